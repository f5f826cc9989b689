/* kvserve bench: prompt processing (ppP: one batch of P tokens into an empty
 * sequence) and text generation (tgN: N one-token decodes) speed, like
 * llama-bench. Each test runs -r times on a fresh sequence after one warm-up;
 * the table gives the median and the standard deviation of tokens/s, and
 * for tg the weight bytes read per second (model_weight_bytes x tok/s). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "cli/setup.h"
#include "kv/kv.h"
#include "model/model.h"

#define BENCH_MAX_REPS 1000

struct bench_opts {
    const char *model;
    int n_prompt, n_gen, reps, n_threads, depth;
    struct cli_model_flags load; /* --mmap and the KV flags; kv.mem 0: enough for the longest test */
};

static void bench_usage(FILE *out)
{
    fprintf(out,
            "usage: kvserve bench [-m MODEL.gguf] [-p 512] [-n 128] [-r 5] [-t T] [-d DEPTH]\n"
            "                     [-ctk T] [-ctv T] [--kv-policy static|dynamic] [--kv-mem SIZE] [--kv-* ...]\n"
            "\n"
            "Like llama-bench: ppP = one batch of P prompt tokens, tgN = N single-token\n"
            "decodes, both into a fresh sequence (after DEPTH untimed tokens with -d).\n"
            "Prints a markdown table of tokens/s (median ± standard deviation over the\n"
            "reps) and, for tg, the weight-read bandwidth in GB/s.\n"
            "\n"
            "  -m, --model PATH        GGUF model (default: the built-in default model)\n"
            "  -p, --n-prompt P        prompt tokens; 0 skips pp (default 512)\n"
            "  -n, --n-gen N           generated tokens; 0 skips tg (default 128)\n"
            "  -r, --repetitions R     reps per test (default 5)\n"
            "  -t, --threads T         threads (default: all cores)\n"
            "  -d, --n-depth D         context already in the cache before each test (default 0)\n"
            "\n");
    fputs(cli_model_flags_help, out);
}

static bool is_flag(const char *a, const char *s, const char *l)
{
    return (s && !strcmp(a, s)) || (l && !strcmp(a, l));
}

static bool parse_value_flag(const char *a, const char *v, void *opts, bool *ok)
{
    struct bench_opts *o = opts;
    if (is_flag(a, "-m", "--model"))
        *ok = (o->model = v) != NULL;
    else if (is_flag(a, "-p", "--n-prompt"))
        *ok = cli_parse_int(v, 0, 1 << 20, &o->n_prompt);
    else if (is_flag(a, "-n", "--n-gen"))
        *ok = cli_parse_int(v, 0, 1 << 20, &o->n_gen);
    else if (is_flag(a, "-r", "--repetitions"))
        *ok = cli_parse_int(v, 1, BENCH_MAX_REPS, &o->reps);
    else if (is_flag(a, "-t", "--threads"))
        *ok = cli_parse_threads(v, &o->n_threads);
    else if (is_flag(a, "-d", "--n-depth"))
        *ok = cli_parse_int(v, 0, 1 << 22, &o->depth);
    else
        return false;
    return true;
}

/* 0 ok, 2 usage error, -1 help printed. */
static int parse_args(int argc, char **argv, struct bench_opts *o)
{
    *o = (struct bench_opts){.n_prompt = 512, .n_gen = 128, .reps = 5, .n_threads = threads_default_count()};
    cli_model_flags_init(&o->load);
    const struct cli_command cmd = {
        .name = "bench", .usage = bench_usage, .model = &o->load, .value_flag = parse_value_flag, .opts = o};
    int rc = cli_parse_command(&cmd, argc, argv);
    if (!rc && o->n_prompt == 0 && o->n_gen == 0) {
        fprintf(stderr, "kvserve bench: nothing to measure with -p 0 and -n 0\n");
        return 2;
    }
    return rc;
}

/* ---- the measurements ------------------------------------------------------ */

struct bench {
    const struct bench_opts *o;
    struct cli_engine e;
    int32_t n_vocab;
    int32_t max_batch;
    int32_t *tokens, *pos, *seq; /* (max_batch) */
    float *logits;               /* (n_vocab) */
    uint64_t rng;
};

static void bench_free(struct bench *b)
{
    cli_engine_free(&b->e);
    free(b->tokens);
    free(b->pos);
    free(b->seq);
    free(b->logits);
}

static int32_t random_token(struct bench *b)
{
    b->rng = b->rng * 6364136223846793005ull + 1442695040888963407ull;
    return (int32_t)((b->rng >> 33) % (uint64_t)b->n_vocab);
}

static ks_status bench_setup(struct bench *b, const char *path)
{
    const struct bench_opts *o = b->o;
    ks_status st = cli_load_model(path, &o->load, &b->e.model);
    if (st)
        return st;
    b->n_vocab = model_hparams(b->e.model)->n_vocab;
    b->rng = 42;
    int32_t most = o->n_prompt > o->depth ? o->n_prompt : o->depth;
    b->max_batch = most > 512 ? 512 : most > 0 ? most : 1;
    if (o->n_prompt > b->max_batch)
        b->max_batch = o->n_prompt; /* pp is one batch */
    struct kv_config cfg;
    int64_t longest = (int64_t)o->depth + (o->n_prompt > o->n_gen ? o->n_prompt : o->n_gen);
    cli_kv_config(b->e.model, &o->load.kv, longest, &cfg);
    if ((st = cli_engine_start(&b->e, &cfg, o->n_threads, b->max_batch)))
        return st;
    b->tokens = malloc((size_t)b->max_batch * sizeof *b->tokens);
    b->pos = malloc((size_t)b->max_batch * sizeof *b->pos);
    b->seq = malloc((size_t)b->max_batch * sizeof *b->seq);
    b->logits = malloc((size_t)b->n_vocab * sizeof *b->logits);
    if (!b->tokens || !b->pos || !b->seq || !b->logits)
        return ks_fail(KS_ERR_NOMEM, "out of memory for the bench buffers");
    return KS_OK;
}

/* Decode n random tokens into seq at its end, in batches of up to max_batch. */
static ks_status feed_random(struct bench *b, int32_t seq, int32_t n, int32_t batch)
{
    for (int32_t done = 0; done < n;) {
        int32_t len = n - done < batch ? n - done : batch, start = kv_seq_len(b->e.kv, seq);
        for (int32_t i = 0; i < len; i++) {
            b->tokens[i] = random_token(b);
            b->pos[i] = start + i;
            b->seq[i] = seq;
        }
        struct model_batch mb = {.n_tokens = len, .tokens = b->tokens, .pos = b->pos, .seq = b->seq};
        ks_status st = model_forward(b->e.ctx, b->e.kv, &mb, b->logits, NULL);
        if (st)
            return st;
        done += len;
    }
    return KS_OK;
}

enum bench_test { BENCH_PP, BENCH_TG };

/* One timed run on a fresh sequence, after the untimed depth; *tps gets tok/s. */
static ks_status run_once(struct bench *b, enum bench_test test, int32_t n, double *tps)
{
    int32_t seq;
    ks_status st = kv_seq_create(b->e.kv, &seq);
    if (st)
        return st;
    st = feed_random(b, seq, b->o->depth, b->max_batch);
    double t0 = cli_now();
    if (!st)
        st = feed_random(b, seq, n, test == BENCH_PP ? n : 1);
    double dt = cli_now() - t0;
    kv_seq_free(b->e.kv, seq);
    *tps = dt > 0 ? n / dt : 0;
    return st;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

struct bench_stat {
    double median, sd;
};

static struct bench_stat stats(double *v, int n)
{
    double mean = 0, var = 0;
    for (int i = 0; i < n; i++)
        mean += v[i] / n;
    for (int i = 0; i < n; i++)
        var += (v[i] - mean) * (v[i] - mean);
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    double median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
    return (struct bench_stat){median, n > 1 ? sqrt(var / (n - 1)) : 0.0};
}

static ks_status run_test(struct bench *b, enum bench_test test, int32_t n, struct bench_stat *out)
{
    double v[BENCH_MAX_REPS], warm;
    ks_status st = run_once(b, test, test == BENCH_PP ? (n < 32 ? n : 32) : 1, &warm);
    for (int r = 0; !st && r < b->o->reps; r++)
        st = run_once(b, test, n, &v[r]);
    if (!st)
        *out = stats(v, b->o->reps);
    return st;
}

/* ---- the table ------------------------------------------------------------- */

static const char *base_name(const char *path)
{
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

static void print_header(void)
{
    printf("| model | size | threads | kv | test | t/s | weights GB/s |\n");
    printf("| --- | ---: | ---: | --- | --- | ---: | ---: |\n");
}

static void print_row(const struct bench *b, const char *path, enum bench_test test, int32_t n,
                      struct bench_stat s)
{
    const struct bench_opts *o = b->o;
    char name[64], kv[64], gbs[32] = "";
    int w = snprintf(name, sizeof name, "%s%d", test == BENCH_PP ? "pp" : "tg", (int)n);
    if (o->depth && w > 0 && (size_t)w < sizeof name)
        snprintf(name + w, sizeof name - (size_t)w, " @ d%d", o->depth);
    snprintf(kv, sizeof kv, "%s/%s%s", quant_type_name(o->load.kv.cfg.type_k), quant_type_name(o->load.kv.cfg.type_v),
             o->load.kv.cfg.policy == KV_POLICY_DYNAMIC ? " dynamic" : "");
    if (test == BENCH_TG)
        snprintf(gbs, sizeof gbs, "%.1f", (double)model_weight_bytes(b->e.model) * s.median / 1e9);
    printf("| %s | %.0f MiB | %d | %s | %s | %.2f ± %.2f | %s |\n", base_name(path),
           (double)model_weight_bytes(b->e.model) / (1 << 20), o->n_threads, kv, name, s.median, s.sd, gbs);
    fflush(stdout);
}

int cli_bench(int argc, char **argv)
{
    struct bench_opts o;
    int rc = parse_args(argc, argv, &o);
    if (rc)
        return rc < 0 ? 0 : rc;
    char default_path[4096];
    const char *path = cli_model_path("bench", o.model, default_path, sizeof default_path);
    if (!path)
        return 2;
    struct bench b = {.o = &o};
    ks_status st = bench_setup(&b, path);
    struct bench_stat s;
    if (!st)
        print_header();
    if (!st && o.n_prompt > 0 && !(st = run_test(&b, BENCH_PP, o.n_prompt, &s)))
        print_row(&b, path, BENCH_PP, o.n_prompt, s);
    if (!st && o.n_gen > 0 && !(st = run_test(&b, BENCH_TG, o.n_gen, &s)))
        print_row(&b, path, BENCH_TG, o.n_gen, s);
    if (st)
        fprintf(stderr, "kvserve bench: %s\n", *ks_errmsg() ? ks_errmsg() : ks_strerror(st));
    bench_free(&b);
    return st ? 1 : 0;
}
