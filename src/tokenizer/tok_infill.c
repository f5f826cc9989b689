/* The fill-in-the-middle prompt of llama-server's /infill (its
 * format_prompt_infill, the repository-level FIM pattern), shared by the
 * server, which serves it, and the router, which keys it:
 *
 *   [extra:] <fim_rep>myproject\n <fim_sep>NAME\n TEXT ... <fim_sep>filename\n
 *   [BOS] <fim_pre> PREFIX PROMPT <fim_suf> SUFFIX <fim_mid>
 *
 * (suffix first with spm), the prefix cut to its last 3/4 of a 2048 token
 * batch, the suffix to what is left of the last quarter, and the extra files
 * to their last n_ctx - 2048 + 2 tokens (llama-server's defaults, -b 2048 and
 * -n -1). */
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tokenizer.h"

enum { INFILL_BATCH = 2048 };

struct ids {
    int32_t *v;
    size_t n, cap;
};

static bool ids_append(struct ids *a, const int32_t *v, size_t n)
{
    if (a->n + n > a->cap) {
        size_t cap = a->cap ? a->cap : 64;
        while (cap < a->n + n)
            cap *= 2;
        int32_t *grown = realloc(a->v, cap * sizeof *grown);
        if (!grown)
            return false;
        a->v = grown;
        a->cap = cap;
    }
    if (n)
        memcpy(a->v + a->n, v, n * sizeof *v);
    a->n += n;
    return true;
}

static ks_status push(struct ids *a, int32_t id)
{
    return ids_append(a, &id, 1) ? KS_OK : ks_fail(KS_ERR_NOMEM, "out of memory while building the infill prompt");
}

/* text tokenized with flags (no BOS: TOK_ADD_SPECIAL is never given), appended. */
static ks_status encode(const struct tokenizer *tok, const char *text, unsigned flags, struct ids *out)
{
    int32_t *v = NULL;
    size_t n = 0;
    ks_status st = tok_encode(tok, text, strlen(text), flags, &v, &n);
    if (!st && !ids_append(out, v, n))
        st = ks_fail(KS_ERR_NOMEM, "out of memory while building the infill prompt");
    free(v);
    return st;
}

/* input_prefix / input_suffix: strings without special tokens parsed, and token ids. */
static ks_status encode_parts(const struct tokenizer *tok, const struct tok_infill_part *p, size_t n,
                              struct ids *out)
{
    ks_status st = KS_OK;
    for (size_t i = 0; i < n && !st; i++)
        st = p[i].text ? encode(tok, p[i].text, 0, out) : push(out, p[i].id);
    return st;
}

/* The repository context: <fim_rep>myproject\n, then each file as
 * <fim_sep>NAME\n TEXT (without a separator token, a plain-text marker). */
static ks_status encode_files(const struct tokenizer *tok, const struct tok_infill *in, struct ids *out)
{
    const struct tok_special *sp = tok_special(tok);
    ks_status st = KS_OK;
    if (sp->fim_rep >= 0 && !(st = push(out, sp->fim_rep)))
        st = encode(tok, "myproject\n", 0, out);
    for (size_t i = 0; i < in->n_files && !st; i++) {
        if (sp->fim_sep >= 0) {
            const char *name = in->files[i].name ? in->files[i].name : "tmp";
            size_t len = strlen(name);
            char *head = malloc(len + 2);
            if (!head)
                return ks_fail(KS_ERR_NOMEM, "out of memory while building the infill prompt");
            memcpy(head, name, len);
            memcpy(head + len, "\n", 2);
            if (!(st = push(out, sp->fim_sep)))
                st = encode(tok, head, 0, out);
            free(head);
        } else {
            st = encode(tok, "\n\n--- snippet ---\n\n", 0, out);
        }
        if (!st)
            st = encode(tok, in->files[i].text, 0, out);
    }
    if (!st && sp->fim_sep >= 0 && !(st = push(out, sp->fim_sep)))
        st = encode(tok, "filename\n", 0, out);
    return st;
}

static size_t clamp_take(int64_t want, size_t have)
{
    if (want < 0)
        want = 0;
    return (size_t)want < have ? (size_t)want : have;
}

/* The prompt from its tokenized parts. */
static ks_status assemble(const struct tokenizer *tok, const struct tok_infill *in, const struct ids *pre,
                          const struct ids *suf, const struct ids *prompt, const struct ids *extra, struct ids *out)
{
    const struct tok_special *sp = tok_special(tok);
    size_t n_pre = clamp_take(3 * (INFILL_BATCH / 4), pre->n);
    size_t n_suf = clamp_take(INFILL_BATCH / 4 - (2 + (int64_t)prompt->n), suf->n);
    size_t n_extra = clamp_take((int64_t)in->n_ctx - INFILL_BATCH + 2, extra->n);
    bool ok = ids_append(out, extra->v + extra->n - n_extra, n_extra);
    if (ok && sp->add_bos)
        ok = ids_append(out, &sp->bos, 1);
    for (int part = 0; ok && part < 2; part++) {
        if ((part == 0) != in->spm)
            ok = ids_append(out, &sp->fim_pre, 1) && ids_append(out, pre->v + pre->n - n_pre, n_pre) &&
                 ids_append(out, prompt->v, prompt->n);
        else
            ok = ids_append(out, &sp->fim_suf, 1) && ids_append(out, suf->v, n_suf);
    }
    if (!ok || !ids_append(out, &sp->fim_mid, 1))
        return ks_fail(KS_ERR_NOMEM, "out of memory while building the infill prompt");
    return KS_OK;
}

ks_status tok_infill_prompt(const struct tokenizer *tok, const struct tok_infill *in, int32_t **ids, size_t *n)
{
    *ids = NULL;
    *n = 0;
    const struct tok_special *sp = tok_special(tok);
    if (sp->fim_pre < 0 || sp->fim_suf < 0 || sp->fim_mid < 0)
        return ks_fail(KS_ERR_UNSUPPORTED, "the vocabulary has no fill-in-the-middle prefix, suffix and middle tokens");
    struct ids pre = {0}, suf = {0}, prompt = {0}, extra = {0}, out = {0};
    ks_status st = encode_parts(tok, in->prefix, in->n_prefix, &pre);
    if (!st)
        st = encode_parts(tok, in->suffix, in->n_suffix, &suf);
    if (!st && in->prompt)
        st = encode(tok, in->prompt, TOK_PARSE_SPECIAL, &prompt);
    if (!st)
        st = encode_files(tok, in, &extra);
    if (!st)
        st = assemble(tok, in, &pre, &suf, &prompt, &extra, &out);
    free(pre.v);
    free(suf.v);
    free(prompt.v);
    free(extra.v);
    if (st) {
        free(out.v);
        return st;
    }
    *ids = out.v;
    *n = out.n;
    return KS_OK;
}
