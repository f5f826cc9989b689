/* quant: scalar reference kernels, with ggml's exact semantics. */
#include "quant/quant_internal.h"

void quant_ref_fill(struct quant_traits *scalar)
{
    (void)scalar;
}
