/* The sampler chain against llama.cpp's own samplers: the anchor build's
 * libllama ($KVSERVE_SHARED/anchor/bin/libllama.so.0, dlopen'd) runs one
 * stage (typical-p, top-p / min-p with min_keep, top-n-sigma, XTC, dynamic
 * temperature, penalties, DRY without breakers, mirostat 1 and 2) on the same
 * logits, and the candidates it leaves, softmaxed, must be kvserve's final
 * distribution for that stage alone. Skipped without the anchor. */
#include <dlfcn.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "sample/sample.h"
#include "sample/sample_internal.h"
#include "support/skip.h"

/* llama.h's types, as its C API defines them */
struct llama_token_data {
    int32_t id;
    float logit;
    float p;
};
struct llama_token_data_array {
    struct llama_token_data *data;
    size_t size;
    int64_t selected;
    bool sorted;
};
struct llama_sampler;

static struct {
    void *lib;
    struct llama_sampler *(*top_p)(float, size_t);
    struct llama_sampler *(*min_p)(float, size_t);
    struct llama_sampler *(*typical)(float, size_t);
    struct llama_sampler *(*temp_ext)(float, float, float);
    struct llama_sampler *(*xtc)(float, float, size_t, uint32_t);
    struct llama_sampler *(*top_n_sigma)(float);
    struct llama_sampler *(*mirostat)(int32_t, uint32_t, float, float, int32_t);
    struct llama_sampler *(*mirostat_v2)(uint32_t, float, float);
    /* the anchor's penalties take the vocabulary size first (n_vocab, last_n, repeat, freq,
     * present): its code reads last_n from the second integer argument */
    struct llama_sampler *(*penalties)(int32_t, int32_t, float, float, float);
    /* the anchor's DRY takes no n_ctx_train: (vocab, multiplier, base, allowed_length,
     * penalty_last_n > 0, breakers, n_breakers), as its code reads its arguments */
    struct llama_sampler *(*dry)(const void *, float, float, int32_t, int32_t, const char **, size_t);
    void (*accept)(struct llama_sampler *, int32_t);
    void (*apply)(struct llama_sampler *, struct llama_token_data_array *);
    void (*free)(struct llama_sampler *);
} L;

static bool load_llama(void)
{
    const char *shared = getenv("KVSERVE_SHARED");
    char path[1024];
    snprintf(path, sizeof path, "%s/anchor/bin/libllama.so.0", shared ? shared : "../shared");
    L.lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!L.lib)
        return false;
#define SYM(field, name) *(void **)&L.field = dlsym(L.lib, name)
    SYM(top_p, "llama_sampler_init_top_p");
    SYM(min_p, "llama_sampler_init_min_p");
    SYM(typical, "llama_sampler_init_typical");
    SYM(temp_ext, "llama_sampler_init_temp_ext");
    SYM(xtc, "llama_sampler_init_xtc");
    SYM(top_n_sigma, "llama_sampler_init_top_n_sigma");
    SYM(mirostat, "llama_sampler_init_mirostat");
    SYM(mirostat_v2, "llama_sampler_init_mirostat_v2");
    SYM(penalties, "llama_sampler_init_penalties");
    SYM(dry, "llama_sampler_init_dry");
    SYM(accept, "llama_sampler_accept");
    SYM(apply, "llama_sampler_apply");
    SYM(free, "llama_sampler_free");
#undef SYM
    return L.top_p && L.min_p && L.typical && L.temp_ext && L.xtc && L.top_n_sigma && L.mirostat && L.mirostat_v2 &&
           L.penalties && L.dry && L.accept && L.apply && L.free;
}

#define V 12
static const float X[V] = {2.0f, 1.5f, 1.4f, 0.3f, -0.2f, 0.9f, -1.0f, 1.45f, 0.0f, -2.5f, 0.6f, -0.7f};

/* llama.cpp's candidates after smpl (history accepted first), softmaxed per id. */
static void llama_probs(struct llama_sampler *smpl, const int32_t *hist, int n_hist, const float *x, int n,
                        double *out)
{
    struct llama_token_data d[512];
    for (int i = 0; i < n; i++)
        d[i] = (struct llama_token_data){i, x[i], 0};
    for (int i = 0; i < n_hist; i++)
        L.accept(smpl, hist[i]);
    struct llama_token_data_array a = {d, (size_t)n, -1, false};
    L.apply(smpl, &a);
    double max = -INFINITY, sum = 0;
    for (size_t i = 0; i < a.size; i++)
        max = a.data[i].logit > max ? a.data[i].logit : max;
    for (int i = 0; i < n; i++)
        out[i] = 0;
    for (size_t i = 0; i < a.size; i++)
        sum += isinf(a.data[i].logit) ? 0 : exp(a.data[i].logit - max);
    for (size_t i = 0; i < a.size; i++)
        out[a.data[i].id] = isinf(a.data[i].logit) ? 0 : exp(a.data[i].logit - max) / sum;
    L.free(smpl);
}

static void ours(struct sample_params p, enum sample_stage st, const int32_t *hist, int n_hist, const float *x, int n,
                 double *out)
{
    p.n_order = 2; /* the stage, then temperature 1 (a second one: the chain, whatever the stage) */
    p.order[0] = st;
    p.order[1] = SAMPLE_STAGE_TEMPERATURE;
    if (st == SAMPLE_STAGE_TEMPERATURE)
        p.order[0] = SAMPLE_STAGE_TEMPERATURE, p.n_order = 1;
    struct sampler *s = NULL;
    assert_int_equal(sample_create(&p, n, &s), KS_OK);
    assert_non_null(s->chain);
    const struct chain_cand *c;
    int32_t k;
    assert_int_equal(sample_final_distribution(s, x, hist, n_hist, &c, &k), KS_OK);
    for (int i = 0; i < n; i++)
        out[i] = 0;
    for (int32_t i = 0; i < k; i++)
        out[c[i].id] = c[i].p;
    sample_free(s);
}

static void same(const double *a, const double *b, int n, const char *what)
{
    for (int i = 0; i < n; i++)
        if (fabs(a[i] - b[i]) > 1e-5) {
            print_error("%s: token %d: kvserve %.7f, llama.cpp %.7f\n", what, i, a[i], b[i]);
            fail();
        }
}

static struct sample_params base(void)
{
    struct sample_params p;
    sample_params_default(&p);
    p.temp = 1.0f;
    p.top_k = 0;
    p.top_p = 1.0f;
    p.min_p = 0.0f;
    p.dynatemp_range = 1e-30f; /* keeps the chain on; a range this small is temperature 1 */
    return p;
}

static void test_truncations(void **state)
{
    (void)state;
    double a[V], b[V];
    for (int keep = 0; keep <= 5; keep += 5) {
        const float ps[] = {0.2f, 0.5f, 0.9f};
        for (int i = 0; i < 3; i++) {
            struct sample_params p = base();
            p.min_keep = keep;
            p.typical_p = ps[i];
            ours(p, SAMPLE_STAGE_TYPICAL_P, NULL, 0, X, V, a);
            llama_probs(L.typical(ps[i], (size_t)keep), NULL, 0, X, V, b);
            same(a, b, V, "typical");
            p = base();
            p.min_keep = keep;
            p.top_p = ps[i];
            ours(p, SAMPLE_STAGE_TOP_P, NULL, 0, X, V, a);
            llama_probs(L.top_p(ps[i], (size_t)keep), NULL, 0, X, V, b);
            same(a, b, V, "top_p");
            p = base();
            p.min_keep = keep;
            p.min_p = ps[i];
            ours(p, SAMPLE_STAGE_MIN_P, NULL, 0, X, V, a);
            llama_probs(L.min_p(ps[i], (size_t)keep), NULL, 0, X, V, b);
            same(a, b, V, "min_p");
            p = base();
            p.top_n_sigma = ps[i] * 2;
            ours(p, SAMPLE_STAGE_TOP_N_SIGMA, NULL, 0, X, V, a);
            llama_probs(L.top_n_sigma(ps[i] * 2), NULL, 0, X, V, b);
            same(a, b, V, "top_n_sigma");
            p = base();
            p.min_keep = keep;
            p.xtc_probability = 1.0f;
            p.xtc_threshold = ps[i] / 3;
            ours(p, SAMPLE_STAGE_XTC, NULL, 0, X, V, a);
            llama_probs(L.xtc(1.0f, ps[i] / 3, (size_t)keep, 1), NULL, 0, X, V, b);
            same(a, b, V, "xtc");
        }
    }
}

static void test_dynatemp(void **state)
{
    (void)state;
    double a[V], b[V];
    const float ranges[] = {0.3f, 0.8f, 1.5f}, exps[] = {0.5f, 1.0f, 2.0f};
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 3; j++) {
            struct sample_params p = base();
            p.temp = 0.9f;
            p.dynatemp_range = ranges[i];
            p.dynatemp_exponent = exps[j];
            ours(p, SAMPLE_STAGE_TEMPERATURE, NULL, 0, X, V, a);
            llama_probs(L.temp_ext(0.9f, ranges[i], exps[j]), NULL, 0, X, V, b);
            same(a, b, V, "dynatemp");
        }
}

static void test_penalties_and_dry(void **state)
{
    (void)state;
    double a[V], b[V];
    const int32_t h[] = {9, 10, 3, 11, 9, 10, 3, 11, 9, 10, 2, 9, 10, 3, 11, 9, 10, 4, 0, 0, 7, 9, 10, 3};
    const int n = (int)(sizeof h / sizeof h[0]);
    struct sample_params p = base();
    p.repeat_penalty = 1.3f;
    p.presence_penalty = 0.2f;
    p.frequency_penalty = 0.1f;
    p.repeat_last_n = 12;
    ours(p, SAMPLE_STAGE_PENALTIES, h, n, X, V, a);
    llama_probs(L.penalties(V, 12, 1.3f, 0.1f, 0.2f), h, n, X, V, b);
    same(a, b, V, "penalties");
    double plain[V];
    p = base();
    ours(p, SAMPLE_STAGE_TOP_P, NULL, 0, X, V, plain); /* top_p 1: nothing */
    int penalized = 0;
    for (int allowed = 0; allowed <= 3; allowed++)
        for (int last_n = 8; last_n <= 64; last_n += 56) {
            p = base();
            p.dry_multiplier = 0.7f;
            p.dry_base = 1.75f;
            p.dry_allowed_length = allowed;
            p.dry_penalty_last_n = last_n;
            ours(p, SAMPLE_STAGE_DRY, h, n, X, V, a);
            llama_probs(L.dry(NULL, 0.7f, 1.75f, allowed, last_n, NULL, 0), h, n, X, V, b);
            same(a, b, V, "dry");
            bool changed = false;
            for (int i = 0; i < V; i++)
                changed |= fabs(a[i] - plain[i]) > 1e-3;
            print_message("dry allowed %d last_n %d: %s\n", allowed, last_n, changed ? "penalized" : "unchanged");
            penalized += changed;
        }
    assert_true(penalized >= 4);
}

static void test_mirostat(void **state)
{
    (void)state;
    enum { N = 300 };
    float x[N];
    for (int i = 0; i < N; i++)
        x[i] = (float)(-1.2 * log(i + 1.0) + 0.01 * ((i * 37) % 11));
    double a[N], b[N];
    const float taus[] = {1.0f, 3.0f, 6.0f};
    for (int k = 0; k < 3; k++)
        for (int version = 1; version <= 2; version++) {
            struct sample_params p = base();
            p.dynatemp_range = 0;
            p.mirostat = version;
            p.mirostat_tau = taus[k];
            struct sampler *s = NULL;
            assert_int_equal(sample_create(&p, N, &s), KS_OK);
            const struct chain_cand *c;
            int32_t n;
            assert_int_equal(sample_final_distribution(s, x, NULL, 0, &c, &n), KS_OK);
            for (int i = 0; i < N; i++)
                a[i] = 0;
            for (int32_t i = 0; i < n; i++)
                a[c[i].id] = c[i].p;
            sample_free(s);
            llama_probs(version == 1 ? L.mirostat(N, 1, taus[k], 0.1f, 100) : L.mirostat_v2(1, taus[k], 0.1f), NULL,
                        0, x, N, b);
            same(a, b, N, version == 1 ? "mirostat" : "mirostat_v2");
        }
}

int main(void)
{
    if (!load_llama())
        return ks_skip_all("no libllama.so.0 with the sampler API under $KVSERVE_SHARED/anchor/bin");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_truncations),
        cmocka_unit_test(test_dynatemp),
        cmocka_unit_test(test_penalties_and_dry),
        cmocka_unit_test(test_mirostat),
    };
    return ks_run_tests(tests, NULL, NULL);
}
