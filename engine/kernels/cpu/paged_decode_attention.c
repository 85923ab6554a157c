/* Paged decode attention on the CPU: one query token per sequence, its context read in place from
 * the paged KV cache through the block table (no gathered copy). Four entry points from one body:
 * paged_decode_attention_f32 (float32 K/V), paged_decode_attention_bf16 (bfloat16 K/V, widened
 * to float32 as they are read), paged_decode_attention_i8 and paged_decode_attention_fp8 (8-bit
 * K/V rows with a float32 scale each, engine/kv_cache/kv_quant.py: each row's values widened to
 * float32 as they are read, its scale applied once to its score (K) or its softmax weight (V));
 * the query, the scores, the softmax and the output accumulate in float32 in all of them.
 *
 * Reference: engine/attention.py, TorchAttentionBackend._decode (gather + SDPA); the wrapper and
 * its test live in engine/kernels/cpu_decode_attention.py and
 * tests/unit/engine/kernels/test_cpu_decode_attention_kernel.py.
 *
 * Layout (docs/design.md §4): one layer's K (or V) cache is [num_blocks, block_size,
 * num_kv_heads, head_row], contiguous, head_row = head_dim (float) or head_dim + 4 bytes (8-bit:
 * the values, then the row's float32 scale); token p of a sequence lives in block
 * block_table[p / block_size], row p % block_size.
 *
 * Work split: one unit per (sequence, KV head), so that one sequence's heads spread over the
 * threads too. A unit serves the KV head's group of query heads (GQA: query head h reads KV head
 * h / (num_heads / num_kv_heads)): each K row is read once for the whole group. Two passes over
 * the context: scores (q . k, scaled) and their softmax (a vector exp), then the weighted sum of
 * V rows for up to ACC_VECS / NV query heads at once, each V row read once per such chunk. While
 * the scores pass reads a block, it asks for the next block's K rows and this block's V rows one
 * token at a time (software prefetches: a unit's rows are too scattered for the hardware's), and
 * the same rows of the unit its thread runs next (units go round robin). With
 * head_dim a multiple of VEC (64 and 128 specialised) the rows go through vectors whose
 * accumulators stay in registers; other head sizes take scalar loops.
 *
 * With at least SEQUENCE_UNITS_PER_THREAD sequences per thread (and head_dim 64 or 128) a unit is
 * a whole sequence instead (DEFINE_UNIT_SEQUENCE): its token rows, every KV head's, are read as
 * one contiguous run each, and the scores of VEC tokens are summed over their lanes at once
 * (vsum_lanes) rather than one horizontal sum per score. Measured on a 2-core Intel Xeon (family
 * 6 model 207), 30 layers at batch 16, 165-token contexts from DRAM: 7.8 -> 6.3 ms (float32),
 * 29 % less with the cache hot; in the decode pass (an engine alternating the two kernels pass
 * by pass) float32 -1 to +1 % at 150-400 tokens of context and -3 % at 600, bfloat16, int8 and
 * fp8 K/V -5 % at 400 (docs/engine.md).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* float8 e4m3fn -> float32: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
 * subnormal (m x 2^-9). 0x7f / 0xff (NaN) are never written (kv_write_q8 saturates at 448). */
static inline float fp8_to_f32(uint8_t x)
{
    const int e = (x >> 3) & 15, m = x & 7;
    const float v = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf((float)m, -9);
    return x & 0x80 ? -v : v;
}
/* The row's float32 scale, stored after its head_dim 8-bit values. */
static inline float row_scale(const void *row, int head_dim)
{
    float s;
    memcpy(&s, (const char *)row + head_dim, sizeof s);
    return s;
}
#define LOAD_F32(p, d) ((p)[d])
#define LOAD_BF16(p, d) bf16_to_f32((p)[d])
#define LOAD_I8(p, d) ((float)(p)[d])
#define LOAD_FP8(p, d) fp8_to_f32((p)[d])
/* A head row's scale: 1 for float rows (folded away by the compiler), the stored one for 8-bit. */
#define SCALE_ONE(p, head_dim) 1.0f
#define SCALE_ROW(p, head_dim) row_scale((p), (head_dim))
/* The fp8 vector path's scale: the row's, times what vload_fp8 leaves out (FP8_VEC_SCALE). */
#define SCALE_FP8(p, head_dim) (row_scale((p), (head_dim)) * FP8_VEC_SCALE)

/* Vectors of VEC floats (GCC/Clang vector extensions) as wide as the machine's registers: one
 * AVX-512 register (16 floats) or one AVX2 register (8). Rows whose head_dim is 64 or 128 take the
 * vector path; other head sizes the scalar loops. Multiply-adds are explicit FMAs (GCC at -std=c11
 * does not contract a * b + c). The register budgets below fit the register file: 32 AVX-512
 * registers, 16 AVX2 ones (a vector of 16 floats on AVX2 was two registers, and the accumulators
 * of one chunk of query heads took 32 of them: GCC spilled them to the stack at every token, and
 * the kernel ran 4-6x slower than its memory traffic on an AVX2 EPYC). */
#if defined(__AVX512F__)
#define VEC 16
#define ACC_VECS 16 /* vector accumulators of one chunk's weighted sum of V rows: half the registers */
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VEC 8
#define ACC_VECS 8
#else
#define VEC 8
#define ACC_VECS 8
#endif
#ifndef SEQUENCE_UNITS_PER_THREAD
#define SEQUENCE_UNITS_PER_THREAD 2 /* sequences per thread from which a unit is a whole sequence */
#endif
#define MAX_NV (128 / VEC) /* the most vectors in one row (head_dim 128) */
typedef float vec_f __attribute__((vector_size(VEC * sizeof(float))));
typedef uint16_t vec_u16 __attribute__((vector_size(VEC * sizeof(uint16_t))));
typedef uint32_t vec_u32 __attribute__((vector_size(VEC * sizeof(uint32_t))));
typedef int8_t vec_i8 __attribute__((vector_size(VEC)));
typedef uint8_t vec_u8 __attribute__((vector_size(VEC)));

#include "vec_ops.h"
/* Sign-extended and converted by two instructions (GCC turned the generic vector convert into a
 * scalar vcvtsi2ss per value: int8 K/V decode attention ran 3x slower than fp8's). */
static inline vec_f vload_i8(const int8_t *p)
{
#if defined(__AVX512F__)
    return (vec_f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    return (vec_f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    vec_i8 b;
    __builtin_memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, vec_f);
#endif
}
/* e4m3 -> float32, 2^-8 times too small where the CPU converts half floats (F16C: every AVX2 and
 * AVX-512 CPU). e4m3's byte s.eeee.mmm placed in a float16 as s.0eeee.mmm0000000 is the same
 * number scaled by 2^-8: the exponent's bias is 15 there, 7 here, and a subnormal (eeee = 0) is
 * m x 2^-17 there, m x 2^-9 here. One hardware conversion (vcvtph2ps, exact, no float32 denormal)
 * then widens it: five instructions for a vector where the float32 bit arithmetic below takes
 * twelve. The row's scale carries the 2^8 back (SCALE_FP8). */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
#define FP8_VEC_SCALE 256.0f
static inline vec_f vload_fp8(const uint8_t *p)
{
    /* t = byte << 7 holds the exponent and mantissa in place and the sign at bit 14; t + (t &
     * 0x4000) carries the sign up to bit 15 and clears bit 14. */
#if defined(__AVX512F__)
    const __m256i t = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 7);
    return (vec_f)_mm512_cvtph_ps(_mm256_add_epi16(t, _mm256_and_si256(t, _mm256_set1_epi16(0x4000))));
#else
    const __m128i t = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p)), 7);
    return (vec_f)_mm256_cvtph_ps(_mm_add_epi16(t, _mm_and_si128(t, _mm_set1_epi16(0x4000))));
#endif
}
#else
/* e4m3 -> float32 by bit arithmetic: the exponent re-biased (7 -> 127) and the mantissa moved up;
 * a subnormal (exponent 0) is built as 2^-6 (1 + m/8) and 2^-6 taken off again, exactly, so no
 * float32 denormal is ever formed. */
#define FP8_VEC_SCALE 1.0f
static inline vec_f vload_fp8(const uint8_t *p)
{
    vec_u8 b;
    __builtin_memcpy(&b, p, sizeof b);
    const vec_u32 w = __builtin_convertvector(b, vec_u32);
    const vec_u32 sign = (w & 0x80u) << 24;
    const vec_u32 sub = (vec_u32)((w & 0x78u) == 0); /* all ones where the exponent is 0 */
    const vec_u32 bits = (((w & 0x7fu) << 20) + (120u << 23) + (sub & (1u << 23))) | sign;
    const vec_u32 corr = sub & (0x3c800000u | sign); /* +-2^-6 on subnormal lanes, +0 elsewhere */
    vec_f v, c;
    __builtin_memcpy(&v, &bits, sizeof v);
    __builtin_memcpy(&c, &corr, sizeof c);
    return v - c;
}
#endif
/* Asks for the cache lines of bytes [p, p + bytes) (64-byte lines; an 8-bit head row with its
 * scale may straddle one more line than its length suggests). locality 3 into L1, 2 into L2. */
#define PREFETCH_SPAN(p, bytes, locality)                                                           \
    do {                                                                                            \
        const uintptr_t first_ = (uintptr_t)(p) & ~(uintptr_t)63;                                    \
        const uintptr_t end_ = (uintptr_t)(p) + (uintptr_t)(bytes);                                  \
        for (uintptr_t a_ = first_; a_ < end_; a_ += 64)                                            \
            __builtin_prefetch((const void *)a_, 0, (locality));                                    \
    } while (0)

/* One (sequence, KV head) unit with the vector path: head_dim = NV x VEC, NV a compile-time
 * constant at each call (always inlined), so a row's accumulators stay in registers. Scores of
 * the group's query heads for every context token, their softmax, then per query head the
 * weighted sum of V rows accumulated in registers over the whole context. */
#define DEFINE_UNIT_VECTOR(NAME, KV_T, VLOAD, SCALE_OF)                                             \
static inline __attribute__((always_inline)) void NAME(                                             \
    const float *q, const KV_T *k_cache, const KV_T *v_cache, const int64_t *table, int64_t ctx,    \
    int64_t g, int64_t row, int64_t hrow, int group, int block_size, float scale, float *scores,     \
    float *o, int NV, const int64_t *next_table, int64_t next_ctx, int64_t next_g)                   \
{                                                                                                   \
    const int head_dim = NV * VEC;                                                                  \
    for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {                                             \
        const int64_t offset = table[t0 / block_size] * block_size * row + g * hrow;                \
        const KV_T *kb = k_cache + offset;                                                          \
        const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;                            \
        /* This unit's rows are a third (a 1 / num_kv_heads) of each token's and its blocks sit     \
         * anywhere, so the hardware prefetchers do not run ahead of them. With each token's K row  \
         * (below) the same row of the next block is asked for, into L1, and this token's V row,    \
         * into L2 for the second pass: a steady stream one block ahead that keeps DRAM busy while  \
         * the scores are computed. (Asking for a whole block's rows at once, at its start, issued  \
         * more requests than the core can keep in flight: 15-20 % slower at batch 16, AMD Zen 4.) \
         * The same token's rows of the thread's next unit (next_table, next_ctx, next_g) go to L2  \
         * too (as far as this unit's context reaches; a longer next unit asks for the rest itself):  \
         * that unit then computes from L2 while DRAM serves the one after, where without it        \
         * DRAM idled through each unit's softmax and V pass (~25 % of the kernel at batch 16).     \
         */                                                                                         \
        const KV_T *k_next = t0 + block_size < ctx ?                                                \
            k_cache + table[t0 / block_size + 1] * block_size * row + g * hrow : NULL;              \
        const KV_T *vb = v_cache + offset;                                                          \
        const int64_t hrow_bytes = hrow * (int64_t)sizeof(KV_T);                                    \
        for (int64_t i = 0; i < n; ++i) {                                                           \
            if (k_next != NULL) PREFETCH_SPAN(k_next + i * row, hrow_bytes, 3);                     \
            PREFETCH_SPAN(vb + i * row, hrow_bytes, 2);                                             \
            if (t0 + i < next_ctx) { /* the thread's next unit: its K and V row of this token, into L2 */ \
                const int64_t t = t0 + i;                                                           \
                const int64_t at = (next_table[t / block_size] * block_size + t % block_size) * row + next_g * hrow; \
                PREFETCH_SPAN(k_cache + at, hrow_bytes, 2);                                         \
                PREFETCH_SPAN(v_cache + at, hrow_bytes, 2);                                         \
            }                                                                                       \
            const KV_T *k = kb + i * row;                                                           \
            vec_f kr[MAX_NV]; /* the K row, read (and widened) once for the whole group */          \
            _Pragma("GCC unroll 16") for (int c = 0; c < NV; ++c) kr[c] = VLOAD(k + c * VEC);       \
            const float ks = SCALE_OF(k, head_dim) * scale;                                         \
            for (int j = 0; j < group; ++j) {                                                       \
                const float *qj = q + (int64_t)j * head_dim;                                        \
                /* two chains of multiply-adds: half the dependent FMA latency of one */            \
                vec_f a0 = vload_f32(qj) * kr[0], a1 = vload_f32(qj + VEC) * kr[1];                 \
                _Pragma("GCC unroll 16") for (int c = 2; c < NV; c += 2) {                          \
                    a0 = vfma(vload_f32(qj + c * VEC), kr[c], a0);                                  \
                    a1 = vfma(vload_f32(qj + (c + 1) * VEC), kr[c + 1], a1);                        \
                }                                                                                   \
                scores[(int64_t)j * ctx + t0 + i] = vsum(a0 + a1) * ks;                             \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
    softmax_rows(scores, group, ctx);                                                               \
    /* Query heads in chunks of ACC_VECS / NV (AVX-512: 4 for head_dim 64, 2 for 128; AVX2: 1): each \
     * V row is read (and widened) once per chunk, the chunk's output rows accumulate in registers. */\
    const int chunk = ACC_VECS / NV > 0 ? ACC_VECS / NV : 1;                                        \
    for (int j0 = 0; j0 < group; j0 += chunk) {                                                     \
        const int nj = group - j0 < chunk ? group - j0 : chunk;                                     \
        vec_f acc[ACC_VECS > MAX_NV ? ACC_VECS : MAX_NV];                                           \
        _Pragma("GCC unroll 16") for (int a = 0; a < chunk * NV; ++a) acc[a] = (vec_f){0};          \
        for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {                                          \
            const KV_T *vb = v_cache + table[t0 / block_size] * block_size * row + g * hrow;        \
            const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;                        \
            for (int64_t i = 0; i < n; ++i) {                                                       \
                const KV_T *v = vb + i * row;                                                       \
                const float vs = SCALE_OF(v, head_dim);                                             \
                vec_f p[ACC_VECS]; /* the chunk's weights of this token (x its V scale), broadcast */\
                _Pragma("GCC unroll 16") for (int jj = 0; jj < chunk; ++jj) {                       \
                    if (jj >= nj) break;                                                            \
                    p[jj] = vbroadcast(scores[(int64_t)(j0 + jj) * ctx + t0 + i] * vs);             \
                }                                                                                   \
                /* Each V vector read (and widened) once. Constant trip counts, unrolled in full:   \
                 * acc and p stay in registers. */                                                  \
                _Pragma("GCC unroll 16") for (int c = 0; c < NV; ++c) {                             \
                    const vec_f vc = VLOAD(v + c * VEC);                                            \
                    _Pragma("GCC unroll 16") for (int jj = 0; jj < chunk; ++jj) {                   \
                        if (jj >= nj) break;                                                        \
                        acc[jj * NV + c] = vfma(p[jj], vc, acc[jj * NV + c]);                       \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int jj = 0; jj < nj; ++jj)                                                             \
            for (int c = 0; c < NV; ++c)                                                            \
                __builtin_memcpy(o + (int64_t)(j0 + jj) * head_dim + c * VEC, &acc[jj * NV + c], sizeof(vec_f));\
    }                                                                                               \
}

typedef int32_t vec_i32 __attribute__((vector_size(VEC * sizeof(int32_t))));

/* exp(x) for x <= 0 on VEC lanes, for softmax's shifted scores (the scalar expf call per score
 * was this kernel's largest cost). */
#include "vec_exp.h"

/* Softmax over t of each of ``rows`` rows of ``scores`` ([rows, ctx]), in place; VEC scores at
 * a time, the row's tail through a padded vector. */
static void softmax_rows(float *scores, int rows, int64_t ctx)
{
    const int64_t body = ctx - ctx % VEC;
    for (int j = 0; j < rows; ++j) {
        float *sj = scores + (int64_t)j * ctx;
        float m = -INFINITY;
        if (body > 0) { /* the maximum of the body by vectors (exact in any order), then the tail */
            vec_f mv = vload_f32(sj);
            for (int64_t t = VEC; t < body; t += VEC) mv = vmax(mv, vload_f32(sj + t));
            for (int i = 0; i < VEC; ++i) m = mv[i] > m ? mv[i] : m;
        }
        for (int64_t t = body; t < ctx; ++t) m = sj[t] > m ? sj[t] : m;
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
        const vec_f invv = vbroadcast(inv);
        for (int64_t t = 0; t < body; t += VEC) {
            const vec_f e = vload_f32(sj + t) * invv;
            __builtin_memcpy(sj + t, &e, sizeof e);
        }
        for (int64_t t = body; t < ctx; ++t) sj[t] *= inv;
    }
}


/* One whole sequence, every KV head (large batches): each token's K (and V) row of all the heads
 * is read as one contiguous run, a block's rows one after another, where a (sequence, KV head)
 * unit reads a 1 / num_kv_heads slice of each. With each token's K row the same row of the next
 * block is asked for (into L1) and this token's V row (into L2). Scores as in DEFINE_UNIT_VECTOR,
 * [num_kv_heads x group, ctx]; the weighted sum of V rows block by block, every KV head's chunk of
 * query heads in turn, accumulating in the output rows (o, [num_kv_heads x group, head_dim],
 * zeroed first), so each block's V rows are read from DRAM once and each head's weighted sum
 * keeps DEFINE_UNIT_VECTOR's order (the scores' lane sums take another order: results within a
 * float32 ulp or so of the per-head unit's). */
#define DEFINE_UNIT_SEQUENCE(NAME, KV_T, VLOAD, SCALE_OF)                                           \
static inline __attribute__((always_inline)) void NAME(                                             \
    const float *q, const KV_T *k_cache, const KV_T *v_cache, const int64_t *table, int64_t ctx,    \
    int num_kv_heads, int64_t row, int64_t hrow, int group, int block_size, float scale,            \
    float *scores, float *o, int NV)                                                                \
{                                                                                                   \
    const int head_dim = NV * VEC;                                                                  \
    const int heads = num_kv_heads * group;                                                         \
    const int64_t row_bytes = row * (int64_t)sizeof(KV_T);                                          \
    for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {                                             \
        const int64_t offset = table[t0 / block_size] * block_size * row;                           \
        const KV_T *kb = k_cache + offset, *vb = v_cache + offset;                                  \
        const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;                            \
        const KV_T *k_next = t0 + block_size < ctx ?                                                \
            k_cache + table[t0 / block_size + 1] * block_size * row : NULL;                         \
        for (int64_t i0 = 0; i0 < n; i0 += VEC) {                                                   \
            const int m = n - i0 < VEC ? (int)(n - i0) : VEC;                                       \
            for (int g = 0; g < num_kv_heads; ++g) {                                                \
                float ks[VEC];                                                                      \
                for (int ii = 0; ii < VEC; ++ii)                                                    \
                    ks[ii] = ii < m ? SCALE_OF(kb + (i0 + ii) * row + g * hrow, head_dim) * scale : 0.0f; \
                /* A narrower element (bfloat16, 8-bit) is widened once per token into kf, which  \
                 * the group's query heads then read from L1; float32 rows are read in place. */    \
                const int widen = sizeof(KV_T) != sizeof(float);                                    \
                vec_f kf[widen ? VEC * MAX_NV : 1];                                                 \
                for (int ii = 0; ii < m; ++ii) {                                                    \
                    const int64_t i = i0 + ii;                                                      \
                    if (g == 0) { /* the token's prefetches, one token at a time */                 \
                        if (k_next != NULL) PREFETCH_SPAN(k_next + i * row, row_bytes, 3);          \
                        PREFETCH_SPAN(vb + i * row, row_bytes, 2);                                  \
                    }                                                                               \
                    if (widen) {                                                                    \
                        const KV_T *k = kb + i * row + g * hrow;                                    \
                        _Pragma("GCC unroll 16") for (int c = 0; c < NV; ++c) kf[ii * NV + c] = VLOAD(k + c * VEC); \
                    }                                                                               \
                }                                                                                   \
                for (int j = 0; j < group; ++j) {                                                   \
                    const float *qj = q + (int64_t)(g * group + j) * head_dim;                      \
                    vec_f qr[MAX_NV];                                                               \
                    _Pragma("GCC unroll 16") for (int c = 0; c < NV; ++c) qr[c] = vload_f32(qj + c * VEC); \
                    vec_f a[VEC];                                                                   \
                    _Pragma("GCC unroll 16") for (int ii = 0; ii < VEC; ++ii) {                     \
                        if (ii >= m) { a[ii] = (vec_f){0}; continue; }                              \
                        const KV_T *k = kb + (i0 + ii) * row + g * hrow;                            \
                        vec_f acc = qr[0] * (widen ? kf[ii * NV] : VLOAD(k));                       \
                        _Pragma("GCC unroll 16") for (int c = 1; c < NV; ++c)                       \
                            acc = vfma(qr[c], widen ? kf[ii * NV + c] : VLOAD(k + c * VEC), acc);   \
                        a[ii] = acc;                                                                \
                    }                                                                               \
                    const vec_f sc = vsum_lanes(a) * vload_f32(ks);                                 \
                    float *dst = scores + (int64_t)(g * group + j) * ctx + t0 + i0;                 \
                    if (m == VEC) __builtin_memcpy(dst, &sc, sizeof sc);                            \
                    else for (int ii = 0; ii < m; ++ii) dst[ii] = sc[ii];                           \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
    softmax_rows(scores, heads, ctx);                                                               \
    memset(o, 0, sizeof(float) * (size_t)heads * (size_t)head_dim);                                 \
    const int chunk = ACC_VECS / NV > 0 ? ACC_VECS / NV : 1;                                        \
    for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {                                             \
        const KV_T *vb = v_cache + table[t0 / block_size] * block_size * row;                       \
        const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;                            \
        for (int g = 0; g < num_kv_heads; ++g) {                                                    \
            for (int j0 = 0; j0 < group; j0 += chunk) {                                             \
                const int nj = group - j0 < chunk ? group - j0 : chunk;                             \
                float *oj = o + (int64_t)(g * group + j0) * head_dim;                               \
                const float *sj = scores + (int64_t)(g * group + j0) * ctx + t0;                    \
                vec_f acc[ACC_VECS > MAX_NV ? ACC_VECS : MAX_NV];                                   \
                _Pragma("GCC unroll 16") for (int jj = 0; jj < chunk; ++jj) {                       \
                    if (jj >= nj) break;                                                            \
                    _Pragma("GCC unroll 16") for (int c = 0; c < NV; ++c)                           \
                        acc[jj * NV + c] = vload_f32(oj + jj * head_dim + c * VEC);                 \
                }                                                                                   \
                for (int64_t i = 0; i < n; ++i) {                                                   \
                    const KV_T *v = vb + i * row + g * hrow;                                        \
                    const float vs = SCALE_OF(v, head_dim);                                         \
                    vec_f p[ACC_VECS];                                                              \
                    _Pragma("GCC unroll 16") for (int jj = 0; jj < chunk; ++jj) {                   \
                        if (jj >= nj) break;                                                        \
                        p[jj] = vbroadcast(sj[(int64_t)jj * ctx + i] * vs);                         \
                    }                                                                               \
                    _Pragma("GCC unroll 16") for (int c = 0; c < NV; ++c) {                         \
                        const vec_f vc = VLOAD(v + c * VEC);                                        \
                        _Pragma("GCC unroll 16") for (int jj = 0; jj < chunk; ++jj) {               \
                            if (jj >= nj) break;                                                    \
                            acc[jj * NV + c] = vfma(p[jj], vc, acc[jj * NV + c]);                   \
                        }                                                                           \
                    }                                                                               \
                }                                                                                   \
                _Pragma("GCC unroll 16") for (int jj = 0; jj < chunk; ++jj) {                       \
                    if (jj >= nj) break;                                                            \
                    _Pragma("GCC unroll 16") for (int c = 0; c < NV; ++c)                           \
                        __builtin_memcpy(oj + jj * head_dim + c * VEC, &acc[jj * NV + c], sizeof(vec_f)); \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
}

/* One kernel per K/V element type: KV_T the cache's element, LOAD(row, d) its d-th value as float,
 * SCALE_OF(row, head_dim) the row's scale, EXTRA the elements after a row's values (4 for the
 * scale of an 8-bit row, else 0), UNIT the vector path of one unit (DEFINE_UNIT_VECTOR). */
#define DEFINE_PAGED_DECODE_ATTENTION(NAME, KV_T, LOAD, SCALE_OF, EXTRA, UNIT, SEQUENCE_UNIT, BY_SEQUENCE)                      \
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
    const int64_t hrow = (int64_t)head_dim + (EXTRA); /* elements per (token, head) row */          \
    const int64_t row = (int64_t)num_kv_heads * hrow; /* elements per token in one block */         \
    const int64_t units = (int64_t)num_seqs * num_kv_heads;                                         \
    if (BY_SEQUENCE && (head_dim == 64 || head_dim == 128) && num_seqs >= SEQUENCE_UNITS_PER_THREAD * num_threads) { \
        /* Enough sequences to keep every thread busy: one unit per sequence (DEFINE_UNIT_SEQUENCE). */ \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                   \
        for (int64_t s = 0; s < num_seqs; ++s) {                                                    \
            const int64_t ctx = seq_lens[s];                                                        \
            float *scores = malloc(sizeof(float) * (size_t)num_heads * (size_t)(ctx > 0 ? ctx : 1)); \
            const float *q = query + s * num_heads * head_dim;                                      \
            float *o = out + s * num_heads * head_dim;                                              \
            const int64_t *table = block_tables + s * table_stride;                                 \
            if (head_dim == 64)                                                                     \
                SEQUENCE_UNIT(q, k_cache, v_cache, table, ctx, num_kv_heads, row, hrow, group, block_size, scale, scores, o, 64 / VEC); \
            else                                                                                    \
                SEQUENCE_UNIT(q, k_cache, v_cache, table, ctx, num_kv_heads, row, hrow, group, block_size, scale, scores, o, 128 / VEC); \
            free(scores);                                                                           \
        }                                                                                           \
        return;                                                                                     \
    }                                                                                               \
    /* Round robin (static, 1): thread t runs units t, t + T, t + 2T, ..., so each unit knows the  \
     * thread's next one and streams its rows into L2 while it computes (DEFINE_UNIT_VECTOR). */    \
    _Pragma("omp parallel for schedule(static, 1) num_threads(num_threads)")                        \
    for (int64_t u = 0; u < units; ++u) {                                                           \
        const int64_t s = u / num_kv_heads, g = u % num_kv_heads;                                   \
        const int64_t ctx = seq_lens[s];                                                            \
        const int64_t *table = block_tables + s * table_stride;                                     \
        const int64_t team = omp_get_num_threads(); /* the threads the runtime gave this region */  \
        const int64_t next = u + team < units ? u + team : -1;                                     \
        const int64_t next_s = next < 0 ? 0 : next / num_kv_heads, next_g = next < 0 ? 0 : next % num_kv_heads; \
        const int64_t next_ctx = next < 0 ? 0 : seq_lens[next_s];                                   \
        const int64_t *next_table = block_tables + next_s * table_stride;                           \
        /* this KV head's group of query heads: [group, head_dim] */                                \
        const float *q = query + (s * num_heads + g * group) * head_dim;                            \
        float *o = out + (s * num_heads + g * group) * head_dim;                                    \
        float *scores = malloc(sizeof(float) * (size_t)group * (size_t)(ctx > 0 ? ctx : 1));        \
        if (head_dim == 64) {                                                                       \
            UNIT(q, k_cache, v_cache, table, ctx, g, row, hrow, group, block_size, scale, scores, o, 64 / VEC, next_table, next_ctx, next_g); \
        } else if (head_dim == 128) {                                                               \
            UNIT(q, k_cache, v_cache, table, ctx, g, row, hrow, group, block_size, scale, scores, o, 128 / VEC, next_table, next_ctx, next_g); \
        } else {                                                                                    \
            /* scores[j * ctx + t] = scale * q_j . k_t */                                           \
            for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {                                      \
                const KV_T *kb = k_cache + table[t0 / block_size] * block_size * row + g * hrow;    \
                const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;                    \
                for (int64_t i = 0; i < n; ++i) {                                                   \
                    const KV_T *k = kb + i * row;                                                   \
                    const float ks = SCALE_OF(k, head_dim) * scale;                                 \
                    for (int j = 0; j < group; ++j) {                                               \
                        const float *qj = q + (int64_t)j * head_dim;                                \
                        float acc = 0.0f;                                                           \
                        for (int d = 0; d < head_dim; ++d) acc += qj[d] * LOAD(k, d);               \
                        scores[(int64_t)j * ctx + t0 + i] = acc * ks;                               \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
            softmax_rows(scores, group, ctx);                                                       \
            for (int64_t i = 0; i < (int64_t)group * head_dim; ++i) o[i] = 0.0f;                    \
            /* o_j = sum_t p_jt v_t */                                                              \
            for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {                                      \
                const KV_T *vb = v_cache + table[t0 / block_size] * block_size * row + g * hrow;    \
                const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;                    \
                for (int64_t i = 0; i < n; ++i) {                                                   \
                    const KV_T *v = vb + i * row;                                                   \
                    const float vs = SCALE_OF(v, head_dim);                                         \
                    for (int j = 0; j < group; ++j) {                                               \
                        const float p = scores[(int64_t)j * ctx + t0 + i] * vs;                     \
                        float *oj = o + (int64_t)j * head_dim;                                      \
                        for (int d = 0; d < head_dim; ++d) oj[d] += p * LOAD(v, d);                 \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        free(scores);                                                                               \
    }                                                                                               \
}

DEFINE_UNIT_VECTOR(unit_vector_f32, float, vload_f32, SCALE_ONE)
DEFINE_UNIT_VECTOR(unit_vector_bf16, uint16_t, vload_bf16, SCALE_ONE)
DEFINE_UNIT_VECTOR(unit_vector_i8, int8_t, vload_i8, SCALE_ROW)
DEFINE_UNIT_VECTOR(unit_vector_fp8, uint8_t, vload_fp8, SCALE_FP8)
DEFINE_UNIT_SEQUENCE(unit_sequence_f32, float, vload_f32, SCALE_ONE)
DEFINE_UNIT_SEQUENCE(unit_sequence_bf16, uint16_t, vload_bf16, SCALE_ONE)
DEFINE_UNIT_SEQUENCE(unit_sequence_i8, int8_t, vload_i8, SCALE_ROW)
DEFINE_UNIT_SEQUENCE(unit_sequence_fp8, uint8_t, vload_fp8, SCALE_FP8)

/* Token p of a sequence lives in block block_table[p / block_size], row p % block_size. */
DEFINE_PAGED_DECODE_ATTENTION(paged_decode_attention_f32, float, LOAD_F32, SCALE_ONE, 0, unit_vector_f32, unit_sequence_f32, 1)
DEFINE_PAGED_DECODE_ATTENTION(paged_decode_attention_bf16, uint16_t, LOAD_BF16, SCALE_ONE, 0, unit_vector_bf16, unit_sequence_bf16, 1)
DEFINE_PAGED_DECODE_ATTENTION(paged_decode_attention_i8, int8_t, LOAD_I8, SCALE_ROW, 4, unit_vector_i8, unit_sequence_i8, 1)
DEFINE_PAGED_DECODE_ATTENTION(paged_decode_attention_fp8, uint8_t, LOAD_FP8, SCALE_ROW, 4, unit_vector_fp8, unit_sequence_fp8, 1)

/* Writes a step's new K and V rows into the paged cache: token t's row (num_kv_heads x head_dim
 * values, row_bytes bytes, at key + t * key_stride bytes) goes to slot slots[t] of the layer's K
 * cache (and the same for V), a slot being a block's row (engine.attention.write_kv's index_copy_
 * as one call: the two index_copy_ per layer cost 20-35 µs each at decode's few rows). Any element
 * type: rows are copied as bytes. Returns the number of slots outside [0, num_slots) (those rows
 * are not written). */
int64_t paged_kv_write(const char *key, int64_t key_stride, const char *value, int64_t value_stride,
                       char *k_cache, char *v_cache, const int64_t *slots, int64_t num_tokens,
                       int64_t row_bytes, int64_t num_slots)
{
    int64_t bad = 0;
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t s = slots[t];
        if (s < 0 || s >= num_slots) { ++bad; continue; }
        __builtin_memcpy(k_cache + s * row_bytes, key + t * key_stride, (size_t)row_bytes);
        __builtin_memcpy(v_cache + s * row_bytes, value + t * value_stride, (size_t)row_bytes);
    }
    return bad;
}

/* float32 -> float8 e4m3fn, |x| <= 448 and finite: round to nearest, ties to even, as torch's
 * conversion. Below 2^-6 the result is subnormal: m x 2^-9, m = round(|x| x 2^9) (exact scaling;
 * m = 8 is the smallest normal's bits). Above, the float32 mantissa rounded at its bit 20 and the
 * exponent re-biased from 127 to 7. */
static inline uint8_t f32_to_fp8(float x)
{
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    const uint8_t sign = (uint8_t)((b >> 24) & 0x80);
    b &= 0x7fffffffu;
    float ax;
    memcpy(&ax, &b, sizeof ax);
    if (ax < 0.015625f) return sign | (uint8_t)nearbyintf(ax * 512.0f);
    b += 0x7ffffu + ((b >> 20) & 1u);
    int v = (int)(b >> 20) - (120 << 3);
    return sign | (uint8_t)(v > 0x7e ? 0x7e : v);
}

/* One (token, head) row of head_dim floats -> head_dim 8-bit values and their float32 scale, as
 * engine/kv_cache/kv_quant.py quantize_rows: scale = max |x| / qmax (1 for an all-zero row),
 * q = x / scale clamped to [-qmax, qmax], rounded to nearest even (int8) or to e4m3 (fp8). */
static inline void quantize_row(const float *x, uint8_t *dst, int head_dim, int fp8)
{
    const float qmax = fp8 ? 448.0f : 127.0f;
    float amax = 0.0f;
    for (int d = 0; d < head_dim; ++d) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
    const float scale = amax > 0.0f ? amax / qmax : 1.0f;
    for (int d = 0; d < head_dim; ++d) {
        float y = x[d] / scale;
        y = y > qmax ? qmax : (y < -qmax ? -qmax : y);
        dst[d] = fp8 ? f32_to_fp8(y) : (uint8_t)(int8_t)nearbyintf(y);
    }
    memcpy(dst + head_dim, &scale, sizeof scale);
}

/* paged_kv_write for an 8-bit cache: token t's float32 K and V rows (num_kv_heads x head_dim,
 * at key + t * key_stride floats, heads contiguous) quantised into slot slots[t] (rows of
 * head_dim + 4 bytes). fp8: 1 for float8 e4m3fn, 0 for int8. Returns the number of slots outside
 * [0, num_slots) (not written). */
int64_t paged_kv_write_q8(const float *key, int64_t key_stride, const float *value, int64_t value_stride,
                          uint8_t *k_cache, uint8_t *v_cache, const int64_t *slots, int64_t num_tokens,
                          int num_kv_heads, int head_dim, int64_t num_slots, int fp8)
{
    const int64_t hrow = (int64_t)head_dim + 4, row = num_kv_heads * hrow;
    int64_t bad = 0;
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t s = slots[t];
        if (s < 0 || s >= num_slots) { ++bad; continue; }
        for (int h = 0; h < num_kv_heads; ++h) {
            quantize_row(key + t * key_stride + (int64_t)h * head_dim, k_cache + s * row + h * hrow, head_dim, fp8);
            quantize_row(value + t * value_stride + (int64_t)h * head_dim, v_cache + s * row + h * hrow, head_dim, fp8);
        }
    }
    return bad;
}

/* The first ctx tokens' K and V rows of one sequence, read through its block table from an 8-bit
 * cache and widened to float32 (value x its row's scale): k_out and v_out are [ctx, num_kv_heads,
 * head_dim] floats. The same numbers as kv_quant.dequantize_rows on the gathered rows (one float32
 * rounding of value x scale; the float16 route's 2^-8 and 2^8 are exact), in one pass where
 * torch's index_select, float8 cast and multiply made three. A chunk of a prompt after cached
 * context, or any chunk on an 8-bit cache, attends over these. fp8: 1 for e4m3fn, 0 for int8. */
void paged_gather_q8(const uint8_t *k_cache, const uint8_t *v_cache, const int64_t *table, int64_t ctx,
                     int block_size, int num_kv_heads, int head_dim, int fp8, float *k_out, float *v_out)
{
    const int64_t hrow = (int64_t)head_dim + 4, row = num_kv_heads * hrow;
    const int vector = head_dim % VEC == 0;
    for (int64_t t = 0; t < ctx; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        for (int plane = 0; plane < 2; ++plane) {
            const uint8_t *src = (plane ? v_cache : k_cache) + slot * row;
            float *dst = (plane ? v_out : k_out) + (t * num_kv_heads) * (int64_t)head_dim;
            for (int h = 0; h < num_kv_heads; ++h, src += hrow, dst += head_dim) {
                const float scale = row_scale(src, head_dim);
                if (vector && fp8) {
                    const vec_f s = vbroadcast(scale * FP8_VEC_SCALE);
                    for (int d = 0; d < head_dim; d += VEC) {
                        const vec_f x = vload_fp8(src + d) * s;
                        __builtin_memcpy(dst + d, &x, sizeof x);
                    }
                } else if (vector) {
                    const vec_f s = vbroadcast(scale);
                    for (int d = 0; d < head_dim; d += VEC) {
                        const vec_f x = vload_i8((const int8_t *)src + d) * s;
                        __builtin_memcpy(dst + d, &x, sizeof x);
                    }
                } else {
                    for (int d = 0; d < head_dim; ++d)
                        dst[d] = (fp8 ? fp8_to_f32(src[d]) : (float)(int8_t)src[d]) * scale;
                }
            }
        }
    }
}
