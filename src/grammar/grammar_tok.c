/* A grammar vocabulary from a tokenizer: each token's bytes as the
 * detokenizer writes them (tok_piece), end-of-generation tokens as EOG, and
 * control tokens, BOS, PAD and <unk> as special (never allowed). */
#include "grammar/grammar.h"
#include "tokenizer/tokenizer.h"

static ks_status tok_piece_kind(void *user, int32_t id, const char **bytes, size_t *len,
                                enum grammar_token_kind *kind)
{
    const struct tokenizer *t = user;
    const struct tok_special *sp = tok_special(t);
    if (tok_is_eog(t, id))
        *kind = GRAMMAR_TOKEN_EOG;
    else if (tok_is_control(t, id) || id == sp->bos || id == sp->pad || id == sp->unk)
        *kind = GRAMMAR_TOKEN_SPECIAL;
    else
        *kind = GRAMMAR_TOKEN_TEXT;
    return tok_piece(t, id, bytes, len);
}

ks_status grammar_vocab_from_tokenizer(const struct tokenizer *t, struct grammar_vocab **out)
{
    return grammar_vocab_create(tok_n_vocab(t), tok_piece_kind, (void *)t, out);
}
