/* sample: the general chain, llama.cpp's sampler chain on a candidate
 * array, for every configuration the fast path (sample.c) does not cover:
 * DRY, top-n-sigma, typical-p, XTC, dynamic temperature, mirostat, min_keep
 * and any stage order. Each stage is written after llama.cpp's
 * (src/llama-sampler.cpp, common/sampling.cpp); where this file departs from
 * it, a comment says why. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sample/sample.h"
#include "sample/sample_internal.h"

/* mirostat 1 estimates the Zipf exponent from this many top tokens (llama.cpp's m) */
#define MIROSTAT_M 100

/* ---- names and the order ------------------------------------------------ */

static const enum sample_stage default_order[] = {
    SAMPLE_STAGE_PENALTIES, SAMPLE_STAGE_DRY,   SAMPLE_STAGE_TOP_N_SIGMA, SAMPLE_STAGE_TOP_K,       SAMPLE_STAGE_TYPICAL_P,
    SAMPLE_STAGE_TOP_P,     SAMPLE_STAGE_MIN_P, SAMPLE_STAGE_XTC,         SAMPLE_STAGE_TEMPERATURE,
};
#define N_DEFAULT_ORDER ((int)(sizeof default_order / sizeof default_order[0]))

static const struct {
    const char *name;
    enum sample_stage stage;
} stage_names[] = {
    /* canonical (common_sampler_type_to_str) first */
    {"penalties", SAMPLE_STAGE_PENALTIES}, {"dry", SAMPLE_STAGE_DRY},     {"top_n_sigma", SAMPLE_STAGE_TOP_N_SIGMA},
    {"top_k", SAMPLE_STAGE_TOP_K},         {"typ_p", SAMPLE_STAGE_TYPICAL_P}, {"top_p", SAMPLE_STAGE_TOP_P},
    {"min_p", SAMPLE_STAGE_MIN_P},         {"xtc", SAMPLE_STAGE_XTC},     {"temperature", SAMPLE_STAGE_TEMPERATURE},
    /* llama-server's alternative names */
    {"top-k", SAMPLE_STAGE_TOP_K},         {"top-p", SAMPLE_STAGE_TOP_P}, {"top-n-sigma", SAMPLE_STAGE_TOP_N_SIGMA},
    {"nucleus", SAMPLE_STAGE_TOP_P},       {"typical-p", SAMPLE_STAGE_TYPICAL_P}, {"typical", SAMPLE_STAGE_TYPICAL_P},
    {"typ-p", SAMPLE_STAGE_TYPICAL_P},     {"typ", SAMPLE_STAGE_TYPICAL_P}, {"min-p", SAMPLE_STAGE_MIN_P},
    {"temp", SAMPLE_STAGE_TEMPERATURE},
};

bool sample_stage_from_name(const char *name, enum sample_stage *out)
{
    for (size_t i = 0; name && i < sizeof stage_names / sizeof stage_names[0]; i++)
        if (!strcmp(name, stage_names[i].name)) {
            *out = stage_names[i].stage;
            return true;
        }
    return false;
}

const char *sample_stage_name(enum sample_stage st)
{
    for (size_t i = 0; i < sizeof stage_names / sizeof stage_names[0]; i++)
        if (stage_names[i].stage == st)
            return stage_names[i].name;
    return "?";
}

int sample_default_order(enum sample_stage *out)
{
    memcpy(out, default_order, sizeof default_order);
    return N_DEFAULT_ORDER;
}

static int order_of(const struct sample_params *p, const enum sample_stage **order)
{
    *order = p->n_order > 0 ? p->order : default_order;
    return p->n_order > 0 ? p->n_order : N_DEFAULT_ORDER;
}

/* Whether a stage changes anything with these parameters. */
static bool stage_active(const struct sample_params *p, enum sample_stage st)
{
    switch (st) {
    case SAMPLE_STAGE_PENALTIES:
        return p->repeat_last_n != 0 &&
               (p->repeat_penalty != 1.0f || p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f);
    case SAMPLE_STAGE_DRY: /* llama.cpp: multiplier != 0, base >= 1, window != 0 */
        return p->dry_multiplier != 0.0f && p->dry_base >= 1.0f && p->dry_penalty_last_n != 0;
    case SAMPLE_STAGE_TOP_N_SIGMA:
        return p->top_n_sigma > 0.0f;
    case SAMPLE_STAGE_TOP_K:
        return p->top_k > 0;
    case SAMPLE_STAGE_TYPICAL_P:
        return p->typical_p > 0.0f && p->typical_p < 1.0f;
    case SAMPLE_STAGE_TOP_P:
        return p->top_p < 1.0f;
    case SAMPLE_STAGE_MIN_P:
        return p->min_p > 0.0f;
    case SAMPLE_STAGE_XTC:
        return p->xtc_probability > 0.0f && p->xtc_threshold <= 0.5f;
    case SAMPLE_STAGE_TEMPERATURE:
        return true;
    }
    return false;
}

bool sample_chain_needed(const struct sample_params *p, int32_t n_vocab)
{
    (void)n_vocab;
    if (p->mirostat != 0 || p->min_keep > 1)
        return true;
    /* the fast path runs penalties, top-k, top-p, min-p, temperature in that order, each once */
    static const enum sample_stage fast[] = {SAMPLE_STAGE_PENALTIES, SAMPLE_STAGE_TOP_K, SAMPLE_STAGE_TOP_P,
                                             SAMPLE_STAGE_MIN_P, SAMPLE_STAGE_TEMPERATURE};
    const enum sample_stage *order;
    int n = order_of(p, &order), next = 0;
    bool seen[SAMPLE_STAGE_TEMPERATURE + 1] = {0};
    for (int i = 0; i < n; i++) {
        if (!stage_active(p, order[i]))
            continue;
        while (next < 5 && fast[next] != order[i])
            next++;
        if (next == 5 || seen[order[i]])
            return true;
        seen[order[i]] = true;
    }
    /* a stage the parameters ask for but the order leaves out does not run: only the chain skips it */
    bool pen = stage_active(p, SAMPLE_STAGE_PENALTIES), tk = p->top_k > 0 && p->top_k < n_vocab;
    return !seen[SAMPLE_STAGE_TEMPERATURE] || p->dynatemp_range > 0.0f || (pen && !seen[SAMPLE_STAGE_PENALTIES]) ||
           (tk && !seen[SAMPLE_STAGE_TOP_K]) || (stage_active(p, SAMPLE_STAGE_TOP_P) && !seen[SAMPLE_STAGE_TOP_P]) ||
           (stage_active(p, SAMPLE_STAGE_MIN_P) && !seen[SAMPLE_STAGE_MIN_P]);
}

ks_status sample_chain_init(struct sampler *s)
{
    s->chain = malloc((size_t)s->n_vocab * sizeof *s->chain);
    s->dry_repeat = calloc((size_t)s->n_vocab, sizeof *s->dry_repeat);
    if (!s->chain || !s->dry_repeat)
        return ks_fail(KS_ERR_NOMEM, "sampler: out of memory for the sampler chain (%d tokens)", (int)s->n_vocab);
    return KS_OK;
}

void sample_chain_free(struct sampler *s)
{
    free(s->chain);
    free(s->dry_repeat);
    free(s->dry_scratch);
    s->chain = NULL;
}

/* ---- the candidate array ------------------------------------------------- */

struct chain {
    struct chain_cand *c;
    int32_t n;
    bool sorted; /* by logit, best first (ties: lower id) */
};

static int cmp_logit_desc(const void *pa, const void *pb)
{
    const struct chain_cand *a = pa, *b = pb;
    if (a->logit != b->logit)
        return a->logit > b->logit ? -1 : 1;
    return a->id < b->id ? -1 : a->id > b->id;
}

static void chain_sort(struct chain *ch)
{
    if (!ch->sorted)
        qsort(ch->c, (size_t)ch->n, sizeof *ch->c, cmp_logit_desc);
    ch->sorted = true;
}

/* llama.cpp's softmax: sorted best first, p = exp(logit - max) / sum. */
static void chain_softmax(struct chain *ch)
{
    chain_sort(ch);
    float max = ch->c[0].logit;
    double sum = 0.0;
    for (int32_t i = 0; i < ch->n; i++) {
        double e = ch->c[i].logit == -INFINITY ? 0.0 : exp((double)ch->c[i].logit - max);
        ch->c[i].p = (float)e;
        sum += e;
    }
    for (int32_t i = 0; i < ch->n; i++)
        ch->c[i].p = (float)(ch->c[i].p / sum);
}

/* ---- the stages ---------------------------------------------------------- */

static ks_status stage_penalties(struct sampler *s, struct chain *ch, const int32_t *history, int32_t n_history)
{
    const int32_t *win;
    int32_t n;
    ks_status st = sample_penalty_window(s, history, n_history, &win, &n);
    if (st)
        return st;
    for (int32_t i = 0; i < ch->n; i++) {
        int32_t c = s->counts[ch->c[i].id];
        if (c > 0)
            ch->c[i].logit = sample_penalize(&s->p, ch->c[i].logit, c);
    }
    for (int32_t i = 0; i < n; i++)
        s->counts[win[i]] = 0;
    ch->sorted = false;
    return KS_OK;
}

static ks_status stage_dry(struct sampler *s, struct chain *ch, const int32_t *history, int32_t n_history)
{
    int32_t *touched, n_touched;
    ks_status st = sample_dry_scan(s, history, n_history, &touched, &n_touched);
    if (st || n_touched == 0)
        return st;
    for (int32_t i = 0; i < ch->n; i++) {
        int32_t len = s->dry_repeat[ch->c[i].id];
        if (len > 0)
            ch->c[i].logit -= sample_dry_penalty(s, ch->c[i].id, len - 1);
    }
    for (int32_t i = 0; i < n_touched; i++)
        s->dry_repeat[touched[i]] = 0;
    ch->sorted = false;
    return KS_OK;
}

/* Keep logits within n standard deviations of the best (over the finite ones). */
static void stage_top_n_sigma(const struct sample_params *p, struct chain *ch)
{
    if (ch->n <= 1)
        return;
    float max = ch->c[0].logit;
    double sum = 0.0, acc = 0.0;
    int32_t valid = 0;
    for (int32_t i = 0; i < ch->n; i++)
        if (ch->c[i].logit != -INFINITY) {
            max = ch->c[i].logit > max ? ch->c[i].logit : max;
            sum += ch->c[i].logit;
            valid++;
        }
    double mean = valid > 0 ? sum / valid : 0.0;
    for (int32_t i = 0; i < ch->n; i++)
        if (ch->c[i].logit != -INFINITY)
            acc += ((double)ch->c[i].logit - mean) * ((double)ch->c[i].logit - mean);
    float std = valid > 0 ? (float)sqrt(acc / valid) : 0.0f;
    for (int32_t i = 0; i < ch->n; i++)
        if (ch->c[i].logit < max - p->top_n_sigma * std)
            ch->c[i].logit = -INFINITY;
    chain_softmax(ch);
}

static void stage_top_k(struct chain *ch, int32_t k)
{
    if (k <= 0)
        return;
    chain_sort(ch);
    ch->n = k < ch->n ? k : ch->n;
}

static void stage_top_p(const struct sample_params *p, struct chain *ch)
{
    chain_softmax(ch);
    double cum = 0.0;
    for (int32_t i = 0; i < ch->n; i++) {
        cum += ch->c[i].p;
        if (cum >= p->top_p && i + 1 >= p->min_keep) {
            ch->n = i + 1;
            return;
        }
    }
}

/* p >= min_p * p_max, i.e. logit >= max + ln(min_p); at least max(min_keep, 1) tokens. */
static void stage_min_p(const struct sample_params *p, struct chain *ch)
{
    if (ch->n == 0)
        return;
    chain_sort(ch);
    float thr = ch->c[0].logit + logf(p->min_p);
    int32_t i = 1;
    while (i < ch->n && (ch->c[i].logit >= thr || i < p->min_keep))
        i++;
    ch->n = i;
}

struct typical_key {
    float score; /* | -ln p - entropy | */
    int32_t at;  /* index in the chain */
};

static int cmp_typical(const void *pa, const void *pb)
{
    const struct typical_key *a = pa, *b = pb;
    if (a->score != b->score)
        return a->score < b->score ? -1 : 1;
    return a->at - b->at;
}

/* Locally typical sampling: keep the tokens whose surprise is closest to the
 * entropy until their mass exceeds typical_p. Tokens with p = 0 (masked)
 * add nothing to the entropy (llama.cpp's 0 * log 0 would make it NaN). */
static ks_status stage_typical(struct sampler *s, struct chain *ch)
{
    const struct sample_params *p = &s->p;
    chain_softmax(ch);
    double entropy = 0.0;
    for (int32_t i = 0; i < ch->n; i++)
        if (ch->c[i].p > 0.0f)
            entropy -= ch->c[i].p * log(ch->c[i].p);
    struct typical_key *key = malloc((size_t)ch->n * sizeof *key);
    if (!key)
        return ks_fail(KS_ERR_NOMEM, "sampler: out of memory for typical-p over %d tokens", (int)ch->n);
    for (int32_t i = 0; i < ch->n; i++)
        key[i] = (struct typical_key){
            ch->c[i].p > 0.0f ? (float)fabs(-log(ch->c[i].p) - entropy) : INFINITY, i};
    qsort(key, (size_t)ch->n, sizeof *key, cmp_typical);
    int32_t last = ch->n;
    double cum = 0.0;
    for (int32_t i = 0; i < ch->n; i++) {
        cum += ch->c[key[i].at].p;
        if (cum > p->typical_p && (p->min_keep == 0 || i >= p->min_keep - 1)) {
            last = i + 1;
            break;
        }
    }
    /* the kept tokens, most typical first */
    struct chain_cand *kept = malloc((size_t)last * sizeof *kept);
    if (!kept) {
        free(key);
        return ks_fail(KS_ERR_NOMEM, "sampler: out of memory for typical-p over %d tokens", (int)ch->n);
    }
    for (int32_t i = 0; i < last; i++)
        kept[i] = ch->c[key[i].at];
    memcpy(ch->c, kept, (size_t)last * sizeof *kept);
    free(kept);
    free(key);
    ch->n = last;
    ch->sorted = false;
    return KS_OK;
}

/* XTC: with probability xtc_probability, drop every token at or above the
 * threshold but the least likely of them. The coin is drawn from the
 * request's stream, and only when the stage can act (as llama.cpp draws
 * from its own). */
static void stage_xtc(struct sampler *s, struct chain *ch)
{
    const struct sample_params *p = &s->p;
    if (ch->n < 2)
        return;
    if (sample_uniform01(s) > p->xtc_probability)
        return;
    chain_softmax(ch);
    int32_t last = 0;
    for (int32_t i = 0; i < ch->n && ch->c[i].p >= p->xtc_threshold; i++)
        last = i;
    if (ch->n - last >= p->min_keep && last > 0) {
        memmove(ch->c, ch->c + last, (size_t)(ch->n - last) * sizeof *ch->c);
        ch->n -= last;
    }
}

/* temp <= 0: only the best stays (the others -inf, kept in the array). */
static void temperature_plain(struct chain *ch, float temp)
{
    if (temp > 0.0f) {
        for (int32_t i = 0; i < ch->n; i++)
            ch->c[i].logit /= temp;
        return;
    }
    int32_t best = 0;
    for (int32_t i = 1; i < ch->n; i++)
        if (ch->c[i].logit > ch->c[best].logit ||
            (ch->c[i].logit == ch->c[best].logit && ch->c[i].id < ch->c[best].id))
            best = i;
    for (int32_t i = 0; i < ch->n; i++)
        if (i != best)
            ch->c[i].logit = -INFINITY;
}

/* Dynamic temperature: temp +- range, scaled by the normalized entropy to
 * the power exponent. A zero temperature (range >= temp and no entropy)
 * keeps the best token, where llama.cpp would divide by zero. */
static void stage_temperature(const struct sample_params *p, struct chain *ch)
{
    if (p->dynatemp_range <= 0.0f) {
        temperature_plain(ch, p->temp);
        return;
    }
    if (ch->n <= 1)
        return;
    float min_temp = p->temp - p->dynatemp_range > 0.0f ? p->temp - p->dynatemp_range : 0.0f;
    float max_temp = p->temp + p->dynatemp_range;
    double max_entropy = -log(1.0 / ch->n);
    chain_softmax(ch);
    double entropy = 0.0;
    for (int32_t i = 0; i < ch->n; i++)
        if (ch->c[i].p > 0.0f)
            entropy -= ch->c[i].p * log(ch->c[i].p);
    double normalized = entropy / max_entropy;
    float dyn = min_temp + (max_temp - min_temp) * (float)pow(normalized, p->dynatemp_exponent);
    temperature_plain(ch, dyn);
}

/* ---- the draw ------------------------------------------------------------ */

/* Index of a draw from the chain's p, never one of ex[0..n_ex). */
static int32_t draw_index(struct sampler *s, const struct chain *ch, const int32_t *ex, int32_t n_ex)
{
    double total = 0.0;
    for (int32_t i = 0; i < ch->n; i++)
        if (!sample_in_set(ch->c[i].id, ex, n_ex))
            total += ch->c[i].p;
    double target = sample_uniform01(s) * total, cum = 0.0;
    int32_t last = -1;
    for (int32_t i = 0; i < ch->n; i++) {
        if (sample_in_set(ch->c[i].id, ex, n_ex) || ch->c[i].p <= 0.0f)
            continue;
        cum += ch->c[i].p;
        last = i;
        if (target < cum)
            return i;
    }
    if (last >= 0)
        return last; /* rounding left target at the very top */
    for (int32_t i = 0; i < ch->n; i++) /* every other token has p = 0 */
        if (!sample_in_set(ch->c[i].id, ex, n_ex))
            return i;
    return 0;
}

/* The chain index of token id, -1 when it is not a candidate. */
static int32_t chain_index(const struct chain *ch, int32_t id)
{
    int32_t at = -1;
    for (int32_t i = 0; i < ch->n; i++)
        if (ch->c[i].id == id)
            at = i;
    return at;
}

/* Draw from the final distribution, or verify q's token q->tokens[j_draft]
 * against it: keep it with probability min(1, p / q), else draw from
 * max(0, p - q) renormalized (the rejection sampler of sample.c; for a
 * one-hot q: keep it with probability p(draft), else draw from p without
 * it). Returns the chain index. */
static int32_t pick(struct sampler *s, const struct chain *ch, const struct sample_proposal *q, int32_t j_draft,
                    bool *accepted)
{
    *accepted = false;
    if (!q)
        return draw_index(s, ch, NULL, 0);
    double p_q[SAMPLE_PROPOSAL_MAX];
    int32_t at_q[SAMPLE_PROPOSAL_MAX];
    for (int32_t j = 0; j < q->n; j++) {
        at_q[j] = chain_index(ch, q->tokens[j]);
        p_q[j] = at_q[j] >= 0 ? ch->c[at_q[j]].p : 0.0;
    }
    int32_t at = at_q[j_draft];
    if (at >= 0 && sample_uniform01(s) * q->probs[j_draft] < p_q[j_draft]) {
        *accepted = true;
        return at;
    }
    if (ch->n == 1 && at >= 0) { /* the draft is the only candidate (rounding left its p below 1) */
        *accepted = true;
        return at;
    }
    int32_t j = sample_residual_pick(s, q, p_q);
    if (j >= 0 && at_q[j] >= 0)
        return at_q[j];
    return draw_index(s, ch, q->tokens, q->n);
}

/* ---- mirostat ------------------------------------------------------------ */

/* Mirostat 1: estimate the Zipf exponent s_hat from the top MIROSTAT_M
 * tokens, keep the top k that make the expected surprise mu. */
static void mirostat_v1(struct sampler *s, struct chain *ch)
{
    chain_softmax(ch);
    double sum_ti_bi = 0.0, sum_ti_sq = 0.0;
    for (int32_t i = 0; i < MIROSTAT_M - 1 && i < ch->n - 1; i++) {
        double t = log((double)(i + 2) / (i + 1));
        double b = log((double)ch->c[i].p / ch->c[i + 1].p);
        sum_ti_bi += t * b;
        sum_ti_sq += t * t;
    }
    double s_hat = sum_ti_bi / sum_ti_sq, eps = s_hat - 1.0;
    double k = pow(eps * pow(2.0, s->mirostat_mu) / (1.0 - pow((double)s->n_vocab, -eps)), 1.0 / s_hat);
    /* llama.cpp casts k to int; a NaN or huge k (one token left, or p = 0 below) keeps what a cast cannot */
    int32_t ki = isfinite(k) && k < (double)ch->n ? (int32_t)k : ch->n;
    stage_top_k(ch, ki > 1 ? ki : 1);
}

/* Mirostat 2: keep the tokens whose surprise -log2 p is at most mu (at least one). */
static void mirostat_v2(struct sampler *s, struct chain *ch)
{
    chain_softmax(ch);
    int32_t n = 0;
    while (n < ch->n && -log2f(ch->c[n].p) <= s->mirostat_mu)
        n++;
    ch->n = n > 0 ? n : 1;
}

/* ---- the chain ----------------------------------------------------------- */

ks_status sample_chain_lead(struct sampler *s, const int32_t *history, int32_t n_history, int *first)
{
    const enum sample_stage *order;
    int n = order_of(&s->p, &order);
    *first = 0;
    if (s->p.mirostat != 0) { /* llama.cpp's mirostat chain has no penalties and no DRY */
        *first = n;
        return KS_OK;
    }
    struct chain whole = {s->chain, s->n_vocab, false};
    for (; *first < n; (*first)++) {
        enum sample_stage st = order[*first];
        if (st != SAMPLE_STAGE_PENALTIES && st != SAMPLE_STAGE_DRY)
            return KS_OK;
        if (!stage_active(&s->p, st) || n_history == 0)
            continue;
        /* on the whole vocabulary the candidates are s->work itself */
        for (int32_t i = 0; i < s->n_vocab; i++)
            whole.c[i] = (struct chain_cand){s->work[i], 0.0f, i};
        ks_status err = st == SAMPLE_STAGE_PENALTIES ? stage_penalties(s, &whole, history, n_history)
                                                     : stage_dry(s, &whole, history, n_history);
        if (err)
            return err;
        for (int32_t i = 0; i < s->n_vocab; i++)
            s->work[i] = whole.c[i].logit;
    }
    return KS_OK;
}

/* The candidates: the whole vocabulary, or when the next active stage is
 * top-k, only its k best (the rest cannot matter to any stage). */
static void build_candidates(struct sampler *s, const enum sample_stage *order, int n, int first, struct chain *ch)
{
    int next = first;
    while (next < n && !stage_active(&s->p, order[next]))
        next++;
    int32_t k = s->p.top_k;
    if (s->p.mirostat == 0 && next < n && order[next] == SAMPLE_STAGE_TOP_K && k < s->n_vocab) {
        sample_select_top(s->work, s->n_vocab, k, s->cands);
        for (int32_t i = 0; i < k; i++)
            ch->c[i] = (struct chain_cand){s->cands[i].logit, 0.0f, s->cands[i].id};
        *ch = (struct chain){ch->c, k, false};
        return;
    }
    for (int32_t i = 0; i < s->n_vocab; i++)
        ch->c[i] = (struct chain_cand){s->work[i], 0.0f, i};
    *ch = (struct chain){ch->c, s->n_vocab, false};
}

static ks_status run_stage(struct sampler *s, enum sample_stage st, struct chain *ch, const int32_t *history,
                           int32_t n_history)
{
    const struct sample_params *p = &s->p;
    if (!stage_active(p, st))
        return KS_OK;
    switch (st) {
    case SAMPLE_STAGE_PENALTIES:
        return n_history > 0 ? stage_penalties(s, ch, history, n_history) : KS_OK;
    case SAMPLE_STAGE_DRY:
        return n_history > 0 ? stage_dry(s, ch, history, n_history) : KS_OK;
    case SAMPLE_STAGE_TOP_N_SIGMA:
        stage_top_n_sigma(p, ch);
        return KS_OK;
    case SAMPLE_STAGE_TOP_K:
        stage_top_k(ch, p->top_k);
        return KS_OK;
    case SAMPLE_STAGE_TYPICAL_P:
        return stage_typical(s, ch);
    case SAMPLE_STAGE_TOP_P:
        stage_top_p(p, ch);
        return KS_OK;
    case SAMPLE_STAGE_MIN_P:
        stage_min_p(p, ch);
        return KS_OK;
    case SAMPLE_STAGE_XTC:
        stage_xtc(s, ch);
        return KS_OK;
    case SAMPLE_STAGE_TEMPERATURE:
        stage_temperature(p, ch);
        return KS_OK;
    }
    return KS_OK;
}

/* The step's final distribution in ch (softmaxed), before the draw. */
static ks_status final_distribution(struct sampler *s, const int32_t *history, int32_t n_history, int first,
                                    struct chain *ch)
{
    const enum sample_stage *order;
    int n = order_of(&s->p, &order);
    *ch = (struct chain){s->chain, 0, false};
    build_candidates(s, order, n, first, ch);
    if (s->p.mirostat != 0) {
        temperature_plain(ch, s->p.temp);
        if (s->p.mirostat == 1)
            mirostat_v1(s, ch);
        else
            mirostat_v2(s, ch);
    } else {
        for (int i = first; i < n; i++) {
            ks_status st = run_stage(s, order[i], ch, history, n_history);
            if (st)
                return st;
        }
    }
    chain_softmax(ch);
    return KS_OK;
}

/* llama-server's post-sampling probabilities: the final distribution is
 * sorted best first, so its head is the alternatives. At temperature 0 only
 * the drawn token has a probability, and llama-server lists it alone. */
static void post_probs(const struct sampler *s, const struct chain *ch, int32_t at, struct sample_result *out)
{
    out->prob = ch->c[at].p;
    out->logprob = logf(ch->c[at].p);
    int32_t n = ch->n;
    while (n > 1 && ch->c[n - 1].p == 0.0f && s->p.temp <= 0.0f)
        n--;
    out->n_top = s->p.n_logprobs < n ? s->p.n_logprobs : n;
    for (int i = 0; i < out->n_top; i++)
        out->top[i] = (struct sample_logprob){ch->c[i].id, logf(ch->c[i].p), ch->c[i].p};
}

ks_status sample_chain_pick(struct sampler *s, const int32_t *history, int32_t n_history, int first,
                            const struct sample_proposal *q, int32_t j_draft, int32_t *token, bool *accepted,
                            struct sample_result *post)
{
    struct chain ch;
    *accepted = false;
    ks_status st = final_distribution(s, history, n_history, first, &ch);
    if (st)
        return st;
    int32_t at = pick(s, &ch, q, j_draft, accepted);
    /* mu follows the surprise of the token returned, so verification advances it as decoding does */
    if (s->p.mirostat != 0)
        s->mirostat_mu -= s->p.mirostat_eta * (-log2f(ch.c[at].p) - s->p.mirostat_tau);
    *token = ch.c[at].id;
    if (post)
        post_probs(s, &ch, at, post);
    return KS_OK;
}

ks_status sample_chain_final(struct sampler *s, const int32_t *history, int32_t n_history, int first,
                             const struct chain_cand **out, int32_t *n_out)
{
    struct chain ch;
    ks_status st = final_distribution(s, history, n_history, first, &ch);
    *out = ch.c;
    *n_out = st ? 0 : ch.n;
    return st;
}
