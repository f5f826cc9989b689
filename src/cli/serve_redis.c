/* The --cache-redis flags: the password comes from a file or the environment,
 * never from the command line (where ps and shell histories show it). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/args.h"
#include "cli/serve_redis.h"
#include "kv/kv.h"
#include "store/store.h"

const char cli_redis_flags_help[] =
    "shared prefix cache (replicas of one model share pages through Redis):\n"
    "      --cache-redis URL     redis://HOST:PORT[/DB]: pages go there as they are computed and a prompt\n"
    "                            continues from there after RAM and --cache-dir (tier order RAM, SSD, Redis)\n"
    "      --cache-redis-password-file F  Redis AUTH password (else $KVSERVE_REDIS_PASSWORD)\n"
    "      --cache-redis-secret-file F    key the pages' checksums with F (the same file, mode 0600, on\n"
    "                            every replica); without it they are unkeyed\n"
    "      --cache-redis-ttl S   seconds a page lives in Redis (default 86400)\n"
    "      --cache-redis-timeout MS  limit of each Redis call (default 200)\n"
    "      --kv-events           publish the chain keys this replica holds to the Redis stream\n"
    "                            kvserve:events:<fingerprint> (KV events), for `kvserve route`\n"
    "      --kv-events-url URL   the URL routers reach this replica at (default http://HOST:PORT)\n"
    "      --kv-events-snapshot S  seconds between full snapshots of the keys (default 10)\n";

bool cli_parse_redis_flag(const char *flag, const char *value, struct cli_redis_flags *f, bool *ok)
{
    if (!strcmp(flag, "--cache-redis"))
        *ok = (f->url = value) != NULL && *value;
    else if (!strcmp(flag, "--cache-redis-password-file"))
        *ok = (f->password_file = value) != NULL && *value;
    else if (!strcmp(flag, "--cache-redis-secret-file"))
        *ok = (f->secret_file = value) != NULL && *value;
    else if (!strcmp(flag, "--cache-redis-ttl"))
        *ok = cli_parse_int(value, 1, 365 * 86400, &f->ttl_s);
    else if (!strcmp(flag, "--cache-redis-timeout"))
        *ok = cli_parse_int(value, 1, 60000, &f->timeout_ms);
    else if (!strcmp(flag, "--kv-events-url"))
        *ok = (f->events_url = value) != NULL && *value;
    else if (!strcmp(flag, "--kv-events-snapshot"))
        *ok = cli_parse_int(value, 1, 3600, &f->events_snapshot_s);
    else
        return false;
    return true;
}

/* The password file's first line. */
static ks_status read_password(const char *path, char **out)
{
    size_t len = 0;
    char *text = cli_read_file(path, &len);
    if (!text)
        return ks_fail(KS_ERR_IO, "cannot read --cache-redis-password-file %s", path);
    text[strcspn(text, "\r\n")] = '\0';
    if (!text[0]) {
        free(text);
        return ks_fail(KS_ERR_INVALID_ARG, "--cache-redis-password-file %s is empty", path);
    }
    *out = text;
    return KS_OK;
}

ks_status cli_open_redis(const struct cli_redis_flags *f, const uint8_t fingerprint[16], struct store_redis **out)
{
    *out = NULL;
    if (!f->url)
        return f->password_file || f->secret_file
                   ? ks_fail(KS_ERR_INVALID_ARG, "--cache-redis-password-file and --cache-redis-secret-file need "
                             "--cache-redis URL")
                   : KS_OK;
    char *password = NULL;
    const char *env = getenv("KVSERVE_REDIS_PASSWORD");
    ks_status st = KS_OK;
    if (f->password_file)
        st = read_password(f->password_file, &password);
    else if (env && *env && !(password = strdup(env)))
        st = ks_fail(KS_ERR_NOMEM, "out of memory");
    struct store_redis_config cfg = {.url = f->url, .password = password, .secret_file = f->secret_file,
                                     .ttl_s = (uint32_t)f->ttl_s, .timeout_ms = (uint32_t)f->timeout_ms};
    memcpy(cfg.fingerprint, fingerprint, sizeof cfg.fingerprint);
    if (!st)
        st = store_redis_open(&cfg, out);
    if (password) {
        memset(password, 0, strlen(password));
        free(password);
    }
    if (!st)
        fprintf(stderr, "kvserve serve: shared prefix cache in Redis at %s (%s checksums)\n", f->url,
                f->secret_file ? "keyed" : "unkeyed");
    return st;
}

/* The password, from its file or the environment (NULL: none). */
static ks_status redis_password(const struct cli_redis_flags *f, char **out)
{
    *out = NULL;
    const char *env = getenv("KVSERVE_REDIS_PASSWORD");
    if (f->password_file)
        return read_password(f->password_file, out);
    if (env && *env && !(*out = strdup(env)))
        return ks_fail(KS_ERR_NOMEM, "out of memory");
    return KS_OK;
}

ks_status cli_open_kv_events(const struct cli_redis_flags *f, const uint8_t fingerprint[16],
                             const struct kv_key_layout *layout, const char *host, int port,
                             struct store_events **out)
{
    *out = NULL;
    if (!f->kv_events)
        return f->events_url ? ks_fail(KS_ERR_INVALID_ARG, "--kv-events-url needs --kv-events") : KS_OK;
    if (!f->url)
        return ks_fail(KS_ERR_INVALID_ARG, "--kv-events needs --cache-redis URL (the events go to its Redis)");
    char url[512], name[256];
    if (f->events_url) {
        snprintf(url, sizeof url, "%s", f->events_url);
    } else {
        bool wildcard = !strcmp(host, "0.0.0.0") || !strcmp(host, "::") || !host[0];
        if (wildcard && gethostname(name, sizeof name) != 0)
            snprintf(name, sizeof name, "localhost");
        name[sizeof name - 1] = '\0';
        snprintf(url, sizeof url, strchr(wildcard ? name : host, ':') ? "http://[%s]:%d" : "http://%s:%d",
                 wildcard ? name : host, port);
    }
    char *password = NULL;
    ks_status st = redis_password(f, &password);
    struct store_events_config cfg = {.url = f->url, .password = password, .timeout_ms = (uint32_t)f->timeout_ms,
                                      .replica = url, .layout = layout->bytes, .layout_len = layout->n_bytes,
                                      .page_tokens = layout->page_tokens, .snapshot_s = (uint32_t)f->events_snapshot_s};
    memcpy(cfg.fingerprint, fingerprint, sizeof cfg.fingerprint);
    if (!st)
        st = store_events_open(&cfg, out);
    if (password) {
        memset(password, 0, strlen(password));
        free(password);
    }
    if (!st) {
        char stream[STORE_EVENTS_STREAM_CHARS + 1];
        store_events_stream(fingerprint, stream);
        fprintf(stderr, "kvserve serve: KV events of %s to %s on %s\n", url, stream, f->url);
    }
    return st;
}
