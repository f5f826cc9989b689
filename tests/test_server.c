/* The HTTP layer in-process: a real tokenizer (stories260K's vocabulary), the
 * real scheduler, and a mock engine whose next token is a pure function of the
 * sequence's history, so every response has a known answer. A tiny socket
 * HTTP client checks routes, errors, streaming, stop strings and concurrency. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "gguf/gguf.h"
#include "kv/kv.h"
#include "server/server.h"

#define MAX_SEQ 64
#define CTX 256

/* ---- mock engine (as in test_sched.c, with the tokenizer's vocabulary) ----------- */

struct mock {
    int32_t n_vocab;
    struct kv_cache *kv;      /* a real (empty) cache for the /cache routes */
    int32_t *hist[MAX_SEQ];
    int32_t len[MAX_SEQ];
    bool live[MAX_SEQ];
};

static uint32_t next_token_of(const int32_t *toks, int32_t n, int32_t n_vocab)
{
    uint32_t h = 2166136261u;
    for (int32_t i = 0; i < n; i++)
        h = (h ^ (uint32_t)toks[i]) * 16777619u;
    /* skip the first few ids (control / byte tokens) so the text is readable */
    return 300 + h % (uint32_t)(n_vocab - 300);
}

static ks_status m_seq_create(void *ctx, int32_t *out)
{
    struct mock *m = ctx;
    for (int i = 0; i < MAX_SEQ; i++)
        if (!m->live[i]) {
            m->live[i] = true;
            m->len[i] = 0;
            *out = i;
            return KS_OK;
        }
    return ks_fail(KS_ERR_KV_FULL, "no slots");
}

static void m_seq_free(void *ctx, int32_t seq)
{
    struct mock *m = ctx;
    m->live[seq] = false;
}

static ks_status m_forward(void *ctx, const struct sched_batch *b, float *logits)
{
    struct mock *m = ctx;
    int32_t row = 0;
    for (int32_t i = 0; i < b->n_tokens; i++) {
        int32_t s = b->seq[i];
        m->hist[s][m->len[s]++] = b->tokens[i];
        if (b->want_logits[i]) {
            float *l = logits + (size_t)row++ * m->n_vocab;
            memset(l, 0, (size_t)m->n_vocab * sizeof *l);
            l[next_token_of(m->hist[s], m->len[s], m->n_vocab)] = 10.0f;
        }
    }
    usleep(200); /* let requests overlap */
    return KS_OK;
}

static ks_status m_sampler_create(void *ctx, const struct sample_params *p, void **out)
{
    (void)ctx;
    (void)p;
    *out = malloc(1);
    return KS_OK;
}

static ks_status m_sampler_next(void *ctx, void *smp, const float *logits, const int32_t *hist, int32_t n,
                                struct sample_result *out)
{
    (void)smp;
    (void)hist;
    (void)n;
    struct mock *m = ctx;
    int best = 0;
    for (int v = 1; v < m->n_vocab; v++)
        if (logits[v] > logits[best])
            best = v;
    memset(out, 0, sizeof *out);
    out->token = best;
    out->logprob = -0.5f;
    return KS_OK;
}

static void m_sampler_free(void *ctx, void *smp)
{
    (void)ctx;
    free(smp);
}

static struct kv_cache *m_cache(void *ctx)
{
    struct mock *m = ctx;
    return m->kv;
}

static void m_destroy(void *ctx)
{
    struct mock *m = ctx;
    kv_free(m->kv);
    for (int i = 0; i < MAX_SEQ; i++)
        free(m->hist[i]);
    free(m);
}

static struct sched *mock_sched(int32_t n_vocab, int max_queue)
{
    struct mock *m = calloc(1, sizeof *m);
    m->n_vocab = n_vocab;
    for (int i = 0; i < MAX_SEQ; i++)
        m->hist[i] = calloc(CTX + 8, sizeof(int32_t));
    struct kv_config kc;
    kv_config_default(&kc);
    kc.n_layer = 2;
    kc.n_kv_head = 2;
    kc.head_dim = 64;
    kc.mem_budget = 64 * kv_page_bytes(&kc, QUANT_F16, QUANT_F16);
    assert_int_equal(kv_create(&kc, &m->kv), KS_OK);
    struct sched_engine e = {
        .ctx = m, .n_vocab = n_vocab, .seq_create = m_seq_create, .seq_free = m_seq_free, .forward = m_forward,
        .sampler_create = m_sampler_create, .sampler_next = m_sampler_next, .sampler_free = m_sampler_free,
        .cache = m_cache, .destroy = m_destroy,
    };
    struct sched_config cfg;
    sched_config_default(&cfg);
    cfg.parallel = 8;
    cfg.max_batch_tokens = 64;
    cfg.prefill_chunk = 16;
    cfg.ctx_size = CTX;
    cfg.max_queue = max_queue;
    struct sched *s = NULL;
    assert_int_equal(sched_create(&cfg, &e, &s), KS_OK);
    return s;
}

/* ---- fixture ------------------------------------------------------------------- */

struct fx {
    struct gguf_file *vocab;
    struct tokenizer *tok;
    struct sched *sched, *sched_full;
    struct server *srv, *srv_key, *srv_full;
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

static int setup(void **state)
{
    (void)state;
    const char *shared = getenv("KVSERVE_SHARED");
    char path[4096];
    snprintf(path, sizeof path, "%s/models/stories260K.gguf", shared ? shared : "../shared");
    if (access(path, R_OK) != 0)
        return 0; /* tests skip */
    if (gguf_open(path, &F.vocab) || tok_load(F.vocab, &F.tok))
        return -1;
    F.sched = mock_sched(tok_n_vocab(F.tok), 256);
    F.sched_full = mock_sched(tok_n_vocab(F.tok), 0);
    F.srv = start_server(F.sched, NULL);
    F.srv_key = start_server(F.sched, "sekret");
    F.srv_full = start_server(F.sched_full, NULL);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    server_stop(F.srv);
    server_stop(F.srv_key);
    server_stop(F.srv_full);
    sched_free(F.sched);
    sched_free(F.sched_full);
    tok_free(F.tok);
    gguf_close(F.vocab);
    return 0;
}

#define NEED_FIXTURE()                                                                                   \
    do {                                                                                                 \
        if (!F.tok) {                                                                                    \
            print_message("skipped: stories260K.gguf not found under KVSERVE_SHARED/models\n");          \
            skip();                                                                                      \
        }                                                                                                \
    } while (0)

/* ---- a tiny HTTP/1.1 client -------------------------------------------------------- */

struct resp {
    int status;
    char headers[4096];
    char *body;
    size_t len;
};

static void dechunk(struct resp *r)
{
    if (!strcasestr(r->headers, "transfer-encoding: chunked"))
        return;
    char *out = malloc(r->len + 1);
    size_t o = 0, i = 0;
    while (i < r->len) {
        size_t n = strtoul(r->body + i, NULL, 16);
        char *eol = strstr(r->body + i, "\r\n");
        if (!eol || n == 0)
            break;
        i = (size_t)(eol - r->body) + 2;
        if (i + n > r->len)
            n = r->len - i;
        memcpy(out + o, r->body + i, n);
        o += n;
        i += n + 2;
    }
    out[o] = '\0';
    free(r->body);
    r->body = out;
    r->len = o;
}

static struct resp http(struct server *srv, const char *method, const char *path, const char *extra_headers,
                        const char *body, size_t body_len)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)server_port(srv))};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    char head[1024];
    int n = snprintf(head, sizeof head,
                     "%s %s HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n%sContent-Type: application/json\r\n"
                     "Content-Length: %zu\r\n\r\n",
                     method, path, extra_headers ? extra_headers : "", body ? body_len : 0);
    assert_int_equal(send(fd, head, (size_t)n, MSG_NOSIGNAL), n);
    size_t sent = 0;
    while (body && sent < body_len) {
        ssize_t k = send(fd, body + sent, body_len - sent, MSG_NOSIGNAL);
        if (k <= 0)
            break; /* the server may answer (413) and close before reading it all */
        sent += (size_t)k;
    }
    struct resp r = {0};
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (len + 4096 > cap)
            buf = realloc(buf, cap *= 2);
        ssize_t k = recv(fd, buf + len, cap - len - 1, 0);
        if (k <= 0)
            break;
        len += (size_t)k;
    }
    close(fd);
    buf[len] = '\0';
    char *sep = strstr(buf, "\r\n\r\n");
    assert_non_null(sep);
    size_t hl = (size_t)(sep - buf);
    memcpy(r.headers, buf, hl < sizeof r.headers - 1 ? hl : sizeof r.headers - 1);
    sscanf(buf, "HTTP/1.%*d %d", &r.status);
    r.len = len - hl - 4;
    r.body = malloc(r.len + 1);
    memcpy(r.body, sep + 4, r.len);
    r.body[r.len] = '\0';
    free(buf);
    dechunk(&r);
    return r;
}

static struct resp post(struct server *srv, const char *path, const char *json)
{
    return http(srv, "POST", path, NULL, json, strlen(json));
}

/* Status and OpenAI error shape. */
static void expect_error(struct resp r, int status, const char *code)
{
    if (r.status != status)
        print_message("unexpected %d: %s\n", r.status, r.body);
    assert_int_equal(r.status, status);
    cJSON *j = cJSON_Parse(r.body);
    assert_non_null(j);
    cJSON *e = cJSON_GetObjectItem(j, "error");
    assert_true(cJSON_IsObject(e));
    assert_true(cJSON_IsString(cJSON_GetObjectItem(e, "message")));
    assert_true(cJSON_IsString(cJSON_GetObjectItem(e, "type")));
    assert_non_null(cJSON_GetObjectItem(e, "code"));
    if (code)
        assert_string_equal(cJSON_GetObjectItem(e, "code")->valuestring, code);
    cJSON_Delete(j);
    free(r.body);
}

/* The text the mock model produces for these prompt ids. */
static char *expected_text(const int32_t *prompt, int n_prompt, int n_gen)
{
    int32_t all[CTX];
    memcpy(all, prompt, (size_t)n_prompt * sizeof *all);
    for (int i = 0; i < n_gen; i++)
        all[n_prompt + i] = (int32_t)next_token_of(all, n_prompt + i, tok_n_vocab(F.tok));
    struct tok_stream *st;
    tok_stream_create(F.tok, TOK_DECODE_REPLACE_BAD, &st);
    size_t cap = 4096, len = 0;
    char *out = calloc(1, cap);
    for (int i = 0; i < n_gen; i++) {
        const char *b;
        size_t n;
        tok_stream_push(st, all[n_prompt + i], &b, &n);
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

/* Concatenate the text of an SSE stream; checks framing and [DONE]. */
static char *sse_text(const char *body, bool chat, char *finish, int *n_usage)
{
    size_t cap = 8192, len = 0;
    char *out = calloc(1, cap);
    bool done = false;
    *n_usage = -1;
    const char *p = body;
    while ((p = strstr(p, "data: ")) != NULL) {
        p += 6;
        const char *end = strstr(p, "\n\n");
        assert_non_null(end);
        if (!strncmp(p, "[DONE]", 6)) {
            done = true;
            break;
        }
        cJSON *j = cJSON_ParseWithLength(p, (size_t)(end - p));
        assert_non_null(j);
        cJSON *u = cJSON_GetObjectItem(j, "usage");
        if (u)
            *n_usage = cJSON_GetObjectItem(u, "completion_tokens")->valueint;
        cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
        if (ch) {
            cJSON *t = chat ? cJSON_GetObjectItem(cJSON_GetObjectItem(ch, "delta"), "content")
                            : cJSON_GetObjectItem(ch, "text");
            if (cJSON_IsString(t)) {
                memcpy(out + len, t->valuestring, strlen(t->valuestring));
                len += strlen(t->valuestring);
            }
            cJSON *f = cJSON_GetObjectItem(ch, "finish_reason");
            if (cJSON_IsString(f))
                strcpy(finish, f->valuestring);
        }
        cJSON_Delete(j);
        p = end;
    }
    assert_true(done);
    return out;
}

/* ---- tests ------------------------------------------------------------------------ */

static void test_health_models_404(void **state)
{
    (void)state;
    NEED_FIXTURE();
    struct resp r = http(F.srv, "GET", "/health", NULL, NULL, 0);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "\"ok\""));
    free(r.body);
    r = http(F.srv, "GET", "/v1/models", NULL, NULL, 0);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "\"mock\""));
    free(r.body);
    expect_error(http(F.srv, "GET", "/nope", NULL, NULL, 0), 404, "not_found");
    expect_error(http(F.srv, "GET", "/v1/completions", NULL, NULL, 0), 405, NULL);
    r = http(F.srv, "GET", "/", NULL, NULL, 0);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "<canvas"));
    free(r.body);
}

static void test_bad_requests(void **state)
{
    (void)state;
    NEED_FIXTURE();
    expect_error(post(F.srv, "/v1/completions", "{\"prompt\": \"hi\""), 400, "invalid_json");
    expect_error(post(F.srv, "/v1/completions", "[1,2]"), 400, "invalid_json");
    expect_error(post(F.srv, "/v1/completions", ""), 400, "invalid_json");
    expect_error(post(F.srv, "/v1/completions", "{\"prompt\": 5}"), 400, "invalid_type");
    expect_error(post(F.srv, "/v1/completions", "{\"prompt\": \"hi\", \"temperature\": \"hot\"}"), 400, "invalid_type");
    expect_error(post(F.srv, "/v1/completions", "{\"prompt\": \"hi\", \"max_tokens\": -3}"), 400, "invalid_value");
    expect_error(post(F.srv, "/v1/completions", "{\"prompt\": \"hi\", \"max_tokens\": 1.5}"), 400, "invalid_type");
    expect_error(post(F.srv, "/v1/completions", "{\"prompt\": \"hi\", \"n\": 2}"), 400, "invalid_value");
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
    expect_error(http(F.srv, "POST", "/v1/completions", NULL, huge, n), 413, "request_too_large");
    free(huge);
    /* the server is still fine */
    struct resp r = post(F.srv, "/v1/completions", "{\"prompt\": [1, 400, 401], \"max_tokens\": 3}");
    assert_int_equal(r.status, 200);
    free(r.body);
}

static void test_api_key_and_overload(void **state)
{
    (void)state;
    NEED_FIXTURE();
    expect_error(post(F.srv_key, "/v1/completions", "{\"prompt\": \"hi\"}"), 401, "invalid_api_key");
    expect_error(http(F.srv_key, "GET", "/metrics", "Authorization: Bearer wrong\r\n", NULL, 0), 401, NULL);
    struct resp r = http(F.srv_key, "GET", "/health", NULL, NULL, 0);
    assert_int_equal(r.status, 200);
    free(r.body);
    const char *body = "{\"prompt\": [1, 400], \"max_tokens\": 2}";
    r = http(F.srv_key, "POST", "/v1/completions", "Authorization: Bearer sekret\r\n", body, strlen(body));
    assert_int_equal(r.status, 200);
    free(r.body);
    r = post(F.srv_full, "/v1/completions", body);
    assert_non_null(strcasestr(r.headers, "Retry-After: 1"));
    expect_error(r, 503, "overloaded");
}

static void test_completion_matches_model(void **state)
{
    (void)state;
    NEED_FIXTURE();
    int32_t prompt[] = {1, 403, 404, 405};
    char *want = expected_text(prompt, 4, 12);
    struct resp r = post(F.srv, "/v1/completions",
                         "{\"model\":\"x\",\"prompt\": [1, 403, 404, 405], \"max_tokens\": 12, \"temperature\": 0, \"logprobs\": 2}");
    assert_int_equal(r.status, 200);
    cJSON *j = cJSON_Parse(r.body);
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
    free(r.body);

    /* the same as a stream */
    r = post(F.srv, "/v1/completions",
             "{\"prompt\": [1, 403, 404, 405], \"max_tokens\": 12, \"stream\": true, \"stream_options\": {\"include_usage\": true}}");
    assert_int_equal(r.status, 200);
    assert_non_null(strcasestr(r.headers, "text/event-stream"));
    char finish[32] = "";
    int n_usage;
    char *got = sse_text(r.body, false, finish, &n_usage);
    assert_string_equal(got, want);
    assert_string_equal(finish, "length");
    assert_int_equal(n_usage, 12);
    free(got);
    free(r.body);

    /* a stop string cuts the text before it, in both modes */
    size_t cut = strlen(want) / 2;
    char stop[8] = {0};
    memcpy(stop, want + cut, 3);
    char *at = strstr(want, stop);
    size_t keep = (size_t)(at - want);
    char body[512];
    snprintf(body, sizeof body, "{\"prompt\": [1, 403, 404, 405], \"max_tokens\": 12, \"stop\": [\"zzzz\", \"%s\"]}", stop);
    r = post(F.srv, "/v1/completions", body);
    j = cJSON_Parse(r.body);
    ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    assert_int_equal(strlen(cJSON_GetObjectItem(ch, "text")->valuestring), keep);
    assert_memory_equal(cJSON_GetObjectItem(ch, "text")->valuestring, want, keep);
    assert_string_equal(cJSON_GetObjectItem(ch, "finish_reason")->valuestring, "stop");
    cJSON_Delete(j);
    free(r.body);
    snprintf(body, sizeof body, "{\"prompt\": [1, 403, 404, 405], \"max_tokens\": 12, \"stream\": true, \"stop\": \"%s\"}", stop);
    r = post(F.srv, "/v1/completions", body);
    got = sse_text(r.body, false, finish, &n_usage);
    assert_int_equal(strlen(got), keep);
    assert_memory_equal(got, want, keep);
    assert_string_equal(finish, "stop");
    free(got);
    free(r.body);
    free(want);
}

static void test_chat(void **state)
{
    (void)state;
    NEED_FIXTURE();
    const char *body = "{\"messages\": [{\"role\": \"system\", \"content\": \"be brief\"}, "
                       "{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"Once upon\"}]}], "
                       "\"max_tokens\": 9, \"logprobs\": true, \"top_logprobs\": 1}";
    struct resp r = post(F.srv, "/v1/chat/completions", body);
    assert_int_equal(r.status, 200);
    cJSON *j = cJSON_Parse(r.body);
    assert_string_equal(cJSON_GetObjectItem(j, "object")->valuestring, "chat.completion");
    cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    cJSON *msg = cJSON_GetObjectItem(ch, "message");
    assert_string_equal(cJSON_GetObjectItem(msg, "role")->valuestring, "assistant");
    char *whole = strdup(cJSON_GetObjectItem(msg, "content")->valuestring);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(cJSON_GetObjectItem(ch, "logprobs"), "content")), 9);
    cJSON_Delete(j);
    free(r.body);

    char sbody[1024];
    snprintf(sbody, sizeof sbody, "%.*s, \"stream\": true}", (int)strlen(body) - 1, body);
    r = post(F.srv, "/v1/chat/completions", sbody);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "\"role\":\"assistant\""));
    char finish[32] = "";
    int n_usage;
    char *got = sse_text(r.body, true, finish, &n_usage);
    assert_string_equal(got, whole);
    assert_string_equal(finish, "length");
    free(got);
    free(whole);
    free(r.body);
}

struct client {
    int idx;
    char *text;
};

static void *client_main(void *arg)
{
    struct client *c = arg;
    char body[256];
    snprintf(body, sizeof body, "{\"prompt\": [1, %d, %d], \"max_tokens\": 40, \"stream\": true}", 310 + c->idx,
             320 + c->idx);
    struct resp r = post(F.srv, "/v1/completions", body);
    char finish[32];
    int n_usage;
    c->text = sse_text(r.body, false, finish, &n_usage);
    free(r.body);
    return NULL;
}

static void test_concurrent_streams(void **state)
{
    (void)state;
    NEED_FIXTURE();
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
        assert_string_equal(cl[i].text, want);
        free(want);
        free(cl[i].text);
    }
    struct resp r = http(F.srv, "GET", "/metrics", NULL, NULL, 0);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "kvserve_requests_running "));
    assert_non_null(strstr(r.body, "kvserve_ttft_seconds_bucket{le=\"+Inf\"}"));
    assert_non_null(strstr(r.body, "kvserve_itl_seconds_count"));
    free(r.body);
    r = http(F.srv, "GET", "/cache/usage", NULL, NULL, 0);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "\"requests\""));
    free(r.body);
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

/* The kv_policy object of /cache/usage. */
static cJSON *usage_policy(cJSON **root)
{
    struct resp r = http(F.srv, "GET", "/cache/usage", NULL, NULL, 0);
    assert_int_equal(r.status, 200);
    *root = cJSON_Parse(r.body);
    free(r.body);
    cJSON *p = cJSON_GetObjectItem(*root, "kv_policy");
    assert_true(cJSON_IsObject(p));
    return p;
}

static void test_cache_policy(void **state)
{
    (void)state;
    NEED_FIXTURE();
    cJSON *root;
    cJSON *p = usage_policy(&root);
    assert_string_equal(json_str(p, "policy"), "static");
    assert_true(json_num(p, "high_watermark") == 0.9);
    cJSON_Delete(root);

    struct resp r = post(F.srv, "/cache/policy",
                         "{\"policy\": \"dynamic\", \"high_watermark\": 0.7, \"low_watermark\": 0.5, \"hot_tokens\": 64,"
                         " \"sink_tokens\": 8, \"floor\": \"q8_0\", \"type_k\": \"q8_0\"}");
    if (r.status != 200)
        print_message("%s\n", r.body);
    assert_int_equal(r.status, 200);
    cJSON *j = cJSON_Parse(r.body);
    free(r.body);
    assert_string_equal(json_str(j, "policy"), "dynamic");
    assert_true(json_num(j, "high_watermark") == 0.7);
    assert_true(json_num(j, "low_watermark") == 0.5);
    assert_true(json_num(j, "hot_tokens") == 64);
    assert_true(json_num(j, "sink_tokens") == 8);
    assert_string_equal(json_str(j, "floor"), "q8_0");
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
    expect_error(post(F.srv, "/cache/policy", "{\"policy\": "), 400, "invalid_json");
    expect_error(http(F.srv, "GET", "/cache/policy", NULL, NULL, 0), 405, NULL);
    r = post(F.srv, "/cache/policy", "{\"policy\": \"static\", \"low_watermark\": 0.8}"); /* above high 0.7 */
    assert_non_null(strstr(r.body, "low_watermark"));
    expect_error(r, 400, "invalid_value");
    p = usage_policy(&root);
    assert_string_equal(json_str(p, "policy"), "dynamic");
    assert_true(json_num(p, "low_watermark") == 0.5);
    cJSON_Delete(root);

    /* an empty object changes nothing and answers the current policy; then restore */
    r = post(F.srv, "/cache/policy", "{}");
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "\"dynamic\""));
    free(r.body);
    r = post(F.srv, "/cache/policy", "{\"policy\": \"static\", \"high_watermark\": 0.9, \"low_watermark\": 0.8,"
                                     " \"type_k\": \"f16\"}");
    assert_int_equal(r.status, 200);
    free(r.body);
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

static void test_prefix_cache_routes(void **state)
{
    (void)state;
    NEED_FIXTURE();
    /* max_tokens 0: a warm-up answered at once, with usage and cached_tokens */
    struct resp r = post(F.srv, "/v1/completions", "{\"prompt\": [1, 400, 401], \"max_tokens\": 0}");
    assert_int_equal(r.status, 200);
    cJSON *j = cJSON_Parse(r.body);
    free(r.body);
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
    assert_non_null(strstr(r.body, "\"cached_tokens\":0"));
    free(r.body);
    /* a streamed warm-up: one chunk finishing with "length", then usage, then [DONE] */
    r = post(F.srv, "/v1/completions", "{\"prompt\": [1, 402], \"max_tokens\": 0, \"stream\": true,"
                                       " \"stream_options\": {\"include_usage\": true}}");
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "\"finish_reason\":\"length\""));
    assert_non_null(strstr(r.body, "\"completion_tokens\":0"));
    assert_non_null(strstr(r.body, "data: [DONE]"));
    free(r.body);
    r = post(F.srv, "/v1/chat/completions",
             "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_completion_tokens\": 0}");
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "\"content\":\"\""));
    assert_non_null(strstr(r.body, "\"cached_tokens\":"));
    free(r.body);
    expect_error(post(F.srv, "/v1/chat/completions",
                      "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_completion_tokens\": -1}"),
                 400, "invalid_value");
    /* start the listing below from an empty cache */
    r = post(F.srv, "/cache/clear", "{\"tier\": \"all\"}");
    assert_int_equal(r.status, 200);
    free(r.body);

    int32_t bad_ids = 1 << 20;
    assert_int_equal(sched_between_steps(F.sched, make_idle_chain, &bad_ids), KS_OK);
    r = http(F.srv, "GET", "/cache/prefixes?limit=5", NULL, NULL, 0);
    assert_int_equal(r.status, 200); /* ids outside the vocabulary do not break the preview */
    j = cJSON_Parse(r.body);
    free(r.body);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(j, "data")), 1);
    cJSON_Delete(j);
    r = post(F.srv, "/cache/clear", "{\"tier\": \"ram\"}");
    assert_non_null(strstr(r.body, "\"ram_pages_dropped\":2"));
    free(r.body);

    int32_t good_ids = 300;
    assert_int_equal(sched_between_steps(F.sched, make_idle_chain, &good_ids), KS_OK);
    r = http(F.srv, "GET", "/cache/prefixes?limit=5", NULL, NULL, 0);
    assert_int_equal(r.status, 200);
    j = cJSON_Parse(r.body);
    free(r.body);
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
    j = cJSON_Parse(r.body);
    free(r.body);
    cJSON *pre = cJSON_GetObjectItem(j, "prefix");
    assert_true(json_num(pre, "idle_pages") == 2 && json_num(pre, "keyed_pages") == 2);
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(j, "disk")));
    cJSON_Delete(j);
    r = http(F.srv, "GET", "/metrics", NULL, NULL, 0);
    assert_non_null(strstr(r.body, "\nkvserve_kv_idle_pages 2\n"));
    assert_non_null(strstr(r.body, "kvserve_prefix_hit_tokens_total{tier=\"disk\"} 0\n"));
    assert_non_null(strstr(r.body, "# TYPE kvserve_prefix_tokens_saved_total counter"));
    assert_null(strstr(r.body, "kvserve_disk_cache_bytes")); /* no SSD tier */
    free(r.body);

    /* /cache/clear: bad requests change nothing, then ram drops the idle pages */
    expect_error(post(F.srv, "/cache/clear", "{\"tier\": \"ssd\"}"), 400, "invalid_value");
    expect_error(post(F.srv, "/cache/clear", "{\"tier\": 3}"), 400, "invalid_value");
    expect_error(post(F.srv, "/cache/clear", "{\"everything\": true}"), 400, "unknown_field");
    expect_error(post(F.srv, "/cache/clear", "{\"tier\": \"disk\"}"), 400, "invalid_value");
    expect_error(post(F.srv, "/cache/clear", "{\"tier\""), 400, "invalid_json");
    expect_error(http(F.srv, "GET", "/cache/clear", NULL, NULL, 0), 405, NULL);
    r = post(F.srv, "/cache/clear", "{\"tier\": \"ram\"}");
    assert_int_equal(r.status, 200);
    j = cJSON_Parse(r.body);
    free(r.body);
    assert_true(json_num(j, "ram_pages_dropped") == 2 && json_num(j, "disk_entries_deleted") == 0);
    assert_true(json_num(j, "ram_bytes_freed") > 0);
    cJSON_Delete(j);
    r = post(F.srv, "/cache/clear", "{}");
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "\"tier\":\"all\""));
    free(r.body);
    r = http(F.srv, "GET", "/cache/prefixes", NULL, NULL, 0);
    assert_non_null(strstr(r.body, "\"data\":[]"));
    free(r.body);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prefix_cache_routes),
        cmocka_unit_test(test_health_models_404),
        cmocka_unit_test(test_bad_requests),
        cmocka_unit_test(test_api_key_and_overload),
        cmocka_unit_test(test_completion_matches_model),
        cmocka_unit_test(test_chat),
        cmocka_unit_test(test_concurrent_streams),
        cmocka_unit_test(test_cache_policy),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
