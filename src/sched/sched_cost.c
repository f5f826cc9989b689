/* The step-cost model of sched_cost.h. */
#include "sched/sched_cost.h"

#include <string.h>

/* EMA weight of a new observation, and how far one observation may pull an
 * estimate up (a step stalled by another process must not collapse the
 * prefill budget for long; real increases still arrive within a few steps). */
static const double ALPHA = 0.25, MAX_JUMP = 3.0;

void sched_cost_init(struct sched_cost *c)
{
    memset(c, 0, sizeof *c);
}

static int slot(int32_t n)
{
    return n > SCHED_COST_SLOTS ? SCHED_COST_SLOTS : n < 0 ? 0 : (int)n;
}

static void ema(double *est, double x, double alpha)
{
    if (*est <= 0) {
        *est = x;
        return;
    }
    if (x > MAX_JUMP * *est)
        x = MAX_JUMP * *est;
    *est = (1 - alpha) * *est + alpha * x;
}

double sched_cost_decode(const struct sched_cost *c, int32_t n_decode)
{
    int s = slot(n_decode);
    for (int d = 0; d <= SCHED_COST_SLOTS; d++) {
        if (s - d >= 1 && c->decode_s[s - d] > 0)
            return c->decode_s[s - d];
        if (s + d <= SCHED_COST_SLOTS && c->decode_s[s + d] > 0)
            return c->decode_s[s + d];
    }
    return 0;
}

void sched_cost_observe(struct sched_cost *c, int32_t n_decode, int32_t n_prefill, double seconds)
{
    if (seconds <= 0 || (n_decode <= 0 && n_prefill <= 0))
        return;
    c->steps++;
    if (n_prefill == 0) {
        /* a refresh after many mixed steps is the only news in a while: weigh it more */
        int sl = slot(n_decode);
        ema(&c->decode_s[sl], seconds, c->steps - c->decode_at[sl] > SCHED_COST_REFRESH ? 0.5 : ALPHA);
        c->decode_at[sl] = c->steps;
        return;
    }
    if (n_decode == 0) {
        /* a prefill-only step amortizes the weights over many tokens: only a
         * first guess until a mixed step measures the marginal cost */
        if (c->prefill_token_s <= 0)
            c->prefill_token_s = seconds / n_prefill;
        return;
    }
    double d = sched_cost_decode(c, n_decode);
    if (d <= 0)
        return;
    double per = (seconds - d) / n_prefill;
    /* A step faster than the decode estimate says little about prefill
     * (timer noise); leaving it out keeps the estimate on the safe side. */
    if (per > 0)
        ema(&c->prefill_token_s, per, ALPHA);
}

int32_t sched_cost_prefill_limit(const struct sched_cost *c, int32_t n_decode, double ratio)
{
    if (n_decode <= 0 || ratio <= 0)
        return INT32_MAX;
    double d = sched_cost_decode(c, n_decode);
    if (d <= 0)
        return 0;
    /* stale for this many decoders: measure it (a count never measured
     * borrows its neighbour's value for at most SCHED_COST_REFRESH steps) */
    if (c->steps - c->decode_at[slot(n_decode)] >= SCHED_COST_REFRESH)
        return 0;
    if (c->prefill_token_s <= 0)
        return n_decode;
    /* the epsilon keeps an exact quotient (36.0 computed as 35.99999...) whole */
    double allowed = (ratio - 1.0) * d / c->prefill_token_s + 1e-9;
    if (allowed < 1)
        return 1;
    return allowed > 1e9 ? INT32_MAX : (int32_t)allowed;
}

double sched_cost_token_ratio(const struct sched_cost *c, int32_t n_decode)
{
    double d = sched_cost_decode(c, n_decode);
    return d > 0 && c->prefill_token_s > 0 ? c->prefill_token_s / d : 0.0;
}

void sched_cost_observe_draft(struct sched_cost *c, double seconds)
{
    if (seconds > 0)
        ema(&c->draft_step_s, seconds, ALPHA);
}

double sched_cost_draft_ratio(const struct sched_cost *c, int32_t n_decode)
{
    double d = sched_cost_decode(c, n_decode);
    return d > 0 && c->draft_step_s > 0 ? c->draft_step_s / d : 0.0;
}
