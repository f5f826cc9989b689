/* libFuzzer harness for the body of POST /v1/chat/completions and
 * /v1/completions: server_completion_parse, the handler's parse step (JSON,
 * messages through the chat template, the prompt through the tokenizer, stop
 * strings, sampling options, max_tokens), in process, without a daemon, a
 * scheduler or a model.
 *
 * Input: byte 0 picks the route (bit 0: chat), a hand-written chat family
 * (bits 1-3) or the Jinja template (bit 5 clear: the vocabulary's template as
 * serve parses it), and a small or the default context (bit 4); the rest is
 * the body (messages, tools, response_format, grammar, options).
 *
 * Oracle: no crash, over-read or leak (ASan), and either a request whose
 * fields hold their documented ranges, or a 4xx status with a message (the
 * dispatcher writes OpenAI's error from it). A 500 is a bug here: the only
 * 500s are out of memory and tokenizer failures, and neither may happen on a
 * body this size. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz/fuzz_vocab.h"
#include "server/server_internal.h"

static struct server srv;

static void check(bool ok, const char *what)
{
    if (!ok) {
        fprintf(stderr, "fuzz_body: %s (last error: %s)\n", what, ks_errmsg());
        abort();
    }
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    /* the BPE vocabulary with the special tokens the chat templates write */
    srv.tok = fuzz_load_vocab("ggml-vocab-llama3.gguf");
    pthread_mutex_init(&srv.mu, NULL);
    /* as serve sets it up: the vocabulary's chat template (else the built-in
     * ChatML one) parsed once, and the grammar trie for response_format */
    struct server_config cfg;
    server_config_default(&cfg);
    check(server_chat_setup(&srv, &cfg) == KS_OK, "chat template setup");
    check(grammar_vocab_from_tokenizer(srv.tok, &srv.grammar_vocab) == KS_OK, "grammar vocabulary");
    return 0;
}

/* A route never builds its error body: the dispatcher makes the OpenAI error
 * from the status and ks_errmsg(). */
static void check_rejection(ks_status st, const struct reply *r)
{
    unsigned http = server_http_status(st);
    check(http >= 400 && http < 500, "a rejected body is a 4xx");
    check(ks_errmsg()[0] != '\0', "the rejection says why");
    check(r->body == NULL, "the route leaves the error body to the dispatcher");
}

static void check_request(const struct sched_request *rq)
{
    int32_t n_vocab = tok_n_vocab(srv.tok);
    check(rq->prompt && rq->n_prompt >= 1 && rq->n_prompt < srv.cfg.ctx_size, "prompt length in [1, ctx)");
    for (int32_t i = 0; i < rq->n_prompt; i++)
        check(rq->prompt[i] >= 0 && rq->prompt[i] < n_vocab, "prompt ids in the vocabulary");
    check(rq->max_tokens >= 0 && rq->max_tokens <= srv.cfg.ctx_size - rq->n_prompt, "max_tokens in [0, ctx - prompt]");
    const struct sample_params *p = &rq->sampling;
    check(p->temp >= 0 && p->temp <= 2, "temperature in [0, 2]");
    check(p->top_p > 0 && p->top_p <= 1, "top_p in (0, 1]");
    check(p->min_p >= 0 && p->min_p <= 1, "min_p in [0, 1]");
    check(p->top_k >= 0, "top_k >= 0");
    check(fabsf(p->presence_penalty) <= 2 && fabsf(p->frequency_penalty) <= 2, "penalties in [-2, 2]");
    check(p->repeat_penalty >= 0 && p->repeat_penalty <= 10, "repeat_penalty in [0, 10]");
    check(p->n_logprobs >= 0 && p->n_logprobs <= SAMPLE_MAX_LOGPROBS, "n_logprobs in [0, max]");
    check(rq->on_event && rq->user, "the request is wired to its call");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    bool chat = data[0] & 1;
    srv.chat.family = (enum tok_chat_family)(((data[0] >> 1) & 7) % TOK_CHAT_COUNT);
    srv.chat.by_family = data[0] & 32; /* a named hand-written family, else the Jinja template */
    srv.cfg.ctx_size = data[0] & 16 ? 64 : 4096;
    /* an exact-size copy, so ASan sees any read past the body's end */
    size_t len = size - 1;
    char *body = malloc(len ? len : 1);
    check(body != NULL, "malloc");
    memcpy(body, data + 1, len);

    struct reply r = {0};
    struct call *c = NULL;
    struct sched_request rq;
    ks_status st = server_completion_parse(&srv, chat, body, len, &c, &rq, &r);
    if (st == KS_OK) {
        check(c != NULL && r.body == NULL && r.status == 0, "success leaves the reply empty");
        check_request(&rq);
        server_completion_discard(c, &rq);
    } else {
        check(c == NULL, "a rejection makes no call");
        check_rejection(st, &r);
    }
    reply_free(&r);
    free(body);
    return 0;
}
