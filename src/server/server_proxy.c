/* Another vendor's API over the chat route (contract in
 * server_proxy_internal.h): the translated request runs through
 * server_route_chat unchanged, and its reply, whichever of its three forms
 * it takes (a body, a whole reply still waited for, an SSE stream), is
 * wrapped so that the API's shape comes out. */
#include "server/server_completion_internal.h"
#include "server/server_proxy_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- helpers ------------------------------------------------------------------------ */

bool server_sse_event(struct sbuf *out, const char *name, cJSON *o)
{
    char *s = o && !server_json_failed() ? cJSON_PrintUnformatted(o) : NULL;
    cJSON_Delete(o);
    size_t before = out->n;
    if (s && name)
        sbuf_printf(out, "event: %s\n", name);
    if (s) {
        sbuf_puts(out, "data: ");
        sbuf_puts(out, s);
        sbuf_puts(out, "\n\n");
    }
    bool ok = s && !out->oom && !server_json_failed();
    free(s);
    if (!ok && out->p) {
        out->n = before;
        out->p[before] = '\0';
    }
    return ok;
}

const char *server_proxy_serial(const char *chat_id)
{
    const char *dash = strchr(chat_id, '-');
    return dash ? dash + 1 : chat_id;
}

static bool word_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

void server_proxy_rename(char *out, size_t size, const char *msg, const char *from, const char *to)
{
    size_t n = strlen(from), o = 0;
    for (const char *p = msg; *p && o + 1 < size;) {
        bool whole = !strncmp(p, from, n) && (p == msg || !word_char(p[-1])) && !word_char(p[n]);
        const char *src = whole ? to : p;
        size_t len = whole ? strlen(to) : 1;
        for (size_t i = 0; i < len && o + 1 < size; i++)
            out[o++] = src[i];
        p += whole ? n : 1;
    }
    out[o] = '\0';
}

static bool type_in(const char *type, const char *const *types, int n)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(type, types[i]))
            return true;
    return false;
}

ks_status server_proxy_join_text(const cJSON *v, const char *const *types, int n_types, char **out)
{
    *out = NULL;
    if (cJSON_IsString(v))
        return (*out = strdup(v->valuestring)) ? KS_OK : KS_ERR_NOMEM;
    if (!cJSON_IsArray(v))
        return KS_ERR_INVALID_ARG;
    struct sbuf b = {0};
    const cJSON *part;
    int k = 0;
    cJSON_ArrayForEach(part, v) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(part, "text");
        if (!cJSON_IsString(type) || !type_in(type->valuestring, types, n_types) || !cJSON_IsString(text)) {
            sbuf_free(&b);
            return KS_ERR_INVALID_ARG;
        }
        if (k++)
            sbuf_puts(&b, "\n");
        sbuf_puts(&b, text->valuestring);
    }
    if (!b.oom)
        *out = b.p ? b.p : strdup("");
    else
        sbuf_free(&b);
    return *out ? KS_OK : KS_ERR_NOMEM;
}

ks_status server_proxy_refuse_parts(struct reply *r, const cJSON *v, const char *const *types, int n_types,
                                    const char *where, const char *kinds)
{
    int k = 0;
    const cJSON *part, *parts = cJSON_IsArray(v) ? v : NULL;
    cJSON_ArrayForEach(part, parts) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
        if (cJSON_IsString(type) && !type_in(type->valuestring, types, n_types))
            return reply_fail(r, KS_ERR_INVALID_ARG, "unsupported_parameter",
                              "%s[%d].type '%.64s' is not supported: kvserve reads %s only (no images, audio or "
                              "files)",
                              where, k, type->valuestring, kinds);
        if (!cJSON_IsString(type) || !cJSON_IsString(cJSON_GetObjectItemCaseSensitive(part, "text")))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                              "%s[%d] must be {\"type\":\"%s\",\"text\":STRING}", where, k, types[0]);
        k++;
    }
    return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "%s must be a string or an array of %s", where, kinds);
}

void server_proxy_copy_fields(cJSON *chat, const cJSON *root, const char *const (*map)[2], size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, map[i][0]);
        if (v && !cJSON_IsNull(v))
            server_json_add(chat, map[i][1], cJSON_Duplicate(v, 1));
    }
    if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(root, "stream")))
        cJSON_AddTrueToObject(cJSON_AddObjectToObject(chat, "stream_options"), "include_usage");
}

ks_status server_proxy_fail(const struct proxy_api *api, struct reply *r, ks_status st)
{
    char msg[1024];
    const char *m = ks_errmsg();
    snprintf(msg, sizeof msg, "%s", *m ? m : ks_strerror(st));
    api->error(r, r->http_status ? r->http_status : server_http_status(st), r->err_code, msg);
    return KS_OK;
}

/* The facts of the request's only choice (n is 1 on these routes). */
static struct proxy_facts call_facts(struct call *c)
{
    struct proxy_facts f = {.n_prompt = c ? c->n_prompt : 0};
    if (c) {
        pthread_mutex_lock(&c->mu);
        f.n_cached = c->n_cached;
        pthread_mutex_unlock(&c->mu);
    }
    if (c && c->stopped && c->stop_word >= 0 && c->stop_word < c->n_stop)
        f.stop_word = c->stop[c->stop_word];
    return f;
}

/* A whole chat answer in r (200) -> the API's; a failure -> its error. */
static ks_status translate_whole(const struct proxy_api *api, void *ctx, const struct proxy_facts *f, struct reply *r,
                                 ks_status st)
{
    if (st)
        return server_proxy_fail(api, r, st);
    server_json_reset();
    cJSON *chat = cJSON_ParseWithLength(r->body, r->len);
    reply_free(r);
    cJSON *out = NULL;
    st = chat ? api->whole(ctx, chat, f, &out) : KS_ERR_NOMEM;
    cJSON_Delete(chat);
    if (!st)
        st = reply_json(r, 200, out);
    if (st)
        return server_proxy_fail(api, r, reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while writing the response"));
    return KS_OK;
}

/* ---- a whole reply still waited for ---------------------------------------------- */

struct proxy_wait {
    bool (*poll)(void *, struct reply *, ks_status *);
    void (*abort_fn)(void *);
    void *cls;
    struct call *c;           /* the choice (a reference of ours): its stop string */
    const struct proxy_api *api;
    void *ctx;
};

static void proxy_wait_free(struct proxy_wait *w)
{
    server_call_unref(w->c);
    w->api->ctx_free(w->ctx);
    free(w);
}

static bool proxy_wait_poll(void *cls, struct reply *r, ks_status *st)
{
    struct proxy_wait *w = cls;
    ks_status inner = KS_OK;
    if (!w->poll(w->cls, r, &inner))
        return false;
    struct proxy_facts f = call_facts(w->c);
    *st = translate_whole(w->api, w->ctx, &f, r, inner);
    proxy_wait_free(w);
    return true;
}

static void proxy_wait_abort(void *cls)
{
    struct proxy_wait *w = cls;
    w->abort_fn(w->cls);
    proxy_wait_free(w);
}

/* ---- a stream ---------------------------------------------------------------------- */

struct proxy_stream {
    MHD_ContentReaderCallback read;
    MHD_ContentReaderFreeCallback free_fn;
    struct group *g;          /* the chat stream's */
    const struct proxy_api *api;
    void *ctx;
    struct sbuf in;           /* the chat stream's bytes not yet parsed */
    struct sbuf out;          /* the API's events not yet sent */
    size_t out_pos;
    bool inner_over;          /* the chat stream has ended */
    ssize_t end;              /* how it ended (MHD_CONTENT_READER_END_*) */
};

/* Translate each complete chat event in s->in. false: out of memory. */
static bool stream_translate(struct proxy_stream *s)
{
    size_t pos = 0;
    bool ok = true;
    char *end;
    while (ok && s->in.p && (end = strstr(s->in.p + pos, "\n\n"))) {
        char *line = s->in.p + pos;
        *end = '\0';
        pos = (size_t)(end - s->in.p) + 2;
        if (strncmp(line, "data: ", 6))
            continue;
        line += 6;
        struct proxy_facts f = call_facts(s->g->calls[0]);
        server_json_reset();
        if (!strcmp(line, "[DONE]")) {
            ok = s->api->event(s->ctx, NULL, &f, &s->out);
            continue;
        }
        cJSON *chunk = cJSON_Parse(line);
        ok = chunk && s->api->event(s->ctx, chunk, &f, &s->out);
        cJSON_Delete(chunk);
    }
    if (pos) {
        memmove(s->in.p, s->in.p + pos, s->in.n - pos + 1);
        s->in.n -= pos;
    }
    return ok && !s->out.oom;
}

static ssize_t proxy_stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    struct proxy_stream *s = cls;
    for (;;) {
        if (s->out.n > s->out_pos) {
            size_t n = s->out.n - s->out_pos < max ? s->out.n - s->out_pos : max;
            memcpy(buf, s->out.p + s->out_pos, n);
            s->out_pos += n;
            return (ssize_t)n;
        }
        s->out.n = s->out_pos = 0;
        if (s->out.p)
            s->out.p[0] = '\0';
        if (s->inner_over)
            return s->end;
        char chunk[4096];
        ssize_t n = s->read(s->g, pos, chunk, sizeof chunk);
        if (n == 0)
            return 0; /* the connection sleeps until the scheduler's next event */
        if (n < 0) {
            s->inner_over = true;
            s->end = n;
            if (n == MHD_CONTENT_READER_END_WITH_ERROR) /* the client has gone */
                return n;
            continue;
        }
        sbuf_append(&s->in, chunk, (size_t)n);
        if (s->in.oom || !stream_translate(s))
            return MHD_CONTENT_READER_END_WITH_ERROR;
    }
}

static void proxy_stream_free(void *cls)
{
    struct proxy_stream *s = cls;
    s->free_fn(s->g);
    s->api->ctx_free(s->ctx);
    sbuf_free(&s->in);
    sbuf_free(&s->out);
    free(s);
}

/* ---- entry ------------------------------------------------------------------------- */

ks_status server_proxy_chat(struct server *srv, const struct server_req *rq, cJSON *chat, const struct proxy_api *api,
                            void *ctx, struct reply *r)
{
    char *body = server_json_failed() ? NULL : cJSON_PrintUnformatted(chat);
    cJSON_Delete(chat);
    if (!body || server_json_failed()) {
        free(body);
        api->ctx_free(ctx);
        return server_proxy_fail(api, r, reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while reading the request"));
    }
    struct server_req inner = *rq;
    inner.body = body;
    inner.len = strlen(body);
    ks_status st = server_route_chat(srv, &inner, r);
    free(body);
    if (st || r->body) {
        struct proxy_facts f = {0};
        st = translate_whole(api, ctx, &f, r, st);
        api->ctx_free(ctx);
        return st;
    }
    if (r->wait_poll) {
        struct proxy_wait *w = calloc(1, sizeof *w);
        if (!w) {
            reply_free(r);
            api->ctx_free(ctx);
            return server_proxy_fail(api, r, reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while starting the request"));
        }
        struct group *g = r->wait_cls;
        *w = (struct proxy_wait){r->wait_poll, r->wait_abort, r->wait_cls, g->calls[0], api, ctx};
        pthread_mutex_lock(&w->c->mu);
        w->c->refs++;
        pthread_mutex_unlock(&w->c->mu);
        r->wait_poll = proxy_wait_poll;
        r->wait_abort = proxy_wait_abort;
        r->wait_cls = w;
        return KS_OK;
    }
    struct proxy_stream *s = calloc(1, sizeof *s);
    if (!s) {
        reply_free(r);
        api->ctx_free(ctx);
        return server_proxy_fail(api, r, reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while starting the request"));
    }
    *s = (struct proxy_stream){.read = r->stream_read, .free_fn = r->stream_free, .g = r->stream_cls, .api = api,
                               .ctx = ctx};
    r->stream_read = proxy_stream_read;
    r->stream_free = proxy_stream_free;
    r->stream_cls = s;
    return KS_OK;
}

ks_status server_proxy_route(struct server *srv, const struct server_req *rq, const struct proxy_api *api,
                             struct reply *r)
{
    cJSON *root, *chat = NULL;
    void *ctx = NULL;
    ks_status st = server_parse_object(rq->body, rq->len, false, &root, r);
    if (!st) {
        st = api->request(srv, root, &chat, &ctx, r);
        cJSON_Delete(root);
    }
    if (st)
        return server_proxy_fail(api, r, st);
    return server_proxy_chat(srv, rq, chat, api, ctx, r);
}
