/* Linear layer with int8 weights on the CPU (weight-only quantisation, dequantised in the kernel):
 *
 *     y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] + bias[n]
 *
 * x float32 [M, K], w int8 [N, K] (one symmetric scale per output channel, float32 [N]), y float32
 * [M, N]. Every product and sum is float32 (the int8 weight is widened exactly), so the result is
 * the float32 GEMM of x with the dequantised weight up to the order of the sums.
 *
 * Reference: engine/model/linear.py (F.linear on the dequantised weight, backend "int8_dequant");
 * the wrapper and its test live in engine/kernels/cpu_int8_linear.py and
 * tests/unit/engine/kernels/test_cpu_int8_linear_kernel.py.
 *
 * Work split: the output channels in tiles of NT, tiles shared out among the threads. At M <= 2
 * (decode of one or two sequences: the weight read from DRAM sets the pace) each tile widens its
 * int8 weights into vectors as it reads them, once per pair of rows. Past that it widens the
 * tile's NT weight rows once into a float32 scratch of NT x K (L1/L2-resident for K up to a few
 * thousand) and runs every row of x against it, so the int8 -> float32 conversion is not repeated
 * per row. K that is not a multiple of VEC, and a last partial tile of channels, take scalar loops.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Vectors of VEC floats; with AVX2 + FMA (any x86-64 from 2013 on) the int8 widening and the
 * multiply-adds are explicit intrinsics (GCC at -std=c11 neither vectorises the widening nor
 * contracts a * b + c into an FMA); elsewhere GCC/Clang vector extensions. */
#define VEC 8
typedef float vec_f __attribute__((vector_size(VEC * sizeof(float))));
typedef int32_t vec_i32 __attribute__((vector_size(VEC * sizeof(int32_t))));
typedef int8_t vec_i8 __attribute__((vector_size(VEC)));

static inline vec_f load_x(const float *p) { vec_f v; memcpy(&v, p, sizeof v); return v; }
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static inline vec_f load_w(const int8_t *p)
{
    __m128i b = _mm_loadl_epi64((const __m128i *)p);
    return (vec_f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}
static inline vec_f fma_f(vec_f a, vec_f b, vec_f c) { return (vec_f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#else
static inline vec_f load_w(const int8_t *p)
{
    vec_i8 b; memcpy(&b, p, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(b, vec_i32), vec_f);
}
static inline vec_f fma_f(vec_f a, vec_f b, vec_f c) { return a * b + c; }
#endif
static inline float hsum(vec_f v)
{
    float s = 0.0f;
    for (int i = 0; i < VEC; i++) s += v[i];
    return s;
}

/* Output channels per tile: their four accumulators per input row stay in registers. */
#define NT 4
/* Input rows per tile: 2 x 4 accumulators + 4 weight vectors + 1 input vector fit in 16 AVX2
 * registers (3 rows spill one; measured 3-15 % slower at M = 3-32 on a Zen 3 EPYC). */
#define MAXMT 2

/* out[i][j] for rows m0..m0+MT of x and channels n0..n0+NT of w; K % VEC == 0. */
#define DEFINE_TILE(MT)                                                                            \
static inline void tile_##MT(const float *x, int64_t K, const int8_t *w, float out[][NT])          \
{                                                                                                  \
    vec_f acc[MT][NT];                                                                             \
    for (int i = 0; i < MT; i++) for (int j = 0; j < NT; j++) acc[i][j] = (vec_f){0};              \
    for (int64_t k = 0; k < K; k += VEC) {                                                         \
        vec_f w0 = load_w(w + k), w1 = load_w(w + K + k), w2 = load_w(w + 2 * K + k),              \
              w3 = load_w(w + 3 * K + k);                                                          \
        for (int i = 0; i < MT; i++) {                                                             \
            vec_f xv = load_x(x + i * K + k);                                                      \
            acc[i][0] = fma_f(xv, w0, acc[i][0]); acc[i][1] = fma_f(xv, w1, acc[i][1]); acc[i][2] = fma_f(xv, w2, acc[i][2]); acc[i][3] = fma_f(xv, w3, acc[i][3]); \
        }                                                                                          \
    }                                                                                              \
    for (int i = 0; i < MT; i++) for (int j = 0; j < NT; j++) out[i][j] = hsum(acc[i][j]);         \
}
#define DEFINE_TILE_F(MT)                                                                          \
static inline void tilef_##MT(const float *x, int64_t K, const float *w, float out[][NT])          \
{                                                                                                  \
    vec_f acc[MT][NT];                                                                             \
    for (int i = 0; i < MT; i++) for (int j = 0; j < NT; j++) acc[i][j] = (vec_f){0};              \
    for (int64_t k = 0; k < K; k += VEC) {                                                         \
        vec_f w0 = load_x(w + k), w1 = load_x(w + K + k), w2 = load_x(w + 2 * K + k),              \
              w3 = load_x(w + 3 * K + k);                                                          \
        for (int i = 0; i < MT; i++) {                                                             \
            vec_f xv = load_x(x + i * K + k);                                                      \
            acc[i][0] = fma_f(xv, w0, acc[i][0]); acc[i][1] = fma_f(xv, w1, acc[i][1]);            \
            acc[i][2] = fma_f(xv, w2, acc[i][2]); acc[i][3] = fma_f(xv, w3, acc[i][3]);            \
        }                                                                                          \
    }                                                                                              \
    for (int i = 0; i < MT; i++) for (int j = 0; j < NT; j++) out[i][j] = hsum(acc[i][j]);         \
}
DEFINE_TILE_F(1)
DEFINE_TILE_F(2)
DEFINE_TILE(1)
DEFINE_TILE(2)

static float dot(const float *x, const int8_t *w, int64_t K)
{
    float s = 0.0f;
    for (int64_t k = 0; k < K; k++) s += x[k] * (float)w[k];
    return s;
}

/* y[M, N] = (x[M, K] @ w[N, K]^T) * scale[N] + bias[N] (bias may be NULL); see the top. */
void int8_linear_f32(const float *x, const int8_t *w, const float *scale, const float *bias, float *y,
                     int64_t M, int64_t N, int64_t K, int num_threads)
{
    int64_t num_tiles = N / NT;  /* full tiles; a partial one follows when N % NT != 0 */
    int vector = K % VEC == 0;
    int widen = M > 2 && vector;
#pragma omp parallel num_threads(num_threads)
    {
    float *wf = widen ? malloc(NT * K * sizeof(float)) : NULL;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_tiles + (N % NT != 0); t++) {
        int64_t n0 = t * NT;
        float out[MAXMT][NT];
        if (t == num_tiles || !vector) {   /* ragged tile or K not a multiple of VEC */
            for (int64_t n = n0; n < N && n < n0 + NT; n++)
                for (int64_t m = 0; m < M; m++)
                    y[m * N + n] = dot(x + m * K, w + n * K, K) * scale[n] + (bias ? bias[n] : 0.0f);
            continue;
        }
        if (wf)
            for (int64_t k = 0; k < NT * K; k += VEC) { vec_f v = load_w(w + n0 * K + k); memcpy(wf + k, &v, sizeof v); }
        for (int64_t m0 = 0; m0 < M;) {
            int64_t mt = M - m0 >= MAXMT ? MAXMT : M - m0;
            if (wf) {
                if (mt == 2) tilef_2(x + m0 * K, K, wf, out);
                else tilef_1(x + m0 * K, K, wf, out);
            }
            else if (mt == 2) tile_2(x + m0 * K, K, w + n0 * K, out);
            else tile_1(x + m0 * K, K, w + n0 * K, out);
            for (int i = 0; i < mt; i++)
                for (int j = 0; j < NT; j++)
                    y[(m0 + i) * N + n0 + j] = out[i][j] * scale[n0 + j] + (bias ? bias[n0 + j] : 0.0f);
            m0 += mt;
        }
    }
    free(wf);
    }
}
