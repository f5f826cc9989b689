/* Internal to sched: the step-cost model behind --max-itl-ratio. While
 * sequences decode, every step carries their tokens, so a step's time is the
 * streams' inter-token latency. The model learns, from measured step times,
 *   decode(n)  the time of a decode-only step with n decoders (EMA per n), and
 *   c          the extra time per prefill token in a mixed step (EMA of
 *              (t - decode(n)) / n_prefill),
 * and sizes the prefill of the next step so decode(n) + k*c <= R * decode(n),
 * never below one token so a long prompt progresses every step. Pure
 * arithmetic on the numbers it is fed, so tests drive it with synthetic
 * timings. */
#ifndef KS_SCHED_COST_H
#define KS_SCHED_COST_H

#include <stdint.h>

enum { SCHED_COST_SLOTS = 64 }; /* decoder counts above this share the last slot */

struct sched_cost {
    double decode_s[SCHED_COST_SLOTS + 1]; /* [n]: EMA seconds of a decode-only step, 0 = not seen */
    double prefill_token_s;                /* EMA seconds per prefill token, 0 = not seen */
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
 * (off); 0 while no decode-only step was measured (run one to learn it);
 * n_decode (a probe) while no prefill cost is known; else the model's answer,
 * at least 1. */
int32_t sched_cost_prefill_limit(const struct sched_cost *c, int32_t n_decode, double ratio);

#endif
