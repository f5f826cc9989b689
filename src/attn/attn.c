/* attn_forward: tiles of query rows x KV heads x page ranges, one online-
 * softmax pass per item over the page table, then a merge of the partial
 * softmax states of each (tile, KV head). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attn/attn.h"
#include "attn/attn_internal.h"

/* Query rows per tile: the GQA group times as many query tokens of one
 * sequence as fit (prefill), so each K/V row is read once per tile. */
enum { TILE_ROWS = 64, ITEMS_PER_THREAD = 4 };

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
    int32_t n_pages;    /* pages up to the furthest position in the tile */
    int32_t n_chunks;   /* page ranges it is split into */
    int32_t item0;      /* index of its first item (head 0, chunk 0) */
};

struct job {
    const struct kv_cache *kv;
    const struct attn_kernels *k;
    int layer, n_head, group, dim;
    float scale;
    const struct attn_query *queries;
    const float *q;
    float *out;

    struct tile *tiles;
    int32_t n_tiles, n_items;
    size_t state_floats;  /* per item: R * (dim + 2) */
    float *states;        /* (n_items, state_floats) */
    uint8_t *scratch;     /* per thread */
    size_t scratch_bytes;
};

static int tile_rows(const struct job *j, const struct tile *t) { return t->n_q * j->group; }

static void find_item(const struct job *j, int32_t item, const struct tile **t, int *head, int *chunk)
{
    int32_t lo = 0, hi = j->n_tiles - 1;
    while (lo < hi) { /* last tile with item0 <= item */
        int32_t mid = (lo + hi + 1) / 2;
        if (j->tiles[mid].item0 <= item)
            lo = mid;
        else
            hi = mid - 1;
    }
    *t = &j->tiles[lo];
    int32_t rel = item - (*t)->item0;
    *head = rel / (*t)->n_chunks;
    *chunk = rel % (*t)->n_chunks;
}

/* Scaled, rotated query rows of one (tile, KV head), and their int8 copy. */
static void load_rows(const struct job *j, const struct tile *t, int head, float *q, block_q8_0 *q8, float *q8d,
                      int32_t *limit)
{
    const struct kv_config *c = kv_get_config(j->kv);
    int d = j->dim;
    for (int i = 0; i < t->n_q; i++) {
        const struct attn_query *qq = &j->queries[t->first + i];
        for (int g = 0; g < j->group; g++) {
            int r = i * j->group + g;
            const float *src = j->q + ((size_t)(t->first + i) * j->n_head + (size_t)head * j->group + g) * d;
            for (int e = 0; e < d; e++)
                q[(size_t)r * d + e] = src[e] * j->scale;
            if (c->rotate)
                kv_rotate(q + (size_t)r * d, d);
            if (q8)
                attn_quantize_q8(q + (size_t)r * d, q8 + (size_t)r * (d / QK8_0), q8d + (size_t)r * (d / QK8_0), d);
            limit[r] = qq->pos + 1;
        }
    }
}

/* Mask positions a row cannot see, then fold the page into the running state
 * (m, l, acc): scores become probabilities in place. */
static void softmax_update(const struct attn_kernels *k, struct attn_rows *rows, int page_start, int n_tok)
{
    for (int r = 0; r < rows->n; r++) {
        float *s = rows->s + (size_t)r * rows->stride;
        int vis = rows->limit[r] - page_start;
        vis = vis < 0 ? 0 : vis > n_tok ? n_tok : vis;
        float mx = rows->m[r];
        for (int t = 0; t < vis; t++)
            mx = s[t] > mx ? s[t] : mx;
        for (int t = vis; t < n_tok; t++)
            s[t] = 0.0f;
        if (vis == 0)
            continue;
        float corr = expf(rows->m[r] - mx);
        if (corr != 1.0f) {
            float *acc = rows->acc + (size_t)r * rows->dim;
            for (int e = 0; e < rows->dim; e++)
                acc[e] *= corr;
        }
        rows->l[r] = rows->l[r] * corr + k->exp_sum(s, vis, mx);
        rows->m[r] = mx;
    }
}

/* Pages are separate allocations, so the hardware prefetcher loses the
 * stream at every page boundary; ask for the next page's K/V rows while
 * this one is being computed. */
static void prefetch_page(const struct kv_cache *kv, const struct kv_page *pg, int layer, int head)
{
    int P = kv->cfg.page_tokens, d = kv->cfg.head_dim;
    size_t rk = (size_t)P * kv_row_bytes(pg->tk, d), rv = (size_t)P * kv_row_bytes(pg->tv, d);
    const char *k = (const char *)kv_page_rows(kv, pg->k, pg->tk, layer, head);
    const char *v = (const char *)kv_page_rows(kv, pg->v, pg->tv, layer, head);
    for (size_t o = 0; o < rk; o += 64)
        __builtin_prefetch(k + o);
    for (size_t o = 0; o < rv; o += 64)
        __builtin_prefetch(v + o);
}

static void run_item(const struct job *j, int32_t item, uint8_t *scratch)
{
    const struct kv_cache *kv = j->kv;
    const struct kv_config *c = kv_get_config(kv);
    const struct tile *t;
    int head, chunk;
    find_item(j, item, &t, &head, &chunk);
    int R = tile_rows(j, t), d = j->dim, P = c->page_tokens;
    bool quant_ok = d % QK8_0 == 0;

    float *q = (float *)scratch;
    float *s = q + (size_t)TILE_ROWS * d;
    int32_t *limit = (int32_t *)(s + (size_t)TILE_ROWS * P);
    float *q8d = (float *)(limit + TILE_ROWS);
    block_q8_0 *q8 = quant_ok ? (block_q8_0 *)(q8d + (size_t)TILE_ROWS * (d / QK8_0)) : NULL;
    load_rows(j, t, head, q, q8, q8d, limit);

    float *st = j->states + (size_t)item * j->state_floats;
    struct attn_rows rows = {
        .n = R, .dim = d, .stride = P, .q = q, .q8 = q8, .q8d = q8d, .limit = limit,
        .m = st, .l = st + R, .acc = st + 2 * R, .s = s,
    };
    for (int r = 0; r < R; r++) {
        rows.m[r] = -INFINITY;
        rows.l[r] = 0.0f;
    }
    memset(rows.acc, 0, (size_t)R * d * sizeof(float));

    int64_t lo, hi;
    threads_split(t->n_pages, chunk, t->n_chunks, &lo, &hi);
    const struct kv_seq *sq = &kv->seqs[t->seq];
    int32_t max_limit = 0;
    for (int r = 0; r < R; r++)
        max_limit = limit[r] > max_limit ? limit[r] : max_limit;
    for (int64_t p = lo; p < hi; p++) {
        const struct kv_page *pg = &kv->pages[sq->pages[p]];
        if (p + 1 < hi)
            prefetch_page(kv, &kv->pages[sq->pages[p + 1]], j->layer, head);
        int page_start = (int)(p * P);
        int n_tok = max_limit - page_start < P ? max_limit - page_start : P;
        j->k->score[kv_type_index(pg->tk)](kv_page_rows(kv, pg->k, pg->tk, j->layer, head), n_tok, &rows);
        softmax_update(j->k, &rows, page_start, n_tok);
        j->k->accum[kv_type_index(pg->tv)](kv_page_rows(kv, pg->v, pg->tv, j->layer, head), n_tok, &rows);
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

/* Merge the chunks of one (tile, head), normalize, rotate back, store. */
static void finish(const struct job *j, const struct tile *t, int head)
{
    const struct kv_config *c = kv_get_config(j->kv);
    int R = tile_rows(j, t), d = j->dim;
    float *base = j->states + (size_t)(t->item0 + head * t->n_chunks) * j->state_floats;
    for (int ch = 1; ch < t->n_chunks; ch++) {
        float *o = base + (size_t)ch * j->state_floats;
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
            if (c->rotate)
                kv_rotate(acc, d);
            float *dst = j->out + ((size_t)(t->first + i) * j->n_head + (size_t)head * j->group + g) * d;
            memcpy(dst, acc, (size_t)d * sizeof(float));
        }
}

static void phase_finish(void *ctx, int ith, int nth)
{
    struct job *j = ctx;
    int n_kv = kv_get_config(j->kv)->n_kv_head;
    int64_t lo, hi;
    threads_split((int64_t)j->n_tiles * n_kv, ith, nth, &lo, &hi);
    for (int64_t i = lo; i < hi; i++)
        finish(j, &j->tiles[i / n_kv], (int)(i % n_kv));
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
        if (s < 0 || s >= kv->n_seq_slots || !kv->seqs[s].live)
            return ks_fail(KS_ERR_NOT_FOUND, "attn: query %d: sequence %d does not exist", (int)i, (int)s);
        if (queries[i].pos < 0 || queries[i].pos >= kv->seqs[s].len)
            return ks_fail(KS_ERR_RANGE, "attn: query %d: position %d outside sequence %d of %d tokens", (int)i,
                           (int)queries[i].pos, (int)s, (int)kv->seqs[s].len);
    }
    return KS_OK;
}

/* Consecutive queries of one sequence share a tile. */
static int32_t make_tiles(struct job *j, int32_t n_queries, int nth)
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
    /* split long sequences into page ranges when there are too few tiles to
     * keep every thread busy (decode of one or a few sequences) */
    int64_t want = (int64_t)nth * ITEMS_PER_THREAD;
    int64_t base = (int64_t)n * c->n_kv_head;
    int32_t split = nth > 1 && base < want ? (int32_t)((want + base - 1) / base) : 1;
    int32_t items = 0;
    for (int32_t i = 0; i < n; i++) {
        struct tile *t = &j->tiles[i];
        t->n_chunks = split < t->n_pages ? split : t->n_pages;
        t->item0 = items;
        items += t->n_chunks * c->n_kv_head;
    }
    j->n_items = items;
    return n;
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
        .group = n_head / c->n_kv_head, .dim = c->head_dim, .scale = scale, .queries = queries, .q = q, .out = out,
    };
    j.tiles = malloc((size_t)n_queries * sizeof *j.tiles);
    if (!j.tiles)
        return ks_fail(KS_ERR_NOMEM, "attn: out of host memory");
    j.n_tiles = make_tiles(&j, n_queries, nth);
    j.state_floats = (size_t)TILE_ROWS * (j.dim + 2);
    int d = j.dim;
    j.scratch_bytes = (size_t)TILE_ROWS * d * sizeof(float) + (size_t)TILE_ROWS * c->page_tokens * sizeof(float) +
                      TILE_ROWS * sizeof(int32_t) + (size_t)TILE_ROWS * (d / QK8_0) * (sizeof(block_q8_0) + sizeof(float));
    j.scratch_bytes = (j.scratch_bytes + 63) / 64 * 64;
    j.states = malloc((size_t)j.n_items * j.state_floats * sizeof(float));
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
