/* llama-server's own routes besides /completion (server_completion.c) and
 * /apply-template (server_chat.c): POST /tokenize, POST /detokenize, GET
 * /props and GET /slots, in llama-server's shapes so its clients (the web UI,
 * token counters) work unchanged. */
#include "server/server_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kv/kv.h"

static cJSON *field(const cJSON *root, const char *key)
{
    cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
    return cJSON_IsNull(v) ? NULL : v;
}

static ks_status get_flag(const cJSON *root, const char *key, bool *out, struct reply *r)
{
    cJSON *v = field(root, key);
    if (v && !cJSON_IsBool(v))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'%s' must be true or false", key);
    if (v)
        *out = cJSON_IsTrue(v);
    return KS_OK;
}

/* A token's piece as llama-server's with_pieces gives it: the text when it
 * is valid UTF-8, else its bytes. */
static cJSON *piece_json(const struct tokenizer *tok, int32_t id)
{
    const char *bytes = "";
    size_t len = 0;
    tok_piece(tok, id, &bytes, &len);
    char *clean = NULL;
    size_t clen = 0;
    if (tok_utf8_sanitize(bytes, len, &clean, &clen))
        return NULL;
    cJSON *p;
    if (clen == len && !memcmp(clean, bytes, len)) {
        p = cJSON_CreateString(clean);
    } else {
        p = cJSON_CreateArray();
        for (size_t i = 0; i < len; i++)
            server_json_push(p, cJSON_CreateNumber((unsigned char)bytes[i]));
    }
    free(clean);
    return p;
}

/* POST /tokenize {"content": TEXT, "add_special": false, "parse_special":
 * true, "with_pieces": false} -> {"tokens": [id, ...]} or, with pieces,
 * {"tokens": [{"id", "piece"}, ...]} (llama-server's defaults). */
ks_status server_route_tokenize(struct server *srv, const struct server_req *rq, struct reply *r)
{
    cJSON *root;
    ks_status st = server_parse_object(rq->body, rq->len, false, &root, r);
    if (st)
        return st;
    bool add_special = false, parse_special = true, with_pieces = false;
    cJSON *content = field(root, "content");
    if (!cJSON_IsString(content))
        st = reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'content' must be a string");
    if (!st && !(st = get_flag(root, "add_special", &add_special, r)) &&
        !(st = get_flag(root, "parse_special", &parse_special, r)))
        st = get_flag(root, "with_pieces", &with_pieces, r);
    int32_t *ids = NULL;
    size_t n = 0;
    unsigned flags = (add_special ? TOK_ADD_SPECIAL : 0) | (parse_special ? TOK_PARSE_SPECIAL : 0);
    if (!st && (st = tok_encode(srv->tok, content->valuestring, strlen(content->valuestring), flags, &ids, &n)))
        st = reply_fail(r, st == KS_ERR_NOMEM ? st : KS_ERR_INTERNAL, NULL, "tokenizer: %s", ks_errmsg());
    cJSON_Delete(root);
    if (st)
        return st;
    cJSON *o = cJSON_CreateObject();
    cJSON *arr = cJSON_AddArrayToObject(o, "tokens");
    for (size_t i = 0; i < n; i++) {
        if (!with_pieces) {
            server_json_push(arr, cJSON_CreateNumber(ids[i]));
            continue;
        }
        cJSON *e = cJSON_CreateObject();
        cJSON_AddNumberToObject(e, "id", ids[i]);
        server_json_add(e, "piece", piece_json(srv->tok, ids[i]));
        server_json_push(arr, e);
    }
    free(ids);
    return reply_json(r, 200, o);
}

/* POST /detokenize {"tokens": [id, ...]} -> {"content": TEXT}: every
 * token's piece, control tokens' text included, as llama-server joins them. */
ks_status server_route_detokenize(struct server *srv, const struct server_req *rq, struct reply *r)
{
    cJSON *root;
    ks_status st = server_parse_object(rq->body, rq->len, false, &root, r);
    if (st)
        return st;
    cJSON *tokens = field(root, "tokens");
    int n = cJSON_IsArray(tokens) ? cJSON_GetArraySize(tokens) : 0;
    int32_t *ids = malloc(((size_t)n + 1) * sizeof *ids);
    if (tokens && !cJSON_IsArray(tokens))
        st = reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'tokens' must be an array of token ids");
    else if (!ids)
        st = reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while reading 'tokens'");
    int i = 0, n_vocab = tok_n_vocab(srv->tok);
    const cJSON *t;
    cJSON_ArrayForEach(t, tokens) {
        if (st)
            break;
        if (!cJSON_IsNumber(t) || t->valuedouble != floor(t->valuedouble) || t->valuedouble < 0 ||
            t->valuedouble >= n_vocab)
            st = reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                            "'tokens' must be integers in [0, %d) (index %d)", n_vocab, i);
        else
            ids[i++] = (int32_t)t->valuedouble;
    }
    cJSON_Delete(root);
    char *raw = NULL, *text = NULL;
    size_t len = 0;
    if (!st && (st = tok_decode(srv->tok, ids, (size_t)i, TOK_DECODE_SPECIAL | TOK_DECODE_KEEP_SPACE, &raw, &len)))
        st = reply_fail(r, st == KS_ERR_NOMEM ? st : KS_ERR_INTERNAL, NULL, "detokenizer: %s", ks_errmsg());
    /* JSON text: invalid UTF-8 (a token that is part of a character) and NUL become U+FFFD */
    if (!st && tok_utf8_sanitize(raw, len, &text, &len))
        st = reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while writing the text");
    free(ids);
    free(raw);
    if (st)
        return st;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "content", text);
    free(text);
    return reply_json(r, 200, o);
}

/* The defaults a request that names no sampling field gets on /completion. */
static cJSON *generation_settings_json(const struct server *srv)
{
    struct sample_params p;
    server_native_sampling(srv, &p);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "n_ctx", srv->cfg.ctx_size);
    cJSON *params = cJSON_AddObjectToObject(o, "params");
    cJSON_AddNumberToObject(params, "n_predict", -1);
    cJSON_AddNumberToObject(params, "temperature", p.temp);
    cJSON_AddNumberToObject(params, "top_k", p.top_k);
    cJSON_AddNumberToObject(params, "top_p", p.top_p);
    cJSON_AddNumberToObject(params, "min_p", p.min_p);
    cJSON_AddNumberToObject(params, "repeat_penalty", p.repeat_penalty);
    cJSON_AddNumberToObject(params, "repeat_last_n", p.repeat_last_n);
    cJSON_AddNumberToObject(params, "presence_penalty", p.presence_penalty);
    cJSON_AddNumberToObject(params, "frequency_penalty", p.frequency_penalty);
    cJSON_AddNumberToObject(params, "seed", srv->cfg.sampling_set & SERVER_SAMPLING_SEED
                                                 ? (double)srv->cfg.sampling.seed : -1.0);
    cJSON_AddNumberToObject(params, "n_probs", 0);
    cJSON_AddBoolToObject(params, "ignore_eos", false);
    cJSON_AddArrayToObject(params, "stop");
    server_samplers_props(srv, params);
    cJSON_AddStringToObject(params, "reasoning_format",
                            srv->cfg.reasoning_format == SERVER_REASONING_NONE       ? "none"
                            : srv->cfg.reasoning_format == SERVER_REASONING_DEEPSEEK ? "deepseek"
                                                                                     : "auto");
    return o;
}

/* GET /props: the server's settings as llama-server reports them. */
ks_status server_route_props(struct server *srv, const struct server_req *rq, struct reply *r)
{
    (void)rq;
    cJSON *o = cJSON_CreateObject();
    server_json_add(o, "default_generation_settings", generation_settings_json(srv));
    cJSON_AddNumberToObject(o, "total_slots", srv->cfg.parallel > 0 ? srv->cfg.parallel : 1);
    cJSON_AddStringToObject(o, "model_path", srv->cfg.model_path ? srv->cfg.model_path : "");
    cJSON_AddStringToObject(o, "model_alias", srv->model_name);
    cJSON_AddNumberToObject(o, "n_ctx", srv->cfg.ctx_size);
    char *tmpl = NULL, *bos = NULL, *eos = NULL;
    size_t len;
    if (srv->chat.src && tok_utf8_sanitize(srv->chat.src, srv->chat.len, &tmpl, &len))
        server_json_push(NULL, NULL); /* notes the failure */
    if (srv->chat.bos_text && tok_utf8_sanitize(srv->chat.bos_text, strlen(srv->chat.bos_text), &bos, &len))
        server_json_push(NULL, NULL);
    if (srv->chat.eos_text && tok_utf8_sanitize(srv->chat.eos_text, strlen(srv->chat.eos_text), &eos, &len))
        server_json_push(NULL, NULL);
    cJSON_AddStringToObject(o, "chat_template", tmpl ? tmpl : srv->chat.by_family ? tok_chat_name(srv->chat.family) : "");
    cJSON_AddStringToObject(o, "bos_token", bos ? bos : "");
    cJSON_AddStringToObject(o, "eos_token", eos ? eos : "");
    free(tmpl);
    free(bos);
    free(eos);
    cJSON *mod = cJSON_AddObjectToObject(o, "modalities");
    cJSON_AddBoolToObject(mod, "vision", false);
    cJSON_AddBoolToObject(mod, "audio", false);
    cJSON_AddStringToObject(o, "build_info", "kvserve");
    return reply_json(r, 200, o);
}

struct slots_ctx {
    struct server *srv;
    cJSON *out;
    bool oom;
};

/* Runs on the scheduler thread, between two steps. */
static void slots_hook(void *user, struct kv_cache *kv)
{
    struct slots_ctx *s = user;
    server_json_reset();
    enum { MAX_LIST = 1024 };
    struct sched_request_info *reqs = malloc(MAX_LIST * sizeof *reqs);
    int n = reqs ? sched_list_requests(s->srv->sched, reqs, MAX_LIST) : 0;
    n = n > MAX_LIST ? MAX_LIST : n;
    s->out = cJSON_CreateArray();
    for (int i = 0; i < n; i++) {
        if (!reqs[i].running)
            continue;
        cJSON *e = cJSON_CreateObject();
        cJSON_AddNumberToObject(e, "id", (double)reqs[i].id);
        cJSON_AddNumberToObject(e, "n_ctx", s->srv->cfg.ctx_size);
        cJSON_AddBoolToObject(e, "is_processing", true);
        cJSON_AddNumberToObject(e, "n_prompt_tokens", reqs[i].n_prompt);
        cJSON_AddNumberToObject(e, "n_decoded", reqs[i].n_generated);
        cJSON_AddNumberToObject(e, "tokens", reqs[i].n_prompt + reqs[i].n_generated);
        cJSON_AddNumberToObject(e, "computed_tokens", reqs[i].n_computed);
        cJSON_AddNumberToObject(e, "cached_tokens", reqs[i].n_cached);
        struct kv_seq_usage su;
        bool have = kv && reqs[i].seq >= 0 && kv_seq_usage(kv, reqs[i].seq, &su) == KS_OK;
        cJSON_AddNumberToObject(e, "kv_pages", have ? su.n_pages : 0);
        cJSON_AddNumberToObject(e, "kv_bytes", have ? (double)su.bytes : 0);
        cJSON_AddNumberToObject(e, "kv_tokens", have ? su.len : 0);
        server_json_push(s->out, e);
    }
    s->oom = !reqs || server_json_failed();
    free(reqs);
}

/* GET /slots: one entry per running request (read-only; llama-server's
 * slot save/restore/erase actions are not offered). */
ks_status server_route_slots(struct server *srv, const struct server_req *rq, struct reply *r)
{
    (void)rq;
    struct slots_ctx s = {.srv = srv};
    ks_status st = sched_between_steps(srv->sched, slots_hook, &s);
    if (st)
        return reply_fail(r, st, "shutting_down", "%s", ks_errmsg());
    if (s.oom) {
        cJSON_Delete(s.out);
        return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while listing the slots");
    }
    return reply_json(r, 200, s.out);
}
