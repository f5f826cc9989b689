/* JSON: the built-in grammar of any JSON object, and JSON Schema (OpenAI's
 * strict subset) -> GBNF. Every generated grammar uses the same primitives
 * (string, number, ws, ...) so that what the model writes is JSON that cJSON
 * and any other parser read back: no lone surrogate escapes, no control
 * characters in strings, bounded whitespace and digit runs. */
#include "grammar/grammar.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "sbuf/sbuf.h"

/* Whitespace runs are at most 20 characters (as llama.cpp's json.gbnf) so a
 * model cannot loop in whitespace; a \u escape never names a surrogate. */
#define JSON_PRIMITIVES                                                                                        \
    "value   ::= object | array | string | number | \"true\" | \"false\" | \"null\"\n"                             \
    "object  ::= \"{\" ws ( string ws \":\" ws value ws ( \",\" ws string ws \":\" ws value ws )* )? \"}\"\n"      \
    "array   ::= \"[\" ws ( value ws ( \",\" ws value ws )* )? \"]\"\n"                                          \
    "string  ::= \"\\\"\" char* \"\\\"\"\n"                                                                    \
    "char    ::= [^\"\\\\\\x7F\\x00-\\x1F] | \"\\\\\" ( [\"\\\\/bfnrt] | \"u\" hex4 )\n"                          \
    "hex4    ::= [0-9a-cA-Ce-fE-F] [0-9a-fA-F]{3} | [dD] [0-7] [0-9a-fA-F]{2}\n"                                 \
    "integer ::= \"-\"? ( \"0\" | [1-9] [0-9]{0,15} )\n"                                                       \
    "number  ::= integer ( \".\" [0-9]{1,16} )? ( [eE] [-+]? [0-9]{1,3} )?\n"                                 \
    "boolean ::= \"true\" | \"false\"\n"                                                                       \
    "null    ::= \"null\"\n"                                                                                   \
    "ws      ::= [ \\t\\n]{0,20}\n"

static const char json_object_gbnf[] = "root    ::= object\n" JSON_PRIMITIVES;

const char *grammar_json_object_gbnf(void)
{
    return json_object_gbnf;
}

/* ---- JSON Schema -> GBNF ---------------------------------------------------------- */

/* Rule names: a prefix of at most RULE_PREFIX - 1 bytes, then rN. */
enum { RULE_PREFIX = 64, RULE_NAME = RULE_PREFIX + 16 };

struct conv {
    const cJSON *root;
    struct sbuf out;
    int n_rules;
    char path[512];      /* JSON pointer of the schema being converted, for errors */
    const cJSON *defs[256];
    char def_rule[256][RULE_NAME];
    char pre[RULE_PREFIX]; /* prefix of every rule name ("" alone, "NAME-" composed) */
    int n_defs;
    int depth;
    ks_status err;
};

__attribute__((format(printf, 3, 4))) static ks_status conv_fail(struct conv *c, ks_status st, const char *fmt, ...)
{
    if (c->err)
        return c->err;
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    c->err = ks_fail(st, "json_schema: %s at %s", msg, c->path[0] ? c->path : "/ (the root)");
    return c->err;
}

/* A GBNF literal for bytes s[0..n) (UTF-8 passes through). */
static void put_literal(struct sbuf *b, const char *s, size_t n)
{
    sbuf_puts(b, "\"");
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch == '"' || ch == '\\') {
            char e[2] = {'\\', (char)ch};
            sbuf_append(b, e, 2);
        } else if (ch < 0x20 || ch == 0x7F) {
            sbuf_printf(b, "\\x%02X", ch);
        } else {
            sbuf_append(b, (const char *)&ch, 1);
        }
    }
    sbuf_puts(b, "\"");
}

/* The literal of a JSON value as cJSON prints it. */
static bool put_json_literal(struct conv *c, const cJSON *v)
{
    char *txt = cJSON_PrintUnformatted(v);
    if (!txt)
        return conv_fail(c, KS_ERR_NOMEM, "out of memory"), false;
    put_literal(&c->out, txt, strlen(txt));
    cJSON_free(txt);
    return true;
}

static const char *const allowed_keys[] = {
    "type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems", "minLength",
    "maxLength", "enum", "const", "anyOf", "$defs", "definitions", "$ref", "format", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum",
    /* annotations */
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "strict", NULL,
};

static bool key_allowed(const char *k)
{
    for (int i = 0; allowed_keys[i]; i++)
        if (!strcmp(allowed_keys[i], k))
            return true;
    return false;
}

static int new_rule(struct conv *c)
{
    return ++c->n_rules;
}

static bool gen(struct conv *c, const cJSON *s, char *name, size_t cap);

/* Descend into a sub-schema with path suffix; name receives its rule. */
static bool gen_at(struct conv *c, const cJSON *s, const char *suffix, char *name, size_t cap)
{
    size_t len = strlen(c->path);
    snprintf(c->path + len, sizeof c->path - len, "%s", suffix);
    bool ok = gen(c, s, name, cap);
    if (ok)
        c->path[len] = 0;
    return ok;
}

static bool get_count(struct conv *c, const cJSON *s, const char *key, int *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(s, key);
    if (!v)
        return true;
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || v->valuedouble < 0 ||
        v->valuedouble > GRAMMAR_MAX_REPEAT)
        return conv_fail(c, KS_ERR_INVALID_ARG, "'%s' must be an integer in [0, %d]", key, GRAMMAR_MAX_REPEAT), false;
    *out = (int)v->valuedouble;
    return true;
}

/* x{lo,hi} with hi < 0 meaning no upper bound. */
static void put_repeat(struct sbuf *b, int lo, int hi)
{
    if (hi < 0)
        sbuf_printf(b, "{%d,}", lo);
    else
        sbuf_printf(b, "{%d,%d}", lo, hi);
}

static bool gen_object(struct conv *c, const cJSON *s, int id)
{
    const cJSON *props = cJSON_GetObjectItemCaseSensitive(s, "properties");
    const cJSON *req = cJSON_GetObjectItemCaseSensitive(s, "required");
    const cJSON *addl = cJSON_GetObjectItemCaseSensitive(s, "additionalProperties");
    if (props && !cJSON_IsObject(props))
        return conv_fail(c, KS_ERR_INVALID_ARG, "'properties' must be an object"), false;
    if (req && !cJSON_IsArray(req))
        return conv_fail(c, KS_ERR_INVALID_ARG, "'required' must be an array of property names"), false;
    if (addl && !cJSON_IsFalse(addl))
        return conv_fail(c, KS_ERR_UNSUPPORTED,
                         "'additionalProperties' other than false is not supported (strict schemas set it to false)"),
               false;
    int n = props ? cJSON_GetArraySize(props) : 0;
    if (n == 0 && !addl) { /* {"type":"object"}: any object */
        sbuf_printf(&c->out, "%sr%d ::= object\n", c->pre, id);
        return true;
    }
    const cJSON *r;
    cJSON_ArrayForEach(r, req) {
        if (!cJSON_IsString(r))
            return conv_fail(c, KS_ERR_INVALID_ARG, "'required' must be an array of property names"), false;
        if (!cJSON_GetObjectItemCaseSensitive(props, r->valuestring))
            return conv_fail(c, KS_ERR_INVALID_ARG, "required property '%s' is not in 'properties'", r->valuestring),
                   false;
    }
    if (n == 0) {
        sbuf_printf(&c->out, "%sr%d ::= \"{\" ws \"}\"\n", c->pre, id);
        return true;
    }
    /* kv_i rules, then first_i / after_i as rules (first_{n} and after_{n} are empty) */
    int base = c->n_rules + 1;
    c->n_rules += 3 * n; /* kv, first, after per property: r{base+3i}, r{base+3i+1}, r{base+3i+2} */
    int i = 0;
    const cJSON *p;
    cJSON_ArrayForEach(p, props) {
        char vname[RULE_NAME];
        char suffix[300];
        snprintf(suffix, sizeof suffix, "/properties/%.250s", p->string);
        if (!gen_at(c, p, suffix, vname, sizeof vname))
            return false;
        sbuf_printf(&c->out, "%sr%d ::= ", c->pre, base + 3 * i);
        cJSON *key = cJSON_CreateString(p->string);
        if (!key)
            return conv_fail(c, KS_ERR_NOMEM, "out of memory"), false;
        bool ok = put_json_literal(c, key);
        cJSON_Delete(key);
        if (!ok)
            return false;
        sbuf_printf(&c->out, " ws \":\" ws %s\n", vname);
        i++;
    }
    i = 0;
    cJSON_ArrayForEach(p, props) {
        bool required = false;
        cJSON_ArrayForEach(r, req) if (!strcmp(r->valuestring, p->string)) required = true;
        int kv = base + 3 * i, first = kv + 1, after = kv + 2;
        bool last = i == n - 1;
        char next_after[RULE_NAME + 2] = "", next_first[RULE_NAME] = "";
        if (!last) {
            snprintf(next_after, sizeof next_after, " %sr%d", c->pre, after + 3);
            snprintf(next_first, sizeof next_first, "%sr%d", c->pre, first + 3);
        }
        if (required) {
            sbuf_printf(&c->out, "%sr%d ::= %sr%d%s\n", c->pre, first, c->pre, kv, next_after);
            sbuf_printf(&c->out, "%sr%d ::= ws \",\" ws %sr%d%s\n", c->pre, after, c->pre, kv, next_after);
        } else {
            if (last)
                sbuf_printf(&c->out, "%sr%d ::= ( %sr%d )?\n", c->pre, first, c->pre, kv);
            else
                sbuf_printf(&c->out, "%sr%d ::= %sr%d%s | %s\n", c->pre, first, c->pre, kv, next_after, next_first);
            sbuf_printf(&c->out, "%sr%d ::= ( ws \",\" ws %sr%d )?%s\n", c->pre, after, c->pre, kv, next_after);
        }
        i++;
    }
    sbuf_printf(&c->out, "%sr%d ::= \"{\" ws %sr%d ws \"}\"\n", c->pre, id, c->pre, base + 1);
    return true;
}

static bool gen_array(struct conv *c, const cJSON *s, int id)
{
    const cJSON *items = cJSON_GetObjectItemCaseSensitive(s, "items");
    int lo = 0, hi = -1;
    if (!get_count(c, s, "minItems", &lo) || !get_count(c, s, "maxItems", &hi))
        return false;
    if (hi >= 0 && hi < lo)
        return conv_fail(c, KS_ERR_INVALID_ARG, "'maxItems' is below 'minItems'"), false;
    char item[RULE_NAME] = "value";
    if (items && !gen_at(c, items, "/items", item, sizeof item))
        return false;
    if (hi == 0) {
        sbuf_printf(&c->out, "%sr%d ::= \"[\" ws \"]\"\n", c->pre, id);
        return true;
    }
    sbuf_printf(&c->out, "%sr%d ::= \"[\" ws %s%s ( ws \",\" ws %s )", c->pre, id, lo == 0 ? "( " : "", item, item);
    put_repeat(&c->out, lo > 0 ? lo - 1 : 0, hi > 0 ? hi - 1 : -1);
    sbuf_printf(&c->out, "%s ws \"]\"\n", lo == 0 ? " )?" : "");
    return true;
}

static bool gen_string(struct conv *c, const cJSON *s, int id)
{
    int lo = 0, hi = -1;
    if (!get_count(c, s, "minLength", &lo) || !get_count(c, s, "maxLength", &hi))
        return false;
    if (hi >= 0 && hi < lo)
        return conv_fail(c, KS_ERR_INVALID_ARG, "'maxLength' is below 'minLength'"), false;
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(s, "format");
    if (fmt && !cJSON_IsString(fmt))
        return conv_fail(c, KS_ERR_INVALID_ARG, "'format' must be a string"), false;
    const char *f = fmt ? fmt->valuestring : "";
    static const char date[] = "[0-9]{4} \"-\" ( \"0\" [1-9] | \"1\" [0-2] ) \"-\" ( \"0\" [1-9] | [12] [0-9] | \"3\" [01] )";
    static const char time[] = "( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] \":\" [0-5] [0-9] ( \".\" [0-9]{1,6} )? "
                               "( \"Z\" | [+-] ( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] )";
    if (!strcmp(f, "date"))
        sbuf_printf(&c->out, "%sr%d ::= \"\\\"\" %s \"\\\"\"\n", c->pre, id, date);
    else if (!strcmp(f, "time"))
        sbuf_printf(&c->out, "%sr%d ::= \"\\\"\" %s \"\\\"\"\n", c->pre, id, time);
    else if (!strcmp(f, "date-time"))
        sbuf_printf(&c->out, "%sr%d ::= \"\\\"\" %s \"T\" %s \"\\\"\"\n", c->pre, id, date, time);
    else if (!strcmp(f, "uuid"))
        sbuf_printf(&c->out,
                    "%sr%d ::= \"\\\"\" [0-9a-fA-F]{8} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{4} "
                    "\"-\" [0-9a-fA-F]{12} \"\\\"\"\n",
                    c->pre, id);
    else if (lo == 0 && hi < 0)
        sbuf_printf(&c->out, "%sr%d ::= string\n", c->pre, id);
    else {
        sbuf_printf(&c->out, "%sr%d ::= \"\\\"\" char", c->pre, id);
        put_repeat(&c->out, lo, hi);
        sbuf_puts(&c->out, " \"\\\"\"\n");
    }
    return true;
}

/* ---- integer ranges --------------------------------------------------------------- */

/* The integer primitive writes at most 16 digits; bounds beyond are clamped. */
#define INT_LIMIT 9999999999999999LL

/* Decimal digits of v >= 0, NUL-terminated; their count. */
static int digits_of(long long v, char *d)
{
    return snprintf(d, 24, "%lld", v);
}

/* Equal-length digit strings a <= b (n digits, a may start with 0 only
 * inside a longer number): one GBNF expression matching every string of n
 * digits from a to b. */
static void put_digit_range(struct sbuf *b, const char *lo, const char *hi, int n)
{
    if (n == 0)
        return;
    if (lo[0] == hi[0]) {
        sbuf_printf(b, "\"%c\" ", lo[0]);
        put_digit_range(b, lo + 1, hi + 1, n - 1);
        return;
    }
    bool lo_zeros = strspn(lo + 1, "0") == (size_t)(n - 1), hi_nines = strspn(hi + 1, "9") == (size_t)(n - 1);
    sbuf_puts(b, "( ");
    char first_lo = lo_zeros ? lo[0] : (char)(lo[0] + 1), first_hi = hi_nines ? hi[0] : (char)(hi[0] - 1);
    bool sep = false;
    if (!lo_zeros) { /* lo[0] followed by lo's tail .. 99..9 */
        char nines[24];
        memset(nines, '9', (size_t)n - 1);
        sbuf_printf(b, "\"%c\" ", lo[0]);
        put_digit_range(b, lo + 1, nines, n - 1);
        sep = true;
    }
    if (first_lo <= first_hi) { /* whole blocks: [x-y] then any n - 1 digits */
        sbuf_printf(b, "%s[%c-%c]", sep ? "| " : "", first_lo, first_hi);
        if (n > 1)
            sbuf_printf(b, " [0-9]{%d}", n - 1);
        sbuf_puts(b, " ");
        sep = true;
    }
    if (!hi_nines) { /* hi[0] followed by 00..0 .. hi's tail */
        char zeros[24];
        memset(zeros, '0', (size_t)n - 1);
        sbuf_printf(b, "%s\"%c\" ", sep ? "| " : "", hi[0]);
        put_digit_range(b, zeros, hi + 1, n - 1);
    }
    sbuf_puts(b, ") ");
}

/* Canonical decimals (no leading zero) of every integer in [lo, hi], 0 <= lo <= hi. */
static void put_uint_range(struct sbuf *b, long long lo, long long hi)
{
    sbuf_puts(b, "( ");
    long long start = lo, pow10 = 1;
    int len = 1;
    while (pow10 * 10 <= lo) {
        pow10 *= 10;
        len++;
    }
    for (bool first = true; start <= hi; first = false, len++, pow10 *= 10) {
        long long top = pow10 > INT_LIMIT / 10 ? INT_LIMIT : pow10 * 10 - 1; /* largest of len digits */
        long long end = hi < top ? hi : top;
        char a[24], z[24];
        digits_of(start, a);
        digits_of(end, z);
        if (!first)
            sbuf_puts(b, "| ");
        put_digit_range(b, a, z, len);
        start = end + 1;
    }
    sbuf_puts(b, ") ");
}

/* A bound of an integer schema: minimum/maximum as given, the exclusive
 * ones moved to the next integer inside; false when it is not a number. */
static bool int_bound(struct conv *c, const cJSON *s, const char *key, bool upper, bool exclusive, long long *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(s, key);
    if (!v)
        return true;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble))
        return conv_fail(c, KS_ERR_INVALID_ARG, "'%s' must be a number", key), false;
    double x = v->valuedouble;
    double r = upper ? (exclusive ? ceil(x) - 1 : floor(x)) : (exclusive ? floor(x) + 1 : ceil(x));
    r = r > (double)INT_LIMIT ? (double)INT_LIMIT : r < -(double)INT_LIMIT ? -(double)INT_LIMIT : r;
    if (upper ? r < (double)*out : r > (double)*out)
        *out = (long long)r;
    return true;
}

/* An integer within minimum/maximum/exclusiveMinimum/exclusiveMaximum, as
 * llama.cpp's schema converter does for integers: the digits themselves are
 * constrained, so no out-of-range number can be written. */
static bool gen_int_range(struct conv *c, const cJSON *s, int id)
{
    long long lo = -INT_LIMIT, hi = INT_LIMIT;
    if (!int_bound(c, s, "minimum", false, false, &lo) || !int_bound(c, s, "exclusiveMinimum", false, true, &lo) ||
        !int_bound(c, s, "maximum", true, false, &hi) || !int_bound(c, s, "exclusiveMaximum", true, true, &hi))
        return false;
    if (lo > hi)
        return conv_fail(c, KS_ERR_INVALID_ARG, "no integer lies within the schema's bounds"), false;
    sbuf_printf(&c->out, "%sr%d ::= ", c->pre, id);
    if (lo < 0) { /* -m for m in [max(1, -hi), -lo] */
        sbuf_puts(&c->out, "\"-\" ");
        put_uint_range(&c->out, hi < 0 ? -hi : 1, -lo);
    }
    if (hi >= 0) {
        if (lo < 0)
            sbuf_puts(&c->out, "| ");
        put_uint_range(&c->out, lo > 0 ? lo : 0, hi);
    }
    sbuf_puts(&c->out, "\n");
    return true;
}

static bool has_bounds(const cJSON *s)
{
    return cJSON_GetObjectItemCaseSensitive(s, "minimum") || cJSON_GetObjectItemCaseSensitive(s, "maximum") ||
           cJSON_GetObjectItemCaseSensitive(s, "exclusiveMinimum") ||
           cJSON_GetObjectItemCaseSensitive(s, "exclusiveMaximum");
}

/* One JSON type by name. */
static bool gen_type(struct conv *c, const cJSON *s, const char *t, int id)
{
    if (!strcmp(t, "integer") && has_bounds(s))
        return gen_int_range(c, s, id);
    if (!strcmp(t, "number") && has_bounds(s))
        return conv_fail(c, KS_ERR_UNSUPPORTED,
                         "'minimum'/'maximum' bound integers only (a number's bounds are not supported; use "
                         "\"type\": \"integer\" or leave the bounds out)"),
               false;
    if (!strcmp(t, "object"))
        return gen_object(c, s, id);
    if (!strcmp(t, "array"))
        return gen_array(c, s, id);
    if (!strcmp(t, "string"))
        return gen_string(c, s, id);
    if (!strcmp(t, "number") || !strcmp(t, "integer") || !strcmp(t, "boolean") || !strcmp(t, "null")) {
        sbuf_printf(&c->out, "%sr%d ::= %s\n", c->pre, id, t);
        return true;
    }
    return conv_fail(c, KS_ERR_INVALID_ARG,
                     "unknown type '%s' (object, array, string, number, integer, boolean, null)", t), false;
}

static bool gen_ref(struct conv *c, const char *ref, char *name, size_t cap)
{
    if (!strcmp(ref, "#")) {
        snprintf(name, cap, "%sr1", c->pre);
        return true;
    }
    const char *key = NULL, *rest = NULL;
    if (!strncmp(ref, "#/$defs/", 8)) {
        key = "$defs";
        rest = ref + 8;
    } else if (!strncmp(ref, "#/definitions/", 14)) {
        key = "definitions";
        rest = ref + 14;
    } else {
        return conv_fail(c, KS_ERR_UNSUPPORTED,
                         "$ref '%.200s' is not supported (only \"#\", \"#/$defs/NAME\" and \"#/definitions/NAME\")", ref),
               false;
    }
    const cJSON *defs = cJSON_GetObjectItemCaseSensitive(c->root, key);
    const cJSON *target = cJSON_IsObject(defs) ? cJSON_GetObjectItemCaseSensitive(defs, rest) : NULL;
    if (!target)
        return conv_fail(c, KS_ERR_INVALID_ARG, "$ref '%.200s' names no schema", ref), false;
    for (int i = 0; i < c->n_defs; i++)
        if (c->defs[i] == target) {
            snprintf(name, cap, "%s", c->def_rule[i]);
            return true;
        }
    if (c->n_defs == 256)
        return conv_fail(c, KS_ERR_UNSUPPORTED, "more than 256 referenced definitions"), false;
    int id = new_rule(c), k = c->n_defs++;
    c->defs[k] = target;
    snprintf(c->def_rule[k], sizeof c->def_rule[k], "%sr%d", c->pre, id);
    snprintf(name, cap, "%sr%d", c->pre, id);
    /* the definition's rule is reserved before its body, so it may refer to itself */
    char body[RULE_NAME], saved[512];
    memcpy(saved, c->path, sizeof saved);
    snprintf(c->path, sizeof c->path, "/%s/%.400s", key, rest);
    if (!gen(c, target, body, sizeof body))
        return false;
    memcpy(c->path, saved, sizeof saved);
    sbuf_printf(&c->out, "%sr%d ::= %s\n", c->pre, id, body);
    return true;
}

/* Emit a rule for schema s; its name goes to name. */
static bool gen(struct conv *c, const cJSON *s, char *name, size_t cap)
{
    if (++c->depth > 64) {
        conv_fail(c, KS_ERR_UNSUPPORTED, "schema nested deeper than 64 levels");
        return false;
    }
    bool ok = false;
    int id = new_rule(c);
    snprintf(name, cap, "%sr%d", c->pre, id);
    if (cJSON_IsTrue(s)) {
        sbuf_printf(&c->out, "%sr%d ::= value\n", c->pre, id);
        ok = true;
        goto out;
    }
    if (!cJSON_IsObject(s)) {
        conv_fail(c, KS_ERR_INVALID_ARG, "a schema must be an object");
        goto out;
    }
    const cJSON *k;
    cJSON_ArrayForEach(k, s) {
        if (!key_allowed(k->string)) {
            conv_fail(c, KS_ERR_UNSUPPORTED,
                      "keyword '%.100s' is not supported (supported: type, properties, required, "
                      "additionalProperties false, items, minItems, maxItems, minLength, maxLength, enum, const, anyOf, "
                      "$defs, $ref, format, minimum/maximum on integers)",
                      k->string);
            goto out;
        }
    }
    const cJSON *ref = cJSON_GetObjectItemCaseSensitive(s, "$ref");
    const cJSON *en = cJSON_GetObjectItemCaseSensitive(s, "enum");
    const cJSON *cn = cJSON_GetObjectItemCaseSensitive(s, "const");
    const cJSON *any = cJSON_GetObjectItemCaseSensitive(s, "anyOf");
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(s, "type");
    if (ref) {
        char target[RULE_NAME];
        if (!cJSON_IsString(ref)) {
            conv_fail(c, KS_ERR_INVALID_ARG, "'$ref' must be a string");
            goto out;
        }
        if (!gen_ref(c, ref->valuestring, target, sizeof target))
            goto out;
        sbuf_printf(&c->out, "%sr%d ::= %s\n", c->pre, id, target);
    } else if (cn) {
        sbuf_printf(&c->out, "%sr%d ::= ", c->pre, id);
        if (!put_json_literal(c, cn))
            goto out;
        sbuf_puts(&c->out, "\n");
    } else if (en) {
        if (!cJSON_IsArray(en) || cJSON_GetArraySize(en) == 0) {
            conv_fail(c, KS_ERR_INVALID_ARG, "'enum' must be a non-empty array");
            goto out;
        }
        sbuf_printf(&c->out, "%sr%d ::= ", c->pre, id);
        const cJSON *v;
        bool first = true;
        cJSON_ArrayForEach(v, en) {
            if (!first)
                sbuf_puts(&c->out, " | ");
            first = false;
            if (!put_json_literal(c, v))
                goto out;
        }
        sbuf_puts(&c->out, "\n");
    } else if (any) {
        if (!cJSON_IsArray(any) || cJSON_GetArraySize(any) == 0) {
            conv_fail(c, KS_ERR_INVALID_ARG, "'anyOf' must be a non-empty array of schemas");
            goto out;
        }
        char alts[64][RULE_NAME];
        int n = 0;
        const cJSON *v;
        cJSON_ArrayForEach(v, any) {
            if (n == 64) {
                conv_fail(c, KS_ERR_UNSUPPORTED, "'anyOf' with more than 64 schemas");
                goto out;
            }
            char suffix[32];
            snprintf(suffix, sizeof suffix, "/anyOf/%d", n);
            if (!gen_at(c, v, suffix, alts[n], sizeof alts[n]))
                goto out;
            n++;
        }
        sbuf_printf(&c->out, "%sr%d ::= ", c->pre, id);
        for (int i = 0; i < n; i++)
            sbuf_printf(&c->out, "%s%s", i ? " | " : "", alts[i]);
        sbuf_puts(&c->out, "\n");
    } else if (cJSON_IsString(type)) {
        if (!gen_type(c, s, type->valuestring, id))
            goto out;
    } else if (cJSON_IsArray(type) && cJSON_GetArraySize(type) > 0) {
        int n = cJSON_GetArraySize(type), base = c->n_rules + 1;
        c->n_rules += n;
        const cJSON *t;
        int i = 0;
        cJSON_ArrayForEach(t, type) {
            if (!cJSON_IsString(t)) {
                conv_fail(c, KS_ERR_INVALID_ARG, "'type' must be a string or an array of strings");
                goto out;
            }
            if (!gen_type(c, s, t->valuestring, base + i))
                goto out;
            i++;
        }
        sbuf_printf(&c->out, "%sr%d ::= ", c->pre, id);
        for (i = 0; i < n; i++)
            sbuf_printf(&c->out, "%s%sr%d", i ? " | " : "", c->pre, base + i);
        sbuf_puts(&c->out, "\n");
    } else if (type) {
        conv_fail(c, KS_ERR_INVALID_ARG, "'type' must be a string or an array of strings");
        goto out;
    } else if (has_bounds(s)) {
        conv_fail(c, KS_ERR_UNSUPPORTED, "'minimum'/'maximum' need \"type\": \"integer\"");
        goto out;
    } else {
        sbuf_printf(&c->out, "%sr%d ::= value\n", c->pre, id);
    }
    ok = true;
out:
    c->depth--;
    return ok;
}

/* The rules of schema[0..len) into out: `name ::= <its top rule>` and the
 * rules it needs, each named with prefix pre. */
static ks_status schema_rules(const char *schema, size_t len, const char *name, const char *pre, struct sbuf *out)
{
    cJSON *root = cJSON_ParseWithLength(schema, len);
    if (!root)
        return ks_fail(KS_ERR_FORMAT, "json_schema: the schema is not valid JSON");
    struct conv *c = calloc(1, sizeof *c);
    if (!c) {
        cJSON_Delete(root);
        return ks_fail(KS_ERR_NOMEM, "json_schema: out of memory");
    }
    c->root = root;
    snprintf(c->pre, sizeof c->pre, "%s", pre);
    sbuf_printf(&c->out, "%s ::= %sr1\n", name, c->pre);
    char top[RULE_NAME];
    ks_status st = KS_OK;
    if (!gen(c, root, top, sizeof top))
        st = c->err ? c->err : ks_fail(KS_ERR_INTERNAL, "json_schema: conversion failed");
    if (!st && c->out.oom)
        st = ks_fail(KS_ERR_NOMEM, "json_schema: out of memory");
    if (!st)
        sbuf_append(out, c->out.p, c->out.n);
    sbuf_free(&c->out);
    cJSON_Delete(root);
    free(c);
    return st;
}

ks_status grammar_from_json_schema(const char *schema, size_t len, char **gbnf)
{
    if (!schema || !gbnf)
        return ks_fail(KS_ERR_INVALID_ARG, "grammar_from_json_schema: NULL argument");
    struct sbuf out = {0};
    ks_status st = schema_rules(schema, len, "root", "", &out);
    if (!st) { /* (an append that failed in schema_rules leaves out.oom set too) */
        sbuf_puts(&out, JSON_PRIMITIVES);
        if (out.oom)
            st = ks_fail(KS_ERR_NOMEM, "json_schema: out of memory");
    }
    if (st) {
        sbuf_free(&out);
        return st;
    }
    *gbnf = out.p;
    return KS_OK;
}

const char *grammar_json_primitives_gbnf(void)
{
    return JSON_PRIMITIVES;
}

static bool rule_name_ok(const char *name)
{
    size_t n = strlen(name);
    if (n == 0 || n > RULE_PREFIX - 2)
        return false;
    for (size_t i = 0; i < n; i++)
        if (!((name[i] >= 'a' && name[i] <= 'z') || (name[i] >= 'A' && name[i] <= 'Z') ||
              (name[i] >= '0' && name[i] <= '9') || name[i] == '_'))
            return false;
    return true;
}

ks_status grammar_json_schema_rules(const char *schema, size_t len, const char *name, char **gbnf)
{
    if (!schema || !name || !gbnf)
        return ks_fail(KS_ERR_INVALID_ARG, "grammar_json_schema_rules: NULL argument");
    if (!rule_name_ok(name))
        return ks_fail(KS_ERR_INVALID_ARG, "grammar_json_schema_rules: rule name '%.80s' must be 1 to %d of [A-Za-z0-9_]",
                       name, RULE_PREFIX - 2);
    char pre[RULE_PREFIX];
    snprintf(pre, sizeof pre, "%s-", name);
    struct sbuf out = {0};
    ks_status st = schema_rules(schema, len, name, pre, &out);
    if (!st && out.oom)
        st = ks_fail(KS_ERR_NOMEM, "json_schema: out of memory");
    if (st) {
        sbuf_free(&out);
        return st;
    }
    *gbnf = out.p;
    return KS_OK;
}
