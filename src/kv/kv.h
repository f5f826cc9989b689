/* kv: the elastic KV cache. A pool of fixed-size pages (P tokens of one
 * sequence, K and V for every layer) allocated on demand from one memory
 * budget. Each page has its own K and V precision (f32, f16, bf16, q8_0,
 * q5_1, q5_0, q4_1, iq4_nl, q4_0: ggml's block formats, bit for bit; and
 * iq3_nl, kvserve's own 3.5-bit type);
 * pages can be requantized live, and a dynamic policy demotes old pages as
 * the pool fills. The kv module knows nothing about HTTP or the model.
 *
 * Token data enters through kv_write() as f32 rows of n_kv_head * head_dim
 * values and is read only by the attn module (attn/attn.h), which walks a
 * sequence's page table in place.
 *
 * Sliding windows (cfg.swa_window): each page stores its window layers' rows
 * in their own allocation, freed alone. When a sequence of len tokens grows,
 * no query of it can read a position below len - swa_window + 1 in a window
 * layer again; its pages wholly below that lose their window rows as soon as
 * no other sequence holding them (fork, shared prefix) can still read them.
 * Prefill chunks are written whole, so a chunk's window rows live until the
 * next growth. A sequence can resume (be cut back to, or continue from the
 * prefix cache at) length L only when every page covering the positions
 * [L - swa_window + 1, L) still has its window rows: kv_seq_resumable() says
 * how far back that is; kv_seq_truncate() refuses other lengths, and the
 * prefix cache maps the longest hit that satisfies the rule.
 *
 * A cache is not thread-safe: one caller (the scheduler thread) uses it; the
 * attn module may read it from the thread pool during attn_forward().
 *
 * The contract is grouped by client, in this order:
 *   types and configuration   every client (kv_create, the KV types, budget arithmetic)
 *   the sequence protocol     model (sched and cli create, fork and free sequences)
 *   reading pages in place    attn
 *   the prefix cache          sched's engine (RAM tier; store is the SSD tier)
 *   admin and usage           server (requantization, run-time policy, usage, fit) */

#ifndef KS_KV_H
#define KS_KV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "quant/quant.h"
#include "status/status.h"
#include "threads/threads.h"

struct kv_cache;

/* ---- types and configuration --------------------------------------------- */

enum { KV_LADDER_MAX = 8 };

/* Layers a sliding-window configuration can describe (struct kv_config.swa_layer). */
enum { KV_MAX_LAYERS = 512 };
enum { KV_MAX_PAGE_TOKENS = 256 }; /* the largest P */

enum kv_policy {
    KV_POLICY_STATIC = 0,  /* every page at type_k / type_v, like llama.cpp -ctk/-ctv */
    KV_POLICY_DYNAMIC = 1, /* sinks + hot window at type_k/type_v, older pages step down */
};

/* Smoothing: which halves a new sequence stores minus its per-channel means
 * (a bit mask). Exact by construction: every key a query sees is shifted by
 * the same mu_k, which shifts all its scores equally (softmax unchanged), and
 * the weights sum to 1, so attention adds mu_v back once to its output. The
 * means of a sequence, per layer and KV head, come from the tokens of its first
 * write that land in page 0 and never change; page 0 owns them, so a sequence
 * that maps a cached page 0 (RAM, disk, fork) takes its means with it. */
enum kv_smooth {
    KV_SMOOTH_OFF = 0,
    KV_SMOOTH_K = 1,
    KV_SMOOTH_V = 2,
    KV_SMOOTH_KV = 3,
};

struct kv_config {
    int n_layer;
    int n_kv_head;
    int head_dim;
    size_t mem_budget;        /* bytes for page storage; exact accounting */
    int page_tokens;          /* P: power of two in [16, KV_MAX_PAGE_TOKENS]; default 32 */
    enum quant_type type_k;   /* start precision of new pages: any KV type (kv_type_index() >= 0) */
    enum quant_type type_v;
    bool rotate;              /* Walsh-Hadamard rotation of K/V over head_dim (default on) */
    bool scale_search;        /* quantized rows take quant's kv_from_float: each block's scale by least
                                 squared error, same block format (default on) */
    enum kv_smooth smooth;    /* halves stored minus the sequence's channel means (default off) */
    enum kv_policy policy;
    int sink_tokens;          /* dynamic: first S tokens kept at start precision (32), unless the cache is full otherwise */
    int hot_tokens;           /* dynamic: most recent W tokens kept (512), likewise */
    float high_watermark;     /* dynamic: start demoting above this usage ratio (0.90) */
    float low_watermark;      /* dynamic: stop demoting below this (0.80) */
    enum quant_type floor;    /* dynamic: lowest precision (Q4_0) */
    /* dynamic: the precisions old pages step down through, highest first
     * (q8_0, q4_0; n_ladder 0 means that default); the floor ends the ladder
     * (levels below it are skipped, and a floor not on it is its last step).
     * See kv_policy.c. */
    enum quant_type ladder[KV_LADDER_MAX];
    int n_ladder;
    bool prefix_cache;        /* keep full pages keyed by content after their sequences end (on) */
    uint8_t fingerprint[16];  /* the model's identity, part of every page key (model_fingerprint) */
    /* Sliding-window attention (gemma2/3, gpt-oss): layer l is a window layer when swa_window > 0 and
     * swa_layer[l]; its queries at position p read only keys at p - swa_window < j <= p (attn_params.window
     * must be swa_window, or smaller, on those layers). The cache then keeps a page's rows of the window
     * layers only while some query of a sequence holding it can still reach them (see "Sliding windows"
     * above), so a long sequence's KV memory grows with its other ("global") layers only. model_kv_config
     * fills both from the model's hyper-parameters; 0 (the default) keeps every layer's rows. kv_create
     * checks swa_window >= 0, n_layer <= KV_MAX_LAYERS when it is > 0, and no flag without a window. */
    int32_t swa_window;
    bool swa_layer[KV_MAX_LAYERS]; /* (n_layer) */
    bool swa_full;            /* keep every window row anyway (llama.cpp's --swa-full): attention is the same,
                                 memory is not saved, and any length can be resumed (default off) */
};

/* Index into the per-type arrays below (and attn's kernel tables), in falling
 * precision: a higher index is a lower precision (the dynamic policy only
 * steps to higher indexes). KV_INDEX_* name each as a constant. Block types
 * (all but f32, f16, bf16) need head_dim to be a multiple of their 32. */
enum {
    KV_INDEX_F32 = 0,
    KV_INDEX_F16 = 1,
    KV_INDEX_BF16 = 2,
    KV_INDEX_Q8_0 = 3,
    KV_INDEX_Q5_1 = 4,
    KV_INDEX_Q5_0 = 5,
    KV_INDEX_Q4_1 = 6,
    KV_INDEX_IQ4_NL = 7,
    KV_INDEX_Q4_0 = 8,
    KV_INDEX_IQ3_NL = 9, /* kvserve's own, not a ggml type */
    KV_N_TYPES = 10,
};
int kv_type_index(enum quant_type t);           /* -1 if not a KV type */
enum quant_type kv_type_at(int index);
/* The KV types' names, comma-separated in index order ("f32, f16, ..."), for messages. */
const char *kv_type_names(void);
/* One KV type by name ("q8_0", case-insensitive): KS_ERR_INVALID_ARG naming
 * the word and the KV types for anything else (a quant type that is not a KV
 * type too). */
ks_status kv_parse_type(const char *text, enum quant_type *out);

/* Parse a comma-separated ladder ("f16,q8_0,q5_0,q4_0") into cfg->ladder:
 * known KV types in falling precision, at most KV_LADDER_MAX. Usability with
 * head_dim is checked by kv_create. KS_ERR_INVALID_ARG names the bad entry. */
ks_status kv_parse_ladder(const char *text, struct kv_config *cfg);

/* Smoothing's names: "off", "k", "v", "kv". kv_parse_smooth: KS_ERR_INVALID_ARG
 * for another word. */
const char *kv_smooth_name(enum kv_smooth s);
ks_status kv_parse_smooth(const char *text, enum kv_smooth *out);

/* Fill defaults: P=32, f16/f16, rotate on, scale search on, smoothing off, static policy, S=32, W=512,
 * watermarks 0.90/0.80, floor q4_0, ladder q8_0,q4_0, prefix cache on. Shape, budget and
 * fingerprint are left for the caller. */
void kv_config_default(struct kv_config *cfg);

/* KS_ERR_INVALID_ARG names the bad field (e.g. q4_0 with head_dim 8, a
 * ladder not in falling precision). */
ks_status kv_create(const struct kv_config *cfg, struct kv_cache **out);
void kv_free(struct kv_cache *kv);
const struct kv_config *kv_get_config(const struct kv_cache *kv);

/* Budget accounting counts page storage only (K and V rows of every layer);
 * a new page of types (tk, tv) costs kv_page_bytes(cfg, tk, tv) bytes, of
 * which kv_page_window_bytes() are its window layers' rows (0 without a
 * sliding window), given back when they are freed. Page metadata and page
 * tables live outside the budget. */
size_t kv_page_bytes(const struct kv_config *cfg, enum quant_type type_k, enum quant_type type_v);
size_t kv_page_window_bytes(const struct kv_config *cfg, enum quant_type type_k, enum quant_type type_v);
/* Is layer a sliding-window layer of cfg; how many there are. */
bool kv_layer_windowed(const struct kv_config *cfg, int layer);
int kv_window_layers(const struct kv_config *cfg);

/* One budget for two caches: a target model's and its draft model's
 * (speculative decoding), whose layouts differ (n_layer, n_kv_head, head_dim)
 * so they cannot be one cache. After kv_share_budget(kv, peer) both draw from
 * kv's budget: one limit (kv's cfg.mem_budget, which becomes peer's too) and
 * one count of bytes used, the sum of both caches' page storage
 * (kv_budget_used; kv_usage reports the other cache's part as shared_used).
 * A cache that needs room first makes it among its own pages as its policy
 * says (the dynamic policy's watermarks compare the sum), then evicts the
 * other cache's idle cached pages (least recently used first); it never
 * demotes or takes pages the other cache's sequences hold. kv_fit counts the
 * other cache's idle pages as reclaimable. Each cache keeps its own prefix
 * keys (its own fingerprint: a draft cache's must differ from the target's),
 * sequences and kv_check; kv_check also checks the sum against the limit.
 * Both caches belong to one thread. kv_free of either ends the sharing.
 * Errors: KS_ERR_STATE when either shares a budget already, peer is kv, or
 * peer holds pages; KS_ERR_KV_FULL when the limit cannot hold one page of
 * peer's start types (with the numbers). */
ks_status kv_share_budget(struct kv_cache *kv, struct kv_cache *peer);
/* Bytes of kv's budget in use: its pages and those of the cache sharing it. */
size_t kv_budget_used(const struct kv_cache *kv);

/* Debug aid: check every invariant (ref counts, accounting, page tables);
 * KS_ERR_INTERNAL with a description on the first broken one. Debug builds
 * (no NDEBUG; -DKS_KV_CHECK=0/1 overrides) also run it after every call here
 * that changes the cache and abort naming the call on a broken invariant. */
ks_status kv_check(const struct kv_cache *kv);

/* ---- the sequence protocol (model) --------------------------------------- */

/* Sequence protocol, used by model_forward():
 *   kv_seq_grow(seq, n)  make positions [len, len+n) writable and set len += n
 *                        (all or nothing; KS_ERR_KV_FULL when the budget and
 *                        the precision floor are exhausted). Under the dynamic
 *                        policy, new pages that lie outside the sinks and hot
 *                        window at len + n get the precision the policy gives
 *                        them at once, so their tokens are written once.
 *   kv_write_rows(layer, seq, pos, n, k, v)  for every pos < len and every
 *                        layer (kv_write: one row)
 *   kv_seq_truncate(seq, len)        drop tokens at the end (chat edits)
 * With a sliding window, a growth's tokens are written and attended before
 * the sequence grows again: the next growth frees what they no longer need
 * (attention over freed rows is refused with KS_ERR_STATE, never read). */

/* Sequences: ids are small non-negative integers chosen by the cache. */
ks_status kv_seq_create(struct kv_cache *kv, int32_t *seq_out);
/* Release every page of seq (pages shared with others are only unreferenced). */
void kv_seq_free(struct kv_cache *kv, int32_t seq);
int32_t kv_seq_len(const struct kv_cache *kv, int32_t seq);
ks_status kv_seq_grow(struct kv_cache *kv, int32_t seq, int32_t n_tokens);
/* KS_ERR_RANGE (len outside [0, kv_seq_len]), KS_ERR_STATE when the window
 * rows a continuation at len needs are freed (len > kv_seq_resumable()). */
ks_status kv_seq_truncate(struct kv_cache *kv, int32_t seq, int32_t len);

/* Store one token's K and V for one layer: k and v hold n_kv_head * head_dim
 * f32 values (head-major). pos < kv_seq_len(seq). Rotation, smoothing and
 * quantization happen here. kv_write_rows(..., pos, 1, k, v). */
ks_status kv_write(struct kv_cache *kv, int layer, int32_t seq, int32_t pos,
                   const float *k, const float *v);

/* Store n consecutive tokens [pos, pos + n) of seq for one layer: k and v hold
 * n rows of n_kv_head * head_dim f32 values. With cfg.smooth, the write that
 * starts a new sequence's page 0 (pos 0) fixes the layer's channel means from
 * its rows in page 0 (at most P of them), so write a prefill batch with one
 * call. KS_ERR_RANGE (positions outside [0, len), n < 1, bad layer),
 * KS_ERR_NOT_FOUND (no such sequence), KS_ERR_KV_FULL or KS_ERR_NOMEM (a copy
 * on write of a shared page, the means' storage), KS_ERR_STATE (a page whose
 * window rows are freed: positions before the sequence's window). */
ks_status kv_write_rows(struct kv_cache *kv, int layer, int32_t seq, int32_t pos, int32_t n,
                        const float *k, const float *v);

/* The K and V rows of one token as kv_write received them, up to the stored
 * precision: dequantized, the channel means added back, the rotation undone
 * (n_kv_head * head_dim f32 each; NULL skips that half). For tests and
 * diagnostics. KS_ERR_NOT_FOUND, KS_ERR_RANGE as kv_write; KS_ERR_STATE for a
 * window layer's row that is freed. */
ks_status kv_read(const struct kv_cache *kv, int layer, int32_t seq, int32_t pos, float *k, float *v);

/* The longest length <= len (>= 0) seq can be cut back to and continue from:
 * the window rows of the positions [L - swa_window + 1, L) are all still
 * stored (len itself without a sliding window). A caller that wants to cut a
 * sequence back to len (a chat edit) cuts it to this and recomputes the
 * tokens from there. 0 for a sequence that does not exist. */
int32_t kv_seq_resumable(const struct kv_cache *kv, int32_t seq, int32_t len);

/* A new sequence sharing every page of src (reference counts go up, nothing
 * is copied). A later kv_write() into a shared page copies it first
 * (copy-on-write), which needs one page of budget. */
ks_status kv_seq_fork(struct kv_cache *kv, int32_t src, int32_t *seq_out);

/* ---- reading pages in place (attn) --------------------------------------- */

/* One layer of one page of a sequence as attention reads it, without a copy.
 * Each half holds, for every KV head of that layer, a run of page_tokens rows
 * of head_dim values in the half's type (after the Hadamard rotation when
 * cfg.rotate), row_bytes apart; kv_view_run() finds a head's run. The
 * pointers stay valid until the next call that changes the cache (grow,
 * write, requantize, free, ...): read them between two such calls only, as a
 * model step does. */
struct kv_page_view {
    const uint8_t *k, *v;         /* the layer's rows in each half: (n_kv_head, page_tokens, row) */
    enum quant_type tk, tv;       /* their types (kv_type_index() >= 0) */
    size_t k_row_bytes, v_row_bytes;
};

/* true when seq is a live sequence of kv. */
bool kv_seq_exists(const struct kv_cache *kv, int32_t seq);
/* Pages in seq's table: token t lives in page t / page_tokens (0 for a
 * sequence that does not exist). */
int32_t kv_seq_n_pages(const struct kv_cache *kv, int32_t seq);
/* The view of layer `layer` of page p (0 <= p < kv_seq_n_pages) of live
 * sequence seq; for a window layer, p >= kv_seq_first_page(kv, seq, layer).
 * The arguments are the caller's to check; Debug builds assert them. */
void kv_seq_page_view(const struct kv_cache *kv, int32_t seq, int32_t p, int layer, struct kv_page_view *out);
/* The first page of seq from which on every page has layer's rows: 0 but for
 * a window layer, whose earlier pages may have lost theirs (a query at
 * position pos may read only from page (pos - swa_window + 1) / P on). */
int32_t kv_seq_first_page(const struct kv_cache *kv, int32_t seq, int layer);

/* The channel means seq's rows of one layer are stored against (smoothing):
 * n_kv_head * head_dim floats, head-major, in the stored (rotated) space, to be
 * added to a row read from any of its pages (attention adds the V means to its
 * output). NULL when that half (v: V, else K) is stored as it is. Valid like a
 * page view; the arguments are the caller's to check. */
const float *kv_seq_mean(const struct kv_cache *kv, int32_t seq, int layer, bool v);

/* The rotation rows are stored under when cfg.rotate is set: a normalized
 * Walsh-Hadamard transform in place over blocks of the largest power of two
 * dividing n (n itself when n is a power of two). Orthogonal and its own
 * inverse, so q.k is unchanged when q is rotated the same way. SIMD when the
 * build has AVX2 or AVX-512, with the bits of kv_rotate_ref, its scalar twin. */
void kv_rotate(float *x, int n);
void kv_rotate_ref(float *x, int n);

/* First of the page_tokens rows of one KV head in a half of a page view. */
static inline const uint8_t *kv_view_run(const struct kv_config *c, const uint8_t *half, size_t row_bytes, int head)
{
    return half + (size_t)head * (size_t)c->page_tokens * row_bytes;
}

/* ---- the prefix cache (sched's engine) ----------------------------------- */

/* A full page has a content key: key_i = XXH3-128(key_{i-1} | its P token ids
 * | model fingerprint | KV layout: P, rotation, head_dim, layers, KV heads),
 * with key_{-1} = 0. Precision is not in the key, so a demoted page still
 * matches. A keyed page is immutable: a write into it (after a truncation,
 * or into a page mapped by kv_seq_attach_partial) goes to a private copy.
 * Nor are smoothing's channel means in the key: page 0 carries its own, and a
 * later page is mapped only into a sequence whose means are the ones its rows
 * were stored against (each keyed page records their tag), so sharing stays
 * exact whichever write fixed them.
 *
 * When the last sequence holding a keyed page lets go of it, the page stays
 * allocated ("idle") on an LRU list and still counts as used. Idle pages are
 * reclaimed only when an allocation needs their bytes: the dynamic policy
 * first demotes idle pages, then evicts them (least recently used first; a
 * released chain is queued leaf first), and only then demotes pages in use;
 * the static policy evicts idle pages when the budget is exhausted. Evicted
 * pages go to the eviction hook (the SSD tier) unless they came from it.
 *
 * The protocol, used by the scheduler's engine:
 *   kv_seq_attach_pages()    map the cached chain that continues a sequence
 *   kv_seq_import_page()     append one page read back from the SSD tier
 *   kv_seq_attach_partial()  map the best-matching cached page for a partial
 *                            last page (its tokens are then copied on write)
 *   kv_seq_publish()         after a step: key the sequence's full pages
 *   kv_seq_publish_tail()    before freeing it: keep its partial last page */

struct kv_key {
    uint64_t lo, hi;
};

static inline bool kv_key_equal(struct kv_key a, struct kv_key b) { return a.lo == b.lo && a.hi == b.hi; }

/* Cache salts (vLLM's cache_salt): a salted sequence's chain starts from a
 * root made from its salt instead of key_{-1} = 0, so every key of the chain
 * differs: its pages, tails included, are shared with (and read back from the
 * SSD tier by) sequences of the same salt only. Unsalted keys are unchanged.
 * A salt is a 128-bit digest, {0, 0} meaning none; kv_salt_mix folds bytes
 * into one (from {0, 0}: the digest of the bytes), never giving {0, 0}. */
struct kv_key kv_salt_mix(struct kv_key salt, const void *bytes, size_t n);
/* Set seq's salt before it holds a page (forks inherit it). KS_ERR_NOT_FOUND
 * (no such sequence), KS_ERR_STATE (it holds tokens already). */
ks_status kv_seq_set_salt(struct kv_cache *kv, int32_t seq, struct kv_key salt);

/* The chain keys of the n_tokens / P full pages of tokens into keys[] (unsalted). */
void kv_prefix_keys(const struct kv_cache *kv, const int32_t *tokens, int32_t n_tokens, struct kv_key *keys);

/* The salt of a request's cache_salt text (the server's field): every process
 * that derives it this way (a replica, a router) gets the same salt. */
struct kv_key kv_cache_salt(const char *text, size_t n);
/* The salt of a request under --cache-salt-from-key: its API key's n bytes
 * hashed with the deployment's tenant_key, then its own salt (own, {0, 0}:
 * none) folded in, so it splits its tenant's cache further and never reaches
 * another tenant's. Replicas and routers with the same tenant_key agree. */
struct kv_key kv_tenant_salt(struct kv_key tenant_key, const char *api_key, size_t n, struct kv_key own);
/* The bytes (sizeof, its NUL included) a deployment's tenant_key is the keyed
 * digest of (store_redis_keyed_digest, store_keyed_digest). */
#define KV_TENANT_KEY_TAG "kvserve tenant cache salt"

/* Everything besides the tokens and the parent that goes into a page key,
 * as bytes (the model fingerprint, P, rotation, head_dim, layers, KV heads,
 * the sliding-window split), so a process without the cache, a router that
 * learnt the layout from a replica's KV events, computes the same keys. */
enum { KV_KEY_LAYOUT_BYTES = 48 };
struct kv_key_layout {
    int32_t page_tokens;      /* P */
    uint32_t n_bytes;         /* of bytes[] in use */
    uint8_t bytes[KV_KEY_LAYOUT_BYTES];
};
void kv_key_layout(const struct kv_cache *kv, struct kv_key_layout *out);
/* The chain keys of the n_tokens / P full pages of tokens under lay, from the
 * root of salt ({0, 0}: unsalted), equal to the keys a cache of that layout
 * gives a sequence of that salt. lay->page_tokens must be in [16, 256]. */
void kv_layout_keys(const struct kv_key_layout *lay, struct kv_key salt, const int32_t *tokens, int32_t n_tokens,
                    struct kv_key *keys);

/* KV events: fn(user, key, true) when a full page's key enters the prefix
 * cache (computed and published, or read back from a tier), fn(user, key,
 * false) when it leaves (evicted, cleared, copied on write). Tails (partial
 * pages) are not reported. Called on the cache's thread, inside the
 * mutation: fn must only record the key, never call back into the cache. */
typedef void (*kv_key_fn)(void *user, struct kv_key key, bool held);
void kv_set_key_hook(struct kv_cache *kv, kv_key_fn fn, void *user);

/* The key seq's next full page would have along tokens (its tokens are
 * tokens[len, len + P)); false when seq cannot continue from the cache (len
 * not a multiple of P, a page not keyed, the prefix cache off). */
bool kv_seq_next_key(const struct kv_cache *kv, int32_t seq, const int32_t *tokens, struct kv_key *out);
/* The keys of seq's next n full pages along tokens (tokens[len, len + n P)
 * must be there), its salt included: keys[0] is the key they continue (seq's
 * last page's, or its chain's root), keys[1 + i] the i-th page's; keys holds
 * n + 1. Returns n, or 0 when seq cannot continue from the cache. */
int32_t kv_seq_next_keys(const struct kv_cache *kv, int32_t seq, const int32_t *tokens, int32_t n, struct kv_key *keys);

/* seq holds tokens[0, len) and len is a multiple of P: map the cached pages
 * that continue it along tokens, while the sequence stays within max_tokens
 * (each page's tokens are compared, not only its key), up to the longest hit
 * the sequence can continue from (kv_seq_resumable: with a sliding window, the
 * pages before the hit's end must still hold their window rows). The pages are shared,
 * nothing is copied, and len grows by P per page. *n_pages_out: pages mapped
 * (0 when len is not page-aligned or the prefix cache is off).
 * KS_ERR_NOT_FOUND (no such sequence), KS_ERR_NOMEM. */
ks_status kv_seq_attach_pages(struct kv_cache *kv, int32_t seq, const int32_t *tokens, int32_t max_tokens,
                              int32_t *n_pages_out);

/* After kv_seq_attach_pages(): among the cached pages and tails that follow
 * seq's last page (same parent key), map the one sharing the longest run of
 * tokens with tokens[len, max_tokens) and set len to the end of that run (with a
 * sliding window, only pages that still hold their window rows). The page stays
 * shared until the next write into it copies it. *n_tokens_out: tokens
 * gained (0 for none). Errors as kv_seq_attach_pages(). */
ks_status kv_seq_attach_partial(struct kv_cache *kv, int32_t seq, const int32_t *tokens, int32_t max_tokens,
                                int32_t *n_tokens_out);

/* Key every full page of seq whose tokens lie in tokens[0, n_computed) (the
 * K/V of those tokens are written). A page whose key is already cached by
 * another page stays private. Incremental: pages keyed before are skipped. */
ks_status kv_seq_publish(struct kv_cache *kv, int32_t seq, const int32_t *tokens, int32_t n_computed);

/* When seq is done: keep its partial last page too (the "tail", tokens in
 * tokens[0, n_computed) and n_computed == len), so a prompt that continues it
 * maps it with kv_seq_attach_partial() and copies it on its first write. A
 * tail is found only through its parent's key and its tokens, never as a
 * full page, and stays in RAM (the SSD tier keeps full pages only). */
ks_status kv_seq_publish_tail(struct kv_cache *kv, int32_t seq, const int32_t *tokens, int32_t n_computed);

/* Pages as bytes for the SSD tier: a header (layout, types, key, parent, the
 * tag of the channel means its rows are stored against), the P token ids, the
 * K and V halves (each: the global layers' rows, then the window layers'),
 * then, for a smoothed sequence's page 0, its channel means. A page whose
 * window rows are freed is never handed to the tier (it could not serve a
 * hit that ends near it), so every blob is a whole page. */
struct kv_page_blob {
    struct kv_key key, parent;
    int32_t n_tokens;         /* P */
    const void *data;
    size_t len;
};
/* Called for each keyed page that leaves RAM (eviction) or is persisted
 * (kv_prefix_persist), unless the page came from the SSD tier. The blob is
 * only valid during the call. */
typedef void (*kv_evict_fn)(void *user, const struct kv_page_blob *blob);
void kv_set_evict_hook(struct kv_cache *kv, kv_evict_fn fn, void *user);
/* Called by kv_seq_publish() for each full page it keys (with its window
 * rows), as a blob of the same format, so a shared tier (Redis) gets a page as
 * soon as it is computed. Pages mapped from the cache or imported are never
 * handed over. The blob is only valid during the call. */
void kv_set_publish_hook(struct kv_cache *kv, kv_evict_fn fn, void *user);

/* Append a page read back from the SSD tier to seq (len a multiple of P).
 * The blob must match this cache's layout, and its key must be the next key
 * of seq's chain along tokens (tokens[0, len + P) are the prompt); past page
 * 0 it must be stored against seq's channel means (smoothing); anything else
 * is KS_ERR_FORMAT and changes nothing. A page 0 brings its means along.
 * KS_ERR_KV_FULL when no room; KS_ERR_STATE when the key is cached in RAM
 * without its window rows (the hit ends before it). */
ks_status kv_seq_import_page(struct kv_cache *kv, int32_t seq, const int32_t *tokens, const void *blob, size_t len);

/* How many of tokens' leading full pages are cached in RAM, by key alone (no
 * tokens compared, nothing mapped): a cheap answer for a router choosing the
 * replica that holds most of a prompt. 0 with the prefix cache off. */
int32_t kv_prefix_held(const struct kv_cache *kv, const int32_t *tokens, int32_t n_tokens);

/* Hand every keyed page not yet on disk to the eviction hook (at shutdown).
 * Returns the pages handed over. */
int32_t kv_prefix_persist(struct kv_cache *kv);

/* Drop every idle cached page (without the hook), and those of the cache
 * sharing kv's budget (kv_share_budget: a draft model's pages come from the
 * same prompts); pages in use are kept. Returns the pages dropped. */
int32_t kv_prefix_clear(struct kv_cache *kv);

/* The cached chains, longest first: a chain runs from a page without a cached
 * parent to a leaf (a keyed page no other keyed page continues). */
enum { KV_PREFIX_HEAD_TOKENS = 32 };
struct kv_prefix_info {
    struct kv_key leaf;
    int32_t n_pages, n_tokens;
    int32_t n_idle;           /* pages of the chain no sequence holds */
    uint64_t hits;            /* times a request mapped the chain's first page */
    uint64_t leaf_hits;       /* times a request mapped it to the leaf */
    int64_t last_use_ms;      /* unix ms of the latest use of any of its pages */
    int32_t n_head;           /* the chain's first tokens (up to KV_PREFIX_HEAD_TOKENS) */
    int32_t head[KV_PREFIX_HEAD_TOKENS];
};
/* Fill out with up to cap chains, longest first; *n_chains gets how many there
 * are (may exceed cap). Errors: KS_ERR_NOMEM (for the listing's scratch; the
 * cache is untouched). */
ks_status kv_prefix_list(const struct kv_cache *kv, struct kv_prefix_info *out, int32_t cap, int32_t *n_chains);

/* ---- admin and usage (server) -------------------------------------------- */

enum kv_select_kind {
    KV_SELECT_ALL = 0,        /* every page of every sequence, and the idle cached pages */
    KV_SELECT_SEQ = 1,        /* the pages of one sequence */
    KV_SELECT_OLDER_THAN = 2, /* pages whose tokens all lie before the most
                                 recent keep_recent tokens of their sequence,
                                 and the idle cached pages */
};

struct kv_selector {
    enum kv_select_kind kind;
    int32_t seq;         /* KV_SELECT_SEQ */
    int32_t keep_recent; /* KV_SELECT_OLDER_THAN: N */
    int32_t max_pages;   /* > 0: convert only the first max_pages selected pages that change
                            (a slice of a long requantization; call again for the rest); 0: all */
};

/* Pass as type_k or type_v to leave that half of each page as it is. */
#define KV_TYPE_KEEP QUANT_TYPE_COUNT

struct kv_requant_result {
    size_t bytes_before;   /* cache bytes used before the call */
    size_t bytes_after;    /* after it (for a dry run, or with max_pages: after converting the whole selection) */
    int32_t pages_selected;
    int32_t pages_changed; /* selected pages whose K or V type changes (converted, unless a dry run) */
    int32_t pages_left;    /* with max_pages: selected pages that still need converting after the call */
    double ms;             /* wall time of the conversion (0 for a dry run) */
};

/* Convert the selected pages to type_k / type_v in place: allocate the new
 * storage, convert (dequantize + quantize the stored, already rotated rows),
 * swap, free. Positions and sequence lengths are untouched. Pages shared by
 * several sequences change for all of them. With sel->max_pages, the
 * budget check still covers the whole selection, and a page converted by one
 * call is not selected as changing by the next, so calls until pages_left is
 * 0 give the same pages as one call without it.
 * Errors: KS_ERR_INVALID_ARG (not a KV type, a block type whose block does
 * not divide head_dim, bad selector), KS_ERR_NOT_FOUND (no such sequence),
 * KS_ERR_KV_FULL (the result would exceed the budget), KS_ERR_NOMEM. On any
 * error every page is left exactly as it was. result may be NULL. */
ks_status kv_requantize(struct kv_cache *kv, const struct kv_selector *sel, enum quant_type type_k,
                        enum quant_type type_v, bool dry_run, struct kv_requant_result *result);

/* Which fields of struct kv_policy_update apply (bit mask). */
enum {
    KV_SET_POLICY = 1 << 0,
    KV_SET_HIGH_WATERMARK = 1 << 1,
    KV_SET_LOW_WATERMARK = 1 << 2,
    KV_SET_HOT_TOKENS = 1 << 3,
    KV_SET_SINK_TOKENS = 1 << 4,
    KV_SET_FLOOR = 1 << 5,
    KV_SET_TYPE_K = 1 << 6,
    KV_SET_TYPE_V = 1 << 7,
    KV_SET_LADDER = 1 << 8,
};

struct kv_policy_update {
    unsigned set;             /* KV_SET_* bits; fields without their bit are ignored */
    enum kv_policy policy;
    float high_watermark, low_watermark;
    int32_t hot_tokens, sink_tokens;
    enum quant_type floor;
    enum quant_type type_k, type_v; /* start precision of pages allocated from now on */
    enum quant_type ladder[KV_LADDER_MAX];
    int n_ladder;
};

/* Change the policy fields of the configuration at run time, all or nothing:
 * the fields named in u->set are merged into the current configuration and
 * the result is validated as a whole (policy static|dynamic, 0 < low <= high
 * <= 1, sinks and hot window in 0..2^24, floor, ladder and start types KV
 * types usable with this head_dim, the ladder in falling precision, one page at the start types within the
 * budget); KS_ERR_INVALID_ARG names the first bad field and nothing changes.
 * Pages already stored keep their types; the new values apply from the next
 * allocation (a dynamic policy whose high watermark is now below the usage
 * demotes then). Not thread-safe, like every call on the cache. */
ks_status kv_set_policy(struct kv_cache *kv, const struct kv_policy_update *u);

struct kv_usage {
    size_t budget, used, free;               /* used: this cache's pages; free: budget - used - shared_used */
    size_t shared_used;                      /* the pages of the cache sharing the budget (kv_share_budget), 0 without */
    int32_t n_pages;
    int32_t n_seqs;
    int64_t n_tokens;                        /* sum of sequence lengths */
    int32_t pages_k[KV_N_TYPES], pages_v[KV_N_TYPES]; /* pages by K type / by V type */
    int64_t tokens_k[KV_N_TYPES], tokens_v[KV_N_TYPES];
    int64_t demotions;                       /* page halves demoted by the dynamic policy */
    int64_t demotion_passes;                 /* times the high watermark was crossed */
    /* prefix cache; n_pages and the per-type counts include idle pages */
    int32_t n_idle_pages;                    /* keyed pages no sequence holds (reclaimable) */
    size_t idle_bytes;
    int32_t n_keyed_pages;                   /* pages with a content key, idle or in use */
    int32_t n_shared_pages;                  /* pages held by more than one sequence */
    int64_t evictions;                       /* idle pages reclaimed for their bytes */
    int64_t evicted_to_disk;                 /* of which handed to the eviction hook */
    int64_t attached_pages;                  /* pages mapped by kv_seq_attach_* and imported */
    /* sliding windows (all 0 without): used = global + window bytes */
    size_t window_bytes;                     /* window layers' rows still stored */
    int32_t n_window_pages;                  /* pages that hold them */
    int64_t window_frees;                    /* pages whose window rows were freed */
};
void kv_usage(const struct kv_cache *kv, struct kv_usage *out);

struct kv_seq_usage {
    int32_t len;
    int32_t n_pages;
    size_t bytes;        /* storage of its pages (shared pages counted in full) */
    size_t window_bytes; /* of which window layers' rows */
    int32_t n_window_pages; /* its pages that still hold them */
    int32_t pages_k[KV_N_TYPES], pages_v[KV_N_TYPES];
};
/* Live sequence ids are below kv_seq_id_limit(); kv_seq_usage() returns
 * KS_ERR_NOT_FOUND for an id that is not live. */
int32_t kv_seq_id_limit(const struct kv_cache *kv);
ks_status kv_seq_usage(const struct kv_cache *kv, int32_t seq, struct kv_seq_usage *out);

/* Tokens that still fit in the free budget plus the idle cached pages (whole
 * pages) if every new page were stored at one precision (K and V alike), and
 * under the dynamic policy for one new sequence (sinks and hot window at the
 * start precision, the rest at the floor, after demoting every demotable page
 * already in the cache).
 * When the floor cannot be used (head_dim not a multiple of its block) the dynamic figure
 * equals the start-precision one: the policy then keeps everything there.
 * Past the dynamic figure the policy lowers sinks and hot windows too, so a
 * sequence can reach the floor's figure.
 * With a sliding window, one sequence holds the window rows of at most
 * ceil(swa_window / P) + 1 pages while it decodes (at the start precision in
 * the dynamic figure), every other page its global rows only; a prefill chunk
 * holds its own pages' window rows too until the next growth. */
struct kv_fit {
    int64_t tokens[KV_N_TYPES]; /* by kv_type_index; -1 where the type is not allowed */
    int64_t dynamic;
    int64_t start;              /* at the configured type_k / type_v */
    int64_t chunk;              /* the longest first prefill chunk of a new sequence, under the cache's policy:
                                   a chunk's pages hold their window rows until the next step (the start or
                                   dynamic figure itself without a sliding window) */
};
void kv_fit(const struct kv_cache *kv, struct kv_fit *out);
/* The same for an empty cache of this configuration (kvserve info). */
ks_status kv_fit_config(const struct kv_config *cfg, struct kv_fit *out);

/* One page of a sequence, in token order (page i holds tokens [i*P, i*P+P)). */
struct kv_page_info {
    enum quant_type type_k, type_v;
    int32_t ref;              /* sequences sharing it (> 1: shared prefix or fork) */
    bool keyed;               /* in the prefix cache */
    bool window_rows;         /* its window layers' rows are stored (always true without a sliding window) */
};
/* Fill up to cap entries of seq's pages in order; *n_out is the sequence's
 * page count (may exceed cap; out may be NULL when cap is 0). KS_ERR_NOT_FOUND
 * for a sequence that is not live. */
ks_status kv_seq_pages(const struct kv_cache *kv, int32_t seq, struct kv_page_info *out, int32_t cap,
                       int32_t *n_out);

#endif
