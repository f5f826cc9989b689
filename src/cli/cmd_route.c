/* kvserve route: the prefix-affinity router in front of kvserve replicas
 * (src/route). It opens the model file for its tokenizer and chat template
 * only (mapped, no weights read) and the fingerprint that names the replicas'
 * KV events stream. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "gguf/gguf.h"
#include "model/model.h"
#include "route/route.h"
#include "store/store.h"
#include "tokenizer/tokenizer.h"

struct route_opts {
    const char *model, *listen, *redis_url, *password_file, *chat_template, *secret_file;
    bool salt_from_key, spm_infill;
    int ctx_size;
    const char *replicas[ROUTE_MAX_REPLICAS];
    int n_replicas;
    float load_weight, shared_page_cost;
    int health_ms, timeout_s;
    size_t max_body;
};

static void route_usage(FILE *out)
{
    fprintf(out,
            "usage: kvserve route --listen HOST:PORT --replica URL [--replica URL ...] -m MODEL.gguf\n"
            "                     [--cache-redis redis://HOST:PORT[/DB]] [options]\n"
            "\n"
            "Send each request to the replica that holds most of its prompt in cache, against its load.\n"
            "The replicas run `kvserve serve --cache-redis URL --kv-events`; their KV events (the chain keys\n"
            "each holds) come from that Redis. Without --cache-redis: the least loaded replica.\n"
            "\n"
            "  -m, --model F              the replicas' model (its tokenizer and chat template are read)\n"
            "      --listen HOST:PORT     address to serve on (default 127.0.0.1:8080)\n"
            "      --replica URL          a replica, http://HOST:PORT as given to its --kv-events-url (1..%d)\n"
            "      --cache-redis URL      the replicas' Redis (KV events); password from\n"
            "                             --cache-redis-password-file F or $KVSERVE_REDIS_PASSWORD\n"
            "      --chat-template NAME   a hand-written chat family, as the replicas' --chat-template\n"
            "  -c, --ctx-size N           the replicas' --ctx-size (their /infill prompts depend on it; default as\n"
            "                             serve's: the model's trained context, at most 4096)\n"
            "      --spm-infill           the replicas run with --spm-infill\n"
            "      --cache-salt-from-key  the replicas run with it: a request's bearer token salts its keys too;\n"
            "                             needs --cache-redis-secret-file F, the replicas' file\n"
            "      --load-weight W        cost of a page in flight on a replica against a page to compute (1)\n"
            "      --shared-page-cost F   cost of a page another replica holds (a fetch from the replicas' Redis)\n"
            "                             against a page to compute, 0 < F <= 1 (0.1; 1: affinity as if no tier)\n"
            "      --health-ms MS         between GET /health checks of the replicas (1000)\n"
            "      --timeout S            idle connection timeout (600)\n"
            "      --max-body BYTES       largest request body (8M)\n"
            "Its own routes: GET /health, GET /route/status. Everything else passes through.\n",
            ROUTE_MAX_REPLICAS);
}

static bool route_flag(const char *a, const char *v, void *opts, bool *ok)
{
    struct route_opts *o = opts;
    if (!strcmp(a, "-m") || !strcmp(a, "--model"))
        *ok = (o->model = v) != NULL;
    else if (!strcmp(a, "--listen"))
        *ok = (o->listen = v) != NULL && strchr(v, ':');
    else if (!strcmp(a, "--replica"))
        *ok = v && o->n_replicas < ROUTE_MAX_REPLICAS && (o->replicas[o->n_replicas++] = v);
    else if (!strcmp(a, "--cache-redis"))
        *ok = (o->redis_url = v) != NULL && *v;
    else if (!strcmp(a, "--cache-redis-password-file"))
        *ok = (o->password_file = v) != NULL && *v;
    else if (!strcmp(a, "--chat-template"))
        *ok = (o->chat_template = v) != NULL;
    else if (!strcmp(a, "--cache-redis-secret-file"))
        *ok = (o->secret_file = v) != NULL && *v;
    else if (!strcmp(a, "-c") || !strcmp(a, "--ctx-size"))
        *ok = cli_parse_int(v, 2, 1 << 24, &o->ctx_size);
    else if (!strcmp(a, "--load-weight"))
        *ok = cli_parse_float(v, 0.0f, 1e6f, &o->load_weight);
    else if (!strcmp(a, "--shared-page-cost"))
        *ok = cli_parse_float(v, 1e-6f, 1.0f, &o->shared_page_cost);
    else if (!strcmp(a, "--health-ms"))
        *ok = cli_parse_int(v, 50, 600000, &o->health_ms);
    else if (!strcmp(a, "--timeout"))
        *ok = cli_parse_int(v, 1, 86400, &o->timeout_s);
    else if (!strcmp(a, "--max-body"))
        *ok = cli_parse_mem(v, &o->max_body);
    else
        return false;
    return true;
}

static bool route_switch(const char *a, void *opts)
{
    struct route_opts *o = opts;
    if (!strcmp(a, "--cache-salt-from-key"))
        return o->salt_from_key = true;
    if (!strcmp(a, "--spm-infill"))
        return o->spm_infill = true;
    return false;
}

/* serve's default --ctx-size: the model's trained context, at most 4096. */
static int32_t default_ctx(const struct gguf_file *f)
{
    struct gguf_str arch;
    char key[96];
    uint32_t n = 0;
    if (gguf_get_str(f, "general.architecture", &arch) == KS_OK && arch.len < 64) {
        snprintf(key, sizeof key, "%.*s.context_length", (int)arch.len, arch.data);
        if (gguf_get_u32(f, key, &n) != KS_OK)
            n = 0;
    }
    return n > 0 && n < 4096 ? (int32_t)n : 4096;
}

/* --cache-salt-from-key: the replicas' tenant key, from their shared secret file. */
static ks_status tenant_key(const struct route_opts *o, struct kv_key *out)
{
    if (!o->salt_from_key)
        return o->secret_file ? ks_fail(KS_ERR_INVALID_ARG, "--cache-redis-secret-file serves --cache-salt-from-key "
                                        "only; give both or neither")
                              : KS_OK;
    if (!o->secret_file)
        return ks_fail(KS_ERR_INVALID_ARG, "--cache-salt-from-key needs --cache-redis-secret-file F, the file the "
                       "replicas are given: their tenants' salts are derived from it");
    struct store_key k;
    ks_status st = store_secret_file_digest(o->secret_file, KV_TENANT_KEY_TAG, sizeof KV_TENANT_KEY_TAG, &k);
    *out = (struct kv_key){k.lo, k.hi};
    return st;
}

static char *read_password(const struct route_opts *o)
{
    const char *env = getenv("KVSERVE_REDIS_PASSWORD");
    if (!o->password_file)
        return env && *env ? strdup(env) : NULL;
    size_t len = 0;
    char *text = cli_read_file(o->password_file, &len);
    if (text)
        text[strcspn(text, "\r\n")] = '\0';
    return text;
}

/* Serve until SIGINT or SIGTERM. */
static int run(struct route_opts *o, struct tokenizer *tok, const struct gguf_file *f)
{
    char host[256];
    const char *colon = strrchr(o->listen, ':');
    snprintf(host, sizeof host, "%.*s", (int)(colon - o->listen), o->listen);
    int port = 0;
    if (!cli_parse_int(colon + 1, 0, 65535, &port)) {
        fprintf(stderr, "kvserve route: --listen %s: the port must be 0..65535\n", o->listen);
        return 2;
    }
    struct route_prompt *rp = NULL;
    struct kv_key tenant = {0, 0};
    ks_status st = tenant_key(o, &tenant);
    if (!st)
        st = route_prompt_create(tok, o->chat_template, o->ctx_size ? o->ctx_size : default_ctx(f), o->spm_infill,
                                 &rp);
    if (st) {
        fprintf(stderr, "kvserve route: %s\n", ks_errmsg());
        return 1;
    }
    char *password = o->redis_url ? read_password(o) : NULL;
    struct route_config cfg = {.host = host, .port = port, .replicas = o->replicas, .n_replicas = o->n_replicas,
                               .redis_url = o->redis_url, .redis_password = password, .prompt = rp,
                               .load_weight = o->load_weight, .shared_page_cost = o->shared_page_cost,
                               .health_ms = o->health_ms, .max_body = o->max_body,
                               .timeout_s = o->timeout_s, .n_fingerprints = 2,
                               .salt_from_key = o->salt_from_key, .tenant_key = tenant};
    model_file_fingerprint(f, false, cfg.fingerprints[0]);
    model_file_fingerprint(f, true, cfg.fingerprints[1]); /* a LongRoPE model's replicas past its original context */
    sigset_t stop;
    sigemptyset(&stop);
    sigaddset(&stop, SIGINT);
    sigaddset(&stop, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop, NULL); /* before any thread starts: they all inherit it */
    signal(SIGPIPE, SIG_IGN);
    struct route *rt = NULL;
    st = route_start(&cfg, &rt);
    if (password) {
        memset(password, 0, strlen(password));
        free(password);
    }
    if (st) {
        fprintf(stderr, "kvserve %s\n", ks_errmsg()); /* the router's messages begin with "route:" */
        route_prompt_free(rp);
        return 1;
    }
    fprintf(stderr, "kvserve route: %d replicas, %s; listening on http://%s:%d\n", o->n_replicas,
            o->redis_url ? "prefix affinity from their KV events" : "least loaded (no --cache-redis: no KV events)",
            host, route_port(rt));
    int sig = 0;
    sigwait(&stop, &sig);
    fprintf(stderr, "kvserve route: stopping\n");
    route_stop(rt);
    route_prompt_free(rp);
    return 0;
}

int cli_route(int argc, char **argv)
{
    struct route_opts o = {.listen = "127.0.0.1:8080"};
    const struct cli_command cmd = {.name = "route", .usage = route_usage, .switch_flag = route_switch,
                                    .value_flag = route_flag, .opts = &o};
    int rc = cli_parse_command(&cmd, argc, argv);
    if (rc)
        return rc < 0 ? 0 : rc;
    if (!o.model || !o.n_replicas) {
        fprintf(stderr, "kvserve route: give -m MODEL.gguf (the replicas' model) and at least one --replica URL\n");
        return 2;
    }
    struct gguf_file *f = NULL;
    struct tokenizer *tok = NULL;
    ks_status st = gguf_open(o.model, &f);
    if (!st)
        st = tok_load(f, &tok);
    if (st) {
        fprintf(stderr, "kvserve route: %s\n", ks_errmsg());
        gguf_close(f);
        return 1;
    }
    rc = run(&o, tok, f);
    tok_free(tok);
    gguf_close(f);
    return rc;
}
