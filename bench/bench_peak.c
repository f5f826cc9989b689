/* bench_peak: the machine's int8 dot-product and f32 FMA throughput, the
 * ceiling of every compute-bound pass (prefill, a speculative verification of
 * k drafts, many streams batched).
 *
 *   bench_peak [-t THREADS]          default: all cores
 *
 * Each thread runs 12 independent chains of the widest instruction this build
 * has (AVX-512 VNNI vpdpbusd / AVX-VNNI / AVX2 vpmaddubsw + vpmaddwd for
 * int8; vfmadd on zmm or ymm for f32) from registers, no memory, and prints
 * GMAC/s (multiply-adds per second), median of 7 passes. Quote a
 * compute-bound figure as a share of it, as decode is quoted against
 * bench_membw: the share is what transfers between machines. */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "bench_util.h"
#include "threads/threads.h"

enum { CHAINS = 12, PASSES = 7, MAX_THREADS = 64 };
#define ITERS 20000000L

struct peak_ctx {
    bool int8;
    double rate[MAX_THREADS]; /* per thread: multiply-adds per second over its own run */
    int64_t sink[MAX_THREADS * 8];
};

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define INT8_ISA "avx512-vnni vpdpbusd zmm"
#define INT8_MACS_PER_OP 64
typedef __m512i ivec;
static inline ivec int8_op(ivec acc, ivec a, ivec b) { return _mm512_dpbusd_epi32(acc, a, b); }
static inline ivec ivec_set(int v) { return _mm512_set1_epi32(v); }
static inline int64_t ivec_fold(ivec v) { return _mm512_reduce_add_epi32(v); }
#elif defined(__AVXVNNI__)
#define INT8_ISA "avx-vnni vpdpbusd ymm"
#define INT8_MACS_PER_OP 32
typedef __m256i ivec;
static inline ivec int8_op(ivec acc, ivec a, ivec b) { return _mm256_dpbusd_avx_epi32(acc, a, b); }
#elif defined(__AVX2__)
#define INT8_ISA "avx2 vpmaddubsw + vpmaddwd + vpaddd ymm"
#define INT8_MACS_PER_OP 32
typedef __m256i ivec;
static inline ivec int8_op(ivec acc, ivec a, ivec b)
{
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
}
#endif
#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512F__))
static inline ivec ivec_set(int v) { return _mm256_set1_epi32(v); }
static inline int64_t ivec_fold(ivec v)
{
    int32_t l[8];
    _mm256_storeu_si256((__m256i *)l, v);
    int64_t s = 0;
    for (int i = 0; i < 8; i++)
        s += l[i];
    return s;
}
#endif

#if defined(__AVX512F__)
#define FMA_ISA "avx512 vfmadd zmm"
#define F32_MACS_PER_OP 16
typedef __m512 fvec;
static inline fvec fvec_set(float v) { return _mm512_set1_ps(v); }
static inline fvec fma_op(fvec acc, fvec a, fvec b) { return _mm512_fmadd_ps(acc, a, b); }
static inline double fvec_fold(fvec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define FMA_ISA "avx2 vfmadd ymm"
#define F32_MACS_PER_OP 8
typedef __m256 fvec;
static inline fvec fvec_set(float v) { return _mm256_set1_ps(v); }
static inline fvec fma_op(fvec acc, fvec a, fvec b) { return _mm256_fmadd_ps(acc, a, b); }
static inline double fvec_fold(fvec v)
{
    float l[8];
    _mm256_storeu_ps(l, v);
    double s = 0;
    for (int i = 0; i < 8; i++)
        s += l[i];
    return s;
}
#endif

/* CHAINS independent accumulators through op; the asm barrier keeps one
 * operand opaque, so the chains are not folded or hoisted out of the loop. */
#define CHAINS_FN(name, vec, set, op, fold, a0, b0)           \
    static int64_t name(void)                                 \
    {                                                         \
        vec acc[CHAINS], a = set(a0), b = set(b0);            \
        for (int i = 0; i < CHAINS; i++)                      \
            acc[i] = set(i);                                  \
        for (long n = 0; n < ITERS / CHAINS; n++) {           \
            _Pragma("GCC unroll 12") for (int i = 0; i < CHAINS; i++) acc[i] = op(acc[i], a, b); \
            __asm__ volatile("" : "+v"(a));                   \
        }                                                     \
        double s = 0;                                         \
        for (int i = 0; i < CHAINS; i++)                      \
            s += (double)fold(acc[i]);                        \
        return (int64_t)s;                                    \
    }

#if defined(INT8_ISA)
CHAINS_FN(int8_chains, ivec, ivec_set, int8_op, ivec_fold, 0x01020304, 0x05060708)
#endif
#if defined(FMA_ISA)
CHAINS_FN(fma_chains, fvec, fvec_set, fma_op, fvec_fold, 0.999999f, 1e-7f)
#endif

#if defined(INT8_ISA) || defined(FMA_ISA)
static void peak_task(void *vctx, int ith, int nth)
{
    struct peak_ctx *c = vctx;
    (void)nth;
    double ops = (double)(ITERS / CHAINS * CHAINS), macs = 0, t0 = bench_seconds(CLOCK_MONOTONIC);
#if defined(INT8_ISA)
    if (c->int8) {
        c->sink[ith * 8] += int8_chains();
        macs = ops * INT8_MACS_PER_OP;
    }
#endif
#if defined(FMA_ISA)
    if (!c->int8) {
        c->sink[ith * 8] += fma_chains();
        macs = ops * F32_MACS_PER_OP;
    }
#endif
    c->rate[ith] = macs / (bench_seconds(CLOCK_MONOTONIC) - t0);
}

/* Median over PASSES runs of the sum of the threads' rates, each timed over
 * its own run (a thread woken late does not count against the others). */
static double measure(threads_pool *pool, int n_threads, bool int8, int64_t *check)
{
    static struct peak_ctx c;
    double rate[PASSES];
    c.int8 = int8;
    for (int r = 0; r < PASSES; r++) {
        threads_run(pool, peak_task, &c);
        rate[r] = 0;
        for (int i = 0; i < n_threads; i++)
            rate[r] += c.rate[i] / 1e9;
    }
    for (int i = 0; i < n_threads; i++)
        *check += c.sink[i * 8];
    return bench_median(rate, PASSES);
}

#endif

int main(int argc, char **argv)
{
#if !defined(INT8_ISA) && !defined(FMA_ISA)
    (void)argc, (void)argv;
    printf("bench_peak: no SIMD in this build (a portable build has no -march=native); build with the default flags\n");
    return 0;
#else
    int n_threads = threads_default_count();
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-t") && i + 1 < argc)
            n_threads = atoi(argv[++i]);
        else
            n_threads = 0;
    }
    if (n_threads < 1 || n_threads > MAX_THREADS) {
        fprintf(stderr, "usage: bench_peak [-t THREADS]   (1..%d)\n", MAX_THREADS);
        return 2;
    }
    threads_pool *pool;
    if (threads_create(n_threads, &pool) != KS_OK) {
        fprintf(stderr, "bench_peak: cannot start %d threads\n", n_threads);
        return 1;
    }
    int64_t check = 0;
#if defined(INT8_ISA)
    printf("int8 dot: %.1f GMAC/s (threads %d, %s)\n", measure(pool, n_threads, true, &check), n_threads, INT8_ISA);
#else
    printf("int8 dot: no SIMD in this build\n");
#endif
#if defined(FMA_ISA)
    printf("f32 fma:  %.1f GMAC/s (threads %d, %s)\n", measure(pool, n_threads, false, &check), n_threads, FMA_ISA);
#else
    printf("f32 fma:  no SIMD in this build\n");
#endif
    printf("(checksum %lld)\n", (long long)check);
    threads_free(pool);
    return 0;
#endif
}
