/* quant: element-wise activation kernels of the forward pass.
 *
 * SwiGLU is ggml_vec_swiglu_f32 bit for bit: the SwiGLU output is the input
 * of the down projection, which rounds it to Q8_K/Q8_0, and an input one ulp
 * away from llama.cpp's rounds to another level often enough to move logits
 * by 1e-2 (README, "Correctness against llama.cpp"). So whole vectors of 16
 * (AVX-512) or 8 (AVX2) go through ggml's exponential in the form of that
 * ISA (vmath_expf_ggml16 / vmath_expf_ggml8), the rest through libm's expf,
 * as ggml does; silu(g) = g / (1 + e^(0 - g)), times up. A build without
 * SIMD is ggml's scalar path: libm for every element. */
#include <math.h>

#include "quant/quant_internal.h"
#include "vmath/vmath.h"

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

/* The lanes of the SIMD path below, one element at a time. */
#if defined(QUANT_HAVE_AVX512)
#define SWIGLU_LANES 16
#define SWIGLU_EXP_LANE vmath_expf_ggml512_lane
#elif defined(QUANT_HAVE_AVX2)
#define SWIGLU_LANES 8
#define SWIGLU_EXP_LANE vmath_expf_ggml256_lane
#else
#define SWIGLU_LANES 1 /* no SIMD: every element through libm */
#endif

void quant_swiglu_twin(float *gate, const float *up, int64_t n)
{
    int64_t n_vec = 0;
#if SWIGLU_LANES > 1
    n_vec = n - n % SWIGLU_LANES;
    for (int64_t i = 0; i < n_vec; i++) {
        float g = gate[i], silu = g / (1.0f + SWIGLU_EXP_LANE(0.0f - g));
        gate[i] = silu * up[i];
    }
#endif
    quant_swiglu_scalar(gate + n_vec, up + n_vec, n - n_vec);
}

#if defined(QUANT_HAVE_AVX512)
void quant_swiglu(float *gate, const float *up, int64_t n)
{
    const __m512 one = _mm512_set1_ps(1.0f);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 g = _mm512_loadu_ps(gate + i);
        __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, vmath_expf_ggml16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        _mm512_storeu_ps(gate + i, _mm512_mul_ps(silu, _mm512_loadu_ps(up + i)));
    }
    quant_swiglu_scalar(gate + i, up + i, n - i);
}
#elif defined(QUANT_HAVE_AVX2)
void quant_swiglu(float *gate, const float *up, int64_t n)
{
    const __m256 one = _mm256_set1_ps(1.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, vmath_expf_ggml8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        _mm256_storeu_ps(gate + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
    }
    quant_swiglu_scalar(gate + i, up + i, n - i);
}
#else
void quant_swiglu(float *gate, const float *up, int64_t n) { quant_swiglu_scalar(gate, up, n); }
#endif

/* ---- gpt-oss's clamped SwiGLU ----------------------------------------------- */

void quant_swiglu_oai_scalar(float *gate, const float *up, int64_t n)
{
    const float alpha = QUANT_SWIGLU_OAI_ALPHA, limit = QUANT_SWIGLU_OAI_LIMIT;
    for (int64_t i = 0; i < n; i++) {
        float x = gate[i] < limit ? gate[i] : limit;
        float y = up[i] < -limit ? -limit : up[i] > limit ? limit : up[i];
        gate[i] = x / (1.0f + expf(alpha * -x)) * (y + 1.0f);
    }
}

#if defined(QUANT_HAVE_AVX512)
void quant_swiglu_oai(float *gate, const float *up, int64_t n)
{
    const __m512 one = _mm512_set1_ps(1.0f), limit = _mm512_set1_ps(QUANT_SWIGLU_OAI_LIMIT);
    const __m512 neg_limit = _mm512_set1_ps(-QUANT_SWIGLU_OAI_LIMIT), neg_alpha = _mm512_set1_ps(-QUANT_SWIGLU_OAI_ALPHA);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 x = _mm512_min_ps(_mm512_loadu_ps(gate + i), limit);
        __m512 y = _mm512_min_ps(_mm512_max_ps(_mm512_loadu_ps(up + i), neg_limit), limit);
        __m512 glu = _mm512_div_ps(x, _mm512_add_ps(one, vmath_exp16(_mm512_mul_ps(neg_alpha, x))));
        _mm512_storeu_ps(gate + i, _mm512_mul_ps(glu, _mm512_add_ps(y, one)));
    }
    quant_swiglu_oai_scalar(gate + i, up + i, n - i);
}
#elif defined(QUANT_HAVE_AVX2)
void quant_swiglu_oai(float *gate, const float *up, int64_t n)
{
    const __m256 one = _mm256_set1_ps(1.0f), limit = _mm256_set1_ps(QUANT_SWIGLU_OAI_LIMIT);
    const __m256 neg_limit = _mm256_set1_ps(-QUANT_SWIGLU_OAI_LIMIT), neg_alpha = _mm256_set1_ps(-QUANT_SWIGLU_OAI_ALPHA);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_min_ps(_mm256_loadu_ps(gate + i), limit);
        __m256 y = _mm256_min_ps(_mm256_max_ps(_mm256_loadu_ps(up + i), neg_limit), limit);
        __m256 glu = _mm256_div_ps(x, _mm256_add_ps(one, vmath_exp8(_mm256_mul_ps(neg_alpha, x))));
        _mm256_storeu_ps(gate + i, _mm256_mul_ps(glu, _mm256_add_ps(y, one)));
    }
    quant_swiglu_oai_scalar(gate + i, up + i, n - i);
}
#else
void quant_swiglu_oai(float *gate, const float *up, int64_t n) { quant_swiglu_oai_scalar(gate, up, n); }
#endif
