/* Paged decode attention on the CPU: one query token per sequence, its context read in place from
 * the paged KV cache through the block table (no gathered copy). Two entry points from one body:
 * paged_decode_attention_f32 (float32 K/V) and paged_decode_attention_bf16 (bfloat16 K/V, widened
 * to float32 as they are read); the query, the scores, the softmax and the output accumulate in
 * float32 in both.
 *
 * Reference: engine/attention.py, TorchAttentionBackend._decode (gather + SDPA); the wrapper and
 * its test live in engine/kernels/cpu_decode_attention.py and
 * tests/unit/engine/kernels/test_cpu_decode_attention_kernel.py.
 *
 * Layout (DESIGN.md section 4): one layer's K (or V) cache is [num_blocks, block_size,
 * num_kv_heads, head_dim], contiguous; token p of a sequence lives in block
 * block_table[p / block_size], row p % block_size.
 *
 * Work split: one unit per sequence. Each token's K (and V) row of every KV head is one
 * contiguous run of num_kv_heads x head_dim floats, read once for all num_heads query heads (GQA:
 * query head h reads KV head h / (num_heads / num_kv_heads)). Two passes over the context:
 * scores (q . k, scaled), then softmax and the weighted sum of V rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* bfloat16 -> float32: the bfloat16 bits are the float32's upper half. */
static inline float bf16_to_f32(uint16_t x)
{
    union { uint32_t u; float f; } v = { (uint32_t)x << 16 };
    return v.f;
}
#define LOAD_F32(p, d) ((p)[d])
#define LOAD_BF16(p, d) bf16_to_f32((p)[d])

/* One kernel per K/V element type: KV_T the cache's element, LOAD(row, d) its d-th value as float. */
#define DEFINE_PAGED_DECODE_ATTENTION(NAME, KV_T, LOAD)                                              \
void NAME(                                                                                          \
    const float *query,          /* [num_seqs, num_heads, head_dim], float32 */                     \
    const KV_T *k_cache,         /* [num_blocks, block_size, num_kv_heads, head_dim] */             \
    const KV_T *v_cache,         /* same */                                                         \
    const int64_t *block_tables, /* [num_seqs, table_stride] */                                     \
    int64_t table_stride,                                                                           \
    const int64_t *seq_lens,     /* [num_seqs] */                                                   \
    float *out,                  /* [num_seqs, num_heads, head_dim], float32 */                     \
    int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,                    \
    float scale, int num_threads)                                                                   \
{                                                                                                   \
    const int group = num_heads / num_kv_heads;                                                     \
    const int64_t row = (int64_t)num_kv_heads * head_dim; /* elements per token in one block */     \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                       \
    for (int s = 0; s < num_seqs; ++s) {                                                            \
        const int64_t ctx = seq_lens[s];                                                            \
        const int64_t *table = block_tables + (int64_t)s * table_stride;                            \
        const float *q = query + (int64_t)s * num_heads * head_dim;                                 \
        float *o = out + (int64_t)s * num_heads * head_dim;                                         \
        float *scores = malloc(sizeof(float) * (size_t)num_heads * (size_t)(ctx > 0 ? ctx : 1));    \
        /* scores[h * ctx + t] = scale * q_h . k_t (KV head h / group) */                           \
        for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {                                          \
            const KV_T *kb = k_cache + table[t0 / block_size] * block_size * row;                   \
            const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;                        \
            for (int64_t i = 0; i < n; ++i) {                                                       \
                for (int h = 0; h < num_heads; ++h) {                                               \
                    const KV_T *k = kb + i * row + (int64_t)(h / group) * head_dim;                 \
                    const float *qh = q + (int64_t)h * head_dim;                                    \
                    float acc = 0.0f;                                                               \
                    _Pragma("omp simd reduction(+ : acc)")                                          \
                    for (int d = 0; d < head_dim; ++d) acc += qh[d] * LOAD(k, d);                   \
                    scores[(int64_t)h * ctx + t0 + i] = acc * scale;                                \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        /* softmax over t, per query head */                                                        \
        for (int h = 0; h < num_heads; ++h) {                                                       \
            float *sh = scores + (int64_t)h * ctx;                                                  \
            float m = -INFINITY;                                                                    \
            for (int64_t t = 0; t < ctx; ++t) m = sh[t] > m ? sh[t] : m;                            \
            float sum = 0.0f;                                                                       \
            for (int64_t t = 0; t < ctx; ++t) { sh[t] = expf(sh[t] - m); sum += sh[t]; }            \
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;                                       \
            for (int64_t t = 0; t < ctx; ++t) sh[t] *= inv;                                         \
        }                                                                                           \
        for (int64_t i = 0; i < (int64_t)num_heads * head_dim; ++i) o[i] = 0.0f;                    \
        /* o_h = sum_t p_ht v_t */                                                                  \
        for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {                                          \
            const KV_T *vb = v_cache + table[t0 / block_size] * block_size * row;                   \
            const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;                        \
            for (int64_t i = 0; i < n; ++i) {                                                       \
                for (int h = 0; h < num_heads; ++h) {                                               \
                    const KV_T *v = vb + i * row + (int64_t)(h / group) * head_dim;                 \
                    const float p = scores[(int64_t)h * ctx + t0 + i];                              \
                    float *oh = o + (int64_t)h * head_dim;                                          \
                    _Pragma("omp simd")                                                             \
                    for (int d = 0; d < head_dim; ++d) oh[d] += p * LOAD(v, d);                     \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        free(scores);                                                                               \
    }                                                                                               \
}

/* Token p of a sequence lives in block block_table[p / block_size], row p % block_size. */
DEFINE_PAGED_DECODE_ATTENTION(paged_decode_attention_f32, float, LOAD_F32)
DEFINE_PAGED_DECODE_ATTENTION(paged_decode_attention_bf16, uint16_t, LOAD_BF16)
