/* gguf accessors: typed getters over the validated file and value printing. */
#include "gguf/gguf_internal.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

uint32_t gguf_version(const struct gguf_file *f) { return f->version; }
uint64_t gguf_alignment(const struct gguf_file *f) { return f->alignment; }
uint64_t gguf_data_offset(const struct gguf_file *f) { return f->data_offset; }
size_t gguf_file_size(const struct gguf_file *f) { return f->size; }

const void *gguf_header_bytes(const struct gguf_file *f, size_t *len_out)
{
    *len_out = (size_t)f->data_offset;
    return f->base;
}
int64_t gguf_n_kv(const struct gguf_file *f) { return f->n_kv; }
int64_t gguf_n_tensors(const struct gguf_file *f) { return f->n_tensors; }

static const char *kv_name(const void *ctx, int64_t i) { return ((const struct gguf_file *)ctx)->kv[i].key; }
static const char *tensor_name(const void *ctx, int64_t i)
{
    return ((const struct gguf_file *)ctx)->tensors[i].name;
}

int64_t gguf_find_key(const struct gguf_file *f, const char *key)
{
    if (!f || !key)
        return -1;
    return gguf_index_find(&f->key_index, key, kv_name, f);
}

const char *gguf_key_at(const struct gguf_file *f, int64_t i)
{
    return f && i >= 0 && i < f->n_kv ? f->kv[i].key : NULL;
}

enum gguf_value_type gguf_type_at(const struct gguf_file *f, int64_t i)
{
    return f && i >= 0 && i < f->n_kv ? f->kv[i].type : GGUF_TYPE_COUNT;
}

const char *gguf_type_name(enum gguf_value_type t)
{
    static const char *const names[GGUF_TYPE_COUNT] = {
        [GGUF_TYPE_UINT8] = "u8", [GGUF_TYPE_INT8] = "i8", [GGUF_TYPE_UINT16] = "u16",
        [GGUF_TYPE_INT16] = "i16", [GGUF_TYPE_UINT32] = "u32", [GGUF_TYPE_INT32] = "i32",
        [GGUF_TYPE_FLOAT32] = "f32", [GGUF_TYPE_BOOL] = "bool", [GGUF_TYPE_STRING] = "str",
        [GGUF_TYPE_ARRAY] = "arr", [GGUF_TYPE_UINT64] = "u64", [GGUF_TYPE_INT64] = "i64",
        [GGUF_TYPE_FLOAT64] = "f64",
    };
    return (unsigned)t < GGUF_TYPE_COUNT ? names[t] : "unknown";
}

const struct gguf_tensor_info *gguf_tensor_at(const struct gguf_file *f, int64_t i)
{
    return f && i >= 0 && i < f->n_tensors ? &f->tensors[i] : NULL;
}

const struct gguf_tensor_info *gguf_find_tensor(const struct gguf_file *f, const char *name)
{
    if (!f || !name)
        return NULL;
    int64_t i = gguf_index_find(&f->tensor_index, name, tensor_name, f);
    return i < 0 ? NULL : &f->tensors[i];
}

/* ---- typed getters ----------------------------------------------------- */

/* An integer value as sign + magnitude, so every target type can range-check it. */
struct int_value {
    bool negative;
    uint64_t magnitude;
};

static struct int_value int_at(const uint8_t *p, enum gguf_value_type t)
{
    int64_t s = 0;
    uint64_t u = 0;
    switch (t) {
    case GGUF_TYPE_UINT8: u = p[0]; break;
    case GGUF_TYPE_UINT16: { uint16_t v; memcpy(&v, p, 2); u = v; break; }
    case GGUF_TYPE_UINT32: { uint32_t v; memcpy(&v, p, 4); u = v; break; }
    case GGUF_TYPE_UINT64: memcpy(&u, p, 8); break;
    case GGUF_TYPE_INT8: s = (int8_t)p[0]; break;
    case GGUF_TYPE_INT16: { int16_t v; memcpy(&v, p, 2); s = v; break; }
    case GGUF_TYPE_INT32: { int32_t v; memcpy(&v, p, 4); s = v; break; }
    case GGUF_TYPE_INT64: memcpy(&s, p, 8); break;
    default: break;
    }
    if (s < 0)
        return (struct int_value){true, (uint64_t)0 - (uint64_t)s};
    return (struct int_value){false, s > 0 ? (uint64_t)s : u};
}

static bool is_int_type(enum gguf_value_type t)
{
    return t <= GGUF_TYPE_INT32 || t == GGUF_TYPE_UINT64 || t == GGUF_TYPE_INT64;
}

bool gguf_value_to_u64(const uint8_t *p, enum gguf_value_type t, uint64_t *out)
{
    if (!is_int_type(t))
        return false;
    struct int_value v = int_at(p, t);
    *out = v.magnitude;
    return !v.negative;
}

static ks_status lookup(const struct gguf_file *f, const char *key, const struct gguf_kv **out)
{
    if (!f || !key)
        return ks_fail(KS_ERR_INVALID_ARG, "gguf getter: NULL argument");
    int64_t i = gguf_find_key(f, key);
    if (i < 0)
        return ks_fail(KS_ERR_NOT_FOUND, "metadata key '%s' is missing", key);
    *out = &f->kv[i];
    return KS_OK;
}

static ks_status wrong_type(const struct gguf_kv *kv, const char *want)
{
    return ks_fail(KS_ERR_FORMAT, "metadata key '%s' is %s, which does not convert to %s", kv->key,
                   gguf_type_name(kv->type), want);
}

static ks_status get_int(const struct gguf_file *f, const char *key, const char *want, const struct gguf_kv **kv,
                         struct int_value *v)
{
    ks_status st = lookup(f, key, kv);
    if (st)
        return st;
    if (!is_int_type((*kv)->type))
        return wrong_type(*kv, want);
    *v = int_at(f->base + (*kv)->value_offset, (*kv)->type);
    return KS_OK;
}

static ks_status out_of_range(const struct gguf_kv *kv, struct int_value v, const char *want)
{
    return ks_fail(KS_ERR_FORMAT, "metadata key '%s' = %s%" PRIu64 " does not fit in %s", kv->key,
                   v.negative ? "-" : "", v.magnitude, want);
}

ks_status gguf_get_u32(const struct gguf_file *f, const char *key, uint32_t *out)
{
    const struct gguf_kv *kv = NULL;
    struct int_value v = {false, 0};
    ks_status st = get_int(f, key, "u32", &kv, &v);
    if (st)
        return st;
    if (v.negative || v.magnitude > UINT32_MAX)
        return out_of_range(kv, v, "u32");
    *out = (uint32_t)v.magnitude;
    return KS_OK;
}

ks_status gguf_get_i32(const struct gguf_file *f, const char *key, int32_t *out)
{
    const struct gguf_kv *kv = NULL;
    struct int_value v = {false, 0};
    ks_status st = get_int(f, key, "i32", &kv, &v);
    if (st)
        return st;
    if (v.magnitude > (v.negative ? (uint64_t)INT32_MAX + 1 : (uint64_t)INT32_MAX))
        return out_of_range(kv, v, "i32");
    *out = v.negative ? (int32_t)(-(int64_t)v.magnitude) : (int32_t)v.magnitude;
    return KS_OK;
}

ks_status gguf_get_u64(const struct gguf_file *f, const char *key, uint64_t *out)
{
    const struct gguf_kv *kv = NULL;
    struct int_value v = {false, 0};
    ks_status st = get_int(f, key, "u64", &kv, &v);
    if (st)
        return st;
    if (v.negative)
        return out_of_range(kv, v, "u64");
    *out = v.magnitude;
    return KS_OK;
}

ks_status gguf_get_f32(const struct gguf_file *f, const char *key, float *out)
{
    const struct gguf_kv *kv = NULL;
    ks_status st = lookup(f, key, &kv);
    if (st)
        return st;
    const uint8_t *p = f->base + kv->value_offset;
    if (kv->type == GGUF_TYPE_FLOAT32) {
        memcpy(out, p, 4);
    } else if (kv->type == GGUF_TYPE_FLOAT64) {
        double d;
        memcpy(&d, p, 8);
        *out = (float)d;
    } else if (is_int_type(kv->type)) {
        struct int_value v = int_at(p, kv->type);
        *out = v.negative ? -(float)v.magnitude : (float)v.magnitude;
    } else {
        return wrong_type(kv, "f32");
    }
    return KS_OK;
}

ks_status gguf_get_bool(const struct gguf_file *f, const char *key, bool *out)
{
    const struct gguf_kv *kv = NULL;
    ks_status st = lookup(f, key, &kv);
    if (st)
        return st;
    if (kv->type != GGUF_TYPE_BOOL)
        return wrong_type(kv, "bool");
    *out = f->base[kv->value_offset] != 0;
    return KS_OK;
}

static struct gguf_str str_at(const struct gguf_file *f, uint64_t offset)
{
    struct gguf_str s;
    memcpy(&s.len, f->base + offset, 8);
    s.data = (const char *)f->base + offset + 8;
    return s;
}

ks_status gguf_get_str(const struct gguf_file *f, const char *key, struct gguf_str *out)
{
    const struct gguf_kv *kv = NULL;
    ks_status st = lookup(f, key, &kv);
    if (st)
        return st;
    if (kv->type != GGUF_TYPE_STRING)
        return wrong_type(kv, "str");
    *out = str_at(f, kv->value_offset);
    return KS_OK;
}

ks_status gguf_get_arr(const struct gguf_file *f, const char *key, enum gguf_value_type *elem_type, uint64_t *count,
                       const void **data)
{
    const struct gguf_kv *kv = NULL;
    ks_status st = lookup(f, key, &kv);
    if (st)
        return st;
    if (kv->type != GGUF_TYPE_ARRAY)
        return wrong_type(kv, "arr");
    if (elem_type)
        *elem_type = kv->elem_type;
    if (count)
        *count = kv->count;
    if (data) {
        bool fixed = gguf_value_size(kv->elem_type) != 0;
        *data = fixed ? f->base + kv->value_offset + 12 : NULL;
    }
    return KS_OK;
}

ks_status gguf_get_arr_str(const struct gguf_file *f, const char *key, uint64_t i, struct gguf_str *out)
{
    const struct gguf_kv *kv = NULL;
    ks_status st = lookup(f, key, &kv);
    if (st)
        return st;
    if (kv->type != GGUF_TYPE_ARRAY || kv->elem_type != GGUF_TYPE_STRING)
        return ks_fail(KS_ERR_FORMAT, "metadata key '%s' is %s%s%s, not an array of strings", kv->key,
                       gguf_type_name(kv->type), kv->type == GGUF_TYPE_ARRAY ? " of " : "",
                       kv->type == GGUF_TYPE_ARRAY ? gguf_type_name(kv->elem_type) : "");
    if (i >= kv->count)
        return ks_fail(KS_ERR_RANGE, "index %" PRIu64 " is past the end of '%s' (%" PRIu64 " strings)", i, kv->key,
                       kv->count);
    *out = str_at(f, kv->str_offsets[i]);
    return KS_OK;
}

/* ---- printing ---------------------------------------------------------- */

enum {
    SHOW_STR_CHARS = 60,      /* a scalar string value */
    SHOW_ELEM_STR_CHARS = 24, /* each string inside an array */
    SHOW_NUM_ELEMS = 8,
    SHOW_STR_ELEMS = 5,
};

/* A bounded appender: output is always NUL-terminated and silently truncated. */
struct out {
    char *buf;
    size_t cap, len;
};

__attribute__((format(printf, 2, 3))) static void put(struct out *o, const char *fmt, ...)
{
    if (o->len + 1 >= o->cap)
        return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(o->buf + o->len, o->cap - o->len, fmt, ap);
    va_end(ap);
    if (n > 0)
        o->len = o->len + (size_t)n < o->cap ? o->len + (size_t)n : o->cap - 1;
}

static void put_str(struct out *o, struct gguf_str s, size_t max_chars)
{
    put(o, "\"");
    uint64_t shown = s.len < max_chars ? s.len : max_chars;
    while (shown < s.len && shown > 0 && ((unsigned char)s.data[shown] & 0xc0) == 0x80)
        shown--; /* cut at a UTF-8 character boundary */
    for (uint64_t i = 0; i < shown; i++) {
        unsigned char ch = (unsigned char)s.data[i];
        if (ch == '\n')
            put(o, "\\n");
        else if (ch == '"' || ch == '\\')
            put(o, "\\%c", ch);
        else if (ch < 0x20 || ch == 0x7f)
            put(o, "\\x%02x", ch);
        else
            put(o, "%c", ch); /* UTF-8 passes through */
    }
    put(o, "\"");
    if (shown < s.len)
        put(o, "... (%" PRIu64 " bytes)", s.len);
}

static void put_scalar(struct out *o, const uint8_t *p, enum gguf_value_type t)
{
    if (is_int_type(t)) {
        struct int_value v = int_at(p, t);
        put(o, "%s%" PRIu64, v.negative ? "-" : "", v.magnitude);
    } else if (t == GGUF_TYPE_FLOAT32) {
        float x;
        memcpy(&x, p, 4);
        put(o, "%.7g", (double)x);
    } else if (t == GGUF_TYPE_FLOAT64) {
        double x;
        memcpy(&x, p, 8);
        put(o, "%.15g", x);
    } else if (t == GGUF_TYPE_BOOL) {
        put(o, "%s", p[0] ? "true" : "false");
    }
}

static void put_array(struct out *o, const struct gguf_file *f, const struct gguf_kv *kv)
{
    put(o, "[%s x %" PRIu64 "]", gguf_type_name(kv->elem_type), kv->count);
    size_t esize = gguf_value_size(kv->elem_type);
    uint64_t limit = kv->elem_type == GGUF_TYPE_STRING ? SHOW_STR_ELEMS : esize ? SHOW_NUM_ELEMS : 0;
    uint64_t n = kv->count < limit ? kv->count : limit;
    for (uint64_t i = 0; i < n; i++) {
        put(o, i ? ", " : " ");
        if (kv->elem_type == GGUF_TYPE_STRING)
            put_str(o, str_at(f, kv->str_offsets[i]), SHOW_ELEM_STR_CHARS);
        else
            put_scalar(o, f->base + kv->value_offset + 12 + i * esize, kv->elem_type);
    }
    if (n && n < kv->count)
        put(o, ", ...");
}

void gguf_format_value(const struct gguf_file *f, int64_t i, char *buf, size_t cap)
{
    if (!buf || !cap)
        return;
    struct out o = {buf, cap, 0};
    buf[0] = '\0';
    if (!f || i < 0 || i >= f->n_kv)
        return;
    const struct gguf_kv *kv = &f->kv[i];
    if (kv->type == GGUF_TYPE_STRING)
        put_str(&o, str_at(f, kv->value_offset), SHOW_STR_CHARS);
    else if (kv->type == GGUF_TYPE_ARRAY)
        put_array(&o, f, kv);
    else
        put_scalar(&o, f->base + kv->value_offset, kv->type);
}
