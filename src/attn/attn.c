/* attn_forward: tiles of query rows x page ranges, one online-softmax pass
 * per item over its pages (every KV head of each page in turn), then a merge
 * of the partial softmax states of each (tile, KV head). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attn/attn.h"
#include "attn/attn_internal.h"

/* TILE_ROWS: query rows per tile and KV head, the GQA group times as many
 * query tokens of one sequence as fit (prefill), so each K/V row is read once
 * per tile. Page ranges: enough items to balance the threads, but each range
 * at least MIN_CHUNK_PAGES long, since every item re-prepares its tile's
 * query rows. */
enum { TILE_ROWS = 64, ITEMS_PER_THREAD = 4, MIN_CHUNK_PAGES = 8 };

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

/* An item is one tile over one range of its pages, for every KV head: pages
 * are the outer loop and heads the inner one, so each page half is read
 * front to back as one stream (per-head runs of P rows alone are too short
 * for the hardware prefetcher). */
struct tile {
    int32_t first, n_q; /* queries[first, first + n_q), one sequence */
    int32_t seq;
    int32_t n_pages;    /* pages up to the furthest position in the tile */
    int32_t n_chunks;   /* page ranges it is split into, one item each */
    int32_t item0;      /* index of its first item */
    size_t state0;      /* offset of its first item's state in states */
};

struct job {
    const struct kv_cache *kv;
    const struct attn_kernels *k;
    int layer, n_head, n_kv, group, dim;
    float scale;
    const struct attn_query *queries;
    const float *q;
    float *out;

    struct tile *tiles;
    int32_t n_tiles, n_items;
    int max_rows;         /* largest tile, in rows per KV head */
    float *states;        /* per item: n_kv x [m (R), l (R), acc (R, dim)] */
    uint8_t *scratch;     /* per thread */
    size_t scratch_bytes;
};

static int tile_rows(const struct job *j, const struct tile *t) { return t->n_q * j->group; }

static size_t head_state_floats(int rows, int dim) { return (size_t)rows * (dim + 2); }

static float *item_state(const struct job *j, const struct tile *t, int chunk, int head)
{
    int R = tile_rows(j, t);
    return j->states + t->state0 + ((size_t)chunk * j->n_kv + head) * head_state_floats(R, j->dim);
}

static const struct tile *find_tile(const struct job *j, int32_t item)
{
    int32_t lo = 0, hi = j->n_tiles - 1;
    while (lo < hi) { /* last tile with item0 <= item */
        int32_t mid = (lo + hi + 1) / 2;
        if (j->tiles[mid].item0 <= item)
            lo = mid;
        else
            hi = mid - 1;
    }
    return &j->tiles[lo];
}

/* Per-thread scratch: the tile's query rows for every head, one page of
 * scores, and the row limits. */
struct scratch {
    float *q;         /* (n_kv, R, dim) scaled, rotated */
    block_q8_0 *q8;   /* (n_kv, R, dim / 32), NULL when dim % 32 != 0 */
    float *q8d;       /* (n_kv, R, dim / 32) */
    float *s;         /* (R, P) */
    int32_t *limit;   /* (R) */
};

/* Bytes of one thread's scratch; with base, also where each part lives. */
static size_t scratch_layout(const struct job *j, uint8_t *base, struct scratch *out)
{
    const struct kv_config *c = kv_get_config(j->kv);
    size_t rows = (size_t)j->n_kv * j->max_rows, nb = (size_t)j->dim / QK8_0;
    size_t q = 0, s = q + rows * j->dim * sizeof(float);
    size_t q8d = s + (size_t)j->max_rows * c->page_tokens * sizeof(float);
    size_t limit = q8d + rows * nb * sizeof(float);
    size_t q8 = limit + (size_t)j->max_rows * sizeof(int32_t);
    size_t end = q8 + rows * nb * sizeof(block_q8_0);
    if (base) {
        out->q = (float *)(base + q);
        out->s = (float *)(base + s);
        out->q8d = (float *)(base + q8d);
        out->limit = (int32_t *)(base + limit);
        out->q8 = j->dim % QK8_0 == 0 ? (block_q8_0 *)(base + q8) : NULL;
    }
    return (end + 63) / 64 * 64;
}

/* Scaled, rotated query rows of one tile for every KV head, and their int8 copy. */
static void load_rows(const struct job *j, const struct tile *t, const struct scratch *sc)
{
    const struct kv_config *c = kv_get_config(j->kv);
    int d = j->dim, nb = d / QK8_0, R = tile_rows(j, t);
    for (int i = 0; i < t->n_q; i++)
        for (int g = 0; g < j->group; g++)
            sc->limit[i * j->group + g] = j->queries[t->first + i].pos + 1;
    for (int h = 0; h < j->n_kv; h++)
        for (int i = 0; i < t->n_q; i++)
            for (int g = 0; g < j->group; g++) {
                size_t r = (size_t)h * R + i * j->group + g;
                const float *src = j->q + ((size_t)(t->first + i) * j->n_head + (size_t)h * j->group + g) * d;
                float *dst = sc->q + r * d;
                for (int e = 0; e < d; e++)
                    dst[e] = src[e] * j->scale;
                if (c->rotate)
                    j->k->rotate(dst, d);
                if (sc->q8)
                    attn_quantize_q8(dst, sc->q8 + r * nb, sc->q8d + r * nb, d);
            }
}

/* Pages are separate allocations, so the hardware prefetcher loses the
 * stream at every page boundary: ask for all of the next page's K and V rows
 * of this layer (two contiguous runs, every KV head) while this page is
 * computed. always_inline: as a separate function with no side effects, GCC
 * deletes the call (prefetches do not count as effects), which the first
 * version of this code silently suffered from. */
static inline __attribute__((always_inline)) void prefetch_page(const struct kv_config *c,
                                                                const struct kv_page_view *pg, int layer)
{
    size_t rows = (size_t)c->page_tokens * c->n_kv_head;
    const char *k = (const char *)kv_view_run(c, pg->k, pg->k_row_bytes, layer, 0);
    const char *v = (const char *)kv_view_run(c, pg->v, pg->v_row_bytes, layer, 0);
    size_t nk = rows * pg->k_row_bytes, nv = rows * pg->v_row_bytes;
    for (size_t o = 0; o < nk; o += 64)
        __builtin_prefetch(k + o);
    for (size_t o = 0; o < nv; o += 64)
        __builtin_prefetch(v + o);
}

static void run_item(const struct job *j, int32_t item, uint8_t *scratch)
{
    const struct kv_cache *kv = j->kv;
    const struct kv_config *c = kv_get_config(kv);
    const struct tile *t = find_tile(j, item);
    int chunk = item - t->item0, R = tile_rows(j, t), d = j->dim, nb = d / QK8_0, P = c->page_tokens;
    struct scratch sc = {0};
    scratch_layout(j, scratch, &sc);
    load_rows(j, t, &sc);

    struct attn_rows rows = {.n = R, .dim = d, .stride = P, .s = sc.s, .limit = sc.limit};
    for (int h = 0; h < j->n_kv; h++) {
        float *st = item_state(j, t, chunk, h);
        for (int r = 0; r < R; r++) {
            st[r] = -INFINITY;
            st[R + r] = 0.0f;
        }
        memset(st + 2 * R, 0, (size_t)R * d * sizeof(float));
    }
    int32_t max_limit = 0;
    for (int r = 0; r < R; r++)
        max_limit = sc.limit[r] > max_limit ? sc.limit[r] : max_limit;

    int64_t lo, hi;
    threads_split(t->n_pages, chunk, t->n_chunks, &lo, &hi);
    /* the walk stays inside the page table and the sequence's tokens */
    assert(t->n_pages <= kv_seq_n_pages(kv, t->seq) && max_limit <= kv_seq_len(kv, t->seq) && lo >= 0 &&
           hi <= t->n_pages);
    struct kv_page_view page, next;
    if (lo < hi)
        kv_seq_page_view(kv, t->seq, (int32_t)lo, &next);
    for (int64_t p = lo; p < hi; p++) {
        page = next;
        if (p + 1 < hi) {
            kv_seq_page_view(kv, t->seq, (int32_t)p + 1, &next);
            prefetch_page(c, &next, j->layer);
        }
        const struct kv_page_view *pg = &page;
        int page_start = (int)(p * P);
        int n_tok = max_limit - page_start < P ? max_limit - page_start : P;
        assert(n_tok > 0 && n_tok <= P && kv_type_index(pg->tk) >= 0 && kv_type_index(pg->tv) >= 0);
        attn_score_fn score = j->k->score[kv_type_index(pg->tk)];
        attn_accum_fn accum = j->k->accum[kv_type_index(pg->tv)];
        for (int h = 0; h < j->n_kv; h++) {
            float *st = item_state(j, t, chunk, h);
            rows.q = sc.q + (size_t)h * R * d;
            rows.q8 = sc.q8 ? sc.q8 + (size_t)h * R * nb : NULL;
            rows.q8d = sc.q8d + (size_t)h * R * nb;
            rows.m = st;
            rows.l = st + R;
            rows.acc = st + 2 * R;
            const uint8_t *k_rows = kv_view_run(c, pg->k, pg->k_row_bytes, j->layer, h);
            attn_set_bounds(&rows, k_rows, (size_t)P * pg->k_row_bytes);
            score(k_rows, n_tok, &rows);
            j->k->softmax(&rows, page_start, n_tok);
            const uint8_t *v_rows = kv_view_run(c, pg->v, pg->v_row_bytes, j->layer, h);
            attn_set_bounds(&rows, v_rows, (size_t)P * pg->v_row_bytes);
            accum(v_rows, n_tok, &rows);
        }
    }
}

static void phase_items(void *ctx, int ith, int nth)
{
    struct job *j = ctx;
    int64_t lo, hi;
    threads_split(j->n_items, ith, nth, &lo, &hi);
    for (int64_t i = lo; i < hi; i++)
        run_item(j, (int32_t)i, j->scratch + (size_t)ith * j->scratch_bytes);
}

/* Merge the chunks of one (tile, head), normalize, add the V means back
 * (smoothing: the weights sum to 1), rotate back, store. */
static void finish(const struct job *j, const struct tile *t, int head)
{
    const struct kv_config *c = kv_get_config(j->kv);
    int R = tile_rows(j, t), d = j->dim;
    const float *mean_v = kv_seq_mean(j->kv, t->seq, j->layer, true);
    float *base = item_state(j, t, 0, head);
    for (int ch = 1; ch < t->n_chunks; ch++) {
        float *o = item_state(j, t, ch, head);
        for (int r = 0; r < R; r++) {
            if (o[R + r] == 0.0f)
                continue;
            float m = base[r] > o[r] ? base[r] : o[r];
            float a = base[R + r] == 0.0f ? 0.0f : expf(base[r] - m), b = expf(o[r] - m);
            float *acc = base + 2 * R + (size_t)r * d, *oacc = o + 2 * R + (size_t)r * d;
            for (int e = 0; e < d; e++)
                acc[e] = acc[e] * a + oacc[e] * b;
            base[R + r] = base[R + r] * a + o[R + r] * b;
            base[r] = m;
        }
    }
    for (int i = 0; i < t->n_q; i++)
        for (int g = 0; g < j->group; g++) {
            int r = i * j->group + g;
            float *acc = base + 2 * R + (size_t)r * d;
            float inv = base[R + r] > 0.0f ? 1.0f / base[R + r] : 0.0f;
            for (int e = 0; e < d; e++)
                acc[e] *= inv;
            for (int e = 0; mean_v && e < d; e++)
                acc[e] += mean_v[(size_t)head * d + e];
            if (c->rotate)
                j->k->rotate(acc, d);
            float *dst = j->out + ((size_t)(t->first + i) * j->n_head + (size_t)head * j->group + g) * d;
            memcpy(dst, acc, (size_t)d * sizeof(float));
        }
}

static void phase_finish(void *ctx, int ith, int nth)
{
    struct job *j = ctx;
    int64_t lo, hi;
    threads_split((int64_t)j->n_tiles * j->n_kv, ith, nth, &lo, &hi);
    for (int64_t i = lo; i < hi; i++)
        finish(j, &j->tiles[i / j->n_kv], (int)(i % j->n_kv));
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

/* Consecutive queries of one sequence share a tile; returns the floats of
 * state all items need. */
static size_t make_tiles(struct job *j, int32_t n_queries, int nth)
{
    const struct kv_config *c = kv_get_config(j->kv);
    int per_tile = TILE_ROWS / j->group;
    int32_t n = 0;
    for (int32_t i = 0; i < n_queries;) {
        struct tile *t = &j->tiles[n++];
        t->first = i;
        t->seq = j->queries[i].seq;
        int32_t max_pos = 0;
        while (i < n_queries && i - t->first < per_tile && j->queries[i].seq == t->seq) {
            max_pos = j->queries[i].pos > max_pos ? j->queries[i].pos : max_pos;
            i++;
        }
        t->n_q = i - t->first;
        t->n_pages = (max_pos + c->page_tokens) / c->page_tokens;
    }
    j->n_tiles = n;
    /* split long sequences into page ranges when there are too few tiles to
     * keep every thread busy (decode of one or a few sequences) */
    int64_t want = (int64_t)nth * ITEMS_PER_THREAD;
    int32_t split = nth > 1 && n < want ? (int32_t)((want + n - 1) / n) : 1;
    int32_t items = 0;
    size_t floats = 0;
    j->max_rows = 0;
    for (int32_t i = 0; i < n; i++) {
        struct tile *t = &j->tiles[i];
        int R = tile_rows(j, t);
        int32_t most = (t->n_pages + MIN_CHUNK_PAGES - 1) / MIN_CHUNK_PAGES;
        most = most > nth ? most : nth < t->n_pages ? nth : t->n_pages;
        t->n_chunks = split < most ? split : most;
        t->item0 = items;
        t->state0 = floats;
        items += t->n_chunks;
        floats += (size_t)t->n_chunks * j->n_kv * head_state_floats(R, j->dim);
        j->max_rows = R > j->max_rows ? R : j->max_rows;
    }
    j->n_items = items;
    return floats;
}

ks_status attn_forward(threads_pool *pool, const struct kv_cache *kv, int layer, const struct attn_query *queries,
                       int32_t n_queries, const float *q, float *out, int n_head, float scale)
{
    ks_status st = check_args(kv, layer, queries, n_queries, n_head);
    if (st || n_queries == 0)
        return st;
    const struct kv_config *c = kv_get_config(kv);
    int nth = pool ? threads_count(pool) : 1;
    struct job j = {
        .kv = kv, .k = forced ? forced : attn_kernels_best(), .layer = layer, .n_head = n_head,
        .n_kv = c->n_kv_head, .group = n_head / c->n_kv_head, .dim = c->head_dim, .scale = scale,
        .queries = queries, .q = q, .out = out,
    };
    j.tiles = malloc((size_t)n_queries * sizeof *j.tiles);
    if (!j.tiles)
        return ks_fail(KS_ERR_NOMEM, "attn: out of host memory");
    size_t state_floats = make_tiles(&j, n_queries, nth);
    j.scratch_bytes = scratch_layout(&j, NULL, NULL);
    j.states = malloc(state_floats * sizeof(float));
    j.scratch = aligned_alloc(64, (size_t)nth * j.scratch_bytes);
    if (!j.states || !j.scratch) {
        free(j.tiles);
        free(j.states);
        free(j.scratch);
        return ks_fail(KS_ERR_NOMEM, "attn: out of host memory for %d items", (int)j.n_items);
    }
    threads_run(pool, phase_items, &j);
    threads_run(pool, phase_finish, &j);
    free(j.tiles);
    free(j.states);
    free(j.scratch);
    return KS_OK;
}
