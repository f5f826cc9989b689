/* kvserve info: what is inside a GGUF and how much memory it needs.
 *
 * Sections print in order: file, metadata, tensors, totals by type,
 * architecture features (as the model loader reads them), memory.
 * The memory section works from struct info_kv_shape, read once from the
 * metadata, so further KV tables (e.g. a fit table per budget) can be added
 * as one more print_* function over the same shape. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "gguf/gguf.h"
#include "kv/kv.h"
#include "model/model.h"
#include "quant/quant.h"

struct info_opts {
    const char *model;
    bool tensors;      /* print the per-tensor table */
    size_t kv_mem;     /* --kv-mem: print the context that fits in this budget; 0 = no */
};

/* The attention geometry that sizes the KV cache. */
struct info_kv_shape {
    char arch[64];
    uint32_t n_layer;
    uint32_t n_head_kv;
    uint32_t head_dim_k, head_dim_v;
    uint32_t n_ctx_train; /* 0 if the file does not say */
    uint32_t swa_window;  /* sliding window of the windowed layers, 0 for none */
    uint32_t swa_period;  /* layer l is windowed when l % period < period - 1 (llama.cpp's set_swa_pattern) */
};

static void info_usage(FILE *out)
{
    fprintf(out,
            "usage: kvserve info -m MODEL.gguf [--no-tensors] [--kv-mem SIZE]\n"
            "\n"
            "Print a GGUF file's metadata (arrays abbreviated), its tensor table (name, type,\n"
            "shape, bytes), totals by tensor type, the architecture's features as kvserve runs\n"
            "them (sliding window and layer pattern, RoPE bases, soft-caps), and the memory it\n"
            "needs: weight bytes and KV cache bytes per token at f16, q8_0 and q4_0.\n"
            "\n"
            "  -m, --model PATH   the GGUF file\n"
            "      --no-tensors   skip the per-tensor table\n"
            "      --kv-mem SIZE  also print the context that fits in a KV budget of SIZE (4G,\n"
            "                     512M, 25%%) at f16, q8_0, q4_0 and under the dynamic policy\n"
            "  -h, --help         this help\n");
}

/* 0 ok, 2 usage error, -1 help printed. */
static int parse_args(int argc, char **argv, struct info_opts *o)
{
    *o = (struct info_opts){.tensors = true};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            info_usage(stdout);
            return -1;
        } else if ((!strcmp(a, "-m") || !strcmp(a, "--model")) && i + 1 < argc) {
            o->model = argv[++i];
        } else if (!strcmp(a, "--no-tensors")) {
            o->tensors = false;
        } else if (!strcmp(a, "--kv-mem") && i + 1 < argc) {
            if (!cli_parse_mem(argv[++i], &o->kv_mem)) {
                fprintf(stderr, "kvserve info: --kv-mem '%s' is not a size (e.g. 4G, 512M, 25%%)\n", argv[i]);
                return 2;
            }
        } else {
            fprintf(stderr, "kvserve info: unknown or incomplete option '%s'\n\n", a);
            info_usage(stderr);
            return 2;
        }
    }
    if (!o->model) {
        fprintf(stderr, "kvserve info: -m MODEL is required\n\n");
        info_usage(stderr);
        return 2;
    }
    return 0;
}

static const char *human_bytes(double bytes, char *buf, size_t cap)
{
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    while (bytes >= 1024 && u < 4) {
        bytes /= 1024;
        u++;
    }
    snprintf(buf, cap, u ? "%.2f %s" : "%.0f %s", bytes, units[u]);
    return buf;
}

/* ---- sections ---------------------------------------------------------- */

static void print_file(const struct gguf_file *f, const char *path)
{
    printf("file: %s\n  GGUF v%u, %zu bytes, alignment %" PRIu64 ", tensor data at offset %" PRIu64 "\n\n",
           path, gguf_version(f), gguf_file_size(f), gguf_alignment(f), gguf_data_offset(f));
}

static void print_metadata(const struct gguf_file *f)
{
    char value[512];
    printf("metadata: %" PRId64 " keys\n", gguf_n_kv(f));
    for (int64_t i = 0; i < gguf_n_kv(f); i++) {
        gguf_format_value(f, i, value, sizeof value);
        printf("  %-44s %-4s %s\n", gguf_key_at(f, i), gguf_type_name(gguf_type_at(f, i)), value);
    }
    printf("\n");
}

static void format_shape(const struct gguf_tensor_info *t, char *buf, size_t cap)
{
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (uint32_t d = 0; d < t->n_dims && n < cap; d++)
        n += (size_t)snprintf(buf + n, cap - n, d ? ", %" PRId64 : "%" PRId64, t->ne[d]);
    if (n < cap)
        snprintf(buf + n, cap - n, "]");
}

static void print_tensors(const struct gguf_file *f)
{
    char shape[96];
    printf("tensors: %" PRId64 "\n  %-40s %-6s %-24s %14s\n", gguf_n_tensors(f), "name", "type", "shape", "bytes");
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        const struct gguf_tensor_info *t = gguf_tensor_at(f, i);
        format_shape(t, shape, sizeof shape);
        printf("  %-40s %-6s %-24s %14" PRIu64 "\n", t->name, quant_type_name(t->type), shape, t->nbytes);
    }
    printf("\n");
}

static uint64_t print_type_totals(const struct gguf_file *f)
{
    uint64_t bytes[QUANT_TYPE_COUNT] = {0}, count[QUANT_TYPE_COUNT] = {0}, total = 0;
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        const struct gguf_tensor_info *t = gguf_tensor_at(f, i);
        bytes[t->type] += t->nbytes;
        count[t->type]++;
        total += t->nbytes;
    }
    char h[32];
    printf("totals by type:\n");
    for (int ty = 0; ty < QUANT_TYPE_COUNT; ty++)
        if (count[ty])
            printf("  %-6s %5" PRIu64 " tensors %14" PRIu64 " bytes  %10s  %5.1f%%\n",
                   quant_type_name((enum quant_type)ty), count[ty], bytes[ty],
                   human_bytes((double)bytes[ty], h, sizeof h), 100.0 * (double)bytes[ty] / (double)total);
    if (!total)
        printf("  (no tensors)\n");
    printf("\n");
    return total;
}

/* ---- KV geometry ------------------------------------------------------- */

static ks_status arch_u32(const struct gguf_file *f, const char *arch, const char *suffix, uint32_t *out)
{
    char key[160];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    return gguf_get_u32(f, key, out);
}

/* An absent key takes its default; a present but unusable one (a per-layer
 * array, a negative value) stays an error rather than being replaced. */
static ks_status arch_u32_or(const struct gguf_file *f, const char *arch, const char *suffix, uint32_t dflt,
                             uint32_t *out)
{
    ks_status st = arch_u32(f, arch, suffix, out);
    if (st == KS_ERR_NOT_FOUND) {
        *out = dflt;
        return KS_OK;
    }
    return st;
}

/* Which layers of an architecture use a sliding window: every layer but the
 * last of each period (the period each architecture's loader in llama.cpp
 * gives set_swa_pattern; attention.sliding_window_pattern overrides it). */
static const struct {
    const char *arch;
    uint32_t period;
} SWA_PERIODS[] = {{"gemma2", 2}, {"gemma3", 6}, {"gpt-oss", 2}, {"cohere2", 4}};

/* The model's rule (model_layer_is_swa), on the window and period read here
 * from the file (info also runs on files the loader refuses). */
static bool swa_windowed(const struct info_kv_shape *s, uint32_t layer)
{
    struct model_hparams hp = {.n_swa = (int)s->swa_window, .swa_pattern = (int)s->swa_period};
    return s->swa_window && s->swa_period > 1 && model_layer_is_swa(&hp, (int)layer);
}

static uint32_t swa_layers(const struct info_kv_shape *s)
{
    uint32_t n = 0;
    for (uint32_t l = 0; l < s->n_layer; l++)
        n += swa_windowed(s, l);
    return n;
}

/* A window and a period known for this architecture, or none (a period of 0). */
static void read_swa(const struct gguf_file *f, struct info_kv_shape *s)
{
    for (size_t i = 0; i < sizeof SWA_PERIODS / sizeof SWA_PERIODS[0]; i++)
        if (strcmp(s->arch, SWA_PERIODS[i].arch) == 0)
            s->swa_period = SWA_PERIODS[i].period;
    uint32_t period = 0;
    if (arch_u32(f, s->arch, "attention.sliding_window_pattern", &period) == KS_OK && period > 1)
        s->swa_period = period;
    if (arch_u32_or(f, s->arch, "attention.sliding_window", 0, &s->swa_window) || !s->swa_period)
        s->swa_window = 0;
}

/* As llama.cpp: key_length/value_length when present, else embedding_length / head_count. */
static ks_status read_kv_shape(const struct gguf_file *f, struct info_kv_shape *s)
{
    *s = (struct info_kv_shape){0};
    struct gguf_str arch;
    ks_status st = gguf_get_str(f, "general.architecture", &arch);
    if (st)
        return st;
    if (arch.len == 0 || arch.len >= sizeof s->arch || memchr(arch.data, '\0', (size_t)arch.len))
        return ks_fail(KS_ERR_FORMAT, "general.architecture is empty or too long");
    memcpy(s->arch, arch.data, (size_t)arch.len);
    uint32_t n_head = 0, n_embd = 0, head_dim = 0;
    st = arch_u32(f, s->arch, "block_count", &s->n_layer);
    st = st ? st : arch_u32(f, s->arch, "attention.head_count", &n_head);
    st = st ? st : arch_u32_or(f, s->arch, "attention.head_count_kv", n_head, &s->n_head_kv);
    st = st ? st : arch_u32_or(f, s->arch, "embedding_length", 0, &n_embd);
    if (st)
        return st;
    if (n_head && n_embd % n_head == 0)
        head_dim = n_embd / n_head;
    st = arch_u32_or(f, s->arch, "attention.key_length", head_dim, &s->head_dim_k);
    st = st ? st : arch_u32_or(f, s->arch, "attention.value_length", head_dim, &s->head_dim_v);
    if (st)
        return st;
    if (!s->n_layer || !s->n_head_kv || !s->head_dim_k || !s->head_dim_v)
        return ks_fail(KS_ERR_FORMAT,
                       "%s: needs nonzero block_count and head_count_kv, and attention.key_length/value_length "
                       "or an embedding_length divisible by head_count",
                       s->arch);
    if (arch_u32_or(f, s->arch, "context_length", 0, &s->n_ctx_train))
        s->n_ctx_train = 0;
    read_swa(f, s);
    return KS_OK;
}

/* KV bytes per token for all layers, or 0 if type cannot hold a head. */
static uint64_t kv_bytes_per_token(const struct info_kv_shape *s, enum quant_type type)
{
    size_t k = quant_row_size(type, s->head_dim_k), v = quant_row_size(type, s->head_dim_v);
    if (!k || !v)
        return 0;
    return (uint64_t)s->n_layer * s->n_head_kv * (k + v);
}

/* The KV types info prints: every one but f32 (a test type), highest precision first. */
static enum quant_type info_kv_type(int i) { return kv_type_at(KV_INDEX_F16 + i); }
enum { INFO_KV_TYPES = KV_N_TYPES - KV_INDEX_F16 };

static void print_kv_memory(const struct info_kv_shape *s)
{
    char a[32], b[32], c[32];
    printf("  KV cache (%s: %u layers, %u KV heads, head_dim k %u / v %u):\n", s->arch, s->n_layer, s->n_head_kv,
           s->head_dim_k, s->head_dim_v);
    printf("    %-6s %12s %14s", "type", "per token", "per 1k tokens");
    if (s->n_ctx_train)
        printf(" %16s", "per context");
    printf("\n");
    for (int i = 0; i < INFO_KV_TYPES; i++) {
        enum quant_type t = info_kv_type(i);
        uint64_t per_tok = kv_bytes_per_token(s, t);
        if (!per_tok) {
            uint32_t bad = quant_row_size(t, s->head_dim_k) ? s->head_dim_v : s->head_dim_k;
            printf("    %-6s n/a (head_dim %u not a multiple of %d)\n", quant_type_name(t), bad,
                   quant_traits(t)->block_elems);
            continue;
        }
        printf("    %-6s %12s %14s", quant_type_name(t), human_bytes((double)per_tok, a, sizeof a),
               human_bytes((double)per_tok * 1000, b, sizeof b));
        if (s->n_ctx_train)
            printf(" %16s", human_bytes((double)per_tok * s->n_ctx_train, c, sizeof c));
        printf("\n");
    }
    if (s->n_ctx_train)
        printf("    (per context = %u tokens, the trained context length)\n", s->n_ctx_train);
    uint32_t n_swa = swa_layers(s);
    if (n_swa) {
        uint64_t f16 = kv_bytes_per_token(s, QUANT_F16), global = f16 / s->n_layer * (s->n_layer - n_swa);
        printf("    sliding window of %u tokens on %u of %u layers: their rows are freed past the window, so a\n"
               "    sequence longer than it grows by the %u other layers' rows only (f16: %s per token instead of %s)\n",
               s->swa_window, n_swa, s->n_layer, s->n_layer - n_swa, human_bytes((double)global, a, sizeof a),
               human_bytes((double)f16, b, sizeof b));
    }
    uint64_t means = 2ull * s->n_layer * s->n_head_kv * s->head_dim_k * sizeof(float);
    printf("    smoothing (--kv-smooth, default %s): channel means of %s per sequence, outside the budget\n",
           kv_smooth_name(KV_SMOOTH_OFF), human_bytes((double)means, a, sizeof a));
}

/* Tokens that fit in budget bytes: kv_fit_config over an empty cache with
 * the default page size and policy settings (f16 start, sinks and hot window
 * kept at f16, older pages at the q4_0 floor for the dynamic row). */
static void print_kv_fit(const struct info_kv_shape *s, size_t budget)
{
    char h[32];
    printf("  KV fit in %s (%zu bytes):\n", human_bytes((double)budget, h, sizeof h), budget);
    if (s->head_dim_k != s->head_dim_v) {
        printf("    n/a (key head_dim %u differs from value head_dim %u)\n", s->head_dim_k, s->head_dim_v);
        return;
    }
    struct kv_config cfg;
    kv_config_default(&cfg);
    cfg.n_layer = (int)s->n_layer;
    cfg.n_kv_head = (int)s->n_head_kv;
    cfg.head_dim = (int)s->head_dim_k;
    cfg.mem_budget = budget;
    uint32_t n_swa = s->n_layer <= KV_MAX_LAYERS ? swa_layers(s) : 0;
    if (n_swa) {
        cfg.swa_window = (int32_t)s->swa_window;
        for (uint32_t l = 0; l < s->n_layer; l++)
            cfg.swa_layer[l] = swa_windowed(s, l);
    }
    struct kv_fit fit;
    if (kv_fit_config(&cfg, &fit)) {
        printf("    n/a (%s)\n", ks_errmsg());
        return;
    }
    for (int i = 0; i < INFO_KV_TYPES; i++) {
        enum quant_type t = info_kv_type(i);
        int64_t n = fit.tokens[kv_type_index(t)];
        if (n < 0)
            printf("    %-8s n/a (head_dim %u not a multiple of %d)\n", quant_type_name(t), s->head_dim_k,
                   quant_traits(t)->block_elems);
        else
            printf("    %-8s %12" PRId64 " tokens\n", quant_type_name(t), n);
    }
    printf("    %-8s %12" PRId64 " tokens (one sequence: first %d and last %d tokens at f16, the rest at %s)\n",
           "dynamic", fit.dynamic, cfg.sink_tokens, cfg.hot_tokens,
           fit.tokens[kv_type_index(cfg.floor)] < 0 ? "f16" : quant_type_name(cfg.floor));
    printf("    (pages of %d tokens; whole pages only)\n", cfg.page_tokens);
    if (n_swa)
        printf("    (the %u sliding-window layers hold only the last %u tokens' rows, at most %u pages)\n", n_swa,
               s->swa_window, (s->swa_window + (uint32_t)cfg.page_tokens - 1) / (uint32_t)cfg.page_tokens + 1);
}

/* ---- experts and what a token reads ----------------------------------------- */

struct info_weights {
    uint32_t n_expert, n_expert_used, n_ff_exp; /* n_expert 0: dense */
    uint64_t params, active_params;             /* elements; active: per token */
    uint64_t token_bytes;                       /* weight bytes one decode token reads */
};

static const char *human_count(double n, char *buf, size_t cap)
{
    static const char *const units[] = {"", "K", "M", "B", "T"};
    int u = 0;
    while (n >= 1000 && u < 4) {
        n /= 1000;
        u++;
    }
    snprintf(buf, cap, u ? "%.2f %s" : "%.0f", n, units[u]);
    return buf;
}

/* A token uses n_expert_used of every layer's n_expert experts (tensors named
 * *_exps.*); a decode step reads every matrix but the token embeddings (one
 * row), which are read whole as the output matrix when output.weight is
 * absent (tied). */
static void read_weights(const struct gguf_file *f, const char *arch, struct info_weights *w)
{
    *w = (struct info_weights){0};
    if (arch[0] && (arch_u32(f, arch, "expert_count", &w->n_expert) ||
                    arch_u32(f, arch, "expert_used_count", &w->n_expert_used) ||
                    w->n_expert_used > w->n_expert))
        w->n_expert = w->n_expert_used = 0;
    if (w->n_expert && arch_u32(f, arch, "expert_feed_forward_length", &w->n_ff_exp) &&
        arch_u32(f, arch, "feed_forward_length", &w->n_ff_exp))
        w->n_ff_exp = 0;
    bool tied = !gguf_find_tensor(f, "output.weight");
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        const struct gguf_tensor_info *t = gguf_tensor_at(f, i);
        uint64_t n = (uint64_t)t->ne[0] * (uint64_t)t->ne[1] * (uint64_t)t->ne[2] * (uint64_t)t->ne[3];
        uint64_t bytes = t->nbytes;
        if (w->n_expert && strstr(t->name, "_exps.") && t->n_dims == 3 && t->ne[2] == w->n_expert) {
            n = n / w->n_expert * w->n_expert_used;
            bytes = bytes / w->n_expert * w->n_expert_used;
        }
        w->params += (uint64_t)t->ne[0] * (uint64_t)t->ne[1] * (uint64_t)t->ne[2] * (uint64_t)t->ne[3];
        w->active_params += n;
        if (strcmp(t->name, "token_embd.weight") || tied)
            w->token_bytes += bytes;
    }
}

static void print_weights(const struct gguf_file *f, const char *arch)
{
    struct info_weights w;
    read_weights(f, arch, &w);
    char h[32], c[32];
    if (w.n_expert)
        printf("  experts: %u per layer, %u used per token, expert FFN %u\n", w.n_expert, w.n_expert_used,
               w.n_ff_exp);
    printf("  parameters: %s (%" PRIu64 ")", human_count((double)w.params, c, sizeof c), w.params);
    if (w.n_expert)
        printf(", active per token: %s (%" PRIu64 ")", human_count((double)w.active_params, c, sizeof c),
               w.active_params);
    printf("\n  read per decode token: %s (%" PRIu64 " bytes: every matrix but the token embeddings%s)\n",
           human_bytes((double)w.token_bytes, h, sizeof h), w.token_bytes,
           w.n_expert ? ", experts counted used / count" : "");
}

static void print_memory(const struct gguf_file *f, uint64_t weight_bytes, size_t kv_mem)
{
    char h[32];
    printf("memory:\n  weights: %s (%" PRIu64 " bytes)\n", human_bytes((double)weight_bytes, h, sizeof h),
           weight_bytes);
    struct gguf_str arch;
    char arch_name[64] = "";
    if (gguf_get_str(f, "general.architecture", &arch) == KS_OK && arch.len < sizeof arch_name &&
        !memchr(arch.data, '\0', (size_t)arch.len))
        memcpy(arch_name, arch.data, (size_t)arch.len);
    print_weights(f, arch_name);
    if (!strcmp(arch_name, "bert") || !strcmp(arch_name, "nomic-bert")) {
        printf("  KV cache: none (an encoder attends within each input, computed whole in one step)\n");
        return;
    }
    struct info_kv_shape shape;
    if (read_kv_shape(f, &shape)) {
        printf("  KV cache: n/a (%s)\n", ks_errmsg());
        return;
    }
    print_kv_memory(&shape);
    if (kv_mem)
        print_kv_fit(&shape, kv_mem);
}

/* ---- architecture features ------------------------------------------------ */

/* Layers il of the given kind, as "0, 2, 4" (at most a few, then "..."). */
static void print_layer_list(const struct model_hparams *hp, bool swa)
{
    int shown = 0, total = 0;
    for (int il = 0; il < hp->n_layer; il++) {
        if (model_layer_is_swa(hp, il) != swa)
            continue;
        if (shown < 6)
            printf("%s%d", shown ? ", " : "", il), shown++;
        total++;
    }
    if (total > shown)
        printf(", ... (%d layers)", total);
}

static void print_rope(const struct model_hparams *hp)
{
    static const char *const scaling[] = {"none", "linear", "llama3", "LongRoPE", "YaRN"};
    printf("  rope: %s, base %g, %d of %d dims, scaling %s", hp->rope_type == MODEL_ROPE_NEOX ? "neox" : "normal",
           (double)hp->rope_freq_base, hp->n_rot, hp->head_dim_k, scaling[hp->rope_scaling]);
    if (hp->rope_scaling == MODEL_ROPE_SCALING_YARN)
        printf(" (factor %g over an original context of %d, beta %g / %g, magnitude %.4f)",
               (double)hp->rope_scale_factor, hp->rope_yarn_orig_ctx, (double)hp->rope_yarn_beta_fast,
               (double)hp->rope_yarn_beta_slow, (double)hp->rope_yarn_mscale);
    else if (hp->rope_scaling == MODEL_ROPE_SCALING_LONGROPE)
        printf(" (rope_factors_short/long, %d factors each: the long ones when the context per sequence exceeds "
               "%d tokens)", hp->n_rot / 2, hp->rope_n_ctx_orig);
    else if (hp->rope_scaling != MODEL_ROPE_SCALING_NONE)
        printf(" (factor %g)", (double)hp->rope_scale_factor);
    if (hp->rope_attn_factor != 1.0f)
        printf("; cos and sin scaled by attn_factor %g", (double)hp->rope_attn_factor);
    printf("\n");
}

/* gemma2 / gemma3: the block's extra steps and the soft-caps. */
static void print_gemma(const struct model_hparams *hp)
{
    if (hp->embd_scale > 0)
        printf("  embeddings x %g, post-attention and post-FFN norms, %s FFN, queries x %g (attention scale 1)\n",
               (double)hp->embd_scale, hp->ffn_act == MODEL_FFN_GEGLU ? "GeGLU (gelu-tanh)" : "SwiGLU",
               (double)hp->attn_q_scale);
    if (hp->attn_softcap > 0)
        printf("  attention logit soft-cap %g\n", (double)hp->attn_softcap);
    if (hp->final_softcap > 0)
        printf("  final logit soft-cap %g\n", (double)hp->final_softcap);
}

/* phi3: fused projections, and the sliding window its file stores but
 * llama.cpp (so kvserve) does not apply. */
static void print_phi3(const struct gguf_file *f, const struct model_hparams *hp)
{
    if (hp->arch != MODEL_ARCH_PHI3)
        return;
    bool qkv = gguf_find_tensor(f, "blk.0.attn_qkv.weight"), up = gguf_find_tensor(f, "blk.0.ffn_up.weight");
    if (qkv || up)
        printf("  fused projections: %s%s%s\n", qkv ? "attn_qkv (Q, K, V rows)" : "", qkv && up ? ", " : "",
               up ? "ffn_up (gate rows, then up rows)" : "");
    if (hp->n_swa_stored > 0)
        printf("  sliding window: %d tokens in the file, not applied (llama.cpp turns phi3's window off; "
               "every layer attends to the whole context)\n", hp->n_swa_stored);
}

/* bert / nomic-bert: what an encoder runs instead of a decoder's blocks. */
static void print_encoder(const struct model_hparams *hp)
{
    printf("  encoder: embeddings only (no output head; completions refused), %s attention within each input\n",
           hp->non_causal ? "bidirectional" : "causal (attention.causal is true)");
    printf("  LayerNorm (eps %g) of the embeddings and after each block's residual (post-norm); %s FFN%s\n",
           (double)hp->norm_eps, hp->arch == MODEL_ARCH_BERT ? "GELU" : "SwiGLU",
           hp->has_qkv_bias ? "; Q/K/V biases" : "");
    if (hp->arch == MODEL_ARCH_BERT)
        printf("  positions: learned, %d (position_embd)\n", hp->n_ctx_train);
    else
        print_rope(hp);
    printf("  pooling: %s\n", model_pooling_name(hp->pooling));
}

/* What the model loader makes of the file (a mapped load, not repacked, so
 * exactly what `serve` would run): the attention kinds per layer (sliding
 * windows, their pattern and RoPE base), sinks, biases, RoPE, gemma's and
 * phi3's extra steps and the MoE gating. Files kvserve cannot load say why. */
static void print_features(const char *path, const struct gguf_file *f)
{
    struct model *m;
    printf("architecture features:\n");
    if (model_load_flags(path, MODEL_LOAD_MMAP | MODEL_LOAD_NO_REPACK, &m)) {
        printf("  n/a (%s)\n", ks_errmsg());
        return;
    }
    const struct model_hparams *hp = model_hparams(m);
    printf("  %s, %d layers\n", hp->arch_name, hp->n_layer);
    if (hp->encoder_only) {
        printf("  attention: %d heads, %d KV heads of %d\n", hp->n_head, hp->n_head_kv, hp->head_dim_k);
        print_encoder(hp);
        model_free(m);
        return;
    }
    printf("  attention: %d heads, %d KV heads of %d", hp->n_head, hp->n_head_kv, hp->head_dim_k);
    if (hp->n_swa > 0) {
        printf("; sliding window %d (pattern %d) on layers ", hp->n_swa, hp->swa_pattern);
        print_layer_list(hp, true);
        printf("; full on layers ");
        print_layer_list(hp, false);
    }
    printf("%s%s%s\n", hp->oai.attn_sinks ? "; sinks (a learned logit per head)" : "",
           hp->has_qk_norm ? "; Q/K norm" : "", hp->oai.post_attn_norm ? "; FFN norm post_attention_norm" : "");
    if (hp->n_swa > 0 && hp->rope_freq_base_swa != hp->rope_freq_base)
        printf("  window layers' RoPE: base %g, unscaled\n", (double)hp->rope_freq_base_swa);
    if (hp->has_qkv_bias || hp->oai.attn_out_bias || hp->oai.expert_bias)
        printf("  biases: %s%s%s\n", hp->has_qkv_bias ? "Q/K/V" : "", hp->oai.attn_out_bias ? ", attention output" : "",
               hp->oai.expert_bias ? ", router and every expert matrix" : "");
    print_rope(hp);
    print_gemma(hp);
    print_phi3(f, hp);
    if (hp->n_expert > 0)
        printf("  experts: %d of %d per token, %s, %s\n", hp->n_expert_used, hp->n_expert,
               hp->oai.softmax_after_topk ? "weights softmax over the top-k router logits"
                                          : "weights from softmax over all experts, top-k renormalized",
               hp->oai.swiglu_oai ? "clamped SwiGLU (alpha 1.702, limit 7)" : "SwiGLU");
    model_free(m);
}

int cli_info(int argc, char **argv)
{
    struct info_opts o;
    int rc = parse_args(argc, argv, &o);
    if (rc)
        return rc < 0 ? 0 : rc;
    struct gguf_file *f;
    if (gguf_open(o.model, &f)) {
        fprintf(stderr, "kvserve info: %s\n", ks_errmsg());
        return 1;
    }
    print_file(f, o.model);
    print_metadata(f);
    if (o.tensors)
        print_tensors(f);
    uint64_t weight_bytes = print_type_totals(f);
    print_features(o.model, f);
    print_memory(f, weight_bytes, o.kv_mem);
    gguf_close(f);
    return 0;
}
