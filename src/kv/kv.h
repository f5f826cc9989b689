/* kv: the elastic KV cache. A pool of fixed-size pages (P tokens of one
 * sequence, K and V for every layer) allocated on demand from one memory
 * budget. Each page has its own K and V precision (f32, f16, q8_0, q4_0);
 * pages can be requantized live, and a dynamic policy demotes old pages as
 * the pool fills. The kv module knows nothing about HTTP or the model.
 *
 * Token data enters through kv_write() as f32 rows of n_kv_head * head_dim
 * values and is read only by the attn module (attn/attn.h), which walks a
 * sequence's page table in place.
 *
 * Sequence protocol, used by model_forward():
 *   kv_seq_grow(seq, n)  make positions [len, len+n) writable and set len += n
 *                        (all or nothing; KS_ERR_KV_FULL when the budget and
 *                        the precision floor are exhausted)
 *   kv_write(layer, seq, pos, k, v)  for every pos < len and every layer
 *   kv_seq_truncate(seq, len)        drop tokens at the end (chat edits)
 * A cache is not thread-safe: one caller (the scheduler thread) uses it; the
 * attn module may read it from the thread pool during attn_forward(). */
#ifndef KS_KV_H
#define KS_KV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "quant/quant.h"
#include "status/status.h"
#include "threads/threads.h"

struct kv_cache;

enum kv_policy {
    KV_POLICY_STATIC = 0,  /* every page at type_k / type_v, like llama.cpp -ctk/-ctv */
    KV_POLICY_DYNAMIC = 1, /* sinks + hot window at type_k/type_v, older pages step down */
};

struct kv_config {
    int n_layer;
    int n_kv_head;
    int head_dim;
    size_t mem_budget;        /* bytes for page storage; exact accounting */
    int page_tokens;          /* P: power of two in [16, 256]; default 32 */
    enum quant_type type_k;   /* start precision of new pages: F32, F16, Q8_0, Q4_0 */
    enum quant_type type_v;
    bool rotate;              /* Walsh-Hadamard rotation of K/V over head_dim (default on) */
    enum kv_policy policy;
    int sink_tokens;          /* dynamic: first S tokens kept at start precision (32) */
    int hot_tokens;           /* dynamic: most recent W tokens kept (512) */
    float high_watermark;     /* dynamic: start demoting above this usage ratio (0.90) */
    float low_watermark;      /* dynamic: stop demoting below this (0.80) */
    enum quant_type floor;    /* dynamic: lowest precision (Q4_0) */
};

/* Fill defaults: P=32, f16/f16, rotate on, static policy, S=32, W=512,
 * watermarks 0.90/0.80, floor q4_0. Shape and budget are left for the caller. */
void kv_config_default(struct kv_config *cfg);

/* KS_ERR_INVALID_ARG names the bad field (e.g. q4_0 with head_dim 8). */
ks_status kv_create(const struct kv_config *cfg, struct kv_cache **out);
void kv_free(struct kv_cache *kv);
const struct kv_config *kv_get_config(const struct kv_cache *kv);

/* Sequences: ids are small non-negative integers chosen by the cache. */
ks_status kv_seq_create(struct kv_cache *kv, int32_t *seq_out);
/* Release every page of seq (pages shared with others are only unreferenced). */
void kv_seq_free(struct kv_cache *kv, int32_t seq);
int32_t kv_seq_len(const struct kv_cache *kv, int32_t seq);
ks_status kv_seq_grow(struct kv_cache *kv, int32_t seq, int32_t n_tokens);
ks_status kv_seq_truncate(struct kv_cache *kv, int32_t seq, int32_t len);

/* Store one token's K and V for one layer: k and v hold n_kv_head * head_dim
 * f32 values (head-major). pos < kv_seq_len(seq). Rotation and quantization
 * happen here. */
ks_status kv_write(struct kv_cache *kv, int layer, int32_t seq, int32_t pos,
                   const float *k, const float *v);

/* ---- additions beyond the first contract (all purely additive) ---------- */

/* Budget accounting counts page storage only (K and V rows of every layer);
 * a page of types (tk, tv) costs kv_page_bytes(cfg, tk, tv) bytes. Page
 * metadata and page tables live outside the budget. */
size_t kv_page_bytes(const struct kv_config *cfg, enum quant_type type_k, enum quant_type type_v);

/* A new sequence sharing every page of src (reference counts go up, nothing
 * is copied). A later kv_write() into a shared page copies it first
 * (copy-on-write), which needs one page of budget. */
ks_status kv_seq_fork(struct kv_cache *kv, int32_t src, int32_t *seq_out);

/* ---- live requantization ------------------------------------------------ */

enum kv_select_kind {
    KV_SELECT_ALL = 0,        /* every page of every sequence */
    KV_SELECT_SEQ = 1,        /* the pages of one sequence */
    KV_SELECT_OLDER_THAN = 2, /* pages whose tokens all lie before the most
                                 recent keep_recent tokens of their sequence */
};

struct kv_selector {
    enum kv_select_kind kind;
    int32_t seq;         /* KV_SELECT_SEQ */
    int32_t keep_recent; /* KV_SELECT_OLDER_THAN: N */
};

/* Pass as type_k or type_v to leave that half of each page as it is. */
#define KV_TYPE_KEEP QUANT_TYPE_COUNT

struct kv_requant_result {
    size_t bytes_before;   /* cache bytes used before the call */
    size_t bytes_after;    /* after it (or, for a dry run, after a real call) */
    int32_t pages_selected;
    int32_t pages_changed; /* selected pages whose K or V type changes */
    double ms;             /* wall time of the conversion (0 for a dry run) */
};

/* Convert the selected pages to type_k / type_v in place: allocate the new
 * storage, convert (dequantize + quantize the stored, already rotated rows),
 * swap, free. Positions and sequence lengths are untouched. Pages shared by
 * several sequences change for all of them.
 * Errors: KS_ERR_INVALID_ARG (type not f32/f16/q8_0/q4_0, quantized type with
 * head_dim % 32 != 0, bad selector), KS_ERR_NOT_FOUND (no such sequence),
 * KS_ERR_KV_FULL (the result would exceed the budget), KS_ERR_NOMEM. On any
 * error every page is left exactly as it was. result may be NULL. */
ks_status kv_requantize(struct kv_cache *kv, const struct kv_selector *sel, enum quant_type type_k,
                        enum quant_type type_v, bool dry_run, struct kv_requant_result *result);

/* ---- usage and fit ------------------------------------------------------- */

/* Index into the per-type arrays below: f32, f16, q8_0, q4_0. */
enum { KV_N_TYPES = 4 };
int kv_type_index(enum quant_type t);           /* -1 if not a KV type */
enum quant_type kv_type_at(int index);

struct kv_usage {
    size_t budget, used, free;
    int32_t n_pages;
    int32_t n_seqs;
    int64_t n_tokens;                        /* sum of sequence lengths */
    int32_t pages_k[KV_N_TYPES], pages_v[KV_N_TYPES]; /* pages by K type / by V type */
    int64_t tokens_k[KV_N_TYPES], tokens_v[KV_N_TYPES];
    int64_t demotions;                       /* page halves demoted by the dynamic policy */
    int64_t demotion_passes;                 /* times the high watermark was crossed */
};
void kv_usage(const struct kv_cache *kv, struct kv_usage *out);

struct kv_seq_usage {
    int32_t len;
    int32_t n_pages;
    size_t bytes;        /* storage of its pages (shared pages counted in full) */
    int32_t pages_k[KV_N_TYPES], pages_v[KV_N_TYPES];
};
/* Live sequence ids are below kv_seq_id_limit(); kv_seq_usage() returns
 * KS_ERR_NOT_FOUND for an id that is not live. */
int32_t kv_seq_id_limit(const struct kv_cache *kv);
ks_status kv_seq_usage(const struct kv_cache *kv, int32_t seq, struct kv_seq_usage *out);

/* Tokens that still fit in the free budget (whole pages) if every new page
 * were stored at one precision (K and V alike), and under the dynamic policy
 * for one new sequence (sinks and hot window at the start precision, the rest
 * at the floor, after demoting every demotable page already in the cache).
 * When the floor cannot be used (head_dim % 32 != 0) the dynamic figure
 * equals the start-precision one: the policy then keeps everything there. */
struct kv_fit {
    int64_t tokens[KV_N_TYPES]; /* by kv_type_index; -1 where the type is not allowed */
    int64_t dynamic;
    int64_t start;              /* at the configured type_k / type_v */
};
void kv_fit(const struct kv_cache *kv, struct kv_fit *out);
/* The same for an empty cache of this configuration (kvserve info). */
ks_status kv_fit_config(const struct kv_config *cfg, struct kv_fit *out);

/* Debug aid: check every invariant (ref counts, accounting, page tables);
 * KS_ERR_INTERNAL with a description on the first broken one. */
ks_status kv_check(const struct kv_cache *kv);

/* ---- run-time policy ----------------------------------------------------- */

/* Which fields of struct kv_policy_update apply (bit mask). */
enum {
    KV_SET_POLICY = 1 << 0,
    KV_SET_HIGH_WATERMARK = 1 << 1,
    KV_SET_LOW_WATERMARK = 1 << 2,
    KV_SET_HOT_TOKENS = 1 << 3,
    KV_SET_SINK_TOKENS = 1 << 4,
    KV_SET_FLOOR = 1 << 5,
    KV_SET_TYPE_K = 1 << 6,
    KV_SET_TYPE_V = 1 << 7,
};

struct kv_policy_update {
    unsigned set;             /* KV_SET_* bits; fields without their bit are ignored */
    enum kv_policy policy;
    float high_watermark, low_watermark;
    int32_t hot_tokens, sink_tokens;
    enum quant_type floor;
    enum quant_type type_k, type_v; /* start precision of pages allocated from now on */
};

/* Change the policy fields of the configuration at run time, all or nothing:
 * the fields named in u->set are merged into the current configuration and
 * the result is validated as a whole (policy static|dynamic, 0 < low <= high
 * <= 1, sinks and hot window in 0..2^24, floor and start types f32/f16/q8_0/
 * q4_0 usable with this head_dim, one page at the start types within the
 * budget); KS_ERR_INVALID_ARG names the first bad field and nothing changes.
 * Pages already stored keep their types; the new values apply from the next
 * allocation (a dynamic policy whose high watermark is now below the usage
 * demotes then). Not thread-safe, like every call on the cache. */
ks_status kv_set_policy(struct kv_cache *kv, const struct kv_policy_update *u);

/* One page of a sequence, in token order (page i holds tokens [i*P, i*P+P)). */
struct kv_page_info {
    enum quant_type type_k, type_v;
    int32_t ref;              /* sequences sharing it (> 1: shared prefix or fork) */
};
/* Fill up to cap entries of seq's pages in order; *n_out is the sequence's
 * page count (may exceed cap; out may be NULL when cap is 0). KS_ERR_NOT_FOUND
 * for a sequence that is not live. */
ks_status kv_seq_pages(const struct kv_cache *kv, int32_t seq, struct kv_page_info *out, int32_t cap,
                       int32_t *n_out);

#endif
