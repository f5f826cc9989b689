/* kvserve serve: load a model, start the scheduler and the OpenAI-compatible
 * HTTP server, run until SIGINT/SIGTERM, then drain within --grace seconds. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "cli/setup.h"
#include "kv/kv.h"
#include "model/model.h"
#include "sched/sched.h"
#include "server/server.h"
#include "store/store.h"
#include "cli/serve_redis.h"
#include "tokenizer/tokenizer.h"

enum { MAX_LIST = 32 }; /* --cors-origin and --allowed-host values */

struct serve_opts {
    const char *model, *host, *api_key, *chat_template, *chat_template_file, *alias;
    int port, parallel, ctx_size, max_batch_tokens, prefill_chunk, max_queue, grace, n_threads;
    int timeout, max_conn_per_ip;
    const char *cors_origins[MAX_LIST + 1], *allowed_hosts[MAX_LIST + 1]; /* NULL-terminated */
    int n_cors_origins, n_allowed_hosts;
    size_t max_body;
    float max_itl_ratio;
    bool prefix_cache;
    const char *cache_dir;       /* SSD tier of the prefix cache, NULL: RAM only */
    size_t cache_disk;           /* its limit, 0: 10% of the free disk */
    struct cli_model_flags load; /* --mmap and the KV flags; kv.mem 0: parallel x ctx, at most 25% of RAM */
    enum server_reasoning_format reasoning_format;
    unsigned sampling_set;       /* SERVER_SAMPLING_* of the sampling flags given */
    struct server_sampling sampling;
    struct server_samplers samplers; /* --typical, --dry-*, --mirostat, --samplers, ... */
    struct cli_spec_flags spec;  /* --spec-type, --draft-max, --draft-min */
    bool spm_infill;             /* --spm-infill */
    struct cli_redis_flags redis; /* --cache-redis... (serve_redis.c) */
    const char *admin_key, *admin_key_file; /* tenant isolation: --admin-key(-file) */
    const char *api_key_file;
    bool cache_salt_from_key, cache_show_text;
    bool embeddings;             /* --embeddings: /v1/embeddings and /embeddings */
    const char *pooling;         /* --pooling NAME, NULL: the file's <arch>.pooling_type */
};

static void serve_usage(FILE *out)
{
    fprintf(out,
            "usage: kvserve serve [-m MODEL.gguf] [options]\n"
            "\n"
            "Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models), /health,\n"
            "/metrics, /cache/usage, /cache/requantize, /cache/policy and a live page at /.\n"
            "\n"
            "  -m, --model PATH          GGUF model (default: the built-in default-model.gguf)\n"
            "      --alias NAME          model id reported to clients (default: the file name)\n"
            "      --host ADDR           IPv4 address to bind (default 127.0.0.1)\n"
            "      --port N              TCP port (default 8080; 0 = any free port)\n"
            "      --api-key KEY         require 'Authorization: Bearer KEY' (all routes but /health)\n"
            "connections:\n"
            "      --timeout SECONDS     close a connection idle this long, or whose request headers are not\n"
            "                            complete by then (default 30, at most 3600; a request waiting for\n"
            "                            the model is not idle)\n"
            "      --max-conn-per-ip N   open connections from one address (default 64; 0 = no limit)\n"
            "      --cors-origin ORIGIN  allow cross-origin requests (and answer CORS preflights) from ORIGIN,\n"
            "                            e.g. http://app.example:3000; repeatable; '*' allows any origin.\n"
            "                            Other cross-origin requests get 403\n"
            "      --allowed-host NAME   when bound to a loopback address, accept this Host name besides\n"
            "                            localhost, 127.0.0.1 and [::1] (others get 421); repeatable\n"
            "      --chat-template-file F  a Jinja chat template to use instead of the model's\n"
            "      --chat-template NAME  a built-in chat format instead of the model's Jinja template\n"
            "                            (chatml, llama3, llama2, mistral, zephyr, gemma, phi3; no tools)\n"
            "      --reasoning-format F  where <think>...</think> goes: auto (reasoning_content when the\n"
            "                            template thinks), deepseek (always split), none (all content);\n"
            "                            a request's reasoning_format overrides it (default auto)\n"
            "      --spm-infill          /infill puts the suffix before the prefix (the Suffix/Prefix/Middle\n"
            "                            order some code models are trained on; default Prefix/Suffix/Middle)\n"
            "  -t, --threads N           compute threads (default: all cores)\n"
            "sampling defaults (of requests that leave the field out; as llama-server's flags):\n"
            "      --temp T, --top-k N, --top-p P, --min-p P, --repeat-penalty R, --seed S\n"
            "                            (default: OpenAI's on /v1 routes: temperature 1, the rest off;\n"
            "                            llama-server's on /completion: 0.8, 40, 0.95, 0.05, 1.0, random)\n"
            "      --typical P, --min-keep N, --top-nsigma N, --dynatemp-range R, --dynatemp-exp E,\n"
            "      --xtc-probability P, --xtc-threshold T, --dry-multiplier M, --dry-base B,\n"
            "      --dry-allowed-length N, --dry-penalty-last-n N, --dry-sequence-breaker S (repeatable;\n"
            "      'none'), --mirostat 0|1|2, --mirostat-lr ETA, --mirostat-ent TAU, --repeat-last-n N,\n"
            "      --presence-penalty P, --frequency-penalty P, --samplers 'penalties;dry;top_k;...',\n"
            "      --sampler-seq edskypmxt   llama.cpp's other samplers, on every route (default: off,\n"
            "                            llama.cpp's default order and DRY breakers; README: Samplers)\n"
            "scheduler:\n"
            "      --parallel N          max running sequences (default 16)\n"
            "  -c, --ctx-size N          max tokens of one sequence (default: the model's, at most 4096)\n"
            "      --max-batch-tokens N  tokens per step (default 512)\n"
            "      --prefill-chunk N     max prefill tokens of one sequence per step (default 256)\n"
            "      --max-itl-ratio R     while streams decode, size each step's prefill so the step's\n"
            "                            predicted time (measured costs) is at most R x a decode-only\n"
            "                            step, at least 1 prompt token per step (default 1.5; 0 = off)\n"
            "      --max-queue N         waiting requests before 503 (default 256)\n"
            "      --max-body SIZE       largest request body (default 8M); larger gets 413\n"
            "      --grace SECONDS       on SIGINT/SIGTERM, time to finish streams (default 10)\n"
            "prefix cache:\n"
            "      --prefix-cache on|off requests that share a prompt prefix share its KV pages, and full\n"
            "                            pages stay cached after a request ends (default on)\n"
            "      --cache-dir DIR       keep evicted pages on disk in DIR (LMDB) and read them back;\n"
            "                            cached pages are written there at shutdown and found after a restart\n"
            "      --cache-disk SIZE     disk limit of --cache-dir, e.g. 20G (default 10%% of the free disk)\n"
            "tenant isolation (prefix cache privacy):\n"
            "      --cache-salt-from-key salt each request's prefix cache with a keyed hash of its bearer token:\n"
            "                            requests share cached pages only with requests of the same key\n"
            "                            (a request's cache_salt field splits further)\n"
            "      --cache-show-text     /cache/prefixes and the page show cached prompts' first tokens as\n"
            "                            text (default: token counts and keys only)\n"
            "      --admin-key KEY       /cache/clear, /cache/policy, /cache/requantize, /cache/prefixes and\n"
            "                            /slots need 'Authorization: Bearer KEY' (401 without, 403 with\n"
            "                            another key); KEY also works wherever --api-key does\n"
            "      --admin-key-file F    the admin key from file F (first line), so it is not in ps\n"
            "      --api-key-file F      the API key from file F (first line), so it is not in ps\n"
            "embeddings:\n"
            "      --embeddings          serve POST /v1/embeddings and /embeddings (as llama-server's flag;\n"
            "                            completions stay on unless the model's attention is not causal)\n"
            "      --pooling TYPE        mean, cls or last instead of the model's <arch>.pooling_type\n");
    fputs(cli_spec_flags_help, out);
    fputs(cli_redis_flags_help, out);
    fputs(cli_model_flags_help, out);
}

static bool is_flag(const char *a, const char *s, const char *l)
{
    return (s && !strcmp(a, s)) || (l && !strcmp(a, l));
}

/* One more value of a repeatable flag (at most MAX_LIST). */
static bool list_add(const char **list, int *n, const char *v)
{
    if (!v || !*v || *n >= MAX_LIST)
        return false;
    list[(*n)++] = v;
    list[*n] = NULL;
    return true;
}

/* --temp, --top-k, --top-p, --min-p, --repeat-penalty, --seed: the ranges a request's fields have. */
static bool parse_sampling_flag(const char *a, const char *v, struct serve_opts *o, bool *ok)
{
    static const struct {
        const char *flag;
        unsigned bit;
        double lo, hi;
        bool integer;
    } flags[] = {
        {"--temp", SERVER_SAMPLING_TEMP, 0, 2, false},
        {"--top-k", SERVER_SAMPLING_TOP_K, 0, 1e9, true},
        {"--top-p", SERVER_SAMPLING_TOP_P, 1e-6, 1, false},
        {"--min-p", SERVER_SAMPLING_MIN_P, 0, 1, false},
        {"--repeat-penalty", SERVER_SAMPLING_REPEAT_PENALTY, 1e-6, 10, false},
        {"--seed", SERVER_SAMPLING_SEED, -1, 9.2e18, true}, /* -1: random, as without the flag */
    };
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++) {
        if (strcmp(a, flags[i].flag))
            continue;
        char *end = NULL;
        double x = v ? strtod(v, &end) : 0;
        *ok = v && end != v && !*end && x >= flags[i].lo && x <= flags[i].hi && (!flags[i].integer || x == (int64_t)x);
        struct server_sampling *s = &o->sampling;
        double *as_double[] = {&s->temp, NULL, &s->top_p, &s->min_p, &s->repeat_penalty, NULL};
        if (*ok && as_double[i])
            *as_double[i] = x;
        else if (*ok)
            *(flags[i].bit == SERVER_SAMPLING_TOP_K ? &s->top_k : &s->seed) = (int64_t)x;
        o->sampling_set |= *ok && !(flags[i].bit == SERVER_SAMPLING_SEED && x < 0) ? flags[i].bit : 0;
        return true;
    }
    return false;
}

static bool parse_switch(const char *a, void *opts)
{
    struct serve_opts *o = opts;
    if (!strcmp(a, "--spm-infill"))
        return o->spm_infill = true;
    if (!strcmp(a, "--cache-salt-from-key"))
        return o->cache_salt_from_key = true;
    if (!strcmp(a, "--cache-show-text"))
        return o->cache_show_text = true;
    if (!strcmp(a, "--embeddings") || !strcmp(a, "--embedding"))
        return o->embeddings = true;
    if (!strcmp(a, "--kv-events"))
        return o->redis.kv_events = true;
    return false;
}

static bool parse_flag(const char *a, const char *v, void *opts, bool *ok)
{
    struct serve_opts *o = opts;
    if (is_flag(a, "-m", "--model")) *ok = (o->model = v) != NULL;
    else if (is_flag(a, NULL, "--alias")) *ok = (o->alias = v) != NULL;
    else if (is_flag(a, NULL, "--host")) *ok = (o->host = v) != NULL;
    else if (is_flag(a, NULL, "--api-key")) *ok = (o->api_key = v) != NULL;
    else if (is_flag(a, NULL, "--chat-template")) *ok = (o->chat_template = v) != NULL;
    else if (is_flag(a, NULL, "--chat-template-file")) *ok = (o->chat_template_file = v) != NULL;
    else if (is_flag(a, NULL, "--reasoning-format")) *ok = server_reasoning_format_parse(v, &o->reasoning_format);
    else if (parse_sampling_flag(a, v, o, ok)) return true;
    else if (server_samplers_flag(a, v, &o->samplers, ok)) return true;
    else if (is_flag(a, NULL, "--port")) *ok = cli_parse_int(v, 0, 65535, &o->port);
    else if (is_flag(a, "-t", "--threads")) *ok = cli_parse_threads(v, &o->n_threads);
    else if (is_flag(a, NULL, "--parallel")) *ok = cli_parse_int(v, 1, 1024, &o->parallel);
    else if (is_flag(a, "-c", "--ctx-size")) *ok = cli_parse_int(v, 2, 1 << 24, &o->ctx_size);
    else if (is_flag(a, NULL, "--max-batch-tokens")) *ok = cli_parse_int(v, 1, 1 << 16, &o->max_batch_tokens);
    else if (is_flag(a, NULL, "--prefill-chunk")) *ok = cli_parse_int(v, 1, 1 << 16, &o->prefill_chunk);
    else if (is_flag(a, NULL, "--max-itl-ratio")) *ok = cli_parse_float(v, 0.0f, 1000.0f, &o->max_itl_ratio);
    else if (is_flag(a, NULL, "--max-queue")) *ok = cli_parse_int(v, 0, 1 << 20, &o->max_queue);
    else if (is_flag(a, NULL, "--max-body")) *ok = cli_parse_mem(v, &o->max_body);
    else if (is_flag(a, NULL, "--grace")) *ok = cli_parse_int(v, 0, 3600, &o->grace);
    else if (is_flag(a, NULL, "--timeout")) *ok = cli_parse_int(v, 1, 3600, &o->timeout);
    else if (is_flag(a, NULL, "--max-conn-per-ip")) *ok = cli_parse_int(v, 0, 1 << 20, &o->max_conn_per_ip);
    else if (is_flag(a, NULL, "--cors-origin")) *ok = list_add(o->cors_origins, &o->n_cors_origins, v);
    else if (is_flag(a, NULL, "--allowed-host")) *ok = list_add(o->allowed_hosts, &o->n_allowed_hosts, v);
    else if (is_flag(a, NULL, "--prefix-cache")) *ok = cli_parse_on_off(v, &o->prefix_cache);
    else if (is_flag(a, NULL, "--cache-dir")) *ok = (o->cache_dir = v) != NULL && *v;
    else if (is_flag(a, NULL, "--admin-key")) *ok = (o->admin_key = v) != NULL && *v;
    else if (is_flag(a, NULL, "--admin-key-file")) *ok = (o->admin_key_file = v) != NULL && *v;
    else if (is_flag(a, NULL, "--api-key-file")) *ok = (o->api_key_file = v) != NULL && *v;
    else if (is_flag(a, NULL, "--cache-disk")) *ok = v && !strchr(v, '%') && cli_parse_mem(v, &o->cache_disk);
    else if (cli_parse_spec_flag(a, v, &o->spec, ok)) return true;
    else if (cli_parse_redis_flag(a, v, &o->redis, ok)) return true;
    else if (is_flag(a, NULL, "--pooling")) *ok = (o->pooling = v) != NULL;
    else return false;
    return true;
}

/* 0 ok, 2 usage error, -1 help printed. */
static int parse_args(int argc, char **argv, struct serve_opts *o)
{
    *o = (struct serve_opts){.host = "127.0.0.1", .port = 8080, .parallel = 16, .max_batch_tokens = 512,
                             .prefill_chunk = 256, .max_queue = 256, .grace = 10, .max_body = 8u << 20,
                             .n_threads = threads_default_count(), .max_itl_ratio = 1.5f, .prefix_cache = true,
                             .timeout = 30, .max_conn_per_ip = 64};
    cli_model_flags_init(&o->load);
    cli_spec_flags_init(&o->spec);
    server_samplers_default(&o->samplers);
    const struct cli_command cmd = {
        .name = "serve", .usage = serve_usage, .model = &o->load, .switch_flag = parse_switch,
        .value_flag = parse_flag, .opts = o};
    return cli_parse_command(&cmd, argc, argv);
}

struct serve_state {
    struct model *model;
    struct model *draft;         /* --model-draft, NULL: none */
    struct tokenizer *tok;
    threads_pool *pool;
    struct sched *sched;
    struct server *srv;
    struct store *store;
    struct store_redis *redis;
    struct store_events *events; /* --kv-events */
    char *chat_template;         /* --chat-template-file's text */
    struct server_loading *loading; /* answers 503 on the port until the server proper takes it over */
    char *admin_key;             /* --admin-key-file's first line */
    char *api_key;               /* --api-key-file's first line */
};

/* The cache: the user's KV flags; without --kv-mem, room for every
 * sequence at full context, at most a quarter of RAM. */
static void kv_setup(const struct serve_opts *o, struct model *m, int32_t ctx, struct kv_config *cfg)
{
    cli_kv_config(m, &o->load.kv, ctx, cfg);
    if (!o->load.kv.mem) {
        int64_t pages = (int64_t)o->parallel * ((ctx + cfg->page_tokens - 1) / cfg->page_tokens);
        size_t want = (size_t)pages * kv_page_bytes(cfg, cfg->type_k, cfg->type_v);
        size_t cap = cli_phys_mem() / 4;
        cfg->mem_budget = cap && want > cap ? cap : want;
    }
}

static int32_t collect_eog(const struct tokenizer *tok, int32_t *eog, int cap)
{
    int n = 0;
    for (int32_t id = 0; id < tok_n_vocab(tok) && n < cap; id++)
        if (tok_is_eog(tok, id))
            eog[n++] = id;
    return n;
}

static const char *base_name(const char *path)
{
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

static ks_status open_store(const struct serve_opts *o, const struct kv_config *kvc, struct store **out)
{
    struct store_config sc = {.dir = o->cache_dir, .max_bytes = o->cache_disk};
    memcpy(sc.fingerprint, kvc->fingerprint, sizeof sc.fingerprint);
    ks_status st = store_open(&sc, out);
    if (st)
        return st;
    struct store_stats ss;
    store_stats(*out, &ss);
    fprintf(stderr, "kvserve serve: prefix cache on disk in %s: %llu pages, %.1f of %.1f MiB\n", o->cache_dir,
            (unsigned long long)ss.entries, (double)ss.bytes / (1 << 20), (double)store_limit(*out) / (1 << 20));
    return KS_OK;
}

/* Every connection is a file descriptor: take the hard limit (the soft one
 * is often 1024), so the server's connection limit, which it derives from
 * the soft limit, is in the thousands. */
static void raise_file_limit(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &rl) != 0)
            fprintf(stderr, "kvserve serve: cannot raise the open-file limit (%s)\n", strerror(errno));
    }
}

/* A --*-key-file: its first line, without the line end, into *out. */
static ks_status read_key_file(const char *flag, const char *path, const char *given, char **out)
{
    if (!path)
        return KS_OK;
    if (given)
        return ks_fail(KS_ERR_INVALID_ARG, "give %.*s or %s, not both", (int)(strlen(flag) - 5), flag, flag);
    size_t len = 0;
    if (!(*out = cli_read_file(path, &len)))
        return ks_fail(KS_ERR_IO, "cannot read %s %s", flag, path);
    (*out)[strcspn(*out, "\r\n")] = '\0';
    if (!**out)
        return ks_fail(KS_ERR_INVALID_ARG, "%s %s: its first line is empty", flag, path);
    return KS_OK;
}

/* The keys from their files, and a warning when the server is open to anyone who reaches it. */
static ks_status read_keys(const struct serve_opts *o, struct serve_state *s)
{
    ks_status st = read_key_file("--admin-key-file", o->admin_key_file, o->admin_key, &s->admin_key);
    if (!st)
        st = read_key_file("--api-key-file", o->api_key_file, o->api_key, &s->api_key);
    if (st)
        return st;
    const char *api_key = s->api_key ? s->api_key : o->api_key;
    if (api_key && !*api_key)
        fprintf(stderr, "kvserve serve: warning: --api-key is empty, so no key is required\n");
    if ((!api_key || !*api_key) && strncmp(o->host, "127.", 4) != 0)
        fprintf(stderr, "kvserve serve: warning: listening on %s without --api-key: anyone who reaches the port can "
                        "run the model%s\n", o->host, o->admin_key || s->admin_key ? "" : " and clear or read the cache");
    return KS_OK;
}

/* --pooling over the file's pooling; --embeddings (implied for an encoder,
 * which can do nothing else) needs one that gives a vector per input. */
static ks_status embeddings_setup(const struct serve_opts *o, struct model *m)
{
    enum model_pooling p;
    ks_status st;
    if (o->pooling) {
        if ((st = model_pooling_parse(o->pooling, &p)))
            return ks_fail(st, "--pooling: %s", ks_errmsg());
        model_set_pooling(m, p);
    }
    p = model_hparams(m)->pooling;
    bool embeddings = o->embeddings || model_hparams(m)->encoder_only;
    if (embeddings && p != MODEL_POOLING_MEAN && p != MODEL_POOLING_CLS && p != MODEL_POOLING_LAST)
        return ks_fail(KS_ERR_INVALID_ARG,
                       "--embeddings: the model pools '%s' (%s.pooling_type), which gives no vector per input; give "
                       "--pooling mean, cls or last", model_pooling_name(p), model_hparams(m)->arch_name);
    return KS_OK;
}

/* --model-draft: load it, configure its KV (in the same budget: without
 * --kv-mem the budget grows by its share of --parallel contexts) and check
 * that one context of both fits. */
static ks_status draft_setup(const struct serve_opts *o, struct serve_state *s, int32_t ctx, struct kv_config *kvc,
                             struct kv_config *dkv)
{
    ks_status st = cli_draft_load(&o->spec, &o->load, s->tok, model_hparams(s->model)->n_vocab, &s->draft);
    if (st)
        return st;
    cli_draft_kv_config(&o->spec, s->draft, kvc, ctx, dkv);
    if (!o->load.kv.mem) {
        int64_t pages = (int64_t)o->parallel * ((ctx + dkv->page_tokens - 1) / dkv->page_tokens);
        kvc->mem_budget += (size_t)pages * kv_page_bytes(dkv, dkv->type_k, dkv->type_v);
        size_t one_of_both = cli_kv_budget_for(kvc, ctx) + cli_kv_budget_for(dkv, ctx); /* the check's need */
        if (kvc->mem_budget < one_of_both) /* --parallel 1: the check counts a page more of each */
            kvc->mem_budget = one_of_both;
    }
    return cli_draft_check_fit(kvc, dkv, ctx);
}

static ks_status start(const struct serve_opts *o, const char *path, struct serve_state *s)
{
    if (o->chat_template && o->chat_template_file)
        return ks_fail(KS_ERR_INVALID_ARG, "give --chat-template NAME or --chat-template-file F, not both");
    size_t tlen = 0;
    if (o->chat_template_file && !(s->chat_template = cli_read_file(o->chat_template_file, &tlen)))
        return ks_fail(KS_ERR_IO, "cannot read --chat-template-file %s", o->chat_template_file);
    if (s->chat_template && strlen(s->chat_template) != tlen)
        return ks_fail(KS_ERR_INVALID_ARG, "--chat-template-file %s contains a NUL byte", o->chat_template_file);
    ks_status st = read_keys(o, s);
    if (st)
        return st;
    st = server_loading_start(o->host, o->port, &s->loading);
    if (st)
        return st;
    /* not in the host:port form of the ready line below, which scripts wait for */
    fprintf(stderr, "kvserve serve: loading %s (port %d answers 503 until it is ready)\n", path,
            server_loading_port(s->loading));
    st = cli_load_model(path, &o->load, &s->model);
    if (st)
        return st;
    st = tok_load(model_gguf(s->model), &s->tok);
    if (st)
        return st;
    if ((st = embeddings_setup(o, s->model)))
        return st;
    const struct model_hparams *hp = model_hparams(s->model);
    int32_t ctx = o->ctx_size;
    if (!ctx)
        ctx = hp->n_ctx_train > 0 && hp->n_ctx_train < 4096 ? hp->n_ctx_train : 4096;
    if (hp->arch == MODEL_ARCH_BERT && ctx > hp->n_ctx_train) /* no position past its learned ones */
        return ks_fail(KS_ERR_INVALID_ARG, "--ctx-size %d exceeds bert's %d learned positions (bert.context_length)",
                       ctx, hp->n_ctx_train);
    struct kv_config kvc;
    kv_setup(o, s->model, ctx, &kvc);
    kvc.prefix_cache = o->prefix_cache;
    if (o->cache_dir && !o->prefix_cache)
        return ks_fail(KS_ERR_INVALID_ARG, "--cache-dir needs --prefix-cache on");
    if (o->cache_dir && (st = open_store(o, &kvc, &s->store)))
        return st;
    if (o->redis.url && !o->prefix_cache)
        return ks_fail(KS_ERR_INVALID_ARG, "--cache-redis needs --prefix-cache on");
    if ((st = cli_open_redis(&o->redis, kvc.fingerprint, &s->redis)))
        return st;
    st = threads_create(o->n_threads, &s->pool);
    if (st)
        return st;
    struct kv_config dkv;
    if (o->spec.model_draft && (st = draft_setup(o, s, ctx, &kvc, &dkv)))
        return st;
    struct sched_config sc;
    sched_config_default(&sc);
    int32_t eog[16];
    sc.parallel = o->parallel;
    sc.max_batch_tokens = o->max_batch_tokens;
    sc.prefill_chunk = o->prefill_chunk;
    sc.max_itl_ratio = o->max_itl_ratio;
    sc.ctx_size = ctx;
    sc.max_queue = o->max_queue;
    sc.spec_type = o->spec.type;
    sc.draft_max = o->spec.draft_max;
    sc.draft_min = o->spec.draft_min;
    sc.pool_n = o->spec.pool_n;
    sc.draft_p_min = o->spec.draft_p_min;
    sc.eog = eog;
    sc.n_eog = collect_eog(s->tok, eog, 16);
    struct sched_engine eng;
    st = sched_engine_model(s->model, &kvc, sc.max_batch_tokens, s->pool, &eng);
    if (st)
        return st;
    if (s->store)
        sched_engine_model_set_store(&eng, s->store);
    if (s->redis)
        sched_engine_model_set_redis(&eng, s->redis);
    if (s->draft && (st = sched_engine_model_add_draft(&eng, s->draft, &dkv, sc.max_batch_tokens, s->pool))) {
        eng.destroy(eng.ctx);
        return st;
    }
    struct kv_key_layout key_layout;
    sched_engine_model_key_layout(&eng, &key_layout);
    if (!st && (st = cli_open_kv_events(&o->redis, kvc.fingerprint, &key_layout, o->host,
                                        server_loading_port(s->loading), &s->events))) {
        eng.destroy(eng.ctx);
        return st;
    }
    if (s->events)
        sched_engine_model_set_events(&eng, s->events);
    st = sched_create(&sc, &eng, &s->sched);
    if (st) {
        eng.destroy(eng.ctx);
        return st;
    }
    raise_file_limit();
    struct server_config cfg;
    server_config_default(&cfg);
    cfg.host = o->host;
    cfg.port = o->port;
    cfg.api_key = s->api_key ? s->api_key : o->api_key;
    cfg.max_body = o->max_body;
    cfg.timeout_s = o->timeout;
    cfg.max_conn_per_ip = o->max_conn_per_ip;
    cfg.cors_origins = o->cors_origins;
    cfg.allowed_hosts = o->allowed_hosts;
    cfg.admin_key = s->admin_key ? s->admin_key : o->admin_key;
    cfg.cache_salt_from_key = o->cache_salt_from_key;
    cfg.cache_show_text = o->cache_show_text;
    cfg.model_name = o->alias ? o->alias : base_name(path);
    cfg.ctx_size = ctx;
    cfg.chat_template = o->chat_template;
    cfg.chat_template_jinja = s->chat_template;
    cfg.chat_template_origin = o->chat_template_file;
    cfg.store = s->store;
    cfg.redis = s->redis;
    cfg.events = s->events;
    cfg.reasoning_format = o->reasoning_format;
    cfg.spm_infill = o->spm_infill;
    cfg.parallel = o->parallel;
    cfg.model_path = path;
    cfg.sampling_set = o->sampling_set;
    cfg.sampling = o->sampling;
    cfg.samplers = &o->samplers;
    cfg.listen_from = s->loading;
    cfg.embeddings = o->embeddings || hp->encoder_only; /* an encoder (bert) only embeds */
    cfg.n_embd = hp->n_embd;
    cfg.no_generation = hp->non_causal || hp->encoder_only;
    st = server_start(&cfg, s->sched, s->tok, &s->srv);
    if (st)
        return st;
    server_set_ready(s->srv, true);
    server_loading_stop(s->loading); /* its last connections get 503; clients retry on the server proper */
    s->loading = NULL;
    fprintf(stderr,
            "kvserve serve: %s on http://%s:%d  (ctx %d, parallel %d, batch %d, chunk %d, kv %.1f MiB %s/%s %s)\n",
            cfg.model_name, o->host, server_port(s->srv), ctx, o->parallel, o->max_batch_tokens, o->prefill_chunk,
            (double)kvc.mem_budget / (1 << 20), quant_type_name(kvc.type_k), quant_type_name(kvc.type_v),
            kvc.policy == KV_POLICY_DYNAMIC ? "dynamic" : "static");
    if (o->spec.type != SPEC_NONE)
        fprintf(stderr, "kvserve serve: speculation %s, %d..%d drafts per verification\n", spec_type_name(o->spec.type),
                o->spec.draft_min, o->spec.draft_max);
    if (s->draft)
        fprintf(stderr, "kvserve serve: draft model %s, KV %s/%s in the same budget, --draft-p-min %.2f\n",
                o->spec.model_draft, quant_type_name(dkv.type_k), quant_type_name(dkv.type_v),
                (double)o->spec.draft_p_min);
    fprintf(stderr, "kvserve serve: at most %d connections (%d per address), idle timeout %d s\n",
            server_max_connections(s->srv), o->max_conn_per_ip, o->timeout);
    return KS_OK;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Stop accepting, let streams finish for up to grace seconds, cancel the rest. */
static void shutdown_gracefully(struct serve_state *s, int grace)
{
    server_quiesce(s->srv);
    sched_drain(s->sched);
    double deadline = now_s() + grace;
    while (server_in_flight(s->srv) > 0 && now_s() < deadline)
        usleep(20000);
    int left = server_in_flight(s->srv);
    if (left > 0) {
        fprintf(stderr, "kvserve serve: cancelling %d request(s) still running after %d s\n", left, grace);
        sched_cancel_all(s->sched);
        double hard = now_s() + 5;
        while (server_in_flight(s->srv) > 0 && now_s() < hard)
            usleep(20000);
    }
}

static void wipe_free(char *key)
{
    if (key)
        memset(key, 0, strlen(key));
    free(key);
}

static void teardown(struct serve_state *s)
{
    server_loading_stop(s->loading);
    server_stop(s->srv);
    sched_free(s->sched); /* hands the cached pages to the store */
    store_close(s->store);
    store_redis_close(s->redis);
    store_events_close(s->events); /* after the engine: its last snapshot is empty */
    threads_free(s->pool);
    tok_free(s->tok);
    model_free(s->model);
    model_free(s->draft);
    free(s->chat_template);
    wipe_free(s->admin_key);
    wipe_free(s->api_key);
}

/* A second SIGINT/SIGTERM during the drain ends the process now: LMDB keeps
 * the last committed state, pages not yet written are lost. */
static void *exit_on_second_signal(void *stop)
{
    int sig = 0;
    sigwait(stop, &sig);
    static const char msg[] = "kvserve serve: second stop signal: exiting now, without draining\n";
    ssize_t ignored = write(STDERR_FILENO, msg, sizeof msg - 1);
    (void)ignored;
    _exit(1);
}

int cli_serve(int argc, char **argv)
{
    struct serve_opts o;
    int rc = parse_args(argc, argv, &o);
    if (rc)
        return rc < 0 ? 0 : rc;
    const char *spec_conflict = cli_spec_flags_conflict(&o.spec);
    if (spec_conflict) {
        fprintf(stderr, "kvserve serve: %s\n", spec_conflict);
        return 2;
    }
    char default_path[4096];
    const char *path = cli_model_path("serve", o.model, default_path, sizeof default_path);
    if (!path)
        return 2;
    /* Block the stop signals in every thread; this one waits for them. */
    static sigset_t stop; /* outlives this call: exit_on_second_signal waits on it */
    sigemptyset(&stop);
    sigaddset(&stop, SIGINT);
    sigaddset(&stop, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop, NULL);
    signal(SIGPIPE, SIG_IGN);

    struct serve_state s = {0};
    ks_status st = start(&o, path, &s);
    if (st) {
        fprintf(stderr, "kvserve serve: %s: %s\n", ks_strerror(st), ks_errmsg());
        teardown(&s);
        return st == KS_ERR_INVALID_ARG ? 2 : 1;
    }
    int sig = 0;
    sigwait(&stop, &sig);
    fprintf(stderr, "kvserve serve: %s received, draining (grace %d s; send it again to exit at once)\n",
            sig == SIGINT ? "SIGINT" : "SIGTERM", o.grace);
    pthread_t second;
    if (pthread_create(&second, NULL, exit_on_second_signal, &stop) == 0)
        pthread_detach(second);
    shutdown_gracefully(&s, o.grace);
    teardown(&s);
    fprintf(stderr, "kvserve serve: stopped\n");
    return 0;
}
