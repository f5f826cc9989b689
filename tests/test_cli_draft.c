/* --model-draft through the real binary ($KVSERVE_BIN) on the build's default
 * model ($KVSERVE_DEFAULT_MODEL): generate gives the same greedy ids with a
 * draft model (the target itself, a 1-layer draft of the same vocabulary at
 * q4_0 pages, and with --draft-p-min) as without and reports the acceptance;
 * serve and generate refuse a draft of another vocabulary naming both sizes and
 * the first differing token, and a draft whose KV does not fit the budget with
 * the numbers; the flags that contradict each other are usage errors.
 * (tests/e2e/draft.sh serves with a draft model.) */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cmocka.h>

#include "model/model.h"
#include "support/run_kvserve.h"
#include "support/skip.h"

static const char *g_bin, *g_model;
static char g_out[1 << 16];
static char g_small[64] = "/tmp/test_cli_draft_small_XXXXXX"; /* 1 layer of `tiny`, another seed */
static char g_other[64] = "/tmp/test_cli_draft_other_XXXXXX"; /* a 300-token vocabulary */
static bool g_made;

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

static void synth(char *path, int n_layer, int n_vocab, uint64_t seed)
{
    struct model_synth_spec spec;
    assert_int_equal(model_synth_preset("tiny", &spec), KS_OK);
    spec.n_layer = n_layer;
    spec.n_vocab = n_vocab;
    spec.seed = seed;
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    assert_int_equal(model_synth(&spec, "q8_0", NULL, path, NULL), KS_OK);
}

/* generate's "speculation: draft, N drafted, M accepted" line in g_out. */
static void speculation_counts(int *drafted, int *accepted)
{
    const char *line = strstr(g_out, "speculation: draft, ");
    assert_non_null(line);
    *drafted = atoi(line + strlen("speculation: draft, "));
    const char *acc = strstr(line, "drafted, ");
    assert_non_null(acc);
    *accepted = atoi(acc + strlen("drafted, "));
}

static void test_generate_same_ids(void **state)
{
    (void)state;
    NEED_INPUTS();
    static const char *prompts[] = {"1,5,6,7,8,9,10,11,12,5,6,7,8,9,10,11,12", "3,100,200,300,400,17,29,31"};
    char drafts[3][256];
    snprintf(drafts[0], sizeof drafts[0], "-md '%s' -ctkd f16 -ctvd f16", g_model);
    snprintf(drafts[1], sizeof drafts[1], "--model-draft '%s'", g_small);
    snprintf(drafts[2], sizeof drafts[2], "--spec-type draft -md '%s' --draft-p-min 0.5", g_small);
    for (size_t i = 0; i < sizeof prompts / sizeof *prompts; i++) {
        char args[1024];
        static char plain[sizeof g_out];
        snprintf(args, sizeof args, "generate -m '%s' --ids %s -n 48 --temp 0 --ignore-eos --output-ids -t 1", g_model,
                 prompts[i]);
        assert_int_equal(run_to(args, false), 0);
        memcpy(plain, g_out, sizeof plain);
        assert_true(strlen(plain) > 48);
        for (int d = 0; d < 3; d++) {
            char with[2048];
            snprintf(with, sizeof with, "%s --draft-max 6 --draft-min 1 %s", args, drafts[d]);
            assert_int_equal(run_to(with, false), 0);
            assert_string_equal(g_out, plain);
            assert_int_equal(run_to(with, true), 0);
            int drafted, accepted;
            speculation_counts(&drafted, &accepted);
            print_message("prompt %zu, draft %d: %d drafted, %d accepted\n", i, d, drafted, accepted);
            assert_true(accepted <= drafted);
            assert_true(drafted > 0 || d == 2); /* a random draft model is rarely sure (p >= 0.5) of a token */
            if (d == 0) /* the target itself, at its own KV precision */
                assert_int_equal(accepted, drafted);
        }
    }
}

/* generate, sampling, the target as its own draft: each draft is drawn from
 * q = the target's own p, so min(1, p / q) keeps all but a rounding's worth. */
static void test_generate_sampled_self_draft(void **state)
{
    (void)state;
    NEED_INPUTS();
    char args[2048];
    snprintf(args, sizeof args,
             "generate -m '%s' --ids 3,100,200,300,400,17,29,31 -n 48 --temp 1 --top-k 10 --top-p 1 --min-p 0 "
             "--seed 3 --ignore-eos --output-ids -t 1 -md '%s' -ctkd f16 -ctvd f16 --draft-max 6 --draft-min 1",
             g_model, g_model);
    assert_int_equal(run_to(args, true), 0);
    int drafted, accepted;
    speculation_counts(&drafted, &accepted);
    print_message("sampled self-draft: %d drafted, %d accepted\n", drafted, accepted);
    assert_true(drafted > 0);
    assert_true(accepted >= drafted - 2);
}

static void test_refused(void **state)
{
    (void)state;
    NEED_INPUTS();
    static const char *const cmds[][2] = {{"generate", "--ids 1,2,3 -n 2"}, {"serve", "--port 0 -t 1"}};
    for (int c = 0; c < 2; c++) {
        char args[2048];
        snprintf(args, sizeof args, "%s -m '%s' %s -md '%s'", cmds[c][0], g_model, cmds[c][1], g_other);
        assert_int_not_equal(run_to(args, true), 0);
        if (!strstr(g_out, "the draft model's vocabulary (300 tokens) differs from the target's (512 tokens): first at "
                           "token "))
            fail_msg("%s:\n%s", args, g_out);
        /* a context of both does not fit: the numbers */
        snprintf(args, sizeof args, "%s -m '%s' %s -md '%s' --kv-mem 1M -c 4096", cmds[c][0], g_model, cmds[c][1],
                 g_small);
        if (c == 0)
            snprintf(args, sizeof args, "generate -m '%s' --ids 1,2,3 -n 4000 -md '%s' --kv-mem 1M", g_model, g_small);
        assert_int_not_equal(run_to(args, true), 0);
        if (!strstr(g_out, "--model-draft: one sequence of ") || !strstr(g_out, "over the KV budget of 1.00 MiB"))
            fail_msg("%s:\n%s", args, g_out);
        /* contradictions */
        snprintf(args, sizeof args, "%s -m '%s' %s --spec-type draft", cmds[c][0], g_model, cmds[c][1]);
        assert_int_equal(run_to(args, true), 2);
        assert_non_null(strstr(g_out, "--spec-type draft needs a draft model (--model-draft FILE)"));
        snprintf(args, sizeof args, "%s -m '%s' %s --spec-type ngram -md '%s'", cmds[c][0], g_model, cmds[c][1],
                 g_small);
        assert_int_equal(run_to(args, true), 2);
        assert_non_null(strstr(g_out, "not an n-gram speculator"));
        snprintf(args, sizeof args, "%s -m '%s' %s --draft-p-min 1.5", cmds[c][0], g_model, cmds[c][1]);
        assert_int_equal(run_to(args, true), 2);
        assert_non_null(strstr(g_out, "bad value '1.5' for --draft-p-min"));
        snprintf(args, sizeof args, "%s -m '%s' %s -ctkd q3_k", cmds[c][0], g_model, cmds[c][1]);
        assert_int_equal(run_to(args, true), 2);
        assert_non_null(strstr(g_out, "bad value 'q3_k' for -ctkd"));
    }
}

static int group_setup(void **state)
{
    (void)state;
    if (!have_inputs())
        return 0;
    synth(g_small, 1, 512, 99);
    synth(g_other, 1, 300, 99);
    g_made = true;
    return 0;
}

static int group_teardown(void **state)
{
    (void)state;
    if (g_made) {
        unlink(g_small);
        unlink(g_other);
    }
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_generate_same_ids),
        cmocka_unit_test(test_generate_sampled_self_draft),
        cmocka_unit_test(test_refused),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
