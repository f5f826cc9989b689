/* attn_forward over paged KV vs a naive f32 attention over a contiguous copy
 * of the unrotated, unquantized K/V. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "attn/attn.h"
#include "attn/attn_internal.h"

struct fixture {
    int n_layer, n_kv, n_head, dim, P;
    int n_seq;
    int32_t seq[4];
    int32_t len[4];
    float *k[4], *v[4]; /* per sequence: (n_layer, len, n_kv, dim) */
};

static uint64_t rng = 88172645463325252ull;
static float frand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((rng >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}

/* Keys with a few outlier channels, the case rotation is for. */
static float sample_k(int e) { return frand() * (e % 16 == 3 ? 8.0f : 1.0f); }

static struct kv_cache *make_cache_smooth(struct fixture *f, enum quant_type tk, enum quant_type tv, bool rotate,
                                          enum kv_smooth smooth, const int32_t *lens, int n_seq);
static struct kv_cache *make_cache(struct fixture *f, enum quant_type tk, enum quant_type tv, bool rotate,
                                   const int32_t *lens, int n_seq)
{
    return make_cache_smooth(f, tk, tv, rotate, KV_SMOOTH_OFF, lens, n_seq);
}

/* Sequences of lens[s] tokens of random K/V, each layer written in one call
 * (smoothing fixes its means from the first write). */
static struct kv_cache *make_cache_smooth(struct fixture *f, enum quant_type tk, enum quant_type tv, bool rotate,
                                          enum kv_smooth smooth, const int32_t *lens, int n_seq)
{
    struct kv_config cfg;
    kv_config_default(&cfg);
    cfg.n_layer = f->n_layer;
    cfg.n_kv_head = f->n_kv;
    cfg.head_dim = f->dim;
    cfg.page_tokens = f->P;
    cfg.type_k = tk;
    cfg.type_v = tv;
    cfg.rotate = rotate;
    cfg.smooth = smooth;
    cfg.mem_budget = (size_t)1 << 30;
    struct kv_cache *kv;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    f->n_seq = n_seq;
    for (int s = 0; s < n_seq; s++) {
        assert_int_equal(kv_seq_create(kv, &f->seq[s]), KS_OK);
        f->len[s] = lens[s];
        assert_int_equal(kv_seq_grow(kv, f->seq[s], lens[s]), KS_OK);
        size_t n = (size_t)f->n_layer * lens[s] * f->n_kv * f->dim;
        f->k[s] = malloc(n * sizeof(float));
        f->v[s] = malloc(n * sizeof(float));
        for (size_t i = 0; i < n; i++) {
            f->k[s][i] = sample_k((int)(i % f->dim));
            f->v[s][i] = frand();
        }
        for (int l = 0; l < f->n_layer; l++) {
            size_t off = (size_t)l * lens[s] * f->n_kv * f->dim;
            assert_int_equal(kv_write_rows(kv, l, f->seq[s], 0, lens[s], f->k[s] + off, f->v[s] + off), KS_OK);
        }
    }
    assert_int_equal(kv_check(kv), KS_OK);
    return kv;
}

static void free_fixture(struct fixture *f)
{
    for (int s = 0; s < f->n_seq; s++) {
        free(f->k[s]);
        free(f->v[s]);
    }
}

/* The obviously correct twin: double-precision softmax per query head over
 * the keys the window leaves, soft-capped scores, the sink in the sum. */
static void naive_attention_ex(const struct fixture *f, int layer, int s, int pos, const float *q, float *out,
                               const struct attn_params *ap)
{
    int group = f->n_head / f->n_kv;
    int first = ap->window > 0 && pos - ap->window + 1 > 0 ? pos - ap->window + 1 : 0;
    double *w = malloc((size_t)(pos + 1) * sizeof *w);
    for (int h = 0; h < f->n_head; h++) {
        int kvh = h / group;
        const float *qh = q + (size_t)h * f->dim;
        double mx = ap->sinks ? ap->sinks[h] : -INFINITY, sum = 0.0;
        for (int p = first; p <= pos; p++) {
            const float *k = f->k[s] + (((size_t)layer * f->len[s] + p) * f->n_kv + kvh) * f->dim;
            double d = 0.0;
            for (int e = 0; e < f->dim; e++)
                d += (double)qh[e] * k[e];
            w[p] = d * ap->scale;
            if (ap->softcap > 0.0f)
                w[p] = ap->softcap * tanh(w[p] / ap->softcap);
            mx = w[p] > mx ? w[p] : mx;
        }
        for (int p = first; p <= pos; p++)
            sum += (w[p] = exp(w[p] - mx));
        if (ap->sinks)
            sum += exp(ap->sinks[h] - mx);
        for (int e = 0; e < f->dim; e++) {
            double acc = 0.0;
            for (int p = first; p <= pos; p++)
                acc += w[p] * f->v[s][(((size_t)layer * f->len[s] + p) * f->n_kv + kvh) * f->dim + e];
            out[(size_t)h * f->dim + e] = (float)(acc / sum);
        }
    }
    free(w);
}

static void naive_attention(const struct fixture *f, int layer, int s, int pos, const float *q, float *out,
                            float scale)
{
    struct attn_params ap = {.scale = scale};
    naive_attention_ex(f, layer, s, pos, q, out, &ap);
}

struct run_stats {
    double max_abs, rms;
};

/* Queries: every sequence's last position (decode) plus, for sequence 0, a
 * run of consecutive positions (prefill tile with the causal mask). */
static struct run_stats run_case(struct fixture *f, struct kv_cache *kv, threads_pool *pool, int layer)
{
    struct attn_query qs[64];
    int nq = 0;
    for (int s = 0; s < f->n_seq; s++)
        qs[nq++] = (struct attn_query){f->seq[s], f->len[s] - 1};
    for (int p = 0; p < f->len[0] && nq < 40; p += 1 + f->len[0] / 24)
        qs[nq++] = (struct attn_query){f->seq[0], p};
    size_t w = (size_t)f->n_head * f->dim;
    float *q = malloc(nq * w * sizeof(float)), *out = malloc(nq * w * sizeof(float));
    float *ref = malloc(w * sizeof(float));
    for (size_t i = 0; i < nq * w; i++)
        q[i] = frand();
    float scale = 1.0f / sqrtf((float)f->dim);
    assert_int_equal(attn_forward(pool, kv, layer, qs, nq, q, out, f->n_head, scale), KS_OK);
    struct run_stats rs = {0, 0};
    double sq = 0.0;
    for (int i = 0; i < nq; i++) {
        int s = 0;
        while (f->seq[s] != qs[i].seq)
            s++;
        naive_attention(f, layer, s, qs[i].pos, q + i * w, ref, scale);
        for (size_t e = 0; e < w; e++) {
            double d = fabs((double)out[i * w + e] - ref[e]);
            rs.max_abs = d > rs.max_abs ? d : rs.max_abs;
            sq += d * d;
        }
    }
    rs.rms = sqrt(sq / (nq * w));
    free(q);
    free(out);
    free(ref);
    return rs;
}

/* K/V pairs: every pair of f32, f16, q8_0 and q4_0, and each other KV type
 * with itself and with f16 on the other half (every kernel of every type
 * meets both a float and a quantized partner page). */
struct type_pair {
    enum quant_type k, v;
};
static const enum quant_type CORE[] = {QUANT_F32, QUANT_F16, QUANT_Q8_0, QUANT_Q4_0};
static const enum quant_type OTHER[] = {QUANT_BF16, QUANT_Q5_1, QUANT_Q5_0, QUANT_Q4_1, QUANT_IQ4_NL, QUANT_IQ3_NL};
enum { N_CORE = 4, N_OTHER = 6, N_PAIRS = N_CORE * N_CORE + 3 * N_OTHER };

static struct type_pair type_pair(int i)
{
    if (i < N_CORE * N_CORE)
        return (struct type_pair){CORE[i / N_CORE], CORE[i % N_CORE]};
    i -= N_CORE * N_CORE;
    enum quant_type t = OTHER[i / 3];
    return i % 3 == 0 ? (struct type_pair){t, t} : i % 3 == 1 ? (struct type_pair){t, QUANT_F16}
                                                            : (struct type_pair){QUANT_F16, t};
}

static bool type_fits(enum quant_type t, int dim) { return dim % quant_traits(t)->block_elems == 0; }

/* Stated error bounds on this data (q and v uniform in [-1, 1], keys with
 * outlier channels up to 8, scale 1/sqrt(dim)), per half: the bound of a
 * K/V pair is the sum of its halves'. A naive f32 attention is the reference. */
struct bounds {
    double max_abs, rms;
};
static struct bounds bound(enum quant_type t)
{
    switch (t) {
    case QUANT_F32: return (struct bounds){5e-6, 5e-6};
    case QUANT_F16: return (struct bounds){2e-3, 3e-4};
    case QUANT_BF16: return (struct bounds){6e-3, 6e-4};
    case QUANT_Q8_0: return (struct bounds){2.5e-2, 3e-3};
    case QUANT_Q5_0: case QUANT_Q5_1: return (struct bounds){0.12, 0.012};
    case QUANT_IQ3_NL: return (struct bounds){0.5, 0.05}; /* 8 levels: twice a 4-bit type's step */
    default: return (struct bounds){0.25, 0.025};
    }
}

static void check_all_types(int dim, int n_head, int n_kv, int P, bool rotate, threads_pool *pool,
                            const struct attn_kernels *k)
{
    attn_set_kernels(k);
    int32_t lens[3] = {400, 37, 1}; /* 400 tokens at P=16: 25 pages, 4 page ranges with 2 threads */
    for (int i = 0; i < N_PAIRS; i++) {
        struct type_pair tp = type_pair(i);
        if (!type_fits(tp.k, dim) || !type_fits(tp.v, dim))
            continue;
        struct fixture f = {.n_layer = 2, .n_kv = n_kv, .n_head = n_head, .dim = dim, .P = P};
        struct kv_cache *kv = make_cache(&f, tp.k, tp.v, rotate, lens, 3);
        struct run_stats rs = run_case(&f, kv, pool, 1);
        double lim = bound(tp.k).max_abs + bound(tp.v).max_abs;
        double lim_rms = bound(tp.k).rms + bound(tp.v).rms;
        if (getenv("ATTN_TEST_VERBOSE"))
            print_message("%s K=%s V=%s dim %d rotate %d: max %.3g rms %.3g\n", k ? k->isa : "best",
                          quant_type_name(tp.k), quant_type_name(tp.v), dim, rotate, rs.max_abs, rs.rms);
        if (rs.max_abs > lim || rs.rms > lim_rms)
            fail_msg("%s K=%s V=%s dim %d rotate %d: error max %g rms %g, bounds %g %g", k ? k->isa : "best",
                     quant_type_name(tp.k), quant_type_name(tp.v), dim, rotate, rs.max_abs, rs.rms, lim, lim_rms);
        kv_free(kv);
        free_fixture(&f);
    }
    attn_set_kernels(NULL);
}

static void test_f32_f16_small_head(void **state)
{
    (void)state;
    check_all_types(8, 8, 4, 16, true, NULL, NULL);
    check_all_types(8, 8, 4, 16, false, NULL, attn_kernels_scalar());
}

static void test_all_types_scalar(void **state)
{
    (void)state;
    check_all_types(64, 4, 2, 32, true, NULL, attn_kernels_scalar());
    check_all_types(64, 4, 2, 32, false, NULL, attn_kernels_scalar());
}

static void test_all_types_simd_threads(void **state)
{
    (void)state;
    threads_pool *pool;
    assert_int_equal(threads_create(2, &pool), KS_OK);
    const struct attn_kernels *sets[] = {attn_kernels_avx2(), attn_kernels_avx512()};
    for (int i = 0; i < 2; i++) {
        if (!sets[i]) {
            print_message("kernel set %d not compiled into this build\n", i);
            continue;
        }
        check_all_types(128, 8, 2, 16, true, pool, sets[i]);
        check_all_types(64, 4, 4, 64, false, pool, sets[i]);
        check_all_types(32, 12, 4, 32, true, pool, sets[i]);
        check_all_types(8, 8, 4, 16, true, pool, sets[i]);
        check_all_types(24, 2, 1, 16, false, pool, sets[i]); /* 8-wide but not 16-wide */
    }
    threads_free(pool);
}

/* A sequence whose pages differ in precision, in both orders (quantized
 * pages first, as the policy demotes old ones, and float pages first): each
 * page takes its own kernel, and the int8 query rows the quantized K
 * kernels need are made at the first such page. */
static void mixed_pages(enum quant_type base_k, enum quant_type base_v, enum quant_type old_k, enum quant_type old_v,
                        threads_pool *pool, const struct attn_kernels *k)
{
    attn_set_kernels(k);
    int32_t lens[2] = {400, 37};
    struct fixture f = {.n_layer = 2, .n_kv = 2, .n_head = 8, .dim = 64, .P = 16};
    struct kv_cache *kv = make_cache(&f, base_k, base_v, true, lens, 2);
    struct kv_selector sel = {.kind = KV_SELECT_OLDER_THAN, .keep_recent = 150};
    assert_int_equal(kv_requantize(kv, &sel, old_k, old_v, false, NULL), KS_OK);
    assert_int_equal(kv_check(kv), KS_OK);
    struct run_stats rs = run_case(&f, kv, pool, 1);
    double lim = bound(base_k).max_abs + bound(base_v).max_abs + bound(old_k).max_abs + bound(old_v).max_abs;
    double lim_rms = bound(base_k).rms + bound(base_v).rms + bound(old_k).rms + bound(old_v).rms;
    if (rs.max_abs > lim || rs.rms > lim_rms)
        fail_msg("%s mixed %s/%s then %s/%s: error max %g rms %g, bounds %g %g", k ? k->isa : "best",
                 quant_type_name(old_k), quant_type_name(old_v), quant_type_name(base_k), quant_type_name(base_v),
                 rs.max_abs, rs.rms, lim, lim_rms);
    kv_free(kv);
    free_fixture(&f);
    attn_set_kernels(NULL);
}

static void test_mixed_precision_pages(void **state)
{
    (void)state;
    threads_pool *pool;
    assert_int_equal(threads_create(2, &pool), KS_OK);
    const struct attn_kernels *sets[] = {attn_kernels_scalar(), attn_kernels_avx2(), attn_kernels_avx512()};
    for (int i = 0; i < 3; i++) {
        if (!sets[i])
            continue;
        mixed_pages(QUANT_F16, QUANT_F16, QUANT_Q4_0, QUANT_Q8_0, pool, sets[i]);
        mixed_pages(QUANT_Q8_0, QUANT_Q4_0, QUANT_F16, QUANT_F32, pool, sets[i]);
        mixed_pages(QUANT_F32, QUANT_BF16, QUANT_IQ4_NL, QUANT_Q5_1, pool, sets[i]);
    }
    threads_free(pool);
}

/* Each SIMD set against the scalar reference on the same cache: the integer
 * dots are exact, so only float summation order and exp differ. Shapes cover
 * every row block (G = 4, and G = 3 as 2 + 1) and every chunking of the
 * quantized K kernels (head_dim 64: part of a 4-block chunk; 96: an odd block
 * count; 256: several chunks). */
static void simd_matches_scalar(int dim, int n_head, int n_kv)
{
    const struct attn_kernels *sets[] = {attn_kernels_avx2(), attn_kernels_avx512()};
    int32_t lens[2] = {300, 45};
    for (int pi = 0; pi < N_PAIRS; pi++) {
        struct type_pair tp = type_pair(pi);
            struct fixture f = {.n_layer = 1, .n_kv = n_kv, .n_head = n_head, .dim = dim, .P = 32};
            struct kv_cache *kv = make_cache(&f, tp.k, tp.v, true, lens, 2);
            struct attn_query qs[3] = {{f.seq[0], 299}, {f.seq[0], 100}, {f.seq[1], 44}};
            size_t w = (size_t)f.n_head * f.dim;
            float *q = malloc(3 * w * sizeof(float)), *ref = malloc(3 * w * sizeof(float)),
                  *got = malloc(3 * w * sizeof(float));
            for (size_t i = 0; i < 3 * w; i++)
                q[i] = frand();
            attn_set_kernels(attn_kernels_scalar());
            assert_int_equal(attn_forward(NULL, kv, 0, qs, 3, q, ref, f.n_head, 0.125f), KS_OK);
            for (int k = 0; k < 2; k++) {
                if (!sets[k])
                    continue;
                attn_set_kernels(sets[k]);
                assert_int_equal(attn_forward(NULL, kv, 0, qs, 3, q, got, f.n_head, 0.125f), KS_OK);
                for (size_t i = 0; i < 3 * w; i++)
                    if (fabsf(got[i] - ref[i]) > 2e-5f)
                        fail_msg("%s K=%s V=%s dim %d: element %zu is %g, scalar %g", sets[k]->isa,
                                 quant_type_name(tp.k), quant_type_name(tp.v), dim, i, got[i], ref[i]);
            }
            attn_set_kernels(NULL);
            free(q);
            free(ref);
            free(got);
            kv_free(kv);
            free_fixture(&f);
        }
}

/* Sliding windows (inside a page, across pages, wider than the sequence),
 * soft-capping and sinks, alone and together, against the naive twin: f32
 * and q8_0 pages, every kernel set, with and without smoothing (which
 * shifts the stored scores: the cap and the sink must see the true ones). */
static void window_case(const struct attn_kernels *k, enum quant_type t, enum kv_smooth smooth, int32_t window,
                        float softcap, bool sinks, threads_pool *pool)
{
    struct fixture f = {.n_layer = 1, .n_kv = 2, .n_head = 4, .dim = 64, .P = 16};
    int32_t lens[2] = {150, 9};
    struct kv_cache *kv = make_cache_smooth(&f, t, t, true, smooth, lens, 2);
    float sink_logits[4] = {0.5f, -1.0f, 2.0f, 0.0f};
    struct attn_params ap = {.scale = 0.3f, .window = window, .softcap = softcap, .sinks = sinks ? sink_logits : NULL};
    struct attn_query qs[40];
    int nq = 0;
    qs[nq++] = (struct attn_query){f.seq[1], 8};
    for (int p = 0; p < 150 && nq < 40; p += 5)
        qs[nq++] = (struct attn_query){f.seq[0], p};
    size_t w = (size_t)f.n_head * f.dim;
    float *q = malloc(nq * w * sizeof(float)), *out = malloc(nq * w * sizeof(float)), *ref = malloc(w * sizeof(float));
    for (size_t i = 0; i < nq * w; i++)
        q[i] = frand();
    attn_set_kernels(k);
    assert_int_equal(attn_forward_ex(pool, kv, 0, qs, nq, q, out, f.n_head, &ap), KS_OK);
    attn_set_kernels(NULL);
    double max_abs = 0.0, lim = t == QUANT_F32 ? 1e-5 : 6e-2;
    for (int i = 0; i < nq; i++) {
        int s = qs[i].seq == f.seq[0] ? 0 : 1;
        naive_attention_ex(&f, 0, s, qs[i].pos, q + i * w, ref, &ap);
        for (size_t e = 0; e < w; e++) {
            double d = fabs((double)out[i * w + e] - ref[e]);
            max_abs = d > max_abs ? d : max_abs;
        }
    }
    if (max_abs > lim)
        fail_msg("%s %s smooth %d window %d softcap %g sinks %d: max error %g > %g", k ? k->isa : "best",
                 quant_type_name(t), (int)smooth, (int)window, (double)softcap, (int)sinks, max_abs, lim);
    free(q);
    free(out);
    free(ref);
    kv_free(kv);
    free_fixture(&f);
}

static void test_window_softcap_sinks(void **state)
{
    (void)state;
    threads_pool *pool;
    assert_int_equal(threads_create(2, &pool), KS_OK);
    const struct attn_kernels *sets[] = {attn_kernels_scalar(), attn_kernels_avx2(), attn_kernels_avx512()};
    const enum quant_type types[] = {QUANT_F32, QUANT_Q8_0};
    const enum kv_smooth smooths[] = {KV_SMOOTH_OFF, KV_SMOOTH_KV};
    const int32_t windows[] = {0, 1, 7, 16, 40, 1000};
    for (int ks = 0; ks < 3; ks++)
        for (int ti = 0; ti < 2; ti++)
            for (int si = 0; si < 2; si++)
                for (int wi = 0; wi < 6; wi++)
                    for (int feat = 0; feat < 4; feat++) {
                        if (!sets[ks])
                            continue;
                        window_case(sets[ks], types[ti], smooths[si], windows[wi], feat & 1 ? 5.0f : 0.0f, feat & 2,
                                    ks == 1 ? NULL : pool);
                    }
    threads_free(pool);
}

/* A long sequence of one KV head: its decode query's segments run on
 * several threads (fewer items than threads) and are folded by whichever
 * finishes last. The output must be the same bits with 1, 2 and 3 threads,
 * alone and inside a batch whose tiles run whole (many items), and stay
 * within f16's bound of the naive twin: plain, windowed across segment
 * boundaries, soft-capped, with sinks, smoothed. */
static void split_case(enum quant_type t, enum kv_smooth smooth, const struct attn_params *ap, threads_pool *const *pools)
{
    struct fixture f = {.n_layer = 1, .n_kv = 1, .n_head = 4, .dim = 64, .P = 16};
    int32_t lens[2] = {1100, 700}; /* 1100 at P = 16: 69 pages, 5 segments of 256 tokens */
    struct kv_cache *kv = make_cache_smooth(&f, t, t, true, smooth, lens, 2);
    size_t w = (size_t)f.n_head * f.dim;
    enum { NQ = 40 };
    struct attn_query qs[NQ];
    int nq = 0;
    qs[nq++] = (struct attn_query){f.seq[0], 1099};
    for (int p = 1; nq < NQ; p += 37) /* a batch: many tiles, of both sequences */
        qs[nq++] = (struct attn_query){f.seq[nq % 2], p % (nq % 2 ? 700 : 1100)};
    float *q = malloc(NQ * w * sizeof(float)), *alone = malloc(w * sizeof(float)), *got = malloc(w * sizeof(float));
    float *batch = malloc(NQ * w * sizeof(float)), *ref = malloc(w * sizeof(float));
    for (size_t i = 0; i < NQ * w; i++)
        q[i] = frand();
    for (int i = 0; i < 4; i++) {
        assert_int_equal(attn_forward_ex(pools[i], kv, 0, qs, 1, q, i ? got : alone, f.n_head, ap), KS_OK);
        if (i && memcmp(got, alone, w * sizeof(float)) != 0)
            fail_msg("%s window %d: the decode query's output differs with pool %d", quant_type_name(t),
                     (int)ap->window, i);
    }
    assert_int_equal(attn_forward_ex(pools[2], kv, 0, qs, nq, q, batch, f.n_head, ap), KS_OK);
    if (memcmp(batch, alone, w * sizeof(float)) != 0)
        fail_msg("%s window %d: the decode query's output differs inside a batch", quant_type_name(t),
                 (int)ap->window);
    double max_abs = 0.0, lim = t == QUANT_F32 ? 1e-5 : 4e-3;
    for (int i = 0; i < nq; i++) {
        naive_attention_ex(&f, 0, qs[i].seq == f.seq[0] ? 0 : 1, qs[i].pos, q + i * w, ref, ap);
        for (size_t e = 0; e < w; e++) {
            double d = fabs((double)batch[i * w + e] - ref[e]);
            max_abs = d > max_abs ? d : max_abs;
        }
    }
    if (max_abs > lim)
        fail_msg("%s window %d softcap %g sinks %d: max error %g > %g", quant_type_name(t), (int)ap->window,
                 (double)ap->softcap, ap->sinks != NULL, max_abs, lim);
    free(q);
    free(alone);
    free(got);
    free(batch);
    free(ref);
    kv_free(kv);
    free_fixture(&f);
}

static void test_split_segments_same_bits(void **state)
{
    (void)state;
    threads_pool *pools[4] = {NULL};
    for (int i = 1; i < 4; i++)
        assert_int_equal(threads_create(i, &pools[i]), KS_OK);
    float sinks[4] = {0.5f, -1.0f, 2.0f, 0.0f};
    const struct attn_params params[] = {
        {.scale = 0.125f},
        {.scale = 0.125f, .window = 600}, /* starts inside the second segment */
        {.scale = 0.125f, .window = 40},  /* inside one segment */
        {.scale = 0.3f, .softcap = 5.0f, .sinks = sinks},
    };
    const enum quant_type types[] = {QUANT_F32, QUANT_F16};
    for (int ti = 0; ti < 2; ti++)
        for (int pi = 0; pi < 4; pi++)
            for (int sm = 0; sm < 2; sm++)
                split_case(types[ti], sm ? KV_SMOOTH_KV : KV_SMOOTH_OFF, &params[pi], pools);
    for (int i = 1; i < 4; i++)
        threads_free(pools[i]);
}

static void test_bad_params(void **state)
{
    (void)state;
    struct fixture f = {.n_layer = 1, .n_kv = 2, .n_head = 4, .dim = 64, .P = 16};
    int32_t lens[1] = {4};
    struct kv_cache *kv = make_cache(&f, QUANT_F32, QUANT_F32, true, lens, 1);
    float q[4 * 64] = {0}, out[4 * 64];
    struct attn_query qs[1] = {{f.seq[0], 3}};
    struct attn_params neg_window = {.scale = 1.0f, .window = -1}, neg_cap = {.scale = 1.0f, .softcap = -2.0f};
    assert_int_equal(attn_forward_ex(NULL, kv, 0, qs, 1, q, out, 4, &neg_window), KS_ERR_INVALID_ARG);
    assert_int_equal(attn_forward_ex(NULL, kv, 0, qs, 1, q, out, 4, &neg_cap), KS_ERR_INVALID_ARG);
    kv_free(kv);
    free_fixture(&f);
}

static void test_simd_matches_scalar(void **state)
{
    (void)state;
    simd_matches_scalar(64, 8, 2);
    simd_matches_scalar(96, 6, 2);
    simd_matches_scalar(256, 8, 2);
}

/* The query's int8 copy rounds like ggml's quantize_row_q8_0 (roundf, halves
 * away from zero) against the f16-rounded scale. */
static void test_quantize_q8_rounding(void **state)
{
    (void)state;
    float x[64];
    block_q8_0 y[2];
    float yd[2];
    for (int trial = 0; trial < 200; trial++) {
        for (int i = 0; i < 64; i++)
            x[i] = frand() * (trial % 3 ? 1.0f : 1e-3f);
        if (trial == 0) { /* scale exactly 1: every x.5 is a tie */
            for (int i = 0; i < 32; i++)
                x[i] = (float)(i - 16) + 0.5f;
            x[5] = 127.0f;
        }
        attn_quantize_q8(x, y, yd, 64);
        for (int b = 0; b < 2; b++)
            for (int i = 0; i < 32; i++) {
                float id = yd[b] != 0.0f ? 1.0f / yd[b] : 0.0f, v = roundf(x[b * 32 + i] * id);
                int want = (int)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
                if (y[b].qs[i] != want)
                    fail_msg("trial %d block %d element %d: %g quantized to %d, roundf gives %d", trial, b, i,
                             x[b * 32 + i], y[b].qs[i], want);
            }
    }
}

/* Outlier channels in K: rotation must lower the q4_0 error. */
static void test_rotation_lowers_q4_0_error(void **state)
{
    (void)state;
    int32_t lens[1] = {200};
    double err[2];
    for (int rot = 0; rot < 2; rot++) {
        rng = 12345;
        struct fixture f = {.n_layer = 1, .n_kv = 2, .n_head = 4, .dim = 64, .P = 32};
        struct kv_cache *kv = make_cache(&f, QUANT_Q4_0, QUANT_F16, rot, lens, 1);
        err[rot] = run_case(&f, kv, NULL, 0).rms;
        kv_free(kv);
        free_fixture(&f);
    }
    if (!(err[1] < 0.7 * err[0]))
        fail_msg("q4_0 K rms error with rotation %g, without %g", err[1], err[0]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_f32_f16_small_head),
        cmocka_unit_test(test_all_types_scalar),
        cmocka_unit_test(test_all_types_simd_threads),
        cmocka_unit_test(test_mixed_precision_pages),
        cmocka_unit_test(test_simd_matches_scalar),
        cmocka_unit_test(test_window_softcap_sinks),
        cmocka_unit_test(test_split_segments_same_bits),
        cmocka_unit_test(test_bad_params),
        cmocka_unit_test(test_quantize_q8_rounding),
        cmocka_unit_test(test_rotation_lowers_q4_0_error),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
