/* k-quants: the prefill GEMM's panel layout (see kq_internal.h), the unpacking
 * of weight rows into it, the driver over row ranges, and the scalar twin of
 * the SIMD tiles (kq_gemm_avx2.c, kq_gemm_avx512.c).
 *
 * Compiled without FMA contraction: the twin must round each product and
 * sum as the scalar reference vec_dot (kq_scalar.c) does. */
#include <math.h>
#include <stdlib.h>

#include "quant/kq_internal.h"

/* One row's super-block in the form the panel stores. */
struct kq_row_block {
    uint8_t u[QK_K];    /* quants, unsigned, element order */
    int32_t sc[16];     /* per sub-block */
    int16_t pair[8][2]; /* weights of bsums 2i and 2i + 1 */
    float d, dmin;
};

static void unpack_q2_K(const void *vb, struct kq_row_block *o)
{
    const block_q2_K *b = vb;
    for (int half = 0; half < 2; half++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++)
                o->u[128 * half + 32 * s + l] = (b->qs[32 * half + l] >> (2 * s)) & 3;
    for (int g = 0; g < 16; g++)
        o->sc[g] = b->scales[g] & 0xF;
    for (int i = 0; i < 8; i++) {
        o->pair[i][0] = b->scales[2 * i] >> 4;
        o->pair[i][1] = b->scales[2 * i + 1] >> 4;
    }
    o->d = kq_f16_to_f32(b->d);
    o->dmin = kq_f16_to_f32(b->dmin);
}

/* u = q + 4: the offset comes back out as 4 * sum(scale * bsums). */
static void unpack_q3_K(const void *vb, struct kq_row_block *o)
{
    const block_q3_K *b = vb;
    for (int c = 0; c < QK_K / 32; c++) {
        const uint8_t *qs = b->qs + 32 * (c / 4);
        for (int l = 0; l < 32; l++)
            o->u[32 * c + l] = (uint8_t)(((qs[l] >> (2 * (c % 4))) & 3) + (((b->hmask[l] >> c) & 1) << 2));
    }
    int8_t sc[16];
    kq_unpack_scales_q3(b->scales, sc);
    for (int g = 0; g < 16; g++)
        o->sc[g] = sc[g];
    for (int i = 0; i < 8; i++) {
        o->pair[i][0] = (int16_t)(4 * sc[2 * i]);
        o->pair[i][1] = (int16_t)(4 * sc[2 * i + 1]);
    }
    o->d = kq_f16_to_f32(b->d);
    o->dmin = 0;
}

/* Q4_K and Q5_K: scales and mins per 32 quants; a min weighs both bsums of its sub-block. */
static void k4_scales(const uint8_t *scales, struct kq_row_block *o)
{
    uint32_t packed[4];
    uint8_t sm[16]; /* scales 0-7, mins 0-7 */
    kq_unpack_scales_k4(scales, packed);
    memcpy(sm, packed, sizeof sm);
    for (int j = 0; j < 8; j++) {
        o->sc[j] = sm[j];
        o->pair[j][0] = o->pair[j][1] = sm[8 + j];
    }
    for (int j = 8; j < 16; j++)
        o->sc[j] = 0;
}

static void unpack_q4_K(const void *vb, struct kq_row_block *o)
{
    const block_q4_K *b = vb;
    for (int j = 0; j < QK_K / 64; j++)
        for (int l = 0; l < 32; l++) {
            o->u[64 * j + l] = b->qs[32 * j + l] & 0xF;
            o->u[64 * j + 32 + l] = b->qs[32 * j + l] >> 4;
        }
    k4_scales(b->scales, o);
    o->d = kq_f16_to_f32(b->d);
    o->dmin = kq_f16_to_f32(b->dmin);
}

static void unpack_q5_K(const void *vb, struct kq_row_block *o)
{
    const block_q5_K *b = vb;
    for (int j = 0; j < QK_K / 64; j++)
        for (int l = 0; l < 32; l++) {
            const uint8_t h = b->qh[l];
            o->u[64 * j + l] = (uint8_t)((b->qs[32 * j + l] & 0xF) | (((h >> (2 * j)) & 1) << 4));
            o->u[64 * j + 32 + l] = (uint8_t)((b->qs[32 * j + l] >> 4) | (((h >> (2 * j + 1)) & 1) << 4));
        }
    k4_scales(b->scales, o);
    o->d = kq_f16_to_f32(b->d);
    o->dmin = kq_f16_to_f32(b->dmin);
}

/* u = q + 32: the offset comes back out as 32 * sum(scale * bsums). */
static void unpack_q6_K(const void *vb, struct kq_row_block *o)
{
    const block_q6_K *b = vb;
    for (int half = 0; half < 2; half++) {
        const uint8_t *ql = b->ql + 64 * half, *qh = b->qh + 32 * half;
        uint8_t *u = o->u + 128 * half;
        for (int l = 0; l < 32; l++) {
            u[l] = (uint8_t)((ql[l] & 0xF) | ((qh[l] & 3) << 4));
            u[l + 32] = (uint8_t)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4));
            u[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
            u[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
        }
    }
    for (int g = 0; g < 16; g++)
        o->sc[g] = b->scales[g];
    for (int i = 0; i < 8; i++) {
        o->pair[i][0] = (int16_t)(32 * b->scales[2 * i]);
        o->pair[i][1] = (int16_t)(32 * b->scales[2 * i + 1]);
    }
    o->d = kq_f16_to_f32(b->d);
    o->dmin = 0;
}

typedef void (*unpack_fn)(const void *block, struct kq_row_block *o);

static unpack_fn unpacker(enum quant_type t)
{
    switch (t) {
    case QUANT_Q2_K: return unpack_q2_K;
    case QUANT_Q3_K: return unpack_q3_K;
    case QUANT_Q4_K: return unpack_q4_K;
    case QUANT_Q5_K: return unpack_q5_K;
    case QUANT_Q6_K: return unpack_q6_K;
    default: return NULL;
    }
}

size_t quant_kq_panel_bytes(int64_t cols) { return (size_t)(cols / QK_K) * KQ_PB_BYTES; }

size_t quant_kq_scratch_bytes(int64_t cols) { return KQ_GEMM_PANELS * quant_kq_panel_bytes(cols); }

/* Row `lane` of super-block pb. */
static void store_lane(const struct kq_row_block *o, int lane, uint8_t *pb)
{
    for (int k = 0; k < QK_K / 4; k++)
        memcpy(pb + KQ_PB_Q + 64 * k + 4 * lane, o->u + 4 * k, 4);
    for (int j = 0; j < 16; j++)
        memcpy(pb + KQ_PB_SC + 64 * j + 4 * lane, &o->sc[j], 4);
    for (int i = 0; i < 8; i++)
        memcpy(pb + KQ_PB_PAIRS + 64 * i + 4 * lane, o->pair[i], 4);
    memcpy(pb + KQ_PB_D + 4 * lane, &o->d, 4);
    memcpy(pb + KQ_PB_DMIN + 4 * lane, &o->dmin, 4);
}

/* Row `lane` of super-block pb in the lane-order layout (KQ_PL_*): every
 * quant times its scale; Q3_K signed (u - 4), Q5_K / Q6_K as unpacked. */
static void store_lane_scaled(enum quant_type t, const struct kq_row_block *o, int lane, uint8_t *pb)
{
    const int per = t == QUANT_Q5_K ? 32 : 16, off = t == QUANT_Q3_K ? 4 : 0;
    for (int j = 0; j < QK_K / 2; j++) {
        const int16_t w[2] = {(int16_t)(o->sc[2 * j / per] * (o->u[2 * j] - off)),
                              (int16_t)(o->sc[(2 * j + 1) / per] * (o->u[2 * j + 1] - off))};
        memcpy(pb + KQ_PL_W + 64 * j + 4 * lane, w, 4);
    }
    for (int i = 0; i < 8; i++)
        memcpy(pb + KQ_PL_PAIRS + 64 * i + 4 * lane, o->pair[i], 4);
    memcpy(pb + KQ_PL_D + 4 * lane, &o->d, 4);
    memcpy(pb + KQ_PL_DMIN + 4 * lane, &o->dmin, 4);
}

void quant_kq_unpack_lane(enum quant_type t, const void *block, int lane, uint8_t *pb)
{
    struct kq_row_block o;
    unpacker(t)(block, &o);
    if (kq_lane_order(t))
        store_lane_scaled(t, &o, lane, pb);
    else
        store_lane(&o, lane, pb);
}

void quant_kq_unpack_panel_row(enum quant_type t, const uint8_t *w, int64_t cols, uint8_t *panel, int lane)
{
    const size_t bb = quant_traits_scalar(t)->block_bytes;
    for (int64_t b = 0; b < cols / QK_K; b++)
        quant_kq_unpack_lane(t, w + (size_t)b * bb, lane, panel + b * KQ_PB_BYTES);
}

void quant_kq_unpack_panel(enum quant_type t, const uint8_t *w, size_t wrow, int nr, int64_t cols, uint8_t *panel)
{
    if (nr < KQ_PANEL_ROWS) /* rows past nr: zero quants, scales and d */
        memset(panel, 0, quant_kq_panel_bytes(cols));
    for (int r = 0; r < nr; r++)
        quant_kq_unpack_panel_row(t, w + (size_t)r * wrow, cols, panel, r);
}

void quant_kq_gemm_rows(const struct quant_kq_gemm *g, quant_kq_tiles_fn tiles, int64_t r0, int64_t r1,
                        uint8_t *scratch)
{
    const size_t pbytes = quant_kq_panel_bytes(g->cols);
    for (int64_t r = r0; r < r1; r += KQ_GEMM_ROWS) {
        const int nr = (int)(r1 - r < KQ_GEMM_ROWS ? r1 - r : KQ_GEMM_ROWS);
        const int np = (nr + KQ_PANEL_ROWS - 1) / KQ_PANEL_ROWS;
        for (int p = 0; p < np; p++) {
            const int pr = nr - p * KQ_PANEL_ROWS < KQ_PANEL_ROWS ? nr - p * KQ_PANEL_ROWS : KQ_PANEL_ROWS;
            if (g->repacked)
                quant_kqrp_unpack_panel(g->wtype, g->W, g->rows, g->cols, r + p * KQ_PANEL_ROWS, pr, scratch + p * pbytes);
            else
                quant_kq_unpack_panel(g->wtype, g->W + (size_t)(r + p * KQ_PANEL_ROWS) * g->wrow, g->wrow, pr, g->cols,
                                      scratch + p * pbytes);
        }
        tiles(g, scratch, np, r, nr);
    }
}

void quant_kq_tile_tokens(const struct quant_kq_gemm *g, int64_t t0, int n, int T, const block_q8_K **y)
{
    for (int t = 0; t < T; t++) {
        int64_t tt = t0 + (t < n ? t : n - 1);
        y[t] = (const block_q8_K *)(g->X + (g->xi ? g->xi[tt] : tt) * g->xrow);
    }
}

/* ---- the scalar twin -------------------------------------------------------- */

static int32_t lane_i32(const uint8_t *p, int lane)
{
    int32_t v;
    memcpy(&v, p + 4 * lane, 4);
    return v;
}

static float lane_f32(const uint8_t *p, int lane)
{
    float v;
    memcpy(&v, p + 4 * lane, 4);
    return v;
}

/* Row `lane` of a panel . one token's Q8_K row (Q2_K, Q4_K), super-block by
 * super-block as the tiles do and as the scalar reference vec_dot does:
 * exact isum and msum, then the two chains of kq_chains_add. */
static float lane_dot(const uint8_t *panel, int lane, const block_q8_K *y, int64_t nsb, int sub)
{
    float acc = 0, accm = 0;
    for (int64_t b = 0; b < nsb; b++) {
        const uint8_t *pb = panel + b * KQ_PB_BYTES;
        int32_t isum = 0, msum = 0;
        for (int j = 0; j < QK_K / 4 / sub; j++) {
            int32_t dot = 0;
            for (int k = j * sub; k < (j + 1) * sub; k++)
                for (int i = 0; i < 4; i++)
                    dot += pb[KQ_PB_Q + 64 * k + 4 * lane + i] * y[b].qs[4 * k + i];
            isum += lane_i32(pb + KQ_PB_SC + 64 * j, lane) * dot;
        }
        for (int i = 0; i < 8; i++) {
            int16_t pair[2];
            memcpy(pair, pb + KQ_PB_PAIRS + 64 * i + 4 * lane, 4);
            msum += pair[0] * y[b].bsums[2 * i] + pair[1] * y[b].bsums[2 * i + 1];
        }
        acc = fmaf((float)isum, lane_f32(pb + KQ_PB_D, lane) * y[b].d, acc);
        accm = fmaf((float)msum, lane_f32(pb + KQ_PB_DMIN, lane) * y[b].d, accm);
    }
    return acc - accm;
}

/* The same in ggml's eight lanes (KQ_PL_* layout, kq_scalar.c's order):
 * lane c's pairs, Q6_K's offset out of lane c, Q5_K's mins on their own. */
static float lane_dot_lanes(const uint8_t *panel, int lane, const block_q8_K *y, int64_t nsb, enum quant_type t)
{
    float acc[8] = {0}, summs = 0;
    for (int64_t b = 0; b < nsb; b++) {
        const uint8_t *pb = panel + b * KQ_PB_BYTES;
        const float dd = y[b].d * lane_f32(pb + KQ_PL_D, lane);
        int32_t msum = 0;
        for (int c = 0; c < 8; c++) {
            int32_t sum = 0;
            for (int m = 0; m < 8; m++)
                for (int h = 0; h < 2; h++) {
                    const int j = 16 * m + 2 * c + h;
                    int16_t w[2];
                    memcpy(w, pb + KQ_PL_W + 64 * j + 4 * lane, 4);
                    sum += w[0] * y[b].qs[2 * j] + w[1] * y[b].qs[2 * j + 1];
                }
            int16_t pair[2];
            memcpy(pair, pb + KQ_PL_PAIRS + 64 * c + 4 * lane, 4);
            const int32_t bs = pair[0] * y[b].bsums[2 * c] + pair[1] * y[b].bsums[2 * c + 1];
            if (t == QUANT_Q6_K)
                sum -= bs;
            msum += bs;
            acc[c] = fmaf(dd, (float)sum, acc[c]);
        }
        if (t == QUANT_Q5_K)
            summs = fmaf(-(y[b].d * lane_f32(pb + KQ_PL_DMIN, lane)), (float)msum, summs);
    }
    const float sum = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    return t == QUANT_Q5_K ? sum + summs : sum;
}

void quant_kq_tiles_scalar(const struct quant_kq_gemm *g, const uint8_t *panels, int np, int64_t r0, int nr)
{
    (void)np;
    const size_t pbytes = quant_kq_panel_bytes(g->cols);
    const int sub = kq_sub_dwords(g->wtype);
    const bool lanes = kq_lane_order(g->wtype);
    for (int r = 0; r < nr; r++)
        for (int64_t t = 0; t < g->n_tokens; t++) {
            const block_q8_K *y = (const block_q8_K *)(g->X + (g->xi ? g->xi[t] : t) * g->xrow);
            const uint8_t *panel = panels + (r / KQ_PANEL_ROWS) * pbytes;
            const int lane = r % KQ_PANEL_ROWS;
            g->Y[t * g->ldy + r0 + r] = lanes ? lane_dot_lanes(panel, lane, y, g->cols / QK_K, g->wtype)
                                              : lane_dot(panel, lane, y, g->cols / QK_K, sub);
        }
}

quant_kq_tiles_fn quant_kq_tiles_best(void)
{
#if defined(KQ_HAVE_GEMM_AVX512)
    return quant_kq_tiles_avx512;
#elif defined(KQ_HAVE_AVX2)
    return quant_kq_tiles_avx2;
#else
    return NULL;
#endif
}
