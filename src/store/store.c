/* Opening the store, rebuilding its index, and the calls that any thread
 * makes: put (queue), get (read and verify), flush, clear, stats. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <xxhash.h>

#include "store/store_internal.h"

enum { LMDB_PAGE = 4096, DEFAULT_QUEUE = 64 << 20 };
static const double FIRST_READ_BPS = 1e9;

uint64_t store_footprint(size_t len)
{
    uint64_t n = (uint64_t)len + sizeof(struct store_header) + sizeof(struct store_meta);
    return (n + LMDB_PAGE - 1) / LMDB_PAGE * LMDB_PAGE + LMDB_PAGE;
}

uint64_t store_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static MDB_val key_val(const struct store_key *k) { return (MDB_val){sizeof *k, (void *)k}; }

/* The header's hash (checksum field zeroed) seeds the payload's: one value
 * covers both, with no hashing state to allocate (a failed allocation must
 * never make a good entry look corrupt). */
static uint64_t checksum(const struct store_header *h, const void *payload)
{
    struct store_header z = *h;
    z.checksum = 0;
    return XXH3_64bits_withSeed(payload, (size_t)h->payload_len, XXH3_64bits(&z, sizeof z));
}

static void drop_queue(struct store *s)
{
    for (struct store_item *it = s->queue, *next; it; it = next) {
        next = it->next;
        free(it->data);
        free(it);
    }
    s->queue = s->queue_tail = NULL;
    s->queue_bytes = 0;
    s->done_seq = s->queued_seq;
    pthread_cond_broadcast(&s->done);
}

void store_disable(struct store *s, const char *why)
{
    if (!s->st.disabled)
        fprintf(stderr, "kvserve: prefix cache on disk disabled: %s (%s)\n", why, s->dir);
    s->st.disabled = true;
    drop_queue(s);
}

/* ---- open: the environment and the index ------------------------------------ */

static ks_status lmdb_fail(const struct store *s, const char *what, int rc)
{
    return ks_fail(KS_ERR_IO, "prefix cache on disk %s: %s: %s", s->dir, what, mdb_strerror(rc));
}

static ks_status make_dir(const char *dir)
{
    if (mkdir(dir, 0700) != 0 && errno != EEXIST)
        return ks_fail(KS_ERR_IO, "--cache-dir %s: cannot create it: %s", dir, strerror(errno));
    struct stat sb;
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return ks_fail(KS_ERR_IO, "--cache-dir %s: not a directory", dir);
    return KS_OK;
}

static uint64_t tenth_of_free(const char *dir)
{
    struct statvfs v;
    if (statvfs(dir, &v) != 0)
        return 1ull << 30;
    return (uint64_t)v.f_bavail * v.f_frsize / 10;
}

static ks_status open_env(struct store *s)
{
    uint64_t map = s->cfg.map_bytes ? s->cfg.map_bytes : s->limit + s->limit / 2 + (64u << 20);
    s->map_bytes = map;
    store_size_budget(s->limit, map, &s->budget, &s->batch_bytes);
    int rc;
    if ((rc = mdb_env_create(&s->env)))
        return lmdb_fail(s, "cannot create the environment", rc);
    if ((rc = mdb_env_set_maxdbs(s->env, 3)) || (rc = mdb_env_set_mapsize(s->env, (size_t)map)))
        return lmdb_fail(s, "cannot size the environment", rc);
    /* NOTLS: read transactions run on HTTP and scheduler threads alike */
    if ((rc = mdb_env_open(s->env, s->dir, MDB_NOTLS | MDB_NOMETASYNC, 0600)))
        return lmdb_fail(s, "cannot open", rc);
    MDB_txn *txn;
    if ((rc = mdb_txn_begin(s->env, NULL, 0, &txn)))
        return lmdb_fail(s, "cannot begin a transaction", rc);
    if ((rc = mdb_dbi_open(txn, "entries", MDB_CREATE, &s->entries)) ||
        (rc = mdb_dbi_open(txn, "meta", MDB_CREATE, &s->metas)) ||
        (rc = mdb_dbi_open(txn, "clock", MDB_CREATE, &s->clock)) || (rc = mdb_txn_commit(txn))) {
        if (rc != MDB_SUCCESS)
            mdb_txn_abort(txn);
        return lmdb_fail(s, "cannot open its databases", rc);
    }
    return KS_OK;
}

/* Delete in db every key that other does not hold; returns an LMDB code. */
static int drop_orphans(MDB_txn *txn, MDB_dbi db, MDB_dbi other)
{
    MDB_cursor *c;
    int rc = mdb_cursor_open(txn, db, &c);
    if (rc)
        return rc;
    MDB_val k, v, o;
    for (rc = mdb_cursor_get(c, &k, &v, MDB_FIRST); rc == 0; rc = mdb_cursor_get(c, &k, &v, MDB_NEXT))
        if (k.mv_size != sizeof(struct store_key) || mdb_get(txn, other, &k, &o) != 0)
            if ((rc = mdb_cursor_del(c, 0)))
                break;
    mdb_cursor_close(c);
    return rc == MDB_NOTFOUND ? 0 : rc;
}

static ks_status load_index(struct store *s)
{
    MDB_txn *txn;
    int rc = mdb_txn_begin(s->env, NULL, 0, &txn);
    if (rc)
        return lmdb_fail(s, "cannot begin a transaction", rc);
    if ((rc = drop_orphans(txn, s->metas, s->entries)) || (rc = drop_orphans(txn, s->entries, s->metas))) {
        mdb_txn_abort(txn);
        return lmdb_fail(s, "cannot check its index", rc);
    }
    MDB_cursor *c;
    if ((rc = mdb_cursor_open(txn, s->metas, &c))) {
        mdb_txn_abort(txn);
        return lmdb_fail(s, "cannot read its index", rc);
    }
    MDB_val k, v;
    ks_status st = KS_OK;
    for (rc = mdb_cursor_get(c, &k, &v, MDB_FIRST); rc == 0 && !st; rc = mdb_cursor_get(c, &k, &v, MDB_NEXT)) {
        struct store_key key;
        struct store_meta m;
        if (v.mv_size != sizeof m) {
            mdb_cursor_del(c, 0); /* its entry goes at the next open */
            continue;
        }
        memcpy(&key, k.mv_data, sizeof key);
        memcpy(&m, v.mv_data, sizeof m);
        st = store_index_put(&s->ix, key, &m);
    }
    mdb_cursor_close(c);
    if (st) {
        mdb_txn_abort(txn);
        return st;
    }
    if ((rc = mdb_txn_commit(txn)))
        return lmdb_fail(s, "cannot commit its index check", rc);
    return KS_OK;
}

ks_status store_open(const struct store_config *cfg, struct store **out)
{
    *out = NULL;
    if (!cfg || !cfg->dir || !*cfg->dir)
        return ks_fail(KS_ERR_INVALID_ARG, "prefix cache on disk: no directory");
    ks_status st = make_dir(cfg->dir);
    if (st)
        return st;
    struct store *s = calloc(1, sizeof *s);
    if (!s || !(s->dir = strdup(cfg->dir))) {
        free(s);
        return ks_fail(KS_ERR_NOMEM, "prefix cache on disk: out of memory");
    }
    s->cfg = *cfg;
    s->cfg.dir = s->dir;
    if (!s->cfg.queue_bytes)
        s->cfg.queue_bytes = DEFAULT_QUEUE;
    s->limit = cfg->max_bytes ? cfg->max_bytes : tenth_of_free(cfg->dir);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->wake, NULL);
    pthread_cond_init(&s->done, NULL);
    if (!(st = open_env(s)) && !(st = load_index(s))) {
        if (pthread_create(&s->writer, NULL, store_writer_main, s) != 0)
            st = ks_fail(KS_ERR_NOMEM, "prefix cache on disk: cannot start the writer thread");
        else
            s->writer_started = true;
    }
    if (st) {
        store_close(s);
        return st;
    }
    *out = s;
    return KS_OK;
}

void store_close(struct store *s)
{
    if (!s)
        return;
    if (s->writer_started) {
        pthread_mutex_lock(&s->mu);
        s->stop = true;
        pthread_cond_signal(&s->wake);
        pthread_mutex_unlock(&s->mu);
        pthread_join(s->writer, NULL);
    }
    drop_queue(s); /* the writer committed everything unless the tier was disabled */
    if (s->env)
        mdb_env_close(s->env);
    store_index_free(&s->ix);
    free(s->doomed);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->wake);
    pthread_cond_destroy(&s->done);
    free(s->dir);
    free(s);
}

uint64_t store_limit(const struct store *s) { return s->limit; }

/* ---- writing ------------------------------------------------------------------- */

static void *make_entry(const struct store *s, struct store_key key, struct store_key parent, uint32_t n_tokens,
                        const void *blob, size_t len)
{
    struct store_header h = {.magic = STORE_MAGIC, .version = STORE_VERSION, .key = key, .parent = parent,
                             .n_tokens = n_tokens, .payload_len = len};
    memcpy(h.fingerprint, s->cfg.fingerprint, sizeof h.fingerprint);
    h.checksum = checksum(&h, blob);
    uint8_t *data = malloc(sizeof h + len);
    if (data) {
        memcpy(data, &h, sizeof h);
        memcpy(data + sizeof h, blob, len);
    }
    return data;
}

ks_status store_put(struct store *s, struct store_key key, struct store_key parent, uint32_t n_tokens,
                    const void *blob, size_t len)
{
    pthread_mutex_lock(&s->mu);
    bool disabled = s->st.disabled, known = store_index_find(&s->ix, key) >= 0;
    bool full = s->queue_bytes + len > s->cfg.queue_bytes;
    if (disabled || known || full) {
        s->st.deduplicated += known && !disabled;
        s->st.dropped += full && !known && !disabled;
        pthread_mutex_unlock(&s->mu);
        return disabled ? ks_fail(KS_ERR_STATE, "the prefix cache on disk is disabled") : KS_OK;
    }
    pthread_mutex_unlock(&s->mu);
    struct store_item *it = calloc(1, sizeof *it);
    void *data = it ? make_entry(s, key, parent, n_tokens, blob, len) : NULL;
    if (!data) {
        free(it);
        return ks_fail(KS_ERR_NOMEM, "prefix cache on disk: out of memory for a queued page");
    }
    *it = (struct store_item){.key = key, .data = data, .len = sizeof(struct store_header) + len,
                              .meta = {.parent = parent, .n_tokens = n_tokens, .bytes = store_footprint(len),
                                       .last_use = store_now_ms()}};
    pthread_mutex_lock(&s->mu);
    if (s->queue_tail)
        s->queue_tail->next = it;
    else
        s->queue = it;
    s->queue_tail = it;
    s->queue_bytes += it->len;
    s->queued_seq++;
    pthread_cond_signal(&s->wake);
    pthread_mutex_unlock(&s->mu);
    return KS_OK;
}

void store_flush(struct store *s)
{
    pthread_mutex_lock(&s->mu);
    uint64_t target = s->queued_seq;
    pthread_cond_signal(&s->wake);
    while (s->done_seq < target && !s->st.disabled)
        pthread_cond_wait(&s->done, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

ks_status store_clear(struct store *s, uint64_t *n_deleted)
{
    store_flush(s);
    pthread_mutex_lock(&s->mu);
    if (s->st.disabled) {
        pthread_mutex_unlock(&s->mu);
        return ks_fail(KS_ERR_STATE, "the prefix cache on disk is disabled");
    }
    s->clear_all = true;
    pthread_cond_signal(&s->wake);
    while (s->clear_all && !s->st.disabled)
        pthread_cond_wait(&s->done, &s->mu);
    if (n_deleted)
        *n_deleted = s->cleared;
    pthread_mutex_unlock(&s->mu);
    return KS_OK;
}

/* ---- reading ----------------------------------------------------------------------- */

bool store_has(struct store *s, struct store_key key, size_t *bytes_out)
{
    pthread_mutex_lock(&s->mu);
    int32_t at = s->st.disabled ? -1 : store_index_find(&s->ix, key);
    if (at >= 0 && bytes_out)
        *bytes_out = (size_t)s->ix.e[at].meta.bytes;
    pthread_mutex_unlock(&s->mu);
    return at >= 0;
}

static bool entry_valid(const struct store *s, struct store_key key, const MDB_val *v)
{
    struct store_header h;
    if (v->mv_size < sizeof h)
        return false;
    memcpy(&h, v->mv_data, sizeof h);
    return h.magic == STORE_MAGIC && h.version == STORE_VERSION && h.key.lo == key.lo && h.key.hi == key.hi &&
           !memcmp(h.fingerprint, s->cfg.fingerprint, sizeof h.fingerprint) &&
           h.payload_len == v->mv_size - sizeof h && checksum(&h, (const uint8_t *)v->mv_data + sizeof h) == h.checksum;
}

/* A bad entry leaves the index now and the disk at the writer's next batch. */
static void doom(struct store *s, struct store_key key)
{
    s->st.corrupt++;
    store_index_remove(&s->ix, key);
    if (s->n_doomed == s->cap_doomed) {
        uint32_t cap = s->cap_doomed ? s->cap_doomed * 2 : 16;
        struct store_key *d = realloc(s->doomed, (size_t)cap * sizeof *d);
        if (!d)
            return; /* it stays on disk until the next open's check or a clear */
        s->doomed = d;
        s->cap_doomed = cap;
    }
    s->doomed[s->n_doomed++] = key;
    pthread_cond_signal(&s->wake);
}

static void note_read(struct store *s, struct store_key key, size_t len, double seconds)
{
    int32_t at = store_index_find(&s->ix, key);
    if (at >= 0) {
        s->ix.e[at].meta.last_use = store_now_ms();
        s->ix.e[at].meta.hits++;
        s->n_dirty += !s->ix.e[at].dirty;
        s->ix.e[at].dirty = true;
    }
    s->st.hits++;
    s->st.reads++;
    s->st.read_bytes += len;
    double bps = (double)len / (seconds > 1e-7 ? seconds : 1e-7);
    s->read_bps = s->read_bps > 0 ? 0.75 * s->read_bps + 0.25 * bps : bps;
    s->st.read_gbs = s->read_bps / 1e9;
}

ks_status store_get(struct store *s, struct store_key key, void **blob_out, size_t *len_out)
{
    *blob_out = NULL;
    *len_out = 0;
    if (!store_has(s, key, NULL)) {
        pthread_mutex_lock(&s->mu);
        s->st.misses++;
        pthread_mutex_unlock(&s->mu);
        return ks_fail(KS_ERR_NOT_FOUND, "page not on disk");
    }
    double t0 = mono_s();
    MDB_txn *txn = NULL;
    MDB_val k = key_val(&key), v;
    bool valid = false;
    void *blob = NULL;
    size_t len = 0;
    int rc = mdb_txn_begin(s->env, NULL, MDB_RDONLY, &txn);
    if (!rc) {
        rc = mdb_get(txn, s->entries, &k, &v);
        valid = !rc && entry_valid(s, key, &v);
        len = valid ? v.mv_size - sizeof(struct store_header) : 0;
        if (valid && (blob = malloc(len ? len : 1)))
            memcpy(blob, (const uint8_t *)v.mv_data + sizeof(struct store_header), len);
        mdb_txn_abort(txn);
    }
    double dt = mono_s() - t0;
    pthread_mutex_lock(&s->mu);
    if (blob)
        note_read(s, key, len, dt);
    else {
        s->st.misses++;
        if (rc == 0 || rc == MDB_NOTFOUND)
            doom(s, key); /* corrupt, truncated, foreign, or gone from disk */
    }
    pthread_mutex_unlock(&s->mu);
    if (!blob)
        return valid ? ks_fail(KS_ERR_NOMEM, "prefix cache on disk: out of memory for a page")
                     : ks_fail(KS_ERR_NOT_FOUND, "page on disk failed its checks");
    *blob_out = blob;
    *len_out = len;
    return KS_OK;
}

double store_read_seconds(struct store *s, size_t len)
{
    pthread_mutex_lock(&s->mu);
    double bps = s->read_bps > 0 ? s->read_bps : FIRST_READ_BPS;
    pthread_mutex_unlock(&s->mu);
    return (double)len / bps;
}

void store_foreach(struct store *s, void (*fn)(void *user, const struct store_entry_info *e), void *user)
{
    pthread_mutex_lock(&s->mu);
    for (uint32_t i = 0; i < s->ix.n; i++) {
        const struct store_entry *e = &s->ix.e[i];
        struct store_entry_info info = {e->key, e->meta.parent, e->meta.n_tokens, e->meta.bytes, e->meta.last_use,
                                        e->meta.hits};
        fn(user, &info);
    }
    pthread_mutex_unlock(&s->mu);
}

void store_stats(struct store *s, struct store_stats *out)
{
    pthread_mutex_lock(&s->mu);
    *out = s->st;
    out->entries = s->ix.n;
    out->bytes = s->ix.bytes;
    out->limit = s->limit;
    pthread_mutex_unlock(&s->mu);
}
