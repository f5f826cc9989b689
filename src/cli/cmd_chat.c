/* kvserve chat: an interactive chat in the terminal. Each turn renders the
 * whole conversation with the model's chat template, tokenizes it, and feeds
 * only what the KV cache does not already hold (the longest common prefix
 * with the tokens in the cache is kept), so earlier turns are not
 * recomputed. The reply streams through the detokenizer. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "cli/setup.h"
#include "jinja/jinja.h"
#include "kv/kv.h"
#include "model/model.h"
#include "sample/sample.h"
#include "tokenizer/tokenizer.h"

struct chat_opts {
    const char *model;
    const char *template_name; /* --chat-template */
    const char *template_file; /* --chat-template-file */
    const char *system;        /* -s */
    int n_predict;             /* per reply */
    int n_ctx;                 /* 0: the model's training context, at most 4096 */
    int n_threads;
    int n_batch;
    bool verbose;              /* -v: per-turn cache reuse on stderr */
    struct sample_params sp;
    struct cli_model_flags load; /* --mmap and the KV flags; kv.mem 0: enough for n_ctx tokens */
};

static void chat_usage(FILE *out)
{
    fprintf(out,
            "usage: kvserve chat [-m MODEL.gguf] [--chat-template NAME] [-s SYSTEM] [options]\n"
            "\n"
            "Chat with a model: type a message and press Enter; an empty line is ignored,\n"
            "/reset starts a new conversation, /exit or end of input (Ctrl-D) quits.\n"
            "The conversation stays in the KV cache between turns.\n"
            "\n"
            "  -m, --model PATH         GGUF model (default: the built-in default model)\n"
            "      --chat-template-file F  a Jinja chat template instead of the model's\n"
            "      --chat-template NAME a built-in format instead of the model's Jinja template:\n"
            "                           chatml, llama3, llama2, mistral, zephyr, gemma, phi3\n"
            "  -s, --system TEXT        system prompt\n"
            "  -n, --n-predict N        most tokens per reply (default 512)\n"
            "  -c, --ctx-size N         context in tokens (default: the model's, at most 4096)\n"
            "  -t, --threads N          threads (default: all cores)\n"
            "  -b, --batch N            prefill batch size (default 512)\n"
            "      --temp T             temperature; 0 = greedy (default 0.8)\n"
            "      --top-k K, --top-p P, --min-p P, --repeat-penalty R, --seed N\n"
            "  -v, --verbose            after each prompt, print on stderr how many tokens were\n"
            "                           reused from the KV cache and how many were computed\n");
    fputs(cli_model_flags_help, out);
}

static bool chat_flag(const char *a, const char *v, void *opts, bool *ok)
{
    struct chat_opts *o = opts;
    if (!strcmp(a, "-m") || !strcmp(a, "--model"))
        *ok = (o->model = v) != NULL;
    else if (!strcmp(a, "--chat-template"))
        *ok = (o->template_name = v) != NULL;
    else if (!strcmp(a, "--chat-template-file"))
        *ok = (o->template_file = v) != NULL;
    else if (!strcmp(a, "-s") || !strcmp(a, "--system"))
        *ok = (o->system = v) != NULL;
    else if (!strcmp(a, "-n") || !strcmp(a, "--n-predict"))
        *ok = cli_parse_int(v, 1, 1 << 20, &o->n_predict);
    else if (!strcmp(a, "-c") || !strcmp(a, "--ctx-size"))
        *ok = cli_parse_int(v, 16, 1 << 24, &o->n_ctx);
    else if (!strcmp(a, "-t") || !strcmp(a, "--threads"))
        *ok = cli_parse_threads(v, &o->n_threads);
    else if (!strcmp(a, "-b") || !strcmp(a, "--batch"))
        *ok = cli_parse_int(v, 1, 1 << 16, &o->n_batch);
    else if (!strcmp(a, "--temp"))
        *ok = cli_parse_float(v, -1e9f, 1e9f, &o->sp.temp);
    else if (!strcmp(a, "--top-k"))
        *ok = cli_parse_int(v, 0, 1 << 30, &o->sp.top_k);
    else if (!strcmp(a, "--top-p"))
        *ok = cli_parse_float(v, 0.0f, 1.0f, &o->sp.top_p);
    else if (!strcmp(a, "--min-p"))
        *ok = cli_parse_float(v, 0.0f, 1.0f, &o->sp.min_p);
    else if (!strcmp(a, "--repeat-penalty"))
        *ok = cli_parse_float(v, 1e-6f, 1e6f, &o->sp.repeat_penalty);
    else if (!strcmp(a, "--seed"))
        *ok = cli_parse_u64(v, &o->sp.seed);
    else
        return false;
    return true;
}

static bool chat_switch(const char *a, void *opts)
{
    struct chat_opts *o = opts;
    if (strcmp(a, "-v") && strcmp(a, "--verbose"))
        return false;
    o->verbose = true;
    return true;
}

/* 0 ok, 2 usage error, -1 help printed. */
static int chat_parse(int argc, char **argv, struct chat_opts *o)
{
    *o = (struct chat_opts){.n_predict = 512, .n_threads = threads_default_count(), .n_batch = 512};
    cli_model_flags_init(&o->load);
    sample_params_default(&o->sp);
    const struct cli_command cmd = {.name = "chat", .usage = chat_usage, .model = &o->load,
                                    .switch_flag = chat_switch, .value_flag = chat_flag, .opts = o};
    return cli_parse_command(&cmd, argc, argv);
}

/* ---- the session ----------------------------------------------------------- */

struct chat {
    const struct chat_opts *o;
    struct cli_engine e;
    struct sampler *sampler;
    struct tokenizer *tok;
    struct tok_stream *stream;
    struct tok_chat_setup tmpl; /* --chat-template NAME's family, else the file's or the model's Jinja template */
    int32_t seq, n_vocab, n_ctx;
    struct tok_chat_msg *msgs; /* contents are malloc'd */
    size_t n_msgs, cap_msgs;
    int32_t *hist;             /* the conversation's tokens; hist[0..n_kv) are in the cache */
    int32_t n_hist, n_kv;
    float *logits;
};

static void chat_free(struct chat *c)
{
    for (size_t i = 0; i < c->n_msgs; i++)
        free((char *)c->msgs[i].content);
    free(c->msgs);
    free(c->hist);
    free(c->logits);
    sample_free(c->sampler);
    tok_stream_free(c->stream);
    tok_free(c->tok);
    tok_chat_setup_free(&c->tmpl);
    cli_engine_free(&c->e);
}

/* The template, as the server takes it (tok_chat_setup): --chat-template
 * NAME picks a hand-written family; else --chat-template-file, the model's
 * tokenizer.chat_template, or ChatML for a model without one. */
static ks_status template_setup(struct chat *c)
{
    const struct chat_opts *o = c->o;
    size_t len = 0;
    char *file = NULL;
    if (!o->template_name && o->template_file && !(file = cli_read_file(o->template_file, &len)))
        return ks_fail(KS_ERR_IO, "cannot read --chat-template-file %s", o->template_file);
    ks_status st = tok_chat_setup(c->tok, o->template_name, file, len, o->template_file, &c->tmpl);
    free(file);
    c->tmpl.src = NULL; /* the parsed template keeps its own copy */
    return st;
}

/* The conversation through the Jinja template, as the server renders a request. */
static ks_status render_jinja(struct chat *c, char **text)
{
    cJSON *req = cJSON_CreateObject();
    cJSON *msgs = cJSON_AddArrayToObject(req, "messages");
    for (size_t i = 0; msgs && i < c->n_msgs; i++) {
        cJSON *m = cJSON_CreateObject();
        cJSON_AddItemToArray(msgs, m);
        if (!cJSON_AddStringToObject(m, "role", c->msgs[i].role) ||
            !cJSON_AddStringToObject(m, "content", c->msgs[i].content))
            msgs = NULL;
    }
    if (!msgs) {
        cJSON_Delete(req);
        return ks_fail(KS_ERR_NOMEM, "out of memory for the conversation");
    }
    size_t max_out = (size_t)c->n_ctx * 64;
    struct jinja_chat chat = {c->tmpl.bos_text, c->tmpl.eos_text, 1, NULL};
    struct jinja_opts opts = {.max_output = max_out > (64u << 10) ? max_out : 64u << 10, .now = (int64_t)time(NULL)};
    ks_status st = jinja_chat_render(c->tmpl.jt, req, &chat, &opts, text, NULL);
    cJSON_Delete(req);
    return st;
}

static ks_status add_msg(struct chat *c, const char *role, const char *content, size_t len)
{
    if (c->n_msgs == c->cap_msgs) {
        size_t ncap = c->cap_msgs ? c->cap_msgs * 2 : 16;
        struct tok_chat_msg *m = realloc(c->msgs, ncap * sizeof *m);
        if (!m)
            return ks_fail(KS_ERR_NOMEM, "out of memory for the conversation");
        c->msgs = m;
        c->cap_msgs = ncap;
    }
    char *copy = malloc(len + 1);
    if (!copy)
        return ks_fail(KS_ERR_NOMEM, "out of memory for the conversation");
    memcpy(copy, content, len);
    copy[len] = 0;
    c->msgs[c->n_msgs++] = (struct tok_chat_msg){role, copy};
    return KS_OK;
}

static ks_status chat_setup(struct chat *c, const char *path)
{
    const struct chat_opts *o = c->o;
    ks_status st = cli_load_model(path, &o->load, &c->e.model);
    if (st || (st = tok_load(model_gguf(c->e.model), &c->tok)) || (st = template_setup(c)))
        return st;
    const struct model_hparams *hp = model_hparams(c->e.model);
    c->n_vocab = hp->n_vocab;
    c->n_ctx = o->n_ctx ? o->n_ctx : (hp->n_ctx_train > 0 && hp->n_ctx_train < 4096 ? hp->n_ctx_train : 4096);
    struct kv_config cfg;
    cli_kv_config(c->e.model, &o->load.kv, c->n_ctx, &cfg);
    if ((st = cli_engine_start(&c->e, &cfg, o->n_threads, o->n_batch)) || (st = kv_seq_create(c->e.kv, &c->seq)) ||
        (st = sample_create(&o->sp, c->n_vocab, &c->sampler)) || (st = tok_stream_create(c->tok, 0, &c->stream)))
        return st;
    c->hist = malloc((size_t)c->n_ctx * sizeof *c->hist);
    c->logits = malloc((size_t)c->n_vocab * sizeof *c->logits);
    if (!c->hist || !c->logits)
        return ks_fail(KS_ERR_NOMEM, "out of memory for a context of %d tokens", (int)c->n_ctx);
    if (o->system && (st = add_msg(c, "system", o->system, strlen(o->system))))
        return st;
    fprintf(stderr, "kvserve chat: template %s, context %d tokens\n",
            c->tmpl.jt ? (o->template_file ? o->template_file : "the model's (Jinja)") : tok_chat_name(c->tmpl.family),
            (int)c->n_ctx);
    return KS_OK;
}

/* Feed hist[n_kv..n_hist) in batches; the logits are the last token's. */
static ks_status feed_pending(struct chat *c)
{
    int32_t pos[512], seq[512];
    while (c->n_kv < c->n_hist) {
        int32_t n = c->n_hist - c->n_kv;
        int32_t cap = c->o->n_batch < 512 ? c->o->n_batch : 512;
        n = n < cap ? n : cap;
        for (int32_t i = 0; i < n; i++) {
            pos[i] = c->n_kv + i;
            seq[i] = c->seq;
        }
        struct model_batch b = {.n_tokens = n, .tokens = c->hist + c->n_kv, .pos = pos, .seq = seq};
        ks_status st = model_forward(c->e.ctx, c->e.kv, &b, c->logits, NULL);
        if (st)
            return st;
        c->n_kv += n;
    }
    return KS_OK;
}

/* Tokenize the rendered conversation and keep the cached common prefix. */
static ks_status prepare_turn(struct chat *c)
{
    char *text = NULL;
    int32_t *ids = NULL;
    size_t n = 0;
    ks_status st = c->tmpl.jt ? render_jinja(c, &text) : tok_chat_render(c->tok, c->tmpl.family, c->msgs, c->n_msgs, true, &text);
    if (!st)
        st = tok_encode(c->tok, text, strlen(text), TOK_ADD_SPECIAL | TOK_PARSE_SPECIAL, &ids, &n);
    free(text);
    if (st)
        return st;
    if (n + (size_t)c->o->n_predict > (size_t)c->n_ctx) {
        free(ids);
        return ks_fail(KS_ERR_RANGE, "the conversation (%zu tokens) plus a reply would exceed the context of %d; "
                                     "/reset or raise -c", n, (int)c->n_ctx);
    }
    int32_t keep = 0;
    while (keep < c->n_kv && (size_t)keep < n && c->hist[keep] == ids[keep])
        keep++;
    if ((size_t)keep == n) /* something must be fed to get logits */
        keep--;
    /* sliding-window layers: resume where the window rows it needs are still stored, recompute the rest */
    keep = kv_seq_resumable(c->e.kv, c->seq, keep);
    if (keep < c->n_kv && (st = kv_seq_truncate(c->e.kv, c->seq, keep))) {
        free(ids);
        return st;
    }
    c->n_kv = keep;
    memcpy(c->hist, ids, n * sizeof *ids);
    c->n_hist = (int32_t)n;
    free(ids);
    if (c->o->verbose)
        fprintf(stderr, "[prompt: %d tokens reused from the KV cache, %d computed]\n", (int)keep, (int)(n - keep));
    return feed_pending(c);
}

struct reply {
    char *p;
    size_t n, cap;
};

static ks_status reply_put(struct reply *r, const char *s, size_t n)
{
    fwrite(s, 1, n, stdout);
    fflush(stdout);
    if (r->n + n + 1 > r->cap) {
        size_t ncap = (r->n + n + 1) * 2;
        char *p = realloc(r->p, ncap);
        if (!p)
            return ks_fail(KS_ERR_NOMEM, "out of memory for the reply");
        r->p = p;
        r->cap = ncap;
    }
    memcpy(r->p + r->n, s, n);
    r->n += n;
    return KS_OK;
}

/* Sample until end-of-generation or n_predict; the reply joins the chat. */
static ks_status generate_reply(struct chat *c)
{
    struct reply r = {0};
    const char *bytes;
    size_t len;
    ks_status st = KS_OK;
    tok_stream_reset(c->stream);
    for (int i = 0; i < c->o->n_predict && !st; i++) {
        struct sample_result res;
        if ((st = sample_next(c->sampler, c->logits, c->hist, c->n_hist, &res)))
            break;
        c->hist[c->n_hist++] = res.token; /* an end token is kept but not fed */
        if (tok_is_eog(c->tok, res.token))
            break;
        if (!(st = tok_stream_push(c->stream, res.token, &bytes, &len)) && !(st = reply_put(&r, bytes, len)))
            st = feed_pending(c);
    }
    if (!st && !(st = tok_stream_flush(c->stream, &bytes, &len)))
        st = reply_put(&r, bytes, len);
    printf("\n");
    if (!st)
        st = add_msg(c, "assistant", r.p ? r.p : "", r.n);
    free(r.p);
    return st;
}

static void reset_chat(struct chat *c)
{
    size_t keep = c->o->system ? 1 : 0;
    for (size_t i = keep; i < c->n_msgs; i++)
        free((char *)c->msgs[i].content);
    c->n_msgs = keep;
    kv_seq_truncate(c->e.kv, c->seq, 0);
    c->n_kv = c->n_hist = 0;
}

static int chat_loop(struct chat *c)
{
    char *line = NULL;
    size_t cap = 0;
    int rc = 0;
    for (;;) {
        printf("> ");
        fflush(stdout);
        ssize_t n = getline(&line, &cap, stdin);
        if (n < 0)
            break;
        while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r'))
            line[--n] = 0;
        if (!n)
            continue;
        if (!strcmp(line, "/exit") || !strcmp(line, "/quit"))
            break;
        if (!strcmp(line, "/reset")) {
            reset_chat(c);
            continue;
        }
        ks_status st = add_msg(c, "user", line, (size_t)n);
        if (!st && !(st = prepare_turn(c)))
            st = generate_reply(c);
        if (st) {
            fprintf(stderr, "kvserve chat: %s\n", ks_errmsg());
            if (st != KS_ERR_RANGE) {
                rc = 1;
                break;
            }
            free((char *)c->msgs[--c->n_msgs].content); /* drop the turn that did not fit */
        }
    }
    free(line);
    printf("\n");
    return rc;
}

int cli_chat(int argc, char **argv)
{
    struct chat_opts o;
    int prc = chat_parse(argc, argv, &o);
    if (prc)
        return prc < 0 ? 0 : prc;
    char default_path[4096];
    const char *path = cli_model_path("chat", o.model, default_path, sizeof default_path);
    if (!path)
        return 2;
    struct chat c = {.o = &o};
    int rc = 1;
    if (chat_setup(&c, path))
        fprintf(stderr, "kvserve chat: %s\n", ks_errmsg());
    else
        rc = chat_loop(&c);
    chat_free(&c);
    return rc;
}
