/* The router's HTTP side: libmicrohttpd with a thread per connection (a
 * forwarded answer's callback waits for the replica's next bytes), the
 * request's raw URI (path and query as the client sent them), its body, and
 * the router's own two routes; the rest is route_forward's. */
#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "route/route_internal.h"
#include "sbuf/sbuf.h"

enum { DEFAULT_MAX_BODY = 8 << 20, DEFAULT_HEALTH_MS = 1000, DEFAULT_TIMEOUT_S = 600 };

/* One request's state, from its URI to its end. */
struct conn {
    char *uri;                /* raw: path and query */
    struct sbuf body;         /* the upload, up to the body limit */
    bool started, too_big;
};

static void *on_uri(void *cls, const char *uri, struct MHD_Connection *c)
{
    (void)cls;
    (void)c;
    struct conn *cn = calloc(1, sizeof *cn);
    if (cn && !(cn->uri = strdup(uri))) {
        free(cn);
        cn = NULL;
    }
    return cn;
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode why)
{
    (void)cls;
    (void)c;
    (void)why;
    struct conn *cn = *con_cls;
    if (!cn)
        return;
    free(cn->uri);
    sbuf_free(&cn->body);
    free(cn);
    *con_cls = NULL;
}

static bool take_upload(struct conn *cn, size_t max, const char *data, size_t n)
{
    if (cn->too_big || cn->body.n + n > max) {
        cn->too_big = true;
        return true;
    }
    sbuf_append(&cn->body, data, n);
    return !cn->body.oom;
}

int route_answer_json(struct MHD_Connection *c, unsigned status, const char *json)
{
    struct MHD_Response *resp = MHD_create_response_from_buffer(strlen(json), (void *)json, MHD_RESPMEM_MUST_COPY);
    if (!resp)
        return MHD_NO;
    MHD_add_response_header(resp, "Content-Type", "application/json");
    int ret = MHD_queue_response(c, status, resp);
    MHD_destroy_response(resp);
    return ret;
}

static char *status_json(struct route *rt)
{
    cJSON *root = cJSON_CreateObject(), *reps = cJSON_AddArrayToObject(root, "replicas");
    for (int r = 0; r < rt->n_rep; r++) {
        struct route_replica *rep = &rt->rep[r];
        struct route_replica_info info;
        route_index_info(rt->index, r, &info);
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "url", rep->url);
        cJSON_AddBoolToObject(o, "healthy", atomic_load(&rep->healthy));
        cJSON_AddNumberToObject(o, "in_flight", atomic_load(&rep->in_flight));
        cJSON_AddNumberToObject(o, "active_pages", (double)atomic_load(&rep->active_pages));
        cJSON_AddNumberToObject(o, "forwarded", (double)atomic_load(&rep->forwarded));
        cJSON_AddNumberToObject(o, "pages_indexed", (double)info.keys);
        cJSON_AddNumberToObject(o, "events", (double)info.events);
        cJSON_AddNumberToObject(o, "snapshots", (double)info.snapshots);
        cJSON_AddNumberToObject(o, "gaps", (double)info.gaps);
        cJSON_AddNumberToObject(o, "seq", (double)info.seq);
        cJSON_AddBoolToObject(o, "has_layout", info.has_layout);
        cJSON_AddItemToArray(reps, o);
    }
    cJSON_AddBoolToObject(root, "events", rt->cfg.redis_url != NULL);
    cJSON_AddBoolToObject(root, "events_connected", atomic_load(&rt->events_connected));
    cJSON_AddNumberToObject(root, "requests", (double)atomic_load(&rt->requests));
    cJSON_AddNumberToObject(root, "routed_by_overlap", (double)atomic_load(&rt->by_overlap));
    cJSON_AddNumberToObject(root, "overlap_pages", (double)atomic_load(&rt->overlap_pages));
    cJSON_AddNumberToObject(root, "unread", (double)atomic_load(&rt->unread));
    cJSON_AddNumberToObject(root, "no_replica", (double)atomic_load(&rt->no_replica));
    cJSON_AddNumberToObject(root, "load_weight", rt->cfg.load_weight);
    cJSON_AddNumberToObject(root, "shared_page_cost", rt->cfg.shared_page_cost);
    char *text = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return text;
}

static int own_route(struct route *rt, struct MHD_Connection *c, const char *uri)
{
    size_t n = strcspn(uri, "?");
    if (n == 7 && !strncmp(uri, "/health", n)) {
        bool any = false;
        for (int r = 0; r < rt->n_rep; r++)
            any |= atomic_load(&rt->rep[r].healthy);
        return route_answer_json(c, any ? 200 : 503, any ? "{\"status\":\"ok\"}" : "{\"status\":\"no replica is up\"}");
    }
    char *text = status_json(rt);
    int ret = text ? route_answer_json(c, 200, text) : route_answer_json(c, 500, "{\"error\":\"out of memory\"}");
    cJSON_free(text);
    return ret;
}

static bool is_own(const char *method, const char *uri)
{
    size_t n = strcspn(uri, "?");
    return !strcmp(method, "GET") && ((n == 7 && !strncmp(uri, "/health", 7)) ||
                                      (n == 13 && !strncmp(uri, "/route/status", 13)));
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls)
{
    (void)url;
    (void)version;
    struct route *rt = cls;
    struct conn *cn = *con_cls;
    if (!cn)
        return MHD_NO; /* out of memory at its URI */
    if (!cn->started) {
        cn->started = true;
        return MHD_YES;
    }
    if (*upload_size) {
        bool ok = take_upload(cn, rt->cfg.max_body, upload, *upload_size);
        *upload_size = 0;
        return ok ? MHD_YES : MHD_NO;
    }
    if (cn->too_big)
        return (enum MHD_Result)route_answer_json(c, 413, "{\"error\":{\"message\":\"router: the body is larger than "
                                               "--max-body\",\"type\":\"invalid_request_error\",\"code\":"
                                               "\"request_too_large\"}}");
    if (is_own(method, cn->uri))
        return (enum MHD_Result)own_route(rt, c, cn->uri);
    return (enum MHD_Result)route_forward(rt, c, method, cn->uri, cn->body.p, cn->body.n);
}

/* ---- start and stop ----------------------------------------------------------------- */

static ks_status add_replica(struct route *rt, const char *url)
{
    if (strncmp(url, "http://", 7) || !url[7])
        return ks_fail(KS_ERR_INVALID_ARG, "route: --replica %s: give http://HOST:PORT", url);
    size_t n = strlen(url);
    while (n > 7 && url[n - 1] == '/')
        n--;
    struct route_replica *rep = &rt->rep[rt->n_rep];
    if (!(rep->url = strndup(url, n)))
        return ks_fail(KS_ERR_NOMEM, "route: out of memory");
    for (int r = 0; r < rt->n_rep; r++)
        if (!strcmp(rt->rep[r].url, rep->url))
            return ks_fail(KS_ERR_INVALID_ARG, "route: --replica %s is given twice", url);
    atomic_init(&rep->healthy, false);
    rt->n_rep++;
    return KS_OK;
}

static ks_status listen_on(struct route *rt)
{
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)rt->cfg.port)};
    if (inet_pton(AF_INET, rt->cfg.host, &addr.sin_addr) != 1)
        return ks_fail(KS_ERR_INVALID_ARG, "route: --listen %s: give an IPv4 address and a port", rt->cfg.host);
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL;
    rt->daemon = MHD_start_daemon(flags, 0, NULL, NULL, on_request, rt, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&addr,
                                  MHD_OPTION_URI_LOG_CALLBACK, on_uri, rt,
                                  MHD_OPTION_NOTIFY_COMPLETED, on_completed, rt,
                                  MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)rt->cfg.timeout_s,
                                  MHD_OPTION_END);
    if (!rt->daemon)
        return ks_fail(KS_ERR_IO, "route: cannot listen on %s:%d (in use, or not this machine's address?)",
                       rt->cfg.host, rt->cfg.port);
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(rt->daemon, MHD_DAEMON_INFO_BIND_PORT);
    rt->port = info ? info->port : rt->cfg.port;
    return KS_OK;
}

ks_status route_start(const struct route_config *cfg, struct route **out)
{
    *out = NULL;
    if (cfg->n_replicas < 1 || cfg->n_replicas > ROUTE_MAX_REPLICAS)
        return ks_fail(KS_ERR_INVALID_ARG, "route: give 1 to %d --replica URLs (got %d)", ROUTE_MAX_REPLICAS,
                       cfg->n_replicas);
    if (cfg->redis_url) {
        char host[256];
        int port, db;
        ks_status st = store_redis_parse_url(cfg->redis_url, host, sizeof host, &port, &db);
        if (st)
            return st;
    }
    struct route *rt = calloc(1, sizeof *rt);
    if (!rt)
        return ks_fail(KS_ERR_NOMEM, "route: out of memory");
    rt->cfg = *cfg;
    rt->cfg.load_weight = cfg->load_weight > 0 ? cfg->load_weight : 1.0;
    rt->cfg.shared_page_cost = cfg->shared_page_cost > 0 ? cfg->shared_page_cost : ROUTE_SHARED_PAGE_COST;
    rt->cfg.health_ms = cfg->health_ms > 0 ? cfg->health_ms : DEFAULT_HEALTH_MS;
    rt->cfg.max_body = cfg->max_body ? cfg->max_body : DEFAULT_MAX_BODY;
    rt->cfg.timeout_s = cfg->timeout_s > 0 ? cfg->timeout_s : DEFAULT_TIMEOUT_S;
    rt->cfg.replicas = NULL;
    pthread_mutex_init(&rt->mu, NULL);
    pthread_cond_init(&rt->wake, NULL);
    ks_status st = curl_global_init(CURL_GLOBAL_DEFAULT) ? ks_fail(KS_ERR_IO, "route: libcurl did not start") : KS_OK;
    for (int i = 0; !st && i < cfg->n_replicas; i++)
        st = add_replica(rt, cfg->replicas[i]);
    if (!st && cfg->redis_password && !(rt->redis_password = strdup(cfg->redis_password)))
        st = ks_fail(KS_ERR_NOMEM, "route: out of memory");
    rt->cfg.redis_password = NULL;
    if (!st)
        st = route_index_create(rt->n_rep, &rt->index);
    if (!st) {
        route_check_health(rt);
        st = listen_on(rt);
    }
    if (!st && pthread_create(&rt->health, NULL, route_health_main, rt) != 0)
        st = ks_fail(KS_ERR_NOMEM, "route: cannot start the health checks");
    rt->health_started = !st;
    if (!st && cfg->redis_url && pthread_create(&rt->events, NULL, route_events_main, rt) != 0)
        st = ks_fail(KS_ERR_NOMEM, "route: cannot start the events reader");
    rt->events_started = !st && cfg->redis_url;
    if (st) {
        route_stop(rt);
        return st;
    }
    *out = rt;
    return KS_OK;
}

int route_port(const struct route *rt) { return rt->port; }

void route_stop(struct route *rt)
{
    if (!rt)
        return;
    pthread_mutex_lock(&rt->mu);
    atomic_store(&rt->stop, true);
    pthread_cond_broadcast(&rt->wake);
    pthread_mutex_unlock(&rt->mu);
    if (rt->daemon)
        MHD_stop_daemon(rt->daemon);
    if (rt->health_started)
        pthread_join(rt->health, NULL);
    if (rt->events_started)
        pthread_join(rt->events, NULL);
    route_index_free(rt->index);
    for (int r = 0; r < rt->n_rep; r++)
        free(rt->rep[r].url);
    if (rt->redis_password)
        memset(rt->redis_password, 0, strlen(rt->redis_password));
    free(rt->redis_password);
    pthread_cond_destroy(&rt->wake);
    pthread_mutex_destroy(&rt->mu);
    curl_global_cleanup();
    free(rt);
}
