/* The prefix cache over HTTP: POST /cache/clear, GET /cache/prefixes, and the
 * prefix / disk parts of /cache/usage and /metrics. RAM-tier reads and
 * changes run between two steps (the cache has one owner); the SSD tier is
 * thread-safe and read directly. */
#include "server/server_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kv/kv.h"
#include "store/store.h"

enum { PREFIX_LIST_MAX = 1000, PREFIX_LIST_DEFAULT = 20 };

/* ---- POST /cache/clear ---------------------------------------------------------- */

struct clear_ctx {
    int32_t pages;
    size_t bytes;
};

static void clear_hook(void *user, struct kv_cache *kv)
{
    struct clear_ctx *c = user;
    if (!kv)
        return;
    size_t before = kv_budget_used(kv); /* with a draft model's pages */
    c->pages = kv_prefix_clear(kv);
    c->bytes = before - kv_budget_used(kv);
}

ks_status server_route_cache_clear(struct server *srv, const struct server_req *rq, struct reply *r)
{
    cJSON *root;
    ks_status st = server_parse_object(rq->body, rq->len, true, &root, r);
    if (st)
        return st;
    const char *tier = "all";
    for (cJSON *f = root->child; f && !st; f = f->next) {
        if (strcmp(f->string, "tier") != 0)
            st = reply_fail(r, KS_ERR_INVALID_ARG, "unknown_field", "unknown field '%s' (use \"tier\")", f->string);
        tier = cJSON_IsString(f) ? f->valuestring : "";
    }
    bool ram = !strcmp(tier, "ram") || !strcmp(tier, "all"), disk = !strcmp(tier, "disk") || !strcmp(tier, "all");
    if (!st && !ram && !disk)
        st = reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'tier' must be \"ram\", \"disk\" or \"all\"");
    else if (!st && !strcmp(tier, "disk") && !srv->cfg.store)
        st = reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                        "'tier': \"disk\" needs the SSD tier (start the server with --cache-dir)");
    struct clear_ctx c = {0, 0};
    uint64_t deleted = 0;
    if (!st && ram && (st = sched_between_steps(srv->sched, clear_hook, &c)))
        st = reply_fail(r, st, "shutting_down", "%s", ks_errmsg());
    if (!st && disk && srv->cfg.store && (st = store_clear(srv->cfg.store, &deleted)))
        st = reply_fail(r, st, "disk_tier_disabled", "%s", ks_errmsg());
    if (st) {
        cJSON_Delete(root);
        return st;
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "tier", tier);
    cJSON_AddNumberToObject(o, "ram_pages_dropped", c.pages);
    cJSON_AddNumberToObject(o, "ram_bytes_freed", (double)c.bytes);
    cJSON_AddNumberToObject(o, "disk_entries_deleted", (double)deleted);
    cJSON_Delete(root);
    return reply_json(r, 200, o);
}

/* ---- GET /cache/prefixes ------------------------------------------------------------- */

static void add_time(cJSON *e, int64_t ms)
{
    time_t t = (time_t)(ms / 1000);
    struct tm tm;
    char buf[32] = "";
    if (gmtime_r(&t, &tm))
        strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
    cJSON_AddStringToObject(e, "last_use", buf);
    cJSON_AddNumberToObject(e, "last_use_ms", (double)ms);
}

static void add_key(cJSON *e, uint64_t lo, uint64_t hi)
{
    char hex[33];
    snprintf(hex, sizeof hex, "%016llx%016llx", (unsigned long long)hi, (unsigned long long)lo);
    cJSON_AddStringToObject(e, "key", hex);
}

struct ram_chains {
    int32_t cap, n;
    struct kv_prefix_info *info;
    ks_status st;
};

static void list_hook(void *user, struct kv_cache *kv)
{
    struct ram_chains *c = user;
    c->n = 0;
    c->st = kv ? kv_prefix_list(kv, c->info, c->cap, &c->n) : KS_OK;
}

static cJSON *ram_chain_json(const struct server *srv, const struct kv_prefix_info *p)
{
    cJSON *e = cJSON_CreateObject();
    cJSON_AddNumberToObject(e, "tokens", p->n_tokens);
    cJSON_AddNumberToObject(e, "pages", p->n_pages);
    cJSON_AddNumberToObject(e, "idle_pages", p->n_idle);
    cJSON_AddNumberToObject(e, "hits", (double)p->hits);
    cJSON_AddNumberToObject(e, "leaf_hits", (double)p->leaf_hits);
    add_time(e, p->last_use_ms);
    cJSON_AddStringToObject(e, "tier", "ram");
    add_key(e, p->leaf.lo, p->leaf.hi);
    if (!srv->cfg.cache_show_text)
        return e; /* other clients' prompts: shown only with --cache-show-text */
    char *text = NULL;
    size_t len = 0;
    /* the preview is for people: invalid UTF-8 becomes U+FFFD, an invalid id ends it */
    ks_status st = tok_decode(srv->tok, p->head, (size_t)p->n_head, TOK_DECODE_SPECIAL | TOK_DECODE_REPLACE_BAD,
                              &text, &len);
    if (st == KS_OK)
        cJSON_AddStringToObject(e, "preview", text);
    else if (st != KS_ERR_NOMEM)
        cJSON_AddNullToObject(e, "preview");
    free(text);
    if (st == KS_ERR_NOMEM) {
        cJSON_Delete(e);
        return NULL; /* server_json_push notes it */
    }
    return e;
}

/* Disk chains from the index: leaves are entries no other entry continues. */
struct disk_chains {
    struct store_entry_info *e;
    uint32_t n, cap;
    bool oom;
};

static void collect_entry(void *user, const struct store_entry_info *e)
{
    struct disk_chains *d = user;
    if (d->n == d->cap) {
        uint32_t cap = d->cap ? d->cap * 2 : 256;
        struct store_entry_info *p = realloc(d->e, (size_t)cap * sizeof *p);
        if (!p) {
            d->oom = true;
            return;
        }
        d->e = p;
        d->cap = cap;
    }
    d->e[d->n++] = *e;
}

static int by_key(const void *a, const void *b)
{
    const struct store_key *x = &((const struct store_entry_info *)a)->key;
    const struct store_key *y = &((const struct store_entry_info *)b)->key;
    if (x->hi != y->hi)
        return (x->hi > y->hi) - (x->hi < y->hi);
    return (x->lo > y->lo) - (x->lo < y->lo);
}

/* d->e sorted by key (disk_chains sorts it): the index of key k, or -1. */
static int32_t find_entry(const struct disk_chains *d, struct store_key k)
{
    struct store_entry_info probe = {.key = k};
    const struct store_entry_info *e = bsearch(&probe, d->e, d->n, sizeof *d->e, by_key);
    return e ? (int32_t)(e - d->e) : -1;
}

struct disk_chain {
    uint32_t leaf;
    int32_t pages, tokens;
    uint64_t last_use;
};

static int by_tokens_desc(const void *a, const void *b)
{
    int32_t x = ((const struct disk_chain *)a)->tokens, y = ((const struct disk_chain *)b)->tokens;
    return (x < y) - (x > y);
}

/* Chains of the disk index, longest first, into *out (malloc'd; NULL when
 * out of memory). Sorts d->e
 * by key so that parents are found by binary search: a disk tier of 10% of a
 * large disk holds hundreds of thousands of pages, and the live page asks for
 * this listing every few seconds. */
static uint32_t disk_chains(struct disk_chains *d, struct disk_chain **out)
{
    if (d->n) /* an empty index has no array (qsort's NULL is undefined) */
        qsort(d->e, d->n, sizeof *d->e, by_key);
    uint8_t *has_child = calloc((size_t)d->n + 1, 1);
    struct disk_chain *c = malloc(((size_t)d->n + 1) * sizeof *c);
    uint32_t n = 0;
    if (has_child && c) {
        for (uint32_t i = 0; i < d->n; i++) {
            int32_t p = find_entry(d, d->e[i].parent);
            if (p >= 0)
                has_child[p] = 1;
        }
        for (uint32_t i = 0; i < d->n; i++) {
            if (has_child[i])
                continue;
            struct disk_chain ch = {i, 0, 0, d->e[i].last_use};
            for (int32_t at = (int32_t)i; at >= 0 && ch.pages <= (int32_t)d->n; at = find_entry(d, d->e[at].parent)) {
                ch.pages++;
                ch.tokens += (int32_t)d->e[at].n_tokens;
                if (d->e[at].last_use > ch.last_use)
                    ch.last_use = d->e[at].last_use;
            }
            c[n++] = ch;
        }
        qsort(c, n, sizeof *c, by_tokens_desc);
    } else {
        free(c);
        c = NULL;
    }
    free(has_child);
    *out = c;
    return n;
}

static ks_status parse_limit(const char *s, int *limit, struct reply *r)
{
    *limit = PREFIX_LIST_DEFAULT;
    if (!s)
        return KS_OK;
    char *end;
    long v = strtol(s, &end, 10);
    if (*s == '\0' || *end != '\0' || v < 1 || v > PREFIX_LIST_MAX)
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'limit' must be an integer in 1..%d",
                          PREFIX_LIST_MAX);
    *limit = (int)v;
    return KS_OK;
}

/* false: out of memory */
static bool add_disk_chains(struct server *srv, cJSON *data, cJSON *o, int limit)
{
    if (!srv->cfg.store) {
        cJSON_AddNullToObject(o, "disk");
        return true;
    }
    struct disk_chains d = {0};
    store_foreach(srv->cfg.store, collect_entry, &d);
    struct disk_chain *c = NULL;
    uint32_t n = d.oom ? 0 : disk_chains(&d, &c);
    if (!c) {
        free(d.e);
        return false;
    }
    for (uint32_t i = 0; c && i < n && (int)i < limit; i++) {
        const struct store_entry_info *leaf = &d.e[c[i].leaf];
        cJSON *e = cJSON_CreateObject();
        cJSON_AddNumberToObject(e, "tokens", c[i].tokens);
        cJSON_AddNumberToObject(e, "pages", c[i].pages);
        cJSON_AddNumberToObject(e, "hits", (double)leaf->hits);
        add_time(e, (int64_t)c[i].last_use);
        cJSON_AddStringToObject(e, "tier", "disk");
        add_key(e, leaf->key.lo, leaf->key.hi);
        server_json_push(data, e);
    }
    struct store_stats st;
    store_stats(srv->cfg.store, &st);
    cJSON *disk = cJSON_AddObjectToObject(o, "disk");
    cJSON_AddNumberToObject(disk, "chains", n);
    cJSON_AddNumberToObject(disk, "entries", (double)st.entries);
    cJSON_AddNumberToObject(disk, "bytes", (double)st.bytes);
    free(c);
    free(d.e);
    return true;
}

static int by_json_tokens_desc(const void *a, const void *b)
{
    double x = cJSON_GetObjectItem(*(cJSON *const *)a, "tokens")->valuedouble;
    double y = cJSON_GetObjectItem(*(cJSON *const *)b, "tokens")->valuedouble;
    return (x < y) - (x > y);
}

/* RAM and disk chains merged, longest first, cut at limit. false: out of memory */
static bool sort_and_cut(cJSON *data, int limit)
{
    int n = cJSON_GetArraySize(data);
    cJSON **items = malloc(((size_t)n + 1) * sizeof *items);
    if (!items)
        return false;
    for (int i = 0; i < n; i++)
        items[i] = cJSON_DetachItemFromArray(data, 0);
    qsort(items, (size_t)n, sizeof *items, by_json_tokens_desc);
    for (int i = 0; i < n; i++) {
        if (i < limit)
            server_json_push(data, items[i]);
        else
            cJSON_Delete(items[i]);
    }
    free(items);
    return true;
}

ks_status server_route_cache_prefixes(struct server *srv, const struct server_req *rq, struct reply *r)
{
    if (server_req_arg(rq, "prompt") || server_req_arg(rq, "tokens"))
        return server_route_prefix_held(srv, rq, r);
    int limit;
    ks_status st = parse_limit(server_req_arg(rq, "limit"), &limit, r);
    if (st)
        return st;
    struct ram_chains rc = {.cap = limit, .info = malloc((size_t)limit * sizeof *rc.info)};
    if (!rc.info)
        return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while listing the cached prefixes");
    if ((st = sched_between_steps(srv->sched, list_hook, &rc))) {
        free(rc.info);
        return reply_fail(r, st, "shutting_down", "%s", ks_errmsg());
    }
    if (rc.st) {
        free(rc.info);
        return reply_fail(r, rc.st, NULL, "out of memory while listing the cached prefixes");
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "object", "list");
    cJSON *data = cJSON_AddArrayToObject(o, "data");
    for (int32_t i = 0; i < rc.n && i < rc.cap; i++)
        server_json_push(data, ram_chain_json(srv, &rc.info[i]));
    cJSON_AddNumberToObject(cJSON_AddObjectToObject(o, "ram"), "chains", rc.n);
    free(rc.info);
    if (!add_disk_chains(srv, data, o, limit) || !sort_and_cut(data, limit)) {
        cJSON_Delete(o);
        return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while listing the cached prefixes");
    }
    return reply_json(r, 200, o);
}

/* ---- /cache/usage and /metrics ---------------------------------------------------------- */

cJSON *server_prefix_usage_json(const struct kv_usage *u, const struct sched_stats *st)
{
    cJSON *p = cJSON_CreateObject();
    cJSON_AddNumberToObject(p, "idle_pages", u->n_idle_pages);
    cJSON_AddNumberToObject(p, "idle_bytes", (double)u->idle_bytes);
    cJSON_AddNumberToObject(p, "keyed_pages", u->n_keyed_pages);
    cJSON_AddNumberToObject(p, "shared_pages", u->n_shared_pages);
    cJSON_AddNumberToObject(p, "evictions", (double)u->evictions);
    cJSON_AddNumberToObject(p, "evicted_to_disk", (double)u->evicted_to_disk);
    cJSON_AddNumberToObject(p, "attached_pages", (double)u->attached_pages);
    cJSON_AddNumberToObject(p, "lookups", (double)st->prefix_lookups);
    cJSON_AddNumberToObject(p, "hit_tokens_ram", (double)st->prefix_hit_ram_tokens);
    cJSON_AddNumberToObject(p, "hit_tokens_disk", (double)st->prefix_hit_disk_tokens);
    cJSON_AddNumberToObject(p, "hit_tokens_redis", (double)st->prefix_hit_redis_tokens);
    cJSON_AddNumberToObject(p, "shared_tokens", (double)st->prefix_shared_tokens);
    cJSON_AddNumberToObject(p, "miss_tokens", (double)st->prefix_miss_tokens);
    cJSON_AddNumberToObject(p, "wait_steps", (double)st->prefix_wait_steps);
    return p;
}

cJSON *server_disk_usage_json(struct server *srv)
{
    if (!srv->cfg.store)
        return cJSON_CreateNull();
    struct store_stats st;
    store_stats(srv->cfg.store, &st);
    cJSON *d = cJSON_CreateObject();
    cJSON_AddNumberToObject(d, "entries", (double)st.entries);
    cJSON_AddNumberToObject(d, "bytes", (double)st.bytes);
    cJSON_AddNumberToObject(d, "limit", (double)st.limit);
    cJSON_AddNumberToObject(d, "reads", (double)st.reads);
    cJSON_AddNumberToObject(d, "read_bytes", (double)st.read_bytes);
    cJSON_AddNumberToObject(d, "writes", (double)st.writes);
    cJSON_AddNumberToObject(d, "write_bytes", (double)st.write_bytes);
    cJSON_AddNumberToObject(d, "corrupt", (double)st.corrupt);
    cJSON_AddNumberToObject(d, "evictions", (double)st.evictions);
    cJSON_AddNumberToObject(d, "dropped", (double)st.dropped);
    cJSON_AddNumberToObject(d, "failures", (double)st.failures);
    cJSON_AddBoolToObject(d, "disabled", st.disabled);
    cJSON_AddNumberToObject(d, "read_gbs", st.read_gbs);
    return d;
}

void server_prefix_metrics(struct server *srv, struct sbuf *b, const struct sched_stats *st, const struct kv_usage *u)
{
    server_metric(b, "kvserve_prefix_lookups_total", "counter", "Prompts looked up in the prefix cache at admission.",
         (double)st->prefix_lookups);
    sbuf_printf(b, "# HELP kvserve_prefix_hit_tokens_total Prompt tokens found in the prefix cache at admission, by tier.\n"
                   "# TYPE kvserve_prefix_hit_tokens_total counter\n"
                   "kvserve_prefix_hit_tokens_total{tier=\"ram\"} %llu\nkvserve_prefix_hit_tokens_total{tier=\"disk\"} %llu\n"
                   "kvserve_prefix_hit_tokens_total{tier=\"redis\"} %llu\n",
                (unsigned long long)st->prefix_hit_ram_tokens, (unsigned long long)st->prefix_hit_disk_tokens,
                (unsigned long long)st->prefix_hit_redis_tokens);
    server_metric(b, "kvserve_prefix_shared_tokens_total", "counter",
         "Prompt tokens taken during prefill from a request computing the same prefix.", (double)st->prefix_shared_tokens);
    server_metric(b, "kvserve_prefix_miss_tokens_total", "counter", "Prompt tokens left to compute after the lookup.",
         (double)st->prefix_miss_tokens);
    server_metric(b, "kvserve_prefix_tokens_saved_total", "counter", "Prompt tokens not computed thanks to the prefix cache.",
         (double)(st->prefix_hit_ram_tokens + st->prefix_hit_disk_tokens + st->prefix_hit_redis_tokens +
                  st->prefix_shared_tokens));
    server_metric(b, "kvserve_prefix_wait_steps_total", "counter", "Steps a request waited for another to compute a shared page.",
         (double)st->prefix_wait_steps);
    if (u) {
        server_metric(b, "kvserve_kv_idle_pages", "gauge", "Cached pages no request holds (reclaimable).", u->n_idle_pages);
        server_metric(b, "kvserve_kv_idle_bytes", "gauge", "Bytes of the idle cached pages.", (double)u->idle_bytes);
        server_metric(b, "kvserve_kv_shared_pages", "gauge", "Pages held by more than one request.", u->n_shared_pages);
        server_metric(b, "kvserve_kv_keyed_pages", "gauge", "Pages in the prefix cache, idle or in use.", u->n_keyed_pages);
        server_metric(b, "kvserve_prefix_evictions_total", "counter", "Idle cached pages reclaimed for their bytes.",
             (double)u->evictions);
    }
    if (!srv->cfg.store)
        return;
    struct store_stats d;
    store_stats(srv->cfg.store, &d);
    server_metric(b, "kvserve_disk_cache_bytes", "gauge", "Disk footprint of the SSD tier's entries.", (double)d.bytes);
    server_metric(b, "kvserve_disk_cache_entries", "gauge", "Pages in the SSD tier.", (double)d.entries);
    server_metric(b, "kvserve_disk_cache_limit_bytes", "gauge", "The SSD tier's limit (--cache-disk).", (double)d.limit);
    server_metric(b, "kvserve_disk_cache_reads_total", "counter", "Pages read back from disk.", (double)d.reads);
    server_metric(b, "kvserve_disk_cache_read_bytes_total", "counter", "Bytes read back from disk.", (double)d.read_bytes);
    server_metric(b, "kvserve_disk_cache_writes_total", "counter", "Pages written to disk.", (double)d.writes);
    server_metric(b, "kvserve_disk_cache_write_bytes_total", "counter", "Bytes written to disk.", (double)d.write_bytes);
    server_metric(b, "kvserve_disk_cache_corrupt_total", "counter", "Corrupt, truncated or foreign entries found and deleted.",
         (double)d.corrupt);
    server_metric(b, "kvserve_disk_cache_evictions_total", "counter", "Entries deleted for room.", (double)d.evictions);
    server_metric(b, "kvserve_disk_cache_dropped_total", "counter", "Pages not written: the write queue was full, or a full disk refused them.", (double)d.dropped);
    server_metric(b, "kvserve_disk_cache_failures_total", "counter", "Write transactions that failed.", (double)d.failures);
    server_metric(b, "kvserve_disk_cache_disabled", "gauge", "1 when the SSD tier gave up after write failures.", d.disabled);
    server_metric(b, "kvserve_disk_cache_read_gbs", "gauge", "Measured read throughput of the SSD tier, GB/s.", d.read_gbs);
}
