/* quant: tensor element types with ggml's exact block layouts, their scalar
 * reference (de)quantizers, and the integer-dot-product matmul kernels
 * (scalar, AVX2, AVX-512/VNNI) that the model and KV cache run on.
 *
 * Layouts are contracts: each block is a named struct with a static assert on
 * its size, so the on-disk GGUF layout is checked by the compiler. The
 * numeric values of enum quant_type are ggml's type ids as stored in GGUF,
 * but for kvserve's own KV-only types (from QUANT_KV_ONLY_FIRST on, beyond
 * ggml's ids), which no GGUF file holds and no weight uses.
 *
 * Dispatch goes through one traits table (quant_traits()). The table's
 * vec_dot/matmul entries are the best kernels compiled into this build; the
 * scalar references stay reachable for tests (quant_traits_scalar()). */
#ifndef KS_QUANT_H
#define KS_QUANT_H

#include <assert.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "status/status.h"
#include "threads/threads.h"

enum quant_type {
    QUANT_F32 = 0,
    QUANT_F16 = 1,
    QUANT_Q4_0 = 2,
    QUANT_Q4_1 = 3,
    QUANT_Q5_0 = 6,
    QUANT_Q5_1 = 7,
    QUANT_Q8_0 = 8,
    QUANT_Q8_1 = 9,
    QUANT_Q2_K = 10,
    QUANT_Q3_K = 11,
    QUANT_Q4_K = 12,
    QUANT_Q5_K = 13,
    QUANT_Q6_K = 14,
    QUANT_Q8_K = 15,
    QUANT_IQ2_XXS = 16,
    QUANT_IQ2_XS = 17,
    QUANT_IQ3_XXS = 18,
    QUANT_IQ1_S = 19,
    QUANT_IQ4_NL = 20,
    QUANT_IQ3_S = 21,
    QUANT_IQ2_S = 22,
    QUANT_IQ4_XS = 23,
    QUANT_IQ1_M = 29,
    QUANT_BF16 = 30,
    QUANT_MXFP4 = 39,
    QUANT_KV_ONLY_FIRST = 64, /* kvserve's own types, KV cache rows only (ggml's largest id is 39) */
    QUANT_IQ3_NL = 64,
    QUANT_TYPE_COUNT = 65, /* one past the largest id; ids in between are unknown */
};

typedef uint16_t quant_f16; /* IEEE half, stored as bits */
typedef uint16_t quant_bf16;

#define QK4_0 32
#define QK4_1 32
#define QK5_0 32
#define QK5_1 32
#define QK8_0 32
#define QK8_1 32
#define QK4_NL 32
#define QK3_NL 32
#define QK_MXFP4 32
#define QK_K 256
#define K_SCALE_SIZE 12

typedef struct { quant_f16 d; uint8_t qs[QK4_0 / 2]; } block_q4_0;
static_assert(sizeof(block_q4_0) == 2 + QK4_0 / 2, "block_q4_0 size");
typedef struct { quant_f16 d, m; uint8_t qs[QK4_1 / 2]; } block_q4_1;
static_assert(sizeof(block_q4_1) == 4 + QK4_1 / 2, "block_q4_1 size");
typedef struct { quant_f16 d; uint8_t qh[4]; uint8_t qs[QK5_0 / 2]; } block_q5_0;
static_assert(sizeof(block_q5_0) == 2 + 4 + QK5_0 / 2, "block_q5_0 size");
typedef struct { quant_f16 d, m; uint8_t qh[4]; uint8_t qs[QK5_1 / 2]; } block_q5_1;
static_assert(sizeof(block_q5_1) == 4 + 4 + QK5_1 / 2, "block_q5_1 size");
typedef struct { quant_f16 d; int8_t qs[QK8_0]; } block_q8_0;
static_assert(sizeof(block_q8_0) == 2 + QK8_0, "block_q8_0 size");
typedef struct { quant_f16 d, s; int8_t qs[QK8_1]; } block_q8_1; /* s = d * sum(qs) */
static_assert(sizeof(block_q8_1) == 4 + QK8_1, "block_q8_1 size");
/* IQ4_NL: 4-bit indices into quant_iq4nl_values (non-linear levels), times d. */
typedef struct { quant_f16 d; uint8_t qs[QK4_NL / 2]; } block_iq4_nl;
static_assert(sizeof(block_iq4_nl) == 2 + QK4_NL / 2, "block_iq4_nl size");
/* ggml's kvalues_iq4nl: the 16 levels an IQ4_NL index selects. */
extern const int8_t quant_iq4nl_values[16];
/* IQ4_XS: IQ4_NL's levels in super-blocks of QK_K, eight blocks of 32 with a
 * 6-bit scale each: block ib's scale is ((scales_l[ib / 2] >> 4 * (ib % 2)) & 15)
 * | ((scales_h >> 2 * ib) & 3) << 4, minus 32, times d. qs as IQ4_NL's, per
 * block of 32: byte j holds element j (low nibble) and j + 16 (high). */
typedef struct { quant_f16 d; uint16_t scales_h; uint8_t scales_l[QK_K / 64]; uint8_t qs[QK_K / 2]; } block_iq4_xs;
static_assert(sizeof(block_iq4_xs) == 2 + 2 + QK_K / 64 + QK_K / 2, "block_iq4_xs size");
/* MXFP4 (OCP microscaling FP4): 4-bit E2M1 codes, times 2^(e - 127) with e an
 * E8M0 exponent. Stored as ggml does: the codes index quant_mxfp4_values,
 * which are twice the E2M1 values, and the scale is taken at half,
 * 2^(e - 128). Nibbles as IQ4_NL's. */
typedef struct { uint8_t e; uint8_t qs[QK_MXFP4 / 2]; } block_mxfp4;
static_assert(sizeof(block_mxfp4) == 1 + QK_MXFP4 / 2, "block_mxfp4 size");
/* ggml's kvalues_mxfp4: the E2M1 values doubled (0, 0.5, 1, ... 6 -> 0, 1, 2, ... 12). */
extern const int8_t quant_mxfp4_values[16];
/* IQ3_NL, kvserve's own 3.5-bit KV type (not a ggml or llama.cpp type): 3-bit
 * indices into quant_iq3nl_values, times d. Element j's index has its low two
 * bits at bits 2 * (j / 8) of qs[j % 8] and its third bit at bit j of qh
 * (little-endian, as q5_0 keeps its fifth bits). */
typedef struct { quant_f16 d; uint8_t qs[QK3_NL / 4]; uint8_t qh[QK3_NL / 8]; } block_iq3_nl;
static_assert(sizeof(block_iq3_nl) == 2 + QK3_NL / 4 + QK3_NL / 8, "block_iq3_nl size");
/* The 8 levels an IQ3_NL index selects: Lloyd-Max levels for a Gaussian
 * (rows are stored after the Hadamard rotation), the outer at 127. */
extern const int8_t quant_iq3nl_values[8];

typedef struct { uint8_t scales[QK_K / 16]; uint8_t qs[QK_K / 4]; quant_f16 d, dmin; } block_q2_K;
static_assert(sizeof(block_q2_K) == 2 * 2 + QK_K / 16 + QK_K / 4, "block_q2_K size");
typedef struct { uint8_t hmask[QK_K / 8]; uint8_t qs[QK_K / 4]; uint8_t scales[12]; quant_f16 d; } block_q3_K;
static_assert(sizeof(block_q3_K) == 2 + QK_K / 4 + QK_K / 8 + 12, "block_q3_K size");
typedef struct { quant_f16 d, dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qs[QK_K / 2]; } block_q4_K;
static_assert(sizeof(block_q4_K) == 2 * 2 + K_SCALE_SIZE + QK_K / 2, "block_q4_K size");
typedef struct { quant_f16 d, dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2]; } block_q5_K;
static_assert(sizeof(block_q5_K) == 2 * 2 + K_SCALE_SIZE + QK_K / 2 + QK_K / 8, "block_q5_K size");
typedef struct { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; quant_f16 d; } block_q6_K;
static_assert(sizeof(block_q6_K) == 2 + QK_K / 16 + 3 * QK_K / 4, "block_q6_K size");
typedef struct { float d; int8_t qs[QK_K]; int16_t bsums[QK_K / 16]; } block_q8_K;
static_assert(sizeof(block_q8_K) == 4 + QK_K + QK_K / 16 * 2, "block_q8_K size");

/* Grid ("i-quant") super-blocks of 256: each group of 4 or 8 magnitudes is
 * one point of a fixed grid (quant/iq3.h has the grids), each element has a
 * sign bit, each 32 (IQ2_S: 16) elements a 4-bit scale ls, times d.
 * IQ3_XXS: qs[0..63] one grid index per 4 elements; then per 32 elements a
 * little-endian u32: four 7-bit sign fields (one per 8 elements, the 8th
 * sign makes the count of minus signs even) and ls in the top 4 bits;
 * value = d * (0.5 + ls) * 0.5 * grid. */
typedef struct { quant_f16 d; uint8_t qs[3 * QK_K / 8]; } block_iq3_xxs;
static_assert(sizeof(block_iq3_xxs) == 2 + 3 * QK_K / 8, "block_iq3_xxs size");
/* IQ3_S: 9-bit grid indices per 4 elements (low bits in qs, bit 8 of 32-block
 * b's group k at bit k of qh[b]), one sign bit per element (signs, bit j of
 * byte k: element 8k + j), ls of 32-block b in nibble b % 2 of scales[b / 2];
 * value = d * (1 + 2 ls) * grid. */
typedef struct { quant_f16 d; uint8_t qs[QK_K / 4]; uint8_t qh[QK_K / 32]; uint8_t signs[QK_K / 8]; uint8_t scales[QK_K / 64]; } block_iq3_s;
static_assert(sizeof(block_iq3_s) == 2 + 13 * (QK_K / 32) + QK_K / 64, "block_iq3_s size");
/* IQ2_S: 10-bit grid indices per 8 elements (low bits in qs[0..31], bits 8-9
 * of 32-block b's group l at bits 2l of qh[b]), sign bits in qs[32..63] (one
 * byte per 8 elements), ls of 32-block b's first and second 16 elements in
 * the low and high nibble of scales[b]; value = d * (0.5 + ls) * 0.25 * grid. */
typedef struct { quant_f16 d; uint8_t qs[QK_K / 4]; uint8_t qh[QK_K / 32]; uint8_t scales[QK_K / 32]; } block_iq2_s;
static_assert(sizeof(block_iq2_s) == 2 + QK_K / 4 + QK_K / 16, "block_iq2_s size");

/* x: n elements of one row of src type; y: n elements of dst. n is a multiple
 * of the block size. */
typedef void (*quant_to_float_fn)(const void *x, float *y, int64_t n);
typedef void (*quant_from_float_fn)(const float *x, void *y, int64_t n);
/* *s = dot(x[0..n), y[0..n)); x is a row of the weight type, y a row of its
 * vec_dot_type. */
typedef void (*quant_vec_dot_fn)(int n, float *s, const void *x, const void *y);

struct quant_traits {
    const char *name;              /* "q4_0", as llama.cpp spells it */
    bool kv_only;                  /* kvserve's own KV cache type: never in a GGUF file, never a weight */
    int block_elems;               /* elements per block */
    size_t block_bytes;            /* bytes per block */
    bool is_quantized;
    quant_to_float_fn to_float;    /* NULL only for types with no kernels */
    quant_from_float_fn from_float;/* NULL if kvserve cannot quantize to it */
    /* KV cache rows only: the same block format with each block's scale
     * chosen by least squared error over candidate scales (never a larger
     * error than from_float's block); NULL: the type has none, use from_float.
     * Weights always take from_float, which is bit-exact with ggml. */
    quant_from_float_fn kv_from_float;
    enum quant_type vec_dot_type;  /* activations are quantized to this */
    quant_vec_dot_fn vec_dot;      /* NULL if not usable as a weight */
};

/* NULL for an id that is not a known type. */
const struct quant_traits *quant_traits(enum quant_type t);
/* The same table with only scalar reference kernels, for tests. */
const struct quant_traits *quant_traits_scalar(enum quant_type t);

/* A ggml type id kvserve implements (the ids a GGUF tensor may have); false
 * for the KV-only types. */
bool quant_type_known(uint32_t id);
/* "q4_0" etc., or "unknown(N)" in a static buffer for unknown ids. */
const char *quant_type_name(enum quant_type t);
/* Parse a name (case-insensitive: "f16", "q8_0", "Q4_K"), KV-only types included. */
ks_status quant_type_from_name(const char *name, enum quant_type *out);
/* Bytes of a row of n elements; 0 if n is not a multiple of the block size. */
size_t quant_row_size(enum quant_type t, int64_t n);
/* ISA of the kernels in quant_traits(): "avx512-vnni", "avx2", "scalar". */
const char *quant_isa(void);

/* Scalar conversions (F16C / AVX-512 vector paths live in the kernels). */
float quant_f16_to_f32(quant_f16 h);
quant_f16 quant_f32_to_f16(float f);
float quant_bf16_to_f32(quant_bf16 h);
quant_bf16 quant_f32_to_bf16(float f);

/* ---- matrix multiply --------------------------------------------------- */
/* Y[t][r] = sum_c W[r][c] * X[t][c] for t < n_tokens, r < rows.
 * W: rows x cols of wtype, row-major (a GGUF 2-D tensor with ne[0] = cols).
 * X: n_tokens x cols f32, Y: n_tokens x rows f32 (row stride = rows).
 * Activations are quantized on the fly to the weight type's vec_dot_type and
 * multiplied with integer dot products; F32/F16/BF16 weights use float dots.
 * The work is tiled over rows x tokens so that each weight block is read once
 * for many tokens, and split across the pool.
 *
 * work/work_size: scratch for the quantized activations, at least
 * quant_matmul_work_size(wtype, cols, n_tokens) bytes. The size never
 * decreases with n_tokens: a buffer sized for the largest batch fits all. */
size_t quant_matmul_work_size(enum quant_type wtype, int64_t cols, int64_t n_tokens);
/* The quantizer quant_matmul applies to wtype's activations (a row of its
 * vec_dot_type): that type's from_float, but for IQ4_NL and MXFP4, whose Q8_0
 * activations are rounded as llama.cpp's CPU backend rounds them
 * (127 / amax, nearest even). NULL for float weights and unknown types. */
quant_from_float_fn quant_act_quantizer(enum quant_type wtype);
ks_status quant_matmul(threads_pool *pool, const void *W, enum quant_type wtype,
                       int64_t rows, int64_t cols, const float *X, int64_t n_tokens,
                       float *Y, void *work, size_t work_size);

/* ---- repacked weights ---------------------------------------------------- */
/* Q4_0, Q8_0, IQ4_NL, MXFP4, Q5_0 and Q5_1 matrices, and with AVX2 or AVX-512
 * the k-quant ones (Q2_K to Q6_K), can be repacked once, at load time, into groups of
 * quant_repack_rows() rows whose blocks are interleaved with their scales
 * (the layout this build's kernels read best: 16 rows with AVX-512, 8 with
 * AVX2 or scalar). The last rows % quant_repack_rows() rows stay row-major,
 * where they were. A repacked matrix has the same size and is read only by
 * quant_matmul_repacked and quant_get_row_repacked. Decode and small batches
 * run GEMV/GEMM kernels on the layout: one sequential stream per group
 * instead of one per row, and per row and token the same bits as the scalar
 * reference vec_dot. Larger batches (Q4_0 / Q8_0 from 17 tokens, the k-quants
 * past a crossover of 8 to 64 by type and ISA) unpack rows into the prefill
 * tiles, with the same bits (a portable build, which has none, and IQ4_NL /
 * MXFP4 / Q5_0 / Q5_1, which have none, run every batch on the group
 * kernels). */
int quant_repack_rows(void);
/* A type this build repacks (above), at least one whole group of rows, cols of whole blocks. */
bool quant_repack_fits(enum quant_type t, int64_t rows, int64_t cols);
/* In place. KS_ERR_INVALID_ARG if it does not fit; KS_ERR_NOMEM (W unchanged)
 * without memory for one group of rows. */
ks_status quant_repack(enum quant_type t, int64_t rows, int64_t cols, void *W);
/* quant_matmul on a repacked W; work as quant_matmul_work_size says. */
ks_status quant_matmul_repacked(threads_pool *pool, const void *W, enum quant_type wtype, int64_t rows, int64_t cols,
                                const float *X, int64_t n_tokens, float *Y, void *work, size_t work_size);

/* ---- several matrices on one input ---------------------------------------- */
/* Y_i = W_i X for n (1 to QUANT_MM_SET_MAX) matrices of one width, each of
 * its own type: the Q, K and V projections (gemma3's Q4_K_M: q5_0 Q and K,
 * q8_0 V), or a feed-forward block's gate and up. Each Y_i has the bits
 * quant_matmul (or, repacked, quant_matmul_repacked) gives. A decode step or
 * a small batch quantizes X once per type and runs all of them in one
 * parallel region, so a thread that ends its share of one matrix goes on to
 * the next instead of waiting for the others; larger batches run one by
 * one. work as quant_matmul_set_work_size says: every distinct type's
 * quant_matmul_work_size, each rounded up to 64 bytes. */
#define QUANT_MM_SET_MAX 4
struct quant_mm_out {
    const void *W;
    enum quant_type type;
    int64_t rows;
    bool repacked; /* W is in quant_repack's layout */
    float *Y;      /* n_tokens x rows */
};
size_t quant_matmul_set_work_size(const struct quant_mm_out *outs, int n, int64_t cols, int64_t n_tokens);
ks_status quant_matmul_set(threads_pool *pool, int64_t cols, const struct quant_mm_out *outs, int n, const float *X,
                           int64_t n_tokens, void *work, size_t work_size);

/* ---- matrix multiply grouped by expert (mixture of experts) ------------- */
/* The gated activation the grouped matmul fuses: SiLU(gate) * up, gpt-oss's
 * quant_swiglu_oai, or Gemma's quant_geglu (a dense FFN run as one expert, so
 * the activation runs inside the matmul's region). */
enum quant_glu { QUANT_GLU_SILU, QUANT_GLU_OAI, QUANT_GLU_GELU };

/* n_expert matrices of one type and shape (rows x cols each, stride bytes
 * apart from W; likewise W2 if set), each applied to its own group of rows:
 * grouped rows start[e] .. start[e + 1] go through expert e,
 *   Y[g][r]  = sum_c W_e[r][c]  * X[xr(g)][c]
 *   Y2[g][r] = sum_c W2_e[r][c] * X[xr(g)][c]      (if W2)
 *   Y[g][r] += B[e][r], Y2[g][r] += B2[e][r]        (if B, B2)
 *   Y[g][r]  = silu(Y[g][r]) * Y2[g][r]            (if swiglu; glu OAI: quant_swiglu_oai, GELU: quant_geglu)
 * where xr(g) = x_rows[g], or g when x_rows is NULL (then n_x = start[n_expert]).
 * Each X row is quantized once, however many experts read it; every
 * expert's rows (of W and W2) are work items of one parallel region, so a
 * decode step is one region, not two per expert. Each expert runs the kernel
 * quant_matmul picks for its token count: Y is bit-identical to quant_matmul
 * per expert (and, if swiglu, to quant_swiglu over each expert's Y when rows
 * is a multiple of 16). With repacked, every expert's slice of W and W2 is a
 * matrix quant_repack rewrote on its own (row-major tail rows past the last
 * whole group included), and Y is bit-identical to quant_matmul_repacked per
 * expert: the group kernels up to 16 tokens, the prefill tiles above. */
struct quant_moe_mm {
    enum quant_type wtype;
    int64_t rows, cols;
    const void *W, *W2;      /* expert e's matrix at W + e * stride; W2 NULL: one product */
    size_t stride;           /* bytes per expert, >= rows * row bytes */
    int n_expert;
    const int32_t *start;    /* (n_expert + 1) grouped row ranges, non-decreasing from 0 */
    const float *X;          /* (n_x, cols) */
    const int32_t *x_rows;   /* (start[n_expert]) X row of each grouped row, or NULL */
    int64_t n_x;
    float *Y, *Y2;           /* (start[n_expert], rows) each; Y2 only with W2 */
    bool swiglu;             /* needs W2 */
    bool repacked;           /* each expert's W (and W2) is in quant_repack's layout */
    /* gpt-oss: per-expert biases added to Y (and Y2) before the activation,
     * Y[g][r] += B[e * rows + r]; and its clamped SwiGLU instead of SiLU */
    const float *B, *B2;     /* (n_expert, rows) each, or NULL */
    enum quant_glu glu;      /* with swiglu: QUANT_GLU_SILU (0), QUANT_GLU_OAI or QUANT_GLU_GELU */
    /* NULL, or (swiglu, one expert, one row, rows a multiple of 256) the
     * activated row packed here as quant_matmul_packed's input for a matrix
     * of type yq_type (quant_matmul_takes_packed), each 256-value block by
     * the thread that finishes its rows: the next matmul's packing moves off
     * the caller into this region. quant_matmul_packed_bytes(yq_type, rows). */
    void *Yq;
    enum quant_type yq_type;
};
/* True if one token's product with a wtype matrix of this width (repacked
 * or not) reads its activations in Q8_K rows (the k-quants' decode), so that
 * quant_matmul_packed can take them packed elsewhere (quant_moe_mm.Yq). */
bool quant_matmul_takes_packed(enum quant_type wtype, bool repacked, int64_t cols);
/* Bytes of one token's packed activations for it. */
size_t quant_matmul_packed_bytes(enum quant_type wtype, int64_t cols);
/* y = W x for one token given as Xq, x packed as the matmul would pack it
 * (quant_act_quantizer's rows): the same bits as quant_matmul(_repacked) on
 * x. KS_ERR_INVALID_ARG unless quant_matmul_takes_packed. */
ks_status quant_matmul_packed(threads_pool *pool, const void *W, enum quant_type wtype, bool repacked, int64_t rows,
                              int64_t cols, const void *Xq, float *Y);
/* Scratch for quant_matmul_experts: enough for any grouping of n_grouped
 * rows over n_x X rows, repacked or not (non-decreasing in both). */
size_t quant_matmul_experts_work_size(enum quant_type wtype, int64_t cols, int64_t n_x, int64_t n_grouped);
/* KS_ERR_UNSUPPORTED: no kernels for wtype; KS_ERR_INVALID_ARG: a bad shape
 * (or, repacked, one quant_repack_fits refuses), a NULL buffer or too small
 * a work buffer; KS_ERR_NOMEM: out of memory for
 * the per-call tables or a thread's weight panel. */
ks_status quant_matmul_experts(threads_pool *pool, const struct quant_moe_mm *p, void *work, size_t work_size);

/* gate[i] = silu(gate[i]) * up[i] for i < n (SwiGLU). quant_swiglu gives
 * llama.cpp's bits (ggml_vec_swiglu_f32 of the CPU backend of this build's
 * ISA: its vector exponential for whole vectors, libm's expf for the rest);
 * quant_swiglu_scalar is the plain reference with libm expf everywhere
 * (ggml's build without SIMD). They agree within 1e-6 relative plus 1e-30
 * absolute. */
void quant_swiglu(float *gate, const float *up, int64_t n);
void quant_swiglu_scalar(float *gate, const float *up, int64_t n);
/* gpt-oss's clamped SwiGLU, as ggml's swiglu_oai with alpha 1.702, limit 7:
 *   x = min(gate, 7), y = clamp(up, -7, 7), gate = x / (1 + exp(-1.702 x)) * (y + 1)
 * Same SIMD / libm split and agreement as quant_swiglu. */
#define QUANT_SWIGLU_OAI_ALPHA 1.702f
#define QUANT_SWIGLU_OAI_LIMIT 7.0f
void quant_swiglu_oai(float *gate, const float *up, int64_t n);
void quant_swiglu_oai_scalar(float *gate, const float *up, int64_t n);

/* GeGLU (Gemma): gate[i] = gelu_tanh(gate[i]) * up[i] for i < n, with ggml's
 * CPU arithmetic: the input rounded to f16 and looked up in a table of
 * f16(gelu(h)) over every f16 h (0 at or below -10, the input itself at or
 * above 10). The SIMD path and the scalar twin give the same bits. */
void quant_geglu(float *gate, const float *up, int64_t n);
void quant_geglu_scalar(float *gate, const float *up, int64_t n);
/* GELU (BERT's FFN, ggml_gelu): x[i] = gelu(x[i]) for i < n, by the same
 * table and thresholds as quant_geglu, so its values for an up of 1 (ggml's
 * ggml_vec_gelu_f32 with GGML_GELU_FP16). Scalar only: an encoder's FFN runs
 * it once per token and layer. */
void quant_gelu(float *x, int64_t n);
/* The table's entry for f16 bits h (tests compare it with ggml's). */
quant_f16 quant_gelu_table_entry(quant_f16 h);

/* Copy row r of W (wtype, cols wide) into y as f32: embedding lookup. */
ks_status quant_get_row(const void *W, enum quant_type wtype, int64_t cols, int64_t r, float *y);
/* The same for a repacked W of rows x cols (tied embeddings, which are the
 * output matrix): the floats quant_get_row gives on the row-major matrix.
 * KS_ERR_INVALID_ARG: r outside [0, rows), a NULL buffer, or a shape that
 * cannot be repacked. */
ks_status quant_get_row_repacked(const void *W, enum quant_type wtype, int64_t rows, int64_t cols, int64_t r, float *y);

#endif
