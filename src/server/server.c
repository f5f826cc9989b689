/* The HTTP daemon: body collection with a size cap, auth, routing and the
 * small routes (/health, /v1/models). */
#include "server/server_internal.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---- small helpers ----------------------------------------------------------- */

void reply_text(struct reply *r, unsigned status, const char *content_type, char *body, size_t len)
{
    r->status = status;
    r->content_type = content_type;
    r->body = body;
    r->len = len;
}

void reply_json(struct reply *r, unsigned status, cJSON *obj)
{
    char *s = obj ? cJSON_PrintUnformatted(obj) : NULL;
    cJSON_Delete(obj);
    if (!s) {
        static const char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\",\"code\":null}}";
        r->status = 500;
        r->content_type = "application/json";
        r->body = strdup(oom);
        r->len = r->body ? strlen(r->body) : 0;
        return;
    }
    reply_text(r, status, "application/json", s, strlen(s));
}

void reply_error(struct reply *r, unsigned status, const char *type, const char *code, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    cJSON *root = cJSON_CreateObject();
    cJSON *err = cJSON_AddObjectToObject(root, "error");
    cJSON_AddStringToObject(err, "message", msg);
    cJSON_AddStringToObject(err, "type", type);
    if (code)
        cJSON_AddStringToObject(err, "code", code);
    else
        cJSON_AddNullToObject(err, "code");
    reply_json(r, status, root);
}

void server_config_default(struct server_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->host = "127.0.0.1";
    cfg->port = 8080;
    cfg->max_body = 8u << 20;
    cfg->model_name = "kvserve";
    cfg->ctx_size = 4096;
}

/* ---- small routes ------------------------------------------------------------- */

static void handle_health(struct server *srv, struct reply *r)
{
    pthread_mutex_lock(&srv->mu);
    bool ready = srv->ready;
    pthread_mutex_unlock(&srv->mu);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "status", ready ? "ok" : "loading");
    reply_json(r, ready ? 200 : 503, o);
}

static void handle_models(struct server *srv, struct reply *r)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "object", "list");
    cJSON *data = cJSON_AddArrayToObject(o, "data");
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "id", srv->model_name);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", (double)time(NULL));
    cJSON_AddStringToObject(m, "owned_by", "kvserve");
    cJSON_AddNumberToObject(m, "context_length", srv->cfg.ctx_size);
    cJSON_AddItemToArray(data, m);
    reply_json(r, 200, o);
}

/* ---- connection handling -------------------------------------------------------- */

struct conn {
    char *body;
    size_t len, cap;
    bool too_big;
};

static bool authorized(struct server *srv, struct MHD_Connection *c)
{
    if (!srv->api_key)
        return true;
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!h || strncmp(h, "Bearer ", 7) != 0)
        return false;
    /* constant-time compare so the key cannot be probed byte by byte */
    const char *k = h + 7;
    size_t kl = strlen(k), al = strlen(srv->api_key);
    unsigned diff = (unsigned)(kl != al);
    for (size_t i = 0; i < kl && i < al; i++)
        diff |= (unsigned)(k[i] ^ srv->api_key[i]);
    return diff == 0;
}

static bool is_method(const char *m, const char *want)
{
    return strcmp(m, want) == 0;
}

static void route(struct server *srv, struct MHD_Connection *c, const char *url, const char *method,
                  const struct conn *cs, struct reply *r)
{
    bool get = is_method(method, "GET") || is_method(method, "HEAD");
    bool post = is_method(method, "POST");
    if (strcmp(url, "/health") != 0 && !authorized(srv, c)) {
        reply_error(r, 401, "invalid_request_error", "invalid_api_key",
                    "missing or wrong API key: send the header 'Authorization: Bearer KEY'");
        return;
    }
    struct {
        const char *path;
        bool want_post;
    } routes[] = {
        {"/health", false}, {"/v1/models", false}, {"/metrics", false}, {"/", false},
        {"/cache/usage", false}, {"/v1/chat/completions", true}, {"/v1/completions", true},
        {"/cache/requantize", true}, {"/cache/policy", true}, {"/cache/prefixes", false}, {"/cache/clear", true},
    };
    int found = -1;
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++)
        if (!strcmp(url, routes[i].path))
            found = (int)i;
    if (found < 0) {
        reply_error(r, 404, "invalid_request_error", "not_found", "unknown route %s %s", method, url);
        return;
    }
    if (routes[found].want_post ? !post : !get) {
        reply_error(r, 405, "invalid_request_error", "method_not_allowed", "%s does not accept %s; use %s",
                    url, method, routes[found].want_post ? "POST" : "GET");
        return;
    }
    const char *body = cs->body ? cs->body : "";
    switch (found) {
    case 0: handle_health(srv, r); break;
    case 1: handle_models(srv, r); break;
    case 2: server_handle_metrics(srv, r); break;
    case 3: server_handle_page(srv, r); break;
    case 4: server_handle_cache_usage(srv, r); break;
    case 5: server_handle_completion(srv, true, body, cs->len, r); break;
    case 6: server_handle_completion(srv, false, body, cs->len, r); break;
    case 7: server_handle_requantize(srv, body, cs->len, r); break;
    case 8: server_handle_policy(srv, body, cs->len, r); break;
    case 9: server_handle_cache_prefixes(srv, MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "limit"), r); break;
    case 10: server_handle_cache_clear(srv, body, cs->len, r); break;
    }
}

static enum MHD_Result send_reply(struct server *srv, struct MHD_Connection *c, struct reply *r)
{
    struct MHD_Response *resp = r->stream;
    if (!resp)
        resp = MHD_create_response_from_buffer(r->len, r->body ? r->body : (char *)"", r->body ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
    if (!resp) {
        free(r->body);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, r->content_type ? r->content_type : "application/json");
    if (r->retry_after > 0) {
        char v[16];
        snprintf(v, sizeof v, "%d", r->retry_after);
        MHD_add_response_header(resp, MHD_HTTP_HEADER_RETRY_AFTER, v);
    }
    if (r->stream) {
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
        MHD_add_response_header(resp, "X-Accel-Buffering", "no");
    }
    enum MHD_Result ret = MHD_queue_response(c, r->status ? r->status : 200, resp);
    MHD_destroy_response(resp);
    pthread_mutex_lock(&srv->mu);
    srv->http_requests++;
    if (r->status >= 400)
        srv->http_errors++;
    pthread_mutex_unlock(&srv->mu);
    return ret;
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
        /* refuse an announced oversized body before reading it */
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl && strtoull(cl, NULL, 10) > srv->cfg.max_body) {
            struct reply r = {0};
            reply_error(&r, 413, "invalid_request_error", "request_too_large",
                        "the request body is larger than the limit of %zu bytes (--max-body)", srv->cfg.max_body);
            return send_reply(srv, c, &r);
        }
        return MHD_YES;
    }
    if (*upload_data_size > 0) {
        size_t n = *upload_data_size;
        *upload_data_size = 0;
        if (cs->too_big || cs->len + n > srv->cfg.max_body) {
            cs->too_big = true;
            return MHD_YES;
        }
        if (cs->len + n + 1 > cs->cap) {
            size_t cap = cs->cap ? cs->cap : 4096;
            while (cap < cs->len + n + 1)
                cap *= 2;
            char *p = realloc(cs->body, cap);
            if (!p)
                return MHD_NO;
            cs->body = p;
            cs->cap = cap;
        }
        memcpy(cs->body + cs->len, upload_data, n);
        cs->len += n;
        cs->body[cs->len] = '\0';
        return MHD_YES;
    }
    struct reply r = {0};
    if (cs->too_big)
        reply_error(&r, 413, "invalid_request_error", "request_too_large",
                    "the request body is larger than the limit of %zu bytes (--max-body)", srv->cfg.max_body);
    else
        route(srv, c, url, method, cs, &r);
    return send_reply(srv, c, &r);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe)
{
    (void)cls;
    (void)c;
    (void)toe;
    struct conn *cs = *con_cls;
    if (cs) {
        free(cs->body);
        free(cs);
        *con_cls = NULL;
    }
}

/* ---- lifetime -------------------------------------------------------------------- */

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
    enum tok_chat_family chat = TOK_CHAT_CHATML;
    if (tok) {
        ks_status st = tok_chat_for(tok, cfg->chat_template, &chat);
        if (st && cfg->chat_template)
            return st;
        if (st) { /* the completions API still works; chat falls back like llama.cpp's does */
            fprintf(stderr, "kvserve serve: warning: %s; using chatml for /v1/chat/completions\n", ks_errmsg());
            chat = TOK_CHAT_CHATML;
        }
    }
    struct server *srv = calloc(1, sizeof *srv);
    if (!srv)
        return ks_fail(KS_ERR_NOMEM, "server: out of memory");
    srv->cfg = *cfg;
    srv->host = dup_or_null(cfg->host);
    srv->api_key = dup_or_null(cfg->api_key && *cfg->api_key ? cfg->api_key : NULL);
    srv->model_name = dup_or_null(cfg->model_name ? cfg->model_name : "kvserve");
    srv->sched = sched;
    srv->tok = tok;
    srv->chat = chat;
    pthread_mutex_init(&srv->mu, NULL);
    srv->daemon = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION | MHD_USE_ITC,
                                   (uint16_t)cfg->port, NULL, NULL, on_request, srv,
                                   MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&addr,
                                   MHD_OPTION_NOTIFY_COMPLETED, on_completed, srv,
                                   MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)600,
                                   MHD_OPTION_END);
    if (!srv->daemon) {
        ks_status st = ks_fail(KS_ERR_IO, "cannot listen on %s:%d (port in use, or not allowed)", cfg->host, cfg->port);
        server_stop(srv);
        return st;
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(srv->daemon, MHD_DAEMON_INFO_BIND_PORT);
    srv->port = info ? info->port : cfg->port;
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
    if (srv->daemon)
        MHD_stop_daemon(srv->daemon);
    pthread_mutex_destroy(&srv->mu);
    free(srv->host);
    free(srv->api_key);
    free(srv->model_name);
    free(srv);
}
