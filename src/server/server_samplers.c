/* llama.cpp's other samplers on the completion routes: a request's
 * typical_p, min_keep, top_n_sigma, dynatemp_*, xtc_*, dry_*, mirostat*,
 * samplers (and repeat_last_n / presence / frequency defaults), over the
 * server-wide defaults of llama-server's flags (--typical, --dry-multiplier,
 * --mirostat, --samplers, ...). Field names, defaults and quirks are
 * llama-server's (tools/server: params_from_json), with one difference: a
 * name it would drop with a warning (an unknown sampler) is a 400 here. */
#include "server/server_completion_internal.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sample/sample.h"

/* llama.cpp's default DRY sequence breakers */
static const char *const default_breakers[] = {"\n", ":", "\"", "*"};

void server_samplers_default(struct server_samplers *d)
{
    memset(d, 0, sizeof *d);
    sample_params_default(&d->p);
    d->n_dry_breakers = -1;
}

/* ---- the server-wide flags ---------------------------------------------------- */

static bool parse_num(const char *v, double lo, double hi, bool integer, double *out)
{
    char *end = NULL;
    double x = v ? strtod(v, &end) : 0;
    if (!v || end == v || *end || !(x >= lo && x <= hi) || (integer && x != floor(x)))
        return false;
    *out = x;
    return true;
}

/* "a;b;c" of stage names (llama-server's alternative names too) or, with
 * chars, llama.cpp's one-letter sequence ("edkypmxt"). */
static bool parse_order(const char *v, bool chars, struct sample_params *p)
{
    static const char letters[] = "edskypmxt"; /* in enum sample_stage order, from PENALTIES */
    int n = 0;
    if (chars) {
        for (const char *c = v; *c; c++) {
            const char *at = strchr(letters, *c);
            if (!at || n == SAMPLE_MAX_STAGES)
                return false;
            p->order[n++] = (enum sample_stage)(SAMPLE_STAGE_PENALTIES + (at - letters));
        }
    } else {
        char name[32];
        for (const char *s = v; *s;) {
            size_t len = strcspn(s, ";");
            if (len == 0 || len >= sizeof name || n == SAMPLE_MAX_STAGES)
                return false;
            memcpy(name, s, len);
            name[len] = 0;
            if (!sample_stage_from_name(name, &p->order[n++]))
                return false;
            s += len + (s[len] == ';');
        }
    }
    p->n_order = n;
    return n > 0;
}

bool server_samplers_flag(const char *a, const char *v, struct server_samplers *d, bool *ok)
{
    struct sample_params *p = &d->p;
    double x = 0;
    static const struct {
        const char *flag, *alt;
        double lo, hi;
        bool integer;
    } nums[] = {
        {"--typical", "--typical-p", -1e9, 1e9, false},
        {"--min-keep", NULL, 0, 1e9, true},
        {"--top-nsigma", "--top-n-sigma", -1e9, 1e9, false},
        {"--dynatemp-range", NULL, 0, 1e9, false},
        {"--dynatemp-exp", NULL, -1e9, 1e9, false},
        {"--xtc-probability", NULL, 0, 1, false},
        {"--xtc-threshold", NULL, 0, 1e9, false},
        {"--dry-multiplier", NULL, -1e9, 1e9, false},
        {"--dry-base", NULL, -1e9, 1e9, false},
        {"--dry-allowed-length", NULL, 0, 1e9, true},
        {"--dry-penalty-last-n", NULL, -1, 1e9, true},
        {"--mirostat", NULL, 0, 2, true},
        {"--mirostat-lr", NULL, -1e9, 1e9, false},
        {"--mirostat-ent", NULL, -1e9, 1e9, false},
        {"--repeat-last-n", NULL, -1, 1e9, true},
        {"--presence-penalty", NULL, -2, 2, false},
        {"--frequency-penalty", NULL, -2, 2, false},
    };
    for (size_t i = 0; i < sizeof nums / sizeof nums[0]; i++) {
        if (strcmp(a, nums[i].flag) && (!nums[i].alt || strcmp(a, nums[i].alt)))
            continue;
        *ok = parse_num(v, nums[i].lo, nums[i].hi, nums[i].integer, &x);
        if (!*ok)
            return true;
        switch (i) {
        case 0: p->typical_p = x <= 0 ? FLT_MIN : (float)x; break; /* 0 keeps the most typical token, as in llama.cpp */
        case 1: p->min_keep = (int)x; break;
        case 2: p->top_n_sigma = (float)x; break;
        case 3: p->dynatemp_range = (float)x; break;
        case 4: p->dynatemp_exponent = (float)x; break;
        case 5: p->xtc_probability = (float)x; break;
        case 6: p->xtc_threshold = (float)x; break;
        case 7: p->dry_multiplier = (float)x; break;
        case 8: p->dry_base = x >= 1 ? (float)x : p->dry_base; break; /* llama.cpp ignores a base below 1 */
        case 9: p->dry_allowed_length = (int)x; break;
        case 10: p->dry_penalty_last_n = (int)x; break;
        case 11: p->mirostat = (int)x; break;
        case 12: p->mirostat_eta = (float)x; break;
        case 13: p->mirostat_tau = (float)x; break;
        case 14: p->repeat_last_n = (int)x; d->set |= SERVER_SAMPLERS_REPEAT_LAST_N; break;
        case 15: p->presence_penalty = (float)x; d->set |= SERVER_SAMPLERS_PRESENCE; break;
        default: p->frequency_penalty = (float)x; d->set |= SERVER_SAMPLERS_FREQUENCY; break;
        }
        return true;
    }
    if (!strcmp(a, "--samplers") || !strcmp(a, "--sampler-seq") || !strcmp(a, "--sampling-seq")) {
        *ok = v && parse_order(v, strcmp(a, "--samplers") != 0, p);
        return true;
    }
    if (!strcmp(a, "--dry-sequence-breaker")) { /* the first one replaces the defaults; "none": no breakers */
        *ok = v && *v && d->n_dry_breakers < SERVER_MAX_DRY_BREAKERS;
        if (*ok && d->n_dry_breakers < 0)
            d->n_dry_breakers = 0;
        if (*ok && !strcmp(v, "none"))
            d->n_dry_breakers = 0;
        else if (*ok)
            d->dry_breakers[d->n_dry_breakers++] = v;
        return true;
    }
    return false;
}

/* ---- a request's fields ---------------------------------------------------------- */

static cJSON *field(const cJSON *root, const char *key)
{
    cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
    return cJSON_IsNull(v) ? NULL : v;
}

static ks_status number(const cJSON *root, const char *key, double lo, double hi, bool integer, double *out,
                        struct reply *r)
{
    cJSON *v = field(root, key);
    if (!v)
        return KS_OK;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || (integer && v->valuedouble != floor(v->valuedouble)))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'%s' must be %s", key,
                          integer ? "an integer" : "a number");
    if (v->valuedouble < lo || v->valuedouble > hi)
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'%s' must be in [%g, %g] (got %g)", key, lo, hi,
                          v->valuedouble);
    *out = v->valuedouble;
    return KS_OK;
}

/* "samplers": llama.cpp's names in order, or a string of its letters. */
static ks_status request_order(const cJSON *root, struct sample_params *p, struct reply *r)
{
    cJSON *v = field(root, "samplers");
    if (!v)
        return KS_OK;
    if (cJSON_IsString(v)) {
        if (!parse_order(v->valuestring, true, p))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                              "'samplers' as a string is llama.cpp's letters, at most %d of e d s k y p m x t "
                              "(got '%.40s')", SAMPLE_MAX_STAGES, v->valuestring);
        return KS_OK;
    }
    if (!cJSON_IsArray(v))
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'samplers' must be an array of sampler names");
    int n = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, v) {
        enum sample_stage st;
        if (!cJSON_IsString(e))
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type", "'samplers' must be an array of sampler names");
        if (n == SAMPLE_MAX_STAGES)
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "'samplers' takes at most %d names",
                              SAMPLE_MAX_STAGES);
        /* a request takes the canonical names only, as llama-server's params_from_json */
        if (!sample_stage_from_name(e->valuestring, &st) || strcmp(sample_stage_name(st), e->valuestring))
            return reply_fail(r, KS_ERR_INVALID_ARG, "unsupported_parameter",
                              "'samplers': '%.40s' is not a sampler kvserve has; use penalties, dry, top_n_sigma, "
                              "top_k, typ_p, top_p, min_p, xtc, temperature",
                              e->valuestring);
        p->order[n++] = st;
    }
    p->n_order = n;
    if (n == 0) /* llama-server: no sampler at all but the draw */
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                          "'samplers' is empty; leave it out for the default order");
    return KS_OK;
}

struct vocab_user {
    const struct tokenizer *tok;
    char *piece;
};

/* A token's text as llama.cpp's detokenize of that token alone: control
 * tokens as their text, SPM's leading space dropped. */
static ks_status vocab_piece(void *user, int32_t id, const char **bytes, size_t *len)
{
    struct vocab_user *u = user;
    free(u->piece);
    u->piece = NULL;
    ks_status st = tok_decode(u->tok, &id, 1, TOK_DECODE_SPECIAL, &u->piece, len);
    *bytes = u->piece;
    return st;
}

static ks_status vocab_tokenize(void *user, const char *text, size_t len, int32_t **ids, size_t *n)
{
    struct vocab_user *u = user;
    return tok_encode(u->tok, text, len, 0, ids, n);
}

static ks_status build_breakers(struct call *c, const char *const *breakers, int n, struct sample_params *p,
                                struct reply *r)
{
    struct vocab_user u = {c->srv->tok, NULL};
    ks_status st = sample_dry_breakers_create(breakers, n, tok_n_vocab(c->srv->tok), vocab_piece, vocab_tokenize,
                                              &u, &c->dry_breakers);
    free(u.piece);
    if (st)
        return reply_fail(r, st == KS_ERR_NOMEM ? st : KS_ERR_INTERNAL, NULL, "DRY sequence breakers: %s",
                          ks_errmsg());
    p->dry_breakers = c->dry_breakers;
    return KS_OK;
}

/* "dry_sequence_breakers" (a non-empty array of strings, as llama-server
 * requires), else the server's, processed only when DRY is on. */
static ks_status request_breakers(struct call *c, const cJSON *root, struct sample_params *p, struct reply *r)
{
    cJSON *v = field(root, "dry_sequence_breakers");
    const char *list[SERVER_MAX_DRY_BREAKERS];
    int n = 0;
    if (v) {
        const cJSON *e;
        if (!cJSON_IsArray(v) || cJSON_GetArraySize(v) == 0)
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                              "'dry_sequence_breakers' must be a non-empty array of strings");
        cJSON_ArrayForEach(e, v) {
            if (!cJSON_IsString(e))
                return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_type",
                                  "'dry_sequence_breakers' must be a non-empty array of strings");
            if (n == SERVER_MAX_DRY_BREAKERS)
                return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                                  "'dry_sequence_breakers' takes at most %d strings", SERVER_MAX_DRY_BREAKERS);
            list[n++] = e->valuestring;
        }
    }
    if (!(p->dry_multiplier != 0.0f && p->dry_base >= 1.0f && p->dry_penalty_last_n != 0))
        return KS_OK;
    if (v)
        return build_breakers(c, list, n, p, r);
    const struct server_samplers *d = c->srv->cfg.samplers;
    if (d && d->n_dry_breakers >= 0)
        return d->n_dry_breakers > 0 ? build_breakers(c, d->dry_breakers, d->n_dry_breakers, p, r) : KS_OK;
    return build_breakers(c, default_breakers, 4, p, r);
}

ks_status server_parse_samplers(struct call *c, const cJSON *root, struct sample_params *p, struct reply *r)
{
    struct server_samplers def;
    const struct server_samplers *d = c->srv->cfg.samplers;
    if (!d) {
        server_samplers_default(&def);
        d = &def;
    }
    const struct sample_params *q = &d->p;
    /* the server's --repeat-last-n / penalties where the request names none */
    if (!field(root, "repeat_last_n") && (d->set & SERVER_SAMPLERS_REPEAT_LAST_N))
        p->repeat_last_n = q->repeat_last_n;
    if (!field(root, "presence_penalty") && (d->set & SERVER_SAMPLERS_PRESENCE))
        p->presence_penalty = q->presence_penalty;
    if (!field(root, "frequency_penalty") && (d->set & SERVER_SAMPLERS_FREQUENCY))
        p->frequency_penalty = q->frequency_penalty;
    double typ = q->typical_p, keep = q->min_keep, sigma = q->top_n_sigma, dyn_r = q->dynatemp_range,
           dyn_e = q->dynatemp_exponent, xtc_p = q->xtc_probability, xtc_t = q->xtc_threshold,
           dry_m = q->dry_multiplier, dry_b = q->dry_base, dry_a = q->dry_allowed_length,
           dry_n = q->dry_penalty_last_n, miro = q->mirostat, tau = q->mirostat_tau, eta = q->mirostat_eta;
    ks_status st;
    if ((st = number(root, "typical_p", -1e9, 1e9, false, &typ, r)) ||
        (st = number(root, "min_keep", 0, 1e9, true, &keep, r)) ||
        (st = number(root, "top_n_sigma", -1e9, 1e9, false, &sigma, r)) ||
        (st = number(root, "dynatemp_range", 0, 1e9, false, &dyn_r, r)) ||
        (st = number(root, "dynatemp_exponent", -1e9, 1e9, false, &dyn_e, r)) ||
        (st = number(root, "xtc_probability", 0, 1, false, &xtc_p, r)) ||
        (st = number(root, "xtc_threshold", 0, 1e9, false, &xtc_t, r)) ||
        (st = number(root, "dry_multiplier", -1e9, 1e9, false, &dry_m, r)) ||
        (st = number(root, "dry_base", -1e9, 1e9, false, &dry_b, r)) ||
        (st = number(root, "dry_allowed_length", 0, 1e9, true, &dry_a, r)) ||
        (st = number(root, "dry_penalty_last_n", -1, 1e9, true, &dry_n, r)) ||
        (st = number(root, "mirostat", 0, 2, true, &miro, r)) ||
        (st = number(root, "mirostat_tau", -1e9, 1e9, false, &tau, r)) ||
        (st = number(root, "mirostat_eta", -1e9, 1e9, false, &eta, r)))
        return st;
    p->typical_p = typ <= 0 ? FLT_MIN : (float)typ; /* 0 keeps the most typical token, as in llama.cpp */
    p->min_keep = (int)keep;
    p->top_n_sigma = (float)sigma;
    p->dynatemp_range = (float)dyn_r;
    p->dynatemp_exponent = (float)dyn_e;
    p->xtc_probability = (float)xtc_p;
    p->xtc_threshold = (float)xtc_t;
    p->dry_multiplier = (float)dry_m;
    p->dry_base = dry_b >= 1.0 ? (float)dry_b : q->dry_base; /* llama-server: a base below 1 is the default */
    p->dry_allowed_length = (int)dry_a;
    p->dry_penalty_last_n = (int)dry_n; /* -1: the whole history, llama-server's context-sized window */
    p->mirostat = (int)miro;
    p->mirostat_tau = (float)tau;
    p->mirostat_eta = (float)eta;
    p->n_order = q->n_order;
    memcpy(p->order, q->order, sizeof p->order);
    if ((st = request_order(root, p, r)))
        return st;
    return request_breakers(c, root, p, r);
}

void server_samplers_props(const struct server *srv, cJSON *params)
{
    struct server_samplers def;
    const struct server_samplers *d = srv->cfg.samplers;
    if (!d) {
        server_samplers_default(&def);
        d = &def;
    }
    const struct sample_params *p = &d->p;
    cJSON_AddNumberToObject(params, "typical_p", p->typical_p);
    cJSON_AddNumberToObject(params, "min_keep", p->min_keep);
    cJSON_AddNumberToObject(params, "top_n_sigma", p->top_n_sigma);
    cJSON_AddNumberToObject(params, "dynatemp_range", p->dynatemp_range);
    cJSON_AddNumberToObject(params, "dynatemp_exponent", p->dynatemp_exponent);
    cJSON_AddNumberToObject(params, "xtc_probability", p->xtc_probability);
    cJSON_AddNumberToObject(params, "xtc_threshold", p->xtc_threshold);
    cJSON_AddNumberToObject(params, "dry_multiplier", p->dry_multiplier);
    cJSON_AddNumberToObject(params, "dry_base", p->dry_base);
    cJSON_AddNumberToObject(params, "dry_allowed_length", p->dry_allowed_length);
    cJSON_AddNumberToObject(params, "dry_penalty_last_n", p->dry_penalty_last_n);
    cJSON_AddNumberToObject(params, "mirostat", p->mirostat);
    cJSON_AddNumberToObject(params, "mirostat_tau", p->mirostat_tau);
    cJSON_AddNumberToObject(params, "mirostat_eta", p->mirostat_eta);
    cJSON *br = cJSON_AddArrayToObject(params, "dry_sequence_breakers");
    const char *const *list = d->n_dry_breakers >= 0 ? d->dry_breakers : default_breakers;
    int n = d->n_dry_breakers >= 0 ? d->n_dry_breakers : 4;
    for (int i = 0; br && i < n; i++)
        cJSON_AddItemToArray(br, cJSON_CreateString(list[i]));
    cJSON *order = cJSON_AddArrayToObject(params, "samplers");
    enum sample_stage def_order[SAMPLE_MAX_STAGES];
    const enum sample_stage *o = p->n_order > 0 ? p->order : def_order;
    int n_order = p->n_order > 0 ? p->n_order : sample_default_order(def_order);
    for (int i = 0; order && i < n_order; i++)
        cJSON_AddItemToArray(order, cJSON_CreateString(sample_stage_name(o[i])));
}
