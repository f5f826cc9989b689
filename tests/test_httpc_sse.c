/* The SSE parser of tools/httpc: the same events for every split of the input,
 * CRLF and CR line ends, multi-line data, comments, [DONE], a last event without
 * its blank line, and a bounded event size. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "httpc/httpc.h"

#define MAX_EVENTS 32

struct events {
    int n;
    char *data[MAX_EVENTS];
    size_t len[MAX_EVENTS];
    int fail_at; /* return an error on this event (-1: never) */
};

static ks_status on_event(void *user, const char *data, size_t len)
{
    struct events *ev = user;
    assert_int_equal(data[len], '\0');
    if (ev->n == ev->fail_at)
        return ks_fail(KS_ERR_FORMAT, "event %d is bad", ev->n);
    assert_true(ev->n < MAX_EVENTS);
    ev->data[ev->n] = malloc(len + 1);
    memcpy(ev->data[ev->n], data, len + 1);
    ev->len[ev->n++] = len;
    return KS_OK;
}

static void events_free(struct events *ev)
{
    for (int i = 0; i < ev->n; i++)
        free(ev->data[i]);
    ev->n = 0;
}

/* Parse text fed in the given pieces (cuts: ascending offsets), then end. */
static ks_status parse(const char *text, size_t len, const size_t *cuts, int n_cuts, size_t max, struct events *ev,
                       bool *done)
{
    *ev = (struct events){.fail_at = -1};
    struct httpc_sse *p;
    assert_int_equal(httpc_sse_create(max, on_event, ev, &p), KS_OK);
    ks_status st = KS_OK;
    size_t at = 0;
    for (int i = 0; i <= n_cuts && !st; i++) {
        size_t to = i < n_cuts ? cuts[i] : len;
        st = httpc_sse_feed(p, text + at, to - at);
        at = to;
    }
    if (!st)
        st = httpc_sse_end(p);
    if (done)
        *done = httpc_sse_done(p);
    httpc_sse_free(p);
    return st;
}

static void expect_events(const struct events *ev, const char *const *want, int n_want)
{
    assert_int_equal(ev->n, n_want);
    for (int i = 0; i < n_want; i++) {
        assert_int_equal(ev->len[i], strlen(want[i]));
        assert_string_equal(ev->data[i], want[i]);
    }
}

/* Every line-end style, multi-line data, comments, other fields, a data field with
 * no value and one with no colon, and the stream's end. */
static const char STREAM[] = ": keep-alive\r\n"
                             "data: {\"text\":\"a\"}\n\n"
                             "event: message\r\nid: 7\r\ndata: two\r\ndata:  lines\r\n\r\n"
                             "retry: 100\r\r"
                             "data:no space\r"
                             ":a comment between the lines\r"
                             "\r"
                             "data\r\r"
                             "data:\n\n"
                             "event: only a name\n\n"
                             "data: x:y: z\n\n"
                             "data: [DONE]\n\n"
                             "data: after the end\n\n";
static const char *const STREAM_EVENTS[] = {"{\"text\":\"a\"}", "two\n lines", "no space", "", "", "x:y: z"};

static void same_events_at_every_split(void **state)
{
    (void)state;
    size_t len = strlen(STREAM);
    struct events ev;
    bool done;
    assert_int_equal(parse(STREAM, len, NULL, 0, 64, &ev, &done), KS_OK);
    assert_true(done);
    expect_events(&ev, STREAM_EVENTS, 6);
    events_free(&ev);
    /* one cut anywhere, two cuts anywhere, and one byte at a time */
    for (size_t a = 0; a <= len; a++) {
        assert_int_equal(parse(STREAM, len, &a, 1, 64, &ev, &done), KS_OK);
        assert_true(done);
        expect_events(&ev, STREAM_EVENTS, 6);
        events_free(&ev);
        for (size_t b = a; b <= len; b++) {
            size_t cuts[2] = {a, b};
            assert_int_equal(parse(STREAM, len, cuts, 2, 64, &ev, &done), KS_OK);
            expect_events(&ev, STREAM_EVENTS, 6);
            events_free(&ev);
        }
    }
    size_t *every = malloc(len * sizeof *every);
    for (size_t i = 0; i < len; i++)
        every[i] = i;
    assert_int_equal(parse(STREAM, len, every, (int)len, 64, &ev, &done), KS_OK);
    expect_events(&ev, STREAM_EVENTS, 6);
    events_free(&ev);
    free(every);
}

static void crlf_split_between_cr_and_lf(void **state)
{
    (void)state;
    /* "\r" ends the line at once; the "\n" of the same "\r\n" in the next feed ends nothing */
    const char *text = "data: a\r\n\r\ndata: b\r\n\r\n";
    size_t cut = 8; /* after "data: a\r" */
    struct events ev;
    assert_int_equal(parse(text, strlen(text), &cut, 1, 16, &ev, NULL), KS_OK);
    const char *want[] = {"a", "b"};
    expect_events(&ev, want, 2);
    events_free(&ev);
    text = "data: a\r\ndata: b\r\n\r\n"; /* the LF is no blank line: one event of two lines */
    assert_int_equal(parse(text, strlen(text), &cut, 1, 16, &ev, NULL), KS_OK);
    const char *joined[] = {"a\nb"};
    expect_events(&ev, joined, 1);
    events_free(&ev);
    /* "\n\r" is two line ends: a blank line */
    text = "data: c\n\rdata: d\n\n";
    assert_int_equal(parse(text, strlen(text), NULL, 0, 16, &ev, NULL), KS_OK);
    const char *want2[] = {"c", "d"};
    expect_events(&ev, want2, 2);
    events_free(&ev);
}

static void last_event_without_blank_line(void **state)
{
    (void)state;
    struct events ev;
    bool done;
    const char *a = "data: first\n\ndata: last\n";
    assert_int_equal(parse(a, strlen(a), NULL, 0, 16, &ev, &done), KS_OK);
    const char *want[] = {"first", "last"};
    expect_events(&ev, want, 2);
    assert_false(done);
    events_free(&ev);
    const char *b = "data: first\n\ndata: la\ndata: st"; /* not even a line break */
    assert_int_equal(parse(b, strlen(b), NULL, 0, 16, &ev, NULL), KS_OK);
    const char *want2[] = {"first", "la\nst"};
    expect_events(&ev, want2, 2);
    events_free(&ev);
    const char *c = "data: [DONE]"; /* [DONE] at the very end is still the end */
    assert_int_equal(parse(c, strlen(c), NULL, 0, 16, &ev, &done), KS_OK);
    assert_int_equal(ev.n, 0);
    assert_true(done);
    /* an empty stream, and one of comments only, have no events */
    assert_int_equal(parse("", 0, NULL, 0, 16, &ev, &done), KS_OK);
    assert_int_equal(ev.n, 0);
    assert_false(done);
    assert_int_equal(parse(": a\n: b", 7, NULL, 0, 16, &ev, NULL), KS_OK);
    assert_int_equal(ev.n, 0);
}

static void oversized_events_are_errors(void **state)
{
    (void)state;
    struct events ev;
    char text[256];
    /* exactly max bytes of data is fine; one more is KS_ERR_RANGE, whatever the split */
    snprintf(text, sizeof text, "data: %s\n\n", "0123456789abcdef");
    assert_int_equal(parse(text, strlen(text), NULL, 0, 16, &ev, NULL), KS_OK);
    assert_int_equal(ev.n, 1);
    events_free(&ev);
    snprintf(text, sizeof text, "data: ok\n\ndata: %s\n\ndata: never\n\n", "0123456789abcdefg");
    size_t len = strlen(text);
    for (size_t cut = 0; cut <= len; cut++) {
        assert_int_equal(parse(text, len, &cut, 1, 16, &ev, NULL), KS_ERR_RANGE);
        assert_int_equal(ev.n, 1); /* "ok" came out before */
        events_free(&ev);
    }
    assert_non_null(strstr(ks_errmsg(), "over 16 bytes"));
    /* lines that fit but add up to more: 9 + '\n' + 7 = 17 */
    const char *lines = "data: 123456789\ndata: 1234567\n\n";
    assert_int_equal(parse(lines, strlen(lines), NULL, 0, 16, &ev, NULL), KS_ERR_RANGE);
    assert_int_equal(ev.n, 0);
    lines = "data: 123456789\ndata: 123456\n\n"; /* 16 */
    assert_int_equal(parse(lines, strlen(lines), NULL, 0, 16, &ev, NULL), KS_OK);
    assert_int_equal(ev.n, 1);
    assert_string_equal(ev.data[0], "123456789\n123456");
    events_free(&ev);
    /* a line may hold "data: " and 16 bytes; an over-long line of another field, and one never ended */
    const char *field = "id: 0123456789abcdefghi\n\n";
    assert_int_equal(parse(field, strlen(field), NULL, 0, 16, &ev, NULL), KS_ERR_RANGE);
    char *flood = malloc(1 << 20);
    memset(flood, 'x', 1 << 20);
    memcpy(flood, "data: ", 6);
    assert_int_equal(parse(flood, 1 << 20, NULL, 0, 4096, &ev, NULL), KS_ERR_RANGE);
    /* a comment is never stored, so its length does not matter */
    flood[0] = ':';
    flood[(1 << 20) - 1] = '\n';
    assert_int_equal(parse(flood, 1 << 20, NULL, 0, 16, &ev, NULL), KS_OK);
    assert_int_equal(ev.n, 0);
    free(flood);
}

static void a_dead_parser_stays_dead(void **state)
{
    (void)state;
    struct events ev = {.fail_at = 1};
    struct httpc_sse *p;
    assert_int_equal(httpc_sse_create(32, on_event, &ev, &p), KS_OK);
    const char *text = "data: a\n\ndata: b\n\ndata: c\n\n";
    assert_int_equal(httpc_sse_feed(p, text, strlen(text)), KS_ERR_FORMAT); /* on_event's status */
    assert_string_equal(ks_errmsg(), "event 1 is bad");
    assert_int_equal(ev.n, 1);
    assert_int_equal(httpc_sse_feed(p, text, strlen(text)), KS_ERR_FORMAT);
    assert_int_equal(httpc_sse_end(p), KS_ERR_FORMAT);
    assert_int_equal(ev.n, 1);
    httpc_sse_free(p);
    events_free(&ev);
    assert_int_equal(httpc_sse_create(0, on_event, &ev, &p), KS_ERR_INVALID_ARG);
    assert_null(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(same_events_at_every_split),
        cmocka_unit_test(crlf_split_between_cr_and_lf),
        cmocka_unit_test(last_event_without_blank_line),
        cmocka_unit_test(oversized_events_are_errors),
        cmocka_unit_test(a_dead_parser_stays_dead),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
