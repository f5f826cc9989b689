/* route's internals: the router's state shared by its HTTP side (route.c),
 * its forwarding (route_forward.c), its health checks and its events reader
 * (route_watch.c). */
#ifndef KS_ROUTE_INTERNAL_H
#define KS_ROUTE_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include "route/route.h"

struct route_replica {
    char *url;                /* base URL without a trailing slash */
    atomic_bool healthy;
    atomic_int in_flight;     /* requests forwarded and not finished */
    atomic_long active_pages; /* their prompts' pages */
    atomic_ulong forwarded;
};

struct route {
    struct route_config cfg;
    struct route_replica rep[ROUTE_MAX_REPLICAS];
    int n_rep;
    struct route_index *index;
    struct MHD_Daemon *daemon;
    int port;
    char *redis_password;

    pthread_mutex_t mu;       /* stop and its wakeup */
    pthread_cond_t wake;
    atomic_bool stop;
    pthread_t health, events;
    bool health_started, events_started;
    atomic_uint turn;         /* ties go round */
    atomic_ulong requests, by_overlap, overlap_pages, unread, no_replica;
    atomic_bool events_connected;
};

/* route_watch.c */
void *route_health_main(void *arg);
void *route_events_main(void *arg);
/* One round of health checks now (at start, and after a connection failed). */
void route_check_health(struct route *rt);
/* Sleep up to ms, false once the router stops. */
bool route_nap(struct route *rt, int ms);

struct MHD_Connection;
/* route.c: answer the connection with a JSON text (copied), as MHD_queue_response returns. */
int route_answer_json(struct MHD_Connection *c, unsigned status, const char *json);

/* route_forward.c: forward one request (the body is taken) and answer the connection with the replica's reply. */
int route_forward(struct route *rt, struct MHD_Connection *c, const char *method, const char *uri, char *body,
                  size_t len);

#endif
