/* AVX2 (+FMA, F16C) kernel set: 8-wide floats, 32-byte q8_0/q4_0 blocks as
 * one 256-bit integer dot (VNNI when present), the other block types widened
 * to f32 in registers. Kernels fall back to the
 * scalar reference for head_dim they cannot tile. The AVX-512 set is in
 * attn_avx512.c and uses this one for what it does not cover. */
#include "attn/attn_internal.h"
#include "vmath/vmath.h"
#include "vmath/vmath_simd.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#include <string.h>

#define AVX2_ON 1
/* Query rows scored or accumulated together: their accumulators stay in
 * registers while each K/V value is loaded once. */
enum { ROW_BLOCK = 4, HALF_BLOCK = QK8_0 / 2 };

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE float hsum8(__m256 v)
{
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

ALWAYS_INLINE __m256 load8_f32(const void *p) { return _mm256_loadu_ps(p); }
ALWAYS_INLINE __m256 load8_f16(const void *p) { return vmath_load8_f16(p); }
ALWAYS_INLINE __m256 load8_bf16(const void *p) { return vmath_load8_bf16(p); }

/* sum(u * s) over 32 bytes in 8 int32 lanes: u unsigned, s signed; no
 * saturation because |u| <= 127 for q8_0 and <= 15 for q4_0 nibbles. */
ALWAYS_INLINE __m256i dot_u8_s8(__m256i u, __m256i s)
{
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* 32 q4_0 values of one block as signed bytes in element order. */
ALWAYS_INLINE __m256i unpack_q4_0(const uint8_t *qs)
{
    __m128i b = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(0x0F);
    __m256i x = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
    return _mm256_sub_epi8(x, _mm256_set1_epi8(8));
}

/* ---- K scores -------------------------------------------------------------- */

#define FLOAT_SCORE_ROWS(name, elem, load, W, vec, fma, zero, hsum)                                          \
    ALWAYS_INLINE void name##_rows(const elem *kt, const float *q, int d, int nr, float *out, int stride)     \
    {                                                                                                        \
        vec acc[ROW_BLOCK];                                                                                  \
        for (int i = 0; i < nr; i++)                                                                         \
            acc[i] = zero();                                                                                 \
        for (int c = 0; c < d; c += W) {                                                                     \
            vec kc = load(kt + c);                                                                           \
            for (int i = 0; i < nr; i++)                                                                     \
                acc[i] = fma(load##_q(q + (size_t)i * d + c), kc, acc[i]);                                   \
        }                                                                                                    \
        for (int i = 0; i < nr; i++)                                                                         \
            out[(size_t)i * stride] = hsum(acc[i]);                                                          \
    }                                                                                                        \
    static void name(const uint8_t *k, int n_tok, const struct attn_rows *rows)                             \
    {                                                                                                        \
        int d = rows->dim, r = 0;                                                                            \
        for (int t = 0; t < n_tok; t++) {                                                                    \
            const elem *kt = (const elem *)ATTN_ROW(rows, k, t, (size_t)d * sizeof(elem));                   \
            for (r = 0; r + ROW_BLOCK <= rows->n; r += ROW_BLOCK)                                            \
                name##_rows(kt, rows->q + (size_t)r * d, d, ROW_BLOCK, rows->s + (size_t)r * rows->stride + t, \
                            rows->stride);                                                                   \
            for (; r < rows->n; r++)                                                                         \
                name##_rows(kt, rows->q + (size_t)r * d, d, 1, rows->s + (size_t)r * rows->stride + t,      \
                            rows->stride);                                                                   \
        }                                                                                                    \
    }

#define load8_f32_q load8_f32
#define load8_f16_q load8_f32
#define load8_bf16_q load8_f32
FLOAT_SCORE_ROWS(score_f32_avx2, float, load8_f32, 8, __m256, _mm256_fmadd_ps, _mm256_setzero_ps, hsum8)
FLOAT_SCORE_ROWS(score_f16_avx2, quant_f16, load8_f16, 8, __m256, _mm256_fmadd_ps, _mm256_setzero_ps, hsum8)
FLOAT_SCORE_ROWS(score_bf16_avx2, quant_bf16, load8_bf16, 8, __m256, _mm256_fmadd_ps, _mm256_setzero_ps, hsum8)

/* One quantized K row against nr int8 query rows; q4 selects the q4_0 layout. */
ALWAYS_INLINE void quant_score_rows(const uint8_t *kt, bool q4, const struct attn_rows *rows, int r0, int nr,
                                    int t)
{
    int nb = rows->dim / QK8_0;
    __m256 acc[ROW_BLOCK];
    for (int i = 0; i < nr; i++)
        acc[i] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i kv;
        float dk;
        if (q4) {
            const block_q4_0 *blk = (const block_q4_0 *)kt + b;
            kv = unpack_q4_0(blk->qs);
            dk = _cvtsh_ss(blk->d);
        } else {
            const block_q8_0 *blk = (const block_q8_0 *)kt + b;
            kv = _mm256_loadu_si256((const __m256i *)blk->qs);
            dk = _cvtsh_ss(blk->d);
        }
        __m256i ku = _mm256_sign_epi8(kv, kv);
        for (int i = 0; i < nr; i++) {
            size_t qi = (size_t)(r0 + i) * nb + b;
            __m256i qv = _mm256_loadu_si256((const __m256i *)rows->q8[qi].qs);
            __m256 dot = _mm256_cvtepi32_ps(dot_u8_s8(ku, _mm256_sign_epi8(qv, kv)));
            acc[i] = _mm256_fmadd_ps(dot, _mm256_set1_ps(dk * rows->q8d[qi]), acc[i]);
        }
    }
    for (int i = 0; i < nr; i++)
        rows->s[(size_t)(r0 + i) * rows->stride + t] = hsum8(acc[i]);
}

/* ---- V accumulation ---------------------------------------------------------- */

/* acc[r][c .. c+W) += sum_t p[r][t] * v_t[c .. c+W) for nr rows, with the
 * accumulators in registers across the page's tokens. */
#define FLOAT_ACCUM(name, elem, load, W, vec, fma, set1, loadacc, storeacc)                                  \
    ALWAYS_INLINE void name##_rows(const elem *v, int n_tok, const struct attn_rows *rows, int r0, int nr, int c) \
    {                                                                                                        \
        int d = rows->dim;                                                                                   \
        vec acc[ROW_BLOCK];                                                                                  \
        for (int i = 0; i < nr; i++)                                                                         \
            acc[i] = loadacc(rows->acc + (size_t)(r0 + i) * d + c);                                          \
        for (int t = 0; t < n_tok; t++) {                                                                    \
            vec x = load((const elem *)ATTN_ROW(rows, v, t, (size_t)d * sizeof(elem)) + c);                  \
            for (int i = 0; i < nr; i++)                                                                     \
                acc[i] = fma(set1(rows->s[(size_t)(r0 + i) * rows->stride + t]), x, acc[i]);                 \
        }                                                                                                    \
        for (int i = 0; i < nr; i++)                                                                         \
            storeacc(rows->acc + (size_t)(r0 + i) * d + c, acc[i]);                                          \
    }                                                                                                        \
    static void name(const uint8_t *vb, int n_tok, const struct attn_rows *rows)                            \
    {                                                                                                        \
        const elem *v = (const elem *)vb;                                                                    \
        for (int c = 0; c < rows->dim; c += W) {                                                             \
            int r = 0;                                                                                       \
            for (; r + ROW_BLOCK <= rows->n; r += ROW_BLOCK)                                                 \
                name##_rows(v, n_tok, rows, r, ROW_BLOCK, c);                                                \
            for (; r < rows->n; r++)                                                                         \
                name##_rows(v, n_tok, rows, r, 1, c);                                                        \
        }                                                                                                    \
    }

FLOAT_ACCUM(accum_f32_avx2, float, load8_f32, 8, __m256, _mm256_fmadd_ps, _mm256_set1_ps, _mm256_loadu_ps,
            _mm256_storeu_ps)
FLOAT_ACCUM(accum_f16_avx2, quant_f16, load8_f16, 8, __m256, _mm256_fmadd_ps, _mm256_set1_ps, _mm256_loadu_ps,
            _mm256_storeu_ps)
FLOAT_ACCUM(accum_bf16_avx2, quant_bf16, load8_bf16, 8, __m256, _mm256_fmadd_ps, _mm256_set1_ps, _mm256_loadu_ps,
            _mm256_storeu_ps)

/* 16 values (half h of block b) of a quantized V row as two 8-float vectors. */
ALWAYS_INLINE void quant_half8(const uint8_t *vt, bool q4, int b, int h, __m256 *lo, __m256 *hi, float *d)
{
    __m128i x;
    if (q4) {
        const block_q4_0 *blk = (const block_q4_0 *)vt + b;
        __m128i raw = _mm_loadu_si128((const __m128i *)blk->qs);
        __m128i nib = _mm_and_si128(h ? _mm_srli_epi16(raw, 4) : raw, _mm_set1_epi8(0x0F));
        x = _mm_sub_epi8(nib, _mm_set1_epi8(8));
        *d = _cvtsh_ss(blk->d);
    } else {
        const block_q8_0 *blk = (const block_q8_0 *)vt + b;
        x = _mm_loadu_si128((const __m128i *)(blk->qs + h * HALF_BLOCK));
        *d = _cvtsh_ss(blk->d);
    }
    *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
    *hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(x, 8)));
}

/* ---- q4_1, q5_0, q5_1, iq4_nl, iq3_nl: blocks widened to f32 in registers -- *
 * K is scored against the f32 query with FMAs and V accumulated likewise;
 * each block is decoded half (16 values) at a time, scale (and minimum)
 * applied, so a value costs one FMA per query row. */

/* 16 bytes as two 8-float vectors, times d plus m. */
ALWAYS_INLINE void widen16(__m128i x, bool is_signed, float d, float m, __m256 *lo, __m256 *hi)
{
    __m256i a = is_signed ? _mm256_cvtepi8_epi32(x) : _mm256_cvtepu8_epi32(x);
    __m256i b = is_signed ? _mm256_cvtepi8_epi32(_mm_srli_si128(x, 8)) : _mm256_cvtepu8_epi32(_mm_srli_si128(x, 8));
    __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
    *lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), dv, mv);
    *hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), dv, mv);
}

/* The nibbles of half h of a block's 16 bytes: low nibbles are values 0-15, high ones 16-31. */
ALWAYS_INLINE __m128i nibbles(const uint8_t *qs, int h)
{
    __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    return _mm_and_si128(h ? _mm_srli_epi16(raw, 4) : raw, _mm_set1_epi8(0x0F));
}

/* value in byte j where bit j of bits (16 bits) is set, else 0: the q5 fifth
 * bits (0x10), iq3_nl's third (0x04). */
ALWAYS_INLINE __m128i bits_as_bytes(uint32_t bits, char value)
{
    const __m128i spread = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m128i sel = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
    __m128i v = _mm_and_si128(_mm_shuffle_epi8(_mm_set1_epi16((short)bits), spread), sel);
    return _mm_and_si128(_mm_cmpeq_epi8(v, sel), _mm_set1_epi8(value));
}

ALWAYS_INLINE __m128i fifth_bits(uint32_t bits) { return bits_as_bytes(bits, 0x10); }

ALWAYS_INLINE uint32_t load_qh(const uint8_t *qh)
{
    uint32_t v;
    memcpy(&v, qh, sizeof v);
    return v;
}

/* The 3-bit indices of values 16h .. 16h+15 of an iq3_nl block: the low two
 * bits of values 16h + i and 16h + 8 + i sit at bits 4h and 4h + 2 of qs[i]. */
ALWAYS_INLINE __m128i iq3_indices(const block_iq3_nl *blk, int h)
{
    uint64_t q;
    memcpy(&q, blk->qs, sizeof q);
    __m128i low = _mm_set_epi64x((long long)(q >> (4 * h + 2)), (long long)(q >> (4 * h)));
    low = _mm_and_si128(low, _mm_set1_epi8(3));
    return _mm_or_si128(low, bits_as_bytes(load_qh(blk->qh) >> (16 * h), 0x04));
}

/* Values 16h .. 16h+15 of block b of a row of type t, dequantized. */
ALWAYS_INLINE void decode_half(const uint8_t *row, enum quant_type t, int b, int h, __m256 *lo, __m256 *hi)
{
    if (t == QUANT_Q4_1) {
        const block_q4_1 *blk = (const block_q4_1 *)row + b;
        widen16(nibbles(blk->qs, h), false, _cvtsh_ss(blk->d), _cvtsh_ss(blk->m), lo, hi);
    } else if (t == QUANT_Q5_0) {
        const block_q5_0 *blk = (const block_q5_0 *)row + b;
        __m128i x = _mm_or_si128(nibbles(blk->qs, h), fifth_bits(load_qh(blk->qh) >> (16 * h)));
        widen16(_mm_sub_epi8(x, _mm_set1_epi8(16)), true, _cvtsh_ss(blk->d), 0.0f, lo, hi);
    } else if (t == QUANT_Q5_1) {
        const block_q5_1 *blk = (const block_q5_1 *)row + b;
        __m128i x = _mm_or_si128(nibbles(blk->qs, h), fifth_bits(load_qh(blk->qh) >> (16 * h)));
        widen16(x, false, _cvtsh_ss(blk->d), _cvtsh_ss(blk->m), lo, hi);
    } else if (t == QUANT_IQ3_NL) {
        const block_iq3_nl *blk = (const block_iq3_nl *)row + b;
        __m128i lut = _mm_loadl_epi64((const __m128i *)quant_iq3nl_values);
        widen16(_mm_shuffle_epi8(lut, iq3_indices(blk, h)), true, _cvtsh_ss(blk->d), 0.0f, lo, hi);
    } else {
        const block_iq4_nl *blk = (const block_iq4_nl *)row + b;
        __m128i lut = _mm_loadu_si128((const __m128i *)quant_iq4nl_values);
        widen16(_mm_shuffle_epi8(lut, nibbles(blk->qs, h)), true, _cvtsh_ss(blk->d), 0.0f, lo, hi);
    }
}

ALWAYS_INLINE void block_score_rows(const uint8_t *kt, enum quant_type t, const struct attn_rows *rows, int r0,
                                    int nr, int tok)
{
    int d = rows->dim;
    __m256 acc[ROW_BLOCK];
    for (int i = 0; i < nr; i++)
        acc[i] = _mm256_setzero_ps();
    for (int b = 0; b < d / QK8_0; b++)
        for (int h = 0; h < 2; h++) {
            __m256 lo, hi;
            decode_half(kt, t, b, h, &lo, &hi);
            for (int i = 0; i < nr; i++) {
                const float *q = rows->q + (size_t)(r0 + i) * d + b * QK8_0 + h * HALF_BLOCK;
                acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q), lo, acc[i]);
                acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8), hi, acc[i]);
            }
        }
    for (int i = 0; i < nr; i++)
        rows->s[(size_t)(r0 + i) * rows->stride + tok] = hsum8(acc[i]);
}

/* One K row against nr query rows: q4_0/q8_0 by integer dots against the
 * int8 query, the other block types decoded against the f32 query. */
ALWAYS_INLINE void score_rows(const uint8_t *kt, enum quant_type type, const struct attn_rows *rows, int r0, int nr,
                              int tok)
{
    if (type == QUANT_Q4_0 || type == QUANT_Q8_0)
        quant_score_rows(kt, type == QUANT_Q4_0, rows, r0, nr, tok);
    else
        block_score_rows(kt, type, rows, r0, nr, tok);
}

ALWAYS_INLINE void quant_score(const uint8_t *k, int n_tok, const struct attn_rows *rows, enum quant_type type)
{
    size_t rb = attn_row_bytes(type, rows->dim);
    for (int t = 0; t < n_tok; t++) {
        const uint8_t *kt = ATTN_ROW(rows, k, t, rb);
        int r = 0;
        for (; r + ROW_BLOCK <= rows->n; r += ROW_BLOCK)
            score_rows(kt, type, rows, r, ROW_BLOCK, t);
        for (; r < rows->n; r++)
            score_rows(kt, type, rows, r, 1, t);
    }
}

/* Values 16h .. 16h+15 of block b of a V row over *d: q4_0/q8_0 as integers
 * with their scale in *d (folded into the probability), the other types
 * already scaled (*d = 1). */
ALWAYS_INLINE void accum_half(const uint8_t *vt, enum quant_type type, int b, int h, __m256 *lo, __m256 *hi, float *d)
{
    if (type == QUANT_Q4_0 || type == QUANT_Q8_0) {
        quant_half8(vt, type == QUANT_Q4_0, b, h, lo, hi, d);
    } else {
        decode_half(vt, type, b, h, lo, hi);
        *d = 1.0f;
    }
}

ALWAYS_INLINE void quant_accum_rows(const uint8_t *v, size_t rb, enum quant_type type, int n_tok,
                                    const struct attn_rows *rows, int r0, int nr, int b, int h)
{
    float *base = rows->acc + b * QK8_0 + h * HALF_BLOCK;
    __m256 a0[ROW_BLOCK], a1[ROW_BLOCK];
    for (int i = 0; i < nr; i++) {
        a0[i] = _mm256_loadu_ps(base + (size_t)(r0 + i) * rows->dim);
        a1[i] = _mm256_loadu_ps(base + (size_t)(r0 + i) * rows->dim + 8);
    }
    for (int t = 0; t < n_tok; t++) {
        __m256 lo, hi;
        float d;
        accum_half(ATTN_ROW(rows, v, t, rb), type, b, h, &lo, &hi, &d);
        for (int i = 0; i < nr; i++) {
            __m256 w = _mm256_set1_ps(rows->s[(size_t)(r0 + i) * rows->stride + t] * d);
            a0[i] = _mm256_fmadd_ps(w, lo, a0[i]);
            a1[i] = _mm256_fmadd_ps(w, hi, a1[i]);
        }
    }
    for (int i = 0; i < nr; i++) {
        _mm256_storeu_ps(base + (size_t)(r0 + i) * rows->dim, a0[i]);
        _mm256_storeu_ps(base + (size_t)(r0 + i) * rows->dim + 8, a1[i]);
    }
}

ALWAYS_INLINE void quant_accum(const uint8_t *v, int n_tok, const struct attn_rows *rows, enum quant_type type)
{
    size_t rb = attn_row_bytes(type, rows->dim);
    for (int b = 0; b < rows->dim / QK8_0; b++)
        for (int h = 0; h < 2; h++) {
            int r = 0;
            for (; r + ROW_BLOCK <= rows->n; r += ROW_BLOCK)
                quant_accum_rows(v, rb, type, n_tok, rows, r, ROW_BLOCK, b, h);
            for (; r < rows->n; r++)
                quant_accum_rows(v, rb, type, n_tok, rows, r, 1, b, h);
        }
}

#define BLOCK_KERNELS(name, type)                                                                            \
    static void score_##name##_avx2(const uint8_t *k, int n_tok, const struct attn_rows *rows)              \
    {                                                                                                        \
        quant_score(k, n_tok, rows, type);                                                                   \
    }                                                                                                        \
    static void accum_##name##_avx2(const uint8_t *v, int n_tok, const struct attn_rows *rows)              \
    {                                                                                                        \
        quant_accum(v, n_tok, rows, type);                                                                   \
    }
BLOCK_KERNELS(q8_0, QUANT_Q8_0)
BLOCK_KERNELS(q4_0, QUANT_Q4_0)
BLOCK_KERNELS(q5_1, QUANT_Q5_1)
BLOCK_KERNELS(q5_0, QUANT_Q5_0)
BLOCK_KERNELS(q4_1, QUANT_Q4_1)
BLOCK_KERNELS(iq4_nl, QUANT_IQ4_NL)
BLOCK_KERNELS(iq3_nl, QUANT_IQ3_NL)

static float exp_sum_avx2(float *s, int n, float mx)
{
    __m256 m = _mm256_set1_ps(mx), sum = _mm256_setzero_ps();
    int t = 0;
    for (; t + 8 <= n; t += 8) {
        __m256 e = vmath_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
        _mm256_storeu_ps(s + t, e);
        sum = _mm256_add_ps(sum, e);
    }
    float tail = 0.0f;
    if (t < n) {
        float buf[8] = {0};
        for (int i = t; i < n; i++)
            buf[i - t] = s[i] - mx;
        __m256 e = vmath_exp8(_mm256_loadu_ps(buf));
        _mm256_storeu_ps(buf, e);
        for (int i = t; i < n; i++) {
            s[i] = buf[i - t];
            tail += buf[i - t];
        }
    }
    return hsum8(sum) + tail;
}

/* head_dim that is not a multiple of the vector width goes to the scalar twin */
#define GUARDED(name, fn, kind, type, W)                                                                     \
    static void name(const uint8_t *x, int n_tok, const struct attn_rows *rows)                             \
    {                                                                                                        \
        if (rows->dim % (W))                                                                                 \
            attn_kernels_scalar()->kind[kv_type_index(type)](x, n_tok, rows);                                \
        else                                                                                                 \
            fn(x, n_tok, rows);                                                                              \
    }
GUARDED(score_f32_avx2_g, score_f32_avx2, score, QUANT_F32, 8)
GUARDED(score_f16_avx2_g, score_f16_avx2, score, QUANT_F16, 8)
GUARDED(accum_f32_avx2_g, accum_f32_avx2, accum, QUANT_F32, 8)
GUARDED(accum_f16_avx2_g, accum_f16_avx2, accum, QUANT_F16, 8)
GUARDED(score_bf16_avx2_g, score_bf16_avx2, score, QUANT_BF16, 8)
GUARDED(accum_bf16_avx2_g, accum_bf16_avx2, accum, QUANT_BF16, 8)

static void softmax_avx2(const struct attn_rows *rows, int page_start, int n_tok)
{
    attn_softmax_with(rows, page_start, n_tok, exp_sum_avx2);
}

static const struct attn_kernels AVX2 = {
    "avx2",
    {[KV_INDEX_F32] = score_f32_avx2_g, [KV_INDEX_F16] = score_f16_avx2_g, [KV_INDEX_BF16] = score_bf16_avx2_g,
     [KV_INDEX_Q8_0] = score_q8_0_avx2, [KV_INDEX_Q5_1] = score_q5_1_avx2, [KV_INDEX_Q5_0] = score_q5_0_avx2,
     [KV_INDEX_Q4_1] = score_q4_1_avx2, [KV_INDEX_IQ4_NL] = score_iq4_nl_avx2, [KV_INDEX_Q4_0] = score_q4_0_avx2,
     [KV_INDEX_IQ3_NL] = score_iq3_nl_avx2},
    {[KV_INDEX_F32] = accum_f32_avx2_g, [KV_INDEX_F16] = accum_f16_avx2_g, [KV_INDEX_BF16] = accum_bf16_avx2_g,
     [KV_INDEX_Q8_0] = accum_q8_0_avx2, [KV_INDEX_Q5_1] = accum_q5_1_avx2, [KV_INDEX_Q5_0] = accum_q5_0_avx2,
     [KV_INDEX_Q4_1] = accum_q4_1_avx2, [KV_INDEX_IQ4_NL] = accum_iq4_nl_avx2, [KV_INDEX_Q4_0] = accum_q4_0_avx2,
     [KV_INDEX_IQ3_NL] = accum_iq3_nl_avx2},
    exp_sum_avx2,
    softmax_avx2,
};
#endif

const struct attn_kernels *attn_kernels_avx2(void)
{
#if defined(AVX2_ON)
    return &AVX2;
#else
    return NULL;
#endif
}
