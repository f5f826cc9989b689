/* Forwarding one request: pick the replica (the prompt's pages it holds
 * against its load), send the request there with libcurl on a thread of its
 * own, and answer the client with the replica's status, headers and body as
 * the bytes arrive (libmicrohttpd pulls them through a callback that waits
 * for the next ones, so an SSE stream passes event by event). */
#include <curl/curl.h>
#include <microhttpd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "route/route_internal.h"

enum {
    MAX_BUFFERED = 1 << 20,   /* bytes read from the replica and not yet sent: the replica waits beyond */
    MAX_HEADERS = 64,
    CONNECT_TIMEOUT_MS = 2000,
    ASSUMED_PAGE_TOKENS = 32, /* a replica's P before its first snapshot tells (kvserve's default) */
    URL_CHARS = 8192,
};

struct header {
    char *name, *value;
};

struct forward {
    struct route *rt;
    int replica;
    long pages;               /* the prompt's, counted in the replica's load */
    CURL *curl;
    struct curl_slist *req_headers;
    char *body;
    size_t body_len;
    pthread_t thread;

    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool answered;            /* the status and headers are known (first body bytes, or the end) */
    bool done, cancelled;
    CURLcode rc;
    long status;
    struct header headers[MAX_HEADERS];
    int n_headers;
    char *buf;                /* [off, len) not yet sent */
    size_t off, len, cap;
};

/* ---- choosing the replica ----------------------------------------------------------- */

struct prompt_keys {
    int32_t *ids;
    size_t n_ids;
    struct kv_key salt;
    bool read;                /* the router read the prompt */
};

double route_replica_cost(int32_t pages, int32_t overlap, int32_t held, double load, double load_weight,
                          double shared_page_cost)
{
    return (double)(pages - held) + shared_page_cost * (double)(held - overlap) + load_weight * load;
}

/* Each replica's pages of the prompt (the layout it announced) and the
 * leading ones it holds; the most any replica holds. */
static int32_t prompt_overlaps(struct route *rt, const struct prompt_keys *pk, int32_t *pages, int32_t *overlap)
{
    struct kv_key_layout lay, last = {0};
    struct kv_key *keys = NULL;
    int32_t n_pages = 0, held = 0;
    for (int r = 0; r < rt->n_rep; r++) {
        pages[r] = pk->read ? (int32_t)(pk->n_ids / ASSUMED_PAGE_TOKENS) : 0;
        overlap[r] = 0;
        if (!pk->read || !route_index_layout(rt->index, r, &lay))
            continue;
        if (!keys || lay.n_bytes != last.n_bytes || memcmp(&lay, &last, sizeof lay)) {
            free(keys);
            n_pages = (int32_t)(pk->n_ids / (size_t)lay.page_tokens);
            keys = malloc(((size_t)n_pages + 1) * sizeof *keys);
            if (keys)
                kv_layout_keys(&lay, pk->salt, pk->ids, (int32_t)pk->n_ids, keys);
            last = lay;
        }
        pages[r] = n_pages;
        overlap[r] = keys ? route_index_overlap(rt->index, r, keys, n_pages) : 0;
        if (overlap[r] > held)
            held = overlap[r];
    }
    free(keys);
    return held;
}

/* The least-cost healthy replica not in tried (a bit each), -1 if none;
 * *overlap_out: the pages of the prompt it holds. */
static int choose(struct route *rt, const struct prompt_keys *pk, uint64_t tried, int32_t *overlap_out, long *pages_out)
{
    int32_t pages[ROUTE_MAX_REPLICAS], overlap[ROUTE_MAX_REPLICAS];
    const int32_t held = prompt_overlaps(rt, pk, pages, overlap);
    int best = -1;
    double best_cost = 0;
    unsigned turn = atomic_fetch_add(&rt->turn, 1);
    *overlap_out = 0;
    *pages_out = 0;
    for (int pass = 0; pass < 2 && best < 0; pass++) /* the second pass: every replica, healthy or not */
        for (int i = 0; i < rt->n_rep; i++) {
            int r = (int)((turn + (unsigned)i) % (unsigned)rt->n_rep);
            struct route_replica *rep = &rt->rep[r];
            if ((tried >> r) & 1 || (pass == 0 && !atomic_load(&rep->healthy)))
                continue;
            double load = (double)atomic_load(&rep->active_pages) + atomic_load(&rep->in_flight);
            double cost = route_replica_cost(pages[r], overlap[r], held < pages[r] ? held : pages[r], load,
                                             rt->cfg.load_weight, rt->cfg.shared_page_cost);
            if (best < 0 || cost < best_cost) {
                best = r;
                best_cost = cost;
                *overlap_out = overlap[r];
                *pages_out = pages[r];
            }
        }
    return best;
}

/* ---- the replica's side (the forward's thread) ------------------------------------------- */

static size_t on_header(char *p, size_t size, size_t n, void *user)
{
    struct forward *f = user;
    size_t len = size * n;
    if (len >= 5 && !memcmp(p, "HTTP/", 5)) { /* a new response (after a 100 Continue): its headers only */
        for (int i = 0; i < f->n_headers; i++) {
            free(f->headers[i].name);
            free(f->headers[i].value);
        }
        f->n_headers = 0;
        return len;
    }
    const char *colon = memchr(p, ':', len);
    if (!colon || f->n_headers == MAX_HEADERS)
        return len;
    size_t nl = (size_t)(colon - p);
    const char *v = colon + 1, *end = p + len;
    while (v < end && (*v == ' ' || *v == '\t'))
        v++;
    while (end > v && (end[-1] == '\r' || end[-1] == '\n' || end[-1] == ' '))
        end--;
    static const char *const hop[] = {"connection", "transfer-encoding", "content-length", "keep-alive", "date",
                                      "upgrade", "trailer"};
    for (size_t i = 0; i < sizeof hop / sizeof hop[0]; i++)
        if (nl == strlen(hop[i]) && !strncasecmp(p, hop[i], nl))
            return len;
    struct header h = {strndup(p, nl), strndup(v, (size_t)(end - v))};
    if (!h.name || !h.value) {
        free(h.name);
        free(h.value);
        return len;
    }
    f->headers[f->n_headers++] = h;
    return len;
}

static size_t on_body(char *p, size_t size, size_t n, void *user)
{
    struct forward *f = user;
    size_t len = size * n;
    pthread_mutex_lock(&f->mu);
    if (!f->answered) {
        curl_easy_getinfo(f->curl, CURLINFO_RESPONSE_CODE, &f->status);
        f->answered = true;
        pthread_cond_broadcast(&f->cv);
    }
    while (f->len - f->off > MAX_BUFFERED && !f->cancelled)
        pthread_cond_wait(&f->cv, &f->mu);
    if (f->cancelled) {
        pthread_mutex_unlock(&f->mu);
        return 0; /* the client left: abort */
    }
    if (f->len + len > f->cap) {
        size_t cap = (f->len + len) * 2;
        char *grown = realloc(f->buf, cap);
        if (!grown) {
            pthread_mutex_unlock(&f->mu);
            return 0;
        }
        f->buf = grown;
        f->cap = cap;
    }
    memcpy(f->buf + f->len, p, len);
    f->len += len;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
    return len;
}

/* A client that left ends the replica's request too (it stops generating), even before its first byte. */
static int on_progress(void *user, curl_off_t dl_total, curl_off_t dl_now, curl_off_t ul_total, curl_off_t ul_now)
{
    (void)dl_total;
    (void)dl_now;
    (void)ul_total;
    (void)ul_now;
    struct forward *f = user;
    pthread_mutex_lock(&f->mu);
    bool cancelled = f->cancelled;
    pthread_mutex_unlock(&f->mu);
    return cancelled;
}

static void *forward_main(void *arg)
{
    struct forward *f = arg;
    CURLcode rc = curl_easy_perform(f->curl);
    long status = 0;
    curl_easy_getinfo(f->curl, CURLINFO_RESPONSE_CODE, &status);
    struct route_replica *rep = &f->rt->rep[f->replica];
    atomic_fetch_sub(&rep->in_flight, 1);
    atomic_fetch_sub(&rep->active_pages, f->pages);
    pthread_mutex_lock(&f->mu);
    f->rc = rc;
    if (!f->answered)
        f->status = status;
    f->answered = f->done = true;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
    return NULL;
}

static void forward_free(struct forward *f)
{
    curl_easy_cleanup(f->curl);
    curl_slist_free_all(f->req_headers);
    free(f->body);
    for (int i = 0; i < f->n_headers; i++) {
        free(f->headers[i].name);
        free(f->headers[i].value);
    }
    free(f->buf);
    pthread_cond_destroy(&f->cv);
    pthread_mutex_destroy(&f->mu);
    free(f);
}

/* Cancel (if still running), wait for the thread, free. */
static void forward_end(struct forward *f)
{
    pthread_mutex_lock(&f->mu);
    f->cancelled = true;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
    pthread_join(f->thread, NULL);
    forward_free(f);
}

/* ---- the client's side ----------------------------------------------------------------- */

static enum MHD_Result copy_header(void *cls, enum MHD_ValueKind kind, const char *name, const char *value)
{
    (void)kind;
    struct curl_slist **list = cls;
    static const char *const skip[] = {"host", "content-length", "connection", "transfer-encoding", "expect",
                                       "keep-alive", "upgrade", "te", "trailer", "proxy-connection"};
    for (size_t i = 0; i < sizeof skip / sizeof skip[0]; i++)
        if (!strcasecmp(name, skip[i]))
            return MHD_YES;
    size_t n = strlen(name) + strlen(value) + 3;
    char *line = malloc(n);
    if (!line)
        return MHD_NO;
    snprintf(line, n, "%s: %s", name, value);
    struct curl_slist *grown = curl_slist_append(*list, line);
    free(line);
    if (grown)
        *list = grown;
    return MHD_YES;
}

/* Start forwarding to replica r; NULL when out of memory. */
static struct forward *forward_start(struct route *rt, struct MHD_Connection *c, int r, long pages, const char *method,
                                     const char *uri, char *body, size_t len)
{
    struct forward *f = calloc(1, sizeof *f);
    if (!f)
        return NULL;
    f->rt = rt;
    f->replica = r;
    f->pages = pages;
    /* its own copy: curl may still read it after another attempt or the connection let go of the request's */
    if (len && !(f->body = malloc(len))) {
        free(f);
        return NULL;
    }
    if (len)
        memcpy(f->body, body, len);
    f->body_len = len;
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);
    char url[URL_CHARS];
    snprintf(url, sizeof url, "%s%s", rt->rep[r].url, uri);
    MHD_get_connection_values(c, MHD_HEADER_KIND, copy_header, &f->req_headers);
    struct curl_slist *grown = curl_slist_append(f->req_headers, "Expect:");
    f->req_headers = grown ? grown : f->req_headers;
    if (!(f->curl = curl_easy_init())) {
        forward_free(f);
        return NULL;
    }
    CURL *h = f->curl;
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, (long)CONNECT_TIMEOUT_MS);
    curl_easy_setopt(h, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, f->req_headers);
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, f);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, f);
    curl_easy_setopt(h, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(h, CURLOPT_XFERINFOFUNCTION, on_progress);
    curl_easy_setopt(h, CURLOPT_XFERINFODATA, f);
    if (!strcmp(method, "HEAD")) {
        curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
    } else if (strcmp(method, "GET") || len) {
        curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)len);
        curl_easy_setopt(h, CURLOPT_POSTFIELDS, f->body ? f->body : "");
        curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, method);
    }
    struct route_replica *rep = &rt->rep[r];
    atomic_fetch_add(&rep->in_flight, 1);
    atomic_fetch_add(&rep->active_pages, pages);
    atomic_fetch_add(&rep->forwarded, 1);
    if (pthread_create(&f->thread, NULL, forward_main, f) != 0) {
        atomic_fetch_sub(&rep->in_flight, 1);
        atomic_fetch_sub(&rep->active_pages, pages);
        forward_free(f);
        return NULL;
    }
    return f;
}

static ssize_t read_body(void *cls, uint64_t pos, char *out, size_t max)
{
    (void)pos;
    struct forward *f = cls;
    pthread_mutex_lock(&f->mu);
    while (f->off == f->len && !f->done)
        pthread_cond_wait(&f->cv, &f->mu);
    ssize_t n;
    if (f->off < f->len) {
        size_t k = f->len - f->off < max ? f->len - f->off : max;
        memcpy(out, f->buf + f->off, k);
        f->off += k;
        if (f->off == f->len)
            f->off = f->len = 0;
        pthread_cond_broadcast(&f->cv);
        n = (ssize_t)k;
    } else {
        n = f->rc == CURLE_OK ? MHD_CONTENT_READER_END_OF_STREAM : MHD_CONTENT_READER_END_WITH_ERROR;
    }
    pthread_mutex_unlock(&f->mu);
    return n;
}

static void free_body(void *cls) { forward_end(cls); }

/* The replica's answer to the client, streamed. */
static int relay(struct route *rt, struct MHD_Connection *c, struct forward *f, int32_t overlap)
{
    struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 << 10, read_body, f, free_body);
    if (!resp) {
        forward_end(f);
        return route_answer_json(c, 500, "{\"error\":{\"message\":\"router: out of memory\",\"type\":\"server_error\","
                                   "\"code\":\"out_of_memory\"}}");
    }
    for (int i = 0; i < f->n_headers; i++)
        MHD_add_response_header(resp, f->headers[i].name, f->headers[i].value);
    char route_hdr[1200];
    snprintf(route_hdr, sizeof route_hdr, "%s; overlap=%d", rt->rep[f->replica].url, (int)overlap);
    MHD_add_response_header(resp, "X-Kvserve-Route", route_hdr);
    int ret = MHD_queue_response(c, (unsigned)f->status, resp);
    MHD_destroy_response(resp);
    return ret;
}

int route_forward(struct route *rt, struct MHD_Connection *c, const char *method, const char *uri, char *body,
                  size_t len)
{
    struct prompt_keys pk = {0};
    atomic_fetch_add(&rt->requests, 1);
    if (!strcmp(method, "POST") && body && rt->cfg.prompt) {
        const char *path = uri;
        pk.read = !route_prompt_tokens(rt->cfg.prompt, path, body, len, &pk.ids, &pk.n_ids, &pk.salt);
        if (!pk.read)
            atomic_fetch_add(&rt->unread, 1);
        const char *auth = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
        if (rt->cfg.salt_from_key && auth && !strncmp(auth, "Bearer ", 7) && auth[7]) /* as the replica reads it */
            pk.salt = kv_tenant_salt(rt->cfg.tenant_key, auth + 7, strlen(auth + 7), pk.salt);
    }
    uint64_t tried = 0;
    int ret = -1;
    for (int attempt = 0; attempt < rt->n_rep && ret < 0; attempt++) {
        int32_t overlap = 0;
        long pages = 0;
        int r = choose(rt, &pk, tried, &overlap, &pages);
        if (r < 0)
            break;
        tried |= 1ull << r;
        struct forward *f = forward_start(rt, c, r, pages, method, uri, body, len);
        if (!f)
            break;
        pthread_mutex_lock(&f->mu);
        while (!f->answered)
            pthread_cond_wait(&f->cv, &f->mu);
        bool no_answer = f->done && f->status == 0;
        pthread_mutex_unlock(&f->mu);
        if (no_answer) { /* refused or unreachable: it is down; the next best one takes the request */
            if (atomic_exchange(&rt->rep[r].healthy, false))
                fprintf(stderr, "kvserve route: %s is down (%s); sending its requests elsewhere\n", rt->rep[r].url,
                        curl_easy_strerror(f->rc));
            forward_end(f);
            continue;
        }
        if (overlap > 0) {
            atomic_fetch_add(&rt->by_overlap, 1);
            atomic_fetch_add(&rt->overlap_pages, (unsigned long)overlap);
        }
        ret = relay(rt, c, f, overlap);
    }
    free(pk.ids);
    if (ret < 0) {
        atomic_fetch_add(&rt->no_replica, 1);
        ret = route_answer_json(c, 502, "{\"error\":{\"message\":\"router: no replica answered\",\"type\":"
                                  "\"unavailable_error\",\"code\":\"no_replica\"}}");
    }
    return ret;
}
