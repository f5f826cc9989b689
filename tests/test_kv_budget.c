/* One budget for two caches of different layouts (a target's and its draft
 * model's, kv_share_budget): the bytes used are the sum of both caches' pages
 * (kv_check holds it), an allocation in either that would cross the limit
 * evicts the other's idle cached pages (never its pages in use), a full pool
 * says so with the numbers, and freeing one cache ends the sharing. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kv/kv.h"
#include "status/status.h"

enum { P = 32 };

/* The target: 4 layers, 2 KV heads of 64 at f16. The draft: 1 layer, 1 KV head of 32 at q4_0. */
static void target_config(struct kv_config *c, size_t budget)
{
    kv_config_default(c);
    c->n_layer = 4;
    c->n_kv_head = 2;
    c->head_dim = 64;
    c->mem_budget = budget;
    memcpy(c->fingerprint, "target-model-fp!", 16);
}

static void draft_config(struct kv_config *c)
{
    kv_config_default(c);
    c->n_layer = 1;
    c->n_kv_head = 1;
    c->head_dim = 32;
    c->type_k = c->type_v = QUANT_Q4_0;
    c->mem_budget = 1 << 20; /* replaced by the target's */
    memcpy(c->fingerprint, "draft-model-fp!!", 16);
}

static size_t target_page(void)
{
    struct kv_config c;
    target_config(&c, 0);
    return kv_page_bytes(&c, QUANT_F16, QUANT_F16);
}

static size_t draft_page(void)
{
    struct kv_config c;
    draft_config(&c);
    return kv_page_bytes(&c, QUANT_Q4_0, QUANT_Q4_0);
}

static void fill(struct kv_cache *kv, int32_t seq, const int32_t *tokens, int32_t n)
{
    const struct kv_config *c = kv_get_config(kv);
    size_t w = (size_t)c->n_kv_head * c->head_dim;
    float k[128], v[128];
    for (int32_t p = 0; p < n; p++)
        for (int l = 0; l < c->n_layer; l++) {
            for (size_t i = 0; i < w; i++) {
                k[i] = (float)((tokens[p] * 13 + p + l + (int)i) % 31) / 31.0f - 0.5f;
                v[i] = (float)((tokens[p] * 7 + p * 3 + (int)i) % 29) / 29.0f - 0.5f;
            }
            assert_int_equal(kv_write(kv, l, seq, p, k, v), KS_OK);
        }
}

/* A sequence of n tokens, published and freed: its full pages stay idle. */
static void idle_pages(struct kv_cache *kv, const int32_t *tokens, int32_t n)
{
    int32_t seq;
    assert_int_equal(kv_seq_create(kv, &seq), KS_OK);
    assert_int_equal(kv_seq_grow(kv, seq, n), KS_OK);
    fill(kv, seq, tokens, n);
    assert_int_equal(kv_seq_publish(kv, seq, tokens, n), KS_OK);
    kv_seq_free(kv, seq);
}

static void assert_shared(const struct kv_cache *target, const struct kv_cache *draft)
{
    struct kv_usage ut, ud;
    kv_usage(target, &ut);
    kv_usage(draft, &ud);
    assert_int_equal(ut.shared_used, ud.used);
    assert_int_equal(ud.shared_used, ut.used);
    assert_int_equal(kv_budget_used(target), ut.used + ud.used);
    assert_int_equal(kv_budget_used(draft), ut.used + ud.used);
    assert_int_equal(ut.budget, ud.budget);
    assert_int_equal(ut.free, ut.budget - ut.used - ud.used);
    assert_int_equal(ud.free, ut.free);
    assert_int_equal(kv_check(target), KS_OK);
    assert_int_equal(kv_check(draft), KS_OK);
}

static void test_sum_and_eviction(void **state)
{
    (void)state;
    size_t budget = 6 * target_page() + 4 * draft_page();
    struct kv_config tc, dc;
    target_config(&tc, budget);
    draft_config(&dc);
    struct kv_cache *target = NULL, *draft = NULL;
    assert_int_equal(kv_create(&tc, &target), KS_OK);
    assert_int_equal(kv_create(&dc, &draft), KS_OK);
    assert_int_equal(kv_share_budget(target, draft), KS_OK);
    assert_int_equal(kv_get_config(draft)->mem_budget, budget);
    assert_int_equal(kv_share_budget(target, draft), KS_ERR_STATE); /* once */

    int32_t tokens[8 * P];
    for (int32_t i = 0; i < 8 * P; i++)
        tokens[i] = 3 + i % 251;
    /* the draft leaves 4 idle pages, the target holds 5 pages in use */
    idle_pages(draft, tokens, 4 * P);
    int32_t seq;
    assert_int_equal(kv_seq_create(target, &seq), KS_OK);
    assert_int_equal(kv_seq_grow(target, seq, 5 * P), KS_OK);
    assert_shared(target, draft);
    struct kv_usage ud;
    kv_usage(draft, &ud);
    assert_int_equal(ud.n_idle_pages, 4);
    assert_int_equal(ud.used, 4 * draft_page());

    /* the target's 6th page fits; its 7th needs the draft's idle bytes */
    assert_int_equal(kv_seq_grow(target, seq, P), KS_OK);
    assert_shared(target, draft);
    kv_usage(draft, &ud);
    assert_int_equal(ud.n_idle_pages, 4);
    /* its 7th page would need more than the draft's 4 small idle pages, which it evicted trying */
    assert_int_equal(kv_seq_grow(target, seq, P), KS_ERR_KV_FULL);
    kv_usage(draft, &ud);
    assert_int_equal(ud.n_idle_pages, 0);
    assert_int_equal(ud.evictions, 4);
    assert_shared(target, draft);

    /* the draft's pages in use are never taken: a full pool refuses with the numbers */
    kv_seq_free(target, seq);
    int32_t dseq;
    assert_int_equal(kv_seq_create(draft, &dseq), KS_OK);
    assert_int_equal(kv_seq_grow(draft, dseq, 4 * P), KS_OK);
    assert_int_equal(kv_seq_create(target, &seq), KS_OK);
    assert_int_equal(kv_seq_grow(target, seq, 6 * P), KS_OK);
    assert_shared(target, draft);
    assert_int_equal(kv_seq_grow(draft, dseq, P), KS_ERR_KV_FULL);
    assert_non_null(strstr(ks_errmsg(), "out of KV memory"));
    assert_int_equal(kv_seq_len(draft, dseq), 4 * P);
    assert_shared(target, draft);

    /* idle target pages make room for the draft */
    fill(target, seq, tokens, 6 * P);
    assert_int_equal(kv_seq_publish(target, seq, tokens, 6 * P), KS_OK);
    kv_seq_free(target, seq);
    struct kv_usage ut;
    kv_usage(target, &ut);
    assert_int_equal(ut.n_idle_pages, 6);
    assert_int_equal(kv_seq_grow(draft, dseq, 2 * P), KS_OK);
    kv_usage(target, &ut);
    assert_int_equal(ut.n_idle_pages, 5); /* one big page made room for two small ones */
    assert_int_equal(ut.evictions, 1);
    assert_shared(target, draft);

    /* kv_fit counts the other cache's idle pages as room */
    struct kv_fit fit;
    kv_fit(draft, &fit);
    assert_true(fit.start >= (int64_t)(5 * target_page() / draft_page() - 1) * P);

    /* clearing the cache clears the draft's idle pages too */
    assert_int_equal(kv_seq_publish(draft, dseq, tokens, 0), KS_OK);
    fill(draft, dseq, tokens, 6 * P);
    assert_int_equal(kv_seq_publish(draft, dseq, tokens, 6 * P), KS_OK);
    kv_seq_free(draft, dseq);
    kv_usage(draft, &ud);
    assert_int_equal(ud.n_idle_pages, 6);
    assert_int_equal(kv_prefix_clear(target), 5 + 6);
    assert_int_equal(kv_budget_used(target), 0);
    assert_shared(target, draft);
    kv_free(draft); /* ends the sharing */
    kv_usage(target, &ut);
    assert_int_equal(ut.shared_used, 0);
    assert_int_equal(kv_budget_used(target), ut.used);
    assert_int_equal(kv_check(target), KS_OK);
    kv_free(target);
}

static void test_refused(void **state)
{
    (void)state;
    struct kv_config tc, dc;
    target_config(&tc, target_page());
    draft_config(&dc);
    struct kv_cache *target = NULL, *draft = NULL, *other = NULL;
    assert_int_equal(kv_create(&tc, &target), KS_OK);
    assert_int_equal(kv_create(&dc, &draft), KS_OK);
    assert_int_equal(kv_create(&dc, &other), KS_OK);
    assert_int_equal(kv_share_budget(target, target), KS_ERR_STATE);
    /* a cache that holds pages cannot join */
    int32_t seq;
    assert_int_equal(kv_seq_create(draft, &seq), KS_OK);
    assert_int_equal(kv_seq_grow(draft, seq, 1), KS_OK);
    assert_int_equal(kv_share_budget(target, draft), KS_ERR_STATE);
    kv_seq_free(draft, seq);
    /* no room for one draft page beside the target's page */
    assert_int_equal(kv_seq_create(target, &seq), KS_OK);
    assert_int_equal(kv_seq_grow(target, seq, 1), KS_OK);
    assert_int_equal(kv_share_budget(target, other), KS_ERR_KV_FULL);
    assert_non_null(strstr(ks_errmsg(), "bytes"));
    kv_seq_free(target, seq);
    assert_int_equal(kv_share_budget(target, other), KS_OK);
    assert_int_equal(kv_share_budget(target, draft), KS_ERR_STATE); /* one peer only */
    kv_free(target); /* the peer goes on alone */
    assert_int_equal(kv_check(other), KS_OK);
    kv_free(other);
    kv_free(draft);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sum_and_eviction),
        cmocka_unit_test(test_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
