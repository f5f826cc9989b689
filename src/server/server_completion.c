/* POST /v1/chat/completions and /v1/completions: a request's calls (one per
 * choice) from start to release: the scheduler's events, submission and the
 * routes. Parsing is in server_completion_parse.c, the answer in
 * server_completion_reply.c. */
#include "server/server_completion_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void server_call_unref(struct call *c)
{
    pthread_mutex_lock(&c->mu);
    int left = --c->refs;
    pthread_mutex_unlock(&c->mu);
    if (left > 0)
        return;
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c->items);
    for (int i = 0; i < c->n_stop; i++)
        free(c->stop[i]);
    tok_stream_free(c->detok);
    sbuf_free(&c->text);
    sbuf_free(&c->out);
    cJSON_Delete(c->lp);
    grammar_free(c->grammar);
    free(c->biases);
    free(c);
}

/* Scheduler thread: queue the token or the end. A token that cannot be
 * queued fails the request (never a silent gap in the text): it is
 * cancelled, so its pages are freed, and the HTTP side answers with an
 * out-of-memory error. */
void server_call_on_event(void *user, const struct sched_event *ev)
{
    struct call *c = user;
    bool cancel = false;
    double now = server_now();
    pthread_mutex_lock(&c->mu);
    c->n_cached = ev->n_cached;
    if (ev->finish == SCHED_FINISH_NONE && c->t_first == 0)
        c->t_first = now;
    if (ev->finish != SCHED_FINISH_NONE)
        c->t_end = now;
    c->n_drafted = ev->n_drafted;
    c->n_accepted = ev->n_accepted;
    if (ev->finish == SCHED_FINISH_NONE) {
        if (c->n_items == c->cap_items && !c->dropped) {
            int cap = c->cap_items ? 2 * c->cap_items : 64;
            struct item *p = realloc(c->items, (size_t)cap * sizeof *p);
            if (p) {
                c->items = p;
                c->cap_items = cap;
            } else {
                c->dropped = cancel = true;
            }
        }
        if (!c->dropped) {
            c->items[c->n_items].token = ev->token;
            c->items[c->n_items].res = *ev->sample;
            c->n_items++;
        }
    } else {
        c->finished = true;
        c->finish = ev->finish;
        if (ev->error)
            snprintf(c->error, sizeof c->error, "%s", ev->error);
    }
    pthread_cond_broadcast(&c->cv);
    if (c->waker)
        server_wake(c->waker);
    pthread_mutex_unlock(&c->mu);
    if (cancel)
        sched_cancel(c->srv->sched, ev->id);
    if (ev->finish != SCHED_FINISH_NONE)
        server_call_unref(c);
}

/* The HTTP side lets go of c: a choice still running is cancelled (the
 * client went away, or another choice failed). */
static void call_release(struct call *c)
{
    pthread_mutex_lock(&c->mu);
    bool finished = c->finished;
    c->waker = NULL;
    pthread_mutex_unlock(&c->mu);
    if (!finished)
        sched_cancel(c->srv->sched, c->sched_id);
    server_call_unref(c);
}

void server_group_done(struct group *g)
{
    struct server *srv = g->srv;
    for (int i = 0; i < g->n; i++)
        call_release(g->calls[i]);
    if (g->waker)
        server_waker_unref(g->waker);
    pthread_mutex_lock(&srv->mu);
    srv->in_flight--;
    pthread_mutex_unlock(&srv->mu);
    free(g);
}
/* ---- entry --------------------------------------------------------------------------- */

static struct call *call_alloc(struct server *srv, bool chat)
{
    struct call *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->srv = srv;
    c->chat = chat;
    c->refs = 1;
    c->stop_word = -1;
    c->created = (long)time(NULL);
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    if (tok_stream_create(srv->tok, TOK_DECODE_REPLACE_BAD, &c->detok) != KS_OK) {
        server_call_unref(c);
        return NULL;
    }
    return c;
}

struct call *server_call_new(struct server *srv, bool chat)
{
    struct call *c = call_alloc(srv, chat);
    if (!c)
        return NULL;
    pthread_mutex_lock(&srv->mu);
    uint64_t n = ++srv->next_call;
    pthread_mutex_unlock(&srv->mu);
    snprintf(c->id, sizeof c->id, "%s-%llu", chat ? "chatcmpl" : "cmpl", (unsigned long long)n);
    return c;
}

/* Choice index of the request c0 parsed: the same options and id, its own
 * output state (the compiled grammar stays c0's; each sampler holds it). */
static struct call *call_clone(const struct call *c0, int index)
{
    struct call *c = call_alloc(c0->srv, c0->chat);
    if (!c)
        return NULL;
    memcpy(c->id, c0->id, sizeof c->id);
    c->created = c0->created;
    c->index = index;
    c->n_choices = c0->n_choices;
    c->stream = c0->stream;
    c->include_usage = c0->include_usage;
    c->logprobs = c0->logprobs;
    c->n_prompt = c0->n_prompt;
    c->max_stop = c0->max_stop;
    c->tools = c0->tools;
    c->tool_fmt = c0->tool_fmt;
    c->harmony_calls = c0->harmony_calls;
    c->think = c0->think;
    c->think_open = c0->think_open;
    c->native = c0->native;
    for (int i = 0; i < c0->n_stop; i++, c->n_stop++)
        if (!(c->stop[i] = strdup(c0->stop[i]))) {
            server_call_unref(c);
            return NULL;
        }
    return c;
}

/* The request's n choices: c0 and its clones (NULL when out of memory; c0
 * is then released). */
static struct group *group_new(struct call *c0)
{
    struct group *g = calloc(1, sizeof *g);
    if (g) {
        g->srv = c0->srv;
        g->calls[g->n++] = c0;
    }
    while (g && g->n < c0->n_choices) {
        struct call *c = call_clone(c0, g->n);
        if (!c)
            break;
        g->calls[g->n++] = c;
    }
    if (g && g->n == c0->n_choices) {
        g->turn = g->n - 1; /* the stream starts with choice 0 */
        return g;
    }
    for (int i = 0; g && i < g->n; i++)
        server_call_unref(g->calls[i]);
    if (!g)
        server_call_unref(c0);
    free(g);
    return NULL;
}

void server_completion_discard(struct call *c, struct sched_request *rq)
{
    free((int32_t *)rq->prompt);
    server_call_unref(c);
}

/* Submit the group's choices, choice i sampling with the request's seed + i.
 * The calls' locks are held so the scheduler cannot deliver events before
 * their sched_id is set. */
static ks_status group_submit(struct group *g, const struct sched_request *rq)
{
    struct sched_choice choices[MAX_CHOICES];
    uint64_t ids[MAX_CHOICES];
    for (int i = 0; i < g->n; i++) {
        g->calls[i]->waker = g->waker;
        choices[i] = (struct sched_choice){rq->sampling, g->calls[i]};
        choices[i].sampling.seed += (uint64_t)i;
        g->calls[i]->refs = 2; /* HTTP side + scheduler side until the final event */
        pthread_mutex_lock(&g->calls[i]->mu);
    }
    double now = server_now();
    for (int i = 0; i < g->n; i++)
        g->calls[i]->t_submit = now;
    ks_status st = sched_submit_n(g->srv->sched, rq, choices, g->n, ids);
    for (int i = 0; i < g->n; i++) {
        if (st)
            g->calls[i]->refs = 1;
        else
            g->calls[i]->sched_id = ids[i];
        pthread_mutex_unlock(&g->calls[i]->mu);
    }
    return st;
}

static ks_status completion(struct server *srv, enum server_api api, const struct server_req *req, struct reply *r)
{
    if (srv->cfg.no_generation)
        return reply_fail(r, KS_ERR_UNSUPPORTED, "not_supported",
                          "this model's attention is not causal (an embedding model): it serves /v1/embeddings "
                          "(with --embeddings), not completions");
    struct call *c = NULL;
    struct sched_request rq;
    ks_status st = server_request_parse(srv, api, req->body, req->len, &c, &rq, r);
    if (st)
        return st;
    int32_t *ids = (int32_t *)rq.prompt;
    struct group *g = group_new(c);
    if (!g) {
        free(ids);
        return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while starting the request's choices");
    }
    pthread_mutex_lock(&srv->mu);
    srv->in_flight++;
    pthread_mutex_unlock(&srv->mu);
    g->waker = req->waker;
    if (g->waker)
        server_waker_ref(g->waker);
    st = group_submit(g, &rq);
    free(ids);
    if (st) {
        if (st == KS_ERR_STATE) {
            r->retry_after = 1;
            st = reply_fail(r, st, "overloaded", "%s", ks_errmsg());
        }
        server_group_done(g);
        return st; /* 400 a prompt (or n) the scheduler refuses, 500 out of memory */
    }
    if (!c->stream && g->waker) { /* answered when the choices are over, no thread held meanwhile */
        server_reply_wait(g, r);
        return KS_OK;
    }
    if (!c->stream) {
        st = server_reply_whole(g, r);
        server_group_done(g);
        return st;
    }
    server_reply_stream(g, r);
    return KS_OK;
}

ks_status server_route_chat(struct server *srv, const struct server_req *rq, struct reply *r)
{
    return completion(srv, SERVER_API_CHAT, rq, r);
}

ks_status server_route_completions(struct server *srv, const struct server_req *rq, struct reply *r)
{
    return completion(srv, SERVER_API_TEXT, rq, r);
}

ks_status server_route_completion_native(struct server *srv, const struct server_req *rq, struct reply *r)
{
    return completion(srv, SERVER_API_NATIVE, rq, r);
}

double server_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}
