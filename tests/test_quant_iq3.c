/* IQ3_XXS, IQ3_S, IQ2_S weights against ggml itself and against their
 * scalar twins:
 *  - to_float is bit-exact with ggml's to_float (libggml-base.so.0 of
 *    $KVSERVE_SHARED/anchor/bin, dlopened) on blocks ggml_quantize_chunk
 *    makes, on blocks our quantizer makes and on random bytes;
 *  - the scalar vec_dot has llama.cpp's bits: ggml_vec_dot_*_q8_K of its
 *    AVX2 CPU backend (libggml-cpu-haswell.so) on the same rows;
 *  - the AVX2 and AVX-512 vec_dots and multi-token kernels give the scalar
 *    vec_dot's bits (any token count and stride), and quant_matmul (decode and
 *    prefill) gives per row and token the bits of the traits vec_dot;
 *  - the scalar vec_dot is the double dot of the dequantized rows within
 *    float rounding (1e-5 of sum |x y|);
 *  - our quantizer's round-trip error on N(0,1) rows is below a bound and
 *    within 1.3x of ggml's own quantizer's (printed).
 * Cases needing the anchor's libraries skip (KS_SKIP) without them. */
#include <dlfcn.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "quant/iq3.h"
#include "support/skip.h"

/* ---- random numbers ---------------------------------------------------- */

static uint64_t rng_state = 0x243F6A8885A308D3ull;
static uint64_t rng_next(void)
{
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static float rng_uniform(void) { return (float)((rng_next() >> 40) * (1.0 / 16777216.0)); }
static float rng_normal(void)
{
    float u1 = rng_uniform(), u2 = rng_uniform();
    if (u1 < 1e-7f) u1 = 1e-7f;
    return sqrtf(-2.f * logf(u1)) * cosf(6.2831853f * u2);
}

/* ---- the types ------------------------------------------------------------ */

struct itype {
    const char *name;
    enum quant_type type;
    size_t bytes;
    quant_vec_dot_fn scalar, avx2, avx512;
    quant_kq_dot_multi_fn multi_avx2, multi_avx512;
    const char *ggml_dot; /* symbol in the anchor's CPU backend */
    double rt_bound;      /* our round-trip RMS error / RMS(x) on N(0,1) */
};

#if defined(KQ_HAVE_AVX2)
#define AVX2(t) quant_vec_dot_##t##_q8_K_avx2
#define MULTI_AVX2(t) quant_vec_dot_##t##_q8_K_multi_avx2
#else
#define AVX2(t) NULL
#define MULTI_AVX2(t) NULL
#endif
#if defined(KQ_HAVE_AVX512)
#define AVX512(t) quant_vec_dot_##t##_q8_K_avx512
#define MULTI_AVX512(t) quant_vec_dot_##t##_q8_K_multi_avx512
#else
#define AVX512(t) NULL
#define MULTI_AVX512(t) NULL
#endif
#define ITYPE(T, t, bound)                                                                                  \
    {#t, QUANT_##T, sizeof(block_##t), quant_vec_dot_##t##_q8_K_scalar, AVX2(t), AVX512(t), MULTI_AVX2(t), \
     MULTI_AVX512(t), "ggml_vec_dot_" #t "_q8_K", bound}

static const struct itype itypes[] = {
    ITYPE(IQ3_XXS, iq3_xxs, 0.20),
    ITYPE(IQ3_S, iq3_s, 0.17),
    ITYPE(IQ2_S, iq2_s, 0.30),
};
#define N_ITYPES (sizeof itypes / sizeof itypes[0])

static const int test_sizes[] = {256, 512, 2048 + 256};
#define MAX_COLS (2048 + 256)

/* Random bytes with a sane d (|d| <= 0.01, either sign). */
static void random_blocks(const struct itype *it, void *x, int nb)
{
    uint8_t *p = x;
    for (size_t i = 0; i < it->bytes * (size_t)nb; i++) p[i] = (uint8_t)rng_next();
    for (int i = 0; i < nb; i++) {
        float d = 0.01f * rng_uniform();
        quant_f16 h = kq_f32_to_f16(rng_next() & 1 ? -d : d);
        memcpy(p + it->bytes * (size_t)i, &h, sizeof h);
    }
}

static void normal_row(float *x, int n, float scale)
{
    for (int i = 0; i < n; i++) x[i] = scale * rng_normal();
}

/* Q8_K rows from a normal f32 row, with our activation quantizer. */
static void q8_row(block_q8_K *y, int n)
{
    float x[MAX_COLS];
    normal_row(x, n, 1.0f);
    quant_traits(QUANT_Q8_K)->from_float(x, y, n);
}

/* ---- ggml, dlopened ------------------------------------------------------ */

struct ggml_type_traits { /* ggml.h's public struct */
    const char *type_name;
    int64_t blck_size, blck_size_interleave;
    size_t type_size;
    bool is_quantized;
    void (*to_float)(const void *x, float *y, int64_t k);
    void (*from_float_ref)(const float *x, void *y, int64_t k);
};
typedef void (*ggml_vec_dot_fn)(int n, float *s, size_t bs, const void *x, size_t bx, const void *y, size_t by,
                                int nrc);

static struct {
    void *base, *cpu;
    const struct ggml_type_traits *(*traits)(int type);
    size_t (*quantize_chunk)(int type, const float *src, void *dst, int64_t start, int64_t nrows,
                             int64_t n_per_row, const float *imatrix);
    void (*quantize_init)(int type);
    char why[2600];
} g;

static const char *anchor_dir(void)
{
    static char dir[1024];
    const char *s = getenv("KVSERVE_SHARED");
    snprintf(dir, sizeof dir, "%s/anchor/bin", s ? s : "../shared");
    return dir;
}

static bool ggml_base(void)
{
    if (g.base)
        return true;
    char path[1100];
    snprintf(path, sizeof path, "%s/libggml-base.so.0", anchor_dir());
    if (!(g.base = dlopen(path, RTLD_NOW | RTLD_LOCAL))) {
        snprintf(g.why, sizeof g.why, "cannot load %s: %s", path, dlerror());
        return false;
    }
    *(void **)&g.traits = dlsym(g.base, "ggml_get_type_traits");
    *(void **)&g.quantize_chunk = dlsym(g.base, "ggml_quantize_chunk");
    *(void **)&g.quantize_init = dlsym(g.base, "ggml_quantize_init");
    if (!g.traits || !g.quantize_chunk || !g.quantize_init) {
        snprintf(g.why, sizeof g.why, "%s lacks ggml_get_type_traits/ggml_quantize_chunk/ggml_quantize_init", path);
        dlclose(g.base);
        g.base = NULL;
        return false;
    }
    return true;
}

/* llama.cpp's AVX2 CPU backend (the code its AVX-512 builds run for these
 * types too), when this CPU can run it. */
static ggml_vec_dot_fn ggml_dot(const struct itype *it)
{
    if (!g.cpu) {
        if (!ggml_base())
            return NULL;
        __builtin_cpu_init();
        if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("bmi2")) {
            snprintf(g.why, sizeof g.why, "this CPU cannot run llama.cpp's AVX2 backend");
            return NULL;
        }
        char path[1100];
        snprintf(path, sizeof path, "%s/libggml-cpu-haswell.so", anchor_dir());
        if (!(g.cpu = dlopen(path, RTLD_NOW | RTLD_LOCAL))) {
            snprintf(g.why, sizeof g.why, "cannot load %s: %s", path, dlerror());
            return NULL;
        }
        void (*cpu_init)(void);
        *(void **)&cpu_init = dlsym(g.cpu, "ggml_cpu_init"); /* its fp16 tables */
        if (cpu_init)
            cpu_init();
    }
    ggml_vec_dot_fn f;
    *(void **)&f = dlsym(g.cpu, it->ggml_dot);
    if (!f)
        snprintf(g.why, sizeof g.why, "no %s in the anchor's CPU backend", it->ggml_dot);
    return f;
}

/* nrows x n values quantized by ggml (an importance matrix of ones). */
static void ggml_quantize(const struct itype *it, const float *x, void *q, int nrows, int n)
{
    float ones[MAX_COLS];
    for (int i = 0; i < n; i++) ones[i] = 1.0f;
    g.quantize_init((int)it->type);
    size_t bytes = g.quantize_chunk((int)it->type, x, q, 0, nrows, n, ones);
    assert_int_equal(bytes, quant_row_size(it->type, n) * (size_t)nrows);
}

/* ---- tests --------------------------------------------------------------- */

static void test_traits(void **state)
{
    (void)state;
    for (size_t k = 0; k < N_ITYPES; k++) {
        const struct itype *it = &itypes[k];
        const struct quant_traits *tr = quant_traits(it->type), *sc = quant_traits_scalar(it->type);
        assert_non_null(tr);
        assert_non_null(sc);
        assert_string_equal(tr->name, it->name);
        assert_int_equal(tr->block_elems, QK_K);
        assert_int_equal(tr->block_bytes, it->bytes);
        assert_int_equal(tr->vec_dot_type, QUANT_Q8_K);
        assert_true(tr->is_quantized && !tr->kv_only && tr->to_float && tr->from_float && tr->vec_dot);
        assert_ptr_equal(sc->vec_dot, it->scalar);
        assert_true(quant_type_known(it->type));
        enum quant_type t;
        assert_int_equal(quant_type_from_name(it->name, &t), KS_OK);
        assert_int_equal(t, it->type);
        assert_int_equal(quant_row_size(it->type, 512), 2 * it->bytes);
    }
    assert_int_equal(sizeof(block_iq3_xxs), 98);
    assert_int_equal(sizeof(block_iq3_s), 110);
    assert_int_equal(sizeof(block_iq2_s), 82);
}

/* Our to_float and ggml's on the same blocks: the same bits. */
static void expect_same_dequant(const struct itype *it, const void *q, int n, const char *what)
{
    float ours[MAX_COLS], theirs[MAX_COLS];
    quant_traits(it->type)->to_float(q, ours, n);
    g.traits((int)it->type)->to_float(q, theirs, n);
    if (memcmp(ours, theirs, sizeof(float) * (size_t)n)) {
        for (int i = 0; i < n; i++)
            if (memcmp(&ours[i], &theirs[i], sizeof(float)))
                fail_msg("%s, %s blocks: element %d is %.9g, ggml's %.9g", it->name, what, i, (double)ours[i],
                         (double)theirs[i]);
    }
}

static void test_dequantize_matches_ggml(void **state)
{
    (void)state;
    if (!ggml_base())
        KS_SKIP("%s", g.why);
    static _Alignas(64) uint8_t q[4 * MAX_COLS];
    float x[4 * MAX_COLS];
    for (size_t k = 0; k < N_ITYPES; k++) {
        const struct itype *it = &itypes[k];
        assert_int_equal(g.traits((int)it->type)->type_size, it->bytes);
        for (size_t s = 0; s < sizeof test_sizes / sizeof test_sizes[0]; s++) {
            const int n = test_sizes[s];
            for (int r = 0; r < 4; r++) normal_row(x + r * n, n, r == 3 ? 1e-3f : 1.0f);
            ggml_quantize(it, x, q, 4, n);
            for (int r = 0; r < 4; r++) expect_same_dequant(it, q + r * quant_row_size(it->type, n), n, "ggml's");
            quant_traits(it->type)->from_float(x, q, n);
            expect_same_dequant(it, q, n, "our quantizer's");
            random_blocks(it, q, n / QK_K);
            expect_same_dequant(it, q, n, "random");
        }
    }
}

static void test_vec_dot_matches_llamacpp(void **state)
{
    (void)state;
    if (!ggml_base())
        KS_SKIP("%s", g.why);
    static _Alignas(64) uint8_t q[MAX_COLS];
    static block_q8_K y[MAX_COLS / QK_K];
    float x[MAX_COLS];
    for (size_t k = 0; k < N_ITYPES; k++) {
        const struct itype *it = &itypes[k];
        ggml_vec_dot_fn theirs = ggml_dot(it);
        if (!theirs)
            KS_SKIP("%s", g.why);
        for (size_t s = 0; s < sizeof test_sizes / sizeof test_sizes[0]; s++) {
            const int n = test_sizes[s];
            for (int trial = 0; trial < 20; trial++) {
                normal_row(x, n, 0.05f);
                if (trial % 2)
                    ggml_quantize(it, x, q, 1, n);
                else
                    random_blocks(it, q, n / QK_K);
                q8_row(y, n);
                float a, b;
                it->scalar(n, &a, q, y);
                theirs(n, &b, 0, q, 0, y, 0, 1);
                if (memcmp(&a, &b, sizeof a))
                    fail_msg("%s n=%d trial %d: scalar %.9g, llama.cpp %.9g", it->name, n, trial, (double)a,
                             (double)b);
            }
        }
    }
}

static void test_vec_dot_vs_dequantized(void **state)
{
    (void)state;
    static _Alignas(64) uint8_t q[MAX_COLS];
    static block_q8_K y[MAX_COLS / QK_K];
    float wx[MAX_COLS], yx[MAX_COLS];
    for (size_t k = 0; k < N_ITYPES; k++) {
        const struct itype *it = &itypes[k];
        for (int trial = 0; trial < 20; trial++) {
            const int n = test_sizes[trial % 3];
            random_blocks(it, q, n / QK_K);
            q8_row(y, n);
            quant_traits(it->type)->to_float(q, wx, n);
            quant_traits(QUANT_Q8_K)->to_float(y, yx, n);
            double ref = 0, mag = 0;
            for (int i = 0; i < n; i++) ref += (double)wx[i] * yx[i], mag += fabs((double)wx[i] * yx[i]);
            float got;
            it->scalar(n, &got, q, y);
            if (fabs(got - ref) > 1e-5 * mag)
                fail_msg("%s n=%d: vec_dot %.9g, dequantized dot %.9g", it->name, n, (double)got, ref);
        }
    }
}

static void expect_bits(const char *what, const struct itype *it, int n, float got, float want)
{
    if (memcmp(&got, &want, sizeof got))
        fail_msg("%s %s n=%d: %.9g, scalar %.9g", it->name, what, n, (double)got, (double)want);
}

/* Each SIMD kernel and, for nt tokens at any stride, its multi-token form. */
static void check_simd(const struct itype *it, quant_vec_dot_fn dot, quant_kq_dot_multi_fn multi, const char *isa)
{
    enum { NT_MAX = 19, Y_PAD = 1 };
    static _Alignas(64) uint8_t q[MAX_COLS];
    static block_q8_K ys[NT_MAX * (MAX_COLS / QK_K + Y_PAD)];
    for (size_t s = 0; s < sizeof test_sizes / sizeof test_sizes[0]; s++) {
        const int n = test_sizes[s], nb = n / QK_K;
        for (int trial = 0; trial < 6; trial++) {
            random_blocks(it, q, nb);
            for (int t = 0; t < NT_MAX; t++) q8_row(ys + t * (nb + Y_PAD), n);
            float want[NT_MAX], got[2 * NT_MAX];
            for (int t = 0; t < NT_MAX; t++) {
                it->scalar(n, &want[t], q, ys + t * (nb + Y_PAD));
                float one;
                dot(n, &one, q, ys + t * (nb + Y_PAD));
                expect_bits(isa, it, n, one, want[t]);
            }
            static const int nts[] = {0, 1, 3, 8, 9, 16, NT_MAX};
            for (size_t c = 0; c < sizeof nts / sizeof nts[0]; c++) {
                for (int t = 0; t < 2 * NT_MAX; t++) got[t] = -1.0f;
                multi(n, nts[c], got, 2, q, ys, (size_t)(nb + Y_PAD) * sizeof(block_q8_K));
                for (int t = 0; t < nts[c]; t++) expect_bits(isa, it, n, got[2 * t], want[t]);
                for (int t = nts[c]; t < NT_MAX; t++) assert_true(got[2 * t] == -1.0f);
            }
        }
    }
}

static void test_simd_matches_scalar(void **state)
{
    (void)state;
    int ran = 0;
    for (size_t k = 0; k < N_ITYPES; k++) {
        const struct itype *it = &itypes[k];
        if (it->avx2)
            check_simd(it, it->avx2, it->multi_avx2, "avx2"), ran++;
        if (it->avx512)
            check_simd(it, it->avx512, it->multi_avx512, "avx512"), ran++;
        assert_ptr_equal(quant_iq3_dot_multi(it->type),
                         it->multi_avx512 ? it->multi_avx512 : it->multi_avx2);
    }
    if (!ran)
        KS_SKIP("no SIMD kernels in this build");
}

/* quant_matmul and quant_get_row with these weights: per row and token the
 * bits of the traits vec_dot on the Q8_K activation rows. */
static void test_matmul_and_get_row(void **state)
{
    (void)state;
    enum { ROWS = 37, COLS = 512, TOK_MAX = 70 };
    threads_pool *pool;
    assert_int_equal(threads_create(2, &pool), KS_OK);
    static float X[TOK_MAX * COLS], Y[TOK_MAX * ROWS], W32[ROWS * COLS], row[COLS];
    static block_q8_K yq[TOK_MAX * COLS / QK_K];
    for (size_t k = 0; k < N_ITYPES; k++) {
        const struct itype *it = &itypes[k];
        const struct quant_traits *tr = quant_traits(it->type);
        const size_t wrow = quant_row_size(it->type, COLS);
        uint8_t *W = malloc(wrow * ROWS);
        normal_row(W32, ROWS * COLS, 0.02f);
        for (int r = 0; r < ROWS; r++) tr->from_float(W32 + r * COLS, W + r * wrow, COLS);
        normal_row(X, TOK_MAX * COLS, 1.0f);
        for (int t = 0; t < TOK_MAX; t++) quant_traits(QUANT_Q8_K)->from_float(X + t * COLS, yq + t * (COLS / QK_K), COLS);
        static const int nts[] = {1, 2, 7, 33, TOK_MAX};
        for (size_t c = 0; c < sizeof nts / sizeof nts[0]; c++) {
            const int nt = nts[c];
            size_t ws = quant_matmul_work_size(it->type, COLS, nt);
            void *work = malloc(ws);
            assert_int_equal(quant_matmul(pool, W, it->type, ROWS, COLS, X, nt, Y, work, ws), KS_OK);
            for (int t = 0; t < nt; t++)
                for (int r = 0; r < ROWS; r++) {
                    float want;
                    tr->vec_dot(COLS, &want, W + r * wrow, yq + t * (COLS / QK_K));
                    if (memcmp(&want, &Y[t * ROWS + r], sizeof want))
                        fail_msg("%s matmul of %d tokens: row %d token %d is %.9g, vec_dot %.9g", it->name, nt, r, t,
                                 (double)Y[t * ROWS + r], (double)want);
                }
            free(work);
        }
        float deq[COLS];
        for (int r = 0; r < ROWS; r += 9) {
            assert_int_equal(quant_get_row(W, it->type, COLS, r, row), KS_OK);
            tr->to_float(W + r * wrow, deq, COLS);
            assert_memory_equal(row, deq, sizeof row);
        }
        free(W);
    }
    threads_free(pool);
}

static double roundtrip_err(const struct itype *it, const float *x, const void *q, int n)
{
    float back[MAX_COLS];
    quant_traits(it->type)->to_float(q, back, n);
    double e = 0, s = 0;
    for (int i = 0; i < n; i++) e += (double)(x[i] - back[i]) * (x[i] - back[i]), s += (double)x[i] * x[i];
    return sqrt(e / s);
}

static void test_quantize_roundtrip(void **state)
{
    (void)state;
    enum { ROWS = 16, N = 2048 };
    static float x[ROWS * N];
    static _Alignas(64) uint8_t q[ROWS * N];
    for (size_t k = 0; k < N_ITYPES; k++) {
        const struct itype *it = &itypes[k];
        const size_t rb = quant_row_size(it->type, N);
        normal_row(x, ROWS * N, 1.0f);
        double ours = 0, theirs = 0;
        for (int r = 0; r < ROWS; r++) {
            quant_traits(it->type)->from_float(x + r * N, q + r * rb, N);
            ours += roundtrip_err(it, x + r * N, q + r * rb, N) / ROWS;
        }
        if (ggml_base()) {
            for (int r = 0; r < ROWS; r++) {
                ggml_quantize(it, x + r * N, q + r * rb, 1, N);
                theirs += roundtrip_err(it, x + r * N, q + r * rb, N) / ROWS;
            }
            print_message("%-8s round-trip RMS error / RMS: ours %.4f, ggml's (imatrix of ones) %.4f\n", it->name,
                          ours, theirs);
            assert_true(ours <= 1.3 * theirs);
        } else {
            print_message("%-8s round-trip RMS error / RMS: ours %.4f\n", it->name, ours);
        }
        assert_true(ours <= it->rt_bound);
        /* zeros and a lone spike survive */
        float z[QK_K] = {0};
        quant_traits(it->type)->from_float(z, q, QK_K);
        float back[QK_K];
        quant_traits(it->type)->to_float(q, back, QK_K);
        for (int i = 0; i < QK_K; i++) assert_true(back[i] == 0.0f);
        z[77] = -3.0f;
        quant_traits(it->type)->from_float(z, q, QK_K);
        quant_traits(it->type)->to_float(q, back, QK_K);
        assert_true(back[77] < -1.5f);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_traits),
        cmocka_unit_test(test_dequantize_matches_ggml),
        cmocka_unit_test(test_vec_dot_matches_llamacpp),
        cmocka_unit_test(test_vec_dot_vs_dequantized),
        cmocka_unit_test(test_simd_matches_scalar),
        cmocka_unit_test(test_matmul_and_get_row),
        cmocka_unit_test(test_quantize_roundtrip),
    };
    return ks_run_tests(tests, NULL, NULL);
}
