/* A deliberately naive f32 forward pass (llama2.c style) for llama, qwen2,
 * qwen3, phi3 (its fused matrices split into copies, LongRoPE's factor set
 * as the model chose it) and the mixture-of-experts forms (qwen3moe, llama
 * with experts): every weight dequantized to f32 with the scalar reference to_float,
 * a contiguous f32 KV cache per sequence, plain loops, one token at a time.
 * The optimized model_forward() is checked against it.
 *
 * Hyper-parameters come from model_hparams(); tensors are read by name from
 * the model's file (model_file_path(), mapped again: the loader repacks its own
 * copy), independently of the model module's loader. */
#ifndef KS_TEST_REF_FORWARD_H
#define KS_TEST_REF_FORWARD_H

#include <stdbool.h>
#include <stdint.h>

#include "model/model.h"

struct ref_model;

enum ref_flags {
    /* Round each matmul input through the weight type's activation type
     * (q8_0 / q8_K) with the scalar quantizer, as the engine's integer
     * kernels do; that makes the comparison tight for quantized weights. */
    REF_QUANTIZE_ACTS = 1,
    /* llama.cpp's own CPU arithmetic (ggml-cpu, native AVX-512 build, prompt
     * as one batch), op by op: tinyBLAS / ggml_vec_dot_f32 summation order,
     * rms_norm with float squares summed in double, RoPE angles by repeated
     * multiplication, SwiGLU through ggml's vector expf, and its default
     * flash attention, which casts an F32 cache to F16, rounds Q to F16 and
     * keeps the V accumulator in F16. ../shared/ref was made that way. */
    REF_LLAMACPP_FA = 2,
};

/* max_seqs sequence slots of max_ctx tokens each; flags from enum ref_flags. */
ks_status ref_model_create(const struct model *m, int max_seqs, int max_ctx, unsigned flags,
                           struct ref_model **out);
void ref_model_free(struct ref_model *r);

/* One token of slot seq at position pos (== the slot's length so far):
 * n_vocab logits. */
ks_status ref_forward(struct ref_model *r, int seq, int32_t token, int32_t pos, float *logits);

/* REF_LLAMACPP_FA only: the size of the batch llama.cpp ran the next tokens
 * in (default: a prompt batch). A one-token batch sums matmuls in another
 * order (ggml_vec_dot_f32 instead of tinyBLAS). */
void ref_set_batch_size(struct ref_model *r, int n_tokens);

/* Reset slot seq to empty. */
void ref_seq_clear(struct ref_model *r, int seq);

#endif
