/* jinja: lexer and parser. Text and tags become tokens (whitespace control,
 * trim_blocks and lstrip_blocks applied to the text as Jinja2 does), then a
 * recursive-descent parser builds the AST with Jinja2's precedence:
 *   cond-expr < or < and < not < comparisons < + - < ~ < * / // % < ** < unary
 *   < postfix (.x [i] (args)) and filters / tests. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja/jinja_internal.h"
#include "sbuf/sbuf.h"

#define JINJA_MAX_SOURCE (16u << 20)
#define JINJA_MAX_NESTING 200
#define JINJA_PARSE_MEMORY (512u << 20)

enum tok_type { T_EOF, T_TEXT, T_VAR_BEGIN, T_VAR_END, T_BLOCK_BEGIN, T_BLOCK_END, T_NAME, T_STR, T_INT, T_FLOAT, T_OP };

struct tok {
    enum tok_type type;
    const char *p; /* T_TEXT: into the source; T_STR: the decoded bytes; T_NAME, T_OP: into the source */
    size_t n;
    int line, col;
};

struct parser {
    struct jinja_template *t;
    const char *src;
    size_t len, pos;
    struct tok *toks;
    size_t n_toks, cap_toks, cur;
    int depth;
    size_t lc_pos; /* line_col's resume point */
    int lc_line, lc_col;
    ks_status err;
    char msg[256];
    jmp_buf jmp;
};

/* ---- errors and memory --------------------------------------------------- */

/* Tokens come in source order, so the scan resumes where the last one ended. */
static void line_col(struct parser *ps, size_t pos, int *line, int *col)
{
    if (pos < ps->lc_pos) {
        ps->lc_pos = 0;
        ps->lc_line = ps->lc_col = 1;
    }
    for (size_t i = ps->lc_pos; i < pos && i < ps->len; i++) {
        if (ps->src[i] == '\n')
            ps->lc_line++, ps->lc_col = 1;
        else
            ps->lc_col++;
    }
    ps->lc_pos = pos;
    *line = ps->lc_line;
    *col = ps->lc_col;
}

__attribute__((format(printf, 5, 6))) static _Noreturn void fail_at(struct parser *ps, ks_status st, int line, int col,
                                                                     const char *fmt, ...)
{
    char what[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    snprintf(ps->msg, sizeof ps->msg, "line %d, column %d: %s", line, col, what);
    ps->err = st;
    longjmp(ps->jmp, 1);
}

#define FAIL_POS(ps, pos, ...)                                                                                       \
    do {                                                                                                             \
        int l_, c_;                                                                                                  \
        line_col(ps, pos, &l_, &c_);                                                                                 \
        fail_at(ps, KS_ERR_FORMAT, l_, c_, __VA_ARGS__);                                                             \
    } while (0)

static void *palloc(struct parser *ps, size_t n)
{
    void *p = arena_alloc(&ps->t->arena, n);
    if (!p)
        fail_at(ps, KS_ERR_NOMEM, 1, 1, "out of memory parsing the template");
    return p;
}

static char *pstrdup(struct parser *ps, const char *s, size_t n)
{
    char *p = palloc(ps, n + 1);
    memcpy(p, s, n);
    return p;
}

/* ---- lexer --------------------------------------------------------------- */

static void push_tok(struct parser *ps, enum tok_type type, const char *p, size_t n, size_t pos)
{
    if (ps->n_toks == ps->cap_toks) {
        size_t cap = ps->cap_toks ? ps->cap_toks * 2 : 256;
        struct tok *nt = palloc(ps, cap * sizeof *nt);
        if (ps->n_toks)
            memcpy(nt, ps->toks, ps->n_toks * sizeof *nt);
        ps->toks = nt;
        ps->cap_toks = cap;
    }
    struct tok *t = &ps->toks[ps->n_toks++];
    t->type = type;
    t->p = p;
    t->n = n;
    line_col(ps, pos, &t->line, &t->col);
}

static bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }
static bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
static bool is_digit(char c) { return c >= '0' && c <= '9'; }

/* The text before a tag: whitespace control and lstrip_blocks shorten it. */
static void push_text(struct parser *ps, size_t start, size_t end, bool strip_left, bool strip_right, bool lstrip_line)
{
    if (strip_left)
        while (start < end && is_space(ps->src[start]))
            start++;
    if (strip_right) {
        while (end > start && is_space(ps->src[end - 1]))
            end--;
    } else if (lstrip_line) {
        size_t k = end;
        while (k > start && (ps->src[k - 1] == ' ' || ps->src[k - 1] == '\t'))
            k--;
        bool at_line_start = (k > start && ps->src[k - 1] == '\n') || (k == start && (k == 0 || ps->src[k - 1] == '\n'));
        if (at_line_start)
            end = k;
    }
    if (end > start)
        push_tok(ps, T_TEXT, ps->src + start, end - start, start);
}

static size_t find_tag(const struct parser *ps, size_t from)
{
    for (size_t i = from; i + 1 < ps->len; i++)
        if (ps->src[i] == '{' && (ps->src[i + 1] == '{' || ps->src[i + 1] == '%' || ps->src[i + 1] == '#'))
            return i;
    return ps->len;
}

static size_t put_utf8(char *o, unsigned cp)
{
    if (cp < 0x80) {
        o[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (char)(0xC0 | (cp >> 6));
        o[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | (cp >> 12));
        o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | (cp >> 18));
    o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* A string literal at ps->pos (on the quote), with Python's escapes. */
static void lex_string(struct parser *ps)
{
    size_t start = ps->pos;
    char q = ps->src[ps->pos++];
    size_t end = ps->pos;
    while (end < ps->len && ps->src[end] != q)
        end += ps->src[end] == '\\' ? 2 : 1;
    if (end >= ps->len)
        FAIL_POS(ps, start, "unterminated string literal");
    char *o = palloc(ps, end - ps->pos + 1);
    size_t n = 0;
    for (;;) {
        if (ps->pos >= ps->len)
            FAIL_POS(ps, start, "unterminated string literal");
        char c = ps->src[ps->pos++];
        if (c == q)
            break;
        if (c != '\\') {
            o[n++] = c;
            continue;
        }
        if (ps->pos >= ps->len)
            FAIL_POS(ps, start, "unterminated string literal");
        char e = ps->src[ps->pos++];
        int digits = e == 'x' ? 2 : e == 'u' ? 4 : e == 'U' ? 8 : 0;
        if (digits) {
            unsigned cp = 0;
            for (int i = 0; i < digits; i++) {
                int h = ps->pos < ps->len ? sbuf_hex_digit(ps->src[ps->pos]) : -1;
                if (h < 0)
                    FAIL_POS(ps, ps->pos, "bad \\%c escape in a string literal", e);
                cp = cp * 16 + (unsigned)h;
                ps->pos++;
            }
            if (cp > 0x10FFFF)
                FAIL_POS(ps, ps->pos, "\\%c escape beyond U+10FFFF", e);
            n += put_utf8(o + n, cp);
            continue;
        }
        switch (e) {
        case 'n': o[n++] = '\n'; break;
        case 't': o[n++] = '\t'; break;
        case 'r': o[n++] = '\r'; break;
        case '0': o[n++] = '\0'; break;
        case 'b': o[n++] = '\b'; break;
        case 'f': o[n++] = '\f'; break;
        case 'v': o[n++] = '\v'; break;
        case '\\': case '\'': case '"': o[n++] = e; break;
        case '\n': break;
        default: o[n++] = '\\'; o[n++] = e; break;
        }
    }
    push_tok(ps, T_STR, o, n, start);
}

static void lex_number(struct parser *ps)
{
    size_t start = ps->pos;
    bool is_float = false;
    while (ps->pos < ps->len && (is_digit(ps->src[ps->pos]) || ps->src[ps->pos] == '_'))
        ps->pos++;
    if (ps->pos + 1 < ps->len && ps->src[ps->pos] == '.' && is_digit(ps->src[ps->pos + 1])) {
        is_float = true;
        ps->pos++;
        while (ps->pos < ps->len && is_digit(ps->src[ps->pos]))
            ps->pos++;
    }
    if (ps->pos < ps->len && (ps->src[ps->pos] == 'e' || ps->src[ps->pos] == 'E')) {
        size_t k = ps->pos + 1;
        if (k < ps->len && (ps->src[k] == '+' || ps->src[k] == '-'))
            k++;
        if (k < ps->len && is_digit(ps->src[k])) {
            is_float = true;
            ps->pos = k;
            while (ps->pos < ps->len && is_digit(ps->src[ps->pos]))
                ps->pos++;
        }
    }
    push_tok(ps, is_float ? T_FLOAT : T_INT, ps->src + start, ps->pos - start, start);
}

static const char *const ops2[] = {"**", "//", "==", "!=", "<=", ">="};
static const char ops1[] = "+-*/%~<>=()[]{},.:|!?";

/* The tokens of one {{ }} or {% %} up to its closing delimiter. Returns
 * whether the closer had a '-' (strip the next text's leading whitespace). */
static bool lex_tag_body(struct parser *ps, bool is_block, size_t open_pos)
{
    int braces = 0;
    char closer = is_block ? '%' : '}';
    for (;;) {
        while (ps->pos < ps->len && is_space(ps->src[ps->pos]))
            ps->pos++;
        if (ps->pos >= ps->len)
            FAIL_POS(ps, open_pos, "%s is never closed", is_block ? "{%" : "{{");
        const char *s = ps->src + ps->pos;
        size_t left = ps->len - ps->pos;
        bool dash = s[0] == '-' && left >= 3 && s[1] == closer && s[2] == '}';
        if (braces == 0 && (dash || (left >= 2 && s[0] == closer && s[1] == '}'))) {
            push_tok(ps, is_block ? T_BLOCK_END : T_VAR_END, s, 0, ps->pos);
            ps->pos += dash ? 3 : 2;
            return dash;
        }
        char c = s[0];
        if (is_name_start(c)) {
            size_t start = ps->pos;
            while (ps->pos < ps->len && (is_name_start(ps->src[ps->pos]) || is_digit(ps->src[ps->pos])))
                ps->pos++;
            push_tok(ps, T_NAME, ps->src + start, ps->pos - start, start);
        } else if (is_digit(c)) {
            lex_number(ps);
        } else if (c == '\'' || c == '"') {
            lex_string(ps);
        } else {
            size_t n = 0;
            for (size_t i = 0; i < sizeof ops2 / sizeof ops2[0] && !n; i++)
                if (left >= 2 && s[0] == ops2[i][0] && s[1] == ops2[i][1])
                    n = 2;
            if (!n && c && strchr(ops1, c))
                n = 1;
            if (!n)
                FAIL_POS(ps, ps->pos, "unexpected character '%c' (0x%02x) in an expression", c >= 32 && c < 127 ? c : '?',
                         (unsigned char)c);
            /* only an open dict literal makes "}}" two braces instead of the closer */
            if (c == '{')
                braces++;
            else if (c == '}' && braces > 0)
                braces--;
            push_tok(ps, T_OP, s, n, ps->pos);
            ps->pos += n;
        }
    }
}

/* trim_blocks: the first newline after a block or comment tag goes. */
static void skip_one_newline(struct parser *ps)
{
    if (ps->pos < ps->len && ps->src[ps->pos] == '\n') /* \r\n was normalized to \n */
        ps->pos++;
}

static void lex(struct parser *ps)
{
    bool strip_next = false;
    while (ps->pos < ps->len) {
        size_t tag = find_tag(ps, ps->pos);
        if (tag >= ps->len) {
            push_text(ps, ps->pos, ps->len, strip_next, false, false);
            break;
        }
        char kind = ps->src[tag + 1];
        char mod = tag + 2 < ps->len ? ps->src[tag + 2] : 0;
        bool is_block = kind == '%' || kind == '#';
        push_text(ps, ps->pos, tag, strip_next, mod == '-', is_block && mod != '+');
        ps->pos = tag + 2 + (mod == '-' || mod == '+');
        if (kind == '#') {
            const char *end = NULL;
            for (size_t i = ps->pos; i + 1 < ps->len && !end; i++)
                if (ps->src[i] == '#' && ps->src[i + 1] == '}')
                    end = ps->src + i;
            if (!end)
                FAIL_POS(ps, tag, "comment {# is never closed");
            strip_next = end > ps->src + ps->pos && end[-1] == '-';
            ps->pos = (size_t)(end - ps->src) + 2;
        } else {
            push_tok(ps, kind == '%' ? T_BLOCK_BEGIN : T_VAR_BEGIN, ps->src + tag, 0, tag);
            strip_next = lex_tag_body(ps, kind == '%', tag);
        }
        if (is_block && !strip_next)
            skip_one_newline(ps);
    }
    push_tok(ps, T_EOF, ps->src + ps->len, 0, ps->len);
}

/* ---- token helpers ------------------------------------------------------- */

static struct tok *peek(struct parser *ps) { return &ps->toks[ps->cur]; }
static struct tok *peek2(struct parser *ps)
{
    return &ps->toks[ps->cur + 1 < ps->n_toks ? ps->cur + 1 : ps->cur];
}
static struct tok *next(struct parser *ps)
{
    struct tok *t = &ps->toks[ps->cur];
    if (t->type != T_EOF)
        ps->cur++;
    return t;
}

static bool tok_is(const struct tok *t, enum tok_type type, const char *s)
{
    return t->type == type && (!s || (t->n == strlen(s) && !memcmp(t->p, s, t->n)));
}
static bool at_op(struct parser *ps, const char *s) { return tok_is(peek(ps), T_OP, s); }
static bool at_name(struct parser *ps, const char *s) { return tok_is(peek(ps), T_NAME, s); }

static const char *tok_desc(const struct tok *t)
{
    switch (t->type) {
    case T_EOF: return "the end of the template";
    case T_TEXT: return "text";
    case T_VAR_BEGIN: return "'{{'";
    case T_VAR_END: return "'}}'";
    case T_BLOCK_BEGIN: return "'{%'";
    case T_BLOCK_END: return "'%}'";
    case T_STR: return "a string";
    case T_INT: case T_FLOAT: return "a number";
    default: return NULL;
    }
}

static _Noreturn void fail_tok(struct parser *ps, const struct tok *t, const char *expected)
{
    const char *d = tok_desc(t);
    if (d)
        fail_at(ps, KS_ERR_FORMAT, t->line, t->col, "expected %s, found %s", expected, d);
    fail_at(ps, KS_ERR_FORMAT, t->line, t->col, "expected %s, found '%.*s'", expected, (int)(t->n > 40 ? 40 : t->n),
            t->p);
}

static void expect_op(struct parser *ps, const char *s)
{
    if (!at_op(ps, s)) {
        char what[16];
        snprintf(what, sizeof what, "'%s'", s);
        fail_tok(ps, peek(ps), what);
    }
    next(ps);
}

static void expect_type(struct parser *ps, enum tok_type type, const char *what)
{
    if (peek(ps)->type != type)
        fail_tok(ps, peek(ps), what);
    next(ps);
}

static const char *expect_name(struct parser *ps, const char *what)
{
    struct tok *t = peek(ps);
    if (t->type != T_NAME)
        fail_tok(ps, t, what);
    next(ps);
    return pstrdup(ps, t->p, t->n);
}

static struct jn *new_node(struct parser *ps, enum jn_kind kind, const struct tok *at)
{
    struct jn *n = palloc(ps, sizeof *n);
    n->kind = kind;
    n->line = at->line;
    n->col = at->col;
    return n;
}

/* A growable array of pointers in the template arena. */
struct pvec {
    void **v;
    size_t n, cap;
};

static void pvec_push(struct parser *ps, struct pvec *pv, void *p)
{
    if (pv->n == pv->cap) {
        size_t cap = pv->cap ? pv->cap * 2 : 4;
        void **nv = palloc(ps, cap * sizeof *nv);
        if (pv->n)
            memcpy(nv, pv->v, pv->n * sizeof *nv);
        pv->v = nv;
        pv->cap = cap;
    }
    pv->v[pv->n++] = p;
}

static void enter(struct parser *ps, const struct tok *at)
{
    if (++ps->depth > JINJA_MAX_NESTING)
        fail_at(ps, KS_ERR_RANGE, at->line, at->col, "nesting deeper than %d", JINJA_MAX_NESTING);
}

/* ---- expressions --------------------------------------------------------- */

static struct jn *parse_expr(struct parser *ps);
static struct jn *parse_or(struct parser *ps);
static struct jn *parse_unary(struct parser *ps);

static bool is_keyword(const struct tok *t)
{
    static const char *const kw[] = {"and", "or", "not", "if", "else", "in", "is", "for", "recursive"};
    for (size_t i = 0; i < sizeof kw / sizeof kw[0]; i++)
        if (tok_is(t, T_NAME, kw[i]))
            return true;
    return false;
}

/* (a, b, k=v) after the '(' was consumed. */
static void parse_args(struct parser *ps, struct jn *n)
{
    struct pvec pos = {0}, kwn = {0}, kwv = {0};
    while (!at_op(ps, ")")) {
        if (peek(ps)->type == T_NAME && tok_is(peek2(ps), T_OP, "=")) {
            pvec_push(ps, &kwn, (void *)expect_name(ps, "an argument name"));
            next(ps);
            pvec_push(ps, &kwv, parse_expr(ps));
        } else {
            if (kwn.n)
                fail_tok(ps, peek(ps), "a keyword argument (positional arguments come first)");
            pvec_push(ps, &pos, parse_expr(ps));
        }
        if (!at_op(ps, ","))
            break;
        next(ps);
    }
    expect_op(ps, ")");
    n->kids = (struct jn **)pos.v;
    n->n_kids = pos.n;
    n->kw_names = (const char **)kwn.v;
    n->kw_vals = (struct jn **)kwv.v;
    n->n_kw = kwn.n;
}

static struct jn *parse_literal(struct parser *ps, struct tok *t)
{
    struct jn *n = new_node(ps, E_LIT, t);
    struct jv *v = palloc(ps, sizeof *v);
    n->lit = v;
    if (t->type == T_INT || t->type == T_FLOAT) {
        char buf[64];
        size_t k = 0;
        for (size_t i = 0; i < t->n && k + 1 < sizeof buf; i++)
            if (t->p[i] != '_')
                buf[k++] = t->p[i];
        buf[k] = 0;
        if (t->type == T_INT) {
            v->kind = JV_INT;
            v->u.i = strtoll(buf, NULL, 10);
        } else {
            v->kind = JV_FLOAT;
            v->u.f = strtod(buf, NULL);
        }
        return n;
    }
    /* adjacent string literals join, as in Python */
    size_t total = t->n;
    size_t k = ps->cur;
    while (ps->toks[k].type == T_STR)
        total += ps->toks[k++].n;
    char *p = palloc(ps, total + 1);
    memcpy(p, t->p, t->n);
    size_t off = t->n;
    while (peek(ps)->type == T_STR) {
        struct tok *u = next(ps);
        memcpy(p + off, u->p, u->n);
        off += u->n;
    }
    v->kind = JV_STR;
    v->u.s.p = p;
    v->u.s.n = total;
    v->u.s.cap = total + 1;
    v->u.s.grow = false; /* shared by every render: never extended in place */
    return n;
}

static struct jn *parse_seq(struct parser *ps, struct tok *at, enum jn_kind kind, const char *close)
{
    struct jn *n = new_node(ps, kind, at);
    struct pvec items = {0};
    while (!at_op(ps, close)) {
        pvec_push(ps, &items, parse_expr(ps));
        if (!at_op(ps, ","))
            break;
        next(ps);
    }
    expect_op(ps, close);
    n->kids = (struct jn **)items.v;
    n->n_kids = items.n;
    return n;
}

static struct jn *parse_dict(struct parser *ps, struct tok *at)
{
    struct jn *n = new_node(ps, E_DICT, at);
    struct pvec keys = {0}, vals = {0};
    while (!at_op(ps, "}")) {
        pvec_push(ps, &keys, parse_expr(ps));
        expect_op(ps, ":");
        pvec_push(ps, &vals, parse_expr(ps));
        if (!at_op(ps, ","))
            break;
        next(ps);
    }
    expect_op(ps, "}");
    n->kids = (struct jn **)keys.v;
    n->kw_vals = (struct jn **)vals.v;
    n->n_kids = keys.n;
    return n;
}

static struct jn *lit_const(struct parser *ps, struct tok *t, struct jv *v)
{
    struct jn *n = new_node(ps, E_LIT, t);
    n->lit = v;
    return n;
}

static struct jn *parse_primary(struct parser *ps)
{
    struct tok *t = next(ps);
    if (t->type == T_STR || t->type == T_INT || t->type == T_FLOAT)
        return parse_literal(ps, t);
    if (t->type == T_NAME) {
        if (tok_is(t, T_NAME, "true") || tok_is(t, T_NAME, "True"))
            return lit_const(ps, t, &jv_true_v);
        if (tok_is(t, T_NAME, "false") || tok_is(t, T_NAME, "False"))
            return lit_const(ps, t, &jv_false_v);
        if (tok_is(t, T_NAME, "none") || tok_is(t, T_NAME, "None"))
            return lit_const(ps, t, &jv_none_v);
        struct jn *n = new_node(ps, E_NAME, t);
        n->name = pstrdup(ps, t->p, t->n);
        n->name_len = t->n;
        return n;
    }
    if (tok_is(t, T_OP, "(")) {
        if (at_op(ps, ")")) {
            next(ps);
            return new_node(ps, E_TUPLE, t);
        }
        struct jn *e = parse_expr(ps);
        if (at_op(ps, ",")) {
            next(ps);
            struct jn *tup = parse_seq(ps, t, E_TUPLE, ")");
            struct jn **kids = palloc(ps, (tup->n_kids + 1) * sizeof *kids);
            kids[0] = e;
            if (tup->n_kids)
                memcpy(kids + 1, tup->kids, tup->n_kids * sizeof *kids);
            tup->kids = kids;
            tup->n_kids++;
            return tup;
        }
        expect_op(ps, ")");
        return e;
    }
    if (tok_is(t, T_OP, "["))
        return parse_seq(ps, t, E_LIST, "]");
    if (tok_is(t, T_OP, "{"))
        return parse_dict(ps, t);
    ps->cur--;
    fail_tok(ps, t, "an expression");
}

static struct jn *parse_subscript(struct parser *ps, struct jn *obj, struct tok *at)
{
    struct jn *start = NULL, *stop = NULL, *step = NULL;
    if (!at_op(ps, ":"))
        start = parse_expr(ps);
    if (!at_op(ps, ":")) {
        expect_op(ps, "]");
        struct jn *n = new_node(ps, E_INDEX, at);
        n->a = obj;
        n->b = start;
        return n;
    }
    next(ps);
    if (!at_op(ps, ":") && !at_op(ps, "]"))
        stop = parse_expr(ps);
    if (at_op(ps, ":")) {
        next(ps);
        if (!at_op(ps, "]"))
            step = parse_expr(ps);
    }
    expect_op(ps, "]");
    struct jn *n = new_node(ps, E_SLICE, at);
    n->a = obj;
    n->b = start;
    n->c = stop;
    n->d = step;
    return n;
}

static struct jn *parse_postfix(struct parser *ps, struct jn *n)
{
    for (;;) {
        struct tok *t = peek(ps);
        if (tok_is(t, T_OP, ".")) {
            next(ps);
            struct tok *nm = next(ps);
            if (nm->type != T_NAME && nm->type != T_INT) {
                ps->cur--;
                fail_tok(ps, nm, "an attribute name after '.'");
            }
            struct jn *a = new_node(ps, E_ATTR, t);
            a->a = n;
            a->name = pstrdup(ps, nm->p, nm->n);
            a->name_len = nm->n;
            n = a;
        } else if (tok_is(t, T_OP, "[")) {
            next(ps);
            n = parse_subscript(ps, n, t);
        } else if (tok_is(t, T_OP, "(")) {
            next(ps);
            struct jn *c = new_node(ps, E_CALL, t);
            c->a = n;
            parse_args(ps, c);
            n = c;
        } else {
            return n;
        }
    }
}

/* A test's single argument written without parentheses: `is sameas false`. */
static bool starts_bare_test_arg(struct parser *ps)
{
    struct tok *t = peek(ps);
    if (t->type == T_STR || t->type == T_INT || t->type == T_FLOAT || tok_is(t, T_OP, "[") || tok_is(t, T_OP, "{"))
        return true;
    return t->type == T_NAME && !is_keyword(t);
}

static struct jn *parse_filters_and_tests(struct parser *ps, struct jn *n)
{
    for (;;) {
        struct tok *t = peek(ps);
        if (tok_is(t, T_OP, "|")) {
            next(ps);
            struct jn *f = new_node(ps, E_FILTER, t);
            f->a = n;
            struct tok *nm = peek(ps);
            f->name = expect_name(ps, "a filter name after '|'");
            if (!jx_has_filter(f->name))
                fail_at(ps, KS_ERR_UNSUPPORTED, nm->line, nm->col, "unknown filter '%s'", f->name);
            if (at_op(ps, "(")) {
                next(ps);
                parse_args(ps, f);
            }
            n = f;
        } else if (tok_is(t, T_NAME, "is")) {
            next(ps);
            struct jn *e = new_node(ps, E_TEST, t);
            e->a = n;
            if (at_name(ps, "not")) {
                next(ps);
                e->op = 1;
            }
            struct tok *nm = peek(ps);
            e->name = expect_name(ps, "a test name after 'is'");
            if (!jx_has_test(e->name))
                fail_at(ps, KS_ERR_UNSUPPORTED, nm->line, nm->col, "unknown test '%s'", e->name);
            if (at_op(ps, "(")) {
                next(ps);
                parse_args(ps, e);
            } else if (starts_bare_test_arg(ps)) {
                struct jn **kids = palloc(ps, sizeof *kids);
                kids[0] = parse_postfix(ps, parse_primary(ps));
                e->kids = kids;
                e->n_kids = 1;
            }
            n = e;
        } else {
            return n;
        }
    }
}

/* As in Jinja2, filters bind to the whole of a signed operand: -3|abs is 3. */
static struct jn *parse_signed(struct parser *ps, bool with_filters)
{
    struct tok *t = peek(ps);
    enter(ps, t);
    struct jn *n;
    if (tok_is(t, T_OP, "-") || tok_is(t, T_OP, "+")) {
        next(ps);
        n = new_node(ps, E_UNARY, t);
        n->op = t->p[0] == '-' ? OP_NEG : OP_POS;
        n->a = parse_signed(ps, false);
    } else {
        n = parse_postfix(ps, parse_primary(ps));
    }
    if (with_filters)
        n = parse_filters_and_tests(ps, n);
    ps->depth--;
    return n;
}

static struct jn *parse_unary(struct parser *ps) { return parse_signed(ps, true); }

static struct jn *binary(struct parser *ps, struct tok *at, int op, struct jn *a, struct jn *b)
{
    struct jn *n = new_node(ps, E_BINARY, at);
    n->op = op;
    n->a = a;
    n->b = b;
    return n;
}

static struct jn *parse_pow(struct parser *ps)
{
    struct jn *n = parse_unary(ps);
    while (at_op(ps, "**")) {
        struct tok *t = next(ps);
        n = binary(ps, t, OP_POW, n, parse_unary(ps));
    }
    return n;
}

static struct jn *parse_math2(struct parser *ps)
{
    struct jn *n = parse_pow(ps);
    for (;;) {
        int op = at_op(ps, "*") ? OP_MUL : at_op(ps, "/") ? OP_DIV : at_op(ps, "//") ? OP_FLOORDIV
               : at_op(ps, "%") ? OP_MOD : OP_NONE;
        if (op == OP_NONE)
            return n;
        struct tok *t = next(ps);
        n = binary(ps, t, op, n, parse_pow(ps));
    }
}

static struct jn *parse_concat(struct parser *ps)
{
    struct jn *n = parse_math2(ps);
    while (at_op(ps, "~")) {
        struct tok *t = next(ps);
        n = binary(ps, t, OP_CONCAT, n, parse_math2(ps));
    }
    return n;
}

static struct jn *parse_math1(struct parser *ps)
{
    struct jn *n = parse_concat(ps);
    for (;;) {
        int op = at_op(ps, "+") ? OP_ADD : at_op(ps, "-") ? OP_SUB : OP_NONE;
        if (op == OP_NONE)
            return n;
        struct tok *t = next(ps);
        n = binary(ps, t, op, n, parse_concat(ps));
    }
}

static int compare_op(struct parser *ps)
{
    if (at_name(ps, "not") && tok_is(peek2(ps), T_NAME, "in")) {
        next(ps);
        return OP_NOTIN;
    }
    return at_op(ps, "==") ? OP_EQ : at_op(ps, "!=") ? OP_NE : at_op(ps, "<") ? OP_LT : at_op(ps, "<=") ? OP_LE
         : at_op(ps, ">") ? OP_GT : at_op(ps, ">=") ? OP_GE : at_name(ps, "in") ? OP_IN : OP_NONE;
}

/* a < b <= c is (a < b) and (b <= c), as in Python (b is evaluated twice). */
static struct jn *parse_compare(struct parser *ps)
{
    struct jn *n = parse_math1(ps), *left = n;
    for (;;) {
        struct tok *t = peek(ps);
        int op = compare_op(ps);
        if (op == OP_NONE)
            return n;
        next(ps);
        struct jn *right = parse_math1(ps);
        struct jn *cmp = binary(ps, t, op, left, right);
        if (n == left) {
            n = cmp;
        } else {
            struct jn *both = new_node(ps, E_AND, t);
            both->a = n;
            both->b = cmp;
            n = both;
        }
        left = right;
    }
}

static struct jn *parse_not(struct parser *ps)
{
    if (at_name(ps, "not")) {
        struct tok *t = next(ps);
        enter(ps, t);
        struct jn *n = new_node(ps, E_UNARY, t);
        n->op = OP_NOT;
        n->a = parse_not(ps);
        ps->depth--;
        return n;
    }
    return parse_compare(ps);
}

static struct jn *parse_and(struct parser *ps)
{
    struct jn *n = parse_not(ps);
    while (at_name(ps, "and")) {
        struct tok *t = next(ps);
        struct jn *a = new_node(ps, E_AND, t);
        a->a = n;
        a->b = parse_not(ps);
        n = a;
    }
    return n;
}

static struct jn *parse_or(struct parser *ps)
{
    struct jn *n = parse_and(ps);
    while (at_name(ps, "or")) {
        struct tok *t = next(ps);
        struct jn *o = new_node(ps, E_OR, t);
        o->a = n;
        o->b = parse_and(ps);
        n = o;
    }
    return n;
}

/* `x if c else y`; without else the value is undefined, as in Jinja2. */
static struct jn *parse_expr(struct parser *ps)
{
    struct tok *start = peek(ps);
    enter(ps, start);
    struct jn *n = parse_or(ps);
    while (at_name(ps, "if")) {
        struct tok *t = next(ps);
        struct jn *c = new_node(ps, E_COND, t);
        c->b = n;
        c->a = parse_or(ps);
        if (at_name(ps, "else")) {
            next(ps);
            c->c = parse_expr(ps);
        }
        n = c;
    }
    ps->depth--;
    return n;
}

/* An expression or an unparenthesised tuple `a, b`. */
static struct jn *parse_tuple_expr(struct parser *ps)
{
    struct tok *t = peek(ps);
    struct jn *first = parse_expr(ps);
    if (!at_op(ps, ","))
        return first;
    struct pvec items = {0};
    pvec_push(ps, &items, first);
    while (at_op(ps, ",")) {
        next(ps);
        if (peek(ps)->type == T_VAR_END || peek(ps)->type == T_BLOCK_END)
            break;
        pvec_push(ps, &items, parse_expr(ps));
    }
    struct jn *n = new_node(ps, E_TUPLE, t);
    n->kids = (struct jn **)items.v;
    n->n_kids = items.n;
    return n;
}

/* ---- statements ---------------------------------------------------------- */

static struct jn *parse_body(struct parser *ps, const char *const *ends, const char **ended);

static bool is_end(const struct tok *t, const char *const *ends)
{
    for (size_t i = 0; ends && ends[i]; i++)
        if (tok_is(t, T_NAME, ends[i]))
            return true;
    return false;
}

static void expect_block_end(struct parser *ps) { expect_type(ps, T_BLOCK_END, "'%}'"); }

static struct jn *parse_if(struct parser *ps, struct tok *at)
{
    static const char *const ends[] = {"elif", "else", "endif", NULL};
    static const char *const endif[] = {"endif", NULL};
    struct jn *n = new_node(ps, N_IF, at);
    n->a = parse_expr(ps);
    expect_block_end(ps);
    const char *ended;
    n->b = parse_body(ps, ends, &ended);
    if (!strcmp(ended, "elif")) {
        n->c = parse_if(ps, &ps->toks[ps->cur - 1]);
        return n;
    }
    expect_block_end(ps);
    if (!strcmp(ended, "else")) {
        n->c = parse_body(ps, endif, &ended);
        expect_block_end(ps);
    }
    return n;
}

static struct jn *parse_for(struct parser *ps, struct tok *at)
{
    static const char *const ends[] = {"else", "endfor", NULL};
    static const char *const endfor[] = {"endfor", NULL};
    struct jn *n = new_node(ps, N_FOR, at);
    struct pvec names = {0};
    bool paren = at_op(ps, "(");
    if (paren)
        next(ps);
    do {
        if (names.n)
            next(ps);
        pvec_push(ps, &names, (void *)expect_name(ps, "a loop variable name"));
    } while (at_op(ps, ","));
    if (paren)
        expect_op(ps, ")");
    n->names = (const char **)names.v;
    n->n_names = names.n;
    if (!at_name(ps, "in"))
        fail_tok(ps, peek(ps), "'in'");
    next(ps);
    n->a = parse_or(ps);
    if (at_name(ps, "if")) {
        next(ps);
        n->d = parse_expr(ps);
    }
    if (at_name(ps, "recursive"))
        fail_at(ps, KS_ERR_UNSUPPORTED, peek(ps)->line, peek(ps)->col, "recursive loops are not supported");
    expect_block_end(ps);
    const char *ended;
    n->b = parse_body(ps, ends, &ended);
    expect_block_end(ps);
    if (!strcmp(ended, "else")) {
        n->c = parse_body(ps, endfor, &ended);
        expect_block_end(ps);
    }
    return n;
}

static struct jn *parse_set(struct parser *ps, struct tok *at)
{
    static const char *const endset[] = {"endset", NULL};
    struct jn *n = new_node(ps, N_SET, at);
    struct tok *first = peek(ps);
    const char *name = expect_name(ps, "a variable name after 'set'");
    if (at_op(ps, ".")) {
        next(ps);
        struct jn *target = new_node(ps, E_ATTR, first);
        struct jn *obj = new_node(ps, E_NAME, first);
        obj->name = name;
        obj->name_len = strlen(name);
        target->a = obj;
        target->name = expect_name(ps, "an attribute name");
        target->name_len = strlen(target->name);
        n->a = target;
    } else {
        struct pvec names = {0};
        pvec_push(ps, &names, (void *)name);
        while (at_op(ps, ",")) {
            next(ps);
            pvec_push(ps, &names, (void *)expect_name(ps, "a variable name"));
        }
        n->names = (const char **)names.v;
        n->n_names = names.n;
    }
    if (at_op(ps, "=")) {
        next(ps);
        n->b = parse_tuple_expr(ps);
        expect_block_end(ps);
        return n;
    }
    if (n->a || n->n_names != 1)
        fail_tok(ps, peek(ps), "'=' (a block set takes one plain name)");
    expect_block_end(ps);
    n->kind = N_SETBLOCK;
    const char *ended;
    n->b = parse_body(ps, endset, &ended);
    expect_block_end(ps);
    return n;
}

static struct jn *parse_macro(struct parser *ps, struct tok *at)
{
    static const char *const endmacro[] = {"endmacro", NULL};
    struct jn *n = new_node(ps, N_MACRO, at);
    n->name = expect_name(ps, "a macro name");
    n->name_len = strlen(n->name);
    expect_op(ps, "(");
    struct pvec names = {0}, defs = {0};
    while (!at_op(ps, ")")) {
        pvec_push(ps, &names, (void *)expect_name(ps, "a parameter name"));
        if (at_op(ps, "=")) {
            next(ps);
            pvec_push(ps, &defs, parse_expr(ps));
        } else {
            pvec_push(ps, &defs, NULL);
        }
        if (!at_op(ps, ","))
            break;
        next(ps);
    }
    expect_op(ps, ")");
    expect_block_end(ps);
    n->names = (const char **)names.v;
    n->n_names = names.n;
    n->kids = (struct jn **)defs.v;
    n->n_kids = defs.n;
    const char *ended;
    n->b = parse_body(ps, endmacro, &ended);
    expect_block_end(ps);
    return n;
}

/* {% filter a | b(x) %}: the chain is stored as filters over E_NAME "__body__". */
static struct jn *parse_filter_block(struct parser *ps, struct tok *at)
{
    static const char *const endfilter[] = {"endfilter", NULL};
    struct jn *n = new_node(ps, N_FILTERBLOCK, at);
    struct jn *chain = new_node(ps, E_NAME, at);
    chain->name = "__body__";
    chain->name_len = 8;
    do {
        if (chain->kind != E_NAME)
            next(ps);
        struct tok *nm = peek(ps);
        struct jn *f = new_node(ps, E_FILTER, nm);
        f->a = chain;
        f->name = expect_name(ps, "a filter name");
        if (!jx_has_filter(f->name))
            fail_at(ps, KS_ERR_UNSUPPORTED, nm->line, nm->col, "unknown filter '%s'", f->name);
        if (at_op(ps, "(")) {
            next(ps);
            parse_args(ps, f);
        }
        chain = f;
    } while (at_op(ps, "|"));
    n->a = chain;
    expect_block_end(ps);
    const char *ended;
    n->b = parse_body(ps, endfilter, &ended);
    expect_block_end(ps);
    return n;
}

static struct jn *parse_statement(struct parser *ps)
{
    struct tok *at = peek(ps);
    if (at->type != T_NAME)
        fail_tok(ps, at, "a statement name");
    next(ps);
    if (tok_is(at, T_NAME, "if"))
        return parse_if(ps, at);
    if (tok_is(at, T_NAME, "for"))
        return parse_for(ps, at);
    if (tok_is(at, T_NAME, "set"))
        return parse_set(ps, at);
    if (tok_is(at, T_NAME, "macro"))
        return parse_macro(ps, at);
    if (tok_is(at, T_NAME, "filter"))
        return parse_filter_block(ps, at);
    if (tok_is(at, T_NAME, "break") || tok_is(at, T_NAME, "continue")) {
        expect_block_end(ps);
        return new_node(ps, at->p[0] == 'b' ? N_BREAK : N_CONTINUE, at);
    }
    if (tok_is(at, T_NAME, "generation")) {
        static const char *const endgen[] = {"endgeneration", NULL};
        expect_block_end(ps);
        const char *ended;
        struct jn *body = parse_body(ps, endgen, &ended);
        expect_block_end(ps);
        return body;
    }
    fail_at(ps, KS_ERR_UNSUPPORTED, at->line, at->col, "unsupported or misplaced statement '%.*s'",
            (int)(at->n > 40 ? 40 : at->n), at->p);
}

/* Statements up to one of ends (NULL-terminated; NULL ends = the template's
 * end). *ended receives the end name, consumed. */
static struct jn *parse_body(struct parser *ps, const char *const *ends, const char **ended)
{
    struct tok *start = peek(ps);
    enter(ps, start);
    struct jn *body = new_node(ps, N_BODY, start);
    struct pvec kids = {0};
    for (;;) {
        struct tok *t = next(ps);
        if (t->type == T_EOF) {
            if (ends) {
                size_t last = 0;
                while (ends[last + 1])
                    last++;
                fail_at(ps, KS_ERR_FORMAT, start->line, start->col, "this block is never closed (expected '%s')",
                        ends[last]);
            }
            break;
        }
        if (t->type == T_TEXT) {
            struct jn *n = new_node(ps, N_TEXT, t);
            n->name = t->p;
            n->name_len = t->n;
            pvec_push(ps, &kids, n);
        } else if (t->type == T_VAR_BEGIN) {
            struct jn *n = new_node(ps, N_OUTPUT, t);
            n->a = parse_tuple_expr(ps);
            expect_type(ps, T_VAR_END, "'}}'");
            pvec_push(ps, &kids, n);
        } else if (t->type == T_BLOCK_BEGIN) {
            if (is_end(peek(ps), ends)) {
                struct tok *e = next(ps);
                *ended = pstrdup(ps, e->p, e->n);
                break;
            }
            pvec_push(ps, &kids, parse_statement(ps));
        } else {
            ps->cur--;
            fail_tok(ps, t, "text, '{{' or '{%'");
        }
    }
    body->kids = (struct jn **)kids.v;
    body->n_kids = kids.n;
    ps->depth--;
    return body;
}

/* ---- API ----------------------------------------------------------------- */

/* Copy src into dst as Jinja2 and llama.cpp read a template: \r\n and \r
 * become \n, and one newline at the very end is dropped
 * (keep_trailing_newline off). Returns the new length; dst[len] = 0. */
static size_t normalize_source(char *dst, const char *src, size_t len)
{
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            dst[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n')
                i++;
        } else {
            dst[n++] = src[i];
        }
    }
    if (n && dst[n - 1] == '\n')
        n--;
    dst[n] = 0;
    return n;
}

ks_status jinja_parse(const char *src, size_t len, struct jinja_template **out)
{
    if (!out || (!src && len))
        return ks_fail(KS_ERR_INVALID_ARG, "jinja_parse: NULL argument");
    if (len > JINJA_MAX_SOURCE)
        return ks_fail(KS_ERR_RANGE, "template of %zu bytes is over the %u-byte limit", len, JINJA_MAX_SOURCE);
    struct jinja_template *t = calloc(1, sizeof *t);
    if (!t)
        return ks_fail(KS_ERR_NOMEM, "out of memory parsing the template");
    t->arena.limit = JINJA_PARSE_MEMORY;
    t->src = malloc(len + 1);
    if (!t->src) {
        free(t);
        return ks_fail(KS_ERR_NOMEM, "out of memory parsing the template");
    }
    t->len = normalize_source(t->src, src, len);
    struct parser *ps = calloc(1, sizeof *ps);
    if (!ps) {
        jinja_free(t);
        return ks_fail(KS_ERR_NOMEM, "out of memory parsing the template");
    }
    ps->t = t;
    ps->src = t->src;
    ps->len = t->len;
    ps->lc_line = ps->lc_col = 1;
    if (setjmp(ps->jmp)) {
        ks_status st = ks_fail(ps->err, "%s", ps->msg);
        free(ps);
        jinja_free(t);
        return st;
    }
    lex(ps);
    const char *ended = NULL;
    t->root = parse_body(ps, NULL, &ended);
    free(ps);
    *out = t;
    return KS_OK;
}

void jinja_free(struct jinja_template *t)
{
    if (!t)
        return;
    arena_free(&t->arena);
    free(t->src);
    free(t);
}
