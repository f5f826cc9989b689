/* The router's pieces without a network: the KV events' encoding (an XADD's
 * fields parse back to the event), the index built from events (snapshots,
 * deltas, epochs, gaps, the overlap of a chain), and the equality that makes
 * routing work: the chain keys the router computes for a request (its own
 * tokenization and chat template, kv_layout_keys over a snapshot's layout,
 * cache_salt included) are the keys a replica's cache gives the same prompt,
 * salted and not (the build's default model: its tokenizer and a cache of
 * its shape). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf/gguf.h"
#include "kv/kv.h"
#include "model/model.h"
#include "route/route.h"
#include "store/store.h"
#include "support/skip.h"
#include "tokenizer/tokenizer.h"

static void put_key(uint8_t *out, uint64_t lo, uint64_t hi)
{
    for (int b = 0; b < 8; b++) {
        out[b] = (uint8_t)(lo >> (8 * b));
        out[8 + b] = (uint8_t)(hi >> (8 * b));
    }
}

/* ---- the entry codec ------------------------------------------------------------ */

static void test_event_round_trip(void **state)
{
    (void)state;
    uint8_t keys[3 * 16], layout[40];
    for (int i = 0; i < 3; i++)
        put_key(keys + 16 * i, 0x1111111111111111ull * (uint64_t)(i + 1), 0xabcdef0000000000ull + (uint64_t)i);
    for (int i = 0; i < 40; i++)
        layout[i] = (uint8_t)(i * 7);
    const char *url = "http://10.0.0.7:8080";
    for (int op = STORE_EVENT_ADD; op <= STORE_EVENT_SNAP; op++) {
        struct store_event ev = {.replica = url, .replica_len = strlen(url), .epoch = 1234567890123ull, .seq = 42,
                                 .op = (enum store_event_op)op, .keys = keys, .n_keys = 3, .layout = layout,
                                 .layout_len = sizeof layout, .page_tokens = 64};
        const char *argv[24];
        size_t lens[24];
        char scratch[64];
        int argc = store_event_argv("kvserve:events:00", 500, &ev, scratch, argv, lens);
        assert_int_equal(argc, op == STORE_EVENT_SNAP ? 20 : 16);
        assert_string_equal(argv[0], "XADD");
        assert_string_equal(argv[4], "500");
        assert_string_equal(argv[5], "*");
        struct store_event back;
        assert_int_equal(store_event_parse(argv + 6, lens + 6, (size_t)argc - 6, &back), KS_OK);
        assert_int_equal(back.replica_len, strlen(url));
        assert_memory_equal(back.replica, url, strlen(url));
        assert_true(back.epoch == ev.epoch && back.seq == 42 && (int)back.op == op && back.n_keys == 3);
        assert_memory_equal(back.keys, keys, sizeof keys);
        if (op == STORE_EVENT_SNAP) {
            assert_int_equal(back.page_tokens, 64);
            assert_int_equal(back.layout_len, sizeof layout);
            assert_memory_equal(back.layout, layout, sizeof layout);
        } else {
            assert_null(back.layout);
        }
    }
}

static void test_event_parse_refuses(void **state)
{
    (void)state;
    struct store_event ev;
    const char *no_op[] = {"replica", "u", "epoch", "1", "seq", "1", "keys", ""};
    size_t no_op_len[] = {7, 1, 5, 1, 3, 1, 4, 0};
    assert_int_equal(store_event_parse(no_op, no_op_len, 8, &ev), KS_ERR_FORMAT);
    const char *odd[] = {"replica", "u", "epoch", "1", "seq", "1", "op", "add", "keys", "abc"};
    size_t odd_len[] = {7, 1, 5, 1, 3, 1, 2, 3, 4, 3};
    assert_int_equal(store_event_parse(odd, odd_len, 10, &ev), KS_ERR_FORMAT);
    assert_non_null(strstr(ks_errmsg(), "multiple of 16"));
    const char *bad_seq[] = {"replica", "u", "epoch", "1", "seq", "-1", "op", "add", "keys", ""};
    size_t bad_seq_len[] = {7, 1, 5, 1, 3, 2, 2, 3, 4, 0};
    assert_int_equal(store_event_parse(bad_seq, bad_seq_len, 10, &ev), KS_ERR_FORMAT);
    const char *snap[] = {"replica", "u", "epoch", "1", "seq", "1", "op", "snap", "keys", ""};
    size_t snap_len[] = {7, 1, 5, 1, 3, 1, 2, 4, 4, 0};
    assert_int_equal(store_event_parse(snap, snap_len, 10, &ev), KS_ERR_FORMAT); /* no layout */
}

/* ---- the index ------------------------------------------------------------------- */

static struct store_event event(enum store_event_op op, uint64_t epoch, uint64_t seq, const uint8_t *keys, size_t n)
{
    static const uint8_t layout[36] = {1, 2, 3};
    return (struct store_event){.replica = "r", .replica_len = 1, .epoch = epoch, .seq = seq, .op = op, .keys = keys,
                                .n_keys = n, .layout = op == STORE_EVENT_SNAP ? layout : NULL,
                                .layout_len = op == STORE_EVENT_SNAP ? sizeof layout : 0,
                                .page_tokens = op == STORE_EVENT_SNAP ? 32 : 0};
}

static void test_index_follows_events(void **state)
{
    (void)state;
    enum { N = 3000 }; /* past the first table's growth */
    uint8_t *bytes = malloc(N * 16);
    struct kv_key *chain = malloc(N * sizeof *chain);
    for (int i = 0; i < N; i++) {
        chain[i] = (struct kv_key){0x9e3779b97f4a7c15ull * (uint64_t)(i + 1), (uint64_t)i};
        put_key(bytes + 16 * i, chain[i].lo, chain[i].hi);
    }
    struct route_index *ix = NULL;
    assert_int_equal(route_index_create(2, &ix), KS_OK);
    struct kv_key_layout lay;
    assert_false(route_index_layout(ix, 0, &lay));
    /* replica 0: a snapshot of the first 10 pages, then 20 more, then page 5 is evicted */
    struct store_event ev = event(STORE_EVENT_SNAP, 7, 1, bytes, 10);
    assert_int_equal(route_index_apply(ix, 0, &ev), KS_OK);
    assert_true(route_index_layout(ix, 0, &lay));
    assert_int_equal(lay.page_tokens, 32);
    assert_int_equal(lay.n_bytes, 36);
    assert_int_equal(route_index_overlap(ix, 0, chain, N), 10);
    assert_int_equal(route_index_overlap(ix, 1, chain, N), 0);
    ev = event(STORE_EVENT_ADD, 7, 2, bytes + 16 * 10, 20);
    assert_int_equal(route_index_apply(ix, 0, &ev), KS_OK);
    assert_int_equal(route_index_overlap(ix, 0, chain, N), 30);
    ev = event(STORE_EVENT_DEL, 7, 3, bytes + 16 * 5, 1);
    assert_int_equal(route_index_apply(ix, 0, &ev), KS_OK);
    assert_int_equal(route_index_overlap(ix, 0, chain, N), 5); /* from the first page to the first miss */
    /* replica 1 holds them all; deleting its keys leaves replica 0's */
    ev = event(STORE_EVENT_ADD, 9, 1, bytes, N);
    assert_int_equal(route_index_apply(ix, 1, &ev), KS_OK);
    assert_int_equal(route_index_overlap(ix, 1, chain, N), N);
    ev = event(STORE_EVENT_DEL, 9, 2, bytes, N);
    assert_int_equal(route_index_apply(ix, 1, &ev), KS_OK);
    assert_int_equal(route_index_overlap(ix, 1, chain, N), 0);
    assert_int_equal(route_index_overlap(ix, 0, chain, N), 5);
    struct route_replica_info info;
    route_index_info(ix, 0, &info);
    assert_true(info.keys == 29 && info.events == 3 && info.gaps == 0 && info.snapshots == 1);
    /* a lost entry is a gap; the next snapshot replaces everything */
    ev = event(STORE_EVENT_ADD, 7, 9, bytes + 16 * 5, 1);
    assert_int_equal(route_index_apply(ix, 0, &ev), KS_OK);
    route_index_info(ix, 0, &info);
    assert_int_equal(info.gaps, 1);
    ev = event(STORE_EVENT_SNAP, 7, 10, bytes + 16 * 100, 3);
    assert_int_equal(route_index_apply(ix, 0, &ev), KS_OK);
    assert_int_equal(route_index_overlap(ix, 0, chain, N), 0);
    assert_int_equal(route_index_overlap(ix, 0, chain + 100, 3), 3);
    /* a restart (a new epoch) drops the old state and waits for its layout */
    ev = event(STORE_EVENT_ADD, 8, 1, bytes, 2);
    assert_int_equal(route_index_apply(ix, 0, &ev), KS_OK);
    assert_int_equal(route_index_overlap(ix, 0, chain + 100, 3), 0);
    assert_int_equal(route_index_overlap(ix, 0, chain, 3), 2);
    assert_false(route_index_layout(ix, 0, &lay));
    route_index_forget(ix, 0);
    assert_int_equal(route_index_overlap(ix, 0, chain, 3), 0);
    assert_int_equal(route_index_apply(ix, 2, &ev), KS_ERR_INVALID_ARG);
    route_index_free(ix);
    free(bytes);
    free(chain);
}

/* ---- the router's keys are the replicas' -------------------------------------------------- */

static char g_model[4096];

static bool find_model(void)
{
    const char *bin = getenv("KVSERVE_BIN");
    if (!bin)
        return false;
    char copy[4096];
    snprintf(copy, sizeof copy, "%s", bin);
    snprintf(g_model, sizeof g_model, "%s/default-model.gguf", dirname(copy));
    FILE *f = fopen(g_model, "rb");
    if (f)
        fclose(f);
    return f != NULL;
}

struct captured {
    struct kv_key keys[64];
    int n;
};

static void on_key(void *user, struct kv_key key, bool held)
{
    struct captured *c = user;
    if (held && c->n < 64)
        c->keys[c->n++] = key;
}

/* The keys a cache of the model's shape gives a sequence computing ids under salt. */
static void cache_keys(const struct gguf_file *f, struct kv_key salt, const int32_t *ids, int32_t n,
                       struct captured *out, struct kv_key_layout *lay)
{
    struct kv_config cfg;
    kv_config_default(&cfg);
    cfg.n_layer = 2;
    cfg.n_kv_head = 2;
    cfg.head_dim = 64;
    cfg.mem_budget = (size_t)64 * kv_page_bytes(&cfg, QUANT_F16, QUANT_F16);
    model_file_fingerprint(f, false, cfg.fingerprint);
    struct kv_cache *kv = NULL;
    assert_int_equal(kv_create(&cfg, &kv), KS_OK);
    kv_set_key_hook(kv, on_key, out);
    int32_t seq = -1;
    assert_int_equal(kv_seq_create(kv, &seq), KS_OK);
    assert_int_equal(kv_seq_set_salt(kv, seq, salt), KS_OK);
    assert_int_equal(kv_seq_grow(kv, seq, n), KS_OK);
    float k[128] = {0}, v[128] = {0};
    for (int32_t p = 0; p < n; p++)
        for (int l = 0; l < cfg.n_layer; l++)
            assert_int_equal(kv_write(kv, l, seq, p, k, v), KS_OK);
    assert_int_equal(kv_seq_publish(kv, seq, ids, n), KS_OK);
    kv_key_layout(kv, lay);
    kv_free(kv);
}

static void check_request(struct route_prompt *rp, const struct tokenizer *tok, const struct gguf_file *f,
                          const char *path, const char *body, const char *salt_text)
{
    int32_t *ids = NULL;
    size_t n = 0;
    struct kv_key salt;
    assert_int_equal(route_prompt_tokens(rp, path, body, strlen(body), &ids, &n, &salt), KS_OK);
    assert_true(n >= 64);
    struct kv_key want_salt = salt_text ? kv_cache_salt(salt_text, strlen(salt_text)) : (struct kv_key){0, 0};
    assert_true(kv_key_equal(salt, want_salt));
    struct captured got = {0};
    struct kv_key_layout lay;
    cache_keys(f, want_salt, ids, (int32_t)n, &got, &lay);
    int32_t n_pages = (int32_t)n / lay.page_tokens;
    assert_int_equal(got.n, n_pages);
    struct kv_key keys[64];
    kv_layout_keys(&lay, salt, ids, (int32_t)n, keys);
    for (int32_t i = 0; i < n_pages; i++)
        assert_true(kv_key_equal(keys[i], got.keys[i]));
    (void)tok;
    free(ids);
}

/* The router's tokens of body on path equal want's. */
static void expect_tokens(struct route_prompt *rp, const char *path, const char *body, const int32_t *want,
                          size_t n_want)
{
    int32_t *ids = NULL;
    size_t n = 0;
    struct kv_key salt;
    assert_int_equal(route_prompt_tokens(rp, path, body, strlen(body), &ids, &n, &salt), KS_OK);
    assert_int_equal(n, n_want);
    assert_memory_equal(ids, want, n * sizeof *ids);
    free(ids);
}

static void test_route_keys_are_the_replicas(void **state)
{
    (void)state;
    if (!find_model())
        KS_SKIP("no default-model.gguf beside $KVSERVE_BIN (run through ctest after building default_model)");
    struct gguf_file *f = NULL;
    struct tokenizer *tok = NULL;
    struct route_prompt *rp = NULL;
    assert_int_equal(gguf_open(g_model, &f), KS_OK);
    assert_int_equal(tok_load(f, &tok), KS_OK);
    assert_int_equal(route_prompt_create(tok, NULL, 4096, false, &rp), KS_OK);
    char text[4096] = "";
    for (int i = 0; i < 120; i++)
        snprintf(text + strlen(text), sizeof text - strlen(text), "w%d ", i);
    char body[8192];
    /* a completion's prompt: tokenized as the replica does (BOS, special tokens parsed) */
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":4}", text);
    int32_t *ids = NULL, *want = NULL;
    size_t n = 0, n_want = 0;
    struct kv_key salt;
    assert_int_equal(route_prompt_tokens(rp, "/v1/completions?x=1", body, strlen(body), &ids, &n, &salt), KS_OK);
    assert_int_equal(tok_encode(tok, text, strlen(text), TOK_ADD_SPECIAL | TOK_PARSE_SPECIAL, &want, &n_want), KS_OK);
    assert_int_equal(n, n_want);
    assert_memory_equal(ids, want, n * sizeof *ids);
    free(ids);
    free(want);
    check_request(rp, tok, f, "/v1/completions", body, NULL);
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"cache_salt\":\"tenant-7\"}", text);
    check_request(rp, tok, f, "/completion", body, "tenant-7");
    snprintf(body, sizeof body,
             "{\"messages\":[{\"role\":\"system\",\"content\":\"%s\"},{\"role\":\"user\",\"content\":\"hi\"}]}", text);
    check_request(rp, tok, f, "/v1/chat/completions", body, NULL);
    snprintf(body, sizeof body,
             "{\"cache_salt\":\"s\",\"messages\":[{\"role\":\"user\",\"content\":"
             "[{\"type\":\"text\",\"text\":\"%s\"}]}]}",
             text);
    check_request(rp, tok, f, "/v1/chat/completions", body, "s");
    /* Anthropic's /v1/messages renders as the chat it translates to (system first, text blocks joined) */
    snprintf(body, sizeof body,
             "{\"messages\":[{\"role\":\"system\",\"content\":\"%s\"},{\"role\":\"user\",\"content\":\"hi\"}]}", text);
    int32_t *chat_ids = NULL;
    size_t n_chat = 0;
    assert_int_equal(route_prompt_tokens(rp, "/v1/chat/completions", body, strlen(body), &chat_ids, &n_chat, &salt),
                     KS_OK);
    snprintf(body, sizeof body,
             "{\"max_tokens\":4,\"system\":[{\"type\":\"text\",\"text\":\"%s\"}],\"messages\":"
             "[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"hi\"}]}]}",
             text);
    expect_tokens(rp, "/v1/messages", body, chat_ids, n_chat);
    /* OpenAI's /v1/responses too (instructions the system message, a developer message one as well) */
    snprintf(body, sizeof body, "{\"instructions\":\"%s\",\"input\":\"hi\",\"max_output_tokens\":4}", text);
    expect_tokens(rp, "/v1/responses", body, chat_ids, n_chat);
    snprintf(body, sizeof body,
             "{\"input\":[{\"role\":\"developer\",\"content\":[{\"type\":\"input_text\",\"text\":\"%s\"}]},"
             "{\"type\":\"message\",\"role\":\"user\",\"content\":\"hi\"}]}",
             text);
    expect_tokens(rp, "/responses", body, chat_ids, n_chat);
    free(chat_ids);
    /* a function call and its output: the chat's assistant tool call and tool message */
    snprintf(body, sizeof body,
             "{\"messages\":[{\"role\":\"system\",\"content\":\"%s\"},{\"role\":\"user\",\"content\":\"hi\"},"
             "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c1\",\"type\":\"function\","
             "\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]},"
             "{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":\"42\"}]}",
             text);
    assert_int_equal(route_prompt_tokens(rp, "/v1/chat/completions", body, strlen(body), &chat_ids, &n_chat, &salt),
                     KS_OK);
    snprintf(body, sizeof body,
             "{\"instructions\":\"%s\",\"input\":[{\"role\":\"user\",\"content\":\"hi\"},"
             "{\"type\":\"reasoning\",\"summary\":[]},"
             "{\"type\":\"function_call\",\"call_id\":\"c1\",\"name\":\"f\",\"arguments\":\"{}\"},"
             "{\"type\":\"function_call_output\",\"call_id\":\"c1\",\"output\":\"42\"}]}",
             text);
    expect_tokens(rp, "/v1/responses", body, chat_ids, n_chat);
    free(chat_ids);
    /* a model without fill-in-the-middle tokens: /infill is the replica's 501, the router balances by load */
    snprintf(body, sizeof body, "{\"input_prefix\":\"a\",\"input_suffix\":\"b\"}");
    assert_int_equal(route_prompt_tokens(rp, "/infill", body, strlen(body), &ids, &n, &salt), KS_ERR_UNSUPPORTED);
    /* what the router does not read: another route; a body that is not JSON */
    assert_int_equal(route_prompt_tokens(rp, "/v1/embeddings", body, strlen(body), &ids, &n, &salt),
                     KS_ERR_NOT_FOUND);
    assert_int_equal(route_prompt_tokens(rp, "/completion", "{\"prompt\":", 10, &ids, &n, &salt), KS_ERR_INVALID_ARG);
    route_prompt_free(rp);
    tok_free(tok);
    gguf_close(f);
}

/* /infill's prompt as the replica builds it (tok_infill_prompt: llama-server's, checked against it by
 * server_infill_parity), with the replicas' context and --spm-infill; a body the replica refuses is not read. */
static void test_route_infill_keys(void **state)
{
    (void)state;
    const char *shared = getenv("KVSERVE_SHARED");
    char path[1024];
    snprintf(path, sizeof path, "%s/models/vocab/ggml-vocab-qwen3.gguf", shared ? shared : "../shared");
    struct gguf_file *f = NULL;
    if (gguf_open(path, &f) != KS_OK)
        KS_SKIP("no %s (Qwen3's vocabulary, with FIM tokens)", path);
    struct tokenizer *tok = NULL;
    assert_int_equal(tok_load(f, &tok), KS_OK);
    const struct tok_special *sp = tok_special(tok);
    for (int spm = 0; spm < 2; spm++) {
        struct route_prompt *rp = NULL;
        assert_int_equal(route_prompt_create(tok, "chatml", 4096, spm, &rp), KS_OK);
        const char body[] = "{\"input_prefix\":[\"def add(a, b):\\n\", 16, \"    \"],\"input_suffix\":\"\\n    return c\\n\","
                            "\"prompt\":\"c =\",\"input_extra\":[{\"filename\":\"util.py\",\"text\":\"def helper():\\n\"},"
                            "{\"text\":\"# no name\\n\"}],\"n_predict\":8}";
        int32_t *ids = NULL, *want = NULL;
        size_t n = 0, n_want = 0;
        struct kv_key salt;
        assert_int_equal(route_prompt_tokens(rp, "/infill", body, strlen(body), &ids, &n, &salt), KS_OK);
        const struct tok_infill_part pre[] = {{"def add(a, b):\n", 0}, {NULL, 16}, {"    ", 0}},
                                     suf[] = {{"\n    return c\n", 0}};
        const struct tok_infill_file files[] = {{"util.py", "def helper():\n"}, {NULL, "# no name\n"}};
        const struct tok_infill in = {pre, suf, 3, 1, "c =", files, 2, 4096, spm};
        assert_int_equal(tok_infill_prompt(tok, &in, &want, &n_want), KS_OK);
        assert_int_equal(n, n_want);
        assert_memory_equal(ids, want, n * sizeof *ids);
        assert_int_equal(ids[0], sp->fim_rep);
        assert_int_equal(ids[n - 1], sp->fim_mid);
        free(ids);
        free(want);
        const char bad[] = "{\"input_prefix\":5,\"input_suffix\":\"b\"}";
        assert_int_equal(route_prompt_tokens(rp, "/infill", bad, strlen(bad), &ids, &n, &salt), KS_ERR_INVALID_ARG);
        route_prompt_free(rp);
    }
    tok_free(tok);
    gguf_close(f);
}

/* A 125-page prompt (a 2000-token system prompt): replica A holds it and
 * serves one 40-page request, replica B is idle. Without a shared tier
 * affinity wins (B would compute 125 pages); with the replicas' Redis B does,
 * fetching the pages A wrote there. A page nobody holds costs the same on
 * both. */
static void test_route_cost_with_shared_tier(void **state)
{
    (void)state;
    const int32_t pages = 125, held = 125;
    const double load_a = 40 + 1, load_b = 0;
    assert_true(route_replica_cost(pages, held, held, load_a, 1.0, 1.0) <
                route_replica_cost(pages, 0, held, load_b, 1.0, 1.0));
    assert_true(route_replica_cost(pages, held, held, load_a, 1.0, ROUTE_SHARED_PAGE_COST) >
                route_replica_cost(pages, 0, held, load_b, 1.0, ROUTE_SHARED_PAGE_COST));
    assert_true(route_replica_cost(pages, 0, 0, 0, 1.0, ROUTE_SHARED_PAGE_COST) ==
                route_replica_cost(pages, 0, 0, 0, 1.0, 1.0));
    /* B holds half of it: its other half is a fetch, A's whole prompt is local */
    assert_true(route_replica_cost(pages, 60, held, 0, 1.0, 0.1) == (double)(125 - 60) * 0.1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_event_round_trip),
        cmocka_unit_test(test_event_parse_refuses),
        cmocka_unit_test(test_index_follows_events),
        cmocka_unit_test(test_route_keys_are_the_replicas),
        cmocka_unit_test(test_route_infill_keys),
        cmocka_unit_test(test_route_cost_with_shared_tier),
    };
    return ks_run_tests(tests, NULL, NULL);
}
