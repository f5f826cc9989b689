/* Smoothing (cfg.smooth): rows stored minus each sequence's channel means.
 * Attention over an f32 cache is the same with and without the means (the
 * shift is exact), quantized rows lose less to offsets, and the means follow
 * page 0 through forks, the prefix cache and the SSD tier's blobs. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "attn/attn.h"
#include "attn/attn_internal.h"
#include "kv/kv.h"

enum { N_LAYER = 2, N_KV = 2, N_HEAD = 8, DIM = 64, P = 16, KV_DIM = N_KV * DIM };

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static float frand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((rng >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}

/* Rows with a per-channel offset larger than their spread, as real K and V
 * have (the offsets are what smoothing removes), and an outlier channel. */
static void offset_rows(float *x, int32_t n, int layer, float salt)
{
    for (int32_t t = 0; t < n; t++)
        for (int i = 0; i < KV_DIM; i++) {
            float offset = 3.0f * sinf(0.37f * (float)i + (float)layer + salt) + (i % 16 == 5 ? 6.0f : 0.0f);
            x[(size_t)t * KV_DIM + i] = offset + 0.5f * frand();
        }
}

static struct kv_cache *make_cache(enum quant_type t, enum kv_smooth smooth)
{
    struct kv_config cfg;
    kv_config_default(&cfg);
    cfg.n_layer = N_LAYER;
    cfg.n_kv_head = N_KV;
    cfg.head_dim = DIM;
    cfg.page_tokens = P;
    cfg.type_k = cfg.type_v = t;
    cfg.smooth = smooth;
    cfg.mem_budget = 64u << 20;
    memcpy(cfg.fingerprint, "smooth-fingerprt", 16);
    struct kv_cache *kv = NULL;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    return kv;
}

/* Write rows [from, to) of every layer in chunks of the given sizes (cycled),
 * k and v holding (N_LAYER, len, KV_DIM). */
static void write_chunks(struct kv_cache *kv, int32_t seq, const float *k, const float *v, int32_t len, int32_t from,
                         int32_t to, const int32_t *chunks, int n_chunks)
{
    for (int32_t pos = from, c = 0; pos < to; c++) {
        int32_t n = chunks[c % n_chunks] < to - pos ? chunks[c % n_chunks] : to - pos;
        for (int l = 0; l < N_LAYER; l++) {
            size_t off = ((size_t)l * len + pos) * KV_DIM;
            assert_int_equal(kv_write_rows(kv, l, seq, pos, n, k + off, v + off), KS_OK);
        }
        pos += n;
    }
}

/* ---- exactness ---------------------------------------------------------------------- */

/* Sequence a: 90 tokens written in chunks of 13, 29 and 48 (the first write
 * fixes the means from its 13 rows in page 0), forked at 50 into b, which goes
 * on to 80 tokens with other rows. Both caches hold the same rows. */
struct two_seqs {
    struct kv_cache *kv;
    int32_t a, b;
};

enum { LEN_A = 90, LEN_B = 80, FORK_AT = 50 };

static struct two_seqs build(enum quant_type t, enum kv_smooth smooth, const float *ka, const float *va,
                             const float *kb, const float *vb)
{
    static const int32_t chunks[] = {13, 29, 48};
    struct two_seqs s = {make_cache(t, smooth), -1, -1};
    assert_int_equal(kv_seq_create(s.kv, &s.a), KS_OK);
    assert_int_equal(kv_seq_grow(s.kv, s.a, FORK_AT), KS_OK);
    write_chunks(s.kv, s.a, ka, va, LEN_A, 0, FORK_AT, chunks, 3);
    assert_int_equal(kv_seq_fork(s.kv, s.a, &s.b), KS_OK);
    assert_int_equal(kv_seq_grow(s.kv, s.a, LEN_A - FORK_AT), KS_OK);
    write_chunks(s.kv, s.a, ka, va, LEN_A, FORK_AT, LEN_A, chunks + 1, 2);
    assert_int_equal(kv_seq_grow(s.kv, s.b, LEN_B - FORK_AT), KS_OK);
    write_chunks(s.kv, s.b, kb, vb, LEN_B, FORK_AT, LEN_B, chunks, 1);
    assert_int_equal(kv_check(s.kv), KS_OK);
    return s;
}

/* Queries at every position of both sequences (prefill tiles with the causal
 * mask, and page ranges split across threads), random query rows, and room
 * for two outputs. */
struct attn_io {
    struct attn_query qs[LEN_A + LEN_B];
    int nq;
    size_t width;       /* floats of one query's rows: N_HEAD * DIM */
    float *q, *ref, *got;
};

static void io_init(struct attn_io *io, const struct two_seqs *s)
{
    io->nq = 0;
    for (int32_t p = 0; p < LEN_A; p++)
        io->qs[io->nq++] = (struct attn_query){s->a, p};
    for (int32_t p = 0; p < LEN_B; p++)
        io->qs[io->nq++] = (struct attn_query){s->b, p};
    io->width = (size_t)N_HEAD * DIM;
    size_t n = io->nq * io->width;
    io->q = malloc(n * sizeof(float));
    io->ref = malloc(n * sizeof(float));
    io->got = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++)
        io->q[i] = 2.0f * frand();
}

static void io_free(struct attn_io *io)
{
    free(io->q);
    free(io->ref);
    free(io->got);
}

static void build_rows(float **ka, float **va, float **kb, float **vb)
{
    *ka = malloc((size_t)N_LAYER * LEN_A * KV_DIM * sizeof(float));
    *va = malloc((size_t)N_LAYER * LEN_A * KV_DIM * sizeof(float));
    *kb = malloc((size_t)N_LAYER * LEN_B * KV_DIM * sizeof(float));
    *vb = malloc((size_t)N_LAYER * LEN_B * KV_DIM * sizeof(float));
    for (int l = 0; l < N_LAYER; l++) {
        offset_rows(*ka + (size_t)l * LEN_A * KV_DIM, LEN_A, l, 0.0f);
        offset_rows(*va + (size_t)l * LEN_A * KV_DIM, LEN_A, l, 1.0f);
        /* b shares a's first FORK_AT rows (the forked prefix) */
        size_t shared = (size_t)FORK_AT * KV_DIM * sizeof(float);
        memcpy(*kb + (size_t)l * LEN_B * KV_DIM, *ka + (size_t)l * LEN_A * KV_DIM, shared);
        memcpy(*vb + (size_t)l * LEN_B * KV_DIM, *va + (size_t)l * LEN_A * KV_DIM, shared);
        offset_rows(*kb + ((size_t)l * LEN_B + FORK_AT) * KV_DIM, LEN_B - FORK_AT, l, 2.0f);
        offset_rows(*vb + ((size_t)l * LEN_B + FORK_AT) * KV_DIM, LEN_B - FORK_AT, l, 3.0f);
    }
}

static void test_f32_attention_exact(void **state)
{
    (void)state;
    float *ka, *va, *kb, *vb;
    build_rows(&ka, &va, &kb, &vb);
    struct two_seqs off = build(QUANT_F32, KV_SMOOTH_OFF, ka, va, kb, vb);
    struct two_seqs on = build(QUANT_F32, KV_SMOOTH_KV, ka, va, kb, vb);
    /* the means are there, and the fork shares a's page 0 and with it its means */
    assert_null(kv_seq_mean(off.kv, off.a, 0, true));
    assert_non_null(kv_seq_mean(on.kv, on.a, 1, false));
    assert_ptr_equal(kv_seq_mean(on.kv, on.a, 1, true), kv_seq_mean(on.kv, on.b, 1, true));
    static struct attn_io io;
    io_init(&io, &on);
    size_t n = io.nq * io.width;
    threads_pool *pool = NULL;
    assert_int_equal(threads_create(2, &pool), KS_OK);
    const struct attn_kernels *sets[] = {attn_kernels_scalar(), attn_kernels_avx2(), attn_kernels_avx512()};
    for (int k = 0; k < 3; k++) {
        if (!sets[k])
            continue;
        attn_set_kernels(sets[k]);
        for (int l = 0; l < N_LAYER; l++) {
            assert_int_equal(attn_forward(pool, off.kv, l, io.qs, io.nq, io.q, io.ref, N_HEAD, 0.125f), KS_OK);
            assert_int_equal(attn_forward(pool, on.kv, l, io.qs, io.nq, io.q, io.got, N_HEAD, 0.125f), KS_OK);
            double worst = 0.0;
            for (size_t i = 0; i < n; i++)
                worst = fmax(worst, fabs((double)io.got[i] - io.ref[i]));
            if (worst > 1e-5)
                fail_msg("%s layer %d: smoothed attention is %g from the plain one", sets[k]->isa, l, worst);
        }
    }
    attn_set_kernels(NULL);
    threads_free(pool);
    io_free(&io);
    kv_free(off.kv);
    kv_free(on.kv);
    free(ka);
    free(va);
    free(kb);
    free(vb);
}

/* Quantized pages with the means: every SIMD set agrees with the scalar one
 * (only the final add is new, and it is shared). */
static void test_quantized_simd_matches_scalar(void **state)
{
    (void)state;
    float *ka, *va, *kb, *vb;
    build_rows(&ka, &va, &kb, &vb);
    enum quant_type types[] = {QUANT_Q8_0, QUANT_Q4_0, QUANT_IQ4_NL};
    for (int ti = 0; ti < 3; ti++) {
        struct two_seqs on = build(types[ti], KV_SMOOTH_KV, ka, va, kb, vb);
        static struct attn_io io;
        io_init(&io, &on);
        size_t n = io.nq * io.width;
        attn_set_kernels(attn_kernels_scalar());
        assert_int_equal(attn_forward(NULL, on.kv, 1, io.qs, io.nq, io.q, io.ref, N_HEAD, 0.125f), KS_OK);
        const struct attn_kernels *sets[] = {attn_kernels_avx2(), attn_kernels_avx512()};
        for (int k = 0; k < 2; k++) {
            if (!sets[k])
                continue;
            attn_set_kernels(sets[k]);
            assert_int_equal(attn_forward(NULL, on.kv, 1, io.qs, io.nq, io.q, io.got, N_HEAD, 0.125f), KS_OK);
            for (size_t i = 0; i < n; i++)
                if (fabsf(io.got[i] - io.ref[i]) > 2e-5f * fmaxf(1.0f, fabsf(io.ref[i])))
                    fail_msg("%s %s: element %zu is %g, scalar %g", sets[k]->isa, quant_type_name(types[ti]), i,
                             io.got[i], io.ref[i]);
        }
        attn_set_kernels(NULL);
        io_free(&io);
        kv_free(on.kv);
    }
    free(ka);
    free(va);
    free(kb);
    free(vb);
}

/* ---- reconstruction -------------------------------------------------------------------- */

/* Mean squared error of kv_read against the rows written, K and V. */
static double read_back_error(enum quant_type t, enum kv_smooth smooth, const float *k, const float *v, int32_t n)
{
    struct kv_cache *kv = make_cache(t, smooth);
    int32_t seq = -1;
    assert_int_equal(kv_seq_create(kv, &seq), KS_OK);
    assert_int_equal(kv_seq_grow(kv, seq, n), KS_OK);
    static const int32_t chunk[] = {40};
    write_chunks(kv, seq, k, v, n, 0, n, chunk, 1);
    double sq = 0.0;
    float rk[KV_DIM], rv[KV_DIM];
    for (int l = 0; l < N_LAYER; l++)
        for (int32_t p = 0; p < n; p++) {
            assert_int_equal(kv_read(kv, l, seq, p, rk, rv), KS_OK);
            size_t off = ((size_t)l * n + p) * KV_DIM;
            for (int i = 0; i < KV_DIM; i++)
                sq += (rk[i] - k[off + i]) * (rk[i] - k[off + i]) + (rv[i] - v[off + i]) * (rv[i] - v[off + i]);
        }
    kv_free(kv);
    return sq / (2.0 * N_LAYER * n * KV_DIM);
}

static void test_smoothing_lowers_quantization_error(void **state)
{
    (void)state;
    enum { N = 100 };
    float *k = malloc((size_t)N_LAYER * N * KV_DIM * sizeof(float));
    float *v = malloc((size_t)N_LAYER * N * KV_DIM * sizeof(float));
    for (int l = 0; l < N_LAYER; l++) {
        offset_rows(k + (size_t)l * N * KV_DIM, N, l, 0.0f);
        offset_rows(v + (size_t)l * N * KV_DIM, N, l, 1.0f);
    }
    /* f32 pages read back what was written, means or not */
    assert_true(read_back_error(QUANT_F32, KV_SMOOTH_KV, k, v, N) < 1e-9);
    enum quant_type types[] = {QUANT_Q8_0, QUANT_Q4_0};
    for (int i = 0; i < 2; i++) {
        double plain = read_back_error(types[i], KV_SMOOTH_OFF, k, v, N);
        double smooth = read_back_error(types[i], KV_SMOOTH_KV, k, v, N);
        print_message("%s: mean squared error %.3g plain, %.3g smoothed\n", quant_type_name(types[i]), plain, smooth);
        if (!(smooth < 0.5 * plain))
            fail_msg("%s: smoothing gave %g against %g without", quant_type_name(types[i]), smooth, plain);
    }
    free(k);
    free(v);
}

/* ---- the means follow page 0 ------------------------------------------------------------- */

struct blobs {
    int n;
    void *data[8];
    size_t len[8];
};

static void keep_blob(void *user, const struct kv_page_blob *b)
{
    struct blobs *log = user;
    if (log->n < 8) {
        log->data[log->n] = malloc(b->len);
        memcpy(log->data[log->n], b->data, b->len);
        log->len[log->n++] = b->len;
    }
}

static void assert_same_rows(const struct kv_cache *x, int32_t sx, const struct kv_cache *y, int32_t sy, int32_t n)
{
    float a[2 * KV_DIM], b[2 * KV_DIM];
    for (int l = 0; l < N_LAYER; l++)
        for (int32_t p = 0; p < n; p++) {
            assert_int_equal(kv_read(x, l, sx, p, a, a + KV_DIM), KS_OK);
            assert_int_equal(kv_read(y, l, sy, p, b, b + KV_DIM), KS_OK);
            assert_memory_equal(a, b, sizeof a);
        }
}

static void test_means_follow_page0(void **state)
{
    (void)state;
    enum { N = 3 * P };
    int32_t tokens[N];
    for (int i = 0; i < N; i++)
        tokens[i] = 100 + i;
    float *k = malloc((size_t)N_LAYER * N * KV_DIM * sizeof(float));
    float *v = malloc((size_t)N_LAYER * N * KV_DIM * sizeof(float));
    for (int l = 0; l < N_LAYER; l++) {
        offset_rows(k + (size_t)l * N * KV_DIM, N, l, 0.0f);
        offset_rows(v + (size_t)l * N * KV_DIM, N, l, 1.0f);
    }
    struct kv_cache *kv = make_cache(QUANT_Q4_0, KV_SMOOTH_KV);
    struct blobs log = {0};
    kv_set_evict_hook(kv, keep_blob, &log);
    int32_t a = -1, hit = -1, other = -1, n = 0;
    static const int32_t whole[] = {N}, small[] = {5};
    assert_int_equal(kv_seq_create(kv, &a), KS_OK);
    assert_int_equal(kv_seq_grow(kv, a, N), KS_OK);
    write_chunks(kv, a, k, v, N, 0, N, whole, 1);
    assert_int_equal(kv_seq_publish(kv, a, tokens, N), KS_OK);

    /* a RAM hit maps page 0 with its means: the same rows, exactly */
    assert_int_equal(kv_seq_create(kv, &hit), KS_OK);
    assert_int_equal(kv_seq_attach_pages(kv, hit, tokens, N, &n), KS_OK);
    assert_int_equal(n, 3);
    assert_ptr_equal(kv_seq_mean(kv, hit, 0, false), kv_seq_mean(kv, a, 0, false));
    assert_same_rows(kv, a, kv, hit, N);

    /* the same tokens computed with another first write have other means: their page 0 stays
     * private (its key is taken), and a's later pages, stored against a's means, are not mapped
     * after it */
    assert_int_equal(kv_seq_create(kv, &other), KS_OK);
    assert_int_equal(kv_seq_grow(kv, other, P), KS_OK);
    write_chunks(kv, other, k, v, N, 0, P, small, 1);
    assert_int_equal(kv_seq_publish(kv, other, tokens, P), KS_OK);
    assert_int_equal(kv_seq_attach_pages(kv, other, tokens, N, &n), KS_OK);
    assert_int_equal(n, 0);
    assert_int_equal(kv_seq_len(kv, other), P);

    /* the SSD tier: page 0's blob carries the means, a fresh cache reads the same rows */
    assert_int_equal(kv_prefix_persist(kv), 3);
    assert_int_equal(log.n, 3);
    assert_true(log.len[0] > log.len[1]); /* page 0 holds the means besides its rows */
    assert_int_equal(kv_seq_import_page(kv, other, tokens, log.data[1], log.len[1]), KS_ERR_FORMAT);
    struct kv_cache *fresh = make_cache(QUANT_F16, KV_SMOOTH_OFF); /* the blob's means win over the config */
    int32_t s = -1;
    assert_int_equal(kv_seq_create(fresh, &s), KS_OK);
    for (int i = 0; i < 3; i++)
        assert_int_equal(kv_seq_import_page(fresh, s, tokens, log.data[i], log.len[i]), KS_OK);
    assert_memory_equal(kv_seq_mean(fresh, s, 1, true), kv_seq_mean(kv, a, 1, true), KV_DIM * sizeof(float));
    assert_same_rows(kv, a, fresh, s, N);
    /* a fork of the imported sequence keeps them, and writes after page 0 use them */
    int32_t f = -1;
    assert_int_equal(kv_seq_fork(fresh, s, &f), KS_OK);
    assert_int_equal(kv_seq_truncate(fresh, f, P + 3), KS_OK);
    assert_int_equal(kv_seq_grow(fresh, f, N - P - 3), KS_OK);
    write_chunks(fresh, f, k, v, N, P + 3, N, small, 1);
    float got[KV_DIM], want[KV_DIM];
    for (int l = 0; l < N_LAYER; l++)
        for (int32_t p = P + 3; p < N; p++) {
            assert_int_equal(kv_read(fresh, l, f, p, got, NULL), KS_OK);
            memcpy(want, k + ((size_t)l * N + p) * KV_DIM, sizeof want);
            for (int i = 0; i < KV_DIM; i++) /* q4_0 (the copied page 1) or f16 rows, near; not off by a mean */
                assert_true(fabsf(got[i] - want[i]) < 0.3f);
        }
    assert_int_equal(kv_check(fresh), KS_OK);
    kv_free(fresh);
    assert_int_equal(kv_check(kv), KS_OK);
    kv_free(kv);
    for (int i = 0; i < log.n; i++)
        free(log.data[i]);
    free(k);
    free(v);
}

static void test_parse_and_bad_config(void **state)
{
    (void)state;
    enum kv_smooth s = KV_SMOOTH_OFF;
    assert_int_equal(kv_parse_smooth("kv", &s), KS_OK);
    assert_int_equal(s, KV_SMOOTH_KV);
    assert_int_equal(kv_parse_smooth("v", &s), KS_OK);
    assert_int_equal(s, KV_SMOOTH_V);
    assert_int_equal(kv_parse_smooth("yes", &s), KS_ERR_INVALID_ARG);
    assert_string_equal(kv_smooth_name(KV_SMOOTH_K), "k");
    struct kv_config cfg;
    kv_config_default(&cfg);
    assert_int_equal(cfg.smooth, KV_SMOOTH_OFF);
    cfg.n_layer = 1;
    cfg.n_kv_head = 1;
    cfg.head_dim = 32;
    cfg.mem_budget = 1u << 20;
    cfg.smooth = (enum kv_smooth)7;
    struct kv_cache *kv = NULL;
    assert_int_equal(kv_create(&cfg, &kv), KS_ERR_INVALID_ARG);
    assert_null(kv);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_f32_attention_exact),
        cmocka_unit_test(test_quantized_simd_matches_scalar),
        cmocka_unit_test(test_smoothing_lowers_quantization_error),
        cmocka_unit_test(test_means_follow_page0),
        cmocka_unit_test(test_parse_and_bad_config),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
