/* kvserve template: render a chat request through a model's own Jinja chat
 * template (or one from a file) and print exactly the prompt text, as
 * llama-server --jinja would build it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "gguf/gguf.h"
#include "jinja/jinja.h"
#include "tokenizer/tokenizer.h"

static void template_usage(FILE *out)
{
    fprintf(out,
            "usage: kvserve template [-m MODEL.gguf] [--chat-template-file F] --request REQ.json [--now YYYY-MM-DD]\n"
            "\n"
            "Print the prompt text (no newline added) that the chat template makes of an\n"
            "OpenAI-style chat request: {\"messages\": [...], \"tools\": [...], \"chat_template_kwargs\": {...}}.\n"
            "The template is the model's tokenizer.chat_template unless --chat-template-file\n"
            "is given; BOS and EOS texts come from the model's vocabulary. A BOS the template\n"
            "prints first is left out (tokenization adds it).\n"
            "\n"
            "  -m, --model PATH            GGUF model or vocabulary (default: the built-in default model)\n"
            "      --chat-template-file F  Jinja template to use instead of the model's\n"
            "      --request FILE          the request JSON ('-' for stdin)\n"
            "      --now YYYY-MM-DD        the date strftime_now and date_string see (default: today, UTC)\n"
            "      --no-generation-prompt  do not end with the assistant's header\n");
}

/* "2026-11-24" as seconds since the epoch at 00:00 UTC. */
static bool parse_date(const char *s, int64_t *out)
{
    struct tm tm = {0};
    const char *end = strptime(s, "%Y-%m-%d", &tm);
    if (!end || *end)
        return false;
    *out = (int64_t)timegm(&tm);
    return true;
}

struct template_args {
    const char *model, *template_file, *request_file;
    int64_t now;
    bool generation_prompt;
};

/* 0 = run, 1 = --help printed, 2 = usage error. */
static int parse_template_args(int argc, char **argv, struct template_args *a)
{
    *a = (struct template_args){.now = (int64_t)time(NULL), .generation_prompt = true};
    for (int i = 1; i < argc; i++) {
        const char *s = argv[i];
        bool has_value = i + 1 < argc;
        if (!strcmp(s, "-h") || !strcmp(s, "--help")) {
            template_usage(stdout);
            return 1;
        } else if ((!strcmp(s, "-m") || !strcmp(s, "--model")) && has_value) {
            a->model = argv[++i];
        } else if (!strcmp(s, "--chat-template-file") && has_value) {
            a->template_file = argv[++i];
        } else if (!strcmp(s, "--request") && has_value) {
            a->request_file = argv[++i];
        } else if (!strcmp(s, "--now") && has_value) {
            if (!parse_date(argv[++i], &a->now)) {
                fprintf(stderr, "kvserve template: bad value '%s' for --now (want YYYY-MM-DD)\n\n", argv[i]);
                template_usage(stderr);
                return 2;
            }
        } else if (!strcmp(s, "--no-generation-prompt")) {
            a->generation_prompt = false;
        } else {
            fprintf(stderr, "kvserve template: unknown or incomplete option '%s'\n\n", s);
            template_usage(stderr);
            return 2;
        }
    }
    if (!a->request_file) {
        fprintf(stderr, "kvserve template: --request FILE is required\n\n");
        template_usage(stderr);
        return 2;
    }
    return 0;
}

/* The template source: the file's, else the model's tokenizer.chat_template. */
static char *template_source(const struct template_args *a, const struct gguf_file *f, size_t *len)
{
    if (a->template_file) {
        char *src = cli_read_file(a->template_file, len);
        if (!src)
            fprintf(stderr, "kvserve template: cannot read %s\n", a->template_file);
        return src;
    }
    struct gguf_str s;
    if (gguf_get_str(f, "tokenizer.chat_template", &s)) {
        fprintf(stderr, "kvserve template: %s has no tokenizer.chat_template; give --chat-template-file F\n", a->model);
        return NULL;
    }
    *len = (size_t)s.len;
    return strndup(s.data, (size_t)s.len);
}

static int render_request(const struct template_args *a, const struct tokenizer *t, const char *src, size_t src_len)
{
    const char *src_name = a->template_file ? a->template_file : "tokenizer.chat_template";
    size_t req_len = 0;
    char *req_text = cli_read_file(a->request_file, &req_len);
    if (!req_text) {
        fprintf(stderr, "kvserve template: cannot read %s\n", a->request_file);
        return 1;
    }
    cJSON *req = cJSON_ParseWithLength(req_text, req_len);
    free(req_text);
    if (!req) {
        fprintf(stderr, "kvserve template: %s is not JSON\n", a->request_file);
        return 1;
    }
    const cJSON *agp = cJSON_GetObjectItemCaseSensitive(req, "add_generation_prompt");
    const cJSON *kwargs = cJSON_GetObjectItemCaseSensitive(req, "chat_template_kwargs");
    struct jinja_template *tmpl = NULL;
    const struct tok_special *sp = tok_special(t);
    char *bos = tok_text_dup(t, sp->bos), *eos = tok_text_dup(t, sp->eos);
    struct jinja_chat chat = {bos, eos, cJSON_IsBool(agp) ? cJSON_IsTrue(agp) : a->generation_prompt,
                              cJSON_IsNull(kwargs) ? NULL : kwargs};
    struct jinja_opts opts = {.now = a->now};
    char *out = NULL;
    size_t n = 0;
    int rc = 1;
    if (!bos || !eos)
        fprintf(stderr, "kvserve template: out of memory\n");
    else if (jinja_parse(src, src_len, &tmpl))
        fprintf(stderr, "kvserve template: %s: %s\n", src_name, ks_errmsg());
    else if (jinja_chat_render(tmpl, req, &chat, &opts, &out, &n))
        fprintf(stderr, "kvserve template: rendering %s with %s: %s\n", a->request_file, src_name, ks_errmsg());
    else
        rc = fwrite(out, 1, n, stdout) == n && fflush(stdout) == 0 ? 0 : 1;
    free(out);
    jinja_free(tmpl);
    free(bos);
    free(eos);
    cJSON_Delete(req);
    return rc;
}

int cli_template(int argc, char **argv)
{
    struct template_args a;
    int st = parse_template_args(argc, argv, &a);
    if (st)
        return st == 1 ? 0 : 2;
    char default_path[4096];
    if (!a.model) {
        if (!cli_default_model(default_path, sizeof default_path)) {
            fprintf(stderr, "kvserve template: no -m MODEL and no built-in default model\n");
            return 2;
        }
        a.model = default_path;
    }
    struct gguf_file *f = NULL;
    struct tokenizer *t = NULL;
    if (gguf_open(a.model, &f) || tok_load(f, &t)) {
        fprintf(stderr, "kvserve template: %s: %s\n", a.model, ks_errmsg());
        gguf_close(f);
        return 1;
    }
    size_t src_len = 0;
    char *src = template_source(&a, f, &src_len);
    int rc = src ? render_request(&a, t, src, src_len) : 1;
    free(src);
    tok_free(t);
    gguf_close(f);
    return rc;
}
