/* quant: element-wise activation kernels of the forward pass. SwiGLU runs
 * over n_tokens x n_ff values per layer, so glibc's scalar expf showed up in
 * prefill profiles; the AVX-512 / AVX2 paths use a polynomial exp with a
 * relative error of about 2e-7, and the scalar path is the reference. */
#include <math.h>

#include "quant/quant_internal.h"

#if defined(QUANT_HAVE_AVX2) || defined(QUANT_HAVE_AVX512)
#include <immintrin.h>
#endif

void quant_swiglu_scalar(float *gate, const float *up, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        float g = gate[i];
        gate[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

/* exp(x) = 2^k * e^r, k = round(x / ln2), |r| <= ln2 / 2, e^r by a degree-6
 * Taylor polynomial; ln2 is split in two so r keeps its low bits. */
#define EXP_POLY(T, set1, fmadd, fnmadd, mul, x, k, out)                                                         \
    do {                                                                                                       \
        T r_ = fnmadd(k, set1(0.693145752f), x);                                                               \
        r_ = fnmadd(k, set1(1.42860677e-6f), r_);                                                              \
        T p_ = set1(1.0f / 720);                                                                               \
        p_ = fmadd(p_, r_, set1(1.0f / 120));                                                                  \
        p_ = fmadd(p_, r_, set1(1.0f / 24));                                                                   \
        p_ = fmadd(p_, r_, set1(1.0f / 6));                                                                    \
        p_ = fmadd(p_, r_, set1(0.5f));                                                                        \
        p_ = fmadd(p_, r_, set1(1.0f));                                                                        \
        out = fmadd(p_, r_, set1(1.0f));                                                                       \
    } while (0)

#if defined(QUANT_HAVE_AVX512)
static inline __m512 exp_512(__m512 x)
{
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 p;
    EXP_POLY(__m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_fnmadd_ps, _mm512_mul_ps, x, k, p);
    return _mm512_scalef_ps(p, k);
}

void quant_swiglu(float *gate, const float *up, int64_t n)
{
    const __m512 one = _mm512_set1_ps(1.0f);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 g = _mm512_loadu_ps(gate + i);
        __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp_512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        _mm512_storeu_ps(gate + i, _mm512_mul_ps(silu, _mm512_loadu_ps(up + i)));
    }
    quant_swiglu_scalar(gate + i, up + i, n - i);
}
#elif defined(QUANT_HAVE_AVX2)
static inline __m256 exp_256(__m256 x)
{
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 p;
    EXP_POLY(__m256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_fnmadd_ps, _mm256_mul_ps, x, k, p);
    /* 2^k through the exponent field; k is in [-126, 127] after the clamp */
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

void quant_swiglu(float *gate, const float *up, int64_t n)
{
    const __m256 one = _mm256_set1_ps(1.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp_256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        _mm256_storeu_ps(gate + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
    }
    quant_swiglu_scalar(gate + i, up + i, n - i);
}
#else
void quant_swiglu(float *gate, const float *up, int64_t n) { quant_swiglu_scalar(gate, up, n); }
#endif
