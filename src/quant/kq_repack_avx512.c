/* k-quants: the group kernels of repacked Q4_K / Q5_K / Q6_K for AVX-512
 * VNNI (the layout is in kquants.h, the scalar twin in kq_repack.c).
 *
 * 16 rows are in the lanes of a 512-bit register: a load brings dword k of
 * 16 rows' blocks, the quants are unpacked to unsigned bytes in registers,
 * and vpdpbusd against a token's broadcast Q8_K dword adds 4 products into
 * each row's int32 sub-block sum. Sub-block sums are scaled in int32
 * (vpmulld), the mins (Q4_K/Q5_K) are 8 vpdpwssd against the Q8_K bsums, and
 * Q6_K's -32 starts each sub-block sum at -32 * bsum. All of that is exact,
 * so a super-block's integer sums are the reference's; the float step per
 * super-block is the reference's operations in its order (no FMA
 * contraction in this file): every row gets the reference's bits.
 *
 * A tile is one group x up to KQRP_TT tokens, so the unpacking of a weight
 * vector serves KQRP_TT tokens. */
#include "quant/kquants.h"

#if defined(KQRP_HAVE_AVX512)
#include <immintrin.h>

#define KQRP_TT 4
#ifndef KQRP_AHEAD
#define KQRP_AHEAD 8192 /* software prefetch distance in the weight stream (4 KiB: 5-15% fewer GB/s, q4_K/q6_K, 1 thread) */
#endif

static inline __m512i bcast(const void *p) { return _mm512_set1_epi32(kq_dword(p)); }
static inline __m512i chunk(const uint8_t *gb, int k) { return _mm512_loadu_si512(gb + 64 * k); }
/* Byte i of every lane, zero-extended. */
static inline __m512i lane_byte(__m512i v, int i) { return _mm512_and_si512(_mm512_srli_epi32(v, 8 * i), _mm512_set1_epi32(0xff)); }

static inline void prefetch_group_block(const uint8_t *gb, size_t bytes)
{
    for (size_t off = 0; off < bytes; off += 64)
        __builtin_prefetch((const char *)gb + KQRP_AHEAD + off, 0, QUANT_WEIGHT_PREFETCH);
}

/* Q4_K (q5 false) and Q5_K: one group x T tokens over every super-block. */
static inline __attribute__((always_inline)) void k4_tile(const struct quant_kq_gemm *g, int64_t grp, int64_t t0,
                                                          int T, bool q5)
{
    const int R = 16, qs0 = q5 ? 12 : 4; /* chunk of the first qs dword */
    const size_t gbb = (size_t)R * (q5 ? sizeof(block_q5_K) : sizeof(block_q4_K));
    const int64_t nsb = g->cols / QK_K;
    const block_q8_K *y[KQRP_TT];
    quant_kq_tile_tokens(g, t0, T, T, y);
    __m512 acc[KQRP_TT];
    for (int t = 0; t < T; t++)
        acc[t] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0f), m1 = _mm512_set1_epi8(1);
    const uint8_t *gb = g->W + (size_t)grp * (size_t)nsb * gbb;
    for (int64_t b = 0; b < nsb; b++, gb += gbb) {
        prefetch_group_block(gb, gbb);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)gb));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gb + 2 * R)));
        const __m512i w0 = chunk(gb, 1), w1 = chunk(gb, 2), w2 = chunk(gb, 3);
        /* bytes 0-3: scales 0-3 / 4-7, mins 0-3 / 4-7 (kq_unpack_scales_k4 in lanes) */
        const __m512i s03 = _mm512_and_si512(w0, _mm512_set1_epi8(0x3f));
        const __m512i s47 = _mm512_or_si512(_mm512_and_si512(w2, m4),
                                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(w0, 6), _mm512_set1_epi8(3)), 4));
        const __m512i m03 = _mm512_and_si512(w1, _mm512_set1_epi8(0x3f));
        const __m512i m47 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w2, 4), m4),
                                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(w1, 6), _mm512_set1_epi8(3)), 4));
        __m512i isum[KQRP_TT], msum[KQRP_TT];
        for (int t = 0; t < T; t++) {
            isum[t] = _mm512_setzero_si512();
            msum[t] = _mm512_setzero_si512();
        }
        for (int j = 0; j < 8; j++) { /* min j weighs bsums 2j and 2j + 1: one int16 pair (m, m) */
            const __m512i m = lane_byte(j < 4 ? m03 : m47, j % 4);
            const __m512i mm = _mm512_or_si512(m, _mm512_slli_epi32(m, 16));
            for (int t = 0; t < T; t++)
                msum[t] = _mm512_dpwssd_epi32(msum[t], mm, bcast(y[t][b].bsums + 2 * j));
        }
        for (int p = 0; p < 4; p++) { /* sub-blocks 2p (low nibbles) and 2p + 1 (high) */
            __m512i dlo[KQRP_TT], dhi[KQRP_TT];
            for (int t = 0; t < T; t++) {
                dlo[t] = _mm512_setzero_si512();
                dhi[t] = _mm512_setzero_si512();
            }
            for (int c = 0; c < 8; c++) {
                const __m512i q = chunk(gb, qs0 + 8 * p + c);
                __m512i lo = _mm512_and_si512(q, m4), hi = _mm512_and_si512(_mm512_srli_epi32(q, 4), m4);
                if (q5) {
                    const __m512i h = chunk(gb, 4 + c);
                    lo = _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 2 * p), m1), 4));
                    hi = _mm512_or_si512(hi, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 2 * p + 1), m1), 4));
                }
                for (int t = 0; t < T; t++) {
                    dlo[t] = _mm512_dpbusd_epi32(dlo[t], lo, bcast(y[t][b].qs + 64 * p + 4 * c));
                    dhi[t] = _mm512_dpbusd_epi32(dhi[t], hi, bcast(y[t][b].qs + 64 * p + 32 + 4 * c));
                }
            }
            const __m512i sa = lane_byte(p < 2 ? s03 : s47, (2 * p) % 4);
            const __m512i sb = lane_byte(p < 2 ? s03 : s47, (2 * p + 1) % 4);
            for (int t = 0; t < T; t++)
                isum[t] = _mm512_add_epi32(isum[t], _mm512_add_epi32(_mm512_mullo_epi32(dlo[t], sa),
                                                                     _mm512_mullo_epi32(dhi[t], sb)));
        }
        for (int t = 0; t < T; t++) {
            const __m512 yd = _mm512_set1_ps(y[t][b].d);
            const __m512 term = _mm512_sub_ps(_mm512_mul_ps(_mm512_mul_ps(yd, d), _mm512_cvtepi32_ps(isum[t])),
                                              _mm512_mul_ps(_mm512_mul_ps(yd, dmin), _mm512_cvtepi32_ps(msum[t])));
            acc[t] = _mm512_add_ps(acc[t], term);
        }
    }
    for (int t = 0; t < T; t++)
        _mm512_storeu_ps(g->Y + (t0 + t) * g->ldy + grp * R, acc[t]);
}

/* Q6_K: quarter q of half h takes its low nibbles from ql dword 16h + 8(q & 1) + c
 * (nibble q >> 1) and its top 2 bits from qh dword 8h + c (bits 2q); element
 * 128h + 32q + 4c, sub-block 8h + 2q + c / 4. */
static inline __attribute__((always_inline)) void q6_tile(const struct quant_kq_gemm *g, int64_t grp, int64_t t0,
                                                          int T)
{
    const int R = 16;
    const size_t gbb = (size_t)R * sizeof(block_q6_K);
    const int64_t nsb = g->cols / QK_K;
    const block_q8_K *y[KQRP_TT];
    quant_kq_tile_tokens(g, t0, T, T, y);
    __m512 acc[KQRP_TT];
    for (int t = 0; t < T; t++)
        acc[t] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0f), m3 = _mm512_set1_epi8(0x30);
    const uint8_t *gb = g->W + (size_t)grp * (size_t)nsb * gbb;
    for (int64_t b = 0; b < nsb; b++, gb += gbb) {
        prefetch_group_block(gb, gbb);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gb + KQRP_Q6_D * R)));
        __m512i isum[KQRP_TT];
        for (int t = 0; t < T; t++)
            isum[t] = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++)
            for (int c4 = 0; c4 < 8; c4 += 4) {
                __m512i dot[4][KQRP_TT];
                for (int q = 0; q < 4; q++)
                    for (int t = 0; t < T; t++)
                        dot[q][t] = _mm512_set1_epi32(-32 * (y[t][b].bsums[8 * h + 2 * q + c4 / 4]));
                for (int c = c4; c < c4 + 4; c++) {
                    const __m512i la = chunk(gb, 16 * h + c), lb = chunk(gb, 16 * h + 8 + c), qh = chunk(gb, 32 + 8 * h + c);
                    const __m512i u[4] = {
                        _mm512_or_si512(_mm512_and_si512(la, m4), _mm512_and_si512(_mm512_slli_epi32(qh, 4), m3)),
                        _mm512_or_si512(_mm512_and_si512(lb, m4), _mm512_and_si512(_mm512_slli_epi32(qh, 2), m3)),
                        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(la, 4), m4), _mm512_and_si512(qh, m3)),
                        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(lb, 4), m4),
                                        _mm512_and_si512(_mm512_srli_epi32(qh, 2), m3)),
                    };
                    for (int q = 0; q < 4; q++)
                        for (int t = 0; t < T; t++)
                            dot[q][t] = _mm512_dpbusd_epi32(dot[q][t], u[q], bcast(y[t][b].qs + 128 * h + 32 * q + 4 * c));
                }
                for (int q = 0; q < 4; q++) {
                    const int sub = 8 * h + 2 * q + c4 / 4;
                    const __m512i sc = _mm512_srai_epi32(_mm512_slli_epi32(chunk(gb, 48 + sub / 4), 24 - 8 * (sub % 4)), 24);
                    for (int t = 0; t < T; t++)
                        isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(dot[q][t], sc));
                }
            }
        for (int t = 0; t < T; t++)
            acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(y[t][b].d), d),
                                                         _mm512_cvtepi32_ps(isum[t])));
    }
    for (int t = 0; t < T; t++)
        _mm512_storeu_ps(g->Y + (t0 + t) * g->ldy + grp * R, acc[t]);
}

typedef void (*kqrp_tile_fn)(const struct quant_kq_gemm *g, int64_t grp, int64_t t0);

#define KQRP_WIDTHS(name, call)                                                                            \
    static void name##_1(const struct quant_kq_gemm *g, int64_t grp, int64_t t0) { call(g, grp, t0, 1); } \
    static void name##_2(const struct quant_kq_gemm *g, int64_t grp, int64_t t0) { call(g, grp, t0, 2); } \
    static void name##_3(const struct quant_kq_gemm *g, int64_t grp, int64_t t0) { call(g, grp, t0, 3); } \
    static void name##_4(const struct quant_kq_gemm *g, int64_t grp, int64_t t0) { call(g, grp, t0, 4); } \
    static const kqrp_tile_fn name##_widths[KQRP_TT + 1] = {NULL, name##_1, name##_2, name##_3, name##_4};

#define Q4K_TILE(g, grp, t0, T) k4_tile(g, grp, t0, T, false)
#define Q5K_TILE(g, grp, t0, T) k4_tile(g, grp, t0, T, true)
KQRP_WIDTHS(q4k, Q4K_TILE)
KQRP_WIDTHS(q5k, Q5K_TILE)
KQRP_WIDTHS(q6k, q6_tile)

void quant_kqrp_rows_avx512(const struct quant_kq_gemm *g, int64_t g0, int64_t g1)
{
    const kqrp_tile_fn *tiles = g->wtype == QUANT_Q4_K ? q4k_widths : g->wtype == QUANT_Q5_K ? q5k_widths : q6k_widths;
    for (int64_t grp = g0; grp < g1; grp++)
        for (int64_t t = 0; t < g->n_tokens; t += KQRP_TT)
            tiles[g->n_tokens - t < KQRP_TT ? g->n_tokens - t : KQRP_TT](g, grp, t);
}
#endif
