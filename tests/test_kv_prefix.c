/* The prefix cache's RAM tier: keys, attach and publish, idle pages and their
 * LRU eviction (leaf first), copy-on-write of keyed pages, pages as bytes for
 * the SSD tier (and rejecting bad ones), listing, clearing, and the policies. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kv/kv.h"
#include "kv/kv_internal.h"

enum { P = 32 };

static void base_config(struct kv_config *cfg, int32_t budget_pages)
{
    kv_config_default(cfg);
    cfg->n_layer = 2;
    cfg->n_kv_head = 2;
    cfg->head_dim = 64;
    cfg->mem_budget = (size_t)budget_pages * kv_page_bytes(cfg, QUANT_F16, QUANT_F16);
    memcpy(cfg->fingerprint, "model-fingerprnt", 16);
}

static struct kv_cache *make_cache(int32_t budget_pages)
{
    struct kv_config cfg;
    base_config(&cfg, budget_pages);
    struct kv_cache *kv = NULL;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    return kv;
}

/* K/V of a token depend on the token and its position only, like a model's. */
static void write_tokens(struct kv_cache *kv, int32_t seq, const int32_t *tokens, int32_t from, int32_t to)
{
    const struct kv_config *c = kv_get_config(kv);
    size_t n = (size_t)c->n_kv_head * c->head_dim;
    float k[256], v[256];
    for (int32_t p = from; p < to; p++)
        for (int l = 0; l < c->n_layer; l++) {
            for (size_t i = 0; i < n; i++) {
                k[i] = (float)((tokens[p] * 31 + p * 7 + l * 3 + (int)i) % 97) / 97.0f - 0.5f;
                v[i] = (float)((tokens[p] * 17 + p * 5 + l + (int)i * 3) % 89) / 89.0f - 0.5f;
            }
            assert_int_equal(kv_write(kv, l, seq, p, k, v), KS_OK);
        }
}

/* A sequence that computed tokens[0, n) and published its full pages. */
static int32_t computed_seq(struct kv_cache *kv, const int32_t *tokens, int32_t n)
{
    int32_t seq = -1;
    assert_int_equal(kv_seq_create(kv, &seq), KS_OK);
    assert_int_equal(kv_seq_grow(kv, seq, n), KS_OK);
    write_tokens(kv, seq, tokens, 0, n);
    assert_int_equal(kv_seq_publish(kv, seq, tokens, n), KS_OK);
    assert_int_equal(kv_check(kv), KS_OK);
    return seq;
}

static void make_tokens(int32_t *t, int32_t n, int32_t salt)
{
    for (int32_t i = 0; i < n; i++)
        t[i] = (i * 7919 + salt * 104729) % 50000;
}

static void test_keys_chain(void **state)
{
    (void)state;
    struct kv_cache *kv = make_cache(8);
    int32_t t[3 * P], u[3 * P];
    make_tokens(t, 3 * P, 1);
    memcpy(u, t, sizeof u);
    u[2 * P + 5]++;
    struct kv_key kt[3], ku[3];
    kv_prefix_keys(kv, t, 3 * P, kt);
    kv_prefix_keys(kv, u, 3 * P + 0, ku);
    assert_true(kv_key_equal(kt[0], ku[0]) && kv_key_equal(kt[1], ku[1]));
    assert_false(kv_key_equal(kt[2], ku[2]));
    /* a sequence's next key is the chain key of its next page */
    int32_t seq = -1, n_pages = 0;
    struct kv_key next;
    assert_int_equal(kv_seq_create(kv, &seq), KS_OK);
    assert_true(kv_seq_next_key(kv, seq, t, &next) && kv_key_equal(next, kt[0]));
    kv_seq_free(kv, computed_seq(kv, t, 2 * P));
    assert_int_equal(kv_seq_attach_pages(kv, seq, t, 3 * P, &n_pages), KS_OK);
    assert_int_equal(n_pages, 2);
    assert_true(kv_seq_next_key(kv, seq, t, &next) && kv_key_equal(next, kt[2]));
    assert_false(kv_seq_next_key(kv, seq + 1000, t, &next));
    kv_seq_free(kv, seq);
    assert_int_equal(kv_seq_create(kv, &seq), KS_OK);
    assert_int_equal(kv_seq_grow(kv, seq, 5), KS_OK); /* not page-aligned: no next key */
    assert_false(kv_seq_next_key(kv, seq, t, &next));
    kv_seq_free(kv, seq);
    /* the same tokens in another page position give another key (the chain) */
    struct kv_key k1[1];
    kv_prefix_keys(kv, t + P, P, k1);
    assert_false(kv_key_equal(k1[0], kt[1]));
    /* another model fingerprint gives other keys */
    struct kv_config cfg;
    base_config(&cfg, 8);
    cfg.fingerprint[0] ^= 1;
    struct kv_cache *other = NULL;
    assert_int_equal(kv_create(&cfg, &other), KS_OK);
    struct kv_key ko[3];
    kv_prefix_keys(other, t, 3 * P, ko);
    assert_false(kv_key_equal(ko[0], kt[0]));
    kv_free(other);
    kv_free(kv);
}

static void test_attach_maps_cached_pages(void **state)
{
    (void)state;
    struct kv_cache *kv = make_cache(16);
    int32_t t[4 * P + 5];
    make_tokens(t, 4 * P + 5, 2);
    int32_t a = computed_seq(kv, t, 4 * P + 5);
    struct kv_usage u;
    kv_usage(kv, &u);
    assert_int_equal(u.n_keyed_pages, 4);
    assert_int_equal(u.n_idle_pages, 0);

    /* a sharer while a still runs: the pages are mapped, not copied */
    int32_t b = -1, n_pages = 0;
    assert_int_equal(kv_seq_create(kv, &b), KS_OK);
    assert_int_equal(kv_seq_attach_pages(kv, b, t, 4 * P + 5, &n_pages), KS_OK);
    assert_int_equal(n_pages, 4);
    assert_int_equal(kv_seq_len(kv, b), 4 * P);
    kv_usage(kv, &u);
    assert_int_equal(u.n_pages, 5);
    assert_int_equal(u.n_shared_pages, 4);
    assert_int_equal(kv_check(kv), KS_OK);

    /* a ends: its full pages stay cached, idle only once b lets go too */
    kv_seq_free(kv, a);
    kv_usage(kv, &u);
    assert_int_equal(u.n_pages, 4);
    assert_int_equal(u.n_idle_pages, 0);
    kv_seq_free(kv, b);
    kv_usage(kv, &u);
    assert_int_equal(u.n_idle_pages, 4);
    assert_int_equal(u.idle_bytes, 4 * kv_page_bytes(kv_get_config(kv), QUANT_F16, QUANT_F16));
    assert_int_equal(u.used, u.idle_bytes);
    assert_int_equal(kv_check(kv), KS_OK);

    /* max_tokens stops at a page boundary; a different page 2 stops the chain */
    int32_t c = -1;
    assert_int_equal(kv_seq_create(kv, &c), KS_OK);
    assert_int_equal(kv_seq_attach_pages(kv, c, t, 2 * P + 31, &n_pages), KS_OK);
    assert_int_equal(n_pages, 2);
    kv_seq_free(kv, c);
    int32_t v[4 * P];
    memcpy(v, t, sizeof v);
    v[2 * P + 3] = 7;
    assert_int_equal(kv_seq_create(kv, &c), KS_OK);
    assert_int_equal(kv_seq_attach_pages(kv, c, v, 4 * P, &n_pages), KS_OK);
    assert_int_equal(n_pages, 2);
    assert_int_equal(kv_check(kv), KS_OK);
    kv_seq_free(kv, c);
    kv_free(kv);
}

/* The K/V a cached page holds equal what computing the same tokens writes. */
static void test_hit_equals_recompute(void **state)
{
    (void)state;
    struct kv_cache *kv = make_cache(16);
    int32_t t[3 * P];
    make_tokens(t, 3 * P, 3);
    kv_seq_free(kv, computed_seq(kv, t, 3 * P));
    int32_t hit = -1, n_pages = 0;
    assert_int_equal(kv_seq_create(kv, &hit), KS_OK);
    assert_int_equal(kv_seq_attach_pages(kv, hit, t, 3 * P, &n_pages), KS_OK);
    assert_int_equal(n_pages, 3);
    struct kv_config cfg = *kv_get_config(kv);
    cfg.prefix_cache = false;
    struct kv_cache *cold = NULL;
    assert_int_equal(kv_create(&cfg, &cold), KS_OK);
    int32_t ref = computed_seq(cold, t, 3 * P);
    for (int i = 0; i < 3; i++) {
        const struct kv_page *x = &kv->pages[kv->seqs[hit].pages[i]], *y = &cold->pages[cold->seqs[ref].pages[i]];
        assert_memory_equal(x->k, y->k, kv_half_bytes(&cfg, QUANT_F16));
        assert_memory_equal(x->v, y->v, kv_half_bytes(&cfg, QUANT_F16));
    }
    kv_usage(cold, &(struct kv_usage){0});
    assert_int_equal(kv_seq_publish(cold, ref, t, 3 * P), KS_OK);
    struct kv_usage u;
    kv_usage(cold, &u);
    assert_int_equal(u.n_keyed_pages, 0); /* prefix cache off: nothing is kept */
    kv_free(cold);
    kv_free(kv);
}

static void test_partial_page_copy_on_write(void **state)
{
    (void)state;
    struct kv_cache *kv = make_cache(16);
    int32_t t[3 * P];
    make_tokens(t, 3 * P, 4);
    kv_seq_free(kv, computed_seq(kv, t, 3 * P));
    /* b shares 2 pages and the first 10 tokens of page 2 */
    int32_t u[3 * P];
    memcpy(u, t, sizeof u);
    for (int i = 2 * P + 10; i < 3 * P; i++)
        u[i] = 40000 + i;
    int32_t b = -1, n_pages = 0, n_part = 0;
    assert_int_equal(kv_seq_create(kv, &b), KS_OK);
    assert_int_equal(kv_seq_attach_pages(kv, b, u, 3 * P, &n_pages), KS_OK);
    assert_int_equal(n_pages, 2);
    assert_int_equal(kv_seq_attach_partial(kv, b, u, 3 * P, &n_part), KS_OK);
    assert_int_equal(n_part, 10);
    assert_int_equal(kv_seq_len(kv, b), 2 * P + 10);
    int32_t cached = kv->seqs[b].pages[2];
    assert_true(kv->pages[cached].keyed);
    struct kv_usage before, after;
    kv_usage(kv, &before);
    /* the first write copies the keyed page; the cached one is untouched */
    void *snapshot = malloc(kv_half_bytes(kv_get_config(kv), QUANT_F16));
    memcpy(snapshot, kv->pages[cached].k, kv_half_bytes(kv_get_config(kv), QUANT_F16));
    assert_int_equal(kv_seq_grow(kv, b, P - 10), KS_OK);
    write_tokens(kv, b, u, 2 * P + 10, 3 * P);
    assert_int_not_equal(kv->seqs[b].pages[2], cached);
    assert_memory_equal(snapshot, kv->pages[cached].k, kv_half_bytes(kv_get_config(kv), QUANT_F16));
    free(snapshot);
    kv_usage(kv, &after);
    assert_int_equal(after.n_pages, before.n_pages + 1);
    assert_int_equal(kv_check(kv), KS_OK);
    /* b's own page 2 publishes as a sibling of the cached one */
    assert_int_equal(kv_seq_publish(kv, b, u, 3 * P), KS_OK);
    kv_usage(kv, &after);
    assert_int_equal(after.n_keyed_pages, 4);
    /* a prompt fully cached still leaves its last token to compute */
    int32_t c = -1;
    assert_int_equal(kv_seq_create(kv, &c), KS_OK);
    assert_int_equal(kv_seq_attach_pages(kv, c, t, 3 * P - 1, &n_pages), KS_OK);
    assert_int_equal(kv_seq_attach_partial(kv, c, t, 3 * P - 1, &n_part), KS_OK);
    assert_int_equal(n_pages, 2);
    assert_int_equal(n_part, P - 1);
    assert_int_equal(kv_check(kv), KS_OK);
    kv_seq_free(kv, c);
    kv_seq_free(kv, b);
    kv_free(kv);
}

/* Truncating into a keyed page and writing again never changes the cached copy. */
static void test_truncate_into_keyed_page(void **state)
{
    (void)state;
    struct kv_cache *kv = make_cache(16);
    int32_t t[2 * P];
    make_tokens(t, 2 * P, 5);
    int32_t a = computed_seq(kv, t, 2 * P);
    int32_t keyed = kv->seqs[a].pages[1];
    assert_int_equal(kv_seq_truncate(kv, a, P + 3), KS_OK);
    assert_int_equal(kv_seq_grow(kv, a, P - 3), KS_OK);
    int32_t u[2 * P];
    memcpy(u, t, sizeof u);
    for (int i = P + 3; i < 2 * P; i++)
        u[i] = 30000 + i;
    write_tokens(kv, a, u, P + 3, 2 * P);
    assert_int_not_equal(kv->seqs[a].pages[1], keyed);
    assert_true(kv->pages[keyed].keyed);
    assert_int_equal(kv_seq_publish(kv, a, u, 2 * P), KS_OK);
    assert_int_equal(kv_check(kv), KS_OK);
    int32_t b = -1, n = 0;
    assert_int_equal(kv_seq_create(kv, &b), KS_OK);
    assert_int_equal(kv_seq_attach_pages(kv, b, t, 2 * P, &n), KS_OK);
    assert_int_equal(n, 2);
    assert_int_equal(kv->seqs[b].pages[1], keyed);
    kv_seq_free(kv, a);
    kv_seq_free(kv, b);
    kv_free(kv);
}

/* Idle pages are reclaimed least recently used first, and a released chain
 * from its leaf. */
static void test_eviction_order_leaf_first(void **state)
{
    (void)state;
    struct kv_cache *kv = make_cache(6);
    int32_t a[3 * P], b[3 * P];
    make_tokens(a, 3 * P, 6);
    make_tokens(b, 3 * P, 7);
    int32_t sa = computed_seq(kv, a, 3 * P), sb = computed_seq(kv, b, 3 * P);
    int32_t pa[3], pb[3];
    memcpy(pa, kv->seqs[sa].pages, sizeof pa);
    memcpy(pb, kv->seqs[sb].pages, sizeof pb);
    kv_seq_free(kv, sa); /* released first: evicted first */
    kv_seq_free(kv, sb);
    struct kv_fit fit;
    kv_fit(kv, &fit);
    assert_int_equal(fit.start, 6 * P); /* idle pages count as room */
    int32_t c = -1;
    assert_int_equal(kv_seq_create(kv, &c), KS_OK);
    assert_int_equal(kv_seq_grow(kv, c, P), KS_OK);
    assert_false(kv->pages[pa[2]].keyed); /* a's leaf went first */
    assert_true(kv->pages[pa[1]].keyed && kv->pages[pa[0]].keyed);
    assert_int_equal(kv_seq_grow(kv, c, P), KS_OK);
    assert_false(kv->pages[pa[1]].keyed);
    assert_true(kv->pages[pa[0]].keyed);
    struct kv_usage u;
    kv_usage(kv, &u);
    assert_int_equal(u.evictions, 2);
    /* a hit refreshes: b's chain used again, then a's root is the oldest */
    int32_t d = -1, n = 0;
    assert_int_equal(kv_seq_create(kv, &d), KS_OK);
    assert_int_equal(kv_seq_attach_pages(kv, d, b, 3 * P, &n), KS_OK);
    assert_int_equal(n, 3);
    kv_seq_free(kv, d);
    assert_int_equal(kv_seq_grow(kv, c, P), KS_OK);
    assert_false(kv->pages[pa[0]].keyed);
    assert_true(kv->pages[pb[0]].keyed && kv->pages[pb[2]].keyed);
    /* full: the next pages come from b's chain, leaf first */
    assert_int_equal(kv_seq_grow(kv, c, P), KS_OK);
    assert_false(kv->pages[pb[2]].keyed);
    assert_int_equal(kv_check(kv), KS_OK);
    /* nothing idle left and no room: KV full, nothing in use touched */
    assert_int_equal(kv_seq_grow(kv, c, 2 * P), KS_OK);
    assert_int_equal(kv_seq_grow(kv, c, P), KS_ERR_KV_FULL);
    assert_int_equal(kv_check(kv), KS_OK);
    kv_seq_free(kv, c);
    kv_free(kv);
}

struct hook_log {
    int n;
    void *blob[8];
    size_t len[8];
};

static void on_evict(void *user, const struct kv_page_blob *b)
{
    struct hook_log *log = user;
    if (log->n < 8) {
        log->blob[log->n] = malloc(b->len);
        memcpy(log->blob[log->n], b->data, b->len);
        log->len[log->n++] = b->len;
    }
}

static void test_blob_round_trip_and_rejects(void **state)
{
    (void)state;
    struct kv_cache *kv = make_cache(8);
    struct hook_log log = {0};
    kv_set_evict_hook(kv, on_evict, &log);
    int32_t t[2 * P + 3];
    make_tokens(t, 2 * P + 3, 8);
    int32_t a = computed_seq(kv, t, 2 * P + 3);
    int32_t pages[2] = {kv->seqs[a].pages[0], kv->seqs[a].pages[1]};
    assert_int_equal(kv_prefix_persist(kv), 2);
    assert_int_equal(kv_prefix_persist(kv), 0); /* once per page */
    assert_int_equal(log.n, 2);

    struct kv_cache *fresh = make_cache(8);
    int32_t s = -1, n = 0;
    assert_int_equal(kv_seq_create(fresh, &s), KS_OK);
    /* page 1 first is not the next page of the chain */
    assert_int_equal(kv_seq_import_page(fresh, s, t, log.blob[1], log.len[1]), KS_ERR_FORMAT);
    /* a flipped token, a truncated blob, another fingerprint: refused */
    uint8_t *bad = malloc(log.len[0]);
    memcpy(bad, log.blob[0], log.len[0]);
    bad[96] ^= 1; /* the first token, after the 96-byte header */
    assert_int_equal(kv_seq_import_page(fresh, s, t, bad, log.len[0]), KS_ERR_FORMAT);
    assert_int_equal(kv_seq_import_page(fresh, s, t, log.blob[0], log.len[0] - 1), KS_ERR_FORMAT);
    memcpy(bad, log.blob[0], log.len[0]);
    bad[72] ^= 1; /* inside the fingerprint */
    assert_int_equal(kv_seq_import_page(fresh, s, t, bad, log.len[0]), KS_ERR_FORMAT);
    assert_int_equal(kv_seq_import_page(fresh, s, t, bad, 10), KS_ERR_FORMAT);
    free(bad);
    assert_int_equal(kv_seq_len(fresh, s), 0);
    assert_int_equal(kv_check(fresh), KS_OK);
    for (int i = 0; i < 2; i++)
        assert_int_equal(kv_seq_import_page(fresh, s, t, log.blob[i], log.len[i]), KS_OK);
    assert_int_equal(kv_seq_len(fresh, s), 2 * P);
    for (int i = 0; i < 2; i++) {
        const struct kv_page *x = &kv->pages[pages[i]], *y = &fresh->pages[fresh->seqs[s].pages[i]];
        assert_memory_equal(x->k, y->k, kv_half_bytes(&kv->cfg, x->tk));
        assert_memory_equal(x->v, y->v, kv_half_bytes(&kv->cfg, x->tv));
        assert_true(y->keyed && y->on_disk);
    }
    kv_seq_free(fresh, s);
    /* imported pages are cached like computed ones, and not written back */
    struct hook_log log2 = {0};
    kv_set_evict_hook(fresh, on_evict, &log2);
    assert_int_equal(kv_seq_create(fresh, &s), KS_OK);
    assert_int_equal(kv_seq_attach_pages(fresh, s, t, 2 * P + 3, &n), KS_OK);
    assert_int_equal(n, 2);
    kv_seq_free(fresh, s);
    assert_int_equal(kv_prefix_clear(fresh), 2);
    assert_int_equal(log2.n, 0);
    assert_int_equal(kv_check(fresh), KS_OK);
    kv_free(fresh);

    /* eviction hands a page over once, with its current precision */
    kv_seq_free(kv, a);
    struct kv_selector all = {.kind = KV_SELECT_ALL};
    assert_int_equal(kv_requantize(kv, &all, QUANT_Q4_0, QUANT_Q8_0, false, NULL), KS_OK);
    assert_int_equal(kv->pages[pages[0]].tk, QUANT_Q4_0); /* idle pages are requantized too */
    assert_true(kv->pages[pages[0]].keyed);
    for (int i = 0; i < log.n; i++)
        free(log.blob[i]);
    log.n = 0;
    for (int i = 0; i < 2; i++)
        kv->pages[pages[i]].on_disk = false;
    int32_t c = -1;
    assert_int_equal(kv_seq_create(kv, &c), KS_OK);
    assert_int_equal(kv_seq_grow(kv, c, 8 * P), KS_OK);
    assert_int_equal(log.n, 2);
    assert_true(log.len[0] < kv_page_bytes(&kv->cfg, QUANT_F16, QUANT_F16));
    struct kv_usage u;
    kv_usage(kv, &u);
    assert_int_equal(u.evicted_to_disk, 2);
    assert_int_equal(kv_check(kv), KS_OK);
    for (int i = 0; i < log.n; i++)
        free(log.blob[i]);
    kv_seq_free(kv, c);
    kv_free(kv);
}

static void test_list_and_clear(void **state)
{
    (void)state;
    struct kv_cache *kv = make_cache(16);
    int32_t t[4 * P], u[4 * P];
    make_tokens(t, 4 * P, 9);
    memcpy(u, t, sizeof u);
    u[3 * P] = 1; /* a branch after 3 shared pages */
    int32_t a = computed_seq(kv, t, 4 * P);
    int32_t b = -1, n = 0;
    assert_int_equal(kv_seq_create(kv, &b), KS_OK);
    assert_int_equal(kv_seq_attach_pages(kv, b, u, 4 * P, &n), KS_OK);
    assert_int_equal(n, 3);
    assert_int_equal(kv_seq_grow(kv, b, P), KS_OK);
    write_tokens(kv, b, u, 3 * P, 4 * P);
    assert_int_equal(kv_seq_publish(kv, b, u, 4 * P), KS_OK);
    int32_t w[P];
    make_tokens(w, P, 10);
    kv_seq_free(kv, computed_seq(kv, w, P));
    struct kv_prefix_info info[4];
    int32_t n_chains = 0;
    assert_int_equal(kv_prefix_list(kv, info, 4, &n_chains), KS_OK);
    assert_int_equal(n_chains, 3);
    assert_int_equal(info[0].n_tokens, 4 * P);
    assert_int_equal(info[1].n_tokens, 4 * P);
    assert_int_equal(info[2].n_tokens, P);
    assert_int_equal(info[2].n_idle, 1);
    assert_int_equal(info[0].hits, 1); /* b mapped the shared root */
    assert_int_equal(info[0].head[0], t[0]);
    /* clear drops idle pages only: the running sequences keep theirs */
    assert_int_equal(kv_prefix_clear(kv), 1);
    assert_int_equal(kv_prefix_list(kv, info, 4, &n_chains), KS_OK);
    assert_int_equal(n_chains, 2);
    kv_seq_free(kv, a);
    assert_int_equal(kv_prefix_clear(kv), 1); /* a's own leaf; the rest is b's */
    kv_seq_free(kv, b);
    assert_int_equal(kv_prefix_clear(kv), 4);
    struct kv_usage us;
    kv_usage(kv, &us);
    assert_int_equal(us.used, 0);
    assert_int_equal(kv_check(kv), KS_OK);
    kv_free(kv);
}

/* Dynamic policy: idle pages step down first, then go, before pages in use. */
static void test_dynamic_demotes_idle_then_evicts(void **state)
{
    (void)state;
    struct kv_config cfg;
    base_config(&cfg, 8);
    cfg.policy = KV_POLICY_DYNAMIC;
    cfg.sink_tokens = 0;
    cfg.hot_tokens = 0;
    cfg.high_watermark = 0.7f;
    cfg.low_watermark = 0.5f;
    struct kv_cache *kv = NULL;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    int32_t t[4 * P];
    make_tokens(t, 4 * P, 11);
    int32_t a = computed_seq(kv, t, 4 * P);
    int32_t pa[4];
    memcpy(pa, kv->seqs[a].pages, sizeof pa);
    kv_seq_free(kv, a);
    int32_t b = -1;
    assert_int_equal(kv_seq_create(kv, &b), KS_OK);
    assert_int_equal(kv_seq_grow(kv, b, 2 * P), KS_OK);
    int32_t live0 = kv->seqs[b].pages[0];
    /* 6 pages' worth is over 0.7 * 8: idle pages are demoted before b's */
    assert_int_equal(kv_seq_grow(kv, b, P), KS_OK);
    assert_int_equal(kv->pages[live0].tk, QUANT_F16);
    assert_true(kv->pages[pa[0]].tv == QUANT_Q8_0 || kv->pages[pa[0]].tv == QUANT_Q4_0);
    assert_int_equal(kv_check(kv), KS_OK);
    /* once idle pages are at the floor they are evicted before b's pages step down */
    struct kv_usage u;
    for (int i = 0; i < 3; i++) {
        assert_int_equal(kv_seq_grow(kv, b, P), KS_OK);
        kv_usage(kv, &u);
        assert_true(u.n_idle_pages == 0 || kv->pages[live0].tk == QUANT_F16);
    }
    assert_true(u.evictions > 0);
    assert_int_equal(u.n_idle_pages, 0);
    assert_int_equal(kv_check(kv), KS_OK);
    kv_seq_free(kv, b);
    kv_free(kv);
}

static void test_fork_shares_keys(void **state)
{
    (void)state;
    struct kv_cache *kv = make_cache(16);
    int32_t t[2 * P + 4];
    make_tokens(t, 2 * P + 4, 12);
    int32_t a = computed_seq(kv, t, 2 * P + 4);
    int32_t f = -1, n = 0;
    assert_int_equal(kv_seq_fork(kv, a, &f), KS_OK);
    /* the partial last page is private to whoever writes it first */
    assert_int_equal(kv_seq_grow(kv, f, 1), KS_OK);
    int32_t x[2 * P + 5];
    memcpy(x, t, sizeof t);
    x[2 * P + 4] = 3;
    write_tokens(kv, f, x, 2 * P + 4, 2 * P + 5);
    assert_int_not_equal(kv->seqs[f].pages[2], kv->seqs[a].pages[2]);
    assert_int_equal(kv->seqs[f].pages[1], kv->seqs[a].pages[1]);
    assert_int_equal(kv_check(kv), KS_OK);
    kv_seq_free(kv, a);
    kv_seq_free(kv, f);
    int32_t b = -1;
    assert_int_equal(kv_seq_create(kv, &b), KS_OK);
    assert_int_equal(kv_seq_attach_pages(kv, b, t, 2 * P + 4, &n), KS_OK);
    assert_int_equal(n, 2);
    assert_true(kv->pages[kv->seqs[b].pages[1]].keyed);
    kv_seq_free(kv, b);
    kv_free(kv);
}

/* A finished sequence's partial last page (its tail) serves a prompt that
 * continues it, up to the tail's own tokens, and is copied on write. */
static void test_tail_of_finished_sequence(void **state)
{
    (void)state;
    struct kv_cache *kv = make_cache(16);
    struct hook_log log = {0};
    kv_set_evict_hook(kv, on_evict, &log);
    int32_t t[3 * P];
    make_tokens(t, 3 * P, 13);
    int32_t a = computed_seq(kv, t, 2 * P + 8);
    assert_int_equal(kv_seq_publish_tail(kv, a, t, 2 * P + 7), KS_OK); /* not all computed: nothing */
    struct kv_usage u;
    kv_usage(kv, &u);
    assert_int_equal(u.n_keyed_pages, 2);
    assert_int_equal(kv_seq_publish_tail(kv, a, t, 2 * P + 8), KS_OK);
    kv_usage(kv, &u);
    assert_int_equal(u.n_keyed_pages, 3);
    int32_t tail = kv->seqs[a].pages[2];
    kv_seq_free(kv, a);
    struct kv_prefix_info info[2];
    int32_t n_chains = 0;
    assert_int_equal(kv_prefix_list(kv, info, 2, &n_chains), KS_OK);
    assert_int_equal(n_chains, 1);
    assert_int_equal(info[0].n_tokens, 2 * P + 8);
    /* a longer prompt: 2 pages, then 8 tokens of the tail (never more) */
    int32_t b = -1, n_pages = 0, n_part = 0;
    assert_int_equal(kv_seq_create(kv, &b), KS_OK);
    assert_int_equal(kv_seq_attach_pages(kv, b, t, 3 * P, &n_pages), KS_OK);
    assert_int_equal(n_pages, 2);
    assert_int_equal(kv_seq_attach_partial(kv, b, t, 3 * P, &n_part), KS_OK);
    assert_int_equal(n_part, 8);
    assert_int_equal(kv->seqs[b].pages[2], tail);
    assert_int_equal(kv_seq_grow(kv, b, P - 8), KS_OK);
    write_tokens(kv, b, t, 2 * P + 8, 3 * P);
    assert_int_not_equal(kv->seqs[b].pages[2], tail);
    assert_true(kv->pages[tail].keyed);
    assert_int_equal(kv_check(kv), KS_OK);
    /* tails stay in RAM: persisting hands over the 2 full pages only */
    assert_int_equal(kv_prefix_persist(kv), 2);
    for (int i = 0; i < log.n; i++)
        free(log.blob[i]);
    kv_seq_free(kv, b);
    kv_free(kv);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_keys_chain),
        cmocka_unit_test(test_attach_maps_cached_pages),
        cmocka_unit_test(test_hit_equals_recompute),
        cmocka_unit_test(test_partial_page_copy_on_write),
        cmocka_unit_test(test_truncate_into_keyed_page),
        cmocka_unit_test(test_eviction_order_leaf_first),
        cmocka_unit_test(test_blob_round_trip_and_rejects),
        cmocka_unit_test(test_list_and_clear),
        cmocka_unit_test(test_dynamic_demotes_idle_then_evicts),
        cmocka_unit_test(test_fork_shares_keys),
        cmocka_unit_test(test_tail_of_finished_sequence),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
