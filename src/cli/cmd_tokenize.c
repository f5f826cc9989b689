/* kvserve tokenize: print the tokens of a text under a model's vocabulary
 * (any GGUF with tokenizer metadata, vocab-only files included). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"

static void tokenize_usage(FILE *out)
{
    fprintf(out,
            "usage: kvserve tokenize [-m MODEL.gguf] (-p TEXT | -f FILE) [--no-special] [--ids]\n"
            "\n"
            "Print one line per token: its id, then its piece in quotes (control bytes\n"
            "escaped). BOS/EOS are added when the vocabulary adds them.\n"
            "\n"
            "  -m, --model PATH   GGUF model or vocabulary (default: the built-in default model)\n"
            "  -p, --prompt TEXT  text to tokenize\n"
            "  -f, --file FILE    read the text from FILE ('-' for stdin)\n"
            "      --no-special   treat control-token text such as <|im_start|> as plain text\n"
            "      --ids          print only the ids, space-separated on one line\n");
}

static char *read_stream(FILE *f, size_t *len)
{
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap)
            break;
        char *p = realloc(buf, cap * 2);
        if (!p) {
            free(buf);
            return NULL;
        }
        buf = p;
        cap *= 2;
    }
    if (buf && ferror(f)) {
        free(buf);
        return NULL;
    }
    *len = n;
    return buf;
}

static char *read_text(const char *path, size_t *len)
{
    if (!strcmp(path, "-"))
        return read_stream(stdin, len);
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    char *buf = read_stream(f, len);
    fclose(f);
    return buf;
}

static void print_piece(const char *p, size_t n)
{
    putchar('\'');
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)p[i];
        if (c == '\n')
            fputs("\\n", stdout);
        else if (c == '\t')
            fputs("\\t", stdout);
        else if (c == '\r')
            fputs("\\r", stdout);
        else if (c == '\\' || c == '\'')
            printf("\\%c", c);
        else if (c < 0x20 || c == 0x7f)
            printf("\\x%02x", c);
        else
            putchar(c);
    }
    puts("'");
}

static int print_tokens(const struct tokenizer *t, const int32_t *ids, size_t n, bool only_ids)
{
    for (size_t i = 0; i < n; i++) {
        if (only_ids) {
            printf(i ? " %d" : "%d", ids[i]);
            continue;
        }
        const char *p;
        size_t len;
        if (tok_piece(t, ids[i], &p, &len))
            return 1;
        printf("%6d -> ", ids[i]);
        print_piece(p, len);
    }
    if (only_ids)
        putchar('\n');
    return 0;
}

int cli_tokenize(int argc, char **argv)
{
    const char *model = NULL, *prompt = NULL, *file = NULL;
    bool special = true, only_ids = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool has_value = i + 1 < argc;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            tokenize_usage(stdout);
            return 0;
        } else if ((!strcmp(a, "-m") || !strcmp(a, "--model")) && has_value) {
            model = argv[++i];
        } else if ((!strcmp(a, "-p") || !strcmp(a, "--prompt")) && has_value) {
            prompt = argv[++i];
        } else if ((!strcmp(a, "-f") || !strcmp(a, "--file")) && has_value) {
            file = argv[++i];
        } else if (!strcmp(a, "--no-special")) {
            special = false;
        } else if (!strcmp(a, "--ids")) {
            only_ids = true;
        } else {
            fprintf(stderr, "kvserve tokenize: unknown or incomplete option '%s'\n\n", a);
            tokenize_usage(stderr);
            return 2;
        }
    }
    if (!prompt == !file) {
        fprintf(stderr, "kvserve tokenize: give exactly one of -p TEXT or -f FILE\n\n");
        tokenize_usage(stderr);
        return 2;
    }
    char default_path[4096];
    if (!model) {
        if (!cli_default_model(default_path, sizeof default_path)) {
            fprintf(stderr, "kvserve tokenize: no -m MODEL and no built-in default model\n");
            return 2;
        }
        model = default_path;
    }
    size_t len = prompt ? strlen(prompt) : 0;
    char *text = file ? read_text(file, &len) : NULL;
    if (file && !text) {
        fprintf(stderr, "kvserve tokenize: cannot read %s\n", file);
        return 1;
    }
    struct gguf_file *f = NULL;
    struct tokenizer *t = NULL;
    int32_t *ids = NULL;
    size_t n = 0;
    int rc = 1;
    unsigned flags = TOK_ADD_SPECIAL | (special ? TOK_PARSE_SPECIAL : 0);
    if (gguf_open(model, &f) || tok_load(f, &t) || tok_encode(t, file ? text : prompt, len, flags, &ids, &n))
        fprintf(stderr, "kvserve tokenize: %s: %s\n", model, ks_errmsg());
    else
        rc = print_tokens(t, ids, n, only_ids);
    free(ids);
    tok_free(t);
    gguf_close(f);
    free(text);
    return rc;
}
