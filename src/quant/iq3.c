/* IQ3_XXS, IQ3_S, IQ2_S: their entries of the traits tables. */
#include "quant/iq3.h"

struct iq3_kernels {
    enum quant_type type;
    const char *name;
    size_t bytes;
    quant_to_float_fn to_float;
    quant_from_float_fn from_float;
    quant_vec_dot_fn dot_scalar, dot_best;
    quant_kq_dot_multi_fn multi; /* NULL: none in this build */
};

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
    {QUANT_##T, #t, sizeof(block_##t), quant_dequantize_row_##t, quant_quantize_row_##t,                    \
     quant_vec_dot_##t##_q8_K_scalar, IQ3_BEST(t), IQ3_MULTI(t)}

static const struct iq3_kernels iq3_table[] = {
    IQ3_ENTRY(IQ3_XXS, iq3_xxs),
    IQ3_ENTRY(IQ3_S, iq3_s),
    IQ3_ENTRY(IQ2_S, iq2_s),
};
#define IQ3_N_TYPES (sizeof iq3_table / sizeof iq3_table[0])

static void fill_one(struct quant_traits *t, const struct iq3_kernels *k, quant_vec_dot_fn dot)
{
    *t = (struct quant_traits){
        .name = k->name,
        .block_elems = QK_K,
        .block_bytes = k->bytes,
        .is_quantized = true,
        .to_float = k->to_float,
        .from_float = k->from_float,
        .vec_dot_type = QUANT_Q8_K,
        .vec_dot = dot,
    };
}

void quant_iq3_fill(struct quant_traits *best, struct quant_traits *scalar)
{
    for (size_t i = 0; i < IQ3_N_TYPES; i++) {
        fill_one(&best[iq3_table[i].type], &iq3_table[i], iq3_table[i].dot_best);
        fill_one(&scalar[iq3_table[i].type], &iq3_table[i], iq3_table[i].dot_scalar);
    }
}

quant_kq_dot_multi_fn quant_iq3_dot_multi(enum quant_type t)
{
    for (size_t i = 0; i < IQ3_N_TYPES; i++)
        if (iq3_table[i].type == t)
            return iq3_table[i].multi;
    return NULL;
}
