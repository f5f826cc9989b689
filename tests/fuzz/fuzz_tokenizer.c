/* libFuzzer harness for the tokenizer: tok_encode on arbitrary bytes (with
 * and without TOK_ADD_SPECIAL / TOK_PARSE_SPECIAL), tok_decode and the
 * streaming detokenizer on arbitrary id arrays (in and out of range), for a
 * SentencePiece vocabulary (llama-spm) and two byte-level BPE ones (llama3,
 * qwen3).
 *
 * Input: byte 0 picks the vocabulary (bits 0-1), encode or decode (bit 2),
 * the encode flags (bits 3-4) and the decode flags (bits 5-7); the rest is the
 * text, or the ids as 3-byte little-endian values (below 0xfffff0: that value
 * modulo the vocabulary size; above: one of the out-of-range ids in `bad`).
 *
 * Oracle (README, "Tokenizers"): encoding never fails and gives ids in range;
 * without flags these lossless vocabularies decode back to the input bytes
 * (SentencePiece reads a literal U+2581 as a space, so such text is exempt);
 * a decode with an invalid id is KS_ERR_RANGE and pushing it leaves the stream
 * unchanged; the stream's pushes plus its flush equal the one-shot decode, and
 * so does a reset stream's prefix against the decode of that prefix; with
 * TOK_DECODE_REPLACE_BAD the text is valid UTF-8. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz/fuzz_vocab.h"

#define N_VOCABS 3
static struct tokenizer *vocabs[N_VOCABS];
static struct tok_stream *streams[N_VOCABS][8]; /* one per vocabulary and decode flags, reused */

static void check(bool ok, const char *what)
{
    if (!ok) {
        fprintf(stderr, "fuzz_tokenizer: %s (last error: %s)\n", what, ks_errmsg());
        abort();
    }
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    static const char *const files[N_VOCABS] = {"ggml-vocab-llama-spm.gguf", "ggml-vocab-llama3.gguf",
                                                "ggml-vocab-qwen3.gguf"};
    for (int v = 0; v < N_VOCABS; v++) {
        vocabs[v] = fuzz_load_vocab(files[v]);
        for (unsigned f = 0; f < 8; f++)
            check(tok_stream_create(vocabs[v], f, &streams[v][f]) == KS_OK, "tok_stream_create");
    }
    check(tok_family(vocabs[0]) == TOK_FAMILY_SPM && tok_family(vocabs[1]) == TOK_FAMILY_BPE, "vocabulary families");
    return 0;
}

/* Strict UTF-8: no overlongs, surrogates or code points above U+10FFFF. */
static bool utf8_valid(const uint8_t *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        size_t len;
        uint8_t lo = 0x80, hi = 0xbf;
        if (c < 0x80) {
            i++;
            continue;
        } else if (c >= 0xc2 && c <= 0xdf) {
            len = 2;
        } else if (c >= 0xe0 && c <= 0xef) {
            len = 3;
            lo = c == 0xe0 ? 0xa0 : 0x80;
            hi = c == 0xed ? 0x9f : 0xbf;
        } else if (c >= 0xf0 && c <= 0xf4) {
            len = 4;
            lo = c == 0xf0 ? 0x90 : 0x80;
            hi = c == 0xf4 ? 0x8f : 0xbf;
        } else {
            return false;
        }
        if (i + len > n || s[i + 1] < lo || s[i + 1] > hi)
            return false;
        for (size_t k = 2; k < len; k++)
            if ((s[i + k] & 0xc0) != 0x80)
                return false;
        i += len;
    }
    return true;
}

static char *decode(const struct tokenizer *t, const int32_t *ids, size_t n, unsigned flags, size_t *len)
{
    char *out = NULL;
    check(tok_decode(t, ids, n, flags, &out, len) == KS_OK, "tok_decode of valid ids");
    check(out[*len] == '\0', "decode is NUL-terminated");
    return out;
}

/* ids[0..n) are all valid: pushes + flush == one-shot, and a reset stream fed
 * the first half then flushed == the decode of that half. */
static void check_stream(struct tok_stream *s, const struct tokenizer *t, const int32_t *ids, size_t n,
                         unsigned flags)
{
    size_t one_len = 0;
    char *one = decode(t, ids, n, flags, &one_len);
    if (flags & TOK_DECODE_REPLACE_BAD)
        check(utf8_valid((const uint8_t *)one, one_len), "REPLACE_BAD output is valid UTF-8");
    const char *bytes;
    size_t len, got = 0;
    tok_stream_reset(s);
    for (size_t i = 0; i <= n; i++) {
        if (i < n)
            check(tok_stream_push(s, ids[i], &bytes, &len) == KS_OK, "push of a valid id");
        else
            check(tok_stream_flush(s, &bytes, &len) == KS_OK, "flush");
        check(got + len <= one_len && !memcmp(bytes, one + got, len), "stream chunk == one-shot bytes");
        got += len;
    }
    check(got == one_len, "stream total == one-shot length");
    free(one);

    size_t k = n / 2, pre_len = 0;
    char *pre = decode(t, ids, k, flags, &pre_len);
    tok_stream_reset(s);
    got = 0;
    for (size_t i = 0; i <= k; i++) {
        if (i < k)
            check(tok_stream_push(s, ids[i], &bytes, &len) == KS_OK, "push of a valid id");
        else
            check(tok_stream_flush(s, &bytes, &len) == KS_OK, "flush");
        check(got + len <= pre_len && !memcmp(bytes, pre + got, len), "prefix stream == prefix decode");
        got += len;
    }
    check(got == pre_len, "prefix stream total == prefix decode length");
    free(pre);
}

static void fuzz_encode(int v, unsigned enc, unsigned dec, const uint8_t *data, size_t size)
{
    const struct tokenizer *t = vocabs[v];
    char *text = malloc(size ? size : 1); /* exact size: ASan sees any over-read */
    check(text != NULL, "malloc");
    memcpy(text, data, size);
    int32_t *ids = NULL;
    size_t n = 0;
    check(tok_encode(t, text, size, enc, &ids, &n) == KS_OK, "tok_encode never fails");
    check(ids != NULL, "ids is never NULL");
    for (size_t i = 0; i < n; i++)
        check(ids[i] >= 0 && ids[i] < tok_n_vocab(t), "encoded ids in the vocabulary");
    if (enc == 0 && !(tok_family(t) == TOK_FAMILY_SPM && memmem(text, size, "\xe2\x96\x81", 3))) {
        size_t blen = 0;
        char *back = decode(t, ids, n, 0, &blen);
        check(blen == size && !memcmp(back, text, size), "decode(encode(text)) == text");
        free(back);
    }
    check_stream(streams[v][dec], t, ids, n, dec);
    free(ids);
    free(text);
}

static void fuzz_decode(int v, unsigned dec, const uint8_t *data, size_t size)
{
    const struct tokenizer *t = vocabs[v];
    int32_t n_vocab = tok_n_vocab(t);
    const int32_t bad[16] = {-1, -2, INT32_MIN, INT32_MAX, n_vocab, n_vocab + 1, -n_vocab, INT32_MIN + 1,
                             -1000, 1 << 30, n_vocab * 2, -3, n_vocab + 255, -256, INT32_MAX - 1, -65536};
    size_t n = size / 3, n_valid = 0;
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids), *valid = malloc((n ? n : 1) * sizeof *valid);
    check(ids && valid, "malloc");
    for (size_t i = 0; i < n; i++) {
        uint32_t u = data[3 * i] | (uint32_t)data[3 * i + 1] << 8 | (uint32_t)data[3 * i + 2] << 16;
        ids[i] = u >= 0xfffff0 ? bad[u - 0xfffff0] : (int32_t)(u % (uint32_t)n_vocab);
        if (ids[i] >= 0 && ids[i] < n_vocab)
            valid[n_valid++] = ids[i];
    }
    for (size_t i = 0; i < n; i++) {
        const char *bytes;
        size_t len;
        bool ok = ids[i] >= 0 && ids[i] < n_vocab;
        check((tok_piece(t, ids[i], &bytes, &len) == KS_OK) == ok, "tok_piece fails only out of range");
        check((tok_text(t, ids[i], &bytes, &len) == KS_OK) == ok, "tok_text fails only out of range");
        /* not tok_find: it walks the whole vocabulary and would be most of the run */
        if (!ok) {
            check(!tok_is_eog(t, ids[i]) && !tok_is_control(t, ids[i]), "out-of-range ids are neither eog nor control");
        }
    }
    char *out = NULL;
    size_t len = 0;
    ks_status st = tok_decode(t, ids, n, dec, &out, &len);
    check(n_valid == n ? st == KS_OK : st == KS_ERR_RANGE, "decode is KS_ERR_RANGE exactly when an id is invalid");
    free(out);

    /* pushes of invalid ids fail and change nothing: the stream of all ids
     * equals the one-shot decode of the valid ones */
    struct tok_stream *s = streams[v][dec];
    size_t one_len = 0;
    char *one = decode(t, valid, n_valid, dec, &one_len);
    tok_stream_reset(s);
    size_t got = 0;
    for (size_t i = 0; i <= n; i++) {
        const char *bytes;
        size_t blen;
        if (i < n) {
            st = tok_stream_push(s, ids[i], &bytes, &blen);
            if (!(ids[i] >= 0 && ids[i] < n_vocab)) {
                check(st == KS_ERR_RANGE, "push of an invalid id is KS_ERR_RANGE");
                continue;
            }
            check(st == KS_OK, "push of a valid id");
        } else {
            check(tok_stream_flush(s, &bytes, &blen) == KS_OK, "flush");
        }
        check(got + blen <= one_len && !memcmp(bytes, one + got, blen), "stream chunk == one-shot bytes");
        got += blen;
    }
    check(got == one_len, "stream total == one-shot length");
    free(one);
    check_stream(s, t, valid, n_valid, dec);
    free(valid);
    free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    int v = (data[0] & 3) % N_VOCABS;
    unsigned enc = (data[0] >> 3) & 3, dec = (data[0] >> 5) & 7;
    if (data[0] & 4)
        fuzz_decode(v, dec, data + 1, size - 1);
    else
        fuzz_encode(v, enc, dec, data + 1, size - 1);
    return 0;
}
