/* Live requantization: convert pages between any two KV types in place.
 * Rows are stored rotated whatever their type, so a conversion is a plain
 * dequantize + quantize of each row. */
#include <assert.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kv/kv_internal.h"

static void convert_part(const struct kv_cache *kv, bool window, const void *src, enum quant_type ts, void *dst,
                         enum quant_type td, float *row)
{
    const struct kv_config *c = &kv->cfg;
    int n_layers = window ? kv->n_window_layers : c->n_layer - kv->n_window_layers;
    size_t n_rows = (size_t)n_layers * (size_t)c->n_kv_head * (size_t)c->page_tokens;
    size_t rs = kv->row_bytes[ts], rd = kv->row_bytes[td];
    quant_to_float_fn load = quant_traits(ts)->to_float;
    quant_from_float_fn store = kv_row_quantizer(kv, td);
    for (size_t r = 0; r < n_rows; r++) {
        load((const uint8_t *)src + r * rs, row, c->head_dim);
        store(row, (uint8_t *)dst + r * rd, c->head_dim);
    }
}

static enum quant_type target(enum quant_type want, enum quant_type have)
{
    return want == KV_TYPE_KEEP ? have : want;
}

/* A page's four parts, in the order of kv_convert_pages' fresh storage. */
enum { PART_K, PART_V, PART_KW, PART_VW, N_PARTS };

static void **page_part(struct kv_page *pg, int part)
{
    return part == PART_K ? &pg->k : part == PART_V ? &pg->v : part == PART_KW ? &pg->kw : &pg->vw;
}

/* Allocate the new storage of every part of the page that changes type. */
static ks_status alloc_parts(const struct kv_cache *kv, struct kv_page *pg, enum quant_type nk, enum quant_type nv,
                             void **fresh)
{
    for (int part = 0; part < N_PARTS; part++) {
        bool is_v = part == PART_V || part == PART_VW, window = part >= PART_KW;
        enum quant_type have = is_v ? pg->tv : pg->tk, want = is_v ? nv : nk;
        if (want != have && *page_part(pg, part) && !(fresh[part] = kv_part_alloc(kv, want, window)))
            return ks_fail(KS_ERR_NOMEM, "kv requantize: out of host memory for new page storage");
    }
    return KS_OK;
}

ks_status kv_convert_pages(struct kv_cache *kv, const int32_t *ids, int32_t n, enum quant_type tk,
                           enum quant_type tv)
{
    void **fresh = calloc((size_t)n * N_PARTS + 1, sizeof *fresh);
    float *row = malloc((size_t)kv->cfg.head_dim * sizeof *row);
    ks_status st = KS_OK;
    if (!fresh || !row)
        st = ks_fail(KS_ERR_NOMEM, "kv requantize: out of host memory");
    /* allocate everything first so that a failure changes nothing */
    for (int32_t i = 0; i < n && !st; i++) {
        struct kv_page *pg = &kv->pages[ids[i]];
        st = alloc_parts(kv, pg, target(tk, pg->tk), target(tv, pg->tv), fresh + (size_t)i * N_PARTS);
    }
    if (st) {
        for (int32_t i = 0; fresh && i < N_PARTS * n; i++)
            free(fresh[i]);
        free(fresh);
        free(row);
        return st;
    }
    for (int32_t i = 0; i < n; i++) {
        assert(ids[i] >= 0 && ids[i] < kv->n_page_slots);
        struct kv_page *pg = &kv->pages[ids[i]];
        assert(pg->k && pg->v && (pg->ref > 0 || pg->keyed)); /* live, or idle and cached */
        size_t before = kv_page_size(kv, pg);
        enum quant_type nk = target(tk, pg->tk), nv = target(tv, pg->tv);
        for (int part = 0; part < N_PARTS; part++) {
            void *to = fresh[(size_t)i * N_PARTS + part];
            if (!to)
                continue;
            bool is_v = part == PART_V || part == PART_VW;
            void **at = page_part(pg, part);
            convert_part(kv, part >= PART_KW, *at, is_v ? pg->tv : pg->tk, to, is_v ? nv : nk, row);
            free(*at);
            *at = to;
        }
        pg->tk = nk;
        pg->tv = nv;
        size_t now = kv_page_size(kv, pg);
        assert(kv->used >= before && (pg->ref > 0 || kv->idle_bytes >= before));
        kv->used = kv->used - before + now;
        if (pg->ref == 0) /* an idle cached page */
            kv->idle_bytes = kv->idle_bytes - before + now;
    }
    free(fresh);
    free(row);
    return KS_OK;
}

static bool page_selected(const struct kv_cache *kv, const struct kv_selector *sel, int32_t seq, int32_t idx)
{
    const struct kv_seq *s = &kv->seqs[seq];
    switch (sel->kind) {
    case KV_SELECT_ALL: return true;
    case KV_SELECT_SEQ: return seq == sel->seq;
    case KV_SELECT_OLDER_THAN:
        return (int64_t)(idx + 1) * kv->cfg.page_tokens <= (int64_t)s->len - sel->keep_recent;
    }
    return false;
}

static void select_page(const struct kv_cache *kv, int32_t id, enum quant_type type_k, enum quant_type type_v,
                        uint8_t *mark, int32_t *ids, int32_t *n_change, size_t *after, struct kv_requant_result *r)
{
    mark[id] = 1;
    r->pages_selected++;
    const struct kv_page *pg = &kv->pages[id];
    enum quant_type nk = target(type_k, pg->tk), nv = target(type_v, pg->tv);
    if (nk == pg->tk && nv == pg->tv)
        return;
    ids[(*n_change)++] = id;
    *after = *after - kv_page_size(kv, pg) + kv_page_size_as(kv, pg, nk, nv);
}

static ks_status check_request(const struct kv_cache *kv, const struct kv_selector *sel, enum quant_type tk,
                               enum quant_type tv)
{
    ks_status st;
    if (tk != KV_TYPE_KEEP && (st = kv_check_type(&kv->cfg, tk, "kv requantize: K type")))
        return st;
    if (tv != KV_TYPE_KEEP && (st = kv_check_type(&kv->cfg, tv, "kv requantize: V type")))
        return st;
    if (!sel)
        return ks_fail(KS_ERR_INVALID_ARG, "kv requantize: no selector");
    if (sel->kind == KV_SELECT_SEQ &&
        (sel->seq < 0 || sel->seq >= kv->n_seq_slots || !kv->seqs[sel->seq].live))
        return ks_fail(KS_ERR_NOT_FOUND, "kv requantize: sequence %d does not exist", (int)sel->seq);
    if (sel->kind == KV_SELECT_OLDER_THAN && sel->keep_recent < 0)
        return ks_fail(KS_ERR_INVALID_ARG, "kv requantize: keep_recent must not be negative");
    if (sel->max_pages < 0)
        return ks_fail(KS_ERR_INVALID_ARG, "kv requantize: max_pages must not be negative (0 = all)");
    if (sel->kind != KV_SELECT_ALL && sel->kind != KV_SELECT_SEQ && sel->kind != KV_SELECT_OLDER_THAN)
        return ks_fail(KS_ERR_INVALID_ARG, "kv requantize: unknown selector kind %d", (int)sel->kind);
    return KS_OK;
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

ks_status kv_requantize(struct kv_cache *kv, const struct kv_selector *sel, enum quant_type type_k,
                        enum quant_type type_v, bool dry_run, struct kv_requant_result *result)
{
    struct kv_requant_result r = {.bytes_before = kv->used};
    ks_status st = check_request(kv, sel, type_k, type_v);
    if (st)
        return st;
    uint8_t *mark = calloc((size_t)kv->n_page_slots + 1, 1);
    int32_t *ids = malloc(((size_t)kv->n_page_slots + 1) * sizeof *ids);
    if (!mark || !ids) {
        free(mark);
        free(ids);
        return ks_fail(KS_ERR_NOMEM, "kv requantize: out of host memory");
    }
    size_t after = kv->used;
    int32_t n_change = 0;
    for (int32_t q = 0; q < kv->n_seq_slots; q++) {
        const struct kv_seq *s = &kv->seqs[q];
        for (int32_t i = 0; s->live && i < s->n_pages; i++)
            if (!mark[s->pages[i]] && page_selected(kv, sel, q, i))
                select_page(kv, s->pages[i], type_k, type_v, mark, ids, &n_change, &after, &r);
    }
    /* idle cached pages belong to no sequence and are older than any window */
    for (int32_t id = kv->lru_head; sel->kind != KV_SELECT_SEQ && id >= 0; id = kv->pages[id].lru_next)
        select_page(kv, id, type_k, type_v, mark, ids, &n_change, &after, &r);
    int32_t n_convert = sel->max_pages > 0 && sel->max_pages < n_change ? sel->max_pages : n_change;
    r.pages_changed = n_convert;
    r.pages_left = n_change - n_convert;
    r.bytes_after = after;
    size_t shared = kv_pool_used(kv) - kv->used; /* the cache sharing the budget keeps its pages */
    if (after + shared > kv->cfg.mem_budget)
        st = ks_fail(KS_ERR_KV_FULL, "kv requantize: the result needs %zu bytes (and %zu for the draft model's cache), over the KV budget of %zu bytes",
                     after, shared, kv->cfg.mem_budget);
    else if (!dry_run && n_convert > 0) {
        double t0 = now_ms();
        st = kv_convert_pages(kv, ids, n_convert, type_k, type_v);
        r.ms = now_ms() - t0;
        KV_DEBUG_CHECK(kv, "kv_requantize");
    }
    free(mark);
    free(ids);
    if (result) /* filled on KS_ERR_KV_FULL too: it says how much was missing */
        *result = r;
    return st;
}
