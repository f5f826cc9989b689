/* The Redis tier's pure parts: the check of a value (sound, damaged, foreign,
 * keyed otherwise), the key names, the --cache-redis URL, the shared secret
 * file; and the tier with nothing listening (opens, misses at once, drops
 * writes, counts); and a chain's lookup against a real redis-server (skipped
 * without one): one MGET, the first miss, a user without scripting, a bad value,
 * the cost test. The tier behind two replicas: tests/e2e/redis_tier.sh. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "store/store_internal.h"
#include "support/skip.h"

static const uint8_t FP[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
static const struct store_key KEY = {0x1122334455667788ull, 0x99aabbccddeeff00ull};
static const struct store_key PARENT = {7, 8};

/* A sealed value of len payload bytes (malloc'd) into *out_len. */
static uint8_t *seal(const uint8_t fp[16], struct store_key key, size_t len, const uint8_t *secret, size_t *out_len)
{
    struct store_header h = store_blob_header(fp, key, PARENT, 32, len, secret != NULL);
    uint8_t *v = malloc(sizeof h + len);
    assert_non_null(v);
    for (size_t i = 0; i < len; i++)
        v[sizeof h + i] = (uint8_t)(i * 31 + 7);
    h.checksum = store_blob_checksum(&h, v + sizeof h, secret);
    memcpy(v, &h, sizeof h);
    *out_len = sizeof h + len;
    return v;
}

static void test_sound_value(void **state)
{
    (void)state;
    size_t n;
    uint8_t *v = seal(FP, KEY, 1000, NULL, &n);
    assert_int_equal(store_blob_check(v, n, FP, KEY, NULL), STORE_BLOB_OK);
    free(v);
    v = seal(FP, KEY, 0, NULL, &n); /* an empty payload is well formed */
    assert_int_equal(store_blob_check(v, n, FP, KEY, NULL), STORE_BLOB_OK);
    free(v);
}

static void test_damaged_values(void **state)
{
    (void)state;
    size_t n;
    uint8_t *v = seal(FP, KEY, 1000, NULL, &n);
    for (size_t at = 0; at < n; at += 37) { /* any flipped bit, header or payload */
        if (at >= offsetof(struct store_header, version) && at < offsetof(struct store_header, parent))
            continue; /* version, fingerprint and key: foreign, below */
        if (at >= offsetof(struct store_header, reserved) && at < offsetof(struct store_header, payload_len))
            continue; /* the keying flag: foreign, below */
        v[at] ^= 0x10;
        assert_int_equal(store_blob_check(v, n, FP, KEY, NULL), STORE_BLOB_CORRUPT);
        v[at] ^= 0x10;
    }
    assert_int_equal(store_blob_check(v, n - 1, FP, KEY, NULL), STORE_BLOB_CORRUPT);         /* truncated */
    assert_int_equal(store_blob_check(v, sizeof(struct store_header) - 1, FP, KEY, NULL), STORE_BLOB_CORRUPT);
    assert_int_equal(store_blob_check(v, 0, FP, KEY, NULL), STORE_BLOB_CORRUPT);
    assert_int_equal(store_blob_check(NULL, n, FP, KEY, NULL), STORE_BLOB_CORRUPT);
    const char junk[] = "not a kvserve page, just some bytes someone SET here ..........................";
    assert_int_equal(store_blob_check(junk, sizeof junk, FP, KEY, NULL), STORE_BLOB_CORRUPT);
    uint8_t *longer = malloc(n + 8); /* trailing bytes: the length disagrees */
    assert_non_null(longer);
    memcpy(longer, v, n);
    memset(longer + n, 0, 8);
    assert_int_equal(store_blob_check(longer, n + 8, FP, KEY, NULL), STORE_BLOB_CORRUPT);
    free(longer);
    free(v);
}

static void test_foreign_values(void **state)
{
    (void)state;
    uint8_t other_fp[16];
    memcpy(other_fp, FP, sizeof other_fp);
    other_fp[15] ^= 1;
    struct store_key other_key = {KEY.lo, KEY.hi ^ 1};
    size_t n;
    uint8_t *v = seal(other_fp, KEY, 500, NULL, &n); /* another model's page */
    assert_int_equal(store_blob_check(v, n, FP, KEY, NULL), STORE_BLOB_FOREIGN);
    free(v);
    v = seal(FP, other_key, 500, NULL, &n); /* a sound page under the wrong name */
    assert_int_equal(store_blob_check(v, n, FP, KEY, NULL), STORE_BLOB_FOREIGN);
    free(v);
    uint8_t secret[XXH3_SECRET_DEFAULT_SIZE], other[XXH3_SECRET_DEFAULT_SIZE];
    const char a[] = "the shared secret of the replicas", b[] = "the secret of another deployment";
    assert_int_equal(XXH3_generateSecret(secret, sizeof secret, a, sizeof a), XXH_OK);
    assert_int_equal(XXH3_generateSecret(other, sizeof other, b, sizeof b), XXH_OK);
    v = seal(FP, KEY, 500, secret, &n);
    assert_int_equal(store_blob_check(v, n, FP, KEY, secret), STORE_BLOB_OK);
    assert_int_equal(store_blob_check(v, n, FP, KEY, NULL), STORE_BLOB_FOREIGN);     /* keyed, reader unkeyed */
    assert_int_equal(store_blob_check(v, n, FP, KEY, other), STORE_BLOB_CORRUPT);   /* keyed with another secret */
    free(v);
    v = seal(FP, KEY, 500, NULL, &n);
    assert_int_equal(store_blob_check(v, n, FP, KEY, secret), STORE_BLOB_FOREIGN);   /* unkeyed, reader keyed */
    struct store_header h;
    memcpy(&h, v, sizeof h);
    h.version = STORE_VERSION + 1; /* a newer replica's format */
    h.checksum = store_blob_checksum(&h, v + sizeof h, NULL);
    memcpy(v, &h, sizeof h);
    assert_int_equal(store_blob_check(v, n, FP, KEY, NULL), STORE_BLOB_FOREIGN);
    free(v);
}

static void test_key_name(void **state)
{
    (void)state;
    char name[STORE_REDIS_KEY_CHARS + 1];
    store_redis_key_name(FP, KEY, name);
    assert_string_equal(name, "kvserve:0102030405060708090a0b0c0d0e0f10:99aabbccddeeff001122334455667788");
    assert_int_equal(strlen(name), STORE_REDIS_KEY_CHARS);
}

static void expect_url(const char *url, const char *host, int port, int db)
{
    char h[64];
    int p = -1, d = -1;
    assert_int_equal(store_redis_parse_url(url, h, sizeof h, &p, &d), KS_OK);
    assert_string_equal(h, host);
    assert_int_equal(p, port);
    assert_int_equal(d, db);
}

static void test_url(void **state)
{
    (void)state;
    expect_url("redis://127.0.0.1:6380", "127.0.0.1", 6380, 0);
    expect_url("redis://cache.internal:7000/3", "cache.internal", 7000, 3);
    expect_url("redis://localhost", "localhost", 6379, 0);
    expect_url("redis://localhost/", "localhost", 6379, 0);
    expect_url("redis://[::1]:6390/1", "::1", 6390, 1);
    static const char *const bad[] = {
        "http://127.0.0.1:6379", "127.0.0.1:6379", "redis://", "redis://:6379", "redis://host:0",
        "redis://host:65536", "redis://host:12x", "redis://host:", "redis://host:6379/x", "redis://host:6379/-1",
        "redis://user:secret@host:6379", "redis://:secret@host", "redis://[::1:6379", "redis://host:6379?db=2",
        "redis://host:6379/123456", NULL,
    };
    char h[64];
    int p, d;
    for (int i = 0; i < (int)(sizeof bad / sizeof bad[0]); i++) {
        ks_status st = store_redis_parse_url(bad[i], h, sizeof h, &p, &d);
        if (st != KS_ERR_INVALID_ARG)
            fail_msg("%s accepted", bad[i] ? bad[i] : "NULL");
    }
    assert_int_equal(store_redis_parse_url("redis://a-very-long-host-name-indeed:1", h, 8, &p, &d),
                     KS_ERR_INVALID_ARG);
    assert_non_null(strstr(ks_errmsg(), "longer than"));
    assert_int_equal(store_redis_parse_url("redis://u:pw@h:1", h, sizeof h, &p, &d), KS_ERR_INVALID_ARG);
    assert_non_null(strstr(ks_errmsg(), "KVSERVE_REDIS_PASSWORD"));
}

static void test_secret_file(void **state)
{
    (void)state;
    char path[] = "/tmp/kvserve-redis-secret-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    uint8_t s1[XXH3_SECRET_DEFAULT_SIZE], s2[XXH3_SECRET_DEFAULT_SIZE];
    assert_int_equal(write(fd, "short", 5), 5);
    assert_int_equal(store_blob_load_secret(path, s1), KS_ERR_IO); /* under 16 bytes */
    assert_int_equal(write(fd, " but now long enough", 20), 20);
    assert_int_equal(store_blob_load_secret(path, s1), KS_OK);
    assert_int_equal(store_blob_load_secret(path, s2), KS_OK);
    assert_memory_equal(s1, s2, sizeof s1); /* the same file, the same key on every replica */
    assert_int_equal(fchmod(fd, 0644), 0);
    assert_int_equal(store_blob_load_secret(path, s1), KS_ERR_IO); /* others may read it */
    assert_non_null(strstr(ks_errmsg(), "chmod 600"));
    close(fd);
    unlink(path);
    assert_int_equal(store_blob_load_secret(path, s1), KS_ERR_IO);
}

/* A loopback port nobody listens on (bound, then closed). */
static int closed_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &len), 0);
    close(fd);
    return ntohs(a.sin_port);
}

static void test_redis_down(void **state)
{
    (void)state;
    char url[64];
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", closed_port());
    struct store_redis_config cfg = {.url = url, .timeout_ms = 100};
    memcpy(cfg.fingerprint, FP, sizeof FP);
    struct store_redis *r = NULL;
    assert_int_equal(store_redis_open(&cfg, &r), KS_OK); /* down at start is no error */
    uint8_t page[256] = {0};
    for (int i = 0; i < 4; i++)
        assert_int_equal(store_redis_put(r, (struct store_key){(uint64_t)i, 1}, PARENT, 32, page, sizeof page),
                         KS_OK);
    store_redis_flush(r);
    struct store_key keys[3] = {{1, 1}, {2, 1}, {3, 1}};
    void *blobs[3] = {0};
    size_t lens[3] = {0};
    assert_int_equal(store_redis_get_chain(r, keys, 3, 0.0, blobs, lens), 0);
    struct store_redis_stats st;
    store_redis_stats(r, &st);
    assert_false(st.connected);
    assert_true(st.connect_failures >= 1);
    assert_int_equal(st.dropped, 4);
    assert_int_equal(st.writes, 0);
    assert_int_equal(st.lookups, 1);
    assert_int_equal(st.hits, 0);
    store_redis_close(r);
    store_redis_close(NULL);
}

static void test_bad_config(void **state)
{
    (void)state;
    struct store_redis_config cfg = {.url = "redis://h:1", .secret_file = "/nonexistent/kvserve-secret"};
    struct store_redis *r = (struct store_redis *)&cfg;
    assert_int_equal(store_redis_open(&cfg, &r), KS_ERR_IO);
    assert_null(r);
    assert_non_null(strstr(ks_errmsg(), "/nonexistent/kvserve-secret"));
    cfg = (struct store_redis_config){.url = "redis://h:99999"};
    assert_int_equal(store_redis_open(&cfg, &r), KS_ERR_INVALID_ARG);
    assert_null(r);
}

/* KV events with nothing listening: notes never block, the mirrored set stays exact (adds, removes, a key
 * added twice), the lost deltas are counted, a flush returns, and closing (with its empty snapshot) does
 * not hang. The events against a real redis-server: tests/e2e/route.sh. */
static void test_events_redis_down(void **state)
{
    (void)state;
    char url[64];
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", closed_port());
    uint8_t layout[36] = {9};
    struct store_events_config cfg = {.url = url, .timeout_ms = 100, .replica = "http://127.0.0.1:1",
                                      .layout = layout, .layout_len = sizeof layout, .page_tokens = 32,
                                      .flush_ms = 5};
    memcpy(cfg.fingerprint, FP, sizeof FP);
    struct store_events *e = NULL;
    assert_int_equal(store_events_open(&cfg, &e), KS_OK);
    for (uint64_t i = 1; i <= 3000; i++)
        store_events_note(e, (struct store_key){i * 0x9e3779b97f4a7c15ull, i}, true);
    store_events_note(e, (struct store_key){5 * 0x9e3779b97f4a7c15ull, 5}, true);
    for (uint64_t i = 1; i <= 1000; i++)
        store_events_note(e, (struct store_key){i * 0x9e3779b97f4a7c15ull, i}, false);
    store_events_note(e, (struct store_key){0, 0}, true); /* the empty key is never mirrored */
    store_events_flush(e, false);
    store_events_flush(e, true);
    struct store_events_stats st;
    store_events_stats(e, &st);
    assert_int_equal(st.held, 2000);
    assert_false(st.connected);
    assert_true(st.connect_failures >= 1);
    assert_int_equal(st.entries, 0);
    store_events_close(e);
    store_events_close(NULL);
    char stream[STORE_EVENTS_STREAM_CHARS + 1];
    store_events_stream(FP, stream);
    assert_string_equal(stream, "kvserve:events:0102030405060708090a0b0c0d0e0f10");
    cfg.replica = NULL;
    assert_int_equal(store_events_open(&cfg, &e), KS_ERR_INVALID_ARG);
    assert_null(e);
}


/* ---- against a real redis-server ------------------------------------------------ */

/* redis-server on a free loopback port, nothing saved; 0 when it cannot run. */
static pid_t redis_start(int port, redisContext **admin)
{
    pid_t pid = fork();
    if (pid == 0) {
        char p[16];
        snprintf(p, sizeof p, "%d", port);
        int null = open("/dev/null", O_WRONLY);
        dup2(null, 1);
        dup2(null, 2);
        execlp("redis-server", "redis-server", "--port", p, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", "/tmp", (char *)NULL);
        _exit(127);
    }
    for (int i = 0; pid > 0 && i < 200; i++) {
        *admin = redisConnect("127.0.0.1", port);
        redisReply *rep = *admin && !(*admin)->err ? redisCommand(*admin, "PING") : NULL;
        bool up = rep && rep->type == REDIS_REPLY_STATUS;
        freeReplyObject(rep);
        if (up)
            return pid;
        redisFree(*admin);
        *admin = NULL;
        if (waitpid(pid, NULL, WNOHANG) == pid)
            return 0; /* exited: not installed */
        nanosleep(&(struct timespec){0, 20 * 1000 * 1000}, NULL);
    }
    if (pid > 0) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
    }
    return 0;
}

static void redis_stop(pid_t pid, redisContext *admin)
{
    redisFree(admin);
    kill(pid, SIGTERM);
    waitpid(pid, NULL, 0);
}

static struct store_key chain_key(int i) { return (struct store_key){0x1000u + (uint64_t)i, 0x77}; }

static void admin_do(redisContext *admin, const char *fmt, const char *arg)
{
    redisReply *rep = redisCommand(admin, fmt, arg);
    assert_non_null(rep);
    freeReplyObject(rep);
}

static int32_t look_up(struct store_redis *r, int32_t n, double page_compute_s, size_t *first_len)
{
    struct store_key keys[8];
    void *blobs[8] = {0};
    size_t lens[8] = {0};
    for (int i = 0; i < n; i++)
        keys[i] = chain_key(i);
    int32_t got = store_redis_get_chain(r, keys, n, page_compute_s, blobs, lens);
    for (int i = 0; i < got; i++) {
        assert_int_equal(lens[i], 300 + i);
        for (size_t b = 0; b < lens[i]; b++)
            assert_int_equal(((uint8_t *)blobs[i])[b], (uint8_t)(b + (size_t)i));
        free(blobs[i]);
    }
    if (first_len)
        *first_len = got ? lens[0] : 0;
    return got;
}

static void test_chain_lookup_live(void **state)
{
    (void)state;
    int port = closed_port();
    redisContext *admin = NULL;
    pid_t pid = redis_start(port, &admin);
    if (!pid)
        KS_SKIP("redis-server is not installed (scripts/deps.sh installs it)");
    char url[64];
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", port);
    struct store_redis_config cfg = {.url = url, .timeout_ms = 2000};
    memcpy(cfg.fingerprint, FP, sizeof FP);
    struct store_redis *r = NULL;
    assert_int_equal(store_redis_open(&cfg, &r), KS_OK);
    uint8_t page[400];
    for (int i = 0; i < 6; i++) { /* pages 0..5 of a chain, page 3 missing */
        for (size_t b = 0; b < sizeof page; b++)
            page[b] = (uint8_t)(b + (size_t)i);
        if (i != 3)
            assert_int_equal(store_redis_put(r, chain_key(i), PARENT, 32, page, 300 + (size_t)i), KS_OK);
    }
    store_redis_flush(r);
    struct store_redis_stats st;

    /* one round trip, stopping at the first miss */
    assert_int_equal(look_up(r, 8, 0.0, NULL), 3);
    store_redis_stats(r, &st);
    assert_int_equal(st.lookups, 1);
    assert_int_equal(st.round_trips, 1);
    assert_int_equal(st.hits, 3);
    assert_int_equal(st.misses, 1);
    assert_int_equal(st.read_bytes, 3 * sizeof(struct store_header) + 300 + 301 + 302);

    /* a lookup is one MGET, no script: a Redis user who may not run scripts still shares pages */
    admin_do(admin, "ACL SETUSER default -@scripting", NULL);
    assert_int_equal(look_up(r, 3, 0.0, NULL), 3);
    assert_int_equal(look_up(r, 2, 0.0, NULL), 2);
    store_redis_stats(r, &st);
    assert_int_equal(st.lookups, 3);
    assert_int_equal(st.round_trips, 3);
    assert_int_equal(st.errors, 0);

    /* a damaged value ends the run after the pages before it, and is deleted */
    char name[STORE_REDIS_KEY_CHARS + 1];
    store_redis_key_name(FP, chain_key(1), name);
    admin_do(admin, "SET %s garbage", name);
    assert_int_equal(look_up(r, 3, 0.0, NULL), 1);
    store_redis_flush(r);
    redisReply *rep = redisCommand(admin, "EXISTS %s", name);
    assert_non_null(rep);
    assert_int_equal(rep->integer, 0);
    freeReplyObject(rep);
    store_redis_stats(r, &st);
    assert_int_equal(st.corrupt, 1);
    assert_int_equal(st.round_trips, 4);

    /* computing a page faster than reading it: Redis is not asked */
    assert_int_equal(look_up(r, 3, 1e-12, NULL), 0);
    store_redis_stats(r, &st);
    assert_int_equal(st.declined, 1);
    assert_int_equal(st.round_trips, 4);
    assert_int_equal(st.lookups, 5);
    assert_true(st.connected);
    assert_true(st.rtt_ms > 0);
    store_redis_close(r);
    redis_stop(pid, admin);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sound_value),   cmocka_unit_test(test_damaged_values),
        cmocka_unit_test(test_foreign_values), cmocka_unit_test(test_key_name),
        cmocka_unit_test(test_url),           cmocka_unit_test(test_secret_file),
        cmocka_unit_test(test_redis_down),    cmocka_unit_test(test_bad_config),
        cmocka_unit_test(test_events_redis_down), cmocka_unit_test(test_chain_lookup_live),
    };
    return ks_run_tests(tests, NULL, NULL);
}
