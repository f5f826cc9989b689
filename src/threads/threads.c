#include "threads/threads.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

/* How long an idle worker spins before sleeping; long enough to bridge the
 * gap between two matmuls of one decode step, short enough not to burn a core
 * while the server is idle. */
enum { SPIN_ITERS = 1 << 16 };

struct threads_pool {
    int n_threads;
    pthread_t *workers;

    pthread_mutex_t mutex;
    pthread_cond_t wake;
    atomic_uint_fast64_t generation;  /* bumped once per region */
    atomic_int pending;               /* workers still inside the region */
    atomic_bool stop;

    threads_fn fn;
    void *ctx;
};

struct worker_arg {
    threads_pool *pool;
    int ith;
};

static uint64_t wait_for_generation(threads_pool *p, uint64_t seen)
{
    for (int i = 0; i < SPIN_ITERS; i++) {
        uint64_t g = atomic_load_explicit(&p->generation, memory_order_acquire);
        if (g != seen || atomic_load_explicit(&p->stop, memory_order_relaxed))
            return g;
        cpu_relax();
    }
    pthread_mutex_lock(&p->mutex);
    uint64_t g;
    while ((g = atomic_load(&p->generation)) == seen && !atomic_load(&p->stop))
        pthread_cond_wait(&p->wake, &p->mutex);
    pthread_mutex_unlock(&p->mutex);
    return g;
}

static void *worker_main(void *argp)
{
    struct worker_arg arg = *(struct worker_arg *)argp;
    free(argp);
    threads_pool *p = arg.pool;
    uint64_t seen = 0;
    for (;;) {
        seen = wait_for_generation(p, seen);
        if (atomic_load(&p->stop))
            return NULL;
        p->fn(p->ctx, arg.ith, p->n_threads);
        atomic_fetch_sub_explicit(&p->pending, 1, memory_order_release);
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
    pthread_mutex_init(&p->mutex, NULL);
    pthread_cond_init(&p->wake, NULL);
    p->workers = calloc((size_t)n_threads, sizeof *p->workers);
    if (!p->workers) {
        threads_free(p);
        return ks_fail(KS_ERR_NOMEM, "allocating the thread pool");
    }
    for (int i = 1; i < n_threads; i++) {
        struct worker_arg *arg = malloc(sizeof *arg);
        if (arg) {
            arg->pool = p;
            arg->ith = i;
        }
        if (!arg || pthread_create(&p->workers[i], NULL, worker_main, arg) != 0) {
            free(arg);
            p->n_threads = i; /* join only the ones that started */
            threads_free(p);
            return ks_fail(KS_ERR_NOMEM, "starting worker thread %d of %d", i, n_threads);
        }
    }
    *out = p;
    return KS_OK;
}

void threads_free(threads_pool *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->mutex);
    atomic_store(&p->stop, true);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mutex);
    for (int i = 1; i < p->n_threads; i++)
        pthread_join(p->workers[i], NULL);
    pthread_cond_destroy(&p->wake);
    pthread_mutex_destroy(&p->mutex);
    free(p->workers);
    free(p);
}

int threads_count(const threads_pool *p) { return p ? p->n_threads : 1; }

void threads_run(threads_pool *p, threads_fn fn, void *ctx)
{
    if (!p || p->n_threads == 1) {
        fn(ctx, 0, 1);
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    atomic_store_explicit(&p->pending, p->n_threads - 1, memory_order_relaxed);
    pthread_mutex_lock(&p->mutex);
    atomic_fetch_add_explicit(&p->generation, 1, memory_order_release);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mutex);

    fn(ctx, 0, p->n_threads);
    while (atomic_load_explicit(&p->pending, memory_order_acquire) != 0)
        cpu_relax();
}

int threads_default_count(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : (int)n;
}
