/* GeGLU (quant_geglu): the SIMD path against its scalar twin bit for bit,
 * over every f16 input, the thresholds and random rows of odd lengths; the
 * GELU table against ggml's own (ggml_table_gelu_f16 of llama.cpp's CPU
 * backends in $KVSERVE_SHARED/anchor/bin, after ggml_cpu_init), bit for bit
 * over every f16 value; and quant_q8_0_dot_ggml, which Gemma's gate uses near
 * f16 rounding midpoints, against ggml_mul_mat run by those backends (one
 * token: vec_dot; eight: tinyBLAS), bit for bit, row-major and repacked. */
#include <dlfcn.h>
#include <stdbool.h>
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

/* ---- ggml's Q8_0 mul_mat through its C API (dlopen) ---------------------- */

/* ggml_init's parameter struct, passed by value: { size_t mem_size; void *mem_buffer; bool no_alloc; } */
struct ggml_init_params_abi {
    size_t mem_size;
    void *mem_buffer;
    bool no_alloc;
};

#define GGML_TYPE_F32_ID 0
#define GGML_TYPE_Q8_0_ID 8

/* out (rows x n_tok) = ggml_mul_mat(W q8_0 rows x cols, X f32 cols x n_tok) run by one CPU backend variant;
 * false when the libraries cannot be had */
static bool ggml_q8_0_matmul(const char *cpu_path, const void *W, int64_t rows, int64_t cols, const float *X,
                             int64_t n_tok, float *out)
{
    char base_path[1024];
    snprintf(base_path, sizeof base_path, "%s/anchor/bin/libggml-base.so.0", getenv("KVSERVE_SHARED"));
    void *base = dlopen(base_path, RTLD_NOW | RTLD_GLOBAL), *cpu = base ? dlopen(cpu_path, RTLD_NOW | RTLD_LOCAL) : NULL;
    if (!cpu)
        return false;
    void *(*init)(struct ggml_init_params_abi) = (void *(*)(struct ggml_init_params_abi))dlsym(base, "ggml_init");
    void *(*new2d)(void *, int, int64_t, int64_t) = (void *(*)(void *, int, int64_t, int64_t))dlsym(base, "ggml_new_tensor_2d");
    void *(*mul_mat)(void *, void *, void *) = (void *(*)(void *, void *, void *))dlsym(base, "ggml_mul_mat");
    void *(*new_graph)(void *) = (void *(*)(void *))dlsym(base, "ggml_new_graph");
    void (*expand)(void *, void *) = (void (*)(void *, void *))dlsym(base, "ggml_build_forward_expand");
    void *(*data)(void *) = (void *(*)(void *))dlsym(base, "ggml_get_data");
    void (*gfree)(void *) = (void (*)(void *))dlsym(base, "ggml_free");
    void (*cpu_init)(void) = (void (*)(void))dlsym(cpu, "ggml_cpu_init");
    int (*compute)(void *, void *, int) = (int (*)(void *, void *, int))dlsym(cpu, "ggml_graph_compute_with_ctx");
    assert_true(init && new2d && mul_mat && new_graph && expand && data && gfree && cpu_init && compute);
    cpu_init();
    void *ctx = init((struct ggml_init_params_abi){(size_t)64 << 20, NULL, false});
    void *tw = new2d(ctx, GGML_TYPE_Q8_0_ID, cols, rows), *tx = new2d(ctx, GGML_TYPE_F32_ID, cols, n_tok);
    memcpy(data(tw), W, quant_row_size(QUANT_Q8_0, cols) * (size_t)rows);
    memcpy(data(tx), X, sizeof(float) * (size_t)(cols * n_tok));
    void *ty = mul_mat(ctx, tw, tx), *g = new_graph(ctx);
    expand(g, ty);
    assert_int_equal(compute(ctx, g, 2), 0);
    memcpy(out, data(ty), sizeof(float) * (size_t)(rows * n_tok));
    gfree(ctx);
    dlclose(cpu);
    return true;
}

static void test_q8_0_dot_matches_ggml(void **state)
{
    (void)state;
    const int64_t rows = 40, cols = 1152, n_tok = 8; /* 40: two repacked groups and a tail */
    size_t wbytes = quant_row_size(QUANT_Q8_0, cols) * rows;
    float *w = malloc(sizeof(float) * rows * cols), *x = malloc(sizeof(float) * cols * n_tok);
    uint8_t *W = malloc(wbytes), *Wr = malloc(wbytes), *xq = malloc(quant_row_size(QUANT_Q8_0, cols));
    float *ref = malloc(sizeof(float) * rows * n_tok), got;
    uint64_t s = 7;
    for (int64_t i = 0; i < rows * cols; i++)
        w[i] = rng_uniform(&s, -0.1f, 0.1f);
    for (int64_t i = 0; i < cols * n_tok; i++)
        x[i] = rng_uniform(&s, -3.0f, 3.0f) * (i % 97 == 0 ? 20.0f : 1.0f);
    quant_traits(QUANT_Q8_0)->from_float(w, W, rows * cols);
    memcpy(Wr, W, wbytes);
    bool repacked = quant_repack_fits(QUANT_Q8_0, rows, cols) && quant_repack(QUANT_Q8_0, rows, cols, Wr) == KS_OK;
    static const char *const variants[] = {"haswell", "icelake", "zen4"};
    int checked = 0;
    for (size_t v = 0; v < sizeof variants / sizeof variants[0] && getenv("KVSERVE_SHARED"); v++)
        for (int64_t nt = 1; nt <= n_tok; nt += n_tok - 1) {
            char path[1024];
            snprintf(path, sizeof path, "%s/anchor/bin/libggml-cpu-%s.so", getenv("KVSERVE_SHARED"), variants[v]);
            if (!ggml_q8_0_matmul(path, W, rows, cols, x, nt, ref))
                continue;
            int bad = 0;
            for (int64_t t = 0; t < nt; t++) {
                quant_q8_0_quantize_ggml(x + t * cols, xq, cols);
                for (int64_t r = 0; r < rows; r++) {
                    assert_int_equal(quant_q8_0_dot_ggml(W, false, rows, cols, r, xq, &got), KS_OK);
                    bad += bits(got) != bits(ref[t * rows + r]);
                    if (repacked) {
                        assert_int_equal(quant_q8_0_dot_ggml(Wr, true, rows, cols, r, xq, &got), KS_OK);
                        bad += bits(got) != bits(ref[t * rows + r]);
                    }
                }
            }
            print_message("ggml %s, %lld token(s): %d of %lld Q8_0 outputs differ\n", variants[v], (long long)nt, bad,
                          (long long)(rows * nt));
            assert_int_equal(bad, 0);
            checked++;
        }
    assert_int_equal(quant_q8_0_dot_ggml(W, false, rows, cols, rows, xq, &got), KS_ERR_INVALID_ARG);
    free(w), free(x), free(W), free(Wr), free(xq), free(ref);
    if (!checked)
        KS_SKIP("no libggml-cpu-*.so under $KVSERVE_SHARED/anchor/bin");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_simd_matches_scalar_every_f16),
        cmocka_unit_test(test_simd_matches_scalar_edges_and_tails),
        cmocka_unit_test(test_table_is_gelu),
        cmocka_unit_test(test_table_matches_ggml),
        cmocka_unit_test(test_q8_0_dot_matches_ggml),
    };
    return ks_run_tests(tests, NULL, NULL);
}
