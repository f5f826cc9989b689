/* server: POST /infill, llama-server's fill-in-the-middle route.
 *
 * The request names the text before and after the cursor (input_prefix,
 * input_suffix, each a string or a list of strings and token ids), optional
 * extra files (input_extra: [{"filename", "text"}]) and an optional prompt
 * that continues the prefix. The prompt is assembled exactly as llama-server
 * assembles it (tok_infill_prompt, which `kvserve route` keys the same way).
 * The result is a native /completion request on those token ids: same
 * fields, same response. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cJSON.h>

#include "server/server.h"
#include "server/server_internal.h"

/* input_prefix / input_suffix as parts: a string, or a list of strings and
 * token ids (llama-server's tokenize_mixed). *out is malloc'd. */
static ks_status parts_of(const struct server *srv, const cJSON *v, const char *name, struct tok_infill_part **out,
                          size_t *n, struct reply *r)
{
    *out = NULL;
    *n = 0;
    if (!cJSON_IsString(v) && !cJSON_IsArray(v))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type",
                          "'%s' must be a string or a list of strings and token ids", name);
    size_t count = cJSON_IsString(v) ? 1 : (size_t)cJSON_GetArraySize(v);
    struct tok_infill_part *p = calloc(count ? count : 1, sizeof *p);
    if (!p)
        return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while building the infill prompt");
    *out = p;
    if (cJSON_IsString(v)) {
        p[0].text = v->valuestring;
        *n = 1;
        return KS_OK;
    }
    int32_t n_vocab = tok_n_vocab(srv->tok);
    const cJSON *e;
    cJSON_ArrayForEach(e, v) {
        if (cJSON_IsString(e))
            p[*n].text = e->valuestring;
        else if (cJSON_IsNumber(e) && e->valuedouble == floor(e->valuedouble) && e->valuedouble >= 0 &&
                 e->valuedouble < n_vocab)
            p[*n].id = (int32_t)e->valuedouble;
        else
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                              "'%s'[%d] must be a string or a token id in [0, %d)", name, (int)*n, n_vocab);
        (*n)++;
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

/* The whole infill prompt of root (its fields checked) into *ids, *n. */
static ks_status infill_prompt(const struct server *srv, const cJSON *root, int32_t **ids, size_t *n,
                               struct reply *r)
{
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(root, "prompt");
    const cJSON *extra = cJSON_GetObjectItemCaseSensitive(root, "input_extra");
    struct tok_infill in = {.prompt = p ? p->valuestring : NULL, .n_ctx = srv->cfg.ctx_size,
                            .spm = srv->cfg.spm_infill};
    struct tok_infill_part *pre = NULL, *suf = NULL;
    struct tok_infill_file *files = calloc((size_t)cJSON_GetArraySize(extra) + 1, sizeof *files);
    ks_status st = files ? KS_OK : reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while building the infill prompt");
    if (!st)
        st = parts_of(srv, cJSON_GetObjectItemCaseSensitive(root, "input_prefix"), "input_prefix", &pre,
                      &in.n_prefix, r);
    if (!st)
        st = parts_of(srv, cJSON_GetObjectItemCaseSensitive(root, "input_suffix"), "input_suffix", &suf,
                      &in.n_suffix, r);
    const cJSON *chunk;
    cJSON_ArrayForEach(chunk, extra) {
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(chunk, "filename");
        if (files)
            files[in.n_files++] = (struct tok_infill_file){cJSON_IsString(name) ? name->valuestring : NULL,
                                                           cJSON_GetObjectItemCaseSensitive(chunk, "text")->valuestring};
    }
    in.prefix = pre;
    in.suffix = suf;
    in.files = files;
    if (!st && (st = tok_infill_prompt(srv->tok, &in, ids, n)))
        st = st == KS_ERR_NOMEM ? reply_fail(r, st, NULL, "out of memory while building the infill prompt")
                                : reply_fail(r, KS_ERR_INTERNAL, NULL, "tokenizer: %s", ks_errmsg());
    free(pre);
    free(suf);
    free(files);
    return st;
}

/* root with its prompt replaced by ids and the infill fields removed, as text. */
static char *completion_body(cJSON *root, const int32_t *ids, size_t n)
{
    static const char *const drop[] = {"input_prefix", "input_suffix", "input_extra", "prompt"};
    for (size_t i = 0; i < sizeof drop / sizeof *drop; i++)
        cJSON_DeleteItemFromObjectCaseSensitive(root, drop[i]);
    cJSON *arr = cJSON_AddArrayToObject(root, "prompt");
    for (size_t i = 0; arr && i < n; i++)
        server_json_push(arr, cJSON_CreateNumber(ids[i]));
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
    int32_t *ids = NULL;
    size_t n = 0;
    if (!(st = check_fields(root, r)))
        st = infill_prompt(srv, root, &ids, &n, r);
    char *body = st ? NULL : completion_body(root, ids, n);
    cJSON_Delete(root);
    free(ids);
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
