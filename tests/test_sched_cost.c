/* The step-cost model behind --max-itl-ratio, driven by synthetic step
 * times: a "machine" whose step takes decode(n) + k * c seconds for n
 * decoders and k prefill tokens. The limit must converge to what keeps a
 * step within ratio x decode(n), never go below one token, and recover from
 * a stalled step. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "sched/sched_cost.h"

struct machine {
    double decode_base, decode_per_seq; /* decode(n) = base + per_seq * n */
    double prefill_token;               /* c */
};

static double step_time(const struct machine *m, int32_t n_decode, int32_t n_prefill)
{
    return m->decode_base + m->decode_per_seq * n_decode + m->prefill_token * n_prefill;
}

/* Run `steps` steps of n decoders with the model's own prefill limit (capped
 * by chunk); returns the last nonzero limit. Records the worst step / decode
 * ratio and the decode-only (refresh) steps. */
static int refreshes;
static int32_t run(struct sched_cost *c, const struct machine *m, int32_t n, int steps, double ratio, int32_t chunk,
                   double *worst)
{
    int32_t lim = 0;
    for (int i = 0; i < steps; i++) {
        int32_t l = sched_cost_prefill_limit(c, n, ratio);
        refreshes += l == 0;
        lim = l ? l : lim;
        int32_t k = l < chunk ? l : chunk;
        double t = step_time(m, n, k);
        double r = t / step_time(m, n, 0);
        if (worst && r > *worst)
            *worst = r;
        sched_cost_observe(c, n, k, t);
    }
    return lim;
}

static void test_unknown_then_probe_then_converge(void **state)
{
    (void)state;
    struct sched_cost c;
    sched_cost_init(&c);
    const struct machine m = {.decode_base = 0.010, .decode_per_seq = 0.001, .prefill_token = 0.0005};
    /* nothing known: no decoders means no limit; decoders with no decode-only
     * measurement get none (one decode-only step measures it) */
    assert_int_equal(sched_cost_prefill_limit(&c, 0, 2.0), INT32_MAX);
    assert_int_equal(sched_cost_prefill_limit(&c, 8, 2.0), 0);
    assert_true(sched_cost_decode(&c, 8) == 0);
    sched_cost_observe(&c, 8, 0, step_time(&m, 8, 0));
    assert_true(fabs(sched_cost_decode(&c, 8) - 0.018) < 1e-12);
    /* prefill cost unknown: a probe of n_decode tokens */
    assert_int_equal(sched_cost_prefill_limit(&c, 8, 2.0), 8);
    double worst = 0;
    int32_t lim = run(&c, &m, 8, 50, 2.0, 100000, &worst);
    /* (2 - 1) * 18 ms / 0.5 ms = 36 tokens */
    assert_int_equal(lim, 36);
    assert_true(worst <= 2.0 + 1e-9);
    /* ratio 1.5: half of that */
    assert_int_equal(run(&c, &m, 8, 5, 1.5, 100000, NULL), 18);
    /* off */
    assert_int_equal(sched_cost_prefill_limit(&c, 8, 0.0), INT32_MAX);
}

static void test_expensive_prefill_floors_at_one_token(void **state)
{
    (void)state;
    struct sched_cost c;
    sched_cost_init(&c);
    /* one prefill token costs 3 decode steps (e.g. attention deep into a long prompt) */
    const struct machine m = {.decode_base = 0.004, .decode_per_seq = 0.0005, .prefill_token = 0.024};
    sched_cost_observe(&c, 8, 0, step_time(&m, 8, 0));
    int32_t lim = run(&c, &m, 8, 30, 2.0, 256, NULL);
    assert_int_equal(lim, 1); /* still progresses every step */
    assert_int_equal(sched_cost_prefill_limit(&c, 8, 1.0), 1);
}

static void test_decoder_count_and_nearest(void **state)
{
    (void)state;
    struct sched_cost c;
    sched_cost_init(&c);
    const struct machine m = {.decode_base = 0.010, .decode_per_seq = 0.002, .prefill_token = 0.001};
    sched_cost_observe(&c, 2, 0, step_time(&m, 2, 0));
    sched_cost_observe(&c, 10, 0, step_time(&m, 10, 0));
    assert_true(fabs(sched_cost_decode(&c, 2) - 0.014) < 1e-12);
    assert_true(fabs(sched_cost_decode(&c, 10) - 0.030) < 1e-12);
    assert_true(fabs(sched_cost_decode(&c, 3) - 0.014) < 1e-12);  /* nearest seen: 2 */
    assert_true(fabs(sched_cost_decode(&c, 9) - 0.030) < 1e-12);  /* nearest seen: 10 */
    assert_true(sched_cost_decode(&c, 500) > 0);                   /* beyond the slots */
    /* the limit scales with the decode step of that many decoders */
    run(&c, &m, 10, 40, 2.0, 100000, NULL);
    assert_int_equal(sched_cost_prefill_limit(&c, 10, 2.0), 30);
    assert_int_equal(sched_cost_prefill_limit(&c, 2, 2.0), 0); /* its estimate is 40 steps old */
    sched_cost_observe(&c, 2, 0, step_time(&m, 2, 0));
    assert_int_equal(sched_cost_prefill_limit(&c, 2, 2.0), 14);
}

static void test_recovers_from_a_stalled_step(void **state)
{
    (void)state;
    struct sched_cost c;
    sched_cost_init(&c);
    const struct machine m = {.decode_base = 0.010, .decode_per_seq = 0.0, .prefill_token = 0.0005};
    sched_cost_observe(&c, 4, 0, step_time(&m, 4, 0));
    assert_int_equal(run(&c, &m, 4, 60, 2.0, 100000, NULL), 20);
    /* another process steals the CPU for one step: 1 s instead of 20 ms */
    sched_cost_observe(&c, 4, 20, 1.0);
    int32_t after = sched_cost_prefill_limit(&c, 4, 2.0);
    assert_true(after >= 1 && after < 20);
    /* the jump is bounded, so normal steps bring it back quickly */
    assert_true(after >= 20 / 4);
    int32_t back = run(&c, &m, 4, 40, 2.0, 100000, NULL);
    assert_true(back == 19 || back == 20); /* the EMA approaches 0.5 ms from above */
    /* steps faster than the decode estimate (timer noise) are ignored */
    sched_cost_observe(&c, 4, 0, step_time(&m, 4, 0)); /* fresh decode estimate */
    sched_cost_observe(&c, 4, 5, 0.005);
    assert_int_equal(sched_cost_prefill_limit(&c, 4, 2.0), back);
}

/* While every step is mixed, decode(n) cannot be measured; the streams'
 * contexts grow and so does decode(n). Every SCHED_COST_REFRESH steps a
 * decode-only step re-measures it, so the growth is not charged to prefill. */
static void test_decode_estimate_is_refreshed(void **state)
{
    (void)state;
    struct sched_cost c;
    sched_cost_init(&c);
    struct machine m = {.decode_base = 0.010, .decode_per_seq = 0.001, .prefill_token = 0.0005};
    sched_cost_observe(&c, 8, 0, step_time(&m, 8, 0));
    refreshes = 0;
    int zero_steps = 0;
    for (int i = 0; i < 400; i++) {
        m.decode_base = 0.010 + 0.0001 * i; /* decoders' attention grows */
        int32_t l = sched_cost_prefill_limit(&c, 8, 2.0);
        zero_steps += l == 0;
        sched_cost_observe(&c, 8, l, step_time(&m, 8, l));
    }
    assert_true(zero_steps >= 400 / SCHED_COST_REFRESH - 1 && zero_steps <= 400 / SCHED_COST_REFRESH + 1);
    /* decode(8) = 0.010 + 0.0399 + 0.008 = 57.9 ms now; prefill stays 0.5 ms/token */
    assert_true(fabs(sched_cost_decode(&c, 8) - 0.0579) < 0.004);
    assert_true(fabs(c.prefill_token_s - 0.0005) < 0.0001);
}

/* Speculation prices a verification of k drafts at decode(n) * (1 + k * r):
 * r is the marginal token over the decode-only step, learned from mixed
 * steps (drafts are fed to the model as extra tokens), 0 before. */
static void test_token_ratio_prices_a_verification(void **state)
{
    (void)state;
    struct machine m = {.decode_base = 20e-3, .decode_per_seq = 0.5e-3, .prefill_token = 0.6e-3};
    struct sched_cost c;
    sched_cost_init(&c);
    assert_true(sched_cost_token_ratio(&c, 4) == 0.0);
    sched_cost_observe(&c, 4, 0, step_time(&m, 4, 0));
    assert_true(sched_cost_token_ratio(&c, 4) == 0.0); /* no marginal token seen yet */
    for (int i = 0; i < 50; i++) {
        sched_cost_observe(&c, 4, 0, step_time(&m, 4, 0));
        sched_cost_observe(&c, 4, 8, step_time(&m, 4, 8)); /* e.g. two requests verifying 4 drafts each */
    }
    double want = m.prefill_token / step_time(&m, 4, 0);
    assert_true(fabs(sched_cost_token_ratio(&c, 4) - want) < 1e-3 * want);
    /* k = 8 drafts cost 1 + 8r steps: here 1.22, the goal is <= 1.5 */
    assert_true(1 + 8 * sched_cost_token_ratio(&c, 4) < 1.25);
}

/* A draft model's step is priced against the target's decode-only step:
 * 0 until both are measured, then their ratio, which follows the draft
 * step's EMA and shrugs off one stalled step like the others. */
static void test_draft_ratio(void **state)
{
    (void)state;
    struct machine m = {.decode_base = 20e-3, .decode_per_seq = 0.5e-3, .prefill_token = 0.6e-3};
    struct sched_cost c;
    sched_cost_init(&c);
    sched_cost_observe_draft(&c, 4e-3);
    assert_true(sched_cost_draft_ratio(&c, 4) == 0.0); /* no decode step yet */
    sched_cost_observe(&c, 4, 0, step_time(&m, 4, 0));
    for (int i = 0; i < 50; i++)
        sched_cost_observe_draft(&c, 4e-3);
    double want = 4e-3 / step_time(&m, 4, 0);
    assert_true(fabs(sched_cost_draft_ratio(&c, 4) - want) < 1e-6);
    sched_cost_observe_draft(&c, 1.0); /* a stall pulls at most MAX_JUMP x, weighted ALPHA */
    assert_true(sched_cost_draft_ratio(&c, 4) < 2 * want);
    sched_cost_observe_draft(&c, 0.0); /* nothing measured: ignored */
    assert_true(sched_cost_draft_ratio(&c, 4) > want);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_unknown_then_probe_then_converge),
        cmocka_unit_test(test_expensive_prefill_floors_at_one_token),
        cmocka_unit_test(test_decoder_count_and_nearest),
        cmocka_unit_test(test_recovers_from_a_stalled_step),
        cmocka_unit_test(test_decode_estimate_is_refreshed),
        cmocka_unit_test(test_token_ratio_prices_a_verification),
        cmocka_unit_test(test_draft_ratio),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
