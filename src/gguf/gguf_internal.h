/* Internal to the gguf module: the parsed file, shared by the reader, the
 * typed getters and the writer (gguf_writer_copy_kv copies raw value bytes). */
#ifndef KS_GGUF_INTERNAL_H
#define KS_GGUF_INTERNAL_H

#include "gguf/gguf.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the gguf module reads little-endian files on little-endian hosts only"
#endif

/* Open-addressing table from name to index; slots hold index + 1, 0 is empty. */
struct gguf_index {
    uint64_t *slots;
    uint64_t mask;
};

struct gguf_kv {
    char *key;                  /* NUL-terminated copy */
    uint64_t key_offset;        /* where the key's length field starts */
    enum gguf_value_type type;
    uint64_t value_offset;      /* first byte after the type field */
    uint64_t value_bytes;       /* encoded size of the value */
    /* ARRAY only */
    enum gguf_value_type elem_type;
    uint64_t count;
    uint64_t *str_offsets;      /* STRING arrays: offset of each element's length field */
};

/* gguf_open_private lines the most tensor bytes up to this (a cache line). */
enum { GGUF_COPY_ALIGN = 64 };

struct gguf_file {
    const uint8_t *base;
    size_t size;
    bool mapped;                /* munmap on close */
    bool private_copy;          /* base is gguf_open_private's writable copy */
    size_t map_shift;           /* base is this far into the mapping (a copy's alignment) */
    uint32_t version;
    uint64_t alignment;
    uint64_t data_offset;
    int64_t n_kv;
    struct gguf_kv *kv;
    int64_t n_tensors;
    struct gguf_tensor_info *tensors;
    struct gguf_index key_index;
    struct gguf_index tensor_index;
};

/* Bytes of one fixed-size value, 0 for STRING/ARRAY/unknown. */
size_t gguf_value_size(enum gguf_value_type t);

/* A non-negative integer value of any integer type; false otherwise. */
bool gguf_value_to_u64(const uint8_t *p, enum gguf_value_type t, uint64_t *out);

uint64_t gguf_hash(const char *s);
/* Index of name, or -1; get_name(ctx, i) returns the name stored at i. */
int64_t gguf_index_find(const struct gguf_index *ix, const char *name,
                        const char *(*get_name)(const void *ctx, int64_t i), const void *ctx);

#endif
