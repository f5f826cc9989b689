/* Precision policy. Static: every page keeps the start precision; idle
 * cached pages (the prefix cache) are evicted when the budget needs their
 * bytes, and a full budget is KS_ERR_KV_FULL. Dynamic: as usage crosses the
 * high watermark, idle cached pages step down first, then they are evicted,
 * then the oldest pages in use outside each sequence's sinks and hot window
 * step down, one rung of the ladder at a time (--kv-ladder; by default V q8_0,
 * K q8_0, V q4_0, K q4_0), V before K (K is the more
 * sensitive half: a K error moves every softmax weight), never below the
 * floor, until usage is under the low watermark. Idle pages go first because
 * no running request reads them. Only when every such page is at the floor
 * and the allocation still does not fit the budget do the sinks and hot
 * windows step down too (oldest first, just enough to fit), so a sequence
 * that fits at the floor never fails for its protected pages.
 *
 * A growing sequence's new pages that will already lie outside its sinks and
 * hot window take part as the newest candidates: the policy lowers their
 * planned types instead of writing them at the start precision and
 * converting them later. */
#include <stdlib.h>

#include "kv/kv_internal.h"

struct demotion_stage {
    bool is_k;
    enum quant_type to;
};

enum { MAX_STAGES = 2 * (KV_LADDER_MAX + 1) };

/* V then K for each ladder level down to the floor, then the floor itself
 * when the ladder does not reach it. */
static int ladder_stages(const struct kv_config *c, struct demotion_stage *out)
{
    static const enum quant_type default_ladder[] = {QUANT_Q8_0, QUANT_Q4_0};
    const enum quant_type *ladder = c->n_ladder ? c->ladder : default_ladder;
    int n_ladder = c->n_ladder ? c->n_ladder : 2, n = 0, floor = kv_type_index(c->floor);
    enum quant_type levels[KV_LADDER_MAX + 1];
    int n_levels = 0;
    for (int i = 0; i < n_ladder && kv_type_index(ladder[i]) <= floor; i++)
        levels[n_levels++] = ladder[i];
    if (n_levels == 0 || levels[n_levels - 1] != c->floor)
        levels[n_levels++] = c->floor;
    for (int i = 0; i < n_levels; i++) {
        out[n++] = (struct demotion_stage){false, levels[i]};
        out[n++] = (struct demotion_stage){true, levels[i]};
    }
    return n;
}

struct candidate {
    uint64_t birth;
    int32_t id;
};

static int by_birth(const void *a, const void *b)
{
    uint64_t x = ((const struct candidate *)a)->birth, y = ((const struct candidate *)b)->birth;
    return (x > y) - (x < y);
}

bool kv_policy_page_protected(const struct kv_config *c, int32_t page, int32_t len)
{
    int64_t first = (int64_t)page * c->page_tokens, end = first + c->page_tokens;
    return first < c->sink_tokens || end > (int64_t)len - c->hot_tokens;
}

/* The length the hot window of sequence q is measured from: a growing
 * sequence's pages that leave the window with this growth are candidates. */
static int32_t window_len(const struct kv_cache *kv, int32_t q, const struct kv_grow_plan *plan)
{
    int32_t len = kv->seqs[q].len;
    return plan && plan->seq == q && plan->new_len > len ? plan->new_len : len;
}

/* Which pages a demotion pass may lower: idle cached pages, pages in use
 * outside every holder's sinks and hot window, or (the last resort before the
 * cache is full) every page in use. */
enum pass { PASS_IDLE, PASS_COLD, PASS_ALL };

/* The pass's pages, oldest first. */
static int32_t collect_candidates(const struct kv_cache *kv, enum pass pass, const struct kv_grow_plan *plan,
                                  struct candidate *out, uint8_t *protect)
{
    for (int32_t q = 0; pass == PASS_COLD && q < kv->n_seq_slots; q++) {
        const struct kv_seq *s = &kv->seqs[q];
        for (int32_t i = 0; s->live && i < s->n_pages; i++)
            if (kv_policy_page_protected(&kv->cfg, i, window_len(kv, q, plan)))
                protect[s->pages[i]] = 1;
    }
    int32_t n = 0;
    for (int32_t id = 0; id < kv->n_page_slots; id++) {
        const struct kv_page *pg = &kv->pages[id];
        if (pass == PASS_IDLE ? pg->ref == 0 && pg->k : pg->ref > 0 && !protect[id])
            out[n++] = (struct candidate){pg->birth, id};
    }
    qsort(out, (size_t)n, sizeof *out, by_birth);
    return n;
}

static bool stage_allowed(const struct kv_config *c, struct demotion_stage st)
{
    return kv_check_type(c, st.to, "") == KS_OK;
}

/* The bytes the allocation still needs: fixed ones plus the planned pages. */
static size_t pending_bytes(const struct kv_cache *kv, size_t bytes, const struct kv_grow_plan *plan)
{
    for (int32_t i = 0; plan && i < plan->n_pages; i++)
        bytes += kv_page_bytes(&kv->cfg, plan->tk[i], plan->tv[i]);
    return bytes;
}

static bool over(const struct kv_cache *kv, size_t bytes, const struct kv_grow_plan *plan, size_t goal)
{
    return kv_pool_used(kv) + pending_bytes(kv, bytes, plan) > goal;
}

/* Lower the pass's planned pages to this stage, oldest first, while the
 * allocation is over goal. */
static void demote_planned(const struct kv_cache *kv, enum pass pass, struct demotion_stage stage, size_t bytes,
                           struct kv_grow_plan *plan, size_t goal)
{
    for (int32_t i = 0; plan && i < plan->n_pages && over(kv, bytes, plan, goal); i++) {
        if (pass == PASS_COLD && kv_policy_page_protected(&kv->cfg, plan->first_page + i, plan->new_len))
            continue;
        enum quant_type *have = stage.is_k ? &plan->tk[i] : &plan->tv[i];
        if (kv_type_index(*have) < kv_type_index(stage.to))
            *have = stage.to;
    }
}

/* Demote the pass's pages (and, but for idle ones, its planned pages) until
 * used + the allocation <= goal or none is left. */
static ks_status demote(struct kv_cache *kv, enum pass pass, size_t bytes, struct kv_grow_plan *plan, size_t goal)
{
    struct candidate *cand = malloc(((size_t)kv->n_page_slots + 1) * sizeof *cand);
    uint8_t *protect = calloc((size_t)kv->n_page_slots + 1, 1);
    if (!cand || !protect) {
        free(cand);
        free(protect);
        return ks_fail(KS_ERR_NOMEM, "kv policy: out of host memory");
    }
    int32_t n = collect_candidates(kv, pass, plan, cand, protect);
    struct demotion_stage stages[MAX_STAGES];
    int n_stages = ladder_stages(&kv->cfg, stages);
    ks_status st = KS_OK;
    for (int s = 0; s < n_stages && over(kv, bytes, plan, goal) && !st; s++) {
        struct demotion_stage stage = stages[s];
        if (!stage_allowed(&kv->cfg, stage))
            continue;
        for (int32_t i = 0; i < n && over(kv, bytes, plan, goal) && !st; i++) {
            const struct kv_page *pg = &kv->pages[cand[i].id];
            enum quant_type have = stage.is_k ? pg->tk : pg->tv;
            if (kv_type_index(have) >= kv_type_index(stage.to))
                continue;
            st = kv_convert_pages(kv, &cand[i].id, 1, stage.is_k ? stage.to : KV_TYPE_KEEP,
                                  stage.is_k ? KV_TYPE_KEEP : stage.to);
            if (!st)
                kv->demotions++;
        }
        if (pass != PASS_IDLE && !st)
            demote_planned(kv, pass, stage, bytes, plan, goal);
    }
    free(cand);
    free(protect);
    return st;
}

static ks_status make_room(struct kv_cache *kv, size_t bytes, struct kv_grow_plan *plan)
{
    const struct kv_config *c = &kv->cfg;
    if (c->policy == KV_POLICY_DYNAMIC && over(kv, bytes, plan, (size_t)((double)c->high_watermark * c->mem_budget))) {
        size_t low = (size_t)((double)c->low_watermark * c->mem_budget);
        kv->demotion_passes++;
        ks_status st = demote(kv, PASS_IDLE, bytes, plan, low);
        if (!st)
            kv_prefix_evict(kv, pending_bytes(kv, bytes, plan), low);
        if (!st)
            st = demote(kv, PASS_COLD, bytes, plan, low);
        /* sinks and hot windows give way only where the cache would be full */
        if (!st)
            st = demote(kv, PASS_ALL, bytes, plan, c->mem_budget);
        if (st)
            return st;
    }
    size_t need = pending_bytes(kv, bytes, plan);
    kv_prefix_evict(kv, need, c->mem_budget);
    if (kv->peer) /* then the idle pages of the cache sharing the budget */
        kv_prefix_evict(kv->peer, need, c->mem_budget);
    if (kv_pool_used(kv) + need > c->mem_budget)
        return ks_fail(KS_ERR_KV_FULL,
                       "out of KV memory: %zu more bytes needed, %zu of %zu used%s (raise --kv-mem%s)", need,
                       kv_pool_used(kv), c->mem_budget,
                       c->policy == KV_POLICY_DYNAMIC ? " with every demotable page at the floor" : "",
                       c->policy == KV_POLICY_DYNAMIC ? "" : " or use --kv-policy dynamic");
    return KS_OK;
}

ks_status kv_policy_make_room(struct kv_cache *kv, size_t bytes) { return make_room(kv, bytes, NULL); }

ks_status kv_policy_plan_grow(struct kv_cache *kv, struct kv_grow_plan *plan) { return make_room(kv, 0, plan); }
