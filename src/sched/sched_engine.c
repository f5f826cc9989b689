/* The real engine for the scheduler: a model, its KV cache and a model
 * context, with samplers from the sample module. Kept in its own file so the
 * scheduling logic links without the model (tests use a mock engine). */
#include <stdio.h>
#include <stdlib.h>

#include "kv/kv.h"
#include "model/model.h"
#include "sample/sample.h"
#include "sched/sched.h"

/* At shutdown every cached page is queued for the disk; wait for the writer
 * after this many bytes so the bounded queue never drops one. */
enum { PERSIST_FLUSH_BYTES = 32 << 20 };

struct model_engine {
    struct model *model;
    struct kv_cache *kv;
    struct model_ctx *mctx;
    int32_t n_vocab;
    struct store *store;      /* SSD tier, borrowed; NULL without --cache-dir */
    size_t persist_pending;   /* bytes handed to the store since its last flush */
    bool persisting;
};

static ks_status me_seq_create(void *ctx, int32_t *seq_out)
{
    struct model_engine *e = ctx;
    return kv_seq_create(e->kv, seq_out);
}

static void me_seq_free(void *ctx, int32_t seq)
{
    struct model_engine *e = ctx;
    kv_seq_free(e->kv, seq);
}

static ks_status me_forward(void *ctx, const struct sched_batch *b, float *logits)
{
    struct model_engine *e = ctx;
    struct model_batch mb = {
        .n_tokens = b->n_tokens, .tokens = b->tokens, .pos = b->pos, .seq = b->seq,
        .want_logits = b->want_logits,
    };
    return model_forward(e->mctx, e->kv, &mb, logits, NULL);
}

static ks_status me_sampler_create(void *ctx, const struct sample_params *p, void **out)
{
    struct model_engine *e = ctx;
    struct sampler *smp = NULL;
    ks_status st = sample_create(p, e->n_vocab, &smp);
    *out = smp;
    return st;
}

static ks_status me_sampler_next(void *ctx, void *smp, const float *logits, const int32_t *history,
                                 int32_t n_history, struct sample_result *out)
{
    (void)ctx;
    return sample_next(smp, logits, history, n_history, out);
}

static void me_sampler_free(void *ctx, void *smp)
{
    (void)ctx;
    sample_free(smp);
}

/* Admit only while the free budget (after what the policy could demote) holds
 * the newcomer's first chunk. */
static bool me_can_admit(void *ctx, int32_t n_new_tokens)
{
    struct model_engine *e = ctx;
    struct kv_fit fit;
    kv_fit(e->kv, &fit);
    int64_t room = kv_get_config(e->kv)->policy == KV_POLICY_DYNAMIC ? fit.dynamic : fit.start;
    return room >= n_new_tokens;
}

static struct kv_cache *me_cache(void *ctx)
{
    struct model_engine *e = ctx;
    return e->kv;
}

/* ---- prefix cache ------------------------------------------------------------ */

static ks_status me_prefix_attach(void *ctx, int32_t seq, const int32_t *tokens, int32_t max_tokens, bool use_disk,
                                  double prefill_token_s, struct sched_prefix_hit *hit)
{
    struct model_engine *e = ctx;
    int32_t P = kv_get_config(e->kv)->page_tokens, n_pages = 0, n_part = 0;
    ks_status st = kv_seq_attach_pages(e->kv, seq, tokens, max_tokens, &n_pages);
    hit->ram_tokens += n_pages * P;
    (void)use_disk;
    (void)prefill_token_s;
    if (!st)
        st = kv_seq_attach_partial(e->kv, seq, tokens, max_tokens, &n_part);
    hit->ram_tokens += n_part;
    return st;
}

static void me_prefix_publish(void *ctx, int32_t seq, const int32_t *tokens, int32_t n_computed)
{
    struct model_engine *e = ctx;
    /* a page that cannot be keyed (no host memory) is only not shared */
    (void)kv_seq_publish(e->kv, seq, tokens, n_computed);
}

static void me_destroy(void *ctx)
{
    struct model_engine *e = ctx;
    model_ctx_free(e->mctx);
    kv_free(e->kv);
    free(e);
}

ks_status sched_engine_model(struct model *m, const struct kv_config *kv_cfg, int32_t max_batch_tokens,
                             struct threads_pool *pool, struct sched_engine *out)
{
    struct model_engine *e = calloc(1, sizeof *e);
    if (!e)
        return ks_fail(KS_ERR_NOMEM, "engine: out of memory");
    e->model = m;
    e->n_vocab = model_hparams(m)->n_vocab;
    ks_status st = kv_create(kv_cfg, &e->kv);
    if (!st)
        st = model_ctx_create(m, max_batch_tokens, pool, &e->mctx);
    if (st) {
        kv_free(e->kv);
        free(e);
        return st;
    }
    *out = (struct sched_engine){
        .ctx = e, .n_vocab = e->n_vocab, .seq_create = me_seq_create, .seq_free = me_seq_free,
        .forward = me_forward, .sampler_create = me_sampler_create, .sampler_next = me_sampler_next,
        .sampler_free = me_sampler_free, .can_admit = me_can_admit, .cache = me_cache, .destroy = me_destroy,
    };
    if (kv_cfg->prefix_cache) {
        out->page_tokens = kv_cfg->page_tokens;
        out->prefix_attach = me_prefix_attach;
        out->prefix_publish = me_prefix_publish;
    }
    return KS_OK;
}
