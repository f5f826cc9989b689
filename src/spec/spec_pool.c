/* spec: the shared n-gram pool of spec.h (--spec-type ngram-pool). */
#include "spec/spec.h"

#include <stdlib.h>
#include <string.h>

/* One slot: which n-gram wrote it (the hash's high half, never 0 once
 * written) and the token that followed it. A collision costs a wrong draft,
 * which verification rejects; the check keeps most of them out. */
struct slot {
    uint32_t check;
    int32_t token;
};

struct spec_pool {
    int32_t n;          /* tokens hashed per key */
    uint64_t mask;      /* slots - 1 (a power of two) */
    struct slot *slots; /* (mask + 1) */
};

static uint64_t mix64(uint64_t h)
{
    /* splitmix64's finalizer: every input bit reaches the index bits */
    h ^= h >> 30;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 27;
    h *= 0x94d049bb133111ebull;
    return h ^ (h >> 31);
}

static uint64_t hash_tokens(const int32_t *t, int32_t n)
{
    uint64_t h = 0x9e3779b97f4a7c15ull;
    for (int32_t i = 0; i < n; i++)
        h = (h ^ (uint32_t)t[i]) * 0x100000001b3ull;
    return mix64(h);
}

static struct slot *slot_of(const struct spec_pool *p, uint64_t h)
{
    return &p->slots[h & p->mask];
}

static uint32_t check_of(uint64_t h)
{
    uint32_t c = (uint32_t)(h >> 32);
    return c ? c : 1;
}

ks_status spec_pool_create(int32_t n, size_t bytes, struct spec_pool **out)
{
    *out = NULL;
    if (n < SPEC_POOL_N_MIN || n > SPEC_POOL_N_MAX)
        return ks_fail(KS_ERR_INVALID_ARG, "--spec-ngram-size-n must be in %d..%d (got %d)", SPEC_POOL_N_MIN,
                       SPEC_POOL_N_MAX, n);
    size_t slots = 1;
    while (slots * 2 * sizeof(struct slot) <= bytes)
        slots *= 2;
    if (slots * sizeof(struct slot) > bytes || slots < 1024)
        return ks_fail(KS_ERR_INVALID_ARG, "n-gram pool: %zu bytes is below its smallest size (%zu)", bytes,
                       1024 * sizeof(struct slot));
    struct spec_pool *p = calloc(1, sizeof *p);
    struct slot *s = p ? calloc(slots, sizeof *s) : NULL;
    if (!s) {
        free(p);
        return ks_fail(KS_ERR_NOMEM, "n-gram pool: out of memory for %zu bytes", slots * sizeof *s);
    }
    *p = (struct spec_pool){.n = n, .mask = (uint64_t)slots - 1, .slots = s};
    *out = p;
    return KS_OK;
}

void spec_pool_free(struct spec_pool *p)
{
    if (p) {
        free(p->slots);
        free(p);
    }
}

size_t spec_pool_bytes(const struct spec_pool *p)
{
    return p ? (size_t)(p->mask + 1) * sizeof *p->slots : 0;
}

void spec_pool_add(struct spec_pool *p, const int32_t *tokens, int32_t n_tokens, int32_t from)
{
    if (!p || !tokens)
        return;
    if (from < p->n)
        from = p->n;
    for (int32_t i = from; i < n_tokens; i++) {
        uint64_t h = hash_tokens(tokens + i - p->n, p->n);
        *slot_of(p, h) = (struct slot){.check = check_of(h), .token = tokens[i]};
    }
}

int32_t spec_pool_draft(const struct spec_pool *p, const int32_t *tokens, int32_t n_tokens, int32_t n_max,
                        int32_t *draft)
{
    if (!p || !tokens || n_tokens < p->n || n_max <= 0)
        return 0;
    /* the last n tokens of the text followed by the draft so far */
    int32_t window[SPEC_POOL_N_MAX + SPEC_DRAFT_LIMIT];
    if (n_max > SPEC_DRAFT_LIMIT)
        n_max = SPEC_DRAFT_LIMIT;
    memcpy(window, tokens + n_tokens - p->n, (size_t)p->n * sizeof *window);
    int32_t m = 0;
    while (m < n_max) {
        uint64_t h = hash_tokens(window + m, p->n);
        const struct slot *s = slot_of(p, h);
        if (s->check != check_of(h))
            break;
        draft[m] = s->token;
        window[p->n + m] = s->token;
        m++;
    }
    return m;
}
