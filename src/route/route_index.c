/* The router's index: chain key -> a bit per replica holding it, from the
 * replicas' KV events. One open-addressing table under a read-write lock (the
 * events thread writes, request threads read). */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "route/route.h"

enum { MIN_CAP = 1024, KEY_BYTES = 16 };

struct slot {
    struct kv_key key;
    uint64_t held;            /* bit r: replica r holds it; 0: an empty slot */
};

struct replica_state {
    struct route_replica_info info;
    struct kv_key_layout layout;
};

struct route_index {
    pthread_rwlock_t lock;
    struct slot *slots;
    uint32_t cap, n;
    int n_replicas;
    struct replica_state rep[ROUTE_MAX_REPLICAS];
};

ks_status route_index_create(int n_replicas, struct route_index **out)
{
    *out = NULL;
    if (n_replicas < 1 || n_replicas > ROUTE_MAX_REPLICAS)
        return ks_fail(KS_ERR_INVALID_ARG, "route: %d replicas; give 1 to %d", n_replicas, ROUTE_MAX_REPLICAS);
    struct route_index *ix = calloc(1, sizeof *ix);
    if (!ix || !(ix->slots = calloc(MIN_CAP, sizeof *ix->slots))) {
        free(ix);
        return ks_fail(KS_ERR_NOMEM, "route: out of memory for the index");
    }
    ix->cap = MIN_CAP;
    ix->n_replicas = n_replicas;
    pthread_rwlock_init(&ix->lock, NULL);
    *out = ix;
    return KS_OK;
}

void route_index_free(struct route_index *ix)
{
    if (!ix)
        return;
    pthread_rwlock_destroy(&ix->lock);
    free(ix->slots);
    free(ix);
}

static uint32_t find_slot(const struct slot *slots, uint32_t cap, struct kv_key k)
{
    uint32_t i = (uint32_t)k.lo & (cap - 1);
    while (slots[i].held && !kv_key_equal(slots[i].key, k))
        i = (i + 1) & (cap - 1);
    return i;
}

/* Copy the entries whose bits survive keep into a table of cap slots. */
static bool rebuild(struct route_index *ix, uint32_t cap, uint64_t keep)
{
    struct slot *slots = calloc(cap, sizeof *slots);
    if (!slots)
        return false;
    uint32_t n = 0;
    for (uint32_t i = 0; i < ix->cap; i++) {
        uint64_t held = ix->slots[i].held & keep;
        if (held) {
            slots[find_slot(slots, cap, ix->slots[i].key)] = (struct slot){ix->slots[i].key, held};
            n++;
        }
    }
    free(ix->slots);
    ix->slots = slots;
    ix->cap = cap;
    ix->n = n;
    return true;
}

static struct kv_key key_at(const uint8_t *p)
{
    struct kv_key k = {0, 0};
    for (int b = 7; b >= 0; b--) {
        k.lo = k.lo << 8 | p[b];
        k.hi = k.hi << 8 | p[8 + b];
    }
    return k;
}

static bool add_key(struct route_index *ix, int r, struct kv_key k)
{
    if ((uint64_t)(ix->n + 1) * 2 >= ix->cap && !rebuild(ix, ix->cap * 2, ~0ull))
        return false;
    uint32_t i = find_slot(ix->slots, ix->cap, k);
    if (!ix->slots[i].held) {
        ix->slots[i].key = k;
        ix->n++;
    }
    ix->rep[r].info.keys += !(ix->slots[i].held & (1ull << r));
    ix->slots[i].held |= 1ull << r;
    return true;
}

/* Backward-shift deletion once no replica holds the key. */
static void del_key(struct route_index *ix, int r, struct kv_key k)
{
    uint32_t mask = ix->cap - 1, i = find_slot(ix->slots, ix->cap, k);
    if (!(ix->slots[i].held & (1ull << r)))
        return;
    ix->rep[r].info.keys--;
    ix->slots[i].held &= ~(1ull << r);
    if (ix->slots[i].held)
        return;
    for (uint32_t j = (i + 1) & mask; ix->slots[j].held; j = (j + 1) & mask) {
        uint32_t home = (uint32_t)ix->slots[j].key.lo & mask;
        if (((j - home) & mask) >= ((j - i) & mask)) {
            ix->slots[i] = ix->slots[j];
            i = j;
        }
    }
    ix->slots[i] = (struct slot){{0, 0}, 0};
    ix->n--;
}

/* Write lock held. */
static bool forget_locked(struct route_index *ix, int r)
{
    uint32_t cap = ix->cap;
    while (cap > MIN_CAP && (uint64_t)ix->n * 8 < cap)
        cap /= 2;
    ix->rep[r].info.keys = 0;
    return rebuild(ix, cap, ~(1ull << r));
}

void route_index_forget(struct route_index *ix, int r)
{
    pthread_rwlock_wrlock(&ix->lock);
    (void)forget_locked(ix, r); /* out of memory: the old table stays, keys included */
    pthread_rwlock_unlock(&ix->lock);
}

static ks_status apply_locked(struct route_index *ix, int r, const struct store_event *ev)
{
    struct replica_state *rs = &ix->rep[r];
    bool new_epoch = ev->epoch != rs->info.epoch;
    if (ev->op == STORE_EVENT_SNAP || new_epoch) {
        if (!forget_locked(ix, r))
            return ks_fail(KS_ERR_NOMEM, "route: out of memory for the index");
    } else if (ev->seq != rs->info.seq + 1) {
        rs->info.gaps++;
    }
    if (ev->op == STORE_EVENT_SNAP) {
        if (ev->layout_len > KV_KEY_LAYOUT_BYTES || ev->page_tokens < 16 || ev->page_tokens > KV_MAX_PAGE_TOKENS ||
            (ev->page_tokens & (ev->page_tokens - 1)))
            return ks_fail(KS_ERR_FORMAT, "route: a snapshot's key layout is not one kvserve writes");
        memset(&rs->layout, 0, sizeof rs->layout);
        rs->layout.page_tokens = ev->page_tokens;
        rs->layout.n_bytes = (uint32_t)ev->layout_len;
        memcpy(rs->layout.bytes, ev->layout, ev->layout_len);
        rs->info.has_layout = true;
        rs->info.snapshots++;
    } else if (new_epoch) {
        rs->info.has_layout = false; /* a restart may have changed it: wait for its snapshot */
    }
    for (size_t i = 0; i < ev->n_keys; i++) {
        struct kv_key k = key_at(ev->keys + i * KEY_BYTES);
        if (ev->op == STORE_EVENT_DEL)
            del_key(ix, r, k);
        else if (!add_key(ix, r, k))
            return ks_fail(KS_ERR_NOMEM, "route: out of memory for the index");
    }
    rs->info.epoch = ev->epoch;
    rs->info.seq = ev->seq;
    rs->info.events++;
    return KS_OK;
}

ks_status route_index_apply(struct route_index *ix, int r, const struct store_event *ev)
{
    if (r < 0 || r >= ix->n_replicas)
        return ks_fail(KS_ERR_INVALID_ARG, "route: no replica %d", r);
    pthread_rwlock_wrlock(&ix->lock);
    ks_status st = apply_locked(ix, r, ev);
    pthread_rwlock_unlock(&ix->lock);
    return st;
}

bool route_index_layout(const struct route_index *ix, int r, struct kv_key_layout *out)
{
    struct route_index *w = (struct route_index *)ix; /* the lock is not part of the index's value */
    pthread_rwlock_rdlock(&w->lock);
    bool has = ix->rep[r].info.has_layout;
    if (has)
        *out = ix->rep[r].layout;
    pthread_rwlock_unlock(&w->lock);
    return has;
}

int32_t route_index_overlap(const struct route_index *ix, int r, const struct kv_key *keys, int32_t n)
{
    struct route_index *w = (struct route_index *)ix;
    uint64_t bit = 1ull << r;
    int32_t held = 0;
    pthread_rwlock_rdlock(&w->lock);
    for (; held < n; held++) {
        const struct slot *s = &ix->slots[find_slot(ix->slots, ix->cap, keys[held])];
        if (!(s->held & bit))
            break;
    }
    pthread_rwlock_unlock(&w->lock);
    return held;
}

void route_index_info(const struct route_index *ix, int r, struct route_replica_info *out)
{
    struct route_index *w = (struct route_index *)ix;
    pthread_rwlock_rdlock(&w->lock);
    *out = ix->rep[r].info;
    pthread_rwlock_unlock(&w->lock);
}
