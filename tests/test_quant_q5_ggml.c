/* q5_0 and q5_1 against ggml's own compiled code, loaded from the llama.cpp
 * build in $KVSERVE_SHARED/anchor/bin (skipped, exit 77, without it):
 *   - libggml-base's quantize_row_q5_*_ref gives kvserve's quantizer's bytes;
 *   - the CPU backend llama.cpp loads here (zen4 / icelake / haswell) and
 *     the AVX2 one (haswell): their Q8_0 and Q8_1 activation quantizers give
 *     kvserve's activation rows, and their ggml_vec_dot_q5_0_q8_0 /
 *     ggml_vec_dot_q5_1_q8_1 give kvserve's bits from every q5 kernel: the
 *     scalar reference, the AVX2 and AVX-512 vec_dots, and quant_matmul (and
 *     quant_matmul_repacked) at every batch size, per row and token. llama.cpp
 *     runs no other kernel for these types on x86 (quant_internal.h, "q5_0
 *     and q5_1"), so these are llama.cpp's q5 matmul outputs. */
#include <dlfcn.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "quant/quant_internal.h"
#include "support/rng.h"
#include "support/skip.h"
#include "threads/threads.h"

typedef void (*ggml_from_float_fn)(const float *x, void *y, int64_t k);
typedef void (*ggml_vec_dot_fn)(int n, float *s, size_t bs, const void *x, size_t bx, const void *y, size_t by,
                                int nrc);

/* One CPU backend of the anchor: its activation quantizers and q5 dots. */
struct ggml_cpu {
    const char *name;
    void *lib;
    ggml_from_float_fn q8_0_act, q8_1_act;
    ggml_vec_dot_fn dot_q5_0, dot_q5_1;
};

static void *g_base;
static struct ggml_cpu g_cpus[2]; /* this CPU's best variant, then haswell (AVX2) */
static int g_n_cpus;

#define COLS 1152 /* gemma3-1b's width: 36 blocks, not a multiple of 256 */
#define N_ROWS 48

struct q5type {
    enum quant_type t, act;
    const char *name;
};
static const struct q5type q5types[] = {{QUANT_Q5_0, QUANT_Q8_0, "q5_0"}, {QUANT_Q5_1, QUANT_Q8_1, "q5_1"}};

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

/* Row r: Gaussian rows at several scales, rows with an outlier, rows of
 * k + 0.5 values with amax 127 (id = 1 exactly: every value is a rounding
 * tie), positive-only rows (q5_1's min), and a block of zeros. */
static void make_row(int r, float *x, int n)
{
    float scale = powf(10.0f, (float)(r % 5) - 2.0f);
    for (int i = 0; i < n; i++)
        x[i] = scale * ks_rng_normal(&rng_state);
    if (r % 4 == 1)
        x[ks_rng_next(&rng_state) % (uint64_t)n] = 30.0f * scale;
    if (r % 4 == 2) {
        for (int i = 0; i < n; i++)
            x[i] = (float)((int)(ks_rng_next(&rng_state) % 253) - 126) + 0.5f;
        for (int b = 0; b < n / 32; b++)
            x[b * 32 + 5] = -127.0f;
    }
    if (r % 6 == 3)
        for (int i = 0; i < n; i++)
            x[i] = fabsf(x[i]) + scale;
    if (r % 8 == 5)
        memset(x + 32, 0, sizeof(float) * 32);
}

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

static bool load_cpu(const char *shared, const char *name, struct ggml_cpu *c)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/anchor/bin/libggml-cpu-%s.so", shared, name);
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib)
        return false;
    void (*cpu_init)(void) = (void (*)(void))dlsym(lib, "ggml_cpu_init");
    *c = (struct ggml_cpu){
        .name = name,
        .lib = lib,
        .q8_0_act = (ggml_from_float_fn)dlsym(lib, "quantize_row_q8_0"),
        .q8_1_act = (ggml_from_float_fn)dlsym(lib, "quantize_row_q8_1"),
        .dot_q5_0 = (ggml_vec_dot_fn)dlsym(lib, "ggml_vec_dot_q5_0_q8_0"),
        .dot_q5_1 = (ggml_vec_dot_fn)dlsym(lib, "ggml_vec_dot_q5_1_q8_1"),
    };
    if (!cpu_init || !c->q8_0_act || !c->q8_1_act || !c->dot_q5_0 || !c->dot_q5_1)
        return false;
    cpu_init();
    return true;
}

static ggml_vec_dot_fn ggml_dot(const struct ggml_cpu *c, enum quant_type t)
{
    return t == QUANT_Q5_0 ? c->dot_q5_0 : c->dot_q5_1;
}

static ggml_from_float_fn ggml_act(const struct ggml_cpu *c, enum quant_type t)
{
    return t == QUANT_Q5_0 ? c->q8_0_act : c->q8_1_act;
}

/* ---- quantizer: libggml-base ----------------------------------------------- */

static void test_quantize_matches_ggml(void **state)
{
    (void)state;
    float x[COLS];
    static uint8_t a[COLS * 2], b[COLS * 2];
    for (int k = 0; k < 2; k++) {
        char name[64];
        snprintf(name, sizeof name, "quantize_row_%s_ref", q5types[k].name);
        ggml_from_float_fn ref = (ggml_from_float_fn)dlsym(g_base, name);
        assert_non_null(ref);
        for (int r = 0; r < N_ROWS; r++) {
            make_row(r, x, COLS);
            quant_traits(q5types[k].t)->from_float(x, a, COLS);
            ref(x, b, COLS);
            if (memcmp(a, b, quant_row_size(q5types[k].t, COLS)))
                fail_msg("%s row %d: kvserve's quantizer and ggml's %s differ", q5types[k].name, r, name);
        }
    }
}

/* get_rows of a q5 token embedding: ggml's dequantize_row_q5_* */
static void test_dequantize_matches_ggml(void **state)
{
    (void)state;
    float x[COLS], ours[COLS], theirs[COLS];
    static uint8_t w[COLS * 2];
    for (int k = 0; k < 2; k++) {
        char name[64];
        snprintf(name, sizeof name, "dequantize_row_%s", q5types[k].name);
        void (*ref)(const void *x, float *y, int64_t k) = (void (*)(const void *, float *, int64_t))dlsym(g_base, name);
        assert_non_null(ref);
        for (int r = 0; r < N_ROWS; r++) {
            make_row(r, x, COLS);
            quant_traits(q5types[k].t)->from_float(x, w, COLS);
            quant_traits(q5types[k].t)->to_float(w, ours, COLS);
            ref(w, theirs, COLS);
            if (memcmp(ours, theirs, sizeof ours))
                fail_msg("%s row %d: kvserve's to_float and ggml's %s differ", q5types[k].name, r, name);
        }
    }
}

/* ---- activations: the CPU backends ----------------------------------------- */

static void test_activations_match_ggml_cpu(void **state)
{
    (void)state;
    if (!g_n_cpus)
        KS_SKIP("no CPU backend of the anchor for this CPU");
    float x[COLS];
    static uint8_t a[COLS * 2], b[COLS * 2];
    for (int c = 0; c < g_n_cpus; c++)
        for (int k = 0; k < 2; k++) {
            quant_from_float_fn ours = quant_act_quantizer(q5types[k].t);
            size_t bytes = quant_row_size(q5types[k].act, COLS);
            for (int r = 0; r < 4 * N_ROWS; r++) {
                make_row(r, x, COLS);
                ours(x, a, COLS);
                ggml_act(&g_cpus[c], q5types[k].t)(x, b, COLS);
                if (memcmp(a, b, bytes))
                    fail_msg("%s activations, row %d: kvserve's differ from ggml-cpu-%s's", q5types[k].name, r,
                             g_cpus[c].name);
            }
        }
}

/* ---- vec_dot: every kvserve kernel against each backend -------------------- */

struct kernel {
    const char *name;
    quant_vec_dot_fn dot[2]; /* q5_0, q5_1 */
};

static const struct kernel kernels[] = {
    {"scalar", {quant_vec_dot_q5_0_q8_0_ref, quant_vec_dot_q5_1_q8_1_ref}},
#if defined(QUANT_HAVE_AVX2)
    {"avx2", {quant_vec_dot_q5_0_q8_0_avx2, quant_vec_dot_q5_1_q8_1_avx2}},
#endif
#if defined(QUANT_HAVE_AVX512)
    {"avx512", {quant_vec_dot_q5_0_q8_0_avx512, quant_vec_dot_q5_1_q8_1_avx512}},
#endif
};
#define N_KERNELS (int)(sizeof kernels / sizeof kernels[0])

static void test_vec_dot_matches_ggml_cpu(void **state)
{
    (void)state;
    if (!g_n_cpus)
        KS_SKIP("no CPU backend of the anchor for this CPU");
    float x[COLS], y[COLS];
    static uint8_t w[COLS * 2], q8[COLS * 2];
    for (int k = 0; k < 2; k++)
        for (int r = 0; r < N_ROWS; r++) {
            make_row(r, x, COLS);
            make_row(r * 7 + 1, y, COLS);
            quant_traits(q5types[k].t)->from_float(x, w, COLS);
            ggml_act(&g_cpus[0], q5types[k].t)(y, q8, COLS);
            /* 1 to 8 blocks, then every 9 more, and the whole row */
            for (int n = 32; n <= COLS; n = n < 8 * 32 ? n + 32 : n + 32 * 9 < COLS ? n + 32 * 9 : n == COLS ? COLS + 1 : COLS) {
                float theirs[2];
                for (int c = 0; c < g_n_cpus; c++)
                    ggml_dot(&g_cpus[c], q5types[k].t)(n, &theirs[c], 0, w, 0, q8, 0, 1);
                if (g_n_cpus == 2 && memcmp(&theirs[0], &theirs[1], sizeof(float)))
                    fail_msg("%s: ggml-cpu-%s and -haswell differ (%.9g, %.9g)", q5types[k].name, g_cpus[0].name,
                             (double)theirs[0], (double)theirs[1]);
                for (int e = 0; e < N_KERNELS; e++) {
                    float ours;
                    kernels[e].dot[k](n, &ours, w, q8);
                    if (memcmp(&ours, &theirs[0], sizeof(float)))
                        fail_msg("%s row %d, n %d: kvserve %s %.9g, ggml-cpu-%s %.9g", q5types[k].name, r, n,
                                 kernels[e].name, (double)ours, g_cpus[0].name, (double)theirs[0]);
                }
                float best;
                quant_traits(q5types[k].t)->vec_dot(n, &best, w, q8);
                if (memcmp(&best, &theirs[0], sizeof(float)))
                    fail_msg("%s row %d, n %d: the traits vec_dot is not ggml's", q5types[k].name, r, n);
            }
        }
}

/* ---- matmul: every path, every batch size ---------------------------------- */

#define MM_ROWS 37 /* two 16-row groups and a row-major tail of 5 */
#define MM_MAX_TOKENS 40

/* Y of quant_matmul (or, repacked, quant_matmul_repacked) against ggml's
 * activation quantizer and vec_dot for every row and token, bit for bit. */
static void check_matmul(threads_pool *pool, const struct q5type *q, bool repack, int n_tokens, const uint8_t *W,
                         const float *X)
{
    size_t wbytes = quant_row_size(q->t, COLS) * MM_ROWS;
    uint8_t *Wm = malloc(wbytes);
    memcpy(Wm, W, wbytes);
    if (repack) {
        if (!quant_repack_fits(q->t, MM_ROWS, COLS)) {
            free(Wm);
            return;
        }
        assert_int_equal(quant_repack(q->t, MM_ROWS, COLS, Wm), KS_OK);
    }
    size_t work_size = quant_matmul_work_size(q->t, COLS, n_tokens);
    void *work = malloc(work_size);
    float *Y = malloc(sizeof(float) * MM_ROWS * (size_t)n_tokens);
    ks_status st = repack ? quant_matmul_repacked(pool, Wm, q->t, MM_ROWS, COLS, X, n_tokens, Y, work, work_size)
                          : quant_matmul(pool, Wm, q->t, MM_ROWS, COLS, X, n_tokens, Y, work, work_size);
    assert_int_equal(st, KS_OK);
    static uint8_t q8[COLS * 2];
    size_t wrow = quant_row_size(q->t, COLS);
    for (int t = 0; t < n_tokens; t++) {
        ggml_act(&g_cpus[0], q->t)(X + (size_t)t * COLS, q8, COLS);
        for (int r = 0; r < MM_ROWS; r++) {
            float theirs;
            ggml_dot(&g_cpus[0], q->t)(COLS, &theirs, 0, W + (size_t)r * wrow, 0, q8, 0, 1);
            if (memcmp(&theirs, &Y[(size_t)t * MM_ROWS + r], sizeof(float)))
                fail_msg("%s %s, %d tokens: token %d row %d: kvserve %.9g, ggml-cpu-%s %.9g", q->name,
                         repack ? "repacked" : "row-major", n_tokens, t, r, (double)Y[(size_t)t * MM_ROWS + r],
                         g_cpus[0].name, (double)theirs);
        }
    }
    free(Wm), free(work), free(Y);
}

static void test_matmul_matches_ggml_cpu(void **state)
{
    (void)state;
    if (!g_n_cpus)
        KS_SKIP("no CPU backend of the anchor for this CPU");
    threads_pool *pool = NULL;
    assert_int_equal(threads_create(2, &pool), KS_OK);
    float *X = malloc(sizeof(float) * COLS * MM_MAX_TOKENS), x[COLS];
    for (int t = 0; t < MM_MAX_TOKENS; t++)
        make_row(t * 3 + 2, X + (size_t)t * COLS, COLS);
    for (int k = 0; k < 2; k++) {
        const struct q5type *q = &q5types[k];
        size_t wrow = quant_row_size(q->t, COLS);
        uint8_t *W = malloc(wrow * MM_ROWS);
        for (int r = 0; r < MM_ROWS; r++) {
            make_row(r, x, COLS);
            quant_traits(q->t)->from_float(x, W + (size_t)r * wrow, COLS);
        }
        const int batches[] = {1, 2, 3, 8, 16, 17, 33, MM_MAX_TOKENS};
        for (size_t b = 0; b < sizeof batches / sizeof batches[0]; b++) {
            check_matmul(pool, q, false, batches[b], W, X);
            check_matmul(pool, q, true, batches[b], W, X);
        }
        free(W);
    }
    free(X);
    threads_free(pool);
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
    const char *best = cpu_variant();
    if (best && load_cpu(shared, best, &g_cpus[g_n_cpus]))
        g_n_cpus++;
    if (g_n_cpus == 1 && strcmp(best, "haswell") && load_cpu(shared, "haswell", &g_cpus[g_n_cpus]))
        g_n_cpus++;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_quantize_matches_ggml),
        cmocka_unit_test(test_dequantize_matches_ggml),
        cmocka_unit_test(test_activations_match_ggml_cpu),
        cmocka_unit_test(test_vec_dot_matches_ggml_cpu),
        cmocka_unit_test(test_matmul_matches_ggml_cpu),
    };
    return ks_run_tests(tests, NULL, NULL);
}
