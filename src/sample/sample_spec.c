/* Speculative sampling's side of the sampler: a draft model's proposal
 * distribution q and the rejection's residual (sample.h,
 * sample_verify_proposal). */
#include <math.h>
#include <string.h>

#include "sample/sample.h"
#include "sample/sample_internal.h"

bool sample_in_set(int32_t id, const int32_t *set, int32_t n)
{
    for (int32_t i = 0; i < n; i++)
        if (set[i] == id)
            return true;
    return false;
}

int32_t sample_residual_pick(struct sampler *s, const struct sample_proposal *q, const double *p_q)
{
    double r[SAMPLE_PROPOSAL_MAX], r_in = 0.0, p_in = 0.0;
    for (int32_t j = 0; j < q->n; j++) {
        r[j] = p_q[j] > q->probs[j] ? p_q[j] - q->probs[j] : 0.0;
        r_in += r[j];
        p_in += p_q[j];
    }
    if (r_in <= 0.0) /* a one-hot q: the residual is p without the draft */
        return -1;
    /* p's mass outside q's support; below this it is rounding, and every
     * token p can give is in q's support */
    double r_out = 1.0 - p_in;
    if (r_out < 1e-9)
        r_out = 0.0;
    double t = sample_uniform01(s) * (r_in + r_out);
    if (t >= r_in && r_out > 0.0)
        return -1;
    double cum = 0.0;
    int32_t last = -1;
    for (int32_t j = 0; j < q->n; j++) {
        if (r[j] <= 0.0)
            continue;
        cum += r[j];
        last = j;
        if (t < cum)
            return j;
    }
    return last; /* rounding left t at the very top */
}

/* c[0..n) best first (n is at most SAMPLE_PROPOSAL_MAX). */
static void sort_best_first(struct cand *c, int32_t n)
{
    for (int32_t i = 1; i < n; i++)
        for (int32_t j = i; j > 0 && (c[j].logit > c[j - 1].logit ||
                                      (c[j].logit == c[j - 1].logit && c[j].id < c[j - 1].id)); j--) {
            struct cand t = c[j];
            c[j] = c[j - 1];
            c[j - 1] = t;
        }
}

/* Of sorted c[0..n), the shortest prefix whose mass (untempered, over z)
 * reaches top_p. */
static int32_t keep_top_p(const struct cand *c, int32_t n, float top_p, float max, double z)
{
    double cum = 0.0;
    for (int32_t i = 0; i < n; i++) {
        cum += exp((double)c[i].logit - (double)max) / z;
        if (cum >= top_p)
            return i + 1;
    }
    return n;
}

ks_status sample_proposal_make(const struct sample_params *p, const float *logits, int32_t n_vocab,
                               struct sample_proposal *out, float *p_top)
{
    if (!p || !logits || !out || !p_top || n_vocab < 1)
        return ks_fail(KS_ERR_INVALID_ARG, "sample_proposal_make: NULL argument or an empty vocabulary");
    int32_t argmax;
    float max;
    if (!sample_max_index(logits, n_vocab, &argmax, &max))
        return ks_fail(KS_ERR_RANGE, "draft sampler: the draft model's logits contain NaN or +inf");
    if (max == -INFINITY)
        return ks_fail(KS_ERR_RANGE, "draft sampler: every logit of the draft model is -inf");
    double z = sample_sum_exp(logits, n_vocab, max, 1.0f);
    *p_top = (float)(1.0 / z);
    memset(out, 0, sizeof *out);
    if (p->temp <= 0.0f) {
        *out = (struct sample_proposal){.n = 1, .tokens = {argmax}, .probs = {1.0f}};
        return KS_OK;
    }
    int32_t k = SAMPLE_PROPOSAL_MAX;
    bool top_k_within = p->top_k > 0 && p->top_k <= SAMPLE_PROPOSAL_MAX;
    if (top_k_within)
        k = p->top_k;
    if (k > n_vocab)
        k = n_vocab;
    struct cand c[SAMPLE_PROPOSAL_MAX];
    sample_select_top(logits, n_vocab, k, c);
    sort_best_first(c, k);
    if (p->top_p < 1.0f) {
        double z_top = 0.0; /* top-p measures mass within the top-k set */
        for (int32_t i = 0; top_k_within && i < k; i++)
            z_top += exp((double)c[i].logit - (double)max);
        k = keep_top_p(c, k, p->top_p, max, top_k_within ? z_top : z);
    }
    if (p->min_p > 0.0f) {
        float thr = max + logf(p->min_p);
        while (k > 1 && c[k - 1].logit < thr)
            k--;
    }
    double total = 0.0, w[SAMPLE_PROPOSAL_MAX];
    for (int32_t i = 0; i < k; i++)
        total += w[i] = exp(((double)c[i].logit - (double)max) / (double)p->temp);
    for (int32_t i = 0; i < k; i++) {
        float q = (float)(w[i] / total);
        if (q <= 0.0f) /* an -inf logit, or one far below the best */
            continue;
        out->tokens[out->n] = c[i].id;
        out->probs[out->n++] = q;
    }
    return KS_OK;
}

int32_t sample_proposal_draw(const struct sample_proposal *q, double u)
{
    double cum = 0.0;
    for (int32_t j = 0; j < q->n; j++) {
        cum += q->probs[j];
        if (u < cum)
            return q->tokens[j];
    }
    return q->tokens[q->n - 1]; /* rounding left u at the very top */
}
