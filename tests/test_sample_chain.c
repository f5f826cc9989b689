/* llama.cpp's other samplers (typical-p, min_keep, top-n-sigma, XTC,
 * dynamic temperature, DRY, mirostat, the stage order) against references
 * written here plainly: full sorts, double precision, quadratic scans, each
 * stage as llama.cpp's src/llama-sampler.cpp describes it. The sampler's
 * final distribution (before the draw) is compared token by token. */
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

#define V 12 /* the vocabulary of most cases */

/* ---- the reference: a plain candidate list ------------------------------- */

struct rc {
    int id;
    double logit, p;
};

struct rlist {
    struct rc c[64];
    int n;
};

static void r_init(struct rlist *l, const float *x, int n)
{
    l->n = n;
    for (int i = 0; i < n; i++)
        l->c[i] = (struct rc){i, x[i], 0};
}

static void r_sort(struct rlist *l) /* insertion sort, best first, ties by id */
{
    for (int i = 1; i < l->n; i++)
        for (int j = i; j > 0; j--) {
            struct rc *a = &l->c[j - 1], *b = &l->c[j];
            if (a->logit > b->logit || (a->logit == b->logit && a->id < b->id))
                break;
            struct rc t = *a;
            *a = *b;
            *b = t;
        }
}

static void r_softmax(struct rlist *l)
{
    r_sort(l);
    double sum = 0;
    for (int i = 0; i < l->n; i++)
        sum += l->c[i].p = isinf(l->c[i].logit) ? 0.0 : exp(l->c[i].logit - l->c[0].logit);
    for (int i = 0; i < l->n; i++)
        l->c[i].p /= sum;
}

static double r_entropy(const struct rlist *l)
{
    double h = 0;
    for (int i = 0; i < l->n; i++)
        if (l->c[i].p > 0)
            h -= l->c[i].p * log(l->c[i].p);
    return h;
}

/* p per token id (0: dropped) */
static void r_probs(struct rlist *l, double *p, int n_vocab)
{
    r_softmax(l);
    for (int i = 0; i < n_vocab; i++)
        p[i] = 0;
    for (int i = 0; i < l->n; i++)
        p[l->c[i].id] = l->c[i].p;
}

/* ---- the sampler's side ---------------------------------------------------- */

static void got_probs(const struct sample_params *p, const float *x, int n_vocab, const int32_t *hist, int n_hist,
                      double *out)
{
    struct sampler *s = NULL;
    assert_int_equal(sample_create(p, n_vocab, &s), KS_OK);
    const struct chain_cand *c;
    int32_t n;
    assert_int_equal(sample_final_distribution(s, x, hist, n_hist, &c, &n), KS_OK);
    for (int i = 0; i < n_vocab; i++)
        out[i] = 0;
    for (int32_t i = 0; i < n; i++)
        out[c[i].id] += c[i].p;
    sample_free(s);
}

static void assert_probs(const double *got, const double *want, int n)
{
    for (int i = 0; i < n; i++) {
        if (fabs(got[i] - want[i]) > 2e-6)
            print_error("token %d: got p %.7f, want %.7f\n", i, got[i], want[i]);
        assert_true(fabs(got[i] - want[i]) <= 2e-6);
    }
}

/* everything off but what a case turns on; a chain-only knob forces the general chain */
static struct sample_params base(void)
{
    struct sample_params p;
    sample_params_default(&p);
    p.temp = 1.0f;
    p.top_k = 0;
    p.top_p = 1.0f;
    p.min_p = 0.0f;
    p.min_keep = 2; /* the chain; min_keep 2 changes nothing where nothing truncates below 2 */
    return p;
}

static const float X[V] = {2.0f, 1.5f, 1.4f, 0.3f, -0.2f, 0.9f, -1.0f, 1.45f, 0.0f, -2.5f, 0.6f, -0.7f};

/* ---- typical-p --------------------------------------------------------------- */

static void r_typical(struct rlist *l, double typ, int min_keep)
{
    r_softmax(l);
    double h = r_entropy(l), score[64];
    int idx[64];
    for (int i = 0; i < l->n; i++) {
        score[i] = fabs(-log(l->c[i].p) - h);
        idx[i] = i;
    }
    for (int i = 1; i < l->n; i++) /* by score, stable */
        for (int j = i; j > 0 && score[idx[j - 1]] > score[idx[j]]; j--) {
            int t = idx[j];
            idx[j] = idx[j - 1];
            idx[j - 1] = t;
        }
    double cum = 0;
    int last = l->n;
    for (int i = 0; i < l->n; i++) {
        cum += l->c[idx[i]].p;
        if (cum > typ && (min_keep == 0 || i >= min_keep - 1)) {
            last = i + 1;
            break;
        }
    }
    struct rlist out = {.n = last};
    for (int i = 0; i < last; i++)
        out.c[i] = l->c[idx[i]];
    *l = out;
}

static void test_typical_p(void **state)
{
    (void)state;
    const float typs[] = {0.2f, 0.5f, 0.9f, 0.99f};
    for (int k = 0; k < 4; k++)
        for (int min_keep = 0; min_keep <= 6; min_keep += 3) {
            struct sample_params p = base();
            p.min_keep = min_keep;
            p.typical_p = typs[k];
            p.n_order = 2;
            p.order[0] = SAMPLE_STAGE_TYPICAL_P;
            p.order[1] = SAMPLE_STAGE_TEMPERATURE;
            struct rlist l;
            r_init(&l, X, V);
            r_typical(&l, typs[k], min_keep);
            double want[V], got[V];
            r_probs(&l, want, V);
            got_probs(&p, X, V, NULL, 0, got);
            assert_probs(got, want, V);
        }
}

/* ---- min_keep on top-p and min-p --------------------------------------------- */

static void test_min_keep(void **state)
{
    (void)state;
    for (int min_keep = 0; min_keep <= 5; min_keep++) {
        struct sample_params p = base();
        p.min_keep = min_keep;
        p.top_p = 0.2f; /* the best token alone has more */
        struct rlist l;
        r_init(&l, X, V);
        r_softmax(&l);
        int keep_p = min_keep > 1 ? min_keep : 1;
        l.n = keep_p;
        double want[V], got[V];
        r_probs(&l, want, V);
        /* temperature 1 twice changes nothing but keeps min_keep 0 and 1 on the chain */
        p.n_order = 3;
        p.order[0] = SAMPLE_STAGE_TOP_P;
        p.order[1] = SAMPLE_STAGE_TEMPERATURE;
        p.order[2] = SAMPLE_STAGE_TEMPERATURE;
        got_probs(&p, X, V, NULL, 0, got);
        assert_probs(got, want, V);

        p.top_p = 1.0f;
        p.min_p = 0.9f; /* only the best passes: exp(-0.45) < 0.9 */
        p.order[0] = SAMPLE_STAGE_MIN_P;
        r_init(&l, X, V);
        r_sort(&l);
        l.n = keep_p;
        r_probs(&l, want, V);
        got_probs(&p, X, V, NULL, 0, got);
        assert_probs(got, want, V);
    }
}

/* ---- top-n-sigma ----------------------------------------------------------------- */

static void test_top_n_sigma(void **state)
{
    (void)state;
    const float ns[] = {0.5f, 1.0f, 2.0f};
    float x[V];
    memcpy(x, X, sizeof x);
    x[9] = -INFINITY; /* left out of the mean and the deviation */
    for (int k = 0; k < 3; k++) {
        double mean = 0, var = 0, max = -INFINITY;
        int valid = 0;
        for (int i = 0; i < V; i++)
            if (!isinf(x[i])) {
                mean += x[i];
                max = x[i] > max ? x[i] : max;
                valid++;
            }
        mean /= valid;
        for (int i = 0; i < V; i++)
            if (!isinf(x[i]))
                var += (x[i] - mean) * (x[i] - mean);
        double sd = sqrt(var / valid);
        struct rlist l = {.n = 0};
        for (int i = 0; i < V; i++)
            l.c[l.n++] = (struct rc){i, x[i] < max - ns[k] * sd ? -INFINITY : x[i], 0};
        double want[V], got[V];
        r_probs(&l, want, V);
        struct sample_params p = base();
        p.top_n_sigma = ns[k];
        got_probs(&p, x, V, NULL, 0, got);
        assert_probs(got, want, V);
    }
    /* equal logits: a zero deviation keeps them all */
    float flat[4] = {1, 1, 1, 1};
    struct sample_params p = base();
    p.top_n_sigma = 1.0f;
    double got[4];
    got_probs(&p, flat, 4, NULL, 0, got);
    for (int i = 0; i < 4; i++)
        assert_true(fabs(got[i] - 0.25) < 1e-6);
}

/* ---- XTC ------------------------------------------------------------------------- */

static void r_xtc(struct rlist *l, double threshold, int min_keep)
{
    r_softmax(l);
    int last = 0;
    for (int i = 0; i < l->n && l->c[i].p >= threshold; i++)
        last = i;
    if (l->n - last >= min_keep && last > 0) {
        memmove(l->c, l->c + last, (size_t)(l->n - last) * sizeof l->c[0]);
        l->n -= last;
    }
}

static void test_xtc(void **state)
{
    (void)state;
    const float thresholds[] = {0.05f, 0.1f, 0.12f, 0.3f};
    for (int k = 0; k < 4; k++)
        for (int min_keep = 0; min_keep <= 12; min_keep += 4) {
            struct sample_params p = base();
            p.min_keep = min_keep;
            p.xtc_probability = 1.0f; /* the coin always says cut */
            p.xtc_threshold = thresholds[k];
            struct rlist l;
            r_init(&l, X, V);
            r_xtc(&l, thresholds[k], min_keep);
            double want[V], got[V];
            r_probs(&l, want, V);
            got_probs(&p, X, V, NULL, 0, got);
            assert_probs(got, want, V);
        }
    /* off: probability 0, or a threshold above 0.5 */
    struct sample_params p = base();
    p.xtc_probability = 1.0f;
    p.xtc_threshold = 0.6f;
    struct rlist l;
    r_init(&l, X, V);
    double want[V], got[V];
    r_probs(&l, want, V);
    got_probs(&p, X, V, NULL, 0, got);
    assert_probs(got, want, V);

    /* probability 0.5: about half the draws may pick the best token, never more */
    p = base();
    p.xtc_probability = 0.5f;
    p.xtc_threshold = 0.1f;
    p.temp = 0.0f; /* greedy after XTC: the best token unless cut */
    struct sampler *s = NULL;
    assert_int_equal(sample_create(&p, V, &s), KS_OK);
    int best = 0;
    for (int i = 0; i < 2000; i++) {
        struct sample_result r;
        assert_int_equal(sample_next(s, X, NULL, 0, &r), KS_OK);
        best += r.token == 0;
    }
    sample_free(s);
    assert_true(best > 850 && best < 1150);
}

/* ---- temperature: dynamic, and its place in the order ---------------------------- */

static void test_dynatemp(void **state)
{
    (void)state;
    const float ranges[] = {0.3f, 0.8f, 1.5f}, exps[] = {0.5f, 1.0f, 2.0f};
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++) {
            struct sample_params p = base();
            p.temp = 0.9f;
            p.dynatemp_range = ranges[a];
            p.dynatemp_exponent = exps[b];
            struct rlist l;
            r_init(&l, X, V);
            r_softmax(&l);
            double lo = p.temp - ranges[a] > 0 ? p.temp - ranges[a] : 0, hi = p.temp + ranges[a];
            double t = lo + (hi - lo) * pow(r_entropy(&l) / log((double)V), exps[b]);
            for (int i = 0; i < l.n; i++)
                l.c[i].logit /= t;
            double want[V], got[V];
            r_probs(&l, want, V);
            got_probs(&p, X, V, NULL, 0, got);
            assert_probs(got, want, V);
        }
}

static void test_order(void **state)
{
    (void)state;
    /* temperature before top-p: the cut sees the tempered distribution */
    struct sample_params p = base();
    p.temp = 2.0f;
    p.top_p = 0.5f;
    p.n_order = 2;
    p.order[0] = SAMPLE_STAGE_TEMPERATURE;
    p.order[1] = SAMPLE_STAGE_TOP_P;
    struct rlist l;
    r_init(&l, X, V);
    for (int i = 0; i < V; i++)
        l.c[i].logit /= 2.0;
    r_softmax(&l);
    double cum = 0;
    for (int i = 0; i < l.n; i++)
        if ((cum += l.c[i].p) >= 0.5) {
            l.n = i > 0 ? i + 1 : 2; /* min_keep 2 */
            break;
        }
    double want[V], got[V];
    r_probs(&l, want, V);
    got_probs(&p, X, V, NULL, 0, got);
    assert_probs(got, want, V);

    /* the default order: top-p sees the untempered distribution */
    p.n_order = 0;
    r_init(&l, X, V);
    r_softmax(&l);
    cum = 0;
    for (int i = 0; i < l.n; i++)
        if ((cum += l.c[i].p) >= 0.5) {
            l.n = i + 1 < 2 ? 2 : i + 1;
            break;
        }
    for (int i = 0; i < l.n; i++)
        l.c[i].logit /= 2.0;
    r_probs(&l, want, V);
    got_probs(&p, X, V, NULL, 0, got);
    assert_probs(got, want, V);

    /* a stage the order leaves out does not run; a stage may run twice */
    p = base();
    p.top_k = 2;
    p.n_order = 1;
    p.order[0] = SAMPLE_STAGE_TEMPERATURE;
    r_init(&l, X, V);
    r_probs(&l, want, V);
    got_probs(&p, X, V, NULL, 0, got);
    assert_probs(got, want, V);
    /* ... and without "temperature" there is no temperature, greedy or not */
    p.temp = 0.0f;
    p.order[0] = SAMPLE_STAGE_MIN_P;
    got_probs(&p, X, V, NULL, 0, got);
    assert_probs(got, want, V);

    /* penalties after top-k apply to the kept tokens only */
    p = base();
    p.top_k = 3;
    p.repeat_penalty = 2.0f;
    p.n_order = 3;
    p.order[0] = SAMPLE_STAGE_TOP_K;
    p.order[1] = SAMPLE_STAGE_PENALTIES;
    p.order[2] = SAMPLE_STAGE_TEMPERATURE;
    const int32_t hist[3] = {0, 7, 9};
    r_init(&l, X, V);
    r_sort(&l);
    l.n = 3; /* 0, 7, 1 */
    for (int i = 0; i < l.n; i++)
        if (l.c[i].id == 0 || l.c[i].id == 7)
            l.c[i].logit /= 2.0;
    r_probs(&l, want, V);
    got_probs(&p, X, V, hist, 3, got);
    assert_probs(got, want, V);

    /* names: canonical and llama-server's alternatives */
    enum sample_stage st;
    assert_true(sample_stage_from_name("typ_p", &st) && st == SAMPLE_STAGE_TYPICAL_P);
    assert_true(sample_stage_from_name("nucleus", &st) && st == SAMPLE_STAGE_TOP_P);
    assert_true(sample_stage_from_name("temp", &st) && st == SAMPLE_STAGE_TEMPERATURE);
    assert_false(sample_stage_from_name("infill", &st));
    assert_string_equal(sample_stage_name(SAMPLE_STAGE_XTC), "xtc");
    enum sample_stage def[SAMPLE_MAX_STAGES];
    assert_int_equal(sample_default_order(def), 9);
    assert_int_equal(def[0], SAMPLE_STAGE_PENALTIES);
    assert_int_equal(def[8], SAMPLE_STAGE_TEMPERATURE);
}

/* ---- DRY ----------------------------------------------------------------------- */

/* A toy vocabulary: pieces, and a tokenizer that takes the longest piece at each byte. */
static const char *const toy[] = {"a", "b", "c", "\n", "x\ny", "q:", ":", "ab", "*", "d", "e", "f"};
#define TOY ((int)(sizeof toy / sizeof toy[0]))

static ks_status toy_piece(void *user, int32_t id, const char **bytes, size_t *len)
{
    (void)user;
    *bytes = toy[id];
    *len = strlen(toy[id]);
    return KS_OK;
}

static ks_status toy_tokenize(void *user, const char *text, size_t len, int32_t **ids, size_t *n)
{
    (void)user;
    *ids = malloc((len + 1) * sizeof **ids);
    *n = 0;
    for (size_t i = 0; i < len;) {
        int best = -1;
        size_t best_len = 0;
        for (int t = 0; t < TOY; t++) {
            size_t l = strlen(toy[t]);
            if (l > best_len && l <= len - i && !memcmp(text + i, toy[t], l)) {
                best = t;
                best_len = l;
            }
        }
        if (best < 0)
            return KS_ERR_FORMAT;
        (*ids)[(*n)++] = best;
        i += best_len;
    }
    return KS_OK;
}

/* The reference's breakers, by hand: head, tail (-1 ends it). */
struct rseq {
    int head;
    int tail[4];
};

static int r_tail_len(const struct rseq *s)
{
    int n = 0;
    while (n < 4 && s->tail[n] >= 0)
        n++;
    return n;
}

/* The DRY penalty of each token, plainly: quadratic matching over the window. */
static void r_dry(const struct sample_params *p, const int32_t *hist, int n_hist, const struct rseq *br, int n_br,
                  double *pen)
{
    for (int t = 0; t < V; t++)
        pen[t] = 0;
    int n = p->dry_penalty_last_n < 0 || p->dry_penalty_last_n > n_hist ? n_hist : p->dry_penalty_last_n;
    if (n <= p->dry_allowed_length)
        return;
    const int32_t *w = hist + n_hist - n;
    int limit = n; /* the nearest complete breaker, from the end */
    for (int i = 0; i < n && limit == n; i++) {
        int longest = -1;
        for (int k = 0; k < n_br; k++) {
            int len = r_tail_len(&br[k]), ok = br[k].head == w[n - 1 - i] && len <= i;
            for (int j = 0; ok && j < len; j++)
                ok = br[k].tail[j] == w[n - 1 - (i - j - 1)];
            if (ok && len > longest)
                longest = len;
        }
        if (longest >= 0)
            limit = i - longest;
    }
    if (limit < p->dry_allowed_length)
        return;
    int best[V] = {0};
    /* a token at position j extends the repeat of the suffix w[..n) that also ends at j - 1 */
    for (int j = 1; j < n; j++) {
        int len = 0;
        while (len < j && w[j - 1 - len] == w[n - 1 - len])
            len++;
        len = len < limit ? len : limit;
        if (len >= p->dry_allowed_length && len + 1 > best[w[j]])
            best[w[j]] = len + 1;
    }
    for (int t = 0; t < V; t++) {
        bool single = false;
        for (int k = 0; k < n_br; k++)
            single |= br[k].head == t && r_tail_len(&br[k]) == 0;
        if (best[t] > 0 && !single)
            pen[t] = p->dry_multiplier * pow(p->dry_base, best[t] - 1 - p->dry_allowed_length);
    }
}

static void check_dry(struct sample_params p, const int32_t *hist, int n_hist, const struct rseq *br, int n_br)
{
    double pen[V], want[V], got[V];
    r_dry(&p, hist, n_hist, br, n_br, pen);
    struct rlist l;
    r_init(&l, X, V);
    for (int i = 0; i < V; i++)
        l.c[i].logit -= pen[i];
    r_probs(&l, want, V);
    got_probs(&p, X, V, hist, n_hist, got);
    assert_probs(got, want, V);
}

static void test_dry_breakers(void **state)
{
    (void)state;
    const char *const br[] = {"\n", ":", "ab", ""};
    struct sample_dry_breakers *b = NULL;
    assert_int_equal(sample_dry_breakers_create(br, 4, TOY, toy_piece, toy_tokenize, NULL, &b), KS_OK);
    /* "\n": 3, 4; ":": 5, 6; "ab": 7 contains it, 0 ("a") heads tail [1] ("b") */
    assert_int_equal(sample_dry_breakers_count(b), 6);
    struct sample_dry_breakers *none = NULL;
    assert_int_equal(sample_dry_breakers_create(br + 3, 1, TOY, toy_piece, toy_tokenize, NULL, &none), KS_OK);
    assert_int_equal(sample_dry_breakers_count(none), 0);
    sample_dry_breakers_free(none);
    sample_dry_breakers_free(b);
}

static void test_dry(void **state)
{
    (void)state;
    const char *const br[] = {"\n", ":", "ab"};
    const struct rseq rbr[] = {{3, {-1}}, {4, {-1}}, {5, {-1}}, {6, {-1}}, {7, {-1}}, {0, {1, -1}}};
    struct sample_dry_breakers *b = NULL;
    assert_int_equal(sample_dry_breakers_create(br, 3, TOY, toy_piece, toy_tokenize, NULL, &b), KS_OK);
    /* c d e f c d e: "f" would make "c d e f" again (repeat 3) */
    const int32_t h1[] = {2, 9, 10, 11, 2, 9, 10};
    /* a repeat across a one-token breaker ("\n" = 3) stops there */
    const int32_t h2[] = {2, 9, 10, 11, 8, 2, 9, 3, 10, 2, 9, 3, 10};
    /* the two-token breaker a b (0 1) caps the repeat; a b alone is "a" + tail */
    const int32_t h3[] = {9, 10, 11, 2, 9, 10, 11, 0, 1, 2, 9, 10, 11, 0, 1, 2, 9, 10};
    /* a long repeat, and the breaker tokens themselves repeating */
    const int32_t h4[] = {9, 10, 3, 11, 9, 10, 3, 11, 9, 10, 3, 11, 9, 10, 3, 11, 9, 10};
    const struct {
        const int32_t *h;
        int n;
    } hs[] = {{h1, 7}, {h2, 13}, {h3, 18}, {h4, 18}};
    /* by hand: after c d e f c d e, "f" repeats 3 tokens: 0.8 * 1.75^(3 - 2) */
    struct sample_params hand = base();
    hand.dry_multiplier = 0.8f;
    hand.dry_breakers = b;
    double pen[V];
    r_dry(&hand, h1, 7, rbr, 6, pen);
    assert_true(fabs(pen[11] - 0.8 * 1.75) < 1e-6);
    assert_true(pen[2] == 0 && pen[9] == 0 && pen[10] == 0);
    double hand_got[V], hand_plain[V];
    got_probs(&hand, X, V, h1, 7, hand_got);
    struct rlist hl;
    r_init(&hl, X, V);
    r_probs(&hl, hand_plain, V);
    assert_true(hand_got[11] < hand_plain[11] * 0.5);
    for (int k = 0; k < 4; k++)
        for (int allowed = 0; allowed <= 3; allowed++)
            for (int last_n = -1; last_n <= 12; last_n += 13) {
                struct sample_params p = base();
                p.dry_multiplier = 0.8f;
                p.dry_base = 1.75f;
                p.dry_allowed_length = allowed;
                p.dry_penalty_last_n = last_n;
                p.dry_breakers = b;
                check_dry(p, hs[k].h, hs[k].n, rbr, 6);
                /* no breakers at all */
                p.dry_breakers = NULL;
                check_dry(p, hs[k].h, hs[k].n, NULL, 0);
            }
    /* a window too short for the allowed length, and an empty history */
    struct sample_params p = base();
    p.dry_multiplier = 1.0f;
    p.dry_allowed_length = 2;
    p.dry_penalty_last_n = 2;
    check_dry(p, h1, 7, NULL, 0);
    check_dry(p, NULL, 0, NULL, 0);
    /* a huge base: the exponent is clamped where the penalty would overflow */
    p.dry_penalty_last_n = -1;
    p.dry_allowed_length = 0;
    p.dry_base = 1e30f;
    p.dry_breakers = b;
    double got[V];
    got_probs(&p, X, V, h4, 18, got);
    for (int i = 0; i < V; i++)
        assert_false(isnan(got[i]));
    sample_dry_breakers_free(b);
}

/* ---- mirostat -------------------------------------------------------------------- */

static void test_mirostat_v2(void **state)
{
    (void)state;
    struct sample_params p = base();
    p.min_keep = 0;
    p.mirostat = 2;
    p.mirostat_tau = 2.0f;
    p.mirostat_eta = 0.3f;
    p.temp = 0.7f;
    p.seed = 7;
    struct sampler *s = NULL;
    assert_int_equal(sample_create(&p, V, &s), KS_OK);
    double mu = 2.0 * p.mirostat_tau;
    for (int step = 0; step < 30; step++) {
        assert_true(fabs(sample_mirostat_mu(s) - mu) < 1e-4);
        struct rlist l;
        r_init(&l, X, V);
        for (int i = 0; i < V; i++)
            l.c[i].logit /= p.temp;
        r_softmax(&l);
        int keep = 0;
        while (keep < l.n && -log2(l.c[keep].p) <= mu)
            keep++;
        l.n = keep > 0 ? keep : 1;
        double want[V], got[V];
        r_probs(&l, want, V);
        const struct chain_cand *c;
        int32_t n;
        assert_int_equal(sample_final_distribution(s, X, NULL, 0, &c, &n), KS_OK);
        for (int i = 0; i < V; i++)
            got[i] = 0;
        for (int32_t i = 0; i < n; i++)
            got[c[i].id] = c[i].p;
        assert_probs(got, want, V);
        struct sample_result r;
        assert_int_equal(sample_next(s, X, NULL, 0, &r), KS_OK);
        assert_true(want[r.token] > 0);
        mu -= p.mirostat_eta * (-log2(want[r.token]) - p.mirostat_tau);
    }
    sample_free(s);
}

static void test_mirostat_v1(void **state)
{
    (void)state;
    enum { N = 300 };
    float x[N];
    for (int i = 0; i < N; i++) /* Zipf-like: p_i ~ 1 / (i + 1)^1.2 */
        x[i] = (float)(-1.2 * log(i + 1.0) + 0.01 * ((i * 37) % 11));
    const float taus[] = {1.0f, 3.0f, 6.0f};
    for (int k = 0; k < 3; k++) {
        struct sample_params p = base();
        p.mirostat = 1;
        p.mirostat_tau = taus[k];
        /* the reference on N tokens, past struct rlist's room */
        struct {
            int id;
            double logit, p;
        } c[N];
        for (int i = 0; i < N; i++)
            c[i].id = i, c[i].logit = x[i];
        for (int i = 1; i < N; i++) /* sort best first */
            for (int j = i; j > 0 && (c[j - 1].logit < c[j].logit); j--) {
                __typeof__(c[0]) t = c[j];
                c[j] = c[j - 1];
                c[j - 1] = t;
            }
        double sum = 0;
        for (int i = 0; i < N; i++)
            sum += c[i].p = exp(c[i].logit - c[0].logit);
        for (int i = 0; i < N; i++)
            c[i].p /= sum;
        double tb = 0, tt = 0, mu = 2.0 * taus[k];
        for (int i = 0; i < 99; i++) {
            double t = log((i + 2.0) / (i + 1.0));
            tb += t * log(c[i].p / c[i + 1].p);
            tt += t * t;
        }
        double sh = tb / tt, eps = sh - 1;
        int kk = (int)pow(eps * pow(2.0, mu) / (1 - pow((double)N, -eps)), 1 / sh);
        kk = kk < 1 ? 1 : kk > N ? N : kk;
        if (k == 1) /* tau 3 truncates to a few tokens (11) */
            assert_true(kk > 1 && kk < N);
        double want[N], got[N];
        double z = 0;
        for (int i = 0; i < kk; i++)
            z += c[i].p;
        for (int i = 0; i < N; i++)
            want[i] = 0;
        for (int i = 0; i < kk; i++)
            want[c[i].id] = c[i].p / z;
        got_probs(&p, x, N, NULL, 0, got);
        assert_probs(got, want, N);
    }
}

/* ---- edge cases and speculative verification ---------------------------------- */

static void test_all_filtered(void **state)
{
    (void)state;
    /* one finite logit: every stage leaves it, with p = 1 and no NaN */
    float x[V];
    for (int i = 0; i < V; i++)
        x[i] = -INFINITY;
    x[5] = 0.5f;
    struct sample_params p = base();
    p.typical_p = 0.5f;
    p.top_n_sigma = 1.0f;
    p.xtc_probability = 1.0f;
    p.dynatemp_range = 2.0f; /* the zero entropy asks for temperature 0 */
    p.temp = 0.5f;
    p.min_keep = 3;
    double got[V];
    got_probs(&p, x, V, NULL, 0, got);
    for (int i = 0; i < V; i++)
        assert_true(got[i] == (i == 5 ? 1.0 : 0.0));
    p.mirostat = 1;
    got_probs(&p, x, V, NULL, 0, got);
    assert_true(got[5] == 1.0);
    p.mirostat = 2;
    got_probs(&p, x, V, NULL, 0, got);
    assert_true(got[5] == 1.0);
    /* greedy through the chain: the argmax after the stages */
    p = base();
    p.temp = 0.0f;
    p.typical_p = 0.3f;
    struct sampler *s = NULL;
    assert_int_equal(sample_create(&p, V, &s), KS_OK);
    struct rlist l;
    r_init(&l, X, V);
    r_typical(&l, 0.3, 2);
    r_sort(&l);
    struct sample_result r;
    assert_int_equal(sample_next(s, X, NULL, 0, &r), KS_OK);
    assert_int_equal(r.token, l.c[0].id);
    sample_free(s);
}

/* sample_verify against a fixed draft yields sample_next's distribution. */
static void test_verify_distribution(void **state)
{
    (void)state;
    struct sample_params p = base();
    p.typical_p = 0.9f;
    p.dry_multiplier = 0.5f;
    p.dry_allowed_length = 1;
    p.xtc_probability = 0.3f;
    p.xtc_threshold = 0.15f;
    const int32_t hist[] = {2, 9, 10, 2, 9};
    /* the mixture over XTC's coin, from the final distributions with the coin forced each way */
    double cut[V], keep[V], want[V];
    p.xtc_probability = 1.0f;
    got_probs(&p, X, V, hist, 5, cut);
    p.xtc_probability = 0.0f;
    got_probs(&p, X, V, hist, 5, keep);
    for (int i = 0; i < V; i++)
        want[i] = 0.3 * cut[i] + 0.7 * keep[i];
    p.xtc_probability = 0.3f;
    int counts[V] = {0};
    const int draws = 30000;
    for (int d = 0; d < draws; d++) {
        p.seed = 1000 + (uint64_t)d;
        struct sampler *s = NULL;
        assert_int_equal(sample_create(&p, V, &s), KS_OK);
        struct sample_result r;
        bool acc;
        assert_int_equal(sample_verify(s, X, hist, 5, 7, &r, &acc), KS_OK);
        assert_true(acc == (r.token == 7));
        counts[r.token]++;
        sample_free(s);
    }
    double chi = 0;
    for (int i = 0; i < V; i++) {
        if (want[i] == 0) {
            assert_int_equal(counts[i], 0);
            continue;
        }
        double e = want[i] * draws;
        chi += (counts[i] - e) * (counts[i] - e) / e;
    }
    assert_true(chi < 45.0); /* 99.99th percentile, <= 11 dof */

    /* mirostat: verification moves mu by the returned token, as decoding does */
    p = base();
    p.mirostat = 2;
    p.seed = 3;
    struct sampler *a = NULL, *b = NULL;
    assert_int_equal(sample_create(&p, V, &a), KS_OK);
    assert_int_equal(sample_create(&p, V, &b), KS_OK);
    for (int i = 0; i < 20; i++) {
        struct sample_result ra, rb;
        bool acc;
        assert_int_equal(sample_verify(a, X, NULL, 0, 1, &ra, &acc), KS_OK);
        float mu = sample_mirostat_mu(b);
        const struct chain_cand *c;
        int32_t n;
        assert_int_equal(sample_final_distribution(b, X, NULL, 0, &c, &n), KS_OK);
        double pt = 0;
        for (int32_t j = 0; j < n; j++)
            pt = c[j].id == ra.token ? c[j].p : pt;
        assert_true(pt > 0);
        assert_true(fabs(sample_mirostat_mu(a) - (mu - p.mirostat_eta * (-log2(pt) - p.mirostat_tau))) < 1e-4);
        assert_int_equal(sample_next(b, X, NULL, 0, &rb), KS_OK); /* b's stream differs; only mu is synced below */
        b->mirostat_mu = sample_mirostat_mu(a);
    }
    sample_free(a);
    sample_free(b);
}

/* post_sampling_probs (llama-server's): the drawn token's probability and
 * the alternatives are the final distribution's, best first (the reference:
 * top-k 4 then temperature 0.7, softmaxed); at temperature 0 the drawn token
 * alone, with probability 1. The draws are those without the option. */
static void check_post_sampling_probs(int min_keep)
{
    struct sample_params p;
    sample_params_default(&p);
    p.min_keep = min_keep; /* 2: the chain path (it changes nothing here), 0: the fast path */
    p.top_k = 4;
    p.top_p = 1.0f;
    p.min_p = 0.0f;
    p.temp = 0.7f;
    p.n_logprobs = 3;
    p.seed = 11;
    struct sample_params q = p;
    q.post_sampling_probs = true;
    struct sampler *plain = NULL, *post = NULL;
    assert_int_equal(sample_create(&p, V, &plain), KS_OK);
    assert_int_equal(sample_create(&q, V, &post), KS_OK);
    struct rlist l;
    r_init(&l, X, V);
    r_sort(&l);
    l.n = 4;
    for (int i = 0; i < l.n; i++)
        l.c[i].logit /= 0.7;
    r_softmax(&l);
    for (int step = 0; step < 20; step++) {
        struct sample_result a, b;
        assert_int_equal(sample_next(plain, X, NULL, 0, &a), KS_OK);
        assert_int_equal(sample_next(post, X, NULL, 0, &b), KS_OK);
        assert_int_equal(a.token, b.token);
        assert_int_equal(b.n_top, 3);
        double want = 0;
        for (int i = 0; i < l.n; i++)
            if (l.c[i].id == b.token)
                want = l.c[i].p;
        assert_true(fabs(b.prob - want) < 1e-6);
        for (int i = 0; i < 3; i++) {
            assert_int_equal(b.top[i].token, l.c[i].id);
            assert_true(fabs(b.top[i].prob - l.c[i].p) < 1e-6);
            assert_true(fabs(b.top[i].logprob - log(l.c[i].p)) < 1e-5);
        }
    }
    sample_free(plain);
    sample_free(post);
    q.temp = 0.0f;
    assert_int_equal(sample_create(&q, V, &post), KS_OK);
    struct sample_result g;
    assert_int_equal(sample_next(post, X, NULL, 0, &g), KS_OK);
    assert_int_equal(g.token, 0);
    assert_int_equal(g.n_top, 1);
    assert_true(g.prob == 1.0f && g.top[0].token == 0 && g.top[0].prob == 1.0f);
    sample_free(post);
}

static void test_post_sampling_probs(void **state)
{
    (void)state;
    check_post_sampling_probs(0);
    check_post_sampling_probs(2);
}

static void test_invalid_params(void **state)
{
    (void)state;
    struct sampler *s = NULL;
    struct sample_params p = base();
    p.mirostat = 3;
    assert_int_equal(sample_create(&p, V, &s), KS_ERR_INVALID_ARG);
    p = base();
    p.min_keep = -1;
    assert_int_equal(sample_create(&p, V, &s), KS_ERR_INVALID_ARG);
    p = base();
    p.n_order = 1;
    p.order[0] = (enum sample_stage)42;
    assert_int_equal(sample_create(&p, V, &s), KS_ERR_INVALID_ARG);
    p = base();
    p.typical_p = NAN;
    assert_int_equal(sample_create(&p, V, &s), KS_ERR_INVALID_ARG);
    p = base();
    p.dry_penalty_last_n = -2;
    assert_int_equal(sample_create(&p, V, &s), KS_ERR_INVALID_ARG);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_typical_p),     cmocka_unit_test(test_min_keep),
        cmocka_unit_test(test_top_n_sigma),   cmocka_unit_test(test_xtc),
        cmocka_unit_test(test_dynatemp),      cmocka_unit_test(test_order),
        cmocka_unit_test(test_dry_breakers),  cmocka_unit_test(test_dry),
        cmocka_unit_test(test_mirostat_v2),   cmocka_unit_test(test_mirostat_v1),
        cmocka_unit_test(test_all_filtered),  cmocka_unit_test(test_verify_distribution),
        cmocka_unit_test(test_invalid_params),  cmocka_unit_test(test_post_sampling_probs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
