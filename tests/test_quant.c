/* quant: conversions, quantize->dequantize error bounds, every SIMD vec_dot
 * against its scalar reference, and quant_matmul against a naive f32 matmul
 * over the dequantized weights. */
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
#include "quant/quant_internal.h"

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rnd32(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 11);
}
static float rndf(void) { return (float)(rnd32() >> 8) / 16777216.0f * 2.0f - 1.0f; } /* [-1, 1) */

static void fill_random(float *x, int64_t n, float scale)
{
    for (int64_t i = 0; i < n; i++)
        x[i] = rndf() * scale;
}

static const enum quant_type k_basic[] = {QUANT_F32, QUANT_F16, QUANT_BF16, QUANT_Q4_0, QUANT_Q4_1,
                                          QUANT_Q5_0, QUANT_Q5_1, QUANT_Q8_0, QUANT_IQ4_NL};
#define N_BASIC (sizeof k_basic / sizeof k_basic[0])
/* The row conversions' tests also cover kvserve's KV-only iq3_nl (it has no matmul). */
#define N_ROW_TYPES (N_BASIC + 1)
static enum quant_type row_type(size_t i) { return i < N_BASIC ? k_basic[i] : QUANT_IQ3_NL; }

/* ---- KV quantizers with a scale search ------------------------------------- */

static double row_error(enum quant_type t, const float *x, const void *q, int64_t n)
{
    float y[QK_K];
    assert_true(n <= QK_K);
    quant_traits_scalar(t)->to_float(q, y, n);
    double e = 0.0;
    for (int64_t i = 0; i < n; i++)
        e += ((double)x[i] - y[i]) * ((double)x[i] - y[i]);
    return e;
}

/* One block of a shape KV rows take: uniform, heavy-tailed with an outlier,
 * or offset by a constant (the channel means rotation leaves behind). */
static void fill_kv_block(float *x, int n, int shape)
{
    float scale = 1.0f + (float)(rnd32() % 100);
    fill_random(x, n, 1.0f);
    for (int i = 0; i < n; i++) {
        if (shape == 1)
            x[i] = x[i] * x[i] * x[i];
        x[i] = x[i] * scale + (shape == 2 ? 0.7f * scale : 0.0f);
    }
    if (shape == 1)
        x[rnd32() % (uint32_t)n] *= 4.0f;
}

/* Scales at the ends of f16's range (underflow to subnormals or 0,
 * overflow to inf): the search never turns a finite block non-finite and
 * stays no worse than the plain block. */
static void check_kv_search_extremes(void)
{
    static const float scales[] = {1e-9f, 1e-7f, 3e-5f, 6e4f, 1e5f};
    for (int t = 0; t < QUANT_TYPE_COUNT; t++) {
        const struct quant_traits *tr = quant_traits((enum quant_type)t);
        if (!tr || !tr->kv_from_float)
            continue;
        for (size_t i = 0; i < sizeof scales / sizeof scales[0]; i++) {
            float x[QK_K], yp[QK_K], ys[QK_K];
            uint8_t plain[256], search[256];
            int n = tr->block_elems;
            fill_random(x, n, scales[i]);
            tr->from_float(x, plain, n);
            tr->kv_from_float(x, search, n);
            tr->to_float(plain, yp, n);
            tr->to_float(search, ys, n);
            double ep = row_error((enum quant_type)t, x, plain, n), es = row_error((enum quant_type)t, x, search, n);
            for (int j = 0; j < n; j++)
                if (isfinite(yp[j]) && !isfinite(ys[j]))
                    fail_msg("%s scale %g: element %d is finite in the plain block, %g with the search", tr->name,
                             (double)scales[i], j, (double)ys[j]);
            if (isfinite(ep) && es > ep * (1.0 + 1e-6))
                fail_msg("%s scale %g: search error %g > plain %g", tr->name, (double)scales[i], es, ep);
        }
    }
}

static void test_kv_scale_search_never_worse(void **state)
{
    (void)state;
    int n_types = 0;
    for (int t = 0; t < QUANT_TYPE_COUNT; t++) {
        const struct quant_traits *tr = quant_traits((enum quant_type)t);
        if (!tr || !tr->kv_from_float)
            continue;
        n_types++;
        assert_ptr_equal(quant_traits_scalar((enum quant_type)t)->kv_from_float, tr->kv_from_float);
        int n = tr->block_elems;
        double plain_sum = 0.0, search_sum = 0.0;
        for (int rep = 0; rep < 3000; rep++) {
            float x[QK_K];
            uint8_t plain[256], search[256];
            fill_kv_block(x, n, rep % 3);
            tr->from_float(x, plain, n);
            tr->kv_from_float(x, search, n);
            double ep = row_error((enum quant_type)t, x, plain, n), es = row_error((enum quant_type)t, x, search, n);
            if (es > ep * (1.0 + 1e-6)) /* f32 sums in the search, f64 here */
                fail_msg("%s block %d: search error %g > plain %g", tr->name, rep, es, ep);
            plain_sum += ep;
            search_sum += es;
        }
        /* the search must actually help, not only do no harm */
        if (!(search_sum < 0.97 * plain_sum))
            fail_msg("%s: search error %g is not below 0.97 x plain %g", tr->name, search_sum, plain_sum);
    }
    assert_true(n_types >= 7); /* q8_0, q5_1, q5_0, q4_1, iq4_nl, q4_0 and iq3_nl */
    check_kv_search_extremes();
    float zero[QK8_0] = {0};
    block_q8_0 z;
    quant_traits(QUANT_Q8_0)->kv_from_float(zero, &z, QK8_0);
    assert_int_equal(z.d, 0);
    /* a constant block: the affine search has no range to fit and keeps d = 0, m = the value */
    float flat[QK4_1];
    for (int j = 0; j < QK4_1; j++)
        flat[j] = 0.375f;
    block_q4_1 f;
    quant_traits(QUANT_Q4_1)->kv_from_float(flat, &f, QK4_1);
    assert_int_equal(f.d, 0);
    assert_float_equal(quant_f16_to_f32(f.m), 0.375f, 0.0f);
}

/* ---- conversions ----------------------------------------------------------- */

static void test_f16_roundtrip_all(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = quant_f16_to_f32((quant_f16)h), g = quant_f16_to_f32_soft((quant_f16)h);
        if (isnan(f)) {
            assert_true(isnan(g));
            continue;
        }
        assert_memory_equal(&f, &g, sizeof f);
        assert_int_equal(quant_f32_to_f16_soft(f), h);
        assert_int_equal(quant_f32_to_f16(f), h);
    }
}

static void test_f16_rounding_matches_hardware(void **state)
{
    (void)state;
    const float edge[] = {65504.0f, 65519.99f, 65520.0f, 1e9f, 5.96e-8f, 2.98e-8f, 2.99e-8f,
                          6.1e-5f, 6.097e-5f, 1.0f + 0x1p-11f, 1.0f + 0x1p-11f + 0x1p-23f, -0.0f, INFINITY};
    for (size_t i = 0; i < sizeof edge / sizeof edge[0]; i++)
        assert_int_equal(quant_f32_to_f16_soft(edge[i]), quant_f32_to_f16(edge[i]));
    for (int i = 0; i < 1000000; i++) {
        uint32_t u = rnd32() | (rnd32() << 21 & 0x80000000u);
        float f;
        memcpy(&f, &u, sizeof f);
        if (isnan(f))
            continue;
        assert_int_equal(quant_f32_to_f16_soft(f), quant_f32_to_f16(f));
    }
}

static void test_bf16(void **state)
{
    (void)state;
    assert_int_equal(quant_f32_to_bf16(1.0f), 0x3f80);
    /* 1 + 2^-8 is a tie: rounds to even (1.0); 1 + 3*2^-8 rounds up */
    assert_int_equal(quant_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);
    assert_int_equal(quant_f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);
    assert_true(isnan(quant_bf16_to_f32(quant_f32_to_bf16(NAN))));
    assert_true(quant_bf16_to_f32(0x4049) > 3.14f && quant_bf16_to_f32(0x4049) < 3.15f);
}

static void test_names(void **state)
{
    (void)state;
    enum quant_type t;
    assert_int_equal(quant_type_from_name("Q4_K", &t), KS_OK);
    assert_int_equal(t, QUANT_Q4_K);
    assert_int_equal(quant_type_from_name("bf16", &t), KS_OK);
    assert_int_equal(t, QUANT_BF16);
    assert_int_equal(quant_type_from_name("q9_9", &t), KS_ERR_INVALID_ARG);
    assert_string_equal(quant_type_name(QUANT_Q8_0), "q8_0");
    assert_string_equal(quant_type_name((enum quant_type)4), "unknown(4)");
    assert_false(quant_type_known(4));
    assert_false(quant_type_known(1000));
    assert_true(quant_type_known(QUANT_Q6_K));
    /* kvserve's own KV type: found by name, but never a GGUF tensor type */
    assert_int_equal(quant_type_from_name("iq3_nl", &t), KS_OK);
    assert_int_equal(t, QUANT_IQ3_NL);
    assert_false(quant_type_known(QUANT_IQ3_NL));
    assert_true(quant_traits(QUANT_IQ3_NL)->kv_only);
    assert_false(quant_traits(QUANT_Q4_0)->kv_only);
    assert_null(quant_traits(QUANT_IQ3_NL)->vec_dot);
    assert_int_equal(quant_row_size(QUANT_IQ3_NL, 64), 28); /* 3.5 bits per value */
    assert_int_equal(quant_row_size(QUANT_Q4_0, 64), 36);
    assert_int_equal(quant_row_size(QUANT_Q4_0, 65), 0);
    assert_int_equal(quant_row_size(QUANT_F16, 3), 6);
    assert_int_equal(quant_row_size(QUANT_Q4_K, 512), 288);
    assert_non_null(quant_isa());
}

/* ---- quantize -> dequantize -------------------------------------------------- */

/* Worst-case error of one element, from the block's range: rounding to the
 * grid (half a step; a full step at the clamped end of the symmetric types),
 * plus the f16 rounding of the scale and the minimum. */
static float error_bound(enum quant_type t, const float *x, int n)
{
    float amax = 0, mn = x[0], mx = x[0];
    for (int i = 0; i < n; i++) {
        amax = fmaxf(amax, fabsf(x[i]));
        mn = fminf(mn, x[i]);
        mx = fmaxf(mx, x[i]);
    }
    const float f16eps = 0x1p-10f;
    const float sub = 130 * 0x1p-25f; /* a subnormal f16 scale/min: half an ulp of 2^-24, times |q| <= 128 */
    switch (t) {
    case QUANT_F32: return 0;
    case QUANT_F16: return amax * 0x1p-11f + 0x1p-25f;
    case QUANT_BF16: return amax * 0x1p-8f;
    case QUANT_Q8_0: return amax / 127 * (0.5f + 128 * f16eps) + sub;
    case QUANT_Q4_0: return amax / 8 * (1.0f + 16 * f16eps) + sub;
    case QUANT_Q5_0: return amax / 16 * (1.0f + 32 * f16eps) + sub;
    case QUANT_Q4_1: return (mx - mn) / 15 * (0.5f + 16 * f16eps) + fabsf(mn) * f16eps + sub;
    case QUANT_Q5_1: return (mx - mn) / 31 * (0.5f + 32 * f16eps) + fabsf(mn) * f16eps + sub;
    /* the fitted scale maps amax within a level or so of +-127 or 113; the
     * levels are up to 24 apart, and the far end (113) clips up to 14 levels */
    case QUANT_IQ4_NL: return amax * (14.0f / 100) * (1.0f + 16 * f16eps) + sub;
    /* the plain quantizer maps amax onto +-127; the widest gap (79..127) is 48 levels */
    case QUANT_IQ3_NL: return amax * (24.0f / 127) * (1.0f + 16 * f16eps) + amax * f16eps + sub;
    default: return INFINITY;
    }
}

static void test_quantize_error_bounds(void **state)
{
    (void)state;
    const int n = 4096;
    float *x = malloc(n * sizeof(float)), *y = malloc(n * sizeof(float));
    void *q = malloc(n * 4);
    for (size_t ti = 0; ti < N_ROW_TYPES; ti++) {
        const struct quant_traits *tr = quant_traits_scalar(row_type(ti));
        for (int rep = 0; rep < 3; rep++) {
            fill_random(x, n, rep == 0 ? 1.0f : rep == 1 ? 100.0f : 1e-3f);
            if (rep == 2)
                for (int i = 0; i < 32; i++)
                    x[i] = 0; /* an all-zero block */
            tr->from_float(x, q, n);
            tr->to_float(q, y, n);
            const int bs = tr->block_elems > 1 ? tr->block_elems : 32;
            for (int b = 0; b < n / bs; b++) {
                float bound = error_bound(row_type(ti), x + b * bs, bs);
                for (int i = b * bs; i < (b + 1) * bs; i++) {
                    if (!(fabsf(x[i] - y[i]) <= bound))
                        fail_msg("%s: x[%d]=%g back as %g, bound %g", tr->name, i, x[i], y[i], bound);
                }
            }
        }
    }
    free(x);
    free(y);
    free(q);
}

/* The table's (possibly SIMD) conversions equal the scalar references bit
 * for bit, on lengths with a vector tail. */
static void test_best_conversions_match_scalar(void **state)
{
    (void)state;
    const int64_t sizes[] = {32, 96, 4096 + 32};
    float x[4096 + 64], a[4096 + 64], b[4096 + 64];
    uint8_t qa[4 * (4096 + 64)], qb[4 * (4096 + 64)];
    for (size_t ti = 0; ti < N_ROW_TYPES; ti++) {
        const struct quant_traits *best = quant_traits(row_type(ti)), *ref = quant_traits_scalar(row_type(ti));
        for (size_t si = 0; si < 3; si++) {
            int64_t n = sizes[si] + (best->block_elems == 1 ? 7 : 0);
            fill_random(x, n, 10.0f);
            size_t bytes = quant_row_size(row_type(ti), n);
            best->from_float(x, qa, n);
            ref->from_float(x, qb, n);
            assert_memory_equal(qa, qb, bytes);
            best->to_float(qa, a, n);
            ref->to_float(qa, b, n);
            assert_memory_equal(a, b, n * sizeof(float));
        }
    }
}

/* Known ggml results on a fixed block: q8_0 of 0..31 / 31. */
static void test_q8_0_exact_values(void **state)
{
    (void)state;
    float x[32];
    for (int i = 0; i < 32; i++)
        x[i] = (float)(i - 16) / 16.0f;
    block_q8_0 b;
    quant_traits_scalar(QUANT_Q8_0)->from_float(x, &b, 32);
    assert_int_equal(b.qs[0], -127);
    assert_int_equal(b.qs[31], 119); /* 15/16 * 127 = 119.06 */
    assert_int_equal(b.qs[24], 64);  /* 0.5 * 127 = 63.5 -> away from zero */
    assert_int_equal(b.qs[8], -64);
}

/* The SIMD Q8_0 quantizers on the inputs where rounding is delicate: exact
 * ties (k + 0.5 after the scale), values just below a tie, zeros, negative
 * zeros, a spread of magnitudes. (No NaN: the reference's cast of it is
 * undefined.) */
static void check_q8_0_quantizer_against(quant_from_float_fn q, quant_from_float_fn ref)
{
    enum { N = 32 * 8 };
    float x[N];
    for (int i = 0; i < 32; i++) {
        x[i] = (float)(i - 16) / 16.0f;                      /* ties at 63.5 */
        x[32 + i] = (float)(2 * i - 31) * 0.5f;              /* +-0.5 steps, amax 15.5 */
        x[64 + i] = i == 0 ? 127.0f : nextafterf((float)(i - 16) + 0.5f, 0.0f);
        x[96 + i] = 0.0f;
        x[128 + i] = (float)i * 0.25f;
        x[160 + i] = ldexpf((float)(i + 1), i - 16) * (i % 2 ? -1.0f : 1.0f);
        x[192 + i] = i == 31 ? -2.0f : 1.0f;
        x[224 + i] = -0.0f;
    }
    block_q8_0 got[N / 32], want[N / 32];
    q(x, got, N);
    ref(x, want, N);
    assert_memory_equal(got, want, sizeof got);
}

static void check_q8_0_quantizer(quant_from_float_fn q) { check_q8_0_quantizer_against(q, quant_q8_0_from_float_ref); }

static void test_q8_0_simd_quantizer_edges(void **state)
{
    (void)state;
    check_q8_0_quantizer(quant_traits(QUANT_Q8_0)->from_float);
#if defined(QUANT_HAVE_AVX2)
    check_q8_0_quantizer(quant_q8_0_from_float_avx2);
#endif
}

/* The activation quantizer (ggml-cpu's x86 rounding: x * (127 / amax), ties
 * to even) in every form this build has, against its scalar twin, on the
 * same edges and on random rows; and the ties it rounds to even where the
 * weight quantizer rounds away from zero. */
static void test_q8_0_act_quantizer(void **state)
{
    (void)state;
    check_q8_0_quantizer_against(quant_q8_0_act_from_float, quant_q8_0_act_from_float_ref);
#if defined(QUANT_HAVE_AVX2)
    check_q8_0_quantizer_against(quant_q8_0_act_from_float_avx2, quant_q8_0_act_from_float_ref);
#endif
    enum { N = 32 * 64 };
    static float x[N];
    for (int i = 0; i < N; i++)
        x[i] = (float)((i * 7919) % 2003 - 1001) / 97.0f;
    block_q8_0 got[N / 32], want[N / 32];
    quant_q8_0_act_from_float(x, got, N);
    quant_q8_0_act_from_float_ref(x, want, N);
    assert_memory_equal(got, want, sizeof got);
    float t[32] = {127.0f, 62.5f, -62.5f, 61.5f}; /* amax 127: the multiplier is exactly 1 */
    block_q8_0 act, wgt;
    quant_q8_0_act_from_float_ref(t, &act, 32);
    quant_q8_0_from_float_ref(t, &wgt, 32);
    assert_int_equal(act.qs[1], 62), assert_int_equal(wgt.qs[1], 63);
    assert_int_equal(act.qs[2], -62), assert_int_equal(wgt.qs[2], -63);
    assert_int_equal(act.qs[3], 62), assert_int_equal(wgt.qs[3], 62);
}

/* ---- vec_dot: SIMD vs scalar --------------------------------------------------- */

typedef void (*dot_fn)(int, float *, const void *, const void *);
struct dot_case {
    enum quant_type wtype;
    dot_fn ref;
    dot_fn simd[2];
    const char *isa[2];
};

#define CASE(t, stem)                                                                      \
    {t, quant_vec_dot_##stem##_ref, {SIMD_AVX2(stem), SIMD_AVX512(stem)}, {"avx2", "avx512"}}
#if defined(QUANT_HAVE_AVX2)
#define SIMD_AVX2(stem) quant_vec_dot_##stem##_avx2
#else
#define SIMD_AVX2(stem) NULL
#endif
#if defined(QUANT_HAVE_AVX512)
#define SIMD_AVX512(stem) quant_vec_dot_##stem##_avx512
#else
#define SIMD_AVX512(stem) NULL
#endif

static const struct dot_case k_dots[] = {
    CASE(QUANT_F32, f32), CASE(QUANT_F16, f16), CASE(QUANT_BF16, bf16),
    CASE(QUANT_Q4_0, q4_0_q8_0), CASE(QUANT_Q4_1, q4_1_q8_1), CASE(QUANT_Q5_0, q5_0_q8_0),
    CASE(QUANT_Q5_1, q5_1_q8_1), CASE(QUANT_Q8_0, q8_0_q8_0),
};

/* The integer block dots are exact in every kernel; the float sum over blocks
 * (or over elements, for float types) may be reordered. Tolerance: each of the
 * (n/32 + 2) additions can lose 2^-24 of the running magnitude, bounded by
 * sum |x_i * y_i| of the dequantized values. */
static double abs_dot(const float *x, const float *y, int n)
{
    double s = 0;
    for (int i = 0; i < n; i++)
        s += fabs((double)x[i] * y[i]);
    return s;
}

static void test_vec_dot_simd_vs_scalar(void **state)
{
    (void)state;
    const int sizes[] = {32, 64, 96, 160, 4096 + 32, 4096 + 64, 33, 47};
    const int nmax = 4096 + 64;
    float *x = malloc(nmax * sizeof(float)), *y = malloc(nmax * sizeof(float));
    float *xd = malloc(nmax * sizeof(float)), *yd = malloc(nmax * sizeof(float));
    void *qx = malloc(nmax * 4), *qy = malloc(nmax * 4);
    int checked = 0;
    for (size_t c = 0; c < sizeof k_dots / sizeof k_dots[0]; c++) {
        const struct dot_case *dc = &k_dots[c];
        const struct quant_traits *wt = quant_traits_scalar(dc->wtype);
        const struct quant_traits *yt = quant_traits_scalar(wt->vec_dot_type);
        for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
            int n = sizes[si];
            if (n % wt->block_elems)
                continue;
            for (int rep = 0; rep < 4; rep++) {
                fill_random(x, n, rep == 3 ? 50.0f : 1.0f);
                fill_random(y, n, 1.0f);
                wt->from_float(x, qx, n);
                yt->from_float(y, qy, n);
                wt->to_float(qx, xd, n);
                yt->to_float(qy, yd, n);
                float want;
                dc->ref(n, &want, qx, qy);
                double tol = (n / 32.0 + 2) * 0x1p-23 * abs_dot(xd, yd, n) + 1e-30;
                if (wt->vec_dot_type == QUANT_Q8_1)
                    tol += (n / 32.0 + 2) * 0x1p-22 * abs_dot(xd, yd, n); /* + min * s terms */
                for (int k = 0; k < 2; k++) {
                    if (!dc->simd[k])
                        continue;
                    float got;
                    dc->simd[k](n, &got, qx, qy);
                    if (!(fabs((double)got - want) <= tol))
                        fail_msg("%s %s n=%d: got %.9g want %.9g (tol %.3g)", wt->name, dc->isa[k], n, got,
                                 want, tol);
                    checked++;
                }
            }
        }
    }
    print_message("checked %d SIMD dots against scalar (isa %s)\n", checked, quant_isa());
    free(x);
    free(y);
    free(xd);
    free(yd);
    free(qx);
    free(qy);
}

/* The quantized dot must equal the f32 dot of the dequantized values (the
 * integer path computes exactly that, up to float summation order). */
static void test_vec_dot_ref_vs_dequantized(void **state)
{
    (void)state;
    const int n = 256;
    float x[256], y[256], xd[256], yd[256];
    uint8_t qx[1024], qy[1024];
    for (size_t c = 0; c < sizeof k_dots / sizeof k_dots[0]; c++) {
        const struct quant_traits *wt = quant_traits_scalar(k_dots[c].wtype);
        const struct quant_traits *yt = quant_traits_scalar(wt->vec_dot_type);
        fill_random(x, n, 1.0f);
        fill_random(y, n, 1.0f);
        wt->from_float(x, qx, n);
        yt->from_float(y, qy, n);
        wt->to_float(qx, xd, n);
        yt->to_float(qy, yd, n);
        double want = 0;
        for (int i = 0; i < n; i++)
            want += (double)xd[i] * yd[i];
        float got;
        wt->vec_dot(n, &got, qx, qy);
        /* q8_1's s is sum * d rounded to f16: 2^-11 relative on the min term */
        double tol = 1e-5 * abs_dot(xd, yd, n) + (wt->vec_dot_type == QUANT_Q8_1 ? 2e-3 * abs_dot(xd, yd, n) : 0);
        if (!(fabs(got - want) <= tol))
            fail_msg("%s: %.9g vs %.9g", wt->name, got, want);
    }
}

/* ---- matmul vs naive f32 ----------------------------------------------------------- */

/* Y = X W^T with W dequantized and X rounded through the activation type
 * (in double), so the only difference left is float summation order. */
static void naive_matmul(enum quant_type wtype, const void *W, int64_t rows, int64_t cols, const float *X,
                         int64_t nt, double *Y, double *Yabs)
{
    const struct quant_traits *wt = quant_traits_scalar(wtype);
    const struct quant_traits *at = quant_traits_scalar(wt->vec_dot_type);
    float *w = malloc(rows * cols * sizeof(float)), *x = malloc(cols * sizeof(float));
    void *xq = malloc(cols * 4 + 64);
    size_t wrow = quant_row_size(wtype, cols);
    for (int64_t r = 0; r < rows; r++)
        wt->to_float((const uint8_t *)W + r * wrow, w + r * cols, cols);
    quant_from_float_fn quantize = quant_act_quantizer(wtype); /* as quant_matmul rounds them */
    for (int64_t t = 0; t < nt; t++) {
        (quantize ? quantize : at->from_float)(X + t * cols, xq, cols);
        at->to_float(xq, x, cols);
        for (int64_t r = 0; r < rows; r++) {
            double s = 0, a = 0;
            for (int64_t c = 0; c < cols; c++) {
                s += (double)w[r * cols + c] * x[c];
                a += fabs((double)w[r * cols + c] * x[c]);
            }
            Y[t * rows + r] = s;
            Yabs[t * rows + r] = a;
        }
    }
    free(w);
    free(x);
    free(xq);
}

/* Y (nt x rows) against the naive matmul of row-major W. */
static void expect_near_naive(enum quant_type wtype, const void *W, int64_t rows, int64_t cols, const float *X,
                              int64_t nt, const float *Y)
{
    const struct quant_traits *wt = quant_traits(wtype);
    double *want = malloc(nt * rows * sizeof(double)), *wabs = malloc(nt * rows * sizeof(double));
    naive_matmul(wtype, W, rows, cols, X, nt, want, wabs);
    /* exact integer block dots; float accumulation over cols/32 block terms
     * (or cols terms for float weights) in some order: (cols/16 + 8) * 2^-24
     * of sum |w*x|. q8_1 activations carry s = d*sum in f16: 2^-11 more. */
    for (int64_t i = 0; i < nt * rows; i++) {
        double tol = (cols / 16.0 + 8) * 0x1p-24 * wabs[i];
        if (wt->vec_dot_type == QUANT_Q8_1)
            tol += 0x1p-10 * wabs[i];
        if (!(fabs(Y[i] - want[i]) <= tol))
            fail_msg("%s rows=%lld cols=%lld tokens=%lld: Y[%lld][%lld]=%.9g want %.9g (tol %.3g)", wt->name,
                     (long long)rows, (long long)cols, (long long)nt, (long long)(i / rows), (long long)(i % rows),
                     Y[i], want[i], tol);
    }
    free(want);
    free(wabs);
}

/* rows x cols random weights of type wtype, row-major. */
static void *random_weights(enum quant_type wtype, int64_t rows, int64_t cols)
{
    const struct quant_traits *wt = quant_traits(wtype);
    size_t wrow = quant_row_size(wtype, cols);
    float *wf = malloc(rows * cols * sizeof(float));
    uint8_t *W = malloc(wrow * rows);
    assert_true(wf && W);
    fill_random(wf, rows * cols, 1.0f);
    for (int64_t r = 0; r < rows; r++)
        wt->from_float(wf + r * cols, W + r * wrow, cols);
    free(wf);
    return W;
}

static void check_matmul(threads_pool *pool, enum quant_type wtype, int64_t rows, int64_t cols, int64_t nt)
{
    float *X = malloc(nt * cols * sizeof(float)), *Y = malloc(nt * rows * sizeof(float));
    void *W = random_weights(wtype, rows, cols);
    fill_random(X, nt * cols, 3.0f);
    size_t ws = quant_matmul_work_size(wtype, cols, nt);
    assert_true(ws > 0);
    void *work = malloc(ws);
    assert_int_equal(quant_matmul(pool, W, wtype, rows, cols, X, nt, Y, work, ws), KS_OK);
    expect_near_naive(wtype, W, rows, cols, X, nt, Y);
    free(X);
    free(Y);
    free(W);
    free(work);
}

/* Extremes of the AVX2 tiles' int16 sums: Q8_0 -128 (which the quantizer
 * never writes) and Q4_0 nibbles 0 and 15 in row 0, against tokens 0 and 1
 * quantized to all +127 and all -127. */
static void put_extremes(enum quant_type wtype, uint8_t *W, int64_t cols, float *X)
{
    if (wtype == QUANT_Q8_0)
        memset(((block_q8_0 *)W)->qs, 0x80, QK8_0);
    else
        for (int i = 0; i < QK4_0 / 2; i++)
            ((block_q4_0 *)W)->qs[i] = i % 2 ? 0xff : 0x0f;
    for (int64_t c = 0; c < 2 * cols; c++)
        X[c] = c < cols ? 1.0f : -1.0f;
}

/* The AVX2 prefill tiles give their scalar twin's bits (AVX2-only build); the
 * twin is near the naive matmul (every build). */
static void check_avx2_twin(threads_pool *pool, enum quant_type wtype, int64_t rows, int64_t cols, int64_t nt)
{
    size_t bytes = quant_row_size(wtype, cols) * rows;
    uint8_t *W = random_weights(wtype, rows, cols), *P = malloc(bytes);
    float *X = malloc(nt * cols * sizeof(float)), *Yt = malloc(nt * rows * sizeof(float));
    float *Ys = malloc(nt * rows * sizeof(float));
    assert_true(P && X && Yt && Ys);
    fill_random(X, nt * cols, 3.0f);
    put_extremes(wtype, W, cols, X);
    memcpy(P, W, bytes);
    bool repacked = quant_repack_fits(wtype, rows, cols) && quant_repack(wtype, rows, cols, P) == KS_OK;
    assert_int_equal(quant_avx2_prefill_twin(W, wtype, false, rows, cols, X, nt, Yt), KS_OK);
    expect_near_naive(wtype, W, rows, cols, X, nt, Yt);
    if (repacked) {
        assert_int_equal(quant_avx2_prefill_twin(P, wtype, true, rows, cols, X, nt, Ys), KS_OK);
        assert_memory_equal(Ys, Yt, nt * rows * sizeof(float));
    }
#if defined(QUANT_HAVE_AVX2) && !defined(QUANT_HAVE_AVX512)
    void *work = malloc(quant_avx2_prefill_work(cols, nt));
    assert_non_null(work);
    for (int layout = 0; layout <= (repacked ? 1 : 0); layout++) {
        memset(Ys, 0xff, nt * rows * sizeof(float));
        assert_int_equal(quant_avx2_prefill(pool, layout ? P : W, wtype, layout, rows, cols, X, nt, Ys, work), KS_OK);
        if (memcmp(Ys, Yt, nt * rows * sizeof(float)) != 0)
            for (int64_t i = 0; i < nt * rows; i++)
                if (Ys[i] != Yt[i])
                    fail_msg("%s %lld x %lld, %lld tokens, %s: Y[%lld][%lld] = %.9g, twin %.9g", quant_type_name(wtype),
                             (long long)rows, (long long)cols, (long long)nt, layout ? "repacked" : "row-major",
                             (long long)(i / rows), (long long)(i % rows), Ys[i], Yt[i]);
    }
    free(work);
#else
    (void)pool;
#endif
    free(W), free(P), free(X), free(Yt), free(Ys);
}

static void test_avx2_prefill_matches_twin(void **state)
{
    (void)state;
    const int64_t shapes[][2] = {{5, 32}, {37, 96}, {64, 256}, {130, 64}, {72, 4096 + 32}};
    const int64_t tokens[] = {8, 9, 16, 17, 24, 33, 64};
    for (int th = 1; th <= 2; th++) {
        threads_pool *pool;
        assert_int_equal(threads_create(th, &pool), KS_OK);
        for (int ti = 0; ti < 2; ti++)
            for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
                for (size_t n = 0; n < sizeof tokens / sizeof tokens[0]; n++)
                    check_avx2_twin(pool, ti ? QUANT_Q8_0 : QUANT_Q4_0, shapes[s][0], shapes[s][1], tokens[n]);
        threads_free(pool);
    }
#if defined(QUANT_HAVE_AVX2) && !defined(QUANT_HAVE_AVX512)
    print_message("AVX2 prefill tiles checked against their scalar twin\n");
#else
    print_message("the AVX2 tiles' scalar twin checked (the tiles are compiled in AVX2-only builds)\n");
#endif
}

static void test_matmul_vs_naive(void **state)
{
    (void)state;
    const int64_t shapes[][2] = {{37, 96}, {64, 256}, {5, 32}, {130, 64}, {7, 160}};
    for (int th = 1; th <= 2; th++) {
        threads_pool *pool;
        assert_int_equal(threads_create(th, &pool), KS_OK);
        for (size_t ti = 0; ti < N_BASIC; ti++) {
            for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
                for (int64_t nt = 1; nt <= 17; nt++)
                    check_matmul(pool, k_basic[ti], shapes[s][0], shapes[s][1], nt);
                check_matmul(pool, k_basic[ti], shapes[s][0], shapes[s][1], 64);
            }
            check_matmul(pool, k_basic[ti], 33, 2048 + 32, 35);
        }
        /* k-quants: traits vec_dot / multi-token kernels below 8 tokens, the prefill tiles from 8 */
        const enum quant_type kq[] = {QUANT_Q2_K, QUANT_Q3_K, QUANT_Q4_K, QUANT_Q5_K, QUANT_Q6_K};
        for (size_t ti = 0; ti < sizeof kq / sizeof kq[0]; ti++) {
            for (int64_t nt = 1; nt <= 17; nt++)
                check_matmul(pool, kq[ti], 19, 512, nt);
            check_matmul(pool, kq[ti], 33, 256, 64);
            check_matmul(pool, kq[ti], 5, 768, 70);
            check_matmul(pool, kq[ti], 37, 256, 512);
        }
        threads_free(pool);
    }
}

static void test_matmul_rejects_bad_args(void **state)
{
    (void)state;
    float x[64] = {0}, y[4];
    uint8_t w[256] = {0}, work[4096];
    assert_int_equal(quant_matmul(NULL, w, QUANT_Q4_0, 2, 33, x, 1, y, work, sizeof work), KS_ERR_INVALID_ARG);
    assert_int_equal(quant_matmul(NULL, w, QUANT_Q8_1, 2, 32, x, 1, y, work, sizeof work), KS_ERR_UNSUPPORTED);
    assert_int_equal(quant_matmul(NULL, w, QUANT_Q4_0, 2, 32, x, 1, y, work, 1), KS_ERR_INVALID_ARG);
    assert_int_equal(quant_matmul(NULL, w, (enum quant_type)4, 2, 32, x, 1, y, work, sizeof work),
                     KS_ERR_UNSUPPORTED);
}

static void test_work_size_monotonic(void **state)
{
    (void)state;
    const enum quant_type types[] = {QUANT_F32, QUANT_F16, QUANT_BF16, QUANT_Q4_0, QUANT_Q4_1, QUANT_Q5_0,
                                     QUANT_Q5_1, QUANT_Q8_0, QUANT_Q2_K, QUANT_Q4_K, QUANT_Q6_K};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        size_t prev = 0;
        for (int64_t nt = 1; nt <= 600; nt++) {
            size_t ws = quant_matmul_work_size(types[i], 2048, nt);
            assert_true(ws >= prev);
            prev = ws;
        }
    }
    assert_int_equal(quant_matmul_work_size(QUANT_Q4_0, 33, 1), 0);
}

/* One expert's product the way a dense matrix of its kind is multiplied. */
static ks_status expert_matmul(threads_pool *pool, const void *W, enum quant_type wtype, bool repacked, int64_t rows,
                               int64_t cols, const float *X, int64_t n, float *Y, void *work, size_t ws)
{
    if (repacked)
        return quant_matmul_repacked(pool, W, wtype, rows, cols, X, n, Y, work, ws);
    return quant_matmul(pool, W, wtype, rows, cols, X, n, Y, work, ws);
}

/* quant_matmul_experts gives the bits of one quant_matmul per expert (and of
 * quant_swiglu over its rows): token counts per expert 0..20 reach the decode
 * and prefill kernels, grouped rows read X through x_rows (tokens shared by
 * several experts) or directly. Repacked (each expert's slice repacked on its
 * own), the bits of one quant_matmul_repacked per expert: the group kernels
 * up to 16 tokens, the prefill tiles above. */
static void check_experts_glu(threads_pool *pool, enum quant_type wtype, int64_t rows, int64_t cols, int n_expert,
                              const int *counts, bool pair, bool repacked, bool bias, enum quant_glu glu)
{
    const struct quant_traits *wt = quant_traits(wtype);
    size_t wrow = quant_row_size(wtype, cols), stride = wrow * (size_t)rows;
    int32_t start[17] = {0};
    for (int e = 0; e < n_expert; e++)
        start[e + 1] = start[e] + counts[e];
    int64_t G = start[n_expert], n_x = pair ? 23 : G;
    uint8_t *W = malloc(stride * n_expert), *W2 = malloc(stride * n_expert);
    float *wf = malloc(cols * sizeof(float)), *X = malloc(n_x * cols * sizeof(float));
    float *xg = malloc(G * cols * sizeof(float));
    float *Y = malloc(G * rows * sizeof(float)), *Y2 = malloc(G * rows * sizeof(float));
    float *R = malloc(G * rows * sizeof(float)), *R2 = malloc(G * rows * sizeof(float));
    int32_t *x_rows = malloc(G * sizeof(int32_t));
    for (int64_t r = 0; r < rows * n_expert; r++) {
        fill_random(wf, cols, 1.0f);
        wt->from_float(wf, W + r * wrow, cols);
        fill_random(wf, cols, 1.0f);
        wt->from_float(wf, W2 + r * wrow, cols);
    }
    for (int e = 0; e < n_expert && repacked; e++) {
        assert_int_equal(quant_repack(wtype, rows, cols, W + e * stride), KS_OK);
        assert_int_equal(quant_repack(wtype, rows, cols, W2 + e * stride), KS_OK);
    }
    fill_random(X, n_x * cols, 3.0f);
    for (int64_t g = 0; g < G; g++)
        x_rows[g] = pair ? (int32_t)(rnd32() % n_x) : (int32_t)g;
    size_t ws = quant_matmul_experts_work_size(wtype, cols, n_x, G);
    for (int64_t n = 1; n <= G; n++) {
        size_t w1 = quant_matmul_work_size(wtype, cols, n);
        ws = w1 > ws ? w1 : ws;
    }
    void *work = malloc(ws);
    struct quant_moe_mm p = {
        .wtype = wtype, .rows = rows, .cols = cols, .W = W, .W2 = pair ? W2 : NULL, .stride = stride,
        .n_expert = n_expert, .start = start, .X = X, .x_rows = pair ? x_rows : NULL, .n_x = n_x, .Y = Y,
        .Y2 = pair ? Y2 : NULL, .swiglu = pair, .repacked = repacked, .glu = pair ? glu : QUANT_GLU_SILU,
    };
    float *B = malloc(n_expert * rows * sizeof(float)), *B2 = malloc(n_expert * rows * sizeof(float));
    fill_random(B, n_expert * rows, 2.0f);
    fill_random(B2, n_expert * rows, 2.0f);
    if (bias)
        p.B = B, p.B2 = pair ? B2 : NULL;
    assert_int_equal(quant_matmul_experts(pool, &p, work, ws), KS_OK);
    for (int64_t g = 0; g < G; g++)
        memcpy(xg + g * cols, X + (int64_t)x_rows[g] * cols, cols * sizeof(float));
    for (int e = 0; e < n_expert; e++) {
        int64_t n = counts[e], t0 = start[e];
        if (!n)
            continue;
        assert_int_equal(expert_matmul(pool, W + e * stride, wtype, repacked, rows, cols, xg + t0 * cols, n,
                                       R + t0 * rows, work, ws), KS_OK);
        for (int64_t i = 0; i < n * rows && bias; i++)
            R[t0 * rows + i] += B[e * rows + i % rows];
        if (pair) {
            assert_int_equal(expert_matmul(pool, W2 + e * stride, wtype, repacked, rows, cols, xg + t0 * cols, n,
                                           R2 + t0 * rows, work, ws), KS_OK);
            for (int64_t i = 0; i < n * rows && bias; i++)
                R2[t0 * rows + i] += B2[e * rows + i % rows];
            if (glu == QUANT_GLU_OAI)
                quant_swiglu_oai(R + t0 * rows, R2 + t0 * rows, n * rows);
            else if (glu == QUANT_GLU_GELU)
                quant_geglu(R + t0 * rows, R2 + t0 * rows, n * rows);
            else
                quant_swiglu(R + t0 * rows, R2 + t0 * rows, n * rows);
        }
    }
    for (int64_t i = 0; i < G * rows; i++)
        if (memcmp(&Y[i], &R[i], sizeof(float)))
            fail_msg("%s rows=%lld cols=%lld pair=%d repacked=%d: grouped row %lld col %lld = %.9g, per expert %.9g",
                     wt->name, (long long)rows, (long long)cols, pair, repacked, (long long)(i / rows),
                     (long long)(i % rows), Y[i], R[i]);
    free(W), free(W2), free(wf), free(X), free(xg), free(Y), free(Y2), free(R), free(R2), free(x_rows), free(work);
    free(B), free(B2);
}

static void check_experts(threads_pool *pool, enum quant_type wtype, int64_t rows, int64_t cols, int n_expert,
                          const int *counts, bool pair, bool repacked)
{
    check_experts_glu(pool, wtype, rows, cols, n_expert, counts, pair, repacked, false, QUANT_GLU_SILU);
}

/* gpt-oss's experts: per-expert biases before the activation, its clamped
 * SwiGLU, and the down projection's bias alone (no pair). */
static void test_matmul_experts_bias_oai(void **state)
{
    (void)state;
    const int counts[][8] = {{1, 0, 0, 1, 0, 0, 0, 1}, {9, 0, 16, 17, 20, 0, 4, 1}};
    const enum quant_type types[] = {QUANT_F32, QUANT_Q8_0, QUANT_Q4_0, QUANT_MXFP4};
    const int R = quant_repack_rows();
    for (int th = 1; th <= 2; th++) {
        threads_pool *pool;
        assert_int_equal(threads_create(th, &pool), KS_OK);
        for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++)
            for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++)
                for (int pair = 0; pair < 2; pair++) {
                    check_experts_glu(pool, types[ti], 80, 96, 8, counts[c], pair, false, true, QUANT_GLU_OAI);
                    check_experts_glu(pool, types[ti], 144, 2048 + 32, 8, counts[c], pair, false, true,
                                      pair ? QUANT_GLU_OAI : QUANT_GLU_SILU);
                    if (types[ti] != QUANT_F32)
                        check_experts_glu(pool, types[ti], 5 * R, 96, 8, counts[c], pair, true, true, QUANT_GLU_OAI);
                }
        threads_free(pool);
    }
}

/* A dense FFN's decode step as model_forward runs it: gate and up as one
 * expert with Gemma's GeGLU fused into the region, the bits of two
 * quant_matmul and one quant_geglu (gemma3's q5_0 gate/up repacked, and the
 * q4_0, q8_0 and k-quant cases). */
static void test_matmul_experts_geglu(void **state)
{
    (void)state;
    const int counts[][1] = {{1}, {2}, {3}};
    const enum quant_type types[] = {QUANT_Q5_0, QUANT_Q4_0, QUANT_Q8_0, QUANT_Q4_K, QUANT_F32};
    const int R = quant_repack_rows();
    for (int th = 1; th <= 2; th++) {
        threads_pool *pool;
        assert_int_equal(threads_create(th, &pool), KS_OK);
        for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++)
            for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
                check_experts_glu(pool, types[ti], 144, 512, 1, counts[c], true, false, false, QUANT_GLU_GELU);
                if (quant_repack_fits(types[ti], 9 * R, 512)) /* k-quants: not in a portable build */
                    check_experts_glu(pool, types[ti], 9 * R, 512, 1, counts[c], true, true, false,
                                      QUANT_GLU_GELU);
            }
        threads_free(pool);
    }
}

/* One token's gate/up/GLU region that also packs its output for a k-quant
 * down (quant_moe_mm.Yq): the same Y, its packed row the bits of
 * quant_act_quantizer on the whole row; quant_matmul_packed on it the bits
 * of quant_matmul(_repacked) on Y. */
static void check_packs_next_input(threads_pool *pool, enum quant_type gtype, enum quant_type dtype, bool repacked,
                                   enum quant_glu glu)
{
    const int64_t F = 3 * QK_K, D = QK_K, drows = 5 * quant_repack_rows();
    int32_t start[2] = {0, 1};
    uint8_t *Wg = random_weights(gtype, F, D), *Wu = random_weights(gtype, F, D);
    uint8_t *Wd = random_weights(dtype, drows, F);
    bool rp_g = repacked && quant_repack_fits(gtype, F, D), rp_d = repacked && quant_repack_fits(dtype, drows, F);
    if (rp_g) {
        assert_int_equal(quant_repack(gtype, F, D, Wg), KS_OK);
        assert_int_equal(quant_repack(gtype, F, D, Wu), KS_OK);
    }
    if (rp_d)
        assert_int_equal(quant_repack(dtype, drows, F, Wd), KS_OK);
    size_t qb = quant_matmul_packed_bytes(dtype, F), ws = quant_matmul_experts_work_size(gtype, D, 1, 1);
    size_t wd = quant_matmul_work_size(dtype, F, 1);
    ws = ws > wd ? ws : wd;
    float *X = malloc(D * sizeof(float)), *Y = malloc(F * sizeof(float)), *Y2 = malloc(F * sizeof(float));
    float *R = malloc(F * sizeof(float)), *R2 = malloc(F * sizeof(float));
    float *yd = malloc(drows * sizeof(float)), *rd = malloc(drows * sizeof(float));
    uint8_t *Yq = malloc(qb), *Rq = malloc(qb);
    void *work = malloc(ws);
    assert_true(X && Y && Y2 && R && R2 && yd && rd && Yq && Rq && work);
    fill_random(X, D, 3.0f);
    struct quant_moe_mm p = {.wtype = gtype, .rows = F, .cols = D, .W = Wg, .W2 = Wu,
                             .stride = quant_row_size(gtype, D) * (size_t)F, .n_expert = 1, .start = start, .X = X,
                             .n_x = 1, .Y = R, .Y2 = R2, .swiglu = true, .repacked = rp_g, .glu = glu};
    assert_int_equal(quant_matmul_experts(pool, &p, work, ws), KS_OK);
    quant_act_quantizer(dtype)(R, Rq, F);
    p.Y = Y, p.Y2 = Y2, p.Yq = Yq, p.yq_type = dtype;
    assert_true(quant_matmul_takes_packed(dtype, rp_d, F));
    assert_int_equal(quant_matmul_experts(pool, &p, work, ws), KS_OK);
    assert_memory_equal(Y, R, F * sizeof(float));
    assert_memory_equal(Yq, Rq, qb);
    assert_int_equal(quant_matmul_packed(pool, Wd, dtype, rp_d, drows, F, Yq, yd), KS_OK);
    assert_int_equal(rp_d ? quant_matmul_repacked(pool, Wd, dtype, drows, F, R, 1, rd, work, ws)
                          : quant_matmul(pool, Wd, dtype, drows, F, R, 1, rd, work, ws), KS_OK);
    assert_memory_equal(yd, rd, drows * sizeof(float));
    free(Wg), free(Wu), free(Wd), free(X), free(Y), free(Y2), free(R), free(R2), free(yd), free(rd), free(Yq);
    free(Rq), free(work);
}

static void test_matmul_experts_packs_next_input(void **state)
{
    (void)state;
    const enum quant_type gtypes[] = {QUANT_Q5_0, QUANT_Q4_0, QUANT_Q4_K};
    const enum quant_type dtypes[] = {QUANT_Q6_K, QUANT_Q4_K, QUANT_Q5_K};
    for (int th = 1; th <= 3; th++) {
        threads_pool *pool;
        assert_int_equal(threads_create(th, &pool), KS_OK);
        for (size_t i = 0; i < sizeof gtypes / sizeof gtypes[0]; i++)
            for (int rp = 0; rp < 2; rp++)
                check_packs_next_input(pool, gtypes[i], dtypes[i], rp, i == 1 ? QUANT_GLU_SILU : QUANT_GLU_GELU);
        threads_free(pool);
    }
    /* refused: a matrix that does not read Q8_K rows, a packed output of two experts */
    float x[QK_K] = {0}, y[QK_K];
    uint8_t w[4096] = {0}, q[1024], work[65536];
    assert_false(quant_matmul_takes_packed(QUANT_Q4_0, false, QK_K));
    assert_int_equal(quant_matmul_packed(NULL, w, QUANT_Q4_0, false, 1, QK_K, q, y), KS_ERR_INVALID_ARG);
    int32_t start[3] = {0, 1, 1};
    struct quant_moe_mm p = {.wtype = QUANT_Q4_0, .rows = QK_K, .cols = 32, .W = w, .W2 = w,
                             .stride = QK_K * sizeof(block_q4_0), .n_expert = 2, .start = start, .X = x, .n_x = 1,
                             .Y = y, .Y2 = y, .swiglu = true, .Yq = q, .yq_type = QUANT_Q4_K};
    assert_int_equal(quant_matmul_experts(NULL, &p, work, sizeof work), KS_ERR_INVALID_ARG);
}

static void test_matmul_experts_vs_per_expert(void **state)
{
    (void)state;
    const int counts[][8] = {{1, 0, 0, 1, 0, 0, 0, 1}, {2, 3, 0, 7, 8, 1, 0, 5}, {9, 0, 16, 17, 20, 0, 4, 1}};
    const enum quant_type types[] = {QUANT_F32, QUANT_F16, QUANT_BF16, QUANT_Q4_0, QUANT_Q4_1, QUANT_Q5_0,
                                     QUANT_Q8_0, QUANT_Q2_K, QUANT_Q3_K, QUANT_Q4_K, QUANT_Q5_K, QUANT_Q6_K};
    for (int th = 1; th <= 2; th++) {
        threads_pool *pool;
        assert_int_equal(threads_create(th, &pool), KS_OK);
        for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
            bool kq = types[ti] >= QUANT_Q2_K && types[ti] <= QUANT_Q6_K;
            for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++)
                for (int pair = 0; pair < 2; pair++) {
                    check_experts(pool, types[ti], 80, kq ? 512 : 96, 8, counts[c], pair, false);
                    check_experts(pool, types[ti], 144, kq ? 256 : 2048 + 32, 8, counts[c], pair, false);
                }
        }
        threads_free(pool);
    }
}

/* Repacked Q4_0 / Q8_0 / MXFP4 / Q5_1 experts, as the model loader makes them, with
 * and without row-major tail rows past the last whole group (IQ4_NL runs
 * MXFP4's paths, Q5_0 Q5_1's: test_quant_repack checks their kernels). */
static void test_matmul_experts_repacked_vs_per_expert(void **state)
{
    (void)state;
    const int counts[][8] = {{1, 0, 0, 1, 0, 0, 0, 1}, {2, 3, 0, 7, 8, 1, 0, 5}, {9, 0, 16, 17, 20, 0, 4, 1}};
    const enum quant_type types[] = {QUANT_Q4_0, QUANT_Q8_0, QUANT_MXFP4, QUANT_Q5_1};
    const int R = quant_repack_rows();
    for (int th = 1; th <= 2; th++) {
        threads_pool *pool;
        assert_int_equal(threads_create(th, &pool), KS_OK);
        for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++)
            for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++)
                for (int pair = 0; pair < 2; pair++) {
                    check_experts(pool, types[ti], 5 * R, 96, 8, counts[c], pair, true);
                    check_experts(pool, types[ti], 9 * R, 2048 + 32, 8, counts[c], pair, true);
                    /* row-major tail rows; without the pair: the fused SwiGLU matches
                     * quant_swiglu only for rows a multiple of 16 (quant.h) */
                    if (!pair)
                        check_experts(pool, types[ti], 5 * R + 3, 96, 8, counts[c], false, true);
                }
        threads_free(pool);
    }
}

static void test_matmul_experts_rejects_bad_args(void **state)
{
    (void)state;
    float x[64] = {0}, y[64];
    uint8_t w[1024] = {0}, work[65536];
    int32_t start[3] = {0, 1, 1};
    struct quant_moe_mm p = {.wtype = QUANT_Q4_0, .rows = 2, .cols = 32, .W = w, .stride = 2 * sizeof(block_q4_0),
                             .n_expert = 2, .start = start, .X = x, .n_x = 1, .Y = y};
    assert_int_equal(quant_matmul_experts(NULL, &p, work, sizeof work), KS_OK);
    p.swiglu = true; /* needs W2 */
    assert_int_equal(quant_matmul_experts(NULL, &p, work, sizeof work), KS_ERR_INVALID_ARG);
    p.swiglu = false, p.glu = QUANT_GLU_OAI; /* the clamped SwiGLU needs swiglu */
    assert_int_equal(quant_matmul_experts(NULL, &p, work, sizeof work), KS_ERR_INVALID_ARG);
    p.glu = QUANT_GLU_SILU;
    p.n_x = 2; /* without x_rows, one X row per grouped row */
    assert_int_equal(quant_matmul_experts(NULL, &p, work, sizeof work), KS_ERR_INVALID_ARG);
    p.n_x = 1, p.stride = 1;
    assert_int_equal(quant_matmul_experts(NULL, &p, work, sizeof work), KS_ERR_INVALID_ARG);
    p.stride = 2 * sizeof(block_q4_0);
    assert_int_equal(quant_matmul_experts(NULL, &p, work, 1), KS_ERR_INVALID_ARG);
    p.repacked = true; /* 2 rows cannot be a repacked group */
    assert_int_equal(quant_matmul_experts(NULL, &p, work, sizeof work), KS_ERR_INVALID_ARG);
    p.repacked = false, p.wtype = QUANT_Q8_1;
    assert_int_equal(quant_matmul_experts(NULL, &p, work, sizeof work), KS_ERR_UNSUPPORTED);
}

/* quant_matmul_set: each matrix's Y has the bits of its own quant_matmul (or
 * quant_matmul_repacked), for decode batches (one region for all) and
 * prefill ones (one by one), float, Q4_0/Q8_0 (repacked or not, with tail
 * rows), k-quant and generic weights, a set whose matrices take different
 * kernels, and sets of different types (gemma3's Q4_K_M: q5_0 Q and K, q8_0
 * V), in a buffer of quant_matmul_set_work_size bytes exactly. */
static void check_set(threads_pool *pool, const enum quant_type *types, int64_t cols, const int64_t *rows,
                      const bool *repacked, int n, int64_t nt)
{
    struct quant_mm_out outs[QUANT_MM_SET_MAX] = {0};
    float *want[QUANT_MM_SET_MAX];
    for (int i = 0; i < n; i++)
        outs[i] = (struct quant_mm_out){.type = types[i], .rows = rows[i], .repacked = repacked[i]};
    size_t ws = quant_matmul_set_work_size(outs, n, cols, nt);
    void *work = malloc(ws);
    float *X = malloc((size_t)(nt * cols) * sizeof(float));
    assert_true(ws > 0 && work && X);
    fill_random(X, nt * cols, 2.0f);
    for (int i = 0; i < n; i++) {
        uint8_t *W = random_weights(types[i], rows[i], cols);
        if (repacked[i])
            assert_int_equal(quant_repack(types[i], rows[i], cols, W), KS_OK);
        want[i] = malloc((size_t)(nt * rows[i]) * sizeof(float));
        float *Y = malloc((size_t)(nt * rows[i]) * sizeof(float));
        assert_true(want[i] && Y);
        assert_int_equal(expert_matmul(pool, W, types[i], repacked[i], rows[i], cols, X, nt, want[i], work, ws),
                         KS_OK);
        outs[i].W = W, outs[i].Y = Y;
    }
    assert_int_equal(quant_matmul_set(pool, cols, outs, n, X, nt, work, ws), KS_OK);
    for (int i = 0; i < n; i++) {
        if (memcmp(outs[i].Y, want[i], (size_t)(nt * rows[i]) * sizeof(float)))
            fail_msg("%s: matrix %d of %d (%lld x %lld%s), %lld tokens: not the bits of its own matmul",
                     quant_type_name(types[i]), i, n, (long long)rows[i], (long long)cols,
                     repacked[i] ? ", repacked" : "", (long long)nt);
        free((void *)outs[i].W), free(outs[i].Y), free(want[i]);
    }
    if (ws > 1) /* a byte short is refused */
        assert_int_equal(quant_matmul_set(pool, cols, outs, n, X, nt, work, ws - 1), KS_ERR_INVALID_ARG);
    free(work), free(X);
}

static void test_matmul_set_is_each_matmul(void **state)
{
    (void)state;
    const enum quant_type types[] = {QUANT_F32, QUANT_F16, QUANT_Q4_0, QUANT_Q8_0, QUANT_Q5_0, QUANT_Q4_K, QUANT_Q6_K};
    const int64_t batches[] = {1, 2, 3, 5, 16, 17, 40};
    const int R = quant_repack_rows();
    const int64_t rows[] = {4 * R, 2 * R + 3, 3 * R, R};
    /* sets of several types, repacked where the build can (as the model loader does) */
    const enum quant_type mixes[][QUANT_MM_SET_MAX] = {
        {QUANT_Q5_0, QUANT_Q5_0, QUANT_Q8_0, QUANT_Q8_0}, /* gemma3's Q4_K_M */
        {QUANT_Q4_K, QUANT_Q6_K, QUANT_Q4_K, QUANT_Q8_0},
        {QUANT_Q8_0, QUANT_F16, QUANT_Q4_K, QUANT_Q8_0},
    };
    for (int th = 1; th <= 2; th++) {
        threads_pool *pool;
        assert_int_equal(threads_create(th, &pool), KS_OK);
        for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++)
            for (size_t b = 0; b < sizeof batches / sizeof batches[0]; b++) {
                bool rp = types[ti] == QUANT_Q4_0 || types[ti] == QUANT_Q8_0;
                const bool all[] = {rp, rp, rp, rp}, mixed[] = {rp, false, rp, false};
                const enum quant_type same[] = {types[ti], types[ti], types[ti], types[ti]};
                check_set(pool, same, 512, rows, all, 3, batches[b]);
                check_set(pool, same, 256, rows + 1, all, 1, batches[b]);
                if (rp)
                    check_set(pool, same, 256, rows, mixed, 4, batches[b]);
            }
        for (size_t mi = 0; mi < sizeof mixes / sizeof mixes[0]; mi++)
            for (size_t b = 0; b < sizeof batches / sizeof batches[0]; b++) {
                bool rp[QUANT_MM_SET_MAX];
                for (int i = 0; i < QUANT_MM_SET_MAX; i++)
                    rp[i] = quant_repack_fits(mixes[mi][i], rows[i], 512);
                check_set(pool, mixes[mi], 512, rows, rp, 3, batches[b]);
                check_set(pool, mixes[mi], 512, rows, rp, 4, batches[b]);
            }
        threads_free(pool);
    }
    float x[32] = {0}, y[4];
    uint8_t w[64] = {0}, work[4096];
    struct quant_mm_out out = {.W = w, .type = QUANT_Q8_0, .rows = 1, .Y = y};
    assert_int_equal(quant_matmul_set(NULL, 32, &out, 1, x, 1, work, sizeof work), KS_OK);
    assert_int_equal(quant_matmul_set(NULL, 32, &out, 0, x, 1, work, sizeof work), KS_ERR_INVALID_ARG);
    assert_int_equal(quant_matmul_set(NULL, 32, &out, QUANT_MM_SET_MAX + 1, x, 1, work, sizeof work),
                     KS_ERR_INVALID_ARG);
    out.repacked = true; /* one row cannot be a repacked group */
    assert_int_equal(quant_matmul_set(NULL, 32, &out, 1, x, 1, work, sizeof work), KS_ERR_INVALID_ARG);
    out.repacked = false, out.W = NULL;
    assert_int_equal(quant_matmul_set(NULL, 32, &out, 1, x, 1, work, sizeof work), KS_ERR_INVALID_ARG);
    out.W = w, out.type = QUANT_Q4_K; /* 32 columns are not a whole Q4_K block */
    assert_int_equal(quant_matmul_set(NULL, 32, &out, 1, x, 1, work, sizeof work), KS_ERR_INVALID_ARG);
}

/* The SIMD SwiGLU agrees with the libm reference over the whole useful range,
 * at every tail length, and has its scalar twin's bits (ggml's exponential
 * lane by lane; test_quant_kquants_ggml checks those against ggml itself). */
static void test_swiglu_simd_vs_scalar(void **state)
{
    (void)state;
    enum { N = 4099 };
    static float g[N], up[N], want[N], got[N], twin[N];
    for (int i = 0; i < N; i++) {
        g[i] = -100.0f + 200.0f * (float)i / N;
        up[i] = 0.5f + (float)(i % 7);
    }
    g[0] = 0.0f, g[1] = -0.0f, g[2] = 1e-20f, g[3] = -87.5f, g[4] = 88.5f;
    for (int n = 0; n <= N; n += n < 40 ? 1 : 613) {
        memcpy(want, g, sizeof g);
        memcpy(got, g, sizeof g);
        memcpy(twin, g, sizeof g);
        quant_swiglu_scalar(want, up, n);
        quant_swiglu(got, up, n);
        quant_swiglu_twin(twin, up, n);
        if (memcmp(got, twin, sizeof got))
            fail_msg("n=%d: quant_swiglu and its scalar twin differ", n);
        for (int i = 0; i < N; i++) {
            float tol = 1e-6f * fabsf(want[i]) + 1e-30f;
            if (!(fabsf(got[i] - want[i]) <= tol))
                fail_msg("n=%d i=%d g=%g: simd %.9g, scalar %.9g", n, i, (double)g[i], (double)got[i],
                         (double)want[i]);
        }
    }
}

/* The SIMD clamped SwiGLU agrees with the libm reference across and beyond
 * its clamps, at every tail length. */
static void test_swiglu_oai_simd_vs_scalar(void **state)
{
    (void)state;
    enum { N = 4099 };
    static float g[N], up[N], want[N], got[N];
    for (int i = 0; i < N; i++) {
        g[i] = -100.0f + 200.0f * (float)i / N;
        up[i] = -12.0f + 24.0f * (float)((i * 37) % N) / N;
    }
    g[0] = 0.0f, g[1] = -0.0f, g[2] = 1e-20f, g[3] = -51.5f, g[4] = 52.5f, g[5] = 7.0f, g[6] = 6.999f;
    up[7] = 7.0f, up[8] = -7.0f, up[9] = -1.0f;
    for (int n = 0; n <= N; n += n < 40 ? 1 : 613) {
        memcpy(want, g, sizeof g);
        memcpy(got, g, sizeof g);
        quant_swiglu_oai_scalar(want, up, n);
        quant_swiglu_oai(got, up, n);
        for (int i = 0; i < N; i++) {
            float tol = 1e-6f * fabsf(want[i]) + 1e-30f;
            if (!(fabsf(got[i] - want[i]) <= tol))
                fail_msg("n=%d i=%d g=%g up=%g: simd %.9g, scalar %.9g", n, i, (double)g[i], (double)up[i],
                         (double)got[i], (double)want[i]);
        }
    }
    /* the clamps: gate at 7 and up at +-7 */
    float g1[2] = {100.0f, 3.0f}, u1[2] = {100.0f, -100.0f};
    quant_swiglu_oai_scalar(g1, u1, 2);
    assert_float_equal(g1[0], 7.0f / (1.0f + expf(-1.702f * 7.0f)) * 8.0f, 0);
    assert_float_equal(g1[1], 3.0f / (1.0f + expf(-1.702f * 3.0f)) * -6.0f, 0);
}

static void test_get_row(void **state)
{
    (void)state;
    float x[3 * 64], y[64];
    fill_random(x, 3 * 64, 1.0f);
    block_q8_0 q[6];
    quant_traits(QUANT_Q8_0)->from_float(x, q, 3 * 64);
    assert_int_equal(quant_get_row(q, QUANT_Q8_0, 64, 2, y), KS_OK);
    for (int i = 0; i < 64; i++)
        assert_float_equal(y[i], quant_f16_to_f32(q[4 + i / 32].d) * q[4 + i / 32].qs[i % 32], 0);
    assert_int_equal(quant_get_row(q, QUANT_Q8_0, 65, 0, y), KS_ERR_INVALID_ARG);
    assert_int_equal(quant_get_row(q, QUANT_Q8_0, 64, -1, y), KS_ERR_INVALID_ARG);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_f16_roundtrip_all),
        cmocka_unit_test(test_f16_rounding_matches_hardware),
        cmocka_unit_test(test_bf16),
        cmocka_unit_test(test_names),
        cmocka_unit_test(test_quantize_error_bounds),
        cmocka_unit_test(test_q8_0_exact_values),
        cmocka_unit_test(test_q8_0_simd_quantizer_edges),
        cmocka_unit_test(test_q8_0_act_quantizer),
        cmocka_unit_test(test_kv_scale_search_never_worse),
        cmocka_unit_test(test_best_conversions_match_scalar),
        cmocka_unit_test(test_vec_dot_simd_vs_scalar),
        cmocka_unit_test(test_vec_dot_ref_vs_dequantized),
        cmocka_unit_test(test_matmul_vs_naive),
        cmocka_unit_test(test_avx2_prefill_matches_twin),
        cmocka_unit_test(test_matmul_rejects_bad_args),
        cmocka_unit_test(test_work_size_monotonic),
        cmocka_unit_test(test_matmul_experts_vs_per_expert),
        cmocka_unit_test(test_matmul_experts_repacked_vs_per_expert),
        cmocka_unit_test(test_matmul_experts_rejects_bad_args),
        cmocka_unit_test(test_matmul_set_is_each_matmul),
        cmocka_unit_test(test_get_row),
        cmocka_unit_test(test_swiglu_simd_vs_scalar),
        cmocka_unit_test(test_swiglu_oai_simd_vs_scalar),
        cmocka_unit_test(test_matmul_experts_bias_oai),
        cmocka_unit_test(test_matmul_experts_geglu),
        cmocka_unit_test(test_matmul_experts_packs_next_input),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
