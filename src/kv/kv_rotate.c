/* The Walsh-Hadamard rotation of K/V rows. Rows are then quantized by
 * quant's traits (ggml's reference quantizers, so a page of any block type holds the
 * bytes llama.cpp would store). */
#include <math.h>

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
