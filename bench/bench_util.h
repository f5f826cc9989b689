/* Timing helpers every benchmark under bench/ shares: a clock reading in
 * seconds and medians of samples. Header-only: each bench is one program. */
#ifndef KS_BENCH_UTIL_H
#define KS_BENCH_UTIL_H

#include <stdlib.h>
#include <time.h>

/* Seconds on clock c (CLOCK_MONOTONIC for wall time, CLOCK_PROCESS_CPUTIME_ID
 * for CPU time, which a loaded machine distorts less). */
static inline double bench_seconds(clockid_t c)
{
    struct timespec ts;
    clock_gettime(c, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline int bench_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Sorts v (v[0] is then the best sample) and returns the median. */
static inline double bench_median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

#endif
