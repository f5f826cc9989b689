/* IQ4_NL, IQ4_XS and MXFP4 weights:
 *  - to_float bit for bit against ggml's own (libggml-base.so.0 of the
 *    llama.cpp anchor, dlopened from $KVSERVE_SHARED/anchor/bin; skipped when
 *    absent) on blocks ggml quantized and on blocks of random bytes, and our
 *    quantizers against ggml_quantize_chunk (no importance matrix): the same
 *    bytes;
 *  - quantize round-trip error on N(0,1) rows below a per-type bound;
 *  - every SIMD vec_dot against its scalar twin: bit-identical for IQ4_NL
 *    and MXFP4 (the same fma chain), and for IQ4_XS to the scalar eight-lane
 *    order (quant_vec_dot_iq4_xs_q8_K_lanes), which is within the bound
 *    test_quant uses ((n/32 + 2) * 2^-23 * sum |x_i y_i|) of ggml's generic
 *    order (the scalar vec_dot); the multi-token
 *    kernels bit-identical to their ISA's vec_dot for every token of a
 *    batch (up to 37 tokens: the 8- and 16-token passes and the rest);
 *  - against llama.cpp's AVX2 CPU backend (libggml-cpu-haswell.so): the
 *    activation quantizers byte for byte and the IQ4_XS vec_dots (SIMD and
 *    scalar eight-lane) bit for bit;
 *  - quant_matmul (decode and prefill paths) bit-identical to the traits
 *    vec_dot per row and token, and quant_get_row to to_float. */
#include <dlfcn.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "quant/iq4_mxfp4.h"
#include "support/skip.h"

/* ---- random numbers ---------------------------------------------------- */

static uint64_t g_rng = 0x2545F4914F6CDD1Dull;
static uint64_t rng_next(void)
{
    uint64_t z = (g_rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static float rng_uniform(void) { return (float)((rng_next() >> 40) * (1.0 / 16777216.0)); }
static float rng_normal(void)
{
    float u1 = rng_uniform(), u2 = rng_uniform();
    if (u1 < 1e-7f)
        u1 = 1e-7f;
    return sqrtf(-2.f * logf(u1)) * cosf(6.2831853f * u2);
}
static void fill_normal(float *x, int64_t n, float scale)
{
    for (int64_t i = 0; i < n; i++)
        x[i] = scale * rng_normal();
}

static const enum quant_type g_types[] = {QUANT_IQ4_NL, QUANT_IQ4_XS, QUANT_MXFP4};
#define N_TYPES (int)(sizeof g_types / sizeof g_types[0])

/* Random bytes for a row of blocks, each block's scale made finite (a NaN
 * scale would make bit comparisons depend on payloads); narrow: MXFP4
 * exponents near 2^0 (dot products that stay finite), else any but NaN. */
static void random_blocks(enum quant_type t, void *row, int64_t n, bool narrow)
{
    const struct quant_traits *tr = quant_traits(t);
    uint8_t *p = row;
    int64_t nb = n / tr->block_elems;
    for (size_t i = 0; i < (size_t)nb * tr->block_bytes; i++)
        p[i] = (uint8_t)rng_next();
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *blk = p + (size_t)b * tr->block_bytes;
        if (t == QUANT_MXFP4) {
            blk[0] = narrow ? (uint8_t)(112 + blk[0] % 32) : (uint8_t)(blk[0] % 255); /* 255 is E8M0's NaN */
        } else {
            quant_f16 d = quant_f32_to_f16((rng_uniform() - 0.5f) * 0.1f);
            memcpy(blk, &d, sizeof d);
        }
    }
}

/* ---- ggml, dlopened -------------------------------------------------------- */

/* ggml.h's struct ggml_type_traits, as the anchor's libggml-base exports it. */
struct ggml_traits {
    const char *type_name;
    int64_t blck_size, blck_size_interleave;
    size_t type_size;
    bool is_quantized;
    void (*to_float)(const void *x, float *y, int64_t k);
    void (*from_float_ref)(const float *x, void *y, int64_t k);
};

static struct {
    void *lib;
    const struct ggml_traits *(*get_traits)(int type);
    size_t (*quantize_chunk)(int type, const float *src, void *dst, int64_t start, int64_t nrows, int64_t n_per_row,
                             const float *imatrix);
    void (*quantize_init)(int type);
} g_ggml;

static bool ggml_load(void)
{
    if (g_ggml.lib)
        return true;
    const char *shared = getenv("KVSERVE_SHARED");
    char path[1024];
    snprintf(path, sizeof path, "%s/anchor/bin/libggml-base.so.0", shared ? shared : "../shared");
    void *lib = dlopen(path, RTLD_NOW | RTLD_GLOBAL); /* the CPU backend below links against it */
    if (!lib)
        return false;
    *(void **)&g_ggml.get_traits = dlsym(lib, "ggml_get_type_traits");
    *(void **)&g_ggml.quantize_chunk = dlsym(lib, "ggml_quantize_chunk");
    *(void **)&g_ggml.quantize_init = dlsym(lib, "ggml_quantize_init");
    if (!g_ggml.get_traits || !g_ggml.quantize_chunk || !g_ggml.quantize_init) {
        dlclose(lib);
        return false;
    }
    g_ggml.lib = lib;
    return true;
}

static void test_layouts(void **state)
{
    (void)state;
    const struct {
        enum quant_type t;
        const char *name;
        int elems;
        size_t bytes;
        enum quant_type dot;
    } want[] = {
        {QUANT_IQ4_NL, "iq4_nl", 32, 18, QUANT_Q8_0},
        {QUANT_IQ4_XS, "iq4_xs", 256, 136, QUANT_Q8_K},
        {QUANT_MXFP4, "mxfp4", 32, 17, QUANT_Q8_0},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const struct quant_traits *tr = quant_traits(want[i].t), *sc = quant_traits_scalar(want[i].t);
        assert_non_null(tr);
        assert_string_equal(tr->name, want[i].name);
        assert_int_equal(tr->block_elems, want[i].elems);
        assert_int_equal(tr->block_bytes, want[i].bytes);
        assert_int_equal(tr->vec_dot_type, want[i].dot);
        assert_true(tr->is_quantized && !tr->kv_only && quant_type_known((uint32_t)want[i].t));
        assert_non_null(tr->to_float);
        assert_non_null(tr->from_float);
        assert_non_null(tr->vec_dot);
        assert_non_null(sc->vec_dot);
        enum quant_type parsed;
        assert_int_equal(quant_type_from_name(want[i].name, &parsed), KS_OK);
        assert_int_equal(parsed, want[i].t);
    }
}

/* Our to_float on ggml's blocks and on random blocks, bit for bit with
 * ggml's; our quantizer's bytes against ggml_quantize_chunk's. */
static void test_against_ggml(void **state)
{
    (void)state;
    if (!ggml_load())
        KS_SKIP("libggml-base.so.0 not found under $KVSERVE_SHARED/anchor/bin");
    enum { N = 4096, ROWS = 4 };
    float *x = malloc(sizeof(float) * N * ROWS), *a = malloc(sizeof(float) * N * ROWS);
    float *b = malloc(sizeof(float) * N * ROWS);
    uint8_t *qg = malloc(N * ROWS), *qk = malloc(N * ROWS);
    assert_true(x && a && b && qg && qk);
    for (int ti = 0; ti < N_TYPES; ti++) {
        enum quant_type t = g_types[ti];
        const struct quant_traits *tr = quant_traits_scalar(t);
        const struct ggml_traits *gt = g_ggml.get_traits((int)t);
        assert_non_null(gt);
        assert_string_equal(gt->type_name, tr->name);
        assert_int_equal(gt->blck_size, tr->block_elems);
        assert_int_equal(gt->type_size, tr->block_bytes);
        size_t row = quant_row_size(t, N);
        for (int rep = 0; rep < 3; rep++) {
            float scale = rep == 0 ? 1.0f : rep == 1 ? 37.0f : 1e-3f;
            fill_normal(x, (int64_t)N * ROWS, scale);
            x[5] = 0.0f, x[40] = -x[41]; /* a zero and a tie of magnitudes */
            for (int j = 0; j < 32; j++) /* a block of zeros (IQ4_XS: a zero scale) */
                x[N + 64 + j] = 0.0f;
            g_ggml.quantize_init((int)t);
            size_t got = g_ggml.quantize_chunk((int)t, x, qg, 0, ROWS, N, NULL);
            assert_int_equal(got, row * ROWS);
            for (int r = 0; r < ROWS; r++)
                tr->from_float(x + (int64_t)r * N, qk + r * row, N);
            size_t differ = 0;
            for (size_t i = 0; i < row * ROWS; i++)
                differ += qg[i] != qk[i];
            if (differ)
                fail_msg("%s scale %g: %zu of %zu quantized bytes differ from ggml_quantize_chunk's", tr->name,
                         (double)scale, differ, row * ROWS);
            gt->to_float(qg, a, (int64_t)N * ROWS);
            tr->to_float(qg, b, (int64_t)N * ROWS);
            assert_memory_equal(a, b, sizeof(float) * N * ROWS);
            random_blocks(t, qg, (int64_t)N * ROWS, false);
            gt->to_float(qg, a, (int64_t)N * ROWS);
            tr->to_float(qg, b, (int64_t)N * ROWS);
            for (int64_t i = 0; i < (int64_t)N * ROWS; i++)
                if (memcmp(&a[i], &b[i], sizeof(float)))
                    fail_msg("%s random blocks: y[%lld] = %.9g, ggml %.9g", tr->name, (long long)i, (double)b[i],
                             (double)a[i]);
            /* the best table's to_float is the reference's */
            quant_traits(t)->to_float(qg, a, (int64_t)N * ROWS);
            assert_memory_equal(a, b, sizeof(float) * N * ROWS);
        }
    }
    free(x), free(a), free(b), free(qg), free(qk);
}

/* Quantize -> dequantize error on N(0,1) rows, as RMS / RMS(x), and MXFP4's
 * exponent edge cases. Bounds measured with some margin (IQ4_NL 0.076, IQ4_XS
 * 0.077, MXFP4 0.114 here). */
static void test_round_trip(void **state)
{
    (void)state;
    enum { N = 8192 };
    const double bound[] = {0.09, 0.09, 0.13};
    float *x = malloc(sizeof(float) * N), *y = malloc(sizeof(float) * N);
    uint8_t *q = malloc(N);
    assert_true(x && y && q);
    for (int ti = 0; ti < N_TYPES; ti++) {
        const struct quant_traits *tr = quant_traits(g_types[ti]);
        fill_normal(x, N, 1.0f);
        tr->from_float(x, q, N);
        tr->to_float(q, y, N);
        double e2 = 0, x2 = 0;
        for (int i = 0; i < N; i++)
            e2 += (double)(x[i] - y[i]) * (x[i] - y[i]), x2 += (double)x[i] * x[i];
        double rel = sqrt(e2 / x2);
        print_message("%s round trip: rms error / rms %.4f\n", tr->name, rel);
        if (!(rel < bound[ti]))
            fail_msg("%s: relative RMS error %.4f, bound %.3f", tr->name, rel, bound[ti]);
        /* zeros come back as zeros; tiny, huge and non-finite blocks stay defined */
        memset(x, 0, sizeof(float) * QK_K);
        tr->from_float(x, q, QK_K);
        tr->to_float(q, y, QK_K);
        for (int i = 0; i < QK_K; i++)
            assert_true(y[i] == 0.0f);
        const float odd[] = {1e-40f, 3e38f, INFINITY, NAN};
        for (size_t k = 0; k < sizeof odd / sizeof odd[0]; k++) {
            for (int i = 0; i < QK_K; i++)
                x[i] = odd[k] * (i % 3 == 0 ? -1.0f : 0.5f);
            tr->from_float(x, q, QK_K);
            tr->to_float(q, y, QK_K);
        }
    }
    free(x), free(y), free(q);
}

/* ---- vec_dot: SIMD against scalar, multi against single -------------------- */

struct dot_kernels {
    const char *isa;
    quant_vec_dot_fn dot[3];
    quant_kq_dot_multi_fn multi[3];
};

static const struct dot_kernels g_isas[] = {
#if defined(IQ4_HAVE_AVX2)
    {"avx2",
     {quant_vec_dot_iq4_nl_q8_0_avx2, quant_vec_dot_iq4_xs_q8_K_avx2, quant_vec_dot_mxfp4_q8_0_avx2},
     {quant_vec_dot_iq4_nl_q8_0_multi_avx2, quant_vec_dot_iq4_xs_q8_K_multi_avx2,
      quant_vec_dot_mxfp4_q8_0_multi_avx2}},
#endif
#if defined(IQ4_HAVE_AVX512)
    {"avx512",
     {quant_vec_dot_iq4_nl_q8_0_avx512, quant_vec_dot_iq4_xs_q8_K_avx512, quant_vec_dot_mxfp4_q8_0_avx512},
     {quant_vec_dot_iq4_nl_q8_0_multi_avx512, quant_vec_dot_iq4_xs_q8_K_multi_avx512,
      quant_vec_dot_mxfp4_q8_0_multi_avx512}},
#endif
    {NULL, {NULL, NULL, NULL}, {NULL, NULL, NULL}},
};

/* sum |x_i * y_i| of the dequantized rows */
static double abs_dot(const float *x, const float *y, int n)
{
    double s = 0;
    for (int i = 0; i < n; i++)
        s += fabs((double)x[i] * y[i]);
    return s;
}

static void test_simd_vs_scalar(void **state)
{
    (void)state;
    if (!g_isas[0].isa)
        KS_SKIP("no SIMD kernels in this build");
    enum { NMAX = 4096, TOK = 37 };
    static const int sizes[] = {256, 512, 768, 2048, 4096, 32, 96, 224, 480};
    float *xf = malloc(sizeof(float) * NMAX), *yf = malloc(sizeof(float) * NMAX * TOK);
    float *xd = malloc(sizeof(float) * NMAX), *yd = malloc(sizeof(float) * NMAX);
    uint8_t *xq = malloc(NMAX), *yq = malloc((size_t)NMAX * 2 * TOK);
    assert_true(xf && yf && xd && yd && xq && yq);
    for (int ti = 0; ti < N_TYPES; ti++) {
        enum quant_type t = g_types[ti];
        const struct quant_traits *tr = quant_traits_scalar(t), *dt = quant_traits(tr->vec_dot_type);
        for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
            int n = sizes[si];
            if (n % tr->block_elems)
                continue;
            size_t yrow = quant_row_size(tr->vec_dot_type, n);
            for (int rep = 0; rep < 6; rep++) {
                fill_normal(xf, n, rep == 1 ? 1e-3f : 1.0f);
                if (rep >= 4)
                    random_blocks(t, xq, n, true);
                else
                    tr->from_float(xf, xq, n);
                fill_normal(yf, (int64_t)n * TOK, rep == 2 ? 100.0f : 1.0f);
                for (int k = 0; k < TOK; k++)
                    dt->from_float(yf + (int64_t)k * n, yq + k * yrow, n);
                tr->to_float(xq, xd, n);
                for (int k = 0; k < TOK; k++) {
                    dt->to_float(yq + k * yrow, yd, n);
                    float want;
                    tr->vec_dot(n, &want, xq, yq + k * yrow);
                    double tol = (n / 32.0 + 2) * 0x1p-23 * abs_dot(xd, yd, n) + 1e-30;
                    float lanes = want; /* IQ4_XS: the scalar eight-lane order the SIMD kernels follow */
                    if (t == QUANT_IQ4_XS)
                        quant_vec_dot_iq4_xs_q8_K_lanes(n, &lanes, xq, yq + k * yrow);
                    if (!(fabs((double)lanes - want) <= tol))
                        fail_msg("%s lanes n=%d token %d: got %.9g want %.9g (tol %.3g)", tr->name, n, k,
                                 (double)lanes, (double)want, tol);
                    for (const struct dot_kernels *d = g_isas; d->isa; d++) {
                        float got;
                        d->dot[ti](n, &got, xq, yq + k * yrow);
                        if (memcmp(&got, &lanes, sizeof got))
                            fail_msg("%s %s n=%d token %d: got %.9g, scalar %.9g (must be equal)", tr->name, d->isa, n,
                                     k, (double)got, (double)lanes);
                        if (t != QUANT_IQ4_XS && memcmp(&got, &want, sizeof got)) /* the same fma chain */
                            fail_msg("%s %s n=%d token %d: got %.9g, scalar %.9g (must be equal)", tr->name, d->isa, n,
                                     k, (double)got, (double)want);
                        if (!(fabs((double)got - want) <= tol))
                            fail_msg("%s %s n=%d token %d: got %.9g want %.9g (tol %.3g)", tr->name, d->isa, n, k,
                                     (double)got, (double)want, tol);
                    }
                }
                for (const struct dot_kernels *d = g_isas; d->isa; d++) {
                    for (int nt = 0; nt <= TOK; nt++) {
                        float s[TOK * 3];
                        for (int k = 0; k < TOK * 3; k++)
                            s[k] = -1.0f;
                        d->multi[ti](n, nt, s, 3, xq, yq, yrow);
                        for (int k = 0; k < TOK; k++) {
                            float one;
                            d->dot[ti](n, &one, xq, yq + k * yrow);
                            if (k < nt && memcmp(&one, &s[3 * k], sizeof one))
                                fail_msg("%s %s multi n=%d nt=%d token %d: %.9g, vec_dot %.9g", tr->name, d->isa, n,
                                         nt, k, (double)s[3 * k], (double)one);
                            /* only s[t * s_stride] for t < nt is written */
                            assert_true(s[3 * k + 1] == -1.0f && s[3 * k + 2] == -1.0f);
                            assert_true(k < nt || s[3 * k] == -1.0f);
                        }
                    }
                }
            }
        }
    }
    free(xf), free(yf), free(xd), free(yd), free(xq), free(yq);
}

/* ggml-cpu.h's struct ggml_type_traits_cpu. */
struct ggml_cpu_traits {
    void (*from_float)(const float *x, void *y, int64_t k);
    void (*vec_dot)(int n, float *s, size_t bs, const void *x, size_t bx, const void *y, size_t by, int nrc);
    int vec_dot_type;
    int64_t nrows;
};

/* llama.cpp's AVX2 CPU backend (libggml-cpu-haswell.so): the kernels it runs
 * on an AVX2 machine, and on AVX-512 ones for IQ4_XS, which has no wider
 * path. Our activation quantizers give its bytes, and our SIMD IQ4_XS
 * vec_dots its bits. (Its IQ4_NL and MXFP4 vec_dots are not what llama.cpp
 * runs on these weights: it repacks them, see iq4_mxfp4.h.) */
static void test_against_ggml_cpu(void **state)
{
    (void)state;
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c"))
        KS_SKIP("the CPU has no AVX2/FMA/F16C for libggml-cpu-haswell.so");
    if (!ggml_load())
        KS_SKIP("libggml-base.so.0 not found under $KVSERVE_SHARED/anchor/bin");
    const char *shared = getenv("KVSERVE_SHARED");
    char path[1024];
    snprintf(path, sizeof path, "%s/anchor/bin/libggml-cpu-haswell.so", shared ? shared : "../shared");
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib)
        KS_SKIP("%s cannot be loaded: %s", path, dlerror());
    void (*cpu_init)(void);
    const struct ggml_cpu_traits *(*cpu_traits)(int type);
    *(void **)&cpu_init = dlsym(lib, "ggml_cpu_init");
    *(void **)&cpu_traits = dlsym(lib, "ggml_get_type_traits_cpu");
    assert_true(cpu_init && cpu_traits);
    cpu_init(); /* its f16 tables */
    enum { N = 2048 };
    float *x = malloc(sizeof(float) * N), *y = malloc(sizeof(float) * N);
    uint8_t *wq = malloc(N), *ya = malloc(2 * N), *yb = malloc(2 * N);
    assert_true(x && y && wq && ya && yb);
    for (int ti = 0; ti < N_TYPES; ti++) {
        enum quant_type t = g_types[ti];
        const struct quant_traits *tr = quant_traits(t);
        const struct ggml_cpu_traits *g = cpu_traits((int)t), *gy = cpu_traits(g->vec_dot_type);
        assert_int_equal(g->vec_dot_type, tr->vec_dot_type);
        quant_from_float_fn act = quant_act_quantizer(t);
        size_t yrow = quant_row_size(tr->vec_dot_type, N);
        for (int rep = 0; rep < 50; rep++) {
            fill_normal(x, N, 1.0f);
            fill_normal(y, N, rep % 2 ? 1.0f : 30.0f);
            if (rep % 5 == 0) /* activations in exact binary ratios: rounding ties */
                for (int i = 0; i < N; i++)
                    y[i] = (float)((int)(y[i] * 4)) * 0.125f;
            tr->from_float(x, wq, N);
            gy->from_float(y, ya, N);
            act(y, yb, N);
            if (memcmp(ya, yb, yrow))
                fail_msg("%s rep %d: our activations differ from ggml-cpu's %s from_float", tr->name, rep,
                         quant_type_name(tr->vec_dot_type));
            if (t != QUANT_IQ4_XS)
                continue;
            float want, lanes;
            g->vec_dot(N, &want, 0, wq, 0, ya, 0, 1);
            quant_vec_dot_iq4_xs_q8_K_lanes(N, &lanes, wq, ya);
            if (memcmp(&lanes, &want, sizeof lanes))
                fail_msg("%s rep %d: scalar eight lanes %.9g, ggml-cpu's AVX2 vec_dot %.9g", tr->name, rep,
                         (double)lanes, (double)want);
            for (const struct dot_kernels *d = g_isas; d->isa; d++) {
                float got;
                d->dot[ti](N, &got, wq, ya);
                if (memcmp(&got, &want, sizeof got))
                    fail_msg("%s %s rep %d: %.9g, ggml-cpu's AVX2 vec_dot %.9g", tr->name, d->isa, rep, (double)got,
                             (double)want);
            }
        }
    }
    free(x), free(y), free(wq), free(ya), free(yb);
    dlclose(lib);
}

/* ---- matmul and get_row ------------------------------------------------------- */

static void test_matmul(void **state)
{
    (void)state;
    threads_pool *pool = NULL;
    assert_int_equal(threads_create(2, &pool), KS_OK);
    static const int64_t token_counts[] = {1, 3, 8, 20, 70};
    for (int ti = 0; ti < N_TYPES; ti++) {
        enum quant_type t = g_types[ti];
        const struct quant_traits *tr = quant_traits(t);
        const int64_t rows = 67, cols = 512;
        size_t wrow = quant_row_size(t, cols), yrow = quant_row_size(tr->vec_dot_type, cols);
        float *wf = malloc(sizeof(float) * rows * cols), *X = malloc(sizeof(float) * 70 * cols);
        float *Y = malloc(sizeof(float) * 70 * rows), *row = malloc(sizeof(float) * cols);
        float *ref = malloc(sizeof(float) * cols);
        uint8_t *W = malloc(wrow * rows), *xq = malloc(yrow);
        assert_true(wf && X && Y && row && ref && W && xq);
        fill_normal(wf, rows * cols, 0.05f);
        for (int64_t r = 0; r < rows; r++)
            tr->from_float(wf + r * cols, W + r * wrow, cols);
        fill_normal(X, 70 * cols, 1.0f);
        for (size_t ci = 0; ci < sizeof token_counts / sizeof token_counts[0]; ci++) {
            int64_t nt = token_counts[ci];
            size_t ws = quant_matmul_work_size(t, cols, nt);
            void *work = malloc(ws);
            assert_non_null(work);
            assert_int_equal(quant_matmul(pool, W, t, rows, cols, X, nt, Y, work, ws), KS_OK);
            for (int64_t k = 0; k < nt; k++) {
                quant_act_quantizer(t)(X + k * cols, xq, cols);
                for (int64_t r = 0; r < rows; r++) {
                    float want;
                    tr->vec_dot((int)cols, &want, W + r * wrow, xq);
                    if (memcmp(&want, &Y[k * rows + r], sizeof want))
                        fail_msg("%s tokens=%lld: Y[%lld][%lld] = %.9g, vec_dot %.9g", tr->name, (long long)nt,
                                 (long long)k, (long long)r, (double)Y[k * rows + r], (double)want);
                }
            }
            free(work);
        }
        assert_int_equal(quant_get_row(W, t, cols, 5, row), KS_OK);
        tr->to_float(W + 5 * wrow, ref, cols);
        assert_memory_equal(row, ref, sizeof(float) * cols);
        free(wf), free(X), free(Y), free(row), free(ref), free(W), free(xq);
    }
    threads_free(pool);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layouts),     cmocka_unit_test(test_against_ggml), cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_simd_vs_scalar), cmocka_unit_test(test_against_ggml_cpu), cmocka_unit_test(test_matmul),
    };
    return ks_run_tests(tests, NULL, NULL);
}
