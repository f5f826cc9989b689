/* store internals: the on-disk records, the in-memory index and the writer. */
#ifndef KS_STORE_INTERNAL_H
#define KS_STORE_INTERNAL_H

#include <lmdb.h>
#include <pthread.h>
#include <stdarg.h>
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack, XXH3_generateSecret */
#include <xxhash.h>

#include "store/store.h"

/* Version 2: checksums keyed with the directory's secret (version 1 entries
 * are dropped at open, see the "format" record). */
enum { STORE_MAGIC = 0x5453564B /* "KVST" */, STORE_VERSION = 2, STORE_SECRET_BYTES = 32 };
#define STORE_SECRET_FILE "secret.key"

/* In front of every blob in the entries database. */
struct store_header {
    uint32_t magic, version;
    uint8_t fingerprint[16];
    struct store_key key, parent;
    uint32_t n_tokens, reserved;
    uint64_t payload_len;
    uint64_t checksum;        /* XXH3-64 with the directory's secret of this header (checksum 0), then the payload */
};
_Static_assert(sizeof(struct store_header) == 80, "the entry header is an on-disk format");

/* The metadata database's value: what the index is rebuilt from. */
struct store_meta {
    struct store_key parent;
    uint32_t n_tokens, reserved;
    uint64_t bytes, last_use, hits;
};
_Static_assert(sizeof(struct store_meta) == 48, "the metadata record is an on-disk format");

struct store_entry {
    struct store_key key;
    struct store_meta meta;
    bool dirty;               /* meta changed in memory (a read), not yet written */
};

/* key -> entry: open addressing over slots holding entry indexes. */
struct store_index {
    struct store_entry *e;    /* (n) dense */
    uint32_t n, cap_e;
    int32_t *slots;           /* (cap) index into e, or -1 */
    uint32_t cap;
    uint64_t bytes;           /* sum of meta.bytes */
};

int32_t store_index_find(const struct store_index *ix, struct store_key k);
ks_status store_index_put(struct store_index *ix, struct store_key k, const struct store_meta *m);
void store_index_remove(struct store_index *ix, struct store_key k);
void store_index_free(struct store_index *ix);

/* A page waiting to be written, header included. */
struct store_item {
    struct store_item *next;
    struct store_key key;
    struct store_meta meta;
    void *data;
    size_t len;
};

enum { STORE_BATCH_BYTES = 64 << 20 };

/* An eviction commit needs free pages too (LMDB copies the pages it
 * changes), and pages a commit frees are reusable only two commits later,
 * so a map that data fills completely cannot even evict. The writer keeps
 * the stored bytes under a budget that leaves room for the pages of three
 * batches in flight: the default map (the limit and a half, plus a batch)
 * gives the whole limit; a map set smaller gets two thirds of what is left
 * after one batch, with batches of an eighth of the map. */
static inline void store_size_budget(uint64_t limit, uint64_t map, uint64_t *budget, uint64_t *batch)
{
    *batch = map / 8 < STORE_BATCH_BYTES ? map / 8 : STORE_BATCH_BYTES;
    uint64_t fits = (map - *batch) / 3 * 2;
    *budget = limit < fits ? limit : fits;
}

struct store {
    struct store_config cfg;
    char *dir;
    MDB_env *env;
    MDB_dbi entries, metas;
    MDB_dbi clock;                 /* one counter, rewritten to advance LMDB's txn id */
    uint64_t map_bytes;
    uint64_t limit;
    /* What the writer keeps stored, and the most one batch writes: the limit
     * and STORE_BATCH_BYTES, or less when the map is too small for them
     * (store_size_budget). */
    uint64_t budget, batch_bytes;

    pthread_mutex_t mu;
    pthread_cond_t wake, done;
    pthread_t writer;
    bool writer_started, stop;
    struct store_index ix;
    struct store_item *queue, *queue_tail;
    size_t queue_bytes;
    uint64_t queued_seq, done_seq; /* puts queued / handled by the writer */
    struct store_key *doomed;      /* keys to delete (corrupt entries) */
    uint32_t n_doomed, cap_doomed;
    bool clear_all;                /* store_clear asked */
    uint64_t cleared;              /* entries the last clear deleted */
    uint32_t n_dirty;
    int consecutive_failures;
    struct store_stats st;
    double read_bps;               /* EWMA of measured read throughput */
    uint8_t secret[XXH3_SECRET_DEFAULT_SIZE]; /* keys the checksums, from the directory's secret file */
    char damage[512];              /* why the directory was found damaged ("" if it was not) */
    /* LMDB's map as opened, for store_value_sane (the open's walk only) */
    const uint8_t *map_base;
    uint32_t psize;
    uint64_t file_bytes;
};

/* Disk footprint of an entry of len blob bytes: LMDB stores it in whole pages. */
uint64_t store_footprint(size_t len);
uint64_t store_now_ms(void);
void *store_writer_main(void *arg);
/* Disable the tier (mu held): log once, drop the queue. */
void store_disable(struct store *s, const char *why);

/* store_check.c: checks before LMDB maps anything. */
/* The directory is the server user's and nobody else can write it. */
ks_status store_check_dir(const char *dir);
/* data.mdb and lock.mdb, if present, are regular files of ours (no links). */
ks_status store_check_files(const char *dir);
/* data.mdb holds the pages its current meta page records (a few missing at
 * the end are added as zeros); *recorded_out: that size, 0 without a file. */
ks_status store_check_data(struct store *s, uint64_t *recorded_out);
/* Read (or make, 0600, on first use) the directory's secret into s->secret. */
ks_status store_load_secret(struct store *s);
/* Note in s->damage why the directory is damaged; returns KS_ERR_IO. */
ks_status store_damaged(struct store *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A value LMDB returned during the open's walk: one on overflow pages must
 * follow an overflow page header naming its own page and the pages the value
 * needs, all within the file (else deleting it would make LMDB free pages
 * that are not its own, and reading it could run past the file). */
bool store_value_sane(const struct store *s, const MDB_val *v);
/* Rename dir to <dir>.damaged-<UTC time>; moved_to: the new name. */
ks_status store_move_aside(const char *dir, char *moved_to, size_t cap);

/* ---- Redis connections (store_redis.c; the page tier's and the KV events') ----- */
struct redisContext;
struct timeval;
/* A hiredis connection to host:port whose calls time out after timeout,
 * authenticated with password (NULL: none) and on database db; NULL with
 * why (cap bytes) saying what failed. */
struct redisContext *store_redis_connect(const char *host, int port, const struct timeval *timeout,
                                         const char *password, int db, char *why, size_t cap);

/* ---- the Redis tier's values (store_redis_blob.c) -------------------------
 * A value is a store_header then the kv blob, like an SSD entry; its
 * checksum is XXH3-64 over the header (checksum 0) and the payload, with the
 * shared secret or, without one, XXH3's default secret (unkeyed), so every
 * replica can verify every other's pages. reserved carries
 * STORE_BLOB_KEYED when a shared secret keyed it. */
enum { STORE_BLOB_KEYED = 1 };
enum store_blob_verdict {
    STORE_BLOB_OK = 0,
    STORE_BLOB_CORRUPT,       /* too short, not a kvserve value, wrong length or checksum */
    STORE_BLOB_FOREIGN,       /* well formed, but another format version, model, key, or keying */
};
/* The header of a value for payload (its checksum still 0). */
struct store_header store_blob_header(const uint8_t fingerprint[16], struct store_key key, struct store_key parent,
                                      uint32_t n_tokens, size_t payload_len, bool keyed);
/* Checksum of header h (its checksum field ignored) and payload; secret:
 * XXH3_SECRET_DEFAULT_SIZE bytes, NULL: unkeyed. */
uint64_t store_blob_checksum(const struct store_header *h, const void *payload, const uint8_t *secret);
/* Is data[0, len) a sound value for key of this model and keying? */
enum store_blob_verdict store_blob_check(const void *data, size_t len, const uint8_t fingerprint[16],
                                         struct store_key key, const uint8_t *secret);
/* "kvserve:<fingerprint hex>:<key hex, hi then lo>" into out. */
enum { STORE_REDIS_KEY_CHARS = 8 + 32 + 1 + 32 };
void store_redis_key_name(const uint8_t fingerprint[16], struct store_key key, char out[STORE_REDIS_KEY_CHARS + 1]);
/* Read a shared secret file (a regular file of ours, mode 0600, 16..4096 bytes)
 * and expand it to XXH3's secret size. KS_ERR_IO naming the file and the fix. */
ks_status store_blob_load_secret(const char *path, uint8_t secret[XXH3_SECRET_DEFAULT_SIZE]);

#endif
