/* quant: scalar reference kernels with ggml's exact semantics (the reference
 * quantizers' rounding, the dequantizers' formulas). The SIMD kernels are
 * tested against these. */
#include <float.h>
#include <math.h>
#include <string.h>

#include "quant/quant_internal.h"

#define F16(h) quant_f16_to_f32(h)

/* ---- float types --------------------------------------------------------- */

static void f32_to_float(const void *x, float *y, int64_t n) { memcpy(y, x, (size_t)n * sizeof(float)); }
static void f32_from_float(const float *x, void *y, int64_t n) { memcpy(y, x, (size_t)n * sizeof(float)); }

static void f16_to_float(const void *vx, float *y, int64_t n)
{
    const quant_f16 *x = vx;
    for (int64_t i = 0; i < n; i++)
        y[i] = quant_f16_to_f32(x[i]);
}

static void f16_from_float(const float *x, void *vy, int64_t n)
{
    quant_f16 *y = vy;
    for (int64_t i = 0; i < n; i++)
        y[i] = quant_f32_to_f16(x[i]);
}

static void bf16_to_float(const void *vx, float *y, int64_t n)
{
    const quant_bf16 *x = vx;
    for (int64_t i = 0; i < n; i++)
        y[i] = quant_bf16_to_f32(x[i]);
}

static void bf16_from_float(const float *x, void *vy, int64_t n)
{
    quant_bf16 *y = vy;
    for (int64_t i = 0; i < n; i++)
        y[i] = quant_f32_to_bf16(x[i]);
}

/* Float dots accumulate in double: the reference should be the most exact. */
void quant_vec_dot_f32_ref(int n, float *s, const void *vx, const void *vy)
{
    const float *x = vx, *y = vy;
    double sum = 0;
    for (int i = 0; i < n; i++)
        sum += (double)x[i] * y[i];
    *s = (float)sum;
}

void quant_vec_dot_f16_ref(int n, float *s, const void *vx, const void *vy)
{
    const quant_f16 *x = vx;
    const float *y = vy;
    double sum = 0;
    for (int i = 0; i < n; i++)
        sum += (double)quant_f16_to_f32(x[i]) * y[i];
    *s = (float)sum;
}

void quant_vec_dot_bf16_ref(int n, float *s, const void *vx, const void *vy)
{
    const quant_bf16 *x = vx;
    const float *y = vy;
    double sum = 0;
    for (int i = 0; i < n; i++)
        sum += (double)quant_bf16_to_f32(x[i]) * y[i];
    *s = (float)sum;
}

/* ---- block quantizers (ggml's quantize_row_*_ref) ------------------------ */

static float absmax_signed(const float *x, int n)
{
    float amax = 0, max = 0;
    for (int j = 0; j < n; j++) {
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    }
    return max;
}

static void min_max(const float *x, int n, float *min, float *max)
{
    *min = FLT_MAX;
    *max = -FLT_MAX;
    for (int j = 0; j < n; j++) {
        if (x[j] < *min)
            *min = x[j];
        if (x[j] > *max)
            *max = x[j];
    }
}

static int imin(int a, int b) { return a < b ? a : b; }

void quant_q4_0_from_float_ref(const float *x, void *vy, int64_t n)
{
    block_q4_0 *y = vy;
    for (int64_t i = 0; i < n / QK4_0; i++, x += QK4_0) {
        const float d = absmax_signed(x, QK4_0) / -8;
        const float id = d ? 1.0f / d : 0.0f;
        y[i].d = quant_f32_to_f16(d);
        for (int j = 0; j < QK4_0 / 2; j++) {
            int xi0 = imin(15, (int8_t)(x[j] * id + 8.5f));
            int xi1 = imin(15, (int8_t)(x[QK4_0 / 2 + j] * id + 8.5f));
            y[i].qs[j] = (uint8_t)(xi0 | (xi1 << 4));
        }
    }
}

void quant_q4_1_from_float_ref(const float *x, void *vy, int64_t n)
{
    block_q4_1 *y = vy;
    for (int64_t i = 0; i < n / QK4_1; i++, x += QK4_1) {
        float min, max;
        min_max(x, QK4_1, &min, &max);
        const float d = (max - min) / ((1 << 4) - 1);
        const float id = d ? 1.0f / d : 0.0f;
        y[i].d = quant_f32_to_f16(d);
        y[i].m = quant_f32_to_f16(min);
        for (int j = 0; j < QK4_1 / 2; j++) {
            int xi0 = imin(15, (int8_t)((x[j] - min) * id + 0.5f));
            int xi1 = imin(15, (int8_t)((x[QK4_1 / 2 + j] - min) * id + 0.5f));
            y[i].qs[j] = (uint8_t)(xi0 | (xi1 << 4));
        }
    }
}

void quant_q5_0_from_float_ref(const float *x, void *vy, int64_t n)
{
    block_q5_0 *y = vy;
    for (int64_t i = 0; i < n / QK5_0; i++, x += QK5_0) {
        const float d = absmax_signed(x, QK5_0) / -16;
        const float id = d ? 1.0f / d : 0.0f;
        y[i].d = quant_f32_to_f16(d);
        uint32_t qh = 0;
        for (int j = 0; j < QK5_0 / 2; j++) {
            int xi0 = imin(31, (int8_t)(x[j] * id + 16.5f));
            int xi1 = imin(31, (int8_t)(x[QK5_0 / 2 + j] * id + 16.5f));
            y[i].qs[j] = (uint8_t)((xi0 & 0x0f) | ((xi1 & 0x0f) << 4));
            qh |= ((uint32_t)(xi0 & 0x10) >> 4) << j;
            qh |= ((uint32_t)(xi1 & 0x10) >> 4) << (j + QK5_0 / 2);
        }
        memcpy(y[i].qh, &qh, sizeof qh);
    }
}

void quant_q5_1_from_float_ref(const float *x, void *vy, int64_t n)
{
    block_q5_1 *y = vy;
    for (int64_t i = 0; i < n / QK5_1; i++, x += QK5_1) {
        float min, max;
        min_max(x, QK5_1, &min, &max);
        const float d = (max - min) / ((1 << 5) - 1);
        const float id = d ? 1.0f / d : 0.0f;
        y[i].d = quant_f32_to_f16(d);
        y[i].m = quant_f32_to_f16(min);
        uint32_t qh = 0;
        for (int j = 0; j < QK5_1 / 2; j++) {
            int xi0 = (uint8_t)((x[j] - min) * id + 0.5f);
            int xi1 = (uint8_t)((x[QK5_1 / 2 + j] - min) * id + 0.5f);
            y[i].qs[j] = (uint8_t)((xi0 & 0x0f) | ((xi1 & 0x0f) << 4));
            qh |= ((uint32_t)(xi0 & 0x10) >> 4) << j;
            qh |= ((uint32_t)(xi1 & 0x10) >> 4) << (j + QK5_1 / 2);
        }
        memcpy(y[i].qh, &qh, sizeof qh);
    }
}

/* ---- IQ4_NL (ggml's quantize_iq4_nl without an importance matrix) -------- */

const int8_t quant_iq4nl_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* Index of the level nearest to v; a tie goes to the upper level. */
int quant_iq4nl_nearest(float v)
{
    const int8_t *lv = quant_iq4nl_values;
    if (v <= lv[0])
        return 0;
    if (v >= lv[15])
        return 15;
    int up = 1;
    while (v >= lv[up])
        up++;
    return v - lv[up - 1] < lv[up] - v ? up - 1 : up;
}

/* Sums of a least-squares fit of the levels inv_scale maps x to, weighted by
 * x^2: the best scale for them is qx / q2. */
struct iq4nl_sums {
    float qx, q2;
};

static struct iq4nl_sums iq4nl_fit(const float *x, float inv_scale)
{
    struct iq4nl_sums s = {0, 0};
    for (int j = 0; j < QK4_NL; j++) {
        float q = quant_iq4nl_values[quant_iq4nl_nearest(inv_scale * x[j])], w = x[j] * x[j];
        s.qx += w * q * x[j];
        s.q2 += w * q * q;
    }
    return s;
}

/* The scale of one block: the fit at max / -127, then the best of 15 fits
 * that map the block's extreme near the outer level. */
float quant_iq4nl_block_scale(const float *x)
{
    enum { TRIES = 7 };
    float amax = 0, max = 0;
    for (int j = 0; j < QK4_NL; j++)
        if (fabsf(x[j]) > amax) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    if (amax < 1e-15f)
        return 0.0f;
    float d0 = -max / quant_iq4nl_values[0];
    struct iq4nl_sums s = iq4nl_fit(x, 1 / d0);
    float d = s.qx / s.q2, best = d * s.qx;
    for (int t = -TRIES; t <= TRIES; t++) {
        s = iq4nl_fit(x, (t + quant_iq4nl_values[0]) / max);
        if (s.q2 > 0 && s.qx * s.qx > best * s.q2) {
            d = s.qx / s.q2;
            best = d * s.qx;
        }
    }
    return d;
}

void quant_iq4_nl_from_float_ref(const float *x, void *vy, int64_t n)
{
    block_iq4_nl *y = vy;
    for (int64_t i = 0; i < n / QK4_NL; i++, x += QK4_NL) {
        float d = quant_iq4nl_block_scale(x), id = d ? 1.0f / d : 0.0f;
        y[i].d = quant_f32_to_f16(d);
        for (int j = 0; j < QK4_NL / 2; j++)
            y[i].qs[j] = (uint8_t)(quant_iq4nl_nearest(id * x[j]) | quant_iq4nl_nearest(id * x[j + QK4_NL / 2]) << 4);
    }
}

/* ---- IQ3_NL (kvserve's own KV type) --------------------------------------- */

/* Lloyd-Max reconstruction levels of 8 for a unit Gaussian (+-0.2451,
 * +-0.7560, +-1.3440, +-2.1520), times 127 / 2.1520. */
const int8_t quant_iq3nl_values[8] = {-127, -79, -45, -14, 14, 45, 79, 127};

/* The plain quantizer: the block's largest magnitude on the first level,
 * every value to its nearest level. The KV rows' least-squares search
 * (quant_kv.c) starts from this block. */
void quant_iq3_nl_from_float_ref(const float *x, void *vy, int64_t n)
{
    block_iq3_nl *y = vy;
    for (int64_t i = 0; i < n / QK3_NL; i++, x += QK3_NL) {
        float max = 0;
        for (int j = 0; j < QK3_NL; j++)
            max = fabsf(x[j]) > fabsf(max) ? x[j] : max;
        float d = max / quant_iq3nl_values[0], id = d ? 1.0f / d : 0.0f;
        uint8_t idx[QK3_NL];
        for (int j = 0; j < QK3_NL; j++)
            idx[j] = (uint8_t)quant_nearest_level(quant_iq3nl_values, 8, id * x[j]);
        y[i].d = quant_f32_to_f16(d);
        quant_iq3nl_pack(idx, &y[i]);
    }
}

static void iq3_nl_to_float(const void *vx, float *y, int64_t n)
{
    const block_iq3_nl *x = vx;
    for (int64_t i = 0; i < n / QK3_NL; i++, y += QK3_NL) {
        const float d = F16(x[i].d);
        for (int j = 0; j < QK3_NL; j++)
            y[j] = d * quant_iq3nl_values[quant_iq3nl_index(&x[i], j)];
    }
}

static float absmax(const float *x, int n)
{
    float amax = 0;
    for (int j = 0; j < n; j++)
        amax = fmaxf(amax, fabsf(x[j]));
    return amax;
}

void quant_q8_0_from_float_ref(const float *x, void *vy, int64_t n)
{
    block_q8_0 *y = vy;
    for (int64_t i = 0; i < n / QK8_0; i++, x += QK8_0) {
        const float d = absmax(x, QK8_0) / ((1 << 7) - 1);
        const float id = d ? 1.0f / d : 0.0f;
        y[i].d = quant_f32_to_f16(d);
        for (int j = 0; j < QK8_0; j++)
            y[i].qs[j] = (int8_t)roundf(x[j] * id);
    }
}

static void q8_1_from_float(const float *x, void *vy, int64_t n)
{
    block_q8_1 *y = vy;
    for (int64_t i = 0; i < n / QK8_1; i++, x += QK8_1) {
        const float d = absmax(x, QK8_1) / ((1 << 7) - 1);
        const float id = d ? 1.0f / d : 0.0f;
        y[i].d = quant_f32_to_f16(d);
        int sum = 0;
        for (int j = 0; j < QK8_1; j++) {
            y[i].qs[j] = (int8_t)roundf(x[j] * id);
            sum += y[i].qs[j];
        }
        y[i].s = quant_f32_to_f16((float)sum * d);
    }
}

/* ---- block dequantizers (ggml's dequantize_row_*) ------------------------ */

static void q4_0_to_float(const void *vx, float *y, int64_t n)
{
    const block_q4_0 *x = vx;
    for (int64_t i = 0; i < n / QK4_0; i++, y += QK4_0) {
        const float d = F16(x[i].d);
        for (int j = 0; j < QK4_0 / 2; j++) {
            y[j] = ((x[i].qs[j] & 0x0f) - 8) * d;
            y[j + QK4_0 / 2] = ((x[i].qs[j] >> 4) - 8) * d;
        }
    }
}

static void q4_1_to_float(const void *vx, float *y, int64_t n)
{
    const block_q4_1 *x = vx;
    for (int64_t i = 0; i < n / QK4_1; i++, y += QK4_1) {
        const float d = F16(x[i].d), m = F16(x[i].m);
        for (int j = 0; j < QK4_1 / 2; j++) {
            y[j] = (x[i].qs[j] & 0x0f) * d + m;
            y[j + QK4_1 / 2] = (x[i].qs[j] >> 4) * d + m;
        }
    }
}

/* The 5th bits: bit j of qh belongs to element j. */
static int q5_value(const uint8_t *qs, uint32_t qh, int j)
{
    int low = j < 16 ? (qs[j] & 0x0f) : (qs[j - 16] >> 4);
    return low | (int)(((qh >> j) & 1) << 4);
}

static void q5_0_to_float(const void *vx, float *y, int64_t n)
{
    const block_q5_0 *x = vx;
    for (int64_t i = 0; i < n / QK5_0; i++, y += QK5_0) {
        const float d = F16(x[i].d);
        uint32_t qh;
        memcpy(&qh, x[i].qh, sizeof qh);
        for (int j = 0; j < QK5_0; j++)
            y[j] = (q5_value(x[i].qs, qh, j) - 16) * d;
    }
}

static void q5_1_to_float(const void *vx, float *y, int64_t n)
{
    const block_q5_1 *x = vx;
    for (int64_t i = 0; i < n / QK5_1; i++, y += QK5_1) {
        const float d = F16(x[i].d), m = F16(x[i].m);
        uint32_t qh;
        memcpy(&qh, x[i].qh, sizeof qh);
        for (int j = 0; j < QK5_1; j++)
            y[j] = q5_value(x[i].qs, qh, j) * d + m;
    }
}

static void iq4_nl_to_float(const void *vx, float *y, int64_t n)
{
    const block_iq4_nl *x = vx;
    for (int64_t i = 0; i < n / QK4_NL; i++, y += QK4_NL) {
        const float d = F16(x[i].d);
        for (int j = 0; j < QK4_NL / 2; j++) {
            y[j] = d * quant_iq4nl_values[x[i].qs[j] & 0x0f];
            y[j + QK4_NL / 2] = d * quant_iq4nl_values[x[i].qs[j] >> 4];
        }
    }
}

static void q8_0_to_float(const void *vx, float *y, int64_t n)
{
    const block_q8_0 *x = vx;
    for (int64_t i = 0; i < n / QK8_0; i++, y += QK8_0) {
        const float d = F16(x[i].d);
        for (int j = 0; j < QK8_0; j++)
            y[j] = x[i].qs[j] * d;
    }
}

static void q8_1_to_float(const void *vx, float *y, int64_t n)
{
    const block_q8_1 *x = vx;
    for (int64_t i = 0; i < n / QK8_1; i++, y += QK8_1) {
        const float d = F16(x[i].d);
        for (int j = 0; j < QK8_1; j++)
            y[j] = x[i].qs[j] * d;
    }
}

/* Nearest integer, ties to even, as cvtps2dq does in the default rounding
 * mode; the low byte of anything out of range (a NaN or an infinity), as
 * the SIMD quantizers keep it. */
static int act_nearest_even(float v)
{
    if (!(fabsf(v) < 2147483520.0f))
        return 0;
    return (int)lrintf(v);
}

/* ---- integer dots -------------------------------------------------------- *
 * Each block's integer dot is exact. Q4_0 and Q8_0 rows are one fma chain
 * over the blocks, sum = fma((float)sumi, dx * dy, sum): what llama.cpp's
 * repacked x86 kernels (q4_0_8x8) compute for every output, and what every
 * kvserve kernel for these types computes, whatever the ISA, layout or batch.
 * The other types scale as sumi * (dx * dy), the product the SIMD kernels
 * form, and differ from them only in the order of the float sum over blocks. */

/* Activations of every weight type whose vec_dot_type is Q8_0: ggml-cpu's
 * x86 quantize_row_q8_0 (and the q8_0 packing of its repacked kernels),
 * which llama.cpp runs on activations, not ggml's reference: d = amax / 127
 * stored as f16, and x * (127 / amax) rounded to nearest even instead of
 * x * (1 / d) rounded half away from zero. The two differ in last bits of
 * the multiplier and on ties; a value near a rounding midpoint then moves by
 * a whole Q8_0 step. With this rounding and the fma chain of the Q4_0 dots
 * below, tiny-gemma3 Q4_0 gives llama.cpp's logits within 1e-6 (5.6e-2 with
 * the reference rounding and separately rounded sums: tests/test_model_gemma.c);
 * MXFP4 embeddings (binary ratios, x * id exactly on k + 0.5) left llama.cpp's
 * greedy ids at token 30 with the reference rounding. */
void quant_q8_0_act_from_float_ref(const float *x, void *vy, int64_t n)
{
    block_q8_0 *y = vy;
    for (int64_t i = 0; i < n / QK8_0; i++, x += QK8_0) {
        float amax = 0;
        for (int j = 0; j < QK8_0; j++)
            amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        y[i].d = quant_f32_to_f16(amax / 127.0f);
        for (int j = 0; j < QK8_0; j++)
            y[i].qs[j] = (int8_t)act_nearest_even(x[j] * id);
    }
}

/* Activations of q4_1 and q5_1 (vec_dot_type Q8_1): ggml-cpu's x86
 * quantize_row_q8_1, as quant_q8_0_act_from_float_ref for Q8_0, with
 * s = f16(d * (float)sum of the rounded quants). */
void quant_q8_1_act_from_float_ref(const float *x, void *vy, int64_t n)
{
    block_q8_1 *y = vy;
    for (int64_t i = 0; i < n / QK8_1; i++, x += QK8_1) {
        float amax = 0;
        for (int j = 0; j < QK8_1; j++)
            amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
        const float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK8_1; j++) {
            y[i].qs[j] = (int8_t)act_nearest_even(x[j] * id);
            sum += y[i].qs[j];
        }
        y[i].d = quant_f32_to_f16(d);
        y[i].s = quant_f32_to_f16(d * (float)sum);
    }
}

void quant_vec_dot_q4_0_q8_0_ref(int n, float *s, const void *vx, const void *vy)
{
    const block_q4_0 *x = vx;
    const block_q8_0 *y = vy;
    float sum = 0;
    for (int i = 0; i < n / QK8_0; i++) {
        int sumi = 0;
        for (int j = 0; j < QK4_0 / 2; j++) {
            sumi += ((x[i].qs[j] & 0x0f) - 8) * y[i].qs[j];
            sumi += ((x[i].qs[j] >> 4) - 8) * y[i].qs[j + QK4_0 / 2];
        }
        sum = fmaf((float)sumi, F16(x[i].d) * F16(y[i].d), sum);
    }
    *s = sum;
}

void quant_vec_dot_q4_1_q8_1_ref(int n, float *s, const void *vx, const void *vy)
{
    const block_q4_1 *x = vx;
    const block_q8_1 *y = vy;
    float sum = 0;
    for (int i = 0; i < n / QK8_1; i++) {
        int sumi = 0;
        for (int j = 0; j < QK4_1 / 2; j++) {
            sumi += (x[i].qs[j] & 0x0f) * y[i].qs[j];
            sumi += (x[i].qs[j] >> 4) * y[i].qs[j + QK4_1 / 2];
        }
        sum += (float)sumi * (F16(x[i].d) * F16(y[i].d)) + F16(x[i].m) * F16(y[i].s);
    }
    *s = sum;
}

/* Lane l of a q5 block against a Q8 block: the exact sum over elements
 * 4l..4l+3 of (q5 level - offset) * y, what one dword of maddubs + madd (or
 * dpbusd) holds in ggml's x86 vec_dot. */
static void q5_lane_sums(const uint8_t *qs, const uint8_t qh_bytes[4], int offset, const int8_t *y,
                         int32_t lane[QUANT_Q5_LANES])
{
    uint32_t qh;
    memcpy(&qh, qh_bytes, sizeof qh);
    for (int l = 0; l < QUANT_Q5_LANES; l++) {
        int32_t sum = 0;
        for (int j = 4 * l; j < 4 * l + 4; j++)
            sum += (q5_value(qs, qh, j) - offset) * y[j];
        lane[l] = sum;
    }
}

/* llama.cpp's x86 order (quant_internal.h, "q5_0 and q5_1"): eight lane
 * accumulators, acc = fma(dx * dy, lane, acc) per block, hsum_float_8. */
void quant_vec_dot_q5_0_q8_0_ref(int n, float *s, const void *vx, const void *vy)
{
    const block_q5_0 *x = vx;
    const block_q8_0 *y = vy;
    float acc[QUANT_Q5_LANES] = {0};
    for (int i = 0; i < n / QK8_0; i++) {
        int32_t lane[QUANT_Q5_LANES];
        q5_lane_sums(x[i].qs, x[i].qh, 16, y[i].qs, lane);
        const float d = F16(x[i].d) * F16(y[i].d);
        for (int l = 0; l < QUANT_Q5_LANES; l++)
            acc[l] = fmaf(d, (float)lane[l], acc[l]);
    }
    *s = quant_lanes_hsum8(acc);
}

/* The same lanes with acc = fma(lane, dx * dy, acc), and the min terms
 * summs = fma(m_x, s_y, summs) in block order (ggml's x86 build contracts
 * its summs += m * s into an fma: vfmadd231ss in libggml-cpu-haswell/icelake),
 * added after the lanes' sum. */
void quant_vec_dot_q5_1_q8_1_ref(int n, float *s, const void *vx, const void *vy)
{
    const block_q5_1 *x = vx;
    const block_q8_1 *y = vy;
    float acc[QUANT_Q5_LANES] = {0}, summs = 0;
    for (int i = 0; i < n / QK8_1; i++) {
        int32_t lane[QUANT_Q5_LANES];
        q5_lane_sums(x[i].qs, x[i].qh, 0, y[i].qs, lane);
        summs = fmaf(F16(x[i].m), F16(y[i].s), summs);
        const float d = F16(x[i].d) * F16(y[i].d);
        for (int l = 0; l < QUANT_Q5_LANES; l++)
            acc[l] = fmaf((float)lane[l], d, acc[l]);
    }
    *s = quant_lanes_hsum8(acc) + summs;
}

/* One fused multiply-add per block, in block order: what llama.cpp's
 * repacked iq4_nl_8x8 kernels compute per row (iq4_mxfp4.h). */
void quant_vec_dot_iq4_nl_q8_0_ref(int n, float *s, const void *vx, const void *vy)
{
    const block_iq4_nl *x = vx;
    const block_q8_0 *y = vy;
    float sum = 0;
    for (int i = 0; i < n / QK8_0; i++) {
        int sumi = 0;
        for (int j = 0; j < QK4_NL / 2; j++) {
            sumi += quant_iq4nl_values[x[i].qs[j] & 0x0f] * y[i].qs[j];
            sumi += quant_iq4nl_values[x[i].qs[j] >> 4] * y[i].qs[j + QK4_NL / 2];
        }
        sum = fmaf((float)sumi, F16(x[i].d) * F16(y[i].d), sum);
    }
    *s = sum;
}

void quant_vec_dot_q8_0_q8_0_ref(int n, float *s, const void *vx, const void *vy)
{
    const block_q8_0 *x = vx;
    const block_q8_0 *y = vy;
    float sum = 0;
    for (int i = 0; i < n / QK8_0; i++) {
        int sumi = 0;
        for (int j = 0; j < QK8_0; j++)
            sumi += x[i].qs[j] * y[i].qs[j];
        sum = fmaf((float)sumi, F16(x[i].d) * F16(y[i].d), sum);
    }
    *s = sum;
}

/* ---- table --------------------------------------------------------------- */

static void set(struct quant_traits *t, quant_to_float_fn to, quant_from_float_fn from, quant_vec_dot_fn dot)
{
    t->to_float = to;
    t->from_float = from;
    t->vec_dot = dot;
}

void quant_ref_fill(struct quant_traits *t)
{
    set(&t[QUANT_F32], f32_to_float, f32_from_float, quant_vec_dot_f32_ref);
    set(&t[QUANT_F16], f16_to_float, f16_from_float, quant_vec_dot_f16_ref);
    set(&t[QUANT_BF16], bf16_to_float, bf16_from_float, quant_vec_dot_bf16_ref);
    set(&t[QUANT_Q4_0], q4_0_to_float, quant_q4_0_from_float_ref, quant_vec_dot_q4_0_q8_0_ref);
    set(&t[QUANT_Q4_1], q4_1_to_float, quant_q4_1_from_float_ref, quant_vec_dot_q4_1_q8_1_ref);
    set(&t[QUANT_Q5_0], q5_0_to_float, quant_q5_0_from_float_ref, quant_vec_dot_q5_0_q8_0_ref);
    set(&t[QUANT_Q5_1], q5_1_to_float, quant_q5_1_from_float_ref, quant_vec_dot_q5_1_q8_1_ref);
    set(&t[QUANT_Q8_0], q8_0_to_float, quant_q8_0_from_float_ref, quant_vec_dot_q8_0_q8_0_ref);
    set(&t[QUANT_Q8_1], q8_1_to_float, q8_1_from_float, NULL);
    set(&t[QUANT_IQ4_NL], iq4_nl_to_float, quant_iq4_nl_from_float_ref, quant_vec_dot_iq4_nl_q8_0_ref);
    set(&t[QUANT_IQ3_NL], iq3_nl_to_float, quant_iq3_nl_from_float_ref, NULL); /* KV only: no weight dot */
}
