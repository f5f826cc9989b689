/* Embedding requests (sched_request.embed) in the scheduler, against the mock
 * engine (tests/support/mock_engine.h), whose embedding of an input is its
 * token count and token sum:
 *   - each input is computed whole in one step from position 0, batched with
 *     generating requests, whose tokens stay those they get alone;
 *   - its one final event (STOP) carries the vector, and its pages are freed;
 *   - an input that cannot fit one step is refused (KS_ERR_RANGE), one that
 *     just fits runs while every other slot decodes;
 *   - an input may fill the context (it generates nothing), a generation
 *     prompt must leave room for one token;
 *   - an engine without embeddings refuses them (KS_ERR_UNSUPPORTED). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "sched/sched.h"
#include "support/deadline.h"
#include "support/mock_engine.h"

#define V 97
#define N_EMBD 4
#define GEN 24

struct result {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int32_t tokens[256];
    int n, n_final;
    bool done;
    enum sched_finish finish;
    float embd[N_EMBD];
    bool has_embd;
};

static void on_event(void *user, const struct sched_event *ev)
{
    struct result *r = user;
    pthread_mutex_lock(&r->mu);
    if (ev->finish == SCHED_FINISH_NONE) {
        if (r->n < 256)
            r->tokens[r->n++] = ev->token;
    } else {
        r->done = true;
        r->n_final++;
        r->finish = ev->finish;
        if ((r->has_embd = ev->embd != NULL))
            memcpy(r->embd, ev->embd, sizeof r->embd);
    }
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

static void result_init(struct result *r)
{
    memset(r, 0, sizeof *r);
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
}

static void result_wait(struct result *r)
{
    pthread_mutex_lock(&r->mu);
    ks_cond_wait_until(&r->cv, &r->mu, &r->done, "a request to finish");
    pthread_mutex_unlock(&r->mu);
}

static struct mock_engine_config config(int32_t n_embd)
{
    return (struct mock_engine_config){.n_vocab = V, .max_seqs = 32, .max_ctx = 1024, .n_embd = n_embd};
}

static struct sched *start_ctx(struct mock_engine *m, int parallel, int32_t max_batch, int32_t ctx)
{
    struct sched_config cfg;
    sched_config_default(&cfg);
    cfg.parallel = parallel;
    cfg.max_batch_tokens = max_batch;
    cfg.prefill_chunk = 8; /* generation prompts take several steps; embeddings never do */
    cfg.ctx_size = ctx;
    struct sched_engine e = mock_engine_sched(m, false);
    struct sched *s = NULL;
    assert_int_equal(sched_create(&cfg, &e, &s), KS_OK);
    return s;
}

static struct sched *start(struct mock_engine *m, int parallel, int32_t max_batch)
{
    return start_ctx(m, parallel, max_batch, 1024);
}

static ks_status submit(struct sched *s, const int32_t *prompt, int32_t n, bool embed, int32_t max_tokens,
                        struct result *r)
{
    struct sched_request rq = {.prompt = prompt, .n_prompt = n, .max_tokens = max_tokens, .on_event = on_event,
                               .user = r, .embed = embed};
    uint64_t id;
    return sched_submit(s, &rq, &id);
}

static void prompt_of(int32_t *p, int32_t n, int32_t salt)
{
    for (int32_t i = 0; i < n; i++)
        p[i] = 3 + (i * 7 + salt) % (V - 3);
}

static void test_mixed_with_generation(void **state)
{
    (void)state;
    struct mock_engine_config mc = config(N_EMBD);
    struct mock_engine *m = NULL;
    assert_int_equal(mock_engine_create(&mc, &m), KS_OK);
    mock_engine_hold(m, true);
    struct sched *s = start(m, 8, 64);
    enum { N_GEN = 3, N_EMB = 5 };
    static struct result gen[N_GEN], emb[N_EMB];
    int32_t gp[N_GEN][20], ep[N_EMB][40];
    for (int i = 0; i < N_GEN; i++) {
        result_init(&gen[i]);
        prompt_of(gp[i], 20, i);
        assert_int_equal(submit(s, gp[i], 20, false, GEN, &gen[i]), KS_OK);
    }
    for (int i = 0; i < N_EMB; i++) {
        result_init(&emb[i]);
        prompt_of(ep[i], 1 + 9 * i, 50 + i); /* 1 .. 37 tokens, one of them a single token */
        assert_int_equal(submit(s, ep[i], 1 + 9 * i, true, 100, &emb[i]), KS_OK);
    }
    mock_engine_hold(m, false);
    for (int i = 0; i < N_EMB; i++) {
        result_wait(&emb[i]);
        int32_t n = 1 + 9 * i, sum = 0;
        for (int32_t k = 0; k < n; k++)
            sum += ep[i][k];
        assert_int_equal(emb[i].finish, SCHED_FINISH_STOP);
        assert_int_equal(emb[i].n, 0); /* no token events */
        assert_int_equal(emb[i].n_final, 1);
        assert_true(emb[i].has_embd);
        assert_true(emb[i].embd[0] == (float)n && emb[i].embd[1] == (float)sum);
    }
    for (int i = 0; i < N_GEN; i++) {
        result_wait(&gen[i]);
        int32_t want[GEN];
        mock_engine_generate(&mc, gp[i], 20, GEN, want);
        assert_int_equal(gen[i].n, GEN);
        assert_memory_equal(gen[i].tokens, want, sizeof want);
    }
    sched_free(s);
    struct mock_engine_stats st;
    mock_engine_stats(m, &st);
    assert_int_equal(st.bad_embeds, 0);
    assert_int_equal(st.embedded, N_EMB);
    assert_int_equal(st.bad_positions, 0);
    assert_int_equal(st.n_live, 0);
    mock_engine_free(m);
}

/* One step holds max_batch tokens; the other parallel - 1 slots may decode. */
static void test_size_limit(void **state)
{
    (void)state;
    struct mock_engine_config mc = config(N_EMBD);
    struct mock_engine *m = NULL;
    assert_int_equal(mock_engine_create(&mc, &m), KS_OK);
    enum { PAR = 4, BATCH = 32 };
    struct sched *s = start(m, PAR, BATCH);
    int32_t p[BATCH + 1];
    prompt_of(p, BATCH + 1, 9);
    struct result big, ok, dec[PAR - 1];
    result_init(&big);
    assert_int_equal(submit(s, p, BATCH - PAR + 2, true, 0, &big), KS_ERR_RANGE);
    /* decoders in every other slot, then an input of exactly the room left */
    for (int i = 0; i < PAR - 1; i++) {
        result_init(&dec[i]);
        assert_int_equal(submit(s, p + i, 3, false, 200, &dec[i]), KS_OK);
    }
    result_init(&ok);
    assert_int_equal(submit(s, p, BATCH - PAR + 1, true, 0, &ok), KS_OK);
    result_wait(&ok);
    assert_true(ok.has_embd && ok.embd[0] == (float)(BATCH - PAR + 1));
    sched_free(s);
    struct mock_engine_stats st;
    mock_engine_stats(m, &st);
    assert_int_equal(st.bad_embeds, 0);
    assert_int_equal(st.n_live, 0);
    mock_engine_free(m);
}

/* A BERT input of 512 tokens fills bert's 512 positions: an embedding may fill
 * the context, a generation prompt may not (it needs room for one token). */
static void test_context_limit(void **state)
{
    (void)state;
    struct mock_engine_config mc = config(N_EMBD);
    struct mock_engine *m = NULL;
    assert_int_equal(mock_engine_create(&mc, &m), KS_OK);
    enum { CTX = 16 };
    struct sched *s = start_ctx(m, 2, 64, CTX);
    int32_t p[CTX + 1];
    prompt_of(p, CTX + 1, 3);
    struct result full, gen;
    result_init(&full);
    result_init(&gen);
    assert_int_equal(submit(s, p, CTX + 1, true, 0, &full), KS_ERR_RANGE);
    assert_int_equal(submit(s, p, CTX, false, 1, &gen), KS_ERR_RANGE);
    assert_int_equal(submit(s, p, CTX, true, 0, &full), KS_OK);
    result_wait(&full);
    assert_true(full.has_embd && full.embd[0] == (float)CTX);
    sched_free(s);
    mock_engine_free(m);
}

static void test_engine_without_embeddings(void **state)
{
    (void)state;
    struct mock_engine_config mc = config(0);
    struct mock_engine *m = NULL;
    assert_int_equal(mock_engine_create(&mc, &m), KS_OK);
    struct sched *s = start(m, 2, 16);
    int32_t p[3] = {5, 6, 7};
    struct result r;
    result_init(&r);
    assert_int_equal(submit(s, p, 3, true, 0, &r), KS_ERR_UNSUPPORTED);
    sched_free(s);
    mock_engine_free(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mixed_with_generation),
        cmocka_unit_test(test_size_limit),
        cmocka_unit_test(test_context_limit),
        cmocka_unit_test(test_engine_without_embeddings),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
