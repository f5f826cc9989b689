/* Scalar reference kernels: the obviously correct twin of the SIMD ones. */
#include <math.h>

#include "attn/attn_internal.h"

static void score_f32(const uint8_t *k, int n_tok, const struct attn_rows *rows)
{
    int d = rows->dim;
    for (int t = 0; t < n_tok; t++) {
        const float *kt = (const float *)ATTN_ROW(rows, k, t, (size_t)d * sizeof(float));
        for (int r = 0; r < rows->n; r++) {
            const float *q = rows->q + (size_t)r * d;
            float s = 0.0f;
            for (int i = 0; i < d; i++)
                s += q[i] * kt[i];
            rows->s[(size_t)r * rows->stride + t] = s;
        }
    }
}

static void score_f16(const uint8_t *k, int n_tok, const struct attn_rows *rows)
{
    int d = rows->dim;
    for (int t = 0; t < n_tok; t++) {
        const quant_f16 *kt = (const quant_f16 *)ATTN_ROW(rows, k, t, (size_t)d * sizeof(quant_f16));
        for (int r = 0; r < rows->n; r++) {
            const float *q = rows->q + (size_t)r * d;
            float s = 0.0f;
            for (int i = 0; i < d; i++)
                s += q[i] * quant_f16_to_f32(kt[i]);
            rows->s[(size_t)r * rows->stride + t] = s;
        }
    }
}

static void score_q8_0(const uint8_t *k, int n_tok, const struct attn_rows *rows)
{
    int nb = rows->dim / QK8_0;
    for (int t = 0; t < n_tok; t++) {
        const block_q8_0 *kt = (const block_q8_0 *)ATTN_ROW(rows, k, t, (size_t)nb * sizeof(block_q8_0));
        for (int r = 0; r < rows->n; r++) {
            const block_q8_0 *q = rows->q8 + (size_t)r * nb;
            float s = 0.0f;
            for (int b = 0; b < nb; b++) {
                int32_t dot = 0;
                for (int i = 0; i < QK8_0; i++)
                    dot += kt[b].qs[i] * q[b].qs[i];
                s += quant_f16_to_f32(kt[b].d) * rows->q8d[(size_t)r * nb + b] * (float)dot;
            }
            rows->s[(size_t)r * rows->stride + t] = s;
        }
    }
}

static void score_q4_0(const uint8_t *k, int n_tok, const struct attn_rows *rows)
{
    int nb = rows->dim / QK4_0;
    for (int t = 0; t < n_tok; t++) {
        const block_q4_0 *kt = (const block_q4_0 *)ATTN_ROW(rows, k, t, (size_t)nb * sizeof(block_q4_0));
        for (int r = 0; r < rows->n; r++) {
            const block_q8_0 *q = rows->q8 + (size_t)r * nb;
            float s = 0.0f;
            for (int b = 0; b < nb; b++) {
                int32_t dot = 0;
                for (int i = 0; i < QK4_0 / 2; i++)
                    dot += ((kt[b].qs[i] & 0x0F) - 8) * q[b].qs[i] + ((kt[b].qs[i] >> 4) - 8) * q[b].qs[i + QK4_0 / 2];
                s += quant_f16_to_f32(kt[b].d) * rows->q8d[(size_t)r * nb + b] * (float)dot;
            }
            rows->s[(size_t)r * rows->stride + t] = s;
        }
    }
}

static void accum_f32(const uint8_t *v, int n_tok, const struct attn_rows *rows)
{
    int d = rows->dim;
    for (int t = 0; t < n_tok; t++) {
        const float *vt = (const float *)ATTN_ROW(rows, v, t, (size_t)d * sizeof(float));
        for (int r = 0; r < rows->n; r++) {
            float p = rows->s[(size_t)r * rows->stride + t];
            float *acc = rows->acc + (size_t)r * d;
            if (p != 0.0f)
                for (int i = 0; i < d; i++)
                    acc[i] += p * vt[i];
        }
    }
}

static void accum_f16(const uint8_t *v, int n_tok, const struct attn_rows *rows)
{
    int d = rows->dim;
    for (int t = 0; t < n_tok; t++) {
        const quant_f16 *vt = (const quant_f16 *)ATTN_ROW(rows, v, t, (size_t)d * sizeof(quant_f16));
        for (int r = 0; r < rows->n; r++) {
            float p = rows->s[(size_t)r * rows->stride + t];
            float *acc = rows->acc + (size_t)r * d;
            if (p != 0.0f)
                for (int i = 0; i < d; i++)
                    acc[i] += p * quant_f16_to_f32(vt[i]);
        }
    }
}

static void accum_q8_0(const uint8_t *v, int n_tok, const struct attn_rows *rows)
{
    int d = rows->dim, nb = d / QK8_0;
    for (int t = 0; t < n_tok; t++) {
        const block_q8_0 *vt = (const block_q8_0 *)ATTN_ROW(rows, v, t, (size_t)nb * sizeof(block_q8_0));
        for (int r = 0; r < rows->n; r++) {
            float p = rows->s[(size_t)r * rows->stride + t];
            float *acc = rows->acc + (size_t)r * d;
            for (int b = 0; p != 0.0f && b < nb; b++) {
                float pd = p * quant_f16_to_f32(vt[b].d);
                for (int i = 0; i < QK8_0; i++)
                    acc[b * QK8_0 + i] += pd * vt[b].qs[i];
            }
        }
    }
}

static void accum_q4_0(const uint8_t *v, int n_tok, const struct attn_rows *rows)
{
    int d = rows->dim, nb = d / QK4_0;
    for (int t = 0; t < n_tok; t++) {
        const block_q4_0 *vt = (const block_q4_0 *)ATTN_ROW(rows, v, t, (size_t)nb * sizeof(block_q4_0));
        for (int r = 0; r < rows->n; r++) {
            float p = rows->s[(size_t)r * rows->stride + t];
            float *acc = rows->acc + (size_t)r * d;
            for (int b = 0; p != 0.0f && b < nb; b++) {
                float pd = p * quant_f16_to_f32(vt[b].d);
                for (int i = 0; i < QK4_0 / 2; i++) {
                    acc[b * QK4_0 + i] += pd * ((vt[b].qs[i] & 0x0F) - 8);
                    acc[b * QK4_0 + i + QK4_0 / 2] += pd * ((vt[b].qs[i] >> 4) - 8);
                }
            }
        }
    }
}

/* The other types (bf16, q4_1, q5_0, q5_1, iq4_nl, iq3_nl) are scored against the f32
 * query: each row is dequantized a chunk of DECODE values at a time by
 * quant's reference dequantizer, the obviously correct decoding. */
enum { DECODE = 32 };

static int decode_chunk(enum quant_type t, const uint8_t *row, int c, int d, float *out)
{
    int n = d - c < DECODE ? d - c : DECODE;
    quant_traits_scalar(t)->to_float(row + quant_row_size(t, c), out, n);
    return n;
}

static void score_decoded(enum quant_type type, const uint8_t *k, int n_tok, const struct attn_rows *rows)
{
    int d = rows->dim;
    size_t rb = quant_row_size(type, d);
    float x[DECODE];
    for (int t = 0; t < n_tok; t++) {
        const uint8_t *kt = ATTN_ROW(rows, k, t, rb);
        for (int r = 0; r < rows->n; r++) {
            const float *q = rows->q + (size_t)r * d;
            float s = 0.0f;
            for (int c = 0; c < d;) {
                int n = decode_chunk(type, kt, c, d, x);
                for (int i = 0; i < n; i++)
                    s += q[c + i] * x[i];
                c += n;
            }
            rows->s[(size_t)r * rows->stride + t] = s;
        }
    }
}

static void accum_decoded(enum quant_type type, const uint8_t *v, int n_tok, const struct attn_rows *rows)
{
    int d = rows->dim;
    size_t rb = quant_row_size(type, d);
    float x[DECODE];
    for (int t = 0; t < n_tok; t++) {
        const uint8_t *vt = ATTN_ROW(rows, v, t, rb);
        for (int c = 0; c < d;) {
            int n = decode_chunk(type, vt, c, d, x);
            for (int r = 0; r < rows->n; r++) {
                float p = rows->s[(size_t)r * rows->stride + t], *acc = rows->acc + (size_t)r * d + c;
                for (int i = 0; p != 0.0f && i < n; i++)
                    acc[i] += p * x[i];
            }
            c += n;
        }
    }
}

#define DECODED_KERNELS(name, type)                                                                          \
    static void score_##name(const uint8_t *k, int n_tok, const struct attn_rows *rows)                     \
    {                                                                                                        \
        score_decoded(type, k, n_tok, rows);                                                                 \
    }                                                                                                        \
    static void accum_##name(const uint8_t *v, int n_tok, const struct attn_rows *rows)                     \
    {                                                                                                        \
        accum_decoded(type, v, n_tok, rows);                                                                 \
    }
DECODED_KERNELS(bf16, QUANT_BF16)
DECODED_KERNELS(q5_1, QUANT_Q5_1)
DECODED_KERNELS(q5_0, QUANT_Q5_0)
DECODED_KERNELS(q4_1, QUANT_Q4_1)
DECODED_KERNELS(iq4_nl, QUANT_IQ4_NL)
DECODED_KERNELS(iq3_nl, QUANT_IQ3_NL)

/* roundf (halves away from zero) for |v| < 2^31, without a libm call: the
 * query is quantized on every step, and roundf/fmaxf calls showed up at
 * 7% of a short-context decode. */
static inline float round_away(float v)
{
    float t = (float)(int32_t)v, f = v - t; /* exact: t and v share sign and exponent range */
    return f >= 0.5f ? t + 1.0f : f <= -0.5f ? t - 1.0f : t;
}

void attn_quantize_q8(const float *x, block_q8_0 *y, float *yd, int n)
{
    for (int b = 0; b < n / QK8_0; b++, x += QK8_0) {
        float amax = 0.0f;
        for (int j = 0; j < QK8_0; j++) {
            float a = fabsf(x[j]);
            amax = a > amax ? a : amax;
        }
        float d = amax / 127.0f;
        quant_f16 dh = quant_f32_to_f16(d);
        float dr = quant_f16_to_f32(dh); /* quantize against the scale the kernels will use */
        float id = dr != 0.0f ? 1.0f / dr : 0.0f;
        y[b].d = dh;
        yd[b] = dr;
        for (int j = 0; j < QK8_0; j++) {
            float v = round_away(x[j] * id);
            y[b].qs[j] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
        }
    }
}

static float exp_sum(float *s, int n, float mx)
{
    float sum = 0.0f;
    for (int t = 0; t < n; t++)
        sum += (s[t] = expf(s[t] - mx));
    return sum;
}

void attn_softmax_with(const struct attn_rows *rows, int page_start, int n_tok, attn_exp_sum_fn exp_sum)
{
    for (int r = 0; r < rows->n; r++) {
        float *s = rows->s + (size_t)r * rows->stride;
        int lo, hi;
        attn_visible(rows, r, page_start, n_tok, &lo, &hi);
        float mx = rows->m[r];
        for (int t = lo; t < hi; t++)
            mx = s[t] > mx ? s[t] : mx;
        for (int t = 0; t < lo; t++)
            s[t] = 0.0f;
        for (int t = hi; t < n_tok; t++)
            s[t] = 0.0f;
        if (hi == lo)
            continue;
        float corr = expf(rows->m[r] - mx);
        if (corr != 1.0f) {
            float *acc = rows->acc + (size_t)r * rows->dim;
            for (int e = 0; e < rows->dim; e++)
                acc[e] *= corr;
        }
        rows->l[r] = rows->l[r] * corr + exp_sum(s + lo, hi - lo, mx);
        rows->m[r] = mx;
    }
}

static void softmax(const struct attn_rows *rows, int page_start, int n_tok)
{
    attn_softmax_with(rows, page_start, n_tok, exp_sum);
}

static const struct attn_kernels SCALAR = {
    "scalar",
    {[KV_INDEX_F32] = score_f32, [KV_INDEX_F16] = score_f16, [KV_INDEX_BF16] = score_bf16,
     [KV_INDEX_Q8_0] = score_q8_0, [KV_INDEX_Q5_1] = score_q5_1, [KV_INDEX_Q5_0] = score_q5_0,
     [KV_INDEX_Q4_1] = score_q4_1, [KV_INDEX_IQ4_NL] = score_iq4_nl, [KV_INDEX_Q4_0] = score_q4_0,
     [KV_INDEX_IQ3_NL] = score_iq3_nl},
    {[KV_INDEX_F32] = accum_f32, [KV_INDEX_F16] = accum_f16, [KV_INDEX_BF16] = accum_bf16,
     [KV_INDEX_Q8_0] = accum_q8_0, [KV_INDEX_Q5_1] = accum_q5_1, [KV_INDEX_Q5_0] = accum_q5_0,
     [KV_INDEX_Q4_1] = accum_q4_1, [KV_INDEX_IQ4_NL] = accum_iq4_nl, [KV_INDEX_Q4_0] = accum_q4_0,
     [KV_INDEX_IQ3_NL] = accum_iq3_nl},
    exp_sum,
    softmax,
};

const struct attn_kernels *attn_kernels_scalar(void) { return &SCALAR; }
