/* The BERT-family encoders against llama.cpp itself: the tiny-bert-embed
 * (bert: learned positions, biases, GELU, CLS pooling) and
 * tiny-nomic-bert-embed (nomic-bert: fused QKV, RoPE, SwiGLU, mean pooling)
 * synth presets at F32 and Q8_0, with their made-up WordPiece vocabulary.
 * tests/data/embed-NAME.json holds llama-server's /v1/embeddings answer (L2
 * normalized) and /tokenize ids for three inputs, tests/data/wpm-tiny-bert-embed.json
 * llama-server's /tokenize of inputs that exercise BERT's pre-tokenization
 * (both made as docs/correctness.md's "Embeddings" says). The test writes the
 * same files again (synth is deterministic) and holds:
 *   - every input's normalized embedding within 1e-4 (L2 distance; the
 *     vectors have norm 1) of llama.cpp's, the three inputs in one batch and
 *     each alone, with one thread and with two;
 *   - kvserve's tokenizer to llama.cpp's ids on every input, [CLS] and [SEP] added;
 *   - the refusals: generation, a batch entry that is not an embedding, a
 *     sequence the cache holds part of, a position past bert's learned ones;
 *     and an encoder never writes the KV cache.
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
#include "tokenizer/tokenizer.h"

#define EMBD_TOL 1e-4
/* Q8_0: an activation whose quantization sits on a rounding tie goes the other
 * way on a last-bit difference (kvserve's attention and LayerNorm sums are
 * not ggml's in every bit), and that moves the vector by far more than the
 * rest: tiny-nomic-bert-embed's third input measures 2.1e-4, the other five
 * Q8_0 inputs 1.5e-7. Still a cosine of 1 - 2e-8 (issue 23's bar: 0.9999). */
#define EMBD_TOL_Q8 3e-4
#define MAX_INPUTS 32
#define MAX_TOKENS 128

static char g_dir[64];

static const struct llamacpp_synth g_cases[] = {
    {"embed-tiny-bert-embed-f32", "tiny-bert-embed", "f32"},
    {"embed-tiny-nomic-bert-embed-f32", "tiny-nomic-bert-embed", "f32"},
    {"embed-tiny-bert-embed-q8_0", "tiny-bert-embed", "q8_0"},
    {"embed-tiny-nomic-bert-embed-q8_0", "tiny-nomic-bert-embed", "q8_0"},
};
#define N_CASES (int)(sizeof g_cases / sizeof g_cases[0])
#define WPM_REF "wpm-tiny-bert-embed"

/* A reference file: its inputs, their token ids and (embed-*.json) embeddings. */
struct ref {
    int n_inputs, n_embd;
    char *inputs[MAX_INPUTS];
    int n_tokens[MAX_INPUTS];
    int32_t tokens[MAX_INPUTS][MAX_TOKENS];
    float *embd; /* (n_inputs, n_embd), NULL without embeddings */
};

static void ref_load(const char *name, struct ref *r)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s.json", llamacpp_data_dir(), name);
    char *text = ks_read_file(path, NULL);
    assert_non_null(text);
    cJSON *root = cJSON_Parse(text);
    free(text);
    assert_non_null(root);
    const cJSON *ins = cJSON_GetObjectItem(root, "inputs"), *toks = cJSON_GetObjectItem(root, "tokens");
    const cJSON *embs = cJSON_GetObjectItem(root, "embeddings");
    *r = (struct ref){.n_inputs = cJSON_GetArraySize(toks)};
    assert_true(r->n_inputs >= 1 && r->n_inputs <= MAX_INPUTS && cJSON_GetArraySize(ins) == r->n_inputs);
    if (embs) {
        assert_int_equal(cJSON_GetArraySize(embs), r->n_inputs);
        r->n_embd = cJSON_GetArraySize(cJSON_GetArrayItem(embs, 0));
        r->embd = malloc((size_t)r->n_inputs * (size_t)r->n_embd * sizeof *r->embd);
        assert_non_null(r->embd);
    }
    for (int i = 0; i < r->n_inputs; i++) {
        const cJSON *t = cJSON_GetArrayItem(toks, i);
        r->inputs[i] = strdup(cJSON_GetArrayItem(ins, i)->valuestring);
        assert_non_null(r->inputs[i]);
        r->n_tokens[i] = cJSON_GetArraySize(t);
        assert_true(r->n_tokens[i] >= 1 && r->n_tokens[i] <= MAX_TOKENS);
        for (int k = 0; k < r->n_tokens[i]; k++)
            r->tokens[i][k] = (int32_t)cJSON_GetArrayItem(t, k)->valuedouble;
        if (!embs)
            continue;
        const cJSON *e = cJSON_GetArrayItem(embs, i);
        assert_int_equal(cJSON_GetArraySize(e), r->n_embd);
        for (int k = 0; k < r->n_embd; k++)
            r->embd[(size_t)i * r->n_embd + k] = (float)cJSON_GetArrayItem(e, k)->valuedouble;
    }
    cJSON_Delete(root);
}

static void ref_free(struct ref *r)
{
    for (int i = 0; i < r->n_inputs; i++)
        free(r->inputs[i]);
    free(r->embd);
}

static double l2_dist(const float *a, const float *b, int n)
{
    double s = 0;
    for (int i = 0; i < n; i++)
        s += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
    return sqrt(s);
}

/* Inputs first .. first + n of r as sequences of one batch; their normalized
 * rows into out. The cache holds none of their tokens before or after. */
static void embed_batch(struct llamacpp_engine *e, const struct ref *r, int first, int n, float *out)
{
    int32_t tok[MAX_INPUTS * MAX_TOKENS], pos[MAX_INPUTS * MAX_TOKENS], seq[MAX_INPUTS * MAX_TOKENS];
    bool embed[MAX_INPUTS * MAX_TOKENS];
    int32_t nb = 0, seqs[MAX_INPUTS];
    for (int i = first; i < first + n; i++) {
        assert_int_equal(kv_seq_create(e->kv, &seqs[i - first]), KS_OK);
        for (int k = 0; k < r->n_tokens[i]; k++, nb++)
            tok[nb] = r->tokens[i][k], pos[nb] = k, seq[nb] = seqs[i - first], embed[nb] = true;
    }
    struct model_batch b = {.n_tokens = nb, .tokens = tok, .pos = pos, .seq = seq};
    int32_t n_embd = -1;
    ks_status st = model_forward_embed(e->ctx, e->kv, &b, embed, NULL, NULL, out, &n_embd);
    if (st)
        fail_msg("model_forward_embed: %s", ks_errmsg());
    assert_int_equal(n_embd, n);
    for (int i = 0; i < n; i++) {
        model_embd_normalize(out + (size_t)i * r->n_embd, r->n_embd, 2);
        assert_int_equal(kv_seq_len(e->kv, seqs[i]), 0); /* an encoder has no cache */
        kv_seq_free(e->kv, seqs[i]);
    }
}

static double g_worst;

static void check_rows(const char *name, const struct ref *r, int first, int n, const float *got)
{
    double tol = strstr(name, "q8_0") ? EMBD_TOL_Q8 : EMBD_TOL;
    for (int i = 0; i < n; i++) {
        double d = l2_dist(got + (size_t)i * r->n_embd, r->embd + (size_t)(first + i) * r->n_embd, r->n_embd);
        g_worst = d > g_worst ? d : g_worst;
        if (!(d <= tol))
            fail_msg("%s: input %d is %.3g (L2) from llama.cpp's embedding", name, first + i, d);
    }
}

static void engine(const struct llamacpp_synth *c, struct llamacpp_engine *e, int n_threads, int max_batch)
{
    char path[1200];
    llamacpp_synth_path(g_dir, c, path, sizeof path);
    llamacpp_engine_init(e, path, n_threads, max_batch, 0);
}

static void test_against_llamacpp(void **state)
{
    (void)state;
    for (int ci = 0; ci < N_CASES; ci++) {
        struct ref r;
        ref_load(g_cases[ci].name, &r);
        assert_non_null(r.embd);
        for (int threads = 1; threads <= 2; threads++) {
            struct llamacpp_engine e;
            engine(&g_cases[ci], &e, threads, 512);
            assert_int_equal(model_hparams(e.m)->n_embd, r.n_embd);
            float *out = malloc((size_t)r.n_inputs * r.n_embd * sizeof *out);
            assert_non_null(out);
            embed_batch(&e, &r, 0, r.n_inputs, out);
            check_rows(g_cases[ci].name, &r, 0, r.n_inputs, out);
            for (int i = 0; i < r.n_inputs; i++) {
                embed_batch(&e, &r, i, 1, out);
                check_rows(g_cases[ci].name, &r, i, 1, out);
            }
            free(out);
            llamacpp_engine_free(&e);
        }
        printf("%s: worst L2 distance to llama.cpp %.3g\n", g_cases[ci].name, g_worst);
        g_worst = 0;
        ref_free(&r);
    }
}

static size_t k_first_diff(const int32_t *a, size_t na, const int32_t *b, int nb)
{
    size_t k = 0;
    while (k < na && k < (size_t)nb && a[k] == b[k])
        k++;
    return k;
}

/* kvserve's WordPiece tokenizer on the synth vocabulary gives llama-server's ids */
static void check_tokens(const struct tokenizer *t, const char *name)
{
    struct ref r;
    ref_load(name, &r);
    for (int i = 0; i < r.n_inputs; i++) {
        int32_t *ids = NULL;
        size_t n = 0;
        ks_status st = tok_encode(t, r.inputs[i], strlen(r.inputs[i]), TOK_ADD_SPECIAL | TOK_PARSE_SPECIAL, &ids, &n);
        if (st)
            fail_msg("%s: tok_encode(input %d): %s", name, i, ks_errmsg());
        bool same = n == (size_t)r.n_tokens[i];
        for (size_t k = 0; same && k < n; k++)
            same = ids[k] == r.tokens[i][k];
        if (!same)
            fail_msg("%s: input %d (\"%s\"): %zu ids, llama.cpp's %d, first difference at %zu", name, i, r.inputs[i],
                     n, r.n_tokens[i], k_first_diff(ids, n, r.tokens[i], r.n_tokens[i]));
        free(ids);
    }
    printf("%s: %d inputs tokenized as llama.cpp\n", name, r.n_inputs);
    ref_free(&r);
}

static void test_tokenizer(void **state)
{
    (void)state;
    struct llamacpp_engine e;
    engine(&g_cases[0], &e, 1, 16);
    struct tokenizer *t = NULL;
    assert_int_equal(tok_load(model_gguf(e.m), &t), KS_OK);
    check_tokens(t, WPM_REF);
    for (int ci = 0; ci < N_CASES; ci++)
        check_tokens(t, g_cases[ci].name);
    tok_free(t);
    llamacpp_engine_free(&e);
}

static void test_refusals(void **state)
{
    (void)state;
    struct llamacpp_engine e;
    engine(&g_cases[0], &e, 1, 600);
    const struct model_hparams *hp = model_hparams(e.m);
    assert_true(hp->encoder_only && hp->non_causal);
    assert_int_equal(hp->pooling, MODEL_POOLING_CLS);
    assert_true(hp->norm_eps > 0 && hp->norm_eps < 1e-11f);
    float *out = malloc((size_t)hp->n_embd * 2 * sizeof *out);
    float *logits = malloc((size_t)hp->n_vocab * sizeof *logits);
    assert_true(out && logits);
    int32_t s;
    assert_int_equal(kv_seq_create(e.kv, &s), KS_OK);
    int32_t tok[2] = {101, 102}, pos[2] = {0, 1}, seq[2] = {s, s};
    bool embed[2] = {true, true}, mixed[2] = {true, false};
    struct model_batch both = {.n_tokens = 2, .tokens = tok, .pos = pos, .seq = seq};
    /* no logits: an encoder has no output head */
    assert_int_equal(model_forward(e.ctx, e.kv, &both, logits, NULL), KS_ERR_UNSUPPORTED);
    assert_int_equal(model_forward_embed(e.ctx, e.kv, &both, NULL, logits, NULL, out, NULL), KS_ERR_UNSUPPORTED);
    /* every entry an embedding entry */
    assert_int_equal(model_forward_embed(e.ctx, e.kv, &both, mixed, logits, NULL, out, NULL), KS_ERR_INVALID_ARG);
    /* a sequence the cache holds part of */
    assert_int_equal(kv_seq_grow(e.kv, s, 1), KS_OK);
    assert_int_equal(model_forward_embed(e.ctx, e.kv, &both, embed, NULL, NULL, out, NULL), KS_ERR_INVALID_ARG);
    assert_int_equal(kv_seq_truncate(e.kv, s, 0), KS_OK);
    /* positions must continue */
    int32_t gap[2] = {0, 2};
    struct model_batch skip = {.n_tokens = 2, .tokens = tok, .pos = gap, .seq = seq};
    assert_int_equal(model_forward_embed(e.ctx, e.kv, &skip, embed, NULL, NULL, out, NULL), KS_ERR_RANGE);
    /* past bert's 512 learned positions */
    enum { LONG = 513 };
    int32_t ltok[LONG], lpos[LONG], lseq[LONG];
    bool lemb[LONG];
    for (int i = 0; i < LONG; i++)
        ltok[i] = 200, lpos[i] = i, lseq[i] = s, lemb[i] = true;
    struct model_batch lng = {.n_tokens = LONG, .tokens = ltok, .pos = lpos, .seq = lseq};
    assert_int_equal(model_forward_embed(e.ctx, e.kv, &lng, lemb, NULL, NULL, out, NULL), KS_ERR_RANGE);
    lng.n_tokens = LONG - 1;
    assert_int_equal(model_forward_embed(e.ctx, e.kv, &lng, lemb, NULL, NULL, out, NULL), KS_OK);
    /* a token outside the vocabulary */
    int32_t bad[2] = {101, 512};
    struct model_batch oov = {.n_tokens = 2, .tokens = bad, .pos = pos, .seq = seq};
    assert_int_equal(model_forward_embed(e.ctx, e.kv, &oov, embed, NULL, NULL, out, NULL), KS_ERR_RANGE);
    assert_int_equal(kv_seq_len(e.kv, s), 0);
    free(out);
    free(logits);
    llamacpp_engine_free(&e);
    /* nomic-bert rotates: no learned positions, so no such limit below n_ctx_train */
    engine(&g_cases[1], &e, 1, 8);
    assert_true(model_hparams(e.m)->encoder_only);
    assert_int_equal(model_hparams(e.m)->pooling, MODEL_POOLING_MEAN);
    assert_int_equal(model_hparams(e.m)->rope_type, MODEL_ROPE_NEOX);
    llamacpp_engine_free(&e);
}

static int setup(void **state)
{
    (void)state;
    if (!llamacpp_synth_dir("bert", g_dir, sizeof g_dir))
        return -1;
    for (int i = 0; i < N_CASES; i++)
        if (!llamacpp_synth_model("test_model_bert", g_dir, &g_cases[i]))
            return -1;
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    llamacpp_synth_dir_remove("test_model_bert", g_dir);
    return 0;
}

int main(void)
{
    for (int i = 0; i < N_CASES; i++)
        if (!llamacpp_synth_reference("test_model_bert", &g_cases[i]))
            return ks_skip_all("no reference tests/data/%s.json", g_cases[i].name);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_against_llamacpp),
        cmocka_unit_test(test_tokenizer),
        cmocka_unit_test(test_refusals),
    };
    return ks_run_tests(tests, setup, teardown);
}
