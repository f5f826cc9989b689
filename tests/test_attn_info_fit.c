/* kvserve info --kv-mem: the context that fits in a KV budget, checked
 * against hand arithmetic on a generated model (2 layers, 2 KV heads,
 * head_dim 64, pages of 32 tokens). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "gguf/gguf.h"
#include "support/run_kvserve.h"
#include "support/skip.h"

enum { OUT_CAP = 1 << 16 };

/* arch's metadata: n_layer layers, 2 KV heads, a sliding window when window > 0. */
static void write_arch_model(const char *path, const char *arch, uint32_t n_layer, uint32_t head_dim, uint32_t window)
{
    struct gguf_writer *w;
    char key[96];
    assert_int_equal(gguf_writer_create(&w), KS_OK);
    assert_int_equal(gguf_writer_set_str(w, "general.architecture", arch), KS_OK);
    snprintf(key, sizeof key, "%s.block_count", arch);
    assert_int_equal(gguf_writer_set_u32(w, key, n_layer), KS_OK);
    snprintf(key, sizeof key, "%s.embedding_length", arch);
    assert_int_equal(gguf_writer_set_u32(w, key, 4 * head_dim), KS_OK);
    snprintf(key, sizeof key, "%s.attention.head_count", arch);
    assert_int_equal(gguf_writer_set_u32(w, key, 4), KS_OK);
    snprintf(key, sizeof key, "%s.attention.head_count_kv", arch);
    assert_int_equal(gguf_writer_set_u32(w, key, 2), KS_OK);
    snprintf(key, sizeof key, "%s.attention.sliding_window", arch);
    if (window)
        assert_int_equal(gguf_writer_set_u32(w, key, window), KS_OK);
    static const uint16_t half[64 * 3];
    assert_int_equal(gguf_writer_add_tensor(w, "token_embd.weight", 2, (int64_t[]){64, 3}, QUANT_F16, half,
                                            sizeof half),
                     KS_OK);
    assert_int_equal(gguf_writer_write(w, path), KS_OK);
    gguf_writer_free(w);
}

static void write_model(const char *path, uint32_t head_dim) { write_arch_model(path, "llama", 2, head_dim, 0); }

static void test_fit_numbers(void **state)
{
    (void)state;
    KS_NEED_KVSERVE();
    char *out = malloc(OUT_CAP), path[] = "/tmp/test_attn_info_fit_XXXXXX", args[256];
    close(mkstemp(path));
    write_model(path, 64);
    snprintf(args, sizeof args, "-m %s --no-tensors --kv-mem 1M", path);
    assert_int_equal(ks_run_kvserve("info", args, out, OUT_CAP), 0);
    /* bytes per token, 2 layers x 2 heads x (K + V): f16 1024, q8_0 544, q4_0 288; pages of 32 */
    ks_expect_text(out, "KV fit in 1.00 MiB (1048576 bytes)");
    ks_expect_text(out, "f16              1024 tokens");  /* 32 pages of 32768 */
    ks_expect_text(out, "q8_0             1920 tokens");  /* 60 pages of 17408 */
    ks_expect_text(out, "q4_0             3616 tokens");  /* 113 pages of 9216 */
    /* 18 pages at f16 (sink page, 16 hot pages, the page being filled), the rest at q4_0 */
    ks_expect_text(out, "dynamic          2144 tokens");
    snprintf(args, sizeof args, "-m %s --kv-mem lots", path);
    assert_int_equal(ks_run_kvserve("info", args, out, OUT_CAP), 2);
    ks_expect_text(out, "--kv-mem 'lots' is not a size");
    unlink(path);
    write_model(path, 8); /* head_dim 8: no quantized types, dynamic stays at f16 */
    snprintf(args, sizeof args, "-m %s --no-tensors --kv-mem 1M", path);
    assert_int_equal(ks_run_kvserve("info", args, out, OUT_CAP), 0);
    ks_expect_text(out, "f16              8192 tokens");
    ks_expect_text(out, "q4_0     n/a (head_dim 8 not a multiple of 32)");
    ks_expect_text(out, "dynamic          8192 tokens");
    unlink(path);
    free(out);
}

/* gemma3: five of every six layers see a window; past it a token costs the
 * global layer's rows only. 6 layers, window 64, pages of 32: a page's rows
 * are 16384 bytes a layer at f16; 3 pages keep their 5 window layers' rows
 * (245760 bytes), and the rest of 1 MiB holds 49 pages of the global layer's. */
static void test_fit_sliding_window(void **state)
{
    (void)state;
    KS_NEED_KVSERVE();
    char *out = malloc(OUT_CAP), path[] = "/tmp/test_attn_info_fit_XXXXXX", args[256];
    close(mkstemp(path));
    write_arch_model(path, "gemma3", 6, 64, 64);
    snprintf(args, sizeof args, "-m %s --no-tensors --kv-mem 1M", path);
    assert_int_equal(ks_run_kvserve("info", args, out, OUT_CAP), 0);
    ks_expect_text(out, "sliding window of 64 tokens on 5 of 6 layers");
    ks_expect_text(out, "f16              1568 tokens");
    ks_expect_text(out, "the 5 sliding-window layers hold only the last 64 tokens' rows, at most 3 pages");
    unlink(path);
    write_arch_model(path, "gemma3", 6, 64, 0); /* no window key: every layer counts */
    assert_int_equal(ks_run_kvserve("info", args, out, OUT_CAP), 0);
    ks_expect_text(out, "f16               320 tokens");
    unlink(path);
    free(out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fit_numbers),
        cmocka_unit_test(test_fit_sliding_window),
    };
    return ks_run_tests(tests, NULL, NULL);
}
