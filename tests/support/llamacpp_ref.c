#include "support/llamacpp_ref.h"

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <cmocka.h>
#include <cjson/cJSON.h>

#include "support/read_file.h"

static int32_t *json_ids(const cJSON *root, const char *key, int *n)
{
    const cJSON *arr = cJSON_GetObjectItemCaseSensitive(root, key);
    assert_true(cJSON_IsArray(arr));
    *n = cJSON_GetArraySize(arr);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(*n > 0 ? *n : 1));
    assert_non_null(ids);
    for (int i = 0; i < *n; i++)
        ids[i] = (int32_t)cJSON_GetArrayItem(arr, i)->valueint;
    return ids;
}

void llamacpp_ref_load(const char *dir, const char *name, struct llamacpp_ref *r)
{
    char jpath[1200], lpath[1200];
    snprintf(jpath, sizeof jpath, "%s/%s.json", dir, name);
    snprintf(lpath, sizeof lpath, "%s/%s.logits.f32", dir, name);
    size_t jlen, llen;
    char *json = ks_read_file(jpath, &jlen);
    r->logits = (float *)ks_read_file(lpath, &llen);
    if (!json || !r->logits)
        fail_msg("cannot read %s or %s", jpath, lpath);
    cJSON *root = cJSON_Parse(json);
    assert_non_null(root);
    const cJSON *fa = cJSON_GetObjectItemCaseSensitive(root, "flash_attn");
    r->flash_attn = !cJSON_IsBool(fa) || cJSON_IsTrue(fa);
    r->n_vocab = cJSON_GetObjectItemCaseSensitive(root, "n_vocab")->valueint;
    r->prompt = json_ids(root, "prompt_ids", &r->n_prompt);
    r->greedy = json_ids(root, "greedy_ids", &r->n_greedy);
    assert_int_equal(llen, (size_t)r->n_prompt * r->n_vocab * sizeof(float));
    cJSON_Delete(root);
    free(json);
}

void llamacpp_ref_free(struct llamacpp_ref *r)
{
    free(r->prompt);
    free(r->greedy);
    free(r->logits);
}

void llamacpp_ref_prefill(const struct llamacpp_ref *r, struct model_ctx *ctx, struct kv_cache *kv, int32_t seq,
                          int chunk, float *out)
{
    size_t n = (size_t)r->n_prompt;
    int32_t *pos = malloc(sizeof(int32_t) * n), *seqs = malloc(sizeof(int32_t) * n);
    bool *want = malloc(sizeof(bool) * n);
    assert_true(pos && seqs && want);
    for (int i = 0; i < r->n_prompt; i++)
        pos[i] = i, seqs[i] = seq, want[i] = true;
    for (int at = 0; at < r->n_prompt; at += chunk) {
        int k = r->n_prompt - at < chunk ? r->n_prompt - at : chunk;
        struct model_batch b = {k, r->prompt + at, pos + at, seqs + at, want + at};
        int32_t n_out = 0;
        if (model_forward(ctx, kv, &b, out + (size_t)at * r->n_vocab, &n_out))
            fail_msg("model_forward: %s", ks_errmsg());
        assert_int_equal(n_out, k);
    }
    free(pos), free(seqs), free(want);
}

void llamacpp_ref_check_greedy(const struct llamacpp_ref *r, const char *name, struct model_ctx *ctx,
                               struct kv_cache *kv, int32_t seq, float *logits)
{
    int32_t next = llamacpp_argmax(logits + (size_t)(r->n_prompt - 1) * r->n_vocab, r->n_vocab);
    for (int i = 0; i < r->n_greedy; i++) {
        if (next != r->greedy[i])
            fail_msg("%s: greedy token %d is %d, llama.cpp picked %d", name, i, next, r->greedy[i]);
        int32_t p = r->n_prompt + i;
        struct model_batch b = {1, &next, &p, &seq, NULL};
        assert_int_equal(model_forward(ctx, kv, &b, logits, NULL), KS_OK);
        next = llamacpp_argmax(logits, r->n_vocab);
    }
}

float llamacpp_two_streams(const char *name, struct model_ctx *ctx, struct kv_cache *kv, const int32_t *prompt,
                           int n, const int32_t *greedy, int n_gen, const float *last_row, int n_vocab)
{
    size_t V = (size_t)n_vocab;
    int32_t s[2];
    assert_int_equal(kv_seq_create(kv, &s[0]), KS_OK);
    assert_int_equal(kv_seq_create(kv, &s[1]), KS_OK);
    int32_t *tok = malloc(sizeof(int32_t) * 2 * (size_t)n), *pos = malloc(sizeof(int32_t) * 2 * (size_t)n);
    int32_t *seqs = malloc(sizeof(int32_t) * 2 * (size_t)n);
    float *logits = malloc(sizeof(float) * 2 * V);
    assert_true(tok && pos && seqs && logits);
    for (int i = 0; i < n; i++)
        for (int q = 0; q < 2; q++)
            tok[2 * i + q] = prompt[i], pos[2 * i + q] = i, seqs[2 * i + q] = s[q];
    struct model_batch b = {2 * n, tok, pos, seqs, NULL};
    int32_t n_out = 0;
    assert_int_equal(model_forward(ctx, kv, &b, logits, &n_out), KS_OK);
    assert_int_equal(n_out, 2);
    float worst = 0;
    for (int q = 0; q < 2; q++) {
        float d = llamacpp_max_diff(logits + q * V, last_row, V);
        worst = d > worst ? d : worst;
    }
    for (int i = 0; i < n_gen; i++) {
        int32_t t2[2], p2[2] = {n + i, n + i};
        for (int q = 0; q < 2; q++) {
            t2[q] = llamacpp_argmax(logits + q * V, n_vocab);
            if (t2[q] != greedy[i])
                fail_msg("%s: stream %d: greedy token %d is %d, llama.cpp picked %d", name, q, i, t2[q], greedy[i]);
        }
        struct model_batch d = {2, t2, p2, s, NULL};
        assert_int_equal(model_forward(ctx, kv, &d, logits, &n_out), KS_OK);
        assert_int_equal(n_out, 2);
    }
    free(tok), free(pos), free(seqs), free(logits);
    return worst;
}

int32_t llamacpp_argmax(const float *x, int n)
{
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best])
            best = i;
    return best;
}

float llamacpp_max_diff(const float *a, const float *b, size_t n)
{
    float worst = 0;
    for (size_t i = 0; i < n; i++) {
        float d = fabsf(a[i] - b[i]);
        worst = d > worst ? d : worst;
    }
    return worst;
}
