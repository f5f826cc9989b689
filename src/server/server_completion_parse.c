/* The completion routes' request: the JSON body -> a call's options (stream,
 * stop strings, logprobs, n, tools, the grammar) and the scheduler request
 * (prompt tokens, sampling, max_tokens). Every bad field is a 400 naming it. */
#include "server/server_completion_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- request parsing ------------------------------------------------------------ */

/* A field that is absent or null reads as "not given". */
static cJSON *field(const cJSON *root, const char *key)
{
    cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
    return cJSON_IsNull(v) ? NULL : v;
}

static ks_status get_number(const cJSON *root, const char *key, double lo, double hi, double *out, struct reply *r)
{
    cJSON *v = field(root, key);
    if (!v)
        return KS_OK;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'%s' must be a number", key);
    if (v->valuedouble < lo || v->valuedouble > hi)
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'%s' must be in [%g, %g] (got %g)", key, lo, hi,
                          v->valuedouble);
    *out = v->valuedouble;
    return KS_OK;
}

static ks_status get_int(const cJSON *root, const char *key, double lo, double hi, int64_t *out, struct reply *r)
{
    cJSON *v = field(root, key);
    if (!v)
        return KS_OK;
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'%s' must be an integer", key);
    if (v->valuedouble < lo || v->valuedouble > hi)
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'%s' must be in [%.0f, %.0f] (got %.0f)", key, lo,
                          hi, v->valuedouble);
    *out = (int64_t)v->valuedouble;
    return KS_OK;
}

static ks_status get_bool(const cJSON *root, const char *key, bool *out, struct reply *r)
{
    cJSON *v = field(root, key);
    if (!v)
        return KS_OK;
    if (!cJSON_IsBool(v))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'%s' must be true or false", key);
    *out = cJSON_IsTrue(v);
    return KS_OK;
}

static ks_status add_stop(struct call *c, const cJSON *s, struct reply *r)
{
    if (!cJSON_IsString(s))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'stop' must be a string or a list of strings");
    size_t n = strlen(s->valuestring);
    if (n == 0)
        return KS_OK;
    if (n > MAX_STOP_LEN || c->n_stop == MAX_STOP)
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'stop' takes at most %d strings of at most %d bytes",
                          MAX_STOP, MAX_STOP_LEN);
    c->stop[c->n_stop] = strdup(s->valuestring);
    if (!c->stop[c->n_stop])
        return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while reading 'stop'");
    c->n_stop++;
    if (n > c->max_stop)
        c->max_stop = n;
    return KS_OK;
}

static ks_status parse_stop(struct call *c, const cJSON *root, struct reply *r)
{
    cJSON *v = field(root, "stop");
    if (!v)
        return KS_OK;
    if (!cJSON_IsArray(v))
        return add_stop(c, v, r);
    const cJSON *s;
    ks_status st = KS_OK;
    cJSON_ArrayForEach(s, v) if ((st = add_stop(c, s, r))) return st;
    return KS_OK;
}

static ks_status parse_sampling(const cJSON *root, bool chat, struct sample_params *p, int *logprobs, int *n_choices,
                                struct reply *r)
{
    static uint64_t seed_counter;
    double temp = 1.0, top_p = 1.0, min_p = 0.0, pres = 0.0, freq = 0.0, rep = 1.0;
    int64_t top_k = 0, seed = -1, n = 1;
    ks_status st;
    if ((st = get_number(root, "temperature", 0, 2, &temp, r)) || (st = get_number(root, "top_p", 0, 1, &top_p, r)) ||
        (st = get_number(root, "min_p", 0, 1, &min_p, r)) ||
        (st = get_number(root, "presence_penalty", -2, 2, &pres, r)) ||
        (st = get_number(root, "frequency_penalty", -2, 2, &freq, r)) ||
        (st = get_number(root, "repeat_penalty", 0, 10, &rep, r)) || (st = get_int(root, "top_k", 0, 1e9, &top_k, r)) ||
        (st = get_int(root, "seed", -9.2e18, 9.2e18, &seed, r)) || (st = get_int(root, "n", 1, MAX_CHOICES, &n, r)))
        return st;
    *n_choices = (int)n;
    *logprobs = -1;
    if (chat) {
        bool lp = false;
        int64_t top = 0;
        if ((st = get_bool(root, "logprobs", &lp, r)) ||
            (st = get_int(root, "top_logprobs", 0, SAMPLE_MAX_LOGPROBS, &top, r)))
            return st;
        if (field(root, "top_logprobs") && !lp)
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'top_logprobs' needs 'logprobs': true");
        if (lp)
            *logprobs = (int)top;
    } else {
        int64_t top = -1;
        if ((st = get_int(root, "logprobs", 0, SAMPLE_MAX_LOGPROBS, &top, r)))
            return st;
        *logprobs = (int)top;
    }
    if ((float)top_p <= 0) /* also a positive value below the smallest float, which would sample with 0 */
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'top_p' must be greater than 0 (got %g)", top_p);
    memset(p, 0, sizeof *p);
    p->temp = (float)temp;
    p->top_k = (int)top_k;
    p->top_p = (float)top_p;
    p->min_p = (float)min_p;
    p->repeat_penalty = (float)rep;
    p->repeat_last_n = 64;
    p->presence_penalty = (float)pres;
    p->frequency_penalty = (float)freq;
    p->seed = seed >= 0 ? (uint64_t)seed
                        : (uint64_t)time(NULL) * 0x9E3779B97F4A7C15ull + __atomic_add_fetch(&seed_counter, 1, __ATOMIC_RELAXED);
    p->n_logprobs = *logprobs > 0 ? *logprobs : 0;
    return KS_OK;
}

/* A tokenizer failure: out of memory stays so, anything else is ours (500). */
static ks_status tokenizer_failed(ks_status st, struct reply *r)
{
    return reply_fail(r, st == KS_ERR_NOMEM ? st : KS_ERR_INTERNAL, NULL, "tokenizer: %s", ks_errmsg());
}

/* The prompt as token ids (*ids_out, malloc'd). */
static ks_status prompt_tokens(struct server *srv, bool chat, const cJSON *root, int32_t **ids_out, int32_t *n_out,
                               struct reply *r)
{
    int32_t *ids = NULL;
    size_t n = 0;
    ks_status st;
    if (chat) {
        char *text;
        if ((st = server_chat_prompt(srv, root, &text, r)))
            return st;
        /* The whole prompt is parsed for special tokens, the messages' text
         * included, as llama-server does (see README: chat templates). */
        st = tok_encode(srv->tok, text, strlen(text), TOK_ADD_SPECIAL | TOK_PARSE_SPECIAL, &ids, &n);
        free(text);
        if (st)
            return tokenizer_failed(st, r);
    } else {
        cJSON *p = field(root, "prompt");
        if (cJSON_IsArray(p) && cJSON_GetArraySize(p) == 1 && cJSON_IsString(cJSON_GetArrayItem(p, 0)))
            p = cJSON_GetArrayItem(p, 0);
        if (cJSON_IsString(p)) {
            if ((st = tok_encode(srv->tok, p->valuestring, strlen(p->valuestring), TOK_ADD_SPECIAL, &ids, &n)))
                return tokenizer_failed(st, r);
        } else if (cJSON_IsArray(p) && cJSON_GetArraySize(p) > 0) {
            n = (size_t)cJSON_GetArraySize(p);
            ids = malloc(n * sizeof *ids);
            if (!ids)
                return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while reading 'prompt'");
            size_t i = 0;
            const cJSON *t;
            int32_t n_vocab = tok_n_vocab(srv->tok);
            cJSON_ArrayForEach(t, p) {
                if (!cJSON_IsNumber(t) || t->valuedouble != floor(t->valuedouble) || t->valuedouble < 0 ||
                    t->valuedouble >= n_vocab) {
                    free(ids);
                    return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                                      "'prompt' token ids must be integers in [0, %d) (index %zu)", n_vocab, i);
                }
                ids[i++] = (int32_t)t->valuedouble;
            }
        } else {
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type",
                              "'prompt' must be a string or a non-empty array of token ids");
        }
    }
    if (n == 0) {
        free(ids);
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "the prompt is empty");
    }
    if (n >= (size_t)srv->cfg.ctx_size) {
        free(ids);
        return reply_fail(r, KS_ERR_INVALID_ARG, "context_length_exceeded",
                          "the prompt has %zu tokens but the context holds %d (--ctx-size); shorten it", n,
                          srv->cfg.ctx_size);
    }
    *ids_out = ids;
    *n_out = (int32_t)n;
    return KS_OK;
}

/* response_format ({"type":"text"|"json_object"|"json_schema", "json_schema":
 * {"name","schema","strict"}}), llama.cpp's "grammar" (GBNF text) or the tool
 * calls tool_choice requires -> the compiled grammar the sampler masks with,
 * for at most max_tokens tokens. A bad schema or grammar is a 400 that names
 * the keyword or line and column. */
static ks_status parse_grammar(struct call *c, const cJSON *root, int32_t max_tokens, struct sample_params *p,
                               struct reply *r)
{
    cJSON *rf = field(root, "response_format"), *gr = field(root, "grammar");
    const char *type = "text";
    if (rf) {
        cJSON *t = cJSON_GetObjectItemCaseSensitive(rf, "type");
        if (!cJSON_IsObject(rf) || !cJSON_IsString(t))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type",
                              "'response_format' must be an object with a string 'type'");
        type = t->valuestring;
        if (strcmp(type, "text") && strcmp(type, "json_object") && strcmp(type, "json_schema"))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                              "'response_format.type' must be text, json_object or json_schema (got '%.64s')", type);
    }
    if (gr && !cJSON_IsString(gr))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'grammar' must be a string of GBNF");
    if (gr && strcmp(type, "text"))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "give 'grammar' or a JSON 'response_format', not both");
    bool tool_calls = c->tool_fmt != SERVER_TOOLS_NONE && c->tools.n_tools > 0 &&
                      (c->tools.choice == SERVER_TOOL_REQUIRED || c->tools.choice == SERVER_TOOL_NAMED);
    if (tool_calls && (gr || strcmp(type, "text")))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                          "'tool_choice' %s constrains the output to tool calls; it cannot be combined with %s",
                          c->tools.choice == SERVER_TOOL_NAMED ? "naming a function" : "\"required\"",
                          gr ? "'grammar'" : "a JSON 'response_format'");
    /* auto: free text, but a call the model starts is constrained from its trigger on */
    /* (harmony's calls follow free reasoning: they are parsed, not constrained, under auto) */
    bool lazy = c->tool_fmt != SERVER_TOOLS_NONE && c->tool_fmt != SERVER_TOOLS_HARMONY &&
                c->tools.choice == SERVER_TOOL_AUTO && !gr && !strcmp(type, "text") && c->srv->grammar_vocab;
    tool_calls = tool_calls || lazy;
    if (!gr && !strcmp(type, "text") && !tool_calls)
        return KS_OK;
    if (!c->srv->grammar_vocab)
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                          "constrained output needs the model's tokenizer, and this model has none");
    char *gbnf = NULL;
    const char *src = gr ? gr->valuestring : grammar_json_object_gbnf(), *what = gr ? "'grammar'" : "'response_format'";
    ks_status st = KS_OK;
    if (tool_calls) {
        bool fell_back;
        st = server_tools_grammar(c->tool_fmt, c->srv->tok, field(root, "tools"), &c->tools, &gbnf, &fell_back);
        src = gbnf;
        what = "the tool-call grammar";
    } else if (!strcmp(type, "json_schema")) {
        cJSON *js = cJSON_GetObjectItemCaseSensitive(rf, "json_schema");
        cJSON *schema = cJSON_GetObjectItemCaseSensitive(js, "schema");
        cJSON *strict = cJSON_GetObjectItemCaseSensitive(js, "strict"), *name = cJSON_GetObjectItemCaseSensitive(js, "name");
        if (!cJSON_IsObject(js) || !cJSON_IsObject(schema))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type",
                              "'response_format.json_schema' must be an object with an object 'schema'");
        if ((strict && !cJSON_IsBool(strict) && !cJSON_IsNull(strict)) || (name && !cJSON_IsString(name)))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type",
                              "'response_format.json_schema': 'strict' must be a boolean and 'name' a string");
        char *text = cJSON_PrintUnformatted(schema);
        if (!text)
            return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while reading 'response_format'");
        st = grammar_from_json_schema(text, strlen(text), &gbnf);
        cJSON_free(text);
        if (st == KS_ERR_FORMAT) /* cJSON printed it, so only an allocation can have failed to parse it */
            st = KS_ERR_NOMEM;
        src = gbnf;
        what = "'response_format.json_schema.schema'";
    }
    if (!st)
        st = grammar_compile(src, strlen(src), &c->grammar);
    free(gbnf);
    if (!st && !lazy && max_tokens > 0 && grammar_min_bytes(c->grammar) > max_tokens)
        st = ks_fail(KS_ERR_RANGE, "max_tokens %d is below the %d tokens the shortest valid output may need (one per "
                                   "byte); raise it", (int)max_tokens, (int)grammar_min_bytes(c->grammar));
    if (st) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", ks_errmsg());
        if (st == KS_ERR_NOMEM)
            return reply_fail(r, st, NULL, "out of memory while compiling %s", what);
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "%s: %s", what, msg);
    }
    p->grammar = c->grammar;
    p->grammar_vocab = c->srv->grammar_vocab;
    p->grammar_max_tokens = max_tokens;
    if (lazy)
        server_tools_triggers(c->tool_fmt, c->srv->tok, &p->grammar_triggers);
    return KS_OK;
}

/* "speculative": {"n_max": N, "n_min": N} (llama-server's field): this
 * request's draft bounds when the server speculates (--spec-type); a field
 * left out keeps the server's (--draft-max, --draft-min), and the scheduler
 * refuses an n_min above the resulting n_max. */
static ks_status parse_speculative(const cJSON *root, struct sched_request *rq, struct reply *r)
{
    cJSON *sp = field(root, "speculative");
    if (!sp)
        return KS_OK;
    if (!cJSON_IsObject(sp))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'speculative' must be an object");
    static const char *keys[2] = {"n_max", "n_min"};
    double v[2] = {-1, -1};
    for (int i = 0; i < 2; i++) {
        cJSON *x = field(sp, keys[i]);
        if (x && (!cJSON_IsNumber(x) || x->valuedouble != floor(x->valuedouble)))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'speculative.%s' must be an integer", keys[i]);
        if (x && (x->valuedouble < 0 || x->valuedouble > SPEC_DRAFT_LIMIT))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'speculative.%s' must be in [0, %d] (got %.0f)",
                              keys[i], SPEC_DRAFT_LIMIT, x->valuedouble);
        if (x)
            v[i] = x->valuedouble;
    }
    if (v[0] >= 0 && v[1] > v[0])
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                          "'speculative.n_min' (%.0f) must not be above 'speculative.n_max' (%.0f)", v[1], v[0]);
    rq->speculative.set = true;
    rq->speculative.n_max = (int32_t)v[0];
    rq->speculative.n_min = (int32_t)v[1];
    return KS_OK;
}

static ks_status parse_options(struct call *c, const cJSON *root, int32_t n_prompt, struct sched_request *rq,
                               struct reply *r)
{
    ks_status st;
    if ((st = get_bool(root, "stream", &c->stream, r)) || (st = get_bool(root, "ignore_eos", &rq->ignore_eog, r)) ||
        (st = parse_stop(c, root, r)) || (st = parse_speculative(root, rq, r)) ||
        (st = parse_sampling(root, c->chat, &rq->sampling, &c->logprobs, &c->n_choices, r)))
        return st;
    cJSON *so = field(root, "stream_options");
    if (so && !cJSON_IsObject(so))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'stream_options' must be an object");
    if (so && (st = get_bool(so, "include_usage", &c->include_usage, r)))
        return st;
    int64_t max_tokens = c->srv->cfg.ctx_size - n_prompt;
    const char *mt_key = field(root, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
    cJSON *mt = field(root, mt_key);
    if (mt && (!cJSON_IsNumber(mt) || mt->valuedouble != floor(mt->valuedouble)))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'%s' must be an integer", mt_key);
    if (mt && mt->valuedouble < 0) /* 0 only prefills and caches the prompt (a warm-up) */
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'%s' must not be negative (got %.0f)", mt_key,
                          mt->valuedouble);
    if (mt && mt->valuedouble < (double)max_tokens)
        max_tokens = (int64_t)mt->valuedouble;
    rq->max_tokens = (int32_t)max_tokens;
    return parse_grammar(c, root, rq->max_tokens, &rq->sampling, r);
}

ks_status server_completion_parse(struct server *srv, bool chat, const char *body, size_t len, struct call **out,
                                  struct sched_request *rq, struct reply *r)
{
    cJSON *root;
    ks_status st = server_parse_object(body, len, false, &root, r);
    if (st)
        return st;
    cJSON *model = field(root, "model");
    if (model && !cJSON_IsString(model)) {
        cJSON_Delete(root);
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'model' must be a string");
    }
    if (!chat && field(root, "messages")) {
        cJSON_Delete(root);
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                          "/v1/completions takes 'prompt', not 'messages' (use /v1/chat/completions)");
    }
    struct call *c = server_call_new(srv, chat);
    if (!c) {
        cJSON_Delete(root);
        return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while starting the request");
    }
    int32_t n_prompt = 0;
    int32_t *ids = NULL;
    st = chat ? server_parse_tool_options(root, &c->tools, r) : KS_OK;
    if (!st)
        st = prompt_tokens(srv, chat, root, &ids, &n_prompt, r);
    /* tool_choice none: the template still sees the tools (as in llama.cpp),
     * the output is not parsed for calls */
    if (chat && !srv->chat.by_family && c->tools.n_tools > 0 && c->tools.choice != SERVER_TOOL_NONE)
        c->tool_fmt = srv->tool_format;
    /* harmony's channels are always parsed: its reasoning is never content */
    if (chat && !srv->chat.by_family && srv->tool_format == SERVER_TOOLS_HARMONY) {
        c->harmony_calls = c->tool_fmt == SERVER_TOOLS_HARMONY;
        c->tool_fmt = SERVER_TOOLS_HARMONY;
    }
    *rq = (struct sched_request){.prompt = ids, .n_prompt = n_prompt, .on_event = server_call_on_event, .user = c};
    if (!st)
        st = parse_options(c, root, n_prompt, rq, r);
    cJSON_Delete(root);
    if (st) {
        free(ids);
        *rq = (struct sched_request){0};
        server_call_unref(c);
        return st;
    }
    c->n_prompt = n_prompt;
    *out = c;
    return KS_OK;
}
