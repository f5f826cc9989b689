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
    sample_dry_breakers_free(c->dry_breakers);
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
    c->post_probs = c0->post_probs;
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

/* Append c0 and its n_choices - 1 clones to g, indices from c0->index
 * (false when out of memory; c0 is then released, the clones made too). */
static bool group_add(struct group *g, struct call *c0)
{
    int first = g->n, n = c0->n_choices;
    g->calls[g->n++] = c0;
    while (g->n < first + n) {
        struct call *c = call_clone(c0, c0->index + (g->n - first));
        if (!c)
            break;
        g->calls[g->n++] = c;
    }
    if (g->n == first + n)
        return true;
    while (g->n > first)
        server_call_unref(g->calls[--g->n]);
    return false;
}

static struct group *group_alloc(struct server *srv)
{
    struct group *g = calloc(1, sizeof *g);
    if (g)
        g->srv = srv;
    return g;
}

/* The group's calls still unsubmitted are released with it. */
static void group_free_unsubmitted(struct group *g)
{
    for (int i = 0; i < g->n; i++)
        server_call_unref(g->calls[i]);
    free(g);
}

void server_completion_discard(struct call *c, struct sched_request *rq)
{
    free((int32_t *)rq->prompt);
    server_call_unref(c);
}

/* Submit calls[first, first + count) of g, the choices of one prompt,
 * choice i sampling with the request's seed + i. The calls' locks are held
 * so the scheduler cannot deliver events before their sched_id is set. */
static ks_status group_submit(struct group *g, int first, int count, const struct sched_request *rq)
{
    struct sched_choice choices[MAX_CHOICES];
    uint64_t ids[MAX_CHOICES];
    struct call **calls = g->calls + first;
    for (int i = 0; i < count; i++) {
        calls[i]->waker = g->waker;
        choices[i] = (struct sched_choice){rq->sampling, calls[i]};
        choices[i].sampling.seed += (uint64_t)i;
        calls[i]->refs = 2; /* HTTP side + scheduler side until the final event */
        pthread_mutex_lock(&calls[i]->mu);
    }
    double now = server_now();
    for (int i = 0; i < count; i++)
        calls[i]->t_submit = now;
    ks_status st = sched_submit_n(g->srv->sched, rq, choices, count, ids);
    for (int i = 0; i < count; i++) {
        if (st)
            calls[i]->refs = 1;
        else
            calls[i]->sched_id = ids[i];
        pthread_mutex_unlock(&calls[i]->mu);
    }
    return st;
}

/* Submit the group's prompts (rqs[p]: the choices from calls[p * n]) and
 * answer: whole, suspended, or streamed. Frees the prompts. */
static ks_status group_run(struct group *g, const struct server_req *req, struct sched_request *rqs, int n_rqs,
                           struct reply *r)
{
    struct server *srv = g->srv;
    pthread_mutex_lock(&srv->mu);
    srv->in_flight++;
    pthread_mutex_unlock(&srv->mu);
    g->turn = g->n - 1; /* the stream starts with choice 0 */
    g->waker = req->waker;
    if (g->waker)
        server_waker_ref(g->waker);
    int per = g->n / n_rqs;
    ks_status st = KS_OK;
    for (int p = 0; p < n_rqs; p++) {
        server_salt_from_key(srv, req->authorization, &rqs[p]);
        if (!st)
            st = group_submit(g, p * per, per, &rqs[p]);
        free((int32_t *)rqs[p].prompt);
    }
    if (st) {
        if (st == KS_ERR_STATE) {
            r->retry_after = 1;
            st = reply_fail(r, st, "overloaded", "%s", ks_errmsg());
        }
        server_group_done(g); /* the prompts submitted are cancelled */
        return st;            /* 400 a prompt (or n) the scheduler refuses, 500 out of memory */
    }
    struct call *c = g->calls[0];
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

static ks_status completion(struct server *srv, enum server_api api, const struct server_req *req, struct reply *r)
{
    struct call *c = NULL;
    struct sched_request rq;
    ks_status st = server_request_parse(srv, api, req->body, req->len, &c, &rq, r);
    if (st)
        return st;
    struct group *g = group_alloc(srv);
    if (!g)
        server_call_unref(c);
    if (!g || !group_add(g, c)) {
        free(g);
        free((int32_t *)rq.prompt);
        return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while starting the request's choices");
    }
    return group_run(g, req, &rq, 1, r);
}

/* ---- several prompts ------------------------------------------------------------- */

/* /v1/completions' and /completion's prompt as a list of prompts (strings or token-id lists,
 * at least two), detached from root (the caller deletes both); NULL for one
 * prompt, which the plain path takes (a list of ids, or [text]). */
static cJSON *prompt_list(const struct server_req *req, cJSON **root)
{
    const char *end = NULL;
    *root = cJSON_ParseWithLengthOpts(req->body, req->len, &end, false);
    if (cJSON_IsObject(*root) && server_json_strict(req->body, req->len, end, *root, NULL)) {
        cJSON_Delete(*root); /* the plain path answers why */
        *root = NULL;
        return NULL;
    }
    cJSON *p = cJSON_IsObject(*root) ? cJSON_GetObjectItemCaseSensitive(*root, "prompt") : NULL;
    if (cJSON_IsArray(p) && cJSON_GetArraySize(p) >= 2 && (cJSON_IsString(p->child) || cJSON_IsArray(p->child)))
        return cJSON_DetachItemViaPointer(*root, p); /* each prompt in turn takes its place */
    cJSON_Delete(*root);
    *root = NULL;
    return NULL;
}

/* The body with prompt replaced by list[index], parsed as one request. */
static ks_status parse_one_prompt(struct server *srv, enum server_api api, cJSON *root, const cJSON *list, int index,
                                  struct call **c, struct sched_request *rq, struct reply *r)
{
    cJSON *one = cJSON_Duplicate(cJSON_GetArrayItem(list, index), 1);
    char *body = NULL;
    cJSON_DeleteItemFromObjectCaseSensitive(root, "prompt");
    if (one && cJSON_AddItemToObject(root, "prompt", one))
        body = cJSON_PrintUnformatted(root);
    else
        cJSON_Delete(one);
    if (!body)
        return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while reading 'prompt'");
    ks_status st = server_request_parse(srv, api, body, strlen(body), c, rq, r);
    free(body);
    if (st)
        return reply_fail(r, st, r->err_code, "prompt %d: %s", index, ks_errmsg());
    return KS_OK;
}

/* Several prompts in one request (OpenAI's batch form, and llama-server's
 * on /completion): each prompt is a request of its own to the scheduler
 * (batched like any others), with n choices each; choice j of prompt p is
 * choices[p * n + j], and usage counts each prompt once. /completion
 * answers an array of its results, in prompt order. */
static ks_status completion_prompts(struct server *srv, enum server_api api, const struct server_req *req,
                                    cJSON *root, const cJSON *list, struct reply *r)
{
    int n_prompts = cJSON_GetArraySize(list);
    if (n_prompts > MAX_CHOICES)
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "at most %d prompts in one request (got %d)",
                          MAX_CHOICES, n_prompts);
    struct sched_request rqs[MAX_CHOICES];
    struct group *g = group_alloc(srv);
    if (!g)
        return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while starting the request's choices");
    ks_status st = KS_OK;
    int parsed = 0;
    for (int p = 0; p < n_prompts && !st; p++) {
        struct call *c;
        if ((st = parse_one_prompt(srv, api, root, list, p, &c, &rqs[p], r)))
            break;
        parsed++;
        if ((int64_t)n_prompts * c->n_choices > MAX_CHOICES) {
            st = reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                            "%d prompts x n = %d make %d choices; at most %d in one request", n_prompts,
                            c->n_choices, n_prompts * c->n_choices, MAX_CHOICES);
            server_call_unref(c);
            break;
        }
        if (p > 0)
            memcpy(c->id, g->calls[0]->id, sizeof c->id); /* one response id */
        c->index = g->n;
        if (!group_add(g, c))
            st = reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while starting the request's choices");
    }
    if (st) {
        for (int p = 0; p < parsed; p++)
            free((int32_t *)rqs[p].prompt);
        group_free_unsubmitted(g);
        return st;
    }
    return group_run(g, req, rqs, n_prompts, r);
}

ks_status server_route_chat(struct server *srv, const struct server_req *rq, struct reply *r)
{
    return completion(srv, SERVER_API_CHAT, rq, r);
}

static ks_status completion_or_prompts(struct server *srv, enum server_api api, const struct server_req *rq,
                                       struct reply *r)
{
    cJSON *root;
    cJSON *list = prompt_list(rq, &root);
    if (!list)
        return completion(srv, api, rq, r);
    ks_status st = completion_prompts(srv, api, rq, root, list, r);
    cJSON_Delete(list);
    cJSON_Delete(root);
    return st;
}

ks_status server_route_completions(struct server *srv, const struct server_req *rq, struct reply *r)
{
    return completion_or_prompts(srv, SERVER_API_TEXT, rq, r);
}

ks_status server_route_completion_native(struct server *srv, const struct server_req *rq, struct reply *r)
{
    return completion_or_prompts(srv, SERVER_API_NATIVE, rq, r);
}

double server_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}
