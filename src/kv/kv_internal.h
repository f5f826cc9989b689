/* kv internals shared by the kv module's files (and its tests). attn, the
 * only reader of pages, reads them through kv.h's page views.
 *
 * Page storage: K and V are separate allocations so that one half can be
 * requantized alone, and each half is two: the global layers' rows and the
 * sliding-window layers' rows (cfg.swa_window), so that the window part can
 * be freed alone once no query reaches it. Each part is laid out
 *     [layer slot][kv_head][token < P][row of head_dim in the half's type]
 * (kv->layer_slot: a layer's index among the layers of its part) so that
 * attention over one (layer, KV head) streams P contiguous rows. Rows are
 * stored after the Walsh-Hadamard rotation when cfg.rotate is set. */
#ifndef KS_KV_INTERNAL_H
#define KS_KV_INTERNAL_H

#include <assert.h>
#include <stdint.h>

#include "kv/kv.h"

/* Debug builds (no NDEBUG) run kv_check() after every public call that
 * changes the cache and abort with its message at the first broken
 * invariant, so a bug shows at the call that made it. -DKS_KV_CHECK=0 turns
 * that off in a Debug build, -DKS_KV_CHECK=1 on in any build. */
#ifndef KS_KV_CHECK
#ifdef NDEBUG
#define KS_KV_CHECK 0
#else
#define KS_KV_CHECK 1
#endif
#endif

/* A smoothed sequence's channel means, owned by its page 0 (kv_smooth.c).
 * Outside the budget, like the rest of a page's metadata. */
struct kv_mean {
    bool has_k, has_v;       /* which halves are stored minus their means */
    int32_t n_fixed;         /* layers whose means are fixed */
    uint64_t tag;            /* nonzero hash of mu once every layer is fixed, 0 before */
    bool *fixed;             /* (n_layer) */
    float *mu;               /* (n_layer, 2: K then V, n_kv_head, head_dim), stored (rotated) space */
};

/* A page slot is free (no storage), live (ref > 0) or idle (ref 0, keyed,
 * on the LRU list). */
struct kv_page {
    void *k, *v;             /* the global layers' rows, NULL for a free slot (allocated even without global layers) */
    void *kw, *vw;           /* the window layers' rows: NULL without window layers, and once freed */
    enum quant_type tk, tv;
    struct kv_mean *mean;    /* the sequence's channel means, on a smoothed sequence's page 0 only */
    uint64_t mean_tag;       /* keyed pages: the tag of the means its rows are stored against (0: none) */
    int32_t ref;             /* sequences whose table holds this page */
    uint64_t birth;          /* allocation order: the dynamic policy demotes oldest first */
    /* prefix cache; a keyed page is immutable */
    bool keyed;
    bool on_disk;            /* the SSD tier has it: no need to hand it to the hook */
    struct kv_key key, parent;
    int32_t *tokens;         /* (P) its token ids, while keyed */
    int32_t n_valid;         /* tokens it holds: P, or fewer for the tail of a finished sequence */
    int32_t lru_prev, lru_next; /* idle pages, least recently used first; -1 ends */
    uint64_t hits;           /* times a sequence mapped it from the cache */
    int64_t last_use_ms;     /* unix ms */
};

struct kv_seq {
    bool live;
    int32_t len;
    int32_t n_pages, cap_pages;
    int32_t *pages;          /* (n_pages) page ids, token t lives in pages[t / P] */
    struct kv_key *keys;     /* (cap_pages) chain keys of the first n_keyed pages */
    int32_t n_keyed;         /* pages whose key is known and whose publication was tried */
    struct kv_key root;      /* key_{-1} of its chain: 0, or its cache salt's root (kv_seq_set_salt) */
    /* sliding windows: no query of this sequence reads a window layer below swa_from again
     * ((len when its last growth began) - swa_window + 1, floored at 0); every page covering
     * [swa_from, len) holds its window rows, and pages [0, swa_scan) hold none */
    int32_t swa_from;
    int32_t swa_scan;
};

/* Open addressing (linear probing, backward-shift deletion): key -> page id. */
struct kv_map {
    int32_t *slots;          /* (cap) page id or -1 */
    uint32_t cap, n;         /* cap a power of two, n < cap / 2 */
};

struct kv_cache {
    struct kv_config cfg;
    int page_shift;          /* log2(P) */
    size_t used;             /* bytes of this cache's page storage, exact */
    struct kv_cache *peer;   /* the cache sharing this one's budget (kv_share_budget), NULL: none */

    struct kv_page *pages;   /* (n_page_slots) */
    int32_t n_page_slots, cap_page_slots;
    int32_t *free_slots;     /* (n_free_slots) ids of slots with ref 0 */
    int32_t n_free_slots, cap_free_slots;
    int32_t n_live_pages;
    uint64_t next_birth;

    struct kv_seq *seqs;     /* (n_seq_slots) */
    int32_t n_seq_slots;

    int64_t demotions, demotion_passes;
    float *scratch;          /* (head_dim) rotation scratch for kv_write */
    size_t row_bytes[QUANT_TYPE_COUNT]; /* quant_row_size(t, head_dim) of each KV type t, 0 for others */
    int n_window_layers;     /* layers whose rows live in a page's window part (0: no sliding window) */
    bool *layer_window;      /* (n_layer) in the window part */
    int32_t *layer_slot;     /* (n_layer) index among the layers of its part */
    int64_t window_frees;

    /* prefix cache, kv_prefix.c */
    struct kv_map map;
    int32_t lru_head, lru_tail;
    int32_t n_idle_pages;
    size_t idle_bytes;
    int64_t evictions, evicted_to_disk, attached_pages;
    kv_evict_fn evict_fn;
    void *evict_user;
    kv_evict_fn publish_fn;   /* kv_set_publish_hook: pages as they are keyed (the Redis tier) */
    void *publish_user;
    kv_key_fn key_fn;         /* kv_set_key_hook: full pages' keys gained and lost (KV events) */
    void *key_user;
    struct kv_key_layout key_layout; /* what besides the tokens goes into a page key, fixed at kv_create */
};

/* Does the page hold its window layers' rows (always without such layers)? */
static inline bool kv_page_has_window(const struct kv_cache *kv, const struct kv_page *pg)
{
    assert(!pg->kw == !pg->vw);
    return kv->n_window_layers == 0 || pg->kw != NULL;
}

/* First row of (layer, kv head) in the K (v false) or V half of a page; rows
 * follow with stride kv->row_bytes of the half's type. The layer's part
 * must be stored. */
static inline uint8_t *kv_page_rows(const struct kv_cache *kv, const struct kv_page *pg, bool v, int layer, int head)
{
    assert(layer >= 0 && layer < kv->cfg.n_layer && head >= 0 && head < kv->cfg.n_kv_head);
    enum quant_type t = v ? pg->tv : pg->tk;
    void *part = kv->layer_window[layer] ? (v ? pg->vw : pg->kw) : (v ? pg->v : pg->k);
    assert((unsigned)t < QUANT_TYPE_COUNT && kv->row_bytes[t] > 0 && part);
    size_t run = (size_t)kv->cfg.page_tokens * kv->row_bytes[t];
    return (uint8_t *)part + ((size_t)kv->layer_slot[layer] * (size_t)kv->cfg.n_kv_head + (size_t)head) * run;
}

/* Bytes drawn from kv's budget: its own pages and its peer's (kv_share_budget). */
static inline size_t kv_pool_used(const struct kv_cache *kv)
{
    return kv->used + (kv->peer ? kv->peer->used : 0);
}

/* ---- invariants, kv.c ------------------------------------------------------ */

#if KS_KV_CHECK
/* kv_check(kv), and abort naming call when an invariant is broken. */
void kv_debug_check(const struct kv_cache *kv, const char *call);
#define KV_DEBUG_CHECK(kv, call) kv_debug_check(kv, call)
#else
#define KV_DEBUG_CHECK(kv, call) ((void)0)
#endif

/* Page id of seq's page idx (idx within its table). */
static inline int32_t kv_seq_page_id(const struct kv_cache *kv, const struct kv_seq *s, int32_t idx)
{
    assert(idx >= 0 && idx < s->n_pages && s->n_pages <= s->cap_pages);
    int32_t id = s->pages[idx];
    assert(id >= 0 && id < kv->n_page_slots && kv->pages[id].ref > 0);
    (void)kv;
    return id;
}

/* ---- pool helpers, kv.c --------------------------------------------------- */

/* KS_ERR_INVALID_ARG unless t is a KV type usable with this head_dim. */
ks_status kv_check_type(const struct kv_config *cfg, enum quant_type t, const char *what);
/* KS_ERR_INVALID_ARG unless cfg's ladder is in falling precision and, when
 * usable, every level works with this head_dim (kv_create tolerates levels
 * that do not, as it tolerates such a floor: the policy skips them). An empty
 * ladder (n_ladder 0) means the default one. */
ks_status kv_check_ladder(const struct kv_config *cfg, bool usable);
/* Bytes of one half's rows of every layer (both parts). */
size_t kv_half_bytes(const struct kv_config *cfg, enum quant_type t);
/* Bytes of one half's rows of the global (window false) or window layers. */
size_t kv_part_bytes(const struct kv_cache *kv, enum quant_type t, bool window);
/* Zeroed storage for one half's part; NULL when the host is out of memory. */
void *kv_part_alloc(const struct kv_cache *kv, enum quant_type t, bool window);
/* The bytes page pg holds now (its window part only while stored); _as: were its halves of types tk / tv. */
size_t kv_page_size(const struct kv_cache *kv, const struct kv_page *pg);
size_t kv_page_size_as(const struct kv_cache *kv, const struct kv_page *pg, enum quant_type tk, enum quant_type tv);
/* The first position a sequence of len tokens may still read in a window layer. */
static inline int32_t kv_window_start(const struct kv_cache *kv, int32_t len)
{
    int32_t from = len - kv->cfg.swa_window + 1;
    return kv->n_window_layers && from > 0 ? from : 0;
}
/* Do the pages covering [kv_window_start(len), len) of a table made of s's
 * pages followed by more[] hold their window rows? */
bool kv_seq_window_intact(const struct kv_cache *kv, const struct kv_seq *s, const int32_t *more, int32_t len);

/* ---- pool, kv.c ---------------------------------------------------------- */

/* A page of types (tk, tv) with ref 1; the caller has checked the budget. */
ks_status kv_page_new(struct kv_cache *kv, enum quant_type tk, enum quant_type tv, int32_t *id_out);
/* Free an unreferenced page's storage and slot (its key must be gone). */
void kv_page_release(struct kv_cache *kv, int32_t id);
ks_status kv_seq_reserve_table(struct kv_seq *s, int32_t n_pages);

/* Copy-on-write: give seq its own copy of page idx when it is shared or keyed. */
ks_status kv_page_make_private(struct kv_cache *kv, struct kv_seq *s, int32_t idx);

/* ---- smoothing, kv_smooth.c ------------------------------------------------ */

size_t kv_mean_floats(const struct kv_config *cfg);
/* Zeroed means, none fixed; NULL when the host is out of memory. */
struct kv_mean *kv_mean_new(const struct kv_config *cfg, bool has_k, bool has_v);
struct kv_mean *kv_mean_clone(const struct kv_config *cfg, const struct kv_mean *m);
void kv_mean_free(struct kv_mean *m);
/* Means of every layer given (from a blob): all fixed, tag computed. */
void kv_mean_fix_all(const struct kv_config *cfg, struct kv_mean *m);
/* The head_dim means of (layer, half, head); NULL when that half is not smoothed. */
const float *kv_mean_row(const struct kv_config *cfg, const struct kv_mean *m, int layer, int half, int head);
/* The means seq's pages are stored against (its page 0's), NULL for none. */
const struct kv_mean *kv_seq_means(const struct kv_cache *kv, const struct kv_seq *s);
/* Their tag, 0 for none: a keyed page is mapped past page 0 only into a
 * sequence with its tag. */
uint64_t kv_seq_mean_tag(const struct kv_cache *kv, const struct kv_seq *s);
/* Before writing rows [pos, pos + n) of one layer (k, v as kv_write_rows):
 * fix the layer's means on page 0 if they are not yet, from the rows that
 * land in page 0 when pos is 0 (a new sequence's first write), as zeros
 * otherwise. Nothing for a sequence without means unless cfg.smooth starts
 * them at pos 0. KS_ERR_NOMEM, or a copy-on-write's error. */
ks_status kv_seq_fix_means(struct kv_cache *kv, struct kv_seq *s, int layer, int32_t pos, int32_t n, const float *k,
                           const float *v);

/* ---- prefix cache, kv_prefix.c ------------------------------------------- */

/* ref went 0 -> 1 (idle page mapped again) or 1 -> 0 (a keyed page released). */
void kv_prefix_take(struct kv_cache *kv, int32_t id);
void kv_prefix_park(struct kv_cache *kv, int32_t id);
/* Reclaim idle pages, least recently used first, until used + bytes <= goal
 * or none is left. */
void kv_prefix_evict(struct kv_cache *kv, size_t bytes, size_t goal);
void kv_prefix_free(struct kv_cache *kv);
ks_status kv_prefix_check(const struct kv_cache *kv);

/* ---- policy, kv_policy.c ---------------------------------------------------- */

/* Make room for an allocation of bytes: the static policy evicts idle cached
 * pages when the budget needs them; the dynamic one, when used + bytes
 * crosses the high watermark, demotes idle cached pages, then evicts them,
 * then demotes the oldest demotable pages in use, until used + bytes is under
 * the low watermark or nothing is left to do. KS_ERR_KV_FULL when used +
 * bytes still exceeds the budget. */
ks_status kv_policy_make_room(struct kv_cache *kv, size_t bytes);

/* The pages a sequence is about to grow by: page first_page + i gets types
 * tk[i] / tv[i] (the start precision on entry). */
struct kv_grow_plan {
    int32_t seq;
    int32_t new_len;          /* the sequence's length after the growth */
    int32_t first_page, n_pages;
    enum quant_type *tk, *tv; /* (n_pages) */
};
/* kv_policy_make_room() for the plan's pages. The dynamic policy treats the
 * planned pages that lie outside the sinks and hot window at new_len as its
 * newest candidates and lowers their types in the plan, so they are created
 * at the precision it would give them; pages of seq that leave the hot window
 * with this growth are candidates too. */
ks_status kv_policy_plan_grow(struct kv_cache *kv, struct kv_grow_plan *plan);
/* Page `page` of a sequence of len tokens lies in its sinks or hot window. */
bool kv_policy_page_protected(const struct kv_config *c, int32_t page, int32_t len);

/* Convert the halves of n pages (ids) to tk / tv (KV_TYPE_KEEP: unchanged),
 * all or nothing: new storage for every page is allocated before any page
 * changes. The caller has checked types and the budget. */
ks_status kv_convert_pages(struct kv_cache *kv, const int32_t *ids, int32_t n, enum quant_type tk,
                           enum quant_type tv);

/* Rows are dequantized by quant's traits (quant_traits(t)->to_float) and
 * quantized by kv_row_quantizer: quant's reference quantizers' bytes (what
 * llama.cpp would store) without cfg.scale_search, its KV quantizers (the same
 * block format, a scale chosen per block by least squared error) with it. The
 * rotation, kv_rotate (kv.h), is in kv_rotate.c. */
static inline quant_from_float_fn kv_row_quantizer(const struct kv_cache *kv, enum quant_type t)
{
    const struct quant_traits *tr = quant_traits(t);
    assert(tr && tr->from_float);
    return kv->cfg.scale_search && tr->kv_from_float ? tr->kv_from_float : tr->from_float;
}

#endif
