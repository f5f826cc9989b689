/* tokenizer: tok_encode — special-token partitioning, then the family
 * encoder on each stretch of plain text.
 *
 * Partitioning follows llama.cpp exactly: special tokens are tried longest
 * first; each one splits every remaining plain-text fragment at all of its
 * non-overlapping occurrences, left to right. With parse_special off only
 * USER_DEFINED tokens are matched (control and unknown tokens are plain
 * text). A first pass finds which special tokens occur at all, so a big
 * vocabulary of them costs one scan of the text, not one per token. */
#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tok_internal.h"

#define TOK_MAX_TEXT ((size_t)1 << 30) /* offsets are 32-bit; 1 GiB is far beyond any prompt */

struct frag {
    int32_t id; /* -1 for plain text */
    uint32_t off, len;
};

struct frags {
    struct frag *v;
    size_t n, cap;
};

static ks_status frags_push(struct frags *f, int32_t id, size_t off, size_t len)
{
    if (id < 0 && !len)
        return KS_OK;
    if (f->n == f->cap) {
        size_t ncap = f->cap ? f->cap * 2 : 16;
        struct frag *v = realloc(f->v, ncap * sizeof *v);
        if (!v)
            return ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory partitioning text");
        f->v = v;
        f->cap = ncap;
    }
    f->v[f->n++] = (struct frag){id, (uint32_t)off, (uint32_t)len};
    return KS_OK;
}

static bool allowed(const struct tokenizer *t, int32_t id, bool parse_special)
{
    return parse_special || !(t->tokens[id].attr & (TOK_ATTR_CONTROL | TOK_ATTR_UNKNOWN));
}

/* occurs[e]: the special text with map entry e appears somewhere. One scan;
 * at each byte only texts with that first and second byte are looked up. */
static bool *find_occurring(const struct tokenizer *t, const char *text, size_t len, size_t *n_found)
{
    bool *occurs = calloc(t->special_map.n + 1, 1);
    if (!occurs)
        return NULL;
    *n_found = 0;
    for (size_t i = 0; i < len; i++) {
        uint8_t b0 = (uint8_t)text[i];
        uint32_t lo = t->len_off[b0], hi = t->len_off[b0 + 1];
        if (lo == hi)
            continue;
        if (!t->first_alone[b0]) {
            uint8_t b1 = i + 1 < len ? (uint8_t)text[i + 1] : 0;
            if (i + 1 >= len || !(t->second_byte[b0][b1 >> 6] >> (b1 & 63) & 1))
                continue;
        }
        for (uint32_t j = lo; j < hi; j++) {
            uint32_t n = t->len_list[j];
            int64_t e = n <= len - i ? tok_strmap_find(&t->special_map, text + i, n) : -1;
            if (e >= 0 && !occurs[e]) {
                occurs[e] = true;
                ++*n_found;
            }
        }
    }
    return occurs;
}

/* Split every plain fragment of in at the occurrences of special token id. */
static ks_status split_on(const struct tokenizer *t, const char *text, int32_t id, const struct frags *in,
                          struct frags *out)
{
    const char *s = tok_text_of(t, id);
    size_t n = t->tokens[id].text_len;
    uint32_t attr = t->tokens[id].attr;
    ks_status st = KS_OK;
    out->n = 0;
    for (size_t i = 0; i < in->n && !st; i++) {
        struct frag f = in->v[i];
        if (f.id >= 0) {
            st = frags_push(out, f.id, 0, 0);
            continue;
        }
        size_t off = f.off, len = f.len;
        while (!st) {
            const char *m = len >= n ? memmem(text + off, len, s, n) : NULL;
            if (!m) {
                st = frags_push(out, -1, off, len);
                break;
            }
            size_t at = (size_t)(m - text), left = at - off;
            if (attr & TOK_ATTR_LSTRIP)
                while (left > 0 && isspace((unsigned char)text[off + left - 1]))
                    left--;
            st = frags_push(out, -1, off, left);
            if (!st)
                st = frags_push(out, id, 0, 0);
            size_t roff = at + n, rlen = off + len - roff;
            if (attr & TOK_ATTR_RSTRIP)
                while (rlen > 0 && isspace((unsigned char)text[roff])) {
                    roff++;
                    rlen--;
                }
            off = roff;
            len = rlen;
        }
    }
    return st;
}

static ks_status partition(const struct tokenizer *t, const char *text, size_t len, bool parse_special,
                           struct frags *out)
{
    struct frags a = {0}, b = {0};
    ks_status st = frags_push(&a, -1, 0, len);
    size_t n_found = 0;
    bool *occurs = st ? NULL : find_occurring(t, text, len, &n_found);
    if (!st && !occurs)
        st = ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory");
    for (size_t k = 0; k < t->n_special && n_found && !st; k++) {
        if (!occurs[t->special_entry[k]] || !allowed(t, t->special[k], parse_special))
            continue;
        st = split_on(t, text, t->special[k], &a, &b);
        struct frags tmp = a;
        a = b;
        b = tmp;
    }
    free(occurs);
    free(b.v);
    if (st) {
        free(a.v);
        return st;
    }
    *out = a;
    return KS_OK;
}

static ks_status encode_fragments(const struct tokenizer *t, const char *text, const struct frags *fr,
                                  struct tok_ids *ids)
{
    bool prev_special = true; /* SPM: the first plain fragment gets the space prefix */
    ks_status st = KS_OK;
    for (size_t i = 0; i < fr->n && !st; i++) {
        const struct frag *f = &fr->v[i];
        if (f->id >= 0) {
            st = tok_ids_push(ids, f->id);
            prev_special = true;
        } else if (t->family == TOK_FAMILY_SPM) {
            st = tok_spm_encode(t, text + f->off, f->len, t->sp.add_space_prefix && prev_special, ids);
            prev_special = false;
        } else if (t->family == TOK_FAMILY_BPE) {
            st = tok_bpe_encode(t, text + f->off, f->len, ids);
        } else {
            st = tok_wpm_encode(t, text + f->off, f->len, ids);
        }
    }
    return st;
}

ks_status tok_encode(const struct tokenizer *t, const char *text, size_t len, unsigned flags, int32_t **ids,
                     size_t *n_ids)
{
    if (!t || !ids || !n_ids || (!text && len))
        return ks_fail(KS_ERR_INVALID_ARG, "tok_encode: NULL argument");
    if (len > TOK_MAX_TEXT)
        return ks_fail(KS_ERR_RANGE, "tok_encode: %zu bytes of text is more than the 1 GiB limit", len);
    struct tok_ids out = {0};
    struct frags fr = {0};
    bool add = flags & TOK_ADD_SPECIAL;
    ks_status st = KS_OK;
    if (add && t->sp.add_bos)
        st = tok_ids_push(&out, t->sp.bos);
    if (!st && len)
        st = partition(t, text, len, flags & TOK_PARSE_SPECIAL, &fr);
    if (!st)
        st = encode_fragments(t, text, &fr, &out);
    if (!st && add && t->sp.add_eos)
        st = tok_ids_push(&out, t->sp.eos);
    if (!st && !out.v && !(out.v = malloc(sizeof *out.v)))
        st = ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory");
    free(fr.v);
    if (st) {
        free(out.v);
        return st;
    }
    *ids = out.v;
    *n_ids = out.n;
    return KS_OK;
}
