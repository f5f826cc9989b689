/* The speculation flags of the real binary ($KVSERVE_BIN) on the build's
 * default model ($KVSERVE_DEFAULT_MODEL): generate gives the same greedy ids
 * with --spec-type ngram as without and reports its acceptance; bad values of
 * --spec-type, --draft-max and --draft-min are usage errors in generate and
 * serve, and serve refuses --draft-min above --draft-max with the numbers;
 * bench --all-logits runs. */
#include <setjmp.h>
#include <stdbool.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cmocka.h>

#include "support/run_kvserve.h"
#include "support/skip.h"

static const char *g_bin, *g_model;
static char g_out[1 << 16];

/* Run kvserve with args (support/run_kvserve.h); stdout, and with_stderr stderr too, into g_out. */
static int run_to(const char *args, bool with_stderr)
{
    return (with_stderr ? ks_run_kvserve : ks_run_kvserve_stdout)("", args, g_out, sizeof g_out);
}

static bool have_inputs(void)
{
    g_bin = getenv("KVSERVE_BIN");
    g_model = getenv("KVSERVE_DEFAULT_MODEL");
    return g_bin && !access(g_bin, X_OK) && g_model && !access(g_model, R_OK);
}

#define NEED_INPUTS()                                                                                             \
    do {                                                                                                          \
        if (!have_inputs())                                                                                       \
            KS_SKIP("KVSERVE_BIN or KVSERVE_DEFAULT_MODEL missing (run through ctest)");                          \
    } while (0)

static void test_generate_same_ids(void **state)
{
    (void)state;
    NEED_INPUTS();
    static const char *prompts[] = {"1,5,6,7,8,9,10,11,12,5,6,7,8,9,10,11,12", "3,100,200,300,400,17,29,31"};
    for (size_t i = 0; i < sizeof prompts / sizeof *prompts; i++) {
        char args[1024];
        static char plain[sizeof g_out];
        snprintf(args, sizeof args, "generate -m '%s' --ids %s -n 48 --temp 0 --ignore-eos --output-ids -t 1", g_model,
                 prompts[i]);
        assert_int_equal(run_to(args, false), 0);
        memcpy(plain, g_out, sizeof plain);
        assert_true(strlen(plain) > 48);
        strcat(args, " --spec-type ngram --draft-max 8 --draft-min 1");
        assert_int_equal(run_to(args, false), 0);
        assert_string_equal(g_out, plain);
        assert_int_equal(run_to(args, true), 0);
        const char *line = strstr(g_out, "speculation: ngram, ");
        assert_non_null(line);
        assert_true(atoi(line + strlen("speculation: ngram, ")) > 0); /* drafted */
        char *type = strstr(args, "--spec-type ngram") + strlen("--spec-type ngram");
        memmove(type + strlen("-pool --spec-ngram-size-n 4"), type, strlen(type) + 1);
        memcpy(type, "-pool --spec-ngram-size-n 4", strlen("-pool --spec-ngram-size-n 4"));
        assert_int_equal(run_to(args, false), 0);
        assert_string_equal(g_out, plain);
    }
}

static void test_bad_values(void **state)
{
    (void)state;
    NEED_INPUTS();
    static const char *const bad[][2] = {
        {"--spec-type", "draft-eagle3"}, {"--draft-max", "0"}, {"--draft-max", "65"}, {"--draft-min", "-1"},
        {"--spec-ngram-size-n", "1"}, {"--spec-ngram-size-n", "65"}};
    static const char *const cmds[][2] = {{"generate", "--ids 1,2,3 -n 2"}, {"serve", "--port 0 -t 1"}};
    for (size_t c = 0; c < 2; c++)
        for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
            char args[1024], want[128];
            snprintf(args, sizeof args, "%s -m '%s' %s %s %s", cmds[c][0], g_model, cmds[c][1], bad[i][0], bad[i][1]);
            assert_int_equal(run_to(args, true), 2);
            snprintf(want, sizeof want, "kvserve %s: bad value '%s' for %s", cmds[c][0], bad[i][1], bad[i][0]);
            if (!strstr(g_out, want))
                fail_msg("%s: no '%s' in:\n%s", args, want, g_out);
        }
    char args[1024];
    snprintf(args, sizeof args, "generate -m '%s' --ids 1,2,3 -n 2 --draft-min 5 --draft-max 2", g_model);
    assert_int_equal(run_to(args, true), 2);
    assert_non_null(strstr(g_out, "--draft-min 5 is above --draft-max 2"));
    snprintf(args, sizeof args, "serve -m '%s' --port 0 -t 1 --spec-type ngram --draft-min 5 --draft-max 2", g_model);
    assert_int_equal(run_to(args, true), 2);
    assert_non_null(strstr(g_out, "--draft-min in 0..--draft-max (got 2 and 5)"));
}

static void test_bench_all_logits(void **state)
{
    (void)state;
    NEED_INPUTS();
    char args[1024];
    snprintf(args, sizeof args, "bench -m '%s' -p 2,9 -n 2 -d 16 -r 1 -t 1 --all-logits -o csv", g_model);
    assert_int_equal(run_to(args, false), 0);
    assert_non_null(strstr(g_out, ",pp2 @ d16,2,0,16,"));
    assert_non_null(strstr(g_out, ",pp9 @ d16,9,0,16,"));
    assert_non_null(strstr(g_out, ",tg2 @ d16,0,2,16,"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_generate_same_ids),
        cmocka_unit_test(test_bad_values),
        cmocka_unit_test(test_bench_all_logits),
    };
    return ks_run_tests(tests, NULL, NULL);
}
