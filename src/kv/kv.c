/* The page pool, sequences and their page tables, and kv_write(). */
#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv/kv_internal.h"

enum { PAGE_ALIGN = 64, MAX_SEQS = 1 << 16 };

void kv_config_default(struct kv_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->page_tokens = 32;
    cfg->type_k = QUANT_F16;
    cfg->type_v = QUANT_F16;
    cfg->rotate = true;
    cfg->scale_search = true;
    cfg->smooth = KV_SMOOTH_OFF;
    cfg->policy = KV_POLICY_STATIC;
    cfg->sink_tokens = 32;
    cfg->hot_tokens = 512;
    cfg->high_watermark = 0.90f;
    cfg->low_watermark = 0.80f;
    cfg->floor = QUANT_Q4_0;
    cfg->ladder[0] = QUANT_Q8_0;
    cfg->ladder[1] = QUANT_Q4_0;
    cfg->n_ladder = 2;
    cfg->prefix_cache = true;
}

/* By KV_INDEX_*: falling precision. */
static const enum quant_type KV_TYPES[KV_N_TYPES] = {
    [KV_INDEX_F32] = QUANT_F32,   [KV_INDEX_F16] = QUANT_F16,   [KV_INDEX_BF16] = QUANT_BF16,
    [KV_INDEX_Q8_0] = QUANT_Q8_0, [KV_INDEX_Q5_1] = QUANT_Q5_1, [KV_INDEX_Q5_0] = QUANT_Q5_0,
    [KV_INDEX_Q4_1] = QUANT_Q4_1, [KV_INDEX_IQ4_NL] = QUANT_IQ4_NL, [KV_INDEX_Q4_0] = QUANT_Q4_0,
    [KV_INDEX_IQ3_NL] = QUANT_IQ3_NL,
};

int kv_type_index(enum quant_type t)
{
    for (int i = 0; i < KV_N_TYPES; i++)
        if (KV_TYPES[i] == t)
            return i;
    return -1;
}

enum quant_type kv_type_at(int index) { return index >= 0 && index < KV_N_TYPES ? KV_TYPES[index] : QUANT_F32; }

/* A literal, not built from KV_TYPES, so that threads may read it at any
 * time; test_kv_types checks it against the table. */
const char *kv_type_names(void) { return "f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, iq4_nl, q4_0, iq3_nl"; }

ks_status kv_check_type(const struct kv_config *cfg, enum quant_type t, const char *what)
{
    if (kv_type_index(t) < 0)
        return ks_fail(KS_ERR_INVALID_ARG, "%s: KV cache type %s is not supported (use one of %s)", what,
                       quant_type_name(t), kv_type_names());
    int block = quant_traits(t)->block_elems;
    if (cfg->head_dim % block != 0)
        return ks_fail(KS_ERR_INVALID_ARG,
                       "%s: KV cache type %s needs head_dim to be a multiple of %d, this model has head_dim %d "
                       "(use f16, bf16 or f32)", what, quant_type_name(t), block, cfg->head_dim);
    return KS_OK;
}

/* Levels in falling precision, each a KV type; usability is the caller's. */
static ks_status check_ladder_order(const enum quant_type *ladder, int n)
{
    if (n < 1 || n > KV_LADDER_MAX)
        return ks_fail(KS_ERR_INVALID_ARG, "--kv-ladder: give 1 to %d types (got %d)", KV_LADDER_MAX, n);
    for (int i = 0; i < n; i++) {
        if (kv_type_index(ladder[i]) < 0)
            return ks_fail(KS_ERR_INVALID_ARG, "--kv-ladder: %s is not a KV cache type (use %s)",
                           quant_type_name(ladder[i]), kv_type_names());
        if (i && kv_type_index(ladder[i]) <= kv_type_index(ladder[i - 1]))
            return ks_fail(KS_ERR_INVALID_ARG,
                           "--kv-ladder: %s after %s does not lower the precision (the order is %s)",
                           quant_type_name(ladder[i]), quant_type_name(ladder[i - 1]), kv_type_names());
    }
    return KS_OK;
}

ks_status kv_parse_type(const char *text, enum quant_type *out)
{
    enum quant_type t;
    if (!text || quant_type_from_name(text, &t) != KS_OK || kv_type_index(t) < 0)
        return ks_fail(KS_ERR_INVALID_ARG, "'%s' is not a KV cache type (use %s)", text ? text : "(none)",
                       kv_type_names());
    *out = t;
    return KS_OK;
}

ks_status kv_parse_ladder(const char *text, struct kv_config *cfg)
{
    enum quant_type ladder[KV_LADDER_MAX];
    int n = 0;
    const char *p = text;
    while (p && *p) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        char name[16];
        if (n == KV_LADDER_MAX)
            return ks_fail(KS_ERR_INVALID_ARG, "--kv-ladder: at most %d types", KV_LADDER_MAX);
        if (len == 0 || len >= sizeof name)
            return ks_fail(KS_ERR_INVALID_ARG, "--kv-ladder '%s': expected types separated by commas", text);
        memcpy(name, p, len);
        name[len] = '\0';
        if (kv_parse_type(name, &ladder[n]) != KS_OK) {
            ks_errmsg_prefix("--kv-ladder");
            return KS_ERR_INVALID_ARG;
        }
        n++;
        p = end ? end + 1 : NULL;
    }
    ks_status st = check_ladder_order(ladder, n);
    if (st)
        return st;
    memcpy(cfg->ladder, ladder, sizeof ladder);
    cfg->n_ladder = n;
    return KS_OK;
}

ks_status kv_check_ladder(const struct kv_config *cfg, bool usable)
{
    if (cfg->n_ladder == 0)
        return KS_OK;
    ks_status st = check_ladder_order(cfg->ladder, cfg->n_ladder);
    for (int i = 0; usable && i < cfg->n_ladder && !st; i++)
        st = kv_check_type(cfg, cfg->ladder[i], "--kv-ladder");
    return st;
}

bool kv_layer_windowed(const struct kv_config *cfg, int layer)
{
    return cfg->swa_window > 0 && layer >= 0 && layer < cfg->n_layer && layer < KV_MAX_LAYERS && cfg->swa_layer[layer];
}

int kv_window_layers(const struct kv_config *cfg)
{
    int n = 0;
    for (int l = 0; l < cfg->n_layer; l++)
        n += kv_layer_windowed(cfg, l);
    return n;
}

static size_t layers_bytes(const struct kv_config *cfg, int n_layers, enum quant_type t)
{
    return (size_t)n_layers * (size_t)cfg->n_kv_head * (size_t)cfg->page_tokens * quant_row_size(t, cfg->head_dim);
}

size_t kv_page_bytes(const struct kv_config *cfg, enum quant_type type_k, enum quant_type type_v)
{
    return layers_bytes(cfg, cfg->n_layer, type_k) + layers_bytes(cfg, cfg->n_layer, type_v);
}

size_t kv_page_window_bytes(const struct kv_config *cfg, enum quant_type type_k, enum quant_type type_v)
{
    int n = kv_window_layers(cfg);
    return layers_bytes(cfg, n, type_k) + layers_bytes(cfg, n, type_v);
}

size_t kv_half_bytes(const struct kv_config *cfg, enum quant_type t) { return layers_bytes(cfg, cfg->n_layer, t); }

size_t kv_part_bytes(const struct kv_cache *kv, enum quant_type t, bool window)
{
    int n = window ? kv->n_window_layers : kv->cfg.n_layer - kv->n_window_layers;
    return layers_bytes(&kv->cfg, n, t);
}

size_t kv_page_size_as(const struct kv_cache *kv, const struct kv_page *pg, enum quant_type tk, enum quant_type tv)
{
    size_t n = kv_part_bytes(kv, tk, false) + kv_part_bytes(kv, tv, false);
    if (pg->kw)
        n += kv_part_bytes(kv, tk, true) + kv_part_bytes(kv, tv, true);
    return n;
}

size_t kv_page_size(const struct kv_cache *kv, const struct kv_page *pg) { return kv_page_size_as(kv, pg, pg->tk, pg->tv); }

static ks_status check_config(const struct kv_config *c)
{
    if (c->n_layer <= 0 || c->n_kv_head <= 0 || c->head_dim <= 0)
        return ks_fail(KS_ERR_INVALID_ARG, "kv cache: n_layer, n_kv_head and head_dim must be positive (got %d, %d, %d)",
                       c->n_layer, c->n_kv_head, c->head_dim);
    int p = c->page_tokens;
    if (p < 16 || p > KV_MAX_PAGE_TOKENS || (p & (p - 1)) != 0)
        return ks_fail(KS_ERR_INVALID_ARG, "--kv-page %d: the page size must be a power of two from 16 to 256", p);
    ks_status st;
    if ((st = kv_check_type(c, c->type_k, "--cache-type-k")) || (st = kv_check_type(c, c->type_v, "--cache-type-v")))
        return st;
    if ((unsigned)c->smooth > KV_SMOOTH_KV)
        return ks_fail(KS_ERR_INVALID_ARG, "--kv-smooth: unknown mode %d (use off, k, v or kv)", (int)c->smooth);
    if (c->swa_window < 0 || (c->swa_window > 0 && c->n_layer > KV_MAX_LAYERS))
        return ks_fail(KS_ERR_INVALID_ARG, "kv cache: sliding window %d over %d layers (the window must not be "
                       "negative, and at most %d layers can be windowed)", (int)c->swa_window, c->n_layer, KV_MAX_LAYERS);
    for (int l = 0; c->swa_window == 0 && l < c->n_layer && l < KV_MAX_LAYERS; l++)
        if (c->swa_layer[l])
            return ks_fail(KS_ERR_INVALID_ARG, "kv cache: layer %d is marked sliding-window but swa_window is 0", l);
    if (c->policy != KV_POLICY_STATIC && c->policy != KV_POLICY_DYNAMIC)
        return ks_fail(KS_ERR_INVALID_ARG, "--kv-policy: unknown policy %d", (int)c->policy);
    if (c->policy == KV_POLICY_DYNAMIC) {
        if (kv_type_index(c->floor) < 0)
            return ks_fail(KS_ERR_INVALID_ARG, "--kv-floor %s: use one of %s", quant_type_name(c->floor),
                           kv_type_names());
        if ((st = kv_check_ladder(c, false)))
            return st;
        if (c->sink_tokens < 0 || c->hot_tokens < 0)
            return ks_fail(KS_ERR_INVALID_ARG, "--kv-sink and --kv-hot must not be negative");
        if (!(c->low_watermark > 0.0f && c->low_watermark <= c->high_watermark && c->high_watermark <= 1.0f))
            return ks_fail(KS_ERR_INVALID_ARG, "kv watermarks must satisfy 0 < low (%g) <= high (%g) <= 1",
                           (double)c->low_watermark, (double)c->high_watermark);
    }
    size_t page = kv_page_bytes(c, c->type_k, c->type_v);
    if (c->mem_budget < page)
        return ks_fail(KS_ERR_INVALID_ARG, "--kv-mem %zu bytes is less than one KV page (%zu bytes at %s/%s, P=%d)",
                       c->mem_budget, page, quant_type_name(c->type_k), quant_type_name(c->type_v), p);
    return KS_OK;
}

ks_status kv_create(const struct kv_config *cfg, struct kv_cache **out)
{
    *out = NULL;
    ks_status st = check_config(cfg);
    if (st)
        return st;
    struct kv_cache *kv = calloc(1, sizeof *kv);
    if (!kv)
        return ks_fail(KS_ERR_NOMEM, "kv cache: out of host memory");
    kv->cfg = *cfg;
    kv->lru_head = kv->lru_tail = -1;
    while ((1 << kv->page_shift) < cfg->page_tokens)
        kv->page_shift++;
    for (int i = 0; i < KV_N_TYPES; i++)
        kv->row_bytes[kv_type_at(i)] = quant_row_size(kv_type_at(i), cfg->head_dim);
    kv->scratch = malloc((size_t)cfg->head_dim * sizeof(float));
    kv->layer_window = calloc((size_t)cfg->n_layer, sizeof *kv->layer_window);
    kv->layer_slot = calloc((size_t)cfg->n_layer, sizeof *kv->layer_slot);
    if (!kv->scratch || !kv->layer_window || !kv->layer_slot) {
        free(kv->scratch);
        free(kv->layer_window);
        free(kv->layer_slot);
        free(kv);
        return ks_fail(KS_ERR_NOMEM, "kv cache: out of host memory");
    }
    int32_t n_part[2] = {0, 0};
    for (int l = 0; l < cfg->n_layer; l++) {
        kv->layer_window[l] = kv_layer_windowed(cfg, l);
        kv->layer_slot[l] = n_part[kv->layer_window[l]]++;
    }
    kv->n_window_layers = n_part[1];
    kv_key_layout(kv, &kv->key_layout);
    *out = kv;
    KV_DEBUG_CHECK(kv, "kv_create");
    return KS_OK;
}

void kv_free(struct kv_cache *kv)
{
    if (!kv)
        return;
    KV_DEBUG_CHECK(kv, "kv_free"); /* the state every call before left */
    if (kv->peer)
        kv->peer->peer = NULL;
    for (int32_t i = 0; i < kv->n_page_slots; i++) {
        free(kv->pages[i].k);
        free(kv->pages[i].v);
        free(kv->pages[i].kw);
        free(kv->pages[i].vw);
        free(kv->pages[i].tokens);
        kv_mean_free(kv->pages[i].mean);
    }
    for (int32_t s = 0; s < kv->n_seq_slots; s++) {
        free(kv->seqs[s].pages);
        free(kv->seqs[s].keys);
    }
    kv_prefix_free(kv);
    free(kv->pages);
    free(kv->free_slots);
    free(kv->seqs);
    free(kv->scratch);
    free(kv->layer_window);
    free(kv->layer_slot);
    free(kv);
}

const struct kv_config *kv_get_config(const struct kv_cache *kv) { return &kv->cfg; }

/* ---- page storage ------------------------------------------------------- */

void *kv_part_alloc(const struct kv_cache *kv, enum quant_type t, bool window)
{
    size_t n = kv_part_bytes(kv, t, window);
    /* never 0 bytes: a page's k pointer marks its slot as used, with or without global layers */
    n = n ? (n + PAGE_ALIGN - 1) / PAGE_ALIGN * PAGE_ALIGN : PAGE_ALIGN;
    void *p = aligned_alloc(PAGE_ALIGN, n);
    if (p)
        memset(p, 0, n); /* unwritten rows read as zeros, never as garbage */
    return p;
}

static ks_status reserve_slot(struct kv_cache *kv, int32_t *id_out)
{
    if (kv->n_free_slots > 0) {
        *id_out = kv->free_slots[--kv->n_free_slots];
        assert(*id_out >= 0 && *id_out < kv->n_page_slots);
        assert(!kv->pages[*id_out].k && !kv->pages[*id_out].v && !kv->pages[*id_out].kw && kv->pages[*id_out].ref == 0 &&
               !kv->pages[*id_out].keyed);
        return KS_OK;
    }
    if (kv->n_page_slots == kv->cap_page_slots) {
        int32_t cap = kv->cap_page_slots ? kv->cap_page_slots * 2 : 64;
        struct kv_page *p = realloc(kv->pages, (size_t)cap * sizeof *p);
        int32_t *f = realloc(kv->free_slots, (size_t)cap * sizeof *f);
        if (p)
            kv->pages = p;
        if (f)
            kv->free_slots = f;
        if (!p || !f)
            return ks_fail(KS_ERR_NOMEM, "kv cache: out of host memory for page metadata");
        kv->cap_page_slots = kv->cap_free_slots = cap;
    }
    *id_out = kv->n_page_slots++;
    memset(&kv->pages[*id_out], 0, sizeof kv->pages[0]);
    kv->pages[*id_out].lru_prev = kv->pages[*id_out].lru_next = -1;
    return KS_OK;
}

static void release_slot(struct kv_cache *kv, int32_t id)
{
    assert(id >= 0 && id < kv->n_page_slots && kv->n_free_slots < kv->cap_free_slots);
    kv->free_slots[kv->n_free_slots++] = id;
}

ks_status kv_page_new(struct kv_cache *kv, enum quant_type tk, enum quant_type tv, int32_t *id_out)
{
    int32_t id = -1;
    ks_status st = reserve_slot(kv, &id);
    if (st)
        return st;
    struct kv_page *pg = &kv->pages[id];
    bool window = kv->n_window_layers > 0;
    pg->k = kv_part_alloc(kv, tk, false);
    pg->v = kv_part_alloc(kv, tv, false);
    pg->kw = window ? kv_part_alloc(kv, tk, true) : NULL;
    pg->vw = window ? kv_part_alloc(kv, tv, true) : NULL;
    if (!pg->k || !pg->v || (window && (!pg->kw || !pg->vw))) {
        free(pg->k);
        free(pg->v);
        free(pg->kw);
        free(pg->vw);
        pg->k = pg->v = pg->kw = pg->vw = NULL;
        release_slot(kv, id);
        return ks_fail(KS_ERR_NOMEM, "kv cache: out of host memory for a page");
    }
    pg->tk = tk;
    pg->tv = tv;
    pg->mean = NULL;
    pg->mean_tag = 0;
    pg->ref = 1;
    pg->birth = kv->next_birth++;
    pg->keyed = pg->on_disk = false;
    pg->hits = 0;
    pg->lru_prev = pg->lru_next = -1;
    kv->used += kv_page_bytes(&kv->cfg, tk, tv);
    assert(kv_pool_used(kv) <= kv->cfg.mem_budget); /* the caller made room */
    kv->n_live_pages++;
    assert(kv->n_live_pages + kv->n_idle_pages + kv->n_free_slots == kv->n_page_slots);
    *id_out = id;
    return KS_OK;
}

void kv_page_release(struct kv_cache *kv, int32_t id)
{
    assert(id >= 0 && id < kv->n_page_slots);
    struct kv_page *pg = &kv->pages[id];
    assert(pg->ref == 0 && !pg->keyed && pg->k && pg->v && pg->lru_prev < 0 && pg->lru_next < 0);
    size_t bytes = kv_page_size(kv, pg);
    assert(kv->used >= bytes);
    kv->used -= bytes;
    free(pg->k);
    free(pg->v);
    free(pg->kw);
    free(pg->vw);
    kv_mean_free(pg->mean);
    pg->k = pg->v = pg->kw = pg->vw = NULL;
    pg->mean = NULL;
    release_slot(kv, id);
}

/* A keyed page outlives its last holder as an idle cached page. */
static void page_unref(struct kv_cache *kv, int32_t id)
{
    assert(id >= 0 && id < kv->n_page_slots);
    struct kv_page *pg = &kv->pages[id];
    assert(pg->ref > 0 && pg->k && pg->v);
    if (--pg->ref > 0)
        return;
    assert(kv->n_live_pages > 0);
    kv->n_live_pages--;
    if (pg->keyed)
        kv_prefix_park(kv, id);
    else
        kv_page_release(kv, id);
}

/* ---- sequences ------------------------------------------------------------ */

static bool seq_valid(const struct kv_cache *kv, int32_t seq)
{
    return seq >= 0 && seq < kv->n_seq_slots && kv->seqs[seq].live;
}

static ks_status seq_not_found(int32_t seq)
{
    return ks_fail(KS_ERR_NOT_FOUND, "kv cache: sequence %d does not exist", (int)seq);
}

ks_status kv_seq_create(struct kv_cache *kv, int32_t *seq_out)
{
    for (int32_t s = 0; s < kv->n_seq_slots; s++)
        if (!kv->seqs[s].live) {
            memset(&kv->seqs[s], 0, sizeof kv->seqs[s]);
            kv->seqs[s].live = true;
            *seq_out = s;
            KV_DEBUG_CHECK(kv, "kv_seq_create");
            return KS_OK;
        }
    if (kv->n_seq_slots >= MAX_SEQS)
        return ks_fail(KS_ERR_RANGE, "kv cache: more than %d live sequences", MAX_SEQS);
    int32_t n = kv->n_seq_slots ? kv->n_seq_slots * 2 : 8;
    struct kv_seq *s = realloc(kv->seqs, (size_t)n * sizeof *s);
    if (!s)
        return ks_fail(KS_ERR_NOMEM, "kv cache: out of host memory for sequences");
    memset(s + kv->n_seq_slots, 0, (size_t)(n - kv->n_seq_slots) * sizeof *s);
    kv->seqs = s;
    int32_t id = kv->n_seq_slots;
    kv->n_seq_slots = n;
    kv->seqs[id].live = true;
    *seq_out = id;
    KV_DEBUG_CHECK(kv, "kv_seq_create");
    return KS_OK;
}

static void seq_drop_pages(struct kv_cache *kv, struct kv_seq *s, int32_t keep_pages)
{
    assert(keep_pages >= 0);
    while (s->n_pages > keep_pages) {
        int32_t id = kv_seq_page_id(kv, s, s->n_pages - 1);
        s->n_pages--;
        page_unref(kv, id);
    }
}

void kv_seq_free(struct kv_cache *kv, int32_t seq)
{
    if (!seq_valid(kv, seq))
        return;
    struct kv_seq *s = &kv->seqs[seq];
    seq_drop_pages(kv, s, 0);
    free(s->pages);
    free(s->keys);
    memset(s, 0, sizeof *s);
    KV_DEBUG_CHECK(kv, "kv_seq_free");
}

int32_t kv_seq_len(const struct kv_cache *kv, int32_t seq)
{
    return seq_valid(kv, seq) ? kv->seqs[seq].len : 0;
}

bool kv_seq_exists(const struct kv_cache *kv, int32_t seq) { return seq_valid(kv, seq); }

int32_t kv_seq_n_pages(const struct kv_cache *kv, int32_t seq)
{
    return seq_valid(kv, seq) ? kv->seqs[seq].n_pages : 0;
}

void kv_seq_page_view(const struct kv_cache *kv, int32_t seq, int32_t p, int layer, struct kv_page_view *out)
{
    assert(seq_valid(kv, seq));
    const struct kv_page *pg = &kv->pages[kv_seq_page_id(kv, &kv->seqs[seq], p)];
    assert(pg->k && pg->v && kv->row_bytes[pg->tk] > 0 && kv->row_bytes[pg->tv] > 0);
    *out = (struct kv_page_view){.k = kv_page_rows(kv, pg, false, layer, 0), .v = kv_page_rows(kv, pg, true, layer, 0),
                                 .tk = pg->tk, .tv = pg->tv, .k_row_bytes = kv->row_bytes[pg->tk],
                                 .v_row_bytes = kv->row_bytes[pg->tv]};
}

int32_t kv_seq_first_page(const struct kv_cache *kv, int32_t seq, int layer)
{
    if (!seq_valid(kv, seq) || layer < 0 || layer >= kv->cfg.n_layer || !kv->layer_window[layer])
        return 0;
    const struct kv_seq *s = &kv->seqs[seq];
    int32_t first = s->swa_from >> kv->page_shift; /* from there on every page has them (kv_check) */
    first = first < s->n_pages ? first : s->n_pages;
    while (first > 0 && kv->pages[s->pages[first - 1]].kw)
        first--;
    return first;
}

/* ---- sliding windows -------------------------------------------------------- */

bool kv_seq_window_intact(const struct kv_cache *kv, const struct kv_seq *s, const int32_t *more, int32_t len)
{
    if (!kv->n_window_layers || kv->cfg.swa_full)
        return true;
    for (int32_t pos = kv_window_start(kv, len) & ~(kv->cfg.page_tokens - 1); pos < len; pos += kv->cfg.page_tokens) {
        int32_t idx = pos >> kv->page_shift;
        int32_t id = idx < s->n_pages ? s->pages[idx] : more[idx - s->n_pages];
        if (!kv_page_has_window(kv, &kv->pages[id]))
            return false;
    }
    return true;
}

int32_t kv_seq_resumable(const struct kv_cache *kv, int32_t seq, int32_t len)
{
    if (!seq_valid(kv, seq))
        return 0;
    const struct kv_seq *s = &kv->seqs[seq];
    len = len < 0 ? 0 : len > s->len ? s->len : len;
    /* the span [start(len), len) moves left with len: below a page without window rows, or empty */
    while (len > 0 && !kv_seq_window_intact(kv, s, NULL, len)) {
        int32_t idx = (len - 1) >> kv->page_shift;
        while (kv_page_has_window(kv, &kv->pages[s->pages[idx]]))
            idx--;
        len = idx << kv->page_shift;
    }
    return len;
}

/* Does a sequence other than seq, holding page id as its page idx, still
 * read idx's window rows? (A shared page sits at the same index in every
 * table: pages are positional.) */
static bool window_needed_elsewhere(const struct kv_cache *kv, int32_t seq, int32_t idx, int32_t id)
{
    int32_t others = kv->pages[id].ref - 1;
    for (int32_t q = 0; q < kv->n_seq_slots && others > 0; q++) {
        const struct kv_seq *t = &kv->seqs[q];
        if (q == seq || !t->live || idx >= t->n_pages || t->pages[idx] != id)
            continue;
        others--;
        if ((int64_t)(idx + 1) * kv->cfg.page_tokens > t->swa_from)
            return true;
    }
    return false;
}

static void page_drop_window(struct kv_cache *kv, int32_t id)
{
    struct kv_page *pg = &kv->pages[id];
    assert(pg->kw && pg->vw && pg->ref > 0);
    size_t bytes = kv_part_bytes(kv, pg->tk, true) + kv_part_bytes(kv, pg->tv, true);
    assert(kv->used >= bytes);
    kv->used -= bytes;
    free(pg->kw);
    free(pg->vw);
    pg->kw = pg->vw = NULL;
    kv->window_frees++;
}

/* seq is about to grow from its len: no query of it reads a window layer
 * below kv_window_start(len) again. Free the window rows of its pages wholly
 * below that which no other holder still reads. */
static void seq_free_window_rows(struct kv_cache *kv, int32_t seq)
{
    struct kv_seq *s = &kv->seqs[seq];
    if (!kv->n_window_layers || kv->cfg.swa_full)
        return;
    s->swa_from = kv_window_start(kv, s->len);
    int32_t end = s->swa_from >> kv->page_shift;
    for (int32_t i = s->swa_scan; i < end; i++) {
        int32_t id = s->pages[i];
        if (kv->pages[id].kw && !window_needed_elsewhere(kv, seq, i, id))
            page_drop_window(kv, id);
    }
    while (s->swa_scan < end && !kv->pages[s->pages[s->swa_scan]].kw)
        s->swa_scan++;
}

int32_t kv_seq_id_limit(const struct kv_cache *kv) { return kv->n_seq_slots; }

ks_status kv_seq_reserve_table(struct kv_seq *s, int32_t n_pages)
{
    if (n_pages <= s->cap_pages)
        return KS_OK;
    int32_t cap = s->cap_pages ? s->cap_pages : 8;
    while (cap < n_pages)
        cap *= 2;
    int32_t *p = realloc(s->pages, (size_t)cap * sizeof *p);
    if (p)
        s->pages = p;
    struct kv_key *k = p ? realloc(s->keys, (size_t)cap * sizeof *k) : NULL;
    if (!k)
        return ks_fail(KS_ERR_NOMEM, "kv cache: out of host memory for a page table");
    s->keys = k;
    s->cap_pages = cap;
    return KS_OK;
}

/* Append add pages to seq, which grows to len tokens, at the types the
 * policy plans for them (all or nothing). */
static ks_status seq_add_pages(struct kv_cache *kv, int32_t seq, int32_t len, int32_t add)
{
    struct kv_seq *s = &kv->seqs[seq];
    enum quant_type *types = malloc(2 * (size_t)add * sizeof *types);
    if (!types)
        return ks_fail(KS_ERR_NOMEM, "kv cache: out of host memory for a page plan");
    int32_t first = s->n_pages;
    struct kv_grow_plan plan = {.seq = seq, .new_len = len, .first_page = first, .n_pages = add,
                                .tk = types, .tv = types + add};
    for (int32_t i = 0; i < add; i++) {
        plan.tk[i] = kv->cfg.type_k;
        plan.tv[i] = kv->cfg.type_v;
    }
    /* the policy may requantize pages of this very sequence; s stays valid
     * because it only touches pages, never page tables */
    ks_status st = kv_policy_plan_grow(kv, &plan);
    for (int32_t i = 0; i < add && !st; i++) {
        int32_t id = -1;
        if ((st = kv_page_new(kv, plan.tk[i], plan.tv[i], &id)))
            seq_drop_pages(kv, s, first);
        else {
            assert(s->n_pages < s->cap_pages);
            s->pages[s->n_pages++] = id;
        }
    }
    free(types);
    return st;
}

static ks_status seq_grow(struct kv_cache *kv, int32_t seq, int32_t n_tokens)
{
    if (!seq_valid(kv, seq))
        return seq_not_found(seq);
    struct kv_seq *s = &kv->seqs[seq];
    if (n_tokens < 0 || (int64_t)s->len + n_tokens > INT32_MAX - kv->cfg.page_tokens)
        return ks_fail(KS_ERR_RANGE, "kv cache: cannot grow sequence %d of %d tokens by %d", (int)seq, (int)s->len,
                       (int)n_tokens);
    int32_t len = s->len + n_tokens;
    int32_t need = (len + kv->cfg.page_tokens - 1) >> kv->page_shift;
    if (n_tokens > 0)
        seq_free_window_rows(kv, seq); /* first, so the policy sees the bytes given back */
    int32_t add = need - s->n_pages;
    ks_status st = kv_seq_reserve_table(s, need);
    if (st)
        return st;
    if (add > 0 && (st = seq_add_pages(kv, seq, len, add)))
        return st;
    s->len = len;
    assert(s->n_pages == need && (int64_t)s->n_pages * kv->cfg.page_tokens >= s->len);
    return KS_OK;
}

ks_status kv_seq_grow(struct kv_cache *kv, int32_t seq, int32_t n_tokens)
{
    ks_status st = seq_grow(kv, seq, n_tokens);
    KV_DEBUG_CHECK(kv, "kv_seq_grow"); /* failures too: all or nothing, and the policy may have run */
    return st;
}

ks_status kv_seq_truncate(struct kv_cache *kv, int32_t seq, int32_t len)
{
    if (!seq_valid(kv, seq))
        return seq_not_found(seq);
    struct kv_seq *s = &kv->seqs[seq];
    if (len < 0 || len > s->len)
        return ks_fail(KS_ERR_RANGE, "kv cache: cannot truncate sequence %d of %d tokens to %d", (int)seq,
                       (int)s->len, (int)len);
    if (!kv_seq_window_intact(kv, s, NULL, len))
        return ks_fail(KS_ERR_STATE,
                       "kv cache: sequence %d cannot continue from %d tokens: the sliding-window rows before it are "
                       "freed (cut it to %d tokens, kv_seq_resumable, and recompute the rest)", (int)seq, (int)len,
                       (int)kv_seq_resumable(kv, seq, len));
    seq_drop_pages(kv, s, (len + kv->cfg.page_tokens - 1) >> kv->page_shift);
    s->len = len;
    int32_t from = kv_window_start(kv, len);
    s->swa_from = from < s->swa_from ? from : s->swa_from;
    s->swa_scan = s->swa_scan < s->n_pages ? s->swa_scan : s->n_pages;
    if (s->n_keyed > len >> kv->page_shift)
        s->n_keyed = len >> kv->page_shift;
    KV_DEBUG_CHECK(kv, "kv_seq_truncate");
    return KS_OK;
}

ks_status kv_seq_fork(struct kv_cache *kv, int32_t src, int32_t *seq_out)
{
    if (!seq_valid(kv, src))
        return seq_not_found(src);
    int32_t id = -1;
    ks_status st = kv_seq_create(kv, &id);
    if (st)
        return st;
    struct kv_seq *from = &kv->seqs[src], *to = &kv->seqs[id];
    if ((st = kv_seq_reserve_table(to, from->n_pages))) {
        kv_seq_free(kv, id);
        return st;
    }
    for (int32_t i = 0; i < from->n_pages; i++) {
        to->pages[i] = kv_seq_page_id(kv, from, i); /* a live page: sharing it never revives one */
        kv->pages[to->pages[i]].ref++;
    }
    memcpy(to->keys, from->keys, (size_t)from->n_keyed * sizeof *to->keys);
    to->n_keyed = from->n_keyed;
    to->root = from->root;
    to->n_pages = from->n_pages;
    to->len = from->len;
    to->swa_from = from->swa_from;
    to->swa_scan = from->swa_scan;
    *seq_out = id;
    KV_DEBUG_CHECK(kv, "kv_seq_fork");
    return KS_OK;
}

/* ---- writing tokens --------------------------------------------------------- */

/* Give seq its own copy of a shared or keyed (immutable) page before writing
 * into it; a page 0 keeps its channel means. */
ks_status kv_page_make_private(struct kv_cache *kv, struct kv_seq *s, int32_t idx)
{
    int32_t old = kv_seq_page_id(kv, s, idx);
    if (kv->pages[old].ref == 1 && !kv->pages[old].keyed)
        return KS_OK;
    /* the dynamic policy may demote this very page while making room (when it
     * lies outside every holder's sinks and hot window): read its types after */
    assert(kv_page_has_window(kv, &kv->pages[old])); /* writes never reach a page before the window */
    ks_status st = kv_policy_make_room(kv, kv_page_bytes(&kv->cfg, kv->pages[old].tk, kv->pages[old].tv));
    enum quant_type tk = kv->pages[old].tk, tv = kv->pages[old].tv;
    const struct kv_mean *mean = kv->pages[old].mean;
    int32_t id = -1;
    if (!st && !(st = kv_page_new(kv, tk, tv, &id))) {
        struct kv_page *pg = &kv->pages[id];
        if (mean && !(pg->mean = kv_mean_clone(&kv->cfg, mean))) {
            pg->ref = 0;
            kv->n_live_pages--;
            kv_page_release(kv, id);
            st = ks_fail(KS_ERR_NOMEM, "kv cache: out of host memory for a sequence's channel means");
        } else {
            memcpy(pg->k, kv->pages[old].k, kv_part_bytes(kv, tk, false));
            memcpy(pg->v, kv->pages[old].v, kv_part_bytes(kv, tv, false));
            if (pg->kw) {
                memcpy(pg->kw, kv->pages[old].kw, kv_part_bytes(kv, tk, true));
                memcpy(pg->vw, kv->pages[old].vw, kv_part_bytes(kv, tv, true));
            }
            s->pages[idx] = id;
            page_unref(kv, old);
        }
    }
    KV_DEBUG_CHECK(kv, "kv_write (copy on write)");
    return st;
}

/* Rotate x into the scratch row, subtract the channel means (NULL: none) and
 * quantize it to dst. */
static void store_row(struct kv_cache *kv, enum quant_type t, const float *x, const float *mu, uint8_t *dst)
{
    const struct kv_config *c = &kv->cfg;
    memcpy(kv->scratch, x, (size_t)c->head_dim * sizeof(float));
    if (c->rotate)
        kv_rotate(kv->scratch, c->head_dim);
    for (int e = 0; mu && e < c->head_dim; e++)
        kv->scratch[e] -= mu[e];
    kv_row_quantizer(kv, t)(kv->scratch, dst, c->head_dim);
}

static ks_status write_token(struct kv_cache *kv, struct kv_seq *s, int layer, int32_t pos, const float *k,
                             const float *v)
{
    const struct kv_config *c = &kv->cfg;
    int32_t idx = pos >> kv->page_shift, t = pos & (c->page_tokens - 1);
    ks_status st = kv_page_make_private(kv, s, idx);
    if (st)
        return st;
    struct kv_page *pg = &kv->pages[kv_seq_page_id(kv, s, idx)];
    assert(pg->ref == 1 && !pg->keyed && s->n_keyed <= idx);
    const struct kv_mean *mean = kv_seq_means(kv, s);
    assert(!mean || mean->fixed[layer]);
    const float *src[2] = {k, v};
    enum quant_type type[2] = {pg->tk, pg->tv};
    for (int kind = 0; kind < 2; kind++) {
        size_t rb = kv->row_bytes[type[kind]];
        for (int h = 0; h < c->n_kv_head; h++)
            store_row(kv, type[kind], src[kind] + (size_t)h * c->head_dim, kv_mean_row(c, mean, layer, kind, h),
                      kv_page_rows(kv, pg, kind, layer, h) + (size_t)t * rb);
    }
    return KS_OK;
}

/* A write needs whole pages (a copy on write copies both parts); a read, the layer's part. */
static ks_status check_rows(const struct kv_cache *kv, int layer, int32_t seq, int32_t pos, int32_t n, bool write)
{
    if (!seq_valid(kv, seq))
        return seq_not_found(seq);
    const struct kv_seq *s = &kv->seqs[seq];
    if (layer < 0 || layer >= kv->cfg.n_layer)
        return ks_fail(KS_ERR_RANGE, "kv_write: layer %d out of [0, %d)", layer, kv->cfg.n_layer);
    if (n < 1 || pos < 0 || pos > s->len - n)
        return ks_fail(KS_ERR_RANGE, "kv_write: positions [%d, %d) outside sequence %d of %d tokens (grow it first)",
                       (int)pos, (int)pos + (int)n, (int)seq, (int)s->len);
    for (int32_t i = pos >> kv->page_shift; (write || kv->layer_window[layer]) && i <= (pos + n - 1) >> kv->page_shift;
         i++)
        if (!kv_page_has_window(kv, &kv->pages[kv_seq_page_id(kv, s, i)]))
            return ks_fail(KS_ERR_STATE, "kv cache: positions [%d, %d) of sequence %d lie before its sliding window: "
                           "their window layers' rows are freed", (int)i * kv->cfg.page_tokens,
                           (int)(i + 1) * kv->cfg.page_tokens, (int)seq);
    return KS_OK;
}

ks_status kv_write_rows(struct kv_cache *kv, int layer, int32_t seq, int32_t pos, int32_t n, const float *k,
                        const float *v)
{
    ks_status st = check_rows(kv, layer, seq, pos, n, true);
    if (st)
        return st;
    struct kv_seq *s = &kv->seqs[seq];
    size_t kv_dim = (size_t)kv->cfg.n_kv_head * kv->cfg.head_dim;
    if ((st = kv_seq_fix_means(kv, s, layer, pos, n, k, v)))
        return st;
    for (int32_t i = 0; i < n && !st; i++)
        st = write_token(kv, s, layer, pos + i, k + i * kv_dim, v + i * kv_dim);
    return st;
}

ks_status kv_write(struct kv_cache *kv, int layer, int32_t seq, int32_t pos, const float *k, const float *v)
{
    return kv_write_rows(kv, layer, seq, pos, 1, k, v);
}

/* Dequantize one stored row, add the channel means back and undo the rotation. */
static void load_row(const struct kv_cache *kv, const struct kv_page *pg, bool v, int layer, int head, int32_t tok,
                     const float *mu, float *out)
{
    const struct kv_config *c = &kv->cfg;
    enum quant_type t = v ? pg->tv : pg->tk;
    const uint8_t *row = kv_page_rows(kv, pg, v, layer, head) + (size_t)tok * kv->row_bytes[t];
    quant_traits(t)->to_float(row, out, c->head_dim);
    for (int e = 0; mu && e < c->head_dim; e++)
        out[e] += mu[e];
    if (c->rotate)
        kv_rotate(out, c->head_dim);
}

ks_status kv_read(const struct kv_cache *kv, int layer, int32_t seq, int32_t pos, float *k, float *v)
{
    ks_status st = check_rows(kv, layer, seq, pos, 1, false);
    if (st)
        return st;
    const struct kv_config *c = &kv->cfg;
    const struct kv_seq *s = &kv->seqs[seq];
    const struct kv_page *pg = &kv->pages[kv_seq_page_id(kv, s, pos >> kv->page_shift)];
    const struct kv_mean *mean = kv_seq_means(kv, s);
    float *dst[2] = {k, v};
    for (int kind = 0; kind < 2; kind++)
        for (int h = 0; dst[kind] && h < c->n_kv_head; h++)
            load_row(kv, pg, kind, layer, h, pos & (c->page_tokens - 1),
                     kv_mean_row(c, mean, layer, kind, h), dst[kind] + (size_t)h * c->head_dim);
    return KS_OK;
}

/* ---- invariants --------------------------------------------------------- */

#if KS_KV_CHECK
void kv_debug_check(const struct kv_cache *kv, const char *call)
{
    /* a failing call's message must survive a check that cannot allocate */
    char saved[512];
    snprintf(saved, sizeof saved, "%s", ks_errmsg());
    ks_status st = kv_check(kv);
    if (st == KS_ERR_NOMEM)
        ks_fail(KS_ERR_NOMEM, "%s", saved);
    else if (st) {
        fprintf(stderr, "kv: %s broke an invariant: %s\n", call, ks_errmsg());
        abort();
    }
}
#endif

ks_status kv_check(const struct kv_cache *kv)
{
    const struct kv_config *c = &kv->cfg;
    int32_t *refs = calloc((size_t)kv->n_page_slots + 1, sizeof *refs);
    if (!refs)
        return ks_fail(KS_ERR_NOMEM, "kv_check: out of host memory");
    ks_status st = KS_OK;
    for (int32_t q = 0; q < kv->n_seq_slots && !st; q++) {
        const struct kv_seq *s = &kv->seqs[q];
        if (!s->live)
            continue;
        if (s->n_pages != (s->len + c->page_tokens - 1) >> kv->page_shift)
            st = ks_fail(KS_ERR_INTERNAL, "kv: sequence %d has %d tokens but %d pages", (int)q, (int)s->len,
                         (int)s->n_pages);
        for (int32_t i = 0; i < s->n_pages && !st; i++) {
            int32_t id = s->pages[i];
            if (id < 0 || id >= kv->n_page_slots || kv->pages[id].ref <= 0)
                st = ks_fail(KS_ERR_INTERNAL, "kv: sequence %d page %d is %d, not a live page", (int)q, (int)i,
                             (int)id);
            else if (i > 0 && kv->pages[id].mean) /* the means belong to page 0 only */
                st = ks_fail(KS_ERR_INTERNAL, "kv: sequence %d page %d holds channel means", (int)q, (int)i);
            else
                refs[id]++;
        }
        if (!st && kv->n_window_layers && (s->swa_from > kv_window_start(kv, s->len) || !kv_seq_window_intact(kv, s, NULL, s->len)))
            st = ks_fail(KS_ERR_INTERNAL, "kv: sequence %d of %d tokens (window from %d) misses window rows it reads",
                         (int)q, (int)s->len, (int)s->swa_from);
        for (int32_t i = 0; i < s->swa_scan && !st; i++)
            if (i >= s->n_pages || kv->pages[s->pages[i]].kw)
                st = ks_fail(KS_ERR_INTERNAL, "kv: sequence %d's page %d before its window scan holds window rows",
                             (int)q, (int)i);
    }
    size_t used = 0;
    int32_t live = 0, idle = 0;
    for (int32_t id = 0; id < kv->n_page_slots && !st; id++) {
        const struct kv_page *pg = &kv->pages[id];
        if (pg->ref != refs[id])
            st = ks_fail(KS_ERR_INTERNAL, "kv: page %d has ref %d but %d tables hold it", (int)id, (int)pg->ref,
                         (int)refs[id]);
        else if (pg->ref > 0 || pg->k) {
            live += pg->ref > 0;
            idle += pg->ref == 0;
            used += kv_page_size(kv, pg);
            if (!pg->k || !pg->v || !pg->kw != !pg->vw || (!kv->n_window_layers && pg->kw))
                st = ks_fail(KS_ERR_INTERNAL, "kv: live page %d has no storage or half a window part", (int)id);
            else if (pg->ref == 0 && !pg->keyed)
                st = ks_fail(KS_ERR_INTERNAL, "kv: page %d has storage, no holder and no key", (int)id);
        }
    }
    if (!st && (used != kv->used || live != kv->n_live_pages || idle != kv->n_idle_pages))
        st = ks_fail(KS_ERR_INTERNAL, "kv: accounting says %zu bytes in %d + %d idle pages, pages hold %zu in %d + %d",
                     kv->used, (int)kv->n_live_pages, (int)kv->n_idle_pages, used, (int)live, (int)idle);
    if (!st && live + idle + kv->n_free_slots != kv->n_page_slots)
        st = ks_fail(KS_ERR_INTERNAL, "kv: %d live + %d idle + %d free page slots != %d", (int)live, (int)idle,
                     (int)kv->n_free_slots, (int)kv->n_page_slots);
    if (!st)
        st = kv_prefix_check(kv);
    if (!st && kv_pool_used(kv) > c->mem_budget)
        st = ks_fail(KS_ERR_INTERNAL, "kv: %zu bytes used (%zu of them by the cache sharing the budget) over a budget of %zu",
                     kv_pool_used(kv), kv_pool_used(kv) - kv->used, c->mem_budget);
    if (!st && kv->peer && (kv->peer->peer != kv || kv->peer->cfg.mem_budget != c->mem_budget))
        st = ks_fail(KS_ERR_INTERNAL, "kv: the cache sharing the budget does not share it back (or another limit)");
    free(refs);
    return st;
}
