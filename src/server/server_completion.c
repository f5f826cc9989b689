/* POST /v1/chat/completions and /v1/completions: parse and validate the
 * request, tokenize, submit to the scheduler, then turn the token events into
 * text (streaming detokenizer, stop strings, logprobs) as one JSON response or
 * as SSE chunks. */
#include "server/server_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_STOP 4
#define MAX_STOP_LEN 256
#define MAX_CHOICES 16

struct item {
    int32_t token;
    struct sample_result res;
};

/* One choice of a request, shared by its HTTP thread and the scheduler
 * thread (which holds a reference until the final event). */
struct call {
    struct server *srv;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;
    /* filled by the scheduler thread */
    struct item *items;
    int n_items, cap_items;
    bool finished;
    bool dropped;                      /* a token could not be queued (out of memory): cancelled */
    enum sched_finish finish;
    char error[256];
    /* request options */
    uint64_t sched_id;
    bool chat, stream, include_usage;
    int logprobs;                      /* -1: off; else number of alternatives */
    char *stop[MAX_STOP];
    int n_stop;
    size_t max_stop;
    char id[48];
    long created;
    int index;                         /* the choice's index in 'choices' */
    int n_choices;                     /* 'n' of the request */
    int32_t n_prompt;
    int32_t n_cached;                  /* prompt tokens the prefix cache served (under mu) */
    int32_t n_drafted, n_accepted;     /* speculation: draft tokens verified, accepted (under mu) */
    struct server_waker *waker;        /* woken at each event (under mu); NULL: the HTTP side blocks, or left */
    struct grammar *grammar;           /* response_format / grammar constraint, NULL: none */
    /* output state (HTTP thread only) */
    int consumed;
    struct tok_stream *detok;
    struct sbuf text;                  /* generated text, cut at a stop string */
    size_t sent;                       /* bytes of text already streamed */
    bool stopped;                      /* a stop string matched */
    cJSON *lp;                         /* accumulated logprobs (non-streaming), NULL: none asked */
    bool oom;                          /* output was lost to an allocation failure */
    bool waited;                       /* a whole reply: its wait has begun (lp is set up) */
    struct sbuf out;                   /* pending SSE bytes */
    size_t out_pos;
    const char *tail;                  /* static SSE bytes sent after out (the out-of-memory error) */
    size_t tail_pos;
    bool role_sent, done;              /* done: the choice's last chunk is in out */
    /* tool calling (chat) */
    struct server_tool_opts tools;
    enum server_tool_format tool_fmt;  /* SERVER_TOOLS_NONE: the output is all content */
    int calls_sent;                    /* tool calls already streamed */
    int n_calls;                       /* tool calls in the answer (set by the final parse) */
    bool harmony_calls;                /* harmony: tools offered, so its calls are parsed */
    size_t sent_reasoning, sent_content; /* harmony: bytes of each part already streamed */
};

/* The n choices of one request (HTTP thread). A stream serves them in
 * turn, a choice's chunks in order; it ends with one usage chunk and one
 * [DONE]. */
struct group {
    struct server *srv;
    struct call *calls[MAX_CHOICES];
    int n;
    int turn;                          /* the choice the stream serves next */
    struct server_waker *waker;        /* the connection's (a reference), NULL: in-process, blocking */
    bool ended;                        /* [DONE] (or a failure's end) is in calls[turn]'s out */
};

#define DROPPED_MSG "out of memory: a generated token could not be kept; the request was cancelled"
#define OOM_MSG "out of memory while writing the response; the request was cancelled"

static void call_unref(struct call *c)
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
    free(c);
}

/* Scheduler thread: queue the token or the end. A token that cannot be
 * queued fails the request (never a silent gap in the text): it is
 * cancelled, so its pages are freed, and the HTTP side answers with an
 * out-of-memory error. */
static void on_event(void *user, const struct sched_event *ev)
{
    struct call *c = user;
    bool cancel = false;
    pthread_mutex_lock(&c->mu);
    c->n_cached = ev->n_cached;
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
        call_unref(c);
}

/* ---- request parsing ------------------------------------------------------------ */

/* A field that is absent or null reads as "not given". */
static cJSON *field(const cJSON *root, const char *key)
{
    cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
    return cJSON_IsNull(v) ? NULL : v;
}

static ks_status get_number(const cJSON *root, const char *key, double lo, double hi, double *out, struct reply *r)
{
    cJSON *v = field(root, key);
    if (!v)
        return KS_OK;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'%s' must be a number", key);
    if (v->valuedouble < lo || v->valuedouble > hi)
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'%s' must be in [%g, %g] (got %g)", key, lo, hi,
                          v->valuedouble);
    *out = v->valuedouble;
    return KS_OK;
}

static ks_status get_int(const cJSON *root, const char *key, double lo, double hi, int64_t *out, struct reply *r)
{
    cJSON *v = field(root, key);
    if (!v)
        return KS_OK;
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'%s' must be an integer", key);
    if (v->valuedouble < lo || v->valuedouble > hi)
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'%s' must be in [%.0f, %.0f] (got %.0f)", key, lo,
                          hi, v->valuedouble);
    *out = (int64_t)v->valuedouble;
    return KS_OK;
}

static ks_status get_bool(const cJSON *root, const char *key, bool *out, struct reply *r)
{
    cJSON *v = field(root, key);
    if (!v)
        return KS_OK;
    if (!cJSON_IsBool(v))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'%s' must be true or false", key);
    *out = cJSON_IsTrue(v);
    return KS_OK;
}

static ks_status add_stop(struct call *c, const cJSON *s, struct reply *r)
{
    if (!cJSON_IsString(s))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'stop' must be a string or a list of strings");
    size_t n = strlen(s->valuestring);
    if (n == 0)
        return KS_OK;
    if (n > MAX_STOP_LEN || c->n_stop == MAX_STOP)
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'stop' takes at most %d strings of at most %d bytes",
                          MAX_STOP, MAX_STOP_LEN);
    c->stop[c->n_stop] = strdup(s->valuestring);
    if (!c->stop[c->n_stop])
        return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while reading 'stop'");
    c->n_stop++;
    if (n > c->max_stop)
        c->max_stop = n;
    return KS_OK;
}

static ks_status parse_stop(struct call *c, const cJSON *root, struct reply *r)
{
    cJSON *v = field(root, "stop");
    if (!v)
        return KS_OK;
    if (!cJSON_IsArray(v))
        return add_stop(c, v, r);
    const cJSON *s;
    ks_status st = KS_OK;
    cJSON_ArrayForEach(s, v) if ((st = add_stop(c, s, r))) return st;
    return KS_OK;
}

static ks_status parse_sampling(const cJSON *root, bool chat, struct sample_params *p, int *logprobs, int *n_choices,
                                struct reply *r)
{
    static uint64_t seed_counter;
    double temp = 1.0, top_p = 1.0, min_p = 0.0, pres = 0.0, freq = 0.0, rep = 1.0;
    int64_t top_k = 0, seed = -1, n = 1;
    ks_status st;
    if ((st = get_number(root, "temperature", 0, 2, &temp, r)) || (st = get_number(root, "top_p", 0, 1, &top_p, r)) ||
        (st = get_number(root, "min_p", 0, 1, &min_p, r)) ||
        (st = get_number(root, "presence_penalty", -2, 2, &pres, r)) ||
        (st = get_number(root, "frequency_penalty", -2, 2, &freq, r)) ||
        (st = get_number(root, "repeat_penalty", 0, 10, &rep, r)) || (st = get_int(root, "top_k", 0, 1e9, &top_k, r)) ||
        (st = get_int(root, "seed", -9.2e18, 9.2e18, &seed, r)) || (st = get_int(root, "n", 1, MAX_CHOICES, &n, r)))
        return st;
    *n_choices = (int)n;
    *logprobs = -1;
    if (chat) {
        bool lp = false;
        int64_t top = 0;
        if ((st = get_bool(root, "logprobs", &lp, r)) ||
            (st = get_int(root, "top_logprobs", 0, SAMPLE_MAX_LOGPROBS, &top, r)))
            return st;
        if (field(root, "top_logprobs") && !lp)
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'top_logprobs' needs 'logprobs': true");
        if (lp)
            *logprobs = (int)top;
    } else {
        int64_t top = -1;
        if ((st = get_int(root, "logprobs", 0, SAMPLE_MAX_LOGPROBS, &top, r)))
            return st;
        *logprobs = (int)top;
    }
    if ((float)top_p <= 0) /* also a positive value below the smallest float, which would sample with 0 */
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'top_p' must be greater than 0 (got %g)", top_p);
    memset(p, 0, sizeof *p);
    p->temp = (float)temp;
    p->top_k = (int)top_k;
    p->top_p = (float)top_p;
    p->min_p = (float)min_p;
    p->repeat_penalty = (float)rep;
    p->repeat_last_n = 64;
    p->presence_penalty = (float)pres;
    p->frequency_penalty = (float)freq;
    p->seed = seed >= 0 ? (uint64_t)seed
                        : (uint64_t)time(NULL) * 0x9E3779B97F4A7C15ull + __atomic_add_fetch(&seed_counter, 1, __ATOMIC_RELAXED);
    p->n_logprobs = *logprobs > 0 ? *logprobs : 0;
    return KS_OK;
}

/* A tokenizer failure: out of memory stays so, anything else is ours (500). */
static ks_status tokenizer_failed(ks_status st, struct reply *r)
{
    return reply_fail(r, st == KS_ERR_NOMEM ? st : KS_ERR_INTERNAL, NULL, "tokenizer: %s", ks_errmsg());
}

/* The prompt as token ids (*ids_out, malloc'd). */
static ks_status prompt_tokens(struct server *srv, bool chat, const cJSON *root, int32_t **ids_out, int32_t *n_out,
                               struct reply *r)
{
    int32_t *ids = NULL;
    size_t n = 0;
    ks_status st;
    if (chat) {
        char *text;
        if ((st = server_chat_prompt(srv, root, &text, r)))
            return st;
        /* The whole prompt is parsed for special tokens, the messages' text
         * included, as llama-server does (see README: chat templates). */
        st = tok_encode(srv->tok, text, strlen(text), TOK_ADD_SPECIAL | TOK_PARSE_SPECIAL, &ids, &n);
        free(text);
        if (st)
            return tokenizer_failed(st, r);
    } else {
        cJSON *p = field(root, "prompt");
        if (cJSON_IsArray(p) && cJSON_GetArraySize(p) == 1 && cJSON_IsString(cJSON_GetArrayItem(p, 0)))
            p = cJSON_GetArrayItem(p, 0);
        if (cJSON_IsString(p)) {
            if ((st = tok_encode(srv->tok, p->valuestring, strlen(p->valuestring), TOK_ADD_SPECIAL, &ids, &n)))
                return tokenizer_failed(st, r);
        } else if (cJSON_IsArray(p) && cJSON_GetArraySize(p) > 0) {
            n = (size_t)cJSON_GetArraySize(p);
            ids = malloc(n * sizeof *ids);
            if (!ids)
                return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while reading 'prompt'");
            size_t i = 0;
            const cJSON *t;
            int32_t n_vocab = tok_n_vocab(srv->tok);
            cJSON_ArrayForEach(t, p) {
                if (!cJSON_IsNumber(t) || t->valuedouble != floor(t->valuedouble) || t->valuedouble < 0 ||
                    t->valuedouble >= n_vocab) {
                    free(ids);
                    return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                                      "'prompt' token ids must be integers in [0, %d) (index %zu)", n_vocab, i);
                }
                ids[i++] = (int32_t)t->valuedouble;
            }
        } else {
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type",
                              "'prompt' must be a string or a non-empty array of token ids");
        }
    }
    if (n == 0) {
        free(ids);
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "the prompt is empty");
    }
    if (n >= (size_t)srv->cfg.ctx_size) {
        free(ids);
        return reply_fail(r, KS_ERR_INVALID_ARG, "context_length_exceeded",
                          "the prompt has %zu tokens but the context holds %d (--ctx-size); shorten it", n,
                          srv->cfg.ctx_size);
    }
    *ids_out = ids;
    *n_out = (int32_t)n;
    return KS_OK;
}

/* ---- text assembly ----------------------------------------------------------------- */

/* s as valid UTF-8 for JSON (NULL when out of memory). */
static char *utf8_clean(const char *s, size_t n)
{
    char *out = NULL;
    size_t len;
    return tok_utf8_sanitize(s, n, &out, &len) == KS_OK ? out : NULL;
}

static cJSON *lp_token_json(struct call *c, int32_t token, float logprob)
{
    const char *bytes = "";
    size_t len = 0;
    tok_piece(c->srv->tok, token, &bytes, &len);
    char *clean = utf8_clean(bytes, len);
    if (!clean)
        return NULL; /* server_json_push / add note it */
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "token", clean);
    cJSON_AddNumberToObject(o, "logprob", logprob);
    cJSON *b = cJSON_AddArrayToObject(o, "bytes");
    for (size_t i = 0; i < len; i++)
        server_json_push(b, cJSON_CreateNumber((unsigned char)bytes[i]));
    free(clean);
    return o;
}

/* Chat: {"content":[{token,logprob,bytes,top_logprobs:[...]}, ...]}.
 * Completions: {"tokens":[],"token_logprobs":[],"top_logprobs":[{tok:lp}],"text_offset":[]}. */
static void lp_add(struct call *c, cJSON *lp, const struct item *it, size_t text_offset)
{
    if (c->chat) {
        cJSON *content = cJSON_GetObjectItem(lp, "content");
        cJSON *e = lp_token_json(c, it->token, it->res.logprob);
        cJSON *top = cJSON_AddArrayToObject(e, "top_logprobs");
        for (int i = 0; i < it->res.n_top && i < c->logprobs; i++)
            server_json_push(top, lp_token_json(c, it->res.top[i].token, it->res.top[i].logprob));
        server_json_push(content, e);
        return;
    }
    cJSON *t = lp_token_json(c, it->token, it->res.logprob);
    cJSON *tt = cJSON_GetObjectItem(t, "token");
    server_json_push(cJSON_GetObjectItem(lp, "tokens"), cJSON_IsString(tt) ? cJSON_CreateString(tt->valuestring) : NULL);
    server_json_push(cJSON_GetObjectItem(lp, "token_logprobs"), cJSON_CreateNumber(it->res.logprob));
    server_json_push(cJSON_GetObjectItem(lp, "text_offset"), cJSON_CreateNumber((double)text_offset));
    cJSON *top = cJSON_CreateObject();
    for (int i = 0; i < it->res.n_top && i < c->logprobs; i++) {
        cJSON *alt = lp_token_json(c, it->res.top[i].token, it->res.top[i].logprob);
        cJSON *at = cJSON_GetObjectItem(alt, "token");
        if (cJSON_IsString(at))
            cJSON_AddNumberToObject(top, at->valuestring, it->res.top[i].logprob);
        else
            server_json_push(top, NULL); /* notes the failure */
        cJSON_Delete(alt);
    }
    server_json_push(cJSON_GetObjectItem(lp, "top_logprobs"), top);
    cJSON_Delete(t);
}

static cJSON *lp_new(bool chat)
{
    cJSON *lp = cJSON_CreateObject();
    if (chat) {
        cJSON_AddArrayToObject(lp, "content");
    } else {
        cJSON_AddArrayToObject(lp, "tokens");
        cJSON_AddArrayToObject(lp, "token_logprobs");
        cJSON_AddArrayToObject(lp, "top_logprobs");
        cJSON_AddArrayToObject(lp, "text_offset");
    }
    return lp;
}

/* ---- tool calls -------------------------------------------------------------------- */

/* A control token of the tool-call markup (<|python_tag|>, [TOOL_CALLS]):
 * the detokenizer drops control tokens, the parser needs them (llama.cpp's
 * preserved tokens). */
static bool tool_markup_token(const struct call *c, int32_t token)
{
    for (int i = 0; c->tool_fmt != SERVER_TOOLS_NONE && i < c->srv->n_tool_tokens; i++)
        if (c->srv->tool_tokens[i] == token)
            return true;
    return false;
}

/* The markup token's text after whatever the detokenizer held. */
static ks_status push_markup(struct call *c, int32_t token)
{
    const char *bytes = NULL, *mark = NULL;
    size_t len = 0, mlen = 0;
    ks_status st = tok_stream_flush(c->detok, &bytes, &len);
    if (!st && len)
        sbuf_append(&c->text, bytes, len);
    if (!st && !(st = tok_text(c->srv->tok, token, &mark, &mlen)))
        sbuf_append(&c->text, mark, mlen);
    return st;
}

static cJSON *tool_call_json(const struct call *c, int index, const struct server_tool_call *tc, bool whole)
{
    char id[80];
    const char *serial = strchr(c->id, '-') ? strchr(c->id, '-') + 1 : c->id;
    if (c->tool_fmt == SERVER_TOOLS_MISTRAL) /* its templates refuse ids that are not 9 alphanumerics */
        snprintf(id, sizeof id, "%09llu",
                 (strtoull(serial, NULL, 10) * 10000 + (unsigned)c->index * 100 + (unsigned)index) % 1000000000ull);
    else if (c->index > 0) /* unique across the choices */
        snprintf(id, sizeof id, "call_%s_%d_%d", serial, c->index, index);
    else
        snprintf(id, sizeof id, "call_%s_%d", serial, index);
    cJSON *o = cJSON_CreateObject();
    if (!whole)
        cJSON_AddNumberToObject(o, "index", index);
    cJSON_AddStringToObject(o, "id", id);
    cJSON_AddStringToObject(o, "type", "function");
    cJSON *fn = cJSON_AddObjectToObject(o, "function");
    cJSON_AddStringToObject(fn, "name", tc->name);
    cJSON_AddStringToObject(fn, "arguments", whole ? tc->arguments : "");
    return o;
}

/* The calls of a final parse as message.tool_calls (NULL: none). */
static cJSON *calls_json(const struct call *c, const struct server_tool_call *calls, int n)
{
    if (n == 0)
        return NULL;
    cJSON *arr = cJSON_CreateArray();
    for (int i = 0; i < n; i++)
        server_json_push(arr, tool_call_json(c, i, &calls[i], true));
    return arr;
}

/* A harmony answer: *reasoning (NULL: none), *content (NULL when there are
 * calls and no text) and the calls. */
static ks_status harmony_answer(struct call *c, char **content, char **reasoning, cJSON **calls)
{
    struct server_harmony h;
    ks_status st = server_harmony_parse(c->text.p ? c->text.p : "", c->text.n, true, c->harmony_calls, &h);
    if (st)
        return st;
    c->n_calls = h.n_calls;
    if (h.reasoning.n > 0 && !(*reasoning = utf8_clean(h.reasoning.p, h.reasoning.n)))
        st = KS_ERR_NOMEM;
    if (!st && (h.content.n > 0 || h.n_calls == 0) && !(*content = utf8_clean(h.content.p ? h.content.p : "", h.content.n)))
        st = KS_ERR_NOMEM;
    if (!st)
        *calls = calls_json(c, h.calls, h.n_calls);
    server_harmony_free(&h);
    return st;
}

/* The final answer of a tool-using request: *content (malloc'd, valid UTF-8;
 * NULL when there are calls and no text), *reasoning (harmony's analysis,
 * NULL: none) and message.tool_calls (NULL: none). */
static ks_status tool_answer(struct call *c, char **content, char **reasoning, cJSON **calls)
{
    *calls = NULL;
    *content = NULL;
    *reasoning = NULL;
    if (c->tool_fmt == SERVER_TOOLS_HARMONY)
        return harmony_answer(c, content, reasoning, calls);
    const char *text = c->text.p ? c->text.p : "";
    struct server_tool_result r;
    ks_status st = server_tools_parse(c->tool_fmt, text, c->text.n, true, &r);
    if (st)
        return st;
    c->n_calls = r.n_calls;
    if (r.response) {
        if (!(*content = utf8_clean(r.response, strlen(r.response))))
            st = KS_ERR_NOMEM;
    } else {
        struct sbuf b = {0};
        sbuf_append(&b, text, r.content_end);
        sbuf_append(&b, text + r.tail_start, c->text.n - r.tail_start);
        bool want = b.n > 0 || r.n_calls == 0; /* calls and no text: content null */
        if (!b.oom && want)
            *content = utf8_clean(b.p ? b.p : "", b.n);
        st = b.oom || (want && !*content) ? KS_ERR_NOMEM : KS_OK;
        sbuf_free(&b);
    }
    if (!st)
        *calls = calls_json(c, r.calls, r.n_calls);
    server_tool_result_free(&r);
    return st;
}

/* Append one token's text and cut at the first stop string. */
static void consume(struct call *c, const struct item *it, cJSON *lp)
{
    if (c->stopped)
        return;
    size_t before = c->text.n;
    if (lp)
        lp_add(c, lp, it, before);
    c->consumed++;
    const char *bytes = NULL;
    size_t len = 0;
    ks_status st = tool_markup_token(c, it->token) ? push_markup(c, it->token)
                                                    : tok_stream_push(c->detok, it->token, &bytes, &len);
    if (st == KS_OK && len)
        sbuf_append(&c->text, bytes, len);
    if (st == KS_ERR_NOMEM || c->text.oom) { /* the text would have a hole */
        c->oom = true;
        return;
    }
    if (c->n_stop == 0 || !c->text.p)
        return;
    size_t from = before > c->max_stop ? before - c->max_stop : 0;
    char *first = NULL;
    for (int i = 0; i < c->n_stop; i++) {
        char *hit = memmem(c->text.p + from, c->text.n - from, c->stop[i], strlen(c->stop[i]));
        if (hit && (!first || hit < first))
            first = hit;
    }
    if (first) {
        c->text.n = (size_t)(first - c->text.p);
        c->text.p[c->text.n] = '\0';
        c->stopped = true;
    }
    if (c->stopped)
        sched_cancel(c->srv->sched, c->sched_id);
}

static void flush_detok(struct call *c)
{
    const char *bytes = NULL;
    size_t len = 0;
    if (c->stopped)
        return;
    ks_status st = tok_stream_flush(c->detok, &bytes, &len);
    if (st == KS_OK && len)
        sbuf_append(&c->text, bytes, len);
    if (st == KS_ERR_NOMEM || c->text.oom)
        c->oom = true;
}

static const char *finish_reason(const struct call *c)
{
    if (c->n_calls > 0) /* also when max_tokens cut the text after complete calls */
        return "tool_calls";
    if (c->stopped || c->finish == SCHED_FINISH_STOP)
        return "stop";
    return "length";
}

/* The prompt counts once (the choices share it), completions add up. */
static cJSON *usage_json(const struct group *g)
{
    struct call *c = g->calls[0];
    pthread_mutex_lock(&c->mu);
    int32_t cached = c->n_cached;
    pthread_mutex_unlock(&c->mu);
    int completion = 0, drafted = 0, accepted = 0;
    for (int i = 0; i < g->n; i++) {
        completion += g->calls[i]->consumed;
        pthread_mutex_lock(&g->calls[i]->mu);
        drafted += g->calls[i]->n_drafted;
        accepted += g->calls[i]->n_accepted;
        pthread_mutex_unlock(&g->calls[i]->mu);
    }
    cJSON *u = cJSON_CreateObject();
    cJSON_AddNumberToObject(u, "prompt_tokens", c->n_prompt);
    cJSON_AddNumberToObject(u, "completion_tokens", completion);
    cJSON_AddNumberToObject(u, "total_tokens", c->n_prompt + completion);
    cJSON *d = cJSON_AddObjectToObject(u, "prompt_tokens_details");
    cJSON_AddNumberToObject(d, "cached_tokens", cached);
    /* speculation (0 without): draft tokens the model verified, and those it kept */
    cJSON_AddNumberToObject(u, "draft_tokens", drafted);
    cJSON_AddNumberToObject(u, "accepted_tokens", accepted);
    return u;
}

static cJSON *response_head(const struct call *c, const char *object)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", c->id);
    cJSON_AddStringToObject(o, "object", object);
    cJSON_AddNumberToObject(o, "created", (double)c->created);
    cJSON_AddStringToObject(o, "model", c->srv->model_name);
    return o;
}

/* ---- non-streaming ----------------------------------------------------------------- */

enum pulled { PULL_EMPTY, PULL_SOME, PULL_OVER };
static enum pulled pull(struct call *c, cJSON *lp, int *n_new, bool wait);

static bool call_dropped(struct call *c)
{
    pthread_mutex_lock(&c->mu);
    bool dropped = c->dropped;
    pthread_mutex_unlock(&c->mu);
    return dropped;
}

/* Consume what has arrived for c; true once the choice is over. wait:
 * block until it is (a route driven in-process). */
static bool choice_over(struct call *c, bool wait)
{
    if (!c->waited) {
        c->waited = true;
        c->lp = c->logprobs >= 0 ? lp_new(c->chat) : NULL;
    }
    int n;
    enum pulled p;
    while ((p = pull(c, c->lp, &n, wait)) == PULL_SOME)
        ;
    return p == PULL_OVER;
}

/* A choice that is over failed (and fails the request). */
static bool choice_failed(struct call *c)
{
    return call_dropped(c) || c->oom ||
           (!c->stopped && (c->finish == SCHED_FINISH_ERROR || c->finish == SCHED_FINISH_CANCELLED));
}

/* The outcome of a choice that is over; a failed choice fails the request. */
static ks_status choice_result(struct call *c, struct reply *r)
{
    if (!c->stopped && !c->oom)
        flush_detok(c);
    if (call_dropped(c) || c->oom) /* group_done cancels the request */
        return reply_fail(r, KS_ERR_NOMEM, NULL, "%s", call_dropped(c) ? DROPPED_MSG : OOM_MSG);
    if (!c->stopped && c->finish == SCHED_FINISH_ERROR)
        return reply_fail(r, KS_ERR_INTERNAL, NULL, "%s", c->error[0] ? c->error : "generation failed");
    if (!c->stopped && c->finish == SCHED_FINISH_CANCELLED)
        return reply_fail(r, KS_ERR_STATE, "shutting_down", "the request was cancelled (server shutting down)");
    return KS_OK;
}

/* choices[] gets the finished choice c: its text or message (with
 * tool_calls), logprobs and finish_reason. */
static ks_status choice_json(struct call *c, cJSON *choices, struct reply *r)
{
    cJSON *tool_calls = NULL;
    char *text = NULL, *reasoning = NULL;
    if (c->tool_fmt != SERVER_TOOLS_NONE ? tool_answer(c, &text, &reasoning, &tool_calls) != KS_OK
                                         : !(text = utf8_clean(c->text.p ? c->text.p : "", c->text.n))) {
        free(text);
        free(reasoning);
        cJSON_Delete(tool_calls);
        return reply_fail(r, KS_ERR_NOMEM, NULL, "%s", OOM_MSG);
    }
    cJSON *ch = cJSON_CreateObject();
    cJSON_AddNumberToObject(ch, "index", c->index);
    if (c->chat) {
        cJSON *msg = cJSON_AddObjectToObject(ch, "message");
        cJSON_AddStringToObject(msg, "role", "assistant");
        if (text)
            cJSON_AddStringToObject(msg, "content", text);
        else
            cJSON_AddNullToObject(msg, "content");
        if (reasoning)
            cJSON_AddStringToObject(msg, "reasoning_content", reasoning);
        if (tool_calls)
            server_json_add(msg, "tool_calls", tool_calls);
    } else {
        cJSON_AddStringToObject(ch, "text", text);
    }
    if (c->lp)
        server_json_add(ch, "logprobs", c->lp);
    else
        cJSON_AddNullToObject(ch, "logprobs");
    c->lp = NULL;
    cJSON_AddStringToObject(ch, "finish_reason", finish_reason(c));
    server_json_push(choices, ch);
    free(text);
    free(reasoning);
    return KS_OK;
}

static ks_status respond_whole(struct group *g, struct reply *r)
{
    ks_status st = KS_OK;
    for (int i = 0; i < g->n && !st; i++) {
        while (!choice_over(g->calls[i], true)) /* at once when the choices are over (whole_poll) */
            ;
        st = choice_result(g->calls[i], r);
    }
    if (st)
        return st;
    struct call *c = g->calls[0];
    cJSON *o = response_head(c, c->chat ? "chat.completion" : "text_completion");
    cJSON *choices = cJSON_AddArrayToObject(o, "choices");
    for (int i = 0; i < g->n && !st; i++)
        st = choice_json(g->calls[i], choices, r);
    if (st) {
        cJSON_Delete(o);
        return st;
    }
    server_json_add(o, "usage", usage_json(g));
    return reply_json(r, 200, o);
}

/* ---- streaming --------------------------------------------------------------------- */

/* Append one SSE event, whole or not at all; false (c->oom) when out of
 * memory, or when a JSON allocation failed while o was built. */
static bool sse_send(struct call *c, cJSON *o)
{
    char *s = o && !server_json_failed() ? cJSON_PrintUnformatted(o) : NULL;
    cJSON_Delete(o);
    size_t before = c->out.n;
    if (s && !server_json_failed()) {
        sbuf_append(&c->out, "data: ", 6);
        sbuf_append(&c->out, s, strlen(s));
        sbuf_append(&c->out, "\n\n", 2);
    }
    bool ok = s && !server_json_failed() && !c->out.oom;
    free(s);
    if (!ok) {
        c->out.n = before; /* drop the partial event; the bytes before it are whole events */
        c->out.oom = false;
        c->oom = true;
    }
    return ok;
}

static cJSON *chunk_new(struct call *c, const char *delta_text, bool with_role, cJSON *lp, const char *finish)
{
    cJSON *o = response_head(c, c->chat ? "chat.completion.chunk" : "text_completion");
    cJSON *choices = cJSON_AddArrayToObject(o, "choices");
    cJSON *ch = cJSON_CreateObject();
    cJSON_AddNumberToObject(ch, "index", c->index);
    if (c->chat) {
        cJSON *d = cJSON_AddObjectToObject(ch, "delta");
        if (with_role)
            cJSON_AddStringToObject(d, "role", "assistant");
        if (delta_text)
            cJSON_AddStringToObject(d, "content", delta_text);
    } else {
        cJSON_AddStringToObject(ch, "text", delta_text ? delta_text : "");
    }
    if (lp)
        server_json_add(ch, "logprobs", lp);
    else
        cJSON_AddNullToObject(ch, "logprobs");
    if (finish)
        cJSON_AddStringToObject(ch, "finish_reason", finish);
    else
        cJSON_AddNullToObject(ch, "finish_reason");
    server_json_push(choices, ch);
    return o;
}

/* Bytes of text safe to send: all of it at the end, else hold back what could
 * still become the start of a stop string, never splitting a UTF-8 char. */
static size_t safe_end(const struct call *c, bool final)
{
    size_t end = c->text.n;
    if (!final && c->max_stop > 0)
        end = end > c->max_stop - 1 ? end - (c->max_stop - 1) : 0;
    while (end > c->sent && end < c->text.n && ((unsigned char)c->text.p[end] & 0xC0) == 0x80)
        end--;
    return end < c->sent ? c->sent : end;
}

static void stream_tools(struct call *c, bool final, cJSON *lp);
static void stream_harmony(struct call *c, bool final, cJSON *lp);

static void stream_text(struct call *c, bool final, cJSON *lp)
{
    if (c->tool_fmt == SERVER_TOOLS_HARMONY)
        return stream_harmony(c, final, lp);
    if (c->tool_fmt != SERVER_TOOLS_NONE)
        return stream_tools(c, final, lp);
    size_t end = safe_end(c, final);
    if (end == c->sent && !lp)
        return;
    char *piece = utf8_clean(c->text.p ? c->text.p + c->sent : "", end - c->sent);
    if (!piece) {
        cJSON_Delete(lp);
        c->oom = true;
        return;
    }
    if (sse_send(c, chunk_new(c, piece, false, lp, NULL)))
        c->sent = end;
    free(piece);
}

/* Send text[c->sent..end) as content (with lp, if any), whole chars only. */
static void stream_content(struct call *c, const char *text, size_t end, cJSON *lp)
{
    if (end <= c->sent && !lp)
        return;
    char *piece = utf8_clean(text + c->sent, end > c->sent ? end - c->sent : 0);
    if (!piece) {
        cJSON_Delete(lp);
        c->oom = true;
        return;
    }
    if (sse_send(c, chunk_new(c, piece, false, lp, NULL)) && end > c->sent)
        c->sent = end;
    free(piece);
}

/* Bytes of part[0..n) that are whole UTF-8 characters, from sent on. */
static size_t whole_chars(const char *part, size_t n, size_t sent)
{
    size_t end = n;
    while (end > sent && ((unsigned char)part[end - 1] & 0x80)) {
        size_t lead = end - 1;
        while (lead > sent && ((unsigned char)part[lead] & 0xC0) == 0x80)
            lead--;
        unsigned char b = (unsigned char)part[lead];
        size_t need = b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : b >= 0xC0 ? 2 : 1;
        if (end - lead >= need)
            break;
        end = lead;
    }
    return end;
}

/* One delta of a harmony part: what is new in part since *sent. */
static void stream_part(struct call *c, const struct sbuf *part, size_t *sent, const char *key, bool final, cJSON **lp)
{
    size_t end = final ? part->n : whole_chars(part->p ? part->p : "", part->n, *sent);
    if (end <= *sent)
        return;
    char *piece = utf8_clean(part->p + *sent, end - *sent);
    if (!piece) {
        c->oom = true;
        return;
    }
    cJSON *o = chunk_new(c, NULL, false, *lp, NULL);
    *lp = NULL;
    cJSON *delta = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(o, "choices"), 0), "delta");
    cJSON_AddStringToObject(delta, key, piece);
    if (sse_send(c, o))
        *sent = end;
    free(piece);
}

static void stream_calls(struct call *c, const struct server_tool_call *calls, int n);

/* A harmony stream: reasoning_content and content deltas as the channels
 * grow (a tail that may be a marker held back), each call once complete. */
static void stream_harmony(struct call *c, bool final, cJSON *lp)
{
    struct server_harmony h;
    if (server_harmony_parse(c->text.p ? c->text.p : "", c->text.n, final, c->harmony_calls, &h)) {
        cJSON_Delete(lp);
        c->oom = true;
        return;
    }
    stream_part(c, &h.reasoning, &c->sent_reasoning, "reasoning_content", final, &lp);
    if (!c->oom)
        stream_part(c, &h.content, &c->sent_content, "content", final, &lp);
    if (lp && !c->oom) /* logprobs of tokens that added no text yet */
        sse_send(c, chunk_new(c, NULL, false, lp, NULL));
    else
        cJSON_Delete(lp);
    if (!c->oom)
        stream_calls(c, h.calls, h.n_calls);
    if (final && !c->oom) {
        c->n_calls = h.n_calls;
        c->sent = c->text.n;
    }
    server_harmony_free(&h);
}

/* Calls not streamed yet, as OpenAI sends them: a delta with index, id,
 * type, name and arguments "", then one with the arguments. */
static void stream_calls(struct call *c, const struct server_tool_call *calls, int n)
{
    for (; !c->oom && c->calls_sent < n; c->calls_sent++) {
        const struct server_tool_call *tc = &calls[c->calls_sent];
        for (int part = 0; part < 2 && !c->oom; part++) {
            cJSON *o = chunk_new(c, NULL, false, NULL, NULL);
            cJSON *delta = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(o, "choices"), 0), "delta");
            cJSON *arr = cJSON_CreateArray();
            cJSON *call = part == 0 ? tool_call_json(c, c->calls_sent, tc, false) : cJSON_CreateObject();
            if (part == 1) {
                cJSON_AddNumberToObject(call, "index", c->calls_sent);
                cJSON *fn = cJSON_AddObjectToObject(call, "function");
                cJSON_AddStringToObject(fn, "arguments", tc->arguments);
            }
            server_json_push(arr, call);
            server_json_add(delta, "tool_calls", arr);
            sse_send(c, o);
        }
    }
}

/* A tool-using stream: content up to the first call marker (less what may
 * still become one or a stop string), each call once complete as OpenAI
 * sends them (a delta with index, id, type, name and arguments "", then one
 * with the arguments), and at the end the text after the calls. */
static void stream_tools(struct call *c, bool final, cJSON *lp)
{
    const char *text = c->text.p ? c->text.p : "";
    struct server_tool_result r;
    if (server_tools_parse(c->tool_fmt, text, c->text.n, final, &r)) {
        cJSON_Delete(lp);
        c->oom = true;
        return;
    }
    size_t end = safe_end(c, final);
    if (end > r.content_end)
        end = r.content_end < c->sent ? c->sent : r.content_end;
    while (end > c->sent && end < c->text.n && ((unsigned char)text[end] & 0xC0) == 0x80)
        end--;
    if (r.response) { /* generic {"response": ...}: held back whole until now */
        char *piece = utf8_clean(r.response, strlen(r.response));
        if (!piece || !sse_send(c, chunk_new(c, piece, false, lp, NULL)))
            c->oom = true;
        free(piece);
        c->sent = c->text.n;
    } else {
        stream_content(c, text, end, lp);
    }
    stream_calls(c, r.calls, r.n_calls);
    if (final && !c->oom) {
        c->n_calls = r.n_calls;
        if (r.n_calls > 0 && r.tail_start < c->text.n) {
            c->sent = r.tail_start;
            stream_content(c, text, c->text.n, NULL);
        }
        c->sent = c->text.n;
    }
    server_tool_result_free(&r);
}

/* The end of a stream that lost output to an allocation failure: an error
 * event and [DONE] from static memory (allocating may fail again), and the
 * request is cancelled so its pages are freed now. */
static void stream_fail(struct call *c)
{
    static const char dropped[] = "data: {\"error\":{\"message\":\"" DROPPED_MSG "\",\"type\":\"server_error\","
                                  "\"code\":null}}\n\ndata: [DONE]\n\n";
    static const char oom[] = "data: {\"error\":{\"message\":\"" OOM_MSG "\",\"type\":\"server_error\","
                              "\"code\":null}}\n\ndata: [DONE]\n\n";
    c->tail = call_dropped(c) ? dropped : oom;
    c->tail_pos = 0;
    c->done = true;
    sched_cancel(c->srv->sched, c->sched_id);
}

/* The choice's last chunk: its finish_reason, or an error event when the
 * scheduler failed or cancelled it. */
static void stream_end(struct call *c)
{
    if (call_dropped(c) || c->oom)
        return stream_fail(c);
    if (!c->stopped && (c->finish == SCHED_FINISH_ERROR || c->finish == SCHED_FINISH_CANCELLED)) {
        cJSON *o = cJSON_CreateObject();
        cJSON *e = cJSON_AddObjectToObject(o, "error");
        cJSON_AddStringToObject(e, "message", c->finish == SCHED_FINISH_ERROR && c->error[0] ? c->error
                                              : "the request was cancelled (server shutting down)");
        cJSON_AddStringToObject(e, "type", "server_error");
        cJSON_AddNullToObject(e, "code");
        if (!sse_send(c, o))
            return stream_fail(c);
    } else {
        flush_detok(c);
        stream_text(c, true, NULL);
        if (c->oom || !sse_send(c, chunk_new(c, c->chat ? NULL : "", false, NULL, finish_reason(c))))
            return stream_fail(c);
    }
    c->done = true;
}

/* Every choice has ended: the usage chunk (if asked) and [DONE], written to
 * the out of the choice served last (already sent). */
static void stream_finish(struct group *g)
{
    struct call *c = g->calls[g->turn];
    g->ended = true;
    server_json_reset();
    if (c->include_usage) {
        cJSON *o = response_head(c, c->chat ? "chat.completion.chunk" : "text_completion");
        cJSON_AddArrayToObject(o, "choices");
        server_json_add(o, "usage", usage_json(g));
        if (!sse_send(c, o))
            return stream_fail(c);
    }
    sbuf_append(&c->out, "data: [DONE]\n\n", 14);
    if (c->out.oom) {
        c->out.oom = false;
        c->tail = "data: [DONE]\n\n";
        c->tail_pos = 0;
    }
}

/* Consume what arrived (at most PULL_MAX at a time, copied on the stack so
 * that draining never allocates): PULL_OVER once the call is over (finished
 * and drained, cut by a stop string, or failed), PULL_EMPTY when nothing has
 * arrived yet (only without wait; wait blocks until something does). */
enum { PULL_MAX = 16 };

static enum pulled pull(struct call *c, cJSON *lp, int *n_new, bool wait)
{
    struct item batch[PULL_MAX];
    *n_new = 0;
    if (c->stopped || c->oom)
        return PULL_OVER;
    pthread_mutex_lock(&c->mu);
    while (wait && c->consumed == c->n_items && !c->finished)
        pthread_cond_wait(&c->cv, &c->mu);
    if (c->consumed == c->n_items && !c->finished) {
        pthread_mutex_unlock(&c->mu);
        return PULL_EMPTY;
    }
    int n = c->n_items - c->consumed;
    if (n > PULL_MAX)
        n = PULL_MAX;
    if (n > 0)
        memcpy(batch, c->items + c->consumed, (size_t)n * sizeof *batch);
    int upto = c->consumed + n;
    bool drained = c->finished && upto == c->n_items;
    bool dropped = c->dropped;
    pthread_mutex_unlock(&c->mu);
    for (int i = 0; i < n && !c->stopped && !c->oom; i++)
        consume(c, &batch[i], lp);
    *n_new = n;
    bool over = c->stopped || c->oom || (drained && (dropped || c->consumed == upto));
    return over ? PULL_OVER : PULL_SOME;
}

/* Produce the next SSE bytes into c->out; false when nothing has arrived
 * (wait: block until something does). */
static bool stream_fill(struct call *c, bool wait)
{
    server_json_reset();
    if (!c->role_sent) {
        c->role_sent = true;
        if (c->chat) {
            if (!sse_send(c, chunk_new(c, "", true, NULL, NULL)))
                stream_fail(c);
            return true;
        }
    }
    cJSON *lp = c->logprobs >= 0 ? lp_new(c->chat) : NULL;
    int n = 0;
    enum pulled p = pull(c, lp, &n, wait);
    if (p == PULL_EMPTY) {
        cJSON_Delete(lp);
        return false;
    }
    if (n > 0 && !c->oom)
        stream_text(c, false, lp);
    else
        cJSON_Delete(lp);
    if (c->oom)
        stream_fail(c);
    else if (p == PULL_OVER)
        stream_end(c);
    return true;
}

/* Copy c's pending SSE bytes (out, then a failure's tail) into buf; 0: none. */
static size_t stream_drain(struct call *c, char *buf, size_t max)
{
    size_t n = c->out.n - c->out_pos;
    const char *src = n ? c->out.p + c->out_pos : "";
    size_t *at = &c->out_pos;
    if (n == 0 && c->tail) {
        src = c->tail + c->tail_pos;
        n = strlen(src);
        at = &c->tail_pos;
    }
    if (n == 0) {
        c->out.n = 0;
        c->out_pos = 0;
        return 0;
    }
    if (n > max)
        n = max;
    memcpy(buf, src, n);
    *at += n;
    return n;
}

/* Serve the next choice that has not ended and has something (round robin,
 * so the choices advance together); once none is left, the stream's end.
 * false: every choice left is still waiting for the scheduler. */
static bool stream_next(struct group *g, bool wait)
{
    bool left = false;
    for (int k = 1; k <= g->n; k++) {
        int i = (g->turn + k) % g->n;
        if (g->calls[i]->done)
            continue;
        left = true;
        if (stream_fill(g->calls[i], wait)) {
            g->turn = i;
            return true;
        }
    }
    if (left)
        return false;
    stream_finish(g);
    return true;
}

/* The response's content reader: the bytes ready now; with nothing ready,
 * the connection sleeps (suspended, no thread held) until the scheduler's
 * next event wakes it. A client that hung up meanwhile ends the stream, and
 * stream_free cancels the request. */
static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void)pos;
    struct group *g = cls;
    for (;;) {
        struct call *c = g->calls[g->turn];
        size_t n = stream_drain(c, buf, max);
        if (n > 0)
            return (ssize_t)n;
        if (g->ended || c->tail) /* a failure's tail ends the stream; group_done cancels the rest */
            return MHD_CONTENT_READER_END_OF_STREAM;
        if (g->waker && server_waker_gone(g->waker))
            return MHD_CONTENT_READER_END_WITH_ERROR;
        if (!stream_next(g, !g->waker) && server_waker_sleep(g->waker))
            return 0;
    }
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
    call_unref(c);
}

static void group_done(struct group *g)
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

/* A whole reply (wait_poll): consume what has arrived; once every choice
 * is over, or one has failed, the reply. */
static bool whole_poll(void *cls, struct reply *r, ks_status *st)
{
    struct group *g = cls;
    bool over = true;
    struct call *failed = NULL;
    for (int i = 0; i < g->n; i++) {
        struct call *c = g->calls[i];
        if (!choice_over(c, false))
            over = false;
        else if (!failed && choice_failed(c))
            failed = c;
    }
    if (!over && !failed)
        return false;
    *st = failed ? choice_result(failed, r) : respond_whole(g, r);
    group_done(g);
    return true;
}

static void whole_abort(void *cls)
{
    group_done(cls);
}

static void stream_free(void *cls)
{
    group_done(cls);
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
    c->created = (long)time(NULL);
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    if (tok_stream_create(srv->tok, TOK_DECODE_REPLACE_BAD, &c->detok) != KS_OK) {
        call_unref(c);
        return NULL;
    }
    return c;
}

static struct call *call_new(struct server *srv, bool chat)
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
    for (int i = 0; i < c0->n_stop; i++, c->n_stop++)
        if (!(c->stop[i] = strdup(c0->stop[i]))) {
            call_unref(c);
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
        call_unref(g->calls[i]);
    if (!g)
        call_unref(c0);
    free(g);
    return NULL;
}

/* response_format ({"type":"text"|"json_object"|"json_schema", "json_schema":
 * {"name","schema","strict"}}), llama.cpp's "grammar" (GBNF text) or the tool
 * calls tool_choice requires -> the compiled grammar the sampler masks with,
 * for at most max_tokens tokens. A bad schema or grammar is a 400 that names
 * the keyword or line and column. */
static ks_status parse_grammar(struct call *c, const cJSON *root, int32_t max_tokens, struct sample_params *p,
                               struct reply *r)
{
    cJSON *rf = field(root, "response_format"), *gr = field(root, "grammar");
    const char *type = "text";
    if (rf) {
        cJSON *t = cJSON_GetObjectItemCaseSensitive(rf, "type");
        if (!cJSON_IsObject(rf) || !cJSON_IsString(t))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type",
                              "'response_format' must be an object with a string 'type'");
        type = t->valuestring;
        if (strcmp(type, "text") && strcmp(type, "json_object") && strcmp(type, "json_schema"))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                              "'response_format.type' must be text, json_object or json_schema (got '%.64s')", type);
    }
    if (gr && !cJSON_IsString(gr))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'grammar' must be a string of GBNF");
    if (gr && strcmp(type, "text"))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "give 'grammar' or a JSON 'response_format', not both");
    bool tool_calls = c->tool_fmt != SERVER_TOOLS_NONE && c->tools.n_tools > 0 &&
                      (c->tools.choice == SERVER_TOOL_REQUIRED || c->tools.choice == SERVER_TOOL_NAMED);
    if (tool_calls && (gr || strcmp(type, "text")))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                          "'tool_choice' %s constrains the output to tool calls; it cannot be combined with %s",
                          c->tools.choice == SERVER_TOOL_NAMED ? "naming a function" : "\"required\"",
                          gr ? "'grammar'" : "a JSON 'response_format'");
    /* auto: free text, but a call the model starts is constrained from its trigger on */
    /* (harmony's calls follow free reasoning: they are parsed, not constrained, under auto) */
    bool lazy = c->tool_fmt != SERVER_TOOLS_NONE && c->tool_fmt != SERVER_TOOLS_HARMONY &&
                c->tools.choice == SERVER_TOOL_AUTO && !gr && !strcmp(type, "text") && c->srv->grammar_vocab;
    tool_calls = tool_calls || lazy;
    if (!gr && !strcmp(type, "text") && !tool_calls)
        return KS_OK;
    if (!c->srv->grammar_vocab)
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                          "constrained output needs the model's tokenizer, and this model has none");
    char *gbnf = NULL;
    const char *src = gr ? gr->valuestring : grammar_json_object_gbnf(), *what = gr ? "'grammar'" : "'response_format'";
    ks_status st = KS_OK;
    if (tool_calls) {
        bool fell_back;
        st = server_tools_grammar(c->tool_fmt, c->srv->tok, field(root, "tools"), &c->tools, &gbnf, &fell_back);
        src = gbnf;
        what = "the tool-call grammar";
    } else if (!strcmp(type, "json_schema")) {
        cJSON *js = cJSON_GetObjectItemCaseSensitive(rf, "json_schema");
        cJSON *schema = cJSON_GetObjectItemCaseSensitive(js, "schema");
        cJSON *strict = cJSON_GetObjectItemCaseSensitive(js, "strict"), *name = cJSON_GetObjectItemCaseSensitive(js, "name");
        if (!cJSON_IsObject(js) || !cJSON_IsObject(schema))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type",
                              "'response_format.json_schema' must be an object with an object 'schema'");
        if ((strict && !cJSON_IsBool(strict) && !cJSON_IsNull(strict)) || (name && !cJSON_IsString(name)))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type",
                              "'response_format.json_schema': 'strict' must be a boolean and 'name' a string");
        char *text = cJSON_PrintUnformatted(schema);
        if (!text)
            return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while reading 'response_format'");
        st = grammar_from_json_schema(text, strlen(text), &gbnf);
        cJSON_free(text);
        if (st == KS_ERR_FORMAT) /* cJSON printed it, so only an allocation can have failed to parse it */
            st = KS_ERR_NOMEM;
        src = gbnf;
        what = "'response_format.json_schema.schema'";
    }
    if (!st)
        st = grammar_compile(src, strlen(src), &c->grammar);
    free(gbnf);
    if (!st && !lazy && max_tokens > 0 && grammar_min_bytes(c->grammar) > max_tokens)
        st = ks_fail(KS_ERR_RANGE, "max_tokens %d is below the %d tokens the shortest valid output may need (one per "
                                   "byte); raise it", (int)max_tokens, (int)grammar_min_bytes(c->grammar));
    if (st) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", ks_errmsg());
        if (st == KS_ERR_NOMEM)
            return reply_fail(r, st, NULL, "out of memory while compiling %s", what);
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "%s: %s", what, msg);
    }
    p->grammar = c->grammar;
    p->grammar_vocab = c->srv->grammar_vocab;
    p->grammar_max_tokens = max_tokens;
    if (lazy)
        server_tools_triggers(c->tool_fmt, c->srv->tok, &p->grammar_triggers);
    return KS_OK;
}

/* "speculative": {"n_max": N, "n_min": N} (llama-server's field): this
 * request's draft bounds when the server speculates (--spec-type); a field
 * left out keeps the server's (--draft-max, --draft-min), and the scheduler
 * refuses an n_min above the resulting n_max. */
static ks_status parse_speculative(const cJSON *root, struct sched_request *rq, struct reply *r)
{
    cJSON *sp = field(root, "speculative");
    if (!sp)
        return KS_OK;
    if (!cJSON_IsObject(sp))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'speculative' must be an object");
    static const char *keys[2] = {"n_max", "n_min"};
    double v[2] = {-1, -1};
    for (int i = 0; i < 2; i++) {
        cJSON *x = field(sp, keys[i]);
        if (x && (!cJSON_IsNumber(x) || x->valuedouble != floor(x->valuedouble)))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'speculative.%s' must be an integer", keys[i]);
        if (x && (x->valuedouble < 0 || x->valuedouble > SPEC_DRAFT_LIMIT))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'speculative.%s' must be in [0, %d] (got %.0f)",
                              keys[i], SPEC_DRAFT_LIMIT, x->valuedouble);
        if (x)
            v[i] = x->valuedouble;
    }
    if (v[0] >= 0 && v[1] > v[0])
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                          "'speculative.n_min' (%.0f) must not be above 'speculative.n_max' (%.0f)", v[1], v[0]);
    rq->speculative.set = true;
    rq->speculative.n_max = (int32_t)v[0];
    rq->speculative.n_min = (int32_t)v[1];
    return KS_OK;
}

static ks_status parse_options(struct call *c, const cJSON *root, int32_t n_prompt, struct sched_request *rq,
                               struct reply *r)
{
    ks_status st;
    if ((st = get_bool(root, "stream", &c->stream, r)) || (st = get_bool(root, "ignore_eos", &rq->ignore_eog, r)) ||
        (st = parse_stop(c, root, r)) || (st = parse_speculative(root, rq, r)) ||
        (st = parse_sampling(root, c->chat, &rq->sampling, &c->logprobs, &c->n_choices, r)))
        return st;
    cJSON *so = field(root, "stream_options");
    if (so && !cJSON_IsObject(so))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'stream_options' must be an object");
    if (so && (st = get_bool(so, "include_usage", &c->include_usage, r)))
        return st;
    int64_t max_tokens = c->srv->cfg.ctx_size - n_prompt;
    const char *mt_key = field(root, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
    cJSON *mt = field(root, mt_key);
    if (mt && (!cJSON_IsNumber(mt) || mt->valuedouble != floor(mt->valuedouble)))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'%s' must be an integer", mt_key);
    if (mt && mt->valuedouble < 0) /* 0 only prefills and caches the prompt (a warm-up) */
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'%s' must not be negative (got %.0f)", mt_key,
                          mt->valuedouble);
    if (mt && mt->valuedouble < (double)max_tokens)
        max_tokens = (int64_t)mt->valuedouble;
    rq->max_tokens = (int32_t)max_tokens;
    return parse_grammar(c, root, rq->max_tokens, &rq->sampling, r);
}

ks_status server_completion_parse(struct server *srv, bool chat, const char *body, size_t len, struct call **out,
                                  struct sched_request *rq, struct reply *r)
{
    cJSON *root;
    ks_status st = server_parse_object(body, len, false, &root, r);
    if (st)
        return st;
    cJSON *model = field(root, "model");
    if (model && !cJSON_IsString(model)) {
        cJSON_Delete(root);
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'model' must be a string");
    }
    if (!chat && field(root, "messages")) {
        cJSON_Delete(root);
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                          "/v1/completions takes 'prompt', not 'messages' (use /v1/chat/completions)");
    }
    struct call *c = call_new(srv, chat);
    if (!c) {
        cJSON_Delete(root);
        return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while starting the request");
    }
    int32_t n_prompt = 0;
    int32_t *ids = NULL;
    st = chat ? server_parse_tool_options(root, &c->tools, r) : KS_OK;
    if (!st)
        st = prompt_tokens(srv, chat, root, &ids, &n_prompt, r);
    /* tool_choice none: the template still sees the tools (as in llama.cpp),
     * the output is not parsed for calls */
    if (chat && !srv->chat_family && c->tools.n_tools > 0 && c->tools.choice != SERVER_TOOL_NONE)
        c->tool_fmt = srv->tool_format;
    /* harmony's channels are always parsed: its reasoning is never content */
    if (chat && !srv->chat_family && srv->tool_format == SERVER_TOOLS_HARMONY) {
        c->harmony_calls = c->tool_fmt == SERVER_TOOLS_HARMONY;
        c->tool_fmt = SERVER_TOOLS_HARMONY;
    }
    *rq = (struct sched_request){.prompt = ids, .n_prompt = n_prompt, .on_event = on_event, .user = c};
    if (!st)
        st = parse_options(c, root, n_prompt, rq, r);
    cJSON_Delete(root);
    if (st) {
        free(ids);
        *rq = (struct sched_request){0};
        call_unref(c);
        return st;
    }
    c->n_prompt = n_prompt;
    *out = c;
    return KS_OK;
}

void server_completion_discard(struct call *c, struct sched_request *rq)
{
    free((int32_t *)rq->prompt);
    call_unref(c);
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

static ks_status completion(struct server *srv, bool chat, const struct server_req *req, struct reply *r)
{
    struct call *c = NULL;
    struct sched_request rq;
    ks_status st = server_completion_parse(srv, chat, req->body, req->len, &c, &rq, r);
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
        group_done(g);
        return st; /* 400 a prompt (or n) the scheduler refuses, 500 out of memory */
    }
    if (!c->stream && g->waker) {
        r->status = 200;
        r->wait_poll = whole_poll;
        r->wait_abort = whole_abort;
        r->wait_cls = g;
        return KS_OK;
    }
    if (!c->stream) {
        st = respond_whole(g, r);
        group_done(g);
        return st;
    }
    r->status = 200;
    r->content_type = "text/event-stream";
    r->stream_read = stream_read;
    r->stream_free = stream_free;
    r->stream_cls = g;
    return KS_OK;
}

ks_status server_route_chat(struct server *srv, const struct server_req *rq, struct reply *r)
{
    return completion(srv, true, rq, r);
}

ks_status server_route_completions(struct server *srv, const struct server_req *rq, struct reply *r)
{
    return completion(srv, false, rq, r);
}
