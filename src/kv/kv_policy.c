/* Precision policy. Static: every page keeps the start precision; idle
 * cached pages (the prefix cache) are evicted when the budget needs their
 * bytes, and a full budget is KS_ERR_KV_FULL. Dynamic: as usage crosses the
 * high watermark, idle cached pages step down first, then they are evicted,
 * then the oldest pages in use outside each sequence's sinks and hot window
 * step down, V before K and one level of the ladder at a time (by default
 * V q8_0, K q8_0, V q4_0, K q4_0), never below the floor, until usage is
 * under the low watermark. Idle pages go first because no running request
 * reads them. */
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

/* Idle cached pages (idle) or pages in use outside every holder's sinks and
 * hot window, oldest first. */
static int32_t collect_candidates(const struct kv_cache *kv, bool idle, struct candidate *out, uint8_t *protect)
{
    const struct kv_config *c = &kv->cfg;
    for (int32_t q = 0; q < kv->n_seq_slots; q++) {
        const struct kv_seq *s = &kv->seqs[q];
        for (int32_t i = 0; s->live && i < s->n_pages; i++) {
            int64_t first = (int64_t)i * c->page_tokens, end = first + c->page_tokens;
            if (first < c->sink_tokens || end > (int64_t)s->len - c->hot_tokens)
                protect[s->pages[i]] = 1;
        }
    }
    int32_t n = 0;
    for (int32_t id = 0; id < kv->n_page_slots; id++) {
        const struct kv_page *pg = &kv->pages[id];
        if (idle ? pg->ref == 0 && pg->k : pg->ref > 0 && !protect[id])
            out[n++] = (struct candidate){pg->birth, id};
    }
    qsort(out, (size_t)n, sizeof *out, by_birth);
    return n;
}

static bool stage_allowed(const struct kv_config *c, const struct demotion_stage *st)
{
    return kv_check_type(c, st->to, "") == KS_OK;
}

/* Demote idle or in-use pages until used + bytes <= goal or none is left. */
static ks_status demote(struct kv_cache *kv, bool idle, size_t bytes, size_t goal)
{
    struct candidate *cand = malloc(((size_t)kv->n_page_slots + 1) * sizeof *cand);
    uint8_t *protect = calloc((size_t)kv->n_page_slots + 1, 1);
    if (!cand || !protect) {
        free(cand);
        free(protect);
        return ks_fail(KS_ERR_NOMEM, "kv policy: out of host memory");
    }
    int32_t n = collect_candidates(kv, idle, cand, protect);
    struct demotion_stage stages[MAX_STAGES];
    int n_stages = ladder_stages(&kv->cfg, stages);
    ks_status st = KS_OK;
    for (int s = 0; s < n_stages && kv->used + bytes > goal && !st; s++) {
        if (!stage_allowed(&kv->cfg, &stages[s]))
            continue;
        for (int32_t i = 0; i < n && kv->used + bytes > goal && !st; i++) {
            const struct kv_page *pg = &kv->pages[cand[i].id];
            enum quant_type have = stages[s].is_k ? pg->tk : pg->tv;
            if (kv_type_index(have) >= kv_type_index(stages[s].to))
                continue;
            st = kv_convert_pages(kv, &cand[i].id, 1, stages[s].is_k ? stages[s].to : KV_TYPE_KEEP,
                                  stages[s].is_k ? KV_TYPE_KEEP : stages[s].to);
            if (!st)
                kv->demotions++;
        }
    }
    free(cand);
    free(protect);
    return st;
}

ks_status kv_policy_make_room(struct kv_cache *kv, size_t bytes)
{
    const struct kv_config *c = &kv->cfg;
    if (c->policy == KV_POLICY_DYNAMIC && kv->used + bytes > (size_t)((double)c->high_watermark * c->mem_budget)) {
        size_t low = (size_t)((double)c->low_watermark * c->mem_budget);
        kv->demotion_passes++;
        ks_status st = demote(kv, true, bytes, low);
        if (!st)
            kv_prefix_evict(kv, bytes, low);
        if (!st)
            st = demote(kv, false, bytes, low);
        if (st)
            return st;
    }
    kv_prefix_evict(kv, bytes, c->mem_budget);
    if (kv->used + bytes > c->mem_budget)
        return ks_fail(KS_ERR_KV_FULL,
                       "out of KV memory: %zu more bytes needed, %zu of %zu used%s (raise --kv-mem%s)", bytes,
                       kv->used, c->mem_budget,
                       c->policy == KV_POLICY_DYNAMIC ? " with every demotable page at the floor" : "",
                       c->policy == KV_POLICY_DYNAMIC ? "" : " or use --kv-policy dynamic");
    return KS_OK;
}
