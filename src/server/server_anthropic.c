/* Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens
 * over the chat route (server_proxy_internal.h).
 *
 * Request: system (a string or text blocks), messages whose content is a
 * string or blocks (text; tool_use from the assistant; tool_result from the
 * user, each becoming a tool message before the user's text; thinking from
 * the assistant as its reasoning_content), tools with input_schema,
 * tool_choice (auto, any, tool, none; disable_parallel_tool_use), max_tokens
 * (required), stop_sequences, temperature, top_p, top_k, stream and thinking
 * (enabled/disabled: the template's enable_thinking). Answer: content blocks
 * thinking (the model's reasoning), text and tool_use, stop_reason end_turn,
 * max_tokens, stop_sequence or tool_use, usage; a stream of Anthropic's
 * events. Errors are {"type":"error","error":{"type","message"}}. */
#include "server/server_completion_internal.h"
#include "server/server_proxy_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- errors ------------------------------------------------------------------------ */

static const char *error_type(unsigned status)
{
    switch (status) {
    case 400: return "invalid_request_error";
    case 401: return "authentication_error";
    case 403: return "permission_error";
    case 404: return "not_found_error";
    case 413: return "request_too_large";
    case 429: return "rate_limit_error";
    case 503: return "overloaded_error";
    default: return status < 500 ? "invalid_request_error" : "api_error";
    }
}

void server_anthropic_error(struct reply *r, unsigned status, const char *code, const char *msg)
{
    static const char oom[] = "{\"type\":\"error\",\"error\":{\"type\":\"api_error\",\"message\":\"out of memory\"}}";
    (void)code;
    char named[1024];
    server_proxy_rename(named, sizeof named, msg, "'stop'", "'stop_sequences'");
    reply_free(r);
    server_json_reset();
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", "error");
    cJSON *e = cJSON_AddObjectToObject(o, "error");
    cJSON_AddStringToObject(e, "type", error_type(status));
    cJSON_AddStringToObject(e, "message", named);
    server_reply_error_json(r, status, o, oom);
}

bool server_anthropic_path(const char *path)
{
    return path && !strncmp(path, "/v1/messages", 12) && (!path[12] || path[12] == '/');
}

/* ---- request: Anthropic -> chat ---------------------------------------------------- */

static cJSON *field(const cJSON *o, const char *key)
{
    cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNull(v) ? NULL : v;
}

static ks_status oom(struct reply *r)
{
    return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while reading the request");
}

/* Fields this route reads, and those it accepts and ignores (bookkeeping). */
static const char *const known_fields[] = {"model", "messages", "system", "max_tokens", "stop_sequences",
                                           "temperature", "top_p", "top_k", "stream", "tools", "tool_choice",
                                           "thinking", "metadata", "service_tier"};

static ks_status check_fields(const cJSON *root, struct reply *r)
{
    const cJSON *f;
    cJSON_ArrayForEach(f, root) {
        bool known = false;
        for (size_t i = 0; i < sizeof known_fields / sizeof known_fields[0] && !known; i++)
            known = !strcmp(f->string, known_fields[i]);
        if (!known && !cJSON_IsNull(f))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_request_error",
                              "'%.64s' is not supported by kvserve's /v1/messages; leave it out", f->string);
    }
    return KS_OK;
}

static const char *const text_types[] = {"text"};

static ks_status add_message(cJSON *msgs, const char *role, char *text, struct reply *r)
{
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "role", role);
    cJSON_AddStringToObject(m, "content", text);
    free(text);
    server_json_push(msgs, m);
    return server_json_failed() ? oom(r) : KS_OK;
}

/* A tool_result block -> a tool message (its content a string, as llama.cpp passes it). */
static ks_status tool_result(cJSON *msgs, const cJSON *b, int i, int k, struct reply *r)
{
    const cJSON *id = field(b, "tool_use_id"), *content = field(b, "content");
    if (!cJSON_IsString(id))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_request_error",
                          "messages[%d].content[%d]: a tool_result needs a string 'tool_use_id'", i, k);
    char *text = NULL;
    ks_status st = content ? server_proxy_join_text(content, text_types, 1, &text)
                           : (text = strdup("")) ? KS_OK : KS_ERR_NOMEM;
    if (st == KS_ERR_INVALID_ARG) {
        char where[80];
        snprintf(where, sizeof where, "messages[%d].content[%d].content", i, k);
        return server_proxy_refuse_parts(r, content, text_types, 1, where, "text blocks");
    }
    if (st)
        return oom(r);
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "role", "tool");
    cJSON_AddStringToObject(m, "tool_call_id", id->valuestring);
    cJSON_AddStringToObject(m, "content", text);
    free(text);
    server_json_push(msgs, m);
    return server_json_failed() ? oom(r) : KS_OK;
}

/* A tool_use block -> one of the assistant's tool_calls. */
static ks_status tool_use(cJSON *calls, const cJSON *b, int i, int k, struct reply *r)
{
    const cJSON *id = field(b, "id"), *name = field(b, "name"), *input = field(b, "input");
    if (!cJSON_IsString(id) || !cJSON_IsString(name) || (input && !cJSON_IsObject(input)))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_request_error",
                          "messages[%d].content[%d]: a tool_use is {\"id\":STRING,\"name\":STRING,\"input\":OBJECT}", i, k);
    char *args = input ? cJSON_PrintUnformatted(input) : strdup("{}");
    if (!args)
        return oom(r);
    cJSON *c = cJSON_CreateObject();
    cJSON_AddStringToObject(c, "id", id->valuestring);
    cJSON_AddStringToObject(c, "type", "function");
    cJSON *fn = cJSON_AddObjectToObject(c, "function");
    cJSON_AddStringToObject(fn, "name", name->valuestring);
    cJSON_AddStringToObject(fn, "arguments", args);
    free(args);
    server_json_push(calls, c);
    return server_json_failed() ? oom(r) : KS_OK;
}

/* One Anthropic message -> chat messages appended to msgs. */
static ks_status message(cJSON *msgs, const cJSON *m, int i, struct reply *r)
{
    const cJSON *role = field(m, "role"), *content = field(m, "content");
    if (!cJSON_IsObject(m) || !cJSON_IsString(role) ||
        (strcmp(role->valuestring, "user") && strcmp(role->valuestring, "assistant")))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_request_error",
                          "messages[%d] needs 'role' \"user\" or \"assistant\" (the system prompt is the top-level "
                          "'system')", i);
    bool user = !strcmp(role->valuestring, "user");
    if (cJSON_IsString(content))
        return add_message(msgs, role->valuestring, strdup(content->valuestring), r);
    if (!cJSON_IsArray(content))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_request_error",
                          "messages[%d].content must be a string or an array of content blocks", i);
    struct sbuf text = {0}, thinking = {0};
    cJSON *calls = cJSON_CreateArray();
    int k = 0, n_text = 0;
    ks_status st = KS_OK;
    const cJSON *b;
    cJSON_ArrayForEach(b, content) {
        const cJSON *type = field(b, "type");
        const char *t = cJSON_IsString(type) ? type->valuestring : "";
        const cJSON *bt = field(b, "text");
        if (!strcmp(t, "text") && cJSON_IsString(bt)) {
            if (n_text++)
                sbuf_puts(&text, "\n");
            sbuf_puts(&text, bt->valuestring);
        } else if (!strcmp(t, "tool_result") && user) {
            st = tool_result(msgs, b, i, k, r);
        } else if (!strcmp(t, "tool_use") && !user) {
            st = tool_use(calls, b, i, k, r);
        } else if (!strcmp(t, "thinking") && !user && cJSON_IsString(field(b, "thinking"))) {
            sbuf_puts(&thinking, field(b, "thinking")->valuestring);
        } else if (!strcmp(t, "redacted_thinking") && !user) {
            /* opaque to kvserve: nothing to render */
        } else if (!strcmp(t, "text") || (!strcmp(t, "thinking") && !user)) {
            st = reply_fail(r, KS_ERR_INVALID_ARG, "invalid_request_error",
                            "messages[%d].content[%d]: a %s block needs a string '%s'", i, k, t, t);
        } else {
            st = reply_fail(r, KS_ERR_INVALID_ARG, "invalid_request_error",
                            "messages[%d].content[%d]: a %s block of type '%.64s' is not supported (user: text, "
                            "tool_result; assistant: text, tool_use, thinking)",
                            i, k, role->valuestring, t);
        }
        if (st)
            break;
        k++;
    }
    bool has_calls = cJSON_GetArraySize(calls) > 0;
    if (!st && (text.oom || thinking.oom))
        st = oom(r);
    if (!st && (n_text > 0 || has_calls || thinking.n > 0 || k == 0)) {
        cJSON *msg = cJSON_CreateObject();
        cJSON_AddStringToObject(msg, "role", role->valuestring);
        if (n_text > 0 || !has_calls)
            cJSON_AddStringToObject(msg, "content", text.p ? text.p : "");
        else
            cJSON_AddNullToObject(msg, "content");
        if (thinking.n > 0)
            cJSON_AddStringToObject(msg, "reasoning_content", thinking.p);
        if (has_calls) {
            server_json_add(msg, "tool_calls", calls);
            calls = NULL;
        }
        server_json_push(msgs, msg);
        st = server_json_failed() ? oom(r) : KS_OK;
    }
    cJSON_Delete(calls);
    sbuf_free(&text);
    sbuf_free(&thinking);
    return st;
}

static ks_status messages(cJSON *chat, const cJSON *root, struct reply *r)
{
    const cJSON *in = field(root, "messages"), *system = field(root, "system");
    if (!cJSON_IsArray(in) || cJSON_GetArraySize(in) == 0)
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_request_error", "'messages' must be a non-empty array");
    cJSON *msgs = cJSON_AddArrayToObject(chat, "messages");
    if (system) {
        char *text = NULL;
        ks_status st = server_proxy_join_text(system, text_types, 1, &text);
        if (st == KS_ERR_INVALID_ARG)
            return server_proxy_refuse_parts(r, system, text_types, 1, "system", "text blocks");
        if (st || (st = add_message(msgs, "system", text, r)))
            return st == KS_ERR_NOMEM ? oom(r) : st;
    }
    int i = 0;
    const cJSON *m;
    cJSON_ArrayForEach(m, in) {
        ks_status st = message(msgs, m, i++, r);
        if (st)
            return st;
    }
    return KS_OK;
}

static ks_status tools(cJSON *chat, const cJSON *root, struct reply *r)
{
    const cJSON *in = field(root, "tools");
    if (!in)
        return KS_OK;
    if (!cJSON_IsArray(in))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_request_error", "'tools' must be an array");
    cJSON *out = cJSON_AddArrayToObject(chat, "tools");
    int i = 0;
    const cJSON *t;
    cJSON_ArrayForEach(t, in) {
        const cJSON *name = field(t, "name"), *schema = field(t, "input_schema"), *type = field(t, "type"),
                    *desc = field(t, "description");
        if (type && (!cJSON_IsString(type) || strcmp(type->valuestring, "custom")))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_request_error",
                              "tools[%d]: server tools ('type' %.64s) are not supported; give custom tools "
                              "{\"name\",\"description\",\"input_schema\"}",
                              i, cJSON_IsString(type) ? type->valuestring : "?");
        if (!cJSON_IsObject(t) || !cJSON_IsString(name) || !cJSON_IsObject(schema) || (desc && !cJSON_IsString(desc)))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_request_error",
                              "tools[%d] must be {\"name\":STRING,\"description\":STRING,\"input_schema\":OBJECT}", i);
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "type", "function");
        cJSON *fn = cJSON_AddObjectToObject(o, "function");
        cJSON_AddStringToObject(fn, "name", name->valuestring);
        if (desc)
            cJSON_AddStringToObject(fn, "description", desc->valuestring);
        server_json_add(fn, "parameters", cJSON_Duplicate(schema, 1));
        server_json_push(out, o);
        i++;
    }
    return server_json_failed() ? oom(r) : KS_OK;
}

static ks_status tool_choice(cJSON *chat, const cJSON *root, struct reply *r)
{
    const cJSON *tc = field(root, "tool_choice");
    if (!tc)
        return KS_OK;
    const cJSON *type = field(tc, "type"), *name = field(tc, "name"), *dp = field(tc, "disable_parallel_tool_use");
    const char *t = cJSON_IsString(type) ? type->valuestring : "";
    if (!cJSON_IsObject(tc) || (dp && !cJSON_IsBool(dp)) ||
        (strcmp(t, "auto") && strcmp(t, "any") && strcmp(t, "none") && (strcmp(t, "tool") || !cJSON_IsString(name))))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_request_error",
                          "'tool_choice' must be {\"type\":\"auto\"|\"any\"|\"none\"} or {\"type\":\"tool\",\"name\":...}");
    if (!strcmp(t, "tool")) {
        cJSON *o = cJSON_AddObjectToObject(chat, "tool_choice");
        cJSON_AddStringToObject(o, "type", "function");
        cJSON_AddStringToObject(cJSON_AddObjectToObject(o, "function"), "name", name->valuestring);
    } else {
        cJSON_AddStringToObject(chat, "tool_choice", !strcmp(t, "any") ? "required" : t);
    }
    if (cJSON_IsTrue(dp))
        cJSON_AddFalseToObject(chat, "parallel_tool_calls");
    return server_json_failed() ? oom(r) : KS_OK;
}

/* thinking {"type":"enabled","budget_tokens":N} / {"type":"disabled"} -> enable_thinking. */
static ks_status thinking(cJSON *chat, const cJSON *root, struct reply *r)
{
    const cJSON *th = field(root, "thinking");
    if (!th)
        return KS_OK;
    const cJSON *type = field(th, "type");
    if (!cJSON_IsObject(th) || !cJSON_IsString(type) ||
        (strcmp(type->valuestring, "enabled") && strcmp(type->valuestring, "disabled")))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_request_error",
                          "'thinking' must be {\"type\":\"enabled\",\"budget_tokens\":N} or {\"type\":\"disabled\"}");
    cJSON *kw = cJSON_AddObjectToObject(chat, "chat_template_kwargs");
    cJSON_AddBoolToObject(kw, "enable_thinking", !strcmp(type->valuestring, "enabled"));
    return server_json_failed() ? oom(r) : KS_OK;
}

/* Copy root[from] to chat[to] (the chat route checks its value). */
/* The chat body of a Messages request; counting: count_tokens's (no
 * max_tokens, nothing generated). */
static ks_status to_chat(const cJSON *root, bool counting, cJSON **out, struct reply *r)
{
    ks_status st = check_fields(root, r);
    if (st)
        return st;
    const cJSON *mt = field(root, "max_tokens"), *stops = field(root, "stop_sequences");
    if (!counting && (!cJSON_IsNumber(mt) || mt->valuedouble != floor(mt->valuedouble) || mt->valuedouble < 1))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_request_error",
                          "'max_tokens' is required: a positive integer");
    if (stops && (!cJSON_IsArray(stops) || cJSON_GetArraySize(stops) > MAX_STOP))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_request_error",
                          "'stop_sequences' must be an array of at most %d strings", MAX_STOP);
    cJSON *chat = cJSON_CreateObject();
    if (!(st = messages(chat, root, r)) && !(st = tools(chat, root, r)) && !(st = tool_choice(chat, root, r)))
        st = thinking(chat, root, r);
    if (!st && !counting) {
        /* not "model": Anthropic's clients name Claude models (Claude Code,
         * the SDK's defaults) and mean whatever this server serves, as
         * llama-server takes them; the answer names the served model */
        static const char *const map[][2] = {{"max_tokens", "max_tokens"}, {"stop_sequences", "stop"},
                                             {"temperature", "temperature"}, {"top_p", "top_p"},
                                             {"top_k", "top_k"}, {"stream", "stream"}};
        server_proxy_copy_fields(chat, root, map, sizeof map / sizeof *map);
        if (server_json_failed())
            st = oom(r);
    }
    if (st) {
        cJSON_Delete(chat);
        return st;
    }
    *out = chat;
    return KS_OK;
}

/* ---- answer: chat -> Anthropic ----------------------------------------------------- */

enum block_kind { BLOCK_NONE, BLOCK_THINKING, BLOCK_TEXT, BLOCK_TOOL };

struct anthropic {
    char model[128];
    /* stream state */
    bool started, ended;
    int index;                /* the open block's index, -1: none yet */
    enum block_kind open;
    char finish[16];          /* the chat finish_reason */
    int output_tokens;
};

static const char *stop_reason(const char *finish, const struct proxy_facts *f)
{
    if (!strcmp(finish, "tool_calls"))
        return "tool_use";
    if (!strcmp(finish, "length"))
        return "max_tokens";
    return f->stop_word ? "stop_sequence" : "end_turn";
}

static void add_stop(cJSON *o, const char *finish, const struct proxy_facts *f)
{
    cJSON_AddStringToObject(o, "stop_reason", stop_reason(finish, f));
    if (f->stop_word && strcmp(finish, "tool_calls") && strcmp(finish, "length"))
        cJSON_AddStringToObject(o, "stop_sequence", f->stop_word);
    else
        cJSON_AddNullToObject(o, "stop_sequence");
}

static cJSON *message_head(const cJSON *chat_id, const char *model)
{
    char id[64];
    snprintf(id, sizeof id, "msg_%s", server_proxy_serial(cJSON_IsString(chat_id) ? chat_id->valuestring : "0"));
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", id);
    cJSON_AddStringToObject(o, "type", "message");
    cJSON_AddStringToObject(o, "role", "assistant");
    cJSON_AddStringToObject(o, "model", model);
    return o;
}

/* Anthropic counts the prompt in parts: input_tokens are the ones computed,
 * cache_read_input_tokens the ones the prefix cache served (as llama-server
 * answers too); nothing is written to a cache on request here. */
static cJSON *usage(int prompt, int cached, int output)
{
    cJSON *u = cJSON_CreateObject();
    cJSON_AddNumberToObject(u, "input_tokens", prompt - cached);
    cJSON_AddNumberToObject(u, "cache_creation_input_tokens", 0);
    cJSON_AddNumberToObject(u, "cache_read_input_tokens", cached);
    cJSON_AddNumberToObject(u, "output_tokens", output);
    return u;
}

/* A tool call's arguments (JSON text) as the block's input object. */
static cJSON *tool_input(const char *args)
{
    cJSON *in = cJSON_Parse(args);
    if (!cJSON_IsObject(in)) {
        cJSON_Delete(in);
        in = cJSON_CreateObject();
    }
    return in;
}

static ks_status anthropic_whole(void *ctx, const cJSON *chat, const struct proxy_facts *f, cJSON **out)
{
    struct anthropic *a = ctx;
    const cJSON *choice = cJSON_GetArrayItem(field(chat, "choices"), 0);
    const cJSON *msg = field(choice, "message"), *finish = field(choice, "finish_reason");
    const cJSON *reasoning = field(msg, "reasoning_content"), *text = field(msg, "content");
    const cJSON *u = field(chat, "usage"), *calls = field(msg, "tool_calls");
    cJSON *o = message_head(field(chat, "id"), a->model);
    cJSON *content = cJSON_AddArrayToObject(o, "content");
    if (cJSON_IsString(reasoning)) {
        cJSON *b = cJSON_CreateObject();
        cJSON_AddStringToObject(b, "type", "thinking");
        cJSON_AddStringToObject(b, "thinking", reasoning->valuestring);
        cJSON_AddStringToObject(b, "signature", "");
        server_json_push(content, b);
    }
    if (cJSON_IsString(text) && (text->valuestring[0] || !calls)) {
        cJSON *b = cJSON_CreateObject();
        cJSON_AddStringToObject(b, "type", "text");
        cJSON_AddStringToObject(b, "text", text->valuestring);
        server_json_push(content, b);
    }
    const cJSON *c;
    cJSON_ArrayForEach(c, calls) {
        const cJSON *fn = field(c, "function");
        const cJSON *id = field(c, "id"), *name = field(fn, "name"), *args = field(fn, "arguments");
        cJSON *b = cJSON_CreateObject();
        cJSON_AddStringToObject(b, "type", "tool_use");
        cJSON_AddStringToObject(b, "id", cJSON_IsString(id) ? id->valuestring : "");
        cJSON_AddStringToObject(b, "name", cJSON_IsString(name) ? name->valuestring : "");
        server_json_add(b, "input", tool_input(cJSON_IsString(args) ? args->valuestring : "{}"));
        server_json_push(content, b);
    }
    add_stop(o, cJSON_IsString(finish) ? finish->valuestring : "stop", f);
    const cJSON *pt = field(u, "prompt_tokens"), *ct = field(u, "completion_tokens");
    const cJSON *cached = field(field(u, "prompt_tokens_details"), "cached_tokens");
    server_json_add(o, "usage", usage(cJSON_IsNumber(pt) ? pt->valueint : f->n_prompt,
                                      cJSON_IsNumber(cached) ? cached->valueint : f->n_cached,
                                      cJSON_IsNumber(ct) ? ct->valueint : 0));
    if (server_json_failed()) {
        cJSON_Delete(o);
        return KS_ERR_NOMEM;
    }
    *out = o;
    return KS_OK;
}

/* ---- the stream ------------------------------------------------------------------- */

static bool send_block_stop(struct anthropic *a, struct sbuf *out)
{
    if (a->open == BLOCK_NONE)
        return true;
    a->open = BLOCK_NONE;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", "content_block_stop");
    cJSON_AddNumberToObject(o, "index", a->index);
    return server_sse_event(out, "content_block_stop", o);
}

/* Open a block of kind (closing the one open): block is its content_block. */
static bool send_block_start(struct anthropic *a, enum block_kind kind, cJSON *block, struct sbuf *out)
{
    if (!send_block_stop(a, out)) {
        cJSON_Delete(block);
        return false;
    }
    a->open = kind;
    a->index++;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", "content_block_start");
    cJSON_AddNumberToObject(o, "index", a->index);
    server_json_add(o, "content_block", block);
    return server_sse_event(out, "content_block_start", o);
}

static bool send_delta(struct anthropic *a, const char *type, const char *key, const char *text, struct sbuf *out)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", "content_block_delta");
    cJSON_AddNumberToObject(o, "index", a->index);
    cJSON *d = cJSON_AddObjectToObject(o, "delta");
    cJSON_AddStringToObject(d, "type", type);
    cJSON_AddStringToObject(d, key, text);
    return server_sse_event(out, "content_block_delta", o);
}

/* Text of a part kind (thinking or text), in its block (opened if need be). */
static bool send_text(struct anthropic *a, enum block_kind kind, const char *text, struct sbuf *out)
{
    bool think = kind == BLOCK_THINKING;
    if (a->open != kind) {
        cJSON *b = cJSON_CreateObject();
        cJSON_AddStringToObject(b, "type", think ? "thinking" : "text");
        cJSON_AddStringToObject(b, think ? "thinking" : "text", "");
        if (think)
            cJSON_AddStringToObject(b, "signature", "");
        if (!send_block_start(a, kind, b, out))
            return false;
    }
    return send_delta(a, think ? "thinking_delta" : "text_delta", think ? "thinking" : "text", text, out);
}

/* A tool call's chat deltas: the first (id, name) opens its block, the
 * arguments are its input_json_delta. */
static bool send_call(struct anthropic *a, const cJSON *call, struct sbuf *out)
{
    const cJSON *id = field(call, "id"), *fn = field(call, "function");
    const cJSON *name = field(fn, "name"), *args = field(fn, "arguments");
    if (cJSON_IsString(id)) {
        cJSON *b = cJSON_CreateObject();
        cJSON_AddStringToObject(b, "type", "tool_use");
        cJSON_AddStringToObject(b, "id", id->valuestring);
        cJSON_AddStringToObject(b, "name", cJSON_IsString(name) ? name->valuestring : "");
        cJSON_AddObjectToObject(b, "input");
        if (!send_block_start(a, BLOCK_TOOL, b, out))
            return false;
    }
    if (cJSON_IsString(args) && args->valuestring[0] && a->open == BLOCK_TOOL)
        return send_delta(a, "input_json_delta", "partial_json", args->valuestring, out);
    return true;
}

static bool send_start(struct anthropic *a, const cJSON *chunk, const struct proxy_facts *f, struct sbuf *out)
{
    a->started = true;
    cJSON *m = message_head(field(chunk, "id"), a->model);
    cJSON_AddArrayToObject(m, "content");
    cJSON_AddNullToObject(m, "stop_reason");
    cJSON_AddNullToObject(m, "stop_sequence");
    server_json_add(m, "usage", usage(f->n_prompt, f->n_cached, 0));
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", "message_start");
    server_json_add(o, "message", m);
    cJSON *ping = cJSON_CreateObject();
    cJSON_AddStringToObject(ping, "type", "ping");
    return server_sse_event(out, "message_start", o) && server_sse_event(out, "ping", ping);
}

static bool send_end(struct anthropic *a, const struct proxy_facts *f, struct sbuf *out)
{
    a->ended = true;
    if (!send_block_stop(a, out))
        return false;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", "message_delta");
    cJSON *d = cJSON_AddObjectToObject(o, "delta");
    add_stop(d, a->finish[0] ? a->finish : "stop", f);
    server_json_add(o, "usage", usage(f->n_prompt, f->n_cached, a->output_tokens));
    cJSON *stop = cJSON_CreateObject();
    cJSON_AddStringToObject(stop, "type", "message_stop");
    return server_sse_event(out, "message_delta", o) && server_sse_event(out, "message_stop", stop);
}

/* An error event ends the stream (Anthropic's clients stop at it). */
static bool send_error(struct anthropic *a, const cJSON *err, struct sbuf *out)
{
    a->ended = true;
    const cJSON *m = field(err, "message");
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", "error");
    cJSON *e = cJSON_AddObjectToObject(o, "error");
    cJSON_AddStringToObject(e, "type", "api_error");
    cJSON_AddStringToObject(e, "message", cJSON_IsString(m) ? m->valuestring : "generation failed");
    return server_sse_event(out, "error", o);
}

static bool anthropic_event(void *ctx, const cJSON *chunk, const struct proxy_facts *f, struct sbuf *out)
{
    struct anthropic *a = ctx;
    if (a->ended)
        return true;
    if (!chunk)
        return send_end(a, f, out);
    if (field(chunk, "error"))
        return send_error(a, field(chunk, "error"), out);
    if (!a->started && !send_start(a, chunk, f, out))
        return false;
    const cJSON *u = field(chunk, "usage");
    if (cJSON_IsNumber(field(u, "completion_tokens")))
        a->output_tokens = field(u, "completion_tokens")->valueint;
    const cJSON *choice = cJSON_GetArrayItem(field(chunk, "choices"), 0);
    const cJSON *delta = field(choice, "delta"), *finish = field(choice, "finish_reason");
    const cJSON *reasoning = field(delta, "reasoning_content"), *text = field(delta, "content");
    bool ok = true;
    if (cJSON_IsString(reasoning) && reasoning->valuestring[0])
        ok = send_text(a, BLOCK_THINKING, reasoning->valuestring, out);
    if (ok && cJSON_IsString(text) && text->valuestring[0])
        ok = send_text(a, BLOCK_TEXT, text->valuestring, out);
    const cJSON *call;
    cJSON_ArrayForEach(call, field(delta, "tool_calls")) if (ok) ok = send_call(a, call, out);
    if (cJSON_IsString(finish))
        snprintf(a->finish, sizeof a->finish, "%s", finish->valuestring);
    return ok;
}

static void anthropic_free(void *ctx)
{
    free(ctx);
}

/* ---- routes ------------------------------------------------------------------------ */

static ks_status anthropic_request(const struct server *srv, const cJSON *root, cJSON **chat, void **ctx,
                                   struct reply *r)
{
    struct anthropic *a = calloc(1, sizeof *a);
    if (!a)
        return oom(r);
    ks_status st = to_chat(root, false, chat, r);
    if (st) {
        free(a);
        return st;
    }
    snprintf(a->model, sizeof a->model, "%s", srv->model_name);
    a->index = -1;
    *ctx = a;
    return KS_OK;
}

const struct proxy_api server_anthropic_api = {anthropic_request, anthropic_whole, anthropic_event,
                                               server_anthropic_error, anthropic_free};

ks_status server_route_messages(struct server *srv, const struct server_req *rq, struct reply *r)
{
    return server_proxy_route(srv, rq, &server_anthropic_api, r);
}

/* The prompt's tokens as /v1/messages would count them ({"input_tokens": N}). */
ks_status server_route_count_tokens(struct server *srv, const struct server_req *rq, struct reply *r)
{
    cJSON *root, *chat = NULL;
    ks_status st = server_parse_object(rq->body, rq->len, false, &root, r);
    if (!st) {
        st = to_chat(root, true, &chat, r);
        cJSON_Delete(root);
    }
    struct server_tool_opts opts;
    char *text = NULL;
    if (!st && !(st = server_parse_tool_options(chat, &opts, r)))
        st = server_chat_prompt(srv, chat, &text, r);
    cJSON_Delete(chat);
    int32_t *ids = NULL;
    size_t n = 0;
    if (!st && tok_encode(srv->tok, text, strlen(text), TOK_ADD_SPECIAL | TOK_PARSE_SPECIAL, &ids, &n))
        st = reply_fail(r, KS_ERR_NOMEM, NULL, "tokenizer: %s", ks_errmsg());
    free(text);
    free(ids);
    if (st)
        return server_proxy_fail(&server_anthropic_api, r, st);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "input_tokens", (double)n);
    st = reply_json(r, 200, o);
    return st ? server_proxy_fail(&server_anthropic_api, r, st) : KS_OK;
}
