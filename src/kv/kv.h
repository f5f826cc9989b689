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

#endif
