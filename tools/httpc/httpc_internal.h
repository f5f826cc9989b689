/* httpc internals shared by the one-request and the many-streams halves. */
#ifndef KS_HTTPC_INTERNAL_H
#define KS_HTTPC_INTERNAL_H

#include <curl/curl.h>

#include "httpc/httpc.h"

/* curl_global_init, once per process. Errors: KS_ERR_INTERNAL. */
ks_status httpc_global_init(void);

/* Set method, URL, headers and body of rq on a fresh easy handle; *hdrs receives
 * the header list the handle points to (free it after the handle). The body is
 * copied into the handle. Errors: KS_ERR_INVALID_ARG (no url), KS_ERR_NOMEM,
 * KS_ERR_INTERNAL. */
ks_status httpc_easy_setup(CURL *e, const struct httpc_request *rq, struct curl_slist **hdrs);

#endif
