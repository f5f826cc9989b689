/* Tenant isolation for the prefix cache and the admin routes: vLLM's
 * cache_salt request field, salts derived from API keys
 * (--cache-salt-from-key), and the admin key (--admin-key) the cache's admin
 * routes need when it is set.
 *
 * The threat: the prefix cache is shared, so a client can learn whether a
 * prompt was seen (its cached_tokens, its latency) and, token by token, how
 * far a guess matches someone else's prompt. A salt splits the cache: pages
 * are shared only between requests of the same salt, and a salted request's
 * cached_tokens counts whole pages only (sched). */
#include "server/server_internal.h"

#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "kv/kv.h"
#include "store/store.h"

enum { CACHE_SALT_MAX_BYTES = 1024 };

/* The bearer token of an Authorization header, NULL when there is none. */
static const char *bearer(const char *authorization)
{
    if (!authorization || strncmp(authorization, "Bearer ", 7) != 0 || !authorization[7])
        return NULL;
    return authorization + 7;
}

/* Constant-time, so a key cannot be probed byte by byte. */
static bool same_secret(const char *given, const char *want)
{
    size_t gl = strlen(given), wl = strlen(want);
    unsigned diff = (unsigned)(gl != wl);
    for (size_t i = 0; i < gl && i < wl; i++)
        diff |= (unsigned)(given[i] ^ want[i]);
    return diff == 0;
}

/* The key the tenants' salts are hashed with: from the shared secret of the
 * Redis tier (--cache-redis-secret-file), so every replica and router given
 * that file derives the same salts and a tenant's pages are shared between
 * replicas; else from the cache directory's secret, so a tenant finds its
 * pages on disk after a restart; else random per process (nothing outlives
 * it). The API key itself is never stored. */
ks_status server_privacy_init(struct server *srv)
{
    const struct server_config *c = &srv->cfg;
    if (c->admin_key && *c->admin_key && !(srv->admin_key = strdup(c->admin_key)))
        return ks_fail(KS_ERR_NOMEM, "server: out of memory for the admin key");
    if (!c->cache_salt_from_key)
        return KS_OK;
    static const char tag[] = KV_TENANT_KEY_TAG;
    struct store_key k;
    if (c->redis && store_redis_keyed_digest(c->redis, tag, sizeof tag, &k)) {
        srv->tenant_key[0] = k.lo;
        srv->tenant_key[1] = k.hi;
    } else if (c->store) {
        k = store_keyed_digest(c->store, tag, sizeof tag);
        srv->tenant_key[0] = k.lo;
        srv->tenant_key[1] = k.hi;
    } else if (getrandom(srv->tenant_key, sizeof srv->tenant_key, 0) != (ssize_t)sizeof srv->tenant_key) {
        return ks_fail(KS_ERR_IO, "server: no random bytes for --cache-salt-from-key's key");
    }
    return KS_OK;
}

void server_privacy_free(struct server *srv)
{
    if (srv->admin_key)
        memset(srv->admin_key, 0, strlen(srv->admin_key));
    free(srv->admin_key);
    srv->admin_key = NULL;
}

/* ---- cache salts ------------------------------------------------------------------ */

ks_status server_parse_cache_salt(const cJSON *root, struct sched_request *rq, struct reply *r)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, "cache_salt");
    if (!v || cJSON_IsNull(v))
        return KS_OK;
    if (!cJSON_IsString(v) || !v->valuestring[0])
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'cache_salt' must be a non-empty string");
    size_t n = strlen(v->valuestring);
    if (n > CACHE_SALT_MAX_BYTES)
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'cache_salt' is %zu bytes; at most %d", n,
                          CACHE_SALT_MAX_BYTES);
    struct kv_key salt = kv_cache_salt(v->valuestring, n); /* a router derives the same (src/route) */
    rq->cache_salt.lo = salt.lo;
    rq->cache_salt.hi = salt.hi;
    return KS_OK;
}

void server_salt_from_key(const struct server *srv, const char *authorization, struct sched_request *rq)
{
    const char *token = bearer(authorization);
    if (!srv->cfg.cache_salt_from_key || !token)
        return;
    struct kv_key salt = kv_tenant_salt((struct kv_key){srv->tenant_key[0], srv->tenant_key[1]}, token, strlen(token),
                                        (struct kv_key){rq->cache_salt.lo, rq->cache_salt.hi});
    rq->cache_salt.lo = salt.lo;
    rq->cache_salt.hi = salt.hi;
}

/* ---- the admin key ------------------------------------------------------------------ */

/* The routes that change the cache or show what is in it. */
static bool admin_route(const char *path)
{
    static const char *const admin[] = {"/cache/requantize", "/cache/policy", "/cache/clear", "/cache/prefixes",
                                        "/slots"};
    for (size_t i = 0; i < sizeof admin / sizeof admin[0]; i++)
        if (!strcmp(path, admin[i]))
            return true;
    return false;
}

bool server_admin_key_matches(const struct server *srv, const char *authorization)
{
    const char *token = bearer(authorization);
    return srv->admin_key && token && same_secret(token, srv->admin_key);
}

bool server_admin_refuse(const struct server *srv, const char *path, const char *authorization, struct reply *r)
{
    if (!srv->admin_key || !path || !admin_route(path) || server_admin_key_matches(srv, authorization))
        return false;
    if (!bearer(authorization))
        server_reply_error(r, 401, "admin_key_required",
                           "%s needs the admin key: send the header 'Authorization: Bearer ADMIN_KEY' (--admin-key)",
                           path);
    else
        server_reply_error(r, 403, "admin_key_required", "%s needs the admin key (--admin-key); this key is not it",
                           path);
    return true;
}
