#include "support/model_server.h"

#include <stdio.h>
#include <unistd.h>

#include "gguf/gguf.h"
#include "kv/kv.h"
#include "model/model.h"
#include "sched/sched.h"
#include "server/server.h"
#include "threads/threads.h"
#include "tokenizer/tokenizer.h"

int model_server_load(const char *path, struct model_server *ms)
{
    if (model_load(path, &ms->model) || gguf_open(path, &ms->f) || tok_load(ms->f, &ms->tok) ||
        threads_create(2, &ms->pool)) {
        fprintf(stderr, "model_server: %s: %s\n", path, ks_errmsg());
        return -1;
    }
    return 0;
}

void model_server_unload(struct model_server *ms)
{
    threads_free(ms->pool);
    tok_free(ms->tok);
    gguf_close(ms->f);
    model_free(ms->model);
}

int model_server_start(const struct model_server_config *mc, struct sched **sched, struct server **srv)
{
    struct kv_config kc;
    model_kv_config(mc->model, &kc);
    kc.mem_budget = mc->kv_budget;
    struct sched_engine eng;
    if (sched_engine_model(mc->model, &kc, 512, mc->pool, &eng)) {
        fprintf(stderr, "model_server: engine: %s\n", ks_errmsg());
        return -1;
    }
    struct sched_config sc;
    sched_config_default(&sc);
    int32_t eog[16];
    int n_eog = 0;
    for (int32_t id = 0; id < tok_n_vocab(mc->tok) && n_eog < 16; id++)
        if (tok_is_eog(mc->tok, id))
            eog[n_eog++] = id;
    sc.eog = eog;
    sc.n_eog = n_eog;
    sc.parallel = mc->parallel;
    sc.ctx_size = mc->ctx_size;
    sc.spec_type = (enum spec_type)mc->spec_type;
    sc.draft_min = mc->draft_min;
    if (sched_create(&sc, &eng, sched)) {
        fprintf(stderr, "model_server: scheduler: %s\n", ks_errmsg());
        eng.destroy(eng.ctx);
        return -1;
    }
    struct server_config cfg;
    server_config_default(&cfg);
    cfg.port = 0;
    cfg.ctx_size = mc->ctx_size;
    cfg.model_name = "default";
    cfg.chat_template_jinja = mc->chat_template_jinja;
    if (server_start(&cfg, *sched, mc->tok, srv)) {
        fprintf(stderr, "model_server: server: %s\n", ks_errmsg());
        sched_free(*sched);
        return -1;
    }
    server_set_ready(*srv, true);
    return 0;
}

void model_server_stop(struct sched *sched, struct server *srv)
{
    sched_cancel_all(sched);
    while (server_in_flight(srv) > 0)
        usleep(1000);
    server_stop(srv);
    sched_free(sched);
}
