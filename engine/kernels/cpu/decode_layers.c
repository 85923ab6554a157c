/* A float32 or bfloat16 Llama decoder stack's decode pass as one C call: every layer's RMSNorm,
 * fused QKV GEMM, rotary embedding, paged KV write, paged decode attention, output GEMM, residual
 * add, RMSNorm, fused gate/up GEMM, SiLU x up, down GEMM and residual add, for all layers in turn.
 *
 * It computes nothing of its own but the residual adds: each step calls the kernel the eager
 * forward calls (engine/model/llama.py), through a function pointer taken from that kernel's
 * library (elementwise.c, fp32_linear.c, paged_decode_attention.c), with the same arguments, so
 * the result is the eager forward's bit for bit. What goes is the Python between the kernels:
 * ~14 calls per layer, each through the module tree, a ctypes call and a new tensor, while the
 * OpenMP team's other thread waits for the next parallel region. On a 2-core AMD EPYC (Zen 4),
 * perf put that other thread in libgomp's wait for 34 % of a batch-16 decode pass.
 *
 * bfloat16 (decode_layers_bf16): the same steps on the kernels' bfloat16 entry points, with the
 * eager forward's conversions in between: the query widened to float32 for the attention (exact),
 * its output and each residual sum rounded to bfloat16 as torch rounds (nearest even), so the
 * result is again the eager forward's bit for bit.
 *
 * Reference: the eager forward (engine/model/llama.py LlamaModel.forward), which runs wherever
 * this does not (prefill, a GEMM on another backend, another dtype, tensor parallelism); the
 * wrapper is engine/kernels/cpu_decode_layers.py, the test tests/unit/engine/kernels/test_cpu_decode_layers.py.
 */
#include <stdint.h>
#include <string.h>

typedef void (*rms_norm_fn)(const float *x, const float *w, float *out, int64_t M, int64_t D, float eps,
                            int num_threads);
typedef int (*linear_fn)(const float *x, const float *packed, const float *bias, float *y, int64_t M, int64_t N,
                         int64_t K, int num_threads);
typedef void (*rotary_fn)(float *x, const float *cos_t, const float *sin_t, int64_t T, int64_t H, int64_t D,
                          int64_t token_stride, int num_threads);
typedef int64_t (*kv_write_fn)(const char *key, int64_t key_stride, const char *value, int64_t value_stride,
                               char *k_cache, char *v_cache, const int64_t *slots, int64_t num_tokens,
                               int64_t row_bytes, int64_t num_slots);
typedef void (*attention_fn)(const float *query, const float *k_cache, const float *v_cache,
                             const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens, float *out,
                             int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                             int num_threads);
typedef void (*silu_mul_fn)(const float *gate_up, float *out, int64_t M, int64_t I, int num_threads);

/* fns[]: the kernels, in this order. */
enum { FN_RMS_NORM, FN_ROTARY, FN_KV_WRITE, FN_ATTENTION, FN_SILU_MUL, FN_LINEAR, FN_LINEAR_STREAM, NUM_FNS };
/* layers[l * LAYER_FIELDS + i]: layer l's pointers and the schedule of each GEMM (0: fp32_linear,
 * 1: fp32_linear_stream), in this order. */
enum {
    L_INPUT_NORM, L_QKV, L_QKV_BIAS, L_O, L_O_BIAS, L_POST_NORM, L_GATE_UP, L_GATE_UP_BIAS, L_DOWN, L_DOWN_BIAS,
    L_K_CACHE, L_V_CACHE, L_QKV_STREAM, L_O_STREAM, L_GATE_UP_STREAM, L_DOWN_STREAM, LAYER_FIELDS
};
int decode_layers_fields(void) { return LAYER_FIELDS; }
int decode_layers_fns(void) { return NUM_FNS; }

/* The next n bytes of scratch at *p, on a 64-byte boundary (the kernels' vector loads see buffers
 * aligned as torch's allocations are). */
#define SCRATCH_BUFFERS 8
static inline void *carve(char **p, int64_t n)
{
    char *at = (char *)(((uintptr_t)*p + 63) & ~(uintptr_t)63);
    *p = at + n;
    return at;
}

/* Bytes of scratch decode_layers_f32 (bf16 0) or decode_layers_bf16 (bf16 1) needs for M tokens. */
int64_t decode_layers_scratch(int64_t M, int64_t D, int64_t H, int64_t KV, int64_t head_dim, int64_t I, int bf16)
{
    const int64_t qkv = (H + 2 * KV) * head_dim, element = bf16 ? 2 : 4;
    return element * M * (D + qkv + H * head_dim + D + 2 * I + I) + 4 * M * 2 * H * head_dim + 64 * SCRATCH_BUFFERS;
}

static inline void add_rows(float *h, const float *t, int64_t n)
{
    for (int64_t i = 0; i < n; ++i) h[i] += t[i];
}

/* hidden [M, D] (float32, one decode token per sequence) -> the last layer's output, in place.
 * cos_t / sin_t [M, head_dim]: the tokens' rotary tables; slots [M]: each token's KV slot;
 * block_tables [M, table_stride] and seq_lens [M] (int64): each sequence's blocks and length
 * with this token; scratch: decode_layers_scratch bytes. Returns 0; -1 when a GEMM could not
 * allocate its scratch; 1 + the layer index when a slot lies outside the cache (its rows are not
 * written; hidden is then partly updated). */
int decode_layers_f32(const int64_t *fns, const int64_t *layers, int num_layers, float *hidden, const float *cos_t,
                      const float *sin_t, const int64_t *slots, const int64_t *block_tables, int64_t table_stride,
                      const int64_t *seq_lens, void *scratch, int64_t M, int64_t D, int H, int KV, int head_dim,
                      int64_t I, float eps, int block_size, int64_t num_slots, float scale, int num_threads)
{
    const rms_norm_fn rms_norm = (rms_norm_fn)(intptr_t)fns[FN_RMS_NORM];
    const rotary_fn rotary = (rotary_fn)(intptr_t)fns[FN_ROTARY];
    const kv_write_fn kv_write = (kv_write_fn)(intptr_t)fns[FN_KV_WRITE];
    const attention_fn attention = (attention_fn)(intptr_t)fns[FN_ATTENTION];
    const silu_mul_fn silu_mul = (silu_mul_fn)(intptr_t)fns[FN_SILU_MUL];
    const linear_fn linears[2] = {(linear_fn)(intptr_t)fns[FN_LINEAR], (linear_fn)(intptr_t)fns[FN_LINEAR_STREAM]};
    const int64_t q_size = (int64_t)H * head_dim, kv_size = (int64_t)KV * head_dim;
    const int64_t n_qkv = q_size + 2 * kv_size;
    char *p = scratch;
    float *xn = carve(&p, 4 * M * D), *qkv = carve(&p, 4 * M * n_qkv), *q = carve(&p, 4 * M * q_size);
    float *attn = carve(&p, 4 * M * q_size), *t = carve(&p, 4 * M * D), *gate_up = carve(&p, 4 * M * 2 * I);
    float *act = carve(&p, 4 * M * I);
#define PTR(l, field) ((const float *)(intptr_t)(l)[field])
#define GEMM(l, field, bias, x, y, N, K) linears[(l)[field##_STREAM] != 0](x, PTR(l, field), PTR(l, bias), y, M, N, K, num_threads)
    for (int i = 0; i < num_layers; ++i) {
        const int64_t *l = layers + (int64_t)i * LAYER_FIELDS;
        rms_norm(hidden, PTR(l, L_INPUT_NORM), xn, M, D, eps, num_threads);
        if (GEMM(l, L_QKV, L_QKV_BIAS, xn, qkv, n_qkv, D)) return -1;
        rotary(qkv, cos_t, sin_t, M, H + KV, head_dim, n_qkv, num_threads); /* Q and K, adjacent */
        if (kv_write((const char *)(qkv + q_size), n_qkv * (int64_t)sizeof(float),
                     (const char *)(qkv + q_size + kv_size), n_qkv * (int64_t)sizeof(float),
                     (char *)(intptr_t)l[L_K_CACHE], (char *)(intptr_t)l[L_V_CACHE], slots, M,
                     kv_size * (int64_t)sizeof(float), num_slots))
            return 1 + i;
        for (int64_t m = 0; m < M; ++m) memcpy(q + m * q_size, qkv + m * n_qkv, sizeof(float) * (size_t)q_size);
        attention(q, PTR(l, L_K_CACHE), PTR(l, L_V_CACHE), block_tables, table_stride, seq_lens, attn, (int)M, H, KV,
                  head_dim, block_size, scale, num_threads);
        if (GEMM(l, L_O, L_O_BIAS, attn, t, D, q_size)) return -1;
        add_rows(hidden, t, M * D);
        rms_norm(hidden, PTR(l, L_POST_NORM), xn, M, D, eps, num_threads);
        if (GEMM(l, L_GATE_UP, L_GATE_UP_BIAS, xn, gate_up, 2 * I, D)) return -1;
        silu_mul(gate_up, act, M, I, num_threads);
        if (GEMM(l, L_DOWN, L_DOWN_BIAS, act, t, D, I)) return -1;
        add_rows(hidden, t, M * D);
    }
#undef GEMM
#undef PTR
    return 0;
}

typedef void (*rms_norm_bf16_fn)(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t M, int64_t D, float eps,
                                 int num_threads);
typedef int (*linear_bf16_fn)(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y, int64_t M,
                              int64_t N, int64_t K, int num_threads);
typedef void (*rotary_bf16_fn)(uint16_t *x, const uint16_t *cos_t, const uint16_t *sin_t, int64_t T, int64_t H,
                               int64_t D, int64_t token_stride, int num_threads);
typedef void (*attention_bf16_fn)(const float *query, const uint16_t *k_cache, const uint16_t *v_cache,
                                  const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,
                                  float *out, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                                  int block_size, float scale, int num_threads);
typedef void (*silu_mul_bf16_fn)(const uint16_t *gate_up, uint16_t *out, int64_t M, int64_t I, int num_threads);

static inline float bf16_to_f32(uint16_t h)
{
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
/* torch's float -> bfloat16: nearest even, NaN to a quiet NaN. */
static inline uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline void add_rows_bf16(uint16_t *h, const uint16_t *t, int64_t n)
{
    for (int64_t i = 0; i < n; ++i) h[i] = f32_to_bf16(bf16_to_f32(h[i]) + bf16_to_f32(t[i]));
}

/* decode_layers_f32 in bfloat16: hidden, cos_t, sin_t, the weights and the caches bfloat16 (as
 * uint16 bits), the GEMMs all bf16_linear (the *_STREAM fields ignored); scratch holds
 * decode_layers_scratch(..., 1) bytes. Same returns. */
int decode_layers_bf16(const int64_t *fns, const int64_t *layers, int num_layers, uint16_t *hidden,
                       const uint16_t *cos_t, const uint16_t *sin_t, const int64_t *slots, const int64_t *block_tables,
                       int64_t table_stride, const int64_t *seq_lens, void *scratch, int64_t M, int64_t D, int H,
                       int KV, int head_dim, int64_t I, float eps, int block_size, int64_t num_slots, float scale,
                       int num_threads)
{
    const rms_norm_bf16_fn rms_norm = (rms_norm_bf16_fn)(intptr_t)fns[FN_RMS_NORM];
    const rotary_bf16_fn rotary = (rotary_bf16_fn)(intptr_t)fns[FN_ROTARY];
    const kv_write_fn kv_write = (kv_write_fn)(intptr_t)fns[FN_KV_WRITE];
    const attention_bf16_fn attention = (attention_bf16_fn)(intptr_t)fns[FN_ATTENTION];
    const silu_mul_bf16_fn silu_mul = (silu_mul_bf16_fn)(intptr_t)fns[FN_SILU_MUL];
    const linear_bf16_fn linear = (linear_bf16_fn)(intptr_t)fns[FN_LINEAR];
    const int64_t q_size = (int64_t)H * head_dim, kv_size = (int64_t)KV * head_dim;
    const int64_t n_qkv = q_size + 2 * kv_size;
    char *p = scratch;
    float *q = carve(&p, 4 * M * q_size), *attn_f = carve(&p, 4 * M * q_size);
    uint16_t *xn = carve(&p, 2 * M * D), *qkv = carve(&p, 2 * M * n_qkv), *attn = carve(&p, 2 * M * q_size);
    uint16_t *t = carve(&p, 2 * M * D), *gate_up = carve(&p, 2 * M * 2 * I), *act = carve(&p, 2 * M * I);
#define PTR(l, field) ((const uint16_t *)(intptr_t)(l)[field])
    for (int i = 0; i < num_layers; ++i) {
        const int64_t *l = layers + (int64_t)i * LAYER_FIELDS;
        rms_norm(hidden, PTR(l, L_INPUT_NORM), xn, M, D, eps, num_threads);
        if (linear(xn, PTR(l, L_QKV), PTR(l, L_QKV_BIAS), qkv, M, n_qkv, D, num_threads)) return -1;
        rotary(qkv, cos_t, sin_t, M, H + KV, head_dim, n_qkv, num_threads);
        if (kv_write((const char *)(qkv + q_size), n_qkv * 2, (const char *)(qkv + q_size + kv_size), n_qkv * 2,
                     (char *)(intptr_t)l[L_K_CACHE], (char *)(intptr_t)l[L_V_CACHE], slots, M, kv_size * 2,
                     num_slots))
            return 1 + i;
        for (int64_t m = 0; m < M; ++m)
            for (int64_t j = 0; j < q_size; ++j) q[m * q_size + j] = bf16_to_f32(qkv[m * n_qkv + j]);
        attention(q, PTR(l, L_K_CACHE), PTR(l, L_V_CACHE), block_tables, table_stride, seq_lens, attn_f, (int)M, H,
                  KV, head_dim, block_size, scale, num_threads);
        for (int64_t j = 0; j < M * q_size; ++j) attn[j] = f32_to_bf16(attn_f[j]);
        if (linear(attn, PTR(l, L_O), PTR(l, L_O_BIAS), t, M, D, q_size, num_threads)) return -1;
        add_rows_bf16(hidden, t, M * D);
        rms_norm(hidden, PTR(l, L_POST_NORM), xn, M, D, eps, num_threads);
        if (linear(xn, PTR(l, L_GATE_UP), PTR(l, L_GATE_UP_BIAS), gate_up, M, 2 * I, D, num_threads)) return -1;
        silu_mul(gate_up, act, M, I, num_threads);
        if (linear(act, PTR(l, L_DOWN), PTR(l, L_DOWN_BIAS), t, M, D, I, num_threads)) return -1;
        add_rows_bf16(hidden, t, M * D);
    }
#undef PTR
    return 0;
}
