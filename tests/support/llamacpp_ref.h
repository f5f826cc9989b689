/* llama.cpp's outputs on a prompt, as ../shared/ref and tests/data hold them:
 * NAME.json (n_vocab, prompt_ids, greedy_ids, and "flash_attn": false when
 * made with plain F32 attention) and NAME.logits.f32 (the logits of every
 * prompt row, n_prompt x n_vocab floats); and the engine checked against
 * them: the prompt's logit rows, then llama.cpp's greedy ids decoded one token
 * per batch. test_model_llamacpp and test_model_moe use it. */
#ifndef KS_TEST_LLAMACPP_REF_H
#define KS_TEST_LLAMACPP_REF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kv/kv.h"
#include "model/model.h"

struct llamacpp_ref {
    int n_vocab, n_prompt, n_greedy;
    int32_t *prompt;  /* (n_prompt) */
    int32_t *greedy;  /* (n_greedy) llama.cpp's greedy continuation */
    float *logits;    /* (n_prompt, n_vocab) */
    bool flash_attn;  /* made with llama.cpp's default CPU flash attention: no "flash_attn" key, or true */
};

/* Read dir/name.json and dir/name.logits.f32; fails the calling test when
 * they cannot be read or disagree on sizes. */
void llamacpp_ref_load(const char *dir, const char *name, struct llamacpp_ref *r);
void llamacpp_ref_free(struct llamacpp_ref *r);

/* The prompt into sequence seq (empty) in batches of chunk tokens, the
 * logits of every row into out (n_prompt x n_vocab). */
void llamacpp_ref_prefill(const struct llamacpp_ref *r, struct model_ctx *ctx, struct kv_cache *kv, int32_t seq,
                          int chunk, float *out);

/* After llamacpp_ref_prefill into logits: decode one token per batch from the
 * argmax of the prompt's last row and fail the test (naming case) at the first
 * id that is not llama.cpp's. logits is overwritten. */
void llamacpp_ref_check_greedy(const struct llamacpp_ref *r, const char *name, struct model_ctx *ctx,
                               struct kv_cache *kv, int32_t seq, float *logits);

/* Two new sequences of kv: prompt[0, n) of both in one batch, then n_gen
 * steps decoding both in one batch, each step's argmax checked against
 * greedy[i] (the test fails naming case, stream and step). Returns the worst
 * |diff| of the two last prompt rows against last_row (n_vocab floats). */
float llamacpp_two_streams(const char *name, struct model_ctx *ctx, struct kv_cache *kv, const int32_t *prompt,
                           int n, const int32_t *greedy, int n_gen, const float *last_row, int n_vocab);

int32_t llamacpp_argmax(const float *x, int n);
float llamacpp_max_diff(const float *a, const float *b, size_t n);

#endif
