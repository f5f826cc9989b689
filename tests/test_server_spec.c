/* Speculative decoding through the completion routes (server_dispatch, the
 * built-in default model, the real engine): a greedy answer is the same text
 * with and without --spec-type ngram, also under a JSON grammar (drafts are
 * verified through the grammar matcher); usage carries draft_tokens and
 * accepted_tokens, in the whole answer and in a stream's usage chunk;
 * speculative.n_max 0 turns it off for one request; bad speculative fields
 * get a 400 naming them; /metrics counts the drafts. Skipped without the
 * model. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "sched/sched.h"
#include "server/server_internal.h"
#include "support/model_server.h"
#include "support/skip.h"

static struct {
    struct model_server ms;
    struct sched *plain_sched, *spec_sched;
    struct server *plain, *spec;
} F;

/* The body of a reply, whole or a stream's bytes. */
static char *body_of(struct reply *r, unsigned *status)
{
    *status = r->status;
    struct sbuf b = {0};
    if (!r->stream_read) {
        sbuf_append(&b, r->body, r->len);
    } else {
        char buf[4096];
        ssize_t k;
        while ((k = r->stream_read(r->stream_cls, b.n, buf, sizeof buf)) > 0)
            sbuf_append(&b, buf, (size_t)k);
    }
    sbuf_append(&b, "", 1);
    reply_free(r);
    return b.p;
}

static char *request(struct server *srv, const char *method, const char *path, const char *body, unsigned *status)
{
    struct server_req rq = {.method = method, .path = path, .body = body, .len = body ? strlen(body) : 0};
    struct reply r = {0};
    server_dispatch(srv, &rq, &r);
    return body_of(&r, status);
}

static cJSON *post_json(struct server *srv, const char *path, const char *body, unsigned want_status)
{
    unsigned status = 0;
    char *text = request(srv, "POST", path, body, &status);
    if (status != want_status)
        print_message("status %u: %s\n", status, text);
    assert_int_equal(status, want_status);
    cJSON *j = cJSON_Parse(text);
    free(text);
    assert_non_null(j);
    return j;
}

static const char *text_of(const cJSON *j)
{
    const cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    const cJSON *t = cJSON_GetObjectItem(ch, "text");
    if (!t)
        t = cJSON_GetObjectItem(cJSON_GetObjectItem(ch, "message"), "content");
    return cJSON_IsString(t) ? t->valuestring : "";
}

static int usage_of(const cJSON *j, const char *key)
{
    const cJSON *v = cJSON_GetObjectItem(cJSON_GetObjectItem(j, "usage"), key);
    assert_non_null(v);
    return (int)v->valuedouble;
}

/* ---- tests ---------------------------------------------------------------------- */

static void test_greedy_text_unchanged(void **state)
{
    (void)state;
    static const char *bodies[] = {
        "{\"prompt\":\"Once upon a time there was a dog. Once upon a time\",\"temperature\":0,\"max_tokens\":60}",
        "{\"prompt\":\"abc abc abc abc\",\"temperature\":0,\"max_tokens\":60,\"ignore_eos\":true}",
    };
    int drafted = 0, accepted = 0;
    for (size_t i = 0; i < sizeof bodies / sizeof *bodies; i++) {
        cJSON *a = post_json(F.plain, "/v1/completions", bodies[i], 200);
        cJSON *b = post_json(F.spec, "/v1/completions", bodies[i], 200);
        assert_string_equal(text_of(a), text_of(b));
        assert_int_equal(usage_of(a, "completion_tokens"), usage_of(b, "completion_tokens"));
        assert_int_equal(usage_of(a, "draft_tokens"), 0);
        assert_int_equal(usage_of(a, "accepted_tokens"), 0);
        drafted += usage_of(b, "draft_tokens");
        accepted += usage_of(b, "accepted_tokens");
        cJSON_Delete(a);
        cJSON_Delete(b);
    }
    print_message("drafted %d, accepted %d\n", drafted, accepted);
    assert_true(accepted > 0 && accepted <= drafted);
}

/* A JSON grammar: a draft the grammar forbids is rejected by the matcher's
 * mask, so the constrained greedy answer is the same. */
static void test_grammar_unchanged(void **state)
{
    (void)state;
    const char *body = "{\"messages\":[{\"role\":\"user\",\"content\":\"An object please\"}],\"temperature\":0,"
                       "\"max_tokens\":120,\"response_format\":{\"type\":\"json_object\"}}";
    cJSON *a = post_json(F.plain, "/v1/chat/completions", body, 200);
    cJSON *b = post_json(F.spec, "/v1/chat/completions", body, 200);
    assert_string_equal(text_of(a), text_of(b));
    print_message("grammar: drafted %d, accepted %d\n", usage_of(b, "draft_tokens"), usage_of(b, "accepted_tokens"));
    cJSON_Delete(a);
    cJSON_Delete(b);
}

/* llama.cpp's other samplers keep drafting on: DRY reads the history
 * verification passes (the drafts kept so far), mirostat's mu and XTC's coin
 * advance only by the token each step returns. Greedy through them, the text
 * is the same with and without speculation, and DRY does change it. */
static void test_samplers_with_drafts(void **state)
{
    (void)state;
    static const char *extra[] = {
        "\"dry_multiplier\":3,\"dry_allowed_length\":1,\"dry_penalty_last_n\":-1",
        "\"dry_multiplier\":3,\"dry_allowed_length\":2,\"samplers\":[\"dry\",\"top_k\",\"temperature\"]",
        "\"mirostat\":2,\"mirostat_tau\":3",
        "\"typical_p\":0.5,\"min_keep\":2,\"xtc_probability\":0.5,\"xtc_threshold\":0.05,\"seed\":5",
    };
    const char *plain_body = "{\"prompt\":\"abc abc abc abc\",\"temperature\":0,\"max_tokens\":60,\"ignore_eos\":true}";
    cJSON *none = post_json(F.plain, "/v1/completions", plain_body, 200);
    for (size_t i = 0; i < sizeof extra / sizeof *extra; i++) {
        char body[512];
        snprintf(body, sizeof body,
                 "{\"prompt\":\"abc abc abc abc\",\"temperature\":0,\"max_tokens\":60,\"ignore_eos\":true,%s}",
                 extra[i]);
        cJSON *a = post_json(F.plain, "/v1/completions", body, 200);
        cJSON *b = post_json(F.spec, "/v1/completions", body, 200);
        /* XTC's coin comes from the request's stream, which verification reads differently:
         * the same distribution, not the same tokens */
        if (!strstr(extra[i], "xtc"))
            assert_string_equal(text_of(a), text_of(b));
        assert_int_equal(usage_of(a, "completion_tokens"), 60);
        assert_int_equal(usage_of(b, "completion_tokens"), 60);
        if (i == 0)
            assert_string_not_equal(text_of(a), text_of(none));
        print_message("samplers case %zu: drafted %d, accepted %d\n", i, usage_of(b, "draft_tokens"),
                      usage_of(b, "accepted_tokens"));
        cJSON_Delete(a);
        cJSON_Delete(b);
    }
    cJSON_Delete(none);
}

static void test_stream_usage_and_per_request_off(void **state)
{
    (void)state;
    const char *stream = "{\"prompt\":\"abc abc abc abc\",\"temperature\":0,\"max_tokens\":40,\"ignore_eos\":true,"
                         "\"stream\":true,\"stream_options\":{\"include_usage\":true}}";
    unsigned status = 0;
    char *sse = request(F.spec, "POST", "/v1/completions", stream, &status);
    assert_int_equal(status, 200);
    const char *u = strstr(sse, "\"usage\":{");
    assert_non_null(u);
    const char *line_end = strchr(u, '\n');
    char *d = strstr(u, "\"draft_tokens\":"), *acc = strstr(u, "\"accepted_tokens\":");
    assert_true(d && acc && (!line_end || (d < line_end && acc < line_end)));
    assert_true(atoi(acc + strlen("\"accepted_tokens\":")) > 0);
    free(sse);

    const char *off = "{\"prompt\":\"abc abc abc abc\",\"temperature\":0,\"max_tokens\":40,\"ignore_eos\":true,"
                      "\"speculative\":{\"n_max\":0}}";
    cJSON *j = post_json(F.spec, "/v1/completions", off, 200);
    assert_int_equal(usage_of(j, "draft_tokens"), 0);
    cJSON_Delete(j);
    const char *capped = "{\"prompt\":\"abc abc abc abc\",\"temperature\":0,\"max_tokens\":40,\"ignore_eos\":true,"
                         "\"speculative\":{\"n_max\":2,\"n_min\":1}}";
    j = post_json(F.spec, "/v1/completions", capped, 200);
    assert_true(usage_of(j, "draft_tokens") > 0);
    cJSON_Delete(j);
}

static void test_bad_speculative_fields(void **state)
{
    (void)state;
    static const char *bad[][2] = {
        {"\"speculative\":3", "'speculative' must be an object"},
        {"\"speculative\":{\"n_max\":65}", "'speculative.n_max' must be in [0, 64]"},
        {"\"speculative\":{\"n_min\":1.5}", "'speculative.n_min' must be an integer"},
        {"\"speculative\":{\"n_max\":2,\"n_min\":3}", "'speculative.n_min' (3) must not be above"},
        {"\"speculative\":{\"n_min\":20}", "n_min in 0..n_max (got n_max 16, n_min 20"}, /* above --draft-max */
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char body[256];
        snprintf(body, sizeof body, "{\"prompt\":\"hi\",\"max_tokens\":2,%s}", bad[i][0]);
        unsigned status = 0;
        char *text = request(F.spec, "POST", "/v1/completions", body, &status);
        assert_int_equal(status, 400);
        if (!strstr(text, bad[i][1]))
            fail_msg("'%s' gave %s", bad[i][0], text);
        free(text);
    }
}

static void test_metrics_count_drafts(void **state)
{
    (void)state;
    unsigned status = 0;
    char *m = request(F.spec, "GET", "/metrics", NULL, &status);
    assert_int_equal(status, 200);
    const char *d = strstr(m, "\nkvserve_spec_draft_tokens_total ");
    const char *a = strstr(m, "\nkvserve_spec_accepted_tokens_total ");
    assert_non_null(d);
    assert_non_null(a);
    double drafted = strtod(d + strlen("\nkvserve_spec_draft_tokens_total "), NULL);
    double accepted = strtod(a + strlen("\nkvserve_spec_accepted_tokens_total "), NULL);
    assert_true(accepted > 0);
    free(m);
    /* the same figures in /cache/usage, for the live page */
    char *u = request(F.spec, "GET", "/cache/usage", NULL, &status);
    assert_int_equal(status, 200);
    cJSON *j = cJSON_Parse(u);
    const cJSON *sp = cJSON_GetObjectItem(j, "speculation");
    assert_non_null(sp);
    assert_true(cJSON_GetObjectItem(sp, "draft_tokens")->valuedouble >= drafted);
    assert_true(cJSON_GetObjectItem(sp, "accepted_tokens")->valuedouble >= accepted);
    cJSON_Delete(j);
    free(u);
}

/* ---- setup -------------------------------------------------------------------------- */

static int setup(void **state)
{
    (void)state;
    if (model_server_load(getenv("KVSERVE_DEFAULT_MODEL"), &F.ms))
        return -1;
    struct model_server_config mc = {.model = F.ms.model, .tok = F.ms.tok, .pool = F.ms.pool, .kv_budget = 64u << 20,
                                     .parallel = 4, .ctx_size = 1024};
    if (model_server_start(&mc, &F.plain_sched, &F.plain))
        return -1;
    mc.spec_type = SPEC_NGRAM;
    mc.draft_min = 1; /* draft whatever the measured costs (a tiny model's extra token costs nearly a step) */
    return model_server_start(&mc, &F.spec_sched, &F.spec);
}

static int teardown(void **state)
{
    (void)state;
    model_server_stop(F.plain_sched, F.plain);
    model_server_stop(F.spec_sched, F.spec);
    model_server_unload(&F.ms);
    return 0;
}

int main(void)
{
    const char *path = getenv("KVSERVE_DEFAULT_MODEL");
    if (!path || access(path, R_OK) != 0)
        return ks_skip_all("the default model (KVSERVE_DEFAULT_MODEL=%s) is not built", path ? path : "");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_text_unchanged),
        cmocka_unit_test(test_grammar_unchanged),
        cmocka_unit_test(test_samplers_with_drafts),
        cmocka_unit_test(test_stream_usage_and_per_request_off),
        cmocka_unit_test(test_bad_speculative_fields),
        cmocka_unit_test(test_metrics_count_drafts),
    };
    return ks_run_tests(tests, setup, teardown);
}
