/* Cache salts (vLLM's cache_salt, issue 24): a salted sequence's chain starts
 * from its salt's root, so pages are shared (in RAM, as tails, and read back
 * from the SSD tier) only between sequences of the same salt; unsalted keys
 * are what they were, so caches written before salts stay valid. */
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

static const struct kv_key NO_SALT = {0, 0};

/* page 0's key for base_config's layout and make_tokens, computed by main before salts existed */
#define UNSALTED_KEY0_LO 0xce0b7b391191a2ecull
#define UNSALTED_KEY0_HI 0xc0d81b38ab0fe1a2ull

static struct kv_config base_config(int32_t budget_pages, enum kv_smooth smooth)
{
    struct kv_config cfg;
    kv_config_default(&cfg);
    cfg.n_layer = 2;
    cfg.n_kv_head = 2;
    cfg.head_dim = 64;
    cfg.smooth = smooth;
    cfg.mem_budget = (size_t)budget_pages * kv_page_bytes(&cfg, QUANT_F16, QUANT_F16);
    memcpy(cfg.fingerprint, "model-fingerprnt", 16);
    return cfg;
}

static struct kv_cache *make_cache(int32_t budget_pages, enum kv_smooth smooth)
{
    struct kv_config cfg = base_config(budget_pages, smooth);
    struct kv_cache *kv = NULL;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    return kv;
}

static struct kv_key salt_of(const char *text) { return kv_salt_mix(NO_SALT, text, strlen(text)); }

static void make_tokens(int32_t *t, int32_t n)
{
    for (int32_t i = 0; i < n; i++)
        t[i] = (i * 7919 + 104729) % 50000;
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

/* A sequence of salt that computed tokens[0, n) and published its full pages and its tail. */
static int32_t computed_seq(struct kv_cache *kv, struct kv_key salt, const int32_t *tokens, int32_t n)
{
    int32_t seq = -1;
    assert_int_equal(kv_seq_create(kv, &seq), KS_OK);
    assert_int_equal(kv_seq_set_salt(kv, seq, salt), KS_OK);
    assert_int_equal(kv_seq_grow(kv, seq, n), KS_OK);
    write_tokens(kv, seq, tokens, 0, n);
    assert_int_equal(kv_seq_publish(kv, seq, tokens, n), KS_OK);
    assert_int_equal(kv_seq_publish_tail(kv, seq, tokens, n), KS_OK);
    assert_int_equal(kv_check(kv), KS_OK);
    return seq;
}

/* Tokens of tokens[0, max) a new sequence of salt finds cached (full pages, then a partial one). */
static int32_t cached_for(struct kv_cache *kv, struct kv_key salt, const int32_t *tokens, int32_t max)
{
    int32_t seq = -1, n_pages = 0, n_part = 0;
    assert_int_equal(kv_seq_create(kv, &seq), KS_OK);
    assert_int_equal(kv_seq_set_salt(kv, seq, salt), KS_OK);
    assert_int_equal(kv_seq_attach_pages(kv, seq, tokens, max, &n_pages), KS_OK);
    assert_int_equal(kv_seq_attach_partial(kv, seq, tokens, max, &n_part), KS_OK);
    kv_seq_free(kv, seq);
    assert_int_equal(kv_check(kv), KS_OK);
    return n_pages * P + n_part;
}

/* Unsalted chain keys are pinned: a cache written before salts existed (on
 * disk, under these keys) is still found. The value is kvserve's key of page
 * 0 for this layout and these tokens before cache salts were added. */
static void test_unsalted_keys_unchanged(void **state)
{
    (void)state;
    struct kv_cache *kv = make_cache(8, KV_SMOOTH_OFF);
    int32_t t[2 * P];
    make_tokens(t, 2 * P);
    struct kv_key keys[2], next;
    kv_prefix_keys(kv, t, 2 * P, keys);
    assert_true(keys[0].lo == UNSALTED_KEY0_LO && keys[0].hi == UNSALTED_KEY0_HI);
    int32_t seq = -1;
    assert_int_equal(kv_seq_create(kv, &seq), KS_OK);
    assert_true(kv_seq_next_key(kv, seq, t, &next) && kv_key_equal(next, keys[0]));
    assert_int_equal(kv_seq_set_salt(kv, seq, NO_SALT), KS_OK); /* {0, 0} is no salt */
    assert_true(kv_seq_next_key(kv, seq, t, &next) && kv_key_equal(next, keys[0]));
    kv_seq_free(kv, seq);
    kv_free(kv);
}

static void test_salt_changes_every_key(void **state)
{
    (void)state;
    struct kv_cache *kv = make_cache(16, KV_SMOOTH_OFF);
    int32_t t[3 * P];
    make_tokens(t, 3 * P);
    struct kv_key a = salt_of("tenant-a"), b = salt_of("tenant-b");
    assert_false(kv_key_equal(a, NO_SALT) || kv_key_equal(a, b));
    assert_true(kv_key_equal(a, salt_of("tenant-a"))); /* deterministic: found again after a restart */
    struct kv_key plain[3], next_a, next_a2, next_b;
    kv_prefix_keys(kv, t, 3 * P, plain);
    int32_t sa = -1, sa2 = -1, sb = -1;
    assert_int_equal(kv_seq_create(kv, &sa), KS_OK);
    assert_int_equal(kv_seq_create(kv, &sa2), KS_OK);
    assert_int_equal(kv_seq_create(kv, &sb), KS_OK);
    assert_int_equal(kv_seq_set_salt(kv, sa, a), KS_OK);
    assert_int_equal(kv_seq_set_salt(kv, sa2, a), KS_OK);
    assert_int_equal(kv_seq_set_salt(kv, sb, b), KS_OK);
    assert_true(kv_seq_next_key(kv, sa, t, &next_a) && kv_seq_next_key(kv, sa2, t, &next_a2) &&
                kv_seq_next_key(kv, sb, t, &next_b));
    assert_true(kv_key_equal(next_a, next_a2));
    assert_false(kv_key_equal(next_a, next_b) || kv_key_equal(next_a, plain[0]) || kv_key_equal(next_b, plain[0]));
    /* a salt is set before the sequence holds a token */
    assert_int_equal(kv_seq_grow(kv, sb, 3), KS_OK);
    assert_int_equal(kv_seq_set_salt(kv, sb, a), KS_ERR_STATE);
    assert_int_equal(kv_seq_set_salt(kv, 1000, a), KS_ERR_NOT_FOUND);
    kv_seq_free(kv, sa);
    kv_seq_free(kv, sa2);
    kv_seq_free(kv, sb);
    kv_free(kv);
}

/* Same prompt, two salts: no page, tail or later page is shared; the same
 * salt shares all of it; a fork keeps its source's salt. */
static void test_sharing_only_within_a_salt(void **state)
{
    (void)state;
    struct kv_cache *kv = make_cache(32, KV_SMOOTH_OFF);
    int32_t t[4 * P];
    make_tokens(t, 4 * P);
    struct kv_key a = salt_of("tenant-a"), b = salt_of("tenant-b");
    kv_seq_free(kv, computed_seq(kv, a, t, 3 * P + 8));
    assert_int_equal(cached_for(kv, a, t, 4 * P), 3 * P + 8); /* 3 pages and the tail's 8 tokens */
    assert_int_equal(cached_for(kv, b, t, 4 * P), 0);
    assert_int_equal(cached_for(kv, NO_SALT, t, 4 * P), 0);
    /* an unsalted sequence's pages are not another salt's either */
    kv_seq_free(kv, computed_seq(kv, NO_SALT, t, 2 * P));
    assert_int_equal(cached_for(kv, NO_SALT, t, 4 * P), 2 * P);
    assert_int_equal(cached_for(kv, b, t, 4 * P), 0);
    /* the chains are listed apart: a's 3 pages and tail, the unsalted 2 */
    struct kv_prefix_info info[4];
    int32_t n_chains = 0;
    assert_int_equal(kv_prefix_list(kv, info, 4, &n_chains), KS_OK);
    assert_int_equal(n_chains, 2);
    assert_int_equal(info[0].n_tokens, 3 * P + 8);
    assert_int_equal(info[1].n_tokens, 2 * P);
    /* a fork continues its source's chain, so it publishes under its salt */
    int32_t src = -1, fork = -1, n_pages = 0;
    assert_int_equal(kv_seq_create(kv, &src), KS_OK);
    assert_int_equal(kv_seq_set_salt(kv, src, a), KS_OK);
    assert_int_equal(kv_seq_attach_pages(kv, src, t, 2 * P, &n_pages), KS_OK);
    assert_int_equal(n_pages, 2);
    assert_int_equal(kv_seq_fork(kv, src, &fork), KS_OK);
    assert_int_equal(kv_seq_grow(kv, fork, P), KS_OK);
    int32_t u[4 * P];
    memcpy(u, t, sizeof u);
    u[2 * P] = 7; /* the fork's own page 2 */
    write_tokens(kv, fork, u, 2 * P, 3 * P);
    assert_int_equal(kv_seq_publish(kv, fork, u, 3 * P), KS_OK);
    kv_seq_free(kv, fork);
    kv_seq_free(kv, src);
    assert_int_equal(cached_for(kv, a, u, 4 * P), 3 * P);
    assert_int_equal(cached_for(kv, NO_SALT, u, 4 * P), 2 * P);
    assert_int_equal(kv_check(kv), KS_OK);
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

/* A salted page on disk is read back only by a sequence of the same salt;
 * page 0 of a smoothed sequence brings its channel means under a salt too. */
static void check_disk_round_trip(enum kv_smooth smooth)
{
    struct kv_cache *kv = make_cache(8, smooth);
    struct hook_log log = {0};
    kv_set_evict_hook(kv, on_evict, &log);
    int32_t t[2 * P];
    make_tokens(t, 2 * P);
    struct kv_key a = salt_of("tenant-a");
    kv_seq_free(kv, computed_seq(kv, a, t, 2 * P));
    assert_int_equal(kv_prefix_persist(kv), 2);
    assert_int_equal(log.n, 2);

    struct kv_cache *fresh = make_cache(8, smooth);
    struct kv_key others[2] = {NO_SALT, salt_of("tenant-b")};
    for (int i = 0; i < 2; i++) {
        int32_t s = -1;
        assert_int_equal(kv_seq_create(fresh, &s), KS_OK);
        assert_int_equal(kv_seq_set_salt(fresh, s, others[i]), KS_OK);
        assert_int_equal(kv_seq_import_page(fresh, s, t, log.blob[0], log.len[0]), KS_ERR_FORMAT);
        assert_int_equal(kv_seq_len(fresh, s), 0);
        kv_seq_free(fresh, s);
    }
    int32_t s = -1;
    assert_int_equal(kv_seq_create(fresh, &s), KS_OK);
    assert_int_equal(kv_seq_set_salt(fresh, s, a), KS_OK);
    for (int i = 0; i < 2; i++)
        assert_int_equal(kv_seq_import_page(fresh, s, t, log.blob[i], log.len[i]), KS_OK);
    assert_int_equal(kv_seq_len(fresh, s), 2 * P);
    kv_seq_free(fresh, s);
    assert_int_equal(cached_for(fresh, a, t, 2 * P), 2 * P);
    assert_int_equal(cached_for(fresh, NO_SALT, t, 2 * P), 0);
    assert_int_equal(kv_check(fresh), KS_OK);
    for (int i = 0; i < log.n; i++)
        free(log.blob[i]);
    kv_free(fresh);
    kv_free(kv);
}

static void test_disk_pages_keep_their_salt(void **state)
{
    (void)state;
    check_disk_round_trip(KV_SMOOTH_OFF);
    check_disk_round_trip(KV_SMOOTH_KV);
}

/* ---- KV events and keys computed without the cache (a router's) --------------------- */

enum { MAX_EVENTS = 64 };
struct key_events {
    struct kv_key key[MAX_EVENTS];
    bool held[MAX_EVENTS];
    int n;
};

static void on_key(void *user, struct kv_key key, bool held)
{
    struct key_events *ev = user;
    assert_true(ev->n < MAX_EVENTS);
    ev->key[ev->n] = key;
    ev->held[ev->n++] = held;
}

/* The keys kv_layout_keys computes from kv_key_layout's bytes alone are the keys the cache gave a
 * sequence of that salt (each reported once by the key hook, tails never), salted or not. */
static void check_layout_keys(struct kv_key salt)
{
    struct kv_cache *kv = make_cache(16, KV_SMOOTH_OFF);
    struct key_events ev = {0};
    kv_set_key_hook(kv, on_key, &ev);
    int32_t tokens[4 * P + 5];
    make_tokens(tokens, 4 * P + 5);
    int32_t seq = computed_seq(kv, salt, tokens, 4 * P + 5);
    assert_int_equal(ev.n, 4);
    struct kv_key_layout lay;
    kv_key_layout(kv, &lay);
    assert_int_equal(lay.page_tokens, P);
    /* a copy of the bytes, as a router holds them after reading them from an event */
    struct kv_key_layout copy;
    memcpy(&copy, &lay, sizeof copy);
    struct kv_key keys[4];
    kv_layout_keys(&copy, salt, tokens, 4 * P + 5, keys);
    for (int i = 0; i < 4; i++) {
        assert_true(ev.held[i]);
        assert_true(kv_key_equal(keys[i], ev.key[i]));
    }
    if (kv_key_equal(salt, NO_SALT)) {
        struct kv_key plain[4];
        kv_prefix_keys(kv, tokens, 4 * P, plain);
        for (int i = 0; i < 4; i++)
            assert_true(kv_key_equal(keys[i], plain[i]));
        assert_int_equal(keys[0].lo, UNSALTED_KEY0_LO);
    }
    /* a new sequence of that salt looks the same keys up in the shared tier (kv_seq_next_keys) */
    int32_t fresh = -1;
    struct kv_key next[5];
    assert_int_equal(kv_seq_create(kv, &fresh), KS_OK);
    assert_int_equal(kv_seq_set_salt(kv, fresh, salt), KS_OK);
    assert_int_equal(kv_seq_next_keys(kv, fresh, tokens, 4, next), 4);
    for (int i = 0; i < 4; i++)
        assert_true(kv_key_equal(next[1 + i], keys[i]));
    assert_int_equal(kv_seq_next_keys(kv, fresh + 1000, tokens, 4, next), 0);
    kv_seq_free(kv, fresh);
    kv_seq_free(kv, seq);
    /* dropping the idle pages reports every full key as lost, the tail not */
    ev.n = 0;
    assert_int_equal(kv_prefix_clear(kv), 5);
    assert_int_equal(ev.n, 4);
    for (int i = 0; i < 4; i++)
        assert_false(ev.held[i]);
    kv_free(kv);
}

static void test_layout_keys_equal_cache_keys(void **state)
{
    (void)state;
    check_layout_keys(NO_SALT);
    check_layout_keys(kv_cache_salt("tenant-a", 8));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_unsalted_keys_unchanged),
        cmocka_unit_test(test_salt_changes_every_key),
        cmocka_unit_test(test_sharing_only_within_a_salt),
        cmocka_unit_test(test_disk_pages_keep_their_salt),
        cmocka_unit_test(test_layout_keys_equal_cache_keys),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
