/* gguf reader: parse and validate a whole GGUF v2/v3 file up front, so that
 * every accessor afterwards is a plain lookup into checked data. */
#include "gguf/gguf_internal.h"

#include <errno.h>
#include <stdio.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

enum {
    KEY_MAX_BYTES = 65535,     /* the GGUF spec's limit on key length */
    TENSOR_NAME_MAX_BYTES = 63, /* ggml's GGML_MAX_NAME (64) including the NUL */
    ARRAY_MAX_DEPTH = 8,
    /* Smallest encodings, used to bound counts by the bytes that remain. */
    KV_MIN_BYTES = 8 + 1 + 4 + 1,                 /* key len, 1-byte key, type, u8 */
    TENSOR_INFO_MIN_BYTES = 8 + 1 + 4 + 8 + 4 + 8, /* name len, name, n_dims, ne[0], type, offset */
    STRING_MIN_BYTES = 8,
    ARRAY_MIN_BYTES = 4 + 8,
};

/* ---- byte cursor ------------------------------------------------------- */

struct cursor {
    const uint8_t *base;
    size_t size;
    size_t pos; /* invariant: pos <= size */
};

static size_t cur_left(const struct cursor *c) { return c->size - c->pos; }

static ks_status cur_need(const struct cursor *c, uint64_t n, const char *what)
{
    if (n > cur_left(c))
        return ks_fail(KS_ERR_FORMAT, "%s at offset %zu needs %llu bytes but the file has only %zu left",
                       what, c->pos, (unsigned long long)n, cur_left(c));
    return KS_OK;
}

static ks_status cur_u32(struct cursor *c, uint32_t *v, const char *what)
{
    ks_status st = cur_need(c, 4, what);
    if (st)
        return st;
    memcpy(v, c->base + c->pos, 4);
    c->pos += 4;
    return KS_OK;
}

static ks_status cur_u64(struct cursor *c, uint64_t *v, const char *what)
{
    ks_status st = cur_need(c, 8, what);
    if (st)
        return st;
    memcpy(v, c->base + c->pos, 8);
    c->pos += 8;
    return KS_OK;
}

static ks_status cur_skip(struct cursor *c, uint64_t n, const char *what)
{
    ks_status st = cur_need(c, n, what);
    if (st)
        return st;
    c->pos += (size_t)n;
    return KS_OK;
}

/* A length-prefixed string; the bytes stay in the mapping. */
static ks_status cur_str(struct cursor *c, struct gguf_str *s, const char *what)
{
    size_t at = c->pos;
    uint64_t len;
    ks_status st = cur_u64(c, &len, what);
    if (st)
        return st;
    if (len > cur_left(c))
        return ks_fail(KS_ERR_FORMAT, "%s at offset %zu has length %llu but the file has only %zu bytes left",
                       what, at, (unsigned long long)len, cur_left(c));
    s->len = len;
    s->data = (const char *)c->base + c->pos;
    c->pos += (size_t)len;
    return KS_OK;
}

/* Check that count items of at least min_bytes each can fit before reading them,
 * so a corrupt count fails fast instead of allocating or looping for ages. */
static ks_status cur_fits(const struct cursor *c, uint64_t count, uint64_t min_bytes, const char *what)
{
    uint64_t total;
    if (__builtin_mul_overflow(count, min_bytes, &total) || total > cur_left(c))
        return ks_fail(KS_ERR_FORMAT, "%s: count %llu at offset %zu cannot fit in the %zu bytes left in the file",
                       what, (unsigned long long)count, c->pos, cur_left(c));
    return KS_OK;
}

/* ---- names ------------------------------------------------------------- */

/* Copy s for an error message, escaping bytes a terminal should not see. */
static const char *printable(struct gguf_str s, char *buf, size_t cap)
{
    size_t o = 0;
    for (uint64_t i = 0; i < s.len && o + 5 < cap; i++) {
        unsigned char ch = (unsigned char)s.data[i];
        if (ch >= 0x20 && ch < 0x7f && ch != '\\')
            buf[o++] = (char)ch;
        else
            o += (size_t)snprintf(buf + o, cap - o, "\\x%02x", ch);
    }
    buf[o < cap ? o : cap - 1] = '\0';
    return buf;
}

static ks_status copy_name(struct gguf_str s, size_t max_len, const char *what, size_t at, char **out)
{
    char shown[96];
    if (s.len == 0)
        return ks_fail(KS_ERR_FORMAT, "%s at offset %zu is empty", what, at);
    if (s.len > max_len)
        return ks_fail(KS_ERR_FORMAT, "%s at offset %zu ('%s...') is %llu bytes long; the limit is %zu",
                       what, at, printable(s, shown, 40), (unsigned long long)s.len, max_len);
    if (memchr(s.data, '\0', (size_t)s.len))
        return ks_fail(KS_ERR_FORMAT, "%s at offset %zu ('%s') contains a NUL byte", what, at,
                       printable(s, shown, sizeof shown));
    char *p = malloc((size_t)s.len + 1);
    if (!p)
        return ks_fail(KS_ERR_NOMEM, "no memory for a %s", what);
    memcpy(p, s.data, (size_t)s.len);
    p[s.len] = '\0';
    *out = p;
    return KS_OK;
}

/* ---- name index -------------------------------------------------------- */

uint64_t gguf_hash(const char *s)
{
    return XXH3_64bits(s, strlen(s));
}

static ks_status index_init(struct gguf_index *ix, uint64_t n)
{
    uint64_t cap = 16;
    while (cap < 2 * n)
        cap *= 2;
    ix->slots = calloc(cap, sizeof *ix->slots);
    if (!ix->slots)
        return ks_fail(KS_ERR_NOMEM, "no memory for a name index of %llu entries", (unsigned long long)n);
    ix->mask = cap - 1;
    return KS_OK;
}

int64_t gguf_index_find(const struct gguf_index *ix, const char *name,
                        const char *(*get_name)(const void *ctx, int64_t i), const void *ctx)
{
    if (!ix->slots)
        return -1;
    for (uint64_t h = gguf_hash(name) & ix->mask;; h = (h + 1) & ix->mask) {
        uint64_t slot = ix->slots[h];
        if (!slot)
            return -1;
        if (!strcmp(get_name(ctx, (int64_t)slot - 1), name))
            return (int64_t)slot - 1;
    }
}

/* Insert i under name; returns the index already there, or -1 if name is new. */
static int64_t index_insert(struct gguf_index *ix, const char *name, int64_t i,
                            const char *(*get_name)(const void *ctx, int64_t i), const void *ctx)
{
    for (uint64_t h = gguf_hash(name) & ix->mask;; h = (h + 1) & ix->mask) {
        uint64_t slot = ix->slots[h];
        if (!slot) {
            ix->slots[h] = (uint64_t)i + 1;
            return -1;
        }
        if (!strcmp(get_name(ctx, (int64_t)slot - 1), name))
            return (int64_t)slot - 1;
    }
}

static const char *kv_name(const void *ctx, int64_t i) { return ((const struct gguf_file *)ctx)->kv[i].key; }
static const char *tensor_name(const void *ctx, int64_t i)
{
    return ((const struct gguf_file *)ctx)->tensors[i].name;
}

/* ---- metadata values --------------------------------------------------- */

size_t gguf_value_size(enum gguf_value_type t)
{
    switch (t) {
    case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_BOOL: return 1;
    case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16: return 2;
    case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_FLOAT32: return 4;
    case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64: case GGUF_TYPE_FLOAT64: return 8;
    default: return 0;
    }
}

static ks_status read_type(struct cursor *c, enum gguf_value_type *t, const char *what)
{
    size_t at = c->pos;
    uint32_t raw;
    ks_status st = cur_u32(c, &raw, what);
    if (st)
        return st;
    if (raw >= GGUF_TYPE_COUNT)
        return ks_fail(KS_ERR_FORMAT, "%s at offset %zu is %u, not a GGUF value type (0..%d)", what, at, raw,
                       GGUF_TYPE_COUNT - 1);
    *t = (enum gguf_value_type)raw;
    return KS_OK;
}

static ks_status check_bools(const struct cursor *c, size_t at, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++)
        if (c->base[at + i] > 1)
            return ks_fail(KS_ERR_FORMAT, "bool at offset %llu is %u, not 0 or 1",
                           (unsigned long long)(at + i), c->base[at + i]);
    return KS_OK;
}

static ks_status skip_fixed(struct cursor *c, enum gguf_value_type t, uint64_t count)
{
    uint64_t bytes;
    if (__builtin_mul_overflow(count, (uint64_t)gguf_value_size(t), &bytes))
        return ks_fail(KS_ERR_FORMAT, "array of %llu %s at offset %zu overflows 64 bits",
                       (unsigned long long)count, gguf_type_name(t), c->pos);
    size_t at = c->pos;
    ks_status st = cur_skip(c, bytes, "array data");
    if (!st && t == GGUF_TYPE_BOOL)
        st = check_bools(c, at, count);
    return st;
}

static ks_status skip_strings(struct cursor *c, uint64_t count, uint64_t *offsets)
{
    ks_status st = cur_fits(c, count, STRING_MIN_BYTES, "string array");
    for (uint64_t i = 0; !st && i < count; i++) {
        struct gguf_str s;
        if (offsets)
            offsets[i] = c->pos;
        st = cur_str(c, &s, "string array element");
        if (st)
            ks_errmsg_prefix("element %llu", (unsigned long long)i);
    }
    return st;
}

static ks_status skip_array(struct cursor *c, int depth);

static ks_status skip_arrays(struct cursor *c, uint64_t count, int depth)
{
    ks_status st = cur_fits(c, count, ARRAY_MIN_BYTES, "array of arrays");
    for (uint64_t i = 0; !st && i < count; i++) {
        st = skip_array(c, depth + 1);
        if (st)
            ks_errmsg_prefix("element %llu", (unsigned long long)i);
    }
    return st;
}

/* A nested array: validated, not indexed. */
static ks_status skip_array(struct cursor *c, int depth)
{
    if (depth > ARRAY_MAX_DEPTH)
        return ks_fail(KS_ERR_FORMAT, "arrays nested deeper than %d levels at offset %zu", ARRAY_MAX_DEPTH, c->pos);
    enum gguf_value_type elem = GGUF_TYPE_UINT8;
    uint64_t count = 0;
    ks_status st = read_type(c, &elem, "array element type");
    if (!st)
        st = cur_u64(c, &count, "array length");
    if (st)
        return st;
    if (elem == GGUF_TYPE_STRING)
        return skip_strings(c, count, NULL);
    if (elem == GGUF_TYPE_ARRAY)
        return skip_arrays(c, count, depth);
    return skip_fixed(c, elem, count);
}

static ks_status read_top_array(struct cursor *c, struct gguf_kv *kv)
{
    ks_status st = read_type(c, &kv->elem_type, "array element type");
    if (!st)
        st = cur_u64(c, &kv->count, "array length");
    if (st)
        return st;
    if (kv->elem_type == GGUF_TYPE_ARRAY)
        return skip_arrays(c, kv->count, 1);
    if (kv->elem_type != GGUF_TYPE_STRING)
        return skip_fixed(c, kv->elem_type, kv->count);
    st = cur_fits(c, kv->count, STRING_MIN_BYTES, "string array");
    if (st)
        return st;
    kv->str_offsets = malloc(kv->count ? kv->count * sizeof *kv->str_offsets : 1);
    if (!kv->str_offsets)
        return ks_fail(KS_ERR_NOMEM, "no memory to index %llu strings", (unsigned long long)kv->count);
    return skip_strings(c, kv->count, kv->str_offsets);
}

static ks_status read_value(struct cursor *c, struct gguf_kv *kv)
{
    kv->value_offset = c->pos;
    ks_status st;
    if (kv->type == GGUF_TYPE_STRING) {
        struct gguf_str s;
        st = cur_str(c, &s, "string value");
    } else if (kv->type == GGUF_TYPE_ARRAY) {
        st = read_top_array(c, kv);
    } else {
        st = skip_fixed(c, kv->type, 1);
    }
    kv->value_bytes = c->pos - kv->value_offset;
    return st;
}

static ks_status read_kv(struct gguf_file *f, struct cursor *c, int64_t i)
{
    struct gguf_kv *kv = &f->kv[i];
    kv->key_offset = c->pos;
    struct gguf_str key;
    ks_status st = cur_str(c, &key, "key");
    if (!st)
        st = copy_name(key, KEY_MAX_BYTES, "key", kv->key_offset, &kv->key);
    if (st) {
        ks_errmsg_prefix("metadata entry #%lld", (long long)i);
        return st;
    }
    st = read_type(c, &kv->type, "value type");
    if (!st)
        st = read_value(c, kv);
    if (st) {
        ks_errmsg_prefix("metadata key '%s' (#%lld at offset %llu)", kv->key, (long long)i,
                         (unsigned long long)kv->key_offset);
        return st;
    }
    int64_t prev = index_insert(&f->key_index, kv->key, i, kv_name, f);
    if (prev >= 0)
        return ks_fail(KS_ERR_FORMAT, "duplicate metadata key '%s' at offset %llu (first at offset %llu)", kv->key,
                       (unsigned long long)kv->key_offset, (unsigned long long)f->kv[prev].key_offset);
    return KS_OK;
}

static ks_status read_alignment(struct gguf_file *f)
{
    f->alignment = GGUF_DEFAULT_ALIGNMENT;
    int64_t i = gguf_find_key(f, "general.alignment");
    if (i < 0)
        return KS_OK;
    uint64_t a;
    if (gguf_get_u64(f, "general.alignment", &a))
        return ks_fail(KS_ERR_FORMAT, "general.alignment (offset %llu) must be a non-negative integer, is %s",
                       (unsigned long long)f->kv[i].key_offset, gguf_type_name(f->kv[i].type));
    if (a == 0 || (a & (a - 1)))
        return ks_fail(KS_ERR_FORMAT, "general.alignment (offset %llu) is %llu, not a nonzero power of two",
                       (unsigned long long)f->kv[i].key_offset, (unsigned long long)a);
    f->alignment = a;
    return KS_OK;
}

/* ---- tensor infos ------------------------------------------------------ */

/* ggml ids kvserve does not implement, to name them in errors. */
static const char *ggml_type_name(uint32_t id)
{
    static const char *const names[] = {
        [16] = "iq2_xxs", [17] = "iq2_xs", [18] = "iq3_xxs", [19] = "iq1_s", [20] = "iq4_nl",
        [21] = "iq3_s", [22] = "iq2_s", [23] = "iq4_xs", [24] = "i8", [25] = "i16", [26] = "i32",
        [27] = "i64", [28] = "f64", [29] = "iq1_m", [34] = "tq1_0", [35] = "tq2_0", [39] = "mxfp4",
    };
    if (quant_type_known(id))
        return quant_type_name((enum quant_type)id);
    if (id < sizeof names / sizeof names[0] && names[id])
        return names[id];
    return NULL;
}

static ks_status read_tensor_type(struct cursor *c, struct gguf_tensor_info *t)
{
    size_t at = c->pos;
    uint32_t id;
    ks_status st = cur_u32(c, &id, "tensor type");
    if (st)
        return st;
    if (!quant_type_known(id) || !quant_traits((enum quant_type)id)) {
        const char *name = ggml_type_name(id);
        if (name)
            return ks_fail(KS_ERR_UNSUPPORTED, "tensor type %s (id %u) at offset %zu is not supported by kvserve",
                           name, id, at);
        return ks_fail(KS_ERR_UNSUPPORTED, "tensor type id %u at offset %zu is not a known ggml type", id, at);
    }
    t->type = (enum quant_type)id;
    return KS_OK;
}

static ks_status read_tensor_shape(struct cursor *c, struct gguf_tensor_info *t)
{
    size_t at = c->pos;
    ks_status st = cur_u32(c, &t->n_dims, "tensor n_dims");
    if (st)
        return st;
    if (t->n_dims < 1 || t->n_dims > GGUF_MAX_DIMS)
        return ks_fail(KS_ERR_FORMAT, "tensor n_dims at offset %zu is %u, must be 1..%d", at, t->n_dims,
                       GGUF_MAX_DIMS);
    for (int d = 0; d < GGUF_MAX_DIMS; d++)
        t->ne[d] = 1;
    for (uint32_t d = 0; d < t->n_dims; d++) {
        at = c->pos;
        uint64_t ne;
        st = cur_u64(c, &ne, "tensor dimension");
        if (st)
            return st;
        if (ne == 0 || ne > INT64_MAX)
            return ks_fail(KS_ERR_FORMAT, "tensor dimension %u at offset %zu is %llu, must be 1..2^63-1", d, at,
                           (unsigned long long)ne);
        t->ne[d] = (int64_t)ne;
    }
    return KS_OK;
}

static ks_status read_tensor_info(struct gguf_file *f, struct cursor *c, int64_t i)
{
    struct gguf_tensor_info *t = &f->tensors[i];
    size_t at = c->pos;
    struct gguf_str name;
    char *copy = NULL;
    ks_status st = cur_str(c, &name, "tensor name");
    if (!st)
        st = copy_name(name, TENSOR_NAME_MAX_BYTES, "tensor name", at, &copy);
    if (st) {
        ks_errmsg_prefix("tensor #%lld", (long long)i);
        return st;
    }
    t->name = copy;
    st = read_tensor_shape(c, t);
    if (!st)
        st = read_tensor_type(c, t);
    if (!st)
        st = cur_u64(c, &t->offset, "tensor data offset");
    if (st) {
        ks_errmsg_prefix("tensor '%s' (#%lld at offset %zu)", t->name, (long long)i, at);
        return st;
    }
    int64_t prev = index_insert(&f->tensor_index, t->name, i, tensor_name, f);
    if (prev >= 0)
        return ks_fail(KS_ERR_FORMAT, "duplicate tensor name '%s' at offset %zu (tensors #%lld and #%lld)", t->name,
                       at, (long long)prev, (long long)i);
    return KS_OK;
}

/* Size in bytes, with every product checked; the shape is already known valid. */
static ks_status tensor_nbytes(const struct gguf_tensor_info *t, uint64_t *out)
{
    const struct quant_traits *tr = quant_traits(t->type);
    if ((uint64_t)t->ne[0] % (uint64_t)tr->block_elems)
        return ks_fail(KS_ERR_FORMAT, "tensor '%s': ne[0] = %lld is not a multiple of the %s block size %d", t->name,
                       (long long)t->ne[0], tr->name, tr->block_elems);
    uint64_t bytes, elems = (uint64_t)t->ne[0];
    bool overflow = __builtin_mul_overflow((uint64_t)t->ne[0] / (uint64_t)tr->block_elems,
                                           (uint64_t)tr->block_bytes, &bytes);
    for (int d = 1; d < GGUF_MAX_DIMS; d++) {
        overflow |= __builtin_mul_overflow(bytes, (uint64_t)t->ne[d], &bytes);
        overflow |= __builtin_mul_overflow(elems, (uint64_t)t->ne[d], &elems);
    }
    if (overflow || elems > INT64_MAX)
        return ks_fail(KS_ERR_FORMAT, "tensor '%s': shape [%lld, %lld, %lld, %lld] overflows 64-bit sizes", t->name,
                       (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2], (long long)t->ne[3]);
    *out = bytes;
    return KS_OK;
}

static ks_status place_tensor(struct gguf_file *f, struct gguf_tensor_info *t)
{
    ks_status st = tensor_nbytes(t, &t->nbytes);
    if (st)
        return st;
    if (t->offset % f->alignment)
        return ks_fail(KS_ERR_FORMAT, "tensor '%s': data offset %llu is not a multiple of the alignment %llu",
                       t->name, (unsigned long long)t->offset, (unsigned long long)f->alignment);
    uint64_t start, end;
    if (__builtin_add_overflow(f->data_offset, t->offset, &start) || __builtin_add_overflow(start, t->nbytes, &end) ||
        end > f->size)
        return ks_fail(KS_ERR_FORMAT,
                       "tensor '%s': its %llu bytes at data offset %llu (file offset %llu) run past the end of the "
                       "%zu-byte file (truncated download?)",
                       t->name, (unsigned long long)t->nbytes, (unsigned long long)t->offset,
                       (unsigned long long)f->data_offset + t->offset, f->size);
    t->data = f->base + start;
    return KS_OK;
}

struct span {
    uint64_t offset, nbytes;
    int64_t tensor;
};

static int by_offset(const void *a, const void *b)
{
    const struct span *x = a, *y = b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

static ks_status check_overlaps(const struct gguf_file *f)
{
    if (f->n_tensors < 2)
        return KS_OK;
    struct span *spans = malloc((size_t)f->n_tensors * sizeof *spans);
    if (!spans)
        return ks_fail(KS_ERR_NOMEM, "no memory to sort %lld tensors", (long long)f->n_tensors);
    for (int64_t i = 0; i < f->n_tensors; i++)
        spans[i] = (struct span){f->tensors[i].offset, f->tensors[i].nbytes, i};
    qsort(spans, (size_t)f->n_tensors, sizeof *spans, by_offset);
    ks_status st = KS_OK;
    for (int64_t k = 1; k < f->n_tensors && !st; k++) {
        const struct span *a = &spans[k - 1], *b = &spans[k];
        if (a->offset + a->nbytes > b->offset) /* both end inside the file: no overflow */
            st = ks_fail(KS_ERR_FORMAT, "tensors '%s' (data offset %llu, %llu bytes) and '%s' (data offset %llu) overlap",
                         f->tensors[a->tensor].name, (unsigned long long)a->offset, (unsigned long long)a->nbytes,
                         f->tensors[b->tensor].name, (unsigned long long)b->offset);
    }
    free(spans);
    return st;
}

/* ---- whole file -------------------------------------------------------- */

static ks_status read_header(struct gguf_file *f, struct cursor *c, uint64_t *n_kv, uint64_t *n_tensors)
{
    if (f->size < 4 || memcmp(f->base, GGUF_MAGIC, 4)) {
        struct gguf_str got = {f->size < 4 ? f->size : 4, (const char *)f->base};
        char shown[32];
        return ks_fail(KS_ERR_FORMAT, "not a GGUF file: it starts with '%s', expected the magic 'GGUF'",
                       printable(got, shown, sizeof shown));
    }
    c->pos = 4;
    ks_status st = cur_u32(c, &f->version, "version");
    if (st)
        return st;
    uint32_t v = f->version;
    if (v == 1)
        return ks_fail(KS_ERR_UNSUPPORTED, "GGUF version 1 is not supported (only v2 and v3); "
                                           "re-convert the model with a current llama.cpp");
    if (v == 0x02000000u || v == 0x03000000u)
        return ks_fail(KS_ERR_UNSUPPORTED, "this is a big-endian GGUF (version %u byte-swapped); only "
                                           "little-endian files are supported", __builtin_bswap32(v));
    if (v != 2 && v != 3)
        return ks_fail(KS_ERR_UNSUPPORTED, "GGUF version %u is not supported (only v2 and v3)", v);
    st = cur_u64(c, n_tensors, "tensor count");
    if (!st)
        st = cur_u64(c, n_kv, "metadata key count");
    if (!st)
        st = cur_fits(c, *n_kv, KV_MIN_BYTES, "metadata key count");
    if (!st)
        st = cur_fits(c, *n_tensors, TENSOR_INFO_MIN_BYTES, "tensor count");
    if (!st && *n_kv * KV_MIN_BYTES + *n_tensors * TENSOR_INFO_MIN_BYTES > cur_left(c))
        st = ks_fail(KS_ERR_FORMAT, "header claims %llu metadata keys and %llu tensors, more than the %zu bytes "
                                    "after it can hold",
                     (unsigned long long)*n_kv, (unsigned long long)*n_tensors, cur_left(c));
    return st;
}

static ks_status read_kvs(struct gguf_file *f, struct cursor *c, uint64_t n)
{
    f->kv = calloc(n ? n : 1, sizeof *f->kv);
    if (!f->kv)
        return ks_fail(KS_ERR_NOMEM, "no memory for %llu metadata keys", (unsigned long long)n);
    ks_status st = index_init(&f->key_index, n);
    for (uint64_t i = 0; i < n && !st; i++) {
        f->n_kv = (int64_t)i + 1; /* so close() frees what was read */
        st = read_kv(f, c, (int64_t)i);
    }
    return st ? st : read_alignment(f);
}

static ks_status read_tensors(struct gguf_file *f, struct cursor *c, uint64_t n)
{
    f->tensors = calloc(n ? n : 1, sizeof *f->tensors);
    if (!f->tensors)
        return ks_fail(KS_ERR_NOMEM, "no memory for %llu tensor infos", (unsigned long long)n);
    ks_status st = index_init(&f->tensor_index, n);
    for (uint64_t i = 0; i < n && !st; i++) {
        f->n_tensors = (int64_t)i + 1;
        st = read_tensor_info(f, c, (int64_t)i);
    }
    if (st)
        return st;
    uint64_t a = f->alignment, end = c->pos;
    if (__builtin_add_overflow(end, a - 1, &f->data_offset))
        return ks_fail(KS_ERR_FORMAT, "alignment %llu overflows the data offset", (unsigned long long)a);
    f->data_offset &= ~(a - 1);
    for (int64_t i = 0; i < f->n_tensors && !st; i++)
        st = place_tensor(f, &f->tensors[i]);
    return st ? st : check_overlaps(f);
}

static ks_status parse(struct gguf_file *f)
{
    struct cursor c = {f->base, f->size, 0};
    uint64_t n_kv = 0, n_tensors = 0;
    ks_status st = read_header(f, &c, &n_kv, &n_tensors);
    if (!st)
        st = read_kvs(f, &c, n_kv);
    if (!st)
        st = read_tensors(f, &c, n_tensors);
    return st;
}

static ks_status open_parsed(struct gguf_file *f, struct gguf_file **out)
{
    ks_status st = parse(f);
    if (st) {
        gguf_close(f);
        return st;
    }
    *out = f;
    return KS_OK;
}

ks_status gguf_open_memory(const void *data, size_t size, struct gguf_file **out)
{
    if (!out || (!data && size))
        return ks_fail(KS_ERR_INVALID_ARG, "gguf_open_memory: NULL argument");
    struct gguf_file *f = calloc(1, sizeof *f);
    if (!f)
        return ks_fail(KS_ERR_NOMEM, "no memory for a GGUF handle");
    static const uint8_t empty[1];
    f->base = data ? data : empty;
    f->size = size;
    return open_parsed(f, out);
}

/* Read the whole file into anonymous memory advised for huge pages, its
 * first byte shift bytes into the mapping; false (and nothing allocated)
 * when that memory cannot be had. */
static bool copy_file(int fd, size_t size, size_t shift, struct gguf_file *f)
{
    /* A file near the size of RAM stays mapped: a private copy could not be
     * paged out and would push the OOM killer, where a mapping only pages. */
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages > 0 && page > 0 && size > (size_t)pages * (size_t)page / 4 * 3)
        return false;
    void *p = mmap(NULL, size + shift, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
        return false;
    (void)madvise(p, size + shift, MADV_HUGEPAGE); /* advice only: fine if refused */
    uint8_t *base = (uint8_t *)p + shift;
    for (size_t done = 0; done < size;) {
        ssize_t r = pread(fd, base + done, size - done, (off_t)done);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            munmap(p, size + shift);
            return false;
        }
        done += (size_t)r;
    }
    f->base = base;
    f->size = size;
    f->map_shift = shift;
    f->mapped = true;
    f->private_copy = true;
    return true;
}

/* The shift that puts the most tensor bytes on 64-byte lines: GGUF aligns
 * tensors to 32 by default, and the data section of a file often starts at
 * 32 mod 64. The weight kernels read whole cache lines (a zmm load), and a
 * stream half a line off splits every load across two: llama-1b Q4_K_M's
 * decode was 5% slower (docs/kernels.md). */
static size_t best_copy_shift(const struct gguf_file *f)
{
    uint64_t on_line[GGUF_COPY_ALIGN] = {0};
    for (int64_t i = 0; i < f->n_tensors; i++) {
        const struct gguf_tensor_info *t = &f->tensors[i];
        uint64_t misalign = (f->data_offset + t->offset) % GGUF_COPY_ALIGN;
        on_line[(GGUF_COPY_ALIGN - misalign) % GGUF_COPY_ALIGN] += t->nbytes;
    }
    size_t best = 0;
    for (size_t s = 1; s < GGUF_COPY_ALIGN; s++)
        best = on_line[s] > on_line[best] ? s : best;
    return best;
}

static ks_status open_fd(const char *path, int *fd, size_t *size)
{
    if ((*fd = open(path, O_RDONLY | O_CLOEXEC)) < 0)
        return ks_fail(KS_ERR_IO, "cannot open: %s", strerror(errno));
    struct stat sb;
    ks_status st = KS_OK;
    if (fstat(*fd, &sb))
        st = ks_fail(KS_ERR_IO, "cannot stat: %s", strerror(errno));
    else if (!S_ISREG(sb.st_mode))
        st = ks_fail(KS_ERR_IO, "not a regular file");
    else if (sb.st_size == 0)
        st = ks_fail(KS_ERR_FORMAT, "the file is empty");
    if (st)
        close(*fd);
    else
        *size = (size_t)sb.st_size;
    return st;
}

static ks_status map_file(int fd, size_t size, struct gguf_file *f)
{
    void *p = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED)
        return ks_fail(KS_ERR_IO, "cannot mmap %zu bytes: %s", size, strerror(errno));
    f->base = p;
    f->size = size;
    f->mapped = true;
    return KS_OK;
}

static ks_status new_handle(struct gguf_file **f)
{
    *f = calloc(1, sizeof **f);
    return *f ? KS_OK : ks_fail(KS_ERR_NOMEM, "no memory for a GGUF handle");
}

/* The file mapped and parsed; for a private copy, then read into memory at
 * the shift that lines its tensors up (best_copy_shift) and parsed again
 * there (the mapping stays when the copy is refused). */
static ks_status open_fd_parsed(int fd, size_t size, bool private_copy, struct gguf_file **out)
{
    struct gguf_file *f, *copy;
    ks_status st = new_handle(&f);
    if (st)
        return st;
    if ((st = map_file(fd, size, f))) {
        /* a file system that cannot map: the private copy as it is in the file */
        if (!private_copy || !copy_file(fd, size, 0, f)) {
            free(f);
            return st;
        }
        return open_parsed(f, out);
    }
    if ((st = open_parsed(f, &f))) /* open_parsed closes f on failure */
        return st;
    *out = f;
    if (!private_copy || new_handle(&copy))
        return KS_OK; /* no memory for a second handle: the mapping serves */
    if (!copy_file(fd, size, best_copy_shift(f), copy)) {
        free(copy);
        return KS_OK;
    }
    gguf_close(f);
    *out = NULL;
    return open_parsed(copy, out);
}

static ks_status open_path(const char *path, bool private_copy, struct gguf_file **out)
{
    if (!path || !out)
        return ks_fail(KS_ERR_INVALID_ARG, "gguf_open: NULL argument");
    int fd;
    size_t size = 0;
    ks_status st = open_fd(path, &fd, &size);
    if (!st) {
        st = open_fd_parsed(fd, size, private_copy, out);
        close(fd);
    }
    if (st)
        ks_errmsg_prefix("%s", path);
    return st;
}

ks_status gguf_open(const char *path, struct gguf_file **out) { return open_path(path, false, out); }

ks_status gguf_open_private(const char *path, struct gguf_file **out) { return open_path(path, true, out); }

void *gguf_private_bytes(struct gguf_file *f, const void *p, size_t n)
{
    if (!f || !f->private_copy || !p)
        return NULL;
    uintptr_t lo = (uintptr_t)f->base, at = (uintptr_t)p;
    if (at < lo || at - lo > f->size || n > f->size - (at - lo))
        return NULL;
    return (uint8_t *)f->base + (at - lo); /* the copy was allocated writable; base is const for readers */
}

void gguf_close(struct gguf_file *f)
{
    if (!f)
        return;
    for (int64_t i = 0; i < f->n_kv; i++) {
        free(f->kv[i].key);
        free(f->kv[i].str_offsets);
    }
    for (int64_t i = 0; i < f->n_tensors; i++)
        free((char *)f->tensors[i].name);
    free(f->kv);
    free(f->tensors);
    free(f->key_index.slots);
    free(f->tensor_index.slots);
    if (f->mapped)
        munmap((void *)(f->base - f->map_shift), f->size + f->map_shift);
    free(f);
}
