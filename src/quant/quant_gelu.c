/* quant: GeGLU, gate = gelu(gate) * up, as ggml's CPU backend computes it for
 * Gemma's feed-forward (ggml_geglu_split with GGML_GELU_FP16 defined, the
 * default of ggml-cpu/vec.h):
 *   x <= -10: 0;  x >= 10: x * up;  else: T[f16(x)] * up
 * where f16() rounds to nearest even and T is a table over every f16 value h
 * of f16(gelu_tanh(h)). ggml fills T once at start with
 *   gelu(x) = (0.5 x) * (1 + tanhf((sqrt(2/pi) x) * fma(0.044715 x, x, 1)))
 * (the compiler fuses 1 + a*x*x into one FMA; the unfused form differs in one
 * of the 65536 entries). Every path here looks up the same table and
 * multiplies once, so the SIMD paths and the scalar twin agree bit for bit. */
#include <math.h>
#include <pthread.h>

#include "quant/quant_internal.h"

#if defined(QUANT_HAVE_AVX2) || defined(QUANT_HAVE_AVX512)
#include <immintrin.h>
#endif

#define GELU_TABLE_SIZE (1 << 16)
#define GELU_LOW (-10.0f)  /* at and below: 0 */
#define GELU_HIGH 10.0f    /* at and above: x */

static float g_gelu_table[GELU_TABLE_SIZE]; /* T[h] as f32, for h = every f16 bit pattern */
static quant_f16 g_gelu_table_f16[GELU_TABLE_SIZE];
static pthread_once_t g_gelu_once = PTHREAD_ONCE_INIT;

static float gelu_tanh(float x)
{
    const float coef_a = 0.044715f;
    const float sqrt_2_over_pi = 0.79788456080286535587989211986876f;
    float inner = fmaf(coef_a * x, x, 1.0f);
    return (0.5f * x) * (1.0f + tanhf((sqrt_2_over_pi * x) * inner));
}

static void gelu_table_init(void)
{
    for (int i = 0; i < GELU_TABLE_SIZE; i++) {
        quant_f16 h = quant_f32_to_f16(gelu_tanh(quant_f16_to_f32((quant_f16)i)));
        g_gelu_table_f16[i] = h;
        g_gelu_table[i] = quant_f16_to_f32(h);
    }
}

static const float *gelu_table(void)
{
    pthread_once(&g_gelu_once, gelu_table_init);
    return g_gelu_table;
}

quant_f16 quant_gelu_table_entry(quant_f16 h)
{
    gelu_table();
    return g_gelu_table_f16[h];
}

static void geglu_scalar(const float *T, float *gate, const float *up, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        float x = gate[i];
        if (x <= GELU_LOW)
            gate[i] = 0.0f;
        else if (x >= GELU_HIGH)
            gate[i] = x * up[i];
        else
            gate[i] = T[quant_f32_to_f16(x)] * up[i];
    }
}

void quant_geglu_scalar(float *gate, const float *up, int64_t n) { geglu_scalar(gelu_table(), gate, up, n); }

void quant_gelu(float *x, int64_t n)
{
    const float *T = gelu_table();
    for (int64_t i = 0; i < n; i++)
        x[i] = x[i] <= GELU_LOW ? 0.0f : x[i] >= GELU_HIGH ? x[i] : T[quant_f32_to_f16(x[i])];
}

#if defined(QUANT_HAVE_AVX512)
void quant_geglu(float *gate, const float *up, int64_t n)
{
    const float *T = gelu_table();
    const __m512 lo = _mm512_set1_ps(GELU_LOW), hi = _mm512_set1_ps(GELU_HIGH);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 x = _mm512_loadu_ps(gate + i);
        __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512 t = _mm512_i32gather_ps(_mm512_cvtepu16_epi32(h), T, 4);
        t = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, hi, _CMP_GE_OQ), t, x);
        __m512 y = _mm512_mul_ps(t, _mm512_loadu_ps(up + i));
        y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lo, _CMP_LE_OQ), y, _mm512_setzero_ps());
        _mm512_storeu_ps(gate + i, y);
    }
    geglu_scalar(T, gate + i, up + i, n - i);
}
#elif defined(QUANT_HAVE_AVX2)
void quant_geglu(float *gate, const float *up, int64_t n)
{
    const float *T = gelu_table();
    const __m256 lo = _mm256_set1_ps(GELU_LOW), hi = _mm256_set1_ps(GELU_HIGH);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(gate + i);
        __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256 t = _mm256_i32gather_ps(T, _mm256_cvtepu16_epi32(h), 4);
        t = _mm256_blendv_ps(t, x, _mm256_cmp_ps(x, hi, _CMP_GE_OQ));
        __m256 y = _mm256_mul_ps(t, _mm256_loadu_ps(up + i));
        y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LE_OQ));
        _mm256_storeu_ps(gate + i, y);
    }
    geglu_scalar(T, gate + i, up + i, n - i);
}
#else
void quant_geglu(float *gate, const float *up, int64_t n) { quant_geglu_scalar(gate, up, n); }
#endif
