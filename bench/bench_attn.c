/* bench_attn: decode attention throughput in GB/s of KV read, one sequence,
 * one layer of a Llama-3-8B-shaped cache (32 query heads, 8 KV heads,
 * head_dim 128), at several context lengths and K/V precisions, plus the
 * same kernels over one contiguous f16 buffer as the baseline for paging.
 *
 *   bench_attn [-t THREADS] [-P PAGE] [-r REPS] [-c CTX] [-k CACHE] [-s gemma3] [-L LAYERS]
 * (-k: only that cache row, e.g. q4_0, for profiling; -c: that one context
 * length, any; -s gemma3: gemma3-1b's shape, one KV head of 256 for 4 query
 * heads, whose decode splits one item's segments across the threads;
 * -L: a cache of LAYERS layers, each call attending the next one, as a decode
 * step does: with enough of them (16 KV MB a layer at 4096 f16: -L 32) the
 * pages come from memory, not from the cache the default single layer
 * stays in)
 * Prints one line per (context, cache) with the median of REPS runs, by wall
 * time and by process CPU time (the CPU figure is the one to compare on a
 * shared, loaded machine: time slices lost to other processes do not count),
 * then per context the ratios the performance targets are stated in. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "attn/attn.h"
#include "attn/attn_internal.h"

/* The cache's shape: Llama-3-8B's by default, gemma3-1b's with -s gemma3
 * (one KV head of 256 shared by 4 query heads: a decode step's whole
 * attention is one item, split across threads by segments). */
static int N_HEAD = 32, N_KV = 8, DIM = 128;
static int N_LAYERS = 1; /* -L */

static double clock_s(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint64_t rng = 1;
static float frand(void)
{
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
}

struct timing {
    double wall, cpu; /* seconds per call, medians over reps */
};

static struct timing median_time(void (*fn)(void *), void *ctx, int reps)
{
    double w[16], c[16];
    fn(ctx); /* warm-up */
    for (int r = 0; r < reps; r++) {
        int iters = 0;
        double w0 = clock_s(CLOCK_MONOTONIC), c0 = clock_s(CLOCK_PROCESS_CPUTIME_ID), el;
        do {
            fn(ctx);
            iters++;
            el = clock_s(CLOCK_PROCESS_CPUTIME_ID) - c0;
        } while (el < 0.15);
        w[r] = (clock_s(CLOCK_MONOTONIC) - w0) / iters;
        c[r] = el / iters;
    }
    qsort(w, (size_t)reps, sizeof w[0], bench_cmp_double);
    qsort(c, (size_t)reps, sizeof c[0], bench_cmp_double);
    return (struct timing){w[reps / 2], c[reps / 2]};
}

static void print_row(int ctx, const char *name, double bytes, struct timing t, const char *note)
{
    printf("%-7d %-16s %8.1f %10.1f %8.2f %10.1f %8.2f%s\n", ctx, name, bytes / 1e6, t.wall * 1e6,
           bytes / t.wall / 1e9, t.cpu * 1e6, bytes / t.cpu / 1e9, note);
    fflush(stdout);
}

struct paged_run {
    threads_pool *pool;
    struct kv_cache *kv;
    struct attn_query q;
    float *x, *out;
    int layer; /* the next call's */
};

static void paged_step(void *ctx)
{
    struct paged_run *r = ctx;
    if (attn_forward(r->pool, r->kv, r->layer, &r->q, 1, r->x, r->out, N_HEAD, 0.088f))
        fprintf(stderr, "attn_forward: %s\n", ks_errmsg());
    r->layer = (r->layer + 1) % N_LAYERS;
}

static struct kv_cache *make_cache(int ctx, int P, enum quant_type tk, enum quant_type tv, bool mixed, int32_t *seq)
{
    struct kv_config cfg;
    kv_config_default(&cfg);
    cfg.n_layer = N_LAYERS;
    cfg.n_kv_head = N_KV;
    cfg.head_dim = DIM;
    cfg.page_tokens = P;
    cfg.type_k = tk;
    cfg.type_v = tv;
    cfg.mem_budget = (size_t)N_LAYERS * ((size_t)ctx * N_KV * DIM * 8 + ((size_t)64 << 20));
    struct kv_cache *kv;
    if (kv_create(&cfg, &kv) || kv_seq_create(kv, seq) || kv_seq_grow(kv, *seq, ctx)) {
        fprintf(stderr, "cache: %s\n", ks_errmsg());
        exit(1);
    }
    float *k = malloc((size_t)N_KV * DIM * sizeof(float)), *v = malloc((size_t)N_KV * DIM * sizeof(float));
    for (int layer = 0; layer < N_LAYERS; layer++)
        for (int p = 0; p < ctx; p++) {
            for (int i = 0; i < N_KV * DIM; i++) {
                k[i] = frand();
                v[i] = frand();
            }
            kv_write(kv, layer, *seq, p, k, v);
        }
    free(k);
    free(v);
    if (mixed) { /* what the dynamic policy makes: recent 512 tokens f16, older ones q4_0 */
        struct kv_selector sel = {.kind = KV_SELECT_OLDER_THAN, .keep_recent = 512};
        if (kv_requantize(kv, &sel, QUANT_Q4_0, QUANT_Q4_0, false, NULL))
            fprintf(stderr, "requantize: %s\n", ks_errmsg());
    }
    return kv;
}

/* The contiguous baseline: the same kernels over [head][token][dim] f16. */
struct contig_run {
    int ctx;
    quant_f16 *k, *v;
    float *q, *s, *acc, *m, *l, *out;
    int32_t *limit;
};

static void contig_step(void *ctx)
{
    struct contig_run *c = ctx;
    const struct attn_kernels *k = attn_kernels_best();
    int G = N_HEAD / N_KV;
    for (int h = 0; h < N_KV; h++) {
        struct attn_rows rows = {.n = G, .dim = DIM, .stride = c->ctx, .q = c->q + (size_t)h * G * DIM,
                                 .limit = c->limit, .m = c->m, .l = c->l, .acc = c->acc, .s = c->s};
        memset(c->acc, 0, (size_t)G * DIM * sizeof(float));
        const uint8_t *kh = (const uint8_t *)(c->k + (size_t)h * c->ctx * DIM);
        const uint8_t *vh = (const uint8_t *)(c->v + (size_t)h * c->ctx * DIM);
        size_t run = (size_t)c->ctx * DIM * sizeof(quant_f16);
        attn_set_bounds(&rows, kh, run);
        k->score[kv_type_index(QUANT_F16)](kh, c->ctx, &rows);
        for (int r = 0; r < G; r++) {
            float *s = c->s + (size_t)r * c->ctx, mx = -INFINITY;
            for (int t = 0; t < c->ctx; t++)
                mx = s[t] > mx ? s[t] : mx;
            c->l[r] = k->exp_sum(s, c->ctx, mx);
        }
        attn_set_bounds(&rows, vh, run);
        k->accum[kv_type_index(QUANT_F16)](vh, c->ctx, &rows);
        for (int r = 0; r < G; r++)
            for (int e = 0; e < DIM; e++)
                c->out[((size_t)h * G + r) * DIM + e] = c->acc[(size_t)r * DIM + e] / c->l[r];
    }
}

static double kv_bytes(const struct kv_cache *kv)
{
    struct kv_usage u;
    kv_usage(kv, &u);
    return (double)u.used / N_LAYERS; /* one layer, whole pages: what a decode step reads, up to the last page */
}

int main(int argc, char **argv)
{
    int n_threads = 1, P = 32, reps = 5, only_ctx = 0;
    const char *only_case = NULL;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "-t"))
            n_threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-P"))
            P = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-r"))
            reps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-c"))
            only_ctx = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-k"))
            only_case = argv[i + 1];
        else if (!strcmp(argv[i], "-L"))
            N_LAYERS = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-s") && !strcmp(argv[i + 1], "gemma3"))
            N_HEAD = 4, N_KV = 1, DIM = 256;
        else if (!strcmp(argv[i], "-s")) {
            fprintf(stderr, "bench_attn: -s %s: the only other shape is gemma3\n", argv[i + 1]);
            return 2;
        }
    }
    reps = reps < 1 ? 1 : reps > 15 ? 15 : reps;
    if (N_LAYERS < 1 || N_LAYERS > 1024) {
        fprintf(stderr, "bench_attn: -L %d: 1 to 1024 layers\n", N_LAYERS);
        return 2;
    }
    threads_pool *pool = NULL;
    if (n_threads > 1 && threads_create(n_threads, &pool)) {
        fprintf(stderr, "threads: %s\n", ks_errmsg());
        return 1;
    }
    printf("bench_attn: kernels %s, %d thread(s), P=%d, %d KV heads x head_dim %d, %d query heads, %d layer(s), "
           "median of %d\n",
           attn_kernels_best()->isa, n_threads, P, N_KV, DIM, N_HEAD, N_LAYERS, reps);
    printf("%-7s %-16s %8s %10s %8s %10s %8s\n", "ctx", "cache", "KV MB", "wall us", "GB/s", "cpu us", "GB/s cpu");
    int ctxs[] = {1024, 4096, 16384, 32768}, n_ctx = 4;
    if (only_ctx) /* any length, e.g. a decode's first hundred tokens */
        ctxs[0] = only_ctx, n_ctx = 1;
    struct {
        const char *name;
        enum quant_type k, v;
        bool mixed;
    } cases[] = {
        {"f16", QUANT_F16, QUANT_F16, false},
        {"q8_0", QUANT_Q8_0, QUANT_Q8_0, false},
        {"q4_0", QUANT_Q4_0, QUANT_Q4_0, false},
        {"mixed(q4/f16)", QUANT_F16, QUANT_F16, true},
        {"bf16", QUANT_BF16, QUANT_BF16, false},
        {"q5_1", QUANT_Q5_1, QUANT_Q5_1, false},
        {"q5_0", QUANT_Q5_0, QUANT_Q5_0, false},
        {"q4_1", QUANT_Q4_1, QUANT_Q4_1, false},
        {"iq4_nl", QUANT_IQ4_NL, QUANT_IQ4_NL, false},
        {"iq3_nl", QUANT_IQ3_NL, QUANT_IQ3_NL, false},
    };
    float *x = malloc(N_HEAD * DIM * sizeof(float)), *out = malloc(N_HEAD * DIM * sizeof(float));
    for (int i = 0; i < N_HEAD * DIM; i++)
        x[i] = frand();
    for (int c = 0; c < n_ctx; c++) {
        int ctx = ctxs[c];
        double cpu[sizeof cases / sizeof cases[0]];
        for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
            if (only_case && strcmp(only_case, cases[k].name)) {
                cpu[k] = NAN;
                continue;
            }
            struct paged_run r = {.pool = pool, .x = x, .out = out};
            r.kv = make_cache(ctx, P, cases[k].k, cases[k].v, cases[k].mixed, &r.q.seq);
            r.q.pos = ctx - 1;
            struct timing t = median_time(paged_step, &r, reps);
            print_row(ctx, cases[k].name, kv_bytes(r.kv), t, "");
            cpu[k] = t.cpu;
            kv_free(r.kv);
        }
        if (only_case)
            continue;
        /* contiguous f16 with the same kernels, single-threaded like -t 1 */
        struct contig_run cr = {.ctx = ctx};
        size_t n = (size_t)N_KV * ctx * DIM;
        cr.k = malloc(n * sizeof(quant_f16));
        cr.v = malloc(n * sizeof(quant_f16));
        for (size_t i = 0; i < n; i++) {
            cr.k[i] = quant_f32_to_f16(frand());
            cr.v[i] = quant_f32_to_f16(frand());
        }
        int G = N_HEAD / N_KV;
        cr.q = x;
        cr.s = malloc((size_t)G * ctx * sizeof(float));
        cr.acc = malloc((size_t)G * DIM * sizeof(float));
        cr.m = calloc(G, sizeof(float));
        cr.l = calloc(G, sizeof(float));
        cr.limit = malloc(G * sizeof(int32_t));
        cr.out = out;
        struct timing t = median_time(contig_step, &cr, reps);
        print_row(ctx, "contiguous f16", 2.0 * n * sizeof(quant_f16), t, n_threads > 1 ? "  (1 thread)" : "");
        if (n_threads == 1) /* the contiguous baseline is single-threaded */
            printf("%-7d ratios (cpu time): q4_0 speed / f16 = %.2f (target >= 2), paged f16 / contiguous = %.3f "
                   "(target <= 1.05)\n",
                   ctx, cpu[0] / cpu[2], cpu[0] / t.cpu);
        free(cr.k);
        free(cr.v);
        free(cr.s);
        free(cr.acc);
        free(cr.m);
        free(cr.l);
        free(cr.limit);
    }
    free(x);
    free(out);
    threads_free(pool);
    return 0;
}
