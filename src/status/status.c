#include "status/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

enum { ERRMSG_CAP = 1024 };
static _Thread_local char errmsg[ERRMSG_CAP];

const char *ks_strerror(ks_status st)
{
    switch (st) {
    case KS_OK: return "ok";
    case KS_ERR_INVALID_ARG: return "invalid argument";
    case KS_ERR_IO: return "I/O error";
    case KS_ERR_FORMAT: return "malformed input";
    case KS_ERR_UNSUPPORTED: return "unsupported";
    case KS_ERR_NOMEM: return "out of memory";
    case KS_ERR_KV_FULL: return "out of KV memory";
    case KS_ERR_RANGE: return "out of range";
    case KS_ERR_STATE: return "invalid state";
    case KS_ERR_NOT_FOUND: return "not found";
    case KS_ERR_INTERNAL: return "internal error";
    }
    return "unknown status";
}

ks_status ks_fail(ks_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(errmsg, sizeof errmsg, fmt, ap);
    va_end(ap);
    return st;
}

const char *ks_errmsg(void) { return errmsg; }

void ks_errmsg_prefix(const char *fmt, ...)
{
    char old[ERRMSG_CAP];
    memcpy(old, errmsg, sizeof old);
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(errmsg, sizeof errmsg, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n + 2 >= sizeof errmsg)
        return;
    size_t at = (size_t)n;
    memcpy(errmsg + at, ": ", 2);
    at += 2;
    size_t keep = strnlen(old, sizeof errmsg - at - 1);
    memcpy(errmsg + at, old, keep);
    errmsg[at + keep] = '\0';
}
