/* bench_kv_quant: cost per KV row of the quantizers kv_write and the
 * requantizer use, the plain one (from_float, llama.cpp's) and the scale
 * search (kv_from_float), single thread.
 *
 *   bench_kv_quant [head_dim [rows]]     default 128 200000
 *
 * Rows are random normal-ish values; the search's work does not depend much
 * on them. Prints ns per row and the search's extra time per token of a
 * model with 32 layers and 8 KV heads (K and V rows). Run with `nice` on a
 * shared machine. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "quant/quant.h"

enum { BENCH_LAYERS = 32, BENCH_KV_HEADS = 8 };

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts); /* CPU time: the machine may be shared */
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t rng = 88172645463325252ull;
static float next_value(void)
{
    float s = 0.0f;
    for (int i = 0; i < 4; i++) { /* a sum of uniforms: roughly normal */
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        s += (float)(rng >> 40) / (float)(1 << 24) - 0.5f;
    }
    return s;
}

static double ns_per_row(quant_from_float_fn fn, const float *x, void *y, int head_dim, int rows, size_t rb)
{
    double t0 = now_s();
    for (int r = 0; r < rows; r++)
        fn(x + (size_t)(r % 1024) * (size_t)head_dim, (char *)y + (size_t)(r % 1024) * rb, head_dim);
    return (now_s() - t0) * 1e9 / rows;
}

int main(int argc, char **argv)
{
    int head_dim = argc > 1 ? atoi(argv[1]) : 128;
    int rows = argc > 2 ? atoi(argv[2]) : 200000;
    if (head_dim <= 0 || head_dim % 32 != 0 || rows <= 0) {
        fprintf(stderr, "usage: bench_kv_quant [head_dim (a multiple of 32) [rows]]\n");
        return 2;
    }
    float *x = malloc((size_t)1024 * (size_t)head_dim * sizeof *x);
    void *y = malloc((size_t)1024 * quant_row_size(QUANT_Q8_0, head_dim));
    if (!x || !y)
        return 1;
    for (size_t i = 0; i < (size_t)1024 * (size_t)head_dim; i++)
        x[i] = next_value();
    const enum quant_type types[] = {QUANT_Q8_0, QUANT_Q5_1, QUANT_Q5_0, QUANT_Q4_1, QUANT_IQ4_NL, QUANT_Q4_0,
                                     QUANT_IQ3_NL};
    printf("head_dim %d, %d rows, single thread\n", head_dim, rows);
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        const struct quant_traits *tr = quant_traits(types[i]);
        size_t rb = quant_row_size(types[i], head_dim);
        double plain = ns_per_row(tr->from_float, x, y, head_dim, rows, rb);
        double search = ns_per_row(tr->kv_from_float, x, y, head_dim, rows, rb);
        double per_token_us = (search - plain) * 2.0 * BENCH_LAYERS * BENCH_KV_HEADS / 1e3;
        printf("%-6s plain %7.1f ns/row  search %7.1f ns/row  (+%.0f us per token at %d layers x %d KV heads)\n",
               tr->name, plain, search, per_token_us, BENCH_LAYERS, BENCH_KV_HEADS);
    }
    free(x);
    free(y);
    return 0;
}
