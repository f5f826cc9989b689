/* The Walsh-Hadamard rotation of K/V rows. Rows are then quantized by
 * quant's traits (ggml's reference quantizers, so a page of any block type holds the
 * bytes llama.cpp would store).
 *
 * kv_rotate runs on every K/V row the cache stores and on every query and
 * output row of attention, so it has SIMD versions. They do the scalar
 * twin's additions and subtractions in its level order (within a vector,
 * lane i of level h takes x[i] + x[i ^ h] without bit h and x[i ^ h] - x[i]
 * with it), so every version gives kv_rotate_ref's bits. */
#include <math.h>

#include "kv/kv_internal.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

static int rotation_block(int n)
{
    return n & -n; /* largest power of two dividing n */
}

void kv_rotate_ref(float *x, int n)
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

#if defined(__AVX512F__)
#define ROT_LANES 16

/* Levels h = 1, 2, 4, 8 of every 16-float vector. */
static void rotate_in_vectors(float *x, int n)
{
    for (int c = 0; c < n; c += ROT_LANES) {
        __m512 v = _mm512_loadu_ps(x + c), s;
        s = _mm512_permute_ps(v, 0xB1);
        v = _mm512_mask_blend_ps(0xAAAA, _mm512_add_ps(v, s), _mm512_sub_ps(s, v));
        s = _mm512_permute_ps(v, 0x4E);
        v = _mm512_mask_blend_ps(0xCCCC, _mm512_add_ps(v, s), _mm512_sub_ps(s, v));
        s = _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1));
        v = _mm512_mask_blend_ps(0xF0F0, _mm512_add_ps(v, s), _mm512_sub_ps(s, v));
        s = _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2));
        v = _mm512_mask_blend_ps(0xFF00, _mm512_add_ps(v, s), _mm512_sub_ps(s, v));
        _mm512_storeu_ps(x + c, v);
    }
}

static void butterfly(float *a, float *c)
{
    __m512 u = _mm512_loadu_ps(a), w = _mm512_loadu_ps(c);
    _mm512_storeu_ps(a, _mm512_add_ps(u, w));
    _mm512_storeu_ps(c, _mm512_sub_ps(u, w));
}

static void scale(float *x, float s) { _mm512_storeu_ps(x, _mm512_mul_ps(_mm512_loadu_ps(x), _mm512_set1_ps(s))); }
#elif defined(__AVX2__)
#define ROT_LANES 8

/* Levels h = 1, 2, 4 of every 8-float vector. */
static void rotate_in_vectors(float *x, int n)
{
    for (int c = 0; c < n; c += ROT_LANES) {
        __m256 v = _mm256_loadu_ps(x + c), s;
        s = _mm256_permute_ps(v, 0xB1);
        v = _mm256_blend_ps(_mm256_add_ps(v, s), _mm256_sub_ps(s, v), 0xAA);
        s = _mm256_permute_ps(v, 0x4E);
        v = _mm256_blend_ps(_mm256_add_ps(v, s), _mm256_sub_ps(s, v), 0xCC);
        s = _mm256_permute2f128_ps(v, v, 0x01);
        v = _mm256_blend_ps(_mm256_add_ps(v, s), _mm256_sub_ps(s, v), 0xF0);
        _mm256_storeu_ps(x + c, v);
    }
}

static void butterfly(float *a, float *c)
{
    __m256 u = _mm256_loadu_ps(a), w = _mm256_loadu_ps(c);
    _mm256_storeu_ps(a, _mm256_add_ps(u, w));
    _mm256_storeu_ps(c, _mm256_sub_ps(u, w));
}

static void scale(float *x, float s) { _mm256_storeu_ps(x, _mm256_mul_ps(_mm256_loadu_ps(x), _mm256_set1_ps(s))); }
#endif

void kv_rotate(float *x, int n)
{
#if defined(ROT_LANES)
    int b = rotation_block(n);
    if (b >= ROT_LANES) {
        float norm = 1.0f / sqrtf((float)b);
        rotate_in_vectors(x, n);
        for (int base = 0; base < n; base += b) {
            float *y = x + base;
            for (int h = ROT_LANES; h < b; h <<= 1)
                for (int i = 0; i < b; i += h << 1)
                    for (int j = i; j < i + h; j += ROT_LANES)
                        butterfly(y + j, y + j + h);
            for (int i = 0; i < b; i += ROT_LANES)
                scale(y + i, norm);
        }
        return;
    }
#endif
    kv_rotate_ref(x, n);
}
