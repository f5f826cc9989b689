/* A token's logits are the same bits whatever batch it runs in and however
 * many threads run it (README, "Exactness"), on the real engine: model_forward
 * over a kv cache. A probe token is decoded alone on one thread (the
 * reference), then on 1 and 2 threads
 *   - alone,
 *   - among 1..15 decode tokens of other sequences (batches of 2..16),
 *   - beside another sequence's prefill chunk (batches of 8, 25 and 64
 *     tokens: past the decode kernels' 7 and the group kernels' 16),
 *   - as the last token of its own sequence's prefill chunk (6 and 21 tokens,
 *     so its context's K/V are computed again in that batch),
 * and every logit is compared bit for bit with the reference. Probes follow a
 * short context (37 tokens, 3 pages of 16) and a long one (420 tokens, 27
 * pages, which attention splits into page ranges).
 *
 * Models: tiny llamas written by synth at q4_0, q8_0, mxfp4, q5_0 and q5_1 with every matrix
 * (the untied output too) at that type, the trained q4_0 model in ../shared
 * when present, repacked (the default); the build's default model (tiny
 * llama, q8_0, KVSERVE_DEFAULT_MODEL), whose output is its tied q8_0 token
 * embeddings, repacked with them; tiny q4_k, q5_k and q6_k llamas, repacked; and a
 * row-major model (MODEL_LOAD_NO_REPACK), held only to what the README
 * promises for row-major matrices (struct promise). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kv/kv.h"
#include "model/model.h"
#include "support/skip.h"
#include "threads/threads.h"

enum {
    PAGE = 16,          /* tokens per KV page: the long context spans many pages */
    MAX_BATCH = 64,
    N_OTHERS = 15,      /* other sequences, one decode token each in a full decode batch */
    SHORT_CTX = 37,
    LONG_CTX = 420,
    SETUP_CHUNK = 64,   /* contexts are prefilled in chunks of this many tokens */
    MAX_DECODE = 16,    /* decode batches of 1..16 tokens: the repacked group kernels' range */
    ROW_MAJOR_DECODE_MAX = 7, /* row-major Q4_0/Q8_0: 8 tokens and more take the prefill tiles */
};

/* ---- an engine: a model, a pool, a cache with the probes' and others' contexts ---- */

struct engine {
    const struct model *m;
    int n_vocab;
    threads_pool *pool;
    struct kv_cache *kv;
    struct model_ctx *ctx;
    int32_t probe_seq[2];       /* short, long */
    int32_t other_seq[N_OTHERS];
    float *logits;              /* (MAX_BATCH, n_vocab) */
};

static const int32_t k_probe_ctx[2] = {SHORT_CTX, LONG_CTX};

static int32_t other_ctx(int i) { return 3 + 11 * i; }

/* Token at pos of a sequence: deterministic, spread over the vocabulary. */
static int32_t token_at(int salt, int32_t pos, int n_vocab)
{
    uint32_t h = (uint32_t)(salt + 1) * 2654435761u ^ (uint32_t)(pos + 7) * 2246822519u;
    h ^= h >> 15;
    return (int32_t)(3 + h % (uint32_t)(n_vocab - 3));
}

struct entry {
    int32_t tok, pos, seq;
};

/* Run entries as one batch with logits for the last entry of each sequence;
 * the row of entry `want` goes to out (if out). */
static void run(struct engine *e, const struct entry *b, int n, int want, float *out)
{
    int32_t tok[MAX_BATCH], pos[MAX_BATCH], seq[MAX_BATCH];
    bool last[MAX_BATCH];
    int row = -1, n_rows = 0;
    for (int i = 0; i < n; i++) {
        tok[i] = b[i].tok, pos[i] = b[i].pos, seq[i] = b[i].seq;
        last[i] = true;
        for (int j = i + 1; j < n; j++)
            last[i] = last[i] && b[j].seq != b[i].seq;
        if (i == want)
            row = n_rows;
        n_rows += last[i];
    }
    struct model_batch mb = {.n_tokens = n, .tokens = tok, .pos = pos, .seq = seq, .want_logits = last};
    int32_t n_out = 0;
    if (model_forward(e->ctx, e->kv, &mb, e->logits, &n_out))
        fail_msg("model_forward: %s", ks_errmsg());
    assert_int_equal(n_out, n_rows);
    if (out) {
        assert_true(row >= 0);
        memcpy(out, e->logits + (size_t)row * e->n_vocab, (size_t)e->n_vocab * sizeof(float));
    }
}

/* Prefill tokens [from, to) of a sequence in chunks of SETUP_CHUNK. */
static void prefill(struct engine *e, int32_t seq, int salt, int32_t from, int32_t to)
{
    struct entry b[SETUP_CHUNK];
    for (int32_t p0 = from; p0 < to; p0 += SETUP_CHUNK) {
        int n = 0;
        for (int32_t p = p0; p < to && n < SETUP_CHUNK; p++)
            b[n++] = (struct entry){token_at(salt, p, e->n_vocab), p, seq};
        run(e, b, n, -1, NULL);
    }
}

static void engine_init(struct engine *e, const struct model *m, int n_threads)
{
    memset(e, 0, sizeof *e);
    e->m = m;
    e->n_vocab = model_hparams(m)->n_vocab;
    assert_int_equal(threads_create(n_threads, &e->pool), KS_OK);
    struct kv_config cfg;
    model_kv_config(m, &cfg);
    cfg.page_tokens = PAGE;
    cfg.prefix_cache = false;
    cfg.mem_budget = 64u << 20;
    assert_int_equal(kv_create(&cfg, &e->kv), KS_OK);
    assert_int_equal(model_ctx_create(m, MAX_BATCH, e->pool, &e->ctx), KS_OK);
    e->logits = malloc((size_t)MAX_BATCH * (size_t)e->n_vocab * sizeof(float));
    assert_non_null(e->logits);
    for (int p = 0; p < 2; p++) {
        assert_int_equal(kv_seq_create(e->kv, &e->probe_seq[p]), KS_OK);
        prefill(e, e->probe_seq[p], p, 0, k_probe_ctx[p]);
    }
    for (int i = 0; i < N_OTHERS; i++) {
        assert_int_equal(kv_seq_create(e->kv, &e->other_seq[i]), KS_OK);
        prefill(e, e->other_seq[i], 100 + i, 0, other_ctx(i));
    }
}

static void engine_free(struct engine *e)
{
    free(e->logits);
    model_ctx_free(e->ctx);
    kv_free(e->kv);
    threads_free(e->pool);
}

/* ---- trials ------------------------------------------------------------------------ */

struct tally {
    const char *label;
    int trials, differ;
    float worst;
};

static struct entry probe_entry(const struct engine *e, int p)
{
    return (struct entry){token_at(p, k_probe_ctx[p], e->n_vocab), k_probe_ctx[p], e->probe_seq[p]};
}

static struct entry other_entry(const struct engine *e, int i, int32_t k)
{
    return (struct entry){token_at(100 + i, other_ctx(i) + k, e->n_vocab), other_ctx(i) + k, e->other_seq[i]};
}

/* Undo a trial: every sequence back to its context. */
static void rollback(struct engine *e)
{
    for (int p = 0; p < 2; p++)
        assert_int_equal(kv_seq_truncate(e->kv, e->probe_seq[p], k_probe_ctx[p]), KS_OK);
    for (int i = 0; i < N_OTHERS; i++)
        assert_int_equal(kv_seq_truncate(e->kv, e->other_seq[i], other_ctx(i)), KS_OK);
}

static void compare(struct tally *t, const float *ref, const float *got, int n_vocab, const char *what, int p,
                    int n_threads)
{
    t->trials++;
    if (!memcmp(ref, got, (size_t)n_vocab * sizeof(float)))
        return;
    float worst = 0;
    for (int i = 0; i < n_vocab; i++)
        worst = fmaxf(worst, fabsf(ref[i] - got[i]));
    if (t->differ < 40)
        print_message("%s: %s probe, %d thread(s), %s: max |diff| %.3g\n", t->label, p ? "long" : "short", n_threads,
                      what, (double)worst);
    t->differ++;
    t->worst = fmaxf(t->worst, worst);
}

/* The probe among decode tokens of others (batches up to max_decode
 * tokens), beside prefill chunks (if prefill_too); every row against ref. */
static void probe_trials(struct engine *e, int p, const float *ref, int n_threads, int max_decode, bool prefill_too,
                         struct tally *t)
{
    float *got = malloc((size_t)e->n_vocab * sizeof(float));
    assert_non_null(got);
    struct entry b[MAX_BATCH];
    char what[96];
    b[0] = probe_entry(e, p);
    run(e, b, 1, 0, got);
    rollback(e);
    compare(t, ref, got, e->n_vocab, "alone", p, n_threads);
    for (int k = 1; k < max_decode; k++) { /* k others; the probe's place moves */
        int at = (k * 7) % (k + 1), n = 0;
        for (int i = 0; i < k; i++) {
            if (n == at)
                b[n++] = probe_entry(e, p);
            b[n++] = other_entry(e, i, 0);
        }
        if (n == at)
            b[n++] = probe_entry(e, p);
        run(e, b, n, at, got);
        rollback(e);
        snprintf(what, sizeof what, "entry %d of %d decode tokens", at, n);
        compare(t, ref, got, e->n_vocab, what, p, n_threads);
    }
    static const int prefill_len[] = {7, 24, 60}; /* with the probe (and 3 decoders at 60): 8, 25, 64 */
    for (size_t c = 0; prefill_too && c < sizeof prefill_len / sizeof *prefill_len; c++) {
        int n = 0, len = prefill_len[c];
        if (len == 60)
            for (int i = 1; i <= 3; i++)
                b[n++] = other_entry(e, i, 0);
        int at = n;
        b[n++] = probe_entry(e, p);
        for (int k = 0; k < len; k++)
            b[n++] = other_entry(e, 0, k);
        run(e, b, n, at, got);
        rollback(e);
        snprintf(what, sizeof what, "beside a prefill chunk of %d (batch of %d)", len, n);
        compare(t, ref, got, e->n_vocab, what, p, n_threads);
    }
    free(got);
}

/* Last: the probe ends a prefill chunk of its own sequence (its context's last
 * m tokens computed again in that batch); the cache keeps the recomputed K/V. */
static void own_prefill_trials(struct engine *e, int p, const float *ref, int n_threads, struct tally *t)
{
    static const int back[] = {5, 20};
    float *got = malloc((size_t)e->n_vocab * sizeof(float));
    assert_non_null(got);
    struct entry b[MAX_BATCH];
    char what[96];
    for (size_t c = 0; c < sizeof back / sizeof *back; c++) {
        int32_t L = k_probe_ctx[p], from = L - back[c];
        assert_int_equal(kv_seq_truncate(e->kv, e->probe_seq[p], from), KS_OK);
        int n = 0;
        for (int32_t pos = from; pos < L; pos++)
            b[n++] = (struct entry){token_at(p, pos, e->n_vocab), pos, e->probe_seq[p]};
        b[n++] = probe_entry(e, p);
        run(e, b, n, n - 1, got);
        assert_int_equal(kv_seq_truncate(e->kv, e->probe_seq[p], L), KS_OK);
        snprintf(what, sizeof what, "last of its own prefill chunk of %d", n);
        compare(t, ref, got, e->n_vocab, what, p, n_threads);
    }
    free(got);
}

/* What a model is held to: decode batches of up to max_decode tokens (a
 * row-major output matrix gets a batch's decode rows, so 7: the README's
 * exception), and whether prefill chunks may share the probe's batch (not
 * with row-major layers, whose tiles and decode kernels round differently). */
struct promise {
    int max_decode;
    bool prefill_too;
};

static const struct promise k_any_batch = {MAX_DECODE, true};
static const struct promise k_row_major = {ROW_MAJOR_DECODE_MAX, false};

/* Every trial of both probes on 1 and 2 threads against the probes decoded
 * alone on one thread; returns the number of trials that differ. */
static int check_loaded(const struct model *m, struct promise pr, const char *label)
{
    int n_vocab = model_hparams(m)->n_vocab;
    float *ref[2];
    struct tally t = {.label = label};
    for (int n_threads = 1; n_threads <= 2; n_threads++) {
        struct engine e;
        engine_init(&e, m, n_threads);
        for (int p = 0; p < 2; p++) {
            if (n_threads == 1) {
                ref[p] = malloc((size_t)n_vocab * sizeof(float));
                assert_non_null(ref[p]);
                struct entry b = probe_entry(&e, p);
                run(&e, &b, 1, 0, ref[p]);
                rollback(&e);
            }
            probe_trials(&e, p, ref[p], n_threads, pr.max_decode, pr.prefill_too, &t);
        }
        for (int p = 0; p < 2 && pr.prefill_too; p++)
            own_prefill_trials(&e, p, ref[p], n_threads, &t);
        engine_free(&e);
    }
    print_message("%s: %d of %d trials differ from the probe alone on one thread (max |diff| %.3g)\n", label, t.differ,
                  t.trials, (double)t.worst);
    free(ref[0]);
    free(ref[1]);
    return t.differ;
}

/* remove_file: a file of this test's, gone once loaded (the model keeps its
 * own copy of the weights). */
static int check_model(const char *path, unsigned flags, bool remove_file, struct promise pr, const char *label)
{
    struct model *m;
    if (model_load_flags(path, flags, &m))
        fail_msg("load %s: %s", path, ks_errmsg());
    if (remove_file)
        unlink(path);
    int differ = check_loaded(m, pr, label);
    model_free(m);
    return differ;
}

/* A tiny llama with every matrix at type (the output untied, so it is
 * repacked too), written to a file of this process in /tmp. */
static void synth_tiny(const char *type, char *path, size_t cap)
{
    struct model_synth_spec spec;
    assert_int_equal(model_synth_preset("tiny", &spec), KS_OK);
    spec.n_layer = 2;
    spec.pure = true;
    spec.untied = true;
    snprintf(path, cap, "/tmp/kvserve-test-bits-%d-%s.gguf", (int)getpid(), type);
    if (model_synth(&spec, type, NULL, path, NULL))
        fail_msg("synth %s: %s", type, ks_errmsg());
}

/* check_model on a tiny synthetic model of type. */
static int check_synth(const char *type, unsigned flags, struct promise pr, const char *label)
{
    char path[128];
    synth_tiny(type, path, sizeof path);
    return check_model(path, flags, true, pr, label);
}

static void trained_model_path(char *buf, size_t cap)
{
    const char *shared = getenv("KVSERVE_SHARED");
    snprintf(buf, cap, "%s/models/trained/tiny-llama-gqa-hd64-q4_0.gguf", shared ? shared : "../shared");
}

/* ---- cases ------------------------------------------------------------------------- */

static void test_default_model(void **state)
{
    (void)state;
    const char *path = getenv("KVSERVE_DEFAULT_MODEL");
    if (!path || access(path, R_OK) != 0)
        KS_SKIP("the default model (KVSERVE_DEFAULT_MODEL=%s) is not built", path ? path : "");
    /* its output is the tied q8_0 token embeddings, repacked like the rest */
    assert_int_equal(check_model(path, 0, false, k_any_batch, "default q8_0"), 0);
}

static void test_q4_0_repacked(void **state)
{
    (void)state;
    assert_int_equal(check_synth("q4_0", 0, k_any_batch, "tiny q4_0"), 0);
}

static void test_q8_0_repacked(void **state)
{
    (void)state;
    assert_int_equal(check_synth("q8_0", 0, k_any_batch, "tiny q8_0"), 0);
}

/* MXFP4 (IQ4_NL's kernels but for the table and the scale): repacked, every
 * batch runs the group kernels, the reference's bits. */
static void test_mxfp4_repacked(void **state)
{
    (void)state;
    assert_int_equal(check_synth("mxfp4", 0, k_any_batch, "tiny mxfp4"), 0);
}

/* q5_0 and q5_1 (gemma3's Q4_K_M keeps most of its bytes at q5_0): every
 * kernel keeps llama.cpp's 8-lane order (quant_internal.h), so repacked (the
 * one-pass group kernels for 1-2 tokens, the unpacked chunks above) a
 * token's logits do not depend on its batch. (Row-major, every batch runs
 * the same vec_dot per row and token.) */
static void test_q5_repacked(void **state)
{
    (void)state;
    assert_int_equal(check_synth("q5_0", 0, k_any_batch, "tiny q5_0"), 0);
    assert_int_equal(check_synth("q5_1", 0, k_any_batch, "tiny q5_1"), 0);
}

/* k-quants repacked (Q2_K to Q6_K): the group kernels and the prefill tiles on
 * panels unpacked from the layout both give the scalar reference's bits
 * (kq_internal.h), so a token's logits do not depend on its batch. */
static void test_kquants_repacked(void **state)
{
    (void)state;
    assert_int_equal(check_synth("q2_k", 0, k_any_batch, "tiny q2_k"), 0);
    assert_int_equal(check_synth("q3_k", 0, k_any_batch, "tiny q3_k"), 0);
    assert_int_equal(check_synth("q4_k", 0, k_any_batch, "tiny q4_k"), 0);
    assert_int_equal(check_synth("q5_k", 0, k_any_batch, "tiny q5_k"), 0);
    assert_int_equal(check_synth("q6_k", 0, k_any_batch, "tiny q6_k"), 0);
}

static void test_trained_q4_0_repacked(void **state)
{
    (void)state;
    char path[4096];
    trained_model_path(path, sizeof path);
    if (access(path, R_OK) != 0)
        KS_SKIP("%s is missing", path);
    /* its output is the tied q6_K token embeddings, repacked too (its row-major
     * kernels give the reference's bits as well) */
    assert_int_equal(check_model(path, 0, false, k_any_batch, "trained q4_0"), 0);
}

/* The exception the README states: row-major Q4_0/Q8_0 weights decode fewer
 * than 8 tokens with kernels that sum in another order than the prefill
 * tiles, so only the thread count and decode batches of up to 7 are free. */
static void test_row_major(void **state)
{
    (void)state;
    assert_int_equal(check_synth("q4_0", MODEL_LOAD_NO_REPACK, k_row_major, "tiny q4_0 row-major"), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_default_model),
        cmocka_unit_test(test_q4_0_repacked),
        cmocka_unit_test(test_q8_0_repacked),
        cmocka_unit_test(test_mxfp4_repacked),
        cmocka_unit_test(test_q5_repacked),
        cmocka_unit_test(test_kquants_repacked),
        cmocka_unit_test(test_trained_q4_0_repacked),
        cmocka_unit_test(test_row_major),
    };
    return ks_run_tests(tests, NULL, NULL);
}
