/* Tool calls in model output (src/server/server_tools.c): each format whole,
 * at every split point of a stream (what was released as content is a prefix
 * of the final content and never holds markup; calls found early are the
 * final ones), malformed markup staying content, and the format detection on
 * the corpus templates' markers. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/server_internal.h"

struct want_call {
    const char *name, *args;
};

struct tcase {
    enum server_tool_format f;
    const char *text;
    const char *content; /* final content: the text outside the calls */
    int n_calls;
    struct want_call calls[3];
};

static const struct tcase cases[] = {
    {SERVER_TOOLS_HERMES, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
     "", 1, {{"get_weather", "{\"city\":\"Paris\"}"}}},
    {SERVER_TOOLS_HERMES,
     "Let me check. <tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n<tool_call>{\"name\": \"b\", "
     "\"arguments\": {\"x\": [1, 2]}}</tool_call> done",
     "Let me check. done", 2, {{"a", "{}"}, {"b", "{\"x\":[1,2]}"}}},
    {SERVER_TOOLS_HERMES, "I use <tool_call>{\"name\": oops}</tool_call> wrongly",
     "I use <tool_call>{\"name\": oops}</tool_call> wrongly", 0, {{0}}},
    {SERVER_TOOLS_HERMES, "no calls here, a < b and <tool", "no calls here, a < b and <tool", 0, {{0}}},
    {SERVER_TOOLS_LLAMA3, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}", "", 1,
     {{"get_weather", "{\"city\":\"Rome\"}"}}},
    {SERVER_TOOLS_LLAMA3, "{\"type\": \"function\", \"name\": \"f\", \"parameters\": {\"a\": 1}}; {\"name\": \"g\", "
                          "\"parameters\": {}}",
     "", 2, {{"f", "{\"a\":1}"}, {"g", "{}"}}},
    {SERVER_TOOLS_LLAMA3, "<|python_tag|>{\"name\": \"search\", \"parameters\": {\"q\": \"x\"}}", "", 1,
     {{"search", "{\"q\":\"x\"}"}}},
    {SERVER_TOOLS_LLAMA3, "<|python_tag|>print(1 + 1)", "", 1, {{"python", "{\"code\":\"print(1 + 1)\"}"}}},
    {SERVER_TOOLS_LLAMA3, "A set {1, 2} and {\"name\": broken", "A set {1, 2} and {\"name\": broken", 0, {{0}}},
    {SERVER_TOOLS_MISTRAL,
     "[TOOL_CALLS] [{\"name\": \"a\", \"arguments\": {\"k\": \"v\"}, \"id\": \"abc123def\"}, {\"name\": \"b\", "
     "\"arguments\": {}}]",
     "", 2, {{"a", "{\"k\":\"v\"}"}, {"b", "{}"}}},
    {SERVER_TOOLS_MISTRAL, "Sure.[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {}}]", "Sure.", 1, {{"a", "{}"}}},
    {SERVER_TOOLS_MISTRAL, "[TOOL_CALLS] not json", "[TOOL_CALLS] not json", 0, {{0}}},
    {SERVER_TOOLS_GENERIC, "{\"tool_calls\": [{\"name\": \"f\", \"arguments\": {\"a\": true}}]}", "", 1,
     {{"f", "{\"a\":true}"}}},
    {SERVER_TOOLS_GENERIC, " {\"tool_call\": {\"name\": \"g\", \"arguments\": {}}}", " ", 1, {{"g", "{}"}}},
    {SERVER_TOOLS_GENERIC, "{\"response\": \"hello\"}", "hello", 0, {{0}}},
    {SERVER_TOOLS_GENERIC, "\n {\"response\": \"hi\"}", "hi", 0, {{0}}},
    {SERVER_TOOLS_GENERIC, "  ", "  ", 0, {{0}}},
    {SERVER_TOOLS_GENERIC, "{not json at all", "{not json at all", 0, {{0}}},
    {SERVER_TOOLS_GENERIC, "plain text {\"tool_call\": 1}", "plain text {\"tool_call\": 1}", 0, {{0}}},
    {SERVER_TOOLS_NONE, "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>",
     "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>", 0, {{0}}},
};

static const char *const markup[] = {"<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]"};

/* The content a result gives for text (the caller frees it). */
static char *content_of(const char *text, size_t n, const struct server_tool_result *r)
{
    if (r->response)
        return strdup(r->response);
    size_t a = r->content_end, b = n - r->tail_start;
    char *s = malloc(a + b + 1);
    memcpy(s, text, a);
    memcpy(s + a, text + r->tail_start, b);
    s[a + b] = 0;
    return s;
}

/* JSON texts equal as values. */
static void assert_json_equal(const char *a, const char *b)
{
    cJSON *x = cJSON_Parse(a), *y = cJSON_Parse(b);
    if (!cJSON_Compare(x, y, true))
        print_message("arguments %s, want %s\n", a, b);
    assert_true(cJSON_Compare(x, y, true));
    cJSON_Delete(x);
    cJSON_Delete(y);
}

static void test_whole(void **state)
{
    (void)state;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const struct tcase *t = &cases[c];
        struct server_tool_result r;
        size_t n = strlen(t->text);
        assert_int_equal(server_tools_parse(t->f, t->text, n, true, &r), KS_OK);
        char *content = content_of(t->text, n, &r);
        if (strcmp(content, t->content) || r.n_calls != t->n_calls)
            print_message("case %zu: content '%s' (want '%s'), %d calls (want %d)\n", c, content, t->content, r.n_calls,
                          t->n_calls);
        assert_string_equal(content, t->content);
        assert_int_equal(r.n_calls, t->n_calls);
        for (int i = 0; i < r.n_calls; i++) {
            assert_string_equal(r.calls[i].name, t->calls[i].name);
            assert_json_equal(r.calls[i].arguments, t->calls[i].args);
        }
        free(content);
        server_tool_result_free(&r);
    }
}

/* A stream releases text[sent..content_end) as content and calls as they
 * complete: at every split point that is a prefix of the final answer, and
 * markup is never released. */
static void test_every_split(void **state)
{
    (void)state;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const struct tcase *t = &cases[c];
        size_t n = strlen(t->text);
        size_t released = 0;
        int calls_seen = 0;
        for (size_t cut = 0; cut <= n; cut++) {
            struct server_tool_result r;
            assert_int_equal(server_tools_parse(t->f, t->text, cut, false, &r), KS_OK);
            assert_true(r.content_end <= cut);
            assert_int_equal(r.tail_start, cut);
            assert_null(r.response);
            if (r.content_end > released)
                released = r.content_end;
            /* released content is a prefix of the final content */
            if (strncmp(t->text, t->content, released) && t->f != SERVER_TOOLS_GENERIC)
                print_message("case %zu cut %zu: released '%.*s'\n", c, cut, (int)released, t->text);
            if (t->f != SERVER_TOOLS_GENERIC || t->n_calls > 0)
                assert_memory_equal(t->text, t->content, released);
            if (t->n_calls > 0 || t->f == SERVER_TOOLS_NONE)
                for (size_t m = 0; m < sizeof markup / sizeof markup[0] && t->f != SERVER_TOOLS_NONE; m++) {
                    char *piece = strndup(t->text, released);
                    assert_null(strstr(piece, markup[m]));
                    free(piece);
                }
            assert_true(r.n_calls >= calls_seen);
            assert_true(r.n_calls <= t->n_calls);
            for (int i = 0; i < r.n_calls; i++) {
                assert_string_equal(r.calls[i].name, t->calls[i].name);
                assert_json_equal(r.calls[i].arguments, t->calls[i].args);
            }
            calls_seen = r.n_calls;
            server_tool_result_free(&r);
        }
    }
}

/* Invalid UTF-8 in a call's name or arguments becomes U+FFFD (the answer is JSON). */
static void test_bad_utf8(void **state)
{
    (void)state;
    const char text[] = "<tool_call>{\"name\": \"f\xff\", \"arguments\": {\"a\": \"x\xc3\"}}</tool_call>";
    struct server_tool_result r;
    assert_int_equal(server_tools_parse(SERVER_TOOLS_HERMES, text, sizeof text - 1, true, &r), KS_OK);
    assert_int_equal(r.n_calls, 1);
    assert_string_equal(r.calls[0].name, "f\xef\xbf\xbd");
    assert_string_equal(r.calls[0].arguments, "{\"a\":\"x\xef\xbf\xbd\"}");
    server_tool_result_free(&r);
}

static void test_detect(void **state)
{
    (void)state;
    assert_int_equal(server_tool_format_detect("{{ '<tool_call>' }}", 19), SERVER_TOOLS_HERMES);
    const char *l3 = "<|start_header_id|>ipython<|end_header_id|>";
    assert_int_equal(server_tool_format_detect(l3, strlen(l3)), SERVER_TOOLS_LLAMA3);
    assert_int_equal(server_tool_format_detect("[TOOL_CALLS] <tool_call>", 24), SERVER_TOOLS_MISTRAL);
    assert_int_equal(server_tool_format_detect("{{ messages }}", 14), SERVER_TOOLS_GENERIC);
    assert_string_equal(server_tool_format_name(SERVER_TOOLS_HERMES), "hermes");
}

/* Random bytes and markup soups: any status, no fault (run under ASan). */
static void test_fuzz(void **state)
{
    (void)state;
    static const char *const bits[] = {"<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "{", "}",
                                       "[", "]", "\"name\"", ":", "\"a\"", ",", "\"arguments\"", "\"parameters\"",
                                       "{}", " ", ";", "\"tool_calls\"", "\"response\"", "x", "\\"};
    uint32_t rng = 12345;
    char buf[512];
    for (int it = 0; it < 20000; it++) {
        size_t n = 0;
        int parts = (int)(rng % 24);
        for (int p = 0; p < parts; p++) {
            rng = rng * 1664525u + 1013904223u;
            const char *b = bits[(rng >> 8) % (sizeof bits / sizeof bits[0])];
            size_t l = strlen(b);
            if (n + l >= sizeof buf)
                break;
            memcpy(buf + n, b, l);
            n += l;
        }
        buf[n] = 0;
        for (int f = SERVER_TOOLS_NONE; f <= SERVER_TOOLS_GENERIC; f++) {
            struct server_tool_result r;
            assert_int_equal(server_tools_parse((enum server_tool_format)f, buf, n, it & 1, &r), KS_OK);
            assert_true(r.content_end <= n && r.tail_start <= n);
            server_tool_result_free(&r);
        }
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_whole),
        cmocka_unit_test(test_every_split),
        cmocka_unit_test(test_bad_utf8),
        cmocka_unit_test(test_detect),
        cmocka_unit_test(test_fuzz),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
