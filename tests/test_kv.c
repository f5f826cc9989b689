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
    const uint8_t *rows = kv_page_rows(kv, is_k ? pg->k : pg->v, t, layer, head);
    kv_row_load(t, rows + (size_t)(pos % c->page_tokens) * kv_row_bytes(t, c->head_dim), out, c->head_dim);
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

static void test_rotation_is_orthonormal(void **state)
{
    (void)state;
    int dims[] = {8, 32, 64, 96, 128};
    for (size_t d = 0; d < sizeof dims / sizeof dims[0]; d++) {
        float x[128], y[128], z[128];
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

static void test_fork_copy_on_write(void **state)
{
    (void)state;
    struct kv_config cfg;
    base_config(&cfg, 64, 1 << 22);
    size_t page = kv_page_bytes(&cfg, QUANT_F16, QUANT_F16);
    struct kv_cache *kv;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    int32_t a, b;
    assert_int_equal(kv_seq_create(kv, &a), KS_OK);
    assert_int_equal(kv_seq_grow(kv, a, 40), KS_OK);
    fill(kv, a, 0, 40);
    assert_int_equal(kv_seq_fork(kv, a, &b), KS_OK);
    struct kv_usage u;
    kv_usage(kv, &u);
    assert_int_equal(u.used, 2 * page); /* shared, nothing copied */
    assert_int_equal(kv_seq_len(kv, b), 40);
    assert_int_equal(kv->pages[kv->seqs[a].pages[1]].ref, 2);
    float before[64], after[64], mine[64];
    read_row(kv, a, 1, 0, 39, true, before);
    float k[128], v[128];
    for (int i = 0; i < 128; i++)
        k[i] = v[i] = 0.5f;
    assert_int_equal(kv_write(kv, 1, b, 39, k, v), KS_OK); /* copy-on-write of page 1 */
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults_and_page_bytes),
        cmocka_unit_test(test_bad_config),
        cmocka_unit_test(test_grow_truncate_accounting),
        cmocka_unit_test(test_write_rotates_and_roundtrips),
        cmocka_unit_test(test_rotation_is_orthonormal),
        cmocka_unit_test(test_fork_copy_on_write),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
