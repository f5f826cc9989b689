/* quant: AVX2 and AVX-512 vec_dot kernels for the traits table. Each has a
 * scalar twin in quant_ref.c and a test comparing them (tests/test_quant.c).
 * The integer parts are exact; only the float sum over blocks may be
 * reordered. */
#include <math.h>
#include <string.h>

#include "quant/quant_internal.h"
#include "vmath/vmath_simd.h"

#if defined(QUANT_HAVE_AVX2) || defined(QUANT_HAVE_AVX512)
#include <immintrin.h>
#endif

const char *quant_isa(void)
{
#if defined(QUANT_HAVE_AVX512)
    return "avx512-vnni";
#elif defined(QUANT_HAVE_AVX2)
    return "avx2";
#else
    return "scalar";
#endif
}

#if defined(QUANT_HAVE_AVX2)
#define F16(h) _cvtsh_ss(h) /* inline F16C: the libquant call was ~8% of AVX2 decode */
#else
#define F16(h) quant_f16_to_f32(h)
#endif

#if defined(QUANT_HAVE_AVX2)
/* ---- AVX2: one 32-element block per step -------------------------------- */

static inline float hsum_256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 16 bytes of nibbles -> 32 bytes: low nibbles first (elements 0..15). */
static inline __m256i nibbles_32(const uint8_t *qs)
{
    __m128i t = _mm_loadu_si128((const __m128i *)qs);
    __m256i b = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    return _mm256_and_si256(b, _mm256_set1_epi8(0x0f));
}

/* Bit i of qh -> byte i = 0xff. */
static inline __m256i bits_32(const uint8_t qh[4])
{
    uint32_t v;
    memcpy(&v, qh, sizeof v);
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)v), spread);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    return _mm256_cmpeq_epi8(_mm256_and_si256(b, bit), bit);
}

/* Sum of u8 x s8 products in 8 int32 lanes (pairs never saturate here:
 * |x| <= 128, |y| <= 127). */
static inline __m256i dot_u8_i8(__m256i ux, __m256i y)
{
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), ux, y);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), ux, y);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(ux, y), _mm256_set1_epi16(1));
#endif
}

static inline __m256 dot_i8_ps(__m256i x, __m256i y)
{
    return _mm256_cvtepi32_ps(dot_u8_i8(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x)));
}

static inline __m256 dot_u8_ps(__m256i x, __m256i y) { return _mm256_cvtepi32_ps(dot_u8_i8(x, y)); }

static inline __m256i q4_0_block(const block_q4_0 *b) { return _mm256_sub_epi8(nibbles_32(b->qs), _mm256_set1_epi8(8)); }

static inline __m256i q5_0_block(const block_q5_0 *b)
{
    __m256i hi = _mm256_andnot_si256(bits_32(b->qh), _mm256_set1_epi8((char)0xf0));
    return _mm256_or_si256(nibbles_32(b->qs), hi); /* (nibble | bit4 << 4) - 16 as int8 */
}

static inline __m256i q5_1_block(const block_q5_1 *b)
{
    __m256i hi = _mm256_and_si256(bits_32(b->qh), _mm256_set1_epi8(0x10));
    return _mm256_or_si256(nibbles_32(b->qs), hi);
}

static inline __m256i load_q8(const int8_t *qs) { return _mm256_loadu_si256((const __m256i *)qs); }

/* Block i's exact integer dot of a Q4_0 or Q8_0 row against Q8_0. */
static inline int q4_0_isum(const block_q4_0 *x, const block_q8_0 *y, int i)
{
    __m256i w = q4_0_block(&x[i]);
    return vmath_hsum8_epi32(dot_u8_i8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(load_q8(y[i].qs), w)));
}

static inline int q8_0_isum(const block_q8_0 *x, const block_q8_0 *y, int i)
{
    __m256i w = load_q8(x[i].qs);
    return vmath_hsum8_epi32(dot_u8_i8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(load_q8(y[i].qs), w)));
}

/* One fma chain over the blocks, as the reference (quant_ref.c says why). */
#define CHAIN_DOT(isum, x, y, n, s)                                                         \
    do {                                                                                    \
        float acc_ = 0;                                                                     \
        for (int i_ = 0; i_ < (n) / QK8_0; i_++)                                            \
            acc_ = fmaf((float)isum(x, y, i_), F16((x)[i_].d) * F16((y)[i_].d), acc_);      \
        *(s) = acc_;                                                                        \
    } while (0)

void quant_vec_dot_q4_0_q8_0_avx2(int n, float *s, const void *vx, const void *vy)
{
    CHAIN_DOT(q4_0_isum, (const block_q4_0 *)vx, (const block_q8_0 *)vy, n, s);
}

void quant_vec_dot_q8_0_q8_0_avx2(int n, float *s, const void *vx, const void *vy)
{
    CHAIN_DOT(q8_0_isum, (const block_q8_0 *)vx, (const block_q8_0 *)vy, n, s);
}

/* q5_0 and q5_1: ggml's x86 order, 8 lanes and hsum_float_8 (quant_internal.h,
 * "q5_0 and q5_1"); on AVX-512 builds dot_u8_i8 is vpdpbusd, as llama.cpp's
 * icelake/zen4 builds run it. */
void quant_vec_dot_q5_0_q8_0_avx2(int n, float *s, const void *vx, const void *vy)
{
    const block_q5_0 *x = vx;
    const block_q8_0 *y = vy;
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < n / QK8_0; i++) {
        __m256 d = _mm256_set1_ps(F16(x[i].d) * F16(y[i].d));
        acc = _mm256_fmadd_ps(d, dot_i8_ps(q5_0_block(&x[i]), load_q8(y[i].qs)), acc);
    }
    *s = hsum_256(acc);
}

void quant_vec_dot_q4_1_q8_1_avx2(int n, float *s, const void *vx, const void *vy)
{
    const block_q4_1 *x = vx;
    const block_q8_1 *y = vy;
    __m256 acc = _mm256_setzero_ps();
    float mins = 0;
    for (int i = 0; i < n / QK8_1; i++) {
        __m256 d = _mm256_set1_ps(F16(x[i].d) * F16(y[i].d));
        mins += F16(x[i].m) * F16(y[i].s);
        acc = _mm256_fmadd_ps(d, dot_u8_ps(nibbles_32(x[i].qs), load_q8(y[i].qs)), acc);
    }
    *s = hsum_256(acc) + mins;
}

void quant_vec_dot_q5_1_q8_1_avx2(int n, float *s, const void *vx, const void *vy)
{
    const block_q5_1 *x = vx;
    const block_q8_1 *y = vy;
    __m256 acc = _mm256_setzero_ps();
    float summs = 0;
    for (int i = 0; i < n / QK8_1; i++) {
        __m256 d = _mm256_set1_ps(F16(x[i].d) * F16(y[i].d));
        summs = fmaf(F16(x[i].m), F16(y[i].s), summs);
        acc = _mm256_fmadd_ps(dot_u8_ps(q5_1_block(&x[i]), load_q8(y[i].qs)), d, acc);
    }
    *s = hsum_256(acc) + summs;
}

/* ---- float dots: 4 independent accumulators, then a scalar tail ---------- */

static inline __m256 load8_f32(const void *p, int i) { return _mm256_loadu_ps((const float *)p + i); }
static inline __m256 load8_f16(const void *p, int i) { return vmath_load8_f16((const quant_f16 *)p + i); }
static inline __m256 load8_bf16(const void *p, int i) { return vmath_load8_bf16((const quant_bf16 *)p + i); }

#define FLOAT_DOT_AVX2(name, load8, scalar)                                           \
    void name(int n, float *s, const void *vx, const void *vy)                        \
    {                                                                                 \
        const float *y = vy;                                                          \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                   \
        int i = 0;                                                                    \
        for (; i + 32 <= n; i += 32) {                                                \
            a0 = _mm256_fmadd_ps(load8(vx, i), _mm256_loadu_ps(y + i), a0);           \
            a1 = _mm256_fmadd_ps(load8(vx, i + 8), _mm256_loadu_ps(y + i + 8), a1);   \
            a2 = _mm256_fmadd_ps(load8(vx, i + 16), _mm256_loadu_ps(y + i + 16), a2); \
            a3 = _mm256_fmadd_ps(load8(vx, i + 24), _mm256_loadu_ps(y + i + 24), a3); \
        }                                                                             \
        for (; i + 8 <= n; i += 8)                                                    \
            a0 = _mm256_fmadd_ps(load8(vx, i), _mm256_loadu_ps(y + i), a0);           \
        float sum = hsum_256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))); \
        for (; i < n; i++)                                                            \
            sum += scalar * y[i];                                                     \
        *s = sum;                                                                     \
    }

FLOAT_DOT_AVX2(quant_vec_dot_f32_avx2, load8_f32, ((const float *)vx)[i])
FLOAT_DOT_AVX2(quant_vec_dot_f16_avx2, load8_f16, quant_f16_to_f32(((const quant_f16 *)vx)[i]))
FLOAT_DOT_AVX2(quant_vec_dot_bf16_avx2, load8_bf16, quant_bf16_to_f32(((const quant_bf16 *)vx)[i]))

/* ---- Q8_0 quantization (bit-exact with quant_q8_0_from_float_ref) ---------- */

/* roundf: nearest, ties away from zero (v - trunc(v) is exact). */
static inline __m256 round_away_256(__m256 v)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 frac = _mm256_andnot_ps(sign, _mm256_sub_ps(v, t));
    const __m256 up = _mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    const __m256 one = _mm256_or_ps(_mm256_set1_ps(1.0f), _mm256_and_ps(v, sign));
    return _mm256_add_ps(t, _mm256_and_ps(up, one));
}

static inline float hmax_256(__m256 v)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* A block of 32 floats into v[4]; returns max |x| (a NaN lane keeps the
 * other operand, as fmaxf). */
static inline float load_block_amax(const float *x, __m256 v[4])
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_loadu_ps(x + 8 * k);
        m = _mm256_max_ps(_mm256_andnot_ps(sign, v[k]), m);
    }
    return hmax_256(m);
}

void quant_q8_0_from_float_avx2(const float *x, void *vy, int64_t n)
{
    block_q8_0 *y = vy;
    for (int64_t i = 0; i < n / QK8_0; i++, x += QK8_0) {
        __m256 v[4];
        const float d = load_block_amax(x, v) / ((1 << 7) - 1);
        const __m256 id = _mm256_set1_ps(d ? 1.0f / d : 0.0f);
        __m256i q[4];
        for (int k = 0; k < 4; k++)
            q[k] = _mm256_cvtps_epi32(round_away_256(_mm256_mul_ps(v[k], id)));
        /* the low byte of each int32, as the reference's cast keeps it (a NaN
         * from an infinite input becomes 0, not -128): mask, then packs that
         * cannot saturate; they interleave the 128-bit lanes, and dwords
         * 0 4 1 5 2 6 3 7 put them back */
        const __m256i lo = _mm256_set1_epi32(0xFF);
        for (int k = 0; k < 4; k++)
            q[k] = _mm256_and_si256(q[k], lo);
        const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(q[0], q[1]), _mm256_packus_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)y[i].qs,
                            _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        y[i].d = quant_f32_to_f16(d);
    }
}

/* quant_q8_0_act_from_float_ref's rounding: x * (127 / amax), nearest even
 * (cvtps2dq in the default rounding mode). */
void quant_q8_0_act_from_float_avx2(const float *x, void *vy, int64_t n)
{
    block_q8_0 *y = vy;
    for (int64_t i = 0; i < n / QK8_0; i++, x += QK8_0) {
        __m256 v[4];
        const float amax = load_block_amax(x, v);
        const __m256 id = _mm256_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
        __m256i q[4];
        const __m256i lo = _mm256_set1_epi32(0xFF);
        for (int k = 0; k < 4; k++)
            q[k] = _mm256_and_si256(_mm256_cvtps_epi32(_mm256_mul_ps(v[k], id)), lo);
        const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(q[0], q[1]), _mm256_packus_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)y[i].qs,
                            _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        y[i].d = quant_f32_to_f16(amax / 127);
    }
}

#endif /* QUANT_HAVE_AVX2 */

#if defined(QUANT_HAVE_AVX512)
/* ---- AVX-512 VNNI: two blocks per 512-bit step, AVX2 step for an odd tail - */

static inline __m512i join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }

static inline __m512 scale2(float d0, float d1)
{
    return _mm512_insertf32x8(_mm512_set1_ps(d0), _mm256_set1_ps(d1), 1);
}

/* dot of unsigned x and signed y bytes, minus k * sum(y): x holds values + k. */
static inline __m512 dot_u8_off(__m512i ux, __m512i y, int k)
{
    __m512i z = _mm512_setzero_si512();
    __m512i corr = k ? _mm512_dpbusd_epi32(z, _mm512_set1_epi8((char)k), y) : z;
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_sub_epi32(z, corr), ux, y));
}

static inline __m512i q8_pair(const int8_t *a, const int8_t *b) { return join(load_q8(a), load_q8(b)); }

/* The generic shape: pairs of blocks in zmm, then one block in ymm. */
#define QDOT_AVX512(name, bx_t, by_t, PAIR_DOT, ONE_DOT, MIN_TERM)                          \
    void name(int n, float *s, const void *vx, const void *vy)                             \
    {                                                                                      \
        const bx_t *x = vx;                                                                \
        const by_t *y = vy;                                                                \
        const int nb = n / 32;                                                             \
        __m512 acc = _mm512_setzero_ps();                                                  \
        float mins = 0;                                                                    \
        int i = 0;                                                                         \
        for (; i + 2 <= nb; i += 2) {                                                      \
            __m512 d = scale2(F16(x[i].d) * F16(y[i].d), F16(x[i + 1].d) * F16(y[i + 1].d)); \
            __m512i qy = q8_pair(y[i].qs, y[i + 1].qs);                                    \
            acc = _mm512_fmadd_ps(d, PAIR_DOT, acc);                                       \
            mins += MIN_TERM(i) + MIN_TERM(i + 1);                                         \
        }                                                                                  \
        float sum = _mm512_reduce_add_ps(acc);                                             \
        if (i < nb) {                                                                      \
            __m256 d = _mm256_set1_ps(F16(x[i].d) * F16(y[i].d));                          \
            sum += hsum_256(_mm256_mul_ps(d, ONE_DOT));                                    \
            mins += MIN_TERM(i);                                                           \
        }                                                                                  \
        *s = sum + mins;                                                                   \
    }

#define NO_MIN(i) 0.0f
#define Q_MIN(i) (F16(x[i].m) * F16(y[i].s))

/* Q4_0 and Q8_0: the reference's fma chain over the blocks (quant_ref.c) */
void quant_vec_dot_q8_0_q8_0_avx512(int n, float *s, const void *vx, const void *vy)
{
    CHAIN_DOT(q8_0_isum, (const block_q8_0 *)vx, (const block_q8_0 *)vy, n, s);
}

void quant_vec_dot_q4_0_q8_0_avx512(int n, float *s, const void *vx, const void *vy)
{
    CHAIN_DOT(q4_0_isum, (const block_q4_0 *)vx, (const block_q8_0 *)vy, n, s);
}
QDOT_AVX512(quant_vec_dot_q4_1_q8_1_avx512, block_q4_1, block_q8_1,
            dot_u8_off(join(nibbles_32(x[i].qs), nibbles_32(x[i + 1].qs)), qy, 0),
            dot_u8_ps(nibbles_32(x[i].qs), load_q8(y[i].qs)), Q_MIN)

/* q5_0 and q5_1 keep ggml's 8 lanes (quant_internal.h): the 256-bit kernels,
 * whose dot_u8_i8 is vpdpbusd here. */
void quant_vec_dot_q5_0_q8_0_avx512(int n, float *s, const void *vx, const void *vy)
{
    quant_vec_dot_q5_0_q8_0_avx2(n, s, vx, vy);
}

void quant_vec_dot_q5_1_q8_1_avx512(int n, float *s, const void *vx, const void *vy)
{
    quant_vec_dot_q5_1_q8_1_avx2(n, s, vx, vy);
}

static inline __m512 load16_f32(const void *p, int i) { return _mm512_loadu_ps((const float *)p + i); }
static inline __m512 load16_f16(const void *p, int i) { return vmath_load16_f16((const quant_f16 *)p + i); }
static inline __m512 load16_bf16(const void *p, int i) { return vmath_load16_bf16((const quant_bf16 *)p + i); }

#define FLOAT_DOT_AVX512(name, load16, scalar)                                             \
    void name(int n, float *s, const void *vx, const void *vy)                             \
    {                                                                                      \
        const float *y = vy;                                                               \
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                        \
        int i = 0;                                                                         \
        for (; i + 64 <= n; i += 64) {                                                     \
            a0 = _mm512_fmadd_ps(load16(vx, i), _mm512_loadu_ps(y + i), a0);              \
            a1 = _mm512_fmadd_ps(load16(vx, i + 16), _mm512_loadu_ps(y + i + 16), a1);    \
            a2 = _mm512_fmadd_ps(load16(vx, i + 32), _mm512_loadu_ps(y + i + 32), a2);    \
            a3 = _mm512_fmadd_ps(load16(vx, i + 48), _mm512_loadu_ps(y + i + 48), a3);    \
        }                                                                                  \
        for (; i + 16 <= n; i += 16)                                                       \
            a0 = _mm512_fmadd_ps(load16(vx, i), _mm512_loadu_ps(y + i), a0);               \
        float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))); \
        for (; i < n; i++)                                                                 \
            sum += scalar * y[i];                                                          \
        *s = sum;                                                                          \
    }

FLOAT_DOT_AVX512(quant_vec_dot_f32_avx512, load16_f32, ((const float *)vx)[i])
FLOAT_DOT_AVX512(quant_vec_dot_f16_avx512, load16_f16, quant_f16_to_f32(((const quant_f16 *)vx)[i]))
FLOAT_DOT_AVX512(quant_vec_dot_bf16_avx512, load16_bf16, quant_bf16_to_f32(((const quant_bf16 *)vx)[i]))

/* ---- Q8_0 quantization (bit-exact with quant_q8_0_from_float_ref) ---------- */

/* roundf: nearest, ties away from zero (v - trunc(v) is exact). */
static inline __m512 round_away(__m512 v)
{
    __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __m512 frac = _mm512_abs_ps(_mm512_sub_ps(v, t));
    __mmask16 up = _mm512_cmp_ps_mask(frac, _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    __m512 one = _mm512_or_ps(_mm512_set1_ps(1.0f), _mm512_and_ps(v, _mm512_set1_ps(-0.0f)));
    return _mm512_mask_add_ps(t, up, t, one);
}

/* The sum of 16 int32 lanes with wrapping vector adds (no signed overflow). */
static inline int hsum_epi32_wrap(__m512i v)
{
    return vmath_hsum8_epi32(_mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)));
}

float quant_q8_0_block_avx512(const float *x, int8_t *q, int *sum)
{
    __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    /* a NaN lane keeps the other operand, as fmaxf does */
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float d = amax / 127;
    const float id = d ? 1.0f / d : 0.0f;
    __m512i qa = _mm512_cvtps_epi32(round_away(_mm512_mul_ps(a, _mm512_set1_ps(id))));
    __m512i qb = _mm512_cvtps_epi32(round_away(_mm512_mul_ps(b, _mm512_set1_ps(id))));
    /* the low byte, as the reference's cast keeps it (NaN from an infinite input: 0) */
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(qb));
    if (sum) /* wrapping adds: an infinite input's lanes hold INT_MIN */
        *sum = hsum_epi32_wrap(_mm512_add_epi32(qa, qb));
    return d;
}

/* ggml-cpu's x86 quantize_row_q8_0 on one block of activations (see
 * quant_q8_0_act_from_float): x * (127 / amax) rounded to nearest even. */
float quant_q8_0_act_block_avx512(const float *x, int8_t *q, int *sum)
{
    __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const __m512 id = _mm512_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
    __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, id)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, id));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(qb));
    if (sum)
        *sum = hsum_epi32_wrap(_mm512_add_epi32(qa, qb));
    return amax / 127;
}

static void q8_0_from_float_avx512(const float *x, void *vy, int64_t n)
{
    block_q8_0 *y = vy;
    for (int64_t i = 0; i < n / QK8_0; i++)
        y[i].d = quant_f32_to_f16(quant_q8_0_block_avx512(x + i * QK8_0, y[i].qs, NULL));
}

#endif /* QUANT_HAVE_AVX512 */

#if defined(QUANT_HAVE_AVX512)
/* ---- float conversions ----------------------------------------------------- */

static void f16_to_float_avx512(const void *vx, float *y, int64_t n)
{
    const quant_f16 *x = vx;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, vmath_load16_f16(x + i));
    for (; i < n; i++)
        y[i] = quant_f16_to_f32(x[i]);
}

static void bf16_to_float_avx512(const void *vx, float *y, int64_t n)
{
    const quant_bf16 *x = vx;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, vmath_load16_bf16(x + i));
    for (; i < n; i++)
        y[i] = quant_bf16_to_f32(x[i]);
}

/* Round to nearest even, exactly as quant_f32_to_f16 (F16C). */
static void f16_from_float_avx512(const float *x, void *vy, int64_t n)
{
    quant_f16 *y = vy;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(y + i), _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++)
        y[i] = quant_f32_to_f16(x[i]);
}
#endif

void quant_q8_0_act_from_float(const float *x, void *vy, int64_t n)
{
#if defined(QUANT_HAVE_AVX512)
    block_q8_0 *y = vy;
    for (int64_t i = 0; i < n / QK8_0; i++)
        y[i].d = quant_f32_to_f16(quant_q8_0_act_block_avx512(x + i * QK8_0, y[i].qs, NULL));
#elif defined(QUANT_HAVE_AVX2)
    quant_q8_0_act_from_float_avx2(x, vy, n);
#else
    quant_q8_0_act_from_float_ref(x, vy, n);
#endif
}

#define SET_DOTS(t, isa)                                                     \
    do {                                                                     \
        t[QUANT_F32].vec_dot = quant_vec_dot_f32_##isa;                      \
        t[QUANT_F16].vec_dot = quant_vec_dot_f16_##isa;                      \
        t[QUANT_BF16].vec_dot = quant_vec_dot_bf16_##isa;                    \
        t[QUANT_Q4_0].vec_dot = quant_vec_dot_q4_0_q8_0_##isa;               \
        t[QUANT_Q4_1].vec_dot = quant_vec_dot_q4_1_q8_1_##isa;               \
        t[QUANT_Q5_0].vec_dot = quant_vec_dot_q5_0_q8_0_##isa;               \
        t[QUANT_Q5_1].vec_dot = quant_vec_dot_q5_1_q8_1_##isa;               \
        t[QUANT_Q8_0].vec_dot = quant_vec_dot_q8_0_q8_0_##isa;               \
    } while (0)

void quant_simd_fill(struct quant_traits *best)
{
#if defined(QUANT_HAVE_AVX512)
    SET_DOTS(best, avx512);
    best[QUANT_F16].to_float = f16_to_float_avx512;
    best[QUANT_F16].from_float = f16_from_float_avx512;
    best[QUANT_BF16].to_float = bf16_to_float_avx512;
    best[QUANT_Q8_0].from_float = q8_0_from_float_avx512;
#elif defined(QUANT_HAVE_AVX2)
    SET_DOTS(best, avx2);
    best[QUANT_Q8_0].from_float = quant_q8_0_from_float_avx2;
#else
    (void)best;
#endif
}
