/* attn_forward: one item per (tile of query rows, KV head), each a single
 * online-softmax pass over its tile's pages in order. A query row's output
 * therefore depends on nothing but its own sequence's pages: not on the
 * other queries of the batch, nor on how many threads share the work (no
 * split of a sequence into page ranges, whose merge would round differently
 * for another split). */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "attn/attn.h"
#include "attn/attn_internal.h"

/* TILE_ROWS: query rows per tile and KV head, the GQA group times as many
 * query tokens of one sequence as fit (prefill), so each K/V row is read once
 * per tile. */
enum { TILE_ROWS = 64 };

static const struct attn_kernels *forced;

void attn_set_kernels(const struct attn_kernels *k) { forced = k; }

const struct attn_kernels *attn_kernels_best(void)
{
    if (attn_kernels_avx512())
        return attn_kernels_avx512();
    if (attn_kernels_avx2())
        return attn_kernels_avx2();
    return attn_kernels_scalar();
}

struct tile {
    int32_t first, n_q; /* queries[first, first + n_q), one sequence */
    int32_t seq;
    int32_t first_page; /* the first page any query's window reaches */
    int32_t n_pages;    /* pages up to the furthest position in the tile */
};

struct job {
    const struct kv_cache *kv;
    const struct attn_kernels *k;
    int layer, n_head, n_kv, group, dim;
    struct attn_params p;
    const struct attn_query *queries;
    const float *q;
    float *out;

    struct tile *tiles;
    int32_t n_tiles;
    atomic_int next_item; /* items are taken from a shared counter: their costs differ with their contexts */
    int max_rows;         /* largest tile, in rows */
    uint8_t *scratch;     /* per thread */
    size_t scratch_bytes;
};

static int tile_rows(const struct job *j, const struct tile *t) { return t->n_q * j->group; }

/* Per-thread scratch: one item's query rows, their int8 copy, one page of
 * scores, the row limits and the online-softmax state. */
struct scratch {
    float *q;         /* (R, dim) scaled, rotated */
    block_q8_0 *q8;   /* (R, dim / 32), NULL when dim % 32 != 0 */
    float *q8d;       /* (R, dim / 32) */
    float *s;         /* (R, P) */
    int32_t *limit;   /* (R) */
    int32_t *first;   /* (R) */
    float *koff;      /* (R) q . mu_k: what K smoothing took off each score */
    float *m, *l;     /* (R) running max and sum of exp */
    float *acc;       /* (R, dim) */
};

/* Bytes of one thread's scratch; with base, also where each part lives. */
static size_t scratch_layout(const struct job *j, uint8_t *base, struct scratch *out)
{
    const struct kv_config *c = kv_get_config(j->kv);
    size_t rows = (size_t)j->max_rows, nb = (size_t)j->dim / QK8_0;
    size_t q = 0, s = q + rows * j->dim * sizeof(float);
    size_t q8d = s + rows * c->page_tokens * sizeof(float);
    size_t m = q8d + rows * nb * sizeof(float);
    size_t l = m + rows * sizeof(float);
    size_t acc = l + rows * sizeof(float);
    size_t limit = acc + rows * j->dim * sizeof(float);
    size_t first = limit + rows * sizeof(int32_t);
    size_t koff = first + rows * sizeof(int32_t);
    size_t q8 = koff + rows * sizeof(float);
    size_t end = q8 + rows * nb * sizeof(block_q8_0);
    if (base) {
        out->q = (float *)(base + q);
        out->s = (float *)(base + s);
        out->q8d = (float *)(base + q8d);
        out->m = (float *)(base + m);
        out->l = (float *)(base + l);
        out->acc = (float *)(base + acc);
        out->limit = (int32_t *)(base + limit);
        out->first = (int32_t *)(base + first);
        out->koff = (float *)(base + koff);
        out->q8 = j->dim % QK8_0 == 0 ? (block_q8_0 *)(base + q8) : NULL;
    }
    return (end + 63) / 64 * 64;
}

static int32_t window_first(const struct attn_params *p, int32_t pos)
{
    return p->window > 0 && pos - p->window + 1 > 0 ? pos - p->window + 1 : 0;
}

/* How far below the true scores the softmax sees them: K smoothing's shift,
 * unless the soft-cap has added it back. */
static float stored_shift(const struct job *j, const struct scratch *sc, int r)
{
    return j->p.softcap > 0.0f ? 0.0f : sc->koff[r];
}

/* Scaled, rotated query rows of one tile for one KV head, their limits, and
 * an empty softmax state: with a sink, the state of a softmax that has seen
 * only the sink (its max is the sink's logit, its sum exp(0)). K smoothing
 * lowered every score by q . mu_k; the sink is lowered as much, so the
 * softmax stays exact. */
static void load_rows(const struct job *j, const struct tile *t, int head, const struct scratch *sc)
{
    const struct kv_config *c = kv_get_config(j->kv);
    int d = j->dim, R = tile_rows(j, t);
    const float *mean_k = kv_seq_mean(j->kv, t->seq, j->layer, false);
    for (int i = 0; i < t->n_q; i++)
        for (int g = 0; g < j->group; g++) {
            int r = i * j->group + g, qh = head * j->group + g;
            int32_t pos = j->queries[t->first + i].pos;
            sc->limit[r] = pos + 1;
            sc->first[r] = window_first(&j->p, pos);
            const float *src = j->q + ((size_t)(t->first + i) * j->n_head + (size_t)qh) * d;
            float *dst = sc->q + (size_t)r * d;
            for (int e = 0; e < d; e++)
                dst[e] = src[e] * j->p.scale;
            if (c->rotate)
                kv_rotate(dst, d);
            sc->koff[r] = 0.0f;
            for (int e = 0; mean_k && e < d; e++)
                sc->koff[r] += dst[e] * mean_k[(size_t)head * d + e];
            sc->m[r] = j->p.sinks ? j->p.sinks[qh] - stored_shift(j, sc, r) : -INFINITY;
            sc->l[r] = j->p.sinks ? 1.0f : 0.0f;
        }
    memset(sc->acc, 0, (size_t)R * d * sizeof(float));
}

/* Soft-capping of one page's scores, on the true score (K smoothing's shift
 * added back: the cap is not shift-invariant). */
static void softcap_scores(const struct job *j, const struct scratch *sc, int R, int P, int n_tok)
{
    float cap = j->p.softcap;
    for (int r = 0; r < R; r++) {
        float *s = sc->s + (size_t)r * P;
        for (int t = 0; t < n_tok; t++)
            s[t] = cap * tanhf((s[t] + sc->koff[r]) / cap);
    }
}

/* The int8 copy of the query rows, for the integer kernels of quantized K
 * pages: made at the first such page, so a float cache never pays for it. */
static void quantize_rows(const struct job *j, const struct tile *t, const struct scratch *sc)
{
    int d = j->dim, nb = d / QK8_0, R = tile_rows(j, t);
    for (int r = 0; r < R; r++)
        attn_quantize_q8(sc->q + (size_t)r * d, sc->q8 + (size_t)r * nb, sc->q8d + (size_t)r * nb, d);
}

/* Pages are separate allocations, so the hardware prefetcher loses the
 * stream at every page boundary: ask for the next page's K and V rows of
 * this (layer, KV head) while this page is computed. always_inline: as a
 * separate function with no side effects, GCC deletes the call (prefetches
 * do not count as effects), which the first version of this code silently
 * suffered from. */
static inline __attribute__((always_inline)) void prefetch_page(const struct kv_config *c,
                                                                const struct kv_page_view *pg, int layer, int head)
{
    const char *k = (const char *)kv_view_run(c, pg->k, pg->k_row_bytes, layer, head);
    const char *v = (const char *)kv_view_run(c, pg->v, pg->v_row_bytes, layer, head);
    size_t nk = (size_t)c->page_tokens * pg->k_row_bytes, nv = (size_t)c->page_tokens * pg->v_row_bytes;
    for (size_t o = 0; o < nk; o += 64)
        __builtin_prefetch(k + o);
    for (size_t o = 0; o < nv; o += 64)
        __builtin_prefetch(v + o);
}

/* Normalize, add the V means back (smoothing: the weights of the keys sum
 * to 1, or with a sink to 1 less the sink's share), rotate back, store the
 * tile's rows of this KV head. */
static void store_rows(const struct job *j, const struct tile *t, int head, const struct scratch *sc)
{
    const struct kv_config *c = kv_get_config(j->kv);
    int d = j->dim;
    const float *mean_v = kv_seq_mean(j->kv, t->seq, j->layer, true);
    for (int i = 0; i < t->n_q; i++)
        for (int g = 0; g < j->group; g++) {
            int r = i * j->group + g;
            float *acc = sc->acc + (size_t)r * d;
            float inv = sc->l[r] > 0.0f ? 1.0f / sc->l[r] : 0.0f;
            for (int e = 0; e < d; e++)
                acc[e] *= inv;
            float w = 1.0f;
            if (mean_v && j->p.sinks)
                w = 1.0f - expf(j->p.sinks[head * j->group + g] - stored_shift(j, sc, r) - sc->m[r]) * inv;
            for (int e = 0; mean_v && e < d; e++)
                acc[e] += w * mean_v[(size_t)head * d + e];
            if (c->rotate)
                kv_rotate(acc, d);
            float *dst = j->out + ((size_t)(t->first + i) * j->n_head + (size_t)head * j->group + g) * d;
            memcpy(dst, acc, (size_t)d * sizeof(float));
        }
}

/* Item = (tile, KV head): every page of the tile in order. */
static void run_item(const struct job *j, int32_t item, uint8_t *scratch)
{
    const struct kv_cache *kv = j->kv;
    const struct kv_config *c = kv_get_config(kv);
    const struct tile *t = &j->tiles[item / j->n_kv];
    int h = item % j->n_kv, R = tile_rows(j, t), d = j->dim, P = c->page_tokens;
    struct scratch sc = {0};
    scratch_layout(j, scratch, &sc);
    load_rows(j, t, h, &sc);
    int32_t max_limit = 0;
    for (int r = 0; r < R; r++)
        max_limit = sc.limit[r] > max_limit ? sc.limit[r] : max_limit;
    /* the walk stays inside the page table and the sequence's tokens */
    assert(t->n_pages <= kv_seq_n_pages(kv, t->seq) && max_limit <= kv_seq_len(kv, t->seq));

    struct attn_rows rows = {.n = R, .dim = d, .stride = P, .s = sc.s, .limit = sc.limit, .q = sc.q, .q8 = sc.q8,
                             .q8d = sc.q8d, .m = sc.m, .l = sc.l, .acc = sc.acc,
                             .first = j->p.window > 0 ? sc.first : NULL};
    struct kv_page_view page, next;
    bool q8_ready = false;
    kv_seq_page_view(kv, t->seq, t->first_page, &next);
    prefetch_page(c, &next, j->layer, h); /* decode's short contexts are a page or three */
    for (int32_t p = t->first_page; p < t->n_pages; p++) {
        page = next;
        if (p + 1 < t->n_pages) {
            kv_seq_page_view(kv, t->seq, p + 1, &next);
            prefetch_page(c, &next, j->layer, h);
        }
        int page_start = p * P;
        int n_tok = max_limit - page_start < P ? max_limit - page_start : P;
        assert(n_tok > 0 && n_tok <= P && kv_type_index(page.tk) >= 0 && kv_type_index(page.tv) >= 0);
        if (sc.q8 && !q8_ready && quant_traits(page.tk)->is_quantized) {
            quantize_rows(j, t, &sc);
            q8_ready = true;
        }
        const uint8_t *k_rows = kv_view_run(c, page.k, page.k_row_bytes, j->layer, h);
        attn_set_bounds(&rows, k_rows, (size_t)P * page.k_row_bytes);
        j->k->score[kv_type_index(page.tk)](k_rows, n_tok, &rows);
        if (j->p.softcap > 0.0f)
            softcap_scores(j, &sc, R, P, n_tok);
        j->k->softmax(&rows, page_start, n_tok);
        const uint8_t *v_rows = kv_view_run(c, page.v, page.v_row_bytes, j->layer, h);
        attn_set_bounds(&rows, v_rows, (size_t)P * page.v_row_bytes);
        j->k->accum[kv_type_index(page.tv)](v_rows, n_tok, &rows);
    }
    store_rows(j, t, h, &sc);
}

static void phase_items(void *ctx, int ith, int nth)
{
    struct job *j = ctx;
    (void)nth;
    int32_t n_items = j->n_tiles * j->n_kv;
    for (int32_t i; (i = atomic_fetch_add_explicit(&j->next_item, 1, memory_order_relaxed)) < n_items;)
        run_item(j, i, j->scratch + (size_t)ith * j->scratch_bytes);
}

static ks_status check_args(const struct kv_cache *kv, int layer, const struct attn_query *queries,
                            int32_t n_queries, int n_head)
{
    const struct kv_config *c = kv_get_config(kv);
    if (layer < 0 || layer >= c->n_layer)
        return ks_fail(KS_ERR_RANGE, "attn: layer %d out of [0, %d)", layer, c->n_layer);
    if (n_head <= 0 || n_head % c->n_kv_head != 0)
        return ks_fail(KS_ERR_INVALID_ARG, "attn: %d query heads is not a multiple of %d KV heads", n_head,
                       c->n_kv_head);
    if (n_head / c->n_kv_head > TILE_ROWS)
        return ks_fail(KS_ERR_UNSUPPORTED, "attn: more than %d query heads per KV head", TILE_ROWS);
    for (int32_t i = 0; i < n_queries; i++) {
        int32_t s = queries[i].seq;
        if (!kv_seq_exists(kv, s))
            return ks_fail(KS_ERR_NOT_FOUND, "attn: query %d: sequence %d does not exist", (int)i, (int)s);
        if (queries[i].pos < 0 || queries[i].pos >= kv_seq_len(kv, s))
            return ks_fail(KS_ERR_RANGE, "attn: query %d: position %d outside sequence %d of %d tokens", (int)i,
                           (int)queries[i].pos, (int)s, (int)kv_seq_len(kv, s));
    }
    return KS_OK;
}

/* Consecutive queries of one sequence share a tile. */
static void make_tiles(struct job *j, int32_t n_queries)
{
    const struct kv_config *c = kv_get_config(j->kv);
    int per_tile = TILE_ROWS / j->group;
    int32_t n = 0;
    j->max_rows = 0;
    for (int32_t i = 0; i < n_queries;) {
        struct tile *t = &j->tiles[n++];
        t->first = i;
        t->seq = j->queries[i].seq;
        int32_t max_pos = 0, min_pos = j->queries[i].pos;
        while (i < n_queries && i - t->first < per_tile && j->queries[i].seq == t->seq) {
            max_pos = j->queries[i].pos > max_pos ? j->queries[i].pos : max_pos;
            min_pos = j->queries[i].pos < min_pos ? j->queries[i].pos : min_pos;
            i++;
        }
        t->n_q = i - t->first;
        t->n_pages = (max_pos + c->page_tokens) / c->page_tokens;
        t->first_page = window_first(&j->p, min_pos) / c->page_tokens;
        j->max_rows = tile_rows(j, t) > j->max_rows ? tile_rows(j, t) : j->max_rows;
    }
    j->n_tiles = n;
}

ks_status attn_forward(threads_pool *pool, const struct kv_cache *kv, int layer, const struct attn_query *queries,
                       int32_t n_queries, const float *q, float *out, int n_head, float scale)
{
    struct attn_params p = {.scale = scale};
    return attn_forward_ex(pool, kv, layer, queries, n_queries, q, out, n_head, &p);
}

ks_status attn_forward_ex(threads_pool *pool, const struct kv_cache *kv, int layer, const struct attn_query *queries,
                          int32_t n_queries, const float *q, float *out, int n_head, const struct attn_params *p)
{
    ks_status st = check_args(kv, layer, queries, n_queries, n_head);
    if (st || n_queries == 0)
        return st;
    if (p->window < 0 || p->softcap < 0.0f || !(p->softcap == p->softcap))
        return ks_fail(KS_ERR_INVALID_ARG, "attn: window %d and softcap %g must not be negative", (int)p->window,
                       (double)p->softcap);
    const struct kv_config *c = kv_get_config(kv);
    int nth = pool ? threads_count(pool) : 1;
    struct job j = {
        .kv = kv, .k = forced ? forced : attn_kernels_best(), .layer = layer, .n_head = n_head,
        .n_kv = c->n_kv_head, .group = n_head / c->n_kv_head, .dim = c->head_dim, .p = *p,
        .queries = queries, .q = q, .out = out,
    };
    j.tiles = malloc((size_t)n_queries * sizeof *j.tiles);
    if (!j.tiles)
        return ks_fail(KS_ERR_NOMEM, "attn: out of host memory");
    make_tiles(&j, n_queries);
    j.scratch_bytes = scratch_layout(&j, NULL, NULL);
    j.scratch = aligned_alloc(64, (size_t)nth * j.scratch_bytes);
    if (!j.scratch) {
        free(j.tiles);
        return ks_fail(KS_ERR_NOMEM, "attn: out of host memory for %d threads' scratch", nth);
    }
    threads_run(pool, phase_items, &j);
    free(j.tiles);
    free(j.scratch);
    return KS_OK;
}
