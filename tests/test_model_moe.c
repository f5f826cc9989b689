/* Mixture-of-experts models against llama.cpp itself: tiny qwen3moe and
 * Mixtral-style (llama with experts) files from `kvserve synth`, F32 and Q8_0
 * weights, F32 cache, llama.cpp's plain F32 attention (dumpref's default,
 * flash attention off). The references in tests/data were made by
 * ../shared/anchor/bin/dumpref from files this tree's synth writes (see
 * README, "Correctness against llama.cpp"); the test writes the same files
 * again (synth is deterministic) and holds:
 *   - every logit of every prompt row within 1e-4 of llama.cpp's (the prompt
 *     in one batch, and in chunks of 5 with one thread);
 *   - llama.cpp's 32 greedy ids exactly, decoding one token per batch, and
 *     again with two sequences decoding in the same batch (two tokens per
 *     step, grouped by expert together);
 *   - the naive reference's MoE block (tests/support) agreeing with both;
 *   - on a router whose experts tie 8 ways (32 experts), the experts
 *     llama.cpp picks, i.e. ggml's argsort order for equal values.
 * Exits 77 (skipped) when tests/data or a model cannot be had. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <cjson/cJSON.h>

#include "model/model.h"
#include "support/ref_forward.h"

#define LOGIT_TOL 1e-4f
#define MAX_IDS 256

static char g_dir[64];

struct moe_case {
    const char *name;   /* tests/data/NAME.{json,logits.f32} */
    const char *preset;
    const char *type;
    unsigned ref_flags; /* naive reference: round activations as the engine does for quantized weights */
    float ref_tol;      /* max |engine - naive reference|; 0: must differ (ties, below) */
};

/* Quantized weights: the naive reference rounds activations to q8_0 as the
 * engine and llama.cpp do. All three agree within 1e-6 here (measured
 * 3.6e-7..2.6e-6). A value that sits on a q8_0 rounding tie can round the
 * other way after a last-bit difference upstream, and that moves logits by
 * ~1e-2. The first prompt these references were made with showed exactly
 * that pattern in tiny-mixtral q8_0 (rows 0-2 within 4e-7 of llama.cpp, rows
 * 3+ 2.4e-2 off from position 3 on, engine and naive reference within 2.4e-7
 * of each other, no near tie in the routing; q4_0 on that prompt and q8_0 on
 * this one agree within 1e-6), so this prompt is used instead. */
static const struct moe_case g_cases[] = {
    {"tiny-qwen3moe-f32", "tiny-qwen3moe", "f32", 0, LOGIT_TOL},
    {"tiny-qwen3moe-q8_0", "tiny-qwen3moe", "q8_0", REF_QUANTIZE_ACTS, LOGIT_TOL},
    {"tiny-mixtral-f32", "tiny-mixtral", "f32", 0, LOGIT_TOL},
    {"tiny-mixtral-q8_0", "tiny-mixtral", "q8_0", REF_QUANTIZE_ACTS, LOGIT_TOL},
    {"tiny-qwen3moe-q4_0", "tiny-qwen3moe", "q4_0", REF_QUANTIZE_ACTS, LOGIT_TOL},
    {"tiny-mixtral-q4_0", "tiny-mixtral", "q4_0", REF_QUANTIZE_ACTS, LOGIT_TOL},
    /* 32 experts in 8-way ties: the engine takes the 4 that ggml's argsort
     * (libstdc++'s introsort) puts first, as llama.cpp does. The naive
     * reference takes equal ones by lower id, ggml's order only for rows of
     * up to 16; here it must disagree, or the case would test no tie
     * (measured: engine 2.6e-6 from llama.cpp, naive reference 0.72). */
    {"tiny-qwen3moe-ties-f32", "tiny-qwen3moe-ties", "f32", 0, 0},
};
#define N_CASES (int)(sizeof g_cases / sizeof g_cases[0])

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        fclose(f);
        return NULL;
    }
    buf[n] = 0;
    fclose(f);
    *len = (size_t)n;
    return buf;
}

static const char *data_dir(void)
{
    static char dir[1024];
    const char *src = getenv("KVSERVE_SOURCE");
    snprintf(dir, sizeof dir, "%s/tests/data", src ? src : ".");
    return dir;
}

static void model_path(const struct moe_case *mc, char *buf, size_t cap)
{
    snprintf(buf, cap, "%s/%s-%s.gguf", g_dir, mc->preset, mc->type);
}

struct reference {
    int n_vocab, n_prompt, n_greedy;
    int32_t prompt[MAX_IDS], greedy[MAX_IDS];
    float *logits; /* (n_prompt, n_vocab) */
};

static int json_ids(const cJSON *root, const char *key, int32_t *ids)
{
    const cJSON *arr = cJSON_GetObjectItemCaseSensitive(root, key);
    assert_true(cJSON_IsArray(arr));
    int n = cJSON_GetArraySize(arr);
    assert_true(n > 0 && n <= MAX_IDS);
    for (int i = 0; i < n; i++)
        ids[i] = (int32_t)cJSON_GetArrayItem(arr, i)->valueint;
    return n;
}

static void load_reference(const struct moe_case *mc, struct reference *r)
{
    char jpath[1200], lpath[1200];
    snprintf(jpath, sizeof jpath, "%s/%s.json", data_dir(), mc->name);
    snprintf(lpath, sizeof lpath, "%s/%s.logits.f32", data_dir(), mc->name);
    size_t jlen, llen;
    char *json = read_file(jpath, &jlen);
    r->logits = (float *)read_file(lpath, &llen);
    if (!json || !r->logits)
        fail_msg("cannot read %s or %s", jpath, lpath);
    cJSON *root = cJSON_Parse(json);
    assert_non_null(root);
    assert_true(cJSON_IsFalse(cJSON_GetObjectItemCaseSensitive(root, "flash_attn")));
    r->n_vocab = cJSON_GetObjectItemCaseSensitive(root, "n_vocab")->valueint;
    r->n_prompt = json_ids(root, "prompt_ids", r->prompt);
    r->n_greedy = json_ids(root, "greedy_ids", r->greedy);
    assert_int_equal(llen, (size_t)r->n_prompt * r->n_vocab * sizeof(float));
    cJSON_Delete(root);
    free(json);
}

static int argmax(const float *x, int n)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best])
            best = i;
    return best;
}

static float max_diff(const float *a, const float *b, size_t n)
{
    float worst = 0;
    for (size_t i = 0; i < n; i++) {
        float d = fabsf(a[i] - b[i]);
        worst = d > worst ? d : worst;
    }
    return worst;
}

struct engine {
    struct model *m;
    threads_pool *pool;
    struct kv_cache *kv;
    struct model_ctx *ctx;
};

static void engine_init(struct engine *e, const struct moe_case *mc, int n_threads, int max_batch)
{
    char path[128];
    model_path(mc, path, sizeof path);
    if (model_load(path, &e->m))
        fail_msg("load %s: %s", path, ks_errmsg());
    assert_int_equal(threads_create(n_threads, &e->pool), KS_OK);
    struct kv_config cfg;
    model_kv_config(e->m, &cfg);
    cfg.type_k = cfg.type_v = QUANT_F32;
    cfg.rotate = false;
    cfg.mem_budget = 16u << 20;
    assert_int_equal(kv_create(&cfg, &e->kv), KS_OK);
    assert_int_equal(model_ctx_create(e->m, max_batch, e->pool, &e->ctx), KS_OK);
}

static void engine_free(struct engine *e)
{
    model_ctx_free(e->ctx);
    kv_free(e->kv);
    threads_free(e->pool);
    model_free(e->m);
}

/* The prompt into sequence seq in chunks, logits of every row into out. */
static void prefill(struct engine *e, int32_t seq, const struct reference *r, int chunk, float *out)
{
    int32_t pos[MAX_IDS], seqs[MAX_IDS];
    bool want[MAX_IDS];
    for (int i = 0; i < r->n_prompt; i++)
        pos[i] = i, seqs[i] = seq, want[i] = true;
    for (int at = 0; at < r->n_prompt; at += chunk) {
        int n = r->n_prompt - at < chunk ? r->n_prompt - at : chunk;
        struct model_batch b = {n, r->prompt + at, pos + at, seqs + at, want + at};
        int32_t n_out = 0;
        if (model_forward(e->ctx, e->kv, &b, out + (size_t)at * r->n_vocab, &n_out))
            fail_msg("model_forward: %s", ks_errmsg());
        assert_int_equal(n_out, n);
    }
}

static void run_case(const struct moe_case *mc, int n_threads, int chunk)
{
    struct reference r;
    load_reference(mc, &r);
    struct engine e;
    engine_init(&e, mc, n_threads, 2 * MAX_IDS);
    const struct model_hparams *hp = model_hparams(e.m);
    assert_int_equal(hp->n_vocab, r.n_vocab);
    assert_true(hp->n_expert > 0);
    size_t V = (size_t)r.n_vocab;
    float *logits = malloc(sizeof(float) * (size_t)r.n_prompt * V);
    int32_t seq;
    assert_int_equal(kv_seq_create(e.kv, &seq), KS_OK);
    prefill(&e, seq, &r, chunk, logits);
    float vs_llama = max_diff(logits, r.logits, (size_t)r.n_prompt * V);
    if (getenv("MOE_TEST_VERBOSE"))
        for (int i = 0; i < r.n_prompt; i++)
            print_message("  row %d: %.2e\n", i, (double)max_diff(logits + i * V, r.logits + i * V, V));

    /* the naive reference on the same prompt */
    struct ref_model *ref;
    assert_int_equal(ref_model_create(e.m, 1, r.n_prompt, mc->ref_flags, &ref), KS_OK);
    float *row = malloc(sizeof(float) * V);
    float vs_ref = 0, ref_vs_llama = 0;
    for (int i = 0; i < r.n_prompt; i++) {
        assert_int_equal(ref_forward(ref, 0, r.prompt[i], i, row), KS_OK);
        float d = max_diff(row, logits + (size_t)i * V, V), dl = max_diff(row, r.logits + (size_t)i * V, V);
        vs_ref = d > vs_ref ? d : vs_ref;
        ref_vs_llama = dl > ref_vs_llama ? dl : ref_vs_llama;
    }
    ref_model_free(ref);
    print_message("%-18s (%d threads, chunks of %d): engine vs llama.cpp %.2e (tol %.0e); engine vs naive ref "
                  "%.2e (tol %.0e); naive ref vs llama.cpp %.2e\n",
                  mc->name, n_threads, chunk, (double)vs_llama, (double)LOGIT_TOL, (double)vs_ref,
                  (double)mc->ref_tol, (double)ref_vs_llama);
    assert_true(vs_llama <= LOGIT_TOL);
    if (mc->ref_tol > 0)
        assert_true(vs_ref <= mc->ref_tol);
    else
        assert_true(vs_ref > 1e-2f);

    /* greedy decode, one token per batch */
    int32_t next = argmax(logits + (size_t)(r.n_prompt - 1) * V, r.n_vocab);
    for (int i = 0; i < r.n_greedy; i++) {
        if (next != r.greedy[i])
            fail_msg("%s: greedy token %d is %d, llama.cpp picked %d", mc->name, i, next, r.greedy[i]);
        int32_t p = r.n_prompt + i;
        struct model_batch b = {1, &next, &p, &seq, NULL};
        assert_int_equal(model_forward(e.ctx, e.kv, &b, logits, NULL), KS_OK);
        next = argmax(logits, r.n_vocab);
    }
    free(row), free(logits), free(r.logits);
    engine_free(&e);
}

/* Two sequences: both prompts in one batch, then both decoding in the same
 * batch; each must follow llama.cpp's greedy ids. */
static void run_two_streams(const struct moe_case *mc)
{
    struct reference r;
    load_reference(mc, &r);
    struct engine e;
    engine_init(&e, mc, 2, 2 * MAX_IDS);
    size_t V = (size_t)r.n_vocab;
    int32_t s[2];
    assert_int_equal(kv_seq_create(e.kv, &s[0]), KS_OK);
    assert_int_equal(kv_seq_create(e.kv, &s[1]), KS_OK);
    int n = r.n_prompt;
    int32_t tok[2 * MAX_IDS], pos[2 * MAX_IDS], seqs[2 * MAX_IDS];
    for (int i = 0; i < n; i++)
        for (int q = 0; q < 2; q++)
            tok[2 * i + q] = r.prompt[i], pos[2 * i + q] = i, seqs[2 * i + q] = s[q];
    float *logits = malloc(sizeof(float) * 2 * V);
    struct model_batch b = {2 * n, tok, pos, seqs, NULL};
    int32_t n_out = 0;
    assert_int_equal(model_forward(e.ctx, e.kv, &b, logits, &n_out), KS_OK);
    assert_int_equal(n_out, 2);
    float worst = 0;
    for (int q = 0; q < 2; q++) {
        float d = max_diff(logits + q * V, r.logits + (size_t)(n - 1) * V, V);
        worst = d > worst ? d : worst;
    }
    for (int i = 0; i < r.n_greedy; i++) {
        int32_t t2[2], p2[2] = {n + i, n + i};
        for (int q = 0; q < 2; q++) {
            t2[q] = argmax(logits + q * V, r.n_vocab);
            if (t2[q] != r.greedy[i])
                fail_msg("%s: stream %d: greedy token %d is %d, llama.cpp picked %d", mc->name, q, i, t2[q],
                         r.greedy[i]);
        }
        struct model_batch d = {2, t2, p2, s, NULL};
        assert_int_equal(model_forward(e.ctx, e.kv, &d, logits, &n_out), KS_OK);
        assert_int_equal(n_out, 2);
    }
    print_message("%-18s two streams in one batch: last prompt row vs llama.cpp %.2e, %d greedy ids equal\n",
                  mc->name, (double)worst, r.n_greedy);
    assert_true(worst <= LOGIT_TOL);
    free(logits), free(r.logits);
    engine_free(&e);
}

static void test_qwen3moe_f32(void **state) { (void)state; run_case(&g_cases[0], 2, MAX_IDS); }
static void test_qwen3moe_f32_chunked(void **state) { (void)state; run_case(&g_cases[0], 1, 5); }
static void test_qwen3moe_q8_0(void **state) { (void)state; run_case(&g_cases[1], 2, MAX_IDS); }
static void test_mixtral_f32(void **state) { (void)state; run_case(&g_cases[2], 2, MAX_IDS); }
static void test_mixtral_f32_chunked(void **state) { (void)state; run_case(&g_cases[2], 1, 5); }
static void test_mixtral_q8_0(void **state) { (void)state; run_case(&g_cases[3], 2, MAX_IDS); }
static void test_qwen3moe_q4_0(void **state) { (void)state; run_case(&g_cases[4], 2, MAX_IDS); }
static void test_mixtral_q4_0(void **state) { (void)state; run_case(&g_cases[5], 2, MAX_IDS); }
static void test_qwen3moe_ties(void **state) { (void)state; run_case(&g_cases[6], 2, MAX_IDS); }
static void test_qwen3moe_two_streams(void **state) { (void)state; run_two_streams(&g_cases[1]); }
static void test_mixtral_two_streams(void **state) { (void)state; run_two_streams(&g_cases[2]); }

/* ---- main ------------------------------------------------------------------ */

/* Write every case's model; false (and a message) when that cannot be done. */
static bool make_models(void)
{
    for (int i = 0; i < N_CASES; i++) {
        const struct moe_case *mc = &g_cases[i];
        char path[128], ref[1200];
        snprintf(ref, sizeof ref, "%s/%s.json", data_dir(), mc->name);
        if (access(ref, R_OK)) {
            fprintf(stderr, "test_model_moe: %s is missing (set KVSERVE_SOURCE to the source tree)\n", ref);
            return false;
        }
        model_path(mc, path, sizeof path);
        if (!access(path, R_OK))
            continue;
        struct model_synth_spec spec;
        if (model_synth_preset(mc->preset, &spec) || model_synth(&spec, mc->type, NULL, path, NULL)) {
            fprintf(stderr, "test_model_moe: cannot write %s: %s\n", path, ks_errmsg());
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
        fprintf(stderr, "test_model_moe: could not remove %s\n", g_dir);
}

int main(void)
{
    snprintf(g_dir, sizeof g_dir, "/tmp/kvserve-test-moe-XXXXXX");
    if (!mkdtemp(g_dir))
        return 77;
    if (!make_models()) {
        remove_dir();
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_qwen3moe_f32),       cmocka_unit_test(test_qwen3moe_f32_chunked),
        cmocka_unit_test(test_qwen3moe_q8_0),      cmocka_unit_test(test_mixtral_f32),
        cmocka_unit_test(test_mixtral_f32_chunked), cmocka_unit_test(test_mixtral_q8_0),
        cmocka_unit_test(test_qwen3moe_two_streams), cmocka_unit_test(test_mixtral_two_streams),
        cmocka_unit_test(test_qwen3moe_q4_0),      cmocka_unit_test(test_mixtral_q4_0),
        cmocka_unit_test(test_qwen3moe_ties),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    remove_dir();
    return rc;
}
