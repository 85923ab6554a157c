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
#include <float.h>
#include <math.h>
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
/* The largest |x| of a row of K floats, or NaN where the row holds a NaN or an infinity: the
 * per-row scale of both activation quantisers below (the VNNI path's int16 rows and
 * int8_split_rows_u8's byte pairs), whose rows then give NaN outputs. */
static float row_absmax(const float *row, int64_t K)
{
    float amax = 0.0f;
    int nonfinite = 0;
    int64_t k = 0;
#if defined(__AVX512F__)
    __m512 vmax = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16) {
        __m512 v = _mm512_loadu_ps(row + k);
        nonfinite |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
    }
    amax = _mm512_reduce_max_ps(vmax);
#endif
    for (; k < K; k++) {
        float a = fabsf(row[k]);
        nonfinite |= a != a;
        amax = a > amax ? a : amax;
    }
    return nonfinite || amax > FLT_MAX ? NAN : amax;
}

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

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* With AVX512-VNNI (AMD Zen 4, Intel Ice Lake / Sapphire Rapids on): VPDPWSSD multiplies pairs of
 * signed 16-bit integers per 32-bit lane and adds both products to an int32 accumulator, 32
 * multiply-adds per instruction (twice an FMA's 16). The int8 weight is packed once in panels of
 * PNR output channels with pairs of k side by side, [ceil(N / PNR)][ceil(K / 2)][PNR][2] (zeros
 * past N and past K), and sign-extended to 16 bits as it is loaded (one VPMOVSXBW per 32
 * weights). Each row of x is quantised to int16 on the fly, symmetric per row:
 *
 *     sx[m] = max_k |x[m, k]| / qmax,   xq[m, k] = round(x[m, k] / sx[m]),
 *     y[m, n] = sum_k xq[m, k] * w[n, k] * sx[m] * scale[n] + bias[n],
 *
 * with qmax = min(32767, (2^31 - 1) / (127 * K')) (K' = K rounded up to even) so that no int32
 * sum can overflow: 32767 up to K = 516, 11010 at K = 1536, 1179 at K = 14336. Each x value's
 * error is at most sx[m] / 2 = max|x[m]| / (2 qmax): 1.5e-5 to 4.5e-5 of the row's largest value at
 * K <= 1536 (bfloat16 activations: 2^-9 = 2e-3 of each value). The weight bytes are a quarter of
 * float32's and half of bfloat16's. Work split, row blocks and prefetch as fp32_linear.c. */
#define PVEC 16              /* int32 lanes per vector */
#define PNR (2 * PVEC)       /* output channels per panel */
#define PMR_MAX 8            /* 8 rows x 2 accumulators + 2 weights + 1 broadcast of 32 registers */

int int8_linear_panel_width(void) { return PNR; }
int int8_linear_pack_pairs(void) { return 1; }    /* k pairs side by side; x rounded to int16 */
int int8_linear_packed_min_rows(void) { return 1; }

/* packed[ceil(N / PNR)][ceil(K / 2)][PNR][2] <- w[N, K]. */
void int8_linear_pack(const int8_t *w, int8_t *packed, int64_t N, int64_t K)
{
    int64_t panels = (N + PNR - 1) / PNR, pairs = (K + 1) / 2;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < pairs; kk++)
            for (int64_t j = 0; j < PNR; j++)
                for (int64_t t = 0; t < 2; t++) {
                    int64_t n = p * PNR + j, k = 2 * kk + t;
                    packed[((p * pairs + kk) * PNR + j) * 2 + t] = n < N && k < K ? w[n * K + k] : 0;
                }
}

/* y[n0 .. n0 + PNR) of one row = acc * (sx * scale) + bias, cut at N for the last panel. */
static inline void store_row_q(float *row, int64_t n0, int64_t N, const float *scale, const float *bias, float sx,
                               __m512i a0, __m512i a1)
{
    float tmp[PNR];
    __m512 f0 = _mm512_cvtepi32_ps(a0), f1 = _mm512_cvtepi32_ps(a1);
    __m512 s = _mm512_set1_ps(sx);
    if (n0 + PNR <= N) {
        f0 = _mm512_mul_ps(f0, _mm512_mul_ps(s, _mm512_loadu_ps(scale + n0)));
        f1 = _mm512_mul_ps(f1, _mm512_mul_ps(s, _mm512_loadu_ps(scale + n0 + PVEC)));
        if (bias) { f0 = _mm512_add_ps(f0, _mm512_loadu_ps(bias + n0)); f1 = _mm512_add_ps(f1, _mm512_loadu_ps(bias + n0 + PVEC)); }
        _mm512_storeu_ps(row + n0, f0); _mm512_storeu_ps(row + n0 + PVEC, f1);
        return;
    }
    _mm512_storeu_ps(tmp, f0); _mm512_storeu_ps(tmp + PVEC, f1);
    for (int64_t j = 0; n0 + j < N; j++) row[n0 + j] = tmp[j] * (sx * scale[n0 + j]) + (bias ? bias[n0 + j] : 0.0f);
}

/* Rows 0..MT of the block against one panel: xp [pairs][MT] (each row's int16 k pair as a 32-bit
 * word), pw the panel [pairs][PNR][2]; rows unrolled so the accumulators stay in registers. */
#define DEFINE_VNNI_KERNEL(MT)                                                                     \
static void vnni_##MT(const uint32_t *xp, int64_t pairs, const int8_t *pw, const float *scale,    \
                      const float *bias, const float *sx, float *y, int64_t N, int64_t n0, const int8_t *next) \
{                                                                                                  \
    __m512i c0[MT], c1[MT];                                                                        \
    _Pragma("GCC unroll 16") for (int i = 0; i < MT; i++) { c0[i] = _mm512_setzero_si512(); c1[i] = _mm512_setzero_si512(); } \
    for (int64_t kk = 0; kk < pairs; kk++) {                                                       \
        __m512i b0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(pw + kk * PNR * 2)));      \
        __m512i b1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(pw + kk * PNR * 2 + 32))); \
        if (next) __builtin_prefetch(next + kk * PNR * 2, 0, 2);                                   \
        _Pragma("GCC unroll 16") for (int i = 0; i < MT; i++) {                                    \
            __m512i a = _mm512_set1_epi32((int)xp[kk * MT + i]);                                   \
            c0[i] = _mm512_dpwssd_epi32(c0[i], a, b0); c1[i] = _mm512_dpwssd_epi32(c1[i], a, b1);  \
        }                                                                                          \
    }                                                                                              \
    _Pragma("GCC unroll 16") for (int i = 0; i < MT; i++)                                          \
        store_row_q(y + i * N, n0, N, scale, bias, sx[i], c0[i], c1[i]);                           \
}
DEFINE_VNNI_KERNEL(1) DEFINE_VNNI_KERNEL(2) DEFINE_VNNI_KERNEL(3) DEFINE_VNNI_KERNEL(4)
DEFINE_VNNI_KERNEL(5) DEFINE_VNNI_KERNEL(6) DEFINE_VNNI_KERNEL(7) DEFINE_VNNI_KERNEL(8)
typedef void (*vnni_fn)(const uint32_t *, int64_t, const int8_t *, const float *, const float *, const float *,
                        float *, int64_t, int64_t, const int8_t *);
static const vnni_fn VNNI[PMR_MAX + 1] = {0, vnni_1, vnni_2, vnni_3, vnni_4, vnni_5, vnni_6, vnni_7, vnni_8};

/* One row of x -> its k pairs of int16 (round to nearest even, as lrintf), written with stride
 * ``stride`` (the row's place in its block's interleaved [pairs][MT] layout); returns the row's
 * scale max|x| / qmax (0 for a zero row, whose values quantise to 0, and for one whose largest
 * magnitude is below qmax / FLT_MAX, ~1e-34; NaN for a row holding a NaN or an infinity, so that
 * its outputs are NaN as the float GEMM's would be or become). */
static float quantize_row_pairs(const float *row, int64_t K, float qmax, uint32_t *out, int64_t stride)
{
    const float amax = row_absmax(row, K);  /* NaN: the row's outputs become NaN (sx below) */
    /* Below qmax / FLT_MAX (~1e-34) qmax / amax overflows: such a row counts as zero. */
    float inv = amax >= qmax / FLT_MAX ? qmax / amax : 0.0f;
    __m512 vinv = _mm512_set1_ps(inv);
    int64_t pairs = (K + 1) / 2, kk = 0;
    for (; 2 * kk + PVEC <= K; kk += PVEC / 2) {  /* 16 values -> 8 pairs */
        __m256i q = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + 2 * kk), vinv)));
        uint32_t w[PVEC / 2];
        _mm256_storeu_si256((__m256i *)w, q);
        for (int j = 0; j < PVEC / 2; j++) out[(kk + j) * stride] = w[j];
    }
    for (; kk < pairs; kk++) {
        int32_t lo = (int32_t)__builtin_lrintf(row[2 * kk] * inv);
        int32_t hi = 2 * kk + 1 < K ? (int32_t)__builtin_lrintf(row[2 * kk + 1] * inv) : 0;
        out[kk * stride] = (uint32_t)(uint16_t)(int16_t)lo | (uint32_t)(uint16_t)(int16_t)hi << 16;
    }
    if (amax != amax) return NAN;
    return inv > 0.0f ? amax / qmax : 0.0f;
}

/* The largest |x| quantised to: no int32 sum of K' products of it with 127 can overflow. */
static int32_t int16_qmax(int64_t K)
{
    int64_t k = K + (K & 1), q = (int64_t)2147483647 / (127 * (k > 0 ? k : 1));
    return (int32_t)(q < 32767 ? q : 32767);
}

/* y[M, N] = x[M, K] @ (w * scale[:, None])^T + bias (bias may be NULL), w as int8_linear_pack()
 * left it, x quantised per row to int16 (see above). Returns 0, or -1 when the scratch cannot be
 * allocated (y is then untouched). */
int int8_linear_packed(const float *x, const int8_t *packed, const float *scale, const float *bias, float *y,
                       int64_t M, int64_t N, int64_t K, int num_threads)
{
    int64_t panels = (N + PNR - 1) / PNR, pairs = (K + 1) / 2;
    int64_t blocks = (M + PMR_MAX - 1) / PMR_MAX;
    uint32_t *xp = malloc((size_t)(M * pairs) * sizeof(uint32_t));
    float *sx = malloc((size_t)M * sizeof(float));
    if (!xp || !sx) { free(xp); free(sx); return -1; }
    float qmax = (float)int16_qmax(K);
    /* Rows quantised in parallel (at prefill's M a single thread spent as long on them as the
     * GEMM's threads on the multiply-adds), each into its block's interleaved pairs. */
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t m0 = b * M / blocks, mt = (b + 1) * M / blocks - m0;
        for (int64_t i = 0; i < mt; i++) sx[m0 + i] = quantize_row_pairs(x + (m0 + i) * K, K, qmax, xp + m0 * pairs + i, mt);
    }
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < blocks; b++) {
            int64_t m0 = b * M / blocks, m1 = (b + 1) * M / blocks;
            const int8_t *next = p + 1 < panels && (b > 0 || m1 - m0 >= 3) ? packed + (p + 1) * pairs * PNR * 2 : 0;
            VNNI[m1 - m0](xp + m0 * pairs, pairs, packed + p * pairs * PNR * 2, scale, bias, sx + m0, y + m0 * N, N,
                          p * PNR, next);
        }
    }
    free(xp); free(sx);
    return 0;
}

/* W8A8: 8-bit activations too (the layers engine/model/loader.py marks for --quantization w8a8:
 * attention output, MLP gate/up), VPDPBUSD, four k per int32 lane (twice VPDPWSSD's multiply-adds per instruction). Each row of
 * x is quantised symmetrically on its own scale to 8 bits and offset to unsigned bytes:
 *
 *     sx[m] = max_k |x[m, k]| / 127,   xq[m, k] = round(x[m, k] / sx[m]) in [-127, 127],
 *     acc[m, n] = sum_k (xq[m, k] + 128) w[n, k]          (u8 x s8, int32, exact)
 *     y[m, n] = (acc[m, n] - 128 colsum[n]) sx[m] scale[n] + bias[n],   colsum[n] = sum_k w[n, k],
 *
 * so y is the float GEMM of the 8-bit x with the int8 weight, each value of x off by at most
 * sx[m] / 2 = max|x[m]| / 254 (a perplexity cost measured in docs/quantization.md). No int32 sum
 * can overflow below K = 2^31 / (255 * 127) = 66311. Rounding to nearest even (as lrintf); a NaN
 * or infinity in a row makes its outputs NaN; a zero row (or one whose largest magnitude is below
 * 127 / FLT_MAX) gives bias. Work split, panels, row blocks and prefetch as int8_linear_packed. */
#define A8_MAX_K 66311

int int8_linear_a8_available(void) { return 1; }

/* The bytes of int8_linear_a8_pack's output for an [N, K] weight: the panels
 * [ceil(N / PNR)][ceil(K / 4)][PNR][4] int8 (zeros past N and K), then 128 colsum[n] as int32
 * [ceil(N / PNR) PNR] (zeros past N). */
int64_t int8_linear_a8_packed_bytes(int64_t N, int64_t K)
{
    int64_t panels = (N + PNR - 1) / PNR, quads = (K + 3) / 4;
    return panels * quads * PNR * 4 + panels * PNR * (int64_t)sizeof(int32_t);
}

void int8_linear_a8_pack(const int8_t *w, int8_t *packed, int64_t N, int64_t K)
{
    int64_t panels = (N + PNR - 1) / PNR, quads = (K + 3) / 4;
    int32_t *corr = (int32_t *)(packed + panels * quads * PNR * 4);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t j = 0; j < PNR; j++) {
            int64_t n = p * PNR + j;
            int32_t sum = 0;
            for (int64_t kk = 0; kk < quads; kk++)
                for (int64_t t = 0; t < 4; t++) {
                    int64_t k = 4 * kk + t;
                    int8_t v = n < N && k < K ? w[n * K + k] : 0;
                    packed[((p * quads + kk) * PNR + j) * 4 + t] = v;
                    sum += v;
                }
            corr[n] = 128 * sum;
        }
}

/* Rows 0..MT of the block against one panel: xq [quads][MT] (four unsigned bytes of a row per
 * word), pw the panel [quads][PNR][4], corr its 128 colsum. */
#define DEFINE_A8_KERNEL(MT)                                                                       \
static void a8_##MT(const uint32_t *xq, int64_t quads, const int8_t *pw, const int32_t *corr,      \
                    const float *scale, const float *bias, const float *sx, float *y, int64_t N,   \
                    int64_t n0, const int8_t *next)                                                \
{                                                                                                  \
    __m512i c0[MT], c1[MT];                                                                        \
    _Pragma("GCC unroll 16") for (int i = 0; i < MT; i++) { c0[i] = _mm512_setzero_si512(); c1[i] = _mm512_setzero_si512(); } \
    for (int64_t kk = 0; kk < quads; kk++) {                                                       \
        __m512i b0 = _mm512_loadu_si512((const void *)(pw + kk * PNR * 4));                        \
        __m512i b1 = _mm512_loadu_si512((const void *)(pw + kk * PNR * 4 + 64));                   \
        if (next) { __builtin_prefetch(next + kk * PNR * 4, 0, 2); __builtin_prefetch(next + kk * PNR * 4 + 64, 0, 2); } \
        _Pragma("GCC unroll 16") for (int i = 0; i < MT; i++) {                                    \
            __m512i a = _mm512_set1_epi32((int)xq[kk * MT + i]);                                   \
            c0[i] = _mm512_dpbusd_epi32(c0[i], a, b0); c1[i] = _mm512_dpbusd_epi32(c1[i], a, b1);  \
        }                                                                                          \
    }                                                                                              \
    __m512i k0 = _mm512_loadu_si512((const void *)corr), k1 = _mm512_loadu_si512((const void *)(corr + PVEC)); \
    _Pragma("GCC unroll 16") for (int i = 0; i < MT; i++)                                          \
        store_row_q(y + i * N, n0, N, scale, bias, sx[i], _mm512_sub_epi32(c0[i], k0),             \
                    _mm512_sub_epi32(c1[i], k1));                                                  \
}
DEFINE_A8_KERNEL(1) DEFINE_A8_KERNEL(2) DEFINE_A8_KERNEL(3) DEFINE_A8_KERNEL(4)
DEFINE_A8_KERNEL(5) DEFINE_A8_KERNEL(6) DEFINE_A8_KERNEL(7) DEFINE_A8_KERNEL(8)
typedef void (*a8_fn)(const uint32_t *, int64_t, const int8_t *, const int32_t *, const float *, const float *,
                      const float *, float *, int64_t, int64_t, const int8_t *);
static const a8_fn A8[PMR_MAX + 1] = {0, a8_1, a8_2, a8_3, a8_4, a8_5, a8_6, a8_7, a8_8};

/* One row of x -> its quads of unsigned bytes xq + 128 (above), written with stride ``stride``;
 * returns sx = max|x| / 127 (0 for a zero row, NaN for one holding a NaN or an infinity). */
static float quantize_row_quads(const float *row, int64_t K, uint32_t *out, int64_t stride)
{
    const float amax = row_absmax(row, K);
    float inv = amax >= 127.0f / FLT_MAX ? 127.0f / amax : 0.0f;  /* NaN amax: 0, outputs NaN below */
    __m512 vinv = _mm512_set1_ps(inv);
    __m512i zp = _mm512_set1_epi32(128);
    int64_t quads = (K + 3) / 4, kk = 0;
    for (; 4 * kk + PVEC <= K; kk += PVEC / 4) {  /* 16 values -> 4 quads */
        __m512i v = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + 4 * kk), vinv)), zp);
        uint32_t w[PVEC / 4];
        _mm_storeu_si128((__m128i *)w, _mm512_cvtusepi32_epi8(v));
        for (int j = 0; j < PVEC / 4; j++) out[(kk + j) * stride] = w[j];
    }
    for (; kk < quads; kk++) {
        uint32_t word = 0;
        for (int t = 0; t < 4; t++) {
            int64_t k = 4 * kk + t;
            int32_t v = k < K ? (int32_t)__builtin_lrintf(row[k] * inv) : 0;
            word |= (uint32_t)(uint8_t)(v + 128) << (8 * t);
        }
        out[kk * stride] = word;
    }
    if (amax != amax) return NAN;
    return inv > 0.0f ? amax / 127.0f : 0.0f;
}

/* y[M, N] = x[M, K] (8-bit per row, above) @ (w * scale[:, None])^T + bias (bias may be NULL),
 * w as int8_linear_a8_pack() left it. Returns 0, -1 when the scratch cannot be allocated, -2
 * when K exceeds A8_MAX_K (y is then untouched). */
int int8_linear_a8_packed(const float *x, const int8_t *packed, const float *scale, const float *bias, float *y,
                          int64_t M, int64_t N, int64_t K, int num_threads)
{
    if (K > A8_MAX_K) return -2;
    int64_t panels = (N + PNR - 1) / PNR, quads = (K + 3) / 4;
    int64_t blocks = (M + PMR_MAX - 1) / PMR_MAX;
    const int32_t *corr = (const int32_t *)(packed + panels * quads * PNR * 4);
    uint32_t *xq = malloc((size_t)(M * quads) * sizeof(uint32_t));
    float *sx = malloc((size_t)M * sizeof(float));
    if (!xq || !sx) { free(xq); free(sx); return -1; }
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t m0 = b * M / blocks, mt = (b + 1) * M / blocks - m0;
        for (int64_t i = 0; i < mt; i++) sx[m0 + i] = quantize_row_quads(x + (m0 + i) * K, K, xq + m0 * quads + i, mt);
    }
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < blocks; b++) {
            int64_t m0 = b * M / blocks, m1 = (b + 1) * M / blocks;
            const int8_t *next = p + 1 < panels && (b > 0 || m1 - m0 >= 3) ? packed + (p + 1) * quads * PNR * 4 : 0;
            A8[m1 - m0](xq + m0 * quads, quads, packed + p * quads * PNR * 4, corr + p * PNR, scale, bias, sx + m0,
                        y + m0 * N, N, p * PNR, next);
        }
    }
    free(xq); free(sx);
    return 0;
}
#elif defined(__AVX2__) && defined(__FMA__)
/* Without VNNI (AVX2 + FMA: AMD Zen 1-3, Intel Haswell to Comet Lake) the packed path is float32:
 * the int8 weight is packed once in panels of PNR output channels, [ceil(N / PNR)][K][PNR] (zeros
 * past N), and the micro-kernel of fp32_linear.c (BLIS register blocking: MT <= 6 rows x 2
 * vectors of accumulators) widens the panel's two 8-channel vectors of each k exactly to float32
 * as it loads them (VPMOVSXBD, VCVTDQ2PS), so the result is the float32 GEMM on the dequantised
 * weight up to the order of the sums, as int8_linear_f32's. Its x values are broadcast from rows
 * interleaved per block ([K][MT]). Used from 3 rows on: at 1-2 rows (the weight read from DRAM sets
 * the pace) int8_linear_f32's widening GEMV on the plain weight is as fast, and the panel layout
 * gains nothing; from 3 rows on the 6 x 16 register blocking does 12 multiply-adds per 2
 * weight vectors where int8_linear_f32's tile of 2 x 4 dot products does 8 per 6 loads. */
#define PVEC 8
#define PNR (2 * PVEC)
#define PMR_MAX 6            /* 6 rows x 2 accumulators + 2 weights + 1 broadcast of AVX2's 16 */

int int8_linear_panel_width(void) { return PNR; }
int int8_linear_pack_pairs(void) { return 0; }
int int8_linear_packed_min_rows(void) { return 3; }

/* packed[ceil(N / PNR)][K][PNR] <- w[N, K]. */
void int8_linear_pack(const int8_t *w, int8_t *packed, int64_t N, int64_t K)
{
    int64_t panels = (N + PNR - 1) / PNR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < PNR; j++) {
                int64_t n = p * PNR + j;
                packed[(p * K + k) * PNR + j] = n < N ? w[n * K + k] : 0;
            }
}

static inline __m256 widen8(const int8_t *p)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* y[n0 .. n0 + PNR) of one row = acc * scale + bias, cut at N for the last panel. */
static inline void store_row_w(float *row, int64_t n0, int64_t N, const float *scale, const float *bias,
                               __m256 a0, __m256 a1)
{
    float tmp[PNR];
    if (n0 + PNR <= N) {
        a0 = _mm256_mul_ps(a0, _mm256_loadu_ps(scale + n0));
        a1 = _mm256_mul_ps(a1, _mm256_loadu_ps(scale + n0 + PVEC));
        if (bias) { a0 = _mm256_add_ps(a0, _mm256_loadu_ps(bias + n0)); a1 = _mm256_add_ps(a1, _mm256_loadu_ps(bias + n0 + PVEC)); }
        _mm256_storeu_ps(row + n0, a0); _mm256_storeu_ps(row + n0 + PVEC, a1);
        return;
    }
    _mm256_storeu_ps(tmp, a0); _mm256_storeu_ps(tmp + PVEC, a1);
    for (int64_t j = 0; n0 + j < N; j++) row[n0 + j] = tmp[j] * scale[n0 + j] + (bias ? bias[n0 + j] : 0.0f);
}

/* Rows 0..MT of the block against one panel (rows unrolled so the accumulators stay in
 * registers); the next panel's k-th row prefetched once per 64-byte line (4 k). */
#define DEFINE_WIDEN_KERNEL(MT)                                                                    \
static void widen_##MT(const float *xp, int64_t K, const int8_t *pw, const float *scale,          \
                       const float *bias, float *y, int64_t N, int64_t n0, const int8_t *next)    \
{                                                                                                  \
    __m256 c0[MT], c1[MT];                                                                         \
    _Pragma("GCC unroll 16") for (int i = 0; i < MT; i++) { c0[i] = _mm256_setzero_ps(); c1[i] = _mm256_setzero_ps(); } \
    for (int64_t k = 0; k < K; k++) {                                                              \
        __m256 b0 = widen8(pw + k * PNR), b1 = widen8(pw + k * PNR + PVEC);                        \
        if (next && (k & 3) == 0) __builtin_prefetch(next + k * PNR, 0, 3);                        \
        _Pragma("GCC unroll 16") for (int i = 0; i < MT; i++) {                                    \
            __m256 a = _mm256_broadcast_ss(xp + k * MT + i);                                       \
            c0[i] = _mm256_fmadd_ps(a, b0, c0[i]); c1[i] = _mm256_fmadd_ps(a, b1, c1[i]);          \
        }                                                                                          \
    }                                                                                              \
    _Pragma("GCC unroll 16") for (int i = 0; i < MT; i++)                                          \
        store_row_w(y + i * N, n0, N, scale, bias, c0[i], c1[i]);                                  \
}
DEFINE_WIDEN_KERNEL(1) DEFINE_WIDEN_KERNEL(2) DEFINE_WIDEN_KERNEL(3)
DEFINE_WIDEN_KERNEL(4) DEFINE_WIDEN_KERNEL(5) DEFINE_WIDEN_KERNEL(6)
typedef void (*widen_fn)(const float *, int64_t, const int8_t *, const float *, const float *, float *, int64_t,
                         int64_t, const int8_t *);
static const widen_fn WIDEN[PMR_MAX + 1] = {0, widen_1, widen_2, widen_3, widen_4, widen_5, widen_6};

/* y[M, N] = x[M, K] @ (w * scale[:, None])^T + bias (bias may be NULL), w as int8_linear_pack()
 * left it; rows in blocks of nearly equal size (16 -> 6 + 5 + 5), the work split and prefetch as
 * fp32_linear.c. Returns 0, or -1 when the scratch cannot be allocated (y is then untouched). */
int int8_linear_packed(const float *x, const int8_t *packed, const float *scale, const float *bias, float *y,
                       int64_t M, int64_t N, int64_t K, int num_threads)
{
    int64_t panels = (N + PNR - 1) / PNR;
    int64_t blocks = (M + PMR_MAX - 1) / PMR_MAX;
    float *xp = malloc((size_t)(M * K) * sizeof(float));
    if (!xp) return -1;
    for (int64_t b = 0; b < blocks; b++) {
        int64_t m0 = b * M / blocks, mt = (b + 1) * M / blocks - m0;
        for (int64_t k = 0; k < K; k++)
            for (int64_t i = 0; i < mt; i++) xp[m0 * K + k * mt + i] = x[(m0 + i) * K + k];
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < blocks; b++) {
            int64_t m0 = b * M / blocks, m1 = (b + 1) * M / blocks;
            const int8_t *next = p + 1 < panels && (b > 0 || m1 - m0 >= 3) ? packed + (p + 1) * K * PNR : 0;
            WIDEN[m1 - m0](xp + m0 * K, K, packed + p * K * PNR, scale, bias, y + m0 * N, N, p * PNR, next);
        }
    free(xp);
    return 0;
}
#else
int int8_linear_panel_width(void) { return 0; }  /* no packed path on this build: int8_linear_f32 */
int int8_linear_pack_pairs(void) { return 0; }
int int8_linear_packed_min_rows(void) { return 0; }
void int8_linear_pack(const int8_t *w, int8_t *packed, int64_t N, int64_t K) { (void)w; (void)packed; (void)N; (void)K; }
int int8_linear_packed(const float *x, const int8_t *packed, const float *scale, const float *bias, float *y,
                       int64_t M, int64_t N, int64_t K, int num_threads)
{ (void)x; (void)packed; (void)scale; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)num_threads; return -1; }
#endif

#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
/* No W8A8 path on this build (it needs AVX512-VNNI): int8_linear_a8_available() says so. */
int int8_linear_a8_available(void) { return 0; }
int64_t int8_linear_a8_packed_bytes(int64_t N, int64_t K) { (void)N; (void)K; return 0; }
void int8_linear_a8_pack(const int8_t *w, int8_t *packed, int64_t N, int64_t K) { (void)w; (void)packed; (void)N; (void)K; }
int int8_linear_a8_packed(const float *x, const int8_t *packed, const float *scale, const float *bias, float *y,
                          int64_t M, int64_t N, int64_t K, int num_threads)
{ (void)x; (void)packed; (void)scale; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)num_threads; return -1; }
#endif

/* Activations for an 8-bit x 8-bit GEMM library at 16-bit precision (oneDNN's u8 x s8 inner
 * product, backend "int8_onednn" in engine/model/linear.py). Each row of x is quantised
 * symmetrically to v in [-QSPLIT, QSPLIT] on its own scale, and v is split into two bytes:
 *
 *     s[m] = max_k |x[m, k]| / QSPLIT,   v = round(x[m, k] / s[m]),
 *     hi = round(v / 256) (half up),      lo = v - 256 hi        (hi in -127..127, lo in -128..127)
 *     q[m, k] = hi + 128,  q[M + m, k] = lo + 128
 *
 * x float32 [M, K], q uint8 [2M, K] (the high bytes of every row, then the low bytes), s float32
 * [M]. One GEMM of the 2M rows with zero point 128 gives each row's two partial sums (int32, exact),
 * and y[m] = s[m] (256 y[m] + y[M + m]). Each value's error is at most s[m] / 2, 1/65278 of its
 * row's largest magnitude, as with 16-bit activations; a zero row (or one whose largest magnitude
 * is below QSPLIT / FLT_MAX, ~1e-34) gets s = 0 and q = 128, a row holding a NaN or an infinity
 * s = NaN (its outputs are NaN, as the float GEMM's would be or become). Rounding to nearest even
 * (as lrintf). */
#define QSPLIT (127 * 256 + 127)
void int8_split_rows_u8(const float *x, uint8_t *q, float *s, int64_t M, int64_t K, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M * K >= (1 << 16))
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * K;
        uint8_t *hi = q + m * K, *lo = q + (M + m) * K;
        const float amax = row_absmax(row, K);
        if (amax != amax) {  /* a NaN or an infinity: the row's outputs become NaN */
            memset(hi, 128, (size_t)K); memset(lo, 128, (size_t)K);
            s[m] = NAN;
            continue;
        }
        /* Below QSPLIT / FLT_MAX (~1e-34) QSPLIT / amax overflows: such a row counts as zero. */
        float inv = amax >= (float)QSPLIT / FLT_MAX ? (float)QSPLIT / amax : 0.0f;
        int64_t k = 0;
#if defined(__AVX512F__)
        __m512 vinv = _mm512_set1_ps(inv);
        __m512i zp = _mm512_set1_epi32(128);
        for (; k + 16 <= K; k += 16) {
            __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + k), vinv));
            __m512i h = _mm512_srai_epi32(_mm512_add_epi32(v, zp), 8);
            __m512i l = _mm512_sub_epi32(v, _mm512_slli_epi32(h, 8));
            _mm_storeu_si128((__m128i *)(hi + k), _mm512_cvtusepi32_epi8(_mm512_add_epi32(h, zp)));
            _mm_storeu_si128((__m128i *)(lo + k), _mm512_cvtusepi32_epi8(_mm512_add_epi32(l, zp)));
        }
#endif
        for (; k < K; k++) {
            int32_t v = (int32_t)__builtin_lrintf(row[k] * inv);
            int32_t h = (v + 128) >> 8;  /* arithmetic shift: floor */
            hi[k] = (uint8_t)(h + 128);
            lo[k] = (uint8_t)(v - 256 * h + 128);
        }
        s[m] = inv > 0.0f ? amax / (float)QSPLIT : 0.0f;
    }
}

/* Activations at 8 bits for an 8-bit x 8-bit GEMM library on a W8A8 layer ("int8_onednn" there),
 * rounded as int8_linear_a8_packed rounds them: s[m] = max_k |x[m, k]| / 127,
 * q[m, k] = round(x[m, k] / s[m]) + 128 (round to nearest even). x float32 [M, K], q uint8 [M, K],
 * s float32 [M]; a zero row (or one below 127 / FLT_MAX) gets s = 0 and q = 128, a row holding a
 * NaN or an infinity s = NaN. */
void int8_quantize_rows_u8(const float *x, uint8_t *q, float *s, int64_t M, int64_t K, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M * K >= (1 << 16))
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * K;
        uint8_t *out = q + m * K;
        const float amax = row_absmax(row, K);
        if (amax != amax) { memset(out, 128, (size_t)K); s[m] = NAN; continue; }
        float inv = amax >= 127.0f / FLT_MAX ? 127.0f / amax : 0.0f;
        int64_t k = 0;
#if defined(__AVX512F__)
        __m512 vinv = _mm512_set1_ps(inv);
        __m512i zp = _mm512_set1_epi32(128);
        for (; k + 16 <= K; k += 16)
            _mm_storeu_si128((__m128i *)(out + k), _mm512_cvtusepi32_epi8(
                _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + k), vinv)), zp)));
#endif
        for (; k < K; k++) out[k] = (uint8_t)((int32_t)__builtin_lrintf(row[k] * inv) + 128);
        s[m] = inv > 0.0f ? amax / 127.0f : 0.0f;
    }
}
