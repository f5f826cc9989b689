/* k-quants: Q2_K to Q6_K (and IQ4_XS) weights repacked at load time into row groups
 * (the layout is in kq_internal.h), the row lookup, the prefill panels read
 * out of the layout, and the scalar twin of the group kernels
 * (kq_repack_avx512.c, kq_repack_avx2.c).
 *
 * The twin takes each row's super-block back out of its group-block, adds
 * up the exact integer sums the scalar reference does (kq_scalar.c) and
 * applies the reference's float steps in its order (this file is compiled
 * without FMA contraction): the reference vec_dot's bits. */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>

#include "quant/iq4_mxfp4.h"
#include "quant/kq_internal.h"

/* What this build repacks: the types whose group kernels beat the row-major
 * ones. With AVX-512 or AVX2, Q4_K, Q5_K and Q6_K (decode, AVX-512: 2.4x,
 * 1.8x, 1.3x the row vec_dot; AVX2: 2.0x, 1.5x, 1.1x, and Q6_K's about
 * 1.25x faster again in its own layout, kq_internal.h), Q2_K and Q3_K (one
 * thread from cache, Zen 4: AVX-512 2.8x, 1.7x; AVX2 2.2x, 1.2x) and IQ4_XS
 * (llama-1b's ffn_down: AVX-512 2.6x the row kernel's GB/s for one token,
 * 3-4x for 2-4, 1.3x from 8, prefill 1.4x; AVX2 1.4x, 1.6x for 3, ~1x for
 * 4-16, prefill 1.1x); the scalar twin reads
 * the layout slower than the row-major scalar reference reads rows, so a
 * portable build repacks no k-quant. */
bool quant_kqrp_type(enum quant_type t)
{
#if defined(KQRP_HAVE_AVX2)
    return t == QUANT_Q2_K || t == QUANT_Q3_K || t == QUANT_Q4_K || t == QUANT_Q5_K || t == QUANT_Q6_K ||
           t == QUANT_IQ4_XS;
#else
    (void)t;
    return false;
#endif
}

/* A super-block as the layout splits it: f16 fields before and after the dwords. */
struct kqrp_fields {
    int head_f16, dwords, tail_f16;
};

static struct kqrp_fields kqrp_fields(enum quant_type t)
{
    switch (t) {
    case QUANT_Q4_K: return (struct kqrp_fields){2, (K_SCALE_SIZE + QK_K / 2) / 4, 0};
    case QUANT_Q5_K: return (struct kqrp_fields){2, (K_SCALE_SIZE + QK_K / 8 + QK_K / 2) / 4, 0};
    case QUANT_Q2_K: return (struct kqrp_fields){0, (QK_K / 16 + QK_K / 4) / 4, 2};
    case QUANT_Q3_K: return (struct kqrp_fields){0, (QK_K / 8 + QK_K / 4 + 12) / 4, 1};
    case QUANT_IQ4_XS: return (struct kqrp_fields){2, (QK_K / 64 + QK_K / 2) / 4, 0};
    default: return (struct kqrp_fields){0, (QK_K / 2 + QK_K / 4 + QK_K / 16) / 4, 1}; /* Q6_K */
    }
}

/* Where row l's bytes [o, o + *unit) of its super-block lie in a group-block
 * of R rows; *unit is the width of the field at o (2: an f16, 4: a dword). */
static size_t kqrp_pos(struct kqrp_fields f, int R, int l, size_t o, size_t *unit)
{
    const size_t head = 2 * (size_t)f.head_f16, body = head + 4 * (size_t)f.dwords;
    if (o < head) {
        *unit = 2;
        return (o / 2) * 2 * (size_t)R + 2 * (size_t)l;
    }
    if (o < body) {
        *unit = 4;
        return head * (size_t)R + (o - head) / 4 * 4 * (size_t)R + 4 * (size_t)l;
    }
    *unit = 2;
    return body * (size_t)R + ((o - body) / 2) * 2 * (size_t)R + 2 * (size_t)l;
}

/* A Q6_K super-block's quants as u = q + 32, in element order (ggml's packing). */
static void q6k_levels(const block_q6_K *x, uint8_t u[QK_K])
{
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++) {
            const uint8_t la = x->ql[64 * h + l], lb = x->ql[64 * h + 32 + l], qh = x->qh[32 * h + l];
            u[128 * h + l] = (uint8_t)((la & 0xF) | (qh & 3) << 4);
            u[128 * h + 32 + l] = (uint8_t)((lb & 0xF) | ((qh >> 2) & 3) << 4);
            u[128 * h + 64 + l] = (uint8_t)((la >> 4) | ((qh >> 4) & 3) << 4);
            u[128 * h + 96 + l] = (uint8_t)((lb >> 4) | ((qh >> 6) & 3) << 4);
        }
}

/* A group's Q6_K row (kq_internal.h): 16 units n of three packed dwords
 * holding four levels each, joined (AVX2's groups of 8: W(c, q, k), n = 2c
 * + k, dwords 3n.., scales after them, reordered) or in element order (n =
 * 8h + c, elements 128h + 32q + 4c + i, dwords 4 + 3n.., scales first). */
static int q6k_unit_elem(bool joined, int n, int q, int i)
{
    return joined ? kqrp_q6k_w_elem(n / 2, q, n % 2, i) : 128 * (n / 8) + 32 * q + 4 * (n % 8) + i;
}
static int q6k_unit_dword(bool joined, int n) { return joined ? 3 * n : 4 + 3 * n; }
static int q6k_scale_byte(bool joined, int s) { return joined ? 4 * 48 + kqrp_q6k_scale_at(s) : s; }

/* x's quants and scales into a group's row q[0..208) (d is not touched). */
static void q6k_pack(const block_q6_K *x, bool joined, uint8_t q[QK_K / 2 + QK_K / 4 + QK_K / 16])
{
    uint8_t u[QK_K];
    q6k_levels(x, u);
    for (int n = 0; n < 16; n++)
        for (int i = 0; i < 4; i++) {
            const uint8_t top = u[q6k_unit_elem(joined, n, 3, i)];
            for (int j = 0; j < 3; j++)
                q[4 * (q6k_unit_dword(joined, n) + j) + i] = (uint8_t)(u[q6k_unit_elem(joined, n, j, i)] | ((top >> (2 * j)) & 3) << 6);
        }
    for (int sb = 0; sb < QK_K / 16; sb++)
        q[q6k_scale_byte(joined, sb)] = (uint8_t)x->scales[sb];
}

/* The inverse: a group's row q back into x's ql, qh and scales. */
static void q6k_unpack(const uint8_t q[QK_K / 2 + QK_K / 4 + QK_K / 16], bool joined, block_q6_K *x)
{
    uint8_t u[QK_K];
    for (int n = 0; n < 16; n++)
        for (int i = 0; i < 4; i++) {
            uint8_t top = 0;
            for (int j = 0; j < 3; j++) {
                const uint8_t v = q[4 * (q6k_unit_dword(joined, n) + j) + i];
                u[q6k_unit_elem(joined, n, j, i)] = v & 0x3F;
                top |= (uint8_t)((v >> 6) << (2 * j));
            }
            u[q6k_unit_elem(joined, n, 3, i)] = top;
        }
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++) {
            const uint8_t *v = u + 128 * h + l;
            x->ql[64 * h + l] = (uint8_t)((v[0] & 0xF) | (v[64] & 0xF) << 4);
            x->ql[64 * h + 32 + l] = (uint8_t)((v[32] & 0xF) | (v[96] & 0xF) << 4);
            x->qh[32 * h + l] = (uint8_t)(v[0] >> 4 | (v[32] >> 4) << 2 | (v[64] >> 4) << 4 | (v[96] >> 4) << 6);
        }
    for (int sb = 0; sb < QK_K / 16; sb++)
        x->scales[sb] = (int8_t)q[q6k_scale_byte(joined, sb)];
}

/* A Q5_K super-block's levels (q, 0..31) in element order (ggml's qs/qh packing), and back. */
static void q5k_levels(const block_q5_K *x, uint8_t u[QK_K])
{
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 32; l++) {
            const uint8_t q = x->qs[32 * j + l], h = x->qh[l];
            u[64 * j + l] = (uint8_t)((q & 0xF) | ((h >> (2 * j)) & 1) << 4);
            u[64 * j + 32 + l] = (uint8_t)((q >> 4) | ((h >> (2 * j + 1)) & 1) << 4);
        }
}

static void q5k_from_levels(const uint8_t u[QK_K], block_q5_K *x)
{
    memset(x->qh, 0, sizeof x->qh);
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 32; l++) {
            const uint8_t lo = u[64 * j + l], hi = u[64 * j + 32 + l];
            x->qs[32 * j + l] = (uint8_t)((lo & 0xF) | (hi & 0xF) << 4);
            x->qh[l] |= (uint8_t)((lo >> 4) << (2 * j) | (hi >> 4) << (2 * j + 1));
        }
}

/* Lane c's five dwords D0..D4 from its level dwords U0..U7 (kq_internal.h),
 * four bytes at a time: levels are below 32, so no masked field crosses a
 * byte. And back. */
#define BYTES4(v) (0x01010101u * (v))
static void q5k_pack_dwords(const uint32_t U[8], uint32_t D[5])
{
    D[0] = U[0] | (U[5] & BYTES4(7)) << 5;
    D[1] = U[1] | (U[5] >> 3 & BYTES4(3)) << 5 | (U[6] >> 3 & BYTES4(1)) << 7;
    D[2] = U[2] | (U[6] & BYTES4(7)) << 5;
    D[3] = U[3] | (U[7] & BYTES4(7)) << 5;
    D[4] = U[4] | (U[7] >> 3 & BYTES4(3)) << 5 | (U[6] >> 4 & BYTES4(1)) << 7;
}

static void q5k_unpack_dwords(const uint32_t D[5], uint32_t U[8])
{
    for (int n = 0; n < 5; n++)
        U[n] = D[n] & BYTES4(0x1F);
    U[5] = (D[0] >> 5 & BYTES4(7)) | (D[1] >> 5 & BYTES4(3)) << 3;
    U[6] = (D[2] >> 5 & BYTES4(7)) | (D[1] >> 7 & BYTES4(1)) << 3 | (D[4] >> 7 & BYTES4(1)) << 4;
    U[7] = (D[3] >> 5 & BYTES4(7)) | (D[4] >> 5 & BYTES4(3)) << 3;
}
#undef BYTES4

/* x's qh and qs as a group of R's 40 packed dwords q (lane c's Dj at dword
 * 5c + j), through the levels in level-dword order: at 32n + 4c, the 4
 * bytes of Un of lane c. */
static void q5k_pack(const block_q5_K *x, int R, uint8_t q[QK_K / 8 + QK_K / 2])
{
    uint8_t u[QK_K], paired[QK_K];
    q5k_levels(x, u);
    const uint8_t *U = u; /* sub-block n's elements 4c + i are already there */
    if (kqrp_q5k_paired(R)) {
        for (int n = 0; n < 8; n++)
            for (int c = 0; c < 8; c++)
                for (int i = 0; i < 4; i++)
                    paired[32 * n + 4 * c + i] = u[kqrp_q5k_elem(R, c, n, i)];
        U = paired;
    }
    for (int c = 0; c < 8; c++) {
        uint32_t Un[8], D[5];
        for (int n = 0; n < 8; n++)
            memcpy(&Un[n], U + 32 * n + 4 * c, 4);
        q5k_pack_dwords(Un, D);
        memcpy(q + 4 * 5 * c, D, sizeof D);
    }
}

/* The inverse: packed dwords q back into x's qh and qs. */
static void q5k_unpack(const uint8_t q[QK_K / 8 + QK_K / 2], int R, block_q5_K *x)
{
    uint8_t U[QK_K], u[QK_K];
    for (int c = 0; c < 8; c++) {
        uint32_t Un[8], D[5];
        memcpy(D, q + 4 * 5 * c, sizeof D);
        q5k_unpack_dwords(D, Un);
        for (int n = 0; n < 8; n++)
            memcpy(U + 32 * n + 4 * c, &Un[n], 4);
    }
    for (int n = 0; n < 8; n++)
        for (int c = 0; c < 8; c++)
            for (int i = 0; i < 4; i++)
                u[kqrp_q5k_elem(R, c, n, i)] = U[32 * n + 4 * c + i];
    q5k_from_levels(u, x);
}

/* Row l's super-block between blk (ggml's layout) and its group-block gb. */
static void kqrp_move(enum quant_type t, int R, int l, uint8_t *gb, uint8_t *blk, bool to_group)
{
    const struct kqrp_fields f = kqrp_fields(t);
    const size_t bb = quant_row_size(t, QK_K);
    _Alignas(4) uint8_t reordered[sizeof(block_q6_K)];
    uint8_t *src = blk;
    if (t == QUANT_Q6_K && R > 1) { /* ql, qh and scales packed level by level */
        if (to_group) {
            memcpy(reordered, blk, bb);
            q6k_pack((const block_q6_K *)(const void *)blk, kqrp_q6k_joined(t, R), reordered);
        }
        src = reordered;
    } else if (t == QUANT_Q5_K && R > 1) { /* qh and qs packed level by level */
        if (to_group) {
            memcpy(reordered, blk, bb);
            q5k_pack((const block_q5_K *)(const void *)blk, R, reordered + offsetof(block_q5_K, qh));
        }
        src = reordered;
    }
    size_t unit;
    for (size_t o = 0; o < bb; o += unit) {
        const size_t p = kqrp_pos(f, R, l, o, &unit);
        if (to_group)
            memcpy(gb + p, src + o, unit);
        else
            memcpy(src + o, gb + p, unit);
    }
    if (!to_group && src == reordered) {
        memcpy(blk, reordered, bb);
        if (t == QUANT_Q6_K)
            q6k_unpack(reordered, kqrp_q6k_joined(t, R), (block_q6_K *)(void *)blk);
        else
            q5k_unpack(reordered + offsetof(block_q5_K, qh), R, (block_q5_K *)(void *)blk);
    }
}

/* Group-block (g, b) of a matrix of cols columns in groups of R rows. */
static uint8_t *kqrp_group_block(const void *W, enum quant_type t, int R, int64_t cols, int64_t g, int64_t b)
{
    const size_t wrow = quant_row_size(t, cols), bb = quant_row_size(t, QK_K);
    return (uint8_t *)W + (size_t)g * (size_t)R * wrow + (size_t)b * (size_t)R * bb;
}

ks_status quant_kqrp_repack_as(enum quant_type t, int64_t rows, int64_t cols, void *W, int R)
{
    const size_t wrow = quant_row_size(t, cols), bb = quant_row_size(t, QK_K);
    uint8_t *rowmajor = malloc((size_t)R * wrow);
    if (!rowmajor)
        return ks_fail(KS_ERR_NOMEM, "repack: out of memory for %d rows of %zu bytes", R, wrow);
    for (int64_t g = 0; g < rows / R; g++) { /* the group's rows become its group-blocks in place */
        memcpy(rowmajor, (uint8_t *)W + (size_t)g * (size_t)R * wrow, (size_t)R * wrow);
        for (int64_t b = 0; b < cols / QK_K; b++)
            for (int l = 0; l < R; l++)
                kqrp_move(t, R, l, kqrp_group_block(W, t, R, cols, g, b), rowmajor + (size_t)l * wrow + (size_t)b * bb,
                          true);
    }
    free(rowmajor);
    return KS_OK;
}

void quant_kqrp_get_block(const void *W, enum quant_type t, int R, int64_t cols, int64_t r, int64_t b, void *out)
{
    kqrp_move(t, R, (int)(r % R), kqrp_group_block(W, t, R, cols, r / R, b), out, false);
}

/* The largest of the three super-blocks. */
#define KQRP_MAX_BLOCK sizeof(block_q6_K)
_Static_assert(sizeof(block_q6_K) >= sizeof(block_q5_K) && sizeof(block_q5_K) >= sizeof(block_q4_K),
               "block_q6_K is the largest repacked super-block");

void quant_kqrp_get_row(const void *W, enum quant_type t, int64_t rows, int64_t cols, int64_t r, float *y)
{
    const quant_to_float_fn to_float = quant_traits_scalar(t)->to_float;
    const int R = QUANT_RP_ROWS;
    if (r >= rows / R * R) { /* a row-major tail row */
        to_float((const uint8_t *)W + (size_t)r * quant_row_size(t, cols), y, cols);
        return;
    }
    _Alignas(4) uint8_t blk[KQRP_MAX_BLOCK];
    for (int64_t b = 0; b < cols / QK_K; b++) {
        quant_kqrp_get_block(W, t, R, cols, r, b, blk);
        to_float(blk, y + b * QK_K, QK_K);
    }
}

/* Row r (inside the groups) into lane `lane` of a panel, block by block. */
static void kqrp_unpack_row(enum quant_type t, const uint8_t *W, int64_t cols, int64_t r, uint8_t *panel, int lane)
{
    _Alignas(4) uint8_t blk[KQRP_MAX_BLOCK];
    for (int64_t b = 0; b < cols / QK_K; b++) {
        quant_kqrp_get_block(W, t, QUANT_RP_ROWS, cols, r, b, blk);
        quant_kq_unpack_lane(t, blk, lane, panel + b * KQ_PB_BYTES);
    }
}

void quant_kqrp_unpack_panel(enum quant_type t, const uint8_t *W, int64_t rows, int64_t cols, int64_t r0, int nr,
                             uint8_t *panel)
{
    const int64_t grouped = rows / QUANT_RP_ROWS * QUANT_RP_ROWS;
    const size_t wrow = quant_row_size(t, cols);
    if (nr < KQ_PANEL_ROWS) /* rows past nr: zero quants, scales and d */
        memset(panel, 0, quant_kq_panel_bytes(cols));
    for (int i = 0; i < nr;) {
        const int64_t r = r0 + i;
#if defined(KQRP_HAVE_AVX2)
        if (r % 8 == 0 && i + 8 <= nr && r + 8 <= grouped &&
            quant_kqrp_unpack8_avx2(t, W, QUANT_RP_ROWS, cols, r, panel, i)) {
            i += 8;
            continue;
        }
#endif
        if (r < grouped)
            kqrp_unpack_row(t, W, cols, r, panel, i);
        else /* a row-major tail row */
            quant_kq_unpack_panel_row(t, W + (size_t)r * wrow, cols, panel, i);
        i++;
    }
}

/* ---- the scalar twin: any group size ---------------------------------------- */

static float kqrp_lanes_hsum(const float a[8])
{
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* Row l of group g against token y, super-block by super-block. */
static float kqrp_row_dot(const struct quant_kq_gemm *g, int R, int64_t grp, int l, const block_q8_K *y)
{
    const enum quant_type t = g->wtype;
    float acc = 0, accm = 0, lanes[8] = {0}, summs = 0;
    _Alignas(4) uint8_t blk[KQRP_MAX_BLOCK];
    for (int64_t b = 0; b < g->cols / QK_K; b++) {
        quant_kqrp_get_block(g->W, t, R, g->cols, grp * R + l, b, blk);
        int32_t isum, msum, lane[8];
        if (t == QUANT_Q4_K) {
            const block_q4_K *x = (const block_q4_K *)(const void *)blk;
            quant_kq_q4_K_sums(x, &y[b], &isum, &msum);
            kq_chains_add(&acc, &accm, isum, msum, x->d, x->dmin, y[b].d);
            continue;
        }
        if (t == QUANT_Q2_K) {
            const block_q2_K *x = (const block_q2_K *)(const void *)blk;
            quant_kq_q2_K_sums(x, &y[b], &isum, &msum);
            kq_chains_add(&acc, &accm, isum, msum, x->d, x->dmin, y[b].d);
            continue;
        }
        float d;
        if (t == QUANT_IQ4_XS) {
            const block_iq4_xs *x = (const block_iq4_xs *)(const void *)blk;
            quant_iq4_xs_lanes(x, &y[b], lane);
            d = kq_f16_to_f32(x->d);
        } else if (t == QUANT_Q3_K) {
            const block_q3_K *x = (const block_q3_K *)(const void *)blk;
            quant_kq_q3_K_lanes(x, &y[b], lane);
            d = kq_f16_to_f32(x->d);
        } else if (t == QUANT_Q6_K) {
            const block_q6_K *x = (const block_q6_K *)(const void *)blk;
            quant_kq_q6_K_lanes(x, &y[b], lane);
            d = kq_f16_to_f32(x->d);
        } else {
            const block_q5_K *x = (const block_q5_K *)(const void *)blk;
            quant_kq_q5_K_lanes(x, &y[b], lane, &msum);
            d = kq_f16_to_f32(x->d);
            summs = fmaf(-y[b].d * kq_f16_to_f32(x->dmin), (float)msum, summs);
        }
        for (int c = 0; c < 8; c++)
            lanes[c] = fmaf(y[b].d * d, (float)lane[c], lanes[c]);
    }
    if (t == QUANT_Q4_K || t == QUANT_Q2_K)
        return acc - accm;
    return t == QUANT_Q5_K ? kqrp_lanes_hsum(lanes) + summs : kqrp_lanes_hsum(lanes);
}

void quant_kqrp_rows_ref(const struct quant_kq_gemm *g, int R, int64_t g0, int64_t g1)
{
    for (int64_t grp = g0; grp < g1; grp++)
        for (int64_t t = 0; t < g->n_tokens; t++) {
            const block_q8_K *y = (const block_q8_K *)(g->X + (g->xi ? g->xi[t] : t) * g->xrow);
            for (int l = 0; l < R; l++)
                g->Y[t * g->ldy + grp * R + l] = kqrp_row_dot(g, R, grp, l, y);
        }
}

void quant_kqrp_tail_rows(const struct quant_kq_gemm *g, int64_t rows)
{
    const quant_vec_dot_fn dot = quant_traits(g->wtype)->vec_dot;
    for (int64_t r = rows / QUANT_RP_ROWS * QUANT_RP_ROWS; r < rows; r++)
        for (int64_t t = 0; t < g->n_tokens; t++)
            dot((int)g->cols, &g->Y[t * g->ldy + r], g->W + (size_t)r * g->wrow, g->X + (g->xi ? g->xi[t] : t) * g->xrow);
}

void quant_kqrp_rows(const struct quant_kq_gemm *g, int64_t g0, int64_t g1)
{
#if defined(KQRP_HAVE_AVX512)
    quant_kqrp_rows_avx512(g, g0, g1);
#elif defined(KQRP_HAVE_AVX2)
    quant_kqrp_rows_avx2(g, g0, g1);
#else
    quant_kqrp_rows_ref(g, QUANT_RP_ROWS, g0, g1);
#endif
}
