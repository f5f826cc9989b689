/* model: Llama-family transformers (llama, qwen2, qwen3, phi3), their
 * mixture-of-experts forms (qwen3moe; llama with experts, i.e. Mixtral;
 * gpt-oss, with sinks, sliding windows, biases and YaRN) and Gemma 2 /
 * Gemma 3 loaded from GGUF and run on the CPU, and the BERT-family encoders
 * (bert, nomic-bert), which only embed (model_bert.c). Every hyper-parameter
 * comes from the file's metadata.
 *
 * The forward pass takes a batch of (token, position, sequence) entries:
 * many prefill tokens of one sequence, one decode token for each of many
 * sequences, or any mix. K/V go to a kv cache through the kv_* interface and
 * attention runs through attn_forward(), so the model never sees pages. */
#ifndef KS_MODEL_H
#define KS_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gguf/gguf.h"
#include "kv/kv.h"
#include "status/status.h"
#include "threads/threads.h"

enum model_arch {
    MODEL_ARCH_LLAMA, MODEL_ARCH_QWEN2, MODEL_ARCH_QWEN3, MODEL_ARCH_QWEN3MOE, MODEL_ARCH_PHI3,
    MODEL_ARCH_GEMMA2, MODEL_ARCH_GEMMA3, MODEL_ARCH_GPT_OSS,
    MODEL_ARCH_BERT, MODEL_ARCH_NOMIC_BERT, /* encoders (hparams.encoder_only), model_bert.c */
};
enum model_rope_type { MODEL_ROPE_NORMAL, MODEL_ROPE_NEOX };
enum model_rope_scaling {
    MODEL_ROPE_SCALING_NONE,
    MODEL_ROPE_SCALING_LINEAR,
    MODEL_ROPE_SCALING_LLAMA3,
    MODEL_ROPE_SCALING_LONGROPE, /* phi3: per-dimension short/long factors (rope_factors_short/long) */
    MODEL_ROPE_SCALING_YARN,
};
/* The gated FFN's activation: SwiGLU silu(gate) * up, or GeGLU gelu_tanh(gate) * up (Gemma) */
enum model_ffn_act { MODEL_FFN_SWIGLU, MODEL_FFN_GEGLU };
/* How an embedding model turns its final hidden states (after output_norm)
 * into one vector per input: llama.cpp's llama_pooling_type, same values
 * (the GGUF key <arch>.pooling_type stores them). NONE: one vector per token;
 * MEAN: their average; CLS: the first token's; LAST: the last token's; RANK:
 * a classifier head (rerankers). */
enum model_pooling {
    MODEL_POOLING_NONE = 0, MODEL_POOLING_MEAN = 1, MODEL_POOLING_CLS = 2, MODEL_POOLING_LAST = 3,
    MODEL_POOLING_RANK = 4,
};

struct model_hparams {
    enum model_arch arch;
    const char *arch_name;     /* "llama" */
    int n_vocab;
    int n_embd;                /* dim */
    int n_layer;
    int n_head;
    int n_head_kv;             /* GQA: n_head is a multiple of n_head_kv */
    int head_dim_k;            /* key_length, or n_embd / n_head */
    int head_dim_v;            /* value_length, or n_embd / n_head */
    int n_rot;                 /* rope.dimension_count, or head_dim_k: the rotated prefix of each head */
    int n_ff;                  /* feed_forward_length (dense FFN; for MoE files informative only) */
    int n_ctx_train;
    float rms_eps;
    enum model_rope_type rope_type;
    float rope_freq_base;
    enum model_rope_scaling rope_scaling;
    float rope_scale_factor;   /* linear: positions are divided by it */
    float rope_llama3_low_freq_factor, rope_llama3_high_freq_factor;
    int rope_llama3_orig_ctx;
    bool tied_embeddings;      /* output.weight absent: reuse token_embd */
    bool has_qkv_bias;         /* qwen2 */
    bool has_qk_norm;          /* qwen3, qwen3moe */
    /* Mixture of experts (expert_count > 0): every layer's FFN is n_expert
     * SwiGLU experts of n_ff_exp, a token goes through the n_expert_used with
     * the largest router probabilities (softmax over all experts, top-k,
     * weights renormalized to sum 1, as llama.cpp's qwen3moe and llama). */
    int n_expert;              /* expert_count; 0: dense */
    int n_expert_used;         /* expert_used_count */
    int n_ff_exp;              /* expert_feed_forward_length (qwen3moe), else n_ff */
    /* phi3: fused projections and LongRoPE */
    bool has_fused_qkv;        /* one attn_qkv matrix: Q, K, V are its row ranges */
    bool has_fused_gate_up;    /* ffn_up holds the gate rows, then the up rows */
    int rope_n_ctx_orig;       /* rope.scaling.original_context_length, else n_ctx_train: LongRoPE's
                                  long factors apply to contexts longer than this */
    float rope_attn_factor;    /* rope.scaling.attn_factor, else 1: cos and sin are scaled by it */
    int n_swa_stored;          /* phi3.attention.sliding_window as the file says (0: none); not
                                  applied, as llama.cpp does not apply it */
    /* Sliding-window attention (gemma2, gemma3, gpt-oss; the one notion the
     * forward pass, the KV cache's freeing (model_kv_config) and `kvserve
     * info` share): a window layer's query at p sees keys at p - n_swa < j <= p. */
    int n_swa;                 /* attention.sliding_window; 0: no window layers */
    int swa_pattern;           /* layer il is a window layer iff il % swa_pattern < swa_pattern - 1
                                  (the last of every swa_pattern is global: gemma3 6, gemma2 and
                                  gpt-oss 2, i.e. the even layers); 0: every layer */
    float rope_freq_base_swa;  /* RoPE base of window layers (gemma3: 10000, unscaled) */
    /* Gemma 2 / Gemma 3 features (the other architectures leave them off):
     * embeddings scaled by sqrt(n_embd); post-attention and post-FFN RMSNorms
     * on each block's output before its residual; GeGLU; queries scaled by
     * attn_q_scale after RoPE (attention then scales by 1); logit soft-capping. */
    float embd_scale;          /* token embeddings times this; 0: off */
    bool has_post_norms;       /* blk.N.post_attention_norm, blk.N.post_ffw_norm */
    enum model_ffn_act ffn_act;
    float attn_q_scale;        /* > 0: q *= attn_q_scale, attention scale 1; 0: scale 1/sqrt(head_dim_k) */
    float attn_softcap;        /* > 0: scores = c * tanh(scores / c) (gemma2) */
    float final_softcap;       /* > 0: logits = c * tanh(logits / c) (gemma2) */
    /* gpt-oss's features, as llama.cpp's openai-moe runs them (0 / false: off) */
    struct {
        bool attn_sinks;           /* attn_sinks: a learned per-head logit in each softmax */
        bool attn_out_bias;        /* attn_output.bias */
        bool post_attn_norm;       /* the FFN's norm is named post_attention_norm */
        bool expert_bias;          /* ffn_gate_inp.bias and every expert matrix's bias */
        bool softmax_after_topk;   /* routing: top-k of the logits, softmax over those k */
        bool swiglu_oai;           /* experts' activation: quant_swiglu_oai (alpha 1.702, limit 7) */
    } oai;
    /* YaRN (rope_scaling YARN): rope.scaling.original_context_length, the
     * ramp's beta_fast / beta_slow, and YaRN's own magnitude scale of cos and
     * sin (the model scales them by it times rope_attn_factor) */
    int rope_yarn_orig_ctx;
    float rope_yarn_beta_fast, rope_yarn_beta_slow, rope_yarn_mscale;
    /* Embedding models (model_embed.c): <arch>.pooling_type (NONE when absent, as
     * llama.cpp; model_set_pooling overrides it) and <arch>.attention.causal
     * (true when absent): false makes an embedding sequence's every token attend
     * to every token of its input, as llama.cpp's mask does. */
    enum model_pooling pooling;
    bool non_causal;           /* attention.causal = false */
    /* BERT-family encoders (bert, nomic-bert; model_bert.c): no output head,
     * so they only embed (model_forward refuses them); LayerNorms with biases
     * (attention.layer_norm_epsilon, not rms_eps), post-norm blocks. bert adds
     * learned absolute positions, nomic-bert rotates Q/K (NEOX) instead. */
    bool encoder_only;
    float norm_eps;            /* attention.layer_norm_epsilon (encoders) */
};

/* Whether layer il attends through hp->n_swa's sliding window (llama.cpp's
 * rule: il % swa_pattern < swa_pattern - 1). */
bool model_layer_is_swa(const struct model_hparams *hp, int il);

struct model;

/* Load and validate: every required tensor present with the right shape and a
 * supported type. Errors name the tensor and what is wrong. The weights are
 * read into private huge-page memory (gguf_open_private), which decodes
 * faster than a file mapping; MODEL_LOAD_MMAP maps the file instead, sharing
 * the page cache between processes and starting faster. In the private copy,
 * the Q4_0 / Q8_0 / IQ4_NL / MXFP4 / Q5_0 / Q5_1 / Q2_K..Q6_K matrices the forward pass multiplies (tied token
 * embeddings too, as the output matrix; untied ones stay row-major; each
 * expert of a 3-D expert tensor as a matrix of its own) are repacked in place
 * for this build's kernels (quant_repack; the file is untouched);
 * MODEL_LOAD_NO_REPACK keeps them row-major (A/B runs). A mapped file is
 * never repacked. */
enum model_load_flags { MODEL_LOAD_MMAP = 1, MODEL_LOAD_NO_REPACK = 2 };
ks_status model_load(const char *path, struct model **out);
ks_status model_load_flags(const char *path, unsigned flags, struct model **out);
void model_free(struct model *m);
const struct model_hparams *model_hparams(const struct model *m);
/* The underlying file, for the tokenizer and `kvserve info`: its metadata and
 * tensor table. The bytes of repacked matrices are in quant_repack's layout,
 * not the file's; open model_file_path() again for the file's bytes. */
const struct gguf_file *model_gguf(const struct model *m);
/* The path the model was loaded from. */
const char *model_file_path(const struct model *m);
/* Bytes of the matrices a forward pass can read: every layer matrix (all
 * experts), the output matrix; not the token embeddings (one row per token). */
uint64_t model_weight_bytes(const struct model *m);
/* Bytes one decode token reads: as model_weight_bytes, with each layer's
 * experts counted n_expert_used / n_expert (only the selected experts' rows
 * are read). Equals model_weight_bytes for a dense model. */
uint64_t model_active_weight_bytes(const struct model *m);

/* The context length of one sequence, as llama.cpp's n_ctx per sequence: a
 * LongRoPE model (phi3 with rope_factors_long/short) rotates with its long
 * factors when n_ctx_seq exceeds hparams.rope_n_ctx_orig and with its short
 * ones otherwise. A loaded model assumes n_ctx_train (llama.cpp's default
 * context). Call it before making contexts and caches: the choice is part of
 * model_fingerprint, since K in a cache keeps the rotation it was written
 * with. No effect on other models. */
void model_set_n_ctx(struct model *m, int32_t n_ctx_seq);
/* true when the long factors are in use (LongRoPE models only). */
bool model_rope_long(const struct model *m);

/* XXH3-128 of the file's metadata and tensor table (gguf_header_bytes): a
 * different model or quantization gives a different fingerprint (a LongRoPE
 * model's also differs between its short and long factors). */
void model_fingerprint(const struct model *m, uint8_t out[16]);
/* The same from the file alone (nothing loaded; a router naming the KV events
 * stream of the model): rope_long as a LongRoPE model's model_rope_long. */
void model_file_fingerprint(const struct gguf_file *f, bool rope_long, uint8_t out[16]);

/* A kv_config shaped for this model (layers, KV heads, head_dim, and its
 * fingerprint for prefix-cache keys) with kv_config_default() for the rest;
 * the caller sets the budget. */
void model_kv_config(const struct model *m, struct kv_config *cfg);

struct model_batch {
    int32_t n_tokens;
    const int32_t *tokens;
    const int32_t *pos;      /* position of each token in its sequence */
    const int32_t *seq;      /* kv sequence id of each token */
    const bool *want_logits; /* NULL: logits for the last token of each sequence only */
};

/* Per-caller scratch sized for a maximum batch: activations, quantized
 * activations, logits. Reused across steps; not shared between threads. */
struct model_ctx;
ks_status model_ctx_create(const struct model *m, int32_t max_batch_tokens, threads_pool *pool,
                           struct model_ctx **out);
void model_ctx_free(struct model_ctx *c);

/* Run one batch. For every sequence in the batch, its tokens must have
 * consecutive positions starting at kv_seq_len(seq); the model grows each
 * sequence in the cache first (all or nothing, so KS_ERR_KV_FULL leaves the
 * cache unchanged) and then writes K/V for every layer.
 *
 * logits: for each batch entry that wants logits, in batch order, one row of
 * n_vocab floats. *n_logits_out (may be NULL) receives the number of rows.
 * An encoder (hparams.encoder_only) has no logits: KS_ERR_UNSUPPORTED. */
ks_status model_forward(struct model_ctx *c, struct kv_cache *kv, const struct model_batch *b,
                        float *logits, int32_t *n_logits_out);

/* ---- embeddings (model_embed.c) ------------------------------------------------- */

/* "none", "mean", "cls", "last", "rank" (llama-server's --pooling names). */
ks_status model_pooling_parse(const char *name, enum model_pooling *out);
const char *model_pooling_name(enum model_pooling p);
/* Use pooling p instead of the file's <arch>.pooling_type (llama-server's --pooling). */
void model_set_pooling(struct model *m, enum model_pooling p);

/* llama.cpp's common_embd_normalize, in place on v (n floats): norm -1 none,
 * 0 max absolute value scaled to 32760 (int16), 1 taxicab, 2 Euclidean (L2;
 * llama-server's default), p > 2 the p-norm. Sums in double; a zero vector
 * stays zero. */
void model_embd_normalize(float *v, int n, int norm);

/* model_forward that also computes embeddings. embed (NULL: none, then this is
 * model_forward): per batch entry, whether it belongs to an embedding
 * sequence. Such a sequence is in the batch whole: all its entries have
 * embed set, its first is position 0 and the cache holds nothing of it before
 * (KS_ERR_INVALID_ARG otherwise), since pooling reads every token's hidden
 * state and a non-causal model's tokens attend to the whole input. For each
 * embedding sequence, in the order of its first entry, embd receives one row
 * of n_embd floats: the model's pooling (MEAN, CLS or LAST; NONE and RANK are
 * KS_ERR_UNSUPPORTED) of its final hidden states after output_norm, not
 * normalized. *n_embd_out (may be NULL): the rows written. Embedding entries
 * want no logits (want_logits false; with want_logits NULL, none of them get
 * a row). Their K/V are written to the cache as any entry's (a non-causal
 * model's depend on the whole input: never share them with another sequence).
 * An encoder (hparams.encoder_only) takes embedding entries only
 * (KS_ERR_INVALID_ARG otherwise; a bert position past its learned ones is
 * KS_ERR_RANGE), attends within each input and writes nothing to the cache. */
ks_status model_forward_embed(struct model_ctx *c, struct kv_cache *kv, const struct model_batch *b,
                              const bool *embed, float *logits, int32_t *n_logits_out, float *embd,
                              int32_t *n_embd_out);

/* ---- synthetic models ---------------------------------------------------- */
/* A deterministic random model of a real architecture's shapes, for benchmarks,
 * the built-in default model and tests. Same spec and seed give the same file. */
struct model_synth_spec {
    const char *arch;          /* "llama", "qwen2" (QKV bias), "qwen3" (Q/K norm), "qwen3moe", "phi3"
                                  (fused QKV and gate/up), "gemma2", "gemma3", "gpt-oss", or the encoders
                                  "bert" / "nomic-bert" (a WordPiece vocab of n_vocab tokens) */
    int n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff;
    int n_expert, n_expert_used; /* n_expert > 0: MoE FFN (llama: Mixtral; qwen3moe needs it) */
    int n_ff_exp;              /* each expert's FFN width (0: n_ff) */
    int router_period;         /* tests: router row e repeats row e % period, so experts tie (0: off) */
    int n_vocab;               /* size of the generated vocab (>= 259); ignored with a vocab file */
    int n_ctx_train;
    float rope_freq_base;
    float rms_eps;             /* 0: 1e-5 (the encoders: their LayerNorm epsilon) */
    bool pure;                 /* every matrix at the given type (no llama-quantize output rule) */
    bool untied;               /* write a separate output.weight (default: tied embeddings) */
    uint64_t seed;
    float init_std;            /* std of the matrices (0: 0.02) */
    float embd_std;            /* std of token_embd (0: init_std) */
    /* phi3 */
    int n_rot;                 /* rope.dimension_count (0: head_dim) */
    int n_ctx_orig;            /* > 0: LongRoPE: rope.scaling.original_context_length, rope.scaling.attn_factor
                                  and rope_factors_long/short, as convert_hf_to_gguf writes a 128k Phi-3.5 */
    int sliding_window;        /* phi3.attention.sliding_window (written for phi3 only) */
    /* gemma2 / gemma3 / gpt-oss */
    int n_swa;                 /* attention.sliding_window (0: not written; gpt-oss: on the even layers) */
    int swa_pattern;           /* gemma3: attention.sliding_window_pattern written when > 0 */
    float attn_softcap, final_softcap; /* gemma2: attn_logit_softcapping, final_logit_softcapping */
    /* gpt-oss */
    float rope_yarn_factor;    /* > 1: YaRN rope.scaling.factor */
    int rope_yarn_orig_ctx;    /* rope.scaling.original_context_length */
    /* embedding models */
    int pooling_type;          /* > 0: <arch>.pooling_type (enum model_pooling) written */
    bool non_causal;           /* <arch>.attention.causal = false written */
};

/* Fill spec from a preset name: llama-1b, smollm2-135m, qwen3-0.6b, tiny,
 * qwen3moe-30b-a3b, mixtral-8x7b, tiny-qwen3moe, tiny-mixtral,
 * tiny-qwen3moe-ties, tiny-llama, phi3-mini, phi4-mini, tiny-phi3, tiny-phi3-short,
 * gemma3-1b, tiny-gemma3, tiny-gemma2, gpt-oss-20b, tiny-gpt-oss, tiny-llama-embed (mean pooling,
 * non-causal), tiny-qwen3-embed (last-token pooling), tiny-bert-embed (bert, CLS pooling),
 * tiny-nomic-bert-embed (nomic-bert, mean pooling). */
ks_status model_synth_preset(const char *name, struct model_synth_spec *spec);
/* Space-separated preset names, for help text. */
const char *model_synth_preset_names(void);

/* Write the model to out_path. type: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0,
 * q5_1, q4_k, q5_k, q6_k, q4_k_m (llama.cpp's Q4_K_M mix), iq4_nl, iq4_xs, mxfp4, iq3_xxs, iq3_s or
 * iq2_s. A matrix whose row
 * is not a multiple of the type's block falls back like llama-quantize does.
 * vocab_path: a GGUF whose tokenizer.* metadata is copied (NULL: a small
 * byte-fallback SentencePiece vocab of spec->n_vocab tokens). pool may be NULL. */
ks_status model_synth(const struct model_synth_spec *spec, const char *type, const char *vocab_path,
                      const char *out_path, threads_pool *pool);

#endif
