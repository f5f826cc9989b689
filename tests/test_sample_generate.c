/* End-to-end tests of `kvserve generate` and `kvserve bench` on a small
 * synthetic model: greedy output equals an in-process argmax decode through
 * the library, seeded sampling is reproducible, the timing line and the
 * output formats are as documented. Exits 77 (skipped) when KVSERVE_BIN is not set. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "kv/kv.h"
#include "model/model.h"
#include "sample/sample.h"
#include "support/skip.h"

#define MAX_IDS 64
#define N_PREDICT 12

static char g_dir[256];
static char g_model[512];
static const char *g_bin;

/* Run `kvserve ARGS`, stdout and stderr into files in g_dir; exit status. */
static int run_kvserve(const char *args, char *out, size_t out_cap, char *err, size_t err_cap)
{
    char cmd[2048], out_path[512], err_path[512];
    snprintf(out_path, sizeof out_path, "%s/stdout", g_dir);
    snprintf(err_path, sizeof err_path, "%s/stderr", g_dir);
    snprintf(cmd, sizeof cmd, "'%s' %s >'%s' 2>'%s'", g_bin, args, out_path, err_path);
    int rc = system(cmd);
    const char *paths[2] = {out_path, err_path};
    char *bufs[2] = {out, err};
    size_t caps[2] = {out_cap, err_cap};
    for (int i = 0; i < 2; i++) {
        if (!bufs[i])
            continue;
        FILE *f = fopen(paths[i], "rb");
        size_t n = f ? fread(bufs[i], 1, caps[i] - 1, f) : 0;
        bufs[i][n] = '\0';
        if (f)
            fclose(f);
    }
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

static int parse_ids(const char *s, int32_t *ids)
{
    int n = 0;
    char *end;
    for (;;) {
        long v = strtol(s, &end, 10);
        if (end == s || n == MAX_IDS)
            break;
        ids[n++] = (int32_t)v;
        s = end;
    }
    return n;
}

static int setup(void **state)
{
    (void)state;
    snprintf(g_dir, sizeof g_dir, "/tmp/kvserve-test-gen-XXXXXX");
    if (!mkdtemp(g_dir))
        return -1;
    snprintf(g_model, sizeof g_model, "%s/tiny.gguf", g_dir);
    char args[1024];
    snprintf(args, sizeof args, "synth --preset tiny --type q8_0 -t 1 -o '%s'", g_model);
    return run_kvserve(args, NULL, 0, NULL, 0) == 0 ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    if (g_dir[0]) {
        char cmd[512];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
        if (system(cmd) != 0)
            return -1;
    }
    return 0;
}

/* The reference: the same decode through the library with an argmax. */
static int reference_greedy(const int32_t *prompt, int n_prompt, int n_predict, int32_t *out)
{
    struct model *m;
    assert_int_equal(model_load(g_model, &m), KS_OK);
    struct kv_config cfg;
    model_kv_config(m, &cfg);
    cfg.mem_budget = 64u << 20;
    struct kv_cache *kv;
    struct model_ctx *ctx;
    int32_t seq;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    assert_int_equal(kv_seq_create(kv, &seq), KS_OK);
    assert_int_equal(model_ctx_create(m, n_prompt, NULL, &ctx), KS_OK);
    int n_vocab = model_hparams(m)->n_vocab;
    float *logits = malloc((size_t)n_vocab * sizeof *logits);
    int32_t pos[MAX_IDS], seqs[MAX_IDS], tok;
    for (int i = 0; i < n_prompt; i++) {
        pos[i] = i;
        seqs[i] = seq;
    }
    struct model_batch b = {.n_tokens = n_prompt, .tokens = prompt, .pos = pos, .seq = seqs};
    assert_int_equal(model_forward(ctx, kv, &b, logits, NULL), KS_OK);
    for (int g = 0; g < n_predict; g++) {
        tok = 0;
        for (int i = 1; i < n_vocab; i++)
            if (logits[i] > logits[tok])
                tok = i;
        out[g] = tok;
        int32_t p = n_prompt + g;
        b = (struct model_batch){.n_tokens = 1, .tokens = &tok, .pos = &p, .seq = &seq};
        assert_int_equal(model_forward(ctx, kv, &b, logits, NULL), KS_OK);
    }
    free(logits);
    model_ctx_free(ctx);
    kv_free(kv);
    model_free(m);
    return n_predict;
}

static void test_greedy_matches_library(void **state)
{
    (void)state;
    const int32_t prompt[5] = {1, 300, 301, 302, 303};
    char args[1024], out[4096], err[4096];
    snprintf(args, sizeof args, "generate -m '%s' --ids 1,300,301,302,303 -n %d --temp 0 --output-ids -t 1",
             g_model, N_PREDICT);
    assert_int_equal(run_kvserve(args, out, sizeof out, err, sizeof err), 0);
    int32_t got[MAX_IDS], want[MAX_IDS];
    assert_int_equal(parse_ids(out, got), N_PREDICT);
    assert_non_null(strchr(out, '\n'));
    assert_string_equal(strchr(out, '\n'), "\n"); /* exactly one line */
    reference_greedy(prompt, 5, N_PREDICT, want);
    assert_memory_equal(got, want, sizeof(int32_t) * N_PREDICT);
    assert_non_null(strstr(err, "timing: prompt 5 tok,"));
    assert_non_null(strstr(err, "generated 12 tok,"));
    assert_non_null(strstr(err, "peak RSS"));
}

static void test_seeded_sampling_reproducible(void **state)
{
    (void)state;
    char args[1024], a[4096], b[4096], c[4096];
    const char *fmt = "generate -m '%s' --ids 1,2,3 -n 24 --temp 1.5 --top-k 0 --top-p 1 --min-p 0 "
                      "--seed %d --output-ids -t 1";
    snprintf(args, sizeof args, fmt, g_model, 5);
    assert_int_equal(run_kvserve(args, a, sizeof a, NULL, 0), 0);
    assert_int_equal(run_kvserve(args, b, sizeof b, NULL, 0), 0);
    assert_string_equal(a, b);
    snprintf(args, sizeof args, fmt, g_model, 6);
    assert_int_equal(run_kvserve(args, c, sizeof c, NULL, 0), 0);
    assert_string_not_equal(a, c);
    int32_t ids[MAX_IDS];
    assert_int_equal(parse_ids(a, ids), 24);
}

static void test_usage_errors(void **state)
{
    (void)state;
    char args[1024], err[4096];
    snprintf(args, sizeof args, "generate -m '%s' --ids 1,2 --top-p 1.5", g_model);
    assert_int_equal(run_kvserve(args, NULL, 0, err, sizeof err), 2);
    assert_non_null(strstr(err, "--top-p"));
    assert_int_equal(run_kvserve("generate --ids 1,x", NULL, 0, NULL, 0), 2);
    snprintf(args, sizeof args, "generate -m '%s' --ids 1,999999 -n 2", g_model);
    assert_int_equal(run_kvserve(args, NULL, 0, err, sizeof err), 1);
    assert_non_null(strstr(err, "999999"));
    assert_int_equal(run_kvserve("generate -m /nonexistent.gguf --ids 1", NULL, 0, NULL, 0), 1);
}

/* "key": [1,2,3] -> ids, as a comma list for --ids; returns the count. */
static int json_ids(const char *json, const char *key, int32_t *ids, int cap, char *list, size_t list_cap)
{
    const char *p = strstr(json, key);
    if (!p || !(p = strchr(p, '[')))
        return 0;
    int n = 0;
    size_t used = 0;
    list[0] = '\0';
    for (p++; n < cap;) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p)
            break;
        ids[n++] = (int32_t)v;
        used += (size_t)snprintf(list + used, list_cap - used, n > 1 ? ",%ld" : "%ld", v);
        p = end;
        while (*p == ',' || *p == ' ' || *p == '\n')
            p++;
    }
    return n;
}

/* llama.cpp's greedy continuations (../shared/ref) reproduced by the CLI: the
 * reference at json_path, made with the model at model_path. */
static void check_llama_cpp_greedy_ids(const char *json_path, const char *model_path)
{
    char json[65536], list[8192], args[12288], out[8192];
    FILE *f = fopen(json_path, "rb");
    assert_non_null(f);
    size_t n = fread(json, 1, sizeof json - 1, f);
    fclose(f);
    json[n] = '\0';
    int32_t prompt[MAX_IDS * 4], want[MAX_IDS * 2], got[MAX_IDS];
    int n_prompt = json_ids(json, "\"prompt_ids\"", prompt, MAX_IDS * 4, list, sizeof list);
    char greedy_list[8192];
    int n_want = json_ids(json, "\"greedy_ids\"", want, MAX_IDS, greedy_list, sizeof greedy_list);
    assert_true(n_prompt > 0 && n_want == MAX_IDS);
    snprintf(args, sizeof args, "generate -m '%s' --ids %s -n %d --temp 0 -ctk f32 -ctv f32 --ignore-eos --output-ids -t 1",
             model_path, list, n_want);
    assert_int_equal(run_kvserve(args, out, sizeof out, NULL, 0), 0);
    assert_int_equal(parse_ids(out, got), n_want);
    assert_memory_equal(got, want, sizeof(int32_t) * (size_t)n_want);
}

/* A case per reference, each skipped (visibly) when its files are absent. */
#define LLAMA_CPP_GREEDY_CASE(fn, ref, model)                                                                    \
    static void fn(void **state)                                                                                 \
    {                                                                                                            \
        (void)state;                                                                                             \
        const char *shared = getenv("KVSERVE_SHARED");                                                           \
        char json_path[1024], model_path[1024];                                                                  \
        snprintf(json_path, sizeof json_path, "%s/ref/%s.json", shared ? shared : "../shared", ref);             \
        snprintf(model_path, sizeof model_path, "%s/%s", shared ? shared : "../shared", model);                  \
        if (access(json_path, R_OK) || access(model_path, R_OK))                                                 \
            KS_SKIP("no %s or %s", json_path, model_path);                                                      \
        check_llama_cpp_greedy_ids(json_path, model_path);                                                       \
    }
LLAMA_CPP_GREEDY_CASE(test_llama_cpp_greedy_once, "stories260K.once", "models/stories260K.gguf")
LLAMA_CPP_GREEDY_CASE(test_llama_cpp_greedy_park, "stories260K.park", "models/stories260K.gguf")
LLAMA_CPP_GREEDY_CASE(test_llama_cpp_greedy_april, "instrument.april", "models/trained/tiny-llama-gqa-hd64-f32.gguf")

static void test_bench_table(void **state)
{
    (void)state;
    char args[1024], out[4096];
    snprintf(args, sizeof args, "bench -m '%s' -p 16 -n 4 -r 2 -t 1 -d 8", g_model);
    assert_int_equal(run_kvserve(args, out, sizeof out, NULL, 0), 0);
    assert_non_null(strstr(out, "| model |"));
    assert_non_null(strstr(out, "| pp16 @ d8 |"));
    assert_non_null(strstr(out, "| tg4 @ d8 |"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_matches_library),
        cmocka_unit_test(test_seeded_sampling_reproducible),
        cmocka_unit_test(test_usage_errors),
        cmocka_unit_test(test_llama_cpp_greedy_once),
        cmocka_unit_test(test_llama_cpp_greedy_park),
        cmocka_unit_test(test_llama_cpp_greedy_april),
        cmocka_unit_test(test_bench_table),
    };
    g_bin = getenv("KVSERVE_BIN");
    if (!g_bin || access(g_bin, X_OK))
        return ks_skip_all("KVSERVE_BIN not set or not executable (run through ctest)");
    return ks_run_tests(tests, setup, teardown);
}
