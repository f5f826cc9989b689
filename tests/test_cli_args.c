/* The flags shared by every command that loads a model (serve, bench,
 * generate, chat, perplexity): every KV flag lands in the right kv_config
 * field, the older spellings still work, bad values are refused, unknown
 * flags are left to the command, and apply() copies the choices but never
 * the model's shape or the budget. cli_parse_command() routes --mmap and
 * the KV flags, and answers -h, unknown flags and bad values with 2. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <cmocka.h>

#include "cli/args.h"

static bool parse(struct cli_kv_flags *f, const char *flag, const char *value)
{
    bool ok = true;
    assert_true(cli_parse_kv_flag(flag, value, f, &ok));
    return ok;
}

static void every_flag_sets_its_field(void **state)
{
    (void)state;
    struct cli_kv_flags f;
    cli_kv_flags_init(&f);
    assert_int_equal(f.mem, 0);
    assert_int_equal(f.cfg.type_k, QUANT_F16);
    assert_true(f.cfg.rotate);
    assert_true(f.cfg.scale_search);
    assert_true(parse(&f, "--kv-mem", "2M"));
    assert_int_equal(f.mem, 2u << 20);
    assert_true(parse(&f, "-ctk", "q8_0"));
    assert_true(parse(&f, "--cache-type-v", "Q4_0"));
    assert_int_equal(f.cfg.type_k, QUANT_Q8_0);
    assert_int_equal(f.cfg.type_v, QUANT_Q4_0);
    assert_true(parse(&f, "--kv-policy", "dynamic"));
    assert_int_equal(f.cfg.policy, KV_POLICY_DYNAMIC);
    assert_true(parse(&f, "--kv-page", "64"));
    assert_int_equal(f.cfg.page_tokens, 64);
    assert_true(parse(&f, "--kv-rotate", "off"));
    assert_false(f.cfg.rotate);
    assert_true(parse(&f, "--kv-scale-search", "off"));
    assert_false(f.cfg.scale_search);
    assert_int_equal(f.cfg.smooth, KV_SMOOTH_OFF);
    assert_true(parse(&f, "--kv-smooth", "kv"));
    assert_int_equal(f.cfg.smooth, KV_SMOOTH_KV);
    assert_true(parse(&f, "--kv-sink", "4"));
    assert_true(parse(&f, "--kv-hot", "128"));
    assert_true(parse(&f, "--kv-floor", "q8_0"));
    assert_true(parse(&f, "--kv-ladder", "f16,q8_0,q5_0,q4_0"));
    assert_true(parse(&f, "-ctv", "iq4_nl"));
    assert_int_equal(f.cfg.type_v, QUANT_IQ4_NL);
    assert_true(parse(&f, "-ctv", "Q4_0"));
    assert_true(parse(&f, "--kv-high", "0.7"));
    assert_true(parse(&f, "--kv-low", "0.5"));
    assert_int_equal(f.cfg.sink_tokens, 4);
    assert_int_equal(f.cfg.hot_tokens, 128);
    assert_int_equal(f.cfg.floor, QUANT_Q8_0);
    assert_true(parse(&f, "--kv-floor", "iq3_nl"));
    assert_int_equal(f.cfg.floor, QUANT_IQ3_NL);
    assert_true(parse(&f, "--kv-floor", "q8_0"));
    assert_float_equal(f.cfg.high_watermark, 0.7f, 1e-6f);
    assert_float_equal(f.cfg.low_watermark, 0.5f, 1e-6f);

    struct kv_config cfg;
    kv_config_default(&cfg);
    cfg.n_layer = 3, cfg.n_kv_head = 2, cfg.head_dim = 64, cfg.mem_budget = 12345;
    cli_kv_flags_apply(&f, &cfg);
    assert_int_equal(cfg.n_layer, 3);
    assert_int_equal(cfg.n_kv_head, 2);
    assert_int_equal(cfg.head_dim, 64);
    assert_int_equal(cfg.mem_budget, 12345);
    assert_int_equal(cfg.type_k, QUANT_Q8_0);
    assert_int_equal(cfg.page_tokens, 64);
    assert_false(cfg.rotate);
    assert_false(cfg.scale_search);
    assert_int_equal(cfg.smooth, KV_SMOOTH_KV);
    assert_int_equal(cfg.policy, KV_POLICY_DYNAMIC);
    assert_int_equal(cfg.floor, QUANT_Q8_0);
    assert_int_equal(cfg.n_ladder, 4);
    assert_int_equal(cfg.ladder[2], QUANT_Q5_0);
}

static void bad_values_are_refused(void **state)
{
    (void)state;
    struct cli_kv_flags f;
    cli_kv_flags_init(&f);
    assert_false(parse(&f, "--kv-page", "48"));  /* not a power of two */
    assert_false(parse(&f, "--kv-page", "8"));   /* below 16 */
    assert_false(parse(&f, "--kv-page", "512")); /* above 256 */
    assert_false(parse(&f, "-ctk", "q5_k"));  /* a weight type, not a KV type */
    assert_false(parse(&f, "--kv-ladder", "q4_0,q8_0")); /* not in falling precision */
    assert_false(parse(&f, "--kv-ladder", "q8_0,,q4_0"));
    assert_false(parse(&f, "--kv-rotate", "yes"));
    assert_false(parse(&f, "--kv-scale-search", "maybe"));
    assert_false(parse(&f, "--kv-smooth", "on"));
    assert_false(parse(&f, "--kv-policy", "auto"));
    assert_false(parse(&f, "--kv-high", "1.5"));
    assert_false(parse(&f, "--kv-mem", "0"));
    assert_false(parse(&f, "--kv-mem", NULL)); /* missing value */
    assert_false(parse(&f, "--kv-high", "0"));   /* a watermark is a ratio in (0, 1] */
    assert_false(parse(&f, "--kv-low", "-0.1"));
    assert_false(parse(&f, "--kv-low", "0.5x"));
    assert_false(parse(&f, "--kv-sink", "-1"));
    assert_false(parse(&f, "--kv-hot", "lots"));
    assert_false(parse(&f, "--kv-floor", "q4_k"));
    assert_false(parse(&f, "--kv-mem", "12Q"));
    bool ok = true;
    assert_false(cli_parse_kv_flag("--threads", "2", &f, &ok));
    assert_false(cli_parse_kv_flag("--kv-pages", "32", &f, &ok));
    assert_false(cli_parse_kv_flag("--mmap", NULL, &f, &ok)); /* not a KV flag: the command's */
}

static void older_spellings_still_work(void **state)
{
    (void)state;
    struct cli_kv_flags f;
    cli_kv_flags_init(&f);
    assert_true(parse(&f, "--kv-page-tokens", "128"));
    assert_int_equal(f.cfg.page_tokens, 128);
    assert_false(parse(&f, "--kv-page-tokens", "100"));
    assert_true(parse(&f, "--kv-sinks", "7"));
    assert_int_equal(f.cfg.sink_tokens, 7);
    assert_true(parse(&f, "--cache-type-k", "f32"));
    assert_true(parse(&f, "-ctv", "f32"));
    assert_int_equal(f.cfg.type_k, QUANT_F32);
    assert_int_equal(f.cfg.type_v, QUANT_F32);
}

static void low_above_high_is_a_conflict(void **state)
{
    (void)state;
    struct cli_kv_flags f;
    cli_kv_flags_init(&f);
    char buf[128];
    assert_null(cli_kv_flags_conflict(&f, buf, sizeof buf));
    assert_true(parse(&f, "--kv-low", "0.95")); /* above the default high of 0.90 */
    const char *msg = cli_kv_flags_conflict(&f, buf, sizeof buf);
    assert_non_null(msg);
    assert_non_null(strstr(msg, "--kv-low"));
    assert_true(parse(&f, "--kv-high", "0.95"));
    assert_null(cli_kv_flags_conflict(&f, buf, sizeof buf));
}

/* ---- cli_parse_command ------------------------------------------------------ */

struct fake_opts {
    int usages;
    bool verbose;
    int n;
};

static struct fake_opts *g_fake; /* usage() has no context argument */

static void fake_usage(FILE *out)
{
    (void)out;
    g_fake->usages++;
}

static bool fake_switch(const char *a, void *opts)
{
    struct fake_opts *o = opts;
    return !strcmp(a, "-v") && (o->verbose = true);
}

static bool fake_value(const char *a, const char *v, void *opts, bool *ok)
{
    struct fake_opts *o = opts;
    if (strcmp(a, "-n"))
        return false;
    *ok = cli_parse_int(v, 1, 10, &o->n);
    return true;
}

static int run(struct fake_opts *o, struct cli_model_flags *m, int argc, char **argv)
{
    *o = (struct fake_opts){0};
    g_fake = o;
    cli_model_flags_init(m);
    const struct cli_command cmd = {.name = "fake", .usage = fake_usage, .model = m,
                                    .switch_flag = fake_switch, .value_flag = fake_value, .opts = o};
    return cli_parse_command(&cmd, argc, argv);
}

static void a_command_line_takes_the_shared_flags(void **state)
{
    (void)state;
    struct fake_opts o;
    struct cli_model_flags m;
    char *ok_argv[] = {"fake", "--mmap", "-n", "3", "--kv-page", "64", "-v", "--kv-sinks", "8", "-ctk", "q8_0",
                       "--no-repack"};
    assert_int_equal(run(&o, &m, 12, ok_argv), 0);
    assert_true(m.mmap);
    assert_true(m.no_repack);
    assert_true(o.verbose);
    assert_int_equal(o.n, 3);
    assert_int_equal(m.kv.cfg.page_tokens, 64);
    assert_int_equal(m.kv.cfg.sink_tokens, 8);
    assert_int_equal(m.kv.cfg.type_k, QUANT_Q8_0);
    assert_int_equal(o.usages, 0);

    char *plain[] = {"fake"};
    assert_int_equal(run(&o, &m, 1, plain), 0);
    assert_false(m.mmap);
    assert_false(m.no_repack);
    assert_int_equal(m.kv.cfg.page_tokens, 32);

    char *help[] = {"fake", "--kv-page", "64", "--help"};
    assert_int_equal(run(&o, &m, 4, help), -1);
    assert_int_equal(o.usages, 1);
}

static void a_bad_command_line_is_a_usage_error(void **state)
{
    (void)state;
    struct fake_opts o;
    struct cli_model_flags m;
    char *bad_page[] = {"fake", "--kv-page", "48"};
    char *bad_type[] = {"fake", "-ctv", "q6_k"};
    char *bad_high[] = {"fake", "--kv-high", "1.2"};
    char *missing[] = {"fake", "--kv-mem"};
    char *unknown[] = {"fake", "--kv-pages", "32"};
    char *conflict[] = {"fake", "--kv-high", "0.5", "--kv-low", "0.6"};
    char *bad_own[] = {"fake", "-n", "11"};
    char **lines[] = {bad_page, bad_type, bad_high, missing, unknown, conflict, bad_own};
    int argcs[] = {3, 3, 3, 2, 3, 5, 3};
    for (size_t i = 0; i < sizeof argcs / sizeof argcs[0]; i++) {
        assert_int_equal(run(&o, &m, argcs[i], lines[i]), 2);
        assert_int_equal(o.usages, 1); /* the usage follows the message */
    }
    /* a command that loads no model takes neither --mmap nor the KV flags */
    char *mmap_argv[] = {"fake", "--mmap"};
    g_fake = &o;
    o.usages = 0;
    const struct cli_command no_model = {.name = "fake", .usage = fake_usage, .value_flag = fake_value, .opts = &o};
    assert_int_equal(cli_parse_command(&no_model, 2, mmap_argv), 2);
    char *kv_argv[] = {"fake", "--kv-page", "32"};
    assert_int_equal(cli_parse_command(&no_model, 3, kv_argv), 2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(every_flag_sets_its_field),
        cmocka_unit_test(bad_values_are_refused),
        cmocka_unit_test(older_spellings_still_work),
        cmocka_unit_test(low_above_high_is_a_conflict),
        cmocka_unit_test(a_command_line_takes_the_shared_flags),
        cmocka_unit_test(a_bad_command_line_is_a_usage_error),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
