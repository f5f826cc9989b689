/* quant: GeGLU, gate = gelu(gate) * up, as ggml's CPU backend computes it for
 * Gemma's feed-forward (ggml_geglu_split with GGML_GELU_FP16 defined, the
 * default of ggml-cpu/vec.h):
 *   x <= -10: 0;  x >= 10: x * up;  else: T[f16(x)] * up
 * where f16() rounds to nearest even and T is a table over every f16 value h
 * of f16(gelu_tanh(h)) (kept here for |h| <= 10 only). ggml fills T once at start with
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

#define GELU_LOW (-10.0f)  /* at and below: 0 */
#define GELU_HIGH 10.0f    /* at and above: x */
/* T only needs the f16 values a lookup can meet, |h| up to f16(GELU_HIGH)
 * (an f32 just below 10 rounds to it): magnitudes 0..GELU_MAG_MAX for +h,
 * then the same for -h. 73 KiB of f16 where all 65536 f32 took 256 KiB: a
 * decode step's weights stream through the caches between two GeGLUs, and
 * the smaller table keeps more of itself (its gathers were 2% of a
 * gemma3-1b decode). */
#define GELU_MAG_MAX 0x4900 /* f16 of 10.0 */
#define GELU_NEG_BASE (GELU_MAG_MAX + 1)
#define GELU_ENTRIES (2 * GELU_NEG_BASE)

static quant_f16 g_gelu_table[GELU_ENTRIES + 1]; /* + 1: the SIMD gathers read 4 bytes at an entry */
static pthread_once_t g_gelu_once = PTHREAD_ONCE_INIT;

static float gelu_tanh(float x)
{
    const float coef_a = 0.044715f;
    const float sqrt_2_over_pi = 0.79788456080286535587989211986876f;
    float inner = fmaf(coef_a * x, x, 1.0f);
    return (0.5f * x) * (1.0f + tanhf((sqrt_2_over_pi * x) * inner));
}

static quant_f16 gelu_f16(quant_f16 h) { return quant_f32_to_f16(gelu_tanh(quant_f16_to_f32(h))); }

/* T's entry for f16 h, its magnitude clamped to the table (the callers take
 * |x| >= 10 and NaN elsewhere). */
static inline int gelu_index(quant_f16 h)
{
    int mag = h & 0x7fff;
    return (mag < GELU_MAG_MAX ? mag : GELU_MAG_MAX) + (h >> 15) * GELU_NEG_BASE;
}

static void gelu_table_init(void)
{
    for (int mag = 0; mag <= GELU_MAG_MAX; mag++) {
        g_gelu_table[mag] = gelu_f16((quant_f16)mag);
        g_gelu_table[GELU_NEG_BASE + mag] = gelu_f16((quant_f16)(0x8000 | mag));
    }
}

static const quant_f16 *gelu_table(void)
{
    pthread_once(&g_gelu_once, gelu_table_init);
    return g_gelu_table;
}

quant_f16 quant_gelu_table_entry(quant_f16 h)
{
    if ((h & 0x7fff) > GELU_MAG_MAX) /* outside the table: ggml's entry, computed */
        return gelu_f16(h);
    return gelu_table()[gelu_index(h)];
}

static float gelu_lookup(const quant_f16 *T, float x) { return quant_f16_to_f32(T[gelu_index(quant_f32_to_f16(x))]); }

static void geglu_scalar(const quant_f16 *T, float *gate, const float *up, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        float x = gate[i];
        if (x <= GELU_LOW)
            gate[i] = 0.0f;
        else if (x >= GELU_HIGH || x != x)
            gate[i] = x * up[i];
        else
            gate[i] = gelu_lookup(T, x) * up[i];
    }
}

void quant_geglu_scalar(float *gate, const float *up, int64_t n) { geglu_scalar(gelu_table(), gate, up, n); }

void quant_gelu(float *x, int64_t n)
{
    const quant_f16 *T = gelu_table();
    for (int64_t i = 0; i < n; i++)
        x[i] = x[i] <= GELU_LOW ? 0.0f : x[i] >= GELU_HIGH || x[i] != x[i] ? x[i] : gelu_lookup(T, x[i]);
}

#if defined(QUANT_HAVE_AVX512)
void quant_geglu(float *gate, const float *up, int64_t n)
{
    const quant_f16 *T = gelu_table();
    const __m512 lo = _mm512_set1_ps(GELU_LOW), hi = _mm512_set1_ps(GELU_HIGH);
    const __m512i mag_bits = _mm512_set1_epi32(0x7fff), mag_max = _mm512_set1_epi32(GELU_MAG_MAX);
    const __m512i sign = _mm512_set1_epi32(0x8000), neg_base = _mm512_set1_epi32(GELU_NEG_BASE);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 x = _mm512_loadu_ps(gate + i);
        __m512i h = _mm512_cvtepu16_epi32(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m512i idx = _mm512_min_epu32(_mm512_and_si512(h, mag_bits), mag_max);
        idx = _mm512_mask_add_epi32(idx, _mm512_test_epi32_mask(h, sign), idx, neg_base);
        __m512i e = _mm512_i32gather_epi32(idx, T, 2); /* entry idx in the low half of each dword */
        __m512 t = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(e));
        t = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, hi, _CMP_GE_OQ) | _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), t, x);
        __m512 y = _mm512_mul_ps(t, _mm512_loadu_ps(up + i));
        y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lo, _CMP_LE_OQ), y, _mm512_setzero_ps());
        _mm512_storeu_ps(gate + i, y);
    }
    geglu_scalar(T, gate + i, up + i, n - i);
}
#elif defined(QUANT_HAVE_AVX2)
void quant_geglu(float *gate, const float *up, int64_t n)
{
    const quant_f16 *T = gelu_table();
    const __m256 lo = _mm256_set1_ps(GELU_LOW), hi = _mm256_set1_ps(GELU_HIGH);
    const __m256i mag_bits = _mm256_set1_epi32(0x7fff), mag_max = _mm256_set1_epi32(GELU_MAG_MAX);
    const __m256i low16 = _mm256_set1_epi32(0xffff), neg_base = _mm256_set1_epi32(GELU_NEG_BASE);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(gate + i);
        __m256i h = _mm256_cvtepu16_epi32(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i idx = _mm256_min_epu32(_mm256_and_si256(h, mag_bits), mag_max);
        idx = _mm256_add_epi32(idx, _mm256_and_si256(_mm256_cmpgt_epi32(h, mag_bits), neg_base));
        __m256i e = _mm256_and_si256(_mm256_i32gather_epi32((const int *)T, idx, 2), low16);
        __m128i e16 = _mm_packus_epi32(_mm256_castsi256_si128(e), _mm256_extracti128_si256(e, 1));
        __m256 t = _mm256_cvtph_ps(e16);
        __m256 keep_x = _mm256_or_ps(_mm256_cmp_ps(x, hi, _CMP_GE_OQ), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        t = _mm256_blendv_ps(t, x, keep_x);
        __m256 y = _mm256_mul_ps(t, _mm256_loadu_ps(up + i));
        y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LE_OQ));
        _mm256_storeu_ps(gate + i, y);
    }
    geglu_scalar(T, gate + i, up + i, n - i);
}
#else
void quant_geglu(float *gate, const float *up, int64_t n) { quant_geglu_scalar(gate, up, n); }
#endif
