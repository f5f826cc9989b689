/* KV row quantizers: each block's scale chosen by least squared error.
 *
 * Weights keep quant_ref.c's quantizers, bit-exact with llama.cpp's files.
 * A KV row is written and read only by kvserve, so it may take whichever
 * scale reconstructs it best, in the same block format (the attention kernels
 * do not change). As in k-quants' make_qx_quants, a few trial scales map the
 * block's largest value to levels near the grid's end; for each, the levels
 * are rounded and the scale refitted by least squares, twice. The reference
 * quantizer's own block is candidate zero, so the chosen block's error is
 * never larger than the plain one's. */
#include <math.h>
#include <string.h>

#include "quant/quant_internal.h"

enum {
    SEARCH_STEPS = 6,    /* trial targets anchor * (1 + s / SEARCH_DIVISOR), |s| <= SEARCH_STEPS */
    SEARCH_DIVISOR = 64, /* about 0.1 level apart at q4_0's -8, as make_qx_quants steps */
    REFITS = 2,          /* round, refit the scale, and round again with it */
    MAX_BLOCK = 32,
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
        float l = roundf(x[j] * inv_d);
        level[j] = (int8_t)(l < (float)g->lo ? g->lo : l > (float)g->hi ? g->hi : l);
    }
}

/* The scale minimizing sum (x - d * level)^2 for these levels. */
static float fit_scale(const float *x, int n, const int8_t *level)
{
    float xl = 0.0f, ll = 0.0f;
    for (int j = 0; j < n; j++) {
        xl += x[j] * level[j];
        ll += (float)(level[j] * level[j]);
    }
    return ll > 0.0f ? xl / ll : 0.0f;
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

struct candidate {
    int8_t level[MAX_BLOCK];
    quant_f16 d;
    float err;
};

/* Round x at trial scale d, then refit: keep into best whatever beats it. */
static void try_scale(const float *x, int n, float d, const struct kv_grid *g, struct candidate *best)
{
    struct candidate c;
    for (int r = 0; r < REFITS && d != 0.0f && isfinite(d); r++) {
        round_levels(x, n, 1.0f / d, g, c.level);
        c.d = quant_f32_to_f16(fit_scale(x, n, c.level));
        d = quant_f16_to_f32(c.d);
        c.err = block_error(x, n, c.level, d);
        if (c.err < best->err)
            *best = c;
    }
}

static void search_block(const float *x, int n, const struct kv_grid *g, quant_from_float_fn plain, void *block)
{
    plain(x, block, n);
    struct candidate best;
    float d0;
    g->decode(block, best.level, &d0);
    best.err = block_error(x, n, best.level, d0);
    float m = signed_absmax(x, n);
    if (m == 0.0f || !isfinite(best.err))
        return;
    float plain_err = best.err;
    for (int a = 0; a < g->n_anchors; a++)
        for (int s = -SEARCH_STEPS; s <= SEARCH_STEPS; s++) {
            float target = (float)g->anchors[a] * (1.0f + (float)s / SEARCH_DIVISOR);
            try_scale(x, n, m / target, g, &best);
        }
    if (best.err < plain_err)
        g->encode(best.level, best.d, block);
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
