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
    SEARCH_STEPS = 3,    /* trial targets anchor * (1 + s / SEARCH_DIVISOR), |s| <= SEARCH_STEPS */
    SEARCH_DIVISOR = 64, /* about 0.1 level apart at q4_0's -8, as make_qx_quants steps */
    REFITS = 1,          /* rounds at the winner's refitted scale */
    MAX_BLOCK = 32,
    LANES = 8,           /* divides every block size */
};

/* A block format as the search sees it: integer levels lo..hi times an f16
 * scale. */
struct kv_grid {
    int lo, hi;
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

/* q4_0 is asymmetric (-8..7): the largest value may sit on either end.
 * q8_0 stays symmetric (-127..127) as the reference keeps it. */
static const struct kv_grid g_q4_0 = {-8, 7, 2, {-8, 7}, sizeof(block_q4_0), q4_0_encode, q4_0_decode};
static const struct kv_grid g_q8_0 = {-127, 127, 1, {127, 0}, sizeof(block_q8_0), q8_0_encode, q8_0_decode};

static float signed_absmax(const float *x, int n)
{
    float m = 0.0f;
    for (int j = 0; j < n; j++)
        if (fabsf(x[j]) > fabsf(m))
            m = x[j];
    return m;
}

static void round_levels(const float *x, int n, float inv_d, const struct kv_grid *g, int8_t *level)
{
    for (int j = 0; j < n; j++) {
        float l = nearbyintf(x[j] * inv_d);
        level[j] = (int8_t)(l < (float)g->lo ? g->lo : l > (float)g->hi ? g->hi : l);
    }
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
    float inv = 1.0f / d, lo = (float)g->lo, hi = (float)g->hi, xls[LANES] = {0}, lls[LANES] = {0};
    for (int j = 0; j < n; j += LANES)
        for (int i = 0; i < LANES; i++) {
            float l = nearbyintf(x[j + i] * inv);
            l = l < lo ? lo : l > hi ? hi : l; /* not fminf: a libm call that keeps NaN rules */
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
        for (int s = -SEARCH_STEPS; s <= SEARCH_STEPS; s++) {
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

void quant_kv_fill(struct quant_traits *t)
{
    t[QUANT_Q4_0].kv_from_float = q4_0_kv_from_float;
    t[QUANT_Q8_0].kv_from_float = q8_0_kv_from_float;
}
