#include "quant/kq_internal.h"

struct kq_kernels {
    enum quant_type type;
    const char *name;
    size_t bytes;
    quant_to_float_fn to_float;
    quant_from_float_fn from_float, from_float_best;
    quant_vec_dot_fn dot_scalar, dot_best;
};

/* Best compiled kernel per type: AVX-512 > AVX2 > scalar. */
#if defined(KQ_HAVE_AVX512)
#define KQ_BEST(t) quant_vec_dot_##t##_q8_K_avx512
#elif defined(KQ_HAVE_AVX2)
#define KQ_BEST(t) quant_vec_dot_##t##_q8_K_avx2
#else
#define KQ_BEST(t) quant_vec_dot_##t##_q8_K_scalar
#endif

#define KQ_ENTRY(T, t)                                                                           \
    {QUANT_##T, #t, sizeof(block_##t), quant_dequantize_row_##t, quant_quantize_row_##t,          \
     quant_quantize_row_##t, quant_vec_dot_##t##_q8_K_scalar, KQ_BEST(t)}

#if defined(KQ_HAVE_AVX512)
#define KQ_Q8_K_FROM_FLOAT quant_quantize_row_q8_K_avx512
#elif defined(KQ_HAVE_AVX2)
#define KQ_Q8_K_FROM_FLOAT quant_quantize_row_q8_K_avx2
#else
#define KQ_Q8_K_FROM_FLOAT quant_quantize_row_q8_K
#endif

static const struct kq_kernels kq_table[] = {
    KQ_ENTRY(Q2_K, q2_K), KQ_ENTRY(Q3_K, q3_K), KQ_ENTRY(Q4_K, q4_K),
    KQ_ENTRY(Q5_K, q5_K), KQ_ENTRY(Q6_K, q6_K),
    /* Q8_K is the activation type only: no vec_dot of its own. */
    {QUANT_Q8_K, "q8_K", sizeof(block_q8_K), quant_dequantize_row_q8_K, quant_quantize_row_q8_K,
     KQ_Q8_K_FROM_FLOAT, NULL, NULL},
};

static void fill_one(struct quant_traits *t, const struct kq_kernels *k, quant_from_float_fn from_float,
                     quant_vec_dot_fn dot)
{
    t->name = k->name;
    t->block_elems = QK_K;
    t->block_bytes = k->bytes;
    t->is_quantized = true;
    t->to_float = k->to_float;
    t->from_float = from_float;
    t->vec_dot_type = QUANT_Q8_K;
    t->vec_dot = dot;
}

void quant_kquants_fill(struct quant_traits *best, struct quant_traits *scalar)
{
    for (size_t i = 0; i < sizeof kq_table / sizeof kq_table[0]; i++) {
        const struct kq_kernels *k = &kq_table[i];
        fill_one(&best[k->type], k, k->from_float_best, k->dot_best);
        fill_one(&scalar[k->type], k, k->from_float, k->dot_scalar);
    }
}

quant_kq_dot_multi_fn quant_kquants_dot_multi(enum quant_type t)
{
#if defined(KQ_HAVE_AVX512)
    if (t == QUANT_Q4_K) return quant_vec_dot_q4_K_q8_K_multi_avx512;
    if (t == QUANT_Q6_K) return quant_vec_dot_q6_K_q8_K_multi_avx512;
#endif
    (void)t;
    return NULL;
}
