/* Internal to the quant module: the kernels that quant.c puts into its traits
 * tables, split by file (scalar references, SIMD kernels, matmul). */
#ifndef KS_QUANT_INTERNAL_H
#define KS_QUANT_INTERNAL_H

#include "quant/quant.h"

/* Portable bit-exact conversions (round to nearest even, NaN kept quiet). The
 * public quant_f16_to_f32 / quant_f32_to_f16 may use F16C instead. */
float quant_f16_to_f32_soft(quant_f16 h);
quant_f16 quant_f32_to_f16_soft(float f);

/* Fill the non-k-quant entries of both tables (see quant_ref.c, quant_simd.c). */
void quant_ref_fill(struct quant_traits *scalar);
void quant_simd_fill(struct quant_traits *best);
/* The KV quantizers with a scale search (quant_kv.c), the same in both tables. */
void quant_kv_fill(struct quant_traits *t);


/* ---- kernels, exposed so tests can compare every variant ----------------- */
void quant_q4_0_from_float_ref(const float *x, void *y, int64_t n);
void quant_q8_0_from_float_ref(const float *x, void *y, int64_t n);

#define QUANT_DECLARE_DOTS(isa)                                                       \
    void quant_vec_dot_f32_##isa(int n, float *s, const void *x, const void *y);       \
    void quant_vec_dot_f16_##isa(int n, float *s, const void *x, const void *y);       \
    void quant_vec_dot_bf16_##isa(int n, float *s, const void *x, const void *y);      \
    void quant_vec_dot_q4_0_q8_0_##isa(int n, float *s, const void *x, const void *y); \
    void quant_vec_dot_q4_1_q8_1_##isa(int n, float *s, const void *x, const void *y); \
    void quant_vec_dot_q5_0_q8_0_##isa(int n, float *s, const void *x, const void *y); \
    void quant_vec_dot_q5_1_q8_1_##isa(int n, float *s, const void *x, const void *y); \
    void quant_vec_dot_q8_0_q8_0_##isa(int n, float *s, const void *x, const void *y);

QUANT_DECLARE_DOTS(ref)
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QUANT_HAVE_AVX2 1
QUANT_DECLARE_DOTS(avx2)
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VBMI__)
#define QUANT_HAVE_AVX512 1
QUANT_DECLARE_DOTS(avx512)
#endif

#if defined(QUANT_HAVE_AVX2)
#include <immintrin.h>
/* The 32 values of a Q4_0 or Q8_0 block as signed bytes in element order, and
 * its scale: what the prefill tiles unpack weight rows into. */
static inline __m256i quant_block_bytes(const uint8_t *row, enum quant_type t, int64_t b, float *d)
{
    if (t == QUANT_Q4_0) {
        const block_q4_0 *blk = (const block_q4_0 *)row + b;
        __m128i x = _mm_loadu_si128((const __m128i *)blk->qs);
        __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), _mm256_set1_epi8(0x0f));
        *d = _cvtsh_ss(blk->d);
        return _mm256_sub_epi8(v, _mm256_set1_epi8(8));
    }
    const block_q8_0 *blk = (const block_q8_0 *)row + b;
    *d = _cvtsh_ss(blk->d);
    return _mm256_loadu_si256((const __m256i *)blk->qs);
}
#endif

#if defined(QUANT_HAVE_AVX2) && !defined(QUANT_HAVE_AVX512)
/* quant_matmul_avx2.c: Q4_0/Q8_0 prefill tiles for AVX2-only CPUs. work
 * holds at least quant_avx2_prefill_work(cols, n_tokens) bytes. */
#include "threads/threads.h"
size_t quant_avx2_prefill_work(int64_t cols, int64_t n_tokens);
ks_status quant_avx2_prefill(threads_pool *pool, const void *W, enum quant_type wtype, int64_t rows, int64_t cols,
                             const float *X, int64_t n_tokens, float *Y, void *work);
#endif

#endif
