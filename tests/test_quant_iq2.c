/* IQ2_XXS, IQ2_XS, IQ1_S, IQ1_M against llama.cpp's own code (dlopen of the
 * anchor build in $KVSERVE_SHARED/anchor/bin) and the SIMD kernels against
 * the scalar twin:
 *  - to_float equals ggml's dequantize_row_* bit for bit, on blocks of random
 *    bytes (every grid point, sign and scale field) and on blocks ggml's
 *    quantizer (ggml_quantize_chunk, importance matrix x^2) made;
 *  - the scalar vec_dot equals ggml's x86 AVX2 vec_dot (libggml-cpu-haswell)
 *    bit for bit, on an AVX2 CPU;
 *  - every SIMD kernel (one token, many, quant_matmul) gives the scalar bits;
 *  - our quantizer's round-trip error is within a bound and not far above
 *    ggml's own quantizer's on the same rows. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "quant/iq2.h"
#include "support/skip.h"

/* ---- random numbers ---------------------------------------------------- */

static uint64_t rng_state = 0x2545F4914F6CDD1Dull;
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
    if (u1 < 1e-7f)
        u1 = 1e-7f;
    return sqrtf(-2.f * logf(u1)) * cosf(6.2831853f * u2);
}

/* ---- the types ------------------------------------------------------------ */

struct itype {
    enum quant_type type;
    const char *ggml_dequant, *ggml_dot;
    double rt_bound;  /* round-trip RMS error / RMS(x) on N(0,1) rows */
};
static const struct itype types[] = {
    {QUANT_IQ2_XXS, "dequantize_row_iq2_xxs", "ggml_vec_dot_iq2_xxs_q8_K", 0.42},
    {QUANT_IQ2_XS, "dequantize_row_iq2_xs", "ggml_vec_dot_iq2_xs_q8_K", 0.36},
    {QUANT_IQ1_S, "dequantize_row_iq1_s", "ggml_vec_dot_iq1_s_q8_K", 0.60},
    {QUANT_IQ1_M, "dequantize_row_iq1_m", "ggml_vec_dot_iq1_m_q8_K", 0.55},
};
#define N_TYPES (sizeof types / sizeof types[0])

/* Blocks of random bytes with a finite, moderate f16 super-scale. */
static void random_blocks(enum quant_type t, uint8_t *out, int nb)
{
    size_t bb = quant_row_size(t, QK_K);
    for (int i = 0; i < nb; i++) {
        uint8_t *b = out + i * bb;
        for (size_t k = 0; k < bb; k++)
            b[k] = (uint8_t)rng_next();
        quant_f16 d = quant_f32_to_f16((0.01f + rng_uniform()) * (rng_next() & 1 ? -1.f : 1.f));
        if (t == QUANT_IQ1_M) {
            block_iq1_m *m = (block_iq1_m *)b;
            for (int k = 0; k < 4; k++) {
                uint16_t sc;
                memcpy(&sc, m->scales + 2 * k, 2);
                sc = (uint16_t)((sc & 0x0fff) | ((d >> (4 * k)) & 0xf) << 12);
                memcpy(m->scales + 2 * k, &sc, 2);
            }
        } else {
            memcpy(b, &d, sizeof d);
        }
    }
}

static void random_q8_K(float *scratch, void *y, int n)
{
    for (int i = 0; i < n; i++)
        scratch[i] = rng_normal();
    quant_quantize_row_q8_K(scratch, y, n);
}

/* ---- llama.cpp's libraries -------------------------------------------------- */

typedef void (*ggml_dequant_fn)(const void *, float *, int64_t);
typedef size_t (*ggml_quantize_chunk_fn)(int, const float *, void *, int64_t, int64_t, int64_t, const float *);
typedef void (*ggml_quantize_init_fn)(int);
typedef void (*ggml_vec_dot_fn)(int, float *, size_t, const void *, size_t, const void *, size_t, int);

static void *open_anchor(const char *lib, char *why, size_t why_size)
{
    const char *dir = getenv("KVSERVE_SHARED");
    char path[4096];
    snprintf(path, sizeof path, "%s/anchor/bin/%s", dir ? dir : "../shared", lib);
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h)
        snprintf(why, why_size, "cannot load %s: %s", path, dlerror());
    return h;
}

static bool same_bits(const float *a, const float *b, int n, int *at)
{
    for (int i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof(float)) != 0) {
            *at = i;
            return false;
        }
    return true;
}

/* ---- to_float vs ggml --------------------------------------------------------- */

static void test_dequantize_matches_ggml(void **state)
{
    (void)state;
    char why[4200];
    void *h = open_anchor("libggml-base.so.0", why, sizeof why);
    if (!h)
        KS_SKIP("%s", why);
    ggml_quantize_chunk_fn quantize_chunk = (ggml_quantize_chunk_fn)dlsym(h, "ggml_quantize_chunk");
    ggml_quantize_init_fn quantize_init = (ggml_quantize_init_fn)dlsym(h, "ggml_quantize_init");
    assert_non_null(quantize_chunk);
    assert_non_null(quantize_init);
    enum { NB = 64, ROWS = 4, COLS = 1024 };
    float *ours = malloc(sizeof(float) * NB * QK_K), *theirs = malloc(sizeof(float) * NB * QK_K);
    float *x = malloc(sizeof(float) * ROWS * COLS), imatrix[COLS];
    uint8_t *blocks = malloc(NB * 128);
    for (size_t k = 0; k < N_TYPES; k++) {
        const struct itype *it = &types[k];
        ggml_dequant_fn deq = (ggml_dequant_fn)dlsym(h, it->ggml_dequant);
        assert_non_null(deq);
        const struct quant_traits *tr = quant_traits_scalar(it->type);
        assert_non_null(tr);
        int at = -1;
        /* random bit patterns: every field of the format */
        random_blocks(it->type, blocks, NB);
        tr->to_float(blocks, ours, NB * QK_K);
        deq(blocks, theirs, NB * QK_K);
        if (!same_bits(ours, theirs, NB * QK_K, &at))
            fail_msg("%s random blocks: element %d: ours %.9g, ggml %.9g", tr->name, at, ours[at], theirs[at]);
        /* ggml's quantizer's blocks (it needs an importance matrix for these types) */
        for (int i = 0; i < ROWS * COLS; i++)
            x[i] = rng_normal() * (i % 97 == 0 ? 4.f : 1.f);
        for (int c = 0; c < COLS; c++) {
            imatrix[c] = 0;
            for (int r = 0; r < ROWS; r++)
                imatrix[c] += x[r * COLS + c] * x[r * COLS + c];
        }
        quantize_init((int)it->type);
        size_t bytes = quantize_chunk((int)it->type, x, blocks, 0, ROWS, COLS, imatrix);
        assert_int_equal(bytes, quant_row_size(it->type, COLS) * ROWS);
        tr->to_float(blocks, ours, ROWS * COLS);
        deq(blocks, theirs, ROWS * COLS);
        if (!same_bits(ours, theirs, ROWS * COLS, &at))
            fail_msg("%s ggml blocks: element %d: ours %.9g, ggml %.9g", tr->name, at, ours[at], theirs[at]);
    }
    free(ours), free(theirs), free(x), free(blocks);
}

/* ---- scalar vec_dot vs ggml's x86 kernel -------------------------------------- */

static void test_vec_dot_matches_ggml_x86(void **state)
{
    (void)state;
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("bmi2"))
        KS_SKIP("this CPU cannot run llama.cpp's AVX2 (haswell) kernels");
    char why[4200];
    void *base = open_anchor("libggml-base.so.0", why, sizeof why);
    void *h = base ? open_anchor("libggml-cpu-haswell.so", why, sizeof why) : NULL;
    if (!h)
        KS_SKIP("%s", why);
    void (*cpu_init)(void) = (void (*)(void))dlsym(h, "ggml_cpu_init");
    if (cpu_init)
        cpu_init();
    enum { N = 8 * QK_K, ROUNDS = 50 };
    float *scratch = malloc(sizeof(float) * N);
    uint8_t *xb = malloc(N / QK_K * 128), *yb = malloc(quant_row_size(QUANT_Q8_K, N));
    for (size_t k = 0; k < N_TYPES; k++) {
        const struct itype *it = &types[k];
        ggml_vec_dot_fn dot = (ggml_vec_dot_fn)dlsym(h, it->ggml_dot);
        assert_non_null(dot);
        const struct quant_traits *tr = quant_traits_scalar(it->type);
        for (int r = 0; r < ROUNDS; r++) {
            int n = QK_K * (1 + r % 8);
            if (r % 2) {
                random_blocks(it->type, xb, n / QK_K);
            } else {
                for (int i = 0; i < n; i++)
                    scratch[i] = rng_normal();
                tr->from_float(scratch, xb, n);
            }
            random_q8_K(scratch, yb, n);
            float ours, theirs;
            tr->vec_dot(n, &ours, xb, yb);
            dot(n, &theirs, 0, xb, 0, yb, 0, 1);
            if (memcmp(&ours, &theirs, sizeof ours) != 0)
                fail_msg("%s round %d (n %d): ours %.9g, ggml %.9g", tr->name, r, n, ours, theirs);
        }
    }
    free(scratch), free(xb), free(yb);
}

/* ---- SIMD vs scalar ------------------------------------------------------------ */

typedef void (*iq2_multi_fn)(enum quant_type, int, int, float *, size_t, const void *, const void *, size_t);

static __attribute__((unused)) void check_multi(const char *isa, iq2_multi_fn multi, enum quant_type t, int n, int nt, const uint8_t *xb,
                        const uint8_t *ys, size_t yrow)
{
    const struct quant_traits *tr = quant_traits_scalar(t);
    float s[40], ref;
    multi(t, n, nt, s, 1, xb, ys, yrow);
    for (int k = 0; k < nt; k++) {
        tr->vec_dot(n, &ref, xb, ys + k * yrow);
        if (memcmp(&ref, &s[k], sizeof ref) != 0)
            fail_msg("%s %s n %d nt %d token %d: %.9g, scalar %.9g", isa, tr->name, n, nt, k, s[k], ref);
    }
}

static void test_simd_matches_scalar(void **state)
{
    (void)state;
    enum { N = 4 * QK_K, NT = 37 };
    float *scratch = malloc(sizeof(float) * N);
    size_t yrow = quant_row_size(QUANT_Q8_K, N);
    uint8_t *xb = malloc(N / QK_K * 128), *ys = malloc(yrow * NT);
    int checked = 0;
    for (size_t k = 0; k < N_TYPES; k++) {
        const enum quant_type t = types[k].type;
        for (int r = 0; r < 6; r++) {
            if (r % 2) {
                random_blocks(t, xb, N / QK_K);
            } else {
                for (int i = 0; i < N; i++)
                    scratch[i] = rng_normal();
                quant_traits(t)->from_float(scratch, xb, N);
            }
            for (int tok = 0; tok < NT; tok++)
                random_q8_K(scratch, ys + tok * yrow, N);
            const int nts[] = {1, 2, 7, 16, 17, NT};
            for (size_t j = 0; j < sizeof nts / sizeof nts[0]; j++) {
#if defined(IQ2_HAVE_AVX2)
                check_multi("avx2", quant_iq2_dot_multi_avx2, t, N, nts[j], xb, ys, yrow);
                checked++;
#endif
#if defined(IQ2_HAVE_AVX512)
                check_multi("avx512", quant_iq2_dot_multi_avx512, t, N, nts[j], xb, ys, yrow);
                checked++;
#endif
            }
            float best, ref;
            quant_traits(t)->vec_dot(N, &best, xb, ys);
            quant_traits_scalar(t)->vec_dot(N, &ref, xb, ys);
            assert_memory_equal(&best, &ref, sizeof ref);
        }
    }
    free(scratch), free(xb), free(ys);
    if (!checked)
        KS_SKIP("no SIMD kernels in this build (portable): the traits vec_dot is the scalar one");
}

/* quant_matmul (decode and the multi-token path) gives the scalar bits. */
static void test_matmul_matches_scalar(void **state)
{
    (void)state;
    enum { ROWS = 24, COLS = 2 * QK_K, MAXT = 40 };
    float *w = malloc(sizeof(float) * ROWS * COLS), *X = malloc(sizeof(float) * MAXT * COLS);
    float *Y = malloc(sizeof(float) * MAXT * ROWS);
    uint8_t *W = malloc(ROWS * COLS), *y8 = malloc(quant_row_size(QUANT_Q8_K, COLS));
    for (int i = 0; i < ROWS * COLS; i++)
        w[i] = rng_normal();
    for (int i = 0; i < MAXT * COLS; i++)
        X[i] = rng_normal();
    for (size_t k = 0; k < N_TYPES; k++) {
        const enum quant_type t = types[k].type;
        const struct quant_traits *tr = quant_traits(t);
        const size_t wrow = quant_row_size(t, COLS);
        for (int r = 0; r < ROWS; r++)
            tr->from_float(w + r * COLS, W + r * wrow, COLS);
        const int nts[] = {1, 3, MAXT};
        for (size_t j = 0; j < 3; j++) {
            size_t ws = quant_matmul_work_size(t, COLS, nts[j]);
            void *work = malloc(ws);
            assert_int_equal(quant_matmul(NULL, W, t, ROWS, COLS, X, nts[j], Y, work, ws), KS_OK);
            for (int tok = 0; tok < nts[j]; tok++) {
                quant_quantize_row_q8_K(X + tok * COLS, y8, COLS);
                for (int r = 0; r < ROWS; r++) {
                    float ref;
                    quant_traits_scalar(t)->vec_dot(COLS, &ref, W + r * wrow, y8);
                    if (memcmp(&ref, &Y[tok * ROWS + r], sizeof ref) != 0)
                        fail_msg("%s nt %d token %d row %d: %.9g, scalar %.9g", tr->name, nts[j], tok, r,
                                 Y[tok * ROWS + r], ref);
                }
            }
            free(work);
        }
    }
    free(w), free(X), free(Y), free(W), free(y8);
}

/* ---- our quantizer ------------------------------------------------------------ */

static double rel_rms(const float *x, const float *y, int n)
{
    double e = 0, s = 0;
    for (int i = 0; i < n; i++)
        e += (double)(x[i] - y[i]) * (x[i] - y[i]), s += (double)x[i] * x[i];
    return sqrt(e / s);
}

static void test_quantizer_round_trip(void **state)
{
    (void)state;
    enum { ROWS = 4, COLS = 2048 };
    float *x = malloc(sizeof(float) * ROWS * COLS), *y = malloc(sizeof(float) * ROWS * COLS), imatrix[COLS];
    uint8_t *blocks = malloc(ROWS * COLS);
    for (int i = 0; i < ROWS * COLS; i++)
        x[i] = rng_normal();
    char why[4200];
    void *h = open_anchor("libggml-base.so.0", why, sizeof why);
    for (size_t k = 0; k < N_TYPES; k++) {
        const struct quant_traits *tr = quant_traits(types[k].type);
        size_t row = quant_row_size(types[k].type, COLS);
        for (int r = 0; r < ROWS; r++)
            tr->from_float(x + r * COLS, blocks + r * row, COLS);
        tr->to_float(blocks, y, ROWS * COLS);
        double ours = rel_rms(x, y, ROWS * COLS);
        print_message("%s: round-trip rel. RMS error %.4f", tr->name, ours);
        assert_true(ours < types[k].rt_bound);
        if (!h) {
            print_message("\n");
            continue;
        }
        for (int c = 0; c < COLS; c++)
            imatrix[c] = 1.0f;
        ((ggml_quantize_init_fn)dlsym(h, "ggml_quantize_init"))((int)types[k].type);
        ((ggml_quantize_chunk_fn)dlsym(h, "ggml_quantize_chunk"))((int)types[k].type, x, blocks, 0, ROWS, COLS,
                                                                   imatrix);
        tr->to_float(blocks, y, ROWS * COLS);
        double theirs = rel_rms(x, y, ROWS * COLS);
        print_message(", ggml's %.4f\n", theirs);
        assert_true(ours < 1.25 * theirs);
    }
    free(x), free(y), free(blocks);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dequantize_matches_ggml),
        cmocka_unit_test(test_vec_dot_matches_ggml_x86),
        cmocka_unit_test(test_simd_matches_scalar),
        cmocka_unit_test(test_matmul_matches_scalar),
        cmocka_unit_test(test_quantizer_round_trip),
    };
    return ks_run_tests(tests, NULL, NULL);
}
