/* Deadlines for tests that wait on another thread (the scheduler, a server, a
 * client): a broken scheduler fails its test within KS_WAIT_SECONDS with a
 * message naming what it waited for, instead of hanging until ctest's timeout.
 * The deadline guards against hangs only; no test passes or fails on speed.
 *
 *   KS_WAIT_UNTIL(n_tokens(r) >= 5, "request %d to produce 5 tokens", i);
 *   ks_cond_wait_until(&r->cv, &r->mu, &r->done, "request to finish");
 */
#ifndef KS_TEST_DEADLINE_H
#define KS_TEST_DEADLINE_H

#include <pthread.h>
#include <stdbool.h>
#include <time.h>

/* Generous: ASan and TSan builds on a loaded 2-core machine are ~20x slower. */
#ifndef KS_WAIT_SECONDS
#define KS_WAIT_SECONDS 30
#endif

/* A CLOCK_MONOTONIC deadline this many seconds from now. */
struct timespec ks_deadline_in(double seconds);
bool ks_deadline_passed(const struct timespec *deadline);

/* Re-evaluate cond every 0.5 ms until it holds; after KS_WAIT_SECONDS fail
 * the calling test with "timed out after 30 s waiting for <what>". */
#define KS_WAIT_UNTIL(cond, ...)                                                                                  \
    do {                                                                                                          \
        struct timespec ks_wait_deadline_ = ks_deadline_in(KS_WAIT_SECONDS);                                      \
        while (!(cond)) {                                                                                         \
            if (ks_deadline_passed(&ks_wait_deadline_))                                                           \
                ks_wait_timed_out(__VA_ARGS__);                                                                   \
            ks_wait_pause();                                                                                      \
        }                                                                                                         \
    } while (0)

/* With mu held: wait on cv until *flag is true, failing the calling test
 * (with mu unlocked) after KS_WAIT_SECONDS. cv must use the default clock
 * (CLOCK_REALTIME), as pthread_cond_init(cv, NULL) gives. */
void ks_cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, const bool *flag, const char *what);

void ks_wait_pause(void);
_Noreturn void ks_wait_timed_out(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
