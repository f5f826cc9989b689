/* k-quants: AVX-512 (BW/VL, VNNI when present) vec_dot kernels Qn_K . Q8_K,
 * 64 quants per step.
 *
 * Same scheme as the AVX2 kernels: unpack 64 quants into unsigned bytes u
 * in natural element order (each 128-bit lane = one group of 16 quants),
 * maddubs with Q8_K (u8*s8 pairs -> s16, never saturating for |u| <= 63),
 * then multiply-add with the group's int16 scale into int32 lanes, which
 * VNNI does in one vpdpwssd. Offsets of signed formats and the mins of the
 * asymmetric ones come out exactly through the Q8_K bsums.
 *
 * Unpacking reads a 32-byte row of packed bits broadcast to both halves of
 * a zmm and shifts each half by its own count (vpsrlvw), which turns the
 * ggml interleaved layouts into 64 consecutive quants without shuffles. */
#include "quant/kquants.h"

#if defined(KQ_HAVE_AVX512)
#include <immintrin.h>

/* vpermw indices: chunk c of 64 quants takes per-16 scale 4c+i in lane i. */
static const uint16_t kq_scale_idx[4][32] = {
#define L8(a) a, a, a, a, a, a, a, a
    {L8(0), L8(1), L8(2), L8(3)},
    {L8(4), L8(5), L8(6), L8(7)},
    {L8(8), L8(9), L8(10), L8(11)},
    {L8(12), L8(13), L8(14), L8(15)},
#undef L8
};

/* test masks for a hmask/qh bit per half: low 32 bytes bit 2c, high 2c+1. */
static const uint8_t kq_bit_sel[4][64] = {
#define B32(a) a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a
    {B32(0x01), B32(0x02)}, {B32(0x04), B32(0x08)}, {B32(0x10), B32(0x20)}, {B32(0x40), B32(0x80)},
#undef B32
};

static inline __m512i load512(const void *p) { return _mm512_loadu_si512(p); }
static inline __m256i load256(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline __m512i bcast256(const void *p) { return _mm512_broadcast_i64x4(load256(p)); }

/* Per-16-bit-lane shift counts: a in the low half, b in the high half. */
static inline __m512i half_counts(int a, int b)
{
    return _mm512_inserti64x4(_mm512_set1_epi16((short)a), _mm256_set1_epi16((short)b), 1);
}

static inline __m512i chunk_scales(__m512i sc16, int c)
{
    return _mm512_permutexvar_epi16(load512(kq_scale_idx[c]), sc16);
}

/* acc += per 32-bit lane: scale * (u . q8) over 4 quants */
static inline __m512i dot64(__m512i acc, __m512i u, const int8_t *q8, __m512i scale)
{
    const __m512i p = _mm512_maddubs_epi16(u, load512(q8));
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, p, scale);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p, scale));
#endif
}

/* u + add where the selected hmask/qh bit for chunk c is set */
static inline __m512i add_top_bit(__m512i u, __m512i bits, int c, int add)
{
    const __mmask64 k = _mm512_test_epi8_mask(bits, load512(kq_bit_sel[c]));
    return _mm512_mask_add_epi8(u, k, u, _mm512_set1_epi8((char)add));
}

static inline float hsum256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

void quant_vec_dot_q2_K_q8_K_avx512(int n, float *s, const void *vx, const void *vy)
{
    const block_q2_K *x = vx;
    const block_q8_K *y = vy;
    const __m512i m3 = _mm512_set1_epi8(3);
    const __m512i cnt_lo = half_counts(0, 2), cnt_hi = half_counts(4, 6);
    const __m128i m4 = _mm_set1_epi8(0xF);
    __m512 acc = _mm512_setzero_ps();
    __m256 accm = _mm256_setzero_ps();
    for (int i = 0; i < n / QK_K; i++) {
        kq_prefetch_block(&x[i], sizeof x[i]);
        const __m128i scb = _mm_loadu_si128((const __m128i *)x[i].scales);
        const __m512i sc16 = _mm512_zextsi256_si512(_mm256_cvtepu8_epi16(_mm_and_si128(scb, m4)));
        const __m256i m16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(scb, 4), m4));
        const __m256i mins = _mm256_madd_epi16(load256(y[i].bsums), m16);
        __m512i sumi = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            const __m512i bits = bcast256(x[i].qs + 32 * h);
            const __m512i u0 = _mm512_and_si512(_mm512_srlv_epi16(bits, cnt_lo), m3);
            const __m512i u1 = _mm512_and_si512(_mm512_srlv_epi16(bits, cnt_hi), m3);
            sumi = dot64(sumi, u0, y[i].qs + 128 * h, chunk_scales(sc16, 2 * h));
            sumi = dot64(sumi, u1, y[i].qs + 128 * h + 64, chunk_scales(sc16, 2 * h + 1));
        }
        const float d = y[i].d * kq_f16_to_f32(x[i].d), dmin = y[i].d * kq_f16_to_f32(x[i].dmin);
        acc = _mm512_fmadd_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(sumi), acc);
        accm = _mm256_fmadd_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(mins), accm);
    }
    *s = _mm512_reduce_add_ps(acc) - hsum256(accm);
}

void quant_vec_dot_q3_K_q8_K_avx512(int n, float *s, const void *vx, const void *vy)
{
    const block_q3_K *x = vx;
    const block_q8_K *y = vy;
    const __m512i m3 = _mm512_set1_epi8(3);
    const __m512i cnt_lo = half_counts(0, 2), cnt_hi = half_counts(4, 6);
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < n / QK_K; i++) {
        kq_prefetch_block(&x[i], sizeof x[i]);
        int8_t sc8[16];
        kq_unpack_scales_q3(x[i].scales, sc8);
        const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc8));
        const __m512i sc16 = _mm512_zextsi256_si512(sc);
        /* u = q + 4 in [0, 7]: take 4 * sum(scale * bsums) back out */
        const __m256i bias = _mm256_slli_epi32(_mm256_madd_epi16(load256(y[i].bsums), sc), 2);
        const __m512i hbits = bcast256(x[i].hmask);
        __m512i sumi = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_zextsi256_si512(bias));
        for (int h = 0; h < 2; h++) {
            const __m512i bits = bcast256(x[i].qs + 32 * h);
            __m512i u0 = _mm512_and_si512(_mm512_srlv_epi16(bits, cnt_lo), m3);
            __m512i u1 = _mm512_and_si512(_mm512_srlv_epi16(bits, cnt_hi), m3);
            u0 = add_top_bit(u0, hbits, 2 * h, 4);
            u1 = add_top_bit(u1, hbits, 2 * h + 1, 4);
            sumi = dot64(sumi, u0, y[i].qs + 128 * h, chunk_scales(sc16, 2 * h));
            sumi = dot64(sumi, u1, y[i].qs + 128 * h + 64, chunk_scales(sc16, 2 * h + 1));
        }
        const float d = y[i].d * kq_f16_to_f32(x[i].d);
        acc = _mm512_fmadd_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(sumi), acc);
    }
    *s = _mm512_reduce_add_ps(acc);
}

/* Q4_K/Q5_K: the 8 per-32 scales and mins widened to 16 per-16 int16 lanes
 * (each repeated twice), so all kernels share chunk_scales() and the mins
 * multiply the bsums directly. */
static inline __m512i k4_scales(const uint8_t *packed, __m256i *m16)
{
    uint32_t sm[4];
    kq_unpack_scales_k4(packed, sm);
    const __m128i b = _mm_loadu_si128((const __m128i *)sm);
    *m16 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(b, b));
    return _mm512_zextsi256_si512(_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(b, b)));
}

void quant_vec_dot_q4_K_q8_K_avx512(int n, float *s, const void *vx, const void *vy)
{
    const block_q4_K *x = vx;
    const block_q8_K *y = vy;
    const __m512i m4 = _mm512_set1_epi8(0xF);
    const __m512i cnt = half_counts(0, 4);
    __m512 acc = _mm512_setzero_ps();
    __m256 accm = _mm256_setzero_ps();
    for (int i = 0; i < n / QK_K; i++) {
        kq_prefetch_block(&x[i], sizeof x[i]);
        __m256i m16;
        const __m512i sc16 = k4_scales(x[i].scales, &m16);
        const __m256i mins = _mm256_madd_epi16(load256(y[i].bsums), m16);
        __m512i sumi = _mm512_setzero_si512();
        for (int c = 0; c < QK_K / 64; c++) {
            const __m512i u = _mm512_and_si512(_mm512_srlv_epi16(bcast256(x[i].qs + 32 * c), cnt), m4);
            sumi = dot64(sumi, u, y[i].qs + 64 * c, chunk_scales(sc16, c));
        }
        const float d = y[i].d * kq_f16_to_f32(x[i].d), dmin = y[i].d * kq_f16_to_f32(x[i].dmin);
        acc = _mm512_fmadd_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(sumi), acc);
        accm = _mm256_fmadd_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(mins), accm);
    }
    *s = _mm512_reduce_add_ps(acc) - hsum256(accm);
}

void quant_vec_dot_q5_K_q8_K_avx512(int n, float *s, const void *vx, const void *vy)
{
    const block_q5_K *x = vx;
    const block_q8_K *y = vy;
    const __m512i m4 = _mm512_set1_epi8(0xF);
    const __m512i cnt = half_counts(0, 4);
    __m512 acc = _mm512_setzero_ps();
    __m256 accm = _mm256_setzero_ps();
    for (int i = 0; i < n / QK_K; i++) {
        kq_prefetch_block(&x[i], sizeof x[i]);
        __m256i m16;
        const __m512i sc16 = k4_scales(x[i].scales, &m16);
        const __m256i mins = _mm256_madd_epi16(load256(y[i].bsums), m16);
        const __m512i hbits = bcast256(x[i].qh);
        __m512i sumi = _mm512_setzero_si512();
        for (int c = 0; c < QK_K / 64; c++) {
            __m512i u = _mm512_and_si512(_mm512_srlv_epi16(bcast256(x[i].qs + 32 * c), cnt), m4);
            u = add_top_bit(u, hbits, c, 16);
            sumi = dot64(sumi, u, y[i].qs + 64 * c, chunk_scales(sc16, c));
        }
        const float d = y[i].d * kq_f16_to_f32(x[i].d), dmin = y[i].d * kq_f16_to_f32(x[i].dmin);
        acc = _mm512_fmadd_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(sumi), acc);
        accm = _mm256_fmadd_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(mins), accm);
    }
    *s = _mm512_reduce_add_ps(acc) - hsum256(accm);
}

void quant_vec_dot_q6_K_q8_K_avx512(int n, float *s, const void *vx, const void *vy)
{
    const block_q6_K *x = vx;
    const block_q8_K *y = vy;
    const __m512i m4 = _mm512_set1_epi8(0xF), m30 = _mm512_set1_epi8(0x30);
    const __m512i up = half_counts(4, 2), down = half_counts(0, 2);
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < n / QK_K; i++) {
        kq_prefetch_block(&x[i], sizeof x[i]);
        const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x[i].scales));
        const __m512i sc16 = _mm512_zextsi256_si512(sc);
        /* u = q + 32 in [0, 63]: take 32 * sum(scale * bsums) back out */
        const __m256i bias = _mm256_slli_epi32(_mm256_madd_epi16(load256(y[i].bsums), sc), 5);
        __m512i sumi = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_zextsi256_si512(bias));
        for (int h = 0; h < 2; h++) {
            const __m512i l = load512(x[i].ql + 64 * h);
            const __m512i hb = bcast256(x[i].qh + 32 * h);
            /* A | (B & C) */
            const __m512i u0 = _mm512_ternarylogic_epi32(_mm512_and_si512(l, m4), _mm512_sllv_epi16(hb, up), m30, 0xF8);
            const __m512i u1 = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
                                                         _mm512_srlv_epi16(hb, down), m30, 0xF8);
            sumi = dot64(sumi, u0, y[i].qs + 128 * h, chunk_scales(sc16, 2 * h));
            sumi = dot64(sumi, u1, y[i].qs + 128 * h + 64, chunk_scales(sc16, 2 * h + 1));
        }
        const float d = y[i].d * kq_f16_to_f32(x[i].d);
        acc = _mm512_fmadd_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(sumi), acc);
    }
    *s = _mm512_reduce_add_ps(acc);
}

/* ==== prefill: one weight row x several tokens ============================ */
/* Each block is unpacked once and multiplied with every token's Q8_K row.
 * Per token the operations and their order are those of the single-token
 * kernels above, so the results are bit-identical to them. */

static inline __attribute__((always_inline)) void q4_K_multi(int n, int nt, float *s, size_t s_stride,
                                                             const block_q4_K *x, const uint8_t *y,
                                                             size_t y_stride)
{
    const __m512i m4 = _mm512_set1_epi8(0xF);
    const __m512i cnt = half_counts(0, 4);
    __m512 acc[KQ_DOT_MAX_TOKENS];
    __m256 accm[KQ_DOT_MAX_TOKENS];
    for (int t = 0; t < nt; t++) {
        acc[t] = _mm512_setzero_ps();
        accm[t] = _mm256_setzero_ps();
    }
    for (int i = 0; i < n / QK_K; i++) {
        kq_prefetch_block(&x[i], sizeof x[i]);
        __m256i m16;
        const __m512i sc16 = k4_scales(x[i].scales, &m16);
        __m512i u[4], sc[4];
        for (int c = 0; c < 4; c++) {
            u[c] = _mm512_and_si512(_mm512_srlv_epi16(bcast256(x[i].qs + 32 * c), cnt), m4);
            sc[c] = chunk_scales(sc16, c);
        }
        const float xd = kq_f16_to_f32(x[i].d), xdmin = kq_f16_to_f32(x[i].dmin);
        for (int t = 0; t < nt; t++) {
            const block_q8_K *yb = (const block_q8_K *)(y + t * y_stride) + i;
            const __m256i mins = _mm256_madd_epi16(load256(yb->bsums), m16);
            __m512i sumi = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) sumi = dot64(sumi, u[c], yb->qs + 64 * c, sc[c]);
            acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(yb->d * xd), _mm512_cvtepi32_ps(sumi), acc[t]);
            accm[t] = _mm256_fmadd_ps(_mm256_set1_ps(yb->d * xdmin), _mm256_cvtepi32_ps(mins), accm[t]);
        }
    }
    for (int t = 0; t < nt; t++) s[t * s_stride] = _mm512_reduce_add_ps(acc[t]) - hsum256(accm[t]);
}

static inline __attribute__((always_inline)) void q6_K_multi(int n, int nt, float *s, size_t s_stride,
                                                             const block_q6_K *x, const uint8_t *y,
                                                             size_t y_stride)
{
    const __m512i m4 = _mm512_set1_epi8(0xF), m30 = _mm512_set1_epi8(0x30);
    const __m512i up = half_counts(4, 2), down = half_counts(0, 2);
    __m512 acc[KQ_DOT_MAX_TOKENS];
    for (int t = 0; t < nt; t++) acc[t] = _mm512_setzero_ps();
    for (int i = 0; i < n / QK_K; i++) {
        kq_prefetch_block(&x[i], sizeof x[i]);
        const __m256i scv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x[i].scales));
        const __m512i sc16 = _mm512_zextsi256_si512(scv);
        __m512i u[4], sc[4];
        for (int h = 0; h < 2; h++) {
            const __m512i l = load512(x[i].ql + 64 * h);
            const __m512i hb = bcast256(x[i].qh + 32 * h);
            u[2 * h] = _mm512_ternarylogic_epi32(_mm512_and_si512(l, m4), _mm512_sllv_epi16(hb, up), m30, 0xF8);
            u[2 * h + 1] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
                                                     _mm512_srlv_epi16(hb, down), m30, 0xF8);
        }
        for (int c = 0; c < 4; c++) sc[c] = chunk_scales(sc16, c);
        const float xd = kq_f16_to_f32(x[i].d);
        for (int t = 0; t < nt; t++) {
            const block_q8_K *yb = (const block_q8_K *)(y + t * y_stride) + i;
            const __m256i bias = _mm256_slli_epi32(_mm256_madd_epi16(load256(yb->bsums), scv), 5);
            __m512i sumi = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_zextsi256_si512(bias));
            for (int c = 0; c < 4; c++) sumi = dot64(sumi, u[c], yb->qs + 64 * c, sc[c]);
            acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(yb->d * xd), _mm512_cvtepi32_ps(sumi), acc[t]);
        }
    }
    for (int t = 0; t < nt; t++) s[t * s_stride] = _mm512_reduce_add_ps(acc[t]);
}

/* nt is dispatched to constants so the token loops unroll; more than
 * KQ_DOT_MAX_TOKENS tokens are done in groups. Groups of 8 tokens beat 4 by
 * about 8% in llama-1b q4_k_m pp512 (each block unpacked once for 8). */
#define KQ_MULTI_CASE(t, k) case k: t##_multi(n, k, s, s_stride, x, y, y_stride); break;
#define KQ_MULTI_ENTRY(t)                                                                                    \
    void quant_vec_dot_##t##_q8_K_multi_avx512(int n, int nt, float *s, size_t s_stride, const void *x,     \
                                                const void *vy, size_t y_stride)                              \
    {                                                                                                        \
        const uint8_t *y = vy;                                                                               \
        for (; nt > 0; nt -= KQ_DOT_MAX_TOKENS, s += KQ_DOT_MAX_TOKENS * s_stride, y += KQ_DOT_MAX_TOKENS * y_stride) \
            switch (nt < KQ_DOT_MAX_TOKENS ? nt : KQ_DOT_MAX_TOKENS) {                                       \
                KQ_MULTI_CASE(t, 1) KQ_MULTI_CASE(t, 2) KQ_MULTI_CASE(t, 3) KQ_MULTI_CASE(t, 4)             \
                KQ_MULTI_CASE(t, 5) KQ_MULTI_CASE(t, 6) KQ_MULTI_CASE(t, 7) KQ_MULTI_CASE(t, 8)             \
            }                                                                                                \
    }
_Static_assert(KQ_DOT_MAX_TOKENS == 8, "KQ_MULTI_ENTRY dispatches 1..8 tokens");
KQ_MULTI_ENTRY(q4_K)
KQ_MULTI_ENTRY(q6_K)

/* ==== Q8_K activations ==================================================== */

/* The first element of largest magnitude, as the reference picks it. */
static float signed_absmax(const float *x, float *amax_out)
{
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    __m512 m = _mm512_setzero_ps();
    for (int j = 0; j < QK_K; j += 16) m = _mm512_max_ps(m, _mm512_and_ps(_mm512_loadu_ps(x + j), absmask));
    const float amax = _mm512_reduce_max_ps(m);
    *amax_out = amax;
    const __m512 va = _mm512_set1_ps(amax);
    for (int j = 0; j < QK_K; j += 16) {
        const __mmask16 k = _mm512_cmp_ps_mask(_mm512_and_ps(_mm512_loadu_ps(x + j), absmask), va, _CMP_EQ_OQ);
        if (k) return x[j + __builtin_ctz(k)];
    }
    return 0.f;
}

void quant_quantize_row_q8_K_avx512(const float *x, void *vy, int64_t n)
{
    block_q8_K *y = vy;
    const __m512i lim = _mm512_set1_epi32(127);
    for (int64_t i = 0; i < n / QK_K; i++, x += QK_K) {
        float amax;
        const float max = signed_absmax(x, &amax);
        if (!(amax > 0)) {
            memset(&y[i], 0, sizeof y[i]);
            continue;
        }
        const float iscale = -127.f / max;
        const __m512 vs = _mm512_set1_ps(iscale);
        for (int g = 0; g < QK_K / 16; g++) {
            /* default MXCSR rounding = nearest even, as the reference */
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * g), vs));
            q = _mm512_min_epi32(q, lim);
            _mm_storeu_si128((__m128i *)(y[i].qs + 16 * g), _mm512_cvtsepi32_epi8(q));
            y[i].bsums[g] = (int16_t)_mm512_reduce_add_epi32(q);
        }
        y[i].d = 1 / iscale;
    }
}

#endif
