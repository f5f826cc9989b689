/* IQ4_NL, IQ4_XS and MXFP4 vec_dots for AVX-512 (BW, VL; VNNI if present),
 * one weight row against nt tokens: two blocks of 32 per register, each
 * looked up once (vpshufb on its nibbles) and dotted with every token's
 * blocks. Integer sums are exact; the float sums run in 16 lanes per token.
 * Scalar twins: quant_ref.c (IQ4_NL), iq4_mxfp4_scalar.c. */
#include <stddef.h>

#include "quant/iq4_mxfp4.h"

#if defined(IQ4_HAVE_AVX512)
#include <immintrin.h>

#define IQ4_TOKENS 8 /* tokens per pass over a row */

static inline __m512i lut_of(const int8_t *values)
{
    return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)values));
}

/* Two blocks' 64 values from their nibbles (16 bytes each): block 0's low
 * nibbles, its high nibbles, then block 1's, in element order. */
static inline __m512i lut_pair(const uint8_t *qs0, const uint8_t *qs1, __m512i lut)
{
    __m256i t = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)qs1), _mm_loadu_si128((const __m128i *)qs0));
    __m512i a = _mm512_inserti64x4(_mm512_castsi256_si512(t), _mm256_srli_epi16(t, 4), 1);
    a = _mm512_shuffle_i64x2(a, a, _MM_SHUFFLE(3, 1, 2, 0));
    return _mm512_shuffle_epi8(lut, _mm512_and_si512(a, _mm512_set1_epi8(0x0f)));
}

/* y with w's sign, to be multiplied by |w| (unsigned operand). */
static inline __m512i signed_by(__m512i y, __m512i w)
{
    return _mm512_mask_sub_epi8(y, _mm512_movepi8_mask(w), _mm512_setzero_si512(), y);
}

/* 16 int32 sums of 4 products each of w . y. */
static inline __m512i dot_i32(__m512i aw, __m512i ys)
{
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, ys);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(aw, ys), _mm512_set1_epi16(1));
#endif
}

static inline __m512i load_pair(const int8_t *a, const int8_t *b)
{
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

/* ---- IQ4_NL and MXFP4: blocks of 32 against Q8_0 -------------------------- */

static inline float nl32_scale(enum quant_type wt, const uint8_t *blk)
{
    return wt == QUANT_MXFP4 ? quant_e8m0_to_f32_half(((const block_mxfp4 *)blk)->e)
                             : _cvtsh_ss(((const block_iq4_nl *)blk)->d);
}

/* T tokens from t0, blocks i and i + 1 per step; an odd last block is
 * paired with itself at scale 0. */
static inline __attribute__((always_inline)) void nl32_tokens(enum quant_type wt, int T, int nb, float *s,
                                                              size_t s_stride, const uint8_t *x, const void *y,
                                                              size_t y_stride, int t0)
{
    const __m512i lut = lut_of(wt == QUANT_MXFP4 ? quant_mxfp4_values : quant_iq4nl_values);
    const size_t bb = wt == QUANT_MXFP4 ? sizeof(block_mxfp4) : sizeof(block_iq4_nl);
    const size_t qoff = wt == QUANT_MXFP4 ? offsetof(block_mxfp4, qs) : offsetof(block_iq4_nl, qs);
    const block_q8_0 *yt[IQ4_TOKENS];
    __m512 acc[IQ4_TOKENS];
    for (int k = 0; k < T; k++) {
        yt[k] = (const block_q8_0 *)((const uint8_t *)y + (size_t)(t0 + k) * y_stride);
        acc[k] = _mm512_setzero_ps();
    }
    for (int i = 0; i < nb; i += 2) {
        const int i1 = i + 1 < nb ? i + 1 : i;
        const uint8_t *b0 = x + (size_t)i * bb, *b1 = x + (size_t)i1 * bb;
        const float d0 = nl32_scale(wt, b0), d1 = i1 != i ? nl32_scale(wt, b1) : 0.0f;
        __m512i w = lut_pair(b0 + qoff, b1 + qoff, lut);
        __m512i aw = _mm512_abs_epi8(w);
        for (int k = 0; k < T; k++) {
            const block_q8_0 *q0 = yt[k] + i, *q1 = yt[k] + i1;
            __m512i p = dot_i32(aw, signed_by(load_pair(q0->qs, q1->qs), w));
            __m512 d = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(d0 * _cvtsh_ss(q0->d)),
                                            _mm512_set1_ps(d1 * _cvtsh_ss(q1->d)));
            acc[k] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(p), acc[k]);
        }
    }
    for (int k = 0; k < T; k++)
        s[(size_t)(t0 + k) * s_stride] = _mm512_reduce_add_ps(acc[k]);
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

void quant_vec_dot_iq4_nl_q8_0_multi_avx512(int n, int nt, float *s, size_t s_stride, const void *x, const void *y,
                                            size_t y_stride)
{
    nl32_multi(QUANT_IQ4_NL, n, nt, s, s_stride, x, y, y_stride);
}

void quant_vec_dot_mxfp4_q8_0_multi_avx512(int n, int nt, float *s, size_t s_stride, const void *x, const void *y,
                                           size_t y_stride)
{
    nl32_multi(QUANT_MXFP4, n, nt, s, s_stride, x, y, y_stride);
}

void quant_vec_dot_iq4_nl_q8_0_avx512(int n, float *s, const void *x, const void *y)
{
    nl32_tokens(QUANT_IQ4_NL, 1, n / 32, s, 0, x, y, 0, 0);
}

void quant_vec_dot_mxfp4_q8_0_avx512(int n, float *s, const void *x, const void *y)
{
    nl32_tokens(QUANT_MXFP4, 1, n / 32, s, 0, x, y, 0, 0);
}

/* ---- IQ4_XS: super-blocks of 256 against Q8_K ------------------------------- */

/* Blocks 2p and 2p + 1 per step: pair sums times each block's scale (ls -
 * 32) in int32, summed over the super-block exactly (below 2^24 per lane),
 * then one float step per super-block. */
static inline __attribute__((always_inline)) void xs_tokens(int T, int nb, float *s, size_t s_stride,
                                                            const block_iq4_xs *x, const void *y, size_t y_stride,
                                                            int t0)
{
    const __m512i lut = lut_of(quant_iq4nl_values);
    const block_q8_K *yt[IQ4_TOKENS];
    __m512 acc[IQ4_TOKENS];
    for (int k = 0; k < T; k++) {
        yt[k] = (const block_q8_K *)((const uint8_t *)y + (size_t)(t0 + k) * y_stride);
        acc[k] = _mm512_setzero_ps();
    }
    for (int i = 0; i < nb; i++) {
        __m512i sumi[IQ4_TOKENS];
        for (int k = 0; k < T; k++)
            sumi[k] = _mm512_setzero_si512();
        for (int p = 0; p < QK_K / 64; p++) {
            const uint8_t *qs = x[i].qs + 32 * p;
            __m512i w = lut_pair(qs, qs + 16, lut);
            __m512i aw = _mm512_abs_epi8(w);
            __m512i sc = _mm512_mask_blend_epi16(0xffff0000u, _mm512_set1_epi16((short)(quant_iq4xs_scale(&x[i], 2 * p) - 32)),
                                                 _mm512_set1_epi16((short)(quant_iq4xs_scale(&x[i], 2 * p + 1) - 32)));
            for (int k = 0; k < T; k++) {
                __m512i q8 = _mm512_loadu_si512((const void *)(yt[k][i].qs + 64 * p));
                __m512i pairs = _mm512_maddubs_epi16(aw, signed_by(q8, w));
                sumi[k] = _mm512_add_epi32(sumi[k], _mm512_madd_epi16(pairs, sc));
            }
        }
        const float dx = _cvtsh_ss(x[i].d);
        for (int k = 0; k < T; k++)
            acc[k] = _mm512_fmadd_ps(_mm512_set1_ps(dx * yt[k][i].d), _mm512_cvtepi32_ps(sumi[k]), acc[k]);
    }
    for (int k = 0; k < T; k++)
        s[(size_t)(t0 + k) * s_stride] = _mm512_reduce_add_ps(acc[k]);
}

void quant_vec_dot_iq4_xs_q8_K_multi_avx512(int n, int nt, float *s, size_t s_stride, const void *x, const void *y,
                                            size_t y_stride)
{
    int t = 0;
    for (; t + IQ4_TOKENS <= nt; t += IQ4_TOKENS)
        xs_tokens(IQ4_TOKENS, n / QK_K, s, s_stride, x, y, y_stride, t);
    for (; t < nt; t++)
        xs_tokens(1, n / QK_K, s, s_stride, x, y, y_stride, t);
}

void quant_vec_dot_iq4_xs_q8_K_avx512(int n, float *s, const void *x, const void *y)
{
    xs_tokens(1, n / QK_K, s, 0, x, y, 0, 0);
}

#endif
