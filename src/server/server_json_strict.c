/* What cJSON lets through but a request body must not hold (issue 24): bytes
 * after the value, invalid UTF-8, \u0000 (cJSON cuts the string there, so the
 * model would see less than the client sent) and duplicate keys (cJSON keeps
 * the first, most parsers the last: two components could read two requests). */
#include "server/server_internal.h"

#include <stdlib.h>
#include <string.h>

/* Bytes of the valid UTF-8 sequence at s[0..n), 0 if it is not one. */
static size_t utf8_valid_len(const unsigned char *s, size_t n)
{
    unsigned char b = s[0];
    size_t len = b < 0x80 ? 1 : (b & 0xE0) == 0xC0 ? 2 : (b & 0xF0) == 0xE0 ? 3 : (b & 0xF8) == 0xF0 ? 4 : 0;
    if (!len || len > n)
        return 0;
    uint32_t cp = len == 1 ? b : len == 2 ? b & 0x1Fu : len == 3 ? b & 0x0Fu : b & 0x07u;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return 0;
        cp = cp << 6 | (s[i] & 0x3Fu);
    }
    static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min_cp[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
        return 0; /* overlong, past Unicode, or a surrogate */
    return len;
}

/* The 400 of a refused body (into r; r NULL: only the status). */
#define REFUSE(r, ...) ((r) ? reply_fail((r), KS_ERR_INVALID_ARG, "invalid_json", __VA_ARGS__) : KS_ERR_INVALID_ARG)

static bool is_hex_zero4(const char *s, size_t left) { return left >= 4 && !memcmp(s, "0000", 4); }

/* The raw text [0, n): valid UTF-8 and no \u0000 inside a string. */
static ks_status check_text(const char *body, size_t n, struct reply *r)
{
    bool in_string = false;
    for (size_t i = 0; i < n;) {
        size_t len = utf8_valid_len((const unsigned char *)body + i, n - i);
        if (!len)
            return REFUSE(r, "the body is not valid UTF-8 (at byte %zu)", i);
        if (len == 1 && body[i] == '"') {
            in_string = !in_string;
        } else if (in_string && body[i] == '\\' && i + 1 < n) {
            if (body[i + 1] == 'u' && is_hex_zero4(body + i + 2, n - i - 2))
                return REFUSE(r, "the body holds \\u0000 in a string (at byte %zu); NUL characters are not accepted", i);
            i += 2; /* the escaped character, never a closing quote */
            continue;
        }
        i += len;
    }
    return KS_OK;
}

static int cmp_key(const void *a, const void *b)
{
    return strcmp((*(const cJSON *const *)a)->string, (*(const cJSON *const *)b)->string);
}

/* A key that an object of v (or below) holds twice, NULL if none; *oom on a failed allocation. */
static const char *duplicate_key(const cJSON *v, bool *oom)
{
    if (!cJSON_IsObject(v) && !cJSON_IsArray(v))
        return NULL;
    int n = cJSON_GetArraySize(v);
    const char *dup = NULL;
    if (cJSON_IsObject(v) && n > 1) {
        const cJSON **keys = malloc((size_t)n * sizeof *keys);
        if (!keys)
            return *oom = true, NULL;
        int k = 0;
        for (const cJSON *c = v->child; c; c = c->next)
            keys[k++] = c;
        qsort(keys, (size_t)k, sizeof *keys, cmp_key);
        for (int i = 1; i < k && !dup; i++)
            if (!strcmp(keys[i]->string, keys[i - 1]->string))
                dup = keys[i]->string;
        free(keys);
    }
    for (const cJSON *c = v->child; c && !dup && !*oom; c = c->next)
        dup = duplicate_key(c, oom);
    return dup;
}

ks_status server_json_strict(const char *body, size_t len, const char *end, const cJSON *root, struct reply *r)
{
    size_t used = end ? (size_t)(end - body) : len;
    for (size_t i = used; i < len; i++)
        if (!strchr(" \t\r\n", body[i]))
            return REFUSE(r, "the body has bytes after its JSON value (at byte %zu)", i);
    ks_status st = check_text(body, used, r);
    if (st)
        return st;
    bool oom = false;
    const char *dup = duplicate_key(root, &oom);
    if (oom)
        return r ? reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while checking the request body") : KS_ERR_NOMEM;
    if (dup)
        return REFUSE(r, "the body holds the key '%.200s' twice in one object", dup);
    return KS_OK;
}
