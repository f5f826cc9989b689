/* tokenizer: chat templates. A GGUF's Jinja template is recognised by the
 * markers it writes and rendered by hand-written code per family, as
 * llama.cpp's built-in templates do; no Jinja is interpreted. */
#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#include "sbuf/sbuf.h"
#include "tokenizer/tok_internal.h"

static const char *const family_names[TOK_CHAT_COUNT] = {
    [TOK_CHAT_CHATML] = "chatml", [TOK_CHAT_LLAMA3] = "llama3", [TOK_CHAT_LLAMA2] = "llama2",
    [TOK_CHAT_MISTRAL] = "mistral", [TOK_CHAT_ZEPHYR] = "zephyr", [TOK_CHAT_GEMMA] = "gemma",
    [TOK_CHAT_PHI3] = "phi3",
};

static const struct {
    const char *alias;
    enum tok_chat_family fam;
} aliases[] = {
    {"llama-3", TOK_CHAT_LLAMA3}, {"llama-2", TOK_CHAT_LLAMA2}, {"tinyllama", TOK_CHAT_ZEPHYR},
    {"phi-3", TOK_CHAT_PHI3},     {"qwen", TOK_CHAT_CHATML},   {"smollm", TOK_CHAT_CHATML},
};

const char *tok_chat_name(enum tok_chat_family fam)
{
    return (unsigned)fam < TOK_CHAT_COUNT ? family_names[fam] : "?";
}

const char *tok_chat_names(void) { return "chatml, llama3, llama2, mistral, zephyr, gemma, phi3"; }

ks_status tok_chat_by_name(const char *name, enum tok_chat_family *out)
{
    if (!name || !out)
        return ks_fail(KS_ERR_INVALID_ARG, "tok_chat_by_name: NULL argument");
    for (int i = 0; i < TOK_CHAT_COUNT; i++)
        if (!strcmp(name, family_names[i])) {
            *out = (enum tok_chat_family)i;
            return KS_OK;
        }
    for (size_t i = 0; i < sizeof aliases / sizeof aliases[0]; i++)
        if (!strcmp(name, aliases[i].alias)) {
            *out = aliases[i].fam;
            return KS_OK;
        }
    return ks_fail(KS_ERR_NOT_FOUND, "unknown chat template '%s'; supported: %s", name, tok_chat_names());
}

/* tmpl may be NULL when len is 0 (an empty template), which memmem may not be given. */
static bool has(const char *tmpl, size_t len, const char *marker)
{
    size_t n = strlen(marker);
    return len >= n && memmem(tmpl, len, marker, n) != NULL;
}

ks_status tok_chat_detect(const char *tmpl, size_t len, enum tok_chat_family *out)
{
    if ((!tmpl && len) || !out)
        return ks_fail(KS_ERR_INVALID_ARG, "tok_chat_detect: NULL argument");
    enum tok_chat_family fam;
    if (has(tmpl, len, "<|im_start|>"))
        fam = TOK_CHAT_CHATML;
    else if (has(tmpl, len, "<|start_header_id|>") && has(tmpl, len, "<|end_header_id|>"))
        fam = TOK_CHAT_LLAMA3;
    else if (has(tmpl, len, "<|assistant|>") && has(tmpl, len, "<|end|>"))
        fam = TOK_CHAT_PHI3;
    else if (has(tmpl, len, "<|user|>") && has(tmpl, len, "<|assistant|>"))
        fam = TOK_CHAT_ZEPHYR;
    else if (has(tmpl, len, "<start_of_turn>"))
        fam = TOK_CHAT_GEMMA;
    else if (has(tmpl, len, "[INST]"))
        fam = has(tmpl, len, "<<SYS>>") ? TOK_CHAT_LLAMA2 : TOK_CHAT_MISTRAL;
    else
        return ks_fail(KS_ERR_UNSUPPORTED,
                       "the model's chat template is not one kvserve recognises (full Jinja is not supported); "
                       "pick one with --chat-template NAME, NAME one of: %s",
                       tok_chat_names());
    *out = fam;
    return KS_OK;
}

ks_status tok_chat_for(const struct tokenizer *t, const char *override_name, enum tok_chat_family *out)
{
    if (override_name)
        return tok_chat_by_name(override_name, out);
    if (!t || !t->chat_template) {
        if (!out)
            return ks_fail(KS_ERR_INVALID_ARG, "tok_chat_for: NULL argument");
        *out = TOK_CHAT_CHATML;
        return KS_OK;
    }
    return tok_chat_detect(t->chat_template, t->chat_template_len, out);
}

const char *tok_chat_template(const struct tokenizer *t, size_t *len)
{
    if (len)
        *len = t && t->chat_template ? t->chat_template_len : 0;
    return t ? t->chat_template : NULL;
}

/* ---- rendering ---------------------------------------------------------- */

static void put_trimmed(struct sbuf *b, const char *s)
{
    size_t n = strlen(s);
    while (n && isspace((unsigned char)*s))
        s++, n--;
    while (n && isspace((unsigned char)s[n - 1]))
        n--;
    sbuf_append(b, s, n);
}

enum role { ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT };

static void render_chatml(struct sbuf *b, const struct tok_chat_msg *m, size_t n, bool gen)
{
    for (size_t i = 0; i < n; i++) {
        sbuf_puts(b, "<|im_start|>");
        sbuf_puts(b, m[i].role);
        sbuf_puts(b, "\n");
        sbuf_puts(b, m[i].content);
        sbuf_puts(b, "<|im_end|>\n");
    }
    if (gen)
        sbuf_puts(b, "<|im_start|>assistant\n");
}

static void render_llama3(struct sbuf *b, const struct tok_chat_msg *m, size_t n, bool gen)
{
    for (size_t i = 0; i < n; i++) {
        sbuf_puts(b, "<|start_header_id|>");
        sbuf_puts(b, m[i].role);
        sbuf_puts(b, "<|end_header_id|>\n\n");
        put_trimmed(b, m[i].content);
        sbuf_puts(b, "<|eot_id|>");
    }
    if (gen)
        sbuf_puts(b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

/* [INST] families: llama2 wraps the system prompt in <<SYS>> and starts
 * every later turn with <s>; mistral puts it in the user turn. */
static void render_inst(struct sbuf *b, const struct tok_chat_msg *m, const enum role *r, size_t n, bool llama2)
{
    bool inside_turn = true;
    sbuf_puts(b, "[INST] ");
    for (size_t i = 0; i < n; i++) {
        if (!inside_turn) {
            inside_turn = true;
            sbuf_puts(b, llama2 ? "<s>[INST] " : "[INST] ");
        }
        if (r[i] == ROLE_SYSTEM) {
            sbuf_puts(b, llama2 ? "<<SYS>>\n" : "");
            put_trimmed(b, m[i].content);
            sbuf_puts(b, llama2 ? "\n<</SYS>>\n\n" : "\n\n");
        } else if (r[i] == ROLE_USER) {
            put_trimmed(b, m[i].content);
            sbuf_puts(b, " [/INST]");
        } else {
            put_trimmed(b, m[i].content);
            sbuf_puts(b, "</s>");
            inside_turn = false;
        }
    }
}

static void render_zephyr(struct sbuf *b, const struct tokenizer *t, const struct tok_chat_msg *m, size_t n,
                          bool gen)
{
    const char *eos = "</s>";
    size_t eos_len = 4;
    if (t && t->sp.eos >= 0) {
        eos = tok_text_of(t, t->sp.eos);
        eos_len = t->tokens[t->sp.eos].text_len;
    }
    for (size_t i = 0; i < n; i++) {
        sbuf_puts(b, "<|");
        sbuf_puts(b, m[i].role);
        sbuf_puts(b, "|>\n");
        sbuf_puts(b, m[i].content);
        sbuf_append(b, eos, eos_len);
        sbuf_puts(b, "\n");
    }
    if (gen)
        sbuf_puts(b, "<|assistant|>\n");
}

static void render_gemma(struct sbuf *b, const struct tok_chat_msg *m, const enum role *r, size_t n, bool gen)
{
    const char *system = NULL;
    for (size_t i = 0; i < n; i++) {
        if (r[i] == ROLE_SYSTEM) {
            system = m[i].content;
            continue;
        }
        sbuf_puts(b, r[i] == ROLE_ASSISTANT ? "<start_of_turn>model\n" : "<start_of_turn>user\n");
        if (system && r[i] == ROLE_USER) {
            put_trimmed(b, system);
            sbuf_puts(b, "\n\n");
            system = NULL;
        }
        put_trimmed(b, m[i].content);
        sbuf_puts(b, "<end_of_turn>\n");
    }
    if (gen)
        sbuf_puts(b, "<start_of_turn>model\n");
}

static void render_phi3(struct sbuf *b, const struct tok_chat_msg *m, size_t n, bool gen)
{
    for (size_t i = 0; i < n; i++) {
        sbuf_puts(b, "<|");
        sbuf_puts(b, m[i].role);
        sbuf_puts(b, "|>\n");
        sbuf_puts(b, m[i].content);
        sbuf_puts(b, "<|end|>\n");
    }
    if (gen)
        sbuf_puts(b, "<|assistant|>\n");
}

static ks_status parse_roles(const struct tok_chat_msg *m, size_t n, enum role *r)
{
    for (size_t i = 0; i < n; i++) {
        if (!m[i].role || !m[i].content)
            return ks_fail(KS_ERR_INVALID_ARG, "chat message %zu has no role or content", i);
        if (!strcmp(m[i].role, "system"))
            r[i] = ROLE_SYSTEM;
        else if (!strcmp(m[i].role, "user"))
            r[i] = ROLE_USER;
        else if (!strcmp(m[i].role, "assistant"))
            r[i] = ROLE_ASSISTANT;
        else
            return ks_fail(KS_ERR_INVALID_ARG, "chat message %zu: role '%s' is not system, user or assistant", i,
                           m[i].role);
    }
    return KS_OK;
}

ks_status tok_chat_render(const struct tokenizer *t, enum tok_chat_family fam, const struct tok_chat_msg *msgs,
                          size_t n, bool add_generation_prompt, char **out)
{
    if (!out || (!msgs && n))
        return ks_fail(KS_ERR_INVALID_ARG, "tok_chat_render: NULL argument");
    if ((unsigned)fam >= TOK_CHAT_COUNT)
        return ks_fail(KS_ERR_INVALID_ARG, "tok_chat_render: bad template family %d", (int)fam);
    enum role *roles = malloc((n ? n : 1) * sizeof *roles);
    if (!roles)
        return ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory");
    ks_status st = parse_roles(msgs, n, roles);
    struct sbuf b = {0};
    sbuf_puts(&b, "");
    if (!st) {
        bool gen = add_generation_prompt;
        switch (fam) {
        case TOK_CHAT_CHATML: render_chatml(&b, msgs, n, gen); break;
        case TOK_CHAT_LLAMA3: render_llama3(&b, msgs, n, gen); break;
        case TOK_CHAT_LLAMA2: render_inst(&b, msgs, roles, n, true); break;
        case TOK_CHAT_MISTRAL: render_inst(&b, msgs, roles, n, false); break;
        case TOK_CHAT_ZEPHYR: render_zephyr(&b, t, msgs, n, gen); break;
        case TOK_CHAT_GEMMA: render_gemma(&b, msgs, roles, n, gen); break;
        case TOK_CHAT_PHI3: render_phi3(&b, msgs, n, gen); break;
        default: break;
        }
    }
    free(roles);
    if (!st && b.oom)
        st = ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory rendering the chat");
    if (st) {
        free(b.p);
        return st;
    }
    *out = b.p;
    return KS_OK;
}
