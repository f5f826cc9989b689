/* Tokenizer against llama.cpp's vectors: every .inp/.out pair in
 * shared/models/vocab whose .gguf is present, plus stories260K. */
#include <dirent.h>
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
#include "tokenizer/tokenizer.h"
#include "support/read_file.h"
#include "support/skip.h"

#define SEPARATOR "\n__ggml_vocab_test__\n"

static const char *shared_dir(void)
{
    const char *d = getenv("KVSERVE_SHARED");
    return d && *d ? d : "../shared";
}

/* out = a/b+suffix; false if it does not fit. */
static bool join_path(char *out, size_t cap, const char *a, const char *b, const char *suffix)
{
    int n = snprintf(out, cap, "%s/%s%s", a, b, suffix);
    return n >= 0 && (size_t)n < cap;
}

static struct tokenizer *load_vocab(const char *path)
{
    struct gguf_file *f = NULL;
    if (gguf_open(path, &f) != KS_OK) {
        print_message("cannot open %s: %s\n", path, ks_errmsg());
        return NULL;
    }
    struct tokenizer *t = NULL;
    ks_status st = tok_load(f, &t);
    if (st)
        print_message("tok_load(%s): %s\n", path, ks_errmsg());
    gguf_close(f);
    return t;
}

static bool file_exists(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (f)
        fclose(f);
    return f != NULL;
}

/* Compare one vocabulary's vectors; returns the number of failures. */
static int run_vocab(const char *dir, const char *name, int *n_pass, int *n_total)
{
    char path[1024];
    size_t inp_len = 0, out_len = 0;
    char *inp = join_path(path, sizeof path, dir, name, ".inp") ? ks_read_file(path, &inp_len) : NULL;
    char *out = join_path(path, sizeof path, dir, name, ".out") ? ks_read_file(path, &out_len) : NULL;
    struct tokenizer *t = inp && out && join_path(path, sizeof path, dir, name, "") ? load_vocab(path) : NULL;
    if (!t) {
        free(inp);
        free(out);
        return 1;
    }
    int fails = 0;
    *n_pass = *n_total = 0;
    char *text = inp, *line = out;
    for (;;) {
        char *sep = strstr(text, SEPARATOR);
        if (!sep || !*line)
            break;
        char *eol = strchr(line, '\n');
        if (eol)
            *eol = 0;
        int32_t *ids = NULL;
        size_t n = 0;
        assert_int_equal(tok_encode(t, text, (size_t)(sep - text), 0, &ids, &n), KS_OK);
        int32_t want[4096];
        size_t nw = 0;
        for (char *p = line, *end; nw < 4096; p = end) {
            long v = strtol(p, &end, 10);
            if (end == p)
                break;
            want[nw++] = (int32_t)v;
        }
        bool ok = n == nw && (!n || !memcmp(ids, want, n * sizeof *ids));
        ++*n_total;
        *n_pass += ok;
        if (!ok && fails++ < 3) {
            print_message("  %s: case %d '%.*s'\n    want:", name, *n_total, (int)(sep - text), text);
            for (size_t i = 0; i < nw; i++)
                print_message(" %d", want[i]);
            print_message("\n    got: ");
            for (size_t i = 0; i < n; i++)
                print_message(" %d", ids[i]);
            print_message("\n");
        }
        free(ids);
        text = sep + strlen(SEPARATOR);
        line = eol ? eol + 1 : line + strlen(line);
    }
    tok_free(t);
    free(inp);
    free(out);
    return fails;
}

static void test_vocab_vectors(void **state)
{
    (void)state;
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/models/vocab", shared_dir());
    struct dirent **names = NULL;
    int n = scandir(dir, &names, NULL, alphasort);
    if (n < 0)
        KS_SKIP("no %s", dir);
    int vocabs = 0, failed = 0;
    for (int i = 0; i < n; i++) {
        const char *fn = names[i]->d_name;
        size_t len = strlen(fn);
        if (len > 4 && !strcmp(fn + len - 4, ".inp")) {
            char name[512], gguf[1200];
            snprintf(name, sizeof name, "%.*s", (int)(len - 4), fn);
            if (!join_path(gguf, sizeof gguf, dir, name, "") || !file_exists(gguf)) {
                print_message("vocab %-32s skipped (no .gguf)\n", name);
            } else {
                int pass = 0, total = 0;
                int fails = run_vocab(dir, name, &pass, &total);
                print_message("vocab %-32s %d/%d passed\n", name, pass, total);
                vocabs++;
                failed += fails != 0;
            }
        }
        free(names[i]);
    }
    free(names);
    print_message("%d vocabularies tested, %d with failures\n", vocabs, failed);
    assert_true(vocabs > 0); /* an empty directory tests nothing */
    assert_int_equal(failed, 0);
}

static void test_stories260k(void **state)
{
    (void)state;
    char path[1024];
    snprintf(path, sizeof path, "%s/models/stories260K.gguf", shared_dir());
    if (!file_exists(path))
        KS_SKIP("no %s", path);
    struct tokenizer *t = load_vocab(path);
    assert_non_null(t);
    int32_t *ids = NULL;
    size_t n = 0;
    const char *text = "Once upon a time";
    assert_int_equal(tok_encode(t, text, strlen(text), TOK_ADD_SPECIAL, &ids, &n), KS_OK);
    const int32_t want[] = {1, 403, 407, 261, 378};
    assert_int_equal(n, 5);
    assert_memory_equal(ids, want, sizeof want);
    char *back = NULL;
    size_t blen = 0;
    assert_int_equal(tok_decode(t, ids, n, 0, &back, &blen), KS_OK);
    assert_string_equal(back, text);
    free(back);
    free(ids);
    const struct tok_special *sp = tok_special(t);
    assert_int_equal(sp->bos, 1);
    assert_int_equal(sp->eos, 2);
    assert_true(sp->add_bos);
    assert_true(tok_is_eog(t, 2));
    assert_false(tok_is_eog(t, 1));
    assert_int_equal(tok_n_vocab(t), 512);
    const char *piece;
    size_t plen;
    assert_int_equal(tok_piece(t, 512, &piece, &plen), KS_ERR_RANGE);
    assert_int_equal(tok_piece(t, -1, &piece, &plen), KS_ERR_RANGE);
    tok_free(t);
}

/* `kvserve tokenize --ids` prints exactly the ids, BOS included. */
static void test_cli_tokenize(void **state)
{
    (void)state;
    const char *bin = getenv("KVSERVE_BIN");
    char model[1024], cmd[4096], line[256] = "";
    if (!bin || !join_path(model, sizeof model, shared_dir(), "models/stories260K.gguf", "") ||
        !file_exists(model) || !file_exists(bin))
        KS_SKIP("no KVSERVE_BIN (run through ctest) or no stories260K.gguf under $KVSERVE_SHARED/models");
    int n = snprintf(cmd, sizeof cmd, "'%s' tokenize -m '%s' -p 'Once upon a time' --ids", bin, model);
    assert_true(n > 0 && (size_t)n < sizeof cmd);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    assert_non_null(fgets(line, sizeof line, p));
    assert_int_equal(pclose(p), 0);
    assert_string_equal(line, "1 403 407 261 378\n");
    n = snprintf(cmd, sizeof cmd, "'%s' tokenize -m '%s' -p 'Once' 2>&1", bin, model);
    assert_true(n > 0 && (size_t)n < sizeof cmd);
    p = popen(cmd, "r");
    assert_non_null(p);
    assert_non_null(fgets(line, sizeof line, p));
    assert_string_equal(line, "     1 -> '<s>'\n");
    assert_non_null(fgets(line, sizeof line, p));
    assert_string_equal(line, "   403 -> ' Once'\n");
    assert_int_equal(pclose(p), 0);
}

/* `kvserve chat` answers two turns and reuses the first turn's KV cache. */
static void test_cli_chat(void **state)
{
    (void)state;
    const char *bin = getenv("KVSERVE_BIN");
    char model[1024], cmd[4096], line[1024];
    if (!bin || !join_path(model, sizeof model, shared_dir(), "models/stories260K.gguf", "") ||
        !file_exists(model) || !file_exists(bin))
        KS_SKIP("no KVSERVE_BIN (run through ctest) or no stories260K.gguf under $KVSERVE_SHARED/models");
    int n = snprintf(cmd, sizeof cmd,
                     "printf 'Hello\\nTell me a story\\n' | '%s' chat -m '%s' -n 16 --temp 0 -t 1 -v "
                     "--chat-template chatml 2>&1",
                     bin, model);
    assert_true(n > 0 && (size_t)n < sizeof cmd);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    int turns = 0, reused_later = 0, first_reused = -1;
    while (fgets(line, sizeof line, p)) {
        int reused, computed;
        const char *at = strstr(line, "[prompt:");
        if (at && sscanf(at, "[prompt: %d tokens reused from the KV cache, %d computed]", &reused, &computed) == 2) {
            if (turns++ == 0)
                first_reused = reused;
            else
                reused_later = reused;
            assert_true(computed > 0);
        }
    }
    assert_int_equal(pclose(p), 0);
    assert_int_equal(turns, 2);
    assert_int_equal(first_reused, 0);
    assert_true(reused_later > 10);
    n = snprintf(cmd, sizeof cmd, "'%s' chat -m '%s' --chat-template jinja </dev/null 2>&1", bin, model);
    assert_true(n > 0 && (size_t)n < sizeof cmd);
    p = popen(cmd, "r");
    assert_non_null(p);
    assert_non_null(fgets(line, sizeof line, p));
    assert_non_null(strstr(line, "chatml, llama3, llama2, mistral, zephyr, gemma, phi3"));
    assert_int_not_equal(pclose(p), 0);
}

/* A byte-level BPE vocabulary written to a temporary GGUF and loaded: the
 * 256 byte-level characters, then extra[] (control tokens from ctrl_from
 * on), the merges, eos_token_id eos. */
static struct tokenizer *bpe_vocab(const char *const *extra, int n_extra, int ctrl_from, const char *const *merges,
                                   int n_merges, int eos)
{
    enum { MAX = 256 + 16 };
    assert_true(n_extra <= MAX - 256);
    char *strs[MAX];
    char chars[256][4];
    uint64_t lens[MAX];
    int n = 0;
    for (int b = 0; b < 256; b++) {
        int cp = b;
        if (!((b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae)))
            cp = 256 + (b <= 0x20 ? b : b <= 0xa0 ? 33 + b - 0x7f : 67);
        int l = cp < 0x80 ? (chars[b][0] = (char)cp, 1)
                          : (chars[b][0] = (char)(0xc0 | cp >> 6), chars[b][1] = (char)(0x80 | (cp & 63)), 2);
        strs[n] = chars[b];
        lens[n++] = (uint64_t)l;
    }
    for (int i = 0; i < n_extra; i++) {
        strs[n] = (char *)extra[i];
        lens[n++] = strlen(extra[i]);
    }
    int32_t types[MAX];
    for (int i = 0; i < n; i++)
        types[i] = i >= 256 + ctrl_from ? 3 : 1;
    char path[] = "/tmp/kvserve-tok-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    struct gguf_writer *w = NULL;
    assert_int_equal(gguf_writer_create(&w), KS_OK);
    assert_int_equal(gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2"), KS_OK);
    assert_int_equal(gguf_writer_set_str(w, "tokenizer.ggml.pre", "no-such-pre"), KS_OK);
    assert_int_equal(gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", (const char *const *)strs, lens, (uint64_t)n),
                     KS_OK);
    assert_int_equal(gguf_writer_set_arr(w, "tokenizer.ggml.token_type", GGUF_TYPE_INT32, types, (uint64_t)n), KS_OK);
    assert_int_equal(gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", merges, NULL, (uint64_t)n_merges), KS_OK);
    assert_int_equal(gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", (uint32_t)eos), KS_OK);
    assert_int_equal(gguf_writer_write(w, path), KS_OK);
    gguf_writer_free(w);
    struct tokenizer *t = load_vocab(path);
    unlink(path);
    assert_non_null(t);
    return t;
}

/* A hand-made byte-level BPE vocabulary: merges apply by rank, and an
 * unknown tokenizer.ggml.pre falls back to "default". */
static void test_synthetic_bpe(void **state)
{
    (void)state;
    const char *extra[] = {"\xc4\xa0t", "he", "\xc4\xa0the", "<|end|>"};
    const char *merges[] = {"h e", "\xc4\xa0 t", "\xc4\xa0t he"};
    struct tokenizer *t = bpe_vocab(extra, 4, 3, merges, 3, 259);
    assert_string_equal(tok_pre_name(t), "default");
    assert_int_equal(tok_family(t), TOK_FAMILY_BPE);
    assert_false(tok_special(t)->add_bos);
    assert_true(tok_is_eog(t, 259));
    int32_t *ids = NULL;
    size_t n_ids = 0;
    const char *text = "the the<|end|>";
    assert_int_equal(tok_encode(t, text, strlen(text), TOK_ADD_SPECIAL | TOK_PARSE_SPECIAL, &ids, &n_ids), KS_OK);
    /* "the" -> t + he; " the" -> Ġthe; <|end|> whole */
    const int32_t want[] = {'t', 257, 258, 259};
    assert_int_equal(n_ids, 4);
    assert_memory_equal(ids, want, sizeof want);
    free(ids);
    assert_int_equal(tok_encode(t, text, strlen(text), 0, &ids, &n_ids), KS_OK);
    assert_int_equal(n_ids, 3 + 7); /* <|end|> as plain text: one token per byte */
    free(ids);
    tok_free(t);
}

/* The harmony vocabulary (gpt-oss, o200k_harmony): <|return|> and <|call|>
 * end a generation and <|end|>, which ends one message of several, does
 * not, as llama.cpp decides from the same token texts. */
static void test_harmony_eog(void **state)
{
    (void)state;
    const char *extra[] = {"<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>",
                           "<|endoftext|>"};
    struct tokenizer *t = bpe_vocab(extra, 7, 0, NULL, 0, 256 + 4);
    assert_true(tok_is_eog(t, 256 + 4));  /* <|return|> */
    assert_true(tok_is_eog(t, 256 + 5));  /* <|call|> */
    assert_true(tok_is_eog(t, 256 + 6));  /* <|endoftext|> */
    assert_false(tok_is_eog(t, 256 + 1)); /* <|end|> */
    assert_false(tok_is_eog(t, 256 + 0));
    tok_free(t);
    /* without <|call|>, <|end|> stays an end of generation (Phi-3's end of turn) */
    t = bpe_vocab(extra, 5, 0, NULL, 0, 256 + 4);
    assert_true(tok_is_eog(t, 256 + 1));
    tok_free(t);
}

/* Fill-in-the-middle tokens found by their texts as llama.cpp finds them
 * (Qwen's names here); pad, repo and file separator end a generation, the
 * three that frame the prompt do not. */
static void test_fim_tokens(void **state)
{
    (void)state;
    const char *extra[] = {"<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>",
                           "<|file_sep|>", "<|endoftext|>"};
    struct tokenizer *t = bpe_vocab(extra, 7, 0, NULL, 0, 256 + 6);
    const struct tok_special *sp = tok_special(t);
    assert_int_equal(sp->fim_pre, 256);
    assert_int_equal(sp->fim_suf, 257);
    assert_int_equal(sp->fim_mid, 258);
    assert_int_equal(sp->fim_pad, 259);
    assert_int_equal(sp->fim_rep, 260);
    assert_int_equal(sp->fim_sep, 261);
    for (int32_t i = 256; i < 259; i++)
        assert_false(tok_is_eog(t, i));
    for (int32_t i = 259; i < 263; i++)
        assert_true(tok_is_eog(t, i));
    assert_true(tok_is_control(t, 256));
    tok_free(t);
    t = bpe_vocab(extra + 6, 1, 0, NULL, 0, 256);
    assert_int_equal(tok_special(t)->fim_pre, -1);
    assert_int_equal(tok_special(t)->fim_sep, -1);
    tok_free(t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_synthetic_bpe),
        cmocka_unit_test(test_harmony_eog),
        cmocka_unit_test(test_fim_tokens),
        cmocka_unit_test(test_cli_tokenize),
        cmocka_unit_test(test_cli_chat),
        cmocka_unit_test(test_stories260k),
        cmocka_unit_test(test_vocab_vectors),
    };
    return ks_run_tests(tests, NULL, NULL);
}
