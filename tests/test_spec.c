/* Speculation's pure parts: prompt lookup (spec_ngram_draft), the adaptive
 * draft length (spec_adapt) and the rejection samplers (sample_verify for a
 * deterministic draft, sample_verify_proposal for a draft drawn from a draft
 * model's q), whose output must be distributed as plain sampling's: checked
 * on a vocabulary of 8 against the exact distribution, with a bound that the
 * usual wrong rules exceed several times over. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "sample/sample.h"
#include "spec/spec.h"
#include "support/rng.h"
#include "support/skip.h"

/* ---- prompt lookup ------------------------------------------------------------ */

static void test_ngram_longest_most_recent_match(void **state)
{
    (void)state;
    int32_t draft[8];
    /* "1 2 3 4 5 | 9 2 3 7 | 1 2 3": the 3-gram 1 2 3 occurred at 0, followed by 4 5 9 ... */
    const int32_t t[] = {1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3};
    int32_t n = (int32_t)(sizeof t / sizeof *t);
    assert_int_equal(spec_ngram_draft(t, n, 4, draft), 4);
    const int32_t want[] = {4, 5, 9, 2};
    assert_memory_equal(draft, want, sizeof want);
    /* only 2 3 matches (at 6, the most recent): followed by 7 1 2 3 */
    const int32_t u[] = {1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 8, 2, 3};
    n = (int32_t)(sizeof u / sizeof *u);
    assert_int_equal(spec_ngram_draft(u, n, 3, draft), 3);
    const int32_t want_u[] = {7, 1, 8};
    assert_memory_equal(draft, want_u, sizeof want_u);
    /* past the end of the text the continuation repeats itself: 5 | 6 7 5 | 6 7 5 6 7 */
    const int32_t v[] = {5, 6, 7, 5};
    assert_int_equal(spec_ngram_draft(v, 4, 8, draft), 8);
    const int32_t want_v[] = {6, 7, 5, 6, 7, 5, 6, 7};
    assert_memory_equal(draft, want_v, sizeof want_v);
    assert_int_equal(spec_ngram_draft(v, 4, 1, draft), 1);
    /* nothing to find, or nothing asked */
    const int32_t w[] = {1, 2, 3, 4};
    assert_int_equal(spec_ngram_draft(w, 4, 8, draft), 0);
    assert_int_equal(spec_ngram_draft(v, 4, 0, draft), 0);
    assert_int_equal(spec_ngram_draft(v, 1, 4, draft), 0);
    assert_int_equal(spec_ngram_draft(NULL, 0, 4, draft), 0);
}

static void test_ngram_repetition_drafts_the_cycle(void **state)
{
    (void)state;
    int32_t t[40], draft[16];
    for (int i = 0; i < 40; i++)
        t[i] = 10 + i % 5;
    assert_int_equal(spec_ngram_draft(t, 40, 16, draft), 16); /* one period back, then the cycle again */
    for (int i = 0; i < 16; i++)
        assert_int_equal(draft[i], 10 + (40 + i) % 5);
}

/* The lookup as spec.h states it, one n at a time from the longest: the
 * reference for spec_ngram_draft's single scan. */
static int32_t naive_ngram_draft(const int32_t *t, int32_t n_tokens, int32_t n_max, int32_t *draft)
{
    int32_t lo = n_tokens > SPEC_NGRAM_WINDOW ? n_tokens - SPEC_NGRAM_WINDOW : 0;
    for (int32_t n = SPEC_NGRAM_MAX; n >= SPEC_NGRAM_MIN; n--)
        for (int32_t at = n_tokens - n - 1; at >= lo; at--) {
            if (memcmp(t + at, t + n_tokens - n, (size_t)n * sizeof *t))
                continue;
            for (int32_t j = 0; j < n_max; j++)
                draft[j] = at + n + j < n_tokens ? t[at + n + j] : draft[at + n + j - n_tokens];
            return n_max;
        }
    return 0;
}

static void test_ngram_matches_the_naive_lookup(void **state)
{
    (void)state;
    static uint64_t rng = 0x9E3779B97F4A7C15ull;
    int32_t t[96], got[8], want[8];
    for (int trial = 0; trial < 2000; trial++) {
        int32_t vocab = 2 + trial % 61, n = 1 + (int32_t)(ks_rng_next(&rng) % 96); /* blocks with and without hits */
        for (int32_t i = 0; i < n; i++)
            t[i] = (int32_t)(ks_rng_next(&rng) % (uint64_t)vocab);
        int32_t m = naive_ngram_draft(t, n, 8, want);
        assert_int_equal(spec_ngram_draft(t, n, 8, got), m);
        assert_memory_equal(got, want, (size_t)m * sizeof *got);
    }
}

/* ---- the shared n-gram pool ------------------------------------------------------ */

static struct spec_pool *pool_of(int32_t n)
{
    struct spec_pool *p = NULL;
    assert_int_equal(spec_pool_create(n, 1u << 16, &p), KS_OK);
    assert_int_equal(spec_pool_bytes(p), 1u << 16);
    return p;
}

/* One request's text teaches the pool; another request whose text ends in
 * the same n tokens drafts what followed them, as far as the pool knows. */
static void test_pool_drafts_across_requests(void **state)
{
    (void)state;
    struct spec_pool *p = pool_of(3);
    const int32_t a[] = {40, 41, 42, 43, 44, 45, 46, 47};
    spec_pool_add(p, 0, a, 5, 0); /* the prompt */
    spec_pool_add(p, 0, a, 8, 5); /* then its output */
    const int32_t b[] = {7, 8, 41, 42, 43};
    int32_t draft[16];
    assert_int_equal(spec_pool_draft(p, 0, b, 5, 16, draft), 4); /* 44 45 46 47, then no key for 45 46 47 */
    const int32_t want[] = {44, 45, 46, 47};
    assert_memory_equal(draft, want, sizeof want);
    assert_int_equal(spec_pool_draft(p, 0, b, 5, 2, draft), 2);
    /* the last n tokens were never seen, or the text is shorter than n */
    const int32_t c[] = {41, 42, 9};
    assert_int_equal(spec_pool_draft(p, 0, c, 3, 4, draft), 0);
    assert_int_equal(spec_pool_draft(p, 0, b, 2, 4, draft), 0);
    assert_int_equal(spec_pool_draft(p, 0, b, 5, 0, draft), 0);
    /* another salt (a tenant's cache_salt) sees none of it */
    assert_int_equal(spec_pool_draft(p, 77, b, 5, 16, draft), 0);
    spec_pool_add(p, 77, a, 8, 0);
    assert_int_equal(spec_pool_draft(p, 77, b, 5, 16, draft), 4);
    /* the newest continuation wins */
    const int32_t d[] = {41, 42, 43, 99};
    spec_pool_add(p, 0, d, 4, 0);
    assert_int_equal(spec_pool_draft(p, 0, b, 5, 1, draft), 1);
    assert_int_equal(draft[0], 99);
    spec_pool_free(p);
}

/* A long text fills the table; lookups of n-grams it never held mostly find
 * nothing (the slot's check), and the ones it held, the latest writer. */
static void test_pool_keys_are_checked(void **state)
{
    (void)state;
    struct spec_pool *p = pool_of(4);
    enum { N = 20000 };
    static int32_t text[N];
    srand(7);
    for (int i = 0; i < N; i++)
        text[i] = rand() % 5000;
    spec_pool_add(p, 0, text, N, 0);
    int found = 0, right = 0;
    int32_t probe[4], draft[1];
    for (int i = 0; i < 2000; i++) {
        for (int j = 0; j < 4; j++)
            probe[j] = 5000 + rand() % 5000; /* never in the text */
        found += spec_pool_draft(p, 0, probe, 4, 1, draft);
        int at = 4 + rand() % (N - 4);
        right += spec_pool_draft(p, 0, text + at - 4, 4, 1, draft) == 1 && draft[0] == text[at];
    }
    assert_int_equal(found, 0);
    assert_true(right > 2000 / 4); /* 8192 slots for 20000 keys: the latest of each slot survives */
    spec_pool_free(p);
}

static void test_pool_bad_sizes(void **state)
{
    (void)state;
    struct spec_pool *p = (struct spec_pool *)1;
    assert_int_not_equal(spec_pool_create(1, 1u << 20, &p), KS_OK);
    assert_null(p);
    assert_int_not_equal(spec_pool_create(SPEC_POOL_N_MAX + 1, 1u << 20, &p), KS_OK);
    assert_int_not_equal(spec_pool_create(8, 100, &p), KS_OK);
    assert_int_equal(spec_pool_create(8, (1u << 20) + 5, &p), KS_OK);
    assert_int_equal(spec_pool_bytes(p), 1u << 20);
    spec_pool_free(p);
    spec_pool_free(NULL);
    enum spec_type t;
    assert_true(spec_parse_type("ngram-pool", &t) && t == SPEC_NGRAM_POOL);
    assert_true(spec_parse_type("ngram-mod", &t) && t == SPEC_NGRAM_POOL);
    assert_string_equal(spec_type_name(SPEC_NGRAM_POOL), "ngram-pool");
    assert_true(spec_parse_type("draft", &t) && t == SPEC_DRAFT);
    assert_true(spec_parse_type("draft-simple", &t) && t == SPEC_DRAFT);
    assert_string_equal(spec_type_name(SPEC_DRAFT), "draft");
    assert_false(spec_parse_type("draft-eagle3", &t));
}

/* ---- adaptive length ------------------------------------------------------------ */

/* With every draft accepted k drafts give k + 1 tokens for 1 + k * c: some
 * k gains 10% exactly when c is small enough; a draft step as dear as a
 * target step (c >= 1) never does. */
static void test_can_pay(void **state)
{
    (void)state;
    assert_true(spec_can_pay(16, 0.1));
    assert_true(spec_can_pay(1, 0.5));   /* 2 / 1.5 */
    assert_false(spec_can_pay(16, 1.0)); /* 17 / 17 */
    assert_false(spec_can_pay(16, 1.2));
    assert_false(spec_can_pay(0, 0.1));  /* no draft allowed */
}

/* The draft model's allowance: a share of the target's work at the draft's
 * cost, so drafts never accepted cost at most that share; each accepted
 * draft earns a target step's worth, so drafting resumes when acceptance
 * returns; an unknown cost bounds nothing. */
static void test_draft_allowance(void **state)
{
    (void)state;
    /* 1000 tokens of work, 2%, a draft a tenth of its target: 200 draft tokens (20 target tokens' worth) */
    assert_true(fabs(spec_draft_allowance(1000, 0, 0.02, 0.1) - 200.0) < 1e-9);
    /* a draft as large as its target: 20, less than one window of a lagging sequence */
    assert_true(fabs(spec_draft_allowance(1000, 0, 0.02, 1.0) - 20.0) < 1e-9);
    /* 10 accepted drafts saved 10 target steps: 100 more draft tokens */
    assert_true(fabs(spec_draft_allowance(1000, 10, 0.02, 0.1) - 300.0) < 1e-9);
    assert_true(spec_draft_allowance(1000, 0, 0.02, 0.2) < spec_draft_allowance(1000, 0, 0.02, 0.1));
    assert_true(isinf(spec_draft_allowance(1000, 0, 0.02, 0.0)));
    assert_true(fabs(spec_draft_allowance(-5, -5, 0.02, 0.5)) < 1e-12);
}

/* The step costs of one stream: measured verifications set the extra
 * token's cost; a pass that lost its core counts as k + 1 steps at most; a
 * dear estimate relaxes over plain steps, so drafting that pays resumes and
 * measures again (a run that stopped drafting for good after one slow pass
 * was seen 1 in 19 times); plain steps never take it below the guess. */
static void test_cost_learns_and_recovers(void **state)
{
    (void)state;
    struct spec_cost c = {0};
    assert_true(fabs(spec_cost_ratio(&c) - SPEC_COST_GUESS) < 1e-12);
    spec_cost_learn(&c, 4, 0.020); /* no step measured yet: nothing to take it from */
    assert_true(c.extra_s == 0.0);
    for (int i = 0; i < 20; i++)
        spec_cost_learn(&c, 0, 0.010);
    assert_true(fabs(c.step_s - 0.010) < 1e-12);
    for (int i = 0; i < 40; i++)
        spec_cost_learn(&c, 8, 0.012); /* 8 more tokens cost a fifth of a step */
    assert_true(fabs(spec_cost_ratio(&c) - 0.025) < 1e-3);
    struct spec_adapt a;
    spec_adapt_init(&a, SPEC_NGRAM);
    for (int i = 0; i < 20; i++)
        spec_adapt_observe(&a, 8, 6);
    assert_true(spec_adapt_len(&a, 100, 0, 8, spec_cost_ratio(&c)) > 0);
    /* preempted passes: each counts as k + 1 steps, no more; a few of them stop the drafting */
    for (int i = 0; i < 6; i++)
        spec_cost_learn(&c, 8, 1.0);
    assert_true(c.extra_s <= c.step_s);
    assert_int_equal(spec_adapt_len(&a, 100, 0, 8, spec_cost_ratio(&c)), 0);
    int plain = 0;
    while (spec_adapt_len(&a, 100, 0, 8, spec_cost_ratio(&c)) == 0 && plain < 1000) {
        spec_cost_learn(&c, 0, 0.010);
        plain++;
    }
    assert_true(plain > 0 && plain <= 2 * SPEC_COST_RELAX_STEPS);
    for (int i = 0; i < 1000; i++)
        spec_cost_learn(&c, 0, 0.010);
    assert_true(fabs(spec_cost_ratio(&c) - SPEC_COST_GUESS) < 1e-9);
    /* nonsense timings change nothing */
    struct spec_cost before = c;
    spec_cost_learn(&c, 3, -1.0);
    spec_cost_learn(&c, -1, 0.5);
    spec_cost_learn(&c, 0, NAN);
    assert_true(c.step_s == before.step_s && c.extra_s == before.extra_s);
}

static void test_adapt_follows_acceptance(void **state)
{
    (void)state;
    struct spec_adapt a;
    spec_adapt_init(&a, SPEC_NGRAM);
    assert_int_equal(spec_adapt_len(&a, 10, 0, 16, 0.1), 0); /* no accepted token seen yet */
    spec_adapt_observe(&a, 1, 1);                            /* a shadow check's hit */
    assert_true(spec_adapt_len(&a, 11, 0, 16, 0.1) > 0);
    for (int i = 0; i < 50; i++)
        spec_adapt_observe(&a, 8, 8);
    assert_true(a.accept > 0.99);
    assert_int_equal(spec_adapt_len(&a, 100, 0, 16, 0.02), 16);
    assert_int_equal(spec_adapt_len(&a, 100, 0, 5, 0.02), 5);
    /* a verification that costs as much as a step is never worth it */
    assert_int_equal(spec_adapt_len(&a, 100, 0, 16, 1.0), 0);
    for (int i = 0; i < 50; i++)
        spec_adapt_observe(&a, 4, 0);
    assert_true(a.accept < 0.01);
    assert_int_equal(spec_adapt_len(&a, 100, 0, 16, 0.02), 0);
    assert_int_equal(spec_adapt_len(&a, 100, 3, 16, 0.02), 3); /* n_min forces drafting */
    assert_int_equal(spec_adapt_len(&a, 100, 0, 0, 0.0), 0);
    /* only tested tokens count: 2 accepted of 8 drafted is 2 hits and 1 miss */
    spec_adapt_init(&a, SPEC_NGRAM);
    spec_adapt_observe(&a, 8, 2);
    double e = 0.5;
    e = 0.9 * e + 0.1;
    e = 0.9 * e + 0.1;
    e = 0.9 * e;
    assert_true(fabs(a.accept - e) < 1e-12);
    assert_true(fabs(spec_expected_tokens(0.5, 3) - 1.875) < 1e-12);
}

/* Drafting waits for a tested token to be accepted, and a verification
 * that keeps nothing rests it for SPEC_REST_MIN, 2x, 4x ... tokens (at most
 * SPEC_REST_MAX), or until SPEC_REST_STREAK shadow checks in a row are
 * accepted; one that keeps a draft ends the backing off. */
static void test_adapt_rests_after_rejections(void **state)
{
    (void)state;
    struct spec_adapt a;
    spec_adapt_init(&a, SPEC_NGRAM);
    for (int i = 0; i < 40; i++)
        spec_adapt_observe(&a, 1, 0); /* shadow misses: still no drafting, acceptance falls */
    assert_int_equal(spec_adapt_len(&a, 50, 0, 16, 0.0), 0);
    assert_int_equal(spec_adapt_len(&a, 50, 2, 16, 0.0), 2); /* n_min forces drafting */
    for (int i = 0; i < 30; i++)
        spec_adapt_observe(&a, 4, 4);
    assert_true(spec_adapt_len(&a, 100, 0, 16, 0.05) > 0);
    int64_t at = 100, rest = SPEC_REST_MIN;
    for (int round = 0; round < 10; round++) {
        spec_adapt_verified(&a, 1, 0, at);
        a.accept = 0.95; /* keep the cost model willing: only the rest decides */
        assert_int_equal(spec_adapt_len(&a, at + rest - 1, 0, 16, 0.05), 0);
        assert_int_equal(spec_adapt_len(&a, at + rest - 1, 3, 16, 0.05), 3);
        assert_true(spec_adapt_len(&a, at + rest, 0, 16, 0.05) > 0);
        at += rest;
        rest = rest * 2 < SPEC_REST_MAX ? rest * 2 : SPEC_REST_MAX;
    }
    assert_int_equal(rest, SPEC_REST_MAX);
    spec_adapt_verified(&a, 4, 1, at); /* a kept draft: no rest, and the next rejection rests the least */
    assert_true(spec_adapt_len(&a, at, 0, 16, 0.05) > 0);
    spec_adapt_verified(&a, 4, 0, at + 2);
    a.accept = 0.95;
    assert_int_equal(spec_adapt_len(&a, at + 2 + SPEC_REST_MIN - 1, 0, 16, 0.05), 0);
    assert_true(spec_adapt_len(&a, at + 2 + SPEC_REST_MIN, 0, 16, 0.05) > 0);
    spec_adapt_verified(&a, 0, 0, at + 50); /* no drafts: nothing learnt */
    assert_true(spec_adapt_len(&a, at + 50, 0, 16, 0.05) > 0);
    /* SPEC_REST_STREAK shadow hits in a row end a rest early; a miss starts the count again */
    at += 60;
    spec_adapt_verified(&a, 2, 0, at);
    spec_adapt_verified(&a, 2, 0, at + SPEC_REST_MIN);
    a.accept = 0.95;
    spec_adapt_observe(&a, 1, 1);
    spec_adapt_observe(&a, 1, 0);
    spec_adapt_observe(&a, 1, 1);
    assert_int_equal(spec_adapt_len(&a, at + SPEC_REST_MIN + 3, 0, 16, 0.05), 0);
    for (int i = 1; i < SPEC_REST_STREAK; i++)
        spec_adapt_observe(&a, 1, 1);
    assert_true(spec_adapt_len(&a, at + SPEC_REST_MIN + 3 + SPEC_REST_STREAK, 0, 16, 0.05) > 0);
    /* a run of SPEC_RUN_MIN accepted tokens plans with (s + 1) / (s + 2) when the EMA is lower */
    spec_adapt_init(&a, SPEC_NGRAM);
    spec_adapt_observe(&a, 1, 1);
    a.accept = 0.5;
    int32_t before = spec_adapt_len(&a, 10, 0, 16, 0.1);
    spec_adapt_observe(&a, SPEC_RUN_MIN, SPEC_RUN_MIN);
    a.accept = 0.5;
    int32_t in_run = spec_adapt_len(&a, 10, 0, 16, 0.1);
    assert_true(in_run > before);
    struct spec_adapt at_run = {.accept = 1.0 - 1.0 / (SPEC_RUN_MIN + 3), .seen_accept = true};
    assert_int_equal(in_run, spec_adapt_len(&at_run, 10, 0, 16, 0.1));
    spec_adapt_observe(&a, 2, 1); /* the run ends */
    a.accept = 0.5;
    assert_int_equal(spec_adapt_len(&a, 10, 0, 16, 0.1), before);
    /* a draft model drafts at once and never rests (its allowance bounds its cost) */
    spec_adapt_init(&a, SPEC_DRAFT);
    assert_true(spec_adapt_len(&a, 10, 0, 16, 0.05) > 0);
    spec_adapt_verified(&a, 2, 0, 10);
    assert_true(spec_adapt_len(&a, 10, 0, 16, 0.05) > 0);
}

/* ---- the rejection sampler ------------------------------------------------------ */

enum { V = 8, TRIALS = 40000 };
static const float LOGITS[V] = {2.0f, 1.5f, 1.0f, 0.5f, 0.0f, -0.5f, -1.0f, 0.3f};

/* The exact distribution of plain sampling: softmax(logits / temp) over the
 * top_k best (0: all). */
static void exact_dist(float temp, int top_k, double *p)
{
    int32_t order[V];
    for (int i = 0; i < V; i++)
        order[i] = i;
    for (int i = 0; i < V; i++)
        for (int j = i + 1; j < V; j++)
            if (LOGITS[order[j]] > LOGITS[order[i]]) {
                int32_t t = order[i];
                order[i] = order[j];
                order[j] = t;
            }
    int keep = top_k > 0 ? top_k : V;
    double z = 0;
    for (int i = 0; i < V; i++)
        p[i] = 0;
    for (int i = 0; i < keep; i++)
        z += p[order[i]] = exp((double)LOGITS[order[i]] / temp);
    for (int i = 0; i < V; i++)
        p[i] /= z;
}

static double total_variation(const double *a, const double *b)
{
    double tv = 0;
    for (int i = 0; i < V; i++)
        tv += fabs(a[i] - b[i]);
    return tv / 2;
}

/* The defaults with only temperature and top-k shaping (top-p 1, min-p 0). */
static struct sample_params temp_top_k(float temp, int top_k)
{
    struct sample_params p;
    sample_params_default(&p);
    p.temp = temp;
    p.top_k = top_k;
    p.top_p = 1.0f;
    p.min_p = 0.0f;
    return p;
}

static struct sampler *make(float temp, int top_k, uint64_t seed)
{
    struct sample_params p = temp_top_k(temp, top_k);
    p.seed = seed;
    struct sampler *s = NULL;
    assert_int_equal(sample_create(&p, V, &s), KS_OK);
    return s;
}

/* Histograms of sample_verify with draft x and of sample_next; the verify
 * acceptance rate into *rate. */
static void histograms(float temp, int top_k, int32_t x, double *verify, double *plain, double *rate)
{
    struct sampler *sv = make(temp, top_k, 1234), *sp = make(temp, top_k, 1234);
    int n_acc = 0;
    for (int i = 0; i < V; i++)
        verify[i] = plain[i] = 0;
    for (int t = 0; t < TRIALS; t++) {
        struct sample_result r;
        bool acc = false;
        assert_int_equal(sample_verify(sv, LOGITS, NULL, 0, x, &r, &acc), KS_OK);
        assert_true(r.token >= 0 && r.token < V);
        assert_true(acc == (r.token == x)); /* a rejection never returns the draft */
        n_acc += acc;
        verify[r.token] += 1.0 / TRIALS;
        assert_int_equal(sample_next(sp, LOGITS, NULL, 0, &r), KS_OK);
        plain[r.token] += 1.0 / TRIALS;
    }
    *rate = (double)n_acc / TRIALS;
    sample_free(sv);
    sample_free(sp);
}

/* What a wrong rule would give: keeping the draft with probability p(x) but
 * drawing the replacement from p itself (x not removed). */
static void wrong_rule(const double *p, int32_t x, double *out)
{
    for (int i = 0; i < V; i++)
        out[i] = (1 - p[x]) * p[i] + (i == x ? p[x] : 0);
}

static void check_case(float temp, int top_k, int32_t x)
{
    static const double BOUND = 0.015; /* sampling noise at 40000 draws is about 0.005 */
    double p[V], verify[V], plain[V], wrong[V], rate;
    exact_dist(temp, top_k, p);
    histograms(temp, top_k, x, verify, plain, &rate);
    print_message("temp %.2f top_k %d draft %d: p(draft) %.4f, accepted %.4f, TV verify %.4f, plain %.4f\n",
                  (double)temp, top_k, (int)x, p[x], rate, total_variation(verify, p), total_variation(plain, p));
    assert_true(total_variation(plain, p) < BOUND);
    assert_true(total_variation(verify, p) < BOUND);
    assert_true(fabs(rate - p[x]) < BOUND);
    /* the bound has the power to see a wrong rule (here 3x over it), or
     * accepting every draft */
    wrong_rule(p, x, wrong);
    if (p[x] > 0.05)
        assert_true(total_variation(wrong, p) > 3 * BOUND);
    assert_true(1.0 - p[x] > 3 * BOUND);
}

static void test_verify_keeps_the_distribution(void **state)
{
    (void)state;
    check_case(1.0f, 0, 1);  /* the whole vocabulary */
    check_case(1.0f, 0, 6);  /* an unlikely draft */
    check_case(0.7f, 4, 2);  /* truncated: top-k */
    check_case(0.7f, 4, 6);  /* a draft outside the top-k: p = 0, never kept */
}

static void test_verify_greedy_is_argmax(void **state)
{
    (void)state;
    struct sampler *s = make(0.0f, 0, 1);
    struct sample_result r;
    bool acc = true;
    assert_int_equal(sample_verify(s, LOGITS, NULL, 0, 3, &r, &acc), KS_OK);
    assert_false(acc);
    assert_int_equal(r.token, 0);
    assert_int_equal(sample_verify(s, LOGITS, NULL, 0, 0, &r, &acc), KS_OK);
    assert_true(acc);
    assert_int_equal(r.token, 0);
    assert_int_equal(sample_verify(s, LOGITS, NULL, 0, V, &r, &acc), KS_ERR_INVALID_ARG);
    assert_int_equal(sample_verify(s, LOGITS, NULL, 0, -1, &r, &acc), KS_ERR_INVALID_ARG);
    sample_free(s);
}

/* ---- speculative sampling: a draft drawn from a draft model's q ---------------- */

/* The draft model's logits: close to LOGITS, not equal (its best token is 1, not 0). */
static const float DRAFT_LOGITS[V] = {1.2f, 1.8f, 0.4f, 0.9f, -0.2f, 0.6f, -1.5f, 0.1f};

static double unit_draw(uint64_t *rng)
{
    return (double)(ks_rng_next(rng) >> 11) * (1.0 / 9007199254740992.0);
}

static void dense_q(const struct sample_proposal *q, double *out)
{
    for (int i = 0; i < V; i++)
        out[i] = 0;
    for (int32_t j = 0; j < q->n; j++)
        out[q->tokens[j]] = q->probs[j];
}

/* What the one-hot rule gives for a draft drawn from q: keep x with
 * min(1, p(x) / q(x)) but replace a rejected x by a draw from p without x
 * (the residual max(0, p - q) not used). */
static void one_hot_replacement(const double *p, const double *q, double *out)
{
    for (int y = 0; y < V; y++)
        out[y] = 0;
    for (int x = 0; x < V; x++) {
        if (q[x] <= 0)
            continue;
        double keep = p[x] >= q[x] ? 1.0 : p[x] / q[x];
        out[x] += q[x] * keep;
        for (int y = 0; y < V && p[x] < 1; y++)
            if (y != x)
                out[y] += q[x] * (1 - keep) * p[y] / (1 - p[x]);
    }
}

/* Draws x ~ q (the test's own stream, as a drafter's), verifies it with a
 * sampler of temp / top_k (min_keep 2 runs the general chain), and checks
 * the histogram against the exact p, the acceptance against sum min(p, q),
 * and that the bound sees the wrong rules. */
static void check_proposal(float temp, int top_k, bool chain, const struct sample_proposal *q)
{
    static const double BOUND = 0.015;
    double p[V], dq[V], got[V] = {0}, wrong[V];
    exact_dist(temp, top_k, p);
    dense_q(q, dq);
    struct sample_params sp = temp_top_k(temp, top_k);
    sp.min_keep = chain ? 2 : 0;
    sp.seed = 99;
    struct sampler *s = NULL;
    assert_int_equal(sample_create(&sp, V, &s), KS_OK);
    uint64_t rng = 0x9E3779B97F4A7C15ull;
    int n_acc = 0;
    for (int t = 0; t < TRIALS; t++) {
        int32_t x = sample_proposal_draw(q, unit_draw(&rng));
        struct sample_result r;
        bool acc = false;
        assert_int_equal(sample_verify_proposal(s, LOGITS, NULL, 0, q, x, &r, &acc), KS_OK);
        assert_true(r.token >= 0 && r.token < V);
        assert_true(!acc || r.token == x);
        n_acc += acc;
        got[r.token] += 1.0 / TRIALS;
    }
    sample_free(s);
    double overlap = 0;
    for (int i = 0; i < V; i++)
        overlap += p[i] < dq[i] ? p[i] : dq[i];
    one_hot_replacement(p, dq, wrong);
    double rate = (double)n_acc / TRIALS;
    print_message("temp %.2f top_k %d %s, q over %d tokens: accepted %.4f (sum min(p, q) %.4f), TV %.4f; "
                  "TV of q %.4f, of the one-hot replacement %.4f\n", (double)temp, top_k, chain ? "chain" : "fast",
                  (int)q->n, rate, overlap, total_variation(got, p), total_variation(dq, p),
                  total_variation(wrong, p));
    assert_true(total_variation(got, p) < BOUND);
    assert_true(fabs(rate - overlap) < BOUND);
    assert_true(total_variation(dq, p) > 3 * BOUND);    /* accepting every draft would be seen */
    assert_true(total_variation(wrong, p) > 3 * BOUND); /* and so would the one-hot replacement */
}

static void make_q(float temp, int top_k, struct sample_proposal *q)
{
    struct sample_params dp = temp_top_k(temp, top_k);
    float p_top;
    assert_int_equal(sample_proposal_make(&dp, DRAFT_LOGITS, V, q, &p_top), KS_OK);
}

static void test_verify_proposal_keeps_the_distribution(void **state)
{
    (void)state;
    struct sample_proposal q;
    make_q(1.0f, 0, &q); /* q over the whole vocabulary */
    check_proposal(1.0f, 0, false, &q);
    check_proposal(1.0f, 0, true, &q);
    make_q(0.7f, 0, &q); /* p truncated to its top 4: q has mass where p has none */
    check_proposal(0.7f, 4, false, &q);
    check_proposal(0.7f, 4, true, &q);
    make_q(0.7f, 2, &q); /* a narrow q: most of the residual is outside its support */
    check_proposal(0.7f, 0, false, &q);
    check_proposal(0.7f, 0, true, &q);
}

/* A one-hot q is sample_verify: the same tokens and decisions from the same seed. */
static void test_verify_proposal_one_hot_is_verify(void **state)
{
    (void)state;
    struct sampler *a = make(0.8f, 5, 7), *b = make(0.8f, 5, 7);
    for (int t = 0; t < 200; t++) {
        int32_t x = t % V;
        struct sample_proposal q = {.n = 1, .tokens = {x}, .probs = {1.0f}};
        struct sample_result ra, rb;
        bool acc_a, acc_b;
        assert_int_equal(sample_verify(a, LOGITS, NULL, 0, x, &ra, &acc_a), KS_OK);
        assert_int_equal(sample_verify_proposal(b, LOGITS, NULL, 0, &q, x, &rb, &acc_b), KS_OK);
        assert_int_equal(ra.token, rb.token);
        assert_int_equal(acc_a, acc_b);
    }
    /* bad proposals are refused */
    struct sample_result r;
    bool acc;
    struct sample_proposal q = {.n = 2, .tokens = {1, 2}, .probs = {0.5f, 0.5f}};
    assert_int_equal(sample_verify_proposal(a, LOGITS, NULL, 0, &q, 3, &r, &acc), KS_ERR_INVALID_ARG);
    q.tokens[1] = V;
    assert_int_equal(sample_verify_proposal(a, LOGITS, NULL, 0, &q, 1, &r, &acc), KS_ERR_INVALID_ARG);
    q.n = 0;
    assert_int_equal(sample_verify_proposal(a, LOGITS, NULL, 0, &q, 1, &r, &acc), KS_ERR_INVALID_ARG);
    sample_free(a);
    sample_free(b);
}

static void test_proposal_make(void **state)
{
    (void)state;
    struct sample_params dp;
    sample_params_default(&dp);
    struct sample_proposal q;
    float p_top;
    dp.temp = 0.0f; /* greedy: one-hot at the argmax */
    assert_int_equal(sample_proposal_make(&dp, DRAFT_LOGITS, V, &q, &p_top), KS_OK);
    assert_int_equal(q.n, 1);
    assert_int_equal(q.tokens[0], 1);
    double z = 0;
    for (int i = 0; i < V; i++)
        z += exp((double)DRAFT_LOGITS[i] - 1.8);
    assert_true(fabs(p_top - 1.0 / z) < 1e-6);
    dp.temp = 0.5f; /* top_k 3: softmax(logits / temp) over the best 3, best first */
    dp.top_k = 3;
    dp.top_p = 1.0f;
    dp.min_p = 0.0f;
    assert_int_equal(sample_proposal_make(&dp, DRAFT_LOGITS, V, &q, &p_top), KS_OK);
    assert_int_equal(q.n, 3);
    const int32_t best[3] = {1, 0, 3};
    double w[3], sum = 0;
    for (int j = 0; j < 3; j++)
        sum += w[j] = exp((double)DRAFT_LOGITS[best[j]] / 0.5);
    for (int j = 0; j < 3; j++) {
        assert_int_equal(q.tokens[j], best[j]);
        assert_true(fabs(q.probs[j] - w[j] / sum) < 1e-6);
    }
    dp.top_k = 0; /* min_p 0.5: tokens within ln 2 of the best (untempered) */
    dp.min_p = 0.5f;
    assert_int_equal(sample_proposal_make(&dp, DRAFT_LOGITS, V, &q, &p_top), KS_OK);
    assert_int_equal(q.n, 2);
    dp.min_p = 0.0f; /* top_p 0.5 over the whole vocabulary: the best two reach it */
    dp.top_p = 0.5f;
    assert_int_equal(sample_proposal_make(&dp, DRAFT_LOGITS, V, &q, &p_top), KS_OK);
    assert_int_equal(q.n, 2);
    float bad[V] = {0};
    bad[2] = NAN;
    assert_int_equal(sample_proposal_make(&dp, bad, V, &q, &p_top), KS_ERR_RANGE);
    for (int j = 0; j < 200; j++) { /* draws follow the cumulative distribution */
        double u = j / 200.0, cum = 0;
        int32_t want = q.tokens[q.n - 1];
        for (int32_t i = 0; i < q.n; i++)
            if (u < (cum += q.probs[i])) {
                want = q.tokens[i];
                break;
            }
        assert_int_equal(sample_proposal_draw(&q, u), want);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ngram_longest_most_recent_match),
        cmocka_unit_test(test_ngram_repetition_drafts_the_cycle),
        cmocka_unit_test(test_ngram_matches_the_naive_lookup),
        cmocka_unit_test(test_pool_drafts_across_requests),
        cmocka_unit_test(test_pool_keys_are_checked),
        cmocka_unit_test(test_pool_bad_sizes),
        cmocka_unit_test(test_can_pay),
        cmocka_unit_test(test_cost_learns_and_recovers),
        cmocka_unit_test(test_adapt_follows_acceptance),
        cmocka_unit_test(test_adapt_rests_after_rejections),
        cmocka_unit_test(test_verify_keeps_the_distribution),
        cmocka_unit_test(test_verify_greedy_is_argmax),
        cmocka_unit_test(test_verify_proposal_keeps_the_distribution),
        cmocka_unit_test(test_verify_proposal_one_hot_is_verify),
        cmocka_unit_test(test_proposal_make),
        cmocka_unit_test(test_draft_allowance),
    };
    return ks_run_tests(tests, NULL, NULL);
}
