/* The KV cache types beyond f32/f16/q8_0/q4_0 (bf16, q4_1, q5_0, q5_1,
 * iq4_nl): quant's reference quantizers make llama.cpp's bytes, its
 * dequantizers agree with a decoder written here from the block formats, and
 * kv lists the types in falling precision. kvserve's own iq3_nl has no
 * llama.cpp bytes to match: its decoder here is written from quant.h's
 * layout, and its search's error is held to the 3-bit Lloyd-Max bound. (The ladder's tests are in
 * test_kv_policy.c.) */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kv/kv.h"
#include "kv_type_blocks.h"

static void blocks_input(float *x)
{
    for (int i = 0; i < KV_BLOCKS_N; i++)
        memcpy(&x[i], &kv_blocks_input[i], sizeof x[i]);
}

/* llama.cpp's reference quantizers (ggml_quantize_chunk, build b10470) made
 * these bytes of the same input: every block, byte for byte. */
static void expect_llamacpp_bytes(enum quant_type t, const uint8_t *want, size_t n)
{
    static float x[KV_BLOCKS_N];
    static uint8_t got[KV_BLOCKS_N * 4];
    blocks_input(x);
    assert_int_equal(quant_row_size(t, KV_BLOCKS_N), n);
    quant_traits_scalar(t)->from_float(x, got, KV_BLOCKS_N);
    for (size_t i = 0; i < n; i++)
        if (got[i] != want[i])
            fail_msg("%s: byte %zu (block %zu) is 0x%02x, llama.cpp's 0x%02x", quant_type_name(t), i,
                     i / quant_traits(t)->block_bytes, got[i], want[i]);
    /* the best table quantizes KV rows the same way */
    memset(got, 0, sizeof got);
    quant_traits(t)->from_float(x, got, KV_BLOCKS_N);
    assert_memory_equal(got, want, n);
}

static void test_bytes_match_llamacpp(void **state)
{
    (void)state;
    expect_llamacpp_bytes(QUANT_BF16, kv_blocks_bf16, sizeof kv_blocks_bf16);
    expect_llamacpp_bytes(QUANT_Q4_1, kv_blocks_q4_1, sizeof kv_blocks_q4_1);
    expect_llamacpp_bytes(QUANT_Q5_0, kv_blocks_q5_0, sizeof kv_blocks_q5_0);
    expect_llamacpp_bytes(QUANT_Q5_1, kv_blocks_q5_1, sizeof kv_blocks_q5_1);
    expect_llamacpp_bytes(QUANT_IQ4_NL, kv_blocks_iq4_nl, sizeof kv_blocks_iq4_nl);
    expect_llamacpp_bytes(QUANT_Q4_0, kv_blocks_q4_0, sizeof kv_blocks_q4_0);
    expect_llamacpp_bytes(QUANT_Q8_0, kv_blocks_q8_0, sizeof kv_blocks_q8_0);
}

/* ---- an independent decoder, from the block formats ------------------------ */

static float half(const uint8_t *p)
{
    uint16_t h = (uint16_t)(p[0] | p[1] << 8);
    int e = (h >> 10) & 31, m = h & 1023;
    float v = e == 0 ? ldexpf((float)m, -24) : ldexpf((float)(m | 1024), e - 25);
    return h & 0x8000 ? -v : v;
}

static uint32_t le32(const uint8_t *p) { return (uint32_t)p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24; }

/* Value j of the 32 of one block: byte layouts as ggml-common.h defines them. */
static float decode_value(enum quant_type t, const uint8_t *blk, int j)
{
    static const int iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
    int nib_at = t == QUANT_Q4_1 ? 4 : t == QUANT_Q5_0 ? 6 : t == QUANT_Q5_1 ? 8 : 2;
    int nib = j < 16 ? blk[nib_at + j] & 15 : blk[nib_at + j - 16] >> 4;
    float d = half(blk);
    switch (t) {
    case QUANT_Q4_1: return d * nib + half(blk + 2);
    case QUANT_Q5_0: return d * ((nib | (int)((le32(blk + 2) >> j) & 1) << 4) - 16);
    case QUANT_Q5_1: return d * (nib | (int)((le32(blk + 4) >> j) & 1) << 4) + half(blk + 2);
    case QUANT_IQ4_NL: return d * iq4nl[nib];
    case QUANT_IQ3_NL: {
        static const int iq3nl[8] = {-127, -79, -45, -14, 14, 45, 79, 127};
        int idx = ((blk[2 + j % 8] >> (2 * (j / 8))) & 3) | (int)((le32(blk + 10) >> j) & 1) << 2;
        return d * iq3nl[idx];
    }
    default: fail_msg("not a 32-block type here"); return 0;
    }
}

/* Dequantization matches the decoder, and the round trip error is within the
 * format's step: half a level for the _1 types; a level for q5_0 (its
 * positive end, 15 d, clips a value at -max); for iq4_nl, 14 d (its levels
 * end at 113 on the side opposite -127, and are up to 24 apart); for iq3_nl,
 * 24 d (half its widest gap, 79..127, with amax on +-127); plus 1e-6
 * for scales that f16 cannot hold (the 1e-7 block: d and m round to
 * subnormals or zero). */
static void test_dequantize_matches_format(void **state)
{
    (void)state;
    const enum quant_type types[] = {QUANT_Q4_1, QUANT_Q5_0, QUANT_Q5_1, QUANT_IQ4_NL, QUANT_IQ3_NL};
    static float x[KV_BLOCKS_N], y[KV_BLOCKS_N];
    static uint8_t q[KV_BLOCKS_N * 4];
    blocks_input(x);
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        enum quant_type t = types[ti];
        size_t bb = quant_traits(t)->block_bytes;
        quant_traits_scalar(t)->from_float(x, q, KV_BLOCKS_N);
        quant_traits_scalar(t)->to_float(q, y, KV_BLOCKS_N);
        for (int b = 0; b < KV_BLOCKS_N / 32; b++) {
            float d = half(q + b * bb);
            float step = fabsf(d) * (t == QUANT_IQ3_NL   ? 24.0f
                                     : t == QUANT_IQ4_NL ? 14.0f
                                     : t == QUANT_Q5_0   ? 1.0f
                                                         : 0.5f);
            for (int j = 0; j < 32; j++) {
                float want = decode_value(t, q + b * bb, j), xi = x[b * 32 + j];
                assert_float_equal(y[b * 32 + j], want, 1e-6f * fabsf(want));
                if (fabsf(y[b * 32 + j] - xi) > step * 1.01f + 1e-3f * fabsf(xi) + 1e-6f)
                    fail_msg("%s block %d value %d: %g became %g (d %g)", quant_type_name(t), b, j, xi,
                             y[b * 32 + j], d);
            }
        }
    }
    /* bf16: the top half of the f32, rounded to nearest even */
    quant_traits_scalar(QUANT_BF16)->from_float(x, q, KV_BLOCKS_N);
    for (int i = 0; i < KV_BLOCKS_N; i++) {
        uint32_t u;
        memcpy(&u, &x[i], sizeof u);
        uint16_t want = (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
        assert_int_equal(q[2 * i] | q[2 * i + 1] << 8, want);
    }
}

/* ---- iq3_nl's quantizer --------------------------------------------------- */

/* Unit Gaussian values (what rotated KV rows look like), from a fixed seed. */
static void gaussian(float *x, int n)
{
    uint64_t st = 0x9E3779B97F4A7C15ull;
    for (int i = 0; i < n; i += 2) {
        double u[2];
        for (int k = 0; k < 2; k++) {
            st = st * 6364136223846793005ull + 1442695040888963407ull;
            u[k] = ((double)(st >> 11) + 0.5) / 9007199254740992.0;
        }
        double r = sqrt(-2.0 * log(u[0]));
        x[i] = (float)(r * cos(6.283185307179586 * u[1]));
        if (i + 1 < n)
            x[i + 1] = (float)(r * sin(6.283185307179586 * u[1]));
    }
}

static double mse(enum quant_type t, const float *x, const uint8_t *q, int n)
{
    static float y[4096];
    quant_traits_scalar(t)->to_float(q, y, n);
    double e = 0.0;
    for (int i = 0; i < n; i++)
        e += ((double)x[i] - y[i]) * ((double)x[i] - y[i]);
    return e / n;
}

/* On Gaussian blocks the searched rows beat the Lloyd-Max error of 8 levels
 * under one scale for the whole distribution (0.03455: each block's own
 * scale adds half a bit per value; measured 0.0255), the plain rows (amax on
 * the outer level, measured 0.0311) are clearly worse, and a row takes 3.5
 * bits per value. */
static void test_iq3_nl_error(void **state)
{
    (void)state;
    enum { N = 4096 };
    static float x[N];
    static uint8_t plain[N], search[N];
    gaussian(x, N);
    const struct quant_traits *tr = quant_traits(QUANT_IQ3_NL);
    tr->from_float(x, plain, N);
    tr->kv_from_float(x, search, N);
    double ep = mse(QUANT_IQ3_NL, x, plain, N), es = mse(QUANT_IQ3_NL, x, search, N);
    print_message("iq3_nl mse on N(0,1): plain %.5f, search %.5f\n", ep, es);
    assert_true(es < 0.03455);
    assert_true(es < 0.9 * ep);
    assert_int_equal(quant_row_size(QUANT_IQ3_NL, N) * 8, (size_t)N * 7 / 2);
}

/* ---- the type list ---------------------------------------------------------- */

static void test_type_order_and_names(void **state)
{
    (void)state;
    const char *names[KV_N_TYPES] = {"f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "iq4_nl", "q4_0", "iq3_nl"};
    for (int i = 0; i < KV_N_TYPES; i++) {
        assert_string_equal(quant_type_name(kv_type_at(i)), names[i]);
        assert_int_equal(kv_type_index(kv_type_at(i)), i);
    }
    assert_int_equal(kv_type_index(QUANT_Q4_K), -1);
    char joined[128] = "";
    for (int i = 0; i < KV_N_TYPES; i++) {
        strcat(joined, i ? ", " : "");
        strcat(joined, quant_type_name(kv_type_at(i)));
    }
    assert_string_equal(kv_type_names(), joined); /* the messages' list is the table's */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bytes_match_llamacpp),
        cmocka_unit_test(test_dequantize_matches_format),
        cmocka_unit_test(test_type_order_and_names),
        cmocka_unit_test(test_iq3_nl_error),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
