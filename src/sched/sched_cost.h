/* Internal to sched: the step-cost model behind --max-itl-ratio. While
 * sequences decode, every step carries their tokens, so a step's time is the
 * streams' inter-token latency. The model learns, from measured step times,
 *   decode(n)  the time of a decode-only step with n decoders (EMA per n), and
 *   c          the extra time per prefill token in a mixed step (EMA of
 *              (t - decode(n)) / n_prefill),
 * and sizes the prefill of the next step so decode(n) + k*c <= R * decode(n),
 * never below one token so a long prompt progresses in every step but one in
 * SCHED_COST_REFRESH: decode(n) grows as the streams' contexts grow, and
 * while every step is mixed it cannot be measured, so a decode-only step is
 * run when the estimate for n is that many steps old (without it the growth
 * would be charged to c). Pure arithmetic on the numbers it is fed, so tests
 * drive it with synthetic timings. */
#ifndef KS_SCHED_COST_H
#define KS_SCHED_COST_H

#include <stdint.h>

enum {
    SCHED_COST_SLOTS = 64,   /* decoder counts above this share the last slot */
    SCHED_COST_REFRESH = 32, /* steps after which decode(n) is measured again */
};

struct sched_cost {
    double decode_s[SCHED_COST_SLOTS + 1]; /* [n]: EMA seconds of a decode-only step, 0 = not seen */
    double prefill_token_s;                /* EMA seconds per prefill token, 0 = not seen */
    int64_t steps;                         /* steps observed */
    int64_t decode_at[SCHED_COST_SLOTS + 1]; /* step of the last decode-only measurement per slot */
    double draft_step_s;                   /* EMA seconds of one draft-model step (one token per drafting
                                              request: --model-draft), 0 = not seen */
};

void sched_cost_init(struct sched_cost *c);
/* Fold in one step that ran n_decode decode tokens and n_prefill prefill
 * tokens in `seconds`. */
void sched_cost_observe(struct sched_cost *c, int32_t n_decode, int32_t n_prefill, double seconds);
/* Estimated decode-only step time with n decoders (the nearest measured
 * count when n was never seen); 0 when nothing was measured yet. */
double sched_cost_decode(const struct sched_cost *c, int32_t n_decode);
/* Prefill tokens allowed beside n_decode decoders for a step of at most
 * ratio x a decode-only step: INT32_MAX without decoders or with ratio <= 0
 * (off); 0 while no decode-only step was measured for about n decoders, or
 * when that measurement is SCHED_COST_REFRESH steps old (run one to learn it);
 * n_decode (a probe) while no prefill cost is known; else the model's answer,
 * at least 1. */
int32_t sched_cost_prefill_limit(const struct sched_cost *c, int32_t n_decode, double ratio);
/* The cost of one more token in a step beside n_decode decoders (a prefill
 * token or a speculative draft) as a fraction of the decode-only step: the
 * marginal token's EMA over decode(n); 0 while either is unknown. What a
 * verification of k drafts costs is decode(n) * (1 + k * this). */
double sched_cost_token_ratio(const struct sched_cost *c, int32_t n_decode);
/* A draft model's steps (--model-draft): fold in one step that fed each
 * drafting request its last draft token, and the cost of such a step as a
 * fraction of the target's decode-only step beside n_decode decoders (0 while
 * either is unknown). Each draft token costs one such step, so a verification
 * of k drafts costs decode(n) * (1 + k * (token_ratio + draft_ratio)). */
void sched_cost_observe_draft(struct sched_cost *c, double seconds);
double sched_cost_draft_ratio(const struct sched_cost *c, int32_t n_decode);

#endif
