/* IQ2_XXS, IQ2_XS, IQ1_S, IQ1_M . Q8_K with AVX-512: as iq2_avx2.c, 64
 * elements a step, the weights' signs put onto the Q8_K quants with a mask
 * straight from the sign bits; the two 32-element halves' lanes are added
 * before the float step, so every token gets the scalar vec_dot's bits. */
#include "quant/iq2.h"

#if defined(IQ2_HAVE_AVX512)
#include <immintrin.h>

/* One block, ready for many tokens. */
struct prepared {
    __m512i mag[4], scale[4]; /* per 64 elements; scales 4 x 8 int16 */
    __mmask64 neg[4], dneg[4];
    int16_t bsum_coef[8];
    float d;
};

static void prepare(enum quant_type t, const void *x, struct prepared *p)
{
    struct iq2_unpacked u;
    quant_iq2_unpack(t, x, &u);
    for (int g = 0; g < 4; g++) {
        p->mag[g] = _mm512_load_si512((const void *)(u.mag + 64 * g));
        p->neg[g] = (__mmask64)u.neg[g];
        p->dneg[g] = (__mmask64)u.dneg[g];
        const int16_t *sc = u.scale + 4 * g;
        p->scale[g] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_setr_m128i(_mm_set1_epi16(sc[0]),
                                                                                  _mm_set1_epi16(sc[1]))),
                                         _mm256_setr_m128i(_mm_set1_epi16(sc[2]), _mm_set1_epi16(sc[3])), 1);
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

/* Lanes k and 8 + k hold the same k of two 32-element halves. */
static inline __m256 fold_lanes(__m512i v)
{
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)));
}

/* nt <= IQ2_TOKENS tokens. */
static void dot_tokens(enum quant_type t, int n, int nt, float *s, size_t s_stride, const uint8_t *x, size_t bb,
                       const uint8_t *y, size_t y_stride)
{
    __m256 acc[IQ2_TOKENS], acc2[IQ2_TOKENS];
    float acc1[IQ2_TOKENS];
    for (int k = 0; k < nt; k++)
        acc[k] = acc2[k] = _mm256_setzero_ps(), acc1[k] = 0;
    const __m512i ones = _mm512_set1_epi8(1), zero = _mm512_setzero_si512();
    struct prepared p;
    for (int i = 0; i < n / QK_K; i++) {
        kq_prefetch_block(x + i * bb, bb);
        prepare(t, x + i * bb, &p);
        for (int k = 0; k < nt; k++) {
            const block_q8_K *yb = (const block_q8_K *)(y + k * y_stride) + i;
            __m512i lane = zero, lane2 = zero;
            for (int g = 0; g < 4; g++) {
                __m512i q = _mm512_loadu_si512((const void *)(yb->qs + 64 * g));
                __m512i p16 = _mm512_maddubs_epi16(p.mag[g], _mm512_mask_sub_epi8(q, p.neg[g], zero, q));
                lane = _mm512_add_epi32(lane, _mm512_madd_epi16(p16, p.scale[g]));
                if (t == QUANT_IQ1_M) {
                    __m512i d16 = _mm512_maddubs_epi16(ones, _mm512_mask_sub_epi8(q, p.dneg[g], zero, q));
                    lane2 = _mm512_add_epi32(lane2, _mm512_madd_epi16(d16, p.scale[g]));
                }
            }
            const float d = yb->d * p.d;
            acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(d), fold_lanes(lane), acc[k]);
            if (t == QUANT_IQ1_M)
                acc2[k] = _mm256_fmadd_ps(_mm256_set1_ps(d), fold_lanes(lane2), acc2[k]);
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

void quant_iq2_dot_multi_avx512(enum quant_type t, int n, int nt, float *s, size_t s_stride, const void *x,
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
