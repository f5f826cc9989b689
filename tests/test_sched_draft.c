/* Speculative decoding with a draft model (SPEC_DRAFT) through the scheduler
 * on the real engine: greedy output is token for token the output without
 * speculation (dense and MoE targets, f16 and q4_0 target pages, 16 requests
 * at once with a prefix-cache hit), the target as its own draft is accepted
 * all but always, a small draft of the same vocabulary is accepted and
 * rejected, sampling requests' drafts are drawn from the draft's q and kept
 * with min(1, p / q) (the target as its own draft: all but always), and between steps and after the requests end both caches pass
 * kv_check, the budget's bytes used are the sum of both caches' pages, and no
 * draft sequence is left behind.
 *
 * Models: the build's default model ($KVSERVE_DEFAULT_MODEL, the `tiny`
 * preset at q8_0, 512 tokens), and synthesized ones of the same vocabulary:
 * a 1-layer `tiny` of another seed as a small draft, `tiny-qwen3moe` as a
 * MoE target. All have repacked q8_0 weights, so a token's logits are the
 * same bits in a batch of any size (batch invariance), which greedy identity
 * relies on. */
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
#include "support/sched_result.h"
#include "support/skip.h"
#include "support/synth_model.h"
#include "threads/threads.h"

enum { N_MANY = 16 };

static struct model *g_default, *g_small, *g_trained, *g_trained_q4;
static threads_pool *g_pool;

/* ---- a request and its events ------------------------------------------------- */

static void result_wait(struct sched_result *r)
{
    sched_result_wait(r);
    assert_int_equal(r->finish, SCHED_FINISH_LENGTH);
}

static void assert_same_tokens(const struct sched_result *a, const struct sched_result *b)
{
    assert_int_equal(a->n, b->n);
    for (int32_t i = 0; i < a->n; i++)
        if (a->tokens[i] != b->tokens[i])
            fail_msg("token %d differs: %d without the draft model, %d with", (int)i, (int)a->tokens[i],
                     (int)b->tokens[i]);
}

/* ---- schedulers ----------------------------------------------------------------- */

struct setup {
    struct model *target, *draft; /* draft NULL: no speculation */
    enum quant_type type;         /* the target's pages */
    enum quant_type draft_type;   /* the draft's pages */
    bool prefix_cache;
    int parallel;
    size_t budget;                /* 0: 64 MiB */
    float max_itl_ratio;          /* 0: off, so the step budget does not depend on timings */
    bool adaptive;                /* --draft-min 0: draft only when the cost model says it pays */
    double claim_ratio;           /* > 0: the draft engine claims its weights are this share of the target's */
};

/* The draft cache of the scheduler made last (valid until it is freed). */
static struct kv_cache *g_draft_kv;

static struct sched *make_sched(const struct setup *u)
{
    struct kv_config kc, dc;
    model_kv_config(u->target, &kc);
    kc.mem_budget = u->budget ? u->budget : 64u << 20;
    kc.type_k = kc.type_v = u->type;
    kc.prefix_cache = u->prefix_cache;
    struct sched_engine eng;
    assert_int_equal(sched_engine_model(u->target, &kc, 512, g_pool, &eng), KS_OK);
    g_draft_kv = NULL;
    struct sched_config sc;
    sched_config_default(&sc);
    sc.parallel = u->parallel;
    sc.max_itl_ratio = u->max_itl_ratio;
    if (u->draft) {
        model_kv_config(u->draft, &dc);
        dc.type_k = dc.type_v = u->draft_type;
        dc.prefix_cache = u->prefix_cache;
        assert_int_equal(sched_engine_model_add_draft(&eng, u->draft, &dc, 512, g_pool), KS_OK);
        g_draft_kv = eng.draft->cache(eng.draft->ctx);
        if (u->claim_ratio > 0)
            eng.draft->weight_bytes = (uint64_t)((double)eng.weight_bytes * u->claim_ratio);
        sc.spec_type = SPEC_DRAFT;
        /* draft whatever the cost model says: a tiny model's extra token costs nearly a step */
        sc.draft_min = u->adaptive ? 0 : 1;
        sc.draft_max = 6;
    }
    struct sched *s = NULL;
    assert_int_equal(sched_create(&sc, &eng, &s), KS_OK);
    return s;
}

/* Between two steps: both caches hold their invariants, and the budget's
 * bytes used are the sum of both caches' pages. */
struct pool_state {
    ks_status target_check, draft_check;
    size_t used_target, used_draft, used_pool, shared_seen;
    int32_t seqs_target, seqs_draft;
};

static void check_pool(void *user, struct kv_cache *kv)
{
    struct pool_state *p = user;
    p->target_check = kv_check(kv);
    p->draft_check = g_draft_kv ? kv_check(g_draft_kv) : KS_OK;
    struct kv_usage ut, ud = {0};
    kv_usage(kv, &ut);
    if (g_draft_kv)
        kv_usage(g_draft_kv, &ud);
    p->used_target = ut.used;
    p->used_draft = ud.used;
    p->shared_seen = ut.shared_used;
    p->used_pool = kv_budget_used(kv);
    p->seqs_target = ut.n_seqs;
    p->seqs_draft = ud.n_seqs;
}

static void assert_pool(struct sched *s, bool idle)
{
    struct pool_state p;
    assert_int_equal(sched_between_steps(s, check_pool, &p), KS_OK);
    assert_int_equal(p.target_check, KS_OK);
    assert_int_equal(p.draft_check, KS_OK);
    assert_int_equal(p.used_pool, p.used_target + p.used_draft);
    assert_int_equal(p.shared_seen, p.used_draft);
    if (idle) {
        assert_int_equal(p.seqs_target, 0);
        assert_int_equal(p.seqs_draft, 0);
    }
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
    if (u->draft)
        assert_pool(s, true);
    sched_free(s);
}

/* ---- prompts and models ----------------------------------------------------------- */

static void random_ids(int32_t *t, int32_t n, int32_t salt, int32_t n_vocab)
{
    for (int32_t i = 0; i < n; i++)
        t[i] = 3 + (int32_t)(((uint32_t)i * 2654435761u + (uint32_t)salt * 40503u) % (uint32_t)(n_vocab - 3));
}

enum { SET_MAX = 8, SET_LEN = 160 };
/* A test's requests: prompt i is first + step * i random tokens of salt + i. */
struct prompt_set {
    int32_t ids[SET_MAX][SET_LEN];
    int32_t *p[SET_MAX], len[SET_MAX];
};

static void random_prompts(struct prompt_set *ps, int n, int32_t first, int32_t step, int32_t salt, int32_t n_vocab)
{
    assert_true(n <= SET_MAX && first + step * (n - 1) <= SET_LEN);
    for (int i = 0; i < n; i++) {
        ps->p[i] = ps->ids[i];
        random_ids(ps->ids[i], ps->len[i] = first + step * i, salt + i, n_vocab);
    }
}

/* The prompts at once on one scheduler (with u's draft), each answer the same
 * as its solo one, the pool accounted after; the scheduler's counts in *st. */
static void run_together(const struct setup *u, int32_t *const *prompts, const int32_t *lens, int n,
                         int32_t max_tokens, const struct sched_result *solo, struct sched_stats *st)
{
    struct sched_result together[SET_MAX];
    assert_true(n <= SET_MAX);
    struct sched *s = make_sched(u);
    for (int i = 0; i < n; i++)
        sched_result_submit_greedy(s, prompts[i], lens[i], max_tokens, &together[i]);
    for (int i = 0; i < n; i++)
        result_wait(&together[i]);
    assert_pool(s, true);
    sched_get_stats(s, st);
    sched_free(s);
    for (int i = 0; i < n; i++)
        assert_same_tokens(&solo[i], &together[i]);
}

static struct model *synth_model(const char *preset, int n_layer, uint64_t seed)
{
    struct model *m = NULL;
    assert_int_equal(ks_synth_model(preset, n_layer, seed, g_pool, &m), KS_OK);
    return m;
}

/* ---- tests -------------------------------------------------------------------- */

/* n prompts alone, without and with the draft: the same tokens. Returns the
 * drafts proposed and accepted over all of them. */
static void identity(struct model *target, struct model *draft, enum quant_type type, enum quant_type draft_type,
                     int32_t *drafted, int32_t *accepted)
{
    enum { N = 3, GEN = 40 };
    int32_t n_vocab = model_hparams(target)->n_vocab;
    static struct prompt_set ps;
    random_prompts(&ps, N, 5, 60, 11, n_vocab);
    int32_t **prompts = ps.p, *lens = ps.len;
    struct sched_result plain[N], spec[N];
    struct setup u = {.target = target, .type = type, .parallel = 2};
    run_each(&u, prompts, lens, N, GEN, plain);
    u.draft = draft;
    u.draft_type = draft_type;
    run_each(&u, prompts, lens, N, GEN, spec);
    *drafted = *accepted = 0;
    for (int i = 0; i < N; i++) {
        assert_same_tokens(&plain[i], &spec[i]);
        assert_int_equal(plain[i].n_drafted, 0);
        *drafted += spec[i].n_drafted;
        *accepted += spec[i].n_accepted;
    }
}

/* The target drafting for itself with pages of its own precision proposes
 * exactly what it then computes: every draft is accepted. */
static void test_self_draft(void **state)
{
    (void)state;
    if (!g_default)
        KS_SKIP("no default model at $KVSERVE_DEFAULT_MODEL (build target default_model)");
    enum quant_type types[2] = {QUANT_F16, QUANT_Q4_0};
    for (int t = 0; t < 2; t++) {
        int32_t drafted, accepted;
        identity(g_default, g_default, types[t], types[t], &drafted, &accepted);
        print_message("self-draft, %s pages: %d drafted, %d accepted\n", quant_type_name(types[t]), (int)drafted,
                      (int)accepted);
        assert_true(drafted > 0);
        assert_int_equal(accepted, drafted);
    }
}

/* Sampling requests (temperature 1, top-k 10: the stages a draft's q
 * follows): n at once, each into out[i] with its own seed. */
static void run_sampled(struct sched *s, int32_t *const *prompts, const int32_t *lens, int n, int32_t max_tokens,
                        struct sched_result *out)
{
    for (int i = 0; i < n; i++) {
        sched_result_init(&out[i]);
        struct sched_request rq = {.prompt = prompts[i], .n_prompt = lens[i], .max_tokens = max_tokens,
                                   .ignore_eog = true, .on_event = sched_result_on_event, .user = &out[i]};
        sample_params_default(&rq.sampling);
        rq.sampling.temp = 1.0f;
        rq.sampling.top_k = 10;
        rq.sampling.top_p = 1.0f;
        rq.sampling.min_p = 0.0f;
        rq.sampling.seed = 77 + (uint64_t)i;
        uint64_t id = 0;
        assert_int_equal(sched_submit(s, &rq, &id), KS_OK);
    }
    for (int i = 0; i < n; i++)
        result_wait(&out[i]);
}

/* Sampled drafts: the target drafting for itself draws each draft from q =
 * its own p, so min(1, p / q) keeps all but a rounding's worth (verified as
 * deterministic proposals, only sum p^2 of them would be kept); a small draft
 * of another seed is mostly rejected, each rejection drawing from
 * max(0, p - q), and its requests still end with all their tokens and the
 * pages accounted for. */
static void test_sampled_drafts(void **state)
{
    (void)state;
    if (!g_default)
        KS_SKIP("no default model at $KVSERVE_DEFAULT_MODEL (build target default_model)");
    enum { N = 3, GEN = 40 };
    int32_t n_vocab = model_hparams(g_default)->n_vocab;
    static struct prompt_set ps;
    random_prompts(&ps, N, 8, 20, 31, n_vocab);
    int32_t **prompts = ps.p, *lens = ps.len;
    struct model *drafts[2] = {g_default, g_small};
    for (int d = 0; d < 2; d++) {
        struct setup u = {.target = g_default, .draft = drafts[d], .type = QUANT_F16,
                          .draft_type = d == 0 ? QUANT_F16 : QUANT_Q4_0, .parallel = N};
        struct sched *s = make_sched(&u);
        struct sched_result out[N];
        run_sampled(s, prompts, lens, N, GEN, out);
        int32_t drafted = 0, accepted = 0;
        for (int i = 0; i < N; i++) {
            assert_int_equal(out[i].n, GEN);
            drafted += out[i].n_drafted;
            accepted += out[i].n_accepted;
        }
        print_message("sampled, %s: %d drafted, %d accepted\n", d == 0 ? "self-draft" : "small draft", (int)drafted,
                      (int)accepted);
        assert_true(drafted > 0);
        if (d == 0)
            assert_true(accepted >= drafted - 2);
        assert_pool(s, true);
        sched_free(s);
    }
}

/* A draft that differs from its target: the trained tiny llama at q4_0
 * drafting for itself at q8_0 (real text: drafts accepted and rejected), or
 * without $KVSERVE_SHARED the 1-layer synthesized draft; its pages at q4_0
 * (the floor), the target's at f16 and q4_0: the output does not change. */
static void test_small_draft_dense(void **state)
{
    (void)state;
    if (!g_default)
        KS_SKIP("no default model at $KVSERVE_DEFAULT_MODEL (build target default_model)");
    struct model *target = g_trained ? g_trained : g_default, *draft = g_trained ? g_trained_q4 : g_small;
    enum quant_type types[2] = {QUANT_F16, QUANT_Q4_0};
    for (int t = 0; t < 2; t++) {
        int32_t drafted, accepted;
        identity(target, draft, types[t], QUANT_Q4_0, &drafted, &accepted);
        print_message("%s, %s pages: %d drafted, %d accepted\n", g_trained ? "trained q8_0 by its q4_0" : "small draft",
                      quant_type_name(types[t]), (int)drafted, (int)accepted);
        assert_true(drafted > 0);
        if (g_trained)
            assert_true(accepted > 0 && accepted < drafted);
    }
}

/* A mixture-of-experts target, drafted for by itself and by the small dense
 * draft; a sliding-window model (tiny-gemma3: a 16-token window, so the draft
 * sequences' cuts meet pages whose window rows are freed) drafting for itself
 * and drafted for by one layer of another seed. */
static void test_moe_and_window(void **state)
{
    (void)state;
    if (!g_default)
        KS_SKIP("no default model at $KVSERVE_DEFAULT_MODEL (build target default_model)");
    struct model *moe = synth_model("tiny-qwen3moe", 0, 0);
    int32_t drafted, accepted;
    identity(moe, moe, QUANT_F16, QUANT_F16, &drafted, &accepted);
    print_message("MoE self-draft: %d drafted, %d accepted\n", (int)drafted, (int)accepted);
    assert_int_equal(accepted, drafted);
    identity(moe, g_small, QUANT_Q4_0, QUANT_Q4_0, &drafted, &accepted);
    print_message("MoE, small draft: %d drafted, %d accepted\n", (int)drafted, (int)accepted);
    assert_true(drafted > 0);
    model_free(moe);
    struct model *swa = synth_model("tiny-gemma3", 0, 0);
    identity(swa, swa, QUANT_F16, QUANT_F16, &drafted, &accepted);
    print_message("sliding window self-draft: %d drafted, %d accepted\n", (int)drafted, (int)accepted);
    assert_true(drafted > 0);
    assert_int_equal(accepted, drafted);
    struct model *swa_small = synth_model("tiny-gemma3", 1, 77); /* rejected: its rows are cut back */
    identity(swa, swa_small, QUANT_F16, QUANT_F16, &drafted, &accepted);
    print_message("sliding window, small draft: %d drafted, %d accepted\n", (int)drafted, (int)accepted);
    assert_true(drafted > 0);
    model_free(swa_small);
    model_free(swa);
}

/* N_MANY requests at once (the trained pair when $KVSERVE_SHARED has it),
 * half of them continuing a shared prefix that an earlier request left in
 * both prefix caches, drafting in one batched draft pass per draft token:
 * each equals its solo answer without a draft model, the pool adds up between
 * steps and mid-stream, and nothing is left behind. */
static void test_many_with_prefix_hit(void **state)
{
    (void)state;
    if (!g_default)
        KS_SKIP("no default model at $KVSERVE_DEFAULT_MODEL (build target default_model)");
    struct model *target = g_trained ? g_trained : g_default, *draft = g_trained ? g_trained_q4 : g_small;
    int32_t n_vocab = model_hparams(target)->n_vocab;
    static int32_t buf[N_MANY + 1][200];
    int32_t *prompts[N_MANY + 1], lens[N_MANY + 1];
    random_ids(buf[N_MANY], 96, 5, n_vocab); /* the shared prefix: 3 pages */
    for (int i = 0; i < N_MANY; i++) {
        prompts[i] = buf[i];
        int32_t own = 8 + 5 * i;
        if (i % 2 == 0) {
            memcpy(buf[i], buf[N_MANY], 96 * sizeof **buf);
            random_ids(buf[i] + 96, own, 100 + i, n_vocab);
            lens[i] = 96 + own;
        } else {
            random_ids(buf[i], lens[i] = own, 200 + i, n_vocab);
        }
    }
    prompts[N_MANY] = buf[N_MANY];
    lens[N_MANY] = 100;
    random_ids(buf[N_MANY] + 96, 4, 77, n_vocab);
    struct sched_result solo[N_MANY], together[N_MANY], first;
    struct setup u = {.target = target, .type = QUANT_F16, .parallel = N_MANY, .prefix_cache = true};
    run_each(&u, prompts, lens, N_MANY, 32, solo);
    u.draft = draft;
    u.draft_type = QUANT_Q4_0;
    struct sched *s = make_sched(&u);
    sched_result_submit_greedy(s, prompts[N_MANY], lens[N_MANY], 8, &first); /* leaves the prefix in both caches */
    result_wait(&first);
    for (int i = 0; i < N_MANY; i++)
        sched_result_submit_greedy(s, prompts[i], lens[i], 32, &together[i]);
    assert_pool(s, false); /* mid-stream */
    for (int i = 0; i < N_MANY; i++)
        result_wait(&together[i]);
    assert_pool(s, true);
    struct sched_stats st;
    sched_get_stats(s, &st);
    struct kv_usage ud;
    kv_usage(g_draft_kv, &ud);
    sched_free(s);
    int32_t hits = 0;
    for (int i = 0; i < N_MANY; i++) {
        assert_same_tokens(&solo[i], &together[i]);
        hits += i % 2 == 0 && together[i].n_cached >= 64;
    }
    print_message("%d requests together: %llu verifications, %llu drafted, %llu accepted; draft cache: %lld pages "
                  "attached\n", N_MANY, (unsigned long long)st.spec_verifications,
                  (unsigned long long)st.spec_draft_tokens, (unsigned long long)st.spec_accepted_tokens,
                  (long long)ud.attached_pages);
    assert_int_equal(hits, N_MANY / 2);
    assert_true(st.spec_draft_tokens > 0);
    assert_true(ud.attached_pages > 0); /* the draft sequences mapped the shared prefix too */
}

/* A budget too small for everyone: requests are preempted and recomputed
 * (their draft sequences freed and made again), the pool never exceeds the
 * budget, and the output does not change. */
static void test_tight_budget(void **state)
{
    (void)state;
    if (!g_default)
        KS_SKIP("no default model at $KVSERVE_DEFAULT_MODEL (build target default_model)");
    enum { N = 6 };
    struct model *target = g_trained ? g_trained : g_default, *draft = g_trained ? g_trained_q4 : g_small;
    int32_t n_vocab = model_hparams(target)->n_vocab;
    static struct prompt_set ps;
    random_prompts(&ps, N, 60, 10, 300, n_vocab);
    int32_t **prompts = ps.p, *lens = ps.len;
    struct kv_config kc;
    model_kv_config(target, &kc);
    size_t page = kv_page_bytes(&kc, QUANT_F16, QUANT_F16);
    struct sched_result solo[N];
    struct setup u = {.target = target, .type = QUANT_F16, .parallel = N};
    run_each(&u, prompts, lens, N, 40, solo);
    u.draft = draft;
    u.draft_type = QUANT_Q4_0;
    u.budget = 12 * page; /* 6 requests of up to 4 pages each do not fit at once */
    struct sched_stats st;
    run_together(&u, prompts, lens, N, 40, solo, &st);
    print_message("tight budget: %llu preemptions, %llu drafted, %llu accepted\n", (unsigned long long)st.preemptions,
                  (unsigned long long)st.spec_draft_tokens, (unsigned long long)st.spec_accepted_tokens);
}

/* With --max-itl-ratio on, the drafts and the draft steps they need take
 * only what the step's budget leaves (how many depends on measured times, so
 * only the output is checked): four requests at once, each its solo answer. */
static void test_itl_budget(void **state)
{
    (void)state;
    if (!g_default)
        KS_SKIP("no default model at $KVSERVE_DEFAULT_MODEL (build target default_model)");
    struct model *target = g_trained ? g_trained : g_default, *draft = g_trained ? g_trained_q4 : g_small;
    enum { N = 4 };
    int32_t n_vocab = model_hparams(target)->n_vocab;
    static struct prompt_set ps;
    random_prompts(&ps, N, 20, 25, 500, n_vocab);
    int32_t **prompts = ps.p, *lens = ps.len;
    struct sched_result solo[N];
    struct setup u = {.target = target, .type = QUANT_F16, .parallel = N};
    run_each(&u, prompts, lens, N, 40, solo);
    u.draft = draft;
    u.draft_type = QUANT_Q4_0;
    u.max_itl_ratio = 1.5f;
    struct sched_stats st;
    run_together(&u, prompts, lens, N, 40, solo, &st);
}

/* The scheduler refuses SPEC_DRAFT without a draft engine. */
static void test_config_refused(void **state)
{
    (void)state;
    if (!g_default)
        KS_SKIP("no default model at $KVSERVE_DEFAULT_MODEL (build target default_model)");
    struct kv_config kc;
    model_kv_config(g_default, &kc);
    kc.mem_budget = 8u << 20;
    struct sched_engine eng;
    assert_int_equal(sched_engine_model(g_default, &kc, 64, g_pool, &eng), KS_OK);
    struct sched_config sc;
    sched_config_default(&sc);
    sc.max_batch_tokens = 64;
    sc.spec_type = SPEC_DRAFT;
    struct sched *s = NULL;
    assert_int_equal(sched_create(&sc, &eng, &s), KS_ERR_INVALID_ARG);
    assert_non_null(strstr(ks_errmsg(), "--model-draft"));
    /* a second draft is refused; a p_min outside 0..1 too */
    struct kv_config dc;
    model_kv_config(g_small, &dc);
    assert_int_equal(sched_engine_model_add_draft(&eng, g_small, &dc, 64, g_pool), KS_OK);
    assert_int_equal(sched_engine_model_add_draft(&eng, g_small, &dc, 64, g_pool), KS_ERR_STATE);
    sc.draft_p_min = 1.5f;
    assert_int_equal(sched_create(&sc, &eng, &s), KS_ERR_INVALID_ARG);
    assert_non_null(strstr(ks_errmsg(), "--draft-p-min"));
    eng.destroy(eng.ctx);
}

/* g_default's engine (16 MiB of cache, contexts of n_ctx) with draft beside
 * it, its cache q4_0 or the model's own type. */
static void default_with_draft(struct model *draft, bool q4_draft, int32_t n_ctx, struct sched_engine *eng)
{
    struct kv_config kc, dc;
    model_kv_config(g_default, &kc);
    kc.mem_budget = 16u << 20;
    assert_int_equal(sched_engine_model(g_default, &kc, n_ctx, g_pool, eng), KS_OK);
    model_kv_config(draft, &dc);
    if (q4_draft)
        dc.type_k = dc.type_v = QUANT_Q4_0;
    assert_int_equal(sched_engine_model_add_draft(eng, draft, &dc, n_ctx, g_pool), KS_OK);
}

/* --draft-p-min 1 keeps only drafts the draft model is certain of: with a
 * random draft model, none. */
static void test_p_min(void **state)
{
    (void)state;
    if (!g_default)
        KS_SKIP("no default model at $KVSERVE_DEFAULT_MODEL (build target default_model)");
    struct sched_engine eng;
    default_with_draft(g_small, true, 64, &eng);
    struct sched_config sc;
    sched_config_default(&sc);
    sc.max_batch_tokens = 64;
    sc.parallel = 2;
    sc.spec_type = SPEC_DRAFT;
    sc.draft_min = 1;
    sc.draft_p_min = 1.0f;
    struct sched *s = NULL;
    assert_int_equal(sched_create(&sc, &eng, &s), KS_OK);
    int32_t prompt[20];
    random_ids(prompt, 20, 9, model_hparams(g_default)->n_vocab);
    struct sched_result r;
    sched_result_submit_greedy(s, prompt, 20, 24, &r);
    result_wait(&r);
    sched_free(s);
    assert_int_equal(r.n, 24);
    assert_int_equal(r.n_drafted, 0);
}

/* A window (sched_drafter_restart): the draft sequence holds the text from
 * base on at positions 0.., costs the draft model only those tokens, and
 * proposes what a sequence of just those tokens proposes; released, nothing
 * is left behind. */
static void test_window_restart(void **state)
{
    (void)state;
    if (!g_default)
        KS_SKIP("no default model at $KVSERVE_DEFAULT_MODEL (build target default_model)");
    enum { N = 100, BASE = 60, K = 3 };
    struct sched_engine eng;
    default_with_draft(g_default, false, 128, &eng);
    struct sched_drafter *d = NULL;
    assert_int_equal(sched_drafter_create(eng.draft, 128, 2, 128, 0.0f, &d), KS_OK);
    int32_t text[N];
    random_ids(text, N, 21, model_hparams(g_default)->n_vocab);
    struct sched_draft_seq win, fresh;
    sched_draft_seq_init(&win);
    sched_draft_seq_init(&fresh);
    sched_drafter_restart(d, &win, text, N, BASE, false);
    assert_int_equal(win.base, BASE);
    struct sched_draft_job jobs[2] = {
        {.ds = &win, .tokens = text, .n_tokens = N, .k = K},
        {.ds = &fresh, .tokens = text + BASE, .n_tokens = N - BASE, .k = K},
    };
    struct sched_drafter_counts before, after;
    sched_drafter_get_counts(d, &before);
    sched_drafter_run(d, jobs, 2);
    sched_drafter_get_counts(d, &after);
    assert_int_equal(jobs[0].n_work, N - BASE + K - 1); /* the window's catch-up and K - 1 draft steps */
    assert_int_equal(jobs[1].n_work, N - BASE + K - 1);
    assert_int_equal(after.tokens - before.tokens, 2 * (N - BASE + K - 1));
    assert_int_equal(jobs[0].n_draft, K);
    assert_int_equal(jobs[1].n_draft, K);
    for (int i = 0; i < K; i++)
        assert_int_equal(jobs[0].draft[i], jobs[1].draft[i]);
    assert_int_equal(win.n_computed, N - BASE);
    /* the text moves on by its first draft: the window's fed draft becomes computed */
    int32_t more[N + 1];
    memcpy(more, text, sizeof text);
    more[N] = jobs[0].draft[0];
    sched_drafter_release(d, &win, more, N + 1, false);
    sched_drafter_release(d, &fresh, more + BASE, N + 1 - BASE, false);
    assert_int_equal(win.seq, -1);
    assert_int_equal(win.base, 0);
    struct kv_usage ud;
    kv_usage(eng.draft->cache(eng.draft->ctx), &ud);
    assert_int_equal(ud.n_seqs, 0);
    assert_int_equal(kv_check(eng.draft->cache(eng.draft->ctx)), KS_OK);
    sched_drafter_free(d);
    eng.destroy(eng.ctx);
}

/* N requests at once with --draft-min 0 whose drafts are never accepted
 * (a draft model of another seed): the output is each one's solo answer
 * without a draft, and the tokens the draft model computed, weighted by its
 * cost (the weights' ratio, or the ratio the draft engine claims), stay
 * within SPEC_DRAFT_IDLE_SHARE of the target's tokens plus the accepted
 * drafts' worth, whatever the measured timings. Returns the draft tokens. */
static uint64_t idle_run(struct model *target, struct model *draft, double claim, const char *what)
{
    enum { N = 4, GEN = 48 };
    int32_t n_vocab = model_hparams(target)->n_vocab;
    static struct prompt_set ps;
    random_prompts(&ps, N, 20, 25, 700, n_vocab);
    int32_t **prompts = ps.p, *lens = ps.len;
    struct sched_result solo[N];
    struct setup u = {.target = target, .type = QUANT_F16, .parallel = N};
    run_each(&u, prompts, lens, N, GEN, solo);
    u.draft = draft;
    u.draft_type = QUANT_Q4_0;
    u.adaptive = true;
    u.claim_ratio = claim;
    struct sched_stats st;
    run_together(&u, prompts, lens, N, GEN, solo, &st);
    double rho = claim > 0 ? claim : (double)model_active_weight_bytes(draft) / (double)model_active_weight_bytes(target);
    double work = (double)(st.prompt_tokens + st.generated_tokens);
    print_message("%s (draft cost %.3f): %llu draft-model forwards, %llu tokens (%.4f of the target's work weighted), "
                  "%llu shadow checks, %llu drafted, %llu accepted\n", what, rho,
                  (unsigned long long)st.spec_draft_forwards, (unsigned long long)st.spec_draft_model_tokens,
                  (double)st.spec_draft_model_tokens * rho / work, (unsigned long long)st.spec_shadow_checks,
                  (unsigned long long)st.spec_draft_tokens, (unsigned long long)st.spec_accepted_tokens);
    assert_true((double)st.spec_draft_model_tokens * rho <=
                SPEC_DRAFT_IDLE_SHARE * work + (double)st.spec_accepted_tokens + 1e-9);
    return st.spec_draft_model_tokens;
}

/* A draft as large as its target never runs (no draft length could pay);
 * a smaller one, and one claiming to be far smaller (so it checks, starts
 * windows, drafts when the measured costs let it), stay within the bound
 * on a target that rejects its drafts. */
static void test_idle_bounded(void **state)
{
    (void)state;
    if (!g_default)
        KS_SKIP("no default model at $KVSERVE_DEFAULT_MODEL (build target default_model)");
    struct model *same = synth_model("tiny", 0, 4242);
    assert_int_equal(idle_run(g_default, same, 0.0, "same-size draft"), 0);
    model_free(same);
    idle_run(g_default, g_small, 0.0, "1-layer draft");
    /* the MoE target rejects the small draft's tokens */
    struct model *moe = synth_model("tiny-qwen3moe", 0, 0);
    idle_run(moe, g_small, 0.0, "MoE, 1-layer draft");
    idle_run(moe, g_small, 0.05, "MoE, 1-layer draft claiming 5%");
    idle_run(moe, g_small, 0.005, "MoE, 1-layer draft claiming 0.5%");
    model_free(moe);
}

/* ---- main ----------------------------------------------------------------------- */

static int group_setup(void **state)
{
    (void)state;
    if (threads_create(2, &g_pool) != KS_OK)
        return -1;
    const char *path = getenv("KVSERVE_DEFAULT_MODEL");
    if (path && access(path, R_OK) == 0 && model_load(path, &g_default) != KS_OK)
        return -1;
    if (!g_default)
        return 0;
    const char *shared = getenv("KVSERVE_SHARED");
    char trained[4096], trained_q4[4096];
    snprintf(trained, sizeof trained, "%s/models/trained/tiny-llama-gqa-hd64-q8_0.gguf", shared ? shared : "../shared");
    snprintf(trained_q4, sizeof trained_q4, "%s/models/trained/tiny-llama-gqa-hd64-q4_0.gguf",
             shared ? shared : "../shared");
    if (access(trained, R_OK) == 0 && access(trained_q4, R_OK) == 0 &&
        (model_load(trained, &g_trained) != KS_OK || model_load(trained_q4, &g_trained_q4) != KS_OK))
        return -1;
    /* the small draft: one layer of `tiny` of another seed, the same vocabulary */
    return ks_synth_model("tiny", 1, 99, g_pool, &g_small) ? -1 : 0;
}

static int group_teardown(void **state)
{
    (void)state;
    model_free(g_small);
    model_free(g_trained);
    model_free(g_trained_q4);
    model_free(g_default);
    threads_free(g_pool);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_self_draft),
        cmocka_unit_test(test_small_draft_dense),
        cmocka_unit_test(test_sampled_drafts),
        cmocka_unit_test(test_moe_and_window),
        cmocka_unit_test(test_many_with_prefix_hit),
        cmocka_unit_test(test_tight_budget),
        cmocka_unit_test(test_itl_budget),
        cmocka_unit_test(test_config_refused),
        cmocka_unit_test(test_p_min),
        cmocka_unit_test(test_window_restart),
        cmocka_unit_test(test_idle_bounded),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
