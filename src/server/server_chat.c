/* Chat requests -> prompt text: the model's own Jinja chat template (or the
 * --chat-template-file one), parsed once at start and rendered per request
 * the way llama-server --jinja does (jinja_chat_render's polyfills), or a
 * hand-written family when the user named one. Also the request's tool
 * options (tools, tool_choice, parallel_tool_calls). */
#include "server/server_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

ks_status server_chat_setup(struct server *srv, const struct server_config *cfg)
{
    const char *text = cfg->chat_template_jinja;
    ks_status st = tok_chat_setup(srv->tok, cfg->chat_template, text, text ? strlen(text) : 0,
                                  cfg->chat_template_origin, &srv->chat);
    if (st || srv->chat.by_family)
        return st;
    if (srv->chat.chatml_fallback)
        fprintf(stderr, "kvserve serve: the model has no tokenizer.chat_template; chat uses chatml\n");
    const char *src = srv->chat.src;
    size_t len = srv->chat.len;
    srv->tool_format = server_harmony_template(src, len) ? SERVER_TOOLS_HARMONY : server_tool_format_detect(src, len);
    /* llama.cpp's preserved tokens: markup that is a control token must reach the parser */
    static const char *const markup[] = {"<|python_tag|>", "[TOOL_CALLS]", "<tool_call>", "</tool_call>"};
    int n_harmony = 0;
    const char *const *harmony = server_harmony_markup(&n_harmony);
    int n_markup = 4 + (srv->tool_format == SERVER_TOOLS_HARMONY ? n_harmony : 0);
    for (int i = 0; i < n_markup; i++) {
        const char *m = i < 4 ? markup[i] : harmony[i - 4];
        int32_t id = tok_find(srv->tok, m, strlen(m));
        if (id >= 0 && tok_is_control(srv->tok, id) && srv->n_tool_tokens < (int)(sizeof srv->tool_tokens / sizeof srv->tool_tokens[0]))
            srv->tool_tokens[srv->n_tool_tokens++] = id;
    }
    srv->template_thinks = server_think_template(src, len);
    static const char *const think[] = {"<think>", "</think>"};
    for (int i = 0; i < 2; i++) {
        int32_t id = tok_find(srv->tok, think[i], strlen(think[i]));
        if (id >= 0 && tok_is_control(srv->tok, id))
            srv->think_tokens[srv->n_think_tokens++] = id;
    }
    return KS_OK;
}

void server_chat_free(struct server *srv) { tok_chat_setup_free(&srv->chat); }

/* ---- tool options ------------------------------------------------------------------ */

static ks_status check_tools(const cJSON *tools, struct reply *r)
{
    if (!cJSON_IsArray(tools))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'tools' must be an array");
    int i = 0;
    const cJSON *t;
    cJSON_ArrayForEach(t, tools) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(t, "type");
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(t, "function");
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(fn, "name");
        const cJSON *params = cJSON_GetObjectItemCaseSensitive(fn, "parameters");
        if (!cJSON_IsObject(t) || !cJSON_IsString(type) || strcmp(type->valuestring, "function") ||
            !cJSON_IsObject(fn) || !cJSON_IsString(name) || !name->valuestring[0] ||
            (params && !cJSON_IsNull(params) && !cJSON_IsObject(params)))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                              "tools[%d] must be {\"type\":\"function\",\"function\":{\"name\":STRING,"
                              "\"parameters\":OBJECT}}",
                              i);
        i++;
    }
    return KS_OK;
}

static bool has_tool(const cJSON *tools, const char *name)
{
    const cJSON *t;
    cJSON_ArrayForEach(t, tools) {
        const cJSON *n = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(t, "function"), "name");
        if (cJSON_IsString(n) && !strcmp(n->valuestring, name))
            return true;
    }
    return false;
}

ks_status server_parse_tool_options(const cJSON *root, struct server_tool_opts *o, struct reply *r)
{
    memset(o, 0, sizeof *o);
    o->parallel = true;
    const cJSON *tools = cJSON_GetObjectItemCaseSensitive(root, "tools");
    if (tools && !cJSON_IsNull(tools)) {
        ks_status st = check_tools(tools, r);
        if (st)
            return st;
        o->n_tools = cJSON_GetArraySize(tools);
    }
    const cJSON *ptc = cJSON_GetObjectItemCaseSensitive(root, "parallel_tool_calls");
    if (ptc && !cJSON_IsNull(ptc)) {
        if (!cJSON_IsBool(ptc))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'parallel_tool_calls' must be true or false");
        o->parallel = cJSON_IsTrue(ptc);
    }
    const cJSON *tc = cJSON_GetObjectItemCaseSensitive(root, "tool_choice");
    o->choice = SERVER_TOOL_AUTO;
    if (!tc || cJSON_IsNull(tc))
        return KS_OK;
    if (cJSON_IsString(tc)) {
        if (!strcmp(tc->valuestring, "auto"))
            o->choice = SERVER_TOOL_AUTO;
        else if (!strcmp(tc->valuestring, "none"))
            o->choice = SERVER_TOOL_NONE;
        else if (!strcmp(tc->valuestring, "required"))
            o->choice = SERVER_TOOL_REQUIRED;
        else
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                              "'tool_choice' must be \"auto\", \"none\", \"required\" or "
                              "{\"type\":\"function\",\"function\":{\"name\":...}} (got \"%.64s\")",
                              tc->valuestring);
    } else {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(tc, "type");
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(tc, "function"), "name");
        if (!cJSON_IsObject(tc) || !cJSON_IsString(type) || strcmp(type->valuestring, "function") ||
            !cJSON_IsString(name))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                              "'tool_choice' must be \"auto\", \"none\", \"required\" or "
                              "{\"type\":\"function\",\"function\":{\"name\":...}}");
        if (!has_tool(tools, name->valuestring))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                              "'tool_choice' names the function '%.64s', which is not in 'tools'", name->valuestring);
        o->choice = SERVER_TOOL_NAMED;
        snprintf(o->name, sizeof o->name, "%s", name->valuestring);
    }
    if (o->choice != SERVER_TOOL_NONE && o->choice != SERVER_TOOL_AUTO && o->n_tools == 0)
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'tool_choice' needs a non-empty 'tools'");
    return KS_OK;
}

/* ---- messages ---------------------------------------------------------------------- */

/* Text parts joined with "\n" (llama.cpp's concatenation for templates that
 * take string content). */
static ks_status join_parts(const cJSON *parts, int i, cJSON **out, struct reply *r)
{
    struct sbuf text = {0};
    const cJSON *part;
    int k = 0;
    cJSON_ArrayForEach(part, parts) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(part, "text");
        if (cJSON_IsString(type) && strcmp(type->valuestring, "text")) { /* image_url, input_audio, file, ... */
            sbuf_free(&text);
            return reply_fail(r, KS_ERR_INVALID_ARG, "unsupported_parameter",
                              "messages[%d].content[%d].type '%.64s' is not supported: kvserve reads text parts only "
                              "(no images, audio or files)",
                              i, k, type->valuestring);
        }
        if (!cJSON_IsString(t) || (type && !cJSON_IsString(type))) {
            sbuf_free(&text);
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type",
                              "messages[%d].content[%d] must be {\"type\":\"text\",\"text\":...}", i, k);
        }
        if (k++)
            sbuf_append(&text, "\n", 1);
        sbuf_append(&text, t->valuestring, strlen(t->valuestring));
    }
    *out = text.oom ? NULL : cJSON_CreateString(text.p ? text.p : "");
    sbuf_free(&text);
    return *out ? KS_OK : reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while reading messages[%d]", i);
}

static ks_status check_tool_calls(const cJSON *calls, int i, struct reply *r)
{
    if (!cJSON_IsArray(calls))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "messages[%d].tool_calls must be an array", i);
    int k = 0;
    const cJSON *tc;
    cJSON_ArrayForEach(tc, calls) {
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(tc, "function");
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(fn, "name");
        const cJSON *args = cJSON_GetObjectItemCaseSensitive(fn, "arguments");
        if (!cJSON_IsObject(tc) || !cJSON_IsObject(fn) || !cJSON_IsString(name) ||
            !(cJSON_IsString(args) || cJSON_IsObject(args)))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                              "messages[%d].tool_calls[%d] must be {\"id\":...,\"type\":\"function\",\"function\":"
                              "{\"name\":STRING,\"arguments\":JSON STRING}}",
                              i, k);
        if (cJSON_IsString(args)) {
            cJSON *parsed = cJSON_Parse(args->valuestring);
            bool ok = parsed != NULL;
            cJSON_Delete(parsed);
            if (!ok && server_json_failed())
                return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while reading messages[%d]", i);
            if (!ok)
                return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                                  "messages[%d].tool_calls[%d].function.arguments is not JSON", i, k);
        }
        k++;
    }
    return KS_OK;
}

/* The request the template sees: messages checked and normalised (developer
 * -> system, text parts joined; content left out only by an assistant's tool
 * calls, a tool message names its call), tools unless absent. */
static ks_status template_request(const cJSON *root, cJSON **out, struct reply *r)
{
    const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(root, "messages");
    if (!cJSON_IsArray(msgs) || cJSON_GetArraySize(msgs) == 0)
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'messages' must be a non-empty array");
    cJSON *req = cJSON_CreateObject();
    cJSON *copy = cJSON_Duplicate(msgs, 1);
    server_json_add(req, "messages", copy);
    const cJSON *tools = cJSON_GetObjectItemCaseSensitive(root, "tools");
    if (tools && !cJSON_IsNull(tools))
        server_json_add(req, "tools", cJSON_Duplicate(tools, 1));
    if (server_json_failed()) {
        cJSON_Delete(req);
        return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while reading 'messages'");
    }
    int i = 0;
    cJSON *m;
    ks_status st = KS_OK;
    cJSON_ArrayForEach(m, copy) {
        cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
        cJSON *content = cJSON_GetObjectItemCaseSensitive(m, "content");
        cJSON *calls = cJSON_GetObjectItemCaseSensitive(m, "tool_calls");
        if (!cJSON_IsObject(m) || !cJSON_IsString(role)) {
            st = reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "messages[%d] needs a string 'role'", i);
            break;
        }
        const char *rn = role->valuestring;
        if (strcmp(rn, "system") && strcmp(rn, "developer") && strcmp(rn, "user") && strcmp(rn, "assistant") &&
            strcmp(rn, "tool")) {
            st = reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                            "messages[%d].role '%.64s' is not supported (system, developer, user, assistant, tool)",
                            i, rn);
            break;
        }
        if (!strcmp(rn, "developer") && !cJSON_SetValuestring(role, "system")) {
            st = reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while reading 'messages'");
            break;
        }
        if (calls && !cJSON_IsNull(calls) && strcmp(rn, "assistant")) {
            st = reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                            "messages[%d]: only assistant messages have tool_calls", i);
            break;
        }
        if (calls && !cJSON_IsNull(calls) && (st = check_tool_calls(calls, i, r)))
            break;
        if (!strcmp(rn, "tool") && !cJSON_IsString(cJSON_GetObjectItemCaseSensitive(m, "tool_call_id"))) {
            st = reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                            "messages[%d] (tool) needs a string 'tool_call_id': the id of the call it answers", i);
            break;
        }
        cJSON *text = NULL;
        if (cJSON_IsArray(content)) {
            if ((st = join_parts(content, i, &text, r)))
                break;
        } else if (!content || cJSON_IsNull(content)) {
            if (!calls || cJSON_IsNull(calls)) { /* an assistant's tool calls keep their null content */
                st = reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                                "messages[%d] (%s) has no 'content'; only an assistant message with tool_calls may "
                                "leave it out", i, rn);
                break;
            }
        } else if (!cJSON_IsString(content)) {
            st = reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type",
                            "messages[%d].content must be a string or an array of text parts", i);
            break;
        }
        if (text && !(content ? cJSON_ReplaceItemInObjectCaseSensitive(m, "content", text)
                              : cJSON_AddItemToObject(m, "content", text))) {
            cJSON_Delete(text);
            st = reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while reading 'messages'");
            break;
        }
        i++;
    }
    if (st) {
        cJSON_Delete(req);
        return st;
    }
    *out = req;
    return KS_OK;
}

/* The variables the request adds to the template's context (*out NULL:
 * none): chat_template_kwargs (enable_thinking, reasoning_effort, ...) and
 * OpenAI's top-level reasoning_effort unless the kwargs set it. The
 * variables the server sets from the request itself are not replaced. */
static ks_status template_kwargs(const cJSON *root, cJSON **out, struct reply *r)
{
    *out = NULL;
    const cJSON *kw = cJSON_GetObjectItemCaseSensitive(root, "chat_template_kwargs");
    const cJSON *effort = cJSON_GetObjectItemCaseSensitive(root, "reasoning_effort");
    kw = cJSON_IsNull(kw) ? NULL : kw;
    effort = cJSON_IsNull(effort) ? NULL : effort;
    if (kw && !cJSON_IsObject(kw))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'chat_template_kwargs' must be an object");
    if (effort && !cJSON_IsString(effort))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'reasoning_effort' must be a string");
    static const char *const reserved[] = {"messages", "tools", "bos_token"};
    for (int i = 0; kw && i < 3; i++)
        if (cJSON_GetObjectItemCaseSensitive(kw, reserved[i]))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                              "'chat_template_kwargs.%s' may not replace the request's own %s", reserved[i],
                              reserved[i]);
    if (!kw && !effort)
        return KS_OK;
    cJSON *copy = kw ? cJSON_Duplicate(kw, 1) : cJSON_CreateObject();
    if (effort && copy && !cJSON_GetObjectItemCaseSensitive(copy, "reasoning_effort"))
        server_json_add(copy, "reasoning_effort", cJSON_CreateString(effort->valuestring));
    if (!copy || server_json_failed()) {
        cJSON_Delete(copy);
        return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while reading 'chat_template_kwargs'");
    }
    *out = copy;
    return KS_OK;
}

/* The model's template over the request. Template errors are the client's
 * (400 with the template's own message); a limit is 413. */
static ks_status render_jinja(struct server *srv, const cJSON *root, char **out, struct reply *r)
{
    cJSON *kw = NULL, *req = NULL;
    ks_status st = template_kwargs(root, &kw, r);
    if (!st && (st = template_request(root, &req, r)))
        cJSON_Delete(kw);
    if (st)
        return st;
    /* The prompt may hold at most ctx_size tokens; 64 bytes a token is far
     * beyond any vocabulary's average, so only a runaway render meets it. */
    size_t max_out = (size_t)srv->cfg.ctx_size * 64;
    if (max_out < (64u << 10))
        max_out = 64u << 10;
    struct jinja_chat chat = {srv->chat.bos_text, srv->chat.eos_text, 1, kw};
    struct jinja_opts opts = {.max_output = max_out, .now = srv->cfg.chat_now ? srv->cfg.chat_now : (int64_t)time(NULL)};
    size_t len = 0;
    st = jinja_chat_render(srv->chat.jt, req, &chat, &opts, out, &len);
    cJSON_Delete(req);
    cJSON_Delete(kw);
    if (server_json_failed()) { /* a context value the polyfills built was lost, or a parse ran out */
        if (!st)
            free(*out);
        *out = NULL;
        st = KS_ERR_NOMEM;
    }
    if (st == KS_ERR_NOMEM)
        return reply_fail(r, st, NULL, "out of memory while rendering the chat template");
    if (st == KS_ERR_RANGE) {
        r->http_status = 413;
        return reply_fail(r, st, "prompt_too_large", "the chat template's output exceeds a limit: %s", ks_errmsg());
    }
    if (st)
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_request", "the chat template refused the request: %s",
                          ks_errmsg());
    if (memchr(*out, 0, len)) { /* a NUL from the messages would cut the prompt short */
        free(*out);
        *out = NULL;
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "the messages contain a NUL character");
    }
    return KS_OK;
}

/* A named hand-written family: system, user and assistant text only; tools
 * it cannot show the model are refused, not dropped. */
static ks_status render_family(struct server *srv, const cJSON *root, char **out, struct reply *r)
{
    const cJSON *tools = cJSON_GetObjectItemCaseSensitive(root, "tools");
    if (cJSON_GetArraySize(tools) > 0)
        return reply_fail(r, KS_ERR_INVALID_ARG, "unsupported_parameter",
                          "'tools': the %s chat template (--chat-template) cannot show tools to the model; serve "
                          "with the model's Jinja template (or --chat-template-file) to call tools",
                          tok_chat_name(srv->chat.family));
    cJSON *req = NULL;
    ks_status st = template_request(root, &req, r);
    if (st)
        return st;
    cJSON *msgs = cJSON_GetObjectItemCaseSensitive(req, "messages");
    int n = cJSON_GetArraySize(msgs);
    struct tok_chat_msg *tm = calloc((size_t)n, sizeof *tm);
    if (!tm) {
        cJSON_Delete(req);
        return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while reading 'messages'");
    }
    int i = 0;
    const cJSON *m;
    cJSON_ArrayForEach(m, msgs) {
        const char *role = cJSON_GetObjectItemCaseSensitive(m, "role")->valuestring;
        const cJSON *c = cJSON_GetObjectItemCaseSensitive(m, "content");
        if (!strcmp(role, "tool") || !cJSON_IsString(c)) {
            free(tm);
            cJSON_Delete(req);
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                              "messages[%d]: the %s chat template takes text from system, user and assistant only "
                              "(tool calls need the model's Jinja template)",
                              i, tok_chat_name(srv->chat.family));
        }
        tm[i++] = (struct tok_chat_msg){role, c->valuestring};
    }
    st = tok_chat_render(srv->tok, srv->chat.family, tm, (size_t)n, true, out);
    free(tm);
    cJSON_Delete(req);
    if (st)
        return reply_fail(r, st == KS_ERR_NOMEM ? st : KS_ERR_INVALID_ARG, st == KS_ERR_NOMEM ? NULL : "invalid_value",
                          "cannot render the chat: %s", ks_errmsg());
    return KS_OK;
}

ks_status server_chat_prompt(struct server *srv, const cJSON *root, char **out, struct reply *r)
{
    *out = NULL;
    return srv->chat.by_family ? render_family(srv, root, out, r) : render_jinja(srv, root, out, r);
}

ks_status server_route_apply_template(struct server *srv, const struct server_req *rq, struct reply *r)
{
    cJSON *root;
    ks_status st = server_parse_object(rq->body, rq->len, false, &root, r);
    if (st)
        return st;
    struct server_tool_opts tools;
    char *text = NULL;
    if (!(st = server_parse_tool_options(root, &tools, r)))
        st = server_chat_prompt(srv, root, &text, r);
    cJSON_Delete(root);
    if (st)
        return st;
    char *clean = NULL;
    size_t len;
    st = tok_utf8_sanitize(text, strlen(text), &clean, &len);
    free(text);
    if (st)
        return reply_fail(r, st, NULL, "out of memory while writing the prompt");
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "prompt", clean);
    free(clean);
    return reply_json(r, 200, o);
}
