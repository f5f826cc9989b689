#include "support/run_kvserve.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <cmocka.h>

static int run(const char *command, const char *args, const char *stderr_to, char *out, size_t cap)
{
    char cmd[8192];
    int n_cmd = snprintf(cmd, sizeof cmd, "'%s' %s %s </dev/null 2>%s", getenv("KVSERVE_BIN"), command, args, stderr_to);
    assert_true(n_cmd > 0 && (size_t)n_cmd < sizeof cmd);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = '\0';
    int status = pclose(p);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

int ks_run_kvserve(const char *command, const char *args, char *out, size_t cap)
{
    return run(command, args, "&1", out, cap);
}

int ks_run_kvserve_stdout(const char *command, const char *args, char *out, size_t cap)
{
    return run(command, args, "/dev/null", out, cap);
}

void ks_expect_text(const char *out, const char *needle)
{
    if (!strstr(out, needle))
        fail_msg("missing '%s' in:\n%s", needle, out);
}
