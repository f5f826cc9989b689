/* The real engine (sched_engine_model) on a loaded model, its scheduler and
 * a server whose routes tests drive in-process with server_dispatch:
 * test_grammar_e2e and test_server_n run the built-in default model
 * (KVSERVE_DEFAULT_MODEL) through it.
 *
 *   struct model_server_config mc = {.model = m, .tok = tok, .pool = pool, .kv_budget = 128u << 20,
 *                                    .parallel = 8, .ctx_size = 1024};
 *   model_server_start(&mc, &sched, &srv);  ...  model_server_stop(sched, srv);
 */
#ifndef KS_TEST_MODEL_SERVER_H
#define KS_TEST_MODEL_SERVER_H

#include <stddef.h>
#include <stdint.h>

struct model;
struct gguf_file;
struct tokenizer;
struct threads_pool;
struct sched;
struct server;

struct model_server_config {
    struct model *model;          /* borrowed; outlives the server */
    const struct tokenizer *tok;  /* borrowed; its end-of-generation tokens stop requests */
    struct threads_pool *pool;    /* borrowed */
    size_t kv_budget;             /* bytes of KV pages */
    int parallel;                 /* sequences at once */
    int32_t ctx_size;
    const char *chat_template_jinja; /* overrides the model's template; NULL: the model's */
    int spec_type;                /* enum spec_type: 0 none, 1 ngram (speculative decoding) */
    int32_t draft_min;            /* its --draft-min (--draft-max stays 16) */
};

/* A loaded model with what a server on it needs, and the server. */
struct model_server {
    struct model *model;
    struct gguf_file *f;          /* the model's GGUF, for the tokenizer */
    struct tokenizer *tok;
    struct threads_pool *pool;    /* 2 threads */
    struct sched *sched;          /* set by model_server_start */
    struct server *srv;
};

/* Load ms's model, tokenizer and pool from path: 0 on success, -1 on
 * failure. unload frees them. */
int model_server_load(const char *path, struct model_server *ms);
void model_server_unload(struct model_server *ms);

/* 0 on success, -1 (with the reason printed) on failure. */
int model_server_start(const struct model_server_config *mc, struct sched **sched, struct server **srv);
/* Cancel what runs, wait for the requests in flight, stop both. */
void model_server_stop(struct sched *sched, struct server *srv);

#endif
