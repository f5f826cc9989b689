/* The real engine for the scheduler: a model, its KV cache and a model
 * context, with samplers from the sample module. Kept in its own file so the
 * scheduling logic links without the model (tests use a mock engine). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv/kv.h"
#include "model/model.h"
#include "sample/sample.h"
#include "sched/sched.h"
#include "store/store.h"

/* At shutdown every cached page is queued for the disk; wait for the writer
 * after this many bytes so the bounded queue never drops one. */
enum { PERSIST_FLUSH_BYTES = 32 << 20 };

struct model_engine {
    struct model *model;
    struct kv_cache *kv;
    struct model_ctx *mctx;
    int32_t n_vocab;
    struct store *store;      /* SSD tier, borrowed; NULL without --cache-dir */
    struct store_redis *redis; /* shared tier, borrowed; NULL without --cache-redis */
    struct sched_engine *draft; /* the draft model's engine (sched_engine_model_add_draft), owned; NULL: none */
    bool persisting;          /* at shutdown: every cached page goes to the store */
    size_t persist_pending;   /* bytes handed to the store since its last flush, while persisting */
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

static ks_status me_seq_fork(void *ctx, int32_t src, int32_t *seq_out)
{
    struct model_engine *e = ctx;
    return kv_seq_fork(e->kv, src, seq_out);
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

static ks_status me_forward_embd(void *ctx, const struct sched_batch *b, float *logits, float *embd)
{
    struct model_engine *e = ctx;
    struct model_batch mb = {
        .n_tokens = b->n_tokens, .tokens = b->tokens, .pos = b->pos, .seq = b->seq,
        .want_logits = b->want_logits,
    };
    return model_forward_embed(e->mctx, e->kv, &mb, b->embed, logits, NULL, embd, NULL);
}

/* Pooling the forward pass can do (model_forward_embed). */
static bool pools(const struct model *m)
{
    enum model_pooling p = model_hparams(m)->pooling;
    return p == MODEL_POOLING_MEAN || p == MODEL_POOLING_CLS || p == MODEL_POOLING_LAST;
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

static ks_status me_sampler_verify_proposal(void *ctx, void *smp, const float *logits, const int32_t *history,
                                            int32_t n_history, const struct sample_proposal *q, int32_t draft,
                                            struct sample_result *out, bool *accepted)
{
    (void)ctx;
    return sample_verify_proposal(smp, logits, history, n_history, q, draft, out, accepted);
}

static ks_status me_sampler_verify(void *ctx, void *smp, const float *logits, const int32_t *history,
                                   int32_t n_history, int32_t draft, struct sample_result *out, bool *accepted)
{
    (void)ctx;
    return sample_verify(smp, logits, history, n_history, draft, out, accepted);
}

static ks_status me_seq_truncate(void *ctx, int32_t seq, int32_t len)
{
    struct model_engine *e = ctx;
    return kv_seq_truncate(e->kv, seq, len);
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
    return fit.chunk >= n_new_tokens;
}

static struct kv_cache *me_cache(void *ctx)
{
    struct model_engine *e = ctx;
    return e->kv;
}

/* ---- prefix cache ------------------------------------------------------------ */

static struct store_key store_key_of(struct kv_key k) { return (struct store_key){k.lo, k.hi}; }

/* Is reading n bytes from disk faster than computing a page? */
static bool worth_reading(struct model_engine *e, size_t n, double prefill_token_s)
{
    double compute = prefill_token_s * kv_get_config(e->kv)->page_tokens;
    return prefill_token_s <= 0.0 || store_read_seconds(e->store, n) < compute;
}

/* Continue seq from the SSD tier, page by page, while the next page is on
 * disk, worth reading and valid. Returns the pages imported. */
static int32_t import_from_disk(struct model_engine *e, int32_t seq, const int32_t *tokens, int32_t max_tokens,
                                double prefill_token_s)
{
    int32_t P = kv_get_config(e->kv)->page_tokens, done = 0;
    struct kv_key key;
    while (e->store && kv_seq_len(e->kv, seq) + P <= max_tokens && kv_seq_next_key(e->kv, seq, tokens, &key)) {
        size_t bytes = 0;
        void *blob = NULL;
        if (!store_has(e->store, store_key_of(key), &bytes) || !worth_reading(e, bytes, prefill_token_s) ||
            store_get(e->store, store_key_of(key), &blob, &bytes) != KS_OK)
            break;
        ks_status st = kv_seq_import_page(e->kv, seq, tokens, blob, bytes);
        free(blob);
        if (st)
            break; /* the store checked its checksum; a page of another layout is simply not used */
        done++;
    }
    return done;
}

/* Continue seq from the shared tier: the run of its next pages Redis holds
 * (verified there), as far as reading beats computing, salted or not (a
 * salt seeds the chain, so tenants' keys never meet). Each page imported is
 * also kept on the SSD tier. Returns the pages imported. */
static int32_t import_from_redis(struct model_engine *e, int32_t seq, const int32_t *tokens, int32_t max_tokens,
                                 double prefill_token_s)
{
    _Static_assert(sizeof(struct kv_key) == sizeof(struct store_key), "one key, two names");
    int32_t P = kv_get_config(e->kv)->page_tokens, len = kv_seq_len(e->kv, seq);
    int32_t n = len % P || len > max_tokens ? 0 : (max_tokens - len) / P;
    /* keys[0]: the key the chain continues, keys[1 + i]: page i's */
    struct kv_key *keys = n > 0 ? malloc(((size_t)n + 1) * sizeof *keys) : NULL;
    void **blobs = keys ? calloc((size_t)n, sizeof *blobs) : NULL;
    size_t *lens = blobs ? calloc((size_t)n, sizeof *lens) : NULL;
    int32_t got = 0, done = 0;
    if (lens && kv_seq_next_keys(e->kv, seq, tokens, n, keys) == n)
        got = store_redis_get_chain(e->redis, (const struct store_key *)(keys + 1), n, prefill_token_s * P, blobs,
                                    lens);
    for (int32_t i = 0; i < got; i++) {
        /* a page of another layout is simply not used, nor anything after it */
        if (done == i && kv_seq_import_page(e->kv, seq, tokens, blobs[i], lens[i]) == KS_OK) {
            done++;
            if (e->store)
                (void)store_put(e->store, store_key_of(keys[1 + i]), store_key_of(keys[i]), (uint32_t)P, blobs[i],
                                lens[i]);
        }
        free(blobs[i]);
    }
    free(blobs);
    free(lens);
    free(keys);
    return done;
}

static ks_status me_prefix_attach(void *ctx, int32_t seq, const int32_t *tokens, int32_t max_tokens, bool use_disk,
                                  double prefill_token_s, struct sched_prefix_hit *hit)
{
    struct model_engine *e = ctx;
    int32_t P = kv_get_config(e->kv)->page_tokens, n_pages = 0, n_part = 0;
    ks_status st = kv_seq_attach_pages(e->kv, seq, tokens, max_tokens, &n_pages);
    hit->ram_tokens += n_pages * P;
    if (!st && use_disk) {
        int32_t from_disk = import_from_disk(e, seq, tokens, max_tokens, prefill_token_s);
        hit->disk_tokens += from_disk * P;
        if (from_disk > 0) {
            st = kv_seq_attach_pages(e->kv, seq, tokens, max_tokens, &n_pages);
            hit->ram_tokens += n_pages * P;
        }
    }
    if (!st && use_disk && e->redis) {
        int32_t from_redis = import_from_redis(e, seq, tokens, max_tokens, prefill_token_s);
        hit->redis_tokens += from_redis * P;
        if (from_redis > 0) {
            st = kv_seq_attach_pages(e->kv, seq, tokens, max_tokens, &n_pages);
            hit->ram_tokens += n_pages * P;
        }
    }
    if (!st)
        st = kv_seq_attach_partial(e->kv, seq, tokens, max_tokens, &n_part);
    hit->ram_tokens += n_part;
    return st;
}

static void me_prefix_publish(void *ctx, int32_t seq, const int32_t *tokens, int32_t n_computed, bool final)
{
    struct model_engine *e = ctx;
    /* a page that cannot be keyed (no host memory) is only not shared */
    if (kv_seq_publish(e->kv, seq, tokens, n_computed) == KS_OK && final)
        (void)kv_seq_publish_tail(e->kv, seq, tokens, n_computed);
}

static ks_status me_seq_set_salt(void *ctx, int32_t seq, uint64_t salt_lo, uint64_t salt_hi)
{
    struct model_engine *e = ctx;
    return kv_seq_set_salt(e->kv, seq, (struct kv_key){salt_lo, salt_hi});
}

static void on_evict(void *user, const struct kv_page_blob *b)
{
    struct model_engine *e = user;
    if (store_put(e->store, store_key_of(b->key), store_key_of(b->parent), (uint32_t)b->n_tokens, b->data, b->len) ||
        !e->persisting)
        return;
    e->persist_pending += b->len;
    if (e->persist_pending >= PERSIST_FLUSH_BYTES) {
        store_flush(e->store);
        e->persist_pending = 0;
    }
}

static void on_publish(void *user, const struct kv_page_blob *b)
{
    struct model_engine *e = user;
    /* only not shared when it fails (no memory) */
    (void)store_redis_put(e->redis, store_key_of(b->key), store_key_of(b->parent), (uint32_t)b->n_tokens, b->data,
                          b->len);
}

void sched_engine_model_set_redis(struct sched_engine *eng, struct store_redis *redis)
{
    struct model_engine *e = eng->ctx;
    e->redis = redis;
    kv_set_publish_hook(e->kv, redis ? on_publish : NULL, e);
}

static void on_key(void *user, struct kv_key key, bool held)
{
    store_events_note(user, store_key_of(key), held);
}

void sched_engine_model_set_events(struct sched_engine *eng, struct store_events *events)
{
    struct model_engine *e = eng->ctx;
    kv_set_key_hook(e->kv, events ? on_key : NULL, events);
}

void sched_engine_model_key_layout(const struct sched_engine *eng, struct kv_key_layout *out)
{
    const struct model_engine *e = eng->ctx;
    kv_key_layout(e->kv, out);
}

void sched_engine_model_set_store(struct sched_engine *eng, struct store *store)
{
    struct model_engine *e = eng->ctx;
    e->store = store;
    kv_set_evict_hook(e->kv, store ? on_evict : NULL, e);
}

static void me_destroy(void *ctx)
{
    struct model_engine *e = ctx;
    if (e->draft) {
        e->draft->destroy(e->draft->ctx);
        free(e->draft);
    }
    if (e->store) {
        e->persisting = true;
        int32_t n = kv_prefix_persist(e->kv);
        store_flush(e->store);
        if (n > 0)
            fprintf(stderr, "kvserve: %d cached KV pages written to the prefix cache on disk\n", (int)n);
    }
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
        .seq_fork = me_seq_fork, .page_tokens = kv_cfg->page_tokens, .forward = me_forward,
        .sampler_create = me_sampler_create, .sampler_next = me_sampler_next,
        .sampler_free = me_sampler_free, .sampler_verify = me_sampler_verify, .seq_truncate = me_seq_truncate,
        .sampler_verify_proposal = me_sampler_verify_proposal,
        .can_admit = me_can_admit, .cache = me_cache, .destroy = me_destroy,
        .weight_bytes = model_active_weight_bytes(m),
    };
    if (pools(m)) {
        out->n_embd = model_hparams(m)->n_embd;
        out->forward_embd = me_forward_embd;
    }
    if (kv_cfg->prefix_cache) {
        out->prefix_attach = me_prefix_attach;
        out->prefix_publish = me_prefix_publish;
        out->seq_set_salt = me_seq_set_salt;
    }
    return KS_OK;
}

ks_status sched_engine_model_draft(struct kv_cache *target_kv, struct model *draft, const struct kv_config *draft_cfg,
                                   int32_t max_batch_tokens, struct threads_pool *pool, struct sched_engine *out)
{
    struct kv_config dc = *draft_cfg;
    dc.mem_budget = kv_get_config(target_kv)->mem_budget;
    struct kv_key fp;
    memcpy(&fp, dc.fingerprint, sizeof fp);
    fp = kv_salt_mix(fp, "draft", 5);
    memcpy(dc.fingerprint, &fp, sizeof fp);
    ks_status st = sched_engine_model(draft, &dc, max_batch_tokens, pool, out);
    if (st)
        return st;
    struct model_engine *de = out->ctx;
    if ((st = kv_share_budget(target_kv, de->kv))) {
        out->destroy(out->ctx);
        return st;
    }
    out->forward_embd = NULL; /* the draft model only proposes tokens */
    out->n_embd = 0;
    return KS_OK;
}

ks_status sched_engine_model_add_draft(struct sched_engine *eng, struct model *draft, const struct kv_config *draft_cfg,
                                       int32_t max_batch_tokens, struct threads_pool *pool)
{
    struct model_engine *e = eng->ctx;
    if (e->draft || eng->draft)
        return ks_fail(KS_ERR_STATE, "engine: it has a draft model already");
    struct sched_engine *d = calloc(1, sizeof *d);
    if (!d)
        return ks_fail(KS_ERR_NOMEM, "engine: out of memory");
    ks_status st = sched_engine_model_draft(e->kv, draft, draft_cfg, max_batch_tokens, pool, d);
    if (st) {
        free(d);
        return st;
    }
    e->draft = d;
    eng->draft = d;
    return KS_OK;
}
