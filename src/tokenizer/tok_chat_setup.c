/* tokenizer: the chat template setup that kvserve serve and kvserve chat
 * share (tokenizer.h: tok_chat_setup). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja/jinja.h"
#include "tokenizer/tok_internal.h"

static ks_status parse_jinja(struct tok_chat_setup *s, const char *origin)
{
    if (!jinja_parse(s->src, s->len, &s->jt))
        return KS_OK;
    char why[512]; /* ks_fail formats into the buffer ks_errmsg() reads */
    snprintf(why, sizeof why, "%s", ks_errmsg());
    return ks_fail(KS_ERR_FORMAT, "%s does not parse: %s (fix it, or give --chat-template-file F or "
                   "--chat-template NAME)", origin, why);
}

static ks_status setup(const struct tokenizer *t, const char *family_name, const char *text, size_t len,
                       const char *origin, struct tok_chat_setup *s)
{
    if (family_name) {
        s->by_family = true;
        return tok_chat_by_name(family_name, &s->family);
    }
    if (text) {
        s->src = text;
        s->len = len;
        origin = origin ? origin : "the chat template";
    } else if ((s->src = tok_chat_template(t, &s->len))) {
        origin = "the model's tokenizer.chat_template";
    } else {
        s->src = jinja_chatml_template;
        s->len = strlen(s->src);
        s->chatml_fallback = true;
        origin = "the built-in chatml template";
    }
    ks_status st = parse_jinja(s, origin);
    if (st)
        return st;
    const struct tok_special *sp = tok_special(t);
    s->bos_text = tok_text_dup(t, sp->bos);
    s->eos_text = tok_text_dup(t, sp->eos);
    return s->bos_text && s->eos_text ? KS_OK : ks_fail(KS_ERR_NOMEM, "out of memory for the BOS and EOS texts");
}

ks_status tok_chat_setup(const struct tokenizer *t, const char *family_name, const char *text, size_t len,
                         const char *origin, struct tok_chat_setup *out)
{
    *out = (struct tok_chat_setup){0};
    ks_status st = setup(t, family_name, text, len, origin, out);
    if (st)
        tok_chat_setup_free(out);
    return st;
}

void tok_chat_setup_free(struct tok_chat_setup *s)
{
    jinja_free(s->jt);
    free(s->bos_text);
    free(s->eos_text);
    *s = (struct tok_chat_setup){0};
}
