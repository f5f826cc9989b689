/* jinja: the interpreter. Statements write to cx->out; expressions return
 * values in the render's arena. Scopes follow Jinja2: a for body and a macro
 * body each get their own, `if` does not, and `set` writes to the innermost. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja/jinja_internal.h"

#define DEFAULT_MAX_OUTPUT (4u << 20)
#define DEFAULT_MAX_STRING (4u << 20)
#define DEFAULT_MAX_STEPS 10000000u
#define DEFAULT_MAX_DEPTH 200u
#define DEFAULT_MAX_MEMORY (64u << 20)

/* ---- scopes -------------------------------------------------------------- */

static struct scope *scope_new(struct jctx *cx, struct scope *parent)
{
    struct scope *s = jx_alloc(cx, sizeof *s);
    s->parent = parent;
    return s;
}

static void scope_set(struct jctx *cx, struct scope *s, const char *name, struct jv *v)
{
    for (size_t i = 0; i < s->n; i++)
        if (!strcmp(s->names[i], name)) {
            s->vals[i] = v;
            return;
        }
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 4;
        const char **nn = jx_alloc(cx, cap * sizeof *nn);
        struct jv **nv = jx_alloc(cx, cap * sizeof *nv);
        if (s->n) {
            memcpy(nn, s->names, s->n * sizeof *nn);
            memcpy(nv, s->vals, s->n * sizeof *nv);
        }
        s->names = nn;
        s->vals = nv;
        s->cap = cap;
    }
    s->names[s->n] = name;
    s->vals[s->n++] = v;
}

static struct jv *scope_get(const struct scope *s, const char *name)
{
    for (; s; s = s->parent)
        for (size_t i = s->n; i-- > 0;)
            if (!strcmp(s->names[i], name))
                return s->vals[i];
    return NULL;
}

static struct jv *undefined_named(struct jctx *cx, const char *name)
{
    struct jv *v = jx_alloc(cx, sizeof *v);
    v->kind = JV_UNDEF;
    v->u.s.p = name;
    v->u.s.n = strlen(name);
    return v;
}

/* ---- expressions --------------------------------------------------------- */

static struct jv *eval(struct jctx *cx, struct scope *sc, const struct jn *n);
static void exec(struct jctx *cx, struct scope *sc, const struct jn *n);

static int64_t as_int(struct jctx *cx, const struct jv *v, const char *what)
{
    if (v->kind == JV_INT)
        return v->u.i;
    if (v->kind == JV_BOOL)
        return v->u.b;
    jx_fail(cx, KS_ERR_INVALID_ARG, "%s must be an integer, not %s", what, jv_kind_name(v));
}

/* Byte offsets of the code points of s: off[i] starts code point i, off[n] = len. */
static size_t *utf8_offsets(struct jctx *cx, const char *s, size_t len, size_t *n_cp)
{
    size_t *off = jx_alloc(cx, (len + 1) * sizeof *off);
    size_t n = 0;
    for (size_t i = 0; i < len; i++)
        if (((unsigned char)s[i] & 0xC0) != 0x80)
            off[n++] = i;
    off[n] = len;
    *n_cp = n;
    return off;
}

static struct jv *loop_attr(struct jctx *cx, const struct jv *loop, const char *name);

static struct jv *index_value(struct jctx *cx, struct jv *obj, struct jv *idx)
{
    if (obj->kind == JV_LOOP && idx->kind == JV_STR)
        return loop_attr(cx, obj, jv_c_str(cx, idx));
    if (obj->kind == JV_DICT) {
        jx_work(cx, obj->u.d.n);
        struct jv *v = jv_dict_getv(obj, idx);
        if (v)
            return v;
        if (idx->kind == JV_STR)
        {
            struct jv *m = jx_method(cx, obj, jv_c_str(cx, idx));
            return m ? m : &jv_undef_v;
        }
        return &jv_undef_v;
    }
    if ((obj->kind == JV_LIST || obj->kind == JV_STR) && (idx->kind == JV_INT || idx->kind == JV_BOOL)) {
        int64_t i = as_int(cx, idx, "an index");
        if (obj->kind == JV_LIST) {
            int64_t n = (int64_t)obj->u.l.n;
            if (i < 0)
                i += n;
            return i >= 0 && i < n ? obj->u.l.v[i] : &jv_undef_v;
        }
        size_t n_cp;
        size_t *off = utf8_offsets(cx, obj->u.s.p, obj->u.s.n, &n_cp);
        if (i < 0)
            i += (int64_t)n_cp;
        if (i < 0 || i >= (int64_t)n_cp)
            return &jv_undef_v;
        return jv_str(cx, obj->u.s.p + off[i], off[i + 1] - off[i]);
    }
    return &jv_undef_v;
}

static struct jv *attr_value(struct jctx *cx, struct jv *obj, const char *name, size_t len)
{
    if (obj->kind == JV_LOOP)
        return loop_attr(cx, obj, name);
    if (obj->kind == JV_DICT) {
        jx_work(cx, obj->u.d.n);
        struct jv *v = jv_dict_get(obj, name, len);
        if (v)
            return v;
    }
    struct jv *m = jx_method(cx, obj, name);
    if (m)
        return m;
    if (obj->kind == JV_LIST && len && name[0] >= '0' && name[0] <= '9')
        return index_value(cx, obj, jv_int(cx, strtoll(name, NULL, 10)));
    return &jv_undef_v;
}

/* An index far outside [-n-1, n+1] acts like those bounds (and cannot
 * overflow when n is added). */
static int64_t clamp_index(int64_t i, int64_t n)
{
    return i < -n - 1 ? -n - 1 : i > n + 1 ? n + 1 : i;
}

/* Python's slice bounds for a sequence of n. */
static void slice_bounds(struct jctx *cx, struct jv *a, struct jv *b, struct jv *c, int64_t n, int64_t *start,
                         int64_t *stop, int64_t *step)
{
    *step = c && c->kind != JV_NONE ? as_int(cx, c, "a slice step") : 1;
    if (*step == 0)
        jx_fail(cx, KS_ERR_INVALID_ARG, "slice step cannot be zero");
    int64_t lo = *step > 0 ? 0 : -1, hi = *step > 0 ? n : n - 1;
    if (*step == INT64_MIN)
        *step = -n - 1;
    if (a && a->kind != JV_NONE) {
        *start = clamp_index(as_int(cx, a, "a slice start"), n);
        if (*start < 0)
            *start = *start + n < lo ? lo : *start + n;
        else if (*start > hi)
            *start = hi;
    } else {
        *start = *step > 0 ? lo : hi;
    }
    if (b && b->kind != JV_NONE) {
        *stop = clamp_index(as_int(cx, b, "a slice stop"), n);
        if (*stop < 0)
            *stop = *stop + n < lo ? lo : *stop + n;
        else if (*stop > hi)
            *stop = hi;
    } else {
        *stop = *step > 0 ? hi : lo;
    }
}

static struct jv *slice_value(struct jctx *cx, struct jv *obj, struct jv *a, struct jv *b, struct jv *c)
{
    int64_t start, stop, step;
    if (obj->kind == JV_LIST) {
        slice_bounds(cx, a, b, c, (int64_t)obj->u.l.n, &start, &stop, &step);
        struct jv *l = jv_list(cx);
        for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step)
            jv_list_push(cx, l, obj->u.l.v[i]);
        return l;
    }
    if (obj->kind == JV_STR) {
        size_t n_cp;
        size_t *off = utf8_offsets(cx, obj->u.s.p, obj->u.s.n, &n_cp);
        slice_bounds(cx, a, b, c, (int64_t)n_cp, &start, &stop, &step);
        if (step == 1)
            return jv_str(cx, obj->u.s.p + off[start], start < stop ? off[stop] - off[start] : 0);
        struct jbuf buf = {0};
        for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step)
            jbuf_put(cx, &buf, obj->u.s.p + off[i], off[i + 1] - off[i]);
        return jv_str(cx, buf.p ? buf.p : "", buf.n);
    }
    if (obj->kind == JV_UNDEF)
        return obj;
    jx_fail(cx, KS_ERR_INVALID_ARG, "cannot slice a %s", jv_kind_name(obj));
}

static bool is_number(const struct jv *v) { return v->kind == JV_INT || v->kind == JV_FLOAT || v->kind == JV_BOOL; }
static double to_double(const struct jv *v)
{
    return v->kind == JV_FLOAT ? v->u.f : v->kind == JV_INT ? (double)v->u.i : (double)v->u.b;
}

/* a ~ b, and a + b with a string: a's text grows in place when it can. */
static struct jv *concat_values(struct jctx *cx, struct jv *a, struct jv *b)
{
    struct jv *left = a->kind == JV_STR ? a : jv_to_str(cx, a);
    struct jv *right = jv_to_str(cx, b);
    return jv_concat(cx, left, right->u.s.p, right->u.s.n);
}

/* The text + gives a value beside a string: llama.cpp writes a dict or list
 * as JSON there. */
static struct jv *plus_text(struct jctx *cx, struct jv *x)
{
    if (x->kind != JV_LIST && x->kind != JV_DICT)
        return jv_to_str(cx, x);
    struct jbuf buf = {0};
    jv_to_json(cx, &buf, x, -1, false);
    return jv_str(cx, buf.p ? buf.p : "", buf.n);
}

static struct jv *add_values(struct jctx *cx, struct jv *a, struct jv *b)
{
    if (a->kind == JV_LIST && b->kind == JV_LIST) {
        struct jv *l = jv_list(cx);
        for (size_t i = 0; i < a->u.l.n; i++)
            jv_list_push(cx, l, a->u.l.v[i]);
        for (size_t i = 0; i < b->u.l.n; i++)
            jv_list_push(cx, l, b->u.l.v[i]);
        return l;
    }
    /* strings join; like llama.cpp, an undefined beside a string is "" and
     * a dict or list is written as JSON */
    bool a_text = a->kind == JV_STR || a->kind == JV_UNDEF || a->kind == JV_LIST || a->kind == JV_DICT;
    bool b_text = b->kind == JV_STR || b->kind == JV_UNDEF || b->kind == JV_LIST || b->kind == JV_DICT;
    if ((a->kind == JV_STR || b->kind == JV_STR) && a_text && b_text) {
        struct jv *right = plus_text(cx, b);
        return jv_concat(cx, plus_text(cx, a), right->u.s.p, right->u.s.n);
    }
    if (is_number(a) && is_number(b)) {
        if (a->kind != JV_FLOAT && b->kind != JV_FLOAT)
            return jv_int(cx, (int64_t)((uint64_t)as_int(cx, a, "") + (uint64_t)as_int(cx, b, "")));
        return jv_float(cx, to_double(a) + to_double(b));
    }
    jx_fail(cx, KS_ERR_INVALID_ARG, "arithmetic on %s and %s", jv_kind_name(a), jv_kind_name(b));
}

static struct jv *repeat_string(struct jctx *cx, struct jv *s, int64_t times)
{
    struct jbuf buf = {0};
    for (int64_t i = 0; i < times; i++) {
        jx_step(cx);
        jbuf_put(cx, &buf, s->u.s.p, s->u.s.n);
    }
    return jv_str(cx, buf.p ? buf.p : "", buf.n);
}

static struct jv *arith(struct jctx *cx, int op, struct jv *a, struct jv *b)
{
    if (op == OP_ADD)
        return add_values(cx, a, b);
    if (op == OP_MUL && a->kind == JV_STR && (b->kind == JV_INT || b->kind == JV_BOOL))
        return repeat_string(cx, a, as_int(cx, b, "a repeat count"));
    if (op == OP_MUL && b->kind == JV_STR && (a->kind == JV_INT || a->kind == JV_BOOL))
        return repeat_string(cx, b, as_int(cx, a, "a repeat count"));
    if (!is_number(a) || !is_number(b))
        jx_fail(cx, KS_ERR_INVALID_ARG, "arithmetic on %s and %s", jv_kind_name(a), jv_kind_name(b));
    bool ints = a->kind != JV_FLOAT && b->kind != JV_FLOAT;
    double x = to_double(a), y = to_double(b);
    if ((op == OP_DIV || op == OP_FLOORDIV || op == OP_MOD) && y == 0)
        jx_fail(cx, KS_ERR_INVALID_ARG, "division by zero");
    if (ints) {
        uint64_t i = (uint64_t)as_int(cx, a, ""), j = (uint64_t)as_int(cx, b, "");
        int64_t si = (int64_t)i, sj = (int64_t)j;
        switch (op) {
        case OP_SUB: return jv_int(cx, (int64_t)(i - j));
        case OP_MUL: return jv_int(cx, (int64_t)(i * j));
        case OP_FLOORDIV:
            if (sj == -1)
                return jv_int(cx, (int64_t)(0 - i));
            return jv_int(cx, si / sj - ((si % sj != 0) && ((si < 0) != (sj < 0))));
        case OP_MOD: {
            if (sj == -1)
                return jv_int(cx, 0);
            int64_t m = si % sj;
            return jv_int(cx, m != 0 && ((m < 0) != (sj < 0)) ? m + sj : m);
        }
        default: break;
        }
    }
    switch (op) {
    case OP_SUB: return jv_float(cx, x - y);
    case OP_MUL: return jv_float(cx, x * y);
    case OP_DIV: return jv_float(cx, x / y);
    case OP_FLOORDIV: return jv_float(cx, floor(x / y));
    case OP_MOD: return jv_float(cx, x - y * floor(x / y));
    case OP_POW:
        if (ints && y >= 0 && fabs(pow(x, y)) < 9.2e18)
            return jv_int(cx, (int64_t)pow(x, y));
        return jv_float(cx, pow(x, y));
    default: jx_fail(cx, KS_ERR_INTERNAL, "bad operator %d", op);
    }
}

/* Comparing dicts looks each key up in the other: quadratic in their size. */
static size_t equality_work(const struct jv *a)
{
    size_t n = jv_size(a);
    return a->kind == JV_DICT ? (n < 65536 ? n * n : SIZE_MAX) : n;
}

static struct jv *eval_binary(struct jctx *cx, struct scope *sc, const struct jn *n)
{
    struct jv *a = eval(cx, sc, n->a), *b = eval(cx, sc, n->b);
    cx->where = n;
    switch (n->op) {
    case OP_EQ: jx_work(cx, equality_work(a)); return jv_bool(jv_equal(a, b));
    case OP_NE: jx_work(cx, equality_work(a)); return jv_bool(!jv_equal(a, b));
    case OP_LT: return jv_bool(jv_compare(cx, a, b) < 0);
    case OP_LE: return jv_bool(jv_compare(cx, a, b) <= 0);
    case OP_GT: return jv_bool(jv_compare(cx, a, b) > 0);
    case OP_GE: return jv_bool(jv_compare(cx, a, b) >= 0);
    case OP_IN: return jv_bool(jv_contains(cx, b, a));
    case OP_NOTIN: return jv_bool(!jv_contains(cx, b, a));
    case OP_CONCAT: return concat_values(cx, a, b);
    default: return arith(cx, n->op, a, b);
    }
}

static struct jv *eval_unary(struct jctx *cx, struct scope *sc, const struct jn *n)
{
    struct jv *a = eval(cx, sc, n->a);
    cx->where = n;
    if (n->op == OP_NOT)
        return jv_bool(!jv_truthy(a));
    if (!is_number(a))
        jx_fail(cx, KS_ERR_INVALID_ARG, "unary %c on %s", n->op == OP_NEG ? '-' : '+', jv_kind_name(a));
    if (n->op == OP_POS)
        return a;
    if (a->kind == JV_FLOAT)
        return jv_float(cx, -a->u.f);
    return jv_int(cx, (int64_t)(0 - (uint64_t)as_int(cx, a, "")));
}

/* Evaluated arguments of a call, filter or test. */
struct args {
    struct jv **pos;
    size_t n_pos;
    const char **kw_names;
    struct jv **kw_vals;
    size_t n_kw;
};

static struct args eval_args(struct jctx *cx, struct scope *sc, const struct jn *n)
{
    struct args a = {0};
    a.n_pos = n->n_kids;
    a.pos = jx_alloc(cx, (n->n_kids + 1) * sizeof *a.pos);
    for (size_t i = 0; i < n->n_kids; i++)
        a.pos[i] = eval(cx, sc, n->kids[i]);
    a.n_kw = n->n_kw;
    a.kw_names = n->kw_names;
    a.kw_vals = jx_alloc(cx, (n->n_kw + 1) * sizeof *a.kw_vals);
    for (size_t i = 0; i < n->n_kw; i++)
        a.kw_vals[i] = eval(cx, sc, n->kw_vals[i]);
    return a;
}

static struct jv *call_macro(struct jctx *cx, struct jv *fn, struct jv **args, size_t n_args, const char **kw_names,
                             struct jv **kw_vals, size_t n_kw)
{
    const struct jn *m = fn->u.m.node;
    struct scope *sc = scope_new(cx, fn->u.m.closure);
    for (size_t i = 0; i < m->n_names; i++) {
        struct jv *v = i < n_args ? args[i] : NULL;
        for (size_t k = 0; k < n_kw && !v; k++)
            if (!strcmp(kw_names[k], m->names[i]))
                v = kw_vals[k];
        if (!v)
            v = m->kids[i] ? eval(cx, sc, m->kids[i]) : undefined_named(cx, m->names[i]);
        scope_set(cx, sc, m->names[i], v);
    }
    struct jbuf buf = {0}, *saved = cx->out;
    int saved_ctl = cx->loop_ctl;
    cx->out = &buf;
    exec(cx, sc, m->b);
    cx->out = saved;
    cx->loop_ctl = saved_ctl;
    return jv_str(cx, buf.p ? buf.p : "", buf.n);
}

struct jv *jx_call_value(struct jctx *cx, struct jv *fn, struct jv **args, size_t n_args, const char **kw_names,
                         struct jv **kw_vals, size_t n_kw)
{
    if (fn->kind == JV_MACRO) {
        if (++cx->depth > cx->opts.max_depth)
            jx_fail(cx, KS_ERR_RANGE, "macro calls nested deeper than the depth limit %u", cx->opts.max_depth);
        struct jv *r = call_macro(cx, fn, args, n_args, kw_names, kw_vals, n_kw);
        cx->depth--;
        return r;
    }
    if (fn->kind == JV_BUILTIN || fn->kind == JV_METHOD)
        return jx_call_builtin(cx, fn, args, n_args, kw_names, kw_vals, n_kw);
    if (fn->kind == JV_UNDEF && fn->u.s.p)
        jx_fail(cx, KS_ERR_INVALID_ARG, "'%.*s' is undefined, it cannot be called", (int)fn->u.s.n, fn->u.s.p);
    jx_fail(cx, KS_ERR_INVALID_ARG, "a %s cannot be called", jv_kind_name(fn));
}

static struct jv *eval_call(struct jctx *cx, struct scope *sc, const struct jn *n)
{
    struct jv *fn;
    if (n->a->kind == E_ATTR) {
        struct jv *obj = eval(cx, sc, n->a->a);
        cx->where = n->a;
        fn = attr_value(cx, obj, n->a->name, n->a->name_len);
        if (fn->kind == JV_UNDEF)
            jx_fail(cx, KS_ERR_INVALID_ARG, "a %s has no method '%s'", jv_kind_name(obj), n->a->name);
    } else {
        fn = eval(cx, sc, n->a);
    }
    struct args a = eval_args(cx, sc, n);
    cx->where = n;
    return jx_call_value(cx, fn, a.pos, a.n_pos, a.kw_names, a.kw_vals, a.n_kw);
}

static struct jv *eval_collection(struct jctx *cx, struct scope *sc, const struct jn *n)
{
    if (n->kind == E_DICT) {
        struct jv *d = jv_dict(cx);
        for (size_t i = 0; i < n->n_kids; i++) {
            struct jv *k = eval(cx, sc, n->kids[i]);
            jv_dict_set(cx, d, k, eval(cx, sc, n->kw_vals[i]));
        }
        return d;
    }
    struct jv *l = jv_list(cx);
    l->is_tuple = n->kind == E_TUPLE;
    for (size_t i = 0; i < n->n_kids; i++)
        jv_list_push(cx, l, eval(cx, sc, n->kids[i]));
    return l;
}

static struct jv *eval_node(struct jctx *cx, struct scope *sc, const struct jn *n)
{
    switch (n->kind) {
    case E_LIT: return n->lit;
    case E_NAME: {
        struct jv *v = scope_get(sc, n->name);
        return v ? v : undefined_named(cx, n->name);
    }
    case E_ATTR: {
        struct jv *obj = eval(cx, sc, n->a);
        cx->where = n;
        return attr_value(cx, obj, n->name, n->name_len);
    }
    case E_INDEX: {
        struct jv *obj = eval(cx, sc, n->a), *idx = eval(cx, sc, n->b);
        cx->where = n;
        return index_value(cx, obj, idx);
    }
    case E_SLICE: {
        struct jv *obj = eval(cx, sc, n->a);
        struct jv *a = n->b ? eval(cx, sc, n->b) : NULL, *b = n->c ? eval(cx, sc, n->c) : NULL;
        struct jv *c = n->d ? eval(cx, sc, n->d) : NULL;
        cx->where = n;
        return slice_value(cx, obj, a, b, c);
    }
    case E_CALL: return eval_call(cx, sc, n);
    case E_FILTER: {
        struct jv *v = eval(cx, sc, n->a);
        struct args a = eval_args(cx, sc, n);
        cx->where = n;
        return jx_filter(cx, n->name, v, a.pos, a.n_pos, a.kw_names, a.kw_vals, a.n_kw);
    }
    case E_TEST: {
        struct jv *v = eval(cx, sc, n->a);
        struct args a = eval_args(cx, sc, n);
        cx->where = n;
        bool r = jx_test(cx, n->name, v, a.pos, a.n_pos);
        return jv_bool(n->op ? !r : r);
    }
    case E_UNARY: return eval_unary(cx, sc, n);
    case E_BINARY: return eval_binary(cx, sc, n);
    case E_AND: {
        struct jv *a = eval(cx, sc, n->a);
        return jv_truthy(a) ? eval(cx, sc, n->b) : a;
    }
    case E_OR: {
        struct jv *a = eval(cx, sc, n->a);
        return jv_truthy(a) ? a : eval(cx, sc, n->b);
    }
    case E_COND:
        if (jv_truthy(eval(cx, sc, n->a)))
            return eval(cx, sc, n->b);
        return n->c ? eval(cx, sc, n->c) : &jv_undef_v;
    case E_LIST: case E_TUPLE: case E_DICT: return eval_collection(cx, sc, n);
    default: jx_fail(cx, KS_ERR_INTERNAL, "node %d is not an expression", (int)n->kind);
    }
}

static struct jv *eval(struct jctx *cx, struct scope *sc, const struct jn *n)
{
    cx->where = n;
    jx_step(cx);
    if (++cx->depth > cx->opts.max_depth)
        jx_fail(cx, KS_ERR_RANGE, "expressions nested deeper than the depth limit %u", cx->opts.max_depth);
    struct jv *v = eval_node(cx, sc, n);
    cx->depth--;
    return v;
}

/* ---- statements ---------------------------------------------------------- */

static void put_out(struct jctx *cx, const char *p, size_t n) { jbuf_put(cx, cx->out, p, n); }

/* The items a for loop walks: a list's elements, a dict's keys, a string's
 * characters; undefined walks nothing. */
static struct jv *iteration_items(struct jctx *cx, struct jv *v)
{
    struct jv *l = jv_walk_list(cx, v);
    if (l)
        return l;
    l = jv_list(cx);
    if (v->kind == JV_STR) {
        size_t n_cp;
        size_t *off = utf8_offsets(cx, v->u.s.p, v->u.s.n, &n_cp);
        for (size_t i = 0; i < n_cp; i++)
            jv_list_push(cx, l, jv_str(cx, v->u.s.p + off[i], off[i + 1] - off[i]));
    } else if (v->kind != JV_UNDEF) {
        jx_fail(cx, KS_ERR_INVALID_ARG, "a %s cannot be iterated", jv_kind_name(v));
    }
    return l;
}

static void bind_targets(struct jctx *cx, struct scope *sc, const char **names, size_t n_names, struct jv *v)
{
    if (n_names == 1) {
        scope_set(cx, sc, names[0], v);
        return;
    }
    if (v->kind != JV_LIST || v->u.l.n != n_names)
        jx_fail(cx, KS_ERR_INVALID_ARG, "cannot unpack a %s into %zu names", jv_kind_name(v), n_names);
    for (size_t i = 0; i < n_names; i++)
        scope_set(cx, sc, names[i], v->u.l.v[i]);
}

static struct jv *loop_object(struct jctx *cx, struct jv *items, size_t i)
{
    struct jv *loop = jx_alloc(cx, sizeof *loop);
    loop->kind = JV_LOOP;
    loop->u.loop.items = items;
    loop->u.loop.i = i;
    return loop;
}

/* loop.index, loop.last, ...: computed from the items and the position. */
static struct jv *loop_attr(struct jctx *cx, const struct jv *loop, const char *name)
{
    struct jv *items = loop->u.loop.items;
    size_t i = loop->u.loop.i, n = items->u.l.n;
    if (!strcmp(name, "index")) return jv_int(cx, (int64_t)i + 1);
    if (!strcmp(name, "index0")) return jv_int(cx, (int64_t)i);
    if (!strcmp(name, "revindex")) return jv_int(cx, (int64_t)(n - i));
    if (!strcmp(name, "revindex0")) return jv_int(cx, (int64_t)(n - i - 1));
    if (!strcmp(name, "first")) return jv_bool(i == 0);
    if (!strcmp(name, "last")) return jv_bool(i + 1 == n);
    if (!strcmp(name, "length")) return jv_int(cx, (int64_t)n);
    if (!strcmp(name, "previtem")) return i > 0 ? items->u.l.v[i - 1] : &jv_undef_v;
    if (!strcmp(name, "nextitem")) return i + 1 < n ? items->u.l.v[i + 1] : &jv_undef_v;
    return &jv_undef_v;
}

static void exec_for(struct jctx *cx, struct scope *sc, const struct jn *n)
{
    struct jv *items = iteration_items(cx, eval(cx, sc, n->a));
    if (n->d) {
        struct jv *kept = jv_list(cx);
        for (size_t i = 0; i < items->u.l.n; i++) {
            jx_step(cx);
            struct scope *fs = scope_new(cx, sc);
            bind_targets(cx, fs, n->names, n->n_names, items->u.l.v[i]);
            if (jv_truthy(eval(cx, fs, n->d)))
                jv_list_push(cx, kept, items->u.l.v[i]);
        }
        items = kept;
    }
    for (size_t i = 0; i < items->u.l.n; i++) { /* a body that appends to the list walks on, within the budget */
        cx->where = n;
        jx_step(cx);
        struct scope *body = scope_new(cx, sc);
        bind_targets(cx, body, n->names, n->n_names, items->u.l.v[i]);
        scope_set(cx, body, "loop", loop_object(cx, items, i));
        exec(cx, body, n->b);
        int ctl = cx->loop_ctl;
        cx->loop_ctl = 0;
        if (ctl == 1)
            break;
    }
    if (!items->u.l.n && n->c)
        exec(cx, sc, n->c);
}

static void exec_set(struct jctx *cx, struct scope *sc, const struct jn *n)
{
    struct jv *v = eval(cx, sc, n->b);
    cx->where = n;
    if (!n->a) {
        bind_targets(cx, sc, n->names, n->n_names, v);
        return;
    }
    struct jv *obj = scope_get(sc, n->a->a->name);
    if (!obj || obj->kind != JV_DICT)
        jx_fail(cx, KS_ERR_INVALID_ARG, "'set %s.%s': %s is not a namespace", n->a->a->name, n->a->name,
                n->a->a->name);
    jx_work(cx, obj->u.d.n);
    for (size_t i = 0; i < obj->u.d.n; i++) { /* an existing attribute: no new key string */
        const struct jv *k = obj->u.d.k[i];
        if (k->kind == JV_STR && k->u.s.n == n->a->name_len && !memcmp(k->u.s.p, n->a->name, k->u.s.n)) {
            obj->u.d.v[i] = v;
            return;
        }
    }
    jv_dict_set(cx, obj, jv_cstr(cx, n->a->name), v);
}

static struct jv *render_body(struct jctx *cx, struct scope *sc, const struct jn *body)
{
    struct jbuf buf = {0}, *saved = cx->out;
    cx->out = &buf;
    exec(cx, sc, body);
    cx->out = saved;
    return jv_str(cx, buf.p ? buf.p : "", buf.n);
}

static void exec(struct jctx *cx, struct scope *sc, const struct jn *n)
{
    cx->where = n;
    jx_step(cx);
    switch (n->kind) {
    case N_BODY:
        for (size_t i = 0; i < n->n_kids && !cx->loop_ctl; i++)
            exec(cx, sc, n->kids[i]);
        return;
    case N_TEXT: put_out(cx, n->name, n->name_len); return;
    case N_OUTPUT: jv_print(cx, cx->out, eval(cx, sc, n->a)); return;
    case N_IF:
        if (jv_truthy(eval(cx, sc, n->a)))
            exec(cx, sc, n->b);
        else if (n->c)
            exec(cx, sc, n->c);
        return;
    case N_FOR: exec_for(cx, sc, n); return;
    case N_SET: exec_set(cx, sc, n); return;
    case N_SETBLOCK: scope_set(cx, sc, n->names[0], render_body(cx, sc, n->b)); return;
    case N_MACRO: {
        struct jv *m = jx_alloc(cx, sizeof *m);
        m->kind = JV_MACRO;
        m->u.m.node = n;
        m->u.m.closure = sc;
        scope_set(cx, sc, n->name, m);
        return;
    }
    case N_FILTERBLOCK: {
        struct scope *fs = scope_new(cx, sc);
        scope_set(cx, fs, "__body__", render_body(cx, sc, n->b));
        jv_print(cx, cx->out, eval(cx, fs, n->a));
        return;
    }
    case N_BREAK: cx->loop_ctl = 1; return;
    case N_CONTINUE: cx->loop_ctl = 2; return;
    default: jx_fail(cx, KS_ERR_INTERNAL, "node %d is not a statement", (int)n->kind);
    }
}

/* ---- API ----------------------------------------------------------------- */

static void apply_defaults(struct jinja_opts *o)
{
    if (!o->max_output)
        o->max_output = DEFAULT_MAX_OUTPUT;
    if (!o->max_string)
        o->max_string = DEFAULT_MAX_STRING;
    if (!o->max_steps)
        o->max_steps = DEFAULT_MAX_STEPS;
    if (!o->max_depth)
        o->max_depth = DEFAULT_MAX_DEPTH;
    if (!o->max_memory)
        o->max_memory = DEFAULT_MAX_MEMORY;
}

ks_status jinja_render(const struct jinja_template *t, const cJSON *context, const struct jinja_opts *opts, char **out,
                       size_t *out_len)
{
    if (!t || !out)
        return ks_fail(KS_ERR_INVALID_ARG, "jinja_render: NULL argument");
    if (context && !cJSON_IsObject(context))
        return ks_fail(KS_ERR_INVALID_ARG, "jinja_render: the context must be a JSON object");
    struct jctx *cx = calloc(1, sizeof *cx);
    if (!cx)
        return ks_fail(KS_ERR_NOMEM, "out of memory rendering the template");
    if (opts)
        cx->opts = *opts;
    apply_defaults(&cx->opts);
    cx->arena.limit = cx->opts.max_memory;
    struct jbuf result = {0};
    if (setjmp(cx->jmp)) {
        ks_status st = ks_fail(cx->err, "%s", cx->msg);
        arena_free(&cx->arena);
        free(cx);
        return st;
    }
    cx->globals = scope_new(cx, NULL);
    jx_install_globals(cx);
    for (const cJSON *c = context ? context->child : NULL; c; c = c->next) {
        size_t n = strlen(c->string ? c->string : "");
        char *name = jx_alloc(cx, n + 1);
        memcpy(name, c->string ? c->string : "", n);
        scope_set(cx, cx->globals, name, jv_from_json(cx, c));
    }
    cx->out = cx->top = &result;
    struct scope *top = scope_new(cx, cx->globals);
    exec(cx, top, t->root);
    char *s = malloc(result.n + 1);
    if (!s) {
        arena_free(&cx->arena);
        free(cx);
        return ks_fail(KS_ERR_NOMEM, "out of memory rendering the template");
    }
    if (result.n)
        memcpy(s, result.p, result.n);
    s[result.n] = 0;
    *out = s;
    if (out_len)
        *out_len = result.n;
    arena_free(&cx->arena);
    free(cx);
    return KS_OK;
}

void jx_set_global(struct jctx *cx, const char *name, struct jv *v) { scope_set(cx, cx->globals, name, v); }
