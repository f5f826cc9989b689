/* The draft model's passes (sched.h, "the draft model's passes"). */
#include "sched/sched.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct sched_drafter {
    const struct sched_engine *eng; /* the draft model's engine (borrowed) */
    int32_t max_batch, chunk;
    int parallel;
    float p_min;
    double step_s;                     /* the last pass's draft steps: seconds in all */
    int n_steps;                       /* and how many */
    struct sched_drafter_counts counts; /* since it was made */
    /* a forward's scratch */
    int32_t *b_tokens, *b_pos, *b_seq; /* (max_batch) */
    bool *b_logits;                    /* (max_batch) */
    int *row_job;                      /* (parallel) the job of each logits row */
    bool *ready;                       /* (parallel) the job has a sequence this pass */
    int32_t *took;                     /* (parallel) its catch-up tokens this pass */
    float *logits;                     /* (parallel, n_vocab) */
};

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void sched_draft_seq_init(struct sched_draft_seq *ds)
{
    memset(ds, 0, sizeof *ds);
    ds->seq = -1;
}

ks_status sched_drafter_create(const struct sched_engine *draft, int32_t max_batch, int parallel, int32_t chunk,
                               float p_min, struct sched_drafter **out)
{
    *out = NULL;
    if (!draft || !draft->forward || !draft->seq_create || !draft->seq_free || !draft->seq_truncate ||
        draft->n_vocab < 1 || max_batch < parallel || parallel < 1 || chunk < 1)
        return ks_fail(KS_ERR_INVALID_ARG, "scheduler: the draft model's engine is incomplete");
    if (!(p_min >= 0.0f && p_min <= 1.0f))
        return ks_fail(KS_ERR_INVALID_ARG, "--draft-p-min must be in 0..1 (got %g)", (double)p_min);
    struct sched_drafter *d = calloc(1, sizeof *d);
    if (!d)
        return ks_fail(KS_ERR_NOMEM, "scheduler: out of memory for the draft model's scratch");
    d->eng = draft;
    d->max_batch = max_batch;
    d->parallel = parallel;
    d->chunk = chunk;
    d->p_min = p_min;
    d->b_tokens = malloc((size_t)max_batch * sizeof *d->b_tokens);
    d->b_pos = malloc((size_t)max_batch * sizeof *d->b_pos);
    d->b_seq = malloc((size_t)max_batch * sizeof *d->b_seq);
    d->b_logits = malloc((size_t)max_batch * sizeof *d->b_logits);
    d->row_job = malloc((size_t)parallel * sizeof *d->row_job);
    d->ready = malloc((size_t)parallel * sizeof *d->ready);
    d->took = malloc((size_t)parallel * sizeof *d->took);
    d->logits = malloc((size_t)parallel * (size_t)draft->n_vocab * sizeof *d->logits);
    if (!d->b_tokens || !d->b_pos || !d->b_seq || !d->b_logits || !d->row_job || !d->ready || !d->took || !d->logits) {
        sched_drafter_free(d);
        return ks_fail(KS_ERR_NOMEM, "scheduler: out of memory for the draft model's scratch");
    }
    *out = d;
    return KS_OK;
}

void sched_drafter_free(struct sched_drafter *d)
{
    if (!d)
        return;
    free(d->b_tokens);
    free(d->b_pos);
    free(d->b_seq);
    free(d->b_logits);
    free(d->row_job);
    free(d->ready);
    free(d->took);
    free(d->logits);
    free(d);
}

static void seq_drop(struct sched_drafter *d, struct sched_draft_seq *ds)
{
    if (ds->seq >= 0)
        d->eng->seq_free(d->eng->ctx, ds->seq);
    int32_t base = ds->base;
    sched_draft_seq_init(ds);
    ds->base = base; /* a sequence started over keeps its window */
}

/* The part of a job's text its draft sequence holds from position 0 on:
 * the whole text, or its window from ds->base. */
static const int32_t *seq_text(const struct sched_draft_job *j)
{
    return j->tokens + j->ds->base;
}

static int32_t seq_len(const struct sched_draft_job *j)
{
    return j->n_tokens - j->ds->base;
}

/* The fed drafts that the request's tokens now continue with become
 * computed; the rows of the rest are cut off. A sequence that cannot be cut
 * there (a sliding window's rows are gone) starts over. */
static void reconcile(struct sched_drafter *d, struct sched_draft_seq *ds, const int32_t *tokens, int32_t n_tokens)
{
    int32_t kept = 0;
    while (kept < ds->n_fed && ds->n_computed + kept < n_tokens && ds->fed[kept] == tokens[ds->n_computed + kept])
        kept++;
    bool cut = kept < ds->n_fed;
    ds->n_computed += kept;
    ds->n_fed = 0;
    if (cut && d->eng->seq_truncate(d->eng->ctx, ds->seq, ds->n_computed) != KS_OK)
        seq_drop(d, ds);
}

/* A sequence for the job (mapping what the draft prefix cache holds of its
 * tokens), reconciled with its tokens. false: none could be had. */
static bool prepare(struct sched_drafter *d, struct sched_draft_job *j)
{
    const struct sched_engine *e = d->eng;
    struct sched_draft_seq *ds = j->ds;
    if (ds->seq >= 0)
        reconcile(d, ds, seq_text(j), seq_len(j));
    if (ds->seq < 0) {
        if (e->seq_create(e->ctx, &ds->seq) != KS_OK) {
            ds->seq = -1;
            return false;
        }
        bool salted = j->salt_lo || j->salt_hi;
        if (salted && e->seq_set_salt && e->seq_set_salt(e->ctx, ds->seq, j->salt_lo, j->salt_hi) != KS_OK) {
            seq_drop(d, ds);
            return false;
        }
        if (salted && !e->seq_set_salt)
            j->share = false;
    }
    /* the last token is computed, not mapped: its logits give the first draft */
    if (j->share && e->prefix_attach && ds->n_computed < seq_len(j) - 1) {
        struct sched_prefix_hit hit = {0};
        if (e->prefix_attach(e->ctx, ds->seq, seq_text(j), seq_len(j) - 1, false, 0.0, &hit) == KS_OK)
            ds->n_computed += hit.ram_tokens;
    }
    return true;
}

/* Uniform in [0, 1) from a request's draft stream (xorshift64, state != 0). */
static double draft_uniform(uint64_t *state)
{
    uint64_t x = *state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *state = x;
    return (double)(x >> 11) * (1.0 / 9007199254740992.0);
}

static const struct sample_params GREEDY = {.temp = 0.0f};

/* Take row r's proposal for its job: the argmax when it is greedy, else a
 * draw from q; unless the draft model is unsure of its best token (or its
 * logits are unusable), which ends the job's drafts in this pass. */
static void take_proposal(struct sched_drafter *d, struct sched_draft_job *j, const float *row)
{
    bool sampled = j->sampling && j->sampling->temp > 0.0f && j->rng && *j->rng;
    struct sample_proposal *q = &j->q[j->n_draft];
    float p_top;
    if (sample_proposal_make(sampled ? j->sampling : &GREEDY, row, d->eng->n_vocab, q, &p_top) != KS_OK ||
        p_top < d->p_min) {
        j->k = j->n_draft; /* no more drafts for it in this pass */
        return;
    }
    j->draft[j->n_draft++] = sampled ? sample_proposal_draw(q, draft_uniform(j->rng)) : q->tokens[0];
}

static void batch_put(struct sched_drafter *d, int32_t *n, int32_t tok, int32_t pos, int32_t seq, bool logits)
{
    d->b_tokens[*n] = tok;
    d->b_pos[*n] = pos;
    d->b_seq[*n] = seq;
    d->b_logits[*n] = logits;
    (*n)++;
}

static ks_status forward(struct sched_drafter *d, int32_t n)
{
    struct sched_batch b = {n, d->b_tokens, d->b_pos, d->b_seq, d->b_logits, NULL};
    ks_status st = d->eng->forward(d->eng->ctx, &b, d->logits);
    if (st == KS_OK) {
        d->counts.forwards++;
        d->counts.tokens += (uint64_t)n;
    }
    return st;
}

/* Catch up on every job's unseen tokens in one forward; returns whether it ran. */
static bool catch_up(struct sched_drafter *d, struct sched_draft_job *jobs, int n_jobs)
{
    const bool *ready = d->ready;
    int32_t *took = d->took;
    int32_t n = 0, rows = 0;
    for (int i = 0; i < n_jobs; i++) {
        struct sched_draft_job *j = &jobs[i];
        int32_t from = j->ds->n_computed, len = seq_len(j), take = len - from;
        took[i] = 0;
        if (!ready[i] || take <= 0)
            continue;
        if (take > d->chunk)
            take = d->chunk;
        if (take > d->max_batch - n)
            take = d->max_batch - n;
        if (take <= 0)
            continue;
        bool logits = from + take == len && j->k > 0;
        for (int32_t t = 0; t < take; t++)
            batch_put(d, &n, seq_text(j)[from + t], from + t, j->ds->seq, logits && t == take - 1);
        if (logits)
            d->row_job[rows++] = i;
        took[i] = take;
    }
    if (n == 0)
        return false;
    double t0 = now_seconds();
    if (forward(d, n) != KS_OK)
        return false;
    /* a catch-up of a token or two per drafting request costs what a draft
     * step does: it is one (every verification starts with one) */
    if (rows > 0 && n <= 2 * rows) {
        d->step_s += now_seconds() - t0;
        d->n_steps++;
    }
    for (int i = 0; i < n_jobs; i++) {
        jobs[i].ds->n_computed += took[i];
        jobs[i].n_work += took[i];
    }
    for (int32_t r = 0; r < rows; r++)
        take_proposal(d, &jobs[d->row_job[r]], d->logits + (size_t)r * d->eng->n_vocab);
    return true;
}

/* One more draft for every job still drafting: feed its last draft. Returns
 * whether any job was fed. */
static bool draft_step(struct sched_drafter *d, struct sched_draft_job *jobs, int n_jobs)
{
    int32_t n = 0, rows = 0;
    for (int i = 0; i < n_jobs; i++) {
        struct sched_draft_job *j = &jobs[i];
        struct sched_draft_seq *ds = j->ds;
        if (j->n_draft == 0 || j->n_draft >= j->k || ds->n_fed != j->n_draft - 1 || n >= d->max_batch)
            continue;
        int32_t tok = j->draft[j->n_draft - 1];
        batch_put(d, &n, tok, ds->n_computed + ds->n_fed, ds->seq, true);
        ds->fed[ds->n_fed++] = tok;
        d->row_job[rows++] = i;
        j->n_work++;
    }
    if (n == 0)
        return false;
    double t0 = now_seconds();
    if (forward(d, n) != KS_OK) { /* all or nothing: nobody was fed */
        for (int32_t r = 0; r < rows; r++) {
            jobs[d->row_job[r]].n_work--;
            jobs[d->row_job[r]].ds->n_fed--;
            jobs[d->row_job[r]].k = jobs[d->row_job[r]].n_draft;
        }
        return false;
    }
    d->step_s += now_seconds() - t0;
    d->n_steps++;
    for (int32_t r = 0; r < rows; r++)
        take_proposal(d, &jobs[d->row_job[r]], d->logits + (size_t)r * d->eng->n_vocab);
    return true;
}

void sched_drafter_run(struct sched_drafter *d, struct sched_draft_job *jobs, int n)
{
    d->step_s = 0;
    d->n_steps = 0;
    if (n > d->parallel)
        n = d->parallel;
    for (int i = 0; i < n; i++) {
        jobs[i].n_draft = 0;
        jobs[i].n_work = 0;
        if (jobs[i].k > SPEC_DRAFT_LIMIT)
            jobs[i].k = SPEC_DRAFT_LIMIT;
        d->ready[i] = prepare(d, &jobs[i]);
    }
    if (!catch_up(d, jobs, n))
        return;
    while (draft_step(d, jobs, n))
        ;
    for (int i = 0; i < n && d->eng->prefix_publish; i++)
        if (d->ready[i] && jobs[i].share && jobs[i].ds->seq >= 0)
            d->eng->prefix_publish(d->eng->ctx, jobs[i].ds->seq, seq_text(&jobs[i]), jobs[i].ds->n_computed, false);
}

void sched_drafter_release(struct sched_drafter *d, struct sched_draft_seq *ds, const int32_t *tokens,
                           int32_t n_tokens, bool share)
{
    if (ds->seq >= 0) {
        reconcile(d, ds, tokens + ds->base, n_tokens - ds->base);
        if (ds->seq >= 0 && share && d->eng->prefix_publish)
            d->eng->prefix_publish(d->eng->ctx, ds->seq, tokens + ds->base, ds->n_computed, true);
    }
    if (ds->seq >= 0)
        d->eng->seq_free(d->eng->ctx, ds->seq);
    sched_draft_seq_init(ds);
}

void sched_drafter_restart(struct sched_drafter *d, struct sched_draft_seq *ds, const int32_t *tokens,
                           int32_t n_tokens, int32_t base, bool share)
{
    sched_drafter_release(d, ds, tokens, n_tokens, share);
    ds->base = base < 0 ? 0 : base > n_tokens ? n_tokens : base;
}

int32_t sched_draft_afford(const struct sched_draft_seq *ds, int32_t n_tokens, bool drafting, double credit,
                           int32_t *lead, bool *window)
{
    const int32_t lag = n_tokens - ds->base - ds->n_computed;
    const int32_t win = n_tokens < SCHED_DRAFT_WINDOW ? n_tokens : SCHED_DRAFT_WINDOW;
    *window = lag > win && (!drafting || credit < lag);
    *lead = *window ? win : lag;
    if (credit < *lead)
        return 0;
    return credit - *lead >= SPEC_DRAFT_LIMIT ? SPEC_DRAFT_LIMIT : 1 + (int32_t)(credit - *lead);
}

void sched_drafter_get_counts(const struct sched_drafter *d, struct sched_drafter_counts *out)
{
    *out = d->counts;
}

double sched_drafter_step_seconds(const struct sched_drafter *d)
{
    return d->n_steps > 0 ? d->step_s / d->n_steps : 0.0;
}
