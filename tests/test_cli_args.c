/* The KV-cache flags shared by serve's siblings (bench, generate, chat):
 * every flag lands in the right kv_config field, bad values are refused,
 * unknown flags are left to the command, and apply() copies the choices
 * but never the model's shape or the budget. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
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
    assert_true(parse(&f, "--kv-sink", "4"));
    assert_true(parse(&f, "--kv-hot", "128"));
    assert_true(parse(&f, "--kv-floor", "q8_0"));
    assert_true(parse(&f, "--kv-high", "0.7"));
    assert_true(parse(&f, "--kv-low", "0.5"));
    assert_int_equal(f.cfg.sink_tokens, 4);
    assert_int_equal(f.cfg.hot_tokens, 128);
    assert_int_equal(f.cfg.floor, QUANT_Q8_0);
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
    assert_int_equal(cfg.policy, KV_POLICY_DYNAMIC);
    assert_int_equal(cfg.floor, QUANT_Q8_0);
}

static void bad_values_are_refused(void **state)
{
    (void)state;
    struct cli_kv_flags f;
    cli_kv_flags_init(&f);
    assert_false(parse(&f, "--kv-page", "48"));  /* not a power of two */
    assert_false(parse(&f, "--kv-page", "8"));   /* below 16 */
    assert_false(parse(&f, "--kv-page", "512")); /* above 256 */
    assert_false(parse(&f, "-ctk", "q5_0"));
    assert_false(parse(&f, "--kv-rotate", "yes"));
    assert_false(parse(&f, "--kv-policy", "auto"));
    assert_false(parse(&f, "--kv-high", "1.5"));
    assert_false(parse(&f, "--kv-mem", "0"));
    assert_false(parse(&f, "--kv-mem", NULL)); /* missing value */
    bool ok = true;
    assert_false(cli_parse_kv_flag("--threads", "2", &f, &ok));
    assert_false(cli_parse_kv_flag("--kv-pages", "32", &f, &ok));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(every_flag_sets_its_field),
        cmocka_unit_test(bad_values_are_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
