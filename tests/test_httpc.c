/* tools/httpc against a scripted server on a loopback socket: the request it
 * sends, the response it parses, and the timing contract of httpc_multi (the
 * events that arrive together are one read with one stamp, whatever HTTP
 * chunks carry them; a later write is a later read). Errors: connection
 * refused, an HTTP error, an oversized event. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "httpc/httpc.h"

/* ---- a server that answers one connection with a script ------------------------------------- */

static atomic_int events_taken; /* by the stream test's on_event */

/* Wait (10 s at most) until the client has taken n events. */
static void wait_for_events(int n)
{
    for (int ms = 0; atomic_load(&events_taken) < n && ms < 10000; ms++)
        usleep(1000);
}

struct script_server {
    int listen_fd, port;
    pthread_t thread;
    const char *const *parts; /* written one write() each, NULL-terminated */
    int pause_ms;             /* between two parts */
    const int *wait_events;   /* optional: before part i, wait until the client has taken
                                 wait_events[i] events (so part i cannot join an earlier read) */
    char request[16384];      /* what the client sent: head and body */
    size_t request_len;
};

static void *serve_one(void *arg)
{
    struct script_server *s = arg;
    int fd = accept(s->listen_fd, NULL, NULL);
    if (fd < 0)
        return NULL;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    /* the head, then Content-Length bytes of body */
    size_t want = SIZE_MAX;
    while (s->request_len < want && s->request_len < sizeof s->request - 1) {
        ssize_t k = recv(fd, s->request + s->request_len, sizeof s->request - 1 - s->request_len, 0);
        if (k <= 0)
            break;
        s->request_len += (size_t)k;
        s->request[s->request_len] = '\0';
        const char *end = strstr(s->request, "\r\n\r\n");
        if (end && want == SIZE_MAX) {
            const char *cl = strcasestr(s->request, "\r\nContent-Length:");
            want = (size_t)(end + 4 - s->request) + (cl && cl < end ? strtoul(cl + 17, NULL, 10) : 0);
        }
    }
    for (int i = 0; s->parts[i]; i++) {
        if (i > 0 && s->wait_events)
            wait_for_events(s->wait_events[i]);
        if (i > 0)
            usleep((useconds_t)s->pause_ms * 1000);
        if (send(fd, s->parts[i], strlen(s->parts[i]), MSG_NOSIGNAL) < 0)
            break;
    }
    close(fd);
    return NULL;
}

static void server_start_gated(struct script_server *s, const char *const *parts, int pause_ms,
                               const int *wait_events)
{
    memset(s, 0, sizeof *s);
    s->parts = parts;
    s->pause_ms = pause_ms;
    s->wait_events = wait_events;
    s->listen_fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(s->listen_fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(s->listen_fd, 4), 0);
    socklen_t len = sizeof a;
    getsockname(s->listen_fd, (struct sockaddr *)&a, &len);
    s->port = ntohs(a.sin_port);
    assert_int_equal(pthread_create(&s->thread, NULL, serve_one, s), 0);
}

static void server_start(struct script_server *s, const char *const *parts, int pause_ms)
{
    server_start_gated(s, parts, pause_ms, NULL);
}

static void server_join(struct script_server *s)
{
    pthread_join(s->thread, NULL);
    close(s->listen_fd);
}

/* A port nothing listens on. */
static int closed_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    bind(fd, (struct sockaddr *)&a, sizeof a);
    socklen_t len = sizeof a;
    getsockname(fd, (struct sockaddr *)&a, &len);
    close(fd);
    return ntohs(a.sin_port);
}

/* ---- one request ----------------------------------------------------------------------------- */

static void request_and_response(void **state)
{
    (void)state;
    static const char *const parts[] = {
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nretry-after:   1  \r\n"
        "Transfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n",
        "3\r\n 1}\r\n0\r\n\r\n", NULL};
    struct script_server srv;
    server_start(&srv, parts, 20);
    char url[64];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/v1/x?y=1", srv.port);
    const char *headers[] = {"Authorization: Bearer k", NULL};
    struct httpc_request rq = {.url = url, .headers = headers, .body = "{\"p\":[1,2]}", .body_len = 11};
    struct httpc_response r;
    assert_int_equal(httpc_request(&rq, &r), KS_OK);
    server_join(&srv);
    /* what went out: a POST of the body as JSON in one piece, the caller's header */
    assert_non_null(strstr(srv.request, "POST /v1/x?y=1 HTTP/1.1\r\n"));
    assert_non_null(strcasestr(srv.request, "\r\nContent-Type: application/json\r\n"));
    assert_non_null(strcasestr(srv.request, "\r\nContent-Length: 11\r\n"));
    assert_non_null(strstr(srv.request, "\r\nAuthorization: Bearer k\r\n"));
    assert_null(strcasestr(srv.request, "Expect:"));
    assert_string_equal(strstr(srv.request, "\r\n\r\n") + 4, "{\"p\":[1,2]}");
    /* what came back: any status, the body de-chunked, headers by name */
    assert_int_equal(r.status, 503);
    assert_int_equal(r.len, 8);
    assert_string_equal(r.body, "{\"a\": 1}");
    assert_string_equal(httpc_response_header(&r, "Retry-After"), "1");
    assert_string_equal(httpc_response_header(&r, "content-type"), "application/json");
    assert_null(httpc_response_header(&r, "Content-Length"));
    httpc_response_free(&r);
    httpc_response_free(&r); /* zeroed: harmless */

    /* a GET has no body; an empty response body is "" */
    static const char *const empty[] = {"HTTP/1.1 204 No Content\r\n\r\n", NULL};
    server_start(&srv, empty, 0);
    snprintf(url, sizeof url, "http://127.0.0.1:%d/health", srv.port);
    rq = (struct httpc_request){.url = url};
    assert_int_equal(httpc_request(&rq, &r), KS_OK);
    server_join(&srv);
    assert_non_null(strstr(srv.request, "GET /health HTTP/1.1\r\n"));
    assert_null(strcasestr(srv.request, "Content-Length"));
    assert_int_equal(r.status, 204);
    assert_string_equal(r.body, "");
    httpc_response_free(&r);

    snprintf(url, sizeof url, "http://127.0.0.1:%d/", closed_port());
    assert_int_equal(httpc_request(&rq, &r), KS_ERR_IO);
    assert_non_null(strstr(ks_errmsg(), url));
    assert_null(r.body);
    rq.url = NULL;
    assert_int_equal(httpc_request(&rq, &r), KS_ERR_INVALID_ARG);
}

/* ---- streams ------------------------------------------------------------------------------------ */

struct got {
    int sent, n;
    double t_sent;
    char data[8][64];
    struct httpc_read rd[8];
    bool finished, done;
    ks_status st;
    long status;
    char why[512];
};

static void on_sent(void *user)
{
    struct got *g = user;
    g->sent++;
    g->t_sent = httpc_now();
}

static ks_status on_event(void *user, const char *data, size_t len, const struct httpc_read *rd)
{
    struct got *g = user;
    assert_true(g->n < 8 && len < 64);
    memcpy(g->data[g->n], data, len + 1);
    g->rd[g->n++] = *rd;
    atomic_fetch_add(&events_taken, 1);
    return KS_OK;
}

static void on_done(void *user, ks_status st, long status, bool done, const char *why)
{
    struct got *g = user;
    g->finished = true;
    g->st = st;
    g->status = status;
    g->done = done;
    snprintf(g->why, sizeof g->why, "%s", why);
}

/* Run one streaming request to the end. */
static void stream(int port, size_t max_event, struct got *g)
{
    memset(g, 0, sizeof *g);
    atomic_store(&events_taken, 0);
    struct httpc_multi *m;
    assert_int_equal(httpc_multi_create(&m), KS_OK);
    char url[64];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/v1/completions", port);
    struct httpc_request rq = {.url = url, .body = "{}", .body_len = 2};
    struct httpc_stream_cb cb = {.on_sent = on_sent, .on_event = on_event, .on_done = on_done, .user = g};
    assert_int_equal(httpc_multi_start(m, &rq, max_event, &cb), KS_OK);
    assert_int_equal(httpc_multi_running(m), 1);
    while (httpc_multi_running(m) > 0)
        assert_int_equal(httpc_multi_step(m, 1.0), KS_OK);
    assert_true(g->finished);
    httpc_multi_free(m);
}

#define SSE_HEAD "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"

static void events_that_arrive_together_are_one_read(void **state)
{
    (void)state;
    /* three events in three HTTP chunks of one write (curl calls back once per chunk),
     * then after a pause the fourth and [DONE] split across chunks */
    static const char *const parts[] = {
        SSE_HEAD "b\r\ndata: one\n\n\r\nb\r\ndata: two\n\n\r\nd\r\ndata: three\n\n\r\n",
        "7\r\ndata: f\r\n9\r\nour\n\ndata\r\n",
        "a\r\n: [DONE]\n\n\r\n0\r\n\r\n", NULL};
    /* the second part waits until the client took the first three events, then 200 ms: it is
     * a later read whatever the machine's load, and its stamp is at least 200 ms later */
    static const int wait_events[] = {0, 3, 4};
    struct script_server srv;
    server_start_gated(&srv, parts, 200, wait_events);
    struct got g;
    stream(srv.port, 64, &g);
    server_join(&srv);
    assert_int_equal(g.st, KS_OK);
    assert_int_equal(g.status, 200);
    assert_true(g.done);
    assert_string_equal(g.why, "");
    assert_int_equal(g.sent, 1);
    assert_int_equal(g.n, 4);
    assert_string_equal(g.data[0], "one");
    assert_string_equal(g.data[1], "two");
    assert_string_equal(g.data[2], "three");
    assert_string_equal(g.data[3], "four");
    /* one read, one stamp for the first three */
    assert_true(g.rd[0].id >= 1);
    assert_true(g.rd[1].id == g.rd[0].id && g.rd[2].id == g.rd[0].id);
    assert_true(g.rd[1].t == g.rd[0].t && g.rd[2].t == g.rd[0].t);
    assert_true(g.rd[0].t >= g.t_sent);
    /* the fourth came in a later write, sent 200 ms after the third was taken */
    assert_true(g.rd[3].id > g.rd[2].id);
    assert_true(g.rd[3].t - g.rd[2].t > 0.15);
    /* the request went out as a POST */
    assert_non_null(strstr(srv.request, "POST /v1/completions HTTP/1.1\r\n"));
}

static void stream_errors(void **state)
{
    (void)state;
    struct got g;
    /* connection refused: no response, never sent */
    int port = closed_port();
    stream(port, 64, &g);
    assert_int_equal(g.st, KS_ERR_IO);
    assert_int_equal(g.status, 0);
    assert_int_equal(g.sent, 0);
    assert_non_null(strstr(g.why, "/v1/completions"));
    assert_string_equal(ks_errmsg(), g.why);

    /* an HTTP error: no events, its status and the start of its body */
    static const char *const err[] = {
        "HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: 29\r\n\r\n"
        "{\"error\":{\"message\":\"nope\"}}\n", NULL};
    struct script_server srv;
    server_start(&srv, err, 0);
    stream(srv.port, 64, &g);
    server_join(&srv);
    if (g.st)
        print_message("%s\n", g.why);
    assert_int_equal(g.st, KS_OK);
    assert_int_equal(g.status, 404);
    assert_int_equal(g.n, 0);
    assert_false(g.done);
    assert_non_null(strstr(g.why, "HTTP 404"));
    assert_non_null(strstr(g.why, "\"message\":\"nope\""));

    /* an event over the limit aborts the stream */
    static const char *const big[] = {SSE_HEAD "19\r\ndata: 0123456789abcdefg\n\n\r\n0\r\n\r\n", NULL};
    server_start(&srv, big, 0);
    stream(srv.port, 16, &g);
    server_join(&srv);
    assert_int_equal(g.st, KS_ERR_RANGE);
    assert_int_equal(g.n, 0);
    assert_non_null(strstr(g.why, "over 16 bytes"));

    /* a malformed chunk (no CRLF after its data) is an I/O error, not a hang */
    static const char *const bad[] = {SSE_HEAD "c\r\ndata: last\r\n0\r\n\r\n", NULL};
    server_start(&srv, bad, 0);
    stream(srv.port, 16, &g);
    server_join(&srv);
    assert_int_equal(g.st, KS_ERR_IO);
    assert_false(g.done);

    /* the stream ends with a last event but no blank line: still delivered */
    static const char *const cut[] = {SSE_HEAD "c\r\ndata: last\r\n\r\n0\r\n\r\n", NULL};
    server_start(&srv, cut, 0);
    stream(srv.port, 16, &g);
    server_join(&srv);
    assert_int_equal(g.st, KS_OK);
    assert_int_equal(g.n, 1);
    assert_string_equal(g.data[0], "last");
    assert_false(g.done);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(request_and_response),
        cmocka_unit_test(events_that_arrive_together_are_one_read),
        cmocka_unit_test(stream_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
