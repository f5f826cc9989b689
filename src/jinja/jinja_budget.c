/* jinja: a render's errors, memory and step budget, which the interpreter
 * (jinja_eval.c), the values (jinja_value.c) and the builtins all charge. */
#include <stdarg.h>
#include <stdio.h>

#include "jinja/jinja_internal.h"

void jx_fail(struct jctx *cx, ks_status st, const char *fmt, ...)
{
    char what[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    int line = cx->where ? cx->where->line : 1, col = cx->where ? cx->where->col : 1;
    snprintf(cx->msg, sizeof cx->msg, "line %d, column %d: %s", line, col, what);
    cx->err = st;
    longjmp(cx->jmp, 1);
}

void *jx_alloc(struct jctx *cx, size_t n)
{
    void *p = arena_alloc(&cx->arena, n);
    if (p)
        return p;
    if (n > cx->arena.limit || cx->arena.used + n + 65536 > cx->arena.limit)
        jx_fail(cx, KS_ERR_RANGE, "the render needs more than its memory limit of %zu bytes", cx->arena.limit);
    jx_fail(cx, KS_ERR_NOMEM, "out of memory rendering the template");
}

void jx_step(struct jctx *cx)
{
    if (++cx->steps > cx->opts.max_steps)
        jx_fail(cx, KS_ERR_RANGE, "the render took more than its step limit of %llu steps",
                (unsigned long long)cx->opts.max_steps);
}

void jx_work(struct jctx *cx, size_t units)
{
    uint64_t cost = 1 + units / JX_WORK_PER_STEP;
    if (cost > cx->opts.max_steps - (cx->steps < cx->opts.max_steps ? cx->steps : cx->opts.max_steps))
        jx_fail(cx, KS_ERR_RANGE, "the render took more than its step limit of %llu steps",
                (unsigned long long)cx->opts.max_steps);
    cx->steps += cost;
}
