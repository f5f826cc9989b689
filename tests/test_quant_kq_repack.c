/* quant: repacked k-quant weights (Q2_K to Q6_K, and IQ4_XS). The repack keeps every
 * super-block (read back out of the layout it is the original bytes; the
 * tail rows past the last whole group keep their bytes in place; AVX2's
 * Q6_K groups hold the layout kq_internal.h states), a row
 * looked up in the layout is the row-major row's floats, every SIMD group
 * kernel gives its scalar twin's bits and the twin the scalar reference
 * vec_dot's, and quant_matmul_repacked, quant_matmul_set and
 * quant_matmul_experts on repacked matrices give the reference's bits at
 * every batch size (the group kernels for small batches, the prefill tiles
 * on panels unpacked from the layout above): a token's row is the same
 * alone and in any batch. Run in each build (AVX-512, AVX2-only, portable),
 * this compares the kernels that build uses against the unrepacked
 * reference. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "quant/iq4_mxfp4.h"
#include "quant/kq_internal.h"
#include "quant/quant.h"
#include "quant/quant_internal.h"
#include "support/rng.h"

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static float rndf(void) { return ks_rng_uniform(&rng_state) * 2.0f - 1.0f; } /* [-1, 1) */

static const enum quant_type k_types[] = {QUANT_Q4_K, QUANT_Q6_K, QUANT_Q5_K, QUANT_Q2_K, QUANT_Q3_K, QUANT_IQ4_XS};
#define N_TYPES (sizeof k_types / sizeof k_types[0])

/* Offsets of a super-block's f16 scales: d, and dmin (d again where there is none). */
static void f16_fields(enum quant_type t, size_t *d, size_t *dmin)
{
    switch (t) {
    case QUANT_Q4_K: *d = offsetof(block_q4_K, d), *dmin = offsetof(block_q4_K, dmin); return;
    case QUANT_Q5_K: *d = offsetof(block_q5_K, d), *dmin = offsetof(block_q5_K, dmin); return;
    case QUANT_Q2_K: *d = offsetof(block_q2_K, d), *dmin = offsetof(block_q2_K, dmin); return;
    case QUANT_Q3_K: *d = *dmin = offsetof(block_q3_K, d); return;
    case QUANT_IQ4_XS: *d = *dmin = offsetof(block_iq4_xs, d); return;
    default: *d = *dmin = offsetof(block_q6_K, d); return;
    }
}

/* rows x cols of wtype: quantized random floats (some rows scaled down, so
 * scales differ widely between the rows of a group; some with an offset, so
 * the mins are not all alike), and every fourth row random bytes with sane
 * f16 scales, whose quants, 6-bit scales and mins reach their extremes. */
static uint8_t *random_matrix(enum quant_type wtype, int64_t rows, int64_t cols)
{
    size_t wrow = quant_row_size(wtype, cols), bb = quant_row_size(wtype, QK_K), at_d, at_dmin;
    uint8_t *W = malloc(wrow * (size_t)rows);
    float *row = malloc((size_t)cols * sizeof(float));
    assert_true(W && row);
    f16_fields(wtype, &at_d, &at_dmin);
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *w = W + r * wrow;
        if (r % 4 == 3) {
            for (size_t i = 0; i < wrow; i++)
                w[i] = (uint8_t)ks_rng_next(&rng_state);
            for (int64_t b = 0; b < cols / QK_K; b++) {
                quant_f16 d = quant_f32_to_f16(0.01f * (1 + rndf())), dmin = quant_f32_to_f16(0.003f * (1 + rndf()));
                memcpy(w + b * bb + at_dmin, &dmin, sizeof dmin);
                memcpy(w + b * bb + at_d, &d, sizeof d);
            }
            continue;
        }
        float scale = r % 5 == 0 ? 0.01f : 1.0f, offset = r % 3 == 0 ? 0.5f : 0.0f;
        for (int64_t c = 0; c < cols; c++)
            row[c] = rndf() * scale + offset * (float)(c % 7 == 0);
        quant_traits(wtype)->from_float(row, w, cols);
    }
    free(row);
    return W;
}

/* Tokens of random floats; token 1 (if any) all +-3, so its Q8_K quants are +-127. */
static float *random_tokens(int64_t n, int64_t cols)
{
    float *X = malloc((size_t)(n * cols) * sizeof(float));
    assert_non_null(X);
    for (int64_t i = 0; i < n * cols; i++)
        X[i] = rndf() * 3.0f;
    for (int64_t c = 0; n > 1 && c < cols; c++)
        X[cols + c] = c % 3 ? 3.0f : -3.0f;
    return X;
}

/* Whether this build repacks t (a portable build repacks no k-quant: its
 * scalar twin is slower than the row-major reference). */
static bool build_repacks(enum quant_type t) { return quant_repack_fits(t, quant_repack_rows(), QK_K); }

static uint8_t *copy_of(const uint8_t *W, size_t bytes)
{
    uint8_t *P = malloc(bytes);
    assert_non_null(P);
    memcpy(P, W, bytes);
    return P;
}

/* Q8_K rows of n tokens by the reference quantizer. */
static uint8_t *q8k_rows(const float *X, int64_t n, int64_t cols)
{
    size_t xrow = quant_row_size(QUANT_Q8_K, cols);
    uint8_t *q = malloc(xrow * (size_t)n);
    assert_non_null(q);
    for (int64_t t = 0; t < n; t++)
        quant_quantize_row_q8_K(X + t * cols, q + t * xrow, cols);
    return q;
}

/* The scalar reference a repacked t's kernels give the bits of: its vec_dot,
 * or for IQ4_XS ggml's eight-lane order (what its SIMD row kernels run;
 * the scalar vec_dot keeps ggml's generic order, iq4_mxfp4.h). */
static quant_vec_dot_fn reference_dot(enum quant_type t)
{
    return t == QUANT_IQ4_XS ? quant_vec_dot_iq4_xs_q8_K_lanes : quant_traits_scalar(t)->vec_dot;
}

/* Y[t][r] by the scalar reference on the row-major matrix. */
static void reference_matmul(enum quant_type wtype, const uint8_t *W, int64_t rows, int64_t cols, const float *X,
                             int64_t n, float *Y)
{
    size_t wrow = quant_row_size(wtype, cols), xrow = quant_row_size(QUANT_Q8_K, cols);
    uint8_t *xq = q8k_rows(X, n, cols);
    for (int64_t t = 0; t < n; t++)
        for (int64_t r = 0; r < rows; r++)
            reference_dot(wtype)((int)cols, &Y[t * rows + r], W + r * wrow, xq + t * xrow);
    free(xq);
}

static void assert_same_bits(const float *got, const float *want, int64_t n, int64_t rows, const char *what,
                             enum quant_type t)
{
    for (int64_t i = 0; i < n * rows; i++)
        if (memcmp(&got[i], &want[i], sizeof(float)))
            fail_msg("%s, %s, %lld tokens: Y[%lld][%lld] = %.9g, reference %.9g", what, quant_type_name(t),
                     (long long)n, (long long)(i / rows), (long long)(i % rows), got[i], want[i]);
}

static void test_repack_keeps_every_block(void **state)
{
    (void)state;
    const int groups[] = {QUANT_RP_ROWS, 16, 8, 1};
    for (size_t ti = 0; ti < N_TYPES; ti++)
        for (size_t gi = 0; gi < sizeof groups / sizeof groups[0]; gi++) {
            enum quant_type t = k_types[ti];
            const int R = groups[gi];
            int64_t rows = 3 * R + (R > 1 ? 5 % R : 0), grouped = 3 * R, cols = 3 * QK_K;
            size_t wrow = quant_row_size(t, cols), bb = quant_row_size(t, QK_K);
            uint8_t *W = random_matrix(t, rows, cols), *P = copy_of(W, wrow * (size_t)rows), blk[sizeof(block_q6_K)];
            assert_int_equal(quant_kqrp_repack_as(t, rows, cols, P, R), KS_OK);
            if (gi == 0 && build_repacks(t)) { /* quant_repack writes that very layout */
                uint8_t *Q = copy_of(W, wrow * (size_t)rows);
                assert_int_equal(quant_repack(t, rows, cols, Q), KS_OK);
                assert_memory_equal(Q, P, wrow * (size_t)rows);
                free(Q);
            }
            if (R > 1)
                assert_memory_not_equal(P, W, wrow * (size_t)grouped);
            else /* a group of one row is the file's block */
                assert_memory_equal(P, W, wrow * (size_t)rows);
            assert_memory_equal(P + grouped * wrow, W + grouped * wrow, wrow * (size_t)(rows - grouped));
            for (int64_t r = 0; r < grouped; r++)
                for (int64_t b = 0; b < cols / QK_K; b++) {
                    quant_kqrp_get_block(P, t, R, cols, r, b, blk);
                    assert_memory_equal(blk, W + r * wrow + b * bb, bb);
                }
            free(W), free(P);
        }
}

/* u = q + 32 of element e of a Q6_K super-block, in ggml's ql/qh packing. */
static uint8_t q6k_level(const block_q6_K *x, int e)
{
    const int h = e / 128, q = e % 128 / 32, l = e % 32;
    const uint8_t ql = x->ql[64 * h + 32 * (q % 2) + l];
    return (uint8_t)((q < 2 ? ql & 0xF : ql >> 4) | ((x->qh[32 * h + l] >> (2 * q)) & 3) << 4);
}

/* Q6_K's groups hold its levels packed, byte for byte as kq_internal.h
 * states (the kernels read that, not the repacker's inverse), with d last:
 * AVX2's groups of 8 joined (W(c, q, k), elements 32q + 4c + 2k + {0, 1,
 * 128, 129}) with the scales reordered after the quants; others (AVX-512's
 * 16) the scale dwords first, then per element group (h, c) three dwords
 * whose byte i is the level of element 128h + 32j + 4c + i with bits 2j,
 * 2j + 1 of element 128h + 96 + 4c + i's on top. */
static void test_q6k_packed_layouts(void **state)
{
    (void)state;
    const int groups[] = {KQRP_Q6K_JOINED_ROWS, 16};
    for (size_t gi = 0; gi < sizeof groups / sizeof groups[0]; gi++) {
        const int R = groups[gi];
        const bool joined = R == KQRP_Q6K_JOINED_ROWS;
        const int64_t rows = 2 * R, cols = 2 * QK_K;
        const size_t wrow = quant_row_size(QUANT_Q6_K, cols), gbb = (size_t)R * sizeof(block_q6_K);
        uint8_t *W = random_matrix(QUANT_Q6_K, rows, cols), *P = copy_of(W, wrow * (size_t)rows);
        assert_int_equal(quant_kqrp_repack_as(QUANT_Q6_K, rows, cols, P, R), KS_OK);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t b = 0; b < cols / QK_K; b++) {
                const block_q6_K *x = (const block_q6_K *)(const void *)(W + r * wrow + b * sizeof(block_q6_K));
                const uint8_t *gb = P + (size_t)(r / R) * R * wrow + (size_t)b * gbb;
                const int l = (int)(r % R);
                for (int n = 0; n < 16; n++) /* joined: c = n / 2, k = n % 2; else h = n / 8, c = n % 8 */
                    for (int j = 0; j < 3; j++)
                        for (int i = 0; i < 4; i++) {
                            const int e = joined ? 4 * (n / 2) + 2 * (n % 2) + (i & 1) + 128 * (i >> 1) : 128 * (n / 8) + 4 * (n % 8) + i;
                            const size_t at = joined ? KQRP_Q6K_JQ(R, n / 2, n % 2, j) : KQRP_Q6K_UNIT(R, n / 8, n % 8) + 4 * (size_t)(j * R);
                            const uint8_t want = (uint8_t)(q6k_level(x, e + 32 * j) | ((q6k_level(x, e + 96) >> (2 * j)) & 3) << 6);
                            assert_int_equal(gb[at + 4 * (size_t)l + (size_t)i], want);
                        }
                for (int m = 0; m < 4; m++) { /* joined scale dword m: sc[2m], sc[2m + 8], sc[2m + 1], sc[2m + 9] */
                    const int8_t *sc = x->scales;
                    const int8_t want[4] = {joined ? sc[2 * m] : sc[4 * m], joined ? sc[2 * m + 8] : sc[4 * m + 1],
                                            joined ? sc[2 * m + 1] : sc[4 * m + 2], joined ? sc[2 * m + 9] : sc[4 * m + 3]};
                    assert_memory_equal(gb + (joined ? KQRP_Q6K_JSC(R) : KQRP_Q6K_SC(R)) + 4 * (size_t)(m * R + l), want, 4);
                }
                assert_memory_equal(gb + KQRP_Q6K_D(R) + 2 * (size_t)l, &x->d, 2);
            }
        free(W), free(P);
    }
}

/* Level (0..31) of element e of a Q5_K super-block, in ggml's qs/qh packing. */
static uint8_t q5k_level(const block_q5_K *x, int e)
{
    const uint8_t q = x->qs[32 * (e / 64) + e % 32];
    return (uint8_t)((e / 32 % 2 ? q >> 4 : q & 0xF) | ((x->qh[e % 32] >> (e / 32)) & 1) << 4);
}

/* Groups of more than one row hold Q5_K's levels packed five bits to a
 * byte, byte for byte as kq_internal.h states: level dword Un of lane c is
 * sub-block n's elements 4c..4c + 3, or in AVX2's groups of 8 (n = 2k + h)
 * elements 4c + 2h, 4c + 2h + 1 of sub-blocks 2k and 2k + 1. */
static void test_q5k_packed_layout(void **state)
{
    (void)state;
    const int groups[] = {8, 16};
    for (size_t gi = 0; gi < sizeof groups / sizeof groups[0]; gi++) {
        const int R = groups[gi];
        const int64_t rows = 2 * R, cols = 2 * QK_K;
        const size_t wrow = quant_row_size(QUANT_Q5_K, cols), gbb = (size_t)R * sizeof(block_q5_K);
        uint8_t *W = random_matrix(QUANT_Q5_K, rows, cols), *P = copy_of(W, wrow * (size_t)rows);
        assert_int_equal(quant_kqrp_repack_as(QUANT_Q5_K, rows, cols, P, R), KS_OK);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t b = 0; b < cols / QK_K; b++) {
                const block_q5_K *x = (const block_q5_K *)(const void *)(W + r * wrow + b * sizeof(block_q5_K));
                const uint8_t *gb = P + (size_t)(r / R) * R * wrow + (size_t)b * gbb;
                const int l = (int)(r % R);
                for (int c = 0; c < 8; c++)
                    for (int i = 0; i < 4; i++) {
                        uint8_t U[8];
                        for (int n = 0; n < 8; n++)
                            U[n] = q5k_level(x, R == 8 ? 32 * (n / 2 * 2 + i / 2) + 4 * c + 2 * (n % 2) + i % 2
                                                       : 32 * n + 4 * c + i);
                        const uint8_t want[5] = {
                            (uint8_t)(U[0] | (U[5] & 7) << 5),
                            (uint8_t)(U[1] | (U[5] >> 3) << 5 | (U[6] >> 3 & 1) << 7),
                            (uint8_t)(U[2] | (U[6] & 7) << 5),
                            (uint8_t)(U[3] | (U[7] & 7) << 5),
                            (uint8_t)(U[4] | (U[7] >> 3) << 5 | (U[6] >> 4) << 7),
                        };
                        for (int j = 0; j < 5; j++)
                            assert_int_equal(gb[KQRP_Q5K_Q(R, c, j) + 4 * (size_t)l + (size_t)i], want[j]);
                    }
                for (int k = 0; k < 3; k++)
                    assert_memory_equal(gb + KQRP_Q5K_SC(R) + 4 * (size_t)(k * R + l), x->scales + 4 * k, 4);
                assert_memory_equal(gb + KQRP_Q5K_D(R) + 2 * (size_t)l, &x->d, 2);
                assert_memory_equal(gb + KQRP_Q5K_DMIN(R) + 2 * (size_t)l, &x->dmin, 2);
            }
        free(W), free(P);
    }
}

static void test_repack_refuses_what_does_not_fit(void **state)
{
    (void)state;
    const int R = quant_repack_rows();
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        enum quant_type t = k_types[ti];
#if defined(KQRP_HAVE_AVX2)
        assert_true(quant_repack_fits(t, R, QK_K));
        assert_true(quant_repack_fits(t, 2 * R + 1, 3 * QK_K));
#else
        assert_false(quant_repack_fits(t, R, QK_K));
#endif
        assert_false(quant_repack_fits(t, R - 1, QK_K));
        assert_false(quant_repack_fits(t, R, QK_K / 2));
        assert_false(quant_repack_fits(t, R, 0));
    }
    assert_false(quant_repack_fits(QUANT_IQ3_S, R, QK_K));
    uint8_t *buf = calloc((size_t)R, sizeof(block_q6_K));
    assert_non_null(buf);
    assert_int_equal(quant_repack(QUANT_Q4_K, R - 1, QK_K, buf), KS_ERR_INVALID_ARG);
    assert_int_equal(quant_repack(QUANT_IQ3_S, R, QK_K, buf), KS_ERR_INVALID_ARG);
    float y[QK_K];
    assert_int_equal(quant_get_row_repacked(buf, QUANT_Q4_K, R, QK_K, R, y), KS_ERR_INVALID_ARG);
    assert_int_equal(quant_get_row_repacked(buf, QUANT_Q4_K, R, QK_K, -1, y), KS_ERR_INVALID_ARG);
    free(buf);
}

typedef void (*kq_kernel_fn)(const struct quant_kq_gemm *g, int64_t g0, int64_t g1);

/* A group kernel on its layout of R rows against the scalar twin on the same
 * bytes, and the twin against the reference vec_dot, for 1 to 9 tokens in a
 * call; tokens in order and through xi (experts read shared rows), here in
 * reverse order. */
static void check_twin(kq_kernel_fn kernel, int R)
{
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        enum quant_type t = k_types[ti];
        const int64_t rows = 3 * R, cols = 5 * QK_K; /* the batch kernels' chunks of 4 super-blocks, and one more */
        size_t wrow = quant_row_size(t, cols), xrow = quant_row_size(QUANT_Q8_K, cols);
        uint8_t *W = random_matrix(t, rows, cols), *P = copy_of(W, wrow * (size_t)rows);
        assert_int_equal(quant_kqrp_repack_as(t, rows, cols, P, R), KS_OK);
        for (int64_t n = 1; n <= 9; n++) {
            float *X = random_tokens(n, cols);
            uint8_t *xq = q8k_rows(X, n, cols), *rev = malloc(xrow * (size_t)n);
            float *Ys = malloc((size_t)(n * rows) * sizeof(float)), *Yt = malloc((size_t)(n * rows) * sizeof(float));
            float *Yr = malloc((size_t)(n * rows) * sizeof(float));
            int32_t *xi = malloc((size_t)n * sizeof *xi);
            assert_true(rev && Ys && Yt && Yr && xi);
            struct quant_kq_gemm g = {.wtype = t, .W = P, .wrow = wrow, .cols = cols, .X = xq, .xrow = xrow,
                                      .n_tokens = n, .Y = Ys, .ldy = rows, .repacked = true, .rows = rows};
            kernel(&g, 0, rows / R);
            g.Y = Yt;
            quant_kqrp_rows_ref(&g, R, 0, rows / R);
            reference_matmul(t, W, rows, cols, X, n, Yr);
            assert_same_bits(Ys, Yt, n, rows, "SIMD kernel vs twin", t);
            assert_same_bits(Yt, Yr, n, rows, "twin vs reference", t);
            for (int64_t i = 0; i < n; i++) {
                xi[i] = (int32_t)(n - 1 - i);
                memcpy(rev + xi[i] * xrow, xq + i * xrow, xrow);
            }
            g.X = rev, g.xi = xi, g.Y = Yt;
            kernel(&g, 0, rows / R);
            assert_same_bits(Yt, Ys, n, rows, "SIMD kernel through xi", t);
            free(X), free(xq), free(rev), free(Ys), free(Yt), free(Yr), free(xi);
        }
        free(W), free(P);
    }
}

static void scalar_twin_16(const struct quant_kq_gemm *g, int64_t g0, int64_t g1) { quant_kqrp_rows_ref(g, 16, g0, g1); }

static void test_simd_kernels_match_scalar_twin(void **state)
{
    (void)state;
    int checked = 0;
#if defined(KQRP_HAVE_AVX512)
    check_twin(quant_kqrp_rows_avx512, 16);
    checked++;
#endif
#if defined(KQRP_HAVE_AVX2)
    check_twin(quant_kqrp_rows_avx2, 8);
    checked++;
#endif
    check_twin(scalar_twin_16, 16); /* the twin itself against the reference, in every build */
    print_message("%d SIMD k-quant group kernels checked against the scalar twin (isa %s)\n", checked, quant_isa());
}

/* quant_matmul_repacked at 1..40 tokens (and 65..67 where the AVX2 build
 * switches to the tiles): the reference's bits for every batch, whichever
 * kernel runs it; quant_matmul on the row-major matrix too. */
static void check_repacked(threads_pool *pool, enum quant_type t, int64_t rows, int64_t cols)
{
    if (!build_repacks(t))
        return;
    size_t wrow = quant_row_size(t, cols);
    uint8_t *W = random_matrix(t, rows, cols), *P = copy_of(W, wrow * (size_t)rows);
    assert_int_equal(quant_repack(t, rows, cols, P), KS_OK);
    const int64_t max_n = 67;
    float *X = random_tokens(max_n, cols);
    float *Yp = malloc((size_t)(max_n * rows) * sizeof(float)), *Yr = malloc((size_t)(max_n * rows) * sizeof(float));
    float *Yu = malloc((size_t)(max_n * rows) * sizeof(float));
    size_t ws = quant_matmul_work_size(t, cols, max_n);
    void *work = malloc(ws);
    assert_true(Yp && Yr && Yu && work);
    reference_matmul(t, W, rows, cols, X, max_n, Yr);
    for (int64_t n = 1; n <= max_n; n = n == 40 ? 65 : n + 1) {
        assert_int_equal(quant_matmul_repacked(pool, P, t, rows, cols, X, n, Yp, work, ws), KS_OK);
        assert_same_bits(Yp, Yr, n, rows, "matmul_repacked", t);
        if (n % 8 == 1 || n >= 65) {
            assert_int_equal(quant_matmul(pool, W, t, rows, cols, X, n, Yu, work, ws), KS_OK);
            assert_same_bits(Yu, Yr, n, rows, "matmul (row-major)", t);
        }
    }
    free(W), free(P), free(X), free(Yp), free(Yr), free(Yu), free(work);
}

static void test_repacked_matmul_matches_reference(void **state)
{
    (void)state;
    const int R = quant_repack_rows();
    /* 40 groups and a tail: threads take spans that shrink to one group (take_own_span) */
    const int64_t shapes[][2] = {{R, QK_K}, {3 * R + 5, 3 * QK_K}, {4 * R + R - 1, 2 * QK_K}, {64 + 3, 768},
                                 {40 * R + 3, QK_K}};
    for (int th = 1; th <= 3; th++) {
        threads_pool *pool;
        assert_int_equal(threads_create(th, &pool), KS_OK);
        for (size_t ti = 0; ti < N_TYPES; ti++)
            for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
                check_repacked(pool, k_types[ti], shapes[s][0], shapes[s][1]);
        threads_free(pool);
    }
    if (build_repacks(QUANT_Q4_K))
        print_message("repacked k-quant matmuls of this build (isa %s, groups of %d rows) checked at 1..40, 65..67 "
                      "tokens\n", quant_isa(), R);
    else
        print_message("this build (isa %s) repacks no k-quant: only the layout and the scalar twin are checked\n",
                      quant_isa());
}

/* Every row of a repacked matrix (groups and tail) looked up as floats: the row-major row's floats. */
static void test_row_lookup_reads_the_layout(void **state)
{
    (void)state;
    const int R = quant_repack_rows();
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        enum quant_type t = k_types[ti];
        int64_t rows = 2 * R + 3, cols = 3 * QK_K;
        if (!build_repacks(t))
            continue;
        size_t wrow = quant_row_size(t, cols);
        uint8_t *W = random_matrix(t, rows, cols), *P = copy_of(W, wrow * (size_t)rows);
        float *want = malloc((size_t)cols * sizeof(float)), *got = malloc((size_t)cols * sizeof(float));
        assert_true(want && got);
        assert_int_equal(quant_repack(t, rows, cols, P), KS_OK);
        for (int64_t r = 0; r < rows; r++) {
            assert_int_equal(quant_get_row(W, t, cols, r, want), KS_OK);
            assert_int_equal(quant_get_row_repacked(P, t, rows, cols, r, got), KS_OK);
            assert_memory_equal(got, want, (size_t)cols * sizeof(float));
        }
        free(W), free(P), free(want), free(got);
    }
}

/* The prefill panels unpacked from the layout are the bytes unpacked from
 * the row-major rows: whole panels, panels across a group boundary, short
 * ones, and ones reaching into the tail rows. */
static void test_panels_read_the_layout(void **state)
{
    (void)state;
    const int R = quant_repack_rows();
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        enum quant_type t = k_types[ti];
        const int64_t rows = 4 * R + 5, cols = 2 * QK_K;
        if (!build_repacks(t) || t == QUANT_IQ4_XS) /* IQ4_XS has no prefill tiles: its group kernels take every batch */
            continue;
        const int64_t at[][2] = {{0, 16}, {16, 16}, {R / 2, 16}, {8, 7}, {4 * R - 8, 13}, {4 * R, 5}, {3, 16}};
        size_t wrow = quant_row_size(t, cols), pbytes = quant_kq_panel_bytes(cols);
        uint8_t *W = random_matrix(t, rows, cols), *P = copy_of(W, wrow * (size_t)rows);
        uint8_t *want = malloc(pbytes), *got = malloc(pbytes);
        assert_true(want && got);
        assert_int_equal(quant_repack(t, rows, cols, P), KS_OK);
        for (size_t i = 0; i < sizeof at / sizeof at[0]; i++) {
            memset(got, 0xa5, pbytes); /* bytes neither writes (the other panel layout's) stay alike */
            memset(want, 0xa5, pbytes);
            quant_kq_unpack_panel(t, W + at[i][0] * wrow, wrow, (int)at[i][1], cols, want);
            quant_kqrp_unpack_panel(t, P, rows, cols, at[i][0], (int)at[i][1], got);
            if (memcmp(got, want, pbytes))
                fail_msg("%s: the panel of rows %lld + %lld differs", quant_type_name(t), (long long)at[i][0],
                         (long long)at[i][1]);
        }
        free(W), free(P), free(want), free(got);
    }
}

/* quant_matmul_set on repacked matrices (one of them with tail rows): each
 * output is quant_matmul_repacked's, for a decode step and batches. */
static void test_matmul_set_on_repacked(void **state)
{
    (void)state;
    const int R = quant_repack_rows();
    threads_pool *pool;
    assert_int_equal(threads_create(2, &pool), KS_OK);
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        enum quant_type t = k_types[ti];
        const int64_t cols = 2 * QK_K, rows[3] = {4 * R, 2 * R + 3, R};
        if (!build_repacks(t))
            continue;
        const int64_t batches[] = {1, 3, 16, 17, 33};
        uint8_t *P[3];
        for (int i = 0; i < 3; i++) {
            P[i] = random_matrix(t, rows[i], cols);
            assert_int_equal(quant_repack(t, rows[i], cols, P[i]), KS_OK);
        }
        for (size_t bi = 0; bi < sizeof batches / sizeof batches[0]; bi++) {
            int64_t n = batches[bi];
            float *X = random_tokens(n, cols);
            const struct quant_mm_out shape = {.type = t};
            size_t ws = quant_matmul_set_work_size(&shape, 1, cols, n); /* one type: one part */
            void *work = malloc(ws);
            struct quant_mm_out outs[3];
            float *want[3];
            for (int i = 0; i < 3; i++) {
                outs[i] = (struct quant_mm_out){.W = P[i], .type = t, .rows = rows[i], .repacked = true,
                                                .Y = malloc((size_t)(n * rows[i]) * sizeof(float))};
                want[i] = malloc((size_t)(n * rows[i]) * sizeof(float));
                assert_true(outs[i].Y && want[i]);
                assert_int_equal(quant_matmul_repacked(pool, P[i], t, rows[i], cols, X, n, want[i], work, ws), KS_OK);
            }
            assert_int_equal(quant_matmul_set(pool, cols, outs, 3, X, n, work, ws), KS_OK);
            for (int i = 0; i < 3; i++) {
                assert_memory_equal(outs[i].Y, want[i], (size_t)(n * rows[i]) * sizeof(float));
                free(outs[i].Y), free(want[i]);
            }
            free(X), free(work);
        }
        for (int i = 0; i < 3; i++)
            free(P[i]);
    }
    threads_free(pool);
}

/* quant_matmul_experts on repacked experts (each slice repacked on its own,
 * with tail rows), X rows shared through x_rows, one expert with enough
 * rows for the prefill tiles: each expert's rows are quant_matmul_repacked's
 * bits (a plain product and gate/up fused with SwiGLU). */
static void test_experts_on_repacked(void **state)
{
    (void)state;
    const int R = quant_repack_rows();
    threads_pool *pool;
    assert_int_equal(threads_create(2, &pool), KS_OK);
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        enum quant_type t = k_types[ti];
        enum { n_expert = 4, n_g = 74 };
        if (!build_repacks(t))
            continue;
        const int64_t rows = 4 * R + 3, cols = 3 * QK_K, n_x = 12;
        const int32_t start[n_expert + 1] = {0, 1, 1, 4, n_g}; /* expert 3: 70 rows, past the AVX2 group kernels' 64 */
        size_t wrow = quant_row_size(t, cols), stride = wrow * (size_t)rows + 64;
        uint8_t *W = calloc((size_t)n_expert, stride), *W2 = calloc((size_t)n_expert, stride);
        assert_true(W && W2);
        for (int e = 0; e < n_expert; e++)
            for (int m = 0; m < 2; m++) {
                uint8_t *dst = (m ? W2 : W) + (size_t)e * stride, *src = random_matrix(t, rows, cols);
                memcpy(dst, src, wrow * (size_t)rows);
                assert_int_equal(quant_repack(t, rows, cols, dst), KS_OK);
                free(src);
            }
        float *X = random_tokens(n_x, cols), *Xg = malloc((size_t)(n_g * cols) * sizeof(float));
        int32_t x_rows[n_g];
        for (int64_t g = 0; g < n_g; g++) {
            x_rows[g] = (int32_t)((g * 5) % n_x);
            memcpy(Xg + g * cols, X + x_rows[g] * cols, (size_t)cols * sizeof(float));
        }
        float *Y = malloc((size_t)(n_g * rows) * sizeof(float)), *Y2 = malloc((size_t)(n_g * rows) * sizeof(float));
        float *want = malloc((size_t)(n_g * rows) * sizeof(float)), *want2 = malloc((size_t)(n_g * rows) * sizeof(float));
        size_t ews = quant_matmul_experts_work_size(t, cols, n_x, n_g), mws = quant_matmul_work_size(t, cols, n_g);
        void *ework = malloc(ews), *mwork = malloc(mws);
        assert_true(Xg && Y && Y2 && want && want2 && ework && mwork);
        for (int e = 0; e < n_expert; e++) {
            int64_t n = start[e + 1] - start[e];
            if (!n)
                continue;
            assert_int_equal(quant_matmul_repacked(pool, W + (size_t)e * stride, t, rows, cols, Xg + start[e] * cols, n,
                                                   want + start[e] * rows, mwork, mws), KS_OK);
            assert_int_equal(quant_matmul_repacked(pool, W2 + (size_t)e * stride, t, rows, cols, Xg + start[e] * cols,
                                                   n, want2 + start[e] * rows, mwork, mws), KS_OK);
        }
        struct quant_moe_mm p = {.wtype = t, .rows = rows, .cols = cols, .W = W, .W2 = W2, .stride = stride,
                                 .n_expert = n_expert, .start = start, .X = X, .x_rows = x_rows, .n_x = n_x,
                                 .Y = Y, .Y2 = Y2, .swiglu = false, .repacked = true};
        assert_int_equal(quant_matmul_experts(pool, &p, ework, ews), KS_OK);
        assert_memory_equal(Y, want, (size_t)(n_g * rows) * sizeof(float));
        assert_memory_equal(Y2, want2, (size_t)(n_g * rows) * sizeof(float));
        p.swiglu = true;
        assert_int_equal(quant_matmul_experts(pool, &p, ework, ews), KS_OK);
        for (int64_t g = 0; g < n_g; g++)
            quant_swiglu(want + g * rows, want2 + g * rows, rows);
        for (int64_t i = 0; i < n_g * rows; i++) /* rows is not a multiple of 16: the vector lanes may split */
            if (fabsf(Y[i] - want[i]) > 1e-6f * fabsf(want[i]) + 1e-30f)
                fail_msg("%s experts swiglu: [%lld] %.9g vs %.9g", quant_type_name(t), (long long)i, Y[i], want[i]);
        free(W), free(W2), free(X), free(Xg), free(Y), free(Y2), free(want), free(want2), free(ework), free(mwork);
    }
    threads_free(pool);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_repack_keeps_every_block),
        cmocka_unit_test(test_q6k_packed_layouts),
        cmocka_unit_test(test_q5k_packed_layout),
        cmocka_unit_test(test_repack_refuses_what_does_not_fit),
        cmocka_unit_test(test_simd_kernels_match_scalar_twin),
        cmocka_unit_test(test_repacked_matmul_matches_reference),
        cmocka_unit_test(test_row_lookup_reads_the_layout),
        cmocka_unit_test(test_panels_read_the_layout),
        cmocka_unit_test(test_matmul_set_on_repacked),
        cmocka_unit_test(test_experts_on_repacked),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
