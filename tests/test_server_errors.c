/* The server's error convention under allocation failure: for every route,
 * fail the n-th allocation of one request for n = 1, 2, ... until a request
 * runs with no failure injected, and check that the answer is never a 200
 * with an empty body, never a 200 with holes (its shape is the shape of the
 * run without failures), an error is the OpenAI error with status 500, a
 * stream ends with an error event or completes, and nothing crashes or leaks
 * (run it in the ASan build: LeakSanitizer checks every failed request).
 *
 * The injector wraps malloc, calloc, realloc and strdup at link time
 * (tests/server_errors.cmake): that covers the server, the tokenizer and the
 * scheduler, and cJSON, which allocates through the server's hook. It counts
 * only the allocations of one thread: the thread handling the request (this
 * one: routes are driven in-process through server_dispatch, as
 * libmicrohttpd's connection thread drives them) or the scheduler thread
 * (on_event, the between-steps hooks that build /cache/usage and friends).
 * Counting one thread at a time keeps the n-th allocation the same in every
 * run. The tokenizer is the built-in default model's
 * (KVSERVE_DEFAULT_MODEL); the engine is a mock whose next token is a pure
 * function of the sequence's history, so every run answers alike. Exit 77
 * without the model. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "gguf/gguf.h"
#include "server/server_internal.h"
#include "support/mock_engine.h"

/* ---- allocation-failure injector ------------------------------------------------ */

enum role { ROLE_NONE, ROLE_HANDLER, ROLE_SCHED };

static _Thread_local enum role thread_role;
static atomic_int armed_role;       /* ROLE_NONE: nothing fails */
static atomic_long countdown;       /* the allocation that reaches 0 fails */
static atomic_bool injected;

void *__real_malloc(size_t n);
void *__real_calloc(size_t k, size_t n);
void *__real_realloc(void *p, size_t n);
char *__real_strdup(const char *s);

static bool fail_now(void)
{
    enum role want = (enum role)atomic_load(&armed_role);
    if (want == ROLE_NONE || thread_role != want)
        return false;
    if (atomic_fetch_sub(&countdown, 1) != 1)
        return false;
    atomic_store(&injected, true);
    return true;
}

void *__wrap_malloc(size_t n)
{
    return fail_now() ? NULL : __real_malloc(n);
}

void *__wrap_calloc(size_t k, size_t n)
{
    return fail_now() ? NULL : __real_calloc(k, n);
}

void *__wrap_realloc(void *p, size_t n)
{
    return fail_now() ? NULL : __real_realloc(p, n);
}

char *__wrap_strdup(const char *s)
{
    return fail_now() ? NULL : __real_strdup(s);
}

static void arm(enum role role, long n)
{
    atomic_store(&injected, false);
    atomic_store(&countdown, n);
    atomic_store(&armed_role, role);
}

static bool disarm(void)
{
    atomic_store(&armed_role, ROLE_NONE);
    return atomic_load(&injected);
}

/* ---- mock engine (tests/support/mock_engine.h) ----------------------------------------- */

#define CTX 256

/* Ids from 259 on, past the control and byte tokens; two alternatives (300 or
 * 301) for the logprobs; a real cache of 16 pages for the /cache routes. */
static const struct mock_engine_config mock_config = {
    .first_token = 259, .max_seqs = 8, .max_ctx = CTX + 8, .kv_pages = 16, .n_top = 2, .top_first = 300,
};

/* ---- fixture --------------------------------------------------------------------------- */

static struct {
    struct gguf_file *gguf;
    struct tokenizer *tok;
    struct mock_engine *mock;
    struct sched *sched;
    struct server *srv;
} F;

static void mark_sched_thread(void *user, struct kv_cache *kv)
{
    (void)user;
    (void)kv;
    thread_role = ROLE_SCHED;
}

static void nothing(void *user, struct kv_cache *kv)
{
    (void)user;
    (void)kv;
}

static int setup(void **state)
{
    (void)state;
    const char *path = getenv("KVSERVE_DEFAULT_MODEL");
    if (gguf_open(path, &F.gguf) || tok_load(F.gguf, &F.tok))
        return -1;
    struct mock_engine_config mc = mock_config;
    mc.n_vocab = tok_n_vocab(F.tok);
    if (mock_engine_create(&mc, &F.mock))
        return -1;
    struct sched_engine e = mock_engine_sched(F.mock, true);
    struct sched_config sc;
    sched_config_default(&sc);
    sc.parallel = 2;
    sc.max_batch_tokens = 64;
    sc.prefill_chunk = 64;
    sc.max_itl_ratio = 0; /* steps sized by the config, not by timing: every run the same */
    sc.ctx_size = CTX;
    if (sched_create(&sc, &e, &F.sched))
        return -1;
    struct server_config cfg;
    server_config_default(&cfg);
    cfg.port = 0;
    cfg.ctx_size = CTX;
    cfg.model_name = "mock";
    if (server_start(&cfg, F.sched, F.tok, &F.srv))
        return -1;
    server_set_ready(F.srv, true);
    thread_role = ROLE_HANDLER;
    return sched_between_steps(F.sched, mark_sched_thread, NULL) ? -1 : 0;
}

static int teardown(void **state)
{
    (void)state;
    server_stop(F.srv);
    sched_free(F.sched);
    tok_free(F.tok);
    gguf_close(F.gguf);
    return 0;
}

/* ---- one request ------------------------------------------------------------------------ */

struct route_case {
    const char *name, *method, *path, *query, *body;
    bool stream;
};

static const char *query_arg(void *ctx, const char *name)
{
    const char *q = ctx; /* "name=value" */
    size_t n = strlen(name);
    return q && !strncmp(q, name, n) && q[n] == '=' ? q + n + 1 : NULL;
}

struct answer {
    unsigned status;
    char *body;               /* malloc'd after disarming */
    size_t len;
};

/* Until the scheduler holds no request and has finished its step. The test
 * thread's own allocations here are not the request's. */
static void wait_idle(void)
{
    enum role me = thread_role;
    thread_role = ROLE_NONE;
    struct sched_request_info info[4];
    while (sched_list_requests(F.sched, info, 4) > 0)
        usleep(100);
    assert_int_equal(sched_between_steps(F.sched, nothing, NULL), KS_OK);
    thread_role = me;
}

/* Run one request with the n-th allocation of role failing (n = 0: none);
 * true if a failure was injected. A stream is read once its request has
 * generated every token, so its events are cut the same way in every run;
 * its bytes go to a static buffer so the test allocates nothing while armed. */
static bool run(const struct route_case *rc, enum role role, long n, struct answer *a)
{
    static char sse[1 << 20];
    size_t sse_len = 0;
    struct server_req rq = {
        .method = rc->method, .path = rc->path, .body = rc->body ? rc->body : "",
        .len = rc->body ? strlen(rc->body) : 0, .arg = query_arg, .arg_ctx = (void *)rc->query,
    };
    struct reply r = {0};
    if (n > 0)
        arm(role, n);
    server_dispatch(F.srv, &rq, &r);
    bool stream = r.stream_read != NULL;
    if (stream) {
        wait_idle();
        for (;;) {
            assert_true(sse_len + 4096 <= sizeof sse);
            ssize_t k = r.stream_read(r.stream_cls, sse_len, sse + sse_len, 4096);
            if (k < 0)
                break;
            sse_len += (size_t)k;
        }
        r.stream_free(r.stream_cls); /* the HTTP side is done */
        r.stream_free = NULL;
    }
    wait_idle();
    bool hit = n > 0 && disarm();
    a->status = r.status;
    a->len = stream ? sse_len : r.len;
    a->body = malloc(a->len + 1);
    memcpy(a->body, stream ? sse : (r.body ? r.body : ""), a->len);
    a->body[a->len] = '\0';
    reply_free(&r);
    return hit;
}

/* ---- checking answers ------------------------------------------------------------------ */

/* The JSON's shape: keys and types, recursively, values left out (counters
 * and clocks differ from run to run). */
static void shape(const cJSON *j, char *out, size_t cap)
{
    size_t at = strlen(out);
    if (cJSON_IsObject(j) || cJSON_IsArray(j)) {
        snprintf(out + at, cap - at, "%c", cJSON_IsObject(j) ? '{' : '[');
        for (const cJSON *c = j->child; c; c = c->next) {
            at = strlen(out);
            if (c->string)
                snprintf(out + at, cap - at, "%s:", c->string);
            shape(c, out, cap);
        }
        at = strlen(out);
        snprintf(out + at, cap - at, "%c", cJSON_IsObject(j) ? '}' : ']');
        return;
    }
    snprintf(out + at, cap - at, "%d,", j->type & 0xFF);
}

/* A completion's answer is the same in every run but for its id and clock. */
static void drop_volatile(cJSON *j)
{
    cJSON_DeleteItemFromObjectCaseSensitive(j, "id");
    cJSON_DeleteItemFromObjectCaseSensitive(j, "created");
}

/* exact: the JSON itself without id and created; else its shape. */
static char *json_norm(const char *text, bool exact)
{
    cJSON *j = cJSON_Parse(text);
    if (!j)
        return NULL;
    char *s;
    if (exact) {
        drop_volatile(j);
        s = cJSON_PrintUnformatted(j);
    } else {
        s = calloc(1, 1 << 16);
        shape(j, s, 1 << 16);
    }
    cJSON_Delete(j);
    return s;
}

/* A stream's events (without id and created), joined; NULL unless it ends
 * with [DONE]. */
static char *sse_norm(const char *text, bool *error_event)
{
    const char *done = "data: [DONE]\n\n";
    size_t n = strlen(text), dn = strlen(done);
    if (n < dn || strcmp(text + n - dn, done) != 0)
        return NULL;
    char *out = calloc(1, 1 << 20);
    *error_event = false;
    for (const char *p = text; strncmp(p, done, dn) != 0;) {
        assert_memory_equal(p, "data: ", 6);
        const char *end = strstr(p, "\n\n");
        assert_non_null(end);
        char *ev = strndup(p + 6, (size_t)(end - p - 6));
        cJSON *j = cJSON_Parse(ev);
        assert_non_null(j);
        cJSON *e = cJSON_GetObjectItem(j, "error");
        if (e) {
            *error_event = true;
            assert_string_equal(cJSON_GetObjectItem(e, "type")->valuestring, "server_error");
            assert_non_null(strstr(cJSON_GetObjectItem(e, "message")->valuestring, "out of memory"));
            assert_string_equal(cJSON_GetObjectItem(e, "code")->valuestring, "out_of_memory");
        }
        cJSON_Delete(j);
        char *s = json_norm(ev, true);
        assert_true(strlen(out) + strlen(s) + 2 < 1 << 20);
        strcat(out, s);
        strcat(out, "|");
        free(s);
        free(ev);
        p = end + 2;
    }
    return out;
}

/* What a 200 says, to compare with the run without failures: a
 * completion's JSON or events but for ids and clocks, the page's bytes,
 * the metrics' lines without values, the shape of other JSON. NULL for an
 * error (checked here). */
static char *check(const struct route_case *rc, const struct answer *a, bool injected)
{
    if (a->status == 200 && a->len == 0)
        fail_msg("%s: 200 with an empty body", rc->name);
    if (a->status != 200) {
        if (!injected || a->status != 500)
            fail_msg("%s: status %u%s: %s", rc->name, a->status, injected ? " (want 500)" : "", a->body);
        cJSON *j = cJSON_Parse(a->body);
        cJSON *e = cJSON_GetObjectItem(j, "error");
        if (!cJSON_IsString(cJSON_GetObjectItem(e, "message")))
            fail_msg("%s: not an OpenAI error: %s", rc->name, a->body);
        assert_string_equal(cJSON_GetObjectItem(e, "type")->valuestring, "server_error");
        assert_non_null(cJSON_GetObjectItem(e, "code"));
        cJSON_Delete(j);
        return NULL;
    }
    if (rc->stream) {
        bool error_event = false;
        char *s = sse_norm(a->body, &error_event);
        if (!s)
            fail_msg("%s: the stream does not end with [DONE]: %s", rc->name, a->body);
        if (error_event) {
            assert_true(injected);
            free(s);
            return NULL;
        }
        return s;
    }
    if (!strcmp(rc->path, "/"))
        return strdup(a->body); /* the page: the same bytes */
    if (!strcmp(rc->path, "/metrics")) { /* Prometheus text: the same lines, values aside */
        char *s = calloc(1, a->len + 1);
        for (const char *p = a->body; *p; p = strchr(p, '\n') + 1) {
            const char *sp = strrchr(p, ' '), *nl = strchr(p, '\n');
            assert_non_null(nl);
            size_t k = *p == '#' || !sp || sp > nl ? (size_t)(nl - p) : (size_t)(sp - p);
            strncat(s, p, k);
            strcat(s, "\n");
        }
        return s;
    }
    char *s = json_norm(a->body, strstr(rc->path, "completions") != NULL);
    if (!s)
        fail_msg("%s: 200 with a body that is not JSON: %s", rc->name, a->body);
    return s;
}

/* ---- the test ------------------------------------------------------------------------- */

static const struct route_case cases[] = {
    {"GET /health", "GET", "/health", NULL, NULL, false},
    {"GET /v1/models", "GET", "/v1/models", NULL, NULL, false},
    {"GET /metrics", "GET", "/metrics", NULL, NULL, false},
    {"GET /", "GET", "/", NULL, NULL, false},
    {"GET /cache/usage", "GET", "/cache/usage", NULL, NULL, false},
    {"GET /cache/prefixes", "GET", "/cache/prefixes", "limit=5", NULL, false},
    {"POST /v1/completions", "POST", "/v1/completions", NULL,
     "{\"prompt\":\"Once upon a time\",\"max_tokens\":6,\"stop\":[\"\\u0001\"],\"logprobs\":2,\"seed\":1}", false},
    {"POST /v1/completions stream", "POST", "/v1/completions", NULL,
     "{\"prompt\":[1,300,301,302],\"max_tokens\":6,\"stream\":true,\"stream_options\":{\"include_usage\":true},"
     "\"logprobs\":1}", true},
    {"POST /v1/chat/completions", "POST", "/v1/chat/completions", NULL,
     "{\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":"
     "[{\"type\":\"text\",\"text\":\"Hi\"}]}],\"max_tokens\":6,\"logprobs\":true,\"top_logprobs\":2,"
     "\"stop\":\"\\u0001\"}", false},
    {"POST /v1/chat/completions stream", "POST", "/v1/chat/completions", NULL,
     "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_completion_tokens\":70,\"stream\":true,"
     "\"stream_options\":{\"include_usage\":true}}", true},
    {"POST /v1/chat/completions tools", "POST", "/v1/chat/completions", NULL,
     "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"},{\"role\":\"assistant\",\"content\":null,"
     "\"tool_calls\":[{\"id\":\"c\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{\\\"a\\\":1}\"}}]},"
     "{\"role\":\"tool\",\"tool_call_id\":\"c\",\"content\":\"ok\"}],\"tools\":[{\"type\":\"function\","
     "\"function\":{\"name\":\"f\",\"parameters\":{}}}],\"tool_choice\":\"auto\",\"max_tokens\":6,"
     "\"chat_template_kwargs\":{\"x\":1}}", false},
    {"POST /v1/chat/completions tools stream", "POST", "/v1/chat/completions", NULL,
     "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"tools\":[{\"type\":\"function\","
     "\"function\":{\"name\":\"f\",\"parameters\":{}}}],\"max_tokens\":8,\"stream\":true}", true},
    {"POST /apply-template", "POST", "/apply-template", NULL,
     "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Hi\"}]}],"
     "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]}", false},
    {"POST /v1/completions json_schema", "POST", "/v1/completions", NULL,
     "{\"prompt\":\"Hi\",\"max_tokens\":8,\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{"
     "\"name\":\"n\",\"schema\":{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},"
     "\"required\":[\"a\"],\"additionalProperties\":false}}}}", false},
    {"POST /v1/completions grammar", "POST", "/v1/completions", NULL,
     "{\"prompt\":\"Hi\",\"max_tokens\":8,\"grammar\":\"root ::= [a-z]+ (\\\" \\\" [0-9]{1,3})?\"}", false},
    {"POST /cache/requantize", "POST", "/cache/requantize", NULL,
     "{\"type_k\":\"q8_0\",\"type_v\":\"q4_0\",\"scope\":\"all\",\"dry_run\":true}", false},
    {"POST /cache/policy", "POST", "/cache/policy", NULL, "{\"policy\":\"dynamic\",\"high_watermark\":0.9}", false},
    {"POST /cache/clear", "POST", "/cache/clear", NULL, "{\"tier\":\"ram\"}", false},
    {"POST /tokenize", "POST", "/tokenize", NULL,
     "{\"content\":\"Hi <s> there\",\"add_special\":true,\"with_pieces\":true}", false},
    {"POST /detokenize", "POST", "/detokenize", NULL, "{\"tokens\":[1,300,3,240,301]}", false},
    {"GET /props", "GET", "/props", NULL, NULL, false},
    {"GET /slots", "GET", "/slots", NULL, NULL, false},
    {"POST /completion", "POST", "/completion", NULL,
     "{\"prompt\":\"Once upon a time\",\"n_predict\":6,\"stop\":[\"\\u0001\"],\"seed\":1}", false},
};

static void test_route(void **state)
{
    const struct route_case *rc = *state;
    struct answer a;
    assert_false(run(rc, ROLE_NONE, 0, &a));
    if (a.status != 200)
        fail_msg("%s without failures: %u %s", rc->name, a.status, a.body);
    char *want = check(rc, &a, false);
    assert_non_null(want);
    free(a.body);
    static const char *const names[] = {"", "the request's thread", "the scheduler thread"};
    for (enum role role = ROLE_HANDLER; role <= ROLE_SCHED; role++) {
        long n = 1, errors = 0, whole = 0;
        for (;; n++) {
            assert_true(n < 100000);
            bool hit = run(rc, role, n, &a);
            char *got = check(rc, &a, hit);
            if (got) {
                if (strcmp(got, want) != 0)
                    fail_msg("%s, allocation %ld of %s failing: a 200 unlike the one without failures:\n%s\nwant\n%s",
                             rc->name, n, names[role], got, want);
                whole++;
            } else {
                errors++;
            }
            free(got);
            free(a.body);
            if (!hit)
                break;
        }
        print_message("%-34s %s: %ld allocations failed one at a time: %ld errors, %ld complete answers\n", rc->name,
                      names[role], n - 1, errors, whole - 1);
    }
    free(want);
}

/* The first token of a stream cannot be queued (on_event's realloc fails on
 * the scheduler thread): the stream ends with the error event, and the
 * request is cancelled at once (its sequence freed), not generated to its
 * max_tokens. */
static void test_lost_token_cancels(void **state)
{
    (void)state;
    const struct route_case *rc = &cases[9];
    assert_true(rc->stream && strstr(rc->body, "\"max_completion_tokens\":70"));
    struct sched_stats before, after;
    sched_get_stats(F.sched, &before);
    struct answer a;
    assert_true(run(rc, ROLE_SCHED, 1, &a));
    sched_get_stats(F.sched, &after);
    assert_int_equal(a.status, 200);
    assert_non_null(strstr(a.body, "a generated token could not be kept; the request was cancelled"));
    assert_non_null(strstr(a.body, "\"content\":\"\"")); /* the role chunk came before */
    assert_null(strstr(a.body, "\"finish_reason\":\"length\""));
    uint64_t generated = after.generated_tokens - before.generated_tokens;
    print_message("tokens generated before the cancel took effect: %llu of 70\n", (unsigned long long)generated);
    assert_true(generated < 70);
    struct mock_engine_stats ms;
    mock_engine_stats(F.mock, &ms);
    assert_int_equal(ms.n_live, 0);
    free(a.body);
}

int main(void)
{
    const char *path = getenv("KVSERVE_DEFAULT_MODEL");
    if (!path || access(path, R_OK) != 0) {
        printf("skipped: the default model (KVSERVE_DEFAULT_MODEL=%s) is not built\n", path ? path : "");
        return 77;
    }
    enum { N_CASES = sizeof cases / sizeof cases[0] };
    struct CMUnitTest tests[N_CASES + 1];
    for (size_t i = 0; i < N_CASES; i++) {
        struct CMUnitTest t = {cases[i].name, test_route, NULL, NULL, (void *)&cases[i]};
        tests[i] = t;
    }
    struct CMUnitTest lost = cmocka_unit_test(test_lost_token_cancels);
    tests[N_CASES] = lost;
    return _cmocka_run_group_tests("server_errors", tests, N_CASES + 1, setup, teardown);
}
