/* The completion routes' answer: token events -> text (streaming
 * detokenizer, stop strings, logprobs, tool calls) as one JSON response or as
 * SSE chunks. */
#include "server/server_completion_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- text assembly ----------------------------------------------------------------- */

/* s as valid UTF-8 for JSON (NULL when out of memory). */
static char *utf8_clean(const char *s, size_t n)
{
    char *out = NULL;
    size_t len;
    return tok_utf8_sanitize(s, n, &out, &len) == KS_OK ? out : NULL;
}

/* One token's entry; key names its number ("logprob", or "prob" for
 * llama-server's post_sampling_probs). */
static cJSON *prob_token_json(struct call *c, int32_t token, const char *key, float value)
{
    const char *bytes = "";
    size_t len = 0;
    tok_piece(c->srv->tok, token, &bytes, &len);
    char *clean = utf8_clean(bytes, len);
    if (!clean)
        return NULL; /* server_json_push / add note it */
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "token", clean);
    cJSON_AddNumberToObject(o, key, value);
    cJSON *b = cJSON_AddArrayToObject(o, "bytes");
    for (size_t i = 0; i < len; i++)
        server_json_push(b, cJSON_CreateNumber((unsigned char)bytes[i]));
    free(clean);
    return o;
}

static cJSON *lp_token_json(struct call *c, int32_t token, float logprob)
{
    return prob_token_json(c, token, "logprob", logprob);
}

/* llama-server's completion_probabilities entry: {id, token, bytes, logprob,
 * top_logprobs}, or with post_sampling_probs {..., prob, top_probs}. */
static cJSON *native_prob_json(struct call *c, int32_t token, float logprob, float prob)
{
    cJSON *o = prob_token_json(c, token, c->post_probs ? "prob" : "logprob", c->post_probs ? prob : logprob);
    if (o)
        cJSON_AddNumberToObject(o, "id", token);
    return o;
}

/* Chat: {"content":[{token,logprob,bytes,top_logprobs:[...]}, ...]}.
 * Completions: {"tokens":[],"token_logprobs":[],"top_logprobs":[{tok:lp}],"text_offset":[]}. */
static void lp_add(struct call *c, cJSON *lp, const struct item *it, size_t text_offset)
{
    if (c->native) {
        cJSON *e = native_prob_json(c, it->token, it->res.logprob, it->res.prob);
        cJSON *top = cJSON_AddArrayToObject(e, c->post_probs ? "top_probs" : "top_logprobs");
        for (int i = 0; i < it->res.n_top && i < c->logprobs; i++)
            server_json_push(top, native_prob_json(c, it->res.top[i].token, it->res.top[i].logprob, it->res.top[i].prob));
        server_json_push(lp, e);
        return;
    }
    if (c->chat) {
        cJSON *content = cJSON_GetObjectItem(lp, "content");
        cJSON *e = lp_token_json(c, it->token, it->res.logprob);
        cJSON *top = cJSON_AddArrayToObject(e, "top_logprobs");
        for (int i = 0; i < it->res.n_top && i < c->logprobs; i++)
            server_json_push(top, lp_token_json(c, it->res.top[i].token, it->res.top[i].logprob));
        server_json_push(content, e);
        return;
    }
    cJSON *t = lp_token_json(c, it->token, it->res.logprob);
    cJSON *tt = cJSON_GetObjectItem(t, "token");
    server_json_push(cJSON_GetObjectItem(lp, "tokens"), cJSON_IsString(tt) ? cJSON_CreateString(tt->valuestring) : NULL);
    server_json_push(cJSON_GetObjectItem(lp, "token_logprobs"), cJSON_CreateNumber(it->res.logprob));
    server_json_push(cJSON_GetObjectItem(lp, "text_offset"), cJSON_CreateNumber((double)text_offset));
    cJSON *top = cJSON_CreateObject();
    for (int i = 0; i < it->res.n_top && i < c->logprobs; i++) {
        cJSON *alt = lp_token_json(c, it->res.top[i].token, it->res.top[i].logprob);
        cJSON *at = cJSON_GetObjectItem(alt, "token");
        if (cJSON_IsString(at))
            cJSON_AddNumberToObject(top, at->valuestring, it->res.top[i].logprob);
        else
            server_json_push(top, NULL); /* notes the failure */
        cJSON_Delete(alt);
    }
    server_json_push(cJSON_GetObjectItem(lp, "top_logprobs"), top);
    cJSON_Delete(t);
}

static cJSON *lp_new(const struct call *c)
{
    if (c->native)
        return cJSON_CreateArray();
    cJSON *lp = cJSON_CreateObject();
    if (c->chat) {
        cJSON_AddArrayToObject(lp, "content");
    } else {
        cJSON_AddArrayToObject(lp, "tokens");
        cJSON_AddArrayToObject(lp, "token_logprobs");
        cJSON_AddArrayToObject(lp, "top_logprobs");
        cJSON_AddArrayToObject(lp, "text_offset");
    }
    return lp;
}

/* ---- tool calls -------------------------------------------------------------------- */

/* A control token of the tool-call markup (<|python_tag|>, [TOOL_CALLS]):
 * the detokenizer drops control tokens, the parser needs them (llama.cpp's
 * preserved tokens). */
static bool tool_markup_token(const struct call *c, int32_t token)
{
    for (int i = 0; c->tool_fmt != SERVER_TOOLS_NONE && i < c->srv->n_tool_tokens; i++)
        if (c->srv->tool_tokens[i] == token)
            return true;
    return false;
}

/* <think> or </think> as a control token: kept in the text for the reasoning split. */
static bool think_token(const struct call *c, int32_t token)
{
    for (int i = 0; c->think && i < c->srv->n_think_tokens; i++)
        if (c->srv->think_tokens[i] == token)
            return true;
    return false;
}

/* The content part of the text (*n bytes): all of it, or what follows the
 * reasoning. */
static const char *content_text(const struct call *c, size_t *n)
{
    size_t off = c->content_off < c->text.n ? c->content_off : c->text.n;
    *n = c->text.n - off;
    return c->text.p ? c->text.p + off : "";
}

/* Split the reasoning off the text so far (c->content_off follows it). */
static void think_split(struct call *c, bool final, struct server_think *t)
{
    server_think_parse(c->text.p ? c->text.p : "", c->text.n, c->think_open, final, t);
    c->content_off = t->content_start;
}

/* The markup token's text after whatever the detokenizer held. */
static ks_status push_markup(struct call *c, int32_t token)
{
    const char *bytes = NULL, *mark = NULL;
    size_t len = 0, mlen = 0;
    ks_status st = tok_stream_flush(c->detok, &bytes, &len);
    if (!st && len)
        sbuf_append(&c->text, bytes, len);
    if (!st && !(st = tok_text(c->srv->tok, token, &mark, &mlen)))
        sbuf_append(&c->text, mark, mlen);
    return st;
}

static cJSON *tool_call_json(const struct call *c, int index, const struct server_tool_call *tc, bool whole)
{
    char id[80];
    const char *serial = strchr(c->id, '-') ? strchr(c->id, '-') + 1 : c->id;
    if (c->tool_fmt == SERVER_TOOLS_MISTRAL) /* its templates refuse ids that are not 9 alphanumerics */
        snprintf(id, sizeof id, "%09llu",
                 (strtoull(serial, NULL, 10) * 10000 + (unsigned)c->index * 100 + (unsigned)index) % 1000000000ull);
    else if (c->index > 0) /* unique across the choices */
        snprintf(id, sizeof id, "call_%s_%d_%d", serial, c->index, index);
    else
        snprintf(id, sizeof id, "call_%s_%d", serial, index);
    cJSON *o = cJSON_CreateObject();
    if (!whole)
        cJSON_AddNumberToObject(o, "index", index);
    cJSON_AddStringToObject(o, "id", id);
    cJSON_AddStringToObject(o, "type", "function");
    cJSON *fn = cJSON_AddObjectToObject(o, "function");
    cJSON_AddStringToObject(fn, "name", tc->name);
    cJSON_AddStringToObject(fn, "arguments", whole ? tc->arguments : "");
    return o;
}

/* The calls of a final parse as message.tool_calls (NULL: none). */
static cJSON *calls_json(const struct call *c, const struct server_tool_call *calls, int n)
{
    if (n == 0)
        return NULL;
    cJSON *arr = cJSON_CreateArray();
    for (int i = 0; i < n; i++)
        server_json_push(arr, tool_call_json(c, i, &calls[i], true));
    return arr;
}

/* A harmony answer: *reasoning (NULL: none), *content (NULL when there are
 * calls and no text) and the calls. */
static ks_status harmony_answer(struct call *c, char **content, char **reasoning, cJSON **calls)
{
    struct server_harmony h;
    ks_status st = server_harmony_parse(c->text.p ? c->text.p : "", c->text.n, true, c->harmony_calls, &h);
    if (st)
        return st;
    c->n_calls = h.n_calls;
    if (h.reasoning.n > 0 && !(*reasoning = utf8_clean(h.reasoning.p, h.reasoning.n)))
        st = KS_ERR_NOMEM;
    if (!st && (h.content.n > 0 || h.n_calls == 0) && !(*content = utf8_clean(h.content.p ? h.content.p : "", h.content.n)))
        st = KS_ERR_NOMEM;
    if (!st)
        *calls = calls_json(c, h.calls, h.n_calls);
    server_harmony_free(&h);
    return st;
}

/* The final answer of a tool-using request: *content (malloc'd, valid UTF-8;
 * NULL when there are calls and no text), *reasoning (harmony's analysis,
 * NULL: none) and message.tool_calls (NULL: none). */
static ks_status tool_answer(struct call *c, char **content, char **reasoning, cJSON **calls)
{
    *calls = NULL;
    *content = NULL;
    *reasoning = NULL;
    if (c->tool_fmt == SERVER_TOOLS_HARMONY)
        return harmony_answer(c, content, reasoning, calls);
    size_t n;
    const char *text = content_text(c, &n);
    struct server_tool_result r;
    ks_status st = server_tools_parse(c->tool_fmt, text, n, true, &r);
    if (st)
        return st;
    c->n_calls = r.n_calls;
    if (r.response) {
        if (!(*content = utf8_clean(r.response, strlen(r.response))))
            st = KS_ERR_NOMEM;
    } else {
        struct sbuf b = {0};
        sbuf_append(&b, text, r.content_end);
        sbuf_append(&b, text + r.tail_start, n - r.tail_start);
        bool want = b.n > 0 || r.n_calls == 0; /* calls and no text: content null */
        if (!b.oom && want)
            *content = utf8_clean(b.p ? b.p : "", b.n);
        st = b.oom || (want && !*content) ? KS_ERR_NOMEM : KS_OK;
        sbuf_free(&b);
    }
    if (!st)
        *calls = calls_json(c, r.calls, r.n_calls);
    server_tool_result_free(&r);
    return st;
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
    ks_status st = tool_markup_token(c, it->token) || think_token(c, it->token)
                       ? push_markup(c, it->token)
                       : tok_stream_push(c->detok, it->token, &bytes, &len);
    if (st == KS_OK && len)
        sbuf_append(&c->text, bytes, len);
    if (st == KS_ERR_NOMEM || c->text.oom) { /* the text would have a hole */
        c->oom = true;
        return;
    }
    if (c->n_stop == 0 || !c->text.p)
        return;
    size_t from = before > c->max_stop ? before - c->max_stop : 0;
    char *first = NULL;
    for (int i = 0; i < c->n_stop; i++) {
        char *hit = memmem(c->text.p + from, c->text.n - from, c->stop[i], strlen(c->stop[i]));
        if (hit && (!first || hit < first)) {
            first = hit;
            c->stop_word = i;
        }
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
    if (c->stopped)
        return;
    ks_status st = tok_stream_flush(c->detok, &bytes, &len);
    if (st == KS_OK && len)
        sbuf_append(&c->text, bytes, len);
    if (st == KS_ERR_NOMEM || c->text.oom)
        c->oom = true;
}

static const char *finish_reason(const struct call *c)
{
    if (c->n_calls > 0) /* also when max_tokens cut the text after complete calls */
        return "tool_calls";
    if (c->stopped || c->finish == SCHED_FINISH_STOP)
        return "stop";
    /* the budget ran out on the grammar's last possible byte (its completion
     * is forced within max_tokens): the output is whole, as clients that
     * refuse a "length" structured output need to know */
    if (c->grammar && c->grammar_whole && !c->oom && grammar_match_ended(c->grammar, c->text.p ? c->text.p : "", c->text.n))
        return "stop";
    return "length";
}

/* Each prompt counts once (its n choices share it; a request of several
 * prompts has n choices of each, from calls[p * n]), completions add up. */
static cJSON *usage_json(const struct group *g)
{
    int64_t prompt = 0, cached = 0;
    int completion = 0, drafted = 0, accepted = 0;
    for (int i = 0; i < g->n; i++) {
        struct call *c = g->calls[i];
        completion += c->consumed;
        pthread_mutex_lock(&c->mu);
        if (i % c->n_choices == 0) {
            prompt += c->n_prompt;
            cached += c->n_cached;
        }
        drafted += c->n_drafted;
        accepted += c->n_accepted;
        pthread_mutex_unlock(&c->mu);
    }
    cJSON *u = cJSON_CreateObject();
    cJSON_AddNumberToObject(u, "prompt_tokens", (double)prompt);
    cJSON_AddNumberToObject(u, "completion_tokens", completion);
    cJSON_AddNumberToObject(u, "total_tokens", (double)(prompt + completion));
    cJSON *d = cJSON_AddObjectToObject(u, "prompt_tokens_details");
    cJSON_AddNumberToObject(d, "cached_tokens", (double)cached);
    /* speculation (0 without): draft tokens the model verified, and those it kept */
    cJSON_AddNumberToObject(u, "draft_tokens", drafted);
    cJSON_AddNumberToObject(u, "accepted_tokens", accepted);
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

/* ---- llama-server's /completion --------------------------------------------------- */

static const char *native_stop_type(const struct call *c)
{
    if (c->stopped)
        return "word";
    return c->finish == SCHED_FINISH_STOP ? "eos" : "limit";
}

static cJSON *native_timings(struct call *c)
{
    pthread_mutex_lock(&c->mu);
    double t0 = c->t_submit, t1 = c->t_first, t2 = c->t_end;
    int32_t cached = c->n_cached;
    pthread_mutex_unlock(&c->mu);
    double prompt_ms = t1 > t0 ? (t1 - t0) * 1e3 : 0, predicted_ms = t2 > t1 && t1 > 0 ? (t2 - t1) * 1e3 : 0;
    int prompt_n = c->n_prompt - cached, predicted_n = c->consumed;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "cache_n", cached);
    cJSON_AddNumberToObject(o, "prompt_n", prompt_n);
    cJSON_AddNumberToObject(o, "prompt_ms", prompt_ms);
    cJSON_AddNumberToObject(o, "prompt_per_token_ms", prompt_n > 0 ? prompt_ms / prompt_n : 0);
    cJSON_AddNumberToObject(o, "prompt_per_second", prompt_ms > 0 ? 1e3 * prompt_n / prompt_ms : 0);
    cJSON_AddNumberToObject(o, "predicted_n", predicted_n);
    cJSON_AddNumberToObject(o, "predicted_ms", predicted_ms);
    cJSON_AddNumberToObject(o, "predicted_per_token_ms", predicted_n > 0 ? predicted_ms / predicted_n : 0);
    cJSON_AddNumberToObject(o, "predicted_per_second", predicted_ms > 0 ? 1e3 * predicted_n / predicted_ms : 0);
    return o;
}

/* One /completion event: a stream's partial one (stop false: content and
 * counts), or the whole answer (and a stream's last event, content ""):
 * stop_type eos / limit / word with the stopping_word, and timings. */
static cJSON *native_json(struct call *c, const char *content, bool stop)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "index", c->index);
    cJSON_AddStringToObject(o, "content", content);
    cJSON_AddArrayToObject(o, "tokens");
    cJSON_AddNumberToObject(o, "id_slot", -1);
    cJSON_AddBoolToObject(o, "stop", stop);
    cJSON_AddNumberToObject(o, "tokens_predicted", c->consumed);
    cJSON_AddNumberToObject(o, "tokens_evaluated", c->n_prompt);
    if (!stop)
        return o;
    cJSON_AddStringToObject(o, "model", c->srv->model_name);
    cJSON_AddBoolToObject(o, "truncated", false);
    cJSON_AddStringToObject(o, "stop_type", native_stop_type(c));
    cJSON_AddStringToObject(o, "stopping_word", c->stopped && c->stop_word >= 0 ? c->stop[c->stop_word] : "");
    cJSON_AddBoolToObject(o, "has_new_line", c->text.p && memchr(c->text.p, '\n', c->text.n));
    /* the last token drawn is not in the cache yet */
    cJSON_AddNumberToObject(o, "tokens_cached", c->n_prompt + (c->consumed > 0 ? c->consumed - 1 : 0));
    server_json_add(o, "timings", native_timings(c));
    return o;
}

/* ---- non-streaming ----------------------------------------------------------------- */

enum pulled { PULL_EMPTY, PULL_SOME, PULL_OVER };
static enum pulled pull(struct call *c, cJSON *lp, int *n_new, bool wait);

static bool call_dropped(struct call *c)
{
    pthread_mutex_lock(&c->mu);
    bool dropped = c->dropped;
    pthread_mutex_unlock(&c->mu);
    return dropped;
}

/* Consume what has arrived for c; true once the choice is over. wait:
 * block until it is (a route driven in-process). */
static bool choice_over(struct call *c, bool wait)
{
    if (!c->waited) {
        c->waited = true;
        c->lp = c->logprobs >= 0 ? lp_new(c) : NULL;
    }
    int n;
    enum pulled p;
    while ((p = pull(c, c->lp, &n, wait)) == PULL_SOME)
        ;
    return p == PULL_OVER;
}

/* A choice that is over failed (and fails the request). */
static bool choice_failed(struct call *c)
{
    return call_dropped(c) || c->oom ||
           (!c->stopped && (c->finish == SCHED_FINISH_ERROR || c->finish == SCHED_FINISH_CANCELLED));
}

/* The outcome of a choice that is over; a failed choice fails the request. */
static ks_status choice_result(struct call *c, struct reply *r)
{
    if (!c->stopped && !c->oom)
        flush_detok(c);
    if (call_dropped(c) || c->oom) /* server_group_done cancels the request */
        return reply_fail(r, KS_ERR_NOMEM, NULL, "%s", call_dropped(c) ? DROPPED_MSG : OOM_MSG);
    if (!c->stopped && c->finish == SCHED_FINISH_ERROR)
        return reply_fail(r, KS_ERR_INTERNAL, "generation_failed", "%s", c->error[0] ? c->error : "generation failed");
    if (!c->stopped && c->finish == SCHED_FINISH_CANCELLED)
        return reply_fail(r, KS_ERR_STATE, "shutting_down", "the request was cancelled (server shutting down)");
    return KS_OK;
}

/* choices[] gets the finished choice c: its text or message (with
 * tool_calls), logprobs and finish_reason. */
static ks_status choice_json(struct call *c, cJSON *choices, struct reply *r)
{
    cJSON *tool_calls = NULL;
    char *text = NULL, *reasoning = NULL, *thought = NULL;
    struct server_think t = {0};
    if (c->think)
        think_split(c, true, &t);
    size_t n;
    const char *content = content_text(c, &n);
    bool think_oom = t.reasoning_end > t.reasoning_start &&
                     !(thought = utf8_clean(c->text.p + t.reasoning_start, t.reasoning_end - t.reasoning_start));
    if (think_oom || (c->tool_fmt != SERVER_TOOLS_NONE ? tool_answer(c, &text, &reasoning, &tool_calls) != KS_OK
                                                       : !(text = utf8_clean(content, n)))) {
        free(thought);
        free(text);
        free(reasoning);
        cJSON_Delete(tool_calls);
        return reply_fail(r, KS_ERR_NOMEM, NULL, "%s", OOM_MSG);
    }
    cJSON *ch = cJSON_CreateObject();
    cJSON_AddNumberToObject(ch, "index", c->index);
    if (c->chat) {
        cJSON *msg = cJSON_AddObjectToObject(ch, "message");
        cJSON_AddStringToObject(msg, "role", "assistant");
        if (text)
            cJSON_AddStringToObject(msg, "content", text);
        else
            cJSON_AddNullToObject(msg, "content");
        if (reasoning || thought)
            cJSON_AddStringToObject(msg, "reasoning_content", reasoning ? reasoning : thought);
        if (tool_calls)
            server_json_add(msg, "tool_calls", tool_calls);
    } else {
        cJSON_AddStringToObject(ch, "text", text);
    }
    if (c->lp)
        server_json_add(ch, "logprobs", c->lp);
    else
        cJSON_AddNullToObject(ch, "logprobs");
    c->lp = NULL;
    cJSON_AddStringToObject(ch, "finish_reason", finish_reason(c));
    server_json_push(choices, ch);
    free(text);
    free(reasoning);
    free(thought);
    return KS_OK;
}

/* One /completion answer; several prompts answer the array of them, in
 * order, as llama-server does. */
static cJSON *native_result(struct call *c)
{
    char *text = utf8_clean(c->text.p ? c->text.p : "", c->text.n);
    if (!text)
        return NULL;
    cJSON *o = native_json(c, text, true);
    free(text);
    if (c->lp)
        server_json_add(o, "completion_probabilities", c->lp);
    c->lp = NULL;
    return o;
}

static ks_status native_whole(struct group *g, struct reply *r)
{
    cJSON *all = g->n > 1 ? cJSON_CreateArray() : NULL;
    for (int i = 0; i < g->n; i++) {
        cJSON *o = native_result(g->calls[i]);
        if (!o) {
            cJSON_Delete(all);
            return reply_fail(r, KS_ERR_NOMEM, NULL, "%s", OOM_MSG);
        }
        if (!all)
            return reply_json(r, 200, o);
        server_json_push(all, o);
    }
    return reply_json(r, 200, all);
}

ks_status server_reply_whole(struct group *g, struct reply *r)
{
    ks_status st = KS_OK;
    for (int i = 0; i < g->n && !st; i++) {
        while (!choice_over(g->calls[i], true)) /* at once when the choices are over (whole_poll) */
            ;
        st = choice_result(g->calls[i], r);
    }
    if (st)
        return st;
    struct call *c = g->calls[0];
    if (c->native)
        return native_whole(g, r);
    cJSON *o = response_head(c, c->chat ? "chat.completion" : "text_completion");
    cJSON *choices = cJSON_AddArrayToObject(o, "choices");
    for (int i = 0; i < g->n && !st; i++)
        st = choice_json(g->calls[i], choices, r);
    if (st) {
        cJSON_Delete(o);
        return st;
    }
    server_json_add(o, "usage", usage_json(g));
    return reply_json(r, 200, o);
}

/* ---- streaming --------------------------------------------------------------------- */

/* Append one SSE event, whole or not at all; false (c->oom) when out of
 * memory, or when a JSON allocation failed while o was built. */
static bool sse_send(struct call *c, cJSON *o)
{
    char *s = o && !server_json_failed() ? cJSON_PrintUnformatted(o) : NULL;
    cJSON_Delete(o);
    size_t before = c->out.n;
    if (s && !server_json_failed()) {
        sbuf_append(&c->out, "data: ", 6);
        sbuf_append(&c->out, s, strlen(s));
        sbuf_append(&c->out, "\n\n", 2);
    }
    bool ok = s && !server_json_failed() && !c->out.oom;
    free(s);
    if (!ok) {
        c->out.n = before; /* drop the partial event; the bytes before it are whole events */
        c->out.oom = false;
        c->oom = true;
    }
    return ok;
}

static cJSON *chunk_new(struct call *c, const char *delta_text, bool with_role, cJSON *lp, const char *finish)
{
    if (c->native) {
        cJSON *o = native_json(c, delta_text ? delta_text : "", finish != NULL);
        if (lp)
            server_json_add(o, "completion_probabilities", lp);
        return o;
    }
    cJSON *o = response_head(c, c->chat ? "chat.completion.chunk" : "text_completion");
    cJSON *choices = cJSON_AddArrayToObject(o, "choices");
    cJSON *ch = cJSON_CreateObject();
    cJSON_AddNumberToObject(ch, "index", c->index);
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
        server_json_add(ch, "logprobs", lp);
    else
        cJSON_AddNullToObject(ch, "logprobs");
    if (finish)
        cJSON_AddStringToObject(ch, "finish_reason", finish);
    else
        cJSON_AddNullToObject(ch, "finish_reason");
    server_json_push(choices, ch);
    return o;
}

/* Bytes of text safe to send: all of it at the end, else hold back what could
 * still become the start of a stop string, never splitting a UTF-8 char. */
static size_t safe_end(const struct call *c, bool final)
{
    size_t n;
    const char *text = content_text(c, &n);
    size_t end = n;
    if (!final && c->max_stop > 0)
        end = end > c->max_stop - 1 ? end - (c->max_stop - 1) : 0;
    while (end > c->sent && end < n && ((unsigned char)text[end] & 0xC0) == 0x80)
        end--;
    return end < c->sent ? c->sent : end;
}

static void stream_tools(struct call *c, bool final, cJSON *lp);
static void stream_harmony(struct call *c, bool final, cJSON *lp);
static void stream_think(struct call *c, bool final, cJSON **lp);

static void stream_text(struct call *c, bool final, cJSON *lp)
{
    if (c->tool_fmt == SERVER_TOOLS_HARMONY)
        return stream_harmony(c, final, lp);
    if (c->think)
        stream_think(c, final, &lp);
    if (c->oom) {
        cJSON_Delete(lp);
        return;
    }
    if (c->tool_fmt != SERVER_TOOLS_NONE)
        return stream_tools(c, final, lp);
    size_t end = safe_end(c, final), n;
    if (end == c->sent && !lp)
        return;
    char *piece = utf8_clean(content_text(c, &n) + c->sent, end - c->sent);
    if (!piece) {
        cJSON_Delete(lp);
        c->oom = true;
        return;
    }
    if (sse_send(c, chunk_new(c, piece, false, lp, NULL)))
        c->sent = end;
    free(piece);
}

/* Send text[c->sent..end) as content (with lp, if any), whole chars only. */
static void stream_content(struct call *c, const char *text, size_t end, cJSON *lp)
{
    if (end <= c->sent && !lp)
        return;
    char *piece = utf8_clean(text + c->sent, end > c->sent ? end - c->sent : 0);
    if (!piece) {
        cJSON_Delete(lp);
        c->oom = true;
        return;
    }
    if (sse_send(c, chunk_new(c, piece, false, lp, NULL)) && end > c->sent)
        c->sent = end;
    free(piece);
}

/* Bytes of part[0..n) that are whole UTF-8 characters, from sent on. */
static size_t whole_chars(const char *part, size_t n, size_t sent)
{
    size_t end = n;
    while (end > sent && ((unsigned char)part[end - 1] & 0x80)) {
        size_t lead = end - 1;
        while (lead > sent && ((unsigned char)part[lead] & 0xC0) == 0x80)
            lead--;
        unsigned char b = (unsigned char)part[lead];
        size_t need = b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : b >= 0xC0 ? 2 : 1;
        if (end - lead >= need)
            break;
        end = lead;
    }
    return end;
}

/* One delta of a part (harmony's channels, the reasoning): what is new in
 * part[0..n) since *sent. */
static void stream_part(struct call *c, const char *part, size_t n, size_t *sent, const char *key, bool final,
                        cJSON **lp)
{
    size_t end = final ? n : whole_chars(part ? part : "", n, *sent);
    if (end <= *sent)
        return;
    char *piece = utf8_clean(part + *sent, end - *sent);
    if (!piece) {
        c->oom = true;
        return;
    }
    cJSON *o = chunk_new(c, NULL, false, *lp, NULL);
    *lp = NULL;
    cJSON *delta = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(o, "choices"), 0), "delta");
    cJSON_AddStringToObject(delta, key, piece);
    if (sse_send(c, o))
        *sent = end;
    free(piece);
}

static void stream_calls(struct call *c, const struct server_tool_call *calls, int n);

/* The reasoning's delta (taking *lp with it); what may still be the start of
 * a stop string is held back, as in content. */
static void stream_think(struct call *c, bool final, cJSON **lp)
{
    struct server_think t;
    think_split(c, final, &t);
    size_t end = t.reasoning_end;
    if (!final && c->max_stop > 0) {
        size_t limit = c->text.n > c->max_stop - 1 ? c->text.n - (c->max_stop - 1) : 0;
        end = end < limit ? end : limit;
    }
    if (end > t.reasoning_start)
        stream_part(c, c->text.p + t.reasoning_start, end - t.reasoning_start, &c->sent_reasoning,
                    "reasoning_content", final, lp);
}

/* A harmony stream: reasoning_content and content deltas as the channels
 * grow (a tail that may be a marker held back), each call once complete. */
static void stream_harmony(struct call *c, bool final, cJSON *lp)
{
    struct server_harmony h;
    if (server_harmony_parse(c->text.p ? c->text.p : "", c->text.n, final, c->harmony_calls, &h)) {
        cJSON_Delete(lp);
        c->oom = true;
        return;
    }
    stream_part(c, h.reasoning.p, h.reasoning.n, &c->sent_reasoning, "reasoning_content", final, &lp);
    if (!c->oom)
        stream_part(c, h.content.p, h.content.n, &c->sent_content, "content", final, &lp);
    if (lp && !c->oom) /* logprobs of tokens that added no text yet */
        sse_send(c, chunk_new(c, NULL, false, lp, NULL));
    else
        cJSON_Delete(lp);
    if (!c->oom)
        stream_calls(c, h.calls, h.n_calls);
    if (final && !c->oom) {
        c->n_calls = h.n_calls;
        c->sent = c->text.n;
    }
    server_harmony_free(&h);
}

/* Calls not streamed yet, as OpenAI sends them: a delta with index, id,
 * type, name and arguments "", then one with the arguments. */
static void stream_calls(struct call *c, const struct server_tool_call *calls, int n)
{
    for (; !c->oom && c->calls_sent < n; c->calls_sent++) {
        const struct server_tool_call *tc = &calls[c->calls_sent];
        for (int part = 0; part < 2 && !c->oom; part++) {
            cJSON *o = chunk_new(c, NULL, false, NULL, NULL);
            cJSON *delta = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(o, "choices"), 0), "delta");
            cJSON *arr = cJSON_CreateArray();
            cJSON *call = part == 0 ? tool_call_json(c, c->calls_sent, tc, false) : cJSON_CreateObject();
            if (part == 1) {
                cJSON_AddNumberToObject(call, "index", c->calls_sent);
                cJSON *fn = cJSON_AddObjectToObject(call, "function");
                cJSON_AddStringToObject(fn, "arguments", tc->arguments);
            }
            server_json_push(arr, call);
            server_json_add(delta, "tool_calls", arr);
            sse_send(c, o);
        }
    }
}

/* A tool-using stream: content up to the first call marker (less what may
 * still become one or a stop string), each call once complete as OpenAI
 * sends them (a delta with index, id, type, name and arguments "", then one
 * with the arguments), and at the end the text after the calls. */
static void stream_tools(struct call *c, bool final, cJSON *lp)
{
    size_t n;
    const char *text = content_text(c, &n);
    struct server_tool_result r;
    if (server_tools_parse(c->tool_fmt, text, n, final, &r)) {
        cJSON_Delete(lp);
        c->oom = true;
        return;
    }
    size_t end = safe_end(c, final);
    if (end > r.content_end)
        end = r.content_end < c->sent ? c->sent : r.content_end;
    while (end > c->sent && end < n && ((unsigned char)text[end] & 0xC0) == 0x80)
        end--;
    if (r.response) { /* generic {"response": ...}: held back whole until now */
        char *piece = utf8_clean(r.response, strlen(r.response));
        if (!piece || !sse_send(c, chunk_new(c, piece, false, lp, NULL)))
            c->oom = true;
        free(piece);
        c->sent = n;
    } else {
        stream_content(c, text, end, lp);
    }
    stream_calls(c, r.calls, r.n_calls);
    if (final && !c->oom) {
        c->n_calls = r.n_calls;
        if (r.n_calls > 0 && r.tail_start < n) {
            c->sent = r.tail_start;
            stream_content(c, text, n, NULL);
        }
        c->sent = n;
    }
    server_tool_result_free(&r);
}

/* The end of a stream that lost output to an allocation failure: an error
 * event and [DONE] from static memory (allocating may fail again), and the
 * request is cancelled so its pages are freed now. */
static void stream_fail(struct call *c)
{
    static const char dropped[] = "data: {\"error\":{\"message\":\"" DROPPED_MSG "\",\"type\":\"server_error\","
                                  "\"code\":\"out_of_memory\"}}\n\ndata: [DONE]\n\n";
    static const char oom[] = "data: {\"error\":{\"message\":\"" OOM_MSG "\",\"type\":\"server_error\","
                              "\"code\":\"out_of_memory\"}}\n\ndata: [DONE]\n\n";
    c->tail = call_dropped(c) ? dropped : oom;
    c->tail_pos = 0;
    c->done = true;
    sched_cancel(c->srv->sched, c->sched_id);
}

/* The choice's last chunk: its finish_reason, or an error event when the
 * scheduler failed or cancelled it. */
static void stream_end(struct call *c)
{
    if (call_dropped(c) || c->oom)
        return stream_fail(c);
    if (!c->stopped && (c->finish == SCHED_FINISH_ERROR || c->finish == SCHED_FINISH_CANCELLED)) {
        cJSON *o = cJSON_CreateObject();
        cJSON *e = cJSON_AddObjectToObject(o, "error");
        cJSON_AddStringToObject(e, "message", c->finish == SCHED_FINISH_ERROR && c->error[0] ? c->error
                                              : "the request was cancelled (server shutting down)");
        cJSON_AddStringToObject(e, "type", "server_error");
        cJSON_AddStringToObject(e, "code", c->finish == SCHED_FINISH_ERROR ? "generation_failed" : "shutting_down");
        if (!sse_send(c, o))
            return stream_fail(c);
    } else {
        flush_detok(c);
        stream_text(c, true, NULL);
        if (c->oom || !sse_send(c, chunk_new(c, c->chat ? NULL : "", false, NULL, finish_reason(c))))
            return stream_fail(c);
    }
    c->done = true;
}

/* Every choice has ended: the usage chunk (if asked) and [DONE], written to
 * the out of the choice served last (already sent). */
static void stream_finish(struct group *g)
{
    struct call *c = g->calls[g->turn];
    g->ended = true;
    if (c->native) /* llama-server's /completion stream ends with its stop event, no [DONE] */
        return;
    server_json_reset();
    if (c->include_usage) {
        cJSON *o = response_head(c, c->chat ? "chat.completion.chunk" : "text_completion");
        cJSON_AddArrayToObject(o, "choices");
        server_json_add(o, "usage", usage_json(g));
        if (!sse_send(c, o))
            return stream_fail(c);
    }
    sbuf_append(&c->out, "data: [DONE]\n\n", 14);
    if (c->out.oom) {
        c->out.oom = false;
        c->tail = "data: [DONE]\n\n";
        c->tail_pos = 0;
    }
}

/* Consume what arrived (at most PULL_MAX at a time, copied on the stack so
 * that draining never allocates): PULL_OVER once the call is over (finished
 * and drained, cut by a stop string, or failed), PULL_EMPTY when nothing has
 * arrived yet (only without wait; wait blocks until something does). */
enum { PULL_MAX = 16 };

static enum pulled pull(struct call *c, cJSON *lp, int *n_new, bool wait)
{
    struct item batch[PULL_MAX];
    *n_new = 0;
    if (c->stopped || c->oom)
        return PULL_OVER;
    pthread_mutex_lock(&c->mu);
    while (wait && c->consumed == c->n_items && !c->finished)
        pthread_cond_wait(&c->cv, &c->mu);
    if (c->consumed == c->n_items && !c->finished) {
        pthread_mutex_unlock(&c->mu);
        return PULL_EMPTY;
    }
    int n = c->n_items - c->consumed;
    if (n > PULL_MAX)
        n = PULL_MAX;
    if (n > 0)
        memcpy(batch, c->items + c->consumed, (size_t)n * sizeof *batch);
    int upto = c->consumed + n;
    bool drained = c->finished && upto == c->n_items;
    bool dropped = c->dropped;
    pthread_mutex_unlock(&c->mu);
    for (int i = 0; i < n && !c->stopped && !c->oom; i++)
        consume(c, &batch[i], lp);
    *n_new = n;
    bool over = c->stopped || c->oom || (drained && (dropped || c->consumed == upto));
    return over ? PULL_OVER : PULL_SOME;
}

/* Produce the next SSE bytes into c->out; false when nothing has arrived
 * (wait: block until something does). */
static bool stream_fill(struct call *c, bool wait)
{
    server_json_reset();
    if (!c->role_sent) {
        c->role_sent = true;
        if (c->chat) {
            if (!sse_send(c, chunk_new(c, "", true, NULL, NULL)))
                stream_fail(c);
            return true;
        }
    }
    cJSON *lp = c->logprobs >= 0 ? lp_new(c) : NULL;
    int n = 0;
    enum pulled p = pull(c, lp, &n, wait);
    if (p == PULL_EMPTY) {
        cJSON_Delete(lp);
        return false;
    }
    if (n > 0 && !c->oom)
        stream_text(c, false, lp);
    else
        cJSON_Delete(lp);
    if (c->oom)
        stream_fail(c);
    else if (p == PULL_OVER)
        stream_end(c);
    return true;
}

/* Copy c's pending SSE bytes (out, then a failure's tail) into buf; 0: none. */
static size_t stream_drain(struct call *c, char *buf, size_t max)
{
    size_t n = c->out.n - c->out_pos;
    const char *src = n ? c->out.p + c->out_pos : "";
    size_t *at = &c->out_pos;
    if (n == 0 && c->tail) {
        src = c->tail + c->tail_pos;
        n = strlen(src);
        at = &c->tail_pos;
    }
    if (n == 0) {
        c->out.n = 0;
        c->out_pos = 0;
        return 0;
    }
    if (n > max)
        n = max;
    memcpy(buf, src, n);
    *at += n;
    return n;
}

/* Serve the next choice that has not ended and has something (round robin,
 * so the choices advance together); once none is left, the stream's end.
 * false: every choice left is still waiting for the scheduler. */
static bool stream_next(struct group *g, bool wait)
{
    bool left = false;
    for (int k = 1; k <= g->n; k++) {
        int i = (g->turn + k) % g->n;
        if (g->calls[i]->done)
            continue;
        left = true;
        if (stream_fill(g->calls[i], wait)) {
            g->turn = i;
            return true;
        }
    }
    if (left)
        return false;
    stream_finish(g);
    return true;
}

/* The response's content reader: the bytes ready now; with nothing ready,
 * the connection sleeps (suspended, no thread held) until the scheduler's
 * next event wakes it. A client that hung up meanwhile ends the stream, and
 * stream_free cancels the request. */
static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void)pos;
    struct group *g = cls;
    for (;;) {
        struct call *c = g->calls[g->turn];
        size_t n = stream_drain(c, buf, max);
        if (n > 0)
            return (ssize_t)n;
        if (g->ended || c->tail) /* a failure's tail ends the stream; server_group_done cancels the rest */
            return MHD_CONTENT_READER_END_OF_STREAM;
        if (g->waker && server_waker_gone(g->waker))
            return MHD_CONTENT_READER_END_WITH_ERROR;
        if (!stream_next(g, !g->waker) && server_waker_sleep(g->waker))
            return 0;
    }
}

static void stream_free(void *cls)
{
    server_group_done(cls);
}

/* A whole reply (wait_poll): consume what has arrived; once every choice
 * is over, or one has failed, the reply. */
static bool whole_poll(void *cls, struct reply *r, ks_status *st)
{
    struct group *g = cls;
    bool over = true;
    struct call *failed = NULL;
    for (int i = 0; i < g->n; i++) {
        struct call *c = g->calls[i];
        if (!choice_over(c, false))
            over = false;
        else if (!failed && choice_failed(c))
            failed = c;
    }
    if (!over && !failed)
        return false;
    *st = failed ? choice_result(failed, r) : server_reply_whole(g, r);
    server_group_done(g);
    return true;
}

static void whole_abort(void *cls)
{
    server_group_done(cls);
}

void server_reply_wait(struct group *g, struct reply *r)
{
    r->status = 200;
    r->wait_poll = whole_poll;
    r->wait_abort = whole_abort;
    r->wait_cls = g;
}

void server_reply_stream(struct group *g, struct reply *r)
{
    r->status = 200;
    r->content_type = "text/event-stream";
    r->stream_read = stream_read;
    r->stream_free = stream_free;
    r->stream_cls = g;
}
