/* GET /: the live page of the KV pool. The page is src/server/page/index.html
 * (self-contained: no external assets), embedded at build time by
 * src/server/page/page.cmake. It polls /cache/usage once a second and shows
 * the KV pool as one row of pages per request in token order (each page
 * split: K precision on top, V below; shared pages outlined), the prefix
 * cache's idle pages (dashed, greyed), the free pages, a chart of usage over
 * time with the dynamic policy's watermarks, the requests, the largest cached
 * prefixes (GET /cache/prefixes, every fifth poll), a requantize form with a
 * dry run, and the run-time policy form (POST /cache/policy). #grid carries
 * data-used-pages, data-idle-pages, data-requests and data-polls for the
 * headless-browser test.
 *
 * The page holds no data, so it is served without the API key; when a fetch
 * answers 401 it asks for the key once, keeps it in sessionStorage and sends
 * it as an Authorization header (never in the URL, which ends up in logs). */
#include "server/server_internal.h"

extern const unsigned char server_page_html[];
extern const size_t server_page_html_len;

ks_status server_route_page(struct server *srv, const struct server_req *rq, struct reply *r)
{
    (void)srv;
    (void)rq;
    r->body_static = true;
    return reply_text(r, 200, "text/html; charset=utf-8", (char *)server_page_html, server_page_html_len);
}
