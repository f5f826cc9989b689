/* sample: turn a row of logits into the next token.
 *
 * Order of operations, as llama.cpp applies them: logit biases, repetition /
 * presence / frequency penalties over the recent history, then (unless greedy) top-k,
 * temperature, top-p and min-p, then a draw from a seeded xoshiro256** stream.
 * temp <= 0 is greedy (argmax after penalties). Logprobs, when asked, are the
 * log-softmax of the penalized logits before truncation, like OpenAI's.
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
};

struct sample_logprob {
    int32_t token;
    float logprob;
};

struct sample_result {
    int32_t token;
    float logprob;                                      /* of the chosen token */
    int n_top;                                          /* = params.n_logprobs */
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

/* Speculative decoding: the next token when a speculator proposed `draft`
 * (a deterministic proposal) for this position. Greedy: the argmax, and
 * *accepted when it is draft. Otherwise draft is kept (*accepted) with its
 * probability p(draft) under this step's whole pipeline (grammar mask,
 * penalties, top-k, temperature, top-p, min-p), and on rejection the token is
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

#endif
