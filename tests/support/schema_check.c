/* See schema_check.h. */
#include "support/schema_check.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static size_t utf8_chars(const char *s)
{
    size_t n = 0;
    for (; *s; s++)
        n += ((unsigned char)*s & 0xC0) != 0x80;
    return n;
}

static bool validate(const cJSON *v, const cJSON *s, const cJSON *root, char *why, size_t cap);

static bool type_ok(const cJSON *v, const cJSON *s, const cJSON *root, const char *t, char *why, size_t cap)
{
    if (!strcmp(t, "null"))
        return cJSON_IsNull(v);
    if (!strcmp(t, "boolean"))
        return cJSON_IsBool(v);
    if (!strcmp(t, "number"))
        return cJSON_IsNumber(v);
    if (!strcmp(t, "integer"))
        return cJSON_IsNumber(v) && v->valuedouble == floor(v->valuedouble);
    if (!strcmp(t, "string")) {
        if (!cJSON_IsString(v))
            return false;
        const cJSON *mx = cJSON_GetObjectItem(s, "maxLength"), *mn = cJSON_GetObjectItem(s, "minLength");
        size_t n = utf8_chars(v->valuestring);
        if ((mx && n > (size_t)mx->valuedouble) || (mn && n < (size_t)mn->valuedouble)) {
            snprintf(why, cap, "string length %zu out of bounds", n);
            return false;
        }
        return true;
    }
    if (!strcmp(t, "array")) {
        if (!cJSON_IsArray(v))
            return false;
        const cJSON *mx = cJSON_GetObjectItem(s, "maxItems"), *items = cJSON_GetObjectItem(s, "items");
        if (mx && cJSON_GetArraySize(v) > (int)mx->valuedouble) {
            snprintf(why, cap, "too many items");
            return false;
        }
        const cJSON *e;
        cJSON_ArrayForEach(e, v) if (items && !validate(e, items, root, why, cap)) return false;
        return true;
    }
    if (!strcmp(t, "object")) {
        if (!cJSON_IsObject(v))
            return false;
        const cJSON *props = cJSON_GetObjectItem(s, "properties"), *req = cJSON_GetObjectItem(s, "required");
        const cJSON *r;
        cJSON_ArrayForEach(r, req) if (!cJSON_GetObjectItemCaseSensitive(v, r->valuestring)) {
            snprintf(why, cap, "required property '%s' missing", r->valuestring);
            return false;
        }
        int last = -1;
        const cJSON *m;
        cJSON_ArrayForEach(m, v) {
            int idx = 0;
            const cJSON *p;
            bool found = false;
            cJSON_ArrayForEach(p, props) {
                if (!strcmp(p->string, m->string)) {
                    found = true;
                    break;
                }
                idx++;
            }
            if (!found) {
                snprintf(why, cap, "property '%s' not in the schema", m->string);
                return false;
            }
            if (idx <= last) {
                snprintf(why, cap, "property '%s' out of the declared order (or repeated)", m->string);
                return false;
            }
            last = idx;
            if (!validate(m, cJSON_GetObjectItem(props, m->string), root, why, cap))
                return false;
        }
        return true;
    }
    snprintf(why, cap, "unknown type %s", t);
    return false;
}

/* Is v one of options (enum: equal to one; anyOf, by_schema: valid against one)? */
static bool matches_one(const cJSON *v, const cJSON *options, bool by_schema, const cJSON *root, char *why, size_t cap)
{
    const cJSON *e;
    bool any = false;
    cJSON_ArrayForEach(e, options) any |= by_schema ? validate(v, e, root, why, cap) : cJSON_Compare(v, e, true);
    return any;
}

static bool validate(const cJSON *v, const cJSON *s, const cJSON *root, char *why, size_t cap)
{
    const cJSON *ref = cJSON_GetObjectItem(s, "$ref");
    if (ref) {
        const char *name = ref->valuestring + strlen("#/$defs/");
        return validate(v, cJSON_GetObjectItem(cJSON_GetObjectItem(root, "$defs"), name), root, why, cap);
    }
    const cJSON *c = cJSON_GetObjectItem(s, "const");
    if (c && !cJSON_Compare(v, c, true)) {
        snprintf(why, cap, "not the const");
        return false;
    }
    const cJSON *en = cJSON_GetObjectItem(s, "enum");
    if (en && !matches_one(v, en, false, root, why, cap)) {
        snprintf(why, cap, "not in the enum");
        return false;
    }
    const cJSON *anyof = cJSON_GetObjectItem(s, "anyOf");
    if (anyof && !matches_one(v, anyof, true, root, why, cap)) {
        snprintf(why, cap, "matches no anyOf branch");
        return false;
    }
    const cJSON *type = cJSON_GetObjectItem(s, "type");
    if (cJSON_IsString(type) && !type_ok(v, s, root, type->valuestring, why, cap)) {
        if (!*why)
            snprintf(why, cap, "not of type %s", type->valuestring);
        return false;
    }
    if (cJSON_IsArray(type)) {
        const cJSON *t;
        bool any = false;
        cJSON_ArrayForEach(t, type) any |= type_ok(v, s, root, t->valuestring, why, cap);
        if (!any) {
            snprintf(why, cap, "of none of the types");
            return false;
        }
    }
    return true;
}

bool ks_schema_valid(const cJSON *v, const cJSON *schema, const cJSON *root, char *why, size_t cap)
{
    if (cap)
        why[0] = 0;
    return validate(v, schema, root, why, cap);
}
