/* model: the forward pass over a batch of (token, position, sequence)
 * entries. Every matrix multiply takes the whole batch as its tokens, so a
 * prefill reads each weight block once for many tokens. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attn/attn.h"
#include "model/model_internal.h"

struct model_ctx {
    const struct model *m;
    threads_pool *pool;
    int32_t max_batch;
    float *x;                    /* (B, n_embd) residual stream */
    float *xb;                   /* (B, n_embd) normed input of a block */
    float *xb2;                  /* (B, n_embd) output of a block; normed rows for the logits */
    float *q;                    /* (B, n_head * head_dim) */
    float *k, *v;                /* (B, n_head_kv * head_dim) */
    float *att;                  /* (B, n_head * head_dim) attention output */
    float *hb, *hb2;             /* (B, n_ff) gate and up; MoE: (C * n_expert_used, n_ff_exp) grouped */
    void *hbq;                   /* one token's hb in Q8_K rows (down_packed), or NULL */
    /* mixture of experts (n_expert > 0) */
    float *router;               /* (B, n_expert) router logits, then probabilities */
    int32_t *sel;                /* (B, n_expert_used) selected experts of each token, in llama.cpp's order */
    float *sel_w;                /* (B, n_expert_used) their weights */
    /* C = min(B, MOE_CHUNK_TOKENS) tokens run their experts together */
    int32_t *exp_start;          /* (n_expert + 1) first grouped row of each expert */
    int32_t *grp_tok;            /* (C * n_expert_used) token of each grouped row, from the chunk's first */
    int32_t *row_of;             /* (C, n_expert_used) grouped row of each (token, slot) */
    float *xg;                   /* (C * n_expert_used, n_embd) expert outputs, grouped */
    float *rope_cs;              /* (B, n_rot / 2, 2) cos and sin of each token's angles */
    float *rope_cs_swa;          /* (B, n_rot / 2, 2) the same for window layers with their own RoPE (gemma3) */
    struct attn_query *queries;  /* (B) */
    int32_t *out_rows;           /* (B) batch index of each logits row */
    int32_t *seqs, *seq_start, *seq_count; /* (B) distinct sequences of the batch */
    void *work;                  /* quantized activations for quant_matmul */
    size_t work_size;
    const bool *embed;           /* (B) of the batch being run (model_forward_embed), NULL: none */
};

/* ---- context ------------------------------------------------------------ */

/* Tokens whose experts run together: the grouped buffers (hb, hb2, xg) hold
 * MOE_CHUNK_TOKENS * n_expert_used rows at most, whatever the batch. At 512
 * (llama.cpp's default ubatch) a prefill reads each expert once per 512 tokens. */
#define MOE_CHUNK_TOKENS 512

static int64_t moe_chunk(int64_t B) { return B < MOE_CHUNK_TOKENS ? B : MOE_CHUNK_TOKENS; }

/* A decode step's gate and up products run as one expert of the grouped
 * matmul, its gated activation applied to each work item's rows inside the
 * same region: otherwise the activation runs on the caller alone between two
 * regions (its table lookups miss the cache the weights have just streamed
 * through: 17-26 us per gemma3-1b layer, 2-3% of a token), while the other
 * threads wait. The same kernels and the same elementwise activation: the
 * same bits (whole runs of 16 rows, where the activation's vector loop puts
 * them). Batches whose activation a region of its own splits
 * (elementwise_pool) keep the separate pass. */
static bool fuse_glu(const struct model_layer *L, int64_t n)
{
    const struct model_mat *g = &L->w_gate, *u = &L->w_up;
    return n < 4 && g->rows % 16 == 0 && g->type == u->type && g->repacked == u->repacked && g->rows == u->rows &&
           g->cols == u->cols;
}

/* The set of matrices [i, i + *k) that matmul_same_input runs together:
 * consecutive ones of one width (any types). */
static void same_input_set(const struct model_mat *const *w, int n, int i, struct quant_mm_out *outs,
                           float *const *y, int *k)
{
    for (*k = 0; i + *k < n && *k < QUANT_MM_SET_MAX; (*k)++) {
        const struct model_mat *m = w[i + *k];
        if (*k > 0 && m->cols != w[i]->cols)
            break;
        outs[*k] = (struct quant_mm_out){.W = m->data, .type = m->type, .rows = m->rows, .repacked = m->repacked,
                                         .Y = y ? y[i + *k] : NULL};
    }
}

/* The largest matmul scratch any batch of 1..B tokens needs: the quant
 * module's size is not monotonic in the token count (decode and prefill
 * paths pack activations differently), so try every count for each distinct
 * (type, cols) pair. */
static size_t max_work(const struct model *m, int32_t B)
{
    enum { MAX_SHAPES = 32 };
    struct { enum quant_type type; int64_t cols; } shapes[MAX_SHAPES];
    int n_shapes = 0;
    size_t best = 0;
    for (int il = -1; il < m->hp.n_layer; il++) {
        const struct model_layer *L = il >= 0 ? &m->layers[il] : NULL;
        struct model_mat gate_e, up_e, down_e;
        const struct model_mat *mats[8] = {&m->output};
        int n_mats = 1;
        if (L && m->hp.n_expert == 0) {
            mats[0] = &L->wq, mats[1] = &L->wk, mats[2] = &L->wv, mats[3] = &L->wo;
            mats[4] = &L->w_gate, mats[5] = &L->w_up, mats[6] = &L->w_down;
            n_mats = 7;
        } else if (L) {
            /* every expert of a layer has the type and shape of expert 0 */
            gate_e = model_expert_mat(&L->gate_exps, 0), up_e = model_expert_mat(&L->up_exps, 0);
            down_e = model_expert_mat(&L->down_exps, 0);
            mats[0] = &L->wq, mats[1] = &L->wk, mats[2] = &L->wv, mats[3] = &L->wo;
            mats[4] = &L->w_router, mats[5] = &gate_e, mats[6] = &up_e, mats[7] = &down_e;
            n_mats = 8;
        }
        if (L && m->hp.n_expert > 0) {
            /* grouped, a chunk of tokens at a time: gate/up read its token rows, down its k per token */
            int64_t nt = moe_chunk(B), g = nt * m->hp.n_expert_used;
            size_t w = quant_matmul_experts_work_size(gate_e.type, gate_e.cols, nt, g);
            best = w > best ? w : best;
            w = quant_matmul_experts_work_size(up_e.type, up_e.cols, nt, g);
            best = w > best ? w : best;
            w = quant_matmul_experts_work_size(down_e.type, down_e.cols, g, g);
            best = w > best ? w : best;
        }
        if (L) { /* Q, K and V (and gate, up unfused) as matmul_same_input runs them: every type's work at once */
            const struct model_mat *sets[2][3] = {{&L->wq, &L->wk, &L->wv}, {&L->w_gate, &L->w_up, NULL}};
            for (int si = 0; si < (m->hp.n_expert == 0 ? 2 : 1); si++) {
                int n_set = sets[si][2] ? 3 : 2;
                for (int i = 0, k; i < n_set; i += k) {
                    struct quant_mm_out outs[QUANT_MM_SET_MAX] = {0};
                    same_input_set(sets[si], n_set, i, outs, NULL, &k);
                    for (int32_t n = 1; n <= B; n++) {
                        size_t w = quant_matmul_set_work_size(outs, k, sets[si][i]->cols, n);
                        best = w > best ? w : best;
                    }
                }
            }
        }
        if (L && m->hp.n_expert == 0) /* decode's gate and up, fused */
            for (int32_t n = 1; n <= B && fuse_glu(L, n); n++) {
                size_t w = quant_matmul_experts_work_size(L->w_gate.type, L->w_gate.cols, n, n);
                best = w > best ? w : best;
            }
        for (int i = 0; i < n_mats; i++) {
            int s = 0;
            while (s < n_shapes && (shapes[s].type != mats[i]->type || shapes[s].cols != mats[i]->cols))
                s++;
            if (s < n_shapes)
                continue;
            for (int32_t n = 1; n <= B; n++) {
                size_t w = quant_matmul_work_size(mats[i]->type, mats[i]->cols, n);
                best = w > best ? w : best;
            }
            if (n_shapes < MAX_SHAPES) {
                shapes[n_shapes].type = mats[i]->type;
                shapes[n_shapes].cols = mats[i]->cols;
                n_shapes++;
            }
        }
    }
    return best;
}

ks_status model_ctx_create(const struct model *m, int32_t max_batch_tokens, threads_pool *pool,
                           struct model_ctx **out)
{
    *out = NULL;
    if (max_batch_tokens < 1 || max_batch_tokens > (1 << 20))
        return ks_fail(KS_ERR_INVALID_ARG, "max batch tokens %d must be in [1, 1048576]", max_batch_tokens);
    const struct model_hparams *hp = &m->hp;
    size_t B = (size_t)max_batch_tokens;
    size_t q_dim = (size_t)hp->n_head * hp->head_dim_k, kv_dim = (size_t)hp->n_head_kv * hp->head_dim_k;
    struct model_ctx *c = calloc(1, sizeof *c);
    if (!c)
        return ks_fail(KS_ERR_NOMEM, "out of memory for the model context");
    c->m = m;
    c->pool = pool;
    c->max_batch = max_batch_tokens;
    c->x = malloc(B * hp->n_embd * sizeof(float));
    c->xb = malloc(B * hp->n_embd * sizeof(float));
    c->xb2 = malloc(B * hp->n_embd * sizeof(float));
    c->q = malloc(B * q_dim * sizeof(float));
    c->k = malloc(B * kv_dim * sizeof(float));
    c->v = malloc(B * kv_dim * sizeof(float));
    c->att = malloc(B * q_dim * sizeof(float));
    /* a MoE file's n_ff is not run; its experts' hidden rows are grouped, k per token of a chunk */
    size_t hrows = hp->n_expert > 0 ? (size_t)moe_chunk(max_batch_tokens) * (size_t)hp->n_expert_used : B;
    size_t ff = (size_t)(hp->n_expert > 0 ? hp->n_ff_exp : hp->n_ff);
    c->hb = malloc(hrows * ff * sizeof(float));
    c->hb2 = malloc(hrows * ff * sizeof(float));
    bool moe = hp->n_expert > 0;
    if (!moe && ff % QK_K == 0) {
        size_t qbytes = quant_row_size(QUANT_Q8_K, (int64_t)ff);
        c->hbq = aligned_alloc(64, (qbytes + 63) / 64 * 64);
    }
    if (moe) {
        size_t k = (size_t)hp->n_expert_used;
        c->router = malloc(B * (size_t)hp->n_expert * sizeof(float));
        c->sel = malloc(B * k * sizeof(int32_t));
        c->sel_w = malloc(B * k * sizeof(float));
        c->exp_start = malloc(((size_t)hp->n_expert + 1) * sizeof(int32_t));
        c->grp_tok = malloc(hrows * sizeof(int32_t));
        c->row_of = malloc(hrows * sizeof(int32_t));
        c->xg = malloc(hrows * (size_t)hp->n_embd * sizeof(float));
    }
    c->rope_cs = malloc(B * (size_t)(hp->n_rot > 0 ? hp->n_rot : 1) * sizeof(float));
    if (m->rope_swa_own)
        c->rope_cs_swa = malloc(B * (size_t)(hp->n_rot > 0 ? hp->n_rot : 1) * sizeof(float));
    c->queries = malloc(B * sizeof *c->queries);
    c->out_rows = malloc(B * sizeof(int32_t));
    c->seqs = malloc(B * sizeof(int32_t));
    c->seq_start = malloc(B * sizeof(int32_t));
    c->seq_count = malloc(B * sizeof(int32_t));
    c->work_size = max_work(m, max_batch_tokens);
    c->work = malloc(c->work_size ? c->work_size : 1);
    if (!c->x || !c->xb || !c->xb2 || !c->q || !c->k || !c->v || !c->att || !c->hb || !c->hb2 || !c->rope_cs ||
        !c->queries || !c->out_rows || !c->seqs || !c->seq_start || !c->seq_count || !c->work ||
        (moe && (!c->router || !c->sel || !c->sel_w || !c->exp_start || !c->grp_tok || !c->row_of || !c->xg)) ||
        (m->rope_swa_own && !c->rope_cs_swa) || (!moe && ff % QK_K == 0 && !c->hbq)) {
        model_ctx_free(c);
        return ks_fail(KS_ERR_NOMEM, "out of memory for a model context of %d batch tokens", max_batch_tokens);
    }
    *out = c;
    return KS_OK;
}

void model_ctx_free(struct model_ctx *c)
{
    if (!c)
        return;
    free(c->x), free(c->xb), free(c->xb2), free(c->q), free(c->k), free(c->v), free(c->att);
    free(c->hb), free(c->hb2), free(c->rope_cs), free(c->rope_cs_swa), free(c->queries), free(c->out_rows);
    free(c->hbq);
    free(c->seqs), free(c->seq_start), free(c->seq_count), free(c->work);
    free(c->router), free(c->sel), free(c->sel_w), free(c->exp_start), free(c->grp_tok), free(c->row_of), free(c->xg);
    free(c);
}

/* ---- row-parallel helpers ------------------------------------------------- */

/* The sum of squares in double. One chain of dependent double additions
 * costs 4 cycles a value (1.3 us for a 1024-wide row, about 8 us per
 * qwen3-0.6b layer with its per-head Q/K norms); RMSNORM_LANES independent
 * partial sums vectorize and differ from that chain only in a double's last
 * bits, far below the float mean's rounding. */
#define RMSNORM_LANES 8

static double sum_squares(const float *x, int n)
{
    double part[RMSNORM_LANES] = {0};
    int i = 0;
    for (; i + RMSNORM_LANES <= n; i += RMSNORM_LANES)
        for (int k = 0; k < RMSNORM_LANES; k++)
            part[k] += (double)x[i + k] * x[i + k];
    double ss = 0.0;
    for (int k = 0; k < RMSNORM_LANES; k++)
        ss += part[k];
    for (; i < n; i++)
        ss += (double)x[i] * x[i];
    return ss;
}

static void rmsnorm_row(float *out, const float *x, const float *w, int n, float eps)
{
    double ss = sum_squares(x, n);
    float scale = 1.0f / sqrtf((float)(ss / n) + eps);
    for (int i = 0; i < n; i++)
        out[i] = (x[i] * scale) * w[i];
}

struct norm_job {
    float *out;
    const float *x;
    const float *w;
    const int32_t *rows; /* NULL: row i of x; else row rows[i] */
    int64_t n_rows;
    int dim;
    float eps;
};

static void norm_task(void *p, int ith, int nth)
{
    const struct norm_job *j = p;
    int64_t lo, hi;
    threads_split(j->n_rows, ith, nth, &lo, &hi);
    for (int64_t i = lo; i < hi; i++) {
        int64_t src = j->rows ? j->rows[i] : i;
        rmsnorm_row(j->out + i * j->dim, j->x + src * j->dim, j->w, j->dim, j->eps);
    }
}

static void rmsnorm_rows(threads_pool *pool, float *out, const float *x, const float *w, const int32_t *rows,
                         int64_t n_rows, int dim, float eps)
{
    struct norm_job j = {out, x, w, rows, n_rows, dim, eps};
    threads_run(pool, norm_task, &j);
}

struct swiglu_job {
    float *gate;
    const float *up;
    int64_t n;
};

/* Threads split SwiGLU's values in runs of this many: quant_swiglu's vector
 * loop and its scalar tail (libm expf) round differently, so a split inside a
 * run would give a value other bits for another thread count or batch size. */
#define SWIGLU_RUN 16

static void glu_split(const struct swiglu_job *j, void (*act)(float *, const float *, int64_t), int ith, int nth)
{
    int64_t lo, hi;
    threads_split((j->n + SWIGLU_RUN - 1) / SWIGLU_RUN, ith, nth, &lo, &hi);
    lo = lo * SWIGLU_RUN < j->n ? lo * SWIGLU_RUN : j->n;
    hi = hi * SWIGLU_RUN < j->n ? hi * SWIGLU_RUN : j->n;
    act(j->gate + lo, j->up + lo, hi - lo);
}

/* gate = silu(gate) * up */
static void swiglu_task(void *p, int ith, int nth) { glu_split(p, quant_swiglu, ith, nth); }

/* gate = gelu_tanh(gate) * up (gemma) */
static void geglu_task(void *p, int ith, int nth) { glu_split(p, quant_geglu, ith, nth); }

/* gpt-oss's clamped SwiGLU (quant_swiglu_oai) */
static void swiglu_oai_task(void *p, int ith, int nth) { glu_split(p, quant_swiglu_oai, ith, nth); }

struct softcap_job {
    float *x;
    int64_t n;
    float cap;
};

/* gemma2's final logit soft-capping as llama.cpp's graph has it: scale by
 * 1 / cap, tanh, scale by cap, each rounded to float */
static void softcap_task(void *p, int ith, int nth)
{
    const struct softcap_job *j = p;
    float inv = 1.0f / j->cap;
    int64_t lo, hi;
    threads_split(j->n, ith, nth, &lo, &hi);
    for (int64_t i = lo; i < hi; i++)
        j->x[i] = tanhf(j->x[i] * inv) * j->cap;
}

/* ---- RoPE ------------------------------------------------------------------ */

/* YaRN's angle for pair i, as ggml's rope_yarn: the interpolated angle
 * (times freq_scale) and the extrapolated one mixed by a ramp that is 1 below
 * the low corr dim and 0 above the high one. */
static float yarn_angle(const struct model *m, int i, float theta_extrap)
{
    float theta_interp = m->rope_freq_scale * theta_extrap;
    float lo = m->rope_yarn_corr[0], hi = m->rope_yarn_corr[1];
    float y = ((float)i - lo) / (hi - lo > 0.001f ? hi - lo : 0.001f);
    float ramp_mix = (1 - (y < 0 ? 0 : y > 1 ? 1 : y)) * m->rope_ext_factor;
    return theta_interp * (1 - ramp_mix) + theta_extrap * ramp_mix;
}

/* Angles as llama.cpp computes them: theta_i = p * theta_scale^i by repeated
 * multiplication, divided by the per-frequency factor, times freq_scale (or
 * YaRN's mix); cos and sin scaled by rope_mscale (rope.scaling.attn_factor,
 * which llama.cpp applies to every layer, window layers too, times YaRN's
 * magnitude). swa_own: gemma3's window layers, their own base, unscaled. */
void model_rope_angles(const struct model *m, bool swa_own, int32_t pos, float *cs)
{
    float theta = (float)pos, mscale = m->rope_mscale;
    float theta_scale = swa_own ? m->rope_theta_scale_swa : m->rope_theta_scale;
    const float *ff = swa_own ? NULL : m->rope_freq_factors;
    for (int i = 0; i < m->hp.n_rot / 2; i++) {
        float th = theta / (ff ? ff[i] : 1.0f);
        float t = swa_own ? th : m->rope_ext_factor != 0.0f ? yarn_angle(m, i, th) : m->rope_freq_scale * th;
        cs[2 * i] = cosf(t) * mscale;
        cs[2 * i + 1] = sinf(t) * mscale;
        theta *= theta_scale;
    }
}

/* Rotate the first n_rot values of one head: pairs (2i, 2i+1) for NORMAL,
 * (i, i + n_rot/2) for NEOX. */
void model_rope_head(float *h, const float *cs, int n_rot, enum model_rope_type type)
{
    int half = n_rot / 2;
    for (int i = 0; i < half; i++) {
        int a = type == MODEL_ROPE_NEOX ? i : 2 * i;
        int b = type == MODEL_ROPE_NEOX ? i + half : 2 * i + 1;
        float x0 = h[a], x1 = h[b], c = cs[2 * i], s = cs[2 * i + 1];
        h[a] = x0 * c - x1 * s;
        h[b] = x0 * s + x1 * c;
    }
}

static void add_bias(float *x, const float *b, int n)
{
    for (int i = 0; i < n; i++)
        x[i] += b[i];
}

struct qk_job {
    const struct model *m;
    const struct model_layer *L;
    float *q, *k, *v;
    const float *rope_cs;
    int64_t n_tokens;
};

/* Per token: QKV bias, per-head Q/K RMSNorm, then RoPE on Q and K; gemma
 * then scales Q (attn_q_scale). */
static void qk_task(void *p, int ith, int nth)
{
    const struct qk_job *j = p;
    const struct model_hparams *hp = &j->m->hp;
    int hd = hp->head_dim_k, q_dim = hp->n_head * hd, kv_dim = hp->n_head_kv * hd;
    int64_t lo, hi;
    threads_split(j->n_tokens, ith, nth, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) {
        float *q = j->q + t * q_dim, *k = j->k + t * kv_dim, *v = j->v + t * kv_dim;
        const float *cs = j->rope_cs + t * hp->n_rot;
        if (j->L->bq) {
            add_bias(q, j->L->bq, q_dim);
            add_bias(k, j->L->bk, kv_dim);
            add_bias(v, j->L->bv, kv_dim);
        }
        for (int h = 0; h < hp->n_head; h++) {
            if (j->L->q_norm)
                rmsnorm_row(q + h * hd, q + h * hd, j->L->q_norm, hd, hp->rms_eps);
            model_rope_head(q + h * hd, cs, hp->n_rot, hp->rope_type);
        }
        if (hp->attn_q_scale > 0)
            for (int i = 0; i < q_dim; i++)
                q[i] *= hp->attn_q_scale;
        for (int h = 0; h < hp->n_head_kv; h++) {
            if (j->L->k_norm)
                rmsnorm_row(k + h * hd, k + h * hd, j->L->k_norm, hd, hp->rms_eps);
            model_rope_head(k + h * hd, cs, hp->n_rot, hp->rope_type);
        }
    }
}

/* ---- batch bookkeeping ------------------------------------------------------ */

/* Find the distinct sequences, check that each one's positions continue its
 * cache contents, and grow them all (undoing the growth if one fails). */
static ks_status batch_prepare(struct model_ctx *c, struct kv_cache *kv, const struct model_batch *b,
                               int32_t *n_seqs_out)
{
    const struct model_hparams *hp = &c->m->hp;
    int32_t n_seqs = 0;
    for (int32_t i = 0; i < b->n_tokens; i++) {
        if (b->tokens[i] < 0 || b->tokens[i] >= hp->n_vocab)
            return ks_fail(KS_ERR_RANGE, "batch entry %d: token id %d is outside the vocabulary [0, %d)", i,
                           b->tokens[i], hp->n_vocab);
        int32_t s = 0;
        while (s < n_seqs && c->seqs[s] != b->seq[i])
            s++;
        if (s == n_seqs) {
            int32_t len = b->seq[i] >= 0 ? kv_seq_len(kv, b->seq[i]) : -1;
            if (len < 0)
                return ks_fail(KS_ERR_NOT_FOUND, "batch entry %d: sequence %d does not exist in the cache", i,
                               b->seq[i]);
            c->seqs[s] = b->seq[i];
            c->seq_start[s] = len;
            c->seq_count[s] = 0;
            n_seqs++;
        }
        int32_t want = c->seq_start[s] + c->seq_count[s];
        if (b->pos[i] != want)
            return ks_fail(KS_ERR_RANGE, "batch entry %d: sequence %d needs position %d next, got %d", i,
                           b->seq[i], want, b->pos[i]);
        c->seq_count[s]++;
    }
    for (int32_t s = 0; s < n_seqs; s++) {
        ks_status st = kv_seq_grow(kv, c->seqs[s], c->seq_count[s]);
        if (st) {
            for (int32_t u = 0; u < s; u++)
                kv_seq_truncate(kv, c->seqs[u], c->seq_start[u]);
            return st;
        }
    }
    *n_seqs_out = n_seqs;
    return KS_OK;
}

/* Entries from t on that continue one sequence position by position. */
static int32_t same_seq_run(const struct model_batch *b, int32_t t)
{
    int32_t run = 1;
    while (t + run < b->n_tokens && b->seq[t + run] == b->seq[t] && b->pos[t + run] == b->pos[t] + run)
        run++;
    return run;
}

static void batch_rollback(struct model_ctx *c, struct kv_cache *kv, int32_t n_seqs)
{
    for (int32_t s = 0; s < n_seqs; s++)
        kv_seq_truncate(kv, c->seqs[s], c->seq_start[s]);
}

/* Rows that get logits, in batch order. */
static int32_t select_outputs(struct model_ctx *c, const struct model_batch *b)
{
    int32_t n = 0;
    if (b->want_logits) {
        for (int32_t i = 0; i < b->n_tokens; i++)
            if (b->want_logits[i])
                c->out_rows[n++] = i;
        return n;
    }
    /* the last entry of each sequence: walk backwards, keep first sightings */
    for (int32_t i = b->n_tokens - 1; i >= 0; i--) {
        if (c->embed && c->embed[i])
            continue;
        bool seen = false;
        for (int32_t j = 0; j < n && !seen; j++)
            seen = b->seq[c->out_rows[j]] == b->seq[i];
        if (!seen)
            c->out_rows[n++] = i;
    }
    for (int32_t i = 0; i < n / 2; i++) {
        int32_t t = c->out_rows[i];
        c->out_rows[i] = c->out_rows[n - 1 - i];
        c->out_rows[n - 1 - i] = t;
    }
    return n;
}

/* ---- the transformer ------------------------------------------------------------ */

/* Elementwise passes (norms, RoPE, activations) over fewer values than this
 * run on the caller alone: a region's wake-up and the cache lines' trips
 * between cores cost more than the pass (a decode step's; a short
 * verification's; any batch of a tiny model). */
#define ELEMENTWISE_INLINE_VALUES 32768
static threads_pool *elementwise_pool(const struct model_ctx *c, int64_t n_values)
{
    return n_values >= ELEMENTWISE_INLINE_VALUES ? c->pool : NULL;
}

static ks_status matmul(struct model_ctx *c, const struct model_mat *w, const float *x, int64_t n, float *y)
{
    if (w->repacked)
        return quant_matmul_repacked(c->pool, w->data, w->type, w->rows, w->cols, x, n, y, c->work, c->work_size);
    return quant_matmul(c->pool, w->data, w->type, w->rows, w->cols, x, n, y, c->work, c->work_size);
}

/* Bytes of the next matrices a decode step's idle workers prefetch while the
 * caller runs the serial work before them (threads_prefetch_idle): about
 * what one core pulls in a gemma3-1b attention (20-28 us). */
#define IDLE_PREFETCH_BYTES (384 * 1024)

/* Hint the next region's matrices (up to 2): the first bytes of each
 * thread's share of their rows, where its stream starts. A decode step only:
 * a prefill's regions are long, its gaps short. */
static void prefetch_next(const struct model_ctx *c, int64_t n, const struct model_mat *a, const struct model_mat *b)
{
    int nth = threads_count(c->pool);
    if (n >= 4 || nth < 2 || nth > THREADS_HINT_MAX)
        return;
    const struct model_mat *mats[2] = {a, b};
    int n_mats = b ? 2 : 1;
    int per = n_mats * nth <= THREADS_HINT_MAX ? nth : THREADS_HINT_MAX / n_mats; /* ranges per matrix */
    const void *ptr[THREADS_HINT_MAX];
    size_t len[THREADS_HINT_MAX];
    int k = 0;
    for (int i = 0; i < n_mats; i++) {
        size_t bytes = quant_row_size(mats[i]->type, mats[i]->cols) * (size_t)mats[i]->rows;
        for (int t = 0; t < per && k < THREADS_HINT_MAX; t++) {
            size_t off = bytes / (size_t)per * (size_t)t, want = IDLE_PREFETCH_BYTES / (size_t)(n_mats * per);
            ptr[k] = (const uint8_t *)mats[i]->data + off;
            len[k++] = want < bytes - off ? want : bytes - off;
        }
    }
    threads_prefetch_idle(c->pool, ptr, len, k);
}

/* y[i] = w[i] x for matrices that read the same x: each run of them with
 * one width is one quant_matmul_set (one parallel region when decoding). */
static ks_status matmul_same_input(struct model_ctx *c, const struct model_mat *const *w, float *const *y, int n,
                                   const float *x, int64_t nt)
{
    for (int i = 0, k; i < n; i += k) {
        struct quant_mm_out outs[QUANT_MM_SET_MAX] = {0};
        same_input_set(w, n, i, outs, y, &k);
        ks_status st = quant_matmul_set(c->pool, w[i]->cols, outs, k, x, nt, c->work, c->work_size);
        if (st)
            return st;
    }
    return KS_OK;
}

/* Tied embeddings are repacked as the output matrix: their rows are read back
 * out of the layout. */
static ks_status embed_token(const struct model *m, int32_t token, float *y)
{
    const struct model_mat *e = &m->tok_embd;
    if (e->repacked)
        return quant_get_row_repacked(e->data, e->type, e->rows, e->cols, token, y);
    return quant_get_row(e->data, e->type, e->cols, token, y);
}

/* The window layer il attends through: the model's sliding window on its
 * window layers (gemma2/3, gpt-oss; model_kv_config gives the cache the same
 * one, so it frees what no query reads), else the window the KV cache was
 * configured with for that layer (a cache may mark a window-less model's
 * layers windowed: it then attends them with that window). A cache that
 * would free rows the model's own window reads is refused. */
static ks_status layer_window(const struct model_hparams *hp, const struct kv_config *kc, int il, int32_t *window)
{
    bool cache_windowed = kv_layer_windowed(kc, il);
    *window = cache_windowed ? kc->swa_window : 0;
    if (hp->n_swa <= 0)
        return KS_OK;
    bool model_windowed = model_layer_is_swa(hp, il);
    if (cache_windowed && (!model_windowed || kc->swa_window < hp->n_swa))
        return ks_fail(KS_ERR_INVALID_ARG,
                       "layer %d: the KV cache keeps a window of %d tokens but the model attends %s (configure the "
                       "cache with model_kv_config)", il, (int)kc->swa_window,
                       model_windowed ? "a wider window" : "every position");
    *window = model_windowed ? hp->n_swa : 0;
    return KS_OK;
}

static ks_status attention_block(struct model_ctx *c, struct kv_cache *kv, int il, const struct model_batch *b)
{
    const struct model *m = c->m;
    const struct model_hparams *hp = &m->hp;
    const struct model_layer *L = &m->layers[il];
    int64_t n = b->n_tokens, kv_dim = (int64_t)hp->n_head_kv * hp->head_dim_k;
    ks_status st;
    /* attention rmsnorm, then Q, K, V projections of the whole batch */
    rmsnorm_rows(elementwise_pool(c, n * hp->n_embd), c->xb, c->x, L->attn_norm, NULL, n, hp->n_embd, hp->rms_eps);
    const struct model_mat *qkv[] = {&L->wq, &L->wk, &L->wv};
    float *const qkv_out[] = {c->q, c->k, c->v};
    if ((st = matmul_same_input(c, qkv, qkv_out, 3, c->xb, n)))
        return st;
    prefetch_next(c, n, &L->wo, NULL);
    /* biases, Q/K norm, RoPE */
    bool swa = model_layer_is_swa(hp, il);
    struct qk_job qj = {m, L, c->q, c->k, c->v, swa && m->rope_swa_own ? c->rope_cs_swa : c->rope_cs, n};
    threads_run(elementwise_pool(c, n * (hp->n_head + hp->n_head_kv) * hp->head_dim_k), qk_task, &qj);
    /* K/V of the whole batch go to the cache first: causal attention within the batch. One
     * write per run of a sequence's consecutive tokens, so that the first one fixes its
     * smoothing means from all its tokens in page 0 */
    for (int32_t t = 0, run; t < b->n_tokens; t += run) {
        run = same_seq_run(b, t);
        if ((st = kv_write_rows(kv, il, b->seq[t], b->pos[t], run, c->k + t * kv_dim, c->v + t * kv_dim)))
            return st;
    }
    int32_t window;
    if ((st = layer_window(hp, kv_get_config(kv), il, &window)))
        return st;
    struct attn_params ap = {
        .scale = hp->attn_q_scale > 0 ? 1.0f : 1.0f / sqrtf((float)hp->head_dim_k),
        .window = window,
        .softcap = hp->attn_softcap,
        .sinks = L->sinks,
    };
    if ((st = attn_forward_ex(c->pool, kv, il, c->queries, (int32_t)n, c->q, c->att, hp->n_head, &ap)))
        return st;
    /* output projection (gpt-oss: and its bias), gemma's post-attention rmsnorm, residual */
    if ((st = matmul(c, &L->wo, c->att, n, c->xb2)))
        return st;
    if (hp->n_expert == 0) /* a MoE layer's router and experts are not known yet */
        prefetch_next(c, n, &L->w_gate, &L->w_up);
    for (int64_t t = 0; t < n && L->bo; t++)
        add_bias(c->xb2 + t * hp->n_embd, L->bo, hp->n_embd);
    if (L->post_attn_norm)
        rmsnorm_rows(elementwise_pool(c, n * hp->n_embd), c->xb2, c->xb2, L->post_attn_norm, NULL, n, hp->n_embd,
                     hp->rms_eps);
    for (int64_t i = 0; i < n * hp->n_embd; i++)
        c->x[i] += c->xb2[i];
    return KS_OK;
}

/* One token's down reads its input packed by the gate/up region
 * (quant_moe_mm.Yq), each block by the thread that finished it, rather than
 * by the caller between the regions (gemma3-1b's 6912 values, half of them
 * in the other core's cache). */
static bool down_packed(const struct model_ctx *c, const struct model_layer *L, int64_t n)
{
    const struct model_mat *d = &L->w_down;
    return n == 1 && c->hbq && L->w_gate.rows == d->cols && quant_matmul_takes_packed(d->type, d->repacked, d->cols);
}

static ks_status gate_up_fused(struct model_ctx *c, const struct model_layer *L, int64_t n)
{
    const struct model_hparams *hp = &c->m->hp;
    const struct model_mat *g = &L->w_gate;
    int32_t start[2] = {0, (int32_t)n};
    struct quant_moe_mm p = {
        .wtype = g->type, .rows = g->rows, .cols = g->cols, .W = g->data, .W2 = L->w_up.data,
        .stride = quant_row_size(g->type, g->cols) * (size_t)g->rows, .n_expert = 1, .start = start, .X = c->xb,
        .n_x = n, .Y = c->hb, .Y2 = c->hb2, .swiglu = true, .repacked = g->repacked,
        .glu = hp->ffn_act == MODEL_FFN_GEGLU ? QUANT_GLU_GELU : QUANT_GLU_SILU,
    };
    if (down_packed(c, L, n))
        p.Yq = c->hbq, p.yq_type = L->w_down.type;
    return quant_matmul_experts(c->pool, &p, c->work, c->work_size);
}

static ks_status ffn_block(struct model_ctx *c, int il, int64_t n)
{
    const struct model_hparams *hp = &c->m->hp;
    const struct model_layer *L = &c->m->layers[il];
    ks_status st;
    /* ffn rmsnorm, SwiGLU: down(silu(gate(x)) * up(x)) (gemma: GeGLU, then its post-ffn rmsnorm), residual */
    rmsnorm_rows(elementwise_pool(c, n * hp->n_embd), c->xb, c->x, L->ffn_norm, NULL, n, hp->n_embd, hp->rms_eps);
    const struct model_mat *gate_up[] = {&L->w_gate, &L->w_up};
    float *const gate_up_out[] = {c->hb, c->hb2};
    bool fused = fuse_glu(L, n);
    if ((st = fused ? gate_up_fused(c, L, n) : matmul_same_input(c, gate_up, gate_up_out, 2, c->xb, n)))
        return st;
    prefetch_next(c, n, &L->w_down, NULL);
    if (!fused) {
        struct swiglu_job sj = {c->hb, c->hb2, n * hp->n_ff};
        threads_fn act = hp->ffn_act == MODEL_FFN_GEGLU ? geglu_task : swiglu_task;
        threads_run(elementwise_pool(c, n * hp->n_ff), act, &sj);
    }
    if (fused && down_packed(c, L, n))
        st = quant_matmul_packed(c->pool, L->w_down.data, L->w_down.type, L->w_down.repacked, L->w_down.rows,
                                 L->w_down.cols, c->hbq, c->xb2);
    else
        st = matmul(c, &L->w_down, c->hb, n, c->xb2);
    if (st)
        return st;
    prefetch_next(c, n, il + 1 < c->m->hp.n_layer ? &c->m->layers[il + 1].wq : &c->m->output, NULL);
    if (L->post_ffn_norm)
        rmsnorm_rows(elementwise_pool(c, n * hp->n_embd), c->xb2, c->xb2, L->post_ffn_norm, NULL, n, hp->n_embd,
                     hp->rms_eps);
    for (int64_t i = 0; i < n * hp->n_embd; i++)
        c->x[i] += c->xb2[i];
    return KS_OK;
}

/* ---- mixture of experts -------------------------------------------------------- */

/* llama.cpp's clamp of the weight sum before renormalizing: the smallest normal f16. */
#define MOE_MIN_WEIGHT_SUM 6.103515625e-5f

/* One token's routing, as llama.cpp's build_moe_ffn computes it on the CPU:
 * probabilities = softmax(logits) (exp of logit - max, sum in double, scaled by
 * the float reciprocal); the first k of their descending argsort, equal ones
 * in ggml's order (model_argsort.c); weights = those probabilities divided by
 * their sum (summed in double, clamped). The row is overwritten with the
 * probabilities. */
static void route_token(float *p, int n_expert, int k, int32_t *sel, float *w)
{
    int32_t order[MODEL_MAX_EXPERTS];
    float mx = p[0];
    for (int i = 1; i < n_expert; i++)
        mx = p[i] > mx ? p[i] : mx;
    double sum = 0.0;
    for (int i = 0; i < n_expert; i++) {
        p[i] = expf(p[i] - mx);
        sum += p[i];
    }
    float inv = (float)(1.0 / sum);
    for (int i = 0; i < n_expert; i++)
        p[i] *= inv;
    model_argsort_desc(p, n_expert, order);
    double wsum = 0.0;
    for (int j = 0; j < k; j++) {
        sel[j] = order[j];
        w[j] = p[order[j]];
        wsum += w[j];
    }
    float s = (float)wsum;
    s = s > MOE_MIN_WEIGHT_SUM ? s : MOE_MIN_WEIGHT_SUM;
    for (int j = 0; j < k; j++)
        w[j] /= s;
}

/* gpt-oss's routing, as llama.cpp's SOFTMAX_WEIGHT gating: the router bias
 * added to the logits, the first k of their descending argsort (ggml's order
 * for ties), weights = softmax over those k logits (as route_token's softmax). */
static void route_token_topk_softmax(float *p, const float *bias, int n_expert, int k, int32_t *sel, float *w)
{
    int32_t order[MODEL_MAX_EXPERTS];
    for (int i = 0; i < n_expert && bias; i++)
        p[i] += bias[i];
    model_argsort_desc(p, n_expert, order);
    float mx = p[order[0]];
    double sum = 0.0;
    for (int j = 0; j < k; j++) {
        sel[j] = order[j];
        w[j] = expf(p[order[j]] - mx);
        sum += w[j];
    }
    float inv = (float)(1.0 / sum);
    for (int j = 0; j < k; j++)
        w[j] *= inv;
}

struct route_job {
    struct model_ctx *c;
    const struct model_layer *L;
    int64_t n_tokens;
};

static void route_task(void *p, int ith, int nth)
{
    const struct route_job *j = p;
    const struct model_hparams *hp = &j->c->m->hp;
    int E = hp->n_expert, k = hp->n_expert_used;
    int64_t lo, hi;
    threads_split(j->n_tokens, ith, nth, &lo, &hi);
    for (int64_t t = lo; t < hi; t++)
        if (hp->oai.softmax_after_topk)
            route_token_topk_softmax(j->c->router + t * E, j->L->b_router, E, k, j->c->sel + t * k,
                                     j->c->sel_w + t * k);
        else
            route_token(j->c->router + t * E, E, k, j->c->sel + t * k, j->c->sel_w + t * k);
}

/* Counting sort of the (token, slot) pairs of tokens t0 .. t0 + n by expert:
 * expert e's tokens are grouped rows exp_start[e] .. exp_start[e + 1], in
 * token order; grp_tok and row_of count tokens from t0. */
static void group_by_expert(struct model_ctx *c, int64_t t0, int64_t n)
{
    const struct model_hparams *hp = &c->m->hp;
    int E = hp->n_expert, k = hp->n_expert_used;
    int32_t *start = c->exp_start;
    const int32_t *sel = c->sel + t0 * k;
    memset(start, 0, ((size_t)E + 1) * sizeof *start);
    for (int64_t i = 0; i < n * k; i++)
        start[sel[i] + 1]++;
    for (int e = 0; e < E; e++)
        start[e + 1] += start[e];
    /* fill with a running cursor per expert (start[e] advances, then shifts back) */
    for (int64_t t = 0; t < n; t++)
        for (int j = 0; j < k; j++) {
            int32_t r = start[sel[t * k + j]]++;
            c->grp_tok[r] = (int32_t)t;
            c->row_of[t * k + j] = r;
        }
    for (int e = E; e > 0; e--)
        start[e] = start[e - 1];
    start[0] = 0;
}

struct rows_job {
    struct model_ctx *c;
    int64_t t0, n;               /* tokens t0 .. t0 + n */
};

/* x[t] += sum over slots j of w[t][j] * expert output, the products rounded
 * and added in slot order as llama.cpp's chain of ggml_add does. */
static void combine_task(void *p, int ith, int nth)
{
    const struct rows_job *j = p;
    const struct model_ctx *c = j->c;
    int64_t D = c->m->hp.n_embd, lo, hi;
    int k = c->m->hp.n_expert_used;
    threads_split(j->n, ith, nth, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) {
        float *x = c->x + (j->t0 + t) * D;
        const float *w = c->sel_w + (j->t0 + t) * k;
        const int32_t *rows = c->row_of + t * k;
        for (int64_t i = 0; i < D; i++) {
            float acc = c->xg[(int64_t)rows[0] * D + i] * w[0];
            for (int s = 1; s < k; s++) {
                float term = c->xg[(int64_t)rows[s] * D + i] * w[s];
                acc += term;
            }
            x[i] += acc;
        }
    }
}

/* The experts of tokens t0 .. t0 + n (their routing done): grouped by
 * expert, so each expert's weights stream once for all its tokens, then
 * combined into the residual. */
static ks_status moe_experts(struct model_ctx *c, const struct model_layer *L, int64_t t0, int64_t n)
{
    const struct model_hparams *hp = &c->m->hp;
    int64_t D = hp->n_embd, F = hp->n_ff_exp, n_rows = n * hp->n_expert_used;
    ks_status st;
    group_by_expert(c, t0, n);
    /* every selected expert's SwiGLU, all experts in one parallel region per step:
     * hb = silu(gate_e(xb[t])) * up_e(xb[t]) for each grouped (token t, expert e) */
    struct quant_moe_mm gu = {
        .wtype = L->gate_exps.type, .rows = F, .cols = D, .W = L->gate_exps.data, .W2 = L->up_exps.data,
        .stride = L->gate_exps.stride, .n_expert = hp->n_expert, .start = c->exp_start, .X = c->xb + t0 * D,
        .x_rows = c->grp_tok, .n_x = n, .Y = c->hb, .Y2 = c->hb2, .swiglu = true, .repacked = L->gate_exps.repacked,
        .B = L->b_gate_exps, .B2 = L->b_up_exps, .glu = hp->oai.swiglu_oai ? QUANT_GLU_OAI : QUANT_GLU_SILU,
    };
    if (L->up_exps.type == L->gate_exps.type && L->up_exps.repacked == L->gate_exps.repacked) {
        if ((st = quant_matmul_experts(c->pool, &gu, c->work, c->work_size)))
            return st;
    } else { /* a mix that quantized (or repacked) gate and up differently: one pass each */
        struct quant_moe_mm up = gu;
        gu.W2 = NULL, gu.Y2 = NULL, gu.swiglu = false, gu.B2 = NULL, gu.glu = QUANT_GLU_SILU;
        up.wtype = L->up_exps.type, up.W = L->up_exps.data, up.stride = L->up_exps.stride, up.W2 = NULL;
        up.repacked = L->up_exps.repacked;
        up.Y = c->hb2, up.Y2 = NULL, up.swiglu = false, up.B = L->b_up_exps, up.B2 = NULL, up.glu = QUANT_GLU_SILU;
        if ((st = quant_matmul_experts(c->pool, &gu, c->work, c->work_size)) ||
            (st = quant_matmul_experts(c->pool, &up, c->work, c->work_size)))
            return st;
        struct swiglu_job sj = {c->hb, c->hb2, n_rows * F};
        threads_run(elementwise_pool(c, n_rows * F), hp->oai.swiglu_oai ? swiglu_oai_task : swiglu_task, &sj);
    }
    /* xg = down_e(hb), grouped */
    struct quant_moe_mm dn = {
        .wtype = L->down_exps.type, .rows = D, .cols = F, .W = L->down_exps.data, .stride = L->down_exps.stride,
        .n_expert = hp->n_expert, .start = c->exp_start, .X = c->hb, .n_x = n_rows, .Y = c->xg,
        .repacked = L->down_exps.repacked, .B = L->b_down_exps,
    };
    if ((st = quant_matmul_experts(c->pool, &dn, c->work, c->work_size)))
        return st;
    /* weighted sum of each token's experts, residual */
    struct rows_job cj = {c, t0, n};
    threads_run(elementwise_pool(c, n * hp->n_expert_used * D), combine_task, &cj);
    return KS_OK;
}

static ks_status moe_block(struct model_ctx *c, int il, int64_t n)
{
    const struct model_hparams *hp = &c->m->hp;
    const struct model_layer *L = &c->m->layers[il];
    int64_t D = hp->n_embd;
    ks_status st;
    /* ffn rmsnorm, router logits (f32), per-token top-k routing */
    rmsnorm_rows(elementwise_pool(c, n * D), c->xb, c->x, L->ffn_norm, NULL, n, (int)D, hp->rms_eps);
    if ((st = matmul(c, &L->w_router, c->xb, n, c->router)))
        return st;
    struct route_job rj = {c, L, n};
    threads_run(elementwise_pool(c, n * hp->n_expert), route_task, &rj);
    for (int64_t t0 = 0; t0 < n; t0 += MOE_CHUNK_TOKENS)
        if ((st = moe_experts(c, L, t0, n - t0 < MOE_CHUNK_TOKENS ? n - t0 : MOE_CHUNK_TOKENS)))
            return st;
    return KS_OK;
}

/* A non-causal model's embedding tokens attend to their whole input: each
 * query reaches its sequence's last position in the batch (all its K/V are
 * written before attention runs, and the sequence starts in this batch). */
static void see_whole_input(struct model_ctx *c, const struct model_batch *b)
{
    for (int32_t t = 0; t < b->n_tokens; t++) {
        if (!c->embed[t])
            continue;
        int32_t s = 0;
        while (c->seqs[s] != b->seq[t])
            s++;
        c->queries[t].pos = c->seq_start[s] + c->seq_count[s] - 1;
    }
}

static ks_status run_layers(struct model_ctx *c, struct kv_cache *kv, const struct model_batch *b, float *logits,
                            int32_t n_out)
{
    const struct model *m = c->m;
    const struct model_hparams *hp = &m->hp;
    int64_t n = b->n_tokens;
    ks_status st;
    /* token embeddings */
    for (int64_t t = 0; t < n; t++)
        if ((st = embed_token(m, b->tokens[t], c->x + t * hp->n_embd)))
            return st;
    if (hp->embd_scale > 0) /* gemma: times sqrt(n_embd) */
        for (int64_t i = 0; i < n * hp->n_embd; i++)
            c->x[i] *= hp->embd_scale;
    for (int64_t t = 0; t < n; t++) {
        model_rope_angles(m, false, b->pos[t], c->rope_cs + t * hp->n_rot);
        if (m->rope_swa_own) /* gemma3's window layers: their own base, unscaled */
            model_rope_angles(m, true, b->pos[t], c->rope_cs_swa + t * hp->n_rot);
        c->queries[t] = (struct attn_query){.seq = b->seq[t], .pos = b->pos[t]};
    }
    if (hp->non_causal && c->embed)
        see_whole_input(c, b);
    for (int il = 0; il < hp->n_layer; il++)
        if ((st = attention_block(c, kv, il, b)) ||
            (st = hp->n_expert > 0 ? moe_block(c, il, n) : ffn_block(c, il, n)))
            return st;
    if (n_out == 0)
        return KS_OK;
    /* final rmsnorm of the rows that want logits, then the classifier */
    rmsnorm_rows(elementwise_pool(c, n_out * hp->n_embd), c->xb2, c->x, m->output_norm, c->out_rows, n_out,
                 hp->n_embd, hp->rms_eps);
    if ((st = matmul(c, &m->output, c->xb2, n_out, logits)))
        return st;
    if (hp->final_softcap > 0) {
        struct softcap_job sj = {logits, (int64_t)n_out * hp->n_vocab, hp->final_softcap};
        threads_run(c->pool, softcap_task, &sj);
    }
    return KS_OK;
}

/* The cache's shape is the model's: KS_ERR_INVALID_ARG with both otherwise. */
static ks_status check_kv_shape(const struct model_ctx *c, const struct kv_cache *kv)
{
    const struct kv_config *kc = kv_get_config(kv);
    if (kc->n_layer != c->m->hp.n_layer || kc->n_kv_head != c->m->hp.n_head_kv ||
        kc->head_dim != c->m->hp.head_dim_k)
        return ks_fail(KS_ERR_INVALID_ARG, "the kv cache is shaped %d layers x %d heads x %d, the model needs %d x %d x %d",
                       kc->n_layer, kc->n_kv_head, kc->head_dim, c->m->hp.n_layer, c->m->hp.n_head_kv,
                       c->m->hp.head_dim_k);
    return KS_OK;
}

ks_status model_forward(struct model_ctx *c, struct kv_cache *kv, const struct model_batch *b, float *logits,
                        int32_t *n_logits_out)
{
    if (n_logits_out)
        *n_logits_out = 0;
    if (b->n_tokens < 0 || b->n_tokens > c->max_batch)
        return ks_fail(KS_ERR_INVALID_ARG, "batch of %d tokens exceeds the context's maximum of %d", b->n_tokens,
                       c->max_batch);
    if (c->m->hp.encoder_only)
        return ks_fail(KS_ERR_UNSUPPORTED, "%s is an encoder (an embedding model without an output head): it computes "
                       "embeddings (model_forward_embed), not logits", c->m->hp.arch_name);
    if (b->n_tokens == 0)
        return KS_OK;
    if (!b->tokens || !b->pos || !b->seq)
        return ks_fail(KS_ERR_INVALID_ARG, "model_forward: batch arrays must not be NULL");
    ks_status st_kv = check_kv_shape(c, kv);
    if (st_kv)
        return st_kv;
    int32_t n_out = select_outputs(c, b);
    if (n_out > 0 && !logits)
        return ks_fail(KS_ERR_INVALID_ARG, "model_forward: logits buffer is NULL but %d rows want logits", n_out);
    int32_t n_seqs = 0;
    ks_status st = batch_prepare(c, kv, b, &n_seqs);
    if (st)
        return st;
    st = run_layers(c, kv, b, logits, n_out);
    if (st) {
        batch_rollback(c, kv, n_seqs);
        return st;
    }
    if (n_logits_out)
        *n_logits_out = n_out;
    return KS_OK;
}

/* ---- embeddings ---------------------------------------------------------------- */

/* Every embedding sequence is whole in the batch: all its entries are
 * embedding entries and it starts at position 0 (batch_prepare has found the
 * sequences and their starts). */
static ks_status check_embed_seqs(const struct model_ctx *c, const struct model_batch *b, int32_t n_seqs)
{
    for (int32_t s = 0; s < n_seqs; s++) {
        int32_t n_embed = 0;
        for (int32_t t = 0; t < b->n_tokens; t++)
            n_embed += b->seq[t] == c->seqs[s] && c->embed[t];
        if (n_embed > 0 && n_embed != c->seq_count[s])
            return ks_fail(KS_ERR_INVALID_ARG, "sequence %d mixes embedding and other entries in one batch",
                           c->seqs[s]);
        if (n_embed > 0 && c->seq_start[s] != 0)
            return ks_fail(KS_ERR_INVALID_ARG,
                           "embedding sequence %d must start in this batch at position 0 (the cache holds %d of its "
                           "tokens)", c->seqs[s], c->seq_start[s]);
    }
    return KS_OK;
}

/* One pooled row per embedding sequence, in the order of its first entry:
 * output_norm of the rows pooling reads, then the pooling. */
static int32_t pool_sequences(struct model_ctx *c, const struct model_batch *b, int32_t n_seqs, float *embd)
{
    const struct model *m = c->m;
    int dim = m->hp.n_embd;
    int32_t n_out = 0;
    for (int32_t s = 0; s < n_seqs; s++) {
        int32_t n_rows = 0;
        for (int32_t t = 0; t < b->n_tokens; t++)
            if (b->seq[t] == c->seqs[s] && c->embed[t])
                c->out_rows[n_rows++] = t;
        if (n_rows == 0)
            continue;
        if (m->hp.pooling == MODEL_POOLING_CLS)
            n_rows = 1;
        else if (m->hp.pooling == MODEL_POOLING_LAST)
            c->out_rows[0] = c->out_rows[n_rows - 1], n_rows = 1;
        rmsnorm_rows(elementwise_pool(c, n_rows * dim), c->xb2, c->x, m->output_norm, c->out_rows, n_rows, dim,
                     m->hp.rms_eps);
        model_pool_rows(m->hp.pooling, c->xb2, n_rows, dim, embd + (size_t)n_out * dim);
        n_out++;
    }
    return n_out;
}

ks_status model_forward_embed(struct model_ctx *c, struct kv_cache *kv, const struct model_batch *b,
                              const bool *embed, float *logits, int32_t *n_logits_out, float *embd,
                              int32_t *n_embd_out)
{
    if (n_embd_out)
        *n_embd_out = 0;
    if (!embed)
        return model_forward(c, kv, b, logits, n_logits_out);
    if (n_logits_out)
        *n_logits_out = 0;
    enum model_pooling p = c->m->hp.pooling;
    if (p != MODEL_POOLING_MEAN && p != MODEL_POOLING_CLS && p != MODEL_POOLING_LAST)
        return ks_fail(KS_ERR_UNSUPPORTED, "embeddings need pooling mean, cls or last; this model pools '%s' (set "
                       "another with --pooling)", model_pooling_name(p));
    if (!embd)
        return ks_fail(KS_ERR_INVALID_ARG, "model_forward_embed: the embeddings buffer is NULL");
    if (b->n_tokens < 0 || b->n_tokens > c->max_batch)
        return ks_fail(KS_ERR_INVALID_ARG, "batch of %d tokens exceeds the context's maximum of %d", b->n_tokens,
                       c->max_batch);
    if (b->n_tokens == 0)
        return KS_OK;
    if (!b->tokens || !b->pos || !b->seq)
        return ks_fail(KS_ERR_INVALID_ARG, "model_forward_embed: batch arrays must not be NULL");
    for (int32_t t = 0; b->want_logits && t < b->n_tokens; t++)
        if (embed[t] && b->want_logits[t])
            return ks_fail(KS_ERR_INVALID_ARG, "batch entry %d: an embedding entry cannot want logits", t);
    if (c->m->hp.encoder_only) /* its own forward pass: LayerNorms, post-norm, attention within the input */
        return model_bert_forward_embed(c->m, c->pool, b, embed, kv, embd, n_embd_out);
    ks_status st_kv = check_kv_shape(c, kv);
    if (st_kv)
        return st_kv;
    c->embed = embed;
    int32_t n_out = select_outputs(c, b), n_seqs = 0;
    ks_status st = n_out > 0 && !logits
                       ? ks_fail(KS_ERR_INVALID_ARG, "model_forward_embed: logits buffer is NULL but %d rows want logits", n_out)
                       : batch_prepare(c, kv, b, &n_seqs);
    if (!st && (st = check_embed_seqs(c, b, n_seqs)))
        batch_rollback(c, kv, n_seqs);
    if (!st && (st = run_layers(c, kv, b, logits, n_out)))
        batch_rollback(c, kv, n_seqs);
    if (!st) {
        int32_t n_embd = pool_sequences(c, b, n_seqs, embd);
        if (n_logits_out)
            *n_logits_out = n_out;
        if (n_embd_out)
            *n_embd_out = n_embd;
    }
    c->embed = NULL;
    return st;
}
