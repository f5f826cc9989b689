/* The scheduler thread and its step: admit, build one batch (decode first,
 * then prefill chunks), run it (shrinking or preempting on KS_ERR_KV_FULL),
 * sample, deliver events. */
#include "sched/sched.h"
#include "sched/sched_cost.h"

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

const double sched_hist_bounds[SCHED_HIST_BUCKETS] = {
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, INFINITY,
};

struct req {
    uint64_t id;
    int32_t *tokens;          /* (cap) prompt then generated */
    int32_t n_tokens, cap;
    int32_t n_prompt, max_tokens, n_generated;
    int32_t n_computed;       /* tokens whose K/V are in the cache */
    int32_t n_cached;         /* prompt tokens the prefix cache served at the first admission */
    int32_t seq;              /* -1 while holding no pages */
    uint64_t admit_order;
    void *sampler;
    sched_event_fn on_event;
    void *user;
    double t_submit, t_last;
    bool ignore_eog;
    uint64_t salt_lo, salt_hi; /* its cache salt, 0 0: none */
    bool no_share;            /* salted, and the engine cannot keep salts: it uses no prefix cache */
    char error_text[256];     /* error points here when it says why (a sampler's message) */
    bool skip_step;           /* this step's prefill chunk was dropped */
    bool needs_lookup;        /* admitted, the prefix cache not asked yet */
    bool looked_up;           /* the first admission's lookup is done (n_cached is set) */
    bool dedup_wait;          /* an older request is computing this one's next page */
    enum sched_finish finish; /* set when done */
    const char *error;
    /* speculation */
    int32_t spec_max, spec_min; /* this request's draft bounds (spec_max 0: off) */
    int32_t pool_fed;         /* tokens[0, pool_fed) are in the scheduler's n-gram pool */
    struct spec_adapt adapt;  /* its acceptance, for the draft length */
    int32_t draft[SPEC_DRAFT_LIMIT]; /* (n_draft) this step's drafts, after its last token */
    int32_t n_draft;
    int32_t shadow;           /* not drafting: the token a 1-token draft proposed, to learn from; -1 none */
    int32_t n_drafted, n_accepted; /* totals */
    struct sched_draft_seq dseq; /* SPEC_DRAFT: its sequence in the draft model's cache */
    int32_t draft_at;         /* SPEC_DRAFT: n_generated when it last had a draft job as a decoder */
    int32_t dprop[SPEC_DRAFT_LIMIT]; /* (n_dprop) SPEC_DRAFT: this step's proposals of the draft model */
    int32_t n_dprop;
    struct sample_proposal dq[SPEC_DRAFT_LIMIT]; /* (n_dprop) SPEC_DRAFT: the q each was drawn from */
    bool draft_q;             /* this step's drafts are dprop's, verified against dq */
    struct sample_params draft_sampling; /* SPEC_DRAFT: what shapes q (temperature, top-k, top-p, min-p) */
    uint64_t draft_rng;       /* SPEC_DRAFT: the stream its sampled drafts are drawn from */
    struct req **forks;       /* the other choices of sched_submit_n, until they fork this one */
    int n_forks;
    uint64_t check_pass;      /* the last sched_check that found it (to find it twice) */
    bool embed;               /* an embedding request (sched_request.embed) */
    float *embd;              /* (engine n_embd) its embedding, once computed */
    /* Written by sched_cancel's thread under mu, read by the scheduler's. Atomic
     * and apart from the flags above: build_batch reads those off the lock
     * during a step, and the compiler merges such reads of neighbouring bools
     * into one wide load. */
    _Atomic bool cancelled;
};

struct hook {
    sched_hook_fn fn;
    sched_slice_fn slice;     /* a sliced job (sched_run_sliced) instead of fn */
    void *user;
    bool done, stopped;       /* stopped: the scheduler ended before the job did */
    struct hook *next;
};

struct sched {
    struct sched_config cfg;
    int32_t eog[16];
    struct sched_engine eng;

    pthread_mutex_t mu;
    pthread_cond_t work;      /* scheduler waits for submissions/hooks */
    pthread_cond_t hook_done;
    pthread_t thread;
    bool thread_started, stop, draining, cancel_all;

    struct req **waiting;     /* FIFO; preempted requests go back to the front */
    int n_waiting, cap_waiting;
    struct req **active;      /* admission order */
    int n_active;
    struct hook *hooks;
    struct hook *jobs;        /* sliced jobs: one slice of each between two steps */
    uint64_t next_id, next_admit;

    /* step cost model (scheduler thread only), see sched_cost.h */
    struct sched_cost cost;
    int32_t step_prefill;     /* prefill tokens in the step being run */
    int step_decode;          /* decode entries in the step being run */
    int32_t step_limit;       /* the cost model's prefill limit for that step */
    int32_t step_draft;       /* draft tokens in the step being run */
    bool no_drafts;           /* the step did not fit with its drafts: retry without */
    int32_t cap_rows;         /* logits rows of a step: one per active sequence plus drafts */
    FILE *trace;              /* KVSERVE_SCHED_TRACE=1: one line per step on stderr */

    /* step scratch (scheduler thread only) */
    int32_t cap_batch;
    int32_t *b_tokens, *b_pos, *b_seq;
    bool *b_logits;
    bool *b_embed;            /* entry of an embedding request */
    float *embd;              /* (parallel, engine n_embd) pooled rows of a step's embedding requests */
    struct req **b_owner;     /* request of each entry with logits */
    struct req **forked;      /* (parallel) the choices one fork_choices started */
    float *logits;

    struct sched_stats st;
    uint64_t check_passes;    /* sched_check runs, which mark each request they find */
    struct spec_pool *pool;   /* SPEC_NGRAM_POOL's shared table (scheduler thread only) */
    struct sched_drafter *drafter; /* SPEC_DRAFT: the draft model's passes (scheduler thread only) */
    struct sched_draft_job *draft_jobs; /* (parallel) a pass's jobs */
    uint64_t shadow_checks;   /* scheduler thread: st.spec_shadow_checks before it is copied */
    uint64_t draft_spent;     /* scheduler thread: draft tokens computed for requests under the allowance */
    struct req **job_req;     /* (parallel) the request of each job */
};

/* Debug builds check the invariants after every change (sched_check). */
#ifndef KS_SCHED_CHECK
#ifdef NDEBUG
#define KS_SCHED_CHECK 0
#else
#define KS_SCHED_CHECK 1
#endif
#endif
#if KS_SCHED_CHECK
static void sched_debug_check(struct sched *s, const char *change);
#define SCHED_DEBUG_CHECK(s, change) sched_debug_check(s, change)
#else
#define SCHED_DEBUG_CHECK(s, change) ((void)0)
#endif

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void hist_add(struct sched_hist *h, double seconds)
{
    int b = 0;
    while (b < SCHED_HIST_BUCKETS - 1 && seconds > sched_hist_bounds[b])
        b++;
    h->counts[b]++;
    h->n++;
    h->sum += seconds;
}

void sched_config_default(struct sched_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->parallel = 16;
    cfg->max_batch_tokens = 512;
    cfg->prefill_chunk = 256;
    cfg->max_itl_ratio = 1.5f;
    cfg->ctx_size = 4096;
    cfg->max_queue = 256;
    cfg->spec_type = SPEC_NONE;
    cfg->draft_max = 16;
    cfg->draft_min = 0;
    cfg->pool_n = SPEC_POOL_N_DEFAULT;
    cfg->pool_bytes = SPEC_POOL_BYTES_DEFAULT;
}

/* ---- request lifetime ---------------------------------------------------- */

static void req_free(struct sched *s, struct req *r)
{
    if (!r)
        return;
    if (r->seq >= 0)
        s->eng.seq_free(s->eng.ctx, r->seq);
    if (r->dseq.seq >= 0)
        sched_drafter_release(s->drafter, &r->dseq, r->tokens, r->n_tokens, false);
    if (r->sampler)
        s->eng.sampler_free(s->eng.ctx, r->sampler);
    for (int i = 0; i < r->n_forks; i++)
        req_free(s, r->forks[i]);
    free(r->forks);
    free(r->tokens);
    free(r->embd);
    free(r);
}

/* The final event of r, and of the choices still waiting to fork it: they
 * end as it does. */
static void req_emit_final(struct req *r)
{
    struct sched_event ev = {
        .id = r->id, .token = -1, .finish = r->finish, .n_prompt = r->n_prompt,
        .n_generated = r->n_generated, .n_cached = r->n_cached, .n_drafted = r->n_drafted,
        .n_accepted = r->n_accepted, .error = r->error,
        .embd = r->embed && r->finish == SCHED_FINISH_STOP ? r->embd : NULL,
    };
    r->on_event(r->user, &ev);
    for (int i = 0; i < r->n_forks; i++) {
        struct req *f = r->forks[i];
        f->finish = r->finish;
        f->error = r->error;
        f->n_cached = r->n_cached;
        req_emit_final(f);
    }
}

static void list_remove(struct req **list, int *n, int i)
{
    memmove(list + i, list + i + 1, (size_t)(*n - i - 1) * sizeof *list);
    (*n)--;
}

static ks_status waiting_push(struct sched *s, struct req *r, bool front)
{
    if (s->n_waiting == s->cap_waiting) {
        int cap = s->cap_waiting ? 2 * s->cap_waiting : 64;
        struct req **w = realloc(s->waiting, (size_t)cap * sizeof *w);
        if (!w)
            return ks_fail(KS_ERR_NOMEM, "scheduler queue: out of memory");
        s->waiting = w;
        s->cap_waiting = cap;
    }
    if (front) {
        memmove(s->waiting + 1, s->waiting, (size_t)s->n_waiting * sizeof *s->waiting);
        s->waiting[0] = r;
    } else {
        s->waiting[s->n_waiting] = r;
    }
    s->n_waiting++;
    return KS_OK;
}

/* ---- submission API (any thread) ----------------------------------------- */

/* A request's draft bound: its own when set and not -1, else the config's. */
static int32_t draft_bound(bool set, int32_t mine, int32_t config)
{
    return set && mine != -1 ? mine : config;
}

static ks_status check_request(const struct sched *s, const struct sched_request *rq)
{
    if (!rq || !rq->prompt || rq->n_prompt < 1 || !rq->on_event)
        return ks_fail(KS_ERR_INVALID_ARG, "request needs a non-empty prompt and an event callback");
    if (rq->max_tokens < 0)
        return ks_fail(KS_ERR_INVALID_ARG, "max_tokens must not be negative (got %d)", rq->max_tokens);
    if (rq->embed && rq->n_prompt > s->cfg.ctx_size) /* an embedding generates nothing: it may fill the context */
        return ks_fail(KS_ERR_RANGE, "the input has %d tokens but the context holds %d", rq->n_prompt,
                       s->cfg.ctx_size);
    if (!rq->embed && rq->n_prompt >= s->cfg.ctx_size)
        return ks_fail(KS_ERR_RANGE, "the prompt has %d tokens but the context holds %d (leave room for one generated token)",
                       rq->n_prompt, s->cfg.ctx_size);
    if (rq->embed && (!s->eng.forward_embd || s->eng.n_embd < 1))
        return ks_fail(KS_ERR_UNSUPPORTED, "this model computes no embeddings (its pooling must be mean, cls or last)");
    int32_t one_step = s->cfg.max_batch_tokens - s->cfg.parallel + 1;
    if (rq->embed && rq->n_prompt > one_step)
        return ks_fail(KS_ERR_RANGE,
                       "the input has %d tokens but an embedding is computed in one step, which has room for %d "
                       "(raise --max-batch-tokens or lower --parallel)", rq->n_prompt, one_step);
    int32_t n_max = draft_bound(rq->speculative.set, rq->speculative.n_max, s->cfg.draft_max);
    int32_t n_min = draft_bound(rq->speculative.set, rq->speculative.n_min, s->cfg.draft_min);
    if (n_max < 0 || n_max > SPEC_DRAFT_LIMIT || n_min < 0 || (n_max > 0 && n_min > n_max))
        return ks_fail(KS_ERR_INVALID_ARG,
                       "speculative.n_max must be in 0..%d and n_min in 0..n_max (got n_max %d, n_min %d with the server's defaults)",
                       SPEC_DRAFT_LIMIT, n_max, n_min);
    for (int32_t i = 0; i < rq->n_prompt; i++)
        if (rq->prompt[i] < 0 || rq->prompt[i] >= s->eng.n_vocab)
            return ks_fail(KS_ERR_INVALID_ARG, "prompt token %d at index %d is outside the vocabulary (0..%d)",
                           rq->prompt[i], i, s->eng.n_vocab - 1);
    return KS_OK;
}

static ks_status req_new(struct sched *s, const struct sched_request *rq, const struct sched_choice *ch,
                         struct req **out)
{
    struct req *r = calloc(1, sizeof *r);
    if (!r)
        return ks_fail(KS_ERR_NOMEM, "request: out of memory");
    int64_t want = (int64_t)rq->n_prompt + (rq->embed ? 0 : rq->max_tokens);
    r->cap = (int32_t)(want < s->cfg.ctx_size ? want : s->cfg.ctx_size);
    r->tokens = malloc((size_t)r->cap * sizeof *r->tokens);
    if (!r->tokens) {
        free(r);
        return ks_fail(KS_ERR_NOMEM, "request: out of memory");
    }
    memcpy(r->tokens, rq->prompt, (size_t)rq->n_prompt * sizeof *r->tokens);
    r->n_tokens = r->n_prompt = rq->n_prompt;
    r->max_tokens = rq->embed ? 0 : rq->max_tokens;
    r->embed = rq->embed;
    if (r->embed && !(r->embd = malloc((size_t)s->eng.n_embd * sizeof *r->embd))) {
        req_free(s, r);
        return ks_fail(KS_ERR_NOMEM, "request: out of memory");
    }
    r->ignore_eog = rq->ignore_eog;
    r->salt_lo = rq->cache_salt.lo;
    r->salt_hi = rq->cache_salt.hi;
    r->seq = -1;
    sched_draft_seq_init(&r->dseq);
    bool spec = s->cfg.spec_type != SPEC_NONE;
    r->spec_max = spec ? draft_bound(rq->speculative.set, rq->speculative.n_max, s->cfg.draft_max) : 0;
    r->spec_min = spec && r->spec_max > 0 ? draft_bound(rq->speculative.set, rq->speculative.n_min, s->cfg.draft_min) : 0;
    spec_adapt_init(&r->adapt, s->cfg.spec_type);
    r->shadow = -1;
    sample_params_default(&r->draft_sampling);
    r->draft_sampling.temp = ch->sampling.temp;
    r->draft_sampling.top_k = ch->sampling.top_k;
    r->draft_sampling.top_p = ch->sampling.top_p;
    r->draft_sampling.min_p = ch->sampling.min_p;
    r->draft_rng = (ch->sampling.seed ^ 0xD1B54A32D192ED03ull) | 1; /* its own stream, never the sampler's */
    r->on_event = rq->on_event;
    r->user = ch->user;
    r->t_submit = now_seconds();
    ks_status st = r->embed ? KS_OK : s->eng.sampler_create(s->eng.ctx, &ch->sampling, &r->sampler);
    if (st) {
        req_free(s, r);
        return st;
    }
    *out = r;
    return KS_OK;
}

/* The first choice, holding the other n - 1 as its forks. */
static ks_status group_new(struct sched *s, const struct sched_request *rq, const struct sched_choice *choices, int n,
                           struct req **out)
{
    struct req *lead = NULL;
    ks_status st = req_new(s, rq, &choices[0], &lead);
    if (!st && n > 1 && !(lead->forks = malloc((size_t)(n - 1) * sizeof *lead->forks)))
        st = ks_fail(KS_ERR_NOMEM, "request: out of memory");
    for (int i = 1; !st && i < n; i++)
        if (!(st = req_new(s, rq, &choices[i], &lead->forks[lead->n_forks])))
            lead->n_forks++;
    if (st) {
        req_free(s, lead);
        return st;
    }
    *out = lead;
    return KS_OK;
}

ks_status sched_submit_n(struct sched *s, const struct sched_request *rq, const struct sched_choice *choices, int n,
                         uint64_t *ids_out)
{
    if (!choices || n < 1 || n > s->cfg.parallel)
        return ks_fail(KS_ERR_RANGE, "%d choices cannot run: between 1 and --parallel (%d) sequences run at once", n,
                       s->cfg.parallel);
    ks_status st = check_request(s, rq);
    if (!st && rq->embed && n > 1)
        st = ks_fail(KS_ERR_INVALID_ARG, "an embedding request has one choice (got %d)", n);
    struct req *r = NULL;
    if (st || (st = group_new(s, rq, choices, n, &r)))
        return st;

    pthread_mutex_lock(&s->mu);
    if (s->draining || s->stop)
        st = ks_fail(KS_ERR_STATE, "the server is shutting down");
    else if (s->n_waiting >= s->cfg.max_queue)
        st = ks_fail(KS_ERR_STATE, "the queue is full (%d waiting); retry later", s->n_waiting);
    else
        st = waiting_push(s, r, false);
    if (!st) {
        r->id = ++s->next_id;
        for (int i = 0; i < r->n_forks; i++)
            r->forks[i]->id = ++s->next_id;
        for (int i = 0; ids_out && i < n; i++)
            ids_out[i] = i == 0 ? r->id : r->forks[i - 1]->id;
        pthread_cond_signal(&s->work);
        SCHED_DEBUG_CHECK(s, "sched_submit_n");
    }
    pthread_mutex_unlock(&s->mu);
    if (st)
        req_free(s, r);
    return st;
}

ks_status sched_submit(struct sched *s, const struct sched_request *rq, uint64_t *id_out)
{
    if (!rq)
        return check_request(s, rq);
    struct sched_choice one = {rq->sampling, rq->user};
    return sched_submit_n(s, rq, &one, 1, id_out);
}

/* Mark request id cancelled if r or one of its forks is it. */
static void mark_cancelled(struct req *r, uint64_t id)
{
    if (r->id == id)
        r->cancelled = true;
    for (int i = 0; i < r->n_forks; i++)
        if (r->forks[i]->id == id)
            r->forks[i]->cancelled = true;
}

void sched_cancel(struct sched *s, uint64_t id)
{
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < s->n_waiting; i++)
        mark_cancelled(s->waiting[i], id);
    for (int i = 0; i < s->n_active; i++)
        mark_cancelled(s->active[i], id);
    pthread_cond_signal(&s->work);
    pthread_mutex_unlock(&s->mu);
}

void sched_drain(struct sched *s)
{
    pthread_mutex_lock(&s->mu);
    s->draining = true;
    pthread_mutex_unlock(&s->mu);
}

void sched_cancel_all(struct sched *s)
{
    pthread_mutex_lock(&s->mu);
    s->cancel_all = true;
    pthread_cond_signal(&s->work);
    pthread_mutex_unlock(&s->mu);
}

/* Queue h on *list for the scheduler thread and wait until it is done. */
static ks_status run_hook(struct sched *s, struct hook **list, struct hook *h)
{
    pthread_mutex_lock(&s->mu);
    if (s->stop) {
        pthread_mutex_unlock(&s->mu);
        return ks_fail(KS_ERR_STATE, "the scheduler has stopped");
    }
    struct hook **tail = list;
    while (*tail)
        tail = &(*tail)->next;
    *tail = h;
    pthread_cond_signal(&s->work);
    while (!h->done)
        pthread_cond_wait(&s->hook_done, &s->mu);
    pthread_mutex_unlock(&s->mu);
    return KS_OK;
}

ks_status sched_between_steps(struct sched *s, sched_hook_fn fn, void *user)
{
    struct hook h = {.fn = fn, .user = user};
    return run_hook(s, &s->hooks, &h);
}

ks_status sched_run_sliced(struct sched *s, sched_slice_fn fn, void *user)
{
    struct hook h = {.slice = fn, .user = user};
    ks_status st = run_hook(s, &s->jobs, &h);
    if (st)
        return st;
    return h.stopped ? ks_fail(KS_ERR_STATE, "the scheduler stopped before the work was done") : KS_OK;
}

void sched_get_stats(struct sched *s, struct sched_stats *out)
{
    pthread_mutex_lock(&s->mu);
    *out = s->st;
    out->n_running = s->n_active;
    out->n_waiting = s->n_waiting;
    pthread_mutex_unlock(&s->mu);
}

static void req_info(const struct req *r, bool running, struct sched_request_info *o)
{
    o->id = r->id;
    o->seq = r->seq;
    o->n_prompt = r->n_prompt;
    o->n_generated = r->n_generated;
    o->n_computed = r->n_computed;
    o->n_cached = r->n_cached;
    o->running = running;
}

int sched_list_requests(struct sched *s, struct sched_request_info *out, int cap)
{
    pthread_mutex_lock(&s->mu);
    int n = 0;
    for (int i = 0; i < s->n_active; i++, n++)
        if (n < cap)
            req_info(s->active[i], true, &out[n]);
    for (int i = 0; i < s->n_waiting; i++, n++)
        if (n < cap)
            req_info(s->waiting[i], false, &out[n]);
    pthread_mutex_unlock(&s->mu);
    return n;
}

/* ---- scheduler thread: bookkeeping (called with mu held) ------------------- */

/* Free a request's pages; what it computed stays in the prefix cache. */
static void release_seq(struct sched *s, struct req *r)
{
    if (r->seq < 0)
        return;
    if (s->eng.prefix_publish && !r->no_share && !r->embed)
        s->eng.prefix_publish(s->eng.ctx, r->seq, r->tokens, r->n_computed, true);
    s->eng.seq_free(s->eng.ctx, r->seq);
    r->seq = -1;
    if (r->dseq.seq >= 0)
        sched_drafter_release(s->drafter, &r->dseq, r->tokens, r->n_tokens, !r->no_share);
    sched_draft_seq_init(&r->dseq); /* a window that never got its sequence starts over too */
}

/* Choices cancelled before they forked leave their group now. */
static int collect_cancelled_forks(struct sched *s, struct req *lead, struct req **done, int cap)
{
    int n = 0;
    for (int i = lead->n_forks - 1; i >= 0 && n < cap && !s->cancel_all; i--) {
        struct req *f = lead->forks[i];
        if (f->cancelled) {
            f->finish = SCHED_FINISH_CANCELLED;
            f->n_cached = lead->n_cached;
            done[n++] = f;
            list_remove(lead->forks, &lead->n_forks, i);
        }
    }
    return n;
}

/* A cancelled first choice whose forks still want the prompt hands them its
 * pages: forks[0] takes its place (nothing is generated before the fork, so
 * the two differ only in who they are). Returns the request to end. */
static struct req *pass_lead(struct req *lead)
{
    struct req *f = lead->forks[0];
    struct req who = *lead;
    lead->id = f->id;
    lead->sampler = f->sampler;
    lead->on_event = f->on_event;
    lead->user = f->user;
    lead->cancelled = f->cancelled;
    lead->t_submit = f->t_submit;
    f->id = who.id;
    f->sampler = who.sampler;
    f->on_event = who.on_event;
    f->user = who.user;
    f->cancelled = who.cancelled;
    f->finish = SCHED_FINISH_CANCELLED;
    f->n_cached = lead->n_cached;
    list_remove(lead->forks, &lead->n_forks, 0);
    return f;
}

/* Should r leave its list (moved into done[])? Then its finish is set. */
static bool leaves(struct sched *s, struct req *r, struct req **done, int *n)
{
    if (!r->cancelled && !s->cancel_all && r->finish == SCHED_FINISH_NONE)
        return false;
    if (r->finish == SCHED_FINISH_NONE && !s->cancel_all && r->n_forks > 0) {
        done[(*n)++] = pass_lead(r);
        return false;
    }
    if (r->finish == SCHED_FINISH_NONE)
        r->finish = SCHED_FINISH_CANCELLED;
    else
        s->st.requests_done++;
    return true;
}

/* Move requests that are cancelled (or all, on cancel_all) or finished out
 * of the lists into done[], freeing their pages now. */
static int collect_cancelled(struct sched *s, struct req **done, int cap)
{
    int n = 0;
    for (int i = s->n_waiting - 1; i >= 0 && n < cap; i--) {
        struct req *r = s->waiting[i];
        n += collect_cancelled_forks(s, r, done + n, cap - n);
        if (n < cap && leaves(s, r, done, &n)) {
            done[n++] = r;
            list_remove(s->waiting, &s->n_waiting, i);
        }
    }
    for (int i = s->n_active - 1; i >= 0 && n < cap; i--) {
        struct req *r = s->active[i];
        n += collect_cancelled_forks(s, r, done + n, cap - n);
        if (n < cap && leaves(s, r, done, &n)) {
            release_seq(s, r);
            done[n++] = r;
            list_remove(s->active, &s->n_active, i);
        }
    }
    if (s->n_waiting == 0 && s->n_active == 0)
        s->cancel_all = false;
    SCHED_DEBUG_CHECK(s, "collect_cancelled");
    return n;
}

static void run_hooks(struct sched *s)
{
    while (s->hooks) {
        struct hook *h = s->hooks;
        s->hooks = h->next;
        pthread_mutex_unlock(&s->mu);
        h->fn(h->user, s->eng.cache ? s->eng.cache(s->eng.ctx) : NULL);
        pthread_mutex_lock(&s->mu);
        h->done = true;
        pthread_cond_broadcast(&s->hook_done);
    }
}

/* The time one slice of a job may add to a step (sched_run_sliced). */
static double slice_budget(const struct sched *s)
{
    if (s->n_active == 0 && s->n_waiting == 0)
        return SCHED_SLICE_IDLE_S;
    enum { FIRST_GUESS_MS = 5 }; /* before any step was measured, or while requests only wait */
    double decode = s->n_active > 0 ? sched_cost_decode(&s->cost, s->n_active) : 0;
    double ratio = (double)s->cfg.max_itl_ratio - 1.0;
    if (ratio < 0.5)
        ratio = 0.5;
    return decode > 0 ? ratio * decode : FIRST_GUESS_MS * 1e-3;
}

/* One slice of every job, in order; a finished job wakes its caller. */
static void run_jobs(struct sched *s)
{
    struct hook **at = &s->jobs;
    while (*at) {
        struct hook *h = *at;
        double budget = slice_budget(s);
        pthread_mutex_unlock(&s->mu);
        bool done = h->slice(h->user, s->eng.cache ? s->eng.cache(s->eng.ctx) : NULL, budget);
        pthread_mutex_lock(&s->mu);
        if (!done) {
            at = &h->next;
            continue;
        }
        *at = h->next;
        h->done = true;
        pthread_cond_broadcast(&s->hook_done);
    }
}

/* At shutdown: the jobs still running end unfinished. */
static void stop_jobs(struct sched *s)
{
    for (struct hook *h = s->jobs; h; h = h->next)
        h->done = h->stopped = true;
    s->jobs = NULL;
    pthread_cond_broadcast(&s->hook_done);
}

static int32_t next_chunk(const struct sched *s, const struct req *r)
{
    int32_t left = r->n_tokens - r->n_computed;
    return left < s->cfg.prefill_chunk || r->embed ? left : s->cfg.prefill_chunk;
}

/* Active slots promised to the forks of admitted first choices. */
static int reserved_slots(const struct sched *s)
{
    int n = 0;
    for (int i = 0; i < s->n_active; i++)
        n += s->active[i]->n_forks;
    return n;
}

/* A group needs a slot per choice, and room for the first chunk plus the
 * page each fork copies on its first write. */
static bool group_fits(const struct sched *s, const struct req *r)
{
    if (s->n_active + reserved_slots(s) + 1 + r->n_forks > s->cfg.parallel)
        return false;
    int32_t page = s->eng.page_tokens > 0 ? s->eng.page_tokens : 1;
    return s->n_active == 0 || !s->eng.can_admit || s->eng.can_admit(s->eng.ctx, next_chunk(s, r) + r->n_forks * page);
}

static bool salted(const struct req *r) { return r->salt_lo || r->salt_hi; }

/* A salted request on an engine that cannot keep salts shares nothing. */
static bool salt_seq(struct sched *s, struct req *r)
{
    r->no_share = salted(r) && s->eng.prefix_attach && !s->eng.seq_set_salt;
    if (!salted(r) || !s->eng.seq_set_salt)
        return true;
    return s->eng.seq_set_salt(s->eng.ctx, r->seq, r->salt_lo, r->salt_hi) == KS_OK;
}

static void admit(struct sched *s)
{
    while (s->n_waiting > 0 && s->n_active < s->cfg.parallel) {
        struct req *r = s->waiting[0];
        if (!group_fits(s, r))
            break;
        if (s->eng.seq_create(s->eng.ctx, &r->seq) != KS_OK) {
            r->seq = -1;
            break;
        }
        if (!salt_seq(s, r)) {
            s->eng.seq_free(s->eng.ctx, r->seq);
            r->seq = -1;
            break;
        }
        r->n_computed = 0;
        r->needs_lookup = s->eng.prefix_attach != NULL && !r->no_share && !r->embed;
        r->admit_order = ++s->next_admit;
        list_remove(s->waiting, &s->n_waiting, 0);
        s->active[s->n_active++] = r;
        SCHED_DEBUG_CHECK(s, "admit");
    }
}

/* The newest active request holding pages goes back to the queue's head. */
static void preempt_newest(struct sched *s)
{
    int victim = -1;
    for (int i = 0; i < s->n_active; i++)
        if (victim < 0 || s->active[i]->admit_order > s->active[victim]->admit_order)
            victim = i;
    struct req *r = s->active[victim];
    release_seq(s, r);
    r->n_computed = 0;
    list_remove(s->active, &s->n_active, victim);
    if (waiting_push(s, r, true) != KS_OK) {
        r->finish = SCHED_FINISH_ERROR;
        r->error = "out of memory while preempting";
        s->active[s->n_active++] = r; /* collected as finished next step */
        SCHED_DEBUG_CHECK(s, "preempt_newest");
        return;
    }
    s->st.preemptions++;
    SCHED_DEBUG_CHECK(s, "preempt_newest");
}

/* ---- scheduler thread: the prefix cache ------------------------------------------ */

/* The prefix the cache may serve: all but the last token, whose logits the
 * first sample needs, unless the request only warms the cache. */
static int32_t cacheable(const struct req *r)
{
    return r->max_tokens > 0 ? r->n_tokens - 1 : r->n_tokens;
}

/* A warm-up (max_tokens 0) is done once its whole prompt is cached, whether
 * computed or found; there is nothing to sample. */
static void finish_warm_up(struct req *r)
{
    if (r->max_tokens == 0 && !r->embed && r->n_computed == r->n_tokens)
        r->finish = SCHED_FINISH_LENGTH;
}

/* The prompt tokens a request is told the cache served: at most its prompt,
 * and with a salt whole pages only, so a partial page's hit does not tell
 * token by token how far a guess matched. */
static int32_t reported_cached(const struct sched *s, const struct req *r, int32_t n)
{
    if (n > r->n_prompt)
        n = r->n_prompt;
    if (salted(r) && s->eng.page_tokens > 1)
        n -= n % s->eng.page_tokens;
    return n;
}

/* Ask the cache (RAM, then disk) for each newly admitted request's prompt. The
 * engine is called without the lock: a disk read may take a while. */
static void lookup_admitted(struct sched *s)
{
    for (int i = 0; i < s->n_active; i++) {
        struct req *r = s->active[i];
        if (!r->needs_lookup)
            continue;
        struct sched_prefix_hit hit = {0};
        s->eng.prefix_attach(s->eng.ctx, r->seq, r->tokens, cacheable(r), true, s->cost.prefill_token_s, &hit);
        int32_t got = hit.ram_tokens + hit.disk_tokens + hit.redis_tokens;
        pthread_mutex_lock(&s->mu);
        r->needs_lookup = false;
        r->n_computed = got;
        if (!r->looked_up)
            r->n_cached = reported_cached(s, r, got);
        r->looked_up = true;
        s->st.prefix_lookups++;
        s->st.prefix_hit_ram_tokens += (uint64_t)hit.ram_tokens;
        s->st.prefix_hit_disk_tokens += (uint64_t)hit.disk_tokens;
        s->st.prefix_hit_redis_tokens += (uint64_t)hit.redis_tokens;
        s->st.prefix_miss_tokens += (uint64_t)(r->n_tokens - got);
        finish_warm_up(r);
        SCHED_DEBUG_CHECK(s, "lookup_admitted");
        pthread_mutex_unlock(&s->mu);
    }
}

/* Is an older active request about to compute the page r needs next, from
 * the same tokens? Then r waits for it instead of computing it twice. */
static bool computed_by_older(const struct sched *s, const struct req *r)
{
    int32_t end = r->n_computed + s->eng.page_tokens;
    if (r->n_computed % s->eng.page_tokens != 0 || end > cacheable(r))
        return false;
    for (int i = 0; i < s->n_active && s->active[i] != r; i++) {
        const struct req *a = s->active[i];
        if (a->finish == SCHED_FINISH_NONE && !a->embed && a->seq >= 0 && a->n_computed < end && end <= cacheable(a) &&
            a->salt_lo == r->salt_lo && a->salt_hi == r->salt_hi &&
            !memcmp(a->tokens, r->tokens, (size_t)end * sizeof *r->tokens))
            return true;
    }
    return false;
}

/* Before a step: prefilling requests take the pages others published since
 * the last step, then wait if an older request is computing their next page. */
static void share_prefill(struct sched *s)
{
    for (int i = 0; i < s->n_active; i++) {
        struct req *r = s->active[i];
        r->dedup_wait = false;
        if (!s->eng.prefix_attach || r->no_share || r->embed || r->finish != SCHED_FINISH_NONE || r->n_computed >= cacheable(r))
            continue;
        struct sched_prefix_hit hit = {0};
        s->eng.prefix_attach(s->eng.ctx, r->seq, r->tokens, cacheable(r), false, 0.0, &hit);
        pthread_mutex_lock(&s->mu);
        if (r->n_computed < r->n_prompt) /* served from the cache, like a hit at admission */
            r->n_cached += hit.ram_tokens;
        r->n_cached = reported_cached(s, r, r->n_cached);
        r->n_computed += hit.ram_tokens;
        s->st.prefix_shared_tokens += (uint64_t)hit.ram_tokens;
        r->dedup_wait = computed_by_older(s, r);
        s->st.prefix_wait_steps += r->dedup_wait;
        finish_warm_up(r);
        SCHED_DEBUG_CHECK(s, "share_prefill");
        pthread_mutex_unlock(&s->mu);
    }
}

/* After a step: offer every full page computed so far to other requests. */
static void publish_computed(struct sched *s)
{
    for (int i = 0; s->eng.prefix_publish && i < s->n_active; i++)
        if (s->active[i]->seq >= 0 && !s->active[i]->no_share && !s->active[i]->embed)
            s->eng.prefix_publish(s->eng.ctx, s->active[i]->seq, s->active[i]->tokens, s->active[i]->n_computed,
                                  false);
}

/* ---- scheduler thread: one step --------------------------------------------- */

static void batch_add(struct sched *s, int32_t *n, struct req *r, int32_t count, int32_t *n_rows)
{
    for (int32_t i = 0; i < count; i++) {
        int32_t pos = r->n_computed + i;
        s->b_tokens[*n] = r->tokens[pos];
        s->b_pos[*n] = pos;
        s->b_seq[*n] = r->seq;
        s->b_logits[*n] = (i == count - 1) && (pos + 1 == r->n_tokens) && r->max_tokens > 0;
        s->b_embed[*n] = r->embed;
        if (s->b_logits[*n])
            s->b_owner[(*n_rows)++] = r;
        (*n)++;
    }
}

/* r's drafts for this step, after its one token at n_computed. */
static void batch_add_drafts(struct sched *s, int32_t *n, struct req *r, int32_t *n_rows)
{
    for (int32_t j = 0; j < r->n_draft; j++) {
        s->b_tokens[*n] = r->draft[j];
        s->b_pos[*n] = r->n_computed + 1 + j;
        s->b_seq[*n] = r->seq;
        s->b_logits[*n] = true;
        s->b_embed[*n] = false;
        s->b_owner[(*n_rows)++] = r;
        (*n)++;
    }
}

static bool is_decoder(const struct req *r)
{
    return r->n_tokens - r->n_computed == 1 && !r->embed && r->finish == SCHED_FINISH_NONE;
}

/* r has prompt left to compute (an embedding request: any; else more than its last token's). */
static bool has_prefill(const struct req *r)
{
    return r->n_tokens - r->n_computed > (r->embed ? 0 : 1);
}

static bool is_prefilling(const struct req *r)
{
    return has_prefill(r) && !r->skip_step && !r->dedup_wait && r->finish == SCHED_FINISH_NONE;
}

/* The draft model's weights over the target's (what a draft token costs
 * before a draft step is measured), 0 when either is unknown. */
static double draft_weight_ratio(const struct sched *s)
{
    const struct sched_engine *d = s->eng.draft;
    return d && d->weight_bytes > 0 && s->eng.weight_bytes > 0 ? (double)d->weight_bytes / (double)s->eng.weight_bytes
                                                               : 0.0;
}

/* A draft step as a fraction of the target's decode-only step beside
 * n_decode decoders: measured, else the weights' ratio, else a guess (as a
 * target token beside decoders). */
static double draft_step_ratio(const struct sched *s, int32_t n_decode)
{
    double d = sched_cost_draft_ratio(&s->cost, n_decode);
    if (d <= 0)
        d = draft_weight_ratio(s);
    return d > 0 ? d : SPEC_COST_GUESS;
}

/* The cost of one more token in a step with n_decode decoders, as a fraction
 * of the decode-only step (the cost model's marginal token), or a guess
 * before it has measured both. */
static double extra_token_cost(const struct sched *s, int32_t n_decode)
{
    double r = sched_cost_token_ratio(&s->cost, n_decode);
    if (r <= 0)
        r = SPEC_COST_GUESS;
    /* a draft model's token costs a draft step too */
    if (s->drafter)
        r += draft_step_ratio(s, n_decode);
    return r;
}

/* Up to k tokens to draft after r's text: the shared pool's (after it has
 * learnt r's latest tokens), else r's own prompt lookup. */
static int32_t propose(struct sched *s, struct req *r, int32_t k, int32_t *draft)
{
    if (s->drafter) { /* the draft model's, from this step's pass */
        int32_t m = k < r->n_dprop ? k : r->n_dprop;
        memcpy(draft, r->dprop, (size_t)(m > 0 ? m : 0) * sizeof *draft);
        return m > 0 ? m : 0;
    }
    if (s->pool) {
        uint64_t salt = r->salt_lo ^ (r->salt_hi * 0x9e3779b97f4a7c15ull); /* tenants do not draft each other's text */
        if (r->pool_fed < r->n_tokens) {
            spec_pool_add(s->pool, salt, r->tokens, r->n_tokens, r->pool_fed);
            r->pool_fed = r->n_tokens;
        }
        int32_t m = spec_pool_draft(s->pool, salt, r->tokens, r->n_tokens, k, draft);
        if (m > 0)
            return m;
    }
    return spec_ngram_draft(r->tokens, r->n_tokens, k, draft);
}

/* The drafts r may take this step, as plan_drafts will count them (before
 * the step's shared draft budget). */
static int32_t draft_want(const struct sched *s, const struct req *r, double extra_cost)
{
    int32_t k = s->no_drafts ? 0 : spec_adapt_len(&r->adapt, r->n_tokens, r->spec_min, r->spec_max, extra_cost);
    int32_t room = r->max_tokens - r->n_generated - 1;
    if (room > r->cap - r->n_tokens - 1)
        room = r->cap - r->n_tokens - 1;
    return k < room ? k : room > 0 ? room : 0;
}

/* Plan r's drafts for this step within *budget extra tokens (r->n_draft), or,
 * when it does not draft, the 1-token proposal its sampled token will be
 * checked against (r->shadow). Every draft kept plus the target's own token
 * must fit max_tokens and the context. */
static void plan_drafts(struct sched *s, struct req *r, int32_t *budget, double extra_cost)
{
    r->n_draft = 0;
    r->shadow = -1;
    r->draft_q = false;
    if (r->spec_max <= 0)
        return;
    int32_t k = draft_want(s, r, extra_cost);
    if (k > *budget)
        k = *budget;
    int32_t m = k > 0 ? propose(s, r, k, r->draft) : 0;
    if (m > 0 && m >= r->spec_min) {
        r->n_draft = m;
        r->draft_q = s->drafter != NULL; /* propose took the draft model's first m, drawn from dq */
        *budget -= m;
        return;
    }
    int32_t one;
    if (propose(s, r, 1, &one) == 1)
        r->shadow = one;
}

/* Extra tokens the step's drafts may take: what the cost model allows beside
 * n_decode decoders, within the batch and the logits rows, and only half of
 * it while a request is prefilling (a prompt keeps progressing). */
static int32_t draft_budget(const struct sched *s, int32_t n_decode, int32_t limit)
{
    int32_t budget = s->cfg.max_batch_tokens - n_decode;
    if (budget > limit)
        budget = limit;
    if (budget > s->cap_rows - s->n_active)
        budget = s->cap_rows - s->n_active;
    for (int i = 0; i < s->n_active; i++)
        if (is_prefilling(s->active[i])) {
            budget /= 2;
            break;
        }
    return budget > 0 ? budget : 0;
}

/* ---- scheduler thread: the draft model (SPEC_DRAFT) -------------------------- */

/* A request that does not draft checks the draft model's next proposal at
 * most once in SCHED_DRAFT_SHADOW_EVERY generated tokens (its shadow), and
 * under the allowance below only when it affords the check.
 *
 * Requests that do not force drafting (--draft-min 0) get draft jobs only
 * within spec_draft_allowance over the scheduler's whole work:
 * SPEC_DRAFT_IDLE_SHARE of the tokens the target computed plus what accepted
 * drafts saved, counted at the dearer of the weights' and the measured cost
 * of a draft token, less what the draft model computed for them. So where
 * nothing is accepted the draft model costs a bounded share of the work,
 * and the catch-up on every token a lagging sequence would need (a draft as
 * large as its target processing the whole text) gives way to a window: the
 * request's last SCHED_DRAFT_WINDOW tokens, prefilled again when a check is
 * due and the allowance affords it (sched_draft_afford). One allowance for
 * all: a request proven to draft well pays for the others' prompts and
 * checks. */

static double draft_token_ratio(const struct sched *s, int32_t n_decode)
{
    double rho = draft_weight_ratio(s), measured = sched_cost_draft_ratio(&s->cost, n_decode);
    return measured > rho ? measured : rho;
}

static double draft_credit(const struct sched *s, int32_t n_decode)
{
    return spec_draft_allowance((int64_t)(s->st.prompt_tokens + s->st.generated_tokens),
                                (int64_t)s->st.spec_accepted_tokens, SPEC_DRAFT_IDLE_SHARE,
                                draft_token_ratio(s, n_decode)) -
           (double)s->draft_spent;
}

/* What the step's budget (--max-itl-ratio, draft_budget) leaves for a draft
 * model's drafts, in marginal target tokens: each draft is one verification
 * token, and each draft step the pass runs (as many as its longest request's
 * drafts) costs the measured draft step over the marginal token's cost. */
struct draft_room {
    double left;              /* marginal tokens still free */
    double step_tokens;       /* one draft step, in marginal tokens */
    int32_t k_max;            /* the longest draft taken so far: the pass's steps */
    double credit;            /* draft tokens the allowance (draft_credit) leaves */
    double earned;            /* draft tokens one more token of the target's work adds to it */
};

static struct draft_room draft_room_init(const struct sched *s, int32_t n_decode)
{
    int32_t limit = sched_cost_prefill_limit(&s->cost, n_decode, s->cfg.max_itl_ratio);
    double c = sched_cost_token_ratio(&s->cost, n_decode);
    return (struct draft_room){
        .left = draft_budget(s, n_decode, limit),
        .step_tokens = draft_step_ratio(s, n_decode) / (c > 0 ? c : SPEC_COST_GUESS),
        .credit = draft_credit(s, n_decode),
        .earned = spec_draft_allowance(1, 0, SPEC_DRAFT_IDLE_SHARE, draft_token_ratio(s, n_decode)),
    };
}

/* Of k drafts wanted, the most that fit what is left (taken from it). */
static int32_t draft_room_take(struct draft_room *room, int32_t k)
{
    for (; k > 0; k--) {
        double cost = k + (k > room->k_max ? k - room->k_max : 0) * room->step_tokens;
        if (cost <= room->left) {
            room->left -= cost;
            room->k_max = k > room->k_max ? k : room->k_max;
            return k;
        }
    }
    return 0;
}

/* Could drafting pay even if every draft were accepted? Once a draft step
 * is measured so dear that no k gains (a draft as large as its target),
 * requests that do not force drafting (--draft-min 0) stop running the draft
 * model: no prompt catch-up, no shadow checks, which would cost the target's
 * rate and could never win it back. */
static bool draft_can_pay(const struct sched *s, int32_t n_decode, double extra_cost)
{
    if (sched_cost_draft_ratio(&s->cost, n_decode) <= 0 && draft_weight_ratio(s) <= 0)
        return true; /* neither measured nor known from the weights */
    return spec_can_pay(SPEC_DRAFT_LIMIT, extra_cost);
}

/* k drafts wanted by decoder r: the most its allowance affords (and the
 * step's room takes), or 1 for a shadow check when one is due and
 * affordable, or 0. *window: start the job from a window. */
static int32_t decoder_job_k(const struct sched *s, struct req *r, struct draft_room *room, double extra_cost,
                             bool *window)
{
    const bool capped = r->spec_min <= 0;
    int32_t k = draft_want(s, r, extra_cost), lead = 0;
    *window = false;
    int32_t afford = capped ? sched_draft_afford(&r->dseq, r->n_tokens, k > 0, room->credit, &lead, window)
                            : SPEC_DRAFT_LIMIT;
    k = draft_room_take(room, k < afford ? k : afford);
    if (k == 0 && afford > 0 && r->n_generated - r->draft_at >= SCHED_DRAFT_SHADOW_EVERY)
        k = 1;
    if (k > 0 && capped)
        room->credit -= lead + k - 1;
    return k;
}

/* A prefilling request's catch-up on its prompt: for one under the
 * allowance, only when it affords the whole of it (a part would be dropped
 * for a window later), counting what the target's prefill of the same
 * tokens, under way, adds to the allowance. */
static bool prefill_job_ok(const struct req *r, struct draft_room *room)
{
    const struct sched_draft_seq *ds = &r->dseq;
    double rest = r->n_tokens - ds->base - ds->n_computed;
    double need = rest - rest * (room->earned < 1 ? room->earned : 1);
    if (r->spec_min > 0)
        return true;
    if (room->credit < need)
        return false;
    room->credit -= need;
    return true;
}

/* The draft model's pass of this step (sched.h, "the draft model's passes"):
 * every speculating decoder that drafts gets its proposals (r->dprop), one
 * that does not a shadow proposal now and then (decoder_job_k), and
 * prefilling requests catch up on their prompt, within the allowance. Returns the seconds it took
 * (outside the target step's measured cost; the drafts and the draft steps
 * they need fit the step's --max-itl-ratio budget, draft_room). */
static double draft_pass(struct sched *s)
{
    if (!s->drafter)
        return 0.0;
    double t0 = now_seconds();
    s->no_drafts = false; /* as run_batch starts the step */
    int32_t n_decode = 0;
    for (int i = 0; i < s->n_active; i++)
        n_decode += is_decoder(s->active[i]);
    double extra_cost = extra_token_cost(s, n_decode);
    struct draft_room room = draft_room_init(s, n_decode);
    const bool can_pay = draft_can_pay(s, n_decode, extra_cost);
    int n = 0;
    for (int i = 0; i < s->n_active; i++) {
        struct req *r = s->active[i];
        r->n_dprop = 0;
        if (r->spec_max <= 0 || r->seq < 0 || r->embed || r->finish != SCHED_FINISH_NONE || r->max_tokens == 0 ||
            (!can_pay && r->spec_min <= 0))
            continue;
        int32_t k = 0;
        if (is_decoder(r)) {
            bool window;
            k = decoder_job_k(s, r, &room, extra_cost, &window);
            if (k == 0)
                continue;
            r->draft_at = r->n_generated;
            if (window)
                sched_drafter_restart(s->drafter, &r->dseq, r->tokens, r->n_tokens, r->n_tokens - SCHED_DRAFT_WINDOW,
                                      !r->no_share);
        } else if (!is_prefilling(r) || !prefill_job_ok(r, &room)) {
            continue;
        }
        s->draft_jobs[n] = (struct sched_draft_job){
            .ds = &r->dseq, .tokens = r->tokens, .n_tokens = r->n_tokens, .k = k, .share = !r->no_share,
            .salt_lo = r->salt_lo, .salt_hi = r->salt_hi, .sampling = &r->draft_sampling, .rng = &r->draft_rng,
        };
        s->job_req[n++] = r;
    }
    if (n == 0)
        return 0.0;
    sched_drafter_run(s->drafter, s->draft_jobs, n);
    sched_cost_observe_draft(&s->cost, sched_drafter_step_seconds(s->drafter));
    for (int i = 0; i < n; i++) {
        struct req *r = s->job_req[i];
        if (r->spec_min <= 0)
            s->draft_spent += (uint64_t)s->draft_jobs[i].n_work;
        r->n_dprop = s->draft_jobs[i].n_draft;
        memcpy(r->dprop, s->draft_jobs[i].draft, (size_t)r->n_dprop * sizeof *r->dprop);
        memcpy(r->dq, s->draft_jobs[i].q, (size_t)r->n_dprop * sizeof *r->dq);
    }
    return now_seconds() - t0;
}

/* Under mu: the speculators' counts into the stats. */
static void draft_counts(struct sched *s)
{
    s->st.spec_shadow_checks = s->shadow_checks;
    if (!s->drafter)
        return;
    struct sched_drafter_counts c;
    sched_drafter_get_counts(s->drafter, &c);
    s->st.spec_draft_forwards = c.forwards;
    s->st.spec_draft_model_tokens = c.tokens;
}

/* Decode entries first (each decoder's token, then its drafts), then prefill
 * chunks oldest first within the budget. Returns the number of tokens;
 * *n_prefill_out the number of prefill chunks. */
static int32_t build_batch(struct sched *s, int32_t *n_rows, int *n_prefill_out)
{
    int32_t n = 0;
    int n_prefill = 0;
    *n_rows = 0;
    int32_t n_decode = 0;
    for (int i = 0; i < s->n_active; i++)
        n_decode += is_decoder(s->active[i]);
    int32_t limit = sched_cost_prefill_limit(&s->cost, n_decode, s->cfg.max_itl_ratio);
    int32_t drafts = draft_budget(s, n_decode, limit), drafts_left = drafts;
    double extra_cost = extra_token_cost(s, n_decode);
    for (int i = 0; i < s->n_active; i++) {
        struct req *r = s->active[i];
        r->n_draft = 0;
        r->shadow = -1;
        if (!is_decoder(r))
            continue;
        plan_drafts(s, r, &drafts_left, extra_cost);
        batch_add(s, &n, r, 1, n_rows);
        batch_add_drafts(s, &n, r, n_rows);
    }
    int32_t n_extra = n - n_decode;
    for (int i = 0; i < s->n_active; i++) {
        struct req *r = s->active[i];
        int32_t chunk = next_chunk(s, r);
        int32_t budget = s->cfg.max_batch_tokens - n;
        if (budget > limit - (n - n_decode))
            budget = limit - (n - n_decode);
        if (r->embed && is_prefilling(r) && chunk > s->cfg.max_batch_tokens - n)
            break; /* whole or not at all, and no newer chunk takes its room */
        if (r->embed && is_prefilling(r)) {
            batch_add(s, &n, r, chunk, n_rows); /* beyond the cost model's limit: it cannot be split */
            n_prefill++;
            continue;
        }
        if (!has_prefill(r) || r->skip_step || r->dedup_wait || r->finish != SCHED_FINISH_NONE ||
            budget <= 0)
            continue;
        batch_add(s, &n, r, chunk < budget ? chunk : budget, n_rows);
        n_prefill++;
    }
    *n_prefill_out = n_prefill;
    s->step_decode = n_decode;
    s->step_draft = n_extra;
    s->step_prefill = n - n_decode - n_extra;
    s->step_limit = limit;
    return n;
}

/* Drop the newest prefill chunk of this step. */
static void drop_newest_prefill(struct sched *s)
{
    struct req *newest = NULL;
    for (int i = 0; i < s->n_active; i++) {
        struct req *r = s->active[i];
        if (is_prefilling(r) && (!newest || r->admit_order > newest->admit_order))
            newest = r;
    }
    if (newest)
        newest->skip_step = true;
}

static void fail_active(struct sched *s, const char *msg)
{
    for (int i = 0; i < s->n_active; i++) {
        s->active[i]->finish = SCHED_FINISH_ERROR;
        s->active[i]->error = msg;
    }
}

static bool any_skipped(const struct sched *s)
{
    for (int i = 0; i < s->n_active; i++)
        if (s->active[i]->skip_step)
            return true;
    return false;
}

/* Run the step's batch; on KS_ERR_KV_FULL shrink it (drop prefill chunks,
 * then preempt the newest) and retry. Returns tokens run (0: nothing ran). */
static int32_t run_batch(struct sched *s, int32_t *n_rows)
{
    static const char *too_big = "the KV cache cannot hold this request even alone; raise --kv-mem or shorten it";
    static const char *engine_failed = "the model failed while computing this step (see the server log)";
    for (int i = 0; i < s->n_active; i++)
        s->active[i]->skip_step = false;
    s->no_drafts = false;
    bool counted_full = false;
    for (;;) {
        int n_prefill;
        int32_t n = build_batch(s, n_rows, &n_prefill);
        if (n == 0 && (s->n_active == 0 || !any_skipped(s)))
            return 0; /* nothing to run: finished or waiting for another's pages */
        if (n > 0) {
            struct sched_batch b = {n, s->b_tokens, s->b_pos, s->b_seq, s->b_logits, NULL};
            for (int32_t i = 0; i < n && !b.embed; i++)
                b.embed = s->b_embed[i] ? s->b_embed : NULL;
            ks_status st = b.embed ? s->eng.forward_embd(s->eng.ctx, &b, s->logits, s->embd)
                                   : s->eng.forward(s->eng.ctx, &b, s->logits);
            if (st == KS_OK)
                return n;
            if (st != KS_ERR_KV_FULL) {
                pthread_mutex_lock(&s->mu);
                fail_active(s, engine_failed);
                SCHED_DEBUG_CHECK(s, "run_batch (engine failure)");
                pthread_mutex_unlock(&s->mu);
                return 0;
            }
            if (!counted_full) {
                pthread_mutex_lock(&s->mu);
                s->st.kv_full_events++;
                pthread_mutex_unlock(&s->mu);
                counted_full = true;
            }
            if (s->step_draft > 0) {
                s->no_drafts = true;
                continue;
            }
            if (n_prefill > 0) {
                drop_newest_prefill(s);
                continue;
            }
        }
        pthread_mutex_lock(&s->mu);
        if (s->n_active <= 1) {
            fail_active(s, too_big);
            SCHED_DEBUG_CHECK(s, "run_batch (too big)");
            pthread_mutex_unlock(&s->mu);
            return 0;
        }
        preempt_newest(s);
        pthread_mutex_unlock(&s->mu);
        for (int i = 0; i < s->n_active; i++)
            s->active[i]->skip_step = false;
    }
}

static bool is_eog(const struct sched *s, int32_t tok)
{
    for (int i = 0; i < s->cfg.n_eog; i++)
        if (s->eog[i] == tok)
            return true;
    return false;
}

/* Take res as r's next token (st: how the draw went) and deliver its event.
 * Returns whether r goes on generating. */
static bool take_token(struct sched *s, struct req *r, ks_status st, const struct sample_result *res, double t)
{
    pthread_mutex_lock(&s->mu);
    bool emit = !st && !r->cancelled;
    if (st) {
        r->finish = SCHED_FINISH_ERROR;
        snprintf(r->error_text, sizeof r->error_text, "sampling failed: %s", ks_errmsg());
        r->error = r->error_text;
    } else if (!r->ignore_eog && is_eog(s, res->token)) {
        r->finish = SCHED_FINISH_STOP;
        emit = false;
    } else {
        r->tokens[r->n_tokens++] = res->token;
        r->n_generated++;
        s->st.generated_tokens++;
        if (r->n_generated == 1)
            hist_add(&s->st.ttft, t - r->t_submit);
        else
            hist_add(&s->st.itl, t - r->t_last);
        r->t_last = t;
        if (r->n_generated >= r->max_tokens || r->n_tokens >= r->cap)
            r->finish = SCHED_FINISH_LENGTH;
    }
    bool go_on = r->finish == SCHED_FINISH_NONE && !r->cancelled;
    SCHED_DEBUG_CHECK(s, "take_token");
    pthread_mutex_unlock(&s->mu);
    if (emit) {
        struct sched_event ev = {
            .id = r->id, .token = res->token, .sample = res, .n_prompt = r->n_prompt,
            .n_generated = r->n_generated, .n_cached = r->n_cached, .n_drafted = r->n_drafted,
            .n_accepted = r->n_accepted,
        };
        r->on_event(r->user, &ev);
    }
    return go_on;
}

/* Sample r's next token from its logits row and deliver the event; a shadow
 * proposal learns whether it would have been accepted. */
static void sample_row(struct sched *s, struct req *r, const float *logits, double t)
{
    struct sample_result res;
    ks_status st = s->eng.sampler_next(s->eng.ctx, r->sampler, logits, r->tokens, r->n_tokens, &res);
    if (!st && r->shadow >= 0) {
        spec_adapt_observe(&r->adapt, 1, res.token == r->shadow);
        s->shadow_checks++;
    }
    take_token(s, r, st, &res, t);
}

/* r's draft i against its row: a draft model's against the q it was drawn
 * from when the engine can (exact either way; min(1, p / q) keeps more). */
static ks_status verify_one(struct sched *s, struct req *r, const float *row, int32_t i, struct sample_result *res,
                            bool *accepted)
{
    if (r->draft_q && s->eng.sampler_verify_proposal)
        return s->eng.sampler_verify_proposal(s->eng.ctx, r->sampler, row, r->tokens, r->n_tokens, &r->dq[i],
                                              r->draft[i], res, accepted);
    return s->eng.sampler_verify(s->eng.ctx, r->sampler, row, r->tokens, r->n_tokens, r->draft[i], res, accepted);
}

/* r fed its last token (counted in n_computed) and k drafts; logits holds
 * their k + 1 rows. Keep
 * drafts while the sampler accepts them, then the target's own token (the
 * rejection's replacement, or after k accepted drafts the token that follows
 * them), and cut the sequence back to the tokens whose K/V stay valid: the
 * last token and the drafts kept. */
static void verify_rows(struct sched *s, struct req *r, const float *logits, double t)
{
    int32_t k = r->n_draft, base = r->n_tokens, kept = 0, tested = 0, accepted_n = 0;
    for (int32_t i = 0; i <= k; i++) {
        const float *row = logits + (size_t)i * s->eng.n_vocab;
        struct sample_result res;
        bool accepted = false;
        ks_status st = i < k ? verify_one(s, r, row, i, &res, &accepted)
                             : s->eng.sampler_next(s->eng.ctx, r->sampler, row, r->tokens, r->n_tokens, &res);
        tested += i < k && !st;
        accepted_n += accepted;
        r->n_accepted += accepted; /* before the event, which carries it */
        int32_t before = r->n_tokens;
        bool go_on = take_token(s, r, st, &res, t);
        kept += accepted && r->n_tokens > before;
        if (!accepted || !go_on)
            break;
    }
    spec_adapt_verified(&r->adapt, tested, accepted_n, r->n_tokens);
    pthread_mutex_lock(&s->mu);
    r->n_drafted += k;
    s->st.spec_draft_tokens += (uint64_t)k;
    s->st.spec_accepted_tokens += (uint64_t)accepted_n;
    s->st.spec_verifications++;
    r->n_computed = base + kept;
    SCHED_DEBUG_CHECK(s, "verify_rows");
    pthread_mutex_unlock(&s->mu);
    if (kept < k && s->eng.seq_truncate(s->eng.ctx, r->seq, base + kept) != KS_OK) {
        pthread_mutex_lock(&s->mu);
        r->finish = SCHED_FINISH_ERROR;
        r->error = "speculation: the KV cache could not drop the rejected draft tokens";
        pthread_mutex_unlock(&s->mu);
    }
}

/* A fork that could not share lead's pages computes the prompt itself (the
 * prefix cache may serve it); without even a queue slot it fails. */
static void fork_fallback(struct sched *s, struct req *f)
{
    if (waiting_push(s, f, true) == KS_OK)
        return;
    f->finish = SCHED_FINISH_ERROR;
    f->error = "out of memory while starting a choice";
    s->active[s->n_active++] = f; /* a reserved slot; collected as finished next step */
}

/* lead's prompt is computed and its first logits row is ready: its forks
 * become active requests on its pages, to sample from the same row. Returns
 * how many did (in s->forked). */
static int fork_choices(struct sched *s, struct req *lead)
{
    int n = 0;
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < lead->n_forks; i++) {
        struct req *f = lead->forks[i];
        if (!s->eng.seq_fork || s->eng.seq_fork(s->eng.ctx, lead->seq, &f->seq) != KS_OK) {
            f->seq = -1;
            fork_fallback(s, f);
            continue;
        }
        f->n_computed = lead->n_computed;
        f->n_cached = lead->n_cached;
        f->no_share = lead->no_share;
        f->looked_up = true;
        f->admit_order = ++s->next_admit;
        s->active[s->n_active++] = f;
        s->forked[n++] = f;
        s->st.forked_choices++;
    }
    lead->n_forks = 0;
    SCHED_DEBUG_CHECK(s, "fork_choices");
    pthread_mutex_unlock(&s->mu);
    return n;
}

/* The step's embedding requests are done: each takes its pooled row (rows
 * in the order of their first entries, as forward_embd writes them). */
static void take_embeddings(struct sched *s, int32_t n)
{
    int32_t row = 0;
    for (int32_t i = 0; i < n; i++) {
        if (!s->b_embed[i] || (i > 0 && s->b_embed[i - 1] && s->b_seq[i - 1] == s->b_seq[i]))
            continue;
        for (int j = 0; j < s->n_active; j++)
            if (s->active[j]->seq == s->b_seq[i]) {
                struct req *r = s->active[j];
                memcpy(r->embd, s->embd + (size_t)row * s->eng.n_embd, (size_t)s->eng.n_embd * sizeof *r->embd);
                r->finish = SCHED_FINISH_STOP;
                break;
            }
        row++;
    }
}

/* Advance n_computed for what ran (drafts count once verified, in
 * verify_rows), sample every row and deliver events. */
static void finish_step(struct sched *s, int32_t n, int32_t n_rows)
{
    double t = now_seconds();
    pthread_mutex_lock(&s->mu);
    for (int32_t i = 0; i < n; i++)
        for (int j = 0; j < s->n_active; j++)
            if (s->active[j]->seq == s->b_seq[i]) {
                struct req *r = s->active[j];
                if (s->b_pos[i] >= r->n_tokens) /* a draft: not one of r's tokens yet */
                    break;
                if (r->n_computed < r->n_prompt)
                    s->st.prompt_tokens++;
                r->n_computed++;
                finish_warm_up(r);
                break;
            }
    take_embeddings(s, n);
    SCHED_DEBUG_CHECK(s, "finish_step");
    pthread_mutex_unlock(&s->mu);

    for (int32_t row = 0; row < n_rows; row++) {
        struct req *r = s->b_owner[row];
        const float *logits = s->logits + (size_t)row * s->eng.n_vocab;
        if (r->n_draft > 0) {
            row += r->n_draft;
            verify_rows(s, r, logits, t);
            r->n_draft = 0;
            continue;
        }
        int n_forked = r->n_forks > 0 ? fork_choices(s, r) : 0;
        sample_row(s, r, logits, t);
        for (int i = 0; i < n_forked; i++)
            sample_row(s, s->forked[i], logits, t);
    }
}

static void *sched_main(void *arg)
{
    struct sched *s = arg;
    enum { DONE_CAP = 64 };
    struct req *done[DONE_CAP];
    pthread_mutex_lock(&s->mu);
    for (;;) {
        run_hooks(s);
        int n_done = collect_cancelled(s, done, DONE_CAP);
        if (n_done > 0) {
            pthread_mutex_unlock(&s->mu);
            for (int i = 0; i < n_done; i++) {
                req_emit_final(done[i]);
                req_free(s, done[i]);
            }
            pthread_mutex_lock(&s->mu);
            continue;
        }
        if (s->stop && s->n_active == 0 && s->n_waiting == 0)
            break;
        if (s->n_active == 0 && s->n_waiting == 0) {
            if (s->jobs)
                run_jobs(s);
            else
                pthread_cond_wait(&s->work, &s->mu);
            continue;
        }
        run_jobs(s); /* one slice per step */
        admit(s);
        pthread_mutex_unlock(&s->mu);

        double t0 = now_seconds();
        lookup_admitted(s);
        share_prefill(s);
        double t_draft = draft_pass(s); /* the draft model's time is not the target step's */
        int32_t n_rows = 0;
        int32_t n = run_batch(s, &n_rows);
        if (n > 0) {
            finish_step(s, n, n_rows);
            publish_computed(s);
        }
        double dt = now_seconds() - t0 - t_draft;
        if (n > 0 && s->trace)
            fprintf(s->trace, "sched step: decode %d draft %d prefill %d limit %d | %.3f ms, decode-only estimate %.2f ms, %.3f ms/prefill token\n",
                    s->step_decode, s->step_draft, s->step_prefill, s->step_limit == INT32_MAX ? -1 : s->step_limit, dt * 1e3,
                    sched_cost_decode(&s->cost, s->step_decode) * 1e3, s->cost.prefill_token_s * 1e3);
        if (n > 0)
            sched_cost_observe(&s->cost, s->step_decode, s->step_prefill + s->step_draft, dt);

        pthread_mutex_lock(&s->mu);
        if (n > 0) {
            s->st.steps++;
            if (dt > s->st.max_step_seconds)
                s->st.max_step_seconds = dt;
        }
        draft_counts(s);
    }
    run_hooks(s);
    stop_jobs(s);
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* ---- invariants ----------------------------------------------------------------- */

/* The counts every request keeps, wherever it is. */
static ks_status check_req(const struct sched *s, const struct req *r)
{
    if (r->n_prompt < 1 || r->n_tokens < r->n_prompt || r->n_tokens > r->cap || r->cap > s->cfg.ctx_size)
        return ks_fail(KS_ERR_INTERNAL, "request %llu: %d prompt and %d tokens in room for %d (context %d)",
                       (unsigned long long)r->id, r->n_prompt, r->n_tokens, r->cap, s->cfg.ctx_size);
    if (r->n_generated != r->n_tokens - r->n_prompt || r->n_generated > r->max_tokens)
        return ks_fail(KS_ERR_INTERNAL, "request %llu: %d generated, %d tokens after the prompt, at most %d",
                       (unsigned long long)r->id, r->n_generated, r->n_tokens - r->n_prompt, r->max_tokens);
    if (r->n_computed < 0 || r->n_computed > r->n_tokens || r->n_cached < 0 || r->n_cached > r->n_prompt)
        return ks_fail(KS_ERR_INTERNAL, "request %llu: %d computed and %d cached of %d tokens (%d prompt)",
                       (unsigned long long)r->id, r->n_computed, r->n_cached, r->n_tokens, r->n_prompt);
    if (r->id == 0 || r->id > s->next_id)
        return ks_fail(KS_ERR_INTERNAL, "request id %llu was never given (last %llu)", (unsigned long long)r->id,
                       (unsigned long long)s->next_id);
    return KS_OK;
}

/* Where a request is decides what it may hold: a queued one and a fork no
 * pages (nothing computed), a running one its own sequence unless it has
 * finished without one; only a first choice has forks. */
static ks_status check_place(const struct sched *s, const struct req *r, bool running, bool fork)
{
    ks_status st = check_req(s, r);
    if (st)
        return st;
    const char *where = fork ? "a fork" : running ? "running" : "queued";
    if (!running && (r->seq != -1 || r->n_computed != 0 || r->dseq.seq != -1))
        return ks_fail(KS_ERR_INTERNAL, "%s request %llu holds sequence %d (draft sequence %d) with %d tokens computed",
                       where, (unsigned long long)r->id, r->seq, r->dseq.seq, r->n_computed);
    if (running && r->seq < 0 && r->finish == SCHED_FINISH_NONE)
        return ks_fail(KS_ERR_INTERNAL, "running request %llu holds no sequence", (unsigned long long)r->id);
    if (running && r->finish == SCHED_FINISH_NONE && (r->admit_order == 0 || r->admit_order > s->next_admit))
        return ks_fail(KS_ERR_INTERNAL, "running request %llu: admission %llu of %llu", (unsigned long long)r->id,
                       (unsigned long long)r->admit_order, (unsigned long long)s->next_admit);
    if (r->n_forks < 0 || (r->n_forks > 0 && (fork || !r->forks)) || r->n_forks >= s->cfg.parallel)
        return ks_fail(KS_ERR_INTERNAL, "%s request %llu has %d forks (--parallel %d)", where,
                       (unsigned long long)r->id, r->n_forks, s->cfg.parallel);
    if (fork && r->finish != SCHED_FINISH_NONE)
        return ks_fail(KS_ERR_INTERNAL, "fork %llu finished before it started", (unsigned long long)r->id);
    return KS_OK;
}

/* Found for the second time in this pass: in two places. Marks instead of
 * a scratch list, so a check never allocates (tests count allocations). */
static bool seen_twice(struct req *r, uint64_t pass)
{
    bool twice = r->check_pass == pass;
    r->check_pass = pass;
    return twice;
}

static ks_status check_unique(struct sched *s)
{
    uint64_t pass = ++s->check_passes;
    for (int i = 0; i < s->n_waiting + s->n_active; i++) {
        struct req *r = i < s->n_waiting ? s->waiting[i] : s->active[i - s->n_waiting];
        bool twice = seen_twice(r, pass);
        for (int f = 0; f < r->n_forks && !twice; f++)
            twice = seen_twice(r->forks[f], pass);
        if (twice)
            return ks_fail(KS_ERR_INTERNAL, "a request (or a fork of request %llu) is in two places",
                           (unsigned long long)r->id);
    }
    for (int i = 0; i < s->n_active; i++)
        for (int j = 0; j < i; j++)
            if (s->active[i]->seq >= 0 && s->active[i]->seq == s->active[j]->seq)
                return ks_fail(KS_ERR_INTERNAL, "running requests %llu and %llu hold sequence %d",
                               (unsigned long long)s->active[j]->id, (unsigned long long)s->active[i]->id,
                               s->active[i]->seq);
    return KS_OK;
}

static ks_status check_locked(struct sched *s)
{
    if (s->n_waiting < 0 || s->n_waiting > s->cap_waiting || s->n_active < 0 || s->n_active > s->cfg.parallel)
        return ks_fail(KS_ERR_INTERNAL, "%d queued (room %d), %d running (--parallel %d)", s->n_waiting,
                       s->cap_waiting, s->n_active, s->cfg.parallel);
    int promised = 0;
    ks_status st = KS_OK;
    for (int i = 0; i < s->n_waiting + s->n_active && !st; i++) {
        bool running = i >= s->n_waiting;
        const struct req *r = running ? s->active[i - s->n_waiting] : s->waiting[i];
        st = check_place(s, r, running, false);
        for (int f = 0; f < r->n_forks && !st; f++)
            st = check_place(s, r->forks[f], false, true);
        promised += running ? r->n_forks : 0;
    }
    if (!st && s->n_active + promised > s->cfg.parallel)
        st = ks_fail(KS_ERR_INTERNAL, "%d running and %d slots promised to forks exceed --parallel %d", s->n_active,
                     promised, s->cfg.parallel);
    return st ? st : check_unique(s);
}

ks_status sched_check(struct sched *s)
{
    pthread_mutex_lock(&s->mu);
    ks_status st = check_locked(s);
    pthread_mutex_unlock(&s->mu);
    return st;
}

#if KS_SCHED_CHECK
static void sched_debug_check(struct sched *s, const char *change)
{
    if (check_locked(s)) {
        fprintf(stderr, "sched: %s broke an invariant: %s\n", change, ks_errmsg());
        abort();
    }
}
#endif

/* ---- create / free ----------------------------------------------------------- */

static ks_status check_config(const struct sched_config *c, const struct sched_engine *e)
{
    if (c->parallel < 1 || c->parallel > 4096)
        return ks_fail(KS_ERR_INVALID_ARG, "--parallel must be in 1..4096 (got %d)", c->parallel);
    if (c->max_batch_tokens < c->parallel)
        return ks_fail(KS_ERR_INVALID_ARG, "--max-batch-tokens (%d) must be at least --parallel (%d) so every running sequence can decode each step",
                       c->max_batch_tokens, c->parallel);
    if (!(c->max_itl_ratio >= 0.0f && c->max_itl_ratio <= 1000.0f))
        return ks_fail(KS_ERR_INVALID_ARG, "--max-itl-ratio must be in 0..1000 (0 = off; got %g)", (double)c->max_itl_ratio);
    if (c->prefill_chunk < 1)
        return ks_fail(KS_ERR_INVALID_ARG, "--prefill-chunk must be at least 1 (got %d)", c->prefill_chunk);
    if (c->ctx_size < 2)
        return ks_fail(KS_ERR_INVALID_ARG, "--ctx-size must be at least 2 (got %d)", c->ctx_size);
    if (c->max_queue < 0)
        return ks_fail(KS_ERR_INVALID_ARG, "--max-queue must be >= 0 (got %d)", c->max_queue);
    if (c->n_eog < 0 || c->n_eog > 16)
        return ks_fail(KS_ERR_INVALID_ARG, "at most 16 end-of-generation tokens (got %d)", c->n_eog);
    if (!e || e->n_vocab < 1 || !e->seq_create || !e->seq_free || !e->forward || !e->sampler_create ||
        !e->sampler_next || !e->sampler_free)
        return ks_fail(KS_ERR_INVALID_ARG, "scheduler engine is incomplete");
    if (c->spec_type != SPEC_NONE && c->spec_type != SPEC_NGRAM && c->spec_type != SPEC_NGRAM_POOL &&
        c->spec_type != SPEC_DRAFT)
        return ks_fail(KS_ERR_INVALID_ARG, "--spec-type must be none, ngram, ngram-pool or draft");
    if (c->spec_type == SPEC_DRAFT && !e->draft)
        return ks_fail(KS_ERR_INVALID_ARG, "--spec-type draft needs a draft model (--model-draft FILE)");
    if (c->spec_type == SPEC_DRAFT && e->draft->n_vocab != e->n_vocab)
        return ks_fail(KS_ERR_INVALID_ARG, "the draft model's vocabulary has %d tokens, the target's %d",
                       e->draft->n_vocab, e->n_vocab);
    if (c->draft_max < 1 || c->draft_max > SPEC_DRAFT_LIMIT || c->draft_min < 0 || c->draft_min > c->draft_max)
        return ks_fail(KS_ERR_INVALID_ARG, "--draft-max must be in 1..%d and --draft-min in 0..--draft-max (got %d and %d)",
                       SPEC_DRAFT_LIMIT, c->draft_max, c->draft_min);
    if (c->spec_type != SPEC_NONE && (!e->sampler_verify || !e->seq_truncate))
        return ks_fail(KS_ERR_INVALID_ARG, "scheduler engine: speculation needs sampler_verify and seq_truncate");
    if (e->forward_embd && e->n_embd < 1)
        return ks_fail(KS_ERR_INVALID_ARG, "scheduler engine: embeddings need n_embd >= 1");
    if (!e->prefix_attach != !e->prefix_publish || (e->prefix_attach && e->page_tokens < 1))
        return ks_fail(KS_ERR_INVALID_ARG, "scheduler engine: a prefix cache needs attach, publish and a page size");
    return KS_OK;
}

static ks_status alloc_scratch(struct sched *s)
{
    int32_t n = s->cfg.max_batch_tokens;
    s->cap_batch = n;
    s->b_tokens = malloc((size_t)n * sizeof *s->b_tokens);
    s->b_pos = malloc((size_t)n * sizeof *s->b_pos);
    s->b_seq = malloc((size_t)n * sizeof *s->b_seq);
    s->b_logits = malloc((size_t)n * sizeof *s->b_logits);
    s->b_embed = malloc((size_t)n * sizeof *s->b_embed);
    s->embd = malloc((size_t)s->cfg.parallel * (size_t)(s->eng.n_embd > 0 ? s->eng.n_embd : 1) * sizeof *s->embd);
    s->b_owner = malloc((size_t)n * sizeof *s->b_owner);
    s->forked = malloc((size_t)s->cfg.parallel * sizeof *s->forked);
    /* one row per active sequence, and draft rows for a few verifying ones */
    int32_t draft_rows = s->cfg.spec_type == SPEC_NONE ? 0 : (s->cfg.parallel < 4 ? s->cfg.parallel : 4) * s->cfg.draft_max;
    if (draft_rows > n)
        draft_rows = n;
    s->cap_rows = s->cfg.parallel + draft_rows;
    s->logits = malloc((size_t)s->cap_rows * (size_t)s->eng.n_vocab * sizeof *s->logits);
    s->active = malloc((size_t)s->cfg.parallel * sizeof *s->active);
    s->draft_jobs = malloc((size_t)s->cfg.parallel * sizeof *s->draft_jobs);
    s->job_req = malloc((size_t)s->cfg.parallel * sizeof *s->job_req);
    if (!s->b_tokens || !s->b_pos || !s->b_seq || !s->b_logits || !s->b_embed || !s->embd || !s->b_owner || !s->forked || !s->logits || !s->active || !s->draft_jobs || !s->job_req)
        return ks_fail(KS_ERR_NOMEM, "scheduler scratch: out of memory");
    return KS_OK;
}

static void free_scratch(struct sched *s)
{
    free(s->b_tokens);
    free(s->b_pos);
    free(s->b_seq);
    free(s->b_logits);
    free(s->b_embed);
    free(s->embd);
    free(s->b_owner);
    free(s->forked);
    free(s->logits);
    free(s->active);
    free(s->draft_jobs);
    free(s->job_req);
    free(s->waiting);
}

ks_status sched_create(const struct sched_config *cfg, const struct sched_engine *engine, struct sched **out)
{
    ks_status st = check_config(cfg, engine);
    if (st)
        return st;
    struct sched *s = calloc(1, sizeof *s);
    if (!s)
        return ks_fail(KS_ERR_NOMEM, "scheduler: out of memory");
    s->cfg = *cfg;
    if (cfg->n_eog)
        memcpy(s->eog, cfg->eog, (size_t)cfg->n_eog * sizeof *s->eog);
    s->cfg.eog = s->eog;
    s->eng = *engine;
    sched_cost_init(&s->cost);
    const char *trace = getenv("KVSERVE_SCHED_TRACE");
    s->trace = trace && *trace && strcmp(trace, "0") ? stderr : NULL;
    /* A step's logit rows come from at most one entry per active sequence. */
    st = alloc_scratch(s);
    if (!st && cfg->spec_type == SPEC_NGRAM_POOL)
        st = spec_pool_create(cfg->pool_n, cfg->pool_bytes, &s->pool);
    if (!st && cfg->spec_type == SPEC_DRAFT)
        st = sched_drafter_create(engine->draft, cfg->max_batch_tokens, cfg->parallel, cfg->prefill_chunk,
                                  cfg->draft_p_min, &s->drafter);
    if (!st) {
        pthread_mutex_init(&s->mu, NULL);
        pthread_cond_init(&s->work, NULL);
        pthread_cond_init(&s->hook_done, NULL);
        if (pthread_create(&s->thread, NULL, sched_main, s) != 0)
            st = ks_fail(KS_ERR_NOMEM, "scheduler: cannot start its thread");
        else
            s->thread_started = true;
    }
    if (st) {
        s->eng.destroy = NULL; /* the caller still owns the engine on failure */
        sched_free(s);
        return st;
    }
    *out = s;
    return KS_OK;
}

void sched_free(struct sched *s)
{
    if (!s)
        return;
    if (s->thread_started) {
        pthread_mutex_lock(&s->mu);
        s->stop = true;
        s->cancel_all = true;
        pthread_cond_signal(&s->work);
        pthread_mutex_unlock(&s->mu);
        pthread_join(s->thread, NULL);
        pthread_mutex_destroy(&s->mu);
        pthread_cond_destroy(&s->work);
        pthread_cond_destroy(&s->hook_done);
    }
    free_scratch(s);
    spec_pool_free(s->pool);
    sched_drafter_free(s->drafter);
    if (s->eng.destroy)
        s->eng.destroy(s->eng.ctx);
    free(s);
}
