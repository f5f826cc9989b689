/* IQ2_XXS, IQ2_XS, IQ1_S, IQ1_M quantizers: kvserve's own, for `kvserve synth
 * --type` (llama-quantize needs an importance matrix for these types; these
 * give valid, reasonable blocks, not ggml's bits).
 *
 * A group of 8 values is one grid point. For a trial scale, each element's
 * nearest of the grid's 3 levels gives a code in 3^8; if that vector is a grid
 * point it is the best one, else the best of its precomputed nearest grid
 * points (by squared distance of the levels) is taken. Per 32 (or 16)
 * elements a few trial scales are tried, each refined by least squares; the
 * block's f16 super-scale then comes from the largest of them and every
 * sub-block is quantized again with its rounded integer scale. Errors are
 * weighted by x^2 plus the block's mean square. */
#include <float.h>
#include <pthread.h>
#include <stdlib.h>

#include "quant/iq2.h"

#define N_CODES 6561      /* 3^8 level vectors of a group of 8 */
#define N_NEIGHBOURS 4    /* grid points kept for a vector off the grid */
#define N_TRIALS 4        /* trial scales per sub-block */
static const float trial_factor[N_TRIALS] = {0.7f, 0.85f, 1.0f, 1.15f};

/* ---- grid index: level vector -> nearest grid points ---------------------- */

struct grid_index {
    const uint64_t *grid;
    int n_grid;
    float level[3];             /* ascending element values of a grid byte */
    int16_t on_grid[N_CODES];   /* the grid point with exactly this level vector, or -1 */
    uint16_t near[N_CODES][N_NEIGHBOURS];
    float value[2048][8];       /* each grid point's element values */
};

static struct grid_index g_iq2xxs, g_iq2xs, g_iq1s;
static pthread_once_t g_once_xxs = PTHREAD_ONCE_INIT, g_once_xs = PTHREAD_ONCE_INIT, g_once_1s = PTHREAD_ONCE_INIT;

static int level_of_byte(const struct grid_index *gi, uint8_t b)
{
    float v = gi->level[0] < 0 ? (float)(int8_t)b : (float)b;
    return v == gi->level[0] ? 0 : v == gi->level[1] ? 1 : 2;
}

static void index_build(struct grid_index *gi, const uint64_t *grid, int n_grid, float l0, float l1, float l2)
{
    gi->grid = grid;
    gi->n_grid = n_grid;
    gi->level[0] = l0, gi->level[1] = l1, gi->level[2] = l2;
    for (int c = 0; c < N_CODES; c++)
        gi->on_grid[c] = -1;
    for (int p = 0; p < n_grid; p++) {
        int code = 0;
        for (int j = 7; j >= 0; j--) {
            int lv = level_of_byte(gi, (uint8_t)(grid[p] >> (8 * j)));
            code = code * 3 + lv;
            gi->value[p][j] = gi->level[lv];
        }
        gi->on_grid[code] = (int16_t)p;
    }
    for (int c = 0; c < N_CODES; c++) {
        float v[8], best_d[N_NEIGHBOURS];
        for (int j = 0, r = c; j < 8; j++, r /= 3)
            v[j] = gi->level[r % 3];
        for (int k = 0; k < N_NEIGHBOURS; k++)
            best_d[k] = FLT_MAX, gi->near[c][k] = 0;
        for (int p = 0; p < n_grid; p++) {
            float d = 0;
            for (int j = 0; j < 8; j++)
                d += (v[j] - gi->value[p][j]) * (v[j] - gi->value[p][j]);
            int k = N_NEIGHBOURS;
            while (k > 0 && d < best_d[k - 1])
                k--;
            if (k == N_NEIGHBOURS)
                continue;
            for (int m = N_NEIGHBOURS - 1; m > k; m--)
                best_d[m] = best_d[m - 1], gi->near[c][m] = gi->near[c][m - 1];
            best_d[k] = d, gi->near[c][k] = (uint16_t)p;
        }
    }
}

static void build_xxs(void) { index_build(&g_iq2xxs, quant_iq2xxs_grid, 256, 8, 25, 43); }
static void build_xs(void) { index_build(&g_iq2xs, quant_iq2xs_grid, 512, 8, 25, 43); }
static void build_1s(void) { index_build(&g_iq1s, quant_iq1s_grid, 2048, -1, 0, 1); }

static const struct grid_index *grid_index_of(enum quant_type t)
{
    switch (t) {
    case QUANT_IQ2_XXS: pthread_once(&g_once_xxs, build_xxs); return &g_iq2xxs;
    case QUANT_IQ2_XS: pthread_once(&g_once_xs, build_xs); return &g_iq2xs;
    default: pthread_once(&g_once_1s, build_1s); return &g_iq1s;
    }
}

/* The grid point p minimising sum w (t - (value_p + off))^2 over 8 elements
 * (t already divided by the scale); *err gets that sum. */
static int nearest_point(const struct grid_index *gi, const float *t, const float *w, float off, float *err)
{
    const float mid01 = 0.5f * (gi->level[0] + gi->level[1]) + off, mid12 = 0.5f * (gi->level[1] + gi->level[2]) + off;
    int code = 0;
    for (int j = 7; j >= 0; j--)
        code = code * 3 + (t[j] < mid01 ? 0 : t[j] < mid12 ? 1 : 2);
    if (gi->on_grid[code] >= 0) {
        const int p = gi->on_grid[code];
        float e = 0;
        for (int j = 0; j < 8; j++) {
            float diff = t[j] - (gi->value[p][j] + off);
            e += w[j] * diff * diff;
        }
        *err = e;
        return p;
    }
    /* the candidates' sums side by side: independent chains, not one long one */
    const uint16_t *cand = gi->near[code];
    float e[N_NEIGHBOURS] = {0};
    for (int j = 0; j < 8; j++)
        for (int k = 0; k < N_NEIGHBOURS; k++) {
            float diff = t[j] - (gi->value[cand[k]][j] + off);
            e[k] += w[j] * diff * diff;
        }
    int best = 0;
    for (int k = 1; k < N_NEIGHBOURS; k++)
        best = e[k] < e[best] ? k : best;
    *err = e[best];
    return cand[best];
}

/* ---- a run of groups sharing one scale --------------------------------------
 * a: the n_groups * 8 values to fit (IQ2: magnitudes, negated where the sign
 * parity forced the wrong sign), w: their weights. With delta_mode, each
 * group's values are scale * (grid + delta), delta = +-1/8, per group (IQ1_M)
 * or one for the run (IQ1_S); without, scale * grid. */
struct fit {
    float scale;
    int idx[8];
    bool delta_neg[8];
};

enum delta_mode { DELTA_NONE, DELTA_PER_RUN, DELTA_PER_GROUP };

static float group_value(const struct grid_index *gi, int p, bool neg, enum delta_mode dm, int j)
{
    float off = dm == DELTA_NONE ? 0 : neg ? -QUANT_IQ1S_DELTA : QUANT_IQ1S_DELTA;
    return gi->value[p][j] + off;
}

/* Groups at a fixed scale s; returns the weighted squared error. */
static float assign(const struct grid_index *gi, const float *a, const float *w, int n_groups, float s,
                    enum delta_mode dm, bool run_neg, struct fit *f)
{
    float t[64], total = 0;
    const float inv = s > 0 ? 1.0f / s : 0;
    for (int e = 0; e < 8 * n_groups; e++)
        t[e] = a[e] * inv;
    for (int g = 0; g < n_groups; g++) {
        float err;
        if (dm == DELTA_PER_GROUP) {
            float err_neg;
            int p_pos = nearest_point(gi, t + 8 * g, w + 8 * g, QUANT_IQ1S_DELTA, &err);
            int p_neg = nearest_point(gi, t + 8 * g, w + 8 * g, -QUANT_IQ1S_DELTA, &err_neg);
            f->delta_neg[g] = err_neg < err;
            f->idx[g] = f->delta_neg[g] ? p_neg : p_pos;
            err = f->delta_neg[g] ? err_neg : err;
        } else {
            float off = dm == DELTA_NONE ? 0 : run_neg ? -QUANT_IQ1S_DELTA : QUANT_IQ1S_DELTA;
            f->idx[g] = nearest_point(gi, t + 8 * g, w + 8 * g, off, &err);
            f->delta_neg[g] = run_neg;
        }
        total += err * s * s;
    }
    return total;
}

/* Least-squares scale for the chosen points; returns the error at it. */
static float refit(const struct grid_index *gi, const float *a, const float *w, int n_groups, enum delta_mode dm,
                   struct fit *f)
{
    double swav = 0, swvv = 0, swaa = 0;
    for (int g = 0; g < n_groups; g++)
        for (int j = 0; j < 8; j++) {
            double v = group_value(gi, f->idx[g], f->delta_neg[g], dm, j), av = a[8 * g + j];
            swav += w[8 * g + j] * av * v, swvv += w[8 * g + j] * v * v, swaa += w[8 * g + j] * av * av;
        }
    if (swvv <= 0 || swav <= 0)
        return (float)swaa;
    f->scale = (float)(swav / swvv);
    return (float)(swaa - swav * swav / swvv);
}

/* The best scale and points for a run; amax_level: the level the largest |a|
 * should about reach. */
static void fit_run(const struct grid_index *gi, const float *a, const float *w, int n_groups, enum delta_mode dm,
                    float amax_level, struct fit *best)
{
    float amax = 0;
    for (int e = 0; e < 8 * n_groups; e++)
        amax = fabsf(a[e]) > amax ? fabsf(a[e]) : amax;
    best->scale = 0;
    memset(best->idx, 0, sizeof best->idx);
    memset(best->delta_neg, 0, sizeof best->delta_neg);
    if (amax == 0)
        return;
    float best_err = FLT_MAX;
    const int n_signs = dm == DELTA_PER_RUN ? 2 : 1;
    for (int sg = 0; sg < n_signs; sg++)
        for (int k = 0; k < N_TRIALS; k++) {
            struct fit f = {0};
            f.scale = amax / amax_level * trial_factor[k];
            assign(gi, a, w, n_groups, f.scale, dm, sg == 1, &f);
            float err = refit(gi, a, w, n_groups, dm, &f);
            if (err < best_err && f.scale > 0)
                best_err = err, *best = f;
        }
}

/* Weights of one super-block's elements. */
static void block_weights(const float *x, float *w)
{
    float sum = 0;
    for (int j = 0; j < QK_K; j++)
        sum += x[j] * x[j];
    const float sigma2 = sum / QK_K;
    for (int j = 0; j < QK_K; j++)
        w[j] = x[j] * x[j] + sigma2;
}

/* Integer scale for a run's float scale s under super-scale d: s ~ d * mul(ls). */
static int round_ls(float s, float d, float base, float step, int max)
{
    if (d <= 0)
        return 0;
    int ls = (int)lrintf((s / d - base) / step);
    return ls < 0 ? 0 : ls > max ? max : ls;
}

/* ---- IQ2: signs ------------------------------------------------------------- */

/* The even-parity sign byte of a group and the magnitudes to fit: with an odd
 * count of negatives, the smallest |x| keeps the wrong sign (its target is then
 * -|x|, so the fit knows). */
static uint8_t group_signs(const float *x, float *a)
{
    uint8_t neg = 0;
    int smallest = 0;
    for (int j = 0; j < 8; j++) {
        a[j] = fabsf(x[j]);
        neg |= (uint8_t)((x[j] < 0) << j);
        if (a[j] < a[smallest])
            smallest = j;
    }
    if (__builtin_popcount(neg) & 1) {
        neg ^= (uint8_t)(1u << smallest);
        a[smallest] = -a[smallest];
    }
    return neg;
}

/* One IQ2 super-block: runs of group_per_run groups, 4-bit ls per run
 * (db = d * (0.5 + ls) / 4). Writes d, per group grid index and sign byte,
 * per run ls. */
static void quantize_iq2_block(enum quant_type t, const float *x, int groups_per_run, float *d_out, int *idx,
                               uint8_t *signs, int *ls)
{
    const struct grid_index *gi = grid_index_of(t);
    float w[QK_K], a[QK_K], s[QK_K / 8];
    block_weights(x, w);
    for (int g = 0; g < QK_K / 8; g++)
        signs[g] = group_signs(x + 8 * g, a + 8 * g);
    const int n_runs = QK_K / 8 / groups_per_run;
    float smax = 0;
    for (int r = 0; r < n_runs; r++) {
        struct fit f;
        fit_run(gi, a + 8 * groups_per_run * r, w + 8 * groups_per_run * r, groups_per_run, DELTA_NONE, 43, &f);
        s[r] = f.scale;
        smax = s[r] > smax ? s[r] : smax;
    }
    const quant_f16 dh = kq_f32_to_f16(smax / 3.875f);
    const float d = kq_f16_to_f32(dh);
    *d_out = d;
    for (int r = 0; r < n_runs; r++) {
        ls[r] = round_ls(s[r], d, 0.125f, 0.25f, 15); /* db = d * (0.5 + ls) / 4 */
        struct fit f;
        float db = d * (0.5f + (float)ls[r]) * 0.25f;
        assign(gi, a + 8 * groups_per_run * r, w + 8 * groups_per_run * r, groups_per_run, db, DELTA_NONE, false, &f);
        for (int g = 0; g < groups_per_run; g++)
            idx[groups_per_run * r + g] = f.idx[g];
    }
}

void quant_quantize_row_iq2_xxs(const float *x, void *vy, int64_t n)
{
    block_iq2_xxs *y = vy;
    for (int64_t i = 0; i < n / QK_K; i++, x += QK_K) {
        float d;
        int idx[QK_K / 8], ls[QK_K / 32];
        uint8_t signs[QK_K / 8];
        quantize_iq2_block(QUANT_IQ2_XXS, x, 4, &d, idx, signs, ls);
        y[i].d = kq_f32_to_f16(d);
        for (int ib = 0; ib < QK_K / 32; ib++) {
            uint8_t grid_bytes[4];
            uint32_t aux = (uint32_t)ls[ib] << 28;
            for (int l = 0; l < 4; l++) {
                grid_bytes[l] = (uint8_t)idx[4 * ib + l];
                aux |= (uint32_t)(signs[4 * ib + l] & 127) << (7 * l);
            }
            memcpy((uint8_t *)y[i].qs + 8 * ib, grid_bytes, 4);
            memcpy((uint8_t *)y[i].qs + 8 * ib + 4, &aux, 4);
        }
    }
}

void quant_quantize_row_iq2_xs(const float *x, void *vy, int64_t n)
{
    block_iq2_xs *y = vy;
    for (int64_t i = 0; i < n / QK_K; i++, x += QK_K) {
        float d;
        int idx[QK_K / 8], ls[QK_K / 16];
        uint8_t signs[QK_K / 8];
        quantize_iq2_block(QUANT_IQ2_XS, x, 2, &d, idx, signs, ls);
        y[i].d = kq_f32_to_f16(d);
        for (int g = 0; g < QK_K / 8; g++)
            y[i].qs[g] = (uint16_t)(idx[g] | (signs[g] & 127) << 9);
        for (int ib = 0; ib < QK_K / 32; ib++)
            y[i].scales[ib] = (uint8_t)(ls[2 * ib] | ls[2 * ib + 1] << 4);
    }
}

/* ---- IQ1 ---------------------------------------------------------------------- */

/* One IQ1 super-block in runs of groups_per_run groups, dl = d * (2 ls + 1)
 * with 3-bit ls: d, then per run ls, per group grid index and delta sign. */
static void quantize_iq1_block(const float *x, int groups_per_run, enum delta_mode dm, float *d_out, int *idx,
                               bool *delta_neg, int *ls)
{
    const struct grid_index *gi = grid_index_of(QUANT_IQ1_S);
    float w[QK_K], s[QK_K / 8];
    block_weights(x, w);
    const int n_runs = QK_K / 8 / groups_per_run;
    float smax = 0;
    for (int r = 0; r < n_runs; r++) {
        struct fit f;
        fit_run(gi, x + 8 * groups_per_run * r, w + 8 * groups_per_run * r, groups_per_run, dm, 1.125f, &f);
        s[r] = f.scale;
        smax = s[r] > smax ? s[r] : smax;
    }
    const float d = kq_f16_to_f32(kq_f32_to_f16(smax / 15.0f));
    *d_out = d;
    for (int r = 0; r < n_runs; r++) {
        ls[r] = round_ls(s[r], d, 1.0f, 2.0f, 7);
        const float dl = d * (float)(2 * ls[r] + 1);
        const float *xr = x + 8 * groups_per_run * r, *wr = w + 8 * groups_per_run * r;
        struct fit f = {0}, f_neg = {0};
        float err = assign(gi, xr, wr, groups_per_run, dl, dm, false, &f);
        if (dm == DELTA_PER_RUN && assign(gi, xr, wr, groups_per_run, dl, dm, true, &f_neg) < err)
            f = f_neg;
        for (int g = 0; g < groups_per_run; g++) {
            idx[groups_per_run * r + g] = f.idx[g];
            delta_neg[groups_per_run * r + g] = f.delta_neg[g];
        }
    }
}

void quant_quantize_row_iq1_s(const float *x, void *vy, int64_t n)
{
    block_iq1_s *y = vy;
    for (int64_t i = 0; i < n / QK_K; i++, x += QK_K) {
        float d;
        int idx[QK_K / 8], ls[QK_K / 32];
        bool delta_neg[QK_K / 8];
        quantize_iq1_block(x, 4, DELTA_PER_RUN, &d, idx, delta_neg, ls);
        y[i].d = kq_f32_to_f16(d);
        for (int ib = 0; ib < QK_K / 32; ib++) {
            uint16_t qh = (uint16_t)(ls[ib] << 12 | (delta_neg[4 * ib] ? 0x8000 : 0));
            for (int l = 0; l < 4; l++) {
                y[i].qs[4 * ib + l] = (uint8_t)idx[4 * ib + l];
                qh |= (uint16_t)((idx[4 * ib + l] >> 8) << (3 * l));
            }
            y[i].qh[ib] = qh;
        }
    }
}

void quant_quantize_row_iq1_m(const float *x, void *vy, int64_t n)
{
    block_iq1_m *y = vy;
    for (int64_t i = 0; i < n / QK_K; i++, x += QK_K) {
        float d;
        int idx[QK_K / 8], ls[QK_K / 16];
        bool delta_neg[QK_K / 8];
        quantize_iq1_block(x, 2, DELTA_PER_GROUP, &d, idx, delta_neg, ls);
        iq1m_scale_t scale;
        scale.f16 = kq_f32_to_f16(d);
        for (int g = 0; g < QK_K / 8; g++)
            y[i].qs[g] = (uint8_t)idx[g];
        for (int h = 0; h < QK_K / 16; h++)
            y[i].qh[h] = (uint8_t)((idx[2 * h] >> 8) | (delta_neg[2 * h] ? 0x08 : 0) | (idx[2 * h + 1] >> 8) << 4 |
                                   (delta_neg[2 * h + 1] ? 0x80 : 0));
        for (int k = 0; k < 4; k++) {
            uint16_t sc = (uint16_t)(ls[4 * k] | ls[4 * k + 1] << 3 | ls[4 * k + 2] << 6 | ls[4 * k + 3] << 9 |
                                     ((scale.u16 >> (4 * k)) & 0xf) << 12);
            memcpy(y[i].scales + 2 * k, &sc, sizeof sc);
        }
    }
}
