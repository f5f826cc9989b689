/* The front door: what a request's headers alone decide, before its body is
 * read. A page on another site can make a browser send requests here: a
 * "simple" cross-origin POST (text/plain or a form) goes out without a
 * preflight, and a DNS-rebinding page reaches a loopback server under its
 * own host name. So: POST routes take only application/json (a browser
 * preflights that), a request whose Origin is not this server's is refused
 * unless --cors-origin allows it, and a server bound to loopback answers
 * only to loopback Host names (and --allowed-host). */
#include "server/server_internal.h"

#include <stdio.h>
#include <string.h>
#include <strings.h>

/* s[0..n) equals t, ignoring case. */
static bool span_is(const char *s, size_t n, const char *t)
{
    return strlen(t) == n && strncasecmp(s, t, n) == 0;
}

static bool in_list(const char *const *list, const char *s, size_t n)
{
    for (; list && *list; list++)
        if (span_is(s, n, *list))
            return true;
    return false;
}

/* The name part of a Host header: "[::1]" of "[::1]:8080", "a.b" of "a.b:80". */
static size_t host_name_len(const char *host)
{
    if (host[0] == '[') {
        const char *end = strchr(host, ']');
        return end ? (size_t)(end - host) + 1 : strlen(host);
    }
    return strcspn(host, ":");
}

static bool host_allowed(const struct server *srv, const char *host)
{
    if (!srv->host_loopback || !host)
        return true; /* an HTTP/1.0 request without Host comes from no browser */
    size_t n = host_name_len(host);
    return span_is(host, n, "localhost") || span_is(host, n, "127.0.0.1") || span_is(host, n, "[::1]") ||
           span_is(host, n, srv->host) || in_list(srv->cfg.allowed_hosts, host, n);
}

/* The request's Origin is this server's own (the page it serves at /),
 * over http or, behind a TLS proxy that keeps the Host, https. */
static bool same_origin(const struct server_head *h)
{
    if (!h->host)
        return false;
    const char *o = h->origin;
    if (strncasecmp(o, "http://", 7) == 0)
        o += 7;
    else if (strncasecmp(o, "https://", 8) == 0)
        o += 8;
    else
        return false;
    return strcasecmp(o, h->host) == 0;
}

static bool origin_allowed(const struct server *srv, const char *origin)
{
    for (const char *const *o = srv->cfg.cors_origins; o && *o; o++) {
        size_t n = strlen(*o);
        while (n > 1 && (*o)[n - 1] == '/')
            n--;
        if (!strcmp(*o, "*") || (strlen(origin) == n && !strncasecmp(origin, *o, n)))
            return true;
    }
    return false;
}

/* application/json, with or without parameters (charset). */
static bool is_json_type(const char *ct)
{
    if (!ct)
        return false;
    ct += strspn(ct, " \t");
    static const char json[] = "application/json";
    size_t n = sizeof json - 1;
    return strncasecmp(ct, json, n) == 0 && (ct[n] == '\0' || ct[n] == ';' || ct[n] == ' ' || ct[n] == '\t');
}

/* A cross-origin request the configuration allows (CORS headers go on its reply). */
static bool cors_request(const struct server *srv, const struct server_head *h)
{
    return h->origin && !same_origin(h) && origin_allowed(srv, h->origin);
}

bool server_guard(const struct server *srv, const struct server_head *h, bool post_route, struct reply *r)
{
    if (!host_allowed(srv, h->host)) {
        server_reply_error(r, 421, "host_not_allowed",
                           "the server is bound to a loopback address and does not answer to Host '%.200s' "
                           "(start it with --allowed-host NAME to accept that name)", h->host);
        return true;
    }
    if (h->origin && !same_origin(h) && !origin_allowed(srv, h->origin)) {
        server_reply_error(r, 403, "origin_not_allowed",
                           "cross-origin requests from '%.200s' are refused (start the server with "
                           "--cors-origin ORIGIN to allow them)", h->origin);
        return true;
    }
    if (!strcmp(h->method, "OPTIONS")) {
        reply_text(r, 204, NULL, NULL, 0);
        return true;
    }
    if (post_route && !strcmp(h->method, "POST") && !is_json_type(h->content_type)) {
        server_reply_error(r, 415, "unsupported_media_type",
                           "%s takes a JSON body: send the header 'Content-Type: application/json' (got %.100s)",
                           h->path, h->content_type ? h->content_type : "none");
        return true;
    }
    return false;
}

void server_guard_cors_headers(const struct server *srv, const struct server_head *h, struct MHD_Response *resp)
{
    if (!strcmp(h->method, "OPTIONS"))
        MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, "GET, HEAD, POST, OPTIONS");
    if (!cors_request(srv, h))
        return;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_ACCESS_CONTROL_ALLOW_ORIGIN, h->origin);
    MHD_add_response_header(resp, MHD_HTTP_HEADER_VARY, "Origin");
    if (!strcmp(h->method, "OPTIONS")) {
        MHD_add_response_header(resp, "Access-Control-Allow-Methods", "GET, HEAD, POST, OPTIONS");
        MHD_add_response_header(resp, "Access-Control-Allow-Headers",
                                h->acr_headers ? h->acr_headers : "Authorization, Content-Type");
        MHD_add_response_header(resp, "Access-Control-Max-Age", "600");
    }
}
