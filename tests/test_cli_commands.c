/* The five commands that load a model (serve, bench, generate, chat,
 * perplexity), run as the real binary ($KVSERVE_BIN) on stories260K (without
 * ../shared, on the build's default model, $KVSERVE_DEFAULT_MODEL, and the
 * two cases that need stories260K's head_dim of 8 skip): each
 * --help ends with the same shared flag block, a bad KV value is a usage
 * error (message, usage, exit 2), a quantized cache on a model whose
 * head_dim is not a multiple of 32 fails with kv's message, and the older
 * spellings --kv-page-tokens / --kv-sinks still run. bench also sweeps
 * llama-bench-style lists (every combination one row per test, csv and json
 * output) and goes on past a combination the model cannot run. */
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
#include <cjson/cJSON.h>

#include "cli/args.h"
#include "support/skip.h"

static const char *const commands[] = {"serve", "bench", "generate", "chat", "perplexity"};
enum { N_COMMANDS = sizeof commands / sizeof commands[0] };

static char g_model[4096], g_text[4096];
static const char *g_bin;
static bool g_head_dim_8; /* g_model is stories260K, whose head_dim 8 no quantized cache can hold */

/* snprintf that fails the test instead of truncating. */
__attribute__((format(printf, 3, 4))) static void fmt(char *buf, size_t cap, const char *f, ...)
{
    va_list ap;
    va_start(ap, f);
    int w = vsnprintf(buf, cap, f, ap);
    va_end(ap);
    assert_true(w >= 0 && (size_t)w < cap);
}

/* Each command's other required arguments, so only the flag under test is wrong. */
static const char *needs(const char *cmd)
{
    static char ppl[4200];
    if (!strcmp(cmd, "serve"))
        return "--port 0 -t 1";
    if (!strcmp(cmd, "bench"))
        return "-p 8 -n 4 -r 1 -t 1";
    if (!strcmp(cmd, "generate"))
        return "--ids 1,2,3 -n 4 --temp 0 --output-ids -t 1";
    if (!strcmp(cmd, "chat"))
        return "-t 1";
    fmt(ppl, sizeof ppl, "-f '%s' -c 64 --chunks 1 -t 1", g_text);
    return ppl;
}

/* Run kvserve with args (stdin empty); its stdout, and with_stderr its
 * stderr too, into out. */
static int run_to(const char *args, bool with_stderr, char *out, size_t cap)
{
    char cmd[12288];
    fmt(cmd, sizeof cmd, "'%s' %s </dev/null %s", g_bin, args, with_stderr ? "2>&1" : "2>/dev/null");
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = '\0';
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static int run(const char *args, char *out, size_t cap)
{
    return run_to(args, true, out, cap);
}

/* The binary, the model (stories260K, else the default model) and a text for
 * perplexity; false (with the reason in g_missing) when one is absent. */
static char g_missing[8400];

static bool find_inputs(void)
{
    const char *shared = getenv("KVSERVE_SHARED"), *src = getenv("KVSERVE_SOURCE");
    const char *fallback = getenv("KVSERVE_DEFAULT_MODEL");
    g_bin = getenv("KVSERVE_BIN");
    fmt(g_model, sizeof g_model, "%s/models/stories260K.gguf", shared ? shared : "../shared");
    fmt(g_text, sizeof g_text, "%s/README.md", src ? src : ".");
    if (!g_bin || access(g_bin, X_OK)) {
        fmt(g_missing, sizeof g_missing, "KVSERVE_BIN not set or not executable (run through ctest)");
        return false;
    }
    g_head_dim_8 = access(g_model, R_OK) == 0;
    if (!g_head_dim_8) {
        if (!fallback || access(fallback, R_OK)) {
            fmt(g_missing, sizeof g_missing, "no %s and no $KVSERVE_DEFAULT_MODEL", g_model);
            return false;
        }
        printf("no %s: running on the default model %s\n", g_model, fallback);
        fmt(g_model, sizeof g_model, "%s", fallback);
    }
    if (access(g_text, R_OK)) {
        fmt(g_missing, sizeof g_missing, "no %s", g_text);
        return false;
    }
    return true;
}

static char g_out[1 << 16];

static void every_help_ends_with_the_shared_block(void **state)
{
    (void)state;
    size_t block = strlen(cli_model_flags_help);
    for (int i = 0; i < N_COMMANDS; i++) {
        char args[64];
        fmt(args, sizeof args, "%s --help", commands[i]);
        assert_int_equal(run(args, g_out, sizeof g_out), 0);
        size_t n = strlen(g_out);
        assert_true(n >= block);
        assert_string_equal(g_out + n - block, cli_model_flags_help);
    }
}

static void a_bad_kv_value_is_a_usage_error(void **state)
{
    (void)state;
    static const char *const bad[][2] = {
        {"--kv-page", "48"}, {"-ctk", "q5_k"}, {"--kv-high", "1.5"}, {"--kv-rotate", "yes"}, {"--kv-sinks", "-1"}};
    for (int i = 0; i < N_COMMANDS; i++)
        for (size_t j = 0; j < sizeof bad / sizeof bad[0]; j++) {
            char args[8192], want[128], usage[64];
            fmt(args, sizeof args, "%s -m '%s' %s %s %s", commands[i], g_model, needs(commands[i]), bad[j][0],
                     bad[j][1]);
            assert_int_equal(run(args, g_out, sizeof g_out), 2);
            fmt(want, sizeof want, "kvserve %s: bad value '%s' for %s", commands[i], bad[j][1], bad[j][0]);
            fmt(usage, sizeof usage, "usage: kvserve %s", commands[i]);
            assert_non_null(strstr(g_out, want));
            assert_non_null(strstr(g_out, usage));
        }
}

static void a_quantized_cache_needs_head_dim_32(void **state)
{
    (void)state;
    if (!g_head_dim_8)
        KS_SKIP("needs stories260K.gguf (head_dim 8), absent under $KVSERVE_SHARED/models");
    for (int i = 0; i < N_COMMANDS; i++) {
        char args[8192], want[64];
        /* the older spellings first: kv's message proves they parsed, serve's too */
        fmt(args, sizeof args, "%s -m '%s' %s --kv-page-tokens 16 --kv-sinks 4 -ctk q4_0", commands[i], g_model,
            needs(commands[i]));
        int rc = run(args, g_out, sizeof g_out);
        assert_true(rc == 1 || rc == 2);
        fmt(want, sizeof want, "kvserve %s: ", commands[i]);
        assert_non_null(strstr(g_out, want));
        assert_non_null(strstr(g_out, "--cache-type-k: KV cache type q4_0 needs head_dim to be a multiple of 32"));
    }
    /* every block type says so too; bf16 has no block and runs */
    char args[8192];
    fmt(args, sizeof args, "generate -m '%s' %s -ctv iq4_nl", g_model, needs("generate"));
    assert_int_equal(run(args, g_out, sizeof g_out), 1);
    assert_non_null(strstr(g_out, "--cache-type-v: KV cache type iq4_nl needs head_dim to be a multiple of 32"));
    fmt(args, sizeof args, "bench -m '%s' -p 8 -n 4 -r 1 -t 1 -ctk bf16 -ctv bf16,f16 -o csv", g_model);
    assert_int_equal(run(args, g_out, sizeof g_out), 0);
    assert_non_null(strstr(g_out, ",bf16,bf16,"));
    assert_non_null(strstr(g_out, ",bf16,f16,"));
}

static void older_spellings_and_mmap_run(void **state)
{
    (void)state;
    char args[8192], plain[256];
    fmt(args, sizeof args, "generate -m '%s' %s", g_model, needs("generate"));
    assert_int_equal(run_to(args, false, g_out, sizeof g_out), 0);
    fmt(plain, sizeof plain, "%s", g_out);
    fmt(args, sizeof args, "generate -m '%s' %s --mmap --kv-page-tokens 16 --kv-sinks 4 --kv-policy dynamic",
             g_model, needs("generate"));
    assert_int_equal(run_to(args, false, g_out, sizeof g_out), 0);
    assert_string_equal(g_out, plain); /* greedy ids: neither the mapping nor the page size changes them */
    fmt(args, sizeof args, "bench -m '%s' %s --mmap --kv-page-tokens 16 --kv-sinks 4", g_model, needs("bench"));
    assert_int_equal(run(args, g_out, sizeof g_out), 0);
    assert_non_null(strstr(g_out, "| tg4 |"));
}

/* Does a CSV row of bench hold exactly this combination and test? Fields:
 * model,size_bytes,n_threads,type_k,type_v,kv_policy,test,n_prompt,n_gen,n_depth,reps,... */
static int count_csv_rows(const char *csv, int threads, const char *type_k, const char *test, int depth)
{
    char want[128];
    int n = 0;
    fmt(want, sizeof want, ",%d,%s,f16,static,%s,", threads, type_k, test);
    for (const char *line = csv; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
        const char *at = strstr(line, want), *end = strchr(line, '\n');
        if (!at || (end && at > end))
            continue;
        /* n_prompt,n_gen, then n_depth */
        const char *f = at + strlen(want);
        int np, ng, d;
        if (sscanf(f, "%d,%d,%d,", &np, &ng, &d) == 3 && d == depth)
            n++;
    }
    return n;
}

static void bench_sweeps_every_combination(void **state)
{
    (void)state;
    char args[8192];
    fmt(args, sizeof args, "bench -m '%s' -p 8,16 -n 4 -r 2 -t 1,2 -ctk f16,f32 -d 0,8 -o csv", g_model);
    assert_int_equal(run_to(args, false, g_out, sizeof g_out), 0);
    assert_true(!strncmp(g_out, "model,size_bytes,n_threads,type_k,type_v,kv_policy,test,", 56));
    int lines = 0;
    for (const char *p = g_out; (p = strchr(p, '\n')); p++)
        lines++;
    assert_int_equal(lines, 1 + 2 * 2 * 2 * 3);
    static const char *const tests[] = {"pp8", "pp16", "tg4"};
    for (int t = 1; t <= 2; t++)
        for (int k = 0; k < 2; k++)
            for (int d = 0; d <= 8; d += 8)
                for (int i = 0; i < 3; i++) {
                    char name[32];
                    fmt(name, sizeof name, "%s%s", tests[i], d ? " @ d8" : "");
                    assert_int_equal(count_csv_rows(g_out, t, k ? "f32" : "f16", name, d), 1);
                }
}

static void bench_json_rows(void **state)
{
    (void)state;
    char args[8192];
    fmt(args, sizeof args, "bench -m '%s' -p 8 -n 4 -r 3 -t 1 -ctk f32 -o json", g_model);
    assert_int_equal(run_to(args, false, g_out, sizeof g_out), 0);
    cJSON *rows = cJSON_Parse(g_out);
    assert_true(cJSON_IsArray(rows));
    assert_int_equal(cJSON_GetArraySize(rows), 2);
    for (int i = 0; i < 2; i++) {
        const cJSON *r = cJSON_GetArrayItem(rows, i);
        assert_string_equal(cJSON_GetObjectItem(r, "test")->valuestring, i ? "tg4" : "pp8");
        assert_string_equal(cJSON_GetObjectItem(r, "type_k")->valuestring, "f32");
        assert_string_equal(cJSON_GetObjectItem(r, "type_v")->valuestring, "f16");
        const cJSON *samples = cJSON_GetObjectItem(r, "samples_ts");
        assert_int_equal(cJSON_GetArraySize(samples), 3);
        double lo = 1e300, hi = 0, median = cJSON_GetObjectItem(r, "tps_median")->valuedouble;
        for (int j = 0; j < 3; j++) {
            double v = cJSON_GetArrayItem(samples, j)->valuedouble;
            lo = v < lo ? v : lo, hi = v > hi ? v : hi;
        }
        assert_true(lo > 0 && lo <= median && median <= hi);
        const cJSON *gbs = cJSON_GetObjectItem(r, "weights_gbs");
        assert_true(i ? cJSON_IsNumber(gbs) && gbs->valuedouble > 0 : cJSON_IsNull(gbs));
    }
    cJSON_Delete(rows);
}

/* A combination the model cannot run is reported, the rest still run, exit 1. */
static void bench_reports_a_failed_combination_and_goes_on(void **state)
{
    (void)state;
    if (!g_head_dim_8) /* the failing combination is a q8_0 cache on head_dim 8 */
        KS_SKIP("needs stories260K.gguf (head_dim 8), absent under $KVSERVE_SHARED/models");
    char args[8192];
    fmt(args, sizeof args, "bench -m '%s' -p 8 -n 4 -r 1 -t 1 -ctk q8_0,f16", g_model);
    assert_int_equal(run(args, g_out, sizeof g_out), 1);
    assert_non_null(strstr(g_out, "kvserve bench: stories260K.gguf, -t 1 -ctk q8_0 -ctv f16 -d 0: --cache-type-k: "));
    assert_non_null(strstr(g_out, "| f16/f16 | pp8 |"));
    assert_non_null(strstr(g_out, "| f16/f16 | tg4 |"));
    assert_null(strstr(g_out, "| q8_0/f16 |"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(every_help_ends_with_the_shared_block),
        cmocka_unit_test(a_bad_kv_value_is_a_usage_error),
        cmocka_unit_test(a_quantized_cache_needs_head_dim_32),
        cmocka_unit_test(older_spellings_and_mmap_run),
        cmocka_unit_test(bench_sweeps_every_combination),
        cmocka_unit_test(bench_json_rows),
        cmocka_unit_test(bench_reports_a_failed_combination_and_goes_on),
    };
    if (!find_inputs())
        return ks_skip_all("%s", g_missing);
    return ks_run_tests(tests, NULL, NULL);
}
