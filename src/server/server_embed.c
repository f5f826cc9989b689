/* POST /v1/embeddings (OpenAI's shape) and POST /embeddings (llama-server's
 * own shape), under --embeddings.
 *
 * 'input' is a string, a list of token ids, or a list of strings and token-id
 * lists (llama-server's /embeddings also takes 'content'). Strings are
 * tokenized as llama-server tokenizes them (BOS/EOS as the vocabulary says,
 * special tokens written in the text parsed); token ids are taken as they
 * are. Each input is one scheduler request (sched_request.embed), so inputs
 * are batched with each other and with generation; the reply waits for all
 * of them. Vectors are normalized as llama-server's embd_normalize says
 * (default 2, Euclidean). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"
#include "server/server_internal.h"

/* OpenAI's limit on the inputs of one request. */
#define EMBED_MAX_INPUTS 2048

struct embed_job;

/* One input: where its final event lands. */
struct embed_slot {
    struct embed_job *job;
    int index;
    uint64_t sched_id;
    bool submitted, done;
};

struct embed_job {
    struct server *srv;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;                  /* the HTTP side and one per submitted input until its final event */
    int n, n_done;             /* inputs; final events received */
    struct embed_slot *slots;  /* (n) */
    int32_t **prompts;         /* (n) token ids of each input, until submitted */
    int32_t *n_tokens;         /* (n) */
    float *embd;               /* (n, n_embd) */
    char error[256];           /* the first input that failed, "" none */
    struct server_waker *waker;
    /* options */
    bool native;               /* llama-server's /embeddings shape */
    bool base64;               /* encoding_format base64: little-endian f32 bytes */
    int normalize;             /* embd_normalize */
};

static void job_unref(struct embed_job *j)
{
    pthread_mutex_lock(&j->mu);
    int left = --j->refs;
    pthread_mutex_unlock(&j->mu);
    if (left > 0)
        return;
    for (int i = 0; i < j->n; i++)
        free(j->prompts ? j->prompts[i] : NULL);
    if (j->waker)
        server_waker_unref(j->waker);
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    free(j->prompts);
    free(j->n_tokens);
    free(j->slots);
    free(j->embd);
    free(j);
}

static struct embed_job *job_new(struct server *srv, int n)
{
    struct embed_job *j = calloc(1, sizeof *j);
    if (!j)
        return NULL;
    j->srv = srv;
    j->refs = 1;
    j->n = n;
    j->normalize = 2;
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    j->slots = calloc((size_t)n, sizeof *j->slots);
    j->prompts = calloc((size_t)n, sizeof *j->prompts);
    j->n_tokens = calloc((size_t)n, sizeof *j->n_tokens);
    j->embd = malloc((size_t)n * (size_t)srv->cfg.n_embd * sizeof *j->embd);
    if (!j->slots || !j->prompts || !j->n_tokens || !j->embd) {
        job_unref(j);
        return NULL;
    }
    for (int i = 0; i < n; i++)
        j->slots[i] = (struct embed_slot){.job = j, .index = i};
    return j;
}

/* Scheduler thread: an input's final event, with its embedding or why it failed. */
static void on_event(void *user, const struct sched_event *ev)
{
    struct embed_slot *slot = user;
    struct embed_job *j = slot->job;
    if (ev->finish == SCHED_FINISH_NONE)
        return;
    int dim = j->srv->cfg.n_embd;
    pthread_mutex_lock(&j->mu);
    if (ev->embd)
        memcpy(j->embd + (size_t)slot->index * dim, ev->embd, (size_t)dim * sizeof *j->embd);
    else if (!j->error[0])
        snprintf(j->error, sizeof j->error, "input %d: %s", slot->index,
                 ev->error ? ev->error : ev->finish == SCHED_FINISH_CANCELLED ? "cancelled" : "no embedding");
    slot->done = true;
    j->n_done++;
    pthread_cond_broadcast(&j->cv);
    if (j->waker)
        server_wake(j->waker);
    pthread_mutex_unlock(&j->mu);
    job_unref(j);
}

/* ---- parsing ---------------------------------------------------------------------- */

static cJSON *field(const cJSON *root, const char *key)
{
    cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
    return cJSON_IsNull(v) ? NULL : v;
}

/* A list of token ids: every item an integer in the vocabulary. */
static bool is_id_list(const cJSON *v)
{
    if (!cJSON_IsArray(v))
        return false;
    for (const cJSON *e = v->child; e; e = e->next)
        if (!cJSON_IsNumber(e))
            return false;
    return true;
}

/* One input (a string or a token-id list) into ids. */
static ks_status input_tokens(struct server *srv, const cJSON *v, int index, int32_t **ids, int32_t *n,
                              struct reply *r)
{
    if (cJSON_IsString(v)) {
        size_t len = 0;
        ks_status st = tok_encode(srv->tok, v->valuestring, strlen(v->valuestring), TOK_ADD_SPECIAL | TOK_PARSE_SPECIAL,
                                  ids, &len);
        if (st)
            return reply_fail(r, st, NULL, "input %d: %s", index, ks_errmsg());
        if (len > INT32_MAX / 2) {
            free(*ids), *ids = NULL;
            return reply_fail(r, KS_ERR_RANGE, "invalid_value", "input %d is too long", index);
        }
        *n = (int32_t)len;
    } else if (is_id_list(v)) {
        int count = cJSON_GetArraySize(v);
        *ids = malloc((size_t)(count > 0 ? count : 1) * sizeof **ids);
        if (!*ids)
            return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory reading the input");
        int k = 0;
        int32_t n_vocab = tok_n_vocab(srv->tok);
        for (const cJSON *e = v->child; e; e = e->next, k++) {
            double d = e->valuedouble;
            if (!(d >= 0 && d < n_vocab && d == floor(d))) {
                free(*ids), *ids = NULL;
                return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                                  "input %d: token %d (%g) is not a token id of this model (0..%d)", index, k, d,
                                  n_vocab - 1);
            }
            (*ids)[k] = (int32_t)d;
        }
        *n = k;
    } else {
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type",
                          "input %d must be a string or a list of token ids", index);
    }
    if (*n == 0) {
        free(*ids), *ids = NULL;
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "input %d is empty (no tokens)", index);
    }
    return KS_OK;
}

/* 'input' (or llama-server's 'content'): the list of inputs it stands for. A
 * string or a token-id list is one input; a list of them is several. */
static ks_status inputs_of(const cJSON *root, bool native, const cJSON **list, bool *single, struct reply *r)
{
    const cJSON *in = field(root, "input");
    if (!in && native)
        in = field(root, "content");
    if (!in)
        return reply_fail(r, KS_ERR_INVALID_ARG, "missing_field", native ? "'input' or 'content' is required"
                                                                         : "'input' is required");
    *single = cJSON_IsString(in) || (is_id_list(in) && cJSON_GetArraySize(in) > 0);
    *list = in;
    if (!*single && !cJSON_IsArray(in))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type",
                          "'input' must be a string, a list of token ids, or a list of strings and token-id lists");
    int n = *single ? 1 : cJSON_GetArraySize(in);
    if (n < 1 || n > EMBED_MAX_INPUTS)
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'input' must hold 1 to %d inputs (got %d)",
                          EMBED_MAX_INPUTS, n);
    return KS_OK;
}

/* The fields other than the inputs, checked; a value kvserve cannot honour
 * (dimensions other than the model's) is refused by name. Unknown fields are
 * ignored, as the completion routes (and OpenAI's and llama-server's APIs)
 * ignore them. */
static ks_status parse_options(struct server *srv, const cJSON *root, struct embed_job *j, struct reply *r)
{
    const cJSON *v = field(root, "model");
    if (v && !cJSON_IsString(v))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'model' must be a string");
    if (v && !j->native && !server_model_served(srv, v->valuestring)) /* as the completion routes: 404 */
        return reply_fail(r, KS_ERR_NOT_FOUND, "model_not_found",
                          "'model' is '%.200s' but this server serves '%s' (see GET /v1/models; --alias names it)",
                          v->valuestring, srv->model_name);
    if ((v = field(root, "encoding_format"))) {
        if (!cJSON_IsString(v) || (strcmp(v->valuestring, "float") && strcmp(v->valuestring, "base64")))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'encoding_format' must be float or base64");
        j->base64 = !strcmp(v->valuestring, "base64");
    }
    if ((v = field(root, "dimensions"))) {
        if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'dimensions' must be an integer");
        if (v->valuedouble != srv->cfg.n_embd)
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                              "'dimensions' %g is not supported: this model's embeddings have %d dimensions and "
                              "kvserve does not shorten them", v->valuedouble, (int)srv->cfg.n_embd);
    }
    if ((v = field(root, "embd_normalize"))) {
        if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || v->valuedouble < -1 ||
            v->valuedouble > 64)
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                              "'embd_normalize' must be an integer in -1..64 (-1 none, 0 max-abs int16, 1 taxicab, "
                              "2 Euclidean, p > 2 p-norm)");
        j->normalize = (int)v->valuedouble;
    }
    if ((v = field(root, "user")) && !cJSON_IsString(v))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'user' must be a string");
    return KS_OK;
}

/* ---- the answer ---------------------------------------------------------------------- */

static char *base64_encode(const unsigned char *p, size_t n)
{
    static const char alphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    char *out = malloc((n + 2) / 3 * 4 + 1), *o = out;
    if (!out)
        return NULL;
    for (size_t i = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)p[i] << 16 | (i + 1 < n ? (uint32_t)p[i + 1] << 8 : 0) | (i + 2 < n ? p[i + 2] : 0);
        *o++ = alphabet[v >> 18 & 63];
        *o++ = alphabet[v >> 12 & 63];
        *o++ = i + 1 < n ? alphabet[v >> 6 & 63] : '=';
        *o++ = i + 2 < n ? alphabet[v & 63] : '=';
    }
    *o = 0;
    return out;
}

/* One vector as JSON: a list of numbers, or base64 of its little-endian f32 bytes. */
static cJSON *vector_json(const float *v, int dim, bool base64)
{
    if (!base64) {
        cJSON *a = cJSON_CreateArray();
        for (int i = 0; a && i < dim; i++)
            server_json_push(a, cJSON_CreateNumber((double)v[i]));
        return a;
    }
    unsigned char *bytes = malloc((size_t)dim * 4);
    if (!bytes)
        return NULL;
    for (int i = 0; i < dim; i++) {
        uint32_t u;
        memcpy(&u, &v[i], 4);
        for (int b = 0; b < 4; b++)
            bytes[4 * i + b] = (unsigned char)(u >> (8 * b));
    }
    char *text = base64_encode(bytes, (size_t)dim * 4);
    free(bytes);
    cJSON *s = text ? cJSON_CreateString(text) : NULL;
    free(text);
    return s;
}

static ks_status reply_embeddings(struct embed_job *j, struct reply *r)
{
    if (j->error[0])
        return reply_fail(r, KS_ERR_INTERNAL, NULL, "%s", j->error);
    int dim = j->srv->cfg.n_embd;
    int64_t n_tokens = 0;
    cJSON *data = cJSON_CreateArray();
    for (int i = 0; i < j->n; i++) {
        float *v = j->embd + (size_t)i * dim;
        model_embd_normalize(v, dim, j->normalize);
        n_tokens += j->n_tokens[i];
        cJSON *item = cJSON_CreateObject();
        cJSON *vec = vector_json(v, dim, j->base64);
        if (j->native) { /* llama-server's /embeddings: one list of vectors per input (one when pooled) */
            cJSON *one = cJSON_CreateArray();
            server_json_push(one, vec);
            vec = one;
        }
        server_json_add(item, "index", cJSON_CreateNumber(i));
        server_json_add(item, "embedding", vec);
        if (!j->native)
            server_json_add(item, "object", cJSON_CreateString("embedding"));
        if (!j->native && j->base64) /* as llama-server marks it */
            server_json_add(item, "encoding_format", cJSON_CreateString("base64"));
        server_json_push(data, item);
    }
    if (j->native)
        return reply_json(r, 200, data);
    cJSON *o = cJSON_CreateObject();
    server_json_add(o, "object", cJSON_CreateString("list"));
    server_json_add(o, "data", data);
    server_json_add(o, "model", cJSON_CreateString(j->srv->model_name));
    cJSON *usage = cJSON_CreateObject();
    server_json_add(usage, "prompt_tokens", cJSON_CreateNumber((double)n_tokens));
    server_json_add(usage, "total_tokens", cJSON_CreateNumber((double)n_tokens));
    server_json_add(o, "usage", usage);
    return reply_json(r, 200, o);
}

/* ---- waiting ------------------------------------------------------------------------- */

static bool all_done(struct embed_job *j)
{
    for (int i = 0; i < j->n; i++)
        if (j->slots[i].submitted && !j->slots[i].done)
            return false;
    return true;
}

/* The HTTP side lets go: inputs still running are cancelled. */
static void job_release(struct embed_job *j)
{
    pthread_mutex_lock(&j->mu);
    for (int i = 0; i < j->n; i++)
        if (j->slots[i].submitted && !j->slots[i].done)
            sched_cancel(j->srv->sched, j->slots[i].sched_id);
    pthread_mutex_unlock(&j->mu);
    struct server *srv = j->srv;
    pthread_mutex_lock(&srv->mu);
    srv->in_flight--;
    pthread_mutex_unlock(&srv->mu);
    job_unref(j);
}

static bool job_poll(void *cls, struct reply *r, ks_status *st)
{
    struct embed_job *j = cls;
    pthread_mutex_lock(&j->mu);
    bool done = all_done(j);
    pthread_mutex_unlock(&j->mu);
    if (!done)
        return false;
    server_json_reset();
    *st = reply_embeddings(j, r);
    job_release(j);
    return true;
}

static void job_abort(void *cls) { job_release(cls); }

/* Submit every input; the slots' lock is held so no event arrives before
 * sched_id is set. */
static ks_status job_submit(struct embed_job *j, struct reply *r)
{
    for (int i = 0; i < j->n; i++) {
        struct sched_request rq = {.prompt = j->prompts[i], .n_prompt = j->n_tokens[i], .on_event = on_event,
                                   .user = &j->slots[i], .embed = true};
        pthread_mutex_lock(&j->mu);
        j->refs++;
        ks_status st = sched_submit(j->srv->sched, &rq, &j->slots[i].sched_id);
        if (st)
            j->refs--;
        else
            j->slots[i].submitted = true;
        pthread_mutex_unlock(&j->mu);
        free(j->prompts[i]);
        j->prompts[i] = NULL;
        if (st == KS_ERR_STATE) {
            r->retry_after = 1;
            return reply_fail(r, st, "overloaded", "%s", ks_errmsg());
        }
        if (st)
            return reply_fail(r, st, st == KS_ERR_UNSUPPORTED ? "not_supported" : "invalid_value", "input %d: %s", i,
                              ks_errmsg());
    }
    return KS_OK;
}

static ks_status parse_job(struct server *srv, const struct server_req *rq, bool native, struct embed_job **out,
                           struct reply *r)
{
    cJSON *root;
    ks_status st = server_parse_object(rq->body, rq->len, false, &root, r);
    if (st)
        return st;
    const cJSON *list = NULL;
    bool single = false;
    struct embed_job *j = NULL;
    if (!(st = inputs_of(root, native, &list, &single, r)) &&
        !(j = job_new(srv, single ? 1 : cJSON_GetArraySize(list))))
        st = reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while starting the request");
    if (j)
        j->native = native;
    if (!st)
        st = parse_options(srv, root, j, r);
    const cJSON *item = single ? list : list ? list->child : NULL;
    for (int i = 0; !st && i < (j ? j->n : 0); i++, item = single ? NULL : item->next)
        st = input_tokens(srv, item, i, &j->prompts[i], &j->n_tokens[i], r);
    cJSON_Delete(root);
    if (st && j)
        job_unref(j);
    *out = st ? NULL : j;
    return st;
}

static ks_status embeddings(struct server *srv, const struct server_req *rq, struct reply *r, bool native)
{
    if (!srv->cfg.embeddings)
        return reply_fail(r, KS_ERR_UNSUPPORTED, "not_supported",
                          "this server does not compute embeddings: start kvserve serve with --embeddings");
    struct embed_job *j = NULL;
    ks_status st = parse_job(srv, rq, native, &j, r);
    if (st)
        return st;
    pthread_mutex_lock(&srv->mu);
    srv->in_flight++;
    pthread_mutex_unlock(&srv->mu);
    if ((st = job_submit(j, r))) {
        job_release(j);
        return st;
    }
    if (rq->waker) { /* answered when every input is done, no thread held meanwhile */
        server_waker_ref(rq->waker);
        pthread_mutex_lock(&j->mu);
        j->waker = rq->waker;
        pthread_mutex_unlock(&j->mu);
        r->status = 200;
        r->wait_poll = job_poll;
        r->wait_abort = job_abort;
        r->wait_cls = j;
        return KS_OK;
    }
    pthread_mutex_lock(&j->mu);
    while (!all_done(j))
        pthread_cond_wait(&j->cv, &j->mu);
    pthread_mutex_unlock(&j->mu);
    st = reply_embeddings(j, r);
    job_release(j);
    return st;
}

ks_status server_route_embeddings(struct server *srv, const struct server_req *rq, struct reply *r)
{
    return embeddings(srv, rq, r, false);
}

ks_status server_route_embeddings_native(struct server *srv, const struct server_req *rq, struct reply *r)
{
    return embeddings(srv, rq, r, true);
}
