/* status: one enum of status codes for every kvserve module, and a per-thread
 * message that says what went wrong in words a user can act on.
 *
 * Contract (LMDB style): every function that can fail returns ks_status; 0 is
 * success. On failure it has called ks_fail(), so ks_errmsg() on the same thread
 * describes the failure until the next ks_fail() on that thread. */
#ifndef KS_STATUS_H
#define KS_STATUS_H

#include <stddef.h>

typedef enum ks_status {
    KS_OK = 0,
    KS_ERR_INVALID_ARG,  /* the caller passed a bad value (flag, JSON field, id) */
    KS_ERR_IO,           /* the OS refused: open, read, mmap, write */
    KS_ERR_FORMAT,       /* input data is malformed (corrupt GGUF, bad UTF-8 ...) */
    KS_ERR_UNSUPPORTED,  /* well-formed but not supported (tensor type, arch) */
    KS_ERR_NOMEM,        /* a host allocation failed */
    KS_ERR_KV_FULL,      /* the KV budget is exhausted even at the precision floor */
    KS_ERR_RANGE,        /* out of range: context overflow, token id, position */
    KS_ERR_STATE,        /* call not allowed in the object's current state */
    KS_ERR_NOT_FOUND,    /* a key, tensor, sequence or request does not exist */
    KS_ERR_INTERNAL,     /* a broken invariant: a bug in kvserve */
} ks_status;

/* Short fixed name of a status ("invalid argument", ...). Never NULL. */
const char *ks_strerror(ks_status st);

/* Record a printf-style message for this thread and return st, so callers
 * can write `return ks_fail(KS_ERR_FORMAT, "tensor %s: ...", name);`. */
ks_status ks_fail(ks_status st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* The message of the last ks_fail() on this thread, or "" if none. The
 * pointer stays valid until the next ks_fail() on this thread. */
const char *ks_errmsg(void);

/* Prefix the current message with more context: "loading model: <old>". */
void ks_errmsg_prefix(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
