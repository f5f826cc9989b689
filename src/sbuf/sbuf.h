/* sbuf: a growable byte string that stays NUL-terminated, for building
 * replies and prompts piece by piece.
 *
 * Contract:
 * - A zeroed `struct sbuf` is an empty buffer; `p` stays NULL until the first
 *   append. After any append `p[n] == '\0'`, so `p` is a C string when the
 *   appended bytes hold no NUL.
 * - Out of memory is sticky: the failing append sets `oom`, leaves the bytes
 *   appended so far intact, and every later append is a no-op. Check `oom`
 *   once, after the last append, instead of after each one.
 * - The buffer owns `p`; sbuf_free releases it and zeroes the struct. A caller
 *   that takes `p` sets the struct to zero instead of freeing.
 * - Not thread-safe: one buffer, one thread at a time. */
#ifndef KS_SBUF_H
#define KS_SBUF_H

#include <stdbool.h>
#include <stddef.h>

struct sbuf {
    char *p;    /* bytes, NUL-terminated; NULL while nothing was appended */
    size_t n;   /* bytes appended, without the terminator */
    size_t cap; /* bytes allocated at p */
    bool oom;   /* an append failed: the buffer holds a prefix of what was asked */
};

/* Append n bytes of s (which may hold NULs). */
void sbuf_append(struct sbuf *b, const char *s, size_t n);

/* Append the C string s. */
void sbuf_puts(struct sbuf *b, const char *s);

/* Append printf-formatted text of any length. */
void sbuf_printf(struct sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Release the bytes and zero the buffer (a zeroed buffer is fine). */
void sbuf_free(struct sbuf *b);

/* The value of one hex digit (either case), -1 for any other character: for
 * the parsers of text that builds strings (JSON and template escapes,
 * SentencePiece's <0xNN> byte pieces). */
static inline int sbuf_hex_digit(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

#endif
