/* A request's prompt tokens, as a replica computes them: the chat template
 * over messages and tools (the model's Jinja template, or a named family),
 * encoded with the BOS and special tokens parsed; a completion's prompt
 * string or token ids as they are. Only the prompt's leading full pages
 * matter to the router, so a detail it renders otherwise than the replica
 * (the date in a template, a content part's layout) costs at most the last
 * pages' affinity, never a wrong answer: the replica renders its own. */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "jinja/jinja.h"
#include "route/route.h"
#include "tokenizer/tokenizer.h"

enum { MAX_RENDER_BYTES = 64 << 20 };

struct route_prompt {
    const struct tokenizer *tok;
    struct tok_chat_setup chat;
    int32_t n_ctx;            /* the replicas' context: /infill's files are cut to it */
    bool spm_infill;
};

ks_status route_prompt_create(const struct tokenizer *tok, const char *chat_template, int32_t n_ctx, bool spm_infill,
                              struct route_prompt **out)
{
    *out = NULL;
    struct route_prompt *rp = calloc(1, sizeof *rp);
    if (!rp)
        return ks_fail(KS_ERR_NOMEM, "route: out of memory");
    rp->tok = tok;
    rp->n_ctx = n_ctx;
    rp->spm_infill = spm_infill;
    ks_status st = tok_chat_setup(tok, chat_template, NULL, 0, NULL, &rp->chat);
    if (st) {
        free(rp);
        return st;
    }
    *out = rp;
    return KS_OK;
}

void route_prompt_free(struct route_prompt *rp)
{
    if (!rp)
        return;
    tok_chat_setup_free(&rp->chat);
    free(rp);
}

/* A message's content as the replica reads it: a string, or text parts joined with "\n". */
static cJSON *content_text(const cJSON *content)
{
    if (!cJSON_IsArray(content))
        return NULL;
    size_t len = 0;
    const cJSON *part;
    cJSON_ArrayForEach(part, content) {
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(part, "text");
        if (!cJSON_IsString(text))
            return NULL;
        len += strlen(text->valuestring) + 1;
    }
    char *joined = malloc(len + 1), *p = joined;
    if (!joined)
        return NULL;
    cJSON_ArrayForEach(part, content) {
        const char *t = cJSON_GetObjectItemCaseSensitive(part, "text")->valuestring;
        if (p != joined)
            *p++ = '\n';
        size_t n = strlen(t);
        memcpy(p, t, n);
        p += n;
    }
    *p = '\0';
    cJSON *s = cJSON_CreateString(joined);
    free(joined);
    return s;
}

/* {"messages": [...], "tools": [...]} with text parts joined. */
static cJSON *template_request(const cJSON *root)
{
    const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(root, "messages");
    const cJSON *tools = cJSON_GetObjectItemCaseSensitive(root, "tools");
    if (!cJSON_IsArray(msgs) || cJSON_GetArraySize(msgs) == 0)
        return NULL;
    cJSON *req = cJSON_CreateObject(), *copy = cJSON_Duplicate(msgs, 1);
    if (!req || !copy || !cJSON_AddItemToObject(req, "messages", copy)) {
        cJSON_Delete(req);
        cJSON_Delete(copy);
        return NULL;
    }
    if (cJSON_IsArray(tools)) {
        cJSON *t = cJSON_Duplicate(tools, 1);
        if (!t || !cJSON_AddItemToObject(req, "tools", t)) {
            cJSON_Delete(t);
            cJSON_Delete(req);
            return NULL;
        }
    }
    cJSON *m;
    cJSON_ArrayForEach(m, copy) {
        cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
        if (cJSON_IsString(role) && !strcmp(role->valuestring, "developer"))
            cJSON_SetValuestring(role, "system"); /* as the replica tells the template */
        cJSON *text = content_text(cJSON_GetObjectItemCaseSensitive(m, "content"));
        if (text && !cJSON_ReplaceItemInObjectCaseSensitive(m, "content", text))
            cJSON_Delete(text);
    }
    return req;
}

/* chat_template_kwargs, with the top-level reasoning_effort unless they set it (NULL: none). */
static cJSON *template_kwargs(const cJSON *root)
{
    const cJSON *kw = cJSON_GetObjectItemCaseSensitive(root, "chat_template_kwargs");
    const cJSON *effort = cJSON_GetObjectItemCaseSensitive(root, "reasoning_effort");
    if (!cJSON_IsObject(kw) && !cJSON_IsString(effort))
        return NULL;
    cJSON *copy = cJSON_IsObject(kw) ? cJSON_Duplicate(kw, 1) : cJSON_CreateObject();
    if (copy && cJSON_IsString(effort) && !cJSON_GetObjectItemCaseSensitive(copy, "reasoning_effort"))
        cJSON_AddStringToObject(copy, "reasoning_effort", effort->valuestring);
    return copy;
}

static ks_status render_family(struct route_prompt *rp, const cJSON *req, char **text)
{
    const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(req, "messages");
    int n = cJSON_GetArraySize(msgs), i = 0;
    struct tok_chat_msg *tm = calloc((size_t)n, sizeof *tm);
    if (!tm)
        return ks_fail(KS_ERR_NOMEM, "route: out of memory");
    const cJSON *m;
    cJSON_ArrayForEach(m, msgs) {
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
        const cJSON *c = cJSON_GetObjectItemCaseSensitive(m, "content");
        if (!cJSON_IsString(role) || !cJSON_IsString(c)) {
            free(tm);
            return ks_fail(KS_ERR_INVALID_ARG, "route: messages[%d] has no text", i);
        }
        tm[i++] = (struct tok_chat_msg){role->valuestring, c->valuestring};
    }
    ks_status st = tok_chat_render(rp->tok, rp->chat.family, tm, (size_t)n, true, text);
    free(tm);
    return st;
}

static ks_status chat_text(struct route_prompt *rp, const cJSON *root, char **text)
{
    cJSON *req = template_request(root);
    if (!req)
        return ks_fail(KS_ERR_INVALID_ARG, "route: no 'messages' to render");
    ks_status st;
    if (rp->chat.by_family) {
        st = render_family(rp, req, text);
    } else {
        cJSON *kw = template_kwargs(root);
        struct jinja_chat chat = {rp->chat.bos_text, rp->chat.eos_text, 1, kw};
        struct jinja_opts opts = {.max_output = MAX_RENDER_BYTES, .now = (int64_t)time(NULL)};
        size_t len = 0;
        st = jinja_chat_render(rp->chat.jt, req, &chat, &opts, text, &len);
        cJSON_Delete(kw);
    }
    cJSON_Delete(req);
    return st;
}

/* ---- Anthropic's /v1/messages, as the replica translates it to a chat ---------------------- */

/* A string, or text blocks joined with "\n" (NULL: other blocks, whose translation the router leaves to
 * the replica). */
static char *anthropic_text(const cJSON *v)
{
    if (cJSON_IsString(v))
        return strdup(v->valuestring);
    cJSON *joined = content_text(v);
    const cJSON *block;
    cJSON_ArrayForEach(block, v) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(block, "type");
        if (!cJSON_IsString(type) || strcmp(type->valuestring, "text")) {
            cJSON_Delete(joined);
            return NULL;
        }
    }
    char *text = joined && cJSON_IsString(joined) ? strdup(joined->valuestring) : NULL;
    cJSON_Delete(joined);
    return text;
}

static bool add_message(cJSON *msgs, const char *role, char *text)
{
    cJSON *m = cJSON_CreateObject();
    bool ok = m && text && cJSON_AddStringToObject(m, "role", role) && cJSON_AddStringToObject(m, "content", text) &&
              cJSON_AddItemToArray(msgs, m);
    if (!ok)
        cJSON_Delete(m);
    free(text);
    return ok;
}

/* {"messages", "tools"}: the system prompt, the messages up to the first one that is not text alone (the
 * leading pages are what the router weighs), the tools as functions. NULL: nothing to render. */
/* Anthropic's and Responses' flat tools ({name, description, <schema key>})
 * as the chat's {"type": "function", "function": {...}} list. */
static void add_function_tools(cJSON *chat, const cJSON *in_tools, const char *schema_key)
{
    cJSON *tools = cJSON_IsArray(in_tools) ? cJSON_AddArrayToObject(chat, "tools") : NULL;
    if (!tools)
        return;
    const cJSON *t;
    cJSON_ArrayForEach(t, in_tools) {
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(t, "name");
        const cJSON *desc = cJSON_GetObjectItemCaseSensitive(t, "description");
        const cJSON *params = cJSON_GetObjectItemCaseSensitive(t, schema_key);
        cJSON *o = cJSON_CreateObject(), *fn = o ? cJSON_AddObjectToObject(o, "function") : NULL;
        if (!fn || !cJSON_IsString(name)) {
            cJSON_Delete(o);
            continue;
        }
        cJSON_AddStringToObject(o, "type", "function");
        cJSON_AddStringToObject(fn, "name", name->valuestring);
        if (cJSON_IsString(desc))
            cJSON_AddStringToObject(fn, "description", desc->valuestring);
        if (cJSON_IsObject(params))
            cJSON_AddItemToObject(fn, "parameters", cJSON_Duplicate(params, 1));
        cJSON_AddItemToArray(tools, o);
    }
}

static cJSON *anthropic_chat(const cJSON *root)
{
    cJSON *chat = cJSON_CreateObject(), *msgs = cJSON_AddArrayToObject(chat, "messages");
    const cJSON *system = cJSON_GetObjectItemCaseSensitive(root, "system");
    if (!msgs || (system && !add_message(msgs, "system", anthropic_text(system)))) {
        cJSON_Delete(chat);
        return NULL;
    }
    const cJSON *m;
    cJSON_ArrayForEach(m, cJSON_GetObjectItemCaseSensitive(root, "messages")) {
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
        char *text = anthropic_text(cJSON_GetObjectItemCaseSensitive(m, "content"));
        if (!cJSON_IsString(role) || !text) {
            free(text);
            break;
        }
        if (!add_message(msgs, role->valuestring, text))
            break;
    }
    add_function_tools(chat, cJSON_GetObjectItemCaseSensitive(root, "tools"), "input_schema");
    if (cJSON_GetArraySize(msgs) == 0) {
        cJSON_Delete(chat);
        return NULL;
    }
    return chat;
}

/* ---- OpenAI's /v1/responses, as the replica translates it to a chat --------------------------- */

/* A string, or text parts joined with "\n" (NULL: neither). */
static char *responses_text(const cJSON *v)
{
    if (cJSON_IsString(v))
        return strdup(v->valuestring);
    cJSON *joined = content_text(v);
    char *text = cJSON_IsString(joined) ? strdup(joined->valuestring) : NULL;
    cJSON_Delete(joined);
    return text;
}

/* A function_call item: a tool call of the assistant message before it (a new one unless the last
 * message is an assistant's). */
static bool add_call(cJSON *msgs, const cJSON *it)
{
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(it, "call_id");
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(it, "name");
    const cJSON *args = cJSON_GetObjectItemCaseSensitive(it, "arguments");
    if (!cJSON_IsString(id) || !cJSON_IsString(name) || !cJSON_IsString(args))
        return false;
    cJSON *last = cJSON_GetArrayItem(msgs, cJSON_GetArraySize(msgs) - 1);
    const cJSON *role = cJSON_GetObjectItemCaseSensitive(last, "role");
    if (!cJSON_IsString(role) || strcmp(role->valuestring, "assistant")) {
        last = cJSON_CreateObject();
        if (!last || !cJSON_AddItemToArray(msgs, last)) {
            cJSON_Delete(last);
            return false;
        }
        cJSON_AddStringToObject(last, "role", "assistant");
        cJSON_AddNullToObject(last, "content");
    }
    cJSON *calls = cJSON_GetObjectItemCaseSensitive(last, "tool_calls");
    if (!calls)
        calls = cJSON_AddArrayToObject(last, "tool_calls");
    /* in the replica's order: a template may print a call as JSON */
    cJSON *c = cJSON_CreateObject();
    cJSON *fn = c && cJSON_AddStringToObject(c, "id", id->valuestring) && cJSON_AddStringToObject(c, "type", "function")
                    ? cJSON_AddObjectToObject(c, "function")
                    : NULL;
    if (!fn || !calls || !cJSON_AddItemToArray(calls, c)) {
        cJSON_Delete(c);
        return false;
    }
    cJSON_AddStringToObject(fn, "name", name->valuestring);
    cJSON_AddStringToObject(fn, "arguments", args->valuestring);
    return true;
}

/* One input item as chat messages; false: an item the router leaves to the replica (it stops there). */
static bool responses_item(cJSON *msgs, const cJSON *it)
{
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(it, "type");
    const cJSON *role = cJSON_GetObjectItemCaseSensitive(it, "role");
    const char *t = cJSON_IsString(type) ? type->valuestring : role ? "message" : "";
    if (!strcmp(t, "message"))
        return cJSON_IsString(role) &&
               add_message(msgs, role->valuestring, responses_text(cJSON_GetObjectItemCaseSensitive(it, "content")));
    if (!strcmp(t, "function_call"))
        return add_call(msgs, it);
    if (!strcmp(t, "reasoning"))
        return true; /* the replica skips it too */
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(it, "call_id");
    char *out = strcmp(t, "function_call_output") || !cJSON_IsString(id)
                    ? NULL
                    : responses_text(cJSON_GetObjectItemCaseSensitive(it, "output"));
    cJSON *m = out ? cJSON_CreateObject() : NULL;
    bool ok = m && cJSON_AddStringToObject(m, "role", "tool") &&
              cJSON_AddStringToObject(m, "tool_call_id", id->valuestring) && cJSON_AddStringToObject(m, "content", out) &&
              cJSON_AddItemToArray(msgs, m);
    if (!ok)
        cJSON_Delete(m);
    free(out);
    return ok;
}

/* {"messages", "tools", "reasoning_effort"} as server_responses.c builds them: instructions as the
 * system message, the input (a string: the user's), function tools; up to the first item the router
 * cannot read. NULL: nothing to render. */
static cJSON *responses_chat(const cJSON *root)
{
    cJSON *chat = cJSON_CreateObject(), *msgs = cJSON_AddArrayToObject(chat, "messages");
    const cJSON *instr = cJSON_GetObjectItemCaseSensitive(root, "instructions");
    const cJSON *in = cJSON_GetObjectItemCaseSensitive(root, "input");
    if (!msgs || (cJSON_IsString(instr) && !add_message(msgs, "system", strdup(instr->valuestring))) ||
        (cJSON_IsString(in) && !add_message(msgs, "user", strdup(in->valuestring)))) {
        cJSON_Delete(chat);
        return NULL;
    }
    const cJSON *it, *items = cJSON_IsArray(in) ? in : NULL;
    cJSON_ArrayForEach(it, items) {
        if (!responses_item(msgs, it))
            break;
    }
    add_function_tools(chat, cJSON_GetObjectItemCaseSensitive(root, "tools"), "parameters");
    const cJSON *effort = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(root, "reasoning"), "effort");
    if (cJSON_IsString(effort))
        cJSON_AddStringToObject(chat, "reasoning_effort", effort->valuestring);
    if (cJSON_GetArraySize(msgs) == 0) {
        cJSON_Delete(chat);
        return NULL;
    }
    return chat;
}

/* ---- /infill, as the replica builds its prompt (tok_infill_prompt) ------------------------------- */

/* input_prefix / input_suffix as parts (*parts malloc'd); false: not a string or a list of them and ids. */
static bool infill_parts(const cJSON *v, int32_t n_vocab, struct tok_infill_part **parts, size_t *n)
{
    size_t count = cJSON_IsString(v) ? 1 : cJSON_IsArray(v) ? (size_t)cJSON_GetArraySize(v) : 0;
    *n = 0;
    *parts = cJSON_IsString(v) || cJSON_IsArray(v) ? calloc(count + 1, sizeof **parts) : NULL;
    if (!*parts)
        return false;
    if (cJSON_IsString(v)) {
        (*parts)[(*n)++].text = v->valuestring;
        return true;
    }
    const cJSON *e;
    cJSON_ArrayForEach(e, v) {
        if (cJSON_IsString(e))
            (*parts)[*n].text = e->valuestring;
        else if (cJSON_IsNumber(e) && e->valuedouble == floor(e->valuedouble) && e->valuedouble >= 0 &&
                 e->valuedouble < n_vocab)
            (*parts)[*n].id = (int32_t)e->valuedouble;
        else
            return false;
        (*n)++;
    }
    return true;
}

static ks_status infill_tokens(struct route_prompt *rp, const cJSON *root, int32_t **ids, size_t *n)
{
    const cJSON *prompt = cJSON_GetObjectItemCaseSensitive(root, "prompt");
    const cJSON *extra = cJSON_GetObjectItemCaseSensitive(root, "input_extra");
    struct tok_infill in = {.prompt = cJSON_IsString(prompt) ? prompt->valuestring : NULL, .n_ctx = rp->n_ctx,
                            .spm = rp->spm_infill};
    struct tok_infill_part *pre = NULL, *suf = NULL;
    struct tok_infill_file *files = calloc((size_t)cJSON_GetArraySize(extra) + 1, sizeof *files);
    int32_t n_vocab = tok_n_vocab(rp->tok);
    bool ok = files && (!prompt || cJSON_IsString(prompt)) && (!extra || cJSON_IsArray(extra)) &&
              infill_parts(cJSON_GetObjectItemCaseSensitive(root, "input_prefix"), n_vocab, &pre, &in.n_prefix) &&
              infill_parts(cJSON_GetObjectItemCaseSensitive(root, "input_suffix"), n_vocab, &suf, &in.n_suffix);
    const cJSON *chunk, *chunks = ok ? extra : NULL;
    cJSON_ArrayForEach(chunk, chunks) {
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(chunk, "filename");
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(chunk, "text");
        ok = ok && cJSON_IsString(text) && (!name || cJSON_IsString(name));
        if (ok)
            files[in.n_files++] = (struct tok_infill_file){name ? name->valuestring : NULL, text->valuestring};
    }
    in.prefix = pre;
    in.suffix = suf;
    in.files = files;
    ks_status st = ok ? tok_infill_prompt(rp->tok, &in, ids, n)
                      : ks_fail(KS_ERR_INVALID_ARG, "route: an /infill body the replica would refuse");
    free(pre);
    free(suf);
    free(files);
    return st;
}

static ks_status token_ids(const cJSON *p, int32_t **ids, size_t *n)
{
    size_t count = (size_t)cJSON_GetArraySize(p), i = 0;
    int32_t *out = malloc((count ? count : 1) * sizeof *out);
    if (!out)
        return ks_fail(KS_ERR_NOMEM, "route: out of memory");
    const cJSON *t;
    cJSON_ArrayForEach(t, p) {
        if (!cJSON_IsNumber(t) || t->valuedouble != floor(t->valuedouble) || t->valuedouble < 0 ||
            t->valuedouble > INT32_MAX) {
            free(out);
            return ks_fail(KS_ERR_INVALID_ARG, "route: 'prompt' holds something other than token ids");
        }
        out[i++] = (int32_t)t->valuedouble;
    }
    *ids = out;
    *n = count;
    return KS_OK;
}

static bool path_is(const char *path, const char *a, const char *b)
{
    size_t n = strcspn(path, "?");
    return (strlen(a) == n && !strncmp(path, a, n)) || (b && strlen(b) == n && !strncmp(path, b, n));
}

static ks_status tokens_of(struct route_prompt *rp, const char *path, const cJSON *root, int32_t **ids, size_t *n)
{
    const unsigned flags = TOK_ADD_SPECIAL | TOK_PARSE_SPECIAL;
    if (path_is(path, "/v1/chat/completions", "/chat/completions")) {
        char *text = NULL;
        ks_status st = chat_text(rp, root, &text);
        if (!st)
            st = tok_encode(rp->tok, text, strlen(text), flags, ids, n);
        free(text);
        return st;
    }
    if (path_is(path, "/v1/messages", NULL) || path_is(path, "/v1/responses", "/responses")) {
        bool messages = path_is(path, "/v1/messages", NULL);
        cJSON *chat = messages ? anthropic_chat(root) : responses_chat(root);
        if (!chat)
            return ks_fail(KS_ERR_INVALID_ARG, "route: no text messages to render");
        char *text = NULL;
        ks_status st = chat_text(rp, chat, &text);
        if (!st)
            st = tok_encode(rp->tok, text, strlen(text), flags, ids, n);
        free(text);
        cJSON_Delete(chat);
        return st;
    }
    if (path_is(path, "/infill", NULL))
        return infill_tokens(rp, root, ids, n);
    if (!path_is(path, "/v1/completions", "/completions") && !path_is(path, "/completion", NULL))
        return KS_ERR_NOT_FOUND;
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(root, "prompt");
    if (cJSON_IsArray(p) && cJSON_GetArraySize(p) == 1 && cJSON_IsString(cJSON_GetArrayItem(p, 0)))
        p = cJSON_GetArrayItem(p, 0);
    if (cJSON_IsString(p))
        return tok_encode(rp->tok, p->valuestring, strlen(p->valuestring), flags, ids, n);
    if (cJSON_IsArray(p) && cJSON_GetArraySize(p) > 0 && cJSON_IsNumber(cJSON_GetArrayItem(p, 0)))
        return token_ids(p, ids, n);
    return ks_fail(KS_ERR_INVALID_ARG, "route: 'prompt' is not one string or one list of token ids");
}

ks_status route_prompt_tokens(struct route_prompt *rp, const char *path, const char *body, size_t len,
                              int32_t **ids, size_t *n, struct kv_key *salt)
{
    *ids = NULL;
    *n = 0;
    *salt = (struct kv_key){0, 0};
    cJSON *root = cJSON_ParseWithLength(body, len);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return ks_fail(KS_ERR_INVALID_ARG, "route: the body is not a JSON object");
    }
    ks_status st = tokens_of(rp, path, root, ids, n);
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(root, "cache_salt");
    if (!st && cJSON_IsString(s) && s->valuestring[0])
        *salt = kv_cache_salt(s->valuestring, strlen(s->valuestring));
    cJSON_Delete(root);
    return st;
}
