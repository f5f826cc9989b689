/* DRY ("don't repeat yourself"), as llama.cpp defines it (after
 * koboldcpp): a token that would extend a sequence the history already
 * holds elsewhere, by more than dry_allowed_length tokens, loses
 * multiplier * base^(length - allowed) from its logit. Sequence breakers
 * (newlines, quotes, ...) cut how far back a repeat may reach.
 *
 * The scan follows llama.cpp step by step: find the nearest breaker to cap
 * the repeat length, find every earlier occurrence of a suffix of the
 * history (the Z-function of the reversed window, linear), note the token
 * that followed each, and penalize those tokens by their longest repeat. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sample/sample.h"
#include "sample/sample_internal.h"

/* llama.cpp's limits on a breaker: its first 40 bytes, tails of at most 20 tokens. */
#define DRY_MAX_BREAKER_BYTES 40
#define DRY_MAX_TAIL_TOKENS 20
/* ln(FLT_MAX): larger exponents of the penalty are clamped (llama.cpp's constant). */
#define DRY_FLOAT_MAX_LOG 88.7228391f

/* ---- breakers ------------------------------------------------------------ */

struct seq_list {
    struct sample_dry_breakers b;
    int32_t cap_seq, cap_tails;
};

static bool same_tail(const struct sample_dry_breakers *b, int32_t i, int32_t head, const int32_t *tail, int32_t n)
{
    return b->head[i] == head && b->tail_start[i + 1] - b->tail_start[i] == n &&
           (n == 0 || !memcmp(b->tails + b->tail_start[i], tail, (size_t)n * sizeof *tail));
}

/* Append (head, tail) unless that pair is there already (llama.cpp drops
 * duplicates). Heads come in ascending order, so a duplicate is among the last. */
static ks_status add_seq(struct seq_list *l, int32_t head, const int32_t *tail, int32_t n)
{
    struct sample_dry_breakers *b = &l->b;
    for (int32_t i = b->n - 1; i >= 0 && b->head[i] == head; i--)
        if (same_tail(b, i, head, tail, n))
            return KS_OK;
    if (b->n + 1 >= l->cap_seq) {
        int32_t cap = l->cap_seq ? 2 * l->cap_seq : 64;
        int32_t *h = realloc(b->head, (size_t)cap * sizeof *h);
        if (h)
            b->head = h;
        int32_t *ts = realloc(b->tail_start, (size_t)(cap + 1) * sizeof *ts);
        if (ts)
            b->tail_start = ts;
        if (!h || !ts)
            return ks_fail(KS_ERR_NOMEM, "DRY: out of memory for the sequence breakers");
        if (b->n == 0)
            b->tail_start[0] = 0;
        l->cap_seq = cap;
    }
    int32_t used = b->tail_start[b->n];
    if (used + n > l->cap_tails) {
        int32_t cap = (used + n) * 2 + 16;
        int32_t *t = realloc(b->tails, (size_t)cap * sizeof *t);
        if (!t)
            return ks_fail(KS_ERR_NOMEM, "DRY: out of memory for the sequence breakers");
        b->tails = t;
        l->cap_tails = cap;
    }
    if (n > 0)
        memcpy(b->tails + used, tail, (size_t)n * sizeof *tail);
    b->head[b->n] = head;
    b->tail_start[++b->n] = used + n;
    return KS_OK;
}

static bool contains(const char *w, size_t wn, const char *s, size_t sn)
{
    for (size_t i = 0; i + sn <= wn; i++)
        if (!memcmp(w + i, s, sn))
            return true;
    return false;
}

/* One breaker against one token's text: the token contains it (a one-token
 * breaker), or ends with its first i bytes at some position (the token heads
 * the tokenization of the rest). */
static ks_status add_overlaps(struct seq_list *l, int32_t id, const char *w, size_t wn, const char *s, size_t sn,
                              sample_tokenize_fn tokenize, void *user)
{
    if (contains(w, wn, s, sn))
        return add_seq(l, id, NULL, 0);
    for (size_t pos = 0; pos < wn; pos++) {
        if (w[pos] != s[0])
            continue;
        size_t i = 1;
        while (i < sn && pos + i < wn && w[pos + i] == s[i])
            i++;
        if (pos + i < wn) /* a mismatch before the token's end */
            continue;
        int32_t *ids = NULL;
        size_t n = 0;
        ks_status st = tokenize(user, s + i, sn - i, &ids, &n);
        if (st)
            return st;
        st = add_seq(l, id, ids, n > DRY_MAX_TAIL_TOKENS ? DRY_MAX_TAIL_TOKENS : (int32_t)n);
        free(ids);
        if (st)
            return st;
    }
    return KS_OK;
}


/* Sort the sequences by head (stable in insertion order within a head). */
static ks_status sort_by_head(struct sample_dry_breakers *b)
{
    int32_t *idx = malloc((size_t)(b->n > 0 ? b->n : 1) * sizeof *idx);
    int32_t *head = malloc((size_t)(b->n > 0 ? b->n : 1) * sizeof *head);
    int32_t *start = malloc((size_t)(b->n + 1) * sizeof *start);
    int32_t *tails = malloc((size_t)(b->n > 0 && b->tail_start[b->n] > 0 ? b->tail_start[b->n] : 1) * sizeof *tails);
    if (!idx || !head || !start || !tails) {
        free(idx), free(head), free(start), free(tails);
        return ks_fail(KS_ERR_NOMEM, "DRY: out of memory for the sequence breakers");
    }
    /* insertion sort by head keeps equal heads in order; breaker lists are small per head */
    for (int32_t i = 0; i < b->n; i++) {
        int32_t j = i;
        while (j > 0 && b->head[idx[j - 1]] > b->head[i]) {
            idx[j] = idx[j - 1];
            j--;
        }
        idx[j] = i;
    }
    start[0] = 0;
    for (int32_t k = 0; k < b->n; k++) {
        int32_t i = idx[k], len = b->tail_start[i + 1] - b->tail_start[i];
        head[k] = b->head[i];
        if (len > 0)
            memcpy(tails + start[k], b->tails + b->tail_start[i], (size_t)len * sizeof *tails);
        start[k + 1] = start[k] + len;
    }
    free(idx);
    free(b->head);
    free(b->tail_start);
    free(b->tails);
    b->head = head;
    b->tail_start = start;
    b->tails = tails;
    return KS_OK;
}

ks_status sample_dry_breakers_create(const char *const *breakers, int n, int32_t n_vocab, sample_piece_fn piece,
                                     sample_tokenize_fn tokenize, void *user, struct sample_dry_breakers **out)
{
    if (!out || (n > 0 && !breakers) || !piece || !tokenize || n < 0 || n_vocab < 1)
        return ks_fail(KS_ERR_INVALID_ARG, "sample_dry_breakers_create: NULL argument or no vocabulary");
    *out = NULL;
    struct seq_list l = {0};
    ks_status st = KS_OK;
    bool any = false;
    for (int k = 0; k < n; k++)
        any |= breakers[k][0] != 0;
    /* each token's text once, against every breaker */
    for (int32_t id = 0; any && id < n_vocab && !st; id++) {
        const char *w;
        size_t wn;
        if ((st = piece(user, id, &w, &wn)))
            break;
        for (int k = 0; k < n && !st; k++) {
            size_t sn = strlen(breakers[k]);
            if (sn > 0)
                st = add_overlaps(&l, id, w, wn, breakers[k], sn > DRY_MAX_BREAKER_BYTES ? DRY_MAX_BREAKER_BYTES : sn,
                                  tokenize, user);
        }
    }
    struct sample_dry_breakers *b = malloc(sizeof *b);
    if (!st && !b)
        st = ks_fail(KS_ERR_NOMEM, "DRY: out of memory for the sequence breakers");
    if (!st && l.b.n == 0) {
        l.b.tail_start = calloc(1, sizeof *l.b.tail_start);
        if (!l.b.tail_start)
            st = ks_fail(KS_ERR_NOMEM, "DRY: out of memory for the sequence breakers");
    }
    if (!st)
        st = sort_by_head(&l.b);
    if (st) {
        free(b);
        free(l.b.head), free(l.b.tail_start), free(l.b.tails);
        return st;
    }
    *b = l.b;
    *out = b;
    return KS_OK;
}

void sample_dry_breakers_free(struct sample_dry_breakers *b)
{
    if (!b)
        return;
    free(b->head);
    free(b->tail_start);
    free(b->tails);
    free(b);
}

int32_t sample_dry_breakers_count(const struct sample_dry_breakers *b)
{
    return b ? b->n : 0;
}

ks_status sample_dry_copy(const struct sample_dry_breakers *b, struct sample_dry_breakers **out)
{
    struct sample_dry_breakers *c = calloc(1, sizeof *c);
    int32_t n_tails = b->tail_start[b->n];
    if (c) {
        c->n = b->n;
        c->head = malloc((size_t)(b->n > 0 ? b->n : 1) * sizeof *c->head);
        c->tail_start = malloc((size_t)(b->n + 1) * sizeof *c->tail_start);
        c->tails = malloc((size_t)(n_tails > 0 ? n_tails : 1) * sizeof *c->tails);
    }
    if (!c || !c->head || !c->tail_start || !c->tails) {
        sample_dry_breakers_free(c);
        return ks_fail(KS_ERR_NOMEM, "sampler: out of memory for DRY's sequence breakers");
    }
    if (b->n > 0)
        memcpy(c->head, b->head, (size_t)b->n * sizeof *c->head);
    memcpy(c->tail_start, b->tail_start, (size_t)(b->n + 1) * sizeof *c->tail_start);
    if (n_tails > 0)
        memcpy(c->tails, b->tails, (size_t)n_tails * sizeof *c->tails);
    *out = c;
    return KS_OK;
}

/* The first sequence with this head, or b->n. */
static int32_t first_with_head(const struct sample_dry_breakers *b, int32_t head)
{
    int32_t lo = 0, hi = b->n;
    while (lo < hi) {
        int32_t mid = lo + (hi - lo) / 2;
        if (b->head[mid] < head)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* ---- the scan ------------------------------------------------------------ */

/* rev[0..n): the window newest first (llama.cpp's last_tokens.rat(i)).
 * The repeat limit: the distance back to the nearest complete breaker
 * (its head and, before it in time, its tail), or n. */
static int32_t repeat_limit(const struct sample_dry_breakers *b, const int32_t *rev, int32_t n)
{
    if (!b)
        return n;
    for (int32_t i = 0; i < n; i++) {
        int32_t longest = -1;
        for (int32_t k = first_with_head(b, rev[i]); k < b->n && b->head[k] == rev[i]; k++) {
            int32_t len = b->tail_start[k + 1] - b->tail_start[k];
            if (len <= longest || len > i)
                continue;
            const int32_t *tail = b->tails + b->tail_start[k];
            int32_t j = 0;
            while (j < len && tail[j] == rev[i - j - 1])
                j++;
            if (j == len)
                longest = len;
        }
        if (longest >= 0)
            return i - longest;
    }
    return n;
}

/* z[k] = the longest common prefix of a[0..n) and a[k..n) (z[0] = n). */
static void z_function(const int32_t *a, int32_t n, int32_t *z)
{
    int32_t l = 0, r = 0;
    z[0] = n;
    for (int32_t k = 1; k < n; k++) {
        int32_t m = k < r ? (r - k < z[k - l] ? r - k : z[k - l]) : 0;
        while (k + m < n && a[m] == a[k + m])
            m++;
        z[k] = m;
        if (k + m > r) {
            l = k;
            r = k + m;
        }
    }
}

ks_status sample_dry_scan(struct sampler *s, const int32_t *history, int32_t n_history, int32_t **touched,
                          int32_t *n_touched)
{
    const struct sample_params *p = &s->p;
    *n_touched = 0;
    *touched = NULL;
    int32_t n = p->dry_penalty_last_n < 0 || p->dry_penalty_last_n > n_history ? n_history : p->dry_penalty_last_n;
    if (n <= p->dry_allowed_length)
        return KS_OK;
    const int32_t *win = history + (n_history - n);
    for (int32_t i = 0; i < n; i++)
        if (win[i] < 0 || win[i] >= s->n_vocab)
            return ks_fail(KS_ERR_RANGE, "sampler: history token %d at index %d is outside the vocabulary (%d)",
                           (int)win[i], (int)(n_history - n + i), (int)s->n_vocab);
    if (n > s->n_dry_scratch) {
        int32_t *grown = realloc(s->dry_scratch, (size_t)n * 3 * sizeof *grown);
        if (!grown)
            return ks_fail(KS_ERR_NOMEM, "sampler: out of memory for DRY over %d tokens", (int)n);
        s->dry_scratch = grown;
        s->n_dry_scratch = n;
    }
    int32_t *rev = s->dry_scratch, *z = rev + n, *list = z + n;
    for (int32_t i = 0; i < n; i++)
        rev[i] = win[n - 1 - i];
    int32_t limit = repeat_limit(s->dry_breakers, rev, n);
    if (limit < p->dry_allowed_length)
        return KS_OK;
    z_function(rev, n, z);
    /* the newest tokens repeat at shift k; the token after that earlier copy is rev[k - 1] */
    for (int32_t k = 1; k < n; k++) {
        int32_t len = z[k] < limit ? z[k] : limit;
        if (len < p->dry_allowed_length)
            continue;
        int32_t t = rev[k - 1];
        if (s->dry_repeat[t] == 0)
            list[(*n_touched)++] = t;
        if (s->dry_repeat[t] < len + 1) /* stored + 1: 0 means "no repeat" */
            s->dry_repeat[t] = len + 1;
    }
    *touched = list;
    return KS_OK;
}

float sample_dry_penalty(const struct sampler *s, int32_t t, int32_t len)
{
    const struct sample_params *p = &s->p;
    const struct sample_dry_breakers *b = s->dry_breakers;
    if (b)
        for (int32_t k = first_with_head(b, t); k < b->n && b->head[k] == t; k++)
            if (b->tail_start[k + 1] == b->tail_start[k])
                return 0.0f; /* a one-token breaker is never penalized */
    int32_t exponent = len - p->dry_allowed_length;
    if (p->dry_base > 1.000001f) {
        int32_t max_exponent = (int32_t)(DRY_FLOAT_MAX_LOG / logf(p->dry_base));
        if (max_exponent > 0 && exponent > max_exponent)
            exponent = max_exponent;
    }
    return p->dry_multiplier * powf(p->dry_base, (float)exponent);
}
