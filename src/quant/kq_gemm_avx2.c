/* k-quants: the prefill GEMM tile for AVX2 (the layout and the scalar twin
 * are in kq_gemm.c; kq_gemm_avx512.c is the AVX-512 one).
 *
 * Rows are in lanes, 8 per register: a panel of 16 rows is two halves. A
 * token's Q8_K dword is broadcast against dword k of 8 rows' unsigned quants;
 *     madd(maddubs(u, x), (sc, sc))
 * gives each row scale * (4 products) in int32, so the scales cost nothing
 * per step. maddubs never saturates: u <= 63 and |x| <= 128 make a pair at
 * most 2 * 63 * 128 = 16128 < 2^15. A tile is one panel x KQ_T2 tokens; the
 * scalar reference's two fma chains per super-block (Q2_K, Q4_K; no other
 * contraction in this file) give the reference's bits. Q3_K, Q5_K and Q6_K
 * have tiles of their own below. */
#include "quant/kq_internal.h"

#if defined(KQ_HAVE_AVX2)
#include <immintrin.h>

#ifndef KQ_T2
#define KQ_T2 4 /* tokens per tile */
#endif

static inline __m256i bcast_dword(const void *p) { return _mm256_set1_epi32(kq_dword(p)); }

/* int32 scales -> the int16 pair (sc, sc) in each lane, for madd. */
static inline __m256i scale_pairs(const uint8_t *p)
{
    const __m256i sc = _mm256_load_si256((const __m256i *)p);
    return _mm256_blend_epi16(sc, _mm256_slli_epi32(sc, 16), 0xAA);
}

/* One panel (two halves of 8 rows) x KQ_T2 tokens (Q2_K, Q4_K); SUB dwords
 * per scale. out = acc - accm, the two chains of kq_chains_add. */
static inline __attribute__((always_inline)) void tile(const struct quant_kq_gemm *g, const uint8_t *panel,
                                                       const block_q8_K *const *y, int SUB, __m256 out[2][KQ_T2])
{
    const int64_t nsb = g->cols / QK_K;
    __m256 facc[2][KQ_T2], macc[2][KQ_T2];
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < KQ_T2; t++)
            facc[h][t] = macc[h][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        const uint8_t *pb = panel + b * KQ_PB_BYTES;
        __m256i isum[2][KQ_T2];
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < KQ_T2; t++)
                isum[h][t] = _mm256_setzero_si256();
        for (int j = 0; j < QK_K / 4 / SUB; j++) {
            const __m256i sc0 = scale_pairs(pb + KQ_PB_SC + 64 * j), sc1 = scale_pairs(pb + KQ_PB_SC + 64 * j + 32);
            for (int k = j * SUB; k < (j + 1) * SUB; k++) {
                const __m256i w0 = _mm256_load_si256((const __m256i *)(pb + KQ_PB_Q + 64 * k));
                const __m256i w1 = _mm256_load_si256((const __m256i *)(pb + KQ_PB_Q + 64 * k + 32));
                for (int t = 0; t < KQ_T2; t++) {
                    const __m256i x = bcast_dword(y[t][b].qs + 4 * k);
                    isum[0][t] = _mm256_add_epi32(isum[0][t], _mm256_madd_epi16(_mm256_maddubs_epi16(w0, x), sc0));
                    isum[1][t] = _mm256_add_epi32(isum[1][t], _mm256_madd_epi16(_mm256_maddubs_epi16(w1, x), sc1));
                }
            }
        }
        for (int t = 0; t < KQ_T2; t++) {
            const __m256 yd = _mm256_set1_ps(y[t][b].d);
            for (int h = 0; h < 2; h++) {
                __m256i msum = _mm256_setzero_si256();
                for (int i = 0; i < 8; i++)
                    msum = _mm256_add_epi32(
                        msum, _mm256_madd_epi16(_mm256_load_si256((const __m256i *)(pb + KQ_PB_PAIRS + 64 * i + 32 * h)),
                                                bcast_dword(y[t][b].bsums + 2 * i)));
                const __m256 dd = _mm256_mul_ps(_mm256_load_ps((const float *)(pb + KQ_PB_D + 32 * h)), yd);
                const __m256 dm = _mm256_mul_ps(_mm256_load_ps((const float *)(pb + KQ_PB_DMIN + 32 * h)), yd);
                facc[h][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[h][t]), dd, facc[h][t]);
                macc[h][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), dm, macc[h][t]);
            }
        }
    }
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < KQ_T2; t++)
            out[h][t] = _mm256_sub_ps(facc[h][t], macc[h][t]);
}

/* ---- Q3_K, Q5_K, Q6_K: ggml's eight lanes (KQ_PL_* layout) ------------------
 * Lane c of a super-block: vpmaddwd + vpaddd of the int16 scale * quant pairs
 * j = 16m + 2c + h against the token's q8 pairs, then one fma into the
 * lane's float accumulator (kq_scalar.c's order). Per super-block, row half
 * and token: 128 madd + 128 add, where the tiles above take 64 x (maddubs +
 * madd + add). */

static inline __m256 neg_ps(__m256 v) { return _mm256_xor_ps(v, _mm256_set1_ps(-0.0f)); }

static inline __attribute__((always_inline)) void lane_tile(const struct quant_kq_gemm *g, const uint8_t *panel,
                                                            const block_q8_K *const *y, enum quant_type type,
                                                            __m256 out[2][KQ_T2])
{
    const int64_t nsb = g->cols / QK_K;
    __m256 facc[8][2][KQ_T2], summs[2][KQ_T2];
    for (int c = 0; c < 8; c++)
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < KQ_T2; t++)
                facc[c][h][t] = _mm256_setzero_ps();
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < KQ_T2; t++)
            summs[h][t] = _mm256_setzero_ps();
    _Alignas(32) int16_t x16[KQ_T2][QK_K];
    for (int64_t b = 0; b < nsb; b++) {
        const uint8_t *pb = panel + b * KQ_PB_BYTES;
        __m256 dd[2][KQ_T2];
        for (int t = 0; t < KQ_T2; t++) {
            for (int i = 0; i < QK_K / 16; i++)
                _mm256_store_si256((__m256i *)(x16[t] + 16 * i),
                                   _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(y[t][b].qs + 16 * i))));
            const __m256 yd = _mm256_set1_ps(y[t][b].d);
            for (int h = 0; h < 2; h++)
                dd[h][t] = _mm256_mul_ps(yd, _mm256_load_ps((const float *)(pb + KQ_PL_D + 32 * h)));
        }
        for (int c = 0; c < 8; c++) {
            __m256i L[2][KQ_T2];
            for (int h = 0; h < 2; h++)
                for (int t = 0; t < KQ_T2; t++)
                    L[h][t] = _mm256_setzero_si256();
            for (int m = 0; m < 8; m++)
                for (int e = 0; e < 2; e++) {
                    const int j = 16 * m + 2 * c + e;
                    const __m256i w0 = _mm256_load_si256((const __m256i *)(pb + KQ_PL_W + 64 * j));
                    const __m256i w1 = _mm256_load_si256((const __m256i *)(pb + KQ_PL_W + 64 * j + 32));
                    for (int t = 0; t < KQ_T2; t++) {
                        const __m256i x = bcast_dword(x16[t] + 2 * j);
                        L[0][t] = _mm256_add_epi32(L[0][t], _mm256_madd_epi16(w0, x));
                        L[1][t] = _mm256_add_epi32(L[1][t], _mm256_madd_epi16(w1, x));
                    }
                }
            for (int h = 0; h < 2; h++) {
                const __m256i pair = _mm256_load_si256((const __m256i *)(pb + KQ_PL_PAIRS + 64 * c + 32 * h));
                for (int t = 0; t < KQ_T2; t++) {
                    if (type == QUANT_Q6_K)
                        L[h][t] = _mm256_sub_epi32(L[h][t], _mm256_madd_epi16(pair, bcast_dword(y[t][b].bsums + 2 * c)));
                    facc[c][h][t] = _mm256_fmadd_ps(dd[h][t], _mm256_cvtepi32_ps(L[h][t]), facc[c][h][t]);
                }
            }
        }
        if (type == QUANT_Q5_K)
            for (int t = 0; t < KQ_T2; t++) {
                const __m256 yd = _mm256_set1_ps(y[t][b].d);
                for (int h = 0; h < 2; h++) {
                    __m256i msum = _mm256_setzero_si256();
                    for (int i = 0; i < 8; i++)
                        msum = _mm256_add_epi32(
                            msum, _mm256_madd_epi16(_mm256_load_si256((const __m256i *)(pb + KQ_PL_PAIRS + 64 * i + 32 * h)),
                                                    bcast_dword(y[t][b].bsums + 2 * i)));
                    const __m256 dm = neg_ps(_mm256_mul_ps(yd, _mm256_load_ps((const float *)(pb + KQ_PL_DMIN + 32 * h))));
                    summs[h][t] = _mm256_fmadd_ps(dm, _mm256_cvtepi32_ps(msum), summs[h][t]);
                }
            }
    }
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < KQ_T2; t++) {
            const __m256 sum = _mm256_add_ps(
                _mm256_add_ps(_mm256_add_ps(facc[0][h][t], facc[4][h][t]), _mm256_add_ps(facc[2][h][t], facc[6][h][t])),
                _mm256_add_ps(_mm256_add_ps(facc[1][h][t], facc[5][h][t]), _mm256_add_ps(facc[3][h][t], facc[7][h][t])));
            out[h][t] = type == QUANT_Q5_K ? _mm256_add_ps(sum, summs[h][t]) : sum;
        }
}

/* Rows r0 .. r0 + nr (nr <= 16) of one panel, all tokens. */
static void panel_tiles(const struct quant_kq_gemm *g, const uint8_t *panel, int64_t r0, int nr, int SUB)
{
    for (int64_t t0 = 0; t0 < g->n_tokens; t0 += KQ_T2) {
        const int n = (int)(g->n_tokens - t0 < KQ_T2 ? g->n_tokens - t0 : KQ_T2);
        const block_q8_K *y[KQ_T2];
        quant_kq_tile_tokens(g, t0, n, KQ_T2, y);
        __m256 facc[2][KQ_T2];
        if (g->wtype == QUANT_Q3_K)
            lane_tile(g, panel, y, QUANT_Q3_K, facc);
        else if (g->wtype == QUANT_Q5_K)
            lane_tile(g, panel, y, QUANT_Q5_K, facc);
        else if (g->wtype == QUANT_Q6_K)
            lane_tile(g, panel, y, QUANT_Q6_K, facc);
        else if (SUB == 8) /* q4_K */
            tile(g, panel, y, 8, facc);
        else /* q2_K */
            tile(g, panel, y, 4, facc);
        for (int t = 0; t < n; t++) {
            float *out = g->Y + (t0 + t) * g->ldy + r0;
            if (nr == KQ_PANEL_ROWS) {
                _mm256_storeu_ps(out, facc[0][t]);
                _mm256_storeu_ps(out + 8, facc[1][t]);
                continue;
            }
            float tmp[KQ_PANEL_ROWS];
            _mm256_storeu_ps(tmp, facc[0][t]);
            _mm256_storeu_ps(tmp + 8, facc[1][t]);
            memcpy(out, tmp, (size_t)nr * sizeof(float));
        }
    }
}

void quant_kq_tiles_avx2(const struct quant_kq_gemm *g, const uint8_t *panels, int np, int64_t r0, int nr)
{
    const size_t pbytes = quant_kq_panel_bytes(g->cols);
    for (int p = 0; p < np; p++) {
        const int pr = nr - p * KQ_PANEL_ROWS < KQ_PANEL_ROWS ? nr - p * KQ_PANEL_ROWS : KQ_PANEL_ROWS;
        panel_tiles(g, panels + p * pbytes, r0 + p * KQ_PANEL_ROWS, pr, kq_sub_dwords(g->wtype));
    }
}
#endif
