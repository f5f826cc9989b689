/* tok_check_same_vocab: a draft model's vocabulary against its target's. */
#include <stdio.h>
#include <string.h>

#include "tokenizer/tokenizer.h"

enum { SHOW_BYTES = 40 }; /* of a token's text in a message */

/* A token's text for a message, quoted: at most SHOW_BYTES bytes, control
 * bytes as '?'; "none" past the vocabulary. */
static void shown(const struct tokenizer *t, int32_t id, char *out, size_t cap)
{
    const char *text = "";
    size_t len = 0;
    if (id >= tok_n_vocab(t) || tok_text(t, id, &text, &len) != KS_OK) {
        snprintf(out, cap, "none");
        return;
    }
    size_t n = len < cap - 3 ? len : cap - 3, o = 0;
    out[o++] = '\'';
    for (size_t i = 0; i < n; i++)
        out[o++] = (unsigned char)text[i] < 0x20 ? '?' : text[i];
    out[o++] = '\'';
    out[o] = '\0';
}

static ks_status check_special(const struct tokenizer *target, const struct tokenizer *draft)
{
    const struct tok_special *a = tok_special(target), *b = tok_special(draft);
    if (a->add_bos != b->add_bos || (a->add_bos && a->bos != b->bos))
        return ks_fail(KS_ERR_INVALID_ARG,
                       "--model-draft: the draft model's BOS differs from the target's (add_bos %d vs %d, BOS id %d vs %d)",
                       b->add_bos, a->add_bos, (int)b->bos, (int)a->bos);
    if (a->add_eos != b->add_eos || (a->add_eos && a->eos != b->eos))
        return ks_fail(KS_ERR_INVALID_ARG,
                       "--model-draft: the draft model's EOS differs from the target's (add_eos %d vs %d, EOS id %d vs %d)",
                       b->add_eos, a->add_eos, (int)b->eos, (int)a->eos);
    return KS_OK;
}

ks_status tok_check_same_vocab(const struct tokenizer *target, const struct tokenizer *draft)
{
    if (tok_family(target) != tok_family(draft))
        return ks_fail(KS_ERR_INVALID_ARG, "--model-draft: the draft model's tokenizer is of another kind than the target's");
    ks_status st = check_special(target, draft);
    if (st)
        return st;
    int32_t n_target = tok_n_vocab(target), n_draft = tok_n_vocab(draft);
    int32_t n = n_target < n_draft ? n_target : n_draft, id = 0;
    for (; id < n; id++) {
        const char *ta = NULL, *tb = NULL;
        size_t la = 0, lb = 0;
        if (tok_text(target, id, &ta, &la) || tok_text(draft, id, &tb, &lb) || la != lb || memcmp(ta, tb, la))
            break;
    }
    if (id == n && n_target == n_draft)
        return KS_OK;
    char a[SHOW_BYTES + 3], b[SHOW_BYTES + 3];
    shown(target, id, a, sizeof a);
    shown(draft, id, b, sizeof b);
    return ks_fail(KS_ERR_INVALID_ARG,
                   "--model-draft: the draft model's vocabulary (%d tokens) differs from the target's (%d tokens): "
                   "first at token %d, %s in the target, %s in the draft",
                   (int)n_draft, (int)n_target, (int)id, a, b);
}
