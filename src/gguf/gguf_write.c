/* gguf writer: GGUF v3, little-endian. Metadata values are encoded when set,
 * so writing is a sequence of fwrite calls and copying a key from an open
 * file is one memcpy of its encoded bytes. */
#include "gguf/gguf_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { GGUF_WRITE_VERSION = 3, WRITER_KEY_MAX_BYTES = 65535, WRITER_NAME_MAX_BYTES = 63 };

struct writer_kv {
    char *key;
    enum gguf_value_type type;
    uint8_t *value; /* encoded, without the type field */
    size_t value_bytes;
};

struct writer_tensor {
    char *name;
    uint32_t n_dims;
    int64_t ne[GGUF_MAX_DIMS];
    enum quant_type type;
    const void *data;
    uint64_t nbytes;
};

struct gguf_writer {
    struct writer_kv *kv;
    size_t n_kv, cap_kv;
    struct writer_tensor *tensors;
    size_t n_tensors, cap_tensors;
};

ks_status gguf_writer_create(struct gguf_writer **out)
{
    if (!out)
        return ks_fail(KS_ERR_INVALID_ARG, "gguf_writer_create: NULL argument");
    *out = calloc(1, sizeof **out);
    return *out ? KS_OK : ks_fail(KS_ERR_NOMEM, "no memory for a GGUF writer");
}

void gguf_writer_free(struct gguf_writer *w)
{
    if (!w)
        return;
    for (size_t i = 0; i < w->n_kv; i++) {
        free(w->kv[i].key);
        free(w->kv[i].value);
    }
    for (size_t i = 0; i < w->n_tensors; i++)
        free(w->tensors[i].name);
    free(w->kv);
    free(w->tensors);
    free(w);
}

static ks_status grow(void **items, size_t *cap, size_t need, size_t item_size)
{
    if (need <= *cap)
        return KS_OK;
    size_t n = *cap ? *cap * 2 : 16;
    void *p = realloc(*items, n * item_size);
    if (!p)
        return ks_fail(KS_ERR_NOMEM, "no memory to grow the GGUF writer");
    *items = p;
    *cap = n;
    return KS_OK;
}

static struct writer_kv *find_kv(struct gguf_writer *w, const char *key)
{
    for (size_t i = 0; i < w->n_kv; i++)
        if (!strcmp(w->kv[i].key, key))
            return &w->kv[i];
    return NULL;
}

/* Takes ownership of value (also on failure). Setting a key again replaces it. */
static ks_status set_encoded(struct gguf_writer *w, const char *key, enum gguf_value_type type, uint8_t *value,
                             size_t value_bytes)
{
    ks_status st = KS_OK;
    size_t klen = key ? strlen(key) : 0;
    if (!w || klen == 0 || klen > WRITER_KEY_MAX_BYTES)
        st = ks_fail(KS_ERR_INVALID_ARG, "GGUF writer: key must be 1..%d bytes", WRITER_KEY_MAX_BYTES);
    struct writer_kv *kv = st ? NULL : find_kv(w, key);
    if (!st && !kv) {
        st = grow((void **)&w->kv, &w->cap_kv, w->n_kv + 1, sizeof *w->kv);
        char *copy = st ? NULL : strdup(key);
        if (!st && !copy)
            st = ks_fail(KS_ERR_NOMEM, "no memory for key '%s'", key);
        if (!st) {
            kv = &w->kv[w->n_kv++];
            *kv = (struct writer_kv){.key = copy};
        }
    }
    if (st) {
        free(value);
        return st;
    }
    free(kv->value);
    kv->type = type;
    kv->value = value;
    kv->value_bytes = value_bytes;
    return KS_OK;
}

static ks_status set_bytes(struct gguf_writer *w, const char *key, enum gguf_value_type type, const void *src,
                           size_t n)
{
    uint8_t *p = malloc(n ? n : 1);
    if (!p)
        return ks_fail(KS_ERR_NOMEM, "no memory for the value of '%s'", key ? key : "");
    memcpy(p, src, n);
    return set_encoded(w, key, type, p, n);
}

ks_status gguf_writer_set_u32(struct gguf_writer *w, const char *key, uint32_t v)
{
    return set_bytes(w, key, GGUF_TYPE_UINT32, &v, sizeof v);
}
ks_status gguf_writer_set_i32(struct gguf_writer *w, const char *key, int32_t v)
{
    return set_bytes(w, key, GGUF_TYPE_INT32, &v, sizeof v);
}
ks_status gguf_writer_set_u64(struct gguf_writer *w, const char *key, uint64_t v)
{
    return set_bytes(w, key, GGUF_TYPE_UINT64, &v, sizeof v);
}
ks_status gguf_writer_set_f32(struct gguf_writer *w, const char *key, float v)
{
    return set_bytes(w, key, GGUF_TYPE_FLOAT32, &v, sizeof v);
}
ks_status gguf_writer_set_bool(struct gguf_writer *w, const char *key, bool v)
{
    uint8_t b = v;
    return set_bytes(w, key, GGUF_TYPE_BOOL, &b, 1);
}

ks_status gguf_writer_set_scalar(struct gguf_writer *w, const char *key, enum gguf_value_type type, const void *v)
{
    size_t n = gguf_value_size(type);
    if (!n || !v)
        return ks_fail(KS_ERR_INVALID_ARG, "GGUF writer: '%s': %s is not a scalar type", key ? key : "",
                       gguf_type_name(type));
    if (type == GGUF_TYPE_BOOL && *(const uint8_t *)v > 1)
        return ks_fail(KS_ERR_INVALID_ARG, "GGUF writer: '%s': bool value is not 0 or 1", key ? key : "");
    return set_bytes(w, key, type, v, n);
}

ks_status gguf_writer_set_str(struct gguf_writer *w, const char *key, const char *v)
{
    if (!v)
        return ks_fail(KS_ERR_INVALID_ARG, "GGUF writer: NULL string for '%s'", key ? key : "");
    uint64_t len = strlen(v);
    uint8_t *p = malloc(8 + len);
    if (!p)
        return ks_fail(KS_ERR_NOMEM, "no memory for the value of '%s'", key ? key : "");
    memcpy(p, &len, 8);
    memcpy(p + 8, v, len);
    return set_encoded(w, key, GGUF_TYPE_STRING, p, 8 + len);
}

static void put_array_header(uint8_t *p, enum gguf_value_type elem, uint64_t count)
{
    uint32_t t = elem;
    memcpy(p, &t, 4);
    memcpy(p + 4, &count, 8);
}

ks_status gguf_writer_set_arr(struct gguf_writer *w, const char *key, enum gguf_value_type elem, const void *data,
                              uint64_t count)
{
    size_t esize = gguf_value_size(elem), bytes;
    if (!esize || (!data && count))
        return ks_fail(KS_ERR_INVALID_ARG, "GGUF writer: '%s': arrays of %s need gguf_writer_set_arr_str",
                       key ? key : "", gguf_type_name(elem));
    if (__builtin_mul_overflow(count, esize, &bytes) || __builtin_add_overflow(bytes, 12, &bytes))
        return ks_fail(KS_ERR_INVALID_ARG, "GGUF writer: '%s': array of %llu elements is too large", key ? key : "",
                       (unsigned long long)count);
    if (elem == GGUF_TYPE_BOOL)
        for (uint64_t i = 0; i < count; i++)
            if (((const uint8_t *)data)[i] > 1)
                return ks_fail(KS_ERR_INVALID_ARG, "GGUF writer: '%s': bool element %llu is not 0 or 1",
                               key ? key : "", (unsigned long long)i);
    uint8_t *p = malloc(bytes);
    if (!p)
        return ks_fail(KS_ERR_NOMEM, "no memory for the value of '%s'", key ? key : "");
    put_array_header(p, elem, count);
    if (count)
        memcpy(p + 12, data, bytes - 12);
    return set_encoded(w, key, GGUF_TYPE_ARRAY, p, bytes);
}

static uint64_t elem_len(const char *const *strs, const uint64_t *lens, uint64_t i)
{
    return lens ? lens[i] : strlen(strs[i]);
}

ks_status gguf_writer_set_arr_str(struct gguf_writer *w, const char *key, const char *const *strs,
                                  const uint64_t *lens, uint64_t count)
{
    size_t bytes = 12;
    bool bad = !strs && count;
    for (uint64_t i = 0; i < count && !bad; i++) {
        uint64_t len = strs[i] ? elem_len(strs, lens, i) : 0;
        bad = (!strs[i] && (!lens || lens[i])) || __builtin_add_overflow(bytes, 8, &bytes) ||
              __builtin_add_overflow(bytes, len, &bytes);
    }
    if (bad)
        return ks_fail(KS_ERR_INVALID_ARG, "GGUF writer: '%s': NULL or oversized strings", key ? key : "");
    uint8_t *p = malloc(bytes), *o = p + 12;
    if (!p)
        return ks_fail(KS_ERR_NOMEM, "no memory for %llu strings of '%s'", (unsigned long long)count, key ? key : "");
    put_array_header(p, GGUF_TYPE_STRING, count);
    for (uint64_t i = 0; i < count; i++) {
        uint64_t len = strs[i] ? elem_len(strs, lens, i) : 0;
        memcpy(o, &len, 8);
        if (len)
            memcpy(o + 8, strs[i], len);
        o += 8 + len;
    }
    return set_encoded(w, key, GGUF_TYPE_ARRAY, p, bytes);
}

ks_status gguf_writer_copy_kv(struct gguf_writer *w, const struct gguf_file *src, const char *prefix)
{
    if (!w || !src || !prefix)
        return ks_fail(KS_ERR_INVALID_ARG, "gguf_writer_copy_kv: NULL argument");
    size_t plen = strlen(prefix);
    for (int64_t i = 0; i < src->n_kv; i++) {
        const struct gguf_kv *kv = &src->kv[i];
        if (strncmp(kv->key, prefix, plen))
            continue;
        ks_status st = set_bytes(w, kv->key, kv->type, src->base + kv->value_offset, kv->value_bytes);
        if (st)
            return st;
    }
    return KS_OK;
}

/* ---- tensors ----------------------------------------------------------- */

static ks_status check_tensor(const struct gguf_writer *w, const char *name, uint32_t n_dims, const int64_t *ne,
                              enum quant_type type, uint64_t nbytes)
{
    size_t len = name ? strlen(name) : 0;
    if (len == 0 || len > WRITER_NAME_MAX_BYTES)
        return ks_fail(KS_ERR_INVALID_ARG, "tensor name must be 1..%d bytes", WRITER_NAME_MAX_BYTES);
    for (size_t i = 0; i < w->n_tensors; i++)
        if (!strcmp(w->tensors[i].name, name))
            return ks_fail(KS_ERR_INVALID_ARG, "tensor '%s' added twice", name);
    if (n_dims < 1 || n_dims > GGUF_MAX_DIMS || !ne)
        return ks_fail(KS_ERR_INVALID_ARG, "tensor '%s': n_dims %u is not 1..%d", name, n_dims, GGUF_MAX_DIMS);
    const struct quant_traits *tr = quant_type_known(type) ? quant_traits(type) : NULL;
    if (!tr)
        return ks_fail(KS_ERR_UNSUPPORTED, "tensor '%s': type id %d is not supported", name, (int)type);
    uint64_t expect;
    bool overflow = false;
    for (uint32_t d = 0; d < n_dims; d++)
        if (ne[d] <= 0)
            return ks_fail(KS_ERR_INVALID_ARG, "tensor '%s': dimension %u is %lld", name, d, (long long)ne[d]);
    if (ne[0] % tr->block_elems)
        return ks_fail(KS_ERR_INVALID_ARG, "tensor '%s': ne[0] = %lld is not a multiple of the %s block size %d",
                       name, (long long)ne[0], tr->name, tr->block_elems);
    overflow |= __builtin_mul_overflow((uint64_t)(ne[0] / tr->block_elems), (uint64_t)tr->block_bytes, &expect);
    for (uint32_t d = 1; d < n_dims; d++)
        overflow |= __builtin_mul_overflow(expect, (uint64_t)ne[d], &expect);
    if (overflow || expect != nbytes)
        return ks_fail(KS_ERR_INVALID_ARG, "tensor '%s': %llu bytes given, the %s shape needs %llu", name,
                       (unsigned long long)nbytes, tr->name, overflow ? 0ull : (unsigned long long)expect);
    return KS_OK;
}

ks_status gguf_writer_add_tensor(struct gguf_writer *w, const char *name, uint32_t n_dims, const int64_t *ne,
                                 enum quant_type type, const void *data, uint64_t nbytes)
{
    if (!w)
        return ks_fail(KS_ERR_INVALID_ARG, "gguf_writer_add_tensor: NULL writer");
    ks_status st = check_tensor(w, name, n_dims, ne, type, nbytes);
    if (!st)
        st = grow((void **)&w->tensors, &w->cap_tensors, w->n_tensors + 1, sizeof *w->tensors);
    if (st)
        return st;
    struct writer_tensor *t = &w->tensors[w->n_tensors];
    *t = (struct writer_tensor){.n_dims = n_dims, .type = type, .data = data, .nbytes = nbytes};
    for (int d = 0; d < GGUF_MAX_DIMS; d++)
        t->ne[d] = d < (int)n_dims ? ne[d] : 1;
    t->name = strdup(name);
    if (!t->name)
        return ks_fail(KS_ERR_NOMEM, "no memory for tensor name '%s'", name);
    w->n_tensors++;
    return KS_OK;
}

/* ---- output ------------------------------------------------------------ */

static ks_status writer_alignment(const struct gguf_writer *w, uint64_t *out)
{
    *out = GGUF_DEFAULT_ALIGNMENT;
    for (size_t i = 0; i < w->n_kv; i++) {
        const struct writer_kv *kv = &w->kv[i];
        if (strcmp(kv->key, "general.alignment"))
            continue;
        uint64_t a;
        if (!gguf_value_to_u64(kv->value, kv->type, &a) || a == 0 || (a & (a - 1)) || a > (1u << 30))
            return ks_fail(KS_ERR_INVALID_ARG, "general.alignment must be a power of two up to 2^30");
        *out = a;
    }
    return KS_OK;
}

static void put_u32(FILE *fp, uint32_t v) { fwrite(&v, 4, 1, fp); }
static void put_u64(FILE *fp, uint64_t v) { fwrite(&v, 8, 1, fp); }

static void put_zeros(FILE *fp, uint64_t n)
{
    static const uint8_t zeros[4096];
    for (; n > 0 && !ferror(fp); n -= n < sizeof zeros ? n : sizeof zeros)
        fwrite(zeros, 1, n < sizeof zeros ? n : sizeof zeros, fp);
}

static uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) & ~(a - 1); }

static void put_header(const struct gguf_writer *w, FILE *fp, uint64_t alignment)
{
    fwrite(GGUF_MAGIC, 1, 4, fp);
    put_u32(fp, GGUF_WRITE_VERSION);
    put_u64(fp, w->n_tensors);
    put_u64(fp, w->n_kv);
    for (size_t i = 0; i < w->n_kv; i++) {
        const struct writer_kv *kv = &w->kv[i];
        put_u64(fp, strlen(kv->key));
        fwrite(kv->key, 1, strlen(kv->key), fp);
        put_u32(fp, kv->type);
        fwrite(kv->value, 1, kv->value_bytes, fp);
    }
    uint64_t offset = 0;
    for (size_t i = 0; i < w->n_tensors; i++) {
        const struct writer_tensor *t = &w->tensors[i];
        put_u64(fp, strlen(t->name));
        fwrite(t->name, 1, strlen(t->name), fp);
        put_u32(fp, t->n_dims);
        for (uint32_t d = 0; d < t->n_dims; d++)
            put_u64(fp, (uint64_t)t->ne[d]);
        put_u32(fp, t->type);
        put_u64(fp, offset);
        offset = align_up(offset + t->nbytes, alignment);
    }
}

static ks_status write_stream(const struct gguf_writer *w, FILE *fp)
{
    uint64_t alignment;
    ks_status st = writer_alignment(w, &alignment);
    if (st)
        return st;
    put_header(w, fp, alignment);
    long pos = ftell(fp);
    if (pos < 0)
        return ks_fail(KS_ERR_IO, "cannot tell the GGUF header size");
    put_zeros(fp, align_up((uint64_t)pos, alignment) - (uint64_t)pos);
    for (size_t i = 0; i < w->n_tensors && !ferror(fp); i++) {
        const struct writer_tensor *t = &w->tensors[i];
        if (t->data)
            fwrite(t->data, 1, t->nbytes, fp);
        else
            put_zeros(fp, t->nbytes);
        put_zeros(fp, align_up(t->nbytes, alignment) - t->nbytes);
    }
    return ferror(fp) ? ks_fail(KS_ERR_IO, "write failed") : KS_OK;
}

ks_status gguf_writer_write(struct gguf_writer *w, const char *path)
{
    if (!w || !path)
        return ks_fail(KS_ERR_INVALID_ARG, "gguf_writer_write: NULL argument");
    uint64_t alignment;
    ks_status st = writer_alignment(w, &alignment);
    if (st)
        return st;
    char tmp[4096];
    if ((size_t)snprintf(tmp, sizeof tmp, "%s.tmp%ld", path, (long)getpid()) >= sizeof tmp)
        return ks_fail(KS_ERR_INVALID_ARG, "output path is too long: %s", path);
    FILE *fp = fopen(tmp, "wb");
    if (!fp)
        return ks_fail(KS_ERR_IO, "cannot create %s: %m", tmp);
    setvbuf(fp, NULL, _IOFBF, 1 << 20);
    st = write_stream(w, fp);
    if (fclose(fp) && !st)
        st = ks_fail(KS_ERR_IO, "cannot write %s: %m", tmp);
    if (!st && rename(tmp, path))
        st = ks_fail(KS_ERR_IO, "cannot rename %s to %s: %m", tmp, path);
    if (st) {
        unlink(tmp);
        ks_errmsg_prefix("writing %s", path);
    }
    return st;
}

ks_status gguf_writer_write_memory(struct gguf_writer *w, void **out, size_t *size)
{
    if (!w || !out || !size)
        return ks_fail(KS_ERR_INVALID_ARG, "gguf_writer_write_memory: NULL argument");
    char *buf = NULL;
    size_t len = 0;
    FILE *fp = open_memstream(&buf, &len);
    if (!fp)
        return ks_fail(KS_ERR_NOMEM, "cannot open a memory stream: %m");
    ks_status st = write_stream(w, fp);
    if (fclose(fp) && !st)
        st = ks_fail(KS_ERR_NOMEM, "memory stream failed");
    if (st) {
        free(buf);
        return st;
    }
    *out = buf;
    *size = len;
    return KS_OK;
}
