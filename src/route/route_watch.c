/* What the router watches: each replica's GET /health (libcurl, all at once
 * every health_ms), and the replicas' KV events (hiredis: XREAD of the
 * model's streams from their start, then blocking for more; a lost
 * connection comes back with a backoff and reads on from the last entry). */
#include <curl/curl.h>
#include <errno.h>
#include <hiredis/hiredis.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "route/route_internal.h"

enum { HEALTH_TIMEOUT_MS = 1000, XREAD_BLOCK_MS = 500, XREAD_COUNT = 256, HOST_CHARS = 256, ID_CHARS = 48 };

bool route_nap(struct route *rt, int ms)
{
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += ms / 1000;
    until.tv_nsec += (long)(ms % 1000) * 1000000L;
    until.tv_sec += until.tv_nsec / 1000000000L;
    until.tv_nsec %= 1000000000L;
    pthread_mutex_lock(&rt->mu);
    while (!rt->stop && pthread_cond_timedwait(&rt->wake, &rt->mu, &until) != ETIMEDOUT) {
    }
    bool go_on = !rt->stop;
    pthread_mutex_unlock(&rt->mu);
    return go_on;
}

/* ---- health ----------------------------------------------------------------------- */

static size_t discard(char *p, size_t size, size_t n, void *user)
{
    (void)p;
    (void)user;
    return size * n;
}

void route_check_health(struct route *rt)
{
    CURLM *multi = curl_multi_init();
    CURL *easy[ROUTE_MAX_REPLICAS] = {0};
    char url[1024];
    for (int r = 0; multi && r < rt->n_rep; r++) {
        snprintf(url, sizeof url, "%s/health", rt->rep[r].url);
        if (!(easy[r] = curl_easy_init()))
            continue;
        curl_easy_setopt(easy[r], CURLOPT_URL, url);
        curl_easy_setopt(easy[r], CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(easy[r], CURLOPT_TIMEOUT_MS, (long)HEALTH_TIMEOUT_MS);
        curl_easy_setopt(easy[r], CURLOPT_WRITEFUNCTION, discard);
        curl_multi_add_handle(multi, easy[r]);
    }
    int running = 1;
    while (multi && running) {
        curl_multi_perform(multi, &running);
        if (running)
            curl_multi_poll(multi, NULL, 0, 100, NULL);
    }
    for (int r = 0; r < rt->n_rep; r++) {
        long code = 0;
        if (easy[r])
            curl_easy_getinfo(easy[r], CURLINFO_RESPONSE_CODE, &code);
        bool was = atomic_load(&rt->rep[r].healthy), now = code == 200;
        if (was != now)
            fprintf(stderr, "kvserve route: %s is %s\n", rt->rep[r].url,
                    now ? "up" : code ? "not ready (GET /health is not 200)" : "down (no answer to GET /health)");
        atomic_store(&rt->rep[r].healthy, now);
        if (easy[r]) {
            curl_multi_remove_handle(multi, easy[r]);
            curl_easy_cleanup(easy[r]);
        }
    }
    curl_multi_cleanup(multi);
}

void *route_health_main(void *arg)
{
    struct route *rt = arg;
    while (route_nap(rt, rt->cfg.health_ms))
        route_check_health(rt);
    return NULL;
}

/* ---- KV events ----------------------------------------------------------------------- */

struct watch {
    char host[HOST_CHARS];
    int port, db;
    redisContext *c;
    double backoff;           /* seconds */
    char streams[2][STORE_EVENTS_STREAM_CHARS + 1];
    char last_id[2][ID_CHARS];
    int n_streams;
    bool said_down, said_stranger;
};

static int replica_of(const struct route *rt, const char *url, size_t len)
{
    while (len && url[len - 1] == '/')
        len--;
    for (int r = 0; r < rt->n_rep; r++)
        if (strlen(rt->rep[r].url) == len && !memcmp(rt->rep[r].url, url, len))
            return r;
    return -1;
}

static void apply_entry(struct route *rt, struct watch *w, const redisReply *fields)
{
    enum { MAX_FIELDS = 32 };
    const char *f[MAX_FIELDS];
    size_t lens[MAX_FIELDS], n = 0;
    for (size_t i = 0; i < fields->elements && n < MAX_FIELDS; i++) {
        const redisReply *e = fields->element[i];
        if (e->type != REDIS_REPLY_STRING)
            return;
        f[n] = e->str;
        lens[n++] = e->len;
    }
    struct store_event ev;
    if (store_event_parse(f, lens, n, &ev))
        return; /* not one of ours: another program's entry in the stream */
    int r = replica_of(rt, ev.replica, ev.replica_len);
    if (r >= 0) {
        (void)route_index_apply(rt->index, r, &ev); /* out of memory: the index only lags */
    } else if (!w->said_stranger) {
        w->said_stranger = true;
        fprintf(stderr, "kvserve route: KV events of %.*s, which is no --replica; ignored (give each replica's "
                "--kv-events-url as its --replica; logged once)\n", (int)(ev.replica_len > 200 ? 200 : ev.replica_len),
                ev.replica);
    }
}

/* One XREAD reply: [[stream, [[id, [field, value, ...]], ...]], ...]. */
static void apply_reply(struct route *rt, struct watch *w, const redisReply *rep)
{
    for (size_t s = 0; rep->type == REDIS_REPLY_ARRAY && s < rep->elements; s++) {
        const redisReply *st = rep->element[s];
        if (st->type != REDIS_REPLY_ARRAY || st->elements != 2 || st->element[0]->type != REDIS_REPLY_STRING)
            continue;
        int k = 0;
        while (k < w->n_streams && strcmp(w->streams[k], st->element[0]->str))
            k++;
        const redisReply *entries = st->element[1];
        for (size_t i = 0; k < w->n_streams && entries->type == REDIS_REPLY_ARRAY && i < entries->elements; i++) {
            const redisReply *e = entries->element[i];
            if (e->type != REDIS_REPLY_ARRAY || e->elements != 2 || e->element[0]->type != REDIS_REPLY_STRING)
                continue;
            snprintf(w->last_id[k], ID_CHARS, "%s", e->element[0]->str);
            if (e->element[1]->type == REDIS_REPLY_ARRAY)
                apply_entry(rt, w, e->element[1]);
        }
    }
}

static bool watch_connect(struct route *rt, struct watch *w)
{
    struct timeval tv = {2, 0};
    w->c = redisConnectWithTimeout(w->host, w->port, tv);
    bool ok = w->c && !w->c->err && redisSetTimeout(w->c, (struct timeval){XREAD_BLOCK_MS / 1000 + 2, 0}) == REDIS_OK;
    if (ok && rt->redis_password) {
        redisReply *rep = redisCommand(w->c, "AUTH %s", rt->redis_password);
        ok = rep && rep->type != REDIS_REPLY_ERROR;
        freeReplyObject(rep);
    }
    if (ok && w->db) {
        redisReply *rep = redisCommand(w->c, "SELECT %d", w->db);
        ok = rep && rep->type != REDIS_REPLY_ERROR;
        freeReplyObject(rep);
    }
    if (!ok) {
        if (!w->said_down)
            fprintf(stderr, "kvserve route: cannot read KV events from redis://%s:%d (%s); routing by load until it "
                    "answers\n", w->host, w->port, w->c && w->c->err ? w->c->errstr : "refused");
        w->said_down = true;
        redisFree(w->c);
        w->c = NULL;
        return false;
    }
    if (w->said_down)
        fprintf(stderr, "kvserve route: reading KV events again\n");
    w->said_down = false;
    atomic_store(&rt->events_connected, true);
    return true;
}

static bool read_more(struct watch *w, redisReply **out)
{
    const char *argv[4 + 2 * 2 + 2];
    size_t lens[4 + 2 * 2 + 2];
    char count[16], block[16];
    snprintf(count, sizeof count, "%d", XREAD_COUNT);
    snprintf(block, sizeof block, "%d", XREAD_BLOCK_MS);
    int n = 0;
    const char *head[] = {"XREAD", "COUNT", count, "BLOCK", block, "STREAMS"};
    for (int i = 0; i < 6; i++)
        argv[n++] = head[i];
    for (int k = 0; k < w->n_streams; k++)
        argv[n++] = w->streams[k];
    for (int k = 0; k < w->n_streams; k++)
        argv[n++] = w->last_id[k];
    for (int i = 0; i < n; i++)
        lens[i] = strlen(argv[i]);
    *out = redisCommandArgv(w->c, n, argv, lens);
    return *out && (*out)->type != REDIS_REPLY_ERROR;
}

void *route_events_main(void *arg)
{
    struct route *rt = arg;
    struct watch w = {.backoff = 0.1, .n_streams = rt->cfg.n_fingerprints};
    if (store_redis_parse_url(rt->cfg.redis_url, w.host, sizeof w.host, &w.port, &w.db))
        return NULL; /* checked by route_start */
    for (int k = 0; k < w.n_streams; k++) {
        store_events_stream(rt->cfg.fingerprints[k], w.streams[k]);
        snprintf(w.last_id[k], ID_CHARS, "0-0"); /* from the start: the latest snapshots are in it */
    }
    while (!atomic_load(&rt->stop)) {
        if (!w.c && !watch_connect(rt, &w)) {
            if (!route_nap(rt, (int)(w.backoff * 1000)))
                break;
            w.backoff = w.backoff * 2 > 5 ? 5 : w.backoff * 2;
            continue;
        }
        w.backoff = 0.1;
        redisReply *rep = NULL;
        if (!read_more(&w, &rep)) {
            fprintf(stderr, "kvserve route: KV events: %s; reconnecting\n",
                    rep ? rep->str : w.c->errstr);
            freeReplyObject(rep);
            redisFree(w.c);
            w.c = NULL;
            atomic_store(&rt->events_connected, false);
            continue;
        }
        apply_reply(rt, &w, rep);
        freeReplyObject(rep);
    }
    redisFree(w.c);
    return NULL;
}
