/* The in-memory index of the store: key -> metadata, rebuilt at open, so a
 * lookup that misses never touches the disk. Entries are dense (removal moves
 * the last one into the hole); slots are linear probing with backward-shift
 * deletion. */
#include <stdlib.h>
#include <string.h>

#include "store/store_internal.h"

enum { MIN_SLOTS = 256 };

static bool key_equal(struct store_key a, struct store_key b) { return a.lo == b.lo && a.hi == b.hi; }

static uint32_t home(const struct store_index *ix, struct store_key k) { return (uint32_t)k.lo & (ix->cap - 1); }

static uint32_t slot_of(const struct store_index *ix, struct store_key k)
{
    uint32_t i = home(ix, k);
    while (ix->slots[i] >= 0 && !key_equal(ix->e[ix->slots[i]].key, k))
        i = (i + 1) & (ix->cap - 1);
    return i;
}

int32_t store_index_find(const struct store_index *ix, struct store_key k)
{
    return ix->cap ? ix->slots[slot_of(ix, k)] : -1;
}

static ks_status rehash(struct store_index *ix, uint32_t cap)
{
    int32_t *slots = malloc((size_t)cap * sizeof *slots);
    if (!slots)
        return ks_fail(KS_ERR_NOMEM, "prefix cache on disk: out of memory for the index");
    for (uint32_t i = 0; i < cap; i++)
        slots[i] = -1;
    free(ix->slots);
    ix->slots = slots;
    ix->cap = cap;
    for (uint32_t j = 0; j < ix->n; j++)
        ix->slots[slot_of(ix, ix->e[j].key)] = (int32_t)j;
    return KS_OK;
}

ks_status store_index_put(struct store_index *ix, struct store_key k, const struct store_meta *m)
{
    int32_t at = store_index_find(ix, k);
    if (at >= 0) {
        ix->bytes = ix->bytes - ix->e[at].meta.bytes + m->bytes;
        ix->e[at].meta = *m;
        return KS_OK;
    }
    ks_status st;
    if ((uint64_t)(ix->n + 1) * 2 > ix->cap && (st = rehash(ix, ix->cap ? ix->cap * 2 : MIN_SLOTS)))
        return st;
    if (ix->n == ix->cap_e) {
        uint32_t cap = ix->cap_e ? ix->cap_e * 2 : MIN_SLOTS;
        struct store_entry *e = realloc(ix->e, (size_t)cap * sizeof *e);
        if (!e)
            return ks_fail(KS_ERR_NOMEM, "prefix cache on disk: out of memory for the index");
        ix->e = e;
        ix->cap_e = cap;
    }
    ix->e[ix->n] = (struct store_entry){.key = k, .meta = *m};
    ix->slots[slot_of(ix, k)] = (int32_t)ix->n++;
    ix->bytes += m->bytes;
    return KS_OK;
}

void store_index_remove(struct store_index *ix, struct store_key k)
{
    if (!ix->cap)
        return;
    uint32_t mask = ix->cap - 1, i = slot_of(ix, k);
    int32_t at = ix->slots[i];
    if (at < 0)
        return;
    ix->bytes -= ix->e[at].meta.bytes;
    for (uint32_t j = (i + 1) & mask; ix->slots[j] >= 0; j = (j + 1) & mask) {
        uint32_t h = home(ix, ix->e[ix->slots[j]].key);
        if (((j - h) & mask) >= ((j - i) & mask)) {
            ix->slots[i] = ix->slots[j];
            i = j;
        }
    }
    ix->slots[i] = -1;
    uint32_t last = --ix->n;
    if ((uint32_t)at != last) {
        ix->e[at] = ix->e[last];
        ix->slots[slot_of(ix, ix->e[at].key)] = at;
    }
}

void store_index_free(struct store_index *ix)
{
    free(ix->e);
    free(ix->slots);
    memset(ix, 0, sizeof *ix);
}
