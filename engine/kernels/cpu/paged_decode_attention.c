/* Paged decode attention on the CPU, float32: one query token per sequence, its context read in
 * place from the paged KV cache through the block table (no gathered copy).
 *
 * Reference: engine/attention.py, TorchAttentionBackend._decode (gather + SDPA); the wrapper and
 * its test live in engine/kernels/cpu_attention_kernel.py and
 * tests/unit/engine/kernels/test_cpu_decode_attention_kernel.py.
 *
 * Layout (DESIGN.md section 4): one layer's K (or V) cache is [num_blocks, block_size,
 * num_kv_heads, head_dim], contiguous; token p of a sequence lives in block
 * block_table[p / block_size], row p % block_size.
 *
 * Work split: one unit per (sequence, KV head); the num_heads / num_kv_heads query heads that
 * share a KV head (GQA) are done together, so each K and V row is read once. Two passes over the
 * context: scores (q . k, scaled), then softmax and the weighted sum of V rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

void paged_decode_attention_f32(
    const float *query,       /* [num_seqs, num_heads, head_dim] */
    const float *k_cache,     /* [num_blocks, block_size, num_kv_heads, head_dim] */
    const float *v_cache,     /* same */
    const int64_t *block_tables, /* [num_seqs, table_stride] */
    int64_t table_stride,
    const int64_t *seq_lens,  /* [num_seqs] */
    float *out,               /* [num_seqs, num_heads, head_dim] */
    int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
    float scale, int num_threads)
{
    const int group = num_heads / num_kv_heads;
    const int64_t row = (int64_t)num_kv_heads * head_dim; /* floats per token in one block */
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)
    for (int s = 0; s < num_seqs; ++s) {
        for (int kh = 0; kh < num_kv_heads; ++kh) {
            const int64_t ctx = seq_lens[s];
            const int64_t *table = block_tables + (int64_t)s * table_stride;
            const float *q = query + ((int64_t)s * num_heads + (int64_t)kh * group) * head_dim;
            float *o = out + ((int64_t)s * num_heads + (int64_t)kh * group) * head_dim;
            float *scores = malloc(sizeof(float) * (size_t)group * (size_t)(ctx > 0 ? ctx : 1));
            /* scores[j * ctx + t] = scale * q_j . k_t */
            for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
                const float *kb = k_cache + table[t0 / block_size] * block_size * row + (int64_t)kh * head_dim;
                const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
                for (int64_t i = 0; i < n; ++i) {
                    const float *k = kb + i * row;
                    for (int j = 0; j < group; ++j) {
                        const float *qj = q + (int64_t)j * head_dim;
                        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                        for (int d = 0; d < head_dim; ++d) acc += qj[d] * k[d];
                        scores[(int64_t)j * ctx + t0 + i] = acc * scale;
                    }
                }
            }
            /* softmax over t, per query head */
            for (int j = 0; j < group; ++j) {
                float *sj = scores + (int64_t)j * ctx;
                float m = -INFINITY;
                for (int64_t t = 0; t < ctx; ++t) m = sj[t] > m ? sj[t] : m;
                float sum = 0.0f;
                for (int64_t t = 0; t < ctx; ++t) { sj[t] = expf(sj[t] - m); sum += sj[t]; }
                const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
                for (int64_t t = 0; t < ctx; ++t) sj[t] *= inv;
                float *oj = o + (int64_t)j * head_dim;
                for (int d = 0; d < head_dim; ++d) oj[d] = 0.0f;
            }
            /* o_j = sum_t p_jt v_t */
            for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
                const float *vb = v_cache + table[t0 / block_size] * block_size * row + (int64_t)kh * head_dim;
                const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
                for (int64_t i = 0; i < n; ++i) {
                    const float *v = vb + i * row;
                    for (int j = 0; j < group; ++j) {
                        const float p = scores[(int64_t)j * ctx + t0 + i];
                        float *oj = o + (int64_t)j * head_dim;
#pragma omp simd
                        for (int d = 0; d < head_dim; ++d) oj[d] += p * v[d];
                    }
                }
            }
            free(scores);
        }
    }
}
