/* quant: Y = X * W^T over the traits table, with AVX-512 fast paths.
 *
 * Paths, chosen by weight type and token count:
 *  - decode (n_tokens < MM_PREFILL_MIN), Q4_0/Q8_0: each thread streams one
 *    contiguous range of rows; activations are packed once into a layout the
 *    row kernel reads with plain loads (dec_pack).
 *  - prefill, Q4_0/Q8_0: activations are quantized to Q8_0 and transposed so a
 *    512-bit register holds 4 consecutive bytes of 16 tokens (pre_pack). A
 *    weight dword is broadcast against it (VNNI dpbusd), so a micro-tile of
 *    Q8_R rows x 16*Q8_TT tokens keeps its accumulators in registers and each
 *    weight byte is loaded once per 32 tokens.
 *  - prefill, F32/F16/BF16: the same tiling with f32 FMAs on f32 activations.
 *  - prefill, k-quants (Q2_K..Q6_K): activations to Q8_K rows; weight rows
 *    unpacked 32 at a time into panels for the register tiles of
 *    kq_gemm*.c (rows in lanes, a token's dword broadcast against them).
 *  - everything else: activations to the vec_dot_type, then traits vec_dot
 *    over row chunks x all tokens, so a chunk of weights stays in cache;
 *    batches of k-quants below the tiles and of the i-quants (IQ4_NL,
 *    IQ4_XS, MXFP4, IQ3_XXS, IQ3_S, IQ2_S, IQ2_XXS, IQ2_XS, IQ1_S, IQ1_M)
 *    run a multi-token vec_dot that unpacks each weight block once for
 *    several tokens (kq_internal.h, iq4_mxfp4.h, iq3.h, iq2.h).
 *  - repacked Q4_0/Q8_0 weights (quant_matmul_repacked): up to RP_GEMM_MAX
 *    tokens, the group kernels of quant_repack.c over row groups taken from
 *    a shared counter; more, the prefill tiles above, unpacking rows from
 *    the layout. Repacked IQ4_NL/MXFP4 weights run the group kernels at
 *    every batch size (they have no tiles).
 *  - repacked Q2_K..Q6_K weights: the group kernels of kq_repack*.c up to a
 *    crossover (kqrp_group_max), the k-quant tiles above on panels unpacked
 *    straight from the layout; repacked IQ4_XS the group kernels
 *    at every batch size. */
#include <stdalign.h>
#include <stdatomic.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "quant/iq4_mxfp4.h"
#include "quant/iq3.h"
#include "quant/iq2.h"
#include "quant/kq_internal.h"
#include "quant/quant_internal.h"
#include "vmath/vmath_simd.h"

#if defined(QUANT_HAVE_AVX512)
#include <immintrin.h>
#endif

#define MM_ALIGN 64
#define MM_TOK_GROUP 16    /* tokens per 512-bit lane set */
#ifndef Q8_R
#define Q8_R 8             /* integer micro-tile: weight rows */
#endif
#ifndef Q8_TT
#define Q8_TT 1            /* integer micro-tile: groups of 16 tokens */
#endif
#ifndef FL_R
#define FL_R 6             /* float micro-tile: weight rows */
#endif
#define FL_TT 2            /* float micro-tile: groups of 16 tokens */
#define MM_PREFILL_MIN 8   /* token count from which the tiled kernels win */
#define MM_ROW_CHUNK 16    /* generic path: rows per cache-resident chunk */
#define MM_KQ_TOKENS 64    /* generic path, k-quants: tokens per L2-resident block */
#define MM_RANGES 16       /* decode: threads with a range of their own (take_own_chunk) */
#define QB 32              /* elements per Q8_0 block */

static size_t align_up(size_t n) { return (n + MM_ALIGN - 1) / MM_ALIGN * MM_ALIGN; }
static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

enum mm_path { MM_GENERIC, MM_Q8_DECODE, MM_Q8_PREFILL, MM_FLOAT_DECODE, MM_FLOAT_PREFILL, MM_Q8_PREFILL_AVX2, MM_REPACKED,
               MM_KQ_PREFILL, MM_KQ_REPACKED };

static inline bool is_q8_family(enum quant_type t) { return t == QUANT_Q4_0 || t == QUANT_Q8_0; }
/* Repacked, these types run the group kernels at every batch size: no tile reads their layout (q5's
 * 8-lane order costs a tile what it costs a group kernel: a cvt and an fma per lane and block). */
static inline bool rp_every_batch(enum quant_type t)
{
    return t == QUANT_IQ4_NL || t == QUANT_MXFP4 || t == QUANT_Q5_0 || t == QUANT_Q5_1;
}
static inline bool is_repackable(enum quant_type t) { return is_q8_family(t) || rp_every_batch(t); }
static bool is_float(enum quant_type t) { return t == QUANT_F32 || t == QUANT_F16 || t == QUANT_BF16; }
static bool is_kquant(enum quant_type t) { return t >= QUANT_Q2_K && t <= QUANT_Q8_K; }

/* k-quant batches from this many tokens run the tiles of kq_gemm*.c; from
 * MM_KQ_GEMM_MULTI_MIN for a type with a multi-token vec_dot, which unpacks
 * in registers: the tiles unpack rows into memory once per matmul, which
 * costs about what 30 tokens of q4_K tiles do (llama-1b shapes, AVX-512:
 * tiles 1.7x slower than multi at 16 tokens, 1.5x faster at 64). */
#ifndef MM_KQ_GEMM_MIN
#define MM_KQ_GEMM_MIN MM_PREFILL_MIN
#endif
#ifndef MM_KQ_GEMM_MULTI_MIN
#define MM_KQ_GEMM_MULTI_MIN 32
#endif

static bool kq_gemm_fits(enum quant_type wtype, int64_t n_tokens)
{
    bool kquant = wtype >= QUANT_Q2_K && wtype <= QUANT_Q6_K;
    if (!kquant || !quant_kq_tiles_best())
        return false;
    return n_tokens >= (quant_kquants_dot_multi(wtype) ? MM_KQ_GEMM_MULTI_MIN : MM_KQ_GEMM_MIN);
}

static enum mm_path choose_path(enum quant_type wtype, int64_t n_tokens)
{
    if (kq_gemm_fits(wtype, n_tokens))
        return MM_KQ_PREFILL;
#if defined(QUANT_HAVE_AVX512)
    bool prefill = n_tokens >= MM_PREFILL_MIN;
    if (is_q8_family(wtype))
        return prefill ? MM_Q8_PREFILL : MM_Q8_DECODE;
    if (is_float(wtype))
        return prefill ? MM_FLOAT_PREFILL : MM_FLOAT_DECODE;
#else
#if defined(QUANT_HAVE_AVX2)
    if (is_q8_family(wtype) && n_tokens >= MM_PREFILL_MIN)
        return MM_Q8_PREFILL_AVX2;
#endif
    (void)n_tokens;
    if (is_float(wtype))
        return MM_FLOAT_DECODE;
#endif
    return MM_GENERIC;
}

/* Repacked weights: batches up to RP_GEMM_MAX tokens run the group kernels
 * (quant_repack.c); larger ones the prefill tiles, which unpack the rows.
 * Without SIMD prefill tiles, and for IQ4_NL/MXFP4, every batch runs the
 * group kernels. */
/* llama-1b q4_0 / q8_0 prefill, 2 threads, group kernels vs tiles (tok/s):
 * AVX-512 at 17 tokens 155 vs 61 (q4_0), 131-148 vs 60 (q8_0), at 32 176 vs
 * 102, at 64 164-179 vs 132-152, at 128 140 vs 185; AVX2 at 17 75 vs 42, at
 * 32 74-76 vs 63-66, at 64 73-79 vs 78-86. The tiles pad to whole groups of
 * 16 tokens, so 17 tokens cost what 32 do. */
#ifndef RP_GEMM_MAX
#if defined(QUANT_HAVE_AVX512)
#define RP_GEMM_MAX 64
#else
#define RP_GEMM_MAX 32
#endif
#endif
#define RP_MIN_CHUNK_ROWS 64 /* rows per work item at least: a long sequential stream */
#define SPAN_SHRINK 2        /* take_own_span: a take is at most half of what is left of a range */
#if defined(QUANT_HAVE_AVX2)
#define RP_HAVE_TILES 1
#endif

/* Repacked k-quants (Q2_K to Q6_K): batches up to kqrp_group_max() tokens run the group
 * kernels of kq_repack*.c, larger ones the prefill tiles on panels unpacked
 * straight from the layout (a SIMD copy, 10-15x faster than unpacking
 * row-major rows, so these tiles beat the row-major ones). Crossovers, ns per
 * block-token, group kernels vs tiles on repacked panels (llama-1b widths,
 * 1 thread, min of 10-20): AVX-512 q4_K 1.75 vs 1.75 at 64 tokens, 1.78 vs
 * 1.56 at 512; q6_K 3.3 vs 3.4 at 32, 3.2 vs 2.9 at 64, 3.4 vs 2.55 at 512.
 * AVX2 q4_K 4.0 vs 4.1 at 32, 4.0 vs 3.9 at 64; q6_K 9.0 vs 9.0 at 8, 9.3
 * vs 7.2 at 16. Q5_K: AVX-512 4.5 vs 4.5 at 16, 4.5 vs 3.6 at 32; AVX2 8.5
 * vs 8.9 at 8, 8.5 vs 7.1 at 16. AVX2 q6_K in its own layout (kq_internal.h;
 * 512 x 2048, medians of 15, two rounds on a busy machine): 12.4, 12.0 vs
 * 14.8, 13.7 at 8; 12.7, 12.0 vs 12.7, 12.1 at 12; 12.8, 11.9 vs 11.7, 10.9
 * at 16. AVX-512 q6_K and q5_K with 8 tokens per pass over their unpacked
 * chunks (Zen 5, 1 thread, 3-5 rounds): q6_K groups 1.84-1.89 vs tiles
 * 2.26-2.31 at 64 tokens, q5_K 1.89-2.27 vs 2.24-3.30. Q2_K (Zen 4, 1 thread,
 * 2048 x 8192, ms for the batch): AVX2 groups 2.74 vs tiles 3.42 at 12 tokens,
 * 14.9 vs 16.5 at 64, 30.6 vs 31.6 at 128; AVX-512 groups 7.16 at 64, tiles
 * 8.58 at 65 and 15.1 at 128; pp512 within noise either way. Q3_K (the same
 * shape; its panels unpacked by quant_kqrp_unpack8_avx2): AVX-512 groups 2.50
 * vs tiles 2.50 at 8 tokens, 5.00 vs 3.90 at 16; AVX2 3.39 vs 3.49 at 6, 4.53
 * vs 3.70 at 8. */
#ifndef KQRP_Q2K_MAX
#define KQRP_Q2K_MAX 64
#endif
#ifndef KQRP_Q3K_MAX
#if defined(QUANT_HAVE_AVX512)
#define KQRP_Q3K_MAX 8
#else
#define KQRP_Q3K_MAX 6
#endif
#endif
static int64_t kqrp_group_max(enum quant_type wtype)
{
    if (wtype == QUANT_IQ4_XS) /* no tiles: its group kernels at every batch size */
        return INT64_MAX;
    if (wtype == QUANT_Q2_K)
        return KQRP_Q2K_MAX;
    if (wtype == QUANT_Q3_K)
        return KQRP_Q3K_MAX;
#if defined(QUANT_HAVE_AVX512)
    return 64;
#else
    return wtype == QUANT_Q4_K ? 32 : wtype == QUANT_Q6_K ? 12 : 8;
#endif
}

static enum mm_path choose_repacked_path(enum quant_type wtype, int64_t n_tokens)
{
    if (quant_kqrp_type(wtype))
        return n_tokens > kqrp_group_max(wtype) && quant_kq_tiles_best() ? MM_KQ_PREFILL : MM_KQ_REPACKED;
#if defined(RP_HAVE_TILES)
    if (n_tokens > RP_GEMM_MAX && !rp_every_batch(wtype))
        return choose_path(wtype, n_tokens);
#endif
    (void)wtype;
    (void)n_tokens;
    return MM_REPACKED;
}

/* Bytes of one token packed for the group kernels: its blocks back to back,
 * as a job reads them. */
static size_t rp_token_bytes(int64_t cols) { return sizeof(struct quant_rp_act) * (size_t)(cols / QB); }

static size_t rp_work(enum quant_type wtype, int64_t cols, int64_t n_tokens)
{
#if defined(RP_HAVE_TILES)
    if (!rp_every_batch(wtype))
        n_tokens = n_tokens < RP_GEMM_MAX ? n_tokens : RP_GEMM_MAX;
#endif
    (void)wtype;
    return rp_token_bytes(cols) * (size_t)n_tokens + MM_ALIGN;
}

/* decode pack, per token: per pair of blocks 64 bytes of q8 values, 16 int32
 * corrections (lanes 0 and 8: -k*sum of each block) and 16 scales. */
#define DEC_CHUNK_BYTES (64 + 64 + 64)
static size_t dec_token_bytes(int64_t cols) { return (size_t)ceil_div(cols / QB, 2) * DEC_CHUNK_BYTES; }

/* prefill pack, per group of 16 tokens: per block 8 x 64 bytes of q8 values
 * (+128, as u8) and 16 scales. */
#define PRE_BLOCK_BYTES (8 * 64 + 64)
static size_t pre_group_bytes(int64_t cols) { return (size_t)(cols / QB) * PRE_BLOCK_BYTES; }

static size_t work_for_path(const struct quant_traits *tr, enum quant_type wtype, int64_t cols, int64_t n_tokens)
{
    switch (choose_path(wtype, n_tokens)) {
    case MM_Q8_DECODE:
        return align_up(dec_token_bytes(cols)) * (size_t)n_tokens + MM_ALIGN;
    case MM_Q8_PREFILL:
        return align_up(pre_group_bytes(cols)) * (size_t)ceil_div(n_tokens, MM_TOK_GROUP) + MM_ALIGN;
    case MM_FLOAT_PREFILL:
        return (size_t)cols * MM_TOK_GROUP * sizeof(float) * (size_t)ceil_div(n_tokens, MM_TOK_GROUP) + MM_ALIGN;
    case MM_FLOAT_DECODE:
        return 1;
    case MM_Q8_PREFILL_AVX2:
#if defined(QUANT_HAVE_AVX2) && !defined(QUANT_HAVE_AVX512)
        return quant_avx2_prefill_work(cols, n_tokens);
#else
        break;
#endif
    case MM_REPACKED:
        return rp_work(wtype, cols, n_tokens);
    case MM_KQ_PREFILL: /* the Q8_K rows of the generic path */
    case MM_KQ_REPACKED:
    case MM_GENERIC:
        break;
    }
    return quant_row_size(tr->vec_dot_type, cols) * (size_t)n_tokens + MM_ALIGN;
}

/* Non-decreasing in n_tokens (the decode layout is larger per token than the
 * prefill one), so a buffer sized for the largest batch serves all smaller. */
size_t quant_matmul_work_size(enum quant_type wtype, int64_t cols, int64_t n_tokens)
{
    const struct quant_traits *tr = quant_traits(wtype);
    if (!tr || cols <= 0 || n_tokens <= 0 || quant_row_size(wtype, cols) == 0)
        return 0;
    size_t need = work_for_path(tr, wtype, cols, n_tokens);
    if (n_tokens >= MM_PREFILL_MIN) {
        size_t small = work_for_path(tr, wtype, cols, MM_PREFILL_MIN - 1);
        need = need > small ? need : small;
    }
    if (is_repackable(wtype)) { /* the same buffer serves the repacked kernels */
        size_t rp = rp_work(wtype, cols, n_tokens);
        need = need > rp ? need : rp;
    }
    return need;
}

/* A product of fewer multiply-adds than this runs on the caller alone: a
 * region costs its wake-up, the hand-off of the activations' and outputs'
 * cache lines between cores and the join, 1-3 us on a 2-vCPU VM, more than
 * half of such a product takes (stories260K, all of whose matmuls are this
 * small, decoded at half the speed of one thread with two). Larger ones
 * gain from every core. */
#define MM_INLINE_MACS ((int64_t)1 << 18)
static threads_pool *mm_pool(threads_pool *pool, int64_t macs) { return macs < MM_INLINE_MACS ? NULL : pool; }

/* Work split into one contiguous range per call index (take_own_span). */
struct mm_ranges {
    struct {
        alignas(64) atomic_llong next; /* chunks of range i taken so far */
    } range[MM_RANGES];
    atomic_llong shared; /* more call indices than ranges: one counter */
};

struct mm {
    const struct quant_traits *tr;
    enum quant_type wtype;
    enum mm_path path;
    const uint8_t *W;
    size_t wrow; /* bytes per weight row */
    int64_t rows, cols, n_tokens;
    const float *X;
    float *Y;
    uint8_t *work; /* aligned */
    size_t xrow;   /* bytes per packed token (or token group) */
    const int32_t *xi; /* NULL, or token t's packed row (decode, generic) or X row (float decode) is xi[t] */
    int corr_shift; /* q8 decode: correction is -(sum << shift) */
    bool repacked;  /* W is in quant_repack's layout */
    atomic_int failed;
    atomic_llong next_panel; /* prefill: panels are taken one at a time */
    struct mm_ranges own;    /* decode: take_own_chunk */
};

/* Prefill panels are handed out dynamically: a thread that loses its core
 * for a while (the machine is shared) does not hold the others up. */
static inline int64_t take_panel(struct mm *m, int64_t n_panels)
{
    int64_t p = atomic_fetch_add_explicit(&m->next_panel, 1, memory_order_relaxed);
    return p < n_panels ? p : -1;
}

/* Units [*u0, *u1) of n_units split into nth contiguous ranges, one per
 * call index: each call takes the units of its own range in order, so on a
 * quiet machine every thread streams one contiguous run of rows as a static
 * split would, then takes the units left in the others' ranges, so a thread
 * that loses its core for a while does not hold the step up. A take is up
 * to max_units while much of a range is left, then half of what is left, down
 * to one unit, so the thread that finishes last is at most a unit behind the
 * others, not a whole chunk (gemma3-1b's down: a 4-group chunk of its 6912
 * columns is ~30 us of one core's stream). Few takes: each is a locked
 * add, which waits for the stream's loads in flight to arrive and starts the
 * next ones from an empty window (gemma3-1b Q4_K_M decode: takes of at most
 * an eighth of a range, shrinking by quarters, and 64-row spans in the
 * gate/up region cost 12% of decode speed against a quarter, halves and
 * 1024 rows). Which rows a span holds never changes a row's result. Returns
 * false when none is left. */
static bool take_own_span(struct mm_ranges *w, int ith, int nth, int64_t n_units, int64_t max_units, int64_t *u0,
                          int64_t *u1)
{
    bool one_counter = nth > MM_RANGES;
    for (int k = 0; k < (one_counter ? 1 : nth); k++) {
        int r = (ith + k) % nth;
        int64_t lo = 0, hi = n_units;
        atomic_llong *next = &w->shared;
        if (!one_counter) {
            threads_split(n_units, r, nth, &lo, &hi);
            next = &w->range[r].next;
        }
        int64_t left = hi - lo - atomic_load_explicit(next, memory_order_relaxed);
        if (left <= 0)
            continue;
        int64_t span = (left + SPAN_SHRINK - 1) / SPAN_SHRINK;
        span = span < 1 ? 1 : span > max_units ? max_units : span;
        int64_t c = atomic_fetch_add_explicit(next, span, memory_order_relaxed);
        if (c < hi - lo) {
            *u0 = lo + c;
            *u1 = lo + (c + span < hi - lo ? c + span : hi - lo);
            return true;
        }
    }
    return false;
}

/* The next chunk of n_chunks for call ith: take_own_span one unit at a time; -1 when none is left. */
static int64_t take_own_chunk(struct mm_ranges *w, int ith, int nth, int64_t n_chunks)
{
    int64_t c0, c1;
    return take_own_span(w, ith, nth, n_chunks, 1, &c0, &c1) ? c0 : -1;
}

/* The group kernels' job for m: tokens packed by quant_rp_pack_token at
 * m->work, read through m->xi when set. */
static struct quant_rp_job rp_job(const struct mm *m)
{
    return (struct quant_rp_job){.wtype = m->wtype, .W = m->W, .nb = m->cols / QB,
                                 .act = (const struct quant_rp_act *)m->work, .act_rows = m->xi,
                                 .n_tokens = m->n_tokens, .Y = m->Y, .ldy = m->rows};
}

/* ---- generic path --------------------------------------------------------- */

/* Q8_0 and Q8_1 activations take ggml-cpu's x86 rounding: quant_ref.c says why. */
quant_from_float_fn quant_act_quantizer(enum quant_type wtype)
{
    const struct quant_traits *tr = quant_traits(wtype);
    if (!tr || !tr->is_quantized)
        return NULL;
    if (tr->vec_dot_type == QUANT_Q8_1)
        return quant_q8_1_act_from_float_ref;
    return tr->vec_dot_type == QUANT_Q8_0 ? quant_q8_0_act_from_float : quant_traits(tr->vec_dot_type)->from_float;
}

static void generic_quantize(void *vctx, int ith, int nth)
{
    struct mm *m = vctx;
    quant_from_float_fn quantize = quant_act_quantizer(m->wtype);
    int64_t lo, hi;
    threads_split(m->n_tokens, ith, nth, &lo, &hi);
    for (int64_t t = lo; t < hi; t++)
        quantize(m->X + t * m->cols, m->work + t * m->xrow, m->cols);
}

/* Software prefetch of a whole row some way ahead: without it the
 * hardware prefetcher leaves single-token matmuls latency-bound. 4 KiB ahead
 * beat 12 KiB by 15-25% for q6_K/q4_K decode with 2 threads (bench_matmul,
 * qwen3-0.6b and llama-1b shapes); 2, 6 and 8 KiB were in between. */
#ifndef MM_PREFETCH_BYTES
#define MM_PREFETCH_BYTES 4096
#endif

static void prefetch_row(const struct mm *m, int64_t r)
{
    if (r >= m->rows)
        return;
    quant_prefetch_weights(m->W + r * m->wrow, m->wrow, false);
}

/* The k-quant kernel that unpacks each weight block once for several
 * tokens (it reads them at a fixed stride), or NULL. */
static quant_kq_dot_multi_fn generic_multi(enum quant_type wtype, int64_t n_tokens)
{
    if (n_tokens <= 1)
        return NULL;
    if (is_kquant(wtype))
        return quant_kquants_dot_multi(wtype);
    quant_kq_dot_multi_fn f = quant_iq4_dot_multi(wtype);
    if (!f)
        f = quant_iq3_dot_multi(wtype);
    return f ? f : quant_iq2_dot_multi(wtype);
}

/* Row chunks [lo, hi) of MM_ROW_CHUNK rows, all tokens. */
static void generic_chunks(const struct mm *m, int64_t lo, int64_t hi)
{
    /* k-quant kernels prefetch their own stream (kq_internal.h) */
    int64_t ahead = is_kquant(m->wtype) ? 0 : MM_PREFETCH_BYTES / (int64_t)m->wrow + 1;
    bool direct = m->path == MM_FLOAT_DECODE; /* float weights read X as is */
    quant_kq_dot_multi_fn multi = generic_multi(m->wtype, m->n_tokens);
    if (multi) { /* k-quants unpack each weight block once for several tokens */
        for (int64_t c = lo; c < hi; c++) {
            int64_t r0 = c * MM_ROW_CHUNK, r1 = r0 + MM_ROW_CHUNK < m->rows ? r0 + MM_ROW_CHUNK : m->rows;
            /* a block of tokens stays in L2 while the chunk's rows pass over it */
            for (int64_t t0 = 0; t0 < m->n_tokens; t0 += MM_KQ_TOKENS) {
                int nt = (int)(m->n_tokens - t0 < MM_KQ_TOKENS ? m->n_tokens - t0 : MM_KQ_TOKENS);
                for (int64_t r = r0; r < r1; r++)
                    multi((int)m->cols, nt, &m->Y[t0 * m->rows + r], (size_t)m->rows, m->W + r * m->wrow,
                          m->work + t0 * m->xrow, m->xrow);
            }
        }
        return;
    }
    for (int64_t c = lo; c < hi; c++) {
        int64_t r0 = c * MM_ROW_CHUNK, r1 = r0 + MM_ROW_CHUNK < m->rows ? r0 + MM_ROW_CHUNK : m->rows;
        for (int64_t t = 0; t < m->n_tokens; t++) {
            int64_t xt = m->xi ? m->xi[t] : t;
            const void *x = direct ? (const void *)(m->X + xt * m->cols) : (const void *)(m->work + xt * m->xrow);
            for (int64_t r = r0; r < r1; r++) {
                if (t == 0 && ahead)
                    prefetch_row(m, r + ahead);
                m->tr->vec_dot((int)m->cols, &m->Y[t * m->rows + r], m->W + r * m->wrow, x);
            }
        }
    }
}

/* Start a stream: the first `ahead` bytes of rows [lo, hi), after which the
 * row loop prefetches that far ahead of itself. */
static void prime_rows(const struct mm *m, int64_t lo, int64_t hi, size_t ahead)
{
    size_t bytes = (size_t)(hi - lo) * m->wrow;
    quant_prefetch_weights(m->W + lo * m->wrow, bytes < ahead ? bytes : ahead, false);
}

/* About 8 chunks of rows per thread (take_own_chunk), each a multiple of
 * MM_ROW_CHUNK rows and at least 64. */
static void generic_compute(void *vctx, int ith, int nth)
{
    struct mm *m = vctx;
    int64_t units = ceil_div(m->rows, MM_ROW_CHUNK);
    int64_t per = ceil_div(units, (int64_t)nth * 8), min_per = ceil_div(64, MM_ROW_CHUNK);
    per = per < min_per ? min_per : per;
    int64_t n_chunks = ceil_div(units, per), prev_hi = -1;
    for (int64_t ci; (ci = take_own_chunk(&m->own, ith, nth, n_chunks)) >= 0;) {
        int64_t lo = ci * per, hi = lo + per < units ? lo + per : units;
        if (lo != prev_hi)
            prime_rows(m, lo * MM_ROW_CHUNK, hi * MM_ROW_CHUNK < m->rows ? hi * MM_ROW_CHUNK : m->rows,
                       is_kquant(m->wtype) ? KQ_PREFETCH_BYTES : MM_PREFETCH_BYTES);
        prev_hi = hi;
        generic_chunks(m, lo, hi);
    }
}

/* ---- prefill: k-quant tiles (kq_gemm*.c) ------------------------------------ */

/* Rows [r0, r1) x all tokens on the Q8_K rows the generic quantizer wrote. */
static void kq_rows(const struct mm *m, int64_t r0, int64_t r1, uint8_t *scratch)
{
    const struct quant_kq_gemm g = {
        .wtype = m->wtype, .W = m->W, .wrow = m->wrow, .cols = m->cols, .X = m->work, .xrow = m->xrow,
        .xi = m->xi, .n_tokens = m->n_tokens, .Y = m->Y, .ldy = m->rows, .repacked = m->repacked, .rows = m->rows,
    };
    quant_kq_gemm_rows(&g, quant_kq_tiles_best(), r0, r1, scratch);
}

/* The group kernels' job: every token's Q8_K row, as the generic quantizer wrote them. */
static struct quant_kq_gemm kqrp_job(const struct mm *m)
{
    return (struct quant_kq_gemm){
        .wtype = m->wtype, .W = m->W, .wrow = m->wrow, .cols = m->cols, .X = m->work, .xrow = m->xrow,
        .xi = m->xi, .n_tokens = m->n_tokens, .Y = m->Y, .ldy = m->rows, .repacked = true, .rows = m->rows,
    };
}

static uint8_t *kq_scratch(int64_t cols) { return aligned_alloc(MM_ALIGN, align_up(quant_kq_scratch_bytes(cols))); }

static void kq_compute(void *vctx, int ith, int nth)
{
    struct mm *m = vctx;
    (void)ith;
    (void)nth;
    uint8_t *scratch = kq_scratch(m->cols);
    if (!scratch) {
        atomic_store(&m->failed, 1);
        return;
    }
    int64_t n_items = ceil_div(m->rows, KQ_GEMM_ROWS);
    for (int64_t it; (it = take_panel(m, n_items)) >= 0;) {
        int64_t r0 = it * KQ_GEMM_ROWS;
        kq_rows(m, r0, r0 + KQ_GEMM_ROWS < m->rows ? r0 + KQ_GEMM_ROWS : m->rows, scratch);
    }
    free(scratch);
}

#if defined(QUANT_HAVE_AVX512)
/* ---- Q8_0 quantization of activations (bit-exact with the reference) ------ */

/* One block of 32: q[32] int8, returns the f16-rounded scale, *sum = sum(q). */
static inline float q8_block(const float *x, int8_t *q, int *sum)
{
    return quant_f16_to_f32(quant_f32_to_f16(quant_q8_0_act_block_avx512(x, q, sum)));
}

/* ---- decode: Q4_0 / Q8_0 rows against one packed token -------------------- */

static void dec_pack_token(const float *x, int64_t cols, int shift, uint8_t *out)
{
    int64_t nb = cols / QB;
    for (int64_t c = 0; c < ceil_div(nb, 2); c++) {
        uint8_t *chunk = out + c * DEC_CHUNK_BYTES;
        int8_t *q = (int8_t *)chunk;
        int32_t *corr = (int32_t *)(chunk + 64);
        float *dy = (float *)(chunk + 128);
        memset(chunk, 0, DEC_CHUNK_BYTES);
        for (int h = 0; h < 2 && 2 * c + h < nb; h++) {
            float d = q8_block(x + (2 * c + h) * QB, q + h * QB, NULL);
            for (int l = 0; l < 8; l++) { /* lane l meets products 4l .. 4l + 3 */
                const int8_t *g = q + h * QB + 4 * l;
                corr[h * 8 + l] = -((g[0] + g[1] + g[2] + g[3]) * (1 << shift));
            }
            for (int l = 0; l < 8; l++)
                dy[h * 8 + l] = d;
        }
    }
}

static void dec_pack(void *vctx, int ith, int nth)
{
    struct mm *m = vctx;
    int64_t lo, hi;
    threads_split(m->n_tokens, ith, nth, &lo, &hi);
    for (int64_t t = lo; t < hi; t++)
        dec_pack_token(m->X + t * m->cols, m->cols, m->corr_shift, m->work + t * m->xrow);
}

/* Q4_0 pair of blocks (36 bytes) -> 64 nibble values in element order. */
static inline __m512i q4_0_pair(__m512i raw)
{
    const __m512i idx = _mm512_set_epi8(
        35, 34, 33, 32, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20,
        35, 34, 33, 32, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20,
        17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2,
        17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2);
    const __m512i shifts = _mm512_set_epi16(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0,
                                            4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512i v = _mm512_srlv_epi16(_mm512_permutexvar_epi8(idx, raw), shifts);
    return _mm512_and_si512(v, _mm512_set1_epi8(0x0f));
}

/* Scales of two blocks at word offsets w0 and w1 of raw -> 8 lanes each. */
static inline __m512 pair_scales(__m512i raw, int w1)
{
    __m256i idx = _mm256_set_epi16((short)w1, (short)w1, (short)w1, (short)w1, (short)w1, (short)w1, (short)w1,
                                   (short)w1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m256i h = _mm512_castsi512_si256(_mm512_permutexvar_epi16(_mm512_castsi256_si512(idx), raw));
    return _mm512_cvtph_ps(h);
}

/* Q8_0 pair of blocks (68 bytes) -> 64 values +128 as u8. */
static inline __m512i q8_0_pair(__m512i lo, __m512i hi)
{
    const __m512i idx = _mm512_set_epi8(
        67, 66, 65, 64, 63, 62, 61, 60, 59, 58, 57, 56, 55, 54, 53, 52,
        51, 50, 49, 48, 47, 46, 45, 44, 43, 42, 41, 40, 39, 38, 37, 36,
        33, 32, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18,
        17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2);
    return _mm512_xor_si512(_mm512_permutex2var_epi8(lo, idx, hi), _mm512_set1_epi8((char)0x80));
}

/* decode: rows per step, sharing the activation loads. Eight rows keep more
 * DRAM streams in flight than four: qwen3-0.6b q8_0 matmuls 37-44 -> 46-47
 * GB/s, llama-1b q4_0 27-31 -> 33-36 GB/s (bench_matmul -t 2). */
#define DEC_NR 8
#ifndef DEC_AHEAD_BYTES
#define DEC_AHEAD_BYTES 8192 /* decode: prefetch distance, at least one step of DEC_NR rows (two was 3-6% slower) */
#endif

/* One pair of blocks of a Q4_0 or Q8_0 row as 64 u8 values, and its two
 * scales in lanes 0-7 and 8-15. Near the end of the row the loads are masked
 * so no byte past the row is read. */
static inline __attribute__((always_inline)) __m512i dec_load(enum quant_type wt, const uint8_t *w, int64_t c,
                                                              int64_t nb, __m512 *dx)
{
    bool full = 2 * c + 2 <= nb, last = 2 * c + 2 >= nb;
    if (wt == QUANT_Q4_0) {
        const uint8_t *b = w + c * 2 * sizeof(block_q4_0);
        bool room = 2 * c + 4 <= nb; /* 72 bytes from b belong to the row */
        __m512i raw = room ? _mm512_loadu_si512(b) : _mm512_maskz_loadu_epi8(vmath_byte_mask(full ? 36 : 18), b);
        *dx = pair_scales(raw, 9);
        return q4_0_pair(raw);
    }
    const uint8_t *b = w + c * 2 * sizeof(block_q8_0);
    __m512i lo = full ? _mm512_loadu_si512(b) : _mm512_maskz_loadu_epi8(vmath_byte_mask(34), b);
    __m512i hi = !full ? _mm512_setzero_si512()
                 : last ? _mm512_maskz_loadu_epi8(vmath_byte_mask(4), b + 64)
                        : _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(b + 64)));
    *dx = pair_scales(lo, 17);
    return q8_0_pair(lo, hi);
}

/* NR rows against one packed token; the activation loads are shared. */
static inline __attribute__((always_inline)) void dec_rows(enum quant_type wt, const uint8_t *w, size_t wrow,
                                                           int64_t nb, const uint8_t *pk, int NR, int64_t ahead,
                                                           float *out)
{
    float acc[DEC_NR];
    for (int r = 0; r < NR; r++)
        acc[r] = 0;
    int64_t npair = ceil_div(nb, 2);
    for (int64_t c = 0; c < npair; c++) {
        const uint8_t *ch = pk + c * DEC_CHUNK_BYTES;
        __m512i y = _mm512_load_si512(ch), corr = _mm512_load_si512(ch + 64);
        __m512 dy = _mm512_load_ps(ch + 128);
        for (int r = 0; r < NR; r++) {
            /* the same bytes `ahead` rows on: the hardware prefetcher alone
             * leaves decode latency-bound at a third of bandwidth */
            const char *pf = (const char *)(w + (r + ahead) * wrow + c * (wt == QUANT_Q4_0 ? 36 : 68));
            __builtin_prefetch(pf, 0, QUANT_WEIGHT_PREFETCH);
            if (wt == QUANT_Q8_0) /* 68 bytes a pair: every 16th pair starts a line past the one before */
                __builtin_prefetch(pf + 67, 0, QUANT_WEIGHT_PREFETCH);
            __m512 dx;
            __m512i q = dec_load(wt, w + r * wrow, c, nb, &dx);
            __m512i dot = _mm512_dpbusd_epi32(corr, q, y);
            /* the reference's fma chain: block 2c, then block 2c + 1 (a missing last block adds 0 * 0) */
            float d[16];
            _mm512_storeu_ps(d, _mm512_mul_ps(dx, dy));
            __m256i lo = _mm512_castsi512_si256(dot), hi = _mm512_extracti64x4_epi64(dot, 1);
            acc[r] = fmaf((float)vmath_hsum8_epi32(lo), d[0], acc[r]);
            acc[r] = fmaf((float)vmath_hsum8_epi32(hi), d[8], acc[r]);
        }
    }
    for (int r = 0; r < NR; r++)
        out[r] = acc[r];
}


static inline __attribute__((always_inline)) void dec_range(const struct mm *m, enum quant_type wt, int64_t lo,
                                                            int64_t hi)
{
    int64_t nb = m->cols / QB;
    int64_t ahead = DEC_AHEAD_BYTES / (int64_t)m->wrow;
    ahead = ahead < DEC_NR ? DEC_NR : ahead;
    for (int64_t t = 0; t < m->n_tokens; t++) {
        const uint8_t *pk = m->work + (m->xi ? m->xi[t] : t) * m->xrow;
        float *y = m->Y + t * m->rows;
        int64_t r = lo;
        for (; r + DEC_NR <= hi; r += DEC_NR)
            dec_rows(wt, m->W + r * m->wrow, m->wrow, nb, pk, DEC_NR, ahead, y + r);
        for (; r < hi; r++)
            dec_rows(wt, m->W + r * m->wrow, m->wrow, nb, pk, 1, ahead, y + r);
    }
}

/* Rows are handed out in chunks (take_own_chunk) rather than split
 * statically: on a shared machine one thread is often slowed (another
 * process, an interrupt), and with a static split the whole step waits for
 * it. Chunks are large enough (>= 64 rows, about 8 per thread) that each
 * stays a long sequential stream for the prefetcher. */
#define DEC_ROW_BLOCK 64 /* a few tokens: rows in blocks of 64 stay in cache while the tokens pass */

/* Rows [lo, hi); *prev_hi is where this thread's last chunk ended (a
 * continuing stream needs no priming). */
static void dec_chunk(const struct mm *m, int64_t lo, int64_t hi, int64_t *prev_hi)
{
    if (lo != *prev_hi)
        prime_rows(m, lo, hi, DEC_AHEAD_BYTES);
    *prev_hi = hi;
    for (int64_t r0 = lo; r0 < hi; r0 += DEC_ROW_BLOCK) {
        int64_t r1 = r0 + DEC_ROW_BLOCK < hi ? r0 + DEC_ROW_BLOCK : hi;
        if (m->wtype == QUANT_Q4_0)
            dec_range(m, QUANT_Q4_0, r0, r1);
        else
            dec_range(m, QUANT_Q8_0, r0, r1);
    }
}

static void dec_compute(void *vctx, int ith, int nth)
{
    struct mm *m = vctx;
    int64_t chunk = m->rows / ((int64_t)nth * 8);
    chunk = chunk < DEC_ROW_BLOCK ? DEC_ROW_BLOCK : (chunk + DEC_ROW_BLOCK - 1) / DEC_ROW_BLOCK * DEC_ROW_BLOCK;
    int64_t n_chunks = ceil_div(m->rows, chunk), prev_hi = -1;
    for (int64_t ci; (ci = take_own_chunk(&m->own, ith, nth, n_chunks)) >= 0;) {
        int64_t lo = ci * chunk, hi = lo + chunk < m->rows ? lo + chunk : m->rows;
        dec_chunk(m, lo, hi, &prev_hi);
    }
}

/* ---- prefill: Q4_0 / Q8_0 micro-tiles ------------------------------------- */

/* Tokens X[rows[t]] (rows NULL: X[t]) for t < n <= 16 into one packed group. */
static void pre_pack_group(const float *X, const int32_t *rows, int64_t cols, int64_t n, uint8_t *out)
{
    int64_t nb = cols / QB;
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *blk = out + b * PRE_BLOCK_BYTES;
        float *dy = (float *)(blk + 8 * 64);
        memset(blk, 0x80, 8 * 64); /* padding tokens: value 0 */
        memset(dy, 0, 64);
        for (int64_t t = 0; t < n; t++) {
            int8_t q[QB];
            int sum;
            dy[t] = q8_block(X + (rows ? rows[t] : t) * cols + b * QB, q, &sum);
            for (int g = 0; g < 8; g++) {
                uint32_t v;
                memcpy(&v, q + 4 * g, 4);
                v ^= 0x80808080u;
                memcpy(blk + g * 64 + t * 4, &v, 4);
            }
        }
    }
}

static void pre_pack(void *vctx, int ith, int nth)
{
    struct mm *m = vctx;
    int64_t lo, hi, ng = ceil_div(m->n_tokens, MM_TOK_GROUP);
    threads_split(ng, ith, nth, &lo, &hi);
    for (int64_t g = lo; g < hi; g++) {
        int64_t t0 = g * MM_TOK_GROUP;
        int64_t n = m->n_tokens - t0 < MM_TOK_GROUP ? m->n_tokens - t0 : MM_TOK_GROUP;
        pre_pack_group(m->X + t0 * m->cols, NULL, m->cols, n, m->work + g * m->xrow);
    }
}

/* Weight rows unpacked to signed bytes, with per-block scale and the
 * correction -128 * sum(w) for the +128 bias of the activations. */
struct wpanel {
    int8_t *q;     /* [Q8_R][cols] */
    float *d;      /* [Q8_R][nb] */
    int32_t *corr; /* [Q8_R][nb] */
};

static void unpack_rows(const struct mm *m, int64_t r0, int nr, struct wpanel *p)
{
    int64_t nb = m->cols / QB;
    for (int r = 0; r < Q8_R; r++) {
        int8_t *q = p->q + r * m->cols;
        if (r >= nr) { /* padding rows contribute zeros */
            memset(q, 0, (size_t)m->cols);
            memset(p->d + r * nb, 0, (size_t)nb * sizeof(float));
            memset(p->corr + r * nb, 0, (size_t)nb * sizeof(int32_t));
            continue;
        }
        for (int64_t b = 0; b < nb; b++) {
            __m256i v = quant_weight_block_bytes(m->W, m->wtype, m->repacked, m->rows, nb, r0 + r, b, &p->d[r * nb + b]);
            _mm256_storeu_si256((__m256i *)(q + b * QB), v);
            __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), v);
            p->corr[r * nb + b] = -128 * vmath_hsum8_epi32(s);
        }
    }
}

static void store_tile(const struct mm *m, __m512 acc, int64_t r, int64_t t0)
{
    float tmp[MM_TOK_GROUP];
    _mm512_storeu_ps(tmp, acc);
    for (int64_t i = 0; i < MM_TOK_GROUP && t0 + i < m->n_tokens; i++)
        m->Y[(t0 + i) * m->rows + r] = tmp[i];
}

/* Q8_R rows x (16 * TT) tokens over all blocks; TT is 1 or Q8_TT. */
static inline __attribute__((always_inline)) void q8_tile(const struct mm *m, const struct wpanel *p, int64_t r0,
                                                          int nr, int64_t g0, int TT)
{
    const int64_t nb = m->cols / QB;
    __m512 facc[Q8_R][Q8_TT];
    for (int r = 0; r < Q8_R; r++)
        for (int tt = 0; tt < TT; tt++)
            facc[r][tt] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i iacc[Q8_R][Q8_TT];
        const uint8_t *yb[Q8_TT];
        for (int tt = 0; tt < TT; tt++)
            yb[tt] = m->work + (g0 + tt) * m->xrow + b * PRE_BLOCK_BYTES;
        for (int r = 0; r < Q8_R; r++)
            for (int tt = 0; tt < TT; tt++)
                iacc[r][tt] = _mm512_set1_epi32(p->corr[r * nb + b]);
        for (int g = 0; g < 8; g++) {
            __m512i yv[Q8_TT];
            for (int tt = 0; tt < TT; tt++)
                yv[tt] = _mm512_load_si512(yb[tt] + g * 64);
            for (int r = 0; r < Q8_R; r++) {
                int32_t wd;
                memcpy(&wd, p->q + r * m->cols + b * QB + 4 * g, 4);
                __m512i wv = _mm512_set1_epi32(wd);
                for (int tt = 0; tt < TT; tt++)
                    iacc[r][tt] = _mm512_dpbusd_epi32(iacc[r][tt], yv[tt], wv);
            }
        }
        for (int tt = 0; tt < TT; tt++) {
            __m512 dy = _mm512_load_ps(yb[tt] + 8 * 64);
            for (int r = 0; r < Q8_R; r++) {
                /* the reference's fma chain: the group kernels' bits, so a repacked row gives a
                 * token the same logits in a batch of 16 tokens and of 17 */
                __m512 s = _mm512_mul_ps(dy, _mm512_set1_ps(p->d[r * nb + b]));
                facc[r][tt] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[r][tt]), s, facc[r][tt]);
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int tt = 0; tt < TT; tt++)
            store_tile(m, facc[r][tt], r0 + r, (g0 + tt) * MM_TOK_GROUP);
}

/* L2 blocking: a thread unpacks up to PRE_SUPER_PANELS panels of rows, then
 * sweeps them over the tokens one block of groups at a time, so each block
 * of activations is read from L3 once per super-panel, not once per panel.
 * Both budgets are bytes of a ~1 MiB L2. */
#ifndef PRE_SUPER_PANELS
#define PRE_SUPER_PANELS 8
#endif
#define PRE_PANEL_BUDGET (256 * 1024)
#define PRE_TOKEN_BUDGET (384 * 1024)

/* A thread's unpacked weight panels: up to PRE_SUPER_PANELS of Q8_R rows. */
struct pre_panels {
    uint8_t *buf;
    struct wpanel p[PRE_SUPER_PANELS];
    int sp; /* panels per super-panel */
};

static size_t pre_panel_bytes(int64_t cols)
{
    return align_up((size_t)(Q8_R * cols)) + 2 * align_up((size_t)(Q8_R * (cols / QB)) * 4);
}

/* Panels per super-panel for this width: as many as fit PRE_PANEL_BUDGET. */
static int pre_super_panels(int64_t cols)
{
    int sp = (int)(PRE_PANEL_BUDGET / pre_panel_bytes(cols));
    return sp < 1 ? 1 : sp > PRE_SUPER_PANELS ? PRE_SUPER_PANELS : sp;
}

static bool pre_panels_alloc(struct pre_panels *pp, int64_t cols, int sp)
{
    size_t qbytes = align_up((size_t)(Q8_R * cols)), sbytes = align_up((size_t)(Q8_R * (cols / QB)) * 4);
    size_t panel_bytes = pre_panel_bytes(cols);
    pp->sp = sp;
    pp->buf = aligned_alloc(MM_ALIGN, panel_bytes * (size_t)sp);
    if (!pp->buf)
        return false;
    for (int k = 0; k < sp; k++) {
        uint8_t *b = pp->buf + (size_t)k * panel_bytes;
        pp->p[k] = (struct wpanel){(int8_t *)b, (float *)(b + qbytes), (int32_t *)(b + qbytes + sbytes)};
    }
    return true;
}

/* Rows [r_lo, r_hi) (r_lo a multiple of Q8_R, at most sp panels) against all tokens. */
static void pre_rows(const struct mm *m, struct pre_panels *pp, int64_t r_lo, int64_t r_hi)
{
    int64_t ng = ceil_div(m->n_tokens, MM_TOK_GROUP);
    int64_t tb = (int64_t)(PRE_TOKEN_BUDGET / pre_group_bytes(m->cols));
    tb = tb < 1 ? 1 : tb;
    int nr[PRE_SUPER_PANELS];
    int np = (int)ceil_div(r_hi - r_lo, Q8_R);
    for (int k = 0; k < np; k++) {
        int64_t r0 = r_lo + k * Q8_R;
        nr[k] = (int)(r_hi - r0 < Q8_R ? r_hi - r0 : Q8_R);
        unpack_rows(m, r0, nr[k], &pp->p[k]);
    }
    for (int64_t g0 = 0; g0 < ng; g0 += tb) {
        int64_t g1 = g0 + tb < ng ? g0 + tb : ng;
        for (int k = 0; k < np; k++) {
            int64_t r0 = r_lo + k * Q8_R, g = g0;
            for (; g + Q8_TT <= g1; g += Q8_TT)
                q8_tile(m, &pp->p[k], r0, nr[k], g, Q8_TT);
            for (; g < g1; g++)
                q8_tile(m, &pp->p[k], r0, nr[k], g, 1);
        }
    }
}

static void pre_compute(void *vctx, int ith, int nth)
{
    struct mm *m = vctx;
    (void)ith;
    (void)nth;
    struct pre_panels pp;
    int sp = pre_super_panels(m->cols);
    if (!pre_panels_alloc(&pp, m->cols, sp)) {
        atomic_store(&m->failed, 1);
        return;
    }
    int64_t super_rows = (int64_t)sp * Q8_R, n_super = ceil_div(m->rows, super_rows);
    for (int64_t si; (si = take_panel(m, n_super)) >= 0;) {
        int64_t lo = si * super_rows, hi = lo + super_rows < m->rows ? lo + super_rows : m->rows;
        pre_rows(m, &pp, lo, hi);
    }
    free(pp.buf);
}

/* ---- prefill: float weights ----------------------------------------------- */

/* Group g of 16 tokens (X rows rows[t], or t), transposed. */
static void fpre_pack_group(const float *X, const int32_t *rows, int64_t cols, int64_t n_tokens, int64_t g,
                            float *out)
{
    for (int64_t k = 0; k < cols; k++)
        for (int64_t i = 0; i < MM_TOK_GROUP; i++) {
            int64_t t = g * MM_TOK_GROUP + i;
            out[k * MM_TOK_GROUP + i] = t < n_tokens ? X[(rows ? rows[t] : t) * cols + k] : 0.0f;
        }
}

static void fpre_pack(void *vctx, int ith, int nth)
{
    struct mm *m = vctx;
    int64_t lo, hi, ng = ceil_div(m->n_tokens, MM_TOK_GROUP);
    threads_split(ng, ith, nth, &lo, &hi);
    for (int64_t g = lo; g < hi; g++)
        fpre_pack_group(m->X, NULL, m->cols, m->n_tokens, g, (float *)(m->work + g * m->xrow));
}

static inline __attribute__((always_inline)) void float_tile(const struct mm *m, const float *wf, int64_t r0,
                                                             int nr, int64_t g0, int TT)
{
    __m512 acc[FL_R][FL_TT];
    for (int r = 0; r < FL_R; r++)
        for (int tt = 0; tt < TT; tt++)
            acc[r][tt] = _mm512_setzero_ps();
    const float *xt[FL_TT];
    for (int tt = 0; tt < TT; tt++)
        xt[tt] = (const float *)(m->work + (g0 + tt) * m->xrow);
    for (int64_t k = 0; k < m->cols; k++) {
        __m512 xv[FL_TT];
        for (int tt = 0; tt < TT; tt++)
            xv[tt] = _mm512_load_ps(xt[tt] + k * MM_TOK_GROUP);
        for (int r = 0; r < FL_R; r++) {
            __m512 wv = _mm512_set1_ps(wf[r * m->cols + k]);
            for (int tt = 0; tt < TT; tt++)
                acc[r][tt] = _mm512_fmadd_ps(xv[tt], wv, acc[r][tt]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int tt = 0; tt < TT; tt++)
            store_tile(m, acc[r][tt], r0 + r, (g0 + tt) * MM_TOK_GROUP);
}

/* Rows r0 .. r0 + FL_R (fewer at the end) against all token groups; wf holds FL_R x cols floats. */
static void fpre_panel(const struct mm *m, float *wf, int64_t r0, int64_t ng)
{
    int nr = (int)(m->rows - r0 < FL_R ? m->rows - r0 : FL_R);
    for (int r = 0; r < FL_R; r++) {
        if (r < nr)
            m->tr->to_float(m->W + (r0 + r) * m->wrow, wf + r * m->cols, m->cols);
        else
            memset(wf + r * m->cols, 0, (size_t)m->cols * sizeof(float));
    }
    int64_t g = 0;
    for (; g + FL_TT <= ng; g += FL_TT)
        float_tile(m, wf, r0, nr, g, FL_TT);
    for (; g < ng; g++)
        float_tile(m, wf, r0, nr, g, 1);
}

static void fpre_compute(void *vctx, int ith, int nth)
{
    struct mm *m = vctx;
    (void)ith;
    (void)nth;
    int64_t ng = ceil_div(m->n_tokens, MM_TOK_GROUP), n_panels = ceil_div(m->rows, FL_R);
    float *wf = aligned_alloc(MM_ALIGN, align_up((size_t)(FL_R * m->cols) * sizeof(float)));
    if (!wf) {
        atomic_store(&m->failed, 1);
        return;
    }
    for (int64_t pi; (pi = take_panel(m, n_panels)) >= 0;)
        fpre_panel(m, wf, pi * FL_R, ng);
    free(wf);
}
#endif /* QUANT_HAVE_AVX512 */

/* ---- grouped by expert ------------------------------------------------------- */
/* quant_matmul_experts: every expert's product in one parallel region, work
 * items (expert, block of rows) taken from one counter; activations packed
 * once in one region before it. Each expert runs the kernel quant_matmul (or,
 * repacked, quant_matmul_repacked) would pick for its token count, so the
 * results are the same bits. */

#define EX_ROWS 16              /* rows per work item of the decode and generic paths */
#define EX_SPAN_ITEMS 4         /* prefill items per take at most (take_own_span) */
#define EX_SPAN_DECODE 64       /* decode items per take at most: 1024 rows (see SPAN_SHRINK) */
#define EX_FL_PANELS 8          /* float prefill: FL_R-row panels per work item */
#define EX_PACK_INLINE 32768    /* activation elements below which packing stays on the caller */

enum ex_pack { EX_PACK_NONE, EX_PACK_TOKEN, EX_PACK_OWN, EX_PACK_AVX2 };
/* Layout of the shared per-X-row packs: the vec_dot_type row, the decode
 * kernel's, or the group kernels' (repacked experts). */
enum ex_tok { EX_TOK_VEC_DOT, EX_TOK_DEC, EX_TOK_RP };

struct ex_expert {
    int e;
    int64_t t0, n;      /* its grouped rows t0 .. t0 + n */
    enum mm_path path;
    enum ex_pack pack;  /* TOKEN: the shared per-X-row packs; OWN: packed here; AVX2: run after the region */
    uint8_t *own;       /* OWN: its packed activations */
    size_t own_xrow;
    int64_t item0, item_rows, n_items;
};

struct ex_run {
    const struct quant_moe_mm *p;
    const struct quant_traits *tr;
    size_t wrow;
    struct ex_expert *ex;
    int n_ex;
    uint8_t *tokpack;   /* one packed row per X row that a TOKEN expert reads */
    size_t tok_xrow;
    enum ex_tok tok_layout;
    int32_t *tok_rows;  /* the X rows to pack */
    int64_t n_tok_rows;
    int64_t n_items;
    int64_t max_span;        /* items per take at most: EX_SPAN_DECODE unless an expert runs a prefill path */
    atomic_llong next;       /* packing: units taken */
    struct mm_ranges items;  /* compute: take_own_span */
    atomic_int failed;
    atomic_int *yq_done;     /* p->Yq: rows of each 256-row block finished */
};

/* X row of expert x's token t */
static inline int64_t ex_xrow(const struct quant_moe_mm *p, const struct ex_expert *x, int64_t t)
{
    return p->x_rows ? p->x_rows[x->t0 + t] : x->t0 + t;
}

static size_t ex_tok_xrow(const struct quant_traits *tr, enum quant_type wtype, int64_t cols, bool repacked,
                          enum ex_tok *layout)
{
    *layout = EX_TOK_VEC_DOT;
    if (repacked && !quant_kqrp_type(wtype)) { /* repacked k-quants read Q8_K rows */
        *layout = EX_TOK_RP;
        return rp_token_bytes(cols);
    }
#if defined(QUANT_HAVE_AVX512)
    if (is_q8_family(wtype)) {
        *layout = EX_TOK_DEC;
        return align_up(dec_token_bytes(cols));
    }
#endif
    return is_float(wtype) ? 0 : quant_row_size(tr->vec_dot_type, cols);
}

/* Bytes of expert x's own packed activations (0 if it has none). */
static size_t ex_own_bytes(const struct quant_traits *tr, enum quant_type wtype, int64_t cols, enum mm_path path,
                           int64_t n)
{
    switch (path) {
#if defined(QUANT_HAVE_AVX512)
    case MM_Q8_PREFILL:
        return align_up(pre_group_bytes(cols)) * (size_t)ceil_div(n, MM_TOK_GROUP);
    case MM_FLOAT_PREFILL:
        return (size_t)cols * MM_TOK_GROUP * sizeof(float) * (size_t)ceil_div(n, MM_TOK_GROUP);
#endif
    case MM_GENERIC:
        return generic_multi(wtype, n) ? align_up(quant_row_size(tr->vec_dot_type, cols) * (size_t)n) : 0;
    default:
        return 0;
    }
}

size_t quant_matmul_experts_work_size(enum quant_type wtype, int64_t cols, int64_t n_x, int64_t n_grouped)
{
    const struct quant_traits *tr = quant_traits(wtype);
    if (!tr || cols <= 0 || n_x <= 0 || n_grouped <= 0 || quant_row_size(wtype, cols) == 0)
        return 0;
    enum ex_tok layout;
    size_t tok = ex_tok_xrow(tr, wtype, cols, false, &layout);
    if (is_repackable(wtype)) { /* repacked experts pack the X rows for the group kernels */
        size_t rp = ex_tok_xrow(tr, wtype, cols, true, &layout);
        tok = rp > tok ? rp : tok;
    }
    size_t need = align_up(tok * (size_t)n_x) + MM_ALIGN;
    /* own packs: an expert of n >= MM_PREFILL_MIN rows packs ceil(n / 16) <= n / 8 groups;
     * a k-quant expert n rows; each rounded up to MM_ALIGN, and there are at most n_grouped experts */
    size_t per_row = 0;
#if defined(QUANT_HAVE_AVX512)
    if (is_q8_family(wtype))
        per_row = align_up(pre_group_bytes(cols)) / MM_PREFILL_MIN + 1;
    else if (is_float(wtype))
        per_row = (size_t)cols * MM_TOK_GROUP * sizeof(float) / MM_PREFILL_MIN + 1;
#endif
    if (generic_multi(wtype, 2))
        per_row = quant_row_size(tr->vec_dot_type, cols);
    need += per_row * (size_t)n_grouped + (size_t)n_grouped * MM_ALIGN;
#if defined(QUANT_HAVE_AVX2) && !defined(QUANT_HAVE_AVX512)
    if (is_q8_family(wtype)) /* experts run one at a time through the AVX2 tiles, on gathered rows */
        need += quant_avx2_prefill_work(cols, n_grouped) + (size_t)n_grouped * (size_t)cols * sizeof(float) +
                MM_ALIGN;
#endif
    return need;
}

/* Pack unit u: X rows of the shared packs first, then the experts with their own. */
static void ex_pack_unit(struct ex_run *r, int64_t u)
{
    const struct quant_moe_mm *p = r->p;
    int64_t cols = p->cols;
    if (u < r->n_tok_rows) {
        int64_t xr = r->tok_rows[u];
        uint8_t *out = r->tokpack + xr * r->tok_xrow;
        switch (r->tok_layout) {
        case EX_TOK_RP:
            quant_rp_pack_token(p->wtype, p->X + xr * cols, cols, (struct quant_rp_act *)(void *)out);
            return;
#if defined(QUANT_HAVE_AVX512)
        case EX_TOK_DEC:
            dec_pack_token(p->X + xr * cols, cols, p->wtype == QUANT_Q4_0 ? 3 : 7, out);
            return;
#endif
        default:
            quant_act_quantizer(p->wtype)(p->X + xr * cols, out, cols);
            return;
        }
    }
    u -= r->n_tok_rows;
    for (int i = 0; i < r->n_ex; i++) {
        const struct ex_expert *x = &r->ex[i];
        if (x->pack != EX_PACK_OWN || u-- > 0)
            continue;
#if defined(QUANT_HAVE_AVX512)
        const int32_t *idx = p->x_rows ? p->x_rows + x->t0 : NULL;
        const float *X = p->x_rows ? p->X : p->X + x->t0 * cols;
#endif
        switch (x->path) {
#if defined(QUANT_HAVE_AVX512)
        case MM_Q8_PREFILL:
            for (int64_t g = 0; g < ceil_div(x->n, MM_TOK_GROUP); g++) {
                int64_t t0 = g * MM_TOK_GROUP, n = x->n - t0 < MM_TOK_GROUP ? x->n - t0 : MM_TOK_GROUP;
                pre_pack_group(idx ? X : X + t0 * cols, idx ? idx + t0 : NULL, cols, n, x->own + g * x->own_xrow);
            }
            break;
        case MM_FLOAT_PREFILL:
            for (int64_t g = 0; g < ceil_div(x->n, MM_TOK_GROUP); g++)
                fpre_pack_group(X, idx, cols, x->n, g, (float *)(x->own + g * x->own_xrow));
            break;
#endif
        default: {
            quant_from_float_fn quantize = quant_act_quantizer(p->wtype);
            for (int64_t t = 0; t < x->n; t++)
                quantize(p->X + ex_xrow(p, x, t) * cols, x->own + t * x->own_xrow, cols);
            break;
        }
        }
        return;
    }
}

static void ex_pack(void *vctx, int ith, int nth)
{
    struct ex_run *r = vctx;
    (void)ith;
    (void)nth;
    int64_t n_units = r->n_tok_rows;
    for (int i = 0; i < r->n_ex; i++)
        n_units += r->ex[i].pack == EX_PACK_OWN;
    for (int64_t u; (u = atomic_fetch_add_explicit(&r->next, 1, memory_order_relaxed)) < n_units;)
        ex_pack_unit(r, u);
}

/* The struct mm of expert x's matrix (0: W, 1: W2). */
static struct mm ex_mm(const struct ex_run *r, const struct ex_expert *x, int mat)
{
    const struct quant_moe_mm *p = r->p;
    const uint8_t *W = (const uint8_t *)(mat ? p->W2 : p->W) + (size_t)x->e * p->stride;
    struct mm m = {
        .tr = r->tr, .wtype = p->wtype, .path = x->path, .W = W, .wrow = r->wrow, .rows = p->rows,
        .cols = p->cols, .n_tokens = x->n, .Y = (mat ? p->Y2 : p->Y) + x->t0 * p->rows, .repacked = p->repacked,
    };
    if (x->path == MM_FLOAT_DECODE) { /* reads X as is */
        m.X = p->x_rows ? p->X : p->X + x->t0 * p->cols;
        m.xi = p->x_rows ? p->x_rows + x->t0 : NULL;
    } else if (x->pack == EX_PACK_TOKEN) {
        m.work = p->x_rows ? r->tokpack : r->tokpack + x->t0 * r->tok_xrow;
        m.xi = p->x_rows ? p->x_rows + x->t0 : NULL;
        m.xrow = r->tok_xrow;
    } else {
        m.work = x->own;
        m.xrow = x->own_xrow;
    }
    return m;
}

/* Per-thread scratch of the prefill tiles, allocated on first use. */
struct ex_scratch {
#if defined(QUANT_HAVE_AVX512)
    struct pre_panels pp;
#endif
    float *wf;
    uint8_t *kq;
};

static bool ex_rows(struct ex_run *r, const struct ex_expert *x, int mat, int64_t r0, int64_t r1,
                    struct ex_scratch *sc)
{
    struct mm m = ex_mm(r, x, mat);
    switch (x->path) {
    case MM_REPACKED: {
        struct quant_rp_job j = rp_job(&m);
        quant_rp_rows(&j, r0 / QUANT_RP_ROWS, r1 / QUANT_RP_ROWS);
        if (r1 == m.rows && m.rows % QUANT_RP_ROWS) /* the row-major tail, with the last item */
            quant_rp_tail_rows(&j, m.rows);
        return true;
    }
#if defined(QUANT_HAVE_AVX512)
    case MM_Q8_DECODE: {
        int64_t prev_hi = -1;
        dec_chunk(&m, r0, r1, &prev_hi);
        return true;
    }
    case MM_Q8_PREFILL:
        if (!sc->pp.buf && !pre_panels_alloc(&sc->pp, m.cols, pre_super_panels(m.cols)))
            return false;
        pre_rows(&m, &sc->pp, r0, r1);
        return true;
    case MM_FLOAT_PREFILL:
        if (!sc->wf && !(sc->wf = aligned_alloc(MM_ALIGN, align_up((size_t)(FL_R * m.cols) * sizeof(float)))))
            return false;
        for (int64_t rr = r0; rr < r1; rr += FL_R)
            fpre_panel(&m, sc->wf, rr, ceil_div(m.n_tokens, MM_TOK_GROUP));
        return true;
#endif
    case MM_KQ_PREFILL:
        if (!sc->kq && !(sc->kq = kq_scratch(m.cols)))
            return false;
        kq_rows(&m, r0, r1, sc->kq);
        return true;
    case MM_KQ_REPACKED: {
        struct quant_kq_gemm g = kqrp_job(&m);
        quant_kqrp_rows(&g, r0 / QUANT_RP_ROWS, r1 / QUANT_RP_ROWS);
        if (r1 == m.rows && m.rows % QUANT_RP_ROWS) /* the row-major tail, with the last item */
            quant_kqrp_tail_rows(&g, m.rows);
        return true;
    }
    default:
        generic_chunks(&m, r0 / MM_ROW_CHUNK, ceil_div(r1, MM_ROW_CHUNK));
        return true;
    }
}

/* The expert whose items include it (experts' items are in increasing order). */
static const struct ex_expert *ex_of_item(const struct ex_run *r, int64_t it)
{
    int lo = 0, hi = r->n_ex - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (r->ex[mid].item0 <= it)
            lo = mid;
        else
            hi = mid - 1;
    }
    return &r->ex[lo];
}

/* After rows r0 .. r1 of expert x's products: its biases, then the gated
 * activation (item rows are multiples of 16, so the activation's vector
 * lanes fall where one pass over the whole rows puts them). */
static void ex_finish_rows(const struct quant_moe_mm *p, const struct ex_expert *x, int64_t r0, int64_t r1)
{
    for (int64_t t = 0; t < x->n; t++) {
        float *y = p->Y + (x->t0 + t) * p->rows, *y2 = p->Y2 ? p->Y2 + (x->t0 + t) * p->rows : NULL;
        for (int64_t r = r0; r < r1 && p->B; r++)
            y[r] += p->B[(int64_t)x->e * p->rows + r];
        for (int64_t r = r0; r < r1 && y2 && p->B2; r++)
            y2[r] += p->B2[(int64_t)x->e * p->rows + r];
        if (p->swiglu && p->glu == QUANT_GLU_OAI)
            quant_swiglu_oai(y + r0, y2 + r0, r1 - r0);
        else if (p->swiglu && p->glu == QUANT_GLU_GELU)
            quant_geglu(y + r0, y2 + r0, r1 - r0);
        else if (p->swiglu)
            quant_swiglu(y + r0, y2 + r0, r1 - r0);
    }
}

/* p->Yq: count rows r0 .. r1 finished; the thread that finishes a block's
 * last rows packs it (acq_rel: it sees the other threads' rows). */
static void ex_pack_finished(const struct ex_run *r, int64_t r0, int64_t r1)
{
    const struct quant_moe_mm *p = r->p;
    size_t bb = quant_row_size(quant_traits(p->yq_type)->vec_dot_type, QK_K);
    for (int64_t lo = r0, hi; lo < r1; lo = hi) {
        int64_t b = lo / QK_K;
        hi = (b + 1) * QK_K < r1 ? (b + 1) * QK_K : r1;
        if (atomic_fetch_add_explicit(&r->yq_done[b], (int)(hi - lo), memory_order_acq_rel) + (hi - lo) == QK_K)
            quant_act_quantizer(p->yq_type)(p->Y + b * QK_K, (uint8_t *)p->Yq + (size_t)b * bb, QK_K);
    }
}

/* The prefill tiles' per-thread scratch holds one work item's rows. */
static bool ex_is_prefill(enum mm_path path)
{
    return path == MM_Q8_PREFILL || path == MM_FLOAT_PREFILL || path == MM_KQ_PREFILL || path == MM_Q8_PREFILL_AVX2;
}

static void ex_compute(void *vctx, int ith, int nth)
{
    struct ex_run *r = vctx;
    const struct quant_moe_mm *p = r->p;
    struct ex_scratch sc = {0};
    /* each thread's own items first: its experts' rows are one stream, which
     * the kernels' prefetches follow from one item into the next */
    for (int64_t u0, u1; !atomic_load_explicit(&r->failed, memory_order_relaxed) &&
                         take_own_span(&r->items, ith, nth, r->n_items, r->max_span, &u0, &u1);) {
        for (int64_t it = u0, end; it < u1; it = end) { /* the span's items, an expert's at a time */
            const struct ex_expert *x = ex_of_item(r, it);
            end = x->item0 + x->n_items < u1 ? x->item0 + x->n_items : u1;
            end = ex_is_prefill(x->path) ? it + 1 : end;
            int64_t r0 = (it - x->item0) * x->item_rows, r1 = (end - x->item0) * x->item_rows;
            r1 = r1 < p->rows ? r1 : p->rows;
            if (!ex_rows(r, x, 0, r0, r1, &sc) || (p->W2 && !ex_rows(r, x, 1, r0, r1, &sc))) {
                atomic_store(&r->failed, 1);
                break;
            }
            ex_finish_rows(p, x, r0, r1);
            if (p->Yq)
                ex_pack_finished(r, r0, r1);
        }
    }
#if defined(QUANT_HAVE_AVX512)
    free(sc.pp.buf);
#endif
    free(sc.wf);
    free(sc.kq);
}

/* Rows per work item of an expert on this path: multiples of 16, so the fused
 * SwiGLU splits rows where the vector loop does. */
static int64_t ex_item_rows(enum mm_path path, int64_t cols)
{
    switch (path) {
#if defined(QUANT_HAVE_AVX512)
    case MM_Q8_PREFILL: {
        int sp = pre_super_panels(cols);
        sp = sp > 1 ? sp & ~1 : sp;
        return (int64_t)sp * Q8_R < 16 ? 16 : (int64_t)sp * Q8_R;
    }
    case MM_FLOAT_PREFILL:
        return EX_FL_PANELS * FL_R;
#endif
    default:
        (void)cols;
        return EX_ROWS;
    }
}

#if defined(QUANT_HAVE_AVX2) && !defined(QUANT_HAVE_AVX512)
/* AVX2-only builds: an expert for the prefill tiles runs on its own, on gathered rows. */
static ks_status ex_avx2_expert(threads_pool *pool, const struct ex_run *r, const struct ex_expert *x,
                                uint8_t *work)
{
    const struct quant_moe_mm *p = r->p;
    float *xg = (float *)work;
    uint8_t *w2 = work + align_up((size_t)x->n * (size_t)p->cols * sizeof(float));
    for (int64_t t = 0; t < x->n; t++)
        memcpy(xg + t * p->cols, p->X + ex_xrow(p, x, t) * p->cols, (size_t)p->cols * sizeof(float));
    for (int mat = 0; mat < (p->W2 ? 2 : 1); mat++) {
        const uint8_t *W = (const uint8_t *)(mat ? p->W2 : p->W) + (size_t)x->e * p->stride;
        ks_status st = quant_avx2_prefill(pool, W, p->wtype, p->repacked, p->rows, p->cols, xg, x->n,
                                          (mat ? p->Y2 : p->Y) + x->t0 * p->rows, w2);
        if (st)
            return st;
    }
    ex_finish_rows(p, x, 0, p->rows);
    return KS_OK;
}
#endif

ks_status quant_matmul_experts(threads_pool *pool, const struct quant_moe_mm *p, void *work, size_t work_size)
{
    const struct quant_traits *tr = quant_traits(p->wtype);
    if (!tr || !tr->vec_dot)
        return ks_fail(KS_ERR_UNSUPPORTED, "matmul: weight type %s has no kernels", quant_type_name(p->wtype));
    size_t wrow = quant_row_size(p->wtype, p->cols);
    int64_t n_grouped = p->n_expert > 0 ? p->start[p->n_expert] : 0;
    if (wrow == 0 || p->rows <= 0 || p->n_expert <= 0 || p->n_x <= 0 || n_grouped <= 0 || p->cols > INT32_MAX ||
        p->stride < wrow * (size_t)p->rows || (p->swiglu && !p->W2) || (p->B2 && !p->W2) ||
        (p->glu != QUANT_GLU_SILU && ((p->glu != QUANT_GLU_OAI && p->glu != QUANT_GLU_GELU) || !p->swiglu)) || (!p->x_rows && p->n_x != n_grouped))
        return ks_fail(KS_ERR_INVALID_ARG, "matmul_experts: bad shape rows=%lld cols=%lld experts=%d rows=%lld for %s",
                       (long long)p->rows, (long long)p->cols, p->n_expert, (long long)n_grouped, tr->name);
    if (p->Yq && (!p->swiglu || p->n_expert != 1 || n_grouped != 1 || p->rows % QK_K ||
                  !quant_matmul_takes_packed(p->yq_type, false, p->rows)))
        return ks_fail(KS_ERR_INVALID_ARG, "matmul_experts: packing the output for %s needs one row of one expert's "
                       "SwiGLU, %lld rows a multiple of %d", quant_type_name(p->yq_type), (long long)p->rows, QK_K);
    if (p->repacked && !quant_repack_fits(p->wtype, p->rows, p->cols))
        return ks_fail(KS_ERR_INVALID_ARG,
                       "matmul_experts: repacked %s experts of %lld x %lld cannot exist (groups of %d rows)", tr->name,
                       (long long)p->rows, (long long)p->cols, QUANT_RP_ROWS);
    if (!p->W || !p->X || !p->Y || (p->W2 && !p->Y2) || !work)
        return ks_fail(KS_ERR_INVALID_ARG, "matmul_experts: NULL buffer");
    size_t need = quant_matmul_experts_work_size(p->wtype, p->cols, p->n_x, n_grouped);
    if (work_size < need)
        return ks_fail(KS_ERR_INVALID_ARG, "matmul_experts: work buffer of %zu bytes, need %zu", work_size, need);

    struct ex_run r = {.p = p, .tr = tr, .wrow = wrow, .max_span = EX_SPAN_DECODE};
    r.ex = malloc(sizeof *r.ex * (size_t)(n_grouped < p->n_expert ? n_grouped : p->n_expert));
    r.tok_rows = malloc(sizeof *r.tok_rows * (size_t)p->n_x);
    uint8_t *need_row = calloc((size_t)p->n_x, 1);
    r.yq_done = p->Yq ? calloc((size_t)(p->rows / QK_K), sizeof *r.yq_done) : NULL;
    if (!r.ex || !r.tok_rows || !need_row || (p->Yq && !r.yq_done)) {
        free(r.ex), free(r.tok_rows), free(need_row), free(r.yq_done);
        return ks_fail(KS_ERR_NOMEM, "matmul_experts: out of memory for %lld rows", (long long)n_grouped);
    }
    uint8_t *base = (uint8_t *)(((uintptr_t)work + MM_ALIGN - 1) & ~(uintptr_t)(MM_ALIGN - 1));
    r.tok_xrow = ex_tok_xrow(tr, p->wtype, p->cols, p->repacked, &r.tok_layout);
    r.tokpack = base;
    uint8_t *own = base + align_up(r.tok_xrow * (size_t)p->n_x);
    int64_t pack_elems = 0;
    for (int e = 0; e < p->n_expert; e++) {
        int64_t n = p->start[e + 1] - p->start[e];
        if (n <= 0)
            continue;
        struct ex_expert *x = &r.ex[r.n_ex++];
        enum mm_path path = p->repacked ? choose_repacked_path(p->wtype, n) : choose_path(p->wtype, n);
        *x = (struct ex_expert){.e = e, .t0 = p->start[e], .n = n, .path = path};
        size_t own_bytes = ex_own_bytes(tr, p->wtype, p->cols, x->path, n);
        if (x->path == MM_FLOAT_DECODE) {
            x->pack = EX_PACK_NONE;
        } else if (x->path == MM_Q8_PREFILL_AVX2) {
            x->pack = EX_PACK_AVX2;
        } else if (own_bytes) {
            x->pack = EX_PACK_OWN;
            x->own = own;
            x->own_xrow = x->path == MM_GENERIC ? quant_row_size(tr->vec_dot_type, p->cols)
                                                : own_bytes / (size_t)ceil_div(n, MM_TOK_GROUP);
            own += align_up(own_bytes);
            pack_elems += n * p->cols;
        } else {
            x->pack = EX_PACK_TOKEN;
            for (int64_t t = 0; t < n; t++)
                need_row[ex_xrow(p, x, t)] = 1;
        }
        x->item_rows = ex_item_rows(x->path, p->cols);
        x->n_items = x->pack == EX_PACK_AVX2 ? 0 : ceil_div(p->rows, x->item_rows);
        x->item0 = r.n_items;
        r.n_items += x->n_items;
        if (ex_is_prefill(x->path))
            r.max_span = EX_SPAN_ITEMS;
    }
    for (int64_t i = 0; i < p->n_x; i++)
        if (need_row[i])
            r.tok_rows[r.n_tok_rows++] = (int32_t)i;
    free(need_row);
    pack_elems += r.n_tok_rows * p->cols;
    pool = mm_pool(pool, n_grouped * p->rows * p->cols * (p->W2 ? 2 : 1));
    /* quantize each activation row once; a decode step's few rows are not worth a region */
    threads_run(pack_elems <= EX_PACK_INLINE ? NULL : pool, ex_pack, &r);
    if (r.n_items > 0)
        threads_run(pool, ex_compute, &r);
    ks_status st = KS_OK;
    if (atomic_load(&r.failed))
        st = ks_fail(KS_ERR_NOMEM, "matmul_experts: out of memory for a %lld-column weight panel", (long long)p->cols);
#if defined(QUANT_HAVE_AVX2) && !defined(QUANT_HAVE_AVX512)
    for (int i = 0; i < r.n_ex && !st; i++)
        if (r.ex[i].pack == EX_PACK_AVX2)
            st = ex_avx2_expert(pool, &r, &r.ex[i], own);
#endif
    free(r.ex), free(r.tok_rows), free(r.yq_done);
    return st;
}

/* ---- repacked weights: the group kernels ---------------------------------- */

static void rp_pack(void *vctx, int ith, int nth)
{
    struct mm *m = vctx;
    int64_t lo, hi;
    threads_split(m->n_tokens, ith, nth, &lo, &hi);
    for (int64_t t = lo; t < hi; t++)
        quant_rp_pack_token(m->wtype, m->X + t * m->cols, m->cols, (struct quant_rp_act *)(m->work + t * m->xrow));
}

/* Groups are handed out in spans (take_own_span), as dec_compute's rows are
 * in chunks, and for the same reason. A thread's own range is one stream:
 * on qwen3-0.6b's layer shapes that beat one shared counter (chunks
 * alternating between threads) by 4-6%, 25 -> 26.3 GB/s (bench_matmul q4_0,
 * 2 threads, AVX-512). The row-major tail rows are one more unit, the last. */
static void groups_compute(struct mm *m, int ith, int nth, void (*groups)(const struct mm *m, int64_t g0, int64_t g1),
                           void (*tail)(const struct mm *m))
{
    int64_t n_groups = m->rows / QUANT_RP_ROWS;
    int64_t chunk = n_groups / ((int64_t)nth * 4); /* a quarter of a range: few takes (take_own_span) */
    chunk = chunk < RP_MIN_CHUNK_ROWS / QUANT_RP_ROWS ? RP_MIN_CHUNK_ROWS / QUANT_RP_ROWS : chunk;
    bool has_tail = m->rows % QUANT_RP_ROWS != 0;
    /* unit n_groups is the row-major tail */
    for (int64_t g0, g1; take_own_span(&m->own, ith, nth, n_groups + has_tail, chunk, &g0, &g1);) {
        if (g0 < n_groups)
            groups(m, g0, g1 < n_groups ? g1 : n_groups);
        if (g1 > n_groups)
            tail(m);
    }
}

static void rp_groups(const struct mm *m, int64_t g0, int64_t g1)
{
    struct quant_rp_job j = rp_job(m);
    quant_rp_rows(&j, g0, g1);
}

static void rp_tail(const struct mm *m)
{
    struct quant_rp_job j = rp_job(m);
    quant_rp_tail_rows(&j, m->rows);
}

static void rp_compute(void *vctx, int ith, int nth) { groups_compute(vctx, ith, nth, rp_groups, rp_tail); }

/* ---- repacked k-quants: their group kernels ----------------------------------- */

static void kqrp_groups(const struct mm *m, int64_t g0, int64_t g1)
{
    struct quant_kq_gemm g = kqrp_job(m);
    quant_kqrp_rows(&g, g0, g1);
}

static void kqrp_tail(const struct mm *m)
{
    struct quant_kq_gemm g = kqrp_job(m);
    quant_kqrp_tail_rows(&g, m->rows);
}

static void kqrp_compute(void *vctx, int ith, int nth) { groups_compute(vctx, ith, nth, kqrp_groups, kqrp_tail); }

/* ---- entry points ---------------------------------------------------------- */

static ks_status matmul_run(threads_pool *pool, const void *W, enum quant_type wtype, bool repacked, int64_t rows,
                            int64_t cols, const float *X, int64_t n_tokens, float *Y, void *work, size_t work_size);

ks_status quant_matmul(threads_pool *pool, const void *W, enum quant_type wtype, int64_t rows, int64_t cols,
                       const float *X, int64_t n_tokens, float *Y, void *work, size_t work_size)
{
    return matmul_run(pool, W, wtype, false, rows, cols, X, n_tokens, Y, work, work_size);
}

ks_status quant_matmul_repacked(threads_pool *pool, const void *W, enum quant_type wtype, int64_t rows, int64_t cols,
                                const float *X, int64_t n_tokens, float *Y, void *work, size_t work_size)
{
    return matmul_run(pool, W, wtype, true, rows, cols, X, n_tokens, Y, work, work_size);
}

/* m for one matrix, checked, with its path chosen. */
static ks_status mm_init(struct mm *m, const void *W, enum quant_type wtype, bool repacked, int64_t rows, int64_t cols,
                         const float *X, int64_t n_tokens, float *Y, void *work, size_t work_size)
{
    const struct quant_traits *tr = quant_traits(wtype);
    if (!tr || !tr->vec_dot)
        return ks_fail(KS_ERR_UNSUPPORTED, "matmul: weight type %s has no kernels", quant_type_name(wtype));
    size_t wrow = quant_row_size(wtype, cols);
    if (wrow == 0 || rows <= 0 || n_tokens <= 0 || cols > INT32_MAX)
        return ks_fail(KS_ERR_INVALID_ARG, "matmul: bad shape rows=%lld cols=%lld tokens=%lld for %s",
                       (long long)rows, (long long)cols, (long long)n_tokens, tr->name);
    if (repacked && !quant_repack_fits(wtype, rows, cols))
        return ks_fail(KS_ERR_INVALID_ARG, "matmul: a repacked %s matrix of %lld x %lld cannot exist (Q4_0, Q8_0, "
                       "IQ4_NL, MXFP4, Q5_0, Q5_1 or Q2_K..Q6_K, whole blocks, at least %d rows)",
                       quant_type_name(wtype), (long long)rows, (long long)cols, QUANT_RP_ROWS);
    if (!W || !X || !Y || !work)
        return ks_fail(KS_ERR_INVALID_ARG, "matmul: NULL buffer");
    size_t need = quant_matmul_work_size(wtype, cols, n_tokens);
    if (work_size < need)
        return ks_fail(KS_ERR_INVALID_ARG, "matmul: work buffer of %zu bytes, need %zu", work_size, need);
    *m = (struct mm){
        .tr = tr, .wtype = wtype, .W = W, .wrow = wrow, .rows = rows, .cols = cols, .n_tokens = n_tokens,
        .X = X, .Y = Y, .work = (uint8_t *)(((uintptr_t)work + MM_ALIGN - 1) & ~(uintptr_t)(MM_ALIGN - 1)),
        .repacked = repacked,
        .path = repacked ? choose_repacked_path(wtype, n_tokens) : choose_path(wtype, n_tokens),
    };
    return KS_OK;
}

/* The compute region of a decode path, whose packed activations any matrix
 * of the same type and width reads; NULL for the prefill paths. */
static threads_fn decode_compute(enum mm_path path)
{
    switch (path) {
    case MM_REPACKED:
        return rp_compute;
    case MM_KQ_REPACKED:
        return kqrp_compute;
#if defined(QUANT_HAVE_AVX512)
    case MM_Q8_DECODE:
        return dec_compute;
#endif
    case MM_FLOAT_DECODE:
    case MM_GENERIC:
        return generic_compute;
    default:
        return NULL;
    }
}

/* A decode path's packed activations; a region costs more than packing a
 * few tokens, so up to MM_PACK_INLINE values (as the experts' EX_PACK_INLINE)
 * stay on the caller: a verification pass of 9 tokens of llama-1b's 2048
 * columns, or any batch of a tiny model. */
#define MM_PACK_INLINE 32768
static void decode_pack(threads_pool *pool, struct mm *m)
{
    threads_pool *packers = m->n_tokens * m->cols <= MM_PACK_INLINE ? NULL : pool;
    switch (m->path) {
    case MM_REPACKED:
        m->xrow = rp_token_bytes(m->cols);
        threads_run(packers, rp_pack, m);
        break;
#if defined(QUANT_HAVE_AVX512)
    case MM_Q8_DECODE:
        m->xrow = align_up(dec_token_bytes(m->cols));
        m->corr_shift = m->wtype == QUANT_Q4_0 ? 3 : 7;
        threads_run(packers, dec_pack, m);
        break;
#endif
    case MM_FLOAT_DECODE: /* reads X as is */
        break;
    default:
        m->xrow = quant_row_size(m->tr->vec_dot_type, m->cols);
        threads_run(packers, generic_quantize, m);
        break;
    }
}

static ks_status mm_failed(const struct mm *m)
{
    if (atomic_load(&m->failed))
        return ks_fail(KS_ERR_NOMEM, "matmul: out of memory for a %lld-column weight panel", (long long)m->cols);
    return KS_OK;
}

static ks_status mm_run(threads_pool *pool, struct mm *m)
{
    pool = mm_pool(pool, m->rows * m->cols * m->n_tokens);
    threads_fn compute = decode_compute(m->path);
    if (compute) {
        decode_pack(pool, m);
        threads_run(pool, compute, m);
        return mm_failed(m);
    }
    switch (m->path) {
#if defined(QUANT_HAVE_AVX512)
    case MM_Q8_PREFILL:
        m->xrow = align_up(pre_group_bytes(m->cols));
        threads_run(pool, pre_pack, m);
        threads_run(pool, pre_compute, m);
        break;
    case MM_FLOAT_PREFILL:
        m->xrow = (size_t)m->cols * MM_TOK_GROUP * sizeof(float);
        threads_run(pool, fpre_pack, m);
        threads_run(pool, fpre_compute, m);
        break;
#endif
    case MM_KQ_PREFILL:
        m->xrow = quant_row_size(QUANT_Q8_K, m->cols);
        threads_run(pool, generic_quantize, m);
        threads_run(pool, kq_compute, m);
        break;
#if defined(QUANT_HAVE_AVX2) && !defined(QUANT_HAVE_AVX512)
    case MM_Q8_PREFILL_AVX2:
        return quant_avx2_prefill(pool, m->W, m->wtype, m->repacked, m->rows, m->cols, m->X, m->n_tokens, m->Y,
                                  m->work);
#endif
    default:
        break;
    }
    return mm_failed(m);
}

static ks_status matmul_run(threads_pool *pool, const void *W, enum quant_type wtype, bool repacked, int64_t rows,
                            int64_t cols, const float *X, int64_t n_tokens, float *Y, void *work, size_t work_size)
{
    struct mm m;
    ks_status st = mm_init(&m, W, wtype, repacked, rows, cols, X, n_tokens, Y, work, work_size);
    return st ? st : mm_run(pool, &m);
}

bool quant_matmul_takes_packed(enum quant_type wtype, bool repacked, int64_t cols)
{
    const struct quant_traits *tr = quant_traits(wtype);
    if (!tr || !tr->vec_dot || tr->vec_dot_type != QUANT_Q8_K || cols <= 0 || cols % QK_K)
        return false;
    enum mm_path path = repacked ? choose_repacked_path(wtype, 1) : choose_path(wtype, 1);
    return path == MM_KQ_REPACKED || path == MM_GENERIC;
}

size_t quant_matmul_packed_bytes(enum quant_type wtype, int64_t cols)
{
    const struct quant_traits *tr = quant_traits(wtype);
    return tr && tr->is_quantized ? quant_row_size(tr->vec_dot_type, cols) : 0;
}

ks_status quant_matmul_packed(threads_pool *pool, const void *W, enum quant_type wtype, bool repacked, int64_t rows,
                              int64_t cols, const void *Xq, float *Y)
{
    if (!quant_matmul_takes_packed(wtype, repacked, cols))
        return ks_fail(KS_ERR_INVALID_ARG, "matmul_packed: a %s%s matrix of %lld columns does not read Q8_K rows",
                       repacked ? "repacked " : "", quant_type_name(wtype), (long long)cols);
    struct mm m; /* its work is Xq itself: no scratch */
    ks_status st = mm_init(&m, W, wtype, repacked, rows, cols, (const float *)Xq, 1, Y, (void *)(uintptr_t)Xq,
                           SIZE_MAX);
    if (st)
        return st;
    m.work = (uint8_t *)(uintptr_t)Xq;
    m.xrow = quant_matmul_packed_bytes(wtype, cols);
    threads_run(mm_pool(pool, rows * cols), decode_compute(m.path), &m);
    return mm_failed(&m);
}

/* ---- several matrices on one input ------------------------------------------- */

struct mm_set {
    struct mm *m;
    int n;
};

static void set_compute(void *ctx, int ith, int nth)
{
    struct mm_set *s = ctx;
    for (int i = 0; i < s->n; i++)
        decode_compute(s->m[i].path)(&s->m[i], ith, nth);
}

/* The first output of outs[0 .. i] with outs[i]'s type: the one whose
 * packed activations it reads. */
static int set_leader(const struct quant_mm_out *outs, int i)
{
    int j = 0;
    while (outs[j].type != outs[i].type)
        j++;
    return j;
}

size_t quant_matmul_set_work_size(const struct quant_mm_out *outs, int n, int64_t cols, int64_t n_tokens)
{
    size_t need = 0;
    for (int i = 0; i < n && i < QUANT_MM_SET_MAX; i++)
        if (set_leader(outs, i) == i) {
            size_t w = quant_matmul_work_size(outs[i].type, cols, n_tokens);
            if (w == 0)
                return 0;
            need += align_up(w);
        }
    return need;
}

/* One by one, each with the whole work buffer: a prefill's matrices each
 * pack their activations their own way. */
static ks_status set_one_by_one(threads_pool *pool, int64_t cols, const struct quant_mm_out *outs, int n,
                                const float *X, int64_t n_tokens, void *work, size_t work_size)
{
    for (int i = 0; i < n; i++) {
        ks_status st = matmul_run(pool, outs[i].W, outs[i].type, outs[i].repacked, outs[i].rows, cols, X, n_tokens,
                                  outs[i].Y, work, work_size);
        if (st)
            return st;
    }
    return KS_OK;
}

ks_status quant_matmul_set(threads_pool *pool, int64_t cols, const struct quant_mm_out *outs, int n, const float *X,
                           int64_t n_tokens, void *work, size_t work_size)
{
    if (n < 1 || n > QUANT_MM_SET_MAX || !outs)
        return ks_fail(KS_ERR_INVALID_ARG, "matmul_set: %d matrices, not 1 to %d", n, QUANT_MM_SET_MAX);
    /* each type's packed activations in its own part of work, as quant_matmul_set_work_size counts them */
    struct mm m[QUANT_MM_SET_MAX];
    int lead[QUANT_MM_SET_MAX];
    size_t at[QUANT_MM_SET_MAX], need = 0;
    for (int i = 0; i < n; i++) {
        lead[i] = set_leader(outs, i);
        if (lead[i] != i)
            continue;
        size_t w = quant_matmul_work_size(outs[i].type, cols, n_tokens);
        if (w == 0)
            return ks_fail(KS_ERR_INVALID_ARG, "matmul_set: matrix %d: %s weights %lld columns wide (%lld tokens) "
                           "have no kernel", i, quant_type_name(outs[i].type), (long long)cols, (long long)n_tokens);
        at[i] = need;
        need += align_up(w);
    }
    if (work_size < need)
        return ks_fail(KS_ERR_INVALID_ARG, "matmul_set: work buffer of %zu bytes, need %zu for %lld columns", work_size,
                       need, (long long)cols);
    bool together = true;
    for (int i = 0; i < n; i++) {
        size_t o = at[lead[i]];
        ks_status st = mm_init(&m[i], outs[i].W, outs[i].type, outs[i].repacked, outs[i].rows, cols, X, n_tokens,
                               outs[i].Y, (uint8_t *)work + o, work_size - o);
        if (st)
            return st;
        together = together && decode_compute(m[i].path) && m[i].path == m[lead[i]].path;
    }
    if (!together)
        return set_one_by_one(pool, cols, outs, n, X, n_tokens, work, work_size);
    int64_t macs = 0;
    for (int i = 0; i < n; i++)
        macs += outs[i].rows * cols * n_tokens;
    pool = mm_pool(pool, macs);
    for (int i = 0; i < n; i++) {
        if (lead[i] == i) {
            decode_pack(pool, &m[i]);
            continue;
        }
        m[i].xrow = m[lead[i]].xrow;
        m[i].corr_shift = m[lead[i]].corr_shift;
    }
    struct mm_set s = {m, n};
    threads_run(pool, set_compute, &s);
    for (int i = 0; i < n; i++) {
        ks_status st = mm_failed(&m[i]);
        if (st)
            return st;
    }
    return KS_OK;
}

ks_status quant_get_row(const void *W, enum quant_type wtype, int64_t cols, int64_t r, float *y)
{
    const struct quant_traits *tr = quant_traits(wtype);
    if (!tr || !tr->to_float)
        return ks_fail(KS_ERR_UNSUPPORTED, "get_row: type %s cannot be converted to f32", quant_type_name(wtype));
    size_t wrow = quant_row_size(wtype, cols);
    if (wrow == 0 || r < 0 || !W || !y)
        return ks_fail(KS_ERR_INVALID_ARG, "get_row: bad row %lld of width %lld for %s", (long long)r,
                       (long long)cols, tr->name);
    tr->to_float((const uint8_t *)W + r * wrow, y, cols);
    return KS_OK;
}
