/* sample: turn a row of logits into the next token.
 *
 * Order of operations, as llama.cpp's common_sampler applies them: logit
 * biases, then the stages of `order` (llama-server's "samplers"; by default
 * penalties, DRY, top-n-sigma, top-k, typical-p, top-p, min-p, XTC,
 * temperature), then a draw from a seeded xoshiro256** stream. Temperature
 * comes last, so top-p and min-p see the untempered distribution, as in
 * llama.cpp. temp <= 0 is greedy (argmax after the stages before it). With
 * mirostat 1 or 2 the stages are replaced, as in llama.cpp, by temperature
 * and the mirostat draw (no penalties, no DRY). Logprobs, when asked, are the
 * log-softmax of the logits after the penalties and DRY (when they lead the
 * order) and before truncation, like OpenAI's.
 *
 * The default configuration (no stage but penalties, top-k, top-p, min-p and
 * temperature active, in the default order, min_keep <= 1) runs a fast path
 * that never sorts the vocabulary; anything else runs the general chain
 * (sample_chain.c) on a candidate array, as llama.cpp does.
 *
 * Every state a sampler keeps (mirostat's mu, the grammar) advances only by
 * the token a call returns, XTC's coin is drawn once per call, and DRY and
 * the penalties read the history the caller passes, so sample_verify gives
 * each position sample_next's distribution for every stage: speculative
 * decoding stays on for all of them.
 *
 * With a grammar (grammar/grammar.h), the logits of every token the grammar
 * does not allow are set to -inf first, and each drawn token advances the
 * grammar state; the sampler owns that state, so a sequence that is preempted
 * and recomputed keeps it. */
#ifndef KS_SAMPLE_H
#define KS_SAMPLE_H

#include <stdbool.h>
#include <stdint.h>

#include "grammar/grammar.h"
#include "status/status.h"

#define SAMPLE_MAX_LOGPROBS 20
#define SAMPLE_MAX_STAGES 16

/* llama.cpp's sampler stages (common_sampler_type), for sample_params.order. */
enum sample_stage {
    SAMPLE_STAGE_PENALTIES = 1, /* "penalties": repeat / presence / frequency */
    SAMPLE_STAGE_DRY,           /* "dry" */
    SAMPLE_STAGE_TOP_N_SIGMA,   /* "top_n_sigma" */
    SAMPLE_STAGE_TOP_K,         /* "top_k" */
    SAMPLE_STAGE_TYPICAL_P,     /* "typ_p" */
    SAMPLE_STAGE_TOP_P,         /* "top_p" */
    SAMPLE_STAGE_MIN_P,         /* "min_p" */
    SAMPLE_STAGE_XTC,           /* "xtc" */
    SAMPLE_STAGE_TEMPERATURE,   /* "temperature", with dynamic temperature */
};

/* llama.cpp's name of a stage -> the stage; llama-server's alternative names
 * ("top-k", "nucleus", "typical", "temp", ...) too. false: not a stage kvserve
 * has (llama.cpp's "infill" and "adaptive_p" are not implemented). */
bool sample_stage_from_name(const char *name, enum sample_stage *out);
/* The canonical name ("top_k", "typ_p", ...); "?" for a bad value. */
const char *sample_stage_name(enum sample_stage st);
/* llama-server's default order into out[SAMPLE_MAX_STAGES]; returns its length. */
int sample_default_order(enum sample_stage *out);

/* DRY's sequence breakers, processed against a vocabulary as llama.cpp does:
 * every token whose text contains a breaker is a one-token breaker, and a
 * token that ends with the start of a breaker heads the tokenization of the
 * rest of that start (at most 20 tokens; a breaker is cut to 40 bytes). */
struct sample_dry_breakers;
/* The bytes of token id, as llama.cpp's detokenize of that token alone
 * (control tokens as their text); owned by the callee. */
typedef ks_status (*sample_piece_fn)(void *user, int32_t id, const char **bytes, size_t *len);
/* text[0..len) tokenized without special tokens (malloc'd ids the caller frees). */
typedef ks_status (*sample_tokenize_fn)(void *user, const char *text, size_t len, int32_t **ids, size_t *n);
/* Process breakers[0..n) (NUL-terminated; empty ones are skipped) against a
 * vocabulary of n_vocab tokens. Errors: KS_ERR_INVALID_ARG (NULL arguments,
 * n_vocab < 1), the callbacks' errors, KS_ERR_NOMEM. */
ks_status sample_dry_breakers_create(const char *const *breakers, int n, int32_t n_vocab, sample_piece_fn piece,
                                     sample_tokenize_fn tokenize, void *user, struct sample_dry_breakers **out);
void sample_dry_breakers_free(struct sample_dry_breakers *b); /* NULL is a no-op */
/* The number of (head token, tail) sequences, for tests and logs. */
int32_t sample_dry_breakers_count(const struct sample_dry_breakers *b);

/* A bias added to one token's logit (llama.cpp's logit_bias); -INFINITY bans it. */
struct sample_bias {
    int32_t token;
    float bias;
};

struct sample_params {
    float temp;               /* <= 0: greedy. default 0.8 */
    int top_k;                /* <= 0: off. default 40 */
    float top_p;              /* >= 1: off. default 0.95 */
    float min_p;              /* <= 0: off. default 0.05 */
    float repeat_penalty;     /* 1: off. default 1.0 */
    int repeat_last_n;        /* history window for all penalties. default 64 */
    float presence_penalty;   /* 0: off */
    float frequency_penalty;  /* 0: off */
    uint64_t seed;            /* default 0xC0FFEE; same seed + same logits = same tokens */
    int n_logprobs;           /* 0..SAMPLE_MAX_LOGPROBS top alternatives to report */
    /* biases[0..n_biases): added to the logits first (a token may repeat: the
     * biases add up); copied by sample_create. Tokens in [0, n_vocab), a bias
     * finite or -INFINITY. */
    const struct sample_bias *biases;
    int n_biases;
    /* Optional constraint (NULL: none). sample_create takes its own reference
     * on grammar; grammar_vocab is borrowed and must outlive the sampler.
     * grammar_max_tokens: the tokens this sampler will draw at most (the
     * request's max_tokens), so the grammar can finish within them; < 0: no limit. */
    struct grammar *grammar;
    const struct grammar_vocab *grammar_vocab;
    int32_t grammar_max_tokens;
    /* n > 0: the grammar is lazy (grammar_state_create_lazy): sampling is
     * free until one of these triggers; n == 0: it applies from the first token. */
    struct grammar_triggers grammar_triggers;

    /* llama.cpp's other samplers. Every field's zero (a memset) is "off";
     * sample_params_default sets llama.cpp's defaults. */
    int min_keep;             /* top-p, min-p, typical-p and XTC keep at least this many. default 0 */
    float typical_p;          /* locally typical sampling; off <= 0 or >= 1. default 1 */
    float top_n_sigma;        /* keep logits >= max - n * std; <= 0: off. default -1 */
    float dynatemp_range;     /* temperature in [temp - range, temp + range] by entropy; 0: off */
    float dynatemp_exponent;  /* default 1 */
    float xtc_probability;    /* XTC: chance to cut the top tokens; 0: off */
    float xtc_threshold;      /* XTC: the probability a cut token has at least; > 0.5: off. default 0.1 */
    float dry_multiplier;     /* DRY: penalty multiplier; 0: off */
    float dry_base;           /* DRY: penalty = multiplier * base^(repeat - allowed); < 1: off. default 1.75 */
    int dry_allowed_length;   /* DRY: repeats this long are free. default 2 */
    int dry_penalty_last_n;   /* DRY: history window; -1: all of it, 0: off. default -1 */
    /* DRY's sequence breakers (NULL: none); copied by sample_create. */
    const struct sample_dry_breakers *dry_breakers;
    int mirostat;             /* 0: off, 1: mirostat, 2: mirostat 2.0 */
    float mirostat_tau;       /* target surprise (bits); mu starts at 2 * tau. default 5 */
    float mirostat_eta;       /* learning rate. default 0.1 */
    /* The stages in the order they run (a stage may repeat; one left out
     * does not run); n_order 0: llama-server's default order. */
    enum sample_stage order[SAMPLE_MAX_STAGES];
    int n_order;
    /* The reported probabilities (the token's and n_logprobs alternatives)
     * are the final distribution's, after every stage (llama-server's
     * post_sampling_probs), not the raw logits' softmax. */
    bool post_sampling_probs;
};

struct sample_logprob {
    int32_t token;
    float logprob;
    float prob;        /* post_sampling_probs: the probability the draw gave it (logprob its log); else 0 */
};

struct sample_result {
    int32_t token;
    float logprob;                                      /* of the chosen token */
    float prob;                                         /* post_sampling_probs: its probability; else 0 */
    int n_top;                                          /* = params.n_logprobs (post_sampling_probs: at most
                                                           the final distribution's candidates) */
    struct sample_logprob top[SAMPLE_MAX_LOGPROBS];     /* best first */
};

struct sampler;

void sample_params_default(struct sample_params *p);
/* KS_ERR_INVALID_ARG names the bad parameter (e.g. top_p 1.5, n_logprobs 30),
 * or a grammar without a vocabulary or with one larger than n_vocab;
 * grammar_state_create's errors (KS_ERR_RANGE: max_tokens below the shortest
 * output). */
ks_status sample_create(const struct sample_params *p, int32_t n_vocab, struct sampler **out);
void sample_free(struct sampler *s);

/* Pick the next token. logits (n_vocab floats) are not modified. With a
 * grammar, the draw is one the grammar allows and it is accepted into the
 * grammar state; grammar_mask's errors (KS_ERR_STATE: nothing can continue)
 * leave the sampler unchanged. history:
 * the tokens so far (prompt and generated) that the penalties look at; may be
 * NULL when n_history is 0. */
ks_status sample_next(struct sampler *s, const float *logits, const int32_t *history,
                      int32_t n_history, struct sample_result *out);

/* Greedy with nothing that changes the logits (no grammar, biases,
 * penalties or chain): the token sample_next and sample_verify pick is the
 * first index of the logits' maximum, whatever the history. Then
 * sample_greedy_token gives it without sample_next's copy of the logits
 * and its logprob pass over the vocabulary, for a caller that uses only the
 * token (a speculative step checks 1 + k rows). */
bool sample_is_plain_greedy(const struct sampler *s);
/* KS_ERR_RANGE when the logits hold NaN or +inf, or are all -inf (as sample_next). */
ks_status sample_greedy_token(const struct sampler *s, const float *logits, int32_t *token);

/* Speculative decoding: the next token when a speculator proposed `draft`
 * (a deterministic proposal) for this position. Greedy: the argmax, and
 * *accepted when it is draft. Otherwise draft is kept (*accepted) with its
 * probability p(draft) under this step's whole pipeline (grammar mask,
 * biases, every stage of the order, mirostat), and on rejection the token is
 * drawn from p with draft removed and renormalized, so the token is
 * distributed exactly as sample_next's. A draft the grammar forbids has
 * p = 0: it is always rejected, and the token is one the grammar allows (the
 * grammar state advances by the returned token, as sample_next's). The
 * random stream is consumed differently from sample_next's (one draw for the
 * decision, one more on rejection), so seeded sampled outputs differ from
 * plain decoding's in their tokens, not in their distribution. Errors as
 * sample_next, and KS_ERR_INVALID_ARG for a draft outside the vocabulary. */
ks_status sample_verify(struct sampler *s, const float *logits, const int32_t *history, int32_t n_history,
                        int32_t draft, struct sample_result *out, bool *accepted);

/* A draft token's proposal distribution q: a draft model's next-token
 * distribution, kept to its SAMPLE_PROPOSAL_MAX most likely tokens (llama.cpp's
 * draft sampler keeps its top 10, LLAMA_DRAFT_TOP_K), renormalized. The
 * draft token is drawn from it (sample_proposal_draw) and verified by
 * sample_verify_proposal. */
enum { SAMPLE_PROPOSAL_MAX = 10 };
struct sample_proposal {
    int32_t n;                            /* tokens in q's support, 1..SAMPLE_PROPOSAL_MAX */
    int32_t tokens[SAMPLE_PROPOSAL_MAX];  /* (n) distinct, most likely first */
    float probs[SAMPLE_PROPOSAL_MAX];     /* (n) q of each, > 0, summing to 1 */
};

/* q from a draft model's logits (n_vocab floats) under the request's
 * temperature, top-k, top-p and min-p (the stages that shape a distribution;
 * penalties, grammar, biases and the rest act on the target's side only, so
 * q is close to, not equal to, the target's chain: any q keeps the output
 * exact, a closer one is accepted more often). top-p's mass is measured over
 * the whole vocabulary when top_k is off or above SAMPLE_PROPOSAL_MAX.
 * p->temp <= 0: one-hot at the argmax. *p_top receives the untempered
 * probability of the most likely token over the whole vocabulary
 * (--draft-p-min's measure). Errors: KS_ERR_INVALID_ARG (NULL arguments,
 * n_vocab < 1), KS_ERR_RANGE (NaN, +inf or every logit -inf). */
ks_status sample_proposal_make(const struct sample_params *p, const float *logits, int32_t n_vocab,
                               struct sample_proposal *out, float *p_top);
/* The token of q at uniform u in [0, 1) (inverse of its cumulative distribution). */
int32_t sample_proposal_draw(const struct sample_proposal *q, double u);

/* sample_verify for a draft drawn from q (standard speculative sampling):
 * keep draft with probability min(1, p(draft) / q(draft)), p this step's
 * whole pipeline as for sample_verify; on rejection draw from max(0, p - q)
 * renormalized. The token is distributed as sample_next's whatever q is.
 * A one-hot q is sample_verify (the same decisions from the same random
 * stream). Greedy: the argmax, accepted when it is draft. Errors as
 * sample_verify, and KS_ERR_INVALID_ARG for a q that is empty, larger than
 * SAMPLE_PROPOSAL_MAX, names a token outside the vocabulary or does not hold
 * draft. */
ks_status sample_verify_proposal(struct sampler *s, const float *logits, const int32_t *history, int32_t n_history,
                                 const struct sample_proposal *q, int32_t draft, struct sample_result *out,
                                 bool *accepted);

#endif
