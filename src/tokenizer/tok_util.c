/* tokenizer: hash maps, UTF-8 helpers and the growable id list. */
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "sbuf/sbuf.h"
#include "tokenizer/tok_internal.h"

/* ---- hashing ------------------------------------------------------------ */

uint64_t tok_hash_bytes(const char *s, size_t n)
{
    return XXH3_64bits(s, n);
}

static uint32_t pow2_at_least(uint64_t n)
{
    uint32_t c = 16;
    while (c < n)
        c <<= 1;
    return c;
}

/* ---- string map --------------------------------------------------------- */

ks_status tok_strmap_init(struct tok_strmap *m, uint32_t expected)
{
    memset(m, 0, sizeof *m);
    m->cap = pow2_at_least((uint64_t)expected * 2 + 1);
    uint32_t n = m->cap / 2 + 1;
    m->slots = calloc(m->cap, sizeof *m->slots);
    m->hashes = malloc(n * sizeof *m->hashes);
    m->off = malloc(n * sizeof *m->off);
    m->len = malloc(n * sizeof *m->len);
    m->val = malloc(n * sizeof *m->val);
    m->arena_cap = (size_t)expected * 8 + 64;
    m->arena = malloc(m->arena_cap);
    if (!m->slots || !m->hashes || !m->off || !m->len || !m->val || !m->arena) {
        tok_strmap_free(m);
        return ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory for the vocabulary map");
    }
    return KS_OK;
}

void tok_strmap_free(struct tok_strmap *m)
{
    free(m->slots);
    free(m->hashes);
    free(m->off);
    free(m->len);
    free(m->val);
    free(m->arena);
    memset(m, 0, sizeof *m);
}

static bool strmap_grow(struct tok_strmap *m)
{
    uint32_t ncap = m->cap * 2;
    uint32_t *slots = calloc(ncap, sizeof *slots);
    if (!slots)
        return false;
    for (uint32_t e = 0; e < m->n; e++) {
        uint32_t i = (uint32_t)m->hashes[e] & (ncap - 1);
        while (slots[i])
            i = (i + 1) & (ncap - 1);
        slots[i] = e + 1;
    }
    free(m->slots);
    m->slots = slots;
    m->cap = ncap;
    uint32_t *off = realloc(m->off, (ncap / 2 + 1) * sizeof *off);
    if (off)
        m->off = off;
    uint32_t *len = realloc(m->len, (ncap / 2 + 1) * sizeof *len);
    if (len)
        m->len = len;
    int32_t *val = realloc(m->val, (ncap / 2 + 1) * sizeof *val);
    if (val)
        m->val = val;
    uint64_t *h = realloc(m->hashes, (ncap / 2 + 1) * sizeof *h);
    if (h)
        m->hashes = h;
    return off && len && val && h;
}

int64_t tok_strmap_find(const struct tok_strmap *m, const char *s, size_t n)
{
    if (!m->cap)
        return -1;
    uint64_t h = tok_hash_bytes(s, n);
    for (uint32_t i = (uint32_t)h & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
        uint32_t e = m->slots[i];
        if (!e)
            return -1;
        e--;
        if (m->hashes[e] == h && m->len[e] == n && !memcmp(m->arena + m->off[e], s, n))
            return e;
    }
}

ks_status tok_strmap_put(struct tok_strmap *m, const char *s, size_t n, int32_t val, uint32_t *index)
{
    int64_t found = tok_strmap_find(m, s, n);
    if (found >= 0) {
        m->val[found] = val;
        if (index)
            *index = (uint32_t)found;
        return KS_OK;
    }
    if ((uint64_t)(m->n + 1) * 2 > m->cap && !strmap_grow(m))
        return ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory growing the vocabulary map");
    if (m->arena_len + n > m->arena_cap) {
        size_t ncap = (m->arena_len + n) * 2;
        char *a = realloc(m->arena, ncap);
        if (!a)
            return ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory for token strings");
        m->arena = a;
        m->arena_cap = ncap;
    }
    if (m->arena_len + n > UINT32_MAX)
        return ks_fail(KS_ERR_FORMAT, "tokenizer: vocabulary strings exceed 4 GiB");
    uint32_t e = m->n++;
    memcpy(m->arena + m->arena_len, s, n);
    m->off[e] = (uint32_t)m->arena_len;
    m->len[e] = (uint32_t)n;
    m->val[e] = val;
    m->hashes[e] = tok_hash_bytes(s, n);
    m->arena_len += n;
    uint32_t i = (uint32_t)m->hashes[e] & (m->cap - 1);
    while (m->slots[i])
        i = (i + 1) & (m->cap - 1);
    m->slots[i] = e + 1;
    if (index)
        *index = e;
    return KS_OK;
}

/* ---- pair map ----------------------------------------------------------- */

static uint32_t pair_slot(uint64_t key, uint32_t cap)
{
    key ^= key >> 33;
    key *= 0xff51afd7ed558ccdull;
    key ^= key >> 33;
    return (uint32_t)key & (cap - 1);
}

ks_status tok_pairmap_init(struct tok_pairmap *m, uint32_t expected)
{
    m->cap = pow2_at_least((uint64_t)expected * 2 + 1);
    m->n = 0;
    m->keys = malloc(m->cap * sizeof *m->keys);
    m->vals = malloc(m->cap * sizeof *m->vals);
    if (!m->keys || !m->vals) {
        tok_pairmap_free(m);
        return ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory for the merge table");
    }
    memset(m->keys, 0xff, m->cap * sizeof *m->keys);
    return KS_OK;
}

void tok_pairmap_free(struct tok_pairmap *m)
{
    free(m->keys);
    free(m->vals);
    memset(m, 0, sizeof *m);
}

/* Capacity is fixed at init to twice the expected count; callers never
 * insert more than expected. */
void tok_pairmap_put_new(struct tok_pairmap *m, uint64_t key, int32_t val)
{
    if ((uint64_t)(m->n + 1) * 2 > m->cap)
        return;
    uint32_t i = pair_slot(key, m->cap);
    while (m->keys[i] != UINT64_MAX) {
        if (m->keys[i] == key)
            return;
        i = (i + 1) & (m->cap - 1);
    }
    m->keys[i] = key;
    m->vals[i] = val;
    m->n++;
}

int32_t tok_pairmap_get(const struct tok_pairmap *m, uint64_t key)
{
    if (!m->cap)
        return -1;
    for (uint32_t i = pair_slot(key, m->cap);; i = (i + 1) & (m->cap - 1)) {
        if (m->keys[i] == key)
            return m->vals[i];
        if (m->keys[i] == UINT64_MAX)
            return -1;
    }
}

/* ---- UTF-8 -------------------------------------------------------------- */

size_t tok_utf8_len(uint8_t lead)
{
    static const uint8_t lens[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return lens[lead >> 4];
}

size_t tok_utf8_decode(const char *s, size_t n, uint32_t *cp)
{
    const uint8_t *u = (const uint8_t *)s;
    if (!n)
        return 0;
    if (u[0] < 0x80) {
        *cp = u[0];
        return 1;
    }
    size_t len;
    uint32_t c, min;
    if ((u[0] & 0xe0) == 0xc0) {
        len = 2, c = u[0] & 0x1f, min = 0x80;
    } else if ((u[0] & 0xf0) == 0xe0) {
        len = 3, c = u[0] & 0x0f, min = 0x800;
    } else if ((u[0] & 0xf8) == 0xf0) {
        len = 4, c = u[0] & 0x07, min = 0x10000;
    } else {
        return 0;
    }
    if (n < len)
        return 0;
    for (size_t i = 1; i < len; i++) {
        if ((u[i] & 0xc0) != 0x80)
            return 0;
        c = (c << 6) | (u[i] & 0x3f);
    }
    if (c < min || c > 0x10ffff || (c >= 0xd800 && c <= 0xdfff))
        return 0;
    *cp = c;
    return len;
}

ks_status tok_utf8_sanitize(const char *s, size_t n, char **out, size_t *len)
{
    static const char replacement[] = "\xEF\xBF\xBD";
    struct sbuf b = {0};
    sbuf_append(&b, "", 0);
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t k = tok_utf8_decode(s + i, n - i, &cp);
        if (k && cp) {
            sbuf_append(&b, s + i, k);
            i += k;
        } else {
            sbuf_append(&b, replacement, sizeof replacement - 1);
            i++;
        }
    }
    if (b.oom) {
        sbuf_free(&b);
        return ks_fail(KS_ERR_NOMEM, "out of memory copying %zu bytes of text", n);
    }
    *out = b.p;
    *len = b.n;
    return KS_OK;
}

size_t tok_utf8_encode(uint32_t cp, char *out)
{
    uint8_t *o = (uint8_t *)out;
    if (cp < 0x80) {
        o[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (uint8_t)(0xc0 | (cp >> 6));
        o[1] = (uint8_t)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (uint8_t)(0xe0 | (cp >> 12));
        o[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3f));
        o[2] = (uint8_t)(0x80 | (cp & 0x3f));
        return 3;
    }
    o[0] = (uint8_t)(0xf0 | (cp >> 18));
    o[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3f));
    o[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3f));
    o[3] = (uint8_t)(0x80 | (cp & 0x3f));
    return 4;
}

/* ---- ids ---------------------------------------------------------------- */

ks_status tok_ids_push(struct tok_ids *ids, int32_t id)
{
    if (ids->n == ids->cap) {
        size_t ncap = ids->cap ? ids->cap * 2 : 64;
        int32_t *v = realloc(ids->v, ncap * sizeof *v);
        if (!v)
            return ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory for %zu token ids", ncap);
        ids->v = v;
        ids->cap = ncap;
    }
    ids->v[ids->n++] = id;
    return KS_OK;
}

/* ---- merge queue -------------------------------------------------------- */

static bool bigram_before(const struct tok_bigram *a, const struct tok_bigram *b)
{
    return a->key < b->key || (a->key == b->key && a->left < b->left);
}

ks_status tok_heap_push(struct tok_heap *h, struct tok_bigram b)
{
    if (h->n == h->cap) {
        size_t ncap = h->cap ? h->cap * 2 : 64;
        struct tok_bigram *v = realloc(h->v, ncap * sizeof *v);
        if (!v)
            return ks_fail(KS_ERR_NOMEM, "tokenizer: out of memory for the merge queue");
        h->v = v;
        h->cap = ncap;
    }
    size_t i = h->n++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!bigram_before(&b, &h->v[p]))
            break;
        h->v[i] = h->v[p];
        i = p;
    }
    h->v[i] = b;
    return KS_OK;
}

struct tok_bigram tok_heap_pop(struct tok_heap *h)
{
    struct tok_bigram top = h->v[0];
    struct tok_bigram last = h->v[--h->n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= h->n)
            break;
        if (c + 1 < h->n && bigram_before(&h->v[c + 1], &h->v[c]))
            c++;
        if (!bigram_before(&h->v[c], &last))
            break;
        h->v[i] = h->v[c];
        i = c;
    }
    if (h->n)
        h->v[i] = last;
    return top;
}

/* ---- word memo ---------------------------------------------------------- */

bool tok_cache_get(const struct tok_cache *c, const char *s, size_t n, struct tok_ids *out)
{
    if (!c->ready)
        return false;
    int64_t e = tok_strmap_find(&c->map, s, n);
    if (e < 0)
        return false;
    const int32_t *p = c->ids.v + c->map.val[e];
    size_t n0 = out->n;
    for (int32_t i = 0; i < p[0]; i++)
        if (tok_ids_push(out, p[1 + i])) {
            out->n = n0; /* the caller recomputes and reports the failure */
            return false;
        }
    return true;
}

void tok_cache_put(struct tok_cache *c, const char *s, size_t n, const int32_t *ids, size_t count)
{
    if (!c->ready) {
        if (tok_strmap_init(&c->map, 1024))
            return;
        c->ready = true;
    }
    size_t at = c->ids.n;
    if (at > INT32_MAX / 2 || tok_ids_push(&c->ids, (int32_t)count))
        return;
    for (size_t i = 0; i < count; i++)
        if (tok_ids_push(&c->ids, ids[i])) {
            c->ids.n = at;
            return;
        }
    if (tok_strmap_put(&c->map, s, n, (int32_t)at, NULL))
        c->ids.n = at;
}

void tok_cache_free(struct tok_cache *c)
{
    if (c->ready)
        tok_strmap_free(&c->map);
    free(c->ids.v);
    memset(c, 0, sizeof *c);
}
