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
 * Layout (docs/design.md §4): one layer's K (or V) cache is [num_blocks, block_size,
 * num_kv_heads, head_dim], contiguous; token p of a sequence lives in block
 * block_table[p / block_size], row p % block_size.
 *
 * Work split: one unit per (sequence, KV head), so that one sequence's heads spread over the
 * threads too. A unit serves the KV head's group of query heads (GQA: query head h reads KV head
 * h / (num_heads / num_kv_heads)): each K row is read once for the whole group. Two passes over
 * the context: scores (q . k, scaled) and their softmax (a vector exp), then the weighted sum of
 * V rows for up to ACC_VECS / NV query heads at once, each V row read once per such chunk. With
 * head_dim a multiple of VEC (64 and 128 specialised) the rows go through vectors whose
 * accumulators stay in registers; other head sizes take scalar loops.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* bfloat16 -> float32: the bfloat16 bits are the float32's upper half. */
static inline float bf16_to_f32(uint16_t x)
{
    union { uint32_t u; float f; } v = { (uint32_t)x << 16 };
    return v.f;
}
#define LOAD_F32(p, d) ((p)[d])
#define LOAD_BF16(p, d) bf16_to_f32((p)[d])

/* Vectors of VEC floats (GCC/Clang vector extensions): the compiler maps them onto the widest
 * registers -march=native offers (one AVX-512 register, two AVX2 ones, ...). Rows whose head_dim
 * is a multiple of VEC take the vector path; others the scalar loops. */
#define VEC 16
typedef float vec_f __attribute__((vector_size(VEC * sizeof(float))));
typedef uint16_t vec_u16 __attribute__((vector_size(VEC * sizeof(uint16_t))));
typedef uint32_t vec_u32 __attribute__((vector_size(VEC * sizeof(uint32_t))));

static inline vec_f vload_f32(const float *p)
{
    vec_f v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}
static inline vec_f vload_bf16(const uint16_t *p)
{
    vec_u16 h;
    __builtin_memcpy(&h, p, sizeof h);
    vec_u32 w = __builtin_convertvector(h, vec_u32) << 16;
    vec_f v;
    __builtin_memcpy(&v, &w, sizeof v);
    return v;
}
/* Vector accumulators of one unit's weighted sum of V rows (half the 32 AVX-512 registers), and
 * the most vectors in one row (head_dim 128). Fixed sizes, not [NV]: GCC keeps a variable-length
 * array on the stack even once NV is a constant, and every access then went through memory. */
#define ACC_VECS 16
#define MAX_NV 8

typedef float vec_f8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vec_f4 __attribute__((vector_size(4 * sizeof(float))));

/* The sum of v's VEC lanes as a tree (halves added pairwise): four dependent vector adds where
 * a lane-by-lane sum is VEC dependent scalar adds, the longest chain of a dot product. */
static inline float vsum(vec_f v)
{
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v); /* in registers; the generic halves below went through the stack */
#else
    vec_f8 lo8, hi8;
    __builtin_memcpy(&lo8, &v, sizeof lo8);
    __builtin_memcpy(&hi8, (const char *)&v + sizeof lo8, sizeof hi8);
    const vec_f8 s8 = lo8 + hi8;
    vec_f4 lo4, hi4;
    __builtin_memcpy(&lo4, &s8, sizeof lo4);
    __builtin_memcpy(&hi4, (const char *)&s8 + sizeof lo4, sizeof hi4);
    const vec_f4 s4 = lo4 + hi4;
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
#endif
}

/* One (sequence, KV head) unit with the vector path: head_dim = NV x VEC, NV a compile-time
 * constant at each call (always inlined), so a row's accumulators stay in registers. Scores of
 * the group's query heads for every context token, their softmax, then per query head the
 * weighted sum of V rows accumulated in registers over the whole context. */
#define DEFINE_UNIT_VECTOR(NAME, KV_T, VLOAD)                                                       \
static inline __attribute__((always_inline)) void NAME(                                             \
    const float *q, const KV_T *k_cache, const KV_T *v_cache, const int64_t *table, int64_t ctx,    \
    int64_t g, int64_t row, int group, int block_size, float scale, float *scores, float *o, int NV) \
{                                                                                                   \
    const int head_dim = NV * VEC;                                                                  \
    for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {                                             \
        const KV_T *kb = k_cache + table[t0 / block_size] * block_size * row + g * head_dim;        \
        const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;                            \
        for (int64_t i = 0; i < n; ++i) {                                                           \
            const KV_T *k = kb + i * row;                                                           \
            vec_f kr[MAX_NV]; /* the K row, read (and widened) once for the whole group */          \
            for (int c = 0; c < NV; ++c) kr[c] = VLOAD(k + c * VEC);                                \
            for (int j = 0; j < group; ++j) {                                                       \
                const float *qj = q + (int64_t)j * head_dim;                                        \
                vec_f a = vload_f32(qj) * kr[0];                                                    \
                for (int c = 1; c < NV; ++c) a += vload_f32(qj + c * VEC) * kr[c];                  \
                scores[(int64_t)j * ctx + t0 + i] = vsum(a) * scale;                                \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
    softmax_rows(scores, group, ctx);                                                               \
    /* Query heads in chunks of ACC_VECS / NV (4 for head_dim 64, 2 for 128): each V row is read    \
     * (and widened) once per chunk, the chunk's output rows accumulate in registers. */            \
    const int chunk = ACC_VECS / NV;                                                                \
    for (int j0 = 0; j0 < group; j0 += chunk) {                                                     \
        const int nj = group - j0 < chunk ? group - j0 : chunk;                                     \
        vec_f acc[ACC_VECS];                                                                        \
        for (int a = 0; a < ACC_VECS; ++a) acc[a] = (vec_f){0};                                     \
        for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {                                          \
            const KV_T *vb = v_cache + table[t0 / block_size] * block_size * row + g * head_dim;    \
            const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;                        \
            for (int64_t i = 0; i < n; ++i) {                                                       \
                const KV_T *v = vb + i * row;                                                       \
                vec_f vr[MAX_NV];                                                                   \
                for (int c = 0; c < NV; ++c) vr[c] = VLOAD(v + c * VEC);                            \
                for (int jj = 0; jj < chunk; ++jj) { /* constant trip count: acc stays in registers */\
                    if (jj >= nj) break;                                                            \
                    const float p = scores[(int64_t)(j0 + jj) * ctx + t0 + i];                      \
                    for (int c = 0; c < NV; ++c) acc[jj * NV + c] += p * vr[c];                     \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int jj = 0; jj < nj; ++jj)                                                             \
            for (int c = 0; c < NV; ++c)                                                            \
                __builtin_memcpy(o + (int64_t)(j0 + jj) * head_dim + c * VEC, &acc[jj * NV + c], sizeof(vec_f));\
    }                                                                                               \
}

typedef int32_t vec_i32 __attribute__((vector_size(VEC * sizeof(int32_t))));

/* exp(x) for x <= 0 on VEC lanes (softmax's shifted scores): Cephes' expf. x = n ln2 + r with
 * |r| <= ln2 / 2 (ln2 split in two for an exact n ln2), exp(r) by its degree-6 minimax
 * polynomial, 2^n built in the exponent bits. At most 1.02 ulp from the correctly rounded exp
 * on [-87, 0] (measured every 1e-6); inputs below -87.3 give exp(-87.3) ~ 1e-38 (nothing a
 * softmax sum notices). The scalar expf call per score was the kernel's largest cost. */
static inline vec_f vexp_nonpositive(vec_f x)
{
    const vec_f lo = (vec_f){0} - 87.3f;
    { /* x = max(x, lo) by a bit select (C's ?: takes no vectors) */
        const vec_i32 below = x < lo;
        vec_i32 xb, lb;
        __builtin_memcpy(&xb, &x, sizeof xb);
        __builtin_memcpy(&lb, &lo, sizeof lb);
        xb = (xb & ~below) | (lb & below);
        __builtin_memcpy(&x, &xb, sizeof x);
    }
    const vec_f t = x * 1.44269504088896341f + 0.5f;
    vec_i32 n = __builtin_convertvector(t, vec_i32); /* truncates toward 0: floor for t < 0 below */
    vec_f nf = __builtin_convertvector(n, vec_f);
    n += (vec_i32)(nf > t); /* a true lane is -1 */
    nf = __builtin_convertvector(n, vec_f);
    const vec_f r = x - nf * 0.693359375f - nf * -2.12194440e-4f;
    vec_f p = (vec_f){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const vec_i32 scale_bits = (n + 127) << 23;
    vec_f two_n;
    __builtin_memcpy(&two_n, &scale_bits, sizeof two_n);
    return p * two_n;
}

/* Softmax over t of each of ``rows`` rows of ``scores`` ([rows, ctx]), in place; VEC scores at
 * a time, the row's tail through a padded vector. */
static void softmax_rows(float *scores, int rows, int64_t ctx)
{
    const int64_t body = ctx - ctx % VEC;
    for (int j = 0; j < rows; ++j) {
        float *sj = scores + (int64_t)j * ctx;
        float m = -INFINITY;
        for (int64_t t = 0; t < ctx; ++t) m = sj[t] > m ? sj[t] : m;
        vec_f sum = (vec_f){0};
        for (int64_t t = 0; t < body; t += VEC) {
            const vec_f e = vexp_nonpositive(vload_f32(sj + t) - m);
            __builtin_memcpy(sj + t, &e, sizeof e);
            sum += e;
        }
        float total = vsum(sum);
        if (body < ctx) {
            float tail[VEC];
            for (int i = 0; i < VEC; ++i) tail[i] = body + i < ctx ? sj[body + i] - m : -INFINITY;
            const vec_f e = vexp_nonpositive(vload_f32(tail));
            for (int64_t t = body; t < ctx; ++t) { sj[t] = e[t - body]; total += sj[t]; }
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t t = 0; t < ctx; ++t) sj[t] *= inv;
    }
}

/* One kernel per K/V element type: KV_T the cache's element, LOAD(row, d) its d-th value as float,
 * UNIT the vector path of one unit (DEFINE_UNIT_VECTOR). */
#define DEFINE_PAGED_DECODE_ATTENTION(NAME, KV_T, LOAD, UNIT)                                        \
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
    const int64_t units = (int64_t)num_seqs * num_kv_heads;                                         \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                       \
    for (int64_t u = 0; u < units; ++u) {                                                           \
        const int64_t s = u / num_kv_heads, g = u % num_kv_heads;                                   \
        const int64_t ctx = seq_lens[s];                                                            \
        const int64_t *table = block_tables + s * table_stride;                                     \
        /* this KV head's group of query heads: [group, head_dim] */                                \
        const float *q = query + (s * num_heads + g * group) * head_dim;                            \
        float *o = out + (s * num_heads + g * group) * head_dim;                                    \
        float *scores = malloc(sizeof(float) * (size_t)group * (size_t)(ctx > 0 ? ctx : 1));        \
        if (head_dim == 4 * VEC) {                                                                  \
            UNIT(q, k_cache, v_cache, table, ctx, g, row, group, block_size, scale, scores, o, 4);  \
        } else if (head_dim == 8 * VEC) {                                                           \
            UNIT(q, k_cache, v_cache, table, ctx, g, row, group, block_size, scale, scores, o, 8);  \
        } else {                                                                                    \
            /* scores[j * ctx + t] = scale * q_j . k_t */                                           \
            for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {                                      \
                const KV_T *kb = k_cache + table[t0 / block_size] * block_size * row + g * head_dim; \
                const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;                    \
                for (int64_t i = 0; i < n; ++i) {                                                   \
                    const KV_T *k = kb + i * row;                                                   \
                    for (int j = 0; j < group; ++j) {                                               \
                        const float *qj = q + (int64_t)j * head_dim;                                \
                        float acc = 0.0f;                                                           \
                        for (int d = 0; d < head_dim; ++d) acc += qj[d] * LOAD(k, d);               \
                        scores[(int64_t)j * ctx + t0 + i] = acc * scale;                            \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
            softmax_rows(scores, group, ctx);                                                       \
            for (int64_t i = 0; i < (int64_t)group * head_dim; ++i) o[i] = 0.0f;                    \
            /* o_j = sum_t p_jt v_t */                                                              \
            for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {                                      \
                const KV_T *vb = v_cache + table[t0 / block_size] * block_size * row + g * head_dim; \
                const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;                    \
                for (int64_t i = 0; i < n; ++i) {                                                   \
                    const KV_T *v = vb + i * row;                                                   \
                    for (int j = 0; j < group; ++j) {                                               \
                        const float p = scores[(int64_t)j * ctx + t0 + i];                          \
                        float *oj = o + (int64_t)j * head_dim;                                      \
                        for (int d = 0; d < head_dim; ++d) oj[d] += p * LOAD(v, d);                 \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        free(scores);                                                                               \
    }                                                                                               \
}

DEFINE_UNIT_VECTOR(unit_vector_f32, float, vload_f32)
DEFINE_UNIT_VECTOR(unit_vector_bf16, uint16_t, vload_bf16)

/* Token p of a sequence lives in block block_table[p / block_size], row p % block_size. */
DEFINE_PAGED_DECODE_ATTENTION(paged_decode_attention_f32, float, LOAD_F32, unit_vector_f32)
DEFINE_PAGED_DECODE_ATTENTION(paged_decode_attention_bf16, uint16_t, LOAD_BF16, unit_vector_bf16)
