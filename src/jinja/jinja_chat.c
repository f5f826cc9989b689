/* jinja: rendering an OpenAI chat request through a model's template the way
 * llama-server --jinja does, with its polyfills (see jinja.h). */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "jinja/jinja_internal.h"

/* o[key] = v (replaced or added); false, with v deleted, when out of memory. */
static bool obj_put(cJSON *o, const char *key, cJSON *v)
{
    bool ok = v && (cJSON_GetObjectItemCaseSensitive(o, key) ? cJSON_ReplaceItemInObjectCaseSensitive(o, key, v)
                                                             : cJSON_AddItemToObject(o, key, v));
    if (!ok)
        cJSON_Delete(v);
    return ok;
}

/* Tool-call arguments arrive as a JSON string; templates expect the object. */
static ks_status parse_tool_arguments(cJSON *messages)
{
    int mi = 0;
    for (cJSON *m = messages->child; m; m = m->next, mi++) {
        cJSON *calls = cJSON_GetObjectItemCaseSensitive(m, "tool_calls");
        for (cJSON *tc = calls ? calls->child : NULL; tc; tc = tc->next) {
            cJSON *fn = cJSON_GetObjectItemCaseSensitive(tc, "function");
            cJSON *args = fn ? cJSON_GetObjectItemCaseSensitive(fn, "arguments") : NULL;
            if (!cJSON_IsString(args))
                continue;
            cJSON *parsed = cJSON_Parse(args->valuestring);
            if (!parsed)
                return ks_fail(KS_ERR_INVALID_ARG, "message %d: tool call arguments are not JSON: %.80s", mi,
                               args->valuestring);
            if (!obj_put(fn, "arguments", parsed))
                return ks_fail(KS_ERR_NOMEM, "out of memory parsing tool call arguments");
        }
    }
    return KS_OK;
}

static bool has_role(const cJSON *messages, const char *role)
{
    for (const cJSON *m = messages->child; m; m = m->next) {
        const cJSON *r = cJSON_GetObjectItemCaseSensitive(m, "role");
        if (cJSON_IsString(r) && !strcmp(r->valuestring, role))
            return true;
    }
    return false;
}

/* The system message joins the first user turn: "SYSTEM\nUSER". */
static ks_status fold_system(cJSON *messages)
{
    cJSON *sys = NULL;
    for (cJSON *m = messages->child; m && !sys; m = m->next) {
        const cJSON *r = cJSON_GetObjectItemCaseSensitive(m, "role");
        if (cJSON_IsString(r) && !strcmp(r->valuestring, "system"))
            sys = m;
    }
    if (!sys)
        return KS_OK;
    const cJSON *sc = cJSON_GetObjectItemCaseSensitive(sys, "content");
    const char *system = cJSON_IsString(sc) ? sc->valuestring : "";
    for (cJSON *m = sys->next; m; m = m->next) {
        const cJSON *r = cJSON_GetObjectItemCaseSensitive(m, "role");
        cJSON *c = cJSON_GetObjectItemCaseSensitive(m, "content");
        if (!cJSON_IsString(r) || strcmp(r->valuestring, "user") || !cJSON_IsString(c))
            continue;
        size_t n = strlen(system) + 1 + strlen(c->valuestring) + 1;
        char *joined = malloc(n);
        if (!joined)
            return ks_fail(KS_ERR_NOMEM, "out of memory folding the system message");
        strcpy(joined, system);
        strcat(joined, "\n");
        strcat(joined, c->valuestring);
        cJSON *s = cJSON_CreateString(joined);
        free(joined);
        if (!s)
            return ks_fail(KS_ERR_NOMEM, "out of memory folding the system message");
        if (!obj_put(m, "content", s))
            return ks_fail(KS_ERR_NOMEM, "out of memory folding the system message");
        break;
    }
    cJSON_Delete(cJSON_DetachItemViaPointer(messages, sys));
    return KS_OK;
}

/* The name of the tool call a tool message answers: by tool_call_id, else
 * the call in the same position. */
static const char *answered_call_name(const cJSON *calls, const cJSON *tool_msg, int index)
{
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(tool_msg, "tool_call_id");
    int i = 0;
    const cJSON *by_pos = NULL;
    for (const cJSON *tc = calls ? calls->child : NULL; tc; tc = tc->next, i++) {
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(tc, "function");
        const cJSON *name = fn ? cJSON_GetObjectItemCaseSensitive(fn, "name") : NULL;
        const cJSON *tid = cJSON_GetObjectItemCaseSensitive(tc, "id");
        if (cJSON_IsString(id) && cJSON_IsString(tid) && !strcmp(id->valuestring, tid->valuestring))
            return cJSON_IsString(name) ? name->valuestring : NULL;
        if (i == index)
            by_pos = name;
    }
    return cJSON_IsString(by_pos) ? by_pos->valuestring : NULL;
}

/* Templates that read message['tool_responses'] (Gemma 4) take tool results
 * inside the assistant message that made the calls, as {name, response}
 * with the response parsed when it is JSON; the tool messages go. */
static ks_status attach_tool_responses(cJSON *messages)
{
    for (cJSON *m = messages->child; m; m = m->next) {
        cJSON *calls = cJSON_GetObjectItemCaseSensitive(m, "tool_calls");
        if (!cJSON_IsArray(calls))
            continue;
        cJSON *responses = NULL;
        int index = 0;
        while (m->next) {
            cJSON *t = m->next;
            const cJSON *role = cJSON_GetObjectItemCaseSensitive(t, "role");
            if (!cJSON_IsString(role) || strcmp(role->valuestring, "tool"))
                break;
            if (!responses && !(responses = cJSON_AddArrayToObject(m, "tool_responses")))
                return ks_fail(KS_ERR_NOMEM, "out of memory attaching tool responses");
            const cJSON *content = cJSON_GetObjectItemCaseSensitive(t, "content");
            cJSON *r = cJSON_CreateObject();
            const char *name = answered_call_name(calls, t, index++);
            cJSON *parsed = cJSON_IsString(content) ? cJSON_Parse(content->valuestring) : NULL;
            if (!parsed)
                parsed = content ? cJSON_Duplicate(content, 1) : cJSON_CreateNull();
            if (!r || !parsed) {
                cJSON_Delete(r);
                cJSON_Delete(parsed);
                return ks_fail(KS_ERR_NOMEM, "out of memory attaching tool responses");
            }
            if (name)
                cJSON_AddStringToObject(r, "name", name);
            if (!obj_put(r, "response", parsed) || !cJSON_AddItemToArray(responses, r)) {
                cJSON_Delete(r);
                return ks_fail(KS_ERR_NOMEM, "out of memory attaching tool responses");
            }
            cJSON_Delete(cJSON_DetachItemViaPointer(messages, t));
        }
    }
    return KS_OK;
}

/* The text of the last message, which the prompt's tail follows; NULL when
 * it is not a string. */
static const char *last_content(const cJSON *messages)
{
    const cJSON *last = NULL;
    for (const cJSON *m = messages->child; m; m = m->next)
        last = m;
    const cJSON *c = last ? cJSON_GetObjectItemCaseSensitive(last, "content") : NULL;
    return cJSON_IsString(c) && c->valuestring[0] ? c->valuestring : NULL;
}

/* The part of a prompt after the last occurrence of text (all of it when text
 * is NULL or absent). */
static const char *tail_after(const char *prompt, const char *text)
{
    const char *tail = prompt;
    if (!text)
        return tail;
    size_t n = strlen(text);
    for (const char *p = prompt; (p = strstr(p, text)); p++)
        tail = p + n;
    return tail;
}

/* llama.cpp passes enable_thinking true only to templates it sees thinking
 * support in: where the flag changes what follows the conversation (the
 * generation prompt). A template where it only changes an earlier part
 * (Apertus' "Deliberation: enabled" system line) is rendered with false.
 * *prompt holds the enable_thinking=true rendering; it may be replaced. */
static ks_status apply_thinking_support(const struct jinja_template *t, cJSON *ctx, const struct jinja_opts *opts,
                                        char **prompt, size_t *len)
{
    if (!memmem(t->src, t->len, "enable_thinking", 15))
        return KS_OK;
    if (!obj_put(ctx, "enable_thinking", cJSON_CreateFalse()))
        return ks_fail(KS_ERR_NOMEM, "out of memory probing enable_thinking");
    char *off = NULL;
    size_t off_len = 0;
    if (jinja_render(t, ctx, opts, &off, &off_len)) {
        obj_put(ctx, "enable_thinking", cJSON_CreateTrue());
        return KS_OK; /* the template insists on thinking: keep the true rendering */
    }
    const char *last = last_content(cJSON_GetObjectItemCaseSensitive(ctx, "messages"));
    bool changes_tail = strcmp(tail_after(*prompt, last), tail_after(off, last)) != 0;
    bool changes_anything = off_len != *len || memcmp(off, *prompt, *len);
    if (changes_anything && !changes_tail) {
        free(*prompt);
        *prompt = off;
        *len = off_len;
    } else {
        free(off);
    }
    return KS_OK;
}

static ks_status build_context(const struct jinja_template *t, const cJSON *request, const struct jinja_chat *chat,
                               const struct jinja_opts *opts, cJSON **out)
{
    const cJSON *messages = cJSON_GetObjectItemCaseSensitive(request, "messages");
    if (!cJSON_IsArray(messages))
        return ks_fail(KS_ERR_INVALID_ARG, "the chat request has no \"messages\" array");
    cJSON *ctx = cJSON_CreateObject();
    cJSON *msgs = cJSON_Duplicate(messages, 1);
    if (!ctx || !msgs || !cJSON_AddItemToObject(ctx, "messages", msgs)) {
        cJSON_Delete(ctx);
        cJSON_Delete(msgs);
        return ks_fail(KS_ERR_NOMEM, "out of memory building the template context");
    }
    ks_status st = parse_tool_arguments(msgs);
    if (!st && (memmem(t->src, t->len, "['tool_responses']", 18) || memmem(t->src, t->len, ".tool_responses", 15)))
        st = attach_tool_responses(msgs);
    if (st) {
        cJSON_Delete(ctx);
        return st;
    }
    const cJSON *tools = cJSON_GetObjectItemCaseSensitive(request, "tools");
    if (tools && !cJSON_IsNull(tools) && !obj_put(ctx, "tools", cJSON_Duplicate(tools, 1))) {
        cJSON_Delete(ctx);
        return ks_fail(KS_ERR_NOMEM, "out of memory building the template context");
    }
    char date[32], datetime[32];
    time_t now = opts ? (time_t)opts->now : 0;
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(date, sizeof date, "%d %b %Y", &tm);
    strftime(datetime, sizeof datetime, "%b %d %Y", &tm);
    if (chat && chat->add_generation_prompt) /* like llama.cpp: undefined, not false, when off */
        cJSON_AddBoolToObject(ctx, "add_generation_prompt", 1);
    cJSON_AddStringToObject(ctx, "bos_token", chat && chat->bos_token ? chat->bos_token : "");
    cJSON_AddStringToObject(ctx, "eos_token", chat && chat->eos_token ? chat->eos_token : "");
    cJSON_AddBoolToObject(ctx, "enable_thinking", 1);
    cJSON_AddStringToObject(ctx, "date_string", date); /* Llama 3.1's "Today Date" */
    cJSON_AddStringToObject(ctx, "datetime", datetime); /* FireFunction v2's "Today is" */
    const cJSON *kw = chat ? chat->kwargs : NULL;
    if (kw && !cJSON_IsObject(kw)) {
        cJSON_Delete(ctx);
        return ks_fail(KS_ERR_INVALID_ARG, "chat_template_kwargs must be an object");
    }
    for (const cJSON *e = kw ? kw->child : NULL; e; e = e->next) {
        if (!obj_put(ctx, e->string, cJSON_Duplicate(e, 1))) {
            cJSON_Delete(ctx);
            return ks_fail(KS_ERR_NOMEM, "out of memory building the template context");
        }
    }
    *out = ctx;
    return KS_OK;
}

static void strip_bos(const struct jinja_chat *chat, char *text, size_t *len)
{
    size_t n = chat && chat->bos_token ? strlen(chat->bos_token) : 0;
    if (n && *len >= n && !memcmp(text, chat->bos_token, n)) {
        memmove(text, text + n, *len - n + 1);
        *len -= n;
    }
}

ks_status jinja_chat_render(const struct jinja_template *t, const cJSON *request, const struct jinja_chat *chat,
                            const struct jinja_opts *opts, char **out, size_t *out_len)
{
    if (!t || !request || !out)
        return ks_fail(KS_ERR_INVALID_ARG, "jinja_chat_render: NULL argument");
    cJSON *ctx = NULL;
    ks_status st = build_context(t, request, chat, opts, &ctx);
    if (st)
        return st;
    char *text = NULL;
    size_t len = 0;
    st = jinja_render(t, ctx, opts, &text, &len);
    cJSON *msgs = cJSON_GetObjectItemCaseSensitive(ctx, "messages");
    if (st == KS_ERR_STATE && has_role(msgs, "system")) {
        st = fold_system(msgs);
        if (!st)
            st = jinja_render(t, ctx, opts, &text, &len);
    }
    if (!st && !(chat && chat->kwargs && cJSON_GetObjectItemCaseSensitive(chat->kwargs, "enable_thinking")))
        st = apply_thinking_support(t, ctx, opts, &text, &len);
    cJSON_Delete(ctx);
    if (st)
        return st;
    strip_bos(chat, text, &len);
    *out = text;
    if (out_len)
        *out_len = len;
    return KS_OK;
}

/* llama.cpp's CHATML_TEMPLATE_SRC: the content alone, null as "" (llama.cpp's
 * messages carry "" there); an assistant's tool_calls are not printed, as
 * llama-server renders them (server_llama_parity). */
const char jinja_chatml_template[] =
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}";
