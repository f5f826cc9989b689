/* Opening the store, rebuilding its index, and the calls that any thread
 * makes: put (queue), get (read and verify), flush, clear, stats. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

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

/* One keyed hash over the header (checksum field zeroed) and the payload.
 * The state lives on the stack: a failed allocation must never make a good
 * entry look corrupt. Keyed with the directory's secret, an entry planted by
 * someone who cannot read the secret file fails (XXH3 is no cryptographic
 * MAC, but without the secret its output cannot be predicted). */
static uint64_t checksum(const struct store *s, const struct store_header *h, const void *payload)
{
    struct store_header z = *h;
    z.checksum = 0;
    XXH3_state_t st;
    XXH3_64bits_reset_withSecret(&st, s->secret, sizeof s->secret);
    XXH3_64bits_update(&st, &z, sizeof z);
    XXH3_64bits_update(&st, payload, (size_t)h->payload_len);
    return XXH3_64bits_digest(&st);
}

struct store_key store_keyed_digest(const struct store *s, const void *data, size_t n)
{
    XXH128_hash_t h = XXH3_128bits_withSecret(data, n, s->secret, sizeof s->secret);
    return (struct store_key){h.low64, h.high64};
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

/* LMDB's codes for a file that is not what it should be. */
static bool lmdb_damage(int rc)
{
    return rc == MDB_INVALID || rc == MDB_CORRUPTED || rc == MDB_PAGE_NOTFOUND || rc == MDB_VERSION_MISMATCH ||
           rc == MDB_INCOMPATIBLE || rc == MDB_BAD_VALSIZE || rc == MDB_BAD_TXN || rc == MDB_CURSOR_FULL ||
           rc == MDB_PAGE_FULL;
}

static ks_status lmdb_fail(struct store *s, const char *what, int rc)
{
    if (lmdb_damage(rc))
        return store_damaged(s, "%s: %s", what, mdb_strerror(rc));
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

/* LMDB has mapped data.mdb: a file shorter than checked (truncated by
 * someone meanwhile) would fault on the first page past its end. */
static ks_status check_size_again(struct store *s, uint64_t recorded)
{
    int fd = -1;
    struct stat sb;
    if (recorded == 0 || mdb_env_get_fd(s->env, &fd) != 0 || fstat(fd, &sb) != 0)
        return KS_OK;
    if ((uint64_t)sb.st_size < recorded)
        return store_damaged(s, "data.mdb shrank to %llu bytes while it was being opened (LMDB recorded %llu)",
                             (unsigned long long)sb.st_size, (unsigned long long)recorded);
    return KS_OK;
}

static ks_status open_env(struct store *s, uint64_t recorded)
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
    ks_status st = check_size_again(s, recorded);
    if (st)
        return st;
    MDB_envinfo info;
    MDB_stat ms;
    int fd = -1;
    struct stat sb;
    if (!mdb_env_info(s->env, &info) && !mdb_env_stat(s->env, &ms) && !mdb_env_get_fd(s->env, &fd) &&
        !fstat(fd, &sb)) {
        s->map_base = info.me_mapaddr;
        s->psize = ms.ms_psize;
        s->file_bytes = (uint64_t)sb.st_size;
    }
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

static bool header_ok(const struct store_header *h, struct store_key key, size_t size)
{
    return h->magic == STORE_MAGIC && h->version == STORE_VERSION && h->key.lo == key.lo && h->key.hi == key.hi &&
           h->payload_len == size - sizeof *h;
}

/* An entry whose header is wrong (the checksum is checked when it is read). */
static bool entry_broken(const MDB_val *k, const MDB_val *v)
{
    struct store_header h;
    struct store_key key;
    if (v->mv_size < sizeof h)
        return true;
    memcpy(&h, v->mv_data, sizeof h);
    memcpy(&key, k->mv_data, sizeof key);
    return !header_ok(&h, key, v->mv_size);
}

/* Delete in db every key that other does not hold and, in the entries,
 * every entry whose header is wrong (counted as corrupt); returns an LMDB
 * code (MDB_CORRUPTED for a value whose overflow pages are not LMDB's). */
static int drop_orphans(struct store *s, MDB_txn *txn, MDB_dbi db, MDB_dbi other)
{
    MDB_cursor *c;
    int rc = mdb_cursor_open(txn, db, &c);
    if (rc)
        return rc;
    MDB_val k, v, o;
    for (rc = mdb_cursor_get(c, &k, &v, MDB_FIRST); rc == 0; rc = mdb_cursor_get(c, &k, &v, MDB_NEXT)) {
        if (!store_value_sane(s, &v)) {
            rc = MDB_CORRUPTED;
            break;
        }
        bool bad = k.mv_size != sizeof(struct store_key) || (db == s->entries && entry_broken(&k, &v));
        s->st.corrupt += bad;
        if ((bad || mdb_get(txn, other, &k, &o) != 0) && (rc = mdb_cursor_del(c, 0)))
            break;
    }
    mdb_cursor_close(c);
    return rc == MDB_NOTFOUND ? 0 : rc;
}

/* Entries of another format version (or from before the version was
 * recorded) are deleted, never misread. */
static int check_format(const struct store *s, MDB_txn *txn)
{
    static const char name[] = "format";
    MDB_val k = {sizeof name, (void *)name}, v;
    uint32_t version = 0;
    int rc = mdb_get(txn, s->clock, &k, &v);
    if (rc && rc != MDB_NOTFOUND)
        return rc;
    if (!rc && v.mv_size == sizeof version)
        memcpy(&version, v.mv_data, sizeof version);
    if (version == STORE_VERSION)
        return 0;
    if ((rc = mdb_drop(txn, s->entries, 0)) || (rc = mdb_drop(txn, s->metas, 0)))
        return rc;
    version = STORE_VERSION;
    v = (MDB_val){sizeof version, &version};
    return mdb_put(txn, s->clock, &k, &v, 0);
}

/* LMDB's free list (its database 0): records of n page numbers after n
 * (mdb_stat -ff reads them so). A page number past the file would be handed
 * out by the next write. */
static int check_free_list(const struct store *s, MDB_txn *txn)
{
    MDB_cursor *c;
    int rc = mdb_cursor_open(txn, 0, &c);
    if (rc)
        return rc;
    uint64_t n_pages = s->psize ? s->file_bytes / s->psize : UINT64_MAX;
    MDB_val k, v;
    for (rc = mdb_cursor_get(c, &k, &v, MDB_FIRST); rc == 0; rc = mdb_cursor_get(c, &k, &v, MDB_NEXT)) {
        size_t n;
        if (v.mv_size < sizeof n || v.mv_size % sizeof n || !store_value_sane(s, &v)) {
            rc = MDB_CORRUPTED;
            break;
        }
        memcpy(&n, v.mv_data, sizeof n);
        if (n != v.mv_size / sizeof n - 1) {
            rc = MDB_CORRUPTED;
            break;
        }
        for (size_t i = 1; i <= n && !rc; i++) {
            size_t pg;
            memcpy(&pg, (const uint8_t *)v.mv_data + i * sizeof pg, sizeof pg);
            rc = pg < 2 || pg >= n_pages ? MDB_CORRUPTED : 0;
        }
        if (rc)
            break;
    }
    mdb_cursor_close(c);
    return rc == MDB_NOTFOUND ? 0 : rc;
}

static ks_status load_index(struct store *s)
{
    MDB_txn *txn;
    int rc = mdb_txn_begin(s->env, NULL, MDB_RDONLY, &txn); /* LMDB shows its free list to readers only */
    if (rc)
        return lmdb_fail(s, "cannot begin a transaction", rc);
    rc = check_free_list(s, txn);
    mdb_txn_abort(txn);
    if (rc)
        return lmdb_fail(s, "cannot check its free list", rc);
    if ((rc = mdb_txn_begin(s->env, NULL, 0, &txn)))
        return lmdb_fail(s, "cannot begin a transaction", rc);
    if ((rc = check_format(s, txn))) {
        mdb_txn_abort(txn);
        return lmdb_fail(s, "cannot check its format", rc);
    }
    /* entries first: one with a bad header goes, then its metadata as an orphan */
    if ((rc = drop_orphans(s, txn, s->entries, s->metas)) || (rc = drop_orphans(s, txn, s->metas, s->entries))) {
        mdb_txn_abort(txn);
        /* the walk allocates little: running out means a corrupt size asked for much */
        if (rc == ENOMEM)
            return store_damaged(s, "LMDB ran out of memory walking its index (a corrupt size)");
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

/* Everything that reads the directory; a failure with s->damage set means
 * its files are damaged (not merely unreadable or refused). */
static ks_status open_checked(struct store *s)
{
    uint64_t recorded = 0;
    ks_status st;
    if ((st = store_check_files(s->dir)) || (st = store_check_data(s, &recorded)) || (st = store_load_secret(s)) ||
        (st = open_env(s, recorded)))
        return st;
    return load_index(s);
}

static void close_env(struct store *s)
{
    if (s->env)
        mdb_env_close(s->env);
    s->env = NULL;
    s->map_base = NULL;
    store_index_free(&s->ix);
}

enum { CHILD_OK = 0, CHILD_DAMAGED = 1, CHILD_FAILED = 2, CHILD_WAIT_S = 600 };

/* What the child's walk tells the parent. */
struct child_report {
    uint64_t corrupt;         /* entries it deleted for a bad header */
    char damage[sizeof(((struct store *)0)->damage)];
};

/* The walk twice: the first deletes what is broken and commits; the second
 * walks what that commit left, as the server's own open will. */
static void child_main(struct store *s, int fd)
{
    static const int fatal[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
    for (size_t i = 0; i < sizeof fatal / sizeof fatal[0]; i++)
        signal(fatal[i], SIG_DFL); /* an inherited handler (a sanitizer's, a test's) must not hide a crash */
    ks_status st = open_checked(s);
    close_env(s);
    if (!st) {
        st = open_checked(s);
        close_env(s);
    }
    struct child_report rep = {.corrupt = s->st.corrupt};
    snprintf(rep.damage, sizeof rep.damage, "%s", st ? s->damage : "");
    if (write(fd, &rep, sizeof rep) != (ssize_t)sizeof rep)
        _exit(CHILD_FAILED);
    _exit(!st ? CHILD_OK : s->damage[0] ? CHILD_DAMAGED : CHILD_FAILED);
}

/* Wait for the child at most CHILD_WAIT_S (a loop in a corrupt tree must not
 * hang the start); *status as waitpid's, or -1 when it was killed. */
static void wait_child(pid_t pid, int *status)
{
    for (int ms = 0; ms < CHILD_WAIT_S * 1000; ms++) {
        pid_t r = waitpid(pid, status, WNOHANG);
        if (r == pid || (r < 0 && errno != EINTR))
            return;
        nanosleep(&(struct timespec){0, 1000000}, NULL);
    }
    kill(pid, SIGKILL);
    waitpid(pid, status, 0);
    *status = -1;
}

/* LMDB 0.9 has no checksums and trusts its file: a flipped bit in a B-tree
 * page can make it read anywhere. So the walk of the file at open (format,
 * free list, orphans and broken entries deleted, index) runs first in a
 * child process, where a crash is a finding, not an outage; only a walk that
 * survived there is repeated here. A failure that is not damage (say,
 * permissions) is left to the real open to report. Returns KS_OK or a
 * damage (s->damage set). */
static ks_status check_in_child(struct store *s)
{
    int p[2];
    if (pipe(p) != 0)
        return KS_OK;
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) {
        close(p[0]);
        close(p[1]);
        return KS_OK; /* cannot isolate the check: the open below runs it unguarded */
    }
    if (pid == 0) {
        close(p[0]);
        child_main(s, p[1]);
    }
    close(p[1]);
    int status = 0;
    wait_child(pid, &status);
    struct child_report rep = {0};
    bool reported = read(p[0], &rep, sizeof rep) == (ssize_t)sizeof rep;
    close(p[0]);
    rep.damage[sizeof rep.damage - 1] = '\0';
    if (reported)
        s->st.corrupt += rep.corrupt;
    if (status == -1)
        return store_damaged(s, "walking data.mdb did not finish in %d s", CHILD_WAIT_S);
    if (WIFSIGNALED(status))
        return store_damaged(s, "LMDB crashed (signal %d) walking data.mdb", WTERMSIG(status));
    if (WIFEXITED(status) && WEXITSTATUS(status) == CHILD_DAMAGED)
        return store_damaged(s, "%s", reported && rep.damage[0] ? rep.damage : "the check found it damaged");
    return KS_OK;
}

/* A damaged directory is moved aside and the store starts empty: a crash
 * loop at every start would be worse than a cold cache. */
static ks_status open_or_recover(struct store *s)
{
    ks_status st = check_in_child(s);
    if (!st)
        st = open_checked(s);
    if (!st || !s->damage[0])
        return st;
    char why[sizeof s->damage], moved[4200];
    snprintf(why, sizeof why, "%s", s->damage);
    close_env(s);
    s->damage[0] = '\0';
    if ((st = store_move_aside(s->dir, moved, sizeof moved)))
        return st;
    fprintf(stderr, "kvserve: prefix cache on disk %s was damaged (%s): moved it to %s and started empty\n", s->dir,
            why, moved);
    if ((st = make_dir(s->dir)))
        return st;
    return open_checked(s);
}

ks_status store_open(const struct store_config *cfg, struct store **out)
{
    *out = NULL;
    if (!cfg || !cfg->dir || !*cfg->dir)
        return ks_fail(KS_ERR_INVALID_ARG, "prefix cache on disk: no directory");
    ks_status st = make_dir(cfg->dir);
    if (!st)
        st = store_check_dir(cfg->dir);
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
    if (!(st = open_or_recover(s))) {
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
    close_env(s);
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
    h.checksum = checksum(s, &h, blob);
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
    return header_ok(&h, key, v->mv_size) && !memcmp(h.fingerprint, s->cfg.fingerprint, sizeof h.fingerprint) &&
           checksum(s, &h, (const uint8_t *)v->mv_data + sizeof h) == h.checksum;
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
