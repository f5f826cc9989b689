/* model_forward against llama.cpp's own outputs (../shared/ref), F32 weights
 * and an F32 KV cache.
 *
 * Why the engine is not within 1e-4 of those outputs: llama.cpp made them
 * with its default CPU flash attention, and llama.cpp casts an F32 cache to
 * F16 for it (llama-graph.cpp, build_attn_mha); F16 K makes Q round to F16
 * too, and for fewer than 64 query rows ggml keeps the V accumulator in an F16
 * vector, rounded after every key. An exact f32 attention (ours) differs by
 * up to 1.7e-2. Measured with tests/support's emulation switched on piece by
 * piece: K/V rounding alone leaves 1.3e-2, K/V/Q 9.8e-3; only the F16
 * accumulator closes the gap. So the checks are:
 *   1. the naive reference in llama.cpp mode (REF_LLAMACPP_FA: ggml-cpu's
 *      arithmetic op by op, that attention included) reproduces llama.cpp:
 *      instrument.april bit for bit (every logit of every row), stories once
 *      within 5e-6; stories park 10 of 19 rows within 1e-4 and the rest
 *      within 8e-4 (stories has head_dim 8 and n_ff 172, which go through
 *      ggml's scalar tails: a last-bit difference there that this emulation
 *      does not reproduce is enough to flip an F16 rounding of the
 *      accumulator, and one flip moves logits by ~1e-4..1e-3). It also
 *      reproduces llama.cpp's 64 greedy ids, decoding one token per batch;
 *   2. model_forward matches the naive f32 reference within 1e-4 on the same
 *      prompt (prefill in one batch and in chunks);
 *   3. model_forward reproduces llama.cpp's 64 greedy ids exactly, and its
 *      logit rows are within LLAMACPP_F32_TOL: the F16 rounding in llama.cpp's
 *      attention that an exact f32 attention does not do.
 * A reference made with `llama.cpp -fa off` (plain F32 attention) and marked
 * "flash_attn": false in its .json skips check 1 and holds check 3 to
 * LOGIT_TOL (1e-4), the bound, against llama.cpp itself. */
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
#include "support/ref_forward.h"
#include "support/skip.h"

#define LOGIT_TOL 1e-4f
#define LLAMACPP_F32_TOL 3e-2f

static const char *shared_dir(void)
{
    const char *d = getenv("KVSERVE_SHARED");
    return d ? d : "../shared";
}

struct ref_case {
    const char *name;
    const char *model;
    float emul_tol; /* check 1: max |llama.cpp-mode reference - llama.cpp| */
};

/* Checks 1 (only for references made with flash attention) and 2 of the
 * header; returns max |engine - naive f32 ref|. */
static float check_naive(const struct model *m, const struct ref_case *rc, bool fa_refs, const int32_t *prompt,
                         int n_prompt, const int32_t *greedy, int n_greedy, const float *llama_logits,
                         const float *engine_logits)
{
    int n_vocab = model_hparams(m)->n_vocab;
    struct ref_model *fa, *plain;
    assert_int_equal(ref_model_create(m, 1, n_prompt + n_greedy, REF_LLAMACPP_FA, &fa), KS_OK);
    assert_int_equal(ref_model_create(m, 1, n_prompt, 0, &plain), KS_OK);
    float *row = malloc(sizeof(float) * (size_t)n_vocab), *row_plain = malloc(sizeof(float) * (size_t)n_vocab);
    float worst_fa = 0, worst_plain = 0;
    char rows[1024] = "";
    for (int i = 0; i < n_prompt; i++) {
        assert_int_equal(ref_forward(plain, 0, prompt[i], i, row_plain), KS_OK);
        float d = llamacpp_max_diff(row_plain, engine_logits + (size_t)i * n_vocab, (size_t)n_vocab);
        worst_plain = d > worst_plain ? d : worst_plain;
    }
    for (int i = 0; i < n_prompt && fa_refs; i++) {
        assert_int_equal(ref_forward(fa, 0, prompt[i], i, row), KS_OK);
        float d = llamacpp_max_diff(row, llama_logits + (size_t)i * n_vocab, (size_t)n_vocab);
        size_t len = strlen(rows);
        snprintf(rows + len, sizeof rows - len, " %.0e", (double)d);
        worst_fa = d > worst_fa ? d : worst_fa;
    }
    if (!fa_refs)
        goto done;
    print_message("%s: llama.cpp-mode reference vs llama.cpp, max |diff| per row:%s\n", rc->name, rows);
    /* the reference's own greedy continuation, one token per batch as llama.cpp decodes */
    ref_set_batch_size(fa, 1);
    for (int i = 0; i < n_greedy; i++) {
        int32_t next = llamacpp_argmax(row, n_vocab);
        if (next != greedy[i])
            fail_msg("%s: llama.cpp-mode reference: greedy token %d is %d, llama.cpp picked %d", rc->name, i, next,
                     greedy[i]);
        assert_int_equal(ref_forward(fa, 0, next, n_prompt + i, row), KS_OK);
    }
    print_message("%s: llama.cpp-mode reference vs llama.cpp: max |diff| %.2e (tol %.0e), %d greedy ids equal\n",
                  rc->name, (double)worst_fa, (double)rc->emul_tol, n_greedy);
    assert_true(worst_fa <= rc->emul_tol);
done:
    free(row), free(row_plain);
    ref_model_free(fa);
    ref_model_free(plain);
    return worst_plain;
}

/* The model and reference files of a case under ../shared. */
static void case_paths(const struct ref_case *rc, char *mpath, char *jpath, char *lpath, size_t cap)
{
    snprintf(mpath, cap, "%s/models/%s", shared_dir(), rc->model);
    snprintf(jpath, cap, "%s/ref/%s.json", shared_dir(), rc->name);
    snprintf(lpath, cap, "%s/ref/%s.logits.f32", shared_dir(), rc->name);
}

/* The first of a case's files that cannot be read, or NULL. */
static const char *missing_file(const struct ref_case *rc)
{
    static char paths[3][1024];
    case_paths(rc, paths[0], paths[1], paths[2], sizeof paths[0]);
    for (int i = 0; i < 3; i++)
        if (access(paths[i], R_OK))
            return paths[i];
    return NULL;
}

#define SKIP_IF_MISSING(rc)                                                                                      \
    do {                                                                                                         \
        const char *missing_ = missing_file(rc);                                                                 \
        if (missing_)                                                                                            \
            KS_SKIP("no %s", missing_);                                                                          \
    } while (0)

static void run_case(const struct ref_case *rc, int n_threads, int prefill_chunk)
{
    char mpath[1024], jpath[1024], lpath[1024];
    case_paths(rc, mpath, jpath, lpath, sizeof mpath);
    char rdir[1024];
    snprintf(rdir, sizeof rdir, "%s/ref", shared_dir());
    struct llamacpp_ref r;
    llamacpp_ref_load(rdir, rc->name, &r);
    int n_prompt = r.n_prompt, n_vocab = r.n_vocab;

    struct model *m;
    assert_int_equal(model_load(mpath, &m), KS_OK);
    assert_int_equal(model_hparams(m)->n_vocab, n_vocab);
    threads_pool *pool;
    assert_int_equal(threads_create(n_threads, &pool), KS_OK);
    struct kv_config cfg;
    model_kv_config(m, &cfg);
    cfg.type_k = cfg.type_v = QUANT_F32;
    cfg.rotate = false;
    cfg.mem_budget = 64u << 20;
    struct kv_cache *kv;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    int32_t seq;
    assert_int_equal(kv_seq_create(kv, &seq), KS_OK);
    struct model_ctx *ctx;
    assert_int_equal(model_ctx_create(m, n_prompt, pool, &ctx), KS_OK);

    /* prefill in chunks, logits for every position */
    float *logits = malloc(sizeof(float) * (size_t)n_prompt * n_vocab);
    llamacpp_ref_prefill(&r, ctx, kv, seq, prefill_chunk, logits);
    /* How llama.cpp made the file. ../shared/ref's files carry no "flash_attn"
     * key: they were made with llama.cpp's default, flash attention on the CPU
     * (what check 1 reproduces). A file made with `-fa off` and marked
     * "flash_attn": false holds plain F32 attention, and the engine must then be
     * within LOGIT_TOL of llama.cpp itself. */
    bool fa_refs = r.flash_attn;
    float llama_tol = fa_refs ? LLAMACPP_F32_TOL : LOGIT_TOL;
    float vs_llama = llamacpp_max_diff(logits, r.logits, (size_t)n_prompt * n_vocab);
    float vs_ref = check_naive(m, rc, fa_refs, r.prompt, n_prompt, r.greedy, r.n_greedy, r.logits, logits);
    print_message("%s: engine vs naive f32 ref %.2e (tol %.0e); engine vs llama.cpp (%s) %.2e (tol %.0e)\n",
                  rc->name, (double)vs_ref, (double)LOGIT_TOL, fa_refs ? "flash attention" : "-fa off",
                  (double)vs_llama, (double)llama_tol);
    assert_true(vs_ref <= LOGIT_TOL);
    assert_true(vs_llama <= llama_tol);

    /* greedy decode, one token at a time */
    llamacpp_ref_check_greedy(&r, rc->name, ctx, kv, seq, logits);

    free(logits);
    llamacpp_ref_free(&r);
    model_ctx_free(ctx);
    kv_free(kv);
    threads_free(pool);
    model_free(m);
}

/* measured: once 4.8e-6, park 7.8e-4, april 0 (bit-exact) */
static const struct ref_case g_once = {"stories260K.once", "stories260K.gguf", 1e-4f};
static const struct ref_case g_park = {"stories260K.park", "stories260K.gguf", 1e-3f};
static const struct ref_case g_april = {"instrument.april", "trained/tiny-llama-gqa-hd64-f32.gguf", 1e-5f};

static void test_once(void **state) { (void)state; SKIP_IF_MISSING(&g_once); run_case(&g_once, 2, 64); }
static void test_park(void **state) { (void)state; SKIP_IF_MISSING(&g_park); run_case(&g_park, 2, 64); }
static void test_park_chunked(void **state) { (void)state; SKIP_IF_MISSING(&g_park); run_case(&g_park, 1, 5); }
static void test_april(void **state) { (void)state; SKIP_IF_MISSING(&g_april); run_case(&g_april, 2, 64); }
static void test_april_chunked(void **state) { (void)state; SKIP_IF_MISSING(&g_april); run_case(&g_april, 2, 7); }

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_once),
        cmocka_unit_test(test_park),
        cmocka_unit_test(test_park_chunked),
        cmocka_unit_test(test_april),
        cmocka_unit_test(test_april_chunked),
    };
    return ks_run_tests(tests, NULL, NULL);
}
