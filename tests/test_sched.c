/* Scheduler logic against a mock engine whose "model" is a pure function of a
 * sequence's whole history: whatever the batching, chunking or preemption,
 * each request must get exactly the tokens it would get alone. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sched/sched.h"
#include "sched/sched_cost.h"
#include "support/deadline.h"
#include "support/mock_engine.h"

#define V 97
#define MAX_SEQ 64

/* ---- mock engine (tests/support/mock_engine.h) ------------------------------------ */

/* A cache of capacity tokens, sequences of up to ctx tokens, ids 0..V-1. */
static struct mock_engine_config mock_config(int32_t capacity, int32_t ctx)
{
    struct mock_engine_config mc = {.n_vocab = V, .max_seqs = MAX_SEQ, .max_ctx = ctx, .capacity = capacity};
    return mc;
}

static struct mock_engine *mock_new(int32_t capacity, int32_t ctx)
{
    struct mock_engine_config mc = mock_config(capacity, ctx);
    struct mock_engine *m = NULL;
    assert_int_equal(mock_engine_create(&mc, &m), KS_OK);
    return m;
}

static struct mock_engine_stats mock_stats(struct mock_engine *m)
{
    struct mock_engine_stats st;
    mock_engine_stats(m, &st);
    return st;
}

/* ---- request results -------------------------------------------------------- */

struct result {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int32_t tokens[4096];
    uint64_t step_of[4096];    /* mock step count when each token arrived */
    int n;
    bool done;
    enum sched_finish finish;
    struct mock_engine *m;
};

static void on_event(void *user, const struct sched_event *ev)
{
    struct result *r = user;
    pthread_mutex_lock(&r->mu);
    if (ev->finish == SCHED_FINISH_NONE) {
        assert_int_equal(ev->n_generated, r->n + 1);
        r->step_of[r->n] = r->m ? mock_stats(r->m).steps : 0;
        r->tokens[r->n++] = ev->token;
    } else {
        r->finish = ev->finish;
        r->done = true;
        pthread_cond_broadcast(&r->cv);
    }
    pthread_mutex_unlock(&r->mu);
}

static struct result *result_new(struct mock_engine *m)
{
    struct result *r = calloc(1, sizeof *r);
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    r->m = m;
    return r;
}

static void result_wait(struct result *r)
{
    pthread_mutex_lock(&r->mu);
    ks_cond_wait_until(&r->cv, &r->mu, &r->done, "a request to finish");
    pthread_mutex_unlock(&r->mu);
}

/* Tokens the request has received so far. */
static int result_count(struct result *r)
{
    pthread_mutex_lock(&r->mu);
    int n = r->n;
    pthread_mutex_unlock(&r->mu);
    return n;
}

static void result_free(struct result *r)
{
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r);
}

static void make_prompt(int32_t *p, int32_t n, int seed)
{
    for (int32_t i = 0; i < n; i++)
        p[i] = (int32_t)((seed * 31 + i * 7 + 3) % V);
}

/* What the mock model generates alone, greedily. */
static void reference(const int32_t *prompt, int32_t n_prompt, int32_t n_gen, int32_t *out)
{
    struct mock_engine_config mc = mock_config(0, 1);
    mock_engine_generate(&mc, prompt, n_prompt, n_gen, out);
}

static uint64_t submit(struct sched *s, const int32_t *prompt, int32_t n, int32_t max_tokens, struct result *r)
{
    struct sched_request rq = {.prompt = prompt, .n_prompt = n, .max_tokens = max_tokens,
                               .on_event = on_event, .user = r};
    uint64_t id = 0;
    assert_int_equal(sched_submit(s, &rq, &id), KS_OK);
    return id;
}

/* n choices of one prompt; ids_out[i] names choice i. */
static void submit_n(struct sched *s, const int32_t *prompt, int32_t n_prompt, int32_t max_tokens, int n,
                     struct result **res, uint64_t *ids_out)
{
    struct sched_request rq = {.prompt = prompt, .n_prompt = n_prompt, .max_tokens = max_tokens, .on_event = on_event};
    struct sched_choice ch[16];
    assert_true(n <= 16);
    for (int i = 0; i < n; i++)
        ch[i] = (struct sched_choice){.user = res[i]};
    assert_int_equal(sched_submit_n(s, &rq, ch, n, ids_out), KS_OK);
}

/* timed: the default decode-first prefill budget, sized by measured step
 * times. The preemption tests run untimed: they need the prompts to fill
 * the cache, which a slow or loaded run (TSan beside another test) could
 * otherwise spread over so many steps that the first requests finish first
 * and nothing is preempted. */
static struct sched *start_cfg(struct mock_engine *m, int parallel, int32_t max_batch, int32_t chunk, int32_t ctx,
                               bool timed)
{
    struct sched_config cfg;
    sched_config_default(&cfg);
    if (!timed)
        cfg.max_itl_ratio = 0.0f;
    cfg.parallel = parallel;
    cfg.max_batch_tokens = max_batch;
    cfg.prefill_chunk = chunk;
    cfg.ctx_size = ctx;
    struct sched_engine e = mock_engine_sched(m, false);
    struct sched *s = NULL;
    assert_int_equal(sched_create(&cfg, &e, &s), KS_OK);
    return s;
}

static struct sched *start(struct mock_engine *m, int parallel, int32_t max_batch, int32_t chunk, int32_t ctx)
{
    return start_cfg(m, parallel, max_batch, chunk, ctx, true);
}

static struct sched *start_untimed(struct mock_engine *m, int parallel, int32_t max_batch, int32_t chunk,
                                   int32_t ctx)
{
    return start_cfg(m, parallel, max_batch, chunk, ctx, false);
}

/* Wait for r, which must have run to max_tokens GEN alone-equal tokens, and free it. */
static void expect_alone_result(struct result *r, const int32_t *prompt, int32_t n_prompt, int32_t n_gen)
{
    int32_t want[4096];
    reference(prompt, n_prompt, n_gen, want);
    result_wait(r);
    assert_int_equal(r->finish, SCHED_FINISH_LENGTH);
    assert_int_equal(r->n, n_gen);
    assert_memory_equal(r->tokens, want, (size_t)n_gen * sizeof *want);
    result_free(r);
}

/* Stop the scheduler; every sequence is freed and every position was right. */
static void stop_clean(struct sched *s, struct mock_engine *m)
{
    sched_free(s);
    assert_int_equal(mock_stats(m).bad_positions, 0);
    assert_int_equal(mock_stats(m).n_live, 0);
    assert_int_equal(mock_stats(m).used, 0);
    mock_engine_free(m);
}

/* ---- tests ------------------------------------------------------------------ */

/* n choices compute the prompt once: the others fork the first's sequence,
 * and each continues exactly as a request of its own would. */
static void test_choices_share_prompt(void **state)
{
    (void)state;
    enum { N = 4, P = 100, GEN = 30 };
    struct mock_engine *m = mock_new(100000, 1024);
    struct sched *s = start(m, 8, 64, 16, 1024);
    int32_t prompt[P];
    make_prompt(prompt, P, 9);
    struct result *res[N];
    uint64_t ids[N];
    for (int i = 0; i < N; i++)
        res[i] = result_new(m);
    submit_n(s, prompt, P, GEN, N, res, ids);
    for (int i = 0; i < N; i++) {
        expect_alone_result(res[i], prompt, P, GEN);
        for (int j = 0; j < i; j++)
            assert_true(ids[i] != ids[j]);
    }
    struct sched_stats st;
    sched_get_stats(s, &st);
    assert_int_equal(st.prompt_tokens, P);
    assert_int_equal(st.forked_choices, N - 1);
    assert_int_equal(sched_check(s), KS_OK);
    sched_free(s);
    struct mock_engine_stats ms = mock_stats(m);
    assert_int_equal(ms.forks, N - 1);
    assert_int_equal(ms.fed, P + N * (GEN - 1)); /* the prompt once, then each choice's own tokens */
    assert_int_equal(ms.bad_positions, 0);
    assert_int_equal(ms.n_live, 0);
    assert_int_equal(ms.used, 0);
    mock_engine_free(m);
}

/* Groups under memory pressure: forked choices are preempted and recomputed
 * like any request, and every choice still gets its exact tokens. */
static void test_choices_under_preemption(void **state)
{
    (void)state;
    enum { G = 4, N = 4, P = 50, GEN = 100 };
    struct mock_engine *m = mock_new(900, 1024);
    mock_engine_hold(m, true);
    struct sched *s = start_untimed(m, 16, 128, 32, 1024);
    static int32_t prompts[G][P];
    struct result *res[G][N];
    for (int g = 0; g < G; g++) {
        make_prompt(prompts[g], P, 70 + g);
        for (int i = 0; i < N; i++)
            res[g][i] = result_new(m);
        submit_n(s, prompts[g], P, GEN, N, res[g], NULL);
    }
    mock_engine_hold(m, false);
    for (int g = 0; g < G; g++)
        for (int i = 0; i < N; i++)
            expect_alone_result(res[g][i], prompts[g], P, GEN);
    struct sched_stats st;
    sched_get_stats(s, &st);
    assert_true(st.preemptions > 0);
    assert_true(st.forked_choices > 0);
    assert_int_equal(sched_check(s), KS_OK); /* Debug builds checked it after every change too */
    stop_clean(s, m);
}

/* Cancelling choices before the fork ends only them, the first choice
 * included: a remaining choice takes over its pages and finishes. */
static void test_cancel_choices_before_fork(void **state)
{
    (void)state;
    enum { N = 3, P = 40, GEN = 12 };
    struct mock_engine *m = mock_new(100000, 1024);
    mock_engine_hold(m, true);
    struct sched *s = start(m, 4, 64, 8, 1024);
    int32_t prompt[P], want[GEN];
    make_prompt(prompt, P, 21);
    reference(prompt, P, GEN, want);
    struct result *res[N];
    uint64_t ids[N];
    for (int i = 0; i < N; i++)
        res[i] = result_new(m);
    submit_n(s, prompt, P, GEN, N, res, ids);
    sched_cancel(s, ids[0]);
    sched_cancel(s, ids[2]);
    mock_engine_hold(m, false);
    for (int i = 0; i < N; i++)
        result_wait(res[i]);
    assert_int_equal(res[0]->finish, SCHED_FINISH_CANCELLED);
    assert_int_equal(res[2]->finish, SCHED_FINISH_CANCELLED);
    assert_int_equal(res[1]->finish, SCHED_FINISH_LENGTH);
    assert_int_equal(res[1]->n, GEN);
    assert_memory_equal(res[1]->tokens, want, sizeof want);
    /* a whole group cancelled while it prefills */
    mock_engine_hold(m, true);
    submit_n(s, prompt, P, GEN, N, res, ids);
    for (int i = 0; i < N; i++)
        res[i]->done = false, res[i]->n = 0;
    for (int i = 0; i < N; i++)
        sched_cancel(s, ids[i]);
    mock_engine_hold(m, false);
    for (int i = 0; i < N; i++) {
        result_wait(res[i]);
        assert_int_equal(res[i]->finish, SCHED_FINISH_CANCELLED);
        result_free(res[i]);
    }
    /* more choices than sequences run at once */
    struct sched_request rq = {.prompt = prompt, .n_prompt = P, .max_tokens = 1, .on_event = on_event};
    struct sched_choice five[5] = {{.user = NULL}};
    assert_int_equal(sched_submit_n(s, &rq, five, 5, NULL), KS_ERR_RANGE);
    sched_free(s);
    assert_int_equal(mock_stats(m).n_live, 0);
    assert_int_equal(mock_stats(m).used, 0);
    mock_engine_free(m);
}

static void test_single_request(void **state)
{
    (void)state;
    struct mock_engine *m = mock_new(100000, 2048);
    struct sched *s = start(m, 4, 64, 16, 2048);
    int32_t prompt[37], want[20];
    make_prompt(prompt, 37, 1);
    reference(prompt, 37, 20, want);
    struct result *r = result_new(m);
    submit(s, prompt, 37, 20, r);
    result_wait(r);
    assert_int_equal(r->finish, SCHED_FINISH_LENGTH);
    assert_int_equal(r->n, 20);
    assert_memory_equal(r->tokens, want, sizeof want);
    assert_true(mock_stats(m).max_chunk_seen <= 16);
    sched_free(s);
    assert_int_equal(mock_stats(m).n_live, 0);
    assert_int_equal(mock_stats(m).bad_positions, 0);
    result_free(r);
    mock_engine_free(m);
}

static void test_concurrent_equals_solo(void **state)
{
    (void)state;
    enum { N = 40, GEN = 30 };
    struct mock_engine *m = mock_new(1000000, 2048);
    struct sched *s = start(m, 8, 64, 16, 2048);
    static int32_t prompts[N][300];
    struct result *res[N];
    for (int i = 0; i < N; i++) {
        make_prompt(prompts[i], 1 + i * 7, i);
        res[i] = result_new(m);
        submit(s, prompts[i], 1 + i * 7, GEN, res[i]);
    }
    for (int i = 0; i < N; i++) {
        int32_t want[GEN];
        reference(prompts[i], 1 + i * 7, GEN, want);
        result_wait(res[i]);
        assert_int_equal(res[i]->n, GEN);
        assert_memory_equal(res[i]->tokens, want, sizeof want);
        result_free(res[i]);
    }
    struct sched_stats st;
    sched_get_stats(s, &st);
    assert_int_equal(st.requests_done, N);
    assert_int_equal(st.generated_tokens, N * GEN);
    assert_int_equal(st.preemptions, 0);
    assert_int_equal(st.ttft.n, N);
    assert_int_equal(st.itl.n, N * (GEN - 1));
    sched_free(s);
    assert_true(mock_stats(m).max_batch_seen <= 64);
    assert_true(mock_stats(m).max_chunk_seen <= 16);
    assert_int_equal(mock_stats(m).bad_positions, 0);
    assert_int_equal(mock_stats(m).n_live, 0);
    mock_engine_free(m);
}

/* A long prompt arriving while 4 sequences decode: every step still carries
 * one token of each decoder, so none of them ever skips a step. */
static void test_long_prefill_does_not_stall_decode(void **state)
{
    (void)state;
    struct mock_engine *m = mock_new(1000000, 4096);
    struct sched *s = start(m, 8, 64, 32, 4096);
    int32_t small[4][5];
    static int32_t big[3000];
    struct result *dec[4];
    for (int i = 0; i < 4; i++) {
        make_prompt(small[i], 5, 100 + i);
        dec[i] = result_new(m);
        submit(s, small[i], 5, 400, dec[i]);
    }
    /* wait until all four decode */
    for (int i = 0; i < 4; i++)
        KS_WAIT_UNTIL(result_count(dec[i]) >= 2, "decoder %d to produce 2 tokens", i);
    make_prompt(big, 3000, 7);
    mock_engine_watch(m, big[0], 3000);
    for (int i = 0; i < 4; i++)
        assert_true(small[i][0] != big[0]);
    struct result *b = result_new(m);
    submit(s, big, 3000, 5, b);
    result_wait(b);
    for (int i = 0; i < 4; i++) {
        result_wait(dec[i]);
        assert_int_equal(dec[i]->n, 400);
        for (int t = 2; t < dec[i]->n; t++)
            assert_int_equal(dec[i]->step_of[t] - dec[i]->step_of[t - 1], 1);
        result_free(dec[i]);
    }
    int32_t want[5];
    reference(big, 3000, 5, want);
    assert_memory_equal(b->tokens, want, sizeof want);
    result_free(b);
    sched_free(s);
    assert_true(mock_stats(m).max_batch_seen <= 64);
    /* the long prompt advanced in every step after its first chunk (floor of
     * one token) but the decode-only steps that refresh the cost model: one
     * every SCHED_COST_REFRESH steps, and one for each new decoder count (the
     * four decoders were admitted in different steps, so they may finish one
     * by one while the prompt is still being computed; under a slow build,
     * TSan, that happened and cost up to one more refresh each) */
    assert_true(mock_stats(m).watch_steps > 0);
    if (mock_stats(m).watch_idle_steps > mock_stats(m).watch_steps / (SCHED_COST_REFRESH - 1) + 1 + 4)
        print_message("long prompt: %d idle steps, %d with tokens\n", mock_stats(m).watch_idle_steps,
                      mock_stats(m).watch_steps);
    assert_true(mock_stats(m).watch_idle_steps <= mock_stats(m).watch_steps / (SCHED_COST_REFRESH - 1) + 1 + 4);
    mock_engine_free(m);
}

/* 16 requests into a cache that holds a fraction of them: preemption and
 * recompute, and every request still gets its solo tokens. */
static void test_preemption_keeps_tokens(void **state)
{
    (void)state;
    enum { N = 16, P = 50, GEN = 100 };
    struct mock_engine *m = mock_new(700, 1024);
    mock_engine_hold(m, true); /* all 16 queued before the first step */
    struct sched *s = start_untimed(m, 16, 128, 32, 1024);
    static int32_t prompts[N][P];
    struct result *res[N];
    for (int i = 0; i < N; i++) {
        make_prompt(prompts[i], P, 50 + i);
        res[i] = result_new(m);
        submit(s, prompts[i], P, GEN, res[i]);
    }
    mock_engine_hold(m, false);
    for (int i = 0; i < N; i++)
        expect_alone_result(res[i], prompts[i], P, GEN);
    struct sched_stats st;
    sched_get_stats(s, &st);
    assert_true(st.preemptions > 0);
    assert_true(st.kv_full_events > 0);
    stop_clean(s, m);
}

static void test_cancel_frees_pages(void **state)
{
    (void)state;
    struct mock_engine *m = mock_new(100000, 4096);
    struct sched *s = start(m, 4, 64, 16, 4096);
    int32_t prompt[10];
    make_prompt(prompt, 10, 3);
    struct result *r = result_new(m);
    uint64_t id = submit(s, prompt, 10, 4000, r);
    KS_WAIT_UNTIL(result_count(r) >= 5, "the request to produce 5 tokens");
    sched_cancel(s, id);
    result_wait(r);
    assert_int_equal(r->finish, SCHED_FINISH_CANCELLED);
    assert_true(r->n < 4000);
    /* pages are gone by the time the final event is delivered */
    struct sched_stats st;
    sched_get_stats(s, &st);
    assert_int_equal(st.n_running, 0);
    sched_free(s);
    assert_int_equal(mock_stats(m).used, 0);
    result_free(r);
    mock_engine_free(m);
}

static void test_rejects_bad_requests(void **state)
{
    (void)state;
    struct mock_engine *m = mock_new(100000, 64);
    struct sched *s = start(m, 1, 16, 16, 64);
    int32_t prompt[64];
    make_prompt(prompt, 64, 1);
    struct result *r = result_new(m);
    struct sched_request rq = {.prompt = prompt, .n_prompt = 64, .max_tokens = 5, .on_event = on_event, .user = r};
    assert_int_equal(sched_submit(s, &rq, NULL), KS_ERR_RANGE);
    rq.n_prompt = 10;
    rq.max_tokens = -1; /* 0 is a warm-up (test_prefix_cache) */
    assert_int_equal(sched_submit(s, &rq, NULL), KS_ERR_INVALID_ARG);
    rq.max_tokens = 5;
    prompt[3] = V;
    assert_int_equal(sched_submit(s, &rq, NULL), KS_ERR_INVALID_ARG);
    prompt[3] = 0;
    sched_drain(s);
    assert_int_equal(sched_submit(s, &rq, NULL), KS_ERR_STATE);
    sched_free(s);
    result_free(r);
    mock_engine_free(m);
}

static void test_queue_limit(void **state)
{
    (void)state;
    struct mock_engine *m = mock_new(100000, 8192);
    struct sched_config cfg;
    sched_config_default(&cfg);
    cfg.parallel = 1;
    cfg.max_batch_tokens = 16;
    cfg.ctx_size = 8192;
    cfg.max_queue = 2;
    struct sched_engine e = mock_engine_sched(m, false);
    struct sched *s = NULL;
    assert_int_equal(sched_create(&cfg, &e, &s), KS_OK);
    int32_t prompt[4];
    make_prompt(prompt, 4, 9);
    struct result *r[4];
    for (int i = 0; i < 4; i++)
        r[i] = result_new(m);
    submit(s, prompt, 4, 8000, r[0]);
    /* the first is running once it produced a token */
    KS_WAIT_UNTIL(result_count(r[0]) >= 1, "the first request to produce a token");
    submit(s, prompt, 4, 3, r[1]);
    submit(s, prompt, 4, 3, r[2]);
    struct sched_request rq = {.prompt = prompt, .n_prompt = 4, .max_tokens = 3, .on_event = on_event, .user = r[3]};
    assert_int_equal(sched_submit(s, &rq, NULL), KS_ERR_STATE);
    sched_cancel_all(s);
    for (int i = 0; i < 3; i++) {
        result_wait(r[i]);
        assert_int_equal(r[i]->finish, SCHED_FINISH_CANCELLED);
    }
    sched_free(s);
    for (int i = 0; i < 4; i++)
        result_free(r[i]);
    mock_engine_free(m);
}

static void count_hook(void *user, struct kv_cache *kv)
{
    assert_null(kv);
    (*(int *)user)++;
}

static void test_hooks_run_between_steps(void **state)
{
    (void)state;
    struct mock_engine *m = mock_new(100000, 2048);
    struct sched *s = start(m, 4, 64, 16, 2048);
    int calls = 0;
    assert_int_equal(sched_between_steps(s, count_hook, &calls), KS_OK); /* idle */
    int32_t prompt[20], want[300];
    make_prompt(prompt, 20, 4);
    reference(prompt, 20, 300, want);
    struct result *r = result_new(m);
    submit(s, prompt, 20, 300, r);
    for (int i = 0; i < 10; i++)
        assert_int_equal(sched_between_steps(s, count_hook, &calls), KS_OK);
    result_wait(r);
    assert_int_equal(calls, 11);
    assert_memory_equal(r->tokens, want, sizeof want);
    sched_free(s);
    result_free(r);
    mock_engine_free(m);
}

/* A sliced job records, at each slice, the steps run and the tokens the
 * stream has received. With a stream to start, its first slice submits it,
 * so every later slice runs while the stream decodes, however fast the
 * machine. */
struct slices {
    struct mock_engine *m;
    struct sched *s;
    const int32_t *prompt;    /* the stream to start, or NULL */
    struct result *stream;
    int n, want;
    uint64_t steps[64];
    int tokens[64];
    double budget[64];
};

static bool record_slice(void *user, struct kv_cache *kv, double budget_s)
{
    (void)kv;
    struct slices *sl = user;
    if (sl->n == 0 && sl->prompt)
        submit(sl->s, sl->prompt, 20, 300, sl->stream);
    sl->steps[sl->n] = mock_stats(sl->m).steps;
    sl->tokens[sl->n] = sl->stream ? result_count(sl->stream) : 0;
    sl->budget[sl->n] = budget_s;
    return ++sl->n == sl->want;
}

/* Long cache work runs one slice between two steps while a stream decodes:
 * the stream gets a token between every two slices. Idle, the slices run back
 * to back with the idle budget. */
static void test_sliced_job_one_slice_per_step(void **state)
{
    (void)state;
    struct mock_engine *m = mock_new(100000, 2048);
    struct sched *s = start(m, 4, 64, 16, 2048);
    struct slices idle = {.m = m, .want = 5};
    assert_int_equal(sched_run_sliced(s, record_slice, &idle), KS_OK);
    assert_int_equal(idle.n, 5);
    for (int i = 0; i < 5; i++) {
        assert_int_equal(idle.steps[i], 0);
        assert_true(idle.budget[i] == SCHED_SLICE_IDLE_S);
    }

    int32_t prompt[20];
    make_prompt(prompt, 20, 5);
    struct result *r = result_new(m);
    struct slices busy = {.m = m, .s = s, .prompt = prompt, .stream = r, .want = 20};
    assert_int_equal(sched_run_sliced(s, record_slice, &busy), KS_OK);
    assert_int_equal(busy.n, 20);
    /* slice 0 ran idle and submitted; slice 1 ran before the first step */
    assert_int_equal(busy.steps[1], 0);
    for (int i = 2; i < 20; i++) {
        assert_int_equal(busy.steps[i], busy.steps[i - 1] + 1); /* one slice per step */
        assert_true(busy.budget[i] > 0 && busy.budget[i] < 1.0);
    }
    /* the 20-token prompt takes two steps of chunk 16; then a token per step */
    for (int i = 3; i < 20; i++)
        assert_true(busy.tokens[i] > busy.tokens[i - 1]);
    expect_alone_result(r, prompt, 20, 300);
    stop_clean(s, m);
}

static void test_request_too_big_for_cache(void **state)
{
    (void)state;
    struct mock_engine *m = mock_new(30, 2048);
    struct sched *s = start(m, 4, 64, 16, 2048);
    int32_t prompt[40];
    make_prompt(prompt, 40, 5);
    struct result *r = result_new(m);
    submit(s, prompt, 40, 5, r);
    result_wait(r);
    assert_int_equal(r->finish, SCHED_FINISH_ERROR);
    /* a request that fits still works afterwards */
    struct result *ok = result_new(m);
    submit(s, prompt, 10, 5, ok);
    result_wait(ok);
    assert_int_equal(ok->finish, SCHED_FINISH_LENGTH);
    sched_free(s);
    assert_int_equal(mock_stats(m).used, 0);
    result_free(r);
    result_free(ok);
    mock_engine_free(m);
}

static void test_eog_stops(void **state)
{
    (void)state;
    struct mock_engine *m = mock_new(100000, 2048);
    int32_t prompt[12], want[50];
    make_prompt(prompt, 12, 8);
    reference(prompt, 12, 50, want);
    struct sched_config cfg;
    sched_config_default(&cfg);
    cfg.ctx_size = 2048;
    cfg.eog = &want[10]; /* the 11th token ends generation */
    cfg.n_eog = 1;
    struct sched_engine e = mock_engine_sched(m, false);
    struct sched *s = NULL;
    assert_int_equal(sched_create(&cfg, &e, &s), KS_OK);
    struct result *r = result_new(m);
    submit(s, prompt, 12, 50, r);
    result_wait(r);
    assert_int_equal(r->finish, SCHED_FINISH_STOP);
    int first = 0;
    while (want[first] != want[10])
        first++;
    assert_int_equal(r->n, first);
    sched_free(s);
    result_free(r);
    mock_engine_free(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_single_request),
        cmocka_unit_test(test_concurrent_equals_solo),
        cmocka_unit_test(test_long_prefill_does_not_stall_decode),
        cmocka_unit_test(test_preemption_keeps_tokens),
        cmocka_unit_test(test_cancel_frees_pages),
        cmocka_unit_test(test_rejects_bad_requests),
        cmocka_unit_test(test_queue_limit),
        cmocka_unit_test(test_hooks_run_between_steps),
        cmocka_unit_test(test_sliced_job_one_slice_per_step),
        cmocka_unit_test(test_request_too_big_for_cache),
        cmocka_unit_test(test_eog_stops),
        cmocka_unit_test(test_choices_share_prompt),
        cmocka_unit_test(test_choices_under_preemption),
        cmocka_unit_test(test_cancel_choices_before_fork),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
