/* exp(x) for x <= 0 on the vector lanes of the including kernel: Cephes' expf. The includer
 * defines vec_f (VEC floats) and vec_i32 (VEC int32) as GCC/Clang vector types first; used by
 * paged_decode_attention.c (softmax of shifted scores) and elementwise.c (SiLU). A kernel's
 * compiled library is cached by its source and the local headers it includes (cpu_build.py).
 *
 * x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two for an exact n ln2), exp(r) by its degree-6
 * minimax polynomial, 2^n built in the exponent bits. At most 1.02 ulp from the correctly rounded
 * exp on [-87, 0] (measured every 1e-6); inputs below -87.3 give exp(-87.3) ~ 1e-38. */
#ifndef TANDEM_VEC_EXP_H
#define TANDEM_VEC_EXP_H
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
#endif
