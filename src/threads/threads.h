/* threads: a persistent pthread pool that runs every heavy op (matmul,
 * attention, requantization) as one parallel region at a time.
 *
 * A region is threads_run(pool, fn, ctx): fn(ctx, ith, nth) runs once for each
 * ith in [0, nth) and threads_run returns when all calls have returned. Each
 * call goes to whichever thread claims it first: the caller runs one, then
 * waits, and runs itself any call no worker has started by the end of its
 * spin, so a worker that another program keeps off its core does not hold the
 * region. fn must therefore not depend on which thread runs an index, nor on
 * two indices running at the same time (no barriers inside a region). A pool
 * of 1 thread runs fn inline. Waiters (idle workers, and the caller waiting
 * for the last call) spin briefly, since decode issues hundreds of regions per
 * token, yielding the core every few spins so an oversubscribed machine still
 * makes progress, then sleep on a futex (Linux).
 *
 * A pool is used by one caller thread at a time; regions do not nest. */
#ifndef KS_THREADS_H
#define KS_THREADS_H

#include <stdint.h>

#include "status/status.h"

typedef struct threads_pool threads_pool;
typedef void (*threads_fn)(void *ctx, int ith, int nth);

/* Start n_threads - 1 workers (n_threads >= 1). */
ks_status threads_create(int n_threads, threads_pool **out);

/* Stop and join the workers. NULL is a no-op. */
void threads_free(threads_pool *pool);

int threads_count(const threads_pool *pool);

/* Run fn(ctx, i, n) for i in [0, n) on the pool and wait for all. A NULL pool
 * runs fn(ctx, 0, 1) inline. */
void threads_run(threads_pool *pool, threads_fn fn, void *ctx);

/* Memory the next region will read, for the workers to prefetch while they
 * wait for it: a decode step's serial parts (norms, RoPE, one thread's
 * attention) leave DRAM idle between two matmul regions, and the next
 * matrix's first bytes can come in meanwhile. Up to THREADS_HINT_MAX ranges
 * [p[i], p[i] + n[i]); each waiting worker takes its share of the lines (a
 * prefetch into L2, a slice at a time, checking for the region between
 * slices, so a region never waits on it). Replaces the previous hint; a hint
 * is prefetched once. A pool of 1 thread (or NULL) ignores it. Only a hint:
 * it changes no result. */
#define THREADS_HINT_MAX 4
void threads_prefetch_idle(threads_pool *pool, const void *const *p, const size_t *n, int n_ranges);

/* Number of online CPUs (the default for -t). */
int threads_default_count(void);

/* The half-open share [*lo, *hi) of n items for thread ith of nth. */
static inline void threads_split(int64_t n, int ith, int nth, int64_t *lo, int64_t *hi)
{
    int64_t per = n / nth, rem = n % nth;
    *lo = ith * per + (ith < rem ? ith : rem);
    *hi = *lo + per + (ith < rem ? 1 : 0);
}

#endif
