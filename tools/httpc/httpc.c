/* httpc: curl's global state, the request setup both halves share, and one
 * blocking request with its whole response in memory. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "httpc/httpc_internal.h"

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static CURLcode init_rc;

static void global_init(void) { init_rc = curl_global_init(CURL_GLOBAL_DEFAULT); }

ks_status httpc_global_init(void)
{
    pthread_once(&init_once, global_init);
    if (init_rc != CURLE_OK)
        return ks_fail(KS_ERR_INTERNAL, "curl_global_init: %s", curl_easy_strerror(init_rc));
    return KS_OK;
}

double httpc_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static bool has_header(const char *const *h, const char *name)
{
    size_t n = strlen(name);
    for (; h && *h; h++)
        if (!strncasecmp(*h, name, n) && (*h)[n] == ':')
            return true;
    return false;
}

static ks_status append(struct curl_slist **l, const char *line)
{
    struct curl_slist *n = curl_slist_append(*l, line);
    if (!n)
        return ks_fail(KS_ERR_NOMEM, "httpc: out of memory for the header '%s'", line);
    *l = n;
    return KS_OK;
}

ks_status httpc_easy_setup(CURL *e, const struct httpc_request *rq, struct curl_slist **hdrs)
{
    *hdrs = NULL;
    if (!rq->url || !*rq->url)
        return ks_fail(KS_ERR_INVALID_ARG, "httpc: a request needs a url");
    ks_status st = KS_OK;
    for (const char *const *h = rq->headers; h && *h && !st; h++)
        st = append(hdrs, *h);
    if (!st && !has_header(rq->headers, "Connection"))
        st = append(hdrs, "Connection: close");
    if (!st && rq->body && !has_header(rq->headers, "Content-Type"))
        st = append(hdrs, "Content-Type: application/json");
    if (!st && rq->body && !has_header(rq->headers, "Expect")) /* curl would hold bodies over 1 KiB back */
        st = append(hdrs, "Expect:");
    if (st)
        return st;
    const char *method = rq->method ? rq->method : rq->body ? "POST" : "GET";
    CURLcode rc = CURLE_OK;
#define SET(opt, val)                                                                                    \
    do {                                                                                                 \
        if (rc == CURLE_OK)                                                                              \
            rc = curl_easy_setopt(e, opt, val);                                                          \
    } while (0)
    SET(CURLOPT_URL, rq->url);
    SET(CURLOPT_NOSIGNAL, 1L);
    SET(CURLOPT_FORBID_REUSE, 1L);
    SET(CURLOPT_HTTPHEADER, *hdrs);
    if (rq->timeout_s > 0)
        SET(CURLOPT_TIMEOUT_MS, (long)(rq->timeout_s * 1000));
    if (rq->body) {
        SET(CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)rq->body_len);
        SET(CURLOPT_COPYPOSTFIELDS, rq->body);
        if (strcmp(method, "POST"))
            SET(CURLOPT_CUSTOMREQUEST, method);
    } else if (!strcmp(method, "HEAD")) {
        SET(CURLOPT_NOBODY, 1L);
    } else if (strcmp(method, "GET")) {
        SET(CURLOPT_CUSTOMREQUEST, method);
    }
#undef SET
    if (rc != CURLE_OK)
        return ks_fail(rc == CURLE_OUT_OF_MEMORY ? KS_ERR_NOMEM : KS_ERR_INTERNAL, "httpc: setting up %s %s: %s",
                       method, rq->url, curl_easy_strerror(rc));
    return KS_OK;
}

/* ---- one request ------------------------------------------------------------------------ */

struct collect {
    struct httpc_response *r;
    size_t cap, headers_cap;
    ks_status st; /* a failure inside a callback */
};

static size_t on_body(char *p, size_t size, size_t n, void *user)
{
    struct collect *c = user;
    struct httpc_response *r = c->r;
    n *= size;
    if (r->len + n > HTTPC_MAX_BODY) {
        c->st = ks_fail(KS_ERR_RANGE, "response body over %zu bytes", HTTPC_MAX_BODY);
        return 0;
    }
    if (r->len + n + 1 > c->cap) {
        size_t cap = c->cap ? c->cap : 4096;
        while (cap < r->len + n + 1)
            cap *= 2;
        char *b = realloc(r->body, cap);
        if (!b) {
            c->st = ks_fail(KS_ERR_NOMEM, "out of memory for a %zu-byte response body", r->len + n);
            return 0;
        }
        r->body = b;
        c->cap = cap;
    }
    memcpy(r->body + r->len, p, n);
    r->len += n;
    r->body[r->len] = '\0';
    return n;
}

static void free_headers(struct httpc_response *r)
{
    for (size_t i = 0; i < r->n_headers; i++) {
        free(r->headers[i].name);
        free(r->headers[i].value);
    }
    r->n_headers = 0;
}

/* One header line as curl gives it ("Name: value\r\n"); a status line starts the
 * headers of a new response (after a 100 Continue), so it drops the ones before. */
static size_t on_header(char *p, size_t size, size_t n, void *user)
{
    struct collect *c = user;
    struct httpc_response *r = c->r;
    size_t len = n * size;
    if (len >= 5 && !memcmp(p, "HTTP/", 5)) {
        free_headers(r);
        return n * size;
    }
    const char *colon = memchr(p, ':', len);
    if (!colon)
        return n * size; /* the blank line, or a malformed line */
    const char *v = colon + 1, *end = p + len;
    while (v < end && (*v == ' ' || *v == '\t'))
        v++;
    while (end > v && (end[-1] == '\r' || end[-1] == '\n' || end[-1] == ' ' || end[-1] == '\t'))
        end--;
    if (r->n_headers == c->headers_cap) {
        size_t cap = c->headers_cap ? 2 * c->headers_cap : 16;
        struct httpc_header *h = realloc(r->headers, cap * sizeof *h);
        if (!h)
            goto nomem;
        r->headers = h;
        c->headers_cap = cap;
    }
    char *name = strndup(p, (size_t)(colon - p)), *value = strndup(v, (size_t)(end - v));
    if (!name || !value) {
        free(name);
        free(value);
        goto nomem;
    }
    r->headers[r->n_headers++] = (struct httpc_header){name, value};
    return n * size;
nomem:
    c->st = ks_fail(KS_ERR_NOMEM, "out of memory for the response headers");
    return 0;
}

ks_status httpc_request(const struct httpc_request *rq, struct httpc_response *out)
{
    memset(out, 0, sizeof *out);
    ks_status st = httpc_global_init();
    if (st)
        return st;
    CURL *e = curl_easy_init();
    if (!e)
        return ks_fail(KS_ERR_NOMEM, "httpc: curl_easy_init failed");
    struct curl_slist *hdrs = NULL;
    struct collect c = {.r = out};
    char err[CURL_ERROR_SIZE] = "";
    st = httpc_easy_setup(e, rq, &hdrs);
    if (!st && (curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_body) || curl_easy_setopt(e, CURLOPT_WRITEDATA, &c) ||
                curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, on_header) ||
                curl_easy_setopt(e, CURLOPT_HEADERDATA, &c) || curl_easy_setopt(e, CURLOPT_ERRORBUFFER, err)))
        st = ks_fail(KS_ERR_INTERNAL, "httpc: setting up the callbacks of %s failed", rq->url);
    if (!st) {
        CURLcode rc = curl_easy_perform(e);
        curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &out->status);
        if (c.st)
            st = c.st;
        else if (rc != CURLE_OK)
            st = ks_fail(KS_ERR_IO, "%s %s: %s", rq->method ? rq->method : rq->body ? "POST" : "GET", rq->url,
                         *err ? err : curl_easy_strerror(rc));
        if (!st && !out->body && !(out->body = calloc(1, 1))) /* an empty body is "" too */
            st = ks_fail(KS_ERR_NOMEM, "httpc: out of memory");
    }
    curl_easy_cleanup(e);
    curl_slist_free_all(hdrs);
    if (st)
        httpc_response_free(out);
    return st;
}

const char *httpc_response_header(const struct httpc_response *r, const char *name)
{
    for (size_t i = 0; i < r->n_headers; i++)
        if (!strcasecmp(r->headers[i].name, name))
            return r->headers[i].value;
    return NULL;
}

void httpc_response_free(struct httpc_response *r)
{
    free_headers(r);
    free(r->headers);
    free(r->body);
    memset(r, 0, sizeof *r);
}
