/* libFuzzer harness for the chat templates (tokenizer/tok_chat.c): family
 * detection from an arbitrary template text, lookup by name, and rendering
 * arbitrary messages in every family, then tokenizing the result the way the
 * server does (TOK_ADD_SPECIAL | TOK_PARSE_SPECIAL).
 *
 * Input: byte 0: bit 0 add_generation_prompt, bit 1 render with a tokenizer
 * (zephyr takes its EOS text from it) or with none, bits 2-7 the family whose
 * rendering is also tokenized. The rest is split at NUL
 * bytes: the first piece is the template text (detected; also tried as a
 * name), then pairs of role and content. A one-byte role picks system, user,
 * assistant or developer (which the renderer must refuse); a longer role is
 * used as it is.
 *
 * Oracle: detection succeeds only on a text holding its family's marker and
 * the family's name maps back to it; rendering succeeds exactly when every role
 * is system/user/assistant, and the output holds every message's content
 * (trimmed of white space; gemma drops a system turn no user turn follows),
 * and tokenizes to ids in the vocabulary. */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz/fuzz_vocab.h"

#define MAX_MSGS 64

static struct tokenizer *tok;

static void check(bool ok, const char *what)
{
    if (!ok) {
        fprintf(stderr, "fuzz_chat: %s (last error: %s)\n", what, ks_errmsg());
        abort();
    }
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    tok = fuzz_load_vocab("ggml-vocab-llama3.gguf");
    return 0;
}

static const char *const markers[TOK_CHAT_COUNT] = {
    [TOK_CHAT_CHATML] = "<|im_start|>",       [TOK_CHAT_LLAMA3] = "<|start_header_id|>",
    [TOK_CHAT_LLAMA2] = "<<SYS>>",            [TOK_CHAT_MISTRAL] = "[INST]",
    [TOK_CHAT_ZEPHYR] = "<|user|>",           [TOK_CHAT_GEMMA] = "<start_of_turn>",
    [TOK_CHAT_PHI3] = "<|end|>",
};

static void fuzz_detect(const uint8_t *data, size_t len)
{
    char *tmpl = malloc(len + 1); /* the detector gets exactly len bytes; by_name the C string */
    check(tmpl != NULL, "malloc");
    memcpy(tmpl, data, len);
    enum tok_chat_family fam = TOK_CHAT_COUNT;
    if (tok_chat_detect(len ? tmpl : NULL, len, &fam) == KS_OK) {
        check((unsigned)fam < TOK_CHAT_COUNT, "detected family in range");
        check(memmem(tmpl, len, markers[fam], strlen(markers[fam])) != NULL, "detected family's marker is present");
        enum tok_chat_family back;
        check(tok_chat_by_name(tok_chat_name(fam), &back) == KS_OK && back == fam, "name round trip");
    } else {
        check(ks_errmsg()[0] != '\0', "detection failure has a message");
    }
    tmpl[len] = '\0';
    if (tok_chat_by_name(tmpl, &fam) == KS_OK)
        check((unsigned)fam < TOK_CHAT_COUNT, "named family in range");
    free(tmpl);
}

/* s with leading and trailing white space (isspace) removed, in place. */
static const char *trimmed(const char *s, size_t *len)
{
    size_t n = strlen(s);
    while (n && isspace((unsigned char)*s))
        s++, n--;
    while (n && isspace((unsigned char)s[n - 1]))
        n--;
    *len = n;
    return s;
}

static bool known_role(const char *r) { return !strcmp(r, "system") || !strcmp(r, "user") || !strcmp(r, "assistant"); }

static void fuzz_render(enum tok_chat_family fam, const struct tokenizer *t, const struct tok_chat_msg *m, size_t n,
                        bool gen, bool encode)
{
    bool all_known = true;
    for (size_t i = 0; i < n; i++)
        all_known = all_known && known_role(m[i].role);
    char *out = NULL;
    ks_status st = tok_chat_render(t, fam, m, n, gen, &out);
    if (!all_known) {
        check(st == KS_ERR_INVALID_ARG && out == NULL, "an unknown role is KS_ERR_INVALID_ARG");
        return;
    }
    check(st == KS_OK && out != NULL, "rendering known roles succeeds");
    for (size_t i = 0; i < n; i++) {
        if (fam == TOK_CHAT_GEMMA && !strcmp(m[i].role, "system")) {
            bool user_follows = false;
            for (size_t k = i + 1; k < n && !user_follows; k++)
                user_follows = !strcmp(m[k].role, "user");
            bool later_system = false;
            for (size_t k = i + 1; k < n && !later_system && strcmp(m[k].role, "user"); k++)
                later_system = !strcmp(m[k].role, "system");
            if (!user_follows || later_system)
                continue;
        }
        size_t len;
        const char *c = trimmed(m[i].content, &len);
        check(memmem(out, strlen(out), c, len) != NULL, "the output holds every content");
    }
    if (!encode) {
        free(out);
        return;
    }
    int32_t *ids = NULL;
    size_t n_ids = 0;
    check(tok_encode(tok, out, strlen(out), TOK_ADD_SPECIAL | TOK_PARSE_SPECIAL, &ids, &n_ids) == KS_OK,
          "the rendered chat tokenizes");
    for (size_t i = 0; i < n_ids; i++)
        check(ids[i] >= 0 && ids[i] < tok_n_vocab(tok), "rendered ids in the vocabulary");
    free(ids);
    free(out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    bool gen = data[0] & 1;
    const struct tokenizer *t = data[0] & 2 ? tok : NULL;
    int tokenized = (data[0] >> 2) % TOK_CHAT_COUNT; /* tokenizing is the slow part: one family per input */
    data++, size--;

    const uint8_t *nul = memchr(data, 0, size);
    size_t tlen = nul ? (size_t)(nul - data) : size;
    fuzz_detect(data, tlen);

    /* the rest as NUL-terminated pieces: role, content, role, content, ... */
    size_t rest = nul ? size - tlen - 1 : 0;
    char *buf = malloc(rest + 1);
    check(buf != NULL, "malloc");
    memcpy(buf, nul ? nul + 1 : data, rest);
    buf[rest] = '\0';
    static const char *const roles[] = {"system", "user", "assistant", "developer"};
    struct tok_chat_msg m[MAX_MSGS];
    size_t n = 0;
    char *p = buf, *end = buf + rest;
    while (n < MAX_MSGS && p < end) {
        char *role = p;
        p += strlen(p) + 1;
        m[n].role = strlen(role) == 1 ? roles[(unsigned char)role[0] % 4] : role;
        m[n].content = p < end ? p : "";
        if (p < end)
            p += strlen(p) + 1;
        n++;
    }
    for (int fam = 0; fam < TOK_CHAT_COUNT; fam++)
        fuzz_render((enum tok_chat_family)fam, t, m, n, gen, fam == tokenized);
    free(buf);
    return 0;
}
