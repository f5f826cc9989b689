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


/* ---- ggml's exponential ------------------------------------------------------
 * ggml_v_expf of ggml-cpu's vec.h, the exponential in llama.cpp's SwiGLU:
 * e^x = 2^n * e^b with n = round(x * log2 e) (by the 1.5 * 2^23 shift),
 * b = x - n * ln2 (ln2 in two parts) and e^b by a degree-5 polynomial
 * (ARM's optimized routines; constants below from ggml-cpu/vec.h); about
 * 1.5 ulp. Its AVX-512 and AVX2 forms round differently: the AVX-512 one adds
 * the polynomial's 1 inside its last FMA and scales by 2^n exactly (scalef),
 * the AVX2 one adds the 1 and scales by 2^n in one FMA, with bit tricks for
 * |n| > 126. A build follows the form llama.cpp's CPU backend of its ISA
 * runs, so that a SwiGLU output, which the next matmul quantizes, has
 * llama.cpp's bits. The *_lane functions are the scalar twins, lane for lane. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define VMATH_GGML_SHIFT 0x1.8p23f
#define VMATH_GGML_LOG2E 0x1.715476p+0f
#define VMATH_GGML_LN2_HI 0x1.62e4p-1f
#define VMATH_GGML_LN2_LO 0x1.7f7d1cp-20f
#define VMATH_GGML_C5 0x1.0e4020p-7f
#define VMATH_GGML_C4 0x1.573e2ep-5f
#define VMATH_GGML_C3 0x1.555e66p-3f
#define VMATH_GGML_C2 0x1.fffdb6p-2f
#define VMATH_GGML_C1 0x1.ffffecp-1f

static inline uint32_t vmath_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float vmath_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ggml_v_expf's AVX-512 form, one lane. */
static inline float vmath_expf_ggml512_lane(float x)
{
    const float z = fmaf(x, VMATH_GGML_LOG2E, VMATH_GGML_SHIFT), n = z - VMATH_GGML_SHIFT;
    const float b = fmaf(-n, VMATH_GGML_LN2_LO, fmaf(-n, VMATH_GGML_LN2_HI, x));
    if (fabsf(n) > 192)
        return n <= 0 ? 0.0f : INFINITY;
    const float u = b * b;
    const float j = fmaf(fmaf(fmaf(VMATH_GGML_C5, b, VMATH_GGML_C4), u, fmaf(VMATH_GGML_C3, b, VMATH_GGML_C2)), u,
                         fmaf(VMATH_GGML_C1, b, 1.0f));
    return ldexpf(j, (int)n);
}

/* ggml_v_expf's AVX2 form, one lane. */
static inline float vmath_expf_ggml256_lane(float x)
{
    const float z = fmaf(x, VMATH_GGML_LOG2E, VMATH_GGML_SHIFT), n = z - VMATH_GGML_SHIFT;
    const float b = fmaf(-n, VMATH_GGML_LN2_LO, fmaf(-n, VMATH_GGML_LN2_HI, x));
    const uint32_t e = vmath_bits(z) << 23;
    const float k = vmath_from_bits(e + vmath_bits(1.0f));
    const float u = b * b;
    const float j = fmaf(fmaf(fmaf(VMATH_GGML_C5, b, VMATH_GGML_C4), u, fmaf(VMATH_GGML_C3, b, VMATH_GGML_C2)), u,
                         VMATH_GGML_C1 * b);
    if (!(fabsf(n) > 126))
        return fmaf(j, k, k);
    const uint32_t g = n <= 0 ? 0x82000000u : 0;
    const float s1 = vmath_from_bits(g + 0x7f000000u), s2 = vmath_from_bits(e - g);
    if (fabsf(n) > 192)
        return s1 * s1;
    return fmaf(s2, j, s2) * s1;
}

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


/* ggml_v_expf's AVX2 form, 8 lanes (the scalar twin: vmath_expf_ggml256_lane). */
VMATH_INLINE __m256 vmath_expf_ggml8(__m256 x)
{
    const __m256 shift = _mm256_set1_ps(VMATH_GGML_SHIFT), abs_mask = _mm256_set1_ps(-0.0f);
    const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(VMATH_GGML_LOG2E), shift), n = _mm256_sub_ps(z, shift);
    const __m256 b = _mm256_fnmadd_ps(n, _mm256_set1_ps(VMATH_GGML_LN2_LO),
                                      _mm256_fnmadd_ps(n, _mm256_set1_ps(VMATH_GGML_LN2_HI), x));
    const __m256i e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
    const __m256 k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_set1_epi32(0x3f800000)));
    const __m256 an = _mm256_andnot_ps(abs_mask, n);
    const __m256 big = _mm256_cmp_ps(an, _mm256_set1_ps(126), _CMP_GT_OQ);
    const __m256 u = _mm256_mul_ps(b, b);
    const __m256 lo = _mm256_fmadd_ps(_mm256_set1_ps(VMATH_GGML_C3), b, _mm256_set1_ps(VMATH_GGML_C2));
    const __m256 hi = _mm256_fmadd_ps(_mm256_set1_ps(VMATH_GGML_C5), b, _mm256_set1_ps(VMATH_GGML_C4));
    const __m256 j = _mm256_fmadd_ps(_mm256_fmadd_ps(hi, u, lo), u, _mm256_mul_ps(_mm256_set1_ps(VMATH_GGML_C1), b));
    const __m256 normal = _mm256_fmadd_ps(j, k, k);
    if (!_mm256_movemask_ps(big))
        return normal;
    /* |n| > 126: 2^n as s1 * s2 (each a normal float); |n| > 192: s1 * s1 (0 or inf) */
    const __m256i g = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_LE_OQ)),
                                       _mm256_set1_epi32((int)0x82000000u));
    const __m256 s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f000000)));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
    const __m256 huge = _mm256_cmp_ps(an, _mm256_set1_ps(192), _CMP_GT_OQ);
    const __m256 scaled = _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1);
    return _mm256_blendv_ps(_mm256_blendv_ps(normal, scaled, big), _mm256_mul_ps(s1, s1), huge);
}

#if defined(__AVX512F__)

/* ggml_v_expf's AVX-512 form, 16 lanes (the scalar twin: vmath_expf_ggml512_lane). */
VMATH_INLINE __m512 vmath_expf_ggml16(__m512 x)
{
    const __m512 shift = _mm512_set1_ps(VMATH_GGML_SHIFT);
    const __m512 z = _mm512_fmadd_ps(x, _mm512_set1_ps(VMATH_GGML_LOG2E), shift), n = _mm512_sub_ps(z, shift);
    const __m512 b = _mm512_fnmadd_ps(n, _mm512_set1_ps(VMATH_GGML_LN2_LO),
                                      _mm512_fnmadd_ps(n, _mm512_set1_ps(VMATH_GGML_LN2_HI), x));
    const __mmask16 huge = _mm512_cmp_ps_mask(_mm512_abs_ps(n), _mm512_set1_ps(192), _CMP_GT_OQ);
    const __m512 u = _mm512_mul_ps(b, b);
    const __m512 lo = _mm512_fmadd_ps(_mm512_set1_ps(VMATH_GGML_C3), b, _mm512_set1_ps(VMATH_GGML_C2));
    const __m512 hi = _mm512_fmadd_ps(_mm512_set1_ps(VMATH_GGML_C5), b, _mm512_set1_ps(VMATH_GGML_C4));
    const __m512 j = _mm512_fmadd_ps(_mm512_fmadd_ps(hi, u, lo), u,
                                     _mm512_fmadd_ps(_mm512_set1_ps(VMATH_GGML_C1), b, _mm512_set1_ps(1.0f)));
    const __m512 res = _mm512_scalef_ps(j, n);
    if (!huge)
        return res;
    const __mmask16 neg = _mm512_cmp_ps_mask(n, _mm512_setzero_ps(), _CMP_LE_OQ);
    const __m512 limit = _mm512_mask_blend_ps(neg, _mm512_set1_ps(INFINITY), _mm512_setzero_ps());
    return _mm512_mask_blend_ps(huge, res, limit);
}

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
