/* Small valid GGUF files that seed the corpus-replay test and the fuzzer:
 * one with every value type and four tensor types (made by the writer), one
 * with nested arrays (only reachable by hand-made bytes). Both return a
 * malloc'd buffer, or NULL if the writer failed. */
#ifndef KS_TESTS_GGUF_SEEDS_H
#define KS_TESTS_GGUF_SEEDS_H

#include "fuzz/gguf_bytes.h"
#include "gguf/gguf.h"

static inline ks_status gguf_seed_fill(struct gguf_writer *w)
{
    static uint8_t data[256];
    for (size_t i = 0; i < sizeof data; i++)
        data[i] = (uint8_t)(i * 7);
    uint8_t u8 = 3, flags[3] = {1, 0, 1};
    int16_t i16 = -2;
    double f64 = 0.25;
    float scores[5] = {0, -1, -2, -3, -4};
    const char *toks[] = {"<s>", "</s>", "a", "", "bc"};
    ks_status st = KS_OK;
    st = st ? st : gguf_writer_set_str(w, "general.architecture", "llama");
    st = st ? st : gguf_writer_set_u32(w, "llama.block_count", 2);
    st = st ? st : gguf_writer_set_i32(w, "i32", -7);
    st = st ? st : gguf_writer_set_u64(w, "u64", 1ull << 40);
    st = st ? st : gguf_writer_set_f32(w, "f32", 0.5f);
    st = st ? st : gguf_writer_set_bool(w, "bool", true);
    st = st ? st : gguf_writer_set_scalar(w, "u8", GGUF_TYPE_UINT8, &u8);
    st = st ? st : gguf_writer_set_scalar(w, "i16", GGUF_TYPE_INT16, &i16);
    st = st ? st : gguf_writer_set_scalar(w, "f64", GGUF_TYPE_FLOAT64, &f64);
    st = st ? st : gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, NULL, 5);
    st = st ? st : gguf_writer_set_arr(w, "tokenizer.ggml.scores", GGUF_TYPE_FLOAT32, scores, 5);
    st = st ? st : gguf_writer_set_arr(w, "flags", GGUF_TYPE_BOOL, flags, 3);
    st = st ? st : gguf_writer_add_tensor(w, "a", 2, (int64_t[]){8, 2}, QUANT_F32, data, 64);
    st = st ? st : gguf_writer_add_tensor(w, "b", 2, (int64_t[]){32, 2}, QUANT_Q8_0, data, 68);
    st = st ? st : gguf_writer_add_tensor(w, "c", 1, (int64_t[]){32}, QUANT_Q4_0, data, 18);
    st = st ? st : gguf_writer_add_tensor(w, "d", 3, (int64_t[]){4, 1, 1}, QUANT_F16, data, 8);
    return st;
}

static inline void *gguf_seed_small(size_t *size)
{
    struct gguf_writer *w;
    void *buf = NULL;
    if (gguf_writer_create(&w))
        return NULL;
    if (gguf_seed_fill(w) || gguf_writer_write_memory(w, &buf, size))
        buf = NULL;
    gguf_writer_free(w);
    return buf;
}

static inline void *gguf_seed_nested(size_t *size)
{
    struct bb b = {0};
    bb_header(&b, 2, 1, 2);
    bb_key(&b, "nested", GGUF_TYPE_ARRAY);
    bb_u32(&b, GGUF_TYPE_ARRAY);
    bb_u64(&b, 3);
    bb_u32(&b, GGUF_TYPE_UINT16); bb_u64(&b, 2); bb_u32(&b, 0x00050004);
    bb_u32(&b, GGUF_TYPE_STRING); bb_u64(&b, 2); bb_str(&b, "x"); bb_str(&b, "yz");
    bb_u32(&b, GGUF_TYPE_ARRAY); bb_u64(&b, 1); bb_u32(&b, GGUF_TYPE_BOOL); bb_u64(&b, 1); bb_u8(&b, 1);
    bb_key(&b, "general.alignment", GGUF_TYPE_UINT32);
    bb_u32(&b, 16);
    bb_tensor(&b, "t", 1, (uint64_t[]){4}, QUANT_F32, 0);
    bb_data(&b, 16, 16, 0x41);
    *size = b.len;
    return b.p;
}

#endif
