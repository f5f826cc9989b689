/* server: POST /infill, llama-server's fill-in-the-middle route.
 *
 * The request names the text before and after the cursor (input_prefix,
 * input_suffix, each a string or a list of strings and token ids), optional
 * extra files (input_extra: [{"filename", "text"}]) and an optional prompt
 * that continues the prefix. The prompt is assembled exactly as llama-server
 * assembles it (its format_prompt_infill, the repo-level FIM pattern):
 *
 *   [extra:] <fim_rep>myproject\n <fim_sep>NAME\n TEXT ... <fim_sep>filename\n
 *   [BOS] <fim_pre> PREFIX PROMPT <fim_suf> SUFFIX <fim_mid>
 *
 * (suffix first with --spm-infill), the prefix cut to its last 3/4 of a 2048
 * token batch, the suffix to what is left of the last quarter, and the extra
 * files to their last ctx - 2048 + 2 tokens (llama-server's defaults, -b 2048
 * and -n -1). The result is a native /completion request on those token
 * ids: same fields, same response. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cJSON.h>

#include "server/server.h"
#include "server/server_internal.h"

enum { INFILL_BATCH = 2048 };

struct ids {
    int32_t *v;
    size_t n, cap;
};

static bool ids_reserve(struct ids *a, size_t more)
{
    if (a->n + more <= a->cap)
        return true;
    size_t cap = a->cap ? a->cap : 64;
    while (cap < a->n + more)
        cap *= 2;
    int32_t *v = realloc(a->v, cap * sizeof *v);
    if (!v)
        return false;
    a->v = v;
    a->cap = cap;
    return true;
}

static bool ids_push(struct ids *a, int32_t id)
{
    if (!ids_reserve(a, 1))
        return false;
    a->v[a->n++] = id;
    return true;
}

static bool ids_append(struct ids *a, const int32_t *v, size_t n)
{
    if (n == 0) /* an empty text's tokens may be NULL, and memcpy takes no NULL even for 0 bytes */
        return true;
    if (!ids_reserve(a, n))
        return false;
    memcpy(a->v + a->n, v, n * sizeof *v);
    a->n += n;
    return true;
}

/* Text without BOS and without parsing special tokens, appended to out. */
static ks_status tokenize_plain(const struct server *srv, const char *text, unsigned flags, struct ids *out,
                                struct reply *r)
{
    int32_t *v = NULL;
    size_t n = 0;
    ks_status st = tok_encode(srv->tok, text, strlen(text), flags, &v, &n);
    if (st)
        return reply_fail(r, st == KS_ERR_NOMEM ? st : KS_ERR_INTERNAL, NULL, "tokenizer: %s", ks_errmsg());
    bool ok = ids_append(out, v, n);
    free(v);
    return ok ? KS_OK : reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while building the infill prompt");
}

/* input_prefix / input_suffix: a string, or a list of strings and token ids
 * (llama-server's tokenize_mixed; no BOS, no special tokens parsed). */
static ks_status tokenize_mixed(const struct server *srv, const cJSON *v, const char *name, struct ids *out,
                                struct reply *r)
{
    if (cJSON_IsString(v))
        return tokenize_plain(srv, v->valuestring, 0, out, r);
    if (!cJSON_IsArray(v))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type",
                          "'%s' must be a string or a list of strings and token ids", name);
    int32_t n_vocab = tok_n_vocab(srv->tok);
    int i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, v) {
        ks_status st = KS_OK;
        if (cJSON_IsString(e))
            st = tokenize_plain(srv, e->valuestring, 0, out, r);
        else if (cJSON_IsNumber(e) && e->valuedouble == floor(e->valuedouble) && e->valuedouble >= 0 &&
                 e->valuedouble < n_vocab)
            st = ids_push(out, (int32_t)e->valuedouble) ? KS_OK
                                                         : reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory");
        else
            st = reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                            "'%s'[%d] must be a string or a token id in [0, %d)", name, i, n_vocab);
        if (st)
            return st;
        i++;
    }
    return KS_OK;
}

/* 501 unless the vocabulary has the prefix, suffix and middle tokens;
 * llama-server's message. */
static ks_status check_vocab(const struct tok_special *sp, struct reply *r)
{
    if (sp->fim_pre >= 0 && sp->fim_suf >= 0 && sp->fim_mid >= 0)
        return KS_OK;
    return reply_fail(r, KS_ERR_UNSUPPORTED, "not_supported", "Infill is not supported by this model: %s%s%s",
                      sp->fim_pre < 0 ? "prefix token is missing. " : "",
                      sp->fim_suf < 0 ? "suffix token is missing. " : "",
                      sp->fim_mid < 0 ? "middle token is missing. " : "");
}

static ks_status check_fields(const cJSON *root, struct reply *r)
{
    const cJSON *prompt = cJSON_GetObjectItemCaseSensitive(root, "prompt");
    const cJSON *extra = cJSON_GetObjectItemCaseSensitive(root, "input_extra");
    if (prompt && !cJSON_IsString(prompt))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "\"prompt\" must be a string");
    if (!cJSON_GetObjectItemCaseSensitive(root, "input_prefix"))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "\"input_prefix\" is required");
    if (!cJSON_GetObjectItemCaseSensitive(root, "input_suffix"))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "\"input_suffix\" is required");
    if (extra && !cJSON_IsArray(extra))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type",
                          "\"input_extra\" must be an array of {\"filename\": string, \"text\": string}");
    const cJSON *chunk;
    cJSON_ArrayForEach(chunk, extra) {
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(chunk, "text");
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(chunk, "filename");
        if (!cJSON_IsString(text))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type",
                              "extra_context chunk must contain a \"text\" field with a string value");
        if (name && !cJSON_IsString(name))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type",
                              "extra_context chunk's \"filename\" field must be a string");
    }
    return KS_OK;
}

/* The repository context: <fim_rep>myproject\n, then each file as
 * <fim_sep>NAME\n TEXT (without a separator token, a plain-text marker). */
static ks_status extra_tokens(const struct server *srv, const cJSON *extra, struct ids *out, struct reply *r)
{
    const struct tok_special *sp = tok_special(srv->tok);
    ks_status st = KS_OK;
    if (sp->fim_rep >= 0 && !(st = ids_push(out, sp->fim_rep) ? KS_OK : reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory")))
        st = tokenize_plain(srv, "myproject\n", 0, out, r);
    const cJSON *chunk;
    cJSON_ArrayForEach(chunk, extra) {
        if (st)
            return st;
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(chunk, "filename");
        const char *text = cJSON_GetObjectItemCaseSensitive(chunk, "text")->valuestring;
        if (sp->fim_sep >= 0) {
            const char *file = cJSON_IsString(name) ? name->valuestring : "tmp";
            size_t len = strlen(file);
            char *head = malloc(len + 2);
            if (!head || !ids_push(out, sp->fim_sep)) {
                free(head);
                return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory");
            }
            memcpy(head, file, len);
            memcpy(head + len, "\n", 2);
            st = tokenize_plain(srv, head, 0, out, r);
            free(head);
        } else {
            st = tokenize_plain(srv, "\n\n--- snippet ---\n\n", 0, out, r);
        }
        if (!st)
            st = tokenize_plain(srv, text, 0, out, r);
    }
    if (!st && sp->fim_sep >= 0) {
        if (!ids_push(out, sp->fim_sep))
            return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory");
        st = tokenize_plain(srv, "filename\n", 0, out, r);
    }
    return st;
}

static int32_t clamp_take(int64_t want, size_t have)
{
    if (want < 0)
        want = 0;
    return (int32_t)(want < (int64_t)have ? want : (int64_t)have);
}

/* The whole infill prompt of root into *out. */
static ks_status infill_prompt(const struct server *srv, const cJSON *root, struct ids *out, struct reply *r)
{
    const struct tok_special *sp = tok_special(srv->tok);
    struct ids pre = {0}, suf = {0}, prompt = {0}, extra = {0};
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(root, "prompt");
    ks_status st = tokenize_mixed(srv, cJSON_GetObjectItemCaseSensitive(root, "input_prefix"), "input_prefix", &pre, r);
    if (!st)
        st = tokenize_mixed(srv, cJSON_GetObjectItemCaseSensitive(root, "input_suffix"), "input_suffix", &suf, r);
    if (!st && p)
        st = tokenize_plain(srv, p->valuestring, TOK_PARSE_SPECIAL, &prompt, r);
    if (!st)
        st = extra_tokens(srv, cJSON_GetObjectItemCaseSensitive(root, "input_extra"), &extra, r);
    if (!st) {
        int32_t n_pre = clamp_take(3 * (INFILL_BATCH / 4), pre.n);
        int32_t n_suf = clamp_take(INFILL_BATCH / 4 - (2 + (int64_t)prompt.n), suf.n);
        int32_t n_extra = clamp_take((int64_t)srv->cfg.ctx_size - INFILL_BATCH + 2, extra.n);
        const struct ids *first = srv->cfg.spm_infill ? &suf : &pre;
        bool ok = ids_append(out, extra.v + extra.n - n_extra, (size_t)n_extra);
        if (ok && sp->add_bos)
            ok = ids_push(out, sp->bos);
        for (int part = 0; ok && part < 2; part++) {
            bool is_pre = (first == &pre) == (part == 0);
            if (is_pre)
                ok = ids_push(out, sp->fim_pre) && ids_append(out, pre.v + pre.n - n_pre, (size_t)n_pre) &&
                     ids_append(out, prompt.v, prompt.n);
            else
                ok = ids_push(out, sp->fim_suf) && ids_append(out, suf.v, (size_t)n_suf);
        }
        if (!ok || !ids_push(out, sp->fim_mid))
            st = reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while building the infill prompt");
    }
    free(pre.v);
    free(suf.v);
    free(prompt.v);
    free(extra.v);
    return st;
}

/* root with its prompt replaced by ids and the infill fields removed, as text. */
static char *completion_body(cJSON *root, const struct ids *ids)
{
    static const char *const drop[] = {"input_prefix", "input_suffix", "input_extra", "prompt"};
    for (size_t i = 0; i < sizeof drop / sizeof *drop; i++)
        cJSON_DeleteItemFromObjectCaseSensitive(root, drop[i]);
    cJSON *arr = cJSON_AddArrayToObject(root, "prompt");
    for (size_t i = 0; arr && i < ids->n; i++)
        server_json_push(arr, cJSON_CreateNumber(ids->v[i]));
    return arr && !server_json_failed() ? cJSON_PrintUnformatted(root) : NULL;
}

ks_status server_route_infill(struct server *srv, const struct server_req *rq, struct reply *r)
{
    ks_status st = check_vocab(tok_special(srv->tok), r);
    if (st)
        return st;
    cJSON *root;
    if ((st = server_parse_object(rq->body, rq->len, false, &root, r)))
        return st;
    struct ids ids = {0};
    if (!(st = check_fields(root, r)))
        st = infill_prompt(srv, root, &ids, r);
    char *body = st ? NULL : completion_body(root, &ids);
    cJSON_Delete(root);
    free(ids.v);
    if (st)
        return st;
    if (!body)
        return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while building the infill request");
    struct server_req native = *rq;
    native.body = body;
    native.len = strlen(body);
    st = server_route_completion_native(srv, &native, r);
    free(body);
    return st;
}
