/* bench_threads: the thread pool's cost per parallel region, the overhead
 * every matmul and attention call of a decode step pays.
 *
 *   bench_threads [regions]          default 20000
 *
 * For 1..4 threads it runs empty regions back to back ("empty": pure
 * dispatch + join) and regions of ~20 us of work each ("work", about one
 * small matmul of a decode step), and "work" regions each after ~10 us of
 * the caller's own serial work ("gap": a decode step's norms and
 * single-thread attention between two matmuls, which the workers wait
 * through), and prints us per region, median of 5.
 * Run it beside a CPU hog (e.g. `yes >/dev/null &` twice on a 2-core
 * machine) to see the oversubscribed case. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "bench_util.h"
#include "threads/threads.h"

static void empty_region(void *ctx, int ith, int nth)
{
    (void)ctx, (void)ith, (void)nth;
}

/* About 40 us of single-thread arithmetic, split over nth threads. */
static void work_region(void *ctx, int ith, int nth)
{
    volatile float *sink = ctx;
    int64_t lo, hi;
    threads_split(40000, ith, nth, &lo, &hi);
    float acc = 0;
    for (int64_t i = lo; i < hi; i++)
        acc = acc * 0.999f + (float)i;
    sink[ith * 16] = acc;
}

/* About 10 us of the caller's own arithmetic. */
static void serial_gap(volatile float *sink)
{
    float acc = 0;
    for (int i = 0; i < 8000; i++)
        acc = acc * 0.999f + (float)i;
    sink[0] = acc;
}

static double us_per_region(threads_pool *pool, threads_fn fn, void *ctx, int regions, bool gap)
{
    enum { REPS = 5 };
    double t[REPS];
    for (int r = 0; r < REPS; r++) {
        double t0 = bench_seconds(CLOCK_MONOTONIC);
        for (int i = 0; i < regions; i++) {
            if (gap)
                serial_gap(ctx);
            threads_run(pool, fn, ctx);
        }
        t[r] = (bench_seconds(CLOCK_MONOTONIC) - t0) * 1e6 / regions;
    }
    qsort(t, REPS, sizeof t[0], bench_cmp_double);
    return t[REPS / 2];
}

int main(int argc, char **argv)
{
    int regions = argc > 1 ? atoi(argv[1]) : 20000;
    if (regions < 1) {
        fprintf(stderr, "usage: bench_threads [regions]\n");
        return 2;
    }
    static float sink[4 * 16];
    printf("threads  empty us/region  work us/region  gap+work us/region  (work = 40k dependent FMAs split, gap = 8k "
           "on the caller first)\n");
    for (int n = 1; n <= 4; n++) {
        threads_pool *pool;
        if (threads_create(n, &pool) != KS_OK) {
            fprintf(stderr, "bench_threads: %s\n", ks_errmsg());
            return 1;
        }
        double e = us_per_region(pool, empty_region, NULL, regions, false);
        double w = us_per_region(pool, work_region, sink, regions / 10 + 1, false);
        double g = us_per_region(pool, work_region, sink, regions / 10 + 1, true);
        printf("%7d  %15.2f  %14.2f  %18.2f\n", n, e, w, g);
        threads_free(pool);
    }
    return 0;
}
