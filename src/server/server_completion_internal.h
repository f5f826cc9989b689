/* Internal to the completion routes (/v1/chat/completions, /v1/completions),
 * shared by their three files: server_completion.c (a request's calls from
 * start to release: the scheduler's events, submission, the routes),
 * server_completion_parse.c (the body -> a call's options and the scheduler
 * request) and server_completion_reply.c (token events -> text, as one JSON
 * response or as SSE chunks). */
#ifndef KS_SERVER_COMPLETION_INTERNAL_H
#define KS_SERVER_COMPLETION_INTERNAL_H

#include "server/server_internal.h"

#define MAX_STOP 4
#define MAX_STOP_LEN 256
#define MAX_CHOICES 16

struct item {
    int32_t token;
    struct sample_result res;
};

/* One choice of a request, shared by its HTTP thread and the scheduler
 * thread (which holds a reference until the final event). */
struct call {
    struct server *srv;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;
    /* filled by the scheduler thread */
    struct item *items;
    int n_items, cap_items;
    bool finished;
    bool dropped;                      /* a token could not be queued (out of memory): cancelled */
    enum sched_finish finish;
    char error[256];
    /* request options */
    uint64_t sched_id;
    bool chat, stream, include_usage;
    bool native;                       /* llama-server's /completion: its answer's shape */
    int logprobs;                      /* -1: off; else number of alternatives */
    bool post_probs;                   /* /completion's post_sampling_probs: "prob" / "top_probs" of the final distribution */
    char *stop[MAX_STOP];
    int n_stop;
    size_t max_stop;
    char id[48];
    long created;
    int index;                         /* the choice's index in 'choices' */
    int n_choices;                     /* 'n' of the request */
    int32_t n_prompt;
    int32_t n_cached;                  /* prompt tokens the prefix cache served (under mu) */
    int32_t n_drafted, n_accepted;     /* speculation: draft tokens verified, accepted (under mu) */
    struct server_waker *waker;        /* woken at each event (under mu); NULL: the HTTP side blocks, or left */
    struct grammar *grammar;           /* response_format / grammar constraint, NULL: none */
    bool grammar_whole;                /* it constrains the whole output (not lazy tool calls) */
    struct sample_bias *biases;        /* logit_bias (the sampling params point here), NULL: none */
    int n_biases;
    struct sample_dry_breakers *dry_breakers; /* DRY's processed breakers (the params point here), NULL: none */
    /* output state (HTTP thread only) */
    int consumed;
    struct tok_stream *detok;
    struct sbuf text;                  /* generated text, cut at a stop string */
    size_t sent;                       /* bytes of text already streamed */
    bool stopped;                      /* a stop string matched */
    int stop_word;                     /* the stop string that matched (index in stop), -1: none */
    /* times (CLOCK_MONOTONIC seconds, under mu): submission, first token, end (0: not yet) */
    double t_submit, t_first, t_end;
    cJSON *lp;                         /* accumulated logprobs (non-streaming), NULL: none asked */
    bool oom;                          /* output was lost to an allocation failure */
    bool waited;                       /* a whole reply: its wait has begun (lp is set up) */
    struct sbuf out;                   /* pending SSE bytes */
    size_t out_pos;
    const char *tail;                  /* static SSE bytes sent after out (the out-of-memory error) */
    size_t tail_pos;
    bool role_sent, done;              /* done: the choice's last chunk is in out */
    /* tool calling (chat) */
    struct server_tool_opts tools;
    enum server_tool_format tool_fmt;  /* SERVER_TOOLS_NONE: the output is all content */
    int calls_sent;                    /* tool calls already streamed */
    int n_calls;                       /* tool calls in the answer (set by the final parse) */
    bool harmony_calls;                /* harmony: tools offered, so its calls are parsed */
    size_t sent_reasoning, sent_content; /* harmony, think: bytes of each part already streamed */
    /* reasoning in <think>...</think> (chat, not harmony) */
    bool think;                        /* split the reasoning off (reasoning_format) */
    bool think_open;                   /* the prompt opened <think>: the output starts in it */
    size_t content_off;                /* think: text[content_off..) is the content */
};

/* The n choices of one request (HTTP thread). A stream serves them in
 * turn, a choice's chunks in order; it ends with one usage chunk and one
 * [DONE]. */
struct group {
    struct server *srv;
    struct call *calls[MAX_CHOICES];
    int n;
    int turn;                          /* the choice the stream serves next */
    struct server_waker *waker;        /* the connection's (a reference), NULL: in-process, blocking */
    bool ended;                        /* [DONE] (or a failure's end) is in calls[turn]'s out */
};

#define DROPPED_MSG "out of memory: a generated token could not be kept; the request was cancelled"
#define OOM_MSG "out of memory while writing the response; the request was cancelled"

/* Which API a request speaks. */
enum server_api {
    SERVER_API_CHAT,   /* /v1/chat/completions */
    SERVER_API_TEXT,   /* /v1/completions */
    SERVER_API_NATIVE, /* llama-server's /completion */
};
/* server_completion_parse for any API (server_completion_parse is this for chat or text). */
ks_status server_request_parse(struct server *srv, enum server_api api, const char *body, size_t len,
                               struct call **out, struct sched_request *rq, struct reply *r);
/* Seconds on CLOCK_MONOTONIC. */
double server_now(void);

/* Drop one reference; the last frees the call. */
void server_call_unref(struct call *c);
/* Scheduler thread: queue the token or the end (sched_request.on_event; user is the call). */
void server_call_on_event(void *user, const struct sched_event *ev);
/* A new call with the request's id (NULL when out of memory). */
struct call *server_call_new(struct server *srv, bool chat);
/* The HTTP side is done with the group: choices still running are cancelled, g is freed. */
void server_group_done(struct group *g);

/* Wait for every choice and answer with one JSON response (the caller then
 * calls server_group_done). */
ks_status server_reply_whole(struct group *g, struct reply *r);
/* The same answer without blocking: the connection waits suspended and the
 * router polls it at each event (the reply owns g from here). */
void server_reply_wait(struct group *g, struct reply *r);
/* Answer with an SSE stream of the choices' chunks; the stream owns g from
 * here and releases it (server_group_done) when the connection ends. */
void server_reply_stream(struct group *g, struct reply *r);

/* server_samplers.c: a request's typical_p, min_keep, top_n_sigma, dynatemp_*,
 * xtc_*, dry_*, mirostat*, samplers into p (over the server's defaults); the
 * DRY breakers are processed into c->dry_breakers when DRY is on. */
ks_status server_parse_samplers(struct call *c, const cJSON *root, struct sample_params *p, struct reply *r);

#endif
