#include "threads/threads.h"

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdbool.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

/* Waiting is spin, then yield, then sleep, paced by the clock. Spinning
 * bridges the microseconds between two ops of one decode step. A yield every
 * YIELD_EVERY_NS of spinning matters when there are more runnable threads
 * than cores (two servers, a busy desktop): a pure spinner would hold the
 * core the thread it waits for needs, for a whole scheduler slice. Not more
 * often: sched_yield is a system call (1.3 us on a VM with page-table
 * isolation, where a pause is 20 ns), and a waiter inside it sees the event
 * late; at a yield every 64 pauses the waits of a small model's decode step
 * spent half their time in the kernel. After SPIN_NS the waiter sleeps on a
 * futex. */
enum { PAUSES_PER_CLOCK = 32 };
#define YIELD_EVERY_NS 20000
#define SPIN_NS 200000

struct threads_pool {
    int n_threads;
    pthread_t *workers;

    threads_fn fn;
    void *ctx;

    /* The region's calls (one per index) go to whichever thread claims them
     * first: region number << 32 | the next index to hand out. */
    _Atomic uint64_t claim;

    /* Futex words (32-bit, as the kernel wants). */
    atomic_uint generation;    /* the region number, bumped once per region */
    atomic_uint unfinished;    /* calls of the region that have not returned */
    atomic_uint stop;
    atomic_int workers_asleep; /* workers inside futex_wait on generation */
    atomic_int caller_asleep;  /* the caller is in futex_wait on unfinished */

    /* threads_prefetch_idle: the ranges, published by bumping hint_seq
     * (odd while the caller writes them) */
    _Atomic(const char *) hint_p[THREADS_HINT_MAX];
    atomic_size_t hint_n[THREADS_HINT_MAX];
    atomic_int hint_count;
    atomic_uint hint_seq;
    atomic_int next_worker_id; /* workers number themselves 0 .. n_threads - 2 */
};

/* Lines a waiting worker prefetches between two looks at the generation. */
enum { HINT_SLICE_LINES = 32 };

static int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void futex_wait(atomic_uint *word, unsigned expected)
{
    /* Returns at once if *word != expected; spurious wake-ups are fine,
     * every caller re-checks its condition. */
    syscall(SYS_futex, (unsigned *)word, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake_all(atomic_uint *word)
{
    syscall(SYS_futex, (unsigned *)word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

/* A worker's progress through the current hint. */
struct hint_cursor {
    int worker;     /* 0 .. n_threads - 2: its share of the lines */
    unsigned seq;   /* the hint it is on (0: none yet) */
    bool done;
    int range;      /* where it stopped: range, line from its share's start */
    int64_t line;
};

/* Prefetch the worker's share of each range's lines, a slice at a time,
 * until region `seen` is over: a region that starts meanwhile (say the
 * attention before the hinted matrix) only pauses it, the next wait resumes
 * it. A new hint starts over. */
static void prefetch_hint(threads_pool *p, struct hint_cursor *cur, unsigned seen)
{
    unsigned seq = atomic_load_explicit(&p->hint_seq, memory_order_acquire);
    if (seq & 1)
        return;
    if (seq != cur->seq)
        *cur = (struct hint_cursor){.worker = cur->worker, .seq = seq};
    int n_workers = p->n_threads - 1, n_ranges = atomic_load_explicit(&p->hint_count, memory_order_relaxed);
    for (; !cur->done && cur->range < n_ranges && cur->range < THREADS_HINT_MAX; cur->range++, cur->line = 0) {
        const char *base = atomic_load_explicit(&p->hint_p[cur->range], memory_order_relaxed);
        size_t lines = (atomic_load_explicit(&p->hint_n[cur->range], memory_order_relaxed) + 63) / 64;
        int64_t lo, hi;
        threads_split((int64_t)lines, cur->worker, n_workers, &lo, &hi);
        for (; lo + cur->line < hi; cur->line += HINT_SLICE_LINES) {
            if (atomic_load_explicit(&p->generation, memory_order_relaxed) != seen ||
                atomic_load_explicit(&p->hint_seq, memory_order_relaxed) != seq)
                return;
            for (int64_t k = lo + cur->line; k < hi && k < lo + cur->line + HINT_SLICE_LINES; k++)
                __builtin_prefetch(base + k * 64, 0, 2); /* into L2, as the matmul kernels' own */
        }
    }
    cur->done = true;
}

/* Spin (yielding now and then) until *word != value; false on timeout. A
 * waiting worker passes its hint cursor (cur, else NULL) to prefetch the
 * current hint meanwhile; *word is then the generation, value the one seen. */
static bool spin_until_changed(atomic_uint *word, unsigned value, threads_pool *p, struct hint_cursor *cur)
{
    int64_t start = now_ns(), last_yield = start;
    for (;;) {
        for (int i = 0; i < PAUSES_PER_CLOCK; i++) {
            if (atomic_load_explicit(word, memory_order_acquire) != value)
                return true;
            if (cur && (atomic_load_explicit(&p->hint_seq, memory_order_relaxed) != cur->seq || !cur->done))
                prefetch_hint(p, cur, value);
            cpu_relax();
        }
        int64_t t = now_ns();
        if (t - start >= SPIN_NS)
            return false;
        if (t - last_yield >= YIELD_EVERY_NS) {
            sched_yield();
            last_yield = now_ns();
        }
    }
}

static unsigned wait_for_generation(threads_pool *p, unsigned seen, struct hint_cursor *cur)
{
    if (!spin_until_changed(&p->generation, seen, p, cur)) {
        /* seq_cst pairs with threads_run: it bumps generation, then reads
         * workers_asleep; either it sees us or futex_wait sees the bump. */
        atomic_fetch_add(&p->workers_asleep, 1);
        while (atomic_load(&p->generation) == seen)
            futex_wait(&p->generation, seen);
        atomic_fetch_sub(&p->workers_asleep, 1);
    }
    return atomic_load_explicit(&p->generation, memory_order_acquire);
}

/* The next index of region gen, or -1 when all are taken or the region is over. */
static int claim_call(threads_pool *p, unsigned gen)
{
    uint64_t c = atomic_load_explicit(&p->claim, memory_order_acquire);
    for (;;) {
        if ((unsigned)(c >> 32) != gen || (uint32_t)c >= (uint32_t)p->n_threads)
            return -1;
        if (atomic_compare_exchange_weak_explicit(&p->claim, &c, c + 1, memory_order_acq_rel, memory_order_acquire))
            return (int)(uint32_t)c;
    }
}

/* fn and ctx are read after the claim: the region cannot end, and the caller
 * cannot replace them, before this call returns. */
static void run_call(threads_pool *p, int ith)
{
    p->fn(p->ctx, ith, p->n_threads);
    /* The last call out wakes a sleeping caller (seq_cst, see finish_region:
     * it publishes caller_asleep before re-reading). */
    if (atomic_fetch_sub(&p->unfinished, 1) == 1 && atomic_load(&p->caller_asleep))
        futex_wake_all(&p->unfinished);
}

/* Wait for the region's calls to return. The spin budget restarts whenever
 * one returns. A call that no worker has taken when the budget runs out is
 * run here: a worker the OS has descheduled (another program on its core)
 * would otherwise hold every region for a scheduler slice. Taking it only
 * then keeps a worker that is merely a little late from losing its share. */
static void finish_region(threads_pool *p, unsigned gen)
{
    unsigned left;
    while ((left = atomic_load_explicit(&p->unfinished, memory_order_acquire)) != 0) {
        if (spin_until_changed(&p->unfinished, left, p, NULL))
            continue;
        int ith = claim_call(p, gen);
        if (ith < 0)
            break;
        run_call(p, ith);
    }
    if (atomic_load(&p->unfinished) == 0)
        return;
    atomic_store(&p->caller_asleep, 1);
    while ((left = atomic_load(&p->unfinished)) != 0)
        futex_wait(&p->unfinished, left);
    atomic_store(&p->caller_asleep, 0);
}

static void *worker_main(void *arg)
{
    threads_pool *p = arg;
    unsigned seen = 0;
    struct hint_cursor cur = {.worker = atomic_fetch_add(&p->next_worker_id, 1), .done = true};
    for (;;) {
        seen = wait_for_generation(p, seen, &cur);
        if (atomic_load(&p->stop))
            return NULL;
        for (int ith; (ith = claim_call(p, seen)) >= 0;)
            run_call(p, ith);
    }
}

ks_status threads_create(int n_threads, threads_pool **out)
{
    *out = NULL;
    if (n_threads < 1 || n_threads > 1024)
        return ks_fail(KS_ERR_INVALID_ARG, "thread count %d is out of range 1..1024", n_threads);
    threads_pool *p = calloc(1, sizeof *p);
    if (!p)
        return ks_fail(KS_ERR_NOMEM, "allocating the thread pool");
    p->n_threads = n_threads;
    p->workers = calloc((size_t)n_threads, sizeof *p->workers);
    if (!p->workers) {
        threads_free(p);
        return ks_fail(KS_ERR_NOMEM, "allocating the thread pool");
    }
    for (int i = 1; i < n_threads; i++) {
        if (pthread_create(&p->workers[i], NULL, worker_main, p) != 0) {
            p->n_threads = i; /* join only the ones that started */
            threads_free(p);
            return ks_fail(KS_ERR_NOMEM, "starting worker thread %d of %d", i, n_threads);
        }
    }
    *out = p;
    return KS_OK;
}

/* Publish a new generation and wake any worker that went to sleep. */
static void start_generation(threads_pool *p)
{
    atomic_fetch_add(&p->generation, 1);
    if (atomic_load(&p->workers_asleep) > 0)
        futex_wake_all(&p->generation);
}

void threads_free(threads_pool *p)
{
    if (!p)
        return;
    atomic_store(&p->stop, 1);
    if (p->workers) {
        start_generation(p);
        for (int i = 1; i < p->n_threads; i++)
            pthread_join(p->workers[i], NULL);
    }
    free(p->workers);
    free(p);
}

int threads_count(const threads_pool *p) { return p ? p->n_threads : 1; }

void threads_prefetch_idle(threads_pool *p, const void *const *ptr, const size_t *n, int n_ranges)
{
    if (!p || p->n_threads == 1)
        return;
    n_ranges = n_ranges < THREADS_HINT_MAX ? n_ranges : THREADS_HINT_MAX;
    atomic_fetch_add_explicit(&p->hint_seq, 1, memory_order_acq_rel); /* odd: being written */
    for (int i = 0; i < n_ranges; i++) {
        atomic_store_explicit(&p->hint_p[i], (const char *)ptr[i], memory_order_relaxed);
        atomic_store_explicit(&p->hint_n[i], n[i], memory_order_relaxed);
    }
    atomic_store_explicit(&p->hint_count, n_ranges, memory_order_relaxed);
    atomic_fetch_add_explicit(&p->hint_seq, 1, memory_order_release);
}

void threads_run(threads_pool *p, threads_fn fn, void *ctx)
{
    if (!p || p->n_threads == 1) {
        fn(ctx, 0, 1);
        return;
    }
    unsigned gen = atomic_load_explicit(&p->generation, memory_order_relaxed) + 1;
    p->fn = fn;
    p->ctx = ctx;
    atomic_store_explicit(&p->unfinished, (unsigned)p->n_threads, memory_order_relaxed);
    atomic_store_explicit(&p->claim, (uint64_t)gen << 32, memory_order_release);
    start_generation(p);
    int ith = claim_call(p, gen); /* one call, whichever index is left */
    if (ith >= 0)
        run_call(p, ith);
    finish_region(p, gen);
}

int threads_default_count(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : (int)n;
}
