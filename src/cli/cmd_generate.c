/* kvserve generate: load a model, prefill a prompt in batches, then sample
 * and stream tokens one decode step at a time: text through the streaming
 * detokenizer, or ids with --output-ids (or when the model has no
 * tokenizer). With --spec-type ngram a step feeds the last token and the
 * prompt-lookup drafts, and sample_verify keeps the drafts the model agrees
 * with (the scheduler's speculation, for one sequence). One timing line on
 * stderr. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "cli/setup.h"
#include "kv/kv.h"
#include "model/model.h"
#include "sample/sample.h"
#include "sched/sched.h"
#include "spec/spec.h"
#include "tokenizer/tokenizer.h"

struct gen_opts {
    const char *model;
    const char *prompt;         /* -p TEXT */
    int32_t *ids;               /* --ids: malloc'd */
    int32_t n_ids;
    int n_predict;
    int n_threads;
    int n_batch;
    bool output_ids;
    bool ignore_eos;
    struct sample_params sp;
    struct cli_model_flags load; /* --mmap and the KV flags; kv.mem 0: enough for prompt + n_predict */
    struct cli_spec_flags spec;  /* --spec-type, --draft-max, --draft-min */
};

static void gen_usage(FILE *out)
{
    fprintf(out,
            "usage: kvserve generate [-m MODEL.gguf] (-p TEXT | --ids 1,2,3) [-n N] [options]\n"
            "\n"
            "Prefill the prompt, then stream up to N generated tokens (stops early at an\n"
            "end-of-generation token). One timing line goes to stderr.\n"
            "\n"
            "  -m, --model PATH       GGUF model (default: the built-in default-model.gguf\n"
            "                         beside the kvserve executable)\n"
            "  -p, --prompt TEXT      prompt text (tokenized with BOS; special tokens written\n"
            "                         in it, e.g. <|im_start|>, are parsed)\n"
            "      --ids LIST         prompt as comma-separated token ids\n"
            "  -n, --n-predict N      tokens to generate (default 64)\n"
            "  -t, --threads N        threads (default: all cores)\n"
            "  -b, --batch N          prefill batch size (default 512)\n"
            "      --output-ids       print only the generated ids, space-separated, one line\n"
            "      --ignore-eos       do not stop at end-of-generation tokens\n"
            "sampling:\n"
            "      --temp T           temperature; 0 = greedy (default 0.8)\n"
            "      --top-k K          0 = off (default 40)\n"
            "      --top-p P          1 = off (default 0.95)\n"
            "      --min-p P          0 = off (default 0.05)\n"
            "      --repeat-penalty R 1 = off (default 1.0)\n"
            "      --repeat-last-n N  penalty window; -1 = all, 0 = off (default 64)\n"
            "      --presence-penalty F, --frequency-penalty F   0 = off\n"
            "      --seed N           sampler seed (default 0xC0FFEE)\n");
    fputs(cli_spec_flags_help, out);
    fputs(cli_model_flags_help, out);
}

static bool is_flag(const char *a, const char *s, const char *l)
{
    return (s && !strcmp(a, s)) || (l && !strcmp(a, l));
}

/* Returns true if a was a sampling flag (and *ok says whether its value parsed). */
static bool parse_sampling_flag(const char *a, const char *v, struct sample_params *sp, bool *ok)
{
    if (!strcmp(a, "--temp"))
        *ok = cli_parse_float(v, -1e9f, 1e9f, &sp->temp);
    else if (!strcmp(a, "--top-k"))
        *ok = cli_parse_int(v, 0, INT32_MAX, &sp->top_k);
    else if (!strcmp(a, "--top-p"))
        *ok = cli_parse_float(v, 0.0f, 1.0f, &sp->top_p);
    else if (!strcmp(a, "--min-p"))
        *ok = cli_parse_float(v, 0.0f, 1.0f, &sp->min_p);
    else if (!strcmp(a, "--repeat-penalty"))
        *ok = cli_parse_float(v, 1e-6f, 1e6f, &sp->repeat_penalty);
    else if (!strcmp(a, "--repeat-last-n"))
        *ok = cli_parse_int(v, -1, INT32_MAX, &sp->repeat_last_n);
    else if (!strcmp(a, "--presence-penalty"))
        *ok = cli_parse_float(v, -1e6f, 1e6f, &sp->presence_penalty);
    else if (!strcmp(a, "--frequency-penalty"))
        *ok = cli_parse_float(v, -1e6f, 1e6f, &sp->frequency_penalty);
    else if (!strcmp(a, "--seed"))
        *ok = cli_parse_u64(v, &sp->seed);
    else
        return false;
    return true;
}

static bool parse_value_flag(const char *a, const char *v, void *opts, bool *ok)
{
    struct gen_opts *o = opts;
    if (parse_sampling_flag(a, v, &o->sp, ok) || cli_parse_spec_flag(a, v, &o->spec, ok))
        return true;
    if (is_flag(a, "-m", "--model"))
        *ok = (o->model = v) != NULL;
    else if (is_flag(a, "-p", "--prompt"))
        *ok = (o->prompt = v) != NULL;
    else if (is_flag(a, NULL, "--ids")) {
        free(o->ids);
        o->ids = NULL;
        *ok = cli_parse_ids(v, &o->ids, &o->n_ids);
    } else if (is_flag(a, "-n", "--n-predict"))
        *ok = cli_parse_int(v, 0, 1 << 24, &o->n_predict);
    else if (is_flag(a, "-t", "--threads"))
        *ok = cli_parse_threads(v, &o->n_threads);
    else if (is_flag(a, "-b", "--batch"))
        *ok = cli_parse_int(v, 1, 1 << 16, &o->n_batch);
    else
        return false;
    return true;
}

static bool parse_switch_flag(const char *a, void *opts)
{
    struct gen_opts *o = opts;
    if (!strcmp(a, "--output-ids"))
        o->output_ids = true;
    else if (!strcmp(a, "--ignore-eos"))
        o->ignore_eos = true;
    else
        return false;
    return true;
}

/* 0 ok, 2 usage error, -1 help printed. */
static int parse_args(int argc, char **argv, struct gen_opts *o)
{
    *o = (struct gen_opts){.n_predict = 64, .n_threads = threads_default_count(), .n_batch = 512};
    cli_model_flags_init(&o->load);
    cli_spec_flags_init(&o->spec);
    sample_params_default(&o->sp);
    const struct cli_command cmd = {.name = "generate", .usage = gen_usage, .model = &o->load,
                                    .switch_flag = parse_switch_flag, .value_flag = parse_value_flag, .opts = o};
    int rc = cli_parse_command(&cmd, argc, argv);
    if (rc)
        return rc;
    if (!o->prompt == !o->ids) {
        fprintf(stderr, "kvserve generate: give exactly one of -p TEXT or --ids LIST\n\n");
        gen_usage(stderr);
        return 2;
    }
    if (o->spec.draft_min > o->spec.draft_max) {
        fprintf(stderr, "kvserve generate: --draft-min %d is above --draft-max %d\n\n", o->spec.draft_min,
                o->spec.draft_max);
        gen_usage(stderr);
        return 2;
    }
    const char *spec_conflict = cli_spec_flags_conflict(&o->spec);
    if (spec_conflict) {
        fprintf(stderr, "kvserve generate: %s\n\n", spec_conflict);
        gen_usage(stderr);
        return 2;
    }
    return 0;
}

/* ---- the run --------------------------------------------------------------- */

struct gen_run {
    const struct gen_opts *o;
    struct cli_engine e;
    struct sampler *sampler;
    struct tokenizer *tok;     /* NULL when the model has no tokenizer metadata */
    struct tok_stream *stream; /* text output; NULL with --output-ids or no tokenizer */
    int32_t seq;
    int32_t n_vocab;
    int32_t *tokens;  /* prompt then generated: the sampler's history */
    int32_t n_tokens;
    int32_t n_prompt;
    float *logits;    /* (1 + draft_max, n_vocab): a step's rows */
    double load_ms, prompt_s, gen_s;
    int32_t n_gen;
    /* speculation */
    int32_t draft_max;            /* 0: off */
    struct spec_adapt adapt;
    struct spec_pool *pool;       /* --spec-type ngram-pool: this run's prompt and output */
    int32_t pool_fed;             /* tokens[0, pool_fed) are in it */
    int32_t draft[SPEC_DRAFT_LIMIT];
    struct spec_cost cost;        /* a 1-token step, one more token in a step */
    int64_t n_drafted, n_accepted, n_steps;
    int64_t n_shadow;             /* tokens checked against a 1-token proposal while not drafting */
    /* --model-draft: the scheduler's drafter for this one sequence */
    struct model *draft_model;
    struct sched_engine draft_eng; /* its engine, its cache in the target's budget (ctx NULL: none) */
    struct sched_drafter *drafter;
    struct sched_draft_seq dseq;
    double draft_step_s;          /* EMA: one draft step */
    double draft_weight;          /* the draft model's weight bytes over the target's */
    int64_t draft_spent;          /* tokens the draft model computed (spec_draft_allowance) */
    int32_t draft_at;             /* n_gen at its last draft pass */
    struct sample_proposal dq[SPEC_DRAFT_LIMIT]; /* the q each of draft[] was drawn from (draft_q) */
    bool draft_q;                 /* draft[] is the draft model's: verify against dq */
    uint64_t draft_rng;           /* the stream its sampled drafts are drawn from */
};

static void run_free(struct gen_run *r)
{
    if (r->drafter)
        sched_drafter_release(r->drafter, &r->dseq, r->tokens, r->n_tokens, false);
    sched_drafter_free(r->drafter);
    if (r->draft_eng.ctx)
        r->draft_eng.destroy(r->draft_eng.ctx); /* before the target's cache, whose budget it shares */
    model_free(r->draft_model);
    sample_free(r->sampler);
    tok_stream_free(r->stream);
    tok_free(r->tok);
    cli_engine_free(&r->e);
    free(r->tokens);
    free(r->logits);
    spec_pool_free(r->pool);
}

/* The tokenizer is optional with --ids: it then only detects the end of
 * generation and renders the output as text. */
static ks_status open_tokenizer(struct gen_run *r)
{
    ks_status st = tok_load(model_gguf(r->e.model), &r->tok);
    if (st) {
        r->tok = NULL;
        if (r->o->prompt) {
            ks_errmsg_prefix("text prompts need the model's tokenizer (use --ids): ");
            return st;
        }
        return KS_OK;
    }
    if (!r->o->output_ids)
        return tok_stream_create(r->tok, 0, &r->stream);
    return KS_OK;
}

static ks_status encode_prompt(struct gen_run *r, int32_t **ids, size_t *n)
{
    const struct gen_opts *o = r->o;
    if (!o->prompt) {
        *n = (size_t)o->n_ids;
        *ids = malloc((*n ? *n : 1) * sizeof **ids);
        if (!*ids)
            return ks_fail(KS_ERR_NOMEM, "out of memory for the prompt");
        memcpy(*ids, o->ids, *n * sizeof **ids);
        return KS_OK;
    }
    /* a command-line prompt is trusted: special tokens written in it count */
    return tok_encode(r->tok, o->prompt, strlen(o->prompt), TOK_ADD_SPECIAL | TOK_PARSE_SPECIAL, ids, n);
}

static ks_status prompt_tokens(struct gen_run *r)
{
    const struct gen_opts *o = r->o;
    int32_t *ids;
    size_t n;
    ks_status st = encode_prompt(r, &ids, &n);
    if (st)
        return st;
    if (n == 0 || n > (size_t)INT32_MAX - (size_t)o->n_predict) {
        free(ids);
        return ks_fail(KS_ERR_INVALID_ARG, n ? "the prompt is too long" : "the prompt is empty");
    }
    for (size_t i = 0; i < n; i++)
        if (ids[i] >= r->n_vocab) {
            st = ks_fail(KS_ERR_RANGE, "prompt id %d (index %zu) is outside the vocabulary of %d", (int)ids[i], i,
                         (int)r->n_vocab);
            free(ids);
            return st;
        }
    r->tokens = realloc(ids, (n + (size_t)o->n_predict) * sizeof *ids);
    if (!r->tokens) {
        free(ids);
        return ks_fail(KS_ERR_NOMEM, "out of memory for %zu tokens", n + (size_t)o->n_predict);
    }
    r->n_tokens = r->n_prompt = (int32_t)n;
    return KS_OK;
}

/* --model-draft: the draft model, checked against the target's vocabulary,
 * and its KV configuration in the same budget (grown by its share without
 * --kv-mem). */
static ks_status draft_load(struct gen_run *r, int32_t n_ctx, struct kv_config *cfg, struct kv_config *dcfg)
{
    const struct gen_opts *o = r->o;
    if (!r->tok)
        return ks_fail(KS_ERR_INVALID_ARG, "--model-draft: the model has no vocabulary to check the draft model's against");
    ks_status st = cli_draft_load(&o->spec, &o->load, r->tok, r->n_vocab, &r->draft_model);
    if (st)
        return st;
    cli_draft_kv_config(&o->spec, r->draft_model, cfg, n_ctx, dcfg);
    if (!o->load.kv.mem)
        cfg->mem_budget += cli_kv_budget_for(dcfg, n_ctx);
    sched_draft_seq_init(&r->dseq);
    uint64_t wt = model_active_weight_bytes(r->e.model), wd = model_active_weight_bytes(r->draft_model);
    r->draft_weight = wt > 0 ? (double)wd / (double)wt : 0.0;
    return cli_draft_check_fit(cfg, dcfg, n_ctx);
}

static ks_status setup(struct gen_run *r, const char *model_path)
{
    const struct gen_opts *o = r->o;
    double t0 = cli_now();
    ks_status st = cli_load_model(model_path, &o->load, &r->e.model);
    if (st)
        return st;
    r->load_ms = (cli_now() - t0) * 1e3;
    r->n_vocab = model_hparams(r->e.model)->n_vocab;
    if ((st = open_tokenizer(r)) || (st = prompt_tokens(r)))
        return st;
    int n_ctx_train = model_hparams(r->e.model)->n_ctx_train;
    if (n_ctx_train > 0 && (int64_t)r->n_prompt + o->n_predict > n_ctx_train)
        fprintf(stderr, "kvserve generate: warning: %d prompt + %d new tokens exceed the model's trained context of %d\n",
                (int)r->n_prompt, o->n_predict, n_ctx_train);
    struct kv_config cfg, dcfg;
    int32_t n_ctx = r->n_prompt + o->n_predict;
    cli_kv_config(r->e.model, &o->load.kv, n_ctx, &cfg);
    if (o->spec.model_draft && (st = draft_load(r, n_ctx, &cfg, &dcfg)))
        return st;
    r->draft_max = o->spec.type == SPEC_NONE ? 0 : o->spec.draft_max;
    spec_adapt_init(&r->adapt, r->draft_model ? SPEC_DRAFT : o->spec.type);
    if (o->spec.type == SPEC_NGRAM_POOL && (st = spec_pool_create(o->spec.pool_n, SPEC_POOL_BYTES_DEFAULT, &r->pool)))
        return st;
    int32_t max_batch = r->n_prompt < o->n_batch ? r->n_prompt : o->n_batch;
    if (max_batch < 1 + r->draft_max)
        max_batch = 1 + r->draft_max;
    if ((st = cli_engine_start(&r->e, &cfg, o->n_threads, max_batch)) || (st = kv_seq_create(r->e.kv, &r->seq)) ||
        (st = sample_create(&o->sp, r->n_vocab, &r->sampler)))
        return st;
    if (r->draft_model && ((st = sched_engine_model_draft(r->e.kv, r->draft_model, &dcfg, max_batch, r->e.pool, &r->draft_eng)) ||
                           (st = sched_drafter_create(&r->draft_eng, max_batch, 1, max_batch, o->spec.draft_p_min, &r->drafter))))
        return st;
    r->logits = malloc((size_t)(1 + r->draft_max) * (size_t)r->n_vocab * sizeof *r->logits);
    if (!r->logits)
        return ks_fail(KS_ERR_NOMEM, "out of memory for the logits");
    return KS_OK;
}

/* Feed n tokens at positions from.. (tokens: NULL for r->tokens + from);
 * logits of the last one, or with all_logits of every one. */
static ks_status feed_tokens(struct gen_run *r, const int32_t *tokens, int32_t from, int32_t n, bool all_logits)
{
    int32_t *pos = malloc((size_t)n * sizeof *pos), *seq = malloc((size_t)n * sizeof *seq);
    bool *want = all_logits ? malloc((size_t)n * sizeof *want) : NULL;
    if (!pos || !seq || (all_logits && !want)) {
        free(pos);
        free(seq);
        free(want);
        return ks_fail(KS_ERR_NOMEM, "out of memory for a batch of %d", (int)n);
    }
    for (int32_t i = 0; i < n; i++) {
        pos[i] = from + i;
        seq[i] = r->seq;
        if (want)
            want[i] = true;
    }
    struct model_batch b = {.n_tokens = n, .tokens = tokens ? tokens : r->tokens + from, .pos = pos, .seq = seq,
                            .want_logits = want};
    ks_status st = model_forward(r->e.ctx, r->e.kv, &b, r->logits, NULL);
    free(pos);
    free(seq);
    free(want);
    return st;
}

/* Feed tokens[from..to) at their positions; logits of the last one. */
static ks_status feed(struct gen_run *r, int32_t from, int32_t to)
{
    return feed_tokens(r, NULL, from, to - from, false);
}

static ks_status prefill(struct gen_run *r)
{
    double t0 = cli_now();
    for (int32_t at = 0; at < r->n_prompt; at += r->o->n_batch) {
        int32_t end = at + r->o->n_batch < r->n_prompt ? at + r->o->n_batch : r->n_prompt;
        ks_status st = feed(r, at, end);
        if (st)
            return st;
    }
    r->prompt_s = cli_now() - t0;
    return KS_OK;
}

static ks_status emit(struct gen_run *r, int32_t token)
{
    if (!r->stream) {
        printf(r->n_gen > 1 ? " %d" : "%d", (int)token);
    } else if (token < tok_n_vocab(r->tok)) { /* models may pad the vocabulary beyond the tokenizer's */
        const char *bytes;
        size_t len;
        ks_status st = tok_stream_push(r->stream, token, &bytes, &len);
        if (st)
            return st;
        fwrite(bytes, 1, len, stdout);
    }
    fflush(stdout);
    return KS_OK;
}

static bool is_end(const struct gen_run *r, int32_t token)
{
    return r->tok && !r->o->ignore_eos && tok_is_eog(r->tok, token);
}

static void finish_output(struct gen_run *r)
{
    const char *bytes;
    size_t len;
    if (r->stream && !tok_stream_flush(r->stream, &bytes, &len))
        fwrite(bytes, 1, len, stdout);
    printf("\n");
    fflush(stdout);
}

/* The prompt goes through the same stream, so the first generated piece
 * keeps its leading space (the stream drops it only at the very start). */
static ks_status echo_prompt(struct gen_run *r)
{
    for (int32_t i = 0; r->stream && i < r->n_prompt; i++) {
        const char *bytes;
        size_t len;
        ks_status st = tok_stream_push(r->stream, r->tokens[i], &bytes, &len);
        if (st)
            return st;
        fwrite(bytes, 1, len, stdout);
    }
    return KS_OK;
}

/* Take token as the next one: false when the run ends here (an
 * end-of-generation token, n_predict reached, or *st failed). */
static bool take(struct gen_run *r, int32_t token, ks_status *st)
{
    if (is_end(r, token))
        return false;
    r->tokens[r->n_tokens++] = token;
    r->n_gen++;
    *st = emit(r, token);
    return !*st && r->n_gen < r->o->n_predict;
}

/* The cost of one more token in a step as a fraction of a 1-token step
 * (measured; a guess until both are). */
static double extra_cost(const struct gen_run *r)
{
    double c = spec_cost_ratio(&r->cost), step_s = r->cost.step_s;
    if (r->drafter) /* a draft model's token costs a draft step too; before one is measured, the weights' ratio */
        c += step_s > 0 && r->draft_step_s > 0 ? r->draft_step_s / step_s
             : r->draft_weight > 0                ? r->draft_weight
                                                  : SPEC_COST_GUESS;
    return c;
}

/* Up to k drafts in r->draft: the pool's (once it has learnt the latest
 * tokens), else prompt lookup; as the scheduler proposes them. */
static int32_t propose(struct gen_run *r, int32_t k)
{
    if (r->drafter) {
        if (!r->draft_rng)
            r->draft_rng = (r->o->sp.seed ^ 0xD1B54A32D192ED03ull) | 1; /* its own stream, never the sampler's */
        struct sched_draft_job job = {.ds = &r->dseq, .tokens = r->tokens, .n_tokens = r->n_tokens, .k = k,
                                      .sampling = &r->o->sp, .rng = &r->draft_rng};
        sched_drafter_run(r->drafter, &job, 1);
        r->draft_spent += job.n_work;
        r->draft_at = r->n_gen;
        double s = sched_drafter_step_seconds(r->drafter);
        if (s > 0)
            r->draft_step_s = r->draft_step_s > 0 ? 0.75 * r->draft_step_s + 0.25 * s : s;
        memcpy(r->draft, job.draft, (size_t)job.n_draft * sizeof *r->draft);
        memcpy(r->dq, job.q, (size_t)job.n_draft * sizeof *r->dq);
        r->draft_q = true;
        return job.n_draft;
    }
    if (r->pool) {
        spec_pool_add(r->pool, 0, r->tokens, r->n_tokens, r->pool_fed);
        r->pool_fed = r->n_tokens;
        int32_t m = spec_pool_draft(r->pool, 0, r->tokens, r->n_tokens, k, r->draft);
        if (m > 0)
            return m;
    }
    return spec_ngram_draft(r->tokens, r->n_tokens, k, r->draft);
}

/* The most drafts the draft model's allowance affords this step without
 * --draft-min (spec_draft_allowance and sched_draft_afford, as the
 * scheduler's), 0 for none; starts the draft sequence again from a window
 * when sched_draft_afford says so. */
static int32_t draft_afford(struct gen_run *r, bool drafting)
{
    if (r->o->spec.draft_min > 0)
        return SPEC_DRAFT_LIMIT;
    double rho = r->draft_weight, measured = r->cost.step_s > 0 ? r->draft_step_s / r->cost.step_s : 0;
    double left = spec_draft_allowance(r->n_tokens, r->n_accepted, SPEC_DRAFT_IDLE_SHARE, rho > measured ? rho : measured) -
                  (double)r->draft_spent;
    int32_t lead;
    bool window;
    int32_t afford = sched_draft_afford(&r->dseq, r->n_tokens, drafting, left, &lead, &window);
    if (afford > 0 && window)
        sched_drafter_restart(r->drafter, &r->dseq, r->tokens, r->n_tokens, r->n_tokens - SCHED_DRAFT_WINDOW, false);
    return afford;
}

/* The drafts for the next step (0 when not drafting); with none, *shadow the
 * token a 1-token draft proposes, to learn acceptance from (-1: none). */
static int32_t plan_drafts(struct gen_run *r, int32_t *shadow)
{
    *shadow = -1;
    if (r->draft_max == 0)
        return 0;
    int32_t room = r->o->n_predict - r->n_gen - 1;
    if (r->drafter && r->o->spec.draft_min <= 0 && (r->draft_step_s > 0 || r->draft_weight > 0) &&
        !spec_can_pay(r->draft_max, extra_cost(r)))
        return 0; /* a draft step this dear never pays, whatever is accepted (as the scheduler's draft_can_pay) */
    int32_t k = spec_adapt_len(&r->adapt, r->n_tokens, r->o->spec.draft_min, r->draft_max, extra_cost(r));
    k = k < room ? k : room;
    bool due = r->n_gen - r->draft_at >= SCHED_DRAFT_SHADOW_EVERY; /* a shadow check now and then */
    if (r->drafter && (k > 0 || due)) {
        int32_t afford = draft_afford(r, k > 0);
        k = k < afford ? k : afford;
        due = due && afford > 0;
    }
    int32_t m = k > 0 ? propose(r, k) : 0;
    if (m > 0 && m >= r->o->spec.draft_min)
        return m;
    if (r->drafter && (m > 0 || !due))
        return 0; /* the draft model's shadow costs a draft pass: check it now and then, within its allowance */
    if (propose(r, 1) == 1)
        *shadow = r->draft[0];
    return 0;
}

/* One step: feed the last token and k drafts, keep the drafts the sampler
 * accepts and the model's own next token, cut the cache back to the tokens
 * kept. false when the run ends. */
static bool spec_step(struct gen_run *r, ks_status *st)
{
    int32_t shadow, k = plan_drafts(r, &shadow), base = r->n_tokens;
    int32_t batch[1 + SPEC_DRAFT_LIMIT];
    batch[0] = r->tokens[base - 1];
    memcpy(batch + 1, r->draft, (size_t)k * sizeof *batch);
    double t0 = cli_now();
    if ((*st = feed_tokens(r, batch, base - 1, 1 + k, k > 0)))
        return false;
    spec_cost_learn(&r->cost, k, cli_now() - t0);
    r->n_steps++;
    bool go_on = true;
    int32_t kept = 0, tested = 0;
    for (int32_t i = 0; i <= k && go_on; i++) {
        const float *row = r->logits + (size_t)i * r->n_vocab;
        struct sample_result res;
        bool accepted = false;
        if (sample_is_plain_greedy(r->sampler)) { /* the argmax alone: generate prints no logprobs */
            *st = sample_greedy_token(r->sampler, row, &res.token);
            accepted = i < k && res.token == r->draft[i];
        } else if (i == k)
            *st = sample_next(r->sampler, row, r->tokens, r->n_tokens, &res);
        else if (r->draft_q) /* a draft model's draft, drawn from dq[i] */
            *st = sample_verify_proposal(r->sampler, row, r->tokens, r->n_tokens, &r->dq[i], r->draft[i], &res,
                                         &accepted);
        else
            *st = sample_verify(r->sampler, row, r->tokens, r->n_tokens, r->draft[i], &res, &accepted);
        if (*st)
            return false;
        if (i == k && shadow >= 0) {
            spec_adapt_observe(&r->adapt, 1, res.token == shadow);
            r->n_shadow++;
        }
        tested += i < k;
        go_on = take(r, res.token, st);
        if (!accepted)
            break;
        kept += r->n_tokens > base + kept;
        r->n_accepted++;
    }
    r->n_drafted += k;
    if (k > 0)
        spec_adapt_verified(&r->adapt, tested, kept, r->n_tokens);
    if (kept < k && (*st = kv_seq_truncate(r->e.kv, r->seq, base + kept)))
        return false;
    return go_on;
}

static ks_status decode_loop(struct gen_run *r)
{
    ks_status st = echo_prompt(r);
    if (st)
        return st;
    double t0 = cli_now();
    struct sample_result res;
    if (r->o->n_predict > 0 && !(st = sample_next(r->sampler, r->logits, r->tokens, r->n_tokens, &res)) &&
        take(r, res.token, &st))
        while (spec_step(r, &st)) {
        }
    r->gen_s = cli_now() - t0;
    finish_output(r);
    return st;
}

static void print_timing(const struct gen_run *r)
{
    double pp = r->prompt_s > 0 ? r->n_prompt / r->prompt_s : 0;
    double tg = r->gen_s > 0 ? r->n_gen / r->gen_s : 0;
    fprintf(stderr,
            "timing: prompt %d tok, %.1f tok/s | generated %d tok, %.1f tok/s | load %.0f ms | peak RSS %.1f MiB\n",
            (int)r->n_prompt, pp, (int)r->n_gen, tg, r->load_ms, (double)cli_peak_rss() / (1 << 20));
    if (r->draft_max > 0)
        fprintf(stderr, "speculation: %s, %" PRId64 " drafted, %" PRId64 " accepted (%.1f%%), %.2f tokens per target pass\n",
                spec_type_name(r->o->spec.type), r->n_drafted, r->n_accepted,
                r->n_drafted ? 100.0 * (double)r->n_accepted / (double)r->n_drafted : 0.0,
                r->n_steps ? (double)(r->n_gen - 1) / (double)r->n_steps : 0.0);
    if (r->drafter) {
        struct sched_drafter_counts c;
        sched_drafter_get_counts(r->drafter, &c);
        fprintf(stderr, "draft model: %" PRIu64 " forwards, %" PRIu64 " tokens (%.3f per token of the text), %" PRId64
                " shadow checks\n", c.forwards, c.tokens, (double)c.tokens / (double)(r->n_prompt + r->n_gen), r->n_shadow);
    }
}

int cli_generate(int argc, char **argv)
{
    struct gen_opts o;
    int rc = parse_args(argc, argv, &o);
    if (rc) {
        free(o.ids);
        return rc < 0 ? 0 : rc;
    }
    char default_path[4096];
    const char *path = cli_model_path("generate", o.model, default_path, sizeof default_path);
    if (!path) {
        free(o.ids);
        return 2;
    }
    struct gen_run r = {.o = &o};
    ks_status st = setup(&r, path);
    bool started = !st;
    if (!st)
        st = prefill(&r);
    if (!st)
        st = decode_loop(&r);
    if (st)
        fprintf(stderr, "kvserve generate: %s\n", *ks_errmsg() ? ks_errmsg() : ks_strerror(st));
    if (started) /* after a mid-run failure too: the tokens so far were printed */
        print_timing(&r);
    run_free(&r);
    free(o.ids);
    return st ? 1 : 0;
}
