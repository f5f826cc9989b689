/* The shared tier: pages in Redis through libhiredis. Two connections, so a
 * lookup never waits behind a write: the lookup one belongs to the caller of
 * store_redis_get_chain (the scheduler), the write one to the writer thread.
 * Each times out after timeout_ms per call, and after a fault comes back only
 * when its backoff has passed, so a dead or stalled Redis costs a lookup at
 * most one timeout per backoff period and then nothing. */
#include <errno.h>
#include <hiredis/hiredis.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "store/store_internal.h"

enum {
    DEFAULT_TTL_S = 86400,
    DEFAULT_TIMEOUT_MS = 200,
    DEFAULT_QUEUE_BYTES = 64 << 20,
    WRITE_BATCH_ITEMS = 64,
    MAX_CHAIN = 4096,         /* pages of one lookup */
    HOST_CHARS = 256,
};
static const double BACKOFF_MIN_S = 0.1, BACKOFF_MAX_S = 5.0;
/* Before the first measurement: a fast LAN, so the first lookup reads and measures. */
static const double FIRST_RTT_S = 2e-4, FIRST_READ_BPS = 1e9;

/* A lookup is one MGET of the chain's keys: one round trip, no script. The
 * leading run of values is used, up to the first missing or bad one; values
 * past a gap (the chain's first pages evicted, its later ones not yet) come
 * back unused, once: the replica then computes and writes the gap again.
 * Passing the values through a Lua script (GET in a loop, stopping at the
 * first miss) made Redis build the reply 5-8x slower than MGET does (44 MB,
 * 62 pages of a 2,000-token prefix: 190-470 ms against 35-60 ms on a busy
 * 2-core machine), past the call's timeout before its first byte. */

/* The fault kinds, each logged once. */
enum event { EV_DOWN, EV_RECONNECT, EV_TIMEOUT, EV_ERROR, EV_FULL, EV_CORRUPT, EV_FOREIGN, EV_DROPPED };

struct redis_conn {
    redisContext *c;          /* NULL: down */
    double next_try;          /* monotonic s: no connect before */
    double backoff;           /* s: the wait after the next fault */
    bool was_down;            /* a later connect is a reconnect */
};

struct redis_item {
    struct redis_item *next;
    char key[STORE_REDIS_KEY_CHARS + 1];
    uint8_t *data;            /* header then payload; NULL: a DEL */
    size_t len;
};

struct store_redis {
    struct store_redis_config cfg;
    char host[HOST_CHARS];
    int port, db;
    char *password;
    bool keyed;
    uint8_t secret[XXH3_SECRET_DEFAULT_SIZE];
    struct timeval timeout;
    struct redis_conn rd, wr;

    pthread_mutex_t mu;
    pthread_cond_t wake, done;
    pthread_t writer;
    bool writer_started, stop;
    bool writer_down;         /* mirrors of the connections' state for other threads (mu) */
    double writer_retry_at;
    struct redis_item *queue, *queue_tail;
    size_t queue_bytes;
    uint64_t queued_seq, done_seq;
    struct store_redis_stats st;
    unsigned logged;          /* bit per enum event */
    double rtt_s, read_bps;   /* EWMA of the measured round trip and read throughput */
    double page_bytes;        /* EWMA of a value's size (written or read): a lookup's cost before the call */
};

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static const uint8_t *secret_of(const struct store_redis *r) { return r->keyed ? r->secret : NULL; }

/* ---- the URL ------------------------------------------------------------------ */

static ks_status parse_number(const char *s, size_t n, long lo, long hi, const char *what, const char *url,
                              long *out)
{
    long v = 0;
    if (n == 0 || n > 5)
        return ks_fail(KS_ERR_INVALID_ARG, "--cache-redis %s: the %s must be a number from %ld to %ld", url, what,
                       lo, hi);
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9')
            return ks_fail(KS_ERR_INVALID_ARG, "--cache-redis %s: the %s must be a number from %ld to %ld", url,
                           what, lo, hi);
        v = v * 10 + (s[i] - '0');
    }
    if (v < lo || v > hi)
        return ks_fail(KS_ERR_INVALID_ARG, "--cache-redis %s: the %s %ld is not in %ld..%ld", url, what, v, lo, hi);
    *out = v;
    return KS_OK;
}

ks_status store_redis_parse_url(const char *url, char *host, size_t host_cap, int *port, int *db)
{
    static const char scheme[] = "redis://";
    if (!url || strncmp(url, scheme, sizeof scheme - 1))
        return ks_fail(KS_ERR_INVALID_ARG, "--cache-redis %s: give redis://HOST:PORT[/DB]", url ? url : "(null)");
    if (strchr(url, '@'))
        return ks_fail(KS_ERR_INVALID_ARG, "--cache-redis: a password never goes on the command line; put it in "
                       "--cache-redis-password-file FILE or the environment variable KVSERVE_REDIS_PASSWORD");
    const char *h = url + sizeof scheme - 1, *h_end;
    if (*h == '[') { /* [IPv6] */
        h_end = strchr(h, ']');
        if (!h_end)
            return ks_fail(KS_ERR_INVALID_ARG, "--cache-redis %s: an IPv6 host needs its closing ]", url);
        h++;
    } else {
        h_end = h + strcspn(h, ":/");
    }
    size_t hn = (size_t)(h_end - h);
    if (hn == 0 || hn >= host_cap)
        return ks_fail(KS_ERR_INVALID_ARG, "--cache-redis %s: the host is empty or longer than %zu characters", url,
                       host_cap - 1);
    memcpy(host, h, hn);
    host[hn] = '\0';
    const char *p = h_end + (*h_end == ']');
    long v = 6379;
    ks_status st = KS_OK;
    if (*p == ':') {
        size_t n = strcspn(p + 1, "/");
        if ((st = parse_number(p + 1, n, 1, 65535, "port", url, &v)))
            return st;
        p += 1 + n;
    }
    *port = (int)v;
    v = 0;
    if (*p == '/' && p[1] && (st = parse_number(p + 1, strlen(p + 1), 0, 65535, "database number", url, &v)))
        return st;
    if (*p && *p != '/')
        return ks_fail(KS_ERR_INVALID_ARG, "--cache-redis %s: unexpected \"%s\" after the host", url, p);
    *db = (int)v;
    return KS_OK;
}

/* ---- events and connections ----------------------------------------------------- */

static void note(struct store_redis *r, enum event ev, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* mu held. */
static void note(struct store_redis *r, enum event ev, const char *fmt, ...)
{
    if (r->logged & (1u << ev))
        return;
    r->logged |= 1u << ev;
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "kvserve: Redis tier redis://%s:%d/%d: %s (logged once; see /metrics)\n", r->host, r->port, r->db,
            msg);
}

/* Send one command and want a status or integer reply (AUTH, SELECT). */
static bool command_ok(redisContext *c, char *why, size_t cap, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    redisReply *rep = redisvCommand(c, fmt, ap);
    va_end(ap);
    bool ok = rep && rep->type != REDIS_REPLY_ERROR;
    if (!ok)
        snprintf(why, cap, "%s", rep ? rep->str : c->errstr);
    freeReplyObject(rep);
    return ok;
}

/* mu held: what other threads may read of a connection's state. */
static void mirror_state(struct store_redis *r, const struct redis_conn *cn)
{
    if (cn == &r->rd) {
        r->st.connected = cn->c != NULL;
    } else {
        r->writer_down = cn->c == NULL;
        r->writer_retry_at = cn->next_try;
    }
}

static void conn_backoff(struct redis_conn *cn)
{
    cn->next_try = mono_s() + cn->backoff;
    cn->backoff = cn->backoff * 2 > BACKOFF_MAX_S ? BACKOFF_MAX_S : cn->backoff * 2;
    if (cn->backoff < BACKOFF_MIN_S)
        cn->backoff = BACKOFF_MIN_S;
    cn->was_down = true;
}

/* After a failed call: the connection is out of step with its replies. */
static void conn_fault(struct store_redis *r, struct redis_conn *cn, const char *during)
{
    bool timeout = cn->c && cn->c->err == REDIS_ERR_IO &&
                   (errno == EAGAIN || errno == EWOULDBLOCK || strstr(cn->c->errstr, "temporarily unavailable"));
    char why[128];
    snprintf(why, sizeof why, "%s", cn->c ? cn->c->errstr : "no connection");
    redisFree(cn->c);
    cn->c = NULL;
    conn_backoff(cn);
    pthread_mutex_lock(&r->mu);
    mirror_state(r, cn);
    if (timeout) {
        r->st.timeouts++;
        note(r, EV_TIMEOUT, "a %s took longer than %u ms; serving from the local tiers and compute, retrying with "
             "backoff", during, r->cfg.timeout_ms);
    } else {
        r->st.errors++;
        note(r, EV_ERROR, "%s failed (%s); serving from the local tiers and compute, retrying with backoff", during,
             why);
    }
    pthread_mutex_unlock(&r->mu);
}

redisContext *store_redis_connect(const char *host, int port, const struct timeval *timeout, const char *password,
                                  int db, char *why, size_t cap)
{
    redisContext *c = redisConnectWithTimeout(host, port, *timeout);
    why[0] = '\0';
    if (!c)
        snprintf(why, cap, "out of memory");
    else if (c->err)
        snprintf(why, cap, "%s", c->errstr);
    else if (redisSetTimeout(c, *timeout) != REDIS_OK)
        snprintf(why, cap, "cannot set the timeout: %s", c->errstr);
    else if (password && !command_ok(c, why, cap, "AUTH %s", password)) {
        /* why says it */
    } else if (db) {
        (void)command_ok(c, why, cap, "SELECT %d", db);
    }
    if (!why[0])
        return c;
    redisFree(c);
    return NULL;
}

static void ewma(double *avg, double sample)
{
    *avg = *avg <= 0.0 ? sample : 0.8 * *avg + 0.2 * sample;
}

/* The lookup connection's first command, PING: a first measure of the round
 * trip. false: the connection failed. */
static bool first_rtt(struct store_redis *r, redisContext *c, char *why, size_t cap)
{
    double t0 = mono_s();
    redisReply *rep = redisCommand(c, "PING");
    if (!rep) {
        snprintf(why, cap, "PING: %s", c->errstr);
        return false;
    }
    pthread_mutex_lock(&r->mu);
    ewma(&r->rtt_s, mono_s() - t0);
    pthread_mutex_unlock(&r->mu);
    freeReplyObject(rep);
    return true;
}

/* Connect (with AUTH and SELECT; the lookup one measures the round trip) unless the
 * backoff forbids it. */
static bool conn_ready(struct store_redis *r, struct redis_conn *cn)
{
    if (cn->c)
        return true;
    if (mono_s() < cn->next_try)
        return false;
    char why[256];
    redisContext *c = store_redis_connect(r->host, r->port, &r->timeout, r->password, r->db, why, sizeof why);
    if (c && cn == &r->rd && !first_rtt(r, c, why, sizeof why)) {
        redisFree(c);
        c = NULL;
    }
    if (!c) {
        conn_backoff(cn);
        pthread_mutex_lock(&r->mu);
        r->st.connect_failures++;
        mirror_state(r, cn);
        note(r, EV_DOWN, "cannot connect (%s); serving from the local tiers and compute, retrying with backoff", why);
        pthread_mutex_unlock(&r->mu);
        return false;
    }
    cn->c = c;
    cn->backoff = BACKOFF_MIN_S;
    pthread_mutex_lock(&r->mu);
    mirror_state(r, cn);
    if (cn->was_down) {
        r->st.reconnects++;
        note(r, EV_RECONNECT, "connected again");
    }
    pthread_mutex_unlock(&r->mu);
    return true;
}

/* ---- writing behind ------------------------------------------------------------ */

static void free_items(struct redis_item *it)
{
    while (it) {
        struct redis_item *next = it->next;
        free(it->data);
        free(it);
        it = next;
    }
}

/* The checksum is made here, off the caller's thread. */
static void seal(const struct store_redis *r, struct redis_item *it)
{
    struct store_header h;
    memcpy(&h, it->data, sizeof h);
    h.checksum = store_blob_checksum(&h, it->data + sizeof h, secret_of(r));
    memcpy(it->data, &h, sizeof h);
}

/* One SET's or DEL's reply. */
static void count_reply(struct store_redis *r, const struct redis_item *it, const redisReply *rep)
{
    pthread_mutex_lock(&r->mu);
    if (!it->data) {
        /* a DEL: nothing to count */
    } else if (rep->type == REDIS_REPLY_STATUS) {
        r->st.writes++;
        r->st.write_bytes += it->len;
    } else if (rep->type == REDIS_REPLY_NIL) {
        r->st.deduplicated++;
    } else if (rep->type == REDIS_REPLY_ERROR && !strncmp(rep->str, "OOM", 3)) {
        r->st.full++;
        note(r, EV_FULL, "Redis is full (%s); pages are not shared until it has room (maxmemory-policy allkeys-lru "
             "makes room by itself)", rep->str);
    } else if (rep->type == REDIS_REPLY_ERROR) {
        r->st.errors++;
        note(r, EV_ERROR, "Redis refused a write: %s", rep->str);
    }
    pthread_mutex_unlock(&r->mu);
}

/* Pipeline the batch's commands, then read their replies. */
static void write_batch(struct store_redis *r, struct redis_item *batch, int n)
{
    int sent = 0;
    bool appended = conn_ready(r, &r->wr);
    for (struct redis_item *it = batch; appended && it; it = it->next) {
        if (it->data) {
            seal(r, it);
            appended = redisAppendCommand(r->wr.c, "SET %s %b NX EX %u", it->key, it->data, it->len,
                                          r->cfg.ttl_s) == REDIS_OK;
        } else {
            appended = redisAppendCommand(r->wr.c, "DEL %s", it->key) == REDIS_OK;
        }
    }
    if (!appended && r->wr.c)
        conn_fault(r, &r->wr, "write"); /* out of memory for the pipeline: start afresh */
    if (appended) {
        int got = 0;
        for (struct redis_item *it = batch; it; it = it->next, got++) {
            redisReply *rep = NULL;
            if (redisGetReply(r->wr.c, (void **)&rep) != REDIS_OK || !rep) {
                conn_fault(r, &r->wr, "write");
                break;
            }
            count_reply(r, it, rep);
            freeReplyObject(rep);
        }
        sent = got;
    }
    pthread_mutex_lock(&r->mu);
    uint64_t lost = 0;
    int i = 0;
    for (struct redis_item *it = batch; it; it = it->next, i++)
        lost += i >= sent && it->data;
    r->st.dropped += lost;
    if (lost)
        note(r, EV_DROPPED, "pages not written: Redis is down or slow (counted in dropped)");
    r->done_seq += (uint64_t)n;
    pthread_cond_broadcast(&r->done);
    pthread_mutex_unlock(&r->mu);
}

static void *writer_main(void *arg)
{
    struct store_redis *r = arg;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        while (!r->queue && !r->stop)
            pthread_cond_wait(&r->wake, &r->mu);
        if (!r->queue)
            break;
        struct redis_item *batch = r->queue, *last = batch;
        int n = 1;
        r->queue_bytes -= batch->len;
        while (last->next && n < WRITE_BATCH_ITEMS) {
            last = last->next;
            r->queue_bytes -= last->len;
            n++;
        }
        r->queue = last->next;
        if (!r->queue)
            r->queue_tail = NULL;
        last->next = NULL;
        pthread_mutex_unlock(&r->mu);
        write_batch(r, batch, n);
        free_items(batch);
        pthread_mutex_lock(&r->mu);
    }
    pthread_mutex_unlock(&r->mu);
    redisFree(r->wr.c);
    r->wr.c = NULL;
    return NULL;
}

static void enqueue(struct store_redis *r, struct redis_item *it)
{
    if (r->queue_tail)
        r->queue_tail->next = it;
    else
        r->queue = it;
    r->queue_tail = it;
    r->queue_bytes += it->len;
    r->queued_seq++;
    pthread_cond_signal(&r->wake);
}

ks_status store_redis_put(struct store_redis *r, struct store_key key, struct store_key parent, uint32_t n_tokens,
                          const void *blob, size_t len)
{
    size_t total = sizeof(struct store_header) + len;
    pthread_mutex_lock(&r->mu);
    /* while the writer's connection is down and backing off, a page would only wait to be dropped */
    bool drop = r->queue_bytes + total > r->cfg.queue_bytes || (r->writer_down && mono_s() < r->writer_retry_at);
    if (drop) {
        r->st.dropped++;
        note(r, EV_DROPPED, "pages not written: the write queue is full or Redis is down (counted in dropped)");
    }
    pthread_mutex_unlock(&r->mu);
    if (drop)
        return KS_OK;
    struct redis_item *it = calloc(1, sizeof *it);
    uint8_t *data = it ? malloc(total) : NULL;
    if (!data) {
        free(it);
        return ks_fail(KS_ERR_NOMEM, "Redis tier: out of memory for a queued page");
    }
    struct store_header h = store_blob_header(r->cfg.fingerprint, key, parent, n_tokens, len, r->keyed);
    memcpy(data, &h, sizeof h);
    memcpy(data + sizeof h, blob, len);
    it->data = data;
    it->len = total;
    store_redis_key_name(r->cfg.fingerprint, key, it->key);
    pthread_mutex_lock(&r->mu);
    ewma(&r->page_bytes, (double)total);
    enqueue(r, it);
    pthread_mutex_unlock(&r->mu);
    return KS_OK;
}

static void queue_delete(struct store_redis *r, const char *key)
{
    struct redis_item *it = calloc(1, sizeof *it);
    if (!it)
        return; /* the bad value stays until its TTL: it is checked on every read */
    memcpy(it->key, key, sizeof it->key);
    pthread_mutex_lock(&r->mu);
    enqueue(r, it);
    pthread_mutex_unlock(&r->mu);
}

void store_redis_flush(struct store_redis *r)
{
    pthread_mutex_lock(&r->mu);
    uint64_t target = r->queued_seq;
    pthread_cond_signal(&r->wake);
    while (r->done_seq < target)
        pthread_cond_wait(&r->done, &r->mu);
    pthread_mutex_unlock(&r->mu);
}

/* ---- looking a chain up ---------------------------------------------------------- */

/* How many of a chain's n pages to read at most, decided before the call
 * from the measured round trip, read speed and page size: reading k pages
 * costs rtt + k * bytes / speed, computing them k * page_compute_s. Per page
 * reading is either cheaper than computing or not (then 0: no call at all);
 * when it is, the round trip is paid back after rtt / (page_compute_s - per
 * page read time) pages, so a chain shorter than that is not worth the call
 * either, and a longer one is read whole. */
static int32_t pages_worth(struct store_redis *r, int32_t n, double page_compute_s)
{
    if (page_compute_s <= 0.0)
        return n;
    pthread_mutex_lock(&r->mu);
    double rtt = r->rtt_s > 0 ? r->rtt_s : FIRST_RTT_S, bps = r->read_bps > 0 ? r->read_bps : FIRST_READ_BPS;
    double page_read_s = r->page_bytes / bps;
    pthread_mutex_unlock(&r->mu);
    double gain = page_compute_s - page_read_s;
    if (gain <= 0.0 || rtt >= (double)n * gain)
        return 0;
    return n;
}

/* A value that fails its check: counted, logged once and deleted. */
static void reject(struct store_redis *r, const char *name, enum store_blob_verdict v)
{
    pthread_mutex_lock(&r->mu);
    if (v == STORE_BLOB_FOREIGN) {
        r->st.foreign++;
        note(r, EV_FOREIGN, "%s holds another model's, format's, key's or keying's page (a replica with another "
             "--cache-redis-secret-file?); not used, deleted, computed instead", name);
    } else {
        r->st.corrupt++;
        note(r, EV_CORRUPT, "%s holds a damaged page (length or checksum); not used, deleted, computed instead",
             name);
    }
    pthread_mutex_unlock(&r->mu);
    queue_delete(r, name);
}

/* MGET's reply {value 1 or nil, ...}: the verified payloads of the leading
 * run into blobs[] up to the first bad one (counted and deleted). Returns
 * them; *run: the pages present in the chain's leading run, and *bytes the
 * bytes of the values taken. */
static int32_t take_values(struct store_redis *r, const redisReply *rep, char (*names)[STORE_REDIS_KEY_CHARS + 1],
                           const struct store_key *keys, int32_t n, void **blobs, size_t *lens, int32_t *run,
                           size_t *bytes)
{
    *run = 0;
    *bytes = 0;
    if (rep->type != REDIS_REPLY_ARRAY || rep->elements != (size_t)n) {
        pthread_mutex_lock(&r->mu);
        r->st.errors++;
        note(r, EV_ERROR, "the lookup (MGET) answered %s; serving from the local tiers and compute",
             rep->type == REDIS_REPLY_ERROR ? rep->str : "something else than one value per key");
        pthread_mutex_unlock(&r->mu);
        return 0;
    }
    while (*run < n && rep->element[*run]->type == REDIS_REPLY_STRING)
        (*run)++;
    int32_t got = 0;
    for (int32_t k = 0; k < *run; k++) {
        const redisReply *v = rep->element[k];
        enum store_blob_verdict verdict = store_blob_check(v->str, v->len, r->cfg.fingerprint, keys[k],
                                                           secret_of(r));
        if (verdict != STORE_BLOB_OK) {
            reject(r, names[k], verdict);
            break;
        }
        size_t len = v->len - sizeof(struct store_header);
        void *copy = malloc(len ? len : 1);
        if (!copy)
            break;
        memcpy(copy, v->str + sizeof(struct store_header), len);
        blobs[got] = copy;
        lens[got++] = len;
        *bytes += v->len;
    }
    return got;
}

/* The measured round trip (a reply without pages) or read speed (the time
 * past one round trip, for the pages' bytes). */
static void measure(struct store_redis *r, double dt, size_t bytes, int32_t got)
{
    pthread_mutex_lock(&r->mu);
    if (bytes == 0) {
        ewma(&r->rtt_s, dt);
    } else {
        double transfer = dt - (r->rtt_s > 0 ? r->rtt_s : FIRST_RTT_S);
        ewma(&r->read_bps, (double)bytes / (transfer > dt * 0.1 ? transfer : dt * 0.1));
        ewma(&r->page_bytes, (double)bytes / got);
    }
    pthread_mutex_unlock(&r->mu);
}

int32_t store_redis_get_chain(struct store_redis *r, const struct store_key *keys, int32_t n, double page_compute_s,
                              void **blobs, size_t *lens)
{
    if (!r || n <= 0)
        return 0;
    if (n > MAX_CHAIN)
        n = MAX_CHAIN;
    pthread_mutex_lock(&r->mu);
    r->st.lookups++;
    pthread_mutex_unlock(&r->mu);
    if (pages_worth(r, n, page_compute_s) == 0) {
        pthread_mutex_lock(&r->mu);
        r->st.declined++;
        pthread_mutex_unlock(&r->mu);
        return 0;
    }
    if (!conn_ready(r, &r->rd))
        return 0;
    /* MGET key_1 .. key_n */
    int argc = n + 1;
    const char **argv = malloc((size_t)argc * sizeof *argv);
    size_t *arglens = malloc((size_t)argc * sizeof *arglens);
    char (*names)[STORE_REDIS_KEY_CHARS + 1] = malloc((size_t)n * sizeof *names);
    int32_t got = 0, run = -1;
    size_t bytes = 0;
    if (argv && arglens && names) {
        argv[0] = "MGET";
        arglens[0] = 4;
        for (int32_t i = 0; i < n; i++) {
            store_redis_key_name(r->cfg.fingerprint, keys[i], names[i]);
            argv[1 + i] = names[i];
            arglens[1 + i] = STORE_REDIS_KEY_CHARS;
        }
        double t0 = mono_s();
        redisReply *rep = redisCommandArgv(r->rd.c, argc, argv, arglens);
        pthread_mutex_lock(&r->mu);
        r->st.round_trips += rep != NULL;
        pthread_mutex_unlock(&r->mu);
        if (!rep) {
            conn_fault(r, &r->rd, "lookup");
        } else {
            got = take_values(r, rep, names, keys, n, blobs, lens, &run, &bytes);
            measure(r, mono_s() - t0, bytes, got);
        }
        freeReplyObject(rep);
    }
    pthread_mutex_lock(&r->mu);
    r->st.reads += (uint64_t)got;
    r->st.read_bytes += bytes;
    r->st.hits += (uint64_t)got;
    r->st.misses += run >= 0 && run < n;
    pthread_mutex_unlock(&r->mu);
    free(argv);
    free(arglens);
    free(names);
    return got;
}

/* ---- open, close, stats --------------------------------------------------------- */

ks_status store_redis_open(const struct store_redis_config *cfg, struct store_redis **out)
{
    *out = NULL;
    struct store_redis *r = calloc(1, sizeof *r);
    if (!r)
        return ks_fail(KS_ERR_NOMEM, "Redis tier: out of memory");
    r->cfg = *cfg;
    r->cfg.ttl_s = cfg->ttl_s ? cfg->ttl_s : DEFAULT_TTL_S;
    r->cfg.timeout_ms = cfg->timeout_ms ? cfg->timeout_ms : DEFAULT_TIMEOUT_MS;
    r->cfg.queue_bytes = cfg->queue_bytes ? cfg->queue_bytes : DEFAULT_QUEUE_BYTES;
    r->timeout = (struct timeval){r->cfg.timeout_ms / 1000, (r->cfg.timeout_ms % 1000) * 1000};
    r->rd.backoff = r->wr.backoff = BACKOFF_MIN_S;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->wake, NULL);
    pthread_cond_init(&r->done, NULL);
    ks_status st = store_redis_parse_url(cfg->url, r->host, sizeof r->host, &r->port, &r->db);
    if (!st && cfg->password && cfg->password[0] && !(r->password = strdup(cfg->password)))
        st = ks_fail(KS_ERR_NOMEM, "Redis tier: out of memory");
    if (!st && cfg->secret_file) {
        r->keyed = true;
        st = store_blob_load_secret(cfg->secret_file, r->secret);
    }
    r->cfg.url = r->cfg.password = r->cfg.secret_file = NULL; /* borrowed strings: not kept */
    if (!st && pthread_create(&r->writer, NULL, writer_main, r) != 0)
        st = ks_fail(KS_ERR_NOMEM, "Redis tier: cannot start its writer thread");
    r->writer_started = !st;
    if (st) {
        store_redis_close(r);
        return st;
    }
    conn_ready(r, &r->rd); /* says so once now if Redis is down at start */
    *out = r;
    return KS_OK;
}

void store_redis_close(struct store_redis *r)
{
    if (!r)
        return;
    if (r->writer_started) {
        pthread_mutex_lock(&r->mu);
        r->stop = true;
        pthread_cond_signal(&r->wake);
        pthread_mutex_unlock(&r->mu);
        pthread_join(r->writer, NULL);
    }
    free_items(r->queue);
    redisFree(r->rd.c);
    redisFree(r->wr.c);
    if (r->password)
        memset(r->password, 0, strlen(r->password));
    free(r->password);
    memset(r->secret, 0, sizeof r->secret);
    pthread_cond_destroy(&r->wake);
    pthread_cond_destroy(&r->done);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

bool store_redis_keyed_digest(const struct store_redis *r, const void *data, size_t n, struct store_key *out)
{
    if (!r->keyed)
        return false;
    XXH128_hash_t h = XXH3_128bits_withSecret(data, n, r->secret, sizeof r->secret);
    *out = (struct store_key){h.low64, h.high64};
    return true;
}

ks_status store_secret_file_digest(const char *secret_file, const void *data, size_t n, struct store_key *out)
{
    uint8_t secret[XXH3_SECRET_DEFAULT_SIZE];
    ks_status st = store_blob_load_secret(secret_file, secret);
    if (!st) {
        XXH128_hash_t h = XXH3_128bits_withSecret(data, n, secret, sizeof secret);
        *out = (struct store_key){h.low64, h.high64};
    }
    memset(secret, 0, sizeof secret);
    return st;
}

void store_redis_stats(struct store_redis *r, struct store_redis_stats *out)
{
    pthread_mutex_lock(&r->mu);
    *out = r->st;
    out->rtt_ms = r->rtt_s * 1e3;
    out->read_mbs = r->read_bps / 1e6;
    pthread_mutex_unlock(&r->mu);
}
