/* IQ2_XXS, IQ2_XS, IQ1_S, IQ1_M . Q8_K with AVX2: per 32 elements the grid
 * magnitudes (unsigned) times the Q8_K quants with the weights' signs moved
 * onto them (maddubs), then times the per-16 scales into 8 int32 lanes
 * (madd): the lanes of iq2.h, so every token gets the scalar vec_dot's bits. */
#include "quant/iq2.h"

#if defined(IQ2_HAVE_AVX2)
#include <immintrin.h>

/* One block, ready for many tokens. */
struct prepared {
    __m256i mag[8], sign[8], dsign[8], scale[8]; /* per 32 elements; signs +-1 bytes, scales 2 x 8 int16 */
    int16_t bsum_coef[8];
    float d;
};

/* 32 sign bits -> 32 bytes of +1 / -1. */
static inline __m256i signs_from_bits(uint32_t bits)
{
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                                            3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    __m256i neg = _mm256_cmpeq_epi8(_mm256_and_si256(b, bit), bit);
    return _mm256_or_si256(neg, _mm256_set1_epi8(1));
}

static void prepare(enum quant_type t, const void *x, struct prepared *p)
{
    struct iq2_unpacked u;
    quant_iq2_unpack(t, x, &u);
    for (int ib = 0; ib < 8; ib++) {
        p->mag[ib] = _mm256_load_si256((const __m256i *)(u.mag + 32 * ib));
        p->sign[ib] = signs_from_bits((uint32_t)(u.neg[ib / 2] >> (32 * (ib % 2))));
        p->dsign[ib] = signs_from_bits((uint32_t)(u.dneg[ib / 2] >> (32 * (ib % 2))));
        p->scale[ib] = _mm256_setr_m128i(_mm_set1_epi16(u.scale[2 * ib]), _mm_set1_epi16(u.scale[2 * ib + 1]));
    }
    memcpy(p->bsum_coef, u.bsum_coef, sizeof p->bsum_coef);
    p->d = u.d;
}

static inline int32_t iq1s_bsum_term(const struct prepared *p, const block_q8_K *y)
{
    int32_t sum = 0;
    for (int ib = 0; ib < 8; ib++)
        sum += (y->bsums[2 * ib] + y->bsums[2 * ib + 1]) * p->bsum_coef[ib];
    return sum;
}

/* nt <= IQ2_TOKENS tokens. */
static void dot_tokens(enum quant_type t, int n, int nt, float *s, size_t s_stride, const uint8_t *x, size_t bb,
                       const uint8_t *y, size_t y_stride)
{
    __m256 acc[IQ2_TOKENS], acc2[IQ2_TOKENS];
    float acc1[IQ2_TOKENS];
    for (int k = 0; k < nt; k++)
        acc[k] = acc2[k] = _mm256_setzero_ps(), acc1[k] = 0;
    const __m256i ones = _mm256_set1_epi8(1);
    struct prepared p;
    for (int i = 0; i < n / QK_K; i++) {
        kq_prefetch_block(x + i * bb, bb);
        prepare(t, x + i * bb, &p);
        for (int k = 0; k < nt; k++) {
            const block_q8_K *yb = (const block_q8_K *)(y + k * y_stride) + i;
            __m256i lane = _mm256_setzero_si256(), lane2 = _mm256_setzero_si256();
            for (int ib = 0; ib < 8; ib++) {
                __m256i q = _mm256_loadu_si256((const __m256i *)(yb->qs + 32 * ib));
                __m256i p16 = _mm256_maddubs_epi16(p.mag[ib], _mm256_sign_epi8(q, p.sign[ib]));
                lane = _mm256_add_epi32(lane, _mm256_madd_epi16(p16, p.scale[ib]));
                if (t == QUANT_IQ1_M) {
                    __m256i d16 = _mm256_maddubs_epi16(ones, _mm256_sign_epi8(q, p.dsign[ib]));
                    lane2 = _mm256_add_epi32(lane2, _mm256_madd_epi16(d16, p.scale[ib]));
                }
            }
            const float d = yb->d * p.d;
            acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(lane), acc[k]);
            if (t == QUANT_IQ1_M)
                acc2[k] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(lane2), acc2[k]);
            if (t == QUANT_IQ1_S)
                acc1[k] = fmaf(d, (float)iq1s_bsum_term(&p, yb), acc1[k]);
        }
    }
    for (int k = 0; k < nt; k++) {
        float a[8], a2[8];
        _mm256_storeu_ps(a, acc[k]);
        _mm256_storeu_ps(a2, acc2[k]);
        float r;
        switch (t) {
        case QUANT_IQ1_S: r = quant_iq2_hsum8(a) + QUANT_IQ1S_DELTA * acc1[k]; break;
        case QUANT_IQ1_M: r = quant_iq2_hsum8(a) + QUANT_IQ1M_DELTA * quant_iq2_hsum8(a2); break;
        default: r = 0.125f * quant_iq2_hsum8(a); break;
        }
        s[k * s_stride] = r;
    }
}

void quant_iq2_dot_multi_avx2(enum quant_type t, int n, int nt, float *s, size_t s_stride, const void *x,
                              const void *y, size_t y_stride)
{
    const size_t bb = quant_row_size(t, QK_K);
    for (int t0 = 0; t0 < nt; t0 += IQ2_TOKENS) {
        int m = nt - t0 < IQ2_TOKENS ? nt - t0 : IQ2_TOKENS;
        dot_tokens(t, n, m, s + (size_t)t0 * s_stride, s_stride, x, bb, (const uint8_t *)y + (size_t)t0 * y_stride,
                   y_stride);
    }
}
#endif
