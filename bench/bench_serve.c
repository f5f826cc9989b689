/* bench_serve: a plain OpenAI-API load generator. N clients send streaming
 * /v1/completions requests (prompt as token ids, so lengths are exact on any
 * server), optionally with a shared prefix and Poisson arrivals, and report
 * TTFT, inter-token latency, the worst decode stall and tok/s. With
 * --probe-len, one long prompt arrives --probe-at seconds in and the streams'
 * latency is split into "during its prefill" and "steady".
 *
 * The requests run on one libcurl multi handle in this thread (tools/httpc).
 * Timing is per read: every SSE event is stamped with the time its bytes
 * reached the client, and the events one stream received in one pass of the
 * multi loop (one wake-up, however many HTTP chunks or recv() calls carried
 * them) are one read with one stamp. When one read carries k token events
 * after a wait of G seconds, each of the k tokens counts as an inter-token gap
 * of G/k (not one G and k-1 zero gaps), and G itself is a candidate for the
 * worst stall (the longest a stream waited for anything). TTFT counts from
 * when the connection was up and the request about to be written.
 *
 * With --out FILE the requests also ask for the usage chunk and FILE gets one
 * line per request: its index, the cached prompt tokens the server reported
 * (usage.prompt_tokens_details.cached_tokens, else llama-server's
 * timings.cache_n; -1 if neither) and the generated text as a JSON string, so
 * scripts can compare greedy outputs and cache hits between servers.
 *
 * usage: bench_serve --url http://HOST:PORT [flags]   (--help for them) */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "bench_util.h"
#include "cli/args.h"
#include "httpc/httpc.h"

/* Largest SSE event of a stream (a token event is ~200 bytes; logprobs are not asked). */
#define BS_MAX_EVENT ((size_t)1 << 20)

struct bs_opts {
    char url[1024];           /* the completions endpoint */
    int clients, prompt_len, gen_len, shared_prefix, requests;
    float rate;               /* requests per second; 0 = send as fast as clients allow */
    const char *model, *api_key;
    const char *out_path;     /* NULL: no per-request output */
    uint64_t seed;
    int probe_len, probe_gen; /* 0: no probe */
    float probe_at;           /* seconds after the start */
};

/* One read that delivered token events: when it returned and how many. */
struct bs_read {
    double t;
    int k;
};

struct bs_result {
    struct bs_run *run;
    bool probe;               /* the long prompt, not one of the clients' requests */
    bool ok;
    double t_send, ttft;
    struct bs_read *reads;
    int n_reads, cap_reads;
    int tokens;
    int cached;               /* cached prompt tokens the server reported; -1: none */
    char *text;               /* the generated text, kept with --out only */
    size_t text_len, text_cap;
    uint64_t last_read;       /* httpc_read.id of the last token event; 0: none yet */
    char why[256];            /* why it failed */
};

struct bs_run {
    const struct bs_opts *o;
    struct httpc_multi *m;
    int active;               /* the clients' requests running (the probe is extra) */
    double t0;
    double *arrival;          /* seconds after t0 */
    struct bs_result *res;
    struct bs_result probe;
};

static void bs_usage(FILE *out)
{
    fprintf(out,
            "usage: bench_serve --url http://HOST:PORT [--clients N] [--prompt-len L] [--gen-len G]\n"
            "                   [--shared-prefix K] [--rate R] [--requests M] [--model NAME] [--api-key KEY]\n"
            "                   [--probe-len L [--probe-at S] [--probe-gen G]]\n"
            "\n"
            "Load any OpenAI-compatible server with streaming /v1/completions requests and print\n"
            "requests done, TTFT p50/p99, inter-token latency p50/p99, worst decode stall, tok/s.\n"
            "  --url URL            server base, e.g. http://127.0.0.1:8080 (\"/v1\" is appended)\n"
            "  --clients N          concurrent clients (default 8)\n"
            "  --prompt-len L       prompt tokens, sent as token ids (default 128)\n"
            "  --gen-len G          tokens to generate per request, ignore_eos (default 128)\n"
            "  --shared-prefix K    the first K prompt tokens are the same in every request (default 0)\n"
            "  --rate R             Poisson arrivals at R requests/s (default 0: closed loop)\n"
            "  --requests M         total requests (default: one per client)\n"
            "  --model NAME         model field of the requests (default \"\": any server takes it)\n"
            "  --api-key KEY        sent as Authorization: Bearer KEY\n"
            "  --seed N             prompt / arrival seed (default 1)\n"
            "  --out FILE           per request: index, reported cached prompt tokens, generated text\n"
            "  --probe-len L        also send one request of L prompt tokens --probe-at seconds in\n"
            "                       and split the streams' latency into during its prefill / steady\n"
            "  --probe-at S         (default 2)\n"
            "  --probe-gen G        tokens the probe generates (default 4)\n");
}

/* The completions endpoint of a server base URL: http[s]://HOST[:PORT][/PATH], "/v1"
 * appended unless the path has it. */
static bool parse_url(const char *url, struct bs_opts *o)
{
    size_t scheme = !strncmp(url, "http://", 7) ? 7 : !strncmp(url, "https://", 8) ? 8 : 0;
    const char *h = url + scheme;
    size_t hn = strcspn(h, "/"), n = strlen(url);
    const char *bracket = h[0] == '[' ? memchr(h, ']', hn) : h; /* [IPv6] */
    const char *colon = bracket ? memchr(bracket, ':', hn - (size_t)(bracket - h)) : NULL;
    size_t name = colon ? (size_t)(colon - h) : hn;
    if (!scheme || name == 0 || !bracket)
        return false;
    int port;
    if (colon && !cli_parse_int(strndupa(colon + 1, hn - name - 1), 1, 65535, &port))
        return false;
    while (n > scheme + hn && url[n - 1] == '/')
        n--;
    bool v1 = memmem(h + hn, n - scheme - hn, "/v1", 3) != NULL;
    int k = snprintf(o->url, sizeof o->url, "%.*s%s/completions", (int)n, url, v1 ? "" : "/v1");
    return k > 0 && (size_t)k < sizeof o->url;
}

/* Deterministic token ids in [100, 356): printable-ish on most vocabularies. */
static int32_t prompt_token(const struct bs_opts *o, int req, int pos)
{
    uint64_t x = o->seed * 0x9E3779B97F4A7C15ull + (uint64_t)pos * 0xBF58476D1CE4E5B9ull +
                 (pos < o->shared_prefix ? 0 : (uint64_t)(req + 1) * 0x94D049BB133111EBull);
    x ^= x >> 31;
    x *= 0xD6E8FEB86659FD93ull;
    x ^= x >> 32;
    return 100 + (int32_t)(x % 256);
}

/* {"model":M,"stream":true,"max_tokens":G,"temperature":0,"ignore_eos":true,"prompt":[ids]}, with
 * "stream_options":{"include_usage":true} under --out; NULL: out of memory */
static char *build_body(const struct bs_opts *o, int req, int prompt_len, int gen_len)
{
    int *ids = malloc((size_t)prompt_len * sizeof *ids);
    cJSON *j = cJSON_CreateObject(), *prompt = NULL;
    char *body = NULL;
    if (ids && j) {
        for (int i = 0; i < prompt_len; i++)
            ids[i] = prompt_token(o, req, i);
        prompt = cJSON_CreateIntArray(ids, prompt_len);
    }
    if (prompt && cJSON_AddStringToObject(j, "model", o->model) && cJSON_AddTrueToObject(j, "stream") &&
        cJSON_AddNumberToObject(j, "max_tokens", gen_len) && cJSON_AddNumberToObject(j, "temperature", 0) &&
        cJSON_AddTrueToObject(j, "ignore_eos") && cJSON_AddItemToObject(j, "prompt", prompt) &&
        (!o->out_path || cJSON_AddTrueToObject(cJSON_AddObjectToObject(j, "stream_options"), "include_usage"))) {
        prompt = NULL; /* j owns it */
        body = cJSON_PrintUnformatted(j);
    }
    cJSON_Delete(prompt);
    cJSON_Delete(j);
    free(ids);
    return body;
}

/* Count one token event delivered by the read that returned at t. */
static void add_token(struct bs_result *r, double t, bool same_read)
{
    if (same_read && r->n_reads > 0) {
        r->reads[r->n_reads - 1].k++;
    } else {
        if (r->n_reads == r->cap_reads) {
            int cap = r->cap_reads ? 2 * r->cap_reads : 256;
            struct bs_read *p = realloc(r->reads, (size_t)cap * sizeof *p);
            if (!p)
                return;
            r->reads = p;
            r->cap_reads = cap;
        }
        r->reads[r->n_reads++] = (struct bs_read){t, 1};
    }
    if (r->tokens == 0)
        r->ttft = t - r->t_send;
    r->tokens++;
}

/* ---- the requests: callbacks of tools/httpc ------------------------------------------------- */

static void on_sent(void *user)
{
    struct bs_result *r = user;
    r->t_send = httpc_now();
}

static void keep_text(struct bs_result *r, const char *s)
{
    size_t n = strlen(s);
    if (r->text_len + n + 1 > r->text_cap) {
        size_t cap = r->text_cap ? 2 * r->text_cap : 256;
        while (cap < r->text_len + n + 1)
            cap *= 2;
        char *p = realloc(r->text, cap);
        if (!p)
            return;
        r->text = p;
        r->text_cap = cap;
    }
    memcpy(r->text + r->text_len, s, n + 1);
    r->text_len += n;
}

/* The usage chunk's cached prompt tokens (OpenAI's field, else llama-server's timings). */
static void keep_cached(struct bs_result *r, const cJSON *j)
{
    const cJSON *details = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(j, "usage"),
                                                             "prompt_tokens_details");
    const cJSON *n = cJSON_GetObjectItemCaseSensitive(details, "cached_tokens");
    if (!cJSON_IsNumber(n))
        n = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(j, "timings"), "cache_n");
    if (cJSON_IsNumber(n))
        r->cached = n->valueint;
}

/* One event with text is one token (servers send one token per event); so is one with empty text
 * before the end (finish_reason null): llama-server sends a token whose bytes are not yet whole
 * UTF-8 that way (byte-fallback tokens), and the synthetic models' output is mostly such bytes. */
static ks_status on_event(void *user, const char *data, size_t len, const struct httpc_read *rd)
{
    struct bs_result *r = user;
    cJSON *j = cJSON_ParseWithLength(data, len);
    const cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(j, "choices"), 0);
    const cJSON *text = cJSON_GetObjectItemCaseSensitive(ch, "text");
    if (cJSON_IsString(text) &&
        (text->valuestring[0] || cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(ch, "finish_reason")))) {
        add_token(r, rd->t, r->last_read == rd->id);
        r->last_read = rd->id;
        if (r->run->o->out_path)
            keep_text(r, text->valuestring);
    }
    if (r->run->o->out_path)
        keep_cached(r, j);
    cJSON_Delete(j);
    return KS_OK;
}

static void on_done(void *user, ks_status st, long http_status, bool done, const char *why)
{
    struct bs_result *r = user;
    /* a connection that breaks after [DONE] still delivered the whole stream */
    r->ok = http_status == 200 && r->tokens > 0 && (st == KS_OK || done);
    if (!r->ok)
        snprintf(r->why, sizeof r->why, "%s", *why ? why : "HTTP 200 without any token");
    if (!r->probe)
        r->run->active--;
}

static ks_status start_request(struct bs_run *run, struct bs_result *r, int req, int prompt_len, int gen_len)
{
    const struct bs_opts *o = run->o;
    r->run = run;
    r->cached = -1;
    char *body = build_body(o, req, prompt_len, gen_len), *auth = NULL;
    if (!body || (o->api_key && asprintf(&auth, "Authorization: Bearer %s", o->api_key) < 0)) {
        free(body);
        return ks_fail(KS_ERR_NOMEM, "out of memory for a request");
    }
    const char *headers[] = {"Accept: text/event-stream", auth, NULL};
    struct httpc_request rq = {.method = "POST", .url = o->url, .headers = headers, .body = body,
                               .body_len = strlen(body)};
    struct httpc_stream_cb cb = {.on_sent = on_sent, .on_event = on_event, .on_done = on_done, .user = r};
    ks_status st = httpc_multi_start(run->m, &rq, BS_MAX_EVENT, &cb);
    free(body);
    free(auth);
    if (st)
        snprintf(r->why, sizeof r->why, "%s", ks_errmsg());
    return st;
}

/* Closed loop: at most --clients requests run at once, each sent no earlier than
 * its arrival time; the probe is extra, --probe-at seconds in. Returns when every
 * request (and the probe) is done. */
static ks_status run_requests(struct bs_run *run)
{
    const struct bs_opts *o = run->o;
    int next = 0;
    bool probe_due = o->probe_len > 0;
    run->t0 = httpc_now();
    for (;;) {
        double now = httpc_now();
        if (probe_due && now >= run->t0 + o->probe_at) {
            /* request index past the others, so its prompt shares nothing with them */
            run->probe.probe = true;
            start_request(run, &run->probe, o->requests + 1, o->probe_len, o->probe_gen);
            probe_due = false;
        }
        while (run->active < o->clients && next < o->requests && run->t0 + run->arrival[next] <= now) {
            if (start_request(run, &run->res[next], next, o->prompt_len, o->gen_len) == KS_OK)
                run->active++;
            next++;
        }
        if (!probe_due && next == o->requests && httpc_multi_running(run->m) == 0)
            return KS_OK;
        double wake = INFINITY;
        if (run->active < o->clients && next < o->requests)
            wake = run->t0 + run->arrival[next];
        if (probe_due && run->t0 + o->probe_at < wake)
            wake = run->t0 + o->probe_at;
        ks_status st = httpc_multi_step(run->m, wake - httpc_now());
        if (st)
            return st;
    }
}

static double pct(const double *sorted, int n, double p)
{
    if (n == 0)
        return NAN;
    int i = (int)ceil(p / 100.0 * n) - 1;
    return sorted[i < 0 ? 0 : i >= n ? n - 1 : i];
}

/* Inter-token gaps of one group of streams, and the longest wait. */
struct bs_lat {
    double *gap;
    int n, cap;
    double worst;
    long tokens;
};

static void lat_add(struct bs_lat *l, double gap, int k, double wait)
{
    if (l->n + k > l->cap) {
        int cap = l->cap ? l->cap : 1024;
        while (cap < l->n + k)
            cap *= 2;
        double *p = realloc(l->gap, (size_t)cap * sizeof *p);
        if (!p)
            return;
        l->gap = p;
        l->cap = cap;
    }
    for (int i = 0; i < k; i++)
        l->gap[l->n++] = gap;
    if (wait > l->worst)
        l->worst = wait;
    l->tokens += k;
}

/* Where a wait from `from` to `to` lies against the probe's prefill, the
 * time from sending the probe to its first token: 0 before, 1 overlapping
 * (during), 2 after. */
static int probe_phase(const struct bs_result *p, double from, double to)
{
    double end = p->t_send + (p->n_reads > 0 ? p->ttft : INFINITY);
    return to <= p->t_send ? 0 : from < end ? 1 : 2;
}

static void collect(const struct bs_run *run, const struct bs_result *r, struct bs_lat *all, struct bs_lat *phase)
{
    for (int j = 1; j < r->n_reads; j++) {
        double from = r->reads[j - 1].t, to = r->reads[j].t, g = to - from;
        int k = r->reads[j].k;
        lat_add(all, g / k, k, g);
        if (run->o->probe_len > 0)
            lat_add(&phase[probe_phase(&run->probe, from, to)], g / k, k, g);
    }
}

static void lat_sort(struct bs_lat *l)
{
    if (l->n > 1) /* gap is NULL while empty */
        qsort(l->gap, (size_t)l->n, sizeof *l->gap, bench_cmp_double);
}

static void lat_row(const char *name, const struct bs_lat *l)
{
    printf("| %s | %ld | %.1f | %.1f | %.1f |\n", name, l->tokens, pct(l->gap, l->n, 50) * 1e3,
           pct(l->gap, l->n, 99) * 1e3, l->worst * 1e3);
}

/* The streams' context grows while they decode, so their decode-only latency
 * is lower before the probe and higher after it; "during" lies between in
 * context, and is compared with both. */
static void report_probe(const struct bs_run *run, struct bs_lat *phase)
{
    const struct bs_result *p = &run->probe;
    for (int i = 0; i < 3; i++)
        lat_sort(&phase[i]);
    char during[64];
    snprintf(during, sizeof during, "during the %d-token prefill", run->o->probe_len);
    printf("\n| streams' latency | tokens | ITL p50 ms | ITL p99 ms | worst stall ms |\n|---|---|---|---|---|\n");
    lat_row("before it", &phase[0]);
    lat_row(during, &phase[1]);
    lat_row("after it", &phase[2]);
    const struct bs_lat *d = &phase[1];
    for (int i = 0; i < 3; i += 2) {
        const struct bs_lat *b = &phase[i];
        if (b->n == 0)
            continue;
        const char *name = i ? "after" : "before";
        printf("%sduring / %s: ITL p50 %.2fx, ITL p99 %.2fx, worst stall / %s p50 %.2fx\n", i ? "" : "\n", name,
               pct(d->gap, d->n, 50) / pct(b->gap, b->n, 50), pct(d->gap, d->n, 99) / pct(b->gap, b->n, 99),
               name, d->worst / pct(b->gap, b->n, 50));
    }
    if (p->ok)
        printf("long prompt: %d tokens, TTFT %.0f ms (%.0f prompt tok/s while the streams decode)\n", run->o->probe_len,
               p->ttft * 1e3, run->o->probe_len / p->ttft);
    else
        printf("long prompt: failed (no tokens)\n");
    if (phase[2].tokens == 0)
        printf("warning: the streams ended before the long prefill did; raise --gen-len for an 'after' baseline\n");
}

static void report(const struct bs_run *run, double wall)
{
    const struct bs_opts *o = run->o;
    int done = 0, n_ttft = 0;
    long tokens = 0, coalesced = 0;
    double *ttft = malloc(sizeof(double) * (size_t)(o->requests + 1));
    struct bs_lat all = {0}, phase[3] = {{0}};
    if (!ttft) {
        fprintf(stderr, "bench_serve: out of memory for the report\n");
        return;
    }
    for (int i = 0; i < o->requests; i++) {
        const struct bs_result *r = &run->res[i];
        tokens += r->tokens;
        for (int j = 0; j < r->n_reads; j++)
            coalesced += r->reads[j].k - 1;
        if (!r->ok)
            continue;
        done++;
        ttft[n_ttft++] = r->ttft;
        collect(run, r, &all, phase);
    }
    qsort(ttft, (size_t)n_ttft, sizeof *ttft, bench_cmp_double);
    lat_sort(&all);
    printf("| clients | prompt | gen | prefix | rate | done | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | worst stall ms | batched tok %% | tok/s |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    printf("| %d | %d | %d | %d | %g | %d/%d | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f |\n", o->clients,
           o->prompt_len, o->gen_len, o->shared_prefix, o->rate, done, o->requests, pct(ttft, n_ttft, 50) * 1e3,
           pct(ttft, n_ttft, 99) * 1e3, pct(all.gap, all.n, 50) * 1e3, pct(all.gap, all.n, 99) * 1e3, all.worst * 1e3,
           tokens ? 100.0 * (double)coalesced / (double)tokens : 0.0, (double)tokens / wall);
    if (o->probe_len > 0)
        report_probe(run, phase);
    free(ttft);
    free(all.gap);
    for (int i = 0; i < 3; i++)
        free(phase[i].gap);
}

/* --out: "index cached "text"" per request, the text as a JSON string (one line whatever it holds). */
static bool write_out(const struct bs_run *run)
{
    FILE *f = fopen(run->o->out_path, "w");
    bool ok = f != NULL;
    for (int i = 0; ok && i < run->o->requests; i++) {
        const struct bs_result *r = &run->res[i];
        cJSON *s = cJSON_CreateString(r->text ? r->text : "");
        char *q = s ? cJSON_PrintUnformatted(s) : NULL;
        ok = q && fprintf(f, "%d %d %s\n", i, r->cached, q) > 0;
        free(q);
        cJSON_Delete(s);
    }
    if (f && fclose(f))
        ok = false;
    return ok;
}

static int parse_args(int argc, char **argv, struct bs_opts *o)
{
    *o = (struct bs_opts){.clients = 8, .prompt_len = 128, .gen_len = 128, .model = "", .seed = 1,
                          .probe_gen = 4, .probe_at = 2.0f};
    bool have_url = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        bool ok;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            bs_usage(stdout);
            return -1;
        }
        if (!v) {
            fprintf(stderr, "bench_serve: %s needs a value\n\n", a);
            bs_usage(stderr);
            return 2;
        }
        i++;
        if (!strcmp(a, "--url")) ok = have_url = parse_url(v, o);
        else if (!strcmp(a, "--clients")) ok = cli_parse_int(v, 1, 4096, &o->clients);
        else if (!strcmp(a, "--prompt-len")) ok = cli_parse_int(v, 1, 1 << 20, &o->prompt_len);
        else if (!strcmp(a, "--gen-len")) ok = cli_parse_int(v, 1, 1 << 20, &o->gen_len);
        else if (!strcmp(a, "--shared-prefix")) ok = cli_parse_int(v, 0, 1 << 20, &o->shared_prefix);
        else if (!strcmp(a, "--requests")) ok = cli_parse_int(v, 1, 1 << 20, &o->requests);
        else if (!strcmp(a, "--rate")) ok = cli_parse_float(v, 0.0f, 1e6f, &o->rate);
        else if (!strcmp(a, "--model")) ok = (o->model = v) != NULL;
        else if (!strcmp(a, "--api-key")) ok = (o->api_key = v) != NULL;
        else if (!strcmp(a, "--seed")) ok = cli_parse_u64(v, &o->seed);
        else if (!strcmp(a, "--out")) ok = (o->out_path = v) != NULL;
        else if (!strcmp(a, "--probe-len")) ok = cli_parse_int(v, 0, 1 << 20, &o->probe_len);
        else if (!strcmp(a, "--probe-gen")) ok = cli_parse_int(v, 1, 1 << 20, &o->probe_gen);
        else if (!strcmp(a, "--probe-at")) ok = cli_parse_float(v, 0.0f, 1e5f, &o->probe_at);
        else {
            fprintf(stderr, "bench_serve: unknown option '%s'\n\n", a);
            bs_usage(stderr);
            return 2;
        }
        if (!ok) {
            fprintf(stderr, "bench_serve: bad value '%s' for %s\n\n", v, a);
            bs_usage(stderr);
            return 2;
        }
    }
    if (!have_url) {
        fprintf(stderr, "bench_serve: --url http://HOST:PORT is required\n\n");
        bs_usage(stderr);
        return 2;
    }
    if (o->shared_prefix > o->prompt_len)
        o->shared_prefix = o->prompt_len;
    if (!o->requests)
        o->requests = o->clients;
    return 0;
}

int main(int argc, char **argv)
{
    struct bs_opts o;
    int rc = parse_args(argc, argv, &o);
    if (rc)
        return rc < 0 ? 0 : rc;
    struct bs_run run = {.o = &o};
    run.arrival = calloc((size_t)o.requests, sizeof *run.arrival);
    run.res = calloc((size_t)o.requests, sizeof *run.res);
    if (!run.arrival || !run.res) {
        fprintf(stderr, "bench_serve: out of memory\n");
        return 1;
    }
    if (httpc_multi_create(&run.m)) {
        fprintf(stderr, "bench_serve: %s\n", ks_errmsg());
        return 1;
    }
    uint64_t x = o.seed | 1;
    double t = 0;
    for (int i = 0; i < o.requests; i++) {
        if (o.rate > 0) { /* exponential gaps, xorshift uniform */
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            t += -log(((double)(x >> 11) + 0.5) / 9007199254740992.0) / o.rate;
        }
        run.arrival[i] = o.rate > 0 ? t : 0;
    }
    if (run_requests(&run)) {
        fprintf(stderr, "bench_serve: %s\n", ks_errmsg());
        return 1;
    }
    report(&run, httpc_now() - run.t0);
    if (o.out_path && !write_out(&run)) {
        fprintf(stderr, "bench_serve: cannot write %s\n", o.out_path);
        return 1;
    }
    int failed = 0;
    const char *first = NULL;
    for (int i = 0; i < o.requests; i++) {
        if (!run.res[i].ok && !failed++)
            first = run.res[i].why;
        free(run.res[i].reads);
        free(run.res[i].text);
    }
    if (o.probe_len > 0 && !run.probe.ok && !failed++)
        first = run.probe.why;
    if (failed)
        fprintf(stderr, "bench_serve: %d request(s) failed (connection refused, HTTP error or no tokens); the first: %s\n",
                failed, first);
    free(run.probe.reads);
    free(run.res);
    free(run.arrival);
    httpc_multi_free(run.m);
    return failed ? 1 : 0;
}
