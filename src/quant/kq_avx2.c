/* k-quants: AVX2 vec_dot kernels Qn_K . Q8_K, 32 quants per step.
 *
 * Every kernel unpacks 32 quants into unsigned bytes u in natural element
 * order, multiplies them with 32 Q8_K bytes (maddubs: u8*s8 pairs -> s16,
 * no saturation since |u| <= 63) and then with the per-16 scales (madd ->
 * s32): int32 lane c of 32 quants holds their elements 4c..4c+3, ggml's
 * lanes. Signed formats are unpacked with an offset: Q3_K's (u = q + 4)
 * comes out of each int16 pair, Q6_K's (u = q + 32) out of each lane through
 * the Q8_K bsums, as ggml's AVX2 kernels do; Q3_K, Q5_K and Q6_K keep the
 * lanes in 8 float accumulators, Q2_K and Q4_K reduce them per block into
 * the two chains of kq_chains_add (kq_scalar.c has the orders). */
#include <string.h>

#include "quant/kq_internal.h"
#include "vmath/vmath_simd.h"

#if defined(KQ_HAVE_AVX2)
#include <immintrin.h>

static inline float hsum256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* pshufb controls picking int16 word pairs: chunk k of 4 takes word 2k in
 * the low lane and 2k+1 in the high lane (per-16 scales), or word k in both
 * (per-32 scales). */
static const uint8_t kq_pair_ctrl[4][32] = {
#define W(a) a * 2, a * 2 + 1
#define X8(a) W(a), W(a), W(a), W(a), W(a), W(a), W(a), W(a)
    {X8(0), X8(1)}, {X8(2), X8(3)}, {X8(4), X8(5)}, {X8(6), X8(7)},
};
static const uint8_t kq_same_ctrl[8][32] = {
    {X8(0), X8(0)}, {X8(1), X8(1)}, {X8(2), X8(2)}, {X8(3), X8(3)},
    {X8(4), X8(4)}, {X8(5), X8(5)}, {X8(6), X8(6)}, {X8(7), X8(7)},
#undef X8
#undef W
};

static inline int32_t hsum_epi32_4(__m128i v)
{
    v = _mm_add_epi32(v, _mm_unpackhi_epi64(v, v));
    return _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32(v, 1)));
}

static inline __m256i load256(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* Scales of chunk c (elements 32c..32c+31) from 16 per-16 int16 scales. */
static inline __m256i pair_scales(__m256i lo_bcast, __m256i hi_bcast, int c)
{
    return _mm256_shuffle_epi8(c < 4 ? lo_bcast : hi_bcast, load256(kq_pair_ctrl[c % 4]));
}

/* sum over 32 elements of u * q8, weighted by scale, as 8 int32 lanes. */
static inline __m256i dot32(__m256i u, const int8_t *q8, __m256i scale)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, load256(q8)), scale);
}

/* The same for signed quants stored as u = q + off: the offset comes out of
 * each int16 pair before the scales (maddubs(off, q8) <= 32 * 127 * 2), so
 * every int32 lane holds scale * q * q8 of its own elements, as ggml's lanes. */
static inline __m256i dot32_off(__m256i u, __m256i off, const int8_t *q8, __m256i scale)
{
    const __m256i y = load256(q8);
    return _mm256_madd_epi16(_mm256_sub_epi16(_mm256_maddubs_epi16(u, y), _mm256_maddubs_epi16(off, y)), scale);
}

/* Per-16 scales as (low 8 broadcast, high 8 broadcast) for pair_scales. */
static inline void split_scales(__m256i sc16, __m256i *lo, __m256i *hi)
{
    *lo = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sc16));
    *hi = _mm256_broadcastsi128_si256(_mm256_extracti128_si256(sc16, 1));
}

/* A block's isum (unreduced) and msum lanes (kq_block_sums_fn). */
static inline void q2_K_block(const void *vx, const block_q8_K *y, __m256i *sumi, __m256i *mins)
{
    const block_q2_K *x = vx;
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m128i m4 = _mm_set1_epi8(0xF);
    kq_prefetch_block(x, sizeof *x);
    const __m128i scb = _mm_loadu_si128((const __m128i *)x->scales);
    const __m256i sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(scb, m4));
    const __m256i m16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(scb, 4), m4));
    *mins = _mm256_madd_epi16(load256(y->bsums), m16);
    __m256i lo, hi;
    split_scales(sc16, &lo, &hi);
    __m256i acc = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
        const __m256i bits = load256(x->qs + 32 * h);
        for (int k = 0; k < 4; k++) {
            const int c = 4 * h + k;
            const __m256i u = _mm256_and_si256(_mm256_srl_epi16(bits, _mm_cvtsi32_si128(2 * k)), m3);
            acc = _mm256_add_epi32(acc, dot32(u, y->qs + 32 * c, pair_scales(lo, hi, c)));
        }
    }
    *sumi = acc;
}

void quant_vec_dot_q2_K_q8_K_avx2(int n, float *s, const void *vx, const void *vy)
{
    kq_dot_by4(n, s, vx, sizeof(block_q2_K), offsetof(block_q2_K, d), offsetof(block_q2_K, dmin), vy, q2_K_block);
}

void quant_vec_dot_q3_K_q8_K_avx2(int n, float *s, const void *vx, const void *vy)
{
    const block_q3_K *x = vx;
    const block_q8_K *y = vy;
    const __m256i m3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1), four = _mm256_set1_epi8(4);
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < n / QK_K; i++) {
        kq_prefetch_block(&x[i], sizeof x[i]);
        int8_t sc8[16];
        kq_unpack_scales_q3(x[i].scales, sc8);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc8));
        __m256i lo, hi;
        split_scales(sc16, &lo, &hi);
        const __m256i hbits = load256(x[i].hmask);
        __m256i sumi = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i bits = load256(x[i].qs + 32 * h);
            for (int k = 0; k < 4; k++) {
                const int c = 4 * h + k;
                const __m256i low = _mm256_and_si256(_mm256_srl_epi16(bits, _mm_cvtsi32_si128(2 * k)), m3);
                const __m256i top = _mm256_and_si256(_mm256_srl_epi16(hbits, _mm_cvtsi32_si128(c)), one);
                const __m256i u = _mm256_or_si256(low, _mm256_slli_epi16(top, 2));
                sumi = _mm256_add_epi32(sumi, dot32_off(u, four, y[i].qs + 32 * c, pair_scales(lo, hi, c)));
            }
        }
        const float d = y[i].d * kq_f16_to_f32(x[i].d);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    *s = hsum256(acc);
}

/* Q4_K/Q5_K: 8 scales and 8 mins per block, one scale per 32 quants. The
 * min term is sum_j min_j * (bsums[2j] + bsums[2j+1]). */
static inline __m128i k4_scales(const block_q8_K *y, const uint8_t *packed, __m256i *sc_bcast)
{
    uint32_t sm[4];
    kq_unpack_scales_k4(packed, sm);
    const __m256i both = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)sm));
    *sc_bcast = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(both));
    const __m256i bs = load256(y->bsums);
    const __m128i pair = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
    return _mm_madd_epi16(_mm256_extracti128_si256(both, 1), pair);
}

static inline __m256i k4_dot_chunk(__m256i u, const int8_t *q8, __m256i sc_bcast, int j)
{
    return dot32(u, q8, _mm256_shuffle_epi8(sc_bcast, load256(kq_same_ctrl[j])));
}

static inline void q4_K_block(const void *vx, const block_q8_K *y, __m256i *sumi, __m256i *mins)
{
    const block_q4_K *x = vx;
    const __m256i m4 = _mm256_set1_epi8(0xF);
    kq_prefetch_block(x, sizeof *x);
    __m256i sc;
    *mins = _mm256_zextsi128_si256(k4_scales(y, x->scales, &sc));
    __m256i acc = _mm256_setzero_si256();
    for (int j = 0; j < QK_K / 64; j++) {
        const __m256i bits = load256(x->qs + 32 * j);
        const __m256i ul = _mm256_and_si256(bits, m4);
        const __m256i uh = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
        acc = _mm256_add_epi32(acc, k4_dot_chunk(ul, y->qs + 64 * j, sc, 2 * j));
        acc = _mm256_add_epi32(acc, k4_dot_chunk(uh, y->qs + 64 * j + 32, sc, 2 * j + 1));
    }
    *sumi = acc;
}

void quant_vec_dot_q4_K_q8_K_avx2(int n, float *s, const void *vx, const void *vy)
{
    kq_dot_by4(n, s, vx, sizeof(block_q4_K), offsetof(block_q4_K, d), offsetof(block_q4_K, dmin), vy, q4_K_block);
}

void quant_vec_dot_q5_K_q8_K_avx2(int n, float *s, const void *vx, const void *vy)
{
    const block_q5_K *x = vx;
    const block_q8_K *y = vy;
    const __m256i m4 = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
    __m256 acc = _mm256_setzero_ps();
    float summs = 0;
    for (int i = 0; i < n / QK_K; i++) {
        kq_prefetch_block(&x[i], sizeof x[i]);
        __m256i sc;
        const __m128i mins = k4_scales(&y[i], x[i].scales, &sc);
        const __m256i hbits = load256(x[i].qh);
        __m256i sumi = _mm256_setzero_si256();
        for (int j = 0; j < QK_K / 64; j++) {
            const __m256i bits = load256(x[i].qs + 32 * j);
            const __m256i hl = _mm256_and_si256(_mm256_srl_epi16(hbits, _mm_cvtsi32_si128(2 * j)), one);
            const __m256i hh = _mm256_and_si256(_mm256_srl_epi16(hbits, _mm_cvtsi32_si128(2 * j + 1)), one);
            const __m256i ul = _mm256_or_si256(_mm256_and_si256(bits, m4), _mm256_slli_epi16(hl, 4));
            const __m256i uh = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits, 4), m4),
                                               _mm256_slli_epi16(hh, 4));
            sumi = _mm256_add_epi32(sumi, k4_dot_chunk(ul, y[i].qs + 64 * j, sc, 2 * j));
            sumi = _mm256_add_epi32(sumi, k4_dot_chunk(uh, y[i].qs + 64 * j + 32, sc, 2 * j + 1));
        }
        const float d = y[i].d * kq_f16_to_f32(x[i].d), dmin = y[i].d * kq_f16_to_f32(x[i].dmin);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
        summs = fmaf(-dmin, (float)hsum_epi32_4(mins), summs);
    }
    *s = hsum256(acc) + summs;
}

void quant_vec_dot_q6_K_q8_K_avx2(int n, float *s, const void *vx, const void *vy)
{
    const block_q6_K *x = vx;
    const block_q8_K *y = vy;
    const __m256i m4 = _mm256_set1_epi8(0xF), m30 = _mm256_set1_epi8(0x30);
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < n / QK_K; i++) {
        kq_prefetch_block(&x[i], sizeof x[i]);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x[i].scales));
        /* u = q + 32 in [0, 63]: 32 * sum(scale * bsums) comes back out of
         * lane c as bsums 2c, 2c + 1 (ggml's lanes: kq_scalar.c) */
        const __m256i bias = _mm256_slli_epi32(_mm256_madd_epi16(load256(y[i].bsums), sc16), 5);
        __m256i lo, hi;
        split_scales(sc16, &lo, &hi);
        __m256i sumi = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i l0 = load256(x[i].ql + 64 * h), l1 = load256(x[i].ql + 64 * h + 32);
            const __m256i hb = load256(x[i].qh + 32 * h);
            const __m256i u[4] = {
                _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30)),
                _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hb, m30)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30)),
            };
            for (int k = 0; k < 4; k++) {
                const int c = 4 * h + k;
                sumi = _mm256_add_epi32(sumi, dot32(u[k], y[i].qs + 32 * c, pair_scales(lo, hi, c)));
            }
        }
        sumi = _mm256_sub_epi32(sumi, bias);
        const float d = y[i].d * kq_f16_to_f32(x[i].d);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    *s = hsum256(acc);
}

/* ==== Q8_K activations ==================================================== */

/* The first element of largest magnitude, as the reference picks it (a NaN
 * lane keeps the running maximum, as its strict > does). */
static float signed_absmax(const float *x, float *amax_out)
{
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps();
    for (int j = 0; j < QK_K; j += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + j), absmask), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    *amax_out = amax;
    const __m256 va = _mm256_set1_ps(amax);
    for (int j = 0; j < QK_K; j += 8) {
        const int k = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(x + j), absmask), va, _CMP_EQ_OQ));
        if (k) return x[j + __builtin_ctz((unsigned)k)];
    }
    return 0.f;
}

void quant_quantize_row_q8_K_avx2(const float *x, void *vy, int64_t n)
{
    block_q8_K *y = vy;
    const __m256i lim = _mm256_set1_epi32(127);
    for (int64_t i = 0; i < n / QK_K; i++, x += QK_K) {
        float amax;
        const float max = signed_absmax(x, &amax);
        if (!amax) {
            memset(&y[i], 0, sizeof y[i]);
            continue;
        }
        const __m256 vs = _mm256_set1_ps(-127.f / max);
        for (int g = 0; g < QK_K / 16; g++) {
            /* default MXCSR rounding = nearest even, as the reference */
            const __m256i a = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16 * g), vs)), lim);
            const __m256i b = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16 * g + 8), vs)), lim);
            /* |q| <= 127: the packs do not saturate; 0 2 1 3 undoes their lane interleave */
            const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
            const __m128i q8 = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
            _mm_storeu_si128((__m128i *)(y[i].qs + 16 * g), q8);
            y[i].bsums[g] = (int16_t)vmath_hsum8_epi32(_mm256_add_epi32(a, b));
        }
        y[i].d = 1 / (-127.f / max);
    }
}

#endif
