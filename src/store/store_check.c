/* What the store checks before LMDB maps anything: the directory is ours and
 * not writable by others, data.mdb and lock.mdb are plain files (LMDB opens
 * them itself, following links), data.mdb holds the pages its meta pages
 * record, and the per-directory secret that keys the entries' checksums.
 * A damaged directory is moved aside so the server starts empty instead of
 * crashing in LMDB.
 *
 * The LMDB facts used here (liblmdb 0.9, mdb.c: MDB_page, MDB_meta, MDB_db,
 * mdb_env_read_header): pages 0 and 1 are meta pages; a page starts with a
 * 16-byte header (pgno u64, pad u16, flags u16, lower/upper u16 x2) and
 * P_META = 0x08; the meta follows it: magic u32 (0xBEEFC0DE), version u32
 * (1), address (8), mapsize (8), two MDB_db of 48 bytes (the first one's
 * leading u32 is the page size), last used page (8), txnid (8). The meta
 * with the larger txnid is the current one. A value too big for its leaf
 * lives on overflow pages: it starts right after the header of the first
 * one (P_OVERFLOW = 0x04, the u32 at offset 12 counts the pages, OVPAGES). */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "store/store_internal.h"

enum {
    LMDB_PAGE_HEADER = 16,
    LMDB_P_OVERFLOW = 0x04,
    LMDB_P_META = 0x08,
    LMDB_META_MAGIC = 0xBEEFC0DEu,
    LMDB_DATA_VERSION = 1,
    META_OFF_MAGIC = LMDB_PAGE_HEADER + 0,
    META_OFF_VERSION = LMDB_PAGE_HEADER + 4,
    META_OFF_PSIZE = LMDB_PAGE_HEADER + 24,
    META_OFF_LAST_PG = LMDB_PAGE_HEADER + 120,
    META_OFF_TXNID = LMDB_PAGE_HEADER + 128,
    META_BYTES = LMDB_PAGE_HEADER + 136,
    MIN_PSIZE = 512,
    MAX_PSIZE = 65536,
    /* The file may be shorter than the recorded last page when the last
     * pages were freed in the transaction that allocated them (LMDB never
     * writes those); a handful at most. More missing is a truncated file. */
    MAX_UNWRITTEN_PAGES = 256,
};

ks_status store_damaged(struct store *s, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->damage, sizeof s->damage, fmt, ap);
    va_end(ap);
    return ks_fail(KS_ERR_IO, "prefix cache on disk %s is damaged: %s", s->dir, s->damage);
}

/* ---- the directory and its files ---------------------------------------------- */

ks_status store_check_dir(const char *dir)
{
    struct stat sb;
    if (stat(dir, &sb) != 0)
        return ks_fail(KS_ERR_IO, "--cache-dir %s: %s", dir, strerror(errno));
    if (sb.st_uid != geteuid())
        return ks_fail(KS_ERR_IO,
                       "--cache-dir %s belongs to uid %u, not to this server's user (uid %u): another user could "
                       "plant or swap its files; use a directory of your own, or chown %u %s",
                       dir, (unsigned)sb.st_uid, (unsigned)geteuid(), (unsigned)geteuid(), dir);
    if (sb.st_mode & (S_IWGRP | S_IWOTH))
        return ks_fail(KS_ERR_IO,
                       "--cache-dir %s is writable by %s (mode %03o): another user could plant or swap its files; "
                       "run chmod go-w %s (or chmod 700 %s)",
                       dir, (sb.st_mode & S_IWOTH) ? "everyone" : "its group", (unsigned)(sb.st_mode & 0777), dir,
                       dir);
    return KS_OK;
}

/* LMDB opens data.mdb and lock.mdb itself, following links: refuse a link. */
ks_status store_check_files(const char *dir)
{
    static const char *const names[] = {"data.mdb", "lock.mdb"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        struct stat sb;
        if (lstat(path, &sb) != 0) {
            if (errno == ENOENT)
                continue;
            return ks_fail(KS_ERR_IO, "--cache-dir %s: cannot check %s: %s", dir, path, strerror(errno));
        }
        if (S_ISLNK(sb.st_mode))
            return ks_fail(KS_ERR_IO,
                           "%s is a symbolic link: kvserve never follows links in its cache directory (LMDB "
                           "would write through it); remove it (rm %s) and start again",
                           path, path);
        if (!S_ISREG(sb.st_mode))
            return ks_fail(KS_ERR_IO, "%s is not a regular file; remove it and start again", path);
        if (sb.st_uid != geteuid())
            return ks_fail(KS_ERR_IO, "%s belongs to uid %u, not to this server's user (uid %u); remove it and "
                           "start again", path, (unsigned)sb.st_uid, (unsigned)geteuid());
    }
    return KS_OK;
}

/* ---- data.mdb against its meta pages --------------------------------------------- */

static uint32_t get32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static uint64_t get64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

struct lmdb_meta {
    uint32_t psize;
    uint64_t last_pg, txnid;
};

/* Read and check the meta page at off; psize 0: read its own page size. */
static ks_status read_meta(struct store *s, int fd, int which, off_t off, struct lmdb_meta *m)
{
    uint8_t b[META_BYTES];
    ssize_t n = pread(fd, b, sizeof b, off);
    if (n != (ssize_t)sizeof b)
        return store_damaged(s, "data.mdb is too short to hold meta page %d", which);
    uint16_t flags;
    memcpy(&flags, b + 10, sizeof flags);
    if (!(flags & LMDB_P_META) || get32(b + META_OFF_MAGIC) != LMDB_META_MAGIC)
        return store_damaged(s, "meta page %d of data.mdb is not an LMDB meta page", which);
    if (get32(b + META_OFF_VERSION) != LMDB_DATA_VERSION)
        return store_damaged(s, "meta page %d of data.mdb has LMDB format %u, not %d", which,
                             get32(b + META_OFF_VERSION), LMDB_DATA_VERSION);
    m->psize = get32(b + META_OFF_PSIZE);
    m->last_pg = get64(b + META_OFF_LAST_PG);
    m->txnid = get64(b + META_OFF_TXNID);
    if (m->psize < MIN_PSIZE || m->psize > MAX_PSIZE || (m->psize & (m->psize - 1)))
        return store_damaged(s, "meta page %d of data.mdb records a page size of %u bytes", which, m->psize);
    if (m->last_pg < 1 || m->last_pg > (UINT64_MAX / MAX_PSIZE))
        return store_damaged(s, "meta page %d of data.mdb records last page %llu", which,
                             (unsigned long long)m->last_pg);
    return KS_OK;
}

/* data.mdb must hold every page up to the last one its current meta page
 * records: LMDB maps the whole file and a page past its end is a SIGBUS. A
 * few unwritten pages at the end are LMDB's own doing and are added as
 * zeros, which LMDB reports as a corrupt page if anything points to them.
 * *recorded_out: the size the file must keep (0: no file yet). */
ks_status store_check_data(struct store *s, uint64_t *recorded_out)
{
    *recorded_out = 0;
    char path[4096];
    snprintf(path, sizeof path, "%s/data.mdb", s->dir);
    int fd = open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT ? KS_OK : ks_fail(KS_ERR_IO, "cannot open %s: %s", path, strerror(errno));
    struct stat sb;
    ks_status st = KS_OK;
    if (fstat(fd, &sb) != 0)
        st = ks_fail(KS_ERR_IO, "cannot stat %s: %s", path, strerror(errno));
    struct lmdb_meta m0, m1;
    if (!st && sb.st_size == 0) { /* created, never committed: LMDB starts it afresh */
        close(fd);
        return KS_OK;
    }
    if (!st && !(st = read_meta(s, fd, 0, 0, &m0)) && !(st = read_meta(s, fd, 1, m0.psize, &m1)) &&
        m0.psize != m1.psize)
        st = store_damaged(s, "the meta pages of data.mdb record page sizes %u and %u", m0.psize, m1.psize);
    if (!st) {
        const struct lmdb_meta *m = m1.txnid > m0.txnid ? &m1 : &m0;
        uint64_t size = (uint64_t)sb.st_size, recorded = (m->last_pg + 1) * m->psize;
        if (recorded > size + (uint64_t)MAX_UNWRITTEN_PAGES * m->psize)
            st = store_damaged(s, "data.mdb has %llu bytes but LMDB recorded %llu (truncated)",
                               (unsigned long long)size, (unsigned long long)recorded);
        else if (recorded > size && ftruncate(fd, (off_t)recorded) != 0)
            st = ks_fail(KS_ERR_IO, "cannot extend %s to its recorded %llu bytes: %s", path,
                         (unsigned long long)recorded, strerror(errno));
        else
            *recorded_out = recorded;
    }
    close(fd);
    return st;
}

bool store_value_sane(const struct store *s, const MDB_val *v)
{
    uintptr_t base = (uintptr_t)s->map_base, at = (uintptr_t)v->mv_data;
    if (!s->map_base || !s->psize || at < base || (at - base) % s->psize != LMDB_PAGE_HEADER)
        return true; /* inline in its leaf page (a leaf's nodes never start right after the header) */
    uint64_t page = (at - base) / s->psize;
    const uint8_t *h = s->map_base + page * s->psize;
    uint64_t pages = ((uint64_t)LMDB_PAGE_HEADER + v->mv_size + s->psize - 1) / s->psize;
    uint16_t flags;
    uint32_t n;
    memcpy(&flags, h + 10, sizeof flags);
    memcpy(&n, h + 12, sizeof n);
    return get64(h) == page && (flags & LMDB_P_OVERFLOW) && n == pages && (page + pages) * s->psize <= s->file_bytes;
}

/* ---- the checksum secret ---------------------------------------------------------- */

static ks_status read_secret(struct store *s, int fd, const char *path, uint8_t key[STORE_SECRET_BYTES])
{
    struct stat sb;
    if (fstat(fd, &sb) != 0)
        return ks_fail(KS_ERR_IO, "cannot stat %s: %s", path, strerror(errno));
    if (!S_ISREG(sb.st_mode) || sb.st_uid != geteuid() || (sb.st_mode & 077))
        return ks_fail(KS_ERR_IO, "%s must be a file of this server's user that nobody else can read (it keys the "
                       "checksums of the pages on disk); remove it (rm %s) and start again", path, path);
    if (sb.st_size != STORE_SECRET_BYTES || pread(fd, key, STORE_SECRET_BYTES, 0) != STORE_SECRET_BYTES)
        return store_damaged(s, "%s does not hold a %d-byte secret", path, STORE_SECRET_BYTES);
    return KS_OK;
}

static ks_status create_secret(const char *path, uint8_t key[STORE_SECRET_BYTES], bool *raced)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
        *raced = errno == EEXIST;
        return *raced ? KS_OK : ks_fail(KS_ERR_IO, "cannot create %s: %s", path, strerror(errno));
    }
    ks_status st = KS_OK;
    if (getrandom(key, STORE_SECRET_BYTES, 0) != STORE_SECRET_BYTES)
        st = ks_fail(KS_ERR_IO, "cannot draw a random secret for %s: %s", path, strerror(errno));
    else if (write(fd, key, STORE_SECRET_BYTES) != STORE_SECRET_BYTES || fsync(fd) != 0)
        st = ks_fail(KS_ERR_IO, "cannot write %s: %s", path, strerror(errno));
    close(fd);
    if (st)
        unlink(path);
    return st;
}

/* The directory's secret (made on first use) expanded to XXH3's secret
 * size: an entry written under another directory's secret, or planted by
 * someone who cannot read this one, fails its checksum. */
ks_status store_load_secret(struct store *s)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", s->dir, STORE_SECRET_FILE);
    uint8_t key[STORE_SECRET_BYTES];
    ks_status st = KS_OK;
    for (int attempt = 0; attempt < 2; attempt++) {
        int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
        if (fd >= 0) {
            st = read_secret(s, fd, path, key);
            close(fd);
            break;
        }
        if (errno == ELOOP)
            return ks_fail(KS_ERR_IO, "%s is a symbolic link: kvserve never follows links in its cache directory; "
                           "remove it (rm %s) and start again", path, path);
        if (errno != ENOENT)
            return ks_fail(KS_ERR_IO, "cannot open %s: %s", path, strerror(errno));
        bool raced = false;
        if ((st = create_secret(path, key, &raced)) || !raced)
            break;
    }
    if (!st && XXH3_generateSecret(s->secret, sizeof s->secret, key, sizeof key) != XXH_OK)
        st = ks_fail(KS_ERR_IO, "prefix cache on disk %s: cannot derive the checksum secret", s->dir);
    memset(key, 0, sizeof key);
    return st;
}

/* ---- moving a damaged directory aside --------------------------------------------- */

ks_status store_move_aside(const char *dir, char *moved_to, size_t cap)
{
    char base[4096];
    snprintf(base, sizeof base, "%s", dir);
    for (size_t n = strlen(base); n > 1 && base[n - 1] == '/'; n--)
        base[n - 1] = '\0';
    time_t now = time(NULL);
    struct tm tm;
    char stamp[32];
    strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", gmtime_r(&now, &tm));
    for (int i = 0; i < 100; i++) {
        if (i == 0)
            snprintf(moved_to, cap, "%s.damaged-%s", base, stamp);
        else
            snprintf(moved_to, cap, "%s.damaged-%s-%d", base, stamp, i);
        struct stat sb;
        if (lstat(moved_to, &sb) == 0)
            continue;
        if (rename(base, moved_to) == 0)
            return KS_OK;
        return ks_fail(KS_ERR_IO, "prefix cache on disk %s is damaged and cannot be moved aside to %s (%s); remove it "
                       "(rm -r %s) and start again", dir, moved_to, strerror(errno), dir);
    }
    return ks_fail(KS_ERR_IO, "prefix cache on disk %s is damaged and too many damaged copies sit beside it; remove "
                   "them and it (rm -r %s %s.damaged-*) and start again", dir, dir, base);
}
