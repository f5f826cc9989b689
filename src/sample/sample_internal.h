/* sample internals shared by the sampler and its tests. */
#ifndef KS_SAMPLE_INTERNAL_H
#define KS_SAMPLE_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

/* exp(x), branch-free and vectorizable; 0 for x < -87 (and -inf). */
float sample_expf(float x);
/* Index of the first maximum of x[0..n) and its value; false if any value
 * is NaN or +inf (the outputs are then meaningless). */
bool sample_max_index(const float *x, int32_t n, int32_t *index_out, float *max_out);
/* sum_i exp((x[i] - shift) * scale), accumulated in double. */
double sample_sum_exp(const float *x, int32_t n, float shift, float scale);
/* Index of the first maximum (ties: the lowest index). */
int32_t sample_argmax(const float *x, int32_t n);

#endif
