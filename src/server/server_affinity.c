/* GET /cache/prefixes?prompt=TEXT (or ?tokens=1,2,3): how many of a prompt's
 * pages this replica holds, in RAM and on its SSD tier, by key alone. A
 * prefix-affinity router asks each replica and sends the prompt where most of
 * it is cached (the Redis tier is shared, so it is not counted here). */
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

#include "kv/kv.h"
#include "server/server_internal.h"
#include "store/store.h"
#include "tokenizer/tokenizer.h"

enum { HELD_MAX_TOKENS = 1 << 20 };

struct held_query {
    const int32_t *tokens;
    int32_t n_tokens;
    int32_t page_tokens, ram_pages, pages;
    struct kv_key *keys;      /* (pages) chain keys, for the SSD tier */
};

static void held_hook(void *user, struct kv_cache *kv)
{
    struct held_query *q = user;
    if (!kv)
        return;
    q->page_tokens = kv_get_config(kv)->page_tokens;
    q->pages = q->n_tokens / q->page_tokens;
    q->ram_pages = kv_prefix_held(kv, q->tokens, q->n_tokens);
    if (q->pages > q->ram_pages && (q->keys = malloc((size_t)q->pages * sizeof *q->keys)))
        kv_prefix_keys(kv, q->tokens, q->n_tokens, q->keys);
}

/* "1,2,3" into ids[] (malloc'd). */
static ks_status parse_ids(const char *s, int32_t n_vocab, int32_t **ids, size_t *n, struct reply *r)
{
    size_t cap = 1;
    for (const char *p = s; *p; p++)
        cap += *p == ',';
    if (cap > HELD_MAX_TOKENS || !(*ids = malloc(cap * sizeof **ids)))
        return reply_fail(r, cap > HELD_MAX_TOKENS ? KS_ERR_INVALID_ARG : KS_ERR_NOMEM, "invalid_value",
                          "'tokens' must be at most %d comma-separated token ids", HELD_MAX_TOKENS);
    *n = 0;
    for (const char *p = s;;) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 0 || v >= n_vocab || (*end && *end != ',')) {
            free(*ids);
            *ids = NULL;
            return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value",
                              "'tokens' must be comma-separated integers in [0, %d)", (int)n_vocab);
        }
        (*ids)[(*n)++] = (int32_t)v;
        if (!*end)
            return KS_OK;
        p = end + 1;
    }
}

ks_status server_route_prefix_held(struct server *srv, const struct server_req *rq, struct reply *r)
{
    const char *text = server_req_arg(rq, "prompt"), *list = server_req_arg(rq, "tokens");
    if (text && list)
        return reply_fail(r, KS_ERR_INVALID_ARG, "invalid_value", "give 'prompt' or 'tokens', not both");
    int32_t *ids = NULL;
    size_t n = 0;
    ks_status st = KS_OK;
    if (list) {
        if ((st = parse_ids(list, tok_n_vocab(srv->tok), &ids, &n, r)))
            return st;
    } else if ((st = tok_encode(srv->tok, text, strlen(text), TOK_ADD_SPECIAL, &ids, &n))) {
        return reply_fail(r, st, NULL, "cannot tokenize 'prompt': %s", ks_errmsg());
    }
    struct held_query q = {.tokens = ids, .n_tokens = n > HELD_MAX_TOKENS ? HELD_MAX_TOKENS : (int32_t)n};
    if ((st = sched_between_steps(srv->sched, held_hook, &q))) {
        free(ids);
        return reply_fail(r, st, "shutting_down", "%s", ks_errmsg());
    }
    int32_t disk_pages = 0;
    while (q.keys && srv->cfg.store && q.ram_pages + disk_pages < q.pages &&
           store_has(srv->cfg.store, (struct store_key){q.keys[q.ram_pages + disk_pages].lo,
                                                        q.keys[q.ram_pages + disk_pages].hi}, NULL))
        disk_pages++;
    free(q.keys);
    free(ids);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "prompt_tokens", (double)n);
    cJSON_AddNumberToObject(o, "page_tokens", q.page_tokens);
    cJSON_AddNumberToObject(o, "pages", q.pages);
    cJSON_AddNumberToObject(o, "ram_pages", q.ram_pages);
    cJSON_AddNumberToObject(o, "disk_pages", disk_pages);
    cJSON_AddNumberToObject(o, "held_tokens", (double)(q.ram_pages + disk_pages) * q.page_tokens);
    return reply_json(r, 200, o);
}
