/* kv_set_policy(): a cache switched at run time behaves exactly like one
 * created with the new policy; bad values are refused with the field named
 * and leave the configuration untouched. The demotion ladder: parsing, its
 * checks, and the dynamic policy stepping down a 4-level one. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kv/kv.h"
#include "kv/kv_internal.h"

static void base_config(struct kv_config *cfg, int head_dim, int budget_pages)
{
    kv_config_default(cfg);
    cfg->n_layer = 2;
    cfg->n_kv_head = 2;
    cfg->head_dim = head_dim;
    cfg->page_tokens = 16;
    cfg->mem_budget = (size_t)budget_pages * kv_page_bytes(cfg, QUANT_F16, QUANT_F16);
}

static void fill(struct kv_cache *kv, int32_t seq, int32_t from, int32_t to)
{
    const struct kv_config *c = kv_get_config(kv);
    size_t n = (size_t)c->n_kv_head * c->head_dim;
    float *k = malloc(n * sizeof *k), *v = malloc(n * sizeof *v);
    for (int32_t p = from; p < to; p++)
        for (int l = 0; l < c->n_layer; l++) {
            for (size_t i = 0; i < n; i++) {
                k[i] = sinf((float)(p * 131 + l * 17 + (int)i));
                v[i] = cosf((float)(p * 71 + l * 13 + (int)i));
            }
            assert_int_equal(kv_write(kv, l, seq, p, k, v), KS_OK);
        }
    free(k);
    free(v);
}

/* Grow seq by n tokens and write them; returns the status of the grow. */
static ks_status grow(struct kv_cache *kv, int32_t seq, int32_t n)
{
    int32_t len = kv_seq_len(kv, seq);
    ks_status st = kv_seq_grow(kv, seq, n);
    if (st == KS_OK)
        fill(kv, seq, len, len + n);
    return st;
}

/* Every page of seq has the same K/V types in both caches, and so do the totals. */
static void assert_same_pages(const struct kv_cache *a, int32_t sa, const struct kv_cache *b, int32_t sb)
{
    assert_int_equal(a->seqs[sa].n_pages, b->seqs[sb].n_pages);
    for (int32_t i = 0; i < a->seqs[sa].n_pages; i++) {
        assert_int_equal(a->pages[a->seqs[sa].pages[i]].tk, b->pages[b->seqs[sb].pages[i]].tk);
        assert_int_equal(a->pages[a->seqs[sa].pages[i]].tv, b->pages[b->seqs[sb].pages[i]].tv);
    }
    struct kv_usage ua, ub;
    kv_usage(a, &ua);
    kv_usage(b, &ub);
    assert_int_equal(ua.used, ub.used);
    assert_memory_equal(ua.pages_k, ub.pages_k, sizeof ua.pages_k);
    assert_memory_equal(ua.pages_v, ub.pages_v, sizeof ua.pages_v);
}

static void test_static_to_dynamic_matches_a_dynamic_cache(void **state)
{
    (void)state;
    struct kv_config cfg;
    base_config(&cfg, 64, 12);
    struct kv_cache *switched, *ref;
    assert_int_equal(kv_create(&cfg, &switched), KS_OK);
    struct kv_config dyn = cfg;
    dyn.policy = KV_POLICY_DYNAMIC;
    dyn.hot_tokens = 32;
    dyn.sink_tokens = 16;
    dyn.high_watermark = 0.75f;
    dyn.low_watermark = 0.5f;
    dyn.floor = QUANT_Q8_0;
    assert_int_equal(kv_create(&dyn, &ref), KS_OK);
    int32_t s1, s2;
    assert_int_equal(kv_seq_create(switched, &s1), KS_OK);
    assert_int_equal(kv_seq_create(ref, &s2), KS_OK);
    /* 8 of 12 pages: under both watermarks' reach for the static cache */
    assert_int_equal(grow(switched, s1, 8 * 16), KS_OK);
    assert_int_equal(grow(ref, s2, 8 * 16), KS_OK);

    struct kv_policy_update u = {
        .set = KV_SET_POLICY | KV_SET_HOT_TOKENS | KV_SET_SINK_TOKENS | KV_SET_HIGH_WATERMARK |
               KV_SET_LOW_WATERMARK | KV_SET_FLOOR,
        .policy = KV_POLICY_DYNAMIC, .hot_tokens = 32, .sink_tokens = 16, .high_watermark = 0.75f,
        .low_watermark = 0.5f, .floor = QUANT_Q8_0,
    };
    assert_int_equal(kv_set_policy(switched, &u), KS_OK);
    const struct kv_config *now = kv_get_config(switched);
    assert_int_equal(now->policy, KV_POLICY_DYNAMIC);
    assert_int_equal(now->hot_tokens, 32);
    assert_int_equal(now->sink_tokens, 16);
    assert_true(now->high_watermark == 0.75f && now->low_watermark == 0.5f);
    assert_int_equal(now->floor, QUANT_Q8_0);
    assert_int_equal(now->type_k, QUANT_F16); /* fields not named stay */

    /* the same growth from here on demotes the same pages in both */
    for (int i = 0; i < 40; i++) {
        ks_status a = grow(switched, s1, 16), b = grow(ref, s2, 16);
        assert_int_equal(a, b);
        assert_int_equal(kv_check(switched), KS_OK);
        assert_same_pages(switched, s1, ref, s2);
        if (a == KS_ERR_KV_FULL)
            break;
        assert_int_equal(a, KS_OK);
    }
    struct kv_usage us;
    kv_usage(switched, &us);
    assert_true(us.demotions > 0);
    /* floor q8_0: nothing below it */
    assert_int_equal(us.pages_k[kv_type_index(QUANT_Q4_0)], 0);
    assert_int_equal(us.pages_v[kv_type_index(QUANT_Q4_0)], 0);
    assert_true(us.pages_v[kv_type_index(QUANT_Q8_0)] > 0);
    kv_free(switched);
    kv_free(ref);
}

static void test_dynamic_to_static_stops_demoting(void **state)
{
    (void)state;
    struct kv_config cfg;
    base_config(&cfg, 64, 6);
    cfg.policy = KV_POLICY_DYNAMIC;
    cfg.hot_tokens = 16;
    cfg.sink_tokens = 0;
    struct kv_cache *kv;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    int32_t s;
    assert_int_equal(kv_seq_create(kv, &s), KS_OK);
    assert_int_equal(grow(kv, s, 5 * 16), KS_OK);
    struct kv_policy_update u = {.set = KV_SET_POLICY, .policy = KV_POLICY_STATIC};
    assert_int_equal(kv_set_policy(kv, &u), KS_OK);
    assert_int_equal(grow(kv, s, 16), KS_OK); /* page 6 of 6: fits without demoting */
    assert_int_equal(grow(kv, s, 16), KS_ERR_KV_FULL);
    assert_non_null(strstr(ks_errmsg(), "--kv-policy dynamic"));
    struct kv_usage us;
    kv_usage(kv, &us);
    assert_int_equal(us.demotions, 0);
    assert_int_equal(us.pages_k[kv_type_index(QUANT_F16)], 6);
    /* back to dynamic: the next page demotes old ones to make room */
    u.policy = KV_POLICY_DYNAMIC;
    assert_int_equal(kv_set_policy(kv, &u), KS_OK);
    assert_int_equal(grow(kv, s, 16), KS_OK);
    kv_usage(kv, &us);
    assert_true(us.demotions > 0);
    assert_int_equal(kv_check(kv), KS_OK);
    kv_free(kv);
}

static void test_lower_high_watermark_demotes_at_next_allocation(void **state)
{
    (void)state;
    struct kv_config cfg;
    base_config(&cfg, 64, 20);
    cfg.policy = KV_POLICY_DYNAMIC;
    cfg.hot_tokens = 16;
    cfg.sink_tokens = 0;
    struct kv_cache *kv;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    int32_t s;
    assert_int_equal(kv_seq_create(kv, &s), KS_OK);
    assert_int_equal(grow(kv, s, 10 * 16), KS_OK); /* 50 %: no demotion at 0.90 */
    struct kv_usage us;
    kv_usage(kv, &us);
    assert_int_equal(us.demotions, 0);
    struct kv_policy_update u = {.set = KV_SET_HIGH_WATERMARK | KV_SET_LOW_WATERMARK, .high_watermark = 0.4f,
                                 .low_watermark = 0.3f};
    assert_int_equal(kv_set_policy(kv, &u), KS_OK);
    kv_usage(kv, &us);
    assert_int_equal(us.demotions, 0); /* nothing happens until the cache allocates */
    assert_int_equal(grow(kv, s, 16), KS_OK);
    kv_usage(kv, &us);
    assert_true(us.demotions > 0);
    assert_true((double)us.used <= 0.3 * (double)us.budget);
    kv_free(kv);
}

static void test_start_types_apply_to_new_pages_only(void **state)
{
    (void)state;
    struct kv_config cfg;
    base_config(&cfg, 64, 20);
    struct kv_cache *kv;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    int32_t s;
    assert_int_equal(kv_seq_create(kv, &s), KS_OK);
    assert_int_equal(grow(kv, s, 2 * 16), KS_OK);
    struct kv_policy_update u = {.set = KV_SET_TYPE_K | KV_SET_TYPE_V, .type_k = QUANT_Q8_0, .type_v = QUANT_Q4_0};
    assert_int_equal(kv_set_policy(kv, &u), KS_OK);
    assert_int_equal(grow(kv, s, 3 * 16), KS_OK);
    struct kv_usage us;
    kv_usage(kv, &us);
    assert_int_equal(us.pages_k[kv_type_index(QUANT_F16)], 2);
    assert_int_equal(us.pages_v[kv_type_index(QUANT_F16)], 2);
    assert_int_equal(us.pages_k[kv_type_index(QUANT_Q8_0)], 3);
    assert_int_equal(us.pages_v[kv_type_index(QUANT_Q4_0)], 3);
    assert_int_equal(us.used, 2 * kv_page_bytes(&cfg, QUANT_F16, QUANT_F16) +
                                  3 * kv_page_bytes(&cfg, QUANT_Q8_0, QUANT_Q4_0));
    assert_int_equal(kv_check(kv), KS_OK);
    /* kv_seq_pages lists them in token order; a fork shares them (ref 2) */
    struct kv_page_info info[8];
    int32_t n = -1, fork;
    assert_int_equal(kv_seq_pages(kv, s, info, 8, &n), KS_OK);
    assert_int_equal(n, 5);
    for (int i = 0; i < 5; i++) {
        assert_int_equal(info[i].type_k, i < 2 ? QUANT_F16 : QUANT_Q8_0);
        assert_int_equal(info[i].type_v, i < 2 ? QUANT_F16 : QUANT_Q4_0);
        assert_int_equal(info[i].ref, 1);
    }
    assert_int_equal(kv_seq_fork(kv, s, &fork), KS_OK);
    assert_int_equal(kv_seq_pages(kv, fork, info, 3, &n), KS_OK);
    assert_int_equal(n, 5); /* the count, though only 3 were filled */
    assert_int_equal(info[2].ref, 2);
    assert_int_equal(kv_seq_pages(kv, 99, info, 8, &n), KS_ERR_NOT_FOUND);
    assert_int_equal(n, 0);
    kv_free(kv);
}

struct bad_case {
    struct kv_policy_update u;
    const char *field; /* must appear in the message */
};

static void test_bad_values_change_nothing(void **state)
{
    (void)state;
    struct kv_config cfg;
    base_config(&cfg, 48, 1); /* head_dim 48: no quantized types; room for one f16 page */
    struct kv_cache *kv;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    const struct bad_case cases[] = {
        {{.set = KV_SET_POLICY, .policy = (enum kv_policy)7}, "policy"},
        {{.set = KV_SET_HIGH_WATERMARK, .high_watermark = 1.5f}, "high_watermark"},
        {{.set = KV_SET_HIGH_WATERMARK, .high_watermark = 0.0f}, "high_watermark"},
        {{.set = KV_SET_HIGH_WATERMARK, .high_watermark = NAN}, "high_watermark"},
        {{.set = KV_SET_LOW_WATERMARK, .low_watermark = 0.95f}, "low_watermark"}, /* above high 0.90 */
        {{.set = KV_SET_LOW_WATERMARK, .low_watermark = -0.1f}, "low_watermark"},
        {{.set = KV_SET_HOT_TOKENS, .hot_tokens = -1}, "hot_tokens"},
        {{.set = KV_SET_SINK_TOKENS, .sink_tokens = 1 << 30}, "sink_tokens"},
        {{.set = KV_SET_FLOOR, .floor = QUANT_Q4_0}, "floor"},
        {{.set = KV_SET_FLOOR, .floor = QUANT_Q4_K}, "floor"},
        {{.set = KV_SET_TYPE_K, .type_k = QUANT_Q8_0}, "type_k"},
        {{.set = KV_SET_TYPE_V, .type_v = QUANT_Q5_1}, "type_v"},
        {{.set = KV_SET_TYPE_V, .type_v = QUANT_Q4_K}, "type_v"},
        {{.set = KV_SET_LADDER, .n_ladder = 2, .ladder = {QUANT_F16, QUANT_F32}}, "--kv-ladder"},
        {{.set = KV_SET_LADDER, .n_ladder = 1, .ladder = {QUANT_IQ4_NL}}, "--kv-ladder"},
        {{.set = KV_SET_TYPE_K | KV_SET_TYPE_V, .type_k = QUANT_F32, .type_v = QUANT_F32}, "budget"},
        {{.set = 1u << 20}, "unknown"},
        /* a valid field beside a bad one: still nothing changes */
        {{.set = KV_SET_POLICY | KV_SET_HOT_TOKENS, .policy = KV_POLICY_DYNAMIC, .hot_tokens = -5}, "hot_tokens"},
    };
    cfg = *kv_get_config(kv);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        assert_int_equal(kv_set_policy(kv, &cases[i].u), KS_ERR_INVALID_ARG);
        if (!strstr(ks_errmsg(), cases[i].field))
            fail_msg("case %zu: message '%s' does not name '%s'", i, ks_errmsg(), cases[i].field);
        assert_memory_equal(kv_get_config(kv), &cfg, sizeof cfg);
    }
    assert_int_equal(kv_set_policy(kv, NULL), KS_ERR_INVALID_ARG);
    /* an empty update is valid and changes nothing */
    struct kv_policy_update none = {0};
    assert_int_equal(kv_set_policy(kv, &none), KS_OK);
    assert_memory_equal(kv_get_config(kv), &cfg, sizeof cfg);
    /* the default q4_0 floor of a head_dim-48 cache does not block other changes */
    struct kv_policy_update dyn = {.set = KV_SET_POLICY, .policy = KV_POLICY_DYNAMIC};
    assert_int_equal(kv_set_policy(kv, &dyn), KS_OK);
    kv_free(kv);
}

/* ---- the demotion ladder -------------------------------------------------- */

static void test_parse_type(void **state)
{
    (void)state;
    enum quant_type t = QUANT_F32;
    assert_int_equal(kv_parse_type("Q8_0", &t), KS_OK);
    assert_int_equal(t, QUANT_Q8_0);
    assert_int_equal(kv_parse_type("iq3_nl", &t), KS_OK);
    assert_int_equal(t, QUANT_IQ3_NL);
    const char *bad[] = {"q4_k", "q9_9", "", NULL}; /* a weight type, no type, nothing */
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        t = QUANT_F16;
        assert_int_equal(kv_parse_type(bad[i], &t), KS_ERR_INVALID_ARG);
        assert_non_null(strstr(ks_errmsg(), "is not a KV cache type (use f32, f16"));
        assert_int_equal(t, QUANT_F16); /* unchanged */
    }
}

static void test_parse_ladder(void **state)
{
    (void)state;
    struct kv_config cfg;
    base_config(&cfg, 64, 64);
    assert_int_equal(cfg.n_ladder, 2);
    assert_int_equal(kv_parse_ladder("f16,q8_0,q5_0,q4_0", &cfg), KS_OK);
    assert_int_equal(cfg.n_ladder, 4);
    assert_int_equal(cfg.ladder[2], QUANT_Q5_0);
    const char *bad[] = {"q4_0,q8_0", "q8_0,q8_0", "q8_0,,q4_0", "q8_0,q4_k", "", "f32,f16,bf16,q8_0,q5_1,q5_0,q4_1,iq4_nl,q4_0"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(kv_parse_ladder(bad[i], &cfg), KS_ERR_INVALID_ARG);
        assert_non_null(strstr(ks_errmsg(), "--kv-ladder"));
        assert_int_equal(cfg.n_ladder, 4); /* unchanged */
    }
    /* a block type on a head_dim it does not divide is refused by name */
    base_config(&cfg, 48, 64);
    cfg.type_k = QUANT_Q5_1;
    struct kv_cache *kv;
    assert_int_equal(kv_create(&cfg, &kv), KS_ERR_INVALID_ARG);
    assert_non_null(strstr(ks_errmsg(), "q5_1 needs head_dim to be a multiple of 32"));
    /* bf16 has no block: any head_dim */
    cfg.type_k = QUANT_BF16;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    struct kv_policy_update u = {.set = KV_SET_LADDER, .n_ladder = 2, .ladder = {QUANT_Q8_0, QUANT_IQ4_NL}};
    assert_int_equal(kv_set_policy(kv, &u), KS_ERR_INVALID_ARG); /* not usable at head_dim 48 */
    u.ladder[0] = QUANT_F16;
    u.ladder[1] = QUANT_BF16;
    assert_int_equal(kv_set_policy(kv, &u), KS_OK);
    assert_int_equal(kv_get_config(kv)->ladder[1], QUANT_BF16);
    kv_free(kv);
}

/* A dynamic cache of cfg with this ladder, pages of 32 tokens, room for
 * pages pages at the start types, and one sequence. */
static struct kv_cache *ladder_cache(struct kv_config *cfg, const char *ladder, int pages, int32_t *seq)
{
    cfg->page_tokens = 32;
    cfg->policy = KV_POLICY_DYNAMIC;
    assert_int_equal(kv_parse_ladder(ladder, cfg), KS_OK);
    cfg->mem_budget = (size_t)pages * kv_page_bytes(cfg, cfg->type_k, cfg->type_v);
    struct kv_cache *kv;
    assert_int_equal(kv_create(cfg, &kv), KS_OK);
    assert_int_equal(kv_seq_create(kv, seq), KS_OK);
    return kv;
}

/* The lowest precision (highest index) among the pages' K or V halves. */
static int lowest(const struct kv_usage *u, bool k)
{
    int lo = -1;
    for (int i = 0; i < KV_N_TYPES; i++)
        if ((k ? u->pages_k[i] : u->pages_v[i]) > 0)
            lo = i;
    return lo;
}

/* Start f32, then the ladder (its levels' indexes in on_ladder, the floor
 * last): as one sequence grows past the budget, every level is reached, V is
 * never behind K, no page leaves the ladder, and at the end, the cache full,
 * every page is at the floor on both halves (the sinks and hot window step
 * down last, when nothing else can). Returns the pages that fit. */
static int32_t check_ladder_to_floor(const char *ladder, enum quant_type floor, const int *on_ladder, int n_on)
{
    struct kv_config cfg;
    base_config(&cfg, 64, 64);
    cfg.type_k = cfg.type_v = QUANT_F32;
    cfg.sink_tokens = 32;
    cfg.hot_tokens = 64;
    cfg.floor = floor;
    int32_t s, len = 0;
    struct kv_cache *kv = ladder_cache(&cfg, ladder, 12, &s);
    bool seen[KV_N_TYPES] = {false};
    struct kv_usage u;
    for (;;) {
        ks_status st = grow(kv, s, 32);
        if (st == KS_ERR_KV_FULL)
            break;
        assert_int_equal(st, KS_OK);
        len += 32;
        assert_int_equal(kv_check(kv), KS_OK);
        kv_usage(kv, &u);
        assert_true(lowest(&u, false) >= lowest(&u, true));
        for (int i = 0; i < KV_N_TYPES; i++) {
            bool allowed = false;
            for (int j = 0; j < n_on; j++)
                allowed |= on_ladder[j] == i;
            if (u.pages_k[i] || u.pages_v[i]) {
                assert_true(allowed);
                seen[i] = true;
            }
        }
        assert_true(len < 100000);
    }
    for (int j = 0; j < n_on; j++)
        assert_true(seen[on_ladder[j]]);
    int32_t n_pages = len / 32;
    kv_usage(kv, &u);
    assert_int_equal(u.pages_k[kv_type_index(floor)], n_pages);
    assert_int_equal(u.pages_v[kv_type_index(floor)], n_pages);
    kv_free(kv);
    return n_pages;
}

static void test_dynamic_policy_four_step_ladder(void **state)
{
    (void)state;
    const int on_ladder[] = {KV_INDEX_F32, KV_INDEX_F16, KV_INDEX_Q8_0, KV_INDEX_Q5_0, KV_INDEX_Q4_0};
    int32_t n_pages = check_ladder_to_floor("f16,q8_0,q5_0,q4_0", QUANT_Q4_0, on_ladder, 5);
    assert_true(n_pages > 12 * 4); /* q4_0 pages are about a seventh of f32 ones */
}

/* A ladder ending at kvserve's 3.5-bit iq3_nl: more pages fit than at q4_0
 * (an iq3_nl page is 28/36 of a q4_0 one at head_dim 64). */
static void test_dynamic_policy_ladder_to_iq3_nl(void **state)
{
    (void)state;
    const int on_ladder[] = {KV_INDEX_F32, KV_INDEX_Q8_0, KV_INDEX_Q4_0, KV_INDEX_IQ3_NL};
    int32_t n_pages = check_ladder_to_floor("q8_0,q4_0,iq3_nl", QUANT_IQ3_NL, on_ladder, 4);
    const int q4_on[] = {KV_INDEX_F32, KV_INDEX_Q8_0, KV_INDEX_Q4_0};
    assert_true(n_pages > check_ladder_to_floor("q8_0,q4_0", QUANT_Q4_0, q4_on, 3));
}

/* A floor above the ladder's end stops it there; a floor not on the ladder is
 * its last step. Once the cache is full, the hot page is at the floor too. */
static void test_floor_ends_the_ladder(void **state)
{
    (void)state;
    const enum quant_type floors[] = {QUANT_Q5_0, QUANT_Q4_1};
    for (int f = 0; f < 2; f++) {
        struct kv_config cfg;
        base_config(&cfg, 64, 64);
        cfg.sink_tokens = 0;
        cfg.hot_tokens = 32;
        cfg.floor = floors[f];
        int32_t s, len = 0;
        struct kv_cache *kv = ladder_cache(&cfg, "q8_0,q5_0,q4_0", 8, &s);
        while (grow(kv, s, 32) == KS_OK)
            len += 32;
        struct kv_usage u;
        kv_usage(kv, &u);
        assert_int_equal(u.pages_k[kv_type_index(floors[f])], len / 32);
        assert_int_equal(u.pages_k[KV_INDEX_Q4_0], 0);
        assert_int_equal(kv_check(kv), KS_OK);
        kv_free(kv);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_static_to_dynamic_matches_a_dynamic_cache),
        cmocka_unit_test(test_dynamic_to_static_stops_demoting),
        cmocka_unit_test(test_lower_high_watermark_demotes_at_next_allocation),
        cmocka_unit_test(test_start_types_apply_to_new_pages_only),
        cmocka_unit_test(test_bad_values_change_nothing),
        cmocka_unit_test(test_parse_type),
        cmocka_unit_test(test_parse_ladder),
        cmocka_unit_test(test_dynamic_policy_four_step_ladder),
        cmocka_unit_test(test_dynamic_policy_ladder_to_iq3_nl),
        cmocka_unit_test(test_floor_ends_the_ladder),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
