/* kvserve info: runs the real binary ($KVSERVE_BIN) on generated files and
 * stories260K and checks the memory numbers against hand arithmetic. */
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

/* llama-style metadata: 2 layers, 4 heads, 2 KV heads, dim 256 (head_dim 64). */
static void write_model(const char *path, uint32_t key_length, uint32_t value_length, uint32_t dim)
{
    struct gguf_writer *w;
    assert_int_equal(gguf_writer_create(&w), KS_OK);
    assert_int_equal(gguf_writer_set_str(w, "general.architecture", "llama"), KS_OK);
    assert_int_equal(gguf_writer_set_u32(w, "llama.block_count", 2), KS_OK);
    assert_int_equal(gguf_writer_set_u32(w, "llama.embedding_length", dim), KS_OK);
    assert_int_equal(gguf_writer_set_u32(w, "llama.attention.head_count", 4), KS_OK);
    assert_int_equal(gguf_writer_set_u32(w, "llama.attention.head_count_kv", 2), KS_OK);
    if (key_length) {
        assert_int_equal(gguf_writer_set_u32(w, "llama.attention.key_length", key_length), KS_OK);
        assert_int_equal(gguf_writer_set_u32(w, "llama.attention.value_length", value_length), KS_OK);
    }
    static const uint16_t half[64 * 3];
    assert_int_equal(gguf_writer_add_tensor(w, "token_embd.weight", 2, (int64_t[]){64, 3}, QUANT_F16, half,
                                            sizeof half),
                     KS_OK);
    assert_int_equal(gguf_writer_add_tensor(w, "blk.0.attn_q.weight", 2, (int64_t[]){64, 4}, QUANT_Q8_0, NULL,
                                            4 * 68),
                     KS_OK);
    assert_int_equal(gguf_writer_write(w, path), KS_OK);
    gguf_writer_free(w);
}

static void test_info_kv_numbers(void **state)
{
    (void)state;
    KS_NEED_KVSERVE();
    char *out = malloc(OUT_CAP);
    char path[] = "/tmp/test_gguf_info_XXXXXX";
    close(mkstemp(path));

    /* head_dim 64 = 256 / 4: per token 2 layers x 2 heads x (K + V) */
    write_model(path, 0, 0, 256);
    char args[256];
    snprintf(args, sizeof args, "-m %s", path);
    assert_int_equal(ks_run_kvserve("info", args, out, OUT_CAP), 0);
    ks_expect_text(out, "head_dim k 64 / v 64");
    ks_expect_text(out, "f16        1.00 KiB"); /* 2*2*(64+64)*2 B */
    ks_expect_text(out, "q8_0          544 B"); /* 2*2*(68+68) */
    ks_expect_text(out, "q4_0          288 B"); /* 2*2*(36+36) */
    ks_expect_text(out, "token_embd.weight");
    ks_expect_text(out, "[64, 3]");
    ks_expect_text(out, "f16        1 tensors            384 bytes");
    ks_expect_text(out, "q8_0       1 tensors            272 bytes");
    ks_expect_text(out, "weights: 656 B (656 bytes)");
    ks_expect_text(out, "llama.attention.head_count_kv                u32  2");

    /* key_length/value_length win over embedding_length / head_count */
    write_model(path, 128, 64, 256);
    assert_int_equal(ks_run_kvserve("info", args, out, OUT_CAP), 0);
    ks_expect_text(out, "head_dim k 128 / v 64");
    ks_expect_text(out, "f16        1.50 KiB"); /* 2*2*(128+64)*2 */

    /* head_dim 8: quantized KV impossible */
    write_model(path, 0, 0, 32);
    assert_int_equal(ks_run_kvserve("info", args, out, OUT_CAP), 0);
    ks_expect_text(out, "q8_0   n/a (head_dim 8 not a multiple of 32)");
    ks_expect_text(out, "q4_0   n/a (head_dim 8 not a multiple of 32)");

    /* a per-layer head_count_kv array is reported, not replaced by head_count */
    struct gguf_writer *w;
    assert_int_equal(gguf_writer_create(&w), KS_OK);
    assert_int_equal(gguf_writer_set_str(w, "general.architecture", "llama"), KS_OK);
    assert_int_equal(gguf_writer_set_u32(w, "llama.block_count", 2), KS_OK);
    assert_int_equal(gguf_writer_set_u32(w, "llama.attention.head_count", 4), KS_OK);
    assert_int_equal(gguf_writer_set_arr(w, "llama.attention.head_count_kv", GGUF_TYPE_INT32, (int32_t[]){2, 1}, 2),
                     KS_OK);
    assert_int_equal(gguf_writer_write(w, path), KS_OK);
    gguf_writer_free(w);
    assert_int_equal(ks_run_kvserve("info", args, out, OUT_CAP), 0);
    ks_expect_text(out, "KV cache: n/a (metadata key 'llama.attention.head_count_kv' is arr");

    /* a broken file: the reader's message and exit 1 */
    FILE *fp = fopen(path, "r+b");
    fseek(fp, 4, SEEK_SET);
    fputc(1, fp);
    fclose(fp);
    assert_int_equal(ks_run_kvserve("info", args, out, OUT_CAP), 1);
    ks_expect_text(out, "GGUF version 1 is not supported");
    unlink(path);

    assert_int_equal(ks_run_kvserve("info", "", out, OUT_CAP), 2);
    assert_int_equal(ks_run_kvserve("info", "--help", out, OUT_CAP), 0);
    ks_expect_text(out, "--no-tensors");
    free(out);
}

static void test_info_stories260k(void **state)
{
    (void)state;
    KS_NEED_KVSERVE();
    const char *dir = getenv("KVSERVE_SHARED");
    char path[4096];
    snprintf(path, sizeof path, "%s/models/stories260K.gguf", dir ? dir : ".");
    if (!dir || access(path, R_OK))
        KS_SKIP("stories260K.gguf not found under $KVSERVE_SHARED/models");
    char *out = malloc(OUT_CAP), args[4200];
    snprintf(args, sizeof args, "-m '%s'", path);
    assert_int_equal(ks_run_kvserve("info", args, out, OUT_CAP), 0);
    ks_expect_text(out, "GGUF v3, 1185376 bytes, alignment 32, tensor data at offset 14176");
    ks_expect_text(out, "tokenizer.ggml.tokens                        arr  [str x 512] \"<unk>\", \"<s>\"");
    ks_expect_text(out, "tensors: 48");
    ks_expect_text(out, "blk.0.ffn_down.weight                    f32    [172, 64]");
    ks_expect_text(out, "f32       48 tensors        1171200 bytes");
    ks_expect_text(out, "f16           640 B"); /* 5 layers x 4 heads x (8+8) x 2 B */
    ks_expect_text(out, "n/a (head_dim 8 not a multiple of 32)");
    free(out);
}

/* A mixture of experts: 8 experts, 2 per token. A token reads the output
 * matrix and 2/8 of the expert tensor, not the token embeddings. */
static void test_info_moe(void **state)
{
    (void)state;
    KS_NEED_KVSERVE();
    char *out = malloc(OUT_CAP);
    char path[] = "/tmp/test_gguf_info_XXXXXX";
    close(mkstemp(path));
    struct gguf_writer *w;
    assert_int_equal(gguf_writer_create(&w), KS_OK);
    assert_int_equal(gguf_writer_set_str(w, "general.architecture", "qwen3moe"), KS_OK);
    assert_int_equal(gguf_writer_set_u32(w, "qwen3moe.block_count", 1), KS_OK);
    assert_int_equal(gguf_writer_set_u32(w, "qwen3moe.embedding_length", 64), KS_OK);
    assert_int_equal(gguf_writer_set_u32(w, "qwen3moe.attention.head_count", 1), KS_OK);
    assert_int_equal(gguf_writer_set_u32(w, "qwen3moe.expert_count", 8), KS_OK);
    assert_int_equal(gguf_writer_set_u32(w, "qwen3moe.expert_used_count", 2), KS_OK);
    assert_int_equal(gguf_writer_set_u32(w, "qwen3moe.expert_feed_forward_length", 32), KS_OK);
    static const uint16_t half[64 * 3];
    static const float f32[64 * 3];
    assert_int_equal(gguf_writer_add_tensor(w, "token_embd.weight", 2, (int64_t[]){64, 3}, QUANT_F16, half,
                                            sizeof half),
                     KS_OK);
    assert_int_equal(gguf_writer_add_tensor(w, "output.weight", 2, (int64_t[]){64, 3}, QUANT_F32, f32, sizeof f32),
                     KS_OK);
    assert_int_equal(gguf_writer_add_tensor(w, "blk.0.ffn_up_exps.weight", 3, (int64_t[]){64, 32, 8}, QUANT_Q8_0,
                                            NULL, 32 * 8 * 68),
                     KS_OK);
    assert_int_equal(gguf_writer_write(w, path), KS_OK);
    gguf_writer_free(w);
    char args[256];
    snprintf(args, sizeof args, "-m %s", path);
    assert_int_equal(ks_run_kvserve("info", args, out, OUT_CAP), 0);
    ks_expect_text(out, "blk.0.ffn_up_exps.weight                 q8_0   [64, 32, 8]");
    ks_expect_text(out, "experts: 8 per layer, 2 used per token, expert FFN 32");
    /* 192 + 192 + 64*32*8; active 192 + 192 + 64*32*2 */
    ks_expect_text(out, "parameters: 16.77 K (16768), active per token: 4.48 K (4480)");
    /* output 768 + 2/8 of 32*8*68 */
    ks_expect_text(out, "read per decode token: 5.00 KiB (5120 bytes");
    unlink(path);
    free(out);
}

/* gpt-oss's features as the loader reads them: which layers slide, sinks,
 * biases, YaRN and the gating (a tiny synth file: window 16 on layers 0 and 2). */
static void test_info_gpt_oss_features(void **state)
{
    (void)state;
    KS_NEED_KVSERVE();
    char *out = malloc(OUT_CAP);
    char path[] = "/tmp/test_gguf_info_XXXXXX";
    close(mkstemp(path));
    char args[512];
    snprintf(args, sizeof args, "--preset tiny-gpt-oss --type q8_0 -t 1 -o %s", path);
    assert_int_equal(ks_run_kvserve("synth", args, out, OUT_CAP), 0);
    snprintf(args, sizeof args, "-m %s --no-tensors", path);
    assert_int_equal(ks_run_kvserve("info", args, out, OUT_CAP), 0);
    ks_expect_text(out, "sliding window 16 (pattern 2) on layers 0, 2; full on layers 1, 3; sinks");
    ks_expect_text(out, "biases: Q/K/V, attention output, router and every expert matrix");
    ks_expect_text(out, "scaling YaRN (factor 32 over an original context of 4096, beta 32 / 1, magnitude 1.3466)");
    ks_expect_text(out, "experts: 4 of 16 per token, weights softmax over the top-k router logits, clamped SwiGLU");
    unlink(path);
    free(out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_info_kv_numbers),
        cmocka_unit_test(test_info_stories260k),
        cmocka_unit_test(test_info_moe),
        cmocka_unit_test(test_info_gpt_oss_features),
    };
    return ks_run_tests(tests, NULL, NULL);
}
