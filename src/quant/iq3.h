/* Internal to the quant module: the grid weight types IQ3_XXS, IQ3_S and
 * IQ2_S (ggml ids 18, 21, 22), whose activations are Q8_K rows.
 *
 * Dequantizers are bit-exact with ggml's dequantize_row_*. The dot products
 * follow the float order of the x86 kernels llama.cpp runs (its AVX2 code,
 * also in its AVX-512 builds): per super-block, eight exact int32 lane sums,
 * lane k holding elements 4k..4k+3 of every 32-element block times its
 * scale; per lane acc[k] = fma(d_x * d_y, (float)lane[k], acc[k]); at the
 * end a fixed pairwise sum of the 8 lanes (quant_iq2_hsum8: ggml's
 * hsum_float_8 order) times the type's constant (0.25, 1, 0.125). The scalar twin computes exactly that, so every
 * SIMD kernel and llama.cpp give the scalar reference's bits.
 *
 * Every function takes a row of n elements, n a multiple of QK_K. */
#ifndef KS_QUANT_IQ3_H
#define KS_QUANT_IQ3_H

#include "quant/iq2.h"
#include "quant/kq_internal.h"

/* ggml's iq3xxs_grid (4 magnitudes of {4,12,..,52,62} per entry, byte j is
 * element j), iq3s_grid (4 of {1,3,..,15}) and iq2s_grid (8 of {8,25,43}):
 * iq3_grids.c. IQ3_XXS's signs use ksigns_iq2xs (7 sign bits -> 8 with an
 * even count), the IQ2 types' table: quant_iq2_ksigns (iq2.h). */
extern const uint32_t quant_iq3xxs_grid[256];
extern const uint32_t quant_iq3s_grid[512];
extern const uint64_t quant_iq2s_grid[1024];

/* Fill the IQ3_XXS, IQ3_S and IQ2_S entries of both tables. */
void quant_iq3_fill(struct quant_traits *best, struct quant_traits *scalar);
/* The multi-token kernel of one of these types in this build (bit-identical
 * to its traits vec_dot), or NULL (then vec_dot per token). */
quant_kq_dot_multi_fn quant_iq3_dot_multi(enum quant_type t);

/* ---- scalar references (iq3_scalar.c) ------------------------------------ */
void quant_dequantize_row_iq3_xxs(const void *x, float *y, int64_t n);
void quant_dequantize_row_iq3_s(const void *x, float *y, int64_t n);
void quant_dequantize_row_iq2_s(const void *x, float *y, int64_t n);
void quant_vec_dot_iq3_xxs_q8_K_scalar(int n, float *s, const void *x, const void *y);
void quant_vec_dot_iq3_s_q8_K_scalar(int n, float *s, const void *x, const void *y);
void quant_vec_dot_iq2_s_q8_K_scalar(int n, float *s, const void *x, const void *y);

/* One super-block as signed values (grid magnitude times sign, |w| <= 62) and
 * the scale of each 16 elements (2 ls + 1, the integer the dot products
 * multiply by). */
void quant_iq3_xxs_unpack(const block_iq3_xxs *b, int8_t w[QK_K], int16_t sc[QK_K / 16]);
void quant_iq3_s_unpack(const block_iq3_s *b, int8_t w[QK_K], int16_t sc[QK_K / 16]);
void quant_iq2_s_unpack(const block_iq2_s *b, int8_t w[QK_K], int16_t sc[QK_K / 16]);

/* The constant each type's dot product ends with (its scales are 2 ls + 1,
 * ggml's dequantized ones (0.5 + ls) * 0.5, (1 + 2 ls), (0.5 + ls) * 0.25). */
#define IQ3_XXS_DOT_SCALE 0.25f
#define IQ3_S_DOT_SCALE 1.0f
#define IQ2_S_DOT_SCALE 0.125f

/* ---- quantizers (iq3_quantize.c): nearest grid point per group with a
 * least-squares scale per 32 (IQ2_S: 16) elements, not ggml's algorithm;
 * thread-safe (the search tables are built once). */
void quant_quantize_row_iq3_xxs(const float *x, void *y, int64_t n);
void quant_quantize_row_iq3_s(const float *x, void *y, int64_t n);
void quant_quantize_row_iq2_s(const float *x, void *y, int64_t n);

/* ---- SIMD kernels: vec_dot is the multi-token kernel at nt = 1 ----------- */
#if defined(KQ_HAVE_AVX2)
void quant_vec_dot_iq3_xxs_q8_K_multi_avx2(int n, int nt, float *s, size_t s_stride, const void *x, const void *y,
                                           size_t y_stride);
void quant_vec_dot_iq3_s_q8_K_multi_avx2(int n, int nt, float *s, size_t s_stride, const void *x, const void *y,
                                         size_t y_stride);
void quant_vec_dot_iq2_s_q8_K_multi_avx2(int n, int nt, float *s, size_t s_stride, const void *x, const void *y,
                                         size_t y_stride);
void quant_vec_dot_iq3_xxs_q8_K_avx2(int n, float *s, const void *x, const void *y);
void quant_vec_dot_iq3_s_q8_K_avx2(int n, float *s, const void *x, const void *y);
void quant_vec_dot_iq2_s_q8_K_avx2(int n, float *s, const void *x, const void *y);
/* The AVX2 kernels' sign table (quant_iq3_fill calls it). */
void quant_iq3_init_avx2(void);
#endif
#if defined(KQ_HAVE_AVX512)
void quant_vec_dot_iq3_xxs_q8_K_multi_avx512(int n, int nt, float *s, size_t s_stride, const void *x,
                                             const void *y, size_t y_stride);
void quant_vec_dot_iq3_s_q8_K_multi_avx512(int n, int nt, float *s, size_t s_stride, const void *x, const void *y,
                                           size_t y_stride);
void quant_vec_dot_iq2_s_q8_K_multi_avx512(int n, int nt, float *s, size_t s_stride, const void *x, const void *y,
                                           size_t y_stride);
void quant_vec_dot_iq3_xxs_q8_K_avx512(int n, float *s, const void *x, const void *y);
void quant_vec_dot_iq3_s_q8_K_avx512(int n, float *s, const void *x, const void *y);
void quant_vec_dot_iq2_s_q8_K_avx512(int n, float *s, const void *x, const void *y);
/* Tables the AVX-512 kernels build once (quant_iq3_fill calls it). */
void quant_iq3_init_avx512(void);
#endif

#endif
