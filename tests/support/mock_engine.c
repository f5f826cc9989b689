#include "support/mock_engine.h"

#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include "kv/kv.h"
#include "support/deadline.h"

struct mock_engine {
    struct mock_engine_config cfg;
    struct kv_cache *kv;       /* NULL without cfg.kv_pages */
    /* held by a step and by the test thread's calls (stats, watch) */
    pthread_mutex_t mu;
    int32_t **hist;            /* (max_seqs, max_ctx): the tokens fed to each sequence */
    int32_t *len;              /* (max_seqs) */
    int32_t *shared;           /* (max_seqs) tokens a fork shares with its source (not counted in used) */
    int32_t *add;              /* (max_seqs) a step's tokens per sequence, scratch */
    bool *live;                /* (max_seqs) */
    struct mock_engine_stats st;
    int32_t watch_first, watch_len;
    atomic_bool hold;
};

int32_t mock_next_token(const struct mock_engine_config *cfg, const int32_t *history, int32_t n)
{
    int32_t p = cfg->repeat_period;
    if (p > 0 && n >= p && (cfg->surprise_every <= 0 || n % cfg->surprise_every != 0))
        return history[n - p];
    uint32_t h = 2166136261u;
    for (int32_t i = 0; i < n; i++)
        h = (h ^ (uint32_t)history[i]) * 16777619u;
    return cfg->first_token + (int32_t)(h % (uint32_t)(cfg->n_vocab - cfg->first_token));
}

void mock_engine_generate(const struct mock_engine_config *cfg, const int32_t *prompt, int32_t n_prompt,
                          int32_t n_gen, int32_t *out)
{
    int32_t *all = malloc((size_t)(n_prompt + n_gen) * sizeof *all);
    assert_non_null(all);
    memcpy(all, prompt, (size_t)n_prompt * sizeof *all);
    for (int32_t i = 0; i < n_gen; i++)
        out[i] = all[n_prompt + i] = mock_next_token(cfg, all, n_prompt + i);
    free(all);
}

/* ---- the engine's functions ------------------------------------------------------ */

static ks_status m_seq_create(void *ctx, int32_t *out)
{
    struct mock_engine *m = ctx;
    pthread_mutex_lock(&m->mu);
    for (int i = 0; i < m->cfg.max_seqs; i++)
        if (!m->live[i]) {
            m->live[i] = true;
            m->len[i] = 0;
            m->st.n_live++;
            pthread_mutex_unlock(&m->mu);
            *out = i;
            return KS_OK;
        }
    pthread_mutex_unlock(&m->mu);
    return ks_fail(KS_ERR_KV_FULL, "mock: no sequence slots");
}

static void m_seq_free(void *ctx, int32_t seq)
{
    struct mock_engine *m = ctx;
    pthread_mutex_lock(&m->mu);
    assert_true(seq >= 0 && seq < m->cfg.max_seqs && m->live[seq]);
    m->live[seq] = false;
    m->st.used -= m->len[seq] - m->shared[seq];
    m->len[seq] = m->shared[seq] = 0;
    m->st.n_live--;
    pthread_mutex_unlock(&m->mu);
}

static ks_status m_seq_fork(void *ctx, int32_t src, int32_t *out)
{
    struct mock_engine *m = ctx;
    ks_status st = m_seq_create(ctx, out);
    if (st)
        return st;
    pthread_mutex_lock(&m->mu);
    assert_true(src >= 0 && src < m->cfg.max_seqs && m->live[src]);
    memcpy(m->hist[*out], m->hist[src], (size_t)m->len[src] * sizeof *m->hist[src]);
    m->len[*out] = m->shared[*out] = m->len[src];
    m->st.forks++;
    pthread_mutex_unlock(&m->mu);
    return KS_OK;
}

/* Cut seq back to len tokens (the scheduler drops rejected drafts). */
static ks_status m_seq_truncate(void *ctx, int32_t seq, int32_t len)
{
    struct mock_engine *m = ctx;
    pthread_mutex_lock(&m->mu);
    assert_true(seq >= 0 && seq < m->cfg.max_seqs && m->live[seq]);
    assert_true(len >= 0 && len <= m->len[seq]);
    int32_t shared = m->shared[seq] < len ? m->shared[seq] : len;
    m->st.used -= (m->len[seq] - m->shared[seq]) - (len - shared);
    m->st.truncations += len < m->len[seq];
    m->len[seq] = len;
    m->shared[seq] = shared;
    pthread_mutex_unlock(&m->mu);
    return KS_OK;
}

/* One step of the "model", with m->mu held. All or nothing: a step that does
 * not fit changes no sequence. */
static ks_status m_forward_locked(struct mock_engine *m, const struct sched_batch *b, float *logits)
{
    const int n_seqs = m->cfg.max_seqs;
    const int32_t V = m->cfg.n_vocab;
    int32_t *add = m->add;
    memset(add, 0, (size_t)n_seqs * sizeof *add);
    for (int32_t i = 0; i < b->n_tokens; i++) {
        int32_t s = b->seq[i];
        assert_true(s >= 0 && s < n_seqs && m->live[s]);
        if (b->pos[i] != m->len[s] + add[s])
            m->st.bad_positions++;
        add[s]++;
        assert_true(m->len[s] + add[s] <= m->cfg.max_ctx);
    }
    if (m->cfg.capacity > 0 && m->st.used + b->n_tokens > m->cfg.capacity)
        return ks_fail(KS_ERR_KV_FULL, "mock cache full");
    if (b->n_tokens > m->st.max_batch_seen)
        m->st.max_batch_seen = b->n_tokens;
    for (int s = 0; s < n_seqs; s++)
        if (add[s] > m->st.max_chunk_seen)
            m->st.max_chunk_seen = add[s];
    int32_t row = 0;
    for (int32_t i = 0; i < b->n_tokens; i++) {
        int32_t s = b->seq[i];
        m->hist[s][m->len[s]++] = b->tokens[i];
        m->st.used++;
        m->st.fed++;
        if (b->want_logits[i]) {
            float *l = logits + (size_t)row++ * V;
            memset(l, 0, (size_t)V * sizeof *l);
            l[mock_next_token(&m->cfg, m->hist[s], m->len[s])] = 10.0f;
        }
    }
    for (int s = 0; s < n_seqs; s++)
        if (m->watch_len > 0 && m->live[s] && m->len[s] > add[s] && m->hist[s][0] == m->watch_first &&
            m->len[s] - add[s] < m->watch_len) {
            if (add[s] == 0)
                m->st.watch_idle_steps++;
            else
                m->st.watch_steps++;
        }
    m->st.steps++;
    return KS_OK;
}

static ks_status m_forward(void *ctx, const struct sched_batch *b, float *logits)
{
    struct mock_engine *m = ctx;
    /* On the scheduler's thread, where cmocka cannot fail a test: a hold the
     * test never releases fails the step instead, and so the request. */
    struct timespec deadline = ks_deadline_in(KS_WAIT_SECONDS);
    while (atomic_load(&m->hold))
        if (ks_deadline_passed(&deadline))
            return ks_fail(KS_ERR_STATE, "mock: held for %d s", KS_WAIT_SECONDS);
        else
            usleep(200);
    pthread_mutex_lock(&m->mu);
    ks_status st = m_forward_locked(m, b, logits);
    pthread_mutex_unlock(&m->mu);
    if (m->cfg.step_sleep_us)
        usleep(m->cfg.step_sleep_us);
    return st;
}

/* The embedding sequences of b, in the order of their first entries: (count, sum of tokens, 0...). */
static void m_embed_rows(struct mock_engine *m, const struct sched_batch *b, float *embd)
{
    int32_t row = 0;
    for (int32_t i = 0; i < b->n_tokens; i++) {
        if (!b->embed[i] || (i > 0 && b->embed[i - 1] && b->seq[i - 1] == b->seq[i]))
            continue;
        float *v = embd + (size_t)row++ * m->cfg.n_embd;
        memset(v, 0, (size_t)m->cfg.n_embd * sizeof *v);
        m->st.bad_embeds += b->pos[i] != 0;
        for (int32_t k = i; k < b->n_tokens && b->seq[k] == b->seq[i]; k++) {
            v[0] += 1.0f;
            if (m->cfg.n_embd > 1)
                v[1] += (float)b->tokens[k];
        }
        m->st.embedded++;
    }
}

static ks_status m_forward_embd(void *ctx, const struct sched_batch *b, float *logits, float *embd)
{
    struct mock_engine *m = ctx;
    ks_status st = m_forward(ctx, b, logits);
    if (st)
        return st;
    pthread_mutex_lock(&m->mu);
    m_embed_rows(m, b, embd);
    pthread_mutex_unlock(&m->mu);
    return KS_OK;
}

static ks_status m_sampler_create(void *ctx, const struct sample_params *p, void **out)
{
    (void)ctx;
    *out = malloc(sizeof *p); /* an allocation on the submitting thread, as the real sampler has */
    return *out ? KS_OK : ks_fail(KS_ERR_NOMEM, "sampler: out of memory");
}

/* Greedy; the sampled token's logprob is -0.5, the k-th alternative's -0.5 - k. */
static ks_status m_sampler_next(void *ctx, void *smp, const float *logits, const int32_t *hist, int32_t n,
                                struct sample_result *out)
{
    (void)smp;
    (void)hist;
    (void)n;
    struct mock_engine *m = ctx;
    int32_t best = 0;
    for (int32_t v = 1; v < m->cfg.n_vocab; v++)
        if (logits[v] > logits[best])
            best = v;
    memset(out, 0, sizeof *out);
    out->token = best;
    out->logprob = -0.5f;
    out->n_top = m->cfg.n_top;
    int32_t alt = m->cfg.top_first;
    for (int k = 0; k < m->cfg.n_top; k++) {
        if (k > 0 && alt == best)
            alt++;
        out->top[k].token = k == 0 ? best : alt++;
        out->top[k].logprob = -0.5f - (float)k;
    }
    return KS_OK;
}

static ks_status m_sampler_verify(void *ctx, void *smp, const float *logits, const int32_t *hist, int32_t n,
                                  int32_t draft, struct sample_result *out, bool *accepted)
{
    ks_status st = m_sampler_next(ctx, smp, logits, hist, n, out);
    *accepted = !st && out->token == draft;
    return st;
}

static void m_sampler_free(void *ctx, void *smp)
{
    (void)ctx;
    free(smp);
}

static struct kv_cache *m_cache(void *ctx)
{
    return ((struct mock_engine *)ctx)->kv;
}

static void m_destroy(void *ctx)
{
    mock_engine_free(ctx);
}

/* ---- life and observation ---------------------------------------------------------- */

ks_status mock_engine_create(const struct mock_engine_config *cfg, struct mock_engine **out)
{
    assert_true(cfg->n_vocab > cfg->first_token && cfg->first_token >= 0);
    assert_true(cfg->max_seqs > 0 && cfg->max_ctx > 0);
    assert_true(cfg->n_top >= 0 && cfg->n_top <= SAMPLE_MAX_LOGPROBS);
    assert_true(cfg->n_top == 0 || cfg->top_first + cfg->n_top <= cfg->n_vocab);
    struct mock_engine *m = calloc(1, sizeof *m);
    if (!m)
        return ks_fail(KS_ERR_NOMEM, "mock: out of memory");
    m->cfg = *cfg;
    pthread_mutex_init(&m->mu, NULL);
    size_t n = (size_t)cfg->max_seqs;
    m->hist = calloc(n, sizeof *m->hist);
    m->len = calloc(n, sizeof *m->len);
    m->shared = calloc(n, sizeof *m->shared);
    m->add = calloc(n, sizeof *m->add);
    m->live = calloc(n, sizeof *m->live);
    bool ok = m->hist && m->len && m->shared && m->add && m->live;
    for (size_t i = 0; ok && i < n; i++)
        ok = (m->hist[i] = calloc((size_t)cfg->max_ctx, sizeof(int32_t))) != NULL;
    if (!ok) {
        mock_engine_free(m);
        return ks_fail(KS_ERR_NOMEM, "mock: out of memory");
    }
    if (cfg->kv_pages > 0) {
        struct kv_config kc;
        kv_config_default(&kc);
        kc.n_layer = 2;
        kc.n_kv_head = 2;
        kc.head_dim = 64;
        kc.mem_budget = (size_t)cfg->kv_pages * kv_page_bytes(&kc, QUANT_F16, QUANT_F16);
        ks_status st = kv_create(&kc, &m->kv);
        if (st) {
            mock_engine_free(m);
            return st;
        }
    }
    *out = m;
    return KS_OK;
}

void mock_engine_free(struct mock_engine *m)
{
    if (!m)
        return;
    kv_free(m->kv);
    for (int i = 0; m->hist && i < m->cfg.max_seqs; i++)
        free(m->hist[i]);
    free(m->hist);
    free(m->len);
    free(m->shared);
    free(m->add);
    free(m->live);
    pthread_mutex_destroy(&m->mu);
    free(m);
}

struct sched_engine mock_engine_sched(struct mock_engine *m, bool owned)
{
    struct sched_engine e = {
        .ctx = m, .n_vocab = m->cfg.n_vocab, .seq_create = m_seq_create, .seq_free = m_seq_free,
        .seq_fork = m_seq_fork, .forward = m_forward, .sampler_create = m_sampler_create, .sampler_next = m_sampler_next,
        .sampler_free = m_sampler_free, .sampler_verify = m_sampler_verify, .seq_truncate = m_seq_truncate,
        .cache = m->kv ? m_cache : NULL, .destroy = owned ? m_destroy : NULL,
    };
    if (m->cfg.n_embd > 0) {
        e.n_embd = m->cfg.n_embd;
        e.forward_embd = m_forward_embd;
    }
    return e;
}

void mock_engine_stats(struct mock_engine *m, struct mock_engine_stats *out)
{
    pthread_mutex_lock(&m->mu);
    *out = m->st;
    pthread_mutex_unlock(&m->mu);
}

void mock_engine_hold(struct mock_engine *m, bool hold)
{
    atomic_store(&m->hold, hold);
}

void mock_engine_watch(struct mock_engine *m, int32_t first, int32_t len)
{
    pthread_mutex_lock(&m->mu);
    m->watch_first = first;
    m->watch_len = len;
    pthread_mutex_unlock(&m->mu);
}
