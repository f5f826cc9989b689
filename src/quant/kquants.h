/* Internal to the quant module: the k-quant family (Q2_K..Q6_K and the Q8_K
 * activation type), 256-element super-blocks with ggml's exact layouts.
 * quant.c builds its traits tables and asks this file to fill the k-quant
 * entries, so the two halves of the module can evolve separately. */
#ifndef KS_QUANT_KQUANTS_H
#define KS_QUANT_KQUANTS_H

#include "quant/quant.h"

/* Fill entries QUANT_Q2_K..QUANT_Q8_K of both tables (indexed by type id):
 * `best` gets the fastest kernels compiled in, `scalar` the references. */
void quant_kquants_fill(struct quant_traits *best, struct quant_traits *scalar);

#endif
