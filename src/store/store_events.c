/* KV events: the set of chain keys this replica holds, mirrored here (the
 * scheduler's thread adds and removes under a mutex), and a writer thread
 * that turns the changes into XADD entries of a Redis stream (store.h
 * describes the protocol). The connection is the Redis tier's kind (timeout
 * per call, AUTH, SELECT, backoff 0.1 s doubling to 5 s), but its own: an
 * event stream must not wait behind page writes, nor a page behind events. */
#include <errno.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "store/store_internal.h"

enum {
    DEFAULT_TIMEOUT_MS = 200,
    DEFAULT_MAXLEN = 10000,
    DEFAULT_SNAPSHOT_S = 10,
    DEFAULT_FLUSH_MS = 20,
    MAX_PENDING = 1 << 16,    /* deltas queued at most; beyond, a snapshot replaces them */
    SET_MIN_CAP = 1024,
    KEY_BYTES = 16,
    HOST_CHARS = 256,
    ARGV_MAX = 16,
};
static const double BACKOFF_MIN_S = 0.1, BACKOFF_MAX_S = 5.0;

/* The logged-once kinds. */
enum note_kind { NOTE_DOWN, NOTE_ERROR, NOTE_RECONNECT, NOTE_LOST };

struct delta {
    struct store_key key;
    bool held;
};

/* Open addressing over keys, {0, 0} an empty slot (a real key is never zero
 * but for 2^-128; such a key is simply not mirrored). */
struct key_set {
    struct store_key *slots;
    uint32_t cap, n;
};

struct store_events {
    struct store_events_config cfg;
    char host[HOST_CHARS];
    int port, db;
    char *password, *replica;
    uint8_t layout[64];
    char stream[STORE_EVENTS_STREAM_CHARS + 1];
    struct timeval timeout;
    redisContext *c;          /* the writer's; NULL: down */
    double next_try, backoff;
    bool was_down;
    uint64_t epoch, seq;      /* seq: the writer's */

    pthread_mutex_t mu;
    pthread_cond_t wake, done;
    pthread_t writer;
    bool writer_started, stop;
    struct key_set held;      /* mu */
    struct delta *pending;    /* mu: (MAX_PENDING) */
    uint32_t n_pending;
    bool want_snapshot;       /* mu: deltas were lost, or a flush asked */
    uint64_t asked, answered; /* mu: flush requests */
    struct store_events_stats st;
    unsigned logged;
};

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void store_events_stream(const uint8_t fingerprint[16], char *out)
{
    memcpy(out, "kvserve:events:", 15);
    for (int i = 0; i < 16; i++)
        snprintf(out + 15 + 2 * i, 3, "%02x", fingerprint[i]);
}

/* ---- the entry codec ------------------------------------------------------------ */

static const char *const OP_NAMES[] = {"add", "del", "snap"};

int store_event_argv(const char *stream, uint32_t maxlen, const struct store_event *ev, char *scratch,
                     const char **argv, size_t *lens)
{
    int n = 0;
    char *maxlen_text = scratch, *epoch_text = scratch + 12, *seq_text = scratch + 34, *p_text = scratch + 56;
    snprintf(maxlen_text, 12, "%" PRIu32, maxlen);
    snprintf(epoch_text, 22, "%" PRIu64, ev->epoch);
    snprintf(seq_text, 22, "%" PRIu64, ev->seq);
    snprintf(p_text, 8, "%d", (int)(ev->page_tokens & 0xffff));
    const char *text[] = {"XADD", stream, "MAXLEN", "~", maxlen_text, "*", "replica", NULL, "epoch", epoch_text,
                          "seq", seq_text, "op", OP_NAMES[ev->op], "keys", NULL};
    for (; n < (int)(sizeof text / sizeof text[0]); n++) {
        argv[n] = text[n];
        lens[n] = text[n] ? strlen(text[n]) : 0;
    }
    argv[7] = ev->replica;
    lens[7] = ev->replica_len;
    argv[15] = (const char *)ev->keys;
    lens[15] = ev->n_keys * KEY_BYTES;
    if (ev->op == STORE_EVENT_SNAP) {
        argv[n] = "page_tokens";
        lens[n++] = 11;
        argv[n] = p_text;
        lens[n++] = strlen(p_text);
        argv[n] = "layout";
        lens[n++] = 6;
        argv[n] = (const char *)ev->layout;
        lens[n++] = ev->layout_len;
    }
    return n;
}

static bool parse_u64(const char *s, size_t n, uint64_t *out)
{
    uint64_t v = 0;
    if (n == 0 || n > 20)
        return false;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9' || v > (UINT64_MAX - (uint64_t)(s[i] - '0')) / 10)
            return false;
        v = v * 10 + (uint64_t)(s[i] - '0');
    }
    *out = v;
    return true;
}

static bool field_is(const char *name, size_t len, const char *want)
{
    return len == strlen(want) && !memcmp(name, want, len);
}

ks_status store_event_parse(const char *const *fields, const size_t *lens, size_t n_fields, struct store_event *out)
{
    memset(out, 0, sizeof *out);
    bool have_epoch = false, have_seq = false, have_op = false, have_keys = false;
    uint64_t p = 0;
    for (size_t i = 0; i + 1 < n_fields; i += 2) {
        const char *name = fields[i], *v = fields[i + 1];
        size_t nl = lens[i], vl = lens[i + 1];
        if (field_is(name, nl, "replica")) {
            out->replica = v;
            out->replica_len = vl;
        } else if (field_is(name, nl, "epoch")) {
            if (!(have_epoch = parse_u64(v, vl, &out->epoch)))
                return ks_fail(KS_ERR_FORMAT, "KV event: 'epoch' is not a number");
        } else if (field_is(name, nl, "seq")) {
            if (!(have_seq = parse_u64(v, vl, &out->seq)))
                return ks_fail(KS_ERR_FORMAT, "KV event: 'seq' is not a number");
        } else if (field_is(name, nl, "op")) {
            for (int op = 0; op < 3 && !have_op; op++)
                if ((have_op = field_is(v, vl, OP_NAMES[op])))
                    out->op = (enum store_event_op)op;
            if (!have_op)
                return ks_fail(KS_ERR_FORMAT, "KV event: 'op' is not add, del or snap");
        } else if (field_is(name, nl, "keys")) {
            if (vl % KEY_BYTES)
                return ks_fail(KS_ERR_FORMAT, "KV event: 'keys' is %zu bytes, not a multiple of %d", vl, KEY_BYTES);
            out->keys = (const uint8_t *)v;
            out->n_keys = vl / KEY_BYTES;
            have_keys = true;
        } else if (field_is(name, nl, "page_tokens")) {
            if (!parse_u64(v, vl, &p) || p < 1 || p > 65535)
                return ks_fail(KS_ERR_FORMAT, "KV event: 'page_tokens' is not a page size");
            out->page_tokens = (int32_t)p;
        } else if (field_is(name, nl, "layout")) {
            out->layout = (const uint8_t *)v;
            out->layout_len = vl;
        }
    }
    if (!out->replica || !out->replica_len || !have_epoch || !have_seq || !have_op || !have_keys)
        return ks_fail(KS_ERR_FORMAT, "KV event: a field of replica, epoch, seq, op, keys is missing");
    if (out->op == STORE_EVENT_SNAP && (!out->layout || !out->page_tokens))
        return ks_fail(KS_ERR_FORMAT, "KV event: a snapshot without 'layout' and 'page_tokens'");
    if (out->op != STORE_EVENT_SNAP) {
        out->layout = NULL;
        out->layout_len = 0;
        out->page_tokens = 0;
    }
    return KS_OK;
}

/* ---- the mirrored key set ------------------------------------------------------------ */

static bool key_zero(struct store_key k) { return !k.lo && !k.hi; }
static bool key_eq(struct store_key a, struct store_key b) { return a.lo == b.lo && a.hi == b.hi; }

static uint32_t set_find_slot(const struct key_set *s, struct store_key k)
{
    uint32_t i = (uint32_t)k.lo & (s->cap - 1);
    while (!key_zero(s->slots[i]) && !key_eq(s->slots[i], k))
        i = (i + 1) & (s->cap - 1);
    return i;
}

static bool set_grow(struct key_set *s)
{
    if ((uint64_t)(s->n + 1) * 2 < s->cap)
        return true;
    uint32_t cap = s->cap ? s->cap * 2 : SET_MIN_CAP;
    struct key_set bigger = {calloc(cap, sizeof(struct store_key)), cap, s->n};
    if (!bigger.slots)
        return false;
    for (uint32_t i = 0; i < s->cap; i++)
        if (!key_zero(s->slots[i]))
            bigger.slots[set_find_slot(&bigger, s->slots[i])] = s->slots[i];
    free(s->slots);
    *s = bigger;
    return true;
}

static bool set_add(struct key_set *s, struct store_key k)
{
    if (!set_grow(s))
        return false;
    uint32_t i = set_find_slot(s, k);
    if (key_zero(s->slots[i])) {
        s->slots[i] = k;
        s->n++;
    }
    return true;
}

/* Backward-shift deletion, as kv's page map. */
static void set_remove(struct key_set *s, struct store_key k)
{
    if (!s->cap)
        return;
    uint32_t mask = s->cap - 1, i = set_find_slot(s, k);
    if (key_zero(s->slots[i]))
        return;
    for (uint32_t j = (i + 1) & mask; !key_zero(s->slots[j]); j = (j + 1) & mask) {
        uint32_t home = (uint32_t)s->slots[j].lo & mask;
        if (((j - home) & mask) >= ((j - i) & mask)) {
            s->slots[i] = s->slots[j];
            i = j;
        }
    }
    s->slots[i] = (struct store_key){0, 0};
    s->n--;
}

static void put_key(uint8_t *out, struct store_key k)
{
    for (int b = 0; b < 8; b++) {
        out[b] = (uint8_t)(k.lo >> (8 * b));
        out[8 + b] = (uint8_t)(k.hi >> (8 * b));
    }
}

/* ---- notes, the connection ------------------------------------------------------------ */

/* mu held. */
static void note(struct store_events *e, enum note_kind kind, const char *what)
{
    if (e->logged & (1u << kind))
        return;
    e->logged |= 1u << kind;
    fprintf(stderr, "kvserve: KV events to redis://%s:%d/%d: %s (logged once)\n", e->host, e->port,
            e->db, what);
}

static void conn_down(struct store_events *e, bool connecting, const char *why)
{
    redisFree(e->c);
    e->c = NULL;
    e->next_try = mono_s() + e->backoff;
    e->backoff = e->backoff * 2 > BACKOFF_MAX_S ? BACKOFF_MAX_S : e->backoff * 2;
    e->was_down = true;
    char msg[384];
    snprintf(msg, sizeof msg, "%s (%s); routers see this replica's keys again after the next snapshot",
             connecting ? "cannot connect" : "a write failed", why);
    pthread_mutex_lock(&e->mu);
    e->st.connected = false;
    if (connecting)
        e->st.connect_failures++;
    else
        e->st.errors++;
    note(e, connecting ? NOTE_DOWN : NOTE_ERROR, msg);
    pthread_mutex_unlock(&e->mu);
}

static bool conn_ready(struct store_events *e)
{
    if (e->c)
        return true;
    if (mono_s() < e->next_try)
        return false;
    char why[256];
    e->c = store_redis_connect(e->host, e->port, &e->timeout, e->password, e->db, why, sizeof why);
    if (!e->c) {
        conn_down(e, true, why);
        return false;
    }
    e->backoff = BACKOFF_MIN_S;
    pthread_mutex_lock(&e->mu);
    e->st.connected = true;
    if (e->was_down) {
        e->st.reconnects++;
        note(e, NOTE_RECONNECT, "connected again");
    }
    pthread_mutex_unlock(&e->mu);
    return true;
}

/* ---- the writer ------------------------------------------------------------------------- */

/* One XADD; false when it failed (the connection is then down). */
static bool send_entry(struct store_events *e, enum store_event_op op, const uint8_t *keys, size_t n_keys)
{
    if (!conn_ready(e))
        return false;
    struct store_event ev = {.replica = e->replica, .replica_len = strlen(e->replica), .epoch = e->epoch,
                             .seq = e->seq + 1, .op = op, .keys = keys, .n_keys = n_keys};
    if (op == STORE_EVENT_SNAP) {
        ev.layout = e->layout;
        ev.layout_len = e->cfg.layout_len;
        ev.page_tokens = e->cfg.page_tokens;
    }
    const char *argv[ARGV_MAX + 4];
    size_t lens[ARGV_MAX + 4];
    char scratch[64];
    int argc = store_event_argv(e->stream, e->cfg.maxlen, &ev, scratch, argv, lens);
    redisReply *rep = redisCommandArgv(e->c, argc, argv, lens);
    if (!rep) {
        conn_down(e, false, e->c->errstr);
        return false;
    }
    bool ok = rep->type != REDIS_REPLY_ERROR;
    if (!ok) {
        pthread_mutex_lock(&e->mu);
        e->st.errors++;
        note(e, NOTE_ERROR, "Redis refused an XADD (out of memory, or not a stream?)");
        pthread_mutex_unlock(&e->mu);
    }
    freeReplyObject(rep);
    if (!ok)
        return false;
    e->seq++;
    pthread_mutex_lock(&e->mu);
    e->st.entries++;
    if (op == STORE_EVENT_SNAP)
        e->st.snapshots++;
    else if (op == STORE_EVENT_ADD)
        e->st.keys_added += n_keys;
    else
        e->st.keys_removed += n_keys;
    pthread_mutex_unlock(&e->mu);
    return true;
}

/* The deltas as runs of one op each, in order. */
static bool send_deltas(struct store_events *e, const struct delta *d, uint32_t n, uint8_t *buf)
{
    for (uint32_t i = 0; i < n;) {
        uint32_t j = i;
        for (; j < n && d[j].held == d[i].held; j++)
            put_key(buf + (size_t)(j - i) * KEY_BYTES, d[j].key);
        if (!send_entry(e, d[i].held ? STORE_EVENT_ADD : STORE_EVENT_DEL, buf, j - i))
            return false;
        i = j;
    }
    return true;
}

/* mu held: the whole set as bytes (malloc'd). */
static uint8_t *set_bytes(const struct key_set *s, size_t *n_keys)
{
    uint8_t *buf = malloc((size_t)(s->n ? s->n : 1) * KEY_BYTES);
    size_t n = 0;
    for (uint32_t i = 0; buf && i < s->cap; i++)
        if (!key_zero(s->slots[i]))
            put_key(buf + KEY_BYTES * n++, s->slots[i]);
    *n_keys = n;
    return buf;
}

static void *writer_main(void *arg)
{
    struct store_events *e = arg;
    struct delta *batch = malloc(MAX_PENDING * sizeof *batch);
    uint8_t *buf = malloc((size_t)MAX_PENDING * KEY_BYTES);
    double next_snapshot = 0; /* the first round sends one */
    pthread_mutex_lock(&e->mu);
    for (;;) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += (long)e->cfg.flush_ms * 1000000L;
        until.tv_sec += until.tv_nsec / 1000000000L;
        until.tv_nsec %= 1000000000L;
        while (!e->stop && e->asked == e->answered &&
               pthread_cond_timedwait(&e->wake, &e->mu, &until) != ETIMEDOUT) {
        }
        bool stopping = e->stop;
        uint64_t asked = e->asked;
        bool snap = e->want_snapshot || mono_s() >= next_snapshot || stopping || !batch || !buf;
        uint8_t *snap_keys = NULL;
        size_t n_snap = 0;
        uint32_t n = 0;
        if (snap) {
            snap_keys = stopping ? malloc(1) : set_bytes(&e->held, &n_snap);
            e->want_snapshot = false;
        } else {
            n = e->n_pending;
            memcpy(batch, e->pending, (size_t)n * sizeof *batch);
        }
        e->n_pending = 0;
        pthread_mutex_unlock(&e->mu);
        bool sent = true;
        if (snap) {
            sent = snap_keys && send_entry(e, STORE_EVENT_SNAP, snap_keys, n_snap);
            if (sent)
                next_snapshot = mono_s() + e->cfg.snapshot_s;
        } else if (n) {
            sent = send_deltas(e, batch, n, buf);
        }
        free(snap_keys);
        pthread_mutex_lock(&e->mu);
        if (!sent) {
            e->want_snapshot = true; /* routers missed something: the whole set once Redis is back */
            if (n)
                e->st.lost += n;
        }
        e->answered = asked;
        pthread_cond_broadcast(&e->done);
        if (stopping)
            break;
    }
    pthread_mutex_unlock(&e->mu);
    free(batch);
    free(buf);
    redisFree(e->c);
    e->c = NULL;
    return NULL;
}

/* ---- the caller's side ---------------------------------------------------------------- */

void store_events_note(struct store_events *e, struct store_key key, bool held)
{
    if (key_zero(key))
        return;
    pthread_mutex_lock(&e->mu);
    if (held && !set_add(&e->held, key)) {
        e->want_snapshot = true; /* no memory: the next snapshot lacks it, deltas would lie */
    } else if (!held) {
        set_remove(&e->held, key);
    }
    if (e->n_pending < MAX_PENDING) {
        e->pending[e->n_pending++] = (struct delta){key, held};
    } else if (!e->want_snapshot) {
        e->want_snapshot = true;
        e->st.lost += e->n_pending;
        e->n_pending = 0;
        note(e, NOTE_LOST, "too many key changes at once; sending a snapshot instead");
    }
    e->st.held = e->held.n;
    pthread_mutex_unlock(&e->mu);
}

void store_events_flush(struct store_events *e, bool snapshot)
{
    pthread_mutex_lock(&e->mu);
    e->want_snapshot |= snapshot;
    uint64_t ticket = ++e->asked;
    pthread_cond_signal(&e->wake);
    while (e->answered < ticket && e->writer_started)
        pthread_cond_wait(&e->done, &e->mu);
    pthread_mutex_unlock(&e->mu);
}

void store_events_stats(struct store_events *e, struct store_events_stats *out)
{
    pthread_mutex_lock(&e->mu);
    *out = e->st;
    pthread_mutex_unlock(&e->mu);
}

static uint64_t random_epoch(void)
{
    uint64_t v = 0;
    int fd = open("/dev/urandom", O_RDONLY);
    if (fd < 0 || read(fd, &v, sizeof v) != (ssize_t)sizeof v) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        v = ((uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec) ^ ((uint64_t)getpid() << 32);
    }
    if (fd >= 0)
        close(fd);
    return v >> 1; /* fits a signed 64-bit number too, for scripts reading the stream */
}

ks_status store_events_open(const struct store_events_config *cfg, struct store_events **out)
{
    *out = NULL;
    if (!cfg->replica || !cfg->replica[0] || cfg->layout_len > 64 || !cfg->page_tokens)
        return ks_fail(KS_ERR_INVALID_ARG, "KV events: need the replica's URL, its key layout (<= 64 bytes) and P");
    struct store_events *e = calloc(1, sizeof *e);
    if (!e)
        return ks_fail(KS_ERR_NOMEM, "KV events: out of memory");
    e->cfg = *cfg;
    e->cfg.timeout_ms = cfg->timeout_ms ? cfg->timeout_ms : DEFAULT_TIMEOUT_MS;
    e->cfg.maxlen = cfg->maxlen ? cfg->maxlen : DEFAULT_MAXLEN;
    e->cfg.snapshot_s = cfg->snapshot_s ? cfg->snapshot_s : DEFAULT_SNAPSHOT_S;
    e->cfg.flush_ms = cfg->flush_ms ? cfg->flush_ms : DEFAULT_FLUSH_MS;
    e->timeout = (struct timeval){e->cfg.timeout_ms / 1000, (e->cfg.timeout_ms % 1000) * 1000};
    e->backoff = BACKOFF_MIN_S;
    e->epoch = random_epoch();
    memcpy(e->layout, cfg->layout, cfg->layout_len);
    store_events_stream(cfg->fingerprint, e->stream);
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->wake, NULL);
    pthread_cond_init(&e->done, NULL);
    ks_status st = store_redis_parse_url(cfg->url, e->host, sizeof e->host, &e->port, &e->db);
    e->pending = malloc(MAX_PENDING * sizeof *e->pending);
    e->replica = strdup(cfg->replica);
    if (!st && (!e->pending || !e->replica ||
                (cfg->password && cfg->password[0] && !(e->password = strdup(cfg->password)))))
        st = ks_fail(KS_ERR_NOMEM, "KV events: out of memory");
    e->cfg.url = e->cfg.password = e->cfg.replica = NULL; /* borrowed: not kept */
    e->cfg.layout = NULL;
    if (!st && pthread_create(&e->writer, NULL, writer_main, e) != 0)
        st = ks_fail(KS_ERR_NOMEM, "KV events: cannot start the writer thread");
    e->writer_started = !st;
    if (st) {
        store_events_close(e);
        return st;
    }
    *out = e;
    return KS_OK;
}

void store_events_close(struct store_events *e)
{
    if (!e)
        return;
    if (e->writer_started) {
        pthread_mutex_lock(&e->mu);
        e->stop = true;
        pthread_cond_signal(&e->wake);
        pthread_mutex_unlock(&e->mu);
        pthread_join(e->writer, NULL);
    }
    redisFree(e->c);
    if (e->password)
        memset(e->password, 0, strlen(e->password));
    free(e->password);
    free(e->replica);
    free(e->pending);
    free(e->held.slots);
    pthread_cond_destroy(&e->wake);
    pthread_cond_destroy(&e->done);
    pthread_mutex_destroy(&e->mu);
    free(e);
}
