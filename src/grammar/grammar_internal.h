/* Internal to the grammar module: the compiled grammar's flat layout. */
#ifndef KS_GRAMMAR_INTERNAL_H
#define KS_GRAMMAR_INTERNAL_H

#include <stdatomic.h>
#include <stdint.h>

#include "grammar/grammar.h"

#define GRAMMAR_INF (1 << 29) /* "never completes" in byte counts; sums saturate here */

enum gelem_kind {
    GE_END,  /* end of an alternative */
    GE_REF,  /* arg: rule index */
    GE_CHAR, /* arg: class index */
};

struct gelem {
    uint8_t kind;
    int32_t arg;
};

/* A character class: ranges[first .. first+n) as (lo, hi) pairs, inclusive,
 * negated or not; ascii is the class over 0..127 precomputed (negation
 * applied) so the common case is one bit test. */
struct gclass {
    uint32_t ascii[4];
    int32_t first, n;
    bool neg;
    int32_t minlen; /* UTF-8 bytes of the smallest code point in the class (1 for a token) */
    bool token;     /* <[N]>: the one range is (GRAMMAR_TOKEN_CP(N), same) */
};

/* A token terminal <[N]> is matched as a code point above Unicode, which no
 * text can produce: only drawing token N itself steps over it. Transitions
 * are keyed (set << GRAMMAR_CP_BITS | cp). */
#define GRAMMAR_CP_BITS 24
#define GRAMMAR_TOKEN_CP(id) (0x110000u + (uint32_t)(id))
#define GRAMMAR_MAX_TOKEN_ID ((int32_t)((1u << GRAMMAR_CP_BITS) - 1 - 0x110000u))

/* Rules are stored flat: the alternatives of rule r are alt_start[rule_alt[r]
 * .. rule_alt[r+1]), each a run of elements ending with GE_END. minrest[p]:
 * the fewest bytes from element p to the end of its alternative. */
struct grammar {
    atomic_int refs;
    struct gelem *elems;      /* (n_elems) */
    int32_t n_elems;
    int32_t *minrest;         /* (n_elems) */
    int32_t *alt_start;       /* (n_alts) */
    int32_t *rule_alt;        /* (n_rules + 1) */
    int32_t n_rules, root;
    char **rule_names;        /* (n_rules) */
    int32_t *rule_min;        /* (n_rules) fewest bytes a rule matches */
    struct gclass *classes;   /* (n_classes) */
    int32_t n_classes;
    uint32_t *ranges;         /* (2 * n_ranges) */
    int32_t *tokens;          /* (n_tokens) distinct ids of the <[N]> terminals */
    int32_t n_tokens;
};

static inline bool gclass_match(const struct grammar *g, const struct gclass *c, uint32_t cp)
{
    if (cp > 0x10FFFF || c->token)
        return c->token && cp == g->ranges[2 * c->first];
    if (cp < 128)
        return (c->ascii[cp >> 5] >> (cp & 31)) & 1u;
    bool in = false;
    for (int32_t i = 0; i < c->n && !in; i++)
        in = cp >= g->ranges[2 * (c->first + i)] && cp <= g->ranges[2 * (c->first + i) + 1];
    return in != c->neg;
}

/* Does the class hold any code point of [lo, hi]? */
bool gclass_intersects(const struct grammar *g, const struct gclass *c, uint32_t lo, uint32_t hi);

static inline int32_t gsat_add(int32_t a, int32_t b)
{
    int64_t s = (int64_t)a + b;
    return s >= GRAMMAR_INF ? GRAMMAR_INF : (int32_t)s;
}

/* ---- the shared mask cache (grammar_mask_cache.c) --------------------------------- */

/* A set's mask depends only on the grammar's content and the set's stacks'
 * content, so states of separately compiled copies of one grammar share it:
 * the key is a grammar fingerprint and a 128-bit canonical hash of the set. */
struct mask_key {
    uint64_t grammar, lo, hi;
};

/* Thread-safe (one lock); full: everything is dropped and it starts over. */
struct mask_cache;
struct mask_cache *gmask_cache_new(size_t limit); /* NULL when out of memory */
void gmask_cache_free(struct mask_cache *c);
/* Copy the cached block of k into bits (room for a whole block); false when absent. */
bool gmask_cache_get(struct mask_cache *c, const struct mask_key *k, uint64_t *bits, int32_t *maxD);
/* Keep a copy of a mask's block of words (an allocation failure only means it is not kept). */
void gmask_cache_put(struct mask_cache *c, const struct mask_key *k, const uint64_t *bits, size_t words,
                     int32_t maxD);
/* Drop every mask and set the limit in bytes. */
void gmask_cache_reset(struct mask_cache *c, size_t limit);
void gmask_cache_stats(struct mask_cache *c, struct grammar_mask_cache_stats *out);
/* Its invariants (grammar_check); KS_ERR_INTERNAL names the first broken one. */
ks_status gmask_cache_check(struct mask_cache *c);

#endif
