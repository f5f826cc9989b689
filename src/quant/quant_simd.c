/* quant: AVX2 / AVX-512 kernels. */
#include "quant/quant_internal.h"

const char *quant_isa(void)
{
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    return "avx512-vnni";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "scalar";
#endif
}

void quant_simd_fill(struct quant_traits *best)
{
    (void)best;
}
