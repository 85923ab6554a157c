/* Loads, multiply-add, broadcast and the lane sum on the vector lanes of the including kernel. The includer
 * defines VEC (floats per vector), vec_f, vec_u16 and vec_u32 (GCC/Clang vector types of VEC
 * lanes) and includes <immintrin.h> where the CPU has AVX2 or AVX-512 first; used by
 * paged_decode_attention.c and paged_prefill_attention.c. A kernel's compiled library is cached by
 * its source and the local headers it includes (cpu_build.py). */
#ifndef TANDEM_VEC_OPS_H
#define TANDEM_VEC_OPS_H
/* bfloat16 -> float32: the bfloat16 bits are the float32's upper half. */
static inline float bf16_to_f32(uint16_t x)
{
    union { uint32_t u; float f; } v = { (uint32_t)x << 16 };
    return v.f;
}
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
/* a * b + c, rounded once where the CPU has FMA (GCC at -std=c11 does not contract a * b + c). */
static inline vec_f vfma(vec_f a, vec_f b, vec_f c)
{
#if defined(__AVX512F__)
    return (vec_f)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX2__) && defined(__FMA__)
    return (vec_f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}
static inline vec_f vbroadcast(float x)
{
#if defined(__AVX512F__)
    return (vec_f)_mm512_set1_ps(x);
#elif defined(__AVX2__)
    return (vec_f)_mm256_set1_ps(x);
#else
    vec_f v;
    for (int i = 0; i < VEC; ++i) v[i] = x; /* GCC builds this lane by lane (insertps) on x86 */
    return v;
#endif
}
/* The sum of v's VEC lanes as a tree (halves added pairwise): log2(VEC) dependent vector adds
 * where a lane-by-lane sum is VEC dependent scalar adds, the longest chain of a dot product. */
static inline float vsum(vec_f v)
{
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v); /* in registers; generic halves went through the stack */
#elif defined(__AVX2__)
    __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#else
    float total = 0.0f;
    for (int i = 0; i < VEC; ++i) total += v[i];
    return total;
#endif
}

/* Lane i of the result is the sum of a[i]'s VEC lanes: VEC horizontal sums at once, by a
 * transpose-and-add tree (adjacent vectors interleaved and added, then 64-bit pairs, then 128-bit
 * lanes): 45 shuffles and adds for 16 sums with AVX-512 (21 for 8 with AVX2), where one vsum
 * each takes 8-9 dependent ones. The sums' order differs from vsum's. */
static inline vec_f vsum_lanes(const vec_f *a)
{
#if defined(__AVX512F__)
    __m512 s[8], t[4], v[2];
    for (int k = 0; k < 8; ++k) {
        const __m512 x = (__m512)a[2 * k], y = (__m512)a[2 * k + 1];
        s[k] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
    }
    for (int k = 0; k < 4; ++k) {
        const __m512d x = _mm512_castps_pd(s[2 * k]), y = _mm512_castps_pd(s[2 * k + 1]);
        t[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int k = 0; k < 2; ++k)
        v[k] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return (vec_f)_mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
#elif defined(__AVX2__)
    __m256 s[4], t[2];
    for (int k = 0; k < 4; ++k) {
        const __m256 x = (__m256)a[2 * k], y = (__m256)a[2 * k + 1];
        s[k] = _mm256_add_ps(_mm256_unpacklo_ps(x, y), _mm256_unpackhi_ps(x, y));
    }
    for (int k = 0; k < 2; ++k) {
        const __m256d x = _mm256_castps_pd(s[2 * k]), y = _mm256_castps_pd(s[2 * k + 1]);
        t[k] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    return (vec_f)_mm256_add_ps(_mm256_permute2f128_ps(t[0], t[1], 0x20), _mm256_permute2f128_ps(t[0], t[1], 0x31));
#else
    vec_f r;
    for (int i = 0; i < VEC; ++i) r[i] = vsum(a[i]);
    return r;
#endif
}
/* Lane-wise maximum (no NaN among the inputs). */
static inline vec_f vmax(vec_f a, vec_f b)
{
#if defined(__AVX512F__)
    return (vec_f)_mm512_max_ps((__m512)a, (__m512)b);
#elif defined(__AVX2__)
    return (vec_f)_mm256_max_ps((__m256)a, (__m256)b);
#else
    vec_f r;
    for (int i = 0; i < VEC; ++i) r[i] = a[i] > b[i] ? a[i] : b[i];
    return r;
#endif
}
#endif
