/* spec: prompt lookup and the adaptive draft length of spec.h. */
#include "spec/spec.h"

#include <math.h>
#include <string.h>

/* EMA weight of one tested token, and the least tokens-per-cost ratio over
 * plain decoding that is worth a verification (the estimate is noisy, and a
 * verification that gains nothing costs every stream in the step). */
static const double ALPHA = 0.1, MIN_GAIN = 1.10;

bool spec_parse_type(const char *text, enum spec_type *out)
{
    if (!strcmp(text, "none"))
        *out = SPEC_NONE;
    else if (!strcmp(text, "ngram"))
        *out = SPEC_NGRAM;
    else if (!strcmp(text, "ngram-pool") || !strcmp(text, "ngram-mod"))
        *out = SPEC_NGRAM_POOL;
    else if (!strcmp(text, "draft") || !strcmp(text, "draft-simple"))
        *out = SPEC_DRAFT;
    else
        return false;
    return true;
}

const char *spec_type_name(enum spec_type t)
{
    return t == SPEC_NGRAM ? "ngram" : t == SPEC_NGRAM_POOL ? "ngram-pool" : t == SPEC_DRAFT ? "draft" : "none";
}

/* The length, up to SPEC_NGRAM_MAX, of the match between the tokens ending
 * at e (not before lo) and the last tokens of the text. */
static int32_t match_len(const int32_t *tokens, int32_t n_tokens, int32_t e, int32_t lo)
{
    int32_t len = 0;
    while (len < SPEC_NGRAM_MAX && e - len >= lo && tokens[e - len] == tokens[n_tokens - 1 - len])
        len++;
    return len;
}

/* Does block[0, SCAN_BLOCK) hold token? Without an early exit, so the
 * compiler compares the block in one or two vector instructions: the scan
 * runs every step (a shadow check's lookup too), and most blocks of a text
 * do not hold its last token. */
enum { SCAN_BLOCK = 16 };
static bool block_has(const int32_t *block, int32_t token)
{
    int hit = 0;
    for (int32_t j = 0; j < SCAN_BLOCK; j++)
        hit |= block[j] == token;
    return hit != 0;
}

int32_t spec_ngram_draft(const int32_t *tokens, int32_t n_tokens, int32_t n_max, int32_t *draft)
{
    if (n_max <= 0 || !tokens || n_tokens < 2)
        return 0;
    int32_t lo = n_tokens > SPEC_NGRAM_WINDOW ? n_tokens - SPEC_NGRAM_WINDOW : 0;
    /* one backward scan for every n at once (a step of a tiny model costs
     * tens of microseconds, so three scans of the window would show):
     * end[n], the end of the most recent occurrence of the last n tokens
     * that is followed by at least one token */
    int32_t end[SPEC_NGRAM_MAX + 1];
    for (int32_t n = 0; n <= SPEC_NGRAM_MAX; n++)
        end[n] = -1;
    int32_t last = tokens[n_tokens - 1];
    for (int32_t e = n_tokens - 2; e >= lo && end[SPEC_NGRAM_MAX] < 0;) {
        if (e - (SCAN_BLOCK - 1) >= lo && !block_has(tokens + e - (SCAN_BLOCK - 1), last)) {
            e -= SCAN_BLOCK;
            continue;
        }
        if (tokens[e] == last)
            for (int32_t n = match_len(tokens, n_tokens, e, lo); n >= 1 && end[n] < 0; n--)
                end[n] = e;
        e--;
    }
    for (int32_t n = SPEC_NGRAM_MAX; n >= SPEC_NGRAM_MIN; n--) {
        if (end[n] < 0)
            continue;
        /* past the end, the continuation copies itself (as an LZ77 match
         * that overlaps its own output): text that repeats with period
         * n_tokens - from keeps repeating */
        int32_t from = end[n] + 1;
        for (int32_t j = 0; j < n_max; j++)
            draft[j] = from + j < n_tokens ? tokens[from + j] : draft[from + j - n_tokens];
        return n_max;
    }
    return 0;
}

void spec_adapt_init(struct spec_adapt *a, enum spec_type t)
{
    *a = (struct spec_adapt){.accept = 0.5, .wary = t != SPEC_DRAFT, .rest = SPEC_REST_MIN};
}

void spec_adapt_observe(struct spec_adapt *a, int32_t drafted, int32_t accepted)
{
    if (drafted <= 0)
        return;
    int32_t tested = accepted < drafted ? accepted + 1 : drafted;
    for (int32_t i = 0; i < tested; i++)
        a->accept = (1 - ALPHA) * a->accept + ALPHA * (i < accepted ? 1.0 : 0.0);
    a->seen_accept = a->seen_accept || accepted > 0;
    a->streak = accepted < drafted ? 0 : a->streak + accepted;
}

void spec_adapt_verified(struct spec_adapt *a, int32_t drafted, int32_t accepted, int64_t n_text)
{
    if (drafted <= 0)
        return;
    spec_adapt_observe(a, drafted, accepted);
    if (!a->wary)
        return;
    if (accepted > 0) {
        a->rest = SPEC_REST_MIN;
        return;
    }
    a->rest_until = n_text + a->rest; /* a->streak is 0: a rest ends early only on new hits */
    a->rest = a->rest < SPEC_REST_MAX / 2 ? 2 * a->rest : SPEC_REST_MAX;
}

double spec_expected_tokens(double a, int32_t k)
{
    double sum = 0, term = 1;
    for (int32_t i = 0; i <= k; i++, term *= a)
        sum += term;
    return sum;
}

/* The acceptance to plan with: the EMA, or within a run of SPEC_RUN_MIN or
 * more accepted tokens the rule of succession's (s + 1) / (s + 2) when that
 * is higher, so a copy that has started gets long drafts at once instead of
 * after the EMA's slow climb. */
static double run_accept(const struct spec_adapt *a)
{
    double run = a->wary && a->streak >= SPEC_RUN_MIN ? 1.0 - 1.0 / (a->streak + 2) : 0.0;
    return run > a->accept ? run : a->accept;
}

int32_t spec_adapt_len(const struct spec_adapt *a, int64_t n_text, int32_t n_min, int32_t n_max, double extra_cost)
{
    if (n_max <= 0)
        return 0;
    if (n_min > n_max)
        n_min = n_max;
    if (a->wary && (!a->seen_accept || (n_text < a->rest_until && a->streak < SPEC_REST_STREAK)))
        return n_min > 0 ? n_min : 0;
    if (extra_cost < 0)
        extra_cost = 0;
    int32_t best = 0;
    double best_rate = MIN_GAIN, accept = run_accept(a);
    for (int32_t k = n_min > 1 ? n_min : 1; k <= n_max; k++) {
        double rate = spec_expected_tokens(accept, k) / (1.0 + k * extra_cost);
        if (rate > best_rate) {
            best_rate = rate;
            best = k;
        }
    }
    return best > 0 ? best : n_min > 0 ? n_min : 0;
}

void spec_cost_learn(struct spec_cost *c, int32_t k, double seconds)
{
    if (!(seconds > 0) || k < 0)
        return;
    if (k == 0) {
        c->step_s = c->step_s > 0 ? 0.75 * c->step_s + 0.25 * seconds : seconds;
        double floor = SPEC_COST_GUESS * c->step_s;
        if (c->extra_s > floor)
            c->extra_s -= (c->extra_s - floor) / SPEC_COST_RELAX_STEPS;
        return;
    }
    if (!(c->step_s > 0) || seconds <= c->step_s)
        return;
    double extra = (seconds - c->step_s) / k;
    extra = extra < c->step_s ? extra : c->step_s;
    /* the first measurement weighs half against the guess, not a quarter
     * against nothing: a tiny model's extra token costs half a step or more */
    c->extra_s = c->extra_s > 0 ? 0.75 * c->extra_s + 0.25 * extra : 0.5 * SPEC_COST_GUESS * c->step_s + 0.5 * extra;
}

double spec_cost_ratio(const struct spec_cost *c)
{
    return c->step_s > 0 && c->extra_s > 0 ? c->extra_s / c->step_s : SPEC_COST_GUESS;
}

bool spec_can_pay(int32_t n_max, double extra_cost)
{
    const struct spec_adapt every_draft_accepted = {.accept = 1.0, .seen_accept = true};
    return spec_adapt_len(&every_draft_accepted, 0, 0, n_max, extra_cost) > 0;
}

double spec_draft_allowance(int64_t n_text, int64_t n_accepted, double share, double cost_ratio)
{
    if (!(cost_ratio > 0))
        return INFINITY;
    return (share * (double)(n_text > 0 ? n_text : 0) + (double)(n_accepted > 0 ? n_accepted : 0)) / cost_ratio;
}
