/* Vocabulary-wide reductions for the sampler, written so that the compiler
 * vectorizes them without -ffast-math: independent lanes of accumulators and
 * a branch-free exp. A 150k vocabulary costs tens of microseconds per token. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "sample/sample_internal.h"

#define LANES 16

/* exp(x) for x in [-87, 88]; 0 below (so -inf logits get exactly zero
 * weight). exp(x) = 2^n * exp(r) with n = round(x / ln2) and
 * |r| <= ln2 / 2, where a degree-6 Taylor polynomial is within ~2e-7. */
static inline float exp_lane(float x)
{
    /* ln2 split so that n * ln2_hi is exact (Cody-Waite): without FMA a
     * single-float ln2 loses ~5e-6 relative at |x| near 87 */
    const float ln2_hi = 0.693145751953125f, ln2_lo = 1.428606765330187e-06f;
    float xc = x > 88.0f ? 88.0f : x;
    xc = xc < -87.0f ? -87.0f : xc;
    float n = rintf(xc * 1.44269504089f);
    float r = (xc - n * ln2_hi) - n * ln2_lo;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    float y = p * scale;
    return x < -87.0f ? 0.0f : y;
}

float sample_expf(float x)
{
    return exp_lane(x);
}

/* Float bits mapped to integers that order like the floats, so the max
 * search runs on integer lanes (float max needs -ffast-math to vectorize). */
static inline int32_t order_key(float v)
{
    int32_t b;
    memcpy(&b, &v, sizeof b);
    return b >= 0 ? b : b ^ INT32_MAX;
}

/* NaN or +inf: an all-ones exponent that is not -inf. */
static inline int32_t is_bad(float v)
{
    int32_t b;
    memcpy(&b, &v, sizeof b);
    return (b & INT32_MAX) >= 0x7f800000 && b != (int32_t)0xff800000;
}

bool sample_max_index(const float *x, int32_t n, int32_t *index_out, float *max_out)
{
    int32_t key[LANES], idx[LANES], bad[LANES];
    for (int k = 0; k < LANES; k++) {
        key[k] = INT32_MIN;
        idx[k] = 0;
        bad[k] = 0;
    }
    int32_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++) {
            int32_t kv = order_key(x[i + k]);
            bad[k] |= is_bad(x[i + k]);
            idx[k] = kv > key[k] ? i + k : idx[k];
            key[k] = kv > key[k] ? kv : key[k];
        }
    int32_t best_key = INT32_MIN, best_idx = 0, any_bad = 0;
    for (int k = 0; k < LANES; k++) {
        any_bad |= bad[k];
        if (i > 0 && (key[k] > best_key || (key[k] == best_key && idx[k] < best_idx))) {
            best_key = key[k];
            best_idx = idx[k];
        }
    }
    for (int32_t j = i; j < n; j++) {
        int32_t kv = order_key(x[j]);
        any_bad |= is_bad(x[j]);
        if (j == 0 || kv > best_key) {
            best_key = kv;
            best_idx = j;
        }
    }
    *index_out = best_idx;
    *max_out = n > 0 ? x[best_idx] : -INFINITY;
    return !any_bad;
}

/* Float lanes vectorize; folding them into a double every CHUNK elements
 * keeps a 150k-term sum accurate to ~1e-7 relative. */
#define CHUNK 1024

double sample_sum_exp(const float *x, int32_t n, float shift, float scale)
{
    double sum = 0.0;
    int32_t i = 0;
    while (i + LANES <= n) {
        float acc[LANES] = {0};
        int32_t end = n - i > CHUNK ? i + CHUNK : n;
        for (; i + LANES <= end; i += LANES)
            for (int k = 0; k < LANES; k++)
                acc[k] += exp_lane((x[i + k] - shift) * scale);
        for (int k = 0; k < LANES; k++)
            sum += acc[k];
    }
    for (; i < n; i++)
        sum += exp_lane((x[i] - shift) * scale);
    return sum;
}

int32_t sample_argmax(const float *x, int32_t n)
{
    int32_t idx;
    float max;
    sample_max_index(x, n, &idx, &max);
    return idx;
}
