/* attn: fused attention over the kv module's pages. One online-softmax pass
 * over a sequence's page table, dispatching per page on its K and V types and
 * dequantizing in registers; no f16/f32 copy of the cache is ever made.
 * Query heads sharing a KV head (GQA) are processed together.
 *
 * Reads the cache, never changes it. */
#ifndef KS_ATTN_H
#define KS_ATTN_H

#include <stdint.h>

#include "kv/kv.h"
#include "status/status.h"
#include "threads/threads.h"

/* One query token: it attends to positions [0, pos] of seq (causal). */
struct attn_query {
    int32_t seq;
    int32_t pos;
};

/* For each i < n_queries: out[i] = softmax(q[i] . K^T * scale) V over
 * positions [0, queries[i].pos] of queries[i].seq, at one layer.
 * q and out: n_queries x (n_head * head_dim) f32, head-major; n_head is a
 * multiple of the cache's n_kv_head. The K/V of every queried position must
 * already be written for this layer. A query's output is the same bits
 * whatever the other queries are and however many threads the pool has:
 * each (query, KV head) is one pass over its sequence's pages in order. */
ks_status attn_forward(threads_pool *pool, const struct kv_cache *kv, int layer,
                       const struct attn_query *queries, int32_t n_queries,
                       const float *q, float *out, int n_head, float scale);

#endif
