/* tokenizer: byte-level BPE ("gpt2" vocabularies).
 *
 * The text is split into words by the pre-tokenizer regexes of
 * tokenizer.ggml.pre (applied in sequence, each to the pieces of the last;
 * the text between matches is kept as words too). Each word starts as one
 * symbol per byte and the adjacent pair with the lowest merge rank is merged
 * until no pair has a rank (ties: leftmost).
 *
 * Everything works on raw bytes: vocabulary strings and merges are decoded
 * from the byte-level alphabet (Ġ = ' ', ...) once, at load time. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf/gguf.h"
#include "tokenizer/tok_internal.h"

/* ---- pre-tokenizers (the regexes llama.cpp uses for each pre type) ------ */

#define RE_GPT2 "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
#define RE_LLAMA3_HEAD "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
#define RE_LLAMA3_TAIL "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define RE_LLAMA3 RE_LLAMA3_HEAD "\\p{N}{1,3}" RE_LLAMA3_TAIL
#define RE_QWEN2 RE_LLAMA3_HEAD "\\p{N}" RE_LLAMA3_TAIL
#define RE_CJK "[\\x{4E00}-\\x{9FA5}\\x{0800}-\\x{4E00}\\x{AC00}-\\x{D7FF}]+"
#define RE_PORO " ?[^(\\s|.,!?\\x{2026}\\x{3002}\\x{FF0C}\\x{3001}\\x{0964}\\x{06D4}\\x{060C})]+"

struct pre_type {
    const char *names; /* '|'-separated tokenizer.ggml.pre values */
    const char *regex[TOK_MAX_REGEX];
    bool ignore_merges;
    bool add_bos;
};

static const struct pre_type pre_types[] = {
    {"default",
     {"[\\p{P}\\$\\+<=>\\^~\\|]+", RE_GPT2, "\\p{N}+", "[0-9][0-9][0-9]"}, false, false},
    {"llama3|llama-v3|llama-bpe|falcon3|falcon-h1|pixtral|midm-2.0|lfm2", {RE_LLAMA3}, true, true},
    {"dbrx|smaug-bpe|chatglm-bpe", {RE_LLAMA3}, false, false},
    {"deepseek-llm",
     {"[\r\n]", "\\s?[\\p{Lu}\\p{Ll}\\p{Lt}]+",
      "\\s?[!-/:-~\\x{FF01}-\\x{FF0F}\\x{FF1A}-\\x{FF5E}\\x{2018}-\\x{201F}\\x{3000}-\\x{3002}]+", "\\s+$",
      RE_CJK, "\\p{N}+"},
     false, false},
    {"deepseek-coder", {"[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", RE_CJK, "\\p{N}"}, false, false},
    {"falcon", {"[\\p{P}\\$\\+<=>\\^~\\|`]+", RE_GPT2, "[0-9][0-9][0-9]"}, false, false},
    {"starcoder|refact|command-r|smollm|codeshell|exaone|minerva-7b", {"\\p{N}", RE_GPT2}, false, false},
    /* gpt-neox: its tokenizer.json uses GPT-2's ByteLevel split, like mpt */
    {"gpt-2|gpt-neox|mpt|olmo|jais|phi-2|roberta-bpe|jina-es|jina-de|gigachat|jina-v1-en|jina-v2-es|jina-v2-de|"
     "jina-v2-code|trillion",
     {RE_GPT2}, false, false},
    {"qwen2|deepseek-r1-qwen|stablelm2|megrez|hunyuan", {RE_QWEN2}, false, false},
    {"poro-chat|bloom|gpt3-finnish", {RE_PORO}, false, false},
    {"viking", {RE_PORO, "\\p{N}"}, false, false},
};

static bool name_in_list(const char *list, const char *name, size_t len)
{
    for (const char *p = list; *p;) {
        const char *bar = strchr(p, '|');
        size_t n = bar ? (size_t)(bar - p) : strlen(p);
        if (n == len && !memcmp(p, name, len))
            return true;
        if (!bar)
            break;
        p = bar + 1;
    }
    return false;
}

static ks_status compile_regexes(struct tokenizer *t, const struct pre_type *pt)
{
    for (int i = 0; i < TOK_MAX_REGEX && pt->regex[i]; i++) {
        int err;
        PCRE2_SIZE erroff;
        pcre2_code *re = pcre2_compile((PCRE2_SPTR)pt->regex[i], PCRE2_ZERO_TERMINATED,
                                       PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF | PCRE2_DOLLAR_ENDONLY,
                                       &err, &erroff, NULL);
        if (!re) {
            PCRE2_UCHAR msg[128];
            pcre2_get_error_message(err, msg, sizeof msg);
            return ks_fail(KS_ERR_INTERNAL, "tokenizer: pre-tokenizer regex %d of '%s' does not compile at %zu: %s",
                           i, t->pre, (size_t)erroff, (const char *)msg);
        }
        (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* the interpreter is the fallback */
        t->regex[t->n_regex++] = re;
    }
    return KS_OK;
}

static ks_status choose_pre(struct tokenizer *t, const char *pre, size_t len)
{
    const struct pre_type *pt = NULL;
    for (size_t i = 0; i < sizeof pre_types / sizeof pre_types[0] && !pt; i++)
        if (name_in_list(pre_types[i].names, pre, len))
            pt = &pre_types[i];
    if (!pt) {
        fprintf(stderr, "kvserve: tokenizer: unknown tokenizer.ggml.pre '%.*s'; using 'default'\n",
                (int)(len > 64 ? 64 : len), pre);
        pt = &pre_types[0];
        pre = "default";
        len = 7;
    }
    size_t n = len < sizeof t->pre - 1 ? len : sizeof t->pre - 1;
    memcpy(t->pre, pre, n);
    t->pre[n] = 0;
    t->ignore_merges = pt->ignore_merges;
    if (pt->add_bos)
        t->sp.add_bos = true;
    return compile_regexes(t, pt);
}

/* ---- merges ------------------------------------------------------------- */

static ks_status intern(struct tokenizer *t, const char *s, size_t n, uint32_t *entry)
{
    int64_t e = tok_strmap_find(&t->lookup, s, n);
    if (e >= 0) {
        *entry = (uint32_t)e;
        return KS_OK;
    }
    return tok_strmap_put(&t->lookup, s, n, -1, entry);
}

static ks_status load_merges(struct tokenizer *t, const struct gguf_file *f)
{
    enum gguf_value_type et;
    uint64_t count = 0;
    const char *key = "tokenizer.ggml.merges";
    if (gguf_find_key(f, key) < 0)
        return tok_pairmap_init(&t->merges, 1);
    ks_status st = gguf_get_arr(f, key, &et, &count, NULL);
    if (st)
        return st;
    if (et != GGUF_TYPE_STRING || count > INT32_MAX)
        return ks_fail(KS_ERR_FORMAT, "tokenizer: %s must be an array of strings", key);
    if ((st = tok_pairmap_init(&t->merges, (uint32_t)count)))
        return st;
    char *buf = NULL;
    size_t cap = 0;
    for (uint64_t i = 0; i < count && !st; i++) {
        struct gguf_str m;
        if ((st = gguf_get_arr_str(f, key, i, &m)))
            break;
        const char *sp = m.len > 1 ? memchr(m.data + 1, ' ', m.len - 1) : NULL;
        if (!sp)
            continue;
        if (m.len > cap) {
            cap = m.len * 2;
            free(buf);
            if (!(buf = malloc(cap))) {
                st = ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory");
                break;
            }
        }
        size_t ln = (size_t)(sp - m.data);
        long l = tok_bytelevel_decode(m.data, ln, buf); /* -1: outside the alphabet, a merge that never applies */
        long r = l > 0 ? tok_bytelevel_decode(sp + 1, m.len - ln - 1, buf + l) : -1;
        if (l <= 0 || r <= 0)
            continue;
        uint32_t el, er;
        if ((st = intern(t, buf, (size_t)l, &el)) || (st = intern(t, buf + l, (size_t)r, &er)))
            break;
        tok_pairmap_put_new(&t->merges, (uint64_t)el << 32 | er, (int32_t)i);
    }
    free(buf);
    return st;
}

ks_status tok_bpe_setup(struct tokenizer *t, const struct gguf_file *f, const char *pre, size_t pre_len)
{
    ks_status st = choose_pre(t, pre, pre_len);
    return st ? st : load_merges(t, f);
}

void tok_bpe_free(struct tokenizer *t)
{
    for (int i = 0; i < t->n_regex; i++)
        pcre2_code_free(t->regex[i]);
    t->n_regex = 0;
}

/* ---- pre-tokenization --------------------------------------------------- */

struct span {
    uint32_t off, len;
};

struct spans {
    struct span *v;
    size_t n, cap;
};

static ks_status spans_push(struct spans *s, size_t off, size_t len)
{
    if (!len)
        return KS_OK;
    if (s->n == s->cap) {
        size_t ncap = s->cap ? s->cap * 2 : 256;
        struct span *v = realloc(s->v, ncap * sizeof *v);
        if (!v)
            return ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory splitting words");
        s->v = v;
        s->cap = ncap;
    }
    s->v[s->n++] = (struct span){(uint32_t)off, (uint32_t)len};
    return KS_OK;
}

static int match_once(const pcre2_code *re, const char *subj, size_t len, size_t start, pcre2_match_data *md)
{
    int rc = pcre2_match(re, (PCRE2_SPTR)subj, len, start, 0, md, NULL);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
        rc = pcre2_match(re, (PCRE2_SPTR)subj, len, start, PCRE2_NO_JIT, md, NULL);
    return rc;
}

/* Split one piece by re into matches and the gaps between them. */
static ks_status split_span(const pcre2_code *re, const char *text, struct span in, pcre2_match_data *md,
                            struct spans *out)
{
    const char *subj = text + in.off;
    size_t pos = 0, gap = 0;
    ks_status st = KS_OK;
    while (pos < in.len && !st) {
        int rc = match_once(re, subj, in.len, pos, md);
        if (rc == PCRE2_ERROR_NOMATCH)
            break;
        if (rc < 0) {
            PCRE2_UCHAR msg[128];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return ks_fail(KS_ERR_INTERNAL, "tokenizer: pre-tokenizer match failed: %s", (const char *)msg);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t ms = ov[0], me = ov[1];
        if (me == ms) { /* empty match: step one character */
            size_t l = tok_utf8_len((uint8_t)subj[ms]);
            pos = ms + (l <= in.len - ms ? l : 1);
            continue;
        }
        st = spans_push(out, in.off + gap, ms - gap);
        if (!st)
            st = spans_push(out, in.off + ms, me - ms);
        pos = gap = me;
    }
    return st ? st : spans_push(out, in.off + gap, in.len - gap);
}

static ks_status pretokenize(const struct tokenizer *t, const char *text, size_t len, struct spans *words)
{
    struct spans a = {0}, b = {0};
    ks_status st = spans_push(&a, 0, len);
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    if (!md)
        st = ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory");
    for (int r = 0; r < t->n_regex && !st; r++) {
        b.n = 0;
        for (size_t i = 0; i < a.n && !st; i++)
            st = split_span(t->regex[r], text, a.v[i], md, &b);
        struct spans tmp = a;
        a = b;
        b = tmp;
    }
    pcre2_match_data_free(md);
    free(b.v);
    if (st) {
        free(a.v);
        return st;
    }
    *words = a;
    return KS_OK;
}

/* ---- merging one word --------------------------------------------------- */

struct bpe_session {
    const struct tokenizer *t;
    const char *w; /* the word's bytes */
    struct tok_sym *sym;
    size_t sym_cap;
    struct tok_heap heap;
    struct tok_cache cache;
};

static int32_t entry_of(const struct tokenizer *t, const char *s, size_t n)
{
    int64_t e = tok_strmap_find(&t->lookup, s, n);
    return e < 0 ? -1 : (int32_t)e;
}

static ks_status add_bigram(struct bpe_session *bs, int32_t left, int32_t right)
{
    if (left < 0 || right < 0)
        return KS_OK;
    const struct tok_sym *l = &bs->sym[left], *r = &bs->sym[right];
    if (l->entry < 0 || r->entry < 0)
        return KS_OK;
    int32_t rank = tok_pairmap_get(&bs->t->merges, (uint64_t)(uint32_t)l->entry << 32 | (uint32_t)r->entry);
    if (rank < 0)
        return KS_OK;
    return tok_heap_push(&bs->heap, (struct tok_bigram){(float)rank, left, right, l->n, r->n});
}

static ks_status emit_symbol(const struct bpe_session *bs, const struct tok_sym *sym, struct tok_ids *out)
{
    const struct tokenizer *t = bs->t;
    int32_t id = sym->entry >= 0 ? t->lookup.val[sym->entry] : -1;
    if (id >= 0)
        return tok_ids_push(out, id);
    /* llama.cpp looks up each byte of the byte-level text alone: only
     * printable ASCII can match. */
    for (uint32_t j = 0; j < sym->n; j++) {
        uint8_t c = (uint8_t)bs->w[sym->off + j];
        int32_t b = tok_byte_to_cp(c) < 0x80 ? t->byte_token[c] : -1;
        ks_status st = b >= 0 ? tok_ids_push(out, b) : KS_OK;
        if (st)
            return st;
    }
    return KS_OK;
}

static ks_status merge_word_uncached(struct bpe_session *bs, size_t n, struct tok_ids *out);

static ks_status merge_word(struct bpe_session *bs, size_t n, struct tok_ids *out)
{
    size_t first = out->n;
    if (n > 1 && n <= TOK_CACHE_MAX_WORD && tok_cache_get(&bs->cache, bs->w, n, out))
        return KS_OK;
    ks_status st = merge_word_uncached(bs, n, out);
    if (!st && n > 1 && n <= TOK_CACHE_MAX_WORD)
        tok_cache_put(&bs->cache, bs->w, n, out->v + first, out->n - first);
    return st;
}

static ks_status merge_word_uncached(struct bpe_session *bs, size_t n, struct tok_ids *out)
{
    const struct tokenizer *t = bs->t;
    if (t->ignore_merges || n == 1) {
        int32_t id = tok_lookup(t, bs->w, n);
        if (id >= 0)
            return tok_ids_push(out, id);
    }
    if (n > bs->sym_cap) {
        struct tok_sym *s = realloc(bs->sym, n * 2 * sizeof *s);
        if (!s)
            return ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory for a %zu-byte word", n);
        bs->sym = s;
        bs->sym_cap = n * 2;
    }
    for (size_t i = 0; i < n; i++)
        bs->sym[i] = (struct tok_sym){(uint32_t)i, 1, (int32_t)i - 1, i + 1 == n ? -1 : (int32_t)i + 1,
                                      entry_of(t, bs->w + i, 1)};
    bs->heap.n = 0;
    ks_status st = KS_OK;
    for (size_t i = 1; i < n && !st; i++)
        st = add_bigram(bs, (int32_t)i - 1, (int32_t)i);
    while (!st && bs->heap.n) {
        struct tok_bigram b = tok_heap_pop(&bs->heap);
        struct tok_sym *l = &bs->sym[b.left], *r = &bs->sym[b.right];
        if (l->n != b.ln || r->n != b.rn)
            continue; /* outdated: one side was merged since */
        l->n += r->n;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0)
            bs->sym[r->next].prev = b.left;
        l->entry = entry_of(t, bs->w + l->off, l->n);
        st = add_bigram(bs, l->prev, b.left);
        if (!st)
            st = add_bigram(bs, b.left, l->next);
    }
    for (int32_t i = 0; i >= 0 && !st; i = bs->sym[i].next)
        st = emit_symbol(bs, &bs->sym[i], out);
    return st;
}

ks_status tok_bpe_encode(const struct tokenizer *t, const char *text, size_t len, struct tok_ids *out)
{
    struct spans words = {0};
    ks_status st = pretokenize(t, text, len, &words);
    if (st)
        return st;
    struct bpe_session bs = {.t = t};
    for (size_t i = 0; i < words.n && !st; i++) {
        bs.w = text + words.v[i].off;
        st = merge_word(&bs, words.v[i].len, out);
    }
    free(bs.sym);
    free(bs.heap.v);
    tok_cache_free(&bs.cache);
    free(words.v);
    return st;
}
