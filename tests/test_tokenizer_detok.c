/* Tokenizer round trips, streaming detokenization, fuzzing, and chat
 * templates. Uses the shared vocabularies; each test skips without them. */
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
#include "tokenizer/tok_internal.h"
#include "tokenizer/tokenizer.h"
#include "support/read_file.h"
#include "support/skip.h"

#define SEPARATOR "\n__ggml_vocab_test__\n"

/* Lossless vocabularies (byte fallback or byte-level). Not deepseek: its
 * user-defined tokens 'õ', 'þ', ... stand for both those letters and the
 * bytes 0xf5, 0xfe, ... and detokenize as the letters, as in llama.cpp. Not
 * falcon or mpt: they have no token for some bytes (0x1c, 0xfe), which are
 * dropped, as in llama.cpp. */
static const char *const lossless[] = {
    "models/stories260K.gguf",           "models/vocab/ggml-vocab-llama-spm.gguf",
    "models/vocab/ggml-vocab-phi-3.gguf", "models/vocab/ggml-vocab-gpt-2.gguf",
    "models/vocab/ggml-vocab-llama3.gguf", "models/vocab/ggml-vocab-qwen3.gguf",
};
#define N_LOSSLESS (sizeof lossless / sizeof lossless[0])

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}

static bool shared_path(char *out, size_t cap, const char *rel)
{
    const char *d = getenv("KVSERVE_SHARED");
    int n = snprintf(out, cap, "%s/%s", d && *d ? d : "../shared", rel);
    return n > 0 && (size_t)n < cap;
}

/* The tokenizer of a shared GGUF, or NULL when the file is absent (the caller
 * skips it). A file that is there but does not load fails the test. */
static struct tokenizer *load(const char *rel)
{
    char path[1024];
    assert_true(shared_path(path, sizeof path, rel));
    if (access(path, R_OK) != 0) {
        print_message("no %s: not tested\n", path);
        return NULL;
    }
    struct gguf_file *f = NULL;
    if (gguf_open(path, &f) != KS_OK)
        fail_msg("gguf_open(%s): %s", path, ks_errmsg());
    struct tokenizer *t = NULL;
    ks_status st = tok_load(f, &t);
    gguf_close(f);
    if (st != KS_OK)
        fail_msg("tok_load(%s): %s", rel, ks_errmsg());
    return t;
}

static char *decode(const struct tokenizer *t, const int32_t *ids, size_t n, unsigned flags, size_t *len)
{
    char *out = NULL;
    assert_int_equal(tok_decode(t, ids, n, flags, &out, len), KS_OK);
    return out;
}

static void assert_roundtrip(const struct tokenizer *t, const char *text, size_t len, const char *vocab)
{
    int32_t *ids = NULL;
    size_t n = 0, blen = 0;
    assert_int_equal(tok_encode(t, text, len, 0, &ids, &n), KS_OK);
    char *back = decode(t, ids, n, 0, &blen);
    if (blen != len || memcmp(back, text, len)) {
        size_t d = 0;
        while (d < len && d < blen && back[d] == text[d])
            d++;
        print_message("%s: round trip of %zu bytes gave %zu, first difference at %zu:", vocab, len, blen, d);
        for (size_t i = d >= 4 ? d - 4 : 0; i < d + 4 && i < len; i++)
            print_message(" %02x/%02x", (uint8_t)text[i], i < blen ? (uint8_t)back[i] : 0);
        print_message("\n");
        fail();
    }
    free(back);
    free(ids);
}

/* Every vector string, random valid UTF-8 and random bytes come back intact. */
/* Invalid UTF-8 and NULs become U+FFFD, one per byte, by tok_utf8_decode's rules. */
static void test_utf8_sanitize(void **state)
{
    (void)state;
    static const struct {
        const char *in;
        size_t n;
        const char *want;
    } cases[] = {
        {"plain", 5, "plain"},
        {"h\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80", 12, "h\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80"},
        {"a\xFF" "b", 3, "a\xEF\xBF\xBD" "b"},
        {"\xC0\x80", 2, "\xEF\xBF\xBD\xEF\xBF\xBD"},             /* overlong NUL */
        {"\xED\xA0\x80", 3, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"}, /* surrogate */
        {"\xF4\x90\x80\x80", 4,
         "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"}, /* above U+10FFFF */
        {"x\xE2\x82", 3, "x\xEF\xBF\xBD\xEF\xBF\xBD"},           /* cut at the end */
        {"a\0b", 3, "a\xEF\xBF\xBD" "b"},
        {"", 0, ""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *out = NULL;
        size_t len = 0;
        assert_int_equal(tok_utf8_sanitize(cases[i].in, cases[i].n, &out, &len), KS_OK);
        assert_non_null(out);
        assert_int_equal(len, strlen(cases[i].want));
        assert_memory_equal(out, cases[i].want, len + 1);
        free(out);
    }
}

static void test_roundtrip(void **state)
{
    (void)state;
    char path[1024];
    size_t inp_len = 0;
    char *inp = shared_path(path, sizeof path, "models/vocab/ggml-vocab-gpt-2.gguf.inp")
                    ? ks_read_file(path, &inp_len)
                    : NULL;
    int tested = 0;
    for (size_t v = 0; v < N_LOSSLESS; v++) {
        struct tokenizer *t = load(lossless[v]);
        if (!t)
            continue;
        tested++;
        for (char *s = inp, *sep; s && (sep = strstr(s, SEPARATOR)); s = sep + strlen(SEPARATOR))
            assert_roundtrip(t, s, (size_t)(sep - s), lossless[v]);
        /* SPM reads a literal U+2581 as a space: only byte-level BPE keeps it */
        static const char *const cps[] = {"a", " ", "\n", "\t", "é", "ж", "中", "🦙", "'s", "1", "!", "\xe2\x96\x81"};
        size_t n_cps = sizeof cps / sizeof cps[0] - (tok_family(t) == TOK_FAMILY_SPM);
        for (int r = 0; r < 200; r++) {
            char buf[512];
            size_t len = 0, target = rnd() % 120;
            while (len < target) {
                const char *c = cps[rnd() % n_cps];
                memcpy(buf + len, c, strlen(c));
                len += strlen(c);
            }
            assert_roundtrip(t, buf, len, lossless[v]);
            for (size_t i = 0; i < len; i++)
                buf[i] = (char)rnd();
            assert_roundtrip(t, buf, len, lossless[v]);
        }
        tok_free(t);
    }
    free(inp);
    if (!tested)
        KS_SKIP("none of its vocabularies under $KVSERVE_SHARED/models");
}

/* Stream chunks are whole UTF-8 for valid text, concatenate to the one-shot
 * result, and flushing after any prefix equals decoding that prefix. */
static void check_stream(const struct tokenizer *t, const int32_t *ids, size_t n, unsigned flags, bool valid)
{
    size_t one_len = 0;
    char *one = decode(t, ids, n, flags, &one_len);
    struct tok_stream *s = NULL;
    assert_int_equal(tok_stream_create(t, flags, &s), KS_OK);
    char *cat = malloc(one_len + 1);
    size_t cat_len = 0;
    const char *bytes;
    size_t len;
    for (size_t i = 0; i <= n; i++) {
        if (i < n)
            assert_int_equal(tok_stream_push(s, ids[i], &bytes, &len), KS_OK);
        else
            assert_int_equal(tok_stream_flush(s, &bytes, &len), KS_OK);
        assert_true(cat_len + len <= one_len);
        memcpy(cat + cat_len, bytes, len);
        cat_len += len;
        if (valid && len) { /* a chunk of valid text never ends mid-character */
            size_t last = len - 1;
            while (last > 0 && ((uint8_t)bytes[last] & 0xc0) == 0x80)
                last--;
            uint8_t lead = (uint8_t)bytes[last];
            size_t want = lead < 0x80 ? 1 : lead >= 0xf0 ? 4 : lead >= 0xe0 ? 3 : 2;
            assert_int_equal(len - last, want);
        }
    }
    assert_int_equal(cat_len, one_len);
    assert_memory_equal(cat, one, one_len);
    for (size_t k = 0; k <= n; k++) {
        size_t pre_len = 0, got = 0;
        char *pre = decode(t, ids, k, flags, &pre_len);
        tok_stream_reset(s);
        for (size_t i = 0; i < k; i++) {
            assert_int_equal(tok_stream_push(s, ids[i], &bytes, &len), KS_OK);
            assert_memory_equal(bytes, pre + got, len);
            got += len;
        }
        assert_int_equal(tok_stream_flush(s, &bytes, &len), KS_OK);
        assert_memory_equal(bytes, pre + got, len);
        assert_int_equal(got + len, pre_len);
        free(pre);
    }
    tok_stream_free(s);
    free(cat);
    free(one);
}

static void test_stream(void **state)
{
    (void)state;
    int tested = 0;
    static const char *const texts[] = {"Héllo wörld, 中文 🦙🦙 ok", " leading space\n\ttabs", "ж"};
    for (size_t v = 0; v < N_LOSSLESS; v++) {
        struct tokenizer *t = load(lossless[v]);
        if (!t)
            continue;
        tested++;
        for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
            int32_t *ids = NULL;
            size_t n = 0;
            assert_int_equal(tok_encode(t, texts[i], strlen(texts[i]), TOK_ADD_SPECIAL, &ids, &n), KS_OK);
            for (unsigned flags = 0; flags < 8; flags++)
                check_stream(t, ids, n, flags, true);
            free(ids);
        }
        int32_t ids[40];
        for (int r = 0; r < 20; r++) { /* random ids: byte tokens split characters anywhere */
            for (int i = 0; i < 40; i++)
                ids[i] = (int32_t)(rnd() % (uint32_t)tok_n_vocab(t));
            check_stream(t, ids, 40, rnd() % 8, false);
        }
        tok_free(t);
    }
    if (!tested)
        KS_SKIP("none of its vocabularies under $KVSERVE_SHARED/models");
}

/* Random bytes, invalid UTF-8, huge words and whitespace runs: no crash, no
 * leak (ASan), and sizes that stay linear. */
static void test_fuzz(void **state)
{
    (void)state;
    int tested = 0;
    size_t big = 256 * 1024;
    char *buf = malloc(big);
    for (size_t v = 0; v < N_LOSSLESS; v++) {
        struct tokenizer *t = load(lossless[v]);
        if (!t)
            continue;
        tested++;
        for (int r = 0; r < 50; r++) {
            size_t len = rnd() % 2048;
            for (size_t i = 0; i < len; i++)
                buf[i] = (char)(r & 1 ? rnd() : (rnd() % 4 ? 0x80 | rnd() % 64 : 0xe0 | rnd() % 32));
            for (unsigned flags = 0; flags < 4; flags++) {
                int32_t *ids = NULL;
                size_t n = 0;
                assert_int_equal(tok_encode(t, buf, len, flags, &ids, &n), KS_OK);
                if (n > len + 2)
                    print_message("%s: %zu bytes gave %zu tokens\n", lossless[v], len, n);
                assert_true(n <= len + 2);
                size_t blen = 0;
                free(decode(t, ids, n, flags & 1 ? TOK_DECODE_REPLACE_BAD : 0, &blen));
                free(ids);
            }
        }
        const char fills[] = {'a', ' ', '\n', '1', '<'};
        for (size_t k = 0; k < sizeof fills; k++) {
            memset(buf, fills[k], big);
            int32_t *ids = NULL;
            size_t n = 0;
            assert_int_equal(tok_encode(t, buf, big, TOK_PARSE_SPECIAL, &ids, &n), KS_OK);
            if (n == 0 || n > big + 1)
                print_message("%s: %zu x '%c' gave %zu tokens\n", lossless[v], big, fills[k], n);
            assert_true(n > 0 && n <= big + 1);
            size_t blen = 0;
            char *back = decode(t, ids, n, 0, &blen);
            assert_int_equal(blen, big);
            free(back);
            free(ids);
        }
        int32_t bad[] = {0, -1};
        char *out = NULL;
        size_t olen = 0;
        assert_int_equal(tok_decode(t, bad, 2, 0, &out, &olen), KS_ERR_RANGE);
        bad[1] = tok_n_vocab(t);
        assert_int_equal(tok_decode(t, bad, 2, 0, &out, &olen), KS_ERR_RANGE);
        tok_free(t);
    }
    free(buf);
    if (!tested)
        KS_SKIP("none of its vocabularies under $KVSERVE_SHARED/models");
}

/* The greedy continuation llama.cpp produced reads as English. */
static void test_reference_continuation(void **state)
{
    (void)state;
    char path[1024];
    size_t len = 0;
    char *json = shared_path(path, sizeof path, "ref/stories260K.once.json") ? ks_read_file(path, &len) : NULL;
    struct tokenizer *t = load("models/stories260K.gguf");
    if (!json || !t) {
        free(json);
        tok_free(t);
        KS_SKIP("no ref/stories260K.once.json or models/stories260K.gguf under $KVSERVE_SHARED");
    }
    char *p = strstr(json, "\"greedy_ids\"");
    assert_non_null(p);
    p = strchr(p, '[');
    int32_t ids[256];
    size_t n = 0;
    for (char *end; p && n < 256; p = end) {
        long v = strtol(p + 1, &end, 10);
        if (end == p + 1)
            break;
        ids[n++] = (int32_t)v;
        if (*end != ',')
            break;
    }
    assert_true(n >= 32);
    size_t blen = 0;
    char *text = decode(t, ids, n, 0, &blen);
    print_message("greedy continuation: \"%s\"\n", text);
    size_t letters = 0, spaces = 0;
    for (size_t i = 0; i < blen; i++) {
        unsigned char c = (unsigned char)text[i];
        assert_true(c >= 0x20 || c == '\n');
        letters += (c | 0x20) >= 'a' && (c | 0x20) <= 'z';
        spaces += c == ' ';
    }
    assert_true(letters > blen / 2 && spaces > n / 4);
    free(text);
    free(json);
    tok_free(t);
}

/* SPM merges each word alone when the vocabulary allows it; that must give
 * exactly what merging the whole text at once gives. */
static void test_spm_words_equal_whole(void **state)
{
    (void)state;
    char path[1024];
    size_t len = 0;
    char *text = shared_path(path, sizeof path, "models/trained/sample.txt") ? ks_read_file(path, &len) : NULL;
    static const char *const vocabs[] = {"models/vocab/ggml-vocab-llama-spm.gguf", "models/stories260K.gguf",
                                         "models/trained/tiny-llama-gqa-hd64-f32.gguf"};
    int tested = 0;
    for (size_t v = 0; text && v < sizeof vocabs / sizeof vocabs[0]; v++) {
        struct tokenizer *t = load(vocabs[v]);
        if (!t)
            continue;
        assert_true(t->spm_split_words);
        size_t n = len < 40000 ? len : 40000;
        for (size_t i = 0; i < 64; i++) /* sprinkle odd spacing and invalid bytes */
            text[(i * 7919) % n] = "  \xe2\x96\x81\xff\t"[i % 6];
        int32_t *a = NULL, *b = NULL;
        size_t na = 0, nb = 0;
        assert_int_equal(tok_encode(t, text, n, 0, &a, &na), KS_OK);
        t->spm_split_words = false;
        assert_int_equal(tok_encode(t, text, n, 0, &b, &nb), KS_OK);
        assert_int_equal(na, nb);
        assert_memory_equal(a, b, na * sizeof *a);
        free(a);
        free(b);
        tok_free(t);
        tested++;
    }
    free(text);
    if (!tested)
        KS_SKIP("no models/trained/sample.txt or none of its vocabularies under $KVSERVE_SHARED");
}

/* ---- chat templates ----------------------------------------------------- */

static const struct tok_chat_msg convo[] = {
    {"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello!"}, {"user", "Bye"}};

static void expect_render(enum tok_chat_family fam, const char *want)
{
    char *out = NULL;
    assert_int_equal(tok_chat_render(NULL, fam, convo, 4, true, &out), KS_OK);
    if (strcmp(out, want))
        print_message("%s:\n got: %s\nwant: %s\n", tok_chat_name(fam), out, want);
    assert_string_equal(out, want);
    free(out);
}

static void test_chat_render(void **state)
{
    (void)state;
    expect_render(TOK_CHAT_CHATML, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                                   "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
                                   "<|im_start|>assistant\n");
    expect_render(TOK_CHAT_LLAMA3,
                  "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                  "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                  "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
                  "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
                  "<|start_header_id|>assistant<|end_header_id|>\n\n");
    expect_render(TOK_CHAT_LLAMA2, "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]Hello!</s><s>[INST] Bye [/INST]");
    expect_render(TOK_CHAT_MISTRAL, "[INST] Be brief.\n\nHi [/INST]Hello!</s>[INST] Bye [/INST]");
    expect_render(TOK_CHAT_ZEPHYR, "<|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\nHello!</s>\n"
                                   "<|user|>\nBye</s>\n<|assistant|>\n");
    expect_render(TOK_CHAT_GEMMA, "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!"
                                  "<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n");
    expect_render(TOK_CHAT_PHI3, "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n"
                                 "<|user|>\nBye<|end|>\n<|assistant|>\n");
    char *out = NULL;
    struct tok_chat_msg bad = {"robot", "x"};
    assert_int_equal(tok_chat_render(NULL, TOK_CHAT_CHATML, &bad, 1, true, &out), KS_ERR_INVALID_ARG);
}

static void test_chat_detect(void **state)
{
    (void)state;
    enum tok_chat_family fam;
    for (int i = 0; i < TOK_CHAT_COUNT; i++) {
        assert_int_equal(tok_chat_by_name(tok_chat_name((enum tok_chat_family)i), &fam), KS_OK);
        assert_int_equal(fam, i);
    }
    assert_int_equal(tok_chat_by_name("jinja-magic", &fam), KS_ERR_NOT_FOUND);
    assert_non_null(strstr(ks_errmsg(), "chatml, llama3"));
    const char *unknown = "{% for m in messages %}{{ m.content }}{% endfor %}";
    assert_int_equal(tok_chat_detect(unknown, strlen(unknown), &fam), KS_ERR_UNSUPPORTED);
    assert_non_null(strstr(ks_errmsg(), "--chat-template"));
    /* an empty template may be NULL (found by fuzz_chat: memmem was passed NULL) */
    assert_int_equal(tok_chat_detect(NULL, 0, &fam), KS_ERR_UNSUPPORTED);
    assert_int_equal(tok_chat_detect("<|im_start|>", 0, &fam), KS_ERR_UNSUPPORTED);
    const char *gemma = "{{ '<start_of_turn>' + role + '\n' }}";
    assert_int_equal(tok_chat_detect(gemma, strlen(gemma), &fam), KS_OK);
    assert_int_equal(fam, TOK_CHAT_GEMMA);
    const char *zephyr = "{{ '<|user|>\n' + message['content'] + eos_token }}{{ '<|assistant|>' }}";
    assert_int_equal(tok_chat_detect(zephyr, strlen(zephyr), &fam), KS_OK);
    assert_int_equal(fam, TOK_CHAT_ZEPHYR);

    static const struct {
        const char *vocab;
        enum tok_chat_family fam;
    } models[] = {{"models/vocab/ggml-vocab-llama3.gguf", TOK_CHAT_LLAMA3},
                  {"models/vocab/ggml-vocab-qwen3.gguf", TOK_CHAT_CHATML},
                  {"models/vocab/ggml-vocab-phi-3.gguf", TOK_CHAT_PHI3}};
    for (size_t i = 0; i < sizeof models / sizeof models[0]; i++) {
        struct tokenizer *t = load(models[i].vocab);
        if (!t)
            continue;
        /* every family's end-of-turn marker ends generation */
        static const char *const ends[] = {"<|eot_id|>", "<|im_end|>", "<|end|>"};
        int32_t end = tok_find(t, ends[i], strlen(ends[i]));
        assert_true(end >= 0 && tok_is_eog(t, end) && tok_is_control(t, end));
        assert_true(tok_is_eog(t, tok_special(t)->eos));
        assert_int_equal(tok_chat_for(t, NULL, &fam), KS_OK);
        assert_int_equal(fam, models[i].fam);
        assert_int_equal(tok_chat_for(t, "gemma", &fam), KS_OK);
        assert_int_equal(fam, TOK_CHAT_GEMMA);
        tok_free(t);
    }
}

/* A rendered llama3 chat tokenizes its markers as single control tokens
 * only when special parsing is on, and the EOG set holds <|eot_id|>. */
static void test_chat_tokens(void **state)
{
    (void)state;
    struct tokenizer *t = load("models/vocab/ggml-vocab-llama3.gguf");
    if (!t)
        KS_SKIP("no models/vocab/ggml-vocab-llama3.gguf under $KVSERVE_SHARED");
    char *text = NULL;
    assert_int_equal(tok_chat_render(t, TOK_CHAT_LLAMA3, convo + 1, 1, true, &text), KS_OK);
    int32_t *ids = NULL;
    size_t n = 0;
    assert_int_equal(tok_encode(t, text, strlen(text), TOK_ADD_SPECIAL | TOK_PARSE_SPECIAL, &ids, &n), KS_OK);
    int32_t start = tok_find(t, "<|start_header_id|>", 19), eot = tok_find(t, "<|eot_id|>", 10);
    assert_true(start >= 0 && eot >= 0);
    assert_int_equal(ids[0], tok_special(t)->bos);
    assert_int_equal(ids[1], start);
    assert_true(tok_is_eog(t, eot));
    assert_true(tok_is_control(t, eot));
    size_t n_plain = 0;
    int32_t *plain = NULL;
    assert_int_equal(tok_encode(t, text, strlen(text), 0, &plain, &n_plain), KS_OK);
    for (size_t i = 0; i < n_plain; i++)
        assert_int_not_equal(plain[i], start);
    size_t blen = 0;
    char *back = decode(t, ids, n, TOK_DECODE_SPECIAL, &blen);
    assert_string_equal(back + strlen("<|begin_of_text|>"), text);
    free(back);
    back = decode(t, ids, n, 0, &blen);
    assert_string_equal(back, "user\n\nHiassistant\n\n");
    free(back);
    free(plain);
    free(ids);
    free(text);
    tok_free(t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip),    cmocka_unit_test(test_stream),
        cmocka_unit_test(test_fuzz),         cmocka_unit_test(test_reference_continuation),
        cmocka_unit_test(test_spm_words_equal_whole),
        cmocka_unit_test(test_chat_render),  cmocka_unit_test(test_chat_detect),
        cmocka_unit_test(test_chat_tokens),  cmocka_unit_test(test_utf8_sanitize),
    };
    return ks_run_tests(tests, NULL, NULL);
}
