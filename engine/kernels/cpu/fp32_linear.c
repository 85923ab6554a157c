/* Float32 linear layer on the CPU for the small M of decode steps (a register-blocked GEMM on a
 * weight packed once in panels):
 *
 *     y[m, n] = sum_k x[m, k] * w[n, k] + bias[n]
 *
 * x float32 [M, K], w float32 [N, K] (nn.Linear's layout), y float32 [M, N]; float32 products and
 * sums (fused multiply-adds), so the result is the float32 GEMM up to the order of the sums.
 *
 * bfloat16: bf16_linear() takes x, w, bias and y in bfloat16 with the same float32 arithmetic:
 * the packed bf16 weight is widened to float32 as it is loaded (a bf16 value is the upper half of
 * a float32, so the widening is exact), x is widened as its rows are interleaved, and each y value
 * is rounded to bfloat16 once (round to nearest even), as oneDNN's and F.linear's bf16 GEMMs round
 * their float32 accumulators. The weight's bytes, what a decode step's GEMM is bound by, halve;
 * every CPU with AVX2 runs it (no AVX512-BF16 needed).
 * With AVX512-BF16 the weight is packed in pairs of k for VDPBF16PS, and with AMX those same
 * panels feed TDPBF16PS tiles (bf16_linear_amx, below).
 *
 * Reference: F.linear (engine/model/linear.py, backend "torch"); the wrapper and its checks live in
 * engine/kernels/cpu_fp32_linear.py, the test in tests/unit/engine/kernels/test_cpu_fp32_linear_kernel.py.
 *
 * Layout. fp32_linear_pack() copies w once into panels of NR output channels, each panel K rows of
 * NR floats ([ceil(N / NR)][K][NR], the last panel padded with zeros), so a panel streams from
 * memory as one contiguous run and the hardware prefetcher keeps ahead of it.
 *
 * Micro-kernel (the BLIS/GotoBLAS register blocking, Van Zee & van de Geijn, "BLIS: A Framework
 * for Rapidly Instantiating BLAS Functionality", TOMS 2015, section 3): MT <= MR_MAX rows of x
 * against one panel; MT x 2 vector accumulators stay in registers for the whole K loop, each step
 * loads the panel's two vectors once and broadcasts one x value per row. MR_MAX fills the register
 * file: 6 rows x 2 = 12 accumulators + 2 weight vectors + 1 broadcast of AVX2's 16 registers, 8
 * rows (16 + 3 of AVX-512's 32). x's rows are first interleaved per block of rows ([K][MT]) so the
 * broadcasts read one stream.
 *
 * Work split: the panels shared out among the threads (each panel's output columns belong to one
 * thread); every thread runs all of x's row blocks against its panels, so a panel is read from
 * DRAM once per call and from L1/L2 for the next row blocks. Small M is where this beats the
 * libraries' general kernels (at M = 1 it is a GEMV that reads each weight once); for large M the
 * chooser (engine/model/linear_chooser.py) times it against oneDNN and MKL and keeps the fastest.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* GCC at -std=c11 does not contract a * b + c into an FMA, and spells a scalar broadcast as an add
 * to a zero vector (which -0.0 keeps from folding): both are explicit here. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define VEC 16
#define MR_MAX 8
typedef float vec_f __attribute__((vector_size(VEC * sizeof(float))));
static inline vec_f fma_f(vec_f a, vec_f b, vec_f c) { return (vec_f)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
static inline vec_f bcast(const float *p) { return (vec_f)_mm512_set1_ps(*p); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VEC 8
#define MR_MAX 6
typedef float vec_f __attribute__((vector_size(VEC * sizeof(float))));
static inline vec_f fma_f(vec_f a, vec_f b, vec_f c) { return (vec_f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
static inline vec_f bcast(const float *p) { return (vec_f)_mm256_broadcast_ss(p); }
#else
#define VEC 4
#define MR_MAX 4
typedef float vec_f __attribute__((vector_size(VEC * sizeof(float))));
static inline vec_f fma_f(vec_f a, vec_f b, vec_f c) { return a * b + c; }
static inline vec_f bcast(const float *p) { vec_f v; for (int i = 0; i < VEC; i++) v[i] = *p; return v; }
#endif
#define NR (2 * VEC)  /* output channels per panel */

static inline vec_f loadv(const float *p) { vec_f v; memcpy(&v, p, sizeof v); return v; }
static inline void storev(float *p, vec_f v) { memcpy(p, &v, sizeof v); }

/* bfloat16 <-> float32: a bf16 value is the upper 16 bits of a float32. */
static inline float bf16_to_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f32_to_bf16(float f) /* round to nearest even; NaN stays a (quiet) NaN */
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
/* VEC bf16 values -> VEC floats (zero-extended to 32 bits, shifted into the upper half). */
static inline vec_f loadv_bf16(const uint16_t *p)
{
#if defined(__AVX512F__)
    __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
    return (vec_f)_mm512_castsi512_ps(w);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    return (vec_f)_mm256_castsi256_ps(w);
#else
    vec_f v;
    for (int i = 0; i < VEC; i++) v[i] = bf16_to_f32(p[i]);
    return v;
#endif
}

/* Output channels per panel on this build (the wrapper sizes the packed tensor with it). */
int fp32_linear_panel_width(void) { return NR; }

/* packed[ceil(N / NR)][K][NR] <- w[N, K], padded with zeros past N. */
void fp32_linear_pack(const float *w, float *packed, int64_t N, int64_t K)
{
    int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < NR; j++) {
                int64_t n = p * NR + j;
                packed[(p * K + k) * NR + j] = n < N ? w[n * K + k] : 0.0f;
            }
}

#if defined(__AVX512BF16__)
/* With AVX512-BF16 a bfloat16 weight is packed in pairs of k for VDPBF16PS, which multiplies two
 * bf16 pairs per 32-bit lane and adds both products to a float32 accumulator:
 * packed[ceil(N / NR)][ceil(K / 2)][NR][2] <- w[N, K], zeros past N and past K (an odd K's pad). */
#define BF16_PAIRS 1
void bf16_linear_pack(const uint16_t *w, uint16_t *packed, int64_t N, int64_t K)
{
    int64_t panels = (N + NR - 1) / NR, pairs = (K + 1) / 2;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < pairs; kk++)
            for (int64_t j = 0; j < NR; j++)
                for (int64_t t = 0; t < 2; t++) {
                    int64_t n = p * NR + j, k = 2 * kk + t;
                    packed[((p * pairs + kk) * NR + j) * 2 + t] = n < N && k < K ? w[n * K + k] : 0;
                }
}
#else
#define BF16_PAIRS 0
/* The same for a bfloat16 weight (bits as uint16): packed[ceil(N / NR)][K][NR] <- w[N, K]. */
void bf16_linear_pack(const uint16_t *w, uint16_t *packed, int64_t N, int64_t K)
{
    int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < NR; j++) {
                int64_t n = p * NR + j;
                packed[(p * K + k) * NR + j] = n < N ? w[n * K + k] : 0;
            }
}
#endif
/* 1 when bf16_linear_pack() packs pairs of k (its K rounded up to even), else 0. */
int bf16_linear_pairs(void) { return BF16_PAIRS; }

/* row[n0 .. n0 + NR) = a0 | a1 (+ bias), cut at N for the last panel. */
static inline void store_row(float *row, int64_t n0, int64_t N, const float *bias, vec_f a0, vec_f a1)
{
    if (n0 + NR <= N) {
        if (bias) { a0 += loadv(bias + n0); a1 += loadv(bias + n0 + VEC); }
        storev(row + n0, a0); storev(row + n0 + VEC, a1);
        return;
    }
    float tmp[NR];
    storev(tmp, a0); storev(tmp + VEC, a1);
    for (int64_t j = 0; n0 + j < N; j++) row[n0 + j] = tmp[j] + (bias ? bias[n0 + j] : 0.0f);
}

/* The same into a bfloat16 row (bias bf16 too): float32 sum, one rounding. */
static inline void store_row_bf16(uint16_t *row, int64_t n0, int64_t N, const uint16_t *bias, vec_f a0, vec_f a1)
{
    float tmp[NR];
    storev(tmp, a0); storev(tmp + VEC, a1);
    int64_t n = N - n0 < NR ? N - n0 : NR;
    for (int64_t j = 0; j < n; j++) row[n0 + j] = f32_to_bf16(tmp[j] + (bias ? bf16_to_f32(bias[n0 + j]) : 0.0f));
}

/* y rows 0..MT, columns [n0, n0 + NR) = xp ([K][MT], interleaved float32 rows) . panel pw + bias,
 * the panel's elements of type W_T widened by LOADW, each row stored by STORE. The loops over rows
 * are unrolled in full so that GCC keeps c0/c1 in registers (a loop it leaves rolled indexes them,
 * and it then stores them to the stack at every k). */
/* c0/c1[0..MT) += rows k0..k1 of xp ([K][MT]) times the panel pw (W_T elements widened by LOADW),
 * PREFETCHT1-ing the same rows of pf (NULL: none) one 64-byte line at a time. Shared by the
 * micro-kernels below and the streaming schedule's chunk kernels. */
#define PANEL_FMA(MT, W_T, LOADW, xp, pw, k0, k1, pf)                                              \
    for (int64_t k = (k0); k < (k1); k++) {                                                        \
        vec_f b0 = LOADW((pw) + k * NR), b1 = LOADW((pw) + k * NR + VEC);                          \
        if (pf)                                                                                    \
            for (int l = 0; l < NR * (int)sizeof(W_T); l += 64)                                    \
                __builtin_prefetch((const char *)((pf) + k * NR) + l, 0, 2);                       \
        _Pragma("GCC unroll 16") for (int i = 0; i < MT; i++) {                                    \
            vec_f a = bcast((xp) + k * MT + i);                                                    \
            c0[i] = fma_f(a, b0, c0[i]); c1[i] = fma_f(a, b1, c1[i]);                              \
        }                                                                                          \
    }
#define DEFINE_MICRO_KERNEL(NAME, MT, W_T, LOADW, Y_T, STORE)                                       \
static void NAME##_##MT(const float *xp, int64_t K, const W_T *pw, const Y_T *bias,                \
                        Y_T *y, int64_t N, int64_t n0, const W_T *next)                            \
{                                                                                                  \
    vec_f c0[MT], c1[MT];                                                                          \
    _Pragma("GCC unroll 16") for (int i = 0; i < MT; i++) { c0[i] = (vec_f){0}; c1[i] = (vec_f){0}; } \
    PANEL_FMA(MT, W_T, LOADW, xp, pw, 0, K, next) /* next: the next panel's rows */                 \
    _Pragma("GCC unroll 16") for (int i = 0; i < MT; i++) STORE(y + i * N, n0, N, bias, c0[i], c1[i]); \
}
#define DEFINE_MICRO_KERNELS(NAME, W_T, LOADW, Y_T, STORE)                                          \
    DEFINE_MICRO_KERNEL(NAME, 1, W_T, LOADW, Y_T, STORE)                                            \
    DEFINE_MICRO_KERNEL(NAME, 2, W_T, LOADW, Y_T, STORE)                                            \
    DEFINE_MICRO_KERNEL(NAME, 3, W_T, LOADW, Y_T, STORE)                                            \
    DEFINE_MICRO_KERNEL(NAME, 4, W_T, LOADW, Y_T, STORE)                                            \
    MICRO_KERNELS_6(NAME, W_T, LOADW, Y_T, STORE)                                                   \
    MICRO_KERNELS_8(NAME, W_T, LOADW, Y_T, STORE)                                                   \
    typedef void (*NAME##_fn)(const float *, int64_t, const W_T *, const Y_T *, Y_T *, int64_t, int64_t, \
                              const W_T *);                                                        \
    static const NAME##_fn NAME##_table[MR_MAX + 1] = {                                            \
        0, NAME##_1, NAME##_2, NAME##_3, NAME##_4 MICRO_ENTRIES_6(NAME) MICRO_ENTRIES_8(NAME) };
#if MR_MAX >= 6
#define MICRO_KERNELS_6(NAME, W_T, LOADW, Y_T, STORE)                                               \
    DEFINE_MICRO_KERNEL(NAME, 5, W_T, LOADW, Y_T, STORE) DEFINE_MICRO_KERNEL(NAME, 6, W_T, LOADW, Y_T, STORE)
#define MICRO_ENTRIES_6(NAME) , NAME##_5, NAME##_6
#else
#define MICRO_KERNELS_6(NAME, W_T, LOADW, Y_T, STORE)
#define MICRO_ENTRIES_6(NAME)
#endif
#if MR_MAX >= 8
#define MICRO_KERNELS_8(NAME, W_T, LOADW, Y_T, STORE)                                               \
    DEFINE_MICRO_KERNEL(NAME, 7, W_T, LOADW, Y_T, STORE) DEFINE_MICRO_KERNEL(NAME, 8, W_T, LOADW, Y_T, STORE)
#define MICRO_ENTRIES_8(NAME) , NAME##_7, NAME##_8
#else
#define MICRO_KERNELS_8(NAME, W_T, LOADW, Y_T, STORE)
#define MICRO_ENTRIES_8(NAME)
#endif
DEFINE_MICRO_KERNELS(micro_f32, float, loadv, float, store_row)
#if !defined(__AVX512BF16__) /* there bf16_linear() multiplies pairs with VDPBF16PS instead (below) */
DEFINE_MICRO_KERNELS(micro_bf16, uint16_t, loadv_bf16, uint16_t, store_row_bf16)
#endif

/* xp <- x's rows in ``blocks`` blocks of nearly equal size, each block's rows interleaved ([K][rows],
 * block b at xp + m0 * K) and widened to float32 by TO_F32. */
#define INTERLEAVE_ROWS(x, xp, M, K, blocks, TO_F32)                                               \
    for (int64_t b = 0; b < (blocks); b++) {                                                       \
        int64_t m0 = b * (M) / (blocks), m1 = (b + 1) * (M) / (blocks), mt = m1 - m0;              \
        for (int64_t k = 0; k < (K); k++)                                                          \
            for (int64_t i = 0; i < mt; i++) (xp)[m0 * (K) + k * mt + i] = TO_F32((x)[(m0 + i) * (K) + k]); \
    }

/* y[M, N] = x[M, K] @ w^T + bias (bias may be NULL), w as the pack function left it; see the top.
 * The M rows are cut into ceil(M / MR_MAX) blocks of nearly equal size (16 -> 6 + 5 + 5), each
 * block's rows interleaved into float32 scratch ([K][rows], widened by TO_F32). Returns 0, or -1
 * when the scratch cannot be allocated (y is then untouched). */
#define DEFINE_LINEAR(NAME, T, TO_F32, TABLE)                                                      \
int NAME(const T *x, const T *packed, const T *bias, T *y, int64_t M, int64_t N, int64_t K, int num_threads) \
{                                                                                                  \
    int64_t panels = (N + NR - 1) / NR;                                                            \
    int64_t blocks = (M + MR_MAX - 1) / MR_MAX;                                                    \
    float *xp = malloc((size_t)(M * K) * sizeof(float));                                           \
    if (!xp) return -1;                                                                            \
    INTERLEAVE_ROWS(x, xp, M, K, blocks, TO_F32)                                                   \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                          \
    for (int64_t p = 0; p < panels; p++)                                                           \
        for (int64_t b = 0; b < blocks; b++) {                                                     \
            int64_t m0 = b * M / blocks, m1 = (b + 1) * M / blocks;                                \
            const T *next = p + 1 < panels && (b > 0 || m1 - m0 >= 3) ? packed + (p + 1) * K * NR : 0; \
            TABLE[m1 - m0](xp + m0 * K, K, packed + p * K * NR, bias, y + m0 * N, N, p * NR, next); \
        }                                                                                          \
    free(xp);                                                                                      \
    return 0;                                                                                      \
}
/* The next panel is prefetched while this one is read from the caches (the row blocks after the
 * first) or, with one block of 3+ rows, while its multiply-adds run: the first block's loads come
 * from DRAM, the prefetcher's own stream, and the compute of the later blocks would otherwise leave
 * the memory idle. Measured on an AVX2 EPYC: 20-30 % off M = 16 and 4-6; at M = 1-2
 * (bandwidth-bound already) it cost up to 20 %. The prefetches ask for L2, not L1 (locality 2,
 * PREFETCHT1): a panel row is read a whole panel later, and the L1 fill buffers a T0 prefetch
 * holds are what the current panel's loads wait on. On a 2-core Intel Xeon (Sapphire Rapids) that
 * took M = 4-16 GEMMs 10-25 % faster (3072 x 576 at M = 16: 0.31 -> 0.27 ms; the 49152 x 576 LM
 * head 6.3 -> 5.6 ms); at M = 1-2 nothing changes. */
#define F32_IDENTITY(v) (v)
DEFINE_LINEAR(fp32_linear, float, F32_IDENTITY, micro_f32_table)

/* The streaming schedule of the same product (fp32_linear_stream): where fp32_linear reads a
 * panel from DRAM in its first row block and then computes its later blocks from the caches,
 * leaving the memory idle but for the next panel's prefetches, this one cuts each panel's K into
 * chunks of KC rows and runs every row block over a chunk before the next chunk, each block's
 * accumulators parked in L1 between chunks. The panel then streams from DRAM once, at an even
 * pace under all the blocks' multiply-adds, with PREFETCHT1 STREAM_AHEAD bytes ahead in the
 * thread's run of panels (the first block of each chunk issues them). Rows go in groups of
 * 2 x MR_MAX (a 16-row group's accumulators are 2 KB with AVX-512): a larger M reads each panel
 * once per group, from L2 after the first. Same sums in the same order as fp32_linear, so the
 * same result bit for bit. Which schedule is faster depends on the CPU and M: the linear chooser
 * times both (backends fp32_cpu and fp32_stream). Measured on a 2-core Intel Xeon (Sapphire
 * Rapids), SmolLM2's 30 layers of GEMMs (qkv, o, gate/up, down): M = 1 17.2-17.8 -> 15.5-15.8
 * ms, M = 16 25.8-26.3 -> 23.3-24.0 ms. */
#define KC 64
#define STREAM_AHEAD 8192
#define STREAM_GROUP (2 * MR_MAX)
#define DEFINE_CHUNK_KERNEL(MT)                                                                    \
static void chunk_f32_##MT(const float *xp, int64_t k0, int64_t k1, const float *pw, float *acc,   \
                           int first, const float *ahead)                                          \
{                                                                                                  \
    vec_f c0[MT], c1[MT];                                                                          \
    _Pragma("GCC unroll 16") for (int i = 0; i < MT; i++) {                                        \
        c0[i] = first ? (vec_f){0} : loadv(acc + i * NR);                                          \
        c1[i] = first ? (vec_f){0} : loadv(acc + i * NR + VEC);                                    \
    }                                                                                              \
    PANEL_FMA(MT, float, loadv, xp, pw, k0, k1, ahead)                                             \
    _Pragma("GCC unroll 16") for (int i = 0; i < MT; i++) {                                        \
        storev(acc + i * NR, c0[i]); storev(acc + i * NR + VEC, c1[i]);                            \
    }                                                                                              \
}
DEFINE_CHUNK_KERNEL(1) DEFINE_CHUNK_KERNEL(2) DEFINE_CHUNK_KERNEL(3) DEFINE_CHUNK_KERNEL(4)
#if MR_MAX >= 6
DEFINE_CHUNK_KERNEL(5) DEFINE_CHUNK_KERNEL(6)
#endif
#if MR_MAX >= 8
DEFINE_CHUNK_KERNEL(7) DEFINE_CHUNK_KERNEL(8)
#endif
typedef void (*chunk_f32_fn)(const float *, int64_t, int64_t, const float *, float *, int, const float *);
static const chunk_f32_fn CHUNK_F32[MR_MAX + 1] = {
    0, chunk_f32_1, chunk_f32_2, chunk_f32_3, chunk_f32_4
#if MR_MAX >= 6
    , chunk_f32_5, chunk_f32_6
#endif
#if MR_MAX >= 8
    , chunk_f32_7, chunk_f32_8
#endif
};

/* y[M, N] = x[M, K] @ w^T + bias, as fp32_linear (same arguments, same packed weight, same
 * result), on the streaming schedule above. Returns 0, or -1 when the scratch cannot be
 * allocated (y is then untouched). */
int fp32_linear_stream(const float *x, const float *packed, const float *bias, float *y, int64_t M, int64_t N,
                       int64_t K, int num_threads)
{
    int64_t panels = (N + NR - 1) / NR;
    int64_t blocks = (M + MR_MAX - 1) / MR_MAX;
    int64_t ahead_rows = STREAM_AHEAD / (NR * (int64_t)sizeof(float));
    const float *end = packed + panels * K * NR;
    float *xp = malloc((size_t)(M * K) * sizeof(float));
    if (!xp) return -1;
    INTERLEAVE_ROWS(x, xp, M, K, blocks, F32_IDENTITY)
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float acc[STREAM_GROUP * NR] __attribute__((aligned(64)));
        const float *pw = packed + p * K * NR;
        for (int64_t g0 = 0; g0 < blocks; g0 += 2) {  /* groups of two row blocks */
            int64_t g1 = g0 + 2 < blocks ? g0 + 2 : blocks, row0 = g0 * M / blocks;
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
                int64_t k1 = k0 + KC < K ? k0 + KC : K;
                /* The first group streams the panel from DRAM: prefetch ahead, within the buffer. */
                const float *ahead = g0 == 0 && pw + (k1 + ahead_rows) * NR <= end ? pw + ahead_rows * NR : 0;
                for (int64_t b = g0; b < g1; b++) {
                    int64_t m0 = b * M / blocks, m1 = (b + 1) * M / blocks;
                    CHUNK_F32[m1 - m0](xp + m0 * K, k0, k1, pw, acc + (m0 - row0) * NR, k0 == 0, b == g0 ? ahead : 0);
                }
            }
            int64_t row1 = g1 * M / blocks;
            for (int64_t i = row0; i < row1; i++)
                store_row(y + i * N, p * NR, N, bias, loadv(acc + (i - row0) * NR), loadv(acc + (i - row0) * NR + VEC));
        }
    }
    free(xp);
    return 0;
}
#if !defined(__AVX512BF16__)
DEFINE_LINEAR(bf16_linear, uint16_t, bf16_to_f32, micro_bf16_table)
#else
/* y rows 0..MT, columns [n0, n0 + NR) with VDPBF16PS: xp holds each row's k pairs as 32-bit words
 * ([pairs][MT]), the panel [pairs][NR][2]; each instruction adds two products per lane, so a k
 * pair costs one multiply-add where the widening kernel spends two (and no widening). */
#define DEFINE_DP_KERNEL(MT)                                                                       \
static void dp_bf16_##MT(const uint32_t *xp, int64_t pairs, const uint16_t *pw, const uint16_t *bias, \
                         uint16_t *y, int64_t N, int64_t n0, const uint16_t *next)                 \
{                                                                                                  \
    __m512 c0[MT], c1[MT];                                                                         \
    _Pragma("GCC unroll 16") for (int i = 0; i < MT; i++) { c0[i] = _mm512_setzero_ps(); c1[i] = _mm512_setzero_ps(); } \
    for (int64_t kk = 0; kk < pairs; kk++) {                                                       \
        __m512bh b0 = (__m512bh)_mm512_loadu_si512(pw + kk * NR * 2);                             \
        __m512bh b1 = (__m512bh)_mm512_loadu_si512(pw + kk * NR * 2 + 32);                         \
        if (next) { __builtin_prefetch(next + kk * NR * 2, 0, 2); __builtin_prefetch(next + kk * NR * 2 + 32, 0, 2); } \
        _Pragma("GCC unroll 16") for (int i = 0; i < MT; i++) {                                    \
            __m512bh a = (__m512bh)_mm512_set1_epi32((int)xp[kk * MT + i]);                        \
            c0[i] = _mm512_dpbf16_ps(c0[i], a, b0); c1[i] = _mm512_dpbf16_ps(c1[i], a, b1);        \
        }                                                                                          \
    }                                                                                              \
    _Pragma("GCC unroll 16") for (int i = 0; i < MT; i++)                                          \
        store_row_bf16(y + i * N, n0, N, bias, (vec_f)c0[i], (vec_f)c1[i]);                        \
}
DEFINE_DP_KERNEL(1) DEFINE_DP_KERNEL(2) DEFINE_DP_KERNEL(3) DEFINE_DP_KERNEL(4)
DEFINE_DP_KERNEL(5) DEFINE_DP_KERNEL(6) DEFINE_DP_KERNEL(7) DEFINE_DP_KERNEL(8)
typedef void (*dp_bf16_fn)(const uint32_t *, int64_t, const uint16_t *, const uint16_t *, uint16_t *, int64_t,
                           int64_t, const uint16_t *);
static const dp_bf16_fn DP_BF16[MR_MAX + 1] = {0, dp_bf16_1, dp_bf16_2, dp_bf16_3, dp_bf16_4,
                                                dp_bf16_5, dp_bf16_6, dp_bf16_7, dp_bf16_8};

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* AMX (Intel's tile unit: TDPBF16PS multiplies a tile of up to 16 rows x 32 bfloat16 of x by one of
 * 16 k pairs x 16 output channels of the weight, adding to a 16 x 16 float32 tile). The pair
 * packing above is the tiles' layout already: a panel's k-pair row is 32 channels x 2 values, so
 * the B tile of channels 0-15 and that of 16-31 are its two 64-byte halves, 16 rows at a stride of
 * one panel row. Each of a thread's panels (a contiguous run of them: one stream from DRAM) is
 * multiplied by x's rows 16 at a time, the float32 tiles stored once and rounded to bfloat16
 * once (store_row_bf16). While the first 16 rows run over a panel, the next panel's rows are
 * asked for (PREFETCHT1): with the hardware's prefetcher alone the 49152 x 576 LM head took 3.05
 * ms (M = 1) and 3.68 ms (M = 16), with this 2.32 and 2.82 (2-core Xeon, family 6 model 207). K
 * must be a multiple of 32 (one x tile's width). Linux gives a process the tiles' register state
 * only when asked (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); where it refuses,
 * bf16_linear keeps VDPBF16PS. */
#include <sys/syscall.h>
long syscall(long number, ...); /* unistd.h declares it only outside strict C11 */
#define AMX_BF16 1
/* Asks once; bf16_linear calls it before its threads start (and its callers hold the GIL). */
static int amx_permitted(void)
{
    static int state; /* 0: not asked yet, 1: granted, -1: refused */
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
    return state > 0;
}
struct amx_tile_config { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };
/* Tiles 0, 1: y's float32 columns 0-15 and 16-31 of a panel (rows x 64 bytes); 2: x (rows x 32
 * bfloat16); 3, 4: the panel's two halves (16 k pairs x 64 bytes). */
static void amx_configure(int rows)
{
    struct amx_tile_config c __attribute__((aligned(64)));
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 3; t++) { c.rows[t] = (uint8_t)rows; c.colsb[t] = 64; }
    for (int t = 3; t < 5; t++) { c.rows[t] = 16; c.colsb[t] = 64; }
    _tile_loadconfig(&c);
}
static void bf16_linear_amx(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                            int64_t M, int64_t N, int64_t K, int num_threads)
{
    const int64_t panels = (N + NR - 1) / NR, pairs = K / 2;
#pragma omp parallel num_threads(num_threads)
    {
        int configured = 0;
        float c[16 * NR] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const uint16_t *pw = packed + p * pairs * NR * 2;
            for (int64_t m0 = 0; m0 < M; m0 += 16) {
                const int rows = M - m0 < 16 ? (int)(M - m0) : 16;
                if (rows != configured) { amx_configure(rows); configured = rows; }
                _tile_zero(0);
                _tile_zero(1);
                for (int64_t k0 = 0; k0 < K; k0 += 32) {
                    const uint16_t *b = pw + (k0 / 2) * NR * 2;
                    if (m0 == 0 && p + 1 < panels) { /* the next panel's same 2 KB, into L2 */
                        const char *next = (const char *)(b + pairs * NR * 2);
                        for (int l = 0; l < 2048; l += 64) _mm_prefetch(next + l, _MM_HINT_T1);
                    }
                    _tile_loadd(2, x + m0 * K + k0, K * (int64_t)sizeof(uint16_t));
                    _tile_loadd(3, b, NR * 2 * (int64_t)sizeof(uint16_t));
                    _tile_loadd(4, b + 32, NR * 2 * (int64_t)sizeof(uint16_t));
                    _tile_dpbf16ps(0, 2, 3);
                    _tile_dpbf16ps(1, 2, 4);
                }
                _tile_stored(0, c, NR * (int64_t)sizeof(float));
                _tile_stored(1, c + 16, NR * (int64_t)sizeof(float));
                for (int i = 0; i < rows; i++)
                    store_row_bf16(y + (m0 + i) * N, p * NR, N, bias, loadv(c + i * NR), loadv(c + i * NR + VEC));
            }
        }
        if (configured) _tile_release();
    }
}
#else
#define AMX_BF16 0
#endif
/* bf16 y[M, N] = x[M, K] @ w^T + bias with w as the pair-packing bf16_linear_pack() left it; the
 * row blocks, the work split and the prefetch as DEFINE_LINEAR's, or the AMX tiles
 * (bf16_linear_amx) where they are built and granted and K is a multiple of 32. Returns 0, or -1
 * when the scratch cannot be allocated. */
int bf16_linear(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y, int64_t M, int64_t N,
                int64_t K, int num_threads)
{
#if AMX_BF16
    if (K % 32 == 0 && amx_permitted()) {
        bf16_linear_amx(x, packed, bias, y, M, N, K, num_threads);
        return 0;
    }
#endif
    int64_t panels = (N + NR - 1) / NR, pairs = (K + 1) / 2;
    int64_t blocks = (M + MR_MAX - 1) / MR_MAX;
    uint32_t *xp = malloc((size_t)(M * pairs) * sizeof(uint32_t));
    if (!xp) return -1;
    for (int64_t b = 0; b < blocks; b++) {
        int64_t m0 = b * M / blocks, m1 = (b + 1) * M / blocks, mt = m1 - m0;
        for (int64_t kk = 0; kk < pairs; kk++)
            for (int64_t i = 0; i < mt; i++) {
                const uint16_t *row = x + (m0 + i) * K;
                uint32_t lo = row[2 * kk], hi = 2 * kk + 1 < K ? row[2 * kk + 1] : 0;
                xp[m0 * pairs + kk * mt + i] = lo | hi << 16;
            }
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < blocks; b++) {
            int64_t m0 = b * M / blocks, m1 = (b + 1) * M / blocks;
            const uint16_t *next = p + 1 < panels && (b > 0 || m1 - m0 >= 3) ? packed + (p + 1) * pairs * NR * 2 : 0;
            DP_BF16[m1 - m0](xp + m0 * pairs, pairs, packed + p * pairs * NR * 2, bias, y + m0 * N, N, p * NR, next);
        }
    free(xp);
    return 0;
}
#endif
