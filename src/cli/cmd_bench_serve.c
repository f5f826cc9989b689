/* kvserve bench-serve: a plain OpenAI-API load generator. N client threads
 * send streaming /v1/completions requests (prompt as token ids, so lengths are
 * exact on any server), optionally with a shared prefix and Poisson arrivals,
 * and report TTFT, inter-token latency, the worst decode stall and tok/s.
 * With --probe-len, one long prompt arrives --probe-at seconds in and the
 * streams' latency is split into "during its prefill" and "steady".
 *
 * Timing is per read: every SSE event is stamped with the time the recv()
 * that delivered it returned. When one read carries k token events after a
 * wait of G seconds, each of the k tokens counts as an inter-token gap of
 * G/k (not one G and k-1 zero gaps), and G itself is a candidate for the
 * worst stall (the longest a stream waited for anything). */
#include <arpa/inet.h>
#include <math.h>
#include <netdb.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "cli/args.h"
#include "cli/cli.h"

struct bs_opts {
    char host[256], base[256];
    int port;
    int clients, prompt_len, gen_len, shared_prefix, requests;
    float rate;               /* requests per second; 0 = send as fast as clients allow */
    const char *model, *api_key;
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
    bool ok;
    double t_send, ttft;
    struct bs_read *reads;
    int n_reads, cap_reads;
    int tokens;
};

struct bs_run {
    const struct bs_opts *o;
    pthread_mutex_t mu;
    int next;
    double t0;
    double *arrival;          /* seconds after t0 */
    struct bs_result *res;
    struct bs_result probe;
};

static void bs_usage(FILE *out)
{
    fprintf(out,
            "usage: kvserve bench-serve --url http://HOST:PORT [--clients N] [--prompt-len L] [--gen-len G]\n"
            "                           [--shared-prefix K] [--rate R] [--requests M] [--model NAME] [--api-key KEY]\n"
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
            "  --model NAME         model field of the requests (default \"default\")\n"
            "  --api-key KEY        sent as Authorization: Bearer KEY\n"
            "  --seed N             prompt / arrival seed (default 1)\n"
            "  --probe-len L        also send one request of L prompt tokens --probe-at seconds in\n"
            "                       and split the streams' latency into during its prefill / steady\n"
            "  --probe-at S         (default 2)\n"
            "  --probe-gen G        tokens the probe generates (default 4)\n");
}

static double bs_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static bool parse_url(const char *url, struct bs_opts *o)
{
    if (strncmp(url, "http://", 7) != 0)
        return false;
    const char *h = url + 7;
    const char *colon = strchr(h, ':'), *slash = strchr(h, '/');
    const char *hend = colon && (!slash || colon < slash) ? colon : slash ? slash : h + strlen(h);
    if (hend == h || (size_t)(hend - h) >= sizeof o->host)
        return false;
    memcpy(o->host, h, (size_t)(hend - h));
    o->host[hend - h] = '\0';
    o->port = 80;
    if (*hend == ':' && !cli_parse_int(strndupa(hend + 1, slash ? (size_t)(slash - hend - 1) : strlen(hend + 1)), 1,
                                       65535, &o->port))
        return false;
    snprintf(o->base, sizeof o->base, "%s", slash ? slash : "");
    size_t bl = strlen(o->base);
    if (bl && o->base[bl - 1] == '/')
        o->base[bl - 1] = '\0';
    if (!strstr(o->base, "/v1"))
        strncat(o->base, "/v1", sizeof o->base - strlen(o->base) - 1);
    return true;
}

static int bs_connect(const struct bs_opts *o)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    char port[16];
    snprintf(port, sizeof port, "%d", o->port);
    if (getaddrinfo(o->host, port, &hints, &ai) != 0)
        return -1;
    int fd = -1;
    for (struct addrinfo *a = ai; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd >= 0 && connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(ai);
    return fd;
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

static char *build_body(const struct bs_opts *o, int req, int prompt_len, int gen_len)
{
    size_t cap = 256 + (size_t)prompt_len * 8;
    char *b = malloc(cap);
    if (!b)
        return NULL;
    size_t n = (size_t)snprintf(b, cap, "{\"model\":\"%s\",\"stream\":true,\"max_tokens\":%d,\"temperature\":0,"
                                        "\"ignore_eos\":true,\"prompt\":[", o->model, gen_len);
    for (int i = 0; i < prompt_len; i++)
        n += (size_t)snprintf(b + n, cap - n, "%s%d", i ? "," : "", prompt_token(o, req, i));
    snprintf(b + n, cap - n, "]}");
    return b;
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

/* Incremental SSE scan over the (de-chunked) body: one content event = one
 * token (servers send one token per event). */
struct sse_state {
    char line[1 << 16];
    size_t n;
    double t_read;            /* when the current read returned */
    int read_id, last_token_read;
    struct bs_result *r;
    bool done;
};

static void sse_line(struct sse_state *s)
{
    s->line[s->n] = '\0';
    if (strncmp(s->line, "data: ", 6) != 0)
        return;
    const char *d = s->line + 6;
    if (!strncmp(d, "[DONE]", 6)) {
        s->done = true;
        return;
    }
    const char *t = strstr(d, "\"text\":\"");
    if (!t || t[8] == '"')
        return; /* no text in this event */
    add_token(s->r, s->t_read, s->last_token_read == s->read_id);
    s->last_token_read = s->read_id;
}

static void sse_feed(struct sse_state *s, const char *p, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (p[i] == '\n') {
            sse_line(s);
            s->n = 0;
        } else if (s->n + 1 < sizeof s->line) {
            s->line[s->n++] = p[i];
        }
    }
}

/* One request; HTTP/1.1 with chunked decoding. */
static void run_request(const struct bs_opts *o, int req, int prompt_len, int gen_len, struct bs_result *r)
{
    int fd = bs_connect(o);
    char *body = build_body(o, req, prompt_len, gen_len);
    if (fd < 0 || !body) {
        free(body);
        if (fd >= 0)
            close(fd);
        return;
    }
    char head[1024];
    char auth[300] = "";
    if (o->api_key)
        snprintf(auth, sizeof auth, "Authorization: Bearer %s\r\n", o->api_key);
    int hn = snprintf(head, sizeof head,
                      "POST %s/completions HTTP/1.1\r\nHost: %s\r\nConnection: close\r\nContent-Type: application/json\r\n"
                      "Accept: text/event-stream\r\n%sContent-Length: %zu\r\n\r\n",
                      o->base, o->host, auth, strlen(body));
    struct sse_state *s = calloc(1, sizeof *s);
    if (!s) {
        free(body);
        close(fd);
        return;
    }
    s->r = r;
    s->last_token_read = -1;
    r->t_send = bs_now();
    bool sent = send(fd, head, (size_t)hn, MSG_NOSIGNAL) == hn &&
                send(fd, body, strlen(body), MSG_NOSIGNAL) == (ssize_t)strlen(body);
    free(body);
    char buf[16384];
    char hdr[8192];
    size_t hl = 0;
    bool in_body = false, chunked = false;
    int status = 0;
    /* chunk decoder state */
    size_t chunk_left = 0;
    char size_line[32];
    size_t sl = 0;
    int crlf_skip = 0;
    while (sent && !s->done) {
        ssize_t k = recv(fd, buf, sizeof buf, 0);
        if (k <= 0)
            break;
        s->t_read = bs_now();
        s->read_id++;
        size_t i = 0;
        while (!in_body && i < (size_t)k) {
            if (hl + 1 < sizeof hdr)
                hdr[hl++] = buf[i];
            i++;
            if (hl >= 4 && !memcmp(hdr + hl - 4, "\r\n\r\n", 4)) {
                hdr[hl] = '\0';
                in_body = true;
                sscanf(hdr, "HTTP/1.%*d %d", &status);
                chunked = strcasestr(hdr, "transfer-encoding: chunked") != NULL;
            }
        }
        while (in_body && i < (size_t)k) {
            if (!chunked) {
                sse_feed(s, buf + i, (size_t)k - i);
                break;
            }
            if (crlf_skip > 0) {
                crlf_skip--;
                i++;
            } else if (chunk_left > 0) {
                size_t take = (size_t)k - i < chunk_left ? (size_t)k - i : chunk_left;
                sse_feed(s, buf + i, take);
                chunk_left -= take;
                i += take;
                if (chunk_left == 0)
                    crlf_skip = 2;
            } else {
                char c = buf[i++];
                if (c == '\n') {
                    size_line[sl] = '\0';
                    chunk_left = strtoul(size_line, NULL, 16);
                    sl = 0;
                    if (chunk_left == 0)
                        s->done = true;
                } else if (c != '\r' && sl + 1 < sizeof size_line) {
                    size_line[sl++] = c;
                }
            }
        }
    }
    close(fd);
    r->ok = status == 200 && r->tokens > 0;
    free(s);
}

static void *client_main(void *arg)
{
    struct bs_run *run = arg;
    for (;;) {
        pthread_mutex_lock(&run->mu);
        int req = run->next < run->o->requests ? run->next++ : -1;
        pthread_mutex_unlock(&run->mu);
        if (req < 0)
            return NULL;
        double wait = run->t0 + run->arrival[req] - bs_now();
        if (wait > 0)
            usleep((useconds_t)(wait * 1e6));
        run_request(run->o, req, run->o->prompt_len, run->o->gen_len, &run->res[req]);
    }
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
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
    qsort(l->gap, (size_t)l->n, sizeof *l->gap, cmp_double);
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
    qsort(ttft, (size_t)n_ttft, sizeof *ttft, cmp_double);
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

static void *probe_main(void *arg)
{
    struct bs_run *run = arg;
    double wait = run->t0 + run->o->probe_at - bs_now();
    if (wait > 0)
        usleep((useconds_t)(wait * 1e6));
    /* request index past the others, so its prompt shares nothing with them */
    run_request(run->o, run->o->requests + 1, run->o->probe_len, run->o->probe_gen, &run->probe);
    return NULL;
}

static int parse_args(int argc, char **argv, struct bs_opts *o)
{
    *o = (struct bs_opts){.clients = 8, .prompt_len = 128, .gen_len = 128, .model = "default", .seed = 1,
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
            fprintf(stderr, "kvserve bench-serve: %s needs a value\n\n", a);
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
        else if (!strcmp(a, "--probe-len")) ok = cli_parse_int(v, 0, 1 << 20, &o->probe_len);
        else if (!strcmp(a, "--probe-gen")) ok = cli_parse_int(v, 1, 1 << 20, &o->probe_gen);
        else if (!strcmp(a, "--probe-at")) ok = cli_parse_float(v, 0.0f, 1e5f, &o->probe_at);
        else {
            fprintf(stderr, "kvserve bench-serve: unknown option '%s'\n\n", a);
            bs_usage(stderr);
            return 2;
        }
        if (!ok) {
            fprintf(stderr, "kvserve bench-serve: bad value '%s' for %s\n\n", v, a);
            bs_usage(stderr);
            return 2;
        }
    }
    if (!have_url) {
        fprintf(stderr, "kvserve bench-serve: --url http://HOST:PORT is required\n\n");
        bs_usage(stderr);
        return 2;
    }
    if (o->shared_prefix > o->prompt_len)
        o->shared_prefix = o->prompt_len;
    if (!o->requests)
        o->requests = o->clients;
    return 0;
}

int cli_bench_serve(int argc, char **argv)
{
    struct bs_opts o;
    int rc = parse_args(argc, argv, &o);
    if (rc)
        return rc < 0 ? 0 : rc;
    struct bs_run run = {.o = &o};
    pthread_mutex_init(&run.mu, NULL);
    run.arrival = calloc((size_t)o.requests, sizeof *run.arrival);
    run.res = calloc((size_t)o.requests, sizeof *run.res);
    pthread_t *th = calloc((size_t)o.clients, sizeof *th);
    if (!run.arrival || !run.res || !th) {
        fprintf(stderr, "kvserve bench-serve: out of memory\n");
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
    run.t0 = bs_now();
    pthread_t probe;
    bool probing = o.probe_len > 0 && pthread_create(&probe, NULL, probe_main, &run) == 0;
    for (int i = 0; i < o.clients; i++)
        pthread_create(&th[i], NULL, client_main, &run);
    for (int i = 0; i < o.clients; i++)
        pthread_join(th[i], NULL);
    if (probing)
        pthread_join(probe, NULL);
    report(&run, bs_now() - run.t0);
    int failed = 0;
    for (int i = 0; i < o.requests; i++) {
        failed += !run.res[i].ok;
        free(run.res[i].reads);
    }
    failed += o.probe_len > 0 && !run.probe.ok;
    free(run.probe.reads);
    free(run.res);
    free(run.arrival);
    free(th);
    pthread_mutex_destroy(&run.mu);
    if (failed)
        fprintf(stderr, "kvserve bench-serve: %d request(s) failed (connection refused, HTTP error or no tokens)\n", failed);
    return failed ? 1 : 0;
}
