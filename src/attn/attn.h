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
 * each (query, KV head) folds its sequence's pages in segments of fixed
 * positions, in page order, whichever threads computed them. */
ks_status attn_forward(threads_pool *pool, const struct kv_cache *kv, int layer,
                       const struct attn_query *queries, int32_t n_queries,
                       const float *q, float *out, int n_head, float scale);

/* What a layer's attention adds to plain causal softmax attention. */
struct attn_params {
    float scale;        /* score = scale * (q . k) */
    int32_t window;     /* > 0: sliding window: a query at position p sees only the
                           keys at positions j with p - window < j <= p (llama.cpp's
                           standard SWA mask: masked when p - j >= window); 0: all j <= p */
    float softcap;      /* > 0: score = softcap * tanh(score / softcap) before the
                           softmax (gemma2's attention logit soft-capping) */
    const float *sinks; /* NULL, or (n_head): head h's softmax gets an extra term
                           exp(sinks[h]) in its denominator, with no value (gpt-oss) */
};

/* attn_forward with the features of p; attn_forward(..., scale) is this with
 * only p->scale set. Windowed queries read only the pages their window
 * reaches, so a sequence's pages of a sliding-window layer before every
 * query's window are never touched. Exact with smoothing: the K means'
 * shift of each score is added back before the soft-cap and to the sink. */
ks_status attn_forward_ex(threads_pool *pool, const struct kv_cache *kv, int layer,
                          const struct attn_query *queries, int32_t n_queries,
                          const float *q, float *out, int n_head, const struct attn_params *p);

#endif
