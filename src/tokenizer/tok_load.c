/* tokenizer: building a tokenizer from GGUF metadata (tokenizer.*). */
#include <ctype.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf/gguf.h"
#include "sbuf/sbuf.h"
#include "tokenizer/tok_internal.h"

enum { TYPE_NORMAL = 1, TYPE_UNKNOWN = 2, TYPE_CONTROL = 3, TYPE_USER_DEFINED = 4, TYPE_UNUSED = 5, TYPE_BYTE = 6 };

static uint32_t attr_of_type(int32_t type)
{
    switch (type) {
    case TYPE_NORMAL: return TOK_ATTR_NORMAL;
    case TYPE_UNKNOWN: return TOK_ATTR_UNKNOWN;
    case TYPE_CONTROL: return TOK_ATTR_CONTROL;
    case TYPE_USER_DEFINED: return TOK_ATTR_USER_DEFINED;
    case TYPE_UNUSED: return TOK_ATTR_UNUSED;
    case TYPE_BYTE: return TOK_ATTR_BYTE;
    default: return 0;
    }
}

/* ---- text arena --------------------------------------------------------- */

static ks_status arena_add(struct tokenizer *t, size_t *cap, const char *s, size_t n, uint32_t *off)
{
    if (t->text_len + n + 1 > *cap) {
        size_t ncap = (t->text_len + n + 1) * 2;
        char *p = realloc(t->text, ncap);
        if (!p)
            return ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory for token text");
        t->text = p;
        *cap = ncap;
    }
    if (t->text_len + n > UINT32_MAX)
        return ks_fail(KS_ERR_FORMAT, "tokenizer: vocabulary text exceeds 4 GiB");
    memcpy(t->text + t->text_len, s, n);
    *off = (uint32_t)t->text_len;
    t->text_len += n;
    return KS_OK;
}

/* ---- byte-level unicode (GPT-2) ----------------------------------------- */

static bool byte_maps_to_itself(unsigned b)
{
    return (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
}

/* The 68 bytes that do not map to themselves (0x00-0x20, 0x7f-0xa0, 0xad)
 * map, in order, to U+0100.. */
uint32_t tok_byte_to_cp(uint8_t b)
{
    if (byte_maps_to_itself(b))
        return b;
    if (b <= 0x20)
        return 256 + b;
    if (b >= 0x7f && b <= 0xa0)
        return 256 + 33 + (b - 0x7fu);
    return 256 + 67; /* 0xad */
}

int tok_cp_to_byte(uint32_t cp)
{
    if (cp < 256)
        return byte_maps_to_itself(cp) ? (int)cp : -1;
    uint32_t n = cp - 256;
    if (n <= 32)
        return (int)n;
    if (n <= 66)
        return (int)(0x7f + n - 33);
    return n == 67 ? 0xad : -1;
}

long tok_bytelevel_decode(const char *s, size_t n, char *out)
{
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t l = tok_utf8_decode(s + i, n - i, &cp);
        int b = l ? tok_cp_to_byte(cp) : -1;
        if (b < 0)
            return -1;
        out[o++] = (char)b;
        i += l;
    }
    return (long)o;
}

/* ---- pieces (what each token detokenizes to) ---------------------------- */

static size_t spm_piece(const char *s, size_t n, uint32_t attr, char *out)
{
    if (attr & (TOK_ATTR_CONTROL | TOK_ATTR_UNKNOWN | TOK_ATTR_USER_DEFINED)) {
        memcpy(out, s, n);
        return n;
    }
    if (attr & TOK_ATTR_BYTE) {
        int hi = n == 6 ? sbuf_hex_digit(s[3]) : -1, lo = n == 6 ? sbuf_hex_digit(s[4]) : -1;
        if (hi >= 0 && lo >= 0 && !memcmp(s, "<0x", 3) && s[5] == '>') {
            out[0] = (char)(hi << 4 | lo);
            return 1;
        }
        memcpy(out, s, n);
        return n;
    }
    if (!(attr & TOK_ATTR_NORMAL))
        return 0;
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        if (i + 3 <= n && !memcmp(s + i, "\xe2\x96\x81", 3)) {
            out[o++] = ' ';
            i += 2;
        } else {
            out[o++] = s[i];
        }
    }
    return o;
}

static size_t bpe_piece(const char *s, size_t n, uint32_t attr, char *out)
{
    if (attr & (TOK_ATTR_CONTROL | TOK_ATTR_UNKNOWN | TOK_ATTR_USER_DEFINED)) {
        memcpy(out, s, n);
        return n;
    }
    if (!(attr & TOK_ATTR_NORMAL))
        return 0;
    /* Characters outside the byte mapping are kept as their UTF-8. */
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t l = tok_utf8_decode(s + i, n - i, &cp);
        int b = l ? tok_cp_to_byte(cp) : -1;
        if (b >= 0) {
            out[o++] = (char)b;
        } else {
            l = l ? l : 1;
            memcpy(out + o, s + i, l);
            o += l;
        }
        i += l;
    }
    return o;
}

/* ---- metadata helpers --------------------------------------------------- */

static void read_id(const struct gguf_file *f, const char *key, int32_t n_vocab, int32_t *id)
{
    uint32_t v;
    if (gguf_get_u32(f, key, &v) == KS_OK)
        *id = v < (uint32_t)n_vocab ? (int32_t)v : -1;
    else if (gguf_find_key(f, key) >= 0) {
        int32_t s;
        if (gguf_get_i32(f, key, &s) == KS_OK)
            *id = s >= 0 && s < n_vocab ? s : -1;
    }
}

static void read_bool(const struct gguf_file *f, const char *key, bool *b)
{
    bool v;
    if (gguf_get_bool(f, key, &v) == KS_OK)
        *b = v;
}

static ks_status read_tokens(struct tokenizer *t, const struct gguf_file *f, size_t *arena_cap)
{
    enum gguf_value_type et;
    uint64_t count;
    const void *data;
    ks_status st = gguf_get_arr(f, "tokenizer.ggml.tokens", &et, &count, &data);
    if (st)
        return ks_fail(st, "tokenizer: tokenizer.ggml.tokens: %s", ks_errmsg());
    if (et != GGUF_TYPE_STRING || count == 0 || count > INT32_MAX)
        return ks_fail(KS_ERR_FORMAT, "tokenizer: tokenizer.ggml.tokens must be a non-empty string array");
    t->n_vocab = (int32_t)count;
    t->tokens = calloc(count, sizeof *t->tokens);
    t->is_eog = calloc(count, sizeof *t->is_eog);
    if (!t->tokens || !t->is_eog)
        return ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory for %" PRIu64 " tokens", count);

    const void *scores = NULL, *types = NULL;
    uint64_t n_scores = 0, n_types = 0;
    enum gguf_value_type st_scores = GGUF_TYPE_COUNT, st_types = GGUF_TYPE_COUNT;
    if (gguf_find_key(f, "tokenizer.ggml.scores") >= 0 &&
        gguf_get_arr(f, "tokenizer.ggml.scores", &st_scores, &n_scores, &scores) == KS_OK &&
        (st_scores != GGUF_TYPE_FLOAT32 || n_scores != count))
        return ks_fail(KS_ERR_FORMAT, "tokenizer: tokenizer.ggml.scores must be %" PRIu64 " f32 values", count);
    if (gguf_find_key(f, "tokenizer.ggml.token_type") >= 0 &&
        gguf_get_arr(f, "tokenizer.ggml.token_type", &st_types, &n_types, &types) == KS_OK &&
        (st_types != GGUF_TYPE_INT32 || n_types != count))
        return ks_fail(KS_ERR_FORMAT, "tokenizer: tokenizer.ggml.token_type must be %" PRIu64 " i32 values", count);

    for (int32_t i = 0; i < t->n_vocab; i++) {
        struct gguf_str s;
        if ((st = gguf_get_arr_str(f, "tokenizer.ggml.tokens", (uint64_t)i, &s)))
            return st;
        struct tok_token *tk = &t->tokens[i];
        if ((st = arena_add(t, arena_cap, s.data, s.len, &tk->text_off)))
            return st;
        tk->text_len = (uint32_t)s.len;
        if (s.len > t->max_token_len)
            t->max_token_len = s.len;
        if (scores)
            memcpy(&tk->score, (const char *)scores + 4 * (size_t)i, 4);
        int32_t type = TYPE_NORMAL;
        if (types)
            memcpy(&type, (const char *)types + 4 * (size_t)i, 4);
        tk->attr = attr_of_type(type);
    }
    return KS_OK;
}

static ks_status make_pieces(struct tokenizer *t, size_t *arena_cap)
{
    char *buf = NULL;
    size_t buf_cap = 0;
    ks_status st = KS_OK;
    for (int32_t i = 0; i < t->n_vocab && !st; i++) {
        struct tok_token *tk = &t->tokens[i];
        if (tk->text_len >= buf_cap) {
            buf_cap = tk->text_len * 2 + 16;
            char *p = realloc(buf, buf_cap);
            if (!p) {
                st = ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory");
                break;
            }
            buf = p;
        }
        /* into buf first: appending to the arena may move it */
        const char *s = tok_text_of(t, i);
        size_t n = t->family != TOK_FAMILY_BPE ? spm_piece(s, tk->text_len, tk->attr, buf)
                                              : bpe_piece(s, tk->text_len, tk->attr, buf);
        tk->piece_len = (uint32_t)n;
        st = arena_add(t, arena_cap, buf, n, &tk->piece_off);
    }
    free(buf);
    return st;
}

/* ---- lookup ------------------------------------------------------------- */

int32_t tok_lookup(const struct tokenizer *t, const char *s, size_t n)
{
    int64_t e = tok_strmap_find(&t->lookup, s, n);
    return e < 0 ? -1 : t->lookup.val[e];
}

static ks_status build_lookup(struct tokenizer *t)
{
    ks_status st = tok_strmap_init(&t->lookup, (uint32_t)t->n_vocab);
    if (st)
        return st;
    char *buf = NULL;
    size_t cap = 0;
    for (int32_t i = 0; i < t->n_vocab && !st; i++) {
        const struct tok_token *tk = &t->tokens[i];
        const char *s = tok_text_of(t, i);
        if (t->family != TOK_FAMILY_BPE) {
            st = tok_strmap_put(&t->lookup, s, tk->text_len, i, NULL);
            continue;
        }
        if (tk->text_len > cap) {
            cap = tk->text_len * 2;
            free(buf);
            if (!(buf = malloc(cap)))
                return ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory");
        }
        long n = tok_bytelevel_decode(s, tk->text_len, buf);
        if (n > 0)
            st = tok_strmap_put(&t->lookup, buf, (size_t)n, i, NULL);
    }
    free(buf);
    return st;
}

/* True when no token has U+2581 after anything but another U+2581. */
static bool marks_only_lead(const struct tokenizer *t)
{
    static const char mark[] = "\xe2\x96\x81";
    for (int32_t i = 0; i < t->n_vocab; i++) {
        const char *s = tok_text_of(t, i);
        size_t n = t->tokens[i].text_len;
        for (size_t j = 1; j + 3 <= n; j++)
            if (!memcmp(s + j, mark, 3) && (j < 3 || memcmp(s + j - 3, mark, 3)))
                return false;
    }
    return true;
}

static void find_byte_tokens(struct tokenizer *t)
{
    static const char hex[] = "0123456789ABCDEF";
    for (int b = 0; b < 256; b++) {
        char raw = (char)b;
        int32_t id = -1;
        if (t->family == TOK_FAMILY_SPM) {
            char name[6] = {'<', '0', 'x', hex[b >> 4], hex[b & 15], '>'};
            id = tok_lookup(t, name, 6);
        }
        if (id < 0)
            id = tok_lookup(t, &raw, 1);
        t->byte_token[b] = id;
    }
}

/* ---- special tokens ----------------------------------------------------- */

static bool text_is(const struct tokenizer *t, int32_t id, const char *s)
{
    size_t n = strlen(s);
    return t->tokens[id].text_len == n && !memcmp(tok_text_of(t, id), s, n);
}

static bool text_in(const struct tokenizer *t, int32_t id, const char *const *list)
{
    for (; *list; list++)
        if (text_is(t, id, *list))
            return true;
    return false;
}

/* The harmony vocabulary (gpt-oss) ends a generation with <|return|> or
 * <|call|>; its <|end|> ends one message of several (the analysis before the
 * answer), so it is not an end of generation there, as in llama.cpp. */
static void unmark_harmony_end(struct tokenizer *t)
{
    int32_t ret = -1, call = -1, end = -1;
    for (int32_t i = 0; i < t->n_vocab; i++) {
        if (!t->is_eog[i])
            continue;
        if (text_is(t, i, "<|return|>"))
            ret = i;
        else if (text_is(t, i, "<|call|>"))
            call = i;
        else if (text_is(t, i, "<|end|>"))
            end = i;
    }
    if (ret >= 0 && call >= 0 && end >= 0)
        t->is_eog[end] = false;
}

/* The fill-in-the-middle tokens the metadata does not name, by the texts
 * llama.cpp's vocabulary loader knows (Qwen, StarCoder/Granite, DeepSeek,
 * CodeLlama, GLM-4.5, Falcon-H1 coder, ...); each found is a control token. */
static void detect_fim(struct tokenizer *t)
{
    static const char *const pre[] = {"<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>",
                                      "<\xef\xbd\x9c" "fim\xe2\x96\x81" "begin\xef\xbd\x9c>", "<PRE>",
                                      "\xe2\x96\x81<PRE>", "<|code_prefix|>", "<|prefix|>", NULL};
    static const char *const suf[] = {"<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>",
                                      "<\xef\xbd\x9c" "fim\xe2\x96\x81" "hole\xef\xbd\x9c>", "<SUF>",
                                      "\xe2\x96\x81<SUF>", "<|code_suffix|>", "<|suffix|>", NULL};
    static const char *const mid[] = {"<|fim_middle|>", "<fim-middle>", "<fim_middle>",
                                      "<\xef\xbd\x9c" "fim\xe2\x96\x81" "end\xef\xbd\x9c>", "<MID>",
                                      "\xe2\x96\x81<MID>", "<|code_middle|>", "<|middle|>", NULL};
    static const char *const pad[] = {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]", NULL};
    static const char *const rep[] = {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", NULL};
    static const char *const sep[] = {"<|file_sep|>", NULL};
    const char *const *lists[6] = {pre, suf, mid, pad, rep, sep};
    struct tok_special *sp = &t->sp;
    int32_t *ids[6] = {&sp->fim_pre, &sp->fim_suf, &sp->fim_mid, &sp->fim_pad, &sp->fim_rep, &sp->fim_sep};
    for (int k = 0; k < 6; k++) {
        for (int32_t i = 0; *ids[k] < 0 && i < t->n_vocab; i++)
            if (text_in(t, i, lists[k])) {
                *ids[k] = i;
                t->tokens[i].attr = TOK_ATTR_CONTROL;
            }
    }
    int32_t ends[3] = {sp->fim_pad, sp->fim_rep, sp->fim_sep};
    for (int k = 0; k < 3; k++)
        if (ends[k] >= 0)
            t->is_eog[ends[k]] = true;
}

/* llama.cpp finds EOT/EOM and the end-of-generation set by these texts. */
static void detect_eog(struct tokenizer *t)
{
    static const char *const eot_texts[] = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
                                            "<|endoftext|>", "<EOT>", "_<EOT>",
                                            "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>",
                                            "<end_of_utterance>", NULL};
    static const char *const eom_texts[] = {"<|eom_id|>", NULL};
    static const char *const eog_texts[] = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
                                            "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>",
                                            "<|end_of_text|>", "<end_of_utterance>",
                                            "<|return|>", "<|call|>", NULL}; /* the last two: o200k_harmony */
    struct tok_special *sp = &t->sp;
    for (int32_t i = 0; i < t->n_vocab; i++) {
        if (sp->eot < 0 && text_in(t, i, eot_texts)) {
            sp->eot = i;
            t->tokens[i].attr = TOK_ATTR_CONTROL;
        }
        if (sp->eom < 0 && text_in(t, i, eom_texts)) {
            sp->eom = i;
            t->tokens[i].attr = TOK_ATTR_CONTROL;
        }
    }
    for (int32_t i = 0; i < t->n_vocab; i++) {
        if (text_in(t, i, eog_texts)) {
            t->is_eog[i] = true;
            t->tokens[i].attr = TOK_ATTR_CONTROL;
        }
    }
    if (sp->eos >= 0)
        t->is_eog[sp->eos] = true;
    if (sp->eot >= 0)
        t->is_eog[sp->eot] = true;
    if (sp->eom >= 0)
        t->is_eog[sp->eom] = true;
    unmark_harmony_end(t);
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Longest text first, then lowest id (llama.cpp's sort is unstable; ties
 * only matter for equal-length tokens that overlap in a text). */
static ks_status sort_special(struct tokenizer *t)
{
    uint64_t *keys = malloc((t->n_special ? t->n_special : 1) * sizeof *keys);
    if (!keys)
        return ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory");
    for (size_t k = 0; k < t->n_special; k++)
        keys[k] = (uint64_t)(UINT32_MAX - t->tokens[t->special[k]].text_len) << 32 | (uint32_t)t->special[k];
    qsort(keys, t->n_special, sizeof *keys, cmp_u64);
    for (size_t k = 0; k < t->n_special; k++)
        t->special[k] = (int32_t)(uint32_t)keys[k];
    free(keys);
    return KS_OK;
}

static ks_status index_special(struct tokenizer *t)
{
    ks_status st = tok_strmap_init(&t->special_map, (uint32_t)t->n_special + 1);
    t->special_entry = malloc((t->n_special + 1) * sizeof *t->special_entry);
    t->len_list = malloc((t->n_special + 1) * sizeof *t->len_list);
    if (!st && (!t->special_entry || !t->len_list))
        st = ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory");
    for (size_t k = 0; k < t->n_special && !st; k++) {
        int32_t id = t->special[k];
        const char *s = tok_text_of(t, id);
        size_t n = t->tokens[id].text_len;
        int64_t e = tok_strmap_find(&t->special_map, s, n);
        if (e < 0)
            st = tok_strmap_put(&t->special_map, s, n, (int32_t)k, (uint32_t *)&e);
        t->special_entry[k] = (uint32_t)e;
        uint8_t b0 = (uint8_t)s[0];
        if (n == 1)
            t->first_alone[b0] = true;
        else
            t->second_byte[b0][(uint8_t)s[1] >> 6] |= 1ull << ((uint8_t)s[1] & 63);
    }
    /* distinct lengths per first byte, longest first (the order of special[]) */
    size_t o = 0;
    for (int b = 0; b < 256 && !st; b++) {
        t->len_off[b] = (uint32_t)o;
        for (size_t k = 0; k < t->n_special; k++) {
            int32_t id = t->special[k];
            uint32_t n = t->tokens[id].text_len;
            if ((uint8_t)tok_text_of(t, id)[0] != b || (o > t->len_off[b] && t->len_list[o - 1] == n))
                continue;
            t->len_list[o++] = n;
        }
    }
    t->len_off[256] = (uint32_t)o;
    return st;
}

static ks_status collect_special(struct tokenizer *t)
{
    const uint32_t mask = TOK_ATTR_CONTROL | TOK_ATTR_USER_DEFINED | TOK_ATTR_UNKNOWN;
    size_t n = 0;
    for (int32_t i = 0; i < t->n_vocab; i++)
        n += (t->tokens[i].attr & mask) && t->tokens[i].text_len > 0;
    t->special = malloc((n ? n : 1) * sizeof *t->special);
    if (!t->special)
        return ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory");
    for (int32_t i = 0; i < t->n_vocab; i++)
        if ((t->tokens[i].attr & mask) && t->tokens[i].text_len > 0)
            t->special[t->n_special++] = i;
    ks_status st = sort_special(t);
    return st ? st : index_special(t);
}

/* Phi-3 GGUFs strip whitespace after their special tokens (llama.cpp keys
 * this off general.name). */
static void apply_name_quirks(struct tokenizer *t, const struct gguf_file *f)
{
    struct gguf_str name;
    if (gguf_get_str(f, "general.name", &name))
        return;
    char low[128];
    size_t n = name.len < sizeof low - 1 ? name.len : sizeof low - 1;
    for (size_t i = 0; i < n; i++)
        low[i] = (char)tolower((unsigned char)name.data[i]);
    low[n] = 0;
    if (!strstr(low, "phi-3") && !strstr(low, "phi3"))
        return;
    for (size_t i = 0; i < t->n_special; i++)
        t->tokens[t->special[i]].attr |= TOK_ATTR_RSTRIP;
    for (int32_t i = 0; i < t->n_vocab; i++) {
        if (text_is(t, i, "</s>"))
            t->tokens[i].attr |= TOK_ATTR_RSTRIP;
        if (text_is(t, i, "<unk>") || text_is(t, i, "<s>") || text_is(t, i, "<|endoftext|>"))
            t->tokens[i].attr &= ~(uint32_t)TOK_ATTR_RSTRIP;
    }
}

/* ---- entry points ------------------------------------------------------- */

static ks_status read_family(struct tokenizer *t, const struct gguf_file *f)
{
    struct gguf_str model;
    ks_status st = gguf_get_str(f, "tokenizer.ggml.model", &model);
    if (st)
        return ks_fail(st, "tokenizer: tokenizer.ggml.model: %s", ks_errmsg());
    if (model.len == 5 && !memcmp(model.data, "llama", 5))
        t->family = TOK_FAMILY_SPM;
    else if (model.len == 4 && !memcmp(model.data, "gpt2", 4))
        t->family = TOK_FAMILY_BPE;
    else if (model.len == 4 && !memcmp(model.data, "bert", 4))
        t->family = TOK_FAMILY_WPM;
    else
        return ks_fail(KS_ERR_UNSUPPORTED,
                       "tokenizer: tokenizer.ggml.model '%.*s' is not supported (supported: llama, gpt2, bert)",
                       (int)(model.len > 64 ? 64 : model.len), model.data);
    return KS_OK;
}

static void read_specials(struct tokenizer *t, const struct gguf_file *f)
{
    struct tok_special *sp = &t->sp;
    int32_t nv = t->n_vocab;
    bool spm = t->family == TOK_FAMILY_SPM;
    *sp = (struct tok_special){.bos = -1, .eos = -1, .eot = -1, .eom = -1, .pad = -1, .unk = -1, .nl = -1,
                               .fim_pre = -1, .fim_suf = -1, .fim_mid = -1, .fim_pad = -1, .fim_rep = -1,
                               .fim_sep = -1};
    if (spm) {
        sp->bos = nv > 1 ? 1 : -1;
        sp->eos = nv > 2 ? 2 : -1;
        sp->unk = 0;
        sp->add_bos = true;
        sp->add_space_prefix = true;
    } else if (t->family == TOK_FAMILY_WPM) {
        sp->bos = nv > 101 ? 101 : -1; /* [CLS] */
        sp->eos = nv > 102 ? 102 : -1; /* [SEP] */
        sp->unk = nv > 100 ? 100 : -1;
        sp->pad = 0;
        sp->add_bos = sp->add_eos = sp->add_space_prefix = true;
        read_id(f, "tokenizer.ggml.cls_token_id", nv, &sp->bos);
        read_id(f, "tokenizer.ggml.seperator_token_id", nv, &sp->eos);
    } else {
        sp->bos = sp->eos = nv > 11 ? 11 : -1;
    }
    read_id(f, "tokenizer.ggml.bos_token_id", nv, &sp->bos);
    read_id(f, "tokenizer.ggml.eos_token_id", nv, &sp->eos);
    read_id(f, "tokenizer.ggml.unknown_token_id", nv, &sp->unk);
    read_id(f, "tokenizer.ggml.padding_token_id", nv, &sp->pad);
    read_id(f, "tokenizer.ggml.eot_token_id", nv, &sp->eot);
    read_id(f, "tokenizer.ggml.eom_token_id", nv, &sp->eom);
    /* the deprecated names first, so the current ones win */
    read_id(f, "tokenizer.ggml.prefix_token_id", nv, &sp->fim_pre);
    read_id(f, "tokenizer.ggml.suffix_token_id", nv, &sp->fim_suf);
    read_id(f, "tokenizer.ggml.middle_token_id", nv, &sp->fim_mid);
    read_id(f, "tokenizer.ggml.fim_pre_token_id", nv, &sp->fim_pre);
    read_id(f, "tokenizer.ggml.fim_suf_token_id", nv, &sp->fim_suf);
    read_id(f, "tokenizer.ggml.fim_mid_token_id", nv, &sp->fim_mid);
    read_id(f, "tokenizer.ggml.fim_pad_token_id", nv, &sp->fim_pad);
    read_id(f, "tokenizer.ggml.fim_rep_token_id", nv, &sp->fim_rep);
    read_id(f, "tokenizer.ggml.fim_sep_token_id", nv, &sp->fim_sep);
}

static ks_status read_chat_template(struct tokenizer *t, const struct gguf_file *f)
{
    struct gguf_str s;
    if (gguf_get_str(f, "tokenizer.chat_template", &s))
        return KS_OK;
    t->chat_template = malloc(s.len + 1);
    if (!t->chat_template)
        return ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory for the chat template");
    memcpy(t->chat_template, s.data, s.len);
    t->chat_template[s.len] = 0;
    t->chat_template_len = s.len;
    return KS_OK;
}

static ks_status load_all(struct tokenizer *t, const struct gguf_file *f)
{
    size_t arena_cap = 0;
    ks_status st;
    if ((st = read_family(t, f)) || (st = read_tokens(t, f, &arena_cap)))
        return st;
    read_specials(t, f);
    if ((st = build_lookup(t)))
        return st;
    if (t->family == TOK_FAMILY_BPE) {
        struct gguf_str pre = {0, ""};
        bool has_pre = gguf_get_str(f, "tokenizer.ggml.pre", &pre) == KS_OK;
        if (!has_pre)
            fprintf(stderr, "kvserve: tokenizer: no tokenizer.ggml.pre in the model; using 'default'\n");
        if ((st = tok_bpe_setup(t, f, has_pre ? pre.data : "default", has_pre ? pre.len : 7)))
            return st;
    }
    read_bool(f, "tokenizer.ggml.add_bos_token", &t->sp.add_bos);
    read_bool(f, "tokenizer.ggml.add_eos_token", &t->sp.add_eos);
    read_bool(f, "tokenizer.ggml.add_space_prefix", &t->sp.add_space_prefix);
    if (t->sp.add_bos && t->sp.bos < 0)
        t->sp.add_bos = false;
    if (t->sp.add_eos && t->sp.eos < 0)
        t->sp.add_eos = false;
    find_byte_tokens(t);
    t->spm_split_words = t->family == TOK_FAMILY_SPM && marks_only_lead(t);
    t->sp.nl = t->byte_token['\n'];
    detect_fim(t);
    detect_eog(t);
    if ((st = collect_special(t)))
        return st;
    apply_name_quirks(t, f);
    if ((st = make_pieces(t, &arena_cap)))
        return st;
    return read_chat_template(t, f);
}

ks_status tok_load(const struct gguf_file *f, struct tokenizer **out)
{
    if (!f || !out)
        return ks_fail(KS_ERR_INVALID_ARG, "tok_load: NULL argument");
    struct tokenizer *t = calloc(1, sizeof *t);
    if (!t)
        return ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory");
    ks_status st = load_all(t, f);
    if (st) {
        tok_free(t);
        return st;
    }
    *out = t;
    return KS_OK;
}

void tok_free(struct tokenizer *t)
{
    if (!t)
        return;
    tok_bpe_free(t);
    tok_strmap_free(&t->lookup);
    tok_pairmap_free(&t->merges);
    free(t->tokens);
    free(t->text);
    free(t->is_eog);
    free(t->special);
    free(t->special_entry);
    free(t->len_list);
    tok_strmap_free(&t->special_map);
    free(t->chat_template);
    free(t);
}

/* ---- small accessors ---------------------------------------------------- */

enum tok_family tok_family(const struct tokenizer *t) { return t->family; }
const char *tok_pre_name(const struct tokenizer *t) { return t->pre; }
int32_t tok_n_vocab(const struct tokenizer *t) { return t->n_vocab; }
const struct tok_special *tok_special(const struct tokenizer *t) { return &t->sp; }

bool tok_is_eog(const struct tokenizer *t, int32_t id)
{
    return id >= 0 && id < t->n_vocab && t->is_eog[id];
}

bool tok_is_control(const struct tokenizer *t, int32_t id)
{
    return id >= 0 && id < t->n_vocab && (t->tokens[id].attr & TOK_ATTR_CONTROL);
}

int32_t tok_find(const struct tokenizer *t, const char *text, size_t len)
{
    int32_t found = -1;
    for (int32_t i = 0; i < t->n_vocab; i++)
        if (t->tokens[i].text_len == len && !memcmp(tok_text_of(t, i), text, len))
            found = i; /* the last duplicate wins, as in llama.cpp's map */
    return found;
}
