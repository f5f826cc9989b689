/* A validator of JSON values against the JSON Schema subset the grammar
 * module compiles (src/grammar/grammar.h): type (one or a list), properties
 * in declared order, required, no other keys, items, maxItems, minLength,
 * maxLength, enum, const, anyOf, $ref "#/$defs/NAME". The reference the
 * grammar's output is checked against. */
#ifndef KS_TEST_SCHEMA_CHECK_H
#define KS_TEST_SCHEMA_CHECK_H

#include <stdbool.h>
#include <stddef.h>

#include <cjson/cJSON.h>

/* Does v satisfy schema (a part of root, which $ref resolves in)? When not,
 * why[0..cap) says what failed. */
bool ks_schema_valid(const cJSON *v, const cJSON *schema, const cJSON *root, char *why, size_t cap);

#endif
