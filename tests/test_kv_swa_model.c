/* Sliding-window rows freed under the real engine: model_forward over a
 * cache whose config marks layers windowed gives the same logits, bit for
 * bit, as a cache that keeps every row (swa_full), through prefill chunks,
 * decode steps and a prefix hit, while its memory grows with the global
 * layer only. The model is a tiny synthetic llama whose cache config says
 * three of its four layers are windowed: not a real sliding-window model's
 * maths (gemma3's tests check those against llama.cpp), only the cache's
 * part of it: what is freed is never read. Then the same with real
 * sliding-window models (tiny-gemma3: layers 0-4 of 6 in a window of 16;
 * tiny-gpt-oss: layers 0 and 2 of 4), whose cache config comes from
 * model_kv_config alone: the model's window fills it. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kv/kv.h"
#include "model/model.h"
#include "threads/threads.h"

enum { PAGE = 16, WINDOW = 24, CHUNK = 48, PROMPT = 150, DECODE = 40, HIT_PROMPT = 130, MAX_BATCH = 64 };

struct engine {
    struct kv_cache *kv;
    struct model_ctx *ctx;
    float *logits; /* (n_vocab) */
};

static struct model *M;
static int N_VOCAB;
static bool OWN_WINDOW; /* M has a sliding window of its own: model_kv_config sets the cache's */

static int32_t token_at(int salt, int32_t pos)
{
    uint32_t h = (uint32_t)(salt + 1) * 2654435761u ^ (uint32_t)(pos + 7) * 2246822519u;
    h ^= h >> 15;
    return (int32_t)(3 + h % (uint32_t)(N_VOCAB - 3));
}

static void engine_init(struct engine *e, bool full)
{
    struct kv_config cfg;
    model_kv_config(M, &cfg);
    cfg.page_tokens = PAGE;
    cfg.mem_budget = (size_t)32 << 20;
    if (OWN_WINDOW) {
        const struct model_hparams *hp = model_hparams(M);
        assert_int_equal(cfg.swa_window, hp->n_swa);
        for (int l = 0; l < cfg.n_layer; l++)
            assert_int_equal(cfg.swa_layer[l], model_layer_is_swa(hp, l));
        assert_true(kv_window_layers(&cfg) > 0 && kv_window_layers(&cfg) < cfg.n_layer);
    } else {
        cfg.swa_window = WINDOW;
        for (int l = 0; l < cfg.n_layer; l++)
            cfg.swa_layer[l] = l % 4 < 3;
    }
    cfg.swa_full = full;
    assert_int_equal(kv_create(&cfg, &e->kv), KS_OK);
    assert_int_equal(model_ctx_create(M, MAX_BATCH, NULL, &e->ctx), KS_OK);
    e->logits = malloc((size_t)N_VOCAB * sizeof(float));
}

static void engine_free(struct engine *e)
{
    model_ctx_free(e->ctx);
    kv_free(e->kv);
    free(e->logits);
}

/* Run tokens [len, len + n) of seq (salt's tokens) as one batch; logits of the last. */
static void run(struct engine *e, int32_t seq, int salt, int32_t n)
{
    int32_t tok[MAX_BATCH], pos[MAX_BATCH], sq[MAX_BATCH], len = kv_seq_len(e->kv, seq);
    assert_true(n > 0 && n <= MAX_BATCH);
    for (int32_t i = 0; i < n; i++) {
        tok[i] = token_at(salt, len + i);
        pos[i] = len + i;
        sq[i] = seq;
    }
    struct model_batch b = {.n_tokens = n, .tokens = tok, .pos = pos, .seq = sq};
    assert_int_equal(model_forward(e->ctx, e->kv, &b, e->logits, NULL), KS_OK);
    assert_int_equal(kv_check(e->kv), KS_OK);
}

static void prefix_tokens(int salt, int32_t n, int32_t *out)
{
    for (int32_t i = 0; i < n; i++)
        out[i] = token_at(salt, i);
}

static void test_freed_rows_never_change_logits(void **state)
{
    (void)state;
    struct engine a, b;
    engine_init(&a, false);
    engine_init(&b, true);
    int32_t sa = -1, sb = -1;
    assert_int_equal(kv_seq_create(a.kv, &sa), KS_OK);
    assert_int_equal(kv_seq_create(b.kv, &sb), KS_OK);
    int32_t tokens[PROMPT + DECODE];
    prefix_tokens(1, PROMPT + DECODE, tokens);
    for (int32_t done = 0; done < PROMPT + DECODE;) {
        int32_t n = done < PROMPT ? (PROMPT - done < CHUNK ? PROMPT - done : CHUNK) : 1;
        run(&a, sa, 1, n);
        run(&b, sb, 1, n);
        assert_memory_equal(a.logits, b.logits, (size_t)N_VOCAB * sizeof(float));
        done += n;
        assert_int_equal(kv_seq_publish(a.kv, sa, tokens, done), KS_OK);
        assert_int_equal(kv_seq_publish(b.kv, sb, tokens, done), KS_OK);
    }
    struct kv_usage ua, ub;
    kv_usage(a.kv, &ua);
    kv_usage(b.kv, &ub);
    int32_t pages = kv_seq_n_pages(a.kv, sa);
    const struct kv_config *c = kv_get_config(a.kv);
    size_t w = kv_page_window_bytes(c, c->type_k, c->type_v), g = kv_page_bytes(c, c->type_k, c->type_v) - w;
    assert_int_equal(ub.used, (size_t)pages * (g + w));
    assert_true(ua.n_window_pages <= (c->swa_window + PAGE - 1) / PAGE + 1);
    assert_int_equal(ua.used, (size_t)pages * g + (size_t)ua.n_window_pages * w);
    /* a second prompt sharing the first HIT_PROMPT - 20 tokens: whatever each cache can map, the logits of
     * its last token are the same bits */
    kv_seq_free(a.kv, sa);
    kv_seq_free(b.kv, sb);
    int32_t prompt[HIT_PROMPT];
    prefix_tokens(1, HIT_PROMPT, prompt);
    for (int32_t i = HIT_PROMPT - 20; i < HIT_PROMPT; i++)
        prompt[i] = token_at(2, i);
    struct engine *es[2] = {&a, &b};
    int32_t hit[2];
    for (int k = 0; k < 2; k++) {
        struct engine *e = es[k];
        int32_t s = -1, n_pages = 0, n_part = 0;
        assert_int_equal(kv_seq_create(e->kv, &s), KS_OK);
        assert_int_equal(kv_seq_attach_pages(e->kv, s, prompt, HIT_PROMPT - 1, &n_pages), KS_OK);
        assert_int_equal(kv_seq_attach_partial(e->kv, s, prompt, HIT_PROMPT - 1, &n_part), KS_OK);
        hit[k] = kv_seq_len(e->kv, s);
        while (kv_seq_len(e->kv, s) < HIT_PROMPT) {
            int32_t len = kv_seq_len(e->kv, s), n = HIT_PROMPT - len < CHUNK ? HIT_PROMPT - len : CHUNK;
            int32_t tok[CHUNK], pos[CHUNK], sq[CHUNK];
            for (int32_t i = 0; i < n; i++) {
                tok[i] = prompt[len + i];
                pos[i] = len + i;
                sq[i] = s;
            }
            struct model_batch mb = {.n_tokens = n, .tokens = tok, .pos = pos, .seq = sq};
            assert_int_equal(model_forward(e->ctx, e->kv, &mb, e->logits, NULL), KS_OK);
        }
    }
    /* the windowed cache freed the rows a hit that long would need; the full one maps it all */
    assert_true(hit[0] < hit[1]);
    assert_int_equal(hit[1], HIT_PROMPT - 20); /* six pages and a partial run into the seventh */
    assert_memory_equal(a.logits, b.logits, (size_t)N_VOCAB * sizeof(float));
    engine_free(&a);
    engine_free(&b);
}

static int load_preset(const char *preset, int n_layer, bool own_window)
{
    struct model_synth_spec spec;
    if (model_synth_preset(preset, &spec))
        return -1;
    if (n_layer)
        spec.n_layer = n_layer;
    char path[128];
    snprintf(path, sizeof path, "/tmp/kvserve-test-swa-%d.gguf", (int)getpid());
    if (model_synth(&spec, "q8_0", NULL, path, NULL) || model_load(path, &M)) {
        unlink(path);
        return -1;
    }
    unlink(path);
    N_VOCAB = model_hparams(M)->n_vocab;
    OWN_WINDOW = own_window;
    return 0;
}

static int setup_llama(void **state)
{
    (void)state;
    return load_preset("tiny", 4, false);
}

static int setup_gemma3(void **state)
{
    (void)state;
    return load_preset("tiny-gemma3", 0, true);
}

static int setup_gpt_oss(void **state)
{
    (void)state;
    return load_preset("tiny-gpt-oss", 0, true);
}

static int teardown(void **state)
{
    (void)state;
    model_free(M);
    M = NULL;
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_freed_rows_never_change_logits, setup_llama, teardown),
        cmocka_unit_test_setup_teardown(test_freed_rows_never_change_logits, setup_gemma3, teardown),
        cmocka_unit_test_setup_teardown(test_freed_rows_never_change_logits, setup_gpt_oss, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
