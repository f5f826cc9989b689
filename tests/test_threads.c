/* The thread pool runs each region exactly once per thread index, makes the
 * workers' writes visible when it returns, and starts and stops cleanly many
 * times over. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdatomic.h>
#include <stdint.h>
#include <cmocka.h>

#include "threads/threads.h"

enum { MAX_THREADS = 8, REGIONS = 2000 };

struct region_ctx {
    atomic_int calls[MAX_THREADS];
    int nth_seen[MAX_THREADS]; /* one slot per index: no two threads write one */
};

static void count_call(void *p, int ith, int nth)
{
    struct region_ctx *c = p;
    atomic_fetch_add(&c->calls[ith], 1);
    c->nth_seen[ith] = nth;
}

static void each_index_runs_once_per_region(void **state)
{
    (void)state;
    for (int n = 1; n <= 4; n++) {
        threads_pool *pool;
        assert_int_equal(threads_create(n, &pool), KS_OK);
        assert_int_equal(threads_count(pool), n);
        struct region_ctx c = {0};
        for (int r = 0; r < REGIONS; r++)
            threads_run(pool, count_call, &c);
        for (int i = 0; i < n; i++) {
            assert_int_equal(atomic_load(&c.calls[i]), REGIONS);
            assert_int_equal(c.nth_seen[i], n);
        }
        for (int i = n; i < MAX_THREADS; i++)
            assert_int_equal(atomic_load(&c.calls[i]), 0);
        threads_free(pool);
    }
}

struct sum_ctx {
    const int64_t *v;
    int64_t n;
    int64_t partial[MAX_THREADS];
};

static void sum_share(void *p, int ith, int nth)
{
    struct sum_ctx *c = p;
    int64_t lo, hi, s = 0;
    threads_split(c->n, ith, nth, &lo, &hi);
    for (int64_t i = lo; i < hi; i++)
        s += c->v[i];
    c->partial[ith] = s;
}

/* Results written by workers are visible to the caller when run returns. */
static void results_visible_after_region(void **state)
{
    (void)state;
    enum { N = 100003 };
    static int64_t v[N];
    int64_t want = 0;
    for (int64_t i = 0; i < N; i++) {
        v[i] = i * 7 % 13;
        want += v[i];
    }
    threads_pool *pool;
    assert_int_equal(threads_create(3, &pool), KS_OK);
    for (int r = 0; r < 200; r++) {
        struct sum_ctx c = {.v = v, .n = N};
        threads_run(pool, sum_share, &c);
        int64_t got = 0;
        for (int i = 0; i < 3; i++)
            got += c.partial[i];
        assert_int_equal(got, want);
    }
    threads_free(pool);
}

static void split_covers_range(void **state)
{
    (void)state;
    for (int64_t n = 0; n < 50; n++)
        for (int nth = 1; nth <= 7; nth++) {
            int64_t next = 0;
            for (int i = 0; i < nth; i++) {
                int64_t lo, hi;
                threads_split(n, i, nth, &lo, &hi);
                assert_int_equal(lo, next);
                assert_true(hi >= lo && hi - lo <= n / nth + 1);
                next = hi;
            }
            assert_int_equal(next, n);
        }
}

static void create_free_repeatedly(void **state)
{
    (void)state;
    for (int i = 0; i < 100; i++) {
        threads_pool *pool;
        assert_int_equal(threads_create(2 + i % 3, &pool), KS_OK);
        struct region_ctx c = {0};
        threads_run(pool, count_call, &c);
        threads_free(pool);
    }
    threads_pool *pool = (threads_pool *)1;
    assert_int_equal(threads_create(0, &pool), KS_ERR_INVALID_ARG);
    assert_null(pool);
    threads_free(NULL);
}

/* Prefetch hints between regions (the workers take them while they wait)
 * change nothing a region computes, however often they are replaced; a pool
 * of 1 thread and a NULL pool ignore them. */
static void prefetch_hints_change_nothing(void **state)
{
    (void)state;
    enum { N = 100003, BUF = 1 << 20 };
    static int64_t v[N];
    static uint8_t buf[BUF];
    int64_t want = 0;
    for (int64_t i = 0; i < N; i++) {
        v[i] = i * 5 % 11;
        want += v[i];
    }
    const void *ptr[THREADS_HINT_MAX + 1] = {buf, buf + 4096, buf + BUF / 2, v, buf + 100};
    size_t len[THREADS_HINT_MAX + 1] = {BUF / 4, 63, BUF / 2, sizeof v, 1};
    threads_prefetch_idle(NULL, ptr, len, 2);
    for (int n = 1; n <= 3; n++) {
        threads_pool *pool;
        assert_int_equal(threads_create(n, &pool), KS_OK);
        for (int r = 0; r < 300; r++) {
            threads_prefetch_idle(pool, ptr + r % 2, len + r % 2, r % (THREADS_HINT_MAX + 2));
            struct sum_ctx c = {.v = v, .n = N};
            threads_run(pool, sum_share, &c);
            int64_t got = 0;
            for (int i = 0; i < n; i++)
                got += c.partial[i];
            assert_int_equal(got, want);
        }
        threads_free(pool);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(each_index_runs_once_per_region),
        cmocka_unit_test(results_visible_after_region),
        cmocka_unit_test(split_covers_range),
        cmocka_unit_test(create_free_repeatedly),
        cmocka_unit_test(prefetch_hints_change_nothing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
