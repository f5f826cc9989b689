#include "sched_gate.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <setjmp.h>
#include <cmocka.h>

#include "deadline.h"
#include "sched/sched.h"

static bool wait_at_gate(void *user, struct kv_cache *kv, double budget_s)
{
    (void)kv;
    (void)budget_s;
    struct sched_gate *g = user;
    atomic_store(&g->state, 1);
    struct timespec deadline = ks_deadline_in(KS_WAIT_SECONDS);
    while (atomic_load(&g->state) != 2 && !ks_deadline_passed(&deadline))
        ks_wait_pause();
    return true;
}

static void *run_gate(void *arg)
{
    struct sched_gate *g = arg;
    g->st = sched_run_sliced(g->s, wait_at_gate, g);
    if (g->st)
        snprintf(g->msg, sizeof g->msg, "%s", ks_errmsg()); /* the message is this thread's */
    return NULL;
}

void sched_gate_close(struct sched_gate *g, struct sched *s)
{
    g->s = s;
    g->st = KS_OK;
    g->msg[0] = '\0';
    atomic_init(&g->state, 0);
    assert_int_equal(pthread_create(&g->thread, NULL, run_gate, g), 0);
    KS_WAIT_UNTIL(atomic_load(&g->state) == 1, "the scheduler to reach the gate");
}

void sched_gate_open(struct sched_gate *g)
{
    atomic_store(&g->state, 2);
    assert_int_equal(pthread_join(g->thread, NULL), 0);
    if (g->st)
        fail_msg("the scheduler's gate: %s", g->msg);
}
