/* sample internals shared by the sampler's files and its tests. */
#ifndef KS_SAMPLE_INTERNAL_H
#define KS_SAMPLE_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "sample/sample.h"

/* exp(x), branch-free and vectorizable; 0 for x < -87 (and -inf). */
float sample_expf(float x);
/* Index of the first maximum of x[0..n) and its value; false if any value
 * is NaN or +inf (the outputs are then meaningless). */
bool sample_max_index(const float *x, int32_t n, int32_t *index_out, float *max_out);
/* sum_i exp((x[i] - shift) * scale), accumulated in double. */
double sample_sum_exp(const float *x, int32_t n, float shift, float scale);
/* Index of the first maximum (ties: the lowest index). */
int32_t sample_argmax(const float *x, int32_t n);

struct cand {
    float logit;
    int32_t id;
};

/* A candidate of the general chain: llama.cpp's llama_token_data. */
struct chain_cand {
    float logit;
    float p;     /* softmax of the logits, valid after chain_softmax */
    int32_t id;
};

/* DRY's processed breakers: (head, tail) sequences sorted by head. */
struct sample_dry_breakers {
    int32_t n;             /* sequences */
    int32_t *head;         /* (n) the token a sequence starts with, ascending */
    int32_t *tail_start;   /* (n + 1) sequence i's tail is tails[tail_start[i] .. tail_start[i + 1]) */
    int32_t *tails;        /* (tail_start[n]) the tokens after the head */
};

struct sampler {
    struct sample_params p;
    int32_t n_vocab;
    uint64_t rng[4];
    float *work;       /* (n_vocab) penalized logits of the current step */
    int32_t *counts;   /* (n_vocab) occurrences in the penalty window; all 0 between calls */
    struct cand *cands; /* (n_vocab) candidate set of the current step */
    struct grammar_state *grammar; /* NULL: unconstrained */
    struct sample_bias *biases; /* (p.n_biases) the sampler's copy of p.biases */
    /* the general chain (sample_chain.c); NULL on the fast path */
    struct chain_cand *chain;   /* (n_vocab) candidates of the current step */
    int32_t *dry_repeat;        /* (n_vocab) DRY: longest repeat each token would extend; all 0 between calls */
    int32_t *dry_scratch;       /* (history window) DRY's repeat counts */
    int32_t n_dry_scratch;
    struct sample_dry_breakers *dry_breakers; /* the sampler's copy; NULL: none */
    float mirostat_mu;          /* mirostat's running surprise bound (bits) */
};

/* Uniform in [0, 1) with 53 random bits from the sampler's stream. */
double sample_uniform01(struct sampler *s);
/* The best k of x[0..n) into out[0..k) (k <= n), in no particular order. */
void sample_select_top(const float *x, int32_t n, int32_t k, struct cand *out);
/* Count each token of the penalty window (the last repeat_last_n of history)
 * into s->counts; *win and *n_win receive the window. KS_ERR_RANGE for a
 * token outside the vocabulary. The caller zeroes the counts it used. */
ks_status sample_penalty_window(struct sampler *s, const int32_t *history, int32_t n_history, const int32_t **win,
                                int32_t *n_win);
/* The penalized logit of one token seen c > 0 times in the window. */
float sample_penalize(const struct sample_params *p, float logit, int32_t c);

/* Whether id is one of set[0..n). */
bool sample_in_set(int32_t id, const int32_t *set, int32_t n);
/* Speculative sampling after q's draft was rejected: the residual
 * max(0, p - q), p_q[j] the target's p of q->tokens[j]. Draws (one uniform,
 * only when the residual has mass on q's support) whether the token comes
 * from q's support, and returns the index j in q of the one drawn there by
 * max(0, p_q - q); -1: the caller draws from p without q's tokens (the
 * rest of the residual, p itself outside q's support). */
int32_t sample_residual_pick(struct sampler *s, const struct sample_proposal *q, const double *p_q);

/* sample_chain.c: whether p needs the general chain; its buffers. */
bool sample_chain_needed(const struct sample_params *p, int32_t n_vocab);
ks_status sample_chain_init(struct sampler *s);
void sample_chain_free(struct sampler *s);
/* The stages that lead the order and only change logits (penalties, DRY),
 * applied to s->work in place; *first receives the index in the order of the
 * first stage they leave. */
ks_status sample_chain_lead(struct sampler *s, const int32_t *history, int32_t n_history, int *first);
/* The rest of the chain from order[first] and the draw. q not NULL: verify
 * its token q->tokens[at] (speculative rejection sampling, see
 * sample_verify_proposal) and set *accepted.
 * post (NULL: none): receives the drawn token's probability and the best
 * n_logprobs candidates of the final distribution (post_sampling_probs). */
ks_status sample_chain_pick(struct sampler *s, const int32_t *history, int32_t n_history, int first,
                            const struct sample_proposal *q, int32_t at, int32_t *token, bool *accepted,
                            struct sample_result *post);

/* The step's final distribution (softmaxed, before the draw; mirostat's mu
 * unchanged), for tests: *out points into the sampler, valid until its next call. */
ks_status sample_chain_final(struct sampler *s, const int32_t *history, int32_t n_history, int first,
                             const struct chain_cand **out, int32_t *n_out);
/* sample.c: prepare the step (grammar, biases, leading stages) and give the
 * chain's final distribution, for tests; KS_ERR_STATE on the fast path. */
ks_status sample_final_distribution(struct sampler *s, const float *logits, const int32_t *history,
                                    int32_t n_history, const struct chain_cand **out, int32_t *n_out);
/* The mirostat mu of a sampler, for tests. */
float sample_mirostat_mu(const struct sampler *s);

/* sample_dry.c */
ks_status sample_dry_copy(const struct sample_dry_breakers *b, struct sample_dry_breakers **out);
/* DRY over the window of history: s->dry_repeat[t] receives the longest
 * repeat token t would extend (only tokens with one >= allowed length;
 * *touched[0..*n_touched) lists them, in s->dry_scratch). The caller applies
 * sample_dry_penalty and zeroes s->dry_repeat. */
ks_status sample_dry_scan(struct sampler *s, const int32_t *history, int32_t n_history, int32_t **touched,
                          int32_t *n_touched);
/* The DRY penalty of token t with repeat length len (0 for a one-token breaker). */
float sample_dry_penalty(const struct sampler *s, int32_t t, int32_t len);

#endif
