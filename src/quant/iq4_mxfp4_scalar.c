/* IQ4_XS and MXFP4: scalar reference dequantizers, quantizers and vec_dots
 * (IQ4_NL's live in quant_ref.c, from when it was a KV cache type only), and
 * the traits entries of all three. Element order and float operations follow
 * ggml's dequantize_row_*, quantize_* and generic vec_dots. */
#include <math.h>

#include "quant/iq4_mxfp4.h"
#include "quant/quant_internal.h"

/* ggml-common.h's kvalues_mxfp4: E2M1's 0, 0.5, 1, 1.5, 2, 3, 4, 6, doubled, then negated. */
const int8_t quant_mxfp4_values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* ==== dequantize ========================================================= */

void quant_dequantize_row_iq4_xs(const void *vx, float *y, int64_t n)
{
    const block_iq4_xs *x = vx;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = kq_f16_to_f32(x[i].d);
        const uint8_t *qs = x[i].qs;
        for (int ib = 0; ib < QK_K / 32; ib++, qs += 16, y += 32) {
            const float dl = d * (float)(quant_iq4xs_scale(&x[i], ib) - 32);
            for (int j = 0; j < 16; j++) {
                y[j] = dl * quant_iq4nl_values[qs[j] & 0xf];
                y[j + 16] = dl * quant_iq4nl_values[qs[j] >> 4];
            }
        }
    }
}

void quant_dequantize_row_mxfp4(const void *vx, float *y, int64_t n)
{
    const block_mxfp4 *x = vx;
    for (int64_t i = 0; i < n / QK_MXFP4; i++, y += QK_MXFP4) {
        const float d = quant_e8m0_to_f32_half(x[i].e);
        for (int j = 0; j < QK_MXFP4 / 2; j++) {
            y[j] = (float)quant_mxfp4_values[x[i].qs[j] & 0xf] * d;
            y[j + QK_MXFP4 / 2] = (float)quant_mxfp4_values[x[i].qs[j] >> 4] * d;
        }
    }
}

/* ==== quantize =========================================================== */

/* One super-block: each block's scale as IQ4_NL's search finds it, then d =
 * -(the scale of largest magnitude) / 32, 6-bit block scales round(s / d)
 * clamped to [-32, 31], and every value again to the level nearest x / (d *
 * l) with d unrounded, as ggml's quantize_row_iq4_nl_impl does. */
static void iq4_xs_super_block(const float *x, block_iq4_xs *y)
{
    float scales[QK_K / 32], max_scale = 0, amax_scale = 0;
    for (int ib = 0; ib < QK_K / 32; ib++) {
        scales[ib] = quant_iq4nl_block_scale(x + 32 * ib);
        if (fabsf(scales[ib]) > amax_scale) {
            amax_scale = fabsf(scales[ib]);
            max_scale = scales[ib];
        }
    }
    const float d = -max_scale / 32, id = d ? 1 / d : 0.0f;
    y->d = kq_f32_to_f16(d);
    y->scales_h = 0;
    memset(y->scales_l, 0, sizeof y->scales_l);
    for (int ib = 0; ib < QK_K / 32; ib++) {
        int l = kq_nearest_int(id * scales[ib]);
        l = l < -32 ? -32 : l > 31 ? 31 : l;
        const float dl = d * (float)l, idl = dl ? 1 / dl : 0.0f;
        const float *xb = x + 32 * ib;
        uint8_t *qs = y->qs + 16 * ib;
        for (int j = 0; j < 16; j++)
            qs[j] = (uint8_t)(quant_iq4nl_nearest(idl * xb[j]) | quant_iq4nl_nearest(idl * xb[j + 16]) << 4);
        l += 32;
        y->scales_l[ib / 2] |= (uint8_t)((l & 0xf) << 4 * (ib % 2));
        y->scales_h |= (uint16_t)((l >> 4) << 2 * ib);
    }
}

void quant_quantize_row_iq4_xs(const float *x, void *vy, int64_t n)
{
    block_iq4_xs *y = vy;
    for (int64_t i = 0; i < n / QK_K; i++)
        iq4_xs_super_block(x + i * QK_K, &y[i]);
}

/* The first level nearest v / d: err is |value * d - v|, as ggml's best_index_mxfp4 measures it. */
static int mxfp4_nearest(float v, float d)
{
    int best = 0;
    float best_err = fabsf((float)quant_mxfp4_values[0] * d - v);
    for (int i = 1; i < 16; i++) {
        float err = fabsf((float)quant_mxfp4_values[i] * d - v);
        if (err < best_err) {
            best = i;
            best_err = err;
        }
    }
    return best;
}

/* ggml's e = floor(log2(amax)) - 2 + 127: amax / 2^(e - 127) lies in [4, 8),
 * near the top level (6). ggml converts a float out of uint8_t's range
 * (undefined behaviour); here amax below 2^-125, zero or NaN gives e = 0 and
 * amax from 2^130 (inf) e = 254. */
static uint8_t mxfp4_exponent(float amax)
{
    if (!(amax > 0.0f))
        return 0;
    float e = floorf(log2f(amax)) - 2 + 127;
    return e < 0 ? 0 : e > 254 ? 254 : (uint8_t)e;
}

void quant_quantize_row_mxfp4(const float *x, void *vy, int64_t n)
{
    block_mxfp4 *y = vy;
    for (int64_t i = 0; i < n / QK_MXFP4; i++, x += QK_MXFP4) {
        float amax = 0;
        for (int j = 0; j < QK_MXFP4; j++)
            amax = amax < fabsf(x[j]) ? fabsf(x[j]) : amax;
        y[i].e = mxfp4_exponent(amax);
        const float d = quant_e8m0_to_f32_half(y[i].e);
        for (int j = 0; j < QK_MXFP4 / 2; j++)
            y[i].qs[j] = (uint8_t)(mxfp4_nearest(x[j], d) | mxfp4_nearest(x[j + QK_MXFP4 / 2], d) << 4);
    }
}

/* ==== activations ========================================================== */

/* ==== vec_dot ============================================================== */

/* Block ib of 32 (values through lut) . 32 int8 of q8. */
static int lut_dot32(const uint8_t *qs, const int8_t *lut, const int8_t *q8)
{
    int sumi1 = 0, sumi2 = 0;
    for (int j = 0; j < 16; j++) {
        sumi1 += q8[j] * lut[qs[j] & 0xf];
        sumi2 += q8[j + 16] * lut[qs[j] >> 4];
    }
    return sumi1 + sumi2;
}

/* ggml's generic order: a float multiply and add per block of 32. */
void quant_vec_dot_iq4_xs_q8_K_scalar(int n, float *s, const void *vx, const void *vy)
{
    const block_iq4_xs *x = vx;
    const block_q8_K *y = vy;
    float sumf = 0;
    for (int i = 0; i < n / QK_K; i++) {
        const float d4d8 = kq_f16_to_f32(x[i].d) * y[i].d;
        for (int ib = 0; ib < QK_K / 32; ib++) {
            const float dl = d4d8 * (float)(quant_iq4xs_scale(&x[i], ib) - 32);
            sumf += dl * (float)lut_dot32(x[i].qs + 16 * ib, quant_iq4nl_values, y[i].qs + 32 * ib);
        }
    }
    *s = sumf;
}

void quant_iq4_xs_lanes(const block_iq4_xs *x, const block_q8_K *y, int32_t lane[8])
{
    for (int c = 0; c < 8; c++)
        lane[c] = 0;
    for (int ib = 0; ib < QK_K / 32; ib++) {
        const int ls = quant_iq4xs_scale(x, ib) - 32;
        const uint8_t *qs = x->qs + 16 * ib;
        const int8_t *q8 = y->qs + 32 * ib;
        for (int c = 0; c < 4; c++) {
            int lo = 0, hi = 0;
            for (int i = 0; i < 4; i++) {
                lo += quant_iq4nl_values[qs[4 * c + i] & 0xf] * q8[4 * c + i];
                hi += quant_iq4nl_values[qs[4 * c + i] >> 4] * q8[16 + 4 * c + i];
            }
            lane[c] += ls * lo;
            lane[c + 4] += ls * hi;
        }
    }
}

void quant_vec_dot_iq4_xs_q8_K_lanes(int n, float *s, const void *vx, const void *vy)
{
    const block_iq4_xs *x = vx;
    const block_q8_K *y = vy;
    float acc[8] = {0};
    for (int i = 0; i < n / QK_K; i++) {
        int32_t lane[8];
        quant_iq4_xs_lanes(&x[i], &y[i], lane);
        const float d = kq_f16_to_f32(x[i].d) * y[i].d;
        for (int c = 0; c < 8; c++)
            acc[c] = fmaf(d, (float)lane[c], acc[c]);
    }
    *s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

/* One fused multiply-add per block, in block order: what llama.cpp's
 * repacked mxfp4_8x8 kernels compute per row (iq4_mxfp4.h). */
void quant_vec_dot_mxfp4_q8_0_scalar(int n, float *s, const void *vx, const void *vy)
{
    const block_mxfp4 *x = vx;
    const block_q8_0 *y = vy;
    float sumf = 0;
    for (int i = 0; i < n / QK_MXFP4; i++) {
        const float d = quant_e8m0_to_f32_half(x[i].e) * kq_f16_to_f32(y[i].d);
        sumf = fmaf((float)lut_dot32(x[i].qs, quant_mxfp4_values, y[i].qs), d, sumf);
    }
    *s = sumf;
}

/* ==== traits ================================================================ */

#if defined(IQ4_HAVE_AVX512)
#define IQ4_BEST(t) quant_vec_dot_##t##_avx512
#elif defined(IQ4_HAVE_AVX2)
#define IQ4_BEST(t) quant_vec_dot_##t##_avx2
#else
#define IQ4_BEST(t) NULL
#endif

static void set(struct quant_traits *t, quant_to_float_fn to, quant_from_float_fn from, quant_vec_dot_fn dot)
{
    t->to_float = to;
    t->from_float = from;
    t->vec_dot = dot;
}

void quant_iq4_fill(struct quant_traits *best, struct quant_traits *scalar)
{
    set(&scalar[QUANT_IQ4_XS], quant_dequantize_row_iq4_xs, quant_quantize_row_iq4_xs,
        quant_vec_dot_iq4_xs_q8_K_scalar);
    set(&scalar[QUANT_MXFP4], quant_dequantize_row_mxfp4, quant_quantize_row_mxfp4, quant_vec_dot_mxfp4_q8_0_scalar);
    best[QUANT_IQ4_XS] = scalar[QUANT_IQ4_XS];
    best[QUANT_MXFP4] = scalar[QUANT_MXFP4];
    quant_vec_dot_fn nl = IQ4_BEST(iq4_nl_q8_0), xs = IQ4_BEST(iq4_xs_q8_K), fp4 = IQ4_BEST(mxfp4_q8_0);
    if (nl)
        best[QUANT_IQ4_NL].vec_dot = nl;
    if (xs)
        best[QUANT_IQ4_XS].vec_dot = xs;
    if (fp4)
        best[QUANT_MXFP4].vec_dot = fp4;
}

quant_kq_dot_multi_fn quant_iq4_dot_multi(enum quant_type t)
{
#if defined(IQ4_HAVE_AVX512)
#define IQ4_MULTI(x) quant_vec_dot_##x##_multi_avx512
#elif defined(IQ4_HAVE_AVX2)
#define IQ4_MULTI(x) quant_vec_dot_##x##_multi_avx2
#endif
#if defined(IQ4_MULTI)
    switch (t) {
    case QUANT_IQ4_NL: return IQ4_MULTI(iq4_nl_q8_0);
    case QUANT_IQ4_XS: return IQ4_MULTI(iq4_xs_q8_K);
    case QUANT_MXFP4: return IQ4_MULTI(mxfp4_q8_0);
    default: return NULL;
    }
#else
    (void)t;
    return NULL;
#endif
}
