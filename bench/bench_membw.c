/* bench_membw: the machine's memory read bandwidth, the ceiling of decode.
 *
 *   bench_membw [-t THREADS] [MiB]          default: all cores, 2048 MiB
 *
 * Sums a buffer far larger than the caches with AVX-512/AVX2 loads (or plain
 * C) on the thread pool and prints GB/s, median of 7 passes. The buffer is
 * held as the model loader holds weights (gguf_open_private): 2 MiB aligned,
 * advised for transparent huge pages. A malloc'd buffer, 16 bytes past a page
 * boundary, split every 64-byte load across two cache lines and read 46-49
 * GB/s with AVX-512 where the AVX2 build read 53-61 (AMD EPYC Zen 5, 2
 * threads, side by side). Quote it next to
 * decode GB/s: the ratio of the two is what transfers between machines
 * (../shared/ref/llama-bench.md measured 43 GB/s with 2 threads). */
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <string.h>
#include <time.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "bench_util.h"
#include "threads/threads.h"

struct sum_ctx {
    const float *buf;
    int64_t n;
    float partial[64 * 16];
};

static float sum_range(const float *p, int64_t n)
{
    int64_t i = 0;
    float s = 0;
#if defined(__AVX512F__)
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 64 <= n; i += 64) {
        a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + i));
        a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + i + 16));
        a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + i + 32));
        a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + i + 48));
    }
    s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#elif defined(__AVX2__)
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 32 <= n; i += 32) {
        a0 = _mm256_add_ps(a0, _mm256_loadu_ps(p + i));
        a1 = _mm256_add_ps(a1, _mm256_loadu_ps(p + i + 8));
        a2 = _mm256_add_ps(a2, _mm256_loadu_ps(p + i + 16));
        a3 = _mm256_add_ps(a3, _mm256_loadu_ps(p + i + 24));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (int l = 0; l < 8; l++)
        s += lanes[l];
#endif
    for (; i < n; i++)
        s += p[i];
    return s;
}

static void sum_task(void *vctx, int ith, int nth)
{
    struct sum_ctx *c = vctx;
    int64_t lo, hi;
    threads_split(c->n, ith, nth, &lo, &hi);
    c->partial[ith * 16] = sum_range(c->buf + lo, hi - lo);
}

int main(int argc, char **argv)
{
    int n_threads = threads_default_count();
    long mib = 2048;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-t") && i + 1 < argc)
            n_threads = atoi(argv[++i]);
        else
            mib = atol(argv[i]);
    }
    if (n_threads < 1 || n_threads > 64 || mib < 1) {
        fprintf(stderr, "usage: bench_membw [-t THREADS] [MiB]\n");
        return 2;
    }
    struct sum_ctx c = {.n = (int64_t)mib * 1024 * 1024 / (int64_t)sizeof(float)};
    size_t bytes = (size_t)c.n * sizeof(float), huge = (size_t)2 << 20;
    float *buf = aligned_alloc(huge, (bytes + huge - 1) / huge * huge);
    if (buf)
        (void)madvise(buf, bytes, MADV_HUGEPAGE); /* advice only, as the loader's */
    threads_pool *pool;
    if (!buf || threads_create(n_threads, &pool) != KS_OK) {
        fprintf(stderr, "bench_membw: cannot allocate %ld MiB or start %d threads\n", mib, n_threads);
        return 1;
    }
    for (int64_t i = 0; i < c.n; i++)
        buf[i] = (float)(i & 7);
    c.buf = buf;
    enum { PASSES = 7 };
    double gbs[PASSES], check = 0;
    for (int r = 0; r < PASSES; r++) {
        double t0 = bench_seconds(CLOCK_MONOTONIC);
        threads_run(pool, sum_task, &c);
        gbs[r] = (double)c.n * sizeof(float) / (bench_seconds(CLOCK_MONOTONIC) - t0) / 1e9;
        for (int i = 0; i < n_threads; i++)
            check += c.partial[i * 16];
    }
    qsort(gbs, PASSES, sizeof gbs[0], bench_cmp_double);
    printf("memory read: %.1f GB/s (threads %d, %ld MiB, best %.1f; checksum %g)\n", gbs[PASSES / 2], n_threads,
           mib, gbs[PASSES - 1], check);
    threads_free(pool);
    free(buf);
    return 0;
}
