/* IQ3_XXS, IQ3_S, IQ2_S: AVX-512 dot products with Q8_K, one weight row
 * against up to KQ_DOT_MAX_TOKENS tokens at a time (vec_dot is nt = 1).
 *
 * Two blocks of 32 per register: a super-block is unpacked once into 4 x 64
 * grid magnitudes (u8), 4 sign masks and 4 int16 scale vectors. Per token a
 * masked subtract negates the Q8_K bytes under the signs, maddubs + madd
 * give 16 int32 lanes (two blocks' 8 lanes of 4 elements) and the halves add
 * into the same 8 exact lane sums the AVX2 kernel and the scalar twin have;
 * the float part is theirs (iq3.h), so the bits are too. */
#include "quant/iq3.h"

#if defined(KQ_HAVE_AVX512)
#include <immintrin.h>

#define IQ_PAIRS (QK_K / 64)

struct iq_unpacked512 {
    __m512i mag[IQ_PAIRS];   /* grid magnitudes of blocks 2p and 2p+1, u8 */
    __mmask64 neg[IQ_PAIRS]; /* bit e: element e is negative */
    __m512i sc[IQ_PAIRS];    /* int16 scale of each element pair */
    float d;
};

typedef void (*iq_unpack_avx512_fn)(const uint8_t *block, struct iq_unpacked512 *u);

static inline uint32_t load_u32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline uint64_t load_u64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float block_d(const uint8_t *block)
{
    quant_f16 h;
    memcpy(&h, block, sizeof h);
    return kq_f16_to_f32(h);
}

/* int16 scales: a0 for elements 0..15, a1 16..31, b0 32..47, b1 48..63. */
static inline __m512i scale_pairs(int a0, int a1, int b0, int b1)
{
    const __m256i a = _mm256_set_m128i(_mm_set1_epi16((short)a1), _mm_set1_epi16((short)a0));
    const __m256i b = _mm256_set_m128i(_mm_set1_epi16((short)b1), _mm_set1_epi16((short)b0));
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}

static uint32_t iq3_xxs_signs(uint32_t aux)
{
    uint32_t signs = 0;
    for (int l = 0; l < 4; l++) signs |= (uint32_t)quant_iq2_ksigns[(aux >> (7 * l)) & 127] << (8 * l);
    return signs;
}

/* Pair p's sign masks and scales of an IQ3_XXS super-block. */
static inline void iq3_xxs_signs_scales(const block_iq3_xxs *b, int p, struct iq_unpacked512 *u)
{
    const uint32_t a0 = load_u32(b->qs + QK_K / 4 + 8 * p), a1 = load_u32(b->qs + QK_K / 4 + 8 * p + 4);
    u->neg[p] = (__mmask64)iq3_xxs_signs(a0) | (__mmask64)iq3_xxs_signs(a1) << 32;
    const int l0 = (int)(2 * (a0 >> 28) + 1), l1 = (int)(2 * (a1 >> 28) + 1);
    u->sc[p] = scale_pairs(l0, l0, l1, l1);
}

/* The same for IQ3_S. */
static inline void iq3_s_signs_scales(const block_iq3_s *b, int p, struct iq_unpacked512 *u)
{
    u->neg[p] = (__mmask64)load_u64(b->signs + 8 * p);
    const int l0 = 2 * (b->scales[p] & 0xf) + 1, l1 = 2 * (b->scales[p] >> 4) + 1;
    u->sc[p] = scale_pairs(l0, l0, l1, l1);
}

#if defined(__AVX512VBMI__)
/* The IQ3 grids looked up with byte permutes instead of gathers (a gather of
 * 16 dwords takes ~22 cycles on Zen 4, four of them most of a super-block's
 * time). Byte j of every entry, bytes[j][index], is 4 (IQ3_XXS) or 8 (IQ3_S)
 * vectors of 64, so an index is two or four two-table vpermi2b (7 bits
 * each) and the blends that pick among them by bit 7 (and IQ3_S's bit 8).
 * Done for a super-block's 64 entries at once, the four byte planes are
 * interleaved back into entries by vpunpck, which works within 128-bit
 * lanes; the indices are first put in the order that leaves the entries of
 * lane L of result k where k's lane L should hold them (iq3_order). */
static _Alignas(64) uint8_t iq3xxs_bytes[4][256];
static _Alignas(64) uint8_t iq3s_bytes[4][512];

void quant_iq3_init_avx512(void)
{
    for (int j = 0; j < 4; j++) {
        for (int i = 0; i < 256; i++)
            iq3xxs_bytes[j][i] = (uint8_t)(quant_iq3xxs_grid[i] >> (8 * j));
        for (int i = 0; i < 512; i++)
            iq3s_bytes[j][i] = (uint8_t)(quant_iq3s_grid[i] >> (8 * j));
    }
}

/* Index position 16 L + 4 k + m takes entry 16 k + 4 L + m (L, k, m < 4). */
#define IQ3_ORDER4(L, k) 16 * (k) + 4 * (L), 16 * (k) + 4 * (L) + 1, 16 * (k) + 4 * (L) + 2, 16 * (k) + 4 * (L) + 3
#define IQ3_ORDER16(L) IQ3_ORDER4(L, 0), IQ3_ORDER4(L, 1), IQ3_ORDER4(L, 2), IQ3_ORDER4(L, 3)
static const uint8_t iq3_order[64] = {IQ3_ORDER16(0), IQ3_ORDER16(1), IQ3_ORDER16(2), IQ3_ORDER16(3)};
#undef IQ3_ORDER4
#undef IQ3_ORDER16

/* Byte plane t (4 or 8 vectors) of the 64 entries at idx (bits 0-6), bit 7
 * in k7, bit 8 in k8 (wide tables only). */
static inline __m512i iq3_plane(const __m512i *t, bool wide, __m512i idx, __mmask64 k7, __mmask64 k8)
{
    const __m512i lo = _mm512_mask_blend_epi8(k7, _mm512_permutex2var_epi8(t[0], idx, t[1]),
                                              _mm512_permutex2var_epi8(t[2], idx, t[3]));
    if (!wide)
        return lo;
    const __m512i hi = _mm512_mask_blend_epi8(k7, _mm512_permutex2var_epi8(t[4], idx, t[5]),
                                              _mm512_permutex2var_epi8(t[6], idx, t[7]));
    return _mm512_mask_blend_epi8(k8, lo, hi);
}

/* The grid magnitudes of a super-block's 64 entries (indices qs, bits 8 in
 * the 64-bit ninth when wide) as 4 vectors of 16 entries in element order. */
static inline __attribute__((always_inline)) void iq3_magnitudes(const uint8_t *bytes, bool wide, const uint8_t *qs,
                                                                 uint64_t ninth, __m512i mag[IQ_PAIRS])
{
    const size_t plane = wide ? 512 : 256;
    const __m512i order = _mm512_loadu_si512((const void *)iq3_order);
    const __m512i idx = _mm512_permutexvar_epi8(order, _mm512_loadu_si512((const void *)qs));
    const __mmask64 k7 = _mm512_movepi8_mask(idx),
                    k8 = wide ? _mm512_movepi8_mask(_mm512_permutexvar_epi8(order, _mm512_movm_epi8(ninth))) : 0;
    __m512i o[4];
    for (int j = 0; j < 4; j++)
        o[j] = iq3_plane((const __m512i *)(bytes + plane * (size_t)j), wide, idx, k7, k8);
    const __m512i a_lo = _mm512_unpacklo_epi8(o[0], o[1]), a_hi = _mm512_unpackhi_epi8(o[0], o[1]);
    const __m512i b_lo = _mm512_unpacklo_epi8(o[2], o[3]), b_hi = _mm512_unpackhi_epi8(o[2], o[3]);
    mag[0] = _mm512_unpacklo_epi16(a_lo, b_lo);
    mag[1] = _mm512_unpackhi_epi16(a_lo, b_lo);
    mag[2] = _mm512_unpacklo_epi16(a_hi, b_hi);
    mag[3] = _mm512_unpackhi_epi16(a_hi, b_hi);
}

static void unpack_iq3_xxs(const uint8_t *block, struct iq_unpacked512 *u)
{
    const block_iq3_xxs *b = (const block_iq3_xxs *)block;
    u->d = block_d(block);
    iq3_magnitudes(&iq3xxs_bytes[0][0], false, b->qs, 0, u->mag);
    for (int p = 0; p < IQ_PAIRS; p++)
        iq3_xxs_signs_scales(b, p, u);
}

static void unpack_iq3_s(const uint8_t *block, struct iq_unpacked512 *u)
{
    const block_iq3_s *b = (const block_iq3_s *)block;
    u->d = block_d(block);
    iq3_magnitudes(&iq3s_bytes[0][0], true, b->qs, load_u64(b->qh), u->mag);
    for (int p = 0; p < IQ_PAIRS; p++)
        iq3_s_signs_scales(b, p, u);
}
#else
void quant_iq3_init_avx512(void) {}

static void unpack_iq3_xxs(const uint8_t *block, struct iq_unpacked512 *u)
{
    const block_iq3_xxs *b = (const block_iq3_xxs *)block;
    u->d = block_d(block);
    for (int p = 0; p < IQ_PAIRS; p++) {
        const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b->qs + 16 * p)));
        u->mag[p] = _mm512_i32gather_epi32(idx, (const int *)quant_iq3xxs_grid, 4);
        iq3_xxs_signs_scales(b, p, u);
    }
}

static void unpack_iq3_s(const uint8_t *block, struct iq_unpacked512 *u)
{
    const block_iq3_s *b = (const block_iq3_s *)block;
    u->d = block_d(block);
    const __m512i shifts = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int p = 0; p < IQ_PAIRS; p++) {
        const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b->qs + 16 * p)));
        const int qh = b->qh[2 * p] | b->qh[2 * p + 1] << 8;
        const __m512i hi = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(qh), shifts), _mm512_set1_epi32(1));
        const __m512i idx = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 8));
        u->mag[p] = _mm512_i32gather_epi32(idx, (const int *)quant_iq3s_grid, 4);
        iq3_s_signs_scales(b, p, u);
    }
}
#endif

static void unpack_iq2_s(const uint8_t *block, struct iq_unpacked512 *u)
{
    const block_iq2_s *b = (const block_iq2_s *)block;
    u->d = block_d(block);
    const __m256i shifts = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    for (int p = 0; p < IQ_PAIRS; p++) {
        const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b->qs + 8 * p)));
        const int qh = b->qh[2 * p] | b->qh[2 * p + 1] << 8;
        const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(qh), shifts), _mm256_set1_epi32(3));
        const __m256i idx = _mm256_or_si256(lo, _mm256_slli_epi32(hi, 8));
        u->mag[p] = _mm512_i32gather_epi64(idx, (const long long *)quant_iq2s_grid, 8);
        u->neg[p] = (__mmask64)load_u64(b->qs + QK_K / 8 + 8 * p);
        const uint8_t s0 = b->scales[2 * p], s1 = b->scales[2 * p + 1];
        u->sc[p] = scale_pairs(2 * (s0 & 0xf) + 1, 2 * (s0 >> 4) + 1, 2 * (s1 & 0xf) + 1, 2 * (s1 >> 4) + 1);
    }
}

/* Token's 8 int32 lanes of one unpacked super-block. */
static inline __m256i block_lanes(const struct iq_unpacked512 *u, const int8_t *q8)
{
    const __m512i zero = _mm512_setzero_si512();
    __m512i sum = zero;
    for (int p = 0; p < IQ_PAIRS; p++) {
        const __m512i q8v = _mm512_loadu_si512((const void *)(q8 + 64 * p));
        const __m512i q = _mm512_mask_sub_epi8(q8v, u->neg[p], zero, q8v);
        sum = _mm512_add_epi32(sum, _mm512_madd_epi16(_mm512_maddubs_epi16(u->mag[p], q), u->sc[p]));
    }
    return _mm256_add_epi32(_mm512_castsi512_si256(sum), _mm512_extracti64x4_epi64(sum, 1));
}

static inline __attribute__((always_inline)) void dot_multi(int n, int nt, float *s, size_t s_stride,
                                                             const uint8_t *x, size_t block_bytes,
                                                             iq_unpack_avx512_fn unpack, const uint8_t *y,
                                                             size_t y_stride, float scale)
{
    for (int t0 = 0; t0 < nt; t0 += KQ_DOT_MAX_TOKENS) {
        const int m = nt - t0 < KQ_DOT_MAX_TOKENS ? nt - t0 : KQ_DOT_MAX_TOKENS;
        __m256 acc[KQ_DOT_MAX_TOKENS];
        for (int t = 0; t < m; t++) acc[t] = _mm256_setzero_ps();
        for (int i = 0; i < n / QK_K; i++) {
            const uint8_t *blk = x + (size_t)i * block_bytes;
            kq_prefetch_block(blk, block_bytes);
            struct iq_unpacked512 u;
            unpack(blk, &u);
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

void quant_vec_dot_iq3_xxs_q8_K_multi_avx512(int n, int nt, float *s, size_t s_stride, const void *x,
                                             const void *y, size_t y_stride)
{
    dot_multi(n, nt, s, s_stride, x, sizeof(block_iq3_xxs), unpack_iq3_xxs, y, y_stride, IQ3_XXS_DOT_SCALE);
}

void quant_vec_dot_iq3_s_q8_K_multi_avx512(int n, int nt, float *s, size_t s_stride, const void *x, const void *y,
                                           size_t y_stride)
{
    dot_multi(n, nt, s, s_stride, x, sizeof(block_iq3_s), unpack_iq3_s, y, y_stride, IQ3_S_DOT_SCALE);
}

void quant_vec_dot_iq2_s_q8_K_multi_avx512(int n, int nt, float *s, size_t s_stride, const void *x, const void *y,
                                           size_t y_stride)
{
    dot_multi(n, nt, s, s_stride, x, sizeof(block_iq2_s), unpack_iq2_s, y, y_stride, IQ2_S_DOT_SCALE);
}

void quant_vec_dot_iq3_xxs_q8_K_avx512(int n, float *s, const void *x, const void *y)
{
    quant_vec_dot_iq3_xxs_q8_K_multi_avx512(n, 1, s, 0, x, y, 0);
}

void quant_vec_dot_iq3_s_q8_K_avx512(int n, float *s, const void *x, const void *y)
{
    quant_vec_dot_iq3_s_q8_K_multi_avx512(n, 1, s, 0, x, y, 0);
}

void quant_vec_dot_iq2_s_q8_K_avx512(int n, float *s, const void *x, const void *y)
{
    quant_vec_dot_iq2_s_q8_K_multi_avx512(n, 1, s, 0, x, y, 0);
}

#endif
