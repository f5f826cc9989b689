/* k-quants: reference quantizers. They follow ggml's quantize_row_*_ref
 * algorithms (what llama-quantize runs without an importance matrix):
 *   - Q2_K/Q4_K/Q5_K: per sub-block, a weighted least-squares search for
 *     scale and min over a sweep of candidate scales ("qkx"), then the
 *     sub-block scales/mins are themselves quantized to 4 or 6 bits against
 *     the super-block's f16 d/dmin, and the quants recomputed with them.
 *   - Q3_K/Q6_K: symmetric, per-16 signed scales ("qx"), 6/8-bit scales.
 *   - Q8_K: plain absmax for activations, plus bsums. */
#include "quant/kq_internal.h"

#define GROUP_MAX_EPS 1e-15f

static inline int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* *max: the value of x[0..n) of the largest magnitude (the first of equals).
 * False, with L zeroed, when every magnitude is below GROUP_MAX_EPS: the
 * group quantizes to 0. */
static bool group_max(const float *x, int n, int8_t *L, float *max)
{
    float amax = 0;
    *max = 0;
    for (int i = 0; i < n; i++) {
        const float ax = fabsf(x[i]);
        if (ax > amax) {
            amax = ax;
            *max = x[i];
        }
    }
    if (amax >= GROUP_MAX_EPS)
        return true;
    memset(L, 0, (size_t)n);
    return false;
}

/* Symmetric quants in [-nmax, nmax) with weights x^2; tries 18 scales
 * around nmax/max and keeps the one with the best weighted fit.
 * L gets quants biased by nmax. Returns the scale. */
static float make_qx_quants(int n, int nmax, const float *x, int8_t *L)
{
    float max;
    if (!group_max(x, n, L, &max))
        return 0.f;
    float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        const int l = clampi(kq_nearest_int(iscale * x[i]), -nmax, nmax - 1);
        L[i] = (int8_t)(l + nmax);
        const float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    float scale = suml2 ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; i++) {
            const int l = clampi(kq_nearest_int(iscale * x[i]), -nmax, nmax - 1);
            const float w = x[i] * x[i];
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; i++)
                L[i] = (int8_t)(nmax + clampi(kq_nearest_int(iscale * x[i]), -nmax, nmax - 1));
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

/* Q3_K's symmetric fit: start from round(x * nmax/max), then move single
 * quants while that improves the weighted (x^2) least-squares fit. */
static float make_q3_quants(int n, int nmax, const float *x, int8_t *L)
{
    float max;
    if (!group_max(x, n, L, &max))
        return 0.f;
    const float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        const int l = clampi(kq_nearest_int(iscale * x[i]), -nmax, nmax - 1);
        L[i] = (int8_t)l;
        const float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    for (int itry = 0; itry < 5; ++itry) {
        int n_changed = 0;
        for (int i = 0; i < n; ++i) {
            const float w = x[i] * x[i];
            float slx = sumlx - w * x[i] * L[i];
            if (slx > 0) {
                float sl2 = suml2 - w * L[i] * L[i];
                const int new_l = clampi(kq_nearest_int(x[i] * sl2 / slx), -nmax, nmax - 1);
                if (new_l != L[i]) {
                    slx += w * x[i] * new_l;
                    sl2 += w * new_l * new_l;
                    if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = (int8_t)new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        ++n_changed;
                    }
                }
            }
        }
        if (!n_changed) break;
    }
    for (int i = 0; i < n; ++i) L[i] = (int8_t)(L[i] + nmax);
    return suml2 > 0 ? sumlx / suml2 : 0.f;
}

/* Asymmetric quants x ~ scale * L - min, L in [0, nmax], min >= 0 stored in
 * *the_min. Weighted least squares over candidate inverse scales
 * (rmin + rdelta*is + nmax) / (max - min), is = 0..nstep. use_mad picks
 * absolute instead of squared error as the figure of merit. */
static float make_qkx2_quants(int n, int nmax, const float *x, const float *weights, uint8_t *L,
                              float *the_min, uint8_t *Laux, float rmin, float rdelta, int nstep,
                              bool use_mad)
{
    float min = x[0], max = x[0];
    float sum_w = weights[0], sum_x = sum_w * x[0];
    for (int i = 1; i < n; ++i) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        const float w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if (min > 0) min = 0;
    if (max == min) {
        memset(L, 0, (size_t)n);
        *the_min = -min;
        return 0.f;
    }
    float iscale = nmax / (max - min);
    float scale = 1 / iscale;
    float best_err = 0;
    for (int i = 0; i < n; ++i) {
        L[i] = (uint8_t)clampi(kq_nearest_int(iscale * (x[i] - min)), 0, nmax);
        const float diff = scale * L[i] + min - x[i];
        best_err += weights[i] * (use_mad ? fabsf(diff) : diff * diff);
    }
    for (int is = 0; is <= nstep; ++is) {
        iscale = (rmin + rdelta * is + nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; ++i) {
            const int l = clampi(kq_nearest_int(iscale * (x[i] - min)), 0, nmax);
            Laux[i] = (uint8_t)l;
            const float w = weights[i];
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * x[i];
        }
        const float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) {
                this_min = 0;
                this_scale = sum_xl / sum_l2;
            }
            float err = 0;
            for (int i = 0; i < n; ++i) {
                const float diff = this_scale * Laux[i] + this_min - x[i];
                err += weights[i] * (use_mad ? fabsf(diff) : diff * diff);
            }
            if (err < best_err) {
                memcpy(L, Laux, (size_t)n);
                best_err = err;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *the_min = -min;
    return scale;
}

/* Pack four 2-bit quants per byte: byte l of each 128-half holds elements
 * l, l+32, l+64, l+96 at bits 0, 2, 4, 6. */
static void pack_2bit(const uint8_t *L, uint8_t *qs)
{
    for (int j = 0; j < QK_K; j += 128)
        for (int l = 0; l < 32; ++l)
            qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
}

/* ==== Q2_K =============================================================== */

void quant_quantize_row_q2_K(const float *x, void *vy, int64_t n)
{
    block_q2_K *y = vy;
    const float q4scale = 15.f;
    for (int64_t i = 0; i < n / QK_K; i++, x += QK_K) {
        uint8_t L[QK_K], Laux[16];
        float weights[16], mins[QK_K / 16], scales[QK_K / 16];
        float max_scale = 0, max_min = 0;
        for (int j = 0; j < QK_K / 16; ++j) {
            for (int l = 0; l < 16; ++l) weights[l] = fabsf(x[16 * j + l]);
            scales[j] = make_qkx2_quants(16, 3, x + 16 * j, weights, L + 16 * j, &mins[j], Laux,
                                         -0.5f, 0.1f, 15, true);
            if (scales[j] > max_scale) max_scale = scales[j];
            if (mins[j] > max_min) max_min = mins[j];
        }
        if (max_scale > 0) {
            const float iscale = q4scale / max_scale;
            for (int j = 0; j < QK_K / 16; ++j)
                y[i].scales[j] = (uint8_t)clampi(kq_nearest_int(iscale * scales[j]), 0, 15);
            y[i].d = kq_f32_to_f16(max_scale / q4scale);
        } else {
            memset(y[i].scales, 0, sizeof y[i].scales);
            y[i].d = kq_f32_to_f16(0.f);
        }
        if (max_min > 0) {
            const float iscale = q4scale / max_min;
            for (int j = 0; j < QK_K / 16; ++j)
                y[i].scales[j] |= (uint8_t)(clampi(kq_nearest_int(iscale * mins[j]), 0, 15) << 4);
            y[i].dmin = kq_f32_to_f16(max_min / q4scale);
        } else {
            y[i].dmin = kq_f32_to_f16(0.f);
        }
        for (int j = 0; j < QK_K / 16; ++j) {
            const float d = kq_f16_to_f32(y[i].d) * (y[i].scales[j] & 0xF);
            if (!d) continue;
            const float dm = kq_f16_to_f32(y[i].dmin) * (y[i].scales[j] >> 4);
            for (int ii = 0; ii < 16; ++ii)
                L[16 * j + ii] = (uint8_t)clampi(kq_nearest_int((x[16 * j + ii] + dm) / d), 0, 3);
        }
        pack_2bit(L, y[i].qs);
    }
}

/* Each group of 16 of a super-block quantized alone by make (levels into L,
 * scale into scales[]): the scale of the largest magnitude, *amax that
 * magnitude (the first one wins a tie, as in ggml). */
static float group_scales16(const float *x, int nmax, float (*make)(int, int, const float *, int8_t *), int8_t *L,
                            float *scales, float *amax)
{
    float max_scale = 0;
    *amax = 0;
    for (int j = 0; j < QK_K / 16; ++j) {
        scales[j] = make(16, nmax, x + 16 * j, L + 16 * j);
        const float scale = fabsf(scales[j]);
        if (scale > *amax) {
            *amax = scale;
            max_scale = scales[j];
        }
    }
    return max_scale;
}

/* ==== Q3_K =============================================================== */

void quant_quantize_row_q3_K(const float *x, void *vy, int64_t n)
{
    block_q3_K *y = vy;
    for (int64_t i = 0; i < n / QK_K; i++, x += QK_K) {
        int8_t L[QK_K];
        float scales[QK_K / 16];
        float amax;
        const float max_scale = group_scales16(x, 4, make_q3_quants, L, scales, &amax);
        memset(y[i].scales, 0, sizeof y[i].scales);
        if (max_scale) {
            const float iscale = -32.f / max_scale;
            for (int j = 0; j < QK_K / 16; ++j) {
                int l = clampi(kq_nearest_int(iscale * scales[j]), -32, 31) + 32;
                if (j < 8) y[i].scales[j] = (uint8_t)(l & 0xF);
                else y[i].scales[j - 8] |= (uint8_t)((l & 0xF) << 4);
                l >>= 4;
                y[i].scales[j % 4 + 8] |= (uint8_t)(l << (2 * (j / 4)));
            }
            y[i].d = kq_f32_to_f16(1 / iscale);
        } else {
            y[i].d = kq_f32_to_f16(0.f);
        }
        for (int j = 0; j < QK_K / 16; ++j) {
            const float d = kq_f16_to_f32(y[i].d) * kq_q3_scale(y[i].scales, j);
            if (!d) continue;
            for (int ii = 0; ii < 16; ++ii)
                L[16 * j + ii] = (int8_t)(clampi(kq_nearest_int(x[16 * j + ii] / d), -4, 3) + 4);
        }
        /* bit 2 of each quant goes to hmask: element e -> byte e%32, bit e/32 */
        memset(y[i].hmask, 0, sizeof y[i].hmask);
        uint8_t L2[QK_K];
        for (int e = 0; e < QK_K; ++e) {
            if (L[e] > 3) y[i].hmask[e % 32] |= (uint8_t)(1 << (e / 32));
            L2[e] = (uint8_t)(L[e] & 3);
        }
        pack_2bit(L2, y[i].qs);
    }
}

/* ==== Q4_K / Q5_K ======================================================== */

/* Shared by Q4_K and Q5_K: fit 8 sub-blocks of 32 with quants in
 * [0, nmax], store d/dmin and the 12-byte packed 6-bit scales/mins, and
 * return the final quants in L (computed against the rounded scales). */
static void quantize_k4_block(const float *x, int nmax, float rmin, int nstep, quant_f16 *out_d,
                              quant_f16 *out_dmin, uint8_t packed[K_SCALE_SIZE], uint8_t L[QK_K])
{
    uint8_t Laux[32];
    float weights[32], mins[QK_K / 32], scales[QK_K / 32];
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < QK_K / 32; ++j) {
        float sum_x2 = 0;
        for (int l = 0; l < 32; ++l) sum_x2 += x[32 * j + l] * x[32 * j + l];
        const float av_x = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; ++l) weights[l] = av_x + fabsf(x[32 * j + l]);
        scales[j] = make_qkx2_quants(32, nmax, x + 32 * j, weights, L + 32 * j, &mins[j], Laux,
                                     rmin, 0.1f, nstep, false);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    memset(packed, 0, K_SCALE_SIZE);
    for (int j = 0; j < QK_K / 32; ++j) {
        const uint8_t ls = (uint8_t)clampi(kq_nearest_int(inv_scale * scales[j]), 0, 63);
        const uint8_t lm = (uint8_t)clampi(kq_nearest_int(inv_min * mins[j]), 0, 63);
        if (j < 4) {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
            packed[j - 4] |= (uint8_t)((ls >> 4) << 6);
            packed[j] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    *out_d = kq_f32_to_f16(max_scale / 63.f);
    *out_dmin = kq_f32_to_f16(max_min / 63.f);
    for (int j = 0; j < QK_K / 32; ++j) {
        uint8_t sc, m;
        kq_get_scale_min_k4(j, packed, &sc, &m);
        const float d = kq_f16_to_f32(*out_d) * sc;
        if (!d) continue;
        const float dm = kq_f16_to_f32(*out_dmin) * m;
        for (int ii = 0; ii < 32; ++ii)
            L[32 * j + ii] = (uint8_t)clampi(kq_nearest_int((x[32 * j + ii] + dm) / d), 0, nmax);
    }
}

void quant_quantize_row_q4_K(const float *x, void *vy, int64_t n)
{
    block_q4_K *y = vy;
    for (int64_t i = 0; i < n / QK_K; i++, x += QK_K) {
        uint8_t L[QK_K];
        quantize_k4_block(x, 15, -1.f, 20, &y[i].d, &y[i].dmin, y[i].scales, L);
        uint8_t *q = y[i].qs;
        for (int j = 0; j < QK_K; j += 64, q += 32)
            for (int l = 0; l < 32; ++l) q[l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
    }
}

void quant_quantize_row_q5_K(const float *x, void *vy, int64_t n)
{
    block_q5_K *y = vy;
    for (int64_t i = 0; i < n / QK_K; i++, x += QK_K) {
        uint8_t L[QK_K];
        quantize_k4_block(x, 31, -0.5f, 15, &y[i].d, &y[i].dmin, y[i].scales, L);
        uint8_t *ql = y[i].qs, *qh = y[i].qh;
        memset(qh, 0, QK_K / 8);
        uint8_t m1 = 1, m2 = 2;
        for (int j = 0; j < QK_K; j += 64, ql += 32) {
            for (int l = 0; l < 32; ++l) {
                int l1 = L[j + l], l2 = L[j + l + 32];
                if (l1 > 15) { l1 -= 16; qh[l] |= m1; }
                if (l2 > 15) { l2 -= 16; qh[l] |= m2; }
                ql[l] = (uint8_t)(l1 | (l2 << 4));
            }
            m1 = (uint8_t)(m1 << 2);
            m2 = (uint8_t)(m2 << 2);
        }
    }
}

/* ==== Q6_K =============================================================== */

void quant_quantize_row_q6_K(const float *x, void *vy, int64_t n)
{
    block_q6_K *y = vy;
    for (int64_t i = 0; i < n / QK_K; i++, x += QK_K) {
        int8_t L[QK_K];
        float scales[QK_K / 16];
        float max_abs_scale;
        const float max_scale = group_scales16(x, 32, make_qx_quants, L, scales, &max_abs_scale);
        if (max_abs_scale < GROUP_MAX_EPS) {
            memset(&y[i], 0, sizeof y[i]);
            continue;
        }
        const float iscale = -128.f / max_scale;
        y[i].d = kq_f32_to_f16(1 / iscale);
        for (int ib = 0; ib < QK_K / 16; ++ib)
            y[i].scales[ib] = (int8_t)clampi(kq_nearest_int(iscale * scales[ib]), -128, 127);
        for (int j = 0; j < QK_K / 16; ++j) {
            const float d = kq_f16_to_f32(y[i].d) * y[i].scales[j];
            if (!d) continue;
            for (int ii = 0; ii < 16; ++ii)
                L[16 * j + ii] = (int8_t)(clampi(kq_nearest_int(x[16 * j + ii] / d), -32, 31) + 32);
        }
        uint8_t *ql = y[i].ql, *qh = y[i].qh;
        for (int j = 0; j < QK_K; j += 128, ql += 64, qh += 32) {
            for (int l = 0; l < 32; ++l) {
                const uint8_t q1 = L[j + l] & 0xF, q2 = L[j + l + 32] & 0xF;
                const uint8_t q3 = L[j + l + 64] & 0xF, q4 = L[j + l + 96] & 0xF;
                ql[l] = (uint8_t)(q1 | (q3 << 4));
                ql[l + 32] = (uint8_t)(q2 | (q4 << 4));
                qh[l] = (uint8_t)((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) |
                                  ((L[j + l + 64] >> 4) << 4) | ((L[j + l + 96] >> 4) << 6));
            }
        }
    }
}

/* ==== Q8_K =============================================================== */

void quant_quantize_row_q8_K(const float *x, void *vy, int64_t n)
{
    block_q8_K *y = vy;
    for (int64_t i = 0; i < n / QK_K; i++, x += QK_K) {
        float max = 0, amax = 0;
        for (int j = 0; j < QK_K; ++j) {
            const float ax = fabsf(x[j]);
            if (ax > amax) { amax = ax; max = x[j]; }
        }
        if (!amax) {
            memset(&y[i], 0, sizeof y[i]);
            continue;
        }
        const float iscale = -127.f / max;
        for (int j = 0; j < QK_K; ++j) {
            const int v = kq_nearest_int(iscale * x[j]);
            y[i].qs[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int j = 0; j < QK_K / 16; ++j) {
            int sum = 0;
            for (int l = 0; l < 16; ++l) sum += y[i].qs[16 * j + l];
            y[i].bsums[j] = (int16_t)sum;
        }
        y[i].d = 1 / iscale;
    }
}
