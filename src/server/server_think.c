/* Reasoning in <think>...</think> (Qwen3, DeepSeek-R1, QwQ and the like)
 * split from the answer, as llama.cpp's reasoning parser does: after
 * optional whitespace the output opens "<think>" (or the prompt's generation
 * prompt already opened it: the output starts inside), the reasoning runs to
 * "</think>" and is stripped of surrounding whitespace, and the content
 * starts after the whitespace that follows "</think>". Output that does not
 * start with "<think>" is all content. A reasoning that never closes (cut by
 * max_tokens) is reasoning. One difference: whitespace before "<think>" is
 * dropped instead of being kept as content, so that the content is one
 * range of the text. The parse is a pure function of the text so far; a tail
 * that may still become a tag, and trailing whitespace of an open reasoning,
 * are held back until the final parse. */
#include "server/server_internal.h"

#include <string.h>

#define THINK_OPEN "<think>"
#define THINK_CLOSE "</think>"

bool server_think_template(const char *tmpl, size_t len)
{
    return tmpl && memmem(tmpl, len, THINK_OPEN, strlen(THINK_OPEN)) &&
           memmem(tmpl, len, THINK_CLOSE, strlen(THINK_CLOSE));
}

bool server_think_prompt_open(const char *prompt, size_t len)
{
    while (len > 0 && strchr(" \t\r\n", prompt[len - 1]))
        len--;
    size_t l = strlen(THINK_OPEN);
    return len >= l && !memcmp(prompt + len - l, THINK_OPEN, l);
}

static bool is_space(char ch) { return ch == ' ' || ch == '\t' || ch == '\r' || ch == '\n'; }

static size_t skip_space(const char *s, size_t i, size_t n)
{
    while (i < n && is_space(s[i]))
        i++;
    return i;
}

/* How many bytes at the end of s[0..n) are a proper prefix of lit. */
static size_t partial_suffix(const char *s, size_t n, const char *lit)
{
    size_t l = strlen(lit);
    for (size_t k = n < l - 1 ? n : l - 1; k > 0; k--)
        if (!memcmp(s + n - k, lit, k))
            return k;
    return 0;
}

/* r gets text[from..to) stripped of surrounding whitespace as the reasoning. */
static void set_reasoning(const char *text, size_t from, size_t to, struct server_think *r)
{
    from = skip_space(text, from, to);
    while (to > from && is_space(text[to - 1]))
        to--;
    r->reasoning_start = from;
    r->reasoning_end = to;
}

void server_think_parse(const char *text, size_t n, bool open, bool final, struct server_think *r)
{
    *r = (struct server_think){.content_start = final ? 0 : n};
    size_t at = skip_space(text, 0, n);
    size_t l = strlen(THINK_OPEN);
    size_t rest = n - at;
    bool opens = rest >= l && !memcmp(text + at, THINK_OPEN, l);
    if (!open && !opens) {
        bool may_open = rest < l && !memcmp(text + at, THINK_OPEN, rest); /* also all whitespace */
        if (final || !may_open)
            r->content_start = 0;
        return;
    }
    r->reasoning = true;
    if (opens)
        at += l;
    const char *close = memmem(text + at, n - at, THINK_CLOSE, strlen(THINK_CLOSE));
    if (!close) {
        size_t end = final ? n : n - partial_suffix(text + at, n - at, THINK_CLOSE);
        set_reasoning(text, at, end, r);
        r->content_start = n;
        return;
    }
    size_t close_at = (size_t)(close - text);
    set_reasoning(text, at, close_at, r);
    r->closed = true;
    r->content_start = skip_space(text, close_at + strlen(THINK_CLOSE), n);
}

bool server_reasoning_format_parse(const char *name, enum server_reasoning_format *out)
{
    static const char *const names[] = {[SERVER_REASONING_AUTO] = "auto", [SERVER_REASONING_NONE] = "none",
                                        [SERVER_REASONING_DEEPSEEK] = "deepseek"};
    for (int i = 0; name && i < (int)(sizeof names / sizeof names[0]); i++)
        if (!strcmp(name, names[i])) {
            *out = (enum server_reasoning_format)i;
            return true;
        }
    return false;
}
