/* Internal to sched: the draft model's side of speculative decoding
 * (cfg.spec_type SPEC_DRAFT, --model-draft). The draft model runs on an
 * engine of its own (sched_engine.draft), whose KV cache shares the target's
 * budget (kv_share_budget) and prefix-caches its pages like the target's.
 *
 * Each speculating request has a draft sequence (struct sched_draft_seq)
 * holding the draft model's K/V of a prefix of the request's tokens,
 * tokens[0, n_computed), followed by the draft tokens it was fed in the last
 * pass (fed[]). One pass (sched_drafter_run) takes the step's jobs, one per
 * request, and does, for all of them together:
 *   reconcile  the fed drafts the target kept become computed tokens; the rows
 *              of the others are cut off (seq_truncate, so a keyed page is
 *              never written); a fresh sequence first maps what the draft
 *              prefix cache holds of the request's tokens
 *   catch up   the tokens the draft model has not seen (prompt chunks, the
 *              tokens accepted or sampled since), at most `chunk` per request
 *              and max_batch in all, in ONE forward of the draft model; the
 *              logits of a request's last token give its first draft
 *   draft      one forward per further draft token, every still-drafting
 *              request's previous draft in one batch, greedy (the argmax),
 *              stopping a request's drafts before the first token the draft
 *              model gives a probability below p_min (llama-server's
 *              --draft-p-min, with the probability over the whole vocabulary)
 * A draft cache that is full, or a draft forward that fails, only ends this
 * pass's drafting: the target decodes on without drafts. The drafts are
 * proposals; nothing here can change what is generated (the scheduler's
 * sample_verify decides). */
#ifndef KS_SCHED_DRAFT_H
#define KS_SCHED_DRAFT_H

#include <stdbool.h>
#include <stdint.h>

#include "sched/sched.h"
#include "sched/sched_cost.h"

struct sched_draft_seq {
    int32_t seq;                   /* the draft engine's sequence, -1 while none */
    int32_t n_computed;            /* the request's tokens[0, n_computed) are in it */
    int32_t fed[SPEC_DRAFT_LIMIT]; /* (n_fed) then these draft tokens, at n_computed on */
    int32_t n_fed;
};

void sched_draft_seq_init(struct sched_draft_seq *ds);

struct sched_draft_job {
    struct sched_draft_seq *ds;
    const int32_t *tokens;         /* the request's text (n_tokens) */
    int32_t n_tokens;
    int32_t k;                     /* drafts wanted after tokens (0: only catch up) */
    bool share;                    /* may map and offer draft prefix-cache pages */
    uint64_t salt_lo, salt_hi;     /* the request's cache salt, 0 0: none */
    int32_t draft[SPEC_DRAFT_LIMIT]; /* out: the proposals (n_draft <= k) */
    int32_t n_draft;
};

struct sched_drafter;

/* draft is borrowed (the target engine owns it). max_batch: tokens per draft
 * forward (the draft engine's model context size); parallel: jobs per pass at
 * most; chunk: catch-up tokens of one request per pass; p_min in [0, 1]. */
ks_status sched_drafter_create(const struct sched_engine *draft, int32_t max_batch, int parallel, int32_t chunk,
                               float p_min, struct sched_drafter **out);
void sched_drafter_free(struct sched_drafter *d);

/* One pass over n <= parallel jobs (see above). The draft steps after the
 * catch up are timed into cost (sched_cost_observe_draft). */
void sched_drafter_run(struct sched_drafter *d, struct sched_draft_job *jobs, int n, struct sched_cost *cost);

/* The request's draft sequence ends (it finished or was preempted): its
 * computed pages go to the draft prefix cache when share, the rows of
 * unverified drafts are dropped, and the sequence is freed. */
void sched_drafter_release(struct sched_drafter *d, struct sched_draft_seq *ds, const int32_t *tokens,
                           int32_t n_tokens, bool share);

#endif
