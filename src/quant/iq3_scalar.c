/* IQ3_XXS, IQ3_S, IQ2_S: scalar reference dequantizers and dot products
 * with Q8_K. The dequantizers compute ggml's float expressions in its order
 * (bit-exact with dequantize_row_*); the dot products are the lane-exact
 * twin of the SIMD kernels and of llama.cpp's x86 ones (iq3.h). */
#include <math.h>

#include "quant/iq3.h"

/* ==== unpack: signed values and per-16 integer scales ==================== */

static uint32_t load_u32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* 8 magnitudes of group bytes g, negated where bit j of signs is set. */
static void apply_signs(const uint8_t *g, uint8_t signs, int8_t *w, int count)
{
    for (int j = 0; j < count; j++)
        w[j] = (int8_t)((signs >> j) & 1 ? -(int)g[j] : (int)g[j]);
}

void quant_iq3_xxs_unpack(const block_iq3_xxs *b, int8_t w[QK_K], int16_t sc[QK_K / 16])
{
    for (int ib = 0; ib < QK_K / 32; ib++) {
        const uint32_t aux = load_u32(b->qs + QK_K / 4 + 4 * ib);
        const uint8_t *q = b->qs + 8 * ib;
        for (int l = 0; l < 4; l++) {
            uint8_t g[8];
            const uint32_t g1 = quant_iq3xxs_grid[q[2 * l]], g2 = quant_iq3xxs_grid[q[2 * l + 1]];
            memcpy(g, &g1, 4);
            memcpy(g + 4, &g2, 4);
            apply_signs(g, quant_iq2_ksigns[(aux >> (7 * l)) & 127], w + 32 * ib + 8 * l, 8);
        }
        sc[2 * ib] = sc[2 * ib + 1] = (int16_t)(2 * (aux >> 28) + 1);
    }
}

void quant_iq3_s_unpack(const block_iq3_s *b, int8_t w[QK_K], int16_t sc[QK_K / 16])
{
    for (int ib = 0; ib < QK_K / 32; ib++) {
        for (int k = 0; k < 8; k++) { /* group k: elements 4k..4k+3 */
            const int idx = b->qs[8 * ib + k] | (((b->qh[ib] >> k) & 1) << 8);
            uint8_t g[4];
            memcpy(g, &quant_iq3s_grid[idx], 4);
            const uint8_t signs = (uint8_t)(b->signs[4 * ib + k / 2] >> (4 * (k % 2)));
            apply_signs(g, signs, w + 32 * ib + 4 * k, 4);
        }
        const int ls = (b->scales[ib / 2] >> (4 * (ib % 2))) & 0xf;
        sc[2 * ib] = sc[2 * ib + 1] = (int16_t)(2 * ls + 1);
    }
}

void quant_iq2_s_unpack(const block_iq2_s *b, int8_t w[QK_K], int16_t sc[QK_K / 16])
{
    const uint8_t *signs = b->qs + QK_K / 8;
    for (int ib = 0; ib < QK_K / 32; ib++) {
        for (int l = 0; l < 4; l++) {
            const int idx = b->qs[4 * ib + l] | (((b->qh[ib] >> (2 * l)) & 3) << 8);
            uint8_t g[8];
            memcpy(g, &quant_iq2s_grid[idx], 8);
            apply_signs(g, signs[4 * ib + l], w + 32 * ib + 8 * l, 8);
        }
        sc[2 * ib] = (int16_t)(2 * (b->scales[ib] & 0xf) + 1);
        sc[2 * ib + 1] = (int16_t)(2 * (b->scales[ib] >> 4) + 1);
    }
}

/* ==== dequantize ========================================================= */
/* ggml multiplies db * grid * (+-1): the same bits as db * (float)(+-grid). */

void quant_dequantize_row_iq3_xxs(const void *vx, float *y, int64_t n)
{
    const block_iq3_xxs *x = vx;
    for (int64_t i = 0; i < n / QK_K; i++) {
        int8_t w[QK_K];
        int16_t sc[QK_K / 16];
        quant_iq3_xxs_unpack(&x[i], w, sc);
        const float d = kq_f16_to_f32(x[i].d);
        for (int ib = 0; ib < QK_K / 32; ib++) {
            const float db = d * (0.5f + (float)((sc[2 * ib] - 1) / 2)) * 0.5f;
            for (int j = 0; j < 32; j++) *y++ = db * (float)w[32 * ib + j];
        }
    }
}

void quant_dequantize_row_iq3_s(const void *vx, float *y, int64_t n)
{
    const block_iq3_s *x = vx;
    for (int64_t i = 0; i < n / QK_K; i++) {
        int8_t w[QK_K];
        int16_t sc[QK_K / 16];
        quant_iq3_s_unpack(&x[i], w, sc);
        const float d = kq_f16_to_f32(x[i].d);
        for (int ib = 0; ib < QK_K / 32; ib++) {
            const float db = d * (float)sc[2 * ib];
            for (int j = 0; j < 32; j++) *y++ = db * (float)w[32 * ib + j];
        }
    }
}

void quant_dequantize_row_iq2_s(const void *vx, float *y, int64_t n)
{
    const block_iq2_s *x = vx;
    for (int64_t i = 0; i < n / QK_K; i++) {
        int8_t w[QK_K];
        int16_t sc[QK_K / 16];
        quant_iq2_s_unpack(&x[i], w, sc);
        const float d = kq_f16_to_f32(x[i].d);
        for (int h = 0; h < QK_K / 16; h++) {
            const float db = d * (0.5f + (float)((sc[h] - 1) / 2)) * 0.25f;
            for (int j = 0; j < 16; j++) *y++ = db * (float)w[16 * h + j];
        }
    }
}

/* ==== vec_dot ============================================================ */

typedef void (*iq_unpack_fn)(const void *block, int8_t w[QK_K], int16_t sc[QK_K / 16]);

/* Lane k: sum over the 8 blocks of 32 of scale * dot(elements 4k..4k+3). */
static void block_lanes(const int8_t w[QK_K], const int16_t sc[QK_K / 16], const int8_t *q8, int32_t lane[8])
{
    for (int k = 0; k < 8; k++) lane[k] = 0;
    for (int ib = 0; ib < QK_K / 32; ib++)
        for (int k = 0; k < 8; k++) {
            int32_t dot = 0;
            for (int e = 32 * ib + 4 * k; e < 32 * ib + 4 * k + 4; e++) dot += w[e] * q8[e];
            lane[k] += sc[2 * ib + k / 4] * dot;
        }
}

static float dot_row(int n, const void *vx, size_t block_bytes, iq_unpack_fn unpack, const block_q8_K *y)
{
    float acc[8] = {0};
    for (int i = 0; i < n / QK_K; i++) {
        const uint8_t *blk = (const uint8_t *)vx + (size_t)i * block_bytes;
        kq_prefetch_block(blk, block_bytes);
        int8_t w[QK_K];
        int16_t sc[QK_K / 16];
        unpack(blk, w, sc);
        int32_t lane[8];
        block_lanes(w, sc, y[i].qs, lane);
        quant_f16 dh;
        memcpy(&dh, blk, sizeof dh); /* d leads every block */
        const float d = kq_f16_to_f32(dh) * y[i].d;
        for (int k = 0; k < 8; k++) acc[k] = fmaf(d, (float)lane[k], acc[k]);
    }
    return quant_iq2_hsum8(acc);
}

static void unpack_iq3_xxs(const void *b, int8_t w[QK_K], int16_t sc[QK_K / 16]) { quant_iq3_xxs_unpack(b, w, sc); }
static void unpack_iq3_s(const void *b, int8_t w[QK_K], int16_t sc[QK_K / 16]) { quant_iq3_s_unpack(b, w, sc); }
static void unpack_iq2_s(const void *b, int8_t w[QK_K], int16_t sc[QK_K / 16]) { quant_iq2_s_unpack(b, w, sc); }

void quant_vec_dot_iq3_xxs_q8_K_scalar(int n, float *s, const void *x, const void *y)
{
    *s = IQ3_XXS_DOT_SCALE * dot_row(n, x, sizeof(block_iq3_xxs), unpack_iq3_xxs, y);
}

void quant_vec_dot_iq3_s_q8_K_scalar(int n, float *s, const void *x, const void *y)
{
    *s = IQ3_S_DOT_SCALE * dot_row(n, x, sizeof(block_iq3_s), unpack_iq3_s, y);
}

void quant_vec_dot_iq2_s_q8_K_scalar(int n, float *s, const void *x, const void *y)
{
    *s = IQ2_S_DOT_SCALE * dot_row(n, x, sizeof(block_iq2_s), unpack_iq2_s, y);
}
