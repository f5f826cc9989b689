/* GBNF -> the flat compiled grammar (grammar_internal.h): a recursive-descent
 * parser over untrusted text (every read bounds-checked, errors with line and
 * column), repetition rewritten into rules as llama.cpp does, then the checks
 * that bound the matcher's work: no undefined rule, no left recursion, a root
 * that can end. */
#include "grammar/grammar_internal.h"
#include "sbuf/sbuf.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- growable arrays ------------------------------------------------------- */

struct ivec {
    int32_t *p;
    int32_t n, cap;
};

static bool ivec_push(struct ivec *v, int32_t x)
{
    if (v->n == v->cap) {
        int32_t cap = v->cap ? 2 * v->cap : 16;
        int32_t *p = realloc(v->p, (size_t)cap * sizeof *p);
        if (!p)
            return false;
        v->p = p;
        v->cap = cap;
    }
    v->p[v->n++] = x;
    return true;
}

/* ---- parser state ------------------------------------------------------------ */

struct prule {
    char *name;
    bool defined;
    size_t first_use;   /* source offset of the first reference, for "undefined" */
    struct ivec elems;  /* (kind, arg) pairs; alternatives end with GE_END */
};

struct parser {
    const char *s;
    size_t len, pos;
    struct prule *rules;
    int32_t n_rules, cap_rules;
    struct gclass *classes;
    int32_t n_classes, cap_classes;
    struct ivec ranges;   /* lo, hi pairs */
    int gen;              /* generated rule counter */
    int depth;            /* nesting of parentheses */
    int64_t n_elems;      /* elements emitted, all rules */
    ks_status err;
};

static void where(const struct parser *p, size_t at, int *line, int *col)
{
    *line = 1;
    *col = 1;
    for (size_t i = 0; i < at && i < p->len; i++) {
        if (p->s[i] == '\n') {
            (*line)++;
            *col = 1;
        } else if (((unsigned char)p->s[i] & 0xC0) != 0x80) {
            (*col)++;
        }
    }
}

__attribute__((format(printf, 4, 5))) static ks_status perr(struct parser *p, ks_status st, size_t at,
                                                            const char *fmt, ...)
{
    if (p->err)
        return p->err;
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    int line, col;
    where(p, at, &line, &col);
    p->err = ks_fail(st, "grammar: line %d, column %d: %s", line, col, msg);
    return p->err;
}

static ks_status nomem(struct parser *p)
{
    if (!p->err)
        p->err = ks_fail(KS_ERR_NOMEM, "grammar: out of memory while compiling");
    return p->err;
}

static int peek(const struct parser *p, size_t ahead)
{
    return p->pos + ahead < p->len ? (unsigned char)p->s[p->pos + ahead] : -1;
}

/* Spaces, tabs, comments; newlines too when newline_ok. */
static void skip_space(struct parser *p, bool newline_ok)
{
    while (p->pos < p->len) {
        char c = p->s[p->pos];
        if (c == ' ' || c == '\t' || c == '\r' || (newline_ok && c == '\n')) {
            p->pos++;
        } else if (c == '#') {
            while (p->pos < p->len && p->s[p->pos] != '\n')
                p->pos++;
        } else {
            break;
        }
    }
}

static bool is_name_char(int c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
}

/* Rule index by name, created undefined on first sight. */
static int32_t rule_get(struct parser *p, const char *name, size_t n, size_t at)
{
    for (int32_t i = 0; i < p->n_rules; i++)
        if (strlen(p->rules[i].name) == n && !memcmp(p->rules[i].name, name, n))
            return i;
    if (p->n_rules == p->cap_rules) {
        int32_t cap = p->cap_rules ? 2 * p->cap_rules : 32;
        struct prule *r = realloc(p->rules, (size_t)cap * sizeof *r);
        if (!r)
            return nomem(p), -1;
        p->rules = r;
        p->cap_rules = cap;
    }
    struct prule *r = &p->rules[p->n_rules];
    memset(r, 0, sizeof *r);
    r->name = malloc(n + 1);
    if (!r->name)
        return nomem(p), -1;
    memcpy(r->name, name, n);
    r->name[n] = 0;
    r->first_use = at;
    return p->n_rules++;
}

/* A new rule named after its parent (the '#' keeps it apart from user names). */
static int32_t rule_generated(struct parser *p, int32_t parent)
{
    char name[160];
    snprintf(name, sizeof name, "%.120s#%d", p->rules[parent].name, ++p->gen);
    int32_t r = rule_get(p, name, strlen(name), p->pos);
    if (r >= 0)
        p->rules[r].defined = true;
    return r;
}

static bool emit(struct parser *p, int32_t rule, int32_t kind, int32_t arg)
{
    if (++p->n_elems > GRAMMAR_MAX_ELEMENTS)
        return perr(p, KS_ERR_RANGE, p->pos, "the grammar expands to over %d elements (repetitions multiply)",
                    GRAMMAR_MAX_ELEMENTS), false;
    struct ivec *v = &p->rules[rule].elems;
    if (!ivec_push(v, kind) || !ivec_push(v, arg))
        return nomem(p), false;
    return true;
}

static int32_t class_new(struct parser *p, bool neg)
{
    if (p->n_classes == p->cap_classes) {
        int32_t cap = p->cap_classes ? 2 * p->cap_classes : 64;
        struct gclass *c = realloc(p->classes, (size_t)cap * sizeof *c);
        if (!c)
            return nomem(p), -1;
        p->classes = c;
        p->cap_classes = cap;
    }
    struct gclass *c = &p->classes[p->n_classes];
    memset(c, 0, sizeof *c);
    c->neg = neg;
    c->first = p->ranges.n / 2;
    return p->n_classes++;
}

static bool class_add(struct parser *p, int32_t cls, uint32_t lo, uint32_t hi)
{
    if (!ivec_push(&p->ranges, (int32_t)lo) || !ivec_push(&p->ranges, (int32_t)hi))
        return nomem(p), false;
    p->classes[cls].n++;
    return true;
}

/* ---- characters ------------------------------------------------------------------ */

/* One UTF-8 character of the source; invalid bytes are an error. */
static bool read_utf8(struct parser *p, uint32_t *cp)
{
    size_t at = p->pos;
    unsigned char b = (unsigned char)p->s[at];
    int n = b < 0x80 ? 1 : (b & 0xE0) == 0xC0 ? 2 : (b & 0xF0) == 0xE0 ? 3 : (b & 0xF8) == 0xF0 ? 4 : 0;
    if (n == 0 || at + (size_t)n > p->len)
        return perr(p, KS_ERR_FORMAT, at, "invalid UTF-8 byte 0x%02X", b), false;
    uint32_t c = n == 1 ? b : n == 2 ? b & 0x1Fu : n == 3 ? b & 0x0Fu : b & 0x07u;
    for (int i = 1; i < n; i++) {
        unsigned char x = (unsigned char)p->s[at + (size_t)i];
        if ((x & 0xC0) != 0x80)
            return perr(p, KS_ERR_FORMAT, at, "invalid UTF-8 sequence"), false;
        c = (c << 6) | (x & 0x3Fu);
    }
    static const uint32_t min_of[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (c < min_of[n] || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF))
        return perr(p, KS_ERR_FORMAT, at, "invalid UTF-8 sequence"), false;
    p->pos += (size_t)n;
    *cp = c;
    return true;
}

static bool read_hex(struct parser *p, int digits, uint32_t *cp)
{
    uint32_t v = 0;
    for (int i = 0; i < digits; i++) {
        int c = peek(p, 0);
        int d = sbuf_hex_digit(c);
        if (d < 0)
            return perr(p, KS_ERR_FORMAT, p->pos, "expected %d hex digits", digits), false;
        v = v * 16 + (uint32_t)d;
        p->pos++;
    }
    if (v > 0x10FFFF)
        return perr(p, KS_ERR_FORMAT, p->pos, "code point U+%X is above U+10FFFF", v), false;
    *cp = v;
    return true;
}

/* A literal or class character with its escapes. */
static bool read_char(struct parser *p, uint32_t *cp)
{
    if (p->pos >= p->len)
        return perr(p, KS_ERR_FORMAT, p->pos, "unexpected end of grammar"), false;
    if (p->s[p->pos] != '\\')
        return read_utf8(p, cp);
    size_t at = p->pos++;
    int e = peek(p, 0);
    p->pos++;
    switch (e) {
    case 'x': return read_hex(p, 2, cp);
    case 'u': return read_hex(p, 4, cp);
    case 'U': return read_hex(p, 8, cp);
    case 'n': *cp = '\n'; return true;
    case 'r': *cp = '\r'; return true;
    case 't': *cp = '\t'; return true;
    case '\\': case '"': case '[': case ']': case '-': case '/': case '\'': case '^':
        *cp = (uint32_t)e;
        return true;
    default:
        return perr(p, KS_ERR_FORMAT, at, "unknown escape '\\%c'", e > 32 && e < 127 ? e : '?'), false;
    }
}

/* ---- expressions ------------------------------------------------------------------- */

static bool parse_alternates(struct parser *p, int32_t rule, bool nested);

/* A decimal number of at most max; what names it in errors. */
static bool parse_int(struct parser *p, int32_t max, const char *what, int32_t *out)
{
    size_t at = p->pos;
    int64_t v = 0;
    if (peek(p, 0) < '0' || peek(p, 0) > '9')
        return perr(p, KS_ERR_FORMAT, at, "expected a %s", what), false;
    while (peek(p, 0) >= '0' && peek(p, 0) <= '9') {
        v = v * 10 + (peek(p, 0) - '0');
        if (v > max)
            return perr(p, KS_ERR_FORMAT, at, "%s over %d", what, max), false;
        p->pos++;
    }
    *out = (int32_t)v;
    return true;
}

/* Rewrite the operand elems[from..) of rule with a postfix operator:
 * x* -> R ::= x R | ;  x+ -> x x* ;  x? -> O ::= x | ;
 * x{m,n} -> m copies of x then (n - m) nested optionals, x{m,} -> m copies then x*. */
static bool apply_repeat(struct parser *p, int32_t rule, int32_t from, int32_t lo, int32_t hi /* -1: inf */)
{
    struct ivec *v = &p->rules[rule].elems;
    int32_t n = (v->n - from) / 2;
    int32_t kind, arg;
    if (n == 1) {
        kind = v->p[from];
        arg = v->p[from + 1];
    } else {
        int32_t sub = rule_generated(p, rule);
        if (sub < 0)
            return false;
        v = &p->rules[rule].elems; /* rules may have moved */
        for (int32_t i = from; i < v->n; i++)
            if (!ivec_push(&p->rules[sub].elems, v->p[i]))
                return nomem(p), false;
        if (!emit(p, sub, GE_END, 0))
            return false;
        kind = GE_REF;
        arg = sub;
    }
    p->rules[rule].elems.n = from;
    for (int32_t i = 0; i < lo; i++)
        if (!emit(p, rule, kind, arg))
            return false;
    if (hi < 0) {
        int32_t star = rule_generated(p, rule);
        if (star < 0 || !emit(p, star, kind, arg) || !emit(p, star, GE_REF, star) || !emit(p, star, GE_END, 0) ||
            !emit(p, star, GE_END, 0))
            return false;
        return emit(p, rule, GE_REF, star);
    }
    int32_t inner = -1; /* O_k ::= x O_{k-1} | ; O_1 ::= x | */
    for (int32_t k = 0; k < hi - lo; k++) {
        int32_t o = rule_generated(p, rule);
        if (o < 0 || !emit(p, o, kind, arg) || (inner >= 0 && !emit(p, o, GE_REF, inner)) || !emit(p, o, GE_END, 0) ||
            !emit(p, o, GE_END, 0))
            return false;
        inner = o;
    }
    return inner < 0 || emit(p, rule, GE_REF, inner);
}

static bool parse_class(struct parser *p, int32_t rule)
{
    size_t at = p->pos++; /* '[' */
    bool neg = peek(p, 0) == '^';
    if (neg)
        p->pos++;
    int32_t cls = class_new(p, neg);
    if (cls < 0)
        return false;
    while (peek(p, 0) != ']') {
        if (p->pos >= p->len)
            return perr(p, KS_ERR_FORMAT, at, "unterminated character class"), false;
        uint32_t lo, hi;
        if (!read_char(p, &lo))
            return false;
        hi = lo;
        if (peek(p, 0) == '-' && peek(p, 1) != ']' && peek(p, 1) != -1) {
            p->pos++;
            size_t rat = p->pos;
            if (!read_char(p, &hi))
                return false;
            if (hi < lo)
                return perr(p, KS_ERR_FORMAT, rat, "range end below its start"), false;
        }
        if (!class_add(p, cls, lo, hi))
            return false;
    }
    p->pos++;
    if (!neg && p->classes[cls].n == 0)
        return perr(p, KS_ERR_FORMAT, at, "empty character class []"), false;
    return emit(p, rule, GE_CHAR, cls);
}

/* <[N]>: the token with id N, matched by drawing that token (a control
 * token's markup, say), never by text. */
static bool parse_token(struct parser *p, int32_t rule)
{
    p->pos += 2; /* "<[" */
    int32_t id;
    if (!parse_int(p, GRAMMAR_MAX_TOKEN_ID, "token id", &id))
        return false;
    if (peek(p, 0) != ']' || peek(p, 1) != '>')
        return perr(p, KS_ERR_FORMAT, p->pos, "expected ']>' to end the token <[%d]>", id), false;
    p->pos += 2;
    int32_t cls = class_new(p, false);
    if (cls < 0 || !class_add(p, cls, GRAMMAR_TOKEN_CP(id), GRAMMAR_TOKEN_CP(id)))
        return false;
    p->classes[cls].token = true;
    return emit(p, rule, GE_CHAR, cls);
}

static bool parse_sequence(struct parser *p, int32_t rule, bool nested)
{
    for (;;) {
        skip_space(p, nested);
        int c = peek(p, 0);
        if (c == -1 || c == '|' || c == ')' || c == '\n')
            return true;
        int32_t from = p->rules[rule].elems.n;
        size_t at = p->pos;
        if (c == '"') {
            p->pos++;
            while (peek(p, 0) != '"') {
                if (p->pos >= p->len)
                    return perr(p, KS_ERR_FORMAT, at, "unterminated string literal"), false;
                uint32_t cp;
                int32_t cls;
                if (!read_char(p, &cp) || (cls = class_new(p, false)) < 0 || !class_add(p, cls, cp, cp) ||
                    !emit(p, rule, GE_CHAR, cls))
                    return false;
            }
            p->pos++;
            if (p->rules[rule].elems.n == from) { /* "" matches nothing: no element */
                skip_space(p, nested);
                continue;
            }
        } else if (c == '[') {
            if (!parse_class(p, rule))
                return false;
        } else if (c == '<' && peek(p, 1) == '[') {
            if (!parse_token(p, rule))
                return false;
        } else if (c == '.') {
            p->pos++;
            int32_t cls = class_new(p, true);
            if (cls < 0 || !emit(p, rule, GE_CHAR, cls))
                return false;
        } else if (c == '(') {
            if (p->depth >= GRAMMAR_MAX_NESTING)
                return perr(p, KS_ERR_FORMAT, at, "parentheses nested deeper than %d", GRAMMAR_MAX_NESTING), false;
            p->pos++;
            p->depth++;
            int32_t sub = rule_generated(p, rule);
            if (sub < 0 || !parse_alternates(p, sub, true))
                return false;
            skip_space(p, true);
            if (peek(p, 0) != ')')
                return perr(p, KS_ERR_FORMAT, p->pos, "expected ')' to close the '(' at offset %zu", at), false;
            p->pos++;
            p->depth--;
            if (!emit(p, rule, GE_REF, sub))
                return false;
        } else if (is_name_char(c)) {
            size_t n = 0;
            while (is_name_char(peek(p, (size_t)n)))
                n++;
            int32_t ref = rule_get(p, p->s + p->pos, n, p->pos);
            if (ref < 0)
                return false;
            p->pos += n;
            if (!emit(p, rule, GE_REF, ref))
                return false;
        } else {
            return perr(p, KS_ERR_FORMAT, at, "unexpected '%c'", c > 32 && c < 127 ? c : '?'), false;
        }
        skip_space(p, nested);
        c = peek(p, 0);
        int32_t lo = -1, hi = -1;
        if (c == '*' || c == '+' || c == '?') {
            p->pos++;
            lo = c == '+' ? 1 : 0;
            hi = c == '?' ? 1 : -1;
        } else if (c == '{') {
            p->pos++;
            skip_space(p, true);
            if (!parse_int(p, GRAMMAR_MAX_REPEAT, "repetition count", &lo))
                return false;
            skip_space(p, true);
            hi = lo;
            if (peek(p, 0) == ',') {
                p->pos++;
                skip_space(p, true);
                hi = -1;
                if (peek(p, 0) != '}' && !parse_int(p, GRAMMAR_MAX_REPEAT, "repetition count", &hi))
                    return false;
                skip_space(p, true);
            }
            if (peek(p, 0) != '}')
                return perr(p, KS_ERR_FORMAT, p->pos, "expected '}' to end the repetition"), false;
            p->pos++;
            if (hi >= 0 && hi < lo)
                return perr(p, KS_ERR_FORMAT, at, "repetition {%d,%d}: the maximum is below the minimum", lo, hi),
                       false;
        }
        if (lo >= 0 && !apply_repeat(p, rule, from, lo, hi))
            return false;
    }
}

static bool parse_alternates(struct parser *p, int32_t rule, bool nested)
{
    for (;;) {
        if (!parse_sequence(p, rule, nested) || !emit(p, rule, GE_END, 0))
            return false;
        /* a '|' may also start the next line of a top-level rule */
        size_t save = p->pos;
        skip_space(p, true);
        if (peek(p, 0) != '|') {
            p->pos = save;
            return true;
        }
        p->pos++;
        skip_space(p, true);
    }
}

static bool parse_rule(struct parser *p)
{
    size_t at = p->pos;
    size_t n = 0;
    while (is_name_char(peek(p, n)))
        n++;
    if (n == 0)
        return perr(p, KS_ERR_FORMAT, at, "expected a rule name"), false;
    int32_t r = rule_get(p, p->s + at, n, at);
    if (r < 0)
        return false;
    if (p->rules[r].defined)
        return perr(p, KS_ERR_FORMAT, at, "rule '%s' is defined twice", p->rules[r].name), false;
    p->rules[r].defined = true;
    p->pos += n;
    skip_space(p, false);
    if (peek(p, 0) != ':' || peek(p, 1) != ':' || peek(p, 2) != '=')
        return perr(p, KS_ERR_FORMAT, p->pos, "expected '::=' after the rule name '%s'", p->rules[r].name), false;
    p->pos += 3;
    skip_space(p, true);
    if (!parse_alternates(p, r, false))
        return false;
    skip_space(p, false);
    if (p->pos < p->len && p->s[p->pos] != '\n')
        return perr(p, KS_ERR_FORMAT, p->pos, "unexpected '%c' (expected the end of the rule)",
                    p->s[p->pos] > 32 && p->s[p->pos] < 127 ? p->s[p->pos] : '?'),
               false;
    return true;
}

/* ---- analysis ------------------------------------------------------------------------ */

static int utf8_len(uint32_t cp)
{
    return cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
}

bool gclass_intersects(const struct grammar *g, const struct gclass *c, uint32_t lo, uint32_t hi)
{
    if (!c->neg) {
        for (int32_t i = 0; i < c->n; i++)
            if (g->ranges[2 * (c->first + i)] <= hi && g->ranges[2 * (c->first + i) + 1] >= lo)
                return true;
        return false;
    }
    /* negated: some point of [lo, hi] outside every range */
    uint32_t x = lo;
    for (bool moved = true; moved && x <= hi;) {
        moved = false;
        for (int32_t i = 0; i < c->n; i++)
            if (g->ranges[2 * (c->first + i)] <= x && g->ranges[2 * (c->first + i) + 1] >= x) {
                x = g->ranges[2 * (c->first + i) + 1] + 1;
                moved = true;
            }
    }
    return x <= hi;
}

static void class_finish(const struct grammar *g, struct gclass *c)
{
    if (c->token) { /* one token: one of the budget, like one byte */
        c->minlen = 1;
        return;
    }
    for (uint32_t cp = 0; cp < 128; cp++) {
        bool in = false;
        for (int32_t i = 0; i < c->n && !in; i++)
            in = cp >= g->ranges[2 * (c->first + i)] && cp <= g->ranges[2 * (c->first + i) + 1];
        if (in != c->neg)
            c->ascii[cp >> 5] |= 1u << (cp & 31);
    }
    /* smallest member: scan boundaries (a range start, or one past a range end) */
    uint32_t best = 0x110000;
    if (!c->neg) {
        for (int32_t i = 0; i < c->n; i++)
            if (g->ranges[2 * (c->first + i)] < best)
                best = g->ranges[2 * (c->first + i)];
    } else {
        uint32_t x = 0;
        for (bool moved = true; moved && x <= 0x10FFFF;) {
            moved = false;
            for (int32_t i = 0; i < c->n; i++)
                if (g->ranges[2 * (c->first + i)] <= x && g->ranges[2 * (c->first + i) + 1] >= x) {
                    x = g->ranges[2 * (c->first + i) + 1] + 1;
                    moved = true;
                }
        }
        best = x;
    }
    c->minlen = best > 0x10FFFF ? GRAMMAR_INF : utf8_len(best);
}

static int32_t elem_min(const struct grammar *g, const struct gelem *e)
{
    return e->kind == GE_CHAR ? g->classes[e->arg].minlen : e->kind == GE_REF ? g->rule_min[e->arg] : 0;
}

/* Left recursion: rule r reaches itself through references that can each be
 * preceded only by empty-matching elements. DFS over that graph. */
static ks_status check_left_recursion(struct grammar *g)
{
    int32_t R = g->n_rules;
    bool *nullable = calloc((size_t)R, 1);
    uint8_t *color = calloc((size_t)R, 1);
    int32_t *path = malloc((size_t)R * sizeof *path), *it = malloc((size_t)R * sizeof *it);
    ks_status st = KS_OK;
    if (!nullable || !color || !path || !it) {
        st = ks_fail(KS_ERR_NOMEM, "grammar: out of memory while compiling");
        goto out;
    }
    for (bool changed = true; changed;) {
        changed = false;
        for (int32_t r = 0; r < R; r++) {
            if (nullable[r])
                continue;
            for (int32_t a = g->rule_alt[r]; a < g->rule_alt[r + 1] && !nullable[r]; a++) {
                int32_t p = g->alt_start[a];
                while (g->elems[p].kind == GE_REF && nullable[g->elems[p].arg])
                    p++;
                if (g->elems[p].kind == GE_END)
                    nullable[r] = changed = true;
            }
        }
    }
    /* iterative DFS; edges enumerated by (alternative, element) position in it[] */
    for (int32_t start = 0; start < R && !st; start++) {
        if (color[start])
            continue;
        int32_t depth = 0;
        path[0] = start;
        it[0] = -1;
        color[start] = 1;
        while (depth >= 0 && !st) {
            int32_t r = path[depth];
            /* next left-edge target of r after position it[depth] */
            int32_t next = -1;
            for (int32_t a = g->rule_alt[r]; a < g->rule_alt[r + 1] && next < 0; a++) {
                for (int32_t p = g->alt_start[a]; g->elems[p].kind == GE_REF; p++) {
                    if (p > it[depth]) {
                        next = p;
                        break;
                    }
                    if (!nullable[g->elems[p].arg])
                        break;
                }
            }
            if (next < 0) {
                color[r] = 2;
                depth--;
                continue;
            }
            it[depth] = next;
            int32_t t = g->elems[next].arg;
            if (color[t] == 1) {
                char cyc[200] = "";
                size_t off = 0;
                int32_t k = depth;
                while (k > 0 && path[k] != t)
                    k--;
                for (int32_t j = k; j <= depth && off < sizeof cyc - 40; j++)
                    off += (size_t)snprintf(cyc + off, sizeof cyc - off, "%.30s -> ", g->rule_names[path[j]]);
                snprintf(cyc + off, sizeof cyc - off, "%.30s", g->rule_names[t]);
                const char *name = g->rule_names[t], *hash = strchr(name, '#');
                st = ks_fail(KS_ERR_UNSUPPORTED,
                             "grammar: %s%.*s' is left-recursive (%s) without consuming a character; "
                             "rewrite it with repetition (x ::= y (\"op\" y)*), and never repeat what can be empty",
                             hash ? "a group or repetition in rule '" : "rule '", hash ? (int)(hash - name) : (int)strlen(name),
                             name, cyc);
            } else if (color[t] == 0) {
                color[t] = 1;
                path[++depth] = t;
                it[depth] = -1;
            }
        }
    }
out:
    free(nullable);
    free(color);
    free(path);
    free(it);
    return st;
}

/* The distinct ids of the token terminals, which the mask tries besides the trie. */
static ks_status collect_tokens(struct grammar *g)
{
    for (int32_t c = 0; c < g->n_classes; c++) {
        if (!g->classes[c].token)
            continue;
        int32_t id = (int32_t)(g->ranges[2 * g->classes[c].first] - GRAMMAR_TOKEN_CP(0)), k = 0;
        while (k < g->n_tokens && g->tokens[k] != id)
            k++;
        if (k < g->n_tokens)
            continue;
        int32_t *t = realloc(g->tokens, (size_t)(g->n_tokens + 1) * sizeof *t);
        if (!t)
            return ks_fail(KS_ERR_NOMEM, "grammar: out of memory while compiling");
        g->tokens = t;
        g->tokens[g->n_tokens++] = id;
    }
    return KS_OK;
}

static ks_status analyse(struct grammar *g)
{
    for (int32_t c = 0; c < g->n_classes; c++)
        class_finish(g, &g->classes[c]);
    ks_status st = collect_tokens(g);
    if (!st)
        st = check_left_recursion(g);
    if (st)
        return st;
    for (int32_t r = 0; r < g->n_rules; r++)
        g->rule_min[r] = GRAMMAR_INF;
    for (bool changed = true; changed;) {
        changed = false;
        for (int32_t r = 0; r < g->n_rules; r++)
            for (int32_t a = g->rule_alt[r]; a < g->rule_alt[r + 1]; a++) {
                int32_t sum = 0;
                for (int32_t p = g->alt_start[a]; g->elems[p].kind != GE_END; p++)
                    sum = gsat_add(sum, elem_min(g, &g->elems[p]));
                if (sum < g->rule_min[r]) {
                    g->rule_min[r] = sum;
                    changed = true;
                }
            }
    }
    for (int32_t p = g->n_elems - 1; p >= 0; p--)
        g->minrest[p] = g->elems[p].kind == GE_END ? 0 : gsat_add(elem_min(g, &g->elems[p]), g->minrest[p + 1]);
    if (g->rule_min[g->root] >= GRAMMAR_INF)
        return ks_fail(KS_ERR_UNSUPPORTED, "grammar: 'root' can never end (every alternative recurses forever), or "
                                           "its shortest text is over %d bytes", GRAMMAR_INF);
    return KS_OK;
}

/* ---- entry ------------------------------------------------------------------------------ */

static void parser_free(struct parser *p)
{
    for (int32_t i = 0; i < p->n_rules; i++) {
        free(p->rules[i].name);
        free(p->rules[i].elems.p);
    }
    free(p->rules);
    free(p->classes);
    free(p->ranges.p);
}

static ks_status flatten(struct parser *p, struct grammar *g)
{
    int32_t n_elems = 0, n_alts = 0;
    for (int32_t r = 0; r < p->n_rules; r++) {
        n_elems += p->rules[r].elems.n / 2;
        for (int32_t i = 0; i < p->rules[r].elems.n; i += 2)
            n_alts += p->rules[r].elems.p[i] == GE_END;
    }
    g->n_rules = p->n_rules;
    g->n_elems = n_elems;
    g->elems = malloc((size_t)n_elems * sizeof *g->elems);
    g->minrest = malloc((size_t)n_elems * sizeof *g->minrest);
    g->alt_start = malloc((size_t)n_alts * sizeof *g->alt_start);
    g->rule_alt = malloc((size_t)(p->n_rules + 1) * sizeof *g->rule_alt);
    g->rule_min = malloc((size_t)p->n_rules * sizeof *g->rule_min);
    g->rule_names = calloc((size_t)p->n_rules, sizeof *g->rule_names);
    if (!g->elems || !g->minrest || !g->alt_start || !g->rule_alt || !g->rule_min || !g->rule_names)
        return ks_fail(KS_ERR_NOMEM, "grammar: out of memory while compiling");
    int32_t e = 0, a = 0;
    for (int32_t r = 0; r < p->n_rules; r++) {
        g->rule_alt[r] = a;
        g->rule_names[r] = p->rules[r].name;
        p->rules[r].name = NULL;
        bool alt_open = false;
        for (int32_t i = 0; i < p->rules[r].elems.n; i += 2) {
            if (!alt_open) {
                g->alt_start[a++] = e;
                alt_open = true;
            }
            g->elems[e].kind = (uint8_t)p->rules[r].elems.p[i];
            g->elems[e].arg = p->rules[r].elems.p[i + 1];
            if (g->elems[e].kind == GE_END)
                alt_open = false;
            e++;
        }
    }
    g->rule_alt[p->n_rules] = a;
    g->classes = p->classes;
    g->n_classes = p->n_classes;
    p->classes = NULL;
    g->ranges = (uint32_t *)p->ranges.p;
    p->ranges.p = NULL;
    return KS_OK;
}

static void grammar_destroy(struct grammar *g)
{
    if (!g)
        return;
    for (int32_t r = 0; g->rule_names && r < g->n_rules; r++)
        free(g->rule_names[r]);
    free(g->rule_names);
    free(g->elems);
    free(g->minrest);
    free(g->alt_start);
    free(g->rule_alt);
    free(g->rule_min);
    free(g->classes);
    free(g->ranges);
    free(g->tokens);
    free(g);
}

ks_status grammar_compile(const char *gbnf, size_t len, struct grammar **out)
{
    if (!out || (!gbnf && len))
        return ks_fail(KS_ERR_INVALID_ARG, "grammar_compile: NULL argument");
    if (len > GRAMMAR_MAX_SOURCE)
        return ks_fail(KS_ERR_RANGE, "grammar: %zu bytes is over the limit of %u", len, GRAMMAR_MAX_SOURCE);
    struct parser p = {.s = gbnf ? gbnf : "", .len = len};
    for (;;) {
        skip_space(&p, true);
        if (p.pos >= p.len || !parse_rule(&p))
            break;
    }
    for (int32_t r = 0; !p.err && r < p.n_rules; r++)
        if (!p.rules[r].defined)
            perr(&p, KS_ERR_FORMAT, p.rules[r].first_use, "rule '%s' is used but never defined", p.rules[r].name);
    int32_t root = -1;
    for (int32_t r = 0; !p.err && r < p.n_rules; r++)
        if (!strcmp(p.rules[r].name, "root"))
            root = r;
    if (!p.err && root < 0)
        p.err = ks_fail(KS_ERR_FORMAT, "grammar: no 'root' rule (the start symbol: root ::= ...)");
    if (p.err) {
        parser_free(&p);
        return p.err;
    }
    struct grammar *g = calloc(1, sizeof *g);
    ks_status st = g ? flatten(&p, g) : ks_fail(KS_ERR_NOMEM, "grammar: out of memory while compiling");
    parser_free(&p);
    if (!st) {
        g->root = root;
        st = analyse(g);
    }
    if (st) {
        grammar_destroy(g);
        return st;
    }
    atomic_init(&g->refs, 1);
    *out = g;
    return KS_OK;
}

void grammar_retain(struct grammar *g)
{
    atomic_fetch_add(&g->refs, 1);
}

void grammar_free(struct grammar *g)
{
    if (g && atomic_fetch_sub(&g->refs, 1) == 1)
        grammar_destroy(g);
}

int32_t grammar_min_bytes(const struct grammar *g)
{
    return g->rule_min[g->root];
}
