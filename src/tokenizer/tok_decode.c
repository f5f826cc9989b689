/* tokenizer: ids -> text. tok_decode is a stream pushed and flushed in one
 * go, so one-shot and streaming output are identical by construction. */
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tok_internal.h"

struct tok_stream {
    const struct tokenizer *t;
    unsigned flags;
    bool seen_text;  /* a non-control piece was emitted (its leading space is gone) */
    char held[8];    /* an incomplete UTF-8 sequence (at most 3 bytes) */
    size_t n_held;
    char *out;       /* the last call's result */
    char *tmp;       /* held + new bytes */
    size_t tmp_cap;
    size_t out_len, out_cap;
};

ks_status tok_piece(const struct tokenizer *t, int32_t id, const char **bytes, size_t *len)
{
    if (!t || id < 0 || id >= t->n_vocab)
        return ks_fail(KS_ERR_RANGE, "token id %d is out of range (vocabulary of %d)", id, t ? t->n_vocab : 0);
    *bytes = t->text + t->tokens[id].piece_off;
    *len = t->tokens[id].piece_len;
    return KS_OK;
}

ks_status tok_text(const struct tokenizer *t, int32_t id, const char **text, size_t *len)
{
    if (!t || id < 0 || id >= t->n_vocab)
        return ks_fail(KS_ERR_RANGE, "token id %d is out of range (vocabulary of %d)", id, t ? t->n_vocab : 0);
    *text = tok_text_of(t, id);
    *len = t->tokens[id].text_len;
    return KS_OK;
}

char *tok_text_dup(const struct tokenizer *t, int32_t id)
{
    bool valid = t && id >= 0 && id < t->n_vocab;
    return strndup(valid ? tok_text_of(t, id) : "", valid ? t->tokens[id].text_len : 0);
}

/* ---- UTF-8 completeness ------------------------------------------------- */

/* Can s[0..n) (n shorter than its lead byte says) still become a valid
 * character? Mirrors tok_utf8_decode's rules: no overlongs, surrogates or
 * code points above U+10FFFF. */
static bool utf8_prefix_ok(const uint8_t *s, size_t n)
{
    uint8_t lo = 0x80, hi = 0xbf;
    switch (s[0]) {
    case 0xe0: lo = 0xa0; break;
    case 0xed: hi = 0x9f; break;
    case 0xf0: lo = 0x90; break;
    case 0xf4: hi = 0x8f; break;
    default:
        if (s[0] < 0xc2 || s[0] > 0xf4)
            return false;
    }
    if (n >= 2 && (s[1] < lo || s[1] > hi))
        return false;
    for (size_t i = 2; i < n; i++)
        if ((s[i] & 0xc0) != 0x80)
            return false;
    return true;
}

static bool out_reserve(struct tok_stream *s, size_t more)
{
    if (s->out_len + more + 1 <= s->out_cap)
        return true;
    size_t ncap = (s->out_len + more + 1) * 2;
    char *p = realloc(s->out, ncap);
    if (!p)
        return false;
    s->out = p;
    s->out_cap = ncap;
    return true;
}

static void out_bad_byte(struct tok_stream *s, uint8_t b)
{
    if (s->flags & TOK_DECODE_REPLACE_BAD) {
        memcpy(s->out + s->out_len, "\xef\xbf\xbd", 3);
        s->out_len += 3;
    } else {
        s->out[s->out_len++] = (char)b;
    }
}

/* Emit every whole character of held+bytes; keep an incomplete tail unless
 * flushing. The caller reserved 3 output bytes per input byte. */
static bool drain(struct tok_stream *s, const char *bytes, size_t n, bool flush)
{
    size_t len = s->n_held + n;
    if (!len)
        return true;
    if (len > s->tmp_cap) {
        char *p = realloc(s->tmp, len * 2);
        if (!p)
            return false;
        s->tmp = p;
        s->tmp_cap = len * 2;
    }
    memcpy(s->tmp, s->held, s->n_held);
    memcpy(s->tmp + s->n_held, bytes, n);
    s->n_held = 0;
    const char *src = s->tmp;
    for (size_t i = 0; i < len;) {
        uint8_t c = (uint8_t)src[i];
        size_t want = tok_utf8_len(c);
        uint32_t cp;
        if (c < 0x80) {
            s->out[s->out_len++] = (char)c;
            i++;
        } else if (want > 1 && i + want <= len && tok_utf8_decode(src + i, want, &cp) == want) {
            memcpy(s->out + s->out_len, src + i, want);
            s->out_len += want;
            i += want;
        } else if (want > 1 && i + want > len && !flush && utf8_prefix_ok((const uint8_t *)src + i, len - i)) {
            memcpy(s->held, src + i, len - i);
            s->n_held = len - i;
            break;
        } else {
            out_bad_byte(s, c);
            i++;
        }
    }
    return true;
}

/* ---- stream ------------------------------------------------------------- */

ks_status tok_stream_create(const struct tokenizer *t, unsigned flags, struct tok_stream **out)
{
    if (!t || !out)
        return ks_fail(KS_ERR_INVALID_ARG, "tok_stream_create: NULL argument");
    struct tok_stream *s = calloc(1, sizeof *s);
    if (!s)
        return ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory");
    s->t = t;
    s->flags = flags;
    *out = s;
    return KS_OK;
}

void tok_stream_free(struct tok_stream *s)
{
    if (!s)
        return;
    free(s->out);
    free(s->tmp);
    free(s);
}

void tok_stream_reset(struct tok_stream *s)
{
    s->seen_text = false;
    s->n_held = 0;
    s->out_len = 0;
}

static ks_status stream_add(struct tok_stream *s, int32_t id)
{
    const struct tokenizer *t = s->t;
    const struct tok_token *tk = &t->tokens[id];
    if ((tk->attr & TOK_ATTR_CONTROL) && !(s->flags & TOK_DECODE_SPECIAL))
        return KS_OK;
    const char *p = t->text + tk->piece_off;
    size_t n = tk->piece_len;
    if (!(tk->attr & TOK_ATTR_CONTROL)) {
        if (!s->seen_text && t->sp.add_space_prefix && !(s->flags & TOK_DECODE_KEEP_SPACE) && n && p[0] == ' ') {
            p++;
            n--;
        }
        s->seen_text = true;
    }
    if (!out_reserve(s, (n + s->n_held) * 3 + 8))
        return ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory decoding");
    if (!drain(s, p, n, false))
        return ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory decoding");
    return KS_OK;
}

ks_status tok_stream_push(struct tok_stream *s, int32_t id, const char **bytes, size_t *len)
{
    if (!s || !bytes || !len)
        return ks_fail(KS_ERR_INVALID_ARG, "tok_stream_push: NULL argument");
    if (id < 0 || id >= s->t->n_vocab)
        return ks_fail(KS_ERR_RANGE, "token id %d is out of range (vocabulary of %d)", id, s->t->n_vocab);
    s->out_len = 0;
    if (!out_reserve(s, 8))
        return ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory decoding");
    ks_status st = stream_add(s, id);
    if (st)
        return st;
    s->out[s->out_len] = 0;
    *bytes = s->out;
    *len = s->out_len;
    return KS_OK;
}

ks_status tok_stream_flush(struct tok_stream *s, const char **bytes, size_t *len)
{
    if (!s || !bytes || !len)
        return ks_fail(KS_ERR_INVALID_ARG, "tok_stream_flush: NULL argument");
    s->out_len = 0;
    if (!out_reserve(s, s->n_held * 3 + 8))
        return ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory decoding");
    if (!drain(s, "", 0, true))
        return ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory decoding");
    s->out[s->out_len] = 0;
    *bytes = s->out;
    *len = s->out_len;
    return KS_OK;
}

ks_status tok_decode(const struct tokenizer *t, const int32_t *ids, size_t n, unsigned flags, char **out,
                     size_t *len)
{
    if (!t || !out || !len || (!ids && n))
        return ks_fail(KS_ERR_INVALID_ARG, "tok_decode: NULL argument");
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= t->n_vocab)
            return ks_fail(KS_ERR_RANGE, "token %zu: id %d is out of range (vocabulary of %d)", i, ids[i],
                           t->n_vocab);
    struct tok_stream s = {.t = t, .flags = flags};
    ks_status st = KS_OK;
    for (size_t i = 0; i < n && !st; i++)
        st = stream_add(&s, ids[i]); /* appends: out_len is not reset between pushes */
    if (!st && !out_reserve(&s, s.n_held * 3 + 8))
        st = ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory decoding");
    if (!st && !drain(&s, "", 0, true))
        st = ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory decoding");
    free(s.tmp);
    if (st) {
        free(s.out);
        return st;
    }
    s.out[s.out_len] = 0;
    *out = s.out;
    *len = s.out_len;
    return KS_OK;
}
