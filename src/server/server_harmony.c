/* gpt-oss's harmony output format mapped to the chat API. After the prompt's
 * "<|start|>assistant" the model writes messages
 *     [<|start|>assistant] HEADER <|message|> BODY (<|end|> | <|call|> | <|return|>)
 * whose HEADER names a channel ("<|channel|>analysis") and, for a tool call,
 * a recipient (" to=functions.NAME", before or after the channel) and a
 * content type (" <|constrain|>json"). <|call|> and <|return|> end the
 * generation (they are end-of-generation tokens, so they are not in the
 * text); <|end|> ends one message. The channels become:
 *   analysis                      reasoning_content
 *   final, commentary (no target) content
 *   commentary to=functions.NAME  a tool call of NAME, its BODY the arguments
 *   any other recipient           reasoning (built-in tools the API does not offer)
 * Text that does not begin with a header is all content (a model that
 * ignores the format). The parse is a pure function of the text so far; a
 * tail that may still become a marker is held back until the final parse. */
#include "server/server_internal.h"

#include <stdlib.h>
#include <string.h>

#define H_START "<|start|>"
#define H_END "<|end|>"
#define H_MESSAGE "<|message|>"
#define H_CHANNEL "<|channel|>"
#define H_CONSTRAIN "<|constrain|>"
#define H_CALL "<|call|>"
#define H_RETURN "<|return|>"
#define H_FUNCTIONS "functions."

/* What ends a message's body; <|start|> (a message the model began without
 * an <|end|>) also opens the next one. */
enum { ENDS_END, ENDS_START, ENDS_CALL, ENDS_RETURN };
static const char *const body_ends[] = {[ENDS_END] = H_END, [ENDS_START] = H_START, [ENDS_CALL] = H_CALL,
                                        [ENDS_RETURN] = H_RETURN};
static const char *const markers[] = {H_START, H_END, H_MESSAGE, H_CHANNEL, H_CONSTRAIN, H_CALL, H_RETURN};
enum { N_MARKERS = sizeof markers / sizeof markers[0] };

bool server_harmony_template(const char *tmpl, size_t len)
{
    return tmpl && memmem(tmpl, len, H_CHANNEL, strlen(H_CHANNEL)) && memmem(tmpl, len, H_MESSAGE, strlen(H_MESSAGE));
}

const char *const *server_harmony_markup(int *n)
{
    *n = N_MARKERS;
    return markers;
}

void server_harmony_free(struct server_harmony *h)
{
    for (int i = 0; i < h->n_calls; i++) {
        free(h->calls[i].name);
        free(h->calls[i].arguments);
    }
    free(h->calls);
    sbuf_free(&h->reasoning);
    sbuf_free(&h->content);
    memset(h, 0, sizeof *h);
}

static bool has_prefix(const char *s, size_t n, const char *lit)
{
    size_t l = strlen(lit);
    return n >= l && !memcmp(s, lit, l);
}

/* s[0..n) is a proper prefix of some marker (it may still become one). */
static bool partial_marker(const char *s, size_t n)
{
    for (int i = 0; i < N_MARKERS; i++)
        if (n < strlen(markers[i]) && !memcmp(s, markers[i], n))
            return true;
    return false;
}

/* How many bytes at the end of s[0..n) may still become a marker. */
static size_t held_back(const char *s, size_t n)
{
    size_t longest = strlen(H_CONSTRAIN);
    for (size_t k = n < longest ? n : longest; k > 0; k--)
        if (s[n - k] == '<' && partial_marker(s + n - k, k))
            return k;
    return 0;
}

/* The first of the terminators at or after s[i], or n; *which its index (-1: none). */
static size_t find_end(const char *s, size_t i, size_t n, int *which)
{
    size_t best = n;
    *which = -1;
    for (int k = 0; k < (int)(sizeof body_ends / sizeof body_ends[0]); k++) {
        const char *p = memmem(s + i, n - i, body_ends[k], strlen(body_ends[k]));
        if (p && (size_t)(p - s) < best) {
            best = (size_t)(p - s);
            *which = k;
        }
    }
    return best;
}

/* The word after key in the header h[0..n) (up to a space or '<'): "" if absent. */
static void header_word(const char *h, size_t n, const char *key, char *out, size_t cap)
{
    out[0] = '\0';
    const char *p = memmem(h, n, key, strlen(key));
    if (!p)
        return;
    p += strlen(key);
    size_t len = 0;
    while (p + len < h + n && p[len] != ' ' && p[len] != '<' && len + 1 < cap)
        len++;
    memcpy(out, p, len);
    out[len] = '\0';
}

static ks_status add_call(struct server_harmony *h, const char *name, const char *body, size_t n)
{
    while (n > 0 && (*body == ' ' || *body == '\n' || *body == '\t' || *body == '\r'))
        body++, n--;
    while (n > 0 && (body[n - 1] == ' ' || body[n - 1] == '\n' || body[n - 1] == '\t' || body[n - 1] == '\r'))
        n--;
    /* arguments as the other formats give them: compact JSON when the body is JSON */
    cJSON *args = cJSON_ParseWithLength(body, n);
    char *raw = args ? cJSON_PrintUnformatted(args) : strndup(body, n);
    cJSON_Delete(args);
    return server_tool_call_append(&h->calls, &h->n_calls, name, raw);
}

/* One message's body, complete or not, to where its channel sends it. */
static ks_status route_body(struct server_harmony *h, const char *hdr, size_t hdr_n, const char *body, size_t n,
                            bool complete, bool calls)
{
    char channel[32], to[128];
    header_word(hdr, hdr_n, H_CHANNEL, channel, sizeof channel);
    header_word(hdr, hdr_n, "to=", to, sizeof to);
    bool function = has_prefix(to, strlen(to), H_FUNCTIONS) && to[strlen(H_FUNCTIONS)];
    if (function && calls)
        return complete ? add_call(h, to + strlen(H_FUNCTIONS), body, n) : KS_OK;
    bool reasoning = !strcmp(channel, "analysis") || (to[0] && !function);
    sbuf_append(reasoning ? &h->reasoning : &h->content, body, n);
    return KS_OK;
}

/* Does the output start with a harmony header (or with what may become one)? */
static bool starts_with_header(const char *s, size_t n)
{
    static const char *const openers[] = {H_CHANNEL, H_MESSAGE, H_START, H_CONSTRAIN, " to=", "to="};
    for (size_t i = 0; i < sizeof openers / sizeof openers[0]; i++) {
        size_t l = strlen(openers[i]);
        if (n >= l ? !memcmp(s, openers[i], l) : !memcmp(s, openers[i], n))
            return true;
    }
    return false;
}

ks_status server_harmony_parse(const char *s, size_t n, bool final, bool calls, struct server_harmony *h)
{
    memset(h, 0, sizeof *h);
    ks_status st = KS_OK;
    if (!starts_with_header(s, n)) {
        sbuf_append(&h->content, s, final ? n : n - held_back(s, n));
        return h->content.oom ? (server_harmony_free(h), ks_fail(KS_ERR_NOMEM, "out of memory")) : KS_OK;
    }
    size_t i = 0;
    while (i < n && !st) {
        if (has_prefix(s + i, n - i, H_START))
            i += strlen(H_START);
        const char *msg = memmem(s + i, n - i, H_MESSAGE, strlen(H_MESSAGE));
        if (!msg) /* a header still being written; at the end one without a body says nothing */
            break;
        size_t hdr = i, hdr_n = (size_t)(msg - s) - i, body = (size_t)(msg - s) + strlen(H_MESSAGE);
        int which;
        size_t end = find_end(s, body, n, &which);
        bool complete = which >= 0 || final;
        if (which < 0 && !final)
            end -= held_back(s + body, end - body);
        st = route_body(h, s + hdr, hdr_n, s + body, end - body, complete, calls);
        if (which < 0)
            break;
        /* <|start|> opens the next message itself; the others end this one */
        i = end + (which == ENDS_START ? 0 : strlen(body_ends[which]));
        if (which != ENDS_START && i < n && !has_prefix(s + i, n - i, H_START)) {
            /* text between messages: content, up to the next message */
            const char *next = memmem(s + i, n - i, H_START, strlen(H_START));
            size_t stop = next ? (size_t)(next - s) : final ? n : n - held_back(s + i, n - i);
            sbuf_append(&h->content, s + i, stop - i);
            if (!next)
                break;
            i = stop;
        }
    }
    if (!st && (h->reasoning.oom || h->content.oom))
        st = ks_fail(KS_ERR_NOMEM, "out of memory parsing the harmony output");
    if (st)
        server_harmony_free(h);
    return st;
}
