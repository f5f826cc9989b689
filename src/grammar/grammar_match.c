/* The matcher: interned pushdown stacks and stack sets, memoized transitions
 * over code points, the vocabulary trie and the per-step mask. */
#include "grammar/grammar_internal.h"

#include <math.h>
#include <stdio.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

/* Per-state limits beyond the per-step ones of grammar.h: the interned
 * stacks, sets and transitions a request may accumulate, and the bytes of
 * cached masks (dropped, not failed, when over). */
enum {
    MAX_NODES = 1 << 22,
    MAX_SETS = 1 << 20,
    MAX_MEMBERS = 1 << 24,
    MASK_CACHE_BYTES = 16 << 20, /* ~880 masks at 151k tokens; x parallel requests */
    /* A cached mask is a block: the bitset's words, a count n, then n
     * (token << 32 | D) for the allowed tokens whose D after them differs
     * from the set's own (at most LIST_MAX; a larger n keeps none): the rest
     * keep it, so the mask under any budget follows without a walk. */
    LIST_MAX = 8192,
};

/* The vocabulary's cache of masks shared by every state over it (see
 * grammar_vocab_set_mask_cache), ~3500 masks at 151k tokens. */
#define SHARED_MASK_BYTES ((size_t)64 << 20)

/* Debug builds check a state's invariants after every call that changes it
 * (grammar_check). */
#ifndef KS_GRAMMAR_CHECK
#ifdef NDEBUG
#define KS_GRAMMAR_CHECK 0
#else
#define KS_GRAMMAR_CHECK 1
#endif
#endif
#if KS_GRAMMAR_CHECK
static void grammar_debug_check(const struct grammar_state *st, const char *call);
#define GRAMMAR_DEBUG_CHECK(st, call) grammar_debug_check(st, call)
#else
#define GRAMMAR_DEBUG_CHECK(st, call) ((void)0)
#endif

#define UNKNOWN (-2)
#define DEAD 0      /* the empty set: nothing can follow */
#define COMPLETE 0  /* node 0: the empty stack, the grammar may end here */

/* ---- open-addressing table: 64-bit key -> int32 ---------------------------------- */

struct table {
    uint64_t *keys;
    int32_t *vals;
    uint32_t cap, n; /* cap a power of two */
};

#define TABLE_EMPTY UINT64_MAX

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static int32_t table_get(const struct table *t, uint64_t key)
{
    if (!t->cap)
        return -1;
    for (uint32_t i = (uint32_t)mix64(key) & (t->cap - 1);; i = (i + 1) & (t->cap - 1)) {
        if (t->keys[i] == key)
            return t->vals[i];
        if (t->keys[i] == TABLE_EMPTY)
            return -1;
    }
}

static bool table_put(struct table *t, uint64_t key, int32_t val)
{
    if (2 * (t->n + 1) > t->cap) {
        uint32_t cap = t->cap ? 2 * t->cap : 1024;
        uint64_t *keys = malloc((size_t)cap * sizeof *keys);
        int32_t *vals = malloc((size_t)cap * sizeof *vals);
        if (!keys || !vals) {
            free(keys);
            free(vals);
            return false;
        }
        memset(keys, 0xff, (size_t)cap * sizeof *keys);
        for (uint32_t i = 0; i < t->cap; i++) {
            if (t->keys[i] == TABLE_EMPTY)
                continue;
            uint32_t j = (uint32_t)mix64(t->keys[i]) & (cap - 1);
            while (keys[j] != TABLE_EMPTY)
                j = (j + 1) & (cap - 1);
            keys[j] = t->keys[i];
            vals[j] = t->vals[i];
        }
        free(t->keys);
        free(t->vals);
        t->keys = keys;
        t->vals = vals;
        t->cap = cap;
    }
    uint32_t i = (uint32_t)mix64(key) & (t->cap - 1);
    while (t->keys[i] != TABLE_EMPTY)
        i = (i + 1) & (t->cap - 1);
    t->keys[i] = key;
    t->vals[i] = val;
    t->n++;
    return true;
}

static void table_free(struct table *t)
{
    free(t->keys);
    free(t->vals);
}

/* ---- vocabulary ------------------------------------------------------------------- */

/* The trie in depth-first order: the subtree of node i is [i, end[i]); node 0
 * is the root (the empty prefix). Tokens with the same bytes hang off one node
 * through tok_next. */
struct grammar_vocab {
    int32_t n_vocab;
    int32_t n_nodes;
    uint8_t *byte;        /* (n_nodes) the byte that leads into the node */
    uint16_t *depth;      /* (n_nodes) */
    int32_t *end;         /* (n_nodes) */
    int32_t *tok_head;    /* (n_nodes) first token ending here, -1 none */
    int32_t *tok_next;    /* (n_vocab) */
    uint8_t *kind;        /* (n_vocab) enum grammar_token_kind */
    uint32_t *off;        /* (n_vocab + 1) token bytes in blob */
    char *blob;
    int32_t *eog;         /* (n_eog) */
    int32_t n_eog;
    int32_t max_len;      /* longest piece in bytes (the trie's depth) */
    /* Plain string content: whole valid UTF-8 of code points in PLAIN_RANGES
     * (no quote, backslash or control). plain: the tokens; plain_sub[i]: every
     * token under node i is plain. A set that loops on every plain code
     * point allows them all at its own D without walking them. */
    uint64_t *plain;      /* (n_vocab / 64 words) */
    uint8_t *plain_sub;   /* (n_nodes) */
    int32_t n_plain;
    bool plain_skip;      /* grammar_vocab_set_plain_skip */
    struct mask_cache *masks; /* shared by the states over this vocabulary (mutable behind its lock) */
};

enum { MAX_PIECE = 4096 };

static const struct grammar_vocab *sort_vocab; /* qsort context (vocab_create is not reentrant-sensitive: see lock) */

static int cmp_piece(const void *a, const void *b)
{
    const struct grammar_vocab *v = sort_vocab;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    uint32_t lx = v->off[x + 1] - v->off[x], ly = v->off[y + 1] - v->off[y];
    int c = memcmp(v->blob + v->off[x], v->blob + v->off[y], lx < ly ? lx : ly);
    if (c)
        return c;
    return lx < ly ? -1 : lx > ly ? 1 : (x > y) - (x < y);
}

void grammar_vocab_free(struct grammar_vocab *v)
{
    if (!v)
        return;
    free(v->byte);
    free(v->depth);
    free(v->end);
    free(v->tok_head);
    free(v->tok_next);
    free(v->kind);
    free(v->off);
    free(v->blob);
    free(v->eog);
    free(v->plain);
    free(v->plain_sub);
    gmask_cache_free(v->masks);
    free(v);
}

int32_t grammar_vocab_size(const struct grammar_vocab *v)
{
    return v->n_vocab;
}

void grammar_vocab_set_mask_cache(struct grammar_vocab *v, size_t bytes)
{
    gmask_cache_reset(v->masks, bytes);
}

void grammar_vocab_mask_cache_stats(const struct grammar_vocab *v, struct grammar_mask_cache_stats *out)
{
    gmask_cache_stats(v->masks, out);
}

void grammar_vocab_set_plain_skip(struct grammar_vocab *v, bool on)
{
    v->plain_skip = on;
}

/* The code points of JSON string content that need no escape (DEL too is
 * left out, as json_object's char class does), as inclusive ranges. */
static const uint32_t PLAIN_RANGES[][2] = {{0x20, 0x21}, {0x23, 0x5B}, {0x5D, 0x7E}, {0x80, 0xD7FF}, {0xE000, 0x10FFFF}};
enum { N_PLAIN_RANGES = sizeof PLAIN_RANGES / sizeof PLAIN_RANGES[0] };

static int utf8_feed(uint32_t *acc, int *rem, int *len, uint8_t b, uint32_t *cp);

static bool is_plain_cp(uint32_t cp)
{
    for (int i = 0; i < N_PLAIN_RANGES; i++)
        if (cp >= PLAIN_RANGES[i][0] && cp <= PLAIN_RANGES[i][1])
            return true;
    return false;
}

static bool is_plain_piece(const char *s, uint32_t n)
{
    uint32_t acc = 0, cp = 0;
    int rem = 0, len = 0;
    for (uint32_t i = 0; i < n; i++) {
        int r = utf8_feed(&acc, &rem, &len, (uint8_t)s[i], &cp);
        if (r < 0 || (r == 1 && !is_plain_cp(cp)))
            return false;
    }
    return rem == 0;
}

/* Mark the plain tokens and the subtrees holding only plain tokens (children
 * come after their parent in depth-first order, so a backward pass sees
 * every child first). */
static bool mark_plain(struct grammar_vocab *v)
{
    v->plain = calloc(((size_t)v->n_vocab + 63) / 64, sizeof *v->plain);
    v->plain_sub = malloc((size_t)v->n_nodes);
    if (!v->plain || !v->plain_sub)
        return false;
    for (int32_t i = v->n_nodes - 1; i > 0; i--) {
        bool all = true;
        int32_t t = v->tok_head[i];
        if (t >= 0 && !is_plain_piece(v->blob + v->off[t], v->off[t + 1] - v->off[t]))
            all = false;
        for (; t >= 0 && all; t = v->tok_next[t]) {
            v->plain[t >> 6] |= 1ull << (t & 63);
            v->n_plain++;
        }
        for (int32_t c = i + 1; c < v->end[i] && all; c = v->end[c])
            all = v->plain_sub[c];
        v->plain_sub[i] = all;
    }
    v->plain_sub[0] = 0;
    v->plain_skip = true;
    return true;
}

static int32_t lcp(const char *a, uint32_t la, const char *b, uint32_t lb)
{
    uint32_t n = la < lb ? la : lb, i = 0;
    while (i < n && a[i] == b[i])
        i++;
    return (int32_t)i;
}

ks_status grammar_vocab_create(int32_t n_vocab, grammar_piece_fn piece, void *user, struct grammar_vocab **out)
{
    static _Atomic int sorting; /* qsort has no context argument: serialize the one sort */
    if (n_vocab < 1 || !piece || !out)
        return ks_fail(KS_ERR_INVALID_ARG, "grammar_vocab_create: needs n_vocab >= 1 and a piece function");
    struct grammar_vocab *v = calloc(1, sizeof *v);
    int32_t *order = NULL, *path = NULL;
    ks_status st = KS_OK;
    if (!v)
        return ks_fail(KS_ERR_NOMEM, "grammar: out of memory building the vocabulary trie");
    v->n_vocab = n_vocab;
    v->kind = malloc((size_t)n_vocab);
    v->off = malloc((size_t)(n_vocab + 1) * sizeof *v->off);
    v->tok_next = malloc((size_t)n_vocab * sizeof *v->tok_next);
    v->eog = malloc((size_t)n_vocab * sizeof *v->eog);
    order = malloc((size_t)n_vocab * sizeof *order);
    size_t cap = 1 << 16, used = 0;
    v->blob = malloc(cap);
    v->masks = gmask_cache_new(SHARED_MASK_BYTES);
    if (!v->kind || !v->off || !v->tok_next || !v->eog || !order || !v->blob || !v->masks)
        goto oom;
    int32_t n_text = 0;
    for (int32_t id = 0; id < n_vocab; id++) {
        const char *b = NULL;
        size_t n = 0;
        enum grammar_token_kind k = GRAMMAR_TOKEN_SPECIAL;
        if ((st = piece(user, id, &b, &n, &k)))
            goto fail;
        if (k == GRAMMAR_TOKEN_TEXT && (n == 0 || n > MAX_PIECE))
            k = GRAMMAR_TOKEN_SPECIAL; /* never allowed: an empty piece makes no progress */
        v->kind[id] = (uint8_t)k;
        v->off[id] = (uint32_t)used;
        if (k == GRAMMAR_TOKEN_EOG)
            v->eog[v->n_eog++] = id;
        if (k != GRAMMAR_TOKEN_TEXT)
            continue;
        if (used + n > cap) {
            while (used + n > cap)
                cap *= 2;
            char *nb = realloc(v->blob, cap);
            if (!nb)
                goto oom;
            v->blob = nb;
        }
        memcpy(v->blob + used, b, n);
        used += n;
        order[n_text++] = id;
        if ((int32_t)n > v->max_len)
            v->max_len = (int32_t)n;
    }
    v->off[n_vocab] = (uint32_t)used;
    /* a non-text token appended nothing: its piece blob[off[id], off[id+1]) is empty */
    int expected = 0;
    while (!atomic_compare_exchange_weak(&sorting, &expected, 1))
        expected = 0;
    sort_vocab = v;
    qsort(order, (size_t)n_text, sizeof *order, cmp_piece);
    atomic_store(&sorting, 0);

    /* nodes: at most 1 + total bytes */
    size_t max_nodes = used + 1;
    v->byte = malloc(max_nodes);
    v->depth = malloc(max_nodes * sizeof *v->depth);
    v->end = malloc(max_nodes * sizeof *v->end);
    v->tok_head = malloc(max_nodes * sizeof *v->tok_head);
    path = malloc((size_t)(v->max_len + 1) * sizeof *path);
    if (!v->byte || !v->depth || !v->end || !v->tok_head || !path)
        goto oom;
    v->byte[0] = 0;
    v->depth[0] = 0;
    v->tok_head[0] = -1;
    v->n_nodes = 1;
    path[0] = 0;
    int32_t top = 0; /* depth of the current path */
    const char *prev = NULL;
    uint32_t prev_len = 0;
    for (int32_t i = 0; i < n_text; i++) {
        int32_t id = order[i];
        const char *s = v->blob + v->off[id];
        uint32_t len = v->off[id + 1] - v->off[id];
        int32_t common = prev ? lcp(prev, prev_len, s, len) : 0;
        while (top > common)
            v->end[path[top--]] = v->n_nodes;
        for (int32_t d = common; d < (int32_t)len; d++) {
            int32_t n = v->n_nodes++;
            v->byte[n] = (uint8_t)s[d];
            v->depth[n] = (uint16_t)(d + 1);
            v->tok_head[n] = -1;
            path[++top] = n;
        }
        v->tok_next[id] = v->tok_head[path[top]];
        v->tok_head[path[top]] = id;
        prev = s;
        prev_len = len;
    }
    while (top >= 0)
        v->end[path[top--]] = v->n_nodes;
    if (!mark_plain(v))
        goto oom;
    free(order);
    free(path);
    *out = v;
    return KS_OK;
oom:
    st = ks_fail(KS_ERR_NOMEM, "grammar: out of memory building the vocabulary trie");
fail:
    free(order);
    free(path);
    grammar_vocab_free(v);
    return st;
}

/* ---- state ---------------------------------------------------------------------------- */

/* A lazy state's wait for its trigger: the text since the last check (the
 * tail that may still begin a trigger word, then the newest token's bytes). */
struct lazy {
    struct grammar_triggers trig;
    bool waiting;
    bool text_seen;           /* non-whitespace text came before pending */
    int32_t max_tokens;       /* the whole budget (< 0: none) */
    int32_t drawn;            /* tokens accepted so far */
    char *pending;            /* (GRAMMAR_MAX_TRIGGER_LEN + MAX_PIECE) */
    size_t n_pending;
};

struct grammar_state {
    struct grammar *g;
    const struct grammar_vocab *v;
    /* stack nodes: (pos, parent); node 0 is the empty stack. nh1, nh2: two
     * hashes of the stack's content (positions down to the bottom), the
     * same in every state of the same grammar */
    int32_t *npos, *nparent, *nD;
    uint64_t *nh1, *nh2;
    uint64_t gkey;            /* the grammar's content (grammar_fingerprint) */
    int32_t n_nodes, cap_nodes;
    struct table node_tab;
    /* sets: members[soff[s] .. soff[s+1]) sorted node ids; set 0 is empty */
    int32_t *soff, *members;
    int32_t n_sets, cap_sets, n_members, cap_members;
    uint64_t *shash;
    int32_t *sD;              /* fewest bytes to complete, GRAMMAR_INF for the empty set */
    int32_t **sascii;         /* (128) transitions on ASCII, UNKNOWN until computed; NULL until first use */
    uint64_t **smask;         /* cached mask (bitset over the vocabulary), NULL none */
    int32_t *smaskD;          /* the largest D after any token the cached mask allows */
    int8_t *sloop;            /* every plain character leads back to the set: 1 yes, 0 no, -1 unknown */
    int32_t *set_slots;       /* set interning: open addressing over shash, -1 empty */
    uint32_t set_cap;
    struct table trans;       /* (set << GRAMMAR_CP_BITS | cp) -> set, non-ASCII */
    struct table cut_D;       /* (set, a cut character's bits) -> partial_D, for the walk */
    size_t mask_bytes;
    /* where the text is */
    int32_t cur;
    int32_t init;             /* the set at the start of the text */
    uint32_t pacc;            /* partial character: bits so far */
    int prem, plen;           /* continuation bytes still expected; bytes of the whole character */
    int32_t remaining;        /* tokens the budget still allows (INT32_MAX: no limit) */
    bool done;                /* an EOG token was accepted */
    struct lazy *lazy;        /* grammar_state_create_lazy: free text until a trigger, NULL: none */
    uint64_t walks;           /* trie walks made (grammar_state_walks) */
    uint64_t shared_hits;     /* masks taken from the vocabulary's cache (grammar_state_shared_hits) */
    ks_status err;            /* the last failure of a helper */
    /* scratch */
    int32_t *tmp;
    int32_t n_tmp, cap_tmp;
    int32_t expand_work;
    uint64_t *scratch;        /* a mask being built */
    int32_t *w_set;           /* (max_len + 1) per-depth walk state */
    uint32_t *w_acc;
    int8_t *w_rem, *w_len;
};

static ks_status oom(void)
{
    return ks_fail(KS_ERR_NOMEM, "grammar: out of memory while matching");
}

/* Helpers below return -1 / false after recording the failure in st->err. */
static void fail_oom(struct grammar_state *st)
{
    st->err = oom();
}

/* realloc st->f to cap elements (the caller's `cap`), or fail the calling
 * bool function with the out-of-memory status. */
#define GROW(f)                                                                                                  \
    do {                                                                                                         \
        void *p_ = realloc(st->f, (size_t)cap * sizeof *st->f);                                                  \
        if (!p_)                                                                                                 \
            return fail_oom(st), false;                                                                          \
        st->f = p_;                                                                                              \
    } while (0)

static bool nodes_grow(struct grammar_state *st)
{
    int32_t cap = st->cap_nodes ? 2 * st->cap_nodes : 1024;
    GROW(npos);
    GROW(nparent);
    GROW(nD);
    GROW(nh1);
    GROW(nh2);
    st->cap_nodes = cap;
    return true;
}

static int32_t node_get(struct grammar_state *st, int32_t pos, int32_t parent)
{
    uint64_t key = (uint64_t)(uint32_t)pos << 32 | (uint32_t)parent;
    int32_t id = table_get(&st->node_tab, key);
    if (id >= 0)
        return id;
    if (st->n_nodes >= MAX_NODES)
        return st->err = ks_fail(KS_ERR_RANGE, "grammar: the state grew past %d stacks; the grammar is too "
                                               "ambiguous for this output", MAX_NODES), -1;
    if (st->n_nodes == st->cap_nodes && !nodes_grow(st))
        return -1;
    id = st->n_nodes;
    st->npos[id] = pos;
    st->nparent[id] = parent;
    st->nD[id] = gsat_add(st->g->minrest[pos], st->nD[parent]);
    st->nh1[id] = mix64(st->nh1[parent] * 0x9E3779B97F4A7C15ull + (uint64_t)(uint32_t)pos);
    st->nh2[id] = mix64((st->nh2[parent] ^ 0xD6E8FEB86659FD93ull) + (uint64_t)(uint32_t)pos * 0xA0761D6478BD642Full);
    if (!table_put(&st->node_tab, key, id))
        return fail_oom(st), -1;
    st->n_nodes++;
    return id;
}

static bool tmp_push(struct grammar_state *st, int32_t x)
{
    if (st->n_tmp == st->cap_tmp) {
        int32_t cap = st->cap_tmp ? 2 * st->cap_tmp : 256;
        int32_t *p = realloc(st->tmp, (size_t)cap * sizeof *p);
        if (!p)
            return fail_oom(st), false;
        st->tmp = p;
        st->cap_tmp = cap;
    }
    st->tmp[st->n_tmp++] = x;
    return true;
}

/* Add to tmp every stack that continues at element pos with parent below it,
 * down to a character element (or the empty stack). A reference followed by
 * the end of its alternative pushes nothing (a tail call), so right-recursive
 * repetition runs in constant stack depth. */
static bool expand(struct grammar_state *st, int32_t pos, int32_t parent, int depth)
{
    if (depth > GRAMMAR_MAX_DEPTH)
        return st->err = ks_fail(KS_ERR_RANGE, "grammar: rule references nest deeper than %d without a character",
                                 GRAMMAR_MAX_DEPTH), false;
    const struct grammar *g = st->g;
    for (;;) {
        const struct gelem *e = &g->elems[pos];
        if (e->kind == GE_END) {
            if (parent == COMPLETE)
                return tmp_push(st, COMPLETE);
            pos = st->npos[parent];
            parent = st->nparent[parent];
            continue;
        }
        if (e->kind == GE_CHAR) {
            int32_t n = node_get(st, pos, parent);
            return n >= 0 && tmp_push(st, n);
        }
        if (++st->expand_work > GRAMMAR_MAX_EXPAND)
            return st->err = ks_fail(KS_ERR_RANGE, "grammar: one character needed over %d rule expansions; the "
                                                   "grammar is too ambiguous", GRAMMAR_MAX_EXPAND), false;
        int32_t cont = parent;
        if (g->elems[pos + 1].kind != GE_END && (cont = node_get(st, pos + 1, parent)) < 0)
            return false;
        int32_t r = e->arg;
        for (int32_t a = g->rule_alt[r]; a < g->rule_alt[r + 1]; a++)
            if (!expand(st, g->alt_start[a], cont, depth + 1))
                return false;
        return true;
    }
}

static int cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

static bool set_slots_grow(struct grammar_state *st)
{
    uint32_t cap = st->set_cap ? 2 * st->set_cap : 1024;
    int32_t *slots = malloc((size_t)cap * sizeof *slots);
    if (!slots)
        return false;
    memset(slots, 0xff, (size_t)cap * sizeof *slots);
    for (uint32_t i = 0; i < st->set_cap; i++) {
        int32_t s = st->set_slots[i];
        if (s < 0)
            continue;
        uint32_t j = (uint32_t)st->shash[s] & (cap - 1);
        while (slots[j] >= 0)
            j = (j + 1) & (cap - 1);
        slots[j] = s;
    }
    free(st->set_slots);
    st->set_slots = slots;
    st->set_cap = cap;
    return true;
}

static bool sets_grow(struct grammar_state *st, int32_t need)
{
    if (need <= st->cap_sets)
        return true;
    int32_t cap = st->cap_sets ? 2 * st->cap_sets : 256;
    while (cap < need)
        cap *= 2;
    GROW(soff);
    GROW(shash);
    GROW(sD);
    GROW(sascii);
    GROW(smask);
    GROW(smaskD);
    GROW(sloop);
    st->cap_sets = cap;
    return true;
}

/* Intern the set in tmp[0..n_tmp) (sorted and deduplicated here). */
static int32_t set_intern(struct grammar_state *st)
{
    int32_t n = st->n_tmp;
    if (n == 0)
        return DEAD;
    qsort(st->tmp, (size_t)n, sizeof *st->tmp, cmp_i32);
    int32_t k = 1;
    for (int32_t i = 1; i < n; i++)
        if (st->tmp[i] != st->tmp[k - 1])
            st->tmp[k++] = st->tmp[i];
    n = k;
    if (n > GRAMMAR_MAX_STACKS)
        return st->err = ks_fail(KS_ERR_RANGE, "grammar: %d stacks alive at once (limit %d); the grammar is too "
                                               "ambiguous", n, GRAMMAR_MAX_STACKS), -1;
    uint64_t h = 0x9E3779B97F4A7C15ull;
    for (int32_t i = 0; i < n; i++)
        h = mix64(h ^ (uint64_t)(uint32_t)st->tmp[i]);
    if (2 * (uint32_t)(st->n_sets + 1) > st->set_cap && !set_slots_grow(st))
        return fail_oom(st), -1;
    uint32_t i = (uint32_t)h & (st->set_cap - 1);
    for (; st->set_slots[i] >= 0; i = (i + 1) & (st->set_cap - 1)) {
        int32_t s = st->set_slots[i];
        if (st->shash[s] == h && st->soff[s + 1] - st->soff[s] == n &&
            !memcmp(st->members + st->soff[s], st->tmp, (size_t)n * sizeof *st->tmp))
            return s;
    }
    if (st->n_sets + 1 >= MAX_SETS || st->n_members + n > MAX_MEMBERS)
        return st->err = ks_fail(KS_ERR_RANGE, "grammar: the state grew past %d stack sets; the grammar is too "
                                               "ambiguous for this output", MAX_SETS), -1;
    if (!sets_grow(st, st->n_sets + 2))
        return -1;
    if (st->n_members + n > st->cap_members) {
        int32_t cap = st->cap_members ? st->cap_members : 1024;
        while (cap < st->n_members + n)
            cap *= 2;
        int32_t *p = realloc(st->members, (size_t)cap * sizeof *p);
        if (!p)
            return fail_oom(st), -1;
        st->members = p;
        st->cap_members = cap;
    }
    int32_t s = st->n_sets++;
    memcpy(st->members + st->n_members, st->tmp, (size_t)n * sizeof *st->tmp);
    st->n_members += n;
    st->soff[s + 1] = st->n_members;
    st->shash[s] = h;
    int32_t D = GRAMMAR_INF;
    for (int32_t j = 0; j < n; j++)
        if (st->nD[st->tmp[j]] < D)
            D = st->nD[st->tmp[j]];
    st->sD[s] = D;
    st->sascii[s] = NULL;
    st->smask[s] = NULL;
    st->smaskD[s] = 0;
    st->sloop[s] = -1;
    st->set_slots[i] = s;
    return s;
}

/* The set after code point cp, memoized; DEAD when nothing accepts cp, -1 on error. */
static int32_t step(struct grammar_state *st, int32_t set, uint32_t cp)
{
    if (set == DEAD)
        return DEAD;
    if (cp < 128 && st->sascii[set] && st->sascii[set][cp] != UNKNOWN)
        return st->sascii[set][cp];
    uint64_t key = (uint64_t)(uint32_t)set << GRAMMAR_CP_BITS | cp;
    if (cp >= 128) {
        int32_t r = table_get(&st->trans, key);
        if (r >= 0)
            return r;
    }
    const struct grammar *g = st->g;
    st->n_tmp = 0;
    st->expand_work = 0;
    for (int32_t i = st->soff[set]; i < st->soff[set + 1]; i++) {
        int32_t m = st->members[i];
        if (m == COMPLETE)
            continue;
        int32_t pos = st->npos[m];
        if (gclass_match(g, &g->classes[g->elems[pos].arg], cp) && !expand(st, pos + 1, st->nparent[m], 0))
            return -1;
    }
    int32_t next = set_intern(st);
    if (next < 0)
        return -1;
    if (cp < 128) {
        if (!st->sascii[set]) {
            int32_t *a = malloc(128 * sizeof *a);
            if (!a)
                return fail_oom(st), -1;
            for (int i = 0; i < 128; i++)
                a[i] = UNKNOWN;
            st->sascii[set] = a;
        }
        st->sascii[set][cp] = next;
    } else if (!table_put(&st->trans, key, next)) {
        return fail_oom(st), -1;
    }
    return next;
}

/* A character cut after some bytes can still become any code point in
 * [lo, hi]: the fewest bytes to complete from set through such a character
 * (its rem bytes, then the rest), GRAMMAR_INF if no stack takes any of them. */
static int32_t partial_D(const struct grammar_state *st, int32_t set, uint32_t lo, uint32_t hi, int rem)
{
    const struct grammar *g = st->g;
    int32_t best = GRAMMAR_INF;
    for (int32_t i = st->soff[set]; i < st->soff[set + 1]; i++) {
        int32_t m = st->members[i];
        if (m == COMPLETE)
            continue;
        int32_t pos = st->npos[m];
        if (!gclass_intersects(g, &g->classes[g->elems[pos].arg], lo, hi))
            continue;
        int32_t d = gsat_add(rem, gsat_add(g->minrest[pos + 1], st->nD[st->nparent[m]]));
        if (d < best)
            best = d;
    }
    return best;
}

static void partial_range(uint32_t acc, int rem, int len, uint32_t *lo, uint32_t *hi);

/* partial_D of the character cut at (acc, rem, len), memoized: a walk meets
 * the same cut (the first bytes of a CJK character, say) under thousands of
 * tokens. A failed insert only costs the next lookup. */
static int32_t cut_D(struct grammar_state *st, int32_t set, uint32_t acc, int rem, int len)
{
    uint64_t key = (uint64_t)(uint32_t)set << 32 | (uint32_t)len << 28 | (uint32_t)rem << 24 | acc;
    int32_t D = table_get(&st->cut_D, key);
    if (D >= 0)
        return D;
    uint32_t lo, hi;
    partial_range(acc, rem, len, &lo, &hi);
    D = partial_D(st, set, lo, hi, rem);
    table_put(&st->cut_D, key, D);
    return D;
}

/* The code points a character with `len` bytes whose first bits are acc and
 * rem bytes still missing can become. */
static void partial_range(uint32_t acc, int rem, int len, uint32_t *lo, uint32_t *hi)
{
    static const uint32_t min_of[5] = {0, 0, 0x80, 0x800, 0x10000};
    *lo = acc << (6 * rem);
    *hi = *lo | ((1u << (6 * rem)) - 1);
    if (*lo < min_of[len])
        *lo = min_of[len];
    if (*hi > 0x10FFFF)
        *hi = 0x10FFFF;
    if (*lo >= 0xD800 && *hi <= 0xDFFF) /* ED A0..BF: only surrogates can follow */
        *hi = 0, *lo = 1;
}

/* Feed one byte to (acc, rem, len). Returns 1 with *cp when a character
 * completes, 0 when more bytes are needed, -1 for invalid UTF-8. */
static int utf8_feed(uint32_t *acc, int *rem, int *len, uint8_t b, uint32_t *cp)
{
    if (*rem == 0) {
        if (b < 0x80) {
            *cp = b;
            return 1;
        }
        if (b >= 0xC2 && b <= 0xDF) {
            *acc = b & 0x1Fu;
            *rem = 1;
        } else if (b >= 0xE0 && b <= 0xEF) {
            *acc = b & 0x0Fu;
            *rem = 2;
        } else if (b >= 0xF0 && b <= 0xF4) {
            *acc = b & 0x07u;
            *rem = 3;
        } else {
            return -1;
        }
        *len = *rem + 1;
        return 0;
    }
    if ((b & 0xC0) != 0x80)
        return -1;
    *acc = (*acc << 6) | (b & 0x3Fu);
    if (--*rem > 0) {
        /* reject early what can no longer be valid: overlong 3/4-byte forms, surrogates, > U+10FFFF */
        uint32_t lo, hi;
        partial_range(*acc, *rem, *len, &lo, &hi);
        return lo > hi ? -1 : 0;
    }
    static const uint32_t min_of[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (*acc < min_of[*len] || *acc > 0x10FFFF || (*acc >= 0xD800 && *acc <= 0xDFFF))
        return -1;
    *cp = *acc;
    return 1;
}

static uint64_t hash_words(uint64_t h, const void *p, size_t bytes)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < bytes; i++)
        h = (h ^ b[i]) * 0x100000001B3ull;
    return mix64(h);
}

/* What the masks of g's stack sets depend on: its elements, rules and
 * classes (not its rule names). Two compilations of one text are equal. */
static uint64_t grammar_fingerprint(const struct grammar *g)
{
    uint64_t h = 0xCBF29CE484222325ull;
    for (int32_t i = 0; i < g->n_elems; i++)
        h = mix64(h ^ ((uint64_t)g->elems[i].kind << 32 | (uint32_t)g->elems[i].arg));
    h = hash_words(h, g->alt_start, (size_t)g->rule_alt[g->n_rules] * sizeof *g->alt_start);
    h = hash_words(h, g->rule_alt, (size_t)(g->n_rules + 1) * sizeof *g->rule_alt);
    for (int32_t i = 0; i < g->n_classes; i++) {
        const struct gclass *c = &g->classes[i];
        h = hash_words(h, c->ascii, sizeof c->ascii);
        h = mix64(h ^ ((uint64_t)(uint32_t)c->n << 32) ^ ((uint64_t)c->neg << 63));
        h = hash_words(h, g->ranges + 2 * (size_t)c->first, (size_t)c->n * 2 * sizeof *g->ranges);
    }
    return mix64(h ^ (uint64_t)(uint32_t)g->root);
}

/* The key of set in the shared cache: the set's stacks by content, in any
 * order (node ids differ between states). */
static struct mask_key set_key(const struct grammar_state *st, int32_t set)
{
    struct mask_key k = {st->gkey, 0, 0};
    for (int32_t i = st->soff[set]; i < st->soff[set + 1]; i++) {
        k.lo += mix64(st->nh1[st->members[i]]);
        k.hi += mix64(st->nh2[st->members[i]] ^ 0x5851F42D4C957F2Dull);
    }
    return k;
}

static ks_status state_create(struct grammar *g, const struct grammar_vocab *v, int32_t max_tokens,
                               struct grammar_state **out)
{
    if (!g || !out)
        return ks_fail(KS_ERR_INVALID_ARG, "grammar_state_create: NULL argument");
    if (max_tokens > 0 && grammar_min_bytes(g) > max_tokens)
        return ks_fail(KS_ERR_RANGE,
                       "max_tokens %d is too small for the grammar: its shortest output is %d bytes, and completing it "
                       "is only guaranteed at one token per byte; raise max_tokens to at least %d",
                       max_tokens, grammar_min_bytes(g), grammar_min_bytes(g));
    struct grammar_state *st = calloc(1, sizeof *st);
    if (!st)
        return ks_fail(KS_ERR_NOMEM, "grammar: out of memory while matching");
    st->g = g;
    grammar_retain(g);
    st->v = v;
    st->remaining = max_tokens < 0 ? INT32_MAX : max_tokens;
    int32_t W = v ? v->max_len + 1 : 1;
    st->w_set = malloc((size_t)W * sizeof *st->w_set);
    st->w_acc = malloc((size_t)W * sizeof *st->w_acc);
    st->w_rem = malloc((size_t)W);
    st->w_len = malloc((size_t)W);
    st->scratch = v ? calloc(((size_t)v->n_vocab + 63) / 64, sizeof *st->scratch) : NULL;
    st->cap_nodes = 1024;
    st->npos = malloc((size_t)st->cap_nodes * sizeof *st->npos);
    st->nparent = malloc((size_t)st->cap_nodes * sizeof *st->nparent);
    st->nD = malloc((size_t)st->cap_nodes * sizeof *st->nD);
    st->nh1 = malloc((size_t)st->cap_nodes * sizeof *st->nh1);
    st->nh2 = malloc((size_t)st->cap_nodes * sizeof *st->nh2);
    if (!st->w_set || !st->w_acc || !st->w_rem || !st->w_len || (v && !st->scratch) || !st->npos || !st->nparent ||
        !st->nD || !st->nh1 || !st->nh2 || !sets_grow(st, 2) || !set_slots_grow(st)) {
        grammar_state_free(st);
        return ks_fail(KS_ERR_NOMEM, "grammar: out of memory while matching");
    }
    /* node 0: the empty stack (not in the node table: (0, 0) is a real stack) */
    st->npos[COMPLETE] = -1;
    st->nparent[COMPLETE] = COMPLETE;
    st->nD[COMPLETE] = 0;
    st->nh1[COMPLETE] = st->nh2[COMPLETE] = 0;
    st->n_nodes = 1;
    st->gkey = v ? grammar_fingerprint(g) : 0;
    /* set 0: the empty set (not in the set table: interning nothing gives DEAD) */
    st->soff[0] = st->soff[1] = 0;
    st->shash[0] = 0;
    st->sD[0] = GRAMMAR_INF;
    st->sascii[0] = NULL;
    st->smask[0] = NULL;
    st->smaskD[0] = 0;
    st->sloop[0] = 0;
    st->n_sets = 1;
    st->n_tmp = 0;
    st->expand_work = 0;
    bool ok = true;
    for (int32_t a = g->rule_alt[g->root]; ok && a < g->rule_alt[g->root + 1]; a++)
        ok = expand(st, g->alt_start[a], COMPLETE, 0);
    int32_t init = ok ? set_intern(st) : -1;
    if (init < 0) {
        ks_status s = st->err;
        grammar_state_free(st);
        return s;
    }
    st->cur = st->init = init;
    *out = st;
    return KS_OK;
}

void grammar_state_free(struct grammar_state *st)
{
    if (!st)
        return;
    for (int32_t s = 0; s < st->n_sets; s++) {
        free(st->sascii[s]);
        free(st->smask[s]);
    }
    free(st->npos);
    free(st->nparent);
    free(st->nD);
    free(st->nh1);
    free(st->nh2);
    table_free(&st->node_tab);
    free(st->soff);
    free(st->members);
    free(st->shash);
    free(st->sD);
    free(st->sascii);
    free(st->smask);
    free(st->smaskD);
    free(st->sloop);
    free(st->set_slots);
    table_free(&st->trans);
    table_free(&st->cut_D);
    free(st->tmp);
    free(st->scratch);
    free(st->w_set);
    free(st->w_acc);
    free(st->w_rem);
    free(st->w_len);
    if (st->lazy)
        free(st->lazy->pending);
    free(st->lazy);
    grammar_free(st->g);
    free(st);
}

static bool set_complete(const struct grammar_state *st, int32_t set)
{
    return set != DEAD && st->members[st->soff[set]] == COMPLETE; /* sorted: node 0 comes first */
}

bool grammar_complete(const struct grammar_state *st)
{
    return st->prem == 0 && set_complete(st, st->cur);
}

/* ---- masking ---------------------------------------------------------------------------- */

/* The set after drawing token id as a token terminal <[id]>: DEAD when no
 * stack takes it here (or a character is cut), -1 on error. */
static int32_t step_token(struct grammar_state *st, int32_t id)
{
    bool terminal = false;
    for (int32_t k = 0; k < st->g->n_tokens && !terminal; k++)
        terminal = st->g->tokens[k] == id;
    return terminal && !st->prem ? step(st, st->cur, GRAMMAR_TOKEN_CP(id)) : DEAD;
}

/* Allow the tokens of the <[N]> terminals that may come next within budget
 * (the trie holds only text tokens). *worst grows to their D; with entries,
 * those whose D is not the current set's join the block's list (see walk). */
static ks_status allow_token_terminals(struct grammar_state *st, int32_t budget, uint64_t *mask, int32_t *worst,
                                       uint64_t *entries, uint64_t *n_list)
{
    const struct grammar_vocab *v = st->v;
    int32_t base = st->sD[st->cur];
    for (int32_t k = 0; k < st->g->n_tokens; k++) {
        int32_t id = st->g->tokens[k];
        if (id >= v->n_vocab || v->kind[id] == GRAMMAR_TOKEN_EOG)
            continue;
        int32_t set = step_token(st, id);
        if (set < 0)
            return st->err;
        int32_t D = st->sD[set];
        if (set == DEAD || D > budget)
            continue;
        mask[id >> 6] |= 1ull << (id & 63);
        if (entries && D != base && (*n_list)++ < LIST_MAX)
            entries[*n_list - 1] = (uint64_t)(uint32_t)id << 32 | (uint32_t)D;
        if (D > *worst)
            *worst = D;
    }
    return KS_OK;
}

/* Does class c treat every plain code point alike: all in (1), all out (0),
 * or mixed (-1)? */
static int plain_uniform(const struct grammar *g, const struct gclass *c)
{
    struct gclass complement = *c;
    complement.neg = !c->neg;
    bool some_in = false, some_out = false;
    for (int i = 0; i < N_PLAIN_RANGES; i++) {
        some_in |= gclass_intersects(g, c, PLAIN_RANGES[i][0], PLAIN_RANGES[i][1]);
        some_out |= c->token || gclass_intersects(g, &complement, PLAIN_RANGES[i][0], PLAIN_RANGES[i][1]);
    }
    return some_in && some_out ? -1 : some_in;
}

/* Is set a loop on plain characters (every one of them leads back to it)?
 * When each stack's class takes all or none of them, every plain character
 * steps to the same set, so one step decides. Memoized; -1 on error. */
static int plain_loop(struct grammar_state *st, int32_t set)
{
    if (st->sloop[set] >= 0)
        return st->sloop[set];
    const struct grammar *g = st->g;
    bool uniform = true;
    for (int32_t i = st->soff[set]; i < st->soff[set + 1] && uniform; i++) {
        int32_t m = st->members[i];
        uniform = m == COMPLETE || plain_uniform(g, &g->classes[g->elems[st->npos[m]].arg]) >= 0;
    }
    int32_t next = uniform ? step(st, set, 'a') : DEAD;
    if (next < 0)
        return -1;
    st->sloop[set] = (int8_t)(next == set);
    return st->sloop[set];
}

/* Walk the trie from the current set and partial character; set the bit of
 * every token allowed with at most `budget` bytes left to complete after it
 * (GRAMMAR_INF: no budget). *maxD receives the largest such D. With list
 * (a whole character, no budget), mask is a block (see LIST_MAX) and its list
 * is filled too. */
static ks_status walk(struct grammar_state *st, int32_t budget, uint64_t *mask, int32_t *maxD, bool list)
{
    const struct grammar_vocab *v = st->v;
    size_t words = ((size_t)v->n_vocab + 63) / 64;
    memset(mask, 0, words * sizeof *mask);
    st->walks++;
    int32_t worst = 0, base = st->sD[st->cur];
    uint64_t n_list = 0, *entries = list ? mask + words + 1 : NULL;
    st->w_set[0] = st->cur;
    st->w_acc[0] = st->pacc;
    st->w_rem[0] = (int8_t)st->prem;
    st->w_len[0] = (int8_t)st->plen;
    int loop = v->plain_skip && st->prem == 0 ? plain_loop(st, st->cur) : 0;
    if (loop < 0)
        return st->err;
    if (loop && base < GRAMMAR_INF && base <= budget) {
        for (size_t w = 0; w < words; w++)
            mask[w] |= v->plain[w];
        worst = v->n_plain ? base : 0; /* D of a plain token: the set's own, so off the list */
    }
    for (int32_t i = 1; i < v->n_nodes;) {
        if (loop && v->plain_sub[i]) {
            i = v->end[i];
            continue;
        }
        int d = v->depth[i];
        int32_t set = st->w_set[d - 1];
        uint32_t acc = st->w_acc[d - 1], cp = 0;
        int rem = st->w_rem[d - 1], len = st->w_len[d - 1];
        int r = utf8_feed(&acc, &rem, &len, v->byte[i], &cp);
        int32_t D = GRAMMAR_INF;
        if (r == 1) {
            set = step(st, set, cp);
            if (set < 0)
                return st->err;
            D = st->sD[set];
        } else if (r == 0) {
            D = cut_D(st, set, acc, rem, len);
        }
        if (r < 0 || D >= GRAMMAR_INF) {
            i = v->end[i]; /* nothing under this prefix */
            continue;
        }
        st->w_set[d] = set;
        st->w_acc[d] = acc;
        st->w_rem[d] = (int8_t)rem;
        st->w_len[d] = (int8_t)len;
        if (v->tok_head[i] >= 0 && D <= budget) {
            for (int32_t t = v->tok_head[i]; t >= 0; t = v->tok_next[t]) {
                mask[t >> 6] |= 1ull << (t & 63);
                if (list && D != base && n_list++ < LIST_MAX)
                    entries[n_list - 1] = (uint64_t)(uint32_t)t << 32 | (uint32_t)D;
            }
            if (D > worst)
                worst = D;
        }
        i++;
    }
    if (grammar_complete(st))
        for (int32_t k = 0; k < v->n_eog; k++)
            mask[v->eog[k] >> 6] |= 1ull << (v->eog[k] & 63); /* D 0 = base: complete */
    ks_status s = allow_token_terminals(st, budget, mask, &worst, entries, &n_list);
    if (list)
        mask[words] = n_list;
    *maxD = worst;
    return s;
}

/* Words of a block whose bitset has `words` words. */
static size_t block_words(const uint64_t *block, size_t words)
{
    return words + 1 + (block[words] <= LIST_MAX ? block[words] : 0);
}

/* The mask under budget from set's block: the tokens off the list keep the
 * set's own D (base). False when the list overflowed (walk instead). */
static bool budget_mask(const uint64_t *block, size_t words, int32_t base, int32_t budget, uint64_t *out)
{
    uint64_t n = block[words];
    const uint64_t *entries = block + words + 1;
    if (n > LIST_MAX)
        return false;
    if (budget >= base)
        memcpy(out, block, words * sizeof *out);
    else
        memset(out, 0, words * sizeof *out);
    for (uint64_t i = 0; i < n; i++) {
        uint32_t t = (uint32_t)(entries[i] >> 32);
        int32_t D = (int32_t)(uint32_t)entries[i];
        if (D > budget)
            out[t >> 6] &= ~(1ull << (t & 63));
        else
            out[t >> 6] |= 1ull << (t & 63);
    }
    return true;
}

/* The full mask (no budget) of the current set: another state's copy from
 * the vocabulary's cache, or a walk whose result goes there. */
static ks_status shared_or_walk(struct grammar_state *st, int32_t set, uint64_t *mask, int32_t *maxD)
{
    const struct grammar_vocab *v = st->v;
    size_t words = ((size_t)v->n_vocab + 63) / 64;
    struct mask_key key = set_key(st, set);
    if (gmask_cache_get(v->masks, &key, mask, maxD)) {
        st->shared_hits++;
        return KS_OK;
    }
    ks_status s = walk(st, GRAMMAR_INF, mask, maxD, true);
    if (!s)
        gmask_cache_put(v->masks, &key, mask, block_words(mask, words), *maxD);
    return s;
}

static bool mask_any(const uint64_t *mask, size_t words)
{
    for (size_t i = 0; i < words; i++)
        if (mask[i])
            return true;
    return false;
}

static ks_status mask_logits(struct grammar_state *st, float *logits, int32_t n_logits)
{
    if (!st->v)
        return ks_fail(KS_ERR_STATE, "grammar_mask: the state has no vocabulary");
    if (st->lazy && st->lazy->waiting)
        return KS_OK; /* free text until a trigger */
    const struct grammar_vocab *v = st->v;
    size_t words = ((size_t)v->n_vocab + 63) / 64;
    const uint64_t *mask = NULL;
    if (st->done) {
        memset(st->scratch, 0, words * sizeof *st->scratch);
        for (int32_t k = 0; k < v->n_eog; k++)
            st->scratch[v->eog[k] >> 6] |= 1ull << (v->eog[k] & 63);
        mask = st->scratch;
    } else if (st->remaining <= 0) {
        return ks_fail(KS_ERR_STATE, "grammar: the token budget is spent");
    } else {
        /* after this token, remaining - 1 tokens are left, one byte each at worst */
        int32_t budget = st->remaining - 1;
        if (st->prem == 0) {
            int32_t set = st->cur;
            if (!st->smask[set]) {
                uint64_t *m = malloc((words + 1 + LIST_MAX) * sizeof *m);
                if (!m)
                    return oom();
                int32_t maxD = 0;
                ks_status s = shared_or_walk(st, set, m, &maxD);
                if (s) {
                    free(m);
                    return s;
                }
                size_t size = block_words(m, words) * sizeof *m;
                uint64_t *fit = realloc(m, size);
                m = fit ? fit : m;
                if (st->mask_bytes + size > MASK_CACHE_BYTES) {
                    for (int32_t k = 0; k < st->n_sets; k++) {
                        free(st->smask[k]);
                        st->smask[k] = NULL;
                    }
                    st->mask_bytes = 0;
                }
                st->smask[set] = m;
                st->smaskD[set] = maxD;
                st->mask_bytes += size;
            }
            if (st->smaskD[set] <= budget)
                mask = st->smask[set];
            else if (budget_mask(st->smask[set], words, st->sD[set], budget, st->scratch))
                mask = st->scratch;
        }
        if (!mask) {
            int32_t maxD;
            ks_status s = walk(st, budget, st->scratch, &maxD, false);
            if (s)
                return s;
            mask = st->scratch;
        }
    }
    if (!mask_any(mask, words))
        return ks_fail(KS_ERR_STATE, "grammar: no token of the vocabulary can continue the text (the vocabulary "
                                     "cannot spell what the grammar needs next)");
    /* a word at a time: masks are mostly runs of all-allowed or all-refused tokens */
    int32_t n = n_logits < v->n_vocab ? n_logits : v->n_vocab;
    for (int32_t base = 0; base < n; base += 64) {
        uint64_t m = mask[base >> 6];
        int32_t len = n - base < 64 ? n - base : 64;
        if (m == ~0ull)
            continue;
        if (m == 0) {
            for (int32_t j = 0; j < len; j++)
                logits[base + j] = -INFINITY;
            continue;
        }
#ifdef __AVX512F__
        if (len == 64) {
            const __m512 ninf = _mm512_set1_ps(-INFINITY);
            for (int j = 0; j < 64; j += 16)
                _mm512_mask_storeu_ps(logits + base + j, (__mmask16)(~(m >> j) & 0xFFFFu), ninf);
            continue;
        }
#endif
        for (int32_t j = 0; j < len; j++)
            if (!((m >> j) & 1))
                logits[base + j] = -INFINITY;
    }
    for (int32_t i = n; i < n_logits; i++)
        logits[i] = -INFINITY;
    return KS_OK;
}

/* ---- accepting -------------------------------------------------------------------------- */

static ks_status feed(struct grammar_state *st, const char *text, size_t len)
{
    int32_t set = st->cur;
    uint32_t acc = st->pacc;
    int rem = st->prem, plen = st->plen;
    for (size_t i = 0; i < len; i++) {
        uint32_t cp;
        int r = utf8_feed(&acc, &rem, &plen, (uint8_t)text[i], &cp);
        if (r < 0)
            return ks_fail(KS_ERR_INVALID_ARG, "grammar: invalid UTF-8 at byte %zu", i);
        if (r == 0)
            continue;
        set = step(st, set, cp);
        if (set < 0)
            return st->err;
        if (set == DEAD)
            return ks_fail(KS_ERR_INVALID_ARG, "grammar: the text does not match at byte %zu (character U+%04X)", i,
                           cp);
    }
    if (rem > 0) {
        uint32_t lo, hi;
        partial_range(acc, rem, plen, &lo, &hi);
        if (partial_D(st, set, lo, hi, rem) >= GRAMMAR_INF)
            return ks_fail(KS_ERR_INVALID_ARG, "grammar: the text ends in a character the grammar cannot take");
    }
    st->cur = set;
    st->pacc = acc;
    st->prem = rem;
    st->plen = plen;
    return KS_OK;
}

static ks_status accept_text(struct grammar_state *st, const char *text, size_t len)
{
    if (st->done)
        return ks_fail(KS_ERR_INVALID_ARG, "grammar: text after the end of generation");
    return feed(st, text, len);
}

static ks_status lazy_accept(struct grammar_state *st, int32_t token);

static ks_status accept_token(struct grammar_state *st, int32_t token)
{
    const struct grammar_vocab *v = st->v;
    if (!v || token < 0 || token >= v->n_vocab)
        return ks_fail(KS_ERR_INVALID_ARG, "grammar: token %d is outside the vocabulary", token);
    if (st->lazy && st->lazy->waiting)
        return lazy_accept(st, token);
    if (st->remaining <= 0 && !st->done)
        return ks_fail(KS_ERR_INVALID_ARG, "grammar: token %d is past the token budget", token);
    if (v->kind[token] == GRAMMAR_TOKEN_EOG) {
        if (!st->done && !grammar_complete(st))
            return ks_fail(KS_ERR_INVALID_ARG, "grammar: end of generation (token %d) before the text is complete",
                           token);
        st->done = true;
        return KS_OK;
    }
    if (st->done)
        return ks_fail(KS_ERR_INVALID_ARG, "grammar: token %d after the end of generation", token);
    int32_t as_terminal = step_token(st, token);
    if (as_terminal < 0)
        return st->err;
    if (as_terminal != DEAD) { /* a <[token]> terminal comes next */
        st->cur = as_terminal;
        st->remaining--;
        return KS_OK;
    }
    if (v->kind[token] != GRAMMAR_TOKEN_TEXT)
        return ks_fail(KS_ERR_INVALID_ARG, "grammar: special token %d is not allowed here (only a <[%d]> terminal "
                                           "takes it)", token, token);
    ks_status s = feed(st, v->blob + v->off[token], v->off[token + 1] - v->off[token]);
    if (!s)
        st->remaining--;
    return s;
}

bool grammar_match(struct grammar *g, const char *text, size_t len)
{
    struct grammar_state *st;
    if (grammar_state_create(g, NULL, -1, &st))
        return false;
    bool ok = grammar_accept_text(st, text, len) == KS_OK;
    if (ok && !grammar_complete(st)) {
        ks_fail(KS_ERR_INVALID_ARG, "grammar: the text is a prefix of the language but does not complete it");
        ok = false;
    }
    grammar_state_free(st);
    return ok;
}

bool grammar_match_ended(struct grammar *g, const char *text, size_t len)
{
    struct grammar_state *st;
    if (grammar_state_create(g, NULL, -1, &st))
        return false;
    bool ok = grammar_accept_text(st, text, len) == KS_OK && grammar_complete(st) &&
              st->soff[st->cur + 1] - st->soff[st->cur] == 1; /* COMPLETE alone: nothing may follow */
    grammar_state_free(st);
    return ok;
}

uint64_t grammar_state_walks(const struct grammar_state *st)
{
    return st->walks;
}

uint64_t grammar_state_shared_hits(const struct grammar_state *st)
{
    return st->shared_hits;
}

/* ---- the public calls that change a state, each checked in Debug builds ------------------ */

ks_status grammar_state_create(struct grammar *g, const struct grammar_vocab *v, int32_t max_tokens,
                               struct grammar_state **out)
{
    ks_status s = state_create(g, v, max_tokens, out);
    if (!s)
        GRAMMAR_DEBUG_CHECK(*out, "grammar_state_create");
    return s;
}

ks_status grammar_mask(struct grammar_state *st, float *logits, int32_t n_logits)
{
    ks_status s = mask_logits(st, logits, n_logits);
    GRAMMAR_DEBUG_CHECK(st, "grammar_mask");
    return s;
}

ks_status grammar_accept_text(struct grammar_state *st, const char *text, size_t len)
{
    ks_status s = accept_text(st, text, len);
    GRAMMAR_DEBUG_CHECK(st, "grammar_accept_text");
    return s;
}

ks_status grammar_accept(struct grammar_state *st, int32_t token)
{
    ks_status s = accept_token(st, token);
    GRAMMAR_DEBUG_CHECK(st, "grammar_accept");
    return s;
}

/* ---- invariants ---------------------------------------------------------------------------- */

static ks_status check_nodes(const struct grammar_state *st)
{
    if (st->n_nodes < 1 || st->n_nodes > st->cap_nodes || st->n_nodes > MAX_NODES)
        return ks_fail(KS_ERR_INTERNAL, "grammar state: %d stack nodes (room %d, limit %d)", st->n_nodes,
                       st->cap_nodes, MAX_NODES);
    if (st->npos[COMPLETE] != -1 || st->nparent[COMPLETE] != COMPLETE || st->nD[COMPLETE] != 0)
        return ks_fail(KS_ERR_INTERNAL, "grammar state: node 0 is not the empty stack");
    for (int32_t i = 1; i < st->n_nodes; i++)
        if (st->nparent[i] < 0 || st->nparent[i] >= i || st->npos[i] < 0 || st->npos[i] >= st->g->n_elems ||
            st->nD[i] < 0)
            return ks_fail(KS_ERR_INTERNAL, "grammar state: node %d (position %d of %d, parent %d, D %d)", i,
                           st->npos[i], st->g->n_elems, st->nparent[i], st->nD[i]);
    return KS_OK;
}

/* Set 0 is empty, every other set a sorted run of distinct nodes, and every
 * set but 0 is in the interning table once. */
static ks_status check_sets(const struct grammar_state *st)
{
    if (st->n_sets < 1 || st->n_sets >= st->cap_sets || st->n_sets > MAX_SETS || st->soff[0] != 0 ||
        st->soff[1] != 0 || st->soff[st->n_sets] != st->n_members || st->n_members > st->cap_members)
        return ks_fail(KS_ERR_INTERNAL, "grammar state: %d sets (room %d) of %d members (room %d)", st->n_sets,
                       st->cap_sets, st->n_members, st->cap_members);
    for (int32_t s = 1; s < st->n_sets; s++) {
        int32_t a = st->soff[s], b = st->soff[s + 1];
        if (b <= a || b - a > GRAMMAR_MAX_STACKS)
            return ks_fail(KS_ERR_INTERNAL, "grammar state: set %d has %d stacks (1..%d)", s, b - a,
                           GRAMMAR_MAX_STACKS);
        for (int32_t m = a; m < b; m++)
            if (st->members[m] < 0 || st->members[m] >= st->n_nodes || (m > a && st->members[m] <= st->members[m - 1]))
                return ks_fail(KS_ERR_INTERNAL, "grammar state: set %d is not sorted distinct nodes", s);
    }
    uint32_t in_table = 0;
    for (uint32_t i = 0; i < st->set_cap; i++)
        in_table += st->set_slots[i] >= 0;
    if (in_table != (uint32_t)st->n_sets - 1 || 2 * (uint64_t)st->n_sets > st->set_cap)
        return ks_fail(KS_ERR_INTERNAL, "grammar state: %u of %d sets interned in %u slots", in_table, st->n_sets - 1,
                       st->set_cap);
    return KS_OK;
}

/* Where the text is, and the bytes of the masks the state keeps. */
static ks_status check_position(const struct grammar_state *st)
{
    bool overdrawn = st->remaining < 0 && !(st->lazy && st->lazy->waiting); /* waiting may outlast the budget */
    if (st->cur < 0 || st->cur >= st->n_sets || st->init < 0 || st->init >= st->n_sets || overdrawn)
        return ks_fail(KS_ERR_INTERNAL, "grammar state: at set %d from %d of %d, %d tokens left", st->cur, st->init,
                       st->n_sets, st->remaining);
    if (st->prem < 0 || st->prem > 3 || st->plen < 0 || st->plen > 4 || (st->prem > 0 && st->prem >= st->plen))
        return ks_fail(KS_ERR_INTERNAL, "grammar state: a cut character of %d bytes waits for %d", st->plen, st->prem);
    if (st->lazy && st->lazy->n_pending > GRAMMAR_MAX_TRIGGER_LEN + MAX_PIECE)
        return ks_fail(KS_ERR_INTERNAL, "grammar state: %zu bytes pending before a trigger", st->lazy->n_pending);
    size_t words = st->v ? ((size_t)st->v->n_vocab + 63) / 64 : 0, bytes = 0;
    int32_t n_masks = 0;
    for (int32_t s = 0; s < st->n_sets; s++)
        if (st->smask[s]) {
            bytes += block_words(st->smask[s], words) * sizeof *st->smask[s];
            n_masks++;
        }
    if (bytes != st->mask_bytes || (bytes > MASK_CACHE_BYTES && n_masks > 1))
        return ks_fail(KS_ERR_INTERNAL, "grammar state: %d cached masks of %zu bytes counted as %zu (limit %d)",
                       n_masks, bytes, st->mask_bytes, MASK_CACHE_BYTES);
    return KS_OK;
}

ks_status grammar_check(const struct grammar_state *st)
{
    ks_status s = check_nodes(st);
    if (!s)
        s = check_sets(st);
    if (!s)
        s = check_position(st);
    if (!s && st->v)
        s = gmask_cache_check(st->v->masks);
    return s;
}

#if KS_GRAMMAR_CHECK
static void grammar_debug_check(const struct grammar_state *st, const char *call)
{
    if (grammar_check(st)) {
        fprintf(stderr, "grammar: %s broke an invariant: %s\n", call, ks_errmsg());
        abort();
    }
}
#endif

/* ---- lazy: free text until a trigger ------------------------------------------------------ */

ks_status grammar_state_create_lazy(struct grammar *g, const struct grammar_vocab *v, int32_t max_tokens,
                                    const struct grammar_triggers *trig, struct grammar_state **out)
{
    if (!trig || trig->n < 1 || trig->n > GRAMMAR_MAX_TRIGGERS)
        return ks_fail(KS_ERR_INVALID_ARG, "grammar_state_create_lazy: 1 to %d triggers", GRAMMAR_MAX_TRIGGERS);
    for (int i = 0; i < trig->n; i++)
        if (trig->t[i].token < 0 && !memchr(trig->t[i].word, 0, GRAMMAR_MAX_TRIGGER_LEN))
            return ks_fail(KS_ERR_INVALID_ARG, "grammar_state_create_lazy: trigger %d is not a NUL-terminated word", i);
    struct grammar_state *st;
    ks_status s = grammar_state_create(g, v, -1, &st);
    if (s)
        return s;
    st->lazy = calloc(1, sizeof *st->lazy);
    if (!st->lazy || !(st->lazy->pending = malloc(GRAMMAR_MAX_TRIGGER_LEN + MAX_PIECE))) {
        grammar_state_free(st);
        return oom();
    }
    st->lazy->trig = *trig;
    st->lazy->waiting = true;
    st->lazy->max_tokens = max_tokens;
    *out = st;
    return KS_OK;
}

bool grammar_triggered(const struct grammar_state *st)
{
    return !st->lazy || !st->lazy->waiting;
}

/* Start constraining: the tokens left are the budget; false (still
 * waiting) when what is already there does not fit in it. */
static bool lazy_start(struct grammar_state *st)
{
    struct lazy *lz = st->lazy;
    st->remaining = lz->max_tokens < 0 ? INT32_MAX : lz->max_tokens - lz->drawn;
    if (st->remaining < 0 || st->sD[st->cur] > st->remaining)
        return false;
    lz->waiting = false;
    return true;
}

static bool is_trigger_token(const struct lazy *lz, int32_t token)
{
    for (int i = 0; i < lz->trig.n; i++)
        if (lz->trig.t[i].token == token)
            return true;
    return false;
}

/* The earliest trigger word in pending (an at_start word only after
 * whitespace alone), its offset in *at. */
static bool find_trigger_word(const struct lazy *lz, size_t *at)
{
    bool found = false;
    for (int i = 0; i < lz->trig.n; i++) {
        const char *w = lz->trig.t[i].word;
        size_t wl = lz->trig.t[i].token < 0 ? strlen(w) : 0;
        for (size_t k = 0; wl && k + wl <= lz->n_pending && (!found || k < *at); k++) {
            if (memcmp(lz->pending + k, w, wl))
                continue;
            bool blank = !lz->text_seen;
            for (size_t j = 0; j < k && blank; j++)
                blank = strchr(" \t\r\n", lz->pending[j]) != NULL;
            if (lz->trig.t[i].at_start && !blank)
                break;
            *at = k;
            found = true;
            break;
        }
    }
    return found;
}

/* Keep the tail of pending that may still begin a trigger word. */
static void lazy_trim(struct lazy *lz)
{
    size_t keep = GRAMMAR_MAX_TRIGGER_LEN - 1;
    if (lz->n_pending <= keep)
        return;
    size_t cut = lz->n_pending - keep;
    for (size_t j = 0; j < cut && !lz->text_seen; j++)
        lz->text_seen = !strchr(" \t\r\n", lz->pending[j]);
    memmove(lz->pending, lz->pending + cut, keep);
    lz->n_pending = keep;
}

static ks_status lazy_accept(struct grammar_state *st, int32_t token)
{
    struct lazy *lz = st->lazy;
    const struct grammar_vocab *v = st->v;
    if (v->kind[token] == GRAMMAR_TOKEN_EOG) {
        st->done = true;
        return KS_OK;
    }
    if (is_trigger_token(lz, token)) {
        if (lazy_start(st) && grammar_accept(st, token) == KS_OK)
            return KS_OK;
        lz->waiting = true; /* the grammar does not start with it (or the budget is short): free text goes on */
        lz->drawn++;
        return KS_OK;
    }
    lz->drawn++;
    if (v->kind[token] != GRAMMAR_TOKEN_TEXT)
        return KS_OK; /* control tokens are no text */
    size_t n = v->off[token + 1] - v->off[token];
    memcpy(lz->pending + lz->n_pending, v->blob + v->off[token], n);
    lz->n_pending += n;
    size_t at = 0;
    if (find_trigger_word(lz, &at)) {
        /* the text from the trigger on is the grammar's first text */
        if (feed(st, lz->pending + at, lz->n_pending - at) == KS_OK && lazy_start(st))
            return KS_OK;
        st->cur = st->init;
        st->pacc = 0;
        st->prem = st->plen = 0;
        lz->text_seen = true; /* that occurrence stays text */
        lz->n_pending = 0;
        return KS_OK;
    }
    lazy_trim(lz);
    return KS_OK;
}
