/* IQ3_XXS, IQ3_S, IQ2_S: their entries of the traits tables. */
#include "quant/iq3.h"

/* Best compiled kernel per type: AVX-512 > AVX2 > scalar. */
#if defined(KQ_HAVE_AVX512)
#define IQ3_BEST(t) quant_vec_dot_##t##_q8_K_avx512
#define IQ3_MULTI(t) quant_vec_dot_##t##_q8_K_multi_avx512
#elif defined(KQ_HAVE_AVX2)
#define IQ3_BEST(t) quant_vec_dot_##t##_q8_K_avx2
#define IQ3_MULTI(t) quant_vec_dot_##t##_q8_K_multi_avx2
#else
#define IQ3_BEST(t) quant_vec_dot_##t##_q8_K_scalar
#define IQ3_MULTI(t) NULL
#endif

#define IQ3_ENTRY(T, t)                                                                                      \
    {QUANT_##T, #t, sizeof(block_##t), quant_dequantize_row_##t, quant_quantize_row_##t, NULL,              \
     quant_vec_dot_##t##_q8_K_scalar, IQ3_BEST(t), IQ3_MULTI(t)}

static const struct kq_entry iq3_table[] = {
    IQ3_ENTRY(IQ3_XXS, iq3_xxs),
    IQ3_ENTRY(IQ3_S, iq3_s),
    IQ3_ENTRY(IQ2_S, iq2_s),
};
#define IQ3_N_TYPES (sizeof iq3_table / sizeof iq3_table[0])

void quant_iq3_fill(struct quant_traits *best, struct quant_traits *scalar)
{
#if defined(KQ_HAVE_AVX512)
    quant_iq3_init_avx512();
#endif
#if defined(KQ_HAVE_AVX2)
    quant_iq3_init_avx2();
#endif
    kq_entries_fill(iq3_table, IQ3_N_TYPES, best, scalar);
}

quant_kq_dot_multi_fn quant_iq3_dot_multi(enum quant_type t) { return kq_entries_dot_multi(iq3_table, IQ3_N_TYPES, t); }
