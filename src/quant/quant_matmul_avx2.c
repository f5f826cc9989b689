/* quant: the AVX2 prefill tile for Q4_0 / Q8_0 weights, for CPUs without
 * AVX-512 (quant_matmul.c holds the AVX-512 one and the dispatch).
 *
 * Activations are quantized to Q8_0 and packed per group of 8 tokens so that
 * one 256-bit register holds 4 consecutive bytes of each of the 8 tokens.
 * Weight rows are unpacked to signed bytes, 4 rows at a time; a weight dword
 * is broadcast against the packed activations:
 *     maddubs(|w|, sign(x, w)) then madd(.., 1)
 * gives w * x summed over 4 bytes per token in int32. |w| <= 128 and
 * |x| <= 127 (the Q8_0 quantizer's range), so a maddubs pair sum is at most
 * 2 * 128 * 127 = 32512 and never saturates int16. Each weight byte is
 * read from L1 once per 8 tokens; the 4 x 8 tile keeps 4 int32 and 4 float
 * accumulators in registers. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "quant/quant_internal.h"

#if defined(QUANT_HAVE_AVX2) && !defined(QUANT_HAVE_AVX512)
#include <immintrin.h>

#define A2_TOK 8                          /* tokens per packed group */
#define A2_ROWS 4                         /* weight rows per tile */
#define A2_BLOCK_BYTES (8 * 32 + 8 * 4)   /* 8 dwords x 8 tokens, then 8 float scales */
#define A2_ALIGN 64

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
    quant_from_float_fn quantize = quant_traits(QUANT_Q8_0)->from_float;
    for (int64_t g = lo; g < hi; g++) {
        uint8_t *grp = c->work + (size_t)g * group_bytes(c->cols);
        memset(grp, 0, group_bytes(c->cols)); /* padding tokens: x = 0, d = 0 */
        for (int tl = 0; tl < A2_TOK && g * A2_TOK + tl < c->n_tokens; tl++) {
            quantize(c->X + (g * A2_TOK + tl) * c->cols, tmp, c->cols);
            for (int64_t b = 0; b < nb; b++) {
                uint8_t *blk = grp + b * A2_BLOCK_BYTES;
                for (int k = 0; k < 8; k++)
                    memcpy(blk + k * 32 + tl * 4, tmp[b].qs + 4 * k, 4);
                float d = quant_f16_to_f32(tmp[b].d);
                memcpy(blk + 8 * 32 + tl * 4, &d, 4);
            }
        }
    }
    free(tmp);
}

/* Rows r0 .. r0 + nr of W as signed bytes (q) and block scales (d); rows past
 * nr are zero. */
static void a2_unpack(const struct a2 *c, int64_t r0, int nr, int8_t *q, float *d)
{
    int64_t nb = c->cols / QK8_0;
    for (int r = 0; r < A2_ROWS; r++) {
        int8_t *qr = q + (size_t)r * c->cols;
        if (r >= nr) {
            memset(qr, 0, (size_t)c->cols);
            memset(d + r * nb, 0, (size_t)nb * sizeof(float));
            continue;
        }
        for (int64_t b = 0; b < nb; b++) {
            __m256i v = quant_weight_block_bytes(c->W, c->wtype, c->repacked, c->rows, nb, r0 + r, b, &d[r * nb + b]);
            _mm256_storeu_si256((__m256i *)(qr + b * QK8_0), v);
        }
    }
}

static inline __m256i dot4(__m256i x, __m256i w)
{
    __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

/* A2_ROWS rows x one group of 8 tokens over all blocks. */
static void a2_tile(const struct a2 *c, const int8_t *q, const float *d, int64_t r0, int nr, int64_t g)
{
    int64_t nb = c->cols / QK8_0;
    const uint8_t *grp = c->work + (size_t)g * group_bytes(c->cols);
    __m256 facc[A2_ROWS];
    for (int r = 0; r < A2_ROWS; r++)
        facc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = grp + b * A2_BLOCK_BYTES;
        __m256i iacc[A2_ROWS];
        for (int r = 0; r < A2_ROWS; r++)
            iacc[r] = _mm256_setzero_si256();
        for (int k = 0; k < 8; k++) {
            __m256i x = _mm256_load_si256((const __m256i *)(blk + k * 32));
            for (int r = 0; r < A2_ROWS; r++) {
                int32_t wd;
                memcpy(&wd, q + (size_t)r * c->cols + b * QK8_0 + 4 * k, 4);
                iacc[r] = _mm256_add_epi32(iacc[r], dot4(x, _mm256_set1_epi32(wd)));
            }
        }
        __m256 dx = _mm256_load_ps((const float *)(blk + 8 * 32));
        for (int r = 0; r < A2_ROWS; r++)
            facc[r] = _mm256_add_ps(facc[r], /* as the reference rounds: the group kernels' bits (no fma) */
                                    _mm256_mul_ps(_mm256_cvtepi32_ps(iacc[r]), _mm256_mul_ps(dx, _mm256_set1_ps(d[r * nb + b]))));
    }
    for (int r = 0; r < nr; r++) {
        float out[A2_TOK];
        _mm256_storeu_ps(out, facc[r]);
        for (int tl = 0; tl < A2_TOK && g * A2_TOK + tl < c->n_tokens; tl++)
            c->Y[(g * A2_TOK + tl) * c->rows + r0 + r] = out[tl];
    }
}

static void a2_compute(void *vctx, int ith, int nth)
{
    struct a2 *c = vctx;
    (void)ith, (void)nth;
    int64_t nb = c->cols / QK8_0, ng = n_groups(c->n_tokens);
    int64_t n_panels = (c->rows + A2_ROWS - 1) / A2_ROWS;
    int8_t *q = aligned_alloc(A2_ALIGN, ((size_t)A2_ROWS * (size_t)c->cols + A2_ALIGN - 1) / A2_ALIGN * A2_ALIGN);
    float *d = malloc((size_t)(A2_ROWS * nb) * sizeof(float));
    if (!q || !d) {
        atomic_store(&c->failed, 1);
        free(q);
        free(d);
        return;
    }
    for (int64_t p; (p = atomic_fetch_add(&c->next, 1)) < n_panels;) {
        int64_t r0 = p * A2_ROWS;
        int nr = (int)(c->rows - r0 < A2_ROWS ? c->rows - r0 : A2_ROWS);
        a2_unpack(c, r0, nr, q, d);
        for (int64_t g = 0; g < ng; g++)
            a2_tile(c, q, d, r0, nr, g);
    }
    free(q);
    free(d);
}

ks_status quant_avx2_prefill(threads_pool *pool, const void *W, enum quant_type wtype, bool repacked, int64_t rows,
                             int64_t cols, const float *X, int64_t n_tokens, float *Y, void *work)
{
    uint8_t *aligned = (uint8_t *)(((uintptr_t)work + A2_ALIGN - 1) / A2_ALIGN * A2_ALIGN);
    struct a2 c = {.W = W, .wtype = wtype, .repacked = repacked, .rows = rows, .cols = cols,
                   .n_tokens = n_tokens, .X = X, .Y = Y, .work = aligned};
    threads_run(pool, a2_pack, &c);
    if (!atomic_load(&c.failed))
        threads_run(pool, a2_compute, &c);
    if (atomic_load(&c.failed))
        return ks_fail(KS_ERR_NOMEM, "matmul: out of memory for a %lld-column weight panel", (long long)cols);
    return KS_OK;
}
#endif
