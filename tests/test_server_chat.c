/* Chat over HTTP with the models' own templates: the server renders every
 * corpus template (../shared/templates, 60 templates x 6 conversations) and
 * the prompt the engine receives must be the tokens of llama.cpp's rendering;
 * then tool calls: a mock engine that writes a scripted text (a tool call in
 * each family's format) must come back as OpenAI tool_calls, whole and
 * streamed. The vocabulary is Llama 3's (../shared/models/vocab), the BOS and
 * EOS texts the corpus was rendered with. Exits 77 without the corpus. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "gguf/gguf.h"
#include "httpc/httpc.h"
#include "server/server.h"
#include "support/deadline.h"
#include "support/read_file.h"
#include "support/skip.h"

#define MAX_SEQ 8
#define CTX 4096
#define CORPUS_NOW 1795478400 /* 2026-11-24, the date of the corpus renderings */

/* ---- mock engine: records the prompt, writes a script -------------------------------- */

struct mock {
    int32_t n_vocab;
    int32_t *hist[MAX_SEQ];
    int32_t len[MAX_SEQ];
    bool live[MAX_SEQ], seen[MAX_SEQ];
};

static struct {
    pthread_mutex_t mu;
    int32_t *prompt; /* the tokens of the last prompt the engine received */
    int32_t n_prompt;
    int32_t *script; /* what the next request's sampler emits, then EOS */
    int32_t n_script;
    int32_t eos;
} M = {.mu = PTHREAD_MUTEX_INITIALIZER};

struct script_sampler {
    int32_t *ids;
    int32_t n, at;
};

static ks_status m_seq_create(void *ctx, int32_t *out)
{
    struct mock *m = ctx;
    for (int i = 0; i < MAX_SEQ; i++)
        if (!m->live[i]) {
            m->live[i] = true;
            m->seen[i] = false;
            m->len[i] = 0;
            *out = i;
            return KS_OK;
        }
    return ks_fail(KS_ERR_KV_FULL, "no slots");
}

static void m_seq_free(void *ctx, int32_t seq)
{
    struct mock *m = ctx;
    m->live[seq] = false;
}

static ks_status m_forward(void *ctx, const struct sched_batch *b, float *logits)
{
    struct mock *m = ctx;
    int32_t row = 0;
    for (int32_t i = 0; i < b->n_tokens; i++) {
        int32_t s = b->seq[i];
        if (m->len[s] < CTX)
            m->hist[s][m->len[s]++] = b->tokens[i];
        if (b->want_logits[i]) {
            if (!m->seen[s]) { /* the first logits end the prompt */
                m->seen[s] = true;
                pthread_mutex_lock(&M.mu);
                free(M.prompt);
                M.prompt = malloc((size_t)m->len[s] * sizeof *M.prompt);
                memcpy(M.prompt, m->hist[s], (size_t)m->len[s] * sizeof *M.prompt);
                M.n_prompt = m->len[s];
                pthread_mutex_unlock(&M.mu);
            }
            memset(logits + (size_t)row++ * m->n_vocab, 0, (size_t)m->n_vocab * sizeof *logits);
        }
    }
    return KS_OK;
}

static ks_status m_sampler_create(void *ctx, const struct sample_params *p, void **out)
{
    (void)ctx;
    (void)p;
    struct script_sampler *s = calloc(1, sizeof *s);
    pthread_mutex_lock(&M.mu);
    s->n = M.n_script;
    s->ids = malloc((size_t)(s->n + 1) * sizeof *s->ids);
    if (s->n)
        memcpy(s->ids, M.script, (size_t)s->n * sizeof *s->ids);
    pthread_mutex_unlock(&M.mu);
    *out = s;
    return KS_OK;
}

static ks_status m_sampler_next(void *ctx, void *smp, const float *logits, const int32_t *hist, int32_t n,
                                struct sample_result *out)
{
    (void)ctx;
    (void)logits;
    (void)hist;
    (void)n;
    struct script_sampler *s = smp;
    memset(out, 0, sizeof *out);
    out->token = s->at < s->n ? s->ids[s->at++] : M.eos;
    return KS_OK;
}

static void m_sampler_free(void *ctx, void *smp)
{
    (void)ctx;
    struct script_sampler *s = smp;
    free(s->ids);
    free(s);
}

static void m_destroy(void *ctx)
{
    struct mock *m = ctx;
    for (int i = 0; i < MAX_SEQ; i++)
        free(m->hist[i]);
    free(m);
}

static struct sched *mock_sched(int32_t n_vocab, int32_t eos)
{
    struct mock *m = calloc(1, sizeof *m);
    m->n_vocab = n_vocab;
    for (int i = 0; i < MAX_SEQ; i++)
        m->hist[i] = calloc(CTX, sizeof(int32_t));
    struct sched_engine e = {
        .ctx = m, .n_vocab = n_vocab, .seq_create = m_seq_create, .seq_free = m_seq_free, .forward = m_forward,
        .sampler_create = m_sampler_create, .sampler_next = m_sampler_next, .sampler_free = m_sampler_free,
        .destroy = m_destroy,
    };
    static int32_t eog[1];
    eog[0] = eos;
    struct sched_config cfg;
    sched_config_default(&cfg);
    cfg.parallel = 4;
    cfg.max_batch_tokens = 512;
    cfg.prefill_chunk = 512;
    cfg.ctx_size = CTX;
    cfg.eog = eog;
    cfg.n_eog = 1;
    struct sched *s = NULL;
    assert_int_equal(sched_create(&cfg, &e, &s), KS_OK);
    return s;
}

/* ---- fixture -------------------------------------------------------------------------- */

static struct {
    char dir[4096];
    struct gguf_file *vocab;
    struct tokenizer *tok;
    struct sched *sched;
    cJSON *conversations;
} F;

static struct server *start_with(const char *jinja_src, const char *family)
{
    struct server_config cfg;
    server_config_default(&cfg);
    cfg.port = 0;
    cfg.ctx_size = CTX;
    cfg.model_name = "mock";
    cfg.chat_template_jinja = jinja_src;
    cfg.chat_template = family;
    cfg.chat_now = CORPUS_NOW;
    struct server *srv = NULL;
    ks_status st = server_start(&cfg, F.sched, F.tok, &srv);
    if (st)
        print_message("server_start: %s\n", ks_errmsg());
    assert_int_equal(st, KS_OK);
    server_set_ready(srv, true);
    return srv;
}

static int setup(void **state)
{
    (void)state;
    char path[4200];
    snprintf(path, sizeof path, "%s/models/vocab/ggml-vocab-llama3.gguf", F.dir);
    if (gguf_open(path, &F.vocab) || tok_load(F.vocab, &F.tok)) {
        fprintf(stderr, "setup: %s: %s\n", path, ks_errmsg());
        return -1;
    }
    M.eos = tok_special(F.tok)->eos;
    F.sched = mock_sched(tok_n_vocab(F.tok), M.eos);
    snprintf(path, sizeof path, "%s/templates/conversations.json", F.dir);
    char *text = ks_read_file(path, NULL);
    F.conversations = text ? cJSON_Parse(text) : NULL;
    free(text);
    return F.conversations ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    sched_free(F.sched);
    tok_free(F.tok);
    gguf_close(F.vocab);
    cJSON_Delete(F.conversations);
    free(M.prompt);
    free(M.script);
    return 0;
}

/* ---- HTTP ------------------------------------------------------------------------------ */

static struct httpc_response post_to(struct server *srv, const char *path, const char *json)
{
    char url[256];
    snprintf(url, sizeof url, "http://127.0.0.1:%d%s", server_port(srv), path);
    struct httpc_request rq = {.method = "POST", .url = url, .body = json, .body_len = strlen(json),
                               .timeout_s = KS_WAIT_SECONDS};
    struct httpc_response r;
    ks_status st = httpc_request(&rq, &r);
    if (st)
        print_message("POST: %s\n", ks_errmsg());
    assert_int_equal(st, KS_OK);
    return r;
}

static struct httpc_response post(struct server *srv, const char *json)
{
    return post_to(srv, "/v1/chat/completions", json);
}

/* POST req (a cJSON object, not consumed) and return the parsed body; *status the HTTP status. */
static cJSON *post_json(struct server *srv, const cJSON *req, long *status)
{
    char *body = cJSON_PrintUnformatted(req);
    struct httpc_response r = post(srv, body);
    free(body);
    cJSON *j = cJSON_ParseWithLength(r.body, r.len);
    if (!j)
        print_message("not JSON (%ld): %.*s\n", r.status, (int)r.len, r.body);
    assert_non_null(j);
    *status = r.status;
    httpc_response_free(&r);
    return j;
}

/* The tokens the server must send for this rendered text: BOS (the template's
 * was stripped) and the text with special tokens parsed. */
static void expected_ids(const char *rendered, int32_t **ids, size_t *n)
{
    assert_int_equal(tok_encode(F.tok, rendered, strlen(rendered), TOK_ADD_SPECIAL | TOK_PARSE_SPECIAL, ids, n), KS_OK);
}

/* ---- the corpus over HTTP ---------------------------------------------------------------- */

static void test_corpus_prompts(void **state)
{
    (void)state;
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/templates", F.dir);
    DIR *d = opendir(dir);
    assert_non_null(d);
    int checked = 0, matched = 0, refused = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t nl = strlen(e->d_name);
        if (nl < 7 || strcmp(e->d_name + nl - 6, ".jinja"))
            continue;
        char path[8400];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        char *src = ks_read_file(path, NULL);
        snprintf(path, sizeof path, "%s/rendered/%.*s.json", dir, (int)(nl - 6), e->d_name);
        char *rtext = ks_read_file(path, NULL);
        assert_non_null(src);
        assert_non_null(rtext);
        cJSON *rendered = cJSON_Parse(rtext);
        free(rtext);
        struct server *srv = start_with(src, NULL);
        const cJSON *conv;
        cJSON_ArrayForEach(conv, F.conversations) {
            const cJSON *want = cJSON_GetObjectItemCaseSensitive(rendered, conv->string);
            cJSON *req = cJSON_Duplicate(conv, 1);
            cJSON_AddNumberToObject(req, "max_tokens", 1);
            long status = 0;
            cJSON *j = post_json(srv, req, &status);
            cJSON_Delete(req);
            if (!cJSON_IsString(want)) { /* llama.cpp refused it: so must we */
                if (status != 400)
                    print_message("%s %s: llama.cpp refused it, kvserve answered %ld\n", e->d_name, conv->string,
                                  status);
                refused += status == 400;
                checked++;
                cJSON_Delete(j);
                continue;
            }
            /* /apply-template answers the text itself */
            char *rbody = cJSON_PrintUnformatted(conv);
            struct httpc_response ar = post_to(srv, "/apply-template", rbody);
            free(rbody);
            cJSON *aj = cJSON_ParseWithLength(ar.body, ar.len);
            const cJSON *prompt = cJSON_GetObjectItemCaseSensitive(aj, "prompt");
            if (ar.status != 200 || !cJSON_IsString(prompt) || strcmp(prompt->valuestring, want->valuestring))
                print_message("%s %s: /apply-template %ld %.*s\n", e->d_name, conv->string, ar.status, (int)ar.len,
                              ar.body);
            assert_int_equal(ar.status, 200);
            assert_string_equal(prompt->valuestring, want->valuestring);
            cJSON_Delete(aj);
            httpc_response_free(&ar);
            int32_t *ids = NULL;
            size_t n = 0;
            expected_ids(want->valuestring, &ids, &n);
            pthread_mutex_lock(&M.mu);
            bool same = status == 200 && (size_t)M.n_prompt == n && !memcmp(M.prompt, ids, n * sizeof *ids);
            if (!same) {
                char *got = NULL;
                size_t gl = 0;
                if (status == 200)
                    tok_decode(F.tok, M.prompt, (size_t)M.n_prompt, TOK_DECODE_SPECIAL, &got, &gl);
                print_message("%s %s: status %ld, the engine's prompt differs from llama.cpp's rendering\n"
                              "--- want\n%s\n--- got\n%s\n",
                              e->d_name, conv->string, status, want->valuestring, got ? got : "(none)");
                free(got);
            }
            pthread_mutex_unlock(&M.mu);
            const cJSON *usage = cJSON_GetObjectItemCaseSensitive(j, "usage");
            if (same)
                same = cJSON_GetObjectItemCaseSensitive(usage, "prompt_tokens")->valueint == (int)n;
            matched += same;
            checked++;
            free(ids);
            cJSON_Delete(j);
        }
        server_stop(srv);
        cJSON_Delete(rendered);
        free(src);
    }
    closedir(d);
    print_message("corpus over HTTP: %d of %d renderings sent exactly, %d refusals kept\n", matched + refused, checked,
                  refused);
    assert_true(checked >= 300);
    assert_int_equal(matched + refused, checked);
}

/* ---- errors ------------------------------------------------------------------------------- */

static void expect_400(struct server *srv, const char *body, const char *needle)
{
    struct httpc_response r = post(srv, body);
    if (r.status != 400 || !strstr(r.body, needle))
        print_message("want 400 with '%s', got %ld: %.*s\n", needle, r.status, (int)r.len, r.body);
    assert_int_equal(r.status, 400);
    assert_non_null(strstr(r.body, needle));
    httpc_response_free(&r);
}

static void test_errors(void **state)
{
    (void)state;
    /* a template that does not parse: an error at start naming line and column */
    struct server_config cfg;
    server_config_default(&cfg);
    cfg.port = 0;
    cfg.chat_template_jinja = "{% for m in messages %}\n{{ m.content }\n{% endfor %}";
    cfg.chat_template_origin = "bad.jinja";
    struct server *srv = NULL;
    assert_int_equal(server_start(&cfg, F.sched, F.tok, &srv), KS_ERR_FORMAT);
    assert_null(srv);
    assert_non_null(strstr(ks_errmsg(), "bad.jinja"));
    print_message("%s\n", ks_errmsg());
    assert_non_null(strstr(ks_errmsg(), "line "));

    const char *raising = "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}"
                          "{% endif %}{{ m.content }}{% endfor %}{{ extra }}";
    srv = start_with(raising, NULL);
    expect_400(srv, "{\"messages\": [{\"role\": \"tool\", \"tool_call_id\": \"c1\", \"content\": \"x\"}]}", "no tools here");
    expect_400(srv, "{\"messages\": [{\"role\": \"robot\", \"content\": \"x\"}]}", "messages[0].role");
    expect_400(srv, "{\"messages\": [{\"role\": \"user\", \"content\": 5}]}", "messages[0].content");
    /* parts kvserve cannot read are refused by their field and type, never dropped */
    expect_400(srv, "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\"}]}]}",
               "messages[0].content[0].type 'image_url' is not supported");
    expect_400(srv,
               "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"a\"}, "
               "{\"type\": \"input_audio\", \"input_audio\": {}}]}]}",
               "messages[0].content[1].type 'input_audio'");
    expect_400(srv, "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"file\", \"file\": {}}]}]}",
               "messages[0].content[0].type 'file'");
    expect_400(srv, "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\"}]}]}",
               "messages[0].content[0] must be");
    expect_400(srv,
               "{\"messages\": [{\"role\": \"assistant\", \"tool_calls\": [{\"type\": \"function\", \"function\": "
               "{\"name\": \"f\", \"arguments\": \"{not json\"}}]}]}",
               "arguments is not JSON");
    expect_400(srv, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"chat_template_kwargs\": 3}",
               "chat_template_kwargs");
    expect_400(srv, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": {}}", "'tools'");
    expect_400(srv,
               "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": [{\"type\": \"function\"}]}",
               "tools[0]");
    expect_400(srv, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tool_choice\": \"sometimes\"}",
               "'tool_choice'");
    expect_400(srv, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tool_choice\": \"required\"}",
               "non-empty 'tools'");
    expect_400(srv,
               "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": [{\"type\": \"function\", "
               "\"function\": {\"name\": \"f\"}}], \"tool_choice\": {\"type\": \"function\", \"function\": "
               "{\"name\": \"g\"}}}",
               "not in 'tools'");
    expect_400(srv, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"parallel_tool_calls\": 1}",
               "parallel_tool_calls");

    /* chat_template_kwargs reach the template */
    cJSON *req = cJSON_Parse("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 1, "
                             "\"chat_template_kwargs\": {\"extra\": \" there\"}}");
    long status = 0;
    cJSON *j = post_json(srv, req, &status);
    assert_int_equal(status, 200);
    int32_t *ids;
    size_t n;
    expected_ids("hi there", &ids, &n);
    pthread_mutex_lock(&M.mu);
    assert_int_equal(M.n_prompt, (int32_t)n);
    assert_memory_equal(M.prompt, ids, n * sizeof *ids);
    pthread_mutex_unlock(&M.mu);
    free(ids);
    cJSON_Delete(j);
    cJSON_Delete(req);

    /* a render limit: 413 */
    const char *big = "{% for i in range(100000) %}0123456789abcdef{% endfor %}";
    server_stop(srv);
    srv = start_with(big, NULL);
    struct httpc_response r = post(srv, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}");
    assert_int_equal(r.status, 413);
    httpc_response_free(&r);
    server_stop(srv);

    /* a named family takes no tool messages */
    srv = start_with(NULL, "chatml");
    expect_400(srv, "{\"messages\": [{\"role\": \"tool\", \"tool_call_id\": \"c1\", \"content\": \"x\"}]}", "chatml");
    /* nor tools: refused by name, never dropped */
    expect_400(srv,
               "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": [{\"type\": \"function\", "
               "\"function\": {\"name\": \"f\", \"parameters\": {\"type\": \"object\"}}}]}",
               "'tools': the chatml chat template");
    server_stop(srv);
}

/* ---- tool calls over HTTP ------------------------------------------------------------------ */

struct tool_stream {
    char content[4096];
    char reasoning[4096];
    bool content_null;     /* no content delta at all */
    int n_calls;
    char ids[4][64], names[4][64], args[4][512];
    char finish[32];
    bool bad_first_delta;  /* a call's first delta lacked id/type/name or had arguments other than "" */
};

static ks_status on_tool_event(void *user, const char *data, size_t len)
{
    struct tool_stream *s = user;
    cJSON *j = cJSON_ParseWithLength(data, len);
    assert_non_null(j);
    cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    cJSON *delta = cJSON_GetObjectItem(ch, "delta");
    cJSON *t = cJSON_GetObjectItem(delta, "content");
    if (cJSON_IsString(t))
        strncat(s->content, t->valuestring, sizeof s->content - strlen(s->content) - 1);
    t = cJSON_GetObjectItem(delta, "reasoning_content");
    if (cJSON_IsString(t))
        strncat(s->reasoning, t->valuestring, sizeof s->reasoning - strlen(s->reasoning) - 1);
    cJSON *tc;
    cJSON_ArrayForEach(tc, cJSON_GetObjectItem(delta, "tool_calls")) {
        int i = cJSON_GetObjectItem(tc, "index")->valueint;
        assert_true(i >= 0 && i < 4);
        cJSON *fn = cJSON_GetObjectItem(tc, "function");
        cJSON *id = cJSON_GetObjectItem(tc, "id"), *name = cJSON_GetObjectItem(fn, "name");
        cJSON *args = cJSON_GetObjectItem(fn, "arguments");
        if (i == s->n_calls) { /* the first delta of a call */
            s->n_calls++;
            if (!cJSON_IsString(id) || !cJSON_IsString(name) || !cJSON_IsString(cJSON_GetObjectItem(tc, "type")) ||
                !cJSON_IsString(args) || args->valuestring[0])
                s->bad_first_delta = true;
            else {
                snprintf(s->ids[i], sizeof s->ids[i], "%s", id->valuestring);
                snprintf(s->names[i], sizeof s->names[i], "%s", name->valuestring);
            }
        }
        if (cJSON_IsString(args))
            strncat(s->args[i], args->valuestring, sizeof s->args[i] - strlen(s->args[i]) - 1);
    }
    cJSON *f = cJSON_GetObjectItem(ch, "finish_reason");
    if (cJSON_IsString(f))
        snprintf(s->finish, sizeof s->finish, "%s", f->valuestring);
    cJSON_Delete(j);
    return KS_OK;
}

static void set_script(const char *text)
{
    int32_t *ids = NULL;
    size_t n = 0;
    assert_int_equal(tok_encode(F.tok, text, strlen(text), TOK_PARSE_SPECIAL, &ids, &n), KS_OK);
    pthread_mutex_lock(&M.mu);
    free(M.script);
    M.script = ids;
    M.n_script = (int32_t)n;
    pthread_mutex_unlock(&M.mu);
}

struct tool_case {
    const char *tmpl;        /* corpus file, or under tests/data/templates when it starts with "local:" */
    const char *tool_choice; /* JSON, NULL: absent */
    const char *script;      /* what the model writes */
    const char *content;     /* NULL: content null */
    int n_calls;
    const char *names[2], *args[2];
};

/* The answer wanted besides tc's: reasoning_content (NULL: none), the
 * request's extra fields (JSON object text, NULL: none; they replace the
 * defaults), finish_reason (NULL: tool_calls with calls, else stop). */
struct want_more {
    const char *reasoning;
    const char *extra;
    const char *finish;
};

/* no_tools: the request offers none (harmony still splits its reasoning off). */
static void check_case(const struct tool_case *tc, const struct want_more *more, bool no_tools)
{
    const char *want_reasoning = more->reasoning;
    char path[4400];
    const char *source = getenv("KVSERVE_SOURCE");
    if (!strncmp(tc->tmpl, "local:", 6))
        snprintf(path, sizeof path, "%s/tests/data/templates/%s", source ? source : ".", tc->tmpl + 6);
    else
        snprintf(path, sizeof path, "%s/templates/%s", F.dir, tc->tmpl);
    char *src = ks_read_file(path, NULL);
    assert_non_null(src);
    struct server *srv = start_with(src, NULL);
    set_script(tc->script);
    cJSON *req = cJSON_Duplicate(cJSON_GetObjectItem(F.conversations, "tools"), 1);
    if (no_tools)
        cJSON_DeleteItemFromObject(req, "tools");
    cJSON_AddNumberToObject(req, "max_tokens", 300);
    if (tc->tool_choice)
        cJSON_AddItemToObject(req, "tool_choice", cJSON_Parse(tc->tool_choice));
    cJSON *extra = more->extra ? cJSON_Parse(more->extra) : NULL;
    for (cJSON *e = extra ? extra->child : NULL; e; e = e->next) {
        cJSON_DeleteItemFromObject(req, e->string);
        cJSON_AddItemToObject(req, e->string, cJSON_Duplicate(e, 1));
    }
    cJSON_Delete(extra);
    const char *finish = more->finish ? more->finish : tc->n_calls ? "tool_calls" : "stop";

    /* whole */
    long status = 0;
    cJSON *j = post_json(srv, req, &status);
    assert_int_equal(status, 200);
    cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    cJSON *msg = cJSON_GetObjectItem(ch, "message");
    cJSON *content = cJSON_GetObjectItem(msg, "content");
    if (tc->content) {
        if (!cJSON_IsString(content) || strcmp(content->valuestring, tc->content))
            print_message("%s: content %s, want '%s'\n", tc->tmpl, cJSON_PrintUnformatted(msg), tc->content);
        assert_true(cJSON_IsString(content));
        assert_string_equal(content->valuestring, tc->content);
    } else {
        assert_true(cJSON_IsNull(content));
    }
    cJSON *reasoning = cJSON_GetObjectItem(msg, "reasoning_content");
    if (want_reasoning)
        assert_string_equal(cJSON_IsString(reasoning) ? reasoning->valuestring : "(none)", want_reasoning);
    else
        assert_null(reasoning);
    cJSON *calls = cJSON_GetObjectItem(msg, "tool_calls");
    assert_int_equal(cJSON_GetArraySize(calls), tc->n_calls);
    for (int i = 0; i < tc->n_calls; i++) {
        cJSON *c = cJSON_GetArrayItem(calls, i);
        assert_string_equal(cJSON_GetObjectItem(c, "type")->valuestring, "function");
        assert_true(cJSON_IsString(cJSON_GetObjectItem(c, "id")));
        cJSON *fn = cJSON_GetObjectItem(c, "function");
        assert_string_equal(cJSON_GetObjectItem(fn, "name")->valuestring, tc->names[i]);
        assert_string_equal(cJSON_GetObjectItem(fn, "arguments")->valuestring, tc->args[i]);
    }
    assert_string_equal(cJSON_GetObjectItem(ch, "finish_reason")->valuestring, finish);
    cJSON_Delete(j);

    /* streamed */
    cJSON_AddTrueToObject(req, "stream");
    char *body = cJSON_PrintUnformatted(req);
    struct httpc_response r = post(srv, body);
    free(body);
    assert_int_equal(r.status, 200);
    struct tool_stream s = {0};
    struct httpc_sse *p;
    assert_int_equal(httpc_sse_create(1 << 20, on_tool_event, &s, &p), KS_OK);
    assert_int_equal(httpc_sse_feed(p, r.body, r.len), KS_OK);
    assert_int_equal(httpc_sse_end(p), KS_OK);
    assert_true(httpc_sse_done(p));
    httpc_sse_free(p);
    httpc_response_free(&r);
    assert_false(s.bad_first_delta);
    assert_string_equal(s.content, tc->content ? tc->content : "");
    assert_string_equal(s.reasoning, want_reasoning ? want_reasoning : "");
    assert_int_equal(s.n_calls, tc->n_calls);
    for (int i = 0; i < tc->n_calls; i++) {
        assert_string_equal(s.names[i], tc->names[i]);
        assert_string_equal(s.args[i], tc->args[i]);
    }
    assert_string_equal(s.finish, finish);
    cJSON_Delete(req);
    server_stop(srv);
    free(src);
}

static void check_tool_case(const struct tool_case *tc, const char *want_reasoning, bool no_tools)
{
    check_case(tc, &(struct want_more){.reasoning = want_reasoning}, no_tools);
}

static void test_tool_calls(void **state)
{
    (void)state;
    static const struct tool_case cases[] = {
        {"Qwen-Qwen2.5-7B-Instruct.jinja", NULL,
         "Checking.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
         "Checking.", 1, {"get_weather"}, {"{\"city\":\"Paris\"}"}},
        {"Qwen-Qwen2.5-7B-Instruct.jinja", "\"required\"",
         "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n<tool_call>{\"name\": \"b\", \"arguments\": "
         "{\"x\": 1}}</tool_call>",
         NULL, 2, {"a", "b"}, {"{}", "{\"x\":1}"}},
        {"Qwen-Qwen2.5-7B-Instruct.jinja", "\"none\"", "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>",
         "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>", 0, {0}, {0}},
        {"Qwen-Qwen2.5-7B-Instruct.jinja", NULL, "<tool_call>{\"name\": broken</tool_call>",
         "<tool_call>{\"name\": broken</tool_call>", 0, {0}, {0}},
        {"meta-llama-Llama-3.1-8B-Instruct.jinja", NULL,
         "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}", NULL, 1,
         {"get_weather"}, {"{\"city\":\"Rome\"}"}},
        {"meta-llama-Llama-3.2-3B-Instruct.jinja",
         "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\"}}",
         "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}", NULL, 1, {"get_weather"},
         {"{\"city\":\"Oslo\"}"}},
        {"mistralai-Mistral-Nemo-Instruct-2407.jinja", NULL,
         "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lima\"}, \"id\": \"abcdefghi\"}]",
         NULL, 1, {"get_weather"}, {"{\"city\":\"Lima\"}"}},
        {"Qwen-Qwen2.5-7B-Instruct.jinja", NULL, "Just text, no < tool call.", "Just text, no < tool call.", 0, {0},
         {0}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        print_message("tool case %zu: %s\n", i, cases[i].tmpl);
        check_tool_case(&cases[i], NULL, false);
    }
    set_script("");
}

/* gpt-oss's harmony: the analysis channel is reasoning_content, final is
 * content, a commentary message to=functions.NAME a call (the model's
 * <|call|> ends the generation), with or without tools, whole and streamed;
 * tool_choice required constrains the output to a call in the format. */
static void test_harmony(void **state)
{
    (void)state;
    static const struct {
        struct tool_case tc;
        const char *reasoning;
        bool no_tools;
    } cases[] = {
        {{"local:openai-gpt-oss-20b.jinja", NULL,
          "<|channel|>analysis<|message|>The user wants weather.<|end|><|start|>assistant<|channel|>commentary "
          "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}",
          NULL, 1, {"get_weather"}, {"{\"city\":\"Paris\"}"}},
         "The user wants weather.", false},
        {{"local:openai-gpt-oss-20b.jinja", NULL,
          "<|channel|>analysis<|message|>Say hi.<|end|><|start|>assistant<|channel|>final<|message|>Hi there!",
          "Hi there!", 0, {0}, {0}},
         "Say hi.", true},
        {{"local:openai-gpt-oss-20b.jinja", "\"required\"",
          "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo\"}", NULL, 1,
          {"get_weather"}, {"{\"city\":\"Oslo\"}"}},
         NULL, false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        print_message("harmony case %zu\n", i);
        check_tool_case(&cases[i].tc, cases[i].reasoning, cases[i].no_tools);
    }
    set_script("");
}

/* The last prompt the engine received, as text (special tokens rendered). */
static char *last_prompt_text(void)
{
    char *text = NULL;
    size_t len = 0;
    pthread_mutex_lock(&M.mu);
    assert_int_equal(tok_decode(F.tok, M.prompt, (size_t)M.n_prompt, TOK_DECODE_SPECIAL, &text, &len), KS_OK);
    pthread_mutex_unlock(&M.mu);
    return text;
}

static bool ends_with(const char *s, const char *tail)
{
    size_t n = strlen(s), k = strlen(tail);
    return n >= k && !strcmp(s + n - k, tail);
}

/* <think>...</think> reasoning (llama.cpp's deepseek parser) with the real
 * Qwen3 and DeepSeek-R1 templates, whole and streamed: reasoning_format
 * auto/none/deepseek, enable_thinking reaching the template, a generation
 * prompt that opens <think> (the output starts inside it), a reasoning cut by
 * max_tokens, and tool calls after the reasoning. */
static void test_reasoning(void **state)
{
    (void)state;
#define qwen3 "Qwen-Qwen3-0.6B.jinja"
#define r1 "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"
#define thought "<think>\nLet me add: 2 + 2.\n</think>\n\nThe answer is 4."
#define tool                                                                                                       \
    "<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "       \
    "{\"city\": \"Paris\"}}\n</tool_call>"
    static const struct {
        struct tool_case tc;
        struct want_more more;
        bool no_tools;
        const char *prompt_tail; /* the rendered prompt must end so, NULL: not checked */
    } cases[] = {
        /* Qwen3 thinks by default: its <think> block is the reasoning */
        {{qwen3, NULL, thought, "The answer is 4.", 0, {0}, {0}}, {"Let me add: 2 + 2.", NULL, NULL}, true,
         "<|im_start|>assistant\n"},
        {{qwen3, NULL, thought, "The answer is 4.", 0, {0}, {0}},
         {"Let me add: 2 + 2.", "{\"reasoning_format\": \"deepseek\"}", NULL}, true, NULL},
        /* none: all of it is content */
        {{qwen3, NULL, thought, thought, 0, {0}, {0}}, {NULL, "{\"reasoning_format\": \"none\"}", NULL}, true, NULL},
        /* enable_thinking false reaches the template, which closes an empty think block */
        {{qwen3, NULL, "Just 4.", "Just 4.", 0, {0}, {0}},
         {NULL, "{\"chat_template_kwargs\": {\"enable_thinking\": false}}", NULL}, true,
         "<|im_start|>assistant\n<think>\n\n</think>\n\n"},
        /* an answer that does not think is all content */
        {{qwen3, NULL, "No thoughts < here.", "No thoughts < here.", 0, {0}, {0}}, {NULL, NULL, NULL}, true, NULL},
        /* tool calls after the reasoning */
        {{qwen3, NULL, tool, NULL, 1, {"get_weather"}, {"{\"city\":\"Paris\"}"}}, {"The user wants weather.", NULL, NULL},
         false, NULL},
        /* a generic call after the reasoning the prompt opened */
        {{"deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", NULL,
          "Kyiv, then.\n</think>\n\n{\"tool_call\": {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Kyiv\"}}}",
          NULL, 1, {"get_weather"}, {"{\"city\":\"Kyiv\"}"}},
         {"Kyiv, then.", NULL, NULL}, false, NULL},
        /* DeepSeek-R1's generation prompt opens <think>: the output starts inside it */
        {{r1, NULL, "I reason here.\n</think>\n\nHello!", "Hello!", 0, {0}, {0}}, {"I reason here.", NULL, NULL}, true,
         "<\xef\xbd\x9c" "Assistant\xef\xbd\x9c><think>\n"},
        /* cut by max_tokens inside the reasoning: it is still reasoning ("I", " reason", " here") */
        {{r1, NULL, "I reason here and there.\n</think>\n\nHello!", "", 0, {0}, {0}},
         {"I reason here", "{\"max_tokens\": 3}", "length"}, true, NULL},
        /* output constrained from its first token is the answer, even after a prompt that opened <think> */
        {{r1, NULL, "{\"a\": 1}", "{\"a\": 1}", 0, {0}, {0}},
         {NULL, "{\"response_format\": {\"type\": \"json_object\"}}", NULL}, true, NULL},
        /* a stop string inside the reasoning ends it there */
        {{r1, NULL, "I reason STOP here.\n</think>\n\nHello!", "", 0, {0}, {0}},
         {"I reason", "{\"stop\": \"STOP\"}", NULL}, true, NULL},
        /* deepseek on a template that does not think still splits a <think> block off; auto does not */
        {{"Qwen-Qwen2.5-7B-Instruct.jinja", NULL, "<think>a</think>b", "b", 0, {0}, {0}},
         {"a", "{\"reasoning_format\": \"deepseek\"}", NULL}, true, NULL},
        {{"Qwen-Qwen2.5-7B-Instruct.jinja", NULL, "<think>a</think>b", "<think>a</think>b", 0, {0}, {0}},
         {NULL, NULL, NULL}, true, NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        print_message("reasoning case %zu: %s\n", i, cases[i].tc.tmpl);
        check_case(&cases[i].tc, &cases[i].more, cases[i].no_tools);
        if (cases[i].prompt_tail) {
            char *text = last_prompt_text();
            if (!ends_with(text, cases[i].prompt_tail))
                print_message("prompt ends '%s'\n", text + (strlen(text) > 80 ? strlen(text) - 80 : 0));
            assert_true(ends_with(text, cases[i].prompt_tail));
            free(text);
        }
    }
    set_script("");
#undef qwen3
#undef r1
#undef thought
#undef tool
}

/* chat_template_kwargs reach the template (reasoning_effort also from the
 * top-level field), never replacing what the request itself sets. */
static void test_template_kwargs(void **state)
{
    (void)state;
    struct server *srv = start_with("{{ messages[0].content }}|{{ reasoning_effort }}|{{ enable_thinking }}|{{ x }}",
                                    NULL);
    static const struct {
        const char *body, *prompt;
    } ok[] = {
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"chat_template_kwargs\": "
         "{\"reasoning_effort\": \"low\", \"enable_thinking\": false, \"x\": 3}}",
         "hi|low|False|3"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"reasoning_effort\": \"high\"}", "hi|high|"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"reasoning_effort\": \"high\", "
         "\"chat_template_kwargs\": {\"reasoning_effort\": \"low\"}}",
         "hi|low|"},
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        struct httpc_response r = post_to(srv, "/apply-template", ok[i].body);
        cJSON *j = cJSON_ParseWithLength(r.body, r.len);
        cJSON *p = cJSON_GetObjectItem(j, "prompt");
        if (!cJSON_IsString(p) || strncmp(p->valuestring, ok[i].prompt, strlen(ok[i].prompt)))
            print_message("case %zu: %.*s\n", i, (int)r.len, r.body);
        assert_true(cJSON_IsString(p));
        assert_memory_equal(p->valuestring, ok[i].prompt, strlen(ok[i].prompt));
        cJSON_Delete(j);
        httpc_response_free(&r);
    }
    expect_400(srv, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"chat_template_kwargs\": "
                    "{\"messages\": []}}", "chat_template_kwargs.messages");
    expect_400(srv, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"chat_template_kwargs\": "
                    "{\"bos_token\": \"x\"}}", "chat_template_kwargs.bos_token");
    expect_400(srv, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"chat_template_kwargs\": "
                    "{\"tools\": []}}", "chat_template_kwargs.tools");
    expect_400(srv, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"reasoning_effort\": 3}",
               "reasoning_effort");
    expect_400(srv, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"reasoning_format\": \"raw\"}",
               "reasoning_format");
    server_stop(srv);
}

/* Fields kvserve does not implement are refused by name, unless they hold
 * the value that leaves the output unchanged; bookkeeping fields pass; bad
 * logit_bias and json_schema shapes are 400s naming the field. */
static void test_refusals(void **state)
{
    (void)state;
    struct server *srv = start_with(NULL, NULL);
    set_script("ok");
    static const struct {
        const char *path, *extra, *needle; /* needle NULL: accepted (200) */
    } cases[] = {
        {"/v1/chat/completions", "\"mirostat\": 2, \"mirostat_tau\": 3, \"mirostat_eta\": 0.2", NULL},
        {"/v1/chat/completions", "\"mirostat\": 3", "'mirostat'"},
        {"/v1/chat/completions", "\"mirostat\": 0", NULL},
        {"/v1/chat/completions", "\"dry_multiplier\": 0.8, \"dry_base\": 0.5, \"dry_allowed_length\": 1", NULL},
        {"/v1/chat/completions", "\"dry_multiplier\": 0.8, \"dry_sequence_breakers\": [\"\\n\", \"x\"]", NULL},
        {"/v1/chat/completions", "\"dry_multiplier\": 0.8, \"dry_sequence_breakers\": []", "'dry_sequence_breakers'"},
        {"/v1/chat/completions", "\"dry_penalty_last_n\": -2", "'dry_penalty_last_n'"},
        {"/v1/chat/completions", "\"xtc_probability\": 0.5, \"xtc_threshold\": 0.2", NULL},
        {"/v1/chat/completions", "\"xtc_probability\": 1.5", "'xtc_probability'"},
        {"/v1/chat/completions", "\"typical_p\": 0.9, \"min_keep\": 2", NULL},
        {"/v1/chat/completions", "\"typical_p\": 1", NULL},
        {"/v1/chat/completions", "\"min_keep\": -1", "'min_keep'"},
        {"/v1/chat/completions", "\"dynatemp_range\": 0.5, \"dynatemp_exponent\": 2, \"top_n_sigma\": 1", NULL},
        {"/v1/chat/completions", "\"samplers\": [\"top_k\", \"temperature\"]", NULL},
        {"/v1/chat/completions", "\"samplers\": \"kypmxt\"", NULL},
        {"/v1/chat/completions", "\"samplers\": [\"infill\"]", "'samplers'"},
        {"/v1/chat/completions", "\"samplers\": [\"temp\"]", "'samplers'"},
        {"/v1/chat/completions", "\"samplers\": \"kq\"", "'samplers'"},
        {"/v1/chat/completions", "\"n_probs\": 3", "'n_probs'"},
        {"/v1/chat/completions", "\"functions\": [{\"name\": \"f\"}]", "'functions'"},
        {"/v1/chat/completions", "\"user\": \"u1\", \"metadata\": {\"a\": \"b\"}, \"store\": false, "
                                 "\"service_tier\": \"auto\"", NULL},
        {"/v1/chat/completions", "\"logit_bias\": {\"5\": 10, \"hello\": -100}", NULL},
        {"/v1/chat/completions", "\"logit_bias\": {\"999999999\": 1}", "'logit_bias'"},
        {"/v1/chat/completions", "\"logit_bias\": [[1, true]]", "'logit_bias'"},
        {"/v1/chat/completions", "\"logit_bias\": [[1]]", "'logit_bias'"},
        {"/v1/chat/completions", "\"logit_bias\": 3", "'logit_bias'"},
        {"/v1/chat/completions", "\"repeat_last_n\": -2", "'repeat_last_n'"},
        {"/v1/chat/completions", "\"json_schema\": {\"type\": \"boolean\"}", NULL},
        {"/v1/chat/completions", "\"json_schema\": 3", "'json_schema'"},
        {"/v1/chat/completions", "\"json_schema\": {\"type\": \"boolean\"}, \"grammar\": \"root ::= \\\"a\\\"\"",
         "'json_schema'"},
        {"/v1/completions", "\"echo\": true", "'echo'"},
        {"/v1/completions", "\"best_of\": 3", "'best_of'"},
        {"/v1/completions", "\"suffix\": \"end\"", "'suffix'"},
        {"/v1/completions", "\"logit_bias\": [[\"text\", false]]", NULL},
        {"/completion", "\"n_probs\": 2, \"cache_prompt\": true, \"n_predict\": -1", NULL},
        {"/completion", "\"n\": 2", "'n'"},
        {"/completion", "\"logprobs\": true", "'logprobs'"},
        {"/completion", "\"mirostat\": 1", NULL},
        {"/completion", "\"dry_multiplier\": 1, \"samplers\": [\"dry\", \"temperature\"], \"n_probs\": 2", NULL},
        {"/completion", "\"n_probs\": 21", "'n_probs'"},
        {"/completion", "\"cache_prompt\": 1", "'cache_prompt'"},
        /* llama-server's and other servers' fields that change the output: refused unless at their no-op value */
        {"/completion", "\"n_indent\": 4", "'n_indent'"},
        {"/completion", "\"n_indent\": 0, \"n_cmpl\": 1, \"reasoning_budget_tokens\": -1", NULL},
        {"/completion", "\"n_cmpl\": 2", "'n_cmpl'"},
        {"/completion", "\"prompt\": {\"prompt_string\": \"hi\", \"multimodal_data\": [\"AA\"]}",
         "'prompt.multimodal_data'"},
        {"/v1/chat/completions", "\"thinking_budget_tokens\": 256", "'thinking_budget_tokens'"},
        {"/v1/chat/completions", "\"reasoning_budget_tokens\": 0", "'reasoning_budget_tokens'"},
        {"/v1/chat/completions", "\"repetition_penalty\": 1.1", "'repetition_penalty'"},
        {"/v1/chat/completions", "\"repetition_penalty\": 1, \"min_tokens\": 0, \"stop_token_ids\": []", NULL},
        {"/v1/chat/completions", "\"guided_json\": {\"type\": \"object\"}", "'guided_json'"},
        {"/v1/chat/completions", "\"verbosity\": \"low\"", "'verbosity'"},
        {"/v1/completions", "\"min_tokens\": 5", "'min_tokens'"},
        {"/v1/completions", "\"tfs_z\": 0.9", "'tfs_z'"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char body[1024];
        bool chat = !strcmp(cases[i].path, "/v1/chat/completions");
        snprintf(body, sizeof body, "{%s, \"max_tokens\": 4, %s}",
                 chat                                    ? "\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]"
                 : strstr(cases[i].extra, "\"prompt\"") ? "\"stream\": false" /* the case's own prompt */
                                                          : "\"prompt\": \"hi\"",
                 cases[i].extra);
        struct httpc_response r = post_to(srv, cases[i].path, body);
        bool ok = cases[i].needle ? r.status == 400 && strstr(r.body, cases[i].needle) : r.status == 200;
        if (!ok)
            print_message("%s %s: %ld %.*s\n", cases[i].path, body, r.status, (int)r.len, r.body);
        assert_true(ok);
        httpc_response_free(&r);
    }
    set_script("");
    server_stop(srv);
}

int main(void)
{
    const char *shared = getenv("KVSERVE_SHARED");
    snprintf(F.dir, sizeof F.dir, "%s", shared ? shared : "../shared");
    char probe[4200];
    snprintf(probe, sizeof probe, "%s/templates/conversations.json", F.dir);
    if (access(probe, R_OK))
        return ks_skip_all("no %s: the chat template corpus is missing", probe);
    snprintf(probe, sizeof probe, "%s/models/vocab/ggml-vocab-llama3.gguf", F.dir);
    if (access(probe, R_OK))
        return ks_skip_all("no %s", probe);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_corpus_prompts),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_tool_calls),
        cmocka_unit_test(test_harmony),
        cmocka_unit_test(test_reasoning),
        cmocka_unit_test(test_template_kwargs),
        cmocka_unit_test(test_refusals),
    };
    return ks_run_tests(tests, setup, teardown);
}
