/* libFuzzer harness for the bodies of POST /v1/messages (Anthropic) and POST
 * /v1/responses (OpenAI) and for the translation of their answers: the
 * API's request translation (proxy_api.request) and then the chat route's
 * parse step on the translated body (server_completion_parse), in process,
 * without a daemon, a scheduler or a model; and the same input read as a
 * chat answer and as a chat stream's chunks, through the API's whole and
 * event translators.
 *
 * Input: byte 0 picks the API (bit 0: Responses, else Anthropic); the rest
 * is the body. The body also plays the chat completion the whole translator
 * reads, each element of its "chunks" array (or the body itself) a stream
 * chunk, then [DONE], and its "stop_word" the stop string that ended it.
 *
 * Oracle: no crash, over-read or leak (ASan); a rejected body is a 4xx with
 * a message; a translated body is a chat body the chat route accepts or
 * rejects with a 4xx (never a 500: only out of memory is one); the
 * translators' output is whole SSE events ("event: NAME\ndata: JSON\n\n")
 * whose data parses. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz/fuzz_vocab.h"
#include "server/server_completion_internal.h"
#include "server/server_proxy_internal.h"

static struct server srv;

static void check(bool ok, const char *what)
{
    if (!ok) {
        fprintf(stderr, "fuzz_apis: %s (last error: %s)\n", what, ks_errmsg());
        abort();
    }
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    srv.tok = fuzz_load_vocab("ggml-vocab-llama3.gguf");
    pthread_mutex_init(&srv.mu, NULL);
    struct server_config cfg;
    server_config_default(&cfg);
    srv.cfg = cfg;
    srv.model_name = "fuzz";
    check(server_chat_setup(&srv, &cfg) == KS_OK, "chat template setup");
    check(grammar_vocab_from_tokenizer(srv.tok, &srv.grammar_vocab) == KS_OK, "grammar vocabulary");
    return 0;
}

static void check_rejection(ks_status st)
{
    unsigned http = server_http_status(st);
    check(http >= 400 && http < 500, "a rejected body is a 4xx");
    check(ks_errmsg()[0] != '\0', "the rejection says why");
}

/* The translated body through the chat route's parse step. */
static void parse_chat(const cJSON *chat)
{
    char *body = cJSON_PrintUnformatted(chat);
    check(body != NULL, "print the chat body");
    struct reply r = {0};
    struct call *c = NULL;
    struct sched_request rq;
    ks_status st = server_completion_parse(&srv, true, body, strlen(body), &c, &rq, &r);
    if (st == KS_OK)
        server_completion_discard(c, &rq);
    else
        check_rejection(st);
    reply_free(&r);
    free(body);
}

/* Every event in out is whole: an optional event line, a data line whose JSON parses, a blank line. */
static void check_events(const struct sbuf *out)
{
    const char *p = out->p ? out->p : "";
    while (*p) {
        if (!strncmp(p, "event: ", 7)) {
            p = strchr(p, '\n');
            check(p != NULL, "an event line ends");
            p++;
        }
        check(!strncmp(p, "data: ", 6), "an event has a data line");
        const char *end = strstr(p, "\n\n");
        check(end != NULL, "an event ends with a blank line");
        cJSON *o = cJSON_ParseWithLength(p + 6, (size_t)(end - p - 6));
        check(cJSON_IsObject(o), "an event's data is a JSON object");
        cJSON_Delete(o);
        p = end + 2;
    }
}

/* A fresh per-request state of api, from a minimal valid request. */
static void *fresh_ctx(const struct proxy_api *api)
{
    static const char *const minimal[2] = {"{\"max_tokens\":1,\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}",
                                           "{\"input\":\"x\"}"};
    cJSON *root = cJSON_Parse(minimal[api == &server_responses_api]), *chat = NULL;
    void *ctx = NULL;
    struct reply r = {0};
    check(root && api->request(&srv, root, &chat, &ctx, &r) == KS_OK, "a minimal request translates");
    cJSON_Delete(chat);
    cJSON_Delete(root);
    return ctx;
}

/* The body as a chat answer and as a stream's chunks (its "chunks" array, or
 * itself) through the API's translators. */
static void translate_answers(const struct proxy_api *api, const cJSON *root)
{
    const cJSON *stop = cJSON_GetObjectItemCaseSensitive(root, "stop_word");
    struct proxy_facts f = {.n_prompt = 7, .stop_word = cJSON_IsString(stop) ? stop->valuestring : NULL};
    void *ctx = fresh_ctx(api);
    cJSON *out = NULL;
    server_json_reset();
    if (api->whole(ctx, root, &f, &out) == KS_OK) {
        char *s = cJSON_PrintUnformatted(out);
        check(s != NULL, "print the whole answer");
        free(s);
        cJSON_Delete(out);
    }
    api->ctx_free(ctx);
    ctx = fresh_ctx(api);
    struct sbuf events = {0};
    const cJSON *chunks = cJSON_GetObjectItemCaseSensitive(root, "chunks");
    const cJSON *chunk;
    if (cJSON_IsArray(chunks)) {
        cJSON_ArrayForEach(chunk, chunks) if (cJSON_IsObject(chunk)) {
            server_json_reset();
            check(api->event(ctx, chunk, &f, &events), "translate a chunk");
        }
    } else {
        check(api->event(ctx, root, &f, &events), "translate a chunk");
    }
    server_json_reset();
    check(api->event(ctx, NULL, &f, &events), "translate [DONE]");
    check(!events.oom, "events fit");
    check_events(&events);
    sbuf_free(&events);
    api->ctx_free(ctx);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    const struct proxy_api *api = data[0] & 1 ? &server_responses_api : &server_anthropic_api;
    server_json_reset();
    cJSON *root = cJSON_ParseWithLength((const char *)data + 1, size - 1);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return 0;
    }
    struct reply r = {0};
    cJSON *chat = NULL;
    void *ctx = NULL;
    ks_status st = api->request(&srv, root, &chat, &ctx, &r);
    if (st == KS_OK) {
        check(chat != NULL && ctx != NULL, "a translated request has a body and a state");
        parse_chat(chat);
        cJSON_Delete(chat);
        api->ctx_free(ctx);
    } else {
        check(chat == NULL && ctx == NULL, "a rejected request leaves nothing");
        check_rejection(st);
        api->error(&r, server_http_status(st), r.err_code, ks_errmsg());
        check(r.body && r.status >= 400 && r.status < 500, "the API's error reply");
    }
    reply_free(&r);
    translate_answers(api, root);
    cJSON_Delete(root);
    return 0;
}
