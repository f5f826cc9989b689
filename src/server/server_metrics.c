/* GET /metrics, GET /cache/usage, POST /cache/requantize, POST /cache/policy.
 * Everything that reads or changes the KV cache runs on the scheduler thread
 * between two steps (sched_between_steps), because the cache has one owner. */
#include "server/server_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv/kv.h"

/* ---- /metrics ---------------------------------------------------------------- */

struct kv_snapshot {
    bool have;
    struct kv_usage u;
    struct kv_config cfg;
};

static void snap_kv(void *user, struct kv_cache *kv)
{
    struct kv_snapshot *s = user;
    if (!kv)
        return;
    s->have = true;
    kv_usage(kv, &s->u);
    s->cfg = *kv_get_config(kv);
}

void server_metric(struct sbuf *b, const char *name, const char *type, const char *help, double v)
{
    sbuf_printf(b, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", name, help, name, type, name, v);
}

static void histogram(struct sbuf *b, const char *name, const char *help, const struct sched_hist *h)
{
    sbuf_printf(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    uint64_t cum = 0;
    for (int i = 0; i < SCHED_HIST_BUCKETS; i++) {
        cum += h->counts[i];
        if (isinf(sched_hist_bounds[i]))
            sbuf_printf(b, "%s_bucket{le=\"+Inf\"} %llu\n", name, (unsigned long long)cum);
        else
            sbuf_printf(b, "%s_bucket{le=\"%g\"} %llu\n", name, sched_hist_bounds[i], (unsigned long long)cum);
    }
    sbuf_printf(b, "%s_sum %.9g\n%s_count %llu\n", name, h->sum, name, (unsigned long long)h->n);
}

ks_status server_route_metrics(struct server *srv, const struct server_req *rq, struct reply *r)
{
    (void)rq;
    struct sched_stats st;
    sched_get_stats(srv->sched, &st);
    struct kv_snapshot kv = {0};
    sched_between_steps(srv->sched, snap_kv, &kv);
    struct sbuf b = {0};
    server_metric(&b, "kvserve_requests_running", "gauge", "Requests admitted to the running batch.", st.n_running);
    server_metric(&b, "kvserve_requests_waiting", "gauge", "Requests queued for admission.", st.n_waiting);
    server_metric(&b, "kvserve_requests_total", "counter", "Requests finished (stop, length or error).", (double)st.requests_done);
    server_metric(&b, "kvserve_prompt_tokens_total", "counter", "Prompt tokens computed, recomputation included.", (double)st.prompt_tokens);
    server_metric(&b, "kvserve_generated_tokens_total", "counter", "Tokens generated.", (double)st.generated_tokens);
    server_metric(&b, "kvserve_steps_total", "counter", "Scheduler steps (batches) run.", (double)st.steps);
    server_metric(&b, "kvserve_preemptions_total", "counter", "Sequences preempted (pages freed, recomputed later).", (double)st.preemptions);
    server_metric(&b, "kvserve_forked_choices_total", "counter",
                  "Choices of n > 1 requests started on the first choice's prompt pages (not recomputed).",
                  (double)st.forked_choices);
    server_metric(&b, "kvserve_kv_full_events_total", "counter", "Steps that did not fit the KV cache at first.", (double)st.kv_full_events);
    server_metric(&b, "kvserve_spec_draft_tokens_total", "counter",
                  "Draft tokens verified by the model (speculative decoding).", (double)st.spec_draft_tokens);
    server_metric(&b, "kvserve_spec_accepted_tokens_total", "counter", "Draft tokens the model accepted.",
                  (double)st.spec_accepted_tokens);
    server_metric(&b, "kvserve_spec_verifications_total", "counter",
                  "Verifications (a request's last token and its drafts in one step).", (double)st.spec_verifications);
    server_metric(&b, "kvserve_spec_shadow_checks_total", "counter",
                  "Tokens checked against a one-token proposal while a request did not draft.",
                  (double)st.spec_shadow_checks);
    server_metric(&b, "kvserve_spec_draft_model_forwards_total", "counter", "Forward passes of the draft model (--model-draft).",
                  (double)st.spec_draft_forwards);
    server_metric(&b, "kvserve_spec_draft_model_tokens_total", "counter", "Tokens the draft model computed (--model-draft).",
                  (double)st.spec_draft_model_tokens);
    server_metric(&b, "kvserve_max_step_seconds", "gauge", "Longest scheduler step so far.", st.max_step_seconds);
    if (srv->grammar_vocab) {
        struct grammar_mask_cache_stats gc;
        grammar_vocab_mask_cache_stats(srv->grammar_vocab, &gc);
        server_metric(&b, "kvserve_grammar_mask_cache_hits_total", "counter",
                      "Grammar masks a request took from another request's walk of the vocabulary.", (double)gc.hits);
        server_metric(&b, "kvserve_grammar_mask_cache_misses_total", "counter",
                      "Grammar masks a request had to walk the vocabulary for.", (double)gc.misses);
        server_metric(&b, "kvserve_grammar_mask_cache_bytes", "gauge", "Bytes of shared grammar masks held.",
                      (double)gc.bytes);
    }
    pthread_mutex_lock(&srv->mu);
    double http = (double)srv->http_requests, http_err = (double)srv->http_errors;
    pthread_mutex_unlock(&srv->mu);
    server_metric(&b, "kvserve_http_requests_total", "counter", "HTTP requests answered.", http);
    server_metric(&b, "kvserve_http_errors_total", "counter", "HTTP requests answered with status >= 400.", http_err);
    if (kv.have) {
        server_metric(&b, "kvserve_kv_bytes_used", "gauge", "KV page storage in use.", (double)kv.u.used);
        server_metric(&b, "kvserve_kv_bytes_budget", "gauge", "KV page storage budget (--kv-mem).", (double)kv.u.budget);
        server_metric(&b, "kvserve_kv_usage_ratio", "gauge", "Used / budget.", kv.u.budget ? (double)kv.u.used / (double)kv.u.budget : 0);
        server_metric(&b, "kvserve_kv_tokens", "gauge", "Tokens held in the KV cache.", (double)kv.u.n_tokens);
        server_metric(&b, "kvserve_kv_draft_bytes_used", "gauge",
                      "KV page storage of the draft model (--model-draft), in the same budget.", (double)kv.u.shared_used);
        server_metric(&b, "kvserve_kv_demotions_total", "counter", "Page halves demoted by the dynamic policy.", (double)kv.u.demotions);
        server_metric(&b, "kvserve_kv_window_bytes", "gauge",
                      "Of the KV bytes used, sliding-window layers' rows (freed past each sequence's window).",
                      (double)kv.u.window_bytes);
        sbuf_printf(&b, "# HELP kvserve_kv_pages KV pages by precision of their K or V half.\n# TYPE kvserve_kv_pages gauge\n");
        for (int i = 0; i < KV_N_TYPES; i++) {
            const char *tn = quant_type_name(kv_type_at(i));
            sbuf_printf(&b, "kvserve_kv_pages{half=\"k\",type=\"%s\"} %d\n", tn, kv.u.pages_k[i]);
            sbuf_printf(&b, "kvserve_kv_pages{half=\"v\",type=\"%s\"} %d\n", tn, kv.u.pages_v[i]);
        }
    }
    server_prefix_metrics(srv, &b, &st, kv.have ? &kv.u : NULL);
    server_redis_metrics(srv, &b);
    histogram(&b, "kvserve_ttft_seconds", "Time to first token.", &st.ttft);
    histogram(&b, "kvserve_itl_seconds", "Inter-token latency.", &st.itl);
    if (b.oom || !b.p) {
        sbuf_free(&b);
        return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while writing the metrics");
    }
    return reply_text(r, 200, "text/plain; version=0.0.4", b.p, b.n);
}

static cJSON *policy_json(const struct kv_config *c);

/* ---- /cache/usage -------------------------------------------------------------- */

/* Sliding-window layers: their rows are freed once no query reaches them, so
 * used = global_bytes + window_bytes, and a long sequence grows by a page's
 * global rows only. Zeros and an empty window without them. */
static cJSON *window_json(const struct kv_config *c, const struct kv_usage *u)
{
    cJSON *o = cJSON_CreateObject();
    int n = kv_window_layers(c);
    cJSON_AddNumberToObject(o, "window", n ? c->swa_window : 0);
    cJSON_AddNumberToObject(o, "window_layers", n);
    cJSON_AddNumberToObject(o, "global_layers", c->n_layer - n);
    cJSON_AddNumberToObject(o, "page_window_bytes", (double)kv_page_window_bytes(c, c->type_k, c->type_v));
    cJSON_AddNumberToObject(o, "window_bytes", (double)u->window_bytes);
    cJSON_AddNumberToObject(o, "global_bytes", (double)(u->used - u->window_bytes));
    cJSON_AddNumberToObject(o, "window_pages", u->n_window_pages);
    cJSON_AddNumberToObject(o, "window_frees", (double)u->window_frees);
    return o;
}

static cJSON *types_json(const int32_t *pages)
{
    cJSON *o = cJSON_CreateObject();
    for (int i = 0; i < KV_N_TYPES; i++)
        cJSON_AddNumberToObject(o, quant_type_name(kv_type_at(i)), pages[i]);
    return o;
}

/* One character per KV type, by kv_type_index: F f32, H f16, B bf16, 8 q8_0,
 * R q5_1, 5 q5_0, S q4_1, N iq4_nl, 4 q4_0, 3 iq3_nl (the page's TYPES table reads them). */
static char type_code(enum quant_type t)
{
    static const char codes[KV_N_TYPES + 1] = "FHB8R5SN43";
    int i = kv_type_index(t);
    return i < 0 ? '?' : codes[i];
}

/* The sequence's pages in token order as strings, one character per page:
 * page_map_k / page_map_v (type_code) and page_shared
 * (1 when other sequences hold the page too). Compact for the live page. */
static bool add_page_map(cJSON *e, const struct kv_cache *kv, int32_t seq)
{
    int32_t n = 0;
    if (kv_seq_pages(kv, seq, NULL, 0, &n) != KS_OK || n <= 0)
        return true;
    struct kv_page_info *info = malloc((size_t)n * sizeof *info);
    char *mk = malloc((size_t)n + 1), *mv = malloc((size_t)n + 1), *sh = malloc((size_t)n + 1);
    bool ok = info && mk && mv && sh;
    if (ok && kv_seq_pages(kv, seq, info, n, &n) == KS_OK) {
        int32_t shared = 0;
        for (int32_t i = 0; i < n; i++) {
            mk[i] = type_code(info[i].type_k);
            mv[i] = type_code(info[i].type_v);
            sh[i] = info[i].ref > 1 ? '1' : '0';
            shared += info[i].ref > 1;
        }
        mk[n] = mv[n] = sh[n] = '\0';
        cJSON_AddNumberToObject(e, "shared_pages", shared);
        cJSON_AddStringToObject(e, "page_map_k", mk);
        cJSON_AddStringToObject(e, "page_map_v", mv);
        cJSON_AddStringToObject(e, "page_shared", sh);
    }
    free(info);
    free(mk);
    free(mv);
    free(sh);
    return ok;
}

struct usage_ctx {
    struct server *srv;
    cJSON *out;
    bool oom;                 /* an allocation failed: out has holes */
};

/* Runs on the scheduler thread, so it notes its own JSON allocation failures. */
static void usage_hook(void *user, struct kv_cache *kv)
{
    struct usage_ctx *u = user;
    server_json_reset();
    cJSON *o = cJSON_CreateObject();
    u->out = o;
    enum { MAX_LIST = 1024 };
    struct sched_request_info *reqs = malloc(MAX_LIST * sizeof *reqs);
    u->oom = !reqs;
    int n_req = reqs ? sched_list_requests(u->srv->sched, reqs, MAX_LIST) : 0;
    if (n_req > MAX_LIST)
        n_req = MAX_LIST;
    if (kv) {
        struct kv_usage us;
        kv_usage(kv, &us);
        const struct kv_config *cfg = kv_get_config(kv);
        cJSON_AddNumberToObject(o, "budget", (double)us.budget);
        cJSON_AddNumberToObject(o, "used", (double)us.used);
        cJSON_AddNumberToObject(o, "free", (double)us.free);
        cJSON_AddNumberToObject(o, "draft_used", (double)us.shared_used); /* --model-draft's pages, same budget */
        cJSON_AddNumberToObject(o, "usage_ratio", us.budget ? (double)us.used / (double)us.budget : 0);
        cJSON_AddNumberToObject(o, "n_pages", us.n_pages);
        cJSON_AddNumberToObject(o, "n_seqs", us.n_seqs);
        cJSON_AddNumberToObject(o, "n_tokens", (double)us.n_tokens);
        cJSON_AddNumberToObject(o, "page_tokens", cfg->page_tokens);
        cJSON_AddNumberToObject(o, "page_bytes", (double)kv_page_bytes(cfg, cfg->type_k, cfg->type_v));
        server_json_add(o, "sliding_window", window_json(cfg, &us));
        cJSON_AddStringToObject(o, "type_k", quant_type_name(cfg->type_k));
        cJSON_AddStringToObject(o, "type_v", quant_type_name(cfg->type_v));
        cJSON_AddBoolToObject(o, "rotate", cfg->rotate);
        cJSON_AddBoolToObject(o, "scale_search", cfg->scale_search);
        cJSON_AddStringToObject(o, "smooth", kv_smooth_name(cfg->smooth));
        cJSON_AddStringToObject(o, "policy", cfg->policy == KV_POLICY_DYNAMIC ? "dynamic" : "static");
        server_json_add(o, "kv_policy", policy_json(cfg));
        server_json_add(o, "pages_k", types_json(us.pages_k));
        server_json_add(o, "pages_v", types_json(us.pages_v));
        cJSON_AddNumberToObject(o, "demotions", (double)us.demotions);
        cJSON_AddNumberToObject(o, "demotion_passes", (double)us.demotion_passes);
        struct kv_fit fit;
        kv_fit(kv, &fit);
        cJSON *f = cJSON_AddObjectToObject(o, "fit");
        for (int i = 0; i < KV_N_TYPES; i++)
            cJSON_AddNumberToObject(f, quant_type_name(kv_type_at(i)), (double)fit.tokens[i]);
        cJSON_AddNumberToObject(f, "dynamic", (double)fit.dynamic);
        cJSON_AddNumberToObject(f, "start", (double)fit.start);
        cJSON_AddNumberToObject(f, "chunk", (double)fit.chunk);
        struct sched_stats st;
        sched_get_stats(u->srv->sched, &st);
        server_json_add(o, "prefix", server_prefix_usage_json(&us, &st));
        cJSON *sp = cJSON_AddObjectToObject(o, "speculation"); /* all zero without --spec-type */
        cJSON_AddNumberToObject(sp, "draft_tokens", (double)st.spec_draft_tokens);
        cJSON_AddNumberToObject(sp, "accepted_tokens", (double)st.spec_accepted_tokens);
        cJSON_AddNumberToObject(sp, "verifications", (double)st.spec_verifications);
    }
    server_json_add(o, "disk", server_disk_usage_json(u->srv));
    server_json_add(o, "redis", server_redis_usage_json(u->srv));
    cJSON *list = cJSON_AddArrayToObject(o, "requests");
    for (int i = 0; i < n_req; i++) {
        cJSON *e = cJSON_CreateObject();
        cJSON_AddNumberToObject(e, "id", (double)reqs[i].id);
        cJSON_AddStringToObject(e, "state", reqs[i].running ? "running" : "waiting");
        cJSON_AddNumberToObject(e, "seq", reqs[i].seq);
        cJSON_AddNumberToObject(e, "prompt_tokens", reqs[i].n_prompt);
        cJSON_AddNumberToObject(e, "generated_tokens", reqs[i].n_generated);
        cJSON_AddNumberToObject(e, "cached_tokens", reqs[i].n_cached);
        cJSON_AddNumberToObject(e, "computed_tokens", reqs[i].n_computed);
        struct kv_seq_usage su;
        if (kv && reqs[i].seq >= 0 && kv_seq_usage(kv, reqs[i].seq, &su) == KS_OK) {
            cJSON_AddNumberToObject(e, "pages", su.n_pages);
            cJSON_AddNumberToObject(e, "bytes", (double)su.bytes);
            cJSON_AddNumberToObject(e, "window_bytes", (double)su.window_bytes);
            server_json_add(e, "pages_k", types_json(su.pages_k));
            server_json_add(e, "pages_v", types_json(su.pages_v));
            if (!add_page_map(e, kv, reqs[i].seq))
                u->oom = true;
        }
        server_json_push(list, e);
    }
    free(reqs);
    u->oom |= server_json_failed();
}

/* "requantize": {"running", "pages_done", "pages_total"}: the running (or
 * last) POST /cache/requantize. */
static bool add_requantize_progress(struct server *srv, cJSON *out)
{
    pthread_mutex_lock(&srv->mu);
    bool running = srv->requant_running;
    int32_t done = srv->requant_done, total = srv->requant_total;
    pthread_mutex_unlock(&srv->mu);
    cJSON *o = cJSON_AddObjectToObject(out, "requantize");
    return o && cJSON_AddBoolToObject(o, "running", running) && cJSON_AddNumberToObject(o, "pages_done", done) &&
           cJSON_AddNumberToObject(o, "pages_total", total);
}

ks_status server_route_cache_usage(struct server *srv, const struct server_req *rq, struct reply *r)
{
    (void)rq;
    struct usage_ctx u = {.srv = srv};
    ks_status st = sched_between_steps(srv->sched, usage_hook, &u);
    if (st)
        return reply_fail(r, st, "shutting_down", "%s", ks_errmsg());
    if (!u.oom)
        u.oom = !add_requantize_progress(srv, u.out);
    if (u.oom) {
        cJSON_Delete(u.out);
        return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while reading the cache usage");
    }
    return reply_json(r, 200, u.out);
}

/* ---- /cache/requantize ---------------------------------------------------------- */

struct requant_ctx {
    struct server *srv;
    struct kv_selector sel;
    uint64_t request_id;      /* scope request: resolved to a sequence on the scheduler thread */
    bool by_request;
    enum quant_type tk, tv;
    bool dry_run;
    int32_t pages_per_step;   /* > 0: the slice size asked for; 0: sized by each step's time budget */
    double page_s;            /* measured seconds per converted page, 0 before the first */
    int slices;               /* slices run (0: not started) */
    ks_status st;
    char err[512];
    struct kv_requant_result res;
};

/* Resolve the request id of scope "request" to its sequence (first slice). */
static bool resolve_request(struct requant_ctx *q)
{
    enum { MAX_LIST = 1024 };
    struct sched_request_info *reqs = malloc(MAX_LIST * sizeof *reqs);
    if (!reqs) {
        q->st = KS_ERR_NOMEM;
        snprintf(q->err, sizeof q->err, "out of memory while looking request %llu up",
                 (unsigned long long)q->request_id);
        return false;
    }
    int n = sched_list_requests(q->srv->sched, reqs, MAX_LIST);
    q->sel.seq = -1;
    for (int i = 0; i < n && i < MAX_LIST; i++)
        if (reqs[i].id == q->request_id)
            q->sel.seq = reqs[i].seq;
    free(reqs);
    if (q->sel.seq >= 0)
        return true;
    q->st = KS_ERR_NOT_FOUND;
    snprintf(q->err, sizeof q->err, "request %llu is not holding KV pages (finished, waiting or unknown)",
             (unsigned long long)q->request_id);
    return false;
}

/* Pages for this slice: as many as the measured speed fits in the budget. */
static int32_t slice_pages(const struct requant_ctx *q, double budget_s)
{
    if (q->pages_per_step > 0)
        return q->pages_per_step;
    if (q->page_s <= 0)
        return 1;
    double n = budget_s / q->page_s;
    return n < 1 ? 1 : n > 1e6 ? 1000000 : (int32_t)n;
}

static void note_slice(struct requant_ctx *q, const struct kv_requant_result *r)
{
    if (q->slices++ == 0) {
        q->res.bytes_before = r->bytes_before;
        q->res.pages_selected = r->pages_selected;
    }
    q->res.bytes_after = r->bytes_after;
    q->res.pages_changed += r->pages_changed;
    q->res.ms += r->ms;
    if (r->pages_changed > 0) {
        double per = r->ms * 1e-3 / r->pages_changed;
        q->page_s = q->page_s > 0 ? 0.5 * q->page_s + 0.5 * per : per;
    }
    if (q->dry_run)
        return; /* the progress shown is the running requantization's */
    pthread_mutex_lock(&q->srv->mu);
    q->srv->requant_done = q->res.pages_changed;
    q->srv->requant_total = q->res.pages_changed + r->pages_left;
    pthread_mutex_unlock(&q->srv->mu);
}

/* One slice of a requantization (sched_run_sliced): true when it is done. */
static bool requant_slice(void *user, struct kv_cache *kv, double budget_s)
{
    struct requant_ctx *q = user;
    pthread_mutex_lock(&q->srv->mu);
    bool stop = q->srv->requant_stop;
    pthread_mutex_unlock(&q->srv->mu);
    if (stop) {
        q->st = KS_ERR_STATE;
        snprintf(q->err, sizeof q->err, "the server is stopping");
        return true;
    }
    if (!kv) {
        q->st = KS_ERR_UNSUPPORTED;
        snprintf(q->err, sizeof q->err, "this engine has no KV cache");
        return true;
    }
    if (q->slices == 0 && q->by_request && !resolve_request(q))
        return true;
    q->sel.max_pages = q->dry_run ? 0 : slice_pages(q, budget_s);
    struct kv_requant_result r = {0};
    ks_status st = kv_requantize(kv, &q->sel, q->tk, q->tv, q->dry_run, &r);
    if (st == KS_ERR_NOT_FOUND && q->slices > 0)
        return true; /* the request's sequence ended meanwhile: its pages are done or gone */
    if (st) {
        q->st = st;
        if (q->slices > 0)
            snprintf(q->err, sizeof q->err, "stopped after converting %d pages: %s", (int)q->res.pages_changed,
                     ks_errmsg());
        else
            snprintf(q->err, sizeof q->err, "%s", ks_errmsg());
        if (st == KS_ERR_KV_FULL && q->slices == 0)
            q->res = r; /* it says how much was missing */
        return true;
    }
    note_slice(q, &r);
    return q->dry_run || r.pages_left == 0;
}

static ks_status parse_type(cJSON *root, const char *key, enum quant_type *out, struct reply *r)
{
    cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
    *out = KV_TYPE_KEEP;
    if (!v || cJSON_IsNull(v))
        return KS_OK;
    if (!cJSON_IsString(v) || kv_parse_type(v->valuestring, out) != KS_OK)
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'%s' must be one of %s", key, kv_type_names());
    return KS_OK;
}

static ks_status parse_scope(cJSON *root, struct requant_ctx *q, struct reply *r)
{
    cJSON *scope = cJSON_GetObjectItemCaseSensitive(root, "scope");
    cJSON *older = cJSON_GetObjectItemCaseSensitive(root, "older_than");
    cJSON *req = cJSON_GetObjectItemCaseSensitive(root, "request");
    if (cJSON_IsObject(scope)) { /* also accept "scope": {"older_than": N} / {"request": ID} */
        older = cJSON_GetObjectItemCaseSensitive(scope, "older_than");
        req = cJSON_GetObjectItemCaseSensitive(scope, "request");
        scope = NULL;
    }
    q->sel.kind = KV_SELECT_ALL;
    if (scope && !(cJSON_IsString(scope) && !strcmp(scope->valuestring, "all")))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                          "'scope' must be \"all\" (or give \"older_than\": N or \"request\": ID)");
    if (older) {
        if (!cJSON_IsNumber(older) || older->valuedouble < 0 || older->valuedouble > 1e9 ||
            older->valuedouble != floor(older->valuedouble))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'older_than' must be a token count >= 0");
        q->sel.kind = KV_SELECT_OLDER_THAN;
        q->sel.keep_recent = (int32_t)older->valuedouble;
    }
    if (req) {
        double id = cJSON_IsNumber(req) ? req->valuedouble : cJSON_IsString(req) ? strtod(req->valuestring, NULL) : -1;
        if (id < 1 || id != floor(id))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'request' must be a request id (see /cache/usage)");
        q->sel.kind = KV_SELECT_SEQ;
        q->by_request = true;
        q->request_id = (uint64_t)id;
    }
    return KS_OK;
}

static ks_status parse_pages_per_step(cJSON *root, struct requant_ctx *q, struct reply *r)
{
    cJSON *v = cJSON_GetObjectItemCaseSensitive(root, "pages_per_step");
    if (!v || cJSON_IsNull(v))
        return KS_OK;
    if (!cJSON_IsNumber(v) || v->valuedouble < 1 || v->valuedouble > 1e6 || v->valuedouble != floor(v->valuedouble))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                          "'pages_per_step' must be a whole number of pages from 1 to 1000000 (or leave it out: "
                          "each step then converts what fits in its time budget)");
    q->pages_per_step = (int32_t)v->valuedouble;
    return KS_OK;
}

/* One requantization runs at a time: a second one would convert the same
 * pages and double the stall the slicing avoids. */
static ks_status claim_requantize(struct server *srv, struct reply *r)
{
    pthread_mutex_lock(&srv->mu);
    bool busy = srv->requant_running;
    int32_t done = srv->requant_done, total = srv->requant_total;
    if (!busy) {
        srv->requant_running = true;
        srv->requant_done = srv->requant_total = 0;
    }
    pthread_mutex_unlock(&srv->mu);
    if (!busy)
        return KS_OK;
    r->http_status = 409;
    return reply_fail(r, KS_ERR_STATE, "requantize_running",
                      "a requantization is already running (%d of %d pages done); wait for it to finish "
                      "(GET /cache/usage shows its progress under \"requantize\") and send this one again",
                      (int)done, (int)total);
}

static void release_requantize(struct server *srv)
{
    pthread_mutex_lock(&srv->mu);
    srv->requant_running = false;
    pthread_mutex_unlock(&srv->mu);
}

/* The answer of a requantization that ran (st: how the scheduler ran it). */
static ks_status requant_reply(const struct requant_ctx *q, ks_status st, uint64_t steps, struct reply *r)
{
    if (st)
        return reply_fail(r, st, "shutting_down", "%s", ks_errmsg());
    if (q->st) { /* 404 an unknown request, 409 the cache is full, 500 out of memory, else 400 */
        bool keep = q->st == KS_ERR_NOT_FOUND || q->st == KS_ERR_KV_FULL || q->st == KS_ERR_NOMEM ||
                    q->st == KS_ERR_STATE;
        return reply_fail(r, keep ? q->st : KS_ERR_INVALID_ARG, NULL, "%s", q->err);
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddBoolToObject(o, "dry_run", q->dry_run);
    cJSON_AddNumberToObject(o, "bytes_before", (double)q->res.bytes_before);
    cJSON_AddNumberToObject(o, "bytes_after", (double)q->res.bytes_after);
    cJSON_AddNumberToObject(o, "bytes_freed", (double)q->res.bytes_before - (double)q->res.bytes_after);
    cJSON_AddNumberToObject(o, "pages_selected", q->res.pages_selected);
    cJSON_AddNumberToObject(o, "pages_converted", q->res.pages_changed);
    cJSON_AddNumberToObject(o, "ms", q->res.ms);
    cJSON_AddNumberToObject(o, "slices", q->slices);
    cJSON_AddNumberToObject(o, "steps", (double)steps); /* scheduler steps in between */
    return reply_json(r, 200, o);
}

/* A requantization the connection waits for without holding a polling
 * thread: its own thread waits for the slices and wakes the connection.
 * Shared by the thread and the connection (refs); a client that leaves
 * does not stop it (the cache is converted all the same). */
struct requant_job {
    struct requant_ctx q;
    struct server_waker *waker;
    pthread_mutex_t mu;
    int refs;
    bool finished;
    ks_status st;
    uint64_t steps;
};

static void job_unref(struct requant_job *j)
{
    pthread_mutex_lock(&j->mu);
    bool last = --j->refs == 0;
    pthread_mutex_unlock(&j->mu);
    if (!last)
        return;
    server_waker_unref(j->waker);
    pthread_mutex_destroy(&j->mu);
    free(j);
}

static void *requant_thread(void *arg)
{
    struct requant_job *j = arg;
    struct server *srv = j->q.srv;
    struct sched_stats before, after;
    sched_get_stats(srv->sched, &before);
    ks_status st = sched_run_sliced(srv->sched, requant_slice, &j->q);
    sched_get_stats(srv->sched, &after);
    release_requantize(srv);
    pthread_mutex_lock(&j->mu);
    j->st = st;
    j->steps = after.steps - before.steps;
    j->finished = true;
    pthread_mutex_unlock(&j->mu);
    server_wake(j->waker);
    job_unref(j);
    return NULL;
}

static bool requant_poll(void *cls, struct reply *r, ks_status *st)
{
    struct requant_job *j = cls;
    pthread_mutex_lock(&j->mu);
    bool finished = j->finished;
    pthread_mutex_unlock(&j->mu);
    if (!finished)
        return false;
    *st = requant_reply(&j->q, j->st, j->steps, r);
    job_unref(j);
    return true;
}

static void requant_abort(void *cls) { job_unref(cls); }

static ks_status requant_start(struct server *srv, const struct requant_ctx *q, struct server_waker *waker,
                               struct reply *r)
{
    struct requant_job *j = calloc(1, sizeof *j);
    if (!j) {
        release_requantize(srv);
        return reply_fail(r, KS_ERR_NOMEM, NULL, "out of memory while starting the requantization");
    }
    j->q = *q;
    j->refs = 2; /* the thread and the connection */
    j->waker = waker;
    server_waker_ref(waker);
    pthread_mutex_init(&j->mu, NULL);
    pthread_mutex_lock(&srv->mu); /* the last one's thread has ended or is ending (one runs at a time) */
    bool old = srv->requant_thread_live;
    pthread_t old_thread = srv->requant_thread;
    srv->requant_thread_live = false;
    pthread_mutex_unlock(&srv->mu);
    if (old)
        pthread_join(old_thread, NULL);
    pthread_mutex_lock(&srv->mu);
    int err = srv->requant_stop ? -1 : pthread_create(&srv->requant_thread, NULL, requant_thread, j);
    srv->requant_thread_live = err == 0;
    pthread_mutex_unlock(&srv->mu);
    if (err) {
        j->refs = 1;
        job_unref(j);
        release_requantize(srv);
        return reply_fail(r, KS_ERR_STATE, "shutting_down", "the server is stopping");
    }
    r->status = 200; /* until the poll fills the reply */
    r->wait_poll = requant_poll;
    r->wait_abort = requant_abort;
    r->wait_cls = j;
    return KS_OK;
}

ks_status server_route_requantize(struct server *srv, const struct server_req *rq, struct reply *r)
{
    cJSON *root;
    ks_status st = server_parse_object(rq->body, rq->len, false, &root, r);
    if (st)
        return st;
    struct requant_ctx q = {.srv = srv};
    cJSON *dry = cJSON_GetObjectItemCaseSensitive(root, "dry_run");
    if (!(st = parse_type(root, "type_k", &q.tk, r)) && !(st = parse_type(root, "type_v", &q.tv, r)))
        st = parse_scope(root, &q, r);
    if (!st && dry && !cJSON_IsBool(dry))
        st = reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'dry_run' must be true or false");
    if (!st && q.tk == KV_TYPE_KEEP && q.tv == KV_TYPE_KEEP)
        st = reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "give 'type_k' and/or 'type_v'");
    if (!st)
        st = parse_pages_per_step(root, &q, r);
    q.dry_run = cJSON_IsTrue(dry);
    cJSON_Delete(root);
    if (st)
        return st;
    if (!q.dry_run && (st = claim_requantize(srv, r)))
        return st;
    if (!q.dry_run && rq->waker)
        return requant_start(srv, &q, rq->waker, r);
    struct sched_stats before, after;
    sched_get_stats(srv->sched, &before);
    st = sched_run_sliced(srv->sched, requant_slice, &q);
    sched_get_stats(srv->sched, &after);
    if (!q.dry_run)
        release_requantize(srv);
    return requant_reply(&q, st, after.steps - before.steps, r);
}

void server_requantize_stop(struct server *srv)
{
    pthread_mutex_lock(&srv->mu);
    bool live = srv->requant_thread_live;
    srv->requant_stop = true;
    srv->requant_thread_live = false;
    pthread_mutex_unlock(&srv->mu);
    if (live)
        pthread_join(srv->requant_thread, NULL);
}

/* ---- /cache/policy -------------------------------------------------------------- */

/* ---- /cache/policy -------------------------------------------------------------- */

static double round4(float x)
{
    return round((double)x * 1e4) / 1e4;
}

/* The policy fields of the live configuration; also part of /cache/usage. */
static cJSON *policy_json(const struct kv_config *c)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "policy", c->policy == KV_POLICY_DYNAMIC ? "dynamic" : "static");
    cJSON_AddNumberToObject(o, "high_watermark", round4(c->high_watermark));
    cJSON_AddNumberToObject(o, "low_watermark", round4(c->low_watermark));
    cJSON_AddNumberToObject(o, "hot_tokens", c->hot_tokens);
    cJSON_AddNumberToObject(o, "sink_tokens", c->sink_tokens);
    cJSON_AddStringToObject(o, "floor", quant_type_name(c->floor));
    char ladder[KV_LADDER_MAX * 8] = "q8_0,q4_0";
    for (int i = 0, n = 0; i < c->n_ladder; i++)
        n += snprintf(ladder + n, sizeof ladder - (size_t)n, "%s%s", i ? "," : "", quant_type_name(c->ladder[i]));
    cJSON_AddStringToObject(o, "ladder", ladder);
    cJSON_AddStringToObject(o, "type_k", quant_type_name(c->type_k));
    cJSON_AddStringToObject(o, "type_v", quant_type_name(c->type_v));
    return o;
}

struct policy_ctx {
    struct kv_policy_update u;
    ks_status st;
    char err[512];
    struct kv_config after;
};

static void policy_hook(void *user, struct kv_cache *kv)
{
    struct policy_ctx *p = user;
    if (!kv) {
        p->st = KS_ERR_UNSUPPORTED;
        snprintf(p->err, sizeof p->err, "this engine has no KV cache");
        return;
    }
    p->st = kv_set_policy(kv, &p->u);
    if (p->st)
        snprintf(p->err, sizeof p->err, "%s", ks_errmsg());
    p->after = *kv_get_config(kv);
}

static ks_status bad_field(struct reply *r, const char *key, const char *want)
{
    return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'%s' must be %s", key, want);
}

/* One JSON member into the update; fails on a bad name or value. */
static ks_status parse_policy_field(const cJSON *v, struct kv_policy_update *u, struct reply *r)
{
    const char *k = v->string;
    if (!strcmp(k, "policy")) {
        if (!cJSON_IsString(v) || (strcmp(v->valuestring, "static") && strcmp(v->valuestring, "dynamic")))
            return bad_field(r, k, "\"static\" or \"dynamic\"");
        u->policy = strcmp(v->valuestring, "dynamic") ? KV_POLICY_STATIC : KV_POLICY_DYNAMIC;
        u->set |= KV_SET_POLICY;
    } else if (!strcmp(k, "high_watermark") || !strcmp(k, "low_watermark")) {
        if (!cJSON_IsNumber(v) || !(v->valuedouble > 0 && v->valuedouble <= 1))
            return bad_field(r, k, "a usage ratio in (0, 1]");
        bool high = !strcmp(k, "high_watermark");
        *(high ? &u->high_watermark : &u->low_watermark) = (float)v->valuedouble;
        u->set |= high ? KV_SET_HIGH_WATERMARK : KV_SET_LOW_WATERMARK;
    } else if (!strcmp(k, "hot_tokens") || !strcmp(k, "sink_tokens")) {
        if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble > (1 << 24) || v->valuedouble != floor(v->valuedouble))
            return bad_field(r, k, "a whole number of tokens in 0..16777216");
        bool hot = !strcmp(k, "hot_tokens");
        *(hot ? &u->hot_tokens : &u->sink_tokens) = (int32_t)v->valuedouble;
        u->set |= hot ? KV_SET_HOT_TOKENS : KV_SET_SINK_TOKENS;
    } else if (!strcmp(k, "floor") || !strcmp(k, "type_k") || !strcmp(k, "type_v")) {
        enum quant_type t;
        if (!cJSON_IsString(v) || kv_parse_type(v->valuestring, &t) != KS_OK)
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'%s' must be one of %s", k, kv_type_names());
        if (!strcmp(k, "floor")) {
            u->floor = t;
            u->set |= KV_SET_FLOOR;
        } else if (!strcmp(k, "type_k")) {
            u->type_k = t;
            u->set |= KV_SET_TYPE_K;
        } else {
            u->type_v = t;
            u->set |= KV_SET_TYPE_V;
        }
    } else if (!strcmp(k, "ladder")) {
        struct kv_config parsed;
        kv_config_default(&parsed);
        if (!cJSON_IsString(v) || kv_parse_ladder(v->valuestring, &parsed) != KS_OK)
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                              "'ladder' must be KV types in falling precision separated by commas, e.g. "
                              "\"f16,q8_0,q5_0,q4_0\" (the order is %s)", kv_type_names());
        memcpy(u->ladder, parsed.ladder, sizeof u->ladder);
        u->n_ladder = parsed.n_ladder;
        u->set |= KV_SET_LADDER;
    } else {
        return reply_fail(r, KS_ERR_INVALID_ARG, "unknown_field",
                          "unknown field '%s' (known: policy, high_watermark, low_watermark, hot_tokens, "
                          "sink_tokens, floor, ladder, type_k, type_v)", k);
    }
    return KS_OK;
}

ks_status server_route_policy(struct server *srv, const struct server_req *rq, struct reply *r)
{
    cJSON *root;
    ks_status st = server_parse_object(rq->body, rq->len, false, &root, r);
    if (st)
        return st;
    struct policy_ctx p = {0};
    for (const cJSON *v = root->child; v && !st; v = v->next)
        st = parse_policy_field(v, &p.u, r);
    cJSON_Delete(root);
    if (st)
        return st;
    if ((st = sched_between_steps(srv->sched, policy_hook, &p)))
        return reply_fail(r, st, "shutting_down", "%s", ks_errmsg());
    if (p.st) { /* 501 without a KV cache, 500 out of memory, else 400 (a rejected combination) */
        bool keep = p.st == KS_ERR_UNSUPPORTED || p.st == KS_ERR_NOMEM;
        return reply_fail(r, keep ? p.st : KS_ERR_INVALID_ARG, "invalid_value", "%s", p.err);
    }
    return reply_json(r, 200, policy_json(&p.after));
}
