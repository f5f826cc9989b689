/* vmath_simd: the SIMD loads and sums that the kernels of several modules share
 * (header only; a leaf like vmath.h: it knows no module's types). Each is
 * defined only when the including file is compiled for its ISA. Their scalar
 * twins are quant_f16_to_f32 / quant_bf16_to_f32, which the kernels' tests
 * compare against. */
#ifndef KS_VMATH_SIMD_H
#define KS_VMATH_SIMD_H

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX2__) && defined(__F16C__)
/* 8 f16 values at p as f32. */
static inline __m256 vmath_load8_f16(const void *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* 8 bf16 values at p as f32 (a bf16 is the high half of an f32). */
static inline __m256 vmath_load8_bf16(const void *p)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

#if defined(__AVX2__)
/* The sum of 8 int32 lanes (wrapping adds: any order gives the same bits). */
static inline int vmath_hsum8_epi32(__m256i v)
{
    __m128i q = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0x4E));
    q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0xB1));
    return _mm_cvtsi128_si32(q);
}

/* The sums of eight int32x8 vectors, as one vector (lane i: the sum of v[i]).
 * Eight horizontal sums at once cost about what two do one at a time. */
static inline __m256i vmath_sums8_epi32(const __m256i v[8])
{
    const __m256i g0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i g1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(g0, g1, 0x20), _mm256_permute2x128_si256(g0, g1, 0x31));
}
#endif

#if defined(__AVX512F__)
/* 16 f16 values at p as f32. */
static inline __m512 vmath_load16_f16(const void *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

/* 16 bf16 values at p as f32. */
static inline __m512 vmath_load16_bf16(const void *p)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#endif

#if defined(__AVX512BW__)
/* The mask of a 64-byte load's first n bytes, for a masked load that stops at
 * the end of a row: empty for n <= 0, every byte for n >= 64. */
static inline __mmask64 vmath_byte_mask(int n)
{
    return n >= 64 ? ~(__mmask64)0 : n <= 0 ? (__mmask64)0 : ((__mmask64)1 << n) - 1;
}
#endif

#endif
