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

/* The sampling of a request that names no field: the API's own defaults
 * (OpenAI's: temperature 1, no top-k/top-p/min-p; llama-server's: 0.8, 40,
 * 0.95, 0.05) under the server's --temp, --top-k, ... flags. */
static struct server_sampling sampling_base(const struct server *srv, bool native)
{
    struct server_sampling b = native ? (struct server_sampling){0.8, 0.95, 0.05, 1.0, 40, -1}
                                      : (struct server_sampling){1.0, 1.0, 0.0, 1.0, 0, -1};
    const struct server_sampling *f = &srv->cfg.sampling;
    unsigned set = srv->cfg.sampling_set;
    if (set & SERVER_SAMPLING_TEMP)
        b.temp = f->temp;
    if (set & SERVER_SAMPLING_TOP_K)
        b.top_k = f->top_k;
    if (set & SERVER_SAMPLING_TOP_P)
        b.top_p = f->top_p;
    if (set & SERVER_SAMPLING_MIN_P)
        b.min_p = f->min_p;
    if (set & SERVER_SAMPLING_REPEAT_PENALTY)
        b.repeat_penalty = f->repeat_penalty;
    if (set & SERVER_SAMPLING_SEED)
        b.seed = f->seed;
    return b;
}

static void fill_sampling(const struct server_sampling *b, double pres, double freq, struct sample_params *p)
{
    static uint64_t seed_counter;
    memset(p, 0, sizeof *p);
    p->temp = (float)b->temp;
    p->top_k = (int)b->top_k;
    p->top_p = (float)b->top_p;
    p->min_p = (float)b->min_p;
    p->repeat_penalty = (float)b->repeat_penalty;
    p->repeat_last_n = 64;
    p->presence_penalty = (float)pres;
    p->frequency_penalty = (float)freq;
    p->seed = b->seed >= 0 ? (uint64_t)b->seed
                           : (uint64_t)time(NULL) * 0x9E3779B97F4A7C15ull +
                                 __atomic_add_fetch(&seed_counter, 1, __ATOMIC_RELAXED);
}

void server_native_sampling(const struct server *srv, struct sample_params *p)
{
    struct server_sampling b = sampling_base(srv, true);
    fill_sampling(&b, 0, 0, p);
}

static ks_status parse_sampling(const struct server *srv, const cJSON *root, enum server_api api,
                                struct sample_params *p, int *logprobs, int *n_choices, struct reply *r)
{
    struct server_sampling b = sampling_base(srv, api == SERVER_API_NATIVE);
    double pres = 0.0, freq = 0.0;
    int64_t n = 1;
    bool post_probs = false;
    ks_status st;
    if ((st = get_number(root, "temperature", 0, 2, &b.temp, r)) || (st = get_number(root, "top_p", 0, 1, &b.top_p, r)) ||
        (st = get_number(root, "min_p", 0, 1, &b.min_p, r)) ||
        (st = get_number(root, "presence_penalty", -2, 2, &pres, r)) ||
        (st = get_number(root, "frequency_penalty", -2, 2, &freq, r)) ||
        (st = get_number(root, "repeat_penalty", 0, 10, &b.repeat_penalty, r)) ||
        (st = get_int(root, "top_k", 0, 1e9, &b.top_k, r)) ||
        (st = get_int(root, "seed", -9.2e18, 9.2e18, &b.seed, r)) ||
        (api != SERVER_API_NATIVE && (st = get_int(root, "n", 1, MAX_CHOICES, &n, r))))
        return st;
    *n_choices = (int)n;
    *logprobs = -1;
    if (api == SERVER_API_NATIVE) {
        int64_t n_probs = 0;
        if ((st = get_int(root, "n_probs", 0, SAMPLE_MAX_LOGPROBS, &n_probs, r)) ||
            (st = get_bool(root, "post_sampling_probs", &post_probs, r)))
            return st;
        *logprobs = n_probs > 0 ? (int)n_probs : -1;
    } else if (api == SERVER_API_CHAT) {
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
    if ((float)b.top_p <= 0) /* also a positive value below the smallest float, which would sample with 0 */
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'top_p' must be greater than 0 (got %g)", b.top_p);
    int64_t last_n = 64;
    if ((st = get_int(root, "repeat_last_n", -1, 1e9, &last_n, r)))
        return st;
    fill_sampling(&b, pres, freq, p);
    p->repeat_last_n = (int)last_n; /* -1: the whole history, as llama-server's context-sized window */
    p->n_logprobs = *logprobs > 0 ? *logprobs : 0;
    p->post_sampling_probs = post_probs;
    return KS_OK;
}

/* ---- fields kvserve does not implement ------------------------------------------------ */

/* A field that would change the output if the server ignored it, with the
 * value that leaves the output as it is (a client that sends the default is
 * served). Any other value is a 400 naming the field: a request is never
 * answered as if it had not asked. README (Server) lists them. */
enum harmless { HARMLESS_NONE, HARMLESS_NUMBER, HARMLESS_FALSY };
enum { API_CHAT = 1u << SERVER_API_CHAT, API_TEXT = 1u << SERVER_API_TEXT, API_NATIVE = 1u << SERVER_API_NATIVE };
static const struct refused {
    const char *name;
    unsigned apis;            /* the routes that refuse it */
    enum harmless harmless;   /* NONE: any value is refused; NUMBER: 'value' is accepted; FALSY: false, 0, "", [], {} */
    double value;
    const char *what;
} refused_fields[] = {
    {"grammar_lazy", API_CHAT | API_TEXT | API_NATIVE, HARMLESS_FALSY, 0, "lazy grammars from the request"},
    {"grammar_triggers", API_CHAT | API_TEXT | API_NATIVE, HARMLESS_FALSY, 0, "grammar triggers"},
    {"preserved_tokens", API_CHAT | API_TEXT | API_NATIVE, HARMLESS_FALSY, 0, "preserved tokens"},
    {"t_max_predict_ms", API_CHAT | API_TEXT | API_NATIVE, HARMLESS_FALSY, 0, "a time limit"},
    {"penalize_nl", API_CHAT | API_TEXT | API_NATIVE, HARMLESS_FALSY, 0, "penalize_nl"},
    {"lora", API_CHAT | API_TEXT | API_NATIVE, HARMLESS_FALSY, 0, "LoRA adapters"},
    {"post_sampling_probs", API_CHAT | API_TEXT, HARMLESS_FALSY, 0, "post-sampling probabilities (/completion has them)"},
    {"return_tokens", API_CHAT | API_TEXT | API_NATIVE, HARMLESS_FALSY, 0, "token ids in the answer"},
    {"response_fields", API_CHAT | API_TEXT | API_NATIVE, HARMLESS_FALSY, 0, "response_fields"},
    {"n_probs", API_CHAT | API_TEXT, HARMLESS_FALSY, 0, "n_probs on this route (use 'logprobs')"},
    {"n", API_NATIVE, HARMLESS_NUMBER, 1, "several choices on /completion (use /v1/completions)"},
    {"logprobs", API_NATIVE, HARMLESS_FALSY, 0, "'logprobs' on /completion (use 'n_probs')"},
    {"echo", API_TEXT, HARMLESS_FALSY, 0, "echoing the prompt"},
    {"best_of", API_TEXT, HARMLESS_NUMBER, 1, "best_of"},
    {"suffix", API_TEXT, HARMLESS_FALSY, 0, "a suffix (fill-in-the-middle)"},
    {"functions", API_CHAT, HARMLESS_FALSY, 0, "legacy 'functions' (use 'tools')"},
    {"function_call", API_CHAT, HARMLESS_NONE, 0, "legacy 'function_call' (use 'tool_choice')"},
    {"audio", API_CHAT, HARMLESS_NONE, 0, "audio output"},
    {"modalities", API_CHAT, HARMLESS_NONE, 0, "output modalities"},
    {"prediction", API_CHAT, HARMLESS_NONE, 0, "predicted outputs"},
    {"web_search_options", API_CHAT, HARMLESS_NONE, 0, "web search"},
    /* llama-server's, read by its completion routes */
    {"n_indent", API_CHAT | API_TEXT | API_NATIVE, HARMLESS_NUMBER, 0, "stopping at an indentation (n_indent)"},
    {"n_cmpl", API_CHAT | API_TEXT | API_NATIVE, HARMLESS_NUMBER, 1, "n_cmpl (use 'n' on the /v1 routes)"},
    {"reasoning_budget_tokens", API_CHAT | API_TEXT | API_NATIVE, HARMLESS_NUMBER, -1, "a reasoning budget"},
    {"thinking_budget_tokens", API_CHAT | API_TEXT | API_NATIVE, HARMLESS_NUMBER, -1, "a thinking budget"},
    {"chat_parser", API_CHAT | API_TEXT | API_NATIVE, HARMLESS_FALSY, 0, "a chat parser from the request"},
    {"parse_tool_calls", API_TEXT | API_NATIVE, HARMLESS_FALSY, 0, "tool-call parsing on a text route"},
    {"chat_format", API_TEXT | API_NATIVE, HARMLESS_FALSY, 0, "a chat format on a text route"},
    /* other servers' samplers and constraints (vLLM, TGI, OpenRouter), which clients send to any server */
    {"repetition_penalty", API_CHAT | API_TEXT | API_NATIVE, HARMLESS_NUMBER, 1, "repetition_penalty (use 'repeat_penalty')"},
    {"min_tokens", API_CHAT | API_TEXT | API_NATIVE, HARMLESS_FALSY, 0, "a minimum length"},
    {"stop_token_ids", API_CHAT | API_TEXT | API_NATIVE, HARMLESS_FALSY, 0, "stop token ids (use 'stop' or 'logit_bias')"},
    {"bad_words", API_CHAT | API_TEXT | API_NATIVE, HARMLESS_FALSY, 0, "bad_words (use 'logit_bias')"},
    {"guided_json", API_CHAT | API_TEXT | API_NATIVE, HARMLESS_FALSY, 0, "guided_json (use 'response_format')"},
    {"guided_regex", API_CHAT | API_TEXT | API_NATIVE, HARMLESS_FALSY, 0, "regular-expression constraints"},
    {"guided_choice", API_CHAT | API_TEXT | API_NATIVE, HARMLESS_FALSY, 0, "guided_choice (use 'grammar')"},
    {"guided_grammar", API_CHAT | API_TEXT | API_NATIVE, HARMLESS_FALSY, 0, "guided_grammar (use 'grammar')"},
    {"structured_outputs", API_CHAT | API_TEXT | API_NATIVE, HARMLESS_FALSY, 0, "structured_outputs (use 'response_format')"},
    {"use_beam_search", API_CHAT | API_TEXT | API_NATIVE, HARMLESS_FALSY, 0, "beam search"},
    {"include_stop_str_in_output", API_CHAT | API_TEXT | API_NATIVE, HARMLESS_FALSY, 0, "keeping the stop string"},
    {"top_a", API_CHAT | API_TEXT | API_NATIVE, HARMLESS_FALSY, 0, "top-a sampling"},
    {"tfs_z", API_CHAT | API_TEXT | API_NATIVE, HARMLESS_NUMBER, 1, "tail-free sampling"},
    {"verbosity", API_CHAT, HARMLESS_NONE, 0, "a verbosity level"},
};

static bool falsy(const cJSON *v)
{
    return cJSON_IsFalse(v) || (cJSON_IsNumber(v) && v->valuedouble == 0) ||
           (cJSON_IsString(v) && !v->valuestring[0]) || ((cJSON_IsArray(v) || cJSON_IsObject(v)) && !v->child);
}

static ks_status refuse_unsupported(const cJSON *root, enum server_api api, struct reply *r)
{
    for (size_t i = 0; i < sizeof refused_fields / sizeof refused_fields[0]; i++) {
        const struct refused *f = &refused_fields[i];
        cJSON *v = field(root, f->name);
        if (!v || !(f->apis & (1u << api)))
            continue;
        if ((f->harmless == HARMLESS_NUMBER && cJSON_IsNumber(v) && v->valuedouble == f->value) ||
            (f->harmless == HARMLESS_FALSY && falsy(v)))
            continue;
        if (f->harmless == HARMLESS_NUMBER)
            return reply_fail(r, KS_ERR_INVALID_ARG, "unsupported_parameter",
                              "'%s' is not supported: kvserve does not implement %s; leave it out or set it to %g",
                              f->name, f->what, f->value);
        return reply_fail(r, KS_ERR_INVALID_ARG, "unsupported_parameter",
                          "'%s' is not supported: kvserve does not implement %s; leave it out", f->name, f->what);
    }
    return KS_OK;
}

/* ---- logit_bias ---------------------------------------------------------------------- */

enum { MAX_BIASES = 4096 };

/* One entry: key a token id (a number, or OpenAI's decimal string) or a text
 * whose tokens all get the bias; value a number (-100 or below bans, as
 * OpenAI's -100 does) or false (bans, llama-server's). */
static ks_status add_bias(struct call *c, const cJSON *key, const cJSON *value, struct reply *r)
{
    float bias;
    if (cJSON_IsFalse(value))
        bias = -INFINITY;
    else if (cJSON_IsNumber(value) && isfinite(value->valuedouble))
        bias = value->valuedouble <= -100 ? -INFINITY : (float)value->valuedouble;
    else
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'logit_bias' values must be numbers or false");
    int32_t n_vocab = tok_n_vocab(c->srv->tok), one, *ids = &one;
    size_t n = 1;
    char *end = NULL;
    double id = cJSON_IsNumber(key) ? key->valuedouble : cJSON_IsString(key) ? strtod(key->valuestring, &end) : NAN;
    bool numeric = cJSON_IsNumber(key) || (end && end != key->valuestring && !*end);
    if (numeric && (id != floor(id) || id < 0 || id >= n_vocab))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'logit_bias' token ids must be integers in [0, %d)",
                          n_vocab);
    if (numeric) {
        one = (int32_t)id;
    } else if (cJSON_IsString(key)) {
        if (tok_encode(c->srv->tok, key->valuestring, strlen(key->valuestring), 0, &ids, &n))
            return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while reading 'logit_bias'");
    } else {
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type",
                          "'logit_bias' entries are [token id or text, bias] pairs");
    }
    struct sample_bias *grown = c->n_biases + n <= MAX_BIASES
                                    ? realloc(c->biases, (c->n_biases + n + 1) * sizeof *grown) : NULL;
    if (grown) {
        c->biases = grown;
        for (size_t i = 0; i < n; i++)
            c->biases[c->n_biases++] = (struct sample_bias){ids[i], bias};
    }
    if (ids != &one)
        free(ids);
    if (!grown && c->n_biases + n > MAX_BIASES)
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'logit_bias' biases at most %d tokens", MAX_BIASES);
    return grown ? KS_OK : reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while reading 'logit_bias'");
}

/* logit_bias as OpenAI's {"TOKEN_ID": bias} or llama-server's [[id, bias]],
 * [["text", bias]], [id, false] and {"text": bias}. */
static ks_status parse_logit_bias(struct call *c, const cJSON *root, struct sample_params *p, struct reply *r)
{
    cJSON *lb = field(root, "logit_bias");
    if (!lb)
        return KS_OK;
    if (!cJSON_IsObject(lb) && !cJSON_IsArray(lb))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type",
                          "'logit_bias' must be an object {\"TOKEN_ID\": bias} or an array of [token, bias] pairs");
    const cJSON *e;
    ks_status st = KS_OK;
    cJSON_ArrayForEach(e, lb) {
        if (cJSON_IsObject(lb)) {
            cJSON key = {.type = cJSON_String, .valuestring = e->string};
            st = add_bias(c, &key, e, r);
        } else if (cJSON_IsArray(e) && cJSON_GetArraySize(e) == 2) {
            st = add_bias(c, cJSON_GetArrayItem(e, 0), cJSON_GetArrayItem(e, 1), r);
        } else {
            st = reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'logit_bias' entries are [token, bias] pairs");
        }
        if (st)
            return st;
    }
    p->biases = c->biases;
    p->n_biases = c->n_biases;
    return KS_OK;
}

/* A tokenizer failure: out of memory stays so, anything else is ours (500). */
static ks_status tokenizer_failed(ks_status st, struct reply *r)
{
    return reply_fail(r, st == KS_ERR_NOMEM ? st : KS_ERR_INTERNAL, NULL, "tokenizer: %s", ks_errmsg());
}

/* The prompt as token ids (*ids_out, malloc'd). */
static ks_status prompt_tokens(struct server *srv, enum server_api api, const cJSON *root, int32_t **ids_out,
                               int32_t *n_out, bool *think_open, struct reply *r)
{
    bool chat = api == SERVER_API_CHAT;
    int32_t *ids = NULL;
    size_t n = 0;
    ks_status st;
    if (chat) {
        char *text;
        if ((st = server_chat_prompt(srv, root, &text, r)))
            return st;
        *think_open = server_think_prompt_open(text, strlen(text));
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
        /* llama-server parses special tokens in the prompt text, on /completion
         * and /v1/completions alike (README: the prompt is trusted text) */
        unsigned flags = TOK_ADD_SPECIAL | TOK_PARSE_SPECIAL;
        if (cJSON_IsString(p)) {
            if ((st = tok_encode(srv->tok, p->valuestring, strlen(p->valuestring), flags, &ids, &n)))
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
        } else if (cJSON_IsObject(p) && cJSON_GetObjectItemCaseSensitive(p, "multimodal_data")) {
            return reply_fail(r, KS_ERR_INVALID_ARG, "unsupported_parameter",
                              "'prompt.multimodal_data' is not supported: kvserve reads text and token ids only (no "
                              "images or audio)");
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
    cJSON *rf = field(root, "response_format"), *gr = field(root, "grammar"), *top = field(root, "json_schema");
    const char *type = "text";
    /* llama-server's top-level json_schema, and its response_format {"type": "json_object", "schema": ...} */
    const cJSON *schema = NULL;
    const char *schema_what = NULL;
    if (top && !cJSON_IsObject(top))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'json_schema' must be a JSON Schema object");
    if (top && (rf || gr))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                          "give one of 'json_schema', 'response_format' and 'grammar'");
    if (top) {
        schema = top;
        schema_what = "'json_schema'";
        type = "json_schema";
    }
    if (rf) {
        cJSON *t = cJSON_GetObjectItemCaseSensitive(rf, "type");
        if (!cJSON_IsObject(rf) || !cJSON_IsString(t))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type",
                              "'response_format' must be an object with a string 'type'");
        type = t->valuestring;
        if (strcmp(type, "text") && strcmp(type, "json_object") && strcmp(type, "json_schema"))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                              "'response_format.type' must be text, json_object or json_schema (got '%.64s')", type);
        cJSON *obj_schema = cJSON_GetObjectItemCaseSensitive(rf, "schema");
        if (!strcmp(type, "json_object") && obj_schema && !cJSON_IsNull(obj_schema)) {
            if (!cJSON_IsObject(obj_schema))
                return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type",
                                  "'response_format.schema' must be a JSON Schema object");
            schema = obj_schema;
            schema_what = "'response_format.schema'";
            type = "json_schema";
        }
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
        if (!schema) {
            cJSON *js = cJSON_GetObjectItemCaseSensitive(rf, "json_schema");
            schema = cJSON_GetObjectItemCaseSensitive(js, "schema");
            cJSON *strict = cJSON_GetObjectItemCaseSensitive(js, "strict");
            cJSON *name = cJSON_GetObjectItemCaseSensitive(js, "name");
            if (!cJSON_IsObject(js) || !cJSON_IsObject(schema))
                return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type",
                                  "'response_format.json_schema' must be an object with an object 'schema'");
            if ((strict && !cJSON_IsBool(strict) && !cJSON_IsNull(strict)) || (name && !cJSON_IsString(name)))
                return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type",
                                  "'response_format.json_schema': 'strict' must be a boolean and 'name' a string");
            schema_what = "'response_format.json_schema.schema'";
        }
        char *text = cJSON_PrintUnformatted(schema);
        if (!text)
            return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while reading 'response_format'");
        st = grammar_from_json_schema(text, strlen(text), &gbnf);
        cJSON_free(text);
        if (st == KS_ERR_FORMAT) /* cJSON printed it, so only an allocation can have failed to parse it */
            st = KS_ERR_NOMEM;
        src = gbnf;
        what = schema_what;
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
    c->grammar_whole = !tool_calls;
    p->grammar_vocab = c->srv->grammar_vocab;
    p->grammar_max_tokens = max_tokens;
    if (lazy)
        server_tools_triggers(c->tool_fmt, c->srv->tok, &p->grammar_triggers);
    return KS_OK;
}

/* reasoning_format (the server's --reasoning-format when absent): whether
 * <think>...</think> is split off into reasoning_content. Harmony's
 * channels are always split (server_harmony.c). */
static ks_status parse_reasoning_format(struct call *c, const cJSON *root, struct reply *r)
{
    enum server_reasoning_format f = c->srv->cfg.reasoning_format;
    cJSON *v = field(root, "reasoning_format");
    if (v && (!cJSON_IsString(v) || !server_reasoning_format_parse(v->valuestring, &f)))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                          "'reasoning_format' must be \"none\", \"auto\" or \"deepseek\"");
    c->think = !c->srv->chat.by_family && c->srv->tool_format != SERVER_TOOLS_HARMONY &&
               (f == SERVER_REASONING_DEEPSEEK || (f == SERVER_REASONING_AUTO && c->srv->template_thinks));
    c->think_open = c->think && c->think_open;
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

static ks_status parse_options(struct call *c, enum server_api api, const cJSON *root, int32_t n_prompt,
                               struct sched_request *rq, struct reply *r)
{
    ks_status st;
    bool cache_prompt = true; /* kvserve always shares and keeps prompt prefixes; the answer is the same */
    if ((st = get_bool(root, "stream", &c->stream, r)) || (st = get_bool(root, "ignore_eos", &rq->ignore_eog, r)) ||
        (st = parse_stop(c, root, r)) || (st = parse_speculative(root, rq, r)) ||
        (st = parse_sampling(c->srv, root, api, &rq->sampling, &c->logprobs, &c->n_choices, r)) ||
        (api == SERVER_API_NATIVE && (st = get_bool(root, "cache_prompt", &cache_prompt, r))) ||
        (st = parse_logit_bias(c, root, &rq->sampling, r)) || (st = server_parse_cache_salt(root, rq, r)) ||
        (st = server_parse_samplers(c, root, &rq->sampling, r)))
        return st;
    c->post_probs = rq->sampling.post_sampling_probs;
    cJSON *so = field(root, "stream_options");
    if (so && !cJSON_IsObject(so))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'stream_options' must be an object");
    if (so && (st = get_bool(so, "include_usage", &c->include_usage, r)))
        return st;
    int64_t max_tokens = c->srv->cfg.ctx_size - n_prompt;
    const char *mt_key = field(root, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
    if (api == SERVER_API_NATIVE && field(root, "n_predict"))
        mt_key = "n_predict";
    cJSON *mt = field(root, mt_key);
    if (mt && (!cJSON_IsNumber(mt) || mt->valuedouble != floor(mt->valuedouble)))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'%s' must be an integer", mt_key);
    if (mt && api == SERVER_API_NATIVE && mt->valuedouble < 0) /* llama-server: -1 is "until the context is full" */
        mt = NULL;
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
    return server_request_parse(srv, chat ? SERVER_API_CHAT : SERVER_API_TEXT, body, len, out, rq, r);
}

/* Does name name the model this server serves: its id in /v1/models (the
 * alias, or the file's name), the file's name without .gguf, its path, or ""
 * (clients that leave it blank)? */
bool server_model_served(const struct server *srv, const char *name)
{
    const char *path = srv->cfg.model_path ? srv->cfg.model_path : "";
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    size_t n = strlen(base);
    bool stem = n > 5 && !strcmp(base + n - 5, ".gguf") && strlen(name) == n - 5 && !strncmp(name, base, n - 5);
    return !*name || (srv->model_name && !strcmp(name, srv->model_name)) ||
           (*path && (!strcmp(name, path) || !strcmp(name, base))) || stem;
}

ks_status server_request_parse(struct server *srv, enum server_api api, const char *body, size_t len,
                               struct call **out, struct sched_request *rq, struct reply *r)
{
    if (srv->cfg.no_generation)
        return reply_fail(r, KS_ERR_UNSUPPORTED, "not_supported",
                          "this is an embedding model (non-causal attention, or an encoder such as bert without an "
                          "output head): it serves /v1/embeddings (with --embeddings; implied for an encoder), not "
                          "completions");
    bool chat = api == SERVER_API_CHAT;
    cJSON *root;
    ks_status st = server_parse_object(body, len, false, &root, r);
    if (st)
        return st;
    cJSON *model = field(root, "model");
    if (model && !cJSON_IsString(model)) {
        cJSON_Delete(root);
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'model' must be a string");
    }
    /* the OpenAI routes name their model; another would be answered by this one unawares */
    if (model && api != SERVER_API_NATIVE && !server_model_served(srv, model->valuestring)) {
        st = reply_fail(r, KS_ERR_NOT_FOUND, "model_not_found", /* 404, as OpenAI and vLLM answer it */
                        "'model' is '%.200s' but this server serves '%s' (see GET /v1/models; --alias names it)",
                        model->valuestring, srv->model_name ? srv->model_name : "kvserve");
        cJSON_Delete(root);
        return st;
    }
    if ((st = refuse_unsupported(root, api, r))) {
        cJSON_Delete(root);
        return st;
    }
    if (!chat && field(root, "messages")) {
        cJSON_Delete(root);
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                          "%s takes 'prompt', not 'messages' (use /v1/chat/completions)",
                          api == SERVER_API_NATIVE ? "/completion" : "/v1/completions");
    }
    struct call *c = server_call_new(srv, chat);
    if (!c) {
        cJSON_Delete(root);
        return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while starting the request");
    }
    c->native = api == SERVER_API_NATIVE;
    /* llama-server's /completion joins the tokens' pieces: an SPM answer keeps its first space */
    if (c->native) {
        tok_stream_free(c->detok);
        c->detok = NULL;
        if (tok_stream_create(srv->tok, TOK_DECODE_REPLACE_BAD | TOK_DECODE_KEEP_SPACE, &c->detok)) {
            cJSON_Delete(root);
            server_call_unref(c);
            return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while starting the request");
        }
    }
    int32_t n_prompt = 0;
    int32_t *ids = NULL;
    st = chat ? server_parse_tool_options(root, &c->tools, r) : KS_OK;
    if (!st)
        st = prompt_tokens(srv, api, root, &ids, &n_prompt, &c->think_open, r);
    if (!st && chat)
        st = parse_reasoning_format(c, root, r);
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
        st = parse_options(c, api, root, n_prompt, rq, r);
    /* output constrained from its first token (a schema, a grammar, required tool calls) is the
     * answer itself, even after a prompt that opened <think> */
    if (!st && rq->sampling.grammar && rq->sampling.grammar_triggers.n == 0)
        c->think_open = false;
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
