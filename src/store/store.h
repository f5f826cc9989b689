/* store: the SSD tier of the KV prefix cache. An LMDB environment in one
 * directory holds page blobs under their 128-bit chain keys (the kv module
 * makes and checks the blobs; the store treats them as bytes). Pages evicted
 * from RAM are queued here and written behind by one writer thread, in
 * batches of one transaction; a RAM miss reads them back with store_get().
 *
 * On disk an entry is a header (magic, format version, model fingerprint,
 * key, parent key, token count, payload length, XXH3-64 checksum of header
 * and payload keyed with the directory's secret file) followed by the blob,
 * plus a small metadata record (last use, size, hits, parent) that the
 * in-memory index is rebuilt from at open.
 *
 * Durability: every batch is one LMDB write transaction. LMDB never
 * overwrites the pages a committed transaction points to, so killing the
 * process at any moment leaves the last committed state intact; the
 * environment is opened with MDB_NOMETASYNC, so a crash of the whole machine
 * may lose the last transaction but not the store's integrity.
 *
 * Failures never stop the server: an entry that fails its checks is counted
 * and deleted; a full map or disk makes the writer evict the least recently
 * used entries and retry, and if that fails the tier disables itself (one
 * line on stderr), after which puts are refused and gets miss.
 *
 * Thread-safe: any thread may call any function. */
#ifndef KS_STORE_H
#define KS_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "status/status.h"

struct store;

struct store_key {
    uint64_t lo, hi;
};

struct store_config {
    const char *dir;          /* created if missing (one level, mode 0700); holds data.mdb and lock.mdb */
    uint64_t max_bytes;       /* limit of the entries' disk footprint; 0 = 10% of dir's free space at open */
    uint8_t fingerprint[16];  /* the model's: an entry with another one is foreign (never returned) */
    size_t queue_bytes;       /* bound of the write-behind queue; 0 = 64 MiB */
    uint64_t map_bytes;       /* LMDB map size; 0 = derived from max_bytes (tests set it small) */
};

/* Open or create the store and rebuild the index from its metadata (entries
 * without metadata, metadata without entries, entries with a broken header
 * and entries of an older format are deleted). A damaged directory (data.mdb
 * shorter than LMDB recorded, broken meta pages or B-tree, a walk that
 * crashes LMDB in a child process) is renamed to <dir>.damaged-<UTC time>,
 * with a line on stderr, and the store starts empty. Errors: KS_ERR_IO (the
 * directory cannot be created or moved aside, belongs to another user or is
 * writable by group/others, holds a symbolic link where LMDB or the secret
 * is, or LMDB refuses it; the message names the path and the fix),
 * KS_ERR_INVALID_ARG, KS_ERR_NOMEM. Forks once (the check's child). */
ks_status store_open(const struct store_config *cfg, struct store **out);
/* Commit everything queued, stop the writer and close. NULL is a no-op. */
void store_close(struct store *s);
/* The effective disk limit in bytes. */
uint64_t store_limit(const struct store *s);

/* Queue a page blob (copied) to be written behind. parent: the key of the
 * previous page of its chain (zero for a first page); n_tokens: tokens in the
 * page. Never blocks: with a full queue the page is dropped and counted. A key
 * already stored is skipped (deduplicated). KS_ERR_STATE when the tier is
 * disabled, KS_ERR_NOMEM. */
ks_status store_put(struct store *s, struct store_key key, struct store_key parent, uint32_t n_tokens,
                    const void *blob, size_t len);
/* Block until everything queued before the call is committed or dropped. */
void store_flush(struct store *s);
/* Is key stored? From the index, no disk access. *bytes_out (may be NULL):
 * the blob's size. */
bool store_has(struct store *s, struct store_key key, size_t *bytes_out);
/* Read a blob into *blob_out (malloc'd, the caller frees) of *len_out bytes.
 * The header and checksum are verified: a corrupt, truncated or foreign entry
 * is counted, deleted by the writer and reported as KS_ERR_NOT_FOUND, like a
 * missing key or a disabled tier. Updates the entry's last use and hits and
 * the measured read speed. KS_ERR_NOMEM. */
ks_status store_get(struct store *s, struct store_key key, void **blob_out, size_t *len_out);
/* Estimated seconds to read len bytes: from the measured read throughput
 * (1 GB/s before the first read). */
double store_read_seconds(struct store *s, size_t len);
/* Delete every entry (waits for the writer). *n_deleted (may be NULL). */
ks_status store_clear(struct store *s, uint64_t *n_deleted);

struct store_entry_info {
    struct store_key key, parent;
    uint32_t n_tokens;
    uint64_t bytes;           /* disk footprint */
    uint64_t last_use;        /* unix ms */
    uint64_t hits;
};
/* Call fn for every indexed entry, under the store's lock (no disk access):
 * fn must be quick and must not call the store. */
void store_foreach(struct store *s, void (*fn)(void *user, const struct store_entry_info *e), void *user);

struct store_stats {
    uint64_t entries, bytes, limit;
    uint64_t reads, read_bytes;     /* successful store_get */
    uint64_t writes, write_bytes;   /* entries committed */
    uint64_t hits, misses;          /* store_get outcomes */
    uint64_t corrupt;               /* corrupt, truncated or foreign entries found (and deleted) */
    uint64_t evictions;             /* entries deleted for room */
    uint64_t dropped;               /* puts dropped: a full queue, or a page a full map could not take */
    uint64_t deduplicated;          /* puts of a key already stored */
    uint64_t failures;              /* write transactions that failed */
    bool disabled;
    double read_gbs;                /* measured read throughput, 0 before any read */
};
void store_stats(struct store *s, struct store_stats *out);

/* XXH3-128 of data keyed with the directory's secret: a digest only this
 * directory's owner can predict, stable across restarts (the server derives
 * tenants' cache salts from API keys with it). */
struct store_key store_keyed_digest(const struct store *s, const void *data, size_t n);

/* ---- the shared tier: Redis ------------------------------------------------
 *
 * Replicas of one model share pages through a Redis server (Debian's
 * redis-server, through libhiredis): one string per page under
 * "kvserve:<fingerprint hex>:<page key hex>", the same header as an SSD entry
 * (magic, version, fingerprint, key, parent, tokens, length, checksum) and the
 * kv blob. Pages are written behind by one thread (SET NX EX ttl, pipelined);
 * a lookup costs one round trip whatever the chain's length: one MGET of the
 * chain's keys, whose leading run up to the first miss is used (no Lua: a
 * script passing the values made Redis build the reply several times slower).
 * How many pages
 * it may read is decided before the call by the SSD tier's cost test with the
 * measured round trip, read speed and page size: nothing when reading a page
 * costs more than computing it, or when even the whole chain would not pay
 * the round trip back; else the whole chain. The Redis user needs MGET, SET
 * and DEL.
 *
 * The check: XXH3-64 over the header and the payload, unkeyed by default, so
 * any replica verifies any other's pages: it catches corruption and foreign or
 * misplaced values, not a malicious writer. With a shared secret file
 * (secret) the checksum is keyed with it: replicas with the same file accept
 * each other's pages, anything else fails as foreign. XXH3 is no MAC either
 * way: protect the Redis server itself (bind, firewall, requirepass/ACL).
 *
 * Faults never stop the server: Redis down, killed, slow (each call times out
 * after timeout_ms), full (OOM replies to SET) or holding a bad value, and the
 * lookup misses (the caller computes), the write is dropped; each kind is
 * counted and logged once, and the connections come back with a backoff
 * (0.1 s doubling to 5 s). Thread-safe: lookups from one thread at a time
 * (the scheduler's), puts from any. */
struct store_redis;

struct store_redis_config {
    const char *url;          /* redis://HOST:PORT[/DB] */
    const char *password;     /* AUTH; NULL or "": none */
    const char *secret_file;  /* shared checksum key (>= 16 bytes, mode 0600); NULL: unkeyed */
    uint8_t fingerprint[16];  /* the model's: part of every key and checked in every value */
    uint32_t ttl_s;           /* EX of every SET; 0 = 86400 */
    uint32_t timeout_ms;      /* of each connect and call; 0 = 200 */
    size_t queue_bytes;       /* bound of the write-behind queue; 0 = 64 MiB */
};

/* Split "redis://HOST:PORT[/DB]" (PORT 1..65535, DB 0..15 by default 0; a
 * "user:password@" part is refused: passwords never go on a command line).
 * KS_ERR_INVALID_ARG naming what is wrong. */
ks_status store_redis_parse_url(const char *url, char *host, size_t host_cap, int *port, int *db);
/* Parse the URL, read the secret file, start the writer. Redis being down is
 * not an error (one line on stderr; the tier reconnects). KS_ERR_INVALID_ARG,
 * KS_ERR_IO (the secret file), KS_ERR_NOMEM. */
ks_status store_redis_open(const struct store_redis_config *cfg, struct store_redis **out);
/* Write what is queued (bounded by the timeouts), stop the writer, close. NULL: no-op. */
void store_redis_close(struct store_redis *r);
/* Queue a page blob (copied) to be written behind. Never blocks: with a full
 * queue, or Redis down, the page is dropped and counted. KS_ERR_NOMEM. */
ks_status store_redis_put(struct store_redis *r, struct store_key key, struct store_key parent, uint32_t n_tokens,
                          const void *blob, size_t len);
/* Block until everything queued before the call is written or dropped. */
void store_redis_flush(struct store_redis *r);
/* Look up the chain keys[0, n) in order, in one round trip: blobs[i]
 * (malloc'd, the caller frees each) and lens[i] get the verified payloads of
 * the leading run of pages that Redis holds, stopping at the first miss, bad
 * value or error. page_compute_s: the seconds computing one page costs (0:
 * always read); when reading cannot beat it (see above), Redis is not asked
 * (counted in declined). Returns the pages in the run (0 on any fault; the
 * pages verified before a bad value are kept, the bad value is deleted from
 * Redis). */
int32_t store_redis_get_chain(struct store_redis *r, const struct store_key *keys, int32_t n, double page_compute_s,
                              void **blobs, size_t *lens);

struct store_redis_stats {
    uint64_t lookups, hits, misses;     /* get_chain calls; pages found and read, chains ended by a miss */
    uint64_t round_trips;               /* lookup commands answered: one MGET per lookup sent */
    uint64_t declined;                  /* lookups not sent: reading could not beat computing */
    uint64_t reads, read_bytes;         /* pages read and verified */
    uint64_t writes, write_bytes;       /* pages Redis took */
    uint64_t deduplicated;              /* SET NX found the key there already */
    uint64_t dropped;                   /* puts dropped: a full queue or Redis down */
    uint64_t corrupt, foreign;          /* values failing the check: damaged; well formed but another model's or key's */
    uint64_t full;                      /* SETs refused for memory (OOM) */
    uint64_t timeouts, errors;          /* calls that timed out; other I/O or protocol errors */
    uint64_t connect_failures, reconnects;
    bool connected;                     /* the lookup connection is up */
    double rtt_ms, read_mbs;            /* measured round trip and GET throughput (0 before any) */
};
void store_redis_stats(struct store_redis *r, struct store_redis_stats *out);
/* XXH3-128 of data keyed with the shared secret (secret_file): the digest
 * every replica and router given the same file computes (the server derives
 * tenants' cache salts from API keys with it). false without a secret file. */
bool store_redis_keyed_digest(const struct store_redis *r, const void *data, size_t n, struct store_key *out);
/* The same digest from the secret file itself (a router, which has no tier).
 * KS_ERR_IO naming the file and the fix. */
ks_status store_secret_file_digest(const char *secret_file, const void *data, size_t n, struct store_key *out);

/* ---- KV events: the chain keys a replica holds, in a Redis stream ----------
 *
 * A replica tells routers which full pages it holds (vLLM's and Dynamo's KV
 * events), so a router sends a prompt where most of it is cached. Each
 * replica appends to the stream "kvserve:events:<fingerprint hex>" (one per
 * model) with XADD ... MAXLEN ~ maxlen, entries of these fields:
 *   replica      the URL routers reach the replica at (its identity)
 *   epoch        a random number per start: a new epoch replaces the old state
 *   seq          1, 2, 3, ... per entry within an epoch (a gap: entries lost)
 *   op           "add" (keys gained), "del" (keys lost) or "snap" (the whole
 *                set the replica holds now, replacing everything before)
 *   keys         the keys, 16 bytes each (lo then hi, little-endian)
 *   page_tokens  (snap only) P, and
 *   layout       (snap only) the key layout's bytes (kv_key_layout), so a
 *                router computes the same keys from a prompt's tokens
 * Deltas go out every flush_ms in order, a snapshot every snapshot_s seconds,
 * after any loss (a full queue, Redis down) and at close (an empty one, so
 * routers forget the replica at once). A router that starts late reads the
 * stream from its start (the latest snapshot of each replica is in it when
 * maxlen covers snapshot_s of events) and follows with XREAD. Never blocks
 * the caller: store_events_note only updates a set and a queue under a
 * mutex; one thread writes, with the Redis tier's faults, counts and backoff. */
struct store_events;

struct store_events_config {
    const char *url;          /* redis://HOST:PORT[/DB] */
    const char *password;     /* AUTH; NULL or "": none */
    uint32_t timeout_ms;      /* of each connect and call; 0 = 200 */
    uint8_t fingerprint[16];  /* the model's: names the stream */
    const char *replica;      /* the URL routers reach this replica at */
    const void *layout;       /* the key layout's bytes (kv_key_layout), len bytes, <= 64 */
    size_t layout_len;
    int32_t page_tokens;
    uint32_t maxlen;          /* MAXLEN ~ of the stream; 0 = 10000 */
    uint32_t snapshot_s;      /* seconds between snapshots; 0 = 10 */
    uint32_t flush_ms;        /* milliseconds between delta entries; 0 = 20 */
};
ks_status store_events_open(const struct store_events_config *cfg, struct store_events **out);
/* Publish an empty snapshot (bounded by the timeout), stop the writer, close. NULL: no-op. */
void store_events_close(struct store_events *e);
/* A full page's key entered (held) or left the cache. Any thread; never blocks
 * on Redis. */
void store_events_note(struct store_events *e, struct store_key key, bool held);
/* Send what is pending now (a snapshot when asked) and wait until it is sent
 * or failed. */
void store_events_flush(struct store_events *e, bool snapshot);

struct store_events_stats {
    uint64_t entries, snapshots;        /* XADDs Redis took; of which snapshots */
    uint64_t keys_added, keys_removed;  /* keys in add/del entries Redis took */
    uint64_t lost;                      /* deltas lost (queue full, Redis down): a snapshot repairs */
    uint64_t errors, connect_failures, reconnects;
    uint64_t held;                      /* keys held now */
    bool connected;
};
void store_events_stats(struct store_events *e, struct store_events_stats *out);

/* The stream's name for a fingerprint (STORE_EVENTS_STREAM_CHARS + 1 bytes). */
enum { STORE_EVENTS_STREAM_CHARS = 15 + 32 };
void store_events_stream(const uint8_t fingerprint[16], char *out);

/* One entry, as parsed from a stream (pointers into the caller's fields). */
enum store_event_op { STORE_EVENT_ADD, STORE_EVENT_DEL, STORE_EVENT_SNAP };
struct store_event {
    const char *replica;      /* not NUL-terminated: replica_len bytes */
    size_t replica_len;
    uint64_t epoch, seq;
    enum store_event_op op;
    const uint8_t *keys;      /* n_keys * 16 bytes */
    size_t n_keys;
    const uint8_t *layout;    /* snap: layout_len bytes; else NULL */
    size_t layout_len;
    int32_t page_tokens;      /* snap: P; else 0 */
};
/* Parse an entry's n_fields name/value strings (fields[2i] a name, fields[2i
 * + 1] its value, lens their lengths). Unknown fields are ignored.
 * KS_ERR_FORMAT naming the missing or bad field. */
ks_status store_event_parse(const char *const *fields, const size_t *lens, size_t n_fields, struct store_event *out);
/* The argument vector of one entry's XADD (argv/lens hold 16 slots; strings
 * point into ev and into scratch, 64 bytes). Returns argc. */
int store_event_argv(const char *stream, uint32_t maxlen, const struct store_event *ev, char *scratch,
                     const char **argv, size_t *lens);

#endif
