/* bench_matmul: quant_matmul speed on the weight shapes of real models.
 *
 *   bench_matmul [-t THREADS] [-r REPS] [-p PREFILL_TOKENS] [-n DECODE_TOKENS] [--type q4_0,q8_0,f16,q4_K]
 *                (any type name quant_type_from_name knows, e.g. mxfp4, iq4_nl)
 *                [--model llama-1b|qwen3-0.6b|gemma3-1b] [--cpu] [--no-repack] [--hot]
 *   bench_matmul --gguf FILE [-t THREADS] [-r REPS] [-n DECODE_TOKENS] [--no-repack]
 *
 * Q4_0 / Q8_0 / IQ4_NL / MXFP4 / Q5_0 / Q5_1 weights are repacked as the model loader repacks them
 * (quant_repack) where the shape allows; --no-repack keeps them row-major.
 * Decode (-n tokens, default 1: one decode stream; 2-16: as many streams
 * batched) reports GB/s of weight bytes read; the weights are cycled
 * through enough copies (>= 512 MB) that they come from DRAM, as in a real
 * forward pass (--hot: one copy, read from cache, to see how far a kernel is
 * from being compute-bound). Prefill (-p tokens, default 512) reports GFLOP/s (2 per
 * multiply-add) and tokens/s. Each figure is the median of REPS runs.
 *
 * --gguf: a model file's own layer matrices (attn_q, attn_k, attn_v,
 * attn_output, ffn_gate, ffn_up, ffn_down of every layer that has them),
 * repacked as the loader repacks them, run in a decode step's order, layer
 * after layer: per matrix name, its mean time a layer and GB/s over the layers
 * (median of REPS passes; a type marked + differs between layers). One shape over and over (the synthetic mode) can hide what the
 * order of a real step costs: there the AVX-512 q4_0 kernel's 8 KiB prefetch
 * distance cost 9% a layer (659 against 603 us at 4 KiB) that the synthetic
 * mode did not show. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "gguf/gguf.h"
#include "quant/quant.h"
#include "threads/threads.h"

struct shape {
    const char *model, *name;
    int64_t cols, rows; /* in -> out */
    int per_token;      /* how many times one token runs it: per layer x layers, or 1 */
};

/* llama-1b: 16 layers; qwen3-0.6b: 28 layers. */
static const struct shape k_shapes[] = {
    {"llama-1b", "attn_q/o 2048->2048", 2048, 2048, 2 * 16},
    {"llama-1b", "attn_k/v 2048->512", 2048, 512, 2 * 16},
    {"llama-1b", "ffn_up/gate 2048->8192", 2048, 8192, 2 * 16},
    {"llama-1b", "ffn_down 8192->2048", 8192, 2048, 16},
    {"llama-1b", "output 2048->128256", 2048, 128256, 1},
    {"qwen3-0.6b", "attn_q 1024->2048", 1024, 2048, 28},
    {"qwen3-0.6b", "attn_k/v 1024->1024", 1024, 1024, 2 * 28},
    {"qwen3-0.6b", "attn_o 2048->1024", 2048, 1024, 28},
    {"qwen3-0.6b", "ffn_up/gate 1024->3072", 1024, 3072, 2 * 28},
    {"qwen3-0.6b", "ffn_down 3072->1024", 3072, 1024, 28},
    {"qwen3-0.6b", "output 1024->151669", 1024, 151669, 1},
    /* gemma3-1b: 26 layers, 1152 wide (not a multiple of 256: its Q4_K_M keeps q/k/v/gate/up at q5_0) */
    {"gemma3-1b", "attn_q 1152->1024", 1152, 1024, 26},
    {"gemma3-1b", "attn_k/v 1152->256", 1152, 256, 2 * 26},
    {"gemma3-1b", "attn_o 1024->1152", 1024, 1152, 26},
    {"gemma3-1b", "ffn_up/gate 1152->6912", 1152, 6912, 2 * 26},
    {"gemma3-1b", "ffn_down 6912->1152", 6912, 1152, 26},
    {"gemma3-1b", "output 1152->262144", 1152, 262144, 1},
};

/* Per model and type: sums of median times weighted by per_token. */
struct totals {
    double dec_s, dec_bytes, pre_s_no_output, pre_tokens;
};

/* --cpu: time by process CPU time instead of wall time, to compare kernels
 * on a machine shared with other jobs (meaningful with -t 1 only). */
static clockid_t g_clock = CLOCK_MONOTONIC;
static bool g_repack = true;
static bool g_hot = false; /* --hot: one copy of the weights, from cache: the kernel's compute bound */

static bool repacked(enum quant_type t, const struct shape *s)
{
    return g_repack && quant_repack_fits(t, s->rows, s->cols);
}

static ks_status matmul(threads_pool *pool, const void *W, enum quant_type t, const struct shape *s, const float *X,
                        int64_t n, float *Y, void *work, size_t ws)
{
    if (repacked(t, s))
        return quant_matmul_repacked(pool, W, t, s->rows, s->cols, X, n, Y, work, ws);
    return quant_matmul(pool, W, t, s->rows, s->cols, X, n, Y, work, ws);
}

/* One random row quantized, then replicated: speed does not depend on values. */
static void *make_weights(enum quant_type t, int64_t rows, int64_t cols, size_t *bytes)
{
    const struct quant_traits *tr = quant_traits(t);
    size_t wrow = quant_row_size(t, cols);
    *bytes = wrow * (size_t)rows;
    /* huge pages, as the model loader asks for (gguf_open_private) */
    size_t huge = 2u << 20, alloc = (*bytes + huge - 1) / huge * huge;
    uint8_t *w = aligned_alloc(huge, alloc);
    if (w)
        (void)madvise(w, alloc, MADV_HUGEPAGE);
    float *x = malloc((size_t)cols * sizeof(float));
    if (!w || !x || !tr->from_float) {
        free(w);
        free(x);
        return NULL;
    }
    srand(1);
    for (int64_t r = 0; r < 4 && r < rows; r++) {
        for (int64_t c = 0; c < cols; c++)
            x[c] = (float)rand() / (float)RAND_MAX - 0.5f;
        tr->from_float(x, w + r * wrow, cols);
    }
    for (int64_t r = 4; r < rows; r++)
        memcpy(w + r * wrow, w + (r % 4) * wrow, wrow);
    free(x);
    return w;
}

static int run_shape(threads_pool *pool, enum quant_type t, const struct shape *s, int reps, int64_t ntok,
                     int64_t ndec, struct totals *tot)
{
    size_t bytes;
    int ncopies = 1;
    while (!g_hot && (size_t)ncopies * quant_row_size(t, s->cols) * (size_t)s->rows < (512u << 20) && ncopies < 256)
        ncopies++;
    void **w = calloc((size_t)ncopies, sizeof *w);
    for (int i = 0; i < ncopies; i++)
        if (!(w[i] = make_weights(t, s->rows, s->cols, &bytes)) ||
            (repacked(t, s) && quant_repack(t, s->rows, s->cols, w[i]) != KS_OK))
            return fprintf(stderr, "out of memory for %s\n", s->name), 1;
    int64_t nmax = ntok > ndec ? ntok : ndec;
    float *X = malloc((size_t)(nmax * s->cols) * sizeof(float)), *Y = malloc((size_t)(nmax * s->rows) * sizeof(float));
    size_t ws = quant_matmul_work_size(t, s->cols, ntok);
    size_t ws1 = quant_matmul_work_size(t, s->cols, ndec);
    void *work = malloc(ws > ws1 ? ws : ws1);
    for (int64_t i = 0; i < nmax * s->cols; i++)
        X[i] = (float)rand() / (float)RAND_MAX - 0.5f;

    /* decode: several passes over all copies per rep */
    double *tv = malloc(sizeof(double) * (size_t)(reps > 0 ? reps : 1));
    int passes = ncopies < 8 ? 8 : ncopies;
    for (int rep = -1; rep < reps; rep++) {
        double t0 = bench_seconds(g_clock);
        for (int i = 0; i < passes; i++)
            if (matmul(pool, w[i % ncopies], t, s, X, ndec, Y, work, ws1) != KS_OK)
                return fprintf(stderr, "matmul: %s\n", ks_errmsg()), 1;
        if (rep >= 0)
            tv[rep] = (bench_seconds(g_clock) - t0) / passes;
    }
    double dec = bench_median(tv, reps), dec_best = tv[0];
    /* prefill: the big output layer gets fewer reps */
    int preps = s->rows > 65536 ? (reps < 3 ? reps : 3) : reps;
    for (int rep = -1; rep < preps; rep++) {
        double t0 = bench_seconds(g_clock);
        if (matmul(pool, w[0], t, s, X, ntok, Y, work, ws) != KS_OK)
            return fprintf(stderr, "matmul: %s\n", ks_errmsg()), 1;
        if (rep >= 0)
            tv[rep] = bench_seconds(g_clock) - t0;
    }
    double pre = bench_median(tv, preps), pre_best = tv[0];
    double flops = 2.0 * (double)s->rows * (double)s->cols * (double)ntok;
    printf("%-10s %-5s %-24s t=%d decode %8.1f us %5.1f GB/s (best %5.1f) | pp%lld %8.2f ms %6.1f GFLOP/s "
           "%8.0f tok/s (best %8.0f)\n",
           s->model, quant_type_name(t), s->name, threads_count(pool), dec * 1e6, (double)bytes / dec / 1e9,
           (double)bytes / dec_best / 1e9, (long long)ntok, pre * 1e3, flops / pre / 1e9, (double)ntok / pre,
           (double)ntok / pre_best);
    fflush(stdout);
    tot->dec_s += dec * s->per_token;
    tot->dec_bytes += (double)bytes * s->per_token;
    if (s->per_token > 1) /* llama.cpp's pp512 runs the output layer for the last token only */
        tot->pre_s_no_output += pre * s->per_token;
    else
        tot->pre_s_no_output += dec;
    tot->pre_tokens = (double)ntok;
    for (int i = 0; i < ncopies; i++)
        free(w[i]);
    free(w);
    free(X);
    free(Y);
    free(work);
    free(tv);
    return 0;
}

/* ---- --gguf: a real model's matrices in a decode step's order --------------- */

static const char *const k_layer_mats[] = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                           "ffn_down"};
enum { N_LAYER_MATS = 7, MAX_FILE_LAYERS = 256 };

struct file_mat {
    void *W;
    enum quant_type type;
    int64_t rows, cols;
    bool repacked;
};

/* Layer il's matrices (W NULL where the file has none; a MoE layer's experts
 * are not among them), repacked in the private copy where the shape allows. */
static int load_layer(struct gguf_file *f, int il, struct file_mat *out)
{
    int found = 0;
    for (int k = 0; k < N_LAYER_MATS; k++) {
        char name[64];
        snprintf(name, sizeof name, "blk.%d.%s.weight", il, k_layer_mats[k]);
        const struct gguf_tensor_info *ti = gguf_find_tensor(f, name);
        out[k] = (struct file_mat){0};
        if (!ti || ti->n_dims != 2)
            continue;
        struct file_mat *m = &out[k];
        m->type = ti->type, m->cols = ti->ne[0], m->rows = ti->ne[1];
        void *own = gguf_private_bytes(f, ti->data, ti->nbytes); /* NULL: mapped read-only, stays row-major */
        m->W = own ? own : (void *)(uintptr_t)ti->data;
        m->repacked = g_repack && own && quant_repack_fits(m->type, m->rows, m->cols);
        if (m->repacked && quant_repack(m->type, m->rows, m->cols, m->W) != KS_OK)
            return fprintf(stderr, "%s: %s\n", name, ks_errmsg()), -1;
        found++;
    }
    return found;
}

static ks_status file_matmul(threads_pool *pool, const struct file_mat *m, const float *X, int64_t n, float *Y,
                             void *work, size_t ws)
{
    if (m->repacked)
        return quant_matmul_repacked(pool, m->W, m->type, m->rows, m->cols, X, n, Y, work, ws);
    return quant_matmul(pool, m->W, m->type, m->rows, m->cols, X, n, Y, work, ws);
}

static int run_file(threads_pool *pool, const char *path, int reps, int64_t ndec)
{
    struct gguf_file *f;
    if (gguf_open_private(path, &f) != KS_OK)
        return fprintf(stderr, "%s\n", ks_errmsg()), 1;
    static struct file_mat mats[MAX_FILE_LAYERS][N_LAYER_MATS];
    int n_layers = 0;
    for (int found; n_layers < MAX_FILE_LAYERS && (found = load_layer(f, n_layers, mats[n_layers])) != 0; n_layers++)
        if (found < 0)
            return gguf_close(f), 1;
    int64_t max_cols = 1, max_rows = 1;
    size_t ws = 0;
    for (int il = 0; il < n_layers; il++)
        for (int k = 0; k < N_LAYER_MATS; k++) {
            const struct file_mat *m = &mats[il][k];
            if (!m->W)
                continue;
            max_cols = m->cols > max_cols ? m->cols : max_cols;
            max_rows = m->rows > max_rows ? m->rows : max_rows;
            size_t w = quant_matmul_work_size(m->type, m->cols, ndec);
            ws = w > ws ? w : ws;
        }
    float *X = malloc((size_t)(ndec * max_cols) * sizeof(float));
    float *Y = malloc((size_t)(ndec * max_rows) * sizeof(float));
    void *work = malloc(ws ? ws : 1);
    double *tv = calloc((size_t)reps * N_LAYER_MATS, sizeof *tv);
    if (!X || !Y || !work || !tv)
        return fprintf(stderr, "out of memory\n"), 1;
    srand(1);
    for (int64_t i = 0; i < ndec * max_cols; i++)
        X[i] = (float)rand() / (float)RAND_MAX - 0.5f;
    printf("# %s: %d layers, decode of %lld token(s), each matrix name's mean over the layers (median of %d passes)\n",
           path, n_layers, (long long)ndec, reps);
    for (int r = -1; r < reps; r++) /* pass -1 warms up */
        for (int il = 0; il < n_layers; il++)
            for (int k = 0; k < N_LAYER_MATS; k++) {
                const struct file_mat *m = &mats[il][k];
                if (!m->W)
                    continue;
                double t0 = bench_seconds(g_clock);
                if (file_matmul(pool, m, X, ndec, Y, work, ws) != KS_OK)
                    return fprintf(stderr, "layer %d %s: %s\n", il, k_layer_mats[k], ks_errmsg()), 1;
                if (r >= 0)
                    tv[k * reps + r] += bench_seconds(g_clock) - t0;
            }
    double step = 0, bytes_all = 0;
    for (int k = 0; k < N_LAYER_MATS; k++) {
        /* every layer's own bytes: a Q4_K_M file's ffn_down is q6_K in some layers, q4_K in others */
        double bytes = 0;
        int count = 0, first = -1;
        bool mixed = false;
        for (int il = 0; il < n_layers; il++) {
            const struct file_mat *m = &mats[il][k];
            if (!m->W)
                continue;
            first = first < 0 ? il : first;
            mixed = mixed || m->type != mats[first][k].type;
            bytes += (double)quant_row_size(m->type, m->cols) * (double)m->rows;
            count++;
        }
        if (count == 0)
            continue;
        const struct file_mat *m = &mats[first][k];
        double t = bench_median(tv + k * reps, reps); /* all its layers, one pass */
        step += t, bytes_all += bytes;
        printf("%-12s %-6s%s %6lld -> %-6lld %-9s %9.1f us %6.1f GB/s\n", k_layer_mats[k], quant_type_name(m->type),
               mixed ? "+" : " ", (long long)m->cols, (long long)m->rows, m->repacked ? "repacked" : "row-major",
               t / count * 1e6, bytes / t / 1e9);
    }
    printf("== layer matrices of one decode step: %.2f ms at %.1f GB/s\n", step * 1e3, bytes_all / step / 1e9);
    free(X), free(Y), free(work), free(tv);
    gguf_close(f);
    return 0;
}

int main(int argc, char **argv)
{
    int threads = 1, reps = 5;
    int64_t ntok = 512, ndec = 1;
    const char *types = "q4_0,q8_0,f16,q4_K", *model = NULL, *file = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-t") && i + 1 < argc)
            threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-r") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-p") && i + 1 < argc)
            ntok = atoll(argv[++i]);
        else if (!strcmp(argv[i], "-n") && i + 1 < argc)
            ndec = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--no-repack"))
            g_repack = false;
        else if (!strcmp(argv[i], "--hot"))
            g_hot = true;
        else if (!strcmp(argv[i], "--type") && i + 1 < argc)
            types = argv[++i];
        else if (!strcmp(argv[i], "--cpu"))
            g_clock = CLOCK_PROCESS_CPUTIME_ID;
        else if (!strcmp(argv[i], "--model") && i + 1 < argc)
            model = argv[++i];
        else if (!strcmp(argv[i], "--gguf") && i + 1 < argc)
            file = argv[++i];
        else {
            fprintf(stderr, "usage: %s [-t THREADS] [-r REPS] [-p TOKENS] [-n DECODE_TOKENS] [--type q4_0,q8_0,f16,q4_K] "
                            "[--model llama-1b|qwen3-0.6b|gemma3-1b] [--cpu] [--no-repack] [--hot]\n"
                            "       %s --gguf FILE [-t THREADS] [-r REPS] [-n DECODE_TOKENS] [--no-repack]\n", argv[0], argv[0]);
            return 2;
        }
    }
    if (threads < 1 || reps < 1 || ntok < 1 || ndec < 1)
        return fprintf(stderr, "bad -t/-r/-p/-n\n"), 2;
    threads_pool *pool;
    if (threads_create(threads, &pool) != KS_OK)
        return fprintf(stderr, "threads: %s\n", ks_errmsg()), 1;
    if (file) {
        int rc = run_file(pool, file, reps, ndec);
        threads_free(pool);
        return rc;
    }
    printf("# bench_matmul isa=%s threads=%d reps=%d decode tokens=%lld weights %s (medians)\n", quant_isa(), threads,
           reps, (long long)ndec, g_repack ? "repacked where they fit" : "row-major");
    char list[256];
    snprintf(list, sizeof list, "%s", types);
    for (char *tok = strtok(list, ","); tok; tok = strtok(NULL, ",")) {
        enum quant_type t;
        if (quant_type_from_name(tok, &t) != KS_OK)
            return fprintf(stderr, "%s\n", ks_errmsg()), 2;
        const struct quant_traits *tr = quant_traits(t);
        if (!tr->vec_dot || !tr->from_float) {
            printf("# %s: no kernels in this build, skipped\n", tok);
            continue;
        }
        const char *models[] = {"llama-1b", "qwen3-0.6b", "gemma3-1b"};
        for (int mi = 0; mi < 3; mi++) {
            if (model && strcmp(model, models[mi]))
                continue;
            struct totals tot = {0};
            for (size_t s = 0; s < sizeof k_shapes / sizeof k_shapes[0]; s++)
                if (!strcmp(models[mi], k_shapes[s].model)) {
                    if (k_shapes[s].cols % tr->block_elems != 0) { /* gemma3's 1152: a Q4_K_M file keeps these q5_0 */
                        printf("# %s %s: %lld columns are not whole %s blocks, skipped\n", models[mi], k_shapes[s].name,
                               (long long)k_shapes[s].cols, tok);
                        continue;
                    }
                    if (run_shape(pool, t, &k_shapes[s], reps, ntok, ndec, &tot))
                        return 1;
                }
            printf("== %s %s t=%d, all weight matmuls of one decode step of %lld token(s): %.2f ms = %.1f tok/s at %.1f GB/s; "
                   "prefill %lld tokens %.1f tok/s (matmuls only, output layer for the last token)\n",
                   models[mi], tok, threads, (long long)ndec, tot.dec_s * 1e3, (double)ndec / tot.dec_s,
                   tot.dec_bytes / tot.dec_s / 1e9,
                   (long long)ntok, tot.pre_tokens / tot.pre_s_no_output);
        }
    }
    threads_free(pool);
    return 0;
}
