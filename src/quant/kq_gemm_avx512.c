/* k-quants: the prefill GEMM tile for AVX-512 VNNI (the layout and the
 * scalar twin are in kq_gemm.c).
 *
 * Rows are in lanes: one 512-bit load brings dword k of 16 rows' unsigned
 * quants, a token's Q8_K dword k is broadcast against it, and vpdpbusd adds
 * the 4 products into each row's int32 sub-block sum. A tile is 2 panels
 * (32 rows) x KQ_T tokens, so each weight vector serves KQ_T tokens and each
 * broadcast 2 panels. At the end of a sub-block the sums are multiplied by
 * the rows' scales (vpmulld) into the super-block sum; the bsums terms are 8
 * vpdpwssd; then the two fma chains per super-block of the scalar reference
 * (Q2_K, Q4_K; explicit fmas, no other contraction in this file), so the bits
 * are the reference's. Q3_K, Q5_K and Q6_K have tiles of their own below.
 *
 * Integer ranges: |q8| <= 128 and u <= 63, a sub-block sum is at most
 * 32 * 63 * 128 < 2^18, times a scale (|sc| <= 128) and 16 sub-blocks stays
 * below 2^31. */
#include "quant/kq_internal.h"

#if defined(KQ_HAVE_GEMM_AVX512)
#include <immintrin.h>

#ifndef KQ_T
#define KQ_T 4 /* tokens per tile */
#endif

static inline __m512i bcast_dword(const void *p) { return _mm512_set1_epi32(kq_dword(p)); }

/* 2 panels x KQ_T tokens over every super-block (Q2_K, Q4_K); SUB dwords per
 * scale. out = acc - accm, the two chains of kq_chains_add. */
static inline __attribute__((always_inline)) void tile(const struct quant_kq_gemm *g, const uint8_t *p0,
                                                       const uint8_t *p1, const block_q8_K *const *y, int SUB,
                                                       __m512 out[2][KQ_T])
{
    const int64_t nsb = g->cols / QK_K;
    __m512 facc[2][KQ_T], macc[2][KQ_T];
    for (int rv = 0; rv < 2; rv++)
        for (int t = 0; t < KQ_T; t++)
            facc[rv][t] = macc[rv][t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        const uint8_t *pb[2] = {p0 + b * KQ_PB_BYTES, p1 + b * KQ_PB_BYTES};
        __m512i isum[2][KQ_T];
        for (int rv = 0; rv < 2; rv++)
            for (int t = 0; t < KQ_T; t++)
                isum[rv][t] = _mm512_setzero_si512();
        for (int j = 0; j < QK_K / 4 / SUB; j++) {
            __m512i acc[2][KQ_T];
            for (int rv = 0; rv < 2; rv++)
                for (int t = 0; t < KQ_T; t++)
                    acc[rv][t] = _mm512_setzero_si512();
            for (int k = j * SUB; k < (j + 1) * SUB; k++) {
                const __m512i w0 = _mm512_load_si512(pb[0] + KQ_PB_Q + 64 * k);
                const __m512i w1 = _mm512_load_si512(pb[1] + KQ_PB_Q + 64 * k);
                for (int t = 0; t < KQ_T; t++) {
                    const __m512i x = bcast_dword(y[t][b].qs + 4 * k);
                    acc[0][t] = _mm512_dpbusd_epi32(acc[0][t], w0, x);
                    acc[1][t] = _mm512_dpbusd_epi32(acc[1][t], w1, x);
                }
            }
            for (int rv = 0; rv < 2; rv++) {
                const __m512i sc = _mm512_load_si512(pb[rv] + KQ_PB_SC + 64 * j);
                for (int t = 0; t < KQ_T; t++)
                    isum[rv][t] = _mm512_add_epi32(isum[rv][t], _mm512_mullo_epi32(acc[rv][t], sc));
            }
        }
        for (int t = 0; t < KQ_T; t++) {
            const __m512 yd = _mm512_set1_ps(y[t][b].d);
            for (int rv = 0; rv < 2; rv++) {
                __m512i msum = _mm512_setzero_si512();
                for (int i = 0; i < 8; i++)
                    msum = _mm512_dpwssd_epi32(msum, _mm512_load_si512(pb[rv] + KQ_PB_PAIRS + 64 * i),
                                               bcast_dword(y[t][b].bsums + 2 * i));
                const __m512 dd = _mm512_mul_ps(_mm512_load_ps(pb[rv] + KQ_PB_D), yd);
                const __m512 dm = _mm512_mul_ps(_mm512_load_ps(pb[rv] + KQ_PB_DMIN), yd);
                facc[rv][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[rv][t]), dd, facc[rv][t]);
                macc[rv][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(msum), dm, macc[rv][t]);
            }
        }
    }
    for (int rv = 0; rv < 2; rv++)
        for (int t = 0; t < KQ_T; t++)
            out[rv][t] = _mm512_sub_ps(facc[rv][t], macc[rv][t]);
}

/* ---- Q3_K, Q5_K, Q6_K: ggml's eight lanes (KQ_PL_* layout) ------------------
 * Lane c of a super-block is 16 vpdpwssd per row vector and token (the
 * int16 scale * quant pairs j = 16m + 2c + h against the token's q8 pairs),
 * then one fma into that lane's float accumulator: 128 vpdpwssd per
 * super-block where the tiles above take 64 vpdpbusd + 16 vpmulld (2 uops)
 * + 16 adds + 8 vpdpwssd, and 8 fmas where they take one float step. */

static inline __m512 neg_ps(__m512 v)
{
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u)));
}

static inline __attribute__((always_inline)) void lane_tile(const struct quant_kq_gemm *g, const uint8_t *p0,
                                                            const uint8_t *p1, const block_q8_K *const *y,
                                                            enum quant_type type, __m512 out[2][KQ_T])
{
    const int64_t nsb = g->cols / QK_K;
    __m512 facc[8][2][KQ_T], summs[2][KQ_T];
    for (int c = 0; c < 8; c++)
        for (int rv = 0; rv < 2; rv++)
            for (int t = 0; t < KQ_T; t++)
                facc[c][rv][t] = _mm512_setzero_ps();
    for (int rv = 0; rv < 2; rv++)
        for (int t = 0; t < KQ_T; t++)
            summs[rv][t] = _mm512_setzero_ps();
    _Alignas(64) int16_t x16[KQ_T][QK_K];
    for (int64_t b = 0; b < nsb; b++) {
        const uint8_t *pb[2] = {p0 + b * KQ_PB_BYTES, p1 + b * KQ_PB_BYTES};
        __m512 dd[2][KQ_T];
        for (int t = 0; t < KQ_T; t++) {
            for (int i = 0; i < QK_K / 32; i++)
                _mm512_store_si512(x16[t] + 32 * i, _mm512_cvtepi8_epi16(_mm256_loadu_si256(
                                                        (const __m256i *)(y[t][b].qs + 32 * i))));
            const __m512 yd = _mm512_set1_ps(y[t][b].d);
            for (int rv = 0; rv < 2; rv++)
                dd[rv][t] = _mm512_mul_ps(yd, _mm512_load_ps(pb[rv] + KQ_PL_D));
        }
        for (int c = 0; c < 8; c++) {
            __m512i L[2][KQ_T];
            for (int rv = 0; rv < 2; rv++)
                for (int t = 0; t < KQ_T; t++)
                    L[rv][t] = _mm512_setzero_si512();
            for (int m = 0; m < 8; m++)
                for (int h = 0; h < 2; h++) {
                    const int j = 16 * m + 2 * c + h;
                    const __m512i w0 = _mm512_load_si512(pb[0] + KQ_PL_W + 64 * j);
                    const __m512i w1 = _mm512_load_si512(pb[1] + KQ_PL_W + 64 * j);
                    for (int t = 0; t < KQ_T; t++) {
                        const __m512i x = bcast_dword(x16[t] + 2 * j);
                        L[0][t] = _mm512_dpwssd_epi32(L[0][t], w0, x);
                        L[1][t] = _mm512_dpwssd_epi32(L[1][t], w1, x);
                    }
                }
            for (int rv = 0; rv < 2; rv++) {
                const __m512i pair = _mm512_load_si512(pb[rv] + KQ_PL_PAIRS + 64 * c);
                for (int t = 0; t < KQ_T; t++) {
                    if (type == QUANT_Q6_K)
                        L[rv][t] = _mm512_sub_epi32(
                            L[rv][t], _mm512_dpwssd_epi32(_mm512_setzero_si512(), pair, bcast_dword(y[t][b].bsums + 2 * c)));
                    facc[c][rv][t] = _mm512_fmadd_ps(dd[rv][t], _mm512_cvtepi32_ps(L[rv][t]), facc[c][rv][t]);
                }
            }
        }
        if (type == QUANT_Q5_K)
            for (int t = 0; t < KQ_T; t++) {
                const __m512 yd = _mm512_set1_ps(y[t][b].d);
                for (int rv = 0; rv < 2; rv++) {
                    __m512i msum = _mm512_setzero_si512();
                    for (int i = 0; i < 8; i++)
                        msum = _mm512_dpwssd_epi32(msum, _mm512_load_si512(pb[rv] + KQ_PL_PAIRS + 64 * i),
                                                   bcast_dword(y[t][b].bsums + 2 * i));
                    const __m512 dm = neg_ps(_mm512_mul_ps(yd, _mm512_load_ps(pb[rv] + KQ_PL_DMIN)));
                    summs[rv][t] = _mm512_fmadd_ps(dm, _mm512_cvtepi32_ps(msum), summs[rv][t]);
                }
            }
    }
    for (int rv = 0; rv < 2; rv++)
        for (int t = 0; t < KQ_T; t++) {
            const __m512 sum = _mm512_add_ps(
                _mm512_add_ps(_mm512_add_ps(facc[0][rv][t], facc[4][rv][t]), _mm512_add_ps(facc[2][rv][t], facc[6][rv][t])),
                _mm512_add_ps(_mm512_add_ps(facc[1][rv][t], facc[5][rv][t]), _mm512_add_ps(facc[3][rv][t], facc[7][rv][t])));
            out[rv][t] = type == QUANT_Q5_K ? _mm512_add_ps(sum, summs[rv][t]) : sum;
        }
}

static void tiles_of(const struct quant_kq_gemm *g, const uint8_t *panels, int np, int64_t r0, int nr, int SUB)
{
    const uint8_t *p1 = np > 1 ? panels + quant_kq_panel_bytes(g->cols) : panels;
    const __mmask16 keep[2] = {
        (__mmask16)(nr >= 16 ? 0xffff : (1u << nr) - 1),
        (__mmask16)(nr >= 32 ? 0xffff : nr <= 16 ? 0 : (1u << (nr - 16)) - 1),
    };
    for (int64_t t0 = 0; t0 < g->n_tokens; t0 += KQ_T) {
        const int n = (int)(g->n_tokens - t0 < KQ_T ? g->n_tokens - t0 : KQ_T);
        const block_q8_K *y[KQ_T];
        quant_kq_tile_tokens(g, t0, n, KQ_T, y);
        __m512 facc[2][KQ_T];
        if (g->wtype == QUANT_Q3_K)
            lane_tile(g, panels, p1, y, QUANT_Q3_K, facc);
        else if (g->wtype == QUANT_Q5_K)
            lane_tile(g, panels, p1, y, QUANT_Q5_K, facc);
        else if (g->wtype == QUANT_Q6_K)
            lane_tile(g, panels, p1, y, QUANT_Q6_K, facc);
        else if (SUB == 8) /* q4_K */
            tile(g, panels, p1, y, 8, facc);
        else /* q2_K */
            tile(g, panels, p1, y, 4, facc);
        for (int t = 0; t < n; t++)
            for (int rv = 0; rv < 2; rv++)
                if (keep[rv])
                    _mm512_mask_storeu_ps(g->Y + (t0 + t) * g->ldy + r0 + 16 * rv, keep[rv], facc[rv][t]);
    }
}

void quant_kq_tiles_avx512(const struct quant_kq_gemm *g, const uint8_t *panels, int np, int64_t r0, int nr)
{
    tiles_of(g, panels, np, r0, nr, kq_sub_dwords(g->wtype));
}
#endif
