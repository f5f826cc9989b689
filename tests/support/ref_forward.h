/* A deliberately naive f32 forward pass (llama2.c style) for llama, qwen2,
 * qwen3, phi3 (its fused matrices split into copies, LongRoPE's factor set
 * as the model chose it), their mixture-of-experts forms (qwen3moe, llama with
 * experts), gemma2 and gemma3 (sliding windows, soft-capping, GeGLU with ggml's
 * f16 rounding): every weight dequantized to f32 with the scalar reference to_float,
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
#include "quant/quant.h"

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
    /* Q8_0 weights multiplied as ggml-cpu does on x86 (AVX2 / AVX-512 builds,
     * vec_dot and llamafile's tinyBLAS alike): activations quantized by its
     * x86 quantize_row_q8_0 (id = 127 / amax, rounding half to even), and per
     * 32-block the products summed in 8 integer lanes of 4 bytes, each lane
     * FMA'd with d = d_w * d_x into a float lane, the 8 lanes added at the end
     * (high 128 bits + low, movehl, movehdup). Gemma's GeGLU rounds its input
     * to f16, so a last-bit difference in the gate can move the output by an
     * f16 step; in this order the reference gives llama.cpp's gemma3 logits
     * bit for bit. */
    REF_GGML_Q8_0 = 4,
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

/* REF_GGML_Q8_0's two steps, for checking them against ggml itself: x (n, a
 * multiple of 32) into n / 32 blocks as ggml's x86 quantize_row_q8_0 does,
 * and the dot of nb weight blocks with such blocks in ggml's x86 order. */
void ref_q8_0_quantize_ggml(const float *x, block_q8_0 *y, int n);
float ref_q8_0_dot_ggml(const block_q8_0 *w, const block_q8_0 *x, int nb);

#endif
