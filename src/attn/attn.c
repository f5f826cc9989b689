/* attn_forward: one item per (tile of query rows, KV head). An item's pages
 * are cut into segments of SEG_TOKENS positions, fixed by page index: each
 * segment is an online-softmax pass over its pages from an empty state, and
 * the segments' states are folded into the rows' state in page order. So a
 * query row's output depends on nothing but its own sequence's pages: not
 * on the other queries of the batch, nor on how many threads share the work.
 * When there are fewer items than threads (a decode step of a model with one
 * or two KV heads: gemma3), the segments of an item run on different threads
 * and the last one to finish folds them, in the same order: the same bits as
 * one thread running the item's segments one after the other. */
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

/* SEG_TOKENS: positions per segment (a whole number of pages, at least one):
 * a decode step of a 4k context splits into 16, and a fold (R x dim
 * multiply-adds) is ~1% of a segment's work. SPLIT_STATE_MAX: bytes of
 * stored segment states above which the items run whole instead (same
 * bits, less parallelism). */
enum { SEG_TOKENS = 256, SPLIT_STATE_MAX = 8 << 20 };

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
    atomic_int next_unit; /* units are taken from a shared counter: their costs differ with their contexts */
    int max_rows;         /* largest tile, in rows */
    uint8_t *scratch;     /* per thread */
    size_t scratch_bytes;
    int seg_pages;        /* pages per segment */

    /* split: a unit is one segment of an item, its state stored in its slot
     * of states (max_rows x (dim + 2) floats); else a unit is a whole item */
    bool split;
    int32_t n_units;
    struct unit *units;
    float *states;
    atomic_int *segs_left; /* per item: segments not yet stored */
};

struct unit {
    int32_t item;
    int32_t seg;       /* split: the segment's index within its item */
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
    float *m, *l;     /* (R) the rows' state: max and sum of exp */
    float *acc;       /* (R, dim) */
    float *sm, *sl;   /* (R) the current segment's state */
    float *sacc;      /* (R, dim) */
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
    size_t sm = koff + rows * sizeof(float);
    size_t sl = sm + rows * sizeof(float);
    size_t sacc = sl + rows * sizeof(float);
    size_t q8 = sacc + rows * j->dim * sizeof(float);
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
        out->sm = (float *)(base + sm);
        out->sl = (float *)(base + sl);
        out->sacc = (float *)(base + sacc);
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
static inline __attribute__((always_inline)) void prefetch_bytes(const void *p, size_t n)
{
    for (size_t o = 0; o < n; o += 64)
        __builtin_prefetch((const char *)p + o);
}

static inline __attribute__((always_inline)) void prefetch_page(const struct kv_config *c,
                                                                const struct kv_page_view *pg, int head)
{
    prefetch_bytes(kv_view_run(c, pg->k, pg->k_row_bytes, head), (size_t)c->page_tokens * pg->k_row_bytes);
    prefetch_bytes(kv_view_run(c, pg->v, pg->v_row_bytes, head), (size_t)c->page_tokens * pg->v_row_bytes);
}

/* A decode step reads each page once and computes little on it, so the next
 * page must arrive while this one is computed. Asked for at once (a page's
 * 256 lines of f16 K and V at head_dim 128), the prefetches fill the core's
 * miss buffers and the page's own loads queue behind them: compute and memory
 * barely overlapped (bench_attn -L 32, 4096 f16, one thread: 2.0 ms against
 * 0.95 from cache). A tile of few rows therefore runs a page in chunks of
 * about CHUNK_BYTES of K (then V) rows, and before each chunk asks for the
 * next page's rows at the same place: 1.57 ms. Many rows compute long enough
 * on a page to hide one burst, and chunks would reload their accumulators;
 * rows of more than CHUNK_BYTES / CHUNK_MIN_TOKENS bytes are not chunked either
 * (gemma3's 512-byte f16 rows in chunks of 8: 18% slower from cache, 10%
 * faster from memory, and its 4096-token cache fits in L3). */
enum { CHUNK_BYTES = 2048, CHUNK_MAX_ROWS = 16, CHUNK_MIN_TOKENS = 8 };

static int chunk_tokens(int R, size_t row_bytes, int P)
{
    int n = (int)(CHUNK_BYTES / row_bytes);
    if (R > CHUNK_MAX_ROWS || n < CHUNK_MIN_TOKENS)
        return P;
    n = (n + CHUNK_MIN_TOKENS - 1) / CHUNK_MIN_TOKENS * CHUNK_MIN_TOKENS; /* whole groups of the score kernels' tokens */
    return n < P ? n : P;
}

/* A page run of rows and where the next page's run of the same head is
 * (NULL: no next page); their types may differ. */
struct page_runs {
    const uint8_t *rows, *next;
    size_t row_bytes, next_row_bytes;
};

/* A score or accum kernel over a page's first n_tok rows, chunk tokens at a
 * time, each chunk first prefetching the same tokens' rows of the next page
 * (P rows). Scores and probabilities are per token and accumulation runs the
 * tokens in order: the same bits as one call. */
static void run_chunks(attn_score_fn kernel, const struct page_runs *r, int n_tok, int P, int chunk,
                       const struct attn_rows *rows)
{
    for (int t0 = 0; t0 < n_tok; t0 += chunk) {
        struct attn_rows part = *rows;
        part.s = rows->s + t0;
        if (r->next)
            prefetch_bytes(r->next + (size_t)t0 * r->next_row_bytes, (size_t)(P - t0 < chunk ? P - t0 : chunk) * r->next_row_bytes);
        kernel(r->rows + (size_t)t0 * r->row_bytes, n_tok - t0 < chunk ? n_tok - t0 : chunk, &part);
    }
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

/* An empty segment state for R rows. */
static void segment_reset(const struct scratch *sc, int R, int d)
{
    for (int r = 0; r < R; r++) {
        sc->sm[r] = -INFINITY;
        sc->sl[r] = 0.0f;
    }
    memset(sc->sacc, 0, (size_t)R * d * sizeof(float));
}

/* Fold a segment's state (sm, sl, sacc) into the rows' (m, l, acc): both
 * rescaled to their common max. A segment a row saw nothing of leaves the
 * row's state as it was, and a first segment is taken as it is: exactly,
 * so which rows share a tile never changes a row's bits. */
static void fold_segment(float *m, float *l, float *acc, const float *sm, const float *sl, const float *sacc, int R,
                         int d)
{
    for (int r = 0; r < R; r++) {
        if (sm[r] == -INFINITY)
            continue;
        float mx = sm[r] > m[r] ? sm[r] : m[r];
        float a = expf(m[r] - mx), b = expf(sm[r] - mx);
        float *y = acc + (size_t)r * d;
        const float *x = sacc + (size_t)r * d;
        for (int e = 0; e < d; e++)
            y[e] = y[e] * a + x[e] * b;
        l[r] = l[r] * a + sl[r] * b;
        m[r] = mx;
    }
}

/* The pages [p0, p1) of a tile for KV head h into the segment state of sc
 * (reset first). */
static void run_segment(const struct job *j, const struct tile *t, int h, int32_t p0, int32_t p1,
                        struct scratch *sc, bool *q8_ready)
{
    const struct kv_cache *kv = j->kv;
    const struct kv_config *c = kv_get_config(kv);
    int R = tile_rows(j, t), d = j->dim, P = c->page_tokens;
    int32_t max_limit = 0;
    for (int r = 0; r < R; r++)
        max_limit = sc->limit[r] > max_limit ? sc->limit[r] : max_limit;
    /* the walk stays inside the page table and the sequence's tokens */
    assert(p1 <= kv_seq_n_pages(kv, t->seq) && max_limit <= kv_seq_len(kv, t->seq));
    segment_reset(sc, R, d);
    struct attn_rows rows = {.n = R, .dim = d, .stride = P, .s = sc->s, .limit = sc->limit, .q = sc->q,
                             .q8 = sc->q8, .q8d = sc->q8d, .m = sc->sm, .l = sc->sl, .acc = sc->sacc,
                             .first = j->p.window > 0 ? sc->first : NULL};
    struct kv_page_view page, next;
    kv_seq_page_view(kv, t->seq, p0, j->layer, &next);
    prefetch_page(c, &next, h); /* decode's short contexts are a page or three */
    for (int32_t p = p0; p < p1; p++) {
        page = next;
        const bool has_next = p + 1 < t->n_pages; /* past the segment's end too: a whole item's next segment starts there */
        if (has_next)
            kv_seq_page_view(kv, t->seq, p + 1, j->layer, &next);
        int page_start = p * P;
        int n_tok = max_limit - page_start < P ? max_limit - page_start : P;
        assert(n_tok > 0 && n_tok <= P && kv_type_index(page.tk) >= 0 && kv_type_index(page.tv) >= 0);
        if (sc->q8 && !*q8_ready && quant_traits(page.tk)->is_quantized) {
            quantize_rows(j, t, sc);
            *q8_ready = true;
        }
        /* rows of a few bytes: one chunk, and the next page asked for at once; the last page: one chunk */
        const int k_chunk = has_next ? chunk_tokens(R, page.k_row_bytes, P) : P;
        const int v_chunk = has_next ? chunk_tokens(R, page.v_row_bytes, P) : P;
        const bool chunked = k_chunk < P || v_chunk < P;
        if (has_next && !chunked)
            prefetch_page(c, &next, h);
        const struct page_runs k = {kv_view_run(c, page.k, page.k_row_bytes, h),
                                    chunked ? kv_view_run(c, next.k, next.k_row_bytes, h) : NULL, page.k_row_bytes,
                                    next.k_row_bytes};
        attn_set_bounds(&rows, k.rows, (size_t)P * page.k_row_bytes);
        run_chunks(j->k->score[kv_type_index(page.tk)], &k, n_tok, P, k_chunk, &rows);
        if (j->p.softcap > 0.0f)
            softcap_scores(j, sc, R, P, n_tok);
        j->k->softmax(&rows, page_start, n_tok);
        const struct page_runs v = {kv_view_run(c, page.v, page.v_row_bytes, h),
                                    chunked ? kv_view_run(c, next.v, next.v_row_bytes, h) : NULL, page.v_row_bytes,
                                    next.v_row_bytes};
        attn_set_bounds(&rows, v.rows, (size_t)P * page.v_row_bytes);
        run_chunks(j->k->accum[kv_type_index(page.tv)], &v, n_tok, P, v_chunk, &rows);
    }
}

/* Segment k of tile t: its pages [*p0, *p1), fixed by page index (the first
 * and last cut to the tile's pages). */
static int32_t tile_first_seg(const struct job *j, const struct tile *t) { return t->first_page / j->seg_pages; }
static int32_t tile_n_segs(const struct job *j, const struct tile *t)
{
    return (t->n_pages - 1) / j->seg_pages - tile_first_seg(j, t) + 1;
}
static void seg_pages(const struct job *j, const struct tile *t, int32_t k, int32_t *p0, int32_t *p1)
{
    int32_t s = tile_first_seg(j, t) + k;
    *p0 = s * j->seg_pages > t->first_page ? s * j->seg_pages : t->first_page;
    *p1 = (s + 1) * j->seg_pages < t->n_pages ? (s + 1) * j->seg_pages : t->n_pages;
}

/* A whole item = (tile, KV head): its segments in order, each folded in. */
static void run_item(const struct job *j, int32_t item, uint8_t *scratch)
{
    const struct tile *t = &j->tiles[item / j->n_kv];
    int h = item % j->n_kv;
    struct scratch sc = {0};
    scratch_layout(j, scratch, &sc);
    load_rows(j, t, h, &sc);
    bool q8_ready = false;
    for (int32_t k = 0, n = tile_n_segs(j, t); k < n; k++) {
        int32_t p0, p1;
        seg_pages(j, t, k, &p0, &p1);
        run_segment(j, t, h, p0, p1, &sc, &q8_ready);
        fold_segment(sc.m, sc.l, sc.acc, sc.sm, sc.sl, sc.sacc, tile_rows(j, t), j->dim);
    }
    store_rows(j, t, h, &sc);
}

/* Where a split item's unit (one of its segments) keeps its state: m, l
 * (max_rows each), then acc (max_rows x dim). */
static float *seg_state(const struct job *j, int32_t unit)
{
    return j->states + (size_t)unit * (size_t)j->max_rows * (size_t)(j->dim + 2);
}

/* One segment of a split item; the last of its segments to finish folds
 * them all in order and stores the rows. */
static void run_split_unit(const struct job *j, const struct unit *u, int32_t unit, uint8_t *scratch)
{
    const struct tile *t = &j->tiles[u->item / j->n_kv];
    int h = u->item % j->n_kv, R = tile_rows(j, t), d = j->dim, M = j->max_rows;
    struct scratch sc = {0};
    scratch_layout(j, scratch, &sc);
    load_rows(j, t, h, &sc);
    bool q8_ready = false;
    int32_t p0, p1;
    seg_pages(j, t, u->seg, &p0, &p1);
    float *st = seg_state(j, unit); /* the segment's state goes straight to its slot */
    sc.sm = st, sc.sl = st + M, sc.sacc = st + 2 * M;
    run_segment(j, t, h, p0, p1, &sc, &q8_ready);
    /* acq_rel: the last one out sees every other segment's stored state */
    if (atomic_fetch_sub_explicit(&j->segs_left[u->item], 1, memory_order_acq_rel) != 1)
        return;
    int32_t first = unit - u->seg; /* an item's segments are consecutive units */
    for (int32_t k = 0, n = tile_n_segs(j, t); k < n; k++) {
        const float *x = seg_state(j, first + k);
        fold_segment(sc.m, sc.l, sc.acc, x, x + M, x + 2 * M, R, d);
    }
    store_rows(j, t, h, &sc);
}

static void phase_units(void *ctx, int ith, int nth)
{
    struct job *j = ctx;
    (void)nth;
    uint8_t *scratch = j->scratch + (size_t)ith * j->scratch_bytes;
    for (int32_t i; (i = atomic_fetch_add_explicit(&j->next_unit, 1, memory_order_relaxed)) < j->n_units;) {
        if (j->split)
            run_split_unit(j, &j->units[i], i, scratch);
        else
            run_item(j, i, scratch);
    }
}

static ks_status check_args(const struct kv_cache *kv, int layer, const struct attn_query *queries,
                            int32_t n_queries, int n_head, const struct attn_params *p)
{
    const struct kv_config *c = kv_get_config(kv);
    /* a window layer's early pages may have lost their rows: only a window within the cache's reads them */
    if (kv_layer_windowed(c, layer) && (p->window <= 0 || p->window > c->swa_window))
        return ks_fail(KS_ERR_INVALID_ARG, "attn: layer %d is a sliding-window layer of the KV cache (window %d): "
                       "attention over it needs a window of 1 to %d, not %d", layer, (int)c->swa_window,
                       (int)c->swa_window, (int)p->window);
    if (layer < 0 || layer >= c->n_layer)
        return ks_fail(KS_ERR_RANGE, "attn: layer %d out of [0, %d)", layer, c->n_layer);
    if (n_head <= 0 || n_head % c->n_kv_head != 0)
        return ks_fail(KS_ERR_INVALID_ARG, "attn: %d query heads is not a multiple of %d KV heads", n_head,
                       c->n_kv_head);
    if (n_head / c->n_kv_head > TILE_ROWS)
        return ks_fail(KS_ERR_UNSUPPORTED, "attn: more than %d query heads per KV head", TILE_ROWS);
    int32_t first_seq = -1, first_page = 0; /* the last query's sequence and its first page with the layer's rows */
    for (int32_t i = 0; i < n_queries; i++) {
        int32_t s = queries[i].seq;
        if (!kv_seq_exists(kv, s))
            return ks_fail(KS_ERR_NOT_FOUND, "attn: query %d: sequence %d does not exist", (int)i, (int)s);
        if (queries[i].pos < 0 || queries[i].pos >= kv_seq_len(kv, s))
            return ks_fail(KS_ERR_RANGE, "attn: query %d: position %d outside sequence %d of %d tokens", (int)i,
                           (int)queries[i].pos, (int)s, (int)kv_seq_len(kv, s));
        if (s != first_seq) {
            first_seq = s;
            first_page = kv_seq_first_page(kv, s, layer);
        }
        if (window_first(p, queries[i].pos) / c->page_tokens < first_page)
            return ks_fail(KS_ERR_STATE, "attn: query %d at position %d of sequence %d reads keys whose sliding-window "
                           "rows are freed (a position before the sequence's window)", (int)i, (int)queries[i].pos,
                           (int)s);
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

/* Whole items when there are enough of them to share the threads, else
 * one unit per segment (if their states fit SPLIT_STATE_MAX). */
static ks_status plan_units(struct job *j, int nth)
{
    int32_t n_items = j->n_tiles * j->n_kv, n_segs = 0;
    for (int32_t i = 0; i < j->n_tiles; i++)
        n_segs += tile_n_segs(j, &j->tiles[i]) * j->n_kv;
    size_t state_bytes = (size_t)n_segs * (size_t)j->max_rows * (size_t)(j->dim + 2) * sizeof(float);
    j->split = nth > 1 && n_items < nth && n_segs > n_items && state_bytes <= SPLIT_STATE_MAX;
    j->n_units = j->split ? n_segs : n_items;
    if (!j->split)
        return KS_OK;
    j->units = malloc((size_t)n_segs * sizeof *j->units);
    j->states = malloc(state_bytes);
    j->segs_left = malloc((size_t)n_items * sizeof *j->segs_left);
    if (!j->units || !j->states || !j->segs_left)
        return ks_fail(KS_ERR_NOMEM, "attn: out of host memory for %d segments' states", (int)n_segs);
    int32_t u = 0;
    for (int32_t i = 0; i < n_items; i++) {
        int32_t n = tile_n_segs(j, &j->tiles[i / j->n_kv]);
        atomic_init(&j->segs_left[i], n);
        for (int32_t k = 0; k < n; k++)
            j->units[u++] = (struct unit){.item = i, .seg = k};
    }
    return KS_OK;
}

/* Attention of fewer multiply-adds than this (scores and values) runs on
 * the caller alone: a region's wake-up and the hand-off of the queries' and
 * outputs' cache lines cost more than it (a short decode or verification
 * context of a small model). */
#define ATTN_INLINE_MACS ((int64_t)1 << 17)

static int64_t attn_work(const struct attn_query *queries, int32_t n_queries, int n_head, int dim,
                         const struct attn_params *p)
{
    int64_t positions = 0;
    for (int32_t i = 0; i < n_queries; i++)
        positions += queries[i].pos + 1 - window_first(p, queries[i].pos);
    return positions * n_head * dim * 2;
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
    ks_status st = check_args(kv, layer, queries, n_queries, n_head, p);
    if (st || n_queries == 0)
        return st;
    if (p->window < 0 || p->softcap < 0.0f || !(p->softcap == p->softcap))
        return ks_fail(KS_ERR_INVALID_ARG, "attn: window %d and softcap %g must not be negative", (int)p->window,
                       (double)p->softcap);
    const struct kv_config *c = kv_get_config(kv);
    if (attn_work(queries, n_queries, n_head, c->head_dim, p) < ATTN_INLINE_MACS)
        pool = NULL;
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
    j.seg_pages = SEG_TOKENS / c->page_tokens > 1 ? SEG_TOKENS / c->page_tokens : 1;
    j.scratch_bytes = scratch_layout(&j, NULL, NULL);
    j.scratch = aligned_alloc(64, (size_t)nth * j.scratch_bytes);
    if (!j.scratch) {
        free(j.tiles);
        return ks_fail(KS_ERR_NOMEM, "attn: out of host memory for %d threads' scratch", nth);
    }
    /* one unit (a short decode context of a model with one KV head): the
     * caller alone, not waking the others, who go on with what they were
     * doing (threads_prefetch_idle's hints) */
    if ((st = plan_units(&j, nth)) == KS_OK)
        threads_run(j.n_units > 1 ? pool : NULL, phase_units, &j);
    free(j.tiles);
    free(j.scratch);
    free(j.units);
    free(j.states);
    free(j.segs_left);
    return st;
}
