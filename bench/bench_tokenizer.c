/* Tokenizer throughput: MB/s encoding ~1 MB of English (the trained model's
 * held-out sample.txt repeated) with each vocabulary given, median of runs.
 *
 * usage: bench_tokenizer [-n RUNS] [-t TEXT] [VOCAB.gguf ...]
 * Without vocabularies: llama-spm, llama3 and qwen3 from the shared dir
 * (KVSERVE_SHARED or ../shared). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"

#define TARGET_BYTES (1u << 20)

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static char *load_text(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    if (n <= 0) {
        fclose(f);
        return NULL;
    }
    size_t reps = (TARGET_BYTES + (size_t)n - 1) / (size_t)n;
    char *buf = malloc((size_t)n * reps);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) {
        fclose(f);
        free(buf);
        return NULL;
    }
    fclose(f);
    for (size_t r = 1; r < reps; r++)
        memcpy(buf + r * (size_t)n, buf, (size_t)n);
    *len = (size_t)n * reps;
    return buf;
}

static int bench_one(const char *path, const char *text, size_t len, int runs)
{
    struct gguf_file *f = NULL;
    struct tokenizer *t = NULL;
    if (gguf_open(path, &f) || tok_load(f, &t)) {
        fprintf(stderr, "%s: %s\n", path, ks_errmsg());
        gguf_close(f);
        return 1;
    }
    gguf_close(f);
    double *secs = malloc((size_t)runs * sizeof *secs);
    size_t n_ids = 0;
    for (int r = 0; r < runs; r++) {
        int32_t *ids = NULL;
        double t0 = now();
        if (tok_encode(t, text, len, 0, &ids, &n_ids)) {
            fprintf(stderr, "encode: %s\n", ks_errmsg());
            return 1;
        }
        secs[r] = now() - t0;
        free(ids);
    }
    qsort(secs, (size_t)runs, sizeof *secs, bench_cmp_double);
    double med = secs[runs / 2];
    const char *name = strrchr(path, '/');
    const char *fam = tok_family(t) == TOK_FAMILY_SPM ? "SPM" : tok_family(t) == TOK_FAMILY_BPE ? "BPE" : "WPM";
    printf("%-28s %s %-10s %8.2f MB in %7.1f ms (median of %d) = %7.2f MB/s, %zu tokens\n", name ? name + 1 : path,
           fam, tok_pre_name(t), len / 1e6, med * 1e3, runs, len / 1e6 / med, n_ids);
    free(secs);
    tok_free(t);
    return 0;
}

int main(int argc, char **argv)
{
    const char *shared = getenv("KVSERVE_SHARED") ? getenv("KVSERVE_SHARED") : "../shared";
    char text_path[1024], defaults[3][1024];
    snprintf(text_path, sizeof text_path, "%s/models/trained/sample.txt", shared);
    int runs = 5, first = 1;
    for (; first < argc && argv[first][0] == '-'; first += 2) {
        if (first + 1 >= argc)
            return fprintf(stderr, "missing value for %s\n", argv[first]), 2;
        if (!strcmp(argv[first], "-n"))
            runs = atoi(argv[first + 1]) > 0 ? atoi(argv[first + 1]) : 1;
        else if (!strcmp(argv[first], "-t"))
            snprintf(text_path, sizeof text_path, "%s", argv[first + 1]);
        else
            return fprintf(stderr, "usage: %s [-n RUNS] [-t TEXT] [VOCAB.gguf ...]\n", argv[0]), 2;
    }
    size_t len = 0;
    char *text = load_text(text_path, &len);
    if (!text)
        return fprintf(stderr, "cannot read %s\n", text_path), 1;
    int rc = 0;
    if (first < argc) {
        for (int i = first; i < argc; i++)
            rc |= bench_one(argv[i], text, len, runs);
    } else {
        const char *names[3] = {"ggml-vocab-llama-spm.gguf", "ggml-vocab-llama3.gguf", "ggml-vocab-qwen3.gguf"};
        for (int i = 0; i < 3; i++) {
            snprintf(defaults[i], sizeof defaults[i], "%s/models/vocab/%s", shared, names[i]);
            rc |= bench_one(defaults[i], text, len, runs);
        }
    }
    free(text);
    return rc;
}
