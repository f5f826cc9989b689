/* Internal to the server module: the server object, the reply helpers and
 * the handlers each file provides. */
#ifndef KS_SERVER_INTERNAL_H
#define KS_SERVER_INTERNAL_H

#include <microhttpd.h>
#include <pthread.h>
#include <stdarg.h>

#include <cjson/cJSON.h>

#include "server/server.h"

struct sbuf {
    char *p;
    size_t n, cap;
    bool oom;
};

void sbuf_append(struct sbuf *b, const char *s, size_t n);
void sbuf_printf(struct sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void sbuf_free(struct sbuf *b);

struct server {
    struct server_config cfg;
    char *host, *api_key, *model_name;
    struct sched *sched;
    const struct tokenizer *tok;
    enum tok_chat_family chat;
    struct MHD_Daemon *daemon;
    int port;
    pthread_mutex_t mu;
    bool ready;
    int in_flight;
    uint64_t next_call;
    uint64_t http_requests, http_errors;
};

/* A finished request handed back to the router: status + body + type. */
struct reply {
    unsigned status;
    char *body;               /* malloc'd */
    size_t len;
    const char *content_type;
    int retry_after;          /* > 0: Retry-After header (503) */
    struct MHD_Response *stream; /* set instead of body for SSE */
};

/* OpenAI-shaped error: {"error":{"message","type","code"}}. */
void reply_error(struct reply *r, unsigned status, const char *type, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
void reply_json(struct reply *r, unsigned status, cJSON *obj); /* takes obj */
void reply_text(struct reply *r, unsigned status, const char *content_type, char *body, size_t len);

/* server_completion.c */
void server_handle_completion(struct server *srv, bool chat, const char *body, size_t len, struct reply *r);
/* The handler's parse step alone (no scheduler is touched; tests/fuzz/fuzz_body.c
 * runs it on arbitrary bodies): body[0..len) (any bytes, not NUL-terminated)
 * -> a new call holding the options (stream, stop strings, logprobs) and rq
 * (rq->prompt malloc'd token ids in [0, n_vocab), 1 <= n_prompt < ctx_size,
 * 0 <= max_tokens <= ctx_size - n_prompt, sampling). Needs srv->tok, srv->chat,
 * srv->cfg.ctx_size and srv->mu.
 * Errors: KS_ERR_INVALID_ARG (r holds the 400 reply) or KS_ERR_INTERNAL (the
 * 500 reply: out of memory, tokenizer failure); *out is then untouched and rq
 * holds nothing to free. On KS_OK free both with server_completion_discard. */
struct call;
ks_status server_completion_parse(struct server *srv, bool chat, const char *body, size_t len, struct call **out,
                                  struct sched_request *rq, struct reply *r);
void server_completion_discard(struct call *c, struct sched_request *rq);

/* server_metrics.c */
void server_handle_metrics(struct server *srv, struct reply *r);
void server_handle_cache_usage(struct server *srv, struct reply *r);
void server_handle_requantize(struct server *srv, const char *body, size_t len, struct reply *r);
void server_handle_policy(struct server *srv, const char *body, size_t len, struct reply *r);

/* server_metrics.c: one Prometheus metric with its # HELP and # TYPE lines */
void server_metric(struct sbuf *b, const char *name, const char *type, const char *help, double v);

/* server_prefix.c: the prefix cache's routes and its parts of /cache/usage and /metrics */
struct kv_usage;
void server_handle_cache_clear(struct server *srv, const char *body, size_t len, struct reply *r);
void server_handle_cache_prefixes(struct server *srv, const char *limit_arg, struct reply *r);
cJSON *server_prefix_usage_json(const struct kv_usage *u, const struct sched_stats *st);
cJSON *server_disk_usage_json(struct server *srv); /* null without the SSD tier */
void server_prefix_metrics(struct server *srv, struct sbuf *b, const struct sched_stats *st, const struct kv_usage *u);

/* server_page.c */
void server_handle_page(struct server *srv, struct reply *r);

#endif
