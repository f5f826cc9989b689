/* gguf: read and write GGUF v2/v3 model files.
 *
 * The reader mmaps the file and validates all of it up front: magic, version,
 * counts, every string and array length, overflow in size arithmetic, known
 * tensor types, dimension products, alignment, and each tensor's bytes against
 * the file size. After gguf_open() succeeds, every accessor below is safe:
 * nothing can point outside the mapping. A malformed file returns
 * KS_ERR_FORMAT with a message naming the offending key/tensor and offset;
 * a well-formed file kvserve cannot use (GGUF v1, big-endian, a tensor type
 * without a quant_traits() entry) returns KS_ERR_UNSUPPORTED. Limits beyond
 * the spec's: tensor names up to 63 bytes (as ggml), keys up to 65535 bytes,
 * arrays nested up to 8 levels, no NUL bytes inside keys or tensor names. A
 * file with no tensors may end before its (aligned) data offset.
 *
 * Memory: keys and tensor names are NUL-terminated copies owned by the file.
 * String values (including the elements of string arrays) point into the
 * mapping and are NOT NUL-terminated; use their len. Everything stays valid
 * until gguf_close(). */
#ifndef KS_GGUF_H
#define KS_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "quant/quant.h"
#include "status/status.h"

#define GGUF_MAGIC "GGUF"
#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_DIMS 4

enum gguf_value_type {
    GGUF_TYPE_UINT8 = 0,
    GGUF_TYPE_INT8 = 1,
    GGUF_TYPE_UINT16 = 2,
    GGUF_TYPE_INT16 = 3,
    GGUF_TYPE_UINT32 = 4,
    GGUF_TYPE_INT32 = 5,
    GGUF_TYPE_FLOAT32 = 6,
    GGUF_TYPE_BOOL = 7,
    GGUF_TYPE_STRING = 8,
    GGUF_TYPE_ARRAY = 9,
    GGUF_TYPE_UINT64 = 10,
    GGUF_TYPE_INT64 = 11,
    GGUF_TYPE_FLOAT64 = 12,
    GGUF_TYPE_COUNT
};

struct gguf_str {
    uint64_t len;
    const char *data; /* not NUL-terminated */
};

struct gguf_file;

struct gguf_tensor_info {
    const char *name;             /* NUL-terminated */
    uint32_t n_dims;              /* 1..GGUF_MAX_DIMS */
    int64_t ne[GGUF_MAX_DIMS];    /* ne[0] is the contiguous (row) dimension; unused dims are 1 */
    enum quant_type type;
    uint64_t offset;              /* relative to the data section */
    uint64_t nbytes;
    const void *data;             /* inside the mapping */
};

/* Open and validate a file, mapped read-only (shares the page cache). */
ks_status gguf_open(const char *path, struct gguf_file **out);

/* Like gguf_open, but read the file into private anonymous memory backed by
 * transparent huge pages when the kernel allows (madvise). Decode streams
 * every weight once per token; with 4 KiB file pages that is one TLB miss
 * per page, and measured decode was up to 20% slower (most with several
 * threads). Falls back to gguf_open's mapping when the memory is refused or the
 * file is over 3/4 of physical RAM (a private copy could not be paged out).
 * The copy starts where the most tensor bytes land on 64-byte cache lines
 * (the file is parsed in its mapping first to find them). */
ks_status gguf_open_private(const char *path, struct gguf_file **out);
/* p .. p + n inside the private copy of gguf_open_private, writable: for a
 * loader that transforms tensors in place (the file is never written). NULL
 * when the file is mapped (gguf_open, or gguf_open_private's fallback), for
 * gguf_open_memory, or when the range is not inside the handle's bytes. */
void *gguf_private_bytes(struct gguf_file *f, const void *p, size_t n);
/* Validate a caller-owned buffer (fuzzing, tests); it must outlive the handle. */
ks_status gguf_open_memory(const void *data, size_t size, struct gguf_file **out);
void gguf_close(struct gguf_file *f);

uint32_t gguf_version(const struct gguf_file *f);
uint64_t gguf_alignment(const struct gguf_file *f);
uint64_t gguf_data_offset(const struct gguf_file *f);
size_t gguf_file_size(const struct gguf_file *f);
/* The bytes before the data section (header, metadata, tensor table): what
 * identifies a model's weights without reading them. *len_out gets the size. */
const void *gguf_header_bytes(const struct gguf_file *f, size_t *len_out);

/* ---- metadata ---------------------------------------------------------- */
int64_t gguf_n_kv(const struct gguf_file *f);
/* Index of key, or -1. */
int64_t gguf_find_key(const struct gguf_file *f, const char *key);
const char *gguf_key_at(const struct gguf_file *f, int64_t i);
enum gguf_value_type gguf_type_at(const struct gguf_file *f, int64_t i);
const char *gguf_type_name(enum gguf_value_type t);

/* Typed getters by key. They return KS_ERR_NOT_FOUND if the key is absent and
 * KS_ERR_FORMAT if its type does not convert: integer getters accept any
 * integer type whose value fits, gguf_get_f32 accepts FLOAT32/FLOAT64 and
 * integers. Out-parameters are untouched on error. */
ks_status gguf_get_u32(const struct gguf_file *f, const char *key, uint32_t *out);
ks_status gguf_get_i32(const struct gguf_file *f, const char *key, int32_t *out);
ks_status gguf_get_u64(const struct gguf_file *f, const char *key, uint64_t *out);
ks_status gguf_get_f32(const struct gguf_file *f, const char *key, float *out);
ks_status gguf_get_bool(const struct gguf_file *f, const char *key, bool *out);
ks_status gguf_get_str(const struct gguf_file *f, const char *key, struct gguf_str *out);

/* Arrays: element type, count and, for non-string element types, a pointer to
 * the packed little-endian elements (may be unaligned: memcpy them). Nested
 * arrays are reported with elem type GGUF_TYPE_ARRAY and data NULL. Any
 * out-parameter may be NULL. */
ks_status gguf_get_arr(const struct gguf_file *f, const char *key,
                       enum gguf_value_type *elem_type, uint64_t *count, const void **data);
/* Element i of a string array (O(1): the reader indexes string arrays).
 * KS_ERR_RANGE if i >= count, KS_ERR_FORMAT if key is not a string array. */
ks_status gguf_get_arr_str(const struct gguf_file *f, const char *key, uint64_t i,
                           struct gguf_str *out);

/* Print one metadata value (arrays abbreviated) for `kvserve info`. */
void gguf_format_value(const struct gguf_file *f, int64_t i, char *buf, size_t cap);

/* ---- tensors ----------------------------------------------------------- */
int64_t gguf_n_tensors(const struct gguf_file *f);
const struct gguf_tensor_info *gguf_tensor_at(const struct gguf_file *f, int64_t i);
/* NULL if absent. */
const struct gguf_tensor_info *gguf_find_tensor(const struct gguf_file *f, const char *name);

/* ---- writer ------------------------------------------------------------ */
/* Builds a GGUF v3 file in memory-light fashion: metadata is copied, tensor
 * data is referenced and must stay valid until gguf_writer_write() returns. */
struct gguf_writer;

ks_status gguf_writer_create(struct gguf_writer **out);
void gguf_writer_free(struct gguf_writer *w);
ks_status gguf_writer_set_u32(struct gguf_writer *w, const char *key, uint32_t v);
ks_status gguf_writer_set_i32(struct gguf_writer *w, const char *key, int32_t v);
ks_status gguf_writer_set_u64(struct gguf_writer *w, const char *key, uint64_t v);
ks_status gguf_writer_set_f32(struct gguf_writer *w, const char *key, float v);
ks_status gguf_writer_set_bool(struct gguf_writer *w, const char *key, bool v);
ks_status gguf_writer_set_str(struct gguf_writer *w, const char *key, const char *v);
/* Any fixed-size scalar type (u8 .. f64, bool), copied from *v. */
ks_status gguf_writer_set_scalar(struct gguf_writer *w, const char *key, enum gguf_value_type type,
                                 const void *v);
/* Array of fixed-size elements (not STRING/ARRAY), copied. */
ks_status gguf_writer_set_arr(struct gguf_writer *w, const char *key, enum gguf_value_type elem,
                              const void *data, uint64_t count);
/* Array of strings, copied; lens may be NULL for NUL-terminated strings. */
ks_status gguf_writer_set_arr_str(struct gguf_writer *w, const char *key,
                                  const char *const *strs, const uint64_t *lens, uint64_t count);
/* Copy every metadata key of src whose name starts with prefix (e.g.
 * "tokenizer." to carry a vocabulary over). */
ks_status gguf_writer_copy_kv(struct gguf_writer *w, const struct gguf_file *src, const char *prefix);
/* ne[0] must be a multiple of the type's block size; nbytes must equal the
 * type's row size times the other dims. data NULL writes zeros. */
ks_status gguf_writer_add_tensor(struct gguf_writer *w, const char *name, uint32_t n_dims,
                                 const int64_t *ne, enum quant_type type, const void *data,
                                 uint64_t nbytes);
/* Writes to a temporary file beside path, then renames it into place. */
ks_status gguf_writer_write(struct gguf_writer *w, const char *path);
/* The same bytes into a malloc'd buffer (tests, fuzz corpora); free() it. */
ks_status gguf_writer_write_memory(struct gguf_writer *w, void **out, size_t *size);

#endif
