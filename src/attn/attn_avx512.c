/* AVX-512 kernel set.
 *
 * Scores: each (query row, token) pair gives one 16-lane vector whose
 * horizontal sum is the score; sixteen such vectors are reduced together by
 * a transposed tree (unpack/shuffle + add), so no per-score horizontal sum
 * is paid. Rows go in blocks of NR = 4, 2 or 1, and a block's 16 vectors
 * cover 16 / NR tokens.
 * Quantized K (needs VNNI and VBMI): the row's nibbles or int8 values are
 * gathered with one byte permute and dotted against the int8 query with
 * vpdpbusd as unsigned bytes; the offset that makes them unsigned (8 for q4_0,
 * 128 for q8_0) is folded into the accumulator's start value, -offset times the
 * query's byte sums, computed once per page.
 * V: one block at a time is widened to f32 in registers (the 4- and 5-bit
 * types through a table of their levels times d, plus m) and FMA'd into the
 * accumulators of every row.
 * bf16, q4_1, q5_0, q5_1, iq4_nl and iq3_nl K: decoded the same way and scored against
 * the f32 query with FMAs, through the float reduction. */
#include "attn/attn_internal.h"
#include "vmath/vmath.h"
#include "vmath/vmath_simd.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX2__) && \
    defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#include <math.h>
#include <string.h>

#define AVX512_ON 1
#define ALWAYS_INLINE static inline __attribute__((always_inline))

enum { LANES = 16, ROW_BLOCK = 4, Q4_CHUNK = 4 /* blocks per 64-byte vector */, Q8_CHUNK = 2 };

/* ---- transposed reductions ------------------------------------------------- */

/* Lane 4L + i: sum of the four floats of vector i in 128-bit lane L. */
ALWAYS_INLINE __m512 red4(__m512 a, __m512 b, __m512 c, __m512 d)
{
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    __m512d x = _mm512_castps_pd(ab), y = _mm512_castps_pd(cd);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}

/* From four red4 results y_g: lane 4g + i is the full sum of vector i of group g. */
ALWAYS_INLINE __m512 red4x4(__m512 y0, __m512 y1, __m512 y2, __m512 y3)
{
    __m512 z01 = _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 z23 = _mm512_add_ps(_mm512_shuffle_f32x4(y2, y3, _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_f32x4(y2, y3, _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(z01, z23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Lane tl * nr + r of z is the score of row r0 + r at token t0 + tl; store
 * the first n_valid tokens of each row. */
ALWAYS_INLINE void store_scores(__m512 z, int nr, const struct attn_rows *rows, int r0, int t0, int n_valid)
{
    static const int32_t to_row_major[3][LANES] = {
        {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
        {0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15},
        {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15},
    };
    int T = LANES / nr;
    float buf[LANES];
    _mm512_storeu_ps(buf, _mm512_permutexvar_ps(_mm512_loadu_si512(to_row_major[nr == 4 ? 2 : nr - 1]), z));
    for (int r = 0; r < nr; r++) {
        float *dst = rows->s + (size_t)(r0 + r) * rows->stride + t0;
        if (n_valid >= T)
            memcpy(dst, buf + r * T, (size_t)T * sizeof(float));
        else
            for (int tl = 0; tl < n_valid; tl++)
                dst[tl] = buf[r * T + tl];
    }
}

/* Run dots(t, v) for the 16 / nr tokens from t0 (clamped to the last valid
 * row, whose repeated scores are not stored), reducing in groups of four. */
#define SCORE_TOKENS(nr, t0, n_tok, DOTS)                                                                   \
    do {                                                                                                     \
        __m512 y_[4];                                                                                        \
        for (int g_ = 0; g_ < 4; g_++)                                               \
        {                                                                                                    \
            __m512 v_[4];                                                                                    \
            for (int u_ = 0; u_ < 4 / (nr); u_++)                                    \
            {                                                                                                \
                int tt_ = (t0) + g_ * (4 / (nr)) + u_;                                                       \
                int t = tt_ < (n_tok) ? tt_ : (n_tok) - 1;                                                   \
                __m512 *v = v_ + u_ * (nr);                                                                  \
                DOTS;                                                                                        \
            }                                                                                                \
            y_[g_] = red4(v_[0], v_[1], v_[2], v_[3]);                                                       \
        }                                                                                                    \
        z = red4x4(y_[0], y_[1], y_[2], y_[3]);                                                              \
    } while (0)

/* ---- float K ----------------------------------------------------------------- */

/* 16 values of a float type (f32, f16 or bf16, the high half of an f32) as f32. */
ALWAYS_INLINE __m512 load16(const void *p, enum quant_type t)
{
    if (t == QUANT_F16)
        return vmath_load16_f16(p);
    if (t == QUANT_BF16)
        return vmath_load16_bf16(p);
    return _mm512_loadu_ps(p);
}

ALWAYS_INLINE size_t elem_bytes(enum quant_type t) { return t == QUANT_F32 ? 4 : 2; }

ALWAYS_INLINE bool is_block_type(enum quant_type t) { return t != QUANT_F32 && t != QUANT_F16 && t != QUANT_BF16; }

/* An iq3_nl block through a table of its 8 levels times d: lane i of the
 * index vectors takes qs[i % 8] shifted by the two bits of value i's (and
 * i + 16's) eighth, and the third bit from qh. */
ALWAYS_INLINE void decode_iq3_nl(const block_iq3_nl *blk, __m512 *x0, __m512 *x1)
{
    const __m512i shift0 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    const __m512i three = _mm512_set1_epi32(3), four = _mm512_set1_epi32(4);
    uint64_t q;
    uint32_t qh;
    memcpy(&q, blk->qs, sizeof q);
    memcpy(&qh, blk->qh, sizeof qh);
    __m512 d = _mm512_cvtph_ps(_mm256_set1_epi16((short)blk->d));
    __m128i levels = _mm_loadl_epi64((const __m128i *)quant_iq3nl_values);
    __m512 tab = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(levels)), d);
    __m512i x = _mm512_cvtepu8_epi32(_mm_set1_epi64x((long long)q));
    __m512i i0 = _mm512_and_si512(_mm512_srlv_epi32(x, shift0), three);
    __m512i i1 = _mm512_and_si512(_mm512_srlv_epi32(x, _mm512_add_epi32(shift0, four)), three);
    i0 = _mm512_mask_or_epi32(i0, (__mmask16)qh, i0, four);
    i1 = _mm512_mask_or_epi32(i1, (__mmask16)(qh >> LANES), i1, four);
    *x0 = _mm512_permutexvar_ps(i0, tab);
    *x1 = _mm512_permutexvar_ps(i1, tab);
}

/* The 32 values of block b of a q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl or iq3_nl row,
 * dequantized, values 0-15 in *x0 and 16-31 in *x1: the 4-bit and 5-bit
 * types through a table of their 16 or 32 levels times d (plus m) indexed by
 * the values, built once per block; q8_0 by widening. */
ALWAYS_INLINE void decode_block(const uint8_t *row, enum quant_type t, int b, __m512 *x0, __m512 *x1)
{
    const __m512 lo16 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 sixteen = _mm512_set1_ps(16.0f);
    if (t == QUANT_Q8_0) {
        const block_q8_0 *blk = (const block_q8_0 *)row + b;
        __m512 d = _mm512_cvtph_ps(_mm256_set1_epi16((short)blk->d));
        *x0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)blk->qs))));
        *x1 = _mm512_mul_ps(
            d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk->qs + LANES)))));
        return;
    }
    if (t == QUANT_IQ3_NL) {
        decode_iq3_nl((const block_iq3_nl *)row + b, x0, x1);
        return;
    }
    /* every other type has a 2-byte d first and its 16 nibble bytes last */
    size_t bb = attn_row_bytes(t, QK8_0);
    const uint8_t *blk = row + (size_t)b * bb, *qs = blk + bb - QK8_0 / 2;
    quant_f16 dh, mh = 0;
    memcpy(&dh, blk, sizeof dh);
    if (t == QUANT_Q4_1 || t == QUANT_Q5_1)
        memcpy(&mh, blk + 2, sizeof mh);
    __m512 d = _mm512_cvtph_ps(_mm256_set1_epi16((short)dh)), m = _mm512_cvtph_ps(_mm256_set1_epi16((short)mh));
    __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    __m512i i0 = x, i1 = _mm512_srli_epi32(x, 4); /* permutexvar reads the low 4 bits */
    if (t == QUANT_Q4_0 || t == QUANT_Q4_1 || t == QUANT_IQ4_NL) {
        __m512 tab;
        if (t == QUANT_Q4_0)
            tab = _mm512_mul_ps(_mm512_sub_ps(lo16, _mm512_set1_ps(8.0f)), d);
        else if (t == QUANT_Q4_1)
            tab = _mm512_fmadd_ps(lo16, d, m);
        else
            tab = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)quant_iq4nl_values))), d);
        *x0 = _mm512_permutexvar_ps(i0, tab);
        *x1 = _mm512_permutexvar_ps(i1, tab);
        return;
    }
    /* q5_0 / q5_1: bit 4 of the index is the value's bit in qh, and permutex2var's table choice */
    uint32_t qh;
    memcpy(&qh, blk + (t == QUANT_Q5_1 ? 4 : 2), sizeof qh);
    const __m512i low4 = _mm512_set1_epi32(0x0F), bit4 = _mm512_set1_epi32(0x10);
    i0 = _mm512_mask_or_epi32(_mm512_and_si512(i0, low4), (__mmask16)qh, _mm512_and_si512(i0, low4), bit4);
    i1 = _mm512_mask_or_epi32(i1, (__mmask16)(qh >> LANES), i1, bit4);
    __m512 ta, tb;
    if (t == QUANT_Q5_0) {
        ta = _mm512_mul_ps(_mm512_sub_ps(lo16, sixteen), d);
        tb = _mm512_mul_ps(lo16, d);
    } else {
        ta = _mm512_fmadd_ps(lo16, d, m);
        tb = _mm512_fmadd_ps(_mm512_add_ps(lo16, sixteen), d, m);
    }
    *x0 = _mm512_permutex2var_ps(ta, i0, tb);
    *x1 = _mm512_permutex2var_ps(ta, i1, tb);
}

/* v[i] = per-lane products of block-type K row kt with query row i, over
 * every block; two partial sums per row halve the FMA dependency chain. */
ALWAYS_INLINE void block_dots(const uint8_t *kt, enum quant_type t, const float *q, int d, int nr, __m512 *v)
{
    __m512 w[ROW_BLOCK];
    for (int i = 0; i < nr; i++) {
        v[i] = _mm512_setzero_ps();
        w[i] = _mm512_setzero_ps();
    }
    for (int b = 0; b < d / QK8_0; b++) {
        __m512 k0, k1;
        decode_block(kt, t, b, &k0, &k1);
        for (int i = 0; i < nr; i++) {
            v[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + (size_t)i * d + b * QK8_0), k0, v[i]);
            w[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + (size_t)i * d + b * QK8_0 + LANES), k1, w[i]);
        }
    }
    for (int i = 0; i < nr; i++)
        v[i] = _mm512_add_ps(v[i], w[i]);
}

/* v[i] = elementwise products of K row kt with query row i, summed over
 * chunks; two partial sums per row halve the FMA dependency chain. */
ALWAYS_INLINE void float_dots(const uint8_t *kt, enum quant_type t, const float *q, int d, int nr, __m512 *v)
{
    if (is_block_type(t)) {
        block_dots(kt, t, q, d, nr, v);
        return;
    }
    size_t eb = elem_bytes(t);
    __m512 w[ROW_BLOCK];
    for (int i = 0; i < nr; i++) {
        v[i] = _mm512_setzero_ps();
        w[i] = _mm512_setzero_ps();
    }
    int c = 0;
    for (; c + 2 * LANES <= d; c += 2 * LANES) {
        __m512 k0 = load16(kt + (size_t)c * eb, t), k1 = load16(kt + (size_t)(c + LANES) * eb, t);
        for (int i = 0; i < nr; i++) {
            v[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + (size_t)i * d + c), k0, v[i]);
            w[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + (size_t)i * d + c + LANES), k1, w[i]);
        }
    }
    if (c < d) {
        __m512 k0 = load16(kt + (size_t)c * eb, t);
        for (int i = 0; i < nr; i++)
            v[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + (size_t)i * d + c), k0, v[i]);
    }
    for (int i = 0; i < nr; i++)
        v[i] = _mm512_add_ps(v[i], w[i]);
}

ALWAYS_INLINE void float_score_block(const uint8_t *k, enum quant_type f16, int n_tok, const struct attn_rows *rows,
                                     int r0, int nr)
{
    int d = rows->dim;
    size_t rb = attn_row_bytes(f16, d);
    const float *q = rows->q + (size_t)r0 * d;
    for (int t0 = 0; t0 < n_tok; t0 += LANES / nr) {
        __m512 z;
        SCORE_TOKENS(nr, t0, n_tok, float_dots(ATTN_ROW(rows, k, t, rb), f16, q, d, nr, v));
        store_scores(z, nr, rows, r0, t0, n_tok - t0);
    }
}

ALWAYS_INLINE void float_score(const uint8_t *k, enum quant_type f16, int n_tok, const struct attn_rows *rows)
{
    int r = 0;
    for (; r + 4 <= rows->n; r += 4)
        float_score_block(k, f16, n_tok, rows, r, 4);
    if (r + 2 <= rows->n) {
        float_score_block(k, f16, n_tok, rows, r, 2);
        r += 2;
    }
    if (r < rows->n)
        float_score_block(k, f16, n_tok, rows, r, 1);
}

static void score_f32_avx512(const uint8_t *k, int n_tok, const struct attn_rows *rows)
{
    float_score(k, QUANT_F32, n_tok, rows);
}

static void score_f16_avx512(const uint8_t *k, int n_tok, const struct attn_rows *rows)
{
    float_score(k, QUANT_F16, n_tok, rows);
}

/* ---- quantized K --------------------------------------------------------------- */

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define AVX512_QUANT_K 1

/* One query row over one chunk of K blocks, in the byte order of the gathered
 * K bytes; bias is -offset * (query bytes summed per int32 lane). */
struct qchunk {
    __m512i q0, q1; /* q4_0: elements 0-15 / 16-31 of each of 4 blocks; q8_0: 2 blocks in q0 */
    __m512i bias;
    __m512 dq;      /* per lane: the query block's scale */
};

enum { MAX_CHUNKS = 8 }; /* head_dim up to 512 for q4_0, 256 for q8_0; larger goes to AVX2 */

static void prep_q4(const struct attn_rows *rows, int r, int b0, int nbk, struct qchunk *out)
{
    int nb = rows->dim / QK8_0;
    const block_q8_0 *q = rows->q8 + (size_t)r * nb + b0;
    __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
    for (int j = 0; j < nbk; j++) {
        __mmask16 m = (__mmask16)(0xF << (4 * j));
        lo = _mm512_mask_broadcast_i32x4(lo, m, _mm_loadu_si128((const __m128i *)q[j].qs));
        hi = _mm512_mask_broadcast_i32x4(hi, m, _mm_loadu_si128((const __m128i *)(q[j].qs + QK8_0 / 2)));
    }
    __m512i ones = _mm512_set1_epi8(1);
    __m512i sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, lo), ones, hi);
    out->q0 = lo;
    out->q1 = hi;
    out->bias = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 3));
    __m512 d = _mm512_maskz_loadu_ps((__mmask16)((1u << nbk) - 1), rows->q8d + (size_t)r * nb + b0);
    out->dq = _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0), d);
}

static void prep_q8(const struct attn_rows *rows, int r, int b0, int nbk, struct qchunk *out)
{
    int nb = rows->dim / QK8_0;
    const block_q8_0 *q = rows->q8 + (size_t)r * nb + b0;
    __m512i x = _mm512_setzero_si512();
    for (int j = 0; j < nbk; j++)
        x = _mm512_mask_broadcast_i64x4(x, (__mmask8)(0xF << (4 * j)), _mm256_loadu_si256((const __m256i *)q[j].qs));
    __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), x);
    out->q0 = x;
    out->q1 = _mm512_setzero_si512();
    out->bias = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 7));
    __m512 d = _mm512_maskz_loadu_ps((__mmask16)((1u << nbk) - 1), rows->q8d + (size_t)r * nb + b0);
    out->dq = _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), d);
}

/* K bytes of one chunk of a row, gathered to match struct qchunk, and the
 * K scale of each lane. */
struct kchunk {
    __m512i k0, k1;
    __m512 dk;
};

/* q4_0 chunk: up to 4 blocks of 18 bytes (f16 scale, 16 nibble bytes). */
ALWAYS_INLINE struct kchunk load_q4(const uint8_t *kc, __mmask64 ma, __mmask64 mb)
{
    /* byte o of the gather: block o / 16, nibble byte o % 16; block 3 comes from the load at +8 */
    const __m512i gather = _mm512_set_epi8(
        127, 126, 125, 124, 123, 122, 121, 120, 119, 118, 117, 116, 115, 114, 113, 112, /* 64 + 56 - 8 + e */
        53, 52, 51, 50, 49, 48, 47, 46, 45, 44, 43, 42, 41, 40, 39, 38, 35, 34, 33, 32, 31, 30, 29, 28, 27, 26, 25, 24,
        23, 22, 21, 20, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2);
    const __m512i scales = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 27, 27, 27, 27, 18, 18,
                                            18, 18, 9, 9, 9, 9, 0, 0, 0, 0);
    __m512i a = _mm512_maskz_loadu_epi8(ma, kc), b = _mm512_maskz_loadu_epi8(mb, kc + 8);
    __m512i x = _mm512_permutex2var_epi8(a, gather, b), m = _mm512_set1_epi8(0x0F);
    struct kchunk r = {
        _mm512_and_si512(x, m),
        _mm512_and_si512(_mm512_srli_epi16(x, 4), m),
        _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(scales, a))),
    };
    return r;
}

/* q8_0 chunk: up to 2 blocks of 34 bytes (f16 scale, 32 int8); the bytes are
 * made unsigned by adding 128 (xor of the sign bit). */
ALWAYS_INLINE struct kchunk load_q8(const uint8_t *kc, __mmask64 ma, __mmask64 mb)
{
    const __m512i gather = _mm512_set_epi8(
        127, 126, 125, 124, 123, 122, 121, 120, 119, 118, 117, 116, 115, 114, 113, 112, 111, 110, 109, 108, 107, 106,
        105, 104, 103, 102, 101, 100, 99, 98, 97, 96, /* 64 + 36 - 4 + e */
        33, 32, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5,
        4, 3, 2);
    const __m512i scales = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 17, 17, 17, 17, 17, 17,
                                            17, 17, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512i a = _mm512_maskz_loadu_epi8(ma, kc), b = _mm512_maskz_loadu_epi8(mb, kc + 4);
    struct kchunk r = {
        _mm512_xor_si512(_mm512_permutex2var_epi8(a, gather, b), _mm512_set1_epi8((char)0x80)),
        _mm512_setzero_si512(),
        _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(scales, a))),
    };
    return r;
}

ALWAYS_INLINE __m512 quant_dot(struct kchunk k, const struct qchunk *q, bool q4)
{
    __m512i acc = _mm512_dpbusd_epi32(q->bias, k.k0, q->q0);
    if (q4)
        acc = _mm512_dpbusd_epi32(acc, k.k1, q->q1);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(k.dk, q->dq));
}

/* v[i] = per-lane contributions of K row kt to the score of row i over all chunks. */
ALWAYS_INLINE void quant_dots(const uint8_t *kt, bool q4, int nch, const struct qchunk *qc, const __mmask64 *mask,
                              int nr, __m512 *v)
{
    size_t chunk_bytes = q4 ? Q4_CHUNK * sizeof(block_q4_0) : Q8_CHUNK * sizeof(block_q8_0);
    struct kchunk k = q4 ? load_q4(kt, mask[0], mask[1]) : load_q8(kt, mask[0], mask[1]);
    for (int i = 0; i < nr; i++) v[i] = quant_dot(k, &qc[i * nch], q4);
    for (int c = 1; c < nch; c++) {
        const uint8_t *kc = kt + c * chunk_bytes;
        k = q4 ? load_q4(kc, mask[2 * c], mask[2 * c + 1]) : load_q8(kc, mask[2 * c], mask[2 * c + 1]);
        for (int i = 0; i < nr; i++) v[i] = _mm512_add_ps(v[i], quant_dot(k, &qc[i * nch + c], q4));
    }
}

/* red4 on int32 lanes: lane 4L + i is the sum of vector i's four lanes in
 * 128-bit lane L. For q4_0 that is one K block, so four rows' block dots
 * are reduced in exact integer arithmetic and scaled once per lane. */
ALWAYS_INLINE __m512i red4i(__m512i a, __m512i b, __m512i c, __m512i d)
{
    __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
}

/* Four rows' scores for one q4_0 token as a red4 result: lane 4L + i holds
 * row i's share from block L of each chunk; dqm[c] lane 4L + i is the query
 * scale of row i, block L. */
ALWAYS_INLINE __m512 q4_token_rows4(const uint8_t *kt, int nch, const struct qchunk *qc, const __m512 *dqm,
                                    const __mmask64 *mask)
{
    __m512 y = _mm512_setzero_ps();
    for (int c = 0; c < nch; c++) {
        struct kchunk k = load_q4(kt + c * Q4_CHUNK * sizeof(block_q4_0), mask[2 * c], mask[2 * c + 1]);
        __m512i d[ROW_BLOCK];
        for (int i = 0; i < ROW_BLOCK; i++) {
            const struct qchunk *q = &qc[i * nch + c];
            d[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(q->bias, k.k0, q->q0), k.k1, q->q1);
        }
        __m512 sum = _mm512_cvtepi32_ps(red4i(d[0], d[1], d[2], d[3]));
        y = _mm512_fmadd_ps(sum, _mm512_mul_ps(k.dk, dqm[c]), y);
    }
    return y;
}

ALWAYS_INLINE void quant_score_block(const uint8_t *k, bool q4, int nch, int n_tok, const struct attn_rows *rows,
                                     int r0, int nr)
{
    int nb = rows->dim / QK8_0, per = q4 ? Q4_CHUNK : Q8_CHUNK;
    size_t rb = attn_quant_row_bytes(q4, rows->dim);
    size_t bb = q4 ? sizeof(block_q4_0) : sizeof(block_q8_0);
    int shift = q4 ? 8 : 4; /* second load's offset */
    struct qchunk qc[ROW_BLOCK * MAX_CHUNKS];
    __mmask64 mask[2 * MAX_CHUNKS];
    for (int c = 0; c < nch; c++) {
        int nbk = nb - c * per < per ? nb - c * per : per;
        mask[2 * c] = vmath_byte_mask((int)(nbk * bb));
        mask[2 * c + 1] = vmath_byte_mask((int)(nbk * bb) - shift);
        for (int i = 0; i < nr; i++)
            (q4 ? prep_q4 : prep_q8)(rows, r0 + i, c * per, nbk, &qc[i * nch + c]);
    }
    if (q4 && nr == ROW_BLOCK) {
        __m512 dqm[MAX_CHUNKS];
        for (int c = 0; c < nch; c++) {
            dqm[c] = qc[c].dq;
            for (int i = 1; i < ROW_BLOCK; i++)
                dqm[c] = _mm512_mask_mov_ps(dqm[c], (__mmask16)(0x1111 << i), qc[i * nch + c].dq);
        }
        for (int t0 = 0; t0 < n_tok; t0 += LANES / ROW_BLOCK) {
            __m512 y[4];
            for (int g = 0; g < 4; g++) {
                int t = t0 + g < n_tok ? t0 + g : n_tok - 1;
                y[g] = q4_token_rows4(ATTN_ROW(rows, k, t, rb), nch, qc, dqm, mask);
            }
            store_scores(red4x4(y[0], y[1], y[2], y[3]), ROW_BLOCK, rows, r0, t0, n_tok - t0);
        }
        return;
    }
    for (int t0 = 0; t0 < n_tok; t0 += LANES / nr) {
        __m512 z;
        SCORE_TOKENS(nr, t0, n_tok, quant_dots(ATTN_ROW(rows, k, t, rb), q4, nch, qc, mask, nr, v));
        store_scores(z, nr, rows, r0, t0, n_tok - t0);
    }
}

/* nch == 1 (head_dim 128 for q4_0) gets its own copy so the query stays in registers. */
ALWAYS_INLINE void quant_score_rows(const uint8_t *k, bool q4, int nch, int n_tok, const struct attn_rows *rows)
{
    int r = 0;
    for (; r + 4 <= rows->n; r += 4)
        quant_score_block(k, q4, nch, n_tok, rows, r, 4);
    if (r + 2 <= rows->n) {
        quant_score_block(k, q4, nch, n_tok, rows, r, 2);
        r += 2;
    }
    if (r < rows->n)
        quant_score_block(k, q4, nch, n_tok, rows, r, 1);
}

ALWAYS_INLINE void quant_score(const uint8_t *k, bool q4, int n_tok, const struct attn_rows *rows)
{
    int nb = rows->dim / QK8_0, per = q4 ? Q4_CHUNK : Q8_CHUNK;
    int nch = (nb + per - 1) / per;
    if (nch > MAX_CHUNKS)
        attn_kernels_avx2()->score[kv_type_index(q4 ? QUANT_Q4_0 : QUANT_Q8_0)](k, n_tok, rows);
    else if (nch == 1)
        quant_score_rows(k, q4, 1, n_tok, rows);
    else if (nch == 2)
        quant_score_rows(k, q4, 2, n_tok, rows);
    else
        quant_score_rows(k, q4, nch, n_tok, rows);
}

static void score_q8_0_avx512(const uint8_t *k, int n_tok, const struct attn_rows *rows)
{
    quant_score(k, false, n_tok, rows);
}

static void score_q4_0_avx512(const uint8_t *k, int n_tok, const struct attn_rows *rows)
{
    quant_score(k, true, n_tok, rows);
}
#endif

/* ---- V accumulation ------------------------------------------------------------ */

ALWAYS_INLINE __m512 prob(const struct attn_rows *rows, int r, int t)
{
    return _mm512_set1_ps(rows->s[(size_t)r * rows->stride + t]);
}

/* Columns [c, c + 16 * w) of nr rows from r0, accumulators in registers
 * across the page's tokens. */
ALWAYS_INLINE void float_accum_cols(const uint8_t *v, enum quant_type f16, int n_tok, const struct attn_rows *rows,
                                    int r0, int nr, int c, int w)
{
    int d = rows->dim;
    size_t rb = attn_row_bytes(f16, d), eb = elem_bytes(f16);
    __m512 acc[2][ROW_BLOCK];
    for (int h = 0; h < w; h++)
        for (int i = 0; i < nr; i++)
            acc[h][i] = _mm512_loadu_ps(rows->acc + (size_t)(r0 + i) * d + c + h * LANES);
    for (int t = 0; t < n_tok; t++) {
        const uint8_t *vt = ATTN_ROW(rows, v, t, rb) + (size_t)c * eb;
        __m512 x0 = load16(vt, f16), x1 = w > 1 ? load16(vt + LANES * eb, f16) : x0;
        for (int i = 0; i < nr; i++) {
            __m512 p = prob(rows, r0 + i, t);
            acc[0][i] = _mm512_fmadd_ps(p, x0, acc[0][i]);
            if (w > 1)
                acc[1][i] = _mm512_fmadd_ps(p, x1, acc[1][i]);
        }
    }
    for (int h = 0; h < w; h++)
        for (int i = 0; i < nr; i++)
            _mm512_storeu_ps(rows->acc + (size_t)(r0 + i) * d + c + h * LANES, acc[h][i]);
}

ALWAYS_INLINE void float_accum_rows(const uint8_t *v, enum quant_type f16, int n_tok, const struct attn_rows *rows,
                                    int r0, int nr)
{
    int c = 0;
    for (; c + 2 * LANES <= rows->dim; c += 2 * LANES)
        float_accum_cols(v, f16, n_tok, rows, r0, nr, c, 2);
    if (c < rows->dim)
        float_accum_cols(v, f16, n_tok, rows, r0, nr, c, 1);
}

ALWAYS_INLINE void float_accum(const uint8_t *v, enum quant_type f16, int n_tok, const struct attn_rows *rows)
{
    int r = 0;
    for (; r + 4 <= rows->n; r += 4)
        float_accum_rows(v, f16, n_tok, rows, r, 4);
    for (; r < rows->n; r++)
        float_accum_rows(v, f16, n_tok, rows, r, 1);
}

static void accum_f32_avx512(const uint8_t *v, int n_tok, const struct attn_rows *rows)
{
    float_accum(v, QUANT_F32, n_tok, rows);
}

static void accum_f16_avx512(const uint8_t *v, int n_tok, const struct attn_rows *rows)
{
    float_accum(v, QUANT_F16, n_tok, rows);
}

/* Blocks [b, b + nblk) (nblk 1 or 2) of nr rows, accumulators in registers
 * across the page's tokens; each probability is broadcast once per token. */
ALWAYS_INLINE void quant_accum_block(const uint8_t *v, enum quant_type type, int n_tok, const struct attn_rows *rows,
                                     int r0, int nr, int b, int nblk)
{
    int d = rows->dim;
    size_t rb = attn_row_bytes(type, d);
    float *base = rows->acc + (size_t)b * QK8_0;
    __m512 a[4][ROW_BLOCK];
    for (int h = 0; h < 2 * nblk; h++)
        for (int i = 0; i < nr; i++)
            a[h][i] = _mm512_loadu_ps(base + (size_t)(r0 + i) * d + h * LANES);
    for (int t = 0; t < n_tok; t++) {
        __m512 x[4];
        for (int k = 0; k < nblk; k++)
            decode_block(ATTN_ROW(rows, v, t, rb), type, b + k, &x[2 * k], &x[2 * k + 1]);
        for (int i = 0; i < nr; i++) {
            __m512 p = prob(rows, r0 + i, t);
            for (int h = 0; h < 2 * nblk; h++)
                a[h][i] = _mm512_fmadd_ps(p, x[h], a[h][i]);
        }
    }
    for (int h = 0; h < 2 * nblk; h++)
        for (int i = 0; i < nr; i++)
            _mm512_storeu_ps(base + (size_t)(r0 + i) * d + h * LANES, a[h][i]);
}

ALWAYS_INLINE void quant_accum(const uint8_t *v, enum quant_type q4, int n_tok, const struct attn_rows *rows)
{
    int nb = rows->dim / QK8_0, b = 0;
    for (; b + 2 <= nb; b += 2) {
        int r = 0;
        for (; r + 4 <= rows->n; r += 4)
            quant_accum_block(v, q4, n_tok, rows, r, 4, b, 2);
        for (; r < rows->n; r++)
            quant_accum_block(v, q4, n_tok, rows, r, 1, b, 2);
    }
    if (b < nb) {
        int r = 0;
        for (; r + 4 <= rows->n; r += 4)
            quant_accum_block(v, q4, n_tok, rows, r, 4, b, 1);
        for (; r < rows->n; r++)
            quant_accum_block(v, q4, n_tok, rows, r, 1, b, 1);
    }
}

static void accum_q8_0_avx512(const uint8_t *v, int n_tok, const struct attn_rows *rows)
{
    quant_accum(v, QUANT_Q8_0, n_tok, rows);
}

static void accum_q4_0_avx512(const uint8_t *v, int n_tok, const struct attn_rows *rows)
{
    quant_accum(v, QUANT_Q4_0, n_tok, rows);
}

/* bf16 and the block types without an integer K kernel: K scored against the
 * f32 query through the float reduction, V decoded in registers. */
#define DECODED_KERNELS(name, type)                                                                          \
    static void score_##name##_avx512(const uint8_t *k, int n_tok, const struct attn_rows *rows)            \
    {                                                                                                        \
        float_score(k, type, n_tok, rows);                                                                   \
    }                                                                                                        \
    static void accum_##name##_avx512(const uint8_t *v, int n_tok, const struct attn_rows *rows)            \
    {                                                                                                        \
        if (is_block_type(type))                                                                             \
            quant_accum(v, type, n_tok, rows);                                                               \
        else                                                                                                 \
            float_accum(v, type, n_tok, rows);                                                               \
    }
DECODED_KERNELS(bf16, QUANT_BF16)
DECODED_KERNELS(q5_1, QUANT_Q5_1)
DECODED_KERNELS(q5_0, QUANT_Q5_0)
DECODED_KERNELS(q4_1, QUANT_Q4_1)
DECODED_KERNELS(iq4_nl, QUANT_IQ4_NL)
DECODED_KERNELS(iq3_nl, QUANT_IQ3_NL)

/* head_dim not a multiple of 16 goes to the AVX2 set (which falls back further). */
#define WIDE_OR_AVX2(name, wide, kind, type)                                                                 \
    static void name(const uint8_t *x, int n_tok, const struct attn_rows *rows)                             \
    {                                                                                                        \
        if (rows->dim % LANES)                                                                               \
            attn_kernels_avx2()->kind[kv_type_index(type)](x, n_tok, rows);                                  \
        else                                                                                                 \
            wide(x, n_tok, rows);                                                                            \
    }
WIDE_OR_AVX2(score_f32_g, score_f32_avx512, score, QUANT_F32)
WIDE_OR_AVX2(score_f16_g, score_f16_avx512, score, QUANT_F16)
WIDE_OR_AVX2(accum_f32_g, accum_f32_avx512, accum, QUANT_F32)
WIDE_OR_AVX2(accum_f16_g, accum_f16_avx512, accum, QUANT_F16)
WIDE_OR_AVX2(score_bf16_g, score_bf16_avx512, score, QUANT_BF16)
WIDE_OR_AVX2(accum_bf16_g, accum_bf16_avx512, accum, QUANT_BF16)

#if !defined(AVX512_QUANT_K)
static void score_q8_0_avx512(const uint8_t *k, int n_tok, const struct attn_rows *rows)
{
    attn_kernels_avx2()->score[kv_type_index(QUANT_Q8_0)](k, n_tok, rows);
}

static void score_q4_0_avx512(const uint8_t *k, int n_tok, const struct attn_rows *rows)
{
    attn_kernels_avx2()->score[kv_type_index(QUANT_Q4_0)](k, n_tok, rows);
}
#endif

/* ---- softmax ------------------------------------------------------------------ */

ALWAYS_INLINE __mmask16 lanes_below(int n) { return n >= LANES ? 0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }

static float exp_sum_avx512(float *s, int n, float mx)
{
    __m512 m = _mm512_set1_ps(mx), sum = _mm512_setzero_ps();
    for (int t = 0; t < n; t += LANES) {
        __mmask16 k = lanes_below(n - t);
        __m512 e = _mm512_maskz_mov_ps(k, vmath_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), m)));
        _mm512_mask_storeu_ps(s + t, k, e);
        sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

static void softmax_avx512(const struct attn_rows *rows, int page_start, int n_tok)
{
    for (int r = 0; r < rows->n; r++) {
        float *s = rows->s + (size_t)r * rows->stride;
        int lo, hi;
        attn_visible(rows, r, page_start, n_tok, &lo, &hi);
        __m512 mv = _mm512_set1_ps(rows->m[r]);
        for (int t = lo; t < hi; t += LANES)
            mv = _mm512_mask_max_ps(mv, lanes_below(hi - t), mv, _mm512_maskz_loadu_ps(lanes_below(hi - t), s + t));
        for (int t = 0; t < lo; t++)
            s[t] = 0.0f;
        for (int t = hi; t < n_tok; t++)
            s[t] = 0.0f;
        if (hi == lo)
            continue;
        float mx = _mm512_reduce_max_ps(mv);
        if (mx != rows->m[r]) {
            float corr = _mm512_cvtss_f32(vmath_exp16(_mm512_set1_ps(rows->m[r] - mx)));
            float *acc = rows->acc + (size_t)r * rows->dim;
            int e = 0;
            for (; e + LANES <= rows->dim; e += LANES)
                _mm512_storeu_ps(acc + e, _mm512_mul_ps(_mm512_loadu_ps(acc + e), _mm512_set1_ps(corr)));
            for (; e < rows->dim; e++)
                acc[e] *= corr;
            rows->l[r] *= corr;
            rows->m[r] = mx;
        }
        rows->l[r] += exp_sum_avx512(s + lo, hi - lo, mx);
    }
}

static const struct attn_kernels AVX512 = {
    "avx512",
    {[KV_INDEX_F32] = score_f32_g, [KV_INDEX_F16] = score_f16_g, [KV_INDEX_BF16] = score_bf16_g,
     [KV_INDEX_Q8_0] = score_q8_0_avx512, [KV_INDEX_Q5_1] = score_q5_1_avx512, [KV_INDEX_Q5_0] = score_q5_0_avx512,
     [KV_INDEX_Q4_1] = score_q4_1_avx512, [KV_INDEX_IQ4_NL] = score_iq4_nl_avx512, [KV_INDEX_Q4_0] = score_q4_0_avx512,
     [KV_INDEX_IQ3_NL] = score_iq3_nl_avx512},
    {[KV_INDEX_F32] = accum_f32_g, [KV_INDEX_F16] = accum_f16_g, [KV_INDEX_BF16] = accum_bf16_g,
     [KV_INDEX_Q8_0] = accum_q8_0_avx512, [KV_INDEX_Q5_1] = accum_q5_1_avx512, [KV_INDEX_Q5_0] = accum_q5_0_avx512,
     [KV_INDEX_Q4_1] = accum_q4_1_avx512, [KV_INDEX_IQ4_NL] = accum_iq4_nl_avx512, [KV_INDEX_Q4_0] = accum_q4_0_avx512,
     [KV_INDEX_IQ3_NL] = accum_iq3_nl_avx512},
    exp_sum_avx512,
    softmax_avx512,
};

const struct attn_kernels *attn_kernels_avx512(void) { return attn_kernels_avx2() ? &AVX512 : NULL; }
#else
const struct attn_kernels *attn_kernels_avx512(void) { return NULL; }
#endif
