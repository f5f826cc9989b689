/* The HTTP layer in-process: a real tokenizer (stories260K's vocabulary, or
 * without ../shared the build's default model's: both are 512-token
 * SentencePiece vocabularies), the real scheduler, and a mock engine whose next token is a pure function of the
 * sequence's history, so every response has a known answer. The client of
 * tools/httpc (libcurl, its SSE parser) and cJSON check routes, errors,
 * streaming, stop strings and concurrency. */
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
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cjson/cJSON.h>

#include "gguf/gguf.h"
#include "httpc/httpc.h"
#include "kv/kv.h"
#include "server/server.h"
#include "support/deadline.h"
#include "support/mock_engine.h"
#include "support/skip.h"

#define CTX 256

/* ---- mock engine (tests/support/mock_engine.h) over the tokenizer's vocabulary ---- */

/* Ids from 300 on (past the control and byte tokens), so the text is readable. */
static struct mock_engine_config mock_config(int32_t n_vocab)
{
    struct mock_engine_config mc = {.n_vocab = n_vocab, .first_token = 300, .max_seqs = 64, .max_ctx = CTX + 8,
                                    .kv_pages = 64, .step_sleep_us = 200 /* let requests overlap */};
    return mc;
}

static struct sched *mock_sched_slow(int32_t n_vocab, int max_queue, int parallel, unsigned step_sleep_us)
{
    struct mock_engine_config mc = mock_config(n_vocab);
    mc.step_sleep_us = step_sleep_us;
    struct mock_engine *m = NULL;
    assert_int_equal(mock_engine_create(&mc, &m), KS_OK);
    struct sched_engine e = mock_engine_sched(m, true);
    struct sched_config cfg;
    sched_config_default(&cfg);
    cfg.parallel = parallel;
    cfg.max_batch_tokens = 64;
    cfg.prefill_chunk = 16;
    cfg.ctx_size = CTX;
    cfg.max_queue = max_queue;
    struct sched *s = NULL;
    assert_int_equal(sched_create(&cfg, &e, &s), KS_OK);
    return s;
}

static struct sched *mock_sched(int32_t n_vocab, int max_queue)
{
    return mock_sched_slow(n_vocab, max_queue, 8, 200);
}

/* ---- fixture ------------------------------------------------------------------- */

struct fx {
    char vocab_path[4096];
    struct gguf_file *vocab;
    struct tokenizer *tok;
    struct sched *sched, *sched_full, *sched_slow;
    struct server *srv, *srv_key, *srv_full, *srv_slow;
};

static struct fx F;

static struct server *start_server(struct sched *s, const char *key)
{
    struct server_config cfg;
    server_config_default(&cfg);
    cfg.port = 0;
    cfg.api_key = key;
    cfg.max_body = 64 * 1024;
    cfg.ctx_size = CTX;
    cfg.model_name = "mock";
    struct server *srv = NULL;
    assert_int_equal(server_start(&cfg, s, F.tok, &srv), KS_OK);
    server_set_ready(srv, true);
    return srv;
}

/* stories260K.gguf under $KVSERVE_SHARED/models, else $KVSERVE_DEFAULT_MODEL. */
static bool find_vocab(void)
{
    const char *shared = getenv("KVSERVE_SHARED"), *fallback = getenv("KVSERVE_DEFAULT_MODEL");
    snprintf(F.vocab_path, sizeof F.vocab_path, "%s/models/stories260K.gguf", shared ? shared : "../shared");
    if (access(F.vocab_path, R_OK) == 0)
        return true;
    if (fallback && access(fallback, R_OK) == 0) {
        printf("no %s: using the default model's vocabulary %s\n", F.vocab_path, fallback);
        snprintf(F.vocab_path, sizeof F.vocab_path, "%s", fallback);
        return true;
    }
    return false;
}

static int setup(void **state)
{
    (void)state;
    if (gguf_open(F.vocab_path, &F.vocab) || tok_load(F.vocab, &F.tok)) {
        fprintf(stderr, "setup: %s: %s\n", F.vocab_path, ks_errmsg());
        return -1;
    }
    F.sched = mock_sched(tok_n_vocab(F.tok), 256);
    F.sched_full = mock_sched(tok_n_vocab(F.tok), 0);
    F.srv = start_server(F.sched, NULL);
    F.srv_key = start_server(F.sched, "sekret");
    F.srv_full = start_server(F.sched_full, NULL);
    /* one sequence at a time, 20 ms a step: an abandoned request holds the only slot */
    F.sched_slow = mock_sched_slow(tok_n_vocab(F.tok), 1, 1, 20000);
    F.srv_slow = start_server(F.sched_slow, NULL);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    server_stop(F.srv);
    server_stop(F.srv_key);
    server_stop(F.srv_full);
    sched_cancel_all(F.sched_slow);
    for (int i = 0; i < 500 && server_in_flight(F.srv_slow) > 0; i++)
        usleep(10000);
    server_stop(F.srv_slow);
    sched_free(F.sched_slow);
    sched_free(F.sched);
    sched_free(F.sched_full);
    tok_free(F.tok);
    gguf_close(F.vocab);
    return 0;
}


/* ---- HTTP through tools/httpc, JSON through cJSON ----------------------------------- */

/* One request: the whole response, whatever its status. header: NULL or one
 * "Name: value" line. */
static struct httpc_response http(struct server *srv, const char *method, const char *path, const char *header,
                                  const char *body, size_t body_len)
{
    char url[256];
    snprintf(url, sizeof url, "http://127.0.0.1:%d%s", server_port(srv), path);
    const char *headers[] = {header, NULL};
    /* a server that never answers fails the test instead of hanging it */
    struct httpc_request rq = {.method = method, .url = url, .headers = headers, .body = body, .body_len = body_len,
                               .timeout_s = KS_WAIT_SECONDS};
    struct httpc_response r;
    ks_status st = httpc_request(&rq, &r);
    if (st)
        print_message("%s %s: %s\n", method, path, ks_errmsg());
    assert_int_equal(st, KS_OK);
    return r;
}

static struct httpc_response post(struct server *srv, const char *path, const char *json)
{
    return http(srv, "POST", path, NULL, json, strlen(json));
}

/* The body as JSON (the caller deletes it). */
static cJSON *json_of(const struct httpc_response *r)
{
    cJSON *j = cJSON_ParseWithLength(r->body, r->len);
    if (!j)
        print_message("not JSON (%ld): %s\n", r->status, r->body);
    assert_non_null(j);
    return j;
}

static double json_num(const cJSON *o, const char *k)
{
    const cJSON *v = cJSON_GetObjectItem(o, k);
    assert_true(cJSON_IsNumber(v));
    return v->valuedouble;
}

static const char *json_str(const cJSON *o, const char *k)
{
    const cJSON *v = cJSON_GetObjectItem(o, k);
    assert_true(cJSON_IsString(v));
    return v->valuestring;
}

/* The value of one series ("name" or "name{labels}") of a Prometheus text body. */
static bool metric(const char *body, const char *series, double *value)
{
    size_t n = strlen(series);
    for (const char *line = body; *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : line + strlen(line))
        if (!strncmp(line, series, n) && line[n] == ' ') {
            *value = strtod(line + n + 1, NULL);
            return true;
        }
    return false;
}

/* Status and OpenAI error shape; returns the message (the caller frees it). */
static char *expect_error_message(struct httpc_response r, int status, const char *code)
{
    if (r.status != status)
        print_message("unexpected %ld: %s\n", r.status, r.body);
    assert_int_equal(r.status, status);
    cJSON *j = json_of(&r);
    cJSON *e = cJSON_GetObjectItem(j, "error");
    assert_true(cJSON_IsObject(e));
    char *message = strdup(json_str(e, "message"));
    assert_true(cJSON_IsString(cJSON_GetObjectItem(e, "type")));
    assert_non_null(cJSON_GetObjectItem(e, "code"));
    if (code)
        assert_string_equal(json_str(e, "code"), code);
    cJSON_Delete(j);
    httpc_response_free(&r);
    return message;
}

static void expect_error(struct httpc_response r, int status, const char *code)
{
    free(expect_error_message(r, status, code));
}

/* The text the mock model produces for these prompt ids. */
static char *expected_text(const int32_t *prompt, int n_prompt, int n_gen)
{
    int32_t gen[CTX];
    struct mock_engine_config mc = mock_config(tok_n_vocab(F.tok));
    mock_engine_generate(&mc, prompt, n_prompt, n_gen, gen);
    struct tok_stream *st;
    tok_stream_create(F.tok, TOK_DECODE_REPLACE_BAD, &st);
    size_t cap = 4096, len = 0;
    char *out = calloc(1, cap);
    for (int i = 0; i < n_gen; i++) {
        const char *b;
        size_t n;
        tok_stream_push(st, gen[i], &b, &n);
        memcpy(out + len, b, n);
        len += n;
    }
    const char *b;
    size_t n;
    tok_stream_flush(st, &b, &n);
    memcpy(out + len, b, n);
    tok_stream_free(st);
    return out;
}

/* What a completion stream said, read event by event with the SSE parser. */
struct stream {
    bool chat;
    char *text;             /* the text (chat: delta.content) of the events, joined */
    size_t len, cap;
    char finish[32];        /* the last finish_reason */
    char role[16];          /* the first delta.role */
    int completion_tokens;  /* from the usage event; -1 without one */
    int cached_tokens;      /* its prompt_tokens_details.cached_tokens; -1 without */
    int n_events, finish_at, usage_at; /* events; the index of the last finish_reason and of usage */
};

static ks_status on_stream_event(void *user, const char *data, size_t len)
{
    struct stream *s = user;
    cJSON *j = cJSON_ParseWithLength(data, len);
    if (!j)
        print_message("event %d is not JSON: %s\n", s->n_events, data);
    assert_non_null(j);
    cJSON *u = cJSON_GetObjectItem(j, "usage");
    if (cJSON_IsObject(u)) {
        s->completion_tokens = (int)json_num(u, "completion_tokens");
        cJSON *c = cJSON_GetObjectItem(cJSON_GetObjectItem(u, "prompt_tokens_details"), "cached_tokens");
        s->cached_tokens = cJSON_IsNumber(c) ? c->valueint : -1;
        s->usage_at = s->n_events;
    }
    cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    if (ch) {
        cJSON *delta = cJSON_GetObjectItem(ch, "delta");
        cJSON *t = s->chat ? cJSON_GetObjectItem(delta, "content") : cJSON_GetObjectItem(ch, "text");
        if (cJSON_IsString(t)) {
            size_t n = strlen(t->valuestring);
            if (s->len + n + 1 > s->cap) {
                while (s->len + n + 1 > s->cap)
                    s->cap *= 2;
                s->text = realloc(s->text, s->cap);
            }
            memcpy(s->text + s->len, t->valuestring, n + 1);
            s->len += n;
        }
        cJSON *role = cJSON_GetObjectItem(delta, "role");
        if (cJSON_IsString(role) && !s->role[0])
            snprintf(s->role, sizeof s->role, "%s", role->valuestring);
        cJSON *f = cJSON_GetObjectItem(ch, "finish_reason");
        if (cJSON_IsString(f)) {
            snprintf(s->finish, sizeof s->finish, "%s", f->valuestring);
            s->finish_at = s->n_events;
        }
    }
    s->n_events++;
    cJSON_Delete(j);
    return KS_OK;
}

/* Read a streamed response (and free it): every event is JSON, and [DONE] ends it. */
static struct stream read_stream(struct httpc_response r, bool chat)
{
    struct stream s = {.chat = chat, .cap = 256, .completion_tokens = -1, .cached_tokens = -1, .finish_at = -1,
                       .usage_at = -1};
    s.text = calloc(1, s.cap);
    struct httpc_sse *p;
    assert_int_equal(httpc_sse_create(1 << 20, on_stream_event, &s, &p), KS_OK);
    assert_int_equal(httpc_sse_feed(p, r.body, r.len), KS_OK);
    assert_int_equal(httpc_sse_end(p), KS_OK);
    assert_true(httpc_sse_done(p));
    httpc_sse_free(p);
    httpc_response_free(&r);
    return s;
}

/* ---- tests ------------------------------------------------------------------------ */

static void test_health_models_404(void **state)
{
    (void)state;
    struct httpc_response r = http(F.srv, "GET", "/health", NULL, NULL, 0);
    assert_int_equal(r.status, 200);
    cJSON *j = json_of(&r);
    assert_string_equal(json_str(j, "status"), "ok");
    cJSON_Delete(j);
    httpc_response_free(&r);
    r = http(F.srv, "GET", "/v1/models", NULL, NULL, 0);
    assert_int_equal(r.status, 200);
    j = json_of(&r);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(j, "data")), 1);
    assert_string_equal(json_str(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "data"), 0), "id"), "mock");
    cJSON_Delete(j);
    httpc_response_free(&r);
    expect_error(http(F.srv, "GET", "/nope", NULL, NULL, 0), 404, "not_found");
    expect_error(http(F.srv, "GET", "/v1/completions", NULL, NULL, 0), 405, NULL);
    r = http(F.srv, "GET", "/", NULL, NULL, 0);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "<canvas")); /* HTML, not JSON */
    httpc_response_free(&r);
}

/* One request to port: the whole response. */
static struct httpc_response http_port(int port, const char *method, const char *path, const char *body)
{
    char url[256];
    snprintf(url, sizeof url, "http://127.0.0.1:%d%s", port, path);
    const char *headers[] = {"Content-Type: application/json", NULL};
    struct httpc_request rq = {.method = method, .url = url, .headers = headers, .body = body,
                               .body_len = body ? strlen(body) : 0, .timeout_s = KS_WAIT_SECONDS};
    struct httpc_response r;
    assert_int_equal(httpc_request(&rq, &r), KS_OK);
    return r;
}

/* GET /health on an open keep-alive connection: the whole answer in buf. */
static void health_on(int fd, char *buf, size_t cap)
{
    static const char rq[] = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
    assert_int_equal(write(fd, rq, sizeof rq - 1), (ssize_t)(sizeof rq - 1));
    size_t n = 0;
    buf[0] = 0;
    while (n + 1 < cap && !(strstr(buf, "\r\n\r\n") && strchr(strstr(buf, "\r\n\r\n"), '}'))) {
        ssize_t k = read(fd, buf + n, cap - 1 - n);
        assert_true(k > 0);
        n += (size_t)k;
        buf[n] = 0;
    }
}

/* While the model loads the port answers llama-server's 503 on every route;
 * then the server proper serves the same socket. */
static void test_loading_then_ready(void **state)
{
    (void)state;
    struct server_loading *l = NULL;
    assert_int_equal(server_loading_start("127.0.0.1", 0, &l), KS_OK);
    int port = server_loading_port(l);
    assert_true(port > 0);
    static const char *const paths[][3] = {{"GET", "/health", NULL}, {"GET", "/v1/models", NULL},
                                           {"POST", "/v1/completions", "{\"prompt\": \"hi\"}"}};
    for (size_t i = 0; i < sizeof paths / sizeof *paths; i++) {
        struct httpc_response r = http_port(port, paths[i][0], paths[i][1], paths[i][2]);
        assert_int_equal(r.status, 503);
        cJSON *j = json_of(&r);
        cJSON *e = cJSON_GetObjectItem(j, "error");
        assert_string_equal(json_str(e, "message"), "Loading model");
        assert_string_equal(json_str(e, "type"), "unavailable_error");
        assert_int_equal((int)json_num(e, "code"), 503);
        cJSON_Delete(j);
        httpc_response_free(&r);
    }
    struct server_config cfg;
    server_config_default(&cfg);
    cfg.port = 0;
    cfg.ctx_size = CTX;
    cfg.model_name = "mock";
    cfg.listen_from = l;
    struct server *srv = NULL;
    assert_int_equal(server_start(&cfg, F.sched, F.tok, &srv), KS_OK);
    server_set_ready(srv, true);
    server_loading_stop(l);
    assert_int_equal(server_port(srv), port);
    /* draining: no new connections, and /health on one still open says so */
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    char answer[2048];
    health_on(fd, answer, sizeof answer);
    assert_non_null(strstr(answer, " 200 "));
    server_quiesce(srv);
    health_on(fd, answer, sizeof answer);
    assert_non_null(strstr(answer, " 503 "));
    assert_non_null(strstr(answer, "\"draining\""));
    close(fd);
    server_stop(srv);
    /* a port in use fails at once, before any load */
    struct server_loading *busy = NULL;
    assert_int_equal(server_loading_start("127.0.0.1", server_port(F.srv), &busy), KS_ERR_IO);
    assert_null(busy);
    assert_int_equal(server_loading_start("localhost", 0, &busy), KS_ERR_INVALID_ARG);
}

static void test_bad_requests(void **state)
{
    (void)state;
    /* a model this server does not serve (OpenAI routes; /completion, like llama-server's, ignores it) */
    expect_error(post(F.srv, "/v1/completions", "{\"prompt\": \"hi\", \"model\": \"gpt-4\"}"), 404,
                 "model_not_found");
    expect_error(post(F.srv, "/v1/chat/completions",
                      "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"model\": \"mocks\"}"),
                 404, "model_not_found");
    static const char *const served[] = {"{\"prompt\": \"hi\", \"max_tokens\": 1, \"model\": \"mock\"}",
                                         "{\"prompt\": \"hi\", \"max_tokens\": 1, \"model\": \"\"}"};
    for (int i = 0; i < 2; i++) {
        struct httpc_response ok = post(F.srv, "/v1/completions", served[i]);
        assert_int_equal(ok.status, 200);
        httpc_response_free(&ok);
    }
    struct httpc_response native = post(F.srv, "/completion", "{\"prompt\": \"hi\", \"n_predict\": 1, \"model\": \"x\"}");
    assert_int_equal(native.status, 200);
    httpc_response_free(&native);
    expect_error(post(F.srv, "/v1/completions", "{\"prompt\": \"hi\""), 400, "invalid_json");
    expect_error(post(F.srv, "/v1/completions", "[1,2]"), 400, "invalid_json");
    expect_error(post(F.srv, "/v1/completions", ""), 400, "invalid_json");
    expect_error(post(F.srv, "/v1/completions", "{\"prompt\": 5}"), 400, "invalid_type");
    expect_error(post(F.srv, "/v1/completions", "{\"prompt\": \"hi\", \"temperature\": \"hot\"}"), 400, "invalid_type");
    expect_error(post(F.srv, "/v1/completions", "{\"prompt\": \"hi\", \"max_tokens\": -3}"), 400, "invalid_value");
    expect_error(post(F.srv, "/v1/completions", "{\"prompt\": \"hi\", \"max_tokens\": 1.5}"), 400, "invalid_type");
    expect_error(post(F.srv, "/v1/completions", "{\"prompt\": \"hi\", \"n\": 17}"), 400, "invalid_value");
    /* positive, but 0 as the sampler's float (found by fuzz_body) */
    expect_error(post(F.srv, "/v1/completions", "{\"prompt\": \"hi\", \"top_p\": 1e-50}"), 400, "invalid_value");
    expect_error(post(F.srv, "/v1/completions", "{\"prompt\": \"hi\", \"stop\": 3}"), 400, "invalid_type");
    expect_error(post(F.srv, "/v1/completions", "{\"prompt\": [1, 99999]}"), 400, "invalid_value");
    expect_error(post(F.srv, "/v1/completions", "{\"prompt\": \"hi\", \"stream\": \"yes\"}"), 400, "invalid_type");
    expect_error(post(F.srv, "/v1/chat/completions", "{\"messages\": []}"), 400, "invalid_type");
    expect_error(post(F.srv, "/v1/chat/completions", "{\"messages\": [{\"role\": \"wizard\", \"content\": \"x\"}]}"), 400,
                 "invalid_value");
    expect_error(post(F.srv, "/v1/chat/completions", "{\"messages\": [{\"content\": \"x\"}]}"), 400, "invalid_type");
    /* a prompt longer than the context */
    char big[8192] = "{\"prompt\": \"";
    for (int i = 0; i < 400; i++)
        strcat(big, "once upon ");
    strcat(big, "\"}");
    expect_error(post(F.srv, "/v1/completions", big), 400, "context_length_exceeded");
    /* a body over --max-body (64 KiB here) */
    size_t n = 200 * 1024;
    char *huge = malloc(n);
    memset(huge, ' ', n);
    huge[0] = '{';
    huge[n - 1] = '}';
    /* with 100-continue the server's early 413 arrives before the body is sent; without it the
     * server's close could break the client's send before the answer is read */
    expect_error(http(F.srv, "POST", "/v1/completions", "Expect: 100-continue", huge, n), 413, "request_too_large");
    free(huge);
    /* the server is still fine */
    struct httpc_response r = post(F.srv, "/v1/completions", "{\"prompt\": [1, 400, 401], \"max_tokens\": 3}");
    assert_int_equal(r.status, 200);
    httpc_response_free(&r);
}

static void test_api_key_and_overload(void **state)
{
    (void)state;
    expect_error(post(F.srv_key, "/v1/completions", "{\"prompt\": \"hi\"}"), 401, "invalid_api_key");
    expect_error(http(F.srv_key, "GET", "/metrics", "Authorization: Bearer wrong", NULL, 0), 401, NULL);
    struct httpc_response r = http(F.srv_key, "GET", "/health", NULL, NULL, 0);
    assert_int_equal(r.status, 200);
    httpc_response_free(&r);
    const char *body = "{\"prompt\": [1, 400], \"max_tokens\": 2}";
    r = http(F.srv_key, "POST", "/v1/completions", "Authorization: Bearer sekret", body, strlen(body));
    assert_int_equal(r.status, 200);
    httpc_response_free(&r);
    r = post(F.srv_full, "/v1/completions", body);
    assert_non_null(httpc_response_header(&r, "Retry-After"));
    assert_string_equal(httpc_response_header(&r, "Retry-After"), "1");
    expect_error(r, 503, "overloaded");
}

static void test_completion_matches_model(void **state)
{
    (void)state;
    int32_t prompt[] = {1, 403, 404, 405};
    char *want = expected_text(prompt, 4, 12);
    struct httpc_response r = post(F.srv, "/v1/completions",
                         "{\"model\":\"mock\",\"prompt\": [1, 403, 404, 405], \"max_tokens\": 12, \"temperature\": 0, \"logprobs\": 2}");
    assert_int_equal(r.status, 200);
    cJSON *j = json_of(&r);
    cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    assert_string_equal(cJSON_GetObjectItem(ch, "text")->valuestring, want);
    assert_string_equal(cJSON_GetObjectItem(ch, "finish_reason")->valuestring, "length");
    cJSON *lp = cJSON_GetObjectItem(ch, "logprobs");
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(lp, "token_logprobs")), 12);
    cJSON *u = cJSON_GetObjectItem(j, "usage");
    assert_int_equal(cJSON_GetObjectItem(u, "prompt_tokens")->valueint, 4);
    assert_int_equal(cJSON_GetObjectItem(u, "completion_tokens")->valueint, 12);
    assert_int_equal(cJSON_GetObjectItem(u, "total_tokens")->valueint, 16);
    cJSON_Delete(j);
    httpc_response_free(&r);

    /* the same as a stream */
    r = post(F.srv, "/v1/completions",
             "{\"prompt\": [1, 403, 404, 405], \"max_tokens\": 12, \"stream\": true, \"stream_options\": {\"include_usage\": true}}");
    assert_int_equal(r.status, 200);
    const char *type = httpc_response_header(&r, "Content-Type");
    assert_non_null(type);
    assert_int_equal(strncmp(type, "text/event-stream", 17), 0);
    struct stream s = read_stream(r, false);
    assert_string_equal(s.text, want);
    assert_string_equal(s.finish, "length");
    assert_int_equal(s.completion_tokens, 12);
    free(s.text);

    /* a stop string cuts the text before it, in both modes */
    size_t cut = strlen(want) / 2;
    char stop[8] = {0};
    memcpy(stop, want + cut, 3);
    char *at = strstr(want, stop);
    size_t keep = (size_t)(at - want);
    char body[512];
    snprintf(body, sizeof body, "{\"prompt\": [1, 403, 404, 405], \"max_tokens\": 12, \"stop\": [\"zzzz\", \"%s\"]}", stop);
    r = post(F.srv, "/v1/completions", body);
    j = json_of(&r);
    ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    assert_int_equal(strlen(cJSON_GetObjectItem(ch, "text")->valuestring), keep);
    assert_memory_equal(cJSON_GetObjectItem(ch, "text")->valuestring, want, keep);
    assert_string_equal(cJSON_GetObjectItem(ch, "finish_reason")->valuestring, "stop");
    cJSON_Delete(j);
    httpc_response_free(&r);
    snprintf(body, sizeof body, "{\"prompt\": [1, 403, 404, 405], \"max_tokens\": 12, \"stream\": true, \"stop\": \"%s\"}", stop);
    s = read_stream(post(F.srv, "/v1/completions", body), false);
    assert_int_equal(strlen(s.text), keep);
    assert_memory_equal(s.text, want, keep);
    assert_string_equal(s.finish, "stop");
    free(s.text);
    free(want);
}

static void test_chat(void **state)
{
    (void)state;
    const char *body = "{\"messages\": [{\"role\": \"system\", \"content\": \"be brief\"}, "
                       "{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"Once upon\"}]}], "
                       "\"max_tokens\": 9, \"logprobs\": true, \"top_logprobs\": 1}";
    struct httpc_response r = post(F.srv, "/v1/chat/completions", body);
    assert_int_equal(r.status, 200);
    cJSON *j = json_of(&r);
    assert_string_equal(cJSON_GetObjectItem(j, "object")->valuestring, "chat.completion");
    cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    cJSON *msg = cJSON_GetObjectItem(ch, "message");
    assert_string_equal(cJSON_GetObjectItem(msg, "role")->valuestring, "assistant");
    char *whole = strdup(cJSON_GetObjectItem(msg, "content")->valuestring);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(cJSON_GetObjectItem(ch, "logprobs"), "content")), 9);
    cJSON_Delete(j);
    httpc_response_free(&r);

    char sbody[1024];
    snprintf(sbody, sizeof sbody, "%.*s, \"stream\": true}", (int)strlen(body) - 1, body);
    r = post(F.srv, "/v1/chat/completions", sbody);
    assert_int_equal(r.status, 200);
    struct stream s = read_stream(r, true);
    assert_string_equal(s.role, "assistant");
    assert_string_equal(s.text, whole);
    assert_string_equal(s.finish, "length");
    free(s.text);
    free(whole);
}

struct client {
    int idx;
    ks_status st;           /* checked on the test's thread: cmocka asserts only there */
    struct httpc_response r;
};

static void *client_main(void *arg)
{
    struct client *c = arg;
    char url[256], body[256];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/v1/completions", server_port(F.srv));
    int n = snprintf(body, sizeof body, "{\"prompt\": [1, %d, %d], \"max_tokens\": 40, \"stream\": true}",
                     310 + c->idx, 320 + c->idx);
    struct httpc_request rq = {.url = url, .body = body, .body_len = (size_t)n, .timeout_s = KS_WAIT_SECONDS};
    c->st = httpc_request(&rq, &c->r);
    return NULL;
}

static void test_concurrent_streams(void **state)
{
    (void)state;
    enum { N = 8 };
    pthread_t th[N];
    struct client cl[N];
    for (int i = 0; i < N; i++) {
        cl[i].idx = i;
        pthread_create(&th[i], NULL, client_main, &cl[i]);
    }
    for (int i = 0; i < N; i++) {
        pthread_join(th[i], NULL);
        int32_t prompt[3] = {1, 310 + i, 320 + i};
        char *want = expected_text(prompt, 3, 40);
        assert_int_equal(cl[i].st, KS_OK);
        assert_int_equal(cl[i].r.status, 200);
        char *text = read_stream(cl[i].r, false).text;
        assert_string_equal(text, want);
        free(want);
        free(text);
    }
    struct httpc_response r = http(F.srv, "GET", "/metrics", NULL, NULL, 0);
    assert_int_equal(r.status, 200);
    double v;
    assert_true(metric(r.body, "kvserve_requests_running", &v));
    assert_true(metric(r.body, "kvserve_ttft_seconds_bucket{le=\"+Inf\"}", &v));
    assert_true(metric(r.body, "kvserve_itl_seconds_count", &v));
    httpc_response_free(&r);
    r = http(F.srv, "GET", "/cache/usage", NULL, NULL, 0);
    assert_int_equal(r.status, 200);
    cJSON *j = json_of(&r);
    assert_true(cJSON_IsArray(cJSON_GetObjectItem(j, "requests")));
    cJSON_Delete(j);
    httpc_response_free(&r);
}

/* A client that sends body to path over a raw socket, waits ms and hangs up without reading the reply. */
static void abandon(struct server *srv, const char *body, int ms)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)server_port(srv))};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    char req[4096];
    int n = snprintf(req, sizeof req,
                     "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     "Content-Length: %zu\r\n\r\n%s", strlen(body), body);
    assert_true(n > 0 && (size_t)n < sizeof req);
    assert_int_equal(write(fd, req, (size_t)n), n);
    usleep((useconds_t)ms * 1000);
    close(fd);
}

/* A counter of srv_slow's /metrics. */
static double slow_metric(const char *name)
{
    struct httpc_response r = http(F.srv_slow, "GET", "/metrics", NULL, NULL, 0);
    double v = -1;
    assert_true(metric(r.body, name, &v));
    httpc_response_free(&r);
    return v;
}

/* A short request after an abandoned one is served (queued behind it, so
 * at once only if the abandoned one was cancelled), and the abandoned one
 * computed fewer than limit tokens of counter (it did not run to its end). */
static void expect_cancelled(const char *counter, double before, double limit)
{
    struct httpc_response r = post(F.srv_slow, "/v1/completions", "{\"prompt\": [1, 300], \"max_tokens\": 1}");
    assert_int_equal(r.status, 200);
    httpc_response_free(&r);
    double used = slow_metric(counter) - before;
    print_message("%s: %.0f (the abandoned request's whole work: %.0f)\n", counter, used, limit);
    assert_true(used < limit);
}

/* A client that hangs up is noticed while its request waits (suspended,
 * no thread) and the request is cancelled, its pages freed: non-streaming
 * while it decodes (240 steps of 20 ms), streaming during a long prefill
 * (13 steps of 16 tokens). */
static void test_abandoned_requests_cancelled(void **state)
{
    (void)state;
    double gen = slow_metric("kvserve_generated_tokens_total");
    abandon(F.srv_slow, "{\"prompt\": [1, 300, 301], \"max_tokens\": 240}", 100);
    expect_cancelled("kvserve_generated_tokens_total", gen, 240);
    char body[2048] = "{\"stream\": true, \"max_tokens\": 8, \"prompt\": [1";
    for (int i = 0; i < 200; i++)
        snprintf(body + strlen(body), sizeof body - strlen(body), ", %d", 300 + (i * 7) % 50);
    strcat(body, "]}");
    double prompt = slow_metric("kvserve_prompt_tokens_total");
    abandon(F.srv_slow, body, 60);
    expect_cancelled("kvserve_prompt_tokens_total", prompt, 200);
}

/* The kv_policy object of /cache/usage. */
static cJSON *usage_policy(cJSON **root)
{
    struct httpc_response r = http(F.srv, "GET", "/cache/usage", NULL, NULL, 0);
    assert_int_equal(r.status, 200);
    *root = json_of(&r);
    httpc_response_free(&r);
    cJSON *p = cJSON_GetObjectItem(*root, "kv_policy");
    assert_true(cJSON_IsObject(p));
    return p;
}

static void test_cache_policy(void **state)
{
    (void)state;
    cJSON *root;
    cJSON *p = usage_policy(&root);
    assert_string_equal(json_str(p, "policy"), "static");
    assert_true(json_num(p, "high_watermark") == 0.9);
    cJSON_Delete(root);

    struct httpc_response r = post(F.srv, "/cache/policy",
                         "{\"policy\": \"dynamic\", \"high_watermark\": 0.7, \"low_watermark\": 0.5, \"hot_tokens\": 64,"
                         " \"sink_tokens\": 8, \"floor\": \"q5_0\", \"type_k\": \"q8_0\", \"ladder\": \"q8_0,q5_1,q5_0\"}");
    if (r.status != 200)
        print_message("%s\n", r.body);
    assert_int_equal(r.status, 200);
    cJSON *j = json_of(&r);
    httpc_response_free(&r);
    assert_string_equal(json_str(j, "policy"), "dynamic");
    assert_true(json_num(j, "high_watermark") == 0.7);
    assert_true(json_num(j, "low_watermark") == 0.5);
    assert_true(json_num(j, "hot_tokens") == 64);
    assert_true(json_num(j, "sink_tokens") == 8);
    assert_string_equal(json_str(j, "floor"), "q5_0");
    assert_string_equal(json_str(j, "ladder"), "q8_0,q5_1,q5_0");
    assert_string_equal(json_str(j, "type_k"), "q8_0");
    assert_string_equal(json_str(j, "type_v"), "f16");
    /* /cache/usage reports the same effective policy */
    p = usage_policy(&root);
    char *a = cJSON_PrintUnformatted(p), *b = cJSON_PrintUnformatted(j);
    assert_string_equal(a, b);
    assert_string_equal(json_str(root, "policy"), "dynamic");
    free(a);
    free(b);
    cJSON_Delete(root);
    cJSON_Delete(j);

    /* bad values: 400, and nothing changes */
    expect_error(post(F.srv, "/cache/policy", "{\"policy\": \"lru\"}"), 400, "invalid_value");
    expect_error(post(F.srv, "/cache/policy", "{\"high_watermark\": \"high\"}"), 400, "invalid_value");
    expect_error(post(F.srv, "/cache/policy", "{\"high_watermark\": 1.5}"), 400, "invalid_value");
    expect_error(post(F.srv, "/cache/policy", "{\"hot_tokens\": -1}"), 400, "invalid_value");
    expect_error(post(F.srv, "/cache/policy", "{\"sink_tokens\": 2.5}"), 400, "invalid_value");
    expect_error(post(F.srv, "/cache/policy", "{\"floor\": \"q3_k\"}"), 400, "invalid_value");
    expect_error(post(F.srv, "/cache/policy", "{\"hot\": 5}"), 400, "unknown_field");
    expect_error(post(F.srv, "/cache/policy", "{\"ladder\": \"q4_0,q8_0\"}"), 400, "invalid_value");
    expect_error(post(F.srv, "/cache/policy", "{\"ladder\": [\"q8_0\"]}"), 400, "invalid_value");
    expect_error(post(F.srv, "/cache/policy", "{\"policy\": "), 400, "invalid_json");
    expect_error(http(F.srv, "GET", "/cache/policy", NULL, NULL, 0), 405, NULL);
    r = post(F.srv, "/cache/policy", "{\"policy\": \"static\", \"low_watermark\": 0.8}"); /* above high 0.7 */
    char *message = expect_error_message(r, 400, "invalid_value");
    assert_non_null(strstr(message, "low_watermark"));
    free(message);
    p = usage_policy(&root);
    assert_string_equal(json_str(p, "policy"), "dynamic");
    assert_true(json_num(p, "low_watermark") == 0.5);
    cJSON_Delete(root);

    /* an empty object changes nothing and answers the current policy; then restore */
    r = post(F.srv, "/cache/policy", "{}");
    assert_int_equal(r.status, 200);
    j = json_of(&r);
    assert_string_equal(json_str(j, "policy"), "dynamic");
    cJSON_Delete(j);
    httpc_response_free(&r);
    r = post(F.srv, "/cache/policy", "{\"policy\": \"static\", \"high_watermark\": 0.9, \"low_watermark\": 0.8,"
                                     " \"type_k\": \"f16\", \"floor\": \"q4_0\", \"ladder\": \"q8_0,q4_0\"}");
    assert_int_equal(r.status, 200);
    httpc_response_free(&r);
}

/* An idle cached chain of 2 pages in the mock's (real) cache. */
/* Two full pages of zeros published under tokens first, first+1, ... (first
 * beyond the vocabulary: ids no tokenizer knows, which the preview tolerates). */
static void make_idle_chain(void *user, struct kv_cache *kv)
{
    const int32_t first = *(const int32_t *)user;
    const struct kv_config *c = kv_get_config(kv);
    int32_t seq = -1, tokens[64];
    for (int i = 0; i < 64; i++)
        tokens[i] = first + i;
    float k[128] = {0}, v[128] = {0};
    assert_int_equal(kv_seq_create(kv, &seq), KS_OK);
    assert_int_equal(kv_seq_grow(kv, seq, 64), KS_OK);
    for (int32_t p = 0; p < 64; p++)
        for (int l = 0; l < c->n_layer; l++)
            assert_int_equal(kv_write(kv, l, seq, p, k, v), KS_OK);
    assert_int_equal(kv_seq_publish(kv, seq, tokens, 64), KS_OK);
    kv_seq_free(kv, seq);
}

/* Every page requantized to iq3_nl (kvserve's own 3.5-bit type) over HTTP:
 * the pages convert and /cache/usage counts them under that name. */
static void test_requantize_to_iq3_nl(void **state)
{
    (void)state;
    struct httpc_response r = post(F.srv, "/cache/clear", "{\"tier\": \"all\"}");
    httpc_response_free(&r);
    int32_t first = 5000;
    assert_int_equal(sched_between_steps(F.sched, make_idle_chain, &first), KS_OK);
    r = post(F.srv, "/cache/requantize", "{\"type_k\": \"iq3_nl\", \"type_v\": \"iq3_nl\", \"scope\": \"all\"}");
    if (r.status != 200)
        print_message("%s\n", r.body);
    assert_int_equal(r.status, 200);
    cJSON *j = json_of(&r);
    httpc_response_free(&r);
    assert_true(json_num(j, "pages_converted") >= 2);
    assert_true(json_num(j, "bytes_freed") > 0);
    cJSON_Delete(j);
    r = http(F.srv, "GET", "/cache/usage", NULL, NULL, 0);
    assert_int_equal(r.status, 200);
    j = json_of(&r);
    httpc_response_free(&r);
    assert_true(json_num(cJSON_GetObjectItem(j, "pages_k"), "iq3_nl") >= 2);
    assert_true(json_num(cJSON_GetObjectItem(j, "pages_v"), "iq3_nl") >= 2);
    cJSON_Delete(j);
    r = post(F.srv, "/cache/clear", "{\"tier\": \"all\"}");
    assert_int_equal(r.status, 200);
    httpc_response_free(&r);
}

/* ---- POST /cache/requantize in slices ------------------------------------------------ */

struct counter {
    pthread_mutex_t mu;
    int tokens;
    bool done;
    enum sched_finish finish;
};

static void count_event(void *user, const struct sched_event *ev)
{
    struct counter *c = user;
    pthread_mutex_lock(&c->mu);
    if (ev->finish == SCHED_FINISH_NONE)
        c->tokens++;
    else {
        c->done = true;
        c->finish = ev->finish;
    }
    pthread_mutex_unlock(&c->mu);
}

static int counted(struct counter *c, bool *done)
{
    pthread_mutex_lock(&c->mu);
    int n = c->tokens;
    if (done)
        *done = c->done;
    pthread_mutex_unlock(&c->mu);
    return n;
}

struct requant_client {
    struct server *srv;
    struct httpc_response r;
    atomic_bool finished;
};

static void *requant_main(void *arg)
{
    struct requant_client *c = arg;
    c->r = post(c->srv, "/cache/requantize", "{\"type_k\": \"q4_0\", \"type_v\": \"q4_0\", \"pages_per_step\": 1}");
    atomic_store(&c->finished, true);
    return NULL;
}

/* 16 idle pages requantized one page per step while a stream decodes: the
 * work takes 16 slices with a step between each two, the stream keeps
 * going, and a second requantization sent meanwhile gets 409. The engine is
 * held (steps wait) while the two are sent, so the first cannot finish
 * before the second arrives, whatever the machine's speed. */
static void test_requantize_in_slices_and_409(void **state)
{
    (void)state;
    struct mock_engine_config mc = mock_config(tok_n_vocab(F.tok));
    struct mock_engine *m = NULL;
    assert_int_equal(mock_engine_create(&mc, &m), KS_OK);
    struct sched_engine e = mock_engine_sched(m, false);
    struct sched_config cfg;
    sched_config_default(&cfg);
    cfg.ctx_size = CTX;
    struct sched *s = NULL;
    assert_int_equal(sched_create(&cfg, &e, &s), KS_OK);
    struct server *srv = start_server(s, NULL);
    for (int32_t i = 0; i < 8; i++) { /* 8 idle chains of 2 pages */
        int32_t first = 6000 + 100 * i;
        assert_int_equal(sched_between_steps(s, make_idle_chain, &first), KS_OK);
    }
    struct counter stream = {.mu = PTHREAD_MUTEX_INITIALIZER};
    int32_t prompt[3] = {1, 333, 334};
    struct sched_request rq = {.prompt = prompt, .n_prompt = 3, .max_tokens = 240, .on_event = count_event,
                               .user = &stream};
    uint64_t id;
    assert_int_equal(sched_submit(s, &rq, &id), KS_OK);
    KS_WAIT_UNTIL(counted(&stream, NULL) > 0, "the stream's first token");

    mock_engine_hold(m, true);
    struct requant_client cl[2] = {{.srv = srv}, {.srv = srv}};
    pthread_t th[2];
    for (int i = 0; i < 2; i++)
        pthread_create(&th[i], NULL, requant_main, &cl[i]);
    KS_WAIT_UNTIL(atomic_load(&cl[0].finished) || atomic_load(&cl[1].finished), "one requantize to be refused");
    int refused = atomic_load(&cl[0].finished) ? 0 : 1;
    mock_engine_hold(m, false);
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
    char *message = expect_error_message(cl[refused].r, 409, "requantize_running");
    assert_non_null(strstr(message, "/cache/usage"));
    free(message);

    struct httpc_response *ok = &cl[1 - refused].r;
    if (ok->status != 200)
        print_message("%s\n", ok->body);
    assert_int_equal(ok->status, 200);
    cJSON *j = json_of(ok);
    httpc_response_free(ok);
    assert_int_equal(json_num(j, "pages_converted"), 16);
    assert_int_equal(json_num(j, "slices"), 16);
    /* one slice between two steps while the stream decodes (it outlives the 16 slices) */
    assert_true(json_num(j, "steps") >= 15);
    cJSON_Delete(j);
    bool done = false;
    int at_end = counted(&stream, &done);
    assert_true(at_end < 240 && !done);

    struct httpc_response r = http(srv, "GET", "/cache/usage", NULL, NULL, 0);
    j = json_of(&r);
    httpc_response_free(&r);
    cJSON *q = cJSON_GetObjectItem(j, "requantize");
    assert_true(cJSON_IsFalse(cJSON_GetObjectItem(q, "running")));
    assert_int_equal(json_num(q, "pages_done"), 16);
    assert_int_equal(json_num(q, "pages_total"), 16);
    assert_int_equal(json_num(cJSON_GetObjectItem(j, "pages_k"), "q4_0"), 16);
    cJSON_Delete(j);
    r = post(srv, "/cache/requantize", "{\"type_k\": \"q8_0\", \"pages_per_step\": 0}");
    expect_error(r, 400, "invalid_value");

    KS_WAIT_UNTIL(counted(&stream, &done) == 240 && done, "the stream to finish");
    assert_int_equal(stream.finish, SCHED_FINISH_LENGTH);
    server_stop(srv);
    sched_free(s);
    mock_engine_free(m);
}

static void test_prefix_cache_routes(void **state)
{
    (void)state;
    /* max_tokens 0: a warm-up answered at once, with usage and cached_tokens */
    struct httpc_response r = post(F.srv, "/v1/completions", "{\"prompt\": [1, 400, 401], \"max_tokens\": 0}");
    assert_int_equal(r.status, 200);
    cJSON *j = json_of(&r);
    httpc_response_free(&r);
    cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    assert_string_equal(json_str(ch, "text"), "");
    assert_string_equal(json_str(ch, "finish_reason"), "length");
    cJSON *u = cJSON_GetObjectItem(j, "usage");
    assert_true(json_num(u, "prompt_tokens") == 3 && json_num(u, "completion_tokens") == 0);
    assert_true(json_num(cJSON_GetObjectItem(u, "prompt_tokens_details"), "cached_tokens") == 0);
    cJSON_Delete(j);
    /* the final stream chunk's usage carries cached_tokens too */
    r = post(F.srv, "/v1/completions", "{\"prompt\": [1, 400], \"max_tokens\": 2, \"stream\": true,"
                                       " \"stream_options\": {\"include_usage\": true}}");
    assert_int_equal(r.status, 200);
    struct stream s = read_stream(r, false);
    assert_int_equal(s.cached_tokens, 0);
    free(s.text);
    /* a streamed warm-up: one chunk finishing with "length", then usage, then [DONE] (read_stream) */
    r = post(F.srv, "/v1/completions", "{\"prompt\": [1, 402], \"max_tokens\": 0, \"stream\": true,"
                                       " \"stream_options\": {\"include_usage\": true}}");
    assert_int_equal(r.status, 200);
    s = read_stream(r, false);
    assert_string_equal(s.finish, "length");
    assert_string_equal(s.text, "");
    assert_int_equal(s.completion_tokens, 0);
    assert_true(s.finish_at >= 0 && s.usage_at > s.finish_at);
    free(s.text);
    r = post(F.srv, "/v1/chat/completions",
             "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_completion_tokens\": 0}");
    assert_int_equal(r.status, 200);
    j = json_of(&r);
    httpc_response_free(&r);
    ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    assert_string_equal(json_str(cJSON_GetObjectItem(ch, "message"), "content"), "");
    u = cJSON_GetObjectItem(j, "usage");
    assert_true(json_num(cJSON_GetObjectItem(u, "prompt_tokens_details"), "cached_tokens") >= 0);
    cJSON_Delete(j);
    expect_error(post(F.srv, "/v1/chat/completions",
                      "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_completion_tokens\": -1}"),
                 400, "invalid_value");
    /* start the listing below from an empty cache */
    r = post(F.srv, "/cache/clear", "{\"tier\": \"all\"}");
    assert_int_equal(r.status, 200);
    httpc_response_free(&r);

    int32_t bad_ids = 1 << 20;
    assert_int_equal(sched_between_steps(F.sched, make_idle_chain, &bad_ids), KS_OK);
    r = http(F.srv, "GET", "/cache/prefixes?limit=5", NULL, NULL, 0);
    assert_int_equal(r.status, 200); /* ids outside the vocabulary do not break the preview */
    j = json_of(&r);
    httpc_response_free(&r);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(j, "data")), 1);
    cJSON_Delete(j);
    r = post(F.srv, "/cache/clear", "{\"tier\": \"ram\"}");
    j = json_of(&r);
    httpc_response_free(&r);
    assert_true(json_num(j, "ram_pages_dropped") == 2);
    cJSON_Delete(j);

    int32_t good_ids = 300;
    assert_int_equal(sched_between_steps(F.sched, make_idle_chain, &good_ids), KS_OK);
    r = http(F.srv, "GET", "/cache/prefixes?limit=5", NULL, NULL, 0);
    assert_int_equal(r.status, 200);
    j = json_of(&r);
    httpc_response_free(&r);
    cJSON *first = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "data"), 0);
    assert_non_null(first);
    assert_true(json_num(first, "tokens") == 64 && json_num(first, "pages") == 2 && json_num(first, "idle_pages") == 2);
    assert_true(json_num(first, "hits") == 0 && json_num(first, "last_use_ms") > 1.6e12);
    assert_string_equal(json_str(first, "tier"), "ram");
    assert_int_equal(strlen(json_str(first, "key")), 32);
    assert_int_equal(strlen(json_str(first, "last_use")), 20); /* 2026-11-24T05:24:27Z */
    assert_true(strlen(json_str(first, "preview")) > 0);
    assert_true(json_num(cJSON_GetObjectItem(j, "ram"), "chains") == 1);
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(j, "disk")));
    cJSON_Delete(j);
    expect_error(http(F.srv, "GET", "/cache/prefixes?limit=0", NULL, NULL, 0), 400, "invalid_value");
    expect_error(http(F.srv, "GET", "/cache/prefixes?limit=x", NULL, NULL, 0), 400, "invalid_value");
    expect_error(post(F.srv, "/cache/prefixes", "{}"), 405, NULL);

    /* /cache/usage and /metrics count the idle pages */
    r = http(F.srv, "GET", "/cache/usage", NULL, NULL, 0);
    j = json_of(&r);
    httpc_response_free(&r);
    cJSON *pre = cJSON_GetObjectItem(j, "prefix");
    assert_true(json_num(pre, "idle_pages") == 2 && json_num(pre, "keyed_pages") == 2);
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(j, "disk")));
    cJSON_Delete(j);
    r = http(F.srv, "GET", "/metrics", NULL, NULL, 0);
    double v;
    assert_true(metric(r.body, "kvserve_kv_idle_pages", &v) && v == 2);
    assert_true(metric(r.body, "kvserve_prefix_hit_tokens_total{tier=\"disk\"}", &v) && v == 0);
    assert_non_null(strstr(r.body, "\n# TYPE kvserve_prefix_tokens_saved_total counter\n"));
    assert_null(strstr(r.body, "kvserve_disk_cache_bytes")); /* no SSD tier */
    httpc_response_free(&r);

    /* /cache/clear: bad requests change nothing, then ram drops the idle pages */
    expect_error(post(F.srv, "/cache/clear", "{\"tier\": \"ssd\"}"), 400, "invalid_value");
    expect_error(post(F.srv, "/cache/clear", "{\"tier\": 3}"), 400, "invalid_value");
    expect_error(post(F.srv, "/cache/clear", "{\"everything\": true}"), 400, "unknown_field");
    expect_error(post(F.srv, "/cache/clear", "{\"tier\": \"disk\"}"), 400, "invalid_value");
    expect_error(post(F.srv, "/cache/clear", "{\"tier\""), 400, "invalid_json");
    expect_error(http(F.srv, "GET", "/cache/clear", NULL, NULL, 0), 405, NULL);
    r = post(F.srv, "/cache/clear", "{\"tier\": \"ram\"}");
    assert_int_equal(r.status, 200);
    j = json_of(&r);
    httpc_response_free(&r);
    assert_true(json_num(j, "ram_pages_dropped") == 2 && json_num(j, "disk_entries_deleted") == 0);
    assert_true(json_num(j, "ram_bytes_freed") > 0);
    cJSON_Delete(j);
    r = post(F.srv, "/cache/clear", "{}");
    assert_int_equal(r.status, 200);
    j = json_of(&r);
    httpc_response_free(&r);
    assert_string_equal(json_str(j, "tier"), "all");
    cJSON_Delete(j);
    r = http(F.srv, "GET", "/cache/prefixes", NULL, NULL, 0);
    j = json_of(&r);
    httpc_response_free(&r);
    assert_true(cJSON_IsArray(cJSON_GetObjectItem(j, "data")));
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(j, "data")), 0);
    cJSON_Delete(j);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prefix_cache_routes),
        cmocka_unit_test(test_requantize_to_iq3_nl),
        cmocka_unit_test(test_requantize_in_slices_and_409),
        cmocka_unit_test(test_health_models_404),
        cmocka_unit_test(test_loading_then_ready),
        cmocka_unit_test(test_bad_requests),
        cmocka_unit_test(test_api_key_and_overload),
        cmocka_unit_test(test_completion_matches_model),
        cmocka_unit_test(test_chat),
        cmocka_unit_test(test_concurrent_streams),
        cmocka_unit_test(test_cache_policy),
        cmocka_unit_test(test_abandoned_requests_cancelled),
    };
    if (!find_vocab())
        return ks_skip_all("no stories260K.gguf under $KVSERVE_SHARED/models and no $KVSERVE_DEFAULT_MODEL");
    return ks_run_tests(tests, setup, teardown);
}
