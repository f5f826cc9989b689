/* Embeddings against llama.cpp itself: the tiny-llama-embed (mean pooling,
 * non-causal attention), tiny-qwen3-embed (last-token pooling, causal) synth
 * presets at F32, and tiny-llama-embed with its pooling overridden to cls.
 * tests/data/embed-NAME.json holds llama-server's /v1/embeddings answer (L2
 * normalized) for three inputs, with their token ids (made as README's
 * "Correctness against llama.cpp" says). The test writes the same files
 * again (synth is deterministic) and holds:
 *   - every input's normalized embedding within 1e-4 (L2 distance; the
 *     vectors have norm 1) of llama.cpp's, the three inputs in one batch;
 *   - the same rows with each input alone in its batch, and beside a decoding
 *     sequence whose logits do not change;
 *   - the refusals: an embedding sequence not starting at 0, pooling none.
 * Exits 77 (skipped) when tests/data or a model cannot be had. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "model/model.h"
#include "support/llamacpp_case.h"
#include "support/read_file.h"
#include "support/skip.h"

#define EMBD_TOL 1e-4
#define LOGIT_TOL 1e-4f /* another batch shape takes other kernel paths */
#define MAX_INPUTS 4
#define MAX_TOKENS 128

static char g_dir[64];

struct embed_case {
    struct llamacpp_synth synth;
    const char *pooling; /* NULL: the file's */
};

static const struct embed_case g_cases[] = {
    {{"embed-tiny-llama-embed-f32", "tiny-llama-embed", "f32"}, NULL},
    {{"embed-tiny-qwen3-embed-f32", "tiny-qwen3-embed", "f32"}, NULL},
    {{"embed-tiny-llama-embed-f32-cls", "tiny-llama-embed", "f32"}, "cls"},
};
#define N_CASES (int)(sizeof g_cases / sizeof g_cases[0])

struct embed_ref {
    int n_inputs, n_embd;
    int n_tokens[MAX_INPUTS];
    int32_t tokens[MAX_INPUTS][MAX_TOKENS];
    float *embd; /* (n_inputs, n_embd) */
};

static void ref_load(const char *name, struct embed_ref *r)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s.json", llamacpp_data_dir(), name);
    char *text = ks_read_file(path, NULL);
    assert_non_null(text);
    cJSON *root = cJSON_Parse(text);
    free(text);
    assert_non_null(root);
    const cJSON *toks = cJSON_GetObjectItem(root, "tokens"), *embs = cJSON_GetObjectItem(root, "embeddings");
    r->n_inputs = cJSON_GetArraySize(toks);
    assert_true(r->n_inputs >= 1 && r->n_inputs <= MAX_INPUTS && cJSON_GetArraySize(embs) == r->n_inputs);
    r->n_embd = cJSON_GetArraySize(cJSON_GetArrayItem(embs, 0));
    r->embd = malloc((size_t)r->n_inputs * (size_t)r->n_embd * sizeof *r->embd);
    assert_non_null(r->embd);
    for (int i = 0; i < r->n_inputs; i++) {
        const cJSON *t = cJSON_GetArrayItem(toks, i), *e = cJSON_GetArrayItem(embs, i);
        r->n_tokens[i] = cJSON_GetArraySize(t);
        assert_true(r->n_tokens[i] >= 1 && r->n_tokens[i] <= MAX_TOKENS && cJSON_GetArraySize(e) == r->n_embd);
        for (int k = 0; k < r->n_tokens[i]; k++)
            r->tokens[i][k] = (int32_t)cJSON_GetArrayItem(t, k)->valuedouble;
        for (int k = 0; k < r->n_embd; k++)
            r->embd[(size_t)i * r->n_embd + k] = (float)cJSON_GetArrayItem(e, k)->valuedouble;
    }
    cJSON_Delete(root);
}

/* The case's engine, with the pooling the reference was made with. */
static void case_engine(const struct embed_case *c, struct llamacpp_engine *e, int max_batch)
{
    char path[1200];
    llamacpp_synth_path(g_dir, &c->synth, path, sizeof path);
    llamacpp_engine_init(e, path, 2, max_batch, 0);
    if (c->pooling) {
        enum model_pooling p;
        assert_int_equal(model_pooling_parse(c->pooling, &p), KS_OK);
        model_set_pooling(e->m, p);
    }
}

static double l2_dist(const float *a, const float *b, int n)
{
    double s = 0;
    for (int i = 0; i < n; i++)
        s += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
    return sqrt(s);
}

/* Inputs first .. first + n of r as sequences 1.. of one batch (and, with
 * decode_seq >= 0, that sequence's next token first); their normalized rows
 * into out. */
static void embed_batch(struct llamacpp_engine *e, const struct embed_ref *r, int first, int n, int32_t decode_seq,
                        int32_t decode_tok, float *logits, float *out)
{
    int32_t tok[MAX_INPUTS * MAX_TOKENS + 1], pos[MAX_INPUTS * MAX_TOKENS + 1], seq[MAX_INPUTS * MAX_TOKENS + 1];
    bool embed[MAX_INPUTS * MAX_TOKENS + 1];
    int32_t nb = 0, seqs[MAX_INPUTS];
    if (decode_seq >= 0) {
        tok[nb] = decode_tok, pos[nb] = kv_seq_len(e->kv, decode_seq), seq[nb] = decode_seq, embed[nb] = false;
        nb++;
    }
    for (int i = first; i < first + n; i++) {
        assert_int_equal(kv_seq_create(e->kv, &seqs[i - first]), KS_OK);
        for (int k = 0; k < r->n_tokens[i]; k++, nb++)
            tok[nb] = r->tokens[i][k], pos[nb] = k, seq[nb] = seqs[i - first], embed[nb] = true;
    }
    struct model_batch b = {.n_tokens = nb, .tokens = tok, .pos = pos, .seq = seq};
    int32_t n_logits = -1, n_embd = -1;
    ks_status st = model_forward_embed(e->ctx, e->kv, &b, embed, logits, &n_logits, out, &n_embd);
    if (st)
        fail_msg("model_forward_embed: %s", ks_errmsg());
    assert_int_equal(n_embd, n);
    assert_int_equal(n_logits, decode_seq >= 0 ? 1 : 0);
    for (int i = 0; i < n; i++) {
        model_embd_normalize(out + (size_t)i * r->n_embd, r->n_embd, 2);
        kv_seq_free(e->kv, seqs[i]);
    }
}

static double g_worst;

static void check_rows(const char *name, const struct embed_ref *r, int first, int n, const float *got)
{
    for (int i = 0; i < n; i++) {
        double d = l2_dist(got + (size_t)i * r->n_embd, r->embd + (size_t)(first + i) * r->n_embd, r->n_embd);
        g_worst = d > g_worst ? d : g_worst;
        if (!(d <= EMBD_TOL))
            fail_msg("%s: input %d is %.3g (L2) from llama.cpp's embedding", name, first + i, d);
    }
}

static void test_against_llamacpp(void **state)
{
    (void)state;
    for (int ci = 0; ci < N_CASES; ci++) {
        const struct embed_case *c = &g_cases[ci];
        struct embed_ref r;
        ref_load(c->synth.name, &r);
        struct llamacpp_engine e;
        case_engine(c, &e, 512);
        int n_vocab = model_hparams(e.m)->n_vocab;
        float *out = malloc((size_t)MAX_INPUTS * r.n_embd * sizeof *out);
        float *logits = malloc(2 * (size_t)n_vocab * sizeof *logits);
        assert_non_null(out);
        assert_non_null(logits);
        /* all inputs in one batch */
        embed_batch(&e, &r, 0, r.n_inputs, -1, 0, NULL, out);
        check_rows(c->synth.name, &r, 0, r.n_inputs, out);
        /* each alone, and beside a decoding sequence whose logits stay as they were */
        int32_t dec;
        assert_int_equal(kv_seq_create(e.kv, &dec), KS_OK);
        int32_t p0[3] = {0, 1, 2}, d0[3] = {dec, dec, dec}, t0[3] = {1, 7, 9};
        struct model_batch pre = {.n_tokens = 3, .tokens = t0, .pos = p0, .seq = d0};
        assert_int_equal(model_forward(e.ctx, e.kv, &pre, logits, NULL), KS_OK);
        int32_t next = 11, p3 = 3;
        struct model_batch one = {.n_tokens = 1, .tokens = &next, .pos = &p3, .seq = &dec};
        assert_int_equal(model_forward(e.ctx, e.kv, &one, logits + n_vocab, NULL), KS_OK);
        assert_int_equal(kv_seq_truncate(e.kv, dec, 3), KS_OK);
        for (int i = 0; i < r.n_inputs; i++) {
            embed_batch(&e, &r, i, 1, dec, next, logits, out);
            check_rows(c->synth.name, &r, i, 1, out);
            float worst = 0;
            for (int v = 0; v < n_vocab; v++)
                worst = fmaxf(worst, fabsf(logits[v] - logits[n_vocab + v]));
            if (!(worst <= LOGIT_TOL))
                fail_msg("%s: input %d changed the decoding sequence's logits by %g", c->synth.name, i, worst);
            assert_int_equal(kv_seq_truncate(e.kv, dec, 3), KS_OK);
        }
        printf("%s: worst L2 distance to llama.cpp %.3g\n", c->synth.name, g_worst);
        g_worst = 0;
        free(out);
        free(logits);
        free(r.embd);
        llamacpp_engine_free(&e);
    }
}

static void test_refusals(void **state)
{
    (void)state;
    struct llamacpp_engine e;
    case_engine(&g_cases[0], &e, 64);
    int dim = model_hparams(e.m)->n_embd;
    float *out = malloc((size_t)dim * sizeof *out);
    assert_non_null(out);
    int32_t s;
    assert_int_equal(kv_seq_create(e.kv, &s), KS_OK);
    int32_t tok[2] = {1, 5}, pos[2] = {0, 1}, seq[2] = {s, s};
    bool embed[2] = {true, true}, mixed[2] = {true, false};
    /* an embedding sequence the cache already holds part of */
    struct model_batch first = {.n_tokens = 1, .tokens = tok, .pos = pos, .seq = seq};
    float *logits = malloc((size_t)model_hparams(e.m)->n_vocab * sizeof *logits);
    assert_non_null(logits);
    assert_int_equal(model_forward(e.ctx, e.kv, &first, logits, NULL), KS_OK);
    struct model_batch rest = {.n_tokens = 1, .tokens = tok + 1, .pos = pos + 1, .seq = seq};
    assert_int_equal(model_forward_embed(e.ctx, e.kv, &rest, embed, NULL, NULL, out, NULL), KS_ERR_INVALID_ARG);
    assert_int_equal(kv_seq_len(e.kv, s), 1); /* rolled back */
    assert_int_equal(kv_seq_truncate(e.kv, s, 0), KS_OK);
    /* a sequence with embedding and other entries */
    struct model_batch both = {.n_tokens = 2, .tokens = tok, .pos = pos, .seq = seq};
    assert_int_equal(model_forward_embed(e.ctx, e.kv, &both, mixed, logits, NULL, out, NULL), KS_ERR_INVALID_ARG);
    assert_int_equal(kv_seq_len(e.kv, s), 0);
    /* pooling none has no row per input */
    model_set_pooling(e.m, MODEL_POOLING_NONE);
    assert_int_equal(model_forward_embed(e.ctx, e.kv, &both, embed, NULL, NULL, out, NULL), KS_ERR_UNSUPPORTED);
    enum model_pooling p;
    assert_int_equal(model_pooling_parse("average", &p), KS_ERR_INVALID_ARG);
    assert_int_equal(model_pooling_parse("last", &p), KS_OK);
    assert_int_equal(p, MODEL_POOLING_LAST);
    /* the file's metadata */
    struct llamacpp_engine q;
    case_engine(&g_cases[1], &q, 8);
    assert_int_equal(model_hparams(q.m)->pooling, MODEL_POOLING_LAST);
    assert_false(model_hparams(q.m)->non_causal);
    llamacpp_engine_free(&q);
    free(out);
    free(logits);
    llamacpp_engine_free(&e);
}

static void test_normalize(void **state)
{
    (void)state;
    float v[3] = {3, -4, 0};
    model_embd_normalize(v, 3, 2);
    assert_true(fabsf(v[0] - 0.6f) < 1e-7f && fabsf(v[1] + 0.8f) < 1e-7f && v[2] == 0.0f);
    float t[2] = {1, -3};
    model_embd_normalize(t, 2, 1);
    assert_true(fabsf(t[0] - 0.25f) < 1e-7f && fabsf(t[1] + 0.75f) < 1e-7f);
    float m[2] = {2, -4};
    model_embd_normalize(m, 2, 0);
    assert_true(fabsf(m[0] - 16380.0f) < 1e-2f && fabsf(m[1] + 32760.0f) < 1e-2f);
    float z[2] = {0, 0};
    model_embd_normalize(z, 2, 2);
    assert_true(z[0] == 0.0f && z[1] == 0.0f);
}

static int setup(void **state)
{
    (void)state;
    if (!llamacpp_synth_dir("embed", g_dir, sizeof g_dir))
        return -1;
    for (int i = 0; i < N_CASES; i++)
        if (!llamacpp_synth_model("test_model_embed", g_dir, &g_cases[i].synth))
            return -1;
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    llamacpp_synth_dir_remove("test_model_embed", g_dir);
    return 0;
}

int main(void)
{
    for (int i = 0; i < N_CASES; i++)
        if (!llamacpp_synth_reference("test_model_embed", &g_cases[i].synth))
            return ks_skip_all("no reference tests/data/%s.json", g_cases[i].synth.name);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_normalize),
        cmocka_unit_test(test_against_llamacpp),
        cmocka_unit_test(test_refusals),
    };
    return ks_run_tests(tests, setup, teardown);
}
