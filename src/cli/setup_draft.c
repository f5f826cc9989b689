/* --model-draft: load a draft model, check its vocabulary and its room in
 * the KV budget, and configure its cache (setup.h). */
#include "cli/setup.h"

#include <string.h>

#include "tokenizer/tokenizer.h"

ks_status cli_draft_load(const struct cli_spec_flags *f, const struct cli_model_flags *load,
                         const struct tokenizer *target_tok, int32_t target_n_vocab, struct model **out)
{
    *out = NULL;
    struct model *m = NULL;
    ks_status st = cli_load_model(f->model_draft, load, &m);
    if (st)
        return ks_fail(st, "--model-draft %s: %s", f->model_draft, ks_errmsg());
    struct tokenizer *tok = NULL;
    if ((st = tok_load(model_gguf(m), &tok)))
        st = ks_fail(st, "--model-draft %s: its vocabulary: %s", f->model_draft, ks_errmsg());
    if (!st)
        st = tok_check_same_vocab(target_tok, tok);
    tok_free(tok);
    if (!st && model_hparams(m)->n_vocab != target_n_vocab)
        st = ks_fail(KS_ERR_INVALID_ARG, "--model-draft %s: the draft model gives %d logits per token, the target %d",
                     f->model_draft, model_hparams(m)->n_vocab, (int)target_n_vocab);
    if (st) {
        model_free(m);
        return st;
    }
    *out = m;
    return KS_OK;
}

void cli_draft_kv_config(const struct cli_spec_flags *f, struct model *draft, const struct kv_config *target,
                         int32_t ctx, struct kv_config *out)
{
    model_set_n_ctx(draft, ctx);
    model_kv_config(draft, out);
    struct kv_config shape = *out;
    *out = *target;
    out->n_layer = shape.n_layer;
    out->n_kv_head = shape.n_kv_head;
    out->head_dim = shape.head_dim;
    out->swa_window = shape.swa_window;
    memcpy(out->swa_layer, shape.swa_layer, sizeof out->swa_layer);
    memcpy(out->fingerprint, shape.fingerprint, sizeof out->fingerprint);
    struct kv_fit fit;
    out->type_k = out->type_v = target->floor;
    if (kv_fit_config(out, &fit) != KS_OK) { /* the floor's blocks do not divide its head size */
        out->type_k = target->type_k;
        out->type_v = target->type_v;
    }
    if (f->draft_type_k != QUANT_TYPE_COUNT)
        out->type_k = f->draft_type_k;
    if (f->draft_type_v != QUANT_TYPE_COUNT)
        out->type_v = f->draft_type_v;
}

ks_status cli_draft_check_fit(const struct kv_config *target, const struct kv_config *draft, int32_t ctx)
{
    size_t t = cli_kv_budget_for(target, ctx), d = cli_kv_budget_for(draft, ctx);
    if (t + d <= target->mem_budget)
        return KS_OK;
    const double MiB = 1 << 20;
    return ks_fail(KS_ERR_KV_FULL,
                   "--model-draft: one sequence of %d tokens needs %.2f MiB of the target's KV (%s/%s) and %.2f MiB of "
                   "the draft model's (%s/%s), %.2f MiB in all, over the KV budget of %.2f MiB (raise --kv-mem, lower "
                   "--ctx-size or give the draft lower -ctkd/-ctvd types)",
                   (int)ctx, (double)t / MiB, quant_type_name(target->type_k), quant_type_name(target->type_v),
                   (double)d / MiB, quant_type_name(draft->type_k), quant_type_name(draft->type_v),
                   (double)(t + d) / MiB, (double)target->mem_budget / MiB);
}
