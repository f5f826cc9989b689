/* Run-time inspection and control of a live cache: kv_set_policy() changes
 * the precision policy (only fields that decide future allocations and
 * demotions, so stored pages keep their types and the cache stays consistent
 * whatever is set), kv_seq_pages() lists a sequence's pages for the server. */
#include <math.h>

#include "kv/kv_internal.h"

enum { MAX_WINDOW_TOKENS = 1 << 24 };

static ks_status check_window(const char *name, int32_t v)
{
    if (v < 0 || v > MAX_WINDOW_TOKENS)
        return ks_fail(KS_ERR_INVALID_ARG, "%s must be a token count in 0..%d (got %d)", name, MAX_WINDOW_TOKENS, v);
    return KS_OK;
}

static ks_status check_watermarks(const struct kv_config *c)
{
    float hi = c->high_watermark, lo = c->low_watermark;
    if (!isfinite(hi) || hi <= 0.0f || hi > 1.0f)
        return ks_fail(KS_ERR_INVALID_ARG, "high_watermark must be a usage ratio in (0, 1] (got %g)", (double)hi);
    if (!isfinite(lo) || lo <= 0.0f || lo > hi)
        return ks_fail(KS_ERR_INVALID_ARG, "low_watermark must be in (0, high_watermark = %g] (got %g)", (double)hi,
                       (double)lo);
    return KS_OK;
}

static void merge(struct kv_config *c, const struct kv_policy_update *u)
{
    if (u->set & KV_SET_POLICY) c->policy = u->policy;
    if (u->set & KV_SET_HIGH_WATERMARK) c->high_watermark = u->high_watermark;
    if (u->set & KV_SET_LOW_WATERMARK) c->low_watermark = u->low_watermark;
    if (u->set & KV_SET_HOT_TOKENS) c->hot_tokens = u->hot_tokens;
    if (u->set & KV_SET_SINK_TOKENS) c->sink_tokens = u->sink_tokens;
    if (u->set & KV_SET_FLOOR) c->floor = u->floor;
    if (u->set & KV_SET_TYPE_K) c->type_k = u->type_k;
    if (u->set & KV_SET_TYPE_V) c->type_v = u->type_v;
    if (u->set & KV_SET_LADDER) {
        c->n_ladder = u->n_ladder;
        for (int i = 0; i < KV_LADDER_MAX; i++)
            c->ladder[i] = i < u->n_ladder ? u->ladder[i] : QUANT_F32;
    }
}

static ks_status check_merged(const struct kv_config *c, unsigned set)
{
    ks_status st;
    if (c->policy != KV_POLICY_STATIC && c->policy != KV_POLICY_DYNAMIC)
        return ks_fail(KS_ERR_INVALID_ARG, "policy must be static or dynamic (got %d)", (int)c->policy);
    bool dynamic = c->policy == KV_POLICY_DYNAMIC;
    if ((dynamic || (set & (KV_SET_HIGH_WATERMARK | KV_SET_LOW_WATERMARK))) && (st = check_watermarks(c)))
        return st;
    if ((dynamic || (set & KV_SET_HOT_TOKENS)) && (st = check_window("hot_tokens", c->hot_tokens)))
        return st;
    if ((dynamic || (set & KV_SET_SINK_TOKENS)) && (st = check_window("sink_tokens", c->sink_tokens)))
        return st;
    /* An unusable floor set at kv_create is tolerated (the policy skips it);
     * one asked for now is refused so the caller learns it would do nothing. */
    if ((set & KV_SET_FLOOR) && (st = kv_check_type(c, c->floor, "floor")))
        return st;
    if ((set & KV_SET_LADDER) && (st = kv_check_ladder(c, true)))
        return st;
    if ((st = kv_check_type(c, c->type_k, "type_k")) || (st = kv_check_type(c, c->type_v, "type_v")))
        return st;
    size_t page = kv_page_bytes(c, c->type_k, c->type_v);
    if (page > c->mem_budget)
        return ks_fail(KS_ERR_INVALID_ARG, "type_k %s / type_v %s: one page (%zu bytes) exceeds the KV budget (%zu bytes)",
                       quant_type_name(c->type_k), quant_type_name(c->type_v), page, c->mem_budget);
    return KS_OK;
}

ks_status kv_set_policy(struct kv_cache *kv, const struct kv_policy_update *u)
{
    if (!kv || !u)
        return ks_fail(KS_ERR_INVALID_ARG, "kv_set_policy: cache and update must not be NULL");
    unsigned known = KV_SET_POLICY | KV_SET_HIGH_WATERMARK | KV_SET_LOW_WATERMARK | KV_SET_HOT_TOKENS |
                     KV_SET_SINK_TOKENS | KV_SET_FLOOR | KV_SET_TYPE_K | KV_SET_TYPE_V | KV_SET_LADDER;
    if (u->set & ~known)
        return ks_fail(KS_ERR_INVALID_ARG, "kv_set_policy: unknown field bits 0x%x", u->set & ~known);
    struct kv_config next = kv->cfg;
    merge(&next, u);
    ks_status st = check_merged(&next, u->set);
    if (st)
        return st;
    kv->cfg = next;
    KV_DEBUG_CHECK(kv, "kv_set_policy");
    return KS_OK;
}

ks_status kv_seq_pages(const struct kv_cache *kv, int32_t seq, struct kv_page_info *out, int32_t cap,
                       int32_t *n_out)
{
    *n_out = 0;
    if (seq < 0 || seq >= kv->n_seq_slots || !kv->seqs[seq].live)
        return ks_fail(KS_ERR_NOT_FOUND, "kv cache: sequence %d does not exist", (int)seq);
    const struct kv_seq *s = &kv->seqs[seq];
    for (int32_t i = 0; i < s->n_pages && i < cap; i++) {
        const struct kv_page *pg = &kv->pages[s->pages[i]];
        out[i] = (struct kv_page_info){pg->tk, pg->tv, pg->ref, pg->keyed, kv_page_has_window(kv, pg)};
    }
    *n_out = s->n_pages;
    return KS_OK;
}
