#include "support/skip.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

enum { MAX_SKIPPED = 64 };

static struct {
    char name[64], reason[256];
} g_skipped[MAX_SKIPPED];
static size_t g_n_skipped;

void ks_skip_note(const char *case_name, const char *fmt, ...)
{
    char reason[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(reason, sizeof reason, fmt, ap);
    va_end(ap);
    printf("SKIPPED CASE %s: %s\n", case_name, reason);
    fflush(stdout);
    if (g_n_skipped < MAX_SKIPPED) {
        snprintf(g_skipped[g_n_skipped].name, sizeof g_skipped[0].name, "%s", case_name);
        snprintf(g_skipped[g_n_skipped].reason, sizeof g_skipped[0].reason, "%s", reason);
    }
    g_n_skipped++;
}

int ks_skip_status(int failed, size_t n_cases)
{
    if (failed) /* 1, not the count: 77 failures must not read as skipped, nor 256 as passed */
        return 1;
    if (g_n_skipped == 0)
        return 0;
    if (g_n_skipped >= n_cases) {
        printf("SKIPPED: all %zu cases (exit %d, reported as skipped)\n", n_cases, KS_SKIP_EXIT);
        return KS_SKIP_EXIT;
    }
    /* One line after cmocka's summary, where a reader (and scripts/test.sh) looks. */
    printf("SKIPPED %zu of %zu cases:", g_n_skipped, n_cases);
    for (size_t i = 0; i < g_n_skipped && i < MAX_SKIPPED; i++)
        printf(" %s (%s)%s", g_skipped[i].name, g_skipped[i].reason, i + 1 < g_n_skipped ? ";" : "");
    printf("\n");
    return 0;
}

int ks_skip_all(const char *fmt, ...)
{
    char reason[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(reason, sizeof reason, fmt, ap);
    va_end(ap);
    printf("SKIPPED: %s (exit %d, reported as skipped)\n", reason, KS_SKIP_EXIT);
    return KS_SKIP_EXIT;
}
