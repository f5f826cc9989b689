/* cli/setup: what the commands that run a model share: the model path, the
 * model load (--mmap), the KV configuration from the flags, and for the
 * single-process commands (bench, generate, chat, perplexity) the engine:
 * model, thread pool, KV cache and forward context. */
#ifndef KS_CLI_SETUP_H
#define KS_CLI_SETUP_H

#include <stddef.h>
#include <stdint.h>

#include "cli/args.h"
#include "kv/kv.h"
#include "model/model.h"
#include "threads/threads.h"

/* The model to load: given (-m), else default-model.gguf beside the
 * executable, written into buf. NULL, after printing "kvserve CMD: no -m
 * MODEL ..." on stderr, when there is neither. */
const char *cli_model_path(const char *cmd, const char *given, char *buf, size_t cap);

/* model_load_flags() with MODEL_LOAD_MMAP when --mmap was given and
 * MODEL_LOAD_NO_REPACK when --no-repack was. */
ks_status cli_load_model(const char *path, const struct cli_model_flags *f, struct model **out);

/* The model's KV shape with the user's KV flags; the budget is --kv-mem,
 * else whole pages for n_tokens of one sequence (cli_kv_budget_for).
 * n_tokens is the context of one sequence: it also picks a LongRoPE model's
 * factor set (model_set_n_ctx), as llama.cpp's n_ctx does. */
void cli_kv_config(struct model *m, const struct cli_kv_flags *f, int64_t n_tokens, struct kv_config *cfg);

/* ---- --model-draft (serve, generate) ---- */

struct sched_engine;
struct tokenizer;
/* Load the draft model (f->model_draft) and check it can draft for the
 * target: the same vocabulary (tok_check_same_vocab against target_tok) and
 * n_vocab logits. Errors name the flag and the difference. */
ks_status cli_draft_load(const struct cli_spec_flags *f, const struct cli_model_flags *load,
                         const struct tokenizer *target_tok, int32_t target_n_vocab, struct model **out);
/* The draft model's KV configuration: its own shape, the target's policy,
 * page size and options, and its KV types from -ctkd/-ctvd, else the policy's
 * floor where the draft's head size allows it, else the target's types. */
void cli_draft_kv_config(const struct cli_spec_flags *f, struct model *draft, const struct kv_config *target,
                         int32_t ctx, struct kv_config *out);
/* Does one sequence of ctx tokens fit target->mem_budget in both caches (at
 * their start types)? KS_ERR_KV_FULL with the numbers otherwise. */
ks_status cli_draft_check_fit(const struct kv_config *target, const struct kv_config *draft, int32_t ctx);

struct cli_engine {
    struct model *model;
    threads_pool *pool;
    struct kv_cache *kv;
    struct model_ctx *ctx;
};

/* For e->model (loaded by the caller): a pool of n_threads, a cache of cfg
 * and a forward context for batches of up to max_batch tokens. On failure
 * the parts made so far stay in e for cli_engine_free(). */
ks_status cli_engine_start(struct cli_engine *e, const struct kv_config *cfg, int n_threads, int32_t max_batch);
/* Frees whatever e holds, the model too; e may be partly set up. */
void cli_engine_free(struct cli_engine *e);

#endif
