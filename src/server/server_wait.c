/* Waiting for the scheduler without a thread: a connection whose reply is
 * not ready is suspended and resumed by the scheduler's next event (see
 * server_internal.h). The watcher thread polls the suspended sockets for a
 * hangup, which libmicrohttpd does not see while a connection is suspended. */
#include "server/server_internal.h"

#include <errno.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

struct server_waker {
    struct server *srv;
    pthread_mutex_t mu;
    atomic_int refs;            /* atomic: the watcher takes one under the list's lock, which nests inside mu */
    struct MHD_Connection *conn;/* NULL once the connection closes */
    int fd;                     /* its socket */
    bool suspended;             /* the connection is suspended on this waker (under mu) */
    bool woken;                 /* a wake arrived while not suspended (under mu) */
    bool gone;                  /* the client hung up while suspended (under mu) */
    struct server_waker *prev, *next; /* srv->watch's list of suspended wakers (under watch->mu) */
};

/* A connection waiting for its next request's headers (MHD's socket context). */
struct head_wait {
    int fd;
    double deadline;            /* monotonic seconds */
    bool listed;
    struct head_wait *prev, *next;
};

struct server_watch {
    pthread_mutex_t mu;
    struct server_waker *head;  /* the suspended connections */
    int n;
    struct head_wait *hw_head, *hw_tail; /* by deadline (appended with the same timeout) */
    double timeout;             /* seconds to send a request's headers */
    bool stop;
    int wake_fd;                /* eventfd: the list changed, or stop */
    pthread_t thread;
};

struct server_waker *server_waker_new(struct server *srv, struct MHD_Connection *conn)
{
    struct server_waker *w = calloc(1, sizeof *w);
    if (!w)
        return NULL;
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    w->srv = srv;
    atomic_init(&w->refs, 1);
    w->conn = conn;
    w->fd = ci ? ci->connect_fd : -1;
    pthread_mutex_init(&w->mu, NULL);
    return w;
}

void server_waker_ref(struct server_waker *w)
{
    atomic_fetch_add(&w->refs, 1);
}

void server_waker_unref(struct server_waker *w)
{
    if (!w)
        return;
    if (atomic_fetch_sub(&w->refs, 1) > 1)
        return;
    pthread_mutex_destroy(&w->mu);
    free(w);
}

void server_waker_detach(struct server_waker *w)
{
    pthread_mutex_lock(&w->mu);
    w->conn = NULL;
    pthread_mutex_unlock(&w->mu);
}

static void watch_signal(struct server_watch *sw)
{
    uint64_t one = 1;
    while (write(sw->wake_fd, &one, sizeof one) < 0 && errno == EINTR)
        ;
}

static void watch_add(struct server_watch *sw, struct server_waker *w)
{
    pthread_mutex_lock(&sw->mu);
    w->prev = NULL;
    w->next = sw->head;
    if (sw->head)
        sw->head->prev = w;
    sw->head = w;
    sw->n++;
    pthread_mutex_unlock(&sw->mu);
    watch_signal(sw);
}

static void watch_remove(struct server_watch *sw, struct server_waker *w)
{
    pthread_mutex_lock(&sw->mu);
    if (w->prev)
        w->prev->next = w->next;
    else
        sw->head = w->next;
    if (w->next)
        w->next->prev = w->prev;
    w->prev = w->next = NULL;
    sw->n--;
    pthread_mutex_unlock(&sw->mu);
}

/* Under w->mu, w suspended: give the connection back to the daemon. */
static void resume_locked(struct server_waker *w)
{
    w->suspended = false;
    watch_remove(w->srv->watch, w);
    MHD_resume_connection(w->conn);
}

void server_wake(struct server_waker *w)
{
    pthread_mutex_lock(&w->mu);
    if (w->suspended)
        resume_locked(w);
    else
        w->woken = true;
    pthread_mutex_unlock(&w->mu);
}

bool server_waker_sleep(struct server_waker *w)
{
    pthread_mutex_lock(&w->mu);
    bool sleep = !w->woken && !w->gone && w->conn;
    w->woken = false;
    if (sleep) {
        /* suspended and listed under w->mu, so a wake cannot come between and be lost */
        w->suspended = true;
        MHD_suspend_connection(w->conn);
        watch_add(w->srv->watch, w);
    }
    pthread_mutex_unlock(&w->mu);
    return sleep;
}

bool server_waker_gone(struct server_waker *w)
{
    pthread_mutex_lock(&w->mu);
    bool gone = w->gone;
    pthread_mutex_unlock(&w->mu);
    return gone;
}

/* ---- the header deadline ----------------------------------------------------------
 *
 * libmicrohttpd's timeout counts idle time only, so a client sending a byte
 * of headers every few seconds (slowloris) would hold its connection
 * forever. Each connection's request headers must be complete within the
 * timeout of its opening (or of its previous request's end); past that the
 * watcher shuts the socket down and the daemon closes it. The socket is
 * unlisted before libmicrohttpd closes it (the CLOSED notification comes
 * first), so a shutdown never reaches a reused descriptor. */

static double mono_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Under sw->mu. */
static void hw_unlist(struct server_watch *sw, struct head_wait *h)
{
    if (!h->listed)
        return;
    if (h->prev)
        h->prev->next = h->next;
    else
        sw->hw_head = h->next;
    if (h->next)
        h->next->prev = h->prev;
    else
        sw->hw_tail = h->prev;
    h->prev = h->next = NULL;
    h->listed = false;
}

static void hw_list(struct server_watch *sw, struct head_wait *h)
{
    pthread_mutex_lock(&sw->mu);
    hw_unlist(sw, h);
    bool was_empty = !sw->hw_head;
    h->deadline = mono_now() + sw->timeout;
    h->listed = true;
    h->prev = sw->hw_tail;
    if (sw->hw_tail)
        sw->hw_tail->next = h;
    else
        sw->hw_head = h;
    sw->hw_tail = h;
    pthread_mutex_unlock(&sw->mu);
    if (was_empty) /* the watcher sleeps without a deadline */
        watch_signal(sw);
}

void server_watch_connection(struct server *srv, struct MHD_Connection *conn, void **socket_context, bool open)
{
    struct server_watch *sw = srv->watch;
    struct head_wait *h = *socket_context;
    if (open) {
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
        h = calloc(1, sizeof *h);
        if (!h || !ci) { /* out of memory: the idle timeout alone applies */
            free(h);
            return;
        }
        h->fd = ci->connect_fd;
        *socket_context = h;
        hw_list(sw, h);
    } else if (h) {
        pthread_mutex_lock(&sw->mu);
        hw_unlist(sw, h);
        pthread_mutex_unlock(&sw->mu);
        free(h);
        *socket_context = NULL;
    }
}

/* The request's headers have arrived (began) or its reply is done (the next request's deadline starts). */
void server_watch_request(struct server *srv, struct MHD_Connection *conn, bool began)
{
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    struct head_wait *h = ci ? ci->socket_context : NULL;
    if (!h)
        return;
    struct server_watch *sw = srv->watch;
    if (began) {
        pthread_mutex_lock(&sw->mu);
        hw_unlist(sw, h);
        pthread_mutex_unlock(&sw->mu);
    } else {
        hw_list(sw, h);
    }
}

/* Shut the sockets past their header deadline; the poll timeout (ms) until
 * the next deadline, -1: none. */
static int hw_expire(struct server_watch *sw)
{
    double now = mono_now();
    pthread_mutex_lock(&sw->mu);
    while (sw->hw_head && sw->hw_head->deadline <= now) {
        struct head_wait *h = sw->hw_head;
        shutdown(h->fd, SHUT_RDWR);
        hw_unlist(sw, h);
    }
    int ms = sw->hw_head ? (int)((sw->hw_head->deadline - now) * 1000) + 1 : -1;
    pthread_mutex_unlock(&sw->mu);
    return ms;
}

/* ---- the watcher ----------------------------------------------------------------- */

/* The watched sockets (and the eventfd first), each waker referenced so it
 * outlives the poll; n entries, NULL when out of memory. */
static struct pollfd *watch_snapshot(struct server_watch *sw, struct server_waker ***ws, int *n)
{
    pthread_mutex_lock(&sw->mu);
    int k = sw->n;
    struct pollfd *fds = calloc((size_t)k + 1, sizeof *fds);
    *ws = calloc((size_t)k + 1, sizeof **ws);
    if (!fds || !*ws) {
        pthread_mutex_unlock(&sw->mu);
        free(fds);
        free(*ws);
        *n = 0;
        return NULL;
    }
    fds[0] = (struct pollfd){.fd = sw->wake_fd, .events = POLLIN};
    int i = 1;
    for (struct server_waker *w = sw->head; w; w = w->next, i++) {
        server_waker_ref(w);
        (*ws)[i] = w;
        /* only a hangup: data a client pipelines after its request is not an event */
        fds[i] = (struct pollfd){.fd = w->fd, .events = POLLRDHUP};
    }
    pthread_mutex_unlock(&sw->mu);
    *n = i;
    return fds;
}

static void mark_gone(struct server_waker *w)
{
    pthread_mutex_lock(&w->mu);
    if (w->suspended) {
        w->gone = true;
        resume_locked(w);
    }
    pthread_mutex_unlock(&w->mu);
}

static void *watch_main(void *arg)
{
    struct server_watch *sw = arg;
    for (;;) {
        pthread_mutex_lock(&sw->mu);
        bool stop = sw->stop;
        pthread_mutex_unlock(&sw->mu);
        if (stop)
            return NULL;
        struct server_waker **ws;
        int n;
        struct pollfd *fds = watch_snapshot(sw, &ws, &n);
        if (!fds) {
            usleep(100000); /* out of memory: try again soon */
            continue;
        }
        if (poll(fds, (nfds_t)n, hw_expire(sw)) > 0) {
            if (fds[0].revents & POLLIN) {
                uint64_t v;
                ssize_t rd = read(sw->wake_fd, &v, sizeof v);
                (void)rd;
            }
            for (int i = 1; i < n; i++)
                if (fds[i].revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL))
                    mark_gone(ws[i]);
        }
        for (int i = 1; i < n; i++)
            server_waker_unref(ws[i]);
        free(ws);
        free(fds);
    }
}

void server_watch_release_all(struct server *srv)
{
    struct server_watch *sw = srv->watch;
    if (!sw)
        return;
    for (;;) {
        pthread_mutex_lock(&sw->mu);
        struct server_waker *w = sw->head;
        if (w)
            server_waker_ref(w);
        pthread_mutex_unlock(&sw->mu);
        if (!w)
            return;
        mark_gone(w); /* resumes it, which unlists it */
        server_waker_unref(w);
    }
}

ks_status server_watch_start(struct server *srv, int timeout_s)
{
    struct server_watch *sw = calloc(1, sizeof *sw);
    if (!sw)
        return ks_fail(KS_ERR_NOMEM, "server: out of memory");
    sw->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (sw->wake_fd < 0) {
        free(sw);
        return ks_fail(KS_ERR_IO, "server: cannot create an eventfd (%s)", strerror(errno));
    }
    pthread_mutex_init(&sw->mu, NULL);
    sw->timeout = timeout_s;
    if (pthread_create(&sw->thread, NULL, watch_main, sw) != 0) {
        pthread_mutex_destroy(&sw->mu);
        close(sw->wake_fd);
        free(sw);
        return ks_fail(KS_ERR_IO, "server: cannot start the connection watcher thread");
    }
    srv->watch = sw;
    return KS_OK;
}

void server_watch_stop(struct server *srv)
{
    struct server_watch *sw = srv->watch;
    if (!sw)
        return;
    pthread_mutex_lock(&sw->mu);
    sw->stop = true;
    pthread_mutex_unlock(&sw->mu);
    watch_signal(sw);
    pthread_join(sw->thread, NULL);
    pthread_mutex_destroy(&sw->mu);
    close(sw->wake_fd);
    free(sw);
    srv->watch = NULL;
}
