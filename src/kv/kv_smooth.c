/* Smoothing: a sequence's K and V rows are stored minus per-channel means,
 * one head_dim vector per (layer, half, KV head), fixed at the sequence's
 * first write from its rows in page 0 and owned by page 0. Quantization then
 * spends its levels on what varies between tokens instead of on a constant
 * offset; attention stays exact (kv.h, enum kv_smooth). */
#include <assert.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "kv/kv_internal.h"

static const char *const SMOOTH_NAMES[] = {
    [KV_SMOOTH_OFF] = "off", [KV_SMOOTH_K] = "k", [KV_SMOOTH_V] = "v", [KV_SMOOTH_KV] = "kv"};

const char *kv_smooth_name(enum kv_smooth s)
{
    return (unsigned)s <= KV_SMOOTH_KV ? SMOOTH_NAMES[s] : "?";
}

ks_status kv_parse_smooth(const char *text, enum kv_smooth *out)
{
    for (int s = KV_SMOOTH_OFF; text && s <= KV_SMOOTH_KV; s++)
        if (!strcmp(text, SMOOTH_NAMES[s])) {
            *out = (enum kv_smooth)s;
            return KS_OK;
        }
    return ks_fail(KS_ERR_INVALID_ARG, "--kv-smooth '%s': use off, k, v or kv", text ? text : "");
}

/* ---- the means' storage -------------------------------------------------------- */

size_t kv_mean_floats(const struct kv_config *cfg)
{
    return (size_t)cfg->n_layer * 2 * (size_t)cfg->n_kv_head * (size_t)cfg->head_dim;
}

struct kv_mean *kv_mean_new(const struct kv_config *cfg, bool has_k, bool has_v)
{
    struct kv_mean *m = calloc(1, sizeof *m);
    if (!m)
        return NULL;
    m->mu = calloc(kv_mean_floats(cfg), sizeof *m->mu);
    m->fixed = calloc((size_t)cfg->n_layer, sizeof *m->fixed);
    if (!m->mu || !m->fixed) {
        kv_mean_free(m);
        return NULL;
    }
    m->has_k = has_k;
    m->has_v = has_v;
    return m;
}

void kv_mean_free(struct kv_mean *m)
{
    if (!m)
        return;
    free(m->mu);
    free(m->fixed);
    free(m);
}

struct kv_mean *kv_mean_clone(const struct kv_config *cfg, const struct kv_mean *m)
{
    struct kv_mean *c = kv_mean_new(cfg, m->has_k, m->has_v);
    if (!c)
        return NULL;
    memcpy(c->mu, m->mu, kv_mean_floats(cfg) * sizeof *c->mu);
    memcpy(c->fixed, m->fixed, (size_t)cfg->n_layer * sizeof *c->fixed);
    c->n_fixed = m->n_fixed;
    c->tag = m->tag;
    return c;
}

/* Nonzero, so that 0 can mean "no means". */
static uint64_t mean_tag(const struct kv_config *cfg, const struct kv_mean *m)
{
    uint64_t h = XXH3_64bits_withSeed(m->mu, kv_mean_floats(cfg) * sizeof *m->mu,
                                      (uint64_t)m->has_k | (uint64_t)m->has_v << 1);
    return h ? h : 1;
}

static void fix_layer(const struct kv_config *cfg, struct kv_mean *m, int layer)
{
    assert(!m->fixed[layer] && m->n_fixed < cfg->n_layer);
    m->fixed[layer] = true;
    if (++m->n_fixed == cfg->n_layer)
        m->tag = mean_tag(cfg, m);
}

void kv_mean_fix_all(const struct kv_config *cfg, struct kv_mean *m)
{
    for (int l = 0; l < cfg->n_layer; l++)
        m->fixed[l] = true;
    m->n_fixed = cfg->n_layer;
    m->tag = mean_tag(cfg, m);
}

const float *kv_mean_row(const struct kv_config *cfg, const struct kv_mean *m, int layer, int half, int head)
{
    if (!m || !(half ? m->has_v : m->has_k))
        return NULL;
    assert(layer >= 0 && layer < cfg->n_layer && head >= 0 && head < cfg->n_kv_head);
    return m->mu + (((size_t)layer * 2 + (size_t)half) * (size_t)cfg->n_kv_head + (size_t)head) * cfg->head_dim;
}

/* ---- a sequence's means ------------------------------------------------------------ */

const struct kv_mean *kv_seq_means(const struct kv_cache *kv, const struct kv_seq *s)
{
    return s->n_pages > 0 ? kv->pages[kv_seq_page_id(kv, s, 0)].mean : NULL;
}

uint64_t kv_seq_mean_tag(const struct kv_cache *kv, const struct kv_seq *s)
{
    const struct kv_mean *m = kv_seq_means(kv, s);
    return m ? m->tag : 0;
}

const float *kv_seq_mean(const struct kv_cache *kv, int32_t seq, int layer, bool v)
{
    assert(kv_seq_exists(kv, seq));
    return kv_mean_row(&kv->cfg, kv_seq_means(kv, &kv->seqs[seq]), layer, v, 0);
}

/* mu = the mean of the n rows (stride kv_dim floats) of one head, rotated as
 * they will be stored. */
static void mean_of_rows(const struct kv_cache *kv, const float *rows, int32_t n, int head, float *mu)
{
    const struct kv_config *c = &kv->cfg;
    size_t kv_dim = (size_t)c->n_kv_head * c->head_dim;
    memset(mu, 0, (size_t)c->head_dim * sizeof *mu);
    for (int32_t t = 0; t < n; t++) {
        memcpy(kv->scratch, rows + t * kv_dim + (size_t)head * c->head_dim, (size_t)c->head_dim * sizeof(float));
        if (c->rotate)
            kv_rotate(kv->scratch, c->head_dim);
        for (int e = 0; e < c->head_dim; e++)
            mu[e] += kv->scratch[e];
    }
    for (int e = 0; e < c->head_dim; e++)
        mu[e] /= (float)n;
}

ks_status kv_seq_fix_means(struct kv_cache *kv, struct kv_seq *s, int layer, int32_t pos, int32_t n, const float *k,
                           const float *v)
{
    const struct kv_config *c = &kv->cfg;
    const struct kv_mean *have = kv_seq_means(kv, s);
    if (have ? have->fixed[layer] : (c->smooth == KV_SMOOTH_OFF || pos != 0))
        return KS_OK;
    /* the means belong to page 0, which may be shared (a fork before its first write) */
    ks_status st = kv_page_make_private(kv, s, 0);
    if (st)
        return st;
    struct kv_page *pg0 = &kv->pages[kv_seq_page_id(kv, s, 0)];
    if (!pg0->mean &&
        !(pg0->mean = kv_mean_new(c, c->smooth & KV_SMOOTH_K, c->smooth & KV_SMOOTH_V)))
        return ks_fail(KS_ERR_NOMEM, "kv cache: out of host memory for a sequence's channel means");
    struct kv_mean *m = pg0->mean;
    int32_t in_page0 = pos == 0 ? (n < c->page_tokens ? n : c->page_tokens) : 0;
    const float *src[2] = {k, v};
    for (int half = 0; half < 2 && in_page0 > 0; half++)
        for (int h = 0; h < c->n_kv_head; h++) {
            float *mu = (float *)kv_mean_row(c, m, layer, half, h);
            if (mu)
                mean_of_rows(kv, src[half], in_page0, h, mu);
        }
    fix_layer(c, m, layer);
    return KS_OK;
}
