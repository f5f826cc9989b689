/* gguf: writer -> reader round trips of every value type, hand-made malformed
 * files (each must fail with a message naming the problem), and known facts
 * about the shared models. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <dirent.h>
#include <time.h>

#include <cmocka.h>

#include "fuzz/gguf_bytes.h"
#include "fuzz/gguf_walk.h"
#include "gguf/gguf.h"
#include "support/skip.h"

/* ---- helpers ----------------------------------------------------------- */

static struct gguf_file *reopen(struct gguf_writer *w, void **buf)
{
    size_t size = 0;
    assert_int_equal(gguf_writer_write_memory(w, buf, &size), KS_OK);
    struct gguf_file *f = NULL;
    ks_status st = gguf_open_memory(*buf, size, &f);
    if (st)
        fail_msg("reopen: %s", ks_errmsg());
    return f;
}

static const char *shared_path(const char *rel, char *buf, size_t cap)
{
    const char *dir = getenv("KVSERVE_SHARED");
    if (!dir)
        return NULL;
    snprintf(buf, cap, "%s/%s", dir, rel);
    return access(buf, R_OK) == 0 ? buf : NULL;
}

static void expect_fail(const struct bb *b, ks_status want, const char *needle)
{
    struct gguf_file *f = NULL;
    ks_status st = gguf_open_memory(b->p, b->len, &f);
    if (st != want || !strstr(ks_errmsg(), needle))
        fail_msg("want status %d with '%s', got %d: '%s'", want, needle, st, ks_errmsg());
    assert_null(f);
}

static bool streq(struct gguf_str s, const char *want)
{
    return s.len == strlen(want) && !memcmp(s.data, want, s.len);
}

/* ---- round trips ------------------------------------------------------- */

static void test_roundtrip_scalars(void **state)
{
    (void)state;
    struct gguf_writer *w;
    assert_int_equal(gguf_writer_create(&w), KS_OK);
    uint8_t u8 = 250; int8_t i8 = -5; uint16_t u16 = 65000; int16_t i16 = -32000;
    int64_t i64 = INT64_MIN; double f64 = 1.0 / 3.0;
    assert_int_equal(gguf_writer_set_scalar(w, "t.u8", GGUF_TYPE_UINT8, &u8), KS_OK);
    assert_int_equal(gguf_writer_set_scalar(w, "t.i8", GGUF_TYPE_INT8, &i8), KS_OK);
    assert_int_equal(gguf_writer_set_scalar(w, "t.u16", GGUF_TYPE_UINT16, &u16), KS_OK);
    assert_int_equal(gguf_writer_set_scalar(w, "t.i16", GGUF_TYPE_INT16, &i16), KS_OK);
    assert_int_equal(gguf_writer_set_scalar(w, "t.i64", GGUF_TYPE_INT64, &i64), KS_OK);
    assert_int_equal(gguf_writer_set_scalar(w, "t.f64", GGUF_TYPE_FLOAT64, &f64), KS_OK);
    assert_int_equal(gguf_writer_set_u32(w, "t.u32", 4000000000u), KS_OK);
    assert_int_equal(gguf_writer_set_i32(w, "t.i32", INT32_MIN), KS_OK);
    assert_int_equal(gguf_writer_set_u64(w, "t.u64", UINT64_MAX), KS_OK);
    assert_int_equal(gguf_writer_set_f32(w, "t.f32", 1e-5f), KS_OK);
    assert_int_equal(gguf_writer_set_bool(w, "t.bool", true), KS_OK);
    assert_int_equal(gguf_writer_set_str(w, "t.str", "héllo\n"), KS_OK);
    assert_int_equal(gguf_writer_set_str(w, "t.empty", ""), KS_OK);
    assert_int_equal(gguf_writer_set_u32(w, "t.replaced", 1), KS_OK);
    assert_int_equal(gguf_writer_set_u32(w, "t.replaced", 2), KS_OK); /* replaces, keeps position */
    uint8_t bad_bool = 2;
    assert_int_equal(gguf_writer_set_scalar(w, "t.bad", GGUF_TYPE_BOOL, &bad_bool), KS_ERR_INVALID_ARG);
    assert_int_equal(gguf_writer_set_scalar(w, "t.bad", GGUF_TYPE_STRING, &u8), KS_ERR_INVALID_ARG);
    assert_int_equal(gguf_writer_set_u32(w, "", 1), KS_ERR_INVALID_ARG);

    void *buf;
    struct gguf_file *f = reopen(w, &buf);
    assert_int_equal(gguf_version(f), 3);
    assert_int_equal(gguf_n_kv(f), 14);
    assert_int_equal(gguf_n_tensors(f), 0);
    static const enum gguf_value_type types[] = {
        GGUF_TYPE_UINT8, GGUF_TYPE_INT8, GGUF_TYPE_UINT16, GGUF_TYPE_INT16, GGUF_TYPE_INT64, GGUF_TYPE_FLOAT64,
        GGUF_TYPE_UINT32, GGUF_TYPE_INT32, GGUF_TYPE_UINT64, GGUF_TYPE_FLOAT32, GGUF_TYPE_BOOL,
        GGUF_TYPE_STRING, GGUF_TYPE_STRING, GGUF_TYPE_UINT32};
    for (int64_t i = 0; i < gguf_n_kv(f); i++) {
        assert_int_equal(gguf_type_at(f, i), types[i]);
        assert_int_equal(gguf_find_key(f, gguf_key_at(f, i)), i);
    }
    assert_int_equal(gguf_find_key(f, "t.nope"), -1);

    uint32_t u32 = 7; int32_t i32 = 7; uint64_t u64 = 7; float f32 = 7; bool b = false; struct gguf_str s;
    assert_int_equal(gguf_get_u32(f, "t.u8", &u32), KS_OK); assert_int_equal(u32, 250);
    assert_int_equal(gguf_get_i32(f, "t.i8", &i32), KS_OK); assert_int_equal(i32, -5);
    assert_int_equal(gguf_get_u32(f, "t.u16", &u32), KS_OK); assert_int_equal(u32, 65000);
    assert_int_equal(gguf_get_i32(f, "t.i16", &i32), KS_OK); assert_int_equal(i32, -32000);
    assert_int_equal(gguf_get_u32(f, "t.u32", &u32), KS_OK); assert_int_equal(u32, 4000000000u);
    assert_int_equal(gguf_get_i32(f, "t.i32", &i32), KS_OK); assert_int_equal(i32, INT32_MIN);
    assert_int_equal(gguf_get_u64(f, "t.u64", &u64), KS_OK); assert_true(u64 == UINT64_MAX);
    assert_int_equal(gguf_get_f32(f, "t.f32", &f32), KS_OK); assert_true(f32 == 1e-5f);
    assert_int_equal(gguf_get_f32(f, "t.f64", &f32), KS_OK); assert_true(f32 == (float)(1.0 / 3.0));
    assert_int_equal(gguf_get_f32(f, "t.i16", &f32), KS_OK); assert_true(f32 == -32000.0f);
    assert_int_equal(gguf_get_bool(f, "t.bool", &b), KS_OK); assert_true(b);
    assert_int_equal(gguf_get_str(f, "t.str", &s), KS_OK); assert_true(streq(s, "héllo\n"));
    assert_int_equal(gguf_get_str(f, "t.empty", &s), KS_OK); assert_int_equal(s.len, 0);
    assert_int_equal(gguf_get_u32(f, "t.replaced", &u32), KS_OK); assert_int_equal(u32, 2);

    /* conversions that do not fit fail and leave the output alone */
    u32 = 7; i32 = 7; u64 = 7;
    assert_int_equal(gguf_get_u32(f, "t.i8", &u32), KS_ERR_FORMAT); assert_int_equal(u32, 7);
    assert_non_null(strstr(ks_errmsg(), "t.i8"));
    assert_int_equal(gguf_get_u32(f, "t.u64", &u32), KS_ERR_FORMAT); assert_int_equal(u32, 7);
    assert_int_equal(gguf_get_i32(f, "t.u32", &i32), KS_ERR_FORMAT); assert_int_equal(i32, 7);
    assert_int_equal(gguf_get_i32(f, "t.i64", &i32), KS_ERR_FORMAT);
    assert_int_equal(gguf_get_u64(f, "t.i64", &u64), KS_ERR_FORMAT); assert_int_equal(u64, 7);
    assert_int_equal(gguf_get_u32(f, "t.str", &u32), KS_ERR_FORMAT);
    assert_int_equal(gguf_get_u32(f, "t.f32", &u32), KS_ERR_FORMAT);
    assert_int_equal(gguf_get_bool(f, "t.u8", &b), KS_ERR_FORMAT);
    assert_int_equal(gguf_get_str(f, "t.u8", &s), KS_ERR_FORMAT);
    assert_int_equal(gguf_get_f32(f, "t.str", &f32), KS_ERR_FORMAT);
    assert_int_equal(gguf_get_u32(f, "t.missing", &u32), KS_ERR_NOT_FOUND);
    assert_non_null(strstr(ks_errmsg(), "t.missing"));

    char text[128];
    gguf_format_value(f, gguf_find_key(f, "t.i64"), text, sizeof text);
    assert_string_equal(text, "-9223372036854775808");
    gguf_format_value(f, gguf_find_key(f, "t.str"), text, sizeof text);
    assert_string_equal(text, "\"héllo\\n\"");
    gguf_format_value(f, gguf_find_key(f, "t.bool"), text, sizeof text);
    assert_string_equal(text, "true");
    gguf_format_value(f, gguf_find_key(f, "t.f32"), text, 4); /* truncates, stays terminated */
    assert_string_equal(text, "1e-");
    gguf_close(f);
    free(buf);
    gguf_writer_free(w);
}

static void test_roundtrip_arrays(void **state)
{
    (void)state;
    static const enum gguf_value_type fixed[] = {
        GGUF_TYPE_UINT8, GGUF_TYPE_INT8, GGUF_TYPE_UINT16, GGUF_TYPE_INT16, GGUF_TYPE_UINT32, GGUF_TYPE_INT32,
        GGUF_TYPE_FLOAT32, GGUF_TYPE_BOOL, GGUF_TYPE_UINT64, GGUF_TYPE_INT64, GGUF_TYPE_FLOAT64};
    static const size_t sizes[] = {1, 1, 2, 2, 4, 4, 4, 1, 8, 8, 8};
    enum { N = 37 };
    uint8_t raw[N * 8];
    for (size_t i = 0; i < sizeof raw; i++)
        raw[i] = (uint8_t)(i * 37 + 11);
    uint8_t bools[N];
    for (int i = 0; i < N; i++)
        bools[i] = (uint8_t)(i % 3 == 0);
    struct gguf_writer *w;
    assert_int_equal(gguf_writer_create(&w), KS_OK);
    char key[64];
    for (size_t t = 0; t < sizeof fixed / sizeof fixed[0]; t++) {
        snprintf(key, sizeof key, "arr.%s", gguf_type_name(fixed[t]));
        const void *src = fixed[t] == GGUF_TYPE_BOOL ? (const void *)bools : raw;
        assert_int_equal(gguf_writer_set_arr(w, key, fixed[t], src, N), KS_OK);
        snprintf(key, sizeof key, "empty.%s", gguf_type_name(fixed[t]));
        assert_int_equal(gguf_writer_set_arr(w, key, fixed[t], NULL, 0), KS_OK);
    }
    assert_int_equal(gguf_writer_set_arr(w, "bad", GGUF_TYPE_STRING, raw, 1), KS_ERR_INVALID_ARG);
    assert_int_equal(gguf_writer_set_arr(w, "bad", GGUF_TYPE_BOOL, raw + 1, 2), KS_ERR_INVALID_ARG);
    const char *strs[] = {"<unk>", "", "a\0b", "héllo", "x"};
    const uint64_t lens[] = {5, 0, 3, 6, 1};
    assert_int_equal(gguf_writer_set_arr_str(w, "strs.lens", strs, lens, 5), KS_OK);
    assert_int_equal(gguf_writer_set_arr_str(w, "strs.nul", strs, NULL, 2), KS_OK);
    assert_int_equal(gguf_writer_set_arr_str(w, "strs.empty", NULL, NULL, 0), KS_OK);

    void *buf;
    struct gguf_file *f = reopen(w, &buf);
    enum gguf_value_type et;
    uint64_t count;
    const void *data;
    for (size_t t = 0; t < sizeof fixed / sizeof fixed[0]; t++) {
        snprintf(key, sizeof key, "arr.%s", gguf_type_name(fixed[t]));
        assert_int_equal(gguf_get_arr(f, key, &et, &count, &data), KS_OK);
        assert_int_equal(et, fixed[t]);
        assert_int_equal(count, N);
        const void *src = fixed[t] == GGUF_TYPE_BOOL ? (const void *)bools : raw;
        assert_memory_equal(data, src, N * sizes[t]);
        snprintf(key, sizeof key, "empty.%s", gguf_type_name(fixed[t]));
        assert_int_equal(gguf_get_arr(f, key, &et, &count, &data), KS_OK);
        assert_int_equal(count, 0);
    }
    assert_int_equal(gguf_get_arr(f, "strs.lens", &et, &count, &data), KS_OK);
    assert_int_equal(et, GGUF_TYPE_STRING);
    assert_int_equal(count, 5);
    assert_null(data);
    struct gguf_str s;
    for (uint64_t i = 0; i < 5; i++) {
        assert_int_equal(gguf_get_arr_str(f, "strs.lens", i, &s), KS_OK);
        assert_int_equal(s.len, lens[i]);
        if (lens[i])
            assert_memory_equal(s.data, strs[i], lens[i]);
    }
    assert_int_equal(gguf_get_arr_str(f, "strs.lens", 5, &s), KS_ERR_RANGE);
    assert_int_equal(gguf_get_arr_str(f, "strs.nul", 1, &s), KS_OK);
    assert_int_equal(s.len, 0);
    assert_int_equal(gguf_get_arr_str(f, "arr.u8", 0, &s), KS_ERR_FORMAT);
    assert_int_equal(gguf_get_arr(f, "strs.empty", &et, &count, NULL), KS_OK);
    assert_int_equal(count, 0);

    char text[256];
    gguf_format_value(f, gguf_find_key(f, "strs.lens"), text, sizeof text);
    assert_string_equal(text, "[str x 5] \"<unk>\", \"\", \"a\\x00b\", \"héllo\", \"x\"");
    gguf_format_value(f, gguf_find_key(f, "arr.bool"), text, sizeof text);
    assert_string_equal(text, "[bool x 37] true, false, false, true, false, false, true, false, ...");
    gguf_close(f);
    free(buf);
    gguf_writer_free(w);
}

static void fill(uint8_t *p, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)((i * 2654435761u + seed) >> 13);
}

static void test_roundtrip_tensors(void **state)
{
    (void)state;
    struct spec {
        const char *name;
        uint32_t n_dims;
        int64_t ne[4];
        enum quant_type type;
    } specs[] = {
        {"a.f32", 2, {5, 3}, QUANT_F32},
        {"b.f16", 1, {7}, QUANT_F16},
        {"c.q8_0", 2, {64, 3}, QUANT_Q8_0},
        {"d.q4_0", 3, {32, 1, 2}, QUANT_Q4_0},
        {"e.q4_k", 2, {256, 2}, QUANT_Q4_K},
        {"f.bf16", 4, {2, 3, 4, 5}, QUANT_BF16},
    };
    enum { NS = sizeof specs / sizeof specs[0] };
    for (int alignment = 32; alignment <= 64; alignment *= 2) {
        struct gguf_writer *w;
        assert_int_equal(gguf_writer_create(&w), KS_OK);
        if (alignment != GGUF_DEFAULT_ALIGNMENT)
            assert_int_equal(gguf_writer_set_u32(w, "general.alignment", (uint32_t)alignment), KS_OK);
        uint8_t *data[NS];
        uint64_t nbytes[NS];
        for (int i = 0; i < NS; i++) {
            nbytes[i] = quant_row_size(specs[i].type, specs[i].ne[0]);
            for (uint32_t d = 1; d < specs[i].n_dims; d++)
                nbytes[i] *= (uint64_t)specs[i].ne[d];
            data[i] = malloc(nbytes[i]);
            fill(data[i], nbytes[i], (unsigned)i);
            assert_int_equal(gguf_writer_add_tensor(w, specs[i].name, specs[i].n_dims, specs[i].ne, specs[i].type,
                                                    data[i], nbytes[i]),
                             KS_OK);
        }
        assert_int_equal(gguf_writer_add_tensor(w, "a.f32", 1, (int64_t[]){1}, QUANT_F32, data[0], 4),
                         KS_ERR_INVALID_ARG);
        assert_int_equal(gguf_writer_add_tensor(w, "x", 1, (int64_t[]){16}, QUANT_Q8_0, data[0], 17),
                         KS_ERR_INVALID_ARG);
        assert_int_equal(gguf_writer_add_tensor(w, "x", 1, (int64_t[]){4}, QUANT_F32, data[0], 15),
                         KS_ERR_INVALID_ARG);
        assert_int_equal(gguf_writer_add_tensor(w, "x", 1, (int64_t[]){0}, QUANT_F32, data[0], 0),
                         KS_ERR_INVALID_ARG);
        assert_int_equal(gguf_writer_add_tensor(w, "zeros", 1, (int64_t[]){3}, QUANT_F32, NULL, 12), KS_OK);

        char path[] = "/tmp/test_gguf_XXXXXX";
        int fd = mkstemp(path);
        assert_true(fd >= 0);
        close(fd);
        assert_int_equal(gguf_writer_write(w, path), KS_OK);
        struct gguf_file *f = NULL;
        if (gguf_open(path, &f))
            fail_msg("%s", ks_errmsg());
        assert_int_equal(gguf_alignment(f), alignment);
        assert_int_equal(gguf_data_offset(f) % (uint64_t)alignment, 0);
        assert_int_equal(gguf_n_tensors(f), NS + 1);
        for (int i = 0; i < NS; i++) {
            const struct gguf_tensor_info *t = gguf_find_tensor(f, specs[i].name);
            assert_non_null(t);
            assert_ptr_equal(t, gguf_tensor_at(f, i));
            assert_int_equal(t->type, specs[i].type);
            assert_int_equal(t->n_dims, specs[i].n_dims);
            for (int d = 0; d < GGUF_MAX_DIMS; d++)
                assert_int_equal(t->ne[d], d < (int)specs[i].n_dims ? specs[i].ne[d] : 1);
            assert_int_equal(t->nbytes, nbytes[i]);
            assert_int_equal(t->offset % (uint64_t)alignment, 0);
            assert_memory_equal(t->data, data[i], nbytes[i]);
            free(data[i]);
        }
        const struct gguf_tensor_info *z = gguf_find_tensor(f, "zeros");
        static const float zeros[3];
        assert_memory_equal(z->data, zeros, sizeof zeros);
        assert_null(gguf_find_tensor(f, "nope"));
        assert_int_equal(gguf_file_size(f) % (size_t)alignment, 0);
        /* the private (huge-page) copy holds the same file */
        struct gguf_file *g = NULL;
        if (gguf_open_private(path, &g))
            fail_msg("%s", ks_errmsg());
        assert_int_equal(gguf_n_tensors(g), gguf_n_tensors(f));
        assert_int_equal(gguf_file_size(g), gguf_file_size(f));
        for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
            const struct gguf_tensor_info *a = gguf_tensor_at(f, i), *b = gguf_tensor_at(g, i);
            assert_string_equal(a->name, b->name);
            assert_int_equal(a->nbytes, b->nbytes);
            assert_ptr_not_equal(a->data, b->data);
            assert_memory_equal(a->data, b->data, a->nbytes);
        }
        gguf_close(g);
        gguf_close(f);
        unlink(path);
        gguf_writer_free(w);
    }
}

static void test_writer_rejects_bad_alignment(void **state)
{
    (void)state;
    struct gguf_writer *w;
    assert_int_equal(gguf_writer_create(&w), KS_OK);
    assert_int_equal(gguf_writer_set_u32(w, "general.alignment", 48), KS_OK);
    void *buf = NULL;
    size_t size;
    assert_int_equal(gguf_writer_write_memory(w, &buf, &size), KS_ERR_INVALID_ARG);
    assert_non_null(strstr(ks_errmsg(), "general.alignment"));
    assert_int_equal(gguf_writer_write(w, "/nonexistent-dir/x.gguf"), KS_ERR_INVALID_ARG);
    assert_int_equal(gguf_writer_set_u32(w, "general.alignment", 32), KS_OK);
    assert_int_equal(gguf_writer_write(w, "/nonexistent-dir/x.gguf"), KS_ERR_IO);
    assert_non_null(strstr(ks_errmsg(), "/nonexistent-dir/x.gguf"));
    gguf_writer_free(w);
}

/* ---- nested arrays and malformed files --------------------------------- */

static void test_nested_arrays(void **state)
{
    (void)state;
    struct bb b = {0};
    bb_header(&b, 3, 0, 2);
    bb_key(&b, "nested", GGUF_TYPE_ARRAY);
    bb_u32(&b, GGUF_TYPE_ARRAY);
    bb_u64(&b, 2);
    bb_u32(&b, GGUF_TYPE_UINT8); bb_u64(&b, 3); bb_u8(&b, 1); bb_u8(&b, 2); bb_u8(&b, 3);
    bb_u32(&b, GGUF_TYPE_STRING); bb_u64(&b, 1); bb_str(&b, "hi");
    bb_key(&b, "after", GGUF_TYPE_UINT32);
    bb_u32(&b, 42);
    struct gguf_file *f = NULL;
    if (gguf_open_memory(b.p, b.len, &f))
        fail_msg("%s", ks_errmsg());
    enum gguf_value_type et;
    uint64_t count;
    const void *data = &count;
    assert_int_equal(gguf_get_arr(f, "nested", &et, &count, &data), KS_OK);
    assert_int_equal(et, GGUF_TYPE_ARRAY);
    assert_int_equal(count, 2);
    assert_null(data);
    uint32_t v;
    assert_int_equal(gguf_get_u32(f, "after", &v), KS_OK);
    assert_int_equal(v, 42);
    char text[64];
    gguf_format_value(f, 0, text, sizeof text);
    assert_string_equal(text, "[arr x 2]");
    gguf_walk(f);
    gguf_close(f);

    /* 9 levels deep is refused */
    b.len = 0;
    bb_header(&b, 3, 0, 1);
    bb_key(&b, "deep", GGUF_TYPE_ARRAY);
    for (int d = 0; d < 9; d++) {
        bb_u32(&b, GGUF_TYPE_ARRAY);
        bb_u64(&b, 1);
    }
    bb_u32(&b, GGUF_TYPE_UINT8);
    bb_u64(&b, 0);
    expect_fail(&b, KS_ERR_FORMAT, "nested deeper");
    expect_fail(&b, KS_ERR_FORMAT, "'deep'");
    free(b.p);
}

/* A valid file with one or two u32 keys and up to two F32 tensors, which
 * each case below breaks in one way. */
struct craft {
    uint32_t version;
    uint32_t value_type;     /* type of key "k" (a u32 value 7 follows) */
    const char *key2;        /* a second u32 key, or NULL */
    uint32_t key2_value;
    const char *t1, *t2;     /* tensor names, t2 may be NULL */
    uint32_t n_dims, type;
    uint64_t ne0, ne1;
    uint64_t off1, off2;
    size_t data_bytes;
};

static void build(struct bb *b, const struct craft *c)
{
    b->len = 0;
    bb_header(b, c->version, c->t2 ? 2 : 1, c->key2 ? 2 : 1);
    bb_key(b, "k", c->value_type);
    bb_u32(b, 7);
    if (c->key2) {
        bb_key(b, c->key2, GGUF_TYPE_UINT32);
        bb_u32(b, c->key2_value);
    }
    uint64_t ne[8] = {c->ne0, c->ne1, 1, 1, 1, 1, 1, 1}; /* n_dims may be a bad 5 */
    bb_tensor(b, c->t1, c->n_dims, ne, c->type, c->off1);
    if (c->t2)
        bb_tensor(b, c->t2, c->n_dims, ne, c->type, c->off2);
    bb_data(b, 32, c->data_bytes, 0x3f);
}

/* The valid base case with some fields overridden. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Woverride-init"
#define CRAFT(...) ((struct craft){3, GGUF_TYPE_UINT32, NULL, 0, "t1", "t2", 2, QUANT_F32, 8, 2, 0, 64, 128, __VA_ARGS__})

static void test_malformed_files(void **state)
{
    (void)state;
    struct bb b = {0};
    build(&b, &CRAFT(.version = 3));
    struct gguf_file *f = NULL;
    if (gguf_open_memory(b.p, b.len, &f))
        fail_msg("the base case must be valid: %s", ks_errmsg());
    assert_int_equal(gguf_n_tensors(f), 2);
    gguf_close(f);

    const struct {
        struct craft c;
        ks_status want;
        const char *needle;
    } cases[] = {
        {CRAFT(.version = 1), KS_ERR_UNSUPPORTED, "version 1"},
        {CRAFT(.version = 4), KS_ERR_UNSUPPORTED, "version 4"},
        {CRAFT(.version = 0x03000000), KS_ERR_UNSUPPORTED, "big-endian"},
        {CRAFT(.value_type = 13), KS_ERR_FORMAT, "not a GGUF value type"},
        {CRAFT(.value_type = GGUF_TYPE_STRING), KS_ERR_FORMAT, "metadata key 'k'"},
        {CRAFT(.key2 = "k"), KS_ERR_FORMAT, "duplicate metadata key 'k'"},
        {CRAFT(.key2 = ""), KS_ERR_FORMAT, "key at offset 41 is empty"},
        {CRAFT(.key2 = "general.alignment", .key2_value = 24), KS_ERR_FORMAT, "not a nonzero power of two"},
        {CRAFT(.key2 = "general.alignment", .key2_value = 0), KS_ERR_FORMAT, "is 0, not a nonzero"},
        {CRAFT(.key2 = "general.alignment", .key2_value = 128, .data_bytes = 1000), KS_ERR_FORMAT, "alignment 128"},
        {CRAFT(.t2 = "t1"), KS_ERR_FORMAT, "duplicate tensor name 't1'"},
        {CRAFT(.t1 = ""), KS_ERR_FORMAT, "tensor name at offset"},
        {CRAFT(.t1 = "0123456789012345678901234567890123456789012345678901234567890123"), KS_ERR_FORMAT,
         "limit is 63"},
        {CRAFT(.n_dims = 0), KS_ERR_FORMAT, "n_dims"},
        {CRAFT(.n_dims = 5), KS_ERR_FORMAT, "n_dims"},
        {CRAFT(.ne0 = 0), KS_ERR_FORMAT, "dimension 0"},
        {CRAFT(.ne1 = 1ull << 63), KS_ERR_FORMAT, "dimension 1"},
        {CRAFT(.ne0 = 1ull << 62, .ne1 = 4), KS_ERR_FORMAT, "overflows"},
        {CRAFT(.type = 99), KS_ERR_UNSUPPORTED, "type id 99"},
        /* a type kvserve does not know: the error names the tensor and the type */
        {CRAFT(.type = 35), KS_ERR_UNSUPPORTED, "tensor 't1' (#0 at offset"},
        {CRAFT(.type = 35), KS_ERR_UNSUPPORTED, "tensor type tq2_0 (id 35)"},
        {CRAFT(.type = 34), KS_ERR_UNSUPPORTED, "tq1_0"},
        {CRAFT(.type = 40), KS_ERR_UNSUPPORTED, "tensor 't1' (#0 at offset"},
        {CRAFT(.type = QUANT_IQ4_XS), KS_ERR_FORMAT, "not a multiple of the iq4_xs block size 256"},
        {CRAFT(.type = QUANT_MXFP4), KS_ERR_FORMAT, "not a multiple of the mxfp4 block size 32"},
        {CRAFT(.type = QUANT_IQ2_XXS), KS_ERR_FORMAT, "not a multiple of the iq2_xxs block size 256"},
        {CRAFT(.type = QUANT_IQ3_NL), KS_ERR_UNSUPPORTED, "type id 64"}, /* kvserve's KV-only type */
        {CRAFT(.type = QUANT_Q8_0), KS_ERR_FORMAT, "not a multiple of the q8_0 block size 32"},
        {CRAFT(.off1 = 4), KS_ERR_FORMAT, "not a multiple of the alignment 32"},
        {CRAFT(.off2 = 32), KS_ERR_FORMAT, "overlap"},
        {CRAFT(.data_bytes = 100), KS_ERR_FORMAT, "tensor 't2': its 64 bytes"},
        {CRAFT(.off2 = 1ull << 63), KS_ERR_FORMAT, "run past the end"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        build(&b, &cases[i].c);
        expect_fail(&b, cases[i].want, cases[i].needle);
    }
#pragma GCC diagnostic pop

    /* header-level damage */
    b.len = 0;
    bb_put(&b, "GGML", 4);
    expect_fail(&b, KS_ERR_FORMAT, "not a GGUF file");
    b.len = 2;
    expect_fail(&b, KS_ERR_FORMAT, "not a GGUF file");
    b.len = 0;
    bb_header(&b, 3, 0, 1ull << 60);
    expect_fail(&b, KS_ERR_FORMAT, "metadata key count");
    b.len = 0;
    bb_header(&b, 3, 1000, 0);
    expect_fail(&b, KS_ERR_FORMAT, "tensor count");
    b.len = 0;
    bb_header(&b, 3, 0, 1);
    bb_str_claim(&b, "abc", 1000);
    bb_data(&b, 1, 32, 0);
    expect_fail(&b, KS_ERR_FORMAT, "has length 1000");
    b.len = 0;
    bb_header(&b, 3, 0, 1);
    bb_key(&b, "flag", GGUF_TYPE_BOOL);
    bb_u8(&b, 2);
    expect_fail(&b, KS_ERR_FORMAT, "not 0 or 1");
    b.len = 0;
    bb_header(&b, 3, 0, 1);
    bb_key(&b, "general.alignment", GGUF_TYPE_STRING);
    bb_str(&b, "32");
    expect_fail(&b, KS_ERR_FORMAT, "general.alignment");
    b.len = 0;
    bb_header(&b, 3, 0, 1);
    bb_key(&b, "big", GGUF_TYPE_ARRAY);
    bb_u32(&b, GGUF_TYPE_UINT64);
    bb_u64(&b, 1ull << 62);
    expect_fail(&b, KS_ERR_FORMAT, "'big'");
    b.len = 0;
    bb_header(&b, 3, 0, 1);
    bb_key(&b, "strs", GGUF_TYPE_ARRAY);
    bb_u32(&b, GGUF_TYPE_STRING);
    bb_u64(&b, 2);
    bb_str(&b, "ok");
    bb_str_claim(&b, "x", 99);
    expect_fail(&b, KS_ERR_FORMAT, "element 1");
    b.len = 0;
    bb_header(&b, 3, 0, 1);
    bb_strn(&b, "a\0b", 3);
    bb_u32(&b, GGUF_TYPE_UINT8);
    bb_u8(&b, 0);
    expect_fail(&b, KS_ERR_FORMAT, "NUL byte");
    free(b.p);

    assert_int_equal(gguf_open("/nonexistent/model.gguf", &f), KS_ERR_IO);
    assert_non_null(strstr(ks_errmsg(), "/nonexistent/model.gguf"));
    char path[] = "/tmp/test_gguf_empty_XXXXXX";
    int fd = mkstemp(path);
    close(fd);
    assert_int_equal(gguf_open(path, &f), KS_ERR_FORMAT);
    assert_non_null(strstr(ks_errmsg(), "empty"));
    assert_int_equal(gguf_open_private(path, &f), KS_ERR_FORMAT);
    assert_non_null(strstr(ks_errmsg(), "empty"));
    unlink(path);
    assert_int_equal(gguf_open_private("/nonexistent/model.gguf", &f), KS_ERR_IO);
    assert_non_null(strstr(ks_errmsg(), "/nonexistent/model.gguf"));
    assert_int_equal(gguf_open_memory(NULL, 0, &f), KS_ERR_FORMAT);
}

/* ---- shared models ----------------------------------------------------- */

static void test_stories260k(void **state)
{
    (void)state;
    char path[4096];
    if (!shared_path("models/stories260K.gguf", path, sizeof path))
        KS_SKIP("stories260K.gguf not found under $KVSERVE_SHARED/models");
    struct gguf_file *f = NULL;
    if (gguf_open(path, &f))
        fail_msg("%s", ks_errmsg());
    assert_int_equal(gguf_version(f), 3);
    assert_int_equal(gguf_alignment(f), 32);
    assert_int_equal(gguf_data_offset(f), 14176);
    uint32_t v;
    float eps;
    struct gguf_str s;
    assert_int_equal(gguf_get_str(f, "general.architecture", &s), KS_OK);
    assert_true(streq(s, "llama"));
    assert_int_equal(gguf_get_u32(f, "llama.block_count", &v), KS_OK); assert_int_equal(v, 5);
    assert_int_equal(gguf_get_u32(f, "llama.embedding_length", &v), KS_OK); assert_int_equal(v, 64);
    assert_int_equal(gguf_get_u32(f, "llama.attention.head_count", &v), KS_OK); assert_int_equal(v, 8);
    assert_int_equal(gguf_get_u32(f, "llama.attention.head_count_kv", &v), KS_OK); assert_int_equal(v, 4);
    assert_int_equal(gguf_get_u32(f, "llama.context_length", &v), KS_OK); assert_int_equal(v, 2048);
    assert_int_equal(gguf_get_f32(f, "llama.attention.layer_norm_rms_epsilon", &eps), KS_OK);
    assert_true(fabsf(eps - 1e-5f) < 1e-9f);
    enum gguf_value_type et;
    uint64_t count;
    assert_int_equal(gguf_get_arr(f, "tokenizer.ggml.tokens", &et, &count, NULL), KS_OK);
    assert_int_equal(et, GGUF_TYPE_STRING);
    assert_int_equal(count, 512);
    assert_int_equal(gguf_get_arr_str(f, "tokenizer.ggml.tokens", 1, &s), KS_OK);
    assert_true(streq(s, "<s>"));
    assert_int_equal(gguf_n_tensors(f), 48);
    const struct gguf_tensor_info *t = gguf_find_tensor(f, "token_embd.weight");
    assert_non_null(t);
    assert_int_equal(t->type, QUANT_F32);
    assert_int_equal(t->n_dims, 2);
    assert_int_equal(t->ne[0], 64);
    assert_int_equal(t->ne[1], 512);
    t = gguf_find_tensor(f, "blk.4.attn_k.weight");
    assert_non_null(t);
    assert_int_equal(t->ne[0], 64);
    assert_int_equal(t->ne[1], 32);
    t = gguf_find_tensor(f, "blk.0.ffn_down.weight");
    assert_int_equal(t->ne[0], 172);
    assert_int_equal(t->ne[1], 64);

    /* the private copy puts the tensors on cache lines: this file's data
     * section starts at 32 mod 64 */
    assert_int_equal(gguf_data_offset(f) % 64, 32);
    struct gguf_file *copy = NULL;
    if (gguf_open_private(path, &copy))
        fail_msg("%s", ks_errmsg());
    uint64_t total = 0, on_line_mapped = 0, on_line_copy = 0;
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        const struct gguf_tensor_info *a = gguf_tensor_at(f, i), *b = gguf_tensor_at(copy, i);
        assert_memory_equal(a->data, b->data, a->nbytes);
        total += a->nbytes;
        on_line_mapped += (uintptr_t)a->data % 64 ? 0 : a->nbytes;
        on_line_copy += (uintptr_t)b->data % 64 ? 0 : b->nbytes;
    }
    assert_true(on_line_copy >= on_line_mapped && on_line_copy * 2 >= total);
    assert_true((uintptr_t)gguf_find_tensor(copy, "token_embd.weight")->data % 64 == 0);
    gguf_close(copy);

    /* copy everything through the writer: same metadata, same tensor bytes */
    struct gguf_writer *w;
    assert_int_equal(gguf_writer_create(&w), KS_OK);
    assert_int_equal(gguf_writer_copy_kv(w, f, ""), KS_OK);
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        t = gguf_tensor_at(f, i);
        assert_int_equal(gguf_writer_add_tensor(w, t->name, t->n_dims, t->ne, t->type, t->data, t->nbytes), KS_OK);
    }
    void *buf;
    struct gguf_file *g = reopen(w, &buf);
    assert_int_equal(gguf_n_kv(g), gguf_n_kv(f));
    char a[512], c[512];
    for (int64_t i = 0; i < gguf_n_kv(f); i++) {
        assert_string_equal(gguf_key_at(g, i), gguf_key_at(f, i));
        gguf_format_value(f, i, a, sizeof a);
        gguf_format_value(g, i, c, sizeof c);
        assert_string_equal(a, c);
    }
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        t = gguf_tensor_at(f, i);
        const struct gguf_tensor_info *u = gguf_tensor_at(g, i);
        assert_string_equal(t->name, u->name);
        assert_int_equal(t->offset, u->offset);
        assert_memory_equal(t->data, u->data, t->nbytes);
    }
    /* the original was written with the same layout rules: byte-identical */
    assert_int_equal(gguf_file_size(g), gguf_file_size(f));
    gguf_close(g);
    free(buf);
    gguf_writer_free(w);
    gguf_close(f);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void test_vocab_files(void **state)
{
    (void)state;
    char dir[4096];
    if (!shared_path("models/vocab", dir, sizeof dir))
        KS_SKIP("$KVSERVE_SHARED/models/vocab not found");
    DIR *d = opendir(dir);
    assert_non_null(d);
    int n_files = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t n = strlen(e->d_name);
        if (n < 5 || strcmp(e->d_name + n - 5, ".gguf"))
            continue;
        char path[8192];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        struct gguf_file *f = NULL;
        if (gguf_open(path, &f))
            fail_msg("%s", ks_errmsg());
        enum gguf_value_type et;
        uint64_t count;
        assert_int_equal(gguf_get_arr(f, "tokenizer.ggml.tokens", &et, &count, NULL), KS_OK);
        assert_int_equal(et, GGUF_TYPE_STRING);
        struct gguf_str s;
        assert_int_equal(gguf_get_arr_str(f, "tokenizer.ggml.tokens", count - 1, &s), KS_OK);
        if (!strcmp(e->d_name, "ggml-vocab-llama3.gguf"))
            assert_int_equal(count, 128256);
        if (!strcmp(e->d_name, "ggml-vocab-qwen3.gguf"))
            assert_int_equal(count, 151669);
        if (!strcmp(e->d_name, "ggml-vocab-llama-spm.gguf")) {
            assert_int_equal(count, 32000);
            assert_int_equal(gguf_get_arr_str(f, "tokenizer.ggml.tokens", 2, &s), KS_OK);
            assert_true(streq(s, "</s>"));
        }
        gguf_walk(f);
        gguf_close(f);
        n_files++;
    }
    closedir(d);
    print_message("opened %d vocab files\n", n_files);

    char path[8192];
    snprintf(path, sizeof path, "%s/ggml-vocab-llama3.gguf", dir);
    struct gguf_file *f = NULL;
    if (access(path, R_OK) || gguf_open(path, &f))
        return;
    double t0 = now_s();
    struct gguf_writer *w;
    assert_int_equal(gguf_writer_create(&w), KS_OK);
    assert_int_equal(gguf_writer_copy_kv(w, f, "tokenizer."), KS_OK);
    void *buf;
    struct gguf_file *g = reopen(w, &buf);
    print_message("copied llama3 tokenizer.* and reopened in %.1f ms\n", 1e3 * (now_s() - t0));
    assert_int_equal(gguf_find_key(g, "general.architecture"), -1);
    uint64_t n_f, n_g;
    assert_int_equal(gguf_get_arr(f, "tokenizer.ggml.tokens", NULL, &n_f, NULL), KS_OK);
    assert_int_equal(gguf_get_arr(g, "tokenizer.ggml.tokens", NULL, &n_g, NULL), KS_OK);
    assert_int_equal(n_f, n_g);
    for (uint64_t i = 0; i < n_f; i++) {
        struct gguf_str a, b;
        assert_int_equal(gguf_get_arr_str(f, "tokenizer.ggml.tokens", i, &a), KS_OK);
        assert_int_equal(gguf_get_arr_str(g, "tokenizer.ggml.tokens", i, &b), KS_OK);
        assert_int_equal(a.len, b.len);
        assert_memory_equal(a.data, b.data, a.len);
    }
    gguf_close(g);
    free(buf);
    gguf_writer_free(w);
    gguf_close(f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip_scalars),
        cmocka_unit_test(test_roundtrip_arrays),
        cmocka_unit_test(test_roundtrip_tensors),
        cmocka_unit_test(test_writer_rejects_bad_alignment),
        cmocka_unit_test(test_nested_arrays),
        cmocka_unit_test(test_malformed_files),
        cmocka_unit_test(test_stories260k),
        cmocka_unit_test(test_vocab_files),
    };
    return ks_run_tests(tests, NULL, NULL);
}
