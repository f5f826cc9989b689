/* sample: penalties, truncation (top-k, top-p, min-p) and a seeded draw.
 *
 * Nothing here sorts the whole vocabulary per token: top-k keeps a k-element
 * heap over one pass of the logits, min-p is a threshold scan, and top-p
 * buckets candidates by probability and sorts only the bucket where the
 * cumulative probability crosses p. Ties between equal logits go to the lower token id
 * everywhere, so results never depend on the order of a partition. */
#include <assert.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sample/sample.h"
#include "sample/sample_internal.h"

/* Above this k, selecting with a heap costs more than a quickselect. */
#define SAMPLE_HEAP_MAX_K 2048
/* Chunk of the direct (untruncated) draw; matches no other constant. */
#define SAMPLE_DRAW_CHUNK 1024

/* ---- random numbers: xoshiro256**, seeded by splitmix64 ----------------- */

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

static uint64_t xoshiro_next(uint64_t s[4])
{
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double sample_uniform01(struct sampler *s)
{
    return (double)(xoshiro_next(s->rng) >> 11) * 0x1.0p-53;
}

/* ---- parameters ---------------------------------------------------------- */

void sample_params_default(struct sample_params *p)
{
    memset(p, 0, sizeof *p);
    p->temp = 0.8f;
    p->top_k = 40;
    p->top_p = 0.95f;
    p->min_p = 0.05f;
    p->repeat_penalty = 1.0f;
    p->repeat_last_n = 64;
    p->presence_penalty = 0.0f;
    p->frequency_penalty = 0.0f;
    p->seed = 0xC0FFEE;
    p->n_logprobs = 0;
    p->typical_p = 1.0f;
    p->top_n_sigma = -1.0f;
    p->dynatemp_exponent = 1.0f;
    p->xtc_threshold = 0.1f;
    p->dry_base = 1.75f;
    p->dry_allowed_length = 2;
    p->dry_penalty_last_n = -1;
    p->mirostat_tau = 5.0f;
    p->mirostat_eta = 0.1f;
}

static ks_status check_chain_params(const struct sample_params *p)
{
    const struct {
        const char *name;
        float v;
    } finite[] = {{"typical_p", p->typical_p},         {"top_n_sigma", p->top_n_sigma},
                  {"dynatemp_range", p->dynatemp_range}, {"dynatemp_exponent", p->dynatemp_exponent},
                  {"xtc_probability", p->xtc_probability}, {"xtc_threshold", p->xtc_threshold},
                  {"dry_multiplier", p->dry_multiplier}, {"dry_base", p->dry_base},
                  {"mirostat_tau", p->mirostat_tau},     {"mirostat_eta", p->mirostat_eta}};
    for (size_t i = 0; i < sizeof finite / sizeof finite[0]; i++)
        if (!isfinite(finite[i].v))
            return ks_fail(KS_ERR_INVALID_ARG, "sampler: %s must be a finite number", finite[i].name);
    if (p->min_keep < 0)
        return ks_fail(KS_ERR_INVALID_ARG, "sampler: min_keep %d must not be negative", p->min_keep);
    if (p->dry_allowed_length < 0 || p->dry_penalty_last_n < -1)
        return ks_fail(KS_ERR_INVALID_ARG, "sampler: dry_allowed_length %d must be >= 0 and dry_penalty_last_n %d >= -1",
                       p->dry_allowed_length, p->dry_penalty_last_n);
    if (p->mirostat < 0 || p->mirostat > 2)
        return ks_fail(KS_ERR_INVALID_ARG, "sampler: mirostat %d must be 0 (off), 1 or 2", p->mirostat);
    if (p->n_order < 0 || p->n_order > SAMPLE_MAX_STAGES)
        return ks_fail(KS_ERR_INVALID_ARG, "sampler: %d stages in the order, at most %d", p->n_order,
                       SAMPLE_MAX_STAGES);
    for (int i = 0; i < p->n_order; i++)
        if (p->order[i] < SAMPLE_STAGE_PENALTIES || p->order[i] > SAMPLE_STAGE_TEMPERATURE)
            return ks_fail(KS_ERR_INVALID_ARG, "sampler: stage %d of the order (%d) is not a stage", i,
                           (int)p->order[i]);
    return KS_OK;
}

static ks_status check_params(const struct sample_params *p, int32_t n_vocab)
{
    if (n_vocab <= 0)
        return ks_fail(KS_ERR_INVALID_ARG, "sampler: n_vocab %d must be positive", (int)n_vocab);
    if (!isfinite(p->temp))
        return ks_fail(KS_ERR_INVALID_ARG, "sampler: temp must be a finite number");
    if (!(p->top_p >= 0.0f && p->top_p <= 1.0f))
        return ks_fail(KS_ERR_INVALID_ARG, "sampler: top_p %g is outside [0, 1]", (double)p->top_p);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return ks_fail(KS_ERR_INVALID_ARG, "sampler: min_p %g is outside [0, 1]", (double)p->min_p);
    if (!(p->repeat_penalty > 0.0f) || !isfinite(p->repeat_penalty))
        return ks_fail(KS_ERR_INVALID_ARG, "sampler: repeat_penalty %g must be a positive number",
                       (double)p->repeat_penalty);
    if (p->repeat_last_n < -1)
        return ks_fail(KS_ERR_INVALID_ARG, "sampler: repeat_last_n %d must be -1 (all), 0 (off) or positive",
                       p->repeat_last_n);
    if (!isfinite(p->presence_penalty))
        return ks_fail(KS_ERR_INVALID_ARG, "sampler: presence_penalty must be a finite number");
    if (!isfinite(p->frequency_penalty))
        return ks_fail(KS_ERR_INVALID_ARG, "sampler: frequency_penalty must be a finite number");
    if (p->n_biases < 0 || (p->n_biases > 0 && !p->biases))
        return ks_fail(KS_ERR_INVALID_ARG, "sampler: %d logit biases with %s pointer", p->n_biases,
                       p->biases ? "a" : "a NULL");
    for (int i = 0; i < p->n_biases; i++)
        if (p->biases[i].token < 0 || p->biases[i].token >= n_vocab ||
            !(isfinite(p->biases[i].bias) || p->biases[i].bias == -INFINITY))
            return ks_fail(KS_ERR_INVALID_ARG, "sampler: logit bias %d (token %d, bias %g) needs a token in [0, %d) "
                                               "and a finite bias or -inf",
                           i, (int)p->biases[i].token, (double)p->biases[i].bias, (int)n_vocab);
    if (p->n_logprobs < 0 || p->n_logprobs > SAMPLE_MAX_LOGPROBS)
        return ks_fail(KS_ERR_INVALID_ARG, "sampler: n_logprobs %d is outside [0, %d]", p->n_logprobs,
                       SAMPLE_MAX_LOGPROBS);
    return check_chain_params(p);
}

ks_status sample_create(const struct sample_params *p, int32_t n_vocab, struct sampler **out)
{
    if (!p || !out)
        return ks_fail(KS_ERR_INVALID_ARG, "sample_create: NULL argument");
    ks_status st = check_params(p, n_vocab);
    if (st)
        return st;
    struct sampler *s = calloc(1, sizeof *s);
    if (!s)
        return ks_fail(KS_ERR_NOMEM, "sampler: out of memory");
    s->p = *p;
    s->n_vocab = n_vocab;
    s->work = malloc((size_t)n_vocab * sizeof *s->work);
    s->counts = calloc((size_t)n_vocab, sizeof *s->counts);
    s->cands = malloc((size_t)n_vocab * sizeof *s->cands);
    if (p->n_biases > 0 && (s->biases = malloc((size_t)p->n_biases * sizeof *s->biases)))
        memcpy(s->biases, p->biases, (size_t)p->n_biases * sizeof *s->biases);
    s->p.biases = s->biases;
    if (!s->work || !s->counts || !s->cands || (p->n_biases > 0 && !s->biases)) {
        sample_free(s);
        return ks_fail(KS_ERR_NOMEM, "sampler: out of memory for a vocabulary of %d", (int)n_vocab);
    }
    if (p->grammar) {
        if (!p->grammar_vocab || grammar_vocab_size(p->grammar_vocab) > n_vocab) {
            sample_free(s);
            return ks_fail(KS_ERR_INVALID_ARG, "sampler: a grammar needs a vocabulary of at most %d tokens",
                           (int)n_vocab);
        }
        st = p->grammar_triggers.n > 0 ? grammar_state_create_lazy(p->grammar, p->grammar_vocab, p->grammar_max_tokens,
                                                                   &p->grammar_triggers, &s->grammar)
                                       : grammar_state_create(p->grammar, p->grammar_vocab, p->grammar_max_tokens,
                                                              &s->grammar);
        if (st) {
            sample_free(s);
            return st;
        }
    }
    s->p.grammar = NULL; /* the state holds the reference; the params' copy is not one */
    s->p.dry_breakers = NULL;
    if (sample_chain_needed(p, n_vocab) &&
        ((p->dry_breakers && (st = sample_dry_copy(p->dry_breakers, &s->dry_breakers))) ||
         (st = sample_chain_init(s)))) {
        sample_free(s);
        return st;
    }
    s->p.dry_breakers = s->dry_breakers;
    s->mirostat_mu = 2.0f * p->mirostat_tau;
    uint64_t x = p->seed;
    for (int i = 0; i < 4; i++)
        s->rng[i] = splitmix64(&x);
    *out = s;
    return KS_OK;
}

void sample_free(struct sampler *s)
{
    if (!s)
        return;
    free(s->work);
    free(s->counts);
    free(s->cands);
    free(s->biases);
    grammar_state_free(s->grammar);
    sample_chain_free(s);
    sample_dry_breakers_free(s->dry_breakers);
    free(s);
}

/* ---- penalties ----------------------------------------------------------- */

static bool penalties_active(const struct sample_params *p)
{
    return p->repeat_last_n != 0 &&
           (p->repeat_penalty != 1.0f || p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f);
}

ks_status sample_penalty_window(struct sampler *s, const int32_t *history, int32_t n_history, const int32_t **win,
                                int32_t *n_win)
{
    int32_t last_n = s->p.repeat_last_n;
    int32_t n = last_n < 0 || last_n > n_history ? n_history : last_n;
    const int32_t *w = history + (n_history - n);
    for (int32_t i = 0; i < n; i++)
        if (w[i] < 0 || w[i] >= s->n_vocab)
            return ks_fail(KS_ERR_RANGE, "sampler: history token %d at index %d is outside the vocabulary (%d)",
                           (int)w[i], (int)(n_history - n + i), (int)s->n_vocab);
    for (int32_t i = 0; i < n; i++)
        s->counts[w[i]]++;
    *win = w;
    *n_win = n;
    return KS_OK;
}

float sample_penalize(const struct sample_params *p, float logit, int32_t c)
{
    float l = logit <= 0.0f ? logit * p->repeat_penalty : logit / p->repeat_penalty;
    return l - (float)c * p->frequency_penalty - p->presence_penalty;
}

/* Penalize each distinct token of the window once, by its count there. */
static ks_status apply_penalties(struct sampler *s, const int32_t *history, int32_t n_history)
{
    const int32_t *win;
    int32_t n;
    ks_status st = sample_penalty_window(s, history, n_history, &win, &n);
    if (st)
        return st;
    for (int32_t i = 0; i < n; i++) {
        int32_t t = win[i], c = s->counts[t];
        if (c == 0)
            continue;
        s->work[t] = sample_penalize(&s->p, s->work[t], c);
        s->counts[t] = 0;
    }
    return KS_OK;
}

/* ---- selection ----------------------------------------------------------- */

static bool better(struct cand a, struct cand b)
{
    return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
}

static int cmp_better_first(const void *pa, const void *pb)
{
    struct cand a = *(const struct cand *)pa, b = *(const struct cand *)pb;
    return better(a, b) ? -1 : better(b, a) ? 1 : 0;
}

static void swap_cand(struct cand *a, struct cand *b)
{
    struct cand t = *a;
    *a = *b;
    *b = t;
}

/* Min-heap on "better": the root is the worst of the kept set. */
static void heap_sift_down(struct cand *h, int32_t k, int32_t i)
{
    for (;;) {
        int32_t l = 2 * i + 1, r = l + 1, w = i;
        if (l < k && better(h[w], h[l]))
            w = l;
        if (r < k && better(h[w], h[r]))
            w = r;
        if (w == i)
            return;
        swap_cand(&h[i], &h[w]);
        i = w;
    }
}

static void heap_offer(struct cand *h, int32_t k, float logit, int32_t id)
{
    /* a later equal logit has a larger id, so only strictly greater wins */
    if (logit > h[0].logit) {
        h[0] = (struct cand){logit, id};
        heap_sift_down(h, k, 0);
    }
}

/* The best k of x[0..n) into out[0..k), in no particular order. Blocks with
 * nothing above the current k-th best are skipped with one vector compare. */
static void select_heap(const float *x, int32_t n, int32_t k, struct cand *out)
{
    enum { BLOCK = 16 };
    for (int32_t i = 0; i < k; i++)
        out[i] = (struct cand){x[i], i};
    for (int32_t i = k / 2 - 1; i >= 0; i--)
        heap_sift_down(out, k, i);
    int32_t i = k;
    for (; i + BLOCK <= n; i += BLOCK) {
        float thr = out[0].logit;
        int any = 0;
        for (int j = 0; j < BLOCK; j++)
            any |= x[i + j] > thr;
        if (any)
            for (int j = 0; j < BLOCK; j++)
                heap_offer(out, k, x[i + j], i + j);
    }
    for (; i < n; i++)
        heap_offer(out, k, x[i], i);
}

/* Reorder c[0..n) so that c[0..k) are the best k (quickselect). */
static void select_partition(struct cand *c, int32_t n, int32_t k)
{
    int32_t lo = 0, hi = n - 1;
    while (lo < hi) {
        int32_t mid = lo + (hi - lo) / 2;
        /* median of three into c[hi] as the pivot */
        if (better(c[mid], c[lo]))
            swap_cand(&c[mid], &c[lo]);
        if (better(c[hi], c[lo]))
            swap_cand(&c[hi], &c[lo]);
        if (better(c[mid], c[hi]))
            swap_cand(&c[mid], &c[hi]);
        struct cand pivot = c[hi];
        int32_t store = lo;
        for (int32_t i = lo; i < hi; i++)
            if (better(c[i], pivot))
                swap_cand(&c[i], &c[store++]);
        swap_cand(&c[store], &c[hi]);
        if (store == k - 1 || store == k)
            return;
        if (store < k)
            lo = store + 1;
        else
            hi = store - 1;
    }
}

void sample_select_top(const float *x, int32_t n, int32_t k, struct cand *out)
{
    if (k <= SAMPLE_HEAP_MAX_K && k < n) {
        select_heap(x, n, k, out);
        return;
    }
    for (int32_t i = 0; i < n; i++)
        out[i] = (struct cand){x[i], i};
    if (k < n)
        select_partition(out, n, k);
}

/* ---- truncation and the draw -------------------------------------------- */

struct temp_scale {
    float max;     /* the largest penalized logit */
    float inv_temp;
};

static float weight(struct temp_scale ts, float logit)
{
    return sample_expf((logit - ts.max) * ts.inv_temp);
}

/* Tokens with p >= min_p * p_max, i.e. logit >= max + temp * ln(min_p). */
static int32_t filter_min_p(struct cand *c, int32_t n, float min_p, struct temp_scale ts)
{
    float thr = ts.max + logf(min_p) / ts.inv_temp;
    int32_t kept = 0;
    for (int32_t i = 0; i < n; i++)
        if (c[i].logit >= thr)
            c[kept++] = c[i];
    return kept > 0 ? kept : 1;
}

/* Top-p over more candidates than this buckets them instead of sorting. */
#define SAMPLE_TOP_P_SORT_MAX 1024
/* Buckets by (max - logit) / temp, 1/16 nat wide; the last takes the rest. */
#define SAMPLE_TOP_P_BUCKETS 1024
#define SAMPLE_TOP_P_BUCKET_SCALE 16.0f

/* Within sorted c[0..n), the shortest prefix whose mass (normalized by z)
 * reaches top_p, continuing from mass cum; n if none does. */
static int32_t top_p_prefix(const struct cand *c, int32_t n, double cum, float top_p, double z,
                            struct temp_scale ts)
{
    for (int32_t i = 0; i < n; i++) {
        cum += weight(ts, c[i].logit) / z;
        if (cum >= top_p)
            return i + 1;
    }
    return n;
}

static int32_t bucket_of(struct temp_scale ts, float logit)
{
    float d = (ts.max - logit) * ts.inv_temp * SAMPLE_TOP_P_BUCKET_SCALE;
    return d < (float)(SAMPLE_TOP_P_BUCKETS - 1) ? (int32_t)d : SAMPLE_TOP_P_BUCKETS - 1;
}

/* Keep the shortest best-first prefix whose mass (normalized by z, the sum
 * over the top-k set) reaches top_p. Many candidates are first bucketed by
 * probability: whole buckets above the crossing are kept unsorted and only
 * the bucket where the mass crosses top_p is sorted. */
static int32_t truncate_top_p(struct cand *c, int32_t n, float top_p, double z, struct temp_scale ts)
{
    if (n <= SAMPLE_TOP_P_SORT_MAX) {
        qsort(c, (size_t)n, sizeof *c, cmp_better_first);
        return top_p_prefix(c, n, 0.0, top_p, z, ts);
    }
    static_assert(SAMPLE_TOP_P_BUCKETS <= 4096, "bucket table lives on the stack");
    double mass[SAMPLE_TOP_P_BUCKETS] = {0};
    for (int32_t i = 0; i < n; i++)
        mass[bucket_of(ts, c[i].logit)] += weight(ts, c[i].logit);
    int32_t cross = SAMPLE_TOP_P_BUCKETS - 1;
    double cum = 0.0;
    for (int32_t b = 0; b < SAMPLE_TOP_P_BUCKETS; b++) {
        if (cum + mass[b] / z >= top_p) {
            cross = b;
            break;
        }
        cum += mass[b] / z;
    }
    /* order: buckets above the crossing, then the crossing bucket */
    int32_t above = 0;
    for (int32_t i = 0; i < n; i++)
        if (bucket_of(ts, c[i].logit) < cross)
            swap_cand(&c[i], &c[above++]);
    int32_t in_cross = above;
    for (int32_t i = above; i < n; i++)
        if (bucket_of(ts, c[i].logit) == cross)
            swap_cand(&c[i], &c[in_cross++]);
    qsort(c + above, (size_t)(in_cross - above), sizeof *c, cmp_better_first);
    return above + top_p_prefix(c + above, in_cross - above, cum, top_p, z, ts);
}

/* A draw from c[0..n) by weight, never one of ex[0..n_ex): the
 * distribution renormalized without them. */
static int32_t draw_from(struct sampler *s, const struct cand *c, int32_t n, struct temp_scale ts, const int32_t *ex,
                         int32_t n_ex)
{
    double total = 0.0;
    int32_t last = -1;
    for (int32_t i = 0; i < n; i++)
        if (!sample_in_set(c[i].id, ex, n_ex)) {
            total += weight(ts, c[i].logit);
            last = last < 0 ? c[i].id : last;
        }
    last = last < 0 ? c[0].id : last;
    double target = sample_uniform01(s) * total, cum = 0.0;
    for (int32_t i = 0; i < n; i++) {
        float w = weight(ts, c[i].logit);
        if (w <= 0.0f || sample_in_set(c[i].id, ex, n_ex))
            continue;
        cum += w;
        last = c[i].id;
        if (target < cum)
            return c[i].id;
    }
    return last; /* rounding left target at the very top */
}

/* Untruncated: a draw over the whole vocabulary, chunk sums first; never
 * one of ex[0..n_ex) (distinct tokens). */
static int32_t draw_full(struct sampler *s, struct temp_scale ts, const int32_t *ex, int32_t n_ex)
{
    const float *x = s->work;
    int32_t n = s->n_vocab;
    double w_ex = 0.0;
    for (int32_t e = 0; e < n_ex; e++)
        w_ex += weight(ts, x[ex[e]]);
    double total = sample_sum_exp(x, n, ts.max, ts.inv_temp) - w_ex;
    double target = sample_uniform01(s) * total, cum = 0.0;
    int32_t last = sample_argmax(x, n);
    for (int32_t i = 0; i < n; i += SAMPLE_DRAW_CHUNK) {
        int32_t len = n - i < SAMPLE_DRAW_CHUNK ? n - i : SAMPLE_DRAW_CHUNK;
        double chunk = sample_sum_exp(x + i, len, ts.max, ts.inv_temp);
        for (int32_t e = 0; e < n_ex; e++)
            if (ex[e] >= i && ex[e] < i + len)
                chunk -= weight(ts, x[ex[e]]);
        if (target >= cum + chunk) {
            cum += chunk;
            continue;
        }
        for (int32_t j = i; j < i + len; j++) {
            float w = weight(ts, x[j]);
            if (w <= 0.0f || sample_in_set(j, ex, n_ex))
                continue;
            cum += w;
            last = j;
            if (target < cum)
                return j;
        }
    }
    if (sample_in_set(last, ex, n_ex)) { /* rounding skipped every chunk and the argmax is excluded */
        int32_t best = -1;
        for (int32_t j = 0; j < n; j++)
            if (!sample_in_set(j, ex, n_ex) && (best < 0 || x[j] > x[best]))
                best = j;
        last = best >= 0 ? best : last;
    }
    return last;
}

/* The truncated candidate set of this step into s->cands: its size, or 0
 * when nothing truncates (the candidates are then the whole s->work). */
static int32_t truncate_candidates(struct sampler *s, struct temp_scale ts)
{
    const struct sample_params *p = &s->p;
    int32_t n = s->n_vocab;
    bool top_k = p->top_k > 0 && p->top_k < n;
    bool top_p = p->top_p < 1.0f;
    bool min_p = p->min_p > 0.0f;
    if (!top_k && !top_p && !min_p)
        return 0;

    int32_t k = top_k ? p->top_k : n;
    double z = 0.0; /* top-p normalizes over the top-k set, before min-p */
    if (top_k) {
        sample_select_top(s->work, n, k, s->cands);
        if (top_p)
            for (int32_t i = 0; i < k; i++)
                z += weight(ts, s->cands[i].logit);
    } else {
        if (top_p)
            z = sample_sum_exp(s->work, n, ts.max, ts.inv_temp);
        if (min_p) {
            /* fold the threshold scan into building the candidate list */
            float thr = ts.max + logf(p->min_p) / ts.inv_temp;
            k = 0;
            for (int32_t i = 0; i < n; i++)
                if (s->work[i] >= thr)
                    s->cands[k++] = (struct cand){s->work[i], i};
        } else {
            sample_select_top(s->work, n, n, s->cands);
        }
    }
    if (min_p)
        k = filter_min_p(s->cands, k, p->min_p, ts);
    if (top_p)
        k = truncate_top_p(s->cands, k, p->top_p, z, ts);
    return k;
}

/* Truncation sees the untempered logits (temperature is llama.cpp's last
 * stage); the draw is tempered. */
/* *k: the truncated candidates (0: the whole vocabulary), for post_probs. */
static int32_t sample_stochastic(struct sampler *s, float max, int32_t *k)
{
    struct temp_scale ts = {max, 1.0f / s->p.temp}, untempered = {max, 1.0f};
    *k = truncate_candidates(s, untempered);
    return *k > 0 ? draw_from(s, s->cands, *k, ts, NULL, 0) : draw_full(s, ts, NULL, 0);
}

/* The probability of token under the step's truncated distribution (k
 * candidates in s->cands, or the whole s->work when k is 0), summed in the
 * order the draws sum. */
static double candidate_prob(const struct sampler *s, int32_t k, struct temp_scale ts, int32_t token)
{
    if (k == 0)
        return weight(ts, s->work[token]) / sample_sum_exp(s->work, s->n_vocab, ts.max, ts.inv_temp);
    double total = 0.0, w = 0.0;
    for (int32_t i = 0; i < k; i++) {
        total += weight(ts, s->cands[i].logit);
        if (s->cands[i].id == token)
            w = weight(ts, s->cands[i].logit);
    }
    return w / total;
}

/* candidate_prob of each of tokens[0..n) (distinct) into p, the normalizer summed once as it sums it. */
static void candidate_probs(const struct sampler *s, int32_t k, struct temp_scale ts, const int32_t *tokens, int32_t n,
                            double *p)
{
    double total = 0.0;
    for (int32_t j = 0; j < n; j++)
        p[j] = k == 0 ? weight(ts, s->work[tokens[j]]) : 0.0;
    if (k == 0)
        total = sample_sum_exp(s->work, s->n_vocab, ts.max, ts.inv_temp);
    for (int32_t i = 0; i < k; i++) {
        float w = weight(ts, s->cands[i].logit);
        total += w;
        for (int32_t j = 0; j < n; j++)
            if (s->cands[i].id == tokens[j])
                p[j] = w;
    }
    for (int32_t j = 0; j < n; j++)
        p[j] /= total;
}

/* Speculative rejection sampling of q's draft q->tokens[at]: keep it with
 * probability min(1, p(x) / q(x)), else draw from max(0, p - q)
 * renormalized (sample_residual_pick: within q's support, or p outside it).
 * For a one-hot q (a deterministic proposal) that is: keep draft with
 * probability p(draft), else draw from p without it; the result is
 * distributed as p exactly: P(x = draft) = p(draft), and for y != draft,
 * P(x = y) = (1 - p(draft)) * p(y) / (1 - p(draft)) = p(y). */
static int32_t verify_stochastic(struct sampler *s, float max, const struct sample_proposal *q, int32_t at,
                                 bool *accepted, int32_t *k)
{
    struct temp_scale ts = {max, 1.0f / s->p.temp}, untempered = {max, 1.0f};
    *k = truncate_candidates(s, untempered);
    double p_q[SAMPLE_PROPOSAL_MAX];
    candidate_probs(s, *k, ts, q->tokens, q->n, p_q);
    *accepted = sample_uniform01(s) * q->probs[at] < p_q[at];
    if (*accepted)
        return q->tokens[at];
    int32_t j = sample_residual_pick(s, q, p_q);
    if (j >= 0)
        return q->tokens[j];
    return *k > 0 ? draw_from(s, s->cands, *k, ts, q->tokens, q->n) : draw_full(s, ts, q->tokens, q->n);
}

/* post_sampling_probs on the fast path: the token's probability and the
 * best alternatives under the step's truncated, tempered distribution (k
 * candidates in s->cands, 0: all of s->work); greedy: the token alone, with
 * probability 1, as llama-server lists it. The chain path fills them itself. */
static void post_probs_fast(struct sampler *s, float max, int32_t k, struct sample_result *out)
{
    int32_t n_top = s->p.n_logprobs;
    if (s->p.temp <= 0.0f) {
        out->prob = 1.0f;
        out->logprob = 0.0f;
        out->n_top = n_top < 1 ? n_top : 1;
        if (out->n_top)
            out->top[0] = (struct sample_logprob){out->token, 0.0f, 1.0f};
        return;
    }
    struct temp_scale ts = {max, 1.0f / s->p.temp};
    out->prob = (float)candidate_prob(s, k, ts, out->token);
    out->logprob = logf(out->prob);
    /* the normalizer once, in the order candidate_prob sums it (before the selection below reorders s->cands) */
    double total = 0.0;
    if (k == 0)
        total = sample_sum_exp(s->work, s->n_vocab, ts.max, ts.inv_temp);
    for (int32_t i = 0; i < k; i++)
        total += weight(ts, s->cands[i].logit);
    struct cand best[SAMPLE_MAX_LOGPROBS];
    if (k == 0) {
        n_top = n_top < s->n_vocab ? n_top : s->n_vocab;
        sample_select_top(s->work, s->n_vocab, n_top, best);
    } else {
        n_top = n_top < k ? n_top : k;
        for (int32_t i = 0; i < n_top; i++) /* selection: n_top is at most SAMPLE_MAX_LOGPROBS */
            for (int32_t j = i + 1; j < k; j++)
                if (better(s->cands[j], s->cands[i]))
                    swap_cand(&s->cands[i], &s->cands[j]);
        memcpy(best, s->cands, (size_t)n_top * sizeof *best);
    }
    qsort(best, (size_t)n_top, sizeof *best, cmp_better_first);
    out->n_top = n_top;
    for (int32_t i = 0; i < n_top; i++) {
        float p = (float)(weight(ts, best[i].logit) / total);
        out->top[i] = (struct sample_logprob){best[i].id, logf(p), p};
    }
}

/* ---- logprobs ------------------------------------------------------------ */

static void fill_logprobs(struct sampler *s, float max, struct sample_result *out)
{
    float lse = max + (float)log(sample_sum_exp(s->work, s->n_vocab, max, 1.0f));
    out->logprob = s->work[out->token] - lse;
    int32_t n_top = s->p.n_logprobs < s->n_vocab ? s->p.n_logprobs : s->n_vocab;
    out->n_top = n_top;
    if (n_top == 0)
        return;
    struct cand top[SAMPLE_MAX_LOGPROBS];
    sample_select_top(s->work, s->n_vocab, n_top, n_top < s->n_vocab ? top : s->cands);
    const struct cand *src = n_top < s->n_vocab ? top : s->cands;
    struct cand sorted[SAMPLE_MAX_LOGPROBS];
    memcpy(sorted, src, (size_t)n_top * sizeof *sorted);
    qsort(sorted, (size_t)n_top, sizeof *sorted, cmp_better_first);
    for (int32_t i = 0; i < n_top; i++)
        out->top[i] = (struct sample_logprob){.token = sorted[i].id, .logprob = sorted[i].logit - lse};
}

/* ---- the step ------------------------------------------------------------ */

/* The grammar mask, the biases and the penalties (on the chain: the
 * stages that lead the order, *first the index of the next) on a copy of
 * logits in s->work; its maximum and the first index holding it. */
static ks_status prepare(struct sampler *s, const float *logits, const int32_t *history, int32_t n_history,
                         float *max, int32_t *argmax, int *first)
{
    if (!s || !logits)
        return ks_fail(KS_ERR_INVALID_ARG, "sample_next: NULL argument");
    if (n_history < 0 || (n_history > 0 && !history))
        return ks_fail(KS_ERR_INVALID_ARG, "sample_next: history of %d tokens with %s pointer",
                       (int)n_history, history ? "a" : "a NULL");
    memcpy(s->work, logits, (size_t)s->n_vocab * sizeof *s->work);
    if (s->grammar) {
        ks_status st = grammar_mask(s->grammar, s->work, s->n_vocab);
        if (st)
            return st;
    }
    for (int i = 0; i < s->p.n_biases; i++)
        s->work[s->biases[i].token] += s->biases[i].bias;
    *first = 0;
    if (s->chain) {
        ks_status st = sample_chain_lead(s, history, n_history, first);
        if (st)
            return st;
    } else if (penalties_active(&s->p) && n_history > 0) {
        ks_status st = apply_penalties(s, history, n_history);
        if (st)
            return st;
    }
    if (!sample_max_index(s->work, s->n_vocab, argmax, max))
        return ks_fail(KS_ERR_RANGE, "sampler: the logits contain NaN or +inf");
    if (*max == -INFINITY)
        return ks_fail(KS_ERR_RANGE, "sampler: every logit is -inf");
    return KS_OK;
}

ks_status sample_next(struct sampler *s, const float *logits, const int32_t *history,
                      int32_t n_history, struct sample_result *out)
{
    if (!out)
        return ks_fail(KS_ERR_INVALID_ARG, "sample_next: NULL argument");
    float max;
    int32_t argmax;
    int first;
    ks_status st = prepare(s, logits, history, n_history, &max, &argmax, &first);
    if (st)
        return st;
    memset(out, 0, sizeof *out);
    bool unused;
    struct sample_result *post = s->p.post_sampling_probs ? out : NULL;
    int32_t k = 0;
    if (s->chain)
        st = sample_chain_pick(s, history, n_history, first, NULL, -1, &out->token, &unused, post);
    else if (s->p.temp <= 0.0f)
        out->token = argmax;
    else
        out->token = sample_stochastic(s, max, &k);
    if (st)
        return st;
    if (!post)
        fill_logprobs(s, max, out);
    else if (!s->chain)
        post_probs_fast(s, max, k, out);
    return s->grammar ? grammar_accept(s->grammar, out->token) : KS_OK;
}

bool sample_is_plain_greedy(const struct sampler *s)
{
    return s && s->p.temp <= 0.0f && !s->chain && !s->grammar && s->p.n_biases == 0 && !penalties_active(&s->p);
}

ks_status sample_greedy_token(const struct sampler *s, const float *logits, int32_t *token)
{
    if (!sample_is_plain_greedy(s) || !logits || !token)
        return ks_fail(KS_ERR_INVALID_ARG, "sample_greedy_token: NULL argument or a sampler that is not plain greedy");
    float max;
    if (!sample_max_index(logits, s->n_vocab, token, &max))
        return ks_fail(KS_ERR_RANGE, "sampler: the logits contain NaN or +inf");
    if (max == -INFINITY)
        return ks_fail(KS_ERR_RANGE, "sampler: every logit is -inf");
    return KS_OK;
}

ks_status sample_verify(struct sampler *s, const float *logits, const int32_t *history, int32_t n_history,
                        int32_t draft, struct sample_result *out, bool *accepted)
{
    struct sample_proposal one_hot = {.n = 1, .tokens = {draft}, .probs = {1.0f}};
    return sample_verify_proposal(s, logits, history, n_history, &one_hot, draft, out, accepted);
}

/* The index of draft in q, -1 when q is malformed or does not hold it. */
static int32_t proposal_index(const struct sample_proposal *q, int32_t n_vocab, int32_t draft)
{
    if (q->n < 1 || q->n > SAMPLE_PROPOSAL_MAX)
        return -1;
    int32_t at = -1;
    for (int32_t j = 0; j < q->n; j++) {
        if (q->tokens[j] < 0 || q->tokens[j] >= n_vocab || !(q->probs[j] > 0.0f))
            return -1;
        at = q->tokens[j] == draft ? j : at;
    }
    return at;
}

ks_status sample_verify_proposal(struct sampler *s, const float *logits, const int32_t *history, int32_t n_history,
                                 const struct sample_proposal *q, int32_t draft, struct sample_result *out,
                                 bool *accepted)
{
    if (!out || !accepted || !q)
        return ks_fail(KS_ERR_INVALID_ARG, "sample_verify: NULL argument");
    *accepted = false;
    if (!s || draft < 0 || draft >= s->n_vocab)
        return ks_fail(KS_ERR_INVALID_ARG, "sample_verify: draft token %d is outside the vocabulary (%d)", (int)draft,
                       s ? (int)s->n_vocab : 0);
    int32_t at = proposal_index(q, s->n_vocab, draft);
    if (at < 0)
        return ks_fail(KS_ERR_INVALID_ARG,
                       "sample_verify: the draft's proposal (%d tokens) must hold draft token %d, with tokens in the "
                       "vocabulary and probabilities above 0", (int)q->n, (int)draft);
    float max;
    int32_t argmax;
    int first;
    ks_status st = prepare(s, logits, history, n_history, &max, &argmax, &first);
    if (st)
        return st;
    memset(out, 0, sizeof *out);
    struct sample_result *post = s->p.post_sampling_probs ? out : NULL;
    int32_t k = 0;
    if (s->chain) {
        if ((st = sample_chain_pick(s, history, n_history, first, q, at, &out->token, accepted, post)))
            return st;
    } else if (s->p.temp <= 0.0f) {
        out->token = argmax;
        *accepted = argmax == draft;
    } else {
        out->token = verify_stochastic(s, max, q, at, accepted, &k);
    }
    if (!post)
        fill_logprobs(s, max, out);
    else if (!s->chain)
        post_probs_fast(s, max, k, out);
    return s->grammar ? grammar_accept(s->grammar, out->token) : KS_OK;
}

ks_status sample_final_distribution(struct sampler *s, const float *logits, const int32_t *history,
                                    int32_t n_history, const struct chain_cand **out, int32_t *n_out)
{
    if (!s || !s->chain)
        return ks_fail(KS_ERR_STATE, "sample_final_distribution: this sampler runs the fast path");
    float max;
    int32_t argmax;
    int first;
    ks_status st = prepare(s, logits, history, n_history, &max, &argmax, &first);
    return st ? st : sample_chain_final(s, history, n_history, first, out, n_out);
}

float sample_mirostat_mu(const struct sampler *s)
{
    return s->mirostat_mu;
}
