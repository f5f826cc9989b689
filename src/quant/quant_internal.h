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

#endif
