/* server: the OpenAI-compatible HTTP API over the scheduler, on libmicrohttpd
 * (a few epoll threads for all connections; a request waiting for the model
 * holds no thread) with cJSON.
 *
 * Routes: POST /v1/chat/completions, POST /v1/completions (SSE streaming or
 * not), GET /v1/models (each also without /v1), llama-server's POST
 * /completion, /infill, /tokenize, /detokenize, /apply-template, GET /props, /slots,
 * GET /health, GET /metrics (Prometheus text),
 * GET /cache/usage, POST /cache/requantize, POST /cache/policy,
 * GET /cache/prefixes, POST /cache/clear (the prefix cache's RAM and SSD
 * tiers), GET / (a live page of the KV pool), POST /v1/embeddings and
 * llama-server's POST /embeddings (with --embeddings). Errors have OpenAI's shape
 * {"error":{"message","type","code"}}. The server tokenizes and detokenizes;
 * the scheduler only sees token ids. */
#ifndef KS_SERVER_H
#define KS_SERVER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "sched/sched.h"
#include "status/status.h"
#include "tokenizer/tokenizer.h"

struct store;
struct store_redis;
struct store_events;

/* Where a thinking model's reasoning goes (llama-server's reasoning_format). */
enum server_reasoning_format {
    SERVER_REASONING_AUTO,     /* as deepseek when the chat template thinks (<think>), else none */
    SERVER_REASONING_NONE,     /* everything in content, tags included */
    SERVER_REASONING_DEEPSEEK, /* <think>...</think> in reasoning_content, the rest in content */
};
/* "auto", "none" or "deepseek" -> *out; false for any other name. */
bool server_reasoning_format_parse(const char *name, enum server_reasoning_format *out);

struct server_config {
    const char *host;         /* "127.0.0.1" */
    int port;                 /* 8080; 0 picks a free port (see server_port) */
    const char *api_key;      /* NULL: no auth; else Bearer KEY on all but /health and / (the page) */
    size_t max_body;          /* bytes (8 MB); larger bodies get 413 */
    const char *model_name;   /* id reported by /v1/models and in responses */
    int32_t ctx_size;         /* prompts of this many tokens or more get 400 */
    const char *chat_template;/* a hand-written family by name (tok_chat_by_name), NULL: Jinja */
    const char *chat_template_jinja;  /* Jinja template text overriding the model's (NUL-terminated,
                                         copied at start), NULL: the model's tokenizer.chat_template
                                         (a model without one gets ChatML) */
    const char *chat_template_origin; /* names chat_template_jinja in errors, e.g. the file's path */
    int64_t chat_now;         /* the time templates see (strftime_now, date_string), seconds since
                                 the epoch; 0: the clock at each request (tests pin it) */
    struct store *store;      /* the prefix cache's SSD tier (borrowed), NULL: none */
    struct store_redis *redis;/* its shared tier (borrowed), NULL: none */
    struct store_events *events; /* its KV events publisher (borrowed), NULL: none (--kv-events) */
    /* connections: any number are served by a few polling threads */
    int timeout_s;            /* a connection idle this long (no byte in or out, or headers not complete)
                                 is closed, seconds (30); a request waiting for the model is not idle */
    int max_conn;             /* open connections; 0: the open-file limit less 128 for the model and cache */
    int max_conn_per_ip;      /* open connections from one address (64); 0: no limit */
    /* cross-site requests and DNS rebinding (borrowed, NULL-terminated lists; NULL: empty) */
    const char *const *cors_origins;  /* origins (scheme://host[:port]) allowed to make cross-origin
                                         requests, "*": any; others get 403 */
    const char *const *allowed_hosts; /* Host names accepted besides localhost, 127.0.0.1 and [::1]
                                         when bound to a loopback address; others get 421 */
    /* tenant isolation (server_privacy.c) */
    const char *admin_key;    /* NULL or "": none; else Bearer ADMIN_KEY on /cache/{clear,policy,requantize,prefixes}
                                 and /slots (401 without a key, 403 with another), and accepted wherever the API key is */
    bool cache_salt_from_key; /* salt each request's prefix cache with a keyed hash of its bearer token */
    bool cache_show_text;     /* /cache/prefixes shows the chains' first tokens as text (off: counts and keys) */
    enum server_reasoning_format reasoning_format; /* --reasoning-format; a request's reasoning_format overrides it */
    int parallel;             /* the scheduler's --parallel, reported by /props as total_slots (0: 1) */
    const char *model_path;   /* reported by /props, NULL: "" */
    /* Server-wide sampling defaults (--temp, --top-k, ...) of the fields a
     * request leaves out; only those whose SERVER_SAMPLING_* bit is in
     * sampling_set count, the others keep the route's own default (OpenAI's
     * on /v1, llama-server's on /completion). */
    bool spm_infill;          /* /infill puts the suffix before the prefix (--spm-infill, llama-server's) */
    struct server_loading *listen_from; /* NULL: bind host:port; else serve the listening socket of
                                           this loading responder (server_loading_handoff) */
    unsigned sampling_set;
    struct server_sampling {
        double temp, top_p, min_p, repeat_penalty;
        int64_t top_k, seed;
    } sampling;
    /* Server-wide defaults of llama.cpp's other samplers (--typical, --dry-*, --xtc-*,
     * --mirostat*, --samplers, ...), borrowed; NULL: llama.cpp's defaults. */
    const struct server_samplers *samplers;
    /* Embeddings (server_embed.c): --embeddings turns on POST /v1/embeddings and /embeddings (off: 501);
     * the scheduler's engine must compute them (sched_engine.forward_embd). */
    bool embeddings;
    int32_t n_embd;           /* the model's embedding width: a request's 'dimensions' must equal it */
    bool no_generation;       /* the model's attention is not causal, or it is an encoder (bert): an
                                 embedding model, whose completion routes answer 501 */
};

/* The other samplers' server-wide defaults (server_samplers.c). */
#define SERVER_MAX_DRY_BREAKERS 64
struct server_samplers {
    struct sample_params p;   /* their fields; repeat_last_n and the penalties where `set` says */
    unsigned set;             /* SERVER_SAMPLERS_* of the penalty flags given */
    const char *dry_breakers[SERVER_MAX_DRY_BREAKERS]; /* borrowed (argv) */
    int n_dry_breakers;       /* -1: llama.cpp's default breakers ("\n", ":", "\"", "*") */
};
enum {
    SERVER_SAMPLERS_REPEAT_LAST_N = 1u << 0,
    SERVER_SAMPLERS_PRESENCE = 1u << 1,
    SERVER_SAMPLERS_FREQUENCY = 1u << 2,
};
/* llama.cpp's defaults: everything off, its default order and breakers. */
void server_samplers_default(struct server_samplers *d);
/* One of llama-server's sampler flags (--typical, --min-keep, --top-nsigma,
 * --dynatemp-range, --dynatemp-exp, --xtc-probability, --xtc-threshold,
 * --dry-multiplier, --dry-base, --dry-allowed-length, --dry-penalty-last-n,
 * --dry-sequence-breaker (repeatable, "none"), --mirostat, --mirostat-lr,
 * --mirostat-ent, --samplers "a;b", --sampler-seq, --repeat-last-n,
 * --presence-penalty, --frequency-penalty): true if a is one (*ok: its
 * value v was good); v is borrowed. */
bool server_samplers_flag(const char *a, const char *v, struct server_samplers *d, bool *ok);

enum {
    SERVER_SAMPLING_TEMP = 1u << 0,
    SERVER_SAMPLING_TOP_K = 1u << 1,
    SERVER_SAMPLING_TOP_P = 1u << 2,
    SERVER_SAMPLING_MIN_P = 1u << 3,
    SERVER_SAMPLING_REPEAT_PENALTY = 1u << 4,
    SERVER_SAMPLING_SEED = 1u << 5,
};

void server_config_default(struct server_config *cfg);

/* Listening while the model loads (llama-server's behaviour): `kvserve serve`
 * binds its port first and answers every request with 503
 * {"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}
 * (Retry-After: 1) until the server proper starts on the same socket
 * (server_config.listen_from), so a health probe sees "loading" instead of a
 * refused connection, and a port already in use fails before the load. */
struct server_loading;
ks_status server_loading_start(const char *host, int port, struct server_loading **out);
int server_loading_port(const struct server_loading *l); /* the bound port (port 0 picks one) */
/* Stop accepting and give up the listening socket (-1 if it cannot); the
 * connections already open keep getting 503 until server_loading_stop. */
int server_loading_handoff(struct server_loading *l);
void server_loading_stop(struct server_loading *l); /* NULL is a no-op */

struct server;

/* Start listening. sched and tok are borrowed and must outlive the server.
 * The server answers /health with "loading" until server_set_ready(). */
ks_status server_start(const struct server_config *cfg, struct sched *sched, const struct tokenizer *tok,
                       struct server **out);
void server_set_ready(struct server *srv, bool ready);
/* The port actually bound. */
int server_port(const struct server *srv);
/* The limit of open connections in force (cfg.max_conn, or from the open-file limit). */
int server_max_connections(const struct server *srv);
/* Stop accepting new connections; requests in flight continue. */
void server_quiesce(struct server *srv);
/* Completion requests in flight (streaming or not). */
int server_in_flight(struct server *srv);
/* Close everything and free. Call after the scheduler has no requests left
 * (sched_cancel_all + waiting for server_in_flight() == 0). */
void server_stop(struct server *srv);

#endif
