/* quant: single outputs of a Q8_0 matmul in ggml-cpu's own x86 arithmetic
 * (its AVX2 code, which its AVX-512 builds run too, in vec_dot and in
 * llamafile's tinyBLAS alike):
 *   - the activations quantized by its x86 quantize_row_q8_0: amax over the
 *     block, d = amax / 127, the quants rint(x * (127 / amax)) (half to even);
 *   - per 32-block the products summed in 8 integer lanes of 4 bytes, each lane
 *     FMA'd with d = d_w * d_x into a float lane, and the 8 lanes added at the
 *     end (high 128 bits onto the low, movehl, movehdup).
 * The fast kernels keep the reference dot's order instead (one sum per block);
 * the two differ in a float's last bits. That matters where a later op rounds
 * coarsely: Gemma's GeGLU looks its input up in an f16 table, so a gate value
 * on an f16 rounding midpoint in one order and beside it in the other moves
 * the output by an f16 step. The model recomputes such gate values here. */
#include <math.h>

#include "quant/quant_internal.h"

void quant_q8_0_quantize_ggml(const float *x, void *vy, int64_t cols)
{
    block_q8_0 *y = vy;
    for (int64_t b = 0; b < cols / QK8_0; b++, x += QK8_0) {
        float amax = 0.0f;
        for (int j = 0; j < QK8_0; j++)
            amax = fmaxf(amax, fabsf(x[j]));
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        y[b].d = quant_f32_to_f16(amax / 127.0f);
        for (int j = 0; j < QK8_0; j++)
            y[b].qs[j] = (int8_t)rintf(x[j] * id);
    }
}

#define GGML_DOT_LANES 8

static float dot_lanes(const void *W, bool grouped, int64_t row_off, int64_t nb, int64_t r, const block_q8_0 *x)
{
    float lane[GGML_DOT_LANES] = {0};
    for (int64_t b = 0; b < nb; b++) {
        block_q8_0 wb;
        if (grouped)
            quant_rp_get_block(W, QUANT_Q8_0, nb, r, b, &wb);
        else
            wb = ((const block_q8_0 *)W)[row_off + b];
        const float d = quant_f16_to_f32(wb.d) * quant_f16_to_f32(x[b].d);
        for (int l = 0; l < GGML_DOT_LANES; l++) {
            int sum = 0;
            for (int k = 4 * l; k < 4 * l + 4; k++)
                sum += wb.qs[k] * x[b].qs[k];
            lane[l] = fmaf(d, (float)sum, lane[l]);
        }
    }
    float half[4];
    for (int i = 0; i < 4; i++)
        half[i] = lane[4 + i] + lane[i];
    return (half[0] + half[2]) + (half[1] + half[3]);
}

ks_status quant_q8_0_dot_ggml(const void *W, bool repacked, int64_t rows, int64_t cols, int64_t r, const void *xq,
                              float *out)
{
    if (!W || !xq || !out || cols <= 0 || cols % QK8_0 || r < 0 || r >= rows ||
        (repacked && !quant_repack_fits(QUANT_Q8_0, rows, cols)))
        return ks_fail(KS_ERR_INVALID_ARG, "q8_0 ggml dot: no row %lld in a%s Q8_0 matrix of %lld x %lld", (long long)r,
                       repacked ? " repacked" : "", (long long)rows, (long long)cols);
    int64_t nb = cols / QK8_0;
    bool grouped = repacked && r < quant_rp_grouped_rows(rows);
    /* a repacked matrix's tail rows stay row-major after its groups */
    *out = dot_lanes(W, grouped, r * nb, nb, r, xq);
    return KS_OK;
}
