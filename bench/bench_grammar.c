/* Grammar-masking cost per decode step at a large vocabulary, against the
 * unconstrained sample step on the same logits.
 *
 * usage: bench_grammar [-r REQUESTS] [-n TOKENS] [-s SCHEMA_JSON | -j] [VOCAB.gguf]
 * Default vocabulary: qwen3 (151k tokens) from the shared dir (KVSERVE_SHARED
 * or ../shared); default grammar: a json_schema of four properties (-j: the
 * json_object grammar). Each request compiles the grammar (as the server
 * does), starts a fresh grammar state and draws up to -n tokens (its
 * max_tokens) from random logits through the mask, so the walk covers object
 * keys, strings, numbers, arrays and the budget's endgame.
 *
 * The requests alternate between two vocabularies built from the same
 * tokenizer: one without the shared mask cache (grammar_vocab_set_mask_cache
 * 0: every request starts with no masks, as before the cache) and one with
 * it; request pairs draw the same tokens, so the two columns are the same
 * work interleaved in time on the same machine.
 *
 * A step's mask is "cold" when it walks the vocabulary trie (the first time
 * its stack set is seen, or near the end of the budget), "shared" when it
 * copies another request's mask from the vocabulary's cache, and "warm" when
 * it applies the state's own cached bitset.
 * Printed: medians and means per step of the mask, the accept, the
 * unconstrained sample_next (default llama.cpp sampling: top-k 40, top-p 0.95,
 * min-p 0.05, temp 0.8), and the grammar's total per step as a share of it. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "gguf/gguf.h"
#include "grammar/grammar.h"
#include "sample/sample.h"
#include "tokenizer/tokenizer.h"

static const char default_schema[] =
    "{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"},\"temperature\":{\"type\":\"number\"},"
    "\"sunny\":{\"type\":\"boolean\"},\"forecast\":{\"type\":\"array\",\"items\":{\"type\":\"object\",\"properties\":"
    "{\"day\":{\"type\":\"string\",\"enum\":[\"mon\",\"tue\",\"wed\"]},\"high\":{\"type\":\"integer\"}},\"required\":"
    "[\"day\",\"high\"],\"additionalProperties\":false}}},\"required\":[\"city\",\"temperature\",\"sunny\",\"forecast\"],"
    "\"additionalProperties\":false}";

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

struct series {
    double *v;
    int n;
};

static void add(struct series *s, double x)
{
    s->v[s->n++] = x;
}

static void report(const char *name, struct series *s)
{
    if (s->n == 0) {
        printf("%-28s %6d steps\n", name, 0);
        return;
    }
    double sum = 0;
    for (int i = 0; i < s->n; i++)
        sum += s->v[i];
    qsort(s->v, (size_t)s->n, sizeof *s->v, bench_cmp_double);
    printf("%-28s %6d steps  median %8.3f ms  mean %8.3f ms  p90 %8.3f ms  max %8.3f ms\n", name, s->n,
           1e3 * s->v[s->n / 2], 1e3 * sum / s->n, 1e3 * s->v[(int)(s->n * 0.9)], 1e3 * s->v[s->n - 1]);
}

static double mean(const struct series *s)
{
    double sum = 0;
    for (int i = 0; i < s->n; i++)
        sum += s->v[i];
    return s->n ? sum / s->n : 0;
}

static uint64_t rng_next(uint64_t *s)
{
    *s += 0x9E3779B97F4A7C15ull;
    uint64_t z = *s;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* The per-step timings of one column. */
struct run {
    const char *name;
    struct series unc, all, cold, shared, warm, acc;
    int completed;
};

static int run_alloc(struct run *r, size_t cap)
{
    struct series *all[] = {&r->unc, &r->all, &r->cold, &r->shared, &r->warm, &r->acc};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (!(all[i]->v = malloc(cap * sizeof(double)))) {
            fprintf(stderr, "bench_grammar: out of memory\n");
            return 1;
        }
    return 0;
}

static void run_free(struct run *r)
{
    struct series *all[] = {&r->unc, &r->all, &r->cold, &r->shared, &r->warm, &r->acc};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        free(all[i]->v);
}

static void run_report(struct run *r)
{
    printf("-- %s (%d ended by EOG, the rest complete at max_tokens)\n", r->name, r->completed);
    report("unconstrained sample_next", &r->unc);
    double m_all = mean(&r->all), m_acc = mean(&r->acc), m_unc = mean(&r->unc);
    report("grammar_mask, all steps", &r->all);
    report("  cold (walked the trie)", &r->cold);
    report("  shared (another's mask)", &r->shared);
    report("  warm (own cached bitset)", &r->warm);
    report("grammar_accept", &r->acc);
    printf("grammar per step (mask + accept), mean: %.3f ms = %.2fx the unconstrained sample step\n",
           1e3 * (m_all + m_acc), (m_all + m_acc) / m_unc);
}

/* One request: compile the grammar, then up to `tokens` draws from random
 * logits through the mask. Returns nonzero on failure (printed). */
static int run_request(struct run *run, const struct grammar_vocab *gv, const struct tokenizer *tok, const char *gbnf,
                       int tokens, uint64_t seed, float *logits, float *masked)
{
    int32_t n_vocab = tok_n_vocab(tok);
    struct grammar *g = NULL;
    struct grammar_state *st = NULL;
    struct sample_params sp;
    sample_params_default(&sp);
    sp.seed = seed;
    struct sampler *plain = NULL;
    if (sample_create(&sp, n_vocab, &plain) || grammar_compile(gbnf, strlen(gbnf), &g) ||
        grammar_state_create(g, gv, tokens, &st)) {
        fprintf(stderr, "bench_grammar: %s\n", ks_errmsg());
        return 1;
    }
    grammar_free(g); /* the state holds it */
    for (int i = 0; i < tokens; i++) {
        for (int32_t k = 0; k < n_vocab; k++) /* a spread like a real model's logits */
            logits[k] = (float)((double)(rng_next(&seed) >> 11) * 0x1.0p-53 * 12.0 - 6.0);
        struct sample_result res;
        double a = now();
        uint64_t walks = grammar_state_walks(st), hits = grammar_state_shared_hits(st);
        sample_next(plain, logits, NULL, 0, &res);
        add(&run->unc, now() - a);
        memcpy(masked, logits, (size_t)n_vocab * sizeof *masked);
        a = now();
        ks_status s = grammar_mask(st, masked, n_vocab);
        double t_mask = now() - a;
        if (s) {
            fprintf(stderr, "bench_grammar: mask: %s\n", ks_errmsg());
            return 1;
        }
        add(&run->all, t_mask);
        add(grammar_state_walks(st) > walks ? &run->cold : grammar_state_shared_hits(st) > hits ? &run->shared
                                                                                                 : &run->warm,
            t_mask);
        sample_next(plain, masked, NULL, 0, &res);
        if (tok_is_eog(tok, res.token)) {
            run->completed++;
            break;
        }
        a = now();
        if (grammar_accept(st, res.token)) {
            fprintf(stderr, "bench_grammar: accept: %s\n", ks_errmsg());
            return 1;
        }
        add(&run->acc, now() - a);
    }
    grammar_state_free(st);
    sample_free(plain);
    return 0;
}

int main(int argc, char **argv)
{
    int requests = 8, tokens = 256;
    const char *schema = default_schema, *path = NULL;
    bool json_object = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-r") && i + 1 < argc)
            requests = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-n") && i + 1 < argc)
            tokens = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-s") && i + 1 < argc)
            schema = argv[++i];
        else if (!strcmp(argv[i], "-j"))
            json_object = true;
        else if (argv[i][0] != '-')
            path = argv[i];
        else {
            fprintf(stderr, "usage: bench_grammar [-r REQUESTS] [-n TOKENS] [-s SCHEMA_JSON | -j] [VOCAB.gguf]\n");
            return 2;
        }
    }
    char buf[1024];
    if (!path) {
        const char *dir = getenv("KVSERVE_SHARED");
        snprintf(buf, sizeof buf, "%s/models/vocab/ggml-vocab-qwen3.gguf", dir ? dir : "../shared");
        path = buf;
    }
    struct gguf_file *f = NULL;
    struct tokenizer *tok = NULL;
    if (gguf_open(path, &f) || tok_load(f, &tok)) {
        fprintf(stderr, "bench_grammar: %s: %s\n", path, ks_errmsg());
        return 1;
    }
    int32_t n_vocab = tok_n_vocab(tok);
    double t0 = now();
    struct grammar_vocab *gv = NULL;
    if (grammar_vocab_from_tokenizer(tok, &gv)) {
        fprintf(stderr, "bench_grammar: %s\n", ks_errmsg());
        return 1;
    }
    double t_trie = now() - t0;
    char *gbnf = NULL;
    t0 = now();
    if (!json_object && grammar_from_json_schema(schema, strlen(schema), &gbnf)) {
        fprintf(stderr, "bench_grammar: %s\n", ks_errmsg());
        return 1;
    }
    const char *text = json_object ? grammar_json_object_gbnf() : gbnf;
    struct grammar *g = NULL;
    if (grammar_compile(text, strlen(text), &g)) {
        fprintf(stderr, "bench_grammar: %s\n", ks_errmsg());
        return 1;
    }
    double t_compile = now() - t0;
    printf("vocabulary %s: %d tokens, trie built once in %.1f ms; grammar (%s) compiled in %.3f ms\n", path,
           (int)n_vocab, 1e3 * t_trie, json_object ? "json_object" : "json_schema", 1e3 * t_compile);

    struct grammar_vocab *gv_plain = NULL;
    if (grammar_vocab_from_tokenizer(tok, &gv_plain)) {
        fprintf(stderr, "bench_grammar: %s\n", ks_errmsg());
        return 1;
    }
    grammar_vocab_set_mask_cache(gv_plain, 0);
    size_t cap = (size_t)requests * (size_t)tokens + 1;
    struct run runs[2] = {{.name = "no shared cache"}, {.name = "shared mask cache"}};
    for (int k = 0; k < 2; k++)
        if (run_alloc(&runs[k], cap))
            return 1;
    float *logits = malloc((size_t)n_vocab * sizeof *logits), *masked = malloc((size_t)n_vocab * sizeof *masked);
    for (int r = 0; r < 2 * requests; r++) {
        struct run *run = &runs[r % 2];
        uint64_t seed = 42 + (uint64_t)(r / 2) * 1000003u; /* a pair draws the same tokens */
        if (run_request(run, r % 2 ? gv : gv_plain, tok, text, tokens, seed, logits, masked))
            return 1;
    }
    printf("%d request pairs of up to %d tokens, alternating\n", requests, tokens);
    for (int k = 0; k < 2; k++)
        run_report(&runs[k]);
    for (int k = 0; k < 2; k++)
        run_free(&runs[k]);
    grammar_vocab_free(gv_plain);
    free(logits);
    free(masked);
    free(gbnf);
    grammar_free(g);
    grammar_vocab_free(gv);
    tok_free(tok);
    gguf_close(f);
    return 0;
}
