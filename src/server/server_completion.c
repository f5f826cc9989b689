/* POST /v1/chat/completions and /v1/completions: parse and validate the
 * request, tokenize, submit to the scheduler, then turn the token events into
 * text (streaming detokenizer, stop strings, logprobs) as one JSON response or
 * as SSE chunks. */
#include "server/server_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_STOP 4
#define MAX_STOP_LEN 256

struct item {
    int32_t token;
    struct sample_result res;
};

/* One request, shared by its HTTP thread and the scheduler thread (which
 * holds a reference until the final event). */
struct call {
    struct server *srv;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;
    /* filled by the scheduler thread */
    struct item *items;
    int n_items, cap_items;
    bool finished;
    enum sched_finish finish;
    char error[256];
    /* request options */
    uint64_t sched_id;
    bool chat, stream, include_usage;
    int logprobs;                      /* -1: off; else number of alternatives */
    char *stop[MAX_STOP];
    int n_stop;
    size_t max_stop;
    char id[48];
    long created;
    int32_t n_prompt;
    int32_t n_cached;                  /* prompt tokens the prefix cache served (under mu) */
    /* output state (HTTP thread only) */
    int consumed;
    struct tok_stream *detok;
    struct sbuf text;                  /* generated text, cut at a stop string */
    size_t sent;                       /* bytes of text already streamed */
    bool stopped;                      /* a stop string matched */
    cJSON *lp;                         /* accumulated logprobs (non-streaming) */
    struct sbuf out;                   /* pending SSE bytes */
    size_t out_pos;
    bool role_sent, done;
};

static void call_unref(struct call *c)
{
    pthread_mutex_lock(&c->mu);
    int left = --c->refs;
    pthread_mutex_unlock(&c->mu);
    if (left > 0)
        return;
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c->items);
    for (int i = 0; i < c->n_stop; i++)
        free(c->stop[i]);
    tok_stream_free(c->detok);
    sbuf_free(&c->text);
    sbuf_free(&c->out);
    cJSON_Delete(c->lp);
    free(c);
}

/* Scheduler thread: queue the token or the end. */
static void on_event(void *user, const struct sched_event *ev)
{
    struct call *c = user;
    pthread_mutex_lock(&c->mu);
    c->n_cached = ev->n_cached;
    if (ev->finish == SCHED_FINISH_NONE) {
        if (c->n_items == c->cap_items) {
            int cap = c->cap_items ? 2 * c->cap_items : 64;
            struct item *p = realloc(c->items, (size_t)cap * sizeof *p);
            if (p) {
                c->items = p;
                c->cap_items = cap;
            }
        }
        if (c->n_items < c->cap_items) {
            c->items[c->n_items].token = ev->token;
            c->items[c->n_items].res = *ev->sample;
            c->n_items++;
        }
    } else {
        c->finished = true;
        c->finish = ev->finish;
        if (ev->error)
            snprintf(c->error, sizeof c->error, "%s", ev->error);
    }
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    if (ev->finish != SCHED_FINISH_NONE)
        call_unref(c);
}

/* ---- request parsing ------------------------------------------------------------ */

/* A field that is absent or null reads as "not given". */
static cJSON *field(const cJSON *root, const char *key)
{
    cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
    return cJSON_IsNull(v) ? NULL : v;
}

static bool get_number(const cJSON *root, const char *key, double lo, double hi, double *out, struct reply *r)
{
    cJSON *v = field(root, key);
    if (!v)
        return true;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble)) {
        reply_error(r, 400, "invalid_request_error", "invalid_type", "'%s' must be a number", key);
        return false;
    }
    if (v->valuedouble < lo || v->valuedouble > hi) {
        reply_error(r, 400, "invalid_request_error", "invalid_value", "'%s' must be in [%g, %g] (got %g)", key, lo,
                    hi, v->valuedouble);
        return false;
    }
    *out = v->valuedouble;
    return true;
}

static bool get_int(const cJSON *root, const char *key, double lo, double hi, int64_t *out, struct reply *r)
{
    cJSON *v = field(root, key);
    if (!v)
        return true;
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble)) {
        reply_error(r, 400, "invalid_request_error", "invalid_type", "'%s' must be an integer", key);
        return false;
    }
    if (v->valuedouble < lo || v->valuedouble > hi) {
        reply_error(r, 400, "invalid_request_error", "invalid_value", "'%s' must be in [%.0f, %.0f] (got %.0f)", key,
                    lo, hi, v->valuedouble);
        return false;
    }
    *out = (int64_t)v->valuedouble;
    return true;
}

static bool get_bool(const cJSON *root, const char *key, bool *out, struct reply *r)
{
    cJSON *v = field(root, key);
    if (!v)
        return true;
    if (!cJSON_IsBool(v)) {
        reply_error(r, 400, "invalid_request_error", "invalid_type", "'%s' must be true or false", key);
        return false;
    }
    *out = cJSON_IsTrue(v);
    return true;
}

static bool add_stop(struct call *c, const cJSON *s, struct reply *r)
{
    if (!cJSON_IsString(s)) {
        reply_error(r, 400, "invalid_request_error", "invalid_type", "'stop' must be a string or a list of strings");
        return false;
    }
    size_t n = strlen(s->valuestring);
    if (n == 0)
        return true;
    if (n > MAX_STOP_LEN || c->n_stop == MAX_STOP) {
        reply_error(r, 400, "invalid_request_error", "invalid_value",
                    "'stop' takes at most %d strings of at most %d bytes", MAX_STOP, MAX_STOP_LEN);
        return false;
    }
    c->stop[c->n_stop] = strdup(s->valuestring);
    if (!c->stop[c->n_stop]) {
        reply_error(r, 500, "server_error", NULL, "out of memory");
        return false;
    }
    c->n_stop++;
    if (n > c->max_stop)
        c->max_stop = n;
    return true;
}

static bool parse_stop(struct call *c, const cJSON *root, struct reply *r)
{
    cJSON *v = field(root, "stop");
    if (!v)
        return true;
    if (!cJSON_IsArray(v))
        return add_stop(c, v, r);
    const cJSON *s;
    cJSON_ArrayForEach(s, v) if (!add_stop(c, s, r)) return false;
    return true;
}

static bool parse_sampling(const cJSON *root, bool chat, struct sample_params *p, int *logprobs, struct reply *r)
{
    static uint64_t seed_counter;
    double temp = 1.0, top_p = 1.0, min_p = 0.0, pres = 0.0, freq = 0.0, rep = 1.0;
    int64_t top_k = 0, seed = -1, n = 1;
    if (!get_number(root, "temperature", 0, 2, &temp, r) || !get_number(root, "top_p", 0, 1, &top_p, r) ||
        !get_number(root, "min_p", 0, 1, &min_p, r) || !get_number(root, "presence_penalty", -2, 2, &pres, r) ||
        !get_number(root, "frequency_penalty", -2, 2, &freq, r) ||
        !get_number(root, "repeat_penalty", 0, 10, &rep, r) || !get_int(root, "top_k", 0, 1e9, &top_k, r) ||
        !get_int(root, "seed", -9.2e18, 9.2e18, &seed, r) || !get_int(root, "n", 1, 1, &n, r))
        return false;
    *logprobs = -1;
    if (chat) {
        bool lp = false;
        int64_t top = 0;
        if (!get_bool(root, "logprobs", &lp, r) || !get_int(root, "top_logprobs", 0, SAMPLE_MAX_LOGPROBS, &top, r))
            return false;
        if (field(root, "top_logprobs") && !lp) {
            reply_error(r, 400, "invalid_request_error", "invalid_value", "'top_logprobs' needs 'logprobs': true");
            return false;
        }
        if (lp)
            *logprobs = (int)top;
    } else {
        int64_t top = -1;
        if (!get_int(root, "logprobs", 0, SAMPLE_MAX_LOGPROBS, &top, r))
            return false;
        *logprobs = (int)top;
    }
    if ((float)top_p <= 0) { /* also a positive value below the smallest float, which would sample with 0 */
        reply_error(r, 400, "invalid_request_error", "invalid_value", "'top_p' must be greater than 0 (got %g)", top_p);
        return false;
    }
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
    return true;
}

/* messages -> rendered chat text. */
static char *render_chat(struct server *srv, const cJSON *root, struct reply *r)
{
    cJSON *msgs = field(root, "messages");
    if (!cJSON_IsArray(msgs) || cJSON_GetArraySize(msgs) == 0) {
        reply_error(r, 400, "invalid_request_error", "invalid_type", "'messages' must be a non-empty array");
        return NULL;
    }
    int n = cJSON_GetArraySize(msgs);
    struct tok_chat_msg *tm = calloc((size_t)n, sizeof *tm);
    char **owned = calloc((size_t)n, sizeof *owned);
    char *out = NULL;
    int i = 0;
    const cJSON *m;
    if (!tm || !owned)
        goto done;
    cJSON_ArrayForEach(m, msgs) {
        cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
        cJSON *content = cJSON_GetObjectItemCaseSensitive(m, "content");
        if (!cJSON_IsObject(m) || !cJSON_IsString(role)) {
            reply_error(r, 400, "invalid_request_error", "invalid_type", "messages[%d] needs a string 'role'", i);
            goto done;
        }
        struct sbuf text = {0};
        if (cJSON_IsString(content)) {
            sbuf_append(&text, content->valuestring, strlen(content->valuestring));
        } else if (cJSON_IsArray(content)) {
            const cJSON *part;
            cJSON_ArrayForEach(part, content) {
                cJSON *t = cJSON_GetObjectItemCaseSensitive(part, "text");
                if (!cJSON_IsString(t)) {
                    sbuf_free(&text);
                    reply_error(r, 400, "invalid_request_error", "invalid_type",
                                "messages[%d].content parts must be {\"type\":\"text\",\"text\":...}", i);
                    goto done;
                }
                sbuf_append(&text, t->valuestring, strlen(t->valuestring));
            }
        } else if (!cJSON_IsNull(content) && content) {
            reply_error(r, 400, "invalid_request_error", "invalid_type", "messages[%d].content must be a string", i);
            goto done;
        }
        if (!text.p)
            sbuf_append(&text, "", 0);
        owned[i] = text.p;
        const char *rn = role->valuestring;
        tm[i].role = !strcmp(rn, "developer") ? "system" : rn;
        tm[i].content = owned[i] ? owned[i] : "";
        if (strcmp(tm[i].role, "system") && strcmp(tm[i].role, "user") && strcmp(tm[i].role, "assistant")) {
            reply_error(r, 400, "invalid_request_error", "invalid_value",
                        "messages[%d].role '%s' is not supported (system, user, assistant)", i, rn);
            goto done;
        }
        i++;
    }
    if (tok_chat_render(srv->tok, srv->chat, tm, (size_t)n, true, &out) != KS_OK) {
        reply_error(r, 400, "invalid_request_error", "invalid_value", "cannot render the chat: %s", ks_errmsg());
        out = NULL;
    }
done:
    for (int k = 0; owned && k < n; k++)
        free(owned[k]);
    free(owned);
    free(tm);
    return out;
}

/* The prompt as token ids (malloc'd), or NULL with r set. */
static int32_t *prompt_tokens(struct server *srv, bool chat, const cJSON *root, int32_t *n_out, struct reply *r)
{
    int32_t *ids = NULL;
    size_t n = 0;
    if (chat) {
        char *text = render_chat(srv, root, r);
        if (!text)
            return NULL;
        ks_status st = tok_encode(srv->tok, text, strlen(text), TOK_ADD_SPECIAL | TOK_PARSE_SPECIAL, &ids, &n);
        free(text);
        if (st) {
            reply_error(r, 500, "server_error", NULL, "tokenizer: %s", ks_errmsg());
            return NULL;
        }
    } else {
        cJSON *p = field(root, "prompt");
        if (cJSON_IsArray(p) && cJSON_GetArraySize(p) == 1 && cJSON_IsString(cJSON_GetArrayItem(p, 0)))
            p = cJSON_GetArrayItem(p, 0);
        if (cJSON_IsString(p)) {
            if (tok_encode(srv->tok, p->valuestring, strlen(p->valuestring), TOK_ADD_SPECIAL, &ids, &n)) {
                reply_error(r, 500, "server_error", NULL, "tokenizer: %s", ks_errmsg());
                return NULL;
            }
        } else if (cJSON_IsArray(p) && cJSON_GetArraySize(p) > 0) {
            n = (size_t)cJSON_GetArraySize(p);
            ids = malloc(n * sizeof *ids);
            if (!ids) {
                reply_error(r, 500, "server_error", NULL, "out of memory");
                return NULL;
            }
            size_t i = 0;
            const cJSON *t;
            int32_t n_vocab = tok_n_vocab(srv->tok);
            cJSON_ArrayForEach(t, p) {
                if (!cJSON_IsNumber(t) || t->valuedouble != floor(t->valuedouble) || t->valuedouble < 0 ||
                    t->valuedouble >= n_vocab) {
                    free(ids);
                    reply_error(r, 400, "invalid_request_error", "invalid_value",
                                "'prompt' token ids must be integers in [0, %d) (index %zu)", n_vocab, i);
                    return NULL;
                }
                ids[i++] = (int32_t)t->valuedouble;
            }
        } else {
            reply_error(r, 400, "invalid_request_error", "invalid_type",
                        "'prompt' must be a string or a non-empty array of token ids");
            return NULL;
        }
    }
    if (n == 0) {
        free(ids);
        reply_error(r, 400, "invalid_request_error", "invalid_value", "the prompt is empty");
        return NULL;
    }
    if (n >= (size_t)srv->cfg.ctx_size) {
        free(ids);
        reply_error(r, 400, "invalid_request_error", "context_length_exceeded",
                    "the prompt has %zu tokens but the context holds %d (--ctx-size); shorten it", n,
                    srv->cfg.ctx_size);
        return NULL;
    }
    *n_out = (int32_t)n;
    return ids;
}

/* ---- text assembly ----------------------------------------------------------------- */

/* Copy s with invalid UTF-8 replaced by U+FFFD (JSON needs valid UTF-8). */
static char *utf8_clean(const char *s, size_t n)
{
    struct sbuf b = {0};
    size_t i = 0;
    while (i < n) {
        unsigned char ch = (unsigned char)s[i];
        size_t len = ch < 0x80 ? 1 : (ch >> 5) == 6 ? 2 : (ch >> 4) == 14 ? 3 : (ch >> 3) == 30 ? 4 : 0;
        bool ok = len > 0 && i + len <= n;
        for (size_t k = 1; ok && k < len; k++)
            ok = ((unsigned char)s[i + k] & 0xC0) == 0x80;
        if (ok && ch != 0) {
            sbuf_append(&b, s + i, len);
            i += len;
        } else {
            sbuf_append(&b, "\xEF\xBF\xBD", 3);
            i++;
        }
    }
    sbuf_append(&b, "", 0);
    return b.p;
}

static cJSON *lp_token_json(struct call *c, int32_t token, float logprob)
{
    const char *bytes = "";
    size_t len = 0;
    tok_piece(c->srv->tok, token, &bytes, &len);
    char *clean = utf8_clean(bytes, len);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "token", clean ? clean : "");
    cJSON_AddNumberToObject(o, "logprob", logprob);
    cJSON *b = cJSON_AddArrayToObject(o, "bytes");
    for (size_t i = 0; i < len; i++)
        cJSON_AddItemToArray(b, cJSON_CreateNumber((unsigned char)bytes[i]));
    free(clean);
    return o;
}

/* Chat: {"content":[{token,logprob,bytes,top_logprobs:[...]}, ...]}.
 * Completions: {"tokens":[],"token_logprobs":[],"top_logprobs":[{tok:lp}],"text_offset":[]}. */
static void lp_add(struct call *c, cJSON *lp, const struct item *it, size_t text_offset)
{
    if (c->chat) {
        cJSON *content = cJSON_GetObjectItem(lp, "content");
        cJSON *e = lp_token_json(c, it->token, it->res.logprob);
        cJSON *top = cJSON_AddArrayToObject(e, "top_logprobs");
        for (int i = 0; i < it->res.n_top && i < c->logprobs; i++)
            cJSON_AddItemToArray(top, lp_token_json(c, it->res.top[i].token, it->res.top[i].logprob));
        cJSON_AddItemToArray(content, e);
        return;
    }
    cJSON *t = lp_token_json(c, it->token, it->res.logprob);
    cJSON_AddItemToArray(cJSON_GetObjectItem(lp, "tokens"),
                         cJSON_CreateString(cJSON_GetObjectItem(t, "token")->valuestring));
    cJSON_AddItemToArray(cJSON_GetObjectItem(lp, "token_logprobs"), cJSON_CreateNumber(it->res.logprob));
    cJSON_AddItemToArray(cJSON_GetObjectItem(lp, "text_offset"), cJSON_CreateNumber((double)text_offset));
    cJSON *top = cJSON_CreateObject();
    for (int i = 0; i < it->res.n_top && i < c->logprobs; i++) {
        cJSON *alt = lp_token_json(c, it->res.top[i].token, it->res.top[i].logprob);
        cJSON_AddNumberToObject(top, cJSON_GetObjectItem(alt, "token")->valuestring, it->res.top[i].logprob);
        cJSON_Delete(alt);
    }
    cJSON_AddItemToArray(cJSON_GetObjectItem(lp, "top_logprobs"), top);
    cJSON_Delete(t);
}

static cJSON *lp_new(bool chat)
{
    cJSON *lp = cJSON_CreateObject();
    if (chat) {
        cJSON_AddArrayToObject(lp, "content");
    } else {
        cJSON_AddArrayToObject(lp, "tokens");
        cJSON_AddArrayToObject(lp, "token_logprobs");
        cJSON_AddArrayToObject(lp, "top_logprobs");
        cJSON_AddArrayToObject(lp, "text_offset");
    }
    return lp;
}

/* Append one token's text and cut at the first stop string. */
static void consume(struct call *c, const struct item *it, cJSON *lp)
{
    if (c->stopped)
        return;
    size_t before = c->text.n;
    if (lp)
        lp_add(c, lp, it, before);
    c->consumed++;
    const char *bytes = NULL;
    size_t len = 0;
    if (tok_stream_push(c->detok, it->token, &bytes, &len) == KS_OK && len)
        sbuf_append(&c->text, bytes, len);
    if (c->n_stop == 0 || !c->text.p)
        return;
    size_t from = before > c->max_stop ? before - c->max_stop : 0;
    char *first = NULL;
    for (int i = 0; i < c->n_stop; i++) {
        char *hit = memmem(c->text.p + from, c->text.n - from, c->stop[i], strlen(c->stop[i]));
        if (hit && (!first || hit < first))
            first = hit;
    }
    if (first) {
        c->text.n = (size_t)(first - c->text.p);
        c->text.p[c->text.n] = '\0';
        c->stopped = true;
    }
    if (c->stopped)
        sched_cancel(c->srv->sched, c->sched_id);
}

static void flush_detok(struct call *c)
{
    const char *bytes = NULL;
    size_t len = 0;
    if (!c->stopped && tok_stream_flush(c->detok, &bytes, &len) == KS_OK && len)
        sbuf_append(&c->text, bytes, len);
}

static const char *finish_reason(const struct call *c)
{
    if (c->stopped || c->finish == SCHED_FINISH_STOP)
        return "stop";
    return "length";
}

static cJSON *usage_json(struct call *c)
{
    pthread_mutex_lock(&c->mu);
    int32_t cached = c->n_cached;
    pthread_mutex_unlock(&c->mu);
    cJSON *u = cJSON_CreateObject();
    cJSON_AddNumberToObject(u, "prompt_tokens", c->n_prompt);
    cJSON_AddNumberToObject(u, "completion_tokens", c->consumed);
    cJSON_AddNumberToObject(u, "total_tokens", c->n_prompt + c->consumed);
    cJSON *d = cJSON_AddObjectToObject(u, "prompt_tokens_details");
    cJSON_AddNumberToObject(d, "cached_tokens", cached);
    return u;
}

static cJSON *response_head(const struct call *c, const char *object)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", c->id);
    cJSON_AddStringToObject(o, "object", object);
    cJSON_AddNumberToObject(o, "created", (double)c->created);
    cJSON_AddStringToObject(o, "model", c->srv->model_name);
    return o;
}

/* ---- non-streaming ----------------------------------------------------------------- */

static bool pull(struct call *c, cJSON *lp, int *n_new);

static void respond_whole(struct call *c, struct reply *r)
{
    cJSON *lp = c->logprobs >= 0 ? lp_new(c->chat) : NULL;
    int n;
    while (!pull(c, lp, &n))
        ;
    if (!c->stopped && c->finish == SCHED_FINISH_ERROR) {
        cJSON_Delete(lp);
        reply_error(r, 500, "server_error", NULL, "%s", c->error[0] ? c->error : "generation failed");
        return;
    }
    if (!c->stopped && c->finish == SCHED_FINISH_CANCELLED) {
        cJSON_Delete(lp);
        reply_error(r, 503, "server_error", "shutting_down", "the request was cancelled (server shutting down)");
        return;
    }
    flush_detok(c);
    char *text = utf8_clean(c->text.p ? c->text.p : "", c->text.n);
    cJSON *o = response_head(c, c->chat ? "chat.completion" : "text_completion");
    cJSON *choices = cJSON_AddArrayToObject(o, "choices");
    cJSON *ch = cJSON_CreateObject();
    cJSON_AddNumberToObject(ch, "index", 0);
    if (c->chat) {
        cJSON *msg = cJSON_AddObjectToObject(ch, "message");
        cJSON_AddStringToObject(msg, "role", "assistant");
        cJSON_AddStringToObject(msg, "content", text ? text : "");
    } else {
        cJSON_AddStringToObject(ch, "text", text ? text : "");
    }
    if (lp)
        cJSON_AddItemToObject(ch, "logprobs", lp);
    else
        cJSON_AddNullToObject(ch, "logprobs");
    cJSON_AddStringToObject(ch, "finish_reason", finish_reason(c));
    cJSON_AddItemToArray(choices, ch);
    cJSON_AddItemToObject(o, "usage", usage_json(c));
    free(text);
    reply_json(r, 200, o);
}

/* ---- streaming --------------------------------------------------------------------- */

static void sse_send(struct call *c, cJSON *o)
{
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!s)
        return;
    sbuf_append(&c->out, "data: ", 6);
    sbuf_append(&c->out, s, strlen(s));
    sbuf_append(&c->out, "\n\n", 2);
    free(s);
}

static cJSON *chunk_new(struct call *c, const char *delta_text, bool with_role, cJSON *lp, const char *finish)
{
    cJSON *o = response_head(c, c->chat ? "chat.completion.chunk" : "text_completion");
    cJSON *choices = cJSON_AddArrayToObject(o, "choices");
    cJSON *ch = cJSON_CreateObject();
    cJSON_AddNumberToObject(ch, "index", 0);
    if (c->chat) {
        cJSON *d = cJSON_AddObjectToObject(ch, "delta");
        if (with_role)
            cJSON_AddStringToObject(d, "role", "assistant");
        if (delta_text)
            cJSON_AddStringToObject(d, "content", delta_text);
    } else {
        cJSON_AddStringToObject(ch, "text", delta_text ? delta_text : "");
    }
    if (lp)
        cJSON_AddItemToObject(ch, "logprobs", lp);
    else
        cJSON_AddNullToObject(ch, "logprobs");
    if (finish)
        cJSON_AddStringToObject(ch, "finish_reason", finish);
    else
        cJSON_AddNullToObject(ch, "finish_reason");
    cJSON_AddItemToArray(choices, ch);
    return o;
}

/* Bytes of text safe to send: all of it at the end, else hold back what could
 * still become the start of a stop string, never splitting a UTF-8 char. */
static size_t safe_end(const struct call *c, bool final)
{
    size_t end = c->text.n;
    if (!final && c->max_stop > 0)
        end = end > c->max_stop - 1 ? end - (c->max_stop - 1) : 0;
    while (end > c->sent && end < c->text.n && ((unsigned char)c->text.p[end] & 0xC0) == 0x80)
        end--;
    return end < c->sent ? c->sent : end;
}

static void stream_text(struct call *c, bool final, cJSON *lp)
{
    size_t end = safe_end(c, final);
    if (end == c->sent && !lp)
        return;
    char *piece = utf8_clean(c->text.p ? c->text.p + c->sent : "", end - c->sent);
    c->sent = end;
    sse_send(c, chunk_new(c, piece ? piece : "", false, lp, NULL));
    free(piece);
}

static void stream_end(struct call *c)
{
    if (!c->stopped && (c->finish == SCHED_FINISH_ERROR || c->finish == SCHED_FINISH_CANCELLED)) {
        cJSON *o = cJSON_CreateObject();
        cJSON *e = cJSON_AddObjectToObject(o, "error");
        cJSON_AddStringToObject(e, "message", c->finish == SCHED_FINISH_ERROR && c->error[0] ? c->error
                                              : "the request was cancelled (server shutting down)");
        cJSON_AddStringToObject(e, "type", "server_error");
        cJSON_AddNullToObject(e, "code");
        sse_send(c, o);
    } else {
        flush_detok(c);
        stream_text(c, true, NULL);
        sse_send(c, chunk_new(c, c->chat ? NULL : "", false, NULL, finish_reason(c)));
        if (c->include_usage) {
            cJSON *o = response_head(c, c->chat ? "chat.completion.chunk" : "text_completion");
            cJSON_AddArrayToObject(o, "choices");
            cJSON_AddItemToObject(o, "usage", usage_json(c));
            sse_send(c, o);
        }
    }
    sbuf_append(&c->out, "data: [DONE]\n\n", 14);
    c->done = true;
}

/* Wait for tokens or the end, consume what arrived; true once the call is
 * over (finished and drained, or cut by a stop string). */
static bool pull(struct call *c, cJSON *lp, int *n_new)
{
    pthread_mutex_lock(&c->mu);
    while (c->consumed == c->n_items && !c->finished)
        pthread_cond_wait(&c->cv, &c->mu);
    int upto = c->n_items;
    bool finished = c->finished;
    struct item *batch = NULL;
    int n = upto - c->consumed;
    if (n > 0) {
        batch = malloc((size_t)n * sizeof *batch);
        if (batch)
            memcpy(batch, c->items + c->consumed, (size_t)n * sizeof *batch);
        else
            n = 0;
    }
    pthread_mutex_unlock(&c->mu);
    for (int i = 0; i < n && !c->stopped; i++)
        consume(c, &batch[i], lp);
    free(batch);
    *n_new = n;
    return c->stopped || (finished && c->consumed == upto);
}

/* Produce the next SSE bytes into c->out; blocks until tokens arrive. */
static void stream_fill(struct call *c)
{
    if (!c->role_sent) {
        c->role_sent = true;
        if (c->chat) {
            sse_send(c, chunk_new(c, "", true, NULL, NULL));
            return;
        }
    }
    cJSON *lp = c->logprobs >= 0 ? lp_new(c->chat) : NULL;
    int n = 0;
    bool over = pull(c, lp, &n);
    if (n > 0)
        stream_text(c, false, lp);
    else
        cJSON_Delete(lp);
    if (over)
        stream_end(c);
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void)pos;
    struct call *c = cls;
    for (;;) {
        if (c->out_pos < c->out.n) {
            size_t n = c->out.n - c->out_pos;
            if (n > max)
                n = max;
            memcpy(buf, c->out.p + c->out_pos, n);
            c->out_pos += n;
            return (ssize_t)n;
        }
        c->out.n = 0;
        c->out_pos = 0;
        if (c->done || c->out.oom)
            return MHD_CONTENT_READER_END_OF_STREAM;
        stream_fill(c);
    }
}

static void http_side_done(struct call *c)
{
    pthread_mutex_lock(&c->mu);
    bool finished = c->finished;
    pthread_mutex_unlock(&c->mu);
    if (!finished)
        sched_cancel(c->srv->sched, c->sched_id); /* client went away */
    struct server *srv = c->srv;
    pthread_mutex_lock(&srv->mu);
    srv->in_flight--;
    pthread_mutex_unlock(&srv->mu);
    call_unref(c);
}

static void stream_free(void *cls)
{
    http_side_done(cls);
}

/* ---- entry --------------------------------------------------------------------------- */

static struct call *call_new(struct server *srv, bool chat)
{
    struct call *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->srv = srv;
    c->chat = chat;
    c->refs = 1;
    c->created = (long)time(NULL);
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    if (tok_stream_create(srv->tok, TOK_DECODE_REPLACE_BAD, &c->detok) != KS_OK) {
        call_unref(c);
        return NULL;
    }
    pthread_mutex_lock(&srv->mu);
    uint64_t n = ++srv->next_call;
    pthread_mutex_unlock(&srv->mu);
    snprintf(c->id, sizeof c->id, "%s-%llu", chat ? "chatcmpl" : "cmpl", (unsigned long long)n);
    return c;
}

static bool parse_options(struct call *c, const cJSON *root, int32_t n_prompt, struct sched_request *rq,
                          struct reply *r)
{
    if (!get_bool(root, "stream", &c->stream, r) || !get_bool(root, "ignore_eos", &rq->ignore_eog, r) ||
        !parse_stop(c, root, r) ||
        !parse_sampling(root, c->chat, &rq->sampling, &c->logprobs, r))
        return false;
    cJSON *so = field(root, "stream_options");
    if (so && (!cJSON_IsObject(so) || !get_bool(so, "include_usage", &c->include_usage, r))) {
        if (!r->body)
            reply_error(r, 400, "invalid_request_error", "invalid_type", "'stream_options' must be an object");
        return false;
    }
    int64_t max_tokens = c->srv->cfg.ctx_size - n_prompt;
    const char *mt_key = field(root, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
    cJSON *mt = field(root, mt_key);
    if (mt && (!cJSON_IsNumber(mt) || mt->valuedouble != floor(mt->valuedouble))) {
        reply_error(r, 400, "invalid_request_error", "invalid_type", "'%s' must be an integer", mt_key);
        return false;
    }
    if (mt && mt->valuedouble < 0) { /* 0 only prefills and caches the prompt (a warm-up) */
        reply_error(r, 400, "invalid_request_error", "invalid_value", "'%s' must not be negative (got %.0f)", mt_key,
                    mt->valuedouble);
        return false;
    }
    if (mt && mt->valuedouble < (double)max_tokens)
        max_tokens = (int64_t)mt->valuedouble;
    rq->max_tokens = (int32_t)max_tokens;
    return true;
}

/* 4xx replies are the client's fault, 5xx ours; the reply carries the words. */
static ks_status rejected(const struct reply *r)
{
    return ks_fail(r->status >= 500 ? KS_ERR_INTERNAL : KS_ERR_INVALID_ARG, "request rejected (HTTP %u)", r->status);
}

ks_status server_completion_parse(struct server *srv, bool chat, const char *body, size_t len, struct call **out,
                                  struct sched_request *rq, struct reply *r)
{
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(body, len, &end, false);
    if (!root || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        reply_error(r, 400, "invalid_request_error", "invalid_json",
                    "the body is not a JSON object (%s)", len == 0 ? "empty body" : "parse error");
        return rejected(r);
    }
    cJSON *model = field(root, "model");
    if (model && !cJSON_IsString(model)) {
        cJSON_Delete(root);
        reply_error(r, 400, "invalid_request_error", "invalid_type", "'model' must be a string");
        return rejected(r);
    }
    if (!chat && field(root, "messages")) {
        cJSON_Delete(root);
        reply_error(r, 400, "invalid_request_error", "invalid_value",
                    "/v1/completions takes 'prompt', not 'messages' (use /v1/chat/completions)");
        return rejected(r);
    }
    struct call *c = call_new(srv, chat);
    if (!c) {
        cJSON_Delete(root);
        reply_error(r, 500, "server_error", NULL, "out of memory");
        return rejected(r);
    }
    int32_t n_prompt = 0;
    int32_t *ids = prompt_tokens(srv, chat, root, &n_prompt, r);
    *rq = (struct sched_request){.prompt = ids, .n_prompt = n_prompt, .on_event = on_event, .user = c};
    bool ok = ids && parse_options(c, root, n_prompt, rq, r);
    cJSON_Delete(root);
    if (!ok) {
        free(ids);
        call_unref(c);
        return rejected(r);
    }
    c->n_prompt = n_prompt;
    *out = c;
    return KS_OK;
}

void server_completion_discard(struct call *c, struct sched_request *rq)
{
    free((int32_t *)rq->prompt);
    call_unref(c);
}

void server_handle_completion(struct server *srv, bool chat, const char *body, size_t len, struct reply *r)
{
    struct call *c = NULL;
    struct sched_request rq;
    if (server_completion_parse(srv, chat, body, len, &c, &rq, r) != KS_OK)
        return;
    int32_t *ids = (int32_t *)rq.prompt;
    c->refs = 2; /* HTTP side + scheduler side until the final event */
    pthread_mutex_lock(&srv->mu);
    srv->in_flight++;
    pthread_mutex_unlock(&srv->mu);
    /* hold the lock so the scheduler cannot deliver events before sched_id is set */
    pthread_mutex_lock(&c->mu);
    ks_status st = sched_submit(srv->sched, &rq, &c->sched_id);
    pthread_mutex_unlock(&c->mu);
    free(ids);
    if (st) {
        c->refs = 1;
        if (st == KS_ERR_STATE) {
            reply_error(r, 503, "server_error", "overloaded", "%s", ks_errmsg());
            r->retry_after = 1;
        } else {
            reply_error(r, st == KS_ERR_NOMEM ? 500 : 400, "invalid_request_error", NULL, "%s", ks_errmsg());
        }
        http_side_done(c);
        return;
    }
    if (!c->stream) {
        respond_whole(c, r);
        http_side_done(c);
        return;
    }
    r->status = 200;
    r->content_type = "text/event-stream";
    r->stream = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, stream_read, c, stream_free);
    if (!r->stream) {
        reply_error(r, 500, "server_error", NULL, "cannot create the stream");
        http_side_done(c);
    }
}
