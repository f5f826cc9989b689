/* Speculative decoding through the scheduler. On the mock engine (a
 * repetitive "model", tests/support/mock_engine.h): every request gets the
 * tokens it gets alone, with drafts verified beside prefill chunks and
 * queued requests, and a step whose drafts do not fit the cache drops them
 * instead of preempting anyone. On the real engine: greedy
 * output with prompt-lookup speculation is token for token the output without
 * it (f16 and q4_0 pages, several requests in one batch, a prefix-cache hit),
 * drafts are actually accepted on repetitive text, and after the requests end
 * the cache holds exactly the pages a run without speculation leaves (the
 * rejected rows were cut off; kv_check passes).
 *
 * Models: the build's default model ($KVSERVE_DEFAULT_MODEL, a random tiny
 * q8_0 llama whose greedy output falls into loops), and when
 * $KVSERVE_SHARED has it the trained tiny q8_0 llama (real text: drafts are
 * both accepted and rejected). Both have repacked q8_0 weights, so a token's
 * logits are the same bits in a batch of any size (docs/kernels.md, batch
 * invariance), which greedy identity relies on. */
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
#include "support/deadline.h"
#include "support/mock_engine.h"
#include "support/sched_gate.h"
#include "support/sched_result.h"
#include "support/skip.h"
#include "support/synth_model.h"
#include "threads/threads.h"

enum { MAX_GEN = 96, N_CONC = 4 };

static struct model *g_default, *g_trained;
static threads_pool *g_pool;

/* ---- a request and its events ------------------------------------------------- */

static void result_wait(struct sched_result *r)
{
    sched_result_wait(r);
    assert_int_equal(r->finish, SCHED_FINISH_LENGTH);
}

/* ---- schedulers ----------------------------------------------------------------- */

struct setup {
    struct model *model;
    enum quant_type type;
    bool prefix_cache;
    bool spec;
    bool pool;         /* with spec: the shared n-gram pool (else prompt lookup) */
    int32_t draft_min; /* > 0: draft whenever the lookup finds that many, whatever the cost model says */
    int parallel;
};

static struct sched *make_sched(const struct setup *u)
{
    struct kv_config kc;
    model_kv_config(u->model, &kc);
    kc.mem_budget = 64u << 20;
    kc.type_k = kc.type_v = u->type;
    kc.prefix_cache = u->prefix_cache;
    struct sched_engine eng;
    assert_int_equal(sched_engine_model(u->model, &kc, 512, g_pool, &eng), KS_OK);
    struct sched_config sc;
    sched_config_default(&sc);
    sc.parallel = u->parallel;
    sc.max_itl_ratio = 0.0f; /* the step budget does not depend on timings */
    sc.spec_type = !u->spec ? SPEC_NONE : u->pool ? SPEC_NGRAM_POOL : SPEC_NGRAM;
    sc.draft_min = u->draft_min;
    struct sched *s = NULL;
    assert_int_equal(sched_create(&sc, &eng, &s), KS_OK);
    return s;
}

/* Each prompt alone, one after the other, on one scheduler. */
static void run_each(const struct setup *u, int32_t *const *prompts, const int32_t *lens, int n, int32_t max_tokens,
                     struct sched_result *out)
{
    struct sched *s = make_sched(u);
    for (int i = 0; i < n; i++) {
        sched_result_submit_greedy(s, prompts[i], lens[i], max_tokens, &out[i]);
        result_wait(&out[i]);
    }
    sched_free(s);
}

/* ---- prompts -------------------------------------------------------------------- */

/* A pseudo-random run of n ids in [3, n_vocab), as test_prefix_cache makes them. */
static void random_ids(int32_t *t, int32_t n, int32_t salt, int32_t n_vocab)
{
    for (int32_t i = 0; i < n; i++)
        t[i] = 3 + (int32_t)(((uint32_t)i * 2654435761u + (uint32_t)salt * 40503u) % (uint32_t)(n_vocab - 3));
}

/* "Retell": a passage, then the passage again up to half, which a trained
 * model continues by copying (and prompt lookup drafts from the first copy). */
static int32_t retell_prompt(int32_t *t, int32_t passage, int32_t salt, int32_t n_vocab)
{
    t[0] = 1;
    random_ids(t + 1, passage, salt, n_vocab);
    memcpy(t + 1 + passage, t + 1, (size_t)(passage / 2) * sizeof *t);
    return 1 + passage + passage / 2;
}

static void assert_same_tokens(const struct sched_result *a, const struct sched_result *b)
{
    assert_int_equal(a->n, b->n);
    for (int32_t i = 0; i < a->n; i++)
        if (a->tokens[i] != b->tokens[i])
            fail_msg("token %d differs: %d without speculation, %d with", (int)i, (int)a->tokens[i], (int)b->tokens[i]);
}

/* ---- tests -------------------------------------------------------------------- */

/* Alone, at f16 and q4_0 pages: identical tokens, and drafts accepted. Both
 * force drafting (draft_min 1: the adaptive length follows measured step
 * times, and a tiny model's extra token costs nearly a step, so it would
 * rarely draft); test_identity_prefix_hit runs the adaptive length. */
static void identity_alone(struct model *m, bool retell)
{
    enum { N = 3, LEN = 200, GEN = 48 };
    int32_t n_vocab = model_hparams(m)->n_vocab;
    static int32_t buf[N][LEN];
    int32_t *prompts[N], lens[N];
    for (int i = 0; i < N; i++) {
        prompts[i] = buf[i];
        if (retell)
            lens[i] = retell_prompt(buf[i], 40 + 20 * i, 7 + i, n_vocab);
        else
            random_ids(buf[i], lens[i] = 8 + 40 * i, 11 + i, n_vocab);
    }
    enum quant_type types[2] = {QUANT_F16, QUANT_Q4_0};
    for (int t = 0; t < 2; t++) {
        struct sched_result plain[N], spec[N];
        struct setup u = {.model = m, .type = types[t], .parallel = 2};
        run_each(&u, prompts, lens, N, GEN, plain);
        u.spec = true;
        u.draft_min = 1;
        run_each(&u, prompts, lens, N, GEN, spec);
        int32_t drafted = 0, accepted = 0;
        for (int i = 0; i < N; i++) {
            assert_same_tokens(&plain[i], &spec[i]);
            assert_int_equal(plain[i].n_drafted, 0);
            drafted += spec[i].n_drafted;
            accepted += spec[i].n_accepted;
        }
        print_message("%s pages: %d drafted, %d accepted over %d x %d tokens\n", t ? "q4_0" : "f16", (int)drafted,
                      (int)accepted, N, GEN);
        assert_true(accepted <= drafted);
        assert_true(accepted > 0);
    }
}

static void test_identity_default_model(void **state)
{
    (void)state;
    if (!g_default)
        KS_SKIP("no default model at $KVSERVE_DEFAULT_MODEL (build target default_model)");
    identity_alone(g_default, false);
}

static void test_identity_trained_retell(void **state)
{
    (void)state;
    if (!g_default || !g_trained)
        KS_SKIP("no trained model under $KVSERVE_SHARED/models/trained");
    identity_alone(g_trained, true);
}

/* A model synthesized from a preset (support/synth_model.h). */
static struct model *synth_model(const char *preset)
{
    struct model *m = NULL;
    assert_int_equal(ks_synth_model(preset, 0, 0, g_pool, &m), KS_OK);
    return m;
}

/* Sliding windows (tiny-gemma3: a 16-token window, so drafts and their
 * truncation cross pages whose window rows are freed behind them) and a
 * mixture of experts (tiny-qwen3moe) speculate without changing a token. */
static void test_identity_window_and_moe(void **state)
{
    (void)state;
    if (!g_default)
        KS_SKIP("no default model at $KVSERVE_DEFAULT_MODEL (build target default_model)");
    static const char *presets[2] = {"tiny-gemma3", "tiny-qwen3moe"};
    for (int p = 0; p < 2; p++) {
        struct model *m = synth_model(presets[p]);
        enum { N = 2 };
        static int32_t buf[N][200];
        int32_t *prompts[N], lens[N];
        for (int i = 0; i < N; i++) {
            prompts[i] = buf[i];
            lens[i] = retell_prompt(buf[i], 60 + 40 * i, 3 + i, model_hparams(m)->n_vocab);
        }
        struct sched_result plain[N], spec[N];
        struct setup u = {.model = m, .type = QUANT_F16, .parallel = 2};
        run_each(&u, prompts, lens, N, 60, plain);
        u.spec = true;
        u.draft_min = 1;
        run_each(&u, prompts, lens, N, 60, spec);
        for (int i = 0; i < N; i++) {
            assert_same_tokens(&plain[i], &spec[i]);
            print_message("%s: %d drafted, %d accepted\n", presets[p], (int)spec[i].n_drafted, (int)spec[i].n_accepted);
        }
        model_free(m);
    }
}

/* N_CONC requests submitted together decode in one batch, drafting side by
 * side with plain decoders and a prefill chunk; each equals its solo answer. */
static void test_identity_concurrent(void **state)
{
    (void)state;
    if (!g_default)
        KS_SKIP("no default model at $KVSERVE_DEFAULT_MODEL (build target default_model)");
    struct model *m = g_trained ? g_trained : g_default;
    int32_t n_vocab = model_hparams(m)->n_vocab;
    static int32_t buf[N_CONC + 1][400];
    int32_t *prompts[N_CONC + 1], lens[N_CONC + 1];
    for (int i = 0; i < N_CONC; i++) {
        prompts[i] = buf[i];
        lens[i] = retell_prompt(buf[i], 30 + 10 * i, 21 + i, n_vocab);
    }
    prompts[N_CONC] = buf[N_CONC]; /* a long prompt arriving later: prefill chunks beside the verifications */
    random_ids(buf[N_CONC], lens[N_CONC] = 300, 99, n_vocab);
    struct sched_result solo[N_CONC + 1], together[N_CONC + 1];
    struct setup u = {.model = m, .type = QUANT_F16, .parallel = N_CONC + 1};
    run_each(&u, prompts, lens, N_CONC + 1, 48, solo);
    u.spec = true;
    u.draft_min = 1;
    struct sched *s = make_sched(&u);
    for (int i = 0; i < N_CONC; i++)
        sched_result_submit_greedy(s, prompts[i], lens[i], 48, &together[i]);
    result_wait(&together[0]); /* mid-stream now (or done) */
    sched_result_submit_greedy(s, prompts[N_CONC], lens[N_CONC], 48, &together[N_CONC]);
    for (int i = 1; i <= N_CONC; i++)
        result_wait(&together[i]);
    struct sched_stats st;
    sched_get_stats(s, &st);
    sched_free(s);
    for (int i = 0; i <= N_CONC; i++)
        assert_same_tokens(&solo[i], &together[i]);
    print_message("%d requests together: %llu verifications, %llu drafted, %llu accepted\n", N_CONC + 1,
                  (unsigned long long)st.spec_verifications, (unsigned long long)st.spec_draft_tokens,
                  (unsigned long long)st.spec_accepted_tokens);
    assert_true(st.spec_accepted_tokens > 0);
}

/* A prompt served from the prefix cache speculates like a cold one (with
 * the adaptive draft length: whether it drafts depends on measured costs). */
static void test_identity_prefix_hit(void **state)
{
    (void)state;
    if (!g_default)
        KS_SKIP("no default model at $KVSERVE_DEFAULT_MODEL (build target default_model)");
    struct model *m = g_trained ? g_trained : g_default;
    int32_t prompt[300];
    int32_t len = retell_prompt(prompt, 180, 5, model_hparams(m)->n_vocab);
    int32_t *prompts[1] = {prompt};
    struct sched_result cold, first, again;
    struct setup u = {.model = m, .type = QUANT_Q4_0, .parallel = 2};
    run_each(&u, prompts, &len, 1, 48, &cold);
    u.spec = u.prefix_cache = true;
    struct sched *s = make_sched(&u);
    sched_result_submit_greedy(s, prompt, len, 48, &first);
    result_wait(&first);
    sched_result_submit_greedy(s, prompt, len, 48, &again);
    result_wait(&again);
    sched_free(s);
    assert_true(again.n_cached > 0);
    assert_same_tokens(&cold, &first);
    assert_same_tokens(&cold, &again);
}

/* ---- the mock engine ------------------------------------------------------------ */

static struct mock_engine_config mock_config(void)
{
    return (struct mock_engine_config){.n_vocab = 97, .first_token = 3, .max_seqs = 16, .max_ctx = 1024,
                                       .repeat_period = 7, .surprise_every = 11};
}

static struct sched *mock_sched_type(const struct mock_engine_config *mc, struct mock_engine **m, int parallel,
                                     enum spec_type type)
{
    assert_int_equal(mock_engine_create(mc, m), KS_OK);
    struct sched_engine eng = mock_engine_sched(*m, false);
    struct sched_config sc;
    sched_config_default(&sc);
    sc.parallel = parallel;
    sc.prefill_chunk = 48;
    sc.max_itl_ratio = 0.0f;
    sc.spec_type = type;
    sc.draft_min = 1;
    struct sched *s = NULL;
    assert_int_equal(sched_create(&sc, &eng, &s), KS_OK);
    return s;
}

static struct sched *mock_sched(const struct mock_engine_config *mc, struct mock_engine **m, int parallel)
{
    return mock_sched_type(mc, m, parallel, SPEC_NGRAM);
}

static void assert_alone(const struct mock_engine_config *mc, const int32_t *prompt, int32_t n, const struct sched_result *r)
{
    int32_t want[MAX_GEN];
    mock_engine_generate(mc, prompt, n, r->n, want);
    for (int32_t i = 0; i < r->n; i++)
        if (want[i] != r->tokens[i])
            fail_msg("token %d: %d, alone %d", (int)i, (int)r->tokens[i], (int)want[i]);
}

/* The pool learns one request's text and drafts it for the next: over a
 * model whose output never repeats itself (prompt lookup finds little), the
 * same prompt sent a second time is answered mostly from the pool's drafts,
 * with the tokens the model gives alone. */
static void test_mock_pool_across_requests(void **state)
{
    (void)state;
    struct mock_engine_config mc = mock_config();
    mc.repeat_period = mc.surprise_every = 0;
    struct mock_engine *m;
    struct sched *s = mock_sched_type(&mc, &m, 2, SPEC_NGRAM_POOL);
    int32_t prompt[40];
    for (int32_t i = 0; i < 40; i++)
        prompt[i] = 3 + (i * 37) % 90;
    struct sched_result r[2];
    for (int i = 0; i < 2; i++) {
        sched_result_submit_greedy(s, prompt, 40, 64, &r[i]);
        result_wait(&r[i]);
        assert_alone(&mc, prompt, 40, &r[i]);
    }
    sched_free(s);
    mock_engine_free(m);
    print_message("pool: first %d/%d accepted, second %d/%d\n", (int)r[0].n_accepted, (int)r[0].n_drafted,
                  (int)r[1].n_accepted, (int)r[1].n_drafted);
    assert_true(r[1].n_accepted >= 48);
    assert_true(r[0].n_accepted < 16);
}

/* Eight requests, four at a time: prompts of 5 to 348 tokens prefill in
 * chunks beside the others' verifications; each gets its lone tokens. */
static void test_mock_exact_under_batching(void **state)
{
    (void)state;
    enum { N = 8, GEN = 80 };
    struct mock_engine_config mc = mock_config();
    struct mock_engine *m;
    struct sched *s = mock_sched(&mc, &m, 4);
    static int32_t prompts[N][400];
    int32_t lens[N];
    struct sched_result r[N];
    mock_engine_hold(m, true);
    for (int i = 0; i < N; i++) {
        random_ids(prompts[i], lens[i] = 5 + 49 * i, 70 + i, mc.n_vocab);
        sched_result_submit_greedy(s, prompts[i], lens[i], GEN, &r[i]);
    }
    mock_engine_hold(m, false);
    for (int i = 0; i < N; i++)
        result_wait(&r[i]);
    struct sched_stats st;
    sched_get_stats(s, &st);
    sched_free(s);
    struct mock_engine_stats ms;
    mock_engine_stats(m, &ms);
    mock_engine_free(m);
    int32_t drafted = 0, accepted = 0;
    for (int i = 0; i < N; i++) {
        assert_int_equal(r[i].n, GEN);
        assert_alone(&mc, prompts[i], lens[i], &r[i]);
        drafted += r[i].n_drafted;
        accepted += r[i].n_accepted;
    }
    print_message("mock: %d drafted, %d accepted, %d truncations, %llu steps for %d tokens\n", (int)drafted,
                  (int)accepted, ms.truncations, (unsigned long long)ms.steps, N * GEN);
    assert_int_equal(ms.bad_positions, 0);
    assert_int_equal(ms.n_live, 0);
    assert_int_equal(ms.used, 0);
    assert_true(accepted > 0 && accepted < drafted); /* the surprises reject drafts */
    assert_true(ms.truncations > 0);
    assert_int_equal((int)st.spec_draft_tokens, drafted);
    assert_int_equal((int)st.spec_accepted_tokens, accepted);
    assert_true(ms.max_chunk_seen <= 48); /* drafts stay within --draft-max + 1, chunks within 48 */
}

/* Each request stops at an end-of-generation token (at a surprise of the
 * mock model, so no draft proposes it before), and the cache holds exactly
 * what the requests hold then: plain decoding fits, but drafts of 16 (the
 * per-request bounds fix the length) past the stop do not. The steps that
 * do not fit drop their drafts and retry; nobody is preempted. */
static void test_mock_kv_full_drops_drafts(void **state)
{
    (void)state;
    enum { N = 3, PROMPT = 20, GEN = 200, STOP_AFTER = 60 };
    struct mock_engine_config mc = mock_config();
    int32_t prompts[N][PROMPT], eog[N], capacity = 0;
    for (int i = 0; i < N; i++) {
        random_ids(prompts[i], PROMPT, 90 + i, mc.n_vocab);
        int32_t out[GEN];
        mock_engine_generate(&mc, prompts[i], PROMPT, GEN, out);
        int32_t g = STOP_AFTER;
        for (bool seen = true; seen && g < GEN; g += !!seen) {
            seen = (PROMPT + g) % mc.surprise_every != 0;
            for (int32_t j = 0; j < PROMPT + g && !seen; j++)
                seen = (j < PROMPT ? prompts[i][j] : out[j - PROMPT]) == out[g];
        }
        assert_true(g < GEN);
        eog[i] = out[g];
        capacity += PROMPT + g; /* the prompt, the g tokens before the stop (the last one fed) */
    }
    mc.capacity = capacity;
    struct mock_engine *m;
    assert_int_equal(mock_engine_create(&mc, &m), KS_OK);
    struct sched_engine eng = mock_engine_sched(m, false);
    struct sched_config sc;
    sched_config_default(&sc);
    sc.parallel = N;
    sc.max_itl_ratio = 0.0f;
    sc.spec_type = SPEC_NGRAM;
    sc.eog = eog;
    sc.n_eog = N;
    struct sched *s = NULL;
    assert_int_equal(sched_create(&sc, &eng, &s), KS_OK);
    struct sched_result r[N];
    struct sched_gate gate; /* all three admitted together: the cache fills at the same step every run */
    sched_gate_close(&gate, s);
    for (int i = 0; i < N; i++) {
        memset(&r[i], 0, sizeof r[i]);
        pthread_mutex_init(&r[i].mu, NULL);
        pthread_cond_init(&r[i].cv, NULL);
        struct sched_request rq = {.prompt = prompts[i], .n_prompt = PROMPT, .max_tokens = GEN, .on_event = sched_result_on_event,
                                   .user = &r[i], .speculative = {true, 16, 16}};
        sample_params_default(&rq.sampling);
        rq.sampling.temp = 0.0f;
        uint64_t id;
        assert_int_equal(sched_submit(s, &rq, &id), KS_OK);
    }
    sched_gate_open(&gate);
    for (int i = 0; i < N; i++) {
        pthread_mutex_lock(&r[i].mu);
        ks_cond_wait_until(&r[i].cv, &r[i].mu, &r[i].done, "a request to finish");
        pthread_mutex_unlock(&r[i].mu);
    }
    struct sched_stats st;
    sched_get_stats(s, &st);
    sched_free(s);
    mock_engine_free(m);
    for (int i = 0; i < N; i++) {
        assert_int_equal(r[i].finish, SCHED_FINISH_STOP);
        assert_alone(&mc, prompts[i], PROMPT, &r[i]);
    }
    print_message("kv full events %llu, preemptions %llu, accepted %llu\n", (unsigned long long)st.kv_full_events,
                  (unsigned long long)st.preemptions, (unsigned long long)st.spec_accepted_tokens);
    assert_true(st.kv_full_events > 0);
    assert_int_equal(st.preemptions, 0);
    assert_true(st.spec_accepted_tokens > 0);
}

/* ---- page accounting ---------------------------------------------------------- */

struct cache_state {
    ks_status check;
    struct kv_usage usage;
};

static void inspect(void *user, struct kv_cache *kv)
{
    struct cache_state *c = user;
    c->check = kv_check(kv);
    kv_usage(kv, &c->usage);
}

/* Requests whose drafts are partly rejected leave the cache as plain decoding
 * does: the same pages, bytes, keyed and idle pages, and every invariant. */
static void test_pages_after_rejections(void **state)
{
    (void)state;
    if (!g_default)
        KS_SKIP("no default model at $KVSERVE_DEFAULT_MODEL (build target default_model)");
    struct model *m = g_trained ? g_trained : g_default;
    int32_t n_vocab = model_hparams(m)->n_vocab;
    static int32_t buf[N_CONC][300];
    int32_t *prompts[N_CONC], lens[N_CONC];
    for (int i = 0; i < N_CONC; i++) {
        prompts[i] = buf[i];
        lens[i] = retell_prompt(buf[i], 50 + 37 * i, 40 + i, n_vocab);
    }
    struct cache_state after[2];
    int32_t accepted = 0, drafted = 0;
    for (int spec = 0; spec < 2; spec++) {
        struct setup u = {.model = m, .type = QUANT_F16, .prefix_cache = true, .spec = spec, .draft_min = 1,
                          .parallel = N_CONC};
        struct sched *s = make_sched(&u);
        struct sched_result r[N_CONC];
        for (int i = 0; i < N_CONC; i++)
            sched_result_submit_greedy(s, prompts[i], lens[i], 45, &r[i]);
        for (int i = 0; i < N_CONC; i++) {
            result_wait(&r[i]);
            drafted += r[i].n_drafted;
            accepted += r[i].n_accepted;
        }
        assert_int_equal(sched_between_steps(s, inspect, &after[spec]), KS_OK);
        sched_free(s);
        assert_int_equal(after[spec].check, KS_OK);
    }
    print_message("pages: %d and %d, %d drafted, %d accepted\n", (int)after[0].usage.n_pages,
                  (int)after[1].usage.n_pages, (int)drafted, (int)accepted);
    assert_true(drafted > accepted); /* some drafts were rejected and cut off */
    assert_int_equal(after[0].usage.n_seqs, 0);
    assert_int_equal(after[1].usage.n_seqs, 0);
    assert_int_equal(after[0].usage.n_pages, after[1].usage.n_pages);
    assert_int_equal(after[0].usage.used, after[1].usage.used);
    assert_int_equal(after[0].usage.n_keyed_pages, after[1].usage.n_keyed_pages);
    assert_int_equal(after[0].usage.n_idle_pages, after[1].usage.n_idle_pages);
}

/* ---- setup -------------------------------------------------------------------- */

static int setup(void **state)
{
    (void)state;
    const char *path = getenv("KVSERVE_DEFAULT_MODEL");
    if (path && access(path, R_OK) == 0 && model_load(path, &g_default) != KS_OK) {
        fprintf(stderr, "setup: %s\n", ks_errmsg());
        return -1;
    }
    const char *shared = getenv("KVSERVE_SHARED");
    char trained[4096];
    snprintf(trained, sizeof trained, "%s/models/trained/tiny-llama-gqa-hd64-q8_0.gguf", shared ? shared : "../shared");
    if (access(trained, R_OK) == 0 && model_load(trained, &g_trained) != KS_OK)
        g_trained = NULL;
    return threads_create(2, &g_pool) == KS_OK ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    threads_free(g_pool);
    if (g_default)
        model_free(g_default);
    if (g_trained)
        model_free(g_trained);
    return 0;
}

int main(void)
{
    if (setup(NULL) != 0)
        return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mock_exact_under_batching),
        cmocka_unit_test(test_mock_pool_across_requests),
        cmocka_unit_test(test_mock_kv_full_drops_drafts),
        cmocka_unit_test(test_identity_default_model),
        cmocka_unit_test(test_identity_trained_retell),
        cmocka_unit_test(test_identity_window_and_moe),
        cmocka_unit_test(test_identity_concurrent),
        cmocka_unit_test(test_identity_prefix_hit),
        cmocka_unit_test(test_pages_after_rejections),
    };
    int rc = ks_run_tests(tests, NULL, NULL);
    teardown(NULL);
    return rc;
}
