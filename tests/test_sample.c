/* Sampler tests: every truncation and penalty against a naive reference
 * written here with full sorts and double-precision softmax. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "sample/sample.h"
#include "sample/sample_internal.h"

/* ---- helpers ------------------------------------------------------------- */

static uint64_t lcg_state = 12345;

static float frand(void) /* uniform in [0, 1) */
{
    lcg_state = lcg_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((lcg_state >> 40) * 0x1.0p-24);
}

static float *random_logits(int32_t n, float scale)
{
    float *x = malloc((size_t)n * sizeof *x);
    assert_non_null(x);
    for (int32_t i = 0; i < n; i++)
        x[i] = (frand() * 2.0f - 1.0f) * scale;
    return x;
}

static struct sampler *make(const struct sample_params *p, int32_t n_vocab)
{
    struct sampler *s = NULL;
    assert_int_equal(sample_create(p, n_vocab, &s), KS_OK);
    return s;
}

static int32_t next(struct sampler *s, const float *logits)
{
    struct sample_result r;
    assert_int_equal(sample_next(s, logits, NULL, 0, &r), KS_OK);
    return r.token;
}

static int32_t naive_argmax(const float *x, int32_t n)
{
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[best])
            best = i;
    return best;
}

static void naive_log_softmax(const float *x, int32_t n, double *out)
{
    double m = -INFINITY, sum = 0.0;
    for (int32_t i = 0; i < n; i++)
        m = x[i] > m ? x[i] : m;
    for (int32_t i = 0; i < n; i++)
        sum += exp((double)x[i] - m);
    for (int32_t i = 0; i < n; i++)
        out[i] = (double)x[i] - m - log(sum);
}

static const float *sort_src;
static int cmp_desc(const void *a, const void *b)
{
    int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    if (sort_src[i] != sort_src[j])
        return sort_src[i] > sort_src[j] ? -1 : 1;
    return i < j ? -1 : 1;
}

/* The kept set of top-k, top-p, min-p, as indices best first; temperature
 * comes after them (llama.cpp's order), so they see untempered logits. */
static int32_t naive_kept(const float *x, int32_t n, const struct sample_params *p, int32_t *order)
{
    for (int32_t i = 0; i < n; i++)
        order[i] = i;
    sort_src = x;
    qsort(order, (size_t)n, sizeof *order, cmp_desc);
    int32_t k = p->top_k > 0 && p->top_k < n ? p->top_k : n;
    double z = 0.0, m = x[order[0]];
    for (int32_t i = 0; i < k; i++)
        z += exp((double)x[order[i]] - m);
    if (p->top_p < 1.0f) {
        double cum = 0.0;
        for (int32_t i = 0; i < k; i++) {
            cum += exp((double)x[order[i]] - m) / z;
            if (cum >= p->top_p) {
                k = i + 1;
                break;
            }
        }
    }
    if (p->min_p > 0.0f) {
        int32_t kept = 0;
        for (int32_t i = 0; i < k; i++)
            if (exp((double)x[order[i]] - m) >= p->min_p)
                kept++;
        k = kept;
    }
    return k;
}

static struct sample_params plain(float temp)
{
    struct sample_params p;
    sample_params_default(&p);
    p.temp = temp;
    p.top_k = 0;
    p.top_p = 1.0f;
    p.min_p = 0.0f;
    return p;
}

/* ---- tests --------------------------------------------------------------- */

static void test_exp_accuracy(void **state)
{
    (void)state;
    for (float x = -87.0f; x <= 0.0f; x += 0.01f) {
        double ref = exp((double)x);
        assert_true(fabs(sample_expf(x) - ref) <= 4e-7 * ref);
    }
    assert_true(sample_expf(-INFINITY) == 0.0f);
    assert_true(sample_expf(-100.0f) == 0.0f);
}

static void test_greedy_is_argmax(void **state)
{
    (void)state;
    struct sample_params p = plain(0.0f);
    p.top_k = 40; /* ignored when greedy */
    int32_t n = 5000;
    struct sampler *s = make(&p, n);
    for (int rep = 0; rep < 20; rep++) {
        float *x = random_logits(n, 10.0f);
        assert_int_equal(next(s, x), naive_argmax(x, n));
        free(x);
    }
    float ties[6] = {1.0f, 3.0f, 2.0f, 3.0f, -INFINITY, 3.0f};
    sample_free(s);
    s = make(&p, 6);
    assert_int_equal(next(s, ties), 1);
    sample_free(s);
}

/* sample_greedy_token is sample_next's token when the sampler is plain
 * greedy (ties: the first), and refused when something changes the logits. */
static void test_greedy_token_fast_path(void **state)
{
    (void)state;
    struct sample_params p = plain(0.0f);
    int32_t n = 4096, token;
    struct sampler *s = make(&p, n);
    assert_true(sample_is_plain_greedy(s));
    for (int rep = 0; rep < 20; rep++) {
        float *x = random_logits(n, 10.0f);
        assert_int_equal(sample_greedy_token(s, x, &token), KS_OK);
        assert_int_equal(token, next(s, x));
        free(x);
    }
    sample_free(s);
    float ties[6] = {1.0f, 3.0f, 2.0f, 3.0f, -INFINITY, 3.0f}, bad[3] = {0.0f, NAN, 1.0f};
    s = make(&p, 6);
    assert_int_equal(sample_greedy_token(s, ties, &token), KS_OK);
    assert_int_equal(token, 1);
    sample_free(s);
    s = make(&p, 3);
    assert_int_equal(sample_greedy_token(s, bad, &token), KS_ERR_RANGE);
    sample_free(s);
    p.repeat_penalty = 1.5f; /* penalties change the logits: not plain */
    s = make(&p, 6);
    assert_false(sample_is_plain_greedy(s));
    assert_int_equal(sample_greedy_token(s, ties, &token), KS_ERR_INVALID_ARG);
    sample_free(s);
    p = plain(0.8f);
    s = make(&p, 6);
    assert_false(sample_is_plain_greedy(s));
    sample_free(s);
}

static void test_seed_determinism(void **state)
{
    (void)state;
    int32_t n = 3000;
    float *x = random_logits(n, 3.0f);
    struct sample_params p;
    sample_params_default(&p);
    p.seed = 42;
    struct sampler *a = make(&p, n), *b = make(&p, n);
    p.seed = 43;
    struct sampler *c = make(&p, n);
    int differ = 0;
    for (int i = 0; i < 200; i++) {
        int32_t ta = next(a, x), tb = next(b, x), tc = next(c, x);
        assert_int_equal(ta, tb);
        differ += ta != tc;
    }
    assert_true(differ > 0);
    sample_free(a);
    sample_free(b);
    sample_free(c);
    free(x);
}

static void test_top_k_one_is_greedy(void **state)
{
    (void)state;
    int32_t n = 151669;
    float *x = random_logits(n, 5.0f);
    const float temps[] = {0.1f, 1.0f, 5.0f};
    for (size_t t = 0; t < 3; t++) {
        struct sample_params p;
        sample_params_default(&p);
        p.top_k = 1;
        p.temp = temps[t];
        struct sampler *s = make(&p, n);
        for (int i = 0; i < 10; i++)
            assert_int_equal(next(s, x), naive_argmax(x, n));
        sample_free(s);
    }
    free(x);
}

/* Draw N times and check which tokens appear. */
static void counts_of(const struct sample_params *p, const float *x, int32_t n, int draws, int *counts)
{
    struct sampler *s = make(p, n);
    memset(counts, 0, (size_t)n * sizeof *counts);
    for (int i = 0; i < draws; i++)
        counts[next(s, x)]++;
    sample_free(s);
}

static void set_log_probs(float *x, const double *probs, int n)
{
    for (int i = 0; i < n; i++)
        x[i] = (float)log(probs[i]);
}

static void test_top_p_hand_made(void **state)
{
    (void)state;
    const double probs[5] = {0.5, 0.3, 0.1, 0.06, 0.04};
    float x[5];
    int counts[5];
    set_log_probs(x, probs, 5);
    struct sample_params p = plain(1.0f);

    p.top_p = 0.7f; /* 0.5 < 0.7 <= 0.8: tokens 0 and 1 */
    counts_of(&p, x, 5, 4000, counts);
    assert_true(counts[0] > 0 && counts[1] > 0);
    assert_int_equal(counts[2] + counts[3] + counts[4], 0);
    assert_true(fabs(counts[0] / 4000.0 - 0.625) < 0.03);

    p.top_p = 0.5f; /* the first token alone reaches 0.5 */
    counts_of(&p, x, 5, 500, counts);
    assert_int_equal(counts[0], 500);

    p.top_p = 0.85f; /* 0.8 < 0.85 <= 0.9: three tokens */
    counts_of(&p, x, 5, 4000, counts);
    assert_true(counts[2] > 0);
    assert_int_equal(counts[3] + counts[4], 0);

    p.top_p = 0.0f; /* keeps at least one */
    counts_of(&p, x, 5, 100, counts);
    assert_int_equal(counts[0], 100);
}

static void test_min_p_hand_made(void **state)
{
    (void)state;
    const double probs[5] = {0.05, 0.5, 0.3, 0.12, 0.03};
    float x[5];
    int counts[5];
    set_log_probs(x, probs, 5);
    struct sample_params p = plain(1.0f);

    p.min_p = 0.2f; /* threshold 0.1: tokens 1, 2, 3 */
    counts_of(&p, x, 5, 4000, counts);
    assert_true(counts[1] > 0 && counts[2] > 0 && counts[3] > 0);
    assert_int_equal(counts[0] + counts[4], 0);

    p.min_p = 0.61f; /* threshold 0.305: token 1 only */
    counts_of(&p, x, 5, 200, counts);
    assert_int_equal(counts[1], 200);

    /* temperature comes after min-p (llama.cpp's order): temperature 2 does
     * not flatten the cut, which stays at 0.3 * 0.5 = 0.15 */
    p.temp = 2.0f;
    p.min_p = 0.3f; /* keeps 0.5 and 0.3, drops 0.12, 0.05, 0.03 */
    counts_of(&p, x, 5, 4000, counts);
    assert_true(counts[1] > 0 && counts[2] > 0);
    assert_int_equal(counts[0] + counts[3] + counts[4], 0);
}

/* Pearson chi-square of observed draws against the expected distribution. */
static double chi_square(const int *counts, const double *expect, int n, int draws, int *dof)
{
    double chi = 0.0;
    *dof = -1;
    for (int i = 0; i < n; i++) {
        if (expect[i] == 0.0) {
            assert_int_equal(counts[i], 0);
            continue;
        }
        double e = expect[i] * draws;
        chi += (counts[i] - e) * (counts[i] - e) / e;
        (*dof)++;
    }
    return chi;
}

static void check_frequencies(struct sample_params p, const float *x, int n)
{
    int32_t order[16];
    int32_t kept = naive_kept(x, n, &p, order);
    double expect[16] = {0}, z = 0.0, m = x[order[0]];
    for (int32_t i = 0; i < kept; i++)
        z += exp((x[order[i]] - m) / p.temp);
    for (int32_t i = 0; i < kept; i++)
        expect[order[i]] = exp((x[order[i]] - m) / p.temp) / z;
    int counts[16];
    const int draws = 40000;
    counts_of(&p, x, n, draws, counts);
    int dof;
    double chi = chi_square(counts, expect, n, draws, &dof);
    /* 99.99th percentile of chi-square with <= 15 dof is below 45 */
    assert_true(chi < 45.0);
}

static void test_frequencies_match_softmax(void **state)
{
    (void)state;
    const float x[10] = {1.0f, 0.5f, -0.3f, 2.0f, 0.0f, 1.7f, -2.0f, 0.9f, 1.1f, -INFINITY};
    struct sample_params p = plain(1.0f);
    check_frequencies(p, x, 10);
    p.temp = 0.6f;
    check_frequencies(p, x, 10);
    p.top_k = 4;
    check_frequencies(p, x, 10);
    p.top_k = 0;
    p.top_p = 0.8f;
    check_frequencies(p, x, 10);
    p.min_p = 0.25f;
    check_frequencies(p, x, 10);
    p.top_k = 3;
    p.temp = 1.5f;
    check_frequencies(p, x, 10);
}

/* Every draw on a large random vocabulary lands in the naive kept set. */
static void test_large_vocab_truncation(void **state)
{
    (void)state;
    int32_t n = 128256;
    float *x = random_logits(n, 8.0f);
    int32_t *order = malloc((size_t)n * sizeof *order);
    char *in_set = malloc((size_t)n);
    struct sample_params cases[4];
    for (int c = 0; c < 4; c++)
        cases[c] = plain(1.0f);
    cases[0].top_k = 40;
    cases[1].top_p = 0.9f;
    cases[2].min_p = 0.05f;
    cases[3].top_k = 5000;
    cases[3].top_p = 0.5f;
    cases[3].min_p = 0.001f;
    for (int c = 0; c < 4; c++) {
        int32_t kept = naive_kept(x, n, &cases[c], order);
        memset(in_set, 0, (size_t)n);
        for (int32_t i = 0; i < kept; i++)
            in_set[order[i]] = 1;
        struct sampler *s = make(&cases[c], n);
        for (int i = 0; i < 50; i++)
            assert_true(in_set[next(s, x)]);
        sample_free(s);
    }
    free(in_set);
    free(order);
    free(x);
}

/* The sampler's logprobs are the log-softmax of the penalized logits. */
static void check_penalized(const struct sample_result *r, const float *want, int n)
{
    double lsm[16];
    naive_log_softmax(want, n, lsm);
    assert_int_equal(r->n_top, n);
    for (int i = 0; i < n; i++)
        assert_true(fabs(r->top[i].logprob - lsm[r->top[i].token]) < 1e-5);
}

static void test_penalties(void **state)
{
    (void)state;
    const int n = 8;
    const float x[8] = {1.0f, -1.0f, 2.0f, 0.5f, -0.5f, 3.0f, 0.0f, 1.5f};
    const int32_t hist[6] = {0, 2, 2, 5, 1, 5};
    const float rep = 1.5f, pres = 0.25f, freq = 0.25f;
    struct sample_params p = plain(0.0f);
    p.repeat_penalty = rep;
    p.presence_penalty = pres;
    p.frequency_penalty = freq;
    p.repeat_last_n = 4; /* window {2, 5, 1, 5} */
    p.n_logprobs = n;
    struct sampler *s = make(&p, n);
    struct sample_result r;
    assert_int_equal(sample_next(s, x, hist, 6, &r), KS_OK);
    float want[8];
    memcpy(want, x, sizeof want);
    want[1] = -1.0f * rep - 1 * freq - pres;
    want[2] = 2.0f / rep - 1 * freq - pres;
    want[5] = 3.0f / rep - 2 * freq - pres;
    check_penalized(&r, want, n);
    assert_int_equal(r.token, 7); /* 5 drops to 1.25, below 7's 1.5 */

    /* the penalty counts are cleared between calls: same input, same output */
    struct sample_result r2;
    assert_int_equal(sample_next(s, x, hist, 6, &r2), KS_OK);
    assert_memory_equal(&r, &r2, sizeof r);

    /* repeat_last_n -1: the whole history {0, 2, 2, 5, 1, 5} */
    sample_free(s);
    p.repeat_last_n = -1;
    s = make(&p, n);
    assert_int_equal(sample_next(s, x, hist, 6, &r), KS_OK);
    want[0] = 1.0f / rep - 1 * freq - pres;
    want[2] = 2.0f / rep - 2 * freq - pres;
    check_penalized(&r, want, n);

    /* repeat_last_n 0 disables penalties */
    sample_free(s);
    p.repeat_last_n = 0;
    s = make(&p, n);
    assert_int_equal(sample_next(s, x, hist, 6, &r), KS_OK);
    check_penalized(&r, x, n);
    assert_int_equal(r.token, 5);
    sample_free(s);
}

static void test_logprobs(void **state)
{
    (void)state;
    int32_t n = 50000;
    float *x = random_logits(n, 12.0f);
    x[17] = -INFINITY;
    double *lsm = malloc((size_t)n * sizeof *lsm);
    naive_log_softmax(x, n, lsm);
    struct sample_params p;
    sample_params_default(&p);
    p.n_logprobs = SAMPLE_MAX_LOGPROBS;
    struct sampler *s = make(&p, n);
    int32_t *order = malloc((size_t)n * sizeof *order);
    for (int32_t i = 0; i < n; i++)
        order[i] = i;
    sort_src = x;
    qsort(order, (size_t)n, sizeof *order, cmp_desc);
    for (int rep = 0; rep < 5; rep++) {
        struct sample_result r;
        assert_int_equal(sample_next(s, x, NULL, 0, &r), KS_OK);
        assert_true(fabs(r.logprob - lsm[r.token]) < 1e-4);
        assert_int_equal(r.n_top, SAMPLE_MAX_LOGPROBS);
        for (int i = 0; i < SAMPLE_MAX_LOGPROBS; i++) {
            assert_int_equal(r.top[i].token, order[i]);
            assert_true(fabs(r.top[i].logprob - lsm[order[i]]) < 1e-4);
        }
    }
    sample_free(s);

    /* a small vocabulary: all of it, and the probabilities sum to 1 */
    const float y[5] = {0.1f, 2.0f, -1.0f, 0.7f, 0.7f};
    p.n_logprobs = 5;
    p.temp = 0.0f;
    s = make(&p, 5);
    struct sample_result r;
    assert_int_equal(sample_next(s, y, NULL, 0, &r), KS_OK);
    double sum = 0.0;
    for (int i = 0; i < 5; i++)
        sum += exp(r.top[i].logprob);
    assert_true(fabs(sum - 1.0) < 1e-5);
    assert_int_equal(r.top[0].token, 1);
    assert_int_equal(r.top[1].token, 3); /* ties: lower id first */
    assert_int_equal(r.top[2].token, 4);
    assert_true(r.logprob == r.top[0].logprob);
    sample_free(s);
    free(order);
    free(lsm);
    free(x);
}

/* logit_bias: the draws and logprobs of biased logits equal those of the
 * same logits with the biases added by hand (the reference), a stochastic
 * sampler with the same seed included; -inf bans a token, repeated tokens'
 * biases add up, and the bias comes before the penalties (llama.cpp's order). */
static void test_logit_bias(void **state)
{
    (void)state;
    const int32_t n = 1000;
    float *x = random_logits(n, 4.0f);
    const struct sample_bias biases[] = {{3, 5.0f}, {10, -INFINITY}, {3, 1.5f}, {999, -2.0f}, {500, 0.25f}};
    float *want = malloc((size_t)n * sizeof *want);
    memcpy(want, x, (size_t)n * sizeof *want);
    for (size_t i = 0; i < sizeof biases / sizeof biases[0]; i++)
        want[biases[i].token] += biases[i].bias;
    for (int greedy = 0; greedy < 2; greedy++) {
        struct sample_params p;
        sample_params_default(&p);
        p.temp = greedy ? 0.0f : 1.0f;
        p.top_k = 0;
        p.top_p = 1.0f;
        p.min_p = 0.0f;
        p.n_logprobs = 5;
        p.seed = 99;
        struct sampler *ref = make(&p, n);
        p.biases = biases;
        p.n_biases = (int)(sizeof biases / sizeof biases[0]);
        struct sampler *s = make(&p, n);
        p.biases = NULL; /* the sampler keeps its own copy */
        for (int step = 0; step < 200; step++) {
            struct sample_result a, b;
            assert_int_equal(sample_next(s, x, NULL, 0, &a), KS_OK);
            assert_int_equal(sample_next(ref, want, NULL, 0, &b), KS_OK);
            assert_int_equal(a.token, b.token);
            assert_true(a.token != 10);
            assert_true(a.logprob == b.logprob);
            for (int i = 0; i < 5; i++)
                assert_int_equal(a.top[i].token, b.top[i].token);
        }
        sample_free(s);
        sample_free(ref);
    }
    /* the penalty applies to the biased logit: (1 + 2) / 2 = 1.5 < 1.9 (penalizing
     * first would give 1 / 2 + 2 = 2.5 and pick token 0) */
    const float y[3] = {1.0f, 1.9f, 0.0f};
    const int32_t hist[1] = {0};
    const struct sample_bias up[1] = {{0, 2.0f}};
    struct sample_params p = plain(0.0f);
    p.repeat_penalty = 2.0f;
    p.biases = up;
    p.n_biases = 1;
    struct sampler *s = make(&p, 3);
    struct sample_result r;
    assert_int_equal(sample_next(s, y, hist, 1, &r), KS_OK);
    assert_int_equal(r.token, 1);
    sample_free(s);
    /* bad biases are refused by name */
    const struct sample_bias bad[1] = {{3, 1.0f}};
    p.biases = bad;
    s = NULL;
    assert_int_equal(sample_create(&p, 3, &s), KS_ERR_INVALID_ARG);
    assert_non_null(strstr(ks_errmsg(), "logit bias"));
    free(want);
    free(x);
}

static void test_invalid(void **state)
{
    (void)state;
    struct sample_params p;
    struct sampler *s = NULL;
    sample_params_default(&p);
    p.top_p = 1.5f;
    assert_int_equal(sample_create(&p, 10, &s), KS_ERR_INVALID_ARG);
    assert_non_null(strstr(ks_errmsg(), "top_p"));
    sample_params_default(&p);
    p.n_logprobs = 30;
    assert_int_equal(sample_create(&p, 10, &s), KS_ERR_INVALID_ARG);
    assert_non_null(strstr(ks_errmsg(), "n_logprobs"));
    sample_params_default(&p);
    p.temp = NAN;
    assert_int_equal(sample_create(&p, 10, &s), KS_ERR_INVALID_ARG);
    sample_params_default(&p);
    assert_int_equal(sample_create(&p, 0, &s), KS_ERR_INVALID_ARG);
    assert_null(s);

    p.repeat_penalty = 1.1f;
    s = make(&p, 4);
    float x[4] = {0, 1, 2, 3};
    int32_t bad_hist[2] = {1, 4};
    struct sample_result r;
    assert_int_equal(sample_next(s, x, bad_hist, 2, &r), KS_ERR_RANGE);
    assert_int_equal(sample_next(s, x, NULL, 2, &r), KS_ERR_INVALID_ARG);
    x[2] = NAN;
    assert_int_equal(sample_next(s, x, NULL, 0, &r), KS_ERR_RANGE);
    float all_masked[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    assert_int_equal(sample_next(s, all_masked, NULL, 0, &r), KS_ERR_RANGE);
    sample_free(s);
    sample_free(NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_exp_accuracy),
        cmocka_unit_test(test_greedy_is_argmax),
        cmocka_unit_test(test_greedy_token_fast_path),
        cmocka_unit_test(test_seed_determinism),
        cmocka_unit_test(test_top_k_one_is_greedy),
        cmocka_unit_test(test_top_p_hand_made),
        cmocka_unit_test(test_min_p_hand_made),
        cmocka_unit_test(test_frequencies_match_softmax),
        cmocka_unit_test(test_large_vocab_truncation),
        cmocka_unit_test(test_penalties),
        cmocka_unit_test(test_logprobs),
        cmocka_unit_test(test_logit_bias),
        cmocka_unit_test(test_invalid),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
