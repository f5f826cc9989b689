/* The k-quants against ggml's own compiled code, loaded from the llama.cpp
 * build in $KVSERVE_SHARED/anchor/bin (skipped, exit 77, without it):
 *   - libggml-base: quantize_row_q*_K_ref (what llama-quantize runs without
 *     an importance matrix) and dequantize_row_q*_K (get_rows of a k-quant
 *     token_embd) give the bytes and floats kvserve's quantizers and
 *     dequantizers give, bit for bit;
 *   - the CPU backend llama.cpp loads on this machine (zen4 / icelake /
 *     haswell, the one ggml_backend_load_all picks): its Q8_K activation
 *     quantizer gives kvserve's Q8_K rows bit for bit (scalar, AVX2 and
 *     AVX-512), rounding ties included, so an activation row is the same
 *     Q8_K row in both engines whenever its floats are the same;
 *   - its ggml_vec_swiglu_f32 (the CPU backend of this build's ISA: haswell
 *     for AVX2, this CPU's AVX-512 one for AVX-512) gives quant_swiglu's
 *     bits: the down projection quantizes that output;
 *   - its vec_dot against kvserve's on the same rows: Q3_K, Q5_K and Q6_K
 *     bit for bit (kvserve's scalar reference and best kernel follow ggml's
 *     x86 eight-lane order, see kq_scalar.c); Q2_K and Q4_K within a
 *     float-order bound: llama.cpp runs those matrices through repacked
 *     8-row gemv/gemm kernels with orders of their own, and kvserve adds one
 *     float term per super-block. The test prints how many rows are bit-equal.
 * These pin down the facts behind test_model_kquants_llamacpp (README,
 * "Correctness against llama.cpp"). */
#include <dlfcn.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "quant/kq_internal.h"
#include "support/rng.h"
#include "support/skip.h"

typedef void (*ggml_from_float_fn)(const float *x, void *y, int64_t k);
typedef void (*ggml_to_float_fn)(const void *x, float *y, int64_t k);
typedef void (*ggml_vec_dot_fn)(int n, float *s, size_t bs, const void *x, size_t bx, const void *y, size_t by,
                                int nrc);
/* ggml-cpu.h's struct ggml_type_traits_cpu */
struct ggml_cpu_traits {
    ggml_from_float_fn from_float;
    ggml_vec_dot_fn vec_dot;
    int vec_dot_type;
    int64_t nrows;
};

static void *g_base, *g_cpu;
static const char *g_cpu_name;
static const struct ggml_cpu_traits *(*g_cpu_traits)(int type);

#define N_ROWS 64
#define ROW_ELEMS (4 * QK_K)

struct ktype {
    enum quant_type t;
    const char *name; /* ggml's symbol suffix */
};
static const struct ktype ktypes[] = {
    {QUANT_Q2_K, "q2_K"}, {QUANT_Q3_K, "q3_K"}, {QUANT_Q4_K, "q4_K"}, {QUANT_Q5_K, "q5_K"}, {QUANT_Q6_K, "q6_K"},
};
#define N_KTYPES (int)(sizeof ktypes / sizeof ktypes[0])

static uint64_t rng_state = 0x2545F4914F6CDD1Dull;

/* Row r of a test set: Gaussian rows at several scales, rows with outliers,
 * and rows built to hit Q8_K's rounding ties: max -127 makes iscale exactly 1,
 * so k + 0.5 values are ties, plus a +127 of the same magnitude (ggml keeps
 * the first) and an all-zero block. */
static void make_row(int r, float *x)
{
    float scale = powf(10.0f, (float)(r % 7) - 3.0f);
    for (int i = 0; i < ROW_ELEMS; i++)
        x[i] = scale * ks_rng_normal(&rng_state);
    if (r % 4 == 1)
        x[ks_rng_next(&rng_state) % ROW_ELEMS] = 40.0f * scale;
    if (r % 4 == 2) {
        for (int i = 0; i < ROW_ELEMS; i++)
            x[i] = (float)((int)(ks_rng_next(&rng_state) % 253) - 126) + 0.5f;
        for (int b = 0; b < ROW_ELEMS / QK_K; b++)
            x[b * QK_K + 7] = -127.0f, x[b * QK_K + 100] = 127.0f;
    }
    if (r % 8 == 3)
        memset(x + QK_K, 0, sizeof(float) * QK_K);
}

/* The CPU variant ggml_backend_load_all would load here: the best one this CPU runs. */
static const char *cpu_variant(void)
{
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni"))
        return "zen4";
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw"))
        return "icelake";
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return "haswell";
    return NULL;
}

static void *sym(void *lib, const char *name)
{
    void *p = dlsym(lib, name);
    if (!p)
        fail_msg("%s not found in the anchor's libraries", name);
    return p;
}

/* ---- quantize / dequantize: libggml-base ---------------------------------- */

static void test_quantize_matches_ggml(void **state)
{
    (void)state;
    float *x = malloc(sizeof(float) * ROW_ELEMS);
    uint8_t a[ROW_ELEMS * 2], b[ROW_ELEMS * 2];
    for (int k = 0; k < N_KTYPES; k++) {
        char name[64];
        snprintf(name, sizeof name, "quantize_row_%s_ref", ktypes[k].name);
        ggml_from_float_fn ref = (ggml_from_float_fn)sym(g_base, name);
        const struct quant_traits *tr = quant_traits_scalar(ktypes[k].t);
        size_t bytes = quant_row_size(ktypes[k].t, ROW_ELEMS);
        for (int r = 0; r < N_ROWS; r++) {
            make_row(r, x);
            tr->from_float(x, a, ROW_ELEMS);
            ref(x, b, ROW_ELEMS);
            if (memcmp(a, b, bytes))
                fail_msg("%s row %d: kvserve's quantizer and ggml's %s differ", ktypes[k].name, r, name);
        }
    }
    free(x);
}

static void test_dequantize_matches_ggml(void **state)
{
    (void)state;
    float *x = malloc(sizeof(float) * ROW_ELEMS), *ya = malloc(sizeof(float) * ROW_ELEMS),
          *yb = malloc(sizeof(float) * ROW_ELEMS);
    uint8_t q[ROW_ELEMS * 2];
    for (int k = 0; k < N_KTYPES; k++) {
        char name[64];
        snprintf(name, sizeof name, "dequantize_row_%s", ktypes[k].name);
        ggml_to_float_fn ref = (ggml_to_float_fn)sym(g_base, name);
        const struct quant_traits *tr = quant_traits(ktypes[k].t);
        for (int r = 0; r < N_ROWS; r++) {
            make_row(r, x);
            quant_traits_scalar(ktypes[k].t)->from_float(x, q, ROW_ELEMS);
            tr->to_float(q, ya, ROW_ELEMS);
            ref(q, yb, ROW_ELEMS);
            if (memcmp(ya, yb, sizeof(float) * ROW_ELEMS))
                fail_msg("%s row %d: kvserve's to_float and ggml's %s differ", ktypes[k].name, r, name);
        }
    }
    free(x), free(ya), free(yb);
}

/* ---- activations and dots: the CPU backend ------------------------------- */

/* Q8_K rows equal as ggml defines them: d, qs and bsums; a block of zeros
 * (d = 0) leaves ggml's bsums unwritten, and its min terms are d * ... = 0. */
static bool q8_K_equal(const block_q8_K *a, const block_q8_K *b, int nb)
{
    for (int i = 0; i < nb; i++) {
        if (memcmp(&a[i].d, &b[i].d, sizeof a[i].d) || memcmp(a[i].qs, b[i].qs, sizeof a[i].qs))
            return false;
        if (a[i].d != 0 && memcmp(a[i].bsums, b[i].bsums, sizeof a[i].bsums))
            return false;
    }
    return true;
}

static void check_q8_K(const char *what, quant_from_float_fn ours, ggml_from_float_fn theirs)
{
    float *x = malloc(sizeof(float) * ROW_ELEMS);
    size_t bytes = quant_row_size(QUANT_Q8_K, ROW_ELEMS);
    uint8_t *a = malloc(bytes), *b = malloc(bytes);
    for (int r = 0; r < 4 * N_ROWS; r++) {
        make_row(r, x);
        ours(x, a, ROW_ELEMS);
        memset(b, 0x5a, bytes);
        theirs(x, b, ROW_ELEMS);
        if (!q8_K_equal((const block_q8_K *)a, (const block_q8_K *)b, ROW_ELEMS / QK_K))
            fail_msg("q8_K %s row %d: kvserve's activation row differs from ggml-cpu-%s's", what, r, g_cpu_name);
    }
    free(x), free(a), free(b);
}

static void test_q8_K_matches_ggml_cpu(void **state)
{
    (void)state;
    if (!g_cpu)
        KS_SKIP("no CPU backend of the anchor for this CPU");
    ggml_from_float_fn theirs = g_cpu_traits(QUANT_Q8_K)->from_float;
    check_q8_K("scalar", quant_quantize_row_q8_K, theirs);
    check_q8_K("best", quant_traits(QUANT_Q8_K)->from_float, theirs);
#if defined(KQ_HAVE_AVX2)
    check_q8_K("avx2", quant_quantize_row_q8_K_avx2, theirs);
#endif
#if defined(KQ_HAVE_AVX512)
    check_q8_K("avx512", quant_quantize_row_q8_K_avx512, theirs);
#endif
}

static void test_vec_dot_vs_ggml_cpu(void **state)
{
    (void)state;
    if (!g_cpu)
        KS_SKIP("no CPU backend of the anchor for this CPU");
    float *x = malloc(sizeof(float) * ROW_ELEMS), *y = malloc(sizeof(float) * ROW_ELEMS),
          *wf = malloc(sizeof(float) * ROW_ELEMS), *yf = malloc(sizeof(float) * ROW_ELEMS);
    uint8_t w[ROW_ELEMS * 2], q8[ROW_ELEMS * 2];
    for (int k = 0; k < N_KTYPES; k++) {
        ggml_vec_dot_fn theirs = g_cpu_traits(ktypes[k].t)->vec_dot;
        int equal = 0;
        double worst = 0;
        for (int r = 0; r < N_ROWS; r++) {
            make_row(r, x);
            for (int i = 0; i < ROW_ELEMS; i++)
                y[i] = ks_rng_normal(&rng_state);
            quant_traits_scalar(ktypes[k].t)->from_float(x, w, ROW_ELEMS);
            quant_quantize_row_q8_K(y, q8, ROW_ELEMS);
            quant_traits_scalar(ktypes[k].t)->to_float(w, wf, ROW_ELEMS);
            quant_dequantize_row_q8_K(q8, yf, ROW_ELEMS);
            double mag = 0;
            for (int i = 0; i < ROW_ELEMS; i++)
                mag += fabs((double)wf[i] * yf[i]);
            float ours, best, ref;
            quant_traits_scalar(ktypes[k].t)->vec_dot(ROW_ELEMS, &ours, w, q8);
            quant_traits(ktypes[k].t)->vec_dot(ROW_ELEMS, &best, w, q8);
            theirs(ROW_ELEMS, &ref, 0, w, 0, q8, 0, 1);
            equal += ours == ref;
            if (kq_lane_order(ktypes[k].t) && (ours != ref || best != ref))
                fail_msg("%s row %d: kvserve %.9g (scalar) / %.9g (best), ggml %.9g: not ggml's bits", ktypes[k].name,
                         r, (double)ours, (double)best, (double)ref);
            double rel = (fabs((double)ours - ref) + fabs((double)best - ref)) / (mag + 1e-30);
            worst = rel > worst ? rel : worst;
            if (rel > 1e-6)
                fail_msg("%s row %d: kvserve %.9g / %.9g, ggml %.9g: more than float order apart", ktypes[k].name, r,
                         (double)ours, (double)best, (double)ref);
        }
        print_message("  %s vs ggml-cpu-%s vec_dot: %d of %d rows bit-equal, worst |diff| / sum|terms| %.2e\n",
                      ktypes[k].name, g_cpu_name, equal, N_ROWS, worst);
    }
    free(x), free(y), free(wf), free(yf);
}

/* ---- SwiGLU ------------------------------------------------------------------ */

static void test_swiglu_matches_ggml_cpu(void **state)
{
    (void)state;
#if defined(QUANT_HAVE_AVX512) || defined(QUANT_HAVE_AVX2)
#if defined(QUANT_HAVE_AVX512)
    void *lib = g_cpu;
    const char *variant = g_cpu_name;
#else
    const char *variant = "haswell";
    char path[1024];
    snprintf(path, sizeof path, "%s/anchor/bin/libggml-cpu-haswell.so",
             getenv("KVSERVE_SHARED") ? getenv("KVSERVE_SHARED") : "../shared");
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
#endif
    if (!lib)
        KS_SKIP("no CPU backend of the anchor for this build's ISA");
    void (*swiglu)(int n, float *y, const float *x, const float *g) =
        (void (*)(int, float *, const float *, const float *))sym(lib, "ggml_vec_swiglu_f32");
    enum { N = 4099 };
    static float g[N], up[N], ours[N], theirs[N];
    for (int i = 0; i < N; i++) {
        g[i] = i < N / 2 ? 4.0f * ks_rng_normal(&rng_state) : -110.0f + 220.0f * (float)i / N; /* and |x| past 88 and 104 */
        up[i] = ks_rng_normal(&rng_state);
    }
    g[0] = 0.0f, g[1] = -0.0f, g[2] = 1e-30f, g[3] = -1e-30f;
    for (int n = 0; n <= N; n += n < 40 ? 1 : 509) {
        memcpy(ours, g, sizeof g);
        quant_swiglu(ours, up, n);
        swiglu(n, theirs, g, up);
        if (memcmp(ours, theirs, sizeof(float) * (size_t)n))
            fail_msg("n=%d: quant_swiglu differs from ggml-cpu-%s's ggml_vec_swiglu_f32", n, variant);
    }
#if !defined(QUANT_HAVE_AVX512)
    dlclose(lib);
#endif
#else
    KS_SKIP("a build without SIMD: quant_swiglu is libm's, ggml's scalar path");
#endif
}

/* ---- main ------------------------------------------------------------------ */

int main(void)
{
    const char *shared = getenv("KVSERVE_SHARED") ? getenv("KVSERVE_SHARED") : "../shared";
    char path[1024];
    snprintf(path, sizeof path, "%s/anchor/bin/libggml-base.so.0", shared);
    g_base = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!g_base)
        return ks_skip_all("cannot load %s", path);
    g_cpu_name = cpu_variant();
    if (g_cpu_name) {
        snprintf(path, sizeof path, "%s/anchor/bin/libggml-cpu-%s.so", shared, g_cpu_name);
        g_cpu = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    }
    if (g_cpu) {
        void (*cpu_init)(void) = (void (*)(void))dlsym(g_cpu, "ggml_cpu_init");
        g_cpu_traits = (const struct ggml_cpu_traits *(*)(int))dlsym(g_cpu, "ggml_get_type_traits_cpu");
        if (!cpu_init || !g_cpu_traits)
            g_cpu = NULL;
        else
            cpu_init();
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_quantize_matches_ggml),
        cmocka_unit_test(test_dequantize_matches_ggml),
        cmocka_unit_test(test_q8_K_matches_ggml_cpu),
        cmocka_unit_test(test_vec_dot_vs_ggml_cpu),
        cmocka_unit_test(test_swiglu_matches_ggml_cpu),
    };
    return ks_run_tests(tests, NULL, NULL);
}
