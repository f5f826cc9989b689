/* model: what makes a model an embedder. Its metadata (pooling type and
 * causality, read as llama.cpp reads them for every architecture) and the
 * pooling of final hidden states into one vector per input. The forward pass
 * itself is model_forward_embed in model_forward.c. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "model/model_internal.h"

static const char *const g_pooling_names[] = {"none", "mean", "cls", "last", "rank"};
#define N_POOLING (int)(sizeof g_pooling_names / sizeof g_pooling_names[0])

ks_status model_pooling_parse(const char *name, enum model_pooling *out)
{
    for (int i = 0; name && i < N_POOLING; i++)
        if (!strcmp(name, g_pooling_names[i])) {
            *out = (enum model_pooling)i;
            return KS_OK;
        }
    return ks_fail(KS_ERR_INVALID_ARG, "pooling '%s' is not one of none, mean, cls, last, rank", name ? name : "");
}

const char *model_pooling_name(enum model_pooling p)
{
    return (int)p >= 0 && (int)p < N_POOLING ? g_pooling_names[p] : "unknown";
}

void model_set_pooling(struct model *m, enum model_pooling p) { m->hp.pooling = p; }

ks_status model_read_embed_meta(const struct gguf_file *f, const char *arch, struct model_hparams *hp)
{
    char key[128];
    snprintf(key, sizeof key, "%s.pooling_type", arch);
    uint32_t pooling = MODEL_POOLING_NONE;
    ks_status st = gguf_get_u32(f, key, &pooling);
    if (st && st != KS_ERR_NOT_FOUND)
        return ks_fail(KS_ERR_FORMAT, "metadata %s must be one unsigned integer: %s", key, ks_errmsg());
    if (pooling >= (uint32_t)N_POOLING)
        return ks_fail(KS_ERR_FORMAT, "metadata %s = %u is not a pooling type (0 none, 1 mean, 2 cls, 3 last, 4 rank)",
                       key, pooling);
    hp->pooling = (enum model_pooling)pooling;
    snprintf(key, sizeof key, "%s.attention.causal", arch);
    bool causal = true;
    st = gguf_get_bool(f, key, &causal);
    if (st && st != KS_ERR_NOT_FOUND)
        return ks_fail(KS_ERR_FORMAT, "metadata %s must be one boolean: %s", key, ks_errmsg());
    hp->non_causal = !causal;
    return KS_OK;
}

/* Pooling as llama.cpp's build_pooling: MEAN multiplies the hidden states by a
 * vector of 1/n (so each product is rounded, then summed), CLS takes the
 * first row, LAST the last. */
void model_pool_rows(enum model_pooling p, const float *rows, int32_t n, int dim, float *out)
{
    if (p == MODEL_POOLING_CLS || p == MODEL_POOLING_LAST) {
        memcpy(out, rows + (size_t)(p == MODEL_POOLING_CLS ? 0 : n - 1) * dim, (size_t)dim * sizeof *out);
        return;
    }
    float w = 1.0f / (float)n;
    for (int i = 0; i < dim; i++) {
        float acc = 0.0f;
        for (int32_t t = 0; t < n; t++)
            acc += rows[(size_t)t * dim + i] * w;
        out[i] = acc;
    }
}

void model_embd_normalize(float *v, int n, int norm)
{
    double sum = 0.0;
    if (norm < 0) {
        sum = 1.0;
    } else if (norm == 0) {
        for (int i = 0; i < n; i++)
            sum = sum < fabs((double)v[i]) ? fabs((double)v[i]) : sum;
        sum /= 32760.0; /* the int16 range, as llama.cpp */
    } else if (norm == 2) {
        for (int i = 0; i < n; i++)
            sum += (double)v[i] * v[i];
        sum = sqrt(sum);
    } else {
        for (int i = 0; i < n; i++)
            sum += pow(fabs((double)v[i]), norm);
        sum = pow(sum, 1.0 / norm);
    }
    double scale = sum > 0.0 ? 1.0 / sum : 0.0;
    for (int i = 0; i < n; i++)
        v[i] = (float)(v[i] * scale);
}
