/* bench_moe: one mixture-of-experts FFN layer (gate, up, SwiGLU, down over
 * the experts the tokens chose), grouped in one parallel region per product
 * (quant_matmul_experts) against one quant_matmul per expert and matrix.
 *
 *   bench_moe [-t THREADS] [-r REPS] [-b 1,16,512] [--type q4_0,q8_0,q4_K]
 *             [--model qwen3moe-30b-a3b|mixtral-8x7b|gpt-oss-20b] [--cpu] [--no-repack]
 *
 * gpt-oss-20b's shape is its experts' (2880 -> 2880, 4 of 32), without their
 * biases and clamped SwiGLU (the plain one costs the same); run it with
 * --type mxfp4. Q4_0 / Q8_0 / IQ4_NL / MXFP4 experts are repacked as the model loader repacks them (each
 * expert's slice on its own) unless --no-repack keeps them row-major.
 * Routing is random (k distinct experts per token, a new draw per rep), and
 * each rep reads the next of several copies of the layer's experts, so a
 * decode step's experts come from DRAM as in a real forward pass. Printed
 * per batch size: the median time of one layer for both ways, tokens/s of
 * that layer, and GB/s of the distinct experts' weight bytes. The two ways
 * run interleaved, rep by rep, so load from other processes falls on both.
 * Router, top-k and the weighted sum are left out: they are the same in both. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "bench_util.h"
#include "quant/quant.h"
#include "threads/threads.h"

struct moe_shape {
    const char *name;
    int64_t n_embd, n_ff;   /* an expert: n_embd -> n_ff (gate, up), n_ff -> n_embd (down) */
    int n_expert, n_used;
};

static const struct moe_shape k_models[] = {
    {"qwen3moe-30b-a3b", 2048, 768, 128, 8},
    {"mixtral-8x7b", 4096, 14336, 8, 2},
    {"gpt-oss-20b", 2880, 2880, 32, 4},
};

static clockid_t g_clock = CLOCK_MONOTONIC;
static bool g_repack = true;

/* rows x cols of t for each of n experts: four random rows quantized, then
 * replicated (speed does not depend on the values); each expert repacked
 * where it fits, unless --no-repack. */
static uint8_t *make_experts(enum quant_type t, int64_t rows, int64_t cols, int n, size_t *stride, bool *repacked)
{
    const struct quant_traits *tr = quant_traits(t);
    size_t wrow = quant_row_size(t, cols), bytes = wrow * (size_t)rows * (size_t)n;
    size_t huge = 2u << 20, alloc = (bytes + huge - 1) / huge * huge;
    uint8_t *w = aligned_alloc(huge, alloc);
    float *x = malloc((size_t)cols * sizeof(float));
    if (!w || !x) {
        free(w), free(x);
        return NULL;
    }
    (void)madvise(w, alloc, MADV_HUGEPAGE);
    for (int r = 0; r < 4; r++) {
        for (int64_t c = 0; c < cols; c++)
            x[c] = (float)rand() / (float)RAND_MAX - 0.5f;
        tr->from_float(x, w + (size_t)r * wrow, cols);
    }
    for (size_t r = 4; r < (size_t)rows * (size_t)n; r++)
        memcpy(w + r * wrow, w + (r % 4) * wrow, wrow);
    free(x);
    *stride = wrow * (size_t)rows;
    *repacked = g_repack && quant_repack_fits(t, rows, cols);
    for (int e = 0; e < n && *repacked; e++)
        if (quant_repack(t, rows, cols, w + (size_t)e * *stride) != KS_OK) {
            free(w);
            return NULL;
        }
    return w;
}

struct layer {
    uint8_t *gate, *up, *down;
    size_t s_gu, s_down;
    bool rp_gu, rp_down; /* repacked */
};

struct bufs {
    int32_t *sel, *start, *grp_tok;
    float *x, *xg, *hb, *hb2, *out;
    void *work;
    size_t work_size;
};

/* k distinct random experts per token, grouped by expert (counting sort). */
static int route(const struct moe_shape *s, int64_t T, struct bufs *b)
{
    int k = s->n_used, E = s->n_expert;
    for (int64_t t = 0; t < T; t++)
        for (int j = 0; j < k; j++) {
            int e, dup;
            do {
                e = rand() % E;
                dup = 0;
                for (int i = 0; i < j; i++)
                    dup |= b->sel[t * k + i] == e;
            } while (dup);
            b->sel[t * k + j] = e;
        }
    memset(b->start, 0, sizeof(int32_t) * (size_t)(E + 1));
    for (int64_t i = 0; i < T * k; i++)
        b->start[b->sel[i] + 1]++;
    int distinct = 0;
    for (int e = 0; e < E; e++) {
        distinct += b->start[e + 1] > 0;
        b->start[e + 1] += b->start[e];
    }
    int32_t *cur = malloc(sizeof(int32_t) * (size_t)E);
    memcpy(cur, b->start, sizeof(int32_t) * (size_t)E);
    for (int64_t t = 0; t < T; t++)
        for (int j = 0; j < k; j++)
            b->grp_tok[cur[b->sel[t * k + j]]++] = (int32_t)t;
    free(cur);
    return distinct;
}

static ks_status matmul(threads_pool *pool, const void *W, bool repacked, enum quant_type t, int64_t rows,
                        int64_t cols, const float *X, int64_t n, float *Y, const struct bufs *b)
{
    if (repacked)
        return quant_matmul_repacked(pool, W, t, rows, cols, X, n, Y, b->work, b->work_size);
    return quant_matmul(pool, W, t, rows, cols, X, n, Y, b->work, b->work_size);
}

/* Before quant_matmul_experts: gather each expert's rows, then gate, up,
 * SwiGLU and down as one quant_matmul each, expert after expert. */
static ks_status layer_per_expert(threads_pool *pool, enum quant_type t, const struct moe_shape *s,
                                  const struct layer *L, struct bufs *b)
{
    int64_t D = s->n_embd, F = s->n_ff;
    for (int64_t r = 0; r < b->start[s->n_expert]; r++)
        memcpy(b->xg + r * D, b->x + (int64_t)b->grp_tok[r] * D, sizeof(float) * (size_t)D);
    for (int e = 0; e < s->n_expert; e++) {
        int64_t n = b->start[e + 1] - b->start[e];
        if (!n)
            continue;
        float *xe = b->xg + (int64_t)b->start[e] * D;
        ks_status st;
        if ((st = matmul(pool, L->gate + (size_t)e * L->s_gu, L->rp_gu, t, F, D, xe, n, b->hb, b)) ||
            (st = matmul(pool, L->up + (size_t)e * L->s_gu, L->rp_gu, t, F, D, xe, n, b->hb2, b)))
            return st;
        quant_swiglu(b->hb, b->hb2, n * F);
        if ((st = matmul(pool, L->down + (size_t)e * L->s_down, L->rp_down, t, D, F, b->hb, n, xe, b)))
            return st;
    }
    return KS_OK;
}

static ks_status layer_grouped(threads_pool *pool, enum quant_type t, const struct moe_shape *s,
                               const struct layer *L, struct bufs *b, int64_t T)
{
    int64_t D = s->n_embd, F = s->n_ff, G = T * s->n_used;
    struct quant_moe_mm gu = {
        .wtype = t, .rows = F, .cols = D, .W = L->gate, .W2 = L->up, .stride = L->s_gu, .n_expert = s->n_expert,
        .start = b->start, .X = b->x, .x_rows = b->grp_tok, .n_x = T, .Y = b->hb, .Y2 = b->hb2, .swiglu = true,
        .repacked = L->rp_gu,
    };
    struct quant_moe_mm dn = {
        .wtype = t, .rows = D, .cols = F, .W = L->down, .stride = L->s_down, .n_expert = s->n_expert,
        .start = b->start, .X = b->hb, .n_x = G, .Y = b->out, .repacked = L->rp_down,
    };
    ks_status st = quant_matmul_experts(pool, &gu, b->work, b->work_size);
    return st ? st : quant_matmul_experts(pool, &dn, b->work, b->work_size);
}

static int run(threads_pool *pool, enum quant_type t, const struct moe_shape *s, const int64_t *batches, int n_b,
               int reps)
{
    int64_t D = s->n_embd, F = s->n_ff, Tmax = 1;
    for (int i = 0; i < n_b; i++)
        Tmax = batches[i] > Tmax ? batches[i] : Tmax;
    size_t layer_bytes = 3 * quant_row_size(t, D) * (size_t)F * (size_t)s->n_expert;
    int n_copies = (int)((1200u << 20) / layer_bytes) + 1; /* >= 1.2 GB: decode reads DRAM */
    n_copies = n_copies > 8 ? 8 : n_copies;
    struct layer *L = calloc((size_t)n_copies, sizeof *L);
    for (int i = 0; i < n_copies; i++) {
        L[i].gate = make_experts(t, F, D, s->n_expert, &L[i].s_gu, &L[i].rp_gu);
        L[i].up = make_experts(t, F, D, s->n_expert, &L[i].s_gu, &L[i].rp_gu);
        L[i].down = make_experts(t, D, F, s->n_expert, &L[i].s_down, &L[i].rp_down);
        if (!L[i].gate || !L[i].up || !L[i].down)
            return fprintf(stderr, "out of memory for %d copies of a %s layer\n", n_copies, s->name), 1;
    }
    int64_t G = Tmax * s->n_used;
    struct bufs b = {0};
    b.sel = malloc(sizeof(int32_t) * (size_t)G);
    b.start = malloc(sizeof(int32_t) * (size_t)(s->n_expert + 1));
    b.grp_tok = malloc(sizeof(int32_t) * (size_t)G);
    b.x = malloc(sizeof(float) * (size_t)(Tmax * D));
    b.xg = malloc(sizeof(float) * (size_t)(G * D));
    b.out = malloc(sizeof(float) * (size_t)(G * D));
    b.hb = malloc(sizeof(float) * (size_t)(G * F));
    b.hb2 = malloc(sizeof(float) * (size_t)(G * F));
    for (int64_t n = 1; n <= G; n++) {
        size_t w1 = quant_matmul_work_size(t, D, n), w2 = quant_matmul_work_size(t, F, n);
        b.work_size = w1 > b.work_size ? w1 : b.work_size;
        b.work_size = w2 > b.work_size ? w2 : b.work_size;
    }
    size_t we = quant_matmul_experts_work_size(t, D, Tmax, G), wd = quant_matmul_experts_work_size(t, F, G, G);
    b.work_size = we > b.work_size ? we : b.work_size;
    b.work_size = wd > b.work_size ? wd : b.work_size;
    b.work = malloc(b.work_size);
    if (!b.sel || !b.start || !b.grp_tok || !b.x || !b.xg || !b.out || !b.hb || !b.hb2 || !b.work)
        return fprintf(stderr, "out of memory for a batch of %lld\n", (long long)Tmax), 1;
    for (int64_t i = 0; i < Tmax * D; i++)
        b.x[i] = (float)rand() / (float)RAND_MAX - 0.5f;
    size_t expert_bytes = layer_bytes / (size_t)s->n_expert;
    double *tv[2] = {malloc(sizeof(double) * (size_t)reps), malloc(sizeof(double) * (size_t)reps)};
    double *gb[2] = {malloc(sizeof(double) * (size_t)reps), malloc(sizeof(double) * (size_t)reps)};
    for (int bi = 0; bi < n_b; bi++) {
        int64_t T = batches[bi];
        /* decode steps are short: several per rep, each on the next copy with a new routing */
        int steps = T == 1 ? 16 : T <= 16 ? 4 : 1, copy = 0;
        for (int rep = -1; rep < reps; rep++)
            for (int w = 0; w < 2; w++) {
                int way = rep & 1 ? 1 - w : w; /* alternate which way goes first */
                double sum = 0, bytes = 0;
                srand((unsigned)(rep + 7) * 7919u);
                for (int i = 0; i < steps; i++) {
                    int distinct = route(s, T, &b);
                    const struct layer *l = &L[copy++ % n_copies];
                    double t0 = bench_seconds(g_clock);
                    ks_status st = way ? layer_grouped(pool, t, s, l, &b, T) : layer_per_expert(pool, t, s, l, &b);
                    sum += bench_seconds(g_clock) - t0;
                    bytes += (double)distinct * (double)expert_bytes;
                    if (st)
                        return fprintf(stderr, "moe layer: %s\n", ks_errmsg()), 1;
                }
                if (rep >= 0) {
                    tv[way][rep] = sum / steps;
                    gb[way][rep] = bytes / sum / 1e9;
                }
            }
        double m0 = bench_median(tv[0], reps), m1 = bench_median(tv[1], reps);
        double g0 = bench_median(gb[0], reps), g1 = bench_median(gb[1], reps);
        printf("%-16s %-5s t=%d batch %4lld: per-expert %9.1f us (%6.1f GB/s %8.0f tok/s) | grouped %9.1f us "
               "(%6.1f GB/s %8.0f tok/s) | %.2fx\n",
               s->name, quant_type_name(t), threads_count(pool), (long long)T, m0 * 1e6, g0, (double)T / m0,
               m1 * 1e6, g1, (double)T / m1, m0 / m1);
        fflush(stdout);
    }
    for (int i = 0; i < n_copies; i++)
        free(L[i].gate), free(L[i].up), free(L[i].down);
    free(L), free(b.sel), free(b.start), free(b.grp_tok), free(b.x), free(b.xg), free(b.out), free(b.hb), free(b.hb2);
    free(b.work), free(tv[0]), free(tv[1]), free(gb[0]), free(gb[1]);
    return 0;
}

int main(int argc, char **argv)
{
    int threads = 1, reps = 5;
    const char *types = "q4_0,q8_0,q4_K", *model = "qwen3moe-30b-a3b", *batch_list = "1,16,512";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-t") && i + 1 < argc)
            threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-r") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-b") && i + 1 < argc)
            batch_list = argv[++i];
        else if (!strcmp(argv[i], "--type") && i + 1 < argc)
            types = argv[++i];
        else if (!strcmp(argv[i], "--model") && i + 1 < argc)
            model = argv[++i];
        else if (!strcmp(argv[i], "--cpu"))
            g_clock = CLOCK_PROCESS_CPUTIME_ID;
        else if (!strcmp(argv[i], "--no-repack"))
            g_repack = false;
        else {
            fprintf(stderr, "usage: %s [-t THREADS] [-r REPS] [-b 1,16,512] [--type q4_0,q8_0,q4_K] "
                            "[--model qwen3moe-30b-a3b|mixtral-8x7b|gpt-oss-20b] [--cpu] [--no-repack]\n", argv[0]);
            return 2;
        }
    }
    const struct moe_shape *s = NULL;
    for (size_t i = 0; i < sizeof k_models / sizeof k_models[0]; i++)
        if (!strcmp(model, k_models[i].name))
            s = &k_models[i];
    int64_t batches[16];
    int n_b = 0;
    char list[256];
    snprintf(list, sizeof list, "%s", batch_list);
    for (char *tok = strtok(list, ","); tok && n_b < 16; tok = strtok(NULL, ","))
        batches[n_b++] = atoll(tok);
    if (!s || threads < 1 || reps < 1 || n_b == 0)
        return fprintf(stderr, "bad --model/-t/-r/-b\n"), 2;
    for (int i = 0; i < n_b; i++)
        if (batches[i] < 1)
            return fprintf(stderr, "bad -b\n"), 2;
    threads_pool *pool;
    if (threads_create(threads, &pool) != KS_OK)
        return fprintf(stderr, "threads: %s\n", ks_errmsg()), 1;
    printf("# bench_moe isa=%s threads=%d reps=%d %s (medians; GB/s of the distinct experts' weights)\n", quant_isa(),
           threads, reps, g_repack ? "repacked where they fit" : "row-major");
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
        if (run(pool, t, s, batches, n_b, reps))
            return 1;
    }
    threads_free(pool);
    return 0;
}
