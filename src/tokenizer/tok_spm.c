/* tokenizer: SentencePiece-style encoding ("llama" vocabularies).
 *
 * Spaces become U+2581, the text is split into UTF-8 characters, and the
 * adjacent pair whose concatenation is the highest-scoring vocabulary token
 * is merged until no pair is a token (ties: leftmost). A final symbol that is
 * not a token is written as byte tokens <0xXX>. This is llama.cpp's
 * algorithm, with a heap so long inputs stay O(n log n). */
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tok_internal.h"

#define SPACE_MARK "\xe2\x96\x81"
#define SPACE_MARK_LEN 3

struct spm_session {
    const struct tokenizer *t;
    const char *s; /* the escaped text */
    struct tok_sym *sym;
    struct tok_heap heap;
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

static ks_status merge_all(struct spm_session *ss, size_t n_sym)
{
    ks_status st = KS_OK;
    for (size_t i = 1; i < n_sym && !st; i++)
        st = try_add_bigram(ss, (int32_t)i - 1, (int32_t)i);
    while (!st && ss->heap.n) {
        struct tok_bigram b = tok_heap_pop(&ss->heap);
        struct tok_sym *l = &ss->sym[b.left], *r = &ss->sym[b.right];
        if (l->n != b.ln || r->n != b.rn)
            continue; /* one side was merged since this pair was queued */
        l->n += r->n;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0)
            ss->sym[r->next].prev = b.left;
        st = try_add_bigram(ss, l->prev, b.left);
        if (!st)
            st = try_add_bigram(ss, b.left, l->next);
    }
    return st;
}

ks_status tok_spm_encode(const struct tokenizer *t, const char *text, size_t len, bool add_prefix,
                         struct tok_ids *out)
{
    size_t n = 0;
    char *s = escape_spaces(text, len, add_prefix, &n);
    struct tok_sym *sym = malloc((n ? n : 1) * sizeof *sym);
    if (!s || !sym) {
        free(s);
        free(sym);
        return ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory for %zu bytes of text", len);
    }
    size_t n_sym = 0;
    for (size_t off = 0; off < n; n_sym++) {
        size_t l = tok_utf8_len((uint8_t)s[off]);
        if (l > n - off)
            l = n - off;
        sym[n_sym] = (struct tok_sym){(uint32_t)off, (uint32_t)l, (int32_t)n_sym - 1,
                                      off + l == n ? -1 : (int32_t)n_sym + 1, -1};
        off += l;
    }
    struct spm_session ss = {t, s, sym, {0}};
    ks_status st = merge_all(&ss, n_sym);
    for (int32_t i = n_sym ? 0 : -1; i >= 0 && !st; i = sym[i].next)
        st = emit_symbol(&ss, &sym[i], out);
    free(ss.heap.v);
    free(sym);
    free(s);
    return st;
}
