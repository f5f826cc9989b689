/* IQ4_NL, IQ4_XS and MXFP4 vec_dots for AVX-512 (BW, VL; VNNI if present),
 * one weight row against nt tokens, with the float operations of the
 * kernels llama.cpp runs (iq4_mxfp4.h, iq4_mxfp4_avx2.c):
 *  - IQ4_NL, MXFP4: per token one chain over the blocks, acc = fma(isum,
 *    d_w * d_y, acc). A block is looked up once and dotted with two tokens
 *    per 512-bit register; 16 tokens run at a time, one per lane of the
 *    chain;
 *  - IQ4_XS: two blocks per register, the pair's int32 lanes folded into
 *    ggml's 8 per super-block (exact), then its one fma into 8 float lanes.
 * Scalar twins: quant_ref.c (IQ4_NL), iq4_mxfp4_scalar.c. */
#include <math.h>
#include <stddef.h>

#include "quant/iq4_mxfp4.h"
#include "vmath/vmath_simd.h"

#if defined(IQ4_HAVE_AVX512)
#include <immintrin.h>

#define IQ4_LANES 16 /* IQ4_NL, MXFP4: tokens per pass, one per lane */
#define XS_TOKENS 8  /* IQ4_XS: tokens per pass over a row */

static inline float hsum_256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Lane k = the sum of p[k]'s 8 lanes. */
static inline __m256i hsum_8x8(const __m256i p[8])
{
    __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* A block's 32 values from its 16 bytes of nibbles (low nibbles first). */
static inline __m256i lut_block(const uint8_t *qs, __m256i lut)
{
    __m128i t = _mm_loadu_si128((const __m128i *)qs);
    __m256i idx = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0f));
    return _mm256_shuffle_epi8(lut, idx);
}

/* int32 sums of 4 products of |w| (unsigned) and y given w's sign. */
static inline __m256i dot_i32_256(__m256i w, __m256i y)
{
    __m256i aw = _mm256_abs_epi8(w);
    __m256i sy = _mm256_mask_sub_epi8(y, _mm256_movepi8_mask(w), _mm256_setzero_si256(), y);
#if defined(__AVX512VNNI__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, sy);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sy), _mm256_set1_epi16(1));
#endif
}

static inline __m512i dot_i32_512(__m512i aw, __m512i w, __m512i y)
{
    __m512i sy = _mm512_mask_sub_epi8(y, _mm512_movepi8_mask(w), _mm512_setzero_si512(), y);
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, sy);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(aw, sy), _mm512_set1_epi16(1));
#endif
}

static inline __m512i load_pair(const int8_t *a, const int8_t *b)
{
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

/* ---- IQ4_NL and MXFP4: blocks of 32 against Q8_0 -------------------------- */

struct nl32 {
    __m256i lut;
    size_t bytes;  /* per block */
    size_t qs_off; /* of the nibbles in a block */
    bool e8m0;     /* MXFP4's exponent scale, else an f16 d */
};

static inline struct nl32 nl32_of(enum quant_type wt)
{
    const int8_t *v = wt == QUANT_MXFP4 ? quant_mxfp4_values : quant_iq4nl_values;
    __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)v));
    if (wt == QUANT_MXFP4)
        return (struct nl32){lut, sizeof(block_mxfp4), offsetof(block_mxfp4, qs), true};
    return (struct nl32){lut, sizeof(block_iq4_nl), offsetof(block_iq4_nl, qs), false};
}

static inline float nl32_scale(const struct nl32 *f, const uint8_t *blk)
{
    if (f->e8m0)
        return quant_e8m0_to_f32_half(blk[0]);
    quant_f16 d;
    memcpy(&d, blk, sizeof d);
    return _cvtsh_ss(d);
}

static inline const block_q8_0 *q8_0_row(const void *y, size_t y_stride, int t)
{
    return (const block_q8_0 *)((const uint8_t *)y + (size_t)t * y_stride);
}

static inline __attribute__((always_inline)) float nl32_one(const struct nl32 *f, int nb, const uint8_t *x,
                                                            const block_q8_0 *y)
{
    float acc = 0.0f;
    for (int i = 0; i < nb; i++) {
        const uint8_t *blk = x + (size_t)i * f->bytes;
        __m256i w = lut_block(blk + f->qs_off, f->lut);
        int isum = vmath_hsum8_epi32(dot_i32_256(w, _mm256_loadu_si256((const __m256i *)y[i].qs)));
        acc = fmaf((float)isum, nl32_scale(f, blk) * _cvtsh_ss(y[i].d), acc);
    }
    return acc;
}

/* IQ4_LANES tokens from t0: tokens 2j and 2j + 1 share a register for the
 * dot, token k's chain is lane k. */
static inline __attribute__((always_inline)) void nl32_lanes(const struct nl32 *f, int nb, float *s, size_t s_stride,
                                                             const uint8_t *x, const void *y, size_t y_stride, int t0)
{
    const block_q8_0 *yt[IQ4_LANES];
    for (int k = 0; k < IQ4_LANES; k++)
        yt[k] = q8_0_row(y, y_stride, t0 + k);
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < nb; i++) {
        const uint8_t *blk = x + (size_t)i * f->bytes;
        __m512i w = _mm512_broadcast_i64x4(lut_block(blk + f->qs_off, f->lut));
        __m512i aw = _mm512_abs_epi8(w);
        __m256i p[IQ4_LANES];
        quant_f16 dy[IQ4_LANES];
        for (int k = 0; k < IQ4_LANES; k += 2) {
            __m512i d2 = dot_i32_512(aw, w, load_pair(yt[k][i].qs, yt[k + 1][i].qs));
            p[k / 2] = _mm512_castsi512_si256(d2);
            p[IQ4_LANES / 2 + k / 2] = _mm512_extracti64x4_epi64(d2, 1);
            dy[k] = yt[k][i].d, dy[k + 1] = yt[k + 1][i].d;
        }
        /* p[j] is token 2j's, p[8 + j] token 2j + 1's: interleave the two sums */
        __m256i even = hsum_8x8(p), odd = hsum_8x8(p + IQ4_LANES / 2);
        __m512i isum = _mm512_permutex2var_epi32(_mm512_castsi256_si512(even),
                                                 _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23),
                                                 _mm512_castsi256_si512(odd));
        __m512 d = _mm512_mul_ps(_mm512_set1_ps(nl32_scale(f, blk)), vmath_load16_f16(dy));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), d, acc);
    }
    float out[IQ4_LANES];
    _mm512_storeu_ps(out, acc);
    for (int k = 0; k < IQ4_LANES; k++)
        s[(size_t)(t0 + k) * s_stride] = out[k];
}

static inline __attribute__((always_inline)) void nl32_multi(enum quant_type wt, int n, int nt, float *s,
                                                             size_t s_stride, const void *x, const void *y,
                                                             size_t y_stride)
{
    const struct nl32 f = nl32_of(wt);
    int t = 0;
    for (; t + IQ4_LANES <= nt; t += IQ4_LANES)
        nl32_lanes(&f, n / 32, s, s_stride, x, y, y_stride, t);
    for (; t < nt; t++)
        s[(size_t)t * s_stride] = nl32_one(&f, n / 32, x, q8_0_row(y, y_stride, t));
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
    const struct nl32 f = nl32_of(QUANT_IQ4_NL);
    *s = nl32_one(&f, n / 32, x, y);
}

void quant_vec_dot_mxfp4_q8_0_avx512(int n, float *s, const void *x, const void *y)
{
    const struct nl32 f = nl32_of(QUANT_MXFP4);
    *s = nl32_one(&f, n / 32, x, y);
}

/* ---- IQ4_XS: super-blocks of 256 against Q8_K ------------------------------- */

/* Two blocks per register: both blocks' 16 values of 4 products times their
 * scales (ls - 32), then the halves added into ggml's 8 lanes (exact). */
static inline __m512i lut_pair(const uint8_t *qs, __m512i lut)
{
    __m256i t = _mm256_loadu_si256((const __m256i *)qs);
    __m512i a = _mm512_inserti64x4(_mm512_castsi256_si512(t), _mm256_srli_epi16(t, 4), 1);
    a = _mm512_shuffle_i64x2(a, a, _MM_SHUFFLE(3, 1, 2, 0)); /* block 0 low, high nibbles, then block 1's */
    return _mm512_shuffle_epi8(lut, _mm512_and_si512(a, _mm512_set1_epi8(0x0f)));
}

static inline __attribute__((always_inline)) void xs_tokens(int T, int nb, float *s, size_t s_stride,
                                                            const block_iq4_xs *x, const void *y, size_t y_stride,
                                                            int t0)
{
    const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)quant_iq4nl_values));
    const block_q8_K *yt[XS_TOKENS];
    __m256 acc[XS_TOKENS];
    for (int k = 0; k < T; k++) {
        yt[k] = (const block_q8_K *)((const uint8_t *)y + (size_t)(t0 + k) * y_stride);
        acc[k] = _mm256_setzero_ps();
    }
    for (int i = 0; i < nb; i++) {
        __m512i sumi[XS_TOKENS];
        for (int k = 0; k < T; k++)
            sumi[k] = _mm512_setzero_si512();
        for (int p = 0; p < QK_K / 64; p++) {
            __m512i w = lut_pair(x[i].qs + 32 * p, lut);
            __m512i aw = _mm512_abs_epi8(w);
            __m512i sc = _mm512_mask_blend_epi16(0xffff0000u,
                                                 _mm512_set1_epi16((short)(quant_iq4xs_scale(&x[i], 2 * p) - 32)),
                                                 _mm512_set1_epi16((short)(quant_iq4xs_scale(&x[i], 2 * p + 1) - 32)));
            __mmask64 neg = _mm512_movepi8_mask(w);
            for (int k = 0; k < T; k++) {
                __m512i q8 = _mm512_loadu_si512((const void *)(yt[k][i].qs + 64 * p));
                __m512i sy = _mm512_mask_sub_epi8(q8, neg, _mm512_setzero_si512(), q8);
                sumi[k] = _mm512_add_epi32(sumi[k], _mm512_madd_epi16(_mm512_maddubs_epi16(aw, sy), sc));
            }
        }
        const float dx = _cvtsh_ss(x[i].d);
        for (int k = 0; k < T; k++) {
            __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(sumi[k]), _mm512_extracti64x4_epi64(sumi[k], 1));
            acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(dx * yt[k][i].d), _mm256_cvtepi32_ps(s8), acc[k]);
        }
    }
    for (int k = 0; k < T; k++)
        s[(size_t)(t0 + k) * s_stride] = hsum_256(acc[k]);
}

void quant_vec_dot_iq4_xs_q8_K_multi_avx512(int n, int nt, float *s, size_t s_stride, const void *x, const void *y,
                                            size_t y_stride)
{
    int t = 0;
    for (; t + XS_TOKENS <= nt; t += XS_TOKENS)
        xs_tokens(XS_TOKENS, n / QK_K, s, s_stride, x, y, y_stride, t);
    for (; t < nt; t++)
        xs_tokens(1, n / QK_K, s, s_stride, x, y, y_stride, t);
}

void quant_vec_dot_iq4_xs_q8_K_avx512(int n, float *s, const void *x, const void *y)
{
    xs_tokens(1, n / QK_K, s, 0, x, y, 0, 0);
}

#endif
