/* jinja: filters, tests, methods of str/list/dict, and the global functions
 * (range, namespace, raise_exception, strftime_now). Each one follows its
 * Jinja2 / Python namesake for the arguments chat templates pass. */
#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "jinja/jinja_internal.h"

/* Arguments as a builtin sees them. */
struct call {
    const char *name;
    struct jv **pos;
    size_t n_pos;
    const char **kw;
    struct jv **kwv;
    size_t n_kw;
};

/* The argument at position i (counting after the value / self) or named kw. */
static struct jv *arg(const struct call *c, size_t i, const char *kw)
{
    if (i < c->n_pos)
        return c->pos[i];
    for (size_t k = 0; kw && k < c->n_kw; k++)
        if (!strcmp(c->kw[k], kw))
            return c->kwv[k];
    return NULL;
}

static struct jv *arg_str(struct jctx *cx, const struct call *c, size_t i, const char *kw)
{
    struct jv *v = arg(c, i, kw);
    if (v && v->kind != JV_STR && v->kind != JV_NONE)
        jx_fail(cx, KS_ERR_INVALID_ARG, "%s: argument %s must be a string, not %s", c->name, kw ? kw : "", jv_kind_name(v));
    return v && v->kind == JV_STR ? v : NULL;
}

static int64_t arg_int(struct jctx *cx, const struct call *c, size_t i, const char *kw, int64_t dflt)
{
    struct jv *v = arg(c, i, kw);
    if (!v || v->kind == JV_NONE)
        return dflt;
    if (v->kind == JV_INT)
        return v->u.i;
    if (v->kind == JV_BOOL)
        return v->u.b;
    jx_fail(cx, KS_ERR_INVALID_ARG, "%s: argument %s must be an integer, not %s", c->name, kw ? kw : "", jv_kind_name(v));
}

static bool arg_bool(const struct call *c, size_t i, const char *kw, bool dflt)
{
    struct jv *v = arg(c, i, kw);
    return v ? jv_truthy(v) : dflt;
}

static _Noreturn void bad_type(struct jctx *cx, const char *what, const struct jv *v)
{
    jx_fail(cx, KS_ERR_INVALID_ARG, "%s does not apply to a %s", what, jv_kind_name(v));
}

static struct jv *need_str(struct jctx *cx, const char *what, struct jv *v)
{
    if (v->kind != JV_STR)
        bad_type(cx, what, v);
    return v;
}

static struct jv *from_buf(struct jctx *cx, const struct jbuf *b) { return jv_str(cx, b->p ? b->p : "", b->n); }

static size_t utf8_count(const char *s, size_t n)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += ((unsigned char)s[i] & 0xC0) != 0x80;
    return k;
}

/* A list for anything iterable: list as is, dict keys, string characters;
 * undefined and none as empty (llama.cpp's leniency, which templates that
 * `set tools = none` and then filter it rely on). */
static struct jv *as_list(struct jctx *cx, const char *what, struct jv *v)
{
    struct jv *l = jv_walk_list(cx, v);
    if (l)
        return l;
    l = jv_list(cx);
    if (v->kind == JV_STR) {
        for (size_t i = 0; i < v->u.s.n;) {
            size_t j = i + 1;
            while (j < v->u.s.n && ((unsigned char)v->u.s.p[j] & 0xC0) == 0x80)
                j++;
            jv_list_push(cx, l, jv_str(cx, v->u.s.p + i, j - i));
            i = j;
        }
    } else if (v->kind != JV_UNDEF && v->kind != JV_NONE) {
        bad_type(cx, what, v);
    }
    return l;
}

/* item.a.b for attribute="a.b"; undefined when a step is missing. */
static struct jv *get_path(struct jctx *cx, struct jv *item, const struct jv *path)
{
    const char *p = path->u.s.p, *end = p + path->u.s.n;
    while (p <= end) {
        const char *dot = memchr(p, '.', (size_t)(end - p));
        size_t n = dot ? (size_t)(dot - p) : (size_t)(end - p);
        if (item->kind == JV_DICT) {
            jx_work(cx, item->u.d.n);
            struct jv *v = jv_dict_get(item, p, n);
            item = v ? v : &jv_undef_v;
        } else if (item->kind == JV_LIST && n && isdigit((unsigned char)p[0])) {
            int64_t i = strtoll(p, NULL, 10);
            item = i < (int64_t)item->u.l.n ? item->u.l.v[i] : &jv_undef_v;
        } else {
            return &jv_undef_v;
        }
        if (!dot)
            break;
        p = dot + 1;
    }
    return item;
}

/* ---- string helpers -------------------------------------------------------- */

static bool py_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

static bool in_set(char c, const struct jv *chars)
{
    return chars ? memchr(chars->u.s.p, c, chars->u.s.n) != NULL : py_space(c);
}

static struct jv *strip(struct jctx *cx, struct jv *s, const struct jv *chars, bool left, bool right)
{
    jx_work(cx, s->u.s.n);
    size_t a = 0, b = s->u.s.n;
    while (left && a < b && in_set(s->u.s.p[a], chars))
        a++;
    while (right && b > a && in_set(s->u.s.p[b - 1], chars))
        b--;
    return jv_str(cx, s->u.s.p + a, b - a);
}

static struct jv *change_case(struct jctx *cx, struct jv *s, int mode /* 0 lower 1 upper 2 title 3 capitalize */)
{
    struct jv *r = jv_str(cx, s->u.s.p, s->u.s.n);
    char *p = (char *)r->u.s.p;
    bool start = true;
    for (size_t i = 0; i < r->u.s.n; i++) {
        unsigned char c = (unsigned char)p[i];
        if (mode == 0)
            p[i] = (char)tolower(c);
        else if (mode == 1)
            p[i] = (char)toupper(c);
        else if (mode == 2)
            p[i] = (char)(start ? toupper(c) : tolower(c));
        else
            p[i] = (char)(i == 0 ? toupper(c) : tolower(c));
        start = !isalnum(c) && c < 0x80;
    }
    return r;
}

static struct jv *replace_str(struct jctx *cx, struct jv *s, struct jv *old, struct jv *new_, int64_t count)
{
    jx_work(cx, s->u.s.n);
    struct jbuf b = {0};
    size_t i = 0, done = 0;
    if (old->u.s.n == 0) {
        for (; i <= s->u.s.n && (count < 0 || (int64_t)done < count); done++) {
            jx_step(cx);
            jbuf_put(cx, &b, new_->u.s.p, new_->u.s.n);
            if (i < s->u.s.n)
                jbuf_put(cx, &b, s->u.s.p + i, 1);
            i++;
        }
        if (i < s->u.s.n)
            jbuf_put(cx, &b, s->u.s.p + i, s->u.s.n - i);
        return from_buf(cx, &b);
    }
    while (i < s->u.s.n && (count < 0 || (int64_t)done < count)) {
        const char *hit = memmem(s->u.s.p + i, s->u.s.n - i, old->u.s.p, old->u.s.n);
        if (!hit)
            break;
        jx_step(cx);
        size_t at = (size_t)(hit - s->u.s.p);
        jbuf_put(cx, &b, s->u.s.p + i, at - i);
        jbuf_put(cx, &b, new_->u.s.p, new_->u.s.n);
        i = at + old->u.s.n;
        done++;
    }
    jbuf_put(cx, &b, s->u.s.p + i, s->u.s.n - i);
    return from_buf(cx, &b);
}

static struct jv *split_str(struct jctx *cx, struct jv *s, struct jv *sep, int64_t maxsplit)
{
    jx_work(cx, s->u.s.n);
    struct jv *l = jv_list(cx);
    const char *p = s->u.s.p, *end = p + s->u.s.n;
    if (!sep) {
        while (p < end) {
            while (p < end && py_space(*p))
                p++;
            if (p == end)
                break;
            const char *q = p;
            if (maxsplit >= 0 && (int64_t)l->u.l.n >= maxsplit) {
                const char *e = end;
                while (e > q && py_space(e[-1]))
                    e--;
                jv_list_push(cx, l, jv_str(cx, q, (size_t)(e - q)));
                break;
            }
            while (q < end && !py_space(*q))
                q++;
            jx_step(cx);
            jv_list_push(cx, l, jv_str(cx, p, (size_t)(q - p)));
            p = q;
        }
        return l;
    }
    if (!sep->u.s.n)
        jx_fail(cx, KS_ERR_INVALID_ARG, "split: empty separator");
    for (;;) {
        const char *hit = (maxsplit < 0 || (int64_t)l->u.l.n < maxsplit)
                              ? memmem(p, (size_t)(end - p), sep->u.s.p, sep->u.s.n) : NULL;
        jx_step(cx);
        if (!hit) {
            jv_list_push(cx, l, jv_str(cx, p, (size_t)(end - p)));
            return l;
        }
        jv_list_push(cx, l, jv_str(cx, p, (size_t)(hit - p)));
        p = hit + sep->u.s.n;
    }
}

static bool affix_match(struct jv *s, struct jv *affix, bool at_end)
{
    if (affix->kind == JV_LIST) {
        for (size_t i = 0; i < affix->u.l.n; i++)
            if (affix_match(s, affix->u.l.v[i], at_end))
                return true;
        return false;
    }
    if (affix->kind != JV_STR || affix->u.s.n > s->u.s.n)
        return false;
    const char *p = at_end ? s->u.s.p + s->u.s.n - affix->u.s.n : s->u.s.p;
    return !memcmp(p, affix->u.s.p, affix->u.s.n);
}

/* "{} and {0} and {name}".format(...) */
static struct jv *format_str(struct jctx *cx, struct jv *s, const struct call *c)
{
    struct jbuf b = {0};
    size_t auto_idx = 0;
    const char *p = s->u.s.p, *end = p + s->u.s.n;
    while (p < end) {
        if ((*p == '{' || *p == '}') && p + 1 < end && p[1] == *p) {
            jbuf_put(cx, &b, p, 1);
            p += 2;
            continue;
        }
        if (*p != '{') {
            jbuf_put(cx, &b, p++, 1);
            continue;
        }
        const char *close = memchr(p, '}', (size_t)(end - p));
        if (!close)
            jx_fail(cx, KS_ERR_INVALID_ARG, "format: '{' without '}'");
        const char *field = p + 1;
        size_t n = (size_t)(close - field);
        struct jv *v = NULL;
        if (n == 0)
            v = arg(c, auto_idx++, NULL);
        else if (isdigit((unsigned char)field[0]))
            v = arg(c, (size_t)strtoul(field, NULL, 10), NULL);
        else
            for (size_t k = 0; k < c->n_kw && !v; k++)
                if (strlen(c->kw[k]) == n && !memcmp(c->kw[k], field, n))
                    v = c->kwv[k];
        if (!v)
            jx_fail(cx, KS_ERR_INVALID_ARG, "format: no argument for {%.*s}", (int)n, field);
        jv_print(cx, &b, v);
        p = close + 1;
    }
    return from_buf(cx, &b);
}

static struct jv *join_items(struct jctx *cx, struct jv *list, struct jv *sep, struct jv *attr)
{
    struct jbuf b = {0};
    for (size_t i = 0; i < list->u.l.n; i++) {
        if (i && sep)
            jbuf_put(cx, &b, sep->u.s.p, sep->u.s.n);
        struct jv *item = attr ? get_path(cx, list->u.l.v[i], attr) : list->u.l.v[i];
        jv_print(cx, &b, item);
    }
    return from_buf(cx, &b);
}

/* ---- methods --------------------------------------------------------------- */

enum method_id {
    M_STRIP, M_LSTRIP, M_RSTRIP, M_SPLIT, M_STARTSWITH, M_ENDSWITH, M_REPLACE, M_UPPER, M_LOWER, M_TITLE,
    M_CAPITALIZE, M_FORMAT, M_FIND, M_COUNT, M_JOIN,
    M_APPEND, M_POP, M_INDEX, M_EXTEND, M_INSERT, M_LCOUNT,
    M_GET, M_ITEMS, M_KEYS, M_VALUES, M_DPOP, M_UPDATE, M_SETDEFAULT,
};

static const struct {
    const char *name;
    enum jv_kind on;
    enum method_id id;
} methods[] = {
    {"strip", JV_STR, M_STRIP},       {"lstrip", JV_STR, M_LSTRIP},         {"rstrip", JV_STR, M_RSTRIP},
    {"split", JV_STR, M_SPLIT},       {"startswith", JV_STR, M_STARTSWITH}, {"endswith", JV_STR, M_ENDSWITH},
    {"replace", JV_STR, M_REPLACE},   {"upper", JV_STR, M_UPPER},           {"lower", JV_STR, M_LOWER},
    {"title", JV_STR, M_TITLE},       {"capitalize", JV_STR, M_CAPITALIZE}, {"format", JV_STR, M_FORMAT},
    {"find", JV_STR, M_FIND},         {"count", JV_STR, M_COUNT},           {"join", JV_STR, M_JOIN},
    {"append", JV_LIST, M_APPEND},    {"pop", JV_LIST, M_POP},              {"index", JV_LIST, M_INDEX},
    {"extend", JV_LIST, M_EXTEND},    {"insert", JV_LIST, M_INSERT},        {"count", JV_LIST, M_LCOUNT},
    {"get", JV_DICT, M_GET},          {"items", JV_DICT, M_ITEMS},          {"keys", JV_DICT, M_KEYS},
    {"values", JV_DICT, M_VALUES},    {"pop", JV_DICT, M_DPOP},             {"update", JV_DICT, M_UPDATE},
    {"setdefault", JV_DICT, M_SETDEFAULT},
};

struct jv *jx_method(struct jctx *cx, struct jv *v, const char *name)
{
    for (size_t i = 0; i < sizeof methods / sizeof methods[0]; i++)
        if (methods[i].on == v->kind && !strcmp(methods[i].name, name)) {
            struct jv *m = jx_alloc(cx, sizeof *m);
            m->kind = JV_METHOD;
            m->u.fn.id = (int)methods[i].id;
            m->u.fn.self = v;
            m->u.fn.name = methods[i].name;
            return m;
        }
    return NULL;
}

static struct jv *dict_items(struct jctx *cx, struct jv *d)
{
    struct jv *l = jv_list(cx);
    for (size_t i = 0; i < d->u.d.n; i++) {
        struct jv *pair = jv_list(cx);
        pair->is_tuple = true;
        jv_list_push(cx, pair, d->u.d.k[i]);
        jv_list_push(cx, pair, d->u.d.v[i]);
        jv_list_push(cx, l, pair);
    }
    return l;
}

static struct jv *list_pop(struct jctx *cx, struct jv *l, int64_t i)
{
    int64_t n = (int64_t)l->u.l.n;
    if (i < 0)
        i += n;
    if (i < 0 || i >= n)
        jx_fail(cx, KS_ERR_INVALID_ARG, "pop: index out of range (list of %lld)", (long long)n);
    struct jv *v = l->u.l.v[i];
    memmove(l->u.l.v + i, l->u.l.v + i + 1, (size_t)(n - i - 1) * sizeof *l->u.l.v);
    l->u.l.n--;
    return v;
}

static struct jv *dict_pop(struct jctx *cx, struct jv *d, struct jv *key, struct jv *dflt)
{
    for (size_t i = 0; i < d->u.d.n; i++)
        if (jv_equal(d->u.d.k[i], key)) {
            struct jv *v = d->u.d.v[i];
            memmove(d->u.d.k + i, d->u.d.k + i + 1, (d->u.d.n - i - 1) * sizeof *d->u.d.k);
            memmove(d->u.d.v + i, d->u.d.v + i + 1, (d->u.d.n - i - 1) * sizeof *d->u.d.v);
            d->u.d.n--;
            return v;
        }
    if (!dflt)
        jx_fail(cx, KS_ERR_INVALID_ARG, "pop: key not in the dict");
    return dflt;
}

static struct jv *need_arg(struct jctx *cx, const struct call *c, size_t i, const char *what)
{
    struct jv *v = arg(c, i, NULL);
    if (!v)
        jx_fail(cx, KS_ERR_INVALID_ARG, "%s needs %s", c->name, what);
    return v;
}

static struct jv *str_method(struct jctx *cx, int id, struct jv *s, const struct call *c)
{
    switch (id) {
    case M_STRIP: return strip(cx, s, arg_str(cx, c, 0, "chars"), true, true);
    case M_LSTRIP: return strip(cx, s, arg_str(cx, c, 0, "chars"), true, false);
    case M_RSTRIP: return strip(cx, s, arg_str(cx, c, 0, "chars"), false, true);
    case M_SPLIT: return split_str(cx, s, arg_str(cx, c, 0, "sep"), arg_int(cx, c, 1, "maxsplit", -1));
    case M_STARTSWITH: return jv_bool(affix_match(s, need_arg(cx, c, 0, "a prefix"), false));
    case M_ENDSWITH: return jv_bool(affix_match(s, need_arg(cx, c, 0, "a suffix"), true));
    case M_REPLACE:
        return replace_str(cx, s, need_str(cx, "replace", need_arg(cx, c, 0, "the old text")),
                           need_str(cx, "replace", need_arg(cx, c, 1, "the new text")), arg_int(cx, c, 2, "count", -1));
    case M_UPPER: return change_case(cx, s, 1);
    case M_LOWER: return change_case(cx, s, 0);
    case M_TITLE: return change_case(cx, s, 2);
    case M_CAPITALIZE: return change_case(cx, s, 3);
    case M_FORMAT: return format_str(cx, s, c);
    case M_FIND: {
        jx_work(cx, s->u.s.n);
        struct jv *sub = need_str(cx, "find", need_arg(cx, c, 0, "the text to find"));
        const char *hit = memmem(s->u.s.p, s->u.s.n, sub->u.s.p, sub->u.s.n);
        return jv_int(cx, hit ? (int64_t)utf8_count(s->u.s.p, (size_t)(hit - s->u.s.p)) : -1);
    }
    case M_COUNT: {
        jx_work(cx, s->u.s.n);
        struct jv *sub = need_str(cx, "count", need_arg(cx, c, 0, "the text to count"));
        int64_t k = 0;
        if (!sub->u.s.n)
            return jv_int(cx, (int64_t)utf8_count(s->u.s.p, s->u.s.n) + 1);
        for (const char *p = s->u.s.p, *e = p + s->u.s.n; (p = memmem(p, (size_t)(e - p), sub->u.s.p, sub->u.s.n));
             p += sub->u.s.n)
            k++;
        return jv_int(cx, k);
    }
    case M_JOIN: return join_items(cx, as_list(cx, "join", need_arg(cx, c, 0, "a list")), s, NULL);
    default: jx_fail(cx, KS_ERR_INTERNAL, "bad string method %d", id);
    }
}

static struct jv *call_method(struct jctx *cx, struct jv *m, const struct call *c)
{
    struct jv *self = m->u.fn.self;
    int id = m->u.fn.id;
    if (self->kind == JV_STR)
        return str_method(cx, id, self, c);
    switch (id) {
    case M_APPEND: jv_list_push(cx, self, need_arg(cx, c, 0, "a value")); return &jv_none_v;
    case M_EXTEND: {
        struct jv *more = as_list(cx, "extend", need_arg(cx, c, 0, "a list"));
        for (size_t i = 0; i < more->u.l.n; i++)
            jv_list_push(cx, self, more->u.l.v[i]);
        return &jv_none_v;
    }
    case M_INSERT: {
        int64_t i = arg_int(cx, c, 0, NULL, 0), n = (int64_t)self->u.l.n;
        struct jv *v = need_arg(cx, c, 1, "a value");
        if (i < 0)
            i = i + n < 0 ? 0 : i + n;
        if (i > n)
            i = n;
        jv_list_push(cx, self, v);
        memmove(self->u.l.v + i + 1, self->u.l.v + i, (size_t)(n - i) * sizeof *self->u.l.v);
        self->u.l.v[i] = v;
        return &jv_none_v;
    }
    case M_POP: return list_pop(cx, self, arg_int(cx, c, 0, NULL, -1));
    case M_LCOUNT: {
        jx_work(cx, self->u.l.n);
        struct jv *x = need_arg(cx, c, 0, "a value");
        int64_t k = 0;
        for (size_t i = 0; i < self->u.l.n; i++)
            k += jv_equal(self->u.l.v[i], x);
        return jv_int(cx, k);
    }
    case M_INDEX: {
        jx_work(cx, self->u.l.n);
        struct jv *x = need_arg(cx, c, 0, "a value");
        for (size_t i = 0; i < self->u.l.n; i++)
            if (jv_equal(self->u.l.v[i], x))
                return jv_int(cx, (int64_t)i);
        jx_fail(cx, KS_ERR_INVALID_ARG, "index: the value is not in the list");
    }
    case M_GET: {
        jx_work(cx, self->u.d.n);
        struct jv *v = jv_dict_getv(self, need_arg(cx, c, 0, "a key"));
        struct jv *dflt = arg(c, 1, "default");
        return v ? v : dflt ? dflt : &jv_none_v;
    }
    case M_ITEMS: return dict_items(cx, self);
    case M_KEYS: case M_VALUES: {
        struct jv *l = jv_list(cx);
        for (size_t i = 0; i < self->u.d.n; i++)
            jv_list_push(cx, l, id == M_KEYS ? self->u.d.k[i] : self->u.d.v[i]);
        return l;
    }
    case M_DPOP: return dict_pop(cx, self, need_arg(cx, c, 0, "a key"), arg(c, 1, "default"));
    case M_UPDATE: {
        struct jv *o = need_arg(cx, c, 0, "a dict");
        if (o->kind != JV_DICT)
            bad_type(cx, "update", o);
        for (size_t i = 0; i < o->u.d.n; i++)
            jv_dict_set(cx, self, o->u.d.k[i], o->u.d.v[i]);
        for (size_t i = 0; i < c->n_kw; i++)
            jv_dict_set(cx, self, jv_cstr(cx, c->kw[i]), c->kwv[i]);
        return &jv_none_v;
    }
    case M_SETDEFAULT: {
        jx_work(cx, self->u.d.n);
        struct jv *k = need_arg(cx, c, 0, "a key"), *v = jv_dict_getv(self, k);
        if (v)
            return v;
        v = arg(c, 1, NULL) ? arg(c, 1, NULL) : &jv_none_v;
        jv_dict_set(cx, self, k, v);
        return v;
    }
    default: jx_fail(cx, KS_ERR_INTERNAL, "bad method %d", id);
    }
}

/* ---- globals ----------------------------------------------------------------- */

enum builtin_id { B_RANGE, B_NAMESPACE, B_RAISE, B_STRFTIME_NOW, B_DICT };

static struct jv *range_list(struct jctx *cx, const struct call *c)
{
    int64_t start = 0, stop, step = 1;
    if (c->n_pos == 1) {
        stop = arg_int(cx, c, 0, NULL, 0);
    } else {
        start = arg_int(cx, c, 0, NULL, 0);
        stop = arg_int(cx, c, 1, NULL, 0);
        step = arg_int(cx, c, 2, NULL, 1);
    }
    if (step == 0)
        jx_fail(cx, KS_ERR_INVALID_ARG, "range: step cannot be zero");
    double count = ((double)stop - (double)start) / (double)step;
    if (count > (double)(cx->opts.max_steps - cx->steps))
        jx_fail(cx, KS_ERR_RANGE, "range of %.0f numbers: over the step limit of %llu steps", count,
                (unsigned long long)cx->opts.max_steps);
    struct jv *l = jv_list(cx);
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        jx_step(cx);
        jv_list_push(cx, l, jv_int(cx, i));
        if (step > 0 ? i > INT64_MAX - step : i < INT64_MIN - step)
            break;
    }
    return l;
}

static struct jv *namespace_new(struct jctx *cx, const struct call *c)
{
    struct jv *ns = jv_dict(cx);
    ns->is_ns = true;
    struct jv *init = arg(c, 0, NULL);
    if (init && init->kind == JV_DICT)
        for (size_t i = 0; i < init->u.d.n; i++)
            jv_dict_set(cx, ns, init->u.d.k[i], init->u.d.v[i]);
    for (size_t i = 0; i < c->n_kw; i++)
        jv_dict_set(cx, ns, jv_cstr(cx, c->kw[i]), c->kwv[i]);
    return ns;
}

static struct jv *strftime_now(struct jctx *cx, const struct call *c)
{
    struct jv *fmt = arg_str(cx, c, 0, "format");
    if (!fmt)
        jx_fail(cx, KS_ERR_INVALID_ARG, "strftime_now needs a format string");
    time_t t = (time_t)cx->opts.now;
    struct tm tm;
    gmtime_r(&t, &tm);
    char out[256];
    size_t n = fmt->u.s.n < 200 ? strftime(out, sizeof out, jv_c_str(cx, fmt), &tm) : 0;
    if (!n && fmt->u.s.n)
        jx_fail(cx, KS_ERR_INVALID_ARG, "strftime_now: format too long or empty result");
    return jv_str(cx, out, n);
}

struct jv *jx_call_builtin(struct jctx *cx, struct jv *fn, struct jv **args, size_t n_args, const char **kw_names,
                           struct jv **kw_vals, size_t n_kw)
{
    struct call c = {fn->u.fn.name, args, n_args, kw_names, kw_vals, n_kw};
    if (fn->kind == JV_METHOD)
        return call_method(cx, fn, &c);
    switch (fn->u.fn.id) {
    case B_RANGE: return range_list(cx, &c);
    case B_NAMESPACE: return namespace_new(cx, &c);
    case B_DICT: {
        struct jv *d = namespace_new(cx, &c);
        d->is_ns = false;
        return d;
    }
    case B_RAISE: {
        struct jv *msg = arg(&c, 0, NULL);
        struct jv *s = msg ? jv_to_str(cx, msg) : jv_cstr(cx, "");
        jx_fail(cx, KS_ERR_STATE, "template raised: %.*s", (int)(s->u.s.n > 300 ? 300 : s->u.s.n), s->u.s.p);
    }
    case B_STRFTIME_NOW: return strftime_now(cx, &c);
    default: jx_fail(cx, KS_ERR_INTERNAL, "bad builtin %d", fn->u.fn.id);
    }
}

void jx_install_globals(struct jctx *cx)
{
    static const struct { const char *name; enum builtin_id id; } globals[] = {
        {"range", B_RANGE}, {"namespace", B_NAMESPACE}, {"raise_exception", B_RAISE},
        {"strftime_now", B_STRFTIME_NOW}, {"dict", B_DICT},
    };
    for (size_t i = 0; i < sizeof globals / sizeof globals[0]; i++) {
        struct jv *f = jx_alloc(cx, sizeof *f);
        f->kind = JV_BUILTIN;
        f->u.fn.id = (int)globals[i].id;
        f->u.fn.name = globals[i].name;
        jx_set_global(cx, globals[i].name, f);
    }
}

/* ---- tests ------------------------------------------------------------------- */

enum test_id {
    T_DEFINED, T_UNDEFINED, T_NONE, T_STRING, T_MAPPING, T_ITERABLE, T_NUMBER, T_INTEGER, T_FLOAT, T_BOOLEAN,
    T_TRUE, T_FALSE, T_CALLABLE, T_LOWER, T_UPPER, T_ODD, T_EVEN,
    /* these take an argument */
    T_EQ, T_NE, T_LT, T_GT, T_LE, T_GE, T_SAMEAS, T_IN, T_DIVISIBLEBY,
};

static const struct {
    const char *name;
    enum test_id id;
} tests[] = {
    {"defined", T_DEFINED}, {"undefined", T_UNDEFINED}, {"none", T_NONE},         {"string", T_STRING},
    {"mapping", T_MAPPING}, {"iterable", T_ITERABLE},   {"sequence", T_ITERABLE}, {"number", T_NUMBER},
    {"integer", T_INTEGER}, {"float", T_FLOAT},         {"boolean", T_BOOLEAN},   {"true", T_TRUE},
    {"false", T_FALSE},     {"callable", T_CALLABLE},   {"lower", T_LOWER},       {"upper", T_UPPER},
    {"odd", T_ODD},         {"even", T_EVEN},           {"eq", T_EQ},             {"equalto", T_EQ},
    {"==", T_EQ},           {"ne", T_NE},               {"!=", T_NE},             {"lt", T_LT},
    {"<", T_LT},            {"gt", T_GT},               {">", T_GT},              {"le", T_LE},
    {"<=", T_LE},           {"ge", T_GE},               {">=", T_GE},             {"sameas", T_SAMEAS},
    {"in", T_IN},           {"divisibleby", T_DIVISIBLEBY},
};

static int find_test(const char *name)
{
    for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++)
        if (!strcmp(tests[i].name, name))
            return (int)tests[i].id;
    return -1;
}

bool jx_has_test(const char *name) { return find_test(name) >= 0; }

static bool all_case(struct jctx *cx, const struct jv *v, bool upper)
{
    v = jv_to_str(cx, v); /* Jinja2 tests str(value) */
    bool cased = false;
    for (size_t i = 0; i < v->u.s.n; i++) {
        unsigned char c = (unsigned char)v->u.s.p[i];
        if ((upper && islower(c)) || (!upper && isupper(c)))
            return false;
        cased |= isalpha(c) != 0;
    }
    return cased;
}

static bool is_odd(struct jctx *cx, const struct jv *v)
{
    if (v->kind == JV_FLOAT)
        return fabs(fmod(v->u.f, 2.0)) == 1.0;
    if (v->kind != JV_INT && v->kind != JV_BOOL)
        jx_fail(cx, KS_ERR_INVALID_ARG, "odd/even need a number, not %s", jv_kind_name(v));
    return (v->kind == JV_INT ? v->u.i : v->u.b) % 2 != 0;
}

static bool divisible_by(struct jctx *cx, const struct jv *v, const struct jv *a)
{
    if ((v->kind == JV_FLOAT || a->kind == JV_FLOAT) && (v->kind != JV_STR && a->kind != JV_STR)) {
        double x = v->kind == JV_FLOAT ? v->u.f : v->kind == JV_INT ? (double)v->u.i : v->u.b;
        double y = a->kind == JV_FLOAT ? a->u.f : a->kind == JV_INT ? (double)a->u.i : a->u.b;
        if (y == 0 || isnan(x) || isnan(y) || (v->kind != JV_FLOAT && v->kind != JV_INT && v->kind != JV_BOOL) ||
            (a->kind != JV_FLOAT && a->kind != JV_INT && a->kind != JV_BOOL))
            jx_fail(cx, KS_ERR_INVALID_ARG, "divisibleby needs numbers, not %s and %s", jv_kind_name(v), jv_kind_name(a));
        return fmod(x, y) == 0;
    }
    if ((a->kind != JV_INT && a->kind != JV_BOOL) || (v->kind != JV_INT && v->kind != JV_BOOL))
        jx_fail(cx, KS_ERR_INVALID_ARG, "divisibleby needs integers, not %s and %s", jv_kind_name(v), jv_kind_name(a));
    int64_t x = v->kind == JV_INT ? v->u.i : v->u.b, y = a->kind == JV_INT ? a->u.i : a->u.b;
    if (y == 0)
        jx_fail(cx, KS_ERR_INVALID_ARG, "divisibleby 0");
    return y == -1 || x % y == 0;
}

bool jx_test(struct jctx *cx, const char *name, struct jv *v, struct jv **args, size_t n_args)
{
    int id = find_test(name);
    if (id < 0)
        jx_fail(cx, KS_ERR_UNSUPPORTED, "unknown test '%s'", name);
    struct jv *a = n_args ? args[0] : NULL;
    if (id >= T_EQ && !a)
        jx_fail(cx, KS_ERR_INVALID_ARG, "test '%s' needs an argument", name);
    switch ((enum test_id)id) {
    case T_DEFINED: return v->kind != JV_UNDEF;
    case T_UNDEFINED: return v->kind == JV_UNDEF;
    case T_NONE: return v->kind == JV_NONE;
    case T_STRING: return v->kind == JV_STR;
    case T_MAPPING: return v->kind == JV_DICT;
    case T_ITERABLE: /* undefined iterates as empty, as in Jinja2 */
        return v->kind == JV_LIST || v->kind == JV_DICT || v->kind == JV_STR || v->kind == JV_UNDEF;
    case T_NUMBER: return v->kind == JV_INT || v->kind == JV_FLOAT || v->kind == JV_BOOL;
    case T_INTEGER: return v->kind == JV_INT;
    case T_FLOAT: return v->kind == JV_FLOAT;
    case T_BOOLEAN: return v->kind == JV_BOOL;
    case T_TRUE: return v->kind == JV_BOOL && v->u.b;
    case T_FALSE: return v->kind == JV_BOOL && !v->u.b;
    case T_CALLABLE: return v->kind == JV_MACRO || v->kind == JV_BUILTIN || v->kind == JV_METHOD;
    case T_LOWER: return all_case(cx, v, false);
    case T_UPPER: return all_case(cx, v, true);
    case T_ODD: return is_odd(cx, v);
    case T_EVEN: return !is_odd(cx, v);
    case T_EQ: return jv_equal(v, a);
    case T_NE: return !jv_equal(v, a);
    case T_LT: return jv_compare(cx, v, a) < 0;
    case T_GT: return jv_compare(cx, v, a) > 0;
    case T_LE: return jv_compare(cx, v, a) <= 0;
    case T_GE: return jv_compare(cx, v, a) >= 0;
    case T_SAMEAS:
        return v == a || (v->kind == a->kind && (v->kind == JV_NONE || (v->kind == JV_BOOL && v->u.b == a->u.b)));
    case T_IN: return jv_contains(cx, a, v);
    case T_DIVISIBLEBY: return divisible_by(cx, v, a);
    }
    jx_fail(cx, KS_ERR_INTERNAL, "test '%s' has no case", name);
}

/* ---- filters ----------------------------------------------------------------- */

/* select / reject / selectattr / rejectattr: keep items whose (attribute's)
 * test result equals want. */
static struct jv *select_items(struct jctx *cx, struct jv *v, const struct call *c, bool by_attr, bool want)
{
    struct jv *list = as_list(cx, c->name, v);
    size_t first = 0;
    struct jv *attr = NULL;
    if (by_attr) {
        attr = need_str(cx, c->name, need_arg(cx, c, 0, "an attribute name"));
        first = 1;
    }
    struct jv *test = arg(c, first, NULL);
    if (test)
        need_str(cx, c->name, test);
    struct jv *out = jv_list(cx);
    for (size_t i = 0; i < list->u.l.n; i++) {
        jx_step(cx);
        struct jv *item = list->u.l.v[i];
        struct jv *x = attr ? get_path(cx, item, attr) : item;
        bool r = test ? jx_test(cx, jv_c_str(cx, test), x, c->pos + first + 1, c->n_pos > first + 1 ? c->n_pos - first - 1 : 0)
                      : jv_truthy(x);
        if (r == want)
            jv_list_push(cx, out, item);
    }
    return out;
}

static struct jv *map_items(struct jctx *cx, struct jv *v, const struct call *c)
{
    struct jv *list = as_list(cx, "map", v);
    struct jv *attr = arg_str(cx, c, SIZE_MAX, "attribute");
    struct jv *dflt = arg(c, SIZE_MAX, "default");
    struct jv *filter = attr ? NULL : need_str(cx, "map", need_arg(cx, c, 0, "a filter name or attribute="));
    struct jv *out = jv_list(cx);
    for (size_t i = 0; i < list->u.l.n; i++) {
        jx_step(cx);
        struct jv *item = list->u.l.v[i];
        if (attr) {
            struct jv *x = get_path(cx, item, attr);
            jv_list_push(cx, out, x->kind == JV_UNDEF && dflt ? dflt : x);
        } else {
            jv_list_push(cx, out, jx_filter(cx, jv_c_str(cx, filter), item, c->pos + 1, c->n_pos - 1, NULL, NULL, 0));
        }
    }
    return out;
}

/* Sorting with the render's error handling: an insertion sort (chat
 * templates sort a handful of items) that charges one step per comparison. */
static void sort_list(struct jctx *cx, struct jv **v, size_t n, struct jv *attr, bool reverse, bool case_sensitive,
                      bool by_key_of_pair)
{
    for (size_t i = 1; i < n; i++) {
        struct jv *x = v[i];
        size_t j = i;
        while (j > 0) {
            jx_step(cx);
            struct jv *a = v[j - 1], *b = x;
            if (by_key_of_pair) {
                a = a->u.l.v[0];
                b = b->u.l.v[0];
            }
            if (attr) {
                a = get_path(cx, a, attr);
                b = get_path(cx, b, attr);
            }
            if (!case_sensitive && a->kind == JV_STR && b->kind == JV_STR) {
                a = change_case(cx, a, 0);
                b = change_case(cx, b, 0);
            }
            int c = jv_compare(cx, a, b);
            if (reverse ? c >= 0 : c <= 0)
                break;
            v[j] = v[j - 1];
            j--;
        }
        v[j] = x;
    }
}

static struct jv *copy_list(struct jctx *cx, struct jv *l)
{
    struct jv *r = jv_list(cx);
    for (size_t i = 0; i < l->u.l.n; i++)
        jv_list_push(cx, r, l->u.l.v[i]);
    return r;
}

static struct jv *indent_text(struct jctx *cx, struct jv *s, const struct call *c)
{
    struct jv *w = arg(c, 0, "width");
    struct jbuf pad = {0};
    if (w && w->kind == JV_STR)
        jbuf_put(cx, &pad, w->u.s.p, w->u.s.n);
    else
        for (int64_t i = 0, n = arg_int(cx, c, 0, "width", 4); i < n && i < 256; i++)
            jbuf_put(cx, &pad, " ", 1);
    bool first = arg_bool(c, 1, "first", false), blank = arg_bool(c, 2, "blank", false);
    struct jbuf b = {0};
    const char *p = s->u.s.p, *end = p + s->u.s.n;
    for (bool is_first = true; p <= end; is_first = false) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *e = nl ? nl : end;
        if ((!is_first || first) && (e > p || blank))
            jbuf_put(cx, &b, pad.p ? pad.p : "", pad.n);
        jbuf_put(cx, &b, p, (size_t)(e - p));
        if (!nl)
            break;
        jbuf_put(cx, &b, "\n", 1);
        p = nl + 1;
    }
    return from_buf(cx, &b);
}

static struct jv *to_int(struct jctx *cx, struct jv *v, const struct call *c)
{
    if (v->kind == JV_INT)
        return v;
    if (v->kind == JV_BOOL)
        return jv_int(cx, v->u.b);
    if (v->kind == JV_FLOAT && fabs(v->u.f) < 9.2e18)
        return jv_int(cx, (int64_t)v->u.f);
    if (v->kind == JV_STR) {
        char buf[64];
        size_t n = v->u.s.n < sizeof buf - 1 ? v->u.s.n : sizeof buf - 1;
        memcpy(buf, v->u.s.p, n);
        buf[n] = 0;
        char *end;
        long long i = strtoll(buf, &end, 10);
        if (end != buf && *end == 0)
            return jv_int(cx, i);
    }
    struct jv *d = arg(c, 0, "default");
    return d ? d : jv_int(cx, 0);
}

/* min/max: strings compare case-insensitively unless case_sensitive=true, as in Jinja2. */
static struct jv *min_max(struct jctx *cx, struct jv *v, const struct call *c, bool want_max)
{
    struct jv *l = as_list(cx, c->name, v);
    bool case_sensitive = arg_bool(c, 0, "case_sensitive", false);
    struct jv *attr = arg_str(cx, c, 1, "attribute");
    struct jv *best = NULL, *best_key = NULL;
    for (size_t i = 0; i < l->u.l.n; i++) {
        struct jv *x = l->u.l.v[i], *key = attr ? get_path(cx, x, attr) : x;
        if (!case_sensitive && key->kind == JV_STR)
            key = change_case(cx, key, 0);
        int r = best ? jv_compare(cx, key, best_key) : 0;
        if (!best || (want_max ? r > 0 : r < 0)) {
            best = x;
            best_key = key;
        }
    }
    return best ? best : &jv_undef_v;
}

static struct jv *from_json_text(struct jctx *cx, struct jv *s)
{
    need_str(cx, "from_json", s);
    cJSON *j = cJSON_ParseWithLength(s->u.s.p, s->u.s.n);
    if (!j)
        jx_fail(cx, KS_ERR_INVALID_ARG, "from_json: the text is not JSON");
    struct jv *v = jv_from_json(cx, j);
    cJSON_Delete(j);
    return v;
}

static struct jv *tojson(struct jctx *cx, struct jv *v, const struct call *c)
{
    struct jv *ind = arg(c, 0, "indent");
    int indent = ind && ind->kind == JV_INT ? (int)(ind->u.i < 0 ? 0 : ind->u.i > 32 ? 32 : ind->u.i) : -1;
    struct jbuf b = {0};
    jv_to_json(cx, &b, v, indent, arg_bool(c, SIZE_MAX, "sort_keys", false));
    return from_buf(cx, &b);
}

static struct jv *unique_items(struct jctx *cx, struct jv *v)
{
    struct jv *l = as_list(cx, "unique", v), *out = jv_list(cx);
    for (size_t i = 0; i < l->u.l.n; i++) {
        bool seen = false;
        for (size_t j = 0; j < out->u.l.n && !seen; j++) {
            jx_step(cx);
            seen = jv_equal(out->u.l.v[j], l->u.l.v[i]);
        }
        if (!seen)
            jv_list_push(cx, out, l->u.l.v[i]);
    }
    return out;
}

static struct jv *length_of(struct jctx *cx, struct jv *v)
{
    switch (v->kind) {
    case JV_STR: jx_work(cx, v->u.s.n); return jv_int(cx, (int64_t)utf8_count(v->u.s.p, v->u.s.n));
    case JV_LIST: return jv_int(cx, (int64_t)v->u.l.n);
    case JV_DICT: return jv_int(cx, (int64_t)v->u.d.n);
    case JV_UNDEF: return jv_int(cx, 0);
    default: bad_type(cx, "length", v);
    }
}

/* Every filter takes the value and the call's arguments. Text filters see
 * str(value), with undefined as "". */
typedef struct jv *(*filter_fn)(struct jctx *cx, struct jv *v, const struct call *c);

static struct jv *f_default(struct jctx *cx, struct jv *v, const struct call *c)
{
    struct jv *d = arg(c, 0, "default_value");
    if (v->kind == JV_UNDEF || (arg_bool(c, 1, "boolean", false) && !jv_truthy(v)))
        return d ? d : jv_cstr(cx, "");
    return v;
}

static struct jv *f_safe(struct jctx *cx, struct jv *v, const struct call *c) { (void)cx, (void)c; return v; }
static struct jv *f_string(struct jctx *cx, struct jv *v, const struct call *c) { (void)c; return jv_to_str(cx, v); }
static struct jv *f_length(struct jctx *cx, struct jv *v, const struct call *c) { (void)c; return length_of(cx, v); }
static struct jv *f_unique(struct jctx *cx, struct jv *v, const struct call *c) { (void)c; return unique_items(cx, v); }
static struct jv *f_from_json(struct jctx *cx, struct jv *v, const struct call *c) { (void)c; return from_json_text(cx, v); }
static struct jv *f_int(struct jctx *cx, struct jv *v, const struct call *c) { return to_int(cx, v, c); }
static struct jv *f_tojson(struct jctx *cx, struct jv *v, const struct call *c) { return tojson(cx, v, c); }
static struct jv *f_map(struct jctx *cx, struct jv *v, const struct call *c) { return map_items(cx, v, c); }
static struct jv *f_min(struct jctx *cx, struct jv *v, const struct call *c) { return min_max(cx, v, c, false); }
static struct jv *f_max(struct jctx *cx, struct jv *v, const struct call *c) { return min_max(cx, v, c, true); }
static struct jv *f_selectattr(struct jctx *cx, struct jv *v, const struct call *c) { return select_items(cx, v, c, true, true); }
static struct jv *f_rejectattr(struct jctx *cx, struct jv *v, const struct call *c) { return select_items(cx, v, c, true, false); }
static struct jv *f_select(struct jctx *cx, struct jv *v, const struct call *c) { return select_items(cx, v, c, false, true); }
static struct jv *f_reject(struct jctx *cx, struct jv *v, const struct call *c) { return select_items(cx, v, c, false, false); }
static struct jv *f_lower(struct jctx *cx, struct jv *v, const struct call *c) { (void)c; return change_case(cx, v, 0); }
static struct jv *f_upper(struct jctx *cx, struct jv *v, const struct call *c) { (void)c; return change_case(cx, v, 1); }
static struct jv *f_title(struct jctx *cx, struct jv *v, const struct call *c) { (void)c; return change_case(cx, v, 2); }
static struct jv *f_capitalize(struct jctx *cx, struct jv *v, const struct call *c) { (void)c; return change_case(cx, v, 3); }
static struct jv *f_indent(struct jctx *cx, struct jv *v, const struct call *c) { return indent_text(cx, v, c); }

static struct jv *f_trim(struct jctx *cx, struct jv *v, const struct call *c)
{
    return strip(cx, v, arg_str(cx, c, 0, "chars"), true, true);
}

static struct jv *f_wordcount(struct jctx *cx, struct jv *v, const struct call *c)
{
    (void)c;
    return jv_int(cx, (int64_t)split_str(cx, v, NULL, -1)->u.l.n);
}

static struct jv *f_replace(struct jctx *cx, struct jv *v, const struct call *c)
{
    return replace_str(cx, v, need_str(cx, "replace", need_arg(cx, c, 0, "the old text")),
                       need_str(cx, "replace", jv_to_str(cx, need_arg(cx, c, 1, "the new text"))),
                       arg_int(cx, c, 2, "count", -1));
}

static struct jv *f_items(struct jctx *cx, struct jv *v, const struct call *c)
{
    (void)c;
    if (v->kind == JV_UNDEF || v->kind == JV_NONE)
        return jv_list(cx);
    if (v->kind != JV_DICT)
        bad_type(cx, "items", v);
    return dict_items(cx, v);
}

static struct jv *f_list(struct jctx *cx, struct jv *v, const struct call *c)
{
    (void)c;
    return copy_list(cx, as_list(cx, "list", v));
}

static struct jv *f_join(struct jctx *cx, struct jv *v, const struct call *c)
{
    return join_items(cx, as_list(cx, "join", v), arg_str(cx, c, 0, "d"), arg_str(cx, c, 1, "attribute"));
}

static struct jv *f_first(struct jctx *cx, struct jv *v, const struct call *c)
{
    (void)c;
    struct jv *l = as_list(cx, "first", v);
    return l->u.l.n ? l->u.l.v[0] : &jv_undef_v;
}

static struct jv *f_last(struct jctx *cx, struct jv *v, const struct call *c)
{
    (void)c;
    struct jv *l = as_list(cx, "last", v);
    return l->u.l.n ? l->u.l.v[l->u.l.n - 1] : &jv_undef_v;
}

static struct jv *f_reverse(struct jctx *cx, struct jv *v, const struct call *c)
{
    (void)c;
    struct jv *l = as_list(cx, "reverse", v);
    if (v->kind == JV_STR) {
        struct jbuf b = {0};
        for (size_t i = l->u.l.n; i-- > 0;)
            jbuf_put(cx, &b, l->u.l.v[i]->u.s.p, l->u.l.v[i]->u.s.n);
        return from_buf(cx, &b);
    }
    struct jv *r = jv_list(cx);
    for (size_t i = l->u.l.n; i-- > 0;)
        jv_list_push(cx, r, l->u.l.v[i]);
    return r;
}

static struct jv *f_sort(struct jctx *cx, struct jv *v, const struct call *c)
{
    struct jv *l = copy_list(cx, as_list(cx, "sort", v));
    sort_list(cx, l->u.l.v, l->u.l.n, arg_str(cx, c, 2, "attribute"), arg_bool(c, 0, "reverse", false),
              arg_bool(c, 1, "case_sensitive", false), false);
    return l;
}

static struct jv *f_dictsort(struct jctx *cx, struct jv *v, const struct call *c)
{
    if (v->kind != JV_DICT)
        bad_type(cx, "dictsort", v);
    struct jv *l = dict_items(cx, v);
    sort_list(cx, l->u.l.v, l->u.l.n, NULL, arg_bool(c, 2, "reverse", false), arg_bool(c, 0, "case_sensitive", false),
              true);
    return l;
}

static struct jv *f_float(struct jctx *cx, struct jv *v, const struct call *c)
{
    if (v->kind == JV_FLOAT)
        return v;
    if (v->kind == JV_INT || v->kind == JV_BOOL)
        return jv_float(cx, v->kind == JV_INT ? (double)v->u.i : v->u.b);
    if (v->kind == JV_STR) {
        const char *text = jv_c_str(cx, v);
        char *end;
        double d = strtod(text, &end);
        if (end != text && end == text + v->u.s.n)
            return jv_float(cx, d);
    }
    struct jv *d = arg(c, 0, "default");
    return d ? d : jv_float(cx, 0.0);
}

static struct jv *f_abs(struct jctx *cx, struct jv *v, const struct call *c)
{
    (void)c;
    if (v->kind == JV_BOOL)
        return jv_int(cx, v->u.b);
    if (v->kind == JV_INT)
        return jv_int(cx, v->u.i < 0 ? (int64_t)(0 - (uint64_t)v->u.i) : v->u.i);
    if (v->kind == JV_FLOAT)
        return jv_float(cx, fabs(v->u.f));
    bad_type(cx, "abs", v);
}

static struct jv *f_round(struct jctx *cx, struct jv *v, const struct call *c)
{
    if (v->kind != JV_FLOAT && v->kind != JV_INT && v->kind != JV_BOOL)
        bad_type(cx, "round", v);
    if (v->kind != JV_FLOAT && arg_int(cx, c, 0, "precision", 0) >= 0) /* Python's round keeps an int */
        return v->kind == JV_INT ? v : jv_int(cx, v->u.b);
    double x = v->kind == JV_FLOAT ? v->u.f : v->kind == JV_INT ? (double)v->u.i : v->u.b;
    double p = pow(10.0, (double)arg_int(cx, c, 0, "precision", 0));
    return jv_float(cx, nearbyint(x * p) / p);
}

static struct jv *f_sum(struct jctx *cx, struct jv *v, const struct call *c)
{
    struct jv *l = as_list(cx, "sum", v), *acc = jv_int(cx, 0);
    struct jv *attr = arg_str(cx, c, SIZE_MAX, "attribute");
    for (size_t i = 0; i < l->u.l.n; i++) {
        struct jv *x = attr ? get_path(cx, l->u.l.v[i], attr) : l->u.l.v[i];
        if (x->kind == JV_FLOAT || acc->kind == JV_FLOAT)
            acc = jv_float(cx, (acc->kind == JV_FLOAT ? acc->u.f : (double)acc->u.i) +
                                   (x->kind == JV_FLOAT ? x->u.f : (double)x->u.i));
        else if (x->kind == JV_INT)
            acc = jv_int(cx, (int64_t)((uint64_t)acc->u.i + (uint64_t)x->u.i));
        else
            bad_type(cx, "sum", x);
    }
    return acc;
}

static const struct filter {
    const char *name;
    filter_fn fn;
    bool on_text; /* works on str(value), undefined as "" */
} filters[] = {
    {"abs", f_abs, false},          {"capitalize", f_capitalize, true}, {"count", f_length, false},
    {"d", f_default, false},        {"default", f_default, false},      {"dictsort", f_dictsort, false},
    {"first", f_first, false},      {"float", f_float, false},          {"from_json", f_from_json, false},
    {"indent", f_indent, true},     {"int", f_int, false},              {"items", f_items, false},
    {"join", f_join, false},        {"last", f_last, false},            {"length", f_length, false},
    {"list", f_list, false},        {"lower", f_lower, true},           {"map", f_map, false},
    {"max", f_max, false},          {"min", f_min, false},              {"reject", f_reject, false},
    {"rejectattr", f_rejectattr, false}, {"replace", f_replace, true},  {"reverse", f_reverse, false},
    {"round", f_round, false},      {"safe", f_safe, false},            {"select", f_select, false},
    {"selectattr", f_selectattr, false}, {"sort", f_sort, false},       {"string", f_string, false},
    {"sum", f_sum, false},          {"title", f_title, true},           {"tojson", f_tojson, false},
    {"trim", f_trim, true},         {"unique", f_unique, false},        {"upper", f_upper, true},
    {"wordcount", f_wordcount, true},
};

static const struct filter *find_filter(const char *name)
{
    for (size_t i = 0; i < sizeof filters / sizeof filters[0]; i++)
        if (!strcmp(filters[i].name, name))
            return &filters[i];
    return NULL;
}

bool jx_has_filter(const char *name) { return find_filter(name) != NULL; }

struct jv *jx_filter(struct jctx *cx, const char *name, struct jv *v, struct jv **args, size_t n_args,
                     const char **kw_names, struct jv **kw_vals, size_t n_kw)
{
    const struct filter *f = find_filter(name);
    if (!f)
        jx_fail(cx, KS_ERR_UNSUPPORTED, "unknown filter '%s'", name);
    jx_step(cx);
    struct call c = {name, args, n_args, kw_names, kw_vals, n_kw};
    if (f->on_text)
        v = v->kind == JV_UNDEF ? jv_cstr(cx, "") : jv_to_str(cx, v);
    return f->fn(cx, v, &c);
}
