/* model: write deterministic random models of real architectures' shapes.
 * Weights come from a counter-based PRNG seeded per (seed, tensor, row), so
 * the file is the same for any thread count. */
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "model/model.h"
#include "quant/quant.h"

/* ---- presets ------------------------------------------------------------- */

struct preset {
    const char *name;
    const char *arch;
    int dim, layers, heads, kv_heads, head_dim, ffn;
    int n_ctx_train;
    float rope_freq_base, rms_eps;
    int experts, experts_used, ffn_exp; /* experts 0: dense */
    float init_std, embd_std;           /* 0: the defaults (0.02, init_std) */
    bool untied;                        /* a separate output.weight */
    int router_period;                  /* router rows repeat with this period (0: off) */
};

static const struct preset g_presets[] = {
    {"llama-1b", "llama", 2048, 16, 32, 8, 64, 8192, 131072, 500000.0f, 1e-5f, 0, 0, 0, 0, 0, false, 0},
    {"smollm2-135m", "llama", 576, 30, 9, 3, 64, 1536, 8192, 100000.0f, 1e-5f, 0, 0, 0, 0, 0, false, 0},
    {"qwen3-0.6b", "qwen3", 1024, 28, 16, 8, 128, 3072, 40960, 1000000.0f, 1e-6f, 0, 0, 0, 0, 0, false, 0},
    {"tiny", "llama", 256, 4, 4, 2, 64, 768, 2048, 10000.0f, 1e-5f, 0, 0, 0, 0, 0, false, 0},
    /* Qwen3-30B-A3B: 128 experts of 768, 8 per token */
    {"qwen3moe-30b-a3b", "qwen3moe", 2048, 48, 32, 4, 128, 6144, 40960, 1000000.0f, 1e-6f, 128, 8, 768, 0, 0, false, 0},
    /* Mixtral 8x7B: llama with 8 experts of 14336, 2 per token */
    {"mixtral-8x7b", "llama", 4096, 32, 32, 8, 128, 14336, 32768, 1000000.0f, 1e-5f, 8, 2, 14336, 0, 0, false, 0},
    /* for tests against llama.cpp: larger weights spread the logits and the
     * router's probabilities, so greedy ids and expert choices are not near
     * ties; an untied output keeps greedy decoding from echoing the last token */
    {"tiny-qwen3moe", "qwen3moe", 256, 2, 4, 2, 64, 512, 2048, 1000000.0f, 1e-6f, 8, 2, 128, 0.06f, 1.0f, true, 0},
    {"tiny-mixtral", "llama", 256, 2, 4, 2, 64, 256, 2048, 1000000.0f, 1e-5f, 8, 2, 256, 0.06f, 1.0f, true, 0},
    /* 32 experts whose router rows repeat every 4: every probability is an
     * 8-way tie, and which 4 of the 8 a token gets is the sort's tie order */
    {"tiny-qwen3moe-ties", "qwen3moe", 256, 2, 4, 2, 64, 512, 2048, 1000000.0f, 1e-6f, 32, 4, 64, 0.06f, 1.0f, true, 4},
    /* dense, spread like the two above; every width a multiple of 256, so
     * that the 256-element super-block types (k-quants, i-quants) fit all */
    {"tiny-llama", "llama", 256, 2, 4, 2, 64, 512, 2048, 10000.0f, 1e-5f, 0, 0, 0, 0.06f, 1.0f, true, 0},
    /* Gemma 3 1B: 5 of every 6 layers in a 512 window (g_windows below) */
    {"gemma3-1b", "gemma3", 1152, 26, 4, 1, 256, 6912, 32768, 1000000.0f, 1e-6f, 0, 0, 0, 0, 0, false, 0},
    /* for tests against llama.cpp: 6 layers so both layer kinds occur (0-4 in a
     * window of 16, 5 global); an untied output keeps greedy decoding from
     * echoing the last token (the real models tie it) */
    {"tiny-gemma3", "gemma3", 256, 6, 4, 2, 64, 512, 2048, 1000000.0f, 1e-6f, 0, 0, 0, 0.06f, 0.06f, true, 0},
    /* llama.cpp's gemma2 always ties the output; small embeddings keep the
     * residual stream from echoing the last token */
    {"tiny-gemma2", "gemma2", 256, 4, 4, 2, 64, 512, 2048, 10000.0f, 1e-6f, 0, 0, 0, 0.06f, 0.01f, false, 0},
    /* gpt-oss-20b: 32 experts of 2880, 4 per token; 64 heads of 64 (4096 wide on a 2880 residual) */
    {"gpt-oss-20b", "gpt-oss", 2880, 24, 64, 8, 64, 2880, 131072, 150000.0f, 1e-5f, 32, 4, 2880, 0, 0, true, 0},
    /* for tests: 4 layers, so two slide (window 16, below a test's prompt and
     * generation) and two see everything; q is 512 wide on a 256 residual */
    {"tiny-gpt-oss", "gpt-oss", 256, 4, 8, 2, 64, 128, 131072, 150000.0f, 1e-5f, 16, 4, 128, 0.06f, 1.0f, true, 0},
    /* embedding models (g_embed_presets below): a llama-architecture embedder with mean pooling and
     * non-causal attention, and a Qwen3-Embedding-like one with last-token pooling, causal */
    {"tiny-llama-embed", "llama", 256, 2, 4, 2, 64, 512, 2048, 10000.0f, 1e-5f, 0, 0, 0, 0.06f, 1.0f, false, 0},
    {"tiny-qwen3-embed", "qwen3", 256, 2, 4, 2, 64, 512, 2048, 1000000.0f, 1e-6f, 0, 0, 0, 0.06f, 1.0f, false, 0},
    /* BERT-family encoders with a small made-up WordPiece vocabulary (write_wpm_vocab): bert with CLS
     * pooling as bge (512 learned positions), nomic-bert with mean pooling as nomic-embed-text; the
     * eps field is their LayerNorm epsilon */
    {"tiny-bert-embed", "bert", 256, 2, 4, 4, 64, 512, 512, 10000.0f, 1e-12f, 0, 0, 0, 0.06f, 1.0f, false, 0},
    {"tiny-nomic-bert-embed", "nomic-bert", 256, 2, 4, 4, 64, 512, 2048, 1000.0f, 1e-12f, 0, 0, 0, 0.06f, 1.0f,
     false, 0},
};

/* The embedding presets' pooling (enum model_pooling) and causality. */
static const struct {
    const char *name;
    int pooling_type;
    bool non_causal;
} g_embed_presets[] = {
    {"tiny-llama-embed", MODEL_POOLING_MEAN, true},
    {"tiny-qwen3-embed", MODEL_POOLING_LAST, false},
    {"tiny-bert-embed", MODEL_POOLING_CLS, true},
    {"tiny-nomic-bert-embed", MODEL_POOLING_MEAN, true},
};

/* The window and soft-capping of the gemma presets. tiny-gemma2's caps are
 * far below the real 50 / 30 so that tanh bends the synthetic model's small
 * scores and logits. */
static const struct {
    const char *name;
    int n_swa, swa_pattern;
    float attn_softcap, final_softcap;
} g_windows[] = {
    {"gemma3-1b", 512, 0, 0, 0},
    {"tiny-gemma3", 16, 0, 0, 0},
    {"tiny-gemma2", 16, 0, 1.5f, 1.0f},
};

/* gpt-oss presets' sliding window and YaRN (rope.scaling.factor, original context) */
static const struct {
    const char *name;
    int n_swa;
    float yarn_factor;
    int yarn_orig_ctx;
} g_oai_presets[] = {
    {"gpt-oss-20b", 128, 32.0f, 4096},
    {"tiny-gpt-oss", 16, 32.0f, 4096},
};

/* phi3 presets: a preset's shapes plus the vocabulary size, the rotated
 * dimensions, LongRoPE's original context (0: none) and the stored window. */
struct phi3_preset {
    struct preset base;
    int n_vocab, n_rot, n_ctx_orig, sliding_window;
};

static const struct phi3_preset g_phi3_presets[] = {
    /* Phi-3.5-mini-instruct: untied output, 128k LongRoPE from 4k */
    {{.name = "phi3-mini", .arch = "phi3", .dim = 3072, .layers = 32, .heads = 32, .kv_heads = 32, .head_dim = 96,
      .ffn = 8192, .n_ctx_train = 131072, .rope_freq_base = 10000.0f, .rms_eps = 1e-5f, .untied = true},
     .n_vocab = 32064, .n_ctx_orig = 4096, .sliding_window = 262144},
    /* Phi-4-mini-instruct: tied embeddings, GQA, 3/4 of each head rotated */
    {{.name = "phi4-mini", .arch = "phi3", .dim = 3072, .layers = 32, .heads = 24, .kv_heads = 8, .head_dim = 128,
      .ffn = 8192, .n_ctx_train = 131072, .rope_freq_base = 10000.0f, .rms_eps = 1e-5f},
     .n_vocab = 200064, .n_rot = 96, .n_ctx_orig = 4096, .sliding_window = 262144},
    /* for tests against llama.cpp: an original context of 64 is shorter than
     * any context llama.cpp makes (dumpref's), so its long factors and an
     * attn_factor of sqrt(2) are in play; partial rotation as Phi-4-mini */
    {{.name = "tiny-phi3", .arch = "phi3", .dim = 256, .layers = 2, .heads = 4, .kv_heads = 2, .head_dim = 64,
      .ffn = 256, .n_ctx_train = 4096, .rope_freq_base = 10000.0f, .rms_eps = 1e-5f, .init_std = 0.06f,
      .embd_std = 1.0f, .untied = true},
     .n_vocab = 512, .n_rot = 48, .n_ctx_orig = 64, .sliding_window = 2047},
    /* the same with an original context of 1024: llama.cpp's short factors at dumpref's context */
    {{.name = "tiny-phi3-short", .arch = "phi3", .dim = 256, .layers = 2, .heads = 4, .kv_heads = 2,
      .head_dim = 64, .ffn = 256, .n_ctx_train = 4096, .rope_freq_base = 10000.0f, .rms_eps = 1e-5f,
      .init_std = 0.06f, .embd_std = 1.0f, .untied = true},
     .n_vocab = 512, .n_rot = 48, .n_ctx_orig = 1024, .sliding_window = 2047},
};

const char *model_synth_preset_names(void)
{
    return "llama-1b smollm2-135m qwen3-0.6b tiny qwen3moe-30b-a3b mixtral-8x7b tiny-qwen3moe tiny-mixtral "
           "tiny-qwen3moe-ties tiny-llama phi3-mini phi4-mini tiny-phi3 tiny-phi3-short gemma3-1b tiny-gemma3 "
           "tiny-gemma2 gpt-oss-20b tiny-gpt-oss tiny-llama-embed tiny-qwen3-embed tiny-bert-embed "
           "tiny-nomic-bert-embed";
}

static void spec_from_preset(const struct preset *p, struct model_synth_spec *spec)
{
    *spec = (struct model_synth_spec){
        .arch = p->arch, .n_embd = p->dim, .n_layer = p->layers, .n_head = p->heads,
        .n_head_kv = p->kv_heads, .head_dim = p->head_dim, .n_ff = p->ffn, .n_expert = p->experts,
        .n_expert_used = p->experts_used, .n_ff_exp = p->ffn_exp, .n_vocab = 512,
        .n_ctx_train = p->n_ctx_train, .rope_freq_base = p->rope_freq_base, .rms_eps = p->rms_eps,
        .seed = 1234, .init_std = p->init_std, .embd_std = p->embd_std, .untied = p->untied,
        .router_period = p->router_period,
    };
}

ks_status model_synth_preset(const char *name, struct model_synth_spec *spec)
{
    for (size_t i = 0; i < sizeof g_phi3_presets / sizeof g_phi3_presets[0]; i++) {
        const struct phi3_preset *p = &g_phi3_presets[i];
        if (strcmp(p->base.name, name))
            continue;
        spec_from_preset(&p->base, spec);
        spec->n_vocab = p->n_vocab;
        spec->n_rot = p->n_rot;
        spec->n_ctx_orig = p->n_ctx_orig;
        spec->sliding_window = p->sliding_window;
        return KS_OK;
    }
    for (size_t i = 0; i < sizeof g_presets / sizeof g_presets[0]; i++) {
        const struct preset *p = &g_presets[i];
        if (strcmp(p->name, name))
            continue;
        spec_from_preset(p, spec);
        for (size_t w = 0; w < sizeof g_windows / sizeof g_windows[0]; w++)
            if (!strcmp(g_windows[w].name, name)) {
                spec->n_swa = g_windows[w].n_swa, spec->swa_pattern = g_windows[w].swa_pattern;
                spec->attn_softcap = g_windows[w].attn_softcap, spec->final_softcap = g_windows[w].final_softcap;
            }
        for (size_t k = 0; k < sizeof g_oai_presets / sizeof g_oai_presets[0]; k++)
            if (!strcmp(g_oai_presets[k].name, name)) {
                spec->n_swa = g_oai_presets[k].n_swa;
                spec->rope_yarn_factor = g_oai_presets[k].yarn_factor;
                spec->rope_yarn_orig_ctx = g_oai_presets[k].yarn_orig_ctx;
            }
        for (size_t k = 0; k < sizeof g_embed_presets / sizeof g_embed_presets[0]; k++)
            if (!strcmp(g_embed_presets[k].name, name)) {
                spec->pooling_type = g_embed_presets[k].pooling_type;
                spec->non_causal = g_embed_presets[k].non_causal;
            }
        return KS_OK;
    }
    return ks_fail(KS_ERR_INVALID_ARG, "unknown preset '%s' (expected one of: %s)", name,
                   model_synth_preset_names());
}

/* ---- tensor types, after llama-quantize ------------------------------------- */

struct type_plan {
    enum quant_type base;
    bool q4_k_m;
    bool pure;
    bool tied;
    int n_layer;
    int n_expert;
};

enum tensor_role { ROLE_EMBD, ROLE_OUTPUT, ROLE_ATTN_K, ROLE_ATTN_V, ROLE_FFN_DOWN, ROLE_MATRIX };

static ks_status plan_parse(const char *name, struct type_plan *p)
{
    if (!strcasecmp(name, "q4_k_m")) {
        p->base = QUANT_Q4_K;
        p->q4_k_m = true;
        return KS_OK;
    }
    static const enum quant_type allowed[] = {
        QUANT_F32,    QUANT_F16,    QUANT_BF16,  QUANT_Q8_0,    QUANT_Q4_0,   QUANT_Q4_1,    QUANT_Q5_0,
        QUANT_Q5_1,   QUANT_Q2_K,   QUANT_Q3_K,  QUANT_Q4_K,    QUANT_Q5_K,   QUANT_Q6_K,    QUANT_IQ4_NL,
        QUANT_IQ4_XS, QUANT_MXFP4,  QUANT_IQ3_XXS, QUANT_IQ3_S, QUANT_IQ2_S, QUANT_IQ2_XXS, QUANT_IQ2_XS,
        QUANT_IQ1_S,  QUANT_IQ1_M};
    enum quant_type t;
    if (quant_type_from_name(name, &t) == KS_OK)
        for (size_t i = 0; i < sizeof allowed / sizeof allowed[0]; i++)
            if (allowed[i] == t) {
                p->base = t;
                return KS_OK;
            }
    return ks_fail(KS_ERR_INVALID_ARG,
                   "synth type '%s' is not one of f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k, "
                   "q4_k_m, iq4_nl, iq4_xs, mxfp4, iq3_xxs, iq3_s, iq2_s, iq2_xxs, iq2_xs, iq1_s, iq1_m",
                   name);
}

/* llama.cpp's use_more_bits(): the first and last eighth and every third layer between. */
static bool use_more_bits(int i, int n)
{
    return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2;
}

static bool fits(enum quant_type t, int64_t cols)
{
    return quant_row_size(t, cols) != 0;
}

/* llama-quantize's fallback for rows that are not a multiple of the block. */
static enum quant_type fallback(enum quant_type t, int64_t cols)
{
    if (!fits(t, cols)) {
        switch (t) {
        case QUANT_Q4_K: t = QUANT_Q5_0; break;
        case QUANT_Q5_K: t = QUANT_Q5_1; break;
        case QUANT_Q6_K: t = QUANT_Q8_0; break;
        case QUANT_IQ4_XS:
        case QUANT_IQ3_XXS:
        case QUANT_IQ3_S:
        case QUANT_IQ2_S:
        case QUANT_IQ2_XXS:
        case QUANT_IQ2_XS:
        case QUANT_IQ1_S:
        case QUANT_IQ1_M:
        case QUANT_Q2_K:
        case QUANT_Q3_K: t = QUANT_IQ4_NL; break;
        default: break;
        }
    }
    return fits(t, cols) ? t : QUANT_F16;
}

static enum quant_type plan_type(const struct type_plan *p, enum tensor_role role, int layer, int64_t cols)
{
    enum quant_type t = p->base;
    if (p->q4_k_m && (role == ROLE_ATTN_V || role == ROLE_FFN_DOWN) && use_more_bits(layer, p->n_layer))
        t = QUANT_Q6_K;
    const struct quant_traits *tr = quant_traits(p->base);
    /* llama-quantize: "for the 8-expert model, bumping this to Q8_0 trades just ~128MB" */
    if (!p->pure && tr->is_quantized && p->n_expert == 8 && (role == ROLE_ATTN_K || role == ROLE_ATTN_V))
        t = QUANT_Q8_0;
    bool is_output = role == ROLE_OUTPUT || (role == ROLE_EMBD && p->tied);
    if (!p->pure && is_output && tr->is_quantized)
        t = cols % tr->block_elems != 0 ? QUANT_Q8_0 : t != QUANT_Q8_0 ? QUANT_Q6_K : t;
    return fallback(t, cols);
}

/* ---- deterministic weights -------------------------------------------------- */

static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [center - half, center + half]: std = half / sqrt(3). */
struct fill {
    float center, half;
};

struct gen_job {
    uint64_t seed;
    int64_t rows, cols;
    int64_t row_period;      /* row r is generated as row r % row_period (0: off) */
    struct fill fill;
    enum quant_type type;
    uint8_t *dst;
    size_t row_bytes;
    atomic_int failed;
};

static void gen_row(const struct gen_job *j, int64_t r, float *row)
{
    if (j->row_period > 0)
        r %= j->row_period;
    uint64_t s = j->seed ^ ((uint64_t)r * 0xd1b54a32d192ed03ull);
    for (int64_t c = 0; c < j->cols; c++) {
        float u = (float)((splitmix64(&s) >> 40) * 0x1p-24) * 2.0f - 1.0f;
        row[c] = j->fill.center + j->fill.half * u;
    }
}

static void gen_task(void *p, int ith, int nth)
{
    struct gen_job *j = p;
    int64_t lo, hi;
    threads_split(j->rows, ith, nth, &lo, &hi);
    float *row = malloc(sizeof(float) * (size_t)j->cols);
    if (!row) {
        atomic_store(&j->failed, 1);
        return;
    }
    const struct quant_traits *tr = quant_traits(j->type);
    for (int64_t r = lo; r < hi; r++) {
        gen_row(j, r, row);
        if (j->type == QUANT_F32)
            memcpy(j->dst + r * j->row_bytes, row, j->row_bytes);
        else
            tr->from_float(row, j->dst + r * j->row_bytes, j->cols);
    }
    free(row);
}

/* ---- the writer session ----------------------------------------------------- */

struct synth {
    const struct model_synth_spec *spec;
    struct type_plan plan;
    struct gguf_writer *w;
    threads_pool *pool;
    int64_t row_period;       /* the next add_tensor's gen_job.row_period */
    void **bufs;
    size_t n_bufs, cap_bufs;
};

/* A tensor of n_mats matrices of rows x cols (n_mats > 1: a 3-D expert tensor
 * [cols, rows, n_mats]); row r of matrix e is generated as row e * rows + r. */
static ks_status add_tensor(struct synth *s, const char *name, int64_t n_mats, int64_t rows, int64_t cols,
                            enum quant_type type, struct fill fill)
{
    const struct quant_traits *tr = quant_traits(type);
    if (!tr || (type != QUANT_F32 && !tr->from_float))
        return ks_fail(KS_ERR_UNSUPPORTED, "synth: tensor %s needs type %s, which kvserve cannot quantize to yet",
                       name, quant_type_name(type));
    size_t row_bytes = quant_row_size(type, cols);
    if (row_bytes == 0)
        return ks_fail(KS_ERR_INVALID_ARG, "synth: tensor %s: %lld columns do not fit type %s", name,
                       (long long)cols, tr->name);
    if (s->n_bufs == s->cap_bufs) {
        size_t cap = s->cap_bufs ? 2 * s->cap_bufs : 64;
        void **nb = realloc(s->bufs, cap * sizeof *nb);
        if (!nb)
            return ks_fail(KS_ERR_NOMEM, "synth: out of memory");
        s->bufs = nb;
        s->cap_bufs = cap;
    }
    size_t bytes = row_bytes * (size_t)rows * (size_t)n_mats;
    uint8_t *data = malloc(bytes);
    if (!data)
        return ks_fail(KS_ERR_NOMEM, "synth: out of memory for tensor %s (%zu bytes)", name, bytes);
    s->bufs[s->n_bufs++] = data;
    struct gen_job j = {.seed = XXH3_64bits(name, strlen(name)) ^ (s->spec->seed * 0x9e3779b97f4a7c15ull), .rows = rows * n_mats,
                        .row_period = s->row_period,
                        .cols = cols, .fill = fill, .type = type, .dst = data, .row_bytes = row_bytes};
    atomic_init(&j.failed, 0);
    threads_run(s->pool, gen_task, &j);
    if (atomic_load(&j.failed))
        return ks_fail(KS_ERR_NOMEM, "synth: out of memory generating %s", name);
    int64_t ne[3] = {cols, rows, n_mats};
    return gguf_writer_add_tensor(s->w, name, n_mats > 1 ? 3 : rows == 1 ? 1 : 2, ne, type, data, bytes);
}

/* n_mats matrices (n_mats > 1: a 3-D expert tensor) */
static ks_status add_matrices(struct synth *s, const char *name, enum tensor_role role, int layer, int64_t n_mats,
                              int64_t rows, int64_t cols)
{
    float std = s->spec->init_std > 0 ? s->spec->init_std : 0.02f;
    if (role == ROLE_EMBD && s->spec->embd_std > 0)
        std = s->spec->embd_std;
    struct fill f = {0.0f, std * sqrtf(3.0f)};
    return add_tensor(s, name, n_mats, rows, cols, plan_type(&s->plan, role, layer, cols), f);
}

static ks_status add_matrix(struct synth *s, const char *name, enum tensor_role role, int layer, int64_t rows,
                            int64_t cols)
{
    return add_matrices(s, name, role, layer, 1, rows, cols);
}

/* Norm weights near 1, biases small: activations stay sane at any depth. */
static ks_status add_vector(struct synth *s, const char *name, int64_t n, struct fill f)
{
    return add_tensor(s, name, 1, 1, n, QUANT_F32, f);
}

/* phi3, as convert_hf_to_gguf writes it: Q, K and V rows in one attn_qkv,
 * gate and up rows in one ffn_up. */
static ks_status add_phi3_layer(struct synth *s, int il)
{
    const struct model_synth_spec *sp = s->spec;
    int64_t E = sp->n_embd, q_dim = (int64_t)sp->n_head * sp->head_dim, kv_dim = (int64_t)sp->n_head_kv * sp->head_dim;
    const struct fill norm = {1.0f, 0.2f};
    char n[96];
    ks_status st;
#define NAME(x) (snprintf(n, sizeof n, "blk.%d." x, il), n)
    if ((st = add_vector(s, NAME("attn_norm.weight"), E, norm)) ||
        /* llama-quantize's category_is_attn_v() takes attn_qkv in with attn_v */
        (st = add_matrix(s, NAME("attn_qkv.weight"), ROLE_ATTN_V, il, q_dim + 2 * kv_dim, E)) ||
        (st = add_matrix(s, NAME("attn_output.weight"), ROLE_MATRIX, il, E, q_dim)) ||
        (st = add_vector(s, NAME("ffn_norm.weight"), E, norm)) ||
        (st = add_matrix(s, NAME("ffn_up.weight"), ROLE_MATRIX, il, 2 * (int64_t)sp->n_ff, E)) ||
        (st = add_matrix(s, NAME("ffn_down.weight"), ROLE_FFN_DOWN, il, E, sp->n_ff)))
        return st;
#undef NAME
    return KS_OK;
}

/* LongRoPE's per-dimension factors, f32 as the converter writes them: short
 * ones near 1, long ones up to 15 (Phi-3.5's grow from 1 to about 60). */
static ks_status add_longrope_factors(struct synth *s)
{
    const struct model_synth_spec *sp = s->spec;
    int64_t half = (sp->n_rot > 0 ? sp->n_rot : sp->head_dim) / 2;
    ks_status st = add_vector(s, "rope_factors_long.weight", half, (struct fill){8.0f, 7.0f});
    return st ? st : add_vector(s, "rope_factors_short.weight", half, (struct fill){1.05f, 0.05f});
}

static bool is_gemma(const char *arch) { return !strcmp(arch, "gemma2") || !strcmp(arch, "gemma3"); }

/* gpt-oss's extra tensors: attention output bias, sinks, router bias and a
 * bias per expert and matrix (llama.cpp's openai-moe names and shapes). */
static ks_status add_gpt_oss_layer(struct synth *s, int il)
{
    const struct model_synth_spec *sp = s->spec;
    int64_t E = sp->n_embd, F = sp->n_ff_exp > 0 ? sp->n_ff_exp : sp->n_ff, X = sp->n_expert;
    const struct fill bias = {0.0f, 0.1f}, sink = {0.0f, 2.0f};
    char n[96];
    ks_status st;
#define NAME(x) (snprintf(n, sizeof n, "blk.%d." x, il), n)
    if ((st = add_vector(s, NAME("attn_output.bias"), E, bias)) ||
        (st = add_vector(s, NAME("attn_sinks.weight"), sp->n_head, sink)) ||
        (st = add_vector(s, NAME("ffn_gate_inp.bias"), X, bias)) ||
        (st = add_tensor(s, NAME("ffn_gate_exps.bias"), 1, X, F, QUANT_F32, bias)) ||
        (st = add_tensor(s, NAME("ffn_up_exps.bias"), 1, X, F, QUANT_F32, bias)))
        return st;
    return add_tensor(s, NAME("ffn_down_exps.bias"), 1, X, E, QUANT_F32, bias);
#undef NAME
}
static ks_status add_layer(struct synth *s, int il, bool qkv_bias, bool qk_norm)
{
    const struct model_synth_spec *sp = s->spec;
    int64_t E = sp->n_embd, q_dim = (int64_t)sp->n_head * sp->head_dim, kv_dim = (int64_t)sp->n_head_kv * sp->head_dim;
    const struct fill norm = {1.0f, 0.2f}, bias = {0.0f, 0.1f};
    char n[96];
    ks_status st;
#define NAME(x) (snprintf(n, sizeof n, "blk.%d." x, il), n)
    if ((st = add_vector(s, NAME("attn_norm.weight"), E, norm)) ||
        (st = add_matrix(s, NAME("attn_q.weight"), ROLE_MATRIX, il, q_dim, E)) ||
        (st = add_matrix(s, NAME("attn_k.weight"), ROLE_ATTN_K, il, kv_dim, E)) ||
        (st = add_matrix(s, NAME("attn_v.weight"), ROLE_ATTN_V, il, kv_dim, E)) ||
        (st = add_matrix(s, NAME("attn_output.weight"), ROLE_MATRIX, il, E, q_dim)))
        return st;
    bool oai = !strcmp(sp->arch, "gpt-oss");
    if ((st = add_vector(s, oai ? NAME("post_attention_norm.weight") : NAME("ffn_norm.weight"), E, norm)) ||
        (oai && (st = add_gpt_oss_layer(s, il))))
        return st;
    if (sp->n_expert == 0 &&
        ((st = add_matrix(s, NAME("ffn_gate.weight"), ROLE_MATRIX, il, sp->n_ff, E)) ||
         (st = add_matrix(s, NAME("ffn_up.weight"), ROLE_MATRIX, il, sp->n_ff, E)) ||
         (st = add_matrix(s, NAME("ffn_down.weight"), ROLE_FFN_DOWN, il, E, sp->n_ff))))
        return st;
    /* The router stays F32 at every type: llama-quantize never quantizes
     * ffn_gate_inp, and convert_hf_to_gguf writes it F32. */
    int64_t F = sp->n_ff_exp > 0 ? sp->n_ff_exp : sp->n_ff, X = sp->n_expert;
    float std = sp->init_std > 0 ? sp->init_std : 0.02f;
    s->row_period = sp->router_period;
    st = sp->n_expert > 0 ? add_tensor(s, NAME("ffn_gate_inp.weight"), 1, X, E, QUANT_F32,
                                       (struct fill){0.0f, std * sqrtf(3.0f)})
                          : KS_OK;
    s->row_period = 0;
    if (st)
        return st;
    if (sp->n_expert > 0 &&
        ((st = add_matrices(s, NAME("ffn_gate_exps.weight"), ROLE_MATRIX, il, X, F, E)) ||
         (st = add_matrices(s, NAME("ffn_up_exps.weight"), ROLE_MATRIX, il, X, F, E)) ||
         (st = add_matrices(s, NAME("ffn_down_exps.weight"), ROLE_FFN_DOWN, il, X, E, F))))
        return st;
    if (qkv_bias && ((st = add_vector(s, NAME("attn_q.bias"), q_dim, bias)) ||
                     (st = add_vector(s, NAME("attn_k.bias"), kv_dim, bias)) ||
                     (st = add_vector(s, NAME("attn_v.bias"), kv_dim, bias))))
        return st;
    if (qk_norm && ((st = add_vector(s, NAME("attn_q_norm.weight"), sp->head_dim, norm)) ||
                    (st = add_vector(s, NAME("attn_k_norm.weight"), sp->head_dim, norm))))
        return st;
    /* gemma's post-norms (the converter has already added Gemma's +1 to every norm weight) */
    if (is_gemma(sp->arch) && ((st = add_vector(s, NAME("post_attention_norm.weight"), E, norm)) ||
                               (st = add_vector(s, NAME("post_ffw_norm.weight"), E, norm))))
        return st;
#undef NAME
    return KS_OK;
}

/* ---- vocabulary ---------------------------------------------------------------- */

enum { TOKEN_NORMAL = 1, TOKEN_UNKNOWN = 2, TOKEN_CONTROL = 3, TOKEN_UNUSED = 5, TOKEN_BYTE = 6 };
#define SYNTH_MIN_VOCAB 259 /* <unk> <s> </s> and 256 byte pieces */

/* Piece i after the specials and bytes: "▁", printable ASCII, "▁a".."▁z",
 * lowercase pairs, then unused fillers. */
static void vocab_piece(int i, char *buf, size_t cap, int *type)
{
    static const char space[] = "\xe2\x96\x81"; /* U+2581 */
    *type = TOKEN_NORMAL;
    if (i == 0) {
        snprintf(buf, cap, "%s", space);
    } else if ((i -= 1) < 94) {
        snprintf(buf, cap, "%c", 0x21 + i);
    } else if ((i -= 94) < 26) {
        snprintf(buf, cap, "%s%c", space, 'a' + i);
    } else if ((i -= 26) < 26 * 26) {
        snprintf(buf, cap, "%c%c", 'a' + i / 26, 'a' + i % 26);
    } else {
        snprintf(buf, cap, "<unused%d>", i - 26 * 26);
        *type = TOKEN_UNUSED;
    }
}

static ks_status write_byte_vocab(struct gguf_writer *w, int n_vocab)
{
    char **strs = calloc((size_t)n_vocab, sizeof *strs);
    float *scores = calloc((size_t)n_vocab, sizeof *scores);
    int32_t *types = calloc((size_t)n_vocab, sizeof *types);
    ks_status st = KS_OK;
    if (!strs || !scores || !types) {
        st = ks_fail(KS_ERR_NOMEM, "synth: out of memory for the vocabulary");
        goto done;
    }
    for (int i = 0; i < n_vocab && !st; i++) {
        char buf[32];
        int type;
        if (i < 3) {
            snprintf(buf, sizeof buf, "%s", i == 0 ? "<unk>" : i == 1 ? "<s>" : "</s>");
            type = i == 0 ? TOKEN_UNKNOWN : TOKEN_CONTROL;
        } else if (i < SYNTH_MIN_VOCAB) {
            snprintf(buf, sizeof buf, "<0x%02X>", i - 3);
            type = TOKEN_BYTE;
        } else {
            vocab_piece(i - SYNTH_MIN_VOCAB, buf, sizeof buf, &type);
            scores[i] = type == TOKEN_NORMAL ? -(float)(i - SYNTH_MIN_VOCAB) : 0.0f;
        }
        types[i] = type;
        strs[i] = strdup(buf);
        if (!strs[i])
            st = ks_fail(KS_ERR_NOMEM, "synth: out of memory for the vocabulary");
    }
    if (!st && !(st = gguf_writer_set_str(w, "tokenizer.ggml.model", "llama")) &&
        !(st = gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", (const char *const *)strs, NULL, (uint64_t)n_vocab)) &&
        !(st = gguf_writer_set_arr(w, "tokenizer.ggml.scores", GGUF_TYPE_FLOAT32, scores, (uint64_t)n_vocab)) &&
        !(st = gguf_writer_set_arr(w, "tokenizer.ggml.token_type", GGUF_TYPE_INT32, types, (uint64_t)n_vocab)) &&
        !(st = gguf_writer_set_u32(w, "tokenizer.ggml.unknown_token_id", 0)) &&
        !(st = gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", 1)) &&
        !(st = gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", 2)) &&
        !(st = gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", true)))
        st = gguf_writer_set_bool(w, "tokenizer.ggml.add_eos_token", false);
done:
    if (strs)
        for (int i = 0; i < n_vocab; i++)
            free(strs[i]);
    free(strs), free(scores), free(types);
    return st;
}

static bool is_encoder(const char *arch) { return !strcmp(arch, "bert") || !strcmp(arch, "nomic-bert"); }

/* The words and word pieces of write_wpm_vocab beyond single characters. */
static const char *const g_wpm_words[] = {
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world", "this", "is", "test",
    "again", "and", "of", "to", "in", "it", "for", "on", "with", "as", "at", "by", "an", "be", "un",
    "embed", "model", "token", "text", "search", "query", "passage", "document",
};
static const char *const g_wpm_pieces[] = {"ing", "tion", "ment", "ness", "able", "ding", "est", "ful"};

/* One WordPiece vocabulary entry i of write_wpm_vocab, as llama.cpp's
 * converter stores BERT vocabularies: a word-initial piece prefixed with
 * U+2581, a continuation ("##x" in the HF vocab) bare, [SPECIAL] as it is. */
static void wpm_piece(int i, char *buf, size_t cap, int *type)
{
    static const char space[] = "\xe2\x96\x81";
    int n_words = (int)(sizeof g_wpm_words / sizeof g_wpm_words[0]);
    int n_pieces = (int)(sizeof g_wpm_pieces / sizeof g_wpm_pieces[0]);
    *type = TOKEN_NORMAL;
    if (i == 0 || i < 100) {
        snprintf(buf, cap, i == 0 ? "[PAD]" : "[unused%d]", i - 1);
        *type = TOKEN_CONTROL;
    } else if (i <= 103) {
        snprintf(buf, cap, "%s", i == 100 ? "[UNK]" : i == 101 ? "[CLS]" : i == 102 ? "[SEP]" : "[MASK]");
        *type = i == 100 ? TOKEN_UNKNOWN : TOKEN_CONTROL;
    } else if ((i -= 104) < 94 - 26) { /* every printable ASCII character but the capitals, word-initial */
        int c = 0x21 + i;
        c += c >= 'A' ? 26 : 0;
        snprintf(buf, cap, "%s%c", space, c);
    } else if ((i -= 94 - 26) < 36) { /* letters and digits as continuations */
        snprintf(buf, cap, "%c", i < 26 ? 'a' + i : '0' + i - 26);
    } else if ((i -= 36) < n_words) {
        snprintf(buf, cap, "%s%s", space, g_wpm_words[i]);
    } else if ((i -= n_words) < n_pieces) {
        snprintf(buf, cap, "%s", g_wpm_pieces[i]);
    } else { /* two-letter continuations, "aa", "ab", ... (none equals a piece above) */
        i -= n_pieces;
        snprintf(buf, cap, "%c%c", 'a' + i / 26 % 26, 'a' + i % 26);
    }
}

/* A small WordPiece ("bert") vocabulary of n_vocab tokens: BERT's special
 * ids ([PAD] 0, [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103), the printable
 * characters word-initial, letters and digits as continuations, a few words
 * and suffixes, then two-letter continuations; the keys convert_hf_to_gguf
 * writes for a BERT model. */
static ks_status write_wpm_vocab(struct gguf_writer *w, int n_vocab)
{
    char **strs = calloc((size_t)n_vocab, sizeof *strs);
    int32_t *types = calloc((size_t)n_vocab, sizeof *types);
    ks_status st = KS_OK;
    if (!strs || !types)
        st = ks_fail(KS_ERR_NOMEM, "synth: out of memory for the vocabulary");
    for (int i = 0; i < n_vocab && !st; i++) {
        char buf[32];
        int type;
        wpm_piece(i, buf, sizeof buf, &type);
        types[i] = type;
        if (!(strs[i] = strdup(buf)))
            st = ks_fail(KS_ERR_NOMEM, "synth: out of memory for the vocabulary");
    }
    if (!st && !(st = gguf_writer_set_str(w, "tokenizer.ggml.model", "bert")) &&
        !(st = gguf_writer_set_str(w, "tokenizer.ggml.pre", "default")) &&
        !(st = gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", (const char *const *)strs, NULL, (uint64_t)n_vocab)) &&
        !(st = gguf_writer_set_arr(w, "tokenizer.ggml.token_type", GGUF_TYPE_INT32, types, (uint64_t)n_vocab)) &&
        !(st = gguf_writer_set_u32(w, "tokenizer.ggml.token_type_count", 2)) &&
        !(st = gguf_writer_set_u32(w, "tokenizer.ggml.unknown_token_id", 100)) &&
        !(st = gguf_writer_set_u32(w, "tokenizer.ggml.cls_token_id", 101)) &&
        !(st = gguf_writer_set_u32(w, "tokenizer.ggml.seperator_token_id", 102)) &&
        !(st = gguf_writer_set_u32(w, "tokenizer.ggml.padding_token_id", 0)))
        st = gguf_writer_set_u32(w, "tokenizer.ggml.mask_token_id", 103);
    if (strs)
        for (int i = 0; i < n_vocab; i++)
            free(strs[i]);
    free(strs), free(types);
    return st;
}

static ks_status add_vocab(struct synth *s, const char *vocab_path, int *n_vocab)
{
    if (!vocab_path && is_encoder(s->spec->arch)) {
        *n_vocab = s->spec->n_vocab;
        if (*n_vocab < 300 || *n_vocab > 26 * 26)
            return ks_fail(KS_ERR_INVALID_ARG, "synth: a WordPiece vocab size %d must be in [300, 676]", *n_vocab);
        return write_wpm_vocab(s->w, *n_vocab);
    }
    if (!vocab_path) {
        *n_vocab = s->spec->n_vocab;
        if (*n_vocab < SYNTH_MIN_VOCAB || *n_vocab > (1 << 20))
            return ks_fail(KS_ERR_INVALID_ARG, "synth: vocab size %d must be in [%d, 1048576]", *n_vocab,
                           SYNTH_MIN_VOCAB);
        return write_byte_vocab(s->w, *n_vocab);
    }
    struct gguf_file *vf;
    ks_status st = gguf_open(vocab_path, &vf);
    if (st) {
        ks_errmsg_prefix("synth: vocab %s: ", vocab_path);
        return st;
    }
    enum gguf_value_type et;
    uint64_t count = 0;
    const void *data;
    st = gguf_get_arr(vf, "tokenizer.ggml.tokens", &et, &count, &data);
    if (st || et != GGUF_TYPE_STRING || count == 0 || count > (1u << 30))
        st = ks_fail(KS_ERR_FORMAT, "synth: %s has no tokenizer.ggml.tokens string array", vocab_path);
    if (!st)
        st = gguf_writer_copy_kv(s->w, vf, "tokenizer.");
    *n_vocab = (int)count;
    gguf_close(vf);
    return st;
}

/* ---- BERT-family encoders -------------------------------------------------------- */

/* A bert / nomic-bert layer as convert_hf_to_gguf writes one: bert's
 * separate Q/K/V and FFN with biases, nomic-bert's fused attn_qkv and SwiGLU
 * without; both with attn_output_norm and layer_output_norm (LayerNorm
 * weights and biases). */
static ks_status add_encoder_layer(struct synth *s, int il)
{
    const struct model_synth_spec *sp = s->spec;
    int64_t E = sp->n_embd, F = sp->n_ff;
    bool nomic = !strcmp(sp->arch, "nomic-bert");
    const struct fill norm = {1.0f, 0.2f}, bias = {0.0f, 0.1f};
    char n[96];
    ks_status st;
#define NAME(x) (snprintf(n, sizeof n, "blk.%d." x, il), n)
    if (nomic ? (st = add_matrix(s, NAME("attn_qkv.weight"), ROLE_ATTN_V, il, 3 * E, E))
              : ((st = add_matrix(s, NAME("attn_q.weight"), ROLE_MATRIX, il, E, E)) ||
                 (st = add_vector(s, NAME("attn_q.bias"), E, bias)) ||
                 (st = add_matrix(s, NAME("attn_k.weight"), ROLE_ATTN_K, il, E, E)) ||
                 (st = add_vector(s, NAME("attn_k.bias"), E, bias)) ||
                 (st = add_matrix(s, NAME("attn_v.weight"), ROLE_ATTN_V, il, E, E)) ||
                 (st = add_vector(s, NAME("attn_v.bias"), E, bias))))
        return st;
    if ((st = add_matrix(s, NAME("attn_output.weight"), ROLE_MATRIX, il, E, E)) ||
        (!nomic && (st = add_vector(s, NAME("attn_output.bias"), E, bias))) ||
        (st = add_vector(s, NAME("attn_output_norm.weight"), E, norm)) ||
        (st = add_vector(s, NAME("attn_output_norm.bias"), E, bias)) ||
        (st = add_matrix(s, NAME("ffn_up.weight"), ROLE_MATRIX, il, F, E)) ||
        (!nomic && (st = add_vector(s, NAME("ffn_up.bias"), F, bias))) ||
        (nomic && (st = add_matrix(s, NAME("ffn_gate.weight"), ROLE_MATRIX, il, F, E))) ||
        (st = add_matrix(s, NAME("ffn_down.weight"), ROLE_FFN_DOWN, il, E, F)) ||
        (!nomic && (st = add_vector(s, NAME("ffn_down.bias"), E, bias))) ||
        (st = add_vector(s, NAME("layer_output_norm.weight"), E, norm)))
        return st;
    return add_vector(s, NAME("layer_output_norm.bias"), E, bias);
#undef NAME
}

/* Token embeddings, two token types, bert's learned positions (f32, which
 * llama-quantize leaves as they are), the embeddings' LayerNorm, the layers;
 * no output norm or matrix. */
static ks_status add_encoder(struct synth *s, int n_vocab)
{
    const struct model_synth_spec *sp = s->spec;
    int64_t E = sp->n_embd;
    float std = sp->init_std > 0 ? sp->init_std : 0.02f;
    const struct fill small = {0.0f, std * sqrtf(3.0f)}, norm = {1.0f, 0.2f}, bias = {0.0f, 0.1f};
    ks_status st;
    if ((st = add_matrix(s, "token_embd.weight", ROLE_EMBD, 0, n_vocab, E)) ||
        (st = add_tensor(s, "token_types.weight", 1, 2, E, QUANT_F32, small)) ||
        (!strcmp(sp->arch, "bert") &&
         (st = add_tensor(s, "position_embd.weight", 1, sp->n_ctx_train, E, QUANT_F32, small))) ||
        (st = add_vector(s, "token_embd_norm.weight", E, norm)) ||
        (st = add_vector(s, "token_embd_norm.bias", E, bias)))
        return st;
    for (int il = 0; il < sp->n_layer && !st; il++)
        st = add_encoder_layer(s, il);
    return st;
}

/* ---- metadata ------------------------------------------------------------------ */

/* llama_ftype ids, for general.file_type (display only). */
static uint32_t file_type(const struct type_plan *p)
{
    if (p->q4_k_m)
        return 15;
    switch (p->base) {
    case QUANT_F32: return 0;
    case QUANT_F16: return 1;
    case QUANT_Q4_0: return 2;
    case QUANT_Q4_1: return 3;
    case QUANT_Q8_0: return 7;
    case QUANT_Q5_0: return 8;
    case QUANT_Q5_1: return 9;
    case QUANT_Q2_K: return 10;
    case QUANT_Q3_K: return 11; /* Q3_K_S: all of its matrices Q3_K */
    case QUANT_Q4_K: return 14;
    case QUANT_Q5_K: return 16;
    case QUANT_Q6_K: return 18;
    case QUANT_IQ4_NL: return 25;
    case QUANT_IQ4_XS: return 30;
    case QUANT_IQ3_XXS: return 23;
    case QUANT_IQ3_S: return 26;
    case QUANT_IQ2_S: return 28;
    case QUANT_IQ2_XXS: return 19;
    case QUANT_IQ2_XS: return 20;
    case QUANT_IQ1_S: return 24;
    case QUANT_IQ1_M: return 31;
    case QUANT_BF16: return 32;
    case QUANT_MXFP4: return 38; /* MXFP4_MOE */
    default: return 0;
    }
}

/* phi3's keys: the original context always, the window as stored, and with
 * LongRoPE the converter's attn_factor sqrt(1 + ln(scale) / ln(original)). */
static ks_status add_phi3_hparams(struct synth *s)
{
    const struct model_synth_spec *sp = s->spec;
    int orig = sp->n_ctx_orig > 0 ? sp->n_ctx_orig : sp->n_ctx_train;
    ks_status st;
    if ((st = gguf_writer_set_u32(s->w, "phi3.rope.scaling.original_context_length", (uint32_t)orig)) ||
        (st = gguf_writer_set_u32(s->w, "phi3.attention.sliding_window", (uint32_t)sp->sliding_window)))
        return st;
    if (sp->n_ctx_orig <= 0)
        return KS_OK;
    double scale = (double)sp->n_ctx_train / sp->n_ctx_orig;
    double attn_factor = scale > 1.0 ? sqrt(1.0 + log(scale) / log((double)sp->n_ctx_orig)) : 1.0;
    return gguf_writer_set_f32(s->w, "phi3.rope.scaling.attn_factor", (float)attn_factor);
}

/* The keys llama.cpp's converter writes for Gemma 2 / 3 beyond the common ones. */
static ks_status add_gemma_hparams(struct synth *s)
{
    const struct model_synth_spec *sp = s->spec;
    char k[128];
    ks_status st = KS_OK;
#define KEY(x) (snprintf(k, sizeof k, "%s." x, sp->arch), k)
    if (sp->n_swa > 0 && (st = gguf_writer_set_u32(s->w, KEY("attention.sliding_window"), (uint32_t)sp->n_swa)))
        return st;
    if (sp->swa_pattern > 0 &&
        (st = gguf_writer_set_u32(s->w, KEY("attention.sliding_window_pattern"), (uint32_t)sp->swa_pattern)))
        return st;
    if (sp->attn_softcap > 0 && (st = gguf_writer_set_f32(s->w, KEY("attn_logit_softcapping"), sp->attn_softcap)))
        return st;
    if (sp->final_softcap > 0)
        st = gguf_writer_set_f32(s->w, KEY("final_logit_softcapping"), sp->final_softcap);
    return st;
#undef KEY
}

static ks_status add_hparams(struct synth *s, int n_vocab)
{
    const struct model_synth_spec *sp = s->spec;
    bool phi3 = !strcmp(sp->arch, "phi3");
    char k[128];
    ks_status st;
#define KEY(x) (snprintf(k, sizeof k, "%s." x, sp->arch), k)
    if ((st = gguf_writer_set_str(s->w, "general.architecture", sp->arch)) ||
        (st = gguf_writer_set_str(s->w, "general.name", "kvserve synthetic model")) ||
        (st = gguf_writer_set_u32(s->w, "general.file_type", file_type(&s->plan))) ||
        (st = gguf_writer_set_u32(s->w, KEY("vocab_size"), (uint32_t)n_vocab)) ||
        (st = gguf_writer_set_u32(s->w, KEY("context_length"), (uint32_t)sp->n_ctx_train)) ||
        (st = gguf_writer_set_u32(s->w, KEY("embedding_length"), (uint32_t)sp->n_embd)) ||
        (st = gguf_writer_set_u32(s->w, KEY("block_count"), (uint32_t)sp->n_layer)) ||
        (st = gguf_writer_set_u32(s->w, KEY("feed_forward_length"), (uint32_t)sp->n_ff)) ||
        (st = gguf_writer_set_u32(s->w, KEY("attention.head_count"), (uint32_t)sp->n_head)) ||
        (st = gguf_writer_set_u32(s->w, KEY("attention.head_count_kv"), (uint32_t)sp->n_head_kv)) ||
        /* convert_hf_to_gguf's phi3 writes no key/value length (head_dim is n_embd / n_head) */
        (st = phi3 ? KS_OK : gguf_writer_set_u32(s->w, KEY("attention.key_length"), (uint32_t)sp->head_dim)) ||
        (st = phi3 ? KS_OK : gguf_writer_set_u32(s->w, KEY("attention.value_length"), (uint32_t)sp->head_dim)) ||
        (st = gguf_writer_set_u32(s->w, KEY("rope.dimension_count"), (uint32_t)(sp->n_rot > 0 ? sp->n_rot : sp->head_dim))) ||
        (st = gguf_writer_set_f32(s->w, KEY("rope.freq_base"), sp->rope_freq_base > 0 ? sp->rope_freq_base : 10000.0f)))
        return st;
    if ((st = gguf_writer_set_f32(s->w, is_encoder(sp->arch) ? KEY("attention.layer_norm_epsilon")
                                                              : KEY("attention.layer_norm_rms_epsilon"),
                                  sp->rms_eps > 0 ? sp->rms_eps : 1e-5f)))
        return st;
    if (phi3 && (st = add_phi3_hparams(s)))
        return st;
    if (sp->n_expert > 0 &&
        ((st = gguf_writer_set_u32(s->w, KEY("expert_count"), (uint32_t)sp->n_expert)) ||
         (st = gguf_writer_set_u32(s->w, KEY("expert_used_count"), (uint32_t)sp->n_expert_used))))
        return st;
    if (is_gemma(sp->arch) && (st = add_gemma_hparams(s)))
        return st;
    if (!strcmp(sp->arch, "gpt-oss") &&
        ((st = gguf_writer_set_u32(s->w, KEY("attention.sliding_window"), (uint32_t)sp->n_swa)) ||
         (st = gguf_writer_set_str(s->w, KEY("rope.scaling.type"), "yarn")) ||
         (st = gguf_writer_set_f32(s->w, KEY("rope.scaling.factor"), sp->rope_yarn_factor)) ||
         (st = gguf_writer_set_u32(s->w, KEY("rope.scaling.original_context_length"), (uint32_t)sp->rope_yarn_orig_ctx)) ||
         (st = gguf_writer_set_f32(s->w, KEY("rope.scaling.yarn_beta_fast"), 32.0f)) ||
         (st = gguf_writer_set_f32(s->w, KEY("rope.scaling.yarn_beta_slow"), 1.0f))))
        return st;
    if (sp->pooling_type > 0 && (st = gguf_writer_set_u32(s->w, KEY("pooling_type"), (uint32_t)sp->pooling_type)))
        return st;
    if (sp->non_causal && (st = gguf_writer_set_bool(s->w, KEY("attention.causal"), false)))
        return st;
    /* llama.cpp reads expert_feed_forward_length for qwen3moe and gpt-oss; llama's experts are n_ff wide */
    if (sp->n_expert > 0 && (!strcmp(sp->arch, "qwen3moe") || !strcmp(sp->arch, "gpt-oss")) &&
        (st = gguf_writer_set_u32(s->w, KEY("expert_feed_forward_length"),
                                  (uint32_t)(sp->n_ff_exp > 0 ? sp->n_ff_exp : sp->n_ff))))
        return st;
    return KS_OK;
#undef KEY
}

static ks_status check_spec(const struct model_synth_spec *sp, bool *qkv_bias, bool *qk_norm)
{
    if (!sp->arch || (strcmp(sp->arch, "llama") && strcmp(sp->arch, "qwen2") && strcmp(sp->arch, "qwen3") &&
                      strcmp(sp->arch, "qwen3moe") && strcmp(sp->arch, "phi3") && !is_gemma(sp->arch) &&
                      strcmp(sp->arch, "gpt-oss") && !is_encoder(sp->arch)))
        return ks_fail(KS_ERR_INVALID_ARG, "synth: arch must be llama, qwen2, qwen3, qwen3moe, phi3, gemma2, gemma3, "
                                           "gpt-oss, bert or nomic-bert");
    if (is_encoder(sp->arch) && (sp->n_expert != 0 || sp->n_head * sp->head_dim != sp->n_embd || sp->untied))
        return ks_fail(KS_ERR_INVALID_ARG, "synth: %s needs n_head * head_dim == n_embd, no experts and no output "
                                           "matrix", sp->arch);
    /* llama.cpp's phi3 loader: attn_output is (n_embd, n_embd), no experts */
    if (!strcmp(sp->arch, "phi3") && (sp->n_expert != 0 || sp->n_head * sp->head_dim != sp->n_embd))
        return ks_fail(KS_ERR_INVALID_ARG, "synth: phi3 needs n_head * head_dim == n_embd and no experts");
    if (sp->n_rot < 0 || sp->n_rot > sp->head_dim || sp->n_rot % 2 != 0 || sp->n_ctx_orig < 0 ||
        sp->sliding_window < 0)
        return ks_fail(KS_ERR_INVALID_ARG, "synth: n_rot must be even and at most head_dim; n_ctx_orig and "
                                           "sliding_window not negative");
    bool oai = !strcmp(sp->arch, "gpt-oss");
    *qkv_bias = !strcmp(sp->arch, "qwen2") || oai;
    *qk_norm = !strcmp(sp->arch, "qwen3") || !strcmp(sp->arch, "qwen3moe") || !strcmp(sp->arch, "gemma3");
    if (sp->n_swa < 0 || sp->swa_pattern < 0 || !(sp->attn_softcap >= 0) || !(sp->final_softcap >= 0) ||
        ((sp->swa_pattern || sp->attn_softcap || sp->final_softcap) && !is_gemma(sp->arch)) ||
        (sp->n_swa && !is_gemma(sp->arch) && !oai))
        return ks_fail(KS_ERR_INVALID_ARG, "synth: sliding windows are gemma2 / gemma3 / gpt-oss features, "
                                           "soft-capping and a window pattern gemma2 / gemma3 ones (none negative)");
    bool moe_arch = !strcmp(sp->arch, "qwen3moe") || oai;
    if (moe_arch && sp->n_expert <= 0)
        return ks_fail(KS_ERR_INVALID_ARG, "synth: %s needs n_expert > 0", sp->arch);
    if (oai && (sp->n_swa <= 0 || !(sp->rope_yarn_factor >= 1.0f) || sp->rope_yarn_orig_ctx <= 0 || !sp->untied))
        return ks_fail(KS_ERR_INVALID_ARG, "synth: gpt-oss needs a sliding window, a YaRN factor >= 1, an original "
                                           "context and an untied output");
    if (sp->n_expert < 0 || sp->n_expert > 512 || (!moe_arch && sp->n_expert > 0 && strcmp(sp->arch, "llama")) ||
        (sp->n_expert > 0 && (sp->n_expert_used < 1 || sp->n_expert_used > sp->n_expert)) || sp->n_ff_exp < 0)
        return ks_fail(KS_ERR_INVALID_ARG, "synth: experts need llama or qwen3moe, n_expert in 1..512 and "
                                           "n_expert_used in 1..n_expert (got %d of %d)",
                       sp->n_expert_used, sp->n_expert);
    if (sp->n_expert > 0 && !moe_arch && sp->n_ff_exp != 0 && sp->n_ff_exp != sp->n_ff)
        return ks_fail(KS_ERR_INVALID_ARG, "synth: llama's experts are feed_forward_length wide: n_ff_exp %d must be "
                                           "0 or n_ff %d", sp->n_ff_exp, sp->n_ff);
    if (sp->n_embd <= 0 || sp->n_layer <= 0 || sp->n_head <= 0 || sp->n_head_kv <= 0 || sp->head_dim <= 0 ||
        sp->n_ff <= 0 || sp->n_ctx_train <= 0 || sp->n_head % sp->n_head_kv != 0 || sp->head_dim % 2 != 0)
        return ks_fail(KS_ERR_INVALID_ARG, "synth: bad shape (sizes must be positive, heads a multiple of kv heads, "
                                           "head_dim even)");
    return KS_OK;
}

ks_status model_synth(const struct model_synth_spec *spec, const char *type, const char *vocab_path,
                      const char *out_path, threads_pool *pool)
{
    bool qkv_bias = false, qk_norm = false, phi3 = spec->arch && !strcmp(spec->arch, "phi3");
    struct synth s = {.spec = spec, .pool = pool};
    ks_status st = check_spec(spec, &qkv_bias, &qk_norm);
    if (!st)
        st = plan_parse(type, &s.plan);
    if (st)
        return st;
    s.plan.pure = spec->pure;
    s.plan.tied = !spec->untied;
    s.plan.n_layer = spec->n_layer;
    s.plan.n_expert = spec->n_expert;
    if ((st = gguf_writer_create(&s.w)))
        return st;
    int n_vocab = 0;
    const struct fill norm = {1.0f, 0.2f};
    if (is_encoder(spec->arch)) {
        if (!(st = add_vocab(&s, vocab_path, &n_vocab)) && !(st = add_hparams(&s, n_vocab)))
            st = add_encoder(&s, n_vocab);
    } else if (!(st = add_vocab(&s, vocab_path, &n_vocab)) && !(st = add_hparams(&s, n_vocab)) &&
        !(st = add_matrix(&s, "token_embd.weight", ROLE_EMBD, 0, n_vocab, spec->n_embd)) &&
        !(st = add_vector(&s, "output_norm.weight", spec->n_embd, norm)) &&
        !(st = spec->untied ? add_matrix(&s, "output.weight", ROLE_OUTPUT, 0, n_vocab, spec->n_embd) : KS_OK) &&
        !(st = phi3 && spec->n_ctx_orig > 0 ? add_longrope_factors(&s) : KS_OK))
        for (int il = 0; il < spec->n_layer && !st; il++)
            st = phi3 ? add_phi3_layer(&s, il) : add_layer(&s, il, qkv_bias, qk_norm);
    if (!st)
        st = gguf_writer_write(s.w, out_path);
    gguf_writer_free(s.w);
    for (size_t i = 0; i < s.n_bufs; i++)
        free(s.bufs[i]);
    free(s.bufs);
    return st;
}
