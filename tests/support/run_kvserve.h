/* The real kvserve binary ($KVSERVE_BIN, which ctest sets) run from a test.
 *
 *   KS_NEED_KVSERVE();                            first thing in a case
 *   assert_int_equal(ks_run_kvserve("info", "-m x.gguf", out, cap), 0);
 *   ks_expect_text(out, "tensors: 48");
 */
#ifndef KS_TEST_RUN_KVSERVE_H
#define KS_TEST_RUN_KVSERVE_H

#include <stddef.h>
#include <stdlib.h>
#include <unistd.h>

#include "support/skip.h"

/* Skip the calling case unless $KVSERVE_BIN is executable. A macro, so that
 * the skip is recorded under the case's name (see skip.h). */
#define KS_NEED_KVSERVE()                                                                                         \
    do {                                                                                                          \
        const char *bin_ = getenv("KVSERVE_BIN");                                                                 \
        if (!bin_ || access(bin_, X_OK))                                                                          \
            KS_SKIP("KVSERVE_BIN not set or not executable (run through ctest)");                                 \
    } while (0)

/* Run `$KVSERVE_BIN COMMAND ARGS 2>&1` through the shell (args are shell
 * words, quoted by the caller where needed): its stdout and stderr into
 * out (at most cap - 1 bytes, NUL-terminated); returns its exit code, -1 when
 * it did not exit. */
int ks_run_kvserve(const char *command, const char *args, char *out, size_t cap);
/* The same with only its stdout in out (stderr discarded): what a command
 * prints as its result, e.g. generate's ids. stdin is empty in both. */
int ks_run_kvserve_stdout(const char *command, const char *args, char *out, size_t cap);

/* Fail the calling test, showing out, unless needle occurs in it. */
void ks_expect_text(const char *out, const char *needle);

#endif
