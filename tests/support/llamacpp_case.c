#include "support/llamacpp_case.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <cmocka.h>

#include "status/status.h"

const char *llamacpp_data_dir(void)
{
    static char dir[1024];
    const char *src = getenv("KVSERVE_SOURCE");
    snprintf(dir, sizeof dir, "%s/tests/data", src ? src : ".");
    return dir;
}

bool llamacpp_synth_dir(const char *tag, char *dir, size_t cap)
{
    int n = snprintf(dir, cap, "/tmp/kvserve-test-%s-XXXXXX", tag);
    return n > 0 && (size_t)n < cap && mkdtemp(dir) != NULL;
}

void llamacpp_synth_path(const char *dir, const struct llamacpp_synth *s, char *buf, size_t cap)
{
    snprintf(buf, cap, "%s/%s-%s.gguf", dir, s->preset, s->type);
}

bool llamacpp_synth_reference(const char *test, const struct llamacpp_synth *s)
{
    char ref[1200];
    snprintf(ref, sizeof ref, "%s/%s.json", llamacpp_data_dir(), s->name);
    if (!access(ref, R_OK))
        return true;
    fprintf(stderr, "%s: %s is missing (set KVSERVE_SOURCE to the source tree)\n", test, ref);
    return false;
}

bool llamacpp_synth_model(const char *test, const char *dir, const struct llamacpp_synth *s)
{
    char path[1200];
    if (!llamacpp_synth_reference(test, s))
        return false;
    llamacpp_synth_path(dir, s, path, sizeof path);
    if (!access(path, R_OK))
        return true;
    struct model_synth_spec spec;
    if (model_synth_preset(s->preset, &spec) || model_synth(&spec, s->type, NULL, path, NULL)) {
        fprintf(stderr, "%s: cannot write %s: %s\n", test, path, ks_errmsg());
        return false;
    }
    return true;
}

bool llamacpp_synth_models(const char *test, const char *dir, const struct llamacpp_synth *(*case_at)(int i), int n)
{
    for (int i = 0; i < n; i++)
        if (!llamacpp_synth_model(test, dir, case_at(i)))
            return false;
    return true;
}

void llamacpp_synth_dir_remove(const char *test, const char *dir)
{
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "%s: could not remove %s\n", test, dir);
}

void llamacpp_engine_init(struct llamacpp_engine *e, const char *path, int n_threads, int max_batch, int32_t n_ctx)
{
    if (model_load(path, &e->m))
        fail_msg("load %s: %s", path, ks_errmsg());
    if (n_ctx > 0)
        model_set_n_ctx(e->m, n_ctx);
    assert_int_equal(threads_create(n_threads, &e->pool), KS_OK);
    struct kv_config cfg;
    model_kv_config(e->m, &cfg);
    cfg.type_k = cfg.type_v = QUANT_F32;
    cfg.rotate = false;
    cfg.mem_budget = 32u << 20;
    assert_int_equal(kv_create(&cfg, &e->kv), KS_OK);
    assert_int_equal(model_ctx_create(e->m, max_batch, e->pool, &e->ctx), KS_OK);
}

void llamacpp_engine_free(struct llamacpp_engine *e)
{
    model_ctx_free(e->ctx);
    kv_free(e->kv);
    threads_free(e->pool);
    model_free(e->m);
}
