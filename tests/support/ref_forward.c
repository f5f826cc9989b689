/* Naive f32 reference forward pass. Written for obviousness, not speed. */
#include "support/ref_forward.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- structs -------------------------------------------------------------- */

struct ref_mat {
    float *w;                 /* (rows, cols) */
    int rows, cols;
    enum quant_type type;     /* the file's type, for activation rounding */
};

struct ref_layer {
    float *attn_norm;         /* (dim) */
    struct ref_mat wq;        /* (n_head * hd, dim) */
    struct ref_mat wk;        /* (n_kv * hd, dim) */
    struct ref_mat wv;        /* (n_kv * hd, dim) */
    struct ref_mat wo;        /* (dim, n_head * hd) */
    float *bq, *bk, *bv;      /* qwen2 biases or NULL */
    float *q_norm, *k_norm;   /* qwen3 (hd) or NULL */
    float *ffn_norm;          /* (dim) */
    struct ref_mat w1;        /* gate (ff, dim) */
    struct ref_mat w3;        /* up (ff, dim) */
    struct ref_mat w2;        /* down (dim, ff) */
    /* mixture of experts instead of w1 / w3 / w2 */
    struct ref_mat router;    /* (n_expert, dim) */
    struct ref_mat *e1;       /* (n_expert) gate (ff_exp, dim), views of one buffer */
    struct ref_mat *e3;       /* (n_expert) up (ff_exp, dim) */
    struct ref_mat *e2;       /* (n_expert) down (dim, ff_exp) */
};

struct ref_model {
    struct gguf_file *file;   /* the model's file, mapped again */
    struct model_hparams hp;
    bool quantize_acts;
    bool llamacpp;            /* REF_LLAMACPP_FA: ggml-cpu arithmetic throughout */
    float *rope_ff;           /* (n_rot / 2) rope_freqs.weight (phi3: rope_factors_long/short), or NULL */
    bool one_token_batch;     /* llama.cpp ran this token alone: no tinyBLAS */
    float *tok_embd;          /* (vocab, dim) */
    struct ref_mat output;    /* (vocab, dim) */
    float *output_norm;       /* (dim) */
    struct ref_layer *layers; /* (n_layer) */
    float *inv_freq;          /* (n_rot / 2) angle per position of each rotated pair */
    int max_seqs, max_ctx;
    float *key_cache;         /* (seq, layer, ctx, n_kv * hd) */
    float *value_cache;       /* (seq, layer, ctx, n_kv * hd) */
    int *seq_len;             /* (seq) */
    /* run state */
    float *x, *xb, *xb2, *q, *k, *v, *att, *hb, *hb2, *scores, *tmp;
    float *probs, *moe_out;   /* (n_expert), (dim) */
};

/* ---- loading -------------------------------------------------------------- */

static float *dequant(const struct gguf_file *f, const char *name, int64_t n_expect, enum quant_type *type)
{
    const struct gguf_tensor_info *t = gguf_find_tensor(f, name);
    if (!t)
        return NULL;
    int64_t n = t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
    if (n != n_expect)
        return NULL;
    float *out = malloc(sizeof(float) * (size_t)n);
    const struct quant_traits *tr = quant_traits_scalar(t->type);
    size_t row_bytes = quant_row_size(t->type, t->ne[0]);
    for (int64_t r = 0; r < n / t->ne[0]; r++)
        tr->to_float((const char *)t->data + r * row_bytes, out + r * t->ne[0], t->ne[0]);
    if (type)
        *type = t->type;
    return out;
}

static ks_status load_mat(const struct gguf_file *f, const char *name, int rows, int cols, struct ref_mat *m)
{
    m->rows = rows, m->cols = cols;
    m->w = dequant(f, name, (int64_t)rows * cols, &m->type);
    return m->w ? KS_OK : ks_fail(KS_ERR_FORMAT, "ref: tensor %s missing or wrong size", name);
}

/* A 3-D expert tensor [cols, rows, n]: n matrices viewing one dequantized buffer. */
static ks_status load_experts(const struct gguf_file *f, const char *name, int n, int rows, int cols,
                              struct ref_mat **out)
{
    struct ref_mat all;
    ks_status st = load_mat(f, name, n * rows, cols, &all);
    if (st)
        return st;
    *out = calloc((size_t)n, sizeof **out);
    for (int e = 0; e < n; e++)
        (*out)[e] = (struct ref_mat){all.w + (size_t)e * rows * cols, rows, cols, all.type};
    return KS_OK;
}

static ks_status load_vec(const struct gguf_file *f, const char *name, int n, bool required, float **out)
{
    *out = dequant(f, name, n, NULL);
    return *out || !required ? KS_OK : ks_fail(KS_ERR_FORMAT, "ref: tensor %s missing", name);
}

/* The per-dimension frequency factors a model divides by: rope_freqs.weight,
 * or for LongRoPE (phi3) the set the model uses, long or short. */
static const struct gguf_tensor_info *factors_tensor(const struct model *m, const struct gguf_file *f)
{
    if (model_hparams(m)->rope_scaling == MODEL_ROPE_SCALING_LONGROPE)
        return gguf_find_tensor(f, model_rope_long(m) ? "rope_factors_long.weight" : "rope_factors_short.weight");
    return gguf_find_tensor(f, "rope_freqs.weight");
}

/* inv_freq[i] = base^(-2i/n_rot), with linear or llama3 scaling, or divided by ff's factors. */
static void rope_freqs(struct ref_model *r, const struct gguf_tensor_info *ff)
{
    const struct model_hparams *hp = &r->hp;
    for (int i = 0; i < hp->n_rot / 2; i++) {
        double freq = pow(hp->rope_freq_base, -2.0 * i / hp->n_rot);
        if (ff) {
            freq /= ((const float *)ff->data)[i];
        } else if (hp->rope_scaling == MODEL_ROPE_SCALING_LINEAR) {
            freq /= hp->rope_scale_factor;
        } else if (hp->rope_scaling == MODEL_ROPE_SCALING_LLAMA3) {
            double wavelen = 2 * M_PI / freq;
            double lo = hp->rope_llama3_orig_ctx / hp->rope_llama3_low_freq_factor;
            double hi = hp->rope_llama3_orig_ctx / hp->rope_llama3_high_freq_factor;
            if (wavelen > lo) {
                freq /= hp->rope_scale_factor;
            } else if (wavelen >= hi) {
                double smooth = (hp->rope_llama3_orig_ctx / wavelen - hp->rope_llama3_low_freq_factor) /
                                (hp->rope_llama3_high_freq_factor - hp->rope_llama3_low_freq_factor);
                freq = (1 - smooth) * freq / hp->rope_scale_factor + smooth * freq;
            }
        }
        r->inv_freq[i] = (float)freq;
    }
}

/* phi3: a fused matrix (sum of rows[i], cols) split into n matrices of rows[i] rows each (copies). */
static ks_status load_split(const struct gguf_file *f, const char *name, int cols, const int *rows,
                            struct ref_mat *const *outs, int n)
{
    int total = 0;
    for (int i = 0; i < n; i++)
        total += rows[i];
    struct ref_mat all;
    ks_status st = load_mat(f, name, total, cols, &all);
    for (int i = 0, first = 0; !st && i < n; first += rows[i], i++) {
        size_t bytes = sizeof(float) * (size_t)rows[i] * (size_t)cols;
        *outs[i] = (struct ref_mat){malloc(bytes), rows[i], cols, all.type};
        memcpy(outs[i]->w, all.w + (size_t)first * cols, bytes);
    }
    free(all.w);
    return st;
}

static ks_status load_layer(struct ref_model *r, const struct gguf_file *f, int l)
{
    const struct model_hparams *hp = &r->hp;
    struct ref_layer *L = &r->layers[l];
    int dim = hp->n_embd, hd = hp->head_dim_k, qd = hp->n_head * hd, kvd = hp->n_head_kv * hd;
    char n[13][96];
    const char *names[13] = {"attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                             "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
                             "ffn_down.weight", "attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_q_norm.weight"};
    for (int i = 0; i < 13; i++)
        snprintf(n[i], sizeof n[i], "blk.%d.%s", l, names[i]);
    char kn[96];
    snprintf(kn, sizeof kn, "blk.%d.attn_k_norm.weight", l);
    ks_status st;
    if (hp->n_expert > 0) {
        char rn[96], gn[96], un[96], dn[96];
        snprintf(rn, sizeof rn, "blk.%d.ffn_gate_inp.weight", l);
        snprintf(gn, sizeof gn, "blk.%d.ffn_gate_exps.weight", l);
        snprintf(un, sizeof un, "blk.%d.ffn_up_exps.weight", l);
        snprintf(dn, sizeof dn, "blk.%d.ffn_down_exps.weight", l);
        int X = hp->n_expert, F = hp->n_ff_exp;
        if ((st = load_mat(f, rn, X, dim, &L->router)) || (st = load_experts(f, gn, X, F, dim, &L->e1)) ||
            (st = load_experts(f, un, X, F, dim, &L->e3)) || (st = load_experts(f, dn, X, dim, F, &L->e2)))
            return st;
    } else if (hp->has_fused_gate_up) { /* phi3: ffn_up is the gate's rows, then up's */
        if ((st = load_split(f, n[7], dim, (int[]){hp->n_ff, hp->n_ff}, (struct ref_mat *[]){&L->w1, &L->w3}, 2)) ||
            (st = load_mat(f, n[8], dim, hp->n_ff, &L->w2)))
            return st;
    } else if ((st = load_mat(f, n[6], hp->n_ff, dim, &L->w1)) || (st = load_mat(f, n[7], hp->n_ff, dim, &L->w3)) ||
               (st = load_mat(f, n[8], dim, hp->n_ff, &L->w2))) {
        return st;
    }
    char qkv[96];
    snprintf(qkv, sizeof qkv, "blk.%d.attn_qkv.weight", l);
    if (hp->has_fused_qkv && (st = load_split(f, qkv, dim, (int[]){qd, kvd, kvd},
                                              (struct ref_mat *[]){&L->wq, &L->wk, &L->wv}, 3)))
        return st;
    if ((st = load_vec(f, n[0], dim, true, &L->attn_norm)) ||
        (!hp->has_fused_qkv && ((st = load_mat(f, n[1], qd, dim, &L->wq)) ||
                                (st = load_mat(f, n[2], kvd, dim, &L->wk)) ||
                                (st = load_mat(f, n[3], kvd, dim, &L->wv)))) ||
        (st = load_mat(f, n[4], dim, qd, &L->wo)) || (st = load_vec(f, n[5], dim, true, &L->ffn_norm)) ||
        (st = load_vec(f, n[9], qd, false, &L->bq)) ||
        (st = load_vec(f, n[10], kvd, false, &L->bk)) || (st = load_vec(f, n[11], kvd, false, &L->bv)))
        return st;
    if (hp->has_qk_norm &&
        ((st = load_vec(f, n[12], hd, true, &L->q_norm)) || (st = load_vec(f, kn, hd, true, &L->k_norm))))
        return st;
    return KS_OK;
}

ks_status ref_model_create(const struct model *m, int max_seqs, int max_ctx, unsigned flags,
                           struct ref_model **out)
{
    struct ref_model *r = calloc(1, sizeof *r);
    if (!r)
        return ks_fail(KS_ERR_NOMEM, "ref: out of memory");
    /* the file's own bytes: the loader may have repacked its copy */
    ks_status open_st = gguf_open(model_file_path(m), &r->file);
    if (open_st) {
        free(r);
        return open_st;
    }
    const struct gguf_file *f = r->file;
    r->hp = *model_hparams(m);
    r->quantize_acts = flags & REF_QUANTIZE_ACTS;
    r->llamacpp = flags & REF_LLAMACPP_FA;
    const struct model_hparams *hp = &r->hp;
    int dim = hp->n_embd, hd = hp->head_dim_k, qd = hp->n_head * hd, kvd = hp->n_head_kv * hd;
    ks_status st = KS_OK;
    r->tok_embd = dequant(f, "token_embd.weight", (int64_t)hp->n_vocab * dim, NULL);
    if (!r->tok_embd)
        st = ks_fail(KS_ERR_FORMAT, "ref: token_embd.weight");
    if (!st && gguf_find_tensor(f, "output.weight"))
        st = load_mat(f, "output.weight", hp->n_vocab, dim, &r->output);
    else if (!st)
        st = load_mat(f, "token_embd.weight", hp->n_vocab, dim, &r->output);
    if (!st)
        st = load_vec(f, "output_norm.weight", dim, true, &r->output_norm);
    r->layers = calloc((size_t)hp->n_layer, sizeof *r->layers);
    if (!st && hp->n_expert_used > 64)
        st = ks_fail(KS_ERR_UNSUPPORTED, "ref: more than 64 experts per token");
    for (int l = 0; l < hp->n_layer && !st; l++)
        st = load_layer(r, f, l);
    r->inv_freq = calloc((size_t)hp->n_rot / 2 + 1, sizeof(float));
    const struct gguf_tensor_info *ff = factors_tensor(m, f);
    rope_freqs(r, ff);
    if (ff && ff->type == QUANT_F32 && ff->ne[0] == hp->n_rot / 2)
        r->rope_ff = (float *)ff->data;
    r->max_seqs = max_seqs, r->max_ctx = max_ctx;
    size_t cache = (size_t)max_seqs * hp->n_layer * max_ctx * kvd;
    r->key_cache = calloc(cache, sizeof(float));
    r->value_cache = calloc(cache, sizeof(float));
    r->seq_len = calloc((size_t)max_seqs, sizeof(int));
    int n_ff = hp->n_ff > hp->n_ff_exp ? hp->n_ff : hp->n_ff_exp;
    int wide = dim > qd ? dim : qd;
    wide = wide > n_ff ? wide : n_ff;
    r->x = calloc((size_t)dim, sizeof(float));
    r->xb = calloc((size_t)wide, sizeof(float));
    r->xb2 = calloc((size_t)dim, sizeof(float));
    r->q = calloc((size_t)qd, sizeof(float));
    r->k = calloc((size_t)kvd, sizeof(float));
    r->v = calloc((size_t)kvd, sizeof(float));
    r->att = calloc((size_t)qd, sizeof(float));
    r->hb = calloc((size_t)n_ff, sizeof(float));
    r->hb2 = calloc((size_t)n_ff, sizeof(float));
    r->probs = calloc((size_t)hp->n_expert + 1, sizeof(float));
    r->moe_out = calloc((size_t)dim, sizeof(float));
    r->scores = calloc((size_t)max_ctx, sizeof(float));
    r->tmp = calloc((size_t)wide, sizeof(float));
    if (st) {
        ref_model_free(r);
        return st;
    }
    *out = r;
    return KS_OK;
}

static void free_mat(struct ref_mat *m) { free(m->w); }

void ref_model_free(struct ref_model *r)
{
    if (!r)
        return;
    for (int l = 0; r->layers && l < r->hp.n_layer; l++) {
        struct ref_layer *L = &r->layers[l];
        free(L->attn_norm), free(L->ffn_norm), free(L->bq), free(L->bk), free(L->bv), free(L->q_norm), free(L->k_norm);
        free_mat(&L->wq), free_mat(&L->wk), free_mat(&L->wv), free_mat(&L->wo);
        free_mat(&L->w1), free_mat(&L->w2), free_mat(&L->w3), free_mat(&L->router);
        if (L->e1)
            free(L->e1[0].w), free(L->e2[0].w), free(L->e3[0].w);
        free(L->e1), free(L->e2), free(L->e3);
    }
    free(r->layers), free(r->tok_embd), free_mat(&r->output), free(r->output_norm), free(r->inv_freq);
    free(r->key_cache), free(r->value_cache), free(r->seq_len);
    free(r->x), free(r->xb), free(r->xb2), free(r->q), free(r->k), free(r->v), free(r->att);
    free(r->hb), free(r->hb2), free(r->scores), free(r->tmp), free(r->probs), free(r->moe_out);
    gguf_close(r->file);
    free(r);
}

void ref_seq_clear(struct ref_model *r, int seq) { r->seq_len[seq] = 0; }

void ref_set_batch_size(struct ref_model *r, int n_tokens) { r->one_token_batch = n_tokens < 2; }

/* ---- blocks --------------------------------------------------------------- */

static void rmsnorm_ggml(float *o, const float *x, const float *w, int n, float eps);

static void rmsnorm_plain(float *o, const float *x, const float *w, int n, float eps)
{
    double ss = 0;
    for (int i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    float s = (float)(1.0 / sqrt(ss / n + eps));
    for (int i = 0; i < n; i++)
        o[i] = w[i] * (s * x[i]);
}

/* The engine multiplies quantized weights with activations rounded to the
 * weight type's vec_dot_type; do the same rounding, with the scalar code. */
static void round_activations(const struct ref_model *r, enum quant_type wtype, const float *x, float *out, int n)
{
    memcpy(out, x, sizeof(float) * (size_t)n);
    if (!r->quantize_acts)
        return;
    enum quant_type at = quant_traits_scalar(wtype)->vec_dot_type;
    const struct quant_traits *tr = quant_traits_scalar(at);
    if (at == QUANT_F32 || !tr || !tr->from_float || !tr->to_float)
        return;
    void *buf = malloc(quant_row_size(at, n));
    tr->from_float(x, buf, n);
    tr->to_float(buf, out, n);
    free(buf);
}

static float dot_ggml(const float *w, const float *x, int n, bool one_token_batch);

/* o = W x, W (rows, cols) */
static void matmul(const struct ref_model *r, float *o, const float *x, const struct ref_mat *W, float *tmp)
{
    round_activations(r, W->type, x, tmp, W->cols);
    for (int i = 0; i < W->rows && r->llamacpp; i++)
        o[i] = dot_ggml(W->w + (size_t)i * W->cols, tmp, W->cols, r->one_token_batch);
    for (int i = 0; i < W->rows && !r->llamacpp; i++) {
        double acc = 0;
        for (int j = 0; j < W->cols; j++)
            acc += (double)W->w[(size_t)i * W->cols + j] * tmp[j];
        o[i] = (float)acc;
    }
}

static void rope(float *head, const struct ref_model *r, int pos)
{
    const struct model_hparams *hp = &r->hp;
    int half = hp->n_rot / 2;
    for (int i = 0; i < half; i++) {
        float theta = (float)pos * r->inv_freq[i];
        float c = cosf(theta) * hp->rope_attn_factor, s = sinf(theta) * hp->rope_attn_factor;
        int a = hp->rope_type == MODEL_ROPE_NEOX ? i : 2 * i;
        int b = hp->rope_type == MODEL_ROPE_NEOX ? i + half : 2 * i + 1;
        float x0 = head[a], x1 = head[b];
        head[a] = x0 * c - x1 * s;
        head[b] = x0 * s + x1 * c;
    }
}

static void softmax(float *x, int n)
{
    float mx = x[0];
    for (int i = 1; i < n; i++)
        mx = x[i] > mx ? x[i] : mx;
    double sum = 0;
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] - mx);
        sum += x[i];
    }
    for (int i = 0; i < n; i++)
        x[i] = (float)(x[i] / sum);
}

/* out = softmax(q . K^T / sqrt(hd)) V over positions 0..pos; K and V rows
 * are stride floats apart. */
static void attention(float *out, const float *q, const float *k, const float *v, int stride, int pos, int hd,
                      float *scores)
{
    for (int t = 0; t <= pos; t++) {
        double s = 0;
        for (int i = 0; i < hd; i++)
            s += (double)q[i] * k[(size_t)t * stride + i];
        scores[t] = (float)(s / sqrt((double)hd));
    }
    softmax(scores, pos + 1);
    for (int i = 0; i < hd; i++) {
        double acc = 0;
        for (int t = 0; t <= pos; t++)
            acc += (double)scores[t] * v[(size_t)t * stride + i];
        out[i] = (float)acc;
    }
}

/* ---- llama.cpp's CPU arithmetic (REF_LLAMACPP_FA) --------------------------
 * What ggml-cpu computes, op by op, for an F32 model and an F32 cache in a
 * native AVX-512 build, prompt processed as one batch (llama.cpp 34af94cd made
 * ../shared/ref that way). Each rounding step is spelled out: fmaf() where ggml
 * fuses (its intrinsics, or the compiler contracting a*b+c), rounded() where it
 * does not, so that this file's own compiler flags cannot change the result. */

/* a*b rounded to float: never contracted into a neighbouring add */
static float rounded(float x)
{
    volatile float v = x;
    return v;
}

/* _mm512_reduce_add_ps: halves of 16, 8, 4, then 2 lanes */
static float reduce16(const float *lane)
{
    float h[8], q[4];
    for (int i = 0; i < 8; i++)
        h[i] = lane[i] + lane[8 + i];
    for (int i = 0; i < 4; i++)
        q[i] = h[i] + h[4 + i];
    return (q[0] + q[2]) + (q[1] + q[3]);
}

/* Four 16-lane accumulators over steps of 64, folded 0+2, 1+3, 0+1, reduced:
 * ggml_vec_dot_f32 and ggml_vec_dot_f16 on AVX-512. Returns the part over
 * the first *np elements. */
static float dot_4x16(const float *a, const float *b, int n, int *np)
{
    float acc[4][16] = {{0}};
    *np = n & ~63;
    for (int j = 0; j < *np; j += 64)
        for (int v = 0; v < 4; v++)
            for (int l = 0; l < 16; l++)
                acc[v][l] = fmaf(a[j + 16 * v + l], b[j + 16 * v + l], acc[v][l]);
    for (int l = 0; l < 16; l++) {
        acc[0][l] += acc[2][l];
        acc[1][l] += acc[3][l];
    }
    for (int l = 0; l < 16; l++)
        acc[0][l] += acc[1][l];
    return reduce16(acc[0]);
}

/* One output of an F32 mul_mat. In a batch of 2+ tokens, rows a multiple of
 * 16 long go to llamafile's tinyBLAS (one 16-lane FMA chain, then a reduce);
 * the rest, and every one-token batch, to ggml_vec_dot_f32 (4 x 16 lanes,
 * then a float tail). */
static float dot_ggml(const float *w, const float *x, int n, bool one_token_batch)
{
    if (n % 16 == 0 && !one_token_batch) {
        float acc[16] = {0};
        for (int j = 0; j < n; j += 16)
            for (int l = 0; l < 16; l++)
                acc[l] = fmaf(w[j + l], x[j + l], acc[l]);
        return reduce16(acc);
    }
    int np;
    float s = dot_4x16(w, x, n, &np);
    for (int j = np; j < n; j++)
        s = fmaf(w[j], x[j], s);
    return s;
}

/* ggml_compute_forward_rms_norm, then the weight: squares rounded to float
 * and summed in double, the mean rounded to float, scale = 1/sqrtf(mean+eps). */
static void rmsnorm_ggml(float *o, const float *x, const float *w, int n, float eps)
{
    double sum = 0;
    for (int i = 0; i < n; i++)
        sum += (double)rounded(x[i] * x[i]);
    float mean = (float)(sum / n);
    float scale = 1.0f / sqrtf(mean + eps);
    for (int i = 0; i < n; i++)
        o[i] = rounded(x[i] * scale) * w[i];
}

/* ggml_rope: angles by repeated multiplication with powf(base, -2/n_rot);
 * the rotation's first product of each line fused with the other's. */
static void rope_ggml(float *head, const struct ref_model *r, int pos)
{
    const struct model_hparams *hp = &r->hp;
    int half = hp->n_rot / 2;
    float theta_scale = powf(hp->rope_freq_base, -2.0f / (float)hp->n_rot);
    float freq_scale = hp->rope_scaling == MODEL_ROPE_SCALING_LINEAR ? 1.0f / hp->rope_scale_factor : 1.0f;
    float theta = (float)pos;
    for (int i = 0; i < half; i++) {
        float t = freq_scale * (theta / (r->rope_ff ? r->rope_ff[i] : 1.0f));
        float c = cosf(t) * hp->rope_attn_factor, s = sinf(t) * hp->rope_attn_factor;
        theta *= theta_scale;
        int a = hp->rope_type == MODEL_ROPE_NEOX ? i : 2 * i;
        int b = hp->rope_type == MODEL_ROPE_NEOX ? i + half : 2 * i + 1;
        float x0 = head[a], x1 = head[b];
        head[a] = fmaf(x0, c, -rounded(x1 * s));
        head[b] = fmaf(x0, s, rounded(x1 * c));
    }
}

/* ggml_v_expf on AVX-512 (a polynomial after ARM's optimized routines), one
 * lane; only ever called on |x| < 88 here. */
static float v_expf(float x)
{
    const float shift = 0x1.8p23f;
    float z = fmaf(x, 0x1.715476p+0f, shift);
    float n = z - shift;
    float b = fmaf(-n, 0x1.7f7d1cp-20f, fmaf(-n, 0x1.62e4p-1f, x));
    if (fabsf(n) > 126)
        return expf(x);
    float u = b * b;
    float j = fmaf(fmaf(fmaf(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u, fmaf(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)), u,
                   fmaf(0x1.ffffecp-1f, b, 1.0f));
    return ldexpf(j, (int)n);
}

/* ggml_vec_swiglu_f32: blocks of 16 through v_expf, the tail through expf */
static void swiglu_ggml(float *gate, const float *up, int n)
{
    int n_vec = n - n % 16;
    for (int i = 0; i < n_vec; i++)
        gate[i] = rounded(gate[i] / (1.0f + v_expf(0.0f - gate[i]))) * up[i];
    for (int i = n_vec; i < n; i++)
        gate[i] = rounded(gate[i] / (1.0f + expf(-gate[i]))) * up[i];
}

static float f16_round(float x) { return quant_f16_to_f32(quant_f32_to_f16(x)); }

/* ggml's CPU flash attention for fewer than 64 query rows
 * (flash_attn_ext_f16_one_chunk). llama.cpp casts an F32 cache to F16 before
 * it, and F16 K makes Q round to F16 too. Scores: f16 products summed as
 * ggml_vec_dot_f16 does (16-lane FMAs over steps of 64, the rest in double).
 * Online softmax with expf; the V accumulator is an F16 vector, rounded after
 * every rescale and every fused v*weight add. */
static void attention_ggml(float *out, const float *q, const float *k, const float *v, int stride, int pos, int hd)
{
    float M = -INFINITY, S = 0.0f, scale = 1.0f / sqrtf((float)hd);
    float qh[512], kh[512];
    for (int i = 0; i < hd; i++)
        out[i] = 0.0f, qh[i] = f16_round(q[i]);
    for (int t = 0; t <= pos; t++) {
        for (int i = 0; i < hd; i++)
            kh[i] = f16_round(k[(size_t)t * stride + i]);
        int np;
        double dot = dot_4x16(qh, kh, hd, &np);
        for (int i = np; i < hd; i++)
            dot += (double)(qh[i] * kh[i]);
        float s = (float)dot * scale;
        float ms = 1.0f, vs = 1.0f;
        if (s > M) {
            float m_old = M;
            M = s;
            ms = expf(m_old - M);
            for (int i = 0; i < hd; i++)
                out[i] = f16_round(out[i] * ms);
        } else {
            vs = expf(s - M);
        }
        for (int i = 0; i < hd; i++)
            out[i] = f16_round(fmaf(f16_round(v[(size_t)t * stride + i]), vs, out[i]));
        S = fmaf(S, ms, vs);
    }
    float s_inv = 1.0f / S;
    for (int i = 0; i < hd; i++)
        out[i] *= s_inv;
}

/* ---- forward -------------------------------------------------------------- */

static void norm(const struct ref_model *r, float *o, const float *x, const float *w, int n)
{
    (r->llamacpp ? rmsnorm_ggml : rmsnorm_plain)(o, x, w, n, r->hp.rms_eps);
}

static void rotate(const struct ref_model *r, float *head, int pos)
{
    (r->llamacpp ? rope_ggml : rope)(head, r, pos);
}

static void swiglu(const struct ref_model *r, float *gate, const float *up, int n)
{
    if (r->llamacpp) {
        swiglu_ggml(gate, up, n);
        return;
    }
    for (int i = 0; i < n; i++)
        gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* SwiGLU FFN: out = down(silu(gate(x)) * up(x)) */
static void ffn(struct ref_model *r, float *out, const float *x, const struct ref_mat *w1, const struct ref_mat *w3,
                const struct ref_mat *w2)
{
    matmul(r, r->hb, x, w1, r->tmp);
    matmul(r, r->hb2, x, w3, r->tmp);
    swiglu(r, r->hb, r->hb2, w1->rows);
    matmul(r, out, r->hb, w2, r->tmp);
}

/* Mixture of experts, as llama.cpp routes it for llama and qwen3moe:
 * probabilities = softmax of the router's logits over all experts; the k
 * largest (equal ones: lower expert id first, which is ggml's argsort order
 * for up to 16 experts only; the engine follows ggml beyond); weights = those k
 * probabilities renormalized to sum 1; out = sum of weight * expert FFN. */
static void moe(struct ref_model *r, const struct ref_layer *L, float *out, const float *x)
{
    const struct model_hparams *hp = &r->hp;
    int dim = hp->n_embd, n = hp->n_expert, k = hp->n_expert_used;
    matmul(r, r->probs, x, &L->router, r->tmp);
    softmax(r->probs, n);
    int chosen[64];
    float weight[64];
    double wsum = 0;
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < n; e++) {
            bool taken = false;
            for (int i = 0; i < j; i++)
                taken |= chosen[i] == e;
            if (!taken && (best < 0 || r->probs[e] > r->probs[best]))
                best = e;
        }
        chosen[j] = best;
        weight[j] = r->probs[best];
        wsum += weight[j];
    }
    for (int i = 0; i < dim; i++)
        out[i] = 0;
    for (int j = 0; j < k; j++) {
        ffn(r, r->xb2, x, &L->e1[chosen[j]], &L->e3[chosen[j]], &L->e2[chosen[j]]);
        float w = (float)(weight[j] / wsum);
        for (int i = 0; i < dim; i++)
            out[i] += w * r->xb2[i];
    }
}

ks_status ref_forward(struct ref_model *r, int seq, int32_t token, int32_t pos, float *logits)
{
    const struct model_hparams *hp = &r->hp;
    int dim = hp->n_embd, hd = hp->head_dim_k, qd = hp->n_head * hd, kvd = hp->n_head_kv * hd;
    int kv_mul = hp->n_head / hp->n_head_kv;
    if (seq < 0 || seq >= r->max_seqs || pos != r->seq_len[seq] || pos >= r->max_ctx || token < 0 ||
        token >= hp->n_vocab)
        return ks_fail(KS_ERR_INVALID_ARG, "ref_forward: bad seq %d / pos %d / token %d", seq, pos, token);
    memcpy(r->x, r->tok_embd + (size_t)token * dim, sizeof(float) * (size_t)dim);

    for (int l = 0; l < hp->n_layer; l++) {
        const struct ref_layer *L = &r->layers[l];
        size_t off = (((size_t)seq * hp->n_layer + l) * r->max_ctx) * kvd;
        float *kc = r->key_cache + off, *vc = r->value_cache + off;

        /* attention rmsnorm */
        norm(r, r->xb, r->x, L->attn_norm, dim);
        /* qkv matmuls (+ bias) */
        matmul(r, r->q, r->xb, &L->wq, r->tmp);
        matmul(r, r->k, r->xb, &L->wk, r->tmp);
        matmul(r, r->v, r->xb, &L->wv, r->tmp);
        for (int i = 0; L->bq && i < qd; i++)
            r->q[i] += L->bq[i];
        for (int i = 0; L->bk && i < kvd; i++)
            r->k[i] += L->bk[i], r->v[i] += L->bv[i];
        /* per-head Q/K rmsnorm (qwen3) and RoPE */
        for (int h = 0; h < hp->n_head; h++) {
            if (L->q_norm)
                norm(r, r->q + h * hd, r->q + h * hd, L->q_norm, hd);
            rotate(r, r->q + h * hd, pos);
        }
        for (int h = 0; h < hp->n_head_kv; h++) {
            if (L->k_norm)
                norm(r, r->k + h * hd, r->k + h * hd, L->k_norm, hd);
            rotate(r, r->k + h * hd, pos);
        }
        /* cache k, v at pos */
        memcpy(kc + (size_t)pos * kvd, r->k, sizeof(float) * (size_t)kvd);
        memcpy(vc + (size_t)pos * kvd, r->v, sizeof(float) * (size_t)kvd);
        /* multi-head attention over positions 0..pos */
        for (int h = 0; h < hp->n_head; h++) {
            const float *kh = kc + (h / kv_mul) * hd, *vh = vc + (h / kv_mul) * hd;
            if (r->llamacpp)
                attention_ggml(r->att + h * hd, r->q + h * hd, kh, vh, kvd, pos, hd);
            else
                attention(r->att + h * hd, r->q + h * hd, kh, vh, kvd, pos, hd, r->scores);
        }
        /* output projection, residual */
        matmul(r, r->xb2, r->att, &L->wo, r->tmp);
        for (int i = 0; i < dim; i++)
            r->x[i] += r->xb2[i];
        /* ffn rmsnorm, SwiGLU (or the mixture of experts), residual */
        norm(r, r->xb, r->x, L->ffn_norm, dim);
        if (hp->n_expert > 0) {
            moe(r, L, r->moe_out, r->xb);
            for (int i = 0; i < dim; i++)
                r->x[i] += r->moe_out[i];
        } else {
            ffn(r, r->xb2, r->xb, &L->w1, &L->w3, &L->w2);
            for (int i = 0; i < dim; i++)
                r->x[i] += r->xb2[i];
        }
    }
    r->seq_len[seq] = pos + 1;
    /* final rmsnorm, classifier */
    norm(r, r->xb, r->x, r->output_norm, dim);
    matmul(r, logits, r->xb, &r->output, r->tmp);
    return KS_OK;
}
