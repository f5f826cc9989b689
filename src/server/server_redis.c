/* The shared (Redis) tier in /cache/usage and /metrics. */
#include <cjson/cJSON.h>

#include "server/server_internal.h"
#include "store/store.h"

cJSON *server_redis_usage_json(struct server *srv)
{
    if (!srv->cfg.redis)
        return cJSON_CreateNull();
    struct store_redis_stats st;
    store_redis_stats(srv->cfg.redis, &st);
    cJSON *d = cJSON_CreateObject();
    cJSON_AddBoolToObject(d, "connected", st.connected);
    const struct { const char *name; uint64_t v; } counts[] = {
        {"lookups", st.lookups}, {"round_trips", st.round_trips}, {"declined", st.declined}, {"hits", st.hits}, {"misses", st.misses}, {"reads", st.reads},
        {"read_bytes", st.read_bytes}, {"writes", st.writes}, {"write_bytes", st.write_bytes},
        {"deduplicated", st.deduplicated}, {"dropped", st.dropped},
        {"corrupt", st.corrupt}, {"foreign", st.foreign}, {"full", st.full}, {"timeouts", st.timeouts},
        {"errors", st.errors}, {"connect_failures", st.connect_failures}, {"reconnects", st.reconnects},
    };
    for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++)
        cJSON_AddNumberToObject(d, counts[i].name, (double)counts[i].v);
    cJSON_AddNumberToObject(d, "rtt_ms", st.rtt_ms);
    cJSON_AddNumberToObject(d, "read_mbs", st.read_mbs);
    return d;
}

/* --kv-events: what the replica published for routers. */
static void server_events_metrics(struct store_events *e, struct sbuf *b)
{
    struct store_events_stats st;
    store_events_stats(e, &st);
    server_metric(b, "kvserve_kv_events_connected", "gauge", "1 while the KV events connection to Redis is up.",
                  st.connected);
    server_metric(b, "kvserve_kv_events_held_keys", "gauge", "Full pages' chain keys this replica holds.",
                  (double)st.held);
    server_metric(b, "kvserve_kv_events_entries_total", "counter", "KV events entries Redis took (XADD).",
                  (double)st.entries);
    server_metric(b, "kvserve_kv_events_snapshots_total", "counter", "Snapshots among them.", (double)st.snapshots);
    server_metric(b, "kvserve_kv_events_keys_added_total", "counter", "Keys published as gained.",
                  (double)st.keys_added);
    server_metric(b, "kvserve_kv_events_keys_removed_total", "counter", "Keys published as lost.",
                  (double)st.keys_removed);
    server_metric(b, "kvserve_kv_events_lost_total", "counter", "Changes not published (a snapshot repairs them).",
                  (double)st.lost);
    server_metric(b, "kvserve_kv_events_errors_total", "counter", "Failed KV events writes and connects.",
                  (double)(st.errors + st.connect_failures));
}

void server_redis_metrics(struct server *srv, struct sbuf *b)
{
    if (!srv->cfg.redis)
        return;
    struct store_redis_stats st;
    store_redis_stats(srv->cfg.redis, &st);
    server_metric(b, "kvserve_redis_connected", "gauge", "1 while the lookup connection to Redis is up.", st.connected);
    server_metric(b, "kvserve_redis_lookups_total", "counter", "Prompt chains looked up in Redis.", (double)st.lookups);
    server_metric(b, "kvserve_redis_round_trips_total", "counter",
                  "Lookup commands Redis answered: one MGET per lookup sent.",
                  (double)st.round_trips);
    server_metric(b, "kvserve_redis_declined_total", "counter",
                  "Lookups not sent: reading the pages could not beat computing them.", (double)st.declined);
    server_metric(b, "kvserve_redis_hits_total", "counter", "Pages read from Redis and verified.", (double)st.hits);
    server_metric(b, "kvserve_redis_misses_total", "counter", "Lookups whose chain ended at a missing page.",
                  (double)st.misses);
    server_metric(b, "kvserve_redis_read_bytes_total", "counter", "Bytes read from Redis.", (double)st.read_bytes);
    server_metric(b, "kvserve_redis_writes_total", "counter", "Pages Redis took (SET NX).", (double)st.writes);
    server_metric(b, "kvserve_redis_write_bytes_total", "counter", "Bytes written to Redis.", (double)st.write_bytes);
    server_metric(b, "kvserve_redis_deduplicated_total", "counter", "Pages another replica had written already.",
                  (double)st.deduplicated);
    server_metric(b, "kvserve_redis_dropped_total", "counter", "Pages not written: queue full or Redis down.",
                  (double)st.dropped);
    sbuf_printf(b, "# HELP kvserve_redis_faults_total Faults of the Redis tier, by kind.\n"
                   "# TYPE kvserve_redis_faults_total counter\n");
    const struct { const char *kind; uint64_t v; } faults[] = {
        {"corrupt", st.corrupt}, {"foreign", st.foreign}, {"full", st.full}, {"timeout", st.timeouts},
        {"error", st.errors}, {"connect", st.connect_failures},
    };
    for (size_t i = 0; i < sizeof faults / sizeof faults[0]; i++)
        sbuf_printf(b, "kvserve_redis_faults_total{kind=\"%s\"} %llu\n", faults[i].kind,
                    (unsigned long long)faults[i].v);
    server_metric(b, "kvserve_redis_reconnects_total", "counter", "Connections to Redis made again after a fault.",
                  (double)st.reconnects);
    server_metric(b, "kvserve_redis_rtt_ms", "gauge", "Measured round trip of a lookup, ms.", st.rtt_ms);
    if (srv->cfg.events)
        server_events_metrics(srv->cfg.events, b);
}
