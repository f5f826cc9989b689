/* kvserve bench: prompt processing (ppP: one batch of P tokens into an empty
 * sequence) and text generation (tgN: N one-token decodes) speed, like
 * llama-bench. Each test runs -r times on a fresh sequence after one warm-up;
 * the table gives the median and the standard deviation of tokens/s, and
 * for tg the weight bytes read per second (model_active_weight_bytes x
 * tok/s: a mixture of experts reads only the selected experts' weights).
 *
 * As in llama-bench, -p, -n, -t, -d, -ctk and -ctv take comma-separated
 * lists and -m may be repeated: every combination is measured, one row per
 * test. A model is loaded once; each (threads, K type, V type, depth)
 * combination gets its own pool, cache and forward context. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "cli/setup.h"
#include "kv/kv.h"
#include "model/model.h"

#define BENCH_MAX_REPS 1000
#define BENCH_MAX_LIST 16 /* values in one comma-separated list */
#define BENCH_MAX_MODELS 16

struct int_list {
    int n, v[BENCH_MAX_LIST];
};

struct type_list {
    int n;
    enum quant_type v[BENCH_MAX_LIST];
};

enum bench_format { BENCH_MD, BENCH_CSV, BENCH_JSON };

struct bench_opts {
    const char *models[BENCH_MAX_MODELS];
    int n_models;
    struct int_list prompt, gen, threads, depth;
    struct type_list type_k, type_v; /* n 0: the KV flags' (or kv's) default */
    int reps;
    bool all_logits;             /* pp: logits of every token (a speculative verification of P - 1 drafts) */
    enum bench_format format;
    struct cli_model_flags load; /* --mmap and the KV flags; kv.mem 0: enough for the longest test */
};

static void bench_usage(FILE *out)
{
    fprintf(out,
            "usage: kvserve bench [-m MODEL.gguf ...] [-p 512] [-n 128] [-r 5] [-t T] [-d DEPTH]\n"
            "                     [-ctk T] [-ctv T] [-o md|csv|json] [--kv-policy static|dynamic]\n"
            "                     [--kv-mem SIZE] [--kv-* ...]\n"
            "\n"
            "Like llama-bench: ppP = one batch of P prompt tokens, tgN = N single-token\n"
            "decodes, both into a fresh sequence (after DEPTH untimed tokens with -d).\n"
            "Prints a table of tokens/s (median ± standard deviation over the reps)\n"
            "and, for tg, the weight-read bandwidth in GB/s (of a mixture of experts,\n"
            "the bytes of the experts a token uses).\n"
            "-p, -n, -t, -d, -ctk and -ctv take comma-separated lists (up to 16 values,\n"
            "e.g. -p 128,512 -ctk f16,q8_0) and -m may be given up to 16 times: every\n"
            "combination is measured.\n"
            "\n"
            "  -m, --model PATH        GGUF model (default: the built-in default model)\n"
            "  -p, --n-prompt P,...    prompt tokens; 0 skips pp (default 512)\n"
            "  -n, --n-gen N,...       generated tokens; 0 skips tg (default 128)\n"
            "  -r, --repetitions R     reps per test (default 5)\n"
            "  -t, --threads T,...     threads (default: all cores)\n"
            "  -d, --n-depth D,...     context already in the cache before each test (default 0)\n"
            "  -o, --output FORMAT     md (markdown table, default), csv or json\n"
            "      --all-logits        pp computes the logits of every token, as a speculative\n"
            "                          verification of P - 1 drafts does (bench/spec.sh), and is\n"
            "                          timed as one: after the depth, a decode step and an\n"
            "                          untimed pass of P tokens cut back off\n"
            "\n");
    fputs(cli_model_flags_help, out);
}

static bool is_flag(const char *a, const char *s, const char *l)
{
    return (s && !strcmp(a, s)) || (l && !strcmp(a, l));
}

/* Split "a,b,c" and parse each item; false on an empty item, a bad one, or
 * more than BENCH_MAX_LIST. */
static bool parse_list(const char *v, bool (*item)(const char *s, void *list, int i), void *list, int *n)
{
    if (!v || !*v)
        return false;
    char buf[256];
    if (strlen(v) >= sizeof buf)
        return false;
    strcpy(buf, v);
    *n = 0;
    for (char *s = buf, *end; s; s = end) {
        end = strchr(s, ',');
        if (end)
            *end++ = '\0';
        if (!*s || *n == BENCH_MAX_LIST || !item(s, list, *n))
            return false;
        (*n)++;
    }
    return true;
}

struct int_item {
    struct int_list *list;
    int lo, hi;
};

static bool int_item(const char *s, void *ctx, int i)
{
    struct int_item *it = ctx;
    return cli_parse_int(s, it->lo, it->hi, &it->list->v[i]);
}

static bool int_list(const char *v, int lo, int hi, struct int_list *out)
{
    struct int_item it = {out, lo, hi};
    return parse_list(v, int_item, &it, &out->n);
}

static bool thread_item(const char *s, void *ctx, int i) { return cli_parse_threads(s, &((struct int_list *)ctx)->v[i]); }

static bool type_item(const char *s, void *ctx, int i) { return kv_parse_type(s, &((struct type_list *)ctx)->v[i]) == KS_OK; }

static bool parse_format(const char *v, enum bench_format *f)
{
    static const char *const names[] = {"md", "csv", "json"};
    for (int i = 0; v && i < 3; i++)
        if (!strcmp(v, names[i]))
            return *f = (enum bench_format)i, true;
    return false;
}

static bool parse_value_flag(const char *a, const char *v, void *opts, bool *ok)
{
    struct bench_opts *o = opts;
    if (is_flag(a, "-m", "--model"))
        *ok = v && o->n_models < BENCH_MAX_MODELS && (o->models[o->n_models++] = v);
    else if (is_flag(a, "-p", "--n-prompt"))
        *ok = int_list(v, 0, 1 << 20, &o->prompt);
    else if (is_flag(a, "-n", "--n-gen"))
        *ok = int_list(v, 0, 1 << 20, &o->gen);
    else if (is_flag(a, "-r", "--repetitions"))
        *ok = cli_parse_int(v, 1, BENCH_MAX_REPS, &o->reps);
    else if (is_flag(a, "-t", "--threads"))
        *ok = parse_list(v, thread_item, &o->threads, &o->threads.n);
    else if (is_flag(a, "-d", "--n-depth"))
        *ok = int_list(v, 0, 1 << 22, &o->depth);
    else if (is_flag(a, "-ctk", "--cache-type-k"))
        *ok = parse_list(v, type_item, &o->type_k, &o->type_k.n);
    else if (is_flag(a, "-ctv", "--cache-type-v"))
        *ok = parse_list(v, type_item, &o->type_v, &o->type_v.n);
    else if (is_flag(a, "-o", "--output"))
        *ok = parse_format(v, &o->format);
    else
        return false;
    return true;
}

static bool parse_switch_flag(const char *a, void *opts)
{
    struct bench_opts *o = opts;
    if (strcmp(a, "--all-logits"))
        return false;
    o->all_logits = true;
    return true;
}

static int max_int(int a, int b) { return a > b ? a : b; }

static int list_max(const struct int_list *l)
{
    int m = 0;
    for (int i = 0; i < l->n; i++)
        m = max_int(m, l->v[i]);
    return m;
}

/* 0 ok, 2 usage error, -1 help printed. */
static int parse_args(int argc, char **argv, struct bench_opts *o)
{
    *o = (struct bench_opts){.prompt = {1, {512}}, .gen = {1, {128}}, .threads = {1, {threads_default_count()}},
                             .depth = {1, {0}}, .reps = 5};
    cli_model_flags_init(&o->load);
    const struct cli_command cmd = {.name = "bench", .usage = bench_usage, .model = &o->load,
                                    .switch_flag = parse_switch_flag, .value_flag = parse_value_flag, .opts = o};
    int rc = cli_parse_command(&cmd, argc, argv);
    if (!rc && list_max(&o->prompt) == 0 && list_max(&o->gen) == 0) {
        fprintf(stderr, "kvserve bench: nothing to measure with -p 0 and -n 0\n");
        return 2;
    }
    if (!o->type_k.n)
        o->type_k = (struct type_list){1, {o->load.kv.cfg.type_k}};
    if (!o->type_v.n)
        o->type_v = (struct type_list){1, {o->load.kv.cfg.type_v}};
    return rc;
}

/* ---- the measurements ------------------------------------------------------ */

/* One combination of the lists: what an engine is built for. */
struct bench_point {
    int n_threads, depth;
    enum quant_type type_k, type_v;
};

struct bench {
    const struct bench_opts *o;
    const char *path;
    struct bench_point pt;
    struct cli_engine e;
    int32_t n_vocab;
    int32_t max_batch;
    int32_t *tokens, *pos, *seq; /* (max_batch) */
    float *logits;               /* (1, n_vocab), or with --all-logits (the largest -p, n_vocab) */
    bool *want;                  /* (max_batch) all true, for --all-logits */
    uint64_t rng;
};

/* Everything but the model, which stays loaded for the next combination. */
static void bench_engine_free(struct bench *b)
{
    struct model *m = b->e.model;
    b->e.model = NULL;
    cli_engine_free(&b->e);
    b->e.model = m;
}

static int32_t random_token(struct bench *b)
{
    b->rng = b->rng * 6364136223846793005ull + 1442695040888963407ull;
    return (int32_t)((b->rng >> 33) % (uint64_t)b->n_vocab);
}

/* Buffers for the largest batch of any test of the lists. */
static ks_status bench_buffers(struct bench *b)
{
    const struct bench_opts *o = b->o;
    int32_t most = max_int(list_max(&o->prompt), list_max(&o->depth));
    b->max_batch = most > 512 ? 512 : most > 0 ? most : 1;
    if (list_max(&o->prompt) > b->max_batch)
        b->max_batch = list_max(&o->prompt); /* pp is one batch */
    b->n_vocab = model_hparams(b->e.model)->n_vocab;
    b->tokens = malloc((size_t)b->max_batch * sizeof *b->tokens);
    b->pos = malloc((size_t)b->max_batch * sizeof *b->pos);
    b->seq = malloc((size_t)b->max_batch * sizeof *b->seq);
    size_t rows = o->all_logits ? (size_t)max_int(list_max(&o->prompt), 1) : 1;
    b->logits = malloc(rows * (size_t)b->n_vocab * sizeof *b->logits);
    b->want = malloc((size_t)b->max_batch * sizeof *b->want);
    for (int32_t i = 0; b->want && i < b->max_batch; i++)
        b->want[i] = true;
    if (!b->tokens || !b->pos || !b->seq || !b->logits || !b->want)
        return ks_fail(KS_ERR_NOMEM, "out of memory for the bench buffers");
    return KS_OK;
}

/* Pool, cache and context for one combination; the cache holds the depth
 * plus the longest test unless --kv-mem says otherwise. */
static ks_status bench_engine(struct bench *b, const struct bench_point *pt)
{
    const struct bench_opts *o = b->o;
    b->pt = *pt;
    b->rng = 42;
    struct cli_kv_flags kvf = o->load.kv;
    kvf.cfg.type_k = pt->type_k;
    kvf.cfg.type_v = pt->type_v;
    int64_t longest = max_int(list_max(&o->prompt) + o->all_logits, list_max(&o->gen)); /* + settle_verifier's step */
    struct kv_config cfg;
    cli_kv_config(b->e.model, &kvf, (int64_t)pt->depth + longest, &cfg);
    return cli_engine_start(&b->e, &cfg, pt->n_threads, b->max_batch);
}

/* Decode n random tokens into seq at its end, in batches of up to max_batch;
 * all_logits: every token's logits, else the last one's. */
static ks_status feed_random(struct bench *b, int32_t seq, int32_t n, int32_t batch, bool all_logits)
{
    for (int32_t done = 0; done < n;) {
        int32_t len = n - done < batch ? n - done : batch, start = kv_seq_len(b->e.kv, seq);
        for (int32_t i = 0; i < len; i++) {
            b->tokens[i] = random_token(b);
            b->pos[i] = start + i;
            b->seq[i] = seq;
        }
        struct model_batch mb = {.n_tokens = len, .tokens = b->tokens, .pos = b->pos, .seq = b->seq,
                                 .want_logits = all_logits ? b->want : NULL};
        ks_status st = model_forward(b->e.ctx, b->e.kv, &mb, b->logits, NULL);
        if (st)
            return st;
        done += len;
    }
    return KS_OK;
}

enum bench_test { BENCH_PP, BENCH_TG };

/* What a verification inside speculative decoding follows: a decode step,
 * then a verification of the same length whose rejected tokens are cut off.
 * The first pass after a prefill of the depth is not one: it ran ~3.4 ms
 * slower than a steady decode step on llama-1b q4_0 at depth 256 (18.7 ms
 * against 15.3, cause not pinned down), and timing it overstated a
 * verification's cost. */
static ks_status settle_verifier(struct bench *b, int32_t seq, int32_t n)
{
    ks_status st = feed_random(b, seq, 1, 1, false);
    int32_t len = kv_seq_len(b->e.kv, seq);
    if (!st)
        st = feed_random(b, seq, n, n, true);
    return st ? st : kv_seq_truncate(b->e.kv, seq, len);
}

/* One timed run on a fresh sequence, after the untimed depth (and, for
 * --all-logits pp, settle_verifier's passes); *tps gets tok/s. */
static ks_status run_once(struct bench *b, enum bench_test test, int32_t n, double *tps)
{
    int32_t seq;
    ks_status st = kv_seq_create(b->e.kv, &seq);
    if (st)
        return st;
    st = feed_random(b, seq, b->pt.depth, b->max_batch, false);
    if (!st && test == BENCH_PP && b->o->all_logits)
        st = settle_verifier(b, seq, n);
    double t0 = cli_now();
    if (!st)
        st = feed_random(b, seq, n, test == BENCH_PP ? n : 1, test == BENCH_PP && b->o->all_logits);
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
    double samples[BENCH_MAX_REPS]; /* tok/s of each rep, in run order */
    int n;
};

static void stats(struct bench_stat *s)
{
    double mean = 0, var = 0, sorted[BENCH_MAX_REPS];
    for (int i = 0; i < s->n; i++)
        mean += s->samples[i] / s->n;
    for (int i = 0; i < s->n; i++)
        var += (s->samples[i] - mean) * (s->samples[i] - mean);
    memcpy(sorted, s->samples, (size_t)s->n * sizeof *sorted);
    qsort(sorted, (size_t)s->n, sizeof *sorted, cmp_double);
    s->median = s->n % 2 ? sorted[s->n / 2] : 0.5 * (sorted[s->n / 2 - 1] + sorted[s->n / 2]);
    s->sd = s->n > 1 ? sqrt(var / (s->n - 1)) : 0.0;
}

/* The warm-up is the test itself for pp: kvserve grows its batch buffers and
 * touches its KV pages when a batch first needs them, where llama.cpp sizes
 * its buffers when it makes the context, so llama-bench's 32-token warm-up
 * leaves it nothing to allocate in a timed run and would leave kvserve a
 * first timed pp128 at about half its speed on the trained 4 MiB model (one
 * rep a round in bench/vs_llamacpp.sh: 14.6-15.5k against 28k tok/s). */
static ks_status run_test(struct bench *b, enum bench_test test, int32_t n, struct bench_stat *out)
{
    double warm;
    ks_status st = run_once(b, test, test == BENCH_PP ? n : 1, &warm);
    out->n = b->o->reps;
    for (int r = 0; !st && r < out->n; r++)
        st = run_once(b, test, n, &out->samples[r]);
    if (!st)
        stats(out);
    return st;
}

/* ---- the output ------------------------------------------------------------ */

static const char *base_name(const char *path)
{
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

static void print_header(enum bench_format f)
{
    if (f == BENCH_MD) {
        printf("| model | size | threads | kv | test | t/s | weights GB/s |\n");
        printf("| --- | ---: | ---: | --- | --- | ---: | ---: |\n");
    } else if (f == BENCH_CSV) {
        printf("model,size_bytes,n_threads,type_k,type_v,kv_policy,test,n_prompt,n_gen,n_depth,reps,"
               "tps_median,tps_sd,weights_gbs\n");
    } else {
        printf("[\n");
    }
}

static void print_footer(enum bench_format f, bool any_rows)
{
    if (f == BENCH_JSON && any_rows)
        printf("\n]\n");
}

/* A CSV field: quoted, with quotes doubled, when it holds a comma, quote or newline. */
static void csv_field(const char *s)
{
    if (!strpbrk(s, ",\"\n")) {
        fputs(s, stdout);
        return;
    }
    putchar('"');
    for (; *s; s++)
        *s == '"' ? fputs("\"\"", stdout) : putchar(*s);
    putchar('"');
}

static void print_json_row(const struct bench *b, enum bench_test test, int32_t n, const struct bench_stat *s,
                           const char *name, const char *policy, double gbs, bool first)
{
    const struct bench_point *pt = &b->pt;
    cJSON *r = cJSON_CreateObject();
    cJSON_AddStringToObject(r, "model", base_name(b->path));
    cJSON_AddNumberToObject(r, "size_bytes", (double)model_weight_bytes(b->e.model));
    cJSON_AddNumberToObject(r, "n_threads", pt->n_threads);
    cJSON_AddStringToObject(r, "type_k", quant_type_name(pt->type_k));
    cJSON_AddStringToObject(r, "type_v", quant_type_name(pt->type_v));
    cJSON_AddStringToObject(r, "kv_policy", policy);
    cJSON_AddStringToObject(r, "test", name);
    cJSON_AddNumberToObject(r, "n_prompt", test == BENCH_PP ? n : 0);
    cJSON_AddNumberToObject(r, "n_gen", test == BENCH_TG ? n : 0);
    cJSON_AddNumberToObject(r, "n_depth", pt->depth);
    cJSON_AddNumberToObject(r, "reps", s->n);
    cJSON_AddNumberToObject(r, "tps_median", s->median);
    cJSON_AddNumberToObject(r, "tps_sd", s->sd);
    cJSON_AddItemToObject(r, "samples_ts", cJSON_CreateDoubleArray(s->samples, s->n));
    if (test == BENCH_TG)
        cJSON_AddNumberToObject(r, "weights_gbs", gbs);
    else
        cJSON_AddNullToObject(r, "weights_gbs");
    char *text = cJSON_PrintUnformatted(r);
    printf("%s  %s", first ? "" : ",\n", text ? text : "{}");
    free(text);
    cJSON_Delete(r);
}

static void print_row(const struct bench *b, enum bench_test test, int32_t n, const struct bench_stat *s, bool first)
{
    const struct bench_point *pt = &b->pt;
    bool dynamic = b->o->load.kv.cfg.policy == KV_POLICY_DYNAMIC;
    const char *policy = dynamic ? "dynamic" : "static";
    char name[64];
    int w = snprintf(name, sizeof name, "%s%d", test == BENCH_PP ? "pp" : "tg", (int)n);
    if (pt->depth && w > 0 && (size_t)w < sizeof name)
        snprintf(name + w, sizeof name - (size_t)w, " @ d%d", pt->depth);
    double bytes = (double)model_weight_bytes(b->e.model);
    double gbs = (double)model_active_weight_bytes(b->e.model) * s->median / 1e9;
    if (first)
        print_header(b->o->format);
    if (b->o->format == BENCH_JSON) {
        print_json_row(b, test, n, s, name, policy, gbs, first);
    } else if (b->o->format == BENCH_CSV) {
        csv_field(base_name(b->path));
        printf(",%.0f,%d,%s,%s,%s,%s,%d,%d,%d,%d,%.3f,%.3f,", bytes, pt->n_threads, quant_type_name(pt->type_k),
               quant_type_name(pt->type_v), policy, name, test == BENCH_PP ? (int)n : 0, test == BENCH_TG ? (int)n : 0,
               pt->depth, s->n, s->median, s->sd);
        if (test == BENCH_TG)
            printf("%.2f", gbs);
        putchar('\n');
    } else {
        char gbs_text[32] = "";
        if (test == BENCH_TG)
            snprintf(gbs_text, sizeof gbs_text, "%.1f", gbs);
        printf("| %s | %.0f MiB | %d | %s/%s%s | %s | %.2f ± %.2f | %s |\n", base_name(b->path), bytes / (1 << 20),
               pt->n_threads, quant_type_name(pt->type_k), quant_type_name(pt->type_v), dynamic ? " dynamic" : "",
               name, s->median, s->sd, gbs_text);
    }
    fflush(stdout);
}

/* Every test of one combination: pp for each -p, then tg for each -n. */
static ks_status run_point(struct bench *b, int *rows)
{
    const struct bench_opts *o = b->o;
    struct bench_stat s;
    for (int t = 0; t < 2; t++) {
        const struct int_list *l = t == 0 ? &o->prompt : &o->gen;
        for (int i = 0; i < l->n; i++) {
            if (l->v[i] == 0)
                continue;
            ks_status st = run_test(b, t == 0 ? BENCH_PP : BENCH_TG, l->v[i], &s);
            if (st)
                return st;
            print_row(b, t == 0 ? BENCH_PP : BENCH_TG, l->v[i], &s, *rows == 0);
            (*rows)++;
        }
    }
    return KS_OK;
}

static void report(const char *path, const struct bench_point *pt, ks_status st)
{
    const char *msg = *ks_errmsg() ? ks_errmsg() : ks_strerror(st);
    if (pt)
        fprintf(stderr, "kvserve bench: %s, -t %d -ctk %s -ctv %s -d %d: %s\n", base_name(path), pt->n_threads,
                quant_type_name(pt->type_k), quant_type_name(pt->type_v), pt->depth, msg);
    else
        fprintf(stderr, "kvserve bench: %s\n", msg);
}

/* Load one model, then each combination of threads, K type, V type and
 * depth. A combination that fails (a quantized cache on a head_dim the type
 * cannot hold, say) is reported and the others still run; the number that
 * failed is returned. */
static int run_model(const struct bench_opts *o, const char *path, int *rows)
{
    struct bench b = {.o = o, .path = path};
    ks_status st = cli_load_model(path, &o->load, &b.e.model);
    if (!st)
        st = bench_buffers(&b);
    int failed = 0;
    if (st) {
        report(path, NULL, st);
        failed = 1;
    }
    for (int it = 0; !st && it < o->threads.n; it++)
        for (int ik = 0; ik < o->type_k.n; ik++)
            for (int iv = 0; iv < o->type_v.n; iv++)
                for (int id = 0; id < o->depth.n; id++) {
                    struct bench_point pt = {o->threads.v[it], o->depth.v[id], o->type_k.v[ik], o->type_v.v[iv]};
                    ks_status pst = bench_engine(&b, &pt);
                    if (!pst)
                        pst = run_point(&b, rows);
                    if (pst)
                        report(path, &pt, pst), failed++;
                    bench_engine_free(&b);
                }
    cli_engine_free(&b.e);
    free(b.tokens), free(b.pos), free(b.seq), free(b.logits), free(b.want);
    return failed;
}

int cli_bench(int argc, char **argv)
{
    struct bench_opts o;
    int rc = parse_args(argc, argv, &o);
    if (rc)
        return rc < 0 ? 0 : rc;
    char default_path[4096];
    if (o.n_models == 0) {
        const char *path = cli_model_path("bench", NULL, default_path, sizeof default_path);
        if (!path)
            return 2;
        o.models[o.n_models++] = path;
    }
    int rows = 0, failed = 0;
    for (int i = 0; i < o.n_models; i++)
        failed += run_model(&o, o.models[i], &rows);
    print_footer(o.format, rows > 0);
    return failed ? 1 : 0;
}
