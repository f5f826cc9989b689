/* Internal to the quant module: ggml's grid quants IQ2_XXS, IQ2_XS, IQ1_S and
 * IQ1_M (ggml ids 16, 17, 19, 29), 256-element super-blocks with ggml's exact
 * layouts (ggml/src/ggml-common.h), weights only, dotted with Q8_K
 * activations.
 *
 * Each group of 8 weights is one point of a fixed grid (quant_iq2xxs_grid,
 * quant_iq2xs_grid, quant_iq1s_grid), times a per-16 or per-32 scale:
 *   IQ2_XXS  d * (0.5 + ls) / 4 * grid * sign, ls 4 bits per 32, signs per 8
 *   IQ2_XS   the same with a 512-point grid and ls per 16
 *   IQ1_S    d * (2 ls + 1) * (grid + delta), ls 3 bits per 32, delta +-1/8 per 32
 *   IQ1_M    the same with ls per 16, delta per 8 and d spread over the scales
 *
 * The vec_dots give the bits of the AVX2 kernels llama.cpp runs on x86
 * (ggml/src/ggml-cpu/arch/x86/quants.c): exact int32 sums in 8 lanes, lane k
 * holding elements 4k..4k+3 of every 32, each scaled by its integer scale;
 * per block acc[k] = fma(d_w * d_y, (float)lane[k], acc[k]); then the lanes'
 * sum in hsum order ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)) and the type's
 * epilogue (tests/test_quant_iq2.c checks them against that library). */
#ifndef KS_QUANT_IQ2_H
#define KS_QUANT_IQ2_H

#include <stdalign.h>

#include "quant/kq_internal.h"

#define QUANT_IQ1S_DELTA 0.125f
#define QUANT_IQ1M_DELTA 0.125f

/* d: f16 scale; qs: per 32 elements two uint32, the first 4 grid indices
 * (bytes), the second 4 x 7-bit sign indices then ls in bits 28..31. */
typedef struct { quant_f16 d; uint16_t qs[QK_K / 8]; } block_iq2_xxs;
static_assert(sizeof(block_iq2_xxs) == 2 + QK_K / 8 * 2, "block_iq2_xxs size");
/* qs: per 8 elements a 9-bit grid index | 7-bit sign index << 9; scales: per
 * 32 elements ls of the first 16 (low nibble) and of the second (high). */
typedef struct { quant_f16 d; uint16_t qs[QK_K / 8]; uint8_t scales[QK_K / 32]; } block_iq2_xs;
static_assert(sizeof(block_iq2_xs) == 2 + QK_K / 8 * 2 + QK_K / 32, "block_iq2_xs size");
/* qs: low 8 bits of each group's 11-bit grid index; qh per 32 elements: bits
 * 3l..3l+2 the high bits of group l, 12..14 ls, 15 the delta's sign (set: -). */
typedef struct { quant_f16 d; uint8_t qs[QK_K / 8]; uint16_t qh[QK_K / 32]; } block_iq1_s;
static_assert(sizeof(block_iq1_s) == 2 + QK_K / 8 + QK_K / 16, "block_iq1_s size");
/* qs: low 8 bits of the grid indices; qh per 16 elements one byte: bits 0..2
 * the high bits of the first group of 8, bit 3 its delta's sign, bits 4..7 the
 * same for the second; scales: 4 uint16, each two 32-element blocks' four
 * 3-bit ls (bits 0..11) and one nibble of the f16 super-scale (bits 12..15). */
typedef struct { uint8_t qs[QK_K / 8]; uint8_t qh[QK_K / 16]; uint8_t scales[QK_K / 32]; } block_iq1_m;
static_assert(sizeof(block_iq1_m) == QK_K / 8 + QK_K / 16 + QK_K / 32, "block_iq1_m size");
/* IQ1_M's super-scale, gathered from the scales' top nibbles. */
typedef union { quant_f16 f16; uint16_t u16; } iq1m_scale_t;

extern const uint64_t quant_iq2xxs_grid[256];
extern const uint64_t quant_iq2xs_grid[512];
extern const uint64_t quant_iq1s_grid[2048];
extern const uint8_t quant_iq2_ksigns[128];

static inline bool quant_is_iq2(enum quant_type t)
{
    return t == QUANT_IQ2_XXS || t == QUANT_IQ2_XS || t == QUANT_IQ1_S || t == QUANT_IQ1_M;
}

/* Fill the four types' entries of both tables (best kernels, references). */
void quant_iq2_fill(struct quant_traits *best, struct quant_traits *scalar);
/* The multi-token kernel of an IQ2/IQ1 type in this build, or NULL. */
quant_kq_dot_multi_fn quant_iq2_dot_multi(enum quant_type t);

/* ---- scalar references (iq2_scalar.c) ------------------------------------- */
void quant_dequantize_row_iq2_xxs(const void *x, float *y, int64_t n);
void quant_dequantize_row_iq2_xs(const void *x, float *y, int64_t n);
void quant_dequantize_row_iq1_s(const void *x, float *y, int64_t n);
void quant_dequantize_row_iq1_m(const void *x, float *y, int64_t n);
void quant_vec_dot_iq2_xxs_q8_K_scalar(int n, float *s, const void *x, const void *y);
void quant_vec_dot_iq2_xs_q8_K_scalar(int n, float *s, const void *x, const void *y);
void quant_vec_dot_iq1_s_q8_K_scalar(int n, float *s, const void *x, const void *y);
void quant_vec_dot_iq1_m_q8_K_scalar(int n, float *s, const void *x, const void *y);

/* ---- quantizers (iq2_quantize.c) -------------------------------------------
 * kvserve's own (not ggml's bit for bit): per 32 or 16 elements a scale
 * search, each group of 8 the grid point nearest its per-element levels
 * (looked up, with precomputed neighbour lists for vectors off the grid),
 * errors weighted by x^2 + the row block's mean square. */
void quant_quantize_row_iq2_xxs(const float *x, void *y, int64_t n);
void quant_quantize_row_iq2_xs(const float *x, void *y, int64_t n);
void quant_quantize_row_iq1_s(const float *x, void *y, int64_t n);
void quant_quantize_row_iq1_m(const float *x, void *y, int64_t n);

/* ---- one block unpacked, as every vec_dot kernel reads it ------------------ */
struct iq2_unpacked {
    alignas(64) uint8_t mag[QK_K]; /* |grid value| of each element */
    uint64_t neg[QK_K / 64];       /* bit j of neg[g]: element 64 g + j is negative */
    uint64_t dneg[QK_K / 64];      /* IQ1_M: the same for each element's delta */
    int16_t scale[QK_K / 16];      /* per 16 elements: the odd integer scale 2 ls + 1 */
    int16_t bsum_coef[QK_K / 32];  /* IQ1_S: per 32 elements (2 ls + 1) * (delta < 0 ? -1 : 1) */
    float d;                       /* the block's f16 super-scale */
};
/* The block at x (one of the four types) into u. */
void quant_iq2_unpack(enum quant_type t, const void *x, struct iq2_unpacked *u);

/* How a type's 8 lane accumulators become the dot (see the top of this file):
 * IQ2: 0.125 * hsum(acc); IQ1_S: hsum(acc) + 1/8 * acc1, acc1 = fma(d, sum of
 * bsum_coef * Q8_K bsums of each 32, acc1) per block; IQ1_M: hsum(acc) + 1/8 *
 * hsum(acc2), acc2's lanes the delta-signed Q8_K quants times the scales. */
static inline float quant_iq2_hsum8(const float a[8])
{
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* ---- SIMD (iq2_avx2.c, iq2_avx512.c) ----------------------------------------
 * s[t * s_stride] = dot(x, y_t) for t < nt (any nt >= 0), y_t the Q8_K row at
 * y + t * y_stride: each block is unpacked once for IQ2_TOKENS tokens. The
 * bits of the scalar vec_dot, per token, for any nt. */
#define IQ2_TOKENS 16
#if defined(KQ_HAVE_AVX2)
#define IQ2_HAVE_AVX2 1
void quant_iq2_dot_multi_avx2(enum quant_type t, int n, int nt, float *s, size_t s_stride, const void *x,
                              const void *y, size_t y_stride);
#endif
#if defined(KQ_HAVE_AVX512)
#define IQ2_HAVE_AVX512 1
void quant_iq2_dot_multi_avx512(enum quant_type t, int n, int nt, float *s, size_t s_stride, const void *x,
                                const void *y, size_t y_stride);
#endif

#endif
