/* quant: the traits tables, type names and scalar f16/bf16 conversions. */
#include <ctype.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "quant/iq4_mxfp4.h"
#include "quant/iq3.h"
#include "quant/iq2.h"
#include "quant/kq_internal.h"
#include "quant/quant_internal.h"

/* ---- f16 / bf16 --------------------------------------------------------- */

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

float quant_f16_to_f32_soft(quant_f16 h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    if (exp == 0x1f) /* inf / nan */
        return f32_from_bits(sign | 0x7f800000 | (man << 13));
    if (exp != 0)
        return f32_from_bits(sign | ((exp + 112) << 23) | (man << 13));
    if (man == 0)
        return f32_from_bits(sign);
    /* subnormal: man * 2^-24 is exact in f32 */
    float v = (float)man * 0x1p-24f;
    return sign ? -v : v;
}

quant_f16 quant_f32_to_f16_soft(float f)
{
    uint32_t x = f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    x &= 0x7fffffff;
    if (x > 0x7f800000) /* nan: keep the top payload bits, force quiet */
        return (quant_f16)(sign | 0x7e00 | ((x >> 13) & 0x3ff));
    if (x >= 0x47800000) /* >= 65536 (or inf) */
        return (quant_f16)(sign | 0x7c00);
    if (x >= 0x38800000) { /* normal half; the rounding carry may reach inf */
        uint32_t r = x - 0x38000000;
        r += 0xfff + ((r >> 13) & 1);
        return (quant_f16)(sign | (r >> 13));
    }
    if (x < 0x33000000) /* below half the smallest subnormal: +-0 */
        return sign;
    uint32_t e = x >> 23;
    uint32_t m = (x & 0x7fffff) | 0x800000;
    uint32_t shift = 126 - e; /* 14..24 */
    uint32_t r = (m + (1u << (shift - 1)) - 1 + ((m >> shift) & 1)) >> shift;
    return (quant_f16)(sign | r);
}

#if defined(__F16C__)
#include <immintrin.h>
float quant_f16_to_f32(quant_f16 h) { return _cvtsh_ss(h); }
quant_f16 quant_f32_to_f16(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
#else
float quant_f16_to_f32(quant_f16 h) { return quant_f16_to_f32_soft(h); }
quant_f16 quant_f32_to_f16(float f) { return quant_f32_to_f16_soft(f); }
#endif

float quant_bf16_to_f32(quant_bf16 h)
{
    return f32_from_bits((uint32_t)h << 16);
}

/* ggml's rounding: nearest even, NaN forced quiet, no flush of subnormals. */
quant_bf16 quant_f32_to_bf16(float f)
{
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffff) > 0x7f800000)
        return (quant_bf16)((u >> 16) | 64);
    return (quant_bf16)((u + (0x7fff + ((u >> 16) & 1))) >> 16);
}

/* ---- traits tables ------------------------------------------------------- */

static struct quant_traits g_best[QUANT_TYPE_COUNT];
static struct quant_traits g_scalar[QUANT_TYPE_COUNT];
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

struct layout {
    enum quant_type type;
    const char *name;
    int block_elems;
    size_t block_bytes;
    bool is_quantized;
    enum quant_type vec_dot_type;
};

/* Float weights keep f32 activations (no rounding of X to f16/bf16). */
static const struct layout g_layouts[] = {
    {QUANT_F32, "f32", 1, sizeof(float), false, QUANT_F32},
    {QUANT_F16, "f16", 1, sizeof(quant_f16), false, QUANT_F32},
    {QUANT_BF16, "bf16", 1, sizeof(quant_bf16), false, QUANT_F32},
    {QUANT_Q4_0, "q4_0", QK4_0, sizeof(block_q4_0), true, QUANT_Q8_0},
    {QUANT_Q4_1, "q4_1", QK4_1, sizeof(block_q4_1), true, QUANT_Q8_1},
    {QUANT_Q5_0, "q5_0", QK5_0, sizeof(block_q5_0), true, QUANT_Q8_0},
    {QUANT_Q5_1, "q5_1", QK5_1, sizeof(block_q5_1), true, QUANT_Q8_1},
    {QUANT_Q8_0, "q8_0", QK8_0, sizeof(block_q8_0), true, QUANT_Q8_0},
    {QUANT_Q8_1, "q8_1", QK8_1, sizeof(block_q8_1), true, QUANT_Q8_1},
    {QUANT_IQ4_NL, "iq4_nl", QK4_NL, sizeof(block_iq4_nl), true, QUANT_Q8_0},
    {QUANT_IQ4_XS, "iq4_xs", QK_K, sizeof(block_iq4_xs), true, QUANT_Q8_K},
    {QUANT_MXFP4, "mxfp4", QK_MXFP4, sizeof(block_mxfp4), true, QUANT_Q8_0},
    {QUANT_IQ3_NL, "iq3_nl", QK3_NL, sizeof(block_iq3_nl), true, QUANT_Q8_0},
};

static void tables_init(void)
{
    for (size_t i = 0; i < sizeof g_layouts / sizeof g_layouts[0]; i++) {
        const struct layout *l = &g_layouts[i];
        struct quant_traits t = {
            .name = l->name,
            .kv_only = l->type >= QUANT_KV_ONLY_FIRST,
            .block_elems = l->block_elems,
            .block_bytes = l->block_bytes,
            .is_quantized = l->is_quantized,
            .vec_dot_type = l->vec_dot_type,
        };
        g_best[l->type] = t;
        g_scalar[l->type] = t;
    }
    quant_kquants_fill(g_best, g_scalar);
    quant_ref_fill(g_scalar);
    /* best starts as the references; SIMD overrides what it has */
    for (int i = 0; i < QUANT_TYPE_COUNT; i++) {
        if (!g_best[i].name || (i >= QUANT_Q2_K && i <= QUANT_Q8_K))
            continue; /* the k-quant half fills both tables itself */
        g_best[i].to_float = g_scalar[i].to_float;
        g_best[i].from_float = g_scalar[i].from_float;
        g_best[i].vec_dot = g_scalar[i].vec_dot;
    }
    quant_iq3_fill(g_best, g_scalar);
    quant_iq2_fill(g_best, g_scalar); /* after the loop above, which would undo its best kernels */
    quant_simd_fill(g_best);
    quant_iq4_fill(g_best, g_scalar);
    quant_kv_fill(g_best);
    quant_kv_fill(g_scalar);
}

static const struct quant_traits *lookup(const struct quant_traits *table, enum quant_type t)
{
    if ((unsigned)t >= QUANT_TYPE_COUNT)
        return NULL;
    pthread_once(&g_once, tables_init);
    return table[t].name ? &table[t] : NULL;
}

const struct quant_traits *quant_traits(enum quant_type t) { return lookup(g_best, t); }
const struct quant_traits *quant_traits_scalar(enum quant_type t) { return lookup(g_scalar, t); }

bool quant_type_known(uint32_t id)
{
    const struct quant_traits *tr = id < QUANT_TYPE_COUNT ? quant_traits((enum quant_type)id) : NULL;
    return tr && !tr->kv_only;
}

const char *quant_type_name(enum quant_type t)
{
    const struct quant_traits *tr = quant_traits(t);
    if (tr)
        return tr->name;
    static _Thread_local char buf[32];
    snprintf(buf, sizeof buf, "unknown(%u)", (unsigned)t);
    return buf;
}

ks_status quant_type_from_name(const char *name, enum quant_type *out)
{
    if (!name || !out)
        return ks_fail(KS_ERR_INVALID_ARG, "quant_type_from_name: NULL argument");
    for (int i = 0; i < QUANT_TYPE_COUNT; i++) {
        const struct quant_traits *tr = quant_traits((enum quant_type)i);
        if (tr && strcasecmp(tr->name, name) == 0) {
            *out = (enum quant_type)i;
            return KS_OK;
        }
    }
    return ks_fail(KS_ERR_INVALID_ARG,
                   "unknown tensor type '%s' (expected one of f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, "
                   "q8_0, q8_1, q2_K, q3_K, q4_K, q5_K, q6_K, q8_K, iq4_nl, iq4_xs, mxfp4, iq3_xxs, iq3_s, iq2_s, "
                   "iq2_xxs, iq2_xs, iq1_s, iq1_m)",
                   name);
}

size_t quant_row_size(enum quant_type t, int64_t n)
{
    const struct quant_traits *tr = quant_traits(t);
    if (!tr || n < 0 || n % tr->block_elems != 0)
        return 0;
    return (size_t)(n / tr->block_elems) * tr->block_bytes;
}
