/* kv_usage and kv_fit: what the cache holds and what still fits. */
#include <stdint.h>
#include <string.h>

#include "kv/kv_internal.h"

void kv_usage(const struct kv_cache *kv, struct kv_usage *out)
{
    memset(out, 0, sizeof *out);
    const struct kv_config *c = &kv->cfg;
    out->budget = c->mem_budget;
    out->used = kv->used;
    out->shared_used = kv_pool_used(kv) - kv->used;
    out->free = c->mem_budget - kv_pool_used(kv);
    out->n_pages = kv->n_live_pages + kv->n_idle_pages;
    out->demotions = kv->demotions;
    out->demotion_passes = kv->demotion_passes;
    out->n_idle_pages = kv->n_idle_pages;
    out->idle_bytes = kv->idle_bytes;
    out->n_keyed_pages = (int32_t)kv->map.n;
    out->evictions = kv->evictions;
    out->evicted_to_disk = kv->evicted_to_disk;
    out->attached_pages = kv->attached_pages;
    for (int32_t id = 0; id < kv->n_page_slots; id++) {
        const struct kv_page *pg = &kv->pages[id];
        if (!pg->k)
            continue;
        out->pages_k[kv_type_index(pg->tk)]++;
        out->pages_v[kv_type_index(pg->tv)]++;
        out->n_shared_pages += pg->ref > 1;
        if (pg->kw) {
            out->n_window_pages++;
            out->window_bytes += kv_part_bytes(kv, pg->tk, true) + kv_part_bytes(kv, pg->tv, true);
        }
    }
    out->window_frees = kv->window_frees;
    for (int32_t q = 0; q < kv->n_seq_slots; q++) {
        const struct kv_seq *s = &kv->seqs[q];
        if (!s->live)
            continue;
        out->n_seqs++;
        out->n_tokens += s->len;
        for (int32_t i = 0; i < s->n_pages; i++) {
            const struct kv_page *pg = &kv->pages[s->pages[i]];
            int32_t in_page = s->len - i * c->page_tokens;
            in_page = in_page < c->page_tokens ? in_page : c->page_tokens;
            out->tokens_k[kv_type_index(pg->tk)] += in_page;
            out->tokens_v[kv_type_index(pg->tv)] += in_page;
        }
    }
}

ks_status kv_seq_usage(const struct kv_cache *kv, int32_t seq, struct kv_seq_usage *out)
{
    memset(out, 0, sizeof *out);
    if (seq < 0 || seq >= kv->n_seq_slots || !kv->seqs[seq].live)
        return ks_fail(KS_ERR_NOT_FOUND, "kv cache: sequence %d does not exist", (int)seq);
    const struct kv_seq *s = &kv->seqs[seq];
    out->len = s->len;
    out->n_pages = s->n_pages;
    for (int32_t i = 0; i < s->n_pages; i++) {
        const struct kv_page *pg = &kv->pages[s->pages[i]];
        out->bytes += kv_page_size(kv, pg);
        if (pg->kw) {
            out->n_window_pages++;
            out->window_bytes += kv_part_bytes(kv, pg->tk, true) + kv_part_bytes(kv, pg->tv, true);
        }
        out->pages_k[kv_type_index(pg->tk)]++;
        out->pages_v[kv_type_index(pg->tv)]++;
    }
    return KS_OK;
}

/* The lower of two precisions (higher kv_type_index). */
static enum quant_type lower(enum quant_type a, enum quant_type b)
{
    return kv_type_index(a) >= kv_type_index(b) ? a : b;
}

static bool floor_usable(const struct kv_config *c)
{
    return kv_check_type(c, c->floor, "") == KS_OK;
}

/* What n pages of one sequence cost: the first `protect` at the `hi` types,
 * the rest at `lo`, and the window rows of at most `window` of them at `hi`
 * (a decoding sequence keeps only its last pages' window rows). */
struct fit_cost {
    size_t hi, lo;           /* a page's global rows */
    size_t window_row_bytes; /* a page's window rows, at hi */
    int64_t protect, window;
};

static uint64_t cost_of(const struct fit_cost *f, int64_t n)
{
    int64_t n_hi = n < f->protect ? n : f->protect, n_win = n < f->window ? n : f->window;
    return (uint64_t)n_hi * f->hi + (uint64_t)(n - n_hi) * f->lo + (uint64_t)n_win * f->window_row_bytes;
}

/* The tokens of the most pages whose cost fits in bytes (the cost grows with
 * n), at most INT32_MAX: the longest a sequence can be, and what fits when
 * every layer is windowed (past the window a page then costs nothing). */
static int64_t tokens_fit(const struct fit_cost *f, size_t bytes, int64_t P)
{
    int64_t lo = 0, hi = f->lo ? (int64_t)(bytes / f->lo) + 1 : INT32_MAX / P;
    hi = hi < INT32_MAX / P ? hi : INT32_MAX / P;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo + 1) / 2;
        if (cost_of(f, mid) <= bytes)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo == INT32_MAX / P ? INT32_MAX : lo * P;
}

/* Fit for `avail` free bytes plus `reclaim` bytes that demoting existing
 * pages would free. */
static void fit_bytes(const struct kv_config *c, size_t avail, size_t reclaim, struct kv_fit *out)
{
    int64_t P = c->page_tokens;
    /* pages covering a decoding query's window: [len - window + 1, len] */
    bool freed = c->swa_window > 0 && !c->swa_full && kv_window_layers(c);
    int64_t window = freed ? (c->swa_window + P - 1) / P + 1 : 0;
    for (int i = 0; i < KV_N_TYPES; i++) {
        enum quant_type t = kv_type_at(i);
        size_t w = freed ? kv_page_window_bytes(c, t, t) : 0, g = kv_page_bytes(c, t, t) - w;
        struct fit_cost f = {g, g, w, 0, window};
        out->tokens[i] = kv_check_type(c, t, "") == KS_OK ? tokens_fit(&f, avail, P) : -1;
    }
    size_t start_w = freed ? kv_page_window_bytes(c, c->type_k, c->type_v) : 0;
    size_t start = kv_page_bytes(c, c->type_k, c->type_v) - start_w;
    struct fit_cost f = {start, start, start_w, 0, window};
    out->start = tokens_fit(&f, avail, P);
    struct fit_cost whole = {start + start_w, start + start_w, 0, 0, 0};
    out->chunk = c->policy == KV_POLICY_DYNAMIC && floor_usable(c) ? -1 : tokens_fit(&whole, avail, P);
    if (!floor_usable(c)) {
        out->dynamic = out->start;
        return;
    }
    enum quant_type fk = lower(c->type_k, c->floor), fv = lower(c->type_v, c->floor);
    f.lo = kv_page_bytes(c, fk, fv) - (freed ? kv_page_window_bytes(c, fk, fv) : 0);
    /* the new sequence's sink pages and hot window stay at the start precision */
    f.protect = (c->sink_tokens + P - 1) / P + (c->hot_tokens + P - 1) / P + 1;
    out->dynamic = tokens_fit(&f, avail + reclaim, P);
    if (c->policy == KV_POLICY_DYNAMIC) {
        size_t w_lo = freed ? kv_page_window_bytes(c, fk, fv) : 0;
        whole = (struct fit_cost){start + start_w, f.lo + w_lo, 0, f.protect, 0};
        out->chunk = tokens_fit(&whole, avail + reclaim, P);
    }
}

void kv_fit(const struct kv_cache *kv, struct kv_fit *out)
{
    const struct kv_config *c = &kv->cfg;
    size_t reclaim = 0;
    if (floor_usable(c)) {
        /* every page outside its sequence's sinks and hot window could drop to the floor */
        for (int32_t q = 0; q < kv->n_seq_slots; q++) {
            const struct kv_seq *s = &kv->seqs[q];
            for (int32_t i = 0; s->live && i < s->n_pages; i++) {
                int64_t first = (int64_t)i * c->page_tokens, end = first + c->page_tokens;
                if (first < c->sink_tokens || end > (int64_t)s->len - c->hot_tokens)
                    continue;
                const struct kv_page *pg = &kv->pages[s->pages[i]];
                if (pg->ref != 1)
                    continue;
                size_t now = kv_page_size(kv, pg);
                size_t low = kv_page_size_as(kv, pg, lower(pg->tk, c->floor), lower(pg->tv, c->floor));
                reclaim += now - low;
            }
        }
    }
    size_t peer_idle = kv->peer ? kv->peer->idle_bytes : 0; /* evicted for us when needed */
    fit_bytes(c, c->mem_budget - kv_pool_used(kv) + kv->idle_bytes + peer_idle, reclaim, out);
}

ks_status kv_fit_config(const struct kv_config *cfg, struct kv_fit *out)
{
    memset(out, 0, sizeof *out);
    if (cfg->n_layer <= 0 || cfg->n_kv_head <= 0 || cfg->head_dim <= 0 || cfg->page_tokens <= 0)
        return ks_fail(KS_ERR_INVALID_ARG, "kv fit: the model shape and page size must be positive");
    ks_status st;
    if ((st = kv_check_type(cfg, cfg->type_k, "--cache-type-k")) || (st = kv_check_type(cfg, cfg->type_v, "--cache-type-v")))
        return st;
    fit_bytes(cfg, cfg->mem_budget, 0, out);
    return KS_OK;
}
