#include "support/deadline.h"

#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <cmocka.h>

struct timespec ks_deadline_in(double seconds)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    long long ns = t.tv_nsec + (long long)(seconds * 1e9);
    t.tv_sec += (time_t)(ns / 1000000000);
    t.tv_nsec = (long)(ns % 1000000000);
    return t;
}

bool ks_deadline_passed(const struct timespec *deadline)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return now.tv_sec > deadline->tv_sec || (now.tv_sec == deadline->tv_sec && now.tv_nsec >= deadline->tv_nsec);
}

void ks_wait_pause(void)
{
    struct timespec t = {0, 500 * 1000};
    nanosleep(&t, NULL);
}

void ks_wait_timed_out(const char *fmt, ...)
{
    char what[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    fail_msg("timed out after %d s waiting for %s", KS_WAIT_SECONDS, what);
    abort(); /* fail_msg does not return; this tells the compiler */
}

void ks_cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, const bool *flag, const char *what)
{
    struct timespec at;
    clock_gettime(CLOCK_REALTIME, &at);
    at.tv_sec += KS_WAIT_SECONDS;
    while (!*flag)
        if (pthread_cond_timedwait(cv, mu, &at) == ETIMEDOUT && !*flag) {
            pthread_mutex_unlock(mu);
            ks_wait_timed_out("%s", what);
        }
}
