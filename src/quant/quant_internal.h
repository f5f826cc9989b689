/* Internal to the quant module: the kernels that quant.c puts into its traits
 * tables, split by file (scalar references, SIMD kernels, matmul). */
#ifndef KS_QUANT_INTERNAL_H
#define KS_QUANT_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "quant/quant.h"

/* __builtin_prefetch's locality for the weight streams of the matmul kernels
 * (but a stream read once: quant_prefetch_weights): 2 = prefetcht1, into L2
 * only. A prefetch into L1 holds one of its few fill buffers for the whole
 * trip to DRAM, which the stream's own loads then queue behind: T1 gave q6_K
 * 25 -> 28 GB/s, repacked q4_0 27.5 -> 28.8 (2 threads) and 14.2 -> 15.2
 * (1 thread), q4_K the same (bench_matmul, llama-1b shapes, AVX-512). */
#ifndef QUANT_WEIGHT_PREFETCH
#define QUANT_WEIGHT_PREFETCH 2
#endif

/* The group kernels (quant_repack.c, kq_repack*.c) of a matmul of up to this
 * many tokens read each weight line once and fetch it with prefetchnta: a
 * line that passes through L2 is evicted from there into L3 (a victim
 * cache), traffic a stream read once does not need. Zen 5, 2 threads,
 * bench_matmul llama-1b shapes, decode of 1 token: q4_K 66 -> 76 tok/s, q6_K
 * 48 -> 60, q8_0 34 -> 38, q5_0 43 -> 47, q4_0 unchanged; kvserve tg128
 * llama-1b Q4_K_M 72.5 -> 96.2 tok/s (membw 56.3 GB/s). Up to 8 tokens most
 * types gain (q8_0 +11-38%, q6_K +3-15%; q4_K -6% at 4). Larger batches pass over a
 * group once per token tile and keep it in L2 (QUANT_WEIGHT_PREFETCH): there
 * prefetchnta cost 2-5%. */
#ifndef QUANT_ONCE_MAX_TOKENS
#define QUANT_ONCE_MAX_TOKENS 8
#endif
static inline bool quant_weights_read_once(int64_t n_tokens) { return n_tokens <= QUANT_ONCE_MAX_TOKENS; }

/* Every 64-byte line of [p, p + bytes) of a weight stream (never faults). */
static inline void quant_prefetch_weights(const void *p, size_t bytes, bool once)
{
    for (size_t off = 0; off < bytes; off += 64) {
        if (once)
            __builtin_prefetch((const char *)p + off, 0, 0);
        else
            __builtin_prefetch((const char *)p + off, 0, QUANT_WEIGHT_PREFETCH);
    }
}

/* Part `part` of `parts` of the lines of [p, p + bytes): a group-block's
 * prefetch spread over its sub-blocks. Asked for at once at the start of
 * each block, the lines of a big group-block (36 for 16 rows of Q4_K, 53 of
 * Q6_K) fill the core's miss buffers and the block's own loads queue behind
 * them. Zen 4 (EPYC, 2 threads, llama-1b Q4_K_M's matrices in a decode
 * step's order, bench_matmul --gguf, 5 interleaved rounds, bench_membw 31.6
 * GB/s): AVX-512 24.1 -> 31.2 GB/s, kvserve tg64 39.6 -> 52.0 tok/s; AVX2
 * (18 and 27 lines) 32.5 -> 32.7, already at the memory. */
static inline void quant_prefetch_weights_part(const void *p, size_t bytes, bool once, int part, int parts)
{
    const size_t lines = (bytes + 63) / 64, l0 = lines * (size_t)part / (size_t)parts,
                 l1 = lines * (size_t)(part + 1) / (size_t)parts;
    quant_prefetch_weights((const char *)p + 64 * l0, 64 * (l1 - l0), once);
}

/* Portable bit-exact conversions (round to nearest even, NaN kept quiet). The
 * public quant_f16_to_f32 / quant_f32_to_f16 may use F16C instead. */
float quant_f16_to_f32_soft(quant_f16 h);
quant_f16 quant_f32_to_f16_soft(float f);

/* Fill the non-k-quant entries of both tables (see quant_ref.c, quant_simd.c). */
void quant_ref_fill(struct quant_traits *scalar);
void quant_simd_fill(struct quant_traits *best);
/* The KV quantizers with a scale search (quant_kv.c), the same in both tables. */
void quant_kv_fill(struct quant_traits *t);


/* ---- kernels, exposed so tests can compare every variant ----------------- */
void quant_q4_0_from_float_ref(const float *x, void *y, int64_t n);
void quant_q8_0_from_float_ref(const float *x, void *y, int64_t n);
/* Activations of the weight types whose vec_dot_type is Q8_0, rounded as
 * llama.cpp's x86 backend rounds them (quant_ref.c says why): the scalar
 * reference, and the build's fastest form, bit for bit the same. */
void quant_q8_0_act_from_float_ref(const float *x, void *y, int64_t n);
void quant_q8_0_act_from_float(const float *x, void *y, int64_t n);
/* Activations of the Q8_1 types (q4_1, q5_1), rounded as ggml-cpu's x86
 * quantize_row_q8_1 rounds them. */
void quant_q8_1_act_from_float_ref(const float *x, void *y, int64_t n);
void quant_q4_1_from_float_ref(const float *x, void *y, int64_t n);
void quant_q5_0_from_float_ref(const float *x, void *y, int64_t n);
void quant_q5_1_from_float_ref(const float *x, void *y, int64_t n);
void quant_iq4_nl_from_float_ref(const float *x, void *y, int64_t n);
void quant_iq3_nl_from_float_ref(const float *x, void *y, int64_t n);
/* IQ4_NL's quantizer in parts, which IQ4_XS's reuses: the index of the level
 * of quant_iq4nl_values nearest v (a tie goes up), and the least-squares
 * scale of one block of 32 (0 for a block of zeros). */
int quant_iq4nl_nearest(float v);
float quant_iq4nl_block_scale(const float *x);

/* ---- q5_0 and q5_1: llama.cpp's x86 order ----------------------------------
 * llama.cpp (anchor b10470) repacks no q5_0/q5_1 matrix on x86 (repack.cpp's
 * tensor traits: q4_0, q8_0, iq4_nl, mxfp4 and k-quants), so a q5_0 matmul
 * runs ggml_vec_dot_q5_0_q8_0 for one token and llamafile's tinyBLAS_Q0_AVX
 * for a batch, q5_1 always ggml_vec_dot_q5_1_q8_1 (tinyBLAS has no q5_1).
 * All of them, on AVX2 and on AVX-512 (the icelake/zen4 builds run the same
 * 256-bit code with vpdpbusd), keep 8 float lanes per output: lane l of a
 * block is the exact integer sum over its elements 4l..4l+3, and
 *   q5_0: acc_l = fma(dx * dy, lane_l, acc_l), dot = hsum8(acc)
 *   q5_1: acc_l = fma(lane_l, dx * dy, acc_l), summs = fma(mx, sy, summs),
 *         dot = hsum8(acc) + summs
 * block by block, hsum8 = hsum_float_8's order below. Every kvserve q5
 * kernel (vec_dots, repacked groups, tiles) gives these bits. */
#define QUANT_Q5_LANES 8
static inline float quant_lanes_hsum8(const float a[QUANT_Q5_LANES])
{
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* Index of the level of values (n of them, ascending) nearest v: how many
 * midpoints between neighbours lie at or below it (a tie goes up). */
static inline int quant_nearest_level(const int8_t *values, int n, float v)
{
    int i = 0;
    for (int k = 0; k + 1 < n; k++)
        i += v >= 0.5f * (float)(values[k] + values[k + 1]);
    return i;
}

/* IQ3_NL: element j's 3-bit index, and a block's indices packed from idx[32]. */
static inline int quant_iq3nl_index(const block_iq3_nl *b, int j)
{
    return ((b->qs[j % 8] >> (2 * (j / 8))) & 3) | ((b->qh[j / 8] >> (j % 8)) & 1) << 2;
}

static inline void quant_iq3nl_pack(const uint8_t *idx, block_iq3_nl *b)
{
    memset(b->qs, 0, sizeof b->qs);
    memset(b->qh, 0, sizeof b->qh);
    for (int j = 0; j < QK3_NL; j++) {
        b->qs[j % 8] |= (uint8_t)((idx[j] & 3) << (2 * (j / 8)));
        b->qh[j / 8] |= (uint8_t)((idx[j] >> 2) << (j % 8));
    }
}
void quant_vec_dot_iq4_nl_q8_0_ref(int n, float *s, const void *x, const void *y);

#define QUANT_DECLARE_DOTS(isa)                                                       \
    void quant_vec_dot_f32_##isa(int n, float *s, const void *x, const void *y);       \
    void quant_vec_dot_f16_##isa(int n, float *s, const void *x, const void *y);       \
    void quant_vec_dot_bf16_##isa(int n, float *s, const void *x, const void *y);      \
    void quant_vec_dot_q4_0_q8_0_##isa(int n, float *s, const void *x, const void *y); \
    void quant_vec_dot_q4_1_q8_1_##isa(int n, float *s, const void *x, const void *y); \
    void quant_vec_dot_q5_0_q8_0_##isa(int n, float *s, const void *x, const void *y); \
    void quant_vec_dot_q5_1_q8_1_##isa(int n, float *s, const void *x, const void *y); \
    void quant_vec_dot_q8_0_q8_0_##isa(int n, float *s, const void *x, const void *y);

QUANT_DECLARE_DOTS(ref)
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QUANT_HAVE_AVX2 1
QUANT_DECLARE_DOTS(avx2)
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VBMI__)
#define QUANT_HAVE_AVX512 1
QUANT_DECLARE_DOTS(avx512)
#endif

/* quant_swiglu's scalar twin: the same bits, element by element (tests). */
void quant_swiglu_twin(float *gate, const float *up, int64_t n);

/* ---- repacked Q4_0 / Q8_0 / IQ4_NL / MXFP4 / Q5_0 / Q5_1 weights (quant_repack.c) */
/* Rows per interleaved group and the bias of stored Q8_0 quants in this
 * build's layout: what the build's fastest kernel reads. */
#if defined(QUANT_HAVE_AVX512)
#define QUANT_RP_ROWS 16
#define QUANT_RP_Q8_BIAS 0x80
#else
#define QUANT_RP_ROWS 8
#define QUANT_RP_Q8_BIAS 0
#endif

/* Rows [0, quant_rp_grouped_rows(rows)) of a repacked matrix are in groups;
 * the rows past them stay row-major, row r at r * row bytes as in the file
 * (a group takes exactly the bytes of its rows). */
static inline int64_t quant_rp_grouped_rows(int64_t rows) { return rows / QUANT_RP_ROWS * QUANT_RP_ROWS; }

/* One activation block quantized to Q8_0 as the repacked kernels read it. */
struct quant_rp_act {
    int8_t qs[QK8_0];
    float d;     /* the f16 scale, widened */
    int32_t sum; /* sum(qs): the correction of unsigned weight operands */
    /* q5_0 / q5_1 only: Q8_1's s (f16 of d * sum, d before its rounding),
     * widened, and per 4-element lane (quant_internal.h, "q5_0 and q5_1")
     * the correction of q5_0's unsigned levels (level + 16) */
    float s;
    int32_t lane_corr[QUANT_Q5_LANES]; /* q5_0: -16 x each lane's sum of qs; 0 otherwise */
};
/* Token x (cols floats) as the group kernels of wtype read it: Q8_0 (or, for
 * q5_1, Q8_1) activations rounded as llama.cpp's x86 backend rounds them. */
void quant_rp_pack_token(enum quant_type wtype, const float *x, int64_t cols, struct quant_rp_act *out);

/* Rows of a repacked matrix against n_tokens packed tokens. */
struct quant_rp_job {
    enum quant_type wtype;
    const uint8_t *W;
    int64_t nb;                     /* blocks per row */
    const struct quant_rp_act *act; /* token t's blocks at act + t * nb, or act + act_rows[t] * nb */
    const int32_t *act_rows;        /* NULL, or (n_tokens) packed row of each token: experts read shared rows */
    int64_t n_tokens;
    float *Y;                       /* Y[t * ldy + r] */
    int64_t ldy;
};
/* Groups [g0, g1) of rows: the build's best kernel; its scalar twin for any
 * group size and bias; the SIMD kernels (layouts of 16 rows +128, 8 rows +0). */
void quant_rp_rows(const struct quant_rp_job *j, int64_t g0, int64_t g1);
/* Token t's packed blocks. */
static inline const struct quant_rp_act *quant_rp_token(const struct quant_rp_job *j, int64_t t)
{
    return j->act + (j->act_rows ? j->act_rows[t] : t) * j->nb;
}
void quant_rp_rows_ref(const struct quant_rp_job *j, int R, int q8_bias, int64_t g0, int64_t g1);
/* The row-major tail rows of a repacked matrix of rows rows (none if rows is
 * a multiple of the group): the scalar twin, the reference's bits. */
void quant_rp_tail_rows(const struct quant_rp_job *j, int64_t rows);
#if defined(QUANT_HAVE_AVX512)
/* One Q8_0 block of 32 floats into q, bit-exact with the reference; returns
 * the f32 scale (before its f16 rounding), and, if sum is not NULL, *sum = sum of q. */
float quant_q8_0_block_avx512(const float *x, int8_t *q, int *sum);
/* The same for activations (quant_q8_0_act_from_float_ref's rounding); returns
 * amax / 127 before its f16 rounding. */
float quant_q8_0_act_block_avx512(const float *x, int8_t *q, int *sum);
void quant_rp_rows_avx512(const struct quant_rp_job *j, int64_t g0, int64_t g1);
#endif
#if defined(QUANT_HAVE_AVX2)
/* The Q8_0 quantizer of AVX2 builds, bit-exact with the reference (tested in
 * AVX-512 builds too). */
void quant_q8_0_from_float_avx2(const float *x, void *y, int64_t n);
void quant_q8_0_act_from_float_avx2(const float *x, void *y, int64_t n);
void quant_rp_rows_avx2(const struct quant_rp_job *j, int64_t g0, int64_t g1);
#endif
/* quant_repack with any group size and Q8_0 bias (tests of the other layouts). */
ks_status quant_rp_repack_as(enum quant_type t, int64_t rows, int64_t cols, void *W, int R, int q8_bias);
/* Row r's block b of a matrix in this build's layout (r in the groups), back
 * in ggml's block layout (a block of t at out: at most a block_q8_0). */
void quant_rp_get_block(const void *W, enum quant_type t, int64_t nb, int64_t r, int64_t b, void *out);
/* Row r (in the groups) as f32 through quant_rp_get_block and the scalar
 * to_float: the reference of quant_get_row_repacked. */
void quant_rp_row_to_float_ref(const void *W, enum quant_type t, int64_t nb, int64_t r, float *y);

#if defined(QUANT_HAVE_AVX2)
#include <immintrin.h>
/* 16 bytes of Q4_0 nibbles -> the block's 32 values as signed bytes. */
static inline __m256i quant_q4_0_values(__m128i x)
{
    __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), _mm256_set1_epi8(0x0f));
    return _mm256_sub_epi8(v, _mm256_set1_epi8(8));
}

/* The 32 values of a Q4_0 or Q8_0 block as signed bytes in element order, and
 * its scale: what the prefill tiles unpack weight rows into. */
static inline __m256i quant_block_bytes(const uint8_t *row, enum quant_type t, int64_t b, float *d)
{
    if (t == QUANT_Q4_0) {
        const block_q4_0 *blk = (const block_q4_0 *)row + b;
        *d = _cvtsh_ss(blk->d);
        return quant_q4_0_values(_mm_loadu_si128((const __m128i *)blk->qs));
    }
    const block_q8_0 *blk = (const block_q8_0 *)row + b;
    *d = _cvtsh_ss(blk->d);
    return _mm256_loadu_si256((const __m256i *)blk->qs);
}

/* The same for row r's block b of a Q4_0 or Q8_0 matrix in this build's
 * repacked layout: the row's 4-byte chunks lie QUANT_RP_ROWS dwords apart
 * (quant_repack.c). */
static inline __m256i quant_rp_block_bytes(const void *W, enum quant_type t, int64_t nb, int64_t r, int64_t b, float *d)
{
    const int R = QUANT_RP_ROWS, l = (int)(r % R);
    size_t bb = t == QUANT_Q4_0 ? sizeof(block_q4_0) : sizeof(block_q8_0);
    const uint8_t *gb = (const uint8_t *)W + (size_t)((r / R) * nb + b) * (size_t)R * bb;
    quant_f16 h;
    memcpy(&h, gb + 2 * l, sizeof h);
    *d = _cvtsh_ss(h);
    const int *chunks = (const int *)(const void *)(gb + 2 * R + 4 * l);
    __m256i at = _mm256_setr_epi32(0, R, 2 * R, 3 * R, 4 * R, 5 * R, 6 * R, 7 * R);
    if (t == QUANT_Q4_0)
        return quant_q4_0_values(_mm_i32gather_epi32(chunks, _mm256_castsi256_si128(at), 4));
    return _mm256_xor_si256(_mm256_i32gather_epi32(chunks, at, 4), _mm256_set1_epi8((char)QUANT_RP_Q8_BIAS));
}

/* Row r's block b of W (rows x nb blocks), row-major or repacked (whose tail
 * rows are row-major): what the prefill tiles unpack weight rows from. */
static inline __m256i quant_weight_block_bytes(const uint8_t *W, enum quant_type t, bool repacked, int64_t rows,
                                               int64_t nb, int64_t r, int64_t b, float *d)
{
    if (repacked && r < quant_rp_grouped_rows(rows))
        return quant_rp_block_bytes(W, t, nb, r, b, d);
    size_t bb = t == QUANT_Q4_0 ? sizeof(block_q4_0) : sizeof(block_q8_0);
    return quant_block_bytes(W + (size_t)r * (size_t)nb * bb, t, b, d);
}
#endif

/* quant_matmul_avx2.c: the scalar twin of the AVX2 prefill tiles, in every
 * build: Y[t * rows + r] = fma((float)isum_b, d_x * d_w, .) block after block,
 * activations quantized by the Q8_0 traits; W row-major or in this build's
 * repacked layout. The tiles give its bits. */
ks_status quant_avx2_prefill_twin(const void *W, enum quant_type wtype, bool repacked, int64_t rows, int64_t cols,
                                  const float *X, int64_t n_tokens, float *Y);

#if defined(QUANT_HAVE_AVX2) && !defined(QUANT_HAVE_AVX512)
/* quant_matmul_avx2.c: Q4_0/Q8_0 prefill tiles for AVX2-only CPUs. work
 * holds at least quant_avx2_prefill_work(cols, n_tokens) bytes. */
#include "threads/threads.h"
size_t quant_avx2_prefill_work(int64_t cols, int64_t n_tokens);
ks_status quant_avx2_prefill(threads_pool *pool, const void *W, enum quant_type wtype, bool repacked, int64_t rows,
                             int64_t cols, const float *X, int64_t n_tokens, float *Y, void *work);
#endif

#endif
