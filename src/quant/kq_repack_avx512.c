/* k-quants: the group kernels of repacked Q4_K / Q6_K / Q5_K for AVX-512
 * VNNI, 16 rows in the lanes of a zmm (the layout is in kq_internal.h, the
 * scalar twin in kq_repack.c).
 *
 * One load brings a dword of each of the 16 rows' super-block; a token's
 * Q8_K dword is broadcast against it, so each row's exact integer sums build
 * up in its own lane and no horizontal sum is ever taken. The float steps
 * per super-block are the scalar reference's (kq_scalar.c), row by row in
 * the lanes: explicit fmas, and this file's other products are not
 * contracted (-ffp-contract=off), so every row gets the reference's bits.
 * A pass takes one group and up to KQRP_TT tokens, so the unpacking of the
 * weights serves them all. */
#include "quant/kq_internal.h"

#if defined(KQRP_HAVE_AVX512)
#include <immintrin.h>

#include "vmath/vmath_simd.h"

#define KQRP_TT 4 /* tokens per pass over a group */
#ifndef KQRP_TOKEN_BLOCK
#define KQRP_TOKEN_BLOCK 64 /* tokens whose Q8_K rows stay in L2 while a thread's groups pass over them */
#endif
#ifndef KQRP_AHEAD
#define KQRP_AHEAD 8192 /* software prefetch distance in the weight stream */
#endif
#define R 16

static inline __m512i bcast(const void *p) { return _mm512_set1_epi32(kq_dword(p)); }
static inline __m512i dword_vec(const uint8_t *gb, size_t at, int k) { return _mm512_loadu_si512(gb + at + 64 * (size_t)k); }

static inline void prefetch_group_block(const uint8_t *gb, size_t bytes)
{
    for (size_t off = 0; off < bytes; off += 64)
        __builtin_prefetch((const char *)gb + KQRP_AHEAD + off, 0, QUANT_WEIGHT_PREFETCH);
}

/* vpshufb patterns on a vector of 4 bytes per row: byte k of each row's
 * dword zero-extended to int32 (one), or as both halves of an int16 pair (pair). */
static inline __m512i pick_byte(int k)
{
    return _mm512_add_epi32(_mm512_set1_epi32((int)(0x80808000u | (unsigned)k)),
                            _mm512_set4_epi32(12, 8, 4, 0));
}
static inline __m512i pick_pair(int k)
{
    return _mm512_add_epi32(_mm512_set1_epi32((int)(0x80008000u | (unsigned)k | (unsigned)k << 16)),
                            _mm512_set4_epi32(0x000c000c, 0x00080008, 0x00040004, 0));
}

/* ---- Q4_K: the two chains of llama.cpp's q4_K_8x8 gemv per row -------------
 * Per super-block and row: isum = sum over sub-blocks j of sc_j * (q . q8),
 * msum = sum of m_j * (bsums 2j + 2j+1), exact; acc = fma(isum, d * dy, acc),
 * accm = fma(msum, dmin * dy, accm); acc - accm at the end. Qs dword 8p + i
 * holds elements 64p + 4i.. (low nibbles, sub-block 2p) and 64p + 32 + 4i..
 * (high, 2p + 1). High nibbles stay in place (x16) with sums of their own,
 * shifted back once per super-block: exact, every product is a multiple of
 * 16. Ranges: a sub-block sum is at most 32 * 15 * 127 (x16 < 2^20), times a
 * scale <= 63 and 4 sub-blocks stays below 2^31. */

#define Q4K_D 0
#define Q4K_DMIN (2 * R)
#define Q4K_SC (4 * R)
#define Q4K_QS (Q4K_SC + 3 * 4 * R)

static inline __attribute__((always_inline)) void q4k_pass(const struct quant_kq_gemm *g, int64_t grp, int64_t t0,
                                                           int T)
{
    const size_t gbb = R * sizeof(block_q4_K);
    const int64_t nsb = g->cols / QK_K;
    const block_q8_K *y[KQRP_TT];
    quant_kq_tile_tokens(g, t0, T, T, y);
    __m512 acc[KQRP_TT], accm[KQRP_TT];
    for (int t = 0; t < T; t++)
        acc[t] = accm[t] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0f), high4 = _mm512_set1_epi8((char)0xf0), low6 = _mm512_set1_epi8(0x3f),
                  top2 = _mm512_set1_epi8(0x30);
    const uint8_t *gb = g->W + (size_t)grp * R * g->wrow;
    for (int64_t b = 0; b < nsb; b++, gb += gbb) {
        prefetch_group_block(gb, gbb);
        /* kq_unpack_scales_k4 in the lanes: bytes 0-3 of s03 / s47 / m03 / m47 are scales 0-3, 4-7, mins 0-3, 4-7 */
        const __m512i w0 = dword_vec(gb, Q4K_SC, 0), w1 = dword_vec(gb, Q4K_SC, 1), w2 = dword_vec(gb, Q4K_SC, 2);
        const __m512i s03 = _mm512_and_si512(w0, low6), m03 = _mm512_and_si512(w1, low6);
        const __m512i s47 = _mm512_or_si512(_mm512_and_si512(w2, low4), _mm512_and_si512(_mm512_srli_epi32(w0, 2), top2));
        const __m512i m47 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w2, 4), low4),
                                            _mm512_and_si512(_mm512_srli_epi32(w1, 2), top2));
        const __m512 d = vmath_load16_f16(gb + Q4K_D), dmin = vmath_load16_f16(gb + Q4K_DMIN);
        __m512i msum[KQRP_TT];
        for (int t = 0; t < T; t++)
            msum[t] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) { /* min j weighs bsums 2j and 2j + 1: the int16 pair (m_j, m_j) */
            const __m512i mm = _mm512_shuffle_epi8(j < 4 ? m03 : m47, pick_pair(j % 4));
            for (int t = 0; t < T; t++)
                msum[t] = _mm512_dpwssd_epi32(msum[t], mm, bcast(y[t][b].bsums + 2 * j));
        }
        for (int t = 0; t < T; t++)
            accm[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(msum[t]), _mm512_mul_ps(dmin, _mm512_set1_ps(y[t][b].d)),
                                      accm[t]);
        __m512i isum[KQRP_TT], isum16[KQRP_TT];
        for (int t = 0; t < T; t++)
            isum[t] = isum16[t] = _mm512_setzero_si512();
        for (int p = 0; p < 4; p++) {
            __m512i dlo[KQRP_TT], dhi[KQRP_TT];
            for (int t = 0; t < T; t++)
                dlo[t] = dhi[t] = _mm512_setzero_si512();
            for (int i = 0; i < 8; i++) {
                const __m512i raw = dword_vec(gb, Q4K_QS, 8 * p + i);
                const __m512i lo = _mm512_and_si512(raw, low4), hi16 = _mm512_and_si512(raw, high4);
                for (int t = 0; t < T; t++) {
                    dlo[t] = _mm512_dpbusd_epi32(dlo[t], lo, bcast(y[t][b].qs + 64 * p + 4 * i));
                    dhi[t] = _mm512_dpbusd_epi32(dhi[t], hi16, bcast(y[t][b].qs + 64 * p + 32 + 4 * i));
                }
            }
            const __m512i scales = p < 2 ? s03 : s47;
            const __m512i sa = _mm512_shuffle_epi8(scales, pick_byte((2 * p) % 4));
            const __m512i sb = _mm512_shuffle_epi8(scales, pick_byte((2 * p + 1) % 4));
            for (int t = 0; t < T; t++) {
                isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(dlo[t], sa));
                isum16[t] = _mm512_add_epi32(isum16[t], _mm512_mullo_epi32(dhi[t], sb));
            }
        }
        for (int t = 0; t < T; t++) {
            const __m512i s = _mm512_add_epi32(isum[t], _mm512_srai_epi32(isum16[t], 4));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(y[t][b].d)), acc[t]);
        }
    }
    for (int t = 0; t < T; t++)
        _mm512_storeu_ps(g->Y + (t0 + t) * g->ldy + grp * R, _mm512_sub_ps(acc[t], accm[t]));
}

typedef void (*kqrp_pass_fn)(const struct quant_kq_gemm *g, int64_t grp, int64_t t0);

/* passes[1..KQRP_TT] of an always-inline pass(g, grp, t0, T). */
#define KQRP_WIDTHS(pass)                                                                                  \
    static void pass##_1(const struct quant_kq_gemm *g, int64_t grp, int64_t t0) { pass(g, grp, t0, 1); } \
    static void pass##_2(const struct quant_kq_gemm *g, int64_t grp, int64_t t0) { pass(g, grp, t0, 2); } \
    static void pass##_3(const struct quant_kq_gemm *g, int64_t grp, int64_t t0) { pass(g, grp, t0, 3); } \
    static void pass##_4(const struct quant_kq_gemm *g, int64_t grp, int64_t t0) { pass(g, grp, t0, 4); } \
    static const kqrp_pass_fn pass##_widths[KQRP_TT + 1] = {NULL, pass##_1, pass##_2, pass##_3, pass##_4};

KQRP_WIDTHS(q4k_pass)

void quant_kqrp_rows_avx512(const struct quant_kq_gemm *g, int64_t g0, int64_t g1)
{
    const kqrp_pass_fn *passes = q4k_pass_widths;
    if (g->wtype != QUANT_Q4_K) {
        quant_kqrp_rows_ref(g, R, g0, g1);
        return;
    }
    /* a block of tokens stays in L2 while the groups pass over it */
    for (int64_t t0 = 0; t0 < g->n_tokens; t0 += KQRP_TOKEN_BLOCK) {
        const int64_t t1 = g->n_tokens - t0 < KQRP_TOKEN_BLOCK ? g->n_tokens : t0 + KQRP_TOKEN_BLOCK;
        for (int64_t grp = g0; grp < g1; grp++)
            for (int64_t t = t0; t < t1; t += KQRP_TT)
                passes[t1 - t < KQRP_TT ? t1 - t : KQRP_TT](g, grp, t);
    }
}
#endif
