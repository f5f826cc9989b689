/* The grammar of the tool calls a request requires (tool_choice "required" or
 * a named function): exactly the text server_tools.c parses as calls in the
 * template's format, with each function's arguments constrained by its
 * 'parameters' schema:
 *   hermes   <tool_call>\n{"name": N, "arguments": A}\n</tool_call>, "\n" between calls
 *   llama3   {"name": N, "parameters": A}, one call (the templates refuse more)
 *   mistral  [TOOL_CALLS][{"name": N, "arguments": A}, ...]
 *   generic  {"tool_calls": [{"name": N, "arguments": A}, ...]}
 *   harmony  [an analysis message] <|channel|>commentary to=functions.N <|constrain|>json<|message|>A
 *            (one call: the model's <|call|> ends the generation)
 * Markup that is one control token of the vocabulary is the terminal <[id]>
 * (the mask never allows a control token otherwise); other markup is text.
 * A schema outside the grammar's subset leaves its arguments any JSON object. */
#include "server/server_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The text around the calls; markup may be one control token, text is
 * always text. */
struct tool_syntax {
    const char *markup;       /* before the calls */
    const char *open, *close; /* around the list of calls */
    const char *call_markup, *call_end_markup;
    const char *call_open, *call_close; /* around each call's JSON object */
    const char *args_key;
    const char *sep;          /* between calls */
};

static const struct tool_syntax syntaxes[] = {
    [SERVER_TOOLS_HERMES] = {"", "", "", "<tool_call>", "</tool_call>", "\n", "\n", "arguments", "\n"},
    [SERVER_TOOLS_LLAMA3] = {"", "", "", "", "", "", "", "parameters", "; "},
    [SERVER_TOOLS_MISTRAL] = {"[TOOL_CALLS]", "[", "]", "", "", "", "", "arguments", ", "},
    [SERVER_TOOLS_GENERIC] = {"", "{\"tool_calls\": [", "]}", "", "", "", "", "arguments", ", "},
};

/* Text as a GBNF literal (nothing for ""). */
static void put_text(struct sbuf *b, const char *text)
{
    if (!*text)
        return;
    sbuf_puts(b, " \"");
    for (; *text; text++) {
        if (*text == '"' || *text == '\\')
            sbuf_append(b, "\\", 1);
        if (*text == '\n')
            sbuf_puts(b, "\\n");
        else
            sbuf_append(b, text, 1);
    }
    sbuf_puts(b, "\"");
}

/* Markup as GBNF: a control token's terminal, else its text. */
static void put_markup(struct sbuf *b, const struct tokenizer *tok, const char *text)
{
    int32_t id = tok && *text ? tok_find(tok, text, strlen(text)) : -1;
    if (id >= 0 && tok_is_control(tok, id))
        sbuf_printf(b, " <[%d]>", id);
    else
        put_text(b, text);
}

/* The rules of one schema (JSON value) under name; the caller's out. */
static ks_status put_schema(struct sbuf *b, const cJSON *schema, const char *name, bool *fell_back)
{
    char *printed = cJSON_PrintUnformatted(schema), *typed = NULL, *rules = NULL;
    /* {"properties": ...} without a type: arguments are an object all the same */
    bool untyped = !cJSON_HasObjectItem(schema, "type") && cJSON_HasObjectItem(schema, "properties");
    size_t n = printed ? strlen(printed) : 0;
    if (printed && untyped && (typed = malloc(n + 18)))
        snprintf(typed, n + 18, "{\"type\":\"object\",%s", printed + 1);
    ks_status st = !printed || (untyped && !typed) ? KS_ERR_NOMEM
                                                   : grammar_json_schema_rules(typed ? typed : printed,
                                                                               strlen(typed ? typed : printed), name, &rules);
    cJSON_free(printed);
    free(typed);
    if (st == KS_ERR_NOMEM || st == KS_ERR_FORMAT) /* cJSON printed it: only an allocation can fail to parse it */
        return ks_fail(KS_ERR_NOMEM, "out of memory building the tool-call grammar");
    if (st) { /* a keyword outside the subset: any object, as the request is still served */
        sbuf_printf(b, "%s ::= object\n", name);
        *fell_back = true;
        return KS_OK;
    }
    sbuf_puts(b, rules);
    free(rules);
    return KS_OK;
}

/* fn<i> ::= <the name as a JSON string> ", \"<args_key>\": " args<i> */
static ks_status put_function(struct sbuf *b, const cJSON *fn, int i, const char *args_key, bool *fell_back)
{
    const cJSON *params = cJSON_GetObjectItemCaseSensitive(fn, "parameters");
    cJSON *name_schema = cJSON_CreateObject();
    if (!name_schema ||
        !cJSON_AddStringToObject(name_schema, "const", cJSON_GetObjectItemCaseSensitive(fn, "name")->valuestring)) {
        cJSON_Delete(name_schema);
        return ks_fail(KS_ERR_NOMEM, "out of memory building the tool-call grammar");
    }
    char name[32], args[32];
    snprintf(name, sizeof name, "name%d", i);
    snprintf(args, sizeof args, "args%d", i);
    bool ignored = false;
    ks_status st = put_schema(b, name_schema, name, &ignored);
    cJSON_Delete(name_schema);
    if (st)
        return st;
    if (cJSON_IsObject(params) && cJSON_GetArraySize(params) > 0)
        st = put_schema(b, params, args, fell_back);
    else /* none, or {}: any object */
        sbuf_printf(b, "%s ::= object\n", args);
    sbuf_printf(b, "fn%d ::= %s \", \\\"%s\\\": \" %s\n", i, name, args_key, args);
    return st;
}

/* Harmony: the functions o allows, each its name as text and its arguments
 * after the header; free reasoning may come first, as the model thinks
 * before it calls. */
static ks_status harmony_grammar(struct sbuf *b, const struct tokenizer *tok, const cJSON *tools,
                                 const struct server_tool_opts *o, bool *fell_back)
{
    sbuf_puts(b, "root ::= analysis?");
    put_markup(b, tok, "<|channel|>");
    put_text(b, "commentary to=functions.");
    sbuf_puts(b, " fn\nanalysis ::=");
    put_markup(b, tok, "<|channel|>");
    put_text(b, "analysis");
    put_markup(b, tok, "<|message|>");
    sbuf_puts(b, " [^<]*");
    put_markup(b, tok, "<|end|>");
    put_markup(b, tok, "<|start|>");
    put_text(b, "assistant");
    sbuf_puts(b, "\nfn ::=");
    int i = 0, n_fn = 0;
    const cJSON *t;
    cJSON_ArrayForEach(t, tools) {
        const char *name = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(t, "function"), "name")->valuestring;
        if (o->choice != SERVER_TOOL_NAMED || !strcmp(name, o->name))
            sbuf_printf(b, "%s fn%d", n_fn++ ? " |" : "", i);
        i++;
    }
    sbuf_puts(b, "\n");
    ks_status st = KS_OK;
    i = 0;
    cJSON_ArrayForEach(t, tools) {
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(t, "function");
        const cJSON *params = cJSON_GetObjectItemCaseSensitive(fn, "parameters");
        char args[32];
        snprintf(args, sizeof args, "args%d", i);
        if (!st && cJSON_IsObject(params) && cJSON_GetArraySize(params) > 0)
            st = put_schema(b, params, args, fell_back);
        else if (!st)
            sbuf_printf(b, "%s ::= object\n", args);
        sbuf_printf(b, "fn%d ::=", i);
        put_text(b, cJSON_GetObjectItemCaseSensitive(fn, "name")->valuestring);
        put_text(b, " ");
        put_markup(b, tok, "<|constrain|>");
        put_text(b, "json");
        put_markup(b, tok, "<|message|>");
        sbuf_printf(b, " %s\n", args);
        i++;
    }
    return st;
}

/* End the grammar in b with the JSON primitives and hand its text to *gbnf
 * (the caller's now); b is freed on any error. */
static ks_status finish_grammar(struct sbuf *b, ks_status st, char **gbnf)
{
    sbuf_puts(b, grammar_json_primitives_gbnf());
    if (!st && b->oom)
        st = ks_fail(KS_ERR_NOMEM, "out of memory building the tool-call grammar");
    if (st)
        sbuf_free(b);
    else
        *gbnf = b->p;
    return st;
}

ks_status server_tools_grammar(enum server_tool_format f, const struct tokenizer *tok, const cJSON *tools,
                               const struct server_tool_opts *o, char **gbnf, bool *fell_back)
{
    *fell_back = false;
    if (f == SERVER_TOOLS_HARMONY) {
        struct sbuf b = {0};
        return finish_grammar(&b, harmony_grammar(&b, tok, tools, o, fell_back), gbnf);
    }
    if (f <= SERVER_TOOLS_NONE || f > SERVER_TOOLS_GENERIC)
        return ks_fail(KS_ERR_INVALID_ARG, "the chat template has no tool-call format");
    const struct tool_syntax *sx = &syntaxes[f];
    struct sbuf b = {0};
    sbuf_puts(&b, "root ::=");
    put_markup(&b, tok, sx->markup);
    put_text(&b, sx->open);
    /* Llama 3.x templates refuse several calls in the history: one, as they teach */
    bool several = o->parallel && f != SERVER_TOOLS_LLAMA3;
    sbuf_puts(&b, several ? " call more*" : " call");
    put_text(&b, sx->close);
    sbuf_puts(&b, "\nmore ::=");
    put_markup(&b, tok, sx->sep);
    sbuf_puts(&b, " call\ncall ::=");
    put_markup(&b, tok, sx->call_markup);
    put_text(&b, sx->call_open);
    sbuf_puts(&b, " \"{\\\"name\\\": \" fn \"}\"");
    put_text(&b, sx->call_close);
    put_markup(&b, tok, sx->call_end_markup);
    sbuf_puts(&b, "\n");
    ks_status st = KS_OK;
    int i = 0, n_fn = 0;
    const cJSON *t;
    sbuf_puts(&b, "fn ::=");
    cJSON_ArrayForEach(t, tools) {
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(t, "function");
        const char *name = cJSON_GetObjectItemCaseSensitive(fn, "name")->valuestring;
        if (o->choice != SERVER_TOOL_NAMED || !strcmp(name, o->name))
            sbuf_printf(&b, "%s fn%d", n_fn++ ? " |" : "", i);
        i++;
    }
    sbuf_puts(&b, "\n");
    i = 0;
    cJSON_ArrayForEach(t, tools) {
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(t, "function");
        if (!st)
            st = put_function(&b, fn, i, sx->args_key, fell_back);
        i++;
    }
    return finish_grammar(&b, st, gbnf);
}

void server_tools_triggers(enum server_tool_format f, const struct tokenizer *tok, struct grammar_triggers *t)
{
    static const struct {
        const char *word;
        bool at_start;
    } starts[] = {
        [SERVER_TOOLS_HERMES] = {"<tool_call>", false},
        [SERVER_TOOLS_LLAMA3] = {"{\"name\"", true},
        [SERVER_TOOLS_MISTRAL] = {"[TOOL_CALLS]", false},
        [SERVER_TOOLS_GENERIC] = {"{\"tool_calls\"", true},
    };
    memset(t, 0, sizeof *t);
    if (f <= SERVER_TOOLS_NONE || f > SERVER_TOOLS_GENERIC)
        return;
    const char *w = starts[f].word;
    int32_t id = tok ? tok_find(tok, w, strlen(w)) : -1;
    t->n = 1;
    t->t[0].token = id >= 0 && tok_is_control(tok, id) ? id : -1;
    t->t[0].at_start = starts[f].at_start;
    if (t->t[0].token < 0)
        snprintf(t->t[0].word, sizeof t->t[0].word, "%s", w);
}
