/* server: the loading responder of server.h. */
#include "server/server.h"

#include <arpa/inet.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct server_loading {
    struct MHD_Daemon *daemon;
    int port;
    bool handed_off;
};

/* llama-server's answer while it loads, on every route: probes and clients
 * that retry on 503 wait, the others see why. */
static const char LOADING_BODY[] = "{\"error\":{\"code\":503,\"message\":\"Loading model\",\"type\":\"unavailable_error\"}}";

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *data, size_t *data_size, void **state)
{
    (void)cls, (void)url, (void)method, (void)version, (void)data;
    if (!*state) { /* headers only: answer once the body (if any) is in, without keeping it */
        *state = c;
        return MHD_YES;
    }
    if (*data_size) {
        *data_size = 0;
        return MHD_YES;
    }
    struct MHD_Response *r =
        MHD_create_response_from_buffer(sizeof LOADING_BODY - 1, (void *)LOADING_BODY, MHD_RESPMEM_PERSISTENT);
    if (!r)
        return MHD_NO;
    MHD_add_response_header(r, "Content-Type", "application/json");
    MHD_add_response_header(r, "Retry-After", "1");
    enum MHD_Result ok = MHD_queue_response(c, 503, r);
    MHD_destroy_response(r);
    return ok;
}

ks_status server_loading_start(const char *host, int port, struct server_loading **out)
{
    *out = NULL;
    if (port < 0 || port > 65535)
        return ks_fail(KS_ERR_INVALID_ARG, "--port must be in 0..65535 (got %d)", port);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (inet_pton(AF_INET, host, &addr.sin_addr) != 1)
        return ks_fail(KS_ERR_INVALID_ARG, "--host '%s' is not an IPv4 address (e.g. 127.0.0.1 or 0.0.0.0)", host);
    struct server_loading *l = calloc(1, sizeof *l);
    if (!l)
        return ks_fail(KS_ERR_NOMEM, "server: out of memory");
    /* one polling thread, a short timeout and a small connection limit:
     * it answers 503 and nothing else, for as long as loading takes */
    l->daemon = MHD_start_daemon(MHD_USE_EPOLL_INTERNAL_THREAD | MHD_USE_ITC, (uint16_t)port, NULL, NULL, on_request,
                                 l, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&addr, MHD_OPTION_CONNECTION_TIMEOUT,
                                 10u, MHD_OPTION_CONNECTION_LIMIT, 256u, MHD_OPTION_CONNECTION_MEMORY_LIMIT,
                                 (size_t)16384, MHD_OPTION_END);
    if (!l->daemon) {
        free(l);
        return ks_fail(KS_ERR_IO, "cannot listen on %s:%d (port in use, or not allowed)", host, port);
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(l->daemon, MHD_DAEMON_INFO_BIND_PORT);
    l->port = info ? info->port : port;
    *out = l;
    return KS_OK;
}

int server_loading_port(const struct server_loading *l)
{
    return l->port;
}

int server_loading_handoff(struct server_loading *l)
{
    if (!l || !l->daemon || l->handed_off)
        return -1;
    l->handed_off = true;
    MHD_socket s = MHD_quiesce_daemon(l->daemon);
    return s == MHD_INVALID_SOCKET ? -1 : (int)s;
}

void server_loading_stop(struct server_loading *l)
{
    if (!l)
        return;
    if (l->daemon) {
        /* not handed off (loading failed): the socket is still the daemon's
         * and closes with it */
        MHD_stop_daemon(l->daemon);
    }
    free(l);
}
