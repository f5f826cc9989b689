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

#include <cmocka.h>

#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"

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

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf) {
        buf[n] = 0;
        *len = (size_t)n;
    }
    return buf;
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
    char *inp = join_path(path, sizeof path, dir, name, ".inp") ? read_file(path, &inp_len) : NULL;
    char *out = join_path(path, sizeof path, dir, name, ".out") ? read_file(path, &out_len) : NULL;
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
    if (n < 0) {
        print_message("no %s: skipping the vocabulary vectors\n", dir);
        skip();
    }
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
    assert_int_equal(failed, 0);
}

static void test_stories260k(void **state)
{
    (void)state;
    char path[1024];
    snprintf(path, sizeof path, "%s/models/stories260K.gguf", shared_dir());
    if (!file_exists(path)) {
        print_message("no %s: skipping\n", path);
        skip();
    }
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
        !file_exists(model) || !file_exists(bin)) {
        print_message("no KVSERVE_BIN or stories260K.gguf: skipping\n");
        skip();
    }
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
        !file_exists(model) || !file_exists(bin)) {
        print_message("no KVSERVE_BIN or stories260K.gguf: skipping\n");
        skip();
    }
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cli_tokenize),
        cmocka_unit_test(test_cli_chat),
        cmocka_unit_test(test_stories260k),
        cmocka_unit_test(test_vocab_vectors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
