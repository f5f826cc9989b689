/* Holds a scheduler between two steps, so that every request submitted while
 * the gate is closed is admitted in the same step. A held engine (as
 * mock_engine_hold) does not give that: the scheduler may already have
 * admitted the first request and be waiting inside its forward.
 *
 *   struct sched_gate g;
 *   sched_gate_close(&g, s);    (returns once the scheduler waits at the gate)
 *   ... sched_submit(...) several times ...
 *   sched_gate_open(&g);        (fails the test if the gate's job failed)
 *
 * The gate is a sliced job (sched_run_sliced) that waits; an idle scheduler
 * runs it before it admits anything, and a gate never opened ends after
 * KS_WAIT_SECONDS. */
#ifndef KS_TEST_SCHED_GATE_H
#define KS_TEST_SCHED_GATE_H

#include <pthread.h>
#include <stdatomic.h>

#include "status/status.h"

struct sched;

struct sched_gate {
    struct sched *s;
    pthread_t thread;
    atomic_int state; /* 0 closing, 1 the scheduler waits at the gate, 2 open */
    ks_status st;     /* sched_run_sliced's, and its message */
    char msg[256];
};

void sched_gate_close(struct sched_gate *g, struct sched *s);
void sched_gate_open(struct sched_gate *g);

#endif
