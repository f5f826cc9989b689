/* quant: the AVX2 prefill tile for Q4_0 / Q8_0 weights, for CPUs without
 * AVX-512 (quant_matmul.c holds the AVX-512 one and the dispatch).
 *
 * Activations are quantized to Q8_0 and packed per group of 8 tokens so that
 * one 256-bit register holds 4 consecutive bytes of each of the 8 tokens; a
 * broadcast weight dword meets them in maddubs.
 *  - Q4_0 rows are unpacked to the unsigned nibbles u = w + 8, so maddubs(u, x)
 *    needs no abs / sign ops. A lane is at most 2 * 15 * 128 = 3840 in
 *    magnitude, so the 8 of a block add up in int16 (30720 < 32767) before one
 *    madd widens them; the -8 becomes a correction -8 * sum(x) per token and
 *    block, computed with the activation packing.
 *  - Q8_0 rows stay signed: maddubs(|w|, sign(x, w)), a lane up to
 *    2 * 128 * 127 = 32512, widened by madd at every step. (Splitting w + 128
 *    into two nibble planes, to sum in int16 as for Q4_0, took as many
 *    instructions and was no faster.)
 * Every block's integer dot is exact, and each (row, token) accumulates
 *     acc = fma((float)isum, d_x * d_w, acc)
 * block after block, as the reference vec_dot and the repacked group kernels
 * do (so a token gets the same bits in any batch), and as
 * quant_avx2_prefill_twin does in scalar code.
 *
 * A thread unpacks a super-panel of rows that stays in L2, then sweeps it over
 * the tokens A2_TT groups at a time, so each group is read from memory once per
 * super-panel and from L1 / L2 once per micro-tile. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "quant/quant_internal.h"

#define A2_TOK 8                              /* tokens per packed group */
#define A2_CHUNKS (QK8_0 / 4)                 /* 4-byte chunks per block */
#define A2_BLOCK_BYTES (A2_CHUNKS * 32 + 64)  /* chunks x 8 tokens, 8 float scales, 8 int32 Q4_0 corrections */
#define A2_ALIGN 64

/* ---- scalar twin ------------------------------------------------------------- */

/* Row r's block b as signed values and its scale, from either layout. */
static float a2_block_values(const void *W, enum quant_type t, bool repacked, int64_t rows, int64_t nb, int64_t r,
                             int64_t b, int8_t v[QK8_0])
{
    union {
        block_q4_0 q4;
        block_q8_0 q8;
    } blk;
    size_t bb = t == QUANT_Q4_0 ? sizeof(block_q4_0) : sizeof(block_q8_0);
    if (repacked && r < quant_rp_grouped_rows(rows)) /* the tail rows stay row-major */
        quant_rp_get_block(W, t, nb, r, b, &blk);
    else
        memcpy(&blk, (const uint8_t *)W + (size_t)(r * nb + b) * bb, bb);
    if (t == QUANT_Q8_0) {
        memcpy(v, blk.q8.qs, QK8_0);
        return quant_f16_to_f32(blk.q8.d);
    }
    for (int i = 0; i < QK4_0 / 2; i++) {
        v[i] = (int8_t)((blk.q4.qs[i] & 0x0f) - 8);
        v[i + QK4_0 / 2] = (int8_t)((blk.q4.qs[i] >> 4) - 8);
    }
    return quant_f16_to_f32(blk.q4.d);
}

ks_status quant_avx2_prefill_twin(const void *W, enum quant_type wtype, bool repacked, int64_t rows, int64_t cols,
                                  const float *X, int64_t n_tokens, float *Y)
{
    int64_t nb = cols / QK8_0;
    block_q8_0 *xq = malloc((size_t)(nb * n_tokens) * sizeof *xq);
    if (!xq)
        return ks_fail(KS_ERR_NOMEM, "matmul twin: out of memory for %lld tokens", (long long)n_tokens);
    for (int64_t t = 0; t < n_tokens; t++)
        quant_q8_0_act_from_float(X + t * cols, xq + t * nb, cols);
    memset(Y, 0, (size_t)(rows * n_tokens) * sizeof *Y);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb; b++) {
            int8_t w[QK8_0];
            float dw = a2_block_values(W, wtype, repacked, rows, nb, r, b, w);
            for (int64_t t = 0; t < n_tokens; t++) {
                const block_q8_0 *x = xq + t * nb + b;
                int32_t isum = 0;
                for (int i = 0; i < QK8_0; i++)
                    isum += w[i] * x->qs[i];
                Y[t * rows + r] = fmaf((float)isum, quant_f16_to_f32(x->d) * dw, Y[t * rows + r]);
            }
        }
    free(xq);
    return KS_OK;
}

#if defined(QUANT_HAVE_AVX2) && !defined(QUANT_HAVE_AVX512)
#include <immintrin.h>

/* Micro-tile: A2_ROWS rows x A2_TT groups of 8 tokens, 9 accumulators of the
 * 16 ymm registers (4 x 2 was as fast for Q4_0 and 4% slower for Q8_0). */
#ifndef A2_TT
#define A2_TT 3
#endif
#ifndef A2_ROWS
#define A2_ROWS 3
#endif
#define A2_PANEL_BUDGET (256 * 1024) /* bytes of unpacked rows per super-panel: well inside L2 */
#define A2_SUPER_MAX 64              /* rows per super-panel at most */

static size_t group_bytes(int64_t cols) { return (size_t)(cols / QK8_0) * A2_BLOCK_BYTES; }
static int64_t n_groups(int64_t n_tokens) { return (n_tokens + A2_TOK - 1) / A2_TOK; }

size_t quant_avx2_prefill_work(int64_t cols, int64_t n_tokens)
{
    return group_bytes(cols) * (size_t)n_groups(n_tokens) + A2_ALIGN;
}

struct a2 {
    const uint8_t *W;
    enum quant_type wtype;
    bool repacked; /* W in quant_repack's layout */
    int64_t rows, cols, n_tokens;
    int super_rows; /* rows per super-panel, a multiple of A2_ROWS */
    const float *X;
    float *Y;
    uint8_t *work;
    atomic_llong next;
    atomic_int failed;
};

/* Quantize the tokens of each group with the Q8_0 traits and repack. */
static void a2_pack(void *vctx, int ith, int nth)
{
    struct a2 *c = vctx;
    int64_t nb = c->cols / QK8_0, ng = n_groups(c->n_tokens), lo, hi;
    threads_split(ng, ith, nth, &lo, &hi);
    block_q8_0 *tmp = malloc((size_t)nb * sizeof *tmp);
    if (!tmp) {
        atomic_store(&c->failed, 1);
        return;
    }
    quant_from_float_fn quantize = quant_q8_0_act_from_float;
    for (int64_t g = lo; g < hi; g++) {
        uint8_t *grp = c->work + (size_t)g * group_bytes(c->cols);
        memset(grp, 0, group_bytes(c->cols)); /* padding tokens: x = 0, d = 0, correction 0 */
        for (int tl = 0; tl < A2_TOK && g * A2_TOK + tl < c->n_tokens; tl++) {
            quantize(c->X + (g * A2_TOK + tl) * c->cols, tmp, c->cols);
            for (int64_t b = 0; b < nb; b++) {
                uint8_t *blk = grp + b * A2_BLOCK_BYTES;
                for (int k = 0; k < A2_CHUNKS; k++)
                    memcpy(blk + k * 32 + tl * 4, tmp[b].qs + 4 * k, 4);
                float d = quant_f16_to_f32(tmp[b].d);
                int32_t sum = 0;
                for (int i = 0; i < QK8_0; i++)
                    sum += tmp[b].qs[i];
                int32_t corr = -8 * sum; /* Q4_0 only */
                memcpy(blk + A2_CHUNKS * 32 + tl * 4, &d, 4);
                memcpy(blk + A2_CHUNKS * 32 + 32 + tl * 4, &corr, 4);
            }
        }
    }
    free(tmp);
}

/* A super-panel of unpacked rows: Q4_0 as u = w + 8, Q8_0 as w. */
struct a2_panel {
    uint8_t *q; /* [rows][cols] */
    float *d;   /* [rows][nb] */
};

/* Rows r0 .. r0 + nr into the panel; rows up to the next multiple of the
 * micro-tile are zero. */
static void a2_unpack(const struct a2 *c, int64_t r0, int nr, const struct a2_panel *p)
{
    int64_t nb = c->cols / QK8_0;
    int padded = (nr + A2_ROWS - 1) / A2_ROWS * A2_ROWS;
    __m256i bias = _mm256_set1_epi8(c->wtype == QUANT_Q4_0 ? 8 : 0);
    for (int r = 0; r < padded; r++) {
        uint8_t *q = p->q + (size_t)r * (size_t)c->cols;
        if (r >= nr) {
            memset(q, 0, (size_t)c->cols);
            memset(p->d + r * nb, 0, (size_t)nb * sizeof(float));
            continue;
        }
        for (int64_t b = 0; b < nb; b++) {
            float *d = &p->d[r * nb + b];
            __m256i v = quant_weight_block_bytes(c->W, c->wtype, c->repacked, c->rows, nb, r0 + r, b, d);
            _mm256_storeu_si256((__m256i *)(q + b * QK8_0), _mm256_add_epi8(v, bias));
        }
    }
}

/* Block b's exact integer dots of A2_ROWS panel rows (from q) x T groups (x[t]
 * at block b) into isum[r][t]; q4: the panel holds u = w + 8. */
static inline __attribute__((always_inline)) void a2_block_dots(const uint8_t *q, size_t cols, const uint8_t *xb[],
                                                                int T, bool q4, __m256i isum[A2_ROWS][A2_TT])
{
    __m256i acc[A2_ROWS][A2_TT]; /* Q4_0: int16 lane pairs; Q8_0: int32 */
    for (int r = 0; r < A2_ROWS; r++)
        for (int t = 0; t < T; t++)
            acc[r][t] = _mm256_setzero_si256();
    for (int k = 0; k < A2_CHUNKS; k++) {
        __m256i x[A2_TT];
        for (int t = 0; t < T; t++)
            x[t] = _mm256_load_si256((const __m256i *)(xb[t] + 32 * k));
        for (int r = 0; r < A2_ROWS; r++) {
            int32_t wd;
            memcpy(&wd, q + r * cols + 4 * k, 4);
            __m256i w = _mm256_set1_epi32(wd);
            if (q4) {
                for (int t = 0; t < T; t++)
                    acc[r][t] = _mm256_add_epi16(acc[r][t], _mm256_maddubs_epi16(w, x[t]));
                continue;
            }
            __m256i wa = _mm256_abs_epi8(w);
            for (int t = 0; t < T; t++)
                acc[r][t] = _mm256_add_epi32(
                    acc[r][t], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, _mm256_sign_epi8(x[t], w)),
                                                 _mm256_set1_epi16(1)));
        }
    }
    for (int t = 0; t < T; t++) {
        __m256i corr = _mm256_load_si256((const __m256i *)(xb[t] + A2_CHUNKS * 32 + 32));
        for (int r = 0; r < A2_ROWS; r++)
            isum[r][t] = q4 ? _mm256_add_epi32(corr, _mm256_madd_epi16(acc[r][t], _mm256_set1_epi16(1))) : acc[r][t];
    }
}

/* A2_ROWS rows of the panel from row pr x T groups of 8 tokens from g0, over
 * all blocks. T and q4 are constants in every caller, so the accumulators
 * stay in registers. */
static inline __attribute__((always_inline)) void a2_tile(const struct a2 *c, const struct a2_panel *p, int pr,
                                                          int64_t r0, int64_t g0, int T, bool q4)
{
    const int64_t nb = c->cols / QK8_0;
    const uint8_t *q = p->q + (size_t)pr * (size_t)c->cols;
    const float *dw = p->d + pr * nb;
    __m256 facc[A2_ROWS][A2_TT];
    for (int r = 0; r < A2_ROWS; r++)
        for (int t = 0; t < T; t++)
            facc[r][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *xb[A2_TT];
        for (int t = 0; t < T; t++)
            xb[t] = c->work + (size_t)(g0 + t) * group_bytes(c->cols) + b * A2_BLOCK_BYTES;
        __m256i isum[A2_ROWS][A2_TT];
        a2_block_dots(q + b * QK8_0, (size_t)c->cols, xb, T, q4, isum);
        for (int t = 0; t < T; t++) {
            __m256 dx = _mm256_load_ps((const float *)(xb[t] + A2_CHUNKS * 32));
            for (int r = 0; r < A2_ROWS; r++) {
                __m256 s = _mm256_mul_ps(dx, _mm256_set1_ps(dw[r * nb + b]));
                /* the reference's fma chain: the group kernels' bits */
                facc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][t]), s, facc[r][t]);
            }
        }
    }
    for (int r = 0; r < A2_ROWS && r0 + pr + r < c->rows; r++)
        for (int t = 0; t < T; t++) {
            float out[A2_TOK];
            _mm256_storeu_ps(out, facc[r][t]);
            int64_t tok = (g0 + t) * A2_TOK;
            for (int tl = 0; tl < A2_TOK && tok + tl < c->n_tokens; tl++)
                c->Y[(tok + tl) * c->rows + r0 + pr + r] = out[tl];
        }
}

/* The tile compiled for each (width, type): A2_TT groups, or the last ones one at a time. */
static void a2_tile_any(const struct a2 *c, const struct a2_panel *p, int pr, int64_t r0, int64_t g0, int T)
{
    if (c->wtype == QUANT_Q4_0)
        T == A2_TT ? a2_tile(c, p, pr, r0, g0, A2_TT, true) : a2_tile(c, p, pr, r0, g0, 1, true);
    else
        T == A2_TT ? a2_tile(c, p, pr, r0, g0, A2_TT, false) : a2_tile(c, p, pr, r0, g0, 1, false);
}

/* Rows [r0, r0 + nr) against all tokens. */
static void a2_super_panel(const struct a2 *c, const struct a2_panel *p, int64_t r0, int nr)
{
    int64_t ng = n_groups(c->n_tokens);
    a2_unpack(c, r0, nr, p);
    for (int64_t g = 0; g < ng;) {
        int T = ng - g < A2_TT ? 1 : A2_TT;
        for (int pr = 0; pr < nr; pr += A2_ROWS)
            a2_tile_any(c, p, pr, r0, g, T);
        g += T;
    }
}

static void a2_compute(void *vctx, int ith, int nth)
{
    struct a2 *c = vctx;
    (void)ith, (void)nth;
    int64_t nb = c->cols / QK8_0, n_super = (c->rows + c->super_rows - 1) / c->super_rows;
    size_t qbytes = ((size_t)c->super_rows * (size_t)c->cols + A2_ALIGN - 1) / A2_ALIGN * A2_ALIGN;
    struct a2_panel p = {.q = aligned_alloc(A2_ALIGN, qbytes), .d = malloc((size_t)(c->super_rows * nb) * sizeof(float))};
    if (!p.q || !p.d) {
        atomic_store(&c->failed, 1);
        free(p.q);
        free(p.d);
        return;
    }
    for (int64_t s; (s = atomic_fetch_add(&c->next, 1)) < n_super;) {
        int64_t r0 = s * c->super_rows;
        a2_super_panel(c, &p, r0, (int)(c->rows - r0 < c->super_rows ? c->rows - r0 : c->super_rows));
    }
    free(p.q);
    free(p.d);
}

/* Rows per super-panel: what fits A2_PANEL_BUDGET, and at least 4 super-panels
 * per thread where the matrix allows, so a slowed thread does not hold up the
 * others. */
static int a2_super_rows(int64_t rows, int64_t cols, int n_threads)
{
    int64_t per_row = cols + cols / QK8_0 * (int64_t)sizeof(float);
    int64_t n = A2_PANEL_BUDGET / per_row, balanced = rows / (4 * (int64_t)n_threads);
    n = n < A2_SUPER_MAX ? n : A2_SUPER_MAX;
    n = n < balanced ? n : balanced;
    n = n / A2_ROWS * A2_ROWS;
    return n < A2_ROWS ? A2_ROWS : (int)n;
}

ks_status quant_avx2_prefill(threads_pool *pool, const void *W, enum quant_type wtype, bool repacked, int64_t rows,
                             int64_t cols, const float *X, int64_t n_tokens, float *Y, void *work)
{
    uint8_t *aligned = (uint8_t *)(((uintptr_t)work + A2_ALIGN - 1) / A2_ALIGN * A2_ALIGN);
    struct a2 c = {.W = W, .wtype = wtype, .repacked = repacked, .rows = rows, .cols = cols,
                   .n_tokens = n_tokens, .X = X, .Y = Y, .work = aligned,
                   .super_rows = a2_super_rows(rows, cols, pool ? threads_count(pool) : 1)};
    threads_run(pool, a2_pack, &c);
    if (!atomic_load(&c.failed))
        threads_run(pool, a2_compute, &c);
    if (atomic_load(&c.failed))
        return ks_fail(KS_ERR_NOMEM, "matmul: out of memory for a %lld-column weight panel", (long long)cols);
    return KS_OK;
}
#endif
