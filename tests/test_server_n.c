/* n > 1 choices end to end: the built-in default model (KVSERVE_DEFAULT_MODEL,
 * a random tiny model), the real engine and scheduler, and the completion
 * routes driven in-process (server_dispatch). Choice i of a request equals a
 * request of its own with seed + i; the prompt is computed once (the other
 * choices fork its pages); at temperature 0 every choice is the same; a
 * stream carries the same choices as the whole answer; each choice has its
 * own grammar state; under memory pressure (preemption) nothing changes.
 * Skipped (KS_SKIP_EXIT) without the model. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "gguf/gguf.h"
#include "model/model.h"
#include "sched/sched.h"
#include "server/server_internal.h"
#include "kv/kv.h"
#include "support/deadline.h"
#include "support/model_server.h"
#include "support/skip.h"
#include "threads/threads.h"

#define PARALLEL 8

static struct {
    struct model_server ms;
} F;

/* ---- requests ------------------------------------------------------------------------- */

/* A whole answer (status + JSON), or a stream's events parsed (SSE). */
struct answer {
    unsigned status;
    cJSON *json;      /* whole: the body; stream: an array of the events' JSON */
    int n_done;       /* stream: [DONE] lines */
};

static struct answer post_on(struct server *srv, const char *path, const char *body)
{
    struct server_req rq = {.method = "POST", .path = path, .body = body, .len = strlen(body)};
    struct reply r = {0};
    server_dispatch(srv, &rq, &r);
    struct answer a = {.status = r.status};
    if (!r.stream_read) {
        a.json = cJSON_ParseWithLength(r.body, r.len);
        assert_non_null(a.json);
        reply_free(&r);
        return a;
    }
    struct sbuf sse = {0};
    char buf[4096];
    ssize_t k;
    while ((k = r.stream_read(r.stream_cls, sse.n, buf, sizeof buf)) > 0)
        sbuf_append(&sse, buf, (size_t)k);
    reply_free(&r);
    a.json = cJSON_CreateArray();
    for (char *line = sse.p; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
        if (strncmp(line, "data: ", 6))
            continue;
        char *end = strchr(line, '\n');
        if (!strncmp(line + 6, "[DONE]", 6))
            a.n_done++;
        else
            cJSON_AddItemToArray(a.json, cJSON_ParseWithLength(line + 6, (size_t)(end - line - 6)));
    }
    sbuf_free(&sse);
    return a;
}

/* Post a malloc'd body to the test's server, and free it. */
static struct answer post(const char *path, char *body)
{
    struct answer a = post_on(F.ms.srv, path, body);
    free(body);
    return a;
}

static const cJSON *choice(const cJSON *j, int i)
{
    return cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), i);
}

static const char *text_of(const cJSON *ch, bool chat)
{
    const cJSON *t = chat ? cJSON_GetObjectItem(cJSON_GetObjectItem(ch, "message"), "content")
                          : cJSON_GetObjectItem(ch, "text");
    return cJSON_IsString(t) ? t->valuestring : "";
}

static const char *finish_of(const cJSON *ch)
{
    const cJSON *f = cJSON_GetObjectItem(ch, "finish_reason");
    return cJSON_IsString(f) ? f->valuestring : "";
}

static int usage_of(const cJSON *j, const char *key)
{
    return (int)cJSON_GetObjectItem(cJSON_GetObjectItem(j, "usage"), key)->valuedouble;
}

static char *completion_body(const char *prompt, int n, int seed, double temp, int max_tokens, const char *extra)
{
    char *b = malloc(1024);
    snprintf(b, 1024, "{\"prompt\":\"%s\",\"n\":%d,\"seed\":%d,\"temperature\":%g,\"max_tokens\":%d%s}", prompt, n,
             seed, temp, max_tokens, extra);
    return b;
}

static char *chat_body(const char *user, int n, int seed, double temp, int max_tokens, const char *extra)
{
    char *b = malloc(1024);
    snprintf(b, 1024,
             "{\"messages\":[{\"role\":\"user\",\"content\":\"%s\"}],\"n\":%d,\"seed\":%d,\"temperature\":%g,"
             "\"max_tokens\":%d%s}",
             user, n, seed, temp, max_tokens, extra);
    return b;
}

static char *request_body(bool chat, const char *text, int n, int seed, double temp, int max_tokens, const char *extra)
{
    return chat ? chat_body(text, n, seed, temp, max_tokens, extra)
                : completion_body(text, n, seed, temp, max_tokens, extra);
}

static struct sched_stats stats(void)
{
    struct sched_stats st;
    sched_get_stats(F.ms.sched, &st);
    return st;
}

/* ---- tests ---------------------------------------------------------------------------- */

/* Choice i equals a separate n=1 request with seed + i, text, finish and
 * logprobs bit for bit (the choices decode in a batch of 3, the lone twin
 * alone and after a prefix-cache hit of all but its last prompt token); the
 * prompt is computed once and counted once. */
static void check_choices_match_single(bool chat)
{
    enum { N = 3, SEED = 41 };
    const char *path = chat ? "/v1/chat/completions" : "/v1/completions";
    const char *extra = chat ? ",\"logprobs\":true,\"top_logprobs\":2" : ",\"logprobs\":2";
    const char *prompt = chat ? "Tell me a story about forks" : "Three bears went to a fork in the road";
    struct sched_stats before = stats();
    struct answer all = post(path, request_body(chat, prompt, N, SEED, 1.0, 40, extra));
    struct sched_stats after = stats();
    assert_int_equal(all.status, 200);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(all.json, "choices")), N);
    int n_prompt = usage_of(all.json, "prompt_tokens"), sum = 0;
    assert_int_equal(after.forked_choices - before.forked_choices, N - 1);
    assert_true(after.prompt_tokens - before.prompt_tokens <= (uint64_t)n_prompt); /* once (less what was cached) */
    for (int i = 0; i < N; i++) {
        const cJSON *ch = choice(all.json, i);
        assert_int_equal((int)cJSON_GetObjectItem(ch, "index")->valuedouble, i);
        struct answer one = post(path, request_body(chat, prompt, 1, SEED + i, 1.0, 40, extra));
        assert_int_equal(one.status, 200);
        const cJSON *ch1 = choice(one.json, 0);
        if (strcmp(text_of(ch, chat), text_of(ch1, chat)))
            print_message("choice %d: '%s'\n  alone: '%s'\n", i, text_of(ch, chat), text_of(ch1, chat));
        assert_string_equal(text_of(ch, chat), text_of(ch1, chat));
        assert_string_equal(finish_of(ch), finish_of(ch1));
        assert_true(cJSON_Compare(cJSON_GetObjectItem(ch, "logprobs"), cJSON_GetObjectItem(ch1, "logprobs"), true));
        sum += usage_of(one.json, "completion_tokens");
        cJSON_Delete(one.json);
    }
    assert_int_equal(usage_of(all.json, "completion_tokens"), sum);
    assert_int_equal(usage_of(all.json, "total_tokens"), n_prompt + sum);
    cJSON_Delete(all.json);
}

static void test_choices_match_single_requests(void **state)
{
    (void)state;
    check_choices_match_single(false);
    check_choices_match_single(true);
}

static void test_temperature_zero_all_equal(void **state)
{
    (void)state;
    struct answer a = post("/v1/completions", completion_body("Once upon a time", 4, 5, 0.0, 30, ""));
    assert_int_equal(a.status, 200);
    for (int i = 1; i < 4; i++)
        assert_string_equal(text_of(choice(a.json, i), false), text_of(choice(a.json, 0), false));
    assert_true(strlen(text_of(choice(a.json, 0), false)) > 0);
    cJSON_Delete(a.json);
}

/* The stream's chunks, put together per index, are the whole answer's
 * choices; each choice ends once; one usage chunk, one [DONE]. */
static void check_stream_agrees(bool chat)
{
    enum { N = 3 };
    const char *path = chat ? "/v1/chat/completions" : "/v1/completions";
    struct answer whole = post(path, request_body(chat, "Hi there", N, 9, 1.0, 30, ""));
    const char *streaming = ",\"stream\":true,\"stream_options\":{\"include_usage\":true}";
    struct answer stream = post(path, request_body(chat, "Hi there", N, 9, 1.0, 30, streaming));
    assert_int_equal(whole.status, 200);
    assert_int_equal(stream.status, 200);
    assert_int_equal(stream.n_done, 1);
    struct sbuf text[N] = {{0}};
    int finishes[N] = {0}, usages = 0;
    const cJSON *ev;
    cJSON_ArrayForEach(ev, stream.json) {
        const cJSON *ch = choice(ev, 0);
        if (cJSON_GetObjectItem(ev, "usage")) {
            usages++;
            assert_int_equal(usage_of(ev, "completion_tokens"), usage_of(whole.json, "completion_tokens"));
            assert_int_equal(usage_of(ev, "prompt_tokens"), usage_of(whole.json, "prompt_tokens"));
        }
        if (!ch)
            continue;
        int i = (int)cJSON_GetObjectItem(ch, "index")->valuedouble;
        assert_true(i >= 0 && i < N);
        assert_int_equal(finishes[i], 0); /* nothing after a choice's end */
        const cJSON *piece = chat ? cJSON_GetObjectItem(cJSON_GetObjectItem(ch, "delta"), "content")
                                  : cJSON_GetObjectItem(ch, "text");
        if (cJSON_IsString(piece))
            sbuf_append(&text[i], piece->valuestring, strlen(piece->valuestring));
        if (cJSON_IsString(cJSON_GetObjectItem(ch, "finish_reason"))) {
            finishes[i]++;
            assert_string_equal(finish_of(ch), finish_of(choice(whole.json, i)));
        }
    }
    assert_int_equal(usages, 1);
    for (int i = 0; i < N; i++) {
        assert_int_equal(finishes[i], 1);
        sbuf_append(&text[i], "", 0);
        assert_string_equal(text[i].p ? text[i].p : "", text_of(choice(whole.json, i), chat));
        sbuf_free(&text[i]);
    }
    cJSON_Delete(whole.json);
    cJSON_Delete(stream.json);
}

static void test_stream_agrees_with_whole(void **state)
{
    (void)state;
    check_stream_agrees(false);
    check_stream_agrees(true);
}

/* Several prompts in one /v1/completions request (OpenAI's list of
 * strings or of token-id lists): choice p * n + j is prompt p's choice j,
 * equal to a request of that prompt alone with seed + j; usage counts each
 * prompt once; the stream carries the same texts; limits are 400s. */
static void test_several_prompts(void **state)
{
    (void)state;
    enum { N = 2, SEED = 17 };
    static const char *const prompts[] = {"Once upon a time", "The little dog", "[1,300,20]"};
    const char *list = "[\"Once upon a time\",\"The little dog\",[1,300,20]]";
    char body[512];
    snprintf(body, sizeof body, "{\"prompt\":%s,\"n\":%d,\"seed\":%d,\"temperature\":1.0,\"max_tokens\":20}", list,
             N, SEED);
    struct answer all = post_on(F.ms.srv, "/v1/completions", body);
    assert_int_equal(all.status, 200);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(all.json, "choices")), 3 * N);
    int prompt_sum = 0, completion_sum = 0;
    for (int p = 0; p < 3; p++) {
        for (int j = 0; j < N; j++) {
            char one_body[512];
            bool ids = prompts[p][0] == '[';
            snprintf(one_body, sizeof one_body,
                     "{\"prompt\":%s%s%s,\"seed\":%d,\"temperature\":1.0,\"max_tokens\":20}", ids ? "" : "\"",
                     prompts[p], ids ? "" : "\"", SEED + j);
            struct answer one = post_on(F.ms.srv, "/v1/completions", one_body);
            assert_int_equal(one.status, 200);
            const cJSON *ch = choice(all.json, p * N + j);
            assert_int_equal((int)cJSON_GetObjectItem(ch, "index")->valuedouble, p * N + j);
            assert_string_equal(text_of(ch, false), text_of(choice(one.json, 0), false));
            if (j == 0)
                prompt_sum += usage_of(one.json, "prompt_tokens");
            completion_sum += usage_of(one.json, "completion_tokens");
            cJSON_Delete(one.json);
        }
    }
    assert_int_equal(usage_of(all.json, "prompt_tokens"), prompt_sum);
    assert_int_equal(usage_of(all.json, "completion_tokens"), completion_sum);
    snprintf(body, sizeof body,
             "{\"prompt\":%s,\"n\":%d,\"seed\":%d,\"temperature\":1.0,\"max_tokens\":20,\"stream\":true}", list, N,
             SEED);
    struct answer stream = post_on(F.ms.srv, "/v1/completions", body);
    assert_int_equal(stream.status, 200);
    assert_int_equal(stream.n_done, 1);
    struct sbuf text[3 * N] = {{0}};
    const cJSON *ev;
    cJSON_ArrayForEach(ev, stream.json) {
        const cJSON *ch = choice(ev, 0);
        const cJSON *piece = ch ? cJSON_GetObjectItem(ch, "text") : NULL;
        int i = ch ? (int)cJSON_GetObjectItem(ch, "index")->valuedouble : -1;
        assert_true(!ch || (i >= 0 && i < 3 * N));
        if (cJSON_IsString(piece))
            sbuf_append(&text[i], piece->valuestring, strlen(piece->valuestring));
    }
    for (int i = 0; i < 3 * N; i++) {
        sbuf_append(&text[i], "", 0);
        assert_string_equal(text[i].p, text_of(choice(all.json, i), false));
        sbuf_free(&text[i]);
    }
    cJSON_Delete(stream.json);
    cJSON_Delete(all.json);
    static const char *const bad[] = {
        "{\"prompt\":[\"a\",\"b\"],\"n\":9}",      /* 18 choices */
        "{\"prompt\":[\"a\",5]}",                   /* a prompt that is neither text nor ids */
        "{\"prompt\":[\"a\",\"b\",\"c\",\"d\",\"e\",\"f\",\"g\",\"h\",\"i\",\"j\",\"k\",\"l\",\"m\",\"n\",\"o\",\"p\",\"q\"]}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        struct answer a = post_on(F.ms.srv, "/v1/completions", bad[i]);
        assert_int_equal(a.status, 400);
        cJSON_Delete(a.json);
    }
}

/* llama-server's /completion with several prompts: an array of its answers
 * in prompt order, each equal to that prompt sent alone; the stream's events
 * carry each prompt's index and add up to the same texts. */
static void test_several_prompts_native(void **state)
{
    (void)state;
    static const char *const prompts[] = {"\"Once upon a time\"", "[1,300,20]"};
    const char *body = "{\"prompt\":[\"Once upon a time\",[1,300,20]],\"n_predict\":12,\"temperature\":0}";
    struct answer all = post_on(F.ms.srv, "/completion", body);
    assert_int_equal(all.status, 200);
    assert_true(cJSON_IsArray(all.json));
    assert_int_equal(cJSON_GetArraySize(all.json), 2);
    for (int p = 0; p < 2; p++) {
        char one_body[256];
        snprintf(one_body, sizeof one_body, "{\"prompt\":%s,\"n_predict\":12,\"temperature\":0}", prompts[p]);
        struct answer one = post_on(F.ms.srv, "/completion", one_body);
        assert_int_equal(one.status, 200);
        const cJSON *got = cJSON_GetArrayItem(all.json, p);
        assert_int_equal((int)cJSON_GetObjectItem(got, "index")->valuedouble, p);
        assert_string_equal(cJSON_GetObjectItem(got, "content")->valuestring,
                            cJSON_GetObjectItem(one.json, "content")->valuestring);
        assert_int_equal((int)cJSON_GetObjectItem(got, "tokens_evaluated")->valuedouble,
                         (int)cJSON_GetObjectItem(one.json, "tokens_evaluated")->valuedouble);
        cJSON_Delete(one.json);
    }
    struct answer stream = post_on(F.ms.srv, "/completion",
                                   "{\"prompt\":[\"Once upon a time\",[1,300,20]],\"n_predict\":12,\"temperature\":0,"
                                   "\"stream\":true}");
    assert_int_equal(stream.status, 200);
    struct sbuf text[2] = {{0}};
    int stops[2] = {0};
    const cJSON *ev;
    cJSON_ArrayForEach(ev, stream.json) {
        int i = (int)cJSON_GetObjectItem(ev, "index")->valuedouble;
        assert_true(i == 0 || i == 1);
        const char *piece = cJSON_GetObjectItem(ev, "content")->valuestring;
        sbuf_append(&text[i], piece, strlen(piece));
        stops[i] += cJSON_IsTrue(cJSON_GetObjectItem(ev, "stop"));
    }
    for (int i = 0; i < 2; i++) {
        sbuf_append(&text[i], "", 0);
        assert_int_equal(stops[i], 1);
        assert_string_equal(text[i].p, cJSON_GetObjectItem(cJSON_GetArrayItem(all.json, i), "content")->valuestring);
        sbuf_free(&text[i]);
    }
    cJSON_Delete(stream.json);
    cJSON_Delete(all.json);
}

/* Each choice has its own grammar state: every one is a JSON object. */
static void test_choices_each_follow_the_grammar(void **state)
{
    (void)state;
    const char *json_object = ",\"response_format\":{\"type\":\"json_object\"}";
    struct answer a = post("/v1/chat/completions", chat_body("An object please", 4, 3, 1.0, 200, json_object));
    assert_int_equal(a.status, 200);
    for (int i = 0; i < 4; i++) {
        cJSON *out = cJSON_Parse(text_of(choice(a.json, i), true));
        if (!cJSON_IsObject(out))
            print_message("choice %d: %s\n", i, text_of(choice(a.json, i), true));
        assert_true(cJSON_IsObject(out));
        cJSON_Delete(out);
    }
    cJSON_Delete(a.json);
}

/* A client that goes away mid-stream cancels every choice. */
static void test_disconnect_cancels_all(void **state)
{
    (void)state;
    struct sched_stats before = stats();
    char *body = completion_body("Keep going", 3, 1, 1.0, 900, ",\"stream\":true,\"ignore_eos\":true");
    struct server_req rq = {.method = "POST", .path = "/v1/completions", .body = body, .len = strlen(body)};
    struct reply r = {0};
    server_dispatch(F.ms.srv, &rq, &r);
    assert_non_null(r.stream_read);
    char buf[256];
    for (int i = 0; i < 12; i++) /* the role-less first chunks of each choice, some tokens */
        assert_true(r.stream_read(r.stream_cls, 0, buf, sizeof buf) > 0);
    reply_free(&r); /* the HTTP side lets go, as when the connection drops */
    free(body);
    KS_WAIT_UNTIL(stats().n_running == 0 && stats().n_waiting == 0 && server_in_flight(F.ms.srv) == 0,
                  "every choice to be cancelled");
    assert_true(stats().generated_tokens - before.generated_tokens < 3 * 900);
}

static void test_limits(void **state)
{
    (void)state;
    static const struct {
        const char *body, *says;
    } bad[] = {
        {"{\"prompt\":\"x\",\"n\":17}", "'n' must be in [1, 16]"},
        {"{\"prompt\":\"x\",\"n\":0}", "'n' must be in [1, 16]"},
        {"{\"prompt\":\"x\",\"n\":9}", "--parallel (8)"}, /* more than run at once */
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        struct answer a = post_on(F.ms.srv, "/v1/completions", bad[i].body);
        const char *msg = cJSON_GetStringValue(cJSON_GetObjectItem(cJSON_GetObjectItem(a.json, "error"), "message"));
        if (a.status != 400 || !msg || !strstr(msg, bad[i].says))
            print_message("%s -> %u %s\n", bad[i].body, a.status, msg ? msg : "");
        assert_int_equal(a.status, 400);
        assert_non_null(strstr(msg, bad[i].says));
        cJSON_Delete(a.json);
    }
}

/* Several n=4 requests on a cache too small for all of them: choices are
 * preempted and recomputed while their siblings keep the shared pages, and
 * every choice still runs to its max_tokens. (Its text is not compared with
 * a roomy server's: a recomputed sequence's K/V come from a prefill, whose
 * float sums differ slightly from decode's, and at temperature 1 a draw may
 * flip; the mock engine's test_sched checks exact tokens under preemption.
 * ASan checks that no choice reads a freed page.) */
struct pressure_job {
    struct server *srv;
    int seed;
    struct answer a;
};

static void *pressure_worker(void *arg)
{
    struct pressure_job *j = arg;
    char *body = completion_body("The long road to the fork in the forest went on and on", 4, j->seed, 1.0, 120,
                                 ",\"ignore_eos\":true");
    j->a = post_on(j->srv, "/v1/completions", body);
    free(body);
    return NULL;
}

static void test_choices_under_preemption(void **state)
{
    (void)state;
    enum { JOBS = 2 };
    struct sched *small_sched;
    struct server *small;
    struct model_server_config mc = {.model = F.ms.model, .tok = F.ms.tok, .pool = F.ms.pool, .kv_budget = 0,
                                     .parallel = PARALLEL, .ctx_size = 1024};
    struct kv_config kc;
    model_kv_config(F.ms.model, &kc);
    mc.kv_budget = (size_t)14 * kv_page_bytes(&kc, kc.type_k, kc.type_v); /* 8 sequences need more */
    assert_int_equal(model_server_start(&mc, &small_sched, &small), 0);
    struct pressure_job jobs[JOBS];
    pthread_t th[JOBS];
    for (int i = 0; i < JOBS; i++) {
        jobs[i] = (struct pressure_job){.srv = small, .seed = 100 + i};
        assert_int_equal(pthread_create(&th[i], NULL, pressure_worker, &jobs[i]), 0);
    }
    for (int i = 0; i < JOBS; i++)
        pthread_join(th[i], NULL);
    struct sched_stats st;
    sched_get_stats(small_sched, &st);
    model_server_stop(small_sched, small);
    print_message("preemptions %llu, forks %llu\n", (unsigned long long)st.preemptions,
                  (unsigned long long)st.forked_choices);
    assert_true(st.preemptions > 0);
    assert_true(st.forked_choices > 0);
    for (int i = 0; i < JOBS; i++) {
        assert_int_equal(jobs[i].a.status, 200);
        assert_int_equal(usage_of(jobs[i].a.json, "completion_tokens"), 4 * 120);
        for (int c = 0; c < 4; c++)
            assert_string_equal(finish_of(choice(jobs[i].a.json, c)), "length");
        cJSON_Delete(jobs[i].a.json);
    }
}

/* ---- setup ---------------------------------------------------------------------------- */

static int setup(void **state)
{
    (void)state;
    const char *path = getenv("KVSERVE_DEFAULT_MODEL");
    if (model_server_load(path, &F.ms))
        return -1;
    struct model_server_config mc = {.model = F.ms.model, .tok = F.ms.tok, .pool = F.ms.pool, .kv_budget = 128u << 20,
                                     .parallel = PARALLEL, .ctx_size = 1024};
    return model_server_start(&mc, &F.ms.sched, &F.ms.srv);
}

static int teardown(void **state)
{
    (void)state;
    model_server_stop(F.ms.sched, F.ms.srv);
    model_server_unload(&F.ms);
    return 0;
}

int main(void)
{
    const char *path = getenv("KVSERVE_DEFAULT_MODEL");
    if (!path || access(path, R_OK) != 0)
        return ks_skip_all("the default model (KVSERVE_DEFAULT_MODEL=%s) is not built", path ? path : "");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_limits),
        cmocka_unit_test(test_choices_match_single_requests),
        cmocka_unit_test(test_temperature_zero_all_equal),
        cmocka_unit_test(test_stream_agrees_with_whole),
        cmocka_unit_test(test_several_prompts),
        cmocka_unit_test(test_several_prompts_native),
        cmocka_unit_test(test_choices_each_follow_the_grammar),
        cmocka_unit_test(test_disconnect_cancels_all),
        cmocka_unit_test(test_choices_under_preemption),
    };
    return ks_run_tests(tests, setup, teardown);
}
