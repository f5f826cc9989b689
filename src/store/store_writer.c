/* The writer thread: takes the queued pages (at most one batch), the entries
 * to delete and the changed metadata, and commits them in one LMDB
 * transaction, evicting the least recently used entries first when the limit
 * needs it. A full map or disk evicts more and retries; a tier that cannot
 * write disables itself. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "store/store_internal.h"

enum { MAX_TRIES = 4, MAX_FAILED_BATCHES = 3 };
/* After an eviction the store is filled to this share of its budget, so the
 * next batches do not evict one entry at a time. */
static const double REFILL = 0.95;

struct batch {
    struct store_item *items;
    uint32_t n_items;
    uint64_t need;            /* footprint of the items */
    struct store_key *del;    /* corrupt entries and eviction victims */
    uint32_t n_del, n_doomed, cap_del;
    struct store_entry *dirty;/* metadata to rewrite */
    uint32_t n_dirty;
    bool clear;
};

static MDB_val key_val(const struct store_key *k) { return (MDB_val){sizeof *k, (void *)k}; }

static int del_both(struct store *s, MDB_txn *txn, const struct store_key *k)
{
    MDB_val kv = key_val(k);
    int rc = mdb_del(txn, s->entries, &kv, NULL);
    if (rc && rc != MDB_NOTFOUND)
        return rc;
    rc = mdb_del(txn, s->metas, &kv, NULL);
    return rc == MDB_NOTFOUND ? 0 : rc;
}

static int put_item(struct store *s, MDB_txn *txn, const struct store_item *it)
{
    MDB_val k = key_val(&it->key), v = {it->len, it->data}, m = {sizeof it->meta, (void *)&it->meta};
    int rc = mdb_put(txn, s->entries, &k, &v, MDB_NOOVERWRITE);
    if (rc == MDB_KEYEXIST)
        return 0;
    return rc ? rc : mdb_put(txn, s->metas, &k, &m, 0);
}

static int put_meta(struct store *s, MDB_txn *txn, const struct store_entry *e)
{
    MDB_val k = key_val(&e->key), v;
    if (mdb_get(txn, s->entries, &k, &v) != 0)
        return 0; /* deleted meanwhile */
    MDB_val m = {sizeof e->meta, (void *)&e->meta};
    return mdb_put(txn, s->metas, &k, &m, 0);
}

/* One transaction: the clear, the deletions, the metadata and (with_items)
 * the new entries. */
static int write_batch(struct store *s, const struct batch *b, bool with_items)
{
    MDB_txn *txn;
    int rc = mdb_txn_begin(s->env, NULL, 0, &txn);
    if (rc)
        return rc;
    if (b->clear && !(rc = mdb_drop(txn, s->entries, 0)))
        rc = mdb_drop(txn, s->metas, 0);
    for (uint32_t i = 0; !rc && i < b->n_del; i++)
        rc = del_both(s, txn, &b->del[i]);
    for (uint32_t i = 0; !rc && i < b->n_dirty; i++)
        rc = put_meta(s, txn, &b->dirty[i]);
    for (const struct store_item *it = b->items; with_items && !rc && it; it = it->next)
        rc = put_item(s, txn, it);
    if (rc) {
        mdb_txn_abort(txn);
        return rc;
    }
    return mdb_txn_commit(txn);
}

/* ---- choosing what to evict (mu held) --------------------------------------- */

struct by_use {
    uint64_t last_use;
    uint32_t i;
};

static int cmp_use(const void *a, const void *b)
{
    uint64_t x = ((const struct by_use *)a)->last_use, y = ((const struct by_use *)b)->last_use;
    return (x > y) - (x < y);
}

static bool add_del(struct batch *b, struct store_key k)
{
    if (b->n_del == b->cap_del) {
        uint32_t cap = b->cap_del ? b->cap_del * 2 : 64;
        struct store_key *d = realloc(b->del, (size_t)cap * sizeof *d);
        if (!d)
            return false;
        b->del = d;
        b->cap_del = cap;
    }
    b->del[b->n_del++] = k;
    return true;
}

static bool is_deleted(const struct batch *b, struct store_key k)
{
    for (uint32_t i = b->n_doomed; i < b->n_del; i++)
        if (b->del[i].lo == k.lo && b->del[i].hi == k.hi)
            return true;
    return false;
}

/* Add the least recently used entries to the batch's deletions until the
 * index minus them plus the batch fits in goal bytes. */
static void choose_victims(struct store *s, struct batch *b, uint64_t goal)
{
    uint64_t freed = 0;
    for (uint32_t i = b->n_doomed; i < b->n_del; i++) {
        int32_t at = store_index_find(&s->ix, b->del[i]);
        freed += at >= 0 ? s->ix.e[at].meta.bytes : 0;
    }
    if (s->ix.bytes - freed + b->need <= goal)
        return;
    struct by_use *order = malloc(((size_t)s->ix.n + 1) * sizeof *order);
    if (!order)
        return;
    for (uint32_t i = 0; i < s->ix.n; i++)
        order[i] = (struct by_use){s->ix.e[i].meta.last_use, i};
    qsort(order, s->ix.n, sizeof *order, cmp_use);
    for (uint32_t j = 0; j < s->ix.n && s->ix.bytes - freed + b->need > goal; j++) {
        const struct store_entry *e = &s->ix.e[order[j].i];
        if (is_deleted(b, e->key) || !add_del(b, e->key))
            continue;
        freed += e->meta.bytes;
    }
    free(order);
}

/* ---- taking and finishing a batch (mu held) ----------------------------------- */

static void take_batch(struct store *s, struct batch *b)
{
    memset(b, 0, sizeof *b);
    struct store_item **tail = &b->items;
    while (s->queue && (b->n_items == 0 || b->need + s->queue->meta.bytes <= s->batch_bytes)) {
        struct store_item *it = s->queue;
        s->queue = it->next;
        s->queue_bytes -= it->len;
        it->next = NULL;
        if (it->meta.bytes > s->limit) { /* can never fit */
            s->st.dropped++;
            s->done_seq++;
            free(it->data);
            free(it);
            continue;
        }
        *tail = it;
        tail = &it->next;
        b->n_items++;
        b->need += it->meta.bytes;
    }
    if (!s->queue)
        s->queue_tail = NULL;
    for (uint32_t i = 0; i < s->n_doomed; i++)
        add_del(b, s->doomed[i]);
    b->n_doomed = b->n_del;
    s->n_doomed = 0;
    b->clear = s->clear_all;
    if (s->n_dirty && (b->dirty = malloc((size_t)s->n_dirty * sizeof *b->dirty)))
        for (uint32_t i = 0; i < s->ix.n; i++)
            if (s->ix.e[i].dirty) {
                s->ix.e[i].dirty = false;
                b->dirty[b->n_dirty++] = s->ix.e[i];
            }
    s->n_dirty = 0;
    if (!b->clear)
        choose_victims(s, b, s->ix.bytes + b->need > s->budget ? (uint64_t)(REFILL * (double)s->budget) : s->budget);
}

static void free_batch(struct batch *b)
{
    for (struct store_item *it = b->items, *next; it; it = next) {
        next = it->next;
        free(it->data);
        free(it);
    }
    free(b->del);
    free(b->dirty);
    memset(b, 0, sizeof *b);
}

/* The committed clear and deletions, in the index; the batch keeps only its items. */
static void apply_deletions(struct store *s, struct batch *b)
{
    if (b->clear) {
        s->cleared = s->ix.n;
        while (s->ix.n)
            store_index_remove(&s->ix, s->ix.e[s->ix.n - 1].key);
        s->clear_all = false;
    }
    for (uint32_t i = 0; i < b->n_del; i++)
        store_index_remove(&s->ix, b->del[i]);
    s->st.evictions += b->n_del - b->n_doomed;
    b->clear = false;
    b->n_del = b->n_doomed = b->n_dirty = 0;
}

static void apply_batch(struct store *s, struct batch *b)
{
    apply_deletions(s, b);
    for (const struct store_item *it = b->items; it; it = it->next) {
        if (store_index_find(&s->ix, it->key) >= 0)
            continue;
        if (store_index_put(&s->ix, it->key, &it->meta) == KS_OK) {
            s->st.writes++;
            s->st.write_bytes += it->len;
        }
    }
    s->consecutive_failures = 0;
}

static bool out_of_room(int rc) { return rc == MDB_MAP_FULL || rc == ENOSPC || rc == MDB_TXN_FULL; }

static int write_unlocked(struct store *s, const struct batch *b, bool with_items)
{
    pthread_mutex_unlock(&s->mu);
    int rc = write_batch(s, b, with_items);
    pthread_mutex_lock(&s->mu);
    return rc;
}

/* Move the second half of b's items into rest, which carries nothing else. */
static void split_batch(struct batch *b, struct batch *rest)
{
    memset(rest, 0, sizeof *rest);
    uint32_t keep = b->n_items / 2;
    uint64_t kept = 0;
    struct store_item **cut = &b->items;
    for (uint32_t i = 0; i < keep; i++, cut = &(*cut)->next)
        kept += (*cut)->meta.bytes;
    rest->items = *cut;
    *cut = NULL;
    rest->n_items = b->n_items - keep;
    rest->need = b->need - kept;
    b->n_items = keep;
    b->need = kept;
}

/* LMDB reuses the pages a transaction frees only from the second commit
 * after it (a reader may still hold the snapshot before). Rewriting one
 * counter is that second commit. */
static int advance_txn(struct store *s)
{
    static const char name[] = "commits";
    MDB_txn *txn;
    int rc = mdb_txn_begin(s->env, NULL, 0, &txn);
    if (rc)
        return rc;
    MDB_val k = {sizeof name, (void *)name}, v;
    uint64_t n = 0;
    if (mdb_get(txn, s->clock, &k, &v) == 0 && v.mv_size == sizeof n)
        memcpy(&n, v.mv_data, sizeof n);
    n++;
    v = (MDB_val){sizeof n, &n};
    if ((rc = mdb_put(txn, s->clock, &k, &v, 0))) {
        mdb_txn_abort(txn);
        return rc;
    }
    return mdb_txn_commit(txn);
}

/* Make room after a full map or disk: commit evictions alone (aiming at half
 * of what is stored, as the map holds less than the limit says), then the
 * commit that lets LMDB reuse their pages. */
static bool make_room(struct store *s, struct batch *b)
{
    if (s->ix.n > 0)
        choose_victims(s, b, (s->ix.bytes + b->need) / 2);
    if (write_unlocked(s, b, false) != 0)
        return false;
    apply_deletions(s, b);
    pthread_mutex_unlock(&s->mu);
    int rc = advance_txn(s);
    pthread_mutex_lock(&s->mu);
    return rc == 0;
}

/* A single page that a full map still refuses. A page bigger than half the
 * map can never be stored reliably: the tier gives up. A smaller one is
 * dropped (the map may be fragmented, or the disk full for now); only
 * MAX_FAILED_BATCHES such pages in a row disable the tier. */
static void give_up_page(struct store *s, const struct batch *b, int rc)
{
    bool hopeless = b->n_items == 1 && b->items->meta.bytes > s->map_bytes / 2;
    s->st.dropped += b->n_items;
    if (hopeless || ++s->consecutive_failures >= MAX_FAILED_BATCHES)
        store_disable(s, mdb_strerror(rc));
}

/* Write a batch. A full map or disk makes room and retries. A batch that
 * still does not fit is written in halves: the map can be smaller than a
 * batch (a small --prefix-disk), and each commit also lets LMDB reuse the
 * pages freed two commits before. */
static void commit_batch(struct store *s, struct batch *b)
{
    for (int tries = 0;; tries++) {
        int rc = write_unlocked(s, b, true);
        if (rc == 0) {
            apply_batch(s, b);
            return;
        }
        s->st.failures++;
        if (out_of_room(rc) && tries + 1 < MAX_TRIES && make_room(s, b))
            continue;
        if (out_of_room(rc) && b->n_items > 1) {
            struct batch rest;
            split_batch(b, &rest);
            commit_batch(s, b);
            if (!s->st.disabled)
                commit_batch(s, &rest);
            free_batch(&rest);
            return;
        }
        if (out_of_room(rc))
            give_up_page(s, b, rc);
        else if (++s->consecutive_failures >= MAX_FAILED_BATCHES)
            store_disable(s, mdb_strerror(rc));
        if (b->clear) {
            s->clear_all = false;
            s->cleared = 0;
        }
        return;
    }
}

void *store_writer_main(void *arg)
{
    struct store *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->stop && !s->queue && !s->n_doomed && !s->clear_all)
            pthread_cond_wait(&s->wake, &s->mu);
        bool idle = !s->queue && !s->n_doomed && !s->clear_all && !s->n_dirty;
        if (s->stop && (idle || s->st.disabled))
            break;
        if (s->st.disabled) {
            s->n_doomed = 0;
            s->clear_all = false;
            pthread_cond_broadcast(&s->done);
            continue;
        }
        struct batch b;
        take_batch(s, &b);
        uint32_t n_items = b.n_items; /* commit_batch may split the batch */
        commit_batch(s, &b);
        s->done_seq += n_items;
        free_batch(&b);
        pthread_cond_broadcast(&s->done);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}
