/* k-quants: the group kernels of repacked Q4_K / Q5_K / Q6_K for AVX2 (the
 * layout is in kquants.h, the scalar twin in kq_repack.c; kq_repack_avx512.c
 * is the same kernel on 16 rows).
 *
 * 8 rows are in the lanes of a 256-bit register: a load brings dword k of
 * 8 rows' blocks, the quants are unpacked to unsigned bytes in registers,
 * and vpmaddubsw + vpmaddwd against a token's broadcast Q8_K dword add 4
 * products into each row's int32 sub-block sum (a pair of products is at
 * most 2 * 63 * 128, no int16 saturation). Sub-block sums are scaled in int32
 * (vpmulld), the mins (Q4_K/Q5_K) are 8 vpmaddwd against the Q8_K bsums, and
 * Q6_K's -32 starts each sub-block sum at -32 * bsum. All of that is exact,
 * so a super-block's integer sums are the reference's; the float step per
 * super-block is the reference's operations in its order (no FMA
 * contraction in this file): every row gets the reference's bits.
 *
 * A tile is one group x up to KQRP_TT tokens, so the unpacking of a weight
 * vector serves KQRP_TT tokens. */
#include "quant/kquants.h"

#if defined(KQRP_HAVE_AVX2)
#include <immintrin.h>

#define KQRP_TT 4
#ifndef KQRP_AHEAD
#define KQRP_AHEAD 4096 /* software prefetch distance in the weight stream, as the Q4_0/Q8_0 group kernels' */
#endif

/* VNNI's vpdpbusd / vpdpwssd with AVX2 instructions, exact for these operands. */
static inline __m256i dpbusd(__m256i acc, __m256i u, __m256i x)
{
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
}
static inline __m256i dpwssd(__m256i acc, __m256i a, __m256i b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
static inline __m256i bcast(const void *p) { return _mm256_set1_epi32(kq_dword(p)); }
static inline __m256i chunk(const uint8_t *gb, int k) { return _mm256_loadu_si256((const __m256i *)(gb + 32 * k)); }
/* Byte i of every lane, zero-extended. */
static inline __m256i lane_byte(__m256i v, int i) { return _mm256_and_si256(_mm256_srli_epi32(v, 8 * i), _mm256_set1_epi32(0xff)); }

static inline void prefetch_group_block(const uint8_t *gb, size_t bytes)
{
    for (size_t off = 0; off < bytes; off += 64)
        __builtin_prefetch((const char *)gb + KQRP_AHEAD + off, 0, QUANT_WEIGHT_PREFETCH);
}

/* Q4_K (q5 false) and Q5_K: one group x T tokens over every super-block. */
static inline __attribute__((always_inline)) void k4_tile(const struct quant_kq_gemm *g, int64_t grp, int64_t t0,
                                                          int T, bool q5)
{
    const int R = 8, qs0 = q5 ? 12 : 4; /* chunk of the first qs dword */
    const size_t gbb = (size_t)R * (q5 ? sizeof(block_q5_K) : sizeof(block_q4_K));
    const int64_t nsb = g->cols / QK_K;
    const block_q8_K *y[KQRP_TT];
    quant_kq_tile_tokens(g, t0, T, T, y);
    __m256 acc[KQRP_TT];
    for (int t = 0; t < T; t++)
        acc[t] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f), m1 = _mm256_set1_epi8(1);
    const uint8_t *gb = g->W + (size_t)grp * (size_t)nsb * gbb;
    for (int64_t b = 0; b < nsb; b++, gb += gbb) {
        prefetch_group_block(gb, gbb);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)gb));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(gb + 2 * R)));
        const __m256i w0 = chunk(gb, 1), w1 = chunk(gb, 2), w2 = chunk(gb, 3);
        /* bytes 0-3: scales 0-3 / 4-7, mins 0-3 / 4-7 (kq_unpack_scales_k4 in lanes) */
        const __m256i s03 = _mm256_and_si256(w0, _mm256_set1_epi8(0x3f));
        const __m256i s47 = _mm256_or_si256(_mm256_and_si256(w2, m4),
                                            _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(w0, 6), _mm256_set1_epi8(3)), 4));
        const __m256i m03 = _mm256_and_si256(w1, _mm256_set1_epi8(0x3f));
        const __m256i m47 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(w2, 4), m4),
                                            _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(w1, 6), _mm256_set1_epi8(3)), 4));
        __m256i isum[KQRP_TT], msum[KQRP_TT];
        for (int t = 0; t < T; t++) {
            isum[t] = _mm256_setzero_si256();
            msum[t] = _mm256_setzero_si256();
        }
        for (int j = 0; j < 8; j++) { /* min j weighs bsums 2j and 2j + 1: one int16 pair (m, m) */
            const __m256i m = lane_byte(j < 4 ? m03 : m47, j % 4);
            const __m256i mm = _mm256_or_si256(m, _mm256_slli_epi32(m, 16));
            for (int t = 0; t < T; t++)
                msum[t] = dpwssd(msum[t], mm, bcast(y[t][b].bsums + 2 * j));
        }
        for (int p = 0; p < 4; p++) { /* sub-blocks 2p (low nibbles) and 2p + 1 (high) */
            __m256i dlo[KQRP_TT], dhi[KQRP_TT];
            for (int t = 0; t < T; t++) {
                dlo[t] = _mm256_setzero_si256();
                dhi[t] = _mm256_setzero_si256();
            }
            for (int c = 0; c < 8; c++) {
                const __m256i q = chunk(gb, qs0 + 8 * p + c);
                __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi32(q, 4), m4);
                if (q5) {
                    const __m256i h = chunk(gb, 4 + c);
                    lo = _mm256_or_si256(lo, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 2 * p), m1), 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 2 * p + 1), m1), 4));
                }
                for (int t = 0; t < T; t++) {
                    dlo[t] = dpbusd(dlo[t], lo, bcast(y[t][b].qs + 64 * p + 4 * c));
                    dhi[t] = dpbusd(dhi[t], hi, bcast(y[t][b].qs + 64 * p + 32 + 4 * c));
                }
            }
            const __m256i sa = lane_byte(p < 2 ? s03 : s47, (2 * p) % 4);
            const __m256i sb = lane_byte(p < 2 ? s03 : s47, (2 * p + 1) % 4);
            for (int t = 0; t < T; t++)
                isum[t] = _mm256_add_epi32(isum[t], _mm256_add_epi32(_mm256_mullo_epi32(dlo[t], sa),
                                                                     _mm256_mullo_epi32(dhi[t], sb)));
        }
        for (int t = 0; t < T; t++) {
            const __m256 yd = _mm256_set1_ps(y[t][b].d);
            const __m256 term = _mm256_sub_ps(_mm256_mul_ps(_mm256_mul_ps(yd, d), _mm256_cvtepi32_ps(isum[t])),
                                              _mm256_mul_ps(_mm256_mul_ps(yd, dmin), _mm256_cvtepi32_ps(msum[t])));
            acc[t] = _mm256_add_ps(acc[t], term);
        }
    }
    for (int t = 0; t < T; t++)
        _mm256_storeu_ps(g->Y + (t0 + t) * g->ldy + grp * R, acc[t]);
}

/* Q6_K: quarter q of half h takes its low nibbles from ql dword 16h + 8(q & 1) + c
 * (nibble q >> 1) and its top 2 bits from qh dword 8h + c (bits 2q); element
 * 128h + 32q + 4c, sub-block 8h + 2q + c / 4. */
static inline __attribute__((always_inline)) void q6_tile(const struct quant_kq_gemm *g, int64_t grp, int64_t t0,
                                                          int T)
{
    const int R = 8;
    const size_t gbb = (size_t)R * sizeof(block_q6_K);
    const int64_t nsb = g->cols / QK_K;
    const block_q8_K *y[KQRP_TT];
    quant_kq_tile_tokens(g, t0, T, T, y);
    __m256 acc[KQRP_TT];
    for (int t = 0; t < T; t++)
        acc[t] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f), m3 = _mm256_set1_epi8(0x30);
    const uint8_t *gb = g->W + (size_t)grp * (size_t)nsb * gbb;
    for (int64_t b = 0; b < nsb; b++, gb += gbb) {
        prefetch_group_block(gb, gbb);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(gb + KQRP_Q6_D * R)));
        __m256i isum[KQRP_TT];
        for (int t = 0; t < T; t++)
            isum[t] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++)
            for (int c4 = 0; c4 < 8; c4 += 4) {
                __m256i dot[4][KQRP_TT];
                for (int q = 0; q < 4; q++)
                    for (int t = 0; t < T; t++)
                        dot[q][t] = _mm256_set1_epi32(-32 * (y[t][b].bsums[8 * h + 2 * q + c4 / 4]));
                for (int c = c4; c < c4 + 4; c++) {
                    const __m256i la = chunk(gb, 16 * h + c), lb = chunk(gb, 16 * h + 8 + c), qh = chunk(gb, 32 + 8 * h + c);
                    const __m256i u[4] = {
                        _mm256_or_si256(_mm256_and_si256(la, m4), _mm256_and_si256(_mm256_slli_epi32(qh, 4), m3)),
                        _mm256_or_si256(_mm256_and_si256(lb, m4), _mm256_and_si256(_mm256_slli_epi32(qh, 2), m3)),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(la, 4), m4), _mm256_and_si256(qh, m3)),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(lb, 4), m4),
                                        _mm256_and_si256(_mm256_srli_epi32(qh, 2), m3)),
                    };
                    for (int q = 0; q < 4; q++)
                        for (int t = 0; t < T; t++)
                            dot[q][t] = dpbusd(dot[q][t], u[q], bcast(y[t][b].qs + 128 * h + 32 * q + 4 * c));
                }
                for (int q = 0; q < 4; q++) {
                    const int sub = 8 * h + 2 * q + c4 / 4;
                    const __m256i sc = _mm256_srai_epi32(_mm256_slli_epi32(chunk(gb, 48 + sub / 4), 24 - 8 * (sub % 4)), 24);
                    for (int t = 0; t < T; t++)
                        isum[t] = _mm256_add_epi32(isum[t], _mm256_mullo_epi32(dot[q][t], sc));
                }
            }
        for (int t = 0; t < T; t++)
            acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(y[t][b].d), d),
                                                         _mm256_cvtepi32_ps(isum[t])));
    }
    for (int t = 0; t < T; t++)
        _mm256_storeu_ps(g->Y + (t0 + t) * g->ldy + grp * R, acc[t]);
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

void quant_kqrp_rows_avx2(const struct quant_kq_gemm *g, int64_t g0, int64_t g1)
{
    const kqrp_tile_fn *tiles = g->wtype == QUANT_Q4_K ? q4k_widths : g->wtype == QUANT_Q5_K ? q5k_widths : q6k_widths;
    for (int64_t grp = g0; grp < g1; grp++)
        for (int64_t t = 0; t < g->n_tokens; t += KQRP_TT)
            tiles[g->n_tokens - t < KQRP_TT ? g->n_tokens - t : KQRP_TT](g, grp, t);
}
#endif
