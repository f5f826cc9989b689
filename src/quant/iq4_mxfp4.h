/* Internal to the quant module: the 4-bit lookup-table weight types IQ4_NL,
 * IQ4_XS and MXFP4, with ggml's exact layouts (quant.h). Each weight is a
 * 4-bit index into a table of 16 int8 levels (quant_iq4nl_values, or
 * quant_mxfp4_values) times a block scale:
 *   IQ4_NL: blocks of 32, an f16 scale;                activations Q8_0
 *   IQ4_XS: super-blocks of 256, an f16 scale times a  activations Q8_K
 *           6-bit scale (minus 32) per block of 32;
 *   MXFP4:  blocks of 32, an E8M0 exponent;            activations Q8_0.
 * quant.c builds its traits tables and asks this file to fill these
 * entries, as kq_internal.h does for the k-quants.
 *
 * The scalar references (iq4_mxfp4_scalar.c) dequantize bit for bit as ggml
 * does. Every integer sum is exact; the float operations follow what
 * llama.cpp's CPU backend runs on x86, so that logits agree to the last bits
 * where they can and a near tie upstream goes the same way:
 *  - IQ4_NL and MXFP4 matrices are repacked by llama.cpp (iq4_nl_8x8,
 *    mxfp4_8x8; rows a multiple of 8) and each output is one chain over the
 *    blocks, acc = fma((float)isum, d_w * d_y, acc). The scalar references
 *    and every SIMD kernel compute exactly that: the same bits in every ISA.
 *  - IQ4_XS runs ggml's AVX2 vec_dot: per super-block the 6-bit scales are
 *    applied in int32 over 8 lanes, one fma per super-block into 8 float
 *    lanes, a horizontal sum at the end. The SIMD kernels do that, and so
 *    does quant_vec_dot_iq4_xs_q8_K_lanes; the scalar reference (the traits
 *    vec_dot) keeps ggml's generic order (a float step per block of 32),
 *    within the bound tests/test_quant_iq4_mxfp4.c holds. SIMD builds
 *    repack IQ4_XS matrices (kq_internal.h) and run kq_repack_avx*.c's
 *    group kernels on them, in the same eight-lane order.
 * Each SIMD vec_dot is its multi-token kernel at nt = 1 with the same
 * operations, so a token gets the same bits in a batch as alone. */
#ifndef KS_QUANT_IQ4_MXFP4_H
#define KS_QUANT_IQ4_MXFP4_H

#include <string.h>

#include "quant/kq_internal.h"
#include "quant/quant.h"

/* Fill the IQ4_NL (vec_dot only: the rest is quant_ref.c's), IQ4_XS and
 * MXFP4 entries of both tables: `best` the fastest kernels compiled in,
 * `scalar` the references. */
void quant_iq4_fill(struct quant_traits *best, struct quant_traits *scalar);

/* The multi-token kernel of an IQ4_NL, IQ4_XS or MXFP4 weight row (the
 * contract of quant_kq_dot_multi_fn, on this type's vec_dot_type rows), or
 * NULL for any other type or a build without SIMD. */
quant_kq_dot_multi_fn quant_iq4_dot_multi(enum quant_type t);


/* ggml's GGML_E8M0_TO_FP32_HALF: 2^(e - 128), exact (e = 0 and 1 give the
 * subnormals 2^-128 and 2^-127). */
static inline float quant_e8m0_to_f32_half(uint8_t e)
{
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* IQ4_XS: block ib's (0..7) scale, 0..63 (subtract 32 for its value). */
static inline int quant_iq4xs_scale(const block_iq4_xs *b, int ib)
{
    return ((b->scales_l[ib / 2] >> 4 * (ib % 2)) & 0xf) | (((b->scales_h >> 2 * ib) & 3) << 4);
}

/* ---- scalar references (iq4_mxfp4_scalar.c) ------------------------------ */
void quant_dequantize_row_iq4_xs(const void *x, float *y, int64_t n);
void quant_dequantize_row_mxfp4(const void *x, float *y, int64_t n);
/* ggml's quantize_iq4_xs without an importance matrix (what llama-quantize
 * runs without --imatrix): per block of 32 the least-squares scale of
 * IQ4_NL's search, then the block scales quantized against the largest. */
void quant_quantize_row_iq4_xs(const float *x, void *y, int64_t n);
/* ggml's quantize_row_mxfp4_ref: e from the block's largest magnitude, each
 * value to the nearest level (the first on a tie). */
void quant_quantize_row_mxfp4(const float *x, void *y, int64_t n);
void quant_vec_dot_iq4_xs_q8_K_scalar(int n, float *s, const void *x, const void *y);
/* IQ4_XS in ggml's AVX2 order, what every SIMD kernel computes: a super-
 * block's 8 exact int32 lanes (lane c: elements 4c..4c + 3 of each block of
 * 32 times its scale), fma(d * dy, lane, acc) per lane, hsum_float_8's sum. */
void quant_iq4_xs_lanes(const block_iq4_xs *x, const block_q8_K *y, int32_t lane[8]);
void quant_vec_dot_iq4_xs_q8_K_lanes(int n, float *s, const void *x, const void *y);
void quant_vec_dot_mxfp4_q8_0_scalar(int n, float *s, const void *x, const void *y);

/* ---- SIMD kernels ------------------------------------------------------- */
#define IQ4_DECLARE(isa)                                                                                  \
    void quant_vec_dot_iq4_nl_q8_0_##isa(int n, float *s, const void *x, const void *y);                \
    void quant_vec_dot_iq4_xs_q8_K_##isa(int n, float *s, const void *x, const void *y);                \
    void quant_vec_dot_mxfp4_q8_0_##isa(int n, float *s, const void *x, const void *y);                 \
    void quant_vec_dot_iq4_nl_q8_0_multi_##isa(int n, int nt, float *s, size_t s_stride, const void *x, \
                                               const void *y, size_t y_stride);                         \
    void quant_vec_dot_iq4_xs_q8_K_multi_##isa(int n, int nt, float *s, size_t s_stride, const void *x, \
                                               const void *y, size_t y_stride);                         \
    void quant_vec_dot_mxfp4_q8_0_multi_##isa(int n, int nt, float *s, size_t s_stride, const void *x,  \
                                              const void *y, size_t y_stride);
#if defined(KQ_HAVE_AVX2) && defined(__F16C__)
#define IQ4_HAVE_AVX2 1
IQ4_DECLARE(avx2)
#endif
#if defined(KQ_HAVE_AVX512)
#define IQ4_HAVE_AVX512 1
IQ4_DECLARE(avx512)
#endif

#endif
