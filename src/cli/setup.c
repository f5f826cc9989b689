#include "cli/setup.h"

#include <stdio.h>

const char *cli_model_path(const char *cmd, const char *given, char *buf, size_t cap)
{
    if (given)
        return given;
    if (cli_default_model(buf, cap))
        return buf;
    fprintf(stderr, "kvserve %s: no -m MODEL and no built-in default model beside the executable\n"
                    "  (build it with: cmake --build build --target default_model)\n", cmd);
    return NULL;
}

ks_status cli_load_model(const char *path, const struct cli_model_flags *f, struct model **out)
{
    unsigned flags = (f->mmap ? MODEL_LOAD_MMAP : 0) | (f->no_repack ? MODEL_LOAD_NO_REPACK : 0);
    return model_load_flags(path, flags, out);
}

void cli_kv_config(struct model *m, const struct cli_kv_flags *f, int64_t n_tokens, struct kv_config *cfg)
{
    model_set_n_ctx(m, n_tokens > INT32_MAX ? INT32_MAX : (int32_t)n_tokens); /* before the fingerprint */
    model_kv_config(m, cfg);
    cli_kv_flags_apply(f, cfg);
    cfg->mem_budget = f->mem ? f->mem : cli_kv_budget_for(cfg, n_tokens);
}

ks_status cli_engine_start(struct cli_engine *e, const struct kv_config *cfg, int n_threads, int32_t max_batch)
{
    ks_status st = threads_create(n_threads, &e->pool);
    if (!st)
        st = kv_create(cfg, &e->kv);
    if (!st)
        st = model_ctx_create(e->model, max_batch, e->pool, &e->ctx);
    return st;
}

void cli_engine_free(struct cli_engine *e)
{
    model_ctx_free(e->ctx);
    kv_free(e->kv);
    threads_free(e->pool);
    model_free(e->model);
    *e = (struct cli_engine){0};
}
