/* A tiny byte builder for hand-made GGUF files in the gguf tests: the writer
 * cannot (and must not) produce malformed files or nested arrays. */
#ifndef KS_TESTS_GGUF_BYTES_H
#define KS_TESTS_GGUF_BYTES_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

struct bb {
    uint8_t *p;
    size_t len, cap;
};

static inline void bb_put(struct bb *b, const void *src, size_t n)
{
    if (b->len + n > b->cap) {
        b->cap = (b->len + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        if (!b->p)
            abort();
    }
    if (n)
        memcpy(b->p + b->len, src, n);
    b->len += n;
}

static inline void bb_u8(struct bb *b, uint8_t v) { bb_put(b, &v, 1); }
static inline void bb_u32(struct bb *b, uint32_t v) { bb_put(b, &v, 4); }
static inline void bb_u64(struct bb *b, uint64_t v) { bb_put(b, &v, 8); }
static inline void bb_strn(struct bb *b, const char *s, uint64_t n)
{
    bb_u64(b, n);
    bb_put(b, s, (size_t)n);
}
static inline void bb_str(struct bb *b, const char *s) { bb_strn(b, s, strlen(s)); }
/* A string whose length field claims more bytes than follow. */
static inline void bb_str_claim(struct bb *b, const char *s, uint64_t claimed)
{
    bb_u64(b, claimed);
    bb_put(b, s, strlen(s));
}

static inline void bb_header(struct bb *b, uint32_t version, uint64_t n_tensors, uint64_t n_kv)
{
    bb_put(b, "GGUF", 4);
    bb_u32(b, version);
    bb_u64(b, n_tensors);
    bb_u64(b, n_kv);
}

/* key, type, then the caller appends the value */
static inline void bb_key(struct bb *b, const char *key, uint32_t type)
{
    bb_str(b, key);
    bb_u32(b, type);
}

static inline void bb_tensor(struct bb *b, const char *name, uint32_t n_dims, const uint64_t *ne, uint32_t type,
                             uint64_t offset)
{
    bb_str(b, name);
    bb_u32(b, n_dims);
    for (uint32_t d = 0; d < n_dims; d++)
        bb_u64(b, ne[d]);
    bb_u32(b, type);
    bb_u64(b, offset);
}

/* Pad with zeros to a multiple of a, then append n data bytes of value v. */
static inline void bb_data(struct bb *b, size_t a, size_t n, uint8_t v)
{
    while (b->len % a)
        bb_u8(b, 0);
    for (size_t i = 0; i < n; i++)
        bb_u8(b, v);
}

#endif
