/* Paged prefill attention on the CPU: causal attention of a chunk of one sequence's prompt (q_len
 * query tokens, the last q_len of its ctx context tokens) over its K/V read in place from the
 * paged cache through its block table (the chunk's own rows written there first). Entry points
 * for float32 and bfloat16 K/V; the query, scores, softmax and output are float32.
 *
 * Reference: torch's scaled_dot_product_attention (engine/cpu_attention.py, the SDPA path this
 * kernel replaces where it runs); the wrapper and its test live in
 * engine/kernels/cpu_prefill_attention.py and
 * tests/unit/engine/kernels/test_cpu_prefill_attention_kernel.py.
 *
 * Query row i (position ctx - q_len + i) attends context tokens 0 .. ctx - q_len + i. Cache layout
 * as the decode kernel's (paged_decode_attention.c): one layer's K (or V) cache is [num_blocks,
 * block_size, num_kv_heads, head_dim]; token p lives in block table[p / block_size], row
 * p % block_size.
 *
 * Why a kernel: torch's CPU flash attention ran a 97-token chunk of a 9-head, 64-dim model at
 * 27-50 GFLOPS on a 2-core AMD Zen 4 (a tenth to a fifth of the FMA peak): at that size its
 * per-call and per-block work dominate. Here the scores and the weighted sum are register-blocked
 * GEMM tiles (broadcast one query value, multiply-add it into vectors of keys), as a BLAS
 * micro-kernel does:
 *
 * 1. K transposed once per call into a scratch KT [num_kv_heads][head_dim][ctx_pad] (float32), so
 *    that VEC consecutive keys' d-th values are one vector load;
 * 2. units of work = (KV head, block of RB query tokens), dynamic schedule (later tokens see more
 *    keys); a unit's query rows are its tokens x the KV head's group of query heads (GQA), taken
 *    MR at a time: scores S[MR][keys] = Q K^T in MR x 2 vector accumulators, masked past each
 *    row's position, exponentiated in place (vec_exp.h), then O = S V / sum(S) in OR rows x head_dim
 *    accumulators per V row read.
 *
 * head_dim must be a multiple of VEC and at most 128 (the vector path); elsewhere the entry points
 * return -1 and the caller keeps SDPA. -2: no memory for the scratch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VEC 16
#define MR 8        /* query rows per scores tile: 8 x 2 accumulators + 2 K vectors + a broadcast of 32 */
#define ACC_VECS 16 /* accumulators of the O tile: half the registers */
#else
#define VEC 8
#define MR 4        /* AVX2's 16 registers: 4 x 2 accumulators + 2 + 1 */
#define ACC_VECS 8
#endif
#define RB 4         /* query tokens per unit */
#define MAX_HEAD_DIM 128
#define MAX_NV (MAX_HEAD_DIM / VEC)
#define ACC_N (ACC_VECS > MAX_NV ? ACC_VECS : MAX_NV) /* one row of head_dim 128 on AVX2 */
typedef float vec_f __attribute__((vector_size(VEC * sizeof(float))));
typedef int32_t vec_i32 __attribute__((vector_size(VEC * sizeof(int32_t))));
typedef uint16_t vec_u16 __attribute__((vector_size(VEC * sizeof(uint16_t))));
typedef uint32_t vec_u32 __attribute__((vector_size(VEC * sizeof(uint32_t))));

#include "vec_exp.h"

#include "vec_ops.h"

/* exp(s[t] - max) in place for t < n (1 <= n <= len), zeros in s[n .. len) (len a multiple of
 * VEC); returns 1 / their sum, the softmax's normaliser (applied to the weighted sum instead). */
static float softmax_prefix(float *s, int64_t n, int64_t len)
{
    const int64_t body = n - n % VEC;
    vec_f vm = vbroadcast(-INFINITY);
    for (int64_t t = 0; t < body; t += VEC) vm = vmax(vm, vload_f32(s + t));
    float m = -INFINITY;
    for (int i = 0; i < VEC; ++i) m = vm[i] > m ? vm[i] : m;
    for (int64_t t = body; t < n; ++t) m = s[t] > m ? s[t] : m;
    vm = vbroadcast(m);
    vec_f sum = (vec_f){0};
    for (int64_t t = 0; t < body; t += VEC) {
        const vec_f e = vexp_nonpositive(vload_f32(s + t) - vm);
        __builtin_memcpy(s + t, &e, sizeof e);
        sum += e;
    }
    float total = vsum(sum);
    if (body < n) {  /* the tail through one vector; its lanes past n are dropped */
        const vec_f e = vexp_nonpositive(vload_f32(s + body) - vm);
        for (int64_t t = body; t < n; ++t) { s[t] = e[t - body]; total += s[t]; }
    }
    for (int64_t t = n; t < len; ++t) s[t] = 0.0f;
    return 1.0f / total;  /* total >= 1: the largest score gives exp(0) */
}

/* Scores of MT query rows (q[m] their head_dim values, pos[m] their positions) against keys
 * 0 .. nk (nk a multiple of 2 VEC) of one KV head's KT [head_dim][ctx_pad]: s[m][t] = scale q_m . k_t. */
#define DEFINE_SCORES(MT)                                                                          \
static void scores_##MT(const float *const *q, const float *kt, int64_t ctx_pad, int head_dim,     \
                        int64_t nk, float scale, float *s, int64_t s_stride)                       \
{                                                                                                  \
    for (int64_t t0 = 0; t0 < nk; t0 += 2 * VEC) {                                                 \
        vec_f a0[MT], a1[MT];                                                                      \
        _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m) { a0[m] = (vec_f){0}; a1[m] = (vec_f){0}; } \
        for (int d = 0; d < head_dim; ++d) {                                                       \
            const vec_f k0 = vload_f32(kt + d * ctx_pad + t0), k1 = vload_f32(kt + d * ctx_pad + t0 + VEC); \
            _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m) {                                 \
                const vec_f x = vbroadcast(q[m][d]);                                               \
                a0[m] = vfma(x, k0, a0[m]); a1[m] = vfma(x, k1, a1[m]);                            \
            }                                                                                      \
        }                                                                                          \
        const vec_f vs = vbroadcast(scale);                                                        \
        _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m) {                                     \
            const vec_f x0 = a0[m] * vs, x1 = a1[m] * vs;                                          \
            __builtin_memcpy(s + m * s_stride + t0, &x0, sizeof x0);                               \
            __builtin_memcpy(s + m * s_stride + t0 + VEC, &x1, sizeof x1);                         \
        }                                                                                          \
    }                                                                                              \
}
DEFINE_SCORES(1) DEFINE_SCORES(2) DEFINE_SCORES(3) DEFINE_SCORES(4)
#if MR > 4
DEFINE_SCORES(5) DEFINE_SCORES(6) DEFINE_SCORES(7) DEFINE_SCORES(8)
#endif
typedef void (*scores_fn)(const float *const *, const float *, int64_t, int, int64_t, float, float *, int64_t);
#if MR > 4
static const scores_fn SCORES[MR + 1] = {0, scores_1, scores_2, scores_3, scores_4,
                                         scores_5, scores_6, scores_7, scores_8};
#else
static const scores_fn SCORES[MR + 1] = {0, scores_1, scores_2, scores_3, scores_4};
#endif

/* O rows: o[r] = inv[r] sum_t p[r][t] v_t for OT rows of weights p (stride p_stride) over tokens
 * 0 .. n of one KV head, NV vectors per row; V rows read through the block table. */
#define DEFINE_WEIGHTED_SUM(NAME, KV_T, VLOAD)                                                     \
static inline __attribute__((always_inline)) void NAME(                                            \
    const float *p, int64_t p_stride, int OT, int64_t n, const KV_T *v_cache, const int64_t *table,  \
    int block_size, int64_t row, int64_t head_off, const float *inv, float *const *o, int NV)       \
{                                                                                                  \
    vec_f acc[ACC_N];                                                                           \
    _Pragma("GCC unroll 16") for (int a = 0; a < ACC_N; ++a) acc[a] = (vec_f){0};               \
    const KV_T *vb = v_cache;  /* the current block's rows of this head, and row i of it */       \
    int64_t i = 0;                                                                                 \
    for (int64_t t = 0; t < n; ++t) {                                                              \
        if (i == block_size) i = 0;                                                                \
        if (i == 0) vb = v_cache + *table++ * block_size * row + head_off;                          \
        const KV_T *v = vb + i++ * row;                                                            \
        vec_f w[ACC_N];                                                                         \
        _Pragma("GCC unroll 16") for (int r = 0; r < ACC_N; ++r) {                                  \
            if (r >= OT) break;                                                                    \
            w[r] = vbroadcast(p[r * p_stride + t]);                                                \
        }                                                                                          \
        _Pragma("GCC unroll 16") for (int c = 0; c < NV; ++c) {                                    \
            const vec_f vc = VLOAD(v + c * VEC);                                                   \
            _Pragma("GCC unroll 16") for (int r = 0; r < ACC_N; ++r) {                              \
                if (r >= OT || r * NV + c >= ACC_N) break;                                      \
                acc[r * NV + c] = vfma(w[r], vc, acc[r * NV + c]);                                 \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    for (int r = 0; r < OT; ++r)                                                                   \
        for (int c = 0; c < NV; ++c) {                                                             \
            const vec_f x = acc[r * NV + c] * inv[r];                                              \
            __builtin_memcpy(o[r] + c * VEC, &x, sizeof x);                                        \
        }                                                                                          \
}
DEFINE_WEIGHTED_SUM(wsum_f32, float, vload_f32)
DEFINE_WEIGHTED_SUM(wsum_bf16, uint16_t, vload_bf16)

#define LOAD_F32(p, d) ((p)[d])
#define LOAD_BF16(p, d) bf16_to_f32((p)[d])

#define DEFINE_PAGED_PREFILL_ATTENTION(NAME, KV_T, LOAD, WSUM)                                     \
int NAME(                                                                                          \
    const float *query,          /* [q_len, num_heads, head_dim] float32, token stride q_stride */ \
    int64_t q_stride,                                                                              \
    const KV_T *k_cache,         /* [num_blocks, block_size, num_kv_heads, head_dim] */            \
    const KV_T *v_cache,         /* same */                                                        \
    const int64_t *table,        /* the sequence's block table, >= ceil(ctx / block_size) ids */   \
    int64_t q_len, int64_t ctx,                                                                    \
    float *out,                  /* [q_len, num_heads, head_dim] float32, contiguous */            \
    int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int num_threads)   \
{                                                                                                  \
    if (head_dim % VEC || head_dim > MAX_HEAD_DIM || q_len < 1 || ctx < q_len || num_heads % num_kv_heads) \
        return -1;                                                                                 \
    const int group = num_heads / num_kv_heads, nv = head_dim / VEC;                               \
    const int64_t row = (int64_t)num_kv_heads * head_dim; /* elements per token in one block */    \
    const int64_t ctx_pad = (ctx + 2 * VEC - 1) / (2 * VEC) * (2 * VEC);                           \
    const int64_t pos0 = ctx - q_len;                                                              \
    float *kt = malloc(sizeof(float) * (size_t)(num_kv_heads * head_dim * ctx_pad));               \
    if (!kt) return -2;                                                                            \
    const int64_t tiles = (ctx_pad + VEC - 1) / VEC, blocks = (q_len + RB - 1) / RB;               \
    const int64_t units = (int64_t)num_kv_heads * blocks;                                          \
    int failed = 0;                                                                                \
    _Pragma("omp parallel num_threads(num_threads)")                                               \
    {                                                                                              \
        /* 1. KT[g][d][t] = K[t][g][d], zeros past ctx (their scores are masked). */               \
        _Pragma("omp for schedule(static)")                                                        \
        for (int64_t u = 0; u < num_kv_heads * tiles; ++u) {                                       \
            const int64_t g = u / tiles, t0 = (u % tiles) * VEC;                                   \
            float *dst = kt + g * head_dim * ctx_pad + t0;                                         \
            for (int64_t t = t0; t < t0 + VEC; ++t) {                                              \
                if (t >= ctx) { for (int d = 0; d < head_dim; ++d) dst[d * ctx_pad + t - t0] = 0.0f; continue; } \
                const KV_T *k = k_cache + (table[t / block_size] * block_size + t % block_size) * row + g * head_dim; \
                for (int d = 0; d < head_dim; ++d) dst[d * ctx_pad + t - t0] = LOAD(k, d);          \
            }                                                                                      \
        }                                                                                          \
        /* 2. Units: (KV head, RB query tokens) x the head's group of query heads. */              \
        float *s = malloc(sizeof(float) * (size_t)(MR * ctx_pad));                                  \
        if (!s) {                                                                                  \
            _Pragma("omp atomic write")                                                            \
            failed = 1;                                                                            \
        }                                                                                          \
        _Pragma("omp for schedule(dynamic, 1)")                                                    \
        for (int64_t u = 0; u < units; ++u) {                                                      \
            if (!s) continue;                                                                      \
            /* the longest units (the last tokens) first: they end together with the short ones */ \
            const int64_t b = blocks - 1 - u / num_kv_heads, g = u % num_kv_heads;                 \
            const int64_t i0 = b * RB, i1 = i0 + RB < q_len ? i0 + RB : q_len;                     \
            const int rows = (int)(i1 - i0) * group;                                               \
            for (int m0 = 0; m0 < rows; m0 += MR) {                                                \
                const int mt = rows - m0 < MR ? rows - m0 : MR;                                    \
                const float *q[MR];                                                                \
                float *o[MR];                                                                      \
                int64_t n_max = 0;                                                                 \
                for (int m = 0; m < mt; ++m) {  /* row m0 + m: token i0 + (m0 + m) / group, head j */ \
                    const int64_t i = i0 + (m0 + m) / group, h = g * group + (m0 + m) % group;     \
                    q[m] = query + i * q_stride + h * head_dim;                                    \
                    o[m] = out + (i * num_heads + h) * head_dim;                                   \
                    n_max = pos0 + i + 1 > n_max ? pos0 + i + 1 : n_max;                           \
                }                                                                                  \
                const int64_t nk = (n_max + 2 * VEC - 1) / (2 * VEC) * (2 * VEC);                  \
                SCORES[mt](q, kt + g * head_dim * ctx_pad, ctx_pad, head_dim, nk, scale, s, ctx_pad); \
                float inv[MR];                                                                     \
                for (int m = 0; m < mt; ++m) {                                                     \
                    const int64_t i = i0 + (m0 + m) / group;                                       \
                    inv[m] = softmax_prefix(s + m * ctx_pad, pos0 + i + 1, nk);                    \
                }                                                                                  \
                const int ot = ACC_VECS / nv > 0 ? ACC_VECS / nv : 1;                              \
                for (int r0 = 0; r0 < mt; r0 += ot) {                                              \
                    const int rt = mt - r0 < ot ? mt - r0 : ot;                                    \
                    if (nv == 128 / VEC)                                                           \
                        WSUM(s + r0 * ctx_pad, ctx_pad, rt, n_max, v_cache, table, block_size, row, g * head_dim,  \
                             inv + r0, o + r0, 128 / VEC);                                                   \
                    else if (nv == 64 / VEC)                                                       \
                        WSUM(s + r0 * ctx_pad, ctx_pad, rt, n_max, v_cache, table, block_size, row, g * head_dim,  \
                             inv + r0, o + r0, 64 / VEC);                                                   \
                    else                                                                           \
                        WSUM(s + r0 * ctx_pad, ctx_pad, rt, n_max, v_cache, table, block_size, row, g * head_dim,  \
                             inv + r0, o + r0, nv);                                                   \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        free(s);                                                                                   \
    }                                                                                              \
    free(kt);                                                                                      \
    return failed ? -2 : 0;                                                                        \
}

DEFINE_PAGED_PREFILL_ATTENTION(paged_prefill_attention_f32, float, LOAD_F32, wsum_f32)
DEFINE_PAGED_PREFILL_ATTENTION(paged_prefill_attention_bf16, uint16_t, LOAD_BF16, wsum_bf16)
