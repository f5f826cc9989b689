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
#include "server/server_internal.h"
#include "support/model_server.h"
#include "threads/threads.h"

/* The check is 200 seeds (Release); the sanitizer builds, ~20x slower,
 * run 40 for memory safety. */
#ifdef NDEBUG
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

static int start(size_t kv_budget, struct sched **sched, struct server **srv);
static void stop(struct sched *sched, struct server *srv);

/* ---- a validator for the supported subset ----------------------------------------- */

static size_t utf8_chars(const char *s)
{
    size_t n = 0;
    for (; *s; s++)
        n += ((unsigned char)*s & 0xC0) != 0x80;
    return n;
}

static bool validate(const cJSON *v, const cJSON *s, char *why, size_t cap);

static bool type_ok(const cJSON *v, const cJSON *s, const char *t, char *why, size_t cap)
{
    if (!strcmp(t, "null"))
        return cJSON_IsNull(v);
    if (!strcmp(t, "boolean"))
        return cJSON_IsBool(v);
    if (!strcmp(t, "number"))
        return cJSON_IsNumber(v);
    if (!strcmp(t, "integer"))
        return cJSON_IsNumber(v) && v->valuedouble == floor(v->valuedouble);
    if (!strcmp(t, "string")) {
        if (!cJSON_IsString(v))
            return false;
        const cJSON *mx = cJSON_GetObjectItem(s, "maxLength"), *mn = cJSON_GetObjectItem(s, "minLength");
        size_t n = utf8_chars(v->valuestring);
        if ((mx && n > (size_t)mx->valuedouble) || (mn && n < (size_t)mn->valuedouble)) {
            snprintf(why, cap, "string length %zu out of bounds", n);
            return false;
        }
        return true;
    }
    if (!strcmp(t, "array")) {
        if (!cJSON_IsArray(v))
            return false;
        const cJSON *mx = cJSON_GetObjectItem(s, "maxItems"), *items = cJSON_GetObjectItem(s, "items");
        if (mx && cJSON_GetArraySize(v) > (int)mx->valuedouble) {
            snprintf(why, cap, "too many items");
            return false;
        }
        const cJSON *e;
        cJSON_ArrayForEach(e, v) if (items && !validate(e, items, why, cap)) return false;
        return true;
    }
    if (!strcmp(t, "object")) {
        if (!cJSON_IsObject(v))
            return false;
        const cJSON *props = cJSON_GetObjectItem(s, "properties"), *req = cJSON_GetObjectItem(s, "required");
        const cJSON *r;
        cJSON_ArrayForEach(r, req) if (!cJSON_GetObjectItemCaseSensitive(v, r->valuestring)) {
            snprintf(why, cap, "required property '%s' missing", r->valuestring);
            return false;
        }
        int last = -1;
        const cJSON *m;
        cJSON_ArrayForEach(m, v) {
            int idx = 0;
            const cJSON *p;
            bool found = false;
            cJSON_ArrayForEach(p, props) {
                if (!strcmp(p->string, m->string)) {
                    found = true;
                    break;
                }
                idx++;
            }
            if (!found) {
                snprintf(why, cap, "property '%s' not in the schema", m->string);
                return false;
            }
            if (idx <= last) {
                snprintf(why, cap, "property '%s' out of the declared order (or repeated)", m->string);
                return false;
            }
            last = idx;
            if (!validate(m, cJSON_GetObjectItem(props, m->string), why, cap))
                return false;
        }
        return true;
    }
    snprintf(why, cap, "unknown type %s", t);
    return false;
}

static bool validate(const cJSON *v, const cJSON *s, char *why, size_t cap)
{
    const cJSON *ref = cJSON_GetObjectItem(s, "$ref");
    if (ref) {
        const char *name = ref->valuestring + strlen("#/$defs/");
        return validate(v, cJSON_GetObjectItem(cJSON_GetObjectItem(F.schema, "$defs"), name), why, cap);
    }
    const cJSON *c = cJSON_GetObjectItem(s, "const");
    if (c && !cJSON_Compare(v, c, true)) {
        snprintf(why, cap, "not the const");
        return false;
    }
    const cJSON *en = cJSON_GetObjectItem(s, "enum");
    if (en) {
        const cJSON *e;
        bool any = false;
        cJSON_ArrayForEach(e, en) any |= cJSON_Compare(v, e, true);
        if (!any) {
            snprintf(why, cap, "not in the enum");
            return false;
        }
    }
    const cJSON *anyof = cJSON_GetObjectItem(s, "anyOf");
    if (anyof) {
        const cJSON *e;
        bool any = false;
        cJSON_ArrayForEach(e, anyof) any |= validate(v, e, why, cap);
        if (!any) {
            snprintf(why, cap, "matches no anyOf branch");
            return false;
        }
    }
    const cJSON *type = cJSON_GetObjectItem(s, "type");
    if (cJSON_IsString(type) && !type_ok(v, s, type->valuestring, why, cap)) {
        if (!*why)
            snprintf(why, cap, "not of type %s", type->valuestring);
        return false;
    }
    if (cJSON_IsArray(type)) {
        const cJSON *t;
        bool any = false;
        cJSON_ArrayForEach(t, type) any |= type_ok(v, s, t->valuestring, why, cap);
        if (!any) {
            snprintf(why, cap, "of none of the types");
            return false;
        }
    }
    return true;
}

static void test_validator_rejects(void **state)
{
    (void)state;
    char why[128] = "";
    cJSON *ok = cJSON_Parse("{\"name\":\"a\",\"age\":1,\"score\":1.5,\"active\":true,\"color\":\"red\",\"nick\":null,"
                            "\"kind\":\"order\",\"id\":\"ab\",\"items\":[{\"sku\":\"x\",\"qty\":2}],"
                            "\"address\":{\"city\":\"c\",\"zip\":\"1\"}}");
    assert_true(validate(ok, F.schema, why, sizeof why));
    cJSON_ReplaceItemInObject(ok, "age", cJSON_CreateNumber(1.5));
    assert_false(validate(ok, F.schema, why, sizeof why));
    cJSON_Delete(ok);
    cJSON *bad = cJSON_Parse("{\"age\":1,\"name\":\"a\"}");
    assert_false(validate(bad, F.schema, why, sizeof why));
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
        bool valid = a.status == 200 && out && validate(out, F.schema, why, sizeof why);
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
    assert_int_equal(start(2u << 20, &sched, &srv), 0);
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

/* ---- setup ----------------------------------------------------------------------------- */

/* The real engine on the default model with a KV budget, its scheduler and a server. */
static int start(size_t kv_budget, struct sched **sched, struct server **srv)
{
    struct model_server_config mc = {.model = F.ms.model, .tok = F.ms.tok, .pool = F.ms.pool, .kv_budget = kv_budget,
                                     .parallel = N_THREADS, .ctx_size = 1024};
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
    if (start(128u << 20, &F.ms.sched, &F.ms.srv))
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
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
