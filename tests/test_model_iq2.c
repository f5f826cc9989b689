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
 * one-token kernels). The same again on files llama-quantize itself makes
 * from the f32 model, with the importance matrix of ones tools/imatrix writes
 * (IQ2_XXS, IQ2_XS, IQ1_M: llama.cpp's own blocks and its mix of types, q2_K
 * token embeddings and attn_v, q5_K output, iq2_xxs attn_output in the IQ1_M
 * file); those cases skip
 * when the anchor's llama-quantize or imatrix_ones is missing. Exits 77
 * (skipped) when tests/data or a model cannot be had. */
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
#include "support/skip.h"

#define LOGIT_TOL 1e-4f
#define MAX_IDS 256
#define PRESET "tiny-llama"

static char g_dir[64];
static const char *const g_types[] = {"iq2_xxs", "iq2_xs", "iq1_s", "iq1_m"};
#define N_TYPES (int)(sizeof g_types / sizeof g_types[0])
/* llama-quantize's IQ1 quantizers take ~14 s of CPU a file: one IQ1 ftype
 * (IQ1_M; its iq1_s blocks are checked bit for bit in test_quant_iq2). */
static const char *const g_lq_types[] = {"iq2_xxs", "iq2_xs", "iq1_m"};
#define N_LQ_TYPES (int)(sizeof g_lq_types / sizeof g_lq_types[0])

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

static bool g_have_lq; /* llama-quantize's files were made */

/* Model tests/data/NAME against llama.cpp's reference of the same name. */
static void run_model(const char *name, const char *path, int n_threads, int chunk)
{
    struct llamacpp_ref r;
    llamacpp_ref_load(data_dir(), name, &r);
    assert_false(r.flash_attn);
    assert_true(r.n_prompt > 0 && r.n_prompt <= MAX_IDS);

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

static void run_case(const char *type, int n_threads, int chunk)
{
    char name[64], path[128];
    snprintf(name, sizeof name, "%s-%s", PRESET, type);
    model_path(type, path, sizeof path);
    run_model(name, path, n_threads, chunk);
}

/* llama-quantize's file of ftype type (lower case). */
static void run_lq_case(const char *type)
{
    char name[64], path[128];
    snprintf(name, sizeof name, "%s-lq-%s", PRESET, type);
    snprintf(path, sizeof path, "%s/lq-%s.gguf", g_dir, type);
    run_model(name, path, 2, MAX_IDS);
}

static void test_iq2_xxs(void **state) { (void)state; run_case("iq2_xxs", 2, MAX_IDS); }
static void test_iq2_xs(void **state) { (void)state; run_case("iq2_xs", 2, MAX_IDS); }
static void test_iq1_s(void **state) { (void)state; run_case("iq1_s", 2, MAX_IDS); }
static void test_iq1_m(void **state) { (void)state; run_case("iq1_m", 2, MAX_IDS); }
static void test_iq2_xxs_chunked(void **state) { (void)state; run_case("iq2_xxs", 1, 5); }
static void test_iq1_m_chunked(void **state) { (void)state; run_case("iq1_m", 1, 5); }

#define LQ_TEST(t)                                                                                             \
    static void test_llama_quantize_##t(void **state)                                                         \
    {                                                                                                          \
        (void)state;                                                                                           \
        if (!g_have_lq)                                                                                        \
            KS_SKIP("no llama-quantize files (the anchor's llama-quantize or imatrix_ones is missing)");      \
        run_lq_case(#t);                                                                                       \
    }
LQ_TEST(iq2_xxs)
LQ_TEST(iq2_xs)
LQ_TEST(iq1_m)

/* The f32 model, its importance matrix of ones, and llama-quantize's file of
 * each type; false when a tool is missing or fails. */
static bool make_lq_models(void)
{
    const char *shared = getenv("KVSERVE_SHARED"), *ones = getenv("KVSERVE_IMATRIX_ONES");
    char quantize[1024], f32[128], dat[128], cmd[2600];
    snprintf(quantize, sizeof quantize, "%s/anchor/bin/llama-quantize", shared ? shared : "../shared");
    if (!ones || access(ones, X_OK) || access(quantize, X_OK))
        return false;
    model_path("f32", f32, sizeof f32);
    snprintf(dat, sizeof dat, "%s/ones.dat", g_dir);
    struct model_synth_spec spec;
    if (model_synth_preset(PRESET, &spec) || model_synth(&spec, "f32", NULL, f32, NULL))
        return false;
    snprintf(cmd, sizeof cmd, "'%s' '%s' '%s' 2>/dev/null", ones, f32, dat);
    if (system(cmd) != 0)
        return false;
    for (int i = 0; i < N_LQ_TYPES; i++) {
        const char *t = g_lq_types[i];
        char upper[16];
        for (size_t k = 0; k <= strlen(t); k++)
            upper[k] = (char)(t[k] >= 'a' && t[k] <= 'z' ? t[k] - 32 : t[k]);
        snprintf(cmd, sizeof cmd, "'%s' --imatrix '%s' '%s' '%s/lq-%s.gguf' %s 2 >/dev/null 2>&1", quantize, dat, f32,
                 g_dir, t, upper);
        if (system(cmd) != 0) {
            fprintf(stderr, "test_model_iq2: llama-quantize to %s failed\n", upper);
            return false;
        }
    }
    return true;
}

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
    g_have_lq = make_lq_models();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_iq2_xxs),
        cmocka_unit_test(test_iq2_xs),
        cmocka_unit_test(test_iq1_s),
        cmocka_unit_test(test_iq1_m),
        cmocka_unit_test(test_iq2_xxs_chunked),
        cmocka_unit_test(test_iq1_m_chunked),
        cmocka_unit_test(test_llama_quantize_iq2_xxs),
        cmocka_unit_test(test_llama_quantize_iq2_xs),
        cmocka_unit_test(test_llama_quantize_iq1_m),
    };
    int rc = ks_run_tests(tests, NULL, NULL);
    remove_dir();
    return rc;
}
