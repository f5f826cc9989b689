/* IQ4_NL, IQ4_XS and MXFP4 vec_dots for AVX2, one weight row against nt
 * tokens: each weight block is looked up once (pshufb on its nibbles) and
 * dotted with every token's block. Integer sums are exact (|level| <= 127,
 * |q8| <= 127: a maddubs pair stays below 2^15). The float operations are
 * those of the kernels llama.cpp runs (iq4_mxfp4.h):
 *  - IQ4_NL, MXFP4: per token one chain over the blocks, acc = fma(isum,
 *    d_w * d_y, acc), as ggml's repacked iq4_nl_8x8 / mxfp4_8x8 GEMV and
 *    GEMM do; 8 tokens at a time, one per lane;
 *  - IQ4_XS: ggml's AVX2 vec_dot: per super-block 8 int32 lanes with the
 *    6-bit scales applied, one fma into 8 float lanes, a horizontal sum at
 *    the end.
 * Scalar twins: quant_ref.c (IQ4_NL), iq4_mxfp4_scalar.c. */
#include <math.h>
#include <stddef.h>

#include "quant/iq4_mxfp4.h"
#include "vmath/vmath_simd.h"

#if defined(IQ4_HAVE_AVX2)
#include <immintrin.h>

#define IQ4_LANES 8  /* IQ4_NL, MXFP4: tokens per pass, one per lane */
#define XS_TOKENS 4  /* IQ4_XS: tokens per pass over a row (an 8-lane accumulator each) */

/* ggml's hsum_float_8: high half + low half, then pairs, then the last two. */
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

/* ---- IQ4_NL and MXFP4: blocks of 32 against Q8_0 -------------------------- */

struct nl32 {
    __m256i lut;
    size_t bytes;  /* per block */
    size_t qs_off; /* of the nibbles in a block */
    bool e8m0;     /* MXFP4's exponent scale, else an f16 d */
};

static inline struct nl32 nl32_of(enum quant_type wt)
{
    if (wt == QUANT_MXFP4)
        return (struct nl32){lut_of(quant_mxfp4_values), sizeof(block_mxfp4), offsetof(block_mxfp4, qs), true};
    return (struct nl32){lut_of(quant_iq4nl_values), sizeof(block_iq4_nl), offsetof(block_iq4_nl, qs), false};
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

/* One token: the chain in a scalar register. */
static inline __attribute__((always_inline)) float nl32_one(const struct nl32 *f, int nb, const uint8_t *x,
                                                            const block_q8_0 *y)
{
    float acc = 0.0f;
    for (int i = 0; i < nb; i++) {
        const uint8_t *blk = x + (size_t)i * f->bytes;
        __m256i w = lut_block(blk + f->qs_off, f->lut);
        int isum = vmath_hsum8_epi32(dot_i32(w, _mm256_loadu_si256((const __m256i *)y[i].qs)));
        acc = fmaf((float)isum, nl32_scale(f, blk) * _cvtsh_ss(y[i].d), acc);
    }
    return acc;
}

/* IQ4_LANES tokens from t0, token k's chain in lane k. */
static inline __attribute__((always_inline)) void nl32_lanes(const struct nl32 *f, int nb, float *s, size_t s_stride,
                                                             const uint8_t *x, const void *y, size_t y_stride, int t0)
{
    const block_q8_0 *yt[IQ4_LANES];
    for (int k = 0; k < IQ4_LANES; k++)
        yt[k] = q8_0_row(y, y_stride, t0 + k);
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < nb; i++) {
        const uint8_t *blk = x + (size_t)i * f->bytes;
        __m256i w = lut_block(blk + f->qs_off, f->lut);
        __m256i p[IQ4_LANES];
        quant_f16 dy[IQ4_LANES];
        for (int k = 0; k < IQ4_LANES; k++) {
            p[k] = dot_i32(w, _mm256_loadu_si256((const __m256i *)yt[k][i].qs));
            dy[k] = yt[k][i].d;
        }
        __m256 d = _mm256_mul_ps(_mm256_set1_ps(nl32_scale(f, blk)), vmath_load8_f16(dy));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hsum_8x8(p)), d, acc);
    }
    float out[IQ4_LANES];
    _mm256_storeu_ps(out, acc);
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
    const struct nl32 f = nl32_of(QUANT_IQ4_NL);
    *s = nl32_one(&f, n / 32, x, y);
}

void quant_vec_dot_mxfp4_q8_0_avx2(int n, float *s, const void *x, const void *y)
{
    const struct nl32 f = nl32_of(QUANT_MXFP4);
    *s = nl32_one(&f, n / 32, x, y);
}

/* ---- IQ4_XS: super-blocks of 256 against Q8_K ------------------------------- */

/* Each block's pair sums times its scale (ls - 32) in int32, summed over the
 * super-block exactly (below 2^24 per lane), then one fma per super-block. */
static inline __attribute__((always_inline)) void xs_tokens(int T, int nb, float *s, size_t s_stride,
                                                            const block_iq4_xs *x, const void *y, size_t y_stride,
                                                            int t0)
{
    const __m256i lut = lut_of(quant_iq4nl_values);
    const block_q8_K *yt[XS_TOKENS];
    __m256 acc[XS_TOKENS];
    for (int k = 0; k < T; k++) {
        yt[k] = (const block_q8_K *)((const uint8_t *)y + (size_t)(t0 + k) * y_stride);
        acc[k] = _mm256_setzero_ps();
    }
    for (int i = 0; i < nb; i++) {
        __m256i sumi[XS_TOKENS];
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
            acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(dx * yt[k][i].d), _mm256_cvtepi32_ps(sumi[k]), acc[k]);
    }
    for (int k = 0; k < T; k++)
        s[(size_t)(t0 + k) * s_stride] = hsum_256(acc[k]);
}

void quant_vec_dot_iq4_xs_q8_K_multi_avx2(int n, int nt, float *s, size_t s_stride, const void *x, const void *y,
                                          size_t y_stride)
{
    int t = 0;
    for (; t + XS_TOKENS <= nt; t += XS_TOKENS)
        xs_tokens(XS_TOKENS, n / QK_K, s, s_stride, x, y, y_stride, t);
    for (; t < nt; t++)
        xs_tokens(1, n / QK_K, s, s_stride, x, y, y_stride, t);
}

void quant_vec_dot_iq4_xs_q8_K_avx2(int n, float *s, const void *x, const void *y)
{
    xs_tokens(1, n / QK_K, s, 0, x, y, 0, 0);
}

#endif
