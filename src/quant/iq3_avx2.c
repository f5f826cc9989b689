/* IQ3_XXS, IQ3_S, IQ2_S: AVX2 dot products with Q8_K, one weight row
 * against up to KQ_DOT_MAX_TOKENS tokens at a time (vec_dot is nt = 1).
 *
 * A super-block is unpacked once: per 32 elements the grid magnitudes as
 * unsigned bytes (gathered from the grid), the signs as +-1 bytes and the
 * scales as int16 pairs. Per token, sign_epi8 moves the signs onto the Q8_K
 * bytes, maddubs + madd give 8 int32 lanes of 4 elements each (no
 * saturation: 2 * 62 * 127 < 2^15), and one fma per super-block adds them
 * into the token's float lanes: the scalar twin's operations (iq3.h).
 * Decode (one token) unpacks each group of 32 and uses it at once, in
 * registers: through memory, the unpacked block cost IQ3_S 15% and IQ2_S 19%
 * of a matrix-vector product (Zen 4, one thread, hot). IQ3_S's grid stays a
 * vpgatherdd (its 9-bit indices are assembled in a vector; eight scalar
 * loads and inserts, as llama.cpp's AVX2 IQ3_S does, were 10% slower here);
 * IQ3_XXS's indices are whole bytes, and there eight loads and one table
 * load per 8 signs (instead of ksigns bytes joined into a mask) took 2440 ->
 * 1487 us. */
#include "quant/iq3.h"

#if defined(KQ_HAVE_AVX2)
#include <immintrin.h>

#include "quant/iq2.h"

struct iq_unpacked {
    __m256i mag[QK_K / 32]; /* grid magnitudes, u8 */
    __m256i sgn[QK_K / 32]; /* +1 / -1 per element */
    __m256i sc[QK_K / 32];  /* int16 scale of each element pair */
    float d;
};

/* Group ib (32 elements) of a super-block: magnitudes, signs, scale pairs. */
typedef void (*iq_unpack_ib_fn)(const uint8_t *block, int ib, __m256i *mag, __m256i *sgn, __m256i *sc);

static inline uint32_t load_u32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float block_d(const uint8_t *block)
{
    quant_f16 h;
    memcpy(&h, block, sizeof h);
    return kq_f16_to_f32(h);
}

/* Bit j of m -> byte j: -1 where set, +1 where clear. */
static inline __m256i sign_bytes(uint32_t m)
{
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                                          3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201ll);
    __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)m), pick), bit);
    return _mm256_or_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(1));
}

/* Scale lo for elements 0..15 of a block of 32, hi for 16..31. */
static inline __m256i scale_pairs(int lo, int hi)
{
    return _mm256_set_m128i(_mm_set1_epi16((short)hi), _mm_set1_epi16((short)lo));
}

#define IQ_INLINE static inline __attribute__((always_inline))

/* quant_iq2_ksigns[i] as 8 bytes, -1 where its bit is set and +1 where clear:
 * a group of 8 signs is one load (llama.cpp's keven_signs). */
static uint64_t g_ksigns_bytes[128];

void quant_iq3_init_avx2(void)
{
    for (int i = 0; i < 128; i++) {
        uint64_t v = 0;
        for (int j = 0; j < 8; j++)
            v |= (uint64_t)((quant_iq2_ksigns[i] >> j) & 1 ? 0xff : 0x01) << (8 * j);
        g_ksigns_bytes[i] = v;
    }
}

IQ_INLINE void unpack_iq3_xxs(const uint8_t *block, int ib, __m256i *mag, __m256i *sgn, __m256i *sc)
{
    const block_iq3_xxs *b = (const block_iq3_xxs *)block;
    const uint8_t *q = b->qs + 8 * ib; /* the indices are whole bytes: eight loads beat a gather */
    const uint32_t *grid = quant_iq3xxs_grid;
    *mag = _mm256_setr_epi32((int)grid[q[0]], (int)grid[q[1]], (int)grid[q[2]], (int)grid[q[3]], (int)grid[q[4]],
                             (int)grid[q[5]], (int)grid[q[6]], (int)grid[q[7]]);
    const uint32_t aux = load_u32(b->qs + QK_K / 4 + 4 * ib);
    *sgn = _mm256_setr_epi64x((long long)g_ksigns_bytes[aux & 127], (long long)g_ksigns_bytes[(aux >> 7) & 127],
                              (long long)g_ksigns_bytes[(aux >> 14) & 127], (long long)g_ksigns_bytes[(aux >> 21) & 127]);
    const int ls = (int)(2 * (aux >> 28) + 1);
    *sc = scale_pairs(ls, ls);
}

IQ_INLINE void unpack_iq3_s(const uint8_t *block, int ib, __m256i *mag, __m256i *sgn, __m256i *sc)
{
    const block_iq3_s *b = (const block_iq3_s *)block;
    const __m256i shifts = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), one = _mm256_set1_epi32(1);
    const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b->qs + 8 * ib)));
    const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(b->qh[ib]), shifts), one);
    const __m256i idx = _mm256_or_si256(lo, _mm256_slli_epi32(hi, 8));
    *mag = _mm256_i32gather_epi32((const int *)quant_iq3s_grid, idx, 4);
    *sgn = sign_bytes(load_u32(b->signs + 4 * ib));
    const int ls = 2 * ((b->scales[ib / 2] >> (4 * (ib % 2))) & 0xf) + 1;
    *sc = scale_pairs(ls, ls);
}

IQ_INLINE void unpack_iq2_s(const uint8_t *block, int ib, __m256i *mag, __m256i *sgn, __m256i *sc)
{
    const block_iq2_s *b = (const block_iq2_s *)block;
    const uint8_t *q = b->qs + 4 * ib; /* four loads: 5% faster than a vpgatherdq of 4 */
    const unsigned h = b->qh[ib];
    const uint64_t *grid = quant_iq2s_grid;
    *mag = _mm256_setr_epi64x((long long)grid[q[0] | (h << 8 & 0x300)], (long long)grid[q[1] | (h << 6 & 0x300)],
                              (long long)grid[q[2] | (h << 4 & 0x300)], (long long)grid[q[3] | (h << 2 & 0x300)]);
    *sgn = sign_bytes(load_u32(b->qs + QK_K / 8 + 4 * ib));
    *sc = scale_pairs(2 * (b->scales[ib] & 0xf) + 1, 2 * (b->scales[ib] >> 4) + 1);
}

/* Group ib's 8 int32 lanes against a token's Q8_K quants, added to sum. */
IQ_INLINE __m256i group_lanes(__m256i sum, __m256i mag, __m256i sgn, __m256i sc, const int8_t *q8, int ib)
{
    const __m256i q = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(q8 + 32 * ib)), sgn);
    return _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(mag, q), sc));
}

/* Token's 8 int32 lanes of one unpacked super-block. */
static inline __m256i block_lanes(const struct iq_unpacked *u, const int8_t *q8)
{
    __m256i sum = _mm256_setzero_si256();
    for (int ib = 0; ib < QK_K / 32; ib++)
        sum = group_lanes(sum, u->mag[ib], u->sgn[ib], u->sc[ib], q8, ib);
    return sum;
}

/* One token (decode): each group is unpacked and used at once, in registers. */
IQ_INLINE float dot_one(int n, const uint8_t *x, size_t block_bytes, iq_unpack_ib_fn unpack, const block_q8_K *y)
{
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < n / QK_K; i++) {
        const uint8_t *blk = x + (size_t)i * block_bytes;
        kq_prefetch_block(blk, block_bytes);
        __m256i sum = _mm256_setzero_si256();
        for (int ib = 0; ib < QK_K / 32; ib++) {
            __m256i mag, sgn, sc;
            unpack(blk, ib, &mag, &sgn, &sc);
            sum = group_lanes(sum, mag, sgn, sc, y[i].qs, ib);
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(block_d(blk) * y[i].d), _mm256_cvtepi32_ps(sum), acc);
    }
    float a[8];
    _mm256_storeu_ps(a, acc);
    return quant_iq2_hsum8(a);
}

IQ_INLINE void dot_multi(int n, int nt, float *s, size_t s_stride, const uint8_t *x, size_t block_bytes,
                         iq_unpack_ib_fn unpack, const uint8_t *y, size_t y_stride, float scale)
{
    if (nt == 1) {
        s[0] = scale * dot_one(n, x, block_bytes, unpack, (const block_q8_K *)y);
        return;
    }
    for (int t0 = 0; t0 < nt; t0 += KQ_DOT_MAX_TOKENS) {
        const int m = nt - t0 < KQ_DOT_MAX_TOKENS ? nt - t0 : KQ_DOT_MAX_TOKENS;
        __m256 acc[KQ_DOT_MAX_TOKENS];
        for (int t = 0; t < m; t++) acc[t] = _mm256_setzero_ps();
        for (int i = 0; i < n / QK_K; i++) {
            const uint8_t *blk = x + (size_t)i * block_bytes;
            kq_prefetch_block(blk, block_bytes);
            struct iq_unpacked u;
            u.d = block_d(blk);
            for (int ib = 0; ib < QK_K / 32; ib++)
                unpack(blk, ib, &u.mag[ib], &u.sgn[ib], &u.sc[ib]);
            for (int t = 0; t < m; t++) {
                const block_q8_K *yt = (const block_q8_K *)(y + (size_t)(t0 + t) * y_stride) + i;
                const __m256i lanes = block_lanes(&u, yt->qs);
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(u.d * yt->d), _mm256_cvtepi32_ps(lanes), acc[t]);
            }
        }
        for (int t = 0; t < m; t++) {
            float a[8];
            _mm256_storeu_ps(a, acc[t]);
            s[(size_t)(t0 + t) * s_stride] = scale * quant_iq2_hsum8(a);
        }
    }
}

void quant_vec_dot_iq3_xxs_q8_K_multi_avx2(int n, int nt, float *s, size_t s_stride, const void *x, const void *y,
                                           size_t y_stride)
{
    dot_multi(n, nt, s, s_stride, x, sizeof(block_iq3_xxs), unpack_iq3_xxs, y, y_stride, IQ3_XXS_DOT_SCALE);
}

void quant_vec_dot_iq3_s_q8_K_multi_avx2(int n, int nt, float *s, size_t s_stride, const void *x, const void *y,
                                         size_t y_stride)
{
    dot_multi(n, nt, s, s_stride, x, sizeof(block_iq3_s), unpack_iq3_s, y, y_stride, IQ3_S_DOT_SCALE);
}

void quant_vec_dot_iq2_s_q8_K_multi_avx2(int n, int nt, float *s, size_t s_stride, const void *x, const void *y,
                                         size_t y_stride)
{
    dot_multi(n, nt, s, s_stride, x, sizeof(block_iq2_s), unpack_iq2_s, y, y_stride, IQ2_S_DOT_SCALE);
}

void quant_vec_dot_iq3_xxs_q8_K_avx2(int n, float *s, const void *x, const void *y)
{
    quant_vec_dot_iq3_xxs_q8_K_multi_avx2(n, 1, s, 0, x, y, 0);
}

void quant_vec_dot_iq3_s_q8_K_avx2(int n, float *s, const void *x, const void *y)
{
    quant_vec_dot_iq3_s_q8_K_multi_avx2(n, 1, s, 0, x, y, 0);
}

void quant_vec_dot_iq2_s_q8_K_avx2(int n, float *s, const void *x, const void *y)
{
    quant_vec_dot_iq2_s_q8_K_multi_avx2(n, 1, s, 0, x, y, 0);
}

#endif
