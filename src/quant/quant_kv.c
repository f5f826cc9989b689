/* KV row quantizers: each block's scale chosen by least squared error.
 *
 * Weights keep quant_ref.c's quantizers, bit-exact with llama.cpp's files.
 * A KV row is written and read only by kvserve, so it may take whichever
 * scale reconstructs it best, in the same block format (the attention kernels
 * do not change). As in k-quants' make_qx_quants, a few trial scales map the
 * block's largest value to levels near the grid's end; for each, the levels
 * are rounded and the scale refitted by least squares, and the winner is
 * rounded again at its own f16 scale (REFITS times). The reference
 * quantizer's own block is candidate zero, so the chosen block's error is
 * never larger than the plain one's. */
#include <math.h>
#include <string.h>

#include "quant/quant_internal.h"

enum {
    SEARCH_DIVISOR = 64, /* trial targets anchor * (1 + s / SEARCH_DIVISOR), |s| <= the grid's steps */
    REFITS = 1,          /* rounds at the winner's refitted scale */
    MAX_BLOCK = 32,
    LANES = 8,           /* divides every block size */
};

/* A block format as the search sees it: integer levels lo..hi times an f16
 * scale. */
struct kv_grid {
    int lo, hi;
    const int8_t *values; /* NULL: levels lo..hi; else the table of levels (iq4_nl, iq3_nl) */
    int n_values;
    int steps;           /* trial targets per side of each anchor: about 0.1 level apart at 4 bits */
    int n_anchors;
    int anchors[2];      /* levels the largest value is aimed at */
    size_t block_bytes;
    void (*encode)(const int8_t *level, quant_f16 d, void *block);
    void (*decode)(const void *block, int8_t *level, float *d);
};

static void q4_0_encode(const int8_t *level, quant_f16 d, void *vb)
{
    block_q4_0 *b = vb;
    b->d = d;
    for (int j = 0; j < QK4_0 / 2; j++)
        b->qs[j] = (uint8_t)((level[j] + 8) | ((level[j + QK4_0 / 2] + 8) << 4));
}

static void q4_0_decode(const void *vb, int8_t *level, float *d)
{
    const block_q4_0 *b = vb;
    *d = quant_f16_to_f32(b->d);
    for (int j = 0; j < QK4_0 / 2; j++) {
        level[j] = (int8_t)((b->qs[j] & 0x0f) - 8);
        level[j + QK4_0 / 2] = (int8_t)((b->qs[j] >> 4) - 8);
    }
}

static void q8_0_encode(const int8_t *level, quant_f16 d, void *vb)
{
    block_q8_0 *b = vb;
    b->d = d;
    memcpy(b->qs, level, QK8_0);
}

static void q8_0_decode(const void *vb, int8_t *level, float *d)
{
    const block_q8_0 *b = vb;
    *d = quant_f16_to_f32(b->d);
    memcpy(level, b->qs, QK8_0);
}

/* The 5th bits: bit j of qh belongs to element j, as in q5_0_to_float. */
static void q5_encode_bits(const uint8_t *u, uint8_t *qs, uint8_t *qh_bytes)
{
    uint32_t qh = 0;
    for (int j = 0; j < 16; j++) {
        qs[j] = (uint8_t)((u[j] & 0x0f) | (u[j + 16] & 0x0f) << 4);
        qh |= (uint32_t)(u[j] >> 4) << j | (uint32_t)(u[j + 16] >> 4) << (j + 16);
    }
    memcpy(qh_bytes, &qh, sizeof qh);
}

static void q5_decode_bits(const uint8_t *qs, const uint8_t *qh_bytes, uint8_t *u)
{
    uint32_t qh;
    memcpy(&qh, qh_bytes, sizeof qh);
    for (int j = 0; j < 16; j++) {
        u[j] = (uint8_t)((qs[j] & 0x0f) | ((qh >> j) & 1) << 4);
        u[j + 16] = (uint8_t)((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
    }
}

static void q5_0_encode(const int8_t *level, quant_f16 d, void *vb)
{
    block_q5_0 *b = vb;
    uint8_t u[QK5_0];
    for (int j = 0; j < QK5_0; j++)
        u[j] = (uint8_t)(level[j] + 16);
    b->d = d;
    q5_encode_bits(u, b->qs, b->qh);
}

static void q5_0_decode(const void *vb, int8_t *level, float *d)
{
    const block_q5_0 *b = vb;
    uint8_t u[QK5_0];
    q5_decode_bits(b->qs, b->qh, u);
    *d = quant_f16_to_f32(b->d);
    for (int j = 0; j < QK5_0; j++)
        level[j] = (int8_t)(u[j] - 16);
}

static void iq4_nl_encode(const int8_t *level, quant_f16 d, void *vb)
{
    block_iq4_nl *b = vb;
    b->d = d;
    for (int j = 0; j < QK4_NL / 2; j++)
        b->qs[j] = (uint8_t)(quant_nearest_level(quant_iq4nl_values, 16, level[j]) |
                             quant_nearest_level(quant_iq4nl_values, 16, level[j + QK4_NL / 2]) << 4);
}

static void iq4_nl_decode(const void *vb, int8_t *level, float *d)
{
    const block_iq4_nl *b = vb;
    *d = quant_f16_to_f32(b->d);
    for (int j = 0; j < QK4_NL / 2; j++) {
        level[j] = quant_iq4nl_values[b->qs[j] & 0x0f];
        level[j + QK4_NL / 2] = quant_iq4nl_values[b->qs[j] >> 4];
    }
}

static void iq3_nl_encode(const int8_t *level, quant_f16 d, void *vb)
{
    block_iq3_nl *b = vb;
    uint8_t idx[QK3_NL];
    for (int j = 0; j < QK3_NL; j++)
        idx[j] = (uint8_t)quant_nearest_level(quant_iq3nl_values, 8, level[j]);
    b->d = d;
    quant_iq3nl_pack(idx, b);
}

static void iq3_nl_decode(const void *vb, int8_t *level, float *d)
{
    const block_iq3_nl *b = vb;
    *d = quant_f16_to_f32(b->d);
    for (int j = 0; j < QK3_NL; j++)
        level[j] = quant_iq3nl_values[quant_iq3nl_index(b, j)];
}

/* q4_0 and q5_0 are asymmetric (-8..7, -16..15): the largest value may sit
 * on either end. q8_0 stays symmetric (-127..127) as the reference keeps it.
 * iq4_nl's levels run -127..113 unevenly; it gets twice the trials, since
 * llama.cpp's reference already tries 15 scales. */
static const struct kv_grid g_q4_0 = {-8, 7, NULL, 0, 3, 2, {-8, 7}, sizeof(block_q4_0), q4_0_encode, q4_0_decode};
static const struct kv_grid g_q5_0 = {-16, 15, NULL, 0, 3, 2, {-16, 15}, sizeof(block_q5_0), q5_0_encode,
                                      q5_0_decode};
static const struct kv_grid g_q8_0 = {-127, 127, NULL, 0, 3, 1, {127, 0}, sizeof(block_q8_0), q8_0_encode,
                                      q8_0_decode};
static const struct kv_grid g_iq4_nl = {-127, 113, quant_iq4nl_values, 16, 6, 2, {-127, 113}, sizeof(block_iq4_nl),
                                        iq4_nl_encode, iq4_nl_decode};
/* iq3_nl's levels are symmetric, so one end is enough; with 8 levels the
 * best scale lies further from max / 127 than at 4 bits (clipping the
 * largest value often pays), hence twice iq4_nl's spread (+-19%). */
static const struct kv_grid g_iq3_nl = {-127, 127, quant_iq3nl_values, 8, 12, 1, {127, 0}, sizeof(block_iq3_nl),
                                        iq3_nl_encode, iq3_nl_decode};

static float signed_absmax(const float *x, int n)
{
    float m = 0.0f;
    for (int j = 0; j < n; j++)
        if (fabsf(x[j]) > fabsf(m))
            m = x[j];
    return m;
}

/* The grid's level nearest v (v in units of the scale). */
static inline float snap(const struct kv_grid *g, float v)
{
    if (g->values)
        return (float)g->values[quant_nearest_level(g->values, g->n_values, v)];
    float l = nearbyintf(v), lo = (float)g->lo, hi = (float)g->hi;
    return l < lo ? lo : l > hi ? hi : l; /* not fminf: a libm call that keeps NaN rules */
}

static void round_levels(const float *x, int n, float inv_d, const struct kv_grid *g, int8_t *level)
{
    for (int j = 0; j < n; j++)
        level[j] = (int8_t)snap(g, x[j] * inv_d);
}

static float block_error(const float *x, int n, const int8_t *level, float d)
{
    float e = 0.0f;
    for (int j = 0; j < n; j++) {
        float r = x[j] - d * (float)level[j];
        e += r * r;
    }
    return e;
}

/* At trial scale d: the levels' sums of x * level and level^2, the refitted
 * f16 scale, and the error it leaves (sum x^2 - 2 d sum(x l) + d^2 sum(l^2),
 * in double: for q8_0 it is a small difference of large terms). */
struct trial {
    quant_f16 d;
    double err;
};

static struct trial try_scale(const float *x, int n, float d, double xx, const struct kv_grid *g)
{
    struct trial t = {0, INFINITY};
    if (d == 0.0f || !isfinite(d))
        return t;
    /* LANES partial sums: one running sum would wait on each add */
    float inv = 1.0f / d, xls[LANES] = {0}, lls[LANES] = {0};
    for (int j = 0; j < n; j += LANES)
        for (int i = 0; i < LANES; i++) {
            float l = snap(g, x[j + i] * inv);
            xls[i] += x[j + i] * l;
            lls[i] += l * l;
        }
    float xl = 0.0f, ll = 0.0f;
    for (int i = 0; i < LANES; i++) {
        xl += xls[i];
        ll += lls[i];
    }
    if (ll == 0.0f)
        return t;
    t.d = quant_f32_to_f16(xl / ll);
    double dh = quant_f16_to_f32(t.d);
    t.err = xx - 2.0 * dh * xl + dh * dh * ll;
    return t;
}

static void search_block(const float *x, int n, const struct kv_grid *g, quant_from_float_fn plain, void *block)
{
    plain(x, block, n);
    int8_t level[MAX_BLOCK];
    float d;
    g->decode(block, level, &d);
    float plain_err = block_error(x, n, level, d);
    float m = signed_absmax(x, n);
    if (m == 0.0f || !isfinite(plain_err))
        return;
    double xx = 0.0;
    for (int j = 0; j < n; j++)
        xx += (double)x[j] * x[j];
    struct trial best = {0, INFINITY};
    for (int a = 0; a < g->n_anchors; a++)
        for (int s = -g->steps; s <= g->steps; s++) {
            float target = (float)g->anchors[a] * (1.0f + (float)s / SEARCH_DIVISOR);
            struct trial t = try_scale(x, n, m / target, xx, g);
            if (t.err < best.err)
                best = t;
        }
    /* round once more at the winner's own scale; keep what the exact error says is better */
    for (int r = 0; r < REFITS && isfinite(best.err); r++) {
        float dh = quant_f16_to_f32(best.d);
        if (dh == 0.0f || !isfinite(dh)) /* the f16 scale underflowed or overflowed */
            break;
        round_levels(x, n, 1.0f / dh, g, level);
        float err = block_error(x, n, level, dh);
        if (!(err < plain_err))
            break;
        plain_err = err;
        g->encode(level, best.d, block);
        best = try_scale(x, n, dh, xx, g);
    }
}

static void search_row(const float *x, void *vy, int64_t n, const struct kv_grid *g, int block_elems,
                       quant_from_float_fn plain)
{
    uint8_t *y = vy;
    for (int64_t i = 0; i < n / block_elems; i++)
        search_block(x + i * block_elems, block_elems, g, plain, y + i * g->block_bytes);
}

static void q4_0_kv_from_float(const float *x, void *y, int64_t n)
{
    search_row(x, y, n, &g_q4_0, QK4_0, quant_q4_0_from_float_ref);
}

static void q8_0_kv_from_float(const float *x, void *y, int64_t n)
{
    search_row(x, y, n, &g_q8_0, QK8_0, quant_q8_0_from_float_ref);
}

static void q5_0_kv_from_float(const float *x, void *y, int64_t n)
{
    search_row(x, y, n, &g_q5_0, QK5_0, quant_q5_0_from_float_ref);
}

static void iq4_nl_kv_from_float(const float *x, void *y, int64_t n)
{
    search_row(x, y, n, &g_iq4_nl, QK4_NL, quant_iq4_nl_from_float_ref);
}

static void iq3_nl_kv_from_float(const float *x, void *y, int64_t n)
{
    search_row(x, y, n, &g_iq3_nl, QK3_NL, quant_iq3_nl_from_float_ref);
}

/* ---- q4_1 and q5_1: x = d * level + m, levels 0..nmax -------------------
 * As k-quants' make_qkx quantizers: trial scales map the block's range
 * [min, max] onto nmax +- AFFINE_SPREAD levels; for each, the levels are
 * rounded from min and both d and m refitted by least squares. */

enum {
    AFFINE_STEPS = 8,   /* trials per side: nmax + s / AFFINE_DIVISOR levels over the range */
    AFFINE_DIVISOR = 8, /* spread +-1 level, as make_qkx2_quants' rmin -1, rdelta 0.1 */
};

struct kv_affine_grid {
    int nmax;
    size_t block_bytes;
    void (*encode)(const uint8_t *level, quant_f16 d, quant_f16 m, void *block);
    void (*decode)(const void *block, uint8_t *level, float *d, float *m);
};

static void q4_1_encode(const uint8_t *level, quant_f16 d, quant_f16 m, void *vb)
{
    block_q4_1 *b = vb;
    b->d = d;
    b->m = m;
    for (int j = 0; j < QK4_1 / 2; j++)
        b->qs[j] = (uint8_t)(level[j] | level[j + QK4_1 / 2] << 4);
}

static void q4_1_decode(const void *vb, uint8_t *level, float *d, float *m)
{
    const block_q4_1 *b = vb;
    *d = quant_f16_to_f32(b->d);
    *m = quant_f16_to_f32(b->m);
    for (int j = 0; j < QK4_1 / 2; j++) {
        level[j] = b->qs[j] & 0x0f;
        level[j + QK4_1 / 2] = b->qs[j] >> 4;
    }
}

static void q5_1_encode(const uint8_t *level, quant_f16 d, quant_f16 m, void *vb)
{
    block_q5_1 *b = vb;
    b->d = d;
    b->m = m;
    q5_encode_bits(level, b->qs, b->qh);
}

static void q5_1_decode(const void *vb, uint8_t *level, float *d, float *m)
{
    const block_q5_1 *b = vb;
    *d = quant_f16_to_f32(b->d);
    *m = quant_f16_to_f32(b->m);
    q5_decode_bits(b->qs, b->qh, level);
}

static const struct kv_affine_grid g_q4_1 = {15, sizeof(block_q4_1), q4_1_encode, q4_1_decode};
static const struct kv_affine_grid g_q5_1 = {31, sizeof(block_q5_1), q5_1_encode, q5_1_decode};

static void round_affine(const float *x, int n, float d, float m, int nmax, uint8_t *level)
{
    float inv = 1.0f / d;
    for (int j = 0; j < n; j++) {
        float l = nearbyintf((x[j] - m) * inv);
        level[j] = (uint8_t)(l < 0.0f ? 0.0f : l > (float)nmax ? (float)nmax : l);
    }
}

static float affine_error(const float *x, int n, const uint8_t *level, float d, float m)
{
    float e = 0.0f;
    for (int j = 0; j < n; j++) {
        float r = x[j] - (d * (float)level[j] + m);
        e += r * r;
    }
    return e;
}

struct affine_trial {
    quant_f16 d, m;
    double err;
};

/* The block's sums of x and x^2: the same for every trial. */
struct affine_sums {
    double x, xx;
};

/* Levels rounded at inverse scale inv from lo; d and m solved from the 2x2
 * normal equations, rounded to f16, and the error they leave. */
static struct affine_trial try_affine(const float *x, int n, float lo, float inv, int nmax, struct affine_sums s)
{
    struct affine_trial t = {0, 0, INFINITY};
    float top = (float)nmax, xls[LANES] = {0}, lls[LANES] = {0}, ls[LANES] = {0};
    for (int j = 0; j < n; j += LANES)
        for (int i = 0; i < LANES; i++) {
            float l = nearbyintf((x[j + i] - lo) * inv);
            l = l < 0.0f ? 0.0f : l > top ? top : l;
            xls[i] += x[j + i] * l;
            lls[i] += l * l;
            ls[i] += l;
        }
    double xl = 0.0, ll = 0.0, l1 = 0.0;
    for (int i = 0; i < LANES; i++) {
        xl += xls[i];
        ll += lls[i];
        l1 += ls[i];
    }
    double det = n * ll - l1 * l1;
    if (!(det > 0.0))
        return t;
    t.d = quant_f32_to_f16((float)((n * xl - l1 * s.x) / det));
    t.m = quant_f32_to_f16((float)((ll * s.x - l1 * xl) / det));
    double d = quant_f16_to_f32(t.d), m = quant_f16_to_f32(t.m);
    t.err = s.xx + d * d * ll + n * m * m - 2.0 * d * xl - 2.0 * m * s.x + 2.0 * d * m * l1;
    return t;
}

static void search_affine_block(const float *x, int n, const struct kv_affine_grid *g, quant_from_float_fn plain,
                                void *block)
{
    plain(x, block, n);
    uint8_t level[MAX_BLOCK];
    float d, m;
    g->decode(block, level, &d, &m);
    float plain_err = affine_error(x, n, level, d, m);
    float lo = x[0], hi = x[0];
    struct affine_sums s = {0.0, 0.0};
    for (int j = 0; j < n; j++) {
        lo = x[j] < lo ? x[j] : lo;
        hi = x[j] > hi ? x[j] : hi;
        s.x += x[j];
        s.xx += (double)x[j] * x[j];
    }
    if (!(hi > lo) || !isfinite(plain_err) || !isfinite(hi - lo))
        return;
    struct affine_trial best = {0, 0, INFINITY};
    for (int k = -AFFINE_STEPS; k <= AFFINE_STEPS; k++) {
        float inv = ((float)g->nmax + (float)k / AFFINE_DIVISOR) / (hi - lo);
        struct affine_trial t = try_affine(x, n, lo, inv, g->nmax, s);
        if (t.err < best.err)
            best = t;
    }
    /* the sums' error is in double; the rounded winner is checked exactly */
    float dh = quant_f16_to_f32(best.d), mh = quant_f16_to_f32(best.m);
    if (!isfinite(best.err) || dh <= 0.0f || !isfinite(dh) || !isfinite(mh))
        return;
    round_affine(x, n, dh, mh, g->nmax, level);
    if (affine_error(x, n, level, dh, mh) < plain_err)
        g->encode(level, best.d, best.m, block);
}

static void search_affine_row(const float *x, void *vy, int64_t n, const struct kv_affine_grid *g,
                              quant_from_float_fn plain)
{
    uint8_t *y = vy;
    for (int64_t i = 0; i < n / MAX_BLOCK; i++)
        search_affine_block(x + i * MAX_BLOCK, MAX_BLOCK, g, plain, y + i * g->block_bytes);
}

static void q4_1_kv_from_float(const float *x, void *y, int64_t n)
{
    search_affine_row(x, y, n, &g_q4_1, quant_q4_1_from_float_ref);
}

static void q5_1_kv_from_float(const float *x, void *y, int64_t n)
{
    search_affine_row(x, y, n, &g_q5_1, quant_q5_1_from_float_ref);
}

void quant_kv_fill(struct quant_traits *t)
{
    t[QUANT_Q4_0].kv_from_float = q4_0_kv_from_float;
    t[QUANT_Q4_1].kv_from_float = q4_1_kv_from_float;
    t[QUANT_Q5_1].kv_from_float = q5_1_kv_from_float;
    t[QUANT_Q5_0].kv_from_float = q5_0_kv_from_float;
    t[QUANT_Q8_0].kv_from_float = q8_0_kv_from_float;
    t[QUANT_IQ4_NL].kv_from_float = iq4_nl_kv_from_float;
    t[QUANT_IQ3_NL].kv_from_float = iq3_nl_kv_from_float;
}
