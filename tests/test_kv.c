/* The page pool: byte accounting, page tables, fork and copy-on-write,
 * argument errors, requantization and the dynamic policy. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kv/kv.h"
#include "kv/kv_internal.h"

static void base_config(struct kv_config *cfg, int head_dim, size_t budget)
{
    kv_config_default(cfg);
    cfg->n_layer = 3;
    cfg->n_kv_head = 2;
    cfg->head_dim = head_dim;
    cfg->mem_budget = budget;
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static float frand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((rng >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}

static void fill(struct kv_cache *kv, int32_t seq, int32_t from, int32_t to)
{
    const struct kv_config *c = kv_get_config(kv);
    size_t n = (size_t)c->n_kv_head * c->head_dim;
    float *k = malloc(n * sizeof *k), *v = malloc(n * sizeof *v);
    for (int32_t p = from; p < to; p++)
        for (int l = 0; l < c->n_layer; l++) {
            for (size_t i = 0; i < n; i++) {
                k[i] = frand();
                v[i] = frand();
            }
            assert_int_equal(kv_write(kv, l, seq, p, k, v), KS_OK);
        }
    free(k);
    free(v);
}

static void test_defaults_and_page_bytes(void **state)
{
    (void)state;
    struct kv_config cfg;
    base_config(&cfg, 64, 1 << 20);
    assert_int_equal(cfg.page_tokens, 32);
    assert_int_equal(cfg.type_k, QUANT_F16);
    assert_true(cfg.rotate);
    /* 3 layers x 2 heads x 32 tokens x 64 dims */
    assert_int_equal(kv_page_bytes(&cfg, QUANT_F16, QUANT_F16), 2 * 3 * 2 * 32 * 64 * 2);
    assert_int_equal(kv_page_bytes(&cfg, QUANT_Q8_0, QUANT_Q4_0), 3 * 2 * 32 * (2 * 34 + 2 * 18));
    assert_int_equal(kv_page_bytes(&cfg, QUANT_F32, QUANT_F32), 2 * 3 * 2 * 32 * 64 * 4);
}

static void test_bad_config(void **state)
{
    (void)state;
    struct kv_config cfg;
    struct kv_cache *kv;
    base_config(&cfg, 8, 1 << 20);
    cfg.type_k = QUANT_Q4_0;
    assert_int_equal(kv_create(&cfg, &kv), KS_ERR_INVALID_ARG);
    assert_non_null(strstr(ks_errmsg(), "head_dim"));
    base_config(&cfg, 64, 1 << 20);
    cfg.page_tokens = 48;
    assert_int_equal(kv_create(&cfg, &kv), KS_ERR_INVALID_ARG);
    cfg.page_tokens = 512;
    assert_int_equal(kv_create(&cfg, &kv), KS_ERR_INVALID_ARG);
    base_config(&cfg, 64, 1 << 20);
    cfg.type_v = QUANT_Q4_K;
    assert_int_equal(kv_create(&cfg, &kv), KS_ERR_INVALID_ARG);
    base_config(&cfg, 64, 100);
    assert_int_equal(kv_create(&cfg, &kv), KS_ERR_INVALID_ARG);
}

static void test_grow_truncate_accounting(void **state)
{
    (void)state;
    struct kv_config cfg;
    base_config(&cfg, 64, 1 << 20);
    size_t page = kv_page_bytes(&cfg, QUANT_F16, QUANT_F16);
    cfg.mem_budget = 5 * page + 7;
    struct kv_cache *kv;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    int32_t a, b;
    assert_int_equal(kv_seq_create(kv, &a), KS_OK);
    assert_int_equal(kv_seq_create(kv, &b), KS_OK);
    assert_int_not_equal(a, b);
    assert_int_equal(kv_seq_grow(kv, a, 1), KS_OK);
    struct kv_usage u;
    kv_usage(kv, &u);
    assert_int_equal(u.used, page);
    assert_int_equal(u.free, 4 * page + 7);
    assert_int_equal(kv_seq_grow(kv, a, 31), KS_OK); /* still one page */
    kv_usage(kv, &u);
    assert_int_equal(u.n_pages, 1);
    assert_int_equal(kv_seq_grow(kv, a, 1), KS_OK);
    assert_int_equal(kv_seq_len(kv, a), 33);
    assert_int_equal(kv_seq_grow(kv, b, 96), KS_OK);
    kv_usage(kv, &u);
    assert_int_equal(u.used, 5 * page);
    assert_int_equal(u.pages_k[kv_type_index(QUANT_F16)], 5);
    assert_int_equal(u.tokens_k[kv_type_index(QUANT_F16)], 33 + 96);
    /* all or nothing: 2 more pages do not fit, nothing changes */
    assert_int_equal(kv_seq_grow(kv, a, 64), KS_ERR_KV_FULL);
    assert_int_equal(kv_seq_len(kv, a), 33);
    assert_int_equal(kv_check(kv), KS_OK);
    kv_usage(kv, &u);
    assert_int_equal(u.used, 5 * page);
    fill(kv, a, 0, 33);
    assert_int_equal(kv_write(kv, 0, a, 33, (float[128]){0}, (float[128]){0}), KS_ERR_RANGE);
    assert_int_equal(kv_seq_truncate(kv, b, 40), KS_OK);
    kv_usage(kv, &u);
    assert_int_equal(u.used, 4 * page);
    assert_int_equal(kv_seq_truncate(kv, b, 41), KS_ERR_RANGE);
    kv_seq_free(kv, b);
    kv_usage(kv, &u);
    assert_int_equal(u.used, 2 * page);
    assert_int_equal(u.n_seqs, 1);
    assert_int_equal(kv_seq_grow(kv, 12345, 1), KS_ERR_NOT_FOUND);
    assert_int_equal(kv_check(kv), KS_OK);
    kv_free(kv);
}

static void read_row(const struct kv_cache *kv, int32_t seq, int layer, int head, int32_t pos, bool is_k, float *out)
{
    const struct kv_config *c = kv_get_config(kv);
    const struct kv_page *pg = &kv->pages[kv->seqs[seq].pages[pos / c->page_tokens]];
    enum quant_type t = is_k ? pg->tk : pg->tv;
    const uint8_t *rows = kv_page_rows(kv, pg, !is_k, layer, head);
    quant_traits(t)->to_float(rows + (size_t)(pos % c->page_tokens) * quant_row_size(t, c->head_dim), out, c->head_dim);
}

static void test_write_rotates_and_roundtrips(void **state)
{
    (void)state;
    struct kv_config cfg;
    base_config(&cfg, 64, 1 << 22);
    cfg.type_k = cfg.type_v = QUANT_F32;
    struct kv_cache *kv;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    int32_t s;
    assert_int_equal(kv_seq_create(kv, &s), KS_OK);
    assert_int_equal(kv_seq_grow(kv, s, 40), KS_OK);
    float k[128], v[128], got[64];
    for (int i = 0; i < 128; i++) {
        k[i] = frand();
        v[i] = frand();
    }
    assert_int_equal(kv_write(kv, 2, s, 37, k, v), KS_OK);
    read_row(kv, s, 2, 1, 37, true, got);
    kv_rotate(got, 64); /* the rotation is its own inverse */
    for (int i = 0; i < 64; i++)
        assert_float_equal(got[i], k[64 + i], 1e-6);
    read_row(kv, s, 2, 0, 37, false, got);
    kv_rotate(got, 64);
    for (int i = 0; i < 64; i++)
        assert_float_equal(got[i], v[i], 1e-6);
    kv_free(kv);
}

/* Rows that stress a quantizer: ordinary, large, tiny (scales near the f16
 * subnormals, inverse scales that overflow), zero, exact ties, one outlier
 * per block, f16 overflow. */
static void edge_row(float *x, int n, int kind)
{
    for (int i = 0; i < n; i++) {
        float r = frand();
        switch (kind % 9) {
        case 0: x[i] = r; break;
        case 1: x[i] = r * 1000.0f; break;
        case 2: x[i] = r * 1e-6f; break;
        case 3: x[i] = 0.0f; break;
        case 4: x[i] = (float)(int)(r * 16.0f) * 0.5f; break;
        case 5: x[i] = i % 32 == 0 ? 3.0f : r * 0.01f; break;
        case 6: x[i] = r * 60000.0f; break;
        case 7: x[i] = r * 1e5f; break;
        case 8: x[i] = (float)(i % 32 - 16) / 16.0f; break;
        }
    }
}

/* Layer 0's row of token p (K: kind 0, V: kind 1) of head h in seq's page,
 * and the row's type. */
static const uint8_t *page_row(const struct kv_cache *kv, int32_t seq, int p, int kind, int h, enum quant_type *type)
{
    const struct kv_config *c = kv_get_config(kv);
    const struct kv_page *pg = &kv->pages[kv->seqs[seq].pages[p / c->page_tokens]];
    *type = kind ? pg->tv : pg->tk;
    size_t rb = quant_row_size(*type, c->head_dim);
    return kv_page_rows(kv, pg, kind, 0, h) + (size_t)(p % c->page_tokens) * rb;
}

/* The bytes a page holds are the bytes quant's scalar quantizer makes of the
 * stored row (the reference from_float, or kv_from_float's scale search with
 * cfg.scale_search), for every KV type, with and without the rotation,
 * through kv_write and through kv_requantize (the reference dequantizer, then
 * the quantizer). The prefix cache's SSD tier keeps these bytes, so they must
 * never drift from quant's. stored: (n_tok, K|V, n_kv_head,
 * head_dim) the values each row should hold, after the rotation. */
static void check_page_rows(const struct kv_cache *kv, int32_t seq, const float *stored, int n_tok)
{
    const struct kv_config *c = kv_get_config(kv);
    int d = c->head_dim;
    uint8_t *want = malloc((size_t)d * sizeof(float));
    for (int p = 0; p < n_tok; p++)
        for (int kind = 0; kind < 2; kind++)
            for (int h = 0; h < c->n_kv_head; h++) {
                enum quant_type t;
                const uint8_t *row = page_row(kv, seq, p, kind, h, &t);
                const struct quant_traits *tr = quant_traits_scalar(t);
                quant_from_float_fn quantize = c->scale_search && tr->kv_from_float ? tr->kv_from_float : tr->from_float;
                quantize(stored + (((size_t)p * 2 + kind) * c->n_kv_head + h) * d, want, d);
                if (memcmp(row, want, quant_row_size(t, d)) != 0)
                    fail_msg("head_dim %d rotate %d search %d %s %s: token %d head %d differs from quant's", d,
                             c->rotate, c->scale_search, kind ? "V" : "K", quant_type_name(t), p, h);
            }
    free(want);
}

/* stored = the reference's dequantization of every row (what a requantization
 * starts from). */
static void dequantize_page_rows(const struct kv_cache *kv, int32_t seq, float *stored, int n_tok)
{
    const struct kv_config *c = kv_get_config(kv);
    int d = c->head_dim;
    for (int p = 0; p < n_tok; p++)
        for (int kind = 0; kind < 2; kind++)
            for (int h = 0; h < c->n_kv_head; h++) {
                enum quant_type t;
                const uint8_t *row = page_row(kv, seq, p, kind, h, &t);
                quant_traits_scalar(t)->to_float(row, stored + (((size_t)p * 2 + kind) * c->n_kv_head + h) * d, d);
            }
}

enum { EDGE_TOKENS = 40 };

/* A one-layer cache of head_dim d at (tk, tv), scale search on or off, holding EDGE_TOKENS edge rows;
 * stored gets what each row should hold (after the rotation). */
static struct kv_cache *edge_cache(int d, bool rot, bool search, enum quant_type tk, enum quant_type tv,
                                   int32_t *seq, float **stored)
{
    struct kv_config cfg;
    base_config(&cfg, d, 1 << 24);
    cfg.n_layer = 1;
    cfg.page_tokens = 16;
    cfg.rotate = rot;
    cfg.scale_search = search;
    cfg.type_k = tk;
    cfg.type_v = tv;
    struct kv_cache *kv;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    assert_int_equal(kv_seq_create(kv, seq), KS_OK);
    assert_int_equal(kv_seq_grow(kv, *seq, EDGE_TOKENS), KS_OK);
    size_t per_tok = 2 * (size_t)cfg.n_kv_head * d;
    *stored = malloc((size_t)EDGE_TOKENS * per_tok * sizeof **stored);
    for (int p = 0; p < EDGE_TOKENS; p++) {
        float *k = *stored + (size_t)p * per_tok, *v = k + per_tok / 2;
        for (int h = 0; h < 2 * cfg.n_kv_head; h++)
            edge_row(k + (size_t)h * d, d, p + h);
        assert_int_equal(kv_write(kv, 0, *seq, p, k, v), KS_OK);
        for (int h = 0; rot && h < 2 * cfg.n_kv_head; h++)
            kv_rotate(k + (size_t)h * d, d);
    }
    return kv;
}

static void test_rows_match_quant_reference(void **state)
{
    (void)state;
    const int dims[] = {32, 64, 96, 128, 256};
    const int n_tok = EDGE_TOKENS, N = KV_N_TYPES;
    for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++)
        for (int rot = 0; rot < 4; rot++) /* bit 0: rotation, bit 1: scale search */
            for (int ti = 0; ti < N; ti++) {
                int32_t s;
                float *stored;
                struct kv_cache *kv = edge_cache(dims[di], rot & 1, rot >> 1, kv_type_at(ti), kv_type_at((ti + 1) % N),
                                                 &s, &stored);
                check_page_rows(kv, s, stored, n_tok);
                /* requantize through every type and back */
                struct kv_selector all = {.kind = KV_SELECT_ALL};
                for (int step = 1; step <= N; step++) {
                    dequantize_page_rows(kv, s, stored, n_tok);
                    assert_int_equal(kv_requantize(kv, &all, kv_type_at((ti + step) % N),
                                                   kv_type_at((ti + 2 * step) % N), false, NULL), KS_OK);
                    check_page_rows(kv, s, stored, n_tok);
                }
                assert_int_equal(kv_check(kv), KS_OK);
                free(stored);
                kv_free(kv);
            }
}

/* Every ordered pair of KV types (K from a to b, V from b to a): the pages
 * hold the reference's bytes of the dequantized rows (a == b changes no page)
 * and kv_check stays clean. */
static void test_requantize_every_pair(void **state)
{
    (void)state;
    for (int a = 0; a < KV_N_TYPES; a++)
        for (int b = 0; b < KV_N_TYPES; b++) {
            int32_t s;
            float *stored;
            struct kv_cache *kv = edge_cache(64, true, true, kv_type_at(a), kv_type_at(b), &s, &stored);
            dequantize_page_rows(kv, s, stored, EDGE_TOKENS);
            struct kv_selector all = {.kind = KV_SELECT_ALL};
            struct kv_requant_result r;
            assert_int_equal(kv_requantize(kv, &all, kv_type_at(b), kv_type_at(a), false, &r), KS_OK);
            assert_int_equal(r.bytes_after, kv_page_bytes(kv_get_config(kv), kv_type_at(b), kv_type_at(a)) * 3);
            assert_int_equal(kv_check(kv), KS_OK);
            assert_int_equal(r.pages_changed, a == b ? 0 : 3);
            if (a != b) /* an unchanged page keeps kv_write's bytes */
                check_page_rows(kv, s, stored, EDGE_TOKENS);
            free(stored);
            kv_free(kv);
        }
}

static void test_rotation_is_orthonormal(void **state)
{
    (void)state;
    int dims[] = {8, 32, 64, 96, 128};
    for (size_t d = 0; d < sizeof dims / sizeof dims[0]; d++) {
        float x[128] = {0}, y[128], z[128];
        for (int i = 0; i < dims[d]; i++)
            x[i] = frand();
        memcpy(y, x, sizeof x);
        kv_rotate(y, dims[d]);
        double nx = 0, ny = 0;
        for (int i = 0; i < dims[d]; i++) {
            nx += x[i] * x[i];
            ny += y[i] * y[i];
        }
        assert_float_equal(nx, ny, 1e-4);
        memcpy(z, y, sizeof y);
        kv_rotate(z, dims[d]);
        for (int i = 0; i < dims[d]; i++)
            assert_float_equal(z[i], x[i], 1e-5);
    }
}

/* kv_rotate (SIMD when the build has it) gives its scalar twin's bits, so a
 * SIMD build and the portable one store and query the same rotated rows. */
static void test_rotate_matches_scalar_twin(void **state)
{
    (void)state;
    const int dims[] = {4, 8, 16, 24, 32, 48, 64, 80, 96, 128, 256, 512};
    float x[512], want[512], got[512];
    for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
        int n = dims[di];
        for (int i = 0; i < n; i++)
            x[i] = frand() * (i % 7 == 0 ? 30.0f : 1.0f);
        memcpy(want, x, (size_t)n * sizeof(float));
        kv_rotate_ref(want, n);
        memcpy(got, x, (size_t)n * sizeof(float));
        kv_rotate(got, n);
        if (memcmp(got, want, (size_t)n * sizeof(float)))
            fail_msg("kv_rotate differs from kv_rotate_ref at n = %d", n);
    }
}

/* A cache of cfg with sequence *a holding len random tokens and *b forked
 * from it (sharing every page). */
static struct kv_cache *forked_cache(const struct kv_config *cfg, int32_t len, int32_t *a, int32_t *b)
{
    struct kv_cache *kv;
    assert_int_equal(kv_create(cfg, &kv), KS_OK);
    assert_int_equal(kv_seq_create(kv, a), KS_OK);
    assert_int_equal(kv_seq_grow(kv, *a, len), KS_OK);
    fill(kv, *a, 0, len);
    assert_int_equal(kv_seq_fork(kv, *a, b), KS_OK);
    return kv;
}

/* K and V rows of value at (layer, seq, pos), 2 heads of 64. */
static void write_const(struct kv_cache *kv, int layer, int32_t seq, int32_t pos, float value)
{
    float k[128], v[128];
    for (int i = 0; i < 128; i++)
        k[i] = v[i] = value;
    assert_int_equal(kv_write(kv, layer, seq, pos, k, v), KS_OK);
}

static void test_fork_copy_on_write(void **state)
{
    (void)state;
    struct kv_config cfg;
    base_config(&cfg, 64, 1 << 22);
    size_t page = kv_page_bytes(&cfg, QUANT_F16, QUANT_F16);
    int32_t a, b;
    struct kv_cache *kv = forked_cache(&cfg, 40, &a, &b);
    struct kv_usage u;
    kv_usage(kv, &u);
    assert_int_equal(u.used, 2 * page); /* shared, nothing copied */
    assert_int_equal(kv_seq_len(kv, b), 40);
    assert_int_equal(kv->pages[kv->seqs[a].pages[1]].ref, 2);
    float before[64], after[64], mine[64];
    read_row(kv, a, 1, 0, 39, true, before);
    write_const(kv, 1, b, 39, 0.5f); /* copy-on-write of page 1 */
    kv_usage(kv, &u);
    assert_int_equal(u.used, 3 * page);
    assert_int_not_equal(kv->seqs[a].pages[1], kv->seqs[b].pages[1]);
    assert_int_equal(kv->seqs[a].pages[0], kv->seqs[b].pages[0]);
    read_row(kv, a, 1, 0, 39, true, after);
    assert_memory_equal(before, after, sizeof before);
    read_row(kv, b, 1, 0, 38, true, mine);
    read_row(kv, a, 1, 0, 38, true, after);
    assert_memory_equal(mine, after, sizeof mine); /* the copy kept the other rows */
    assert_int_equal(kv_check(kv), KS_OK);
    kv_seq_free(kv, a);
    kv_usage(kv, &u);
    assert_int_equal(u.used, 2 * page);
    assert_int_equal(kv_check(kv), KS_OK);
    kv_free(kv);
}

/* A copy on write that needs room can make the dynamic policy demote the
 * very page being copied (here: no sinks, no hot window, so every page is
 * demotable): the copy must take the page's types after the demotion, not
 * before (it read a demoted half with the old half's size). */
static void test_copy_on_write_of_a_page_the_policy_demotes(void **state)
{
    (void)state;
    struct kv_config cfg;
    base_config(&cfg, 64, 1);
    size_t f16 = kv_page_bytes(&cfg, QUANT_F16, QUANT_F16);
    cfg.mem_budget = 3 * f16;
    cfg.policy = KV_POLICY_DYNAMIC;
    cfg.sink_tokens = 0;
    cfg.hot_tokens = 0;
    int32_t a, b;
    struct kv_cache *kv = forked_cache(&cfg, 64, &a, &b);
    float theirs[64], mine[64];
    /* 2 pages + the copy cross the high watermark: both shared pages are demoted first */
    write_const(kv, 2, b, 63, 0.25f);
    const struct kv_page *pa = &kv->pages[kv->seqs[a].pages[1]], *pb = &kv->pages[kv->seqs[b].pages[1]];
    assert_int_not_equal(kv->seqs[a].pages[1], kv->seqs[b].pages[1]);
    assert_int_not_equal(pa->tv, QUANT_F16);
    assert_int_equal(pb->tk, pa->tk);
    assert_int_equal(pb->tv, pa->tv);
    read_row(kv, a, 2, 1, 40, false, theirs);
    read_row(kv, b, 2, 1, 40, false, mine);
    assert_memory_equal(mine, theirs, sizeof mine); /* the copy holds the demoted rows */
    assert_int_equal(kv_check(kv), KS_OK);
    kv_free(kv);
}

static struct kv_cache *filled_cache(enum quant_type tk, enum quant_type tv, size_t budget_pages, int32_t *seqs,
                                     const int32_t *lens, int n_seq)
{
    struct kv_config cfg;
    base_config(&cfg, 64, 1);
    cfg.type_k = tk;
    cfg.type_v = tv;
    cfg.mem_budget = budget_pages * kv_page_bytes(&cfg, tk, tv);
    struct kv_cache *kv;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    for (int i = 0; i < n_seq; i++) {
        assert_int_equal(kv_seq_create(kv, &seqs[i]), KS_OK);
        assert_int_equal(kv_seq_grow(kv, seqs[i], lens[i]), KS_OK);
        fill(kv, seqs[i], 0, lens[i]);
    }
    return kv;
}

static void test_requantize_dry_run_and_real(void **state)
{
    (void)state;
    int32_t seqs[2], lens[2] = {100, 50}; /* 4 + 2 pages */
    struct kv_cache *kv = filled_cache(QUANT_F16, QUANT_F16, 16, seqs, lens, 2);
    const struct kv_config *c = kv_get_config(kv);
    size_t f16 = kv_page_bytes(c, QUANT_F16, QUANT_F16), q8q4 = kv_page_bytes(c, QUANT_Q8_0, QUANT_Q4_0);
    float before[64], after[64];
    read_row(kv, seqs[0], 1, 1, 10, true, before);

    struct kv_selector all = {.kind = KV_SELECT_ALL};
    struct kv_requant_result r;
    assert_int_equal(kv_requantize(kv, &all, QUANT_Q8_0, QUANT_Q4_0, true, &r), KS_OK);
    assert_int_equal(r.bytes_before, 6 * f16);
    assert_int_equal(r.bytes_after, 6 * q8q4);
    assert_int_equal(r.pages_changed, 6);
    struct kv_usage u;
    kv_usage(kv, &u);
    assert_int_equal(u.used, 6 * f16); /* a dry run changes nothing */
    assert_int_equal(u.pages_k[kv_type_index(QUANT_F16)], 6);

    struct kv_selector older = {.kind = KV_SELECT_OLDER_THAN, .keep_recent = 40};
    assert_int_equal(kv_requantize(kv, &older, QUANT_Q8_0, KV_TYPE_KEEP, false, &r), KS_OK);
    /* seq 0 (100 tokens): pages ending at <= 60 -> page 0 (32); seq 1 (50): ending <= 10 -> none */
    assert_int_equal(r.pages_changed, 1);
    assert_int_equal(r.bytes_after, 5 * f16 + kv_page_bytes(c, QUANT_Q8_0, QUANT_F16));
    kv_usage(kv, &u);
    assert_int_equal(u.used, r.bytes_after);
    assert_int_equal(u.pages_k[kv_type_index(QUANT_Q8_0)], 1);
    assert_int_equal(u.pages_v[kv_type_index(QUANT_F16)], 6);
    read_row(kv, seqs[0], 1, 1, 10, true, after);
    for (int i = 0; i < 64; i++)
        assert_float_equal(after[i], before[i], 0.02);

    struct kv_selector one = {.kind = KV_SELECT_SEQ, .seq = seqs[1]};
    assert_int_equal(kv_requantize(kv, &one, QUANT_Q4_0, QUANT_Q4_0, false, &r), KS_OK);
    assert_int_equal(r.pages_changed, 2);
    struct kv_seq_usage su;
    assert_int_equal(kv_seq_usage(kv, seqs[1], &su), KS_OK);
    assert_int_equal(su.pages_k[kv_type_index(QUANT_Q4_0)], 2);
    assert_int_equal(su.bytes, 2 * kv_page_bytes(c, QUANT_Q4_0, QUANT_Q4_0));
    /* and back up to f16 */
    assert_int_equal(kv_requantize(kv, &all, QUANT_F16, QUANT_F16, false, &r), KS_OK);
    assert_int_equal(r.bytes_after, 6 * f16);
    read_row(kv, seqs[0], 1, 1, 10, true, after);
    for (int i = 0; i < 64; i++)
        assert_float_equal(after[i], before[i], 0.02);
    assert_int_equal(kv_check(kv), KS_OK);

    struct kv_selector missing = {.kind = KV_SELECT_SEQ, .seq = 999};
    assert_int_equal(kv_requantize(kv, &missing, QUANT_Q8_0, QUANT_Q8_0, false, &r), KS_ERR_NOT_FOUND);
    assert_int_equal(kv_requantize(kv, &all, QUANT_Q4_K, QUANT_Q8_0, false, &r), KS_ERR_INVALID_ARG);
    kv_free(kv);
}

/* A requantization in slices of max_pages (what POST /cache/requantize runs
 * between scheduler steps) stores exactly the bytes of the one-shot one. */
static void test_requantize_in_slices_matches_one_shot(void **state)
{
    (void)state;
    int32_t seqs[2], seqs_b[2], lens[2] = {100, 50}; /* 4 + 2 pages */
    uint64_t seed = rng;
    struct kv_cache *a = filled_cache(QUANT_F16, QUANT_F16, 16, seqs, lens, 2);
    rng = seed; /* the same rows in both */
    struct kv_cache *b = filled_cache(QUANT_F16, QUANT_F16, 16, seqs_b, lens, 2);
    struct kv_selector all = {.kind = KV_SELECT_ALL};
    struct kv_requant_result r;
    assert_int_equal(kv_requantize(a, &all, QUANT_Q4_0, QUANT_Q8_0, false, &r), KS_OK);
    assert_int_equal(r.pages_changed, 6);
    assert_int_equal(r.pages_left, 0);
    struct kv_selector slice = {.kind = KV_SELECT_ALL, .max_pages = 4};
    int calls = 0, converted = 0;
    do {
        assert_int_equal(kv_requantize(b, &slice, QUANT_Q4_0, QUANT_Q8_0, false, &r), KS_OK);
        assert_true(r.pages_changed <= 4);
        converted += r.pages_changed;
        calls++;
    } while (r.pages_left > 0);
    assert_int_equal(calls, 2);
    assert_int_equal(converted, 6);
    const struct kv_config *c = kv_get_config(a);
    for (int i = 0; i < 2; i++)
        for (int32_t p = 0; p < a->seqs[seqs[i]].n_pages; p++) {
            const struct kv_page *pa = &a->pages[a->seqs[seqs[i]].pages[p]];
            const struct kv_page *pb = &b->pages[b->seqs[seqs_b[i]].pages[p]];
            assert_int_equal(pa->tk, pb->tk);
            assert_int_equal(pa->tv, pb->tv);
            for (int is_v = 0; is_v < 2; is_v++)
                for (int l = 0; l < c->n_layer; l++)
                    for (int h = 0; h < c->n_kv_head; h++)
                        assert_memory_equal(kv_page_rows(a, pa, is_v, l, h), kv_page_rows(b, pb, is_v, l, h),
                                            (size_t)c->page_tokens * quant_row_size(is_v ? pa->tv : pa->tk, c->head_dim));
        }
    struct kv_usage ua, ub;
    kv_usage(a, &ua);
    kv_usage(b, &ub);
    assert_int_equal(ua.used, ub.used);
    struct kv_selector bad = {.kind = KV_SELECT_ALL, .max_pages = -1};
    assert_int_equal(kv_requantize(b, &bad, QUANT_Q8_0, KV_TYPE_KEEP, false, &r), KS_ERR_INVALID_ARG);
    kv_free(a);
    kv_free(b);
}

static void test_requantize_failure_leaves_pages(void **state)
{
    (void)state;
    int32_t seqs[1], lens[1] = {128};
    struct kv_cache *kv = filled_cache(QUANT_Q4_0, QUANT_Q4_0, 5, seqs, lens, 1); /* 4 pages used of 5 */
    size_t used = kv->used;
    struct kv_selector all = {.kind = KV_SELECT_ALL};
    struct kv_requant_result r;
    assert_int_equal(kv_requantize(kv, &all, QUANT_F16, QUANT_F16, false, &r), KS_ERR_KV_FULL);
    assert_true(r.bytes_after > kv_get_config(kv)->mem_budget);
    assert_int_equal(kv->used, used);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(kv->pages[kv->seqs[seqs[0]].pages[i]].tk, QUANT_Q4_0);
        assert_int_equal(kv->pages[kv->seqs[seqs[0]].pages[i]].tv, QUANT_Q4_0);
    }
    assert_int_equal(kv_check(kv), KS_OK);
    kv_free(kv);

    /* head_dim 8: quantized types are a clear error */
    struct kv_config cfg;
    base_config(&cfg, 8, 1 << 20);
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    assert_int_equal(kv_requantize(kv, &all, QUANT_Q8_0, KV_TYPE_KEEP, true, &r), KS_ERR_INVALID_ARG);
    assert_non_null(strstr(ks_errmsg(), "head_dim"));
    kv_free(kv);
}

/* Dynamic policy, head_dim 64, one page of sinks, two hot pages, a budget of
 * f16_pages pages at f16. */
static void dynamic_config(struct kv_config *cfg, int f16_pages)
{
    base_config(cfg, 64, 1);
    cfg->policy = KV_POLICY_DYNAMIC;
    cfg->sink_tokens = 32;
    cfg->hot_tokens = 64;
    cfg->mem_budget = (size_t)f16_pages * kv_page_bytes(cfg, QUANT_F16, QUANT_F16);
}

static void test_dynamic_policy_demotes_in_order(void **state)
{
    (void)state;
    struct kv_config cfg;
    dynamic_config(&cfg, 10);
    struct kv_cache *kv;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    int32_t s;
    assert_int_equal(kv_seq_create(kv, &s), KS_OK);
    int32_t len = 0;
    int steps_v_q8 = 0, longest_protected = 0;
    struct kv_usage u;
    /* grow one page at a time until the cache is really full */
    for (;;) {
        ks_status st = kv_seq_grow(kv, s, 32);
        if (st == KS_ERR_KV_FULL)
            break;
        assert_int_equal(st, KS_OK);
        fill(kv, s, len, len + 32);
        len += 32;
        assert_int_equal(kv_check(kv), KS_OK);
        kv_usage(kv, &u);
        assert_true(u.used <= u.budget);
        /* V goes to q8_0 before any K is touched */
        if (u.pages_k[kv_type_index(QUANT_Q8_0)] == 0 && u.pages_v[kv_type_index(QUANT_Q8_0)] > 0)
            steps_v_q8++;
        /* sink page 0 and the 2 hot pages at f16, everything else at the floor */
        int32_t n = len / 32;
        const struct kv_page *pg = kv->pages;
        const int32_t *ids = kv->seqs[s].pages;
        if (n > 3 && pg[ids[0]].tk == QUANT_F16 && pg[ids[n - 1]].tv == QUANT_F16 && pg[ids[n - 2]].tk == QUANT_F16 &&
            u.pages_k[kv_type_index(QUANT_Q4_0)] == n - 3 && u.pages_v[kv_type_index(QUANT_Q4_0)] == n - 3)
            longest_protected = n;
        assert_true(len < 10000);
    }
    assert_true(steps_v_q8 > 0);
    assert_true(longest_protected > 20); /* far more than the 10 pages that fit at f16 */
    kv_usage(kv, &u);
    int32_t n_pages = len / 32;
    /* past that the sinks and hot window gave way: full means every page at the floor */
    assert_true(n_pages > longest_protected);
    assert_int_equal(u.pages_k[kv_type_index(QUANT_Q4_0)], n_pages);
    assert_int_equal(u.pages_v[kv_type_index(QUANT_Q4_0)], n_pages);
    assert_true(u.used + kv_page_bytes(&cfg, QUANT_Q4_0, QUANT_Q4_0) > u.budget);
    assert_true(u.demotions > 0);
    assert_int_equal(kv_seq_len(kv, s), len);
    kv_free(kv);
}

/* The K (k) or V type of page i of seq. */
static enum quant_type page_type(const struct kv_cache *kv, int32_t s, int32_t i, bool k)
{
    const struct kv_page *pg = &kv->pages[kv->seqs[s].pages[i]];
    return k ? pg->tk : pg->tv;
}

/* One batch of 16 pages into an empty dynamic cache that holds 8 at f16: the
 * pages outside the sinks and hot window are created at lower precision (no
 * page is converted), and a budget one byte short of every page at the floor
 * fails without changing anything. */
static void test_dynamic_policy_plans_new_pages(void **state)
{
    (void)state;
    struct kv_config cfg;
    dynamic_config(&cfg, 8);
    size_t f16 = kv_page_bytes(&cfg, QUANT_F16, QUANT_F16), q4 = kv_page_bytes(&cfg, QUANT_Q4_0, QUANT_Q4_0);
    struct kv_cache *kv;
    int32_t s;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    assert_int_equal(kv_seq_create(kv, &s), KS_OK);
    assert_int_equal(kv_seq_grow(kv, s, 16 * 32), KS_OK);
    fill(kv, s, 0, 16 * 32);
    struct kv_usage u;
    kv_usage(kv, &u);
    assert_int_equal(u.demotions, 0);
    assert_true(u.used <= (size_t)(cfg.low_watermark * (float)cfg.mem_budget) + 3 * f16);
    for (int32_t i = 0; i < 16; i++) {
        bool protected = i == 0 || i >= 14;
        assert_int_equal(page_type(kv, s, i, true), protected ? QUANT_F16 : QUANT_Q4_0);
        assert_int_equal(page_type(kv, s, i, false), protected ? QUANT_F16 : QUANT_Q4_0);
    }
    assert_int_equal(kv_check(kv), KS_OK);
    kv_free(kv);

    /* every page at the floor, sinks and hot window included, fits exactly */
    cfg.mem_budget = 16 * q4;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    assert_int_equal(kv_seq_create(kv, &s), KS_OK);
    assert_int_equal(kv_seq_grow(kv, s, 16 * 32), KS_OK);
    kv_usage(kv, &u);
    assert_int_equal(u.used, 16 * q4);
    kv_free(kv);

    cfg.mem_budget = 16 * q4 - 1;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    assert_int_equal(kv_seq_create(kv, &s), KS_OK);
    assert_int_equal(kv_seq_grow(kv, s, 16 * 32), KS_ERR_KV_FULL);
    kv_usage(kv, &u);
    assert_int_equal(u.used, 0);
    assert_int_equal(kv_seq_len(kv, s), 0);
    kv_free(kv);
}

static void test_dynamic_policy_head_dim_8_stays_f16(void **state)
{
    (void)state;
    struct kv_config cfg;
    base_config(&cfg, 8, 1);
    cfg.policy = KV_POLICY_DYNAMIC;
    cfg.mem_budget = 4 * kv_page_bytes(&cfg, QUANT_F16, QUANT_F16);
    struct kv_cache *kv;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    int32_t s;
    assert_int_equal(kv_seq_create(kv, &s), KS_OK);
    assert_int_equal(kv_seq_grow(kv, s, 4 * 32), KS_OK);
    assert_int_equal(kv_seq_grow(kv, s, 1), KS_ERR_KV_FULL);
    struct kv_usage u;
    kv_usage(kv, &u);
    assert_int_equal(u.pages_k[kv_type_index(QUANT_F16)], 4);
    kv_free(kv);
}

static void test_fit(void **state)
{
    (void)state;
    struct kv_config cfg;
    base_config(&cfg, 64, 1);
    size_t f16 = kv_page_bytes(&cfg, QUANT_F16, QUANT_F16);
    cfg.mem_budget = 100 * f16 + 5;
    struct kv_fit fit;
    assert_int_equal(kv_fit_config(&cfg, &fit), KS_OK);
    assert_int_equal(fit.tokens[kv_type_index(QUANT_F16)], 100 * 32);
    assert_int_equal(fit.tokens[kv_type_index(QUANT_F32)], 50 * 32);
    assert_int_equal(fit.tokens[kv_type_index(QUANT_Q8_0)], (int64_t)((100 * f16 + 5) / kv_page_bytes(&cfg, QUANT_Q8_0, QUANT_Q8_0)) * 32);
    assert_int_equal(fit.tokens[kv_type_index(QUANT_Q4_0)], (int64_t)((100 * f16 + 5) / kv_page_bytes(&cfg, QUANT_Q4_0, QUANT_Q4_0)) * 32);
    assert_int_equal(fit.start, 100 * 32);
    assert_true(fit.dynamic > fit.tokens[kv_type_index(QUANT_Q8_0)]);
    assert_true(fit.dynamic < fit.tokens[kv_type_index(QUANT_Q4_0)]);

    cfg.policy = KV_POLICY_DYNAMIC;
    struct kv_cache *kv;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    int32_t s;
    assert_int_equal(kv_seq_create(kv, &s), KS_OK);
    assert_int_equal(kv_seq_grow(kv, s, 32 * 20), KS_OK);
    kv_fit(kv, &fit);
    assert_int_equal(fit.tokens[kv_type_index(QUANT_F16)], 80 * 32);
    /* the dynamic figure counts what demoting the 20 pages would free */
    struct kv_fit empty;
    kv_fit_config(&cfg, &empty);
    assert_true(fit.dynamic > 80 * 32);
    kv_free(kv);
    base_config(&cfg, 8, 1 << 20);
    assert_int_equal(kv_fit_config(&cfg, &fit), KS_OK);
    assert_int_equal(fit.tokens[kv_type_index(QUANT_Q8_0)], -1);
    assert_int_equal(fit.dynamic, fit.start);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults_and_page_bytes),
        cmocka_unit_test(test_bad_config),
        cmocka_unit_test(test_grow_truncate_accounting),
        cmocka_unit_test(test_write_rotates_and_roundtrips),
        cmocka_unit_test(test_rotation_is_orthonormal),
        cmocka_unit_test(test_rotate_matches_scalar_twin),
        cmocka_unit_test(test_rows_match_quant_reference),
        cmocka_unit_test(test_requantize_every_pair),
        cmocka_unit_test(test_fork_copy_on_write),
        cmocka_unit_test(test_copy_on_write_of_a_page_the_policy_demotes),
        cmocka_unit_test(test_requantize_dry_run_and_real),
        cmocka_unit_test(test_requantize_in_slices_matches_one_shot),
        cmocka_unit_test(test_requantize_failure_leaves_pages),
        cmocka_unit_test(test_dynamic_policy_demotes_in_order),
        cmocka_unit_test(test_dynamic_policy_plans_new_pages),
        cmocka_unit_test(test_dynamic_policy_head_dim_8_stays_f16),
        cmocka_unit_test(test_fit),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
