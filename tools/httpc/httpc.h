/* httpc: the HTTP client of kvserve's tests and of bench/bench_serve. It is not
 * part of the kvserve binary: the server never calls it.
 *
 * Three parts, each usable alone:
 *   1. httpc_sse_*     one incremental Server-Sent Events parser;
 *   2. httpc_request   one blocking request, the whole response in memory (libcurl easy API);
 *   3. httpc_multi_*   many streaming requests driven from one thread (libcurl multi API),
 *                      each event stamped with the read that delivered it.
 * JSON is left to the caller (cJSON).
 *
 * Contract (LMDB style, as every kvserve module): functions that can fail return
 * ks_status, 0 is success, and on failure ks_errmsg() on the calling thread says
 * what went wrong. The functions are thread-safe on distinct objects; libcurl's
 * global state is set up once, on first use, behind pthread_once. */
#ifndef KS_HTTPC_H
#define KS_HTTPC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "status/status.h"

/* ---- 1. Server-Sent Events -------------------------------------------------------------- */

/* One event's data: the `data:` lines of one event joined with "\n" (one leading space
 * after each colon dropped), NUL-terminated at data[len]; valid only during the call.
 * Return KS_OK to go on; any other status stops the parser, and httpc_sse_feed() returns it. */
typedef ks_status (*httpc_sse_fn)(void *user, const char *data, size_t len);

struct httpc_sse;

/* A parser that calls on_event for every event whose data fits in max_event bytes
 * (max_event >= 1; a line may be 6 bytes longer, for the "data: " before the data).
 * Lines end with "\n", "\r\n" or "\r" (also when the two bytes of "\r\n" arrive in
 * different calls); an empty line ends an event. Comment lines (":...") are skipped
 * without being stored, whatever their length. Fields other than `data` (event, id,
 * retry, unknown ones) are ignored; an event without a data field is not delivered.
 * The event whose data is exactly "[DONE]" (OpenAI's end of stream) is not delivered:
 * it makes httpc_sse_done() true and every later byte is ignored.
 * Errors: KS_ERR_INVALID_ARG (max_event 0), KS_ERR_NOMEM. */
ks_status httpc_sse_create(size_t max_event, httpc_sse_fn on_event, void *user, struct httpc_sse **out);

/* Feed the next n bytes of the stream, split anywhere: the events are the same for
 * every split. Calls on_event for each event these bytes complete, in order.
 * Errors: KS_ERR_RANGE when an event's data (or a line) would exceed its limit (the
 * parser never holds more than about twice max_event); whatever on_event returned. After an error the
 * parser is dead: every later call returns the same status. */
ks_status httpc_sse_feed(struct httpc_sse *p, const char *bytes, size_t n);

/* The stream ended: a last line without its line break, and a last event without
 * its blank line, are delivered (the spec drops them; a server that closes right
 * after the last "data:" line should not lose it). Same errors as httpc_sse_feed. */
ks_status httpc_sse_end(struct httpc_sse *p);

/* True once the "[DONE]" event went by. */
bool httpc_sse_done(const struct httpc_sse *p);

void httpc_sse_free(struct httpc_sse *p);

/* ---- 2. one request ---------------------------------------------------------------------- */

/* What to send. */
struct httpc_request {
    const char *method;         /* "GET", "POST", ...; NULL: POST with a body, else GET */
    const char *url;            /* "http://127.0.0.1:8080/v1/completions" */
    const char *const *headers; /* NULL, or "Name: value" lines ending with a NULL entry */
    const char *body;           /* NULL: no body (not even Content-Length) */
    size_t body_len;            /* bytes of body; 0 sends an empty body */
    double timeout_s;           /* > 0: the whole exchange fails (KS_ERR_IO) after this long */
};
/* A body goes out as "Content-Type: application/json" unless headers name another
 * type, and in one piece with the headers (no "Expect: 100-continue" wait) unless
 * headers hold an Expect line: "Expect: 100-continue" waits for the server's go-ahead,
 * so an early refusal (a 413) is read before any of the body is sent.
 * Redirects are not followed. The connection is closed afterwards. */

struct httpc_header {
    char *name, *value; /* value without surrounding blanks */
};

/* What came back. Owned by the caller: httpc_response_free(). */
struct httpc_response {
    long status;                  /* HTTP status, e.g. 200 */
    char *body;                   /* NUL-terminated at body[len]; never NULL after success */
    size_t len;
    struct httpc_header *headers; /* the final response's headers, in order */
    size_t n_headers;
};

/* Largest body httpc_request() keeps in memory. */
#define HTTPC_MAX_BODY ((size_t)64 << 20)

/* Send rq and wait for the whole response, whatever its status (a 404 is KS_OK with
 * status 404). curl stops sending a body once an early error response arrives (a 413
 * from a server that will not read the rest), and that response is returned; a server
 * that resets the connection before its answer is read gives KS_ERR_IO.
 * Errors: KS_ERR_INVALID_ARG (no url), KS_ERR_IO (no response: connection refused,
 * reset, a malformed reply; ks_errmsg() has curl's words and the URL), KS_ERR_RANGE
 * (a body over HTTPC_MAX_BODY), KS_ERR_NOMEM. *out is zeroed on failure. */
ks_status httpc_request(const struct httpc_request *rq, struct httpc_response *out);

/* The value of the first header called name (case-insensitive), or NULL. */
const char *httpc_response_header(const struct httpc_response *r, const char *name);

/* Frees what r holds and zeroes it; safe on a zeroed response. */
void httpc_response_free(struct httpc_response *r);

/* ---- 3. many streams in one thread -------------------------------------------------------- */

/* The read that delivered an event. A pass of httpc_multi_step() reads every stream
 * whose socket has data; all the bytes one stream gets in one pass are one read, so
 * events that arrived together (however many HTTP chunks and callbacks carried them)
 * share one read. */
struct httpc_read {
    double t;    /* httpc_now() when the read's first bytes reached the client */
    uint64_t id; /* per stream, from 1 up; equal ids: the same read */
};

/* A streaming request's callbacks; all are called from httpc_multi_step(). */
struct httpc_stream_cb {
    /* The connection is up and the request is about to be written: when a latency
     * measurement starts (connecting is not the server's time). May be NULL. */
    void (*on_sent)(void *user);
    /* One SSE event of a 2xx response (see httpc_sse_create; "[DONE]" is not one).
     * Return KS_OK, or an error to abort the request (on_done then gets it). */
    ks_status (*on_event)(void *user, const char *data, size_t len, const struct httpc_read *rd);
    /* The request is over and freed. st: KS_OK if the response arrived whole, else
     * why not (KS_ERR_IO connection refused/reset, KS_ERR_RANGE an oversized event,
     * or on_event's status). http_status: 0 if no response began. done: the stream
     * ended with "[DONE]". why: "" when st is KS_OK and the status is 2xx, else a
     * message (curl's words, or the status and the start of the error body). May
     * start new requests on the same multi. */
    void (*on_done)(void *user, ks_status st, long http_status, bool done, const char *why);
    void *user;
};

struct httpc_multi;

/* Errors: KS_ERR_NOMEM, KS_ERR_INTERNAL (curl refused to set up). */
ks_status httpc_multi_create(struct httpc_multi **out);

/* Start a streaming request (rq is copied; its body need not outlive the call) whose
 * SSE events of at most max_event bytes go to cb. Nothing is sent before the next
 * httpc_multi_step(). Errors: KS_ERR_INVALID_ARG (no url, no on_event or on_done,
 * max_event 0), KS_ERR_NOMEM, KS_ERR_INTERNAL. */
ks_status httpc_multi_start(struct httpc_multi *m, const struct httpc_request *rq, size_t max_event,
                            const struct httpc_stream_cb *cb);

/* Requests started and not yet done. */
int httpc_multi_running(const struct httpc_multi *m);

/* Wait up to max_wait seconds (0: do not wait) for any stream's socket, then move
 * every request on: connect, send, read, parse, and call on_done for the ones that
 * ended. Errors: KS_ERR_INTERNAL (curl's multi handle failed; the requests in it
 * are lost). */
ks_status httpc_multi_step(struct httpc_multi *m, double max_wait);

/* Aborts the requests still running (their on_done is not called) and frees m. */
void httpc_multi_free(struct httpc_multi *m);

/* The clock of httpc_read.t: CLOCK_MONOTONIC in seconds. */
double httpc_now(void);

#endif
