/* A mock scheduler engine (struct sched_engine) whose "model" is a pure
 * function of a sequence's whole history: the next token is an FNV-1a hash of
 * every token fed so far, mapped into [first_token, n_vocab). Whatever the
 * batching, chunking or preemption, a request gets exactly the tokens
 * mock_engine_generate() computes for it alone. test_sched, test_server and
 * test_server_errors drive the real scheduler with it.
 *
 *   struct mock_engine_config mc = {.n_vocab = 97, .max_seqs = 64, .max_ctx = 2048};
 *   struct mock_engine *m;
 *   mock_engine_create(&mc, &m);
 *   struct sched_engine e = mock_engine_sched(m, false);   sched_create(&cfg, &e, &s)
 *   ...  sched_free(s); mock_engine_stats(m, &st); mock_engine_free(m);
 *
 * The engine has sampler_verify (greedy: the draft is kept when it is the
 * argmax) and seq_truncate, so the scheduler may speculate on it.
 *
 * The engine's functions run on the scheduler thread; they fail the calling
 * test (cmocka) on a sequence the scheduler does not own. Nothing but the
 * sampler's create allocates after mock_engine_create: test_server_errors
 * counts allocations. */
#ifndef KS_TEST_MOCK_ENGINE_H
#define KS_TEST_MOCK_ENGINE_H

#include <stdbool.h>
#include <stdint.h>

#include "sched/sched.h"

struct mock_engine_config {
    int32_t n_vocab;        /* logits per row */
    int32_t first_token;    /* the lowest id the model produces (past a tokenizer's control and byte tokens) */
    int max_seqs;           /* sequence slots */
    int32_t max_ctx;        /* tokens one sequence holds */
    int32_t capacity;       /* tokens all sequences hold together; beyond it a step fails with
                               KS_ERR_KV_FULL (the scheduler preempts); 0: no limit */
    int kv_pages;           /* > 0: a real, empty KV cache of this many f16 pages (2 layers, 2 KV heads of
                               64) that engine.cache hands to between-step hooks (the /cache routes) */
    int n_top;              /* alternatives the greedy sampler reports: the sampled token, then
                               top_first, top_first + 1, ... skipping the sampled one */
    int32_t top_first;
    unsigned step_sleep_us; /* each step sleeps this long (lets HTTP requests overlap) */
    /* A repetitive model, for speculation (0: off): the next token repeats the
     * one repeat_period back, except at every surprise_every-th position
     * (0: never), where it is the hash. */
    int32_t repeat_period, surprise_every;
    /* > 0: the engine computes embeddings of n_embd floats (forward_embd):
     * an input's vector is (its token count, the sum of its tokens, 0...) */
    int32_t n_embd;
};

struct mock_engine_stats {
    int n_live;             /* sequences created and not freed */
    int32_t used;           /* tokens held, against capacity (a fork's shared tokens count once) */
    int32_t max_batch_seen; /* most tokens in one step */
    int32_t max_chunk_seen; /* most tokens of one sequence in one step */
    int bad_positions;      /* batch entries whose position was not the sequence's next */
    uint64_t steps;         /* successful forwards */
    uint64_t fed;           /* tokens computed by successful forwards */
    int forks;              /* sequences made by seq_fork */
    int truncations;        /* seq_truncate calls that dropped tokens */
    int watch_steps;        /* steps that fed the watched prompt (mock_engine_watch) */
    int watch_idle_steps;   /* steps that did not while it was still in prefill */
    int bad_embeds;         /* embedding sequences that did not start at 0 in their step */
    uint64_t embedded;      /* embedding vectors computed */
};

struct mock_engine;

ks_status mock_engine_create(const struct mock_engine_config *cfg, struct mock_engine **out);
void mock_engine_free(struct mock_engine *m);

/* The engine table over m. owned: the engine's destroy frees m (sched_free
 * does); else the caller frees m after sched_free, and may read its stats. */
struct sched_engine mock_engine_sched(struct mock_engine *m, bool owned);

/* Thread-safe while the scheduler runs. */
void mock_engine_stats(struct mock_engine *m, struct mock_engine_stats *out);

/* While held, steps wait (at most KS_WAIT_SECONDS, then the step fails): a
 * test queues all its requests before the first step, whatever the machine's
 * speed. */
void mock_engine_hold(struct mock_engine *m, bool hold);

/* Watch the prompt of the sequences whose first token is first until they hold
 * len tokens: count the steps that fed them and those that did not. */
void mock_engine_watch(struct mock_engine *m, int32_t first, int32_t len);

/* The model: the token that follows history[0, n). */
int32_t mock_next_token(const struct mock_engine_config *cfg, const int32_t *history, int32_t n);

/* What the model generates greedily after prompt, alone: n_gen tokens into out. */
void mock_engine_generate(const struct mock_engine_config *cfg, const int32_t *prompt, int32_t n_prompt,
                          int32_t n_gen, int32_t *out);

#endif
