/* k-quants: the group kernels of repacked Q2_K to Q6_K for AVX-512
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
#include "quant/iq4_mxfp4.h"
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

/* kq_unpack_scales_k4 in the lanes (Q4_K's and Q5_K's 6-bit packing): from a
 * row's three scale dwords, bytes 0-3 of s03 / s47 / m03 / m47 are its scales
 * 0-3, 4-7 and mins 0-3, 4-7. */
static inline void unpack_scales_mins(__m512i w0, __m512i w1, __m512i w2, __m512i *s03, __m512i *s47, __m512i *m03, __m512i *m47)
{
    const __m512i low4 = _mm512_set1_epi8(0x0f), low6 = _mm512_set1_epi8(0x3f), top2 = _mm512_set1_epi8(0x30);
    *s03 = _mm512_and_si512(w0, low6);
    *m03 = _mm512_and_si512(w1, low6);
    *s47 = _mm512_or_si512(_mm512_and_si512(w2, low4), _mm512_and_si512(_mm512_srli_epi32(w0, 2), top2));
    *m47 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w2, 4), low4), _mm512_and_si512(_mm512_srli_epi32(w1, 2), top2));
}

/* One chain step in the lanes, fma(sums, x_scale * y_d, acc) per row: kq_chains_add's, and an eight-lane
 * kernel's fma(d * dy, lane, acc) (products commute exactly: the same bits). */
static inline __m512 chain_add(__m512 acc, __m512i sums, __m512 x_scale, float y_d)
{
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(x_scale, _mm512_set1_ps(y_d)), acc);
}

/* vpshufb patterns on a vector of 4 bytes per row: byte k of each row's
 * dword zero-extended to int32 (one), or as both halves of an int16 pair (pair). */
static inline __m512i pick_byte(int k)
{
    return _mm512_add_epi32(_mm512_set1_epi32((int)(0x80808000u | (unsigned)k)),
                            _mm512_set4_epi32(12, 8, 4, 0));
}
static inline __m512i pick_two(int a, int b) /* bytes a and b as an int16 pair */
{
    return _mm512_add_epi32(_mm512_set1_epi32((int)(0x80008000u | (unsigned)a | (unsigned)b << 16)),
                            _mm512_set4_epi32(0x000c000c, 0x00080008, 0x00040004, 0));
}
static inline __m512i pick_pair(int k) { return pick_two(k, k); }

/* ---- Q4_K: the two chains of llama.cpp's q4_K_8x8 gemv per row -------------
 * Per super-block and row: isum = sum over sub-blocks j of sc_j * (q . q8),
 * msum = sum of m_j * (bsums 2j + 2j+1), exact; acc = fma(isum, d * dy, acc),
 * accm = fma(msum, dmin * dy, accm); acc - accm at the end. Qs dword 8p + i
 * holds elements 64p + 4i.. (low nibbles, sub-block 2p) and 64p + 32 + 4i..
 * (high, 2p + 1). High nibbles stay in place (x16) with sums of their own,
 * shifted back once per super-block: exact, every product is a multiple of
 * 16. Ranges: a sub-block sum is at most 32 * 15 * 127 (x16 < 2^20), times a
 * scale <= 63 and 4 sub-blocks stays below 2^31. */


static inline __attribute__((always_inline)) void q4k_pass(const struct quant_kq_gemm *g, int64_t grp, int64_t t0,
                                                           int T)
{
    const bool once = quant_weights_read_once(g->n_tokens);
    const size_t gbb = R * sizeof(block_q4_K);
    const int64_t nsb = g->cols / QK_K;
    const block_q8_K *y[KQRP_TT];
    quant_kq_tile_tokens(g, t0, T, T, y);
    __m512 acc[KQRP_TT], accm[KQRP_TT];
    for (int t = 0; t < T; t++)
        acc[t] = accm[t] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0f), high4 = _mm512_set1_epi8((char)0xf0);
    const uint8_t *gb = g->W + (size_t)grp * R * g->wrow;
    for (int64_t b = 0; b < nsb; b++, gb += gbb) {
        /* kq_unpack_scales_k4 in the lanes: bytes 0-3 of s03 / s47 / m03 / m47 are scales 0-3, 4-7, mins 0-3, 4-7 */
        const size_t at_sc = KQRP_Q4K_SC(R);
        const __m512i w0 = dword_vec(gb, at_sc, 0), w1 = dword_vec(gb, at_sc, 1), w2 = dword_vec(gb, at_sc, 2);
        __m512i s03, s47, m03, m47;
        unpack_scales_mins(w0, w1, w2, &s03, &s47, &m03, &m47);
        const __m512 d = vmath_load16_f16(gb + KQRP_Q4K_D(R)), dmin = vmath_load16_f16(gb + KQRP_Q4K_DMIN(R));
        __m512i msum[KQRP_TT];
        for (int t = 0; t < T; t++)
            msum[t] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) { /* min j weighs bsums 2j and 2j + 1: the int16 pair (m_j, m_j) */
            const __m512i mm = _mm512_shuffle_epi8(j < 4 ? m03 : m47, pick_pair(j % 4));
            for (int t = 0; t < T; t++)
                msum[t] = _mm512_dpwssd_epi32(msum[t], mm, bcast(y[t][b].bsums + 2 * j));
        }
        for (int t = 0; t < T; t++)
            accm[t] = chain_add(accm[t], msum[t], dmin, y[t][b].d);
        __m512i isum[KQRP_TT], isum16[KQRP_TT];
        for (int t = 0; t < T; t++)
            isum[t] = isum16[t] = _mm512_setzero_si512();
        /* P sub-block pairs at once: 2 * P * T independent vpdpbusd chains hide their latency */
        const int P = T == 1 ? 4 : T == 2 ? 2 : 1;
        for (int p0 = 0; p0 < 4; p0 += P) {
            __m512i dlo[4][KQRP_TT], dhi[4][KQRP_TT];
            for (int pi = 0; pi < P; pi++)
                for (int t = 0; t < T; t++)
                    dlo[pi][t] = dhi[pi][t] = _mm512_setzero_si512();
            for (int i = 0; i < 8; i++) {
                quant_prefetch_weights_part(gb + KQRP_AHEAD, gbb, once, (p0 / P) * 8 + i, 32 / P);
                for (int pi = 0; pi < P; pi++) {
                    const int p = p0 + pi;
                    const __m512i raw = dword_vec(gb, KQRP_Q4K_QS(R), 8 * p + i);
                    const __m512i lo = _mm512_and_si512(raw, low4), hi16 = _mm512_and_si512(raw, high4);
                    for (int t = 0; t < T; t++) {
                        dlo[pi][t] = _mm512_dpbusd_epi32(dlo[pi][t], lo, bcast(y[t][b].qs + 64 * p + 4 * i));
                        dhi[pi][t] = _mm512_dpbusd_epi32(dhi[pi][t], hi16, bcast(y[t][b].qs + 64 * p + 32 + 4 * i));
                    }
                }
            }
            for (int pi = 0; pi < P; pi++) {
                const int p = p0 + pi;
                const __m512i scales = p < 2 ? s03 : s47;
                const __m512i sa = _mm512_shuffle_epi8(scales, pick_byte((2 * p) % 4));
                const __m512i sb = _mm512_shuffle_epi8(scales, pick_byte((2 * p + 1) % 4));
                for (int t = 0; t < T; t++) {
                    isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(dlo[pi][t], sa));
                    isum16[t] = _mm512_add_epi32(isum16[t], _mm512_mullo_epi32(dhi[pi][t], sb));
                }
            }
        }
        for (int t = 0; t < T; t++) {
            const __m512i s = _mm512_add_epi32(isum[t], _mm512_srai_epi32(isum16[t], 4));
            acc[t] = chain_add(acc[t], s, d, y[t][b].d);
        }
    }
    for (int t = 0; t < T; t++)
        _mm512_storeu_ps(g->Y + (t0 + t) * g->ldy + grp * R, _mm512_sub_ps(acc[t], accm[t]));
}

/* ---- Q2_K: the two chains of llama.cpp's q2_K_8x8 gemv per row -------------
 * Q4_K's chains, with 16 sub-blocks of 16 (kq_scalar.c): isum = sum over
 * sub-blocks g of sc_g * (q . q8), msum = sum of m_g * bsums_g. Bits 2s, 2s + 1
 * of qs dword 8h + i hold elements 128h + 32s + 4i.. (sub-block 8h + 2s +
 * i / 4); each field is masked in place (times 4^s), its sub-block's four
 * dwords summed by vpdpbusd and shifted back (exact: every product is a
 * multiple of 4^s). The shifted sum, at most 16 * 3 * 127 in magnitude, is
 * its own int16 (its high half the sign), so one vpdpwssd against the
 * zero-extended scale (sc, 0) multiplies and adds it. */

static inline __attribute__((always_inline)) void q2k_pass(const struct quant_kq_gemm *g, int64_t grp, int64_t t0,
                                                           int T)
{
    const bool once = quant_weights_read_once(g->n_tokens);
    const size_t gbb = R * sizeof(block_q2_K);
    const int64_t nsb = g->cols / QK_K;
    const block_q8_K *y[KQRP_TT];
    quant_kq_tile_tokens(g, t0, T, T, y);
    __m512 acc[KQRP_TT], accm[KQRP_TT];
    for (int t = 0; t < T; t++)
        acc[t] = accm[t] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const uint8_t *gb = g->W + (size_t)grp * R * g->wrow;
    for (int64_t b = 0; b < nsb; b++, gb += gbb) {
        __m512i sc[4], mn[4]; /* byte k of dword j: sub-block 4j + k's scale, min */
        for (int j = 0; j < 4; j++) {
            const __m512i w = dword_vec(gb, KQRP_Q2K_SC(R), j);
            sc[j] = _mm512_and_si512(w, low4);
            mn[j] = _mm512_and_si512(_mm512_srli_epi32(w, 4), low4);
        }
        const __m512 d = vmath_load16_f16(gb + KQRP_Q2K_D(R)), dmin = vmath_load16_f16(gb + KQRP_Q2K_DMIN(R));
        __m512i msum[KQRP_TT], isum[KQRP_TT];
        for (int t = 0; t < T; t++)
            msum[t] = isum[t] = _mm512_setzero_si512();
        for (int p = 0; p < 8; p++) { /* mins 2p, 2p + 1 weigh bsums 2p, 2p + 1 */
            const __m512i mm = _mm512_shuffle_epi8(mn[p / 2], pick_two(2 * (p % 2), 2 * (p % 2) + 1));
            for (int t = 0; t < T; t++)
                msum[t] = _mm512_dpwssd_epi32(msum[t], mm, bcast(y[t][b].bsums + 2 * p));
        }
        for (int t = 0; t < T; t++)
            accm[t] = chain_add(accm[t], msum[t], dmin, y[t][b].d);
#pragma GCC unroll 4 /* 33.0 -> 35.1 GB/s one thread from cache (Zen 4) */
        for (int part = 0; part < 4; part++) { /* half h, dwords 4ih .. 4ih + 3 */
            const int h = part / 2, ih = part % 2;
            quant_prefetch_weights_part(gb + KQRP_AHEAD, gbb, once, part, 4);
            __m512i raw[4];
            for (int ii = 0; ii < 4; ii++)
                raw[ii] = dword_vec(gb, KQRP_Q2K_QS(R), 8 * h + 4 * ih + ii);
            for (int s = 0; s < 4; s++) {
                const __m512i field = _mm512_set1_epi8((char)(3 << 2 * s));
                __m512i dot[KQRP_TT];
                for (int t = 0; t < T; t++)
                    dot[t] = _mm512_setzero_si512();
                for (int ii = 0; ii < 4; ii++) {
                    const __m512i q = _mm512_and_si512(raw[ii], field);
                    for (int t = 0; t < T; t++)
                        dot[t] = _mm512_dpbusd_epi32(dot[t], q, bcast(y[t][b].qs + 128 * h + 32 * s + 16 * ih + 4 * ii));
                }
                const __m512i scale = _mm512_shuffle_epi8(sc[2 * h + s / 2], pick_byte(2 * (s % 2) + ih));
                for (int t = 0; t < T; t++)
                    isum[t] = _mm512_dpwssd_epi32(isum[t], _mm512_srai_epi32(dot[t], 2 * s), scale);
            }
        }
        for (int t = 0; t < T; t++)
            acc[t] = chain_add(acc[t], isum[t], d, y[t][b].d);
    }
    for (int t = 0; t < T; t++)
        _mm512_storeu_ps(g->Y + (t0 + t) * g->ldy + grp * R, _mm512_sub_ps(acc[t], accm[t]));
}

/* ---- Q6_K: ggml's eight lanes per row --------------------------------------------
 * Lane c of a super-block (the elements e with (e % 32) / 4 == c) is, per
 * row, the sum over the 8 dwords e = 128h + 32q + 4c (h, q < 2, 4) of
 * sc[e / 16] * (u . q8) with u = q + 32 unsigned, minus 32 * (sc[2c] *
 * bsums[2c] + sc[2c + 1] * bsums[2c + 1]) (kq_scalar.c): each dword is one
 * vpmaddubsw (two pair sums per row, at most 2 * 63 * 127) and one vpdpwssd
 * against the (sc, sc) int16 pair of its sub-block, the offset one vpdpwssd
 * of (-32 sc[2c], -32 sc[2c + 1]) against the token's bsums pair. Then
 * acc[c] = fma(d * dy, lane, acc[c]) per row, and hsum_float_8's order at the
 * end. Element groups 128h + 32q + 4c, q = 0..3, are one unit of three
 * packed dwords (kq_internal.h). */

#define Q6K_CHUNK 4 /* super-blocks of a group a batch kernel takes at a time */
#define LANES_TT 2 /* tokens per pass of the eight-lane kernels (Q5_K, Q6_K): 8 float lanes per token in registers */

/* vpshufb pattern: bytes a and b of each row's dword as the high bytes of an
 * int16 pair (an arithmetic shift then sign-extends them). */
static inline __m512i pick_high_pair(int a, int b)
{
    return _mm512_add_epi32(_mm512_set1_epi32((int)(0x00800080u | (unsigned)a << 8 | (unsigned)b << 24)),
                            _mm512_set4_epi32(0x0c000c00, 0x08000800, 0x04000400, 0));
}

/* Each byte of a qword rotated within it (vpmultishiftqb: byte j takes the 8
 * bits from bit 8j + shift, mod 64): a per-byte shift whose bits from the
 * neighbour the bit select below ignores, on the shuffle port instead of the
 * one the multiplies use. */
static inline __m512i byte_shift(__m512i v, int shift)
{
    const int64_t ctrl = (int64_t)(0x3830282018100800ull + 0x0101010101010101ull * (uint64_t)(shift & 63));
    return _mm512_multishift_epi64_epi8(_mm512_set1_epi64(ctrl), v);
}

/* The four u = q + 32 of element groups 128h + 32q + 4c, q = 0..3, of 16
 * rows: three masked out of the unit's dwords, the fourth's 2-bit parts
 * shifted down (vpmultishiftqb) and joined by bit selects (vpternlogd) under
 * masks; a select overwrites the operand computed for it, so no copy of a
 * mask is needed. */
#define SEL_B_OVER_A 0xd8 /* mask ? b : a, for (a, b, mask) */
static inline void q6k_levels(const uint8_t *gb, int h, int c, __m512i u[4])
{
    const __m512i low6 = _mm512_set1_epi8(0x3f);
    const size_t at = KQRP_Q6K_UNIT(R, h, c);
    const __m512i d0 = dword_vec(gb, at, 0), d1 = dword_vec(gb, at, 1), d2 = dword_vec(gb, at, 2);
    u[0] = _mm512_and_si512(d0, low6);
    u[1] = _mm512_and_si512(d1, low6);
    u[2] = _mm512_and_si512(d2, low6);
    const __m512i b01 = _mm512_ternarylogic_epi32(byte_shift(d1, 4), byte_shift(d0, 6), _mm512_set1_epi8(0x03), SEL_B_OVER_A);
    u[3] = _mm512_and_si512(_mm512_ternarylogic_epi32(byte_shift(d2, 2), b01, _mm512_set1_epi8(0x0f), SEL_B_OVER_A), low6);
}

/* One group-block unpacked: what a token's pass reads. */
struct q6k_block {
    __m512i u[2][8][4]; /* [h][c][q]: u = q + 32 of element group 128h + 32q + 4c of the 16 rows */
    __m512i scp[16];    /* (sc_s, sc_s) of sub-block s, sign-extended */
    __m512i off[8];     /* (-32 sc_2c, -32 sc_2c+1) */
    __m512 d;
};

static inline __attribute__((always_inline)) void q6k_scales(const uint8_t *gb, __m512i scp[16], __m512i off[8])
{
#pragma GCC unroll 16
    for (int s = 0; s < 16; s++)
        scp[s] = _mm512_srai_epi16(_mm512_shuffle_epi8(dword_vec(gb, KQRP_Q6K_SC(R), s / 4), pick_high_pair(s % 4, s % 4)), 8);
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) /* (sc << 8) >> 3, negated */
        off[c] = _mm512_sub_epi16(
            _mm512_setzero_si512(),
            _mm512_srai_epi16(_mm512_shuffle_epi8(dword_vec(gb, KQRP_Q6K_SC(R), c / 2), pick_high_pair(2 * c % 4, 2 * c % 4 + 1)), 3));
}

/* Lane c of T tokens' super-block b (y[t] + b), from the unpacked u of lane c
 * (u[h][q]) or, with u NULL, unpacked here from gb; the int lanes in lane[t]. */
static inline __attribute__((always_inline)) void q6k_lane(const uint8_t *gb, const __m512i (*u)[8][4], const __m512i *scp,
                                                           __m512i off, const block_q8_K *const *y, int64_t b, int T,
                                                           int c, __m512i *lane)
{
    for (int t = 0; t < T; t++)
        lane[t] = _mm512_dpwssd_epi32(_mm512_setzero_si512(), off, bcast(y[t][b].bsums + 2 * c));
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        __m512i v[4];
        if (u)
            for (int q = 0; q < 4; q++)
                v[q] = u[h][c][q];
        else
            q6k_levels(gb, h, c, v);
        for (int q = 0; q < 4; q++) {
            const __m512i sc = scp[8 * h + 2 * q + c / 4];
            for (int t = 0; t < T; t++)
                lane[t] = _mm512_dpwssd_epi32(lane[t], _mm512_maddubs_epi16(v[q], bcast(y[t][b].qs + 128 * h + 32 * q + 4 * c)),
                                              sc);
        }
    }
}

/* An eight-lane kernel's row sums in hsum_float_8's order, row by row. */
static inline __m512 lanes_hsum(const __m512 v[8])
{
    return _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(v[0], v[4]), _mm512_add_ps(v[2], v[6])),
                         _mm512_add_ps(_mm512_add_ps(v[1], v[5]), _mm512_add_ps(v[3], v[7])));
}

static inline __attribute__((always_inline)) void q6k_store(const struct quant_kq_gemm *g, int64_t grp, int64_t t,
                                                            const __m512 v[8])
{
    _mm512_storeu_ps(g->Y + t * g->ldy + grp * R, lanes_hsum(v));
}

/* Super-blocks [b0, b1) of a group (gb its first) for T (<= LANES_TT)
 * tokens into acc[t][c], unpacking as it goes; the first pass over a stretch
 * of the weights prefetches ahead of it. */
static inline __attribute__((always_inline)) void q6k_blocks(const uint8_t *gb, const block_q8_K *const *y, int64_t b0,
                                                             int64_t b1, int T, bool prefetch, bool once,
                                                             __m512 (*acc)[8])
{
    const size_t gbb = R * sizeof(block_q6_K);
    gb += (size_t)b0 * gbb;
    for (int64_t b = b0; b < b1; b++, gb += gbb) {
        __m512i scp[16], off[8];
        q6k_scales(gb, scp, off);
        const __m512 d = vmath_load16_f16(gb + KQRP_Q6K_D(R));
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            if (prefetch)
                quant_prefetch_weights_part(gb + KQRP_AHEAD, gbb, once, c, 8);
            __m512i lane[LANES_TT];
            q6k_lane(gb, NULL, scp, off[c], y, b, T, c, lane);
            for (int t = 0; t < T; t++)
                acc[t][c] = chain_add(acc[t][c], lane[t], d, y[t][b].d);
        }
    }
}


/* Batches of a few tokens (several streams decoding at once, a short
 * verification) for the eight-lane kernels (Q5_K, Q6_K): Q6K_CHUNK blocks
 * of a group at a time (in L1 after the first pair), the tokens passing
 * over them two by two as decode does, their sums kept in memory between
 * chunks. Unpacking a chunk once for all the tokens (q6k_batch) pays only
 * from about 16 tokens. One thread from cache (Zen 4, bench_matmul --hot,
 * llama-1b's ffn_down, GB/s of weights times tokens, medians of 5
 * interleaved): Q6_K 3 tokens 24 -> 50, 4 30 -> 52, 8 38 -> 47 (a pair
 * alone reads 57); Q5_K 22 -> 45, 28 -> 48, 38 -> 42. From 9 tokens the
 * batch kernel is as fast or faster (Q5_K / Q6_K at 9: 50 / 51 against 46
 * / 52 two by two, at 12: 50 / 54 against 44 / 53). */
#ifndef Q6K_PAIRS_MAX
#define Q6K_PAIRS_MAX 8
#endif

/* Blocks [b0, b1) of a group for n (1 or 2) tokens, their sums in acc and summs (Q6_K has none). */
typedef void (*lanes_blocks_fn)(const uint8_t *gb, const block_q8_K *const *y, int64_t b0, int64_t b1, bool prefetch,
                                bool once, __m512 (*acc)[8], __m512 *summs);

/* T tokens from t0 of group grp into acc and summs (zeroed here), by_width[n] running n tokens. */
static void lanes_pairs(const struct quant_kq_gemm *g, int64_t grp, int64_t t0, int T, const lanes_blocks_fn *by_width,
                        __m512 (*acc)[8], __m512 *summs)
{
    const bool once = quant_weights_read_once(g->n_tokens);
    const int64_t nsb = g->cols / QK_K;
    const uint8_t *gb = g->W + (size_t)grp * R * g->wrow;
    const block_q8_K *y[Q6K_PAIRS_MAX];
    quant_kq_tile_tokens(g, t0, T, T, y);
    for (int t = 0; t < T; t++) {
        summs[t] = _mm512_setzero_ps();
        for (int c = 0; c < 8; c++)
            acc[t][c] = _mm512_setzero_ps();
    }
    for (int64_t b0 = 0; b0 < nsb; b0 += Q6K_CHUNK) {
        const int64_t b1 = nsb - b0 < Q6K_CHUNK ? nsb : b0 + Q6K_CHUNK;
        for (int t = 0; t < T; t += LANES_TT)
            by_width[T - t < LANES_TT ? T - t : LANES_TT](gb, y + t, b0, b1, t == 0, once, acc + t, summs + t);
    }
}

/* A width of lanes_pairs: the sums copied into registers around an inlined pass. */
#define LANES_BLOCKS_WIDTH(name, blocks, n)                                                                       \
    static void name(const uint8_t *gb, const block_q8_K *const *y, int64_t b0, int64_t b1, bool prefetch,      \
                     bool once, __m512 (*acc)[8], __m512 *summs)                                                 \
    {                                                                                                            \
        __m512 a[n][8], m[n];                                                                                    \
        memcpy(a, acc, sizeof a);                                                                                \
        memcpy(m, summs, sizeof m);                                                                              \
        blocks(gb, y, b0, b1, n, prefetch, once, a, m);                                                          \
        memcpy(acc, a, sizeof a);                                                                                \
        memcpy(summs, m, sizeof m);                                                                              \
    }

static inline __attribute__((always_inline)) void q6k_blocks_sums(const uint8_t *gb, const block_q8_K *const *y,
                                                                  int64_t b0, int64_t b1, int T, bool prefetch,
                                                                  bool once, __m512 (*acc)[8], __m512 *summs)
{
    (void)summs;
    q6k_blocks(gb, y, b0, b1, T, prefetch, once, acc);
}
/* name##_pass of an eight-lane kernel without mins (Q6_K, IQ4_XS): one group x
 * T (<= LANES_TT) tokens, decode, through blocks (a pass with lanes_blocks_fn's arguments). */
#define LANES_PASS_NO_MINS(name, blocks)                                                                          \
    static inline __attribute__((always_inline)) void name##_pass(const struct quant_kq_gemm *g, int64_t grp,   \
                                                                  int64_t t0, int T)                            \
    {                                                                                                           \
        const block_q8_K *y[LANES_TT];                                                                          \
        quant_kq_tile_tokens(g, t0, T, T, y);                                                                   \
        __m512 acc[LANES_TT][8];                                                                                \
        for (int t = 0; t < T; t++)                                                                             \
            for (int c = 0; c < 8; c++)                                                                         \
                acc[t][c] = _mm512_setzero_ps();                                                                \
        blocks(g->W + (size_t)grp * R * g->wrow, y, 0, g->cols / QK_K, T, true,                                 \
               quant_weights_read_once(g->n_tokens), acc, NULL);                                                \
        for (int t = 0; t < T; t++)                                                                             \
            q6k_store(g, grp, t0 + t, acc[t]);                                                                  \
    }
LANES_PASS_NO_MINS(q6k, q6k_blocks_sums)
LANES_BLOCKS_WIDTH(q6k_blocks_1, q6k_blocks_sums, 1)
LANES_BLOCKS_WIDTH(q6k_blocks_2, q6k_blocks_sums, 2)
static const lanes_blocks_fn q6k_blocks_widths[LANES_TT + 1] = {NULL, q6k_blocks_1, q6k_blocks_2};

/* name##_pairs of an eight-lane kernel without mins (Q6_K, IQ4_XS): lanes_pairs over name##_blocks_widths. */
#define LANES_PAIRS_NO_MINS(name)                                                        \
    static void name##_pairs(const struct quant_kq_gemm *g, int64_t grp, int64_t t0, int T) \
    {                                                                                    \
        __m512 acc[Q6K_PAIRS_MAX][8], unused[Q6K_PAIRS_MAX];                             \
        lanes_pairs(g, grp, t0, T, name##_blocks_widths, acc, unused);                   \
        for (int t = 0; t < T; t++)                                                      \
            q6k_store(g, grp, t0 + t, acc[t]);                                           \
    }
LANES_PAIRS_NO_MINS(q6k)

/* Batches: Q6K_CHUNK blocks of a group unpacked once into L1, and up to
 * Q6K_BATCH tokens passing over them Q6K_BATCH_TT at a time (their lanes
 * kept in memory between chunks): the unpacking, most of a decode pass's
 * work, is shared by the batch, and each unpacked vector loaded from L1
 * serves that many tokens' independent chains (two at a time: 2.85 ns per
 * block-token at 8 tokens, 2.35 at 64; eight: 2.17 and 1.82; Zen 5, 1 thread,
 * medians of 5 interleaved). The same operations per token and block as
 * q6k_pass, in the same order: the same bits. */
#define Q6K_BATCH 16
#ifndef Q6K_BATCH_TT
#define Q6K_BATCH_TT 8
#endif
/* PASS(T) for n tokens, T a constant (1 .. Q6K_BATCH_TT) so each width keeps its chains in registers. */
#if Q6K_BATCH_TT >= 8
#define BATCH_WIDE_CASES(PASS) \
    case 8: PASS(8); break;    \
    case 7: PASS(7); break;    \
    case 6: PASS(6); break;    \
    case 5: PASS(5); break;
#else
#define BATCH_WIDE_CASES(PASS)
#endif
#define BATCH_WIDTHS(n, PASS)       \
    switch (n) {                    \
        BATCH_WIDE_CASES(PASS)      \
    case 4: PASS(4); break;         \
    case 3: PASS(3); break;         \
    case 2: PASS(2); break;         \
    default: PASS(1); break;        \
    }

/* Blocks [0, nbk) of a chunk unpacked at blk (super-blocks b0..) for n (<=
 * Q6K_BATCH_TT) tokens into acc and summs; one block's unpacking into out. */
typedef void (*lanes_chunk_fn)(const void *blk, int nbk, int64_t b0, const block_q8_K *const *y, int n,
                               __m512 (*acc)[8], __m512 *summs);
typedef void (*lanes_unpack_fn)(const uint8_t *gb, void *out);

/* T (<= Q6K_BATCH) tokens from t0 of group grp into acc and summs (zeroed
 * here): Q6K_CHUNK super-blocks (block_bytes per row) at a time unpacked
 * into blk, a block every `unpacked` bytes, and the tokens passing over them
 * Q6K_BATCH_TT at a time. */
static void lanes_batch(const struct quant_kq_gemm *g, int64_t grp, int64_t t0, int T, size_t block_bytes,
                        lanes_unpack_fn unpack, uint8_t *blk, size_t unpacked, lanes_chunk_fn chunk,
                        __m512 (*acc)[8], __m512 *summs)
{
    const bool once = quant_weights_read_once(g->n_tokens);
    const size_t gbb = R * block_bytes;
    const int64_t nsb = g->cols / QK_K;
    for (int t = 0; t < T; t++) {
        summs[t] = _mm512_setzero_ps();
        for (int c = 0; c < 8; c++)
            acc[t][c] = _mm512_setzero_ps();
    }
    for (int64_t b0 = 0; b0 < nsb; b0 += Q6K_CHUNK) {
        const int nbk = (int)(nsb - b0 < Q6K_CHUNK ? nsb - b0 : Q6K_CHUNK);
        const uint8_t *gb = g->W + (size_t)grp * R * g->wrow + (size_t)b0 * gbb;
        for (int i = 0; i < nbk; i++) {
            quant_prefetch_weights(gb + (size_t)i * gbb + KQRP_AHEAD, gbb, once);
            unpack(gb + (size_t)i * gbb, blk + (size_t)i * unpacked);
        }
        for (int t = 0; t < T; t += Q6K_BATCH_TT) {
            const int n = T - t < Q6K_BATCH_TT ? T - t : Q6K_BATCH_TT;
            const block_q8_K *y[Q6K_BATCH_TT];
            quant_kq_tile_tokens(g, t0 + t, n, n, y);
            chunk(blk, nbk, b0, y, n, acc + t, summs + t);
        }
    }
}

static void q6k_unpack(const uint8_t *gb, void *out)
{
    struct q6k_block *o = out;
    for (int h = 0; h < 2; h++)
        for (int c = 0; c < 8; c++)
            q6k_levels(gb, h, c, o->u[h][c]);
    q6k_scales(gb, o->scp, o->off);
    o->d = vmath_load16_f16(gb + KQRP_Q6K_D(R));
}

static inline __attribute__((always_inline)) void q6k_chunk_pass(const struct q6k_block *blk, int nbk, int64_t b0,
                                                                 const block_q8_K *const *y, int T, __m512 (*acc)[8])
{
    for (int i = 0; i < nbk; i++)
        for (int c = 0; c < 8; c++) {
            __m512i lane[Q6K_BATCH_TT];
            q6k_lane(NULL, blk[i].u, blk[i].scp, blk[i].off[c], y, b0 + i, T, c, lane);
            for (int t = 0; t < T; t++)
                acc[t][c] = chain_add(acc[t][c], lane[t], blk[i].d, y[t][b0 + i].d);
        }
}


/* name##_batch of an eight-lane kernel without mins (Q6_K, IQ4_XS): lanes_batch
 * over chunks of struct name##_block, each width of name##_chunk_pass. */
#define LANES_BATCH_NO_MINS(name, block_type)                                                                    \
    static void name##_chunk(const void *blk, int nbk, int64_t b0, const block_q8_K *const *y, int n,            \
                             __m512 (*acc)[8], __m512 *summs)                                                    \
    {                                                                                                            \
        (void)summs;                                                                                             \
        BATCH_WIDTHS(n, name##_CHUNK_PASS)                                                                       \
    }                                                                                                            \
    static void name##_batch(const struct quant_kq_gemm *g, int64_t grp, int64_t t0, int T)                     \
    {                                                                                                            \
        static _Thread_local struct name##_block blk[Q6K_CHUNK];                                                 \
        __m512 acc[Q6K_BATCH][8], unused[Q6K_BATCH];                                                             \
        lanes_batch(g, grp, t0, T, sizeof(block_type), name##_unpack, (uint8_t *)blk, sizeof blk[0], name##_chunk, \
                    acc, unused);                                                                                \
        for (int t = 0; t < T; t++)                                                                              \
            q6k_store(g, grp, t0 + t, acc[t]);                                                                   \
    }
#define q6k_CHUNK_PASS(T) q6k_chunk_pass(blk, nbk, b0, y, T, acc)
LANES_BATCH_NO_MINS(q6k, block_q6_K)

/* ---- Q5_K: ggml's eight lanes, mins on their own --------------------------------
 * Lane c sums, per 32-element sub-block m, sc_m * (u . q8) over elements
 * 32m + 4c.. with u the 5-bit level (vpmaddubsw, pairs at most 2 * 31 *
 * 127, then vpdpwssd with (sc_m, sc_m)); the mins are Q4_K's msum.
 * acc[c] = fma(d * dy, lane, acc[c]), summs = fma(-dy * dmin, msum, summs),
 * hsum_float_8's order plus summs at the end (kq_scalar.c). The group-block
 * holds lane c's levels of sub-block m as dword Um of its five packed
 * dwords (kq_internal.h). */

/* Lane c's level dwords U0..U7 of 16 rows: U0..U4 one mask each, U5..U7
 * their bits gathered by byte shifts and bit selects (vpternlogd). */
static inline void q5k_levels(const uint8_t *gb, int c, __m512i u[8])
{
    const __m512i low5 = _mm512_set1_epi8(0x1f), low3 = _mm512_set1_epi8(0x07), low4 = _mm512_set1_epi8(0x0f);
    __m512i D[5];
    for (int j = 0; j < 5; j++) {
        D[j] = dword_vec(gb, KQRP_Q5K_Q(R, c, 0), j);
        u[j] = _mm512_and_si512(D[j], low5);
    }
    /* bits 0-2 of U5 and U7 from bits 5-7 of D0 and D3, bits 3-4 from bits 5-6 of D1 and D4 */
    u[5] = _mm512_and_si512(_mm512_ternarylogic_epi32(byte_shift(D[1], 2), byte_shift(D[0], 5), low3, SEL_B_OVER_A), low5);
    u[7] = _mm512_and_si512(_mm512_ternarylogic_epi32(byte_shift(D[4], 2), byte_shift(D[3], 5), low3, SEL_B_OVER_A), low5);
    /* U6: bits 0-2 from bits 5-7 of D2, bit 3 from bit 7 of D1, bit 4 from bit 7 of D4 */
    const __m512i u6lo = _mm512_ternarylogic_epi32(byte_shift(D[1], 4), byte_shift(D[2], 5), low3, SEL_B_OVER_A);
    u[6] = _mm512_and_si512(_mm512_ternarylogic_epi32(byte_shift(D[4], 3), u6lo, low4, SEL_B_OVER_A), low5);
}

/* lanes_hsum plus the mins */
static inline __attribute__((always_inline)) void q5k_store(const struct quant_kq_gemm *g, int64_t grp, int64_t t,
                                                            const __m512 v[8], __m512 summs)
{
    _mm512_storeu_ps(g->Y + t * g->ldy + grp * R, _mm512_add_ps(lanes_hsum(v), summs));
}

/* A block's (sc_m, sc_m) pairs, its mins 0-3 / 4-7, d and dmin. */
static inline __attribute__((always_inline)) void q5k_scales(const uint8_t *gb, __m512i scp[8], __m512i *m03,
                                                             __m512i *m47, __m512 *d, __m512 *dmin)
{
    const size_t at_sc = KQRP_Q5K_SC(R);
    __m512i s03, s47;
    unpack_scales_mins(dword_vec(gb, at_sc, 0), dword_vec(gb, at_sc, 1), dword_vec(gb, at_sc, 2), &s03, &s47, m03, m47);
    for (int m = 0; m < 8; m++)
        scp[m] = _mm512_shuffle_epi8(m < 4 ? s03 : s47, pick_pair(m % 4));
    *d = vmath_load16_f16(gb + KQRP_Q5K_D(R));
    *dmin = vmath_load16_f16(gb + KQRP_Q5K_DMIN(R));
}

/* T tokens' mins of super-block b into summs[t]. */
static inline __attribute__((always_inline)) void q5k_mins(__m512i m03, __m512i m47, __m512 dmin,
                                                           const block_q8_K *const *y, int64_t b, int T, __m512 *summs)
{
    for (int t = 0; t < T; t++) {
        __m512i msum = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++)
            msum = _mm512_dpwssd_epi32(msum, _mm512_shuffle_epi8(j < 4 ? m03 : m47, pick_pair(j % 4)),
                                       bcast(y[t][b].bsums + 2 * j));
        summs[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(-y[t][b].d), dmin), _mm512_cvtepi32_ps(msum), summs[t]);
    }
}

/* Lane c of T tokens' super-block b from its levels u, into acc[t][c]. */
static inline __attribute__((always_inline)) void q5k_lane(const __m512i u[8], const __m512i scp[8], __m512 d,
                                                           const block_q8_K *const *y, int64_t b, int T, int c,
                                                           __m512 (*acc)[8])
{
    __m512i lane[Q6K_BATCH_TT];
    for (int t = 0; t < T; t++)
        lane[t] = _mm512_setzero_si512();
    for (int m = 0; m < 8; m++)
        for (int t = 0; t < T; t++)
            lane[t] = _mm512_dpwssd_epi32(lane[t], _mm512_maddubs_epi16(u[m], bcast(y[t][b].qs + 32 * m + 4 * c)),
                                          scp[m]);
    for (int t = 0; t < T; t++)
        acc[t][c] = chain_add(acc[t][c], lane[t], d, y[t][b].d);
}

/* Super-blocks [b0, b1) of a group (gb its first) for T (<= LANES_TT)
 * tokens into acc and summs, unpacking as it goes; the first pass over a
 * stretch of the weights prefetches ahead of it. */
static inline __attribute__((always_inline)) void q5k_blocks(const uint8_t *gb, const block_q8_K *const *y, int64_t b0,
                                                             int64_t b1, int T, bool prefetch, bool once,
                                                             __m512 (*acc)[8], __m512 *summs)
{
    const size_t gbb = R * sizeof(block_q5_K);
    gb += (size_t)b0 * gbb;
    for (int64_t b = b0; b < b1; b++, gb += gbb) {
        __m512i scp[8], m03, m47;
        __m512 d, dmin;
        q5k_scales(gb, scp, &m03, &m47, &d, &dmin);
        q5k_mins(m03, m47, dmin, y, b, T, summs);
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            if (prefetch)
                quant_prefetch_weights_part(gb + KQRP_AHEAD, gbb, once, c, 8);
            __m512i u[8];
            q5k_levels(gb, c, u);
            q5k_lane(u, scp, d, y, b, T, c, acc);
        }
    }
}

/* One group x T (<= LANES_TT) tokens: decode. */
static inline __attribute__((always_inline)) void q5k_pass(const struct quant_kq_gemm *g, int64_t grp, int64_t t0,
                                                           int T)
{
    const block_q8_K *y[LANES_TT];
    quant_kq_tile_tokens(g, t0, T, T, y);
    __m512 acc[LANES_TT][8], summs[LANES_TT];
    for (int t = 0; t < T; t++) {
        summs[t] = _mm512_setzero_ps();
        for (int c = 0; c < 8; c++)
            acc[t][c] = _mm512_setzero_ps();
    }
    q5k_blocks(g->W + (size_t)grp * R * g->wrow, y, 0, g->cols / QK_K, T, true, quant_weights_read_once(g->n_tokens),
               acc, summs);
    for (int t = 0; t < T; t++)
        q5k_store(g, grp, t0 + t, acc[t], summs[t]);
}

/* Batches of a few tokens: lanes_pairs. */
LANES_BLOCKS_WIDTH(q5k_blocks_1, q5k_blocks, 1)
LANES_BLOCKS_WIDTH(q5k_blocks_2, q5k_blocks, 2)
static const lanes_blocks_fn q5k_blocks_widths[LANES_TT + 1] = {NULL, q5k_blocks_1, q5k_blocks_2};

static void q5k_pairs(const struct quant_kq_gemm *g, int64_t grp, int64_t t0, int T)
{
    __m512 acc[Q6K_PAIRS_MAX][8], summs[Q6K_PAIRS_MAX];
    lanes_pairs(g, grp, t0, T, q5k_blocks_widths, acc, summs);
    for (int t = 0; t < T; t++)
        q5k_store(g, grp, t0 + t, acc[t], summs[t]);
}

/* Batches, as Q6_K's (lanes_batch): Q6K_CHUNK blocks of a group unpacked once into L1 and
 * up to Q6K_BATCH tokens passing over them Q6K_BATCH_TT at a time, their
 * lanes and mins kept in memory between chunks; the same operations per
 * token and block as q5k_pass, in the same order: the same bits. */

struct q5k_block {
    __m512i u[8][8];          /* [c][m]: u = nibble | fifth bit << 4 of sub-block m's elements of lane c */
    __m512i scp[8], m03, m47; /* (sc_m, sc_m) pairs; mins 0-3, 4-7 */
    __m512 d, dmin;
};

static void q5k_unpack(const uint8_t *gb, void *out)
{
    struct q5k_block *o = out;
    for (int c = 0; c < 8; c++)
        q5k_levels(gb, c, o->u[c]);
    q5k_scales(gb, o->scp, &o->m03, &o->m47, &o->d, &o->dmin);
}

static inline __attribute__((always_inline)) void q5k_chunk_pass(const struct q5k_block *blk, int nbk, int64_t b0,
                                                                 const block_q8_K *const *y, int T, __m512 (*acc)[8],
                                                                 __m512 *summs)
{
    for (int i = 0; i < nbk; i++) {
        const struct q5k_block *k = &blk[i];
        q5k_mins(k->m03, k->m47, k->dmin, y, b0 + i, T, summs);
        for (int c = 0; c < 8; c++)
            q5k_lane(k->u[c], k->scp, k->d, y, b0 + i, T, c, acc);
    }
}

static void q5k_chunk(const void *blk, int nbk, int64_t b0, const block_q8_K *const *y, int n, __m512 (*acc)[8],
                      __m512 *summs)
{
#define Q5K_PASS(T) q5k_chunk_pass(blk, nbk, b0, y, T, acc, summs)
    BATCH_WIDTHS(n, Q5K_PASS)
#undef Q5K_PASS
}

static void q5k_batch(const struct quant_kq_gemm *g, int64_t grp, int64_t t0, int T)
{
    static _Thread_local struct q5k_block blk[Q6K_CHUNK];
    __m512 acc[Q6K_BATCH][8], summs[Q6K_BATCH];
    lanes_batch(g, grp, t0, T, sizeof(block_q5_K), q5k_unpack, (uint8_t *)blk, sizeof blk[0], q5k_chunk, acc, summs);
    for (int t = 0; t < T; t++)
        q5k_store(g, grp, t0 + t, acc[t], summs[t]);
}

/* ---- IQ4_XS: ggml's eight lanes, a lookup per nibble ------------------------------
 * Lane c sums, per block j of 32, (ls_j - 32) * (w . q8) over the elements
 * 32j + 4c.. (iq4_mxfp4.h): the low nibbles of qs dword 4j + c for c < 4, the
 * high ones of dword 4j + c - 4 above. A nibble vector is looked up as |w|
 * (one byte permute) and its signs (levels 0-7 are the negative ones) taken
 * as a mask that negates the token's quants: one vpmaddubsw (pairs at most 2
 * * 127 * 127) and one vpdpwssd against (ls_j - 32, ls_j - 32) per dword and
 * token, where the row kernel (iq4_mxfp4_avx512.c) unpacked each block for
 * one row and summed across lanes. acc[c] = fma(d * dy, lane, acc[c]), and
 * hsum_float_8's order at the end (q6k_store): ggml's AVX2 vec_dot, bit for
 * bit. */

/* |level| of each index, in each 128-bit lane (for vpermb: in all four, so
 * bits 4-5 of an index do not matter). */
static inline __m512i iq4xs_abs_lut(void)
{
    return _mm512_broadcast_i32x4(_mm_abs_epi8(_mm_loadu_si128((const __m128i *)quant_iq4nl_values)));
}

/* Block j's (ls_j - 32) as both halves of an int16 pair, from the rows'
 * scales_l dword L (bits 4j..4j + 3) and scales_h H (bits 2j, 2j + 1). */
static inline __m512i iq4xs_scale_pair(__m512i L, __m512i H, int j)
{
    const __m512i nib = _mm512_srli_epi32(L, 4 * j);
    const __m512i top = j <= 2 ? _mm512_slli_epi32(H, 4 - 2 * j) : _mm512_srli_epi32(H, 2 * j - 4);
    const __m512i ls = _mm512_and_si512(_mm512_ternarylogic_epi32(top, nib, _mm512_set1_epi32(0x0f), SEL_B_OVER_A),
                                        _mm512_set1_epi32(0x3f));
    return _mm512_sub_epi16(_mm512_shuffle_epi8(ls, pick_pair(0)), _mm512_set1_epi16(32));
}

static inline __attribute__((always_inline)) void iq4xs_scales(const uint8_t *gb, __m512i scp[8], __m512 *d)
{
    const __m512i L = dword_vec(gb, KQRP_IQ4XS_SL(R), 0);
    const __m512i H = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(gb + KQRP_IQ4XS_SH(R))));
    for (int j = 0; j < 8; j++)
        scp[j] = iq4xs_scale_pair(L, H, j);
    *d = vmath_load16_f16(gb + KQRP_IQ4XS_D(R));
}

/* |w| and the signs of qs dword k's low nibbles (a[0], neg[0]) and high ones. */
static inline __attribute__((always_inline)) void iq4xs_levels(const uint8_t *gb, int k, __m512i lut, __m512i a[2],
                                                               __mmask64 neg[2])
{
    const __m512i q = dword_vec(gb, KQRP_IQ4XS_QS(R), k);
#if defined(__AVX512VBMI__)
    a[0] = _mm512_permutexvar_epi8(q, lut);
    a[1] = _mm512_permutexvar_epi8(_mm512_srli_epi16(q, 4), lut);
#else
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    a[0] = _mm512_shuffle_epi8(lut, _mm512_and_si512(q, low4));
    a[1] = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(q, 4), low4));
#endif
    neg[0] = _mm512_testn_epi8_mask(q, _mm512_set1_epi8(0x08));
    neg[1] = _mm512_testn_epi8_mask(q, _mm512_set1_epi8((char)0x80));
}

/* lane + (ls - 32) * (w . q8) per row, w = |w| with the signs neg. */
static inline __m512i iq4xs_dot(__m512i lane, __m512i a, __mmask64 neg, __m512i scp, const int8_t *q8)
{
    const __m512i y = bcast(q8);
    return _mm512_dpwssd_epi32(lane, _mm512_maddubs_epi16(a, _mm512_mask_sub_epi8(y, neg, _mm512_setzero_si512(), y)),
                               scp);
}

/* Super-blocks [b0, b1) of a group (gb its first) for T (<= LANES_TT)
 * tokens into acc, unpacking as it goes; the first pass over a stretch of
 * the weights prefetches ahead of it. Lanes m and m + 4 at a time. */
static inline __attribute__((always_inline)) void iq4xs_blocks(const uint8_t *gb, const block_q8_K *const *y,
                                                               int64_t b0, int64_t b1, int T, bool prefetch, bool once,
                                                               __m512 (*acc)[8], __m512 *summs)
{
    (void)summs;
    const size_t gbb = R * sizeof(block_iq4_xs);
    const __m512i lut = iq4xs_abs_lut();
    gb += (size_t)b0 * gbb;
    for (int64_t b = b0; b < b1; b++, gb += gbb) {
        __m512i scp[8];
        __m512 d;
        iq4xs_scales(gb, scp, &d);
#pragma GCC unroll 4
        for (int m = 0; m < 4; m++) {
            if (prefetch)
                quant_prefetch_weights_part(gb + KQRP_AHEAD, gbb, once, m, 4);
            __m512i lo[LANES_TT], hi[LANES_TT];
            for (int t = 0; t < T; t++)
                lo[t] = hi[t] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                __m512i a[2];
                __mmask64 neg[2];
                iq4xs_levels(gb, 4 * j + m, lut, a, neg);
                for (int t = 0; t < T; t++) {
                    lo[t] = iq4xs_dot(lo[t], a[0], neg[0], scp[j], y[t][b].qs + 32 * j + 4 * m);
                    hi[t] = iq4xs_dot(hi[t], a[1], neg[1], scp[j], y[t][b].qs + 32 * j + 16 + 4 * m);
                }
            }
            for (int t = 0; t < T; t++) {
                acc[t][m] = chain_add(acc[t][m], lo[t], d, y[t][b].d);
                acc[t][m + 4] = chain_add(acc[t][m + 4], hi[t], d, y[t][b].d);
            }
        }
    }
}

LANES_PASS_NO_MINS(iq4xs, iq4xs_blocks)
static void iq4xs_pass_1(const struct quant_kq_gemm *g, int64_t grp, int64_t t0) { iq4xs_pass(g, grp, t0, 1); }
static void iq4xs_pass_2(const struct quant_kq_gemm *g, int64_t grp, int64_t t0) { iq4xs_pass(g, grp, t0, 2); }

/* Batches of a few tokens: lanes_pairs. */
LANES_BLOCKS_WIDTH(iq4xs_blocks_1, iq4xs_blocks, 1)
LANES_BLOCKS_WIDTH(iq4xs_blocks_2, iq4xs_blocks, 2)
static const lanes_blocks_fn iq4xs_blocks_widths[LANES_TT + 1] = {NULL, iq4xs_blocks_1, iq4xs_blocks_2};

LANES_PAIRS_NO_MINS(iq4xs)

/* Batches and prefill (IQ4_XS has no tiles), as Q6_K's (lanes_batch): Q6K_CHUNK blocks
 * of a group unpacked once into L1 and up to Q6K_BATCH tokens passing over
 * them Q6K_BATCH_TT at a time; the same operations per token and block as
 * iq4xs_pass, in the same order: the same bits. */

struct iq4xs_block {
    __m512i a[QK_K / 8][2];     /* |w| of qs dword k's low and high nibbles, 16 rows */
    __mmask64 neg[QK_K / 8][2]; /* and their signs */
    __m512i scp[8];
    __m512 d;
};

static void iq4xs_unpack(const uint8_t *gb, void *out)
{
    struct iq4xs_block *o = out;
    const __m512i lut = iq4xs_abs_lut();
    for (int k = 0; k < QK_K / 8; k++)
        iq4xs_levels(gb, k, lut, o->a[k], o->neg[k]);
    iq4xs_scales(gb, o->scp, &o->d);
}

static inline __attribute__((always_inline)) void iq4xs_chunk_pass(const struct iq4xs_block *blk, int nbk, int64_t b0,
                                                                   const block_q8_K *const *y, int T, __m512 (*acc)[8])
{
    for (int i = 0; i < nbk; i++) {
        const struct iq4xs_block *k = &blk[i];
        const int64_t b = b0 + i;
        for (int m = 0; m < 4; m++) {
            __m512i lo[Q6K_BATCH_TT], hi[Q6K_BATCH_TT];
            for (int t = 0; t < T; t++)
                lo[t] = hi[t] = _mm512_setzero_si512();
            for (int j = 0; j < 8; j++) {
                const int q = 4 * j + m;
                for (int t = 0; t < T; t++) {
                    lo[t] = iq4xs_dot(lo[t], k->a[q][0], k->neg[q][0], k->scp[j], y[t][b].qs + 32 * j + 4 * m);
                    hi[t] = iq4xs_dot(hi[t], k->a[q][1], k->neg[q][1], k->scp[j], y[t][b].qs + 32 * j + 16 + 4 * m);
                }
            }
            for (int t = 0; t < T; t++) {
                acc[t][m] = chain_add(acc[t][m], lo[t], k->d, y[t][b].d);
                acc[t][m + 4] = chain_add(acc[t][m + 4], hi[t], k->d, y[t][b].d);
            }
        }
    }
}


#define iq4xs_CHUNK_PASS(T) iq4xs_chunk_pass(blk, nbk, b0, y, T, acc)
LANES_BATCH_NO_MINS(iq4xs, block_iq4_xs)

/* ---- Q3_K: ggml's eight lanes per row ----------------------------------------------
 * Lane c sums sc_{e / 16} * q * q8 over the elements e = 32m + 4c + i (m < 8,
 * i < 4), q = field + 4h - 4 (kq_scalar.c). Element group 32m + 4c takes its
 * 2-bit field from bits 2(m % 4) of qs dword 8(m / 4) + c and its h from bit
 * m of hmask dword c. Each group is one vpmaddubsw of u = field + 4h
 * (unsigned, at most 7: pairs at most 2 * 7 * 127) and one vpdpwssd against
 * its sub-block's (sc, sc); the offset, -4 sc times the group's sum of Q8_K
 * quants S(m, c), is one vpdpwssd per two groups of (-sc_2m+c/4, -sc_2m+2+c/4)
 * against the token's (4 S(m, c), 4 S(m + 1, c)). Then Q6_K's float steps. */

/* The 16 rows' scales unbiased (kq_unpack_scales_q3 in the lanes): byte k of
 * a[j] is scale 4j + k; then (sc_g, sc_g) of each sub-block g, and the offset
 * pairs -(sc_g, sc_g+2) for g = 4p + q, p < 4, q < 2, at off[2p + q]. */
static inline __attribute__((always_inline)) void q3k_scales(const uint8_t *gb, __m512i scp[16], __m512i off[8])
{
    const __m512i w0 = dword_vec(gb, KQRP_Q3K_SC(R), 0), w1 = dword_vec(gb, KQRP_Q3K_SC(R), 1),
                  w2 = dword_vec(gb, KQRP_Q3K_SC(R), 2);
    const __m512i low4 = _mm512_set1_epi8(0x0f), top2 = _mm512_set1_epi8(0x30), bias = _mm512_set1_epi8(32);
    const __m512i lo[4] = {w0, w1, _mm512_srli_epi32(w0, 4), _mm512_srli_epi32(w1, 4)};
    const __m512i hi[4] = {_mm512_slli_epi32(w2, 4), _mm512_slli_epi32(w2, 2), w2, _mm512_srli_epi32(w2, 2)};
    __m512i a[4];
    for (int j = 0; j < 4; j++)
        a[j] = _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(lo[j], low4), _mm512_and_si512(hi[j], top2)), bias);
#pragma GCC unroll 16
    for (int g = 0; g < 16; g++)
        scp[g] = _mm512_srai_epi16(_mm512_shuffle_epi8(a[g / 4], pick_high_pair(g % 4, g % 4)), 8);
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)
        off[i] = _mm512_sub_epi16(_mm512_setzero_si512(),
                                  _mm512_srai_epi16(_mm512_shuffle_epi8(a[i / 2], pick_high_pair(i % 2, i % 2 + 2)), 8));
}

/* A token's (4 S(2p, c), 4 S(2p + 1, c)) as dword 8p + c of sums. */
static inline void q3k_token_sums(const block_q8_K *y, int32_t sums[32])
{
    const __m512i fours = _mm512_set1_epi8(4);
    const __m256i order = _mm256_setr_epi16(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    for (int p = 0; p < 4; p++) {
        const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), fours, _mm512_loadu_si512(y->qs + 64 * p));
        _mm256_storeu_si256((__m256i *)(void *)(sums + 8 * p), _mm256_permutexvar_epi16(order, _mm512_cvtepi32_epi16(s)));
    }
}

/* One group x T (<= LANES_TT) tokens. */
static inline __attribute__((always_inline)) void q3k_pass(const struct quant_kq_gemm *g, int64_t grp, int64_t t0,
                                                           int T)
{
    const bool once = quant_weights_read_once(g->n_tokens);
    const size_t gbb = R * sizeof(block_q3_K);
    const block_q8_K *y[LANES_TT];
    quant_kq_tile_tokens(g, t0, T, T, y);
    __m512 acc[LANES_TT][8];
    for (int t = 0; t < T; t++)
        for (int c = 0; c < 8; c++)
            acc[t][c] = _mm512_setzero_ps();
    const __m512i low2 = _mm512_set1_epi8(0x03), four = _mm512_set1_epi8(4);
    const uint8_t *gb = g->W + (size_t)grp * R * g->wrow;
    for (int64_t b = 0; b < g->cols / QK_K; b++, gb += gbb) {
        __m512i scp[16], off[8];
        q3k_scales(gb, scp, off);
        const __m512 d = vmath_load16_f16(gb + KQRP_Q3K_D(R));
        _Alignas(64) int32_t sums[LANES_TT][32];
        for (int t = 0; t < T; t++)
            q3k_token_sums(&y[t][b], sums[t]);
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            quant_prefetch_weights_part(gb + KQRP_AHEAD, gbb, once, c, 8);
            __m512i lane[LANES_TT];
            for (int t = 0; t < T; t++) {
                lane[t] = _mm512_setzero_si512();
                for (int p = 0; p < 4; p++)
                    lane[t] = _mm512_dpwssd_epi32(lane[t], off[2 * p + c / 4], _mm512_set1_epi32(sums[t][8 * p + c]));
            }
            const __m512i hm = dword_vec(gb, KQRP_Q3K_HM(R), c);
            for (int h = 0; h < 2; h++) {
                const __m512i qs = dword_vec(gb, KQRP_Q3K_QS(R), 8 * h + c);
                for (int f = 0; f < 4; f++) {
                    const int m = 4 * h + f;
                    const __m512i field = _mm512_and_si512(f ? byte_shift(qs, 2 * f) : qs, low2);
                    const __mmask64 high = _mm512_test_epi8_mask(hm, _mm512_set1_epi8((char)(1 << m)));
                    const __m512i u = _mm512_mask_add_epi8(field, high, field, four);
                    for (int t = 0; t < T; t++)
                        lane[t] = _mm512_dpwssd_epi32(lane[t], _mm512_maddubs_epi16(u, bcast(y[t][b].qs + 32 * m + 4 * c)),
                                                      scp[2 * m + c / 4]);
                }
            }
            for (int t = 0; t < T; t++)
                acc[t][c] = chain_add(acc[t][c], lane[t], d, y[t][b].d);
        }
    }
    for (int t = 0; t < T; t++)
        q6k_store(g, grp, t0 + t, acc[t]);
}

static void q3k_pass_1(const struct quant_kq_gemm *g, int64_t grp, int64_t t0) { q3k_pass(g, grp, t0, 1); }
static void q3k_pass_2(const struct quant_kq_gemm *g, int64_t grp, int64_t t0) { q3k_pass(g, grp, t0, 2); }

/* Q3_K: tokens two at a time (its batches past kqrp_group_max run the tiles). */
static void q3k_rows(const struct quant_kq_gemm *g, int64_t g0, int64_t g1)
{
    for (int64_t grp = g0; grp < g1; grp++)
        for (int64_t t = 0; t < g->n_tokens; t += LANES_TT)
            (g->n_tokens - t == 1 ? q3k_pass_1 : q3k_pass_2)(g, grp, t);
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
KQRP_WIDTHS(q2k_pass)
static void q6k_pass_1(const struct quant_kq_gemm *g, int64_t grp, int64_t t0) { q6k_pass(g, grp, t0, 1); }
static void q6k_pass_2(const struct quant_kq_gemm *g, int64_t grp, int64_t t0) { q6k_pass(g, grp, t0, 2); }

/* Q4_K and Q2_K: a block of tokens stays in L2 while the groups pass over it. */
static void chains_rows(const struct quant_kq_gemm *g, const kqrp_pass_fn *passes, int64_t g0, int64_t g1)
{
    for (int64_t t0 = 0; t0 < g->n_tokens; t0 += KQRP_TOKEN_BLOCK) {
        const int64_t t1 = g->n_tokens - t0 < KQRP_TOKEN_BLOCK ? g->n_tokens : t0 + KQRP_TOKEN_BLOCK;
        for (int64_t grp = g0; grp < g1; grp++)
            for (int64_t t = t0; t < t1; t += KQRP_TT)
                passes[t1 - t < KQRP_TT ? t1 - t : KQRP_TT](g, grp, t);
    }
}

static void q5k_pass_1(const struct quant_kq_gemm *g, int64_t grp, int64_t t0) { q5k_pass(g, grp, t0, 1); }
static void q5k_pass_2(const struct quant_kq_gemm *g, int64_t grp, int64_t t0) { q5k_pass(g, grp, t0, 2); }

/* The eight-lane kernels of one type (Q5_K, Q6_K) by the tokens of a pass. */
typedef void (*lanes_batch_fn)(const struct quant_kq_gemm *g, int64_t grp, int64_t t0, int T);
struct lanes_kernels {
    kqrp_pass_fn pass[LANES_TT + 1]; /* decode: 1 or 2 tokens */
    lanes_batch_fn pairs;            /* 3 .. Q6K_PAIRS_MAX tokens */
    lanes_batch_fn batch;            /* more, up to Q6K_BATCH */
};
static const struct lanes_kernels q6k_kernels = {{NULL, q6k_pass_1, q6k_pass_2}, q6k_pairs, q6k_batch};
static const struct lanes_kernels q5k_kernels = {{NULL, q5k_pass_1, q5k_pass_2}, q5k_pairs, q5k_batch};
static const struct lanes_kernels iq4xs_kernels = {{NULL, iq4xs_pass_1, iq4xs_pass_2}, iq4xs_pairs, iq4xs_batch};

/* Token blocks of Q6K_BATCH, each group passed by the kernel for its size. */
static void lanes_rows(const struct quant_kq_gemm *g, const struct lanes_kernels *k, int64_t g0, int64_t g1)
{
    for (int64_t t0 = 0; t0 < g->n_tokens; t0 += Q6K_BATCH) {
        const int T = (int)(g->n_tokens - t0 < Q6K_BATCH ? g->n_tokens - t0 : Q6K_BATCH);
        for (int64_t grp = g0; grp < g1; grp++) {
            if (T > Q6K_PAIRS_MAX)
                k->batch(g, grp, t0, T);
            else if (T > LANES_TT)
                k->pairs(g, grp, t0, T);
            else
                k->pass[T](g, grp, t0);
        }
    }
}

void quant_kqrp_rows_avx512(const struct quant_kq_gemm *g, int64_t g0, int64_t g1)
{
    switch (g->wtype) {
    case QUANT_Q2_K: chains_rows(g, q2k_pass_widths, g0, g1); return;
    case QUANT_Q3_K: q3k_rows(g, g0, g1); return;
    case QUANT_Q4_K: chains_rows(g, q4k_pass_widths, g0, g1); return;
    case QUANT_Q5_K: lanes_rows(g, &q5k_kernels, g0, g1); return;
    case QUANT_Q6_K: lanes_rows(g, &q6k_kernels, g0, g1); return;
    case QUANT_IQ4_XS: lanes_rows(g, &iq4xs_kernels, g0, g1); return;
    default: quant_kqrp_rows_ref(g, R, g0, g1); return;
    }
}
#endif
