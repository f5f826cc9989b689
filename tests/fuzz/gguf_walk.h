/* Touch everything a successfully opened GGUF exposes, so that a reader bug
 * that lets a pointer escape the buffer shows up under ASan. Shared by the
 * libFuzzer harness and the corpus-replay test. Returns a checksum so the
 * reads cannot be optimized away. */
#ifndef KS_TESTS_GGUF_WALK_H
#define KS_TESTS_GGUF_WALK_H

#include <string.h>

#include "gguf/gguf.h"

static inline uint64_t gguf_walk_bytes(const void *p, uint64_t n)
{
    const unsigned char *b = p;
    return n ? (uint64_t)b[0] + b[n - 1] + b[n / 2] : 0;
}

static inline uint64_t gguf_walk_kv(const struct gguf_file *f, int64_t i)
{
    const char *key = gguf_key_at(f, i);
    uint64_t sum = strlen(key) + (uint64_t)gguf_find_key(f, key);
    char buf[256];
    gguf_format_value(f, i, buf, sizeof buf);
    sum += strlen(buf);
    uint32_t u32; int32_t i32; uint64_t u64; float f32; bool b; struct gguf_str s;
    if (!gguf_get_u32(f, key, &u32)) sum += u32;
    if (!gguf_get_i32(f, key, &i32)) sum += (uint64_t)i32;
    if (!gguf_get_u64(f, key, &u64)) sum += u64;
    if (!gguf_get_f32(f, key, &f32)) sum += (uint64_t)(f32 == f32);
    if (!gguf_get_bool(f, key, &b)) sum += b;
    if (!gguf_get_str(f, key, &s)) sum += gguf_walk_bytes(s.data, s.len);
    enum gguf_value_type et;
    uint64_t count;
    const void *data;
    if (!gguf_get_arr(f, key, &et, &count, &data)) {
        size_t esize = et == GGUF_TYPE_UINT8 || et == GGUF_TYPE_INT8 || et == GGUF_TYPE_BOOL ? 1
                     : et == GGUF_TYPE_UINT16 || et == GGUF_TYPE_INT16 ? 2
                     : et == GGUF_TYPE_UINT32 || et == GGUF_TYPE_INT32 || et == GGUF_TYPE_FLOAT32 ? 4
                     : et == GGUF_TYPE_STRING || et == GGUF_TYPE_ARRAY ? 0 : 8;
        if (data)
            sum += gguf_walk_bytes(data, count * esize);
        for (uint64_t k = 0; et == GGUF_TYPE_STRING && k < count; k++)
            if (!gguf_get_arr_str(f, key, k, &s))
                sum += gguf_walk_bytes(s.data, s.len);
        gguf_get_arr_str(f, key, count, &s); /* past the end: must fail cleanly */
    }
    return sum;
}

static inline uint64_t gguf_walk(const struct gguf_file *f)
{
    uint64_t sum = gguf_version(f) + gguf_alignment(f) + gguf_data_offset(f) + gguf_file_size(f);
    for (int64_t i = 0; i < gguf_n_kv(f); i++)
        sum += gguf_walk_kv(f, i);
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        const struct gguf_tensor_info *t = gguf_tensor_at(f, i);
        sum += gguf_walk_bytes(t->data, t->nbytes) + (gguf_find_tensor(f, t->name) == t);
        for (int d = 0; d < GGUF_MAX_DIMS; d++)
            sum += (uint64_t)t->ne[d];
    }
    sum += gguf_key_at(f, -1) == NULL && gguf_tensor_at(f, gguf_n_tensors(f)) == NULL;
    return sum;
}

#endif
