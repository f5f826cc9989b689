#include "support/sched_result.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include <cmocka.h>

#include "support/deadline.h"

void sched_result_init(struct sched_result *r)
{
    memset(r, 0, sizeof *r);
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
}

void sched_result_on_event(void *user, const struct sched_event *ev)
{
    struct sched_result *r = user;
    pthread_mutex_lock(&r->mu);
    if (ev->finish == SCHED_FINISH_NONE && r->n < SCHED_RESULT_MAX_TOKENS)
        r->tokens[r->n++] = ev->token;
    if (ev->finish != SCHED_FINISH_NONE) {
        r->done = true;
        r->finish = ev->finish;
        r->n_cached = ev->n_cached;
        r->n_prompt = ev->n_prompt;
        r->n_drafted = ev->n_drafted;
        r->n_accepted = ev->n_accepted;
        pthread_cond_signal(&r->cv);
    }
    pthread_mutex_unlock(&r->mu);
}

void sched_result_wait(struct sched_result *r)
{
    pthread_mutex_lock(&r->mu);
    ks_cond_wait_until(&r->cv, &r->mu, &r->done, "a request to finish");
    pthread_mutex_unlock(&r->mu);
}

void sched_result_submit_greedy(struct sched *s, const int32_t *prompt, int32_t n, int32_t max_tokens,
                                struct sched_result *r)
{
    sched_result_init(r);
    struct sched_request rq = {.prompt = prompt, .n_prompt = n, .max_tokens = max_tokens, .ignore_eog = true,
                               .on_event = sched_result_on_event, .user = r};
    sample_params_default(&rq.sampling);
    rq.sampling.temp = 0.0f;
    uint64_t id = 0;
    assert_int_equal(sched_submit(s, &rq, &id), KS_OK);
}
