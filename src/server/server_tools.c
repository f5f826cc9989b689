/* Tool calls in a model's output, in the formats the corpus templates teach
 * (llama.cpp's common/chat.cpp parses the same ones):
 *   hermes   <tool_call>{"name": N, "arguments": {...}}</tool_call>, repeated
 *            (Hermes 2 Pro / 3, Qwen 2.5 / 3, QwQ, SmolLM3, ...)
 *   llama3   {"name": N, "parameters": {...}} (optionally "type": "function"
 *            first), or <|python_tag|> then such an object, or code (a call
 *            of "python" with {"code": ...}); calls may be separated by ';'
 *   mistral  [TOOL_CALLS] [{"name": N, "arguments": {...}}, ...]
 *   generic  the whole output one JSON object: {"tool_calls": [{"name",
 *            "arguments"}, ...]}, {"tool_call": {...}} or {"response": TEXT}
 * The parse is a pure function of the text so far: text before the first
 * call marker is content (less a tail that may still become a marker, held
 * back as stop strings are), calls count once their JSON is complete, and a
 * final parse turns whatever does not parse into content. */
#include "server/server_internal.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum server_tool_format server_tool_format_detect(const char *tmpl, size_t len)
{
    if (!tmpl)
        return SERVER_TOOLS_GENERIC;
    if (memmem(tmpl, len, "[TOOL_CALLS]", 12))
        return SERVER_TOOLS_MISTRAL;
    if (memmem(tmpl, len, "<tool_call>", 11))
        return SERVER_TOOLS_HERMES;
    if (memmem(tmpl, len, "<|start_header_id|>ipython<|end_header_id|>", 43) || memmem(tmpl, len, "<|python_tag|>", 14))
        return SERVER_TOOLS_LLAMA3;
    return SERVER_TOOLS_GENERIC;
}

const char *server_tool_format_name(enum server_tool_format f)
{
    static const char *const names[] = {"none", "hermes", "llama3", "mistral", "generic", "harmony"};
    return (unsigned)f < sizeof names / sizeof names[0] ? names[f] : "?";
}

void server_tool_result_free(struct server_tool_result *r)
{
    for (int i = 0; i < r->n_calls; i++) {
        free(r->calls[i].name);
        free(r->calls[i].arguments);
    }
    free(r->calls);
    free(r->response);
    memset(r, 0, sizeof *r);
}

/* ---- helpers ------------------------------------------------------------------------- */

static size_t skip_ws(const char *s, size_t i, size_t n)
{
    while (i < n && isspace((unsigned char)s[i]))
        i++;
    return i;
}

/* Does s[0..n) start with lit, or (partial) is it a proper prefix of lit? 1 = whole, 2 = prefix, 0 = no. */
static int match_lit(const char *s, size_t n, const char *lit)
{
    size_t l = strlen(lit);
    if (n >= l)
        return memcmp(s, lit, l) == 0;
    return memcmp(s, lit, n) == 0 ? 2 : 0;
}

/* One JSON value at s[i..n): *end receives the index after it. NULL when it
 * does not parse there (incomplete or malformed). */
static cJSON *json_at(const char *s, size_t i, size_t n, size_t *end)
{
    const char *e = NULL;
    cJSON *v = cJSON_ParseWithLengthOpts(s + i, n - i, &e, false);
    if (v)
        *end = (size_t)(e - s);
    return v;
}

ks_status server_tool_call_append(struct server_tool_call **calls, int *n_calls, const char *name, char *raw)
{
    struct server_tool_call *p = realloc(*calls, (size_t)(*n_calls + 1) * sizeof *p);
    if (p)
        *calls = p;
    char *a = NULL, *nm = NULL;
    size_t len;
    bool ok = p && raw && !tok_utf8_sanitize(raw, strlen(raw), &a, &len) &&
              !tok_utf8_sanitize(name, strlen(name), &nm, &len);
    free(raw);
    if (!ok) {
        free(a);
        free(nm);
        return ks_fail(KS_ERR_NOMEM, "out of memory parsing tool calls");
    }
    (*calls)[(*n_calls)++] = (struct server_tool_call){nm, a};
    return KS_OK;
}

/* The arguments as JSON text: a string's own text, anything else compact,
 * none as {}. */
static ks_status add_call(struct server_tool_result *r, const char *name, const cJSON *args)
{
    char *raw = args ? (cJSON_IsString(args) ? strdup(args->valuestring) : cJSON_PrintUnformatted(args)) : strdup("{}");
    return server_tool_call_append(&r->calls, &r->n_calls, name, raw);
}

/* {"name": N, <args_key>: {...}} (args_key NULL: "arguments" or "parameters").
 * false when obj is not such a call. */
static bool call_parts(const cJSON *obj, const char **name, const cJSON **args)
{
    const cJSON *n = cJSON_GetObjectItemCaseSensitive(obj, "name");
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(obj, "arguments");
    if (!a)
        a = cJSON_GetObjectItemCaseSensitive(obj, "parameters");
    if (!cJSON_IsObject(obj) || !cJSON_IsString(n) || !n->valuestring[0] || (a && !cJSON_IsObject(a) && !cJSON_IsString(a)))
        return false;
    *name = n->valuestring;
    *args = a;
    return true;
}

/* ---- the formats: each finds the first marker and parses the calls after it ---------- */

/* Where a call starts at s[i..n): 1 a marker is there, 2 s[i..n) may still
 * become one, 0 no. */
typedef int (*marker_fn)(const char *s, size_t i, size_t n);

static int hermes_marker(const char *s, size_t i, size_t n)
{
    return match_lit(s + i, n - i, "<tool_call>");
}

static int mistral_marker(const char *s, size_t i, size_t n)
{
    return match_lit(s + i, n - i, "[TOOL_CALLS]");
}

/* {"name" or {"type" (whitespace allowed), or <|python_tag|>. */
static int llama3_marker(const char *s, size_t i, size_t n)
{
    int t = match_lit(s + i, n - i, "<|python_tag|>");
    if (t || s[i] != '{')
        return t;
    size_t j = skip_ws(s, i + 1, n);
    if (j == n)
        return 2;
    int a = match_lit(s + j, n - j, "\"name\""), b = match_lit(s + j, n - j, "\"type\"");
    return a == 1 || b == 1 ? 1 : a || b ? 2 : 0;
}

/* The whole output, when it starts with '{' (whitespace before it is held
 * too, so a {"response": ...} reply streams as its text alone). */
static int generic_marker(const char *s, size_t i, size_t n)
{
    if (skip_ws(s, 0, i) != i)
        return 0;
    if (s[i] == '{')
        return 1;
    return skip_ws(s, i, n) == n ? 2 : 0;
}

/* Parse the calls from s[i..n); *end the index after the last complete one.
 * Returns KS_OK with no calls when nothing parses. */
typedef ks_status (*calls_fn)(const char *s, size_t i, size_t n, bool final, struct server_tool_result *r,
                              size_t *end);

static ks_status hermes_calls(const char *s, size_t i, size_t n, bool final, struct server_tool_result *r,
                              size_t *end)
{
    (void)final;
    for (;;) {
        size_t j = skip_ws(s, i, n);
        if (hermes_marker(s, j, n) != 1)
            return KS_OK;
        size_t k = 0;
        cJSON *obj = json_at(s, j + 11, n, &k);
        const char *name;
        const cJSON *args;
        k = obj ? skip_ws(s, k, n) : n;
        bool ok = obj && call_parts(obj, &name, &args) && match_lit(s + k, n - k, "</tool_call>") == 1;
        ks_status st = ok ? add_call(r, name, args) : KS_OK;
        cJSON_Delete(obj);
        if (st || !ok)
            return st;
        i = *end = k + 12;
    }
}

static ks_status mistral_calls(const char *s, size_t i, size_t n, bool final, struct server_tool_result *r,
                               size_t *end)
{
    (void)final;
    size_t k = 0;
    cJSON *arr = json_at(s, skip_ws(s, i + 12, n), n, &k);
    if (!cJSON_IsArray(arr) || cJSON_GetArraySize(arr) == 0) {
        cJSON_Delete(arr);
        return KS_OK;
    }
    const cJSON *c;
    const char *name;
    const cJSON *args;
    cJSON_ArrayForEach(c, arr) if (!call_parts(c, &name, &args))
    {
        cJSON_Delete(arr);
        return KS_OK;
    }
    ks_status st = KS_OK;
    cJSON_ArrayForEach(c, arr) if (!st && call_parts(c, &name, &args)) st = add_call(r, name, args);
    cJSON_Delete(arr);
    if (!st)
        *end = k;
    return st;
}

static ks_status llama3_calls(const char *s, size_t i, size_t n, bool final, struct server_tool_result *r,
                              size_t *end)
{
    bool tag = match_lit(s + i, n - i, "<|python_tag|>") == 1;
    if (tag)
        i = skip_ws(s, i + 14, n);
    for (bool first = true;; first = false) {
        size_t j = skip_ws(s, i, n);
        if (!first && j < n && s[j] == ';')
            j = skip_ws(s, j + 1, n);
        size_t k = 0;
        cJSON *obj = j < n && s[j] == '{' ? json_at(s, j, n, &k) : NULL;
        const char *name;
        const cJSON *args;
        if (!obj || !call_parts(obj, &name, &args)) {
            cJSON_Delete(obj);
            /* <|python_tag|> followed by code: the python tool (llama.cpp's
             * reading of Llama 3.1's code interpreter), only once complete */
            if (first && tag && final && obj == NULL && j < n) {
                cJSON *code = cJSON_CreateObject();
                char *text = strndup(s + j, n - j);
                ks_status st = code && text && cJSON_AddStringToObject(code, "code", text)
                                   ? add_call(r, "python", code)
                                   : ks_fail(KS_ERR_NOMEM, "out of memory parsing tool calls");
                free(text);
                cJSON_Delete(code);
                if (!st)
                    *end = n;
                return st;
            }
            return KS_OK;
        }
        ks_status st = add_call(r, name, args);
        cJSON_Delete(obj);
        if (st)
            return st;
        i = *end = k;
    }
}

static ks_status generic_calls(const char *s, size_t i, size_t n, bool final, struct server_tool_result *r,
                               size_t *end)
{
    (void)final;
    size_t k = 0;
    cJSON *obj = json_at(s, i, n, &k);
    if (!cJSON_IsObject(obj) || skip_ws(s, k, n) != n) {
        cJSON_Delete(obj);
        return KS_OK;
    }
    const cJSON *calls = cJSON_GetObjectItemCaseSensitive(obj, "tool_calls");
    const cJSON *one = cJSON_GetObjectItemCaseSensitive(obj, "tool_call");
    const cJSON *c;
    const char *name;
    const cJSON *args;
    ks_status st = KS_OK;
    bool ok = false;
    if (cJSON_IsArray(calls) && cJSON_GetArraySize(calls) > 0) {
        ok = true;
        cJSON_ArrayForEach(c, calls) ok = ok && call_parts(c, &name, &args);
        cJSON_ArrayForEach(c, calls) if (ok && !st && call_parts(c, &name, &args)) st = add_call(r, name, args);
    } else if (one && call_parts(one, &name, &args)) {
        ok = true;
        st = add_call(r, name, args);
    }
    cJSON_Delete(obj);
    if (ok && !st)
        *end = n;
    return st;
}

static const struct {
    marker_fn marker;
    calls_fn calls;
} formats[] = {
    [SERVER_TOOLS_HERMES] = {hermes_marker, hermes_calls},
    [SERVER_TOOLS_LLAMA3] = {llama3_marker, llama3_calls},
    [SERVER_TOOLS_MISTRAL] = {mistral_marker, mistral_calls},
    [SERVER_TOOLS_GENERIC] = {generic_marker, generic_calls},
};

/* {"response": TEXT}: the generic format's plain answer. */
static ks_status generic_response(const char *s, size_t n, struct server_tool_result *r)
{
    size_t i = skip_ws(s, 0, n), k = 0;
    cJSON *obj = i < n && s[i] == '{' ? json_at(s, i, n, &k) : NULL;
    const cJSON *resp = cJSON_GetObjectItemCaseSensitive(obj, "response");
    if (cJSON_IsString(resp) && cJSON_GetArraySize(obj) == 1 && skip_ws(s, k, n) == n &&
        !(r->response = strdup(resp->valuestring))) {
        cJSON_Delete(obj);
        return ks_fail(KS_ERR_NOMEM, "out of memory parsing tool calls");
    }
    cJSON_Delete(obj);
    return KS_OK;
}

ks_status server_tools_parse(enum server_tool_format f, const char *s, size_t n, bool final,
                             struct server_tool_result *r)
{
    memset(r, 0, sizeof *r);
    r->content_end = n;
    r->tail_start = n;
    if (f <= SERVER_TOOLS_NONE || f > SERVER_TOOLS_GENERIC)
        return KS_OK;
    for (size_t i = 0; i < n; i++) {
        int m = formats[f].marker(s, i, n);
        if (!m)
            continue;
        if (m == 2) { /* may become a marker: hold it back, or at the end it is text */
            if (!final)
                r->content_end = i;
            return KS_OK;
        }
        size_t end = (size_t)-1;
        ks_status st = formats[f].calls(s, i, n, final, r, &end);
        if (st) {
            server_tool_result_free(r);
            return st;
        }
        if (r->n_calls == 0) {
            if (!final) { /* incomplete (or malformed: the end tells) */
                r->content_end = i;
                return KS_OK;
            }
            if (f == SERVER_TOOLS_GENERIC)
                return generic_response(s, n, r);
            continue; /* malformed: this marker is text; look further */
        }
        r->content_end = i;
        r->tail_start = final ? skip_ws(s, end, n) : n;
        if (!final && end < n) /* more may follow: what is after the calls waits for the end */
            r->tail_start = n;
        return KS_OK;
    }
    return KS_OK;
}
