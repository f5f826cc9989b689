/* IQ3_XXS, IQ3_S, IQ2_S quantizers (from_float): kvserve's own search, not
 * ggml's (files are valid for any decoder; bit-exactness with llama-quantize
 * is not a goal).
 *
 * Per super-block: signs are taken off (IQ3_XXS keeps an even count of minus
 * signs per 8 elements by flipping its smallest element's sign); each scale
 * group (32 elements, IQ2_S 16) tries a few scales around max/top level, maps
 * each group of 4 (IQ2_S 8) magnitudes to a grid point and keeps the least-
 * squares scale of the best try; d is the largest of those over 31, each
 * group's 4-bit ls the nearest (or a neighbour's, whichever errs least), and
 * the grid points are chosen again under the final scales.
 *
 * Mapping a group to a grid point: round each magnitude to its nearest
 * level, which names a cell of the level lattice; a direct table says which
 * grid point sits there. When none does (most cells: the grids hold 256 of
 * 4096, 512 of 4096 and 1024 of 6561), only that cell's precomputed
 * neighbours (the grid points at its two smallest distances, at most
 * IQ_NB_MAX) are tried, never the whole grid. */
#include <math.h>
#include <pthread.h>

#include "quant/iq3.h"

#define IQ_NB_MAX 16
#define IQ_MAX_GROUP 8
#define IQ_MAX_POINTS 1024
#define IQ_MAX_CELLS 6561 /* 3^8 (IQ2_S); the IQ3 lattices have 8^4 = 4096 */
#define IQ_TOP_SCALE 31 /* 2 * 15 + 1: the largest per-group multiplier */

struct iq_grid {
    int group;           /* elements per grid point */
    int n_levels;
    int8_t levels[8];    /* ascending magnitudes a grid byte can have */
    float mids[8];       /* (n_levels - 1) midpoints between neighbouring levels */
    int n_points;
    uint8_t points[IQ_MAX_POINTS * IQ_MAX_GROUP];  /* (n_points, group) magnitudes */
    float fpoints[IQ_MAX_POINTS * IQ_MAX_GROUP];   /* the same as floats */
    float point_mm[IQ_MAX_POINTS];                 /* sum of a point's squared magnitudes */
    int n_cells;                                  /* n_levels ^ group */
    int16_t cell_point[IQ_MAX_CELLS];             /* (n_cells) grid point in the cell, or -1 */
    int32_t nb_start[IQ_MAX_CELLS + 1];           /* neighbours of cell c: nb[nb_start[c] .. nb_start[c + 1]) */
    uint16_t nb[IQ_MAX_CELLS * IQ_NB_MAX];
};

enum { GRID_IQ3_XXS, GRID_IQ3_S, GRID_IQ2_S, GRID_COUNT };
static struct iq_grid g_grids[GRID_COUNT];
static pthread_once_t g_grids_once = PTHREAD_ONCE_INIT;

/* ---- the search tables ---------------------------------------------------- */

static int level_index(const struct iq_grid *g, int v)
{
    for (int l = 0; l < g->n_levels; l++)
        if (g->levels[l] == v)
            return l;
    return -1;
}

static int cell_of_point(const struct iq_grid *g, const uint8_t *p)
{
    int cell = 0;
    for (int j = g->group - 1; j >= 0; j--)
        cell = cell * g->n_levels + level_index(g, p[j]);
    return cell;
}

static int point_dist(const struct iq_grid *g, const int8_t *cell_mag, const uint8_t *p)
{
    int d = 0;
    for (int j = 0; j < g->group; j++) d += (cell_mag[j] - p[j]) * (cell_mag[j] - p[j]);
    return d;
}

/* Grid points at the cell's two smallest distances, nearest first, at most IQ_NB_MAX. */
static int cell_neighbours(const struct iq_grid *g, int cell, uint16_t *out)
{
    int dist[IQ_MAX_POINTS];
    int8_t mag[IQ_MAX_GROUP];
    for (int j = 0, c = cell; j < g->group; j++, c /= g->n_levels) mag[j] = g->levels[c % g->n_levels];
    int d1 = INT32_MAX, d2 = INT32_MAX;
    for (int p = 0; p < g->n_points; p++) {
        dist[p] = point_dist(g, mag, g->points + (size_t)p * (size_t)g->group);
        if (dist[p] < d1)
            d2 = d1, d1 = dist[p];
        else if (dist[p] > d1 && dist[p] < d2)
            d2 = dist[p];
    }
    int n = 0;
    for (int want = d1; n < IQ_NB_MAX; want = d2) {
        for (int p = 0; p < g->n_points && n < IQ_NB_MAX; p++)
            if (dist[p] == want)
                out[n++] = (uint16_t)p;
        if (want == d2 || d2 == INT32_MAX)
            break;
    }
    return n;
}

static void grid_build(struct iq_grid *g, const void *table, size_t entry_bytes)
{
    g->n_cells = 1;
    for (int j = 0; j < g->group; j++) g->n_cells *= g->n_levels;
    for (int p = 0; p < g->n_points; p++) /* little-endian entries: byte j is element j */
        for (int j = 0; j < g->group; j++) {
            uint64_t e = 0;
            memcpy(&e, (const uint8_t *)table + (size_t)p * entry_bytes, entry_bytes);
            g->points[(size_t)p * (size_t)g->group + (size_t)j] = (uint8_t)(e >> (8 * j));
        }
    for (int p = 0; p < g->n_points; p++) {
        g->point_mm[p] = 0;
        for (int j = 0; j < g->group; j++) {
            const float m = g->points[(size_t)p * (size_t)g->group + (size_t)j];
            g->fpoints[(size_t)p * (size_t)g->group + (size_t)j] = m;
            g->point_mm[p] += m * m;
        }
    }
    for (int l = 0; l + 1 < g->n_levels; l++) g->mids[l] = 0.5f * (float)(g->levels[l] + g->levels[l + 1]);
    for (int c = 0; c < g->n_cells; c++) g->cell_point[c] = -1;
    for (int p = 0; p < g->n_points; p++) g->cell_point[cell_of_point(g, g->points + (size_t)p * (size_t)g->group)] = (int16_t)p;
    int32_t at = 0;
    for (int c = 0; c < g->n_cells; c++) {
        g->nb_start[c] = at;
        if (g->cell_point[c] < 0)
            at += cell_neighbours(g, c, g->nb + at);
    }
    g->nb_start[g->n_cells] = at;
}

static void grid_setup(struct iq_grid *g, int group, const int8_t *levels, int n_levels, const void *table,
                       size_t entry_bytes, int n_points)
{
    g->group = group;
    g->n_levels = n_levels;
    memcpy(g->levels, levels, (size_t)n_levels);
    g->n_points = n_points;
    grid_build(g, table, entry_bytes);
}

static void grids_init(void)
{
    static const int8_t iq3xxs_levels[] = {4, 12, 20, 28, 36, 44, 52, 62}, iq3s_levels[] = {1, 3, 5, 7, 9, 11, 13, 15},
                        iq2s_levels[] = {8, 25, 43};
    grid_setup(&g_grids[GRID_IQ3_XXS], 4, iq3xxs_levels, 8, quant_iq3xxs_grid, sizeof quant_iq3xxs_grid[0], 256);
    grid_setup(&g_grids[GRID_IQ3_S], 4, iq3s_levels, 8, quant_iq3s_grid, sizeof quant_iq3s_grid[0], 512);
    grid_setup(&g_grids[GRID_IQ2_S], 8, iq2s_levels, 3, quant_iq2s_grid, sizeof quant_iq2s_grid[0], 1024);
}

/* ---- one group ----------------------------------------------------------- */

static float group_err(const struct iq_grid *g, const float *t, float s, int p)
{
    const float *m = g->fpoints + (size_t)p * (size_t)g->group;
    float e = 0;
    for (int j = 0; j < g->group; j++) e += (t[j] - s * m[j]) * (t[j] - s * m[j]);
    return e;
}

/* The grid point for targets t (signs taken off) at scale s > 0; rough: on a
 * miss, the cell's first neighbour (one nearest on the lattice) untried. */
static int group_point(const struct iq_grid *g, const float *t, float s, bool rough)
{
    const float inv = 1.0f / s;
    int cell = 0;
    for (int j = g->group - 1; j >= 0; j--) {
        const float v = t[j] * inv;
        int l = 0; /* the nearest level: how many midpoints lie at or below v */
        for (int k = 0; k + 1 < g->n_levels; k++) l += v >= g->mids[k];
        cell = cell * g->n_levels + l;
    }
    if (g->cell_point[cell] >= 0)
        return g->cell_point[cell];
    if (rough)
        return g->nb[g->nb_start[cell]];
    int best = g->nb[g->nb_start[cell]];
    float best_err = INFINITY;
    for (int32_t k = g->nb_start[cell]; k < g->nb_start[cell + 1]; k++) {
        float e = group_err(g, t, s, g->nb[k]);
        if (e < best_err)
            best_err = e, best = g->nb[k];
    }
    return best;
}

/* ---- one scale group (n elements) ----------------------------------------- */

/* Points for each group of t at scale s; returns sum(t * m) and *mm = sum(m * m). */
static float assign(const struct iq_grid *g, const float *t, int n, float s, bool rough, uint16_t *pts, float *mm)
{
    float tm = 0;
    *mm = 0;
    for (int k = 0; k < n / g->group; k++) {
        const int p = group_point(g, t + k * g->group, s, rough);
        const float *m = g->fpoints + (size_t)p * (size_t)g->group;
        pts[k] = (uint16_t)p;
        for (int j = 0; j < g->group; j++) tm += t[k * g->group + j] * m[j];
        *mm += g->point_mm[p];
    }
    return tm;
}

/* The least-squares scale of the best of a few tries (0 for an all-zero group),
 * each try mapped roughly: the final mapping (assign_err) searches. */
static float best_scale(const struct iq_grid *g, const float *t, int n)
{
    static const float tries[] = {0.6f, 0.7f, 0.8f, 0.9f, 1.0f, 1.1f, 1.2f, 1.35f};
    float amax = 0;
    for (int j = 0; j < n; j++) amax = t[j] > amax ? t[j] : amax;
    if (amax < 1e-30f)
        return 0;
    float best = 0, best_gain = 0;
    for (size_t i = 0; i < sizeof tries / sizeof tries[0]; i++) {
        uint16_t pts[32];
        float mm;
        const float tm = assign(g, t, n, amax / (float)g->levels[g->n_levels - 1] * tries[i], true, pts, &mm);
        /* error = sum(t^2) - tm^2 / mm at the least-squares scale tm / mm */
        if (tm > 0 && tm * tm / mm > best_gain)
            best_gain = tm * tm / mm, best = tm / mm;
    }
    return best;
}

static float assign_err(const struct iq_grid *g, const float *t, int n, float s, uint16_t *pts)
{
    float mm, e = 0;
    assign(g, t, n, s, false, pts, &mm);
    for (int k = 0; k < n / g->group; k++) e += group_err(g, t + k * g->group, s, pts[k]);
    return e;
}

/* ---- one super-block ------------------------------------------------------ */

struct iq_solution {
    quant_f16 d;
    uint8_t ls[QK_K / 16];   /* per scale group */
    uint16_t pts[QK_K / 4];  /* per group */
    uint8_t signs[QK_K / 8]; /* bit j of byte k: element 8k + j negative */
};

/* x: QK_K values; scale groups of n_sg elements; value = d / div * (2 ls + 1) * m. */
static void solve_block(const struct iq_grid *g, const float *x, int n_sg, float div, bool even_signs,
                        struct iq_solution *sol)
{
    float t[QK_K];
    memset(sol, 0, sizeof *sol);
    for (int k = 0; k < QK_K / 8; k++) {
        int smallest = 0;
        for (int j = 0; j < 8; j++) {
            const float v = x[8 * k + j];
            t[8 * k + j] = fabsf(v);
            sol->signs[k] |= (uint8_t)((v < 0) << j);
            smallest = fabsf(v) < fabsf(x[8 * k + smallest]) ? j : smallest;
        }
        if (even_signs && (__builtin_popcount(sol->signs[k]) & 1)) {
            sol->signs[k] ^= (uint8_t)(1u << smallest); /* its stored sign is now wrong: aim at -|x| */
            t[8 * k + smallest] = -t[8 * k + smallest];
        }
    }
    const int n_groups = QK_K / n_sg;
    float s[QK_K / 16], smax = 0;
    for (int i = 0; i < n_groups; i++) {
        s[i] = best_scale(g, t + i * n_sg, n_sg);
        smax = s[i] > smax ? s[i] : smax;
    }
    sol->d = kq_f32_to_f16(smax / IQ_TOP_SCALE * div);
    const float unit = kq_f16_to_f32(sol->d) / div; /* the scale of ls = 0 */
    if (!(unit > 0)) { /* all zero (or the scale underflowed): d = 0 dequantizes to zeros */
        sol->d = 0;
        return;
    }
    for (int i = 0; i < n_groups; i++) {
        const int ls0 = kq_nearest_int((s[i] / unit - 1) * 0.5f);
        float best_err = INFINITY;
        for (int ls = ls0 - 1; ls <= ls0 + 1; ls++) {
            if (ls < 0 || ls > 15)
                continue;
            uint16_t pts[32];
            const float e = assign_err(g, t + i * n_sg, n_sg, unit * (float)(2 * ls + 1), pts);
            if (e < best_err) {
                best_err = e;
                sol->ls[i] = (uint8_t)ls;
                memcpy(sol->pts + i * n_sg / g->group, pts, sizeof(uint16_t) * (size_t)(n_sg / g->group));
            }
        }
    }
}

static const struct iq_grid *grid(int which)
{
    pthread_once(&g_grids_once, grids_init);
    return &g_grids[which];
}

/* ---- packing ------------------------------------------------------------- */

void quant_quantize_row_iq3_xxs(const float *x, void *vy, int64_t n)
{
    const struct iq_grid *g = grid(GRID_IQ3_XXS);
    block_iq3_xxs *y = vy;
    for (int64_t i = 0; i < n / QK_K; i++, x += QK_K) {
        struct iq_solution sol;
        memset(&y[i], 0, sizeof y[i]);
        solve_block(g, x, 32, 4.0f, true, &sol);
        y[i].d = sol.d;
        for (int k = 0; k < QK_K / 4; k++) y[i].qs[k] = (uint8_t)sol.pts[k];
        for (int ib = 0; ib < QK_K / 32; ib++) {
            uint32_t aux = (uint32_t)sol.ls[ib] << 28;
            for (int l = 0; l < 4; l++) aux |= (uint32_t)(sol.signs[4 * ib + l] & 127) << (7 * l);
            memcpy(y[i].qs + QK_K / 4 + 4 * ib, &aux, sizeof aux);
        }
    }
}

void quant_quantize_row_iq3_s(const float *x, void *vy, int64_t n)
{
    const struct iq_grid *g = grid(GRID_IQ3_S);
    block_iq3_s *y = vy;
    for (int64_t i = 0; i < n / QK_K; i++, x += QK_K) {
        struct iq_solution sol;
        memset(&y[i], 0, sizeof y[i]);
        solve_block(g, x, 32, 1.0f, false, &sol);
        y[i].d = sol.d;
        for (int k = 0; k < QK_K / 4; k++) {
            y[i].qs[k] = (uint8_t)sol.pts[k];
            y[i].qh[k / 8] |= (uint8_t)(((sol.pts[k] >> 8) & 1) << (k % 8));
        }
        memcpy(y[i].signs, sol.signs, sizeof y[i].signs);
        for (int ib = 0; ib < QK_K / 32; ib++) y[i].scales[ib / 2] |= (uint8_t)(sol.ls[ib] << (4 * (ib % 2)));
    }
}

void quant_quantize_row_iq2_s(const float *x, void *vy, int64_t n)
{
    const struct iq_grid *g = grid(GRID_IQ2_S);
    block_iq2_s *y = vy;
    for (int64_t i = 0; i < n / QK_K; i++, x += QK_K) {
        struct iq_solution sol;
        memset(&y[i], 0, sizeof y[i]);
        solve_block(g, x, 16, 8.0f, false, &sol);
        y[i].d = sol.d;
        for (int k = 0; k < QK_K / 8; k++) {
            y[i].qs[k] = (uint8_t)sol.pts[k];
            y[i].qh[k / 4] |= (uint8_t)(((sol.pts[k] >> 8) & 3) << (2 * (k % 4)));
        }
        memcpy(y[i].qs + QK_K / 8, sol.signs, QK_K / 8);
        for (int ib = 0; ib < QK_K / 32; ib++) y[i].scales[ib] = (uint8_t)(sol.ls[2 * ib] | sol.ls[2 * ib + 1] << 4);
    }
}
