/* OpenAI's Responses API: POST /v1/responses over the chat route
 * (server_proxy_internal.h).
 *
 * Request: input (a string, or items: messages {role, content} whose content
 * is a string or input_text/output_text parts, function_call,
 * function_call_output; reasoning items are skipped), instructions (the
 * system message), tools (function), tool_choice, parallel_tool_calls,
 * max_output_tokens, temperature, top_p, text.format (text, json_object,
 * json_schema), reasoning.effort and stream. Nothing is stored: store is
 * accepted, previous_response_id refused. Answer: a response object whose
 * output holds a reasoning item (when the model thinks), a message item and
 * function_call items, with usage; a stream of the Responses events.
 * Errors are OpenAI's {"error":{...}}. */
#include "server/server_proxy_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static cJSON *field(const cJSON *o, const char *key)
{
    cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNull(v) ? NULL : v;
}

static ks_status oom(struct reply *r)
{
    return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while reading the request");
}

static void responses_error(struct reply *r, unsigned status, const char *code, const char *msg)
{
    static const char *const renames[][2] = {{"max_tokens", "max_output_tokens"},
                                              {"'response_format.json_schema.schema'", "'text.format.schema'"},
                                              {"'response_format.json_schema'", "'text.format'"},
                                              {"'response_format'", "'text.format'"}};
    char named[2][1024];
    snprintf(named[0], sizeof named[0], "%s", msg);
    for (size_t i = 0; i < sizeof renames / sizeof renames[0]; i++)
        server_proxy_rename(named[(i + 1) % 2], sizeof named[0], named[i % 2], renames[i][0], renames[i][1]);
    server_reply_error(r, status, code, "%s", named[sizeof renames / sizeof renames[0] % 2]);
}

/* ---- request: Responses -> chat ---------------------------------------------------- */

/* Fields this route reads; bookkeeping it accepts and ignores; fields
 * accepted only at the value that changes nothing. */
static const char *const known_fields[] = {"model", "input", "instructions", "tools", "tool_choice",
                                           "parallel_tool_calls", "max_output_tokens", "temperature", "top_p",
                                           "text", "reasoning", "stream", "store", "metadata", "user",
                                           "service_tier", "prompt_cache_key", "safety_identifier"};
static const char *const falsy_fields[] = {"include", "background", "previous_response_id", "top_logprobs",
                                           "truncation", "conversation", "prompt", "max_tool_calls"};

static bool falsy(const cJSON *v)
{
    return cJSON_IsNull(v) || cJSON_IsFalse(v) || (cJSON_IsNumber(v) && v->valuedouble == 0) ||
           (cJSON_IsString(v) && (!v->valuestring[0] || !strcmp(v->valuestring, "disabled"))) ||
           ((cJSON_IsArray(v) || cJSON_IsObject(v)) && !v->child);
}

static ks_status check_fields(const cJSON *root, struct reply *r)
{
    const cJSON *f;
    cJSON_ArrayForEach(f, root) {
        bool known = false;
        for (size_t i = 0; i < sizeof known_fields / sizeof known_fields[0] && !known; i++)
            known = !strcmp(f->string, known_fields[i]);
        for (size_t i = 0; i < sizeof falsy_fields / sizeof falsy_fields[0] && !known; i++)
            known = !strcmp(f->string, falsy_fields[i]) && falsy(f);
        if (!known)
            return reply_fail(r, KS_ERR_INVALID_ARG, "unsupported_parameter",
                              "'%.64s' is not supported by kvserve's /v1/responses (nothing is stored between "
                              "requests); leave it out",
                              f->string);
    }
    return KS_OK;
}

static const char *const text_types[] = {"input_text", "output_text", "text"};

/* A message item {role, content} -> a chat message. */
static ks_status message_item(cJSON *msgs, const cJSON *it, int i, struct reply *r)
{
    const cJSON *role = field(it, "role");
    const char *rn = cJSON_IsString(role) ? role->valuestring : "";
    if (strcmp(rn, "user") && strcmp(rn, "assistant") && strcmp(rn, "system") && strcmp(rn, "developer"))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                          "input[%d].role must be user, assistant, system or developer", i);
    char *text = NULL;
    ks_status st = server_proxy_join_text(field(it, "content"), text_types, 3, &text);
    if (st == KS_ERR_INVALID_ARG) {
        char where[64];
        snprintf(where, sizeof where, "input[%d].content", i);
        return server_proxy_refuse_parts(r, field(it, "content"), text_types, 3, where, "input_text/output_text parts");
    }
    if (st)
        return oom(r);
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "role", rn);
    cJSON_AddStringToObject(m, "content", text);
    free(text);
    server_json_push(msgs, m);
    return server_json_failed() ? oom(r) : KS_OK;
}

/* A function_call item -> a tool call of the assistant message before it
 * (a new one unless the previous message is an assistant's). */
static ks_status call_item(cJSON *msgs, const cJSON *it, int i, struct reply *r)
{
    const cJSON *id = field(it, "call_id"), *name = field(it, "name"), *args = field(it, "arguments");
    if (!cJSON_IsString(id) || !cJSON_IsString(name) || !cJSON_IsString(args))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                          "input[%d]: a function_call is {\"call_id\",\"name\",\"arguments\"} (strings)", i);
    cJSON *last = cJSON_GetArrayItem(msgs, cJSON_GetArraySize(msgs) - 1);
    const cJSON *role = field(last, "role");
    if (!cJSON_IsString(role) || strcmp(role->valuestring, "assistant")) {
        last = cJSON_CreateObject();
        cJSON_AddStringToObject(last, "role", "assistant");
        cJSON_AddNullToObject(last, "content");
        server_json_push(msgs, last);
    }
    cJSON *calls = field(last, "tool_calls");
    if (!calls)
        calls = cJSON_AddArrayToObject(last, "tool_calls");
    cJSON *c = cJSON_CreateObject();
    cJSON_AddStringToObject(c, "id", id->valuestring);
    cJSON_AddStringToObject(c, "type", "function");
    cJSON *fn = cJSON_AddObjectToObject(c, "function");
    cJSON_AddStringToObject(fn, "name", name->valuestring);
    cJSON_AddStringToObject(fn, "arguments", args->valuestring);
    server_json_push(calls, c);
    return server_json_failed() ? oom(r) : KS_OK;
}

/* A function_call_output item -> a tool message (content a string). */
static ks_status output_item(cJSON *msgs, const cJSON *it, int i, struct reply *r)
{
    const cJSON *id = field(it, "call_id");
    char *text = NULL;
    if (!cJSON_IsString(id))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                          "input[%d]: a function_call_output is {\"call_id\":STRING,\"output\":STRING}", i);
    ks_status st = server_proxy_join_text(field(it, "output"), text_types, 3, &text);
    if (st == KS_ERR_INVALID_ARG) {
        char where[64];
        snprintf(where, sizeof where, "input[%d].output", i);
        return server_proxy_refuse_parts(r, field(it, "output"), text_types, 3, where, "input_text parts");
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

static ks_status input(cJSON *chat, const cJSON *root, struct reply *r)
{
    const cJSON *in = field(root, "input"), *instr = field(root, "instructions");
    cJSON *msgs = cJSON_AddArrayToObject(chat, "messages");
    if (instr && !cJSON_IsString(instr))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'instructions' must be a string");
    if (instr) {
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "role", "system");
        cJSON_AddStringToObject(m, "content", instr->valuestring);
        server_json_push(msgs, m);
    }
    if (cJSON_IsString(in)) {
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "role", "user");
        cJSON_AddStringToObject(m, "content", in->valuestring);
        server_json_push(msgs, m);
        return server_json_failed() ? oom(r) : KS_OK;
    }
    if (!cJSON_IsArray(in) || cJSON_GetArraySize(in) == 0)
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'input' must be a string or a non-empty array of items");
    int i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, in) {
        const cJSON *type = field(it, "type");
        const char *t = cJSON_IsString(type) ? type->valuestring : field(it, "role") ? "message" : "";
        ks_status st;
        if (!strcmp(t, "message"))
            st = message_item(msgs, it, i, r);
        else if (!strcmp(t, "function_call"))
            st = call_item(msgs, it, i, r);
        else if (!strcmp(t, "function_call_output"))
            st = output_item(msgs, it, i, r);
        else if (!strcmp(t, "reasoning"))
            st = KS_OK; /* the model's earlier thinking: templates drop it from past turns */
        else
            st = reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                            "input[%d]: items of type '%.64s' are not supported (message, function_call, "
                            "function_call_output, reasoning)",
                            i, t);
        if (st)
            return st;
        i++;
    }
    return KS_OK;
}

static ks_status tools(cJSON *chat, const cJSON *root, struct reply *r)
{
    const cJSON *in = field(root, "tools");
    if (!in)
        return KS_OK;
    if (!cJSON_IsArray(in))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'tools' must be an array");
    cJSON *out = cJSON_AddArrayToObject(chat, "tools");
    int i = 0;
    const cJSON *t;
    cJSON_ArrayForEach(t, in) {
        const cJSON *type = field(t, "type"), *name = field(t, "name"), *desc = field(t, "description"),
                    *params = field(t, "parameters");
        if (!cJSON_IsString(type) || strcmp(type->valuestring, "function"))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                              "tools[%d]: only function tools are supported (got type '%.64s')", i,
                              cJSON_IsString(type) ? type->valuestring : "?");
        if (!cJSON_IsString(name) || (desc && !cJSON_IsString(desc)) || (params && !cJSON_IsObject(params)))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                              "tools[%d] must be {\"type\":\"function\",\"name\":STRING,\"parameters\":OBJECT}", i);
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "type", "function");
        cJSON *fn = cJSON_AddObjectToObject(o, "function");
        cJSON_AddStringToObject(fn, "name", name->valuestring);
        if (desc)
            cJSON_AddStringToObject(fn, "description", desc->valuestring);
        if (params)
            server_json_add(fn, "parameters", cJSON_Duplicate(params, 1));
        server_json_push(out, o);
        i++;
    }
    return server_json_failed() ? oom(r) : KS_OK;
}

static ks_status tool_choice(cJSON *chat, const cJSON *root, struct reply *r)
{
    const cJSON *tc = field(root, "tool_choice");
    if (!tc || cJSON_IsString(tc)) { /* auto, none, required: the chat route checks them */
        if (tc)
            server_json_add(chat, "tool_choice", cJSON_Duplicate(tc, 1));
        return server_json_failed() ? oom(r) : KS_OK;
    }
    const cJSON *type = field(tc, "type"), *name = field(tc, "name");
    if (!cJSON_IsString(type) || strcmp(type->valuestring, "function") || !cJSON_IsString(name))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                          "'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\":\"function\",\"name\":...}");
    cJSON *o = cJSON_AddObjectToObject(chat, "tool_choice");
    cJSON_AddStringToObject(o, "type", "function");
    cJSON_AddStringToObject(cJSON_AddObjectToObject(o, "function"), "name", name->valuestring);
    return server_json_failed() ? oom(r) : KS_OK;
}

/* text.format -> response_format; reasoning.effort -> reasoning_effort. */
static ks_status text_and_reasoning(cJSON *chat, const cJSON *root, struct reply *r)
{
    const cJSON *text = field(root, "text"), *reasoning = field(root, "reasoning");
    const cJSON *format = field(text, "format");
    if ((text && !cJSON_IsObject(text)) || (reasoning && !cJSON_IsObject(reasoning)))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'%s' must be an object", text && !cJSON_IsObject(text) ? "text" : "reasoning");
    if (field(text, "verbosity")) /* reasoning.summary is ignored: the reasoning item holds the whole text */
        return reply_fail(r, KS_ERR_INVALID_ARG, "unsupported_parameter",
                          "'text.verbosity' is not supported: kvserve does not implement a verbosity level; leave it "
                          "out");
    const cJSON *type = field(format, "type");
    if (format && (!cJSON_IsString(type) || (strcmp(type->valuestring, "text") && strcmp(type->valuestring, "json_object") &&
                                              strcmp(type->valuestring, "json_schema"))))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                          "'text.format.type' must be text, json_object or json_schema");
    if (format && !strcmp(type->valuestring, "json_schema")) {
        cJSON *rf = cJSON_AddObjectToObject(chat, "response_format");
        cJSON_AddStringToObject(rf, "type", "json_schema");
        cJSON *js = cJSON_AddObjectToObject(rf, "json_schema");
        static const char *const keys[] = {"name", "schema", "strict"};
        for (int i = 0; i < 3; i++)
            if (field(format, keys[i]))
                server_json_add(js, keys[i], cJSON_Duplicate(field(format, keys[i]), 1));
    } else if (format && !strcmp(type->valuestring, "json_object")) {
        cJSON_AddStringToObject(cJSON_AddObjectToObject(chat, "response_format"), "type", "json_object");
    }
    const cJSON *effort = field(reasoning, "effort");
    if (effort && !cJSON_IsString(effort))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'reasoning.effort' must be a string");
    if (effort)
        cJSON_AddStringToObject(chat, "reasoning_effort", effort->valuestring);
    return server_json_failed() ? oom(r) : KS_OK;
}

static ks_status to_chat(const cJSON *root, cJSON **out, struct reply *r)
{
    ks_status st = check_fields(root, r);
    if (st)
        return st;
    cJSON *chat = cJSON_CreateObject();
    if (!(st = input(chat, root, r)) && !(st = tools(chat, root, r)) && !(st = tool_choice(chat, root, r)))
        st = text_and_reasoning(chat, root, r);
    if (!st) {
        static const char *const map[][2] = {{"model", "model"}, {"max_output_tokens", "max_tokens"},
                                             {"temperature", "temperature"}, {"top_p", "top_p"},
                                             {"parallel_tool_calls", "parallel_tool_calls"}, {"stream", "stream"}};
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

/* ---- answer: chat -> Responses ----------------------------------------------------- */

enum item_kind { ITEM_NONE, ITEM_REASONING, ITEM_MESSAGE, ITEM_CALL };

struct responses {
    cJSON *echo;              /* the request's settings the response object repeats */
    char model[128];
    long created;
    char serial[32];          /* the chat id's serial number: resp_N, msg_N, ... */
    /* stream state */
    bool started, ended;
    int seq;                  /* sequence_number of the next event */
    cJSON *output;            /* the items done so far */
    enum item_kind open;
    char item_id[64];
    struct sbuf text;         /* the open item's text (or arguments) */
    char call_id[80], call_name[128];
    char finish[16];
    int input_tokens, output_tokens, cached_tokens;
};

static cJSON *response_object(const struct responses *s, const char *status, cJSON *output)
{
    char id[64];
    snprintf(id, sizeof id, "resp_%s", s->serial);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", id);
    cJSON_AddStringToObject(o, "object", "response");
    cJSON_AddNumberToObject(o, "created_at", (double)s->created);
    cJSON_AddStringToObject(o, "status", status);
    cJSON_AddNullToObject(o, "error");
    if (!strcmp(status, "incomplete"))
        cJSON_AddStringToObject(cJSON_AddObjectToObject(o, "incomplete_details"), "reason", "max_output_tokens");
    else
        cJSON_AddNullToObject(o, "incomplete_details");
    cJSON_AddStringToObject(o, "model", s->model);
    server_json_add(o, "output", output ? output : cJSON_CreateArray());
    const cJSON *e;
    cJSON_ArrayForEach(e, s->echo) server_json_add(o, e->string, cJSON_Duplicate(e, 1));
    return o;
}

static cJSON *usage(int input, int cached, int output)
{
    cJSON *u = cJSON_CreateObject();
    cJSON_AddNumberToObject(u, "input_tokens", input);
    cJSON_AddNumberToObject(cJSON_AddObjectToObject(u, "input_tokens_details"), "cached_tokens", cached);
    cJSON_AddNumberToObject(u, "output_tokens", output);
    cJSON_AddNumberToObject(cJSON_AddObjectToObject(u, "output_tokens_details"), "reasoning_tokens", 0);
    cJSON_AddNumberToObject(u, "total_tokens", (double)input + output); /* counts read back from a chat reply: no int overflow */
    return u;
}

static cJSON *text_part(const char *type, const char *text)
{
    cJSON *p = cJSON_CreateObject();
    cJSON_AddStringToObject(p, "type", type);
    cJSON_AddStringToObject(p, "text", text);
    if (!strcmp(type, "output_text"))
        cJSON_AddArrayToObject(p, "annotations");
    return p;
}

/* An item of kind with its text (the arguments of a call); status done or in_progress. */
static cJSON *item_json(enum item_kind kind, const char *id, const char *text, const char *call_id, const char *name,
                        bool done)
{
    cJSON *it = cJSON_CreateObject();
    cJSON_AddStringToObject(it, "id", id);
    if (kind == ITEM_REASONING) {
        cJSON_AddStringToObject(it, "type", "reasoning");
        cJSON_AddArrayToObject(it, "summary");
        cJSON *content = cJSON_AddArrayToObject(it, "content");
        if (done)
            server_json_push(content, text_part("reasoning_text", text));
        return it;
    }
    cJSON_AddStringToObject(it, "type", kind == ITEM_MESSAGE ? "message" : "function_call");
    cJSON_AddStringToObject(it, "status", done ? "completed" : "in_progress");
    if (kind == ITEM_MESSAGE) {
        cJSON_AddStringToObject(it, "role", "assistant");
        cJSON *content = cJSON_AddArrayToObject(it, "content");
        if (done)
            server_json_push(content, text_part("output_text", text));
    } else {
        cJSON_AddStringToObject(it, "call_id", call_id);
        cJSON_AddStringToObject(it, "name", name);
        cJSON_AddStringToObject(it, "arguments", done ? text : "");
    }
    return it;
}

/* An item's id: its kind's prefix, the request's serial and its index in output. */
static void item_name(char *buf, size_t size, enum item_kind kind, const char *serial, int index)
{
    const char *prefix = kind == ITEM_REASONING ? "rs" : kind == ITEM_MESSAGE ? "msg" : "fc";
    snprintf(buf, size, "%s_%s_%d", prefix, serial, index);
}

static ks_status responses_whole(void *ctx, const cJSON *chat, const struct proxy_facts *f, cJSON **out)
{
    struct responses *s = ctx;
    const cJSON *choice = cJSON_GetArrayItem(field(chat, "choices"), 0);
    const cJSON *msg = field(choice, "message"), *finish = field(choice, "finish_reason");
    const cJSON *reasoning = field(msg, "reasoning_content"), *text = field(msg, "content"), *calls = field(msg, "tool_calls");
    const cJSON *id = field(chat, "id"), *u = field(chat, "usage");
    snprintf(s->serial, sizeof s->serial, "%s", server_proxy_serial(cJSON_IsString(id) ? id->valuestring : "0"));
    cJSON *output = cJSON_CreateArray();
    char item_id[96];
    if (cJSON_IsString(reasoning)) {
        item_name(item_id, sizeof item_id, ITEM_REASONING, s->serial, cJSON_GetArraySize(output));
        server_json_push(output, item_json(ITEM_REASONING, item_id, reasoning->valuestring, NULL, NULL, true));
    }
    if (cJSON_IsString(text) && (text->valuestring[0] || !calls)) {
        item_name(item_id, sizeof item_id, ITEM_MESSAGE, s->serial, cJSON_GetArraySize(output));
        server_json_push(output, item_json(ITEM_MESSAGE, item_id, text->valuestring, NULL, NULL, true));
    }
    const cJSON *c;
    cJSON_ArrayForEach(c, calls) {
        const cJSON *fn = field(c, "function"), *cid = field(c, "id");
        const cJSON *name = field(fn, "name"), *args = field(fn, "arguments");
        item_name(item_id, sizeof item_id, ITEM_CALL, s->serial, cJSON_GetArraySize(output));
        server_json_push(output, item_json(ITEM_CALL, item_id, cJSON_IsString(args) ? args->valuestring : "{}",
                                           cJSON_IsString(cid) ? cid->valuestring : "",
                                           cJSON_IsString(name) ? name->valuestring : "", true));
    }
    bool cut = cJSON_IsString(finish) && !strcmp(finish->valuestring, "length");
    cJSON *o = response_object(s, cut ? "incomplete" : "completed", output);
    const cJSON *pt = field(u, "prompt_tokens"), *ct = field(u, "completion_tokens");
    const cJSON *cached = field(field(u, "prompt_tokens_details"), "cached_tokens");
    server_json_add(o, "usage", usage(cJSON_IsNumber(pt) ? pt->valueint : f->n_prompt,
                                      cJSON_IsNumber(cached) ? cached->valueint : 0,
                                      cJSON_IsNumber(ct) ? ct->valueint : 0));
    if (server_json_failed()) {
        cJSON_Delete(o);
        return KS_ERR_NOMEM;
    }
    *out = o;
    return KS_OK;
}

/* ---- the stream ------------------------------------------------------------------- */

/* An event {"type": name, "sequence_number", ...o's keys}. */
static bool send_event(struct responses *s, const char *name, cJSON *o, struct sbuf *out)
{
    cJSON *e = cJSON_CreateObject();
    cJSON_AddStringToObject(e, "type", name);
    cJSON_AddNumberToObject(e, "sequence_number", s->seq++);
    while (o && o->child) {
        cJSON *kv = cJSON_DetachItemViaPointer(o, o->child);
        server_json_add(e, kv->string, kv);
    }
    cJSON_Delete(o);
    return server_sse_event(out, name, e);
}

/* The open item's index in output. */
static int open_index(const struct responses *s)
{
    return cJSON_GetArraySize(s->output);
}

static cJSON *item_event(const struct responses *s, bool content_index)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "item_id", s->item_id);
    cJSON_AddNumberToObject(o, "output_index", open_index(s));
    if (content_index)
        cJSON_AddNumberToObject(o, "content_index", 0);
    return o;
}

/* Close the open item: its .done events, then it joins output. */
static bool close_item(struct responses *s, struct sbuf *out)
{
    if (s->open == ITEM_NONE)
        return true;
    enum item_kind kind = s->open;
    s->open = ITEM_NONE;
    const char *text = s->text.p ? s->text.p : "";
    bool ok = true;
    if (kind == ITEM_CALL) {
        cJSON *o = item_event(s, false);
        cJSON_AddStringToObject(o, "name", s->call_name);
        cJSON_AddStringToObject(o, "arguments", text);
        ok = send_event(s, "response.function_call_arguments.done", o, out);
    } else {
        bool think = kind == ITEM_REASONING;
        cJSON *o = item_event(s, true);
        cJSON_AddStringToObject(o, "text", text);
        if (!think)
            cJSON_AddArrayToObject(o, "logprobs");
        cJSON *p = item_event(s, true);
        server_json_add(p, "part", text_part(think ? "reasoning_text" : "output_text", text));
        ok = send_event(s, think ? "response.reasoning_text.done" : "response.output_text.done", o, out) &&
             send_event(s, "response.content_part.done", p, out);
    }
    cJSON *item = item_json(kind, s->item_id, text, s->call_id, s->call_name, true);
    cJSON *d = cJSON_CreateObject();
    cJSON_AddNumberToObject(d, "output_index", open_index(s));
    server_json_add(d, "item", cJSON_Duplicate(item, 1));
    ok = ok && send_event(s, "response.output_item.done", d, out);
    server_json_push(s->output, item);
    sbuf_free(&s->text);
    return ok && !server_json_failed();
}

/* Open an item of kind (closing the one open): output_item.added, and the
 * content part of a message or reasoning item. */
static bool open_item(struct responses *s, enum item_kind kind, const char *call_id, const char *name, struct sbuf *out)
{
    if (!close_item(s, out))
        return false;
    int n = open_index(s);
    item_name(s->item_id, sizeof s->item_id, kind, s->serial, n);
    snprintf(s->call_id, sizeof s->call_id, "%s", call_id ? call_id : "");
    snprintf(s->call_name, sizeof s->call_name, "%s", name ? name : "");
    s->open = kind;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "output_index", n);
    server_json_add(o, "item", item_json(kind, s->item_id, "", s->call_id, s->call_name, false));
    if (!send_event(s, "response.output_item.added", o, out))
        return false;
    if (kind == ITEM_CALL)
        return true;
    cJSON *p = item_event(s, true);
    server_json_add(p, "part", text_part(kind == ITEM_REASONING ? "reasoning_text" : "output_text", ""));
    return send_event(s, "response.content_part.added", p, out);
}

static bool send_text(struct responses *s, enum item_kind kind, const char *delta, struct sbuf *out)
{
    if (s->open != kind && !open_item(s, kind, NULL, NULL, out))
        return false;
    sbuf_puts(&s->text, delta);
    cJSON *o = item_event(s, kind != ITEM_CALL);
    cJSON_AddStringToObject(o, "delta", delta);
    if (kind == ITEM_MESSAGE)
        cJSON_AddArrayToObject(o, "logprobs");
    const char *name = kind == ITEM_REASONING ? "response.reasoning_text.delta"
                       : kind == ITEM_MESSAGE ? "response.output_text.delta"
                                              : "response.function_call_arguments.delta";
    return !s->text.oom && send_event(s, name, o, out);
}

static bool send_call(struct responses *s, const cJSON *call, struct sbuf *out)
{
    const cJSON *id = field(call, "id"), *fn = field(call, "function");
    const cJSON *name = field(fn, "name"), *args = field(fn, "arguments");
    if (cJSON_IsString(id) &&
        !open_item(s, ITEM_CALL, id->valuestring, cJSON_IsString(name) ? name->valuestring : "", out))
        return false;
    if (cJSON_IsString(args) && args->valuestring[0] && s->open == ITEM_CALL)
        return send_text(s, ITEM_CALL, args->valuestring, out);
    return true;
}

static bool send_lifecycle(struct responses *s, const char *name, const char *status, bool with_usage, struct sbuf *out)
{
    cJSON *resp = response_object(s, status, cJSON_Duplicate(s->output, 1));
    if (with_usage)
        server_json_add(resp, "usage", usage(s->input_tokens, s->cached_tokens, s->output_tokens));
    cJSON *o = cJSON_CreateObject();
    server_json_add(o, "response", resp);
    return send_event(s, name, o, out);
}

static bool send_start(struct responses *s, const cJSON *chunk, const struct proxy_facts *f, struct sbuf *out)
{
    s->started = true;
    const cJSON *id = field(chunk, "id");
    snprintf(s->serial, sizeof s->serial, "%s", server_proxy_serial(cJSON_IsString(id) ? id->valuestring : "0"));
    s->input_tokens = f->n_prompt;
    return send_lifecycle(s, "response.created", "in_progress", false, out) &&
           send_lifecycle(s, "response.in_progress", "in_progress", false, out);
}

static bool send_error(struct responses *s, const cJSON *err, struct sbuf *out)
{
    s->ended = true;
    const cJSON *m = field(err, "message");
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "code", "server_error");
    cJSON_AddStringToObject(o, "message", cJSON_IsString(m) ? m->valuestring : "generation failed");
    cJSON_AddNullToObject(o, "param");
    return send_event(s, "error", o, out);
}

static bool responses_event(void *ctx, const cJSON *chunk, const struct proxy_facts *f, struct sbuf *out)
{
    struct responses *s = ctx;
    if (s->ended)
        return true;
    if (!chunk) {
        s->ended = true;
        bool cut = !strcmp(s->finish, "length");
        return close_item(s, out) && send_lifecycle(s, cut ? "response.incomplete" : "response.completed",
                                                    cut ? "incomplete" : "completed", true, out);
    }
    if (field(chunk, "error"))
        return send_error(s, field(chunk, "error"), out);
    if (!s->started && !send_start(s, chunk, f, out))
        return false;
    const cJSON *u = field(chunk, "usage");
    if (u) {
        const cJSON *pt = field(u, "prompt_tokens"), *ct = field(u, "completion_tokens");
        const cJSON *cached = field(field(u, "prompt_tokens_details"), "cached_tokens");
        s->input_tokens = cJSON_IsNumber(pt) ? pt->valueint : s->input_tokens;
        s->output_tokens = cJSON_IsNumber(ct) ? ct->valueint : 0;
        s->cached_tokens = cJSON_IsNumber(cached) ? cached->valueint : 0;
    }
    const cJSON *choice = cJSON_GetArrayItem(field(chunk, "choices"), 0);
    const cJSON *delta = field(choice, "delta"), *finish = field(choice, "finish_reason");
    const cJSON *reasoning = field(delta, "reasoning_content"), *text = field(delta, "content");
    bool ok = true;
    if (cJSON_IsString(reasoning) && reasoning->valuestring[0])
        ok = send_text(s, ITEM_REASONING, reasoning->valuestring, out);
    if (ok && cJSON_IsString(text) && text->valuestring[0])
        ok = send_text(s, ITEM_MESSAGE, text->valuestring, out);
    const cJSON *call;
    cJSON_ArrayForEach(call, field(delta, "tool_calls")) if (ok) ok = send_call(s, call, out);
    if (cJSON_IsString(finish))
        snprintf(s->finish, sizeof s->finish, "%s", finish->valuestring);
    return ok;
}

static void responses_free(void *ctx)
{
    struct responses *s = ctx;
    if (!s)
        return;
    cJSON_Delete(s->echo);
    cJSON_Delete(s->output);
    sbuf_free(&s->text);
    free(s);
}

/* The request's settings a response object repeats (absent ones as OpenAI's defaults). */
static cJSON *echo_settings(const cJSON *root)
{
    cJSON *e = cJSON_CreateObject();
    static const char *const keys[] = {"instructions", "max_output_tokens", "temperature", "top_p", "tool_choice",
                                       "tools", "parallel_tool_calls", "text", "reasoning", "metadata", "store", "user"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, keys[i]);
        if (v)
            server_json_add(e, keys[i], cJSON_Duplicate(v, 1));
    }
    if (!cJSON_GetObjectItemCaseSensitive(e, "tools"))
        cJSON_AddArrayToObject(e, "tools");
    if (!cJSON_GetObjectItemCaseSensitive(e, "tool_choice"))
        cJSON_AddStringToObject(e, "tool_choice", "auto");
    if (!cJSON_GetObjectItemCaseSensitive(e, "parallel_tool_calls"))
        cJSON_AddTrueToObject(e, "parallel_tool_calls");
    return e;
}

static ks_status responses_request(const struct server *srv, const cJSON *root, cJSON **chat, void **ctx,
                                   struct reply *r)
{
    struct responses *s = calloc(1, sizeof *s);
    if (!s)
        return oom(r);
    ks_status st = to_chat(root, chat, r);
    if (st) {
        free(s);
        return st;
    }
    snprintf(s->model, sizeof s->model, "%s", srv->model_name);
    snprintf(s->serial, sizeof s->serial, "0");
    s->created = (long)time(NULL);
    s->echo = echo_settings(root);
    s->output = cJSON_CreateArray();
    if (server_json_failed()) {
        cJSON_Delete(*chat);
        responses_free(s);
        return oom(r);
    }
    *ctx = s;
    return KS_OK;
}

const struct proxy_api server_responses_api = {responses_request, responses_whole, responses_event, responses_error,
                                               responses_free};

ks_status server_route_responses(struct server *srv, const struct server_req *rq, struct reply *r)
{
    return server_proxy_route(srv, rq, &server_responses_api, r);
}
