/* model_argsort_desc: the order ggml's CPU argsort (libstdc++'s std::sort with
 * v[a] > v[b]) gives a row of router probabilities, ties included. The
 * expected orders of tied rows were printed by std::sort itself (g++ 12,
 * libstdc++), and model_argsort.c agreed with it on 200000 random rows with
 * ties and on median-of-three killer sequences that reach its heapsort;
 * test_model_moe checks the same order against llama.cpp end to end. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "model/model_internal.h"

static void expect_order(const float *v, int n, const int32_t *want, int n_want)
{
    int32_t got[512];
    model_argsort_desc(v, n, got);
    for (int i = 0; i < n_want; i++)
        if (got[i] != want[i])
            fail_msg("n %d: position %d holds %d, std::sort puts %d there", n, i, got[i], want[i]);
}

/* Up to 16 elements std::sort is an insertion sort: stable. */
static void test_short_rows_are_stable(void **state)
{
    (void)state;
    float v[16] = {0.1f, 0.3f, 0.3f, 0.2f, 0.3f, 0.1f, 0.0f, 0.2f, 0.3f, 0.0f, 0.1f, 0.2f, 0.3f, 0.3f, 0.0f, 0.1f};
    const int32_t want[16] = {1, 2, 4, 8, 12, 13, 3, 7, 11, 0, 5, 10, 15, 6, 9, 14};
    expect_order(v, 16, want, 16);
    float eight[8] = {0};
    const int32_t id8[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    expect_order(eight, 8, id8, 8);
}

/* Beyond 16 the introsort's partitions reorder equal values. */
static void test_long_rows_follow_introsort(void **state)
{
    (void)state;
    float zeros[128] = {0};
    const int32_t want32[32] = {16, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17,
                                0,  15, 14, 13, 12, 11, 10, 9,  8,  7,  6,  5,  4,  3,  2,  1};
    expect_order(zeros, 32, want32, 32);
    /* 128 equal experts: llama.cpp's first 8 are 80, 95, 94, ... */
    const int32_t want128[16] = {80, 95, 94, 93, 92, 91, 90, 89, 88, 87, 86, 85, 84, 83, 82, 81};
    expect_order(zeros, 128, want128, 16);
    /* period 4, as tiny-qwen3moe-ties' router: 8-way ties at the top */
    float periodic[32];
    for (int i = 0; i < 32; i++)
        periodic[i] = i % 4 == 1 ? 1.0f : 0.0f;
    const int32_t wantp[32] = {1,  17, 21, 13, 25, 9,  5,  29, 28, 27, 26, 24, 23, 30, 22, 0,
                               20, 31, 19, 18, 16, 15, 14, 12, 11, 10, 8,  7,  6,  4,  3,  2};
    expect_order(periodic, 32, wantp, 32);
}

/* Without ties the result is the descending order, whatever the length. */
static void test_distinct_values_descend(void **state)
{
    (void)state;
    float v[512];
    int32_t idx[512];
    for (int n = 1; n <= 512; n = n * 2 + 1) {
        for (int i = 0; i < n; i++)
            v[i] = (float)((i * 7919) % 1021); /* distinct: 1021 is prime, n < 1021 */
        model_argsort_desc(v, n, idx);
        bool seen[512] = {false};
        for (int i = 0; i < n; i++) {
            assert_true(idx[i] >= 0 && idx[i] < n && !seen[idx[i]]);
            seen[idx[i]] = true;
            if (i > 0)
                assert_true(v[idx[i - 1]] > v[idx[i]]);
        }
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_short_rows_are_stable),
        cmocka_unit_test(test_long_rows_follow_introsort),
        cmocka_unit_test(test_distinct_values_descend),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
