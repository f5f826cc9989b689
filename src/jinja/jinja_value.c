/* jinja: values (constructors, truth, equality, order), how they print, and
 * JSON in (cJSON) and out (Python's json.dumps). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja/jinja_internal.h"

struct jv jv_undef_v = {.kind = JV_UNDEF};
struct jv jv_none_v = {.kind = JV_NONE};
struct jv jv_true_v = {.kind = JV_BOOL, .u.b = true};
struct jv jv_false_v = {.kind = JV_BOOL, .u.b = false};

/* ---- construction -------------------------------------------------------- */

struct jv *jv_str(struct jctx *cx, const char *p, size_t n)
{
    if (n > cx->opts.max_string)
        jx_fail(cx, KS_ERR_RANGE, "a string of %zu bytes is over the string limit of %zu bytes", n, cx->opts.max_string);
    jx_work(cx, n);
    struct jv *v = jx_alloc(cx, sizeof *v + n + 1);
    char *s = (char *)(v + 1);
    if (n)
        memcpy(s, p, n);
    v->kind = JV_STR;
    v->u.s.p = s;
    v->u.s.n = n;
    v->u.s.cap = n + 1;
    v->u.s.grow = true;
    return v;
}

struct jv *jv_concat(struct jctx *cx, struct jv *a, const char *b, size_t bn)
{
    size_t n = a->u.s.n + bn;
    if (bn > cx->opts.max_string || n > cx->opts.max_string)
        jx_fail(cx, KS_ERR_RANGE, "a string of %zu bytes is over the string limit of %zu bytes", n, cx->opts.max_string);
    jx_work(cx, bn);
    struct jv *v = jx_alloc(cx, sizeof *v);
    v->kind = JV_STR;
    v->u.s.n = n;
    v->u.s.grow = true;
    if (a->u.s.grow && a->u.s.cap >= n + 1) {
        /* the new string takes a's spare bytes; a keeps its n bytes */
        a->u.s.grow = false;
        v->u.s.p = a->u.s.p;
        v->u.s.cap = a->u.s.cap;
    } else {
        size_t cap = 2 * n + 1 > 64 ? 2 * n + 1 : 64;
        char *p = jx_alloc(cx, cap);
        memcpy(p, a->u.s.p, a->u.s.n);
        v->u.s.p = p;
        v->u.s.cap = cap;
    }
    char *w = (char *)v->u.s.p;
    if (bn)
        memcpy(w + a->u.s.n, b, bn);
    w[n] = 0;
    return v;
}

const char *jv_c_str(struct jctx *cx, const struct jv *v)
{
    if (!v->u.s.p[v->u.s.n])
        return v->u.s.p;
    char *c = jx_alloc(cx, v->u.s.n + 1);
    memcpy(c, v->u.s.p, v->u.s.n);
    return c;
}

struct jv *jv_cstr(struct jctx *cx, const char *s) { return jv_str(cx, s, strlen(s)); }

struct jv *jv_int(struct jctx *cx, int64_t i)
{
    struct jv *v = jx_alloc(cx, sizeof *v);
    v->kind = JV_INT;
    v->u.i = i;
    return v;
}

struct jv *jv_float(struct jctx *cx, double f)
{
    struct jv *v = jx_alloc(cx, sizeof *v);
    v->kind = JV_FLOAT;
    v->u.f = f;
    return v;
}

struct jv *jv_bool(bool b) { return b ? &jv_true_v : &jv_false_v; }

struct jv *jv_list(struct jctx *cx)
{
    struct jv *v = jx_alloc(cx, sizeof *v);
    v->kind = JV_LIST;
    return v;
}

struct jv *jv_walk_list(struct jctx *cx, struct jv *v)
{
    if (v->kind == JV_LIST)
        return v;
    if (v->kind != JV_DICT)
        return NULL;
    struct jv *l = jv_list(cx);
    for (size_t i = 0; i < v->u.d.n; i++)
        jv_list_push(cx, l, v->u.d.k[i]);
    return l;
}

struct jv *jv_dict(struct jctx *cx)
{
    struct jv *v = jx_alloc(cx, sizeof *v);
    v->kind = JV_DICT;
    return v;
}

static void **grow(struct jctx *cx, void **old, size_t n, size_t cap)
{
    void **nv = jx_alloc(cx, cap * sizeof *nv);
    if (n)
        memcpy(nv, old, n * sizeof *nv);
    return nv;
}

void jv_list_push(struct jctx *cx, struct jv *l, struct jv *v)
{
    if (l->u.l.n == l->u.l.cap) {
        size_t cap = l->u.l.cap ? l->u.l.cap * 2 : 4;
        l->u.l.v = (struct jv **)grow(cx, (void **)l->u.l.v, l->u.l.n, cap);
        l->u.l.cap = cap;
    }
    l->u.l.v[l->u.l.n++] = v;
}

struct jv *jv_dict_getv(const struct jv *d, const struct jv *key)
{
    for (size_t i = 0; i < d->u.d.n; i++)
        if (jv_equal(d->u.d.k[i], key))
            return d->u.d.v[i];
    return NULL;
}

struct jv *jv_dict_get(const struct jv *d, const char *key, size_t n)
{
    for (size_t i = 0; i < d->u.d.n; i++) {
        const struct jv *k = d->u.d.k[i];
        if (k->kind == JV_STR && k->u.s.n == n && !memcmp(k->u.s.p, key, n))
            return d->u.d.v[i];
    }
    return NULL;
}

void jv_dict_set(struct jctx *cx, struct jv *d, struct jv *k, struct jv *v)
{
    jx_work(cx, d->u.d.n);
    for (size_t i = 0; i < d->u.d.n; i++)
        if (jv_equal(d->u.d.k[i], k)) {
            d->u.d.v[i] = v;
            return;
        }
    if (d->u.d.n == d->u.d.cap) {
        size_t cap = d->u.d.cap ? d->u.d.cap * 2 : 4;
        d->u.d.k = (struct jv **)grow(cx, (void **)d->u.d.k, d->u.d.n, cap);
        d->u.d.v = (struct jv **)grow(cx, (void **)d->u.d.v, d->u.d.n, cap);
        d->u.d.cap = cap;
    }
    d->u.d.k[d->u.d.n] = k;
    d->u.d.v[d->u.d.n++] = v;
}

/* ---- truth, equality, order ---------------------------------------------- */

bool jv_truthy(const struct jv *v)
{
    switch (v->kind) {
    case JV_UNDEF: case JV_NONE: return false;
    case JV_BOOL: return v->u.b;
    case JV_INT: return v->u.i != 0;
    case JV_FLOAT: return v->u.f != 0.0;
    case JV_STR: return v->u.s.n != 0;
    case JV_LIST: return v->u.l.n != 0;
    case JV_DICT: return v->u.d.n != 0;
    default: return true;
    }
}

static bool is_num(const struct jv *v) { return v->kind == JV_INT || v->kind == JV_FLOAT || v->kind == JV_BOOL; }
static double num_of(const struct jv *v)
{
    return v->kind == JV_FLOAT ? v->u.f : v->kind == JV_INT ? (double)v->u.i : (double)v->u.b;
}

/* Values can contain themselves (l.append(l)); past this depth two values
 * count as different instead of recursing on. */
#define JV_COMPARE_DEPTH 200

static bool equal_at(const struct jv *a, const struct jv *b, int level);

bool jv_equal(const struct jv *a, const struct jv *b) { return equal_at(a, b, 0); }

static bool equal_at(const struct jv *a, const struct jv *b, int level)
{
    if (level > JV_COMPARE_DEPTH)
        return false;
    if (is_num(a) && is_num(b)) {
        if (a->kind == JV_INT && b->kind == JV_INT)
            return a->u.i == b->u.i;
        return num_of(a) == num_of(b);
    }
    if (a->kind != b->kind)
        return false;
    switch (a->kind) {
    case JV_UNDEF: case JV_NONE: return true;
    case JV_STR: return a->u.s.n == b->u.s.n && !memcmp(a->u.s.p, b->u.s.p, a->u.s.n);
    case JV_LIST:
        if (a->u.l.n != b->u.l.n)
            return false;
        for (size_t i = 0; i < a->u.l.n; i++)
            if (!equal_at(a->u.l.v[i], b->u.l.v[i], level + 1))
                return false;
        return true;
    case JV_DICT:
        if (a->u.d.n != b->u.d.n)
            return false;
        for (size_t i = 0; i < a->u.d.n; i++) {
            const struct jv *o = jv_dict_getv(b, a->u.d.k[i]);
            if (!o || !equal_at(a->u.d.v[i], o, level + 1))
                return false;
        }
        return true;
    default: return a == b;
    }
}

static int compare_at(struct jctx *cx, const struct jv *a, const struct jv *b, int level);

int jv_compare(struct jctx *cx, const struct jv *a, const struct jv *b) { return compare_at(cx, a, b, 0); }

static int compare_at(struct jctx *cx, const struct jv *a, const struct jv *b, int level)
{
    if (level > JV_COMPARE_DEPTH)
        jx_fail(cx, KS_ERR_RANGE, "comparing values nested deeper than %d", JV_COMPARE_DEPTH);
    if (is_num(a) && is_num(b)) {
        if (a->kind == JV_INT && b->kind == JV_INT)
            return (a->u.i > b->u.i) - (a->u.i < b->u.i);
        double x = num_of(a), y = num_of(b);
        return (x > y) - (x < y);
    }
    if (a->kind == JV_STR && b->kind == JV_STR) {
        size_t n = a->u.s.n < b->u.s.n ? a->u.s.n : b->u.s.n;
        jx_work(cx, n);
        int c = n ? memcmp(a->u.s.p, b->u.s.p, n) : 0;
        if (c)
            return c < 0 ? -1 : 1;
        return (a->u.s.n > b->u.s.n) - (a->u.s.n < b->u.s.n);
    }
    if (a->kind == JV_LIST && b->kind == JV_LIST) {
        for (size_t i = 0; i < a->u.l.n && i < b->u.l.n; i++) {
            int c = compare_at(cx, a->u.l.v[i], b->u.l.v[i], level + 1);
            if (c)
                return c;
        }
        return (a->u.l.n > b->u.l.n) - (a->u.l.n < b->u.l.n);
    }
    jx_fail(cx, KS_ERR_INVALID_ARG, "cannot order %s and %s", jv_kind_name(a), jv_kind_name(b));
}

size_t jv_size(const struct jv *v)
{
    return v->kind == JV_STR ? v->u.s.n : v->kind == JV_LIST ? v->u.l.n : v->kind == JV_DICT ? v->u.d.n : 1;
}

bool jv_contains(struct jctx *cx, const struct jv *hay, const struct jv *needle)
{
    jx_work(cx, jv_size(hay));
    switch (hay->kind) {
    case JV_STR:
        if (needle->kind != JV_STR)
            jx_fail(cx, KS_ERR_INVALID_ARG, "'in <string>' needs a string on the left, not %s", jv_kind_name(needle));
        return needle->u.s.n == 0 || memmem(hay->u.s.p, hay->u.s.n, needle->u.s.p, needle->u.s.n) != NULL;
    case JV_LIST:
        for (size_t i = 0; i < hay->u.l.n; i++)
            if (jv_equal(hay->u.l.v[i], needle))
                return true;
        return false;
    case JV_DICT: return jv_dict_getv(hay, needle) != NULL;
    case JV_UNDEF: case JV_NONE: return false;
    default: jx_fail(cx, KS_ERR_INVALID_ARG, "'in' needs a string, list or dict on the right, not %s", jv_kind_name(hay));
    }
}

const char *jv_kind_name(const struct jv *v)
{
    static const char *const names[] = {
        [JV_UNDEF] = "undefined", [JV_NONE] = "none",  [JV_BOOL] = "boolean", [JV_INT] = "integer",
        [JV_FLOAT] = "float",     [JV_STR] = "string", [JV_LIST] = "list",    [JV_DICT] = "dict",
        [JV_MACRO] = "macro",     [JV_BUILTIN] = "function", [JV_METHOD] = "method", [JV_LOOP] = "loop",
    };
    return names[v->kind];
}

/* ---- text ---------------------------------------------------------------- */

void jbuf_put(struct jctx *cx, struct jbuf *b, const char *p, size_t n)
{
    jx_work(cx, n);
    bool is_output = b == cx->top;
    size_t limit = is_output ? cx->opts.max_output : cx->opts.max_string;
    if (n > limit || b->n > limit - n)
        jx_fail(cx, KS_ERR_RANGE, "%s would pass its limit of %zu bytes", is_output ? "the output" : "a string", limit);
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *np = jx_alloc(cx, cap);
        if (b->n)
            memcpy(np, b->p, b->n);
        b->p = np;
        b->cap = cap;
    }
    if (n)
        memcpy(b->p + b->n, p, n);
    b->n += n;
    b->p[b->n] = 0;
}

void jbuf_puts(struct jctx *cx, struct jbuf *b, const char *s) { jbuf_put(cx, b, s, strlen(s)); }

/* Python's repr(float): the shortest digits that read back the same, in
 * fixed notation for exponents -4..15 and as d.ddde+XX outside. */
static void format_float(double f, char *buf, size_t size)
{
    if (isnan(f)) {
        snprintf(buf, size, "NaN");
        return;
    }
    if (isinf(f)) {
        snprintf(buf, size, f > 0 ? "Infinity" : "-Infinity");
        return;
    }
    char e[40];
    int prec = 1;
    for (; prec <= 17; prec++) {
        snprintf(e, sizeof e, "%.*e", prec - 1, f);
        if (strtod(e, NULL) == f)
            break;
    }
    int exp10 = atoi(strchr(e, 'e') + 1);
    if (exp10 >= -4 && exp10 < 16) {
        int decimals = prec - 1 - exp10;
        snprintf(buf, size, "%.*f", decimals > 0 ? decimals : 0, f);
        if (!strchr(buf, '.')) {
            size_t n = strlen(buf);
            if (n + 2 < size)
                memcpy(buf + n, ".0", 3);
        }
        return;
    }
    /* mantissa digits as %e gave them, exponent with a sign and 2+ digits */
    char *ep = strchr(e, 'e');
    *ep = 0;
    snprintf(buf, size, "%.24se%c%02d", e, exp10 < 0 ? '-' : '+', exp10 < 0 ? -exp10 : exp10);
}

/* The escape of byte c inside a string quoted by q, NULL to keep it as it is
 * (tmp: room for a numeric escape). */
typedef const char *(*escape_fn)(unsigned char c, char q, char tmp[8]);

/* s[0..n) between two q, each byte escape() names replaced. */
static void put_quoted(struct jctx *cx, struct jbuf *b, const char *s, size_t n, char q, escape_fn escape)
{
    jbuf_put(cx, b, &q, 1);
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        char tmp[8];
        const char *esc = escape((unsigned char)s[i], q, tmp);
        if (!esc)
            continue;
        jbuf_put(cx, b, s + run, i - run);
        jbuf_puts(cx, b, esc);
        run = i + 1;
    }
    jbuf_put(cx, b, s + run, n - run);
    jbuf_put(cx, b, &q, 1);
}

static const char *json_escape(unsigned char c, char q, char tmp[8])
{
    (void)q;
    switch (c) {
    case '"': return "\\\"";
    case '\\': return "\\\\";
    case '\n': return "\\n";
    case '\r': return "\\r";
    case '\t': return "\\t";
    case '\b': return "\\b";
    case '\f': return "\\f";
    default:
        if (c >= 0x20)
            return NULL;
        snprintf(tmp, 8, "\\u%04x", c);
        return tmp;
    }
}

static void put_json_string(struct jctx *cx, struct jbuf *b, const char *s, size_t n)
{
    put_quoted(cx, b, s, n, '"', json_escape);
}

static void put_newline_indent(struct jctx *cx, struct jbuf *b, int indent, int level)
{
    jbuf_put(cx, b, "\n", 1);
    for (int i = 0; i < indent * level; i++)
        jbuf_put(cx, b, " ", 1);
}

static int cmp_keys(const void *x, const void *y)
{
    const struct jv *a = *(struct jv *const *)x, *b = *(struct jv *const *)y;
    if (a->kind != JV_STR || b->kind != JV_STR)
        return 0;
    size_t n = a->u.s.n < b->u.s.n ? a->u.s.n : b->u.s.n;
    int c = n ? memcmp(a->u.s.p, b->u.s.p, n) : 0;
    return c ? c : (a->u.s.n > b->u.s.n) - (a->u.s.n < b->u.s.n);
}

static void json_value(struct jctx *cx, struct jbuf *b, const struct jv *v, int indent, bool sort_keys, int level);

static void json_dict(struct jctx *cx, struct jbuf *b, const struct jv *v, int indent, bool sort_keys, int level)
{
    if (!v->u.d.n) {
        jbuf_puts(cx, b, "{}");
        return;
    }
    size_t n = v->u.d.n;
    size_t *order = jx_alloc(cx, n * sizeof *order);
    for (size_t i = 0; i < n; i++)
        order[i] = i;
    if (sort_keys) {
        struct jv **keys = jx_alloc(cx, n * sizeof *keys);
        memcpy(keys, v->u.d.k, n * sizeof *keys);
        qsort(keys, n, sizeof *keys, cmp_keys);
        for (size_t i = 0; i < n; i++)
            for (size_t j = 0; j < n; j++)
                if (v->u.d.k[j] == keys[i])
                    order[i] = j;
    }
    jbuf_put(cx, b, "{", 1);
    for (size_t i = 0; i < n; i++) {
        if (i)
            jbuf_puts(cx, b, indent >= 0 ? "," : ", ");
        if (indent >= 0)
            put_newline_indent(cx, b, indent, level + 1);
        const struct jv *k = v->u.d.k[order[i]];
        if (k->kind == JV_STR) {
            put_json_string(cx, b, k->u.s.p, k->u.s.n);
        } else {
            struct jv *ks = jv_to_str(cx, k);
            put_json_string(cx, b, ks->u.s.p, ks->u.s.n);
        }
        jbuf_puts(cx, b, ": ");
        json_value(cx, b, v->u.d.v[order[i]], indent, sort_keys, level + 1);
    }
    if (indent >= 0)
        put_newline_indent(cx, b, indent, level);
    jbuf_put(cx, b, "}", 1);
}

static void json_value(struct jctx *cx, struct jbuf *b, const struct jv *v, int indent, bool sort_keys, int level)
{
    if (level > (int)cx->opts.max_depth)
        jx_fail(cx, KS_ERR_RANGE, "a value nested deeper than the depth limit %u", cx->opts.max_depth);
    char num[40];
    switch (v->kind) {
    case JV_UNDEF: case JV_NONE: jbuf_puts(cx, b, "null"); return;
    case JV_BOOL: jbuf_puts(cx, b, v->u.b ? "true" : "false"); return;
    case JV_INT: snprintf(num, sizeof num, "%lld", (long long)v->u.i); jbuf_puts(cx, b, num); return;
    case JV_FLOAT: format_float(v->u.f, num, sizeof num); jbuf_puts(cx, b, num); return;
    case JV_STR: put_json_string(cx, b, v->u.s.p, v->u.s.n); return;
    case JV_LIST:
        if (!v->u.l.n) {
            jbuf_puts(cx, b, "[]");
            return;
        }
        jbuf_put(cx, b, "[", 1);
        for (size_t i = 0; i < v->u.l.n; i++) {
            if (i)
                jbuf_puts(cx, b, indent >= 0 ? "," : ", ");
            if (indent >= 0)
                put_newline_indent(cx, b, indent, level + 1);
            json_value(cx, b, v->u.l.v[i], indent, sort_keys, level + 1);
        }
        if (indent >= 0)
            put_newline_indent(cx, b, indent, level);
        jbuf_put(cx, b, "]", 1);
        return;
    case JV_DICT: json_dict(cx, b, v, indent, sort_keys, level); return;
    default: jx_fail(cx, KS_ERR_INVALID_ARG, "a %s cannot be written as JSON", jv_kind_name(v));
    }
}

void jv_to_json(struct jctx *cx, struct jbuf *b, const struct jv *v, int indent, bool sort_keys)
{
    json_value(cx, b, v, indent, sort_keys, 0);
}

static const char *py_escape(unsigned char c, char q, char tmp[8])
{
    if (c == '\\')
        return "\\\\";
    if (c == (unsigned char)q)
        return q == '"' ? "\\\"" : "\\'";
    if (c == '\n')
        return "\\n";
    if (c == '\r')
        return "\\r";
    if (c == '\t')
        return "\\t";
    if (c >= 0x20 && c != 0x7f)
        return NULL;
    snprintf(tmp, 8, "\\x%02x", c);
    return tmp;
}

/* Python's repr() of a str: single quotes unless the text holds ' and no ". */
static void put_py_string(struct jctx *cx, struct jbuf *b, const char *s, size_t n)
{
    bool dq = memchr(s, '\'', n) && !memchr(s, '"', n);
    put_quoted(cx, b, s, n, dq ? '"' : '\'', py_escape);
}

/* Python's repr() of a list or dict, which is what str() gives. */
static void put_repr(struct jctx *cx, struct jbuf *b, const struct jv *v, int level)
{
    if (level > (int)cx->opts.max_depth)
        jx_fail(cx, KS_ERR_RANGE, "a value nested deeper than the depth limit %u", cx->opts.max_depth);
    if (v->kind == JV_STR) {
        put_py_string(cx, b, v->u.s.p, v->u.s.n);
    } else if (v->kind == JV_LIST) {
        jbuf_put(cx, b, v->is_tuple ? "(" : "[", 1);
        for (size_t i = 0; i < v->u.l.n; i++) {
            if (i)
                jbuf_puts(cx, b, ", ");
            put_repr(cx, b, v->u.l.v[i], level + 1);
        }
        if (v->is_tuple && v->u.l.n == 1)
            jbuf_put(cx, b, ",", 1);
        jbuf_put(cx, b, v->is_tuple ? ")" : "]", 1);
    } else if (v->kind == JV_DICT) {
        jbuf_put(cx, b, "{", 1);
        for (size_t i = 0; i < v->u.d.n; i++) {
            if (i)
                jbuf_puts(cx, b, ", ");
            put_repr(cx, b, v->u.d.k[i], level + 1);
            jbuf_puts(cx, b, ": ");
            put_repr(cx, b, v->u.d.v[i], level + 1);
        }
        jbuf_put(cx, b, "}", 1);
    } else if (v->kind == JV_UNDEF) {
        jbuf_puts(cx, b, "None");
    } else {
        jv_print(cx, b, v);
    }
}

void jv_print(struct jctx *cx, struct jbuf *b, const struct jv *v)
{
    char num[40];
    switch (v->kind) {
    case JV_UNDEF: return;
    case JV_NONE: jbuf_puts(cx, b, "None"); return;
    case JV_BOOL: jbuf_puts(cx, b, v->u.b ? "True" : "False"); return;
    case JV_INT: snprintf(num, sizeof num, "%lld", (long long)v->u.i); jbuf_puts(cx, b, num); return;
    case JV_FLOAT: format_float(v->u.f, num, sizeof num); jbuf_puts(cx, b, num); return;
    case JV_STR: jbuf_put(cx, b, v->u.s.p, v->u.s.n); return;
    case JV_LIST: case JV_DICT: put_repr(cx, b, v, 0); return;
    default: jbuf_puts(cx, b, "<"), jbuf_puts(cx, b, jv_kind_name(v)), jbuf_puts(cx, b, ">"); return;
    }
}

struct jv *jv_to_str(struct jctx *cx, const struct jv *v)
{
    if (v->kind == JV_STR)
        return (struct jv *)v;
    struct jbuf b = {0};
    jv_print(cx, &b, v);
    return jv_str(cx, b.p ? b.p : "", b.n);
}

/* ---- JSON in --------------------------------------------------------------- */

struct jv *jv_from_json(struct jctx *cx, const cJSON *j)
{
    if (!j || cJSON_IsNull(j))
        return &jv_none_v;
    if (cJSON_IsBool(j))
        return jv_bool(cJSON_IsTrue(j));
    if (cJSON_IsNumber(j)) {
        double d = j->valuedouble;
        if (d == floor(d) && fabs(d) < 9007199254740992.0)
            return jv_int(cx, (int64_t)d);
        return jv_float(cx, d);
    }
    if (cJSON_IsString(j))
        return jv_cstr(cx, j->valuestring ? j->valuestring : "");
    if (cJSON_IsArray(j)) {
        struct jv *l = jv_list(cx);
        for (const cJSON *c = j->child; c; c = c->next)
            jv_list_push(cx, l, jv_from_json(cx, c));
        return l;
    }
    if (cJSON_IsObject(j)) {
        /* keys are appended without a duplicate scan (linear in the object's
         * size); of duplicate keys the first is the one lookups find */
        struct jv *d = jv_dict(cx);
        size_t n = 0;
        for (const cJSON *c = j->child; c; c = c->next)
            n++;
        d->u.d.k = jx_alloc(cx, (n ? n : 1) * sizeof *d->u.d.k);
        d->u.d.v = jx_alloc(cx, (n ? n : 1) * sizeof *d->u.d.v);
        d->u.d.cap = n ? n : 1;
        for (const cJSON *c = j->child; c; c = c->next) {
            d->u.d.k[d->u.d.n] = jv_cstr(cx, c->string ? c->string : "");
            d->u.d.v[d->u.d.n++] = jv_from_json(cx, c);
        }
        return d;
    }
    return &jv_none_v;
}
