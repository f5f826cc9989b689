/* model: load a llama / qwen2 / qwen3 / qwen3moe / phi3 / gemma2 / gemma3 /
 * gpt-oss GGUF (llama with experts is Mixtral). Hyper-parameters come from the metadata; every tensor is checked
 * for presence, shape and a usable type, and matrices are used in place from
 * the mapping. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "model/model_internal.h"

/* ---- architectures ------------------------------------------------------ */

struct arch_info {
    const char *name;
    enum model_arch arch;
    enum model_rope_type rope_type;
    bool needs_qkv_bias;
    bool needs_qk_norm;
    bool needs_experts;
    bool fused_qkv_gate_up;  /* phi3: attn_qkv (or attn_q/k/v) and a fused ffn_up */
    bool encoder;            /* bert, nomic-bert: load_encoder_tensors, model_bert.c */
};

static const struct arch_info g_archs[] = {
    {"llama", MODEL_ARCH_LLAMA, MODEL_ROPE_NORMAL, false, false, false, false, false},
    {"qwen2", MODEL_ARCH_QWEN2, MODEL_ROPE_NEOX, true, false, false, false, false},
    {"qwen3", MODEL_ARCH_QWEN3, MODEL_ROPE_NEOX, false, true, false, false, false},
    {"qwen3moe", MODEL_ARCH_QWEN3MOE, MODEL_ROPE_NEOX, false, true, true, false, false},
    {"phi3", MODEL_ARCH_PHI3, MODEL_ROPE_NEOX, false, false, false, true, false},
    {"gemma2", MODEL_ARCH_GEMMA2, MODEL_ROPE_NEOX, false, false, false, false, false},
    {"gemma3", MODEL_ARCH_GEMMA3, MODEL_ROPE_NEOX, false, true, false, false, false},
    {"gpt-oss", MODEL_ARCH_GPT_OSS, MODEL_ROPE_NEOX, true, false, true, false, false},
    /* llama.cpp rotates nomic-bert (and would bert) the NEOX way */
    {"bert", MODEL_ARCH_BERT, MODEL_ROPE_NEOX, false, false, false, false, true},
    {"nomic-bert", MODEL_ARCH_NOMIC_BERT, MODEL_ROPE_NEOX, false, false, false, false, true},
};

static const struct arch_info *arch_find(const struct gguf_str *s)
{
    for (size_t i = 0; i < sizeof g_archs / sizeof g_archs[0]; i++)
        if (strlen(g_archs[i].name) == s->len && !memcmp(g_archs[i].name, s->data, s->len))
            return &g_archs[i];
    return NULL;
}

/* ---- metadata ------------------------------------------------------------- */

/* The status of reading key: an absent optional key is KS_OK with *absent
 * set (the caller takes its default), an absent required one is an error
 * naming it. */
static ks_status meta_found(ks_status st, const char *key, bool required, bool *absent)
{
    *absent = st == KS_ERR_NOT_FOUND && !required;
    if (st == KS_ERR_NOT_FOUND && required)
        return ks_fail(KS_ERR_FORMAT, "required metadata key %s is missing", key);
    return *absent ? KS_OK : st;
}

static ks_status meta_int(const struct gguf_file *f, const char *arch, const char *suffix, bool required,
                          int def, int *out)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    uint32_t v;
    bool absent;
    ks_status st = meta_found(gguf_get_u32(f, key, &v), key, required, &absent);
    if (absent)
        *out = def;
    if (st || absent)
        return st;
    if (v == 0 || v > (1u << 30))
        return ks_fail(KS_ERR_FORMAT, "metadata %s = %u is out of range", key, v);
    *out = (int)v;
    return KS_OK;
}

static ks_status meta_float(const struct gguf_file *f, const char *arch, const char *suffix, bool required,
                            float def, float *out)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    bool absent;
    ks_status st = meta_found(gguf_get_f32(f, key, out), key, required, &absent);
    if (absent)
        *out = def;
    if (st || absent)
        return st;
    if (!isfinite(*out))
        return ks_fail(KS_ERR_FORMAT, "metadata %s is not a finite number", key);
    return KS_OK;
}

static bool meta_str_is(const struct gguf_file *f, const char *key, const char *want, bool *present)
{
    struct gguf_str s;
    *present = gguf_get_str(f, key, &s) == KS_OK;
    return *present && strlen(want) == s.len && !strncasecmp(want, s.data, s.len);
}

static ks_status read_shape(const struct gguf_file *f, const char *a, struct model_hparams *hp)
{
    ks_status st;
    if ((st = meta_int(f, a, "embedding_length", true, 0, &hp->n_embd)) ||
        (st = meta_int(f, a, "block_count", true, 0, &hp->n_layer)) ||
        (st = meta_int(f, a, "attention.head_count", true, 0, &hp->n_head)) ||
        (st = meta_int(f, a, "attention.head_count_kv", false, hp->n_head, &hp->n_head_kv)) ||
        (st = meta_int(f, a, "feed_forward_length", true, 0, &hp->n_ff)) ||
        (st = meta_int(f, a, "context_length", true, 0, &hp->n_ctx_train)))
        return st;
    /* encoders normalize with LayerNorm, the others with RMSNorm: one epsilon each */
    float *eps = hp->encoder_only ? &hp->norm_eps : &hp->rms_eps;
    if ((st = meta_float(f, a, hp->encoder_only ? "attention.layer_norm_epsilon" : "attention.layer_norm_rms_epsilon",
                         true, 0, eps)))
        return st;
    /* 0 (rejected below) when the default is needed but does not divide */
    int def_hd = hp->n_embd % hp->n_head == 0 ? hp->n_embd / hp->n_head : 0;
    if ((st = meta_int(f, a, "attention.key_length", false, def_hd, &hp->head_dim_k)) ||
        (st = meta_int(f, a, "attention.value_length", false, def_hd, &hp->head_dim_v)))
        return st;
    if (hp->head_dim_k == 0 || hp->head_dim_v == 0)
        return ks_fail(KS_ERR_FORMAT, "%s.embedding_length %d is not a multiple of head_count %d", a,
                       hp->n_embd, hp->n_head);
    if ((st = meta_int(f, a, "rope.dimension_count", false, hp->head_dim_k, &hp->n_rot)) ||
        (st = meta_float(f, a, "rope.freq_base", false, 10000.0f, &hp->rope_freq_base)))
        return st;
    if (hp->n_head_kv > hp->n_head || hp->n_head % hp->n_head_kv != 0)
        return ks_fail(KS_ERR_FORMAT, "%s.attention.head_count %d is not a multiple of head_count_kv %d", a,
                       hp->n_head, hp->n_head_kv);
    if (hp->head_dim_k != hp->head_dim_v)
        return ks_fail(KS_ERR_UNSUPPORTED, "key_length %d differs from value_length %d; kvserve needs them equal",
                       hp->head_dim_k, hp->head_dim_v);
    if (hp->n_rot % 2 != 0 || hp->n_rot > hp->head_dim_k)
        return ks_fail(KS_ERR_FORMAT, "%s.rope.dimension_count %d must be even and at most the head size %d", a,
                       hp->n_rot, hp->head_dim_k);
    if (!(*eps > 0) || !(hp->rope_freq_base > 0))
        return ks_fail(KS_ERR_FORMAT, "%s.attention.layer_norm_%sepsilon and rope.freq_base must be positive", a,
                       hp->encoder_only ? "" : "rms_");
    return KS_OK;
}

/* ---- experts ---------------------------------------------------------------- */

/* expert_count, expert_used_count and the expert FFN width. The routing
 * kvserve runs is the one llama.cpp runs for llama and qwen3moe (softmax over
 * all experts, top-k, weights renormalized); a file asking for anything else
 * (shared experts, another gating function, scaled weights) is refused by key
 * rather than run another way. */
static ks_status read_experts(const struct gguf_file *f, const char *a, bool required, struct model_hparams *hp)
{
    char key[128];
    uint32_t n = 0, used = 0;
    snprintf(key, sizeof key, "%s.expert_count", a);
    ks_status st = gguf_get_u32(f, key, &n);
    if (st == KS_ERR_NOT_FOUND && !required)
        return KS_OK;
    if (st == KS_ERR_NOT_FOUND)
        return ks_fail(KS_ERR_FORMAT, "required metadata key %s is missing (a %s file is a mixture of experts)", key, a);
    if (st)
        return st;
    if (n == 0 && !required)
        return KS_OK;
    if (n == 0 || n > MODEL_MAX_EXPERTS)
        return ks_fail(KS_ERR_FORMAT, "metadata %s = %u, expected 1..%d", key, n, MODEL_MAX_EXPERTS);
    snprintf(key, sizeof key, "%s.expert_used_count", a);
    st = gguf_get_u32(f, key, &used);
    if (st == KS_ERR_NOT_FOUND)
        return ks_fail(KS_ERR_FORMAT, "required metadata key %s is missing (%s.expert_count is %u)", key, a, n);
    if (st)
        return st;
    if (used == 0 || used > n)
        return ks_fail(KS_ERR_FORMAT, "metadata %s = %u, expected 1..%u (%s.expert_count)", key, used, n, a);
    hp->n_expert = (int)n;
    hp->n_expert_used = (int)used;
    hp->n_ff_exp = hp->n_ff;
    if (hp->arch == MODEL_ARCH_QWEN3MOE &&
        (st = meta_int(f, a, "expert_feed_forward_length", false, hp->n_ff / hp->n_expert_used, &hp->n_ff_exp)))
        return st;
    if (hp->arch == MODEL_ARCH_GPT_OSS && (st = meta_int(f, a, "expert_feed_forward_length", true, 0, &hp->n_ff_exp)))
        return st;
    if (hp->n_ff_exp <= 0)
        return ks_fail(KS_ERR_FORMAT, "%s.expert_feed_forward_length is missing and feed_forward_length %d / "
                                      "expert_used_count %d is 0", a, hp->n_ff, hp->n_expert_used);
    uint32_t shared = 0;
    snprintf(key, sizeof key, "%s.expert_shared_count", a);
    if (gguf_get_u32(f, key, &shared) == KS_OK && shared != 0)
        return ks_fail(KS_ERR_UNSUPPORTED, "metadata %s = %u: shared experts are not supported", key, shared);
    uint32_t gating = 0;
    snprintf(key, sizeof key, "%s.expert_gating_func", a);
    /* llama.cpp's gpt-oss graph gates its own way whatever this key says */
    if (hp->arch != MODEL_ARCH_GPT_OSS && gguf_get_u32(f, key, &gating) == KS_OK && gating != 1)
        return ks_fail(KS_ERR_UNSUPPORTED, "metadata %s = %u: only 1 (softmax) is supported", key, gating);
    float scale = 0.0f;
    snprintf(key, sizeof key, "%s.expert_weights_scale", a);
    if (gguf_get_f32(f, key, &scale) == KS_OK && scale != 0.0f && scale != 1.0f)
        return ks_fail(KS_ERR_UNSUPPORTED, "metadata %s = %g: scaled expert weights are not supported", key,
                       (double)scale);
    return KS_OK;
}

/* ---- gpt-oss ------------------------------------------------------------- */

/* The sliding window and its layer pattern, and the features llama.cpp's
 * openai-moe graph always has (sinks, biases, softmax after top-k, the
 * clamped SwiGLU, the post-attention norm's name). */
static ks_status read_gpt_oss(const struct gguf_file *f, const char *a, struct model_hparams *hp)
{
    char key[128];
    ks_status st = meta_int(f, a, "attention.sliding_window", true, 0, &hp->n_swa);
    if (st)
        return st;
    uint32_t pattern = 2;
    snprintf(key, sizeof key, "%s.attention.sliding_window_pattern", a);
    st = gguf_get_u32(f, key, &pattern);
    if (st && st != KS_ERR_NOT_FOUND)
        return ks_fail(KS_ERR_UNSUPPORTED, "metadata %s must be one unsigned integer (a per-layer array is not "
                                           "supported)", key);
    if (pattern > (uint32_t)hp->n_layer + 1)
        return ks_fail(KS_ERR_FORMAT, "metadata %s = %u exceeds the layer count %d", key, pattern, hp->n_layer);
    hp->swa_pattern = (int)pattern;
    hp->rope_freq_base_swa = hp->rope_freq_base;
    float base_swa = hp->rope_freq_base;
    if ((st = meta_float(f, a, "rope.freq_base_swa", false, hp->rope_freq_base, &base_swa)))
        return st;
    if (base_swa != hp->rope_freq_base)
        return ks_fail(KS_ERR_UNSUPPORTED, "%s.rope.freq_base_swa %g differs from rope.freq_base %g: a separate RoPE "
                                           "base for sliding layers is not supported for %s", a, (double)base_swa,
                       (double)hp->rope_freq_base, a);
    hp->oai.attn_sinks = hp->oai.attn_out_bias = hp->oai.post_attn_norm = true;
    hp->oai.expert_bias = hp->oai.softmax_after_topk = hp->oai.swiglu_oai = true;
    return KS_OK;
}

/* ---- RoPE scaling --------------------------------------------------------- */

/* Llama 3.1's frequency rescaling, as llama.cpp's converter bakes into rope_freqs. */
static void llama3_factors(const struct model_hparams *hp, float *ff)
{
    float lo_wavelen = (float)hp->rope_llama3_orig_ctx / hp->rope_llama3_low_freq_factor;
    float hi_wavelen = (float)hp->rope_llama3_orig_ctx / hp->rope_llama3_high_freq_factor;
    for (int i = 0; i < hp->n_rot / 2; i++) {
        float freq = 1.0f / powf(hp->rope_freq_base, (float)(2 * i) / (float)hp->n_rot);
        float wavelen = 2.0f * (float)M_PI / freq;
        if (wavelen < hi_wavelen) {
            ff[i] = 1.0f;
        } else if (wavelen > lo_wavelen) {
            ff[i] = hp->rope_scale_factor;
        } else {
            float smooth = ((float)hp->rope_llama3_orig_ctx / wavelen - hp->rope_llama3_low_freq_factor) /
                           (hp->rope_llama3_high_freq_factor - hp->rope_llama3_low_freq_factor);
            ff[i] = 1.0f / ((1.0f - smooth) / hp->rope_scale_factor + smooth);
        }
    }
}

/* A vector of n_rot / 2 positive per-dimension frequency factors (rope_freqs,
 * rope_factors_long / short), converted to f32 into out. */
static ks_status read_factors_tensor(const struct model *m, const struct gguf_tensor_info *t, float *out)
{
    const struct model_hparams *hp = &m->hp;
    const struct quant_traits *tr = quant_traits(t->type);
    if (t->n_dims != 1 || t->ne[0] != hp->n_rot / 2 || !tr || !tr->to_float)
        return ks_fail(KS_ERR_FORMAT, "tensor %s must be a vector of %d f32 (n_rot / 2)", t->name, hp->n_rot / 2);
    tr->to_float(t->data, out, t->ne[0]);
    for (int i = 0; i < hp->n_rot / 2; i++)
        if (!(out[i] > 0) || !isfinite(out[i]))
            return ks_fail(KS_ERR_FORMAT, "tensor %s has a non-positive factor at %d", t->name, i);
    return KS_OK;
}

static ks_status read_rope_freqs_tensor(struct model *m, const struct gguf_tensor_info *t)
{
    return read_factors_tensor(m, t, m->rope_freq_factors);
}

/* ---- phi3: LongRoPE ------------------------------------------------------- */

/* rope_factors_short / rope_factors_long (both or neither, one copy for all
 * layers, as convert_hf_to_gguf writes them). llama.cpp rotates with the long
 * set when its context per sequence exceeds the original training context
 * (model_set_n_ctx); the magnitude scaling is rope.scaling.attn_factor, read
 * for every architecture in read_rope. */
static ks_status read_longrope(struct model *m)
{
    struct model_hparams *hp = &m->hp;
    const struct gguf_tensor_info *sh = gguf_find_tensor(m->file, "rope_factors_short.weight");
    const struct gguf_tensor_info *lo = gguf_find_tensor(m->file, "rope_factors_long.weight");
    if (!sh && !lo)
        return KS_OK;
    if (!sh || !lo)
        return ks_fail(KS_ERR_FORMAT, "tensor %s is present but %s is missing (LongRoPE needs both)",
                       sh ? "rope_factors_short.weight" : "rope_factors_long.weight",
                       sh ? "rope_factors_long.weight" : "rope_factors_short.weight");
    size_t half = (size_t)(hp->n_rot / 2);
    float *both = malloc(sizeof(float) * 2 * half);
    m->rope_freq_factors = malloc(sizeof(float) * half);
    m->rope_factors_short = both;
    m->rope_factors_long = both ? both + half : NULL;
    if (!both || !m->rope_freq_factors)
        return ks_fail(KS_ERR_NOMEM, "out of memory for rope factors");
    ks_status st;
    if ((st = read_factors_tensor(m, sh, both)) || (st = read_factors_tensor(m, lo, both + half)))
        return st;
    hp->rope_scaling = MODEL_ROPE_SCALING_LONGROPE;
    model_set_n_ctx(m, hp->n_ctx_train);
    return KS_OK;
}

/* attention.sliding_window as stored: llama.cpp reads it for phi3 and then
 * turns it off (its "Phi SWA is currently disabled"), so it is shown, not run.
 * 0 is valid here (convert_hf_to_gguf writes 0 for Phi-4). */
static ks_status read_stored_window(const struct gguf_file *f, const char *a, struct model_hparams *hp)
{
    char key[128];
    uint32_t v = 0;
    snprintf(key, sizeof key, "%s.attention.sliding_window", a);
    ks_status st = gguf_get_u32(f, key, &v);
    if (st && st != KS_ERR_NOT_FOUND)
        return st;
    if (v > (1u << 30))
        return ks_fail(KS_ERR_FORMAT, "metadata %s = %u is out of range", key, v);
    hp->n_swa_stored = (int)v;
    return KS_OK;
}

/* llama.cpp's corr dim: the pair index whose wavelength makes n_rot_turns
 * turns over the original context (ggml_rope_yarn_corr_dim). */
static float yarn_corr_dim(int n_dims, int n_ctx_orig, float n_rot_turns, float base)
{
    return (float)n_dims * logf((float)n_ctx_orig / (n_rot_turns * 2 * (float)M_PI)) / (2 * logf(base));
}

/* llama.cpp's YaRN magnitude, 1 + 0.1 mscale ln(scale) above scale 1. */
static float yarn_get_mscale(float scale, float mscale)
{
    return scale <= 1.0f ? 1.0f : 0.1f * mscale * logf(scale) + 1.0f;
}

/* llama.cpp's YaRN ramp bounds. Its loader reads no rope.scaling.yarn_beta_*
 * keys, nor yarn_log_multiplier, for the architectures kvserve runs
 * (measured on the anchor build: a gpt-oss file saying beta 4 / 2 and log
 * multiplier 0.5 runs as one without them), so neither does kvserve; it does
 * read rope.scaling.attn_factor. */
#define YARN_BETA_FAST 32.0f
#define YARN_BETA_SLOW 1.0f

/* YaRN as llama.cpp sets it up: ext_factor 1; the attention factor from the
 * scale, divided by the magnitude ggml's rope multiplies back in, times
 * rope.scaling.attn_factor (read by read_rope for every architecture, already
 * in rope_mscale); the corr dims from the beta bounds and the original context. */
static ks_status read_yarn(struct model *m, const char *a, float factor)
{
    struct model_hparams *hp = &m->hp;
    ks_status st;
    if ((st = meta_int(m->file, a, "rope.scaling.original_context_length", false, hp->n_ctx_train,
                       &hp->rope_yarn_orig_ctx)))
        return st;
    hp->rope_yarn_beta_fast = YARN_BETA_FAST;
    hp->rope_yarn_beta_slow = YARN_BETA_SLOW;
    hp->rope_scaling = MODEL_ROPE_SCALING_YARN;
    m->rope_freq_scale = 1.0f / factor;
    m->rope_ext_factor = 1.0f;
    float scale = 1.0f / m->rope_freq_scale;
    float attn = yarn_get_mscale(scale, 1.0f);
    attn *= 1.0f / (1.0f + 0.1f * logf(scale));
    float ggml_mscale = 1.0f + 0.1f * logf(1.0f / m->rope_freq_scale);
    hp->rope_yarn_mscale = attn * ggml_mscale;
    /* llama.cpp's order: (yarn attn_factor * rope.scaling.attn_factor) * ggml's magnitude */
    m->rope_mscale = (attn * hp->rope_attn_factor) * ggml_mscale;
    float lo = floorf(yarn_corr_dim(hp->n_rot, hp->rope_yarn_orig_ctx, hp->rope_yarn_beta_fast, hp->rope_freq_base));
    float hi = ceilf(yarn_corr_dim(hp->n_rot, hp->rope_yarn_orig_ctx, hp->rope_yarn_beta_slow, hp->rope_freq_base));
    m->rope_yarn_corr[0] = lo > 0.0f ? lo : 0.0f;
    m->rope_yarn_corr[1] = hi < (float)(hp->n_rot - 1) ? hi : (float)(hp->n_rot - 1);
    return KS_OK;
}

static ks_status read_rope(struct model *m, const char *a)
{
    struct model_hparams *hp = &m->hp;
    const struct gguf_file *f = m->file;
    char key[128];
    ks_status st;
    float factor = 1.0f, linear = 0.0f;
    if ((st = meta_float(f, a, "rope.scaling.factor", false, 1.0f, &factor)) ||
        (st = meta_float(f, a, "rope.scale_linear", false, 0.0f, &linear)))
        return st;
    if (linear != 0.0f)
        factor = linear;
    if (!(factor > 0))
        return ks_fail(KS_ERR_FORMAT, "%s.rope.scaling.factor must be positive", a);
    hp->rope_scale_factor = factor;
    m->rope_freq_scale = 1.0f;
    m->rope_theta_scale = powf(hp->rope_freq_base, -2.0f / (float)hp->n_rot);
    /* llama.cpp multiplies its rope attn_factor (cos and sin) by this key's value for every architecture */
    if ((st = meta_float(f, a, "rope.scaling.attn_factor", false, 1.0f, &hp->rope_attn_factor)) ||
        (st = meta_int(f, a, "rope.scaling.original_context_length", false, hp->n_ctx_train, &hp->rope_n_ctx_orig)))
        return st;
    if (!(hp->rope_attn_factor > 0))
        return ks_fail(KS_ERR_FORMAT, "%s.rope.scaling.attn_factor must be positive", a);
    m->rope_mscale = hp->rope_attn_factor;
    if (hp->arch == MODEL_ARCH_PHI3) /* llama.cpp's phi3 has no rope_freqs and no scaling type */
        return read_longrope(m);

    snprintf(key, sizeof key, "%s.rope.scaling.type", a);
    bool has_type;
    bool is_linear = meta_str_is(f, key, "linear", &has_type);
    bool is_llama3 = has_type && meta_str_is(f, key, "llama3", &has_type);
    bool is_none = has_type && meta_str_is(f, key, "none", &has_type);
    bool is_yarn = has_type && meta_str_is(f, key, "yarn", &has_type);
    const struct gguf_tensor_info *freqs = gguf_find_tensor(f, "rope_freqs.weight");

    if (freqs || is_llama3) {
        m->rope_freq_factors = malloc(sizeof(float) * (size_t)(hp->n_rot / 2));
        if (!m->rope_freq_factors)
            return ks_fail(KS_ERR_NOMEM, "out of memory for rope factors");
        hp->rope_scaling = MODEL_ROPE_SCALING_LLAMA3;
    }
    if (freqs)
        return read_rope_freqs_tensor(m, freqs);
    if (is_llama3) {
        if ((st = meta_float(f, a, "rope.scaling.low_freq_factor", false, 1.0f,
                             &hp->rope_llama3_low_freq_factor)) ||
            (st = meta_float(f, a, "rope.scaling.high_freq_factor", false, 4.0f,
                             &hp->rope_llama3_high_freq_factor)) ||
            (st = meta_int(f, a, "rope.scaling.original_context_length", false, 8192,
                           &hp->rope_llama3_orig_ctx)))
            return st;
        if (!(hp->rope_llama3_high_freq_factor > hp->rope_llama3_low_freq_factor) ||
            !(hp->rope_llama3_low_freq_factor > 0))
            return ks_fail(KS_ERR_FORMAT, "llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor");
        llama3_factors(hp, m->rope_freq_factors);
        return KS_OK;
    }
    if (is_yarn)
        return read_yarn(m, a, factor);
    if (is_linear || (!has_type && factor != 1.0f)) {
        hp->rope_scaling = MODEL_ROPE_SCALING_LINEAR;
        m->rope_freq_scale = 1.0f / factor;
        return KS_OK;
    }
    if (has_type && !is_none) {
        struct gguf_str s;
        gguf_get_str(f, key, &s);
        return ks_fail(KS_ERR_UNSUPPORTED, "%s = '%.*s' is not supported (kvserve knows none, linear, llama3, yarn)",
                       key, (int)(s.len > 64 ? 64 : s.len), s.data);
    }
    hp->rope_scaling = MODEL_ROPE_SCALING_NONE;
    return KS_OK;
}

/* ---- gemma2 / gemma3 ------------------------------------------------------- */

/* 2 or 3 for Gemma 2 / Gemma 3 (read_gemma), else 0 */
static int gemma_version(enum model_arch arch)
{
    return arch == MODEL_ARCH_GEMMA2 ? 2 : arch == MODEL_ARCH_GEMMA3 ? 3 : 0;
}

/* An optional u32 key that may be 0; def when absent. */
static ks_status meta_u32_opt(const struct gguf_file *f, const char *a, const char *suffix, uint32_t def,
                              uint32_t *out)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", a, suffix);
    ks_status st = gguf_get_u32(f, key, out);
    if (st == KS_ERR_NOT_FOUND) {
        *out = def;
        return KS_OK;
    }
    if (st)
        return ks_fail(KS_ERR_UNSUPPORTED, "metadata %s must be one unsigned integer: %s", key, ks_errmsg());
    if (*out > (1u << 30))
        return ks_fail(KS_ERR_FORMAT, "metadata %s = %u is out of range", key, *out);
    return KS_OK;
}

/* A soft-capping value: finite, not negative (0: off), def when absent. */
static ks_status read_softcap(const struct gguf_file *f, const char *a, const char *suffix, float def, float *out)
{
    ks_status st = meta_float(f, a, suffix, false, def, out);
    if (!st && !(*out >= 0))
        return ks_fail(KS_ERR_FORMAT, "metadata %s.%s must not be negative", a, suffix);
    return st;
}

/* Gemma's hyper-parameters as llama.cpp sets them: embeddings scaled by
 * sqrt(n_embd), post-norms, GeGLU, queries scaled by 1/sqrt(head_dim) (the
 * 27B sizes, 46 layers for gemma2 and 62 for gemma3, by
 * 1/sqrt(n_embd / n_head)) with attention scale 1. gemma2: a 4096 window on
 * even layers (pattern 2), attention and final logit soft-capping (50, 30 by
 * default). gemma3: a window from attention.sliding_window on 5 of every 6
 * layers (attention.sliding_window_pattern), window layers at RoPE base
 * rope.freq_base_swa (10000) without scaling; a file without a window gets
 * final logit soft-capping instead when it has final_logit_softcapping. */
static ks_status read_gemma(struct model *m, const char *a, int gemma)
{
    struct model_hparams *hp = &m->hp;
    const struct gguf_file *f = m->file;
    hp->embd_scale = sqrtf((float)hp->n_embd);
    hp->has_post_norms = true;
    hp->ffn_act = MODEL_FFN_GEGLU;
    bool is_27b = hp->n_layer == (gemma == 2 ? 46 : 62);
    hp->attn_q_scale = is_27b ? 1.0f / sqrtf((float)(hp->n_embd / hp->n_head)) : 1.0f / sqrtf((float)hp->head_dim_k);
    uint32_t n_swa = 0, pattern = 0;
    ks_status st;
    if (gemma == 2) {
        hp->swa_pattern = 2;
        hp->rope_freq_base_swa = hp->rope_freq_base;
        if ((st = meta_u32_opt(f, a, "attention.sliding_window", 4096, &n_swa)) ||
            (st = read_softcap(f, a, "attn_logit_softcapping", 50.0f, &hp->attn_softcap)) ||
            (st = read_softcap(f, a, "final_logit_softcapping", 30.0f, &hp->final_softcap)))
            return st;
        hp->n_swa = (int)n_swa;
        return KS_OK;
    }
    if ((st = meta_u32_opt(f, a, "attention.sliding_window", 0, &n_swa)))
        return st;
    if (n_swa == 0) /* llama.cpp's gemma3 graph without window layers caps the logits, if the file says by what */
        return read_softcap(f, a, "final_logit_softcapping", 0.0f, &hp->final_softcap);
    if ((st = meta_u32_opt(f, a, "attention.sliding_window_pattern", 6, &pattern)) ||
        (st = meta_float(f, a, "rope.freq_base_swa", false, 10000.0f, &hp->rope_freq_base_swa)))
        return st;
    if (!(hp->rope_freq_base_swa > 0))
        return ks_fail(KS_ERR_FORMAT, "metadata %s.rope.freq_base_swa must be positive", a);
    hp->n_swa = (int)n_swa;
    hp->swa_pattern = (int)pattern;
    m->rope_swa_own = true;
    m->rope_theta_scale_swa = powf(hp->rope_freq_base_swa, -2.0f / (float)hp->n_rot);
    return KS_OK;
}

bool model_layer_is_swa(const struct model_hparams *hp, int il)
{
    return hp->n_swa > 0 && (hp->swa_pattern == 0 || il % hp->swa_pattern < hp->swa_pattern - 1);
}

/* ---- tensors ------------------------------------------------------------- */

struct loader {
    struct model *m;
    float *vec_next, *vec_end;
};

static const struct gguf_tensor_info *find_tensor(const struct gguf_file *f, const char *name, bool required,
                                                  ks_status *st)
{
    const struct gguf_tensor_info *t = gguf_find_tensor(f, name);
    if (!t && required)
        *st = ks_fail(KS_ERR_FORMAT, "tensor '%s' is missing", name);
    return t;
}

static ks_status load_mat(struct loader *ld, const char *name, int64_t rows, int64_t cols, bool required,
                          struct model_mat *out)
{
    ks_status st = KS_OK;
    const struct gguf_tensor_info *t = find_tensor(ld->m->file, name, required, &st);
    if (!t)
        return st;
    if (t->ne[0] != cols || t->ne[1] != rows || t->ne[2] != 1 || t->ne[3] != 1)
        return ks_fail(KS_ERR_FORMAT, "tensor '%s' has shape [%lld, %lld, %lld, %lld], expected [%lld, %lld]",
                       name, (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2],
                       (long long)t->ne[3], (long long)cols, (long long)rows);
    const struct quant_traits *tr = quant_traits(t->type);
    if (!tr || !tr->vec_dot || !tr->to_float)
        return ks_fail(KS_ERR_UNSUPPORTED, "tensor '%s' has type %s, which kvserve has no kernels for", name,
                       quant_type_name(t->type));
    *out = (struct model_mat){.data = t->data, .type = t->type, .rows = rows, .cols = cols};
    return KS_OK;
}

/* Norms and biases are small: convert them to f32 once. A tensor of `rows`
 * vectors of n (GGUF [n, rows]; per-expert biases) is rows * n floats. */
static ks_status load_vecs(struct loader *ld, const char *name, int64_t n, int64_t rows, bool required,
                           const float **out)
{
    ks_status st = KS_OK;
    const struct gguf_tensor_info *t = find_tensor(ld->m->file, name, required, &st);
    *out = NULL;
    if (!t)
        return st;
    if (t->ne[0] != n || t->ne[1] != rows || t->ne[2] != 1 || t->ne[3] != 1)
        return ks_fail(KS_ERR_FORMAT, "tensor '%s' has shape [%lld, %lld], expected [%lld, %lld]", name,
                       (long long)t->ne[0], (long long)t->ne[1], (long long)n, (long long)rows);
    n *= rows;
    const struct quant_traits *tr = quant_traits(t->type);
    if (!tr || !tr->to_float)
        return ks_fail(KS_ERR_UNSUPPORTED, "tensor '%s' has type %s, which kvserve cannot read", name,
                       quant_type_name(t->type));
    if (ld->vec_end - ld->vec_next < n)
        return ks_fail(KS_ERR_INTERNAL, "model vector store too small at '%s'", name);
    tr->to_float(t->data, ld->vec_next, n);
    *out = ld->vec_next;
    ld->vec_next += n;
    return KS_OK;
}

static ks_status load_vec(struct loader *ld, const char *name, int64_t n, bool required, const float **out)
{
    return load_vecs(ld, name, n, 1, required, out);
}

/* An expert tensor: GGUF [cols, rows, n_expert]. */
static ks_status load_experts(struct loader *ld, const char *name, int64_t rows, int64_t cols,
                              struct model_experts *out)
{
    const struct gguf_file *f = ld->m->file;
    int n_expert = ld->m->hp.n_expert;
    const struct gguf_tensor_info *t = gguf_find_tensor(f, name);
    if (!t) {
        /* blk.N.ffn_gate_exps.weight -> blk.N.ffn_gate.0.weight: the layout of older Mixtral files */
        char old[128];
        const char *x = strstr(name, "_exps.weight");
        if (x && snprintf(old, sizeof old, "%.*s.0.weight", (int)(x - name), name) < (int)sizeof old &&
            gguf_find_tensor(f, old))
            return ks_fail(KS_ERR_UNSUPPORTED,
                           "tensor '%s' is missing but '%s' is present: the per-expert tensor layout of older "
                           "Mixtral GGUF files is not supported; convert the model again with a current "
                           "llama.cpp convert_hf_to_gguf.py (one 3-D tensor per layer and matrix)",
                           name, old);
        return ks_fail(KS_ERR_FORMAT, "tensor '%s' is missing (%s.expert_count is %d)", name, ld->m->hp.arch_name,
                       n_expert);
    }
    if (t->ne[0] != cols || t->ne[1] != rows || t->ne[2] != n_expert || t->ne[3] != 1)
        return ks_fail(KS_ERR_FORMAT,
                       "tensor '%s' has shape [%lld, %lld, %lld, %lld], expected [%lld, %lld, %d] (n_expert %d)",
                       name, (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2], (long long)t->ne[3],
                       (long long)cols, (long long)rows, n_expert, n_expert);
    const struct quant_traits *tr = quant_traits(t->type);
    if (!tr || !tr->vec_dot || !tr->to_float)
        return ks_fail(KS_ERR_UNSUPPORTED, "tensor '%s' has type %s, which kvserve has no kernels for", name,
                       quant_type_name(t->type));
    size_t stride = quant_row_size(t->type, cols) * (size_t)rows;
    if (stride == 0 || (uint64_t)stride * (uint64_t)n_expert != t->nbytes)
        return ks_fail(KS_ERR_FORMAT, "tensor '%s' holds %llu bytes, expected %d experts of %zu", name,
                       (unsigned long long)t->nbytes, n_expert, stride);
    *out = (struct model_experts){.data = t->data, .type = t->type, .rows = rows, .cols = cols, .stride = stride};
    return KS_OK;
}

static uint64_t mat_bytes(const struct model_mat *w)
{
    return (uint64_t)quant_row_size(w->type, w->cols) * (uint64_t)w->rows;
}

/* Rows first .. first + n of w, a matrix of their own (rows are contiguous). */
static struct model_mat mat_rows(const struct model_mat *w, int64_t first, int64_t n)
{
    size_t row_bytes = quant_row_size(w->type, w->cols);
    return (struct model_mat){.data = (const uint8_t *)w->data + (size_t)first * row_bytes, .type = w->type,
                              .rows = n, .cols = w->cols};
}

/* phi3: blk.N.attn_qkv holds Q's rows, then K's, then V's (llama.cpp views its
 * output at those offsets). A file with separate attn_q/k/v loads as llama's. */
static ks_status load_fused_qkv(struct loader *ld, int il, struct model_layer *L)
{
    const struct model_hparams *hp = &ld->m->hp;
    int64_t q_out = (int64_t)hp->n_head * hp->head_dim_k, kv_out = (int64_t)hp->n_head_kv * hp->head_dim_k;
    char n[96];
    snprintf(n, sizeof n, "blk.%d.attn_qkv.weight", il);
    struct model_mat qkv;
    ks_status st = load_mat(ld, n, q_out + 2 * kv_out, hp->n_embd, true, &qkv);
    if (st)
        return st;
    L->wq = mat_rows(&qkv, 0, q_out);
    L->wk = mat_rows(&qkv, q_out, kv_out);
    L->wv = mat_rows(&qkv, q_out + kv_out, kv_out);
    return KS_OK;
}

/* phi3: blk.N.ffn_up is (2 * n_ff, n_embd): ggml_swiglu takes the first half
 * as the gate (through SiLU) and the second as up. */
static ks_status load_fused_gate_up(struct loader *ld, int il, struct model_layer *L)
{
    const struct model_hparams *hp = &ld->m->hp;
    char n[96];
    snprintf(n, sizeof n, "blk.%d.ffn_up.weight", il);
    struct model_mat gate_up;
    ks_status st = load_mat(ld, n, 2 * (int64_t)hp->n_ff, hp->n_embd, true, &gate_up);
    if (st)
        return st;
    L->w_gate = mat_rows(&gate_up, 0, hp->n_ff);
    L->w_up = mat_rows(&gate_up, hp->n_ff, hp->n_ff);
    return KS_OK;
}

static ks_status load_layer(struct loader *ld, int il, const struct arch_info *ai)
{
    const struct model_hparams *hp = &ld->m->hp;
    struct model_layer *L = &ld->m->layers[il];
    int64_t E = hp->n_embd, q_out = (int64_t)hp->n_head * hp->head_dim_k;
    int64_t k_out = (int64_t)hp->n_head_kv * hp->head_dim_k, v_out = (int64_t)hp->n_head_kv * hp->head_dim_v;
    int64_t o_in = (int64_t)hp->n_head * hp->head_dim_v;
    char n[96];
    ks_status st;
#define NAME(s) (snprintf(n, sizeof n, "blk.%d." s, il), n)
    bool fused_qkv = ai->fused_qkv_gate_up && gguf_find_tensor(ld->m->file, NAME("attn_qkv.weight"));
    if (fused_qkv && (st = load_fused_qkv(ld, il, L)))
        return st;
    if ((st = load_vec(ld, NAME("attn_norm.weight"), E, true, &L->attn_norm)) ||
        (st = load_mat(ld, NAME("attn_q.weight"), q_out, E, !fused_qkv, &L->wq)) ||
        (st = load_mat(ld, NAME("attn_k.weight"), k_out, E, !fused_qkv, &L->wk)) ||
        (st = load_mat(ld, NAME("attn_v.weight"), v_out, E, !fused_qkv, &L->wv)) ||
        (st = load_mat(ld, NAME("attn_output.weight"), E, o_in, true, &L->wo)) ||
        (st = load_vec(ld, NAME("attn_q.bias"), q_out, ai->needs_qkv_bias, &L->bq)) ||
        (st = load_vec(ld, NAME("attn_k.bias"), k_out, ai->needs_qkv_bias, &L->bk)) ||
        (st = load_vec(ld, NAME("attn_v.bias"), v_out, ai->needs_qkv_bias, &L->bv)))
        return st;
    if (hp->oai.post_attn_norm ? (st = load_vec(ld, NAME("post_attention_norm.weight"), E, true, &L->ffn_norm))
                               : (st = load_vec(ld, NAME("ffn_norm.weight"), E, true, &L->ffn_norm)))
        return st;
    if ((hp->oai.attn_out_bias && (st = load_vec(ld, NAME("attn_output.bias"), E, true, &L->bo))) ||
        (hp->oai.attn_sinks && (st = load_vec(ld, NAME("attn_sinks.weight"), hp->n_head, true, &L->sinks))))
        return st;
    if (ai->needs_qk_norm &&
        ((st = load_vec(ld, NAME("attn_q_norm.weight"), hp->head_dim_k, true, &L->q_norm)) ||
         (st = load_vec(ld, NAME("attn_k_norm.weight"), hp->head_dim_k, true, &L->k_norm))))
        return st;
    if (hp->has_post_norms &&
        ((st = load_vec(ld, NAME("post_attention_norm.weight"), E, true, &L->post_attn_norm)) ||
         (st = load_vec(ld, NAME("post_ffw_norm.weight"), E, true, &L->post_ffn_norm))))
        return st;
    uint64_t attn = mat_bytes(&L->wq) + mat_bytes(&L->wk) + mat_bytes(&L->wv) + mat_bytes(&L->wo);
    if (hp->n_expert == 0) {
        if (!gguf_find_tensor(ld->m->file, NAME("ffn_gate.weight")) &&
            gguf_find_tensor(ld->m->file, NAME("ffn_gate_inp.weight")))
            return ks_fail(KS_ERR_FORMAT, "tensor '%s' is present but metadata %s.expert_count is missing", n,
                           hp->arch_name);
        if (ai->fused_qkv_gate_up ? (st = load_fused_gate_up(ld, il, L))
                                  : ((st = load_mat(ld, NAME("ffn_gate.weight"), hp->n_ff, E, true, &L->w_gate)) ||
                                     (st = load_mat(ld, NAME("ffn_up.weight"), hp->n_ff, E, true, &L->w_up))))
            return st;
        if ((st = load_mat(ld, NAME("ffn_down.weight"), E, hp->n_ff, true, &L->w_down)))
            return st;
        uint64_t ffn = mat_bytes(&L->w_gate) + mat_bytes(&L->w_up) + mat_bytes(&L->w_down);
        ld->m->weight_bytes += attn + ffn;
        ld->m->active_weight_bytes += attn + ffn;
        return KS_OK;
    }
    int64_t F = hp->n_ff_exp;
    if (gguf_find_tensor(ld->m->file, NAME("ffn_gate_up_exps.weight")))
        return ks_fail(KS_ERR_UNSUPPORTED, "tensor '%s': fused gate/up expert tensors are not supported; convert "
                                           "the model without fusing them", n);
    if ((st = load_mat(ld, NAME("ffn_gate_inp.weight"), hp->n_expert, E, true, &L->w_router)) ||
        (st = load_experts(ld, NAME("ffn_gate_exps.weight"), F, E, &L->gate_exps)) ||
        (st = load_experts(ld, NAME("ffn_up_exps.weight"), F, E, &L->up_exps)) ||
        (st = load_experts(ld, NAME("ffn_down_exps.weight"), E, F, &L->down_exps)))
        return st;
    if (hp->oai.expert_bias &&
        ((st = load_vec(ld, NAME("ffn_gate_inp.bias"), hp->n_expert, true, &L->b_router)) ||
         (st = load_vecs(ld, NAME("ffn_gate_exps.bias"), F, hp->n_expert, true, &L->b_gate_exps)) ||
         (st = load_vecs(ld, NAME("ffn_up_exps.bias"), F, hp->n_expert, true, &L->b_up_exps)) ||
         (st = load_vecs(ld, NAME("ffn_down_exps.bias"), E, hp->n_expert, true, &L->b_down_exps))))
        return st;
#undef NAME
    uint64_t one_expert = L->gate_exps.stride + L->up_exps.stride + L->down_exps.stride;
    ld->m->weight_bytes += attn + mat_bytes(&L->w_router) + one_expert * (uint64_t)hp->n_expert;
    ld->m->active_weight_bytes += attn + mat_bytes(&L->w_router) + one_expert * (uint64_t)hp->n_expert_used;
    return KS_OK;
}

static ks_status read_vocab_size(const struct gguf_file *f, const char *a, int *n_vocab)
{
    enum gguf_value_type et;
    uint64_t count;
    const void *data;
    if (gguf_get_arr(f, "tokenizer.ggml.tokens", &et, &count, &data) == KS_OK) {
        if (count == 0 || count > (1u << 30))
            return ks_fail(KS_ERR_FORMAT, "tokenizer.ggml.tokens has %llu entries", (unsigned long long)count);
        *n_vocab = (int)count;
        return KS_OK;
    }
    const struct gguf_tensor_info *t = gguf_find_tensor(f, "token_embd.weight");
    if (!t)
        return ks_fail(KS_ERR_FORMAT, "tensor 'token_embd.weight' is missing");
    if (t->ne[1] <= 0 || t->ne[1] > (1 << 30))
        return ks_fail(KS_ERR_FORMAT, "token_embd.weight has %lld rows", (long long)t->ne[1]);
    (void)a;
    *n_vocab = (int)t->ne[1];
    return KS_OK;
}

static ks_status load_tensors(struct model *m, const struct arch_info *ai)
{
    const struct model_hparams *hp = &m->hp;
    size_t per_layer = 2 * (size_t)hp->n_embd + 3 * (size_t)hp->n_head * hp->head_dim_k + 2 * (size_t)hp->head_dim_k;
    per_layer += hp->has_post_norms ? 2 * (size_t)hp->n_embd : 0;
    if (hp->oai.attn_out_bias || hp->oai.attn_sinks || hp->oai.expert_bias) /* gpt-oss */
        per_layer += (size_t)hp->n_embd + (size_t)hp->n_head +
                     (size_t)hp->n_expert * (1 + 2 * (size_t)hp->n_ff_exp + (size_t)hp->n_embd);
    size_t n_vec = (size_t)hp->n_layer * per_layer + (size_t)hp->n_embd;
    m->vec_store = malloc(n_vec * sizeof(float));
    m->layers = calloc((size_t)hp->n_layer, sizeof *m->layers);
    if (!m->vec_store || !m->layers)
        return ks_fail(KS_ERR_NOMEM, "out of memory for the model's layer table");
    struct loader ld = {.m = m, .vec_next = m->vec_store, .vec_end = m->vec_store + n_vec};
    ks_status st;
    if ((st = load_mat(&ld, "token_embd.weight", hp->n_vocab, hp->n_embd, true, &m->tok_embd)) ||
        (st = load_vec(&ld, "output_norm.weight", hp->n_embd, true, &m->output_norm)) ||
        (st = load_mat(&ld, "output.weight", hp->n_vocab, hp->n_embd, false, &m->output)))
        return st;
    m->hp.tied_embeddings = m->output.data == NULL;
    if (m->hp.tied_embeddings)
        m->output = m->tok_embd;
    m->weight_bytes = m->active_weight_bytes = mat_bytes(&m->output);
    for (int il = 0; il < hp->n_layer; il++)
        if ((st = load_layer(&ld, il, ai)))
            return st;
    m->hp.has_qkv_bias = m->layers[0].bq != NULL;
    m->hp.has_qk_norm = ai->needs_qk_norm;
    m->hp.has_fused_qkv = ai->fused_qkv_gate_up && gguf_find_tensor(m->file, "blk.0.attn_qkv.weight");
    m->hp.has_fused_gate_up = ai->fused_qkv_gate_up;
    for (int il = 1; il < hp->n_layer; il++)
        if ((m->layers[il].bq != NULL) != m->hp.has_qkv_bias || (m->layers[il].bk != NULL) != m->hp.has_qkv_bias ||
            (m->layers[il].bv != NULL) != m->hp.has_qkv_bias)
            return ks_fail(KS_ERR_FORMAT, "layer %d: attention biases must be present in all layers or none", il);
    if (m->hp.has_qkv_bias && (!m->layers[0].bk || !m->layers[0].bv))
        return ks_fail(KS_ERR_FORMAT, "attn_q.bias is present but attn_k.bias or attn_v.bias is missing");
    return KS_OK;
}

/* ---- BERT-family encoders ---------------------------------------------------- */

/* One encoder layer, as llama.cpp's bert loader names them: Q/K/V (bert:
 * attn_q/k/v with biases; nomic-bert: one attn_qkv, Q's rows then K's then
 * V's), attn_output, attn_output_norm, the FFN (bert: ffn_up, ffn_down with
 * biases, GELU; nomic-bert: ffn_gate too, SwiGLU, no biases) and
 * layer_output_norm. A bias llama.cpp does not require is optional here too. */
static ks_status load_encoder_layer(struct loader *ld, int il)
{
    const struct model_hparams *hp = &ld->m->hp;
    struct model_layer *L = &ld->m->layers[il];
    int64_t E = hp->n_embd, q_out = (int64_t)hp->n_head * hp->head_dim_k;
    int64_t kv_out = (int64_t)hp->n_head_kv * hp->head_dim_k, F = hp->n_ff;
    bool nomic = hp->arch == MODEL_ARCH_NOMIC_BERT;
    char n[96];
    ks_status st;
#define NAME(s) (snprintf(n, sizeof n, "blk.%d." s, il), n)
    bool fused = gguf_find_tensor(ld->m->file, NAME("attn_qkv.weight")) != NULL;
    if (fused) {
        const float *bqkv = NULL;
        if ((st = load_fused_qkv(ld, il, L)) ||
            (st = load_vec(ld, NAME("attn_qkv.bias"), q_out + 2 * kv_out, false, &bqkv)))
            return st;
        if (bqkv)
            L->bq = bqkv, L->bk = bqkv + q_out, L->bv = bqkv + q_out + kv_out;
    } else if ((st = load_mat(ld, NAME("attn_q.weight"), q_out, E, true, &L->wq)) ||
               (st = load_mat(ld, NAME("attn_k.weight"), kv_out, E, true, &L->wk)) ||
               (st = load_mat(ld, NAME("attn_v.weight"), kv_out, E, true, &L->wv)) ||
               (st = load_vec(ld, NAME("attn_q.bias"), q_out, false, &L->bq)) ||
               (st = load_vec(ld, NAME("attn_k.bias"), kv_out, false, &L->bk)) ||
               (st = load_vec(ld, NAME("attn_v.bias"), kv_out, false, &L->bv))) {
        return st;
    }
    if ((st = load_mat(ld, NAME("attn_output.weight"), E, q_out, true, &L->wo)) ||
        (st = load_vec(ld, NAME("attn_output.bias"), E, false, &L->bo)) ||
        (st = load_vec(ld, NAME("attn_output_norm.weight"), E, true, &L->attn_out_norm)) ||
        (st = load_vec(ld, NAME("attn_output_norm.bias"), E, true, &L->attn_out_norm_b)) ||
        (st = load_mat(ld, NAME("ffn_up.weight"), F, E, true, &L->w_up)) ||
        (st = load_vec(ld, NAME("ffn_up.bias"), F, false, &L->b_up)) ||
        (st = load_mat(ld, NAME("ffn_gate.weight"), F, E, nomic, &L->w_gate)) ||
        (st = load_mat(ld, NAME("ffn_down.weight"), E, F, true, &L->w_down)) ||
        (st = load_vec(ld, NAME("ffn_down.bias"), E, false, &L->b_down)) ||
        (st = load_vec(ld, NAME("layer_output_norm.weight"), E, true, &L->layer_out_norm)) ||
        (st = load_vec(ld, NAME("layer_output_norm.bias"), E, true, &L->layer_out_norm_b)))
        return st;
    if (!nomic && L->w_gate.data)
        return ks_fail(KS_ERR_UNSUPPORTED, "tensor '%s': a gated FFN in a bert file is not supported", n);
    if ((L->bq != NULL) != (L->bk != NULL) || (L->bq != NULL) != (L->bv != NULL))
        return ks_fail(KS_ERR_FORMAT, "layer %d: attn_q/k/v biases must be all present or all absent", il);
    if (gguf_find_tensor(ld->m->file, NAME("ffn_up_exps.weight")) || gguf_find_tensor(ld->m->file, NAME("attn_norm_2.weight")))
        return ks_fail(KS_ERR_UNSUPPORTED, "tensor '%s': experts and second attention norms (nomic-bert-moe, jina) are not "
                       "supported", n);
#undef NAME
    uint64_t bytes = mat_bytes(&L->wq) + mat_bytes(&L->wk) + mat_bytes(&L->wv) + mat_bytes(&L->wo) +
                     mat_bytes(&L->w_up) + mat_bytes(&L->w_down) + (L->w_gate.data ? mat_bytes(&L->w_gate) : 0);
    ld->m->weight_bytes += bytes;
    ld->m->active_weight_bytes += bytes;
    return KS_OK;
}

/* bert / nomic-bert: token embeddings, token_types (row 0 added to every
 * token), bert's learned positions, the embeddings' LayerNorm, the layers. No
 * output_norm and no output matrix: the final hidden states are the
 * embeddings. A classifier head (cls, cls_out: rerankers) is not loaded. */
static ks_status load_encoder_tensors(struct model *m)
{
    const struct model_hparams *hp = &m->hp;
    size_t E = (size_t)hp->n_embd;
    size_t per_layer = 3 * (size_t)hp->n_head * hp->head_dim_k + 6 * E + (size_t)hp->n_ff;
    size_t n_vec = (size_t)hp->n_layer * per_layer + 2 * E;
    m->vec_store = malloc(n_vec * sizeof(float));
    m->layers = calloc((size_t)hp->n_layer, sizeof *m->layers);
    if (!m->vec_store || !m->layers)
        return ks_fail(KS_ERR_NOMEM, "out of memory for the model's layer table");
    struct loader ld = {.m = m, .vec_next = m->vec_store, .vec_end = m->vec_store + n_vec};
    const struct gguf_tensor_info *types = gguf_find_tensor(m->file, "token_types.weight");
    int64_t n_types = types ? types->ne[1] : 0;
    if (types && (n_types < 1 || n_types > 1024))
        return ks_fail(KS_ERR_FORMAT, "tensor 'token_types.weight' has %lld rows, expected 1..1024", (long long)n_types);
    ks_status st;
    if ((st = load_mat(&ld, "token_embd.weight", hp->n_vocab, hp->n_embd, true, &m->tok_embd)) ||
        (st = load_mat(&ld, "token_types.weight", n_types, hp->n_embd, false, &m->type_embd)) ||
        (st = load_mat(&ld, "position_embd.weight", hp->n_ctx_train, hp->n_embd, hp->arch == MODEL_ARCH_BERT,
                       &m->pos_embd)) ||
        (st = load_vec(&ld, "token_embd_norm.weight", hp->n_embd, true, &m->tok_norm)) ||
        (st = load_vec(&ld, "token_embd_norm.bias", hp->n_embd, true, &m->tok_norm_b)))
        return st;
    if (m->pos_embd.data && hp->arch != MODEL_ARCH_BERT)
        return ks_fail(KS_ERR_FORMAT, "tensor 'position_embd.weight' in a %s file: it rotates its positions",
                       hp->arch_name);
    if (gguf_find_tensor(m->file, "cls.weight") || gguf_find_tensor(m->file, "cls.output.weight"))
        return ks_fail(KS_ERR_UNSUPPORTED, "tensor 'cls.weight' / 'cls.output.weight': classifier heads (rerankers, "
                       "pooling rank) are not supported");
    for (int il = 0; il < hp->n_layer; il++)
        if ((st = load_encoder_layer(&ld, il)))
            return st;
    m->hp.has_qkv_bias = m->layers[0].bq != NULL;
    m->hp.has_fused_qkv = gguf_find_tensor(m->file, "blk.0.attn_qkv.weight") != NULL;
    return KS_OK;
}

/* ---- repacking ------------------------------------------------------------ */

/* A Q4_0 / Q8_0 / IQ4_NL / MXFP4 / Q5_0 / Q5_1 / Q2_K..Q6_K matrix (as quant_repack_fits says for this build) of
 * the private copy goes into quant_repack's layout in
 * place; a mapped file (--mmap, or a copy that was refused) stays row-major,
 * since its pages are the page cache's. */
static ks_status repack_mat(struct model *m, struct model_mat *w)
{
    if (!w->data || !quant_repack_fits(w->type, w->rows, w->cols))
        return KS_OK;
    void *p = gguf_private_bytes(m->file, w->data, quant_row_size(w->type, w->cols) * (size_t)w->rows);
    if (!p)
        return KS_OK;
    ks_status st = quant_repack(w->type, w->rows, w->cols, p);
    w->repacked = st == KS_OK;
    return st;
}

/* Each expert's slice of a 3-D expert tensor is a matrix of its own, repacked
 * on its own, so an expert's rows stay one contiguous stream. */
static ks_status repack_experts(struct model *m, struct model_experts *x)
{
    int n_expert = m->hp.n_expert;
    if (!x->data || !quant_repack_fits(x->type, x->rows, x->cols))
        return KS_OK;
    uint8_t *p = gguf_private_bytes(m->file, x->data, x->stride * (size_t)n_expert);
    if (!p)
        return KS_OK;
    for (int e = 0; e < n_expert; e++) {
        ks_status st = quant_repack(x->type, x->rows, x->cols, p + (size_t)e * x->stride);
        if (st) {
            ks_errmsg_prefix("expert %d of %d", e, n_expert);
            return st;
        }
    }
    x->repacked = true;
    return KS_OK;
}

/* Every matrix the forward pass multiplies. Untied token embeddings are only
 * looked up a row at a time and stay row-major; tied ones are the output
 * matrix, read whole every token, so they are repacked and looked up in the
 * layout (quant_get_row_repacked). */
static ks_status repack_weights(struct model *m)
{
    ks_status st;
    if (m->hp.tied_embeddings) {
        st = repack_mat(m, &m->tok_embd);
        m->output = m->tok_embd;
    } else
        st = repack_mat(m, &m->output);
    for (int il = 0; il < m->hp.n_layer && !st; il++) {
        struct model_layer *L = &m->layers[il];
        struct model_mat *mats[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down, &L->w_router};
        for (size_t i = 0; i < sizeof mats / sizeof mats[0] && !st; i++)
            st = repack_mat(m, mats[i]);
        struct model_experts *exps[] = {&L->gate_exps, &L->up_exps, &L->down_exps};
        for (size_t i = 0; i < sizeof exps / sizeof exps[0] && !st; i++)
            st = repack_experts(m, exps[i]);
    }
    return st;
}

/* ---- public ------------------------------------------------------------- */

static ks_status load_file(struct model *m)
{
    struct gguf_str s;
    ks_status st = gguf_get_str(m->file, "general.architecture", &s);
    if (st)
        return st == KS_ERR_NOT_FOUND ? ks_fail(KS_ERR_FORMAT, "metadata general.architecture is missing") : st;
    const struct arch_info *ai = arch_find(&s);
    if (!ai)
        return ks_fail(KS_ERR_UNSUPPORTED,
                       "architecture '%.*s' is not supported (kvserve runs llama, qwen2, qwen3, qwen3moe, phi3, "
                       "gemma2, gemma3, gpt-oss, and the embedding encoders bert, nomic-bert)",
                       (int)(s.len > 64 ? 64 : s.len), s.data);
    m->hp.arch = ai->arch;
    m->hp.arch_name = ai->name;
    m->hp.rope_type = ai->rope_type;
    m->hp.encoder_only = ai->encoder;
    if ((st = read_shape(m->file, ai->name, &m->hp)) ||
        (st = read_experts(m->file, ai->name, ai->needs_experts, &m->hp)) || (st = read_rope(m, ai->name)) ||
        (ai->arch == MODEL_ARCH_PHI3 && (st = read_stored_window(m->file, ai->name, &m->hp))) ||
        (ai->arch == MODEL_ARCH_GPT_OSS && (st = read_gpt_oss(m->file, ai->name, &m->hp))) ||
        (st = read_vocab_size(m->file, ai->name, &m->hp.n_vocab)) ||
        (st = model_read_embed_meta(m->file, ai->name, &m->hp)) ||
        (gemma_version(ai->arch) && (st = read_gemma(m, ai->name, gemma_version(ai->arch)))))
        return st;
    return ai->encoder ? load_encoder_tensors(m) : load_tensors(m, ai);
}

ks_status model_load(const char *path, struct model **out) { return model_load_flags(path, 0, out); }

ks_status model_load_flags(const char *path, unsigned flags, struct model **out)
{
    *out = NULL;
    struct model *m = calloc(1, sizeof *m);
    if (m && !(m->path = strdup(path)))
        free(m), m = NULL;
    if (!m)
        return ks_fail(KS_ERR_NOMEM, "out of memory loading %s", path);
    ks_status st = flags & MODEL_LOAD_MMAP ? gguf_open(path, &m->file) : gguf_open_private(path, &m->file);
    if (!st && ((st = load_file(m)) || (!(flags & MODEL_LOAD_NO_REPACK) && (st = repack_weights(m)))))
        ks_errmsg_prefix("%s", path); /* gguf_open's messages already name the file */
    if (st) {
        ks_errmsg_prefix("loading model");
        model_free(m);
        return st;
    }
    *out = m;
    return KS_OK;
}

void model_free(struct model *m)
{
    if (!m)
        return;
    gguf_close(m->file);
    free(m->path);
    free(m->layers);
    free(m->vec_store);
    free(m->rope_freq_factors);
    free(m->rope_factors_short); /* one block with rope_factors_long */
    free(m);
}

const struct model_hparams *model_hparams(const struct model *m) { return &m->hp; }
const struct gguf_file *model_gguf(const struct model *m) { return m->file; }
const char *model_file_path(const struct model *m) { return m->path; }
uint64_t model_weight_bytes(const struct model *m) { return m->weight_bytes; }
uint64_t model_active_weight_bytes(const struct model *m) { return m->active_weight_bytes; }

void model_kv_config(const struct model *m, struct kv_config *cfg)
{
    kv_config_default(cfg);
    cfg->n_layer = m->hp.n_layer;
    cfg->n_kv_head = m->hp.n_head_kv;
    cfg->head_dim = m->hp.head_dim_k;
    /* sliding-window models (gemma2/3, gpt-oss): the cache frees the rows of
     * their window layers past the window (kv.h), which model_forward attends
     * with the same window */
    if (m->hp.n_swa > 0 && m->hp.n_layer <= KV_MAX_LAYERS) {
        cfg->swa_window = m->hp.n_swa;
        for (int l = 0; l < m->hp.n_layer; l++)
            cfg->swa_layer[l] = model_layer_is_swa(&m->hp, l);
    }
    model_fingerprint(m, cfg->fingerprint);
}

void model_set_n_ctx(struct model *m, int32_t n_ctx_seq)
{
    if (m->hp.rope_scaling != MODEL_ROPE_SCALING_LONGROPE)
        return;
    m->rope_long = n_ctx_seq > m->hp.rope_n_ctx_orig;
    memcpy(m->rope_freq_factors, m->rope_long ? m->rope_factors_long : m->rope_factors_short,
           sizeof(float) * (size_t)(m->hp.n_rot / 2));
}

bool model_rope_long(const struct model *m) { return m->rope_long; }

void model_file_fingerprint(const struct gguf_file *f, bool rope_long, uint8_t out[16])
{
    size_t len = 0;
    const void *header = gguf_header_bytes(f, &len);
    XXH128_hash_t h = XXH3_128bits(header, len);
    if (rope_long) /* K rotated with the long factors is another cache's */
        h = XXH3_128bits_withSeed(header, len, 1);
    memcpy(out, &h.low64, 8);
    memcpy(out + 8, &h.high64, 8);
}

void model_fingerprint(const struct model *m, uint8_t out[16]) { model_file_fingerprint(m->file, m->rope_long, out); }
