/* route: the prefix-affinity router (`kvserve route`). An HTTP front for N
 * kvserve replicas of one model that sends each request to the replica that
 * holds most of its prompt in cache, weighed against the load it has sent
 * there (SGLang's router, NVIDIA Dynamo's KV router).
 *
 * It knows what each replica holds from the replicas' KV events (store.h: the
 * Redis stream kvserve:events:<fingerprint>): an index chain key -> replicas.
 * For a request it computes the prompt's tokens itself (the model's tokenizer
 * and chat template only, no weights) and their chain keys with the layout
 * the replicas announced (kv_layout_keys, salts included: the request's
 * cache_salt), so its keys are the replicas' own. Then, among the replicas
 * whose GET /health answers 200 (checked every health_ms, and at once when a
 * connection to one fails):
 *
 *   cost(r) = pages of the prompt no replica holds
 *           + shared_page_cost * (pages another replica holds and r does not)
 *           + load_weight * (prompt pages of the requests in flight on r + their count)
 *
 * (route_replica_cost). A replica with KV events has the shared Redis page
 * tier (--kv-events needs --cache-redis), where the pages another replica
 * computed are written behind: fetching one costs a fraction of computing it,
 * so affinity weighs that little against load.
 * and the least cost wins (ties: the next in turn). A request it cannot read
 * (another route, a body that is not JSON) goes unchanged to the least loaded
 * replica. Everything passes through: method, path, query, headers
 * (Authorization included; hop-by-hop ones excepted), body, and the answer
 * as it arrives (SSE streams event by event). A replica that refuses the
 * connection is marked down and the request goes to the next best one. The
 * router's own routes: GET /health (200 while a replica is up) and GET
 * /route/status (replicas, health, load, pages indexed, events applied). */
#ifndef KS_ROUTE_H
#define KS_ROUTE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kv/kv.h"
#include "status/status.h"
#include "store/store.h"

enum { ROUTE_MAX_REPLICAS = 64 };

/* ---- the index: chain key -> the replicas holding it ------------------------ */

struct route_index;
ks_status route_index_create(int n_replicas, struct route_index **out);
void route_index_free(struct route_index *ix);
/* Apply one event of replica r: a snapshot (or a new epoch) replaces what r
 * held; add and del change it; a sequence gap is counted (the next snapshot
 * repairs it). A snapshot also gives r's key layout. Thread-safe. */
ks_status route_index_apply(struct route_index *ix, int r, const struct store_event *ev);
/* Forget everything replica r held (its health check failed for good, or it
 * said goodbye with an empty snapshot). */
void route_index_forget(struct route_index *ix, int r);
/* r's key layout; false before r's first snapshot. */
bool route_index_layout(const struct route_index *ix, int r, struct kv_key_layout *out);
/* How many of keys[0, n) r holds, counting from the first up to the first miss. */
int32_t route_index_overlap(const struct route_index *ix, int r, const struct kv_key *keys, int32_t n);

struct route_replica_info {
    uint64_t keys;            /* keys it holds, by the index */
    uint64_t epoch, seq;      /* of its last event */
    uint64_t events, gaps, snapshots;
    bool has_layout;
};
void route_index_info(const struct route_index *ix, int r, struct route_replica_info *out);

/* ---- a request's prompt ---------------------------------------------------- */

struct tokenizer;
struct route_prompt;
/* chat_template: a hand-written family's name (tok_chat_by_name) or NULL for
 * the model's Jinja template (as `serve` without --chat-template); n_ctx and
 * spm_infill: the replicas' --ctx-size and --spm-infill (their /infill
 * prompts depend on them). The tokenizer is borrowed. KS_ERR_FORMAT (the
 * template), KS_ERR_NOMEM. */
ks_status route_prompt_create(const struct tokenizer *tok, const char *chat_template, int32_t n_ctx, bool spm_infill,
                              struct route_prompt **out);
void route_prompt_free(struct route_prompt *rp);
/* The prompt tokens a replica would compute for a request to path with this
 * body (POST /v1/chat/completions, /v1/completions, /completion, a single
 * prompt; /v1/messages and /v1/responses as the chat the replica translates
 * them to, up to their first message the router does not read; /infill as
 * tok_infill_prompt builds it), and its cache salt from cache_salt ({0, 0}:
 * none; route_forward folds in a tenant's, kv_tenant_salt). KS_ERR_NOT_FOUND: not a
 * request the router reads (it then balances by load alone);
 * KS_ERR_INVALID_ARG: a body it cannot read. *ids is malloc'd. */
ks_status route_prompt_tokens(struct route_prompt *rp, const char *path, const char *body, size_t len,
                              int32_t **ids, size_t *n, struct kv_key *salt);

/* ---- the router ---------------------------------------------------------- */

struct route_config {
    const char *host;         /* listen address */
    int port;                 /* 0: any free port (route_port tells) */
    const char *const *replicas; /* base URLs, "http://HOST:PORT", n_replicas of them */
    int n_replicas;
    const char *redis_url;    /* the replicas' --cache-redis; NULL: no events (load balancing only) */
    const char *redis_password;
    uint8_t fingerprints[2][16]; /* the model's events streams (short and long RoPE factors) */
    int n_fingerprints;
    struct route_prompt *prompt; /* borrowed */
    bool salt_from_key;       /* the replicas' --cache-salt-from-key: a bearer token salts its request's keys */
    struct kv_key tenant_key; /* ... with the replicas' tenant key (store_secret_file_digest of KV_TENANT_KEY_TAG) */
    double load_weight;       /* cost of a page in flight against a page to compute; 0 = 1 */
    double shared_page_cost;  /* cost of a page another replica holds (a Redis fetch) against one to compute,
                               * in (0, 1]; 0 = ROUTE_SHARED_PAGE_COST */
    int health_ms;            /* between health checks; 0 = 1000 */
    size_t max_body;          /* 0 = 8 MiB */
    int timeout_s;            /* idle connection timeout; 0 = 600 */
};

/* Reading a page from Redis over a LAN against computing it: a 16-token page
 * of a 1B model is ~0.5 MiB (~0.5 ms at 1 GB/s) against ~100 ms of prefill on
 * a CPU; of a 4M-parameter model ~32 KiB against ~0.5 ms. A tenth keeps a
 * little affinity (the holder needs no network at all). */
#define ROUTE_SHARED_PAGE_COST 0.1

/* The cost above for one replica: pages of the prompt, overlap the leading
 * pages it holds, held the most any replica holds (>= overlap), load its
 * prompt pages in flight plus their count. */
double route_replica_cost(int32_t pages, int32_t overlap, int32_t held, double load, double load_weight,
                          double shared_page_cost);

struct route;
/* Bind, start the health checks and the events reader, serve. KS_ERR_IO (the
 * address), KS_ERR_INVALID_ARG (no replicas, too many, a URL that is not
 * http://), KS_ERR_NOMEM. */
ks_status route_start(const struct route_config *cfg, struct route **out);
int route_port(const struct route *rt);
void route_stop(struct route *rt);

#endif
