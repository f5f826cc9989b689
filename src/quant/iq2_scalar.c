/* IQ2_XXS, IQ2_XS, IQ1_S, IQ1_M: scalar reference dequantizers (ggml's
 * dequantize_row_* bit for bit), the block unpacker every vec_dot reads, the
 * scalar vec_dots (the bits of llama.cpp's x86 kernels, see iq2.h) and the
 * traits entries. */
#include "quant/iq2.h"

/* ==== block fields ========================================================= */

static inline uint32_t load_u32(const void *p)
{
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* IQ2_XXS sub-block ib: grid index of group l, its sign byte, and ls. */
static inline int xxs_index(const block_iq2_xxs *b, int ib, int l) { return ((const uint8_t *)b->qs)[8 * ib + l]; }
static inline uint32_t xxs_aux(const block_iq2_xxs *b, int ib) { return load_u32((const uint8_t *)b->qs + 8 * ib + 4); }
static inline uint8_t xxs_signs(const block_iq2_xxs *b, int ib, int l)
{
    return quant_iq2_ksigns[(xxs_aux(b, ib) >> (7 * l)) & 127];
}
static inline int xxs_ls(const block_iq2_xxs *b, int ib) { return (int)(xxs_aux(b, ib) >> 28); }

/* IQ1_S group g (0..31): its 11-bit grid index. */
static inline int iq1s_index(const block_iq1_s *b, int g)
{
    return b->qs[g] | (((b->qh[g / 4] >> (3 * (g % 4))) & 7) << 8);
}

/* IQ1_M group g: its grid index and whether its delta is negative; the
 * 3-bit ls of 16-element half h (0..15) and the super-scale. */
static inline int iq1m_index(const block_iq1_m *b, int g)
{
    return b->qs[g] | (((b->qh[g / 2] >> (4 * (g % 2))) & 7) << 8);
}
static inline bool iq1m_delta_neg(const block_iq1_m *b, int g) { return (b->qh[g / 2] >> (4 * (g % 2) + 3)) & 1; }
static inline uint16_t iq1m_sc(const block_iq1_m *b, int k)
{
    uint16_t v;
    memcpy(&v, b->scales + 2 * k, sizeof v);
    return v;
}
static inline int iq1m_ls(const block_iq1_m *b, int h) { return (iq1m_sc(b, h / 4) >> (3 * (h % 4))) & 7; }
static inline float iq1m_d(const block_iq1_m *b)
{
    iq1m_scale_t sc;
    sc.u16 = (uint16_t)((iq1m_sc(b, 0) >> 12) | ((iq1m_sc(b, 1) >> 8) & 0x00f0) | ((iq1m_sc(b, 2) >> 4) & 0x0f00) |
                        (iq1m_sc(b, 3) & 0xf000));
    return kq_f16_to_f32(sc.f16);
}

static inline uint8_t grid_byte(uint64_t g, int j) { return (uint8_t)(g >> (8 * j)); }

/* ==== dequantize =========================================================== */

void quant_dequantize_row_iq2_xxs(const void *vx, float *y, int64_t n)
{
    const block_iq2_xxs *x = vx;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = kq_f16_to_f32(x[i].d);
        for (int ib = 0; ib < QK_K / 32; ib++) {
            const float db = d * (0.5f + (float)xxs_ls(&x[i], ib)) * 0.25f;
            for (int l = 0; l < 4; l++) {
                const uint64_t g = quant_iq2xxs_grid[xxs_index(&x[i], ib, l)];
                const uint8_t signs = xxs_signs(&x[i], ib, l);
                for (int j = 0; j < 8; j++)
                    *y++ = db * (float)grid_byte(g, j) * ((signs >> j) & 1 ? -1.f : 1.f);
            }
        }
    }
}

void quant_dequantize_row_iq2_xs(const void *vx, float *y, int64_t n)
{
    const block_iq2_xs *x = vx;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = kq_f16_to_f32(x[i].d);
        for (int ib = 0; ib < QK_K / 32; ib++) {
            const float db[2] = {d * (0.5f + (float)(x[i].scales[ib] & 0xf)) * 0.25f,
                                 d * (0.5f + (float)(x[i].scales[ib] >> 4)) * 0.25f};
            for (int l = 0; l < 4; l++) {
                const uint16_t q = x[i].qs[4 * ib + l];
                const uint64_t g = quant_iq2xs_grid[q & 511];
                const uint8_t signs = quant_iq2_ksigns[q >> 9];
                for (int j = 0; j < 8; j++)
                    *y++ = db[l / 2] * (float)grid_byte(g, j) * ((signs >> j) & 1 ? -1.f : 1.f);
            }
        }
    }
}

void quant_dequantize_row_iq1_s(const void *vx, float *y, int64_t n)
{
    const block_iq1_s *x = vx;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = kq_f16_to_f32(x[i].d);
        for (int ib = 0; ib < QK_K / 32; ib++) {
            const float dl = d * (float)(2 * ((x[i].qh[ib] >> 12) & 7) + 1);
            const float delta = x[i].qh[ib] & 0x8000 ? -QUANT_IQ1S_DELTA : QUANT_IQ1S_DELTA;
            for (int l = 0; l < 4; l++) {
                const uint64_t g = quant_iq1s_grid[iq1s_index(&x[i], 4 * ib + l)];
                for (int j = 0; j < 8; j++)
                    *y++ = dl * ((float)(int8_t)grid_byte(g, j) + delta);
            }
        }
    }
}

void quant_dequantize_row_iq1_m(const void *vx, float *y, int64_t n)
{
    const block_iq1_m *x = vx;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = iq1m_d(&x[i]);
        for (int g = 0; g < QK_K / 8; g++) {
            const float dl = d * (float)(2 * iq1m_ls(&x[i], g / 2) + 1);
            const float delta = iq1m_delta_neg(&x[i], g) ? -QUANT_IQ1M_DELTA : QUANT_IQ1M_DELTA;
            const uint64_t grid = quant_iq1s_grid[iq1m_index(&x[i], g)];
            for (int j = 0; j < 8; j++)
                *y++ = dl * ((float)(int8_t)grid_byte(grid, j) + delta);
        }
    }
}

/* ==== unpack ================================================================ */

/* An int8 grid entry of -1/0/1 bytes: magnitudes into mag, negatives as 8 bits. */
static uint8_t unpack_signed8(uint64_t g, uint8_t *mag)
{
    uint8_t neg = 0;
    for (int j = 0; j < 8; j++) {
        int8_t v = (int8_t)grid_byte(g, j);
        mag[j] = (uint8_t)(v < 0 ? -v : v);
        neg |= (uint8_t)((v < 0) << j);
    }
    return neg;
}

static void set_neg8(uint64_t *neg, int g, uint8_t bits) { neg[g / 8] |= (uint64_t)bits << (8 * (g % 8)); }

static void unpack_iq2_xxs(const block_iq2_xxs *b, struct iq2_unpacked *u)
{
    u->d = kq_f16_to_f32(b->d);
    for (int ib = 0; ib < QK_K / 32; ib++) {
        u->scale[2 * ib] = u->scale[2 * ib + 1] = (int16_t)(2 * xxs_ls(b, ib) + 1);
        for (int l = 0; l < 4; l++) {
            memcpy(u->mag + 32 * ib + 8 * l, &quant_iq2xxs_grid[xxs_index(b, ib, l)], 8);
            set_neg8(u->neg, 4 * ib + l, xxs_signs(b, ib, l));
        }
    }
}

static void unpack_iq2_xs(const block_iq2_xs *b, struct iq2_unpacked *u)
{
    u->d = kq_f16_to_f32(b->d);
    for (int ib = 0; ib < QK_K / 32; ib++) {
        u->scale[2 * ib] = (int16_t)(2 * (b->scales[ib] & 0xf) + 1);
        u->scale[2 * ib + 1] = (int16_t)(2 * (b->scales[ib] >> 4) + 1);
    }
    for (int g = 0; g < QK_K / 8; g++) {
        memcpy(u->mag + 8 * g, &quant_iq2xs_grid[b->qs[g] & 511], 8);
        set_neg8(u->neg, g, quant_iq2_ksigns[b->qs[g] >> 9]);
    }
}

static void unpack_iq1_s(const block_iq1_s *b, struct iq2_unpacked *u)
{
    u->d = kq_f16_to_f32(b->d);
    for (int ib = 0; ib < QK_K / 32; ib++) {
        int ls = 2 * ((b->qh[ib] >> 12) & 7) + 1;
        u->scale[2 * ib] = u->scale[2 * ib + 1] = (int16_t)ls;
        u->bsum_coef[ib] = (int16_t)(b->qh[ib] & 0x8000 ? -ls : ls);
    }
    for (int g = 0; g < QK_K / 8; g++)
        set_neg8(u->neg, g, unpack_signed8(quant_iq1s_grid[iq1s_index(b, g)], u->mag + 8 * g));
}

static void unpack_iq1_m(const block_iq1_m *b, struct iq2_unpacked *u)
{
    u->d = iq1m_d(b);
    for (int h = 0; h < QK_K / 16; h++)
        u->scale[h] = (int16_t)(2 * iq1m_ls(b, h) + 1);
    for (int g = 0; g < QK_K / 8; g++) {
        set_neg8(u->neg, g, unpack_signed8(quant_iq1s_grid[iq1m_index(b, g)], u->mag + 8 * g));
        set_neg8(u->dneg, g, iq1m_delta_neg(b, g) ? 0xff : 0);
    }
}

void quant_iq2_unpack(enum quant_type t, const void *x, struct iq2_unpacked *u)
{
    memset(u->neg, 0, sizeof u->neg);
    memset(u->dneg, 0, sizeof u->dneg);
    switch (t) {
    case QUANT_IQ2_XXS: unpack_iq2_xxs(x, u); break;
    case QUANT_IQ2_XS: unpack_iq2_xs(x, u); break;
    case QUANT_IQ1_S: unpack_iq1_s(x, u); break;
    default: unpack_iq1_m(x, u); break;
    }
}

/* ==== vec_dot ============================================================== */

static size_t block_bytes(enum quant_type t)
{
    switch (t) {
    case QUANT_IQ2_XXS: return sizeof(block_iq2_xxs);
    case QUANT_IQ2_XS: return sizeof(block_iq2_xs);
    case QUANT_IQ1_S: return sizeof(block_iq1_s);
    default: return sizeof(block_iq1_m);
    }
}

static inline bool neg_bit(const uint64_t *neg, int e) { return (neg[e / 64] >> (e % 64)) & 1; }

static void dot_scalar(enum quant_type t, int n, float *s, const void *vx, const void *vy)
{
    const uint8_t *x = vx;
    const block_q8_K *y = vy;
    const size_t bb = block_bytes(t);
    float acc[8] = {0}, acc2[8] = {0}, acc1 = 0;
    struct iq2_unpacked u;
    for (int i = 0; i < n / QK_K; i++) {
        kq_prefetch_block(x + i * bb, bb);
        quant_iq2_unpack(t, x + i * bb, &u);
        int32_t lane[8] = {0}, lane2[8] = {0};
        for (int e = 0; e < QK_K; e++) {
            const int k = (e % 32) / 4, sc = u.scale[e / 16], q = y[i].qs[e];
            lane[k] += sc * (neg_bit(u.neg, e) ? -u.mag[e] : u.mag[e]) * q;
            lane2[k] += sc * (neg_bit(u.dneg, e) ? -q : q);
        }
        const float d = y[i].d * u.d;
        for (int k = 0; k < 8; k++) {
            acc[k] = fmaf(d, (float)lane[k], acc[k]);
            acc2[k] = fmaf(d, (float)lane2[k], acc2[k]);
        }
        if (t == QUANT_IQ1_S) {
            int32_t sumi1 = 0;
            for (int ib = 0; ib < QK_K / 32; ib++)
                sumi1 += (y[i].bsums[2 * ib] + y[i].bsums[2 * ib + 1]) * u.bsum_coef[ib];
            acc1 = fmaf(d, (float)sumi1, acc1);
        }
    }
    switch (t) {
    case QUANT_IQ1_S: *s = quant_iq2_hsum8(acc) + QUANT_IQ1S_DELTA * acc1; break;
    case QUANT_IQ1_M: *s = quant_iq2_hsum8(acc) + QUANT_IQ1M_DELTA * quant_iq2_hsum8(acc2); break;
    default: *s = 0.125f * quant_iq2_hsum8(acc); break;
    }
}

void quant_vec_dot_iq2_xxs_q8_K_scalar(int n, float *s, const void *x, const void *y)
{
    dot_scalar(QUANT_IQ2_XXS, n, s, x, y);
}
void quant_vec_dot_iq2_xs_q8_K_scalar(int n, float *s, const void *x, const void *y)
{
    dot_scalar(QUANT_IQ2_XS, n, s, x, y);
}
void quant_vec_dot_iq1_s_q8_K_scalar(int n, float *s, const void *x, const void *y)
{
    dot_scalar(QUANT_IQ1_S, n, s, x, y);
}
void quant_vec_dot_iq1_m_q8_K_scalar(int n, float *s, const void *x, const void *y)
{
    dot_scalar(QUANT_IQ1_M, n, s, x, y);
}

/* ==== the best kernels and the traits ======================================= */

#if defined(IQ2_HAVE_AVX512)
#define IQ2_MULTI quant_iq2_dot_multi_avx512
#elif defined(IQ2_HAVE_AVX2)
#define IQ2_MULTI quant_iq2_dot_multi_avx2
#endif

#if defined(IQ2_MULTI)
#define IQ2_KERNELS(t, T)                                                                                   \
    static void dot_multi_##t(int n, int nt, float *s, size_t s_stride, const void *x, const void *y,      \
                              size_t y_stride)                                                              \
    {                                                                                                       \
        IQ2_MULTI(QUANT_##T, n, nt, s, s_stride, x, y, y_stride);                                           \
    }                                                                                                       \
    static void dot_best_##t(int n, float *s, const void *x, const void *y)                                 \
    {                                                                                                       \
        IQ2_MULTI(QUANT_##T, n, 1, s, 1, x, y, 0);                                                          \
    }
#else
#define IQ2_KERNELS(t, T)                                                                                   \
    static void dot_best_##t(int n, float *s, const void *x, const void *y)                                 \
    {                                                                                                       \
        quant_vec_dot_##t##_q8_K_scalar(n, s, x, y);                                                        \
    }
#endif
IQ2_KERNELS(iq2_xxs, IQ2_XXS)
IQ2_KERNELS(iq2_xs, IQ2_XS)
IQ2_KERNELS(iq1_s, IQ1_S)
IQ2_KERNELS(iq1_m, IQ1_M)

#if defined(IQ2_MULTI)
#define IQ2_MULTI_OF(t) dot_multi_##t
#else
#define IQ2_MULTI_OF(t) NULL
#endif
#define IQ2_ENTRY(T, t)                                                                                     \
    {QUANT_##T, #t, sizeof(block_##t), quant_dequantize_row_##t, quant_quantize_row_##t, NULL,             \
     quant_vec_dot_##t##_q8_K_scalar, dot_best_##t, IQ2_MULTI_OF(t)}

static const struct kq_entry iq2_table[] = {
    IQ2_ENTRY(IQ2_XXS, iq2_xxs),
    IQ2_ENTRY(IQ2_XS, iq2_xs),
    IQ2_ENTRY(IQ1_S, iq1_s),
    IQ2_ENTRY(IQ1_M, iq1_m),
};

#define IQ2_N_TYPES (sizeof iq2_table / sizeof iq2_table[0])

void quant_iq2_fill(struct quant_traits *best, struct quant_traits *scalar)
{
    kq_entries_fill(iq2_table, IQ2_N_TYPES, best, scalar);
}

quant_kq_dot_multi_fn quant_iq2_dot_multi(enum quant_type t) { return kq_entries_dot_multi(iq2_table, IQ2_N_TYPES, t); }
