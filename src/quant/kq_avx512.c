/* k-quants: AVX-512 (BW/VL, VNNI when present) vec_dot kernels Q2_K / Q4_K
 * . Q8_K, 64 quants per step (Q3_K, Q5_K and Q6_K run their AVX2 kernels,
 * which are ggml's lane order: kq_scalar.c).
 *
 * Same scheme as the AVX2 kernels: unpack 64 quants into unsigned bytes u
 * in natural element order (each 128-bit lane = one group of 16 quants),
 * maddubs with Q8_K (u8*s8 pairs -> s16, never saturating for |u| <= 63),
 * then multiply-add with the group's int16 scale into int32 lanes, which
 * VNNI does in one vpdpwssd. The mins come out exactly through the Q8_K
 * bsums; each block's two integer sums go into the two float chains of
 * kq_chains_add.
 *
 * Unpacking reads a 32-byte row of packed bits broadcast to both halves of
 * a zmm and shifts each half by its own count (vpsrlvw), which turns the
 * ggml interleaved layouts into 64 consecutive quants without shuffles. */
#include "quant/kq_internal.h"
#include "vmath/vmath_simd.h"

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

static inline __m512i load512(const void *p) { return _mm512_loadu_si512(p); }
static inline __m256i load256(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline __m512i bcast256(const void *p) { return _mm512_broadcast_i64x4(load256(p)); }

/* The two halves added: eight int32 lanes with the same total. */
static inline __m256i fold512(__m512i v)
{
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

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

static inline void q2_K_block(const void *vx, const block_q8_K *y, __m256i *sumi, __m256i *mins)
{
    const block_q2_K *x = vx;
    const __m512i m3 = _mm512_set1_epi8(3);
    const __m512i cnt_lo = half_counts(0, 2), cnt_hi = half_counts(4, 6);
    const __m128i m4 = _mm_set1_epi8(0xF);
    kq_prefetch_block(x, sizeof *x);
    const __m128i scb = _mm_loadu_si128((const __m128i *)x->scales);
    const __m512i sc16 = _mm512_zextsi256_si512(_mm256_cvtepu8_epi16(_mm_and_si128(scb, m4)));
    const __m256i m16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(scb, 4), m4));
    *mins = _mm256_madd_epi16(load256(y->bsums), m16);
    __m512i acc = _mm512_setzero_si512();
    for (int h = 0; h < 2; h++) {
        const __m512i bits = bcast256(x->qs + 32 * h);
        const __m512i u0 = _mm512_and_si512(_mm512_srlv_epi16(bits, cnt_lo), m3);
        const __m512i u1 = _mm512_and_si512(_mm512_srlv_epi16(bits, cnt_hi), m3);
        acc = dot64(acc, u0, y->qs + 128 * h, chunk_scales(sc16, 2 * h));
        acc = dot64(acc, u1, y->qs + 128 * h + 64, chunk_scales(sc16, 2 * h + 1));
    }
    *sumi = fold512(acc);
}

void quant_vec_dot_q2_K_q8_K_avx512(int n, float *s, const void *vx, const void *vy)
{
    kq_dot_by4(n, s, vx, sizeof(block_q2_K), offsetof(block_q2_K, d), offsetof(block_q2_K, dmin), vy, q2_K_block);
}

/* ---- Q4_K: sub-block sums by bytes, scaled as int16 pairs ------------------
 * vpdpbusd sums 4 products of a nibble and a Q8_K quant per dword (|sum| <=
 * 4 * 15 * 128, an int16), so two chunks' dwords pack into one vector of
 * words (vpackssdw, which never saturates here) and one vpdpwssd multiplies
 * them by their sub-block scales: per 128 quants 2 byte dots, 1 pack and 1
 * scale multiply where dot64 takes 2 maddubs and 2 scale multiplies. The
 * scales of 4 blocks are unpacked together, one block per 128-bit lane
 * (kq_unpack_scales_k4's bit moves by vpshufb). bench_kquant: 16.5 -> 21
 * GB/s hot on one thread. */

/* Per 128-bit lane: sc0..3 = q0..3 & 63, sc4..7 = (q8..11 & 15) | (q0..3 >> 6) << 4,
 * m0..3 = q4..7 & 63, m4..7 = (q8..11 >> 4) | (q4..7 >> 6) << 4. */
static const int8_t k4_pick_lo[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11};
static const int8_t k4_pick_top[16] = {-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7};
static const uint8_t k4_keep_lo[16] = {63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0};
static const uint8_t k4_keep_hi[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15};

/* vpermw indices into 2 blocks' 32 words [sc0..7, m0..7] x 2, for block b of
 * the pair. After vpackssdw(p0, p1) lanes 0-1 hold sub-blocks (0, 2) and
 * lanes 2-3 (1, 3), 4 words each: the scales follow that order. */
#define K4_W4(v) v, v, v, v
#define K4_LANE(s) K4_W4(s), K4_W4((s) + 2)
#define K4_SC(b, p) {K4_LANE(16 * (b) + 4 * (p)), K4_LANE(16 * (b) + 4 * (p)), K4_LANE(16 * (b) + 4 * (p) + 1), \
                     K4_LANE(16 * (b) + 4 * (p) + 1)}
static const uint16_t k4_sc_idx[2][2][32] = {{K4_SC(0, 0), K4_SC(0, 1)}, {K4_SC(1, 0), K4_SC(1, 1)}};
#define K4_M2(v) v, v
#define K4_MIN(b) {K4_M2(16 * (b) + 8), K4_M2(16 * (b) + 9), K4_M2(16 * (b) + 10), K4_M2(16 * (b) + 11), \
                   K4_M2(16 * (b) + 12), K4_M2(16 * (b) + 13), K4_M2(16 * (b) + 14), K4_M2(16 * (b) + 15)}
static const uint16_t k4_min_idx[2][32] = {K4_MIN(0), K4_MIN(1)};
#undef K4_W4
#undef K4_LANE
#undef K4_SC
#undef K4_M2
#undef K4_MIN

static inline __m512i bcast128(const void *p) { return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)p)); }

/* Dwords of 4 products each: u (unsigned) times q (signed). */
static inline __m512i dot_bytes(__m512i u, __m512i q)
{
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, q);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, q), _mm512_set1_epi16(1));
#endif
}

static inline __m512i dot_words(__m512i acc, __m512i a, __m512i b)
{
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

/* The 16 scale and min bytes of n <= 4 blocks, widened to words: blocks 0-1
 * in w[0], 2-3 in w[1]. The 16-byte loads end inside each block's qs. */
static inline void k4_scales4(const block_q4_K *x, int n, __m512i w[2])
{
    __m512i v = _mm512_zextsi128_si512(_mm_loadu_si128((const __m128i *)x[0].scales));
    if (n > 1)
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)x[1].scales), 1);
    if (n > 2)
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)x[2].scales), 2);
    if (n > 3)
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)x[3].scales), 3);
    const __m512i a = _mm512_shuffle_epi8(v, bcast128(k4_pick_lo)), b = _mm512_shuffle_epi8(v, bcast128(k4_pick_top));
    const __m512i lo = _mm512_and_si512(a, bcast128(k4_keep_lo));
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(a, 4), bcast128(k4_keep_hi));
    const __m512i top = _mm512_srli_epi16(_mm512_and_si512(b, _mm512_set1_epi8((char)0xC0)), 2);
    const __m512i bytes = _mm512_ternarylogic_epi32(lo, hi, top, 0xFE); /* lo | hi | top */
    w[0] = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(bytes));
    w[1] = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(bytes, 1));
}

/* One block unpacked: its 256 quants as bytes, its scales per packed word
 * pair, its mins against the bsums, d and dmin. */
struct k4_block {
    __m512i u[4], sc[2];
    __m256i m16;
    float d, dmin;
};

static inline __attribute__((always_inline)) void k4_block_load(const block_q4_K *x, const __m512i w[2], int b,
                                                                 struct k4_block *k)
{
    const __m512i m4 = _mm512_set1_epi8(0xF), cnt = half_counts(0, 4);
    const __m512i src = w[b >> 1];
    for (int p = 0; p < 2; p++)
        k->sc[p] = _mm512_permutexvar_epi16(load512(k4_sc_idx[b & 1][p]), src);
    k->m16 = _mm512_castsi512_si256(_mm512_permutexvar_epi16(load512(k4_min_idx[b & 1]), src));
    for (int c = 0; c < 4; c++)
        k->u[c] = _mm512_and_si512(_mm512_srlv_epi16(bcast256(x->qs + 32 * c), cnt), m4);
    k->d = kq_f16_to_f32(x->d);
    k->dmin = kq_f16_to_f32(x->dmin);
}

/* One block's two exact sums against one token, left unreduced: sumi (per
 * dword lane) and the mins against the bsums. */
static inline __attribute__((always_inline)) void k4_block_sums(const struct k4_block *k, const block_q8_K *y,
                                                                 __m256i *sumi, __m256i *mins)
{
    __m512i p[4];
    for (int c = 0; c < 4; c++)
        p[c] = dot_bytes(k->u[c], load512(y->qs + 64 * c));
    const __m512i s = dot_words(_mm512_setzero_si512(), _mm512_packs_epi32(p[0], p[1]), k->sc[0]);
    *sumi = fold512(dot_words(s, _mm512_packs_epi32(p[2], p[3]), k->sc[1]));
    *mins = _mm256_madd_epi16(load256(y->bsums), k->m16);
}

/* ==== one weight row x one token, and x several tokens ===================
 * Every block ends in two exact integer sums per token, which the scalar
 * reference turns into floats at once: acc = fma(isum, d * dy, acc), accm =
 * fma(msum, dmin * dy, accm), block after block. A horizontal sum per block
 * and per token cost more than the block's dot, so the sums are reduced
 * eight at a time: one token's 4 blocks (sumi and mins) together, or one
 * block's sums for up to 8 tokens, whose float chains then run side by
 * side in the lanes. The float steps are the reference's, in its order, so
 * a token gets the same bits alone, in a batch and from the scalar twin. */

static inline __attribute__((always_inline)) void q4_K_one(int n, float *s, const block_q4_K *x,
                                                           const block_q8_K *y)
{
    const int nb = n / QK_K;
    float acc = 0, accm = 0;
    for (int i0 = 0; i0 < nb; i0 += 4) {
        const int nblk = nb - i0 < 4 ? nb - i0 : 4;
        __m512i w[2];
        k4_scales4(x + i0, nblk, w);
        __m256i v[8];
        quant_f16 d[4], dmin[4];
        for (int b = 0; b < 4; b++) {
            v[b] = v[4 + b] = _mm256_setzero_si256();
            if (b < nblk) {
                kq_prefetch_block(&x[i0 + b], sizeof x[i0 + b]);
                struct k4_block k;
                k4_block_load(&x[i0 + b], w, b, &k);
                k4_block_sums(&k, &y[i0 + b], &v[b], &v[4 + b]);
                d[b] = x[i0 + b].d;
                dmin[b] = x[i0 + b].dmin;
            }
        }
        kq_chains_add4(&acc, &accm, v, nblk, d, dmin, &y[i0]);
    }
    *s = acc - accm;
}

static inline __attribute__((always_inline)) void q4_K_multi(int n, int nt, float *s, size_t s_stride,
                                                             const block_q4_K *x, const uint8_t *y,
                                                             size_t y_stride)
{
    const int nb = n / QK_K;
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    for (int i0 = 0; i0 < nb; i0 += 4) {
        __m512i w[2];
        k4_scales4(x + i0, nb - i0 < 4 ? nb - i0 : 4, w);
        for (int i = i0; i < nb && i < i0 + 4; i++) {
            kq_prefetch_block(&x[i], sizeof x[i]);
            struct k4_block k;
            k4_block_load(&x[i], w, i - i0, &k);
            __m256i si[8], mi[8];
            _Alignas(32) float yd[8] = {0};
            for (int t = 0; t < 8; t++) {
                si[t] = mi[t] = _mm256_setzero_si256();
                if (t < nt) {
                    const block_q8_K *yt = (const block_q8_K *)(y + t * y_stride) + i;
                    k4_block_sums(&k, yt, &si[t], &mi[t]);
                    yd[t] = yt->d;
                }
            }
            const __m256 vyd = _mm256_load_ps(yd);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(vmath_sums8_epi32(si)), _mm256_mul_ps(_mm256_set1_ps(k.d), vyd), acc);
            accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(vmath_sums8_epi32(mi)), _mm256_mul_ps(_mm256_set1_ps(k.dmin), vyd), accm);
        }
    }
    _Alignas(32) float out[8];
    _mm256_store_ps(out, _mm256_sub_ps(acc, accm));
    for (int t = 0; t < nt; t++) s[t * s_stride] = out[t];
}

void quant_vec_dot_q4_K_q8_K_avx512(int n, float *s, const void *vx, const void *vy)
{
    q4_K_one(n, s, vx, vy);
}

/* nt is dispatched to constants so the token loops unroll; more than
 * KQ_DOT_MAX_TOKENS tokens are done in groups. Groups of 8 tokens beat 4 by
 * about 8% in llama-1b q4_k_m pp512 (each block unpacked once for 8). */
void quant_vec_dot_q4_K_q8_K_multi_avx512(int n, int nt, float *s, size_t s_stride, const void *x, const void *vy,
                                          size_t y_stride)
{
    _Static_assert(KQ_DOT_MAX_TOKENS == 8, "the token lanes are one __m256");
    const uint8_t *y = vy;
    for (; nt > 0; nt -= KQ_DOT_MAX_TOKENS, s += KQ_DOT_MAX_TOKENS * s_stride, y += KQ_DOT_MAX_TOKENS * y_stride)
        switch (nt < KQ_DOT_MAX_TOKENS ? nt : KQ_DOT_MAX_TOKENS) {
        case 1: q4_K_one(n, s, x, (const block_q8_K *)y); break;
#define KQ_MULTI_CASE(k) case k: q4_K_multi(n, k, s, s_stride, x, y, y_stride); break;
        KQ_MULTI_CASE(2) KQ_MULTI_CASE(3) KQ_MULTI_CASE(4) KQ_MULTI_CASE(5) KQ_MULTI_CASE(6) KQ_MULTI_CASE(7)
        KQ_MULTI_CASE(8)
#undef KQ_MULTI_CASE
        }
}

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
