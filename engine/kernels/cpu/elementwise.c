/* The decoder layer's elementwise steps on the CPU, float32, one call each: RMSNorm, the rotary
 * embedding (in place) and SiLU(gate) x up. In eager torch each is 5-8 small ops (rms_norm alone
 * runs pow, mean, add, rsqrt, mul, mul), 18-50 µs per call on decode's few rows, ~4 ms of a 30-layer
 * decode pass on a 2-core AMD EPYC; here one loop per row.
 *
 * Reference: engine/model/llama.py (RMSNorm, RotaryEmbedding.apply, LlamaMLP: the torch forms,
 * which CUDA, bfloat16 and torch.compile keep); the wrapper lives in
 * engine/kernels/cpu_elementwise.py, the test in tests/unit/engine/kernels/test_cpu_elementwise_kernel.py.
 *
 * Rounding: every product and sum is a separate float32 operation as in torch (GCC at -std=c11
 * does not contract them into FMAs), so the rotary embedding is bitwise torch's; RMSNorm's mean of
 * squares is summed in another order than torch's reduction, and SiLU uses Cephes' vector expf
 * (vec_exp.h; libm's expf in the tail past the last whole vector) where torch uses Sleef's: both
 * within a few float32 ulps of torch.
 *
 * bfloat16 (the *_bf16 entry points, tensors as uint16 bits): each step rounds to bfloat16 where
 * the torch form's bfloat16 ops round (llama.py: RMSNorm normalises in float32, rounds, then
 * multiplies by the bf16 weight and rounds again; the rotary rounds each product and the sum;
 * SiLU rounds, then the product with up rounds), so the rotary is bitwise torch's bfloat16 ops and
 * the others are except where a float32 ulp moves a value across a bfloat16 rounding boundary.
 *
 * Threads: decode steps have a few rows of a few hundred values, where an OpenMP fork costs more
 * than the work: rows are shared out among the threads only past PARALLEL_ELEMENTS values, or
 * SILU_PARALLEL_ELEMENTS for SiLU x up, whose exp and division cost ~40 cycles per vector: a
 * batch-16 decode step's [16, 1536] took 21 us on one thread and 13 us on two (bfloat16 40 and
 * 23; AMD EPYC Zen 4), where the fork costs a few us with the threads warm from the GEMM before.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PARALLEL_ELEMENTS (1 << 16)
#define SILU_PARALLEL_ELEMENTS (1 << 13)

/* SiLU's vector path: VEC floats per GCC/Clang vector (one AVX-512 or AVX2 register). */
#if defined(__AVX512F__)
#define VEC 16
#else
#define VEC 8
#endif
typedef float vec_f __attribute__((vector_size(VEC * sizeof(float))));
typedef int32_t vec_i32 __attribute__((vector_size(VEC * sizeof(int32_t))));
#include "vec_exp.h"

/* mask ? a : b per lane (mask lanes all ones or all zeros; C's ?: takes no vectors). */
static inline vec_f vselect(vec_i32 mask, vec_f a, vec_f b)
{
    vec_i32 ab, bb;
    __builtin_memcpy(&ab, &a, sizeof ab);
    __builtin_memcpy(&bb, &b, sizeof bb);
    ab = (ab & mask) | (bb & ~mask);
    vec_f out;
    __builtin_memcpy(&out, &ab, sizeof out);
    return out;
}
/* silu(g) = g / (1 + exp(-g)) on VEC lanes from exp of a non-positive argument only:
 * e = exp(-|g|), silu = g / (1 + e) for g >= 0 and g e / (1 + e) for g < 0 (the same value;
 * exp(-g) of a negative g would overflow the polynomial's range). Within a few float32 ulps of
 * torch's vectorised form. libm's scalar expf here took a [1600, 3072] prompt chunk's SiLU x up
 * 6 ms in bfloat16, 40 % of the prefill pass on an Intel Xeon. */
static inline vec_f vsilu(vec_f g)
{
    const vec_i32 negative = g < 0.0f;
    const vec_f e = vexp_nonpositive(vselect(negative, g, -g));  /* exp(-|g|) */
    return vselect(negative, g * e, g) / (1.0f + e);
}
static inline vec_f vload(const float *p) { vec_f v; __builtin_memcpy(&v, p, sizeof v); return v; }
typedef uint16_t vec_u16 __attribute__((vector_size(VEC * sizeof(uint16_t))));
typedef uint32_t vec_u32 __attribute__((vector_size(VEC * sizeof(uint32_t))));
/* VEC bfloat16 values -> floats, and back with f32_to_bf16's rounding (nearest even; NaN quiet). */
static inline vec_f vload_bf16(const uint16_t *p)
{
    vec_u16 h;
    __builtin_memcpy(&h, p, sizeof h);
    const vec_u32 w = __builtin_convertvector(h, vec_u32) << 16;
    vec_f f;
    __builtin_memcpy(&f, &w, sizeof f);
    return f;
}
static inline void vstore_bf16(uint16_t *p, vec_f f)
{
    vec_u32 u;
    __builtin_memcpy(&u, &f, sizeof u);
    const vec_u32 nan = (vec_u32)((u & 0x7fffffffu) > 0x7f800000u);
    const vec_u32 bits = (((u >> 16) | 0x40u) & nan) | (((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) & ~nan);
    const vec_u16 h = __builtin_convertvector(bits, vec_u16);
    __builtin_memcpy(p, &h, sizeof h);
}
static inline float silu_scalar(float g) { return g / (1.0f + expf(-g)); }

/* bfloat16 <-> float32: a bf16 value is the upper 16 bits of a float32. */
static inline float bf16_to_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f32_to_bf16(float f) /* round to nearest even; NaN stays a (quiet) NaN */
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
#define BF(v) f32_to_bf16(v)
#define FL(h) bf16_to_f32(h)

/* out[m] = x[m] * w / sqrt(mean(x[m]^2) + eps), rows of D values (HF's LlamaRMSNorm in float32). */
void rms_norm_f32(const float *x, const float *w, float *out, int64_t M, int64_t D, float eps, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M * D > PARALLEL_ELEMENTS)
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * D;
        float *om = out + m * D;
        float s[8] = {0}; /* eight partial sums: the loop vectorises without -ffast-math */
        int64_t d = 0;
        for (; d + 8 <= D; d += 8)
            for (int i = 0; i < 8; i++) s[i] += xm[d + i] * xm[d + i];
        float total = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
        for (; d < D; d++) total += xm[d] * xm[d];
        const float inv = 1.0f / sqrtf(total / (float)D + eps);
        for (d = 0; d < D; d++) om[d] = w[d] * (xm[d] * inv);
    }
}

/* Rotary embedding in place, half-split layout (transformers' rotate_half): for each token t and
 * head h of x ([T, H, D] with token stride x_stride and head stride D),
 *     x1' = x1 * cos1 - x2 * sin1,   x2' = x2 * cos2 + x1 * sin2
 * where x1, x2 are the head's halves and cos / sin ([T, D], contiguous) the token's tables. */
void rotary_f32(float *x, const float *cos_t, const float *sin_t, int64_t T, int64_t H, int64_t D,
                int64_t x_stride, int num_threads)
{
    const int64_t half = D / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (T * H * D > PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_t + t * D, *s = sin_t + t * D;
        for (int64_t h = 0; h < H; h++) {
            float *xh = x + t * x_stride + h * D;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = xh[i], x2 = xh[i + half];
                const float a = x1 * c[i], b = -x2 * s[i];          /* torch: x * cos + cat(-x2, x1) * sin */
                const float e = x2 * c[i + half], f = x1 * s[i + half];
                xh[i] = a + b;
                xh[i + half] = e + f;
            }
        }
    }
}

/* out[m, i] = silu(gate_up[m, i]) * gate_up[m, I + i] for the MLP's fused [M, 2I] projection. */
void silu_mul_f32(const float *gate_up, float *out, int64_t M, int64_t I, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M * I > SILU_PARALLEL_ELEMENTS)
    for (int64_t m = 0; m < M; m++) {
        const float *g = gate_up + m * 2 * I, *u = g + I;
        float *o = out + m * I;
        int64_t i = 0;
        for (; i + VEC <= I; i += VEC) {
            const vec_f v = vsilu(vload(g + i)) * vload(u + i);
            __builtin_memcpy(o + i, &v, sizeof v);
        }
        for (; i < I; i++) o[i] = silu_scalar(g[i]) * u[i];
    }
}

/* bfloat16 RMSNorm (llama.py's bf16 form): out = bf16(w * bf16(x * 1 / sqrt(mean(x^2) + eps))). */
void rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t M, int64_t D, float eps,
                   int num_threads)
{
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M * D > PARALLEL_ELEMENTS)
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *xm = x + m * D;
        uint16_t *om = out + m * D;
        float s[8] = {0};
        int64_t d = 0;
        for (; d + 8 <= D; d += 8)
            for (int i = 0; i < 8; i++) s[i] += FL(xm[d + i]) * FL(xm[d + i]);
        float total = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
        for (; d < D; d++) total += FL(xm[d]) * FL(xm[d]);
        const float inv = 1.0f / sqrtf(total / (float)D + eps);
        for (d = 0; d < D; d++) om[d] = BF(FL(w[d]) * FL(BF(FL(xm[d]) * inv)));
    }
}

/* bfloat16 rotary in place, as rotary_f32 with each product and each sum rounded to bfloat16. */
void rotary_bf16(uint16_t *x, const uint16_t *cos_t, const uint16_t *sin_t, int64_t T, int64_t H, int64_t D,
                 int64_t x_stride, int num_threads)
{
    const int64_t half = D / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (T * H * D > PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *c = cos_t + t * D, *s = sin_t + t * D;
        for (int64_t h = 0; h < H; h++) {
            uint16_t *xh = x + t * x_stride + h * D;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = FL(xh[i]), x2 = FL(xh[i + half]);
                const float a = FL(BF(x1 * FL(c[i]))), b = FL(BF(-x2 * FL(s[i])));
                const float e = FL(BF(x2 * FL(c[i + half]))), f = FL(BF(x1 * FL(s[i + half])));
                xh[i] = BF(a + b);
                xh[i + half] = BF(e + f);
            }
        }
    }
}

/* bfloat16 SiLU(gate) x up: out = bf16(bf16(silu(g)) * u). */
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t M, int64_t I, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M * I > SILU_PARALLEL_ELEMENTS)
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *g = gate_up + m * 2 * I, *u = g + I;
        uint16_t *o = out + m * I;
        int64_t i = 0;
        for (; i + VEC <= I; i += VEC) {
            uint16_t silu[VEC];
            vstore_bf16(silu, vsilu(vload_bf16(g + i)));
            vstore_bf16(o + i, vload_bf16(silu) * vload_bf16(u + i));
        }
        for (; i < I; i++) o[i] = BF(FL(BF(silu_scalar(FL(g[i])))) * FL(u[i]));
    }
}

/* Greedy sampling's argmax, as torch.argmax(x, -1): out[m] is the index of the largest value of
 * row m of x [M, N] float32, the first one where several are equal, the first NaN where the row
 * has one (torch counts NaN as the largest). torch's CPU argmax measured 0.5-1 ms on a decode
 * step's [16, 49152] logits (1-2 % of the pass); here one vector pass keeping each lane's maximum
 * and its first place, rows shared out among the threads. */
static int64_t argmax_row(const float *row, int64_t N)
{
    float best = row[0];
    int64_t k = 0, index = 0;
    if (N >= VEC) {
        /* Per lane: its largest value and where it first stands (strictly greater replaces). */
        vec_f vmax = vload(row);
        vec_i32 lane, at;
        for (int j = 0; j < VEC; j++) lane[j] = j;
        at = lane;
        vec_i32 unordered = vmax != vmax;
        for (k = VEC; k + VEC <= N; k += VEC) {
            const vec_f v = vload(row + k);
            const vec_i32 greater = v > vmax;
            unordered |= v != v;
            vmax = vselect(greater, v, vmax);
            at = (at & ~greater) | ((lane + (int32_t)k) & greater);
        }
        int32_t any_nan = 0;
        for (int j = 0; j < VEC; j++) any_nan |= unordered[j];
        if (any_nan) k = 0;  /* the scalar loop below finds the first NaN */
        else
            for (int j = 0; j < VEC; j++)  /* the largest over the lanes, the first place of it */
                if (vmax[j] > best || (vmax[j] == best && at[j] < index)) { best = vmax[j]; index = at[j]; }
    }
    for (; k < N; k++) {  /* the tail, or every value of a row with a NaN */
        if (row[k] != row[k]) return k;
        if (row[k] > best) { best = row[k]; index = k; }
    }
    return index;
}

void argmax_rows_f32(const float *x, int64_t *out, int64_t M, int64_t N, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M * N > PARALLEL_ELEMENTS)
    for (int64_t m = 0; m < M; m++) out[m] = argmax_row(x + m * N, N);
}
