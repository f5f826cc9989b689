/* Internal to the model module: the loaded weights, shared by the loader and
 * the forward pass. */
#ifndef KS_MODEL_INTERNAL_H
#define KS_MODEL_INTERNAL_H

#include "model/model.h"
#include "quant/quant.h"

/* llama.cpp's LLAMA_MAX_EXPERTS; the loader refuses more */
#define MODEL_MAX_EXPERTS 512

/* A 2-D weight used in place from the mapping: rows x cols of type. */
struct model_mat {
    const void *data;
    enum quant_type type;
    int64_t rows, cols;
    bool repacked;           /* data is in quant_repack's layout: multiply with quant_matmul_repacked */
};

/* The experts of one layer: a GGUF 3-D tensor [cols, rows, n_expert], so
 * expert e's matrix is the contiguous rows x cols slice at data + e * stride. */
struct model_experts {
    const uint8_t *data;
    enum quant_type type;
    int64_t rows, cols;
    size_t stride;                           /* bytes per expert */
    bool repacked;                           /* each expert's slice is in quant_repack's layout */
};

static inline struct model_mat model_expert_mat(const struct model_experts *x, int e)
{
    return (struct model_mat){.data = x->data + (size_t)e * x->stride, .type = x->type, .rows = x->rows,
                              .cols = x->cols, .repacked = x->repacked};
}

struct model_layer {
    const float *attn_norm;                  /* (n_embd) */
    /* phi3's fused attn_qkv (n_head * head_dim_k + 2 * n_head_kv * head_dim_k, n_embd) and fused
     * ffn_up (2 * n_ff, n_embd) are not matrices of their own here: wq, wk, wv and w_gate, w_up
     * are their row ranges (rows of a row-major matrix are contiguous), each repacked on its own. */
    struct model_mat wq;                     /* (n_head * head_dim_k, n_embd) */
    struct model_mat wk;                     /* (n_head_kv * head_dim_k, n_embd) */
    struct model_mat wv;                     /* (n_head_kv * head_dim_v, n_embd) */
    struct model_mat wo;                     /* (n_embd, n_head * head_dim_v) */
    const float *bq, *bk, *bv;               /* qwen2: (q rows), (k rows), (v rows) */
    const float *q_norm, *k_norm;            /* qwen3: (head_dim_k) each */
    const float *ffn_norm;                   /* (n_embd) */
    struct model_mat w_gate;                 /* (n_ff, n_embd) */
    struct model_mat w_up;                   /* (n_ff, n_embd) */
    struct model_mat w_down;                 /* (n_embd, n_ff) */
    /* MoE layers instead of w_gate / w_up / w_down: */
    struct model_mat w_router;               /* (n_expert, n_embd) ffn_gate_inp */
    struct model_experts gate_exps;          /* (n_expert, n_ff_exp, n_embd) */
    struct model_experts up_exps;            /* (n_expert, n_ff_exp, n_embd) */
    struct model_experts down_exps;          /* (n_expert, n_embd, n_ff_exp) */
    /* gemma2 / gemma3: RMSNorms of the attention and FFN outputs, before their residuals */
    const float *post_attn_norm;             /* (n_embd) post_attention_norm */
    const float *post_ffn_norm;              /* (n_embd) post_ffw_norm */
    /* gpt-oss */
    const float *bo;                         /* (n_embd) attn_output.bias */
    const float *sinks;                      /* (n_head) attn_sinks */
    const float *b_router;                   /* (n_expert) ffn_gate_inp.bias */
    const float *b_gate_exps, *b_up_exps;    /* (n_expert, n_ff_exp) each */
    const float *b_down_exps;                /* (n_expert, n_embd) */
    /* BERT-family encoders (post-norm: each LayerNorm after its residual) */
    const float *attn_out_norm, *attn_out_norm_b;   /* (n_embd) each: attn_output_norm */
    const float *layer_out_norm, *layer_out_norm_b; /* (n_embd) each: layer_output_norm */
    const float *b_up, *b_down;                     /* (n_ff), (n_embd): bert's FFN biases, NULL if absent */
};

/* idx = 0..n-1 ordered by descending v, equal values in the order ggml's CPU
 * argsort (libstdc++'s std::sort) leaves them: llama.cpp's expert choice. */
void model_argsort_desc(const float *v, int n, int32_t *idx);

struct model {
    struct gguf_file *file;
    char *path;
    struct model_hparams hp;
    struct model_mat tok_embd;               /* (n_vocab, n_embd) */
    struct model_mat output;                 /* (n_vocab, n_embd); tok_embd when tied */
    const float *output_norm;                /* (n_embd) */
    struct model_layer *layers;              /* (n_layer) */
    /* RoPE: position p rotates pair i by p * freq_scale * theta_scale^i / freq_factors[i] */
    float rope_theta_scale;
    float rope_freq_scale;
    float *rope_freq_factors;                /* (n_rot / 2); NULL: all 1. LongRoPE: the set in use */
    float rope_mscale;                       /* cos and sin are scaled by it: rope.scaling.attn_factor, times
                                                YaRN's magnitude (in ggml's order), else 1 */
    /* phi3 LongRoPE: both sets, (n_rot / 2) each, one allocation; rope_freq_factors holds a copy of one */
    float *rope_factors_short, *rope_factors_long;
    bool rope_long;                          /* model_set_n_ctx chose the long set */
    /* sliding-window layers (hp.n_swa > 0) rotate with their own base and no
     * scaling when rope_swa_own is set (gemma3), else as the other layers */
    bool rope_swa_own;
    float rope_theta_scale_swa;              /* rope_freq_base_swa^(-2 / n_rot) */
    /* YaRN: pair i mixes extrapolated and interpolated angles by the ramp
     * between the corr dims */
    float rope_ext_factor;                   /* 0: off */
    float rope_yarn_corr[2];
    uint64_t weight_bytes;
    uint64_t active_weight_bytes;            /* per decode token: experts counted used / n_expert */
    /* BERT-family encoders */
    struct model_mat type_embd;              /* (n_token_types, n_embd) token_types; row 0 is added to every
                                                token ("sentence A"); data NULL if absent */
    struct model_mat pos_embd;               /* (n_ctx_train, n_embd) position_embd (bert; nomic-bert rotates) */
    const float *tok_norm, *tok_norm_b;      /* (n_embd) each: token_embd_norm, the embeddings' LayerNorm */
    /* Small 1-D tensors (norms, biases) converted to f32 at load, in one block. */
    float *vec_store;
};

/* model_embed.c: <arch>.pooling_type and <arch>.attention.causal into hp
 * (KS_ERR_FORMAT naming a key of the wrong type or an unknown pooling). */
ks_status model_read_embed_meta(const struct gguf_file *f, const char *arch, struct model_hparams *hp);
/* out (dim) = pooling p (MEAN, CLS or LAST) of rows (n, dim), n >= 1. */
void model_pool_rows(enum model_pooling p, const float *rows, int32_t n, int dim, float *out);

/* model_forward.c's RoPE, shared with the encoders: the cos / sin of
 * position pos for every rotated pair (cs: n_rot / 2 pairs), and the rotation
 * of one head's first n_rot values. */
void model_rope_angles(const struct model *m, bool swa_own, int32_t pos, float *cs);
void model_rope_head(float *h, const float *cs, int n_rot, enum model_rope_type type);

/* model_bert.c: model_forward_embed for an encoder (hp.encoder_only). Every
 * entry must be an embedding entry of a sequence whole in the batch and
 * absent from the cache; attention runs within each sequence's input, never
 * through the KV cache. */
ks_status model_bert_forward_embed(const struct model *m, threads_pool *pool, const struct model_batch *b,
                                   const bool *embed, const struct kv_cache *kv, float *embd, int32_t *n_embd_out);

#endif
