/* The HTTP daemon: body collection with a size cap, the route table, auth,
 * the error convention (a route returns ks_status; a failure becomes an
 * OpenAI-shaped error here) and the small routes (/health, /v1/models). */
#include "server/server_internal.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

/* ---- small helpers ----------------------------------------------------------- */

/* ---- replies and the error convention ------------------------------------------- */

static _Thread_local bool json_oom;

static void *json_malloc(size_t n)
{
    void *p = malloc(n);
    if (!p)
        json_oom = true;
    return p;
}

static void json_hooks_install(void)
{
    cJSON_Hooks h = {.malloc_fn = json_malloc, .free_fn = free};
    cJSON_InitHooks(&h);
}

void server_json_reset(void)
{
    json_oom = false;
}

bool server_json_failed(void)
{
    return json_oom;
}

void server_json_add(cJSON *obj, const char *key, cJSON *item)
{
    if (!obj || !item || !cJSON_AddItemToObject(obj, key, item)) {
        cJSON_Delete(item);
        json_oom = true;
    }
}

void server_json_push(cJSON *arr, cJSON *item)
{
    if (!arr || !item || !cJSON_AddItemToArray(arr, item)) {
        cJSON_Delete(item);
        json_oom = true;
    }
}

ks_status server_parse_object(const char *body, size_t len, bool empty_is_object, cJSON **out, struct reply *r)
{
    server_json_reset();
    const char *end = NULL;
    cJSON *root = len == 0 && empty_is_object ? cJSON_CreateObject() : cJSON_ParseWithLengthOpts(body, len, &end, false);
    if (cJSON_IsObject(root) && len > 0) {
        ks_status st = server_json_strict(body, len, end, root, r);
        if (st) {
            cJSON_Delete(root);
            *out = NULL;
            return st;
        }
    }
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        *out = NULL;
        if (server_json_failed())
            return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while parsing the request body");
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_json", "the body is not a JSON object (%s)",
                          len == 0 ? "empty body" : "parse error");
    }
    *out = root;
    return KS_OK;
}

ks_status reply_text(struct reply *r, unsigned status, const char *content_type, char *body, size_t len)
{
    r->status = status;
    r->content_type = content_type;
    r->body = body;
    r->len = len;
    return KS_OK;
}

ks_status reply_json(struct reply *r, unsigned status, cJSON *obj)
{
    char *s = obj && !server_json_failed() ? cJSON_PrintUnformatted(obj) : NULL;
    cJSON_Delete(obj);
    if (!s || server_json_failed()) {
        free(s);
        return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while writing the response");
    }
    return reply_text(r, status, "application/json", s, strlen(s));
}

ks_status reply_fail(struct reply *r, ks_status st, const char *code, const char *fmt, ...)
{
    char msg[1024]; /* fmt's arguments may be ks_errmsg() itself */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    r->err_code = code;
    return ks_fail(st, "%s", msg);
}

void reply_free(struct reply *r)
{
    if (!r->body_static)
        free(r->body);
    if (r->stream_free)
        r->stream_free(r->stream_cls);
    r->body = NULL;
    r->body_static = false;
    r->stream_read = NULL;
    r->stream_free = NULL;
    r->stream_cls = NULL;
    if (r->wait_abort)
        r->wait_abort(r->wait_cls);
    r->wait_poll = NULL;
    r->wait_abort = NULL;
    r->wait_cls = NULL;
}

unsigned server_http_status(ks_status st)
{
    switch (st) {
    case KS_ERR_INVALID_ARG:
    case KS_ERR_FORMAT:
    case KS_ERR_RANGE: return 400;
    case KS_ERR_NOT_FOUND: return 404;
    case KS_ERR_KV_FULL: return 409;
    case KS_ERR_UNSUPPORTED: return 501;
    case KS_ERR_STATE: return 503;
    default: return 500; /* out of memory, I/O, internal */
    }
}

/* Every error has a code a client can switch on (issue 24): a route that
 * names none gets its status's. */
const char *server_default_error_code(unsigned status)
{
    switch (status) {
    case 400: return "invalid_request";
    case 401: return "unauthorized";
    case 403: return "forbidden";
    case 404: return "not_found";
    case 405: return "method_not_allowed";
    case 409: return "conflict";
    case 413: return "request_too_large";
    case 414: return "uri_too_long";
    case 415: return "unsupported_media_type";
    case 421: return "host_not_allowed";
    case 431: return "headers_too_large";
    case 501: return "not_implemented";
    case 503: return "unavailable";
    default: return status >= 500 ? "server_error" : "invalid_request";
    }
}

/* The OpenAI-shaped error body {"error":{"message","type","code"}}. When even
 * that cannot be allocated the reply is a static one, so an error is never
 * sent as an empty body. */
void server_reply_error(struct reply *r, unsigned status, const char *code, const char *fmt, ...)
{
    static const char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\",\"code\":\"out_of_memory\"}}";
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    reply_free(r);
    server_json_reset();
    cJSON *root = cJSON_CreateObject();
    cJSON *err = cJSON_AddObjectToObject(root, "error");
    cJSON_AddStringToObject(err, "message", msg);
    cJSON_AddStringToObject(err, "type", status >= 500 ? "server_error" : "invalid_request_error");
    cJSON_AddStringToObject(err, "code", code ? code : server_default_error_code(status));
    server_reply_error_json(r, status, root, oom);
}

void server_reply_error_json(struct reply *r, unsigned status, cJSON *o, const char *oom_body)
{
    char *s = server_json_failed() ? NULL : cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (s && server_json_failed()) {
        free(s);
        s = NULL;
    }
    r->status = s ? status : 500;
    r->content_type = "application/json";
    r->body = s ? s : (char *)oom_body;
    r->body_static = !s;
    r->len = strlen(r->body);
}

void server_config_default(struct server_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->host = "127.0.0.1";
    cfg->port = 8080;
    cfg->max_body = 8u << 20;
    cfg->model_name = "kvserve";
    cfg->ctx_size = 4096;
    cfg->timeout_s = 30;
    cfg->max_conn_per_ip = 64;
}

/* ---- small routes ------------------------------------------------------------- */

static ks_status route_health(struct server *srv, const struct server_req *rq, struct reply *r)
{
    (void)rq;
    pthread_mutex_lock(&srv->mu);
    bool ready = srv->ready, draining = srv->draining;
    pthread_mutex_unlock(&srv->mu);
    cJSON *o = cJSON_CreateObject();
    /* a balancer stops sending work here as soon as the drain begins */
    cJSON_AddStringToObject(o, "status", draining ? "draining" : ready ? "ok" : "loading");
    return reply_json(r, ready && !draining ? 200 : 503, o);
}

static ks_status route_models(struct server *srv, const struct server_req *rq, struct reply *r)
{
    (void)rq;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "object", "list");
    cJSON *data = cJSON_AddArrayToObject(o, "data");
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "id", srv->model_name);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", (double)time(NULL));
    cJSON_AddStringToObject(m, "owned_by", "kvserve");
    cJSON_AddNumberToObject(m, "context_length", srv->cfg.ctx_size);
    server_json_push(data, m);
    return reply_json(r, 200, o);
}

/* ---- routing ---------------------------------------------------------------------- */

/* Every route, as Redis's command table: one row per path, dispatched
 * through fn. GET routes answer HEAD too. open: served without the API key
 * (/health for probes; / is the page, which holds no data and asks for the
 * key itself). */
static const struct route {
    const char *path;
    const char *method;
    bool open;
    server_route_fn fn;
} routes[] = {
    {"/health", "GET", true, route_health},
    {"/", "GET", true, server_route_page},
    {"/v1/models", "GET", false, route_models},
    {"/v1/chat/completions", "POST", false, server_route_chat},
    {"/apply-template", "POST", false, server_route_apply_template},
    {"/v1/completions", "POST", false, server_route_completions},
    /* llama-server's routes, and the OpenAI ones without /v1 as it serves them */
    {"/models", "GET", false, route_models},
    {"/chat/completions", "POST", false, server_route_chat},
    {"/completions", "POST", false, server_route_completions},
    {"/completion", "POST", false, server_route_completion_native},
    {"/infill", "POST", false, server_route_infill},
    {"/tokenize", "POST", false, server_route_tokenize},
    {"/detokenize", "POST", false, server_route_detokenize},
    {"/props", "GET", false, server_route_props},
    {"/slots", "GET", false, server_route_slots},
    {"/metrics", "GET", false, server_route_metrics},
    {"/cache/usage", "GET", false, server_route_cache_usage},
    {"/cache/requantize", "POST", false, server_route_requantize},
    {"/cache/policy", "POST", false, server_route_policy},
    {"/cache/prefixes", "GET", false, server_route_cache_prefixes},
    {"/cache/clear", "POST", false, server_route_cache_clear},
    /* Anthropic's Messages API and OpenAI's Responses API, over the chat route */
    {"/v1/messages", "POST", false, server_route_messages},
    {"/v1/messages/count_tokens", "POST", false, server_route_count_tokens},
    {"/v1/responses", "POST", false, server_route_responses},
    {"/responses", "POST", false, server_route_responses},
    {"/v1/embeddings", "POST", false, server_route_embeddings},
    {"/embeddings", "POST", false, server_route_embeddings_native},
};

const char *server_req_arg(const struct server_req *rq, const char *name)
{
    return rq->arg ? rq->arg(rq->arg_ctx, name) : NULL;
}

static bool key_matches(const struct server *srv, const char *k)
{
    /* constant-time compare so the key cannot be probed byte by byte */
    size_t kl = strlen(k), al = strlen(srv->api_key);
    unsigned diff = (unsigned)(kl != al);
    for (size_t i = 0; i < kl && i < al; i++)
        diff |= (unsigned)(k[i] ^ srv->api_key[i]);
    return diff == 0;
}

/* The key as "Authorization: Bearer KEY" or as "x-api-key: KEY" (Anthropic's clients). */
static bool authorized_by(const struct server *srv, const char *h, const char *x_api_key)
{
    if (!srv->api_key || server_admin_key_matches(srv, h))
        return true;
    if (x_api_key && key_matches(srv, x_api_key))
        return true;
    return h && strncmp(h, "Bearer ", 7) == 0 && key_matches(srv, h + 7);
}

static bool method_allowed(const struct route *rt, const char *method)
{
    if (!strcmp(rt->method, "GET") && !strcmp(method, "HEAD"))
        return true;
    return !strcmp(rt->method, method);
}

static const struct route *route_find(const char *path)
{
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++)
        if (!strcmp(path, routes[i].path))
            return &routes[i];
    return NULL;
}

/* The error convention: a failed status becomes the error reply; a KS_OK
 * without a reply is a bug, answered as one. */
static void route_result(const struct server_req *rq, struct reply *r, ks_status st)
{
    if (st) {
        const char *msg = ks_errmsg();
        server_reply_error(r, r->http_status ? r->http_status : server_http_status(st), r->err_code, "%s",
                           *msg ? msg : ks_strerror(st));
    } else if (!r->status || (!r->body && !r->stream_read && !r->wait_poll && r->status != 204)) {
        server_reply_error(r, 500, NULL, "%s %s produced no reply (a bug in kvserve)", rq->method, rq->path);
    }
}

static void reply_unauthorized(struct reply *r, const char *path)
{
    if (server_anthropic_path(path))
        server_anthropic_error(r, 401, NULL, "missing or wrong API key: send the header 'x-api-key: KEY' or "
                                             "'Authorization: Bearer KEY'");
    else
        server_reply_error(r, 401, "invalid_api_key", "missing or wrong API key: send the header 'Authorization: Bearer KEY'");
}

void server_dispatch(struct server *srv, const struct server_req *rq, struct reply *r)
{
    const struct route *rt = route_find(rq->path);
    if (!(rt && rt->open) && !authorized_by(srv, rq->authorization, rq->x_api_key)) {
        reply_unauthorized(r, rq->path);
        return;
    }
    if (!rt) {
        server_reply_error(r, 404, "not_found", "unknown route %s %s", rq->method, rq->path);
        return;
    }
    if (server_admin_refuse(srv, rq->path, rq->authorization, r))
        return;
    if (!method_allowed(rt, rq->method)) {
        server_reply_error(r, 405, "method_not_allowed", "%s does not accept %s; use %s", rq->path, rq->method, rt->method);
        return;
    }
    server_json_reset();
    route_result(rq, r, rt->fn(srv, rq, r));
}

/* ---- connection handling -------------------------------------------------------- */

/* One request on a connection (MHD's con_cls). */
struct conn {
    struct sbuf body;           /* the request body, while within --max-body */
    size_t received;            /* body bytes received, kept or discarded */
    bool too_big;
    bool answered;              /* a reply was queued from the headers alone */
    bool waiting;               /* reply is a whole reply the scheduler has yet to produce */
    struct server_head head;    /* into MHD's storage of the request's headers */
    struct reply reply;
    struct server_waker *waker;
};

static const char *connection_arg(void *conn, const char *name)
{
    return MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, name);
}

static const char *header(struct MHD_Connection *c, const char *name)
{
    return MHD_lookup_connection_value(c, MHD_HEADER_KIND, name);
}

static enum MHD_Result send_reply(struct server *srv, struct MHD_Connection *c, struct conn *cs, struct reply *r)
{
    struct MHD_Response *resp;
    if (r->stream_read) {
        resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, r->stream_read, r->stream_cls, r->stream_free);
        if (resp)
            r->stream_free = NULL; /* the response owns the stream now */
    } else {
        resp = MHD_create_response_from_buffer(r->len, r->body, r->body_static ? MHD_RESPMEM_PERSISTENT
                                                                               : MHD_RESPMEM_MUST_FREE);
        if (resp)
            r->body = NULL;
    }
    if (!resp) {
        reply_free(r);
        return MHD_NO;
    }
    if (r->status != 204)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE,
                                r->content_type ? r->content_type : "application/json");
    if (r->retry_after > 0) {
        char v[16];
        snprintf(v, sizeof v, "%d", r->retry_after);
        MHD_add_response_header(resp, MHD_HTTP_HEADER_RETRY_AFTER, v);
    }
    if (r->stream_read) {
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
        MHD_add_response_header(resp, "X-Accel-Buffering", "no");
    }
    server_guard_cors_headers(srv, &cs->head, resp);
    enum MHD_Result ret = MHD_queue_response(c, r->status, resp);
    MHD_destroy_response(resp);
    r->stream_read = NULL;
    r->stream_cls = NULL;
    reply_free(r);
    pthread_mutex_lock(&srv->mu);
    srv->http_requests++;
    if (r->status >= 400)
        srv->http_errors++;
    pthread_mutex_unlock(&srv->mu);
    return ret;
}

/* A reply decided by the headers alone (refused, or a preflight): sent
 * before the body is read, which is then not read at all. */
static enum MHD_Result answer_early(struct server *srv, struct MHD_Connection *c, struct conn *cs)
{
    cs->answered = true;
    return send_reply(srv, c, cs, &cs->reply);
}

static void reply_too_large(struct server *srv, struct reply *r)
{
    server_reply_error(r, 413, "request_too_large", "the request body is larger than the limit of %zu bytes (--max-body)",
                       srv->cfg.max_body);
}

/* The first call of a request: only its headers have arrived. */
static enum MHD_Result on_headers(struct server *srv, struct MHD_Connection *c, const char *url, const char *method,
                                  struct conn *cs)
{
    cs->head = (struct server_head){
        .method = method, .path = url, .host = header(c, MHD_HTTP_HEADER_HOST),
        .origin = header(c, MHD_HTTP_HEADER_ORIGIN), .content_type = header(c, MHD_HTTP_HEADER_CONTENT_TYPE),
        .acr_method = header(c, "Access-Control-Request-Method"),
        .acr_headers = header(c, "Access-Control-Request-Headers"),
    };
    const struct route *rt = route_find(url);
    if (server_guard(srv, &cs->head, rt && !strcmp(rt->method, "POST"), &cs->reply))
        return answer_early(srv, c, cs);
    if (!(rt && rt->open) && !authorized_by(srv, header(c, MHD_HTTP_HEADER_AUTHORIZATION), header(c, "x-api-key"))) {
        reply_unauthorized(&cs->reply, url);
        return answer_early(srv, c, cs);
    }
    if (rt && server_admin_refuse(srv, url, header(c, MHD_HTTP_HEADER_AUTHORIZATION), &cs->reply))
        return answer_early(srv, c, cs);
    const char *cl = header(c, MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (cl && strtoull(cl, NULL, 10) > srv->cfg.max_body) {
        reply_too_large(srv, &cs->reply);
        return answer_early(srv, c, cs);
    }
    return MHD_YES;
}

/* A body past --max-body whose length was not announced (chunked) is
 * discarded as it arrives and answered with 413 at its end; libmicrohttpd
 * 0.9.75 cannot queue a reply in the middle of an upload. A client that
 * sends more than this past the limit is cut off without one. */
enum { DISCARD_MAX = 1 << 20 };

/* A piece of the body. */
static enum MHD_Result on_body(struct server *srv, struct conn *cs, const char *data, size_t n)
{
    if (cs->answered)
        return MHD_YES;
    cs->received += n;
    if (cs->too_big || cs->received > srv->cfg.max_body) {
        if (!cs->too_big) {
            cs->too_big = true;
            sbuf_free(&cs->body);
        }
        return cs->received - srv->cfg.max_body > DISCARD_MAX ? MHD_NO : MHD_YES;
    }
    sbuf_append(&cs->body, data, n);
    return cs->body.oom ? MHD_NO : MHD_YES;
}

/* The whole reply is waited for: poll it each time the connection wakes,
 * send it when ready, sleep (suspended) otherwise. A client that hung up
 * cancels the work, and its connection is closed. */
static enum MHD_Result continue_waiting(struct server *srv, struct MHD_Connection *c, struct conn *cs)
{
    struct reply *r = &cs->reply;
    for (;;) {
        if (server_waker_gone(cs->waker)) {
            reply_free(r); /* wait_abort */
            cs->waiting = false;
            return MHD_NO;
        }
        bool (*poll)(void *, struct reply *, ks_status *) = r->wait_poll;
        void (*abort_fn)(void *) = r->wait_abort;
        void *cls = r->wait_cls;
        r->wait_poll = NULL;
        r->wait_abort = NULL;
        r->wait_cls = NULL;
        ks_status st = KS_OK;
        if (poll(cls, r, &st)) {
            cs->waiting = false;
            struct server_req rq = {.method = cs->head.method, .path = cs->head.path};
            route_result(&rq, r, st);
            return send_reply(srv, c, cs, r);
        }
        r->wait_poll = poll;
        r->wait_abort = abort_fn;
        r->wait_cls = cls;
        if (server_waker_sleep(cs->waker))
            return MHD_YES;
    }
}

/* The request is complete: route it. */
static enum MHD_Result on_request_end(struct server *srv, struct MHD_Connection *c, struct conn *cs)
{
    struct reply *r = &cs->reply;
    if (cs->too_big) {
        reply_too_large(srv, r);
        return send_reply(srv, c, cs, r);
    }
    cs->waker = server_waker_new(srv, c);
    if (!cs->waker) {
        server_reply_error(r, 500, "out_of_memory", "out of memory while starting the request");
        return send_reply(srv, c, cs, r);
    }
    struct server_req rq = {
        .method = cs->head.method, .path = cs->head.path, .body = cs->body.p ? cs->body.p : "", .len = cs->body.n,
        .authorization = header(c, MHD_HTTP_HEADER_AUTHORIZATION), .x_api_key = header(c, "x-api-key"),
        .arg = connection_arg, .arg_ctx = c, .waker = cs->waker,
    };
    server_dispatch(srv, &rq, r);
    if (r->wait_poll) {
        cs->waiting = true;
        return continue_waiting(srv, c, cs);
    }
    return send_reply(srv, c, cs, r);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload_data, size_t *upload_data_size,
                                  void **con_cls)
{
    (void)version;
    struct server *srv = cls;
    struct conn *cs = *con_cls;
    if (!cs) {
        cs = calloc(1, sizeof *cs);
        if (!cs)
            return MHD_NO;
        *con_cls = cs;
        server_watch_request(srv, c, true);
        return on_headers(srv, c, url, method, cs);
    }
    if (*upload_data_size > 0) {
        size_t n = *upload_data_size;
        *upload_data_size = 0;
        return on_body(srv, cs, upload_data, n);
    }
    if (cs->answered)
        return MHD_YES;
    if (cs->waiting)
        return continue_waiting(srv, c, cs);
    return on_request_end(srv, c, cs);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe)
{
    struct server *srv = cls;
    if (toe == MHD_REQUEST_TERMINATED_COMPLETED_OK) /* the connection stays open for the next request */
        server_watch_request(srv, c, false);
    struct conn *cs = *con_cls;
    if (cs) {
        reply_free(&cs->reply); /* a reply still waited for is cancelled */
        if (cs->waker) {
            server_waker_detach(cs->waker);
            server_waker_unref(cs->waker);
        }
        sbuf_free(&cs->body);
        free(cs);
        *con_cls = NULL;
    }
}

static void on_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe)
{
    server_watch_connection(cls, c, socket_context, toe == MHD_CONNECTION_NOTIFY_STARTED);
}

/* ---- lifetime -------------------------------------------------------------------- */

/* The polling threads of the daemon: enough that one request's parsing and
 * tokenizing (done on them) does not hold up everyone else. */
enum { HTTP_THREADS = 4 };
/* File descriptors kept out of the connection limit: the model, the cache
 * directory, the daemon's own (epoll, listening socket, wakeups), logs. */
enum { RESERVED_FDS = 128 };

static int connection_limit_from_files(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY)
        return 1 << 16;
    long n = (long)rl.rlim_cur - RESERVED_FDS;
    return n < 16 ? 16 : n > (1 << 20) ? 1 << 20 : (int)n;
}

int server_max_connections(const struct server *srv)
{
    return srv->max_conn;
}

static char *dup_or_null(const char *s)
{
    return s ? strdup(s) : NULL;
}

ks_status server_start(const struct server_config *cfg, struct sched *sched, const struct tokenizer *tok,
                       struct server **out)
{
    if (cfg->port < 0 || cfg->port > 65535)
        return ks_fail(KS_ERR_INVALID_ARG, "--port must be in 0..65535 (got %d)", cfg->port);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)cfg->port)};
    if (inet_pton(AF_INET, cfg->host, &addr.sin_addr) != 1)
        return ks_fail(KS_ERR_INVALID_ARG, "--host '%s' is not an IPv4 address (e.g. 127.0.0.1 or 0.0.0.0)", cfg->host);
    struct server *srv = calloc(1, sizeof *srv);
    if (!srv)
        return ks_fail(KS_ERR_NOMEM, "server: out of memory");
    srv->cfg = *cfg;
    pthread_mutex_init(&srv->mu, NULL);
    srv->host = dup_or_null(cfg->host);
    srv->api_key = dup_or_null(cfg->api_key && *cfg->api_key ? cfg->api_key : NULL);
    srv->model_name = dup_or_null(cfg->model_name ? cfg->model_name : "kvserve");
    if (!srv->host || (cfg->api_key && *cfg->api_key && !srv->api_key) || !srv->model_name) {
        server_stop(srv); /* a lost API key would open the server */
        return ks_fail(KS_ERR_NOMEM, "server: out of memory");
    }
    ks_status pst = server_privacy_init(srv);
    if (pst) {
        char msg[256];
        snprintf(msg, sizeof msg, "%s", ks_errmsg());
        server_stop(srv);
        return ks_fail(pst, "%s", msg);
    }
    srv->sched = sched;
    srv->tok = tok;
    ks_status cst = tok ? server_chat_setup(srv, cfg) : KS_OK;
    if (cst) {
        char msg[1024]; /* server_stop may overwrite the message */
        snprintf(msg, sizeof msg, "%s", ks_errmsg());
        server_stop(srv);
        return ks_fail(cst, "%s", msg);
    }
    /* the vocabulary's trie for grammar-constrained requests, built once (~0.1 s at 151k tokens) */
    ks_status gst = tok ? grammar_vocab_from_tokenizer(tok, &srv->grammar_vocab) : KS_OK;
    if (gst) {
        server_stop(srv);
        return gst;
    }
    static pthread_once_t hooks_once = PTHREAD_ONCE_INIT;
    pthread_once(&hooks_once, json_hooks_install);
    srv->host_loopback = (ntohl(addr.sin_addr.s_addr) >> 24) == 127;
    unsigned timeout = (unsigned)(cfg->timeout_s > 0 ? cfg->timeout_s : 30);
    ks_status wst = server_watch_start(srv, (int)timeout);
    if (wst) {
        server_stop(srv);
        return wst;
    }
    srv->max_conn = cfg->max_conn > 0 ? cfg->max_conn : connection_limit_from_files();
    /* epoll polling threads serve every connection: an idle or slow one
     * costs a socket and a little memory, never a thread */
    /* the address to bind, or the socket the loading responder listened on */
    int listen_fd = cfg->listen_from ? server_loading_handoff(cfg->listen_from) : -1;
    if (cfg->listen_from && listen_fd < 0) {
        server_stop(srv);
        return ks_fail(KS_ERR_IO, "cannot take over the listening socket of %s:%d", cfg->host, cfg->port);
    }
    struct MHD_OptionItem where[] = {
        listen_fd >= 0 ? (struct MHD_OptionItem){MHD_OPTION_LISTEN_SOCKET, listen_fd, NULL}
                       : (struct MHD_OptionItem){MHD_OPTION_SOCK_ADDR, 0, &addr},
        {MHD_OPTION_END, 0, NULL},
    };
    srv->daemon = MHD_start_daemon(MHD_USE_EPOLL_INTERNAL_THREAD | MHD_ALLOW_SUSPEND_RESUME,
                                   (uint16_t)cfg->port, NULL, NULL, on_request, srv,
                                   MHD_OPTION_ARRAY, where,
                                   MHD_OPTION_THREAD_POOL_SIZE, (unsigned)HTTP_THREADS,
                                   MHD_OPTION_CONNECTION_LIMIT, (unsigned)srv->max_conn,
                                   MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned)(cfg->max_conn_per_ip > 0
                                                                                  ? cfg->max_conn_per_ip : 0),
                                   MHD_OPTION_CONNECTION_TIMEOUT, timeout,
                                   MHD_OPTION_NOTIFY_COMPLETED, on_completed, srv,
                                   MHD_OPTION_NOTIFY_CONNECTION, on_connection, srv,
                                   MHD_OPTION_END);
    if (!srv->daemon) {
        if (listen_fd >= 0)
            close(listen_fd);
        ks_status st = ks_fail(KS_ERR_IO, "cannot listen on %s:%d (port in use, or not allowed)", cfg->host, cfg->port);
        server_stop(srv);
        return st;
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(srv->daemon, MHD_DAEMON_INFO_BIND_PORT);
    srv->port = info && info->port ? info->port
              : cfg->listen_from   ? server_loading_port(cfg->listen_from)
                                   : cfg->port;
    *out = srv;
    return KS_OK;
}

void server_set_ready(struct server *srv, bool ready)
{
    pthread_mutex_lock(&srv->mu);
    srv->ready = ready;
    pthread_mutex_unlock(&srv->mu);
}

int server_port(const struct server *srv)
{
    return srv->port;
}

void server_quiesce(struct server *srv)
{
    pthread_mutex_lock(&srv->mu);
    srv->draining = true;
    pthread_mutex_unlock(&srv->mu);
    if (srv->daemon) {
        MHD_socket s = MHD_quiesce_daemon(srv->daemon);
        if (s != MHD_INVALID_SOCKET)
            close(s);
    }
}

int server_in_flight(struct server *srv)
{
    pthread_mutex_lock(&srv->mu);
    int n = srv->in_flight;
    pthread_mutex_unlock(&srv->mu);
    return n;
}

void server_stop(struct server *srv)
{
    if (!srv)
        return;
    server_requantize_stop(srv);
    if (srv->daemon) {
        server_watch_release_all(srv);
        MHD_stop_daemon(srv->daemon);
    }
    server_watch_stop(srv);
    pthread_mutex_destroy(&srv->mu);
    grammar_vocab_free(srv->grammar_vocab);
    free(srv->host);
    free(srv->api_key);
    server_privacy_free(srv);
    free(srv->model_name);
    server_chat_free(srv);
    free(srv);
}
