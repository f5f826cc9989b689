/* quant: repacked Q4_0 / Q8_0 / IQ4_NL / MXFP4 / Q5_0 / Q5_1 weights. The repack keeps every block
 * (unpacking gives the original bytes back; the tail rows past the last
 * whole group keep their bytes in place), a row looked up in the layout is
 * the row-major row's floats, quant_matmul_repacked gives the scalar
 * reference vec_dot's bits at every batch size (the group kernels up to 16
 * tokens, the prefill tiles above, which round as the reference does), and
 * every SIMD group kernel gives its scalar twin's bits (tokens read in order
 * or through act_rows, as experts read shared rows). Run in each build
 * (AVX-512, AVX2-only, portable), this compares the repacked kernels that
 * build uses against the unrepacked reference. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "quant/iq4_mxfp4.h"
#include "quant/quant.h"
#include "quant/quant_internal.h"
#include "support/rng.h"

static uint64_t rng_state = 0x2545f4914f6cdd1dull;
static float rndf(void) { return ks_rng_uniform(&rng_state) * 2.0f - 1.0f; } /* [-1, 1) */

static const enum quant_type k_types[] = {QUANT_Q4_0, QUANT_Q8_0, QUANT_IQ4_NL, QUANT_MXFP4, QUANT_Q5_0, QUANT_Q5_1};

/* rows x cols of wtype from random floats (some rows scaled down, so
 * scales differ widely between the rows of a group). */
static void *random_matrix(enum quant_type wtype, int64_t rows, int64_t cols)
{
    size_t wrow = quant_row_size(wtype, cols);
    uint8_t *W = malloc(wrow * (size_t)rows);
    float *row = malloc((size_t)cols * sizeof(float));
    assert_non_null(W);
    assert_non_null(row);
    for (int64_t r = 0; r < rows; r++) {
        float scale = r % 5 == 0 ? 0.01f : 1.0f;
        for (int64_t c = 0; c < cols; c++)
            row[c] = rndf() * scale;
        quant_traits(wtype)->from_float(row, W + r * wrow, cols);
    }
    if (wtype == QUANT_MXFP4 || wtype == QUANT_IQ4_NL) /* every fourth row at the largest levels, + then - */
        for (int64_t r = 3; r < rows; r += 4)
            for (int64_t b = 0; b < cols / QK8_0; b++)
                memset(W + r * wrow + (size_t)b * quant_row_size(wtype, QK8_0) +
                           (wtype == QUANT_MXFP4 ? offsetof(block_mxfp4, qs) : offsetof(block_iq4_nl, qs)),
                       b % 2 ? 0xff : 0x77, QK8_0 / 2);
    if (wtype == QUANT_MXFP4) /* the smallest exponents, whose scales are subnormal floats, in some blocks */
        for (int64_t r = 0; r < rows; r += 3)
            ((block_mxfp4 *)(void *)(W + r * wrow))[r % (cols / QK_MXFP4)].e = (uint8_t)(r % 2);
    free(row);
    return W;
}

static float *random_tokens(int64_t n, int64_t cols)
{
    float *X = malloc((size_t)(n * cols) * sizeof(float));
    assert_non_null(X);
    for (int64_t i = 0; i < n * cols; i++)
        X[i] = rndf() * 3.0f;
    for (int64_t c = 0; n > 1 && c < cols; c++) /* token 1 all +3: its Q8_0 quants are all 127 */
        X[cols + c] = 3.0f;
    return X;
}

static quant_vec_dot_fn ref_dot(enum quant_type wtype)
{
    switch (wtype) {
    case QUANT_Q4_0: return quant_vec_dot_q4_0_q8_0_ref;
    case QUANT_IQ4_NL: return quant_vec_dot_iq4_nl_q8_0_ref;
    case QUANT_MXFP4: return quant_vec_dot_mxfp4_q8_0_scalar;
    case QUANT_Q5_0: return quant_vec_dot_q5_0_q8_0_ref;
    case QUANT_Q5_1: return quant_vec_dot_q5_1_q8_1_ref;
    default: return quant_vec_dot_q8_0_q8_0_ref;
    }
}

/* Y[t][r] by the scalar reference vec_dot on the row-major matrix. */
static void reference_matmul(enum quant_type wtype, const uint8_t *W, int64_t rows, int64_t cols, const float *X,
                             int64_t n, float *Y)
{
    size_t wrow = quant_row_size(wtype, cols);
    block_q8_1 *xq = malloc((size_t)(cols / QK8_0) * sizeof *xq); /* the larger of Q8_0 and Q8_1 */
    assert_non_null(xq);
    for (int64_t t = 0; t < n; t++) {
        if (wtype == QUANT_Q5_1)
            quant_q8_1_act_from_float_ref(X + t * cols, xq, cols);
        else
            quant_q8_0_act_from_float_ref(X + t * cols, xq, cols);
        for (int64_t r = 0; r < rows; r++)
            ref_dot(wtype)((int)cols, &Y[t * rows + r], W + r * wrow, xq);
    }
    free(xq);
}

static void test_repack_keeps_every_block(void **state)
{
    (void)state;
    const int R = quant_repack_rows();
    for (size_t ti = 0; ti < sizeof k_types / sizeof k_types[0]; ti++) {
        enum quant_type t = k_types[ti];
        int64_t rows = 3 * R + 5, grouped = 3 * R, cols = 160, nb = cols / QK8_0;
        size_t wrow = quant_row_size(t, cols), bb = wrow / (size_t)nb;
        uint8_t *W = random_matrix(t, rows, cols), *P = malloc(wrow * (size_t)rows);
        assert_non_null(P);
        memcpy(P, W, wrow * (size_t)rows);
        assert_int_equal(quant_repack(t, rows, cols, P), KS_OK);
        assert_memory_not_equal(P, W, wrow * (size_t)grouped);
        assert_memory_equal(P + grouped * wrow, W + grouped * wrow, wrow * (size_t)(rows - grouped));
        for (int64_t r = 0; r < rows; r++)
            for (int64_t b = 0; b < nb; b++) {
                uint8_t blk[sizeof(block_q8_0)];
                if (r < grouped) {
                    quant_rp_get_block(P, t, nb, r, b, blk);
                    assert_memory_equal(blk, W + r * wrow + b * bb, bb);
                }
#if defined(QUANT_HAVE_AVX2)
                if (t != QUANT_Q4_0 && t != QUANT_Q8_0) /* no prefill tile reads the others */
                    continue;
                /* the prefill tiles' read of a repacked row, gathered or from the tail */
                float d_rp, d_rows;
                __m256i v_rp = quant_weight_block_bytes(P, t, true, rows, nb, r, b, &d_rp);
                __m256i v_rows = quant_block_bytes(W + r * wrow, t, b, &d_rows);
                assert_memory_equal(&v_rp, &v_rows, sizeof v_rp);
                assert_memory_equal(&d_rp, &d_rows, sizeof d_rp);
#endif
            }
        free(W);
        free(P);
    }
}

static void test_repack_refuses_what_does_not_fit(void **state)
{
    (void)state;
    const int R = quant_repack_rows();
    uint8_t buf[64 * sizeof(block_q8_0)] = {0};
    assert_true(R == 8 || R == 16);
    assert_true(quant_repack_fits(QUANT_Q4_0, R, 64));
    assert_true(quant_repack_fits(QUANT_Q4_0, R + 1, 64)); /* one tail row */
    assert_true(quant_repack_fits(QUANT_IQ4_NL, R, 64));
    assert_true(quant_repack_fits(QUANT_MXFP4, 2 * R + 3, 96));
    assert_false(quant_repack_fits(QUANT_MXFP4, R - 1, 64));
    assert_false(quant_repack_fits(QUANT_IQ3_XXS, R, 256));
    assert_false(quant_repack_fits(QUANT_Q8_0, R - 1, 64)); /* no whole group: row-major kernels */
    assert_false(quant_repack_fits(QUANT_Q8_0, 0, 64));
    assert_false(quant_repack_fits(QUANT_Q4_1, R, 64));
    assert_false(quant_repack_fits(QUANT_Q8_0, R, 48));
    assert_false(quant_repack_fits(QUANT_F16, R, 64));
    assert_int_equal(quant_repack(QUANT_Q8_0, R, 48, buf), KS_ERR_INVALID_ARG);
    assert_int_equal(quant_repack(QUANT_Q8_0, R, 32, NULL), KS_ERR_INVALID_ARG);
    float x[32] = {0}, y[16];
    assert_int_equal(quant_matmul_repacked(NULL, buf, QUANT_Q4_1, R, 32, x, 1, y, buf, sizeof buf),
                     KS_ERR_INVALID_ARG);
    assert_int_equal(quant_get_row_repacked(buf, QUANT_Q8_0, R, 32, R, y), KS_ERR_INVALID_ARG);
    assert_int_equal(quant_get_row_repacked(buf, QUANT_Q8_0, R, 32, -1, y), KS_ERR_INVALID_ARG);
    assert_int_equal(quant_get_row_repacked(buf, QUANT_Q4_1, R, 32, 0, y), KS_ERR_INVALID_ARG);
    assert_int_equal(quant_get_row_repacked(NULL, QUANT_Q8_0, R, 32, 0, y), KS_ERR_INVALID_ARG);
}

/* quant_matmul_repacked on threads x shapes x batch sizes: the reference's
 * bits whether the group kernels (up to 16 tokens, or every batch in a build
 * without SIMD prefill tiles) or the tiles run, so a token's row is the same
 * in a batch of 16 and of 17; the unrepacked kernels (row-major decode and
 * prefill tiles) give them too. */
static void check_repacked(threads_pool *pool, enum quant_type t, int64_t rows, int64_t cols, int64_t n)
{
    size_t wrow = quant_row_size(t, cols);
    uint8_t *W = random_matrix(t, rows, cols), *P = malloc(wrow * (size_t)rows);
    float *X = random_tokens(n, cols);
    float *Yp = malloc((size_t)(n * rows) * sizeof(float)), *Yr = malloc((size_t)(n * rows) * sizeof(float));
    float *Yu = malloc((size_t)(n * rows) * sizeof(float));
    size_t ws = quant_matmul_work_size(t, cols, n);
    void *work = malloc(ws);
    assert_true(P && Yp && Yr && Yu && work);
    memcpy(P, W, wrow * (size_t)rows);
    assert_int_equal(quant_repack(t, rows, cols, P), KS_OK);
    assert_int_equal(quant_matmul_repacked(pool, P, t, rows, cols, X, n, Yp, work, ws), KS_OK);
    assert_int_equal(quant_matmul(pool, W, t, rows, cols, X, n, Yu, work, ws), KS_OK);
    reference_matmul(t, W, rows, cols, X, n, Yr);
    size_t bytes = (size_t)(n * rows) * sizeof(float);
    for (int64_t i = 0; i < n * rows; i++)
        if (Yp[i] != Yr[i])
            fail_msg("%s %lld x %lld, %lld tokens: Y[%lld][%lld] = %.9g, reference %.9g, unrepacked %.9g",
                     quant_type_name(t), (long long)rows, (long long)cols, (long long)n, (long long)(i / rows),
                     (long long)(i % rows), Yp[i], Yr[i], Yu[i]);
    if (memcmp(Yu, Yr, bytes))
        fail_msg("%s %lld x %lld, %lld tokens: the unrepacked kernels differ from the reference",
                 quant_type_name(t), (long long)rows, (long long)cols, (long long)n);
    free(W), free(P), free(X), free(Yp), free(Yr), free(Yu), free(work);
}

static void test_repacked_matmul_matches_reference(void **state)
{
    (void)state;
    const int R = quant_repack_rows();
    /* and with tail rows past the last group (1 to R - 1 of them) */
    const int64_t shapes[][2] = {{R, 32}, {3 * R, 96}, {8 * R, 512}, {2 * R, 2048},
                                 {R + 5, 96}, {3 * R + 1, 256}, {2 * R + R - 1, 64}};
    const int64_t batches[] = {1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 32, 33, 64, 65}; /* both sides of RP_GEMM_MAX */
    for (int th = 1; th <= 2; th++) {
        threads_pool *pool;
        assert_int_equal(threads_create(th, &pool), KS_OK);
        for (size_t ti = 0; ti < sizeof k_types / sizeof k_types[0]; ti++)
            for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
                for (size_t b = 0; b < sizeof batches / sizeof batches[0]; b++)
                    check_repacked(pool, k_types[ti], shapes[s][0], shapes[s][1], batches[b]);
        threads_free(pool);
    }
    print_message("repacked kernels of this build (isa %s, groups of %d rows) checked\n", quant_isa(),
                  quant_repack_rows());
}

/* Every row of a repacked matrix (groups and tail) looked up as floats: the
 * row-major row's floats from the scalar to_float, by the build's kernel and
 * by the scalar reference. */
static void test_row_lookup_reads_the_layout(void **state)
{
    (void)state;
    const int R = quant_repack_rows();
    for (size_t ti = 0; ti < sizeof k_types / sizeof k_types[0]; ti++) {
        enum quant_type t = k_types[ti];
        int64_t rows = 4 * R + 3, cols = 192, nb = cols / QK8_0;
        size_t wrow = quant_row_size(t, cols);
        uint8_t *W = random_matrix(t, rows, cols), *P = malloc(wrow * (size_t)rows);
        float *want = malloc((size_t)cols * sizeof(float)), *got = malloc((size_t)cols * sizeof(float));
        float *ref = malloc((size_t)cols * sizeof(float));
        assert_true(P && want && got && ref);
        memcpy(P, W, wrow * (size_t)rows);
        assert_int_equal(quant_repack(t, rows, cols, P), KS_OK);
        for (int64_t r = 0; r < rows; r++) {
            quant_traits_scalar(t)->to_float(W + r * wrow, want, cols);
            assert_int_equal(quant_get_row_repacked(P, t, rows, cols, r, got), KS_OK);
            assert_memory_equal(got, want, (size_t)cols * sizeof(float));
            if (r < 4 * R) {
                quant_rp_row_to_float_ref(P, t, nb, r, ref);
                assert_memory_equal(ref, want, (size_t)cols * sizeof(float));
            }
        }
        free(W), free(P), free(want), free(got), free(ref);
    }
}

typedef void (*rp_kernel_fn)(const struct quant_rp_job *j, int64_t g0, int64_t g1);

/* A SIMD group kernel on its layout (R rows, Q8_0 bias) against the scalar
 * twin on the same bytes, and the twin against the reference vec_dot. */
static void check_twin(rp_kernel_fn kernel, int R, int q8_bias)
{
    for (size_t ti = 0; ti < sizeof k_types / sizeof k_types[0]; ti++) {
        enum quant_type t = k_types[ti];
        /* 20 blocks: past q5's chunks of 16; every tile width of the AVX-512 kernel (12) and a split, and
         * q5's token pairs (up to 16 tokens) and its batch kernel */
        int64_t rows = 4 * R, cols = 20 * QK8_0, nb = cols / QK8_0;
        for (int64_t n = 1; n <= 17; n++) {
            size_t wrow = quant_row_size(t, cols);
            uint8_t *W = random_matrix(t, rows, cols), *P = malloc(wrow * (size_t)rows);
            float *X = random_tokens(n, cols);
            struct quant_rp_act *act = malloc((size_t)(n * nb) * sizeof *act);
            float *Ys = malloc((size_t)(n * rows) * sizeof(float)), *Yt = malloc((size_t)(n * rows) * sizeof(float));
            float *Yr = malloc((size_t)(n * rows) * sizeof(float));
            assert_true(P && act && Ys && Yt && Yr);
            memcpy(P, W, wrow * (size_t)rows);
            assert_int_equal(quant_rp_repack_as(t, rows, cols, P, R, q8_bias), KS_OK);
            for (int64_t i = 0; i < n; i++)
                quant_rp_pack_token(t, X + i * cols, cols, act + i * nb);
            struct quant_rp_job j = {.wtype = t, .W = P, .nb = nb, .act = act, .n_tokens = n, .Y = Ys, .ldy = rows};
            kernel(&j, 0, rows / R);
            j.Y = Yt;
            quant_rp_rows_ref(&j, R, q8_bias, 0, rows / R);
            reference_matmul(t, W, rows, cols, X, n, Yr);
            assert_memory_equal(Ys, Yt, (size_t)(n * rows) * sizeof(float));
            assert_memory_equal(Yt, Yr, (size_t)(n * rows) * sizeof(float));
            /* tokens read through act_rows (experts share packed rows): here packed in reverse order */
            struct quant_rp_act *rev = malloc((size_t)(n * nb) * sizeof *rev);
            int32_t *act_rows = malloc((size_t)n * sizeof *act_rows);
            assert_true(rev && act_rows);
            for (int64_t i = 0; i < n; i++) {
                act_rows[i] = (int32_t)(n - 1 - i);
                memcpy(rev + act_rows[i] * nb, act + i * nb, (size_t)nb * sizeof *act);
            }
            j.act = rev, j.act_rows = act_rows, j.Y = Yt;
            kernel(&j, 0, rows / R);
            assert_memory_equal(Ys, Yt, (size_t)(n * rows) * sizeof(float));
            free(W), free(P), free(X), free(act), free(Ys), free(Yt), free(Yr), free(rev), free(act_rows);
        }
    }
}

static void scalar_16_biased(const struct quant_rp_job *j, int64_t g0, int64_t g1) { quant_rp_rows_ref(j, 16, 0x80, g0, g1); }

static void test_simd_kernels_match_scalar_twin(void **state)
{
    (void)state;
    int checked = 0;
#if defined(QUANT_HAVE_AVX512)
    check_twin(quant_rp_rows_avx512, 16, 0x80);
    checked++;
#endif
#if defined(QUANT_HAVE_AVX2)
    check_twin(quant_rp_rows_avx2, 8, 0);
    checked++;
#endif
    check_twin(scalar_16_biased, 16, 0x80); /* the twin itself, on the AVX-512 layout, in every build */
    print_message("%d SIMD group kernels checked against the scalar twin (isa %s)\n", checked, quant_isa());
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_repack_keeps_every_block),
        cmocka_unit_test(test_repack_refuses_what_does_not_fit),
        cmocka_unit_test(test_repacked_matmul_matches_reference),
        cmocka_unit_test(test_row_lookup_reads_the_layout),
        cmocka_unit_test(test_simd_kernels_match_scalar_twin),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
