/* IQ4_NL, IQ4_XS and MXFP4 vec_dots for AVX2, one weight row against nt
 * tokens: each weight block is looked up once (pshufb on its nibbles) and
 * dotted with every token's block. Integer sums are exact (|level| <= 127,
 * |q8| <= 127: a maddubs pair stays below 2^15); the float sums run in 8
 * lanes per token. Scalar twins: quant_ref.c (IQ4_NL), iq4_mxfp4_scalar.c. */
#include "quant/iq4_mxfp4.h"

#if defined(IQ4_HAVE_AVX2)
#include <immintrin.h>

#define IQ4_TOKENS 4 /* tokens per pass over a row: 2 accumulators each stay in registers */

static inline float hsum_256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The 16 levels in both 128-bit lanes, for pshufb. */
static inline __m256i lut_of(const int8_t *values)
{
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)values));
}

/* A block's 32 values from its 16 bytes of nibbles: low nibbles are
 * elements 0..15, high nibbles 16..31. */
static inline __m256i lut_block(const uint8_t *qs, __m256i lut)
{
    __m128i t = _mm_loadu_si128((const __m128i *)qs);
    __m256i idx = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0f));
    return _mm256_shuffle_epi8(lut, idx);
}

/* 16 int16 pair sums of w . y (signed bytes): |w| times y with w's sign. */
static inline __m256i dot_pairs(__m256i w, __m256i y)
{
    return _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(y, w));
}

static inline __m256i dot_i32(__m256i w, __m256i y) { return _mm256_madd_epi16(dot_pairs(w, y), _mm256_set1_epi16(1)); }

static inline const block_q8_0 *q8_0_row(const void *y, size_t y_stride, int t)
{
    return (const block_q8_0 *)((const uint8_t *)y + (size_t)t * y_stride);
}

/* ---- IQ4_NL and MXFP4: blocks of 32 against Q8_0 -------------------------- */

/* T tokens from t0: block i into accumulator i % 2 of each token. */
static inline __attribute__((always_inline)) void nl32_tokens(enum quant_type wt, int T, int nb, float *s,
                                                              size_t s_stride, const uint8_t *x, const void *y,
                                                              size_t y_stride, int t0)
{
    const __m256i lut = lut_of(wt == QUANT_MXFP4 ? quant_mxfp4_values : quant_iq4nl_values);
    const size_t bb = wt == QUANT_MXFP4 ? sizeof(block_mxfp4) : sizeof(block_iq4_nl);
    const block_q8_0 *yt[IQ4_TOKENS];
    __m256 acc[IQ4_TOKENS][2];
    for (int k = 0; k < T; k++) {
        yt[k] = q8_0_row(y, y_stride, t0 + k);
        acc[k][0] = acc[k][1] = _mm256_setzero_ps();
    }
    for (int i = 0; i < nb; i++) {
        const uint8_t *blk = x + (size_t)i * bb;
        float dw;
        __m256i w;
        if (wt == QUANT_MXFP4) {
            dw = quant_e8m0_to_f32_half(((const block_mxfp4 *)blk)->e);
            w = lut_block(((const block_mxfp4 *)blk)->qs, lut);
        } else {
            dw = _cvtsh_ss(((const block_iq4_nl *)blk)->d);
            w = lut_block(((const block_iq4_nl *)blk)->qs, lut);
        }
        for (int k = 0; k < T; k++) {
            const block_q8_0 *b = yt[k] + i;
            __m256i p = dot_i32(w, _mm256_loadu_si256((const __m256i *)b->qs));
            __m256 d = _mm256_set1_ps(dw * _cvtsh_ss(b->d));
            acc[k][i & 1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(p), acc[k][i & 1]);
        }
    }
    for (int k = 0; k < T; k++)
        s[(size_t)(t0 + k) * s_stride] = hsum_256(_mm256_add_ps(acc[k][0], acc[k][1]));
}

static inline __attribute__((always_inline)) void nl32_multi(enum quant_type wt, int n, int nt, float *s,
                                                             size_t s_stride, const void *x, const void *y,
                                                             size_t y_stride)
{
    int t = 0;
    for (; t + IQ4_TOKENS <= nt; t += IQ4_TOKENS)
        nl32_tokens(wt, IQ4_TOKENS, n / 32, s, s_stride, x, y, y_stride, t);
    for (; t < nt; t++)
        nl32_tokens(wt, 1, n / 32, s, s_stride, x, y, y_stride, t);
}

void quant_vec_dot_iq4_nl_q8_0_multi_avx2(int n, int nt, float *s, size_t s_stride, const void *x, const void *y,
                                          size_t y_stride)
{
    nl32_multi(QUANT_IQ4_NL, n, nt, s, s_stride, x, y, y_stride);
}

void quant_vec_dot_mxfp4_q8_0_multi_avx2(int n, int nt, float *s, size_t s_stride, const void *x, const void *y,
                                         size_t y_stride)
{
    nl32_multi(QUANT_MXFP4, n, nt, s, s_stride, x, y, y_stride);
}

void quant_vec_dot_iq4_nl_q8_0_avx2(int n, float *s, const void *x, const void *y)
{
    nl32_tokens(QUANT_IQ4_NL, 1, n / 32, s, 0, x, y, 0, 0);
}

void quant_vec_dot_mxfp4_q8_0_avx2(int n, float *s, const void *x, const void *y)
{
    nl32_tokens(QUANT_MXFP4, 1, n / 32, s, 0, x, y, 0, 0);
}

/* ---- IQ4_XS: super-blocks of 256 against Q8_K ------------------------------- */

/* Each block's pair sums times its scale (ls - 32) in int32, summed over the
 * super-block exactly (below 2^24 per lane), then one float step per super-block. */
static inline __attribute__((always_inline)) void xs_tokens(int T, int nb, float *s, size_t s_stride,
                                                            const block_iq4_xs *x, const void *y, size_t y_stride,
                                                            int t0)
{
    const __m256i lut = lut_of(quant_iq4nl_values);
    const block_q8_K *yt[IQ4_TOKENS];
    __m256 acc[IQ4_TOKENS][2];
    for (int k = 0; k < T; k++) {
        yt[k] = (const block_q8_K *)((const uint8_t *)y + (size_t)(t0 + k) * y_stride);
        acc[k][0] = acc[k][1] = _mm256_setzero_ps();
    }
    for (int i = 0; i < nb; i++) {
        __m256i sumi[IQ4_TOKENS];
        for (int k = 0; k < T; k++)
            sumi[k] = _mm256_setzero_si256();
        for (int ib = 0; ib < QK_K / 32; ib++) {
            __m256i w = lut_block(x[i].qs + 16 * ib, lut);
            __m256i sc = _mm256_set1_epi16((short)(quant_iq4xs_scale(&x[i], ib) - 32));
            for (int k = 0; k < T; k++) {
                __m256i q8 = _mm256_loadu_si256((const __m256i *)(yt[k][i].qs + 32 * ib));
                sumi[k] = _mm256_add_epi32(sumi[k], _mm256_madd_epi16(dot_pairs(w, q8), sc));
            }
        }
        const float dx = _cvtsh_ss(x[i].d);
        for (int k = 0; k < T; k++)
            acc[k][i & 1] = _mm256_fmadd_ps(_mm256_set1_ps(dx * yt[k][i].d), _mm256_cvtepi32_ps(sumi[k]), acc[k][i & 1]);
    }
    for (int k = 0; k < T; k++)
        s[(size_t)(t0 + k) * s_stride] = hsum_256(_mm256_add_ps(acc[k][0], acc[k][1]));
}

void quant_vec_dot_iq4_xs_q8_K_multi_avx2(int n, int nt, float *s, size_t s_stride, const void *x, const void *y,
                                          size_t y_stride)
{
    int t = 0;
    for (; t + IQ4_TOKENS <= nt; t += IQ4_TOKENS)
        xs_tokens(IQ4_TOKENS, n / QK_K, s, s_stride, x, y, y_stride, t);
    for (; t < nt; t++)
        xs_tokens(1, n / QK_K, s, s_stride, x, y, y_stride, t);
}

void quant_vec_dot_iq4_xs_q8_K_avx2(int n, float *s, const void *x, const void *y)
{
    xs_tokens(1, n / QK_K, s, 0, x, y, 0, 0);
}

#endif
