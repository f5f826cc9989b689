/* httpc_sse: the incremental Server-Sent Events parser (the event-stream format of
 * the HTML spec, "9.2 Server-sent events"), bounded by the caller's max_event. */
#include <stdlib.h>
#include <string.h>

#include "httpc/httpc.h"

/* "data: " before max bytes of data */
#define LINE_EXTRA 6

struct httpc_sse {
    size_t max;             /* bytes of one event's data; a line may have LINE_EXTRA more */
    httpc_sse_fn on_event;
    void *user;
    char *line;             /* the current line, without its line break */
    size_t line_len, line_cap;
    char *data;             /* the current event's data lines, each followed by '\n' */
    size_t data_len, data_cap;
    bool has_data;          /* the event has a data field (possibly empty) */
    bool in_comment;        /* the current line started with ':': its bytes are dropped */
    bool after_cr;          /* the last line ended with '\r': a '\n' next ends nothing */
    bool done;              /* "[DONE]" went by: ignore the rest */
    ks_status failed;
};

ks_status httpc_sse_create(size_t max_event, httpc_sse_fn on_event, void *user, struct httpc_sse **out)
{
    *out = NULL;
    if (max_event == 0 || max_event > SIZE_MAX / 4 || !on_event)
        return ks_fail(KS_ERR_INVALID_ARG, "httpc_sse_create: max_event must be at least 1 and on_event set");
    struct httpc_sse *p = calloc(1, sizeof *p);
    if (!p)
        return ks_fail(KS_ERR_NOMEM, "httpc_sse_create: out of memory");
    p->max = max_event;
    p->on_event = on_event;
    p->user = user;
    *out = p;
    return KS_OK;
}

void httpc_sse_free(struct httpc_sse *p)
{
    if (!p)
        return;
    free(p->line);
    free(p->data);
    free(p);
}

bool httpc_sse_done(const struct httpc_sse *p) { return p->done; }

static ks_status fail(struct httpc_sse *p, ks_status st)
{
    p->failed = st;
    return st;
}

/* Room for need bytes (plus a NUL) in *buf, growing by doubling; need <= max + LINE_EXTRA. */
static ks_status reserve(struct httpc_sse *p, char **buf, size_t *cap, size_t need)
{
    if (need + 1 <= *cap)
        return KS_OK;
    size_t c = *cap ? *cap : 256;
    while (c < need + 1)
        c *= 2;
    if (c > p->max + LINE_EXTRA + 1)
        c = p->max + LINE_EXTRA + 1;
    char *b = realloc(*buf, c);
    if (!b)
        return fail(p, ks_fail(KS_ERR_NOMEM, "SSE parser: out of memory for a %zu-byte event", need));
    *buf = b;
    *cap = c;
    return KS_OK;
}

static ks_status too_big(struct httpc_sse *p)
{
    return fail(p, ks_fail(KS_ERR_RANGE,
                           "SSE event over %zu bytes (or a line over %zu): not an event stream, or raise the limit",
                           p->max, p->max + LINE_EXTRA));
}

/* The blank line: deliver the event, if it has data. */
static ks_status dispatch(struct httpc_sse *p)
{
    if (!p->has_data)
        return KS_OK;
    size_t len = p->data_len - 1; /* drop the '\n' after the last data line */
    p->data[len] = '\0';
    p->has_data = false;
    p->data_len = 0;
    if (len == 6 && !memcmp(p->data, "[DONE]", 6)) {
        p->done = true;
        return KS_OK;
    }
    ks_status st = p->on_event(p->user, p->data, len);
    return st ? fail(p, st) : KS_OK;
}

/* One whole line (its break already consumed). */
static ks_status end_line(struct httpc_sse *p)
{
    if (p->in_comment) {
        p->in_comment = false;
        return KS_OK;
    }
    if (p->line_len == 0)
        return dispatch(p);
    size_t n = p->line_len;
    p->line_len = 0;
    const char *colon = memchr(p->line, ':', n);
    size_t name_len = colon ? (size_t)(colon - p->line) : n;
    if (name_len != 4 || memcmp(p->line, "data", 4))
        return KS_OK; /* event, id, retry and unknown fields */
    const char *v = colon ? colon + 1 : p->line + n;
    size_t vn = (size_t)(p->line + n - v);
    if (vn && *v == ' ')
        v++, vn--;
    if (p->data_len + vn > p->max) /* the data so far, its '\n's included, plus this value */
        return too_big(p);
    ks_status st = reserve(p, &p->data, &p->data_cap, p->data_len + vn + 1);
    if (st)
        return st;
    memcpy(p->data + p->data_len, v, vn);
    p->data_len += vn;
    p->data[p->data_len++] = '\n';
    p->has_data = true;
    return KS_OK;
}

ks_status httpc_sse_feed(struct httpc_sse *p, const char *bytes, size_t n)
{
    if (p->failed)
        return p->failed;
    size_t i = 0;
    while (i < n && !p->done) {
        if (p->after_cr) {
            p->after_cr = false;
            if (bytes[i] == '\n') {
                i++;
                continue;
            }
        }
        if (bytes[i] == '\r' || bytes[i] == '\n') {
            p->after_cr = bytes[i] == '\r';
            i++;
            ks_status st = end_line(p);
            if (st)
                return st;
            continue;
        }
        if (p->line_len == 0 && !p->in_comment && bytes[i] == ':')
            p->in_comment = true;
        /* the rest of the line in this buffer */
        size_t end = i;
        while (end < n && bytes[end] != '\r' && bytes[end] != '\n')
            end++;
        if (!p->in_comment) {
            size_t k = end - i;
            if (p->line_len + k > p->max + LINE_EXTRA)
                return too_big(p);
            ks_status st = reserve(p, &p->line, &p->line_cap, p->line_len + k);
            if (st)
                return st;
            memcpy(p->line + p->line_len, bytes + i, k);
            p->line_len += k;
        }
        i = end;
    }
    return KS_OK;
}

ks_status httpc_sse_end(struct httpc_sse *p)
{
    if (p->failed)
        return p->failed;
    if (p->done)
        return KS_OK;
    ks_status st = KS_OK;
    if (p->line_len > 0 || p->in_comment)
        st = end_line(p);
    if (!st)
        st = dispatch(p);
    p->after_cr = false;
    return st;
}
