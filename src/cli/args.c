#include "cli/args.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
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

bool cli_parse_kv_type(const char *s, enum quant_type *out)
{
    static const struct { const char *name; enum quant_type t; } types[] = {
        {"f32", QUANT_F32}, {"f16", QUANT_F16}, {"q8_0", QUANT_Q8_0}, {"q4_0", QUANT_Q4_0}};
    for (size_t i = 0; s && i < sizeof types / sizeof types[0]; i++)
        if (!strcasecmp(s, types[i].name)) {
            *out = types[i].t;
            return true;
        }
    return false;
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

static bool parse_on_off(const char *s, bool *out)
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

bool cli_parse_kv_flag(const char *a, const char *v, struct cli_kv_flags *f, bool *ok)
{
    struct kv_config *c = &f->cfg;
    if (!strcmp(a, "--kv-mem"))
        *ok = cli_parse_mem(v, &f->mem);
    else if (!strcmp(a, "-ctk") || !strcmp(a, "--cache-type-k"))
        *ok = cli_parse_kv_type(v, &c->type_k);
    else if (!strcmp(a, "-ctv") || !strcmp(a, "--cache-type-v"))
        *ok = cli_parse_kv_type(v, &c->type_v);
    else if (!strcmp(a, "--kv-policy"))
        *ok = cli_parse_kv_policy(v, &c->policy);
    else if (!strcmp(a, "--kv-page"))
        *ok = parse_page_tokens(v, &c->page_tokens);
    else if (!strcmp(a, "--kv-rotate"))
        *ok = parse_on_off(v, &c->rotate);
    else if (!strcmp(a, "--kv-sink"))
        *ok = cli_parse_int(v, 0, 1 << 24, &c->sink_tokens);
    else if (!strcmp(a, "--kv-hot"))
        *ok = cli_parse_int(v, 0, 1 << 24, &c->hot_tokens);
    else if (!strcmp(a, "--kv-floor"))
        *ok = cli_parse_kv_type(v, &c->floor);
    else if (!strcmp(a, "--kv-high"))
        *ok = cli_parse_float(v, 0.0f, 1.0f, &c->high_watermark);
    else if (!strcmp(a, "--kv-low"))
        *ok = cli_parse_float(v, 0.0f, 1.0f, &c->low_watermark);
    else
        return false;
    return true;
}

void cli_kv_flags_apply(const struct cli_kv_flags *f, struct kv_config *cfg)
{
    const struct kv_config *u = &f->cfg;
    cfg->type_k = u->type_k;
    cfg->type_v = u->type_v;
    cfg->policy = u->policy;
    cfg->page_tokens = u->page_tokens;
    cfg->rotate = u->rotate;
    cfg->sink_tokens = u->sink_tokens;
    cfg->hot_tokens = u->hot_tokens;
    cfg->floor = u->floor;
    cfg->high_watermark = u->high_watermark;
    cfg->low_watermark = u->low_watermark;
}

const char cli_kv_flags_help[] =
    "KV cache:\n"
    "      --kv-mem SIZE        budget, e.g. 512M, 2G, 25% (default: enough pages for the run)\n"
    "  -ctk, --cache-type-k T   f32 f16 q8_0 q4_0 (default f16)\n"
    "  -ctv, --cache-type-v T   (default f16)\n"
    "      --kv-policy P        static | dynamic (default static)\n"
    "      --kv-page P          tokens per page, power of two 16..256 (default 32)\n"
    "      --kv-rotate on|off   Hadamard rotation of K and V (default on)\n"
    "      --kv-sink N          dynamic: first tokens kept at start precision (default 32)\n"
    "      --kv-hot N           dynamic: recent tokens kept at start precision (default 512)\n"
    "      --kv-floor T         dynamic: lowest precision (default q4_0)\n"
    "      --kv-high R, --kv-low R  dynamic: demotion watermarks (default 0.90 / 0.80)\n";

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
