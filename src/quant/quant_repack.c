/* quant: Q4_0 / Q8_0 / IQ4_NL / MXFP4 / Q5_0 / Q5_1 weights repacked at load time into
 * interleaved row groups, and the decode GEMV / small-batch GEMM kernels that
 * read them.
 *
 * A group of QUANT_RP_ROWS rows is stored block column by block column; one
 * group-block holds the rows' scales (f16; MXFP4's E8M0 bytes), then their
 * quants in 4-byte chunks (chunk k of every row, then chunk k + 1):
 *     d[R] | qs[0..4) of rows 0..R-1 | qs[4..8) of rows 0..R-1 | ...
 * so one vector load brings 4 bytes of each of R rows, one row per 32-bit
 * lane, and a broadcast dword of the activations meets it: each lane ends a
 * block with that row's exact integer block dot, no horizontal sums. A group
 * is one sequential stream where the row-major layout was R streams.
 *
 * A matrix whose rows are not a multiple of R keeps its last rows % R rows
 * row-major: each group takes exactly the bytes of its rows, so the tail rows
 * stay where the file had them, and they run the scalar twin as groups of one
 * row (a row-major row is a group of 1 with unbiased Q8_0 quants).
 *
 * R is 16 with AVX-512 (a 512-bit register) and 8 with AVX2 and scalar. With
 * AVX-512 the Q8_0 quants are stored +128 (as u8) for vpdpbusd's unsigned
 * operand; Q4_0 nibbles are unsigned already (their -8 and the +128 become a
 * correction times the activation block's sum).
 *
 * IQ4_NL and MXFP4 nibbles are indices into a table of 16 int8 levels, laid
 * out as Q4_0's. The AVX-512 kernel looks them up (vpermb) in the table
 * +128, as u8 for vpdpbusd, the +128 removed by the same correction; the AVX2
 * kernel looks up the signed levels and multiplies |w| by x with w's sign
 * (every pair of products fits int16). Their groups are read by every batch
 * size: quant_matmul.c has no other kernel for the layout.
 *
 * Q5_0 and Q5_1 group-blocks keep their header fields as arrays, each one
 * vector load: d[R] | m[R] (Q5_1) | qh[R] (4 bytes; in lane order when R is
 * 8, rp_q5_lane_order) | then the nibbles in chunks as Q4_0's. A group of
 * one row is the file's block. Their kernels
 * keep llama.cpp's 8 float lanes per row (quant_internal.h, "q5_0 and
 * q5_1"): dword c of a block's rows against the token's dword c is lane c's
 * exact sum in one vpdpbusd (levels stored unsigned, nibble | bit << 4; q5_0's
 * -16 is a correction of -16 x the dword's activation sum), then one fma per
 * lane into 8 accumulators per row vector, and hsum_float_8's order at the
 * end: the reference vec_dot's bits, whatever the batch.
 *
 * Every other kernel computes, per row and token, what quant_vec_dot_*_ref does:
 *     sum = fma((float)isum_b, d_w * d_x, sum), block after block
 * (llama.cpp's repacked x86 order; this file is compiled with
 * -ffp-contract=off, so no other product is fused), so every ISA and the
 * scalar twin give the same bits as the unrepacked reference, whatever the
 * batch. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "quant/iq4_mxfp4.h"
#include "quant/kq_internal.h"
#include "quant/quant_internal.h"
#include "vmath/vmath_simd.h"

#if defined(QUANT_HAVE_AVX2)
#include <immintrin.h>
#endif

#define RP_CHUNK 4        /* bytes of one row per lane */
#define RP_TT 4           /* tokens sharing one pass over a group's weights (AVX2: 16 ymm registers) */
#define RP512_TT 12       /* the same with AVX-512's 32 zmm registers: a verification of 8 drafts in one pass */
#define RP5_TT 2          /* the same for q5 with AVX-512: 8 lane accumulators per token */
#define RP5_CHUNK_BLOCKS 16 /* q5 batches: blocks of a group unpacked at once (8 KiB of levels with AVX-512) */
#define RP5_BATCH_TOKENS 16 /* q5 batches: tokens passing over one unpacked chunk */
#ifndef RP_AHEAD
#define RP_AHEAD 4096     /* software prefetch distance in the weight stream (2 KiB: 3% fewer GB/s on q4_0) */
#endif
/* The same for the AVX-512 kernels, by kind. q5 and q8_0: 8 KiB, as their
 * k-quants' (KQRP_AHEAD): gemma3-1b's q5_0 gate/up, 2 threads from DRAM, 12
 * interleaved runs: median 51.2 GB/s at 4 KiB, 55.0 at 8 KiB; a whole
 * llama-1b q8_0 step's matrices in model order 8% slower at 4 KiB. Q4_0 and
 * the lookup-table types: 4 KiB. One matrix after another of the same shape
 * (bench_matmul) hides it, but in a decode step's order (q, k, v, o, gate,
 * up, down, layer after layer) llama-1b q4_0 at 8 KiB streamed slower than
 * with no software prefetch at all: 15 interleaved rounds, 659 us a layer at
 * 8 KiB, 603 at 4 KiB, 592 at 3 KiB (bench_matmul --gguf shows it); kvserve
 * tg128 70.6 -> 97.1 tok/s (11 interleaved rounds, Zen 5). IQ4_NL did not
 * care (2-16 KiB or none). */
#ifndef RP512_AHEAD
#define RP512_AHEAD 8192
#endif
#ifndef RP512_AHEAD_Q4
#define RP512_AHEAD_Q4 4096
#endif

/* The 4-bit lookup-table types: nibbles as Q4_0's, each an index into 16 int8 levels. */
static bool rp_is_lut(enum quant_type t) { return t == QUANT_IQ4_NL || t == QUANT_MXFP4; }
static bool rp_is_q5(enum quant_type t) { return t == QUANT_Q5_0 || t == QUANT_Q5_1; }
/* q5 header arrays: f16 fields per row (d; d and m) before the qh dwords. */
static int rp_q5_f16s(enum quant_type t) { return t == QUANT_Q5_1 ? 2 : 1; }
static const int8_t *rp_levels(enum quant_type t) { return t == QUANT_MXFP4 ? quant_mxfp4_values : quant_iq4nl_values; }

static size_t rp_block_bytes(enum quant_type t)
{
    switch (t) {
    case QUANT_Q4_0: return sizeof(block_q4_0);
    case QUANT_IQ4_NL: return sizeof(block_iq4_nl);
    case QUANT_MXFP4: return sizeof(block_mxfp4);
    case QUANT_Q5_0: return sizeof(block_q5_0);
    case QUANT_Q5_1: return sizeof(block_q5_1);
    default: return sizeof(block_q8_0);
    }
}
/* Bytes of one row's header before the nibbles: an f16 scale, MXFP4's E8M0
 * exponent, or a q5 block's f16 fields and qh. */
static int rp_scale_bytes(enum quant_type t)
{
    if (rp_is_q5(t))
        return 2 * rp_q5_f16s(t) + 4;
    return t == QUANT_MXFP4 ? 1 : (int)sizeof(quant_f16);
}
static int rp_chunks(enum quant_type t) { return (t == QUANT_Q8_0 ? QK8_0 : QK4_0 / 2) / RP_CHUNK; }

int quant_repack_rows(void) { return QUANT_RP_ROWS; }

bool quant_repack_fits(enum quant_type t, int64_t rows, int64_t cols)
{
    if (quant_kqrp_type(t))
        return rows >= QUANT_RP_ROWS && cols > 0 && cols % QK_K == 0 && cols <= INT32_MAX;
    return (t == QUANT_Q4_0 || t == QUANT_Q8_0 || rp_is_lut(t) || rp_is_q5(t)) && rows >= QUANT_RP_ROWS && cols > 0 &&
           cols % QK8_0 == 0 && cols <= INT32_MAX;
}

/* Group-block (g, b): R scales, then the chunks. */
static uint8_t *rp_group_block(const uint8_t *W, enum quant_type t, int64_t nb, int R, int64_t g, int64_t b)
{
    return (uint8_t *)W + (size_t)(g * nb + b) * (size_t)R * rp_block_bytes(t);
}

/* Lane (row) l's 4 bytes of chunk k in a group-block of R rows; its scale is at gb + l * rp_scale_bytes(t). */
static uint8_t *rp_chunk(uint8_t *gb, enum quant_type t, int R, int l, int k)
{
    return gb + rp_scale_bytes(t) * R + (size_t)k * RP_CHUNK * R + 4 * l;
}

/* Lane l's scale as a float: the f16, or 2^(e - 128) (quant_e8m0_to_f32_half, as MXFP4's vec_dot reads it). */
static float rp_scale(const uint8_t *gb, enum quant_type t, int l)
{
    if (t == QUANT_MXFP4)
        return quant_e8m0_to_f32_half(gb[l]);
    quant_f16 d;
    memcpy(&d, gb + 2 * l, sizeof d);
    return quant_f16_to_f32(d);
}

/* q5 groups of 8 rows (the AVX2 and scalar layout) store each row's qh in
 * lane order: element e = 4c + i's fifth bit at bit 8i + c, so lane c's bits
 * of 8 rows reach bit 4 of their bytes in one dword shift and are kept by one
 * mask (the file's order took a shift and two byte shuffles). AVX-512's
 * 16-row groups keep the file's order for their vpermd lookup; a group of one
 * row is the file's block. */
static bool rp_q5_lane_order(int R) { return R == 8; }

static uint32_t rp_q5_qh_to_lanes(uint32_t qh)
{
    uint32_t out = 0;
    for (int e = 0; e < QK5_0; e++)
        out |= ((qh >> e) & 1u) << (8 * (e % 4) + e / 4);
    return out;
}

static uint32_t rp_q5_qh_from_lanes(uint32_t lanes)
{
    uint32_t qh = 0;
    for (int e = 0; e < QK5_0; e++)
        qh |= ((lanes >> (8 * (e % 4) + e / 4)) & 1u) << e;
    return qh;
}

/* Row l's header between its block (blk) and the group-block: q5's fields go
 * to their arrays (qh in lane order for 8 rows), every other type's scale to
 * gb + l * its bytes. */
static void rp_header_io(uint8_t *gb, enum quant_type t, int R, int l, uint8_t *blk, bool put)
{
    if (!rp_is_q5(t)) {
        const int sb = rp_scale_bytes(t);
        put ? memcpy(gb + sb * l, blk, (size_t)sb) : memcpy(blk, gb + sb * l, (size_t)sb);
        return;
    }
    const int nf = rp_q5_f16s(t);
    for (int f = 0; f <= nf; f++) { /* the f16 fields, then qh */
        size_t at = f < nf ? 2 * ((size_t)f * R + l) : 2 * (size_t)nf * R + 4 * (size_t)l, n = f < nf ? 2 : 4;
        put ? memcpy(gb + at, blk + 2 * f, n) : memcpy(blk + 2 * f, gb + at, n);
    }
    if (rp_q5_lane_order(R)) {
        uint8_t *qh = put ? gb + 2 * (size_t)nf * R + 4 * (size_t)l : blk + 2 * nf;
        uint32_t v;
        memcpy(&v, qh, sizeof v);
        v = put ? rp_q5_qh_to_lanes(v) : rp_q5_qh_from_lanes(v);
        memcpy(qh, &v, sizeof v);
    }
}

static void rp_put(uint8_t *gb, enum quant_type t, int R, int q8_bias, int l, const uint8_t *blk)
{
    const int sb = rp_scale_bytes(t);
    rp_header_io(gb, t, R, l, (uint8_t *)blk, true);
    const uint8_t *qs = blk + sb;
    for (int k = 0; k < rp_chunks(t); k++)
        for (int i = 0; i < RP_CHUNK; i++)
            rp_chunk(gb, t, R, l, k)[i] = t == QUANT_Q8_0 ? (uint8_t)(qs[k * RP_CHUNK + i] ^ q8_bias) : qs[k * RP_CHUNK + i];
}

void quant_rp_get_block(const void *W, enum quant_type t, int64_t nb, int64_t r, int64_t b, void *out)
{
    const int R = QUANT_RP_ROWS, l = (int)(r % R), sb = rp_scale_bytes(t);
    uint8_t *gb = rp_group_block(W, t, nb, R, r / R, b), *o = out;
    rp_header_io(gb, t, R, l, o, false);
    for (int k = 0; k < rp_chunks(t); k++)
        for (int i = 0; i < RP_CHUNK; i++) {
            uint8_t v = rp_chunk(gb, t, R, l, k)[i];
            o[sb + k * RP_CHUNK + i] = t == QUANT_Q8_0 ? (uint8_t)(v ^ QUANT_RP_Q8_BIAS) : v;
        }
}

ks_status quant_repack(enum quant_type t, int64_t rows, int64_t cols, void *W)
{
    if (!W || !quant_repack_fits(t, rows, cols))
        return ks_fail(KS_ERR_INVALID_ARG, "repack: %s matrix of %lld x %lld cannot be repacked (Q4_0, Q8_0, IQ4_NL, "
                       "IQ4_XS, MXFP4, Q5_0, Q5_1 or Q2_K..Q6_K, whole blocks, at least %d rows)", quant_type_name(t),
                       (long long)rows, (long long)cols, QUANT_RP_ROWS);
    if (quant_kqrp_type(t))
        return quant_kqrp_repack_as(t, rows, cols, W, QUANT_RP_ROWS);
    return quant_rp_repack_as(t, rows, cols, W, QUANT_RP_ROWS, QUANT_RP_Q8_BIAS);
}

ks_status quant_rp_repack_as(enum quant_type t, int64_t rows, int64_t cols, void *W, int R, int q8_bias)
{
    size_t wrow = quant_row_size(t, cols), bb = rp_block_bytes(t);
    int64_t nb = cols / QK8_0;
    uint8_t *rowmajor = malloc((size_t)R * wrow);
    if (!rowmajor)
        return ks_fail(KS_ERR_NOMEM, "repack: out of memory for %d rows of %zu bytes", R, wrow);
    for (int64_t g = 0; g < rows / R; g++) {
        uint8_t *group = (uint8_t *)W + (size_t)g * R * wrow; /* the group's rows become its group-blocks in place */
        memcpy(rowmajor, group, (size_t)R * wrow);
        for (int64_t b = 0; b < nb; b++)
            for (int l = 0; l < R; l++)
                rp_put(rp_group_block(W, t, nb, R, g, b), t, R, q8_bias, l, rowmajor + l * wrow + b * bb);
    }
    free(rowmajor);
    return KS_OK;
}

void quant_rp_pack_token(enum quant_type wtype, const float *x, int64_t cols, struct quant_rp_act *out)
{
    for (int64_t b = 0; b < cols / QK8_0; b++) {
#if defined(QUANT_HAVE_AVX512)
        if (!rp_is_q5(wtype)) { /* the quants, scale and sum in one pass (quant_q8_0_act_from_float's bits) */
            int sum;
            float d = quant_q8_0_act_block_avx512(x + b * QK8_0, out[b].qs, &sum);
            out[b].d = quant_f16_to_f32(quant_f32_to_f16(d));
            out[b].s = 0.0f;
            out[b].sum = sum;
            memset(out[b].lane_corr, 0, sizeof out[b].lane_corr);
            continue;
        }
#endif
        quant_f16 d, s = 0;
        if (wtype == QUANT_Q5_1) { /* Q8_1's quants and d are Q8_0's (the same rounding); s besides */
            block_q8_1 q;
            quant_q8_1_act_from_float_ref(x + b * QK8_0, &q, QK8_0);
            memcpy(out[b].qs, q.qs, QK8_0);
            d = q.d, s = q.s;
        } else {
            block_q8_0 q;
            quant_q8_0_act_from_float(x + b * QK8_0, &q, QK8_0);
            memcpy(out[b].qs, q.qs, QK8_0);
            d = q.d;
        }
        out[b].d = quant_f16_to_f32(d);
        out[b].s = quant_f16_to_f32(s);
        int sum = 0;
        for (int c = 0; c < QUANT_Q5_LANES; c++) {
            int lane = 0;
            for (int i = 4 * c; i < 4 * c + 4; i++)
                lane += out[b].qs[i];
            out[b].lane_corr[c] = wtype == QUANT_Q5_0 ? -16 * lane : 0;
            sum += lane;
        }
        out[b].sum = sum;
    }
}

/* ---- one row back as floats: the lookup of tied token embeddings ----------- */

void quant_rp_row_to_float_ref(const void *W, enum quant_type t, int64_t nb, int64_t r, float *y)
{
    quant_to_float_fn to_float = quant_traits_scalar(t)->to_float;
    uint8_t blk[sizeof(block_q8_0)]; /* the largest block */
    for (int64_t b = 0; b < nb; b++) {
        quant_rp_get_block(W, t, nb, r, b, blk);
        to_float(blk, y + b * QK8_0, QK8_0);
    }
}

#if defined(QUANT_HAVE_AVX2)
static void rp_row_to_float_avx2(const void *W, enum quant_type t, int64_t nb, int64_t r, float *y)
{
    for (int64_t b = 0; b < nb; b++, y += QK8_0) {
        float d;
        __m256i v = quant_rp_block_bytes(W, t, nb, r, b, &d);
        __m128i half[2] = {_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)};
        for (int i = 0; i < 4; i++) {
            __m128i q = i % 2 ? _mm_srli_si128(half[i / 2], 8) : half[i / 2];
            __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
            _mm256_storeu_ps(y + 8 * i, _mm256_mul_ps(f, _mm256_set1_ps(d)));
        }
    }
}
#endif

ks_status quant_get_row_repacked(const void *W, enum quant_type t, int64_t rows, int64_t cols, int64_t r, float *y)
{
    if (!W || !y || !quant_repack_fits(t, rows, cols) || r < 0 || r >= rows)
        return ks_fail(KS_ERR_INVALID_ARG, "get_row: no row %lld in a repacked %s matrix of %lld x %lld", (long long)r,
                       quant_type_name(t), (long long)rows, (long long)cols);
    if (r >= quant_rp_grouped_rows(rows))
        return quant_get_row(W, t, cols, r, y);
    if (quant_kqrp_type(t)) {
        quant_kqrp_get_row(W, t, rows, cols, r, y);
        return KS_OK;
    }
#if defined(QUANT_HAVE_AVX2)
    if (!rp_is_lut(t) && !rp_is_q5(t)) {
        rp_row_to_float_avx2(W, t, cols / QK8_0, r, y);
        return KS_OK;
    }
#endif
    /* a lookup-table or q5 row: one value times the scale (plus q5_1's min) per element, the same bits in any form */
    quant_rp_row_to_float_ref(W, t, cols / QK8_0, r, y);
    return KS_OK;
}

#if defined(QUANT_HAVE_AVX2)
/* Chunk k of an activation block: what a SIMD kernel broadcasts. */
static int32_t act_dword(const struct quant_rp_act *a, int k)
{
    int32_t v;
    memcpy(&v, a->qs + k * RP_CHUNK, sizeof v);
    return v;
}

/* One tile: a group's rows against tokens t0 .. t0 + T over all blocks. */
typedef void (*rp_tile_fn)(const struct quant_rp_job *j, int64_t g, int64_t t0);

/* Groups [g0, g1), the tokens in the fewest tiles of at most max_T, as even
 * as they go (17 tokens are 9 + 8 with AVX-512, and 3 + 3 + 3 + 4 + 4 with
 * AVX2: tiles of the widest width and a narrow last one cost a pass over the
 * weights for few tokens); tiles[T] is the kernel compiled for T tokens, a
 * constant width that keeps its accumulators in registers. */
static void rp_rows(const struct quant_rp_job *j, int64_t g0, int64_t g1, const rp_tile_fn *tiles, int max_T)
{
    const int64_t n_tiles = (j->n_tokens + max_T - 1) / max_T, narrow = j->n_tokens / n_tiles,
                  wide_from = n_tiles - j->n_tokens % n_tiles; /* tiles from here take narrow + 1 */
    for (int64_t g = g0; g < g1; g++)
        for (int64_t i = 0, t = 0; i < n_tiles; i++) {
            const int64_t T = narrow + (i >= wide_from);
            tiles[T](j, g, t);
            t += T;
        }
}

/* tiles[1..RP_TT] (and to RP512_TT) of an always-inline tile(j, g, t0, T). */
#define RP_TILE_WIDTH(tile, T) \
    static void tile##_##T(const struct quant_rp_job *j, int64_t g, int64_t t0) { tile(j, g, t0, T); }
#define RP_TILE_WIDTHS(tile)                                                                                       \
    RP_TILE_WIDTH(tile, 1) RP_TILE_WIDTH(tile, 2) RP_TILE_WIDTH(tile, 3) RP_TILE_WIDTH(tile, 4)                    \
    static const rp_tile_fn tile##_widths[RP_TT + 1] = {NULL, tile##_1, tile##_2, tile##_3, tile##_4};
/* tiles[3..RP512_TT] of tile; widths 1 and 2 are rp512_any_1 and _2, any kind */
#define RP512_TILE_WIDTHS(tile)                                                                                    \
    RP_TILE_WIDTH(tile, 3) RP_TILE_WIDTH(tile, 4) RP_TILE_WIDTH(tile, 5) RP_TILE_WIDTH(tile, 6)                    \
    RP_TILE_WIDTH(tile, 7) RP_TILE_WIDTH(tile, 8) RP_TILE_WIDTH(tile, 9) RP_TILE_WIDTH(tile, 10)                   \
    RP_TILE_WIDTH(tile, 11) RP_TILE_WIDTH(tile, 12)                                                                \
    static const rp_tile_fn tile##_widths[RP512_TT + 1] = {                                                        \
        NULL, rp512_any_1, rp512_any_2, tile##_3, tile##_4, tile##_5, tile##_6,                                    \
        tile##_7, tile##_8, tile##_9, tile##_10, tile##_11, tile##_12};
#endif

#if defined(QUANT_HAVE_AVX512)
/* q5's fifth bits: entry i holds 0x10 in byte b where bit b of i is set (the
 * 4 bits of one lane, per row dword; vpermd reads an index's low 4 bits). */
static const int32_t rp_q5_bits[16] = {
    0x00000000, 0x00000010, 0x00001000, 0x00001010, 0x00100000, 0x00100010, 0x00101000, 0x00101010,
    0x10000000, 0x10000010, 0x10001000, 0x10001010, 0x10100000, 0x10100010, 0x10101000, 0x10101010,
};
#endif

/* ---- scalar twin: any R and Q8_0 bias ---------------------------------------- */

static int32_t rp_dot_ref(const uint8_t *gb, enum quant_type t, int R, int q8_bias, int l, const struct quant_rp_act *a)
{
    int32_t isum = 0;
    for (int k = 0; k < rp_chunks(t); k++)
        for (int i = 0; i < RP_CHUNK; i++) {
            uint8_t v = rp_chunk((uint8_t *)gb, t, R, l, k)[i];
            int e = k * RP_CHUNK + i;
            if (t == QUANT_Q4_0)
                isum += ((v & 0x0f) - 8) * a->qs[e] + ((v >> 4) - 8) * a->qs[e + QK4_0 / 2];
            else if (rp_is_lut(t))
                isum += rp_levels(t)[v & 0x0f] * a->qs[e] + rp_levels(t)[v >> 4] * a->qs[e + QK4_0 / 2];
            else
                isum += (int8_t)(v ^ q8_bias) * a->qs[e];
        }
    return isum;
}

/* q5: lane c of row l's block, the exact sum of its 4 elements' (level - 16) * x
 * (q5_0) or level * x (q5_1). Lane c < 4 is chunk c's low nibbles, lane c >= 4
 * chunk c - 4's high ones; element e's fifth bit is bit e of qh (bit
 * 8 (e % 4) + e / 4 in lane order). */
static void rp5_lanes_ref(const uint8_t *gb, enum quant_type t, int R, int l, const struct quant_rp_act *a,
                          int32_t lane[QUANT_Q5_LANES])
{
    uint32_t qh;
    memcpy(&qh, gb + 2 * (size_t)rp_q5_f16s(t) * R + 4 * (size_t)l, sizeof qh);
    const int offset = t == QUANT_Q5_0 ? 16 : 0;
    for (int c = 0; c < QUANT_Q5_LANES; c++) {
        const uint8_t *ch = rp_chunk((uint8_t *)gb, t, R, l, c % 4);
        int32_t sum = 0;
        for (int i = 0; i < RP_CHUNK; i++) {
            int e = 4 * c + i, bit = rp_q5_lane_order(R) ? 8 * i + c : e;
            int level = ((ch[i] >> (c < 4 ? 0 : 4)) & 0x0f) | (int)(((qh >> bit) & 1) << 4);
            sum += (level - offset) * a->qs[e];
        }
        lane[c] = sum;
    }
}

/* quant_vec_dot_q5_0_q8_0_ref / q5_1_q8_1_ref on the group layout. */
static void rp5_rows_ref(const struct quant_rp_job *j, int R, int64_t g0, int64_t g1)
{
    const enum quant_type t = j->wtype;
    for (int64_t g = g0; g < g1; g++)
        for (int64_t tok = 0; tok < j->n_tokens; tok++) {
            const struct quant_rp_act *a = quant_rp_token(j, tok);
            for (int l = 0; l < R; l++) {
                float acc[QUANT_Q5_LANES] = {0}, summs = 0;
                for (int64_t b = 0; b < j->nb; b++) {
                    const uint8_t *gb = rp_group_block(j->W, t, j->nb, R, g, b);
                    int32_t lane[QUANT_Q5_LANES];
                    rp5_lanes_ref(gb, t, R, l, a + b, lane);
                    if (t == QUANT_Q5_1) {
                        quant_f16 m;
                        memcpy(&m, gb + 2 * ((size_t)R + l), sizeof m);
                        summs = fmaf(quant_f16_to_f32(m), a[b].s, summs);
                    }
                    const float d = rp_scale(gb, t, l) * a[b].d;
                    for (int c = 0; c < QUANT_Q5_LANES; c++)
                        acc[c] = fmaf(d, (float)lane[c], acc[c]);
                }
                float sum = quant_lanes_hsum8(acc);
                j->Y[tok * j->ldy + g * R + l] = t == QUANT_Q5_1 ? sum + summs : sum;
            }
        }
}

void quant_rp_rows_ref(const struct quant_rp_job *j, int R, int q8_bias, int64_t g0, int64_t g1)
{
    if (rp_is_q5(j->wtype)) {
        rp5_rows_ref(j, R, g0, g1);
        return;
    }
    for (int64_t g = g0; g < g1; g++)
        for (int64_t t = 0; t < j->n_tokens; t++) {
            const struct quant_rp_act *a = quant_rp_token(j, t);
            for (int l = 0; l < R; l++) {
                float sum = 0;
                for (int64_t b = 0; b < j->nb; b++) {
                    const uint8_t *gb = rp_group_block(j->W, j->wtype, j->nb, R, g, b);
                    sum = fmaf((float)rp_dot_ref(gb, j->wtype, R, q8_bias, l, a + b), rp_scale(gb, j->wtype, l) * a[b].d,
                               sum);
                }
                j->Y[t * j->ldy + g * R + l] = sum;
            }
        }
}

void quant_rp_tail_rows(const struct quant_rp_job *j, int64_t rows)
{
    int64_t r0 = quant_rp_grouped_rows(rows);
    struct quant_rp_job tail = *j;
    tail.W = j->W + (size_t)r0 * (size_t)j->nb * rp_block_bytes(j->wtype);
    tail.Y = j->Y + r0;
    quant_rp_rows_ref(&tail, 1, 0, 0, rows - r0);
}

#if defined(QUANT_HAVE_AVX512)
/* ---- AVX-512: 16 rows per lane set ------------------------------------------- */

/* The 16 rows' scales of a group-block as floats: f16, or MXFP4's 2^(e - 128),
 * whose exponent field is e - 1 (e = 0 and 1 give the subnormals 2^-128 and
 * 2^-127, as quant_e8m0_to_f32_half). */
static inline __m512 rp512_scales(const uint8_t *gb, enum quant_type t)
{
    if (t != QUANT_MXFP4)
        return vmath_load16_f16(gb);
    __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)gb));
    __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    __m512i subnormal = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    __mmask16 small = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(small, normal, subnormal));
}

/* A lookup-table type's 16 levels +128 (as u8, for vpdpbusd) in each 16-byte
 * quarter: vpermb reads an index's low 6 bits, so bits 4 and 5 pick a copy and
 * a nibble needs no mask, a high one only a shift. */
static inline __m512i rp512_levels_u8(enum quant_type t)
{
    __m128i v = _mm_loadu_si128((const __m128i *)rp_levels(t));
    return _mm512_broadcast_i32x4(_mm_xor_si128(v, _mm_set1_epi8((char)0x80)));
}

/* Up to RP512_TT tokens. kind: QUANT_Q4_0, QUANT_Q8_0, or QUANT_IQ4_NL for
 * both lookup-table types, a constant, so each kind's tiles are compiled
 * without the others' branches (with them, GCC broadcast every token's
 * dwords into registers and stack slots ahead of the branch, spilling from 4
 * tokens on, instead of one broadcast load where each is used). */
static inline __attribute__((always_inline)) void rp512_tile(const struct quant_rp_job *j, int64_t g, int64_t t0,
                                                             int T, enum quant_type kind)
{
    const bool once = quant_weights_read_once(j->n_tokens);
    const int R = 16, bias = kind == QUANT_Q4_0 ? 8 : 128;
    const size_t gbb = (size_t)R * rp_block_bytes(j->wtype), qs_at = (size_t)R * rp_scale_bytes(j->wtype);
    const bool lut = kind == QUANT_IQ4_NL;
    const __m512i levels = lut ? rp512_levels_u8(j->wtype) : _mm512_setzero_si512();
    const struct quant_rp_act *a[RP512_TT];
    __m512 acc[RP512_TT];
    for (int t = 0; t < T; t++) {
        a[t] = quant_rp_token(j, t0 + t);
        acc[t] = _mm512_setzero_ps();
    }
    const uint8_t *gb = rp_group_block(j->W, j->wtype, j->nb, R, g, 0);
    for (int64_t b = 0; b < j->nb; b++, gb += gbb) {
        quant_prefetch_weights(gb + (kind == QUANT_Q8_0 ? RP512_AHEAD : RP512_AHEAD_Q4), gbb, once);
        __m512i isum[RP512_TT];
        for (int t = 0; t < T; t++)
            isum[t] = _mm512_set1_epi32(-bias * a[t][b].sum);
        if (kind == QUANT_Q4_0 && T > 4) {
            /* 5 tokens and more: the high nibbles shifted down once for all of them, so a token's block is
             * 8 vpdpbusd in one chain (enough chains to hide its latency) and no shift or add of its own. */
            for (int k = 0; k < 4; k++) {
                __m512i raw = _mm512_loadu_si512(gb + qs_at + 64 * k);
                __m512i lo = _mm512_and_si512(raw, _mm512_set1_epi8(0x0f));
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), _mm512_set1_epi8(0x0f));
                for (int t = 0; t < T; t++) {
                    isum[t] = _mm512_dpbusd_epi32(isum[t], lo, _mm512_set1_epi32(act_dword(&a[t][b], k)));
                    isum[t] = _mm512_dpbusd_epi32(isum[t], hi, _mm512_set1_epi32(act_dword(&a[t][b], k + 4)));
                }
            }
        } else if (kind == QUANT_Q4_0) {
            /* Up to 4 tokens: high nibbles stay in place (raw & 0xf0 = 16 x nibble) with sums of their own,
             * shifted back once per block (exact: every product is a multiple of 16): one AND per load
             * instead of a shift and an AND, and two dependency chains instead of one. */
            __m512i hsum[RP512_TT];
            for (int t = 0; t < T; t++)
                hsum[t] = _mm512_setzero_si512();
            for (int k = 0; k < 4; k++) {
                __m512i raw = _mm512_loadu_si512(gb + qs_at + 64 * k);
                __m512i lo = _mm512_and_si512(raw, _mm512_set1_epi8(0x0f));
                __m512i hi16 = _mm512_and_si512(raw, _mm512_set1_epi8((char)0xf0));
                for (int t = 0; t < T; t++) {
                    isum[t] = _mm512_dpbusd_epi32(isum[t], lo, _mm512_set1_epi32(act_dword(&a[t][b], k)));
                    hsum[t] = _mm512_dpbusd_epi32(hsum[t], hi16, _mm512_set1_epi32(act_dword(&a[t][b], k + 4)));
                }
            }
            for (int t = 0; t < T; t++)
                isum[t] = _mm512_add_epi32(isum[t], _mm512_srai_epi32(hsum[t], 4));
        } else if (lut) {
            __m512i hsum[RP512_TT];
            for (int t = 0; t < T; t++)
                hsum[t] = _mm512_setzero_si512();
            for (int k = 0; k < 4; k++) {
                __m512i raw = _mm512_loadu_si512(gb + qs_at + 64 * k);
                __m512i lo = _mm512_permutexvar_epi8(raw, levels);
                __m512i hi = _mm512_permutexvar_epi8(_mm512_srli_epi16(raw, 4), levels);
                for (int t = 0; t < T; t++) { /* from 5 tokens one chain per token, as Q4_0's */
                    isum[t] = _mm512_dpbusd_epi32(isum[t], lo, _mm512_set1_epi32(act_dword(&a[t][b], k)));
                    __m512i *h = T > 4 ? &isum[t] : &hsum[t];
                    *h = _mm512_dpbusd_epi32(*h, hi, _mm512_set1_epi32(act_dword(&a[t][b], k + 4)));
                }
            }
            for (int t = 0; t < T && T <= 4; t++)
                isum[t] = _mm512_add_epi32(isum[t], hsum[t]);
        } else {
            for (int k = 0; k < 8; k++) {
                __m512i w = _mm512_loadu_si512(gb + qs_at + 64 * k);
                for (int t = 0; t < T; t++)
                    isum[t] = _mm512_dpbusd_epi32(isum[t], w, _mm512_set1_epi32(act_dword(&a[t][b], k)));
            }
        }
        __m512 dw = rp512_scales(gb, lut ? j->wtype : kind);
        for (int t = 0; t < T; t++)
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), _mm512_mul_ps(dw, _mm512_set1_ps(a[t][b].d)), acc[t]);
    }
    for (int t = 0; t < T; t++)
        _mm512_storeu_ps(j->Y + (t0 + t) * j->ldy + g * R, acc[t]);
}

static inline __attribute__((always_inline)) void rp512_q4(const struct quant_rp_job *j, int64_t g, int64_t t0, int T)
{
    rp512_tile(j, g, t0, T, QUANT_Q4_0);
}
static inline __attribute__((always_inline)) void rp512_q8(const struct quant_rp_job *j, int64_t g, int64_t t0, int T)
{
    rp512_tile(j, g, t0, T, QUANT_Q8_0);
}
static inline __attribute__((always_inline)) void rp512_lut(const struct quant_rp_job *j, int64_t g, int64_t t0, int T)
{
    rp512_tile(j, g, t0, T, QUANT_IQ4_NL);
}
/* One and two tokens: every kind in one function, the kind known at run time, as before the kinds were
 * split: GCC schedules these better than rp512_q4_1 and _2 (3-6% on L2-resident 2048 x 2048 q4_0, 1 thread,
 * interleaved A/B medians on a busy machine). */
static void rp512_any_1(const struct quant_rp_job *j, int64_t g, int64_t t0)
{
    rp512_tile(j, g, t0, 1, rp_is_lut(j->wtype) ? QUANT_IQ4_NL : j->wtype);
}
static void rp512_any_2(const struct quant_rp_job *j, int64_t g, int64_t t0)
{
    rp512_tile(j, g, t0, 2, rp_is_lut(j->wtype) ? QUANT_IQ4_NL : j->wtype);
}
RP512_TILE_WIDTHS(rp512_q4)
RP512_TILE_WIDTHS(rp512_q8)
RP512_TILE_WIDTHS(rp512_lut)

/* q5: the unsigned levels (nibble | fifth bit << 4) of lanes k and k + 4 of
 * 16 rows, from chunk k's bytes (raw) and the rows' qh: bits 4k.. / 16 + 4k..
 * of qh looked up as 0x10 bytes (vpermd reads an index's low 4 bits), each
 * merged under the nibble mask by one vpternlogd; the high nibbles moved
 * down by vpmultishiftqb, on the shuffle port, as the lookups are, rather
 * than the one the shifts and vpdpbusd share (a decode pass of gemma3-1b's
 * Q4_K_M is two thirds q5_0 bytes, and these kernels sit closest to their
 * compute bound). */
#define RP5_SEL_A_OVER_B 0xe4 /* (a, b, c): c ? a : b */
static inline void rp512_q5_levels(__m512i raw, __m512i qh, int k, __m512i bits, __m512i *u_lo, __m512i *u_hi)
{
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const __m512i nib_hi = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x3c342c241c140c04ll), raw);
    *u_lo = _mm512_ternarylogic_epi32(raw, _mm512_permutexvar_epi32(_mm512_srli_epi32(qh, 4 * k), bits), low4,
                                      RP5_SEL_A_OVER_B);
    *u_hi = _mm512_ternarylogic_epi32(nib_hi, _mm512_permutexvar_epi32(_mm512_srli_epi32(qh, 16 + 4 * k), bits), low4,
                                      RP5_SEL_A_OVER_B);
}

/* q5: blocks [b0, b1) of group g's 16 rows against tokens a[0..T) (T <=
 * RP5_TT: 8 lane accumulators per token), in llama.cpp's lane order, into
 * acc and summs; the first pass over a stretch of the weights prefetches
 * ahead of it. */
static inline __attribute__((always_inline)) void rp512_q5_blocks(const struct quant_rp_job *j, int64_t g, int64_t b0,
                                                                  int64_t b1, const struct quant_rp_act *const *a,
                                                                  int T, bool prefetch, __m512 (*acc)[QUANT_Q5_LANES],
                                                                  __m512 *summs)
{
    const bool once = quant_weights_read_once(j->n_tokens);
    const int R = 16;
    const bool q5_1 = j->wtype == QUANT_Q5_1;
    const size_t gbb = (size_t)R * rp_block_bytes(j->wtype), qh_at = 2 * (size_t)rp_q5_f16s(j->wtype) * R,
                 qs_at = (size_t)R * rp_scale_bytes(j->wtype);
    const __m512i bits = _mm512_loadu_si512(rp_q5_bits);
    const uint8_t *gb = rp_group_block(j->W, j->wtype, j->nb, R, g, b0);
    for (int64_t b = b0; b < b1; b++, gb += gbb) {
        if (prefetch)
            quant_prefetch_weights(gb + RP512_AHEAD, gbb, once);
        const __m512i qh = _mm512_loadu_si512(gb + qh_at);
        const __m512 dw = vmath_load16_f16(gb);
        __m512 dd[RP5_TT];
        for (int t = 0; t < T; t++)
            dd[t] = _mm512_mul_ps(dw, _mm512_set1_ps(a[t][b].d));
        if (q5_1) {
            const __m512 m = vmath_load16_f16(gb + 2 * R);
            for (int t = 0; t < T; t++)
                summs[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(a[t][b].s), summs[t]);
        }
        for (int k = 0; k < 4; k++) {
            __m512i u_lo, u_hi;
            rp512_q5_levels(_mm512_loadu_si512(gb + qs_at + 64 * k), qh, k, bits, &u_lo, &u_hi);
            for (int t = 0; t < T; t++) {
                const struct quant_rp_act *x = &a[t][b];
                __m512i lo = _mm512_dpbusd_epi32(_mm512_set1_epi32(x->lane_corr[k]), u_lo,
                                                 _mm512_set1_epi32(act_dword(x, k)));
                __m512i hi = _mm512_dpbusd_epi32(_mm512_set1_epi32(x->lane_corr[k + 4]), u_hi,
                                                 _mm512_set1_epi32(act_dword(x, k + 4)));
                acc[t][k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), dd[t], acc[t][k]);
                acc[t][k + 4] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), dd[t], acc[t][k + 4]);
            }
        }
    }
}

static inline void rp512_q5_store(const struct quant_rp_job *j, int64_t g, int64_t t, const __m512 v[QUANT_Q5_LANES],
                                  __m512 summs)
{
    /* hsum_float_8's order, row by row */
    __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(v[0], v[4]), _mm512_add_ps(v[2], v[6])),
                               _mm512_add_ps(_mm512_add_ps(v[1], v[5]), _mm512_add_ps(v[3], v[7])));
    _mm512_storeu_ps(j->Y + t * j->ldy + g * 16, j->wtype == QUANT_Q5_1 ? _mm512_add_ps(sum, summs) : sum);
}

/* Tokens t0 .. t0 + T's activations in a, their sums zeroed. */
static inline __attribute__((always_inline)) void rp512_q5_begin(const struct quant_rp_job *j, int64_t t0, int T,
                                                                 const struct quant_rp_act **a,
                                                                 __m512 (*acc)[QUANT_Q5_LANES], __m512 *summs)
{
    for (int t = 0; t < T; t++) {
        a[t] = quant_rp_token(j, t0 + t);
        summs[t] = _mm512_setzero_ps();
        for (int c = 0; c < QUANT_Q5_LANES; c++)
            acc[t][c] = _mm512_setzero_ps();
    }
}

/* q5: a group-block's 16 rows against tokens t0 .. t0 + T (T <= RP5_TT): decode. */
static inline __attribute__((always_inline)) void rp512_q5_tile(const struct quant_rp_job *j, int64_t g, int64_t t0,
                                                                int T)
{
    const struct quant_rp_act *a[RP5_TT];
    __m512 acc[RP5_TT][QUANT_Q5_LANES], summs[RP5_TT];
    rp512_q5_begin(j, t0, T, a, acc, summs);
    rp512_q5_blocks(j, g, 0, j->nb, a, T, true, acc, summs);
    for (int t = 0; t < T; t++)
        rp512_q5_store(j, g, t0 + t, acc[t], summs[t]);
}

/* q5 batches of up to RP5_PAIRS_MAX tokens (several streams decoding, a
 * verification): RP5_CHUNK_BLOCKS blocks of a group at a time (in L1 after
 * the first pair), the tokens passing over them two by two as decode does,
 * their sums kept in memory between chunks. One thread from cache (Zen 4,
 * bench_matmul --hot, llama-1b's ffn_down, GB/s of weights times tokens,
 * medians of 3 interleaved, q5_0 / q5_1) against unpacking each chunk once
 * for all the tokens (rp512_q5_batch): 3 tokens 32 / 26 -> 39 / 39, 4 33 /
 * 23 -> 43 / 43, 8 33 / 32 -> 40 / 38, 12 36 / 34 -> 44 / 43, 16 37 / 35
 * -> 43 / 43; a pair alone reads 51 / 49. Prefill keeps the batch kernel:
 * gemma3-1b's q5_0 matrices at pp512 ran 5% slower two by two (1 thread). */
#define RP5_PAIRS_MAX 16
static void rp512_q5_pairs(const struct quant_rp_job *j, int64_t g, int64_t t0, int T)
{
    const struct quant_rp_act *a[RP5_PAIRS_MAX];
    __m512 acc[RP5_PAIRS_MAX][QUANT_Q5_LANES], summs[RP5_PAIRS_MAX];
    rp512_q5_begin(j, t0, T, a, acc, summs);
    for (int64_t b0 = 0; b0 < j->nb; b0 += RP5_CHUNK_BLOCKS) {
        const int64_t b1 = j->nb - b0 < RP5_CHUNK_BLOCKS ? j->nb : b0 + RP5_CHUNK_BLOCKS;
        for (int t = 0; t < T; t += RP5_TT) {
            const int n = T - t < RP5_TT ? T - t : RP5_TT;
            __m512 v[RP5_TT][QUANT_Q5_LANES], sm[RP5_TT];
            memcpy(v, acc[t], (size_t)n * sizeof v[0]);
            memcpy(sm, summs + t, (size_t)n * sizeof sm[0]);
            if (n == 1)
                rp512_q5_blocks(j, g, b0, b1, a + t, 1, t == 0, v, sm);
            else
                rp512_q5_blocks(j, g, b0, b1, a + t, 2, t == 0, v, sm);
            memcpy(acc[t], v, (size_t)n * sizeof v[0]);
            memcpy(summs + t, sm, (size_t)n * sizeof sm[0]);
        }
    }
    for (int t = 0; t < T; t++)
        rp512_q5_store(j, g, t0 + t, acc[t], summs[t]);
}

static void rp512_q5_tile_1(const struct quant_rp_job *j, int64_t g, int64_t t0) { rp512_q5_tile(j, g, t0, 1); }
static void rp512_q5_tile_2(const struct quant_rp_job *j, int64_t g, int64_t t0) { rp512_q5_tile(j, g, t0, 2); }

/* q5 batches: as rp2_q5_batch (a chunk of blocks unpacked once into L1,
 * RP5_BATCH_TOKENS tokens passing over it), two tokens at a time so each
 * unpacked vector is loaded once per pair. */
struct rp512_q5_block {
    __m512i u[QUANT_Q5_LANES]; /* lane c's 4 levels (unsigned) of each of the 16 rows */
    __m512 dw, m;
};

static inline void rp512_q5_unpack(const uint8_t *gb, enum quant_type t, struct rp512_q5_block *o)
{
    const int R = 16;
    const size_t qh_at = 2 * (size_t)rp_q5_f16s(t) * R, qs_at = (size_t)R * rp_scale_bytes(t);
    const __m512i bits = _mm512_loadu_si512(rp_q5_bits), qh = _mm512_loadu_si512(gb + qh_at);
    for (int k = 0; k < 4; k++)
        rp512_q5_levels(_mm512_loadu_si512(gb + qs_at + 64 * k), qh, k, bits, &o->u[k], &o->u[k + 4]);
    o->dw = vmath_load16_f16(gb);
    o->m = t == QUANT_Q5_1 ? vmath_load16_f16(gb + 2 * R) : _mm512_setzero_ps();
}

/* Tokens a[0..T) (T = 1 or 2) over nbk unpacked blocks, their accumulators in v. */
static inline __attribute__((always_inline)) void rp512_q5_pass(const struct rp512_q5_block *blk, int nbk,
                                                                const struct quant_rp_act *const *a, int T, bool q5_1,
                                                                __m512 v[2][QUANT_Q5_LANES], __m512 sm[2])
{
    for (int i = 0; i < nbk; i++) {
        __m512 dd[2];
        for (int t = 0; t < T; t++) {
            dd[t] = _mm512_mul_ps(blk[i].dw, _mm512_set1_ps(a[t][i].d));
            if (q5_1)
                sm[t] = _mm512_fmadd_ps(blk[i].m, _mm512_set1_ps(a[t][i].s), sm[t]);
        }
        for (int c = 0; c < QUANT_Q5_LANES; c++) {
            const __m512i u = blk[i].u[c];
            for (int t = 0; t < T; t++) {
                __m512i corr = q5_1 ? _mm512_setzero_si512() : _mm512_set1_epi32(a[t][i].lane_corr[c]);
                __m512i p = _mm512_dpbusd_epi32(corr, u, _mm512_set1_epi32(act_dword(&a[t][i], c)));
                v[t][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), dd[t], v[t][c]);
            }
        }
    }
}

static void rp512_q5_batch(const struct quant_rp_job *j, int64_t g)
{
    const int R = 16;
    const bool q5_1 = j->wtype == QUANT_Q5_1;
    const size_t gbb = (size_t)R * rp_block_bytes(j->wtype);
    struct rp512_q5_block blk[RP5_CHUNK_BLOCKS];
    __m512 acc[RP5_BATCH_TOKENS][QUANT_Q5_LANES], summs[RP5_BATCH_TOKENS];
    for (int64_t t0 = 0; t0 < j->n_tokens; t0 += RP5_BATCH_TOKENS) {
        const int T = (int)(j->n_tokens - t0 < RP5_BATCH_TOKENS ? j->n_tokens - t0 : RP5_BATCH_TOKENS);
        for (int t = 0; t < T; t++) {
            summs[t] = _mm512_setzero_ps();
            for (int c = 0; c < QUANT_Q5_LANES; c++)
                acc[t][c] = _mm512_setzero_ps();
        }
        for (int64_t b0 = 0; b0 < j->nb; b0 += RP5_CHUNK_BLOCKS) {
            const int nbk = (int)(j->nb - b0 < RP5_CHUNK_BLOCKS ? j->nb - b0 : RP5_CHUNK_BLOCKS);
            const uint8_t *gb = rp_group_block(j->W, j->wtype, j->nb, R, g, b0);
            for (int i = 0; i < nbk; i++)
                rp512_q5_unpack(gb + (size_t)i * gbb, j->wtype, &blk[i]);
            for (int t = 0; t < T; t += 2) {
                const int n = T - t < 2 ? 1 : 2;
                const struct quant_rp_act *a[2] = {quant_rp_token(j, t0 + t) + b0,
                                                   quant_rp_token(j, t0 + t + n - 1) + b0};
                __m512 v[2][QUANT_Q5_LANES], sm[2] = {summs[t], summs[t + n - 1]};
                for (int c = 0; c < QUANT_Q5_LANES; c++)
                    v[0][c] = acc[t][c], v[1][c] = acc[t + n - 1][c];
                if (n == 2)
                    rp512_q5_pass(blk, nbk, a, 2, q5_1, v, sm);
                else
                    rp512_q5_pass(blk, nbk, a, 1, q5_1, v, sm);
                for (int c = 0; c < QUANT_Q5_LANES; c++)
                    acc[t][c] = v[0][c], acc[t + n - 1][c] = n == 2 ? v[1][c] : v[0][c];
                summs[t] = sm[0], summs[t + n - 1] = n == 2 ? sm[1] : sm[0];
            }
        }
        for (int t = 0; t < T; t++) {
            const __m512 *v = acc[t];
            __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(v[0], v[4]), _mm512_add_ps(v[2], v[6])),
                                       _mm512_add_ps(_mm512_add_ps(v[1], v[5]), _mm512_add_ps(v[3], v[7])));
            _mm512_storeu_ps(j->Y + (t0 + t) * j->ldy + g * R, q5_1 ? _mm512_add_ps(sum, summs[t]) : sum);
        }
    }
}

void quant_rp_rows_avx512(const struct quant_rp_job *j, int64_t g0, int64_t g1)
{
    if (rp_is_q5(j->wtype)) {
        for (int64_t g = g0; g < g1; g++) {
            if (j->n_tokens > RP5_PAIRS_MAX) { /* prefill: the unpacking shared by the batch */
                rp512_q5_batch(j, g);
                continue;
            }
            if (j->n_tokens > RP5_TT) {
                rp512_q5_pairs(j, g, 0, (int)j->n_tokens);
                continue;
            }
            (j->n_tokens < RP5_TT ? rp512_q5_tile_1 : rp512_q5_tile_2)(j, g, 0);
        }
        return;
    }
    const rp_tile_fn *tiles = j->wtype == QUANT_Q4_0   ? rp512_q4_widths
                              : j->wtype == QUANT_Q8_0 ? rp512_q8_widths
                                                       : rp512_lut_widths;
    rp_rows(j, g0, g1, tiles, RP512_TT);
}
#endif

#if defined(QUANT_HAVE_AVX2)
/* ---- AVX2: 8 rows per lane set ---------------------------------------------- */

/* 4 bytes of each of 8 rows (unsigned) times the broadcast activation dword:
 * maddubs pairs are at most 2 * 15 * 127 for nibbles, and for Q8_0 the
 * |w| / sign(x, w) form keeps them at most 2 * 128 * 127, so int16 never saturates. */
static inline __m256i rp2_dot_q8(__m256i w, __m256i x)
{
    __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

/* The 8 rows' scales of a group-block as floats (rp512_scales). */
static inline __m256 rp2_scales(const uint8_t *gb, enum quant_type t)
{
    if (t != QUANT_MXFP4)
        return vmath_load8_f16(gb);
    __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)gb));
    __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, subnormal, small));
}

/* |w| (unsigned) times x with w's sign, 4 products per int32 lane: a pair is
 * at most 2 * 127 * 128 for int8 levels, so int16 never saturates. */
static inline __m256i rp2_dot_abs(__m256i abs_w, __m256i w, __m256i x)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(abs_w, _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1));
}

#define RP2_MXFP4_BIAS 12 /* the largest |level| of MXFP4 (quant_mxfp4_values) */
static inline __attribute__((always_inline)) void rp2_tile(const struct quant_rp_job *j, int64_t g, int64_t t0, int T)
{
    const bool once = quant_weights_read_once(j->n_tokens);
    const int R = 8;
    const size_t gbb = (size_t)R * rp_block_bytes(j->wtype), qs_at = (size_t)R * rp_scale_bytes(j->wtype);
    const bool lut = rp_is_lut(j->wtype);
    /* the levels of a lookup-table type, MXFP4's + RP2_MXFP4_BIAS (unsigned) */
    const __m256i levels =
        lut ? _mm256_add_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)rp_levels(j->wtype))),
                              _mm256_set1_epi8(j->wtype == QUANT_MXFP4 ? RP2_MXFP4_BIAS : 0))
            : _mm256_setzero_si256();
    const struct quant_rp_act *a[RP_TT];
    __m256 acc[RP_TT];
    for (int t = 0; t < T; t++) {
        a[t] = quant_rp_token(j, t0 + t);
        acc[t] = _mm256_setzero_ps();
    }
    const uint8_t *gb = rp_group_block(j->W, j->wtype, j->nb, R, g, 0);
    for (int64_t b = 0; b < j->nb; b++, gb += gbb) {
        quant_prefetch_weights(gb + RP_AHEAD, gbb, once);
        __m256i isum[RP_TT];
        if (j->wtype == QUANT_Q4_0) {
            /* A block's products are summed in int16 and widened once: each int16 lane sums 16 products
             * of a nibble (<= 15) and an activation (|x| <= 128), at most 30720 < 32767. */
            __m256i p16[RP_TT];
            for (int t = 0; t < T; t++)
                p16[t] = _mm256_setzero_si256();
            for (int k = 0; k < 4; k++) {
                __m256i raw = _mm256_loadu_si256((const __m256i *)(gb + qs_at + 32 * k));
                __m256i lo = _mm256_and_si256(raw, _mm256_set1_epi8(0x0f));
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0f));
                for (int t = 0; t < T; t++) {
                    p16[t] = _mm256_add_epi16(p16[t], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(act_dword(&a[t][b], k))));
                    p16[t] = _mm256_add_epi16(p16[t],
                                              _mm256_maddubs_epi16(hi, _mm256_set1_epi32(act_dword(&a[t][b], k + 4))));
                }
            }
            for (int t = 0; t < T; t++)
                isum[t] = _mm256_add_epi32(_mm256_set1_epi32(-8 * a[t][b].sum),
                                           _mm256_madd_epi16(p16[t], _mm256_set1_epi16(1)));
        } else if (j->wtype == QUANT_MXFP4) {
            /* MXFP4's levels are at most 12 in magnitude: as u = level + 12 (unsigned, <= 24) a token's
             * products sum in int16, one sum per nibble half (4 pairs of at most 2 * 24 * 128: 24576), and
             * isum = sum(u * x) - 12 * sum(x): no sign or abs per product, as Q4_0's -8. */
            __m256i plo[RP_TT], phi[RP_TT];
            for (int t = 0; t < T; t++)
                plo[t] = phi[t] = _mm256_setzero_si256();
            for (int k = 0; k < 4; k++) {
                __m256i raw = _mm256_loadu_si256((const __m256i *)(gb + qs_at + 32 * k));
                __m256i lo = _mm256_shuffle_epi8(levels, _mm256_and_si256(raw, _mm256_set1_epi8(0x0f)));
                __m256i hi = _mm256_shuffle_epi8(levels,
                                                 _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0f)));
                for (int t = 0; t < T; t++) {
                    plo[t] = _mm256_add_epi16(plo[t], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(act_dword(&a[t][b], k))));
                    phi[t] = _mm256_add_epi16(phi[t],
                                              _mm256_maddubs_epi16(hi, _mm256_set1_epi32(act_dword(&a[t][b], k + 4))));
                }
            }
            const __m256i ones = _mm256_set1_epi16(1);
            for (int t = 0; t < T; t++)
                isum[t] = _mm256_add_epi32(_mm256_set1_epi32(-RP2_MXFP4_BIAS * a[t][b].sum),
                                           _mm256_add_epi32(_mm256_madd_epi16(plo[t], ones), _mm256_madd_epi16(phi[t], ones)));
        } else if (lut) { /* IQ4_NL */
            for (int t = 0; t < T; t++)
                isum[t] = _mm256_setzero_si256();
            for (int k = 0; k < 4; k++) {
                __m256i raw = _mm256_loadu_si256((const __m256i *)(gb + qs_at + 32 * k));
                __m256i lo = _mm256_shuffle_epi8(levels, _mm256_and_si256(raw, _mm256_set1_epi8(0x0f)));
                __m256i hi = _mm256_shuffle_epi8(levels,
                                                 _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0f)));
                __m256i abs_lo = _mm256_abs_epi8(lo), abs_hi = _mm256_abs_epi8(hi);
                for (int t = 0; t < T; t++) {
                    __m256i plo = rp2_dot_abs(abs_lo, lo, _mm256_set1_epi32(act_dword(&a[t][b], k)));
                    __m256i phi = rp2_dot_abs(abs_hi, hi, _mm256_set1_epi32(act_dword(&a[t][b], k + 4)));
                    isum[t] = _mm256_add_epi32(isum[t], _mm256_add_epi32(plo, phi));
                }
            }
        } else {
            for (int t = 0; t < T; t++)
                isum[t] = _mm256_setzero_si256();
            for (int k = 0; k < 8; k++) {
                __m256i w = _mm256_loadu_si256((const __m256i *)(gb + qs_at + 32 * k));
                for (int t = 0; t < T; t++)
                    isum[t] = _mm256_add_epi32(isum[t], rp2_dot_q8(w, _mm256_set1_epi32(act_dword(&a[t][b], k))));
            }
        }
        __m256 dw = rp2_scales(gb, j->wtype);
        for (int t = 0; t < T; t++)
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_mul_ps(dw, _mm256_set1_ps(a[t][b].d)), acc[t]);
    }
    for (int t = 0; t < T; t++)
        _mm256_storeu_ps(j->Y + (t0 + t) * j->ldy + g * R, acc[t]);
}

RP_TILE_WIDTHS(rp2_tile)

/* q5: lane c's fifth bits of 8 rows (qh in lane order) at bit 4 of their bytes. */
static inline __m256i rp2_q5_bits(__m256i qh, int c)
{
    const __m256i at = c < 4 ? _mm256_slli_epi32(qh, 4 - c) : c > 4 ? _mm256_srli_epi32(qh, c - 4) : qh;
    return _mm256_and_si256(at, _mm256_set1_epi8(0x10));
}

/* q5: the unsigned levels (nibble | fifth bit << 4) of lanes k and k + 4 of
 * 8 rows, from chunk k's bytes (raw) and the rows' qh in lane order. */
static inline void rp2_q5_levels(__m256i raw, __m256i qh, int k, __m256i *u_lo, __m256i *u_hi)
{
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    *u_lo = _mm256_or_si256(_mm256_and_si256(raw, low4), rp2_q5_bits(qh, k));
    *u_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low4), rp2_q5_bits(qh, k + 4));
}

/* q5: acc plus lane c's exact sums of 8 rows' unsigned levels (u) times the
 * broadcast activation dword (x): one vpdpbusd where the CPU has AVX-VNNI
 * (e.g. Alder Lake without AVX-512), else maddubs pairs (at most 2 * 31 * 127:
 * int16 never saturates) widened by madd. */
static inline __m256i rp2_q5_dot(__m256i acc, __m256i u, __m256i x)
{
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, x);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
#endif
}

/* q5: a group-block's 8 rows against one token, in llama.cpp's lane order
 * (8 lane accumulators fill half the ymm registers: one token per pass). */
static void rp2_q5_tile(const struct quant_rp_job *j, int64_t g, int64_t t0)
{
    const bool once = quant_weights_read_once(j->n_tokens);
    const int R = 8;
    const bool q5_1 = j->wtype == QUANT_Q5_1;
    const size_t gbb = (size_t)R * rp_block_bytes(j->wtype), qh_at = 2 * (size_t)rp_q5_f16s(j->wtype) * R,
                 qs_at = (size_t)R * rp_scale_bytes(j->wtype);
    const struct quant_rp_act *a = quant_rp_token(j, t0);
    __m256 acc[QUANT_Q5_LANES], summs = _mm256_setzero_ps();
    for (int c = 0; c < QUANT_Q5_LANES; c++)
        acc[c] = _mm256_setzero_ps();
    const uint8_t *gb = rp_group_block(j->W, j->wtype, j->nb, R, g, 0);
    for (int64_t b = 0; b < j->nb; b++, gb += gbb) {
        quant_prefetch_weights(gb + RP_AHEAD, gbb, once);
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(gb + qh_at));
        const __m256 dd = _mm256_mul_ps(vmath_load8_f16(gb), _mm256_set1_ps(a[b].d));
        if (q5_1)
            summs = _mm256_fmadd_ps(vmath_load8_f16(gb + 2 * R), _mm256_set1_ps(a[b].s), summs);
        for (int k = 0; k < 4; k++) {
            __m256i u_lo, u_hi;
            rp2_q5_levels(_mm256_loadu_si256((const __m256i *)(gb + qs_at + 32 * k)), qh, k, &u_lo, &u_hi);
            const __m256i lo = rp2_q5_dot(_mm256_set1_epi32(a[b].lane_corr[k]), u_lo,
                                          _mm256_set1_epi32(act_dword(&a[b], k)));
            const __m256i hi = rp2_q5_dot(_mm256_set1_epi32(a[b].lane_corr[k + 4]), u_hi,
                                          _mm256_set1_epi32(act_dword(&a[b], k + 4)));
            acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), dd, acc[k]);
            acc[k + 4] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), dd, acc[k + 4]);
        }
    }
    __m256 sum = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6])),
                               _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7])));
    _mm256_storeu_ps(j->Y + t0 * j->ldy + g * R, q5_1 ? _mm256_add_ps(sum, summs) : sum);
}

/* q5 batches: a chunk of a group's blocks is unpacked once into L1 (levels
 * per lane, scales) and RP5_BATCH_TOKENS tokens pass over it one by one,
 * each with its 8 lane accumulators in registers: the unpacking, most of a
 * one-token pass's work, is shared by the batch. The same operations per
 * token and block as rp2_q5_tile, in the same order: the same bits. */
struct rp2_q5_block {
    __m256i u[QUANT_Q5_LANES]; /* lane c's 4 levels (unsigned) of each of the 8 rows */
    __m256 dw, m;              /* the rows' d and (q5_1) m */
};

static inline void rp2_q5_unpack(const uint8_t *gb, enum quant_type t, struct rp2_q5_block *o)
{
    const int R = 8;
    const size_t qh_at = 2 * (size_t)rp_q5_f16s(t) * R, qs_at = (size_t)R * rp_scale_bytes(t);
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(gb + qh_at));
    for (int k = 0; k < 4; k++)
        rp2_q5_levels(_mm256_loadu_si256((const __m256i *)(gb + qs_at + 32 * k)), qh, k, &o->u[k], &o->u[k + 4]);
    o->dw = vmath_load8_f16(gb);
    o->m = t == QUANT_Q5_1 ? vmath_load8_f16(gb + 2 * R) : _mm256_setzero_ps();
}

static void rp2_q5_batch(const struct quant_rp_job *j, int64_t g)
{
    const int R = 8;
    const bool q5_1 = j->wtype == QUANT_Q5_1;
    const size_t gbb = (size_t)R * rp_block_bytes(j->wtype);
    struct rp2_q5_block blk[RP5_CHUNK_BLOCKS];
    __m256 acc[RP5_BATCH_TOKENS][QUANT_Q5_LANES], summs[RP5_BATCH_TOKENS];
    for (int64_t t0 = 0; t0 < j->n_tokens; t0 += RP5_BATCH_TOKENS) {
        const int T = (int)(j->n_tokens - t0 < RP5_BATCH_TOKENS ? j->n_tokens - t0 : RP5_BATCH_TOKENS);
        for (int t = 0; t < T; t++) {
            summs[t] = _mm256_setzero_ps();
            for (int c = 0; c < QUANT_Q5_LANES; c++)
                acc[t][c] = _mm256_setzero_ps();
        }
        for (int64_t b0 = 0; b0 < j->nb; b0 += RP5_CHUNK_BLOCKS) {
            const int nbk = (int)(j->nb - b0 < RP5_CHUNK_BLOCKS ? j->nb - b0 : RP5_CHUNK_BLOCKS);
            const uint8_t *gb = rp_group_block(j->W, j->wtype, j->nb, R, g, b0);
            for (int i = 0; i < nbk; i++)
                rp2_q5_unpack(gb + (size_t)i * gbb, j->wtype, &blk[i]);
            for (int t = 0; t < T; t++) {
                const struct quant_rp_act *a = quant_rp_token(j, t0 + t) + b0;
                __m256 v[QUANT_Q5_LANES], sm = summs[t];
                for (int c = 0; c < QUANT_Q5_LANES; c++)
                    v[c] = acc[t][c];
                for (int i = 0; i < nbk; i++) {
                    const __m256 dd = _mm256_mul_ps(blk[i].dw, _mm256_set1_ps(a[i].d));
                    if (q5_1)
                        sm = _mm256_fmadd_ps(blk[i].m, _mm256_set1_ps(a[i].s), sm);
                    for (int c = 0; c < QUANT_Q5_LANES; c++) {
                        /* q5_1's levels are unsigned already: no correction */
                        const __m256i corr = q5_1 ? _mm256_setzero_si256() : _mm256_set1_epi32(a[i].lane_corr[c]);
                        const __m256i p = rp2_q5_dot(corr, blk[i].u[c], _mm256_set1_epi32(act_dword(&a[i], c)));
                        v[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), dd, v[c]);
                    }
                }
                for (int c = 0; c < QUANT_Q5_LANES; c++)
                    acc[t][c] = v[c];
                summs[t] = sm;
            }
        }
        for (int t = 0; t < T; t++) {
            const __m256 *v = acc[t];
            __m256 sum = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(v[0], v[4]), _mm256_add_ps(v[2], v[6])),
                                       _mm256_add_ps(_mm256_add_ps(v[1], v[5]), _mm256_add_ps(v[3], v[7])));
            _mm256_storeu_ps(j->Y + (t0 + t) * j->ldy + g * R, q5_1 ? _mm256_add_ps(sum, summs[t]) : sum);
        }
    }
}

void quant_rp_rows_avx2(const struct quant_rp_job *j, int64_t g0, int64_t g1)
{
    if (rp_is_q5(j->wtype)) {
        for (int64_t g = g0; g < g1; g++) {
            if (j->n_tokens > 1) {
                rp2_q5_batch(j, g);
                continue;
            }
            rp2_q5_tile(j, g, 0);
        }
        return;
    }
    rp_rows(j, g0, g1, rp2_tile_widths, RP_TT);
}
#endif

void quant_rp_rows(const struct quant_rp_job *j, int64_t g0, int64_t g1)
{
#if defined(QUANT_HAVE_AVX512)
    quant_rp_rows_avx512(j, g0, g1);
#elif defined(QUANT_HAVE_AVX2)
    /* an AVX2 build stores 8-row groups; AVX-512 code is never compiled in */
    quant_rp_rows_avx2(j, g0, g1);
#else
    quant_rp_rows_ref(j, QUANT_RP_ROWS, QUANT_RP_Q8_BIAS, g0, g1);
#endif
}
