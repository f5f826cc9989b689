/* The prefix cache end to end through the scheduler and the real engine: a
 * greedy request gives the same tokens with and without prefix hits, requests
 * that share a prompt compute its pages once (also when they arrive together),
 * round 2 of a chat reuses round 1's pages with its generated tokens, and
 * max_tokens 0 warms the cache. The model is the build's default model (a
 * deterministic random `tiny` llama, $KVSERVE_DEFAULT_MODEL), or
 * $KVSERVE_PREFIX_MODEL. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kv/kv.h"
#include "model/model.h"
#include "sched/sched.h"
#include "store/store.h"
#include "support/deadline.h"
#include "support/sched_result.h"
#include "support/skip.h"
#include "threads/threads.h"

enum { N_REQ = 16, P = 32 };

static struct model *g_model;
static enum kv_smooth g_smooth; /* the caches' smoothing, per case */
static int32_t g_swa_window;    /* > 0: the caches mark every other layer sliding-window (per case) */
static threads_pool *g_pool;
static char g_model_path[4096];

/* ---- a request and its events ------------------------------------------------- */

static struct sched_result *run(struct sched *s, const int32_t *prompt, int32_t n, int32_t max_tokens)
{
    struct sched_result *r = malloc(sizeof *r);
    sched_result_submit_greedy(s, prompt, n, max_tokens, r);
    sched_result_wait(r);
    return r;
}

/* ---- engine ------------------------------------------------------------------- */

static struct sched *make_sched(bool prefix_cache, enum quant_type type, int parallel)
{
    struct kv_config kc;
    model_kv_config(g_model, &kc);
    kc.mem_budget = 64u << 20;
    kc.type_k = kc.type_v = type;
    kc.prefix_cache = prefix_cache;
    kc.smooth = g_smooth;
    kc.swa_window = g_swa_window;
    for (int l = 0; g_swa_window && l < kc.n_layer; l++)
        kc.swa_layer[l] = l % 2 == 0;
    struct sched_engine eng;
    assert_int_equal(sched_engine_model(g_model, &kc, 512, g_pool, &eng), KS_OK);
    struct sched_config sc;
    sched_config_default(&sc);
    sc.parallel = parallel;
    sc.max_itl_ratio = 0.0f; /* deterministic chunks */
    struct sched *s = NULL;
    assert_int_equal(sched_create(&sc, &eng, &s), KS_OK);
    return s;
}

static struct sched *make_sched_store(struct store *st, size_t budget)
{
    struct kv_config kc;
    model_kv_config(g_model, &kc);
    kc.mem_budget = budget;
    kc.smooth = g_smooth;
    struct sched_engine eng;
    assert_int_equal(sched_engine_model(g_model, &kc, 512, g_pool, &eng), KS_OK);
    sched_engine_model_set_store(&eng, st);
    struct sched_config sc;
    sched_config_default(&sc);
    sc.parallel = 2;
    sc.max_itl_ratio = 0.0f;
    struct sched *s = NULL;
    assert_int_equal(sched_create(&sc, &eng, &s), KS_OK);
    return s;
}

static void prompt_of(int32_t *t, int32_t n, int32_t salt)
{
    int32_t n_vocab = model_hparams(g_model)->n_vocab;
    for (int32_t i = 0; i < n; i++)
        t[i] = 3 + (int32_t)(((uint32_t)i * 2654435761u + (uint32_t)salt * 40503u) % (uint32_t)(n_vocab - 3));
}

/* ---- tests -------------------------------------------------------------------- */

/* Exact results: the tokens with a hit equal the tokens computed cold, at f16
 * and at q8_0 pages, and at q8_0 pages smoothed (the hit maps page 0 with its
 * channel means). */
static void test_hit_gives_same_tokens(void **state)
{
    (void)state;
    enum quant_type types[3] = {QUANT_F16, QUANT_Q8_0, QUANT_Q8_0};
    enum kv_smooth smooth[3] = {KV_SMOOTH_OFF, KV_SMOOTH_OFF, KV_SMOOTH_KV};
    for (int t = 0; t < 3; t++) {
        g_smooth = smooth[t];
        int32_t prompt[300];
        prompt_of(prompt, 300, 1);
        struct sched *cold = make_sched(false, types[t], 4);
        struct sched_result *ref = run(cold, prompt, 300, 24);
        sched_free(cold);
        assert_int_equal(ref->n_cached, 0);

        struct sched *s = make_sched(true, types[t], 4);
        struct sched_result *first = run(s, prompt, 300, 24);
        struct sched_result *again = run(s, prompt, 300, 24);
        assert_int_equal(first->n_cached, 0);
        assert_int_equal(again->n_cached, 299 / P * P + 299 % P); /* all but the last token */
        assert_int_equal(again->n, 24);
        assert_memory_equal(ref->tokens, first->tokens, 24 * sizeof(int32_t));
        assert_memory_equal(ref->tokens, again->tokens, 24 * sizeof(int32_t));
        /* a prompt that shares 200 tokens then differs: hit, and equal to cold */
        int32_t other[260];
        memcpy(other, prompt, 200 * sizeof *other);
        prompt_of(other + 200, 60, 2);
        struct sched_result *branch = run(s, other, 260, 16);
        assert_int_equal(branch->n_cached, 200);
        sched_free(s);
        cold = make_sched(false, types[t], 4);
        struct sched_result *branch_ref = run(cold, other, 260, 16);
        sched_free(cold);
        assert_memory_equal(branch_ref->tokens, branch->tokens, 16 * sizeof(int32_t));
        free(ref);
        free(first);
        free(again);
        free(branch);
        free(branch_ref);
    }
    g_smooth = KV_SMOOTH_OFF;
}

/* Sixteen requests with one 600-token prefix, submitted together: the prefix
 * is computed once, and every answer equals its solo answer. */
static void test_concurrent_sharers_compute_prefix_once(void **state)
{
    (void)state;
    enum { PREFIX = 600, SUFFIX = 27, LEN = PREFIX + SUFFIX };
    static int32_t prompts[N_REQ][LEN];
    for (int i = 0; i < N_REQ; i++) {
        prompt_of(prompts[i], PREFIX, 3);
        prompt_of(prompts[i] + PREFIX, SUFFIX, 100 + i);
    }
    struct sched *s = make_sched(true, QUANT_F16, N_REQ);
    struct sched_result res[N_REQ];
    for (int i = 0; i < N_REQ; i++)
        sched_result_submit_greedy(s, prompts[i], LEN, 8, &res[i]);
    for (int i = 0; i < N_REQ; i++)
        sched_result_wait(&res[i]);
    struct sched_stats st;
    sched_get_stats(s, &st);
    sched_free(s);
    /* naive: 16 x 627 = 10032 tokens; shared: one request computes it all, the
     * others only their 27-token suffix (the prefix's partial last page is
     * taken from the first request's page and copied on write) */
    print_message("prompt tokens computed: %llu of %d, shared during prefill: %llu, waits %llu\n",
                  (unsigned long long)st.prompt_tokens, N_REQ * LEN, (unsigned long long)st.prefix_shared_tokens,
                  (unsigned long long)st.prefix_wait_steps);
    assert_true(st.prompt_tokens <= (uint64_t)(LEN + (N_REQ - 1) * SUFFIX));
    for (int i = 1; i < N_REQ; i++)
        assert_int_equal(res[i].n_cached, PREFIX);
    struct sched *cold = make_sched(false, QUANT_F16, 4);
    for (int i = 0; i < N_REQ; i += 5) {
        struct sched_result *ref = run(cold, prompts[i], LEN, 8);
        assert_memory_equal(ref->tokens, res[i].tokens, 8 * sizeof(int32_t));
        free(ref);
    }
    sched_free(cold);
}

/* Round 2 of a chat reuses round 1's prompt and generated tokens. */
static void test_chat_round_two_reuses_generated(void **state)
{
    (void)state;
    struct sched *s = make_sched(true, QUANT_F16, 4);
    int32_t round[400];
    prompt_of(round, 150, 4);
    struct sched_result *r1 = run(s, round, 150, 40);
    memcpy(round + 150, r1->tokens, 40 * sizeof *round);
    prompt_of(round + 190, 70, 5);
    struct sched_result *r2 = run(s, round, 260, 8);
    /* all 189 tokens round 1 computed (its last generated token was never fed):
     * 5 full pages and the tail round 1 left when it ended */
    assert_int_equal(r2->n_cached, 189);
    sched_free(s);
    free(r1);
    free(r2);
}

/* Sliding-window layers (the cache config marks every other layer of the
 * llama windowed: not a real sliding-window model's maths, the cache's part of
 * it): round 2 of a chat hits to round 1's end, whose last pages keep their
 * window rows; a prompt sharing only round 1's beginning misses there (those
 * pages lost theirs); both give the tokens a cold run gives. */
static void test_sliding_window_hits(void **state)
{
    (void)state;
    g_swa_window = 64;
    int32_t round[400], branch[200];
    prompt_of(round, 150, 4);
    struct sched *cold = make_sched(false, QUANT_F16, 4);
    struct sched_result *ref1 = run(cold, round, 150, 40);
    struct sched *s = make_sched(true, QUANT_F16, 4);
    struct sched_result *r1 = run(s, round, 150, 40);
    assert_memory_equal(ref1->tokens, r1->tokens, 40 * sizeof(int32_t));
    memcpy(round + 150, r1->tokens, 40 * sizeof *round);
    prompt_of(round + 190, 70, 5);
    struct sched_result *r2 = run(s, round, 260, 8), *ref2 = run(cold, round, 260, 8);
    assert_int_equal(r2->n_cached, 189);
    assert_memory_equal(ref2->tokens, r2->tokens, 8 * sizeof(int32_t));
    memcpy(branch, round, 100 * sizeof *branch);
    prompt_of(branch + 100, 100, 6);
    struct sched_result *r3 = run(s, branch, 200, 8), *ref3 = run(cold, branch, 200, 8);
    assert_int_equal(r3->n_cached, 0); /* pages 0..2 (tokens before 96) keep no window rows */
    assert_memory_equal(ref3->tokens, r3->tokens, 8 * sizeof(int32_t));
    sched_free(s);
    sched_free(cold);
    free(ref1);
    free(r1);
    free(r2);
    free(ref2);
    free(r3);
    free(ref3);
    g_swa_window = 0;
}

/* max_tokens 0 computes and caches the prompt, and returns at once. */
static void test_warm_up(void **state)
{
    (void)state;
    struct sched *s = make_sched(true, QUANT_F16, 4);
    int32_t prompt[200];
    prompt_of(prompt, 200, 6);
    struct sched_result *w = run(s, prompt, 128, 0);
    assert_int_equal(w->finish, SCHED_FINISH_LENGTH);
    assert_int_equal(w->n, 0);
    assert_int_equal(w->n_prompt, 128);
    struct sched_result *hit = run(s, prompt, 200, 4);
    assert_int_equal(hit->n_cached, 128);
    struct sched_result *again = run(s, prompt, 128, 0); /* fully cached: nothing to compute */
    assert_int_equal(again->n_cached, 128);
    assert_int_equal(again->finish, SCHED_FINISH_LENGTH);
    struct sched_stats st;
    sched_get_stats(s, &st);
    assert_int_equal(st.prompt_tokens, 128 + 72);
    sched_free(s);
    free(w);
    free(hit);
    free(again);
}

/* The SSD tier: pages persisted when an engine stops are read back by the
 * next engine over the same store, with the same tokens as a cold run; pages
 * evicted from a small RAM budget are written behind and read back too. */
static void disk_tier_restart(void)
{
    char dir[] = "/tmp/kvserve-prefix-XXXXXX";
    assert_non_null(mkdtemp(dir));
    struct kv_config kc;
    model_kv_config(g_model, &kc);
    struct store_config stc = {.dir = dir, .max_bytes = 256u << 20};
    memcpy(stc.fingerprint, kc.fingerprint, sizeof stc.fingerprint);
    int32_t prompt[400];
    prompt_of(prompt, 400, 7);

    struct sched *cold = make_sched(false, QUANT_F16, 2);
    struct sched_result *ref = run(cold, prompt, 400, 12);
    sched_free(cold);

    struct store *st = NULL;
    assert_int_equal(store_open(&stc, &st), KS_OK);
    struct sched *s = make_sched_store(st, 64u << 20);
    struct sched_result *first = run(s, prompt, 400, 12);
    sched_free(s); /* persists every cached page */
    store_close(st);

    assert_int_equal(store_open(&stc, &st), KS_OK);
    struct store_stats ss;
    store_stats(st, &ss);
    assert_true(ss.entries >= 12);
    s = make_sched_store(st, 64u << 20);
    struct sched_result *warm = run(s, prompt, 400, 12);
    struct sched_stats sst;
    sched_get_stats(s, &sst);
    sched_free(s);
    assert_int_equal(warm->n_cached, 384);
    assert_int_equal(sst.prefix_hit_disk_tokens, 384);
    assert_memory_equal(ref->tokens, first->tokens, 12 * sizeof(int32_t));
    assert_memory_equal(ref->tokens, warm->tokens, 12 * sizeof(int32_t));

    /* a RAM budget of 16 pages: another prompt pushes this one's pages out to disk */
    size_t page = kv_page_bytes(&kc, QUANT_F16, QUANT_F16);
    s = make_sched_store(st, 16 * page);
    int32_t other[400];
    prompt_of(other, 400, 8);
    struct sched_result *a = run(s, prompt, 400, 4);
    struct sched_result *b = run(s, other, 400, 4);
    store_flush(st);
    struct sched_result *c = run(s, prompt, 400, 4);
    sched_get_stats(s, &sst);
    sched_free(s);
    assert_true(c->n_cached >= 352); /* from RAM and disk */
    assert_true(sst.prefix_hit_disk_tokens > 0);
    assert_memory_equal(a->tokens, c->tokens, 4 * sizeof(int32_t));
    store_close(st);
    free(ref);
    free(first);
    free(warm);
    free(a);
    free(b);
    free(c);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
}

/* Without and with smoothing: page 0's blob carries the channel means. */
static void test_disk_tier_restart(void **state)
{
    (void)state;
    disk_tier_restart();
    g_smooth = KV_SMOOTH_KV;
    disk_tier_restart();
    g_smooth = KV_SMOOTH_OFF;
}

/* ---- setup -------------------------------------------------------------------- */

static int setup(void **state)
{
    (void)state;
    if (model_load(g_model_path, &g_model) != KS_OK) {
        fprintf(stderr, "setup: %s\n", ks_errmsg());
        return -1;
    }
    return threads_create(2, &g_pool) == KS_OK ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    threads_free(g_pool);
    model_free(g_model);
    return 0;
}

int main(void)
{
    const char *path = getenv("KVSERVE_PREFIX_MODEL");
    if (!path)
        path = getenv("KVSERVE_DEFAULT_MODEL");
    if (!path || access(path, R_OK) != 0)
        return ks_skip_all("no model at '%s' (build the default model or set KVSERVE_PREFIX_MODEL)",
                           path ? path : "$KVSERVE_DEFAULT_MODEL");
    snprintf(g_model_path, sizeof g_model_path, "%s", path);
    if (setup(NULL) != 0)
        return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hit_gives_same_tokens),
        cmocka_unit_test(test_concurrent_sharers_compute_prefix_once),
        cmocka_unit_test(test_chat_round_two_reuses_generated),
        cmocka_unit_test(test_sliding_window_hits),
        cmocka_unit_test(test_warm_up),
        cmocka_unit_test(test_disk_tier_restart),
    };
    int rc = ks_run_tests(tests, NULL, NULL);
    teardown(NULL);
    return rc;
}
