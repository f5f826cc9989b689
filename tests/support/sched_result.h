/* One scheduler request's events, gathered for a test: the tokens it
 * produced and what its finish event reported. The sched_request's on_event
 * is sched_result_on_event with user the result.
 *
 *   struct sched_result r;
 *   sched_result_submit_greedy(s, prompt, n, 32, &r);
 *   sched_result_wait(&r);      (fails the test after KS_WAIT_SECONDS)
 */
#ifndef KS_TEST_SCHED_RESULT_H
#define KS_TEST_SCHED_RESULT_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "sched/sched.h"

enum { SCHED_RESULT_MAX_TOKENS = 256 }; /* tokens kept; later ones are counted in no field */

struct sched_result {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done;
    enum sched_finish finish;
    int32_t tokens[SCHED_RESULT_MAX_TOKENS];
    int32_t n;
    /* from the finish event */
    int32_t n_cached, n_prompt, n_drafted, n_accepted;
};

void sched_result_init(struct sched_result *r);
void sched_result_on_event(void *user, const struct sched_event *ev);
/* Until the finish event; the test fails after KS_WAIT_SECONDS. */
void sched_result_wait(struct sched_result *r);
/* A greedy request (temperature 0, end-of-generation ignored) of
 * max_tokens into a fresh r; the test fails when sched_submit does. */
void sched_result_submit_greedy(struct sched *s, const int32_t *prompt, int32_t n, int32_t max_tokens,
                                struct sched_result *r);

#endif
