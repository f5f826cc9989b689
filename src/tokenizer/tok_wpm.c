/* tokenizer: WordPiece ("bert" vocabularies), as llama.cpp does it.
 *
 * Pre-processing keeps the first code point of each character's NFD form
 * (which drops accents), lowercases, splits on whitespace, and makes every
 * punctuation mark, ASCII symbol and CJK ideograph a word of its own;
 * control characters vanish. Each word, prefixed with U+2581, is then cut
 * greedily into the longest vocabulary tokens; a word that cannot be cut
 * becomes [UNK]. */
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tok_internal.h"
#include "tokenizer/tok_unicode.h"

static uint32_t cp_flags(uint32_t cp)
{
    unsigned lo = 0, hi = tok_cp_flag_ranges_n;
    while (lo < hi) {
        unsigned mid = (lo + hi) / 2;
        if (cp < tok_cp_flag_ranges[mid].first)
            hi = mid;
        else if (cp > tok_cp_flag_ranges[mid].last)
            lo = mid + 1;
        else
            return tok_cp_flag_ranges[mid].flags;
    }
    return 0;
}

static uint32_t cp_map(const struct tok_cp_pair *table, unsigned n, uint32_t cp)
{
    unsigned lo = 0, hi = n;
    while (lo < hi) {
        unsigned mid = (lo + hi) / 2;
        if (cp < table[mid].from)
            hi = mid;
        else if (cp > table[mid].from)
            lo = mid + 1;
        else
            return table[mid].to;
    }
    return cp;
}

static bool is_chinese(uint32_t c)
{
    return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) || (c >= 0x20000 && c <= 0x2A6DF) ||
           (c >= 0x2A700 && c <= 0x2B73F) || (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B920 && c <= 0x2CEAF) ||
           (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

#define SPACE_MARK "\xe2\x96\x81"

/* Cut one word (already prefixed with U+2581) into tokens. */
static ks_status cut_word(const struct tokenizer *t, const char *w, size_t n, size_t max_len, struct tok_ids *out)
{
    size_t start = out->n;
    for (size_t i = 0; i < n;) {
        size_t j = i + max_len < n ? i + max_len : n;
        int32_t id = -1;
        for (; j > i; j--)
            if ((id = tok_lookup(t, w + i, j - i)) >= 0)
                break;
        if (id < 0) {
            out->n = start;
            break;
        }
        ks_status st = tok_ids_push(out, id);
        if (st)
            return st;
        i = j;
    }
    return out->n == start && t->sp.unk >= 0 ? tok_ids_push(out, t->sp.unk) : KS_OK;
}

struct word {
    char *p;
    size_t n, cap;
};

static bool word_put(struct word *w, const char *s, size_t n)
{
    if (w->n + n > w->cap) {
        size_t ncap = (w->n + n) * 2 + 16;
        char *p = realloc(w->p, ncap);
        if (!p)
            return false;
        w->p = p;
        w->cap = ncap;
    }
    memcpy(w->p + w->n, s, n);
    w->n += n;
    return true;
}

static ks_status finish_word(const struct tokenizer *t, struct word *w, size_t max_len, struct tok_ids *out)
{
    ks_status st = KS_OK;
    if (w->n > 3)
        st = cut_word(t, w->p, w->n, max_len, out);
    w->n = 0;
    if (!word_put(w, SPACE_MARK, 3))
        return ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory");
    return st;
}

ks_status tok_wpm_encode(const struct tokenizer *t, const char *text, size_t len, struct tok_ids *out)
{
    size_t max_len = t->max_token_len;
    struct word w = {0};
    if (!word_put(&w, SPACE_MARK, 3))
        return ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory");
    ks_status st = KS_OK;
    for (size_t i = 0; i < len && !st;) {
        uint32_t cp;
        size_t l = tok_utf8_decode(text + i, len - i, &cp);
        if (!l) { /* invalid UTF-8 reads as U+FFFD, which is dropped */
            i++;
            continue;
        }
        i += l;
        cp = cp_map(tok_cp_nfd, tok_cp_nfd_n, cp);
        uint32_t f = cp_flags(cp);
        if (f & TOK_CP_WS) {
            st = finish_word(t, &w, max_len, out);
            continue;
        }
        if (cp == 0 || cp == 0xFFFD || (f & TOK_CP_CONTROL))
            continue;
        char enc[4];
        size_t el = tok_utf8_encode(cp_map(tok_cp_lower, tok_cp_lower_n, cp), enc);
        bool alone = (f & TOK_CP_PUNCT) || (cp < 0x7F && (f & TOK_CP_SYMBOL)) || is_chinese(cp);
        if (alone && (st = finish_word(t, &w, max_len, out)))
            break;
        if (!word_put(&w, enc, el)) {
            st = ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory");
            break;
        }
        if (alone)
            st = finish_word(t, &w, max_len, out);
    }
    if (!st)
        st = finish_word(t, &w, max_len, out);
    free(w.p);
    return st;
}
