#include "cli/args.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

bool cli_parse_int(const char *s, long lo, long hi, int *out)
{
    if (!s || !*s)
        return false;
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || v < lo || v > hi)
        return false;
    *out = (int)v;
    return true;
}

bool cli_parse_u64(const char *s, uint64_t *out)
{
    if (!s || !*s || *s == '-')
        return false;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || *end)
        return false;
    *out = v;
    return true;
}

bool cli_parse_float(const char *s, float lo, float hi, float *out)
{
    if (!s || !*s)
        return false;
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || *end || !isfinite(v) || v < lo || v > hi)
        return false;
    *out = v;
    return true;
}

bool cli_parse_threads(const char *s, int *out)
{
    return cli_parse_int(s, 1, 1024, out);
}

size_t cli_phys_mem(void)
{
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    return pages > 0 && page > 0 ? (size_t)pages * (size_t)page : 0;
}

static double unit_scale(const char *u)
{
    static const char *const names = "KMGT";
    if (!*u)
        return 1.0;
    const char *p = strchr(names, toupper((unsigned char)*u));
    if (!p && toupper((unsigned char)*u) == 'B' && !u[1])
        return 1.0;
    if (!p)
        return 0.0;
    const char *rest = u + 1;
    if (strcasecmp(rest, "") && strcasecmp(rest, "B") && strcasecmp(rest, "iB"))
        return 0.0;
    return ldexp(1.0, 10 * (int)(p - names + 1));
}

bool cli_parse_mem(const char *s, size_t *bytes)
{
    if (!s || !*s)
        return false;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || !isfinite(v) || v <= 0)
        return false;
    double b;
    if (!strcmp(end, "%")) {
        if (v > 100)
            return false;
        b = v / 100.0 * (double)cli_phys_mem();
    } else {
        double scale = unit_scale(end);
        if (scale == 0.0)
            return false;
        b = v * scale;
    }
    if (b < 1.0 || b > (double)SIZE_MAX / 2)
        return false;
    *bytes = (size_t)b;
    return true;
}

bool cli_parse_kv_policy(const char *s, enum kv_policy *out)
{
    if (s && !strcasecmp(s, "static"))
        *out = KV_POLICY_STATIC;
    else if (s && !strcasecmp(s, "dynamic"))
        *out = KV_POLICY_DYNAMIC;
    else
        return false;
    return true;
}

void cli_kv_flags_init(struct cli_kv_flags *f)
{
    kv_config_default(&f->cfg);
    f->mem = 0;
}

bool cli_parse_on_off(const char *s, bool *out)
{
    if (s && !strcmp(s, "on"))
        *out = true;
    else if (s && !strcmp(s, "off"))
        *out = false;
    else
        return false;
    return true;
}

static bool parse_page_tokens(const char *s, int *out)
{
    return cli_parse_int(s, 16, 256, out) && (*out & (*out - 1)) == 0;
}

/* A demotion watermark: a usage ratio in (0, 1]. */
static bool parse_watermark(const char *s, float *out)
{
    return cli_parse_float(s, 0.0f, 1.0f, out) && *out > 0.0f;
}

static bool is_flag(const char *a, const char *name, const char *alias)
{
    return !strcmp(a, name) || (alias && !strcmp(a, alias));
}

bool cli_parse_kv_flag(const char *a, const char *v, struct cli_kv_flags *f, bool *ok)
{
    struct kv_config *c = &f->cfg;
    if (is_flag(a, "--kv-mem", NULL))
        *ok = cli_parse_mem(v, &f->mem);
    else if (is_flag(a, "-ctk", "--cache-type-k"))
        *ok = kv_parse_type(v, &c->type_k) == KS_OK;
    else if (is_flag(a, "-ctv", "--cache-type-v"))
        *ok = kv_parse_type(v, &c->type_v) == KS_OK;
    else if (is_flag(a, "--kv-policy", NULL))
        *ok = cli_parse_kv_policy(v, &c->policy);
    else if (is_flag(a, "--kv-page", "--kv-page-tokens")) /* the second: an older spelling */
        *ok = parse_page_tokens(v, &c->page_tokens);
    else if (is_flag(a, "--kv-rotate", NULL))
        *ok = cli_parse_on_off(v, &c->rotate);
    else if (is_flag(a, "--kv-scale-search", NULL))
        *ok = cli_parse_on_off(v, &c->scale_search);
    else if (is_flag(a, "--kv-smooth", NULL))
        *ok = kv_parse_smooth(v, &c->smooth) == KS_OK;
    else if (is_flag(a, "--kv-sink", "--kv-sinks")) /* the second: an older spelling */
        *ok = cli_parse_int(v, 0, 1 << 24, &c->sink_tokens);
    else if (is_flag(a, "--kv-hot", NULL))
        *ok = cli_parse_int(v, 0, 1 << 24, &c->hot_tokens);
    else if (is_flag(a, "--kv-floor", NULL))
        *ok = kv_parse_type(v, &c->floor) == KS_OK;
    else if (is_flag(a, "--kv-ladder", NULL))
        *ok = v && kv_parse_ladder(v, c) == KS_OK;
    else if (is_flag(a, "--kv-high", NULL))
        *ok = parse_watermark(v, &c->high_watermark);
    else if (is_flag(a, "--kv-low", NULL))
        *ok = parse_watermark(v, &c->low_watermark);
    else if (is_flag(a, "--kv-swa-full", NULL))
        *ok = cli_parse_on_off(v, &c->swa_full);
    else
        return false;
    return true;
}

const char *cli_kv_flags_conflict(const struct cli_kv_flags *f, char *buf, size_t cap)
{
    if (f->cfg.low_watermark <= f->cfg.high_watermark)
        return NULL;
    snprintf(buf, cap, "--kv-low %g is above --kv-high %g", (double)f->cfg.low_watermark,
             (double)f->cfg.high_watermark);
    return buf;
}

void cli_kv_flags_apply(const struct cli_kv_flags *f, struct kv_config *cfg)
{
    const struct kv_config *u = &f->cfg;
    cfg->type_k = u->type_k;
    cfg->type_v = u->type_v;
    cfg->policy = u->policy;
    cfg->page_tokens = u->page_tokens;
    cfg->rotate = u->rotate;
    cfg->scale_search = u->scale_search;
    cfg->smooth = u->smooth;
    cfg->sink_tokens = u->sink_tokens;
    cfg->hot_tokens = u->hot_tokens;
    cfg->floor = u->floor;
    memcpy(cfg->ladder, u->ladder, sizeof cfg->ladder);
    cfg->n_ladder = u->n_ladder;
    cfg->high_watermark = u->high_watermark;
    cfg->low_watermark = u->low_watermark;
    cfg->swa_full = u->swa_full && cfg->swa_window > 0; /* a model without a sliding window has nothing to keep */
}

void cli_model_flags_init(struct cli_model_flags *f)
{
    f->mmap = false;
    f->no_repack = false;
    cli_kv_flags_init(&f->kv);
}

void cli_spec_flags_init(struct cli_spec_flags *f)
{
    *f = (struct cli_spec_flags){.type = SPEC_NONE, .draft_max = 16, .draft_min = 0,
                                   .pool_n = SPEC_POOL_N_DEFAULT, .draft_type_k = QUANT_TYPE_COUNT,
                                   .draft_type_v = QUANT_TYPE_COUNT};
}

const char *cli_spec_flags_conflict(struct cli_spec_flags *f)
{
    if (f->model_draft && f->type == SPEC_NONE)
        f->type = SPEC_DRAFT;
    if (f->type == SPEC_DRAFT && !f->model_draft)
        return "--spec-type draft needs a draft model (--model-draft FILE)";
    if (f->model_draft && f->type != SPEC_DRAFT)
        return "--model-draft drafts with a draft model: give --spec-type draft (or none), not an n-gram speculator";
    return NULL;
}

static bool parse_kv_type(const char *value, enum quant_type *out)
{
    return value && kv_parse_type(value, out) == KS_OK;
}

bool cli_parse_spec_flag(const char *flag, const char *value, struct cli_spec_flags *f, bool *ok)
{
    if (!strcmp(flag, "--spec-type"))
        *ok = value && spec_parse_type(value, &f->type);
    else if (!strcmp(flag, "--draft-max"))
        *ok = cli_parse_int(value, 1, SPEC_DRAFT_LIMIT, &f->draft_max);
    else if (!strcmp(flag, "--draft-min"))
        *ok = cli_parse_int(value, 0, SPEC_DRAFT_LIMIT, &f->draft_min);
    else if (!strcmp(flag, "--spec-ngram-size-n"))
        *ok = cli_parse_int(value, SPEC_POOL_N_MIN, SPEC_POOL_N_MAX, &f->pool_n);
    else if (!strcmp(flag, "--model-draft") || !strcmp(flag, "-md"))
        *ok = (f->model_draft = value) != NULL && *value;
    else if (!strcmp(flag, "--draft-p-min"))
        *ok = cli_parse_float(value, 0.0f, 1.0f, &f->draft_p_min);
    else if (!strcmp(flag, "--cache-type-k-draft") || !strcmp(flag, "-ctkd"))
        *ok = parse_kv_type(value, &f->draft_type_k);
    else if (!strcmp(flag, "--cache-type-v-draft") || !strcmp(flag, "-ctvd"))
        *ok = parse_kv_type(value, &f->draft_type_v);
    else
        return false;
    return true;
}

const char cli_spec_flags_help[] =
    "speculative decoding (the same flags in serve and generate):\n"
    "      --spec-type T        none | ngram | ngram-pool | draft (default none). ngram: draft tokens by looking\n"
    "                           the last 1-3 tokens up in the request's own prompt and output (prompt\n"
    "                           lookup); ngram-pool (alias ngram-mod): from one 16 MiB table shared by\n"
    "                           all requests, the token that followed the last N tokens anywhere in\n"
    "                           any request's text, else prompt lookup. Drafts are verified in one\n"
    "                           forward pass: output unchanged (greedy: the same tokens)\n"
    "      --spec-ngram-size-n N  ngram-pool's N, 2..64 (default 8)\n"
    "      --draft-max N        drafts per verification at most, 1..64 (default 16); the length\n"
    "                           adapts to each request's acceptance and to the measured cost\n"
    "      --draft-min N        draft at least N tokens or none, 0..--draft-max (default 0)\n"
    "  -md, --model-draft FILE  draft with a smaller model of the same vocabulary (implies\n"
    "                           --spec-type draft): its KV pages share the --kv-mem budget\n"
    "      --draft-p-min P      stop a request's drafts before a token the draft model gives a\n"
    "                           probability below P, 0..1 (default 0: never)\n"
    "  -ctkd, --cache-type-k-draft T, -ctvd, --cache-type-v-draft T\n"
    "                           the draft model's KV types (default: the KV policy's floor, q4_0,\n"
    "                           where its head size allows, else the target's types)\n";

const char cli_model_flags_help[] =
    "model loading and KV cache (the same flags in serve, bench, generate, chat and perplexity):\n"
    "      --mmap               map the model file instead of reading it into huge pages\n"
    "                           (page cache shared between processes, faster start, slower decode;\n"
    "                           the weights stay row-major: no repacking)\n"
    "      --no-repack          keep Q4_0/Q8_0/IQ4_NL/IQ4_XS/MXFP4/Q5_0/Q5_1/Q2_K..Q6_K weights row-major instead of repacking them at load\n"
    "                           into interleaved row groups for this CPU's kernels (A/B runs)\n"
    "      --kv-mem SIZE        cache budget, e.g. 512M, 2G, 25% (default: room for the run;\n"
    "                           serve: parallel x ctx-size tokens, at most 25% of RAM)\n"
    "  -ctk, --cache-type-k T   start precision of K: f32 f16 bf16 q8_0 q5_1 q5_0 q4_1 iq4_nl\n"
    "                           q4_0 iq3_nl (default f16; all but f32/f16/bf16 need a head_dim\n"
    "                           that is a multiple of 32; iq3_nl is kvserve's own 3.5-bit type)\n"
    "  -ctv, --cache-type-v T   start precision of V (default f16)\n"
    "      --kv-policy P        static | dynamic (default static)\n"
    "      --kv-page P          tokens per page, power of two 16..256 (default 32)\n"
    "      --kv-rotate on|off   Hadamard rotation of K and V (default on)\n"
    "      --kv-scale-search on|off\n"
    "                           quantized rows: each block's scale by least squared error\n"
    "                           (default on; off: llama.cpp's max-based scale)\n"
    "      --kv-smooth off|k|v|kv\n"
    "                           store K and/or V minus each sequence's channel means, fixed\n"
    "                           from its first page and added back exactly (default off)\n"
    "      --kv-sink N          dynamic: first tokens kept at start precision (default 32)\n"
    "      --kv-hot N           dynamic: recent tokens kept at start precision (default 512)\n"
    "      --kv-floor T         dynamic: lowest precision (default q4_0)\n"
    "      --kv-ladder T,T,...  dynamic: the precisions old pages step down through, V then K\n"
    "                           at each, highest first, ending at the floor (default q8_0,q4_0)\n"
    "      --kv-high R          dynamic: demote old pages above this usage ratio (default 0.90)\n"
    "      --kv-low R           dynamic: until usage is below this ratio (default 0.80)\n"
    "      --kv-swa-full on|off sliding-window models (gemma2/3, gpt-oss): keep the rows of window\n"
    "                           layers past the window too (llama.cpp's --swa-full; default off)\n";

/* ---- one command line ----------------------------------------------------- */

__attribute__((format(printf, 2, 3))) static int usage_error(const struct cli_command *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "kvserve %s: ", c->name);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputs("\n\n", stderr);
    c->usage(stderr);
    return 2;
}

static bool parse_switch(const struct cli_command *c, const char *a)
{
    if (c->model && !strcmp(a, "--mmap"))
        return c->model->mmap = true;
    if (c->model && !strcmp(a, "--no-repack"))
        return c->model->no_repack = true;
    return c->switch_flag && c->switch_flag(a, c->opts);
}

/* The command's own flags first: bench takes lists where the shared flags
 * take one value (-ctk f16,q8_0). */
static bool parse_value(const struct cli_command *c, const char *a, const char *v, bool *ok)
{
    if (c->value_flag && c->value_flag(a, v, c->opts, ok))
        return true;
    return c->model && cli_parse_kv_flag(a, v, &c->model->kv, ok);
}

int cli_parse_command(const struct cli_command *c, int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            c->usage(stdout);
            return -1;
        }
        if (parse_switch(c, a))
            continue;
        const char *v = i + 1 < argc ? argv[++i] : NULL;
        bool ok = true;
        if (!parse_value(c, a, v, &ok))
            return usage_error(c, "unknown option '%s'", a);
        if (!ok)
            return usage_error(c, "bad value '%s' for %s", v ? v : "(missing)", a);
    }
    char buf[128];
    const char *conflict = c->model ? cli_kv_flags_conflict(&c->model->kv, buf, sizeof buf) : NULL;
    return conflict ? usage_error(c, "%s", conflict) : 0;
}

size_t cli_kv_budget_for(const struct kv_config *cfg, int64_t n_tokens)
{
    int64_t pages = (n_tokens + cfg->page_tokens - 1) / cfg->page_tokens + 1;
    return (size_t)pages * kv_page_bytes(cfg, cfg->type_k, cfg->type_v);
}

bool cli_parse_ids(const char *s, int32_t **ids, int32_t *n)
{
    if (!s || !*s)
        return false;
    int32_t cap = 1;
    for (const char *p = s; *p; p++)
        cap += *p == ',';
    int32_t *a = malloc((size_t)cap * sizeof *a), count = 0;
    if (!a)
        return false;
    const char *p = s;
    for (;;) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX || (*end && *end != ',')) {
            free(a);
            return false;
        }
        a[count++] = (int32_t)v;
        if (!*end)
            break;
        p = end + 1;
    }
    *ids = a;
    *n = count;
    return true;
}

size_t cli_peak_rss(void)
{
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru))
        return 0;
    return (size_t)ru.ru_maxrss * 1024; /* Linux reports KiB */
}

bool cli_default_model(char *path, size_t cap)
{
    char exe[4096];
    ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (len <= 0)
        return false;
    exe[len] = '\0';
    char *slash = strrchr(exe, '/');
    if (!slash)
        return false;
    *slash = '\0';
    int w = snprintf(path, cap, "%s/default-model.gguf", exe);
    if (w < 0 || (size_t)w >= cap)
        return false;
    return access(path, R_OK) == 0;
}

double cli_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

char *cli_read_file(const char *path, size_t *len)
{
    FILE *f = strcmp(path, "-") ? fopen(path, "rb") : stdin;
    if (!f)
        return NULL;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    while (buf) {
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap)
            break;
        char *p = realloc(buf, cap * 2 + 1);
        if (!p) {
            free(buf);
            buf = NULL;
            break;
        }
        buf = p;
        cap *= 2;
    }
    if (buf && ferror(f)) {
        free(buf);
        buf = NULL;
    }
    if (f != stdin)
        fclose(f);
    if (buf) {
        buf[n] = 0;
        *len = n;
    }
    return buf;
}
