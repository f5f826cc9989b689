/* Structured output end to end: the built-in default model (a random tiny
 * model, KVSERVE_DEFAULT_MODEL), the real engine and scheduler, and the
 * server's routes driven in-process (server_dispatch). 200 seeded requests
 * with a json_schema, some cut by a small max_tokens, on /v1/completions and
 * /v1/chat/completions: every output must parse with cJSON and validate
 * against the schema (a validator for the supported subset below), and a
 * "length" finish must have spent exactly max_tokens. A random model writes
 * valid JSON only through the grammar. Plus json_object, a GBNF 'grammar',
 * and the 400s for a bad schema, a bad grammar and a too small max_tokens.
 * Exit 77 without the model. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "gguf/gguf.h"
#include "kv/kv.h"
#include "model/model.h"
#include "sample/sample.h"
#include "server/server_internal.h"
#include "support/model_server.h"
#include "support/read_file.h"
#include "support/schema_check.h"
#include "support/skip.h"
#include "threads/threads.h"

/* The check is 200 seeds (Release with its SIMD kernels); the
 * sanitizer builds, ~20x slower, and the portable build, whose scalar kernels
 * took this file past 15 minutes, run 40 for memory safety and the kernels'
 * paths. */
#if defined(NDEBUG) && (defined(__AVX2__) || !defined(__x86_64__))
#define KS_FULL_SWEEP 1
#endif
#ifdef KS_FULL_SWEEP
#define N_SAMPLES 200
#else
#define N_SAMPLES 40
#endif
#define N_THREADS 8

static const char schema_text[] =
    "{\"$defs\":{\"item\":{\"type\":\"object\",\"properties\":{\"sku\":{\"type\":\"string\",\"maxLength\":6},"
    "\"qty\":{\"type\":\"integer\"}},\"required\":[\"sku\",\"qty\"],\"additionalProperties\":false}},"
    "\"type\":\"object\",\"properties\":{"
    "\"name\":{\"type\":\"string\"},"
    "\"age\":{\"type\":\"integer\"},"
    "\"score\":{\"type\":\"number\"},"
    "\"active\":{\"type\":\"boolean\"},"
    "\"color\":{\"enum\":[\"red\",\"green\",\"blue\"]},"
    "\"nick\":{\"type\":[\"string\",\"null\"]},"
    "\"kind\":{\"const\":\"order\"},"
    "\"id\":{\"anyOf\":[{\"type\":\"integer\"},{\"type\":\"string\",\"maxLength\":4}]},"
    "\"items\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/item\"},\"maxItems\":3},"
    "\"address\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"},\"zip\":{\"type\":\"string\","
    "\"minLength\":1,\"maxLength\":5}},\"required\":[\"city\",\"zip\"],\"additionalProperties\":false}},"
    "\"required\":[\"name\",\"age\",\"score\",\"active\",\"color\",\"nick\",\"kind\",\"id\",\"items\",\"address\"],"
    "\"additionalProperties\":false}";

static struct {
    struct model_server ms;
    struct server *cur; /* the server post() talks to, NULL: srv */
    cJSON *schema;
    int32_t min_bytes;
} F;

static int start(size_t kv_budget, const char *chat_template, struct sched **sched, struct server **srv);
static void stop(struct sched *sched, struct server *srv);

static void test_validator_rejects(void **state)
{
    (void)state;
    char why[128] = "";
    cJSON *ok = cJSON_Parse("{\"name\":\"a\",\"age\":1,\"score\":1.5,\"active\":true,\"color\":\"red\",\"nick\":null,"
                            "\"kind\":\"order\",\"id\":\"ab\",\"items\":[{\"sku\":\"x\",\"qty\":2}],"
                            "\"address\":{\"city\":\"c\",\"zip\":\"1\"}}");
    assert_true(ks_schema_valid(ok, F.schema, F.schema, why, sizeof why));
    cJSON_ReplaceItemInObject(ok, "age", cJSON_CreateNumber(1.5));
    assert_false(ks_schema_valid(ok, F.schema, F.schema, why, sizeof why));
    cJSON_Delete(ok);
    cJSON *bad = cJSON_Parse("{\"age\":1,\"name\":\"a\"}");
    assert_false(ks_schema_valid(bad, F.schema, F.schema, why, sizeof why));
    cJSON_Delete(bad);
}

/* ---- requests ------------------------------------------------------------------ */

struct answer {
    unsigned status;
    cJSON *json;
};

static struct answer post(const char *path, const char *body)
{
    struct server_req rq = {.method = "POST", .path = path, .body = body, .len = strlen(body)};
    struct reply r = {0};
    server_dispatch(F.cur ? F.cur : F.ms.srv, &rq, &r);
    assert_null(r.stream_read);
    struct answer a = {r.status, cJSON_ParseWithLength(r.body, r.len)};
    if (r.status != 200 && r.status != 400)
        print_message("%s -> %u %.*s\n", path, r.status, (int)r.len, r.body);
    assert_non_null(a.json);
    reply_free(&r);
    return a;
}

static char *body_for(int seed, bool chat, int max_tokens, const char *format)
{
    size_t cap = strlen(format) + 512;
    char *b = malloc(cap);
    if (chat)
        snprintf(b, cap,
                 "{\"messages\":[{\"role\":\"user\",\"content\":\"Give me an order %d\"}],\"max_tokens\":%d,"
                 "\"seed\":%d,\"temperature\":1.0,\"response_format\":%s}",
                 seed, max_tokens, seed, format);
    else
        snprintf(b, cap,
                 "{\"prompt\":\"Once upon a time %d\",\"max_tokens\":%d,\"seed\":%d,\"temperature\":1.0,"
                 "\"response_format\":%s}",
                 seed, max_tokens, seed, format);
    return b;
}

static const char *choice_text(const cJSON *j, bool chat)
{
    const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    const cJSON *t = chat ? cJSON_GetObjectItem(cJSON_GetObjectItem(c, "message"), "content")
                          : cJSON_GetObjectItem(c, "text");
    return cJSON_IsString(t) ? t->valuestring : NULL;
}

static const char *finish(const cJSON *j)
{
    const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    const cJSON *f = cJSON_GetObjectItem(c, "finish_reason");
    return cJSON_IsString(f) ? f->valuestring : "?";
}

struct tally {
    int n_samples;
    int done, valid, stop, length, cut_runs;
    int first_bad;
    char bad[1024];
    pthread_mutex_t mu;
};

static struct tally T = {.n_samples = N_SAMPLES, .first_bad = -1, .mu = PTHREAD_MUTEX_INITIALIZER};
static char *g_format;

static void *worker(void *arg)
{
    int w = (int)(intptr_t)arg;
    for (int seed = w; seed < T.n_samples; seed += N_THREADS) {
        bool chat = seed % 2 == 1;
        /* every fourth run has a budget just above the shortest output: cut mid-object unless the grammar steers */
        bool cut = seed % 4 == 0;
        int max_tokens = cut ? F.min_bytes + (seed % 40) : 600;
        char *body = body_for(seed, chat, max_tokens, g_format);
        struct answer a = post(chat ? "/v1/chat/completions" : "/v1/completions", body);
        free(body);
        const char *text = choice_text(a.json, chat);
        const cJSON *usage = cJSON_GetObjectItem(a.json, "usage");
        int completion_tokens = (int)cJSON_GetObjectItem(usage, "completion_tokens")->valuedouble;
        char why[256] = "";
        cJSON *out = text ? cJSON_Parse(text) : NULL;
        bool valid = a.status == 200 && out && ks_schema_valid(out, F.schema, F.schema, why, sizeof why);
        const char *fr = finish(a.json);
        bool fin_ok = !strcmp(fr, "stop") || (!strcmp(fr, "length") && completion_tokens == max_tokens);
        pthread_mutex_lock(&T.mu);
        T.done++;
        T.valid += valid && fin_ok;
        T.stop += !strcmp(fr, "stop");
        T.length += !strcmp(fr, "length");
        T.cut_runs += cut;
        if ((!valid || !fin_ok) && T.first_bad < 0) {
            T.first_bad = seed;
            snprintf(T.bad, sizeof T.bad, "seed %d status %u finish %s (%d of %d tokens): %s | %.700s", seed, a.status,
                     fr, completion_tokens, max_tokens, out ? why : "does not parse", text ? text : "(no text)");
        }
        pthread_mutex_unlock(&T.mu);
        cJSON_Delete(out);
        cJSON_Delete(a.json);
    }
    return NULL;
}

static void test_json_schema_200_seeds(void **state)
{
    (void)state;
    size_t cap = sizeof schema_text + 128;
    g_format = malloc(cap);
    snprintf(g_format, cap, "{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"order\",\"strict\":true,\"schema\":%s}}",
             schema_text);
    pthread_t th[N_THREADS];
    for (int i = 0; i < N_THREADS; i++)
        assert_int_equal(pthread_create(&th[i], NULL, worker, (void *)(intptr_t)i), 0);
    for (int i = 0; i < N_THREADS; i++)
        pthread_join(th[i], NULL);
    print_message("json_schema: %d/%d outputs parse and validate (%d stop, %d length; %d runs with max_tokens just "
                  "above the shortest output of %d bytes)\n",
                  T.valid, T.done, T.stop, T.length, T.cut_runs, F.min_bytes);
    if (T.first_bad >= 0)
        print_message("first failure: %s\n", T.bad);
    assert_int_equal(T.done, N_SAMPLES);
    assert_int_equal(T.valid, N_SAMPLES);
    free(g_format);
}

/* A KV budget far below the requests' contexts: sequences are preempted and
 * recomputed mid-object, and their grammar state (kept in the sampler) must
 * carry on where it was. */
static void test_json_schema_under_preemption(void **state)
{
    (void)state;
    struct sched *sched;
    struct server *srv;
    assert_int_equal(start(2u << 20, NULL, &sched, &srv), 0);
    F.cur = srv;
    size_t cap = sizeof schema_text + 128;
    g_format = malloc(cap);
    snprintf(g_format, cap, "{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"order\",\"schema\":%s}}",
             schema_text);
    memset(&T, 0, sizeof T);
    T.n_samples = 24;
    T.first_bad = -1;
    pthread_mutex_init(&T.mu, NULL);
    pthread_t th[N_THREADS];
    for (int i = 0; i < N_THREADS; i++)
        assert_int_equal(pthread_create(&th[i], NULL, worker, (void *)(intptr_t)i), 0);
    for (int i = 0; i < N_THREADS; i++)
        pthread_join(th[i], NULL);
    struct sched_stats ss;
    sched_get_stats(sched, &ss);
    print_message("under preemption: %d/%d valid (%llu preemptions)\n", T.valid, T.done,
                  (unsigned long long)ss.preemptions);
    if (T.first_bad >= 0)
        print_message("first failure: %s\n", T.bad);
    assert_int_equal(T.valid, T.done);
    assert_true(ss.preemptions > 0);
    free(g_format);
    F.cur = NULL;
    stop(sched, srv);
}

static void test_json_object_and_gbnf(void **state)
{
    (void)state;
    for (int seed = 0; seed < 20; seed++) {
        char *body = body_for(seed, seed % 2, seed % 3 == 0 ? 8 + seed : 300, "{\"type\":\"json_object\"}");
        struct answer a = post(seed % 2 ? "/v1/chat/completions" : "/v1/completions", body);
        free(body);
        assert_int_equal(a.status, 200);
        cJSON *out = cJSON_Parse(choice_text(a.json, seed % 2));
        if (!out)
            print_message("json_object seed %d: %s\n", seed, choice_text(a.json, seed % 2));
        assert_true(cJSON_IsObject(out));
        cJSON_Delete(out);
        cJSON_Delete(a.json);
    }
    for (int seed = 0; seed < 20; seed++) {
        char body[512];
        snprintf(body, sizeof body,
                 "{\"prompt\":\"Answer:\",\"max_tokens\":%d,\"seed\":%d,\"grammar\":\"root ::= (\\\"yes\\\" | "
                 "\\\"no\\\") \\\", \\\" [0-9]{1,3} \\\"%%\\\"\"}",
                 seed % 2 ? 6 : 50, seed);
        struct answer a = post("/v1/completions", body);
        assert_int_equal(a.status, 200);
        const char *t = choice_text(a.json, false);
        struct grammar *g;
        const char *gbnf = "root ::= (\"yes\" | \"no\") \", \" [0-9]{1,3} \"%\"";
        assert_int_equal(grammar_compile(gbnf, strlen(gbnf), &g), KS_OK);
        if (!grammar_match(g, t, strlen(t)))
            print_message("gbnf seed %d: '%s'\n", seed, t);
        assert_true(grammar_match(g, t, strlen(t)));
        grammar_free(g);
        cJSON_Delete(a.json);
    }
}

static void expect_400(const char *body, const char *fragment)
{
    struct answer a = post("/v1/completions", body);
    const cJSON *msg = cJSON_GetObjectItem(cJSON_GetObjectItem(a.json, "error"), "message");
    if (a.status != 400 || !cJSON_IsString(msg) || !strstr(msg->valuestring, fragment))
        print_message("%s -> %u %s\n", body, a.status, cJSON_IsString(msg) ? msg->valuestring : "");
    assert_int_equal(a.status, 400);
    assert_non_null(strstr(msg->valuestring, fragment));
    cJSON_Delete(a.json);
}

static void test_errors(void **state)
{
    (void)state;
    expect_400("{\"prompt\":\"x\",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"n\","
               "\"schema\":{\"type\":\"string\",\"pattern\":\"^a$\"}}}}",
               "'pattern' is not supported");
    expect_400("{\"prompt\":\"x\",\"grammar\":\"root ::= \\\"a\\\"\\nfoo ::= (\"}", "line 2, column");
    expect_400("{\"prompt\":\"x\",\"grammar\":\"root ::= root \\\"a\\\"\"}", "left-recursive");
    expect_400("{\"prompt\":\"x\",\"max_tokens\":3,\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{"
               "\"name\":\"n\",\"schema\":{\"type\":\"object\",\"properties\":{\"abc\":{\"type\":\"string\"}},"
               "\"required\":[\"abc\"],\"additionalProperties\":false}}}}",
               "max_tokens 3");
    expect_400("{\"prompt\":\"x\",\"response_format\":{\"type\":\"xml\"}}", "json_schema");
    expect_400("{\"prompt\":\"x\",\"response_format\":{\"type\":\"json_schema\"}}", "json_schema");
    expect_400("{\"prompt\":\"x\",\"grammar\":\"root ::= \\\"a\\\"\",\"response_format\":{\"type\":\"json_object\"}}",
               "not both");
    /* text is no constraint */
    struct answer a = post("/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":4,\"response_format\":{\"type\":\"text\"}}");
    assert_int_equal(a.status, 200);
    cJSON_Delete(a.json);
}

/* ---- tool_choice ------------------------------------------------------------------ */

/* get_weather and search have schemas in the subset; lookup's 'pattern' is
 * not, so its arguments are any object; ping has no parameters. */
static const char tools_text[] =
    "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":\"object\","
    "\"properties\":{\"city\":{\"type\":\"string\",\"maxLength\":12},\"unit\":{\"enum\":[\"c\",\"f\"]},"
    "\"days\":{\"type\":\"integer\"}},\"required\":[\"city\",\"unit\"],\"additionalProperties\":false}}},"
    "{\"type\":\"function\",\"function\":{\"name\":\"search\",\"parameters\":{\"type\":\"object\","
    "\"properties\":{\"query\":{\"type\":\"string\",\"minLength\":1,\"maxLength\":20},\"limit\":{\"type\":"
    "[\"integer\",\"null\"]},\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\",\"maxLength\":6},"
    "\"maxItems\":2}},\"required\":[\"query\",\"limit\"]}}},"
    "{\"type\":\"function\",\"function\":{\"name\":\"lookup\",\"parameters\":{\"type\":\"object\","
    "\"properties\":{\"id\":{\"type\":\"string\",\"pattern\":\"^[0-9]+$\"}}}}},"
    "{\"type\":\"function\",\"function\":{\"name\":\"ping\"}}]";

struct family {
    const char *template_file; /* in ../shared/templates */
    enum server_tool_format format;
};

static const struct family families[] = {
    {"Qwen-Qwen2.5-7B-Instruct.jinja", SERVER_TOOLS_HERMES},
    {"meta-llama-Llama-3.1-8B-Instruct.jinja", SERVER_TOOLS_LLAMA3},
    {"mistralai-Mistral-Nemo-Instruct-2407.jinja", SERVER_TOOLS_MISTRAL},
    {"Kimi-K2-Instruct.jinja", SERVER_TOOLS_GENERIC},
};

#ifdef KS_FULL_SWEEP
#define N_TOOL_SEEDS 48
#else
#define N_TOOL_SEEDS 6 /* sanitizer and portable builds (12 made the file take 811 s under ASan) */
#endif

/* The request's options for a seed: required (parallel or not) or a named function. */
static struct server_tool_opts tool_opts_for(int seed, const cJSON *tools)
{
    struct server_tool_opts o = {.choice = SERVER_TOOL_REQUIRED, .parallel = seed % 3 != 1,
                                 .n_tools = cJSON_GetArraySize(tools)};
    if (seed % 3 == 2) {
        o.choice = SERVER_TOOL_NAMED;
        const cJSON *fn = cJSON_GetObjectItem(cJSON_GetArrayItem(tools, seed / 3 % o.n_tools), "function");
        snprintf(o.name, sizeof o.name, "%s", cJSON_GetObjectItem(fn, "name")->valuestring);
    }
    return o;
}

/* The shortest output of the tool grammar, in bytes. */
static int32_t tool_min_bytes(struct server *srv, const cJSON *tools, const struct server_tool_opts *o)
{
    char *gbnf = NULL;
    bool fell_back = false;
    assert_int_equal(server_tools_grammar(srv->tool_format, F.ms.tok, tools, o, &gbnf, &fell_back), KS_OK);
    assert_true(fell_back); /* lookup's pattern */
    struct grammar *g = NULL;
    assert_int_equal(grammar_compile(gbnf, strlen(gbnf), &g), KS_OK);
    int32_t min = grammar_min_bytes(g);
    grammar_free(g);
    free(gbnf);
    return min;
}

/* One call of the answer: a tool of the request (the named one), arguments
 * that parse and validate against its schema (any object for lookup). */
static bool call_valid(const cJSON *call, const cJSON *tools, const struct server_tool_opts *o, char *why, size_t cap)
{
    const cJSON *fn = cJSON_GetObjectItem(call, "function");
    const cJSON *name = cJSON_GetObjectItem(fn, "name"), *args = cJSON_GetObjectItem(fn, "arguments");
    if (!cJSON_IsString(name) || !cJSON_IsString(args) || !cJSON_IsString(cJSON_GetObjectItem(call, "id")))
        return snprintf(why, cap, "malformed call"), false;
    if (o->choice == SERVER_TOOL_NAMED && strcmp(name->valuestring, o->name))
        return snprintf(why, cap, "called %s, not the named %s", name->valuestring, o->name), false;
    const cJSON *schema = NULL, *t;
    bool known = false;
    cJSON_ArrayForEach(t, tools) {
        const cJSON *f = cJSON_GetObjectItem(t, "function");
        if (!strcmp(cJSON_GetObjectItem(f, "name")->valuestring, name->valuestring)) {
            known = true;
            schema = cJSON_GetObjectItem(f, "parameters");
        }
    }
    if (!known)
        return snprintf(why, cap, "unknown function %s", name->valuestring), false;
    cJSON *a = cJSON_Parse(args->valuestring);
    bool ok = cJSON_IsObject(a);
    if (!ok)
        snprintf(why, cap, "arguments are not a JSON object: %s", args->valuestring);
    else if (schema && strcmp(name->valuestring, "lookup"))
        ok = ks_schema_valid(a, schema, schema, why, cap);
    cJSON_Delete(a);
    return ok;
}

/* The answer's message and a result for each of its calls go back through
 * the template (Mistral's refuses ids that are not 9 alphanumerics): the
 * rendered prompt holds the results. */
static void check_round_trip(const struct family *fam, const cJSON *message)
{
    cJSON *req = cJSON_CreateObject();
    cJSON *msgs = cJSON_AddArrayToObject(req, "messages");
    cJSON *user = cJSON_CreateObject();
    cJSON_AddStringToObject(user, "role", "user");
    cJSON_AddStringToObject(user, "content", "What is the weather in Paris?");
    cJSON_AddItemToArray(msgs, user);
    cJSON_AddItemToArray(msgs, cJSON_Duplicate(message, 1));
    const cJSON *call;
    int k = 0;
    cJSON_ArrayForEach(call, cJSON_GetObjectItem(message, "tool_calls")) {
        cJSON *tool = cJSON_CreateObject();
        char result[64];
        snprintf(result, sizeof result, "RESULT-%d-of-the-tool", k++);
        cJSON_AddStringToObject(tool, "role", "tool");
        cJSON_AddStringToObject(tool, "tool_call_id", cJSON_GetObjectItem(call, "id")->valuestring);
        cJSON_AddStringToObject(tool, "content", result);
        cJSON_AddItemToArray(msgs, tool);
    }
    cJSON_AddItemToObject(req, "tools", cJSON_Parse(tools_text));
    char *body = cJSON_PrintUnformatted(req);
    struct answer a = post("/apply-template", body);
    const cJSON *prompt = cJSON_GetObjectItem(a.json, "prompt");
    if (a.status != 200)
        print_message("%s round trip: %s\n", fam->template_file, body);
    assert_int_equal(a.status, 200);
    for (int i = 0; i < k; i++) {
        char result[64];
        snprintf(result, sizeof result, "RESULT-%d-of-the-tool", i);
        assert_non_null(strstr(prompt->valuestring, result));
    }
    free(body);
    cJSON_Delete(a.json);
    cJSON_Delete(req);
}

/* Every answer to tool_choice required / named is a tool_calls message whose
 * calls validate, with finish_reason tool_calls, also when max_tokens is
 * just above the shortest call. */
static void check_family(const struct family *fam, const char *tmpl)
{
    struct sched *sched;
    struct server *srv;
    assert_int_equal(start(128u << 20, tmpl, &sched, &srv), 0);
    assert_int_equal(srv->tool_format, fam->format);
    F.cur = srv;
    cJSON *tools = cJSON_Parse(tools_text);
    int valid = 0, cut = 0;
    for (int seed = 0; seed < N_TOOL_SEEDS; seed++) {
        struct server_tool_opts o = tool_opts_for(seed, tools);
        int32_t max_tokens = seed % 4 == 0 ? tool_min_bytes(srv, tools, &o) + seed % 16 : 400;
        cut += seed % 4 == 0;
        char choice[200] = "\"required\"";
        if (o.choice == SERVER_TOOL_NAMED)
            snprintf(choice, sizeof choice, "{\"type\":\"function\",\"function\":{\"name\":\"%s\"}}", o.name);
        char *body = malloc(sizeof tools_text + 512);
        sprintf(body,
                "{\"messages\":[{\"role\":\"user\",\"content\":\"What is the weather in Paris? (%d)\"}],"
                "\"tools\":%s,\"tool_choice\":%s,\"parallel_tool_calls\":%s,\"max_tokens\":%d,\"seed\":%d,"
                "\"temperature\":1.0}",
                seed, tools_text, choice, o.parallel ? "true" : "false", max_tokens, seed);
        struct answer a = post("/v1/chat/completions", body);
        free(body);
        const cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(a.json, "choices"), 0);
        const cJSON *calls = cJSON_GetObjectItem(cJSON_GetObjectItem(ch, "message"), "tool_calls");
        int n = cJSON_GetArraySize(calls);
        char why[256] = "";
        bool ok = a.status == 200 && !strcmp(finish(a.json), "tool_calls") && n >= 1 && (o.parallel || n == 1);
        if (!ok)
            snprintf(why, sizeof why, "status %u, finish %s, %d calls", a.status, finish(a.json), n);
        const cJSON *call;
        cJSON_ArrayForEach(call, calls) ok = ok && call_valid(call, tools, &o, why, sizeof why);
        if (!ok) {
            char *text = cJSON_PrintUnformatted(a.json);
            print_message("%s seed %d: %s\n%s\n", fam->template_file, seed, why, text);
            free(text);
        }
        valid += ok;
        if (ok && seed < 3)
            check_round_trip(fam, cJSON_GetObjectItem(ch, "message"));
        cJSON_Delete(a.json);
    }
    print_message("%s (%s): %d/%d answers are valid tool calls (%d with max_tokens just above the shortest call)\n",
                  fam->template_file, server_tool_format_name(fam->format), valid, N_TOOL_SEEDS, cut);
    assert_int_equal(valid, N_TOOL_SEEDS);
    cJSON_Delete(tools);
    F.cur = NULL;
    stop(sched, srv);
}

static void test_tool_choice_families(void **state)
{
    (void)state;
    const char *dir = getenv("KVSERVE_SHARED");
    for (size_t i = 0; i < sizeof families / sizeof families[0]; i++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/templates/%s", dir ? dir : "../shared", families[i].template_file);
        char *tmpl = ks_read_file(path, NULL);
        if (!tmpl)
            KS_SKIP("no template %s", path);
        check_family(&families[i], tmpl);
        free(tmpl);
    }
}

/* tool_choice auto: the sampler with the lazy tool grammar of each format,
 * the first tokens forced to spell some text and the format's trigger, then
 * random logits: whatever follows the trigger is calls that parse and
 * validate (a random model would almost never start a call by itself). */
static void test_tool_choice_auto_lazy(void **state)
{
    (void)state;
    cJSON *tools = cJSON_Parse(tools_text);
    struct server_tool_opts o = {.choice = SERVER_TOOL_AUTO, .parallel = true, .n_tools = cJSON_GetArraySize(tools)};
    int32_t n_vocab = tok_n_vocab(F.ms.tok);
    float *logits = malloc((size_t)n_vocab * sizeof *logits);
    static const char *const words[] = {[SERVER_TOOLS_HERMES] = "Let me check. <tool_call>",
                                        [SERVER_TOOLS_LLAMA3] = " {\"name\"",
                                        [SERVER_TOOLS_MISTRAL] = "Sure.[TOOL_CALLS]",
                                        [SERVER_TOOLS_GENERIC] = "{\"tool_calls\""};
    int valid = 0, total = 0;
    for (enum server_tool_format f = SERVER_TOOLS_HERMES; f <= SERVER_TOOLS_GENERIC; f++) {
        char *gbnf = NULL;
        bool fell_back;
        struct grammar *g = NULL;
        assert_int_equal(server_tools_grammar(f, F.ms.tok, tools, &o, &gbnf, &fell_back), KS_OK);
        assert_int_equal(grammar_compile(gbnf, strlen(gbnf), &g), KS_OK);
        free(gbnf);
        int32_t *ids = NULL;
        size_t n_ids = 0;
        assert_int_equal(tok_encode(F.ms.tok, words[f], strlen(words[f]), 0, &ids, &n_ids), KS_OK);
        for (int seed = 0; seed < N_TOOL_SEEDS; seed++) {
            struct sample_params p;
            sample_params_default(&p);
            p.seed = (uint64_t)seed;
            p.temp = 1.0f;
            p.top_k = 0;
            p.min_p = 0.0f;
            p.top_p = 1.0f;
            p.grammar = g;
            p.grammar_vocab = F.ms.srv->grammar_vocab;
            p.grammar_max_tokens = 300;
            server_tools_triggers(f, F.ms.tok, &p.grammar_triggers);
            struct sampler *smp;
            assert_int_equal(sample_create(&p, n_vocab, &smp), KS_OK);
            struct sbuf text = {0};
            uint64_t rng = (uint64_t)seed * 0x9E3779B97F4A7C15ull + 1;
            for (int32_t step = 0; step < 300; step++) {
                for (int32_t i = 0; i < n_vocab; i++) {
                    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
                    logits[i] = (float)(rng >> 40) / (float)(1 << 24) * 4.0f;
                }
                if ((size_t)step < n_ids)
                    logits[ids[step]] = 100.0f;
                struct sample_result res;
                assert_int_equal(sample_next(smp, logits, NULL, 0, &res), KS_OK);
                if (tok_is_eog(F.ms.tok, res.token))
                    break;
                const char *b;
                size_t bl;
                assert_int_equal(tok_piece(F.ms.tok, res.token, &b, &bl), KS_OK);
                sbuf_append(&text, b, bl);
            }
            struct server_tool_result r;
            assert_int_equal(server_tools_parse(f, text.p, text.n, true, &r), KS_OK);
            bool ok = r.n_calls >= 1;
            char why[256] = "no call";
            for (int i = 0; i < r.n_calls && ok; i++) {
                cJSON *call = cJSON_CreateObject();
                cJSON_AddStringToObject(call, "id", "x");
                cJSON *fn = cJSON_AddObjectToObject(call, "function");
                cJSON_AddStringToObject(fn, "name", r.calls[i].name);
                cJSON_AddStringToObject(fn, "arguments", r.calls[i].arguments);
                ok = call_valid(call, tools, &o, why, sizeof why);
                cJSON_Delete(call);
            }
            if (!ok)
                print_message("%s seed %d: %s\n%.*s\n", server_tool_format_name(f), seed, why, (int)text.n, text.p);
            valid += ok;
            total++;
            server_tool_result_free(&r);
            sbuf_free(&text);
            sample_free(smp);
        }
        free(ids);
        grammar_free(g);
    }
    print_message("tool_choice auto: %d/%d outputs that started a call hold only valid calls after it\n", valid, total);
    assert_int_equal(valid, total);
    free(logits);
    cJSON_Delete(tools);
}

/* ---- setup ----------------------------------------------------------------------------- */

/* The real engine on the default model with a KV budget, its scheduler and a server. */
static int start(size_t kv_budget, const char *chat_template, struct sched **sched, struct server **srv)
{
    struct model_server_config mc = {.model = F.ms.model, .tok = F.ms.tok, .pool = F.ms.pool, .kv_budget = kv_budget,
                                     .parallel = N_THREADS, .ctx_size = 4096, .chat_template_jinja = chat_template};
    return model_server_start(&mc, sched, srv);
}

static void stop(struct sched *sched, struct server *srv)
{
    model_server_stop(sched, srv);
}

static int setup(void **state)
{
    (void)state;
    const char *path = getenv("KVSERVE_DEFAULT_MODEL");
    if (model_server_load(path, &F.ms))
        return -1;
    if (start(128u << 20, NULL, &F.ms.sched, &F.ms.srv))
        return -1;
    F.schema = cJSON_Parse(schema_text);
    char *gbnf = NULL;
    struct grammar *g = NULL;
    if (!F.schema || grammar_from_json_schema(schema_text, strlen(schema_text), &gbnf) ||
        grammar_compile(gbnf, strlen(gbnf), &g))
        return -1;
    F.min_bytes = grammar_min_bytes(g);
    grammar_free(g);
    free(gbnf);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    stop(F.ms.sched, F.ms.srv);
    model_server_unload(&F.ms);
    cJSON_Delete(F.schema);
    return 0;
}

int main(void)
{
    const char *path = getenv("KVSERVE_DEFAULT_MODEL");
    if (!path || access(path, R_OK) != 0) {
        printf("skipped: the default model (KVSERVE_DEFAULT_MODEL=%s) is not built\n", path ? path : "");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_validator_rejects),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_json_object_and_gbnf),
        cmocka_unit_test(test_json_schema_200_seeds),
        cmocka_unit_test(test_json_schema_under_preemption),
        cmocka_unit_test(test_tool_choice_families),
        cmocka_unit_test(test_tool_choice_auto_lazy),
    };
    return ks_run_tests(tests, setup, teardown);
}
