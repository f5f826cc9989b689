/* attn internals: the per-page kernels and their dispatch table.
 *
 * Attention for one KV head runs over a tile of R query rows: the G query
 * heads of that KV head (GQA) for one or more query tokens of one sequence.
 * Each page of the sequence is visited once per tile (pages outer, KV heads
 * inner, so a page half is read front to back); its K rows are scored
 * against all R rows, the page's scores folded into the running softmax
 * once, and its V rows accumulated into all R rows, so every K/V row is
 * loaded once per tile. Scores and values stay in registers or in the tile's
 * small score buffer; the page itself is read in place, never past row
 * n_tok - 1. */
#ifndef KS_ATTN_INTERNAL_H
#define KS_ATTN_INTERNAL_H

#include <assert.h>
#include <stdint.h>

#include "kv/kv.h"
#include "quant/quant.h"

/* One tile of query rows and their online-softmax state. */
struct attn_rows {
    int n;                 /* R rows */
    int dim;               /* head_dim */
    int stride;            /* floats between score rows in s (>= P) */
    const float *q;        /* (R, dim) scaled and rotated queries */
    const block_q8_0 *q8;  /* (R, dim / 32) q as int8 blocks, for quantized K; NULL otherwise */
    const float *q8d;      /* (R, dim / 32) the f32 value of each q8 block's scale */
    const int32_t *limit;  /* (R) visible tokens of each row: pos + 1 */
    const int32_t *first;  /* (R) first visible position of each row (sliding window); NULL: 0 */
    float *m, *l;          /* (R) running max and sum of exp */
    float *acc;            /* (R, dim) running sum of p * v */
    float *s;              /* (R, stride) scores of the current page, then p */
    /* Debug builds: the bytes the current kernel call may read, the run of P
     * rows of one (layer, KV head) in the page half it was given */
    const uint8_t *lo, *hi;
};

/* Row t of a kernel call's K or V rows (rb bytes each from base). Debug builds
 * assert that it lies in [rows->lo, rows->hi) and that t < rows->stride (its
 * score slot); Release builds only compute the address. */
static inline const uint8_t *attn_row_checked(const struct attn_rows *rows, const uint8_t *base, int t, size_t rb)
{
    const uint8_t *row = base + (size_t)t * rb;
    assert(t >= 0 && t < rows->stride);
    assert(rows->lo && row >= rows->lo && row + rb <= rows->hi);
    (void)rows;
    return row;
}
#ifdef NDEBUG
#define ATTN_ROW(rows, base, t, rb) ((const uint8_t *)(base) + (size_t)(t) * (rb))
#else
#define ATTN_ROW(rows, base, t, rb) attn_row_checked(rows, (const uint8_t *)(base), t, rb)
#endif

/* Set the bounds ATTN_ROW checks: n bytes from base (nothing in Release). */
static inline void attn_set_bounds(struct attn_rows *rows, const uint8_t *base, size_t n)
{
#ifdef NDEBUG
    (void)rows, (void)base, (void)n;
#else
    rows->lo = base;
    rows->hi = base + n;
#endif
}

/* s[r * stride + t] = q_r . k_t for t < n_tok (rows of one page, stride
 * quant_row_size(type, dim) apart), for every row r. */
typedef void (*attn_score_fn)(const uint8_t *k, int n_tok, const struct attn_rows *rows);
/* acc_r += sum_t p[r][t] * v_t for every row r and t < n_tok; p is in s. */
typedef void (*attn_accum_fn)(const uint8_t *v, int n_tok, const struct attn_rows *rows);

/* s[t] = exp(s[t] - mx) for t < n; returns the sum. */
typedef float (*attn_exp_sum_fn)(float *s, int n, float mx);
/* Fold one page's scores (tokens [page_start, page_start + n_tok)) into the
 * running state of every row: positions a row cannot see (>= limit, or
 * < first) get probability 0, the others exp(s - m) after m, l and acc are
 * rescaled to the new running max. */
typedef void (*attn_softmax_fn)(const struct attn_rows *rows, int page_start, int n_tok);

struct attn_kernels {
    const char *isa;
    attn_score_fn score[KV_N_TYPES]; /* by kv_type_index */
    attn_accum_fn accum[KV_N_TYPES];
    attn_exp_sum_fn exp_sum;
    attn_softmax_fn softmax;
};

/* Bytes of one q4_0 (q4) or q8_0 row of dim values, quant_row_size() inline
 * for the kernels' token loops. */
static inline size_t attn_quant_row_bytes(bool q4, int dim)
{
    return (size_t)(dim / QK8_0) * (q4 ? sizeof(block_q4_0) : sizeof(block_q8_0));
}

/* Bytes of one row of dim values of KV type t, quant_row_size() inline (a
 * constant per type when t is one) for the kernels' token loops. */
static inline size_t attn_row_bytes(enum quant_type t, int dim)
{
    switch (t) {
    case QUANT_F32: return (size_t)dim * sizeof(float);
    case QUANT_F16: return (size_t)dim * sizeof(quant_f16);
    case QUANT_BF16: return (size_t)dim * sizeof(quant_bf16);
    case QUANT_Q8_0: return (size_t)(dim / QK8_0) * sizeof(block_q8_0);
    case QUANT_Q5_1: return (size_t)(dim / QK5_1) * sizeof(block_q5_1);
    case QUANT_Q5_0: return (size_t)(dim / QK5_0) * sizeof(block_q5_0);
    case QUANT_Q4_1: return (size_t)(dim / QK4_1) * sizeof(block_q4_1);
    case QUANT_IQ4_NL: return (size_t)(dim / QK4_NL) * sizeof(block_iq4_nl);
    case QUANT_Q4_0: return (size_t)(dim / QK4_0) * sizeof(block_q4_0);
    case QUANT_IQ3_NL: return (size_t)(dim / QK3_NL) * sizeof(block_iq3_nl);
    default: return quant_row_size(t, dim);
    }
}

/* Row r's visible slice [*lo, *hi) of a page's n_tok scores from page_start. */
static inline void attn_visible(const struct attn_rows *rows, int r, int page_start, int n_tok, int *lo, int *hi)
{
    int h = rows->limit[r] - page_start, l = rows->first ? rows->first[r] - page_start : 0;
    *hi = h < 0 ? 0 : h > n_tok ? n_tok : h;
    *lo = l < 0 ? 0 : l > *hi ? *hi : l;
}

/* The reference page softmax over any exp_sum kernel (scalar and AVX2 sets). */
void attn_softmax_with(const struct attn_rows *rows, int page_start, int n_tok, attn_exp_sum_fn exp_sum);

const struct attn_kernels *attn_kernels_scalar(void);
const struct attn_kernels *attn_kernels_avx2(void);   /* NULL when not compiled in */
const struct attn_kernels *attn_kernels_avx512(void); /* NULL when not compiled in */
/* The best compiled-in set; tests may force another with attn_set_kernels. */
const struct attn_kernels *attn_kernels_best(void);
void attn_set_kernels(const struct attn_kernels *k); /* NULL: back to the best */

/* Quantize n floats (a multiple of 32) to q8_0 blocks, quantizing against
 * the f16-rounded scale, whose f32 value goes to yd[block]. */
void attn_quantize_q8(const float *x, block_q8_0 *y, float *yd, int n);

#endif
