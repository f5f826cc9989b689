/* Internal to the server module: the server object, the reply helpers and
 * the handlers each file provides. */
#ifndef KS_SERVER_INTERNAL_H
#define KS_SERVER_INTERNAL_H

#include <microhttpd.h>
#include <pthread.h>
#include <stdarg.h>

#include <cjson/cJSON.h>

#include "jinja/jinja.h"
#include "grammar/grammar.h"
#include "sbuf/sbuf.h"
#include "server/server.h"

/* How a chat template's model writes tool calls (server_tools.c). */
enum server_tool_format {
    SERVER_TOOLS_NONE,    /* no tools offered (or tool_choice none): all text is content */
    SERVER_TOOLS_HERMES,  /* <tool_call>{...}</tool_call> */
    SERVER_TOOLS_LLAMA3,  /* {"name": ..., "parameters": ...}, <|python_tag|> */
    SERVER_TOOLS_MISTRAL, /* [TOOL_CALLS] [...] */
    SERVER_TOOLS_GENERIC, /* {"tool_calls": [...]} / {"tool_call": ...} / {"response": ...} */
    SERVER_TOOLS_HARMONY, /* gpt-oss: channels (reasoning, content) and commentary to=functions.NAME (server_harmony.c) */
};

struct server {
    struct server_config cfg;
    char *host, *api_key, *model_name;
    struct sched *sched;
    const struct tokenizer *tok;
    struct tok_chat_setup chat; /* the hand-written family the user named, or the Jinja template */
    enum server_tool_format tool_format; /* how the template's model writes tool calls */
    int32_t tool_tokens[12];    /* control tokens of the tool-call markup, kept in the text */
    int n_tool_tokens;
    bool template_thinks;       /* the template's model writes <think>...</think> */
    int32_t think_tokens[2];    /* <think>, </think> when they are control tokens, kept in the text */
    int n_think_tokens;
    struct grammar_vocab *grammar_vocab; /* tok's pieces for constrained sampling; NULL without tok */
    struct MHD_Daemon *daemon;
    int port;
    int max_conn;               /* the daemon's connection limit */
    bool host_loopback;         /* bound to a loopback address: Host must name it (server_guard.c) */
    struct server_watch *watch; /* the hangup watcher of suspended connections (server_wait.c) */
    pthread_mutex_t mu;
    bool ready;
    bool draining;              /* server_quiesce was called: /health answers 503 "draining" */
    int in_flight;
    uint64_t next_call;
    uint64_t http_requests, http_errors;
    /* POST /cache/requantize, one at a time, in slices between steps (under mu) */
    bool requant_running;
    int32_t requant_done, requant_total; /* pages converted / to convert (grows as streams add pages) */
    /* It waits for its slices on a thread of its own, not on a polling
     * thread (whose other connections would stall with it): server_stop
     * stops it at its next slice and joins it. */
    bool requant_thread_live, requant_stop;
    pthread_t requant_thread;
    /* tenant isolation (server_privacy.c) */
    char *admin_key;            /* NULL: the admin routes need only the API key */
    uint64_t tenant_key[2];     /* keys the hash that makes a tenant's cache salt from its API key */
};

/* One HTTP request as the routes see it (no libmicrohttpd in it, so routes
 * can be driven in-process). */
struct server_req {
    const char *method;       /* "GET", "HEAD", "POST", ... */
    const char *path;         /* without the query string */
    const char *authorization;/* the Authorization header, NULL if absent */
    const char *x_api_key;    /* the x-api-key header (Anthropic's clients send the key there), NULL if absent */
    const char *body;         /* never NULL ("" without a body) */
    size_t len;
    /* The value of a query argument, NULL if absent; arg may be NULL (no query). */
    const char *(*arg)(void *arg_ctx, const char *name);
    void *arg_ctx;
    /* The connection's way back after waiting for the scheduler; NULL (a
     * route driven in-process): the route blocks instead of waiting. */
    struct server_waker *waker;
};

/* The value of query argument name, NULL if absent. */
const char *server_req_arg(const struct server_req *rq, const char *name);

/* The answer a route fills: status + body + type, or a stream. */
struct reply {
    unsigned status;
    char *body;               /* malloc'd, or static when body_static */
    size_t len;
    bool body_static;
    const char *content_type;
    int retry_after;          /* > 0: Retry-After header (503) */
    const char *err_code;     /* OpenAI error code of a failed route (reply_fail), NULL: none */
    unsigned http_status;     /* a failed route's HTTP status when not server_http_status()'s (413), 0: that */
    /* SSE: set instead of body; the router makes the response from them. */
    MHD_ContentReaderCallback stream_read;
    MHD_ContentReaderFreeCallback stream_free;
    void *stream_cls;
    /* A whole reply the scheduler has yet to produce: set instead of body
     * (only with a waker). The router calls wait_poll each time the
     * connection is woken; it returns false while the reply is not ready,
     * else fills r or fails as a route does (*st) and has released wait_cls.
     * wait_abort releases wait_cls (cancelling the work) when the client has
     * gone. */
    bool (*wait_poll)(void *wait_cls, struct reply *r, ks_status *st);
    void (*wait_abort)(void *wait_cls);
    void *wait_cls;
};

/* ---- waiting without a thread (server_wait.c) -------------------------------------
 *
 * The daemon serves every connection from a few polling threads, so a route
 * never blocks while the scheduler generates: the connection is suspended
 * (MHD_suspend_connection) and resumed when the scheduler delivers an event.
 * A waker is that link, shared (refcounted) by the connection and the work
 * it waits for. While suspended, libmicrohttpd does not watch the socket, so
 * a watcher thread polls the suspended sockets for a hangup and resumes the
 * connection marked gone; the router (or the stream reader) then cancels the
 * work through the normal release path. */
struct server_waker;
/* A waker for connection conn of srv's daemon (one reference), NULL when out of memory. */
struct server_waker *server_waker_new(struct server *srv, struct MHD_Connection *conn);
void server_waker_ref(struct server_waker *w);
void server_waker_unref(struct server_waker *w);
/* The connection is closing (MHD's completion callback): later wakes do nothing. */
void server_waker_detach(struct server_waker *w);
/* Any thread: what the connection waits for has happened (a token, the end). */
void server_wake(struct server_waker *w);
/* The polling thread, inside an access handler or content reader of w's
 * connection: suspend it until the next server_wake. false: a wake arrived
 * since the last sleep (or the client has gone), so look again instead. */
bool server_waker_sleep(struct server_waker *w);
/* The client closed its connection while the work waited. */
bool server_waker_gone(struct server_waker *w);
/* The watcher thread (started before the daemon, stopped after it). It
 * also enforces the header deadline: a request's headers must be complete
 * within timeout_s of the connection's opening or of its previous request's
 * end, or the socket is shut down (slowloris). */
ks_status server_watch_start(struct server *srv, int timeout_s);
void server_watch_stop(struct server *srv);
/* Resume every suspended connection as gone (its work is cancelled): the
 * daemon must not be stopped with a connection suspended. */
void server_watch_release_all(struct server *srv);
/* MHD's connection notifications (open: STARTED, else CLOSED). */
void server_watch_connection(struct server *srv, struct MHD_Connection *conn, void **socket_context, bool open);
/* A request's headers arrived (began), or its reply is done (!began). */
void server_watch_request(struct server *srv, struct MHD_Connection *conn, bool began);

/* ---- the front door (server_guard.c) ----------------------------------------------
 *
 * Checks made from the request's headers alone, before its body is read:
 * DNS rebinding (Host), cross-site requests (Origin, CORS preflight) and the
 * body's type. */
struct server_head {
    const char *method, *path;
    const char *host, *origin, *content_type;
    const char *acr_method, *acr_headers; /* Access-Control-Request-Method / -Headers */
};
/* Fills r with the refusal (421 Host, 403 Origin, 415 Content-Type on a
 * POST route) or the answer to a CORS preflight (OPTIONS, 204), and returns
 * true; false: the request may go on. post_route: the path is a POST route. */
bool server_guard(const struct server *srv, const struct server_head *h, bool post_route, struct reply *r);
/* The CORS headers of a reply to h (an allowed cross-origin request), added to resp. */
void server_guard_cors_headers(const struct server *srv, const struct server_head *h, struct MHD_Response *resp);
/* The OpenAI-shaped error reply (server.c); r's previous content is released. */
void server_reply_error(struct reply *r, unsigned status, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* An error reply of any API's shape: o (deleted here) printed as JSON with
 * status, or, when it cannot be, 500 with the static oom_body (an error is
 * never an empty body). r must be empty (reply_free). */
void server_reply_error_json(struct reply *r, unsigned status, cJSON *o, const char *oom_body);

/* A route: reads the request, fills r and returns KS_OK, or returns a failed
 * status with ks_errmsg() saying why (reply_fail adds an OpenAI error code).
 * It never builds an error body: the dispatcher turns a failed status into
 * {"error":{"message","type","code"}} with the HTTP status of
 * server_http_status(), and a KS_OK without a filled reply into a 500. */
typedef ks_status (*server_route_fn)(struct server *srv, const struct server_req *rq, struct reply *r);

/* Auth, routing (404, 405), the route, then the error convention above.
 * Always leaves a complete reply in r. */
void server_dispatch(struct server *srv, const struct server_req *rq, struct reply *r);
/* Release what a reply holds (a body, or a stream that was never sent). */
void reply_free(struct reply *r);

/* HTTP status of a failed ks_status: 400 bad input (invalid argument,
 * format, range), 404 not found, 409 KV cache full, 501 unsupported, 503
 * state (queue full, shutting down, tier disabled), 500 the rest (out of
 * memory, I/O, internal). */
unsigned server_http_status(ks_status st);

/* ks_fail(st, fmt, ...) and r->err_code = code; returns st. */
ks_status reply_fail(struct reply *r, ks_status st, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* 200-style replies. reply_json takes obj and fails with KS_ERR_NOMEM when
 * obj is NULL, cannot be printed, or a JSON allocation of this thread failed
 * since server_json_reset() (cJSON's Add functions fail silently, and a tree
 * with holes must not be sent). reply_text takes body. */
ks_status reply_json(struct reply *r, unsigned status, cJSON *obj);
ks_status reply_text(struct reply *r, unsigned status, const char *content_type, char *body, size_t len);

/* cJSON allocates through a hook that notes failures per thread (installed
 * by server_start). reset clears this thread's note; failed reads it. Hooks
 * that build JSON on the scheduler thread reset and read it there. */
void server_json_reset(void);
bool server_json_failed(void);
/* cJSON_AddItemToObject / cJSON_AddItemToArray that delete item when it
 * cannot be added (the key's copy failed, or obj is NULL after an earlier
 * failure) instead of leaking it, and note the failure. */
void server_json_add(cJSON *obj, const char *key, cJSON *item);
void server_json_push(cJSON *arr, cJSON *item);
/* Parse a request body that must be a JSON object: KS_ERR_INVALID_ARG
 * (code invalid_json) when it is not, KS_ERR_NOMEM when parsing ran out of
 * memory. An empty body is {} when empty_is_object. */
ks_status server_parse_object(const char *body, size_t len, bool empty_is_object, cJSON **out, struct reply *r);

/* server_chat.c: chat requests -> prompt text. setup (at start) parses the
 * Jinja template (cfg->chat_template_jinja, else the model's, else a
 * built-in chatml), or picks the family cfg->chat_template names; a template
 * that does not parse is KS_ERR_FORMAT naming line and column. */
ks_status server_chat_setup(struct server *srv, const struct server_config *cfg);
void server_chat_free(struct server *srv);
/* The prompt text of a chat request (malloc'd NUL-terminated *out): its
 * messages checked (400 naming the message), rendered with tools and
 * chat_template_kwargs; a template error is a 400 with its message, a
 * render limit a 413. */
ks_status server_chat_prompt(struct server *srv, const cJSON *root, char **out, struct reply *r);

enum server_tool_choice { SERVER_TOOL_AUTO, SERVER_TOOL_NONE, SERVER_TOOL_REQUIRED, SERVER_TOOL_NAMED };
struct server_tool_opts {
    enum server_tool_choice choice;
    bool parallel;     /* parallel_tool_calls (default true) */
    int n_tools;       /* entries of 'tools' */
    char name[128];    /* SERVER_TOOL_NAMED: the function */
};
/* tools (OpenAI shape), tool_choice and parallel_tool_calls, checked: 400
 * naming the bad field. */
ks_status server_parse_tool_options(const cJSON *root, struct server_tool_opts *o, struct reply *r);

/* server_tools.c: tool calls in a model's output (formats in the file's
 * header). The format comes from the chat template's text, as llama.cpp's
 * chat-format detection picks it. */
struct server_tool_call {
    char *name;
    char *arguments;      /* JSON text of the arguments object */
};
struct server_tool_result {
    size_t content_end;   /* text[0..content_end) is content (before the first call, or all) */
    size_t tail_start;    /* text[tail_start..n) is content after the calls (final parses only) */
    struct server_tool_call *calls;
    int n_calls;          /* complete calls, in order */
    char *response;       /* generic {"response": TEXT}: the content instead of the text, else NULL */
};
enum server_tool_format server_tool_format_detect(const char *tmpl, size_t len); /* NULL: generic */
const char *server_tool_format_name(enum server_tool_format f);
/* Parse text[0..n). Not final: content_end holds back a marker or a tail
 * that may become one; only complete calls count; tail_start is n. Final:
 * text that does not parse as calls is content. Errors: KS_ERR_NOMEM (r is
 * then empty). Free r with server_tool_result_free. */
ks_status server_tools_parse(enum server_tool_format f, const char *text, size_t n, bool final,
                             struct server_tool_result *r);
void server_tool_result_free(struct server_tool_result *r);
/* Append the call (name, raw: its arguments' text, malloc'd, taken and freed
 * here; NULL means out of memory) to (*calls)[0..*n_calls), both as valid
 * UTF-8 (the model's bytes may not be, and the answer is JSON: U+FFFD as in
 * content). KS_ERR_NOMEM leaves the calls as they were. */
ks_status server_tool_call_append(struct server_tool_call **calls, int *n_calls, const char *name, char *raw);
/* server_harmony.c: gpt-oss's harmony format (channels in the file's header). */
struct server_harmony {
    struct sbuf reasoning;  /* the analysis messages' text, in order */
    struct sbuf content;    /* the final messages' (and commentary preambles') text */
    struct server_tool_call *calls;
    int n_calls;            /* complete calls to=functions.NAME, in order */
};
/* A template that writes harmony (its text has <|channel|> and <|message|>). */
bool server_harmony_template(const char *tmpl, size_t len);
/* The format's markup texts (control tokens the parser needs in the text). */
const char *const *server_harmony_markup(int *n);
/* Parse the output text[0..n) (what follows the prompt's <|start|>assistant).
 * Not final: a tail that may become a marker is held back and an unfinished
 * call does not count. calls false: tool calls are not parsed (their bodies
 * are content). KS_ERR_NOMEM (h is then empty). Free h with
 * server_harmony_free. */
ks_status server_harmony_parse(const char *text, size_t n, bool final, bool calls, struct server_harmony *h);
void server_harmony_free(struct server_harmony *h);
/* server_think.c: reasoning in <think>...</think> (rules in the file's header). */
struct server_think {
    bool reasoning;               /* the output has a reasoning part (opened, or the prompt opened it) */
    bool closed;                  /* its </think> is in the text */
    size_t reasoning_start, reasoning_end; /* text[start..end): the reasoning, stripped */
    size_t content_start;         /* text[content_start..n): the content (empty while held back) */
};
/* A template whose model thinks in <think>...</think> (it writes both tags). */
bool server_think_template(const char *tmpl, size_t len);
/* The rendered prompt ends inside an opened <think> (DeepSeek-R1's
 * generation prompt, Qwen3.5's): the output starts in the reasoning. */
bool server_think_prompt_open(const char *prompt, size_t len);
/* Split the output text[0..n); open: the prompt opened the reasoning. Not
 * final: a tail that may still become a tag or trailing whitespace of the
 * reasoning is held back. Never fails. */
void server_think_parse(const char *text, size_t n, bool open, bool final, struct server_think *r);
/* server_tools_grammar.c: the GBNF (malloc'd *gbnf) whose language is
 * exactly the calls o requires (tool_choice required: one call of any tool,
 * a named one: of that tool; more than one only with o->parallel, and never
 * in the llama3 format, whose templates refuse several) in format
 * f, each call's arguments valid against its function's 'parameters' (tools
 * as server_parse_tool_options checked them). Markup that is a control token
 * of tok (NULL: none) is a <[id]> terminal. *fell_back: some tool's schema
 * is outside the grammar's subset and its arguments are any JSON object.
 * Errors: KS_ERR_INVALID_ARG f is SERVER_TOOLS_NONE; KS_ERR_NOMEM. */
ks_status server_tools_grammar(enum server_tool_format f, const struct tokenizer *tok, const cJSON *tools,
                               const struct server_tool_opts *o, char **gbnf, bool *fell_back);
/* The triggers of that grammar used lazily (tool_choice auto): the markup
 * that starts a call in format f (a control token of tok as a token
 * trigger), or for llama3 and generic the call's opening JSON as the first
 * text of the answer. */
void server_tools_triggers(enum server_tool_format f, const struct tokenizer *tok, struct grammar_triggers *t);

/* The routes, one per file that serves them (see the table in server.c). */
/* server_completion.c */
ks_status server_route_chat(struct server *srv, const struct server_req *rq, struct reply *r);
ks_status server_route_completions(struct server *srv, const struct server_req *rq, struct reply *r);
/* The completion routes' parse step alone (no scheduler is touched;
 * tests/fuzz/fuzz_body.c runs it on arbitrary bodies): body[0..len) (any
 * bytes, not NUL-terminated) -> a new call holding the options (stream, stop
 * strings, logprobs) and rq (rq->prompt malloc'd token ids in [0, n_vocab),
 * 1 <= n_prompt < ctx_size, 0 <= max_tokens <= ctx_size - n_prompt,
 * sampling). Needs srv->tok, srv->chat, srv->cfg.ctx_size and srv->mu.
 * Errors: a failed status with r's error code set (reply_fail): KS_ERR_INVALID_ARG
 * for a 400, KS_ERR_NOMEM or another for a 500; *out is then untouched and rq
 * holds nothing to free. On KS_OK free both with server_completion_discard. */
struct call;
ks_status server_completion_parse(struct server *srv, bool chat, const char *body, size_t len, struct call **out,
                                  struct sched_request *rq, struct reply *r);
void server_completion_discard(struct call *c, struct sched_request *rq);

/* server_llama.c: llama-server's routes */
ks_status server_route_tokenize(struct server *srv, const struct server_req *rq, struct reply *r);
ks_status server_route_detokenize(struct server *srv, const struct server_req *rq, struct reply *r);
ks_status server_route_props(struct server *srv, const struct server_req *rq, struct reply *r);
ks_status server_route_slots(struct server *srv, const struct server_req *rq, struct reply *r);
/* server_completion.c: POST /completion, llama-server's native completion */
ks_status server_route_completion_native(struct server *srv, const struct server_req *rq, struct reply *r);
/* POST /infill (server_infill.c): fill-in-the-middle as llama-server
 * assembles it, answered as /completion. */
ks_status server_route_infill(struct server *srv, const struct server_req *rq, struct reply *r);
/* server_completion_parse.c: the sampling a /completion request that names
 * no field gets (llama-server's defaults under the server's flags). */
void server_native_sampling(const struct server *srv, struct sample_params *p);
/* server_samplers.c: the other samplers' defaults (typical_p, dry_*, mirostat,
 * samplers, ...) into /props' default_generation_settings.params. */
void server_samplers_props(const struct server *srv, cJSON *params);

/* server_chat.c: POST /apply-template, the prompt text of a chat request (llama-server's route) */
ks_status server_route_apply_template(struct server *srv, const struct server_req *rq, struct reply *r);

/* server_metrics.c */
ks_status server_route_metrics(struct server *srv, const struct server_req *rq, struct reply *r);
ks_status server_route_cache_usage(struct server *srv, const struct server_req *rq, struct reply *r);
ks_status server_route_requantize(struct server *srv, const struct server_req *rq, struct reply *r);
/* Stop a running requantization at its next slice and wait for its thread. */
void server_requantize_stop(struct server *srv);
ks_status server_route_policy(struct server *srv, const struct server_req *rq, struct reply *r);

/* server_metrics.c: one Prometheus metric with its # HELP and # TYPE lines */
void server_metric(struct sbuf *b, const char *name, const char *type, const char *help, double v);

/* server_prefix.c: the prefix cache's routes and its parts of /cache/usage and /metrics */
struct kv_usage;
ks_status server_route_cache_clear(struct server *srv, const struct server_req *rq, struct reply *r);
ks_status server_route_cache_prefixes(struct server *srv, const struct server_req *rq, struct reply *r);
/* ?prompt= or ?tokens= of /cache/prefixes: the pages of it held here (server_affinity.c) */
ks_status server_route_prefix_held(struct server *srv, const struct server_req *rq, struct reply *r);

/* server_json_strict.c: 400 (invalid_json) for a parsed body with bytes after
 * its value (end: where cJSON stopped), invalid UTF-8, \u0000 in a string or
 * a key twice in one object (r NULL: the status only). */
ks_status server_json_strict(const char *body, size_t len, const char *end, const cJSON *root, struct reply *r);

/* The error code of a status, for errors whose route names none (server.c). */
const char *server_default_error_code(unsigned status);

/* server_privacy.c: the admin key, cache salts. init copies the admin key and
 * makes the tenants' hash key (KS_ERR_NOMEM, KS_ERR_IO); free wipes them. */
ks_status server_privacy_init(struct server *srv);
void server_privacy_free(struct server *srv);
/* The request's "cache_salt" (a non-empty string) -> rq->cache_salt; 400 otherwise. */
ks_status server_parse_cache_salt(const cJSON *root, struct sched_request *rq, struct reply *r);
/* With --cache-salt-from-key: fold the bearer token's keyed hash into rq->cache_salt. */
void server_salt_from_key(const struct server *srv, const char *authorization, struct sched_request *rq);
/* Is the header's bearer token the admin key? */
bool server_admin_key_matches(const struct server *srv, const char *authorization);
/* An admin route without the admin key (when one is set): the 401/403 reply is in r, true. */
bool server_admin_refuse(const struct server *srv, const char *path, const char *authorization, struct reply *r);
cJSON *server_prefix_usage_json(const struct kv_usage *u, const struct sched_stats *st);
cJSON *server_disk_usage_json(struct server *srv); /* null without the SSD tier */
void server_prefix_metrics(struct server *srv, struct sbuf *b, const struct sched_stats *st, const struct kv_usage *u);
cJSON *server_redis_usage_json(struct server *srv); /* null without the shared tier (server_redis.c) */
void server_redis_metrics(struct server *srv, struct sbuf *b);

/* server_completion_parse.c: does a request's 'model' name the served model (its /v1/models id, the
 * file's name with or without .gguf, its path, or "")? */
bool server_model_served(const struct server *srv, const char *name);

/* server_embed.c: POST /v1/embeddings (OpenAI's shape) and /embeddings (llama-server's) */
ks_status server_route_embeddings(struct server *srv, const struct server_req *rq, struct reply *r);
ks_status server_route_embeddings_native(struct server *srv, const struct server_req *rq, struct reply *r);

/* server_page.c: the live page, embedded at build time from src/server/page/ */
ks_status server_route_page(struct server *srv, const struct server_req *rq, struct reply *r);

/* server_anthropic.c: Anthropic's POST /v1/messages and /v1/messages/count_tokens */
ks_status server_route_messages(struct server *srv, const struct server_req *rq, struct reply *r);
ks_status server_route_count_tokens(struct server *srv, const struct server_req *rq, struct reply *r);
/* A path of Anthropic's API: its errors are {"type":"error","error":{"type","message"}} */
bool server_anthropic_path(const char *path);
/* That error reply (r's previous content is released); code is unused (Anthropic's type follows status). */
void server_anthropic_error(struct reply *r, unsigned status, const char *code, const char *msg);
/* server_responses.c: OpenAI's POST /v1/responses */
ks_status server_route_responses(struct server *srv, const struct server_req *rq, struct reply *r);

#endif
