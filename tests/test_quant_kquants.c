/* k-quants (Q2_K..Q6_K, Q8_K): dequantize against per-element formulas of
 * ggml's layouts, quantize round-trip error bounds, vec_dot scalar against
 * the dot of dequantized rows, and every SIMD kernel against the scalar one.
 *
 * Tolerances:
 *  - vec_dot vs double dot of dequantized rows, and SIMD vs scalar on random
 *    data: |a - b| <= 1e-5 * sum_i |x_i * y_i| (float rounding of per-block
 *    terms and of the summation order only; all integer sums are exact).
 *  - SIMD vs scalar with d = dmin = y.d = 1 and small Q8 values, where every
 *    partial sum is an integer below 2^24: bit-identical.
 *  - quantize round trip: RMS error / RMS(x) on N(0,1) data below a per-type
 *    bound (Q8_K additionally: every element within |d|/2). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "quant/kq_internal.h"
#include "support/skip.h"

/* ---- random numbers ---------------------------------------------------- */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
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
static void rng_bytes(void *p, size_t n)
{
    uint8_t *b = p;
    for (size_t i = 0; i < n; i++) b[i] = (uint8_t)rng_next();
}

/* ---- per-type description --------------------------------------------- */

struct ktype {
    const char *name;
    enum quant_type type;
    size_t bytes;
    size_t off_d, off_dmin; /* dmin offset == off_d for types without one */
    bool signed_d;          /* d may be negative (symmetric formats) */
    quant_to_float_fn deq;
    quant_from_float_fn quant;
    quant_vec_dot_fn scalar, avx2, avx512;
    double rt_bound; /* quantize round-trip RMS error / RMS(x) */
};

#if defined(KQ_HAVE_AVX2)
#define AVX2(t) quant_vec_dot_##t##_q8_K_avx2
#else
#define AVX2(t) NULL
#endif
#if defined(KQ_HAVE_AVX512)
#define AVX512(t) quant_vec_dot_##t##_q8_K_avx512
#else
#define AVX512(t) NULL
#endif

static const struct ktype ktypes[] = {
    {"q2_K", QUANT_Q2_K, sizeof(block_q2_K), offsetof(block_q2_K, d), offsetof(block_q2_K, dmin), false,
     quant_dequantize_row_q2_K, quant_quantize_row_q2_K, quant_vec_dot_q2_K_q8_K_scalar, AVX2(q2_K),
     AVX512(q2_K), 0.40},
    {"q3_K", QUANT_Q3_K, sizeof(block_q3_K), offsetof(block_q3_K, d), offsetof(block_q3_K, d), true,
     quant_dequantize_row_q3_K, quant_quantize_row_q3_K, quant_vec_dot_q3_K_q8_K_scalar, AVX2(q3_K),
     NULL, 0.20},
    {"q4_K", QUANT_Q4_K, sizeof(block_q4_K), offsetof(block_q4_K, d), offsetof(block_q4_K, dmin), false,
     quant_dequantize_row_q4_K, quant_quantize_row_q4_K, quant_vec_dot_q4_K_q8_K_scalar, AVX2(q4_K),
     AVX512(q4_K), 0.10},
    {"q5_K", QUANT_Q5_K, sizeof(block_q5_K), offsetof(block_q5_K, d), offsetof(block_q5_K, dmin), false,
     quant_dequantize_row_q5_K, quant_quantize_row_q5_K, quant_vec_dot_q5_K_q8_K_scalar, AVX2(q5_K),
     NULL, 0.05},
    {"q6_K", QUANT_Q6_K, sizeof(block_q6_K), offsetof(block_q6_K, d), offsetof(block_q6_K, d), true,
     quant_dequantize_row_q6_K, quant_quantize_row_q6_K, quant_vec_dot_q6_K_q8_K_scalar, AVX2(q6_K),
     NULL, 0.025},
};
#define N_KTYPES (sizeof ktypes / sizeof ktypes[0])

static const int test_sizes[] = {256, 512, 4096 + 256};

static void set_f16(void *blk, size_t off, float v)
{
    const quant_f16 h = kq_f32_to_f16(v);
    memcpy((uint8_t *)blk + off, &h, sizeof h);
}

/* Random bytes everywhere, then sane d/dmin (|d| <= 0.01). */
static void random_blocks(const struct ktype *kt, void *x, int nb)
{
    rng_bytes(x, kt->bytes * (size_t)nb);
    for (int i = 0; i < nb; i++) {
        uint8_t *blk = (uint8_t *)x + kt->bytes * (size_t)i;
        float d = 0.01f * rng_uniform();
        if (kt->signed_d && (rng_next() & 1)) d = -d;
        set_f16(blk, kt->off_d, d);
        if (kt->off_dmin != kt->off_d) set_f16(blk, kt->off_dmin, 0.01f * rng_uniform());
    }
}

static void fix_bsums(block_q8_K *y)
{
    for (int g = 0; g < QK_K / 16; g++) {
        int s = 0;
        for (int l = 0; l < 16; l++) s += y->qs[16 * g + l];
        y->bsums[g] = (int16_t)s;
    }
}

/* Q8_K rows with qs uniform in [-range, range] (range <= 128 means the full
 * int8 range) and consistent bsums. */
static void random_q8(block_q8_K *y, int nb, int range, float d)
{
    for (int i = 0; i < nb; i++) {
        for (int l = 0; l < QK_K; l++) {
            int v = (int)(rng_next() % (uint64_t)(2 * range + 1)) - range;
            y[i].qs[l] = (int8_t)(v < -128 ? -128 : v > 127 ? 127 : v);
        }
        y[i].d = d != 0 ? d : 0.001f + 0.01f * rng_uniform();
        fix_bsums(&y[i]);
    }
}

/* ---- independent per-element formulas of ggml's layouts ---------------- */

static float f16at(const uint8_t *blk, size_t off)
{
    quant_f16 h;
    memcpy(&h, blk + off, sizeof h);
    return kq_f16_to_f32(h);
}

static void k4_scale_min(const uint8_t *s, int j, int *sc, int *m)
{
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static float naive_elem(enum quant_type t, const void *vb, int e)
{
    const int half = e / 128, r = e % 128, quarter = r / 32, l = e % 32, g = e / 16;
    switch (t) {
    case QUANT_Q2_K: {
        const block_q2_K *b = vb;
        const int q = (b->qs[32 * half + l] >> (2 * quarter)) & 3;
        return kq_f16_to_f32(b->d) * (b->scales[g] & 15) * q - kq_f16_to_f32(b->dmin) * (b->scales[g] >> 4);
    }
    case QUANT_Q3_K: {
        const block_q3_K *b = vb;
        const int q = (b->qs[32 * half + l] >> (2 * quarter)) & 3;
        const int h = (b->hmask[l] >> (e / 32)) & 1;
        const int lo = g < 8 ? b->scales[g] & 15 : b->scales[g - 8] >> 4;
        const int sc = (lo | (((b->scales[8 + g % 4] >> (2 * (g / 4))) & 3) << 4)) - 32;
        return kq_f16_to_f32(b->d) * sc * (q - (h ? 0 : 4));
    }
    case QUANT_Q4_K: case QUANT_Q5_K: {
        const uint8_t *scales = t == QUANT_Q4_K ? ((const block_q4_K *)vb)->scales : ((const block_q5_K *)vb)->scales;
        const uint8_t *qs = t == QUANT_Q4_K ? ((const block_q4_K *)vb)->qs : ((const block_q5_K *)vb)->qs;
        const int sub = e / 32;
        int q = (qs[32 * (e / 64) + l] >> (4 * (sub & 1))) & 15;
        if (t == QUANT_Q5_K) q |= ((((const block_q5_K *)vb)->qh[l] >> sub) & 1) << 4;
        int sc, m;
        k4_scale_min(scales, sub, &sc, &m);
        return f16at(vb, 0) * sc * q - f16at(vb, 2) * m;
    }
    case QUANT_Q6_K: {
        const block_q6_K *b = vb;
        const int lo = (b->ql[64 * half + l + 32 * (quarter & 1)] >> (4 * (quarter >> 1))) & 15;
        const int hi = (b->qh[32 * half + l] >> (2 * quarter)) & 3;
        return kq_f16_to_f32(b->d) * b->scales[g] * ((lo | (hi << 4)) - 32);
    }
    default:
        return NAN;
    }
}

/* ---- tests --------------------------------------------------------------- */

static void test_dequantize_matches_layout(void **state)
{
    (void)state;
    for (size_t k = 0; k < N_KTYPES; k++) {
        const struct ktype *kt = &ktypes[k];
        const int nb = 8;
        uint8_t *x = malloc(kt->bytes * nb);
        float *y = malloc(sizeof(float) * QK_K * nb);
        random_blocks(kt, x, nb);
        kt->deq(x, y, (int64_t)QK_K * nb);
        for (int i = 0; i < nb; i++)
            for (int e = 0; e < QK_K; e++) {
                const float want = naive_elem(kt->type, x + kt->bytes * i, e);
                if (y[QK_K * i + e] != want) {
                    fail_msg("%s block %d elem %d: got %g want %g", kt->name, i, e, y[QK_K * i + e], want);
                }
            }
        free(x);
        free(y);
    }
}

static double rel_rms_roundtrip(const struct ktype *kt, const float *x, int n, float *out)
{
    void *q = malloc(kt->bytes * (size_t)(n / QK_K));
    kt->quant(x, q, n);
    kt->deq(q, out, n);
    double err = 0, ref = 0;
    for (int i = 0; i < n; i++) {
        err += (double)(out[i] - x[i]) * (out[i] - x[i]);
        ref += (double)x[i] * x[i];
    }
    free(q);
    return sqrt(err / ref);
}

static void test_quantize_roundtrip(void **state)
{
    (void)state;
    const int n = 64 * QK_K;
    float *x = malloc(sizeof(float) * n), *out = malloc(sizeof(float) * n);
    for (int i = 0; i < n; i++) x[i] = rng_normal() * (1.f + (float)(i / QK_K % 7)); /* varied scales */
    for (size_t k = 0; k < N_KTYPES; k++) {
        const double e = rel_rms_roundtrip(&ktypes[k], x, n, out);
        print_message("  %s round-trip rel RMS error %.4f (bound %.3f)\n", ktypes[k].name, e, ktypes[k].rt_bound);
        assert_true(e < ktypes[k].rt_bound);
    }
    /* asymmetric data (all positive with offset) exercises the mins */
    for (int i = 0; i < n; i++) x[i] = 3.f + rng_uniform();
    for (size_t k = 0; k < N_KTYPES; k++) {
        const double e = rel_rms_roundtrip(&ktypes[k], x, n, out);
        print_message("  %s offset data rel RMS error %.5f\n", ktypes[k].name, e);
        assert_true(e < ktypes[k].rt_bound);
    }
    /* all-zero input quantizes to zeros */
    memset(x, 0, sizeof(float) * QK_K);
    for (size_t k = 0; k < N_KTYPES; k++) {
        rel_rms_roundtrip(&ktypes[k], x, QK_K, out);
        for (int i = 0; i < QK_K; i++) assert_true(out[i] == 0.f);
    }
    free(x);
    free(out);
}

static void test_q8_K_quantize(void **state)
{
    (void)state;
    const int nb = 16;
    float *x = malloc(sizeof(float) * QK_K * nb), *out = malloc(sizeof(float) * QK_K * nb);
    block_q8_K *y = malloc(sizeof(block_q8_K) * nb);
    for (int i = 0; i < QK_K * nb; i++) x[i] = rng_normal() * (float)(1 + i / QK_K);
    memset(x + QK_K * 3, 0, sizeof(float) * QK_K); /* one all-zero block */
    quant_quantize_row_q8_K(x, y, QK_K * nb);
    quant_dequantize_row_q8_K(y, out, QK_K * nb);
    for (int i = 0; i < nb; i++) {
        float amax = 0, max = 0;
        for (int l = 0; l < QK_K; l++)
            if (fabsf(x[QK_K * i + l]) > amax) { amax = fabsf(x[QK_K * i + l]); max = x[QK_K * i + l]; }
        assert_true(y[i].d == (amax ? -max / 127.f : 0.f) || fabsf(y[i].d + max / 127.f) <= 1e-6f * amax);
        for (int l = 0; l < QK_K; l++) {
            assert_true(y[i].qs[l] >= -127 && y[i].qs[l] <= 127);
            assert_true(fabsf(out[QK_K * i + l] - x[QK_K * i + l]) <= fabsf(y[i].d) * 0.5001f + 1e-30f);
        }
        for (int g = 0; g < QK_K / 16; g++) {
            int s = 0;
            for (int l = 0; l < 16; l++) s += y[i].qs[16 * g + l];
            assert_int_equal(s, y[i].bsums[g]);
        }
    }
    free(x);
    free(out);
    free(y);
}

/* The SIMD Q8_K quantizer is bit-identical to the reference, ties included. */
#if defined(KQ_HAVE_AVX2)
static void check_q8_K_quantizer(quant_from_float_fn simd)
{
    const int nb = 32;
    float *x = malloc(sizeof(float) * QK_K * nb);
    block_q8_K *a = malloc(sizeof(block_q8_K) * nb), *b = malloc(sizeof(block_q8_K) * nb);
    for (int i = 0; i < QK_K * nb; i++) x[i] = rng_normal() * (float)(1 + i / QK_K);
    memset(x + QK_K * 2, 0, sizeof(float) * QK_K);
    /* block 5: scale exactly 1, halves everywhere -> round-half-even ties */
    for (int l = 0; l < QK_K; l++) x[QK_K * 5 + l] = (float)((int)(rng_next() % 253) - 126) + 0.5f;
    x[QK_K * 5 + 7] = -127.f;
    /* block 6: equal magnitudes of both signs; the first one sets the sign */
    for (int l = 0; l < QK_K; l++) x[QK_K * 6 + l] = (l % 3) ? 1.f : -2.f;
    x[QK_K * 6 + 200] = 2.f;
    memset(a, 0x55, sizeof(block_q8_K) * nb);
    memset(b, 0xAA, sizeof(block_q8_K) * nb);
    quant_quantize_row_q8_K(x, a, QK_K * nb);
    simd(x, b, QK_K * nb);
    assert_memory_equal(a, b, sizeof(block_q8_K) * nb);
    assert_true(a[6].d > 0); /* max was -2 first: d = -(-2)/127 */
    free(x);
    free(a);
    free(b);
}
#endif

static void test_q8_K_quantize_simd(void **state)
{
    (void)state;
#if defined(KQ_HAVE_AVX512)
    check_q8_K_quantizer(quant_quantize_row_q8_K_avx512);
#endif
#if defined(KQ_HAVE_AVX2)
    check_q8_K_quantizer(quant_quantize_row_q8_K_avx2);
#else
    KS_SKIP("this build has no AVX2 or AVX-512 kernels");
#endif
}

static double dot_dequant(const struct ktype *kt, const void *x, const block_q8_K *y, int n, double *mag)
{
    float *a = malloc(sizeof(float) * n), *b = malloc(sizeof(float) * n);
    kt->deq(x, a, n);
    quant_dequantize_row_q8_K(y, b, n);
    double s = 0, m = 0;
    for (int i = 0; i < n; i++) {
        s += (double)a[i] * b[i];
        m += fabs((double)a[i] * b[i]);
    }
    free(a);
    free(b);
    *mag = m;
    return s;
}

static void check_close(const char *what, const char *name, int n, double got, double want, double mag)
{
    if (!(fabs(got - want) <= 1e-5 * mag + 1e-30))
        fail_msg("%s %s n=%d: got %.9g want %.9g (|diff| %.3g, bound %.3g)", what, name, n, got, want,
                 fabs(got - want), 1e-5 * mag);
}

static void test_vec_dot_scalar_vs_dequant(void **state)
{
    (void)state;
    for (size_t k = 0; k < N_KTYPES; k++) {
        const struct ktype *kt = &ktypes[k];
        for (size_t si = 0; si < sizeof test_sizes / sizeof test_sizes[0]; si++) {
            const int n = test_sizes[si], nb = n / QK_K;
            for (int rep = 0; rep < 4; rep++) {
                void *x = malloc(kt->bytes * nb);
                block_q8_K *y = malloc(sizeof(block_q8_K) * nb);
                random_blocks(kt, x, nb);
                random_q8(y, nb, 128, 0);
                double mag;
                const double want = dot_dequant(kt, x, y, n, &mag);
                float got;
                kt->scalar(n, &got, x, y);
                check_close("scalar vs dequant", kt->name, n, got, want, mag);
                free(x);
                free(y);
            }
        }
    }
}

static void check_simd(const struct ktype *kt, quant_vec_dot_fn simd, const char *isa)
{
    if (!simd) {
        print_message("  %s %s: not compiled in, skipped\n", kt->name, isa);
        return;
    }
    for (size_t si = 0; si < sizeof test_sizes / sizeof test_sizes[0]; si++) {
        const int n = test_sizes[si], nb = n / QK_K;
        void *x = malloc(kt->bytes * nb);
        block_q8_K *y = malloc(sizeof(block_q8_K) * nb);
        for (int rep = 0; rep < 8; rep++) {
            random_blocks(kt, x, nb);
            random_q8(y, nb, 128, 0);
            float ref, got;
            double mag;
            dot_dequant(kt, x, y, n, &mag);
            kt->scalar(n, &ref, x, y);
            simd(n, &got, x, y);
            check_close(isa, kt->name, n, got, ref, mag);
            if (memcmp(&got, &ref, sizeof got))
                fail_msg("%s %s n=%d: %.9g, the reference's bits are %.9g", isa, kt->name, n, got, ref);
        }
        if (n <= 512) { /* integer-exact setting: every partial sum < 2^24 */
            for (int rep = 0; rep < 8; rep++) {
                random_blocks(kt, x, nb);
                for (int i = 0; i < nb; i++) {
                    uint8_t *blk = (uint8_t *)x + kt->bytes * i;
                    set_f16(blk, kt->off_d, 1.f);
                    set_f16(blk, kt->off_dmin, 1.f);
                }
                random_q8(y, nb, 4, 1.f);
                float ref, got;
                kt->scalar(n, &ref, x, y);
                simd(n, &got, x, y);
                if (ref != got) fail_msg("%s %s n=%d exact: got %.1f want %.1f", isa, kt->name, n, got, ref);
            }
        }
        free(x);
        free(y);
    }
}

static void test_vec_dot_simd_vs_scalar(void **state)
{
    (void)state;
    for (size_t k = 0; k < N_KTYPES; k++) {
        check_simd(&ktypes[k], ktypes[k].avx2, "avx2");
        check_simd(&ktypes[k], ktypes[k].avx512, "avx512");
    }
}

/* Quantized weights . quantized activations against the f32 dot of the
 * originals: the error is the quantization error, well below 5% here. */
static void test_vec_dot_quantized_accuracy(void **state)
{
    (void)state;
    const int n = 16 * QK_K, nb = n / QK_K;
    float *w = malloc(sizeof(float) * n), *a = malloc(sizeof(float) * n);
    block_q8_K *y = malloc(sizeof(block_q8_K) * nb);
    struct quant_traits best[QUANT_TYPE_COUNT], scalar[QUANT_TYPE_COUNT];
    memset(best, 0, sizeof best);
    memset(scalar, 0, sizeof scalar);
    quant_kquants_fill(best, scalar);
    for (int i = 0; i < n; i++) {
        w[i] = rng_normal();
        a[i] = rng_normal() + w[i]; /* correlated so the dot is large */
    }
    double ref = 0;
    for (int i = 0; i < n; i++) ref += (double)w[i] * a[i];
    quant_quantize_row_q8_K(a, y, n);
    for (size_t k = 0; k < N_KTYPES; k++) {
        const struct ktype *kt = &ktypes[k];
        void *x = malloc(kt->bytes * nb);
        kt->quant(w, x, n);
        float got;
        best[kt->type].vec_dot(n, &got, x, y);
        print_message("  %s dot rel error %.5f\n", kt->name, fabs(got - ref) / fabs(ref));
        assert_true(fabs(got - ref) <= 0.05 * fabs(ref));
        free(x);
    }
    free(w);
    free(a);
    free(y);
}

/* The prefill kernels give exactly the best vec_dot's result per token. */
static void test_vec_dot_multi(void **state)
{
    (void)state;
    struct quant_traits best[QUANT_TYPE_COUNT], scalar[QUANT_TYPE_COUNT];
    memset(best, 0, sizeof best);
    memset(scalar, 0, sizeof scalar);
    quant_kquants_fill(best, scalar);
    int tested = 0;
    for (size_t k = 0; k < N_KTYPES; k++) {
        const struct ktype *kt = &ktypes[k];
        const quant_kq_dot_multi_fn multi = quant_kquants_dot_multi(kt->type);
        if (!multi) continue;
        tested++;
        for (size_t si = 0; si < sizeof test_sizes / sizeof test_sizes[0]; si++) {
            const int n = test_sizes[si], nb = n / QK_K, max_nt = 7;
            void *x = malloc(kt->bytes * nb);
            block_q8_K *y = malloc(sizeof(block_q8_K) * nb * max_nt);
            random_blocks(kt, x, nb);
            random_q8(y, nb * max_nt, 128, 0);
            for (int nt = 0; nt <= max_nt; nt++) {
                float got[2 * 7 + 1];
                for (int t = 0; t < 2 * 7 + 1; t++) got[t] = -1.f;
                multi(n, nt, got, 2, x, y, sizeof(block_q8_K) * nb);
                for (int t = 0; t < nt; t++) {
                    float want;
                    best[kt->type].vec_dot(n, &want, x, y + t * nb);
                    if (got[2 * t] != want) fail_msg("%s multi nt=%d t=%d: %g vs %g", kt->name, nt, t, got[2 * t], want);
                    assert_true(got[2 * t + 1] == -1.f); /* stride respected */
                }
                assert_true(got[2 * nt] == -1.f); /* nothing past nt */
            }
            free(x);
            free(y);
        }
    }
    if (!tested)
        KS_SKIP("no k-quant type has a multi-token dot kernel in this build");
}

/* ---- prefill GEMM tiles ---------------------------------------------------- */

struct tiles_kernel {
    const char *name;
    quant_kq_tiles_fn fn;
};
static const struct tiles_kernel k_tiles[] = {
    {"scalar", quant_kq_tiles_scalar},
#if defined(KQ_HAVE_AVX2)
    {"avx2", quant_kq_tiles_avx2},
#endif
#if defined(KQ_HAVE_GEMM_AVX512)
    {"avx512", quant_kq_tiles_avx512},
#endif
};

#define GUARD (-12345.0f)

/* Rows [lo, hi) of a random rows x cols matrix against nt random Q8_K rows
 * (read through an index into fewer rows when indexed) with one tile kernel:
 * every result has the scalar reference vec_dot's bits, and Y outside those
 * rows (and past the last row, ldy = rows + 1) keeps its guard value. */
static void check_gemm(const struct ktype *kt, const struct tiles_kernel *tk, int64_t rows, int64_t cols, int64_t nt,
                       int64_t lo, int64_t hi, bool indexed)
{
    const int64_t nb = cols / QK_K, nx = indexed ? nt / 2 + 1 : nt, ldy = rows + 1;
    const size_t wrow = kt->bytes * (size_t)nb;
    uint8_t *W = malloc(wrow * (size_t)rows);
    block_q8_K *X = malloc(sizeof(block_q8_K) * (size_t)(nb * nx));
    int32_t *xi = malloc(sizeof(int32_t) * (size_t)nt);
    float *Y = malloc(sizeof(float) * (size_t)(nt * ldy));
    size_t sbytes = (quant_kq_scratch_bytes(cols) + 63) / 64 * 64;
    uint8_t *scratch = aligned_alloc(64, sbytes);
    assert_non_null(W), assert_non_null(X), assert_non_null(xi), assert_non_null(Y), assert_non_null(scratch);
    random_blocks(kt, W, (int)(nb * rows));
    random_q8(X, (int)(nb * nx), 128, 0);
    for (int64_t t = 0; t < nt; t++)
        xi[t] = indexed ? (int32_t)(rng_next() % (uint64_t)nx) : (int32_t)t;
    for (int64_t i = 0; i < nt * ldy; i++)
        Y[i] = GUARD;
    const struct quant_kq_gemm g = {
        .wtype = kt->type, .W = W, .wrow = wrow, .cols = cols, .X = (const uint8_t *)X,
        .xrow = sizeof(block_q8_K) * (size_t)nb, .xi = indexed ? xi : NULL, .n_tokens = nt, .Y = Y, .ldy = ldy,
    };
    quant_kq_gemm_rows(&g, tk->fn, lo, hi, scratch);
    for (int64_t t = 0; t < nt; t++)
        for (int64_t r = 0; r < ldy; r++) {
            float want = GUARD;
            if (r >= lo && r < hi)
                kt->scalar((int)cols, &want, W + r * wrow, X + xi[t] * nb);
            const float got = Y[t * ldy + r];
            if (memcmp(&got, &want, sizeof got))
                fail_msg("%s %s rows=%lld [%lld, %lld) cols=%lld tokens=%lld%s: Y[%lld][%lld] = %.9g, want %.9g",
                         kt->name, tk->name, (long long)rows, (long long)lo, (long long)hi, (long long)cols,
                         (long long)nt, indexed ? " indexed" : "", (long long)t, (long long)r, got, want);
        }
    free(W), free(X), free(xi), free(Y), free(scratch);
}

/* Every tile kernel (the scalar twin and each SIMD one this build has) gives
 * the scalar reference vec_dot's bits: rows not a multiple of a panel or of a
 * work item, 1..17 (the tile's token tails), 64 and 512 tokens, tokens read
 * through an index. */
static void test_gemm_tiles_vs_reference(void **state)
{
    (void)state;
    for (size_t k = 0; k < N_KTYPES; k++)
        for (size_t i = 0; i < sizeof k_tiles / sizeof k_tiles[0]; i++) {
            const struct ktype *kt = &ktypes[k];
            const struct tiles_kernel *tk = &k_tiles[i];
            for (int64_t nt = 1; nt <= 17; nt++)
                check_gemm(kt, tk, 37, 512, nt, 0, 37, false);
            check_gemm(kt, tk, 16, 768, 9, 0, 16, true);
            check_gemm(kt, tk, 19, 256, 64, 0, 19, true);
            check_gemm(kt, tk, 70, 256, 512, 5, 61, false);
            check_gemm(kt, tk, 64, 1024, 13, 32, 64, false);
        }
    print_message("checked %zu tile kernels against the reference\n", sizeof k_tiles / sizeof k_tiles[0]);
}

/* Element el of row r in the lane-order layout (Q3_K, Q5_K, Q6_K): d times
 * the stored scale * quant, less Q6_K's offset (bsum weight 32 * scale) or
 * Q5_K's dmin * min, is the dequantized value. */
static void check_lane_panel(const struct ktype *kt, const uint8_t *pb, int r, int el, float want)
{
    int16_t w[2], pair[2];
    float d, dmin;
    memcpy(w, pb + KQ_PL_W + 64 * (el / 2) + 4 * r, 4);
    memcpy(pair, pb + KQ_PL_PAIRS + 64 * (el / 32) + 4 * r, 4);
    memcpy(&d, pb + KQ_PL_D + 4 * r, 4);
    memcpy(&dmin, pb + KQ_PL_DMIN + 4 * r, 4);
    const int bw = pair[(el / 16) % 2], q = w[el % 2];
    float got = d * (float)q, mag = fabsf(got);
    if (kt->type == QUANT_Q6_K)
        got = d * (float)(q - bw), mag = fabsf(got);
    if (kt->type == QUANT_Q5_K)
        got -= dmin * (float)bw, mag += fabsf(dmin * (float)bw);
    if (!(fabsf(got - want) <= 1e-6f * mag))
        fail_msg("%s row %d element %d: panel %.9g, dequantized %.9g", kt->name, r, el, got, want);
}

/* The panel holds what the reference dequantizer reads: d * scale * q - dmin
 * * min, element by element, with the zero rows past nr. */
static void test_gemm_panel_layout(void **state)
{
    (void)state;
    for (size_t k = 0; k < N_KTYPES; k++) {
        const struct ktype *kt = &ktypes[k];
        const int64_t cols = 512, nb = cols / QK_K, nr = 11;
        const size_t wrow = kt->bytes * (size_t)nb;
        uint8_t *W = malloc(wrow * (size_t)nr), *panel = aligned_alloc(64, quant_kq_panel_bytes(cols));
        float *deq = malloc(sizeof(float) * (size_t)cols);
        random_blocks(kt, W, (int)(nb * nr));
        quant_kq_unpack_panel(kt->type, W, wrow, (int)nr, cols, panel);
        const int sub = 4 * kq_sub_dwords(kt->type);
        const int offset = kt->type == QUANT_Q3_K ? 4 : kt->type == QUANT_Q6_K ? 32 : 0;
        for (int r = 0; r < KQ_PANEL_ROWS; r++) {
            if (r < nr)
                kt->deq(W + r * wrow, deq, cols);
            for (int64_t e = 0; e < cols; e++) {
                const uint8_t *pb = panel + (e / QK_K) * KQ_PB_BYTES;
                const int el = (int)(e % QK_K), j = el / sub;
                int32_t sc;
                int16_t pair[2];
                float d, dmin;
                if (kq_lane_order(kt->type)) {
                    check_lane_panel(kt, pb, r, el, r < nr ? deq[e] : 0.0f);
                    continue;
                }
                memcpy(&sc, pb + KQ_PB_SC + 64 * j + 4 * r, 4);
                memcpy(pair, pb + KQ_PB_PAIRS + 64 * (el / 32) + 4 * r, 4);
                memcpy(&d, pb + KQ_PB_D + 4 * r, 4);
                memcpy(&dmin, pb + KQ_PB_DMIN + 4 * r, 4);
                const int u = pb[KQ_PB_Q + 64 * (el / 4) + 4 * r + el % 4];
                /* the min of element el's 16 weighs bsum el / 16: pair half (el / 16) % 2 */
                const int m = kq_has_dmin(kt->type) ? pair[(el / 16) % 2] : 0;
                if (!kq_has_dmin(kt->type) && pair[(el / 16) % 2] != offset * sc)
                    fail_msg("%s row %d element %lld: bsum weight %d, want %d * %d", kt->name, r, (long long)e,
                             pair[(el / 16) % 2], offset, sc);
                const float scaled = d * (float)(sc * (u - offset)), min = dmin * (float)m;
                const float got = scaled - min;
                const float want = r < nr ? deq[e] : 0.0f;
                if (!(fabsf(got - want) <= 1e-6f * (fabsf(scaled) + fabsf(min))))
                    fail_msg("%s row %d element %lld: panel %.9g, dequantized %.9g", kt->name, r, (long long)e, got,
                             want);
            }
        }
        free(W), free(panel), free(deq);
    }
}

static void test_traits_fill(void **state)
{
    (void)state;
    struct quant_traits best[QUANT_TYPE_COUNT], scalar[QUANT_TYPE_COUNT];
    memset(best, 0, sizeof best);
    memset(scalar, 0, sizeof scalar);
    quant_kquants_fill(best, scalar);
    for (size_t k = 0; k < N_KTYPES; k++) {
        const struct ktype *kt = &ktypes[k];
        for (int tab = 0; tab < 2; tab++) {
            const struct quant_traits *t = &(tab ? scalar : best)[kt->type];
            assert_string_equal(t->name, kt->name);
            assert_int_equal(t->block_elems, QK_K);
            assert_int_equal(t->block_bytes, kt->bytes);
            assert_true(t->is_quantized);
            assert_ptr_equal(t->to_float, kt->deq);
            assert_ptr_equal(t->from_float, kt->quant);
            assert_int_equal(t->vec_dot_type, QUANT_Q8_K);
            assert_non_null(t->vec_dot);
        }
        assert_ptr_equal(scalar[kt->type].vec_dot, kt->scalar);
    }
    assert_string_equal(best[QUANT_Q8_K].name, "q8_K");
    assert_int_equal(best[QUANT_Q8_K].block_bytes, sizeof(block_q8_K));
    assert_ptr_equal(scalar[QUANT_Q8_K].from_float, quant_quantize_row_q8_K);
    assert_non_null(best[QUANT_Q8_K].from_float);
    /* nothing outside the k-quant range is touched */
    assert_null(best[QUANT_Q8_0].name);
    assert_null(best[QUANT_BF16].name);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dequantize_matches_layout),
        cmocka_unit_test(test_quantize_roundtrip),
        cmocka_unit_test(test_q8_K_quantize),
        cmocka_unit_test(test_q8_K_quantize_simd),
        cmocka_unit_test(test_vec_dot_scalar_vs_dequant),
        cmocka_unit_test(test_vec_dot_simd_vs_scalar),
        cmocka_unit_test(test_vec_dot_quantized_accuracy),
        cmocka_unit_test(test_vec_dot_multi),
        cmocka_unit_test(test_gemm_tiles_vs_reference),
        cmocka_unit_test(test_gemm_panel_layout),
        cmocka_unit_test(test_traits_fill),
    };
    return ks_run_tests(tests, NULL, NULL);
}
