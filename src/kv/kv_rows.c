/* Rows of the KV cache: rotation and the scalar (de)quantizers of the page
 * types. q8_0 and q4_0 follow ggml's reference quantizers exactly, so a
 * q8_0/q4_0 page holds the same bytes llama.cpp would store. */
#include <math.h>
#include <string.h>

#include "kv/kv_internal.h"

static int rotation_block(int n)
{
    return n & -n; /* largest power of two dividing n */
}

void kv_rotate(float *x, int n)
{
    int b = rotation_block(n);
    float norm = 1.0f / sqrtf((float)b);
    for (int base = 0; base < n; base += b) {
        float *y = x + base;
        for (int h = 1; h < b; h <<= 1)
            for (int i = 0; i < b; i += h << 1)
                for (int j = i; j < i + h; j++) {
                    float a = y[j], c = y[j + h];
                    y[j] = a + c;
                    y[j + h] = a - c;
                }
        for (int i = 0; i < b; i++)
            y[i] *= norm;
    }
}

static void store_q8_0(const float *x, block_q8_0 *y, int n)
{
    for (int b = 0; b < n / QK8_0; b++, x += QK8_0) {
        float amax = 0.0f;
        for (int j = 0; j < QK8_0; j++)
            amax = fmaxf(amax, fabsf(x[j]));
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[b].d = quant_f32_to_f16(d);
        for (int j = 0; j < QK8_0; j++)
            y[b].qs[j] = (int8_t)roundf(x[j] * id);
    }
}

static void store_q4_0(const float *x, block_q4_0 *y, int n)
{
    for (int b = 0; b < n / QK4_0; b++, x += QK4_0) {
        float amax = 0.0f, max = 0.0f; /* max: the value of largest magnitude, with its sign */
        for (int j = 0; j < QK4_0; j++)
            if (fabsf(x[j]) > amax) {
                amax = fabsf(x[j]);
                max = x[j];
            }
        float d = max / -8.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[b].d = quant_f32_to_f16(d);
        for (int j = 0; j < QK4_0 / 2; j++) {
            int lo = (int)(x[j] * id + 8.5f), hi = (int)(x[j + QK4_0 / 2] * id + 8.5f);
            lo = lo < 15 ? lo : 15;
            hi = hi < 15 ? hi : 15;
            y[b].qs[j] = (uint8_t)(lo | (hi << 4));
        }
    }
}

void kv_row_store(enum quant_type t, const float *x, void *row, int n)
{
    switch (t) {
    case QUANT_F32: memcpy(row, x, (size_t)n * sizeof(float)); break;
    case QUANT_F16: {
        quant_f16 *h = row;
        for (int i = 0; i < n; i++)
            h[i] = quant_f32_to_f16(x[i]);
        break;
    }
    case QUANT_Q8_0: store_q8_0(x, row, n); break;
    case QUANT_Q4_0: store_q4_0(x, row, n); break;
    default: break;
    }
}

void kv_row_load(enum quant_type t, const void *row, float *x, int n)
{
    switch (t) {
    case QUANT_F32: memcpy(x, row, (size_t)n * sizeof(float)); break;
    case QUANT_F16: {
        const quant_f16 *h = row;
        for (int i = 0; i < n; i++)
            x[i] = quant_f16_to_f32(h[i]);
        break;
    }
    case QUANT_Q8_0: {
        const block_q8_0 *b = row;
        for (int i = 0; i < n / QK8_0; i++) {
            float d = quant_f16_to_f32(b[i].d);
            for (int j = 0; j < QK8_0; j++)
                x[i * QK8_0 + j] = d * b[i].qs[j];
        }
        break;
    }
    case QUANT_Q4_0: {
        const block_q4_0 *b = row;
        for (int i = 0; i < n / QK4_0; i++) {
            float d = quant_f16_to_f32(b[i].d);
            for (int j = 0; j < QK4_0 / 2; j++) {
                x[i * QK4_0 + j] = d * ((b[i].qs[j] & 0x0F) - 8);
                x[i * QK4_0 + j + QK4_0 / 2] = d * ((b[i].qs[j] >> 4) - 8);
            }
        }
        break;
    }
    default: break;
    }
}
