/* k-quants: scalar reference dequantizers and Qn_K . Q8_K dot products.
 * These define the semantics; the AVX2/AVX-512 kernels are checked
 * against them. Element order inside a super-block follows ggml exactly. */
#include "quant/kq_internal.h"

/* ==== dequantize ========================================================= */

void quant_dequantize_row_q2_K(const void *vx, float *y, int64_t n)
{
    const block_q2_K *x = vx;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = kq_f16_to_f32(x[i].d), dmin = kq_f16_to_f32(x[i].dmin);
        const uint8_t *q = x[i].qs;
        int is = 0;
        for (int half = 0; half < QK_K / 128; half++, q += 32) {
            for (int shift = 0; shift < 8; shift += 2) {
                for (int g = 0; g < 2; g++) { /* two groups of 16 per shift */
                    const uint8_t sc = x[i].scales[is++];
                    const float dl = d * (sc & 0xF), ml = dmin * (sc >> 4);
                    for (int l = 0; l < 16; l++)
                        *y++ = dl * ((q[16 * g + l] >> shift) & 3) - ml;
                }
            }
        }
    }
}

void quant_dequantize_row_q3_K(const void *vx, float *y, int64_t n)
{
    const block_q3_K *x = vx;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = kq_f16_to_f32(x[i].d);
        const uint8_t *q = x[i].qs, *hm = x[i].hmask;
        uint8_t m = 1;
        int is = 0;
        for (int half = 0; half < QK_K / 128; half++, q += 32) {
            for (int shift = 0; shift < 8; shift += 2, m = (uint8_t)(m << 1)) {
                for (int g = 0; g < 2; g++) {
                    const float dl = d * kq_q3_scale(x[i].scales, is++);
                    for (int l = 16 * g; l < 16 * g + 16; l++)
                        *y++ = dl * (((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4));
                }
            }
        }
    }
}

void quant_dequantize_row_q4_K(const void *vx, float *y, int64_t n)
{
    const block_q4_K *x = vx;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = kq_f16_to_f32(x[i].d), dmin = kq_f16_to_f32(x[i].dmin);
        const uint8_t *q = x[i].qs;
        for (int j = 0; j < QK_K / 64; j++, q += 32) {
            uint8_t sc, m;
            kq_get_scale_min_k4(2 * j, x[i].scales, &sc, &m);
            const float d1 = d * sc, m1 = dmin * m;
            kq_get_scale_min_k4(2 * j + 1, x[i].scales, &sc, &m);
            const float d2 = d * sc, m2 = dmin * m;
            for (int l = 0; l < 32; l++) *y++ = d1 * (q[l] & 0xF) - m1;
            for (int l = 0; l < 32; l++) *y++ = d2 * (q[l] >> 4) - m2;
        }
    }
}

void quant_dequantize_row_q5_K(const void *vx, float *y, int64_t n)
{
    const block_q5_K *x = vx;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = kq_f16_to_f32(x[i].d), dmin = kq_f16_to_f32(x[i].dmin);
        const uint8_t *ql = x[i].qs, *qh = x[i].qh;
        uint8_t u1 = 1, u2 = 2;
        for (int j = 0; j < QK_K / 64; j++, ql += 32) {
            uint8_t sc, m;
            kq_get_scale_min_k4(2 * j, x[i].scales, &sc, &m);
            const float d1 = d * sc, m1 = dmin * m;
            kq_get_scale_min_k4(2 * j + 1, x[i].scales, &sc, &m);
            const float d2 = d * sc, m2 = dmin * m;
            for (int l = 0; l < 32; l++) *y++ = d1 * ((ql[l] & 0xF) + ((qh[l] & u1) ? 16 : 0)) - m1;
            for (int l = 0; l < 32; l++) *y++ = d2 * ((ql[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) - m2;
            u1 = (uint8_t)(u1 << 2);
            u2 = (uint8_t)(u2 << 2);
        }
    }
}

/* Q6_K: element l of each 128-half takes its low 4 bits from ql and its top
 * 2 bits from qh; the four quarters of a half share ql/qh bytes. */
static inline int q6_value(const uint8_t *ql, const uint8_t *qh, int e)
{
    const int quarter = e / 32, l = e % 32;
    const int lo = (ql[l + 32 * (quarter & 1)] >> (4 * (quarter >> 1))) & 0xF;
    const int hi = (qh[l] >> (2 * quarter)) & 3;
    return (lo | (hi << 4)) - 32;
}

void quant_dequantize_row_q6_K(const void *vx, float *y, int64_t n)
{
    const block_q6_K *x = vx;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = kq_f16_to_f32(x[i].d);
        for (int half = 0; half < QK_K / 128; half++) {
            const uint8_t *ql = x[i].ql + 64 * half, *qh = x[i].qh + 32 * half;
            const int8_t *sc = x[i].scales + 8 * half;
            for (int e = 0; e < 128; e++)
                *y++ = d * sc[e / 16] * q6_value(ql, qh, e);
        }
    }
}

void quant_dequantize_row_q8_K(const void *vx, float *y, int64_t n)
{
    const block_q8_K *x = vx;
    for (int64_t i = 0; i < n / QK_K; i++)
        for (int l = 0; l < QK_K; l++) *y++ = x[i].d * x[i].qs[l];
}

/* ==== vec_dot ============================================================ */
/* Each kernel unpacks a block into its 256 integer quants (and per-16 or
 * per-32 scales) and takes exact integer sums.
 *
 * Q3_K, Q5_K and Q6_K add them up as llama.cpp does on x86 (ggml-cpu's AVX2
 * vec_dot, which its AVX-512 builds run too): eight int32 lanes per block,
 * lane c holding scale * q * q8 over the elements e with (e % 32) / 4 == c
 * (Q3_K's offset applied per element, Q6_K's as 32 * scale * bsums of the
 * two 16-element groups 2c and 2c + 1 taken out of lane c), each lane turned
 * into a float and fused into its own accumulator, acc[c] = fma(d, lane, acc[c]),
 * the 8 accumulators added at the end as (a0+a4 + a2+a6) + (a1+a5 + a3+a7).
 * Q5_K's mins go into a separate float sum, one multiply-add per block.
 *
 * Q2_K and Q4_K follow the repacked 8-row gemv/gemm kernels llama.cpp runs
 * them with on x86 (repack.cpp, q2_K_8x8 / q4_K_8x8): per block the exact
 * integer sums isum = sum(scale * q * q8) and msum = sum(min * bsums), two
 * fused chains acc = fma(isum, d_x * d_y, acc), accm = fma(msum, dmin_x * d_y,
 * accm), and acc - accm at the end. */

/* The 8 lanes of one block: q the signed quants, sc the scale of each group
 * of `per` consecutive quants (16 or 32). */
static void kq_lane_sums(const int8_t q[QK_K], const int32_t *sc, int per, const int8_t *q8, int32_t lane[8])
{
    for (int c = 0; c < 8; c++) {
        int32_t sum = 0;
        for (int m = 0; m < QK_K / 32; m++)
            for (int i = 0; i < 4; i++) {
                const int e = 32 * m + 4 * c + i;
                sum += sc[e / per] * q[e] * q8[e];
            }
        lane[c] = sum;
    }
}

static void kq_lanes_fma(float acc[8], float d, const int32_t lane[8])
{
    for (int c = 0; c < 8; c++) acc[c] = fmaf(d, (float)lane[c], acc[c]);
}

static float quant_kq_lanes_hsum(const float acc[8])
{
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

static void unpack_q2_K(const block_q2_K *b, uint8_t q[QK_K])
{
    for (int half = 0; half < 2; half++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++)
                q[128 * half + 32 * s + l] = (b->qs[32 * half + l] >> (2 * s)) & 3;
}

void quant_kq_q2_K_sums(const block_q2_K *x, const block_q8_K *y, int32_t *isum, int32_t *msum)
{
    uint8_t q[QK_K];
    unpack_q2_K(x, q);
    *isum = *msum = 0;
    for (int g = 0; g < QK_K / 16; g++) {
        int32_t dot = 0;
        for (int l = 16 * g; l < 16 * g + 16; l++) dot += q[l] * y->qs[l];
        *isum += (x->scales[g] & 0xF) * dot;
        *msum += (x->scales[g] >> 4) * y->bsums[g];
    }
}

void quant_vec_dot_q2_K_q8_K_scalar(int n, float *s, const void *vx, const void *vy)
{
    const block_q2_K *x = vx;
    const block_q8_K *y = vy;
    float acc = 0, accm = 0;
    for (int i = 0; i < n / QK_K; i++) {
        kq_prefetch_block(&x[i], sizeof x[i]);
        int32_t isum, msum;
        quant_kq_q2_K_sums(&x[i], &y[i], &isum, &msum);
        kq_chains_add(&acc, &accm, isum, msum, x[i].d, x[i].dmin, y[i].d);
    }
    *s = acc - accm;
}

/* Q3_K quants with the high bit applied: values in [-4, 3]. */
static void unpack_q3_K(const block_q3_K *b, int8_t q[QK_K])
{
    for (int c = 0; c < QK_K / 32; c++) { /* 32 quants: 2-bit field c%4 of byte row c/4, hmask bit c */
        const uint8_t *qs = b->qs + 32 * (c / 4);
        for (int l = 0; l < 32; l++)
            q[32 * c + l] = (int8_t)(((qs[l] >> (2 * (c % 4))) & 3) - (((b->hmask[l] >> c) & 1) ? 0 : 4));
    }
}

void quant_kq_q3_K_lanes(const block_q3_K *x, const block_q8_K *y, int32_t lane[8])
{
    int8_t q[QK_K];
    unpack_q3_K(x, q);
    int32_t sc[16];
    for (int g = 0; g < 16; g++) sc[g] = kq_q3_scale(x->scales, g);
    kq_lane_sums(q, sc, 16, y->qs, lane);
}

void quant_vec_dot_q3_K_q8_K_scalar(int n, float *s, const void *vx, const void *vy)
{
    const block_q3_K *x = vx;
    const block_q8_K *y = vy;
    float acc[8] = {0};
    for (int i = 0; i < n / QK_K; i++) {
        kq_prefetch_block(&x[i], sizeof x[i]);
        int32_t lane[8];
        quant_kq_q3_K_lanes(&x[i], &y[i], lane);
        kq_lanes_fma(acc, y[i].d * kq_f16_to_f32(x[i].d), lane);
    }
    *s = quant_kq_lanes_hsum(acc);
}

void quant_kq_q4_K_sums(const block_q4_K *x, const block_q8_K *y, int32_t *isum, int32_t *msum)
{
    uint8_t q[QK_K];
    for (int j = 0; j < QK_K / 64; j++)
        for (int l = 0; l < 32; l++) {
            q[64 * j + l] = x->qs[32 * j + l] & 0xF;
            q[64 * j + 32 + l] = x->qs[32 * j + l] >> 4;
        }
    *isum = *msum = 0;
    for (int j = 0; j < QK_K / 32; j++) {
        uint8_t sc, m;
        kq_get_scale_min_k4(j, x->scales, &sc, &m);
        int32_t dot = 0;
        for (int l = 32 * j; l < 32 * j + 32; l++) dot += q[l] * y->qs[l];
        *isum += sc * dot;
        *msum += m * (y->bsums[2 * j] + y->bsums[2 * j + 1]);
    }
}

void quant_vec_dot_q4_K_q8_K_scalar(int n, float *s, const void *vx, const void *vy)
{
    const block_q4_K *x = vx;
    const block_q8_K *y = vy;
    float acc = 0, accm = 0;
    for (int i = 0; i < n / QK_K; i++) {
        kq_prefetch_block(&x[i], sizeof x[i]);
        int32_t isum, msum;
        quant_kq_q4_K_sums(&x[i], &y[i], &isum, &msum);
        kq_chains_add(&acc, &accm, isum, msum, x[i].d, x[i].dmin, y[i].d);
    }
    *s = acc - accm;
}

void quant_kq_q5_K_lanes(const block_q5_K *x, const block_q8_K *y, int32_t lane[8], int32_t *mins)
{
    int8_t q[QK_K];
    for (int j = 0; j < QK_K / 64; j++)
        for (int l = 0; l < 32; l++) {
            const uint8_t h = x->qh[l];
            q[64 * j + l] = (int8_t)((x->qs[32 * j + l] & 0xF) | (((h >> (2 * j)) & 1) << 4));
            q[64 * j + 32 + l] = (int8_t)((x->qs[32 * j + l] >> 4) | (((h >> (2 * j + 1)) & 1) << 4));
        }
    int32_t sc[8];
    *mins = 0;
    for (int j = 0; j < QK_K / 32; j++) {
        uint8_t scale, m;
        kq_get_scale_min_k4(j, x->scales, &scale, &m);
        sc[j] = scale;
        *mins += m * (y->bsums[2 * j] + y->bsums[2 * j + 1]);
    }
    kq_lane_sums(q, sc, 32, y->qs, lane);
}

/* Q5_K: mins as ggml's x86 kernel takes them, summs += (-y.d * dmin) * sum(min * bsums) per block. */
void quant_vec_dot_q5_K_q8_K_scalar(int n, float *s, const void *vx, const void *vy)
{
    const block_q5_K *x = vx;
    const block_q8_K *y = vy;
    float acc[8] = {0}, summs = 0;
    for (int i = 0; i < n / QK_K; i++) {
        kq_prefetch_block(&x[i], sizeof x[i]);
        int32_t lane[8], mins;
        quant_kq_q5_K_lanes(&x[i], &y[i], lane, &mins);
        kq_lanes_fma(acc, y[i].d * kq_f16_to_f32(x[i].d), lane);
        summs = fmaf(-y[i].d * kq_f16_to_f32(x[i].dmin), (float)mins, summs);
    }
    *s = quant_kq_lanes_hsum(acc) + summs;
}

/* Q6_K: the quants as u = q + 32, the offset out of each lane through bsums. */
void quant_kq_q6_K_lanes(const block_q6_K *x, const block_q8_K *y, int32_t lane[8])
{
    int8_t q[QK_K];
    for (int half = 0; half < 2; half++) {
        const uint8_t *ql = x->ql + 64 * half, *qh = x->qh + 32 * half;
        int8_t *qq = q + 128 * half;
        for (int l = 0; l < 32; l++) {
            qq[l] = (int8_t)((ql[l] & 0xF) | ((qh[l] & 3) << 4));
            qq[l + 32] = (int8_t)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4));
            qq[l + 64] = (int8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
            qq[l + 96] = (int8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
        }
    }
    int32_t sc[16];
    for (int g = 0; g < 16; g++) sc[g] = x->scales[g];
    kq_lane_sums(q, sc, 16, y->qs, lane);
    for (int c = 0; c < 8; c++)
        lane[c] -= 32 * (sc[2 * c] * y->bsums[2 * c] + sc[2 * c + 1] * y->bsums[2 * c + 1]);
}

void quant_vec_dot_q6_K_q8_K_scalar(int n, float *s, const void *vx, const void *vy)
{
    const block_q6_K *x = vx;
    const block_q8_K *y = vy;
    float acc[8] = {0};
    for (int i = 0; i < n / QK_K; i++) {
        kq_prefetch_block(&x[i], sizeof x[i]);
        int32_t lane[8];
        quant_kq_q6_K_lanes(&x[i], &y[i], lane);
        kq_lanes_fma(acc, y[i].d * kq_f16_to_f32(x[i].d), lane);
    }
    *s = quant_kq_lanes_hsum(acc);
}
