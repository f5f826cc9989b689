/* sched: the continuous-batching scheduler. One scheduler thread owns the
 * engine (model context + KV cache) and runs steps; any thread may submit,
 * cancel and observe requests.
 *
 * Each step builds ONE batch. Decode comes first: every running sequence adds
 * its one token. The rest of the step's budget (max_batch_tokens) goes to
 * prefill chunks of admitted sequences, oldest first, at most prefill_chunk
 * tokens per sequence per step, so a long prompt never freezes the streams.
 *
 * Admission is FCFS while fewer than `parallel` sequences are active and the
 * engine says the cache can hold the next chunk. When a step does not fit
 * (KS_ERR_KV_FULL; the KV policy has already demoted what it could), the
 * step first drops its prefill chunks, then preempts the newest active
 * sequence: its pages are freed and it goes back to the head of the queue,
 * keeping its generated tokens, to be recomputed later. Cancellation frees
 * pages at the next step boundary.
 *
 * Speculative decoding (cfg.spec_type SPEC_NGRAM or SPEC_NGRAM_POOL,
 * spec/spec.h; the pool is the scheduler's, fed every speculating request's
 * prompt and output, and falls back to the request's own text; or SPEC_DRAFT,
 * a draft model on engine.draft, sched_draft.h: before the step's batch is
 * built, one pass of the draft model catches every speculating request up on
 * the tokens it has not seen and proposes each decoder's drafts greedily, one
 * batched draft forward per draft token, its cost measured into the cost
 * model; a request that does not draft lets its draft sequence lag and
 * checks the draft model's next proposal now and then, as the n-gram
 * speculators' shadow does, catching up or restarting from a window of its
 * last tokens; without --draft-min all of the draft model's work stays
 * within spec_draft_allowance): a decoding
 * request may add k draft tokens after its one token; the step then computes
 * logits for all k + 1 positions in one forward pass, and the engine's
 * sampler_verify keeps each draft with the target's own probability (greedy:
 * when it is the argmax), so the output is the one plain decoding gives
 * (greedy: the same tokens; sampling: the same distribution). The first
 * rejected position yields the target's own token, and every row after it is
 * dropped: the sequence is cut back with seq_truncate to the tokens kept (a
 * page the prefix cache keyed lies wholly below that length, since only
 * computed tokens are published, and the kv cache copies a shared page before
 * writing into it). Drafts count against the step's budget as what they cost
 * (the cost model's marginal token, like a prefill token beside decoders):
 * they come after every decoder's own token and before prefill chunks, and
 * while a request is prefilling they leave it at least half the budget. The
 * draft length adapts per request (spec_adapt) to its acceptance and to
 * that marginal cost. On KS_ERR_KV_FULL a step first drops its drafts.
 *
 * The scheduler has no HTTP and no tokenizer inside: requests are token ids
 * and events are token ids. The engine is a small table of functions so the
 * scheduling logic can be tested without a model (see sched_engine_model for
 * the real one over model/kv/sample). */
#ifndef KS_SCHED_H
#define KS_SCHED_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "sample/sample.h"
#include "spec/spec.h"
#include "status/status.h"

struct kv_cache;
struct model;

/* ---- engine ------------------------------------------------------------ */

/* Prompt tokens a prefix-cache lookup found, by tier. */
struct sched_prefix_hit {
    int32_t ram_tokens, disk_tokens;
    int32_t redis_tokens;     /* read from the shared tier */
};

/* One batch entry per token; want_logits marks the last token fed of a
 * sequence whose input is complete. logits rows come out in batch order, one
 * row of n_vocab floats for each entry with want_logits. */
struct sched_batch {
    int32_t n_tokens;
    const int32_t *tokens;
    const int32_t *pos;
    const int32_t *seq;
    const bool *want_logits;
    const bool *embed;       /* NULL: no embedding request in the batch; else per entry: it is one's */
};

struct sched_engine {
    void *ctx;
    int32_t n_vocab;
    ks_status (*seq_create)(void *ctx, int32_t *seq_out);
    void (*seq_free)(void *ctx, int32_t seq);
    /* Optional: a new sequence sharing every computed token of src (no copy;
     * a later write into a shared page copies it). Without it, the extra
     * choices of sched_submit_n compute the prompt themselves. */
    ks_status (*seq_fork)(void *ctx, int32_t src, int32_t *seq_out);
    /* All or nothing: KS_ERR_KV_FULL leaves every sequence unchanged. */
    ks_status (*forward)(void *ctx, const struct sched_batch *b, float *logits);
    ks_status (*sampler_create)(void *ctx, const struct sample_params *p, void **out);
    ks_status (*sampler_next)(void *ctx, void *sampler, const float *logits, const int32_t *history,
                              int32_t n_history, struct sample_result *out);
    void (*sampler_free)(void *ctx, void *sampler);
    /* Speculation (both or neither; cfg.spec_type needs them): the
     * sample_verify of sample.h on the engine's sampler, and cutting seq back
     * to its first len tokens (kv_seq_truncate). */
    ks_status (*sampler_verify)(void *ctx, void *sampler, const float *logits, const int32_t *history,
                                int32_t n_history, int32_t draft, struct sample_result *out, bool *accepted);
    ks_status (*seq_truncate)(void *ctx, int32_t seq, int32_t len);
    /* Optional: sample_verify_proposal on the engine's sampler, for a draft
     * model's sampled drafts (without it they are verified as deterministic
     * proposals, sampler_verify: as exact, accepted less often). */
    ks_status (*sampler_verify_proposal)(void *ctx, void *sampler, const float *logits, const int32_t *history,
                                         int32_t n_history, const struct sample_proposal *q, int32_t draft,
                                         struct sample_result *out, bool *accepted);
    /* Optional embeddings (both or neither): n_embd floats per input, and
     * forward with the batch's embedding requests (b->embed; each one whole
     * in the batch from position 0) pooled into embd, one row per embedding
     * sequence in the order of its first entry. */
    int32_t n_embd;
    ks_status (*forward_embd)(void *ctx, const struct sched_batch *b, float *logits, float *embd);
    /* Optional: can the cache take n_new more tokens right now (admission)? */
    bool (*can_admit)(void *ctx, int32_t n_new_tokens);
    /* Optional: the live cache, handed to between-step hooks (NULL if none). */
    struct kv_cache *(*cache)(void *ctx);
    void (*destroy)(void *ctx);

    /* Optional prefix cache (attach and publish, or none; page_tokens >= 1
     * with them). page_tokens: the size of a shareable page (also what
     * admission counts per fork for its copy-on-write; 0: count 1 token).
     * prefix_attach: seq holds tokens[0, len); map the cached
     * K/V that continue it along tokens, never past max_tokens; with use_disk
     * also read pages back from the SSD tier when reading is estimated faster
     * than computing (prefill_token_s: measured seconds per prefill token, 0
     * unknown). Adds what it found to *hit. prefix_publish: the K/V of
     * tokens[0, n_computed) are written; offer the full pages to others, and
     * with final (the sequence is about to be freed) its partial last page. */
    int32_t page_tokens;
    ks_status (*prefix_attach)(void *ctx, int32_t seq, const int32_t *tokens, int32_t max_tokens, bool use_disk,
                               double prefill_token_s, struct sched_prefix_hit *hit);
    void (*prefix_publish)(void *ctx, int32_t seq, const int32_t *tokens, int32_t n_computed, bool final);
    /* Optional, with the prefix cache: give a new sequence (no tokens yet) a
     * request's cache salt (kv_seq_set_salt); without it salted requests
     * share nothing with others. */
    ks_status (*seq_set_salt)(void *ctx, int32_t seq, uint64_t salt_lo, uint64_t salt_hi);
    /* Optional: the draft model's engine (cfg.spec_type SPEC_DRAFT needs it),
     * of the same n_vocab, with forward, seq_create, seq_free and seq_truncate
     * (and a prefix cache if it has one; its samplers are not used). Owned by
     * this engine: destroy() destroys it. */
    struct sched_engine *draft;
    /* Optional: the bytes of weights one decode token reads (0: unknown):
     * a draft's over its target's is what a draft token costs before its
     * steps are measured. */
    uint64_t weight_bytes;
};

/* The real engine: the model (borrowed, must outlive the engine), a KV cache
 * made from kv_cfg and a model context for max_batch_tokens on pool (both
 * owned: destroy() frees them). It computes embeddings (forward_embd) when the
 * model pools mean, cls or last at this call (model_set_pooling first).
 * Defined in sched_engine.c. */
struct kv_config;
struct threads_pool;
ks_status sched_engine_model(struct model *m, const struct kv_config *kv_cfg, int32_t max_batch_tokens,
                             struct threads_pool *pool, struct sched_engine *out);
/* Give a model engine the prefix cache's SSD tier (borrowed: close it after
 * the engine is destroyed). Pages evicted from RAM are written behind to it,
 * RAM misses look it up, and destroying the engine hands it every cached page
 * it does not have yet. */
struct store;
void sched_engine_model_set_store(struct sched_engine *e, struct store *store);
/* Give a model engine the shared tier (borrowed: close it after the engine is
 * destroyed). Pages are handed to it as they are computed; after RAM and the
 * SSD tier, a lookup continues the chain from it, and a page read from it is
 * kept locally (RAM, and the SSD tier if any). */
struct store_redis;
void sched_engine_model_set_redis(struct sched_engine *e, struct store_redis *redis);
/* KV events: every full page key the engine's cache gains or loses goes to
 * events (borrowed; NULL: none). key_layout: the cache's (kv_key_layout), for
 * the events' snapshots. */
struct store_events;
struct kv_key_layout;
void sched_engine_model_set_events(struct sched_engine *e, struct store_events *events);
void sched_engine_model_key_layout(const struct sched_engine *e, struct kv_key_layout *out);
/* Give a model engine a draft model (speculative decoding, SPEC_DRAFT): an
 * engine over draft (borrowed, must outlive the engine) with a KV cache made
 * from draft_cfg that shares e's budget (kv_share_budget: one limit, one count
 * of bytes used; draft_cfg's mem_budget is ignored) and a model context for
 * max_batch_tokens on pool. Its pages are prefix-cached in its own cache
 * under draft_cfg's fingerprint mixed with "draft" (so it differs from the
 * target's even when the target is its own draft), never in the SSD or
 * shared tiers. The caller has checked the
 * vocabularies. Errors: KS_ERR_STATE (e has a draft already), kv_create's and
 * model_ctx_create's, KS_ERR_KV_FULL (no room for a draft page, with the
 * numbers). */
ks_status sched_engine_model_add_draft(struct sched_engine *e, struct model *draft, const struct kv_config *draft_cfg,
                                       int32_t max_batch_tokens, struct threads_pool *pool);
/* The same draft engine on its own, its cache sharing target_kv's budget (for
 * a caller without a scheduler: `kvserve generate` drafts for its one
 * sequence with it and a drafter). The caller destroys it before target_kv. */
ks_status sched_engine_model_draft(struct kv_cache *target_kv, struct model *draft, const struct kv_config *draft_cfg,
                                   int32_t max_batch_tokens, struct threads_pool *pool, struct sched_engine *out);


/* ---- the draft model's passes ---------------------------------------------- */

/* The draft model's side of speculative decoding (cfg.spec_type SPEC_DRAFT,
 * --model-draft), sched_draft.c; the scheduler runs it, and so does
 * `kvserve generate` for its one sequence. The draft model runs on an
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
 *              request's previous draft in one batch, stopping a request's
 *              drafts before the first token whose best candidate the draft
 *              model gives a probability below p_min (llama-server's
 *              --draft-p-min, with the probability over the whole
 *              vocabulary). A greedy request's draft is the argmax; a
 *              sampling request's is drawn from q, the draft model's
 *              distribution under the request's temperature, top-k, top-p
 *              and min-p (sample_proposal_make), which verification needs to
 *              keep the target's distribution (sample_verify_proposal:
 *              accepted with min(1, p / q), where llama.cpp drafts greedily
 *              even for sampling requests and accepts a draft only when the
 *              target samples the same token)
 * A draft cache that is full, or a draft forward that fails, only ends this
 * pass's drafting: the target decodes on without drafts. The drafts are
 * proposals; nothing here can change what is generated (the scheduler's
 * sample_verify decides). */
struct sched_draft_seq {
    int32_t seq;                   /* the draft engine's sequence, -1 while none */
    int32_t base;                  /* it holds the request's text from here on, at positions 0.. (> 0: a
                                      window, sched_drafter_restart) */
    int32_t n_computed;            /* the request's tokens[base, base + n_computed) are in it */
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
    /* The request's sampling (NULL, or temp <= 0: greedy drafts) and its
     * drafts' random stream (state != 0; used only when sampling). */
    const struct sample_params *sampling;
    uint64_t *rng;
    int32_t draft[SPEC_DRAFT_LIMIT]; /* out: the proposals (n_draft <= k) */
    int32_t n_draft;
    struct sample_proposal q[SPEC_DRAFT_LIMIT]; /* out: (n_draft) the distribution each was drawn from (greedy: one-hot) */
    int32_t n_work;                /* out: tokens the draft model computed for it in the pass */
};

struct sched_drafter;

/* What a drafter made the draft model compute since it was made. */
struct sched_drafter_counts {
    uint64_t forwards;             /* draft forwards that ran */
    uint64_t tokens;               /* tokens they fed it (catch-up, windows and drafts) */
};

/* draft is borrowed and must outlive the drafter. max_batch: tokens per draft
 * forward (at most the draft engine's model context size); parallel: jobs per
 * pass at most; chunk: catch-up tokens of one request per pass; p_min in
 * [0, 1]. Errors: KS_ERR_INVALID_ARG (an engine without forward, seq_create,
 * seq_free or seq_truncate; p_min outside 0..1, naming --draft-p-min),
 * KS_ERR_NOMEM. */
ks_status sched_drafter_create(const struct sched_engine *draft, int32_t max_batch, int parallel, int32_t chunk,
                               float p_min, struct sched_drafter **out);
void sched_drafter_free(struct sched_drafter *d);

/* One pass over n <= parallel jobs (see above). */
void sched_drafter_run(struct sched_drafter *d, struct sched_draft_job *jobs, int n);
/* The mean seconds of the last pass's draft steps (each feeding every
 * still-drafting job one token; a catch-up of at most two tokens per drafting
 * job counts as one), 0 when it ran none: a cost model's input. */
double sched_drafter_step_seconds(const struct sched_drafter *d);
void sched_drafter_get_counts(const struct sched_drafter *d, struct sched_drafter_counts *out);

/* The request's draft sequence ends (it finished or was preempted): its
 * computed pages go to the draft prefix cache when share, the rows of
 * unverified drafts are dropped, and the sequence is freed. */
void sched_drafter_release(struct sched_drafter *d, struct sched_draft_seq *ds, const int32_t *tokens,
                           int32_t n_tokens, bool share);
/* Release it so, and have the next pass start it again from tokens[base]
 * (clamped to 0..n_tokens): a window of the text, positioned from 0, which
 * costs the draft model n_tokens - base tokens instead of catching up on
 * everything it has not seen. The draft model then proposes from the window
 * only; its proposals stay proposals (verification keeps the output). */
void sched_drafter_restart(struct sched_drafter *d, struct sched_draft_seq *ds, const int32_t *tokens,
                           int32_t n_tokens, int32_t base, bool share);

/* A request that does not force drafting (--draft-min 0) checks the draft
 * model's next proposal at most once in SCHED_DRAFT_SHADOW_EVERY generated
 * tokens while it does not draft, and a lagging draft sequence may restart
 * from the text's last SCHED_DRAFT_WINDOW tokens (the scheduler and
 * `generate` alike). */
enum { SCHED_DRAFT_SHADOW_EVERY = 8, SCHED_DRAFT_WINDOW = 64 };
/* For such a request with credit draft tokens left of its allowance
 * (spec_draft_allowance): the drafts (0..SPEC_DRAFT_LIMIT) a job of ds over
 * tokens[0, n_tokens) affords, and in *lead what it costs the draft model
 * before its first proposal: the catch-up on what ds has not seen or, with
 * *window, a fresh window (sched_drafter_restart from n_tokens -
 * SCHED_DRAFT_WINDOW) when that is cheaper and the job only checks
 * (!drafting: drafting wants the whole context) or cannot afford the
 * catch-up. 0 drafts: nothing is affordable, and nothing is to be restarted. */
int32_t sched_draft_afford(const struct sched_draft_seq *ds, int32_t n_tokens, bool drafting, double credit,
                           int32_t *lead, bool *window);


/* ---- scheduler ----------------------------------------------------------- */

struct sched_config {
    int parallel;            /* max active sequences (16) */
    int32_t max_batch_tokens;/* tokens per step (512) */
    int32_t prefill_chunk;   /* max prefill tokens of one sequence per step (256) */
    float max_itl_ratio;     /* > 0: while sequences decode, size a step's prefill so its predicted
                                time (measured step costs, see sched_cost.h) is at most this
                                times a decode-only step, but at least 1 token; 0 = off. (1.5) */
    int32_t ctx_size;        /* max tokens (prompt + generated) of one sequence (engine's, 0 = 4096) */
    int max_queue;           /* submissions beyond this many waiting fail with KS_ERR_BUSY-like STATE (256) */
    const int32_t *eog;      /* end-of-generation token ids (copied) */
    int n_eog;
    enum spec_type spec_type; /* SPEC_NONE (default), SPEC_NGRAM: prompt-lookup drafts, SPEC_NGRAM_POOL: the shared pool */
    int32_t draft_max;       /* drafts per verification at most, 1..SPEC_DRAFT_LIMIT (16) */
    int32_t draft_min;       /* at least this many or none, 0..draft_max (0) */
    int32_t pool_n;          /* SPEC_NGRAM_POOL: tokens per key, SPEC_POOL_N_MIN..MAX (SPEC_POOL_N_DEFAULT) */
    size_t pool_bytes;       /* SPEC_NGRAM_POOL: its table's size (SPEC_POOL_BYTES_DEFAULT) */
    float draft_p_min;       /* SPEC_DRAFT: a request's drafts stop before the first token whose
                                draft-model probability is below this, 0..1 (0: never; llama-server's
                                --draft-p-min default) */
};

void sched_config_default(struct sched_config *cfg);

enum sched_finish {
    SCHED_FINISH_NONE = 0,   /* a token event, more to come */
    SCHED_FINISH_STOP,       /* hit an end-of-generation token (not reported as a token) */
    SCHED_FINISH_LENGTH,     /* max_tokens or ctx_size reached */
    SCHED_FINISH_CANCELLED,  /* sched_cancel or shutdown */
    SCHED_FINISH_ERROR,      /* the engine failed; message in the event */
};

/* Delivered on the scheduler thread, in order, for each request: one event per
 * generated token (finish NONE), then exactly one final event with finish set
 * (token -1). The callback must be quick and must not call back into sched
 * except sched_cancel. After the final event the request's memory is gone. */
struct sched_event {
    uint64_t id;
    int32_t token;                    /* -1 on the final event */
    const struct sample_result *sample; /* the draw, with logprobs if asked; NULL on final */
    enum sched_finish finish;
    int32_t n_prompt;                 /* prompt tokens */
    int32_t n_generated;              /* tokens generated so far */
    int32_t n_cached;                 /* prompt tokens served from the prefix cache */
    int32_t n_drafted;                /* draft tokens verified so far (speculation) */
    int32_t n_accepted;               /* of which accepted */
    const char *error;                /* SCHED_FINISH_ERROR only */
    const float *embd;                /* an embedding request's final event with finish STOP: its
                                         engine n_embd floats (pooled, not normalized); else NULL */
};
typedef void (*sched_event_fn)(void *user, const struct sched_event *ev);

struct sched_request {
    const int32_t *prompt;   /* copied at submission */
    int32_t n_prompt;        /* >= 1 */
    int32_t max_tokens;      /* >= 0; 0 computes and caches the prompt, then finishes (LENGTH) */
    struct sample_params sampling;
    bool ignore_eog;         /* generate max_tokens even past end-of-generation tokens */
    /* Per-request draft bounds (set: use n_max, n_min instead of the config's
     * draft_max, draft_min; -1 keeps the config's; n_max 0 turns speculation
     * off for this request). No effect when cfg.spec_type is SPEC_NONE. */
    struct {
        bool set;
        int32_t n_max, n_min; /* -1 or 0..SPEC_DRAFT_LIMIT; n_min <= n_max once the defaults are in, unless n_max is 0 */
    } speculative;
    sched_event_fn on_event;
    void *user;
    /* vLLM's cache_salt as a digest (kv_salt_mix), {0, 0}: none. A salted
     * request shares prefix-cache pages only with requests of the same salt,
     * and its n_cached is rounded down to whole pages (no token-level oracle). */
    struct {
        uint64_t lo, hi;
    } cache_salt;
    /* An embedding request (the engine must have forward_embd): the prompt is
     * computed in one step (so n_prompt <= max_batch_tokens - parallel + 1,
     * else KS_ERR_RANGE), never served from nor offered to the prefix cache
     * (a non-causal model's K/V depend on the whole input, and pooling reads
     * every token's hidden state, which the cache does not keep), and its pages
     * are freed when it ends. Nothing is sampled (max_tokens and sampling are
     * ignored): its one final event carries the embedding. A step that has
     * no room for the whole prompt adds no prefill chunk after it, so it is
     * never passed over for good. */
    bool embed;
};

/* One choice of sched_submit_n: its own sampling (seed, grammar) and the
 * user pointer its events carry. */
struct sched_choice {
    struct sample_params sampling;
    void *user;
};

struct sched;

ks_status sched_create(const struct sched_config *cfg, const struct sched_engine *engine, struct sched **out);
/* Cancels everything still in flight (final events are delivered), stops the
 * thread and destroys the engine. */
void sched_free(struct sched *s);

/* Thread-safe. KS_ERR_INVALID_ARG for a bad request, KS_ERR_RANGE for a
 * prompt that does not fit ctx_size, KS_ERR_STATE when the queue is full or
 * the scheduler is shutting down. *id_out names the request. */
ks_status sched_submit(struct sched *s, const struct sched_request *r, uint64_t *id_out);
/* n choices continuing one prompt (r->sampling and r->user are ignored;
 * choice i uses choices[i]). The prompt is computed once, by the first
 * choice; when its last token's logits are ready, the others fork its
 * sequence (engine seq_fork: the pages are shared) and all n sample from
 * that row, each with its own sampler. From then on each choice is a request
 * of its own (its own events, preemption and finish). The group is admitted
 * only when n sequences fit under `parallel` and the cache can take the first
 * chunk plus a page per extra choice. ids_out[i] names choice i. Errors as
 * sched_submit, and KS_ERR_RANGE when n is not in 1..parallel. Cancelling a
 * choice before the fork cancels only that choice. */
ks_status sched_submit_n(struct sched *s, const struct sched_request *r, const struct sched_choice *choices, int n,
                         uint64_t *ids_out);
/* Thread-safe; frees the request's pages at the next step boundary. Unknown
 * or finished ids are ignored. */
void sched_cancel(struct sched *s, uint64_t id);
/* Stop admitting new submissions (they fail with KS_ERR_STATE). */
void sched_drain(struct sched *s);
/* Cancel every request in flight. */
void sched_cancel_all(struct sched *s);

/* Run fn(user, kv) on the scheduler thread between two steps and wait for it.
 * kv is the engine's live cache (NULL for engines without one). */
typedef void (*sched_hook_fn)(void *user, struct kv_cache *kv);
ks_status sched_between_steps(struct sched *s, sched_hook_fn fn, void *user);

/* Long work on the cache (a requantization of every page) in slices, so the
 * streams keep their pace: fn(user, kv, budget_s) runs on the scheduler
 * thread once between every two steps until it returns true, and the caller
 * waits for that. budget_s is the time one slice should take: while
 * sequences run, what --max-itl-ratio lets a step add to a decode-only step
 * (the decode-first budget a prefill chunk gets, at least half a decode-only
 * step; 5 ms before one was measured), with no request at all
 * SCHED_SLICE_IDLE_S; fn does at least one unit of work per call whatever
 * the budget. KS_ERR_STATE when the scheduler has stopped or stops
 * before fn is done. */
#define SCHED_SLICE_IDLE_S 0.05
typedef bool (*sched_slice_fn)(void *user, struct kv_cache *kv, double budget_s);
ks_status sched_run_sliced(struct sched *s, sched_slice_fn fn, void *user);

/* ---- stats --------------------------------------------------------------- */

#define SCHED_HIST_BUCKETS 14
/* Upper bounds in seconds of the latency histogram buckets (last is +Inf). */
extern const double sched_hist_bounds[SCHED_HIST_BUCKETS];

struct sched_hist {
    uint64_t counts[SCHED_HIST_BUCKETS]; /* per bucket, not cumulative */
    uint64_t n;
    double sum;                          /* seconds */
};

struct sched_request_info {
    uint64_t id;
    int32_t seq;                         /* kv sequence, -1 when not holding pages */
    int32_t n_prompt, n_generated, n_computed;
    int32_t n_cached;                    /* prompt tokens served from the prefix cache */
    bool running;                        /* admitted (else waiting) */
};

struct sched_stats {
    int n_running;                       /* admitted sequences */
    int n_waiting;
    uint64_t requests_done;
    uint64_t prompt_tokens;              /* prompt tokens computed (recomputes included) */
    uint64_t generated_tokens;
    uint64_t steps;
    uint64_t preemptions;
    uint64_t forked_choices;             /* choices of sched_submit_n started on the first choice's pages */
    uint64_t kv_full_events;             /* steps that did not fit at first */
    /* speculation */
    uint64_t spec_draft_tokens;          /* draft tokens verified */
    uint64_t spec_accepted_tokens;       /* of which accepted */
    uint64_t spec_verifications;         /* verifications (a request's k + 1 tokens in a step) */
    uint64_t spec_shadow_checks;         /* tokens checked against a 1-token proposal while not drafting */
    uint64_t spec_draft_forwards;        /* a draft model's forwards (--model-draft) */
    uint64_t spec_draft_model_tokens;    /* tokens they computed */
    double max_step_seconds;
    /* prefix cache */
    uint64_t prefix_lookups;             /* admissions that looked the prompt up */
    uint64_t prefix_hit_ram_tokens;      /* tokens found at admission in RAM */
    uint64_t prefix_hit_disk_tokens;     /* ... read back from the SSD tier */
    uint64_t prefix_hit_redis_tokens;    /* ... read from the shared (Redis) tier */
    uint64_t prefix_shared_tokens;       /* tokens taken during prefill from a request computing the same prefix */
    uint64_t prefix_miss_tokens;         /* prompt tokens left to compute after the lookup */
    uint64_t prefix_wait_steps;          /* steps a request waited for another to compute a shared page */
    struct sched_hist ttft;
    struct sched_hist itl;
};

void sched_get_stats(struct sched *s, struct sched_stats *out);
/* Snapshot of up to cap active/waiting requests; returns how many there are. */
int sched_list_requests(struct sched *s, struct sched_request_info *out, int cap);

/* Debug aid: check the scheduler's invariants under its lock (every request
 * in exactly one place: the queue, the running list, or the forks of one
 * first choice; the slots running and promised to forks within --parallel;
 * only running requests hold KV sequences, each its own; token counts within
 * their request's bounds). KS_ERR_INTERNAL names the first broken one.
 * Debug builds (no NDEBUG; -DKS_SCHED_CHECK=0/1 overrides) also run it after
 * every change of the lists and the requests' counts, and abort naming the
 * change on a broken invariant; Release builds never do. */
ks_status sched_check(struct sched *s);

#endif
