/* Sliding-window layers in the KV cache: a page's window rows are freed once
 * no holder's query reaches them, so memory grows with the global layers
 * only; attention over every layer stays bit for bit what a cache that keeps
 * everything gives (the twin: the same writes into a cache without a window),
 * through decode steps, prefill chunks, forks, truncation, prefix hits (RAM
 * and the SSD tier's blobs), requantization and the dynamic policy. Debug
 * builds also run kv_check after every call that changes a cache. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "attn/attn.h"
#include "kv/kv.h"
#include "kv/kv_internal.h"

enum { P = 16, N_LAYER = 4, N_KV = 2, N_HEAD = 4, DIM = 64, WINDOW = 40, MAX_TOK = 1024 };

/* Layers 0, 1 and 3 windowed, layer 2 global: a window part of three layer
 * slots around a global one. */
static bool layer_windowed(int l) { return l != 2; }

static void config(struct kv_config *cfg, bool windowed, size_t budget)
{
    kv_config_default(cfg);
    cfg->n_layer = N_LAYER;
    cfg->n_kv_head = N_KV;
    cfg->head_dim = DIM;
    cfg->page_tokens = P;
    cfg->mem_budget = budget ? budget : (size_t)64 << 20;
    memcpy(cfg->fingerprint, "swa-test-model!!", 16);
    if (windowed) {
        cfg->swa_window = WINDOW;
        for (int l = 0; l < N_LAYER; l++)
            cfg->swa_layer[l] = layer_windowed(l);
    }
}

static struct kv_cache *make(bool windowed, size_t budget)
{
    struct kv_config cfg;
    config(&cfg, windowed, budget);
    struct kv_cache *kv = NULL;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    return kv;
}

static size_t global_page_bytes(void)
{
    struct kv_config cfg;
    config(&cfg, true, 0);
    return kv_page_bytes(&cfg, QUANT_F16, QUANT_F16) - kv_page_window_bytes(&cfg, QUANT_F16, QUANT_F16);
}

static size_t window_page_bytes(void)
{
    struct kv_config cfg;
    config(&cfg, true, 0);
    return kv_page_window_bytes(&cfg, QUANT_F16, QUANT_F16);
}

static void make_tokens(int32_t *t, int32_t n, int32_t salt)
{
    for (int32_t i = 0; i < n; i++)
        t[i] = (i * 7919 + salt * 104729) % 50000;
}

/* K/V rows depend on the token, its position and the layer only, like a model's. */
static void write_rows(struct kv_cache *kv, int32_t seq, const int32_t *tokens, int32_t from, int32_t to)
{
    enum { W = N_KV * DIM };
    float k[W], v[W];
    for (int32_t p = from; p < to; p++)
        for (int l = 0; l < N_LAYER; l++) {
            for (int i = 0; i < W; i++) {
                k[i] = (float)((tokens[p] * 31 + p * 7 + l * 3 + i) % 97) / 97.0f - 0.5f;
                v[i] = (float)((tokens[p] * 17 + p * 5 + l + i * 3) % 89) / 89.0f - 0.5f;
            }
            assert_int_equal(kv_write(kv, l, seq, p, k, v), KS_OK);
        }
}

/* One model step of n tokens: grow, write them. */
static void step(struct kv_cache *kv, int32_t seq, const int32_t *tokens, int32_t n)
{
    int32_t len = kv_seq_len(kv, seq);
    assert_int_equal(kv_seq_grow(kv, seq, n), KS_OK);
    write_rows(kv, seq, tokens, len, len + n);
    assert_int_equal(kv_check(kv), KS_OK);
}

static struct attn_params layer_params(int l)
{
    return (struct attn_params){.scale = 0.125f, .window = layer_windowed(l) ? WINDOW : 0};
}

/* Attention of queries at positions [from, to) of seq over every layer into
 * out (N_LAYER, to - from, N_HEAD, DIM); the queries depend on the position. */
static void attend(const struct kv_cache *kv, int32_t seq, int32_t from, int32_t to, float *out)
{
    int32_t n = to - from;
    struct attn_query *qs = malloc((size_t)n * sizeof *qs);
    size_t w = (size_t)N_HEAD * DIM;
    float *q = malloc((size_t)n * w * sizeof *q);
    for (int32_t i = 0; i < n; i++) {
        qs[i] = (struct attn_query){seq, from + i};
        for (size_t e = 0; e < w; e++)
            q[(size_t)i * w + e] = (float)(((from + i) * 13 + (int)e * 7) % 53) / 53.0f - 0.5f;
    }
    for (int l = 0; l < N_LAYER; l++) {
        struct attn_params ap = layer_params(l);
        assert_int_equal(attn_forward_ex(NULL, kv, l, qs, n, q, out + (size_t)l * n * w, N_HEAD, &ap), KS_OK);
    }
    free(qs);
    free(q);
}

/* The windowed cache's and the twin's attention for [from, to) are the same bits. */
static void assert_same_attention(const struct kv_cache *a, int32_t sa, const struct kv_cache *b, int32_t sb,
                                  int32_t from, int32_t to)
{
    size_t n = (size_t)N_LAYER * (size_t)(to - from) * N_HEAD * DIM;
    float *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y);
    attend(a, sa, from, to, x);
    attend(b, sb, from, to, y);
    assert_memory_equal(x, y, n * sizeof *x);
    free(x);
    free(y);
}

static int32_t pages_with_window(const struct kv_cache *kv, int32_t seq)
{
    struct kv_page_info info[MAX_TOK / P];
    int32_t n = 0, with = 0;
    assert_int_equal(kv_seq_pages(kv, seq, info, MAX_TOK / P, &n), KS_OK);
    for (int32_t i = 0; i < n; i++)
        with += info[i].window_rows;
    return with;
}

static int32_t new_seq(struct kv_cache *kv)
{
    int32_t s = -1;
    assert_int_equal(kv_seq_create(kv, &s), KS_OK);
    return s;
}

static void test_config(void **state)
{
    (void)state;
    struct kv_config cfg;
    config(&cfg, true, 0);
    assert_int_equal(kv_window_layers(&cfg), 3);
    assert_true(kv_layer_windowed(&cfg, 0) && !kv_layer_windowed(&cfg, 2) && !kv_layer_windowed(&cfg, 4));
    size_t all = kv_page_bytes(&cfg, QUANT_F16, QUANT_F16);
    assert_int_equal(kv_page_window_bytes(&cfg, QUANT_F16, QUANT_F16), all / 4 * 3);
    struct kv_cache *kv = NULL;
    cfg.swa_window = -1;
    assert_int_equal(kv_create(&cfg, &kv), KS_ERR_INVALID_ARG);
    cfg.swa_window = 0; /* flags without a window */
    assert_int_equal(kv_create(&cfg, &kv), KS_ERR_INVALID_ARG);
    config(&cfg, true, 0);
    cfg.n_layer = KV_MAX_LAYERS + 1;
    assert_int_equal(kv_create(&cfg, &kv), KS_ERR_INVALID_ARG);
    config(&cfg, false, 0);
    assert_int_equal(kv_page_window_bytes(&cfg, QUANT_F16, QUANT_F16), 0);
    assert_int_equal(kv_window_layers(&cfg), 0);
}

/* Decode token by token, then a long prefill chunk: past the window, the
 * bytes are every page's global rows plus the window rows of the pages a
 * query can still reach; attention equals the twin's at every step. */
static void test_memory_grows_with_global_layers(void **state)
{
    (void)state;
    struct kv_cache *kv = make(true, 0), *twin = make(false, 0);
    int32_t t[MAX_TOK];
    make_tokens(t, MAX_TOK, 1);
    int32_t s = new_seq(kv), u = new_seq(twin);
    size_t g = global_page_bytes(), w = window_page_bytes();
    for (int32_t len = 0; len < 12 * P; len++) {
        step(kv, s, t, 1);
        step(twin, u, t, 1);
        int32_t n_pages = kv_seq_n_pages(kv, s), from = kv_window_start(kv, len);
        /* pages covering [len - WINDOW + 1, len + 1) keep their rows, no other */
        int32_t want = n_pages - from / P;
        assert_int_equal(pages_with_window(kv, s), want);
        assert_true(want <= (WINDOW + P - 1) / P + 1);
        struct kv_usage us;
        kv_usage(kv, &us);
        assert_int_equal(us.used, (size_t)n_pages * g + (size_t)want * w);
        assert_int_equal(us.window_bytes, (size_t)want * w);
        assert_int_equal(us.n_window_pages, want);
        assert_same_attention(kv, s, twin, u, len, len + 1);
    }
    /* a chunk of 10 pages holds its window rows while it is computed, and gives them up at the next step */
    step(kv, s, t, 10 * P);
    step(twin, u, t, 10 * P);
    assert_same_attention(kv, s, twin, u, 12 * P, 22 * P);
    assert_true(pages_with_window(kv, s) >= 10);
    step(kv, s, t, 1);
    step(twin, u, t, 1);
    assert_true(pages_with_window(kv, s) <= (WINDOW + P - 1) / P + 1);
    assert_same_attention(kv, s, twin, u, 22 * P, 22 * P + 1);
    struct kv_seq_usage su;
    assert_int_equal(kv_seq_usage(kv, s, &su), KS_OK);
    assert_int_equal(su.bytes, (size_t)su.n_pages * g + (size_t)su.n_window_pages * w);
    struct kv_usage a, b;
    kv_usage(kv, &a);
    kv_usage(twin, &b);
    assert_true(a.used * 2 < b.used); /* three of four layers windowed */
    assert_true(a.window_frees > 0);
    /* a window layer's freed pages are refused to queries that would read them, and to writes and reads */
    struct attn_query early = {s, 3 * P};
    float q[N_HEAD * DIM] = {0}, out[N_HEAD * DIM];
    struct attn_params ap = layer_params(0);
    assert_int_equal(attn_forward_ex(NULL, kv, 0, &early, 1, q, out, N_HEAD, &ap), KS_ERR_STATE);
    ap.window = 0;
    struct attn_query late = {s, 22 * P};
    assert_int_equal(attn_forward_ex(NULL, kv, 0, &late, 1, q, out, N_HEAD, &ap), KS_ERR_INVALID_ARG);
    ap = layer_params(2); /* the global layer reads everything */
    assert_int_equal(attn_forward_ex(NULL, kv, 2, &early, 1, q, out, N_HEAD, &ap), KS_OK);
    float row[N_KV * DIM];
    assert_int_equal(kv_read(kv, 0, s, 3 * P, row, NULL), KS_ERR_STATE);
    assert_int_equal(kv_read(kv, 2, s, 3 * P, row, NULL), KS_OK);
    assert_int_equal(kv_write(kv, 2, s, 3 * P, row, row), KS_ERR_STATE);
    kv_free(kv);
    kv_free(twin);
}

/* A fork shares the pages: their window rows live while either sequence can
 * read them, and go when the last holder moves past them or lets go. */
static void test_fork(void **state)
{
    (void)state;
    struct kv_cache *kv = make(true, 0), *twin = make(false, 0);
    int32_t t[MAX_TOK], v[MAX_TOK];
    make_tokens(t, MAX_TOK, 2);
    int32_t a = new_seq(kv), ta = new_seq(twin);
    step(kv, a, t, 5 * P + 3);
    step(twin, ta, t, 5 * P + 3);
    int32_t b = -1, tb = -1;
    assert_int_equal(kv_seq_fork(kv, a, &b), KS_OK);
    assert_int_equal(kv_seq_fork(twin, ta, &tb), KS_OK);
    memcpy(v, t, sizeof v);
    for (int32_t i = 5 * P + 3; i < MAX_TOK; i++)
        v[i] = t[i] + 1;
    /* a runs ahead: the shared pages keep their rows for b, which has not moved */
    for (int i = 0; i < 6 * P; i++) {
        step(kv, a, t, 1);
        step(twin, ta, t, 1);
    }
    assert_int_equal(pages_with_window(kv, b), 6);
    assert_same_attention(kv, b, twin, tb, 5 * P + 2, 5 * P + 3);
    assert_same_attention(kv, a, twin, ta, 11 * P + 2, 11 * P + 3);
    /* b moves on: now nobody needs the early pages' rows */
    for (int i = 0; i < 4 * P; i++) {
        step(kv, b, v, 1);
        step(twin, tb, v, 1);
    }
    assert_same_attention(kv, b, twin, tb, 9 * P + 2, 9 * P + 3);
    assert_int_equal(pages_with_window(kv, b), (int32_t)(kv_seq_n_pages(kv, b) - kv_window_start(kv, 9 * P + 2) / P));
    /* a fork of b holds rows b has moved past, then ends: b's next step frees them */
    int32_t c = -1;
    assert_int_equal(kv_seq_fork(kv, b, &c), KS_OK);
    step(kv, b, v, 3 * P);
    kv_seq_free(kv, c);
    kv_seq_free(kv, a);
    step(kv, b, v, 1);
    assert_int_equal(pages_with_window(kv, b), (int32_t)(kv_seq_n_pages(kv, b) - kv_window_start(kv, 12 * P + 3) / P));
    kv_free(kv);
    kv_free(twin);
}

/* Cutting a sequence back: a length whose window rows are gone is refused;
 * kv_seq_resumable says where to resume, and recomputing from there gives
 * the twin's attention. */
static void test_truncate(void **state)
{
    (void)state;
    struct kv_cache *kv = make(true, 0), *twin = make(false, 0);
    int32_t t[MAX_TOK], v[MAX_TOK];
    make_tokens(t, MAX_TOK, 3);
    int32_t s = new_seq(kv), u = new_seq(twin);
    for (int i = 0; i < 10 * P; i++) {
        step(kv, s, t, 1);
        step(twin, u, t, 1);
    }
    int32_t len = 10 * P;
    /* one token back (a chat's "recompute the last token") is always possible */
    assert_int_equal(kv_seq_resumable(kv, s, len - 1), len - 1);
    assert_int_equal(kv_seq_truncate(kv, s, len - 1), KS_OK);
    assert_int_equal(kv_seq_truncate(twin, u, len - 1), KS_OK);
    step(kv, s, t, 1);
    step(twin, u, t, 1);
    assert_same_attention(kv, s, twin, u, len - 1, len);
    /* far back: refused, the resumable length is before every freed page */
    int32_t want = 4 * P + 5;
    assert_int_equal(kv_seq_truncate(kv, s, want), KS_ERR_STATE);
    int32_t r = kv_seq_resumable(kv, s, want);
    assert_true(r < want);
    assert_true(r == 0 || kv_seq_window_intact(kv, &kv->seqs[s], NULL, r));
    assert_int_equal(kv_seq_resumable(twin, u, want), want);
    assert_int_equal(kv_seq_truncate(kv, s, r), KS_OK);
    assert_int_equal(kv_seq_truncate(twin, u, want), KS_OK);
    /* recompute [r, want), then continue both along other tokens */
    memcpy(v, t, (size_t)want * sizeof *t);
    make_tokens(v + want, MAX_TOK - want, 5);
    step(kv, s, v, want - r);
    assert_int_equal(kv_seq_len(kv, s), want);
    step(kv, s, v, 2 * P + 1);
    step(twin, u, v, 2 * P + 1);
    assert_same_attention(kv, s, twin, u, want, want + 2 * P + 1);
    step(kv, s, v, 1);
    step(twin, u, v, 1);
    assert_same_attention(kv, s, twin, u, want + 2 * P + 1, want + 2 * P + 2);
    kv_free(kv);
    kv_free(twin);
}

/* The longest hit length h <= n_pages * P (a multiple of P) at which every page
 * covering [h - WINDOW + 1, h) had window rows (info: the chain's pages). */
static int32_t expected_hit(const struct kv_page_info *info, int32_t n_pages)
{
    for (int32_t k = n_pages; k > 0; k--) {
        int32_t h = k * P, from = h - WINDOW + 1 > 0 ? h - WINDOW + 1 : 0;
        bool ok = true;
        for (int32_t i = from / P; i < k; i++)
            ok = ok && info[i].window_rows;
        if (ok)
            return h;
    }
    return 0;
}

/* A computed sequence whose pages are published step by step, as the
 * scheduler does: prefill in chunks of `chunk`, then decode to n. */
static int32_t conversation(struct kv_cache *kv, const int32_t *t, int32_t prefill, int32_t chunk, int32_t n)
{
    int32_t s = new_seq(kv);
    while (kv_seq_len(kv, s) < n) {
        int32_t len = kv_seq_len(kv, s), m = len < prefill ? (prefill - len < chunk ? prefill - len : chunk) : 1;
        step(kv, s, t, m);
        assert_int_equal(kv_seq_publish(kv, s, t, len + m), KS_OK);
    }
    return s;
}

/* A prefix hit maps the longest chain whose window rows before its end are
 * stored; computing the rest gives the twin's attention (hit or no hit). */
static void test_prefix_hit_rule(void **state)
{
    (void)state;
    struct kv_cache *kv = make(true, 0), *twin = make(false, 0);
    int32_t t[MAX_TOK], v[MAX_TOK];
    make_tokens(t, MAX_TOK, 6);
    int32_t a = conversation(kv, t, 4 * P, 2 * P, 12 * P + 7);
    struct kv_page_info info[MAX_TOK / P];
    int32_t n_info = 0;
    assert_int_equal(kv_seq_pages(kv, a, info, MAX_TOK / P, &n_info), KS_OK);
    assert_int_equal(kv_seq_publish_tail(kv, a, t, 12 * P + 7), KS_OK);
    kv_seq_free(kv, a);
    /* the whole chain: its last pages still hold their rows, so all of it is a hit */
    int32_t c = new_seq(kv), n_chain = 0;
    assert_int_equal(kv_seq_attach_pages(kv, c, t, 12 * P + 7, &n_chain), KS_OK);
    assert_int_equal(n_chain, 12);
    kv_seq_free(kv, c);
    /* the hits below grow from where they end, freeing the rows of pages far before it: the last cut's
     * frees no page an earlier one needs */
    for (int32_t cut = 1; cut <= 13; cut++) {
        /* a prompt that follows the chain for cut pages (or into the tail), then differs */
        memcpy(v, t, sizeof v);
        int32_t div = cut == 13 ? 12 * P + 7 : cut * P + 3;
        make_tokens(v + div, MAX_TOK - div, 100 + cut);
        int32_t n_prompt = div + P;
        int32_t b = new_seq(kv), n_pages = 0, n_part = 0;
        assert_int_equal(kv_seq_attach_pages(kv, b, v, n_prompt - 1, &n_pages), KS_OK);
        int32_t full = div / P < 12 ? div / P : 12;
        assert_int_equal(n_pages * P, expected_hit(info, full));
        assert_int_equal(kv_seq_attach_partial(kv, b, v, n_prompt - 1, &n_part), KS_OK);
        int32_t hit = kv_seq_len(kv, b);
        assert_true(kv_seq_window_intact(kv, &kv->seqs[b], NULL, hit));
        int32_t u = new_seq(twin);
        if (hit > 0)
            step(twin, u, v, hit);
        step(kv, b, v, n_prompt - hit);
        step(twin, u, v, n_prompt - hit);
        assert_same_attention(kv, b, twin, u, hit, n_prompt);
        kv_seq_free(kv, b);
        kv_seq_free(twin, u);
    }
    kv_free(kv);
    kv_free(twin);
}

struct blob_log {
    int n;
    void *blob[64];
    size_t len[64];
    struct kv_key key[64];
};

static void on_evict(void *user, const struct kv_page_blob *b)
{
    struct blob_log *log = user;
    assert_true(log->n < 64);
    log->blob[log->n] = malloc(b->len);
    memcpy(log->blob[log->n], b->data, b->len);
    log->len[log->n] = b->len;
    log->key[log->n] = b->key;
    log->n++;
}

static const void *find_blob(const struct blob_log *log, struct kv_key key, size_t *len)
{
    for (int i = 0; i < log->n; i++)
        if (kv_key_equal(log->key[i], key)) {
            *len = log->len[i];
            return log->blob[i];
        }
    return NULL;
}

/* The SSD tier gets whole pages only: a page without its window rows is not
 * handed over. Blobs read back into a fresh cache give the twin's attention;
 * a key cached in RAM without its rows is refused. */
static void test_ssd_blobs(void **state)
{
    (void)state;
    struct kv_cache *kv = make(true, 0), *twin = make(false, 0);
    struct blob_log log = {0};
    kv_set_evict_hook(kv, on_evict, &log);
    int32_t t[MAX_TOK];
    make_tokens(t, MAX_TOK, 7);
    int32_t a = conversation(kv, t, 2 * P, 2 * P, 9 * P);
    int32_t with = pages_with_window(kv, a);
    assert_int_equal(kv_prefix_persist(kv), with);
    assert_int_equal(log.n, with);
    /* the blobs are the chain's last pages: a fresh cache computes the pages before, then reads them */
    struct kv_cache *fresh = make(true, 0);
    int32_t s = new_seq(fresh), from = 9 - with;
    step(fresh, s, t, from * P);
    assert_int_equal(kv_seq_publish(fresh, s, t, from * P), KS_OK);
    for (int32_t i = from; i < 9; i++) {
        struct kv_key key;
        size_t len = 0;
        assert_true(kv_seq_next_key(fresh, s, t, &key));
        const void *blob = find_blob(&log, key, &len);
        assert_non_null(blob);
        assert_int_equal(kv_seq_import_page(fresh, s, t, blob, len), KS_OK);
    }
    assert_int_equal(kv_seq_len(fresh, s), 9 * P);
    int32_t u = new_seq(twin);
    step(fresh, s, t, P);
    step(twin, u, t, 10 * P);
    assert_same_attention(fresh, s, twin, u, 9 * P, 10 * P);
    /* the first cache holds the early keys without their rows: importing one of the later blobs into a
     * sequence that maps those keys from RAM is refused at the first rowless page */
    int32_t b = new_seq(kv), n_pages = 0;
    assert_int_equal(kv_seq_attach_pages(kv, b, t, 4 * P, &n_pages), KS_OK);
    assert_int_equal(n_pages, 0); /* pages 2 and 3 lost their rows */
    kv_seq_free(kv, a);
    assert_int_equal(kv_seq_attach_pages(kv, b, t, 9 * P, &n_pages), KS_OK);
    assert_int_equal(n_pages, 9);
    kv_seq_free(kv, b);
    struct kv_cache *third = make(true, 0);
    int32_t c = new_seq(third);
    struct kv_key key;
    size_t len = 0;
    assert_true(kv_seq_next_key(third, c, t, &key));
    assert_null(find_blob(&log, key, &len)); /* page 0 never reached the tier */
    kv_free(third);
    for (int i = 0; i < log.n; i++)
        free(log.blob[i]);
    kv_free(fresh);
    kv_free(kv);
    kv_free(twin);
}

/* Requantizing pages with and without their window rows converts what is
 * stored, with exact accounting, and matches the twin converted alike. */
static void test_requantize(void **state)
{
    (void)state;
    struct kv_cache *kv = make(true, 0), *twin = make(false, 0);
    int32_t t[MAX_TOK];
    make_tokens(t, MAX_TOK, 8);
    int32_t s = new_seq(kv), u = new_seq(twin);
    for (int i = 0; i < 6 * P; i++) {
        step(kv, s, t, 1);
        step(twin, u, t, 1);
    }
    struct kv_selector all = {.kind = KV_SELECT_ALL};
    struct kv_requant_result r;
    assert_int_equal(kv_requantize(kv, &all, QUANT_Q8_0, QUANT_Q4_0, true, &r), KS_OK);
    size_t predicted = r.bytes_after;
    assert_int_equal(kv_requantize(kv, &all, QUANT_Q8_0, QUANT_Q4_0, false, &r), KS_OK);
    assert_int_equal(kv_requantize(twin, &all, QUANT_Q8_0, QUANT_Q4_0, false, NULL), KS_OK);
    struct kv_usage us;
    kv_usage(kv, &us);
    assert_int_equal(us.used, predicted);
    struct kv_config cfg;
    config(&cfg, true, 0);
    size_t w = kv_page_window_bytes(&cfg, QUANT_Q8_0, QUANT_Q4_0), g = kv_page_bytes(&cfg, QUANT_Q8_0, QUANT_Q4_0) - w;
    assert_int_equal(us.used, (size_t)kv_seq_n_pages(kv, s) * g + (size_t)us.n_window_pages * w);
    assert_same_attention(kv, s, twin, u, 6 * P - 1, 6 * P);
    step(kv, s, t, 1);
    step(twin, u, t, 1);
    assert_same_attention(kv, s, twin, u, 6 * P, 6 * P + 1);
    kv_free(kv);
    kv_free(twin);
}

/* The dynamic policy under pressure sees the real bytes: a sequence decodes
 * far past what its pages would take with every layer's rows, with every
 * invariant kept, and attention stays the twin's where both hold the same
 * page types (the twin is given room enough never to demote, so only the
 * check that the windowed cache keeps going is made past that). */
static void test_dynamic_policy(void **state)
{
    (void)state;
    struct kv_config cfg;
    config(&cfg, true, 0);
    size_t full = kv_page_bytes(&cfg, QUANT_F16, QUANT_F16);
    cfg.mem_budget = 12 * full;
    cfg.policy = KV_POLICY_DYNAMIC;
    cfg.sink_tokens = P;
    cfg.hot_tokens = 2 * P;
    struct kv_cache *kv = NULL;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    struct kv_fit fit;
    kv_fit(kv, &fit);
    int32_t t[MAX_TOK];
    make_tokens(t, MAX_TOK, 9);
    int32_t s = new_seq(kv);
    /* 12 full pages' worth of budget; windowed, a page costs a quarter past the window */
    int32_t n = 40 * P;
    assert_true(fit.dynamic >= n);
    for (int32_t i = 0; i < n; i++) {
        step(kv, s, t, 1);
        struct kv_usage us;
        kv_usage(kv, &us);
        assert_true(us.used <= cfg.mem_budget);
    }
    struct kv_usage us;
    kv_usage(kv, &us);
    assert_true(us.demotions > 0);
    /* a prefill chunk on top: its window rows all need room at once, then are given back */
    int32_t b = new_seq(kv);
    step(kv, b, t, 3 * P);
    step(kv, b, t, 1);
    assert_true(pages_with_window(kv, b) <= (WINDOW + P - 1) / P + 1);
    kv_free(kv);
}

/* The fit figures: tokens one sequence can decode to in an empty cache. The
 * static figure is what a real decode reaches, to within the window pages'
 * rounding (the figure counts ceil(WINDOW / P) + 1 pages of window rows). */
static void test_fit(void **state)
{
    (void)state;
    struct kv_config cfg;
    config(&cfg, true, 0);
    cfg.mem_budget = 10 * kv_page_bytes(&cfg, QUANT_F16, QUANT_F16);
    struct kv_fit fit;
    assert_int_equal(kv_fit_config(&cfg, &fit), KS_OK);
    size_t g = global_page_bytes(), w = window_page_bytes();
    int64_t win_pages = (WINDOW + P - 1) / P + 1;
    int64_t pages = (int64_t)((cfg.mem_budget - (size_t)win_pages * w) / g);
    assert_int_equal(fit.start, pages * P);
    assert_int_equal(fit.tokens[kv_type_index(QUANT_F16)], pages * P);
    assert_int_equal(fit.chunk, 10 * P); /* a chunk's pages are whole until the next step */
    struct kv_cache *kv = NULL;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    int32_t t[MAX_TOK];
    make_tokens(t, MAX_TOK, 10);
    int32_t s = new_seq(kv);
    while (kv_seq_len(kv, s) < MAX_TOK - 1 && kv_seq_grow(kv, s, 1) == KS_OK)
        write_rows(kv, s, t, kv_seq_len(kv, s) - 1, kv_seq_len(kv, s));
    int32_t reached = kv_seq_len(kv, s);
    assert_true(reached >= fit.start && reached <= fit.start + P);
    kv_free(kv);
    /* without a window the figure is the plain one */
    config(&cfg, false, 0);
    cfg.mem_budget = 20 * kv_page_bytes(&cfg, QUANT_F16, QUANT_F16);
    assert_int_equal(kv_fit_config(&cfg, &fit), KS_OK);
    assert_int_equal(fit.start, 20 * P);
    assert_int_equal(fit.chunk, 20 * P);
    cfg.policy = KV_POLICY_DYNAMIC;
    assert_int_equal(kv_fit_config(&cfg, &fit), KS_OK);
    assert_int_equal(fit.chunk, fit.dynamic);
    /* every layer windowed: memory stops growing past the window */
    config(&cfg, true, 0);
    for (int l = 0; l < N_LAYER; l++)
        cfg.swa_layer[l] = true;
    cfg.mem_budget = 20 * kv_page_bytes(&cfg, QUANT_F16, QUANT_F16);
    assert_int_equal(kv_fit_config(&cfg, &fit), KS_OK);
    assert_int_equal(fit.start, INT32_MAX);
}

/* swa_full keeps every row: the bytes of every layer, any length resumable,
 * the fit of a cache without a window. */
static void test_swa_full(void **state)
{
    (void)state;
    struct kv_config cfg;
    config(&cfg, true, 0);
    cfg.swa_full = true;
    struct kv_cache *kv = NULL;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    int32_t t[MAX_TOK];
    make_tokens(t, MAX_TOK, 11);
    int32_t s = new_seq(kv);
    for (int i = 0; i < 6 * P; i++)
        step(kv, s, t, 1);
    struct kv_usage us;
    kv_usage(kv, &us);
    assert_int_equal(us.used, 6 * kv_page_bytes(&cfg, QUANT_F16, QUANT_F16));
    assert_int_equal(kv_seq_resumable(kv, s, 5), 5);
    assert_int_equal(kv_seq_truncate(kv, s, 5), KS_OK);
    kv_free(kv);
    struct kv_fit with, without;
    cfg.mem_budget = 10 * kv_page_bytes(&cfg, QUANT_F16, QUANT_F16);
    assert_int_equal(kv_fit_config(&cfg, &with), KS_OK);
    assert_int_equal(with.start, 10 * P);
    cfg.swa_full = false;
    assert_int_equal(kv_fit_config(&cfg, &without), KS_OK);
    assert_true(without.start > 2 * with.start);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_config),
        cmocka_unit_test(test_memory_grows_with_global_layers),
        cmocka_unit_test(test_fork),
        cmocka_unit_test(test_truncate),
        cmocka_unit_test(test_prefix_hit_rule),
        cmocka_unit_test(test_ssd_blobs),
        cmocka_unit_test(test_requantize),
        cmocka_unit_test(test_dynamic_policy),
        cmocka_unit_test(test_fit),
        cmocka_unit_test(test_swa_full),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
