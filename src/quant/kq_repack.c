/* k-quants: Q4_K / Q5_K / Q6_K weights repacked at load time into
 * interleaved row groups (the layout is in kquants.h), the row lookup, and
 * the scalar twin of the group kernels (kq_repack_avx512.c, kq_repack_avx2.c).
 *
 * Compiled without FMA contraction: the twin must give the scalar reference
 * vec_dot's bits, and it does by running that very vec_dot on one
 * super-block at a time (a sum that starts at 0 and adds one term is that
 * term, so the per-block results add up in the reference's order). */
#include <stdlib.h>

#include "quant/kquants.h"

bool quant_kqrp_type(enum quant_type t) { return t == QUANT_Q4_K || t == QUANT_Q5_K || t == QUANT_Q6_K; }

/* Row l's bytes [o, o + unit) of a super-block inside its group-block of R
 * rows, where unit is the width of the field at o (2 for an f16 scale, 4 for
 * a dword chunk). */
static size_t kqrp_pos(enum quant_type t, int R, int l, size_t o, size_t *unit)
{
    if (t != QUANT_Q6_K && o < 4) { /* d[R], then dmin[R] */
        *unit = 2;
        return (o / 2) * 2 * (size_t)R + 2 * (size_t)l;
    }
    if (t == QUANT_Q6_K && o >= KQRP_Q6_D) { /* d[R] after the chunks */
        *unit = 2;
        return KQRP_Q6_D * (size_t)R + 2 * (size_t)l;
    }
    *unit = 4;
    return (o / 4) * 4 * (size_t)R + 4 * (size_t)l;
}

/* Copy row l's super-block between blk (ggml's layout) and its group-block gb. */
static void kqrp_move(enum quant_type t, int R, int l, uint8_t *gb, uint8_t *blk, bool to_group)
{
    size_t bb = quant_row_size(t, QK_K), unit;
    for (size_t o = 0; o < bb; o += unit) {
        size_t p = kqrp_pos(t, R, l, o, &unit);
        if (to_group)
            memcpy(gb + p, blk + o, unit);
        else
            memcpy(blk + o, gb + p, unit);
    }
}

ks_status quant_kqrp_repack_as(enum quant_type t, int64_t rows, int64_t cols, void *W, int R)
{
    size_t wrow = quant_row_size(t, cols), bb = quant_row_size(t, QK_K);
    int64_t nsb = cols / QK_K;
    uint8_t *rowmajor = malloc((size_t)R * wrow);
    if (!rowmajor)
        return ks_fail(KS_ERR_NOMEM, "repack: out of memory for %d rows of %zu bytes", R, wrow);
    for (int64_t g = 0; g < rows / R; g++) {
        uint8_t *group = (uint8_t *)W + (size_t)g * R * wrow; /* the group's rows become its group-blocks in place */
        memcpy(rowmajor, group, (size_t)R * wrow);
        for (int64_t b = 0; b < nsb; b++)
            for (int l = 0; l < R; l++)
                kqrp_move(t, R, l, group + (size_t)b * R * bb, rowmajor + l * wrow + b * bb, true);
    }
    free(rowmajor);
    return KS_OK;
}

void quant_kqrp_get_block(const void *W, enum quant_type t, int R, int64_t cols, int64_t r, int64_t b, void *out)
{
    size_t wrow = quant_row_size(t, cols), bb = quant_row_size(t, QK_K);
    uint8_t *group = (uint8_t *)W + (size_t)(r / R) * R * wrow;
    kqrp_move(t, R, (int)(r % R), group + (size_t)b * R * bb, out, false);
}

void quant_kqrp_get_row(const void *W, enum quant_type t, int R, int64_t cols, int64_t r, void *out)
{
    size_t bb = quant_row_size(t, QK_K);
    for (int64_t b = 0; b < cols / QK_K; b++)
        quant_kqrp_get_block(W, t, R, cols, r, b, (uint8_t *)out + b * bb);
}

/* A whole group of R rows back out, field by field: what the prefill tiles
 * read when a batch is too large for the group kernels. */
static void kqrp_unpack_group(const uint8_t *group, enum quant_type t, int R, int64_t cols, uint8_t *out)
{
    const size_t wrow = quant_row_size(t, cols), bb = quant_row_size(t, QK_K);
    const bool q6 = t == QUANT_Q6_K;
    const size_t k0 = q6 ? 0 : 1, k1 = q6 ? KQRP_Q6_D / 4 : bb / 4; /* the dword chunks */
    for (int64_t b = 0; b < cols / QK_K; b++) {
        const uint8_t *gb = group + (size_t)b * R * bb;
        uint8_t *o = out + b * bb;
        for (int l = 0; l < R; l++) {
            uint8_t *blk = o + l * wrow;
            if (q6) {
                memcpy(blk + KQRP_Q6_D, gb + KQRP_Q6_D * (size_t)R + 2 * l, 2);
            } else {
                memcpy(blk, gb + 2 * l, 2);
                memcpy(blk + 2, gb + 2 * (size_t)R + 2 * l, 2);
            }
            for (size_t k = k0; k < k1; k++)
                memcpy(blk + 4 * k, gb + 4 * ((size_t)R * k + (size_t)l), 4);
        }
    }
}

void quant_kqrp_unpack_rows(const void *W, enum quant_type t, int64_t rows, int64_t cols, int64_t r0, int nr,
                            uint8_t *out)
{
    const int R = QUANT_RP_ROWS;
    size_t wrow = quant_row_size(t, cols);
    for (int i = 0; i < nr;) {
        int64_t r = r0 + i;
        if (r % R == 0 && i + R <= nr && r + R <= quant_rp_grouped_rows(rows)) {
            kqrp_unpack_group((const uint8_t *)W + (size_t)r * wrow, t, R, cols, out + i * wrow);
            i += R;
            continue;
        }
        if (r < quant_rp_grouped_rows(rows))
            quant_kqrp_get_row(W, t, R, cols, r, out + i * wrow);
        else
            memcpy(out + i * wrow, (const uint8_t *)W + r * wrow, wrow);
        i++;
    }
}

/* ---- the scalar twin: any group size --------------------------------------- */

void quant_kqrp_rows_ref(const struct quant_kq_gemm *g, int R, int64_t g0, int64_t g1)
{
    const quant_vec_dot_fn dot = quant_traits_scalar(g->wtype)->vec_dot;
    const size_t bb = quant_row_size(g->wtype, QK_K);
    const int64_t nsb = g->cols / QK_K;
    uint8_t blk[sizeof(block_q6_K) > sizeof(block_q5_K) ? sizeof(block_q6_K) : sizeof(block_q5_K)];
    for (int64_t grp = g0; grp < g1; grp++) {
        uint8_t *group = (uint8_t *)g->W + (size_t)grp * R * g->wrow;
        for (int64_t t = 0; t < g->n_tokens; t++) {
            const block_q8_K *y = (const block_q8_K *)(g->X + (g->xi ? g->xi[t] : t) * g->xrow);
            for (int l = 0; l < R; l++) {
                float sum = 0;
                for (int64_t b = 0; b < nsb; b++) {
                    float s;
                    kqrp_move(g->wtype, R, l, group + (size_t)b * R * bb, blk, false);
                    dot(QK_K, &s, blk, &y[b]);
                    sum += s;
                }
                g->Y[t * g->ldy + grp * R + l] = sum;
            }
        }
    }
}

void quant_kqrp_tail_rows(const struct quant_kq_gemm *g, int64_t rows)
{
    const quant_vec_dot_fn dot = quant_traits_scalar(g->wtype)->vec_dot;
    for (int64_t r = quant_rp_grouped_rows(rows); r < rows; r++)
        for (int64_t t = 0; t < g->n_tokens; t++)
            dot((int)g->cols, &g->Y[t * g->ldy + r], g->W + r * g->wrow, g->X + (g->xi ? g->xi[t] : t) * g->xrow);
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
