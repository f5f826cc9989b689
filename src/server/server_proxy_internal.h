/* Internal to the routes that speak another vendor's API over the chat route
 * (server_anthropic.c: /v1/messages, server_responses.c: /v1/responses).
 *
 * Such a route translates its request into a /v1/chat/completions body and
 * hands it to server_proxy_chat, which serves it with the chat route itself
 * (template, tool-call parsing, reasoning split, grammar, scheduler), then
 * turns the chat answer back into the API's shape: a whole answer through
 * api->whole, a stream chunk by chunk through api->event (the chat stream's
 * SSE bytes are parsed as they arrive), a failure through api->error. */
#ifndef KS_SERVER_PROXY_INTERNAL_H
#define KS_SERVER_PROXY_INTERNAL_H

#include "server/server_internal.h"

/* What the chat answer's JSON does not say. */
struct proxy_facts {
    int32_t n_prompt;       /* prompt tokens (0: unknown) */
    int32_t n_cached;       /* of which the prefix cache served (so far, in a stream) */
    const char *stop_word;  /* the stop string that ended the answer, NULL: none (or unknown) */
};

struct proxy_api {
    /* root (the parsed body) -> the chat body (*chat, a new object) and the
     * API's per-request state (*ctx, freed with ctx_free). Errors: a 400
     * naming the API's field, KS_ERR_NOMEM (reply_fail; nothing to free). */
    ks_status (*request)(const struct server *srv, const cJSON *root, cJSON **chat, void **ctx, struct reply *r);
    /* The chat completion (a chat.completion object) -> the API's answer
     * (*out, a new object). Errors: KS_ERR_NOMEM. */
    ks_status (*whole)(void *ctx, const cJSON *chat, const struct proxy_facts *f, cJSON **out);
    /* One chat stream chunk (an object: a chunk, a usage chunk or an
     * {"error":...}; NULL: the stream's [DONE]) -> the API's SSE events
     * appended to out. false: out of memory. */
    bool (*event)(void *ctx, const cJSON *chunk, const struct proxy_facts *f, struct sbuf *out);
    /* The error reply of a failed request (status, message, OpenAI code or NULL). */
    void (*error)(struct reply *r, unsigned status, const char *code, const char *msg);
    void (*ctx_free)(void *ctx);
};

/* server_anthropic.c, server_responses.c (also driven by tests/fuzz/fuzz_apis.c) */
extern const struct proxy_api server_anthropic_api, server_responses_api;

/* A route of api: the body parsed, api->request, then server_proxy_chat.
 * Always fills r (failures in the API's error shape) and returns KS_OK. */
ks_status server_proxy_route(struct server *srv, const struct server_req *rq, const struct proxy_api *api,
                             struct reply *r);
/* Serve chat (a /v1/chat/completions body; taken and deleted) with the
 * chat route, answering in api's shape. ctx is the API's per-request state,
 * taken (freed with api->ctx_free, also on failure). Always fills r (a
 * failure is api->error's reply) and returns KS_OK. */
ks_status server_proxy_chat(struct server *srv, const struct server_req *rq, cJSON *chat, const struct proxy_api *api,
                            void *ctx, struct reply *r);
/* The failed status st (ks_errmsg(), r's error code and HTTP status) as
 * api->error's reply; returns KS_OK. */
ks_status server_proxy_fail(const struct proxy_api *api, struct reply *r, ks_status st);

/* One SSE event "event: NAME\ndata: JSON\n\n" (name NULL: no event line);
 * o is deleted. false: out of memory (a JSON allocation since
 * server_json_reset included); out then holds what it held before. */
bool server_sse_event(struct sbuf *out, const char *name, cJSON *o);

/* msg with each whole word from (a field name of the chat route) replaced by
 * to (the API's name for it), into out[0..size): the chat route's errors
 * name its own fields. */
void server_proxy_rename(char *out, size_t size, const char *msg, const char *from, const char *to);
/* The serial number of a chat id ("chatcmpl-42" -> "42"). */
const char *server_proxy_serial(const char *chat_id);
/* The text of a string or of an array of {"type": one of types, "text"}
 * blocks joined with "\n" (*out malloc'd). Errors: KS_ERR_INVALID_ARG v is
 * neither (or a block is not one of types), KS_ERR_NOMEM; no message set. */
ks_status server_proxy_join_text(const cJSON *v, const char *const *types, int n_types, char **out);
/* Why server_proxy_join_text refused v, as a 400 on r naming the field:
 * where is its name in the request ("messages[2].content"), kinds the parts
 * it takes in words ("text blocks"). A part of another type is refused by
 * that type (an image, a file: kvserve reads text only). */
ks_status server_proxy_refuse_parts(struct reply *r, const cJSON *v, const char *const *types, int n_types,
                                    const char *where, const char *kinds);
/* Copy root's fields map[i][0] into chat as map[i][1] (those present), and
 * ask for the usage chunk when root streams (the answers carry usage). */
void server_proxy_copy_fields(cJSON *chat, const cJSON *root, const char *const (*map)[2], size_t n);

#endif
