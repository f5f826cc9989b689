/* kv_share_budget: a target's and its draft model's caches under one limit. */
#include "kv/kv_internal.h"

ks_status kv_share_budget(struct kv_cache *kv, struct kv_cache *peer)
{
    if (!kv || !peer || kv == peer || kv->peer || peer->peer)
        return ks_fail(KS_ERR_STATE, "kv: a budget is shared by two distinct caches, each sharing no other");
    if (peer->used > 0 || peer->n_live_pages + peer->n_idle_pages > 0)
        return ks_fail(KS_ERR_STATE, "kv: a cache joins another's budget before it holds pages");
    size_t page = kv_page_bytes(&peer->cfg, peer->cfg.type_k, peer->cfg.type_v);
    if (kv->used + page > kv->cfg.mem_budget)
        return ks_fail(KS_ERR_KV_FULL, "kv: the budget of %zu bytes (%zu used) has no room for one %zu-byte page of the other cache",
                       kv->cfg.mem_budget, kv->used, page);
    kv->peer = peer;
    peer->peer = kv;
    peer->cfg.mem_budget = kv->cfg.mem_budget;
    KV_DEBUG_CHECK(kv, "kv_share_budget");
    KV_DEBUG_CHECK(peer, "kv_share_budget");
    return KS_OK;
}

size_t kv_budget_used(const struct kv_cache *kv)
{
    return kv_pool_used(kv);
}
