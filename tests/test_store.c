/* The prefix cache's SSD tier: round trips, restart warmth, LRU eviction
 * under the limit, corrupt / truncated / foreign entries, a full map, a store
 * that cannot be created, and kill -9 of a writing process at random points. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <lmdb.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "store/store.h"

static char g_dir[64];

static void fresh_dir(void)
{
    snprintf(g_dir, sizeof g_dir, "/tmp/kvserve-store-XXXXXX");
    assert_non_null(mkdtemp(g_dir));
}

static void remove_dir(void)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    assert_int_equal(system(cmd), 0);
}

static struct store_config config(uint64_t max_bytes)
{
    struct store_config c = {.dir = g_dir, .max_bytes = max_bytes};
    memcpy(c.fingerprint, "store-test-model", 16);
    return c;
}

static struct store_key key_of(uint64_t i) { return (struct store_key){i * 0x9E3779B97F4A7C15ull + 1, i}; }

/* Blob content follows from the key, so a reader can check it. */
static size_t fill_blob(uint64_t i, uint8_t *b, size_t cap)
{
    size_t n = 1000 + (size_t)(i * 7919 % 30000);
    n = n < cap ? n : cap;
    for (size_t j = 0; j < n; j++)
        b[j] = (uint8_t)(i * 31 + j * 7);
    return n;
}

static bool blob_ok(uint64_t i, const void *blob, size_t len)
{
    static uint8_t want[40000];
    size_t n = fill_blob(i, want, sizeof want);
    return n == len && !memcmp(want, blob, n);
}

static void put(struct store *s, uint64_t i)
{
    static uint8_t b[40000];
    size_t n = fill_blob(i, b, sizeof b);
    assert_int_equal(store_put(s, key_of(i), key_of(i ? i - 1 : 0), 32, b, n), KS_OK);
}

static bool get_ok(struct store *s, uint64_t i)
{
    void *blob = NULL;
    size_t len = 0;
    if (store_get(s, key_of(i), &blob, &len) != KS_OK)
        return false;
    bool ok = blob_ok(i, blob, len);
    free(blob);
    return ok;
}

static void test_round_trip(void **state)
{
    (void)state;
    fresh_dir();
    struct store_config c = config(64u << 20);
    struct store *s = NULL;
    assert_int_equal(store_open(&c, &s), KS_OK);
    for (uint64_t i = 0; i < 20; i++)
        put(s, i);
    store_flush(s);
    for (uint64_t i = 0; i < 20; i++) {
        size_t bytes = 0;
        assert_true(store_has(s, key_of(i), &bytes));
        assert_true(bytes >= 1000);
        assert_true(get_ok(s, i));
    }
    assert_false(store_has(s, key_of(99), NULL));
    void *blob = NULL;
    size_t len = 0;
    assert_int_equal(store_get(s, key_of(99), &blob, &len), KS_ERR_NOT_FOUND);
    put(s, 3); /* already stored */
    store_flush(s);
    struct store_stats st;
    store_stats(s, &st);
    assert_int_equal(st.entries, 20);
    assert_int_equal(st.writes, 20);
    assert_int_equal(st.reads, 20);
    assert_int_equal(st.hits, 20);
    assert_int_equal(st.misses, 1);
    assert_int_equal(st.deduplicated, 1);
    assert_true(st.read_gbs > 0);
    assert_true(store_read_seconds(s, 1 << 20) > 0);
    store_close(s);
    remove_dir();
}

struct collect {
    int n;
    uint64_t hits;
};

static void count_entry(void *user, const struct store_entry_info *e)
{
    struct collect *c = user;
    c->n++;
    c->hits += e->hits;
    assert_int_equal(e->n_tokens, 32);
}

static void test_restart_warmth(void **state)
{
    (void)state;
    fresh_dir();
    struct store_config c = config(64u << 20);
    struct store *s = NULL;
    assert_int_equal(store_open(&c, &s), KS_OK);
    for (uint64_t i = 0; i < 10; i++)
        put(s, i);
    store_flush(s);
    assert_true(get_ok(s, 4));
    store_close(s);
    assert_int_equal(store_open(&c, &s), KS_OK);
    struct collect col = {0, 0};
    store_foreach(s, count_entry, &col);
    assert_int_equal(col.n, 10);
    assert_int_equal(col.hits, 1); /* the read before the restart */
    for (uint64_t i = 0; i < 10; i++)
        assert_true(get_ok(s, i));
    uint64_t n = 0;
    assert_int_equal(store_clear(s, &n), KS_OK);
    assert_int_equal(n, 10);
    assert_false(store_has(s, key_of(1), NULL));
    store_close(s);
    assert_int_equal(store_open(&c, &s), KS_OK);
    struct store_stats st;
    store_stats(s, &st);
    assert_int_equal(st.entries, 0);
    store_close(s);
    remove_dir();
}

static void test_lru_eviction(void **state)
{
    (void)state;
    fresh_dir();
    /* entries take 2-9 LMDB pages: a 200 KiB limit holds about a dozen */
    struct store_config c = config(200u << 10);
    struct store *s = NULL;
    assert_int_equal(store_open(&c, &s), KS_OK);
    for (uint64_t i = 0; i < 8; i++) {
        put(s, i);
        store_flush(s);
        struct timespec ms = {0, 2000000};
        nanosleep(&ms, NULL); /* distinct last-use times */
    }
    assert_true(get_ok(s, 0)); /* 0 is now the most recently used */
    struct timespec ms = {0, 2000000};
    nanosleep(&ms, NULL);
    for (uint64_t i = 100; i < 140; i++) {
        put(s, i);
        store_flush(s);
    }
    struct store_stats st;
    store_stats(s, &st);
    assert_true(st.bytes <= c.max_bytes);
    assert_true(st.evictions > 0);
    assert_false(store_has(s, key_of(1), NULL)); /* the oldest unread went first */
    assert_true(store_has(s, key_of(139), NULL));
    store_close(s);
    remove_dir();
}

/* Damage entries behind the store's back with LMDB itself. */
static void damage(struct store_key k, int how)
{
    MDB_env *env;
    MDB_txn *txn;
    MDB_dbi db;
    assert_int_equal(mdb_env_create(&env), 0);
    assert_int_equal(mdb_env_set_maxdbs(env, 2), 0);
    assert_int_equal(mdb_env_open(env, g_dir, 0, 0600), 0);
    assert_int_equal(mdb_txn_begin(env, NULL, 0, &txn), 0);
    assert_int_equal(mdb_dbi_open(txn, "entries", 0, &db), 0);
    MDB_val kv = {sizeof k, &k}, v;
    assert_int_equal(mdb_get(txn, db, &kv, &v), 0);
    uint8_t *copy = malloc(v.mv_size);
    memcpy(copy, v.mv_data, v.mv_size);
    size_t len = v.mv_size;
    if (how == 0)
        copy[len - 10] ^= 0x40; /* a flipped payload byte */
    else if (how == 1)
        len -= 100; /* truncated */
    else
        copy[8] ^= 1; /* another model's fingerprint */
    MDB_val nv = {len, copy};
    assert_int_equal(mdb_put(txn, db, &kv, &nv, 0), 0);
    assert_int_equal(mdb_txn_commit(txn), 0);
    mdb_env_close(env);
    free(copy);
}

static void test_corrupt_and_foreign_entries(void **state)
{
    (void)state;
    fresh_dir();
    struct store_config c = config(64u << 20);
    struct store *s = NULL;
    assert_int_equal(store_open(&c, &s), KS_OK);
    for (uint64_t i = 0; i < 6; i++)
        put(s, i);
    store_close(s);
    for (int how = 0; how < 3; how++)
        damage(key_of((uint64_t)how), how);
    assert_int_equal(store_open(&c, &s), KS_OK);
    for (uint64_t i = 0; i < 3; i++) {
        void *blob = NULL;
        size_t len = 0;
        assert_int_equal(store_get(s, key_of(i), &blob, &len), KS_ERR_NOT_FOUND);
        assert_null(blob);
        assert_false(store_has(s, key_of(i), NULL));
    }
    for (uint64_t i = 3; i < 6; i++)
        assert_true(get_ok(s, i));
    struct store_stats st;
    store_stats(s, &st);
    assert_int_equal(st.corrupt, 3);
    store_close(s);
    /* deleted on disk, not only in memory */
    assert_int_equal(store_open(&c, &s), KS_OK);
    store_stats(s, &st);
    assert_int_equal(st.entries, 3);
    store_close(s);
    /* a store opened for another model finds every entry foreign */
    c.fingerprint[0] ^= 1;
    assert_int_equal(store_open(&c, &s), KS_OK);
    void *blob = NULL;
    size_t len = 0;
    assert_int_equal(store_get(s, key_of(4), &blob, &len), KS_ERR_NOT_FOUND);
    store_stats(s, &st);
    assert_int_equal(st.corrupt, 1);
    store_close(s);
    remove_dir();
}

/* Fill a 1 MiB map with ~3 MiB of pages, flushing every flush_every puts. */
static struct store *fill_small_map(uint64_t flush_every)
{
    fresh_dir();
    /* the limit says 64 MiB but the map holds 1 MiB: the writer keeps to what it can hold */
    struct store_config c = config(64u << 20);
    c.map_bytes = 1u << 20;
    struct store *s = NULL;
    assert_int_equal(store_open(&c, &s), KS_OK);
    for (uint64_t i = 0; i < 200; i++) {
        put(s, i);
        if (i % flush_every == flush_every - 1)
            store_flush(s);
    }
    store_flush(s);
    struct store_stats st;
    store_stats(s, &st);
    assert_false(st.disabled);
    /* the writer keeps what is stored to a budget that leaves the map room
     * for the batches in flight, so no commit ever finds it full */
    assert_int_equal(st.failures, 0);
    assert_int_equal(st.dropped, 0);
    assert_true(st.evictions > 0);
    assert_true(st.bytes <= c.map_bytes / 3 * 2);
    assert_true(get_ok(s, 199));
    return s;
}

static void test_full_map(void **state)
{
    (void)state;
    struct store *s = fill_small_map(10);
    /* a page larger than the whole map can never be written: the tier gives up */
    size_t big = 2u << 20;
    uint8_t *b = calloc(1, big);
    assert_int_equal(store_put(s, key_of(1000), key_of(0), 32, b, big), KS_OK);
    store_flush(s);
    free(b);
    struct store_stats st;
    store_stats(s, &st);
    assert_true(st.disabled);
    assert_int_equal(store_put(s, key_of(1001), key_of(0), 32, "x", 1), KS_ERR_STATE);
    assert_false(store_has(s, key_of(199), NULL));
    void *blob = NULL;
    size_t len = 0;
    assert_int_equal(store_get(s, key_of(199), &blob, &len), KS_ERR_NOT_FOUND);
    store_close(s);
    remove_dir();
}

/* One batch of pages (~3 MiB queued before the writer catches up, at most)
 * larger than the map is written in parts, not refused; so are batches of
 * every size between. (With the map filled to the last page, an eviction
 * could not commit either: 3% of such runs disabled the tier.) */
static void test_batch_larger_than_map(void **state)
{
    (void)state;
    static const uint64_t every[] = {1, 3, 7, 40, 200};
    for (size_t i = 0; i < sizeof every / sizeof every[0]; i++) {
        struct store *s = fill_small_map(every[i]);
        store_close(s);
        remove_dir();
    }
}

static void test_bad_directory(void **state)
{
    (void)state;
    fresh_dir();
    char file[128], sub[160];
    snprintf(file, sizeof file, "%s/file", g_dir);
    FILE *f = fopen(file, "w");
    assert_non_null(f);
    fclose(f);
    snprintf(sub, sizeof sub, "%s/dir", file);
    struct store_config c = config(1u << 20);
    c.dir = sub;
    struct store *s = NULL;
    assert_int_equal(store_open(&c, &s), KS_ERR_IO);
    assert_non_null(strstr(ks_errmsg(), sub));
    c.dir = file;
    assert_int_equal(store_open(&c, &s), KS_ERR_IO);
    assert_null(s);
    remove_dir();
}

/* A child writes and reports each committed key; it is killed at a random
 * moment; every reported key must read back intact. */
/* The limit (2 GiB) is far above what 5 rounds write (about 0.3 GiB), so an
 * entry that goes missing was lost, not evicted. */
static void writer_child(int fd, uint64_t first)
{
    struct store_config c = config(2048ull << 20);
    struct store *s = NULL;
    if (store_open(&c, &s) != KS_OK)
        _exit(3);
    for (uint64_t i = first;; i += 8) {
        for (uint64_t j = i; j < i + 8; j++)
            put(s, j);
        store_flush(s);
        uint64_t done[8];
        for (int j = 0; j < 8; j++)
            done[j] = i + (uint64_t)j;
        if (write(fd, done, sizeof done) != (ssize_t)sizeof done)
            _exit(4);
    }
}

static void test_kill9_keeps_committed_entries(void **state)
{
    (void)state;
    fresh_dir();
    srand(12345);
    uint64_t *reported = malloc(sizeof(uint64_t) * 200000);
    size_t n_reported = 0;
    for (int round = 0; round < 5; round++) {
        int p[2];
        assert_int_equal(pipe(p), 0);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            close(p[0]);
            writer_child(p[1], (uint64_t)round * 1000000);
        }
        close(p[1]);
        struct timespec t = {0, (100 + rand() % 300) * 1000000L};
        nanosleep(&t, NULL);
        kill(pid, SIGKILL);
        int status;
        waitpid(pid, &status, 0);
        uint64_t k;
        while (read(p[0], &k, sizeof k) == (ssize_t)sizeof k && n_reported < 200000)
            reported[n_reported++] = k;
        close(p[0]);
        struct store_config c = config(2048ull << 20);
        struct store *s = NULL;
        assert_int_equal(store_open(&c, &s), KS_OK);
        for (size_t i = 0; i < n_reported; i++)
            if (!get_ok(s, reported[i]))
                fail_msg("round %d: committed entry %llu lost or damaged", round, (unsigned long long)reported[i]);
        struct store_stats st;
        store_stats(s, &st);
        assert_int_equal(st.corrupt, 0);
        assert_int_equal(st.evictions, 0); /* the limit holds every entry: none may go missing */
        assert_true(st.entries >= n_reported);
        store_close(s);
    }
    print_message("kill -9: %zu committed entries checked over 5 rounds\n", n_reported);
    assert_true(n_reported > 0);
    free(reported);
    remove_dir();
}

/* ---- a damaged cache directory -------------------------------------------------- */

/* The cache lives one level down, so the copy moved aside is under g_dir too. */
static char g_cache[96];

static struct store_config cache_config(void)
{
    snprintf(g_cache, sizeof g_cache, "%s/cache", g_dir);
    struct store_config c = config(64u << 20);
    c.dir = g_cache;
    return c;
}

static uint8_t *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc((size_t)n + 1);
    assert_int_equal(fread(b, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    *len = (size_t)n;
    return b;
}

static void write_file(const char *path, const void *b, size_t len, mode_t mode)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, mode);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, b, len), (ssize_t)len);
    close(fd);
}

static bool moved_aside(void)
{
    char pattern[128];
    snprintf(pattern, sizeof pattern, "%s.damaged-*", g_cache);
    glob_t g;
    bool found = glob(pattern, 0, NULL, &g) == 0 && g.gl_pathc > 0;
    globfree(&g);
    return found;
}

enum outcome { INTACT, SOME_REJECTED, MOVED_ASIDE, WRONG_DATA, OPEN_FAILED, N_OUTCOMES };
enum { N_DAMAGE_ENTRIES = 40 };

/* In a child, so that a crash is seen instead of suffered: open the damaged
 * directory and read every entry back. */
static void open_damaged_child(void)
{
    struct store_config c = cache_config();
    struct store *s = NULL;
    if (store_open(&c, &s) != KS_OK) {
        printf("store_open: %s\n", ks_errmsg()); /* stdout: the child's stderr is silenced */
        fflush(stdout);
        _exit(OPEN_FAILED);
    }
    struct store_stats st;
    store_stats(s, &st);
    if (moved_aside())
        _exit(st.entries == 0 ? MOVED_ASIDE : WRONG_DATA);
    int rejected = 0;
    for (uint64_t i = 0; i < N_DAMAGE_ENTRIES; i++) {
        void *blob = NULL;
        size_t len = 0;
        if (store_get(s, key_of(i), &blob, &len) != KS_OK) {
            rejected++;
            continue;
        }
        bool ok = blob_ok(i, blob, len);
        free(blob);
        if (!ok)
            _exit(WRONG_DATA);
    }
    store_close(s);
    _exit(rejected ? SOME_REJECTED : INTACT);
}

struct pristine {
    uint8_t *data, *secret;
    size_t data_len, secret_len;
};

/* Remove dir and the files in it (a store directory has no subdirectories). */
static void remove_flat_dir(const char *dir)
{
    static const char *const names[] = {"data.mdb", "lock.mdb", "secret.key"};
    char path[256];
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        unlink(path);
    }
    assert_true(rmdir(dir) == 0 || errno == ENOENT);
}

/* Restore the directory from the pristine copy with data.mdb replaced by
 * (data, len), open it in a child and return the outcome. */
static enum outcome try_damaged(const struct pristine *p, const uint8_t *data, size_t len, const char *what)
{
    char path[160], pattern[128];
    remove_flat_dir(g_cache);
    snprintf(pattern, sizeof pattern, "%s.damaged-*", g_cache);
    glob_t g;
    if (glob(pattern, 0, NULL, &g) == 0)
        for (size_t i = 0; i < g.gl_pathc; i++)
            remove_flat_dir(g.gl_pathv[i]);
    globfree(&g);
    assert_int_equal(mkdir(g_cache, 0700), 0);
    snprintf(path, sizeof path, "%s/data.mdb", g_cache);
    write_file(path, data, len, 0600);
    snprintf(path, sizeof path, "%s/secret.key", g_cache);
    write_file(path, p->secret, p->secret_len, 0600);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int devnull = open("/dev/null", O_WRONLY); /* the "moved it to" lines */
        dup2(devnull, 2);
        static const int fatal[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
        for (size_t i = 0; i < sizeof fatal / sizeof fatal[0]; i++)
            signal(fatal[i], SIG_DFL); /* cmocka's handlers would turn a crash into an exit code */
        open_damaged_child();
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    if (WIFSIGNALED(status))
        fail_msg("%s: opening the damaged store crashed with signal %d", what, WTERMSIG(status));
    int code = WEXITSTATUS(status);
    if (code == WRONG_DATA)
        fail_msg("%s: the damaged store returned a wrong page", what);
    if (code >= N_OUTCOMES) /* a sanitizer's exit code (66: TSan's), its report on the silenced stderr */
        fail_msg("%s: the child opening the damaged store exited with %d", what, code);
    if (code == OPEN_FAILED)
        fail_msg("%s: the damaged store neither opened nor was moved aside", what);
    return (enum outcome)code;
}

/* Is page i of the file a branch or leaf page of the B-trees (LMDB's page
 * header: pgno u64, pad u16, flags u16; P_BRANCH 1, P_LEAF 2)? */
static bool tree_page(const uint8_t *data, size_t len, size_t i)
{
    if ((i + 1) * 4096 > len || i < 2)
        return false;
    uint64_t pgno;
    uint16_t flags;
    memcpy(&pgno, data + i * 4096, sizeof pgno);
    memcpy(&flags, data + i * 4096 + 10, sizeof flags);
    return pgno == i && (flags & 0x3) != 0;
}

/* data.mdb truncated at many points and flipped at random bits (anywhere,
 * in the meta pages, and in the B-tree pages): opening never crashes; the
 * store either opens and every entry reads back intact or is rejected by
 * its checksum, or the directory is moved aside and the store starts empty. */
static void test_damaged_data_file(void **state)
{
    (void)state;
    fresh_dir();
    struct store_config c = cache_config();
    struct store *s = NULL;
    assert_int_equal(store_open(&c, &s), KS_OK);
    for (uint64_t i = 0; i < N_DAMAGE_ENTRIES; i++)
        put(s, i);
    store_flush(s);
    store_close(s);
    struct pristine p;
    char path[160];
    snprintf(path, sizeof path, "%s/data.mdb", g_cache);
    p.data = read_file(path, &p.data_len);
    snprintf(path, sizeof path, "%s/secret.key", g_cache);
    p.secret = read_file(path, &p.secret_len);
    assert_int_equal(p.secret_len, 32);
    size_t n_pages = p.data_len / 4096, tree[4096], n_tree = 0;
    for (size_t i = 0; i < n_pages && n_tree < 4096; i++)
        if (tree_page(p.data, p.data_len, i))
            tree[n_tree++] = i;
    assert_true(n_tree > 0);

    int counts[N_OUTCOMES] = {0};
    char what[96];
    assert_int_equal(try_damaged(&p, p.data, p.data_len, "undamaged"), INTACT);
    uint8_t *copy = malloc(p.data_len);
    size_t cuts[] = {0, 1, 100, 4095, 4096, 4097, 8191, 8192, 8193, 3 * 4096, p.data_len - 4096, p.data_len - 1};
    enum { N_CUTS = sizeof cuts / sizeof cuts[0], N_SPREAD = 18 };
    for (size_t i = 0; i < N_CUTS + N_SPREAD; i++) {
        size_t cut = i < N_CUTS ? cuts[i] : p.data_len * (i - N_CUTS + 1) / (N_SPREAD + 1);
        snprintf(what, sizeof what, "data.mdb truncated to %zu of %zu bytes", cut, p.data_len);
        counts[try_damaged(&p, p.data, cut, what)]++;
    }
    srand(2024);
    for (int seed = 0; seed < 120; seed++) {
        memcpy(copy, p.data, p.data_len);
        int n_flips = 1 + rand() % 4;
        const char *where = seed % 3 == 0 ? "anywhere" : seed % 3 == 1 ? "in the meta pages" : "in the B-tree pages";
        for (int f = 0; f < n_flips; f++) {
            size_t at = seed % 3 == 0   ? (size_t)rand() % p.data_len
                        : seed % 3 == 1 ? (size_t)rand() % 8192
                                        : tree[(size_t)rand() % n_tree] * 4096 + (size_t)rand() % 4096;
            copy[at] ^= (uint8_t)(1u << (rand() % 8));
        }
        snprintf(what, sizeof what, "seed %d: %d bits flipped %s", seed, n_flips, where);
        counts[try_damaged(&p, copy, p.data_len, what)]++;
    }
    print_message("damaged data.mdb: %d opened intact, %d opened with entries rejected, %d moved aside\n",
                  counts[INTACT], counts[SOME_REJECTED], counts[MOVED_ASIDE]);
    assert_true(counts[MOVED_ASIDE] > 0);
    free(copy);
    free(p.data);
    free(p.secret);
    remove_dir();
}

/* A directory others can write, links where LMDB opens its files or the
 * secret, and (as root) a directory of another user are refused with the
 * fix in the message; a linked-to file is never written. */
static void test_unsafe_directory(void **state)
{
    (void)state;
    fresh_dir();
    struct store_config c = cache_config();
    struct store *s = NULL;
    assert_int_equal(mkdir(g_cache, 0700), 0);
    assert_int_equal(chmod(g_cache, 0777), 0);
    assert_int_equal(store_open(&c, &s), KS_ERR_IO);
    assert_non_null(strstr(ks_errmsg(), g_cache));
    assert_non_null(strstr(ks_errmsg(), "chmod go-w"));
    assert_int_equal(chmod(g_cache, 0700), 0);
    if (geteuid() == 0) {
        assert_int_equal(chown(g_cache, 12345, 12345), 0);
        assert_int_equal(store_open(&c, &s), KS_ERR_IO);
        assert_non_null(strstr(ks_errmsg(), "chown"));
        assert_int_equal(chown(g_cache, 0, 0), 0);
    }

    char victim[160], link[160];
    snprintf(victim, sizeof victim, "%s/victim", g_dir);
    write_file(victim, "precious", 8, 0600);
    static const char *const names[] = {"lock.mdb", "data.mdb", "secret.key"};
    for (size_t i = 0; i < 3; i++) {
        snprintf(link, sizeof link, "%s/%s", g_cache, names[i]);
        assert_int_equal(symlink(victim, link), 0);
        assert_int_equal(store_open(&c, &s), KS_ERR_IO);
        assert_null(s);
        assert_non_null(strstr(ks_errmsg(), "symbolic link"));
        assert_non_null(strstr(ks_errmsg(), link));
        assert_int_equal(unlink(link), 0);
    }
    size_t len = 0;
    uint8_t *b = read_file(victim, &len);
    assert_int_equal(len, 8);
    assert_memory_equal(b, "precious", 8);
    free(b);
    /* a secret others can read is refused too */
    snprintf(link, sizeof link, "%s/secret.key", g_cache);
    write_file(link, "0123456789abcdef0123456789abcdef", 32, 0644);
    assert_int_equal(chmod(link, 0644), 0);
    assert_int_equal(store_open(&c, &s), KS_ERR_IO);
    assert_non_null(strstr(ks_errmsg(), link));
    assert_int_equal(unlink(link), 0);
    assert_int_equal(store_open(&c, &s), KS_OK);
    store_close(s);
    struct stat sb;
    assert_int_equal(stat(link, &sb), 0);
    assert_int_equal(sb.st_mode & 0777, 0600);
    remove_dir();
}

/* Entries written under another directory's secret (pages planted by
 * someone who cannot read this one) fail their checksum; entries of the
 * previous format version are dropped at open, not misread. */
static void test_planted_and_old_entries(void **state)
{
    (void)state;
    fresh_dir();
    struct store_config c = cache_config();
    struct store *s = NULL;
    assert_int_equal(store_open(&c, &s), KS_OK);
    for (uint64_t i = 0; i < 8; i++)
        put(s, i);
    store_close(s);
    char path[160];
    snprintf(path, sizeof path, "%s/secret.key", g_cache);
    write_file(path, "another directory's secret 32 b.", 32, 0600);
    assert_int_equal(store_open(&c, &s), KS_OK);
    for (uint64_t i = 0; i < 8; i++) {
        void *blob = NULL;
        size_t len = 0;
        assert_int_equal(store_get(s, key_of(i), &blob, &len), KS_ERR_NOT_FOUND);
    }
    struct store_stats st;
    store_stats(s, &st);
    assert_int_equal(st.corrupt, 8);
    for (uint64_t i = 10; i < 14; i++)
        put(s, i);
    store_close(s);

    /* mark the directory as written by format version 1 */
    MDB_env *env;
    MDB_txn *txn;
    MDB_dbi db;
    assert_int_equal(mdb_env_create(&env), 0);
    assert_int_equal(mdb_env_set_maxdbs(env, 3), 0);
    assert_int_equal(mdb_env_open(env, g_cache, 0, 0600), 0);
    assert_int_equal(mdb_txn_begin(env, NULL, 0, &txn), 0);
    assert_int_equal(mdb_dbi_open(txn, "clock", 0, &db), 0);
    static const char name[] = "format";
    uint32_t v1 = 1;
    MDB_val k = {sizeof name, (void *)name}, v = {sizeof v1, &v1};
    assert_int_equal(mdb_put(txn, db, &k, &v, 0), 0);
    assert_int_equal(mdb_txn_commit(txn), 0);
    mdb_env_close(env);
    assert_int_equal(store_open(&c, &s), KS_OK);
    store_stats(s, &st);
    assert_int_equal(st.entries, 0);
    assert_int_equal(st.corrupt, 0);
    put(s, 20);
    store_flush(s);
    assert_true(get_ok(s, 20));
    store_close(s);
    remove_dir();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_restart_warmth),
        cmocka_unit_test(test_lru_eviction),
        cmocka_unit_test(test_corrupt_and_foreign_entries),
        cmocka_unit_test(test_full_map),
        cmocka_unit_test(test_batch_larger_than_map),
        cmocka_unit_test(test_bad_directory),
        cmocka_unit_test(test_kill9_keeps_committed_entries),
        cmocka_unit_test(test_damaged_data_file),
        cmocka_unit_test(test_unsafe_directory),
        cmocka_unit_test(test_planted_and_old_entries),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
