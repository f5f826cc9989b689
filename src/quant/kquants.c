#include "quant/kquants.h"

static void fill_one(struct quant_traits *t, const char *name, size_t bytes, enum quant_type dot)
{
    t->name = name;
    t->block_elems = QK_K;
    t->block_bytes = bytes;
    t->is_quantized = true;
    t->vec_dot_type = dot;
}

void quant_kquants_fill(struct quant_traits *best, struct quant_traits *scalar)
{
    struct quant_traits *tables[2] = {best, scalar};
    for (int i = 0; i < 2; i++) {
        struct quant_traits *t = tables[i];
        fill_one(&t[QUANT_Q2_K], "q2_K", sizeof(block_q2_K), QUANT_Q8_K);
        fill_one(&t[QUANT_Q3_K], "q3_K", sizeof(block_q3_K), QUANT_Q8_K);
        fill_one(&t[QUANT_Q4_K], "q4_K", sizeof(block_q4_K), QUANT_Q8_K);
        fill_one(&t[QUANT_Q5_K], "q5_K", sizeof(block_q5_K), QUANT_Q8_K);
        fill_one(&t[QUANT_Q6_K], "q6_K", sizeof(block_q6_K), QUANT_Q8_K);
        fill_one(&t[QUANT_Q8_K], "q8_K", sizeof(block_q8_K), QUANT_Q8_K);
    }
}
