/* bench_kquant: single-thread GB/s of weight read for the k-quant vec_dot
 * kernels (Qn_K . Q8_K), one matrix-vector product = rows vec_dots.
 *
 *   bench_kquant [rows cols [cold_MiB]]     default 2048 8192 768
 *
 * "hot" repeats one rows x cols matrix (cache-resident when it fits);
 * "cold" walks copies totalling cold_MiB (about a llama-1b Q4_K_M model),
 * which is what decode sees. Weights are random bytes with sane f16 scales:
 * the kernels' speed does not depend on the values. Prints the median of
 * the repetitions. Run with `nice` on a shared machine.
 *
 * The types quant_repack takes (Q4_K, Q6_K, Q5_K) are then repacked and
 * timed on the group kernels the model runs them with (one token: "groups"
 * hot/cold GB/s; KQ_DOT_MAX_TOKENS tokens: ns per block-token), and the
 * prefill panels' unpacking from each layout. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "quant/kq_internal.h"

static uint64_t rng = 88172645463325252ull;
static uint64_t next_rand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

struct kernel {
    const char *isa;
    quant_vec_dot_fn fn;
};

struct btype {
    const char *name;
    size_t bytes, off_d, off_dmin; /* off_dmin == off_d when there is no dmin */
    struct kernel k[3];
};

#if defined(KQ_HAVE_AVX2)
#define AVX2(t) {"avx2", quant_vec_dot_##t##_q8_K_avx2}
#else
#define AVX2(t) {"avx2", NULL}
#endif
#if defined(KQ_HAVE_AVX512)
#define AVX512(t) {"avx512", quant_vec_dot_##t##_q8_K_avx512}
#else
#define AVX512(t) {"avx512", NULL}
#endif
#define BT_WITH(t, dmin, avx512)                                                                 \
    {#t, sizeof(block_##t), offsetof(block_##t, d), offsetof(block_##t, dmin),                   \
     {{"scalar", quant_vec_dot_##t##_q8_K_scalar}, AVX2(t), avx512}}
#define BT(t, dmin) BT_WITH(t, dmin, AVX512(t))
/* Q3_K, Q5_K, Q6_K: ggml's lane order has AVX2 kernels only (kq_scalar.c). */
#define BT_LANES(t, dmin) BT_WITH(t, dmin, AVX512_NONE)
#define AVX512_NONE {"avx512", NULL}

static const struct btype btypes[] = {
    BT(q2_K, dmin), BT_LANES(q3_K, d), BT(q4_K, dmin), BT_LANES(q5_K, dmin), BT_LANES(q6_K, d),
};

static void fill_random(const struct btype *bt, uint8_t *w, size_t nblocks)
{
    for (size_t i = 0; i < nblocks * bt->bytes; i++) w[i] = (uint8_t)next_rand();
    for (size_t i = 0; i < nblocks; i++) {
        const quant_f16 h = kq_f32_to_f16(0.001f); /* no NaN/inf scales */
        memcpy(w + i * bt->bytes + bt->off_d, &h, sizeof h);
        memcpy(w + i * bt->bytes + bt->off_dmin, &h, sizeof h);
    }
}

/* The machine's read bandwidth on the same buffer: a plain vectorizable sum. */
static double time_read(const uint8_t *w, size_t bytes, int reps, float *sink)
{
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        const double t0 = bench_seconds(CLOCK_MONOTONIC);
        uint64_t acc[8] = {0};
        const uint64_t *p = (const uint64_t *)w;
        for (size_t i = 0; i + 8 <= bytes / 8; i += 8)
            for (int j = 0; j < 8; j++) acc[j] += p[i + j];
        const double t = bench_seconds(CLOCK_MONOTONIC) - t0;
        if (t < best) best = t;
        for (int j = 0; j < 8; j++) *sink += (float)acc[j];
    }
    return best;
}

/* Median seconds for one pass of `passes` matrix-vector products over the
 * matrices starting at w, each rows x row_bytes, taken round-robin. */
static double time_matvec(quant_vec_dot_fn fn, const uint8_t *w, int n_mats, int rows, int cols,
                          size_t row_bytes, const block_q8_K *y, int reps, float *sink)
{
    double t[32];
    if (reps > 32) reps = 32;
    for (int r = 0; r < reps; r++) {
        const double t0 = bench_seconds(CLOCK_MONOTONIC);
        for (int m = 0; m < n_mats; m++) {
            const uint8_t *mat = w + (size_t)m * rows * row_bytes;
            for (int i = 0; i < rows; i++) {
                float s;
                fn(cols, &s, mat + (size_t)i * row_bytes, y);
                *sink += s;
            }
        }
        t[r] = (bench_seconds(CLOCK_MONOTONIC) - t0) / n_mats;
    }
    qsort(t, (size_t)reps, sizeof t[0], bench_cmp_double);
    return t[reps / 2];
}

/* Prefill kernel: one row x KQ_DOT_MAX_TOKENS tokens, hot matrix. */
static void print_multi(const struct btype *bt, quant_kq_dot_multi_fn multi, const uint8_t *w, int rows, int cols,
                        size_t row_bytes, const block_q8_K *y, float *sink)
{
    double t[15];
    const int reps = 15, nt = KQ_DOT_MAX_TOKENS;
    const size_t y_stride = sizeof(block_q8_K) * (size_t)(cols / QK_K);
    for (int r = 0; r < reps; r++) {
        const double t0 = bench_seconds(CLOCK_MONOTONIC);
        for (int i = 0; i < rows; i++) {
            float s[KQ_DOT_MAX_TOKENS];
            multi(cols, nt, s, 1, w + (size_t)i * row_bytes, y, y_stride);
            *sink += s[0];
        }
        t[r] = bench_seconds(CLOCK_MONOTONIC) - t0;
    }
    qsort(t, (size_t)reps, sizeof t[0], bench_cmp_double);
    const double blocks = (double)rows * (cols / QK_K) * nt;
    printf("%-6s %-7s %10s %10s %12.2f   (prefill, x%d tokens, ns per block-token)\n", bt->name, "multi", "-", "-",
           t[reps / 2] / blocks * 1e9, nt);
}

/* ---- repacked (quant_repack's layout, kq_repack*.c) ---------------------------- */

#ifndef BATCH_TOKENS
#define BATCH_TOKENS 64 /* a prefill batch (-DBATCH_TOKENS=512 for pp512's) */
#endif
#define CHUNK_GROUPS 8 /* groups per call, as a thread's chunk of quant_matmul (llama-1b, 2 threads) */

/* Median seconds of one matrix x nt tokens by the group kernels over the
 * repacked matrices starting at w, taken round-robin. */
static double time_groups(enum quant_type t, const uint8_t *w, int n_mats, int rows, int cols, size_t row_bytes,
                          const block_q8_K *y, int nt, int reps, float *sink)
{
    double tm[32];
    float *out = malloc(sizeof(float) * (size_t)rows * (size_t)nt);
    if (!out) return 0;
    if (reps > 32) reps = 32;
    for (int r = 0; r < reps; r++) {
        const double t0 = bench_seconds(CLOCK_MONOTONIC);
        for (int m = 0; m < n_mats; m++) {
            const struct quant_kq_gemm g = {
                .wtype = t, .W = w + (size_t)m * rows * row_bytes, .wrow = row_bytes, .cols = cols,
                .X = (const uint8_t *)y, .xrow = sizeof(block_q8_K) * (size_t)(cols / QK_K), .n_tokens = nt,
                .Y = out, .ldy = rows, .repacked = true, .rows = rows,
            };
            for (int64_t g0 = 0; g0 < rows / QUANT_RP_ROWS; g0 += CHUNK_GROUPS)
                quant_kqrp_rows(&g, g0, g0 + CHUNK_GROUPS < rows / QUANT_RP_ROWS ? g0 + CHUNK_GROUPS : rows / QUANT_RP_ROWS);
            quant_kqrp_tail_rows(&g, rows);
            *sink += out[0];
        }
        tm[r] = (bench_seconds(CLOCK_MONOTONIC) - t0) / n_mats;
    }
    free(out);
    qsort(tm, (size_t)reps, sizeof tm[0], bench_cmp_double);
    return tm[reps / 2];
}

/* Median seconds to unpack every row of one matrix into prefill panels,
 * from the row-major rows or from the repacked layout. */
static double time_panels(enum quant_type t, const uint8_t *w, bool repacked, int rows, int cols, size_t row_bytes,
                          uint8_t *panel, int reps, float *sink)
{
    double tm[32];
    if (reps > 32) reps = 32;
    for (int r = 0; r < reps; r++) {
        const double t0 = bench_seconds(CLOCK_MONOTONIC);
        for (int r0 = 0; r0 < rows; r0 += KQ_PANEL_ROWS) {
            const int nr = rows - r0 < KQ_PANEL_ROWS ? rows - r0 : KQ_PANEL_ROWS;
            if (repacked)
                quant_kqrp_unpack_panel(t, w, rows, cols, r0, nr, panel);
            else
                quant_kq_unpack_panel(t, w + (size_t)r0 * row_bytes, row_bytes, nr, cols, panel);
            *sink += (float)panel[r0 % 64];
        }
        tm[r] = bench_seconds(CLOCK_MONOTONIC) - t0;
    }
    qsort(tm, (size_t)reps, sizeof tm[0], bench_cmp_double);
    return tm[reps / 2];
}

/* Median seconds of one matrix x nt tokens by the prefill tiles (panels
 * unpacked from either layout, as quant_matmul runs them). */
static double time_tiles(enum quant_type t, const uint8_t *w, bool repacked, int rows, int cols, size_t row_bytes,
                         const block_q8_K *y, int nt, int reps, float *sink)
{
    double tm[32];
    const quant_kq_tiles_fn tiles = quant_kq_tiles_best();
    float *out = malloc(sizeof(float) * (size_t)rows * (size_t)nt);
    uint8_t *scratch = aligned_alloc(64, quant_kq_scratch_bytes(cols));
    if (!tiles || !out || !scratch) {
        free(out), free(scratch);
        return 0;
    }
    if (reps > 32) reps = 32;
    const struct quant_kq_gemm g = {
        .wtype = t, .W = w, .wrow = row_bytes, .cols = cols, .X = (const uint8_t *)y,
        .xrow = sizeof(block_q8_K) * (size_t)(cols / QK_K), .n_tokens = nt, .Y = out, .ldy = rows,
        .repacked = repacked, .rows = rows,
    };
    for (int r = 0; r < reps; r++) {
        const double t0 = bench_seconds(CLOCK_MONOTONIC);
        quant_kq_gemm_rows(&g, tiles, 0, rows, scratch);
        *sink += out[0];
        tm[r] = bench_seconds(CLOCK_MONOTONIC) - t0;
    }
    free(out), free(scratch);
    qsort(tm, (size_t)reps, sizeof tm[0], bench_cmp_double);
    return tm[reps / 2];
}

/* The same matrices repacked (in place): the group kernels for one token (hot
 * and cold GB/s, as the vec_dot lines), for KQ_DOT_MAX_TOKENS tokens (ns per
 * block-token, as the multi line), and the prefill panels' unpacking from
 * either layout (ns per row-block). */
static void print_repacked(const struct btype *bt, enum quant_type t, uint8_t *w, int n_cold, int rows, int cols,
                           size_t row_bytes, const block_q8_K *y, const block_q8_K *y_multi, const block_q8_K *y_batch,
                           float *sink)
{
    const size_t mat_bytes = row_bytes * (size_t)rows;
    const double blocks = (double)rows * (cols / QK_K);
    uint8_t *panel = aligned_alloc(64, quant_kq_panel_bytes(cols));
    if (!panel) return;
    const double rowmajor_unpack = time_panels(t, w, false, rows, cols, row_bytes, panel, 5, sink);
    const double rowmajor_tiles = time_tiles(t, w, false, rows, cols, row_bytes, y_batch, BATCH_TOKENS, 3, sink);
    for (int m = 0; m < n_cold; m++)
        if (quant_kqrp_repack_as(t, rows, cols, w + (size_t)m * mat_bytes, QUANT_RP_ROWS)) return;
    time_groups(t, w, 1, rows, cols, row_bytes, y, 1, 1, sink); /* warm up */
    const double hot = time_groups(t, w, 1, rows, cols, row_bytes, y, 1, 15, sink);
    const double cold = time_groups(t, w, n_cold, rows, cols, row_bytes, y, 1, 5, sink);
    printf("%-6s %-7s %10.2f %10.2f %12.2f   (repacked, %d-row groups)\n", bt->name, "groups", mat_bytes / hot / 1e9,
           mat_bytes / cold / 1e9, hot / blocks * 1e9, QUANT_RP_ROWS);
    const double multi = time_groups(t, w, 1, rows, cols, row_bytes, y_multi, KQ_DOT_MAX_TOKENS, 15, sink);
    printf("%-6s %-7s %10s %10s %12.2f   (repacked prefill, x%d tokens, ns per block-token)\n", bt->name, "groups",
           "-", "-", multi / blocks / KQ_DOT_MAX_TOKENS * 1e9, KQ_DOT_MAX_TOKENS);
    const double repacked_unpack = time_panels(t, w, true, rows, cols, row_bytes, panel, 5, sink);
    const double groups_batch = time_groups(t, w, 1, rows, cols, row_bytes, y_batch, BATCH_TOKENS, 3, sink);
    const double tiles_batch = time_tiles(t, w, true, rows, cols, row_bytes, y_batch, BATCH_TOKENS, 3, sink);
    printf("%-6s %-7s %10s %10s %12.2f   (repacked prefill, x%d tokens, ns per block-token)\n", bt->name, "groups",
           "-", "-", groups_batch / blocks / BATCH_TOKENS * 1e9, BATCH_TOKENS);
    printf("%-6s %-7s %10s %10s %12.2f   (repacked prefill tiles, x%d tokens, ns per block-token)\n", bt->name,
           "tiles", "-", "-", tiles_batch / blocks / BATCH_TOKENS * 1e9, BATCH_TOKENS);
    printf("%-6s %-7s %10s %10s %12.2f   (row-major prefill tiles, x%d tokens, ns per block-token)\n", bt->name,
           "tiles", "-", "-", rowmajor_tiles / blocks / BATCH_TOKENS * 1e9, BATCH_TOKENS);
    printf("%-6s %-7s %10s %10s %12.2f   (prefill panels from row-major rows, ns per row-block)\n", bt->name, "unpack",
           "-", "-", rowmajor_unpack / blocks * 1e9);
    printf("%-6s %-7s %10s %10s %12.2f   (prefill panels from the repacked layout, ns per row-block)\n", bt->name,
           "unpack", "-", "-", repacked_unpack / blocks * 1e9);
    free(panel);
}

int main(int argc, char **argv)
{
    int rows = 2048, cols = 8192, cold_mib = 768;
    if (argc >= 3) {
        rows = atoi(argv[1]);
        cols = atoi(argv[2]);
    }
    if (argc >= 4) cold_mib = atoi(argv[3]);
    if (rows <= 0 || cols <= 0 || cols % QK_K != 0 || cold_mib < 0) {
        fprintf(stderr, "usage: bench_kquant [rows cols [cold_MiB]]  (cols a multiple of %d)\n", QK_K);
        return 2;
    }
    float *act = malloc(sizeof(float) * (size_t)cols);
    block_q8_K *y = malloc(sizeof(block_q8_K) * (size_t)(cols / QK_K));
    if (!act || !y) return 1;
    for (int i = 0; i < cols; i++) act[i] = (float)((int)(next_rand() % 2001) - 1000) / 1000.f;
    quant_quantize_row_q8_K(act, y, cols);
    /* prefill: KQ_DOT_MAX_TOKENS copies of the activation row */
    block_q8_K *y_multi = malloc(sizeof(block_q8_K) * (size_t)(cols / QK_K) * KQ_DOT_MAX_TOKENS);
    if (!y_multi) return 1;
    for (int t = 0; t < KQ_DOT_MAX_TOKENS; t++) memcpy(y_multi + t * (cols / QK_K), y, sizeof(block_q8_K) * (size_t)(cols / QK_K));

    /* a prefill batch: BATCH_TOKENS copies */
    block_q8_K *y_batch = malloc(sizeof(block_q8_K) * (size_t)(cols / QK_K) * BATCH_TOKENS);
    if (!y_batch) return 1;
    for (int t = 0; t < BATCH_TOKENS; t++) memcpy(y_batch + t * (cols / QK_K), y, sizeof(block_q8_K) * (size_t)(cols / QK_K));
    printf("single thread, %d x %d, median of reps; GB/s = weight bytes read / time\n", rows, cols);
    printf("%-6s %-7s %10s %10s %12s\n", "type", "kernel", "hot GB/s", "cold GB/s", "ns/block hot");
    float sink = 0;
    for (size_t b = 0; b < sizeof btypes / sizeof btypes[0]; b++) {
        const struct btype *bt = &btypes[b];
        const size_t row_bytes = bt->bytes * (size_t)(cols / QK_K);
        const size_t mat_bytes = row_bytes * (size_t)rows;
        int n_cold = (int)(((size_t)cold_mib << 20) / mat_bytes);
        if (n_cold < 1) n_cold = 1;
        uint8_t *w = malloc(mat_bytes * (size_t)n_cold);
        if (!w) {
            fprintf(stderr, "out of memory for %d copies of %zu bytes\n", n_cold, mat_bytes);
            return 1;
        }
        fill_random(bt, w, (mat_bytes / bt->bytes) * (size_t)n_cold);
        if (b == 0) {
            const double t = time_read(w, mat_bytes * (size_t)n_cold, 5, &sink);
            printf("%-6s %-7s %10s %10.2f %12s\n", "-", "memread", "-", mat_bytes * (double)n_cold / t / 1e9, "-");
        }
        for (int k = 0; k < 3; k++) {
            if (!bt->k[k].fn) continue;
            const bool slow = k == 0;
            time_matvec(bt->k[k].fn, w, 1, rows, cols, row_bytes, y, 1, &sink); /* warm up */
            const double hot = time_matvec(bt->k[k].fn, w, 1, rows, cols, row_bytes, y, slow ? 3 : 15, &sink);
            const double cold = slow ? 0 : time_matvec(bt->k[k].fn, w, n_cold, rows, cols, row_bytes, y, 5, &sink);
            const double blocks = (double)rows * (cols / QK_K);
            printf("%-6s %-7s %10.2f ", bt->name, bt->k[k].isa, mat_bytes / hot / 1e9);
            if (slow) printf("%10s ", "-");
            else printf("%10.2f ", mat_bytes / cold / 1e9);
            printf("%12.2f\n", hot / blocks * 1e9);
            fflush(stdout);
        }
        const quant_kq_dot_multi_fn multi = quant_kquants_dot_multi(b == 2 ? QUANT_Q4_K : b == 4 ? QUANT_Q6_K : QUANT_F32);
        if (multi) print_multi(bt, multi, w, rows, cols, row_bytes, y_multi, &sink);
        const enum quant_type types[] = {QUANT_Q2_K, QUANT_Q3_K, QUANT_Q4_K, QUANT_Q5_K, QUANT_Q6_K};
        if (quant_kqrp_type(types[b]) && rows >= QUANT_RP_ROWS)
            print_repacked(bt, types[b], w, n_cold, rows, cols, row_bytes, y, y_multi, y_batch, &sink);
        free(w);
    }
    fprintf(stderr, "(checksum %g)\n", (double)sink);
    free(act);
    free(y);
    free(y_multi);
    free(y_batch);
    return 0;
}
