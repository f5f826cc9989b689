/* cli/serve_redis: the --cache-redis flags of `kvserve serve` and opening the
 * shared tier from them. */
#ifndef KS_CLI_SERVE_REDIS_H
#define KS_CLI_SERVE_REDIS_H

#include <stdbool.h>
#include <stdint.h>

#include "store/store.h"

struct cli_redis_flags {
    const char *url;           /* --cache-redis redis://HOST:PORT[/DB]; NULL: no shared tier */
    const char *password_file; /* --cache-redis-password-file; else $KVSERVE_REDIS_PASSWORD */
    const char *secret_file;   /* --cache-redis-secret-file: keys the checksums (the same file on every replica) */
    int ttl_s;                 /* --cache-redis-ttl, 0: 86400 */
    int timeout_ms;            /* --cache-redis-timeout, 0: 200 */
    bool kv_events;            /* --kv-events: publish the chain keys held to a Redis stream */
    const char *events_url;    /* --kv-events-url: the URL routers reach this replica at */
    int events_snapshot_s;     /* --kv-events-snapshot, 0: 10 */
};
/* True if flag is one of the above; *ok says whether value was good. */
bool cli_parse_redis_flag(const char *flag, const char *value, struct cli_redis_flags *f, bool *ok);
extern const char cli_redis_flags_help[];

/* Open the shared tier for a model of this fingerprint (*out NULL without
 * --cache-redis). Redis being down is not an error. KS_ERR_INVALID_ARG,
 * KS_ERR_IO (password or secret file), KS_ERR_NOMEM. */
ks_status cli_open_redis(const struct cli_redis_flags *f, const uint8_t fingerprint[16], struct store_redis **out);

/* With --kv-events: open the publisher of this replica's KV events (*out
 * NULL without the flag). The replica's URL is --kv-events-url, else
 * http://HOST:PORT (a wildcard host: this machine's name). KS_ERR_INVALID_ARG
 * (--kv-events without --cache-redis), KS_ERR_NOMEM. */
struct kv_key_layout;
ks_status cli_open_kv_events(const struct cli_redis_flags *f, const uint8_t fingerprint[16],
                             const struct kv_key_layout *layout, const char *host, int port,
                             struct store_events **out);

#endif
