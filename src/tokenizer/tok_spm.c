/* tokenizer: SentencePiece-style encoding ("llama" vocabularies).
 *
 * Spaces become U+2581, the text is split into UTF-8 characters, and the
 * adjacent pair whose concatenation is the highest-scoring vocabulary token
 * is merged until no pair is a token (ties: leftmost). A final symbol that is
 * not a token is written as byte tokens <0xXX>. This is llama.cpp's
 * algorithm (but for malformed UTF-8, see char_len).
 *
 * Speed: when no vocabulary token has U+2581 after other text (true of
 * SentencePiece vocabularies), no merge can cross the start of a word, so
 * each word is merged alone (a small heap that stays in cache) and repeated
 * words come from a memo. The result is identical to merging the whole text:
 * merges in different words never interact and keep their relative order. */
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tok_internal.h"

#define SPACE_MARK "\xe2\x96\x81"
#define SPACE_MARK_LEN 3

struct spm_session {
    const struct tokenizer *t;
    const char *s; /* the escaped text */
    struct tok_sym *sym;
    size_t sym_cap;
    struct tok_heap heap;
    struct tok_cache cache;
};

static char *escape_spaces(const char *text, size_t len, bool add_prefix, size_t *out_len)
{
    size_t spaces = add_prefix;
    for (size_t i = 0; i < len; i++)
        spaces += text[i] == ' ';
    size_t n = len + spaces * (SPACE_MARK_LEN - 1) + add_prefix;
    char *out = malloc(n ? n : 1);
    if (!out)
        return NULL;
    size_t o = 0;
    if (add_prefix) {
        memcpy(out, SPACE_MARK, SPACE_MARK_LEN);
        o = SPACE_MARK_LEN;
    }
    for (size_t i = 0; i < len; i++) {
        if (text[i] == ' ') {
            memcpy(out + o, SPACE_MARK, SPACE_MARK_LEN);
            o += SPACE_MARK_LEN;
        } else {
            out[o++] = text[i];
        }
    }
    *out_len = o;
    return out;
}

/* Bytes of the character at s[off]. llama.cpp trusts the lead byte; a
 * malformed sequence is taken byte by byte instead, so that it cannot swallow
 * the U+2581 of a following space (which would no longer decode to ' '). */
static size_t char_len(const char *s, size_t end, size_t off)
{
    uint32_t cp;
    size_t l = tok_utf8_decode(s + off, end - off, &cp);
    return l ? l : 1;
}

static ks_status try_add_bigram(struct spm_session *ss, int32_t left, int32_t right)
{
    if (left < 0 || right < 0)
        return KS_OK;
    const struct tok_sym *l = &ss->sym[left], *r = &ss->sym[right];
    int32_t id = tok_lookup(ss->t, ss->s + l->off, l->n + r->n);
    if (id < 0)
        return KS_OK;
    struct tok_bigram b = {-ss->t->tokens[id].score, left, right, l->n, r->n};
    return tok_heap_push(&ss->heap, b);
}

static ks_status emit_symbol(const struct spm_session *ss, const struct tok_sym *sym, struct tok_ids *out)
{
    const struct tokenizer *t = ss->t;
    int32_t id = tok_lookup(t, ss->s + sym->off, sym->n);
    if (id >= 0)
        return tok_ids_push(out, id);
    for (uint32_t j = 0; j < sym->n; j++) {
        int32_t b = t->byte_token[(uint8_t)ss->s[sym->off + j]];
        if (b < 0)
            b = t->sp.unk;
        ks_status st = b >= 0 ? tok_ids_push(out, b) : KS_OK;
        if (st)
            return st;
    }
    return KS_OK;
}

/* Merge the characters of s[start, end) and append the tokens. */
static ks_status encode_span(struct spm_session *ss, size_t start, size_t end, struct tok_ids *out)
{
    size_t n_sym = 0, max_sym = end - start;
    if (max_sym > ss->sym_cap) {
        struct tok_sym *p = realloc(ss->sym, max_sym * 2 * sizeof *p);
        if (!p)
            return ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory for %zu bytes of text", max_sym);
        ss->sym = p;
        ss->sym_cap = max_sym * 2;
    }
    struct tok_sym *sym = ss->sym;
    for (size_t off = start; off < end; n_sym++) {
        size_t l = char_len(ss->s, end, off);
        sym[n_sym] = (struct tok_sym){(uint32_t)off, (uint32_t)l, (int32_t)n_sym - 1,
                                      off + l == end ? -1 : (int32_t)n_sym + 1, -1};
        off += l;
    }
    ss->heap.n = 0;
    ks_status st = KS_OK;
    for (size_t i = 1; i < n_sym && !st; i++)
        st = try_add_bigram(ss, (int32_t)i - 1, (int32_t)i);
    while (!st && ss->heap.n) {
        struct tok_bigram b = tok_heap_pop(&ss->heap);
        struct tok_sym *l = &sym[b.left], *r = &sym[b.right];
        if (l->n != b.ln || r->n != b.rn)
            continue; /* one side was merged since this pair was queued */
        l->n += r->n;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0)
            sym[r->next].prev = b.left;
        st = try_add_bigram(ss, l->prev, b.left);
        if (!st)
            st = try_add_bigram(ss, b.left, l->next);
    }
    for (int32_t i = n_sym ? 0 : -1; i >= 0 && !st; i = sym[i].next)
        st = emit_symbol(ss, &sym[i], out);
    return st;
}

static ks_status encode_word(struct spm_session *ss, size_t start, size_t end, struct tok_ids *out)
{
    size_t n = end - start, first = out->n;
    if (n <= TOK_CACHE_MAX_WORD && tok_cache_get(&ss->cache, ss->s + start, n, out))
        return KS_OK;
    ks_status st = encode_span(ss, start, end, out);
    if (!st && n <= TOK_CACHE_MAX_WORD)
        tok_cache_put(&ss->cache, ss->s + start, n, out->v + first, out->n - first);
    return st;
}

static bool is_mark(const char *s, size_t n, size_t at)
{
    return at + SPACE_MARK_LEN <= n && !memcmp(s + at, SPACE_MARK, SPACE_MARK_LEN);
}

/* Words start at a U+2581 that does not follow another one. */
static ks_status encode_words(struct spm_session *ss, size_t n, struct tok_ids *out)
{
    const char *s = ss->s;
    size_t start = 0;
    ks_status st = KS_OK;
    for (size_t off = 0; off < n && !st;) {
        size_t l = char_len(s, n, off);
        if (off > start && is_mark(s, n, off) && !(off >= SPACE_MARK_LEN && is_mark(s, n, off - SPACE_MARK_LEN))) {
            st = encode_word(ss, start, off, out);
            start = off;
        }
        off += l;
    }
    return st || start == n ? st : encode_word(ss, start, n, out);
}

ks_status tok_spm_encode(const struct tokenizer *t, const char *text, size_t len, bool add_prefix,
                         struct tok_ids *out)
{
    size_t n = 0;
    char *s = escape_spaces(text, len, add_prefix, &n);
    if (!s)
        return ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory for %zu bytes of text", len);
    struct spm_session ss = {.t = t, .s = s};
    ks_status st = t->spm_split_words ? encode_words(&ss, n, out) : encode_span(&ss, 0, n, out);
    free(ss.heap.v);
    free(ss.sym);
    tok_cache_free(&ss.cache);
    free(s);
    return st;
}
