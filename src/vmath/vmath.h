/* vmath: vector math that the kernels of several modules share (header only;
 * a leaf like status: it depends on nothing and knows no module).
 *
 * vmath_exp16 (AVX-512F) and vmath_exp8 (AVX2 + FMA): e^x per lane. x is
 * clamped to [-87, 88], so the result is a normal float; then
 * e^x = 2^k * e^r with k = round(x / ln2), |r| <= ln2 / 2 (ln2 split in two
 * so r keeps its low bits) and e^r by a degree-6 Taylor polynomial.
 * Relative error about 2e-7. quant's SwiGLU and attn's softmax use them;
 * each is defined only when the including file is compiled for its ISA. */
#ifndef KS_VMATH_H
#define KS_VMATH_H

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define VMATH_INLINE static inline __attribute__((always_inline))

/* e^r for |r| <= ln2 / 2 and k, from x and k = round(x / ln2). */
#define VMATH_EXP_POLY(T, set1, fmadd, fnmadd, x, k, out)                                                \
    do {                                                                                                 \
        T r_ = fnmadd(k, set1(0.693145752f), x);                                                         \
        r_ = fnmadd(k, set1(1.42860677e-6f), r_);                                                        \
        T p_ = set1(1.0f / 720);                                                                         \
        p_ = fmadd(p_, r_, set1(1.0f / 120));                                                            \
        p_ = fmadd(p_, r_, set1(1.0f / 24));                                                             \
        p_ = fmadd(p_, r_, set1(1.0f / 6));                                                              \
        p_ = fmadd(p_, r_, set1(0.5f));                                                                  \
        p_ = fmadd(p_, r_, set1(1.0f));                                                                  \
        out = fmadd(p_, r_, set1(1.0f));                                                                 \
    } while (0)

VMATH_INLINE __m256 vmath_exp8(__m256 x)
{
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 p;
    VMATH_EXP_POLY(__m256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_fnmadd_ps, x, k, p);
    /* 2^k through the exponent field; k is in [-126, 127] after the clamp */
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#if defined(__AVX512F__)
VMATH_INLINE __m512 vmath_exp16(__m512 x)
{
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 p;
    VMATH_EXP_POLY(__m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_fnmadd_ps, x, k, p);
    return _mm512_scalef_ps(p, k);
}
#endif /* __AVX512F__ */

#endif /* __AVX2__ && __FMA__ */
#endif
