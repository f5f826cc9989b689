/* k-quants: the group kernels of repacked Q2_K to Q6_K for AVX2, 8
 * rows in the lanes of a ymm (the layout is in kq_internal.h, the scalar
 * twin in kq_repack.c; kq_repack_avx512.c says how a pass works).
 *
 * Without VNNI, a weight dword (unsigned) times a broadcast Q8_K dword is
 * vpmaddubsw (two int16 pair sums per row) and the scale multiply is
 * vpmaddwd against (scale, scale) int16 pairs, which also adds the pair:
 * exact as long as no int16 sum passes 32767, which the ranges noted at
 * each kernel keep. The float steps are the scalar reference's, row by row
 * in the lanes (explicit fmas, no contraction in this file). */
#include "quant/iq4_mxfp4.h"
#include "quant/kq_internal.h"

#if defined(KQRP_HAVE_AVX2)
#include <immintrin.h>

#include "vmath/vmath_simd.h"

#define KQRP_TT 2 /* tokens per pass over a group: 16 ymm registers hold 2 tokens' sums */
#ifndef KQRP_AHEAD
#define KQRP_AHEAD 4096 /* software prefetch distance in the weight stream */
#endif
#define R 8

static inline __m256i bcast(const void *p) { return _mm256_set1_epi32(kq_dword(p)); }
static inline __m256i dword_vec(const uint8_t *gb, size_t at, int k)
{
    return _mm256_loadu_si256((const __m256i *)(gb + at + 32 * (size_t)k));
}

/* One chain step of kq_chains_add in the lanes: fma(sums, x_scale * y_d, acc) per row. */
static inline __m256 chain_add(__m256 acc, __m256i sums, __m256 x_scale, float y_d)
{
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(x_scale, _mm256_set1_ps(y_d)), acc);
}

/* An eight-lane kernel's row sums in hsum_float_8's order, row by row, and their store for token t. */
static inline __m256 lanes_hsum(const __m256 acc[8])
{
    return _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6])),
                         _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7])));
}

static inline void lanes_store(const struct quant_kq_gemm *g, int64_t grp, int64_t t, const __m256 acc[8])
{
    _mm256_storeu_ps(g->Y + t * g->ldy + grp * R, lanes_hsum(acc));
}

/* kq_unpack_scales_k4 in the lanes (Q4_K's and Q5_K's 6-bit packing): from a
 * row's three scale dwords, bytes 0-3 of s03 / s47 / m03 / m47 are its scales
 * 0-3, 4-7 and mins 0-3, 4-7. */
static inline void unpack_scales_mins(__m256i w0, __m256i w1, __m256i w2, __m256i *s03, __m256i *s47, __m256i *m03, __m256i *m47)
{
    const __m256i low4 = _mm256_set1_epi8(0x0f), low6 = _mm256_set1_epi8(0x3f), top2 = _mm256_set1_epi8(0x30);
    *s03 = _mm256_and_si256(w0, low6);
    *m03 = _mm256_and_si256(w1, low6);
    *s47 = _mm256_or_si256(_mm256_and_si256(w2, low4), _mm256_and_si256(_mm256_srli_epi32(w0, 2), top2));
    *m47 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(w2, 4), low4), _mm256_and_si256(_mm256_srli_epi32(w1, 2), top2));
}

/* vpshufb pattern: bytes a and b of each row's dword zero-extended to an int16 pair. */
static inline __m256i pick_two(int a, int b)
{
    const __m128i at = _mm_add_epi32(_mm_set1_epi32((int)(0x80008000u | (unsigned)a | (unsigned)b << 16)),
                                     _mm_setr_epi32(0, 0x00040004, 0x00080008, 0x000c000c));
    return _mm256_broadcastsi128_si256(at);
}

/* vpshufb pattern: byte k of each row's dword as both halves of an int16 pair. */
static inline __m256i pick_pair(int k) { return pick_two(k, k); }

/* A Q8_K block's sums of its 32-element sub-blocks j = 0..7 as int16 (|sum| <=
 * 32 * 128) in sums[0..7]: a min multiplies a whole sub-block, so two mins per
 * vpmaddwd instead of one. */
static inline void q8k_sub_block_sums(const block_q8_K *y, int16_t sums[16])
{
    const __m256i pairs = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(const void *)y->bsums), _mm256_set1_epi16(1));
    /* packs works in 128-bit halves: sums 0-3 | 0-3 | 4-7 | 4-7 */
    const __m256i packed = _mm256_packs_epi32(pairs, pairs);
    _mm256_store_si256((__m256i *)(void *)sums, _mm256_permute4x64_epi64(packed, 0xd8));
}

/* ---- Q4_K (kq_repack_avx512.c's order) ---------------------------------------
 * With AVX-VNNI a sub-block's products add up in int32 (vpdpbusd) and its
 * scale multiplies the sums (vpmulld); without it, vpmaddubsw pairs add up in
 * int16 (8 dwords a lane: 16 products of a nibble and a Q8_K quant, at most
 * 16 * 15 * 127 = 30480) and vpmaddwd multiplies them by (scale, scale)
 * pairs. Both are the exact integer sums, so the float steps see the same
 * values. (Two groups a pass, each broadcast feeding 16 rows, ran 40% faster
 * from cache but a third slower from memory: two streams a thread.) */
#if defined(__AVXVNNI__)
static inline __m256i q4k_dot(__m256i acc, __m256i u, __m256i x) { return _mm256_dpbusd_avx_epi32(acc, u, x); }
/* byte k of each row's dword zero-extended to the row's int32 */
static inline __m256i q4k_scale_pick(__m256i scales, int k)
{
    const __m128i at = _mm_add_epi32(_mm_set1_epi32((int)(0x80808000u | (unsigned)k)), _mm_setr_epi32(0, 4, 8, 12));
    return _mm256_shuffle_epi8(scales, _mm256_broadcastsi128_si256(at));
}
static inline __m256i q4k_scaled(__m256i sums, __m256i scale) { return _mm256_mullo_epi32(sums, scale); }
#else
static inline __m256i q4k_dot(__m256i acc, __m256i u, __m256i x) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, x)); }
static inline __m256i q4k_scale_pick(__m256i scales, int k) { return _mm256_shuffle_epi8(scales, pick_pair(k)); }
static inline __m256i q4k_scaled(__m256i sums, __m256i scale) { return _mm256_madd_epi16(sums, scale); }
#endif

static inline __attribute__((always_inline)) void q4k_pass(const struct quant_kq_gemm *g, int64_t grp, int64_t t0,
                                                           int T)
{
    const bool once = quant_weights_read_once(g->n_tokens);
    const size_t gbb = R * sizeof(block_q4_K);
    const int64_t nsb = g->cols / QK_K;
    const block_q8_K *y[KQRP_TT];
    quant_kq_tile_tokens(g, t0, T, T, y);
    __m256 acc[KQRP_TT], accm[KQRP_TT];
    for (int t = 0; t < T; t++)
        acc[t] = accm[t] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const uint8_t *gb = g->W + (size_t)grp * R * g->wrow;
    for (int64_t b = 0; b < nsb; b++, gb += gbb) {
        const size_t at_sc = KQRP_Q4K_SC(R);
        const __m256i w0 = dword_vec(gb, at_sc, 0), w1 = dword_vec(gb, at_sc, 1), w2 = dword_vec(gb, at_sc, 2);
        __m256i s03, s47, m03, m47;
        unpack_scales_mins(w0, w1, w2, &s03, &s47, &m03, &m47);
        const __m256 d = vmath_load8_f16(gb + KQRP_Q4K_D(R)), dmin = vmath_load8_f16(gb + KQRP_Q4K_DMIN(R));
        __m256i msum[KQRP_TT];
        _Alignas(32) int16_t bs32[KQRP_TT][16];
        for (int t = 0; t < T; t++)
            q8k_sub_block_sums(&y[t][b], bs32[t]);
        for (int k = 0; k < 4; k++) {
            const __m256i mm = _mm256_shuffle_epi8(k < 2 ? m03 : m47, pick_two(2 * k % 4, 2 * k % 4 + 1));
            for (int t = 0; t < T; t++) {
                const __m256i m = _mm256_madd_epi16(mm, bcast(bs32[t] + 2 * k));
                msum[t] = k == 0 ? m : _mm256_add_epi32(msum[t], m);
            }
        }
        for (int t = 0; t < T; t++)
            accm[t] = chain_add(accm[t], msum[t], dmin, y[t][b].d);
        __m256i isum[KQRP_TT];
        for (int t = 0; t < T; t++)
            isum[t] = _mm256_setzero_si256();
#pragma GCC unroll 4 /* rolled, it spilled: 30.4 GB/s one thread from cache, unrolled 34.5 (Zen 4) */
        for (int p = 0; p < 4; p++) {
            quant_prefetch_weights_part(gb + KQRP_AHEAD, gbb, once, p, 4);
            __m256i dlo[KQRP_TT], dhi[KQRP_TT];
            for (int t = 0; t < T; t++)
                dlo[t] = dhi[t] = _mm256_setzero_si256();
            for (int i = 0; i < 8; i++) {
                const __m256i raw = dword_vec(gb, KQRP_Q4K_QS(R), 8 * p + i);
                const __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                for (int t = 0; t < T; t++) {
                    dlo[t] = q4k_dot(dlo[t], lo, bcast(y[t][b].qs + 64 * p + 4 * i));
                    dhi[t] = q4k_dot(dhi[t], hi, bcast(y[t][b].qs + 64 * p + 32 + 4 * i));
                }
            }
            const __m256i scales = p < 2 ? s03 : s47;
            const __m256i sa = q4k_scale_pick(scales, 2 * p % 4), sb = q4k_scale_pick(scales, (2 * p + 1) % 4);
            for (int t = 0; t < T; t++)
                isum[t] = _mm256_add_epi32(isum[t], _mm256_add_epi32(q4k_scaled(dlo[t], sa), q4k_scaled(dhi[t], sb)));
        }
        for (int t = 0; t < T; t++)
            acc[t] = chain_add(acc[t], isum[t], d, y[t][b].d);
    }
    for (int t = 0; t < T; t++)
        _mm256_storeu_ps(g->Y + (t0 + t) * g->ldy + grp * R, _mm256_sub_ps(acc[t], accm[t]));
}

/* ---- Q2_K (kq_repack_avx512.c's order) ---------------------------------------
 * Q4_K's dot and scale steps with each 2-bit field shifted down to 0..3: a
 * sub-block's 16 products add up to at most 16 * 3 * 127 in an int16 lane. */
static inline __attribute__((always_inline)) void q2k_pass(const struct quant_kq_gemm *g, int64_t grp, int64_t t0,
                                                           int T)
{
    const bool once = quant_weights_read_once(g->n_tokens);
    const size_t gbb = R * sizeof(block_q2_K);
    const int64_t nsb = g->cols / QK_K;
    const block_q8_K *y[KQRP_TT];
    quant_kq_tile_tokens(g, t0, T, T, y);
    __m256 acc[KQRP_TT], accm[KQRP_TT];
    for (int t = 0; t < T; t++)
        acc[t] = accm[t] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0f), low2 = _mm256_set1_epi8(0x03);
    const uint8_t *gb = g->W + (size_t)grp * R * g->wrow;
    for (int64_t b = 0; b < nsb; b++, gb += gbb) {
        const __m256 d = vmath_load8_f16(gb + KQRP_Q2K_D(R)), dmin = vmath_load8_f16(gb + KQRP_Q2K_DMIN(R));
        __m256i msum[KQRP_TT], isum[KQRP_TT];
        for (int t = 0; t < T; t++)
            msum[t] = isum[t] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) { /* byte k of scale dword j: sub-block 4j + k's scale | min << 4 */
            const __m256i mn = _mm256_and_si256(_mm256_srli_epi32(dword_vec(gb, KQRP_Q2K_SC(R), j), 4), low4);
            for (int k = 0; k < 4; k += 2) {
                const __m256i mm = _mm256_shuffle_epi8(mn, pick_two(k, k + 1));
                for (int t = 0; t < T; t++)
                    msum[t] = _mm256_add_epi32(msum[t], _mm256_madd_epi16(mm, bcast(y[t][b].bsums + 4 * j + k)));
            }
        }
        for (int t = 0; t < T; t++)
            accm[t] = chain_add(accm[t], msum[t], dmin, y[t][b].d);
#pragma GCC unroll 4 /* 18.8 -> 22.0 GB/s one thread from cache (Zen 4) */
        for (int part = 0; part < 4; part++) { /* half h, dwords 4ih .. 4ih + 3 */
            const int h = part / 2, ih = part % 2;
            quant_prefetch_weights_part(gb + KQRP_AHEAD, gbb, once, part, 4);
            __m256i raw[4];
            for (int ii = 0; ii < 4; ii++)
                raw[ii] = dword_vec(gb, KQRP_Q2K_QS(R), 8 * h + 4 * ih + ii);
            for (int s = 0; s < 4; s++) {
                __m256i dot[KQRP_TT];
                for (int t = 0; t < T; t++)
                    dot[t] = _mm256_setzero_si256();
                for (int ii = 0; ii < 4; ii++) {
                    const __m256i q = _mm256_and_si256(_mm256_srli_epi16(raw[ii], 2 * s), low2);
                    for (int t = 0; t < T; t++)
                        dot[t] = q4k_dot(dot[t], q, bcast(y[t][b].qs + 128 * h + 32 * s + 16 * ih + 4 * ii));
                }
                const __m256i sc = _mm256_and_si256(dword_vec(gb, KQRP_Q2K_SC(R), 2 * h + s / 2), low4);
                const __m256i scale = q4k_scale_pick(sc, 2 * (s % 2) + ih);
                for (int t = 0; t < T; t++)
                    isum[t] = _mm256_add_epi32(isum[t], q4k_scaled(dot[t], scale));
            }
        }
        for (int t = 0; t < T; t++)
            acc[t] = chain_add(acc[t], isum[t], d, y[t][b].d);
    }
    for (int t = 0; t < T; t++)
        _mm256_storeu_ps(g->Y + (t0 + t) * g->ldy + grp * R, _mm256_sub_ps(acc[t], accm[t]));
}

/* ---- Q6_K: ggml's eight lanes per row (kq_repack_avx512.c's order) --------------
 * The groups of 8 are AVX2's layout (kq_internal.h): three dwords give four
 * W(c, q, k) in 11 vector ops, where ggml's ql and qh took 17. A vpmaddubsw
 * of W(c, q, k) against the token's quants in its order gives int16 pairs of
 * u = q + 32 times Q8_K quants (each at most 2 * 63 * 128 = 16128), the k = 0
 * and k = 1 ones add up in int16 (at most 32256), and one vpmaddwd against
 * (sc_s, sc_s+8) puts both sub-blocks in lane c, which ends less (32 sc_2c,
 * 32 sc_2c+1) . (bsums 2c, 2c+1). */

/* vpshufb pattern: bytes a and b of each row's dword as the high bytes of an int16 pair. */
static inline __m256i pick_high_pair(int a, int b)
{
    const __m128i at = _mm_add_epi32(_mm_set1_epi32((int)(0x00800080u | (unsigned)a << 8 | (unsigned)b << 24)),
                                     _mm_setr_epi32(0, 0x04000400, 0x08000800, 0x0c000c00));
    return _mm256_broadcastsi128_si256(at);
}

/* Where sub-block s's scale lies in a row's 16 scale bytes. */
static inline int q6k_scale_at(bool joined, int s) { return joined ? kqrp_q6k_scale_at(s) : s; }

/* The 8 rows' scales of sub-blocks s1 and s2 (in one scale dword) as an
 * int16 pair, sign-extended and times 2^(8 - shift). */
static inline __m256i q6k_scale_pair(const uint8_t *gb, bool joined, int s1, int s2, int shift)
{
    const int at1 = q6k_scale_at(joined, s1), at2 = q6k_scale_at(joined, s2);
    const size_t sc = joined ? KQRP_Q6K_JSC(R) : KQRP_Q6K_SC(R);
    return _mm256_srai_epi16(_mm256_shuffle_epi8(dword_vec(gb, sc, at1 / 4), pick_high_pair(at1 % 4, at2 % 4)),
                             shift);
}

/* (32 sc_2c, 32 sc_2c+1) of the 8 rows: (sc << 8) >> 3. */
static inline __m256i q6k_offset_pair(const uint8_t *gb, bool joined, int c)
{
    return q6k_scale_pair(gb, joined, 2 * c, 2 * c + 1, 3);
}

/* The four levels of a unit of three packed Q6_K dwords at `at` (kq_internal.h):
 * W(c, q, k) in a joined group of 8, element groups 128h + 32q + 4c in others. */
static inline void q6k_levels(const uint8_t *gb, size_t at, __m256i u[4])
{
    const __m256i low6 = _mm256_set1_epi8(0x3f);
    const __m256i a = dword_vec(gb, at, 0), b = dword_vec(gb, at, 1), d = dword_vec(gb, at, 2);
    u[0] = _mm256_and_si256(a, low6);
    u[1] = _mm256_and_si256(b, low6);
    u[2] = _mm256_and_si256(d, low6);
    /* each byte's top two bits alone, so the 16-bit shifts carry no bits across bytes */
    const __m256i ta = _mm256_andnot_si256(low6, a), tb = _mm256_andnot_si256(low6, b), td = _mm256_andnot_si256(low6, d);
    u[3] = _mm256_or_si256(_mm256_or_si256(_mm256_srli_epi16(ta, 6), _mm256_srli_epi16(tb, 4)), _mm256_srli_epi16(td, 2));
}

/* A Q8_K block's quants in W's order: dword n = 16q + 2c + k holds the
 * int16s n and 64 + n of qs. vpunpck interleaves within 128-bit halves, so
 * dword n lies at q8k_across_at(n). */
static inline void q8k_across_halves(const block_q8_K *y, uint8_t out[QK_K])
{
    for (int i = 0; i < 4; i++) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)(y->qs + 32 * i)),
                      b = _mm256_loadu_si256((const __m256i *)(const void *)(y->qs + QK_K / 2 + 32 * i));
        _mm256_store_si256((__m256i *)(void *)(out + 64 * i), _mm256_unpacklo_epi16(a, b));
        _mm256_store_si256((__m256i *)(void *)(out + 64 * i + 32), _mm256_unpackhi_epi16(a, b));
    }
}

static inline int q8k_across_at(int n) { return (n & ~12) | (n & 4) << 1 | (n & 8) >> 1; }

/* One group x one token: the lanes' int32 chains are plain adds here (vpmaddwd
 * then vpaddd), so a lane is summed whole before the next one starts. Lanes
 * 0-3 read the even sub-blocks' scales and lanes 4-7 the odd ones'. */
static void q6k_pass(const struct quant_kq_gemm *g, int64_t grp, int64_t t0)
{
    const bool once = quant_weights_read_once(g->n_tokens);
    const size_t gbb = R * sizeof(block_q6_K);
    const block_q8_K *y = (const block_q8_K *)(g->X + (g->xi ? g->xi[t0] : t0) * g->xrow);
    __m256 acc[8];
    for (int c = 0; c < 8; c++)
        acc[c] = _mm256_setzero_ps();
    const uint8_t *gb = g->W + (size_t)grp * R * g->wrow;
    /* Block b + 1's quants are reordered while block b runs: reordered
     * just before its use, the compiler took the broadcasts out of the stored
     * registers (~100 shuffles a block) and it was slower. */
    _Alignas(32) uint8_t yqs[2][QK_K];
    const int64_t nb = g->cols / QK_K;
    if (nb > 0)
        q8k_across_halves(&y[0], yqs[0]);
    for (int64_t b = 0; b < nb; b++, gb += gbb) {
        if (b + 1 < nb)
            q8k_across_halves(&y[b + 1], yqs[(b + 1) % 2]);
        const uint8_t *yq = yqs[b % 2];
        const __m256 dd = _mm256_mul_ps(_mm256_set1_ps(y[b].d), vmath_load8_f16(gb + KQRP_Q6K_D(R)));
#pragma GCC unroll 2
        for (int odd = 0; odd < 2; odd++) {
            __m256i sp[4]; /* (sc_s, sc_s+8), s = 2q + odd */
            for (int q = 0; q < 4; q++)
                sp[q] = q6k_scale_pair(gb, true, 2 * q + odd, 2 * q + odd + 8, 8);
#pragma GCC unroll 4
            for (int c = 4 * odd; c < 4 * odd + 4; c++) {
                quant_prefetch_weights_part(gb + KQRP_AHEAD, gbb, once, c, 8);
                __m256i u0[4], u1[4], lane = _mm256_setzero_si256();
                q6k_levels(gb, KQRP_Q6K_JQ(R, c, 0, 0), u0);
                q6k_levels(gb, KQRP_Q6K_JQ(R, c, 1, 0), u1);
                for (int q = 0; q < 4; q++) {
                    const int n = 16 * q + 2 * c;
                    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(u0[q], bcast(yq + 4 * q8k_across_at(n))),
                                                       _mm256_maddubs_epi16(u1[q], bcast(yq + 4 * q8k_across_at(n + 1))));
                    lane = _mm256_add_epi32(lane, _mm256_madd_epi16(p, sp[q]));
                }
                lane = _mm256_sub_epi32(lane, _mm256_madd_epi16(q6k_offset_pair(gb, true, c), bcast(y[b].bsums + 2 * c)));
                acc[c] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(lane), acc[c]);
            }
        }
    }
    lanes_store(g, grp, t0, acc);
}

/* ---- Q3_K (kq_repack_avx512.c's order) ---------------------------------------------
 * u = field + 4h of element group 32m + 4c in 5 vector ops (the 2-bit field
 * shifted down and masked, the h bit masked and moved to bit 2, joined); the
 * vpmaddwd against (sc, sc) adds each pair straight into the lane. */

/* Byte k of a[j]: scale 4j + k of each of 8 rows, unbiased, from the rows' three scale dwords. */
static inline void q3k_unpack_scales(__m256i w0, __m256i w1, __m256i w2, __m256i a[4])
{
    const __m256i low4 = _mm256_set1_epi8(0x0f), top2 = _mm256_set1_epi8(0x30), bias = _mm256_set1_epi8(32);
    const __m256i lo[4] = {w0, w1, _mm256_srli_epi32(w0, 4), _mm256_srli_epi32(w1, 4)};
    const __m256i hi[4] = {_mm256_slli_epi32(w2, 4), _mm256_slli_epi32(w2, 2), w2, _mm256_srli_epi32(w2, 2)};
    for (int j = 0; j < 4; j++)
        a[j] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(lo[j], low4), _mm256_and_si256(hi[j], top2)), bias);
}

/* (sc_g, sc_g) of each sub-block g, sign-extended, from q3k_unpack_scales' a. */
static inline __m256i q3k_scale_pair(const __m256i a[4], int g)
{
    return _mm256_srai_epi16(_mm256_shuffle_epi8(a[g / 4], pick_high_pair(g % 4, g % 4)), 8);
}

/* The 8 rows' (sc_g, sc_g) pairs and the offset pairs -(sc_g, sc_g+2), g = 4p + q, at off[2p + q]. */
static inline void q3k_scales(const uint8_t *gb, __m256i scp[16], __m256i off[8])
{
    __m256i a[4];
    q3k_unpack_scales(dword_vec(gb, KQRP_Q3K_SC(R), 0), dword_vec(gb, KQRP_Q3K_SC(R), 1), dword_vec(gb, KQRP_Q3K_SC(R), 2), a);
    for (int g = 0; g < 16; g++)
        scp[g] = q3k_scale_pair(a, g);
    for (int i = 0; i < 8; i++)
        off[i] = _mm256_sub_epi16(_mm256_setzero_si256(),
                                  _mm256_srai_epi16(_mm256_shuffle_epi8(a[i / 2], pick_high_pair(i % 2, i % 2 + 2)), 8));
}

/* A token's (4 S(2p, c), 4 S(2p + 1, c)) as dword 8p + c of sums: vpmaddubsw
 * by 4 gives each dword's two pair sums, vphaddw the dword sums of groups
 * 2p (low) and 2p + 1 (high) per 128-bit half, and a vpshufb interleaves them. */
static inline void q3k_token_sums(const block_q8_K *y, int32_t sums[32])
{
    const __m256i fours = _mm256_set1_epi8(4);
    const __m256i order = _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15));
    for (int p = 0; p < 4; p++) {
        const __m256i lo = _mm256_maddubs_epi16(fours, _mm256_loadu_si256((const __m256i *)(const void *)(y->qs + 64 * p)));
        const __m256i hi = _mm256_maddubs_epi16(fours, _mm256_loadu_si256((const __m256i *)(const void *)(y->qs + 64 * p + 32)));
        _mm256_store_si256((__m256i *)(void *)(sums + 8 * p), _mm256_shuffle_epi8(_mm256_hadd_epi16(lo, hi), order));
    }
}

/* u = field + 4h of the 8 rows' element group 32m + 4c (m = 4h + f) from qs dword 8h + c and hmask dword c. */
static inline __m256i q3k_level(__m256i qs, __m256i hm, int m)
{
    const __m256i low2 = _mm256_set1_epi8(0x03);
    const int f = m % 4;
    const __m256i field = _mm256_and_si256(f ? _mm256_srli_epi16(qs, 2 * f) : qs, low2);
    __m256i h = _mm256_and_si256(hm, _mm256_set1_epi8((char)(1 << m)));
    h = m < 2 ? _mm256_slli_epi16(h, 2 - m) : m > 2 ? _mm256_srli_epi16(h, m - 2) : h;
    return _mm256_or_si256(field, h);
}

static void q3k_pass(const struct quant_kq_gemm *g, int64_t grp, int64_t t0)
{
    const bool once = quant_weights_read_once(g->n_tokens);
    const size_t gbb = R * sizeof(block_q3_K);
    const block_q8_K *y = (const block_q8_K *)(g->X + (g->xi ? g->xi[t0] : t0) * g->xrow);
    __m256 acc[8];
    for (int c = 0; c < 8; c++)
        acc[c] = _mm256_setzero_ps();
    const uint8_t *gb = g->W + (size_t)grp * R * g->wrow;
    for (int64_t b = 0; b < g->cols / QK_K; b++, gb += gbb) {
        __m256i scp[16], off[8];
        q3k_scales(gb, scp, off);
        _Alignas(32) int32_t sums[32];
        q3k_token_sums(&y[b], sums);
        const __m256 dd = _mm256_mul_ps(_mm256_set1_ps(y[b].d), vmath_load8_f16(gb + KQRP_Q3K_D(R)));
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            quant_prefetch_weights_part(gb + KQRP_AHEAD, gbb, once, c, 8);
            __m256i lane = _mm256_setzero_si256();
            for (int p = 0; p < 4; p++)
                lane = _mm256_add_epi32(lane, _mm256_madd_epi16(off[2 * p + c / 4], _mm256_set1_epi32(sums[8 * p + c])));
            const __m256i hm = dword_vec(gb, KQRP_Q3K_HM(R), c);
            for (int h = 0; h < 2; h++) {
                const __m256i qs = dword_vec(gb, KQRP_Q3K_QS(R), 8 * h + c);
                for (int f = 0; f < 4; f++) {
                    const int m = 4 * h + f;
                    const __m256i p = _mm256_maddubs_epi16(q3k_level(qs, hm, m), bcast(y[b].qs + 32 * m + 4 * c));
                    lane = _mm256_add_epi32(lane, _mm256_madd_epi16(p, scp[2 * m + c / 4]));
                }
            }
            acc[c] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(lane), acc[c]);
        }
    }
    lanes_store(g, grp, t0, acc);
}

/* ---- Q5_K (kq_repack_avx512.c's order), levels paired ----------------------------
 * In groups of 8, level dword Un (n = 2k + h) of lane c holds elements
 * 4c + 2h, 4c + 2h + 1 of sub-blocks 2k and 2k + 1 (kq_internal.h). Against
 * the token's quants in that order (q5k_token_pairs), a vpmaddubsw gives
 * per row the two sub-blocks' partial sums in its int16 halves (each at most
 * 2 * 31 * 127); U2k + U2k+1 add up to the whole sums S (at most 4 * 31 *
 * 127, no overflow), and one vpmaddwd against (sc_2k, sc_2k+1) adds sc * S
 * of both to the lane: the exact integer lane, with half the vpmaddwd and
 * adds of one per dword. */

/* Lane c's level dwords U0..U7 of 8 rows (the unpacking of kq_internal.h's five dwords). */
static inline void q5k_levels(const uint8_t *gb, int c, __m256i u[8])
{
    const __m256i low5 = _mm256_set1_epi8(0x1f), low3 = _mm256_set1_epi8(0x07), bits34 = _mm256_set1_epi8(0x18);
    __m256i D[5];
    for (int j = 0; j < 5; j++) {
        D[j] = dword_vec(gb, KQRP_Q5K_Q(R, c, 0), j);
        u[j] = _mm256_and_si256(D[j], low5);
    }
    /* a right shift by s of the int16 brings the high byte's bits into the low byte's top s bits only, which the masks drop */
    u[5] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(D[0], 5), low3), _mm256_and_si256(_mm256_srli_epi16(D[1], 2), bits34));
    u[7] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(D[3], 5), low3), _mm256_and_si256(_mm256_srli_epi16(D[4], 2), bits34));
    u[6] = _mm256_or_si256(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(D[2], 5), low3),
                                           _mm256_and_si256(_mm256_srli_epi16(D[1], 4), _mm256_set1_epi8(0x08))),
                           _mm256_and_si256(_mm256_srli_epi16(D[4], 3), _mm256_set1_epi8(0x10)));
}

/* A token's Q8_K quants in the paired order: at 64k, word w of sub-blocks 2k
 * and 2k + 1 side by side (vpunpck*wd per 128-bit half). */
static inline void q5k_token_pairs(const block_q8_K *y, int8_t xq[QK_K])
{
    for (int k = 0; k < 4; k++) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)(y->qs + 64 * k)),
                      b = _mm256_loadu_si256((const __m256i *)(const void *)(y->qs + 64 * k + 32));
        _mm256_store_si256((__m256i *)(void *)(xq + 64 * k), _mm256_unpacklo_epi16(a, b));
        _mm256_store_si256((__m256i *)(void *)(xq + 64 * k + 32), _mm256_unpackhi_epi16(a, b));
    }
}

/* Where q5k_token_pairs put the quants that meet level dword U2k+h of lane c. */
static inline int q5k_pair_at(int c, int k, int h)
{
    const int r = 2 * (c % 4) + h; /* word 2c + h of its 128-bit half c / 4 */
    return 64 * k + (r < 4 ? 0 : 32) + 16 * (c / 4) + 4 * (r % 4);
}

/* The 8 rows' scales (m < 8) and mins (m >= 8) of a Q5_K / Q4_K group-block as (v, v) int16 pairs. */
static inline void k4_scale_pairs(const uint8_t *gb, size_t at_sc, __m256i pairs[16])
{
    const __m256i w0 = dword_vec(gb, at_sc, 0), w1 = dword_vec(gb, at_sc, 1), w2 = dword_vec(gb, at_sc, 2);
    __m256i s03, s47, m03, m47;
    unpack_scales_mins(w0, w1, w2, &s03, &s47, &m03, &m47);
    for (int j = 0; j < 8; j++) {
        pairs[j] = _mm256_shuffle_epi8(j < 4 ? s03 : s47, pick_pair(j % 4));
        pairs[8 + j] = _mm256_shuffle_epi8(j < 4 ? m03 : m47, pick_pair(j % 4));
    }
}

static void q5k_pass(const struct quant_kq_gemm *g, int64_t grp, int64_t t0)
{
    const bool once = quant_weights_read_once(g->n_tokens);
    const size_t gbb = R * sizeof(block_q5_K);
    const block_q8_K *y = (const block_q8_K *)(g->X + (g->xi ? g->xi[t0] : t0) * g->xrow);
    __m256 acc[8], summs = _mm256_setzero_ps();
    for (int c = 0; c < 8; c++)
        acc[c] = _mm256_setzero_ps();
    const uint8_t *gb = g->W + (size_t)grp * R * g->wrow;
    /* the token's quants paired a block ahead: broadcasts right after the
     * stores that wrote them waited for the stores (12% of the pass) */
    const int64_t nsb = g->cols / QK_K;
    _Alignas(32) int8_t xq[2][QK_K];
    q5k_token_pairs(&y[0], xq[0]);
    for (int64_t b = 0; b < nsb; b++, gb += gbb) {
        const size_t at_sc = KQRP_Q5K_SC(R);
        __m256i s03, s47, m03, m47, sp[4];
        unpack_scales_mins(dword_vec(gb, at_sc, 0), dword_vec(gb, at_sc, 1), dword_vec(gb, at_sc, 2), &s03, &s47, &m03, &m47);
        _Alignas(32) int16_t bs32[16];
        q8k_sub_block_sums(&y[b], bs32);
        __m256i msum = _mm256_setzero_si256();
        for (int k = 0; k < 4; k++) {
            sp[k] = _mm256_shuffle_epi8(k < 2 ? s03 : s47, pick_two(2 * k % 4, 2 * k % 4 + 1));
            const __m256i mm = _mm256_shuffle_epi8(k < 2 ? m03 : m47, pick_two(2 * k % 4, 2 * k % 4 + 1));
            msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mm, bcast(bs32 + 2 * k)));
        }
        const __m256 d = vmath_load8_f16(gb + KQRP_Q5K_D(R)), dmin = vmath_load8_f16(gb + KQRP_Q5K_DMIN(R));
        summs = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(-y[b].d), dmin), _mm256_cvtepi32_ps(msum), summs);
        const __m256 dd = _mm256_mul_ps(_mm256_set1_ps(y[b].d), d);
        if (b + 1 < nsb)
            q5k_token_pairs(&y[b + 1], xq[(b + 1) % 2]);
        const int8_t *x = xq[b % 2];
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            quant_prefetch_weights_part(gb + KQRP_AHEAD, gbb, once, c, 8);
            __m256i u[8], lane = _mm256_setzero_si256();
            q5k_levels(gb, c, u);
            for (int k = 0; k < 4; k++) {
                const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(u[2 * k], bcast(x + q5k_pair_at(c, k, 0))),
                                                   _mm256_maddubs_epi16(u[2 * k + 1], bcast(x + q5k_pair_at(c, k, 1))));
                lane = _mm256_add_epi32(lane, _mm256_madd_epi16(s, sp[k]));
            }
            acc[c] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(lane), acc[c]);
        }
    }
    _mm256_storeu_ps(g->Y + t0 * g->ldy + grp * R, _mm256_add_ps(lanes_hsum(acc), summs));
}

/* ---- prefill panels straight from the layout ------------------------------------ */

/* vpshufb pattern: byte k of each row's dword zero-extended to int32. */
static inline __m256i pick_byte(int k)
{
    const __m128i at = _mm_add_epi32(_mm_set1_epi32((int)(0x80808000u | (unsigned)k)), _mm_setr_epi32(0, 4, 8, 12));
    return _mm256_broadcastsi128_si256(at);
}

static inline void store_lanes(uint8_t *pb, size_t at, __m256i v) { _mm256_storeu_si256((__m256i *)(pb + at), v); }

/* Rows r .. r + 8 of a Q4_K group (r % 8 == 0, group of Rg rows) into lanes
 * lane0 .. lane0 + 8 of a panel: what quant_kq_unpack_lane stores, 8 rows
 * per instruction. */
static void q4k_unpack8(const uint8_t *W, int Rg, int64_t cols, int64_t r, uint8_t *panel, int lane0)
{
    const size_t wrow = quant_row_size(QUANT_Q4_K, cols), gbb = (size_t)Rg * sizeof(block_q4_K);
    const int l0 = (int)(r % Rg);
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const uint8_t *gb = W + (size_t)(r / Rg) * (size_t)Rg * wrow;
    for (int64_t b = 0; b < cols / QK_K; b++, gb += gbb) {
        uint8_t *pb = panel + b * KQ_PB_BYTES;
        const size_t at_sc = 4 * (size_t)Rg + 4 * (size_t)l0, at_qs = at_sc + 3 * 4 * (size_t)Rg, lanes = 4 * (size_t)lane0;
        for (int c = 0; c < QK_K / 8; c++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(gb + at_qs + 4 * (size_t)Rg * c));
            const int k = 16 * (c / 8) + c % 8; /* the panel's dword of the low nibbles; the high ones 8 later */
            store_lanes(pb, KQ_PB_Q + 64 * (size_t)k + lanes, _mm256_and_si256(raw, low4));
            store_lanes(pb, KQ_PB_Q + 64 * (size_t)(k + 8) + lanes, _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4));
        }
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(gb + at_sc)),
                      w1 = _mm256_loadu_si256((const __m256i *)(gb + at_sc + 4 * (size_t)Rg)),
                      w2 = _mm256_loadu_si256((const __m256i *)(gb + at_sc + 8 * (size_t)Rg));
        __m256i s03, s47, m03, m47;
        unpack_scales_mins(w0, w1, w2, &s03, &s47, &m03, &m47);
        for (int j = 0; j < 8; j++) {
            store_lanes(pb, KQ_PB_SC + 64 * (size_t)j + lanes, _mm256_shuffle_epi8(j < 4 ? s03 : s47, pick_byte(j % 4)));
            store_lanes(pb, KQ_PB_SC + 64 * (size_t)(j + 8) + lanes, _mm256_setzero_si256());
            store_lanes(pb, KQ_PB_PAIRS + 64 * (size_t)j + lanes, _mm256_shuffle_epi8(j < 4 ? m03 : m47, pick_pair(j % 4)));
        }
        _mm256_storeu_ps((float *)(void *)(pb + KQ_PB_D + lanes), vmath_load8_f16(gb + 2 * (size_t)l0));
        _mm256_storeu_ps((float *)(void *)(pb + KQ_PB_DMIN + lanes), vmath_load8_f16(gb + 2 * (size_t)(Rg + l0)));
    }
}

/* The same for Q2_K: panel dword 32h + 8s + i is field s of qs dword 8h + i. */
static void q2k_unpack8(const uint8_t *W, int Rg, int64_t cols, int64_t r, uint8_t *panel, int lane0)
{
    const size_t wrow = quant_row_size(QUANT_Q2_K, cols), gbb = (size_t)Rg * sizeof(block_q2_K);
    const size_t row = 4 * (size_t)(r % Rg), lanes = 4 * (size_t)lane0;
    const __m256i low4 = _mm256_set1_epi8(0x0f), low2 = _mm256_set1_epi8(0x03);
    const uint8_t *gb = W + (size_t)(r / Rg) * (size_t)Rg * wrow;
    for (int64_t b = 0; b < cols / QK_K; b++, gb += gbb) {
        uint8_t *pb = panel + b * KQ_PB_BYTES;
        for (int k = 0; k < QK_K / 16; k++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(gb + KQRP_Q2K_QS(Rg) + 4 * (size_t)Rg * k + row));
            for (int s = 0; s < 4; s++)
                store_lanes(pb, KQ_PB_Q + 64 * (size_t)(32 * (k / 8) + 8 * s + k % 8) + lanes,
                            _mm256_and_si256(_mm256_srli_epi16(raw, 2 * s), low2));
        }
        for (int j = 0; j < 4; j++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(gb + KQRP_Q2K_SC(Rg) + 4 * (size_t)Rg * j + row));
            const __m256i sc = _mm256_and_si256(w, low4), mn = _mm256_and_si256(_mm256_srli_epi32(w, 4), low4);
            for (int k = 0; k < 4; k++)
                store_lanes(pb, KQ_PB_SC + 64 * (size_t)(4 * j + k) + lanes, _mm256_shuffle_epi8(sc, pick_byte(k)));
            for (int k = 0; k < 4; k += 2)
                store_lanes(pb, KQ_PB_PAIRS + 64 * (size_t)(2 * j + k / 2) + lanes, _mm256_shuffle_epi8(mn, pick_two(k, k + 1)));
        }
        _mm256_storeu_ps((float *)(void *)(pb + KQ_PB_D + lanes), vmath_load8_f16(gb + KQRP_Q2K_D(Rg) + row / 2));
        _mm256_storeu_ps((float *)(void *)(pb + KQ_PB_DMIN + lanes), vmath_load8_f16(gb + KQRP_Q2K_DMIN(Rg) + row / 2));
    }
}

/* The same for Q6_K into the lane-order panel (KQ_PL_*): pair j = 2 x int16
 * sc * u of elements 2j, 2j + 1; pair i of the bsums weights (32 sc_2i,
 * 32 sc_2i+1); d; dmin 0. */
static void q6k_unpack8(const uint8_t *W, int Rg, int64_t cols, int64_t r, uint8_t *panel, int lane0)
{
    const size_t wrow = quant_row_size(QUANT_Q6_K, cols), gbb = (size_t)Rg * sizeof(block_q6_K);
    const size_t lanes = 4 * (size_t)lane0, at = 4 * (size_t)(r % Rg); /* the 8 rows' offset in the group's dwords */
    const __m128i lo_pair = _mm_setr_epi32(0x80018000, 0x80058004, 0x80098008, 0x800d800c);
    const __m256i first = _mm256_broadcastsi128_si256(lo_pair),
                  second = _mm256_broadcastsi128_si256(_mm_add_epi32(lo_pair, _mm_set1_epi32(0x00020002)));
    const uint8_t *gb = W + (size_t)(r / Rg) * (size_t)Rg * wrow;
    const bool joined = kqrp_q6k_joined(QUANT_Q6_K, Rg); /* then the 8 rows are the whole group */
    uint8_t g8[8 * sizeof(block_q6_K)]; /* other groups' 8 rows as a group of 8, dword slots kept */
    for (int64_t b = 0; b < cols / QK_K; b++, gb += gbb) {
        uint8_t *pb = panel + b * KQ_PB_BYTES;
        const uint8_t *src = gb;
        if (!joined) {
            for (int k = 0; k < 52; k++)
                memcpy(g8 + 32 * k, gb + 4 * (size_t)Rg * k + at, 32);
            memcpy(g8 + KQRP_Q6K_D(R), gb + 52 * 4 * (size_t)Rg + at / 2, 16);
            src = g8;
        }
        __m256i scp[16];
        for (int s = 0; s < 16; s++)
            scp[s] = q6k_scale_pair(src, joined, s, s, 8);
        for (int c = 0; c < 8; c++)
            for (int k = 0; k < 2; k++) {
                __m256i u[4]; /* joined: W(c, q, k), elements of pairs j and 64 + j; else half k's
                                 element groups 128k + 32q + 4c, pairs j and j + 1 */
                q6k_levels(src, joined ? KQRP_Q6K_JQ(R, c, k, 0) : KQRP_Q6K_UNIT(R, k, c), u);
                for (int q = 0; q < 4; q++) {
                    const int s = 8 * (joined ? 0 : k) + 2 * q + c / 4;
                    const size_t j = joined ? 16 * (size_t)q + 2 * (size_t)c + (size_t)k
                                            : 64 * (size_t)k + 16 * (size_t)q + 2 * (size_t)c;
                    const size_t j2 = joined ? j + 64 : j + 1;
                    store_lanes(pb, KQ_PL_W + 64 * j + lanes, _mm256_mullo_epi16(_mm256_shuffle_epi8(u[q], first), scp[s]));
                    store_lanes(pb, KQ_PL_W + 64 * j2 + lanes,
                                _mm256_mullo_epi16(_mm256_shuffle_epi8(u[q], second), scp[joined ? s + 8 : s]));
                }
            }
        for (int i = 0; i < 8; i++)
            store_lanes(pb, KQ_PL_PAIRS + 64 * (size_t)i + lanes, q6k_offset_pair(src, joined, i));
        _mm256_storeu_ps((float *)(void *)(pb + KQ_PL_D + lanes), vmath_load8_f16(src + KQRP_Q6K_D(R)));
        _mm256_storeu_ps((float *)(void *)(pb + KQ_PL_DMIN + lanes), _mm256_setzero_ps());
    }
}

/* Q3_K into the lane-order panel: pair j = 2 x int16 sc * q of elements 2j,
 * 2j + 1 (q = u - 4); pair i of the bsums weights (4 sc_2i, 4 sc_2i+1); d; dmin 0. */
static void q3k_unpack8(const uint8_t *W, int Rg, int64_t cols, int64_t r, uint8_t *panel, int lane0)
{
    const size_t wrow = quant_row_size(QUANT_Q3_K, cols), gbb = (size_t)Rg * sizeof(block_q3_K);
    const size_t lanes = 4 * (size_t)lane0, at = 4 * (size_t)(r % Rg);
    const __m128i lo_pair = _mm_setr_epi32(0x80018000, 0x80058004, 0x80098008, 0x800d800c);
    const __m256i first = _mm256_broadcastsi128_si256(lo_pair),
                  second = _mm256_broadcastsi128_si256(_mm_add_epi32(lo_pair, _mm_set1_epi32(0x00020002))),
                  four = _mm256_set1_epi16(4);
    const uint8_t *gb = W + (size_t)(r / Rg) * (size_t)Rg * wrow;
    for (int64_t b = 0; b < cols / QK_K; b++, gb += gbb) {
        uint8_t *pb = panel + b * KQ_PB_BYTES;
#define Q3K_DWORDS(k) _mm256_loadu_si256((const __m256i *)(const void *)(gb + 4 * (size_t)Rg * (k) + at))
        __m256i a[4];
        q3k_unpack_scales(Q3K_DWORDS(24), Q3K_DWORDS(25), Q3K_DWORDS(26), a);
        for (int c = 0; c < 8; c++) {
            const __m256i hm = Q3K_DWORDS(c);
            for (int h = 0; h < 2; h++) {
                const __m256i qs = Q3K_DWORDS(8 + 8 * h + c);
                for (int f = 0; f < 4; f++) {
                    const int m = 4 * h + f;
                    const __m256i u = q3k_level(qs, hm, m), sc = q3k_scale_pair(a, 2 * m + c / 4);
                    const size_t j = 16 * (size_t)m + 2 * (size_t)c;
                    store_lanes(pb, KQ_PL_W + 64 * j + lanes,
                                _mm256_mullo_epi16(_mm256_sub_epi16(_mm256_shuffle_epi8(u, first), four), sc));
                    store_lanes(pb, KQ_PL_W + 64 * (j + 1) + lanes,
                                _mm256_mullo_epi16(_mm256_sub_epi16(_mm256_shuffle_epi8(u, second), four), sc));
                }
            }
        }
#undef Q3K_DWORDS
        for (int i = 0; i < 8; i++)
            store_lanes(pb, KQ_PL_PAIRS + 64 * (size_t)i + lanes,
                        _mm256_slli_epi16(_mm256_srai_epi16(_mm256_shuffle_epi8(a[i / 2], pick_high_pair(2 * i % 4, 2 * i % 4 + 1)), 8), 2));
        _mm256_storeu_ps((float *)(void *)(pb + KQ_PL_D + lanes), vmath_load8_f16(gb + KQRP_Q3K_D(Rg) + at / 2));
        _mm256_storeu_ps((float *)(void *)(pb + KQ_PL_DMIN + lanes), _mm256_setzero_ps());
    }
}

/* Q5_K into the lane-order panel: pair j = 2 x int16 sc * u of elements 2j,
 * 2j + 1; pair i of the bsums weights (m_i, m_i); d; dmin. */
static void q5k_unpack8(const uint8_t *W, int Rg, int64_t cols, int64_t r, uint8_t *panel, int lane0)
{
    const size_t wrow = quant_row_size(QUANT_Q5_K, cols), gbb = (size_t)Rg * sizeof(block_q5_K);
    const size_t lanes = 4 * (size_t)lane0, at = 4 * (size_t)(r % Rg);
    const __m128i lo_pair = _mm_setr_epi32(0x80018000, 0x80058004, 0x80098008, 0x800d800c);
    const __m256i first = _mm256_broadcastsi128_si256(lo_pair),
                  second = _mm256_broadcastsi128_si256(_mm_add_epi32(lo_pair, _mm_set1_epi32(0x00020002)));
    const uint8_t *gb = W + (size_t)(r / Rg) * (size_t)Rg * wrow;
    uint8_t g8[8 * sizeof(block_q5_K)]; /* the 8 rows as a group of 8 */
    for (int64_t b = 0; b < cols / QK_K; b++, gb += gbb) {
        uint8_t *pb = panel + b * KQ_PB_BYTES;
        memcpy(g8 + KQRP_Q5K_D(R), gb + at / 2, 16);
        memcpy(g8 + KQRP_Q5K_DMIN(R), gb + 2 * (size_t)Rg + at / 2, 16);
        for (int k = 0; k < 43; k++)
            memcpy(g8 + KQRP_Q5K_SC(R) + 32 * k, gb + 4 * (size_t)Rg + 4 * (size_t)Rg * k + at, 32);
        __m256i pairs[16];
        k4_scale_pairs(g8, KQRP_Q5K_SC(R), pairs);
        for (int c = 0; c < 8; c++) {
            __m256i u[8];
            q5k_levels(g8, c, u);
            for (int n = 0; n < 8; n++) { /* bytes 0-1 and 2-3 of Un: elements 2j, 2j + 1 of sub-blocks m0, m1 */
                const int m0 = kqrp_q5k_elem(Rg, c, n, 0) / 32, m1 = kqrp_q5k_elem(Rg, c, n, 2) / 32;
                const size_t j0 = (size_t)kqrp_q5k_elem(Rg, c, n, 0) / 2, j1 = (size_t)kqrp_q5k_elem(Rg, c, n, 2) / 2;
                store_lanes(pb, KQ_PL_W + 64 * j0 + lanes, _mm256_mullo_epi16(_mm256_shuffle_epi8(u[n], first), pairs[m0]));
                store_lanes(pb, KQ_PL_W + 64 * j1 + lanes, _mm256_mullo_epi16(_mm256_shuffle_epi8(u[n], second), pairs[m1]));
            }
        }
        for (int i = 0; i < 8; i++)
            store_lanes(pb, KQ_PL_PAIRS + 64 * (size_t)i + lanes, pairs[8 + i]);
        _mm256_storeu_ps((float *)(void *)(pb + KQ_PL_D + lanes), vmath_load8_f16(g8 + KQRP_Q5K_D(R)));
        _mm256_storeu_ps((float *)(void *)(pb + KQ_PL_DMIN + lanes), vmath_load8_f16(g8 + KQRP_Q5K_DMIN(R)));
    }
}

bool quant_kqrp_unpack8_avx2(enum quant_type t, const uint8_t *W, int Rg, int64_t cols, int64_t r, uint8_t *panel,
                             int lane0)
{
    if (t == QUANT_Q5_K)
        q5k_unpack8(W, Rg, cols, r, panel, lane0);
    else if (t == QUANT_Q4_K)
        q4k_unpack8(W, Rg, cols, r, panel, lane0);
    else if (t == QUANT_Q6_K)
        q6k_unpack8(W, Rg, cols, r, panel, lane0);
    else if (t == QUANT_Q2_K)
        q2k_unpack8(W, Rg, cols, r, panel, lane0);
    else if (t == QUANT_Q3_K)
        q3k_unpack8(W, Rg, cols, r, panel, lane0);
    else
        return false;
    return true;
}

/* ---- IQ4_XS (kq_repack_avx512.c's eight lanes) ---------------------------------------
 * A nibble vector is looked up as signed levels w (vpshufb) and |w|; the
 * token's quants take w's signs (vpsignb: no level is 0), one vpmaddubsw
 * (pairs at most 2 * 127 * 127) and one vpmaddwd against (ls_j - 32, ls_j -
 * 32) per dword and token. Block j's dwords 4j + m feed lanes m and m + 4,
 * so a super-block's eight lanes stay in registers. */

/* Block j's (ls_j - 32) as both halves of an int16 pair, from the rows'
 * scales_l dword L (bits 4j..4j + 3) and scales_h H (bits 2j, 2j + 1). */
static inline __m256i iq4xs_scale_pair(__m256i L, __m256i H, int j)
{
    const __m256i nib = _mm256_and_si256(_mm256_srli_epi32(L, 4 * j), _mm256_set1_epi32(0x0f));
    const __m256i top = _mm256_and_si256(j <= 2 ? _mm256_slli_epi32(H, 4 - 2 * j) : _mm256_srli_epi32(H, 2 * j - 4),
                                         _mm256_set1_epi32(0x30));
    return _mm256_sub_epi16(_mm256_shuffle_epi8(_mm256_or_si256(nib, top), pick_pair(0)), _mm256_set1_epi16(32));
}

static inline void iq4xs_scales(const uint8_t *gb, __m256i scp[8])
{
    const __m256i L = dword_vec(gb, KQRP_IQ4XS_SL(R), 0);
    const __m256i H = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(gb + KQRP_IQ4XS_SH(R))));
    for (int j = 0; j < 8; j++)
        scp[j] = iq4xs_scale_pair(L, H, j);
}

/* Levels w and |w| of qs dword k's low nibbles ([0]) and high ones ([1]). */
static inline void iq4xs_levels(const uint8_t *gb, int k, __m256i lut, __m256i w[2], __m256i a[2])
{
    const __m256i q = dword_vec(gb, KQRP_IQ4XS_QS(R), k), low4 = _mm256_set1_epi8(0x0f);
    w[0] = _mm256_shuffle_epi8(lut, _mm256_and_si256(q, low4));
    w[1] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(q, 4), low4));
    a[0] = _mm256_abs_epi8(w[0]);
    a[1] = _mm256_abs_epi8(w[1]);
}

static inline __m256i iq4xs_dot(__m256i lane, __m256i a, __m256i w, __m256i scp, const int8_t *q8)
{
    return _mm256_add_epi32(lane, _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(bcast(q8), w)), scp));
}

static inline __m256i iq4xs_lut(void)
{
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)quant_iq4nl_values));
}

/* One group x one token: decode. */
static void iq4xs_pass(const struct quant_kq_gemm *g, int64_t grp, int64_t t0)
{
    const bool once = quant_weights_read_once(g->n_tokens);
    const size_t gbb = R * sizeof(block_iq4_xs);
    const block_q8_K *y = (const block_q8_K *)(g->X + (g->xi ? g->xi[t0] : t0) * g->xrow);
    const __m256i lut = iq4xs_lut();
    __m256 acc[8];
    for (int c = 0; c < 8; c++)
        acc[c] = _mm256_setzero_ps();
    const uint8_t *gb = g->W + (size_t)grp * R * g->wrow;
    for (int64_t b = 0; b < g->cols / QK_K; b++, gb += gbb) {
        __m256i scp[8], lane[8];
        iq4xs_scales(gb, scp);
        for (int c = 0; c < 8; c++)
            lane[c] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            quant_prefetch_weights_part(gb + KQRP_AHEAD, gbb, once, j, 8);
#pragma GCC unroll 4
            for (int m = 0; m < 4; m++) {
                __m256i w[2], a[2];
                iq4xs_levels(gb, 4 * j + m, lut, w, a);
                lane[m] = iq4xs_dot(lane[m], a[0], w[0], scp[j], y[b].qs + 32 * j + 4 * m);
                lane[m + 4] = iq4xs_dot(lane[m + 4], a[1], w[1], scp[j], y[b].qs + 32 * j + 16 + 4 * m);
            }
        }
        const __m256 d = vmath_load8_f16(gb + KQRP_IQ4XS_D(R));
        for (int c = 0; c < 8; c++)
            acc[c] = chain_add(acc[c], lane[c], d, y[b].d);
    }
    lanes_store(g, grp, t0, acc);
}

/* Batches and prefill (IQ4_XS has no tiles): IQ4XS_CHUNK blocks of a group
 * looked up once into L1 and up to IQ4XS_BATCH tokens passing over them
 * IQ4XS_TT at a time, their lanes kept in memory between chunks; the same
 * operations per token and block as iq4xs_pass, in the same order. One or
 * two tokens run iq4xs_pass each (the second finds the group in cache): one
 * thread from cache, llama-1b's ffn_down, GB/s x tokens, 2 tokens 21.4
 * that way against 17.6 through a chunk, 16 tokens 28.8 through chunks.
 * Products of level x scale in int16 (vpmaddwd against the token's quants
 * widened, no vpsignb) were slower: 20.8 at 16, the loads bound them. */
#define IQ4XS_CHUNK 4
#define IQ4XS_BATCH 16
#ifndef IQ4XS_TT
#define IQ4XS_TT 4 /* tokens per pass over a chunk (2 and 3 were no faster at 3-16 tokens) */
#endif
#ifndef IQ4XS_PASS_MAX
#define IQ4XS_PASS_MAX 2
#endif

struct iq4xs_block {
    __m256i w[QK_K / 8][2], a[QK_K / 8][2]; /* levels and |levels| of qs dword k's low and high nibbles */
    __m256i scp[8];
    __m256 d;
};

static void iq4xs_unpack(const uint8_t *gb, struct iq4xs_block *o)
{
    const __m256i lut = iq4xs_lut();
    for (int k = 0; k < QK_K / 8; k++)
        iq4xs_levels(gb, k, lut, o->w[k], o->a[k]);
    iq4xs_scales(gb, o->scp);
    o->d = vmath_load8_f16(gb + KQRP_IQ4XS_D(R));
}

/* Chunk blocks [0, nbk) (super-blocks b0..) for T (<= IQ4XS_TT) tokens: a
 * looked-up vector loaded once serves them all. */
static inline __attribute__((always_inline)) void iq4xs_chunk_pass(const struct iq4xs_block *blk, int nbk, int64_t b0,
                                                                   const block_q8_K *const *y, int T, __m256 (*acc)[8])
{
    for (int i = 0; i < nbk; i++) {
        const struct iq4xs_block *k = &blk[i];
        for (int m = 0; m < 4; m++) { /* lanes m and m + 4 */
            __m256i lo[IQ4XS_TT], hi[IQ4XS_TT];
            for (int t = 0; t < T; t++)
                lo[t] = hi[t] = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) {
                const int q = 4 * j + m;
                const __m256i a0 = k->a[q][0], w0 = k->w[q][0], a1 = k->a[q][1], w1 = k->w[q][1];
                for (int t = 0; t < T; t++) {
                    lo[t] = iq4xs_dot(lo[t], a0, w0, k->scp[j], y[t][b0 + i].qs + 32 * j + 4 * m);
                    hi[t] = iq4xs_dot(hi[t], a1, w1, k->scp[j], y[t][b0 + i].qs + 32 * j + 16 + 4 * m);
                }
            }
            for (int t = 0; t < T; t++) {
                acc[t][m] = chain_add(acc[t][m], lo[t], k->d, y[t][b0 + i].d);
                acc[t][m + 4] = chain_add(acc[t][m + 4], hi[t], k->d, y[t][b0 + i].d);
            }
        }
    }
}

static void iq4xs_batch(const struct quant_kq_gemm *g, int64_t grp, int64_t t0, int T)
{
    const bool once = quant_weights_read_once(g->n_tokens);
    const size_t gbb = R * sizeof(block_iq4_xs);
    const int64_t nsb = g->cols / QK_K;
    static _Thread_local struct iq4xs_block blk[IQ4XS_CHUNK];
    __m256 acc[IQ4XS_BATCH][8];
    const block_q8_K *y[IQ4XS_BATCH];
    quant_kq_tile_tokens(g, t0, T, T, y);
    for (int t = 0; t < T; t++)
        for (int c = 0; c < 8; c++)
            acc[t][c] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < nsb; b0 += IQ4XS_CHUNK) {
        const int nbk = (int)(nsb - b0 < IQ4XS_CHUNK ? nsb - b0 : IQ4XS_CHUNK);
        const uint8_t *gb = g->W + (size_t)grp * R * g->wrow + (size_t)b0 * gbb;
        for (int i = 0; i < nbk; i++) {
            quant_prefetch_weights(gb + (size_t)i * gbb + KQRP_AHEAD, gbb, once);
            iq4xs_unpack(gb + (size_t)i * gbb, &blk[i]);
        }
        for (int t = 0; t < T; t += IQ4XS_TT) {
            const int n = T - t < IQ4XS_TT ? T - t : IQ4XS_TT;
            switch (n) { /* each width keeps its chains in registers */
#if IQ4XS_TT >= 4
            case 4: iq4xs_chunk_pass(blk, nbk, b0, y + t, 4, acc + t); break;
#endif
#if IQ4XS_TT >= 3
            case 3: iq4xs_chunk_pass(blk, nbk, b0, y + t, 3, acc + t); break;
#endif
            case 2: iq4xs_chunk_pass(blk, nbk, b0, y + t, 2, acc + t); break;
            default: iq4xs_chunk_pass(blk, nbk, b0, y + t, 1, acc + t); break;
            }
        }
    }
    for (int t = 0; t < T; t++)
        lanes_store(g, grp, t0 + t, acc[t]);
}

static void iq4xs_rows(const struct quant_kq_gemm *g, int64_t g0, int64_t g1)
{
    for (int64_t t0 = 0; t0 < g->n_tokens; t0 += IQ4XS_BATCH) {
        const int T = (int)(g->n_tokens - t0 < IQ4XS_BATCH ? g->n_tokens - t0 : IQ4XS_BATCH);
        for (int64_t grp = g0; grp < g1; grp++) {
            if (T <= IQ4XS_PASS_MAX)
                for (int t = 0; t < T; t++)
                    iq4xs_pass(g, grp, t0 + t);
            else
                iq4xs_batch(g, grp, t0, T);
        }
    }
}

typedef void (*kqrp_pass_fn)(const struct quant_kq_gemm *g, int64_t grp, int64_t t0);

#define KQRP_WIDTHS(pass)                                                                                  \
    static void pass##_1(const struct quant_kq_gemm *g, int64_t grp, int64_t t0) { pass(g, grp, t0, 1); } \
    static void pass##_2(const struct quant_kq_gemm *g, int64_t grp, int64_t t0) { pass(g, grp, t0, 2); } \
    static const kqrp_pass_fn pass##_widths[KQRP_TT + 1] = {NULL, pass##_1, pass##_2};

KQRP_WIDTHS(q4k_pass)
KQRP_WIDTHS(q2k_pass)

void quant_kqrp_rows_avx2(const struct quant_kq_gemm *g, int64_t g0, int64_t g1)
{
    if (g->wtype == QUANT_IQ4_XS) {
        iq4xs_rows(g, g0, g1);
        return;
    }
    const kqrp_pass_fn *passes = g->wtype == QUANT_Q2_K ? q2k_pass_widths : q4k_pass_widths;
    if (g->wtype == QUANT_Q6_K || g->wtype == QUANT_Q5_K || g->wtype == QUANT_Q3_K) {
        const kqrp_pass_fn pass = g->wtype == QUANT_Q6_K ? q6k_pass : g->wtype == QUANT_Q5_K ? q5k_pass : q3k_pass;
        for (int64_t grp = g0; grp < g1; grp++)
            for (int64_t t = 0; t < g->n_tokens; t++)
                pass(g, grp, t);
        return;
    }
    if (g->wtype != QUANT_Q4_K && g->wtype != QUANT_Q2_K) {
        quant_kqrp_rows_ref(g, R, g0, g1);
        return;
    }
    for (int64_t grp = g0; grp < g1; grp++)
        for (int64_t t = 0; t < g->n_tokens; t += KQRP_TT)
            passes[g->n_tokens - t < KQRP_TT ? g->n_tokens - t : KQRP_TT](g, grp, t);
}
#endif
