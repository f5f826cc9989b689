/* httpc_multi: streaming requests on one curl multi handle, driven by the caller's
 * loop of httpc_multi_step(). Each step is one pass: wait for any socket, then
 * curl_multi_perform reads every ready stream. curl calls the write callback once
 * per decoded HTTP chunk, several times for one recv(); the pass counter folds all
 * the calls of one stream in one pass into one read with one time stamp. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "httpc/httpc_internal.h"

struct httpc_stream {
    struct httpc_multi *m;
    struct httpc_stream *prev, *next; /* in m->streams */
    CURL *e;
    struct curl_slist *hdrs;
    struct httpc_sse *sse;
    struct httpc_stream_cb cb;
    uint64_t pass;                    /* the pass of the last read */
    struct httpc_read rd;             /* the current read */
    long status;                      /* HTTP status, once the body begins */
    char err_body[160];               /* the start of a non-2xx body */
    size_t err_len;
    ks_status st;                     /* a failure inside a callback, */
    char why[512];                    /* and its message */
    char curl_err[CURL_ERROR_SIZE];
};

struct httpc_multi {
    CURLM *cm;
    struct httpc_stream *streams;
    int running;
    uint64_t pass;
};

static bool is_2xx(long status) { return status >= 200 && status <= 299; }

ks_status httpc_multi_create(struct httpc_multi **out)
{
    *out = NULL;
    ks_status st = httpc_global_init();
    if (st)
        return st;
    struct httpc_multi *m = calloc(1, sizeof *m);
    if (!m)
        return ks_fail(KS_ERR_NOMEM, "httpc_multi_create: out of memory");
    m->cm = curl_multi_init();
    if (!m->cm) {
        free(m);
        return ks_fail(KS_ERR_INTERNAL, "httpc_multi_create: curl_multi_init failed");
    }
    *out = m;
    return KS_OK;
}

static void stream_free(struct httpc_stream *s)
{
    if (s->e) {
        curl_multi_remove_handle(s->m->cm, s->e);
        curl_easy_cleanup(s->e);
    }
    curl_slist_free_all(s->hdrs);
    httpc_sse_free(s->sse);
    free(s);
}

void httpc_multi_free(struct httpc_multi *m)
{
    if (!m)
        return;
    while (m->streams) {
        struct httpc_stream *s = m->streams;
        m->streams = s->next;
        stream_free(s);
    }
    curl_multi_cleanup(m->cm);
    free(m);
}

int httpc_multi_running(const struct httpc_multi *m) { return m->running; }

static ks_status on_sse(void *user, const char *data, size_t len)
{
    struct httpc_stream *s = user;
    return s->cb.on_event(s->cb.user, data, len, &s->rd);
}

static size_t on_bytes(char *p, size_t size, size_t n, void *user)
{
    struct httpc_stream *s = user;
    n *= size;
    if (s->pass != s->m->pass) { /* the first bytes of this pass: a new read */
        s->pass = s->m->pass;
        s->rd.t = httpc_now();
        s->rd.id++;
    }
    if (!s->status)
        curl_easy_getinfo(s->e, CURLINFO_RESPONSE_CODE, &s->status);
    if (!is_2xx(s->status)) { /* an error body: keep its start for the message */
        size_t k = n < sizeof s->err_body - 1 - s->err_len ? n : sizeof s->err_body - 1 - s->err_len;
        memcpy(s->err_body + s->err_len, p, k);
        s->err_len += k;
        s->err_body[s->err_len] = '\0';
        return n;
    }
    ks_status st = httpc_sse_feed(s->sse, p, n);
    if (st) {
        s->st = st;
        snprintf(s->why, sizeof s->why, "%s", ks_errmsg());
        return 0; /* curl aborts the transfer */
    }
    return n;
}

static int on_prereq(void *user, char *primary_ip, char *local_ip, int primary_port, int local_port)
{
    (void)primary_ip, (void)local_ip, (void)primary_port, (void)local_port;
    struct httpc_stream *s = user;
    s->cb.on_sent(s->cb.user);
    return CURL_PREREQFUNC_OK;
}

ks_status httpc_multi_start(struct httpc_multi *m, const struct httpc_request *rq, size_t max_event,
                            const struct httpc_stream_cb *cb)
{
    if (!cb->on_event || !cb->on_done || max_event == 0)
        return ks_fail(KS_ERR_INVALID_ARG, "httpc_multi_start: on_event, on_done and max_event >= 1 are required");
    struct httpc_stream *s = calloc(1, sizeof *s);
    if (!s)
        return ks_fail(KS_ERR_NOMEM, "httpc_multi_start: out of memory");
    s->m = m;
    s->cb = *cb;
    ks_status st = httpc_sse_create(max_event, on_sse, s, &s->sse);
    if (!st && !(s->e = curl_easy_init()))
        st = ks_fail(KS_ERR_NOMEM, "httpc_multi_start: curl_easy_init failed");
    if (!st)
        st = httpc_easy_setup(s->e, rq, &s->hdrs);
    if (!st && (curl_easy_setopt(s->e, CURLOPT_WRITEFUNCTION, on_bytes) ||
                curl_easy_setopt(s->e, CURLOPT_WRITEDATA, s) || curl_easy_setopt(s->e, CURLOPT_PRIVATE, s) ||
                curl_easy_setopt(s->e, CURLOPT_ERRORBUFFER, s->curl_err) ||
                (cb->on_sent && (curl_easy_setopt(s->e, CURLOPT_PREREQFUNCTION, on_prereq) ||
                                 curl_easy_setopt(s->e, CURLOPT_PREREQDATA, s)))))
        st = ks_fail(KS_ERR_INTERNAL, "httpc_multi_start: setting up the callbacks of %s failed", rq->url);
    if (!st && curl_multi_add_handle(m->cm, s->e) != CURLM_OK)
        st = ks_fail(KS_ERR_INTERNAL, "httpc_multi_start: curl_multi_add_handle failed for %s", rq->url);
    if (st) {
        curl_easy_cleanup(s->e);
        s->e = NULL;
        stream_free(s);
        return st;
    }
    s->next = m->streams;
    if (m->streams)
        m->streams->prev = s;
    m->streams = s;
    m->running++;
    return KS_OK;
}

/* A request curl finished (rc): settle its outcome, free it, then tell the caller. */
static void finish(struct httpc_stream *s, CURLcode rc)
{
    struct httpc_multi *m = s->m;
    curl_easy_getinfo(s->e, CURLINFO_RESPONSE_CODE, &s->status);
    const char *url = NULL;
    curl_easy_getinfo(s->e, CURLINFO_EFFECTIVE_URL, &url);
    ks_status st = s->st;
    char why[sizeof s->why + 64] = "";
    if (!st && rc == CURLE_OK && is_2xx(s->status) && (st = httpc_sse_end(s->sse)))
        snprintf(s->why, sizeof s->why, "%s", ks_errmsg());
    if (st)
        snprintf(why, sizeof why, "%s", s->why);
    else if (rc != CURLE_OK)
        st = KS_ERR_IO, snprintf(why, sizeof why, "%s: %s", url ? url : "?",
                                 *s->curl_err ? s->curl_err : curl_easy_strerror(rc));
    else if (!is_2xx(s->status))
        snprintf(why, sizeof why, "HTTP %ld from %s: %s", s->status, url ? url : "?", s->err_body);
    long status = s->status;
    bool done = httpc_sse_done(s->sse);
    struct httpc_stream_cb cb = s->cb;
    if (s->prev)
        s->prev->next = s->next;
    else
        m->streams = s->next;
    if (s->next)
        s->next->prev = s->prev;
    m->running--;
    stream_free(s);
    if (st)
        ks_fail(st, "%s", why);
    cb.on_done(cb.user, st, status, done, why);
}

ks_status httpc_multi_step(struct httpc_multi *m, double max_wait)
{
    int ms = !(max_wait > 0) ? 0 : max_wait > 3600 ? 3600 * 1000 : (int)ceil(max_wait * 1e3);
    CURLMcode mc = curl_multi_poll(m->cm, NULL, 0, ms, NULL);
    if (mc == CURLM_OK) {
        m->pass++;
        int still;
        mc = curl_multi_perform(m->cm, &still);
    }
    if (mc != CURLM_OK)
        return ks_fail(KS_ERR_INTERNAL, "httpc_multi_step: %s", curl_multi_strerror(mc));
    CURLMsg *msg;
    int left;
    while ((msg = curl_multi_info_read(m->cm, &left))) {
        if (msg->msg != CURLMSG_DONE)
            continue;
        CURLcode rc = msg->data.result;
        struct httpc_stream *s = NULL;
        curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **)&s);
        finish(s, rc);
    }
    return KS_OK;
}
