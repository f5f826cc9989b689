/* sbuf: a growable NUL-terminated byte string with a sticky out-of-memory flag. */
#include "sbuf/sbuf.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void sbuf_append(struct sbuf *b, const char *s, size_t n)
{
    if (b->oom)
        return;
    if (n > SIZE_MAX / 2 - b->n - 1) {
        b->oom = true;
        return;
    }
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = true;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    if (n)
        memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
}

void sbuf_puts(struct sbuf *b, const char *s)
{
    sbuf_append(b, s, strlen(s));
}

void sbuf_printf(struct sbuf *b, const char *fmt, ...)
{
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0) {
        b->oom = true; /* an encoding error: the text cannot be built */
        return;
    }
    if ((size_t)n < sizeof tmp) {
        sbuf_append(b, tmp, (size_t)n);
        return;
    }
    char *big = malloc((size_t)n + 1);
    if (!big) {
        b->oom = true;
        return;
    }
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    sbuf_append(b, big, (size_t)n);
    free(big);
}

void sbuf_free(struct sbuf *b)
{
    free(b->p);
    memset(b, 0, sizeof *b);
}
