/* kvserve perplexity: llama-perplexity's scoring over the paged KV cache.
 * The text is tokenized with BOS, split into chunks of CTX tokens, each
 * evaluated from an empty sequence with its first token replaced by BOS;
 * the second half of each chunk is scored. Against saved baseline logits
 * (--kl-base) it also reports KL divergence and top-1 agreement. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "cli/setup.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"

#define LOGITS_MAGIC 0x4b56504cu /* "KVPL": magic, n_vocab, n_rows, then rows of f32 */

struct ppl_opts {
    const char *model, *text, *kl_base, *save_logits;
    int n_ctx, n_batch, n_threads, max_chunks; /* n_batch 0: one batch per chunk */
    bool json;
    struct cli_model_flags load; /* --mmap and the KV flags; kv.mem 0: one chunk */
};

static void ppl_usage(FILE *out)
{
    fprintf(out,
            "usage: kvserve perplexity -m MODEL -f TEXT [-c CTX] [--kl-base FILE | --save-logits FILE] [--json]\n"
            "\n"
            "  -m, --model PATH        GGUF model (required)\n"
            "  -f, --file TEXT         text file to score (required)\n"
            "  -c, --ctx-size N        tokens per chunk (default 512); the second half of each is scored\n"
            "  -b, --batch-size N      evaluate each chunk in batches of N tokens, as a server prefills\n"
            "                          (default: the whole chunk at once); the KV policy acts between them\n"
            "      --chunks N          score at most N chunks (default: all)\n"
            "      --save-logits FILE  write the scored logits (the KL baseline, run it with -ctk f32 -ctv f32)\n"
            "      --kl-base FILE      compare with saved logits: mean and p99 KL divergence, top-1 agreement\n"
            "      --json              one JSON object on stdout\n"
            "  -t, --threads N         threads (default: all cores)\n"
            "\n");
    fputs(cli_model_flags_help, out);
}

static bool flag(const char *a, const char *s, const char *l) { return (s && !strcmp(a, s)) || !strcmp(a, l); }

static bool parse_value(const char *a, const char *v, void *opts, bool *ok)
{
    struct ppl_opts *o = opts;
    if (flag(a, "-m", "--model"))
        *ok = (o->model = v) != NULL;
    else if (flag(a, "-f", "--file"))
        *ok = (o->text = v) != NULL;
    else if (flag(a, "-c", "--ctx-size"))
        *ok = cli_parse_int(v, 4, 1 << 20, &o->n_ctx);
    else if (flag(a, "-b", "--batch-size"))
        *ok = cli_parse_int(v, 1, 1 << 20, &o->n_batch);
    else if (flag(a, NULL, "--chunks"))
        *ok = cli_parse_int(v, 1, 1 << 30, &o->max_chunks);
    else if (flag(a, NULL, "--kl-base"))
        *ok = (o->kl_base = v) != NULL;
    else if (flag(a, NULL, "--save-logits"))
        *ok = (o->save_logits = v) != NULL;
    else if (flag(a, "-t", "--threads"))
        *ok = cli_parse_threads(v, &o->n_threads);
    else
        return false;
    return true;
}

static bool parse_switch(const char *a, void *opts)
{
    struct ppl_opts *o = opts;
    if (strcmp(a, "--json"))
        return false;
    o->json = true;
    return true;
}

static int parse_args(int argc, char **argv, struct ppl_opts *o)
{
    *o = (struct ppl_opts){.n_ctx = 512, .n_threads = threads_default_count()};
    cli_model_flags_init(&o->load);
    const struct cli_command cmd = {.name = "perplexity", .usage = ppl_usage, .model = &o->load,
                                    .switch_flag = parse_switch, .value_flag = parse_value, .opts = o};
    int rc = cli_parse_command(&cmd, argc, argv);
    if (rc)
        return rc;
    if (!o->model || !o->text) {
        fprintf(stderr, "kvserve perplexity: -m MODEL and -f TEXT are required\n");
        return 2;
    }
    if (o->kl_base && o->save_logits) {
        fprintf(stderr, "kvserve perplexity: use --kl-base or --save-logits, not both\n");
        return 2;
    }
    if (o->n_batch == 0 || o->n_batch > o->n_ctx)
        o->n_batch = o->n_ctx;
    return 0;
}

static ks_status read_file(const char *path, char **buf, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return ks_fail(KS_ERR_IO, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    *buf = malloc(n > 0 ? (size_t)n : 1);
    if (!*buf || n < 0 || fread(*buf, 1, (size_t)n, f) != (size_t)n) {
        fclose(f);
        free(*buf);
        return ks_fail(KS_ERR_IO, "cannot read %s", path);
    }
    fclose(f);
    *len = (size_t)n;
    return KS_OK;
}

/* log-softmax of one row into out (double for a stable KL). */
static void log_softmax(const float *x, int n, double *out)
{
    double mx = -INFINITY, sum = 0.0;
    for (int i = 0; i < n; i++)
        mx = x[i] > mx ? x[i] : mx;
    for (int i = 0; i < n; i++)
        sum += exp(x[i] - mx);
    double lse = mx + log(sum);
    for (int i = 0; i < n; i++)
        out[i] = x[i] - lse;
}

static int argmax(const float *x, int n)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best])
            best = i;
    return best;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

struct ppl_state {
    struct cli_engine e;
    struct tokenizer *tok;
    int n_vocab;
    FILE *save, *base;
    double nll;
    int64_t n_scored;
    double *kld;          /* (n_scored) */
    int64_t n_top1;
    float *logits, *base_row;
    double *lp, *lq;
};

/* Run tok[0, n_ctx) of seq through the model in batches of n_batch tokens;
 * the logits of positions [first, n_ctx - 1) land in s->logits in order. */
static ks_status eval_chunk(struct ppl_state *s, int32_t seq, const int32_t *tok, int n_ctx, int n_batch)
{
    int first = n_ctx / 2;
    int32_t *pos = malloc((size_t)n_batch * sizeof *pos), *sq = malloc((size_t)n_batch * sizeof *sq);
    bool *want = malloc((size_t)n_batch * sizeof *want);
    ks_status st = pos && sq && want ? KS_OK : ks_fail(KS_ERR_NOMEM, "out of memory");
    for (int b0 = 0; !st && b0 < n_ctx; b0 += n_batch) {
        int n = n_ctx - b0 < n_batch ? n_ctx - b0 : n_batch;
        for (int i = 0; i < n; i++) {
            pos[i] = b0 + i;
            sq[i] = seq;
            want[i] = b0 + i >= first && b0 + i < n_ctx - 1;
        }
        int out_row = b0 > first ? b0 - first : 0;
        struct model_batch b = {.n_tokens = n, .tokens = tok + b0, .pos = pos, .seq = sq, .want_logits = want};
        st = model_forward(s->e.ctx, s->e.kv, &b, s->logits + (size_t)out_row * s->n_vocab, NULL);
    }
    free(pos);
    free(sq);
    free(want);
    return st;
}

/* Accumulate NLL (and against --kl-base, KL and top-1) of the scored rows. */
static ks_status score_rows(struct ppl_state *s, const int32_t *tokens, int n_ctx)
{
    ks_status st = KS_OK;
    int first = n_ctx / 2;
    for (int i = first; !st && i < n_ctx - 1; i++) {
        const float *row = s->logits + (size_t)(i - first) * s->n_vocab;
        log_softmax(row, s->n_vocab, s->lq);
        s->nll -= s->lq[tokens[i + 1]];
        if (s->save && fwrite(row, sizeof(float), (size_t)s->n_vocab, s->save) != (size_t)s->n_vocab)
            st = ks_fail(KS_ERR_IO, "cannot write the logits file");
        if (!st && s->base) {
            if (fread(s->base_row, sizeof(float), (size_t)s->n_vocab, s->base) != (size_t)s->n_vocab)
                return ks_fail(KS_ERR_FORMAT, "--kl-base: the file has fewer rows than this run scores (same -c and text?)");
            log_softmax(s->base_row, s->n_vocab, s->lp);
            double kl = 0.0;
            for (int v = 0; v < s->n_vocab; v++)
                kl += exp(s->lp[v]) * (s->lp[v] - s->lq[v]);
            s->kld[s->n_scored] = kl;
            s->n_top1 += argmax(s->base_row, s->n_vocab) == argmax(row, s->n_vocab);
        }
        s->n_scored++;
    }
    return st;
}

static ks_status score_chunk(struct ppl_state *s, const int32_t *tokens, int n_ctx, int n_batch, int32_t bos)
{
    int32_t seq;
    ks_status st = kv_seq_create(s->e.kv, &seq);
    if (st)
        return st;
    int32_t *tok = malloc((size_t)n_ctx * sizeof *tok);
    if (!tok)
        st = ks_fail(KS_ERR_NOMEM, "out of memory");
    for (int i = 0; !st && i < n_ctx; i++)
        tok[i] = i == 0 && bos >= 0 ? bos : tokens[i];
    if (!st)
        st = eval_chunk(s, seq, tok, n_ctx, n_batch);
    if (!st)
        st = score_rows(s, tokens, n_ctx);
    kv_seq_free(s->e.kv, seq);
    free(tok);
    return st;
}

static ks_status open_logits(struct ppl_state *s, const struct ppl_opts *o, uint32_t n_rows)
{
    uint32_t hdr[3] = {LOGITS_MAGIC, (uint32_t)s->n_vocab, n_rows};
    if (o->save_logits) {
        if (!(s->save = fopen(o->save_logits, "wb")) || fwrite(hdr, sizeof hdr, 1, s->save) != 1)
            return ks_fail(KS_ERR_IO, "cannot write %s", o->save_logits);
    }
    if (o->kl_base) {
        uint32_t got[3];
        if (!(s->base = fopen(o->kl_base, "rb")) || fread(got, sizeof got, 1, s->base) != 1)
            return ks_fail(KS_ERR_IO, "cannot read %s", o->kl_base);
        if (got[0] != LOGITS_MAGIC || got[1] != hdr[1] || got[2] != n_rows)
            return ks_fail(KS_ERR_FORMAT, "%s: not a logits file of this model and -c/--chunks (%u rows of %u, want %u of %u)",
                           o->kl_base, got[2], got[1], n_rows, hdr[1]);
    }
    return KS_OK;
}

static ks_status ppl_setup(struct ppl_state *s, const struct ppl_opts *o, int32_t **ids, size_t *n_ids)
{
    ks_status st = cli_load_model(o->model, &o->load, &s->e.model);
    if (st || (st = tok_load(model_gguf(s->e.model), &s->tok)))
        return st;
    s->n_vocab = model_hparams(s->e.model)->n_vocab;
    char *text = NULL;
    size_t len = 0;
    if ((st = read_file(o->text, &text, &len)))
        return st;
    st = tok_encode(s->tok, text, len, TOK_ADD_SPECIAL, ids, n_ids);
    free(text);
    if (st)
        return st;
    struct kv_config cfg;
    cli_kv_config(s->e.model, &o->load.kv, o->n_ctx, &cfg);
    int half = o->n_ctx / 2;
    s->logits = malloc((size_t)half * s->n_vocab * sizeof(float));
    s->base_row = malloc((size_t)s->n_vocab * sizeof(float));
    s->lp = malloc((size_t)s->n_vocab * sizeof(double));
    s->lq = malloc((size_t)s->n_vocab * sizeof(double));
    if (!s->logits || !s->base_row || !s->lp || !s->lq)
        return ks_fail(KS_ERR_NOMEM, "out of memory for logits");
    return cli_engine_start(&s->e, &cfg, o->n_threads, o->n_batch);
}

static void print_result(const struct ppl_state *s, const struct ppl_opts *o, double ppl, double kmean, double kp99,
                         double top1)
{
    const struct kv_config *c = kv_get_config(s->e.kv);
    if (o->json) {
        /* without --kl-base there is nothing to compare against: null, not 0 */
        char kl[128] = "\"kld_mean\": null, \"kld_p99\": null, \"top1\": null";
        if (o->kl_base)
            snprintf(kl, sizeof kl, "\"kld_mean\": %.8f, \"kld_p99\": %.8f, \"top1\": %.6f", kmean, kp99, top1);
        printf("{\"ppl\": %.6f, %s, \"n_tokens\": %lld, "
               "\"n_ctx\": %d, \"cache\": {\"type_k\": \"%s\", \"type_v\": \"%s\", \"rotate\": %s, "
               "\"scale_search\": %s, \"smooth\": \"%s\", \"page\": %d, "
               "\"policy\": \"%s\", \"mem\": %zu}}\n",
               ppl, kl, (long long)s->n_scored, o->n_ctx, quant_type_name(c->type_k),
               quant_type_name(c->type_v), c->rotate ? "true" : "false", c->scale_search ? "true" : "false",
               kv_smooth_name(c->smooth), c->page_tokens,
               c->policy == KV_POLICY_DYNAMIC ? "dynamic" : "static", c->mem_budget);
        return;
    }
    printf("cache %s/%s rotate %s scale search %s smooth %s, c=%d, %lld scored tokens\n",
           quant_type_name(c->type_k), quant_type_name(c->type_v), c->rotate ? "on" : "off",
           c->scale_search ? "on" : "off", kv_smooth_name(c->smooth), o->n_ctx, (long long)s->n_scored);
    printf("PPL = %.4f\n", ppl);
    if (o->kl_base)
        printf("mean KLD = %.6f   KLD p99 = %.6f   same top-1 = %.2f%%\n", kmean, kp99, top1 * 100.0);
}

static void ppl_free(struct ppl_state *s)
{
    if (s->save)
        fclose(s->save);
    if (s->base)
        fclose(s->base);
    tok_free(s->tok);
    cli_engine_free(&s->e);
    free(s->kld);
    free(s->logits);
    free(s->base_row);
    free(s->lp);
    free(s->lq);
}

int cli_perplexity(int argc, char **argv)
{
    struct ppl_opts o;
    int rc = parse_args(argc, argv, &o);
    if (rc)
        return rc < 0 ? 0 : rc;
    struct ppl_state s = {0};
    int32_t *ids = NULL;
    size_t n_ids = 0;
    ks_status st = ppl_setup(&s, &o, &ids, &n_ids);
    int64_t n_chunks = (int64_t)n_ids / o.n_ctx;
    if (!st && o.max_chunks && n_chunks > o.max_chunks)
        n_chunks = o.max_chunks;
    if (!st && n_chunks == 0)
        st = ks_fail(KS_ERR_INVALID_ARG, "the text has %zu tokens, fewer than one chunk of -c %d", n_ids, o.n_ctx);
    int per_chunk = o.n_ctx - 1 - o.n_ctx / 2;
    if (!st)
        st = open_logits(&s, &o, (uint32_t)(n_chunks * per_chunk));
    if (!st && !(s.kld = calloc((size_t)(n_chunks * per_chunk) + 1, sizeof *s.kld)))
        st = ks_fail(KS_ERR_NOMEM, "out of memory");
    int32_t bos = st ? -1 : tok_special(s.tok)->bos;
    for (int64_t c = 0; !st && c < n_chunks; c++)
        st = score_chunk(&s, ids + c * o.n_ctx, o.n_ctx, o.n_batch, bos);
    if (!st) {
        double ppl = exp(s.nll / (double)s.n_scored), kmean = 0.0, kp99 = 0.0, top1 = 1.0;
        if (s.base) {
            for (int64_t i = 0; i < s.n_scored; i++)
                kmean += s.kld[i];
            kmean /= (double)s.n_scored;
            qsort(s.kld, (size_t)s.n_scored, sizeof *s.kld, cmp_double);
            kp99 = s.kld[(size_t)((double)(s.n_scored - 1) * 0.99)];
            top1 = (double)s.n_top1 / (double)s.n_scored;
        }
        print_result(&s, &o, ppl, kmean, kp99, top1);
    } else
        fprintf(stderr, "kvserve perplexity: %s\n", ks_errmsg());
    free(ids);
    ppl_free(&s);
    return st ? 1 : 0;
}
