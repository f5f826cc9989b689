#include "quant/kq_internal.h"

/* Best compiled kernel per type: AVX-512 > AVX2 > scalar. Q3_K, Q5_K and
 * Q6_K keep ggml's AVX2 lane order (kq_scalar.c), which llama.cpp runs on
 * AVX-512 machines too: their AVX2 kernels are the best there. */
#if defined(KQ_HAVE_AVX512)
#define KQ_BEST(t) quant_vec_dot_##t##_q8_K_avx512
#elif defined(KQ_HAVE_AVX2)
#define KQ_BEST(t) quant_vec_dot_##t##_q8_K_avx2
#else
#define KQ_BEST(t) quant_vec_dot_##t##_q8_K_scalar
#endif
#if defined(KQ_HAVE_AVX2)
#define KQ_LANES(t) quant_vec_dot_##t##_q8_K_avx2
#else
#define KQ_LANES(t) quant_vec_dot_##t##_q8_K_scalar
#endif

#if defined(KQ_HAVE_AVX512)
#define KQ_MULTI_Q4_K quant_vec_dot_q4_K_q8_K_multi_avx512
#else
#define KQ_MULTI_Q4_K NULL
#endif

#define KQ_ENTRY_WITH(T, t, best, multi)                                                          \
    {QUANT_##T, #t, sizeof(block_##t), quant_dequantize_row_##t, quant_quantize_row_##t,          \
     quant_quantize_row_##t, quant_vec_dot_##t##_q8_K_scalar, best, multi}
#define KQ_ENTRY(T, t, multi) KQ_ENTRY_WITH(T, t, KQ_BEST(t), multi)
#define KQ_ENTRY_LANES(T, t) KQ_ENTRY_WITH(T, t, KQ_LANES(t), NULL)

#if defined(KQ_HAVE_AVX512)
#define KQ_Q8_K_FROM_FLOAT quant_quantize_row_q8_K_avx512
#elif defined(KQ_HAVE_AVX2)
#define KQ_Q8_K_FROM_FLOAT quant_quantize_row_q8_K_avx2
#else
#define KQ_Q8_K_FROM_FLOAT quant_quantize_row_q8_K
#endif

static const struct kq_entry kq_table[] = {
    KQ_ENTRY(Q2_K, q2_K, NULL), KQ_ENTRY_LANES(Q3_K, q3_K), KQ_ENTRY(Q4_K, q4_K, KQ_MULTI_Q4_K),
    KQ_ENTRY_LANES(Q5_K, q5_K), KQ_ENTRY_LANES(Q6_K, q6_K),
    /* Q8_K is the activation type only: no vec_dot of its own. */
    {QUANT_Q8_K, "q8_K", sizeof(block_q8_K), quant_dequantize_row_q8_K, quant_quantize_row_q8_K,
     KQ_Q8_K_FROM_FLOAT, NULL, NULL, NULL},
};
#define KQ_N_TYPES (sizeof kq_table / sizeof kq_table[0])

static void fill_one(struct quant_traits *t, const struct kq_entry *e, quant_from_float_fn from_float,
                     quant_vec_dot_fn dot)
{
    *t = (struct quant_traits){
        .name = e->name,
        .block_elems = QK_K,
        .block_bytes = e->bytes,
        .is_quantized = true,
        .to_float = e->to_float,
        .from_float = from_float,
        .vec_dot_type = QUANT_Q8_K,
        .vec_dot = dot,
    };
}

void kq_entries_fill(const struct kq_entry *table, size_t n, struct quant_traits *best, struct quant_traits *scalar)
{
    for (size_t i = 0; i < n; i++) {
        const struct kq_entry *e = &table[i];
        fill_one(&best[e->type], e, e->from_float_best ? e->from_float_best : e->from_float, e->dot_best);
        fill_one(&scalar[e->type], e, e->from_float, e->dot_scalar);
    }
}

quant_kq_dot_multi_fn kq_entries_dot_multi(const struct kq_entry *table, size_t n, enum quant_type t)
{
    for (size_t i = 0; i < n; i++)
        if (table[i].type == t)
            return table[i].multi;
    return NULL;
}

void quant_kquants_fill(struct quant_traits *best, struct quant_traits *scalar)
{
    kq_entries_fill(kq_table, KQ_N_TYPES, best, scalar);
}

quant_kq_dot_multi_fn quant_kquants_dot_multi(enum quant_type t) { return kq_entries_dot_multi(kq_table, KQ_N_TYPES, t); }
