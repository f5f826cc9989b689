/* model: the BERT-family encoders, bert (all-MiniLM, bge, e5, gte, ...) and
 * nomic-bert (nomic-embed-text), run as llama.cpp's bert graph runs them:
 *
 *   x = tok_embd[token] + token_types[0] (+ position_embd[pos], bert)
 *   x = LayerNorm(x)                                    token_embd_norm
 *   per layer:
 *     q, k, v = Wq x + bq, Wk x + bk, Wv x + bv         (nomic-bert: one attn_qkv, RoPE NEOX on q, k)
 *     a = Wo attention(q, k, v) + bo                    every token of the input sees every other
 *     h = LayerNorm(a + x)                              attn_output_norm (post-norm)
 *     f = Wdown gelu(Wup h + b_up) + b_down             (nomic-bert: Wdown silu(Wgate h) * Wup h)
 *     x = LayerNorm(f + h)                              layer_output_norm
 *   the embedding: pooling (mean, cls, last) of the final x, no output norm.
 *
 * llama.cpp gives these models no KV cache (create_memory returns none for
 * them), and neither does this file: attention is computed directly within
 * each input, whose K/V live only for the step. An input is one sequence of
 * the batch, computed whole. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "model/model_internal.h"

/* ---- the batch's sequences ------------------------------------------------------ */

/* The batch's inputs: input s is entries rows[off[s]] .. rows[off[s] + len[s] - 1]
 * in position order, and entry t belongs to input of[t]. */
struct inputs {
    int32_t n;
    int32_t *seq;   /* (n) kv sequence id */
    int32_t *off;   /* (n) */
    int32_t *len;   /* (n) */
    int32_t *rows;  /* (n_tokens) batch index of each input's positions 0, 1, ... */
    int32_t *of;    /* (n_tokens) */
};

static void inputs_free(struct inputs *in)
{
    free(in->seq), free(in->off), free(in->len), free(in->rows), free(in->of);
}

/* Every entry an embedding entry; each input starts at position 0, continues
 * position by position in batch order, fits the learned positions (bert) and
 * has nothing in the cache (llama.cpp's encoders have no cache to continue). */
static ks_status inputs_find(const struct model *m, const struct model_batch *b, const bool *embed,
                             const struct kv_cache *kv, struct inputs *in)
{
    int32_t nt = b->n_tokens;
    *in = (struct inputs){0};
    in->seq = malloc(sizeof(int32_t) * (size_t)nt), in->off = malloc(sizeof(int32_t) * (size_t)nt);
    in->len = malloc(sizeof(int32_t) * (size_t)nt), in->rows = malloc(sizeof(int32_t) * (size_t)nt);
    in->of = malloc(sizeof(int32_t) * (size_t)nt);
    if (!in->seq || !in->off || !in->len || !in->rows || !in->of)
        return ks_fail(KS_ERR_NOMEM, "out of memory for a batch of %d tokens", nt);
    for (int32_t t = 0; t < nt; t++) {
        if (!embed[t])
            return ks_fail(KS_ERR_INVALID_ARG, "batch entry %d: %s is an encoder, every entry must be an embedding "
                           "entry", t, m->hp.arch_name);
        if (b->tokens[t] < 0 || b->tokens[t] >= m->hp.n_vocab)
            return ks_fail(KS_ERR_RANGE, "batch entry %d: token id %d is outside the vocabulary [0, %d)", t,
                           b->tokens[t], m->hp.n_vocab);
        int32_t s = 0;
        while (s < in->n && in->seq[s] != b->seq[t])
            s++;
        if (s == in->n) {
            int32_t cached = b->seq[t] >= 0 ? kv_seq_len(kv, b->seq[t]) : -1;
            if (cached < 0)
                return ks_fail(KS_ERR_NOT_FOUND, "batch entry %d: sequence %d does not exist in the cache", t, b->seq[t]);
            if (cached > 0)
                return ks_fail(KS_ERR_INVALID_ARG, "embedding sequence %d must start in this batch at position 0 "
                               "(the cache holds %d of its tokens)", b->seq[t], cached);
            in->seq[in->n] = b->seq[t], in->len[in->n] = 0, in->n++;
        }
        if (b->pos[t] != in->len[s])
            return ks_fail(KS_ERR_RANGE, "batch entry %d: sequence %d needs position %d next, got %d", t, b->seq[t],
                           in->len[s], b->pos[t]);
        if (m->pos_embd.data && b->pos[t] >= m->pos_embd.rows)
            return ks_fail(KS_ERR_RANGE, "batch entry %d: position %d is past %s's %lld learned positions "
                           "(context_length); shorten the input", t, b->pos[t], m->hp.arch_name,
                           (long long)m->pos_embd.rows);
        in->len[s]++;
        in->of[t] = s;
    }
    for (int32_t s = 0, off = 0; s < in->n; off += in->len[s], s++)
        in->off[s] = off;
    for (int32_t t = 0; t < nt; t++)
        in->rows[in->off[in->of[t]] + b->pos[t]] = t;
    return KS_OK;
}

/* ---- scratch ------------------------------------------------------------------------ */

struct bert_step {
    const struct model *m;
    threads_pool *pool;
    const struct model_batch *b;
    struct inputs in;
    int64_t n;                   /* tokens */
    float *x;                    /* (n, n_embd) hidden states */
    float *h;                    /* (n, n_embd) the FFN's input */
    float *y;                    /* (n, n_embd) a block's output */
    float *q;                    /* (n, n_head * head_dim) */
    float *k, *v;                /* (n, n_head_kv * head_dim) */
    float *att;                  /* (n, n_head * head_dim) attention output */
    float *ff, *ff2;             /* (n, n_ff) up (and gate) */
    float *rope_cs;              /* (n, n_rot / 2, 2) nomic-bert's cos and sin */
    void *work;
    size_t work_size;
};

static void step_free(struct bert_step *s)
{
    free(s->x), free(s->h), free(s->y), free(s->q), free(s->k), free(s->v), free(s->att);
    free(s->ff), free(s->ff2), free(s->rope_cs), free(s->work);
    inputs_free(&s->in);
}

static size_t work_size(const struct model *m, int64_t n)
{
    size_t best = 0;
    for (int il = 0; il < m->hp.n_layer; il++) {
        const struct model_layer *L = &m->layers[il];
        const struct model_mat *mats[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_up, &L->w_gate, &L->w_down};
        for (size_t i = 0; i < sizeof mats / sizeof mats[0]; i++) {
            size_t w = mats[i]->data ? quant_matmul_work_size(mats[i]->type, mats[i]->cols, n) : 0;
            best = w > best ? w : best;
        }
    }
    return best;
}

static ks_status step_alloc(struct bert_step *s)
{
    const struct model_hparams *hp = &s->m->hp;
    size_t n = (size_t)s->n, E = (size_t)hp->n_embd;
    size_t q_dim = (size_t)hp->n_head * hp->head_dim_k, kv_dim = (size_t)hp->n_head_kv * hp->head_dim_k;
    s->x = malloc(n * E * sizeof(float)), s->h = malloc(n * E * sizeof(float)), s->y = malloc(n * E * sizeof(float));
    s->q = malloc(n * q_dim * sizeof(float)), s->att = malloc(n * q_dim * sizeof(float));
    s->k = malloc(n * kv_dim * sizeof(float)), s->v = malloc(n * kv_dim * sizeof(float));
    s->ff = malloc(n * (size_t)hp->n_ff * sizeof(float)), s->ff2 = malloc(n * (size_t)hp->n_ff * sizeof(float));
    s->rope_cs = malloc(n * (size_t)(hp->n_rot > 0 ? hp->n_rot : 1) * sizeof(float));
    s->work_size = work_size(s->m, s->n);
    s->work = malloc(s->work_size ? s->work_size : 1);
    if (!s->x || !s->h || !s->y || !s->q || !s->att || !s->k || !s->v || !s->ff || !s->ff2 || !s->rope_cs || !s->work)
        return ks_fail(KS_ERR_NOMEM, "out of memory for an encoder step of %lld tokens", (long long)s->n);
    return KS_OK;
}

/* ---- blocks ---------------------------------------------------------------------------- */

/* LayerNorm as ggml_norm, then ggml_mul by w and ggml_add of b: mean and
 * variance summed in double, each product and sum rounded to float. */
static void layer_norm_row(float *out, const float *x, const float *w, const float *b, int n, float eps)
{
    double sum = 0.0;
    for (int i = 0; i < n; i++)
        sum += x[i];
    float mean = (float)(sum / n);
    double sum2 = 0.0;
    for (int i = 0; i < n; i++) {
        float d = x[i] - mean;
        out[i] = d;
        sum2 += (double)d * d;
    }
    float scale = 1.0f / sqrtf((float)(sum2 / n) + eps);
    for (int i = 0; i < n; i++) {
        float y = out[i] * scale;
        y = y * w[i];
        out[i] = y + b[i];
    }
}

struct norm_job {
    float *out;
    const float *x, *w, *b;
    int64_t n_rows;
    int dim;
    float eps;
};

static void norm_task(void *p, int ith, int nth)
{
    const struct norm_job *j = p;
    int64_t lo, hi;
    threads_split(j->n_rows, ith, nth, &lo, &hi);
    for (int64_t r = lo; r < hi; r++)
        layer_norm_row(j->out + r * j->dim, j->x + r * j->dim, j->w, j->b, j->dim, j->eps);
}

/* out (n, dim) = LayerNorm(x) row by row (out may be x) */
static void layer_norm(struct bert_step *s, float *out, const float *x, const float *w, const float *b)
{
    struct norm_job j = {out, x, w, b, s->n, s->m->hp.n_embd, s->m->hp.norm_eps};
    threads_run(s->pool, norm_task, &j);
}

static void add_rows_bias(float *y, const float *bias, int64_t n, int dim)
{
    for (int64_t t = 0; bias && t < n; t++)
        for (int i = 0; i < dim; i++)
            y[t * dim + i] += bias[i];
}

/* y (n, rows) = w x (+ bias) */
static ks_status linear(struct bert_step *s, const struct model_mat *w, const float *bias, const float *x, float *y)
{
    ks_status st = w->repacked ? quant_matmul_repacked(s->pool, w->data, w->type, w->rows, w->cols, x, s->n, y,
                                                       s->work, s->work_size)
                               : quant_matmul(s->pool, w->data, w->type, w->rows, w->cols, x, s->n, y, s->work,
                                              s->work_size);
    if (!st)
        add_rows_bias(y, bias, s->n, (int)w->rows);
    return st;
}

/* x = tok_embd[token] + token_types[0], then + position_embd[pos] (bert), in
 * llama.cpp's order of additions */
static ks_status embed_inputs(struct bert_step *s)
{
    const struct model *m = s->m;
    int E = m->hp.n_embd;
    float *row = s->y, *pos = s->h; /* token_types[0], one position's row */
    ks_status st = KS_OK;
    if (m->type_embd.data && (st = quant_get_row(m->type_embd.data, m->type_embd.type, E, 0, row)))
        return st;
    for (int64_t t = 0; t < s->n; t++) {
        float *x = s->x + t * E;
        if ((st = quant_get_row(m->tok_embd.data, m->tok_embd.type, E, s->b->tokens[t], x)))
            return st;
        for (int i = 0; m->type_embd.data && i < E; i++)
            x[i] += row[i];
        if (!m->pos_embd.data)
            continue;
        if ((st = quant_get_row(m->pos_embd.data, m->pos_embd.type, E, s->b->pos[t], pos)))
            return st;
        for (int i = 0; i < E; i++)
            x[i] = pos[i] + x[i];
    }
    return KS_OK;
}

/* nomic-bert: Q and K rotated at each token's position (NEOX pairs) */
static void rotate_qk(struct bert_step *s)
{
    const struct model_hparams *hp = &s->m->hp;
    int hd = hp->head_dim_k, q_dim = hp->n_head * hd, kv_dim = hp->n_head_kv * hd;
    for (int64_t t = 0; t < s->n; t++) {
        float *cs = s->rope_cs + t * hp->n_rot;
        model_rope_angles(s->m, false, s->b->pos[t], cs);
        for (int h = 0; h < hp->n_head; h++)
            model_rope_head(s->q + t * q_dim + h * hd, cs, hp->n_rot, hp->rope_type);
        for (int h = 0; h < hp->n_head_kv; h++)
            model_rope_head(s->k + t * kv_dim + h * hd, cs, hp->n_rot, hp->rope_type);
    }
}

struct attn_job {
    struct bert_step *s;
    int max_len;
    atomic_bool failed;
};

/* One token's heads over the keys of its input (all of them; with
 * attention.causal = true only those at or before it): softmax(q k / sqrt(d))
 * as ggml's soft_max (exp of score - max, summed in double, scaled by the
 * float reciprocal), then the weighted sum of V. */
static void attend_token(const struct bert_step *s, int64_t t, float *p)
{
    const struct model_hparams *hp = &s->m->hp;
    int hd = hp->head_dim_k, q_dim = hp->n_head * hd, kv_dim = hp->n_head_kv * hd;
    int group = hp->n_head / hp->n_head_kv;
    int32_t in = s->in.of[t];
    const int32_t *rows = s->in.rows + s->in.off[in];
    int32_t n_keys = hp->non_causal ? s->in.len[in] : s->b->pos[t] + 1;
    float scale = 1.0f / sqrtf((float)hd);
    for (int h = 0; h < hp->n_head; h++) {
        const float *q = s->q + t * q_dim + h * hd;
        int kvh = h / group;
        float mx = -INFINITY;
        for (int32_t j = 0; j < n_keys; j++) {
            const float *k = s->k + (int64_t)rows[j] * kv_dim + kvh * hd;
            float dot = 0.0f;
            for (int i = 0; i < hd; i++)
                dot += q[i] * k[i];
            p[j] = dot * scale;
            mx = p[j] > mx ? p[j] : mx;
        }
        double sum = 0.0;
        for (int32_t j = 0; j < n_keys; j++) {
            p[j] = expf(p[j] - mx);
            sum += p[j];
        }
        float inv = (float)(1.0 / sum);
        float *out = s->att + t * q_dim + h * hd;
        memset(out, 0, sizeof(float) * (size_t)hd);
        for (int32_t j = 0; j < n_keys; j++) {
            const float *v = s->v + (int64_t)rows[j] * kv_dim + kvh * hd;
            float w = p[j] * inv;
            for (int i = 0; i < hd; i++)
                out[i] += w * v[i];
        }
    }
}

static void attn_task(void *p, int ith, int nth)
{
    struct attn_job *j = p;
    int64_t lo, hi;
    threads_split(j->s->n, ith, nth, &lo, &hi);
    if (lo >= hi)
        return;
    float *scores = malloc(sizeof(float) * (size_t)j->max_len);
    if (!scores) {
        atomic_store(&j->failed, true); /* any thread's failure fails the step */
        return;
    }
    for (int64_t t = lo; t < hi; t++)
        attend_token(j->s, t, scores);
    free(scores);
}

static ks_status attention(struct bert_step *s)
{
    struct attn_job j = {.s = s, .max_len = 1};
    atomic_init(&j.failed, false);
    for (int32_t i = 0; i < s->in.n; i++)
        j.max_len = s->in.len[i] > j.max_len ? s->in.len[i] : j.max_len;
    threads_run(s->pool, attn_task, &j);
    return atomic_load(&j.failed) ? ks_fail(KS_ERR_NOMEM, "out of memory for attention scores of %d keys", j.max_len) : KS_OK;
}

struct act_job {
    float *a;
    const float *b;
    int64_t n;
    bool swiglu;
};

/* Threads split the values in runs of this many, as model_forward.c's
 * SwiGLU does, so that a value's bits do not depend on the thread count */
#define ACT_RUN 16

static void act_task(void *p, int ith, int nth)
{
    const struct act_job *j = p;
    int64_t lo, hi;
    threads_split((j->n + ACT_RUN - 1) / ACT_RUN, ith, nth, &lo, &hi);
    lo = lo * ACT_RUN < j->n ? lo * ACT_RUN : j->n;
    hi = hi * ACT_RUN < j->n ? hi * ACT_RUN : j->n;
    if (j->swiglu)
        quant_swiglu(j->a + lo, j->b + lo, hi - lo);
    else
        quant_gelu(j->a + lo, hi - lo);
}

static ks_status layer(struct bert_step *s, int il)
{
    const struct model *m = s->m;
    const struct model_layer *L = &m->layers[il];
    int64_t n = s->n, E = m->hp.n_embd;
    ks_status st;
    /* self-attention over each input, output projection */
    if ((st = linear(s, &L->wq, L->bq, s->x, s->q)) || (st = linear(s, &L->wk, L->bk, s->x, s->k)) ||
        (st = linear(s, &L->wv, L->bv, s->x, s->v)))
        return st;
    if (m->hp.arch == MODEL_ARCH_NOMIC_BERT)
        rotate_qk(s);
    if ((st = attention(s)) || (st = linear(s, &L->wo, L->bo, s->att, s->y)))
        return st;
    /* residual, then the attention's LayerNorm (post-norm) */
    for (int64_t i = 0; i < n * E; i++)
        s->y[i] += s->x[i];
    layer_norm(s, s->h, s->y, L->attn_out_norm, L->attn_out_norm_b);
    /* FFN: bert up + bias, GELU, down + bias; nomic-bert silu(gate) * up, down */
    if ((st = linear(s, &L->w_up, L->b_up, s->h, s->ff)))
        return st;
    struct act_job aj = {s->ff, NULL, n * m->hp.n_ff, false};
    if (L->w_gate.data) {
        if ((st = linear(s, &L->w_gate, NULL, s->h, s->ff2)))
            return st;
        aj = (struct act_job){s->ff2, s->ff, n * m->hp.n_ff, true};
    }
    threads_run(s->pool, act_task, &aj);
    if ((st = linear(s, &L->w_down, L->b_down, aj.a, s->y)))
        return st;
    /* residual, then the layer's output LayerNorm */
    for (int64_t i = 0; i < n * E; i++)
        s->y[i] += s->h[i];
    layer_norm(s, s->x, s->y, L->layer_out_norm, L->layer_out_norm_b);
    return KS_OK;
}

/* One pooled row per input, in the order of its first entry: its final
 * hidden states gathered in position order, then the model's pooling. */
static void pool_inputs(struct bert_step *s, float *embd)
{
    int E = s->m->hp.n_embd;
    for (int32_t in = 0; in < s->in.n; in++) {
        const int32_t *rows = s->in.rows + s->in.off[in];
        for (int32_t p = 0; p < s->in.len[in]; p++)
            memcpy(s->y + (size_t)p * E, s->x + (size_t)rows[p] * E, sizeof(float) * (size_t)E);
        model_pool_rows(s->m->hp.pooling, s->y, s->in.len[in], E, embd + (size_t)in * E);
    }
}

ks_status model_bert_forward_embed(const struct model *m, threads_pool *pool, const struct model_batch *b,
                                   const bool *embed, const struct kv_cache *kv, float *embd, int32_t *n_embd_out)
{
    struct bert_step s = {.m = m, .pool = pool, .b = b, .n = b->n_tokens};
    ks_status st = inputs_find(m, b, embed, kv, &s.in);
    if (!st)
        st = step_alloc(&s);
    if (!st)
        st = embed_inputs(&s);
    if (!st)
        layer_norm(&s, s.x, s.x, m->tok_norm, m->tok_norm_b);
    for (int il = 0; il < m->hp.n_layer && !st; il++)
        st = layer(&s, il);
    if (!st) {
        pool_inputs(&s, embd);
        if (n_embd_out)
            *n_embd_out = s.in.n;
    }
    step_free(&s);
    return st;
}
