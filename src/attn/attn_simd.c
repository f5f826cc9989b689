/* SIMD kernel sets (AVX2, AVX-512). Filled in per ISA below; a set that is
 * not compiled into this build reports NULL. */
#include "attn/attn_internal.h"

const struct attn_kernels *attn_kernels_avx2(void) { return NULL; }
const struct attn_kernels *attn_kernels_avx512(void) { return NULL; }
