/* A whole file into memory, for tests that read reference data. */
#ifndef KS_TEST_READ_FILE_H
#define KS_TEST_READ_FILE_H

#include <stddef.h>

/* The file's bytes plus a terminating NUL (malloc'd; free it), its size in
 * *len (len may be NULL); NULL (and *len untouched) when it cannot be opened or
 * read. */
char *ks_read_file(const char *path, size_t *len);

#endif
