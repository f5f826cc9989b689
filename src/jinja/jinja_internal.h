/* jinja: shared internals of the parser and the interpreter.
 *
 * Memory: everything a template owns (AST, decoded string literals) lives in
 * the template's arena; everything a render creates (values, scopes, output)
 * lives in the render's arena, freed at once when the render ends. Values are
 * never freed one by one, so they need no reference counts, and the arena's
 * byte limit bounds a render's memory.
 *
 * Errors: the parser and the interpreter stop at the first error with
 * longjmp back to jinja_parse / jinja_render (as Lua does), which turn it into
 * a ks_status. That is safe because nothing between owns memory outside an
 * arena. */
#ifndef KS_JINJA_INTERNAL_H
#define KS_JINJA_INTERNAL_H

#include <setjmp.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "jinja/jinja.h"

/* ---- arena --------------------------------------------------------------- */

struct ja_block;
struct arena {
    struct ja_block *head; /* newest block first */
    size_t used, limit;    /* bytes handed out (blocks included), and the cap */
};

/* NULL when the limit or malloc refuses. Memory is zeroed, 16-byte aligned. */
void *arena_alloc(struct arena *a, size_t n);
void arena_free(struct arena *a);

/* ---- values -------------------------------------------------------------- */

enum jv_kind {
    JV_UNDEF, JV_NONE, JV_BOOL, JV_INT, JV_FLOAT, JV_STR, JV_LIST, JV_DICT,
    JV_MACRO,   /* a {% macro %}: node + the scope it was defined in */
    JV_BUILTIN, /* a global function (range, namespace, ...) */
    JV_METHOD,  /* obj.name of a str/list/dict method, bound to obj */
    JV_LOOP,    /* a for loop's `loop`: its attributes are computed when read */
};

struct jn;
struct scope;

struct jv {
    enum jv_kind kind;
    bool is_ns;    /* a namespace(): a dict whose attributes `set` may assign */
    bool is_tuple; /* a list Python would hold as a tuple (literals, dict items): prints as (a, b) */
    union {
        bool b;
        int64_t i;
        double f;
        /* JV_STR, JV_UNDEF (its name). cap bytes are allocated at p (>= n + 1);
         * when grow is set this value may extend its text in place past n,
         * which is how `ns.out = ns.out ~ piece` stays linear. p[n] is NUL
         * unless a longer string now shares the bytes: use jv_c_str() for a
         * C string. */
        struct { const char *p; size_t n, cap; bool grow; } s;
        struct { struct jv **v; size_t n, cap; } l;           /* JV_LIST */
        struct { struct jv **k, **v; size_t n, cap; } d;      /* JV_DICT: keys in insertion order */
        struct { const struct jn *node; struct scope *closure; } m; /* JV_MACRO */
        struct { int id; struct jv *self; const char *name; } fn;   /* JV_BUILTIN, JV_METHOD */
        struct { struct jv *items; size_t i; } loop;                /* JV_LOOP: items[i] is current */
    } u;
};

/* ---- AST ----------------------------------------------------------------- */

enum jn_kind {
    /* statements */
    N_BODY,    /* kids: statements */
    N_TEXT,    /* name/name_len: the text */
    N_OUTPUT,  /* a: expression */
    N_IF,      /* a: condition, b: then body, c: else body or N_IF (elif) or NULL */
    N_FOR,     /* names: targets, a: iterable, d: filter or NULL, b: body, c: else or NULL */
    N_SET,     /* names: targets (or a: ns.attr target), b: value */
    N_SETBLOCK,/* names[0]: target, b: body */
    N_MACRO,   /* name, names: params, kids: defaults (NULL entries), b: body */
    N_FILTERBLOCK, /* a: the filter chain applied to E_NAME "__body__", b: body */
    N_BREAK, N_CONTINUE,
    /* expressions */
    E_LIT,     /* lit */
    E_NAME,    /* name */
    E_ATTR,    /* a.name */
    E_INDEX,   /* a[b] */
    E_SLICE,   /* a[b:c:d], missing parts NULL */
    E_CALL,    /* a(kids..., kw_names=kw_vals...) */
    E_FILTER,  /* a | name(kids..., kw...) */
    E_TEST,    /* a is [not] name(kids...); op = 1 when negated */
    E_UNARY,   /* op a: '-', '+', '!' (not) */
    E_BINARY,  /* a op b */
    E_AND, E_OR,
    E_COND,    /* b if a else c */
    E_LIST, E_TUPLE, /* kids */
    E_DICT,    /* kids: keys, kw_vals: values (n_kids of each) */
};

enum jn_op {
    OP_NONE, OP_ADD, OP_SUB, OP_MUL, OP_DIV, OP_FLOORDIV, OP_MOD, OP_POW, OP_CONCAT,
    OP_EQ, OP_NE, OP_LT, OP_LE, OP_GT, OP_GE, OP_IN, OP_NOTIN, OP_NEG, OP_POS, OP_NOT,
};

struct jn {
    enum jn_kind kind;
    int op;
    int line, col;
    struct jn *a, *b, *c, *d;
    struct jn **kids;
    size_t n_kids;
    const char **names;
    size_t n_names;
    const char **kw_names;
    struct jn **kw_vals;
    size_t n_kw;
    const char *name;
    size_t name_len;
    struct jv *lit;
};

struct jinja_template {
    struct arena arena;
    struct jn *root; /* N_BODY */
    char *src;
    size_t len;
};

/* ---- interpreter --------------------------------------------------------- */

struct jbuf {
    char *p;
    size_t n, cap;
};

struct scope {
    struct scope *parent;
    const char **names;
    struct jv **vals;
    size_t n, cap;
};

struct jctx {
    struct arena arena;
    struct jinja_opts opts;
    struct scope *globals;
    struct jbuf *out;         /* where output goes now (a block set or macro redirects it) */
    struct jbuf *top;         /* the render's output, under max_output */
    uint64_t steps;
    unsigned depth;
    int loop_ctl;             /* 1 after break, 2 after continue, until the loop sees it */
    const struct jn *where;   /* the node being evaluated, for error positions */
    ks_status err;
    char msg[512];
    jmp_buf jmp;
};

extern struct jv jv_undef_v, jv_none_v, jv_true_v, jv_false_v;

/* Stop the render: record "line L, column C: msg" for cx->where and longjmp. */
_Noreturn void jx_fail(struct jctx *cx, ks_status st, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void *jx_alloc(struct jctx *cx, size_t n);

struct jv *jv_str(struct jctx *cx, const char *p, size_t n);
/* a's text then b's, reusing a's spare capacity when a may grow. */
struct jv *jv_concat(struct jctx *cx, struct jv *a, const char *b, size_t bn);
/* The text of a string value as a NUL-terminated C string (a copy when the
 * bytes after it belong to a longer string). */
const char *jv_c_str(struct jctx *cx, const struct jv *v);
struct jv *jv_cstr(struct jctx *cx, const char *s);
struct jv *jv_int(struct jctx *cx, int64_t i);
struct jv *jv_float(struct jctx *cx, double f);
struct jv *jv_bool(bool b);
struct jv *jv_list(struct jctx *cx);
struct jv *jv_dict(struct jctx *cx);
/* What a walk over a list or a dict sees, as a list: the list itself, a
 * dict's keys in insertion order (a new list); NULL for any other kind. */
struct jv *jv_walk_list(struct jctx *cx, struct jv *v);
void jv_list_push(struct jctx *cx, struct jv *l, struct jv *v);
void jv_dict_set(struct jctx *cx, struct jv *d, struct jv *k, struct jv *v);
struct jv *jv_dict_get(const struct jv *d, const char *key, size_t n); /* NULL if absent */
struct jv *jv_dict_getv(const struct jv *d, const struct jv *key);
bool jv_truthy(const struct jv *v);
bool jv_equal(const struct jv *a, const struct jv *b);
int jv_compare(struct jctx *cx, const struct jv *a, const struct jv *b); /* <0, 0, >0; fails on mixed types */
/* Elements of a list or dict, bytes of a string, 1 otherwise: the work of a scan. */
size_t jv_size(const struct jv *v);
/* Python's `needle in hay` for a string, list or dict; false for undefined and none. */
bool jv_contains(struct jctx *cx, const struct jv *hay, const struct jv *needle);
const char *jv_kind_name(const struct jv *v);
struct jv *jv_from_json(struct jctx *cx, const cJSON *j);

/* Append text to a buffer, within the string limit (or the output limit for
 * the render's output). */
void jbuf_put(struct jctx *cx, struct jbuf *b, const char *p, size_t n);
void jbuf_puts(struct jctx *cx, struct jbuf *b, const char *s);
/* How str() / {{ }} print a value. */
void jv_print(struct jctx *cx, struct jbuf *b, const struct jv *v);
struct jv *jv_to_str(struct jctx *cx, const struct jv *v);
/* json.dumps(v, indent=indent, ensure_ascii=False, sort_keys) with Python's
 * separators; indent < 0 means none. */
void jv_to_json(struct jctx *cx, struct jbuf *b, const struct jv *v, int indent, bool sort_keys);

/* Builtins (jinja_builtins.c). */
struct jv *jx_filter(struct jctx *cx, const char *name, struct jv *v, struct jv **args, size_t n_args,
                     const char **kw_names, struct jv **kw_vals, size_t n_kw);
bool jx_test(struct jctx *cx, const char *name, struct jv *v, struct jv **args, size_t n_args);
bool jx_has_test(const char *name);
bool jx_has_filter(const char *name);
/* A method of v named name, or NULL when v has no such method. */
struct jv *jx_method(struct jctx *cx, struct jv *v, const char *name);
struct jv *jx_call_builtin(struct jctx *cx, struct jv *fn, struct jv **args, size_t n_args, const char **kw_names,
                           struct jv **kw_vals, size_t n_kw);
void jx_install_globals(struct jctx *cx);
void jx_set_global(struct jctx *cx, const char *name, struct jv *v);

/* Interpreter entry points the builtins need (map and select with filters
 * and tests take no macros, so only macro calls come back here). */
struct jv *jx_call_value(struct jctx *cx, struct jv *fn, struct jv **args, size_t n_args, const char **kw_names,
                         struct jv **kw_vals, size_t n_kw);

/* Step accounting: every call costs one step and checks the budget. */
void jx_step(struct jctx *cx);
/* Bulk work (bytes copied or searched, entries scanned) costs a step per
 * JX_WORK_PER_STEP units, so a linear operation repeated in a loop still
 * meets the step budget that stands in for time. */
#define JX_WORK_PER_STEP 64
void jx_work(struct jctx *cx, size_t units);

#endif
