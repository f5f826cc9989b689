/* The prefix cache's RAM tier: content keys of full pages, the key -> page
 * map, the LRU list of idle pages, attaching cached chains to sequences,
 * publishing computed pages, and pages as bytes for the SSD tier. */
#include <assert.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <xxhash.h>

#include "kv/kv_internal.h"

enum { MAP_MIN_CAP = 64, BLOB_MAGIC = 0x4750564B /* "KVPG" */, BLOB_VERSION = 2 };

static const struct kv_key ZERO_KEY = {0, 0};

static int64_t unix_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- keys --------------------------------------------------------------- */

/* What besides the tokens makes two pages interchangeable. */
struct key_layout {
    uint8_t fingerprint[16];
    uint32_t page_tokens, rotate, head_dim, n_layer, n_kv_head;
};

void kv_key_layout(const struct kv_cache *kv, struct kv_key_layout *out)
{
    const struct kv_config *c = &kv->cfg;
    struct key_layout lay = {.page_tokens = (uint32_t)c->page_tokens, .rotate = c->rotate,
                             .head_dim = (uint32_t)c->head_dim, .n_layer = (uint32_t)c->n_layer,
                             .n_kv_head = (uint32_t)c->n_kv_head};
    memcpy(lay.fingerprint, c->fingerprint, sizeof lay.fingerprint);
    _Static_assert(sizeof lay + sizeof(uint64_t) <= KV_KEY_LAYOUT_BYTES, "kv_key_layout holds a key's layout");
    memset(out, 0, sizeof *out);
    out->page_tokens = c->page_tokens;
    memcpy(out->bytes, &lay, sizeof lay);
    out->n_bytes = sizeof lay;
    /* the split of a page's rows (which layers are windowed) is part of its layout; without a window the
     * keys stay what they were */
    if (kv->n_window_layers) {
        uint64_t swa = XXH3_64bits_withSeed(c->swa_layer, (size_t)c->n_layer * sizeof c->swa_layer[0],
                                            (uint64_t)c->swa_window);
        memcpy(out->bytes + out->n_bytes, &swa, sizeof swa);
        out->n_bytes += sizeof swa;
    }
}

static struct kv_key layout_chain_key(const struct kv_key_layout *lay, struct kv_key prev, const int32_t *tokens)
{
    uint8_t buf[sizeof prev + KV_MAX_PAGE_TOKENS * sizeof(int32_t) + KV_KEY_LAYOUT_BYTES];
    size_t n_tok = (size_t)lay->page_tokens * sizeof(int32_t);
    memcpy(buf, &prev, sizeof prev);
    memcpy(buf + sizeof prev, tokens, n_tok);
    memcpy(buf + sizeof prev + n_tok, lay->bytes, lay->n_bytes);
    XXH128_hash_t h = XXH3_128bits(buf, sizeof prev + n_tok + lay->n_bytes);
    return (struct kv_key){h.low64, h.high64};
}

static struct kv_key chain_key(const struct kv_cache *kv, struct kv_key prev, const int32_t *tokens)
{
    return layout_chain_key(&kv->key_layout, prev, tokens);
}

void kv_prefix_keys(const struct kv_cache *kv, const int32_t *tokens, int32_t n_tokens, struct kv_key *keys)
{
    struct kv_key prev = ZERO_KEY;
    for (int32_t i = 0; (int64_t)(i + 1) * kv->cfg.page_tokens <= n_tokens; i++)
        prev = keys[i] = chain_key(kv, prev, tokens + (size_t)i * kv->cfg.page_tokens);
}

/* ---- key -> page map ------------------------------------------------------- */

static uint32_t map_home(const struct kv_map *m, struct kv_key k) { return (uint32_t)k.lo & (m->cap - 1); }

static int32_t map_find(const struct kv_cache *kv, struct kv_key k)
{
    const struct kv_map *m = &kv->map;
    if (m->cap == 0)
        return -1;
    for (uint32_t i = map_home(m, k);; i = (i + 1) & (m->cap - 1)) {
        int32_t id = m->slots[i];
        if (id < 0)
            return -1;
        if (kv_key_equal(kv->pages[id].key, k))
            return id;
    }
}

static void map_place(struct kv_cache *kv, int32_t id)
{
    struct kv_map *m = &kv->map;
    assert(id >= 0 && id < kv->n_page_slots && (uint64_t)m->n * 2 < m->cap);
    uint32_t i = map_home(m, kv->pages[id].key);
    while (m->slots[i] >= 0)
        i = (i + 1) & (m->cap - 1);
    m->slots[i] = id;
}

static ks_status map_reserve(struct kv_cache *kv, uint32_t n)
{
    struct kv_map *m = &kv->map;
    if ((uint64_t)n * 2 < m->cap)
        return KS_OK;
    uint32_t cap = m->cap ? m->cap : MAP_MIN_CAP;
    while ((uint64_t)n * 2 >= cap)
        cap *= 2;
    int32_t *slots = malloc((size_t)cap * sizeof *slots), *old = m->slots;
    if (!slots)
        return ks_fail(KS_ERR_NOMEM, "kv prefix cache: out of host memory for the page map");
    for (uint32_t i = 0; i < cap; i++)
        slots[i] = -1;
    uint32_t old_cap = m->cap;
    m->slots = slots;
    m->cap = cap;
    for (uint32_t i = 0; i < old_cap; i++)
        if (old[i] >= 0)
            map_place(kv, old[i]);
    free(old);
    return KS_OK;
}

/* Backward-shift deletion keeps every probe run unbroken without tombstones. */
static void map_remove(struct kv_cache *kv, int32_t id)
{
    struct kv_map *m = &kv->map;
    assert(m->n > 0 && kv->pages[id].keyed);
    uint32_t mask = m->cap - 1, i = map_home(m, kv->pages[id].key);
    while (m->slots[i] != id) {
        assert(m->slots[i] >= 0); /* a keyed page is in its probe run */
        i = (i + 1) & mask;
    }
    for (uint32_t j = (i + 1) & mask; m->slots[j] >= 0; j = (j + 1) & mask) {
        uint32_t home = map_home(m, kv->pages[m->slots[j]].key);
        /* move slot j back into the hole when its home is not in (i, j] */
        if (((j - home) & mask) >= ((j - i) & mask)) {
            m->slots[i] = m->slots[j];
            i = j;
        }
    }
    m->slots[i] = -1;
    m->n--;
}

static ks_status page_set_key(struct kv_cache *kv, int32_t id, struct kv_key key, struct kv_key parent,
                              const int32_t *tokens, int32_t n_valid, uint64_t mean_tag)
{
    size_t n = (size_t)kv->cfg.page_tokens * sizeof(int32_t);
    int32_t *copy = calloc(1, n);
    ks_status st = copy ? map_reserve(kv, kv->map.n + 1) : ks_fail(KS_ERR_NOMEM, "kv prefix cache: out of host memory");
    if (st) {
        free(copy);
        return st;
    }
    struct kv_page *pg = &kv->pages[id];
    assert(!pg->keyed && pg->ref > 0 && n_valid > 0 && n_valid <= kv->cfg.page_tokens);
    memcpy(copy, tokens, (size_t)n_valid * sizeof *tokens);
    pg->tokens = copy;
    pg->n_valid = n_valid;
    pg->key = key;
    pg->parent = parent;
    pg->mean_tag = mean_tag;
    pg->keyed = true;
    pg->hits = 0;
    pg->last_use_ms = unix_ms();
    map_place(kv, id);
    kv->map.n++;
    if (kv->key_fn && n_valid == kv->cfg.page_tokens)
        kv->key_fn(kv->key_user, key, true);
    return KS_OK;
}

static void page_unset_key(struct kv_cache *kv, int32_t id)
{
    struct kv_page *pg = &kv->pages[id];
    map_remove(kv, id);
    if (kv->key_fn && pg->n_valid == kv->cfg.page_tokens)
        kv->key_fn(kv->key_user, pg->key, false);
    free(pg->tokens);
    pg->tokens = NULL;
    pg->keyed = false;
}

/* ---- idle pages: the LRU list ------------------------------------------------ */

static size_t page_bytes(const struct kv_cache *kv, const struct kv_page *pg) { return kv_page_size(kv, pg); }

static void lru_unlink(struct kv_cache *kv, int32_t id)
{
    struct kv_page *pg = &kv->pages[id];
    assert(pg->keyed && pg->ref <= 1); /* idle, or being mapped by kv_prefix_take */
    assert(pg->lru_prev >= 0 ? kv->pages[pg->lru_prev].lru_next == id : kv->lru_head == id);
    assert(pg->lru_next >= 0 ? kv->pages[pg->lru_next].lru_prev == id : kv->lru_tail == id);
    if (pg->lru_prev >= 0)
        kv->pages[pg->lru_prev].lru_next = pg->lru_next;
    else
        kv->lru_head = pg->lru_next;
    if (pg->lru_next >= 0)
        kv->pages[pg->lru_next].lru_prev = pg->lru_prev;
    else
        kv->lru_tail = pg->lru_prev;
    pg->lru_prev = pg->lru_next = -1;
}

void kv_prefix_park(struct kv_cache *kv, int32_t id)
{
    struct kv_page *pg = &kv->pages[id];
    assert(pg->ref == 0 && pg->keyed && pg->k && pg->v && pg->lru_prev < 0 && pg->lru_next < 0);
    pg->lru_prev = kv->lru_tail;
    pg->lru_next = -1;
    if (kv->lru_tail >= 0)
        kv->pages[kv->lru_tail].lru_next = id;
    else
        kv->lru_head = id;
    kv->lru_tail = id;
    kv->n_idle_pages++;
    kv->idle_bytes += page_bytes(kv, pg);
    pg->last_use_ms = unix_ms();
}

void kv_prefix_take(struct kv_cache *kv, int32_t id)
{
    assert(id >= 0 && id < kv->n_page_slots);
    struct kv_page *pg = &kv->pages[id];
    assert(pg->k && pg->v && pg->keyed); /* only cached pages are mapped */
    if (pg->ref++ > 0)
        return;
    lru_unlink(kv, id);
    assert(kv->n_idle_pages > 0 && kv->idle_bytes >= page_bytes(kv, pg));
    kv->n_idle_pages--;
    kv->idle_bytes -= page_bytes(kv, pg);
    kv->n_live_pages++;
}

/* ---- pages as bytes ------------------------------------------------------------ */

/* Version 2 added the channel means (smoothing); a version 1 entry is a miss. */
struct blob_header {
    uint32_t magic, version;
    uint32_t page_tokens, n_layer, n_kv_head, head_dim, rotate;
    uint32_t type_k, type_v;
    uint32_t mean_halves;     /* page 0 of a smoothed sequence: bit 0 K, bit 1 V; its means follow the V half */
    struct kv_key key, parent;
    uint8_t fingerprint[16];
    uint64_t mean_tag;        /* the means the rows are stored against, 0 for none */
};
_Static_assert(sizeof(struct blob_header) == 96, "the page blob header is an on-disk format");

static size_t blob_size(const struct kv_cache *kv, enum quant_type tk, enum quant_type tv, bool means)
{
    return sizeof(struct blob_header) + (size_t)kv->cfg.page_tokens * sizeof(int32_t) +
           kv_page_bytes(&kv->cfg, tk, tv) + (means ? kv_mean_floats(&kv->cfg) * sizeof(float) : 0);
}

static void *blob_pack(const struct kv_cache *kv, const struct kv_page *pg, size_t *len_out)
{
    const struct kv_config *c = &kv->cfg;
    size_t len = blob_size(kv, pg->tk, pg->tv, pg->mean != NULL);
    size_t n_tok = (size_t)c->page_tokens * sizeof(int32_t);
    uint8_t *b = malloc(len);
    if (!b)
        return NULL;
    struct blob_header h = {
        .magic = BLOB_MAGIC, .version = BLOB_VERSION, .page_tokens = (uint32_t)c->page_tokens,
        .n_layer = (uint32_t)c->n_layer, .n_kv_head = (uint32_t)c->n_kv_head, .head_dim = (uint32_t)c->head_dim,
        .rotate = c->rotate, .type_k = (uint32_t)pg->tk, .type_v = (uint32_t)pg->tv, .key = pg->key,
        .parent = pg->parent, .mean_tag = pg->mean_tag,
        .mean_halves = pg->mean ? (uint32_t)pg->mean->has_k | (uint32_t)pg->mean->has_v << 1 : 0,
    };
    memcpy(h.fingerprint, c->fingerprint, sizeof h.fingerprint);
    memcpy(b, &h, sizeof h);
    memcpy(b + sizeof h, pg->tokens, n_tok);
    size_t at = sizeof h + n_tok;
    const void *parts[4] = {pg->k, pg->kw, pg->v, pg->vw};
    for (int i = 0; i < 4; i++) {
        size_t n = kv_part_bytes(kv, i < 2 ? pg->tk : pg->tv, i & 1);
        if (n)
            memcpy(b + at, parts[i], n);
        at += n;
    }
    if (pg->mean)
        memcpy(b + at, pg->mean->mu, kv_mean_floats(c) * sizeof(float));
    *len_out = len;
    return b;
}

/* Hand a keyed page to the SSD tier once. */
static bool page_hand_over(struct kv_cache *kv, struct kv_page *pg)
{
    if (!kv->evict_fn || pg->on_disk || pg->n_valid < kv->cfg.page_tokens || !kv_page_has_window(kv, pg))
        return false;
    size_t len = 0;
    void *data = blob_pack(kv, pg, &len);
    if (!data)
        return false;
    struct kv_page_blob blob = {pg->key, pg->parent, kv->cfg.page_tokens, data, len};
    kv->evict_fn(kv->evict_user, &blob);
    free(data);
    pg->on_disk = true;
    return true;
}

void kv_set_evict_hook(struct kv_cache *kv, kv_evict_fn fn, void *user)
{
    kv->evict_fn = fn;
    kv->evict_user = user;
}

int32_t kv_prefix_held(const struct kv_cache *kv, const int32_t *tokens, int32_t n_tokens)
{
    if (!kv->cfg.prefix_cache)
        return 0;
    int32_t P = kv->cfg.page_tokens, held = 0;
    struct kv_key parent = {0, 0};
    for (; (held + 1) * P <= n_tokens; held++) {
        struct kv_key key = chain_key(kv, parent, tokens + (size_t)held * P);
        if (map_find(kv, key) < 0)
            break;
        parent = key;
    }
    return held;
}

void kv_set_key_hook(struct kv_cache *kv, kv_key_fn fn, void *user)
{
    kv->key_fn = fn;
    kv->key_user = user;
}

void kv_set_publish_hook(struct kv_cache *kv, kv_evict_fn fn, void *user)
{
    kv->publish_fn = fn;
    kv->publish_user = user;
}

/* A page just keyed goes to the publish hook (a blob that cannot be packed,
 * for lack of host memory, is only not shared). */
static void page_announce(struct kv_cache *kv, struct kv_page *pg)
{
    if (!kv->publish_fn || pg->n_valid < kv->cfg.page_tokens || !kv_page_has_window(kv, pg))
        return;
    size_t len = 0;
    void *data = blob_pack(kv, pg, &len);
    if (!data)
        return;
    struct kv_page_blob blob = {pg->key, pg->parent, kv->cfg.page_tokens, data, len};
    kv->publish_fn(kv->publish_user, &blob);
    free(data);
}

/* ---- eviction ------------------------------------------------------------------ */

static void evict_idle(struct kv_cache *kv, int32_t id, bool to_disk)
{
    struct kv_page *pg = &kv->pages[id];
    assert(pg->ref == 0 && pg->keyed);
    if (to_disk && page_hand_over(kv, pg))
        kv->evicted_to_disk++;
    lru_unlink(kv, id);
    assert(kv->n_idle_pages > 0 && kv->idle_bytes >= page_bytes(kv, pg));
    kv->n_idle_pages--;
    kv->idle_bytes -= page_bytes(kv, pg);
    page_unset_key(kv, id);
    kv_page_release(kv, id);
}

void kv_prefix_evict(struct kv_cache *kv, size_t bytes, size_t goal)
{
    while (kv_pool_used(kv) + bytes > goal && kv->lru_head >= 0) {
        evict_idle(kv, kv->lru_head, true);
        kv->evictions++;
    }
}

static int32_t clear_idle(struct kv_cache *kv)
{
    int32_t n = 0;
    for (; kv->lru_head >= 0; n++)
        evict_idle(kv, kv->lru_head, false);
    assert(kv->n_idle_pages == 0 && kv->idle_bytes == 0);
    KV_DEBUG_CHECK(kv, "kv_prefix_clear");
    return n;
}

int32_t kv_prefix_clear(struct kv_cache *kv)
{
    /* the draft model's pages were computed from the same prompts */
    return clear_idle(kv) + (kv->peer ? clear_idle(kv->peer) : 0);
}

int32_t kv_prefix_persist(struct kv_cache *kv)
{
    int32_t n = 0;
    for (int32_t id = 0; id < kv->n_page_slots; id++)
        if (kv->pages[id].keyed && page_hand_over(kv, &kv->pages[id]))
            n++;
    KV_DEBUG_CHECK(kv, "kv_prefix_persist");
    return n;
}

/* ---- attaching cached pages to a sequence ------------------------------------- */

/* The salt is hashed once more, with a tag of its own, so a chain's root is
 * never a page's key (whose input is laid out otherwise). */
static struct kv_key salt_root(struct kv_key salt)
{
    static const char tag[] = "kvserve cache salt root";
    uint8_t buf[sizeof tag + sizeof salt];
    memcpy(buf, tag, sizeof tag);
    memcpy(buf + sizeof tag, &salt, sizeof salt);
    XXH128_hash_t h = XXH3_128bits(buf, sizeof buf);
    return (struct kv_key){h.low64, h.high64};
}

struct kv_key kv_salt_mix(struct kv_key salt, const void *bytes, size_t n)
{
    XXH128_hash_t of_bytes = XXH3_128bits(bytes, n);
    uint64_t buf[4] = {salt.lo, salt.hi, of_bytes.low64, of_bytes.high64};
    XXH128_hash_t h = XXH3_128bits(buf, sizeof buf);
    struct kv_key k = {h.low64, h.high64};
    return kv_key_equal(k, ZERO_KEY) ? (struct kv_key){1, 0} : k; /* {0, 0} means "no salt" */
}

struct kv_key kv_cache_salt(const char *text, size_t n)
{
    static const char tag[] = "kvserve cache_salt";
    return kv_salt_mix(kv_salt_mix(ZERO_KEY, tag, sizeof tag), text, n);
}

struct kv_key kv_tenant_salt(struct kv_key tenant_key, const char *api_key, size_t n, struct kv_key own)
{
    struct kv_key tenant = kv_salt_mix(tenant_key, api_key, n);
    return kv_key_equal(own, ZERO_KEY) ? tenant : kv_salt_mix(tenant, &own, sizeof own);
}

void kv_layout_keys(const struct kv_key_layout *lay, struct kv_key salt, const int32_t *tokens, int32_t n_tokens,
                    struct kv_key *keys)
{
    assert(lay->page_tokens >= 16 && lay->page_tokens <= KV_MAX_PAGE_TOKENS && lay->n_bytes <= KV_KEY_LAYOUT_BYTES);
    struct kv_key prev = kv_key_equal(salt, ZERO_KEY) ? ZERO_KEY : salt_root(salt);
    for (int32_t i = 0; (int64_t)(i + 1) * lay->page_tokens <= n_tokens; i++)
        prev = keys[i] = layout_chain_key(lay, prev, tokens + (size_t)i * lay->page_tokens);
}

static ks_status live_seq(const struct kv_cache *kv, int32_t seq, struct kv_seq **out)
{
    if (seq < 0 || seq >= kv->n_seq_slots || !kv->seqs[seq].live)
        return ks_fail(KS_ERR_NOT_FOUND, "kv cache: sequence %d does not exist", (int)seq);
    *out = &kv->seqs[seq];
    return KS_OK;
}

ks_status kv_seq_set_salt(struct kv_cache *kv, int32_t seq, struct kv_key salt)
{
    struct kv_seq *s = NULL;
    ks_status st = live_seq(kv, seq, &s);
    if (st)
        return st;
    if (s->n_pages > 0)
        return ks_fail(KS_ERR_STATE, "kv cache: sequence %d already holds tokens; set its cache salt first", (int)seq);
    s->root = kv_key_equal(salt, ZERO_KEY) ? ZERO_KEY : salt_root(salt);
    return KS_OK;
}

/* Can seq continue from the cache: its length is page-aligned and the key of
 * every page so far is known (published or attached)? */
static bool seq_extendable(const struct kv_cache *kv, const struct kv_seq *s)
{
    return kv->cfg.prefix_cache && (s->len & (kv->cfg.page_tokens - 1)) == 0 && s->n_keyed == s->n_pages;
}

static struct kv_key last_key(const struct kv_seq *s) { return s->n_keyed ? s->keys[s->n_keyed - 1] : s->root; }

/* Map page id (already referenced for s) as s's next page. */
bool kv_seq_next_key(const struct kv_cache *kv, int32_t seq, const int32_t *tokens, struct kv_key *out)
{
    if (seq < 0 || seq >= kv->n_seq_slots || !kv->seqs[seq].live || !seq_extendable(kv, &kv->seqs[seq]))
        return false;
    const struct kv_seq *s = &kv->seqs[seq];
    *out = chain_key(kv, last_key(s), tokens + s->len);
    return true;
}

int32_t kv_seq_next_keys(const struct kv_cache *kv, int32_t seq, const int32_t *tokens, int32_t n, struct kv_key *keys)
{
    if (n <= 0 || seq < 0 || seq >= kv->n_seq_slots || !kv->seqs[seq].live || !seq_extendable(kv, &kv->seqs[seq]))
        return 0;
    const struct kv_seq *s = &kv->seqs[seq];
    keys[0] = last_key(s);
    for (int32_t i = 0; i < n; i++)
        keys[i + 1] = chain_key(kv, keys[i], tokens + s->len + (size_t)i * kv->cfg.page_tokens);
    return n;
}

/* Page 0 brings its means; a later page must be stored against seq's. */
static bool stored_against_seq_means(const struct kv_cache *kv, const struct kv_seq *s, int32_t id)
{
    return s->n_pages == 0 || kv->pages[id].mean_tag == kv_seq_mean_tag(kv, s);
}

static void seq_map(struct kv_cache *kv, struct kv_seq *s, int32_t id, int32_t n_tokens)
{
    struct kv_page *pg = &kv->pages[id];
    assert(pg->ref > 0 && s->n_pages < s->cap_pages && n_tokens > 0 && n_tokens <= pg->n_valid);
    assert((s->len & (kv->cfg.page_tokens - 1)) == 0); /* a mapped page starts a page */
    pg->hits++;
    pg->last_use_ms = unix_ms();
    s->pages[s->n_pages++] = id;
    s->len += n_tokens;
    s->swa_from = kv_window_start(kv, s->len); /* its tokens are all computed: queries come after them */
    kv->attached_pages++;
}

static ks_status attach_pages(struct kv_cache *kv, int32_t seq, const int32_t *tokens, int32_t max_tokens,
                              int32_t *n_pages_out)
{
    *n_pages_out = 0;
    struct kv_seq *s = NULL;
    ks_status st = live_seq(kv, seq, &s);
    if (st || !seq_extendable(kv, s))
        return st;
    int32_t P = kv->cfg.page_tokens, resumable = s->len, n_resumable = 0;
    while ((int64_t)s->len + P <= max_tokens) {
        const int32_t *page_tokens = tokens + s->len;
        struct kv_key key = chain_key(kv, last_key(s), page_tokens);
        int32_t id = map_find(kv, key);
        if (id < 0 || kv->pages[id].n_valid != P ||
            memcmp(kv->pages[id].tokens, page_tokens, (size_t)P * sizeof *page_tokens) != 0 ||
            !stored_against_seq_means(kv, s, id))
            break;
        if ((st = kv_seq_reserve_table(s, s->n_pages + 1)))
            return st;
        s->keys[s->n_keyed++] = key;
        kv_prefix_take(kv, id);
        seq_map(kv, s, id, P);
        (*n_pages_out)++;
        if (kv_seq_window_intact(kv, s, NULL, s->len)) {
            resumable = s->len;
            n_resumable = *n_pages_out;
        }
    }
    /* a hit must end where the window rows it reads are stored: keep the longest such */
    for (int32_t i = n_resumable; i < *n_pages_out; i++) {
        kv->pages[s->pages[s->n_pages - 1 - (i - n_resumable)]].hits--;
        kv->attached_pages--;
    }
    *n_pages_out = n_resumable;
    return s->len == resumable ? KS_OK : kv_seq_truncate(kv, seq, resumable);
}

static int32_t common_run(const int32_t *a, const int32_t *b, int32_t n)
{
    int32_t i = 0;
    while (i < n && a[i] == b[i])
        i++;
    return i;
}

static ks_status attach_partial(struct kv_cache *kv, int32_t seq, const int32_t *tokens, int32_t max_tokens,
                                int32_t *n_tokens_out)
{
    *n_tokens_out = 0;
    struct kv_seq *s = NULL;
    ks_status st = live_seq(kv, seq, &s);
    if (st || !seq_extendable(kv, s) || max_tokens <= s->len)
        return st;
    int32_t want = max_tokens - s->len < kv->cfg.page_tokens ? max_tokens - s->len : kv->cfg.page_tokens;
    struct kv_key parent = last_key(s);
    int32_t best = -1, best_run = 0;
    for (int32_t id = 0; id < kv->n_page_slots; id++) {
        const struct kv_page *pg = &kv->pages[id];
        if (!pg->keyed || !kv_key_equal(pg->parent, parent) || !stored_against_seq_means(kv, s, id) ||
            !kv_page_has_window(kv, pg))
            continue;
        int32_t run = common_run(pg->tokens, tokens + s->len, want < pg->n_valid ? want : pg->n_valid);
        if (run > best_run) {
            best = id;
            best_run = run;
        }
    }
    if (best < 0)
        return KS_OK;
    if ((st = kv_seq_reserve_table(s, s->n_pages + 1)))
        return st;
    kv_prefix_take(kv, best);
    seq_map(kv, s, best, best_run);
    *n_tokens_out = best_run;
    return KS_OK;
}

static ks_status publish(struct kv_cache *kv, int32_t seq, const int32_t *tokens, int32_t n_computed)
{
    struct kv_seq *s = NULL;
    ks_status st = live_seq(kv, seq, &s);
    if (st || !kv->cfg.prefix_cache)
        return st;
    int32_t P = kv->cfg.page_tokens;
    int32_t full = (n_computed < s->len ? n_computed : s->len) / P;
    for (int32_t i = s->n_keyed; i < full; i++) {
        const int32_t *page_tokens = tokens + (size_t)i * P;
        struct kv_key parent = last_key(s), key = chain_key(kv, parent, page_tokens);
        int32_t id = s->pages[i];
        assert(!kv->pages[id].keyed || kv_key_equal(kv->pages[id].key, key));
        /* a page whose key another page already has stays private: one copy is cached */
        if (!kv->pages[id].keyed && map_find(kv, key) < 0) {
            if ((st = page_set_key(kv, id, key, parent, page_tokens, P, kv_seq_mean_tag(kv, s))))
                return st;
            page_announce(kv, &kv->pages[id]);
        }
        s->keys[i] = key;
        s->n_keyed = i + 1;
    }
    return KS_OK;
}

/* A tail's key: the chain key of its tokens padded with -n, which no token id
 * is, so it never equals a full page's key. */
static struct kv_key tail_key(const struct kv_cache *kv, struct kv_key parent, const int32_t *tokens, int32_t n)
{
    int32_t padded[256];
    for (int32_t i = 0; i < kv->cfg.page_tokens; i++)
        padded[i] = i < n ? tokens[i] : -n;
    return chain_key(kv, parent, padded);
}

static ks_status publish_tail(struct kv_cache *kv, int32_t seq, const int32_t *tokens, int32_t n_computed)
{
    struct kv_seq *s = NULL;
    ks_status st = live_seq(kv, seq, &s);
    int32_t P = kv->cfg.page_tokens, n = s ? s->len % P : 0;
    if (st || !kv->cfg.prefix_cache || n == 0 || n_computed < s->len || s->n_keyed != s->n_pages - 1)
        return st;
    int32_t id = s->pages[s->n_pages - 1];
    if (kv->pages[id].keyed || kv->pages[id].ref != 1)
        return KS_OK; /* a mapped cached page, or shared by a fork */
    const int32_t *tail = tokens + s->len - n;
    struct kv_key parent = last_key(s), key = tail_key(kv, parent, tail, n);
    if (map_find(kv, key) >= 0)
        return KS_OK;
    return page_set_key(kv, id, key, parent, tail, n, kv_seq_mean_tag(kv, s));
}

/* ---- reading a page back from the SSD tier ------------------------------------ */

static ks_status blob_check(const struct kv_cache *kv, const struct blob_header *h, size_t len)
{
    const struct kv_config *c = &kv->cfg;
    if (h->magic != BLOB_MAGIC || h->version != BLOB_VERSION)
        return ks_fail(KS_ERR_FORMAT, "kv page blob: not a version %d page", BLOB_VERSION);
    if (h->page_tokens != (uint32_t)c->page_tokens || h->n_layer != (uint32_t)c->n_layer ||
        h->n_kv_head != (uint32_t)c->n_kv_head || h->head_dim != (uint32_t)c->head_dim ||
        h->rotate != (uint32_t)c->rotate || memcmp(h->fingerprint, c->fingerprint, sizeof h->fingerprint) != 0)
        return ks_fail(KS_ERR_FORMAT, "kv page blob: made for another model or KV layout");
    if (h->type_k >= QUANT_TYPE_COUNT || h->type_v >= QUANT_TYPE_COUNT ||
        kv_check_type(c, (enum quant_type)h->type_k, "kv page blob") ||
        kv_check_type(c, (enum quant_type)h->type_v, "kv page blob"))
        return ks_fail(KS_ERR_FORMAT, "kv page blob: bad K/V types %u/%u", h->type_k, h->type_v);
    if (h->mean_halves > (KV_SMOOTH_K | KV_SMOOTH_V))
        return ks_fail(KS_ERR_FORMAT, "kv page blob: bad channel means flags %u", h->mean_halves);
    if (len != blob_size(kv, (enum quant_type)h->type_k, (enum quant_type)h->type_v, h->mean_halves != 0))
        return ks_fail(KS_ERR_FORMAT, "kv page blob: %zu bytes, its header says otherwise", len);
    return KS_OK;
}

/* A page 0's channel means, as the blob carries them after its V half. */
static ks_status import_means(struct kv_cache *kv, struct kv_page *pg, const struct blob_header *h, const uint8_t *mu)
{
    if (!h->mean_halves)
        return KS_OK;
    pg->mean = kv_mean_new(&kv->cfg, h->mean_halves & KV_SMOOTH_K, h->mean_halves & KV_SMOOTH_V);
    if (!pg->mean)
        return ks_fail(KS_ERR_NOMEM, "kv cache: out of host memory for a sequence's channel means");
    memcpy(pg->mean->mu, mu, kv_mean_floats(&kv->cfg) * sizeof(float));
    kv_mean_fix_all(&kv->cfg, pg->mean);
    return KS_OK;
}

static ks_status import_page(struct kv_cache *kv, int32_t seq, const int32_t *tokens, const void *blob, size_t len)
{
    struct kv_seq *s = NULL;
    ks_status st = live_seq(kv, seq, &s);
    if (st)
        return st;
    if (!seq_extendable(kv, s))
        return ks_fail(KS_ERR_STATE, "kv cache: sequence %d cannot take a cached page now", (int)seq);
    struct blob_header h;
    if (len < sizeof h)
        return ks_fail(KS_ERR_FORMAT, "kv page blob: %zu bytes is too short", len);
    memcpy(&h, blob, sizeof h);
    if ((st = blob_check(kv, &h, len)))
        return st;
    const struct kv_config *c = &kv->cfg;
    const int32_t *page_tokens = tokens + s->len;
    size_t n_tok = (size_t)c->page_tokens * sizeof(int32_t);
    const uint8_t *b = (const uint8_t *)blob + sizeof h;
    struct kv_key parent = last_key(s), key = chain_key(kv, parent, page_tokens);
    if (!kv_key_equal(h.key, key) || !kv_key_equal(h.parent, parent) || memcmp(b, page_tokens, n_tok) != 0)
        return ks_fail(KS_ERR_FORMAT, "kv page blob: its key or tokens are not the next page of this prompt");
    if (s->n_pages > 0 && h.mean_halves)
        return ks_fail(KS_ERR_FORMAT, "kv page blob: channel means %u on a page that is not a sequence's first",
                       h.mean_halves);
    if (s->n_pages > 0 && h.mean_tag != kv_seq_mean_tag(kv, s))
        return ks_fail(KS_ERR_FORMAT, "kv page blob: stored against other channel means than this sequence's");
    if ((st = kv_seq_reserve_table(s, s->n_pages + 1)))
        return st;
    int32_t id = map_find(kv, key);
    if (id >= 0 && !stored_against_seq_means(kv, s, id))
        return ks_fail(KS_ERR_FORMAT, "kv page blob: its key is cached in RAM against other channel means");
    if (id >= 0 && !kv_page_has_window(kv, &kv->pages[id]))
        return ks_fail(KS_ERR_STATE, "kv cache: the page is cached in RAM without its sliding-window rows");
    if (id >= 0) { /* published in RAM meanwhile */
        s->keys[s->n_keyed++] = key;
        kv_prefix_take(kv, id);
        seq_map(kv, s, id, c->page_tokens);
        return KS_OK;
    }
    enum quant_type tk = (enum quant_type)h.type_k, tv = (enum quant_type)h.type_v;
    if ((st = kv_policy_make_room(kv, kv_page_bytes(c, tk, tv))) || (st = kv_page_new(kv, tk, tv, &id)))
        return st;
    struct kv_page *pg = &kv->pages[id];
    size_t at = n_tok;
    void *parts[4] = {pg->k, pg->kw, pg->v, pg->vw};
    for (int i = 0; i < 4; i++) {
        size_t n = kv_part_bytes(kv, i < 2 ? tk : tv, i & 1);
        if (n)
            memcpy(parts[i], b + at, n);
        at += n;
    }
    if ((st = import_means(kv, pg, &h, b + at)) ||
        (st = page_set_key(kv, id, key, parent, page_tokens, c->page_tokens, pg->mean ? pg->mean->tag : h.mean_tag))) {
        pg->ref = 0;
        kv->n_live_pages--;
        kv_page_release(kv, id);
        return st;
    }
    pg->on_disk = true;
    s->keys[s->n_keyed++] = key;
    seq_map(kv, s, id, c->page_tokens);
    return KS_OK;
}

/* ---- the public calls that change the cache: Debug builds check it after each */

ks_status kv_seq_attach_pages(struct kv_cache *kv, int32_t seq, const int32_t *tokens, int32_t max_tokens,
                              int32_t *n_pages_out)
{
    ks_status st = attach_pages(kv, seq, tokens, max_tokens, n_pages_out);
    KV_DEBUG_CHECK(kv, "kv_seq_attach_pages");
    return st;
}

ks_status kv_seq_attach_partial(struct kv_cache *kv, int32_t seq, const int32_t *tokens, int32_t max_tokens,
                                int32_t *n_tokens_out)
{
    ks_status st = attach_partial(kv, seq, tokens, max_tokens, n_tokens_out);
    KV_DEBUG_CHECK(kv, "kv_seq_attach_partial");
    return st;
}

ks_status kv_seq_publish(struct kv_cache *kv, int32_t seq, const int32_t *tokens, int32_t n_computed)
{
    ks_status st = publish(kv, seq, tokens, n_computed);
    KV_DEBUG_CHECK(kv, "kv_seq_publish");
    return st;
}

ks_status kv_seq_publish_tail(struct kv_cache *kv, int32_t seq, const int32_t *tokens, int32_t n_computed)
{
    ks_status st = publish_tail(kv, seq, tokens, n_computed);
    KV_DEBUG_CHECK(kv, "kv_seq_publish_tail");
    return st;
}

ks_status kv_seq_import_page(struct kv_cache *kv, int32_t seq, const int32_t *tokens, const void *blob, size_t len)
{
    ks_status st = import_page(kv, seq, tokens, blob, len);
    KV_DEBUG_CHECK(kv, "kv_seq_import_page");
    return st;
}

/* ---- listing the cached chains --------------------------------------------------- */

static int by_tokens_desc(const void *a, const void *b)
{
    int32_t x = ((const struct kv_prefix_info *)a)->n_tokens, y = ((const struct kv_prefix_info *)b)->n_tokens;
    return (x < y) - (x > y);
}

static void chain_describe(const struct kv_cache *kv, int32_t leaf, struct kv_prefix_info *o)
{
    memset(o, 0, sizeof *o);
    o->leaf = kv->pages[leaf].key;
    o->leaf_hits = kv->pages[leaf].hits;
    int32_t id = leaf, root = leaf;
    for (int32_t steps = 0; id >= 0 && steps <= (int32_t)kv->map.n; steps++) {
        const struct kv_page *pg = &kv->pages[id];
        o->n_pages++;
        o->n_tokens += pg->n_valid;
        o->n_idle += pg->ref == 0;
        if (pg->last_use_ms > o->last_use_ms)
            o->last_use_ms = pg->last_use_ms;
        root = id;
        id = kv_key_equal(pg->parent, ZERO_KEY) ? -1 : map_find(kv, pg->parent);
    }
    o->hits = kv->pages[root].hits;
    o->n_head = kv->pages[root].n_valid < KV_PREFIX_HEAD_TOKENS ? kv->pages[root].n_valid : KV_PREFIX_HEAD_TOKENS;
    memcpy(o->head, kv->pages[root].tokens, (size_t)o->n_head * sizeof *o->head);
}

ks_status kv_prefix_list(const struct kv_cache *kv, struct kv_prefix_info *out, int32_t cap, int32_t *n_chains)
{
    uint8_t *has_child = calloc((size_t)kv->n_page_slots + 1, 1);
    struct kv_prefix_info *all = malloc(((size_t)kv->map.n + 1) * sizeof *all);
    if (!has_child || !all) {
        free(has_child);
        free(all);
        return ks_fail(KS_ERR_NOMEM, "kv: out of memory listing the cached prefixes (%u keyed pages)", kv->map.n);
    }
    for (int32_t id = 0; id < kv->n_page_slots; id++) {
        int32_t parent = kv->pages[id].keyed ? map_find(kv, kv->pages[id].parent) : -1;
        if (parent >= 0)
            has_child[parent] = 1;
    }
    int32_t n = 0;
    for (int32_t id = 0; id < kv->n_page_slots; id++)
        if (kv->pages[id].keyed && !has_child[id])
            chain_describe(kv, id, &all[n++]);
    qsort(all, (size_t)n, sizeof *all, by_tokens_desc);
    memcpy(out, all, (size_t)(n < cap ? n : cap) * sizeof *out);
    free(has_child);
    free(all);
    *n_chains = n;
    return KS_OK;
}

/* ---- invariants and teardown ------------------------------------------------------ */

ks_status kv_prefix_check(const struct kv_cache *kv)
{
    uint32_t keyed = 0;
    for (int32_t id = 0; id < kv->n_page_slots; id++) {
        const struct kv_page *pg = &kv->pages[id];
        if (!pg->keyed)
            continue;
        keyed++;
        if (!pg->tokens || map_find(kv, pg->key) != id)
            return ks_fail(KS_ERR_INTERNAL, "kv: keyed page %d is not in the page map", (int)id);
    }
    if (keyed != kv->map.n)
        return ks_fail(KS_ERR_INTERNAL, "kv: the page map holds %u keys, %u pages are keyed", kv->map.n, keyed);
    int32_t n = 0;
    size_t bytes = 0;
    for (int32_t id = kv->lru_head, prev = -1; id >= 0; prev = id, id = kv->pages[id].lru_next, n++) {
        const struct kv_page *pg = &kv->pages[id];
        if (n > kv->n_page_slots || pg->ref != 0 || !pg->keyed || pg->lru_prev != prev)
            return ks_fail(KS_ERR_INTERNAL, "kv: the idle list is broken at page %d", (int)id);
        bytes += page_bytes(kv, pg);
    }
    if (n != kv->n_idle_pages || bytes != kv->idle_bytes)
        return ks_fail(KS_ERR_INTERNAL, "kv: the idle list holds %d pages / %zu bytes, accounting says %d / %zu", (int)n,
                       bytes, (int)kv->n_idle_pages, kv->idle_bytes);
    return KS_OK;
}

void kv_prefix_free(struct kv_cache *kv)
{
    free(kv->map.slots);
    kv->map.slots = NULL;
    kv->map.cap = kv->map.n = 0;
}
