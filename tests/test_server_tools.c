/* Tool calls in model output (src/server/server_tools.c): each format whole,
 * at every split point of a stream (what was released as content is a prefix
 * of the final content and never holds markup; calls found early are the
 * final ones), malformed markup staying content, the format detection on
 * the corpus templates' markers, and each format's tool-call grammar
 * (src/server/server_tools_grammar.c) against the parser. */
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

/* ---- the tool-call grammar ------------------------------------------------------------- */

static const char grammar_tools[] =
    "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":\"object\","
    "\"properties\":{\"city\":{\"type\":\"string\"}},\"required\":[\"city\"],\"additionalProperties\":false}}},"
    "{\"type\":\"function\",\"function\":{\"name\":\"say \\\"hi\\\"\",\"parameters\":{\"properties\":{\"n\":"
    "{\"type\":\"integer\"}},\"required\":[\"n\"]}}},"
    "{\"type\":\"function\",\"function\":{\"name\":\"ping\",\"parameters\":{}}},"
    "{\"type\":\"function\",\"function\":{\"name\":\"grep\",\"parameters\":{\"type\":\"object\","
    "\"properties\":{\"re\":{\"type\":\"string\",\"pattern\":\"a+\"}}}}}]";

static struct grammar *tool_grammar(enum server_tool_format f, const struct server_tool_opts *o, bool *fell_back)
{
    cJSON *tools = cJSON_Parse(grammar_tools);
    char *gbnf = NULL;
    assert_int_equal(server_tools_grammar(f, NULL, tools, o, &gbnf, fell_back), KS_OK);
    struct grammar *g = NULL;
    ks_status st = grammar_compile(gbnf, strlen(gbnf), &g);
    if (st)
        fprintf(stderr, "%s\n%s\n", ks_errmsg(), gbnf);
    assert_int_equal(st, KS_OK);
    free(gbnf);
    cJSON_Delete(tools);
    return g;
}

/* The text a grammar accepts, and what the parser reads from it. */
static void expect_calls(struct grammar *g, enum server_tool_format f, const char *text, int n_calls)
{
    bool ok = grammar_match(g, text, strlen(text));
    if ((n_calls > 0) != ok)
        fprintf(stderr, "%s: '%s' %s\n", server_tool_format_name(f), text, ok ? "matches" : ks_errmsg());
    assert_int_equal(ok, n_calls > 0);
    if (!ok)
        return;
    struct server_tool_result r;
    assert_int_equal(server_tools_parse(f, text, strlen(text), true, &r), KS_OK);
    assert_int_equal(r.n_calls, n_calls);
    assert_int_equal(r.content_end, 0);
    server_tool_result_free(&r);
}

/* Each format's grammar accepts exactly its calls (any tool, the named one,
 * one or several), which the parser reads back; arguments follow the schema,
 * {} and an untyped schema take objects, a schema outside the subset any object. */
static void test_grammar_formats(void **state)
{
    (void)state;
    struct server_tool_opts req = {.choice = SERVER_TOOL_REQUIRED, .parallel = true, .n_tools = 4};
    struct server_tool_opts one = req, named = req;
    one.parallel = false;
    named.choice = SERVER_TOOL_NAMED;
    strcpy(named.name, "ping");
    static const struct {
        enum server_tool_format f;
        const char *call_a, *call_b, *bad_args, *join;
    } forms[] = {
        {SERVER_TOOLS_HERMES, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>",
         "<tool_call>\n{\"name\": \"ping\", \"arguments\": {\"x\": [1]}}\n</tool_call>",
         "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"town\": \"Rome\"}}\n</tool_call>", "\n"},
        {SERVER_TOOLS_LLAMA3, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}",
         "{\"name\": \"ping\", \"parameters\": {}}", "{\"name\": \"get_weather\", \"parameters\": {}}", "; "},
        {SERVER_TOOLS_MISTRAL, "{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Rome\"}}",
         "{\"name\": \"ping\", \"arguments\": {}}", "{\"name\": \"say \\\"hi\\\"\", \"arguments\": {\"n\": 1.5}}", ", "},
        {SERVER_TOOLS_GENERIC, "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}",
         "{\"name\": \"ping\", \"arguments\": {}}", "{\"name\": \"grep\", \"arguments\": 5}", ", "},
    };
    for (size_t i = 0; i < sizeof forms / sizeof forms[0]; i++) {
        enum server_tool_format f = forms[i].f;
        const char *pre = f == SERVER_TOOLS_MISTRAL ? "[TOOL_CALLS][" : f == SERVER_TOOLS_GENERIC ? "{\"tool_calls\": [" : "";
        const char *post = f == SERVER_TOOLS_MISTRAL ? "]" : f == SERVER_TOOLS_GENERIC ? "]}" : "";
        char a[512], b[512], two[1024], bad[512];
        snprintf(a, sizeof a, "%s%s%s", pre, forms[i].call_a, post);
        snprintf(b, sizeof b, "%s%s%s", pre, forms[i].call_b, post);
        snprintf(two, sizeof two, "%s%s%s%s%s", pre, forms[i].call_a, forms[i].join, forms[i].call_b, post);
        snprintf(bad, sizeof bad, "%s%s%s", pre, forms[i].bad_args, post);
        bool fell_back = false;
        struct grammar *g = tool_grammar(f, &req, &fell_back);
        assert_true(fell_back); /* grep's pattern */
        expect_calls(g, f, a, 1);
        expect_calls(g, f, two, f == SERVER_TOOLS_LLAMA3 ? 0 : 2);
        expect_calls(g, f, bad, 0);
        expect_calls(g, f, "Sure.", 0);
        grammar_free(g);
        g = tool_grammar(f, &one, &fell_back);
        expect_calls(g, f, a, 1);
        expect_calls(g, f, two, 0);
        grammar_free(g);
        g = tool_grammar(f, &named, &fell_back);
        expect_calls(g, f, a, 0);
        expect_calls(g, f, b, 1);
        grammar_free(g);
    }
    /* the generic grammar in full: a quoted name, an untyped schema's object, the fallback's any object */
    struct grammar *g = tool_grammar(SERVER_TOOLS_GENERIC, &req, &(bool){false});
    expect_calls(g, SERVER_TOOLS_GENERIC,
                 "{\"tool_calls\": [{\"name\": \"say \\\"hi\\\"\", \"arguments\": {\"n\": 3}}, {\"name\": \"grep\", "
                 "\"arguments\": {\"re\": 1, \"more\": [true]}}]}",
                 2);
    grammar_free(g);
    struct grammar_triggers t;
    server_tools_triggers(SERVER_TOOLS_LLAMA3, NULL, &t);
    assert_int_equal(t.n, 1);
    assert_string_equal(t.t[0].word, "{\"name\"");
    assert_true(t.t[0].at_start);
    server_tools_triggers(SERVER_TOOLS_HERMES, NULL, &t);
    assert_string_equal(t.t[0].word, "<tool_call>");
    assert_false(t.t[0].at_start);
}

/* ---- harmony (gpt-oss) ---------------------------------------------------------------- */

struct hcase {
    const char *text;
    bool calls;          /* tools offered */
    const char *reasoning, *content;
    int n_calls;
    struct want_call call;
};

static const struct hcase hcases[] = {
    {"<|channel|>analysis<|message|>User says hi.<|end|><|start|>assistant<|channel|>final<|message|>Hello!", false,
     "User says hi.", "Hello!", 0, {0}},
    {"<|channel|>final<|message|>Just the answer.", false, "", "Just the answer.", 0, {0}},
    {"<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
     "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}",
     true, "Need weather.", "", 1, {"get_weather", "{\"city\":\"Paris\"}"}},
    /* the recipient before the channel, as the template renders calls */
    {" to=functions.get_weather<|channel|>commentary json<|message|>{\"city\":\"Rome\"}", true, "", "", 1,
     {"get_weather", "{\"city\":\"Rome\"}"}},
    /* tools not offered: a call's body is content */
    {"<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}", false, "", "{}", 0, {0}},
    /* a commentary preamble is content; a built-in tool's call is reasoning */
    {"<|channel|>commentary<|message|>Checking. <|end|><|start|>assistant to=browser.search<|channel|>analysis "
     "<|message|>{\"query\": \"x\"}<|end|><|start|>assistant<|channel|>final<|message|>Done.",
     true, "{\"query\": \"x\"}", "Checking. Done.", 0, {0}},
    /* cut by max_tokens inside the thinking: it is still reasoning */
    {"<|channel|>analysis<|message|>I am still thinking ab", false, "I am still thinking ab", "", 0, {0}},
    /* a model that ignores the format: all content, markup-like text included */
    {"Plain text with a < sign and <|end|> inside.", false, "", "Plain text with a < sign and <|end|> inside.", 0, {0}},
    {"", false, "", "", 0, {0}},
};

static void check_harmony(const struct hcase *t, const struct server_harmony *h, size_t c)
{
    char *r = strndup(h->reasoning.p ? h->reasoning.p : "", h->reasoning.n);
    char *k = strndup(h->content.p ? h->content.p : "", h->content.n);
    if (strcmp(r, t->reasoning) || strcmp(k, t->content) || h->n_calls != t->n_calls)
        print_message("harmony case %zu: reasoning '%s' content '%s' %d calls\n", c, r, k, h->n_calls);
    assert_string_equal(r, t->reasoning);
    assert_string_equal(k, t->content);
    assert_int_equal(h->n_calls, t->n_calls);
    if (h->n_calls) {
        assert_string_equal(h->calls[0].name, t->call.name);
        assert_json_equal(h->calls[0].arguments, t->call.args);
    }
    free(r);
    free(k);
}

/* Whole texts, and every prefix as a stream sees it: what a non-final
 * parse gives is a prefix of the final reasoning and content (so deltas are
 * never taken back) and never holds a marker; calls only once complete. */
static void test_harmony(void **state)
{
    (void)state;
    static const char *const hmarkup[] = {"<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"};
    for (size_t c = 0; c < sizeof hcases / sizeof hcases[0]; c++) {
        const struct hcase *t = &hcases[c];
        size_t n = strlen(t->text);
        struct server_harmony h;
        assert_int_equal(server_harmony_parse(t->text, n, true, t->calls, &h), KS_OK);
        check_harmony(t, &h, c);
        server_harmony_free(&h);
        bool plain = !strcmp(t->text, t->content);
        for (size_t cut = 0; cut <= n; cut++) {
            assert_int_equal(server_harmony_parse(t->text, cut, false, t->calls, &h), KS_OK);
            assert_true(h.reasoning.n <= strlen(t->reasoning) && h.content.n <= strlen(t->content));
            assert_memory_equal(h.reasoning.p ? h.reasoning.p : "", t->reasoning, h.reasoning.n);
            assert_memory_equal(h.content.p ? h.content.p : "", t->content, h.content.n);
            for (size_t m = 0; m < sizeof hmarkup / sizeof hmarkup[0] && !plain; m++) {
                char *piece = strndup(h.content.p ? h.content.p : "", h.content.n);
                assert_null(strstr(piece, hmarkup[m]));
                free(piece);
            }
            assert_true(h.n_calls <= t->n_calls);
            if (h.n_calls && cut < n)
                fail_msg("harmony case %zu: a call counted at %zu of %zu bytes", c, cut, n);
            server_harmony_free(&h);
        }
    }
    const char *tmpl = "{{- '<|start|>' + role + '<|channel|>final<|message|>' }}";
    assert_true(server_harmony_template(tmpl, strlen(tmpl)));
    assert_false(server_harmony_template("<tool_call>", 11));
    assert_string_equal(server_tool_format_name(SERVER_TOOLS_HARMONY), "harmony");
}

/* Random markup soups: any split, no fault (run under ASan). */
static void test_harmony_fuzz(void **state)
{
    (void)state;
    static const char *const bits[] = {"<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                                       "<|call|>", "<|return|>", "<|", "analysis", "final", "commentary", " to=",
                                       "functions.f", "json", "{}", "x", " ", "\xc3"};
    uint32_t rng = 777;
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
        struct server_harmony h;
        assert_int_equal(server_harmony_parse(buf, n, it & 1, it & 2, &h), KS_OK);
        assert_true(h.reasoning.n + h.content.n <= n);
        server_harmony_free(&h);
    }
}

/* The harmony grammar (tool_choice required / named) accepts a call, with or
 * without reasoning first, and the parser reads it back. */
static void test_harmony_grammar(void **state)
{
    (void)state;
    struct server_tool_opts req = {.choice = SERVER_TOOL_REQUIRED, .n_tools = 4}, named = req;
    named.choice = SERVER_TOOL_NAMED;
    strcpy(named.name, "ping");
    bool fell_back = false;
    struct grammar *g = tool_grammar(SERVER_TOOLS_HARMONY, &req, &fell_back);
    static const struct {
        const char *text;
        bool ok;     /* the grammar accepts it */
        int n_calls; /* the parser reads (it does not check arguments) */
    } texts[] = {
        {"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Rome\"}", true, 1},
        {"<|channel|>analysis<|message|>Rome, then.<|end|><|start|>assistant<|channel|>commentary to=functions.ping "
         "<|constrain|>json<|message|>{}",
         true, 1},
        {"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"town\": \"Rome\"}", false, 1},
        {"<|channel|>final<|message|>Sure.", false, 0},
    };
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
        bool ok = grammar_match(g, texts[i].text, strlen(texts[i].text));
        if (ok != texts[i].ok)
            fprintf(stderr, "harmony grammar: '%s' %s\n", texts[i].text, ok ? "matches" : ks_errmsg());
        assert_int_equal(ok, texts[i].ok);
        struct server_harmony h;
        assert_int_equal(server_harmony_parse(texts[i].text, strlen(texts[i].text), true, true, &h), KS_OK);
        assert_int_equal(h.n_calls, texts[i].n_calls);
        server_harmony_free(&h);
    }
    grammar_free(g);
    g = tool_grammar(SERVER_TOOLS_HARMONY, &named, &fell_back);
    assert_false(grammar_match(g, texts[0].text, strlen(texts[0].text)));
    const char *ping = "<|channel|>commentary to=functions.ping <|constrain|>json<|message|>{}";
    assert_true(grammar_match(g, ping, strlen(ping)));
    grammar_free(g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_whole),
        cmocka_unit_test(test_every_split),
        cmocka_unit_test(test_bad_utf8),
        cmocka_unit_test(test_detect),
        cmocka_unit_test(test_fuzz),
        cmocka_unit_test(test_grammar_formats),
        cmocka_unit_test(test_harmony),
        cmocka_unit_test(test_harmony_fuzz),
        cmocka_unit_test(test_harmony_grammar),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
