/* The frame every test against llama.cpp's references shares: tests/data
 * (where NAME.json and NAME.logits.f32 live), a temporary directory of
 * models written by `kvserve synth` (deterministic, so they are the files
 * the references were made from), and the engine a case runs on: the model,
 * threads, llama.cpp's dumpref cache (F32, no rotation) and a context.
 * test_model_moe, _gemma, _phi3 and _gptoss use it. */
#ifndef KS_TEST_LLAMACPP_CASE_H
#define KS_TEST_LLAMACPP_CASE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kv/kv.h"
#include "model/model.h"
#include "threads/threads.h"

/* $KVSERVE_SOURCE/tests/data (./tests/data without it). */
const char *llamacpp_data_dir(void);

/* A case's reference and model: tests/data/NAME.json, and PRESET at TYPE. */
struct llamacpp_synth {
    const char *name, *preset, *type;
};

/* A new directory /tmp/kvserve-test-TAG-XXXXXX in dir (cap bytes); false
 * when it cannot be made. */
bool llamacpp_synth_dir(const char *tag, char *dir, size_t cap);
/* dir/PRESET-TYPE.gguf */
void llamacpp_synth_path(const char *dir, const struct llamacpp_synth *s, char *buf, size_t cap);
/* The case's reference exists; false, with a line on stderr naming test,
 * when it does not. */
bool llamacpp_synth_reference(const char *test, const struct llamacpp_synth *s);
/* The case's reference exists and its model is in dir (written now unless
 * there already); false, with a line on stderr naming test, when a
 * reference or the model cannot be had. */
bool llamacpp_synth_model(const char *test, const char *dir, const struct llamacpp_synth *s);
/* llamacpp_synth_model for each of the n cases case_at(0..n-1). */
bool llamacpp_synth_models(const char *test, const char *dir, const struct llamacpp_synth *(*case_at)(int i), int n);
/* rm -rf dir */
void llamacpp_synth_dir_remove(const char *test, const char *dir);

struct llamacpp_engine {
    struct model *m;
    threads_pool *pool;
    struct kv_cache *kv;
    struct model_ctx *ctx;
};

/* Load path (n_ctx > 0: model_set_n_ctx first, for RoPE scalings that
 * depend on it), n_threads threads, a 32 MiB F32 cache, a context for
 * batches of max_batch tokens; fails the calling test on any error. */
void llamacpp_engine_init(struct llamacpp_engine *e, const char *path, int n_threads, int max_batch, int32_t n_ctx);
void llamacpp_engine_free(struct llamacpp_engine *e);

#endif
