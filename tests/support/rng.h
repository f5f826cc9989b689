/* A small deterministic generator for test data (xorshift64), each test
 * file with its own state and seed, so its data never depends on another's.
 *
 *   static uint64_t rng = 0x2545F4914F6CDD1Dull;
 *   float x = ks_rng_normal(&rng);
 */
#ifndef KS_TEST_RNG_H
#define KS_TEST_RNG_H

#include <math.h>
#include <stdint.h>

static inline uint64_t ks_rng_next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* [0, 1) in steps of 2^-24 (exact as a float). */
static inline float ks_rng_uniform(uint64_t *s) { return (float)((ks_rng_next(s) >> 40) * (1.0 / 16777216.0)); }

/* Box-Muller, one value of the pair. */
static inline float ks_rng_normal(uint64_t *s)
{
    float u = ks_rng_uniform(s) + 1e-7f, v = ks_rng_uniform(s);
    return sqrtf(-2.0f * logf(u)) * cosf(6.2831853f * v);
}

#endif
