/* model_forward against the naive reference forward (tests/support) on small
 * synthetic models of each architecture and weight type, in batched prefill,
 * one-token decode and several sequences mixed in one batch. Also: loader
 * errors, hyper-parameters, batch validation and all-or-nothing growth.
 *
 * Tolerances (max |logit difference|; logits here have std ~1, max ~4):
 *   F32, F16 weights: 1e-4 against the plain f32 reference (measured ~1e-6).
 *   Q8_0, Q4_0: 0.1; Q4_K: 0.15 against the plain f32 reference (measured
 *     4-7e-2): the engine rounds activations to q8_0 / q8_K for integer dots.
 *   Quantized types are also run against a reference that rounds activations
 *     the same way with the scalar quantizer. The math is then identical and
 *     most rows agree to ~1e-6, but an activation that sits on a rounding tie
 *     can round the other way after a last-bit difference upstream, and that
 *     token's K/V carries the change to later tokens of its sequence. So at
 *     least a third of the rows must agree within 1e-4: the data is
 *     deterministic, and 7 to 15 of 15 rows do today across the native,
 *     AVX2-only and portable builds (a kernel bug moves every row). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "model/model.h"
#include "support/ref_forward.h"

#define N_VOCAB 300
#define MAX_CTX 32

static char g_dir[64];

/* ---- model fixtures --------------------------------------------------------- */

struct arch_case {
    const char *arch;
    int n_head, n_head_kv, head_dim;
    bool untied;
    int n_expert, n_expert_used, n_ff_exp; /* mixture of experts when n_expert > 0 */
    const char *name;                      /* file name and label (NULL: arch) */
};

static const struct arch_case g_llama = {"llama", 4, 2, 64, true, 0, 0, 0, NULL};
static const struct arch_case g_qwen2 = {"qwen2", 8, 2, 32, true, 0, 0, 0, NULL};
static const struct arch_case g_qwen3 = {"qwen3", 2, 1, 128, true, 0, 0, 0, NULL};
/* 3 of 8 experts per token; expert width 256 keeps q4_K for ffn_down_exps */
static const struct arch_case g_qwen3moe = {"qwen3moe", 2, 1, 128, true, 8, 3, 256, NULL};
/* llama's experts are n_ff (512) wide */
static const struct arch_case g_mixtral = {"llama", 4, 2, 64, true, 8, 2, 0, "mixtral"};
/* tied embeddings: the output matrix is token_embd, repacked (300 rows: whole groups and a row-major tail),
 * and the embedding lookup reads its rows back out of the layout */
static const struct arch_case g_tied = {"llama", 4, 2, 64, false, 0, 0, 0, "llama-tied"};

static const char *case_name(const struct arch_case *ac) { return ac->name ? ac->name : ac->arch; }

static void synth_path(char *buf, size_t cap, const char *arch, const char *type)
{
    snprintf(buf, cap, "%s/%s-%s.gguf", g_dir, arch, type);
}

static struct model *make_model(const struct arch_case *ac, const char *type)
{
    struct model_synth_spec spec = {
        .arch = ac->arch, .n_embd = 256, .n_layer = 2, .n_head = ac->n_head, .n_head_kv = ac->n_head_kv,
        .head_dim = ac->head_dim, .n_ff = 512, .n_expert = ac->n_expert, .n_expert_used = ac->n_expert_used,
        .n_ff_exp = ac->n_ff_exp, .n_vocab = N_VOCAB, .n_ctx_train = 512,
        .rope_freq_base = 10000.0f, .pure = true, .untied = ac->untied, .seed = 7, .init_std = 0.06f, .embd_std = 1.0f,
    };
    char path[128];
    synth_path(path, sizeof path, case_name(ac), type);
    ks_status st = model_synth(&spec, type, NULL, path, NULL);
    if (st)
        fail_msg("synth %s %s: %s", case_name(ac), type, ks_errmsg());
    struct model *m;
    st = model_load(path, &m);
    if (st)
        fail_msg("load %s: %s", path, ks_errmsg());
    return m;
}

/* Write the synthetic model (checking that it loads); its path into path. */
static void synth_file(const struct arch_case *ac, const char *type, char *path, size_t cap)
{
    model_free(make_model(ac, type));
    synth_path(path, cap, case_name(ac), type);
}

struct engine {
    threads_pool *pool;
    struct kv_cache *kv;
    struct model_ctx *ctx;
};

static void engine_init(struct engine *e, const struct model *m, int n_threads)
{
    assert_int_equal(threads_create(n_threads, &e->pool), KS_OK);
    struct kv_config cfg;
    model_kv_config(m, &cfg);
    cfg.type_k = cfg.type_v = QUANT_F32;
    cfg.rotate = false;
    cfg.mem_budget = 8u << 20;
    assert_int_equal(kv_create(&cfg, &e->kv), KS_OK);
    assert_int_equal(model_ctx_create(m, 16, e->pool, &e->ctx), KS_OK);
}

static void engine_free(struct engine *e)
{
    model_ctx_free(e->ctx);
    kv_free(e->kv);
    threads_free(e->pool);
}

/* ---- comparison -------------------------------------------------------------- */

struct tol {
    float plain; /* vs the plain f32 reference */
};

struct worst {
    float tight, plain;
    int rows, rows_exact; /* rows within EXACT_TOL of the rounded-activation reference */
};

#define EXACT_TOL 1e-4f

static void compare_row(const float *got, const float *ref_tight, const float *ref_plain, struct worst *w)
{
    float row_tight = 0;
    for (int j = 0; j < N_VOCAB; j++) {
        float a = fabsf(got[j] - ref_tight[j]), b = fabsf(got[j] - ref_plain[j]);
        row_tight = a > row_tight ? a : row_tight;
        w->plain = b > w->plain ? b : w->plain;
    }
    w->tight = row_tight > w->tight ? row_tight : w->tight;
    w->rows++;
    w->rows_exact += row_tight <= EXACT_TOL;
}

/* The batch's entries go through both references in order; rows that want
 * logits are compared with the engine's. */
static void run_batch(struct engine *e, struct ref_model *rt, struct ref_model *rp, const int32_t *kv_seq,
                      const int32_t *tok, const int32_t *slot, const int32_t *pos, const bool *want, int n,
                      int expect_rows, struct worst *w)
{
    int32_t seqs[16];
    for (int i = 0; i < n; i++)
        seqs[i] = kv_seq[slot[i]];
    float *got = malloc(sizeof(float) * (size_t)n * N_VOCAB);
    struct model_batch b = {n, tok, pos, seqs, want};
    int32_t n_out = -1;
    if (model_forward(e->ctx, e->kv, &b, got, &n_out))
        fail_msg("model_forward: %s", ks_errmsg());
    assert_int_equal(n_out, expect_rows);
    float lt[N_VOCAB], lp[N_VOCAB];
    int row = 0;
    for (int i = 0; i < n; i++) {
        assert_int_equal(ref_forward(rt, slot[i], tok[i], pos[i], lt), KS_OK);
        assert_int_equal(ref_forward(rp, slot[i], tok[i], pos[i], lp), KS_OK);
        bool wants = want ? want[i] : true;
        for (int j = i + 1; !want && j < n && wants; j++)
            wants = slot[j] != slot[i];
        if (wants) {
            float before = w->tight;
            compare_row(got + (size_t)row++ * N_VOCAB, lt, lp, w);
            if (getenv("MODEL_TEST_VERBOSE") && w->tight > before)
                print_message("  batch of %d, entry %d (slot %d pos %d): tight %.2e\n", n, i, slot[i], pos[i], (double)w->tight);
        }
    }
    assert_int_equal(row, expect_rows);
    free(got);
}

/* A prompt of 12 tokens (i * mul + add) % N_VOCAB as one batch through the
 * engine and both references, comparing every row (all_rows) or the last;
 * the worst |engine - tight reference|. */
static float prompt_vs_refs(const struct model *m, int mul, int add, bool all_rows)
{
    struct engine e;
    engine_init(&e, m, 2);
    struct ref_model *r, *r2;
    assert_int_equal(ref_model_create(m, 1, MAX_CTX, REF_QUANTIZE_ACTS, &r), KS_OK);
    assert_int_equal(ref_model_create(m, 1, MAX_CTX, 0, &r2), KS_OK);
    int32_t seq;
    assert_int_equal(kv_seq_create(e.kv, &seq), KS_OK);
    int32_t tok[12], pos[12], slot[12] = {0};
    bool want[12];
    for (int i = 0; i < 12; i++)
        tok[i] = (i * mul + add) % N_VOCAB, pos[i] = i, want[i] = true;
    struct worst w = {0};
    run_batch(&e, r, r2, &seq, tok, slot, pos, all_rows ? want : NULL, 12, all_rows ? 12 : 1, &w);
    ref_model_free(r);
    ref_model_free(r2);
    engine_free(&e);
    return w.tight;
}

static void run_case(const struct arch_case *ac, const char *type, struct tol tol, int n_threads)
{
    struct model *m = make_model(ac, type);
    struct engine e;
    engine_init(&e, m, n_threads);
    struct ref_model *rt, *rp;
    assert_int_equal(ref_model_create(m, 3, MAX_CTX, REF_QUANTIZE_ACTS, &rt), KS_OK);
    assert_int_equal(ref_model_create(m, 3, MAX_CTX, 0, &rp), KS_OK);
    int32_t kv_seq[3];
    for (int s = 0; s < 3; s++)
        assert_int_equal(kv_seq_create(e.kv, &kv_seq[s]), KS_OK);
    struct worst w = {0};

    /* batched prefill of sequence 0: 7 tokens, every row */
    {
        int32_t tok[] = {1, 17, 255, 3, 299, 42, 100}, slot[7] = {0}, pos[] = {0, 1, 2, 3, 4, 5, 6};
        bool want[7] = {true, true, true, true, true, true, true};
        run_batch(&e, rt, rp, kv_seq, tok, slot, pos, want, 7, 7, &w);
    }
    /* one-token decode */
    for (int i = 0; i < 2; i++) {
        int32_t tok = 5 + 77 * i, slot = 0, pos = 7 + i;
        run_batch(&e, rt, rp, kv_seq, &tok, &slot, &pos, NULL, 1, 1, &w);
    }
    /* two new sequences' prefill interleaved with a decode of sequence 0 */
    {
        int32_t tok[] = {9, 8, 7, 250, 64, 6, 251}, slot[] = {1, 1, 1, 2, 0, 1, 2}, pos[] = {0, 1, 2, 0, 9, 3, 1};
        run_batch(&e, rt, rp, kv_seq, tok, slot, pos, NULL, 7, 3, &w);
    }
    /* one decode token for each of the three sequences */
    {
        int32_t tok[] = {13, 31, 130}, slot[] = {2, 0, 1}, pos[] = {2, 10, 4};
        run_batch(&e, rt, rp, kv_seq, tok, slot, pos, NULL, 3, 3, &w);
    }
    print_message("%-8s %-4s: max |diff| vs plain f32 ref %.2e (tol %.0e); vs rounded-activation ref: %d/%d rows "
                  "within %.0e, max %.2e\n",
                  case_name(ac), type, (double)w.plain, (double)tol.plain, w.rows_exact, w.rows, (double)EXACT_TOL,
                  (double)w.tight);
    assert_true(w.plain <= tol.plain);
    assert_true(w.tight <= tol.plain);
    assert_true(3 * w.rows_exact >= w.rows);
    if (tol.plain <= EXACT_TOL)
        assert_int_equal(w.rows_exact, w.rows);
    ref_model_free(rt);
    ref_model_free(rp);
    engine_free(&e);
    model_free(m);
}

static const struct tol TOL_FLOAT = {1e-4f};
static const struct tol TOL_Q8 = {0.1f};
static const struct tol TOL_QK = {0.15f};
/* Tied: the output matrix is the embeddings (std embd_std = 1 where an untied output has init_std = 0.06),
 * so the logits and their rounding errors are 1 / 0.06 times TOL_Q8's (measured 0.70-0.78). */
static const struct tol TOL_TIED = {0.1f / 0.06f};

#define CASE(arch, type, tol)                                              \
    static void test_##arch##_##type(void **state)                         \
    {                                                                      \
        (void)state;                                                       \
        run_case(&g_##arch, #type, tol, 2);                                \
    }
#define ARCH_CASES(arch)                 \
    CASE(arch, f32, TOL_FLOAT)           \
    CASE(arch, f16, TOL_FLOAT)           \
    CASE(arch, q8_0, TOL_Q8)             \
    CASE(arch, q4_0, TOL_Q8)             \
    CASE(arch, q4_k, TOL_QK)
ARCH_CASES(llama)
ARCH_CASES(qwen2)
ARCH_CASES(qwen3)
ARCH_CASES(qwen3moe)
ARCH_CASES(mixtral)

static void test_moe_single_thread(void **state)
{
    (void)state;
    run_case(&g_qwen3moe, "q8_0", TOL_Q8, 1);
}

static void test_tied_q8_0(void **state)
{
    (void)state;
    run_case(&g_tied, "q8_0", TOL_TIED, 2);
}

static void test_tied_q4_0(void **state)
{
    (void)state;
    run_case(&g_tied, "q4_0", TOL_TIED, 2);
}

static void test_single_thread(void **state)
{
    (void)state;
    run_case(&g_qwen2, "q4_0", TOL_Q8, 1);
}

/* ---- loader --------------------------------------------------------------------- */

static void test_hparams(void **state)
{
    (void)state;
    struct model *m = make_model(&g_qwen3, "f32");
    const struct model_hparams *hp = model_hparams(m);
    assert_int_equal(hp->arch, MODEL_ARCH_QWEN3);
    assert_string_equal(hp->arch_name, "qwen3");
    assert_int_equal(hp->n_vocab, N_VOCAB);
    assert_int_equal(hp->n_embd, 256);
    assert_int_equal(hp->n_layer, 2);
    assert_int_equal(hp->n_head, 2);
    assert_int_equal(hp->n_head_kv, 1);
    assert_int_equal(hp->head_dim_k, 128);
    assert_int_equal(hp->head_dim_v, 128);
    assert_int_equal(hp->n_rot, 128);
    assert_int_equal(hp->n_ff, 512);
    assert_int_equal(hp->n_ctx_train, 512);
    assert_int_equal(hp->rope_type, MODEL_ROPE_NEOX);
    assert_int_equal(hp->rope_scaling, MODEL_ROPE_SCALING_NONE);
    assert_false(hp->tied_embeddings);
    assert_true(hp->has_qk_norm);
    assert_false(hp->has_qkv_bias);
    struct kv_config cfg;
    model_kv_config(m, &cfg);
    assert_int_equal(cfg.n_layer, 2);
    assert_int_equal(cfg.n_kv_head, 1);
    assert_int_equal(cfg.head_dim, 128);
    assert_true(model_weight_bytes(m) > 0);
    model_free(m);

    m = make_model(&g_qwen2, "q8_0");
    hp = model_hparams(m);
    assert_int_equal(hp->arch, MODEL_ARCH_QWEN2);
    assert_true(hp->has_qkv_bias);
    assert_false(hp->has_qk_norm);
    assert_int_equal(hp->rope_type, MODEL_ROPE_NEOX);
    model_free(m);

    m = make_model(&g_llama, "f16");
    hp = model_hparams(m);
    assert_int_equal(hp->rope_type, MODEL_ROPE_NORMAL);
    assert_false(hp->tied_embeddings);
    model_free(m);

    m = make_model(&g_qwen3moe, "f32");
    hp = model_hparams(m);
    assert_int_equal(hp->arch, MODEL_ARCH_QWEN3MOE);
    assert_true(hp->has_qk_norm);
    assert_int_equal(hp->rope_type, MODEL_ROPE_NEOX);
    assert_int_equal(hp->n_expert, 8);
    assert_int_equal(hp->n_expert_used, 3);
    assert_int_equal(hp->n_ff_exp, 256);
    /* a token reads 3 of 8 experts: 5 fewer of (gate, up, down) 256 x 256 f32 per layer */
    assert_int_equal(model_weight_bytes(m) - model_active_weight_bytes(m), 2 * 5 * 3 * 256 * 256 * 4);
    model_free(m);

    m = make_model(&g_mixtral, "q8_0");
    hp = model_hparams(m);
    assert_int_equal(hp->arch, MODEL_ARCH_LLAMA);
    assert_int_equal(hp->n_expert, 8);
    assert_int_equal(hp->n_expert_used, 2);
    assert_int_equal(hp->n_ff_exp, 512); /* llama's experts are n_ff wide */
    model_free(m);

    m = make_model(&g_llama, "f32");
    assert_int_equal(model_hparams(m)->n_expert, 0);
    assert_int_equal(model_weight_bytes(m), model_active_weight_bytes(m));
    model_free(m);
}

enum edit_kind { EDIT_DROP, EDIT_SHAPE, EDIT_TYPE, EDIT_RENAME, EDIT_ZERO };

static const char *g_rename_to; /* EDIT_RENAME's new name */

/* Copy src to dst with every key (plus extra ones) and every tensor, except
 * that tensor `name` is dropped, reshaped, given a type without kernels,
 * renamed to g_rename_to or zeroed. */
static void rewrite(const char *src, const char *dst, const char *name, enum edit_kind kind,
                    void (*extra_keys)(struct gguf_writer *))
{
    struct gguf_file *f;
    assert_int_equal(gguf_open(src, &f), KS_OK);
    struct gguf_writer *w;
    assert_int_equal(gguf_writer_create(&w), KS_OK);
    assert_int_equal(gguf_writer_copy_kv(w, f, ""), KS_OK);
    if (extra_keys)
        extra_keys(w);
    uint8_t *zeros = calloc(1, 1 << 20);
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        const struct gguf_tensor_info *t = gguf_tensor_at(f, i);
        int64_t ne[GGUF_MAX_DIMS];
        memcpy(ne, t->ne, sizeof ne);
        if (name && !strcmp(t->name, name)) {
            if (kind == EDIT_DROP)
                continue;
            if (kind == EDIT_RENAME) {
                assert_int_equal(gguf_writer_add_tensor(w, g_rename_to, t->n_dims, ne, t->type, t->data, t->nbytes), KS_OK);
            } else if (kind == EDIT_ZERO) {
                assert_true(t->nbytes <= 1 << 20);
                assert_int_equal(gguf_writer_add_tensor(w, t->name, t->n_dims, ne, t->type, zeros, t->nbytes), KS_OK);
            } else if (kind == EDIT_SHAPE) {
                ne[1] /= 2;
                assert_int_equal(gguf_writer_add_tensor(w, t->name, t->n_dims, ne, t->type, t->data, t->nbytes / 2), KS_OK);
            } else {
                /* q8_K is an activation type: no weight kernels */
                size_t bytes = quant_row_size(QUANT_Q8_K, ne[0]) * (size_t)ne[1];
                assert_true(bytes <= 1 << 20);
                assert_int_equal(gguf_writer_add_tensor(w, t->name, t->n_dims, ne, QUANT_Q8_K, zeros, bytes), KS_OK);
            }
            continue;
        }
        assert_int_equal(gguf_writer_add_tensor(w, t->name, t->n_dims, ne, t->type, t->data, t->nbytes), KS_OK);
    }
    assert_int_equal(gguf_writer_write(w, dst), KS_OK);
    gguf_writer_free(w);
    free(zeros);
    gguf_close(f);
}

static void expect_load_error(const char *path, ks_status want, const char *needle)
{
    struct model *m = NULL;
    ks_status st = model_load(path, &m);
    if (st != want || !strstr(ks_errmsg(), needle))
        fail_msg("loading %s: got status %d '%s', wanted %d mentioning '%s'", path, st, ks_errmsg(), want, needle);
    assert_null(m);
}

static void set_arch_mamba(struct gguf_writer *w) { gguf_writer_set_str(w, "general.architecture", "mamba"); }
static void drop_nothing(struct gguf_writer *w) { (void)w; }

static void test_load_errors(void **state)
{
    (void)state;
    char src[128], dst[160];
    synth_file(&g_qwen2, "q8_0", src, sizeof src);
    snprintf(dst, sizeof dst, "%s/broken.gguf", g_dir);

    rewrite(src, dst, "blk.1.ffn_up.weight", EDIT_DROP, drop_nothing);
    expect_load_error(dst, KS_ERR_FORMAT, "blk.1.ffn_up.weight");
    rewrite(src, dst, "blk.0.attn_k.bias", EDIT_DROP, drop_nothing);
    expect_load_error(dst, KS_ERR_FORMAT, "blk.0.attn_k.bias");
    rewrite(src, dst, "blk.0.attn_q.weight", EDIT_SHAPE, drop_nothing);
    expect_load_error(dst, KS_ERR_FORMAT, "blk.0.attn_q.weight");
    rewrite(src, dst, "blk.1.ffn_down.weight", EDIT_TYPE, drop_nothing);
    expect_load_error(dst, KS_ERR_UNSUPPORTED, "blk.1.ffn_down.weight");
    expect_load_error(dst, KS_ERR_UNSUPPORTED, "q8_K");
    rewrite(src, dst, NULL, EDIT_DROP, set_arch_mamba);
    expect_load_error(dst, KS_ERR_UNSUPPORTED, "mamba");
    expect_load_error("/nonexistent/model.gguf", KS_ERR_IO, "/nonexistent/model.gguf");
}

static void set_used_9(struct gguf_writer *w) { gguf_writer_set_u32(w, "qwen3moe.expert_used_count", 9); }
static void set_shared(struct gguf_writer *w) { gguf_writer_set_u32(w, "qwen3moe.expert_shared_count", 1); }
static void set_dense_llama(struct gguf_writer *w) { gguf_writer_set_u32(w, "llama.expert_count", 0); }

static void test_moe_load_errors(void **state)
{
    (void)state;
    char src[128], mix[128], dst[160];
    synth_file(&g_qwen3moe, "q8_0", src, sizeof src);
    synth_file(&g_mixtral, "q8_0", mix, sizeof mix);
    snprintf(dst, sizeof dst, "%s/broken.gguf", g_dir);

    rewrite(src, dst, "blk.1.ffn_up_exps.weight", EDIT_DROP, drop_nothing);
    expect_load_error(dst, KS_ERR_FORMAT, "blk.1.ffn_up_exps.weight");
    rewrite(src, dst, "blk.0.ffn_gate_inp.weight", EDIT_DROP, drop_nothing);
    expect_load_error(dst, KS_ERR_FORMAT, "blk.0.ffn_gate_inp.weight");
    rewrite(src, dst, "blk.0.ffn_down_exps.weight", EDIT_SHAPE, drop_nothing);
    expect_load_error(dst, KS_ERR_FORMAT, "blk.0.ffn_down_exps.weight");
    expect_load_error(dst, KS_ERR_FORMAT, "expected [256, 256, 8]");
    rewrite(src, dst, "blk.0.ffn_gate_inp.weight", EDIT_SHAPE, drop_nothing);
    expect_load_error(dst, KS_ERR_FORMAT, "blk.0.ffn_gate_inp.weight");
    rewrite(src, dst, NULL, EDIT_DROP, set_used_9);
    expect_load_error(dst, KS_ERR_FORMAT, "qwen3moe.expert_used_count = 9, expected 1..8");
    rewrite(src, dst, NULL, EDIT_DROP, set_shared);
    expect_load_error(dst, KS_ERR_UNSUPPORTED, "qwen3moe.expert_shared_count");
    /* llama with expert tensors but no expert_count */
    rewrite(mix, dst, NULL, EDIT_DROP, set_dense_llama);
    expect_load_error(dst, KS_ERR_FORMAT, "expert_count");
    /* the per-expert layout of older Mixtral files is refused by name */
    g_rename_to = "blk.0.ffn_gate.0.weight";
    rewrite(mix, dst, "blk.0.ffn_gate_exps.weight", EDIT_RENAME, drop_nothing);
    expect_load_error(dst, KS_ERR_UNSUPPORTED, "blk.0.ffn_gate.0.weight");
}

/* A router of zeros: every expert has the same probability, and the top-k
 * takes the lowest ids (ggml's argsort of a row this short is stable). The
 * engine must pick the same experts as the naive reference. */
static void test_moe_router_ties(void **state)
{
    (void)state;
    char src[128], dst[160];
    synth_file(&g_qwen3moe, "f32", src, sizeof src);
    snprintf(dst, sizeof dst, "%s/ties.gguf", g_dir);
    rewrite(src, dst, "blk.1.ffn_gate_inp.weight", EDIT_ZERO, drop_nothing);
    struct model *m;
    assert_int_equal(model_load(dst, &m), KS_OK);
    float tight = prompt_vs_refs(m, 53, 5, true);
    print_message("router ties: max |diff| %.2e\n", (double)tight);
    assert_true(tight <= 1e-4f);
    model_free(m);
}

/* ---- RoPE scaling from metadata ------------------------------------------------ */

static void set_linear(struct gguf_writer *w)
{
    gguf_writer_set_str(w, "llama.rope.scaling.type", "linear");
    gguf_writer_set_f32(w, "llama.rope.scaling.factor", 4.0f);
}

static void set_llama3(struct gguf_writer *w)
{
    gguf_writer_set_str(w, "llama.rope.scaling.type", "llama3");
    gguf_writer_set_f32(w, "llama.rope.scaling.factor", 8.0f);
    gguf_writer_set_f32(w, "llama.rope.scaling.low_freq_factor", 1.0f);
    gguf_writer_set_f32(w, "llama.rope.scaling.high_freq_factor", 4.0f);
    gguf_writer_set_u32(w, "llama.rope.scaling.original_context_length", 64);
}

static void run_scaled(void (*keys)(struct gguf_writer *), enum model_rope_scaling want, float factor)
{
    char src[128], dst[160];
    synth_file(&g_llama, "f32", src, sizeof src);
    snprintf(dst, sizeof dst, "%s/scaled.gguf", g_dir);
    rewrite(src, dst, NULL, EDIT_DROP, keys);
    struct model *m;
    assert_int_equal(model_load(dst, &m), KS_OK);
    assert_int_equal(model_hparams(m)->rope_scaling, want);
    assert_true(fabsf(model_hparams(m)->rope_scale_factor - factor) < 1e-6f);
    float tight = prompt_vs_refs(m, 37, 11, false);
    print_message("rope scaling %d: max |diff| %.2e\n", want, (double)tight);
    assert_true(tight <= 1e-4f);
    model_free(m);
}

static void test_rope_linear(void **state)
{
    (void)state;
    run_scaled(set_linear, MODEL_ROPE_SCALING_LINEAR, 4.0f);
}

static void test_rope_llama3(void **state)
{
    (void)state;
    run_scaled(set_llama3, MODEL_ROPE_SCALING_LLAMA3, 8.0f);
}

/* ---- batch validation and all-or-nothing growth ------------------------------------ */

static void test_batch_errors(void **state)
{
    (void)state;
    struct model *m = make_model(&g_llama, "q8_0");
    threads_pool *pool;
    assert_int_equal(threads_create(2, &pool), KS_OK);
    struct kv_config cfg;
    model_kv_config(m, &cfg);
    cfg.type_k = cfg.type_v = QUANT_F32;
    cfg.page_tokens = 16;
    cfg.mem_budget = 2 * kv_page_bytes(&cfg, QUANT_F32, QUANT_F32);
    struct kv_cache *kv;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    struct model_ctx *ctx;
    assert_int_equal(model_ctx_create(m, 32, pool, &ctx), KS_OK);
    int32_t a, b;
    assert_int_equal(kv_seq_create(kv, &a), KS_OK);
    assert_int_equal(kv_seq_create(kv, &b), KS_OK);
    float *logits = malloc(sizeof(float) * 32 * N_VOCAB);
    int32_t tok[32], pos[32], seq[32];
    for (int i = 0; i < 32; i++)
        tok[i] = i, pos[i] = i, seq[i] = a;

    /* 10 tokens of a: one page */
    struct model_batch bt = {10, tok, pos, seq, NULL};
    assert_int_equal(model_forward(ctx, kv, &bt, logits, NULL), KS_OK);
    assert_int_equal(kv_seq_len(kv, a), 10);

    /* a position gap, a token outside the vocab, an unknown sequence, too many tokens */
    int32_t p_gap = 11, bad_tok = N_VOCAB, bad_seq = 999;
    struct model_batch gap = {1, tok, &p_gap, &a, NULL};
    assert_int_equal(model_forward(ctx, kv, &gap, logits, NULL), KS_ERR_RANGE);
    int32_t p10 = 10;
    struct model_batch btok = {1, &bad_tok, &p10, &a, NULL};
    assert_int_equal(model_forward(ctx, kv, &btok, logits, NULL), KS_ERR_RANGE);
    int32_t p0 = 0;
    struct model_batch bseq = {1, tok, &p0, &bad_seq, NULL};
    assert_int_not_equal(model_forward(ctx, kv, &bseq, logits, NULL), KS_OK);
    struct model_batch big = {33, tok, pos, seq, NULL};
    assert_int_equal(model_forward(ctx, kv, &big, logits, NULL), KS_ERR_INVALID_ARG);
    assert_int_equal(kv_seq_len(kv, a), 10);

    /* a grows into the second (last) page, b would need a third: nothing changes */
    for (int i = 0; i < 10; i++)
        pos[i] = 10 + i, seq[i] = a;
    for (int i = 10; i < 15; i++)
        pos[i] = i - 10, seq[i] = b;
    struct model_batch full = {15, tok, pos, seq, NULL};
    assert_int_equal(model_forward(ctx, kv, &full, logits, NULL), KS_ERR_KV_FULL);
    assert_int_equal(kv_seq_len(kv, a), 10);
    assert_int_equal(kv_seq_len(kv, b), 0);
    /* a alone fits */
    struct model_batch ok = {10, tok, pos, seq, NULL};
    int32_t n_out = 0;
    assert_int_equal(model_forward(ctx, kv, &ok, logits, &n_out), KS_OK);
    assert_int_equal(n_out, 1);
    assert_int_equal(kv_seq_len(kv, a), 20);

    free(logits);
    model_ctx_free(ctx);
    kv_free(kv);
    threads_free(pool);
    model_free(m);
}

/* ---- synth ---------------------------------------------------------------------------- */

static void test_synth_deterministic_and_mix(void **state)
{
    (void)state;
    struct model_synth_spec spec;
    assert_int_equal(model_synth_preset("tiny", &spec), KS_OK);
    assert_int_equal(model_synth_preset("nope", &spec), KS_ERR_INVALID_ARG);
    assert_int_equal(model_synth_preset("tiny", &spec), KS_OK);
    spec.n_layer = 8;
    char p1[128], p2[128];
    snprintf(p1, sizeof p1, "%s/mix1.gguf", g_dir);
    snprintf(p2, sizeof p2, "%s/mix2.gguf", g_dir);
    threads_pool *pool;
    assert_int_equal(threads_create(2, &pool), KS_OK);
    assert_int_equal(model_synth(&spec, "q4_k_m", NULL, p1, pool), KS_OK);
    assert_int_equal(model_synth(&spec, "q4_k_m", NULL, p2, NULL), KS_OK);
    assert_int_equal(model_synth(&spec, "q8_k", NULL, p2, NULL), KS_ERR_INVALID_ARG); /* activations only */
    threads_free(pool);
    struct gguf_file *f;
    assert_int_equal(gguf_open(p1, &f), KS_OK);
    /* same bytes with and without threads */
    FILE *a = fopen(p1, "rb"), *b = fopen(p2, "rb");
    int ca, cb;
    do {
        ca = fgetc(a), cb = fgetc(b);
        assert_int_equal(ca, cb);
    } while (ca != EOF);
    fclose(a), fclose(b);
    /* llama.cpp's Q4_K_M: q6_K output (tied embeddings) and attn_v / ffn_down
     * of layers 0, 3 (every third from n/8) and 7 (last eighth) of 8 */
    assert_int_equal(gguf_find_tensor(f, "token_embd.weight")->type, QUANT_Q6_K);
    assert_null(gguf_find_tensor(f, "output.weight"));
    assert_int_equal(gguf_find_tensor(f, "output_norm.weight")->type, QUANT_F32);
    const int more_bits[8] = {1, 0, 0, 1, 0, 0, 1, 1};
    for (int il = 0; il < 8; il++) {
        char n[64];
        enum quant_type want = more_bits[il] ? QUANT_Q6_K : QUANT_Q4_K;
        snprintf(n, sizeof n, "blk.%d.attn_v.weight", il);
        assert_int_equal(gguf_find_tensor(f, n)->type, want);
        snprintf(n, sizeof n, "blk.%d.ffn_down.weight", il);
        assert_int_equal(gguf_find_tensor(f, n)->type, want);
        snprintf(n, sizeof n, "blk.%d.attn_q.weight", il);
        assert_int_equal(gguf_find_tensor(f, n)->type, QUANT_Q4_K);
    }
    gguf_close(f);
    struct model *m;
    assert_int_equal(model_load(p1, &m), KS_OK);
    assert_int_equal(model_hparams(m)->n_vocab, 512);
    assert_true(model_hparams(m)->tied_embeddings);
    model_free(m);
}

/* ---- main ------------------------------------------------------------------------------ */

static int setup(void **state)
{
    (void)state;
    snprintf(g_dir, sizeof g_dir, "/tmp/kvserve-test-model-XXXXXX");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_llama_f32),  cmocka_unit_test(test_llama_f16),  cmocka_unit_test(test_llama_q8_0),
        cmocka_unit_test(test_llama_q4_0), cmocka_unit_test(test_llama_q4_k), cmocka_unit_test(test_qwen2_f32),
        cmocka_unit_test(test_qwen2_f16),  cmocka_unit_test(test_qwen2_q8_0), cmocka_unit_test(test_qwen2_q4_0),
        cmocka_unit_test(test_qwen2_q4_k), cmocka_unit_test(test_qwen3_f32),  cmocka_unit_test(test_qwen3_f16),
        cmocka_unit_test(test_qwen3_q8_0), cmocka_unit_test(test_qwen3_q4_0), cmocka_unit_test(test_qwen3_q4_k),
        cmocka_unit_test(test_qwen3moe_f32), cmocka_unit_test(test_qwen3moe_f16), cmocka_unit_test(test_qwen3moe_q8_0),
        cmocka_unit_test(test_qwen3moe_q4_0), cmocka_unit_test(test_qwen3moe_q4_k), cmocka_unit_test(test_mixtral_f32),
        cmocka_unit_test(test_mixtral_f16), cmocka_unit_test(test_mixtral_q8_0), cmocka_unit_test(test_mixtral_q4_0),
        cmocka_unit_test(test_mixtral_q4_k),
        cmocka_unit_test(test_tied_q8_0),
        cmocka_unit_test(test_tied_q4_0),
        cmocka_unit_test(test_single_thread),
        cmocka_unit_test(test_moe_single_thread),
        cmocka_unit_test(test_hparams),
        cmocka_unit_test(test_load_errors),
        cmocka_unit_test(test_moe_load_errors),
        cmocka_unit_test(test_moe_router_ties),
        cmocka_unit_test(test_rope_linear),
        cmocka_unit_test(test_rope_llama3),
        cmocka_unit_test(test_batch_errors),
        cmocka_unit_test(test_synth_deterministic_and_mix),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
