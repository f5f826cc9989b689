/* jinja: the bump allocator behind templates and renders (see jinja_internal.h). */
#include <stdlib.h>
#include <string.h>

#include "jinja/jinja_internal.h"

#define ARENA_BLOCK_MIN (64u * 1024u)
#define ARENA_ALIGN 16u

struct ja_block {
    struct ja_block *next;
    size_t size, off; /* usable bytes after the header, bytes used */
    _Alignas(16) unsigned char data[];
};

void *arena_alloc(struct arena *a, size_t n)
{
    n = (n + ARENA_ALIGN - 1) & ~(size_t)(ARENA_ALIGN - 1);
    if (n == 0)
        n = ARENA_ALIGN;
    struct ja_block *b = a->head;
    if (!b || b->size - b->off < n) {
        size_t size = n > ARENA_BLOCK_MIN ? n : ARENA_BLOCK_MIN;
        if (size > a->limit || a->used > a->limit - size)
            return NULL;
        b = malloc(sizeof *b + size);
        if (!b)
            return NULL;
        b->next = a->head;
        b->size = size;
        b->off = 0;
        a->head = b;
        a->used += size;
    }
    void *p = b->data + b->off;
    b->off += n;
    memset(p, 0, n);
    return p;
}

void arena_free(struct arena *a)
{
    struct ja_block *b = a->head;
    while (b) {
        struct ja_block *next = b->next;
        free(b);
        b = next;
    }
    a->head = NULL;
    a->used = 0;
}
