/* Grammar-masking cost per decode step at a large vocabulary, against the
 * unconstrained sample step on the same logits.
 *
 * usage: bench_grammar [-r REQUESTS] [-n TOKENS] [-s SCHEMA_JSON | -j] [VOCAB.gguf]
 * Default vocabulary: qwen3 (151k tokens) from the shared dir (KVSERVE_SHARED
 * or ../shared); default grammar: a json_schema of four properties (-j: the
 * json_object grammar). Each request starts a fresh grammar state and draws
 * up to -n tokens (its max_tokens) from random logits through the mask, so the
 * walk covers object keys, strings, numbers, arrays and the budget's endgame.
 *
 * A step's mask is "cold" when it walks the vocabulary trie (the first time
 * its stack set is seen in a request, or near the end of the budget) and
 * "warm" when it applies the set's cached bitset.
 * Printed: medians and means per step of the mask, the accept, the
 * unconstrained sample_next (default llama.cpp sampling: top-k 40, top-p 0.95,
 * min-p 0.05, temp 0.8), and the grammar's total per step as a share of it. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
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
    qsort(s->v, (size_t)s->n, sizeof *s->v, cmp_double);
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

    struct sample_params sp;
    sample_params_default(&sp);
    struct sampler *plain = NULL;
    if (sample_create(&sp, n_vocab, &plain)) {
        fprintf(stderr, "bench_grammar: %s\n", ks_errmsg());
        return 1;
    }
    size_t cap = (size_t)requests * (size_t)tokens + 1;
    struct series cold = {malloc(cap * sizeof(double)), 0}, warm = {malloc(cap * sizeof(double)), 0};
    struct series all = {malloc(cap * sizeof(double)), 0}, acc = {malloc(cap * sizeof(double)), 0};
    struct series unc = {malloc(cap * sizeof(double)), 0};
    float *logits = malloc((size_t)n_vocab * sizeof *logits), *masked = malloc((size_t)n_vocab * sizeof *masked);
    uint64_t seed = 42;
    int completed = 0;
    for (int r = 0; r < requests; r++) {
        struct grammar_state *st = NULL;
        if (grammar_state_create(g, gv, tokens, &st)) {
            fprintf(stderr, "bench_grammar: %s\n", ks_errmsg());
            return 1;
        }
        for (int i = 0; i < tokens; i++) {
            for (int32_t k = 0; k < n_vocab; k++) /* a spread like a real model's logits */
                logits[k] = (float)((double)(rng_next(&seed) >> 11) * 0x1.0p-53 * 12.0 - 6.0);
            struct sample_result res;
            double a = now();
            uint64_t walks = grammar_state_walks(st);
            sample_next(plain, logits, NULL, 0, &res);
            add(&unc, now() - a);
            memcpy(masked, logits, (size_t)n_vocab * sizeof *masked);
            a = now();
            ks_status s = grammar_mask(st, masked, n_vocab);
            double t_mask = now() - a;
            if (s) {
                fprintf(stderr, "bench_grammar: mask: %s\n", ks_errmsg());
                return 1;
            }
            add(&all, t_mask);
            sample_next(plain, masked, NULL, 0, &res);
            if (tok_is_eog(tok, res.token)) {
                completed++;
                break;
            }
            a = now();
            if (grammar_accept(st, res.token)) {
                fprintf(stderr, "bench_grammar: accept: %s\n", ks_errmsg());
                return 1;
            }
            add(&acc, now() - a);
            if (grammar_state_walks(st) > walks)
                add(&cold, t_mask);
            else
                add(&warm, t_mask);
        }
        grammar_state_free(st);
    }
    printf("%d requests of up to %d tokens (%d ended by EOG, the rest complete at max_tokens)\n", requests, tokens,
           completed);
    report("unconstrained sample_next", &unc);
    double m_all = mean(&all), m_acc = mean(&acc), m_unc = mean(&unc);
    report("grammar_mask, all steps", &all);
    report("  cold (walked the trie)", &cold);
    report("  warm (cached bitset)", &warm);
    report("grammar_accept", &acc);
    printf("grammar per step (mask + accept), mean: %.3f ms = %.2fx the unconstrained sample step\n",
           1e3 * (m_all + m_acc), (m_all + m_acc) / m_unc);
    free(logits);
    free(masked);
    free(cold.v);
    free(warm.v);
    free(all.v);
    free(acc.v);
    free(unc.v);
    free(gbnf);
    sample_free(plain);
    grammar_free(g);
    grammar_vocab_free(gv);
    tok_free(tok);
    gguf_close(f);
    return 0;
}
