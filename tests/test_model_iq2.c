/* IQ2_XXS, IQ2_XS, IQ1_S and IQ1_M weights against llama.cpp itself: the
 * dense `tiny-llama` preset written by `kvserve synth --type T` (every matrix
 * at T but the output, q6_K as llama-quantize puts it), F32 cache,
 * llama.cpp's plain F32 attention (dumpref's default, flash attention off).
 * The references in tests/data were made by ../shared/anchor/bin/dumpref from
 * files this tree's synth writes (README, "Correctness against llama.cpp");
 * the test writes the same files again (synth is deterministic) and holds
 * every logit of every prompt row within 1e-4 of llama.cpp's, with the prompt
 * in one batch (2 threads: the multi-token kernels) and in chunks of 5 on one
 * thread, and llama.cpp's 64 greedy ids exactly, one token per batch (the
 * one-token kernels). Exits 77 (skipped) when tests/data or a model cannot be
 * had. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "model/model.h"
#include "support/llamacpp_ref.h"

#define LOGIT_TOL 1e-4f
#define MAX_IDS 256
#define PRESET "tiny-llama"

static char g_dir[64];
static const char *const g_types[] = {"iq2_xxs", "iq2_xs", "iq1_s", "iq1_m"};
#define N_TYPES (int)(sizeof g_types / sizeof g_types[0])

static const char *data_dir(void)
{
    static char dir[1024];
    const char *src = getenv("KVSERVE_SOURCE");
    snprintf(dir, sizeof dir, "%s/tests/data", src ? src : ".");
    return dir;
}

static void model_path(const char *type, char *buf, size_t cap)
{
    snprintf(buf, cap, "%s/%s-%s.gguf", g_dir, PRESET, type);
}

static void run_case(const char *type, int n_threads, int chunk)
{
    char name[64], path[128];
    snprintf(name, sizeof name, "%s-%s", PRESET, type);
    struct llamacpp_ref r;
    llamacpp_ref_load(data_dir(), name, &r);
    assert_false(r.flash_attn);
    assert_true(r.n_prompt > 0 && r.n_prompt <= MAX_IDS);

    model_path(type, path, sizeof path);
    struct model *m;
    if (model_load(path, &m))
        fail_msg("load %s: %s", path, ks_errmsg());
    threads_pool *pool;
    assert_int_equal(threads_create(n_threads, &pool), KS_OK);
    struct kv_config cfg;
    model_kv_config(m, &cfg);
    cfg.type_k = cfg.type_v = QUANT_F32;
    cfg.rotate = false;
    cfg.mem_budget = 16u << 20;
    struct kv_cache *kv;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    struct model_ctx *ctx;
    assert_int_equal(model_ctx_create(m, MAX_IDS, pool, &ctx), KS_OK);
    assert_int_equal(model_hparams(m)->n_vocab, r.n_vocab);

    size_t V = (size_t)r.n_vocab;
    float *logits = malloc(sizeof(float) * (size_t)r.n_prompt * V);
    int32_t seq;
    assert_int_equal(kv_seq_create(kv, &seq), KS_OK);
    llamacpp_ref_prefill(&r, ctx, kv, seq, chunk, logits);
    float diff = llamacpp_max_diff(logits, r.logits, (size_t)r.n_prompt * V);
    print_message("%-18s (%d threads, chunks of %d): max |logit - llama.cpp| %.2e (tol %.0e)\n", name, n_threads,
                  chunk, (double)diff, (double)LOGIT_TOL);
    if (getenv("IQ2_TEST_VERBOSE"))
        for (int i = 0; i < r.n_prompt; i++)
            print_message("  row %d: %.2e\n", i, (double)llamacpp_max_diff(logits + i * V, r.logits + i * V, V));
    assert_true(diff <= LOGIT_TOL);
    llamacpp_ref_check_greedy(&r, name, ctx, kv, seq, logits);

    free(logits);
    llamacpp_ref_free(&r);
    model_ctx_free(ctx);
    kv_free(kv);
    threads_free(pool);
    model_free(m);
}

static void test_iq2_xxs(void **state) { (void)state; run_case("iq2_xxs", 2, MAX_IDS); }
static void test_iq2_xs(void **state) { (void)state; run_case("iq2_xs", 2, MAX_IDS); }
static void test_iq1_s(void **state) { (void)state; run_case("iq1_s", 2, MAX_IDS); }
static void test_iq1_m(void **state) { (void)state; run_case("iq1_m", 2, MAX_IDS); }
static void test_iq2_xxs_chunked(void **state) { (void)state; run_case("iq2_xxs", 1, 5); }
static void test_iq1_m_chunked(void **state) { (void)state; run_case("iq1_m", 1, 5); }

/* Write every type's model; false (and a message) when that cannot be done. */
static bool make_models(void)
{
    for (int i = 0; i < N_TYPES; i++) {
        char path[128], ref[1200];
        snprintf(ref, sizeof ref, "%s/%s-%s.json", data_dir(), PRESET, g_types[i]);
        if (access(ref, R_OK)) {
            fprintf(stderr, "test_model_iq2: %s is missing (set KVSERVE_SOURCE to the source tree)\n", ref);
            return false;
        }
        model_path(g_types[i], path, sizeof path);
        struct model_synth_spec spec;
        if (model_synth_preset(PRESET, &spec) || model_synth(&spec, g_types[i], NULL, path, NULL)) {
            fprintf(stderr, "test_model_iq2: cannot write %s: %s\n", path, ks_errmsg());
            return false;
        }
    }
    return true;
}

static void remove_dir(void)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd) != 0)
        fprintf(stderr, "test_model_iq2: could not remove %s\n", g_dir);
}

int main(void)
{
    snprintf(g_dir, sizeof g_dir, "/tmp/kvserve-test-iq2-XXXXXX");
    if (!mkdtemp(g_dir))
        return 77;
    if (!make_models()) {
        remove_dir();
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_iq2_xxs), cmocka_unit_test(test_iq2_xs),          cmocka_unit_test(test_iq1_s),
        cmocka_unit_test(test_iq1_m),   cmocka_unit_test(test_iq2_xxs_chunked), cmocka_unit_test(test_iq1_m_chunked),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    remove_dir();
    return rc;
}
