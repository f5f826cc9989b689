/* grammar: the mask cache a vocabulary shares between the states over it
 * (grammar_vocab_set_mask_cache). A set's mask depends only on the grammar's
 * content and the set's stacks' content, so states of separately compiled
 * copies of one grammar (one per request) share it. Keys are 192-bit hashes:
 * a grammar fingerprint and a 128-bit canonical hash of the set. Full:
 * everything is dropped and the cache starts over (bounded memory, no
 * bookkeeping per use). */
#include "grammar/grammar_internal.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

struct shared_mask {
    struct mask_key key;
    int32_t maxD;
    uint64_t *bits;           /* the block (see LIST_MAX in grammar_match.c), NULL: empty slot */
    size_t n_words;
};

struct mask_cache {
    pthread_mutex_t mu;
    struct shared_mask *slots;
    uint32_t cap, n;          /* cap a power of two, at most half full */
    size_t bytes, limit;
    uint64_t hits, misses;
};

static void clear(struct mask_cache *c)
{
    for (uint32_t i = 0; i < c->cap; i++) {
        free(c->slots[i].bits);
        c->slots[i].bits = NULL;
    }
    c->n = 0;
    c->bytes = 0;
}

void gmask_cache_free(struct mask_cache *c)
{
    if (!c)
        return;
    clear(c);
    free(c->slots);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

struct mask_cache *gmask_cache_new(size_t limit)
{
    struct mask_cache *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    pthread_mutex_init(&c->mu, NULL);
    c->limit = limit;
    return c;
}

static bool key_equal(const struct mask_key *a, const struct mask_key *b)
{
    return a->grammar == b->grammar && a->lo == b->lo && a->hi == b->hi;
}

static uint32_t key_slot(const struct mask_cache *c, const struct mask_key *k)
{
    uint32_t i = (uint32_t)(k->lo ^ k->grammar) & (c->cap - 1);
    while (c->slots[i].bits && !key_equal(&c->slots[i].key, k))
        i = (i + 1) & (c->cap - 1);
    return i;
}

bool gmask_cache_get(struct mask_cache *c, const struct mask_key *k, uint64_t *bits, int32_t *maxD)
{
    pthread_mutex_lock(&c->mu);
    struct shared_mask *e = c->cap ? &c->slots[key_slot(c, k)] : NULL;
    bool hit = e && e->bits;
    if (hit) {
        memcpy(bits, e->bits, e->n_words * sizeof *bits);
        *maxD = e->maxD;
        c->hits++;
    } else {
        c->misses++;
    }
    pthread_mutex_unlock(&c->mu);
    return hit;
}

void gmask_cache_put(struct mask_cache *c, const struct mask_key *k, const uint64_t *bits, size_t words,
                           int32_t maxD)
{
    size_t size = words * sizeof *bits;
    pthread_mutex_lock(&c->mu);
    if (c->bytes + size > c->limit)
        clear(c);
    if (size <= c->limit && 2 * (c->n + 1) > c->cap) {
        uint32_t cap = c->cap ? 2 * c->cap : 64;
        struct shared_mask *slots = calloc(cap, sizeof *slots);
        if (slots) {
            struct shared_mask *old = c->slots;
            uint32_t old_cap = c->cap;
            c->slots = slots;
            c->cap = cap;
            for (uint32_t i = 0; i < old_cap; i++)
                if (old[i].bits)
                    c->slots[key_slot(c, &old[i].key)] = old[i];
            free(old);
        }
    }
    uint64_t *copy = size <= c->limit && 2 * (c->n + 1) <= c->cap ? malloc(size) : NULL;
    struct shared_mask *e = copy ? &c->slots[key_slot(c, k)] : NULL;
    if (e && !e->bits) {
        memcpy(copy, bits, size);
        *e = (struct shared_mask){*k, maxD, copy, words};
        c->n++;
        c->bytes += size;
    } else {
        free(copy); /* another state put it first */
    }
    pthread_mutex_unlock(&c->mu);
}

void gmask_cache_reset(struct mask_cache *c, size_t limit)
{
    pthread_mutex_lock(&c->mu);
    clear(c);
    c->limit = limit;
    pthread_mutex_unlock(&c->mu);
}

ks_status gmask_cache_check(struct mask_cache *c)
{
    pthread_mutex_lock(&c->mu);
    uint32_t n = 0;
    size_t bytes = 0;
    ks_status st = KS_OK;
    for (uint32_t i = 0; i < c->cap && !st; i++) {
        const struct shared_mask *e = &c->slots[i];
        if (!e->bits)
            continue;
        n++;
        bytes += e->n_words * sizeof *e->bits;
        if (key_slot(c, &e->key) != i)
            st = ks_fail(KS_ERR_INTERNAL, "grammar mask cache: the mask in slot %u is not found by its key", i);
    }
    if (!st && (n != c->n || bytes != c->bytes))
        st = ks_fail(KS_ERR_INTERNAL, "grammar mask cache: %u masks of %zu bytes counted as %u of %zu", n, bytes, c->n,
                     c->bytes);
    if (!st && (c->bytes > c->limit || 2 * (uint64_t)c->n > c->cap || (c->cap & (c->cap - 1))))
        st = ks_fail(KS_ERR_INTERNAL, "grammar mask cache: %zu bytes (limit %zu), %u masks in %u slots", c->bytes,
                     c->limit, c->n, c->cap);
    pthread_mutex_unlock(&c->mu);
    return st;
}

void gmask_cache_stats(struct mask_cache *c, struct grammar_mask_cache_stats *out)
{
    pthread_mutex_lock(&c->mu);
    *out = (struct grammar_mask_cache_stats){
        .hits = c->hits, .misses = c->misses, .masks = c->n, .bytes = c->bytes, .limit = c->limit,
    };
    pthread_mutex_unlock(&c->mu);
}
