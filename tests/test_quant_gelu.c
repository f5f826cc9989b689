/* GeGLU (quant_geglu): the SIMD path against its scalar twin bit for bit,
 * over every f16 input, the thresholds and random rows of odd lengths; and
 * the GELU table against ggml's own (ggml_table_gelu_f16 of llama.cpp's CPU
 * backends in $KVSERVE_SHARED/anchor/bin, after ggml_cpu_init), bit for bit
 * over every f16 value. */
#include <dlfcn.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "quant/quant.h"
#include "support/skip.h"

static uint32_t bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s << 13, *s ^= *s >> 7, *s ^= *s << 17;
    return *s;
}

static float rng_uniform(uint64_t *s, float lo, float hi)
{
    return lo + (hi - lo) * (float)((rng_next(s) >> 40) * 0x1p-24);
}

/* SIMD and scalar on the same input; returns the number of differing values. */
static int64_t compare_paths(const float *x, const float *up, int64_t n)
{
    float *a = malloc(sizeof(float) * (size_t)n), *b = malloc(sizeof(float) * (size_t)n);
    assert_non_null(a);
    assert_non_null(b);
    memcpy(a, x, sizeof(float) * (size_t)n);
    memcpy(b, x, sizeof(float) * (size_t)n);
    quant_geglu(a, up, n);
    quant_geglu_scalar(b, up, n);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++)
        if (bits(a[i]) != bits(b[i]) && !(isnan(a[i]) && isnan(b[i]))) {
            if (bad < 5)
                print_message("  x=%a up=%a: simd %a scalar %a\n", (double)x[i], (double)up[i], (double)a[i],
                              (double)b[i]);
            bad++;
        }
    free(a), free(b);
    return bad;
}

static void test_simd_matches_scalar_every_f16(void **state)
{
    (void)state;
    int64_t n = 1 << 16;
    float *x = malloc(sizeof(float) * (size_t)n), *up = malloc(sizeof(float) * (size_t)n);
    uint64_t s = 0x9e3779b97f4a7c15ull;
    for (int64_t i = 0; i < n; i++) {
        x[i] = quant_f16_to_f32((quant_f16)i);
        up[i] = rng_uniform(&s, -3.0f, 3.0f);
    }
    assert_int_equal(compare_paths(x, up, n), 0);
    free(x), free(up);
}

static void test_simd_matches_scalar_edges_and_tails(void **state)
{
    (void)state;
    const float edges[] = {-10.0f, 10.0f, nextafterf(-10.0f, 0.0f), nextafterf(10.0f, 0.0f),
                           nextafterf(-10.0f, -20.0f), nextafterf(10.0f, 20.0f), -0.0f, 0.0f, INFINITY, -INFINITY,
                           65504.0f, 65520.0f, -65520.0f, 1e-8f, -1e-8f, 3.0e-5f, 9.9990234f, -9.9990234f};
    uint64_t s = 42;
    for (int64_t n = 1; n <= 67; n++) {
        float x[67], up[67];
        for (int64_t i = 0; i < n; i++) {
            x[i] = (rng_next(&s) & 3) == 0 ? edges[rng_next(&s) % (sizeof edges / sizeof edges[0])]
                                           : rng_uniform(&s, -12.0f, 12.0f);
            up[i] = rng_uniform(&s, -2.0f, 2.0f);
        }
        assert_int_equal(compare_paths(x, up, n), 0);
    }
    /* the thresholds as ggml takes them */
    float x[4] = {-10.0f, 10.0f, -11.0f, 12.5f}, up[4] = {2.0f, 2.0f, 2.0f, 2.0f};
    quant_geglu_scalar(x, up, 4);
    assert_true(x[0] == 0.0f && !signbit(x[0]) && x[1] == 20.0f && x[2] == 0.0f && x[3] == 25.0f);
}

/* quant_gelu (BERT's FFN) is quant_geglu with an up of 1, bit for bit: every
 * f16 value, the thresholds and values between f16s */
static void test_gelu_is_geglu_times_one(void **state)
{
    (void)state;
    int64_t n = (1 << 16) + 64;
    float *x = malloc(sizeof(float) * (size_t)n), *g = malloc(sizeof(float) * (size_t)n);
    float *one = malloc(sizeof(float) * (size_t)n);
    assert_true(x && g && one);
    uint64_t s = 7;
    for (int64_t i = 0; i < n; i++) {
        x[i] = i < (1 << 16) ? quant_f16_to_f32((quant_f16)i) : rng_uniform(&s, -12.0f, 12.0f);
        one[i] = 1.0f;
    }
    x[n - 1] = -10.0f, x[n - 2] = 10.0f;
    memcpy(g, x, sizeof(float) * (size_t)n);
    quant_gelu(x, n);
    quant_geglu_scalar(g, one, n);
    for (int64_t i = 0; i < n; i++)
        if (!(bits(x[i]) == bits(g[i]) || (isnan(x[i]) && isnan(g[i]))))
            fail_msg("quant_gelu differs from quant_geglu(x, 1) at %lld: %a vs %a", (long long)i, x[i], g[i]);
    free(x), free(g), free(one);
}

/* the table is GELU-tanh to f16 precision (ggml's float 1 + tanh cancels where gelu is tiny) */
static void test_table_is_gelu(void **state)
{
    (void)state;
    for (int i = 0; i < (1 << 16); i++) {
        float x = quant_f16_to_f32((quant_f16)i);
        if (!isfinite(x) || fabsf(x) >= 10.0f)
            continue;
        double exact = 0.5 * x * (1.0 + tanh(0.7978845608028654 * x * (1.0 + 0.044715 * (double)x * x)));
        double got = quant_f16_to_f32(quant_gelu_table_entry((quant_f16)i));
        assert_true(fabs(got - exact) <= 1e-3 * fabs(exact) + 2e-6);
    }
}

/* ggml's table, from each CPU backend variant the anchor build ships */
static void test_table_matches_ggml(void **state)
{
    (void)state;
    const char *shared = getenv("KVSERVE_SHARED");
    static const char *const variants[] = {"haswell", "icelake", "zen4"};
    int checked = 0;
    for (size_t v = 0; v < sizeof variants / sizeof variants[0]; v++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/anchor/bin/libggml-cpu-%s.so", shared ? shared : "", variants[v]);
        void *lib = shared ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : NULL;
        if (!lib)
            continue;
        void (*cpu_init)(void) = (void (*)(void))dlsym(lib, "ggml_cpu_init");
        const uint16_t *table = dlsym(lib, "ggml_table_gelu_f16");
        assert_non_null(cpu_init);
        assert_non_null(table);
        cpu_init();
        int bad = 0;
        for (int i = 0; i < (1 << 16); i++) {
            float x = quant_f16_to_f32((quant_f16)i);
            if (!isnan(x) && quant_gelu_table_entry((quant_f16)i) != table[i] && bad++ < 5)
                print_message("  %s: h=0x%04x (x=%g): ours 0x%04x, ggml 0x%04x\n", variants[v], i, (double)x,
                              quant_gelu_table_entry((quant_f16)i), table[i]);
        }
        print_message("ggml %s: %d of 65536 GELU table entries differ\n", variants[v], bad);
        assert_int_equal(bad, 0);
        checked++;
        dlclose(lib);
    }
    if (!checked)
        KS_SKIP("no libggml-cpu-*.so under $KVSERVE_SHARED/anchor/bin");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_simd_matches_scalar_every_f16),
        cmocka_unit_test(test_simd_matches_scalar_edges_and_tails),
        cmocka_unit_test(test_table_is_gelu),
        cmocka_unit_test(test_gelu_is_geglu_times_one),
        cmocka_unit_test(test_table_matches_ggml),
    };
    return ks_run_tests(tests, NULL, NULL);
}
