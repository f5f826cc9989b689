/* spec: the draft side of speculative decoding, as pure functions on token
 * ids. A speculator proposes the tokens that may come next; the target model
 * verifies them in one forward pass and the sampler (sample_verify) decides
 * which to keep, so nothing here can change what is generated, only how many
 * target passes it takes.
 *
 * Prompt lookup (spec_ngram_draft): the request's own prompt and output are
 * searched for the most recent earlier occurrence of their last n tokens, n
 * from SPEC_NGRAM_MAX down to SPEC_NGRAM_MIN (prompt-lookup decoding's
 * max_ngram_size 3; llama.cpp's lookup example searches n-grams of 1..4), and
 * the tokens that followed it are the draft. Input-grounded answers (summaries,
 * code edits, quoting RAG answers) repeat spans of their prompt, which this
 * finds.
 *
 * Draft length (spec_adapt): per request, an exponential moving average of
 * the chance a drafted token is accepted, a; with k drafts a pass yields
 * (1 - a^(k+1)) / (1 - a) tokens on average (acceptance stops at the first
 * rejection) and costs 1 + k * c decode steps, c the cost of one more token
 * in a step relative to a decode step (the scheduler's cost model). The
 * length is the k in [n_min, n_max] with the best tokens per unit of cost, or
 * 0 when no k beats plain decoding (one token per step) by 10%.
 * While it does not draft, the caller still checks what a 1-token draft
 * would have proposed against the token actually generated
 * (spec_adapt_observe with 1 drafted), so a request whose text turns
 * repetitive starts drafting again without paying for a verification.
 * Two rules keep a request whose n-gram drafts are not accepted within a few
 * percent of plain decoding (issue 25: at most 3% slower where nothing is
 * accepted; a draft model's cost is bounded by spec_draft_allowance instead,
 * and its shadow checks are rare, so they do not apply to it):
 * it drafts only once a tested token (a shadow check's, free) was accepted,
 * and a verification that keeps none of its drafts rests drafting for the
 * next SPEC_REST_MIN generated tokens, twice as long after each such
 * verification in a row (up to SPEC_REST_MAX), so a text that only now and
 * then matches its past pays for few rejected verifications; SPEC_REST_STREAK
 * shadow checks accepted in a row end a rest early (prompt lookup's matches
 * come in runs: a copy that starts again is seen at once, a chance match of
 * common tokens rarely twice in a row). Within a run of SPEC_RUN_MIN or more
 * tokens accepted in a row (s of them), the length is planned with the
 * higher of the EMA and (s + 1) / (s + 2), so a copy that has started gets
 * long drafts at once rather than after the EMA's climb. */
#ifndef KS_SPEC_H
#define KS_SPEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "status/status.h"

enum {
    SPEC_NGRAM_MAX = 3,   /* longest suffix looked up */
    SPEC_NGRAM_MIN = 1,   /* shortest */
    SPEC_DRAFT_LIMIT = 64 /* largest --draft-max / speculative.n_max */
};

/* SPEC_DRAFT: a draft model proposes (the scheduler runs it, sched.h); the
 * functions below serve the n-gram speculators. */
enum spec_type { SPEC_NONE = 0, SPEC_NGRAM = 1, SPEC_NGRAM_POOL = 2, SPEC_DRAFT = 3 };

/* "none" | "ngram" | "ngram-pool" (also llama-server's name, "ngram-mod") |
 * "draft" (also llama-server's "draft-simple");
 * false for another word. */
bool spec_parse_type(const char *text, enum spec_type *out);
const char *spec_type_name(enum spec_type t);

/* The n_max tokens that followed the most recent earlier occurrence of the
 * last n tokens of tokens[0, n_tokens) (the longest n first), continued past
 * the end of the text as if it repeated from there (the match copies its own
 * output); written to draft, their count returned (0: no match, or
 * n_max <= 0). The search looks
 * back at most SPEC_NGRAM_WINDOW tokens, so its cost per step is bounded. */
enum { SPEC_NGRAM_WINDOW = 8192 };
int32_t spec_ngram_draft(const int32_t *tokens, int32_t n_tokens, int32_t n_max, int32_t *draft);

/* The shared n-gram pool (--spec-type ngram-pool, llama-server's
 * ngram-mod): one table for every request, indexed by a hash of n tokens,
 * holding the token that last followed them. Every request's prompt and
 * output are added as it runs, so a request drafts from text any earlier
 * request read or wrote: a shared system prompt, a document summarized
 * twice, code edited in several rounds. Constant memory and cost per token;
 * n long enough (8 by default) that a match is rarely a coincidence. A draft
 * follows the pool one token at a time, hashing the last n tokens of the text
 * and the draft so far, until a key is missing.
 * Not thread-safe: the scheduler thread owns it. */
enum { SPEC_POOL_N_MIN = 2, SPEC_POOL_N_MAX = 64, SPEC_POOL_N_DEFAULT = 8 };
#define SPEC_POOL_BYTES_DEFAULT ((size_t)16 << 20)
struct spec_pool;
/* n tokens per key; the table takes the largest power-of-two slot count
 * within bytes (8 bytes a slot, at least 1024 slots). */
ks_status spec_pool_create(int32_t n, size_t bytes, struct spec_pool **out);
void spec_pool_free(struct spec_pool *p);
size_t spec_pool_bytes(const struct spec_pool *p);
/* Learn tokens[from, n_tokens): for each, the n tokens before it -> it.
 * salt (0: none) is mixed into every key: text learnt under one salt (a
 * tenant's cache_salt) drafts only for requests of the same salt. */
void spec_pool_add(struct spec_pool *p, uint64_t salt, const int32_t *tokens, int32_t n_tokens, int32_t from);
/* Up to n_max (<= SPEC_DRAFT_LIMIT) tokens the pool predicts after
 * tokens[0, n_tokens) under salt, written to draft; their count returned. */
int32_t spec_pool_draft(const struct spec_pool *p, uint64_t salt, const int32_t *tokens, int32_t n_tokens,
                        int32_t n_max, int32_t *draft);

/* Per-request acceptance statistics. */
enum { SPEC_REST_MIN = 2, SPEC_REST_MAX = 64, SPEC_REST_STREAK = 2, SPEC_RUN_MIN = 4 };
struct spec_adapt {
    double accept;      /* EMA of the chance one tested draft token is accepted, in [0, 1] */
    bool wary;          /* the two rules above apply (n-gram speculators) */
    bool seen_accept;   /* a tested token was accepted: drafting may start */
    int32_t streak;     /* tested tokens accepted in a row, the latest last */
    int32_t rest;       /* tokens the next fully rejected verification rests drafting for */
    int64_t rest_until; /* no drafting while the text is shorter than this many tokens */
};

/* For speculator type t; accept starts at 0.5, optimistic enough to draft at
 * once (a draft model) or at the first accepted shadow check (n-gram). */
void spec_adapt_init(struct spec_adapt *a, enum spec_type t);
/* Fold in one shadow check (or one verification) of `drafted` tokens, of
 * which the first `accepted` were kept. Each token tested counts once: the
 * accepted ones, and the first rejected one (those after it were never
 * tested). */
void spec_adapt_observe(struct spec_adapt *a, int32_t drafted, int32_t accepted);
/* Fold in one verification of `drafted` tokens (spec_adapt_observe) that
 * left the text n_text tokens long; none accepted rests drafting (above). */
void spec_adapt_verified(struct spec_adapt *a, int32_t drafted, int32_t accepted, int64_t n_text);
/* The draft length to ask for (see above) when the text is n_text tokens
 * long; extra_cost: c >= 0, the cost of one more token in a step as a
 * fraction of a decode step. n_min > 0 forces at least n_min. */
int32_t spec_adapt_len(const struct spec_adapt *a, int64_t n_text, int32_t n_min, int32_t n_max, double extra_cost);
/* One stream's step costs, for a caller without the scheduler's cost model
 * (kvserve generate): EMAs of a 1-token step and of one more token in a
 * step, in seconds (0 until measured). */
struct spec_cost {
    double step_s, extra_s;
};
/* One more token's cost (or a draft step's) as a fraction of a 1-token step
 * before it is measured; the scheduler's cost model guesses the same. */
#define SPEC_COST_GUESS 0.1
/* Fold in a step of 1 + k tokens that took `seconds`. A verification never
 * counts as more than k + 1 plain steps (a slower pass was preempted). A
 * plain step (k = 0) also relaxes the extra token's cost toward the guess by
 * 1/SPEC_COST_RELAX_STEPS: a dear estimate, from a pass that lost its core,
 * would otherwise stop the drafting that alone could measure it again. */
#define SPEC_COST_RELAX_STEPS 32
void spec_cost_learn(struct spec_cost *c, int32_t k, double seconds);
/* One more token's cost as a fraction of a 1-token step: measured, else SPEC_COST_GUESS. */
double spec_cost_ratio(const struct spec_cost *c);
/* Expected tokens per verification pass with k drafts at acceptance a. */
double spec_expected_tokens(double a, int32_t k);
/* Could a draft length up to n_max gain at extra_cost even if every draft
 * were accepted? False: a speculator this dear (a draft model as large as its
 * target) cannot pay for any work it does. */
bool spec_can_pay(int32_t n_max, double extra_cost);

/* The share of the target's work a draft model may take for a request
 * whose drafts are never accepted (issue 25: never more than 3% slower where
 * nothing is accepted), kept below 3% for the drafts' verification tokens. */
#define SPEC_DRAFT_IDLE_SHARE 0.02
/* The draft-model tokens a request that does not force drafting may have
 * had computed (its catch-up, windows, shadow checks and drafts) once its
 * text is n_text tokens of which n_accepted were accepted drafts: share of
 * the target's work on the text plus the work its accepted drafts saved (a
 * target decode step each), in draft tokens of cost_ratio (a draft token's
 * cost over a target token's: the models' weight bytes, or measured; <= 0:
 * unknown, no bound). So drafts never accepted cost at most `share` of the
 * target's work, and a request whose drafts are accepted earns the room to
 * go on drafting. */
double spec_draft_allowance(int64_t n_text, int64_t n_accepted, double share, double cost_ratio);

#endif
