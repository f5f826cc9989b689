/* Skipped cases that cannot pass silently.
 *
 * cmocka's skip() counts a case as passed, so a test binary whose inputs are
 * missing would show green in ctest. Tests skip through this module instead:
 *
 *   KS_SKIP("no %s", path);                 in a case: records the case and why,
 *                                           prints it, then cmocka's skip()
 *   return ks_run_tests(tests, setup, td);  in main, instead of
 *                                           cmocka_run_group_tests
 *   return ks_skip_all("no %s", path);      in main, before running anything
 *
 * The exit status is 1 when any case failed (cmocka prints how many); else 77
 * (KS_SKIP_EXIT, the SKIP_RETURN_CODE CMake gives every unit test, so ctest
 * reports "Not Run" / skipped) when every case skipped; else 0, after a
 * "SKIPPED k of n cases: <name> (<reason>); ..." line on stdout, which
 * scripts/test.sh collects. A case must call KS_SKIP itself, not through a
 * helper function, so that the recorded name is the case's. */
#ifndef KS_TEST_SKIP_H
#define KS_TEST_SKIP_H

#include <stddef.h>

#define KS_SKIP_EXIT 77

/* Record the calling case as skipped (with a printf-style reason) and skip it. */
#define KS_SKIP(...)                                                                                              \
    do {                                                                                                          \
        ks_skip_note(__func__, __VA_ARGS__);                                                                      \
        skip();                                                                                                   \
    } while (0)

/* Run a cmocka group and turn failures and recorded skips into the exit status
 * described above. */
#define ks_run_tests(tests, setup, teardown)                                                                      \
    ks_skip_status(cmocka_run_group_tests(tests, setup, teardown), sizeof(tests) / sizeof((tests)[0]))

void ks_skip_note(const char *case_name, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* failed: cmocka_run_group_tests' result; n_cases: the group's size. */
int ks_skip_status(int failed, size_t n_cases);

/* Print "SKIPPED: <reason>" and return KS_SKIP_EXIT, for a binary that can run
 * none of its cases. */
int ks_skip_all(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
