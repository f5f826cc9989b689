/* Internal to the quant module: the k-quant family (Q2_K..Q6_K and the Q8_K
 * activation type), 256-element super-blocks with ggml's exact layouts.
 * quant.c builds its traits tables and asks this file to fill the k-quant
 * entries, so the two halves of the module can evolve separately.
 *
 * Every function takes a row of n elements, n a multiple of QK_K (256).
 * Quantizers follow ggml's reference algorithms (quantize_row_*_ref), which
 * is what llama-quantize runs when no importance matrix is given.
 *
 * vec_dot kernels compute *s = dot(x, y) for a row x of the weight type and a
 * row y of block_q8_K. All integer sums inside a block are exact, and every
 * kernel (SIMD vec_dot, multi-token, prefill tile) adds them up in the order
 * of the scalar reference, which is llama.cpp's on x86 (kq_scalar.c), so all
 * give its bits (tests/test_quant_kquants.c).
 * Q8_K rows passed to vec_dot must have bsums consistent with qs (as
 * quant_quantize_row_q8_K produces): the kernels use them for the min/offset
 * terms. */
#ifndef KS_QUANT_KQ_INTERNAL_H
#define KS_QUANT_KQ_INTERNAL_H

#include <math.h>
#include <stddef.h>
#include <string.h>

#include "quant/quant.h"
#include "quant/quant_internal.h"

/* Fill entries QUANT_Q2_K..QUANT_Q8_K of both tables (indexed by type id):
 * `best` gets the fastest kernels compiled in, `scalar` the references. */
void quant_kquants_fill(struct quant_traits *best, struct quant_traits *scalar);

/* ---- scalar reference dequantizers (to_float) ------------------------- */
void quant_dequantize_row_q2_K(const void *x, float *y, int64_t n);
void quant_dequantize_row_q3_K(const void *x, float *y, int64_t n);
void quant_dequantize_row_q4_K(const void *x, float *y, int64_t n);
void quant_dequantize_row_q5_K(const void *x, float *y, int64_t n);
void quant_dequantize_row_q6_K(const void *x, float *y, int64_t n);
void quant_dequantize_row_q8_K(const void *x, float *y, int64_t n);

/* ---- reference quantizers (from_float) -------------------------------- */
void quant_quantize_row_q2_K(const float *x, void *y, int64_t n);
void quant_quantize_row_q3_K(const float *x, void *y, int64_t n);
void quant_quantize_row_q4_K(const float *x, void *y, int64_t n);
void quant_quantize_row_q5_K(const float *x, void *y, int64_t n);
void quant_quantize_row_q6_K(const float *x, void *y, int64_t n);
/* Activations: per block d = -max/127 where max is the signed value of
 * largest magnitude (ggml's sign convention), qs = round(x/d) clamped to
 * [-127, 127], bsums = sums of 16 consecutive qs. */
void quant_quantize_row_q8_K(const float *x, void *y, int64_t n);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* Bit-identical to quant_quantize_row_q8_K for finite inputs. */
void quant_quantize_row_q8_K_avx512(const float *x, void *y, int64_t n);
#endif

/* ---- vec_dot Qn_K . Q8_K ------------------------------------------------ */
void quant_vec_dot_q2_K_q8_K_scalar(int n, float *s, const void *x, const void *y);
void quant_vec_dot_q3_K_q8_K_scalar(int n, float *s, const void *x, const void *y);
void quant_vec_dot_q4_K_q8_K_scalar(int n, float *s, const void *x, const void *y);
void quant_vec_dot_q5_K_q8_K_scalar(int n, float *s, const void *x, const void *y);
void quant_vec_dot_q6_K_q8_K_scalar(int n, float *s, const void *x, const void *y);

#if defined(__AVX2__) && defined(__FMA__)
#define KQ_HAVE_AVX2 1
void quant_vec_dot_q2_K_q8_K_avx2(int n, float *s, const void *x, const void *y);
void quant_vec_dot_q3_K_q8_K_avx2(int n, float *s, const void *x, const void *y);
void quant_vec_dot_q4_K_q8_K_avx2(int n, float *s, const void *x, const void *y);
void quant_vec_dot_q5_K_q8_K_avx2(int n, float *s, const void *x, const void *y);
void quant_vec_dot_q6_K_q8_K_avx2(int n, float *s, const void *x, const void *y);
/* Q8_K activations, bit-exact with quant_quantize_row_q8_K. */
void quant_quantize_row_q8_K_avx2(const float *x, void *y, int64_t n);
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KQ_HAVE_AVX512 1
void quant_vec_dot_q2_K_q8_K_avx512(int n, float *s, const void *x, const void *y);
void quant_vec_dot_q4_K_q8_K_avx512(int n, float *s, const void *x, const void *y);
#endif

/* ---- prefill: one weight row x several tokens ---------------------------- */
/* s[t * s_stride] = dot(x, y_t) for t < nt (any nt >= 0; tokens are taken
 * KQ_DOT_MAX_TOKENS at a time), where y_t = (const uint8_t *)y + t * y_stride is a Q8_K row. Each weight
 * block is unpacked once for all nt tokens; results are bit-identical to the
 * type's vec_dot in quant_traits(). */
#define KQ_DOT_MAX_TOKENS 8
typedef void (*quant_kq_dot_multi_fn)(int n, int nt, float *s, size_t s_stride, const void *x, const void *y,
                                      size_t y_stride);
/* The multi-token kernel of a k-quant weight type, or NULL if it has none
 * (call vec_dot per token then). */
quant_kq_dot_multi_fn quant_kquants_dot_multi(enum quant_type t);

/* One super-block (QK_K) weight type's entry of the traits tables, with Q8_K
 * activations: the k-quants here, iq2.h's and iq3.h's types. */
struct kq_entry {
    enum quant_type type;
    const char *name;
    size_t bytes;
    quant_to_float_fn to_float;
    quant_from_float_fn from_float, from_float_best;
    quant_vec_dot_fn dot_scalar, dot_best;
    quant_kq_dot_multi_fn multi; /* NULL: none in this build */
};
/* best[type] and scalar[type] for each entry of table[0..n). */
void kq_entries_fill(const struct kq_entry *table, size_t n, struct quant_traits *best, struct quant_traits *scalar);
/* The multi-token kernel of weight type t in table[0..n), NULL if none. */
quant_kq_dot_multi_fn kq_entries_dot_multi(const struct kq_entry *table, size_t n, enum quant_type t);
#if defined(KQ_HAVE_AVX512)
void quant_vec_dot_q4_K_q8_K_multi_avx512(int n, int nt, float *s, size_t s_stride, const void *x,
                                          const void *y, size_t y_stride);
#endif

/* ---- prefill: register-tiled GEMM over unpacked row panels (kq_gemm*.c) -- */
/* A panel is KQ_PANEL_ROWS weight rows unpacked once, super-block by
 * super-block, into the layout the tiles read with one vector load per step:
 * the rows' quants as unsigned bytes (offset formats shifted up: Q3_K + 4,
 * Q6_K + 32), dword k of every row side by side (row r's bytes 4k..4k+3 at
 * KQ_PB_Q + 64k + 4r), then per sub-block one int32 scale per row, per pair
 * of Q8_K bsums one int16 pair per row (the mins, or the offset times the
 * scales), and d / dmin as f32. A tile broadcasts a dword of a token's Q8_K
 * quants against a dword of every row (rows in lanes), keeps exact int32 sums
 * per sub-block, applies the scales in int32 and turns each super-block into
 * floats once, with the scalar reference vec_dot's operations in its order:
 * every tile kernel gives the reference's bits, for any batch and ISA. */
#define KQ_PANEL_ROWS 16
#define KQ_GEMM_PANELS 2 /* panels a tile reads together: rows per work item = 32 */
#define KQ_GEMM_ROWS (KQ_GEMM_PANELS * KQ_PANEL_ROWS)
#define KQ_PB_Q 0                                  /* [64 dwords][16 rows] x 4 quants */
#define KQ_PB_SC (KQ_PB_Q + QK_K / 4 * 64)         /* [16 sub-blocks][16 rows] int32 scales */
#define KQ_PB_PAIRS (KQ_PB_SC + 16 * 64)           /* [8 bsum pairs][16 rows] 2 x int16 */
#define KQ_PB_D (KQ_PB_PAIRS + 8 * 64)             /* [16 rows] f32 d */
#define KQ_PB_DMIN (KQ_PB_D + 64)                  /* [16 rows] f32 dmin (0: an offset format) */
/* Q3_K, Q5_K and Q6_K (kq_lane_order) use another layout, for ggml's eight
 * lanes: lane c of a super-block sums the elements e with (e % 32) / 4 == c,
 * each already times its scale. Pair j (elements 2j, 2j + 1) of every row as
 * two int16 scale * quant (Q3_K signed, Q5_K / Q6_K unsigned u = q + 32) side
 * by side, pair i of Q8_K bsums' weights (Q6_K 32 * scales: lane i's offset,
 * Q5_K the mins), then d / dmin. Lane c's pairs are j = 16m + 2c + h. */
#define KQ_PL_W 0                                  /* [128 pairs][16 rows] 2 x int16 */
#define KQ_PL_PAIRS (KQ_PL_W + QK_K / 2 * 64)      /* [8 bsum pairs][16 rows] 2 x int16 */
#define KQ_PL_D (KQ_PL_PAIRS + 8 * 64)             /* [16 rows] f32 d */
#define KQ_PL_DMIN (KQ_PL_D + 64)                  /* [16 rows] f32 dmin (Q5_K) */
#define KQ_PB_BYTES (KQ_PL_DMIN + 64)              /* per super-block of a panel, either layout */
_Static_assert(KQ_PB_DMIN + 64 <= KQ_PB_BYTES, "the k-quant panel layouts share KQ_PB_BYTES");

/* Rows [r0, r0 + nr) of a matrix against n_tokens Q8_K rows. */
struct quant_kq_gemm {
    enum quant_type wtype; /* Q2_K .. Q6_K */
    const uint8_t *W;      /* (rows, cols) of wtype, wrow bytes per row */
    size_t wrow;
    int64_t cols;
    const uint8_t *X;      /* token t's Q8_K row at X + (xi ? xi[t] : t) * xrow */
    size_t xrow;
    const int32_t *xi;
    int64_t n_tokens;
    float *Y;              /* Y[t * ldy + r] */
    int64_t ldy;
    bool repacked;         /* W in quant_repack's layout (kq_repack.c), of `rows` rows */
    int64_t rows;
};
/* Computes Y for rows r0 .. r0 + nr (nr <= np * KQ_PANEL_ROWS) and every
 * token from np (1 or 2) unpacked panels, quant_kq_panel_bytes() apart. */
typedef void (*quant_kq_tiles_fn)(const struct quant_kq_gemm *g, const uint8_t *panels, int np, int64_t r0, int nr);

size_t quant_kq_panel_bytes(int64_t cols);
/* Scratch of quant_kq_gemm_rows: KQ_GEMM_PANELS panels, 64-byte aligned. */
size_t quant_kq_scratch_bytes(int64_t cols);
/* nr (<= KQ_PANEL_ROWS) rows starting at w into one panel; rows past nr are zero. */
void quant_kq_unpack_panel(enum quant_type t, const uint8_t *w, size_t wrow, int nr, int64_t cols, uint8_t *panel);
/* One row's super-block (ggml's layout) into lane `lane` of a panel's super-block pb. */
void quant_kq_unpack_lane(enum quant_type t, const void *block, int lane, uint8_t *pb);
/* A whole row w (cols wide) into lane `lane` of a panel. */
void quant_kq_unpack_panel_row(enum quant_type t, const uint8_t *w, int64_t cols, uint8_t *panel, int lane);
/* Rows [r0, r1) x every token: unpack KQ_GEMM_ROWS rows at a time, run tiles. */
void quant_kq_gemm_rows(const struct quant_kq_gemm *g, quant_kq_tiles_fn tiles, int64_t r0, int64_t r1,
                        uint8_t *scratch);
/* The scalar twin, and the SIMD tiles this build has (NULL: none; the
 * traits vec_dot is then as fast and gives the same bits). */
void quant_kq_tiles_scalar(const struct quant_kq_gemm *g, const uint8_t *panels, int np, int64_t r0, int nr);
/* y[t] = token t0 + t's Q8_K row for t < T; past n tokens, the last one
 * again (a tile's tail computes it and does not store it). */
void quant_kq_tile_tokens(const struct quant_kq_gemm *g, int64_t t0, int n, int T, const block_q8_K **y);
quant_kq_tiles_fn quant_kq_tiles_best(void);
/* 4 bytes at p (any alignment) as the dword the tiles broadcast. */
static inline int32_t kq_dword(const void *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}
/* Dwords of quants per scale: 8 (32 quants) for Q4_K/Q5_K, 4 for the others. */
static inline int kq_sub_dwords(enum quant_type t) { return t == QUANT_Q4_K || t == QUANT_Q5_K ? 8 : 4; }
/* Types whose dots follow ggml's x86 eight-lane order (kq_scalar.c), with
 * the KQ_PL_* panel layout. */
static inline bool kq_lane_order(enum quant_type t) { return t == QUANT_Q3_K || t == QUANT_Q5_K || t == QUANT_Q6_K; }
/* Formats with a dmin term; the others fold their offset into the integer sum. */
static inline bool kq_has_dmin(enum quant_type t) { return t == QUANT_Q2_K || t == QUANT_Q4_K || t == QUANT_Q5_K; }
#if defined(KQ_HAVE_AVX2)
void quant_kq_tiles_avx2(const struct quant_kq_gemm *g, const uint8_t *panels, int np, int64_t r0, int nr);
#endif
#if defined(KQ_HAVE_AVX512) && defined(__AVX512VNNI__)
#define KQ_HAVE_GEMM_AVX512 1
void quant_kq_tiles_avx512(const struct quant_kq_gemm *g, const uint8_t *panels, int np, int64_t r0, int nr);
#endif

/* ---- repacked k-quants, Q2_K to Q6_K (kq_repack*.c) -------------------------
 * quant_repack's layout for the k-quants: groups of R = QUANT_RP_ROWS rows
 * (16 with AVX-512, 8 otherwise), stored super-block column by super-block
 * column. A group-block holds the R rows' super-block b with each field
 * side by side: the f16 fields as arrays of R, the rest of the block dword
 * by dword (dword k of rows 0..R-1, then dword k + 1):
 *     Q2_K: 20 dwords x R (scales 0-3, qs 4-19) | d[R] | dmin[R]
 *     Q3_K: 27 dwords x R (hmask 0-7, qs 8-23, scales 24-26) | d[R]
 *     Q4_K: d[R] | dmin[R] | 35 dwords x R (scales 0-2, qs 0-31)
 *     Q5_K: d[R] | dmin[R] | 43 dwords x R (scales 0-2, then the quants
 *           packed five bits to a byte, lane by lane: below)
 *     Q6_K: 52 dwords x R (scales 0-3, then per element group (h, c) its
 *           levels packed in 3 dwords) | d[R]
 *           (AVX2's groups of 8: levels packed and paired, below)
 * so a group-block takes exactly the bytes of its rows' blocks, a group of
 * one row is the file's block, and the tail rows past the last whole group
 * stay row-major where the file had them. One vector load brings a dword of
 * each of R rows, one row per 32-bit lane: the group kernels broadcast a
 * token's Q8_K dword against it, so every row's sums end in its own lane
 * and the float steps run per row in lanes, in the scalar reference's order
 * (kq_scalar.c): the reference vec_dot's bits for every row, token and
 * batch size. Jobs are struct quant_kq_gemm with W the repacked matrix
 * (wrow its row-major row bytes, group g at W + g * R * wrow). The types
 * this build repacks (quant_repack_fits' k-quants): */
/* Byte offsets of each field in a group-block of R rows (the layout above). */
#define KQRP_Q2K_SC(R) 0
#define KQRP_Q2K_QS(R) (4 * 4 * (R))
#define KQRP_Q2K_D(R) (20 * 4 * (R))
#define KQRP_Q2K_DMIN(R) (KQRP_Q2K_D(R) + 2 * (R))
#define KQRP_Q3K_HM(R) 0
#define KQRP_Q3K_QS(R) (8 * 4 * (R))
#define KQRP_Q3K_SC(R) (24 * 4 * (R))
#define KQRP_Q3K_D(R) (27 * 4 * (R))
#define KQRP_Q4K_D(R) 0
#define KQRP_Q4K_DMIN(R) (2 * (R))
#define KQRP_Q4K_SC(R) (4 * (R))
#define KQRP_Q4K_QS(R) (KQRP_Q4K_SC(R) + 3 * 4 * (R))
#define KQRP_Q5K_D(R) 0
#define KQRP_Q5K_DMIN(R) (2 * (R))
#define KQRP_Q5K_SC(R) (4 * (R))
/* Q5_K's quants in groups of R > 1: ggml's four low bits in qs and fifth
 * bit in qh took 3.5 vector ops per dword of levels (u = q) to join
 * (AVX-512; 4.4 with AVX2), more than the two of its dot, so a group-block
 * stores the levels whole. Lane c (ggml's eight lanes: elements e with
 * e % 32 / 4 == c) has 8 level dwords U0..U7 of 4 levels each, held in 5
 * dwords D0..D4 whose byte i is
 *     D0 = U0 | (U5 & 7) << 5               D3 = U3 | (U7 & 7) << 5
 *     D1 = U1 | (U5 >> 3) << 5 | (U6 >> 3 & 1) << 7
 *     D2 = U2 | (U6 & 7) << 5               D4 = U4 | (U7 >> 3) << 5 | (U6 >> 4) << 7
 * (U0..U4 are one mask; U5..U7 come out with three shared masks). Byte i of
 * Un is the level of element kqrp_q5k_elem(R, c, n, i): sub-block n's (ggml's
 * order) or, in AVX2's groups of 8, paired: Un (n = 2k + h) holds two
 * elements of sub-block 2k and two of 2k + 1, so a vpmaddubsw sums each
 * sub-block's part in its own int16 half, two such add up, and one vpmaddwd
 * against (sc_2k, sc_2k+1) scales four dwords (the token's quants are
 * reordered to match once a block). */
#define KQRP_Q5K_PAIRED_ROWS 8
static inline bool kqrp_q5k_paired(int R) { return R == KQRP_Q5K_PAIRED_ROWS; }
/* Byte offset of dword Dj of lane c in a group-block of R rows. */
#define KQRP_Q5K_Q(R, c, j) (KQRP_Q5K_SC(R) + 4 * (size_t)(R) * (size_t)(3 + 5 * (c) + (j)))
static inline int kqrp_q5k_elem(int R, int c, int n, int i)
{
    if (!kqrp_q5k_paired(R))
        return 32 * n + 4 * c + i;
    return 32 * (n / 2 * 2 + i / 2) + 4 * c + 2 * (n % 2) + i % 2;
}
/* Q6_K in groups of R > 1 (AVX2's 8 below): the scale dwords, then per
 * element group (h, c) (elements 128h + 32q + 4c + i, q = 0..3, i = 0..3) a
 * unit of three dwords whose byte i is
 *     Uj | (bits 2j, 2j + 1 of U3) << 6,   j = 0..2,
 * Uq the level (q + 32, 0..63) of element 128h + 32q + 4c + i: three levels
 * whole (one mask each) and the fourth from the top bits, 9 vector ops
 * where ggml's ql and qh took 11. The units stream front to back: in ggml's
 * order (ql, qh, scales) an element group's bytes lay 1-2 KiB apart and
 * Q6_K decode read memory at 40-42 GB/s where bench_membw read 53-59 and
 * Q4_K 55-58; in this order 45-50, and 31 -> 33-34 where memory read 33
 * (Zen 4, 2 threads, bench_matmul --gguf llama-1b Q4_K_M's ffn_down). */
#define KQRP_Q6K_SC(R) 0
#define KQRP_Q6K_UNIT(R, h, c) (4 * (size_t)(R) * (size_t)(4 + 3 * (8 * (h) + (c))))
#define KQRP_Q6K_D(R) (52 * 4 * (R))
/* Q6_K in groups of KQRP_Q6K_JOINED_ROWS (AVX2's groups) is stored for
 * AVX2's kernel: without AVX-512 the vector ops, not the memory, bound its
 * decode; joining a quant's 4 low and 2 high bits took more of them than the
 * multiplies, and so did a vpmaddwd per dword. With u = q + 32 and
 * W(c, q, k) the four elements 32q + 4c + 2k + {0, 1, 128, 129} (a pair of
 * sub-block s = 2q + c / 4 and one of sub-block s + 8, both in ggml's lane c),
 * a row's 192 quant bytes are dwords 6c + 3k + j (c = 0..7, k = 0..1,
 * j = 0..2) whose byte i is
 *     W(c, j, k)[i] | (bits 2j, 2j + 1 of W(c, 3, k)[i]) << 6
 * (W(c, j, k) is that byte & 0x3f; W(c, 3, k) gathers the three bytes' top
 * bits), and its scale dword m (m = 0..3) is sc[2m], sc[2m + 8], sc[2m + 1],
 * sc[2m + 9]: a vpmaddubsw against the token's quants in the same order sums
 * each sub-block's pair in its own int16 half, so one vpmaddwd against
 * (sc_s, sc_s+8) scales two dwords. d stays where it is. Groups of other
 * sizes (AVX-512's 16) pack the levels in element order, above. */
#define KQRP_Q6K_JOINED_ROWS 8
static inline bool kqrp_q6k_joined(enum quant_type t, int R) { return t == QUANT_Q6_K && R == KQRP_Q6K_JOINED_ROWS; }
/* Byte offset of joined dword 6c + 3k + j in a group-block of R rows, and of its scale dwords. */
#define KQRP_Q6K_JQ(R, c, k, j) (4 * (size_t)(R) * (size_t)(6 * (c) + 3 * (k) + (j)))
#define KQRP_Q6K_JSC(R) (48 * 4 * (R))
/* Element i (0..3) of W(c, q, k), and where sub-block s's scale lies in a joined row's 16 scale bytes. */
static inline int kqrp_q6k_w_elem(int c, int q, int k, int i) { return 32 * q + 4 * c + 2 * k + (i & 1) + 128 * (i >> 1); }
static inline int kqrp_q6k_scale_at(int s) { return 4 * (s % 8 / 2) + 2 * (s % 2) + s / 8; }
/* IQ4_XS in the same scheme, its block's fields as they
 * are: d[R] | scales_h[R] | scales_l: 1 dword x R | qs: 32 dwords x R.
 * Qs dword 4j + m (block j of 32) holds elements 32j + 4m.. in its low
 * nibbles and 32j + 16 + 4m.. in its high ones: ggml's lanes m and m + 4. */
#define KQRP_IQ4XS_D(R) 0
#define KQRP_IQ4XS_SH(R) (2 * (R))
#define KQRP_IQ4XS_SL(R) (4 * (R))
#define KQRP_IQ4XS_QS(R) (8 * (R))
bool quant_kqrp_type(enum quant_type t);
/* Repack with any group size R (tests of the other builds' layouts). */
ks_status quant_kqrp_repack_as(enum quant_type t, int64_t rows, int64_t cols, void *W, int R);
/* Row r's super-block b (r inside the groups of R rows) in ggml's layout. */
void quant_kqrp_get_block(const void *W, enum quant_type t, int R, int64_t cols, int64_t r, int64_t b, void *out);
/* Row r of a repacked matrix of rows rows as f32 (groups and tail). */
void quant_kqrp_get_row(const void *W, enum quant_type t, int64_t rows, int64_t cols, int64_t r, float *y);
/* Groups [g0, g1) of rows against every token: the build's best kernel; the
 * scalar twin (any R); the SIMD kernels (R = 16, R = 8). */
void quant_kqrp_rows(const struct quant_kq_gemm *g, int64_t g0, int64_t g1);
void quant_kqrp_rows_ref(const struct quant_kq_gemm *g, int R, int64_t g0, int64_t g1);
/* The row-major tail rows of a repacked matrix of rows rows (none if rows is
 * a multiple of the group): the traits vec_dot, the reference's bits. */
void quant_kqrp_tail_rows(const struct quant_kq_gemm *g, int64_t rows);
/* nr (<= KQ_PANEL_ROWS) rows from r0 of a repacked matrix of rows rows into
 * one prefill panel, as quant_kq_unpack_panel does from row-major rows. */
void quant_kqrp_unpack_panel(enum quant_type t, const uint8_t *W, int64_t rows, int64_t cols, int64_t r0, int nr,
                             uint8_t *panel);
/* One super-block's exact integer sums in the reference's form: Q2_K's and
 * Q4_K's isum and msum, Q3_K's, Q6_K's (and Q5_K's) 8 lanes (Q5_K: and its mins). */
void quant_kq_q2_K_sums(const block_q2_K *x, const block_q8_K *y, int32_t *isum, int32_t *msum);
void quant_kq_q3_K_lanes(const block_q3_K *x, const block_q8_K *y, int32_t lane[8]);
void quant_kq_q4_K_sums(const block_q4_K *x, const block_q8_K *y, int32_t *isum, int32_t *msum);
void quant_kq_q6_K_lanes(const block_q6_K *x, const block_q8_K *y, int32_t lane[8]);
void quant_kq_q5_K_lanes(const block_q5_K *x, const block_q8_K *y, int32_t lane[8], int32_t *mins);
#if defined(QUANT_HAVE_AVX512)
#define KQRP_HAVE_AVX512 1
void quant_kqrp_rows_avx512(const struct quant_kq_gemm *g, int64_t g0, int64_t g1);
#endif
#if defined(QUANT_HAVE_AVX2)
#define KQRP_HAVE_AVX2 1
void quant_kqrp_rows_avx2(const struct quant_kq_gemm *g, int64_t g0, int64_t g1);
/* Rows r .. r + 8 (r % 8 == 0, inside the groups of Rg rows) into lanes
 * lane0 .. lane0 + 8 of a prefill panel, as quant_kq_unpack_lane stores
 * them; false if type t has no such unpacker (then row by row). */
bool quant_kqrp_unpack8_avx2(enum quant_type t, const uint8_t *W, int Rg, int64_t cols, int64_t r, uint8_t *panel,
                             int lane0);
#endif

/* ---- helpers shared by the kq_*.c files --------------------------------- */

/* Weight blocks are read as one long stream (a matrix-vector product runs
 * its rows back to back), and the hardware prefetcher alone leaves that
 * latency-bound, so every vec_dot fetches the block KQ_PREFETCH_BYTES ahead
 * of the one it reads; past the row that is the next row's. Whole-row
 * prefetches issued between vec_dots were 10-20% slower: they come in
 * bursts. 8 KiB beat 2 and 4 KiB by 2-6% (bench_matmul q6_K, llama-1b shapes,
 * 2 threads, AVX-512). A prefetch never faults, even past the allocation.
 * Into L2 only: QUANT_WEIGHT_PREFETCH (quant_internal.h). */
#ifndef KQ_PREFETCH_BYTES
#define KQ_PREFETCH_BYTES 8192
#endif
static inline void kq_prefetch_block(const void *block, size_t bytes)
{
    const char *p = (const char *)block + KQ_PREFETCH_BYTES;
    quant_prefetch_weights(p, bytes, false);
    __builtin_prefetch(p + bytes - 1, 0, QUANT_WEIGHT_PREFETCH);
}

/* IEEE half <-> float, kept inline here because every kernel converts a
 * block's d/dmin on the hot path. Same results as quant_f16_to_f32(). */
#if defined(__F16C__)
#include <immintrin.h>
static inline float kq_f16_to_f32(quant_f16 h) { return _cvtsh_ss(h); }
static inline quant_f16 kq_f32_to_f16(float f)
{
    return (quant_f16)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
#else
static inline float kq_bits_to_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t kq_f32_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float kq_f16_to_f32(quant_f16 h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0x1f)
        return kq_bits_to_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        float v = (float)man * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    return kq_bits_to_f32(sign | ((exp + 112) << 23) | (man << 13));
}
static inline quant_f16 kq_f32_to_f16(float f)
{
    uint32_t u = kq_f32_to_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    uint32_t au = u & 0x7fffffffu;
    if (au > 0x7f800000u) return (quant_f16)(sign | 0x7e00); /* NaN */
    if (au >= 0x477ff000u) return (quant_f16)(sign | 0x7c00); /* rounds to inf */
    if (au < 0x38800000u) { /* subnormal half: round(|f| * 2^24) */
        float v = kq_bits_to_f32(au) * 16777216.0f;
        return (quant_f16)(sign | (uint16_t)lrintf(v));
    }
    uint32_t r = au + 0xfffu + ((au >> 13) & 1); /* round to nearest even */
    return (quant_f16)(sign | ((r - 0x38000000u) >> 13));
}
#endif

/* Round to nearest, ties to even (ggml's nearest_int) of v already rounded
 * to float. cvtss2si rather than the 1.5*2^23 trick: GCC's default
 * -ffp-contract=fast would fuse that addition with the caller's multiply
 * and round a different value; lrintf() is a libm call unless errno is off. */
#if defined(__SSE2__)
#include <immintrin.h>
static inline int kq_nearest_int(float v) { return _mm_cvtss_si32(_mm_set_ss(v)); }
#else
static inline int kq_nearest_int(float v) { return (int)lrintf(v); }
#endif

/* One Q2_K / Q4_K block into the two chains of llama.cpp's repacked kernels
 * (kq_scalar.c): acc = fma(isum, d_x * d_y, acc), accm = fma(msum, dmin_x * d_y, accm). */
static inline void kq_chains_add(float *acc, float *accm, int32_t isum, int32_t msum, quant_f16 d, quant_f16 dmin,
                                 float yd)
{
    *acc = fmaf((float)isum, kq_f16_to_f32(d) * yd, *acc);
    *accm = fmaf((float)msum, kq_f16_to_f32(dmin) * yd, *accm);
}

#if defined(KQ_HAVE_AVX2)
#include "vmath/vmath_simd.h"
/* Up to four consecutive blocks into the chains, in block order: v[b] holds
 * block b's isum and v[4 + b] its msum, each as unreduced int32 lanes (zero
 * for b >= nblk); d, dmin the blocks' scales; y the first block's
 * activations. One horizontal sum of eight vectors serves the four blocks
 * where one per sum cost more than a block's dot product. */
static inline void kq_chains_add4(float *acc, float *accm, const __m256i v[8], int nblk, const quant_f16 d[4],
                                  const quant_f16 dmin[4], const block_q8_K *y)
{
    _Alignas(32) int32_t sums[8];
    _mm256_store_si256((__m256i *)sums, vmath_sums8_epi32(v));
    for (int b = 0; b < nblk; b++)
        kq_chains_add(acc, accm, sums[b], sums[4 + b], d[b], dmin[b], y[b].d);
}

/* One block's isum and msum as unreduced int32 lanes. */
typedef void (*kq_block_sums_fn)(const void *x, const block_q8_K *y, __m256i *sumi, __m256i *mins);

/* A Q2_K / Q4_K vec_dot: block_sums on every block (x_bytes each, d and dmin
 * at those offsets), four blocks into the chains at a time. Inlined with a
 * constant block_sums, so each kernel is one loop. */
static inline __attribute__((always_inline)) void kq_dot_by4(int n, float *s, const void *vx, size_t x_bytes,
                                                             size_t d_at, size_t dmin_at, const block_q8_K *y,
                                                             kq_block_sums_fn block_sums)
{
    const uint8_t *x = vx;
    const int nb = n / QK_K;
    float acc = 0, accm = 0;
    for (int i0 = 0; i0 < nb; i0 += 4) {
        const int nblk = nb - i0 < 4 ? nb - i0 : 4;
        __m256i v[8];
        quant_f16 d[4], dmin[4];
        for (int b = 0; b < 4; b++) {
            v[b] = v[4 + b] = _mm256_setzero_si256();
            if (b < nblk) {
                const uint8_t *xb = x + (size_t)(i0 + b) * x_bytes;
                block_sums(xb, &y[i0 + b], &v[b], &v[4 + b]);
                memcpy(&d[b], xb + d_at, sizeof d[b]);
                memcpy(&dmin[b], xb + dmin_at, sizeof dmin[b]);
            }
        }
        kq_chains_add4(&acc, &accm, v, nblk, d, dmin, &y[i0]);
    }
    *s = acc - accm;
}
#endif

/* Q4_K/Q5_K pack 8 six-bit scales and 8 six-bit mins into 12 bytes:
 * bytes 0-3 low 6 bits of scales 0-3, bytes 4-7 low 6 bits of mins 0-3,
 * bytes 8-11 low nibble scale 4-7 / high nibble min 4-7, and the top two
 * bits of scales/mins 4-7 in the top bits of bytes 0-3 / 4-7. */
static inline void kq_get_scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m)
{
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* All of a Q4_K/Q5_K block's scales and mins at once, as 16 bytes in out:
 * scales 0-7 then mins 0-7. */
static inline void kq_unpack_scales_k4(const uint8_t packed[K_SCALE_SIZE], uint32_t out[4])
{
    uint32_t w[3];
    memcpy(w, packed, sizeof w);
    out[0] = w[0] & 0x3f3f3f3fu;
    out[1] = (w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4);
    out[2] = w[1] & 0x3f3f3f3fu;
    out[3] = ((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4);
}

/* Q3_K's 16 scales unbiased, as 16 bytes in out (the SIMD kernels' form). */
static inline void kq_unpack_scales_q3(const uint8_t packed[12], int8_t out[16])
{
    uint32_t w[3], a[4];
    memcpy(w, packed, sizeof w);
    a[0] = (w[0] & 0x0f0f0f0fu) | (((w[2] >> 0) & 0x03030303u) << 4);
    a[1] = (w[1] & 0x0f0f0f0fu) | (((w[2] >> 2) & 0x03030303u) << 4);
    a[2] = ((w[0] >> 4) & 0x0f0f0f0fu) | (((w[2] >> 4) & 0x03030303u) << 4);
    a[3] = ((w[1] >> 4) & 0x0f0f0f0fu) | (((w[2] >> 6) & 0x03030303u) << 4);
    uint8_t b[16];
    memcpy(b, a, sizeof b);
    for (int i = 0; i < 16; i++) out[i] = (int8_t)(b[i] - 32);
}

/* Q3_K's 16 six-bit scales, biased by 32: low nibbles in bytes 0-7 (scales
 * 0-7 low nibble, 8-15 high nibble), top two bits in bytes 8-11. */
static inline int kq_q3_scale(const uint8_t *scales, int j)
{
    int lo = j < 8 ? scales[j] & 0xF : scales[j - 8] >> 4;
    int hi = (scales[8 + j % 4] >> (2 * (j / 4))) & 3;
    return (lo | (hi << 4)) - 32;
}

#endif
