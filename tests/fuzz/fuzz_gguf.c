/* libFuzzer harness for the GGUF reader (and, through a round trip, the
 * writer). Build: CC=clang cmake -S . -B build-fuzz -DKS_FUZZ=ON &&
 * cmake --build build-fuzz --target fuzz_gguf; see README "GGUF and kvserve info".
 *
 * Oracle: gguf_open_memory never crashes or over-reads (ASan), fails only with
 * KS_ERR_FORMAT / KS_ERR_UNSUPPORTED and a message, and a file it accepts
 * survives writer -> reader with the same keys, values and tensor bytes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz/gguf_walk.h"
#include "gguf/gguf.h"

/* The reader accepts any power of two as the alignment and the writer up to
 * 2^30; the round trip stops at 2^24: a 2^30 alignment pads the written copy
 * to 1 GiB, which (with ASan's quarantine of the memory stream's reallocs)
 * passes run.sh's 2.5 GB limit (a CI run's libFuzzer "out-of-memory" on such
 * a file, tests/fuzz/gguf/align-2p30). Larger alignments differ only in the
 * padding's length. */
#define ROUND_TRIP_MAX_ALIGNMENT (1ull << 24)

static void check(bool ok, const char *what)
{
    if (!ok) {
        fprintf(stderr, "fuzz_gguf: %s (last error: %s)\n", what, ks_errmsg());
        abort();
    }
}

static void round_trip(const struct gguf_file *f)
{
    if (gguf_alignment(f) > ROUND_TRIP_MAX_ALIGNMENT)
        return;
    struct gguf_writer *w;
    check(gguf_writer_create(&w) == KS_OK, "writer_create");
    check(gguf_writer_copy_kv(w, f, "") == KS_OK, "copy_kv");
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        const struct gguf_tensor_info *t = gguf_tensor_at(f, i);
        check(gguf_writer_add_tensor(w, t->name, t->n_dims, t->ne, t->type, t->data, t->nbytes) == KS_OK,
              "add_tensor of an accepted tensor");
    }
    void *buf;
    size_t size;
    check(gguf_writer_write_memory(w, &buf, &size) == KS_OK, "write_memory");
    struct gguf_file *g = NULL;
    check(gguf_open_memory(buf, size, &g) == KS_OK, "reopen what the writer wrote");
    check(gguf_n_kv(g) == gguf_n_kv(f) && gguf_n_tensors(g) == gguf_n_tensors(f), "same counts");
    char a[512], b[512];
    for (int64_t i = 0; i < gguf_n_kv(f); i++) {
        check(!strcmp(gguf_key_at(f, i), gguf_key_at(g, i)), "same key order");
        gguf_format_value(f, i, a, sizeof a);
        gguf_format_value(g, i, b, sizeof b);
        check(!strcmp(a, b), "same value");
    }
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        const struct gguf_tensor_info *t = gguf_tensor_at(f, i), *u = gguf_tensor_at(g, i);
        check(t->nbytes == u->nbytes && !memcmp(t->data, u->data, t->nbytes), "same tensor bytes");
    }
    gguf_close(g);
    free(buf);
    gguf_writer_free(w);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct gguf_file *f = NULL;
    ks_status st = gguf_open_memory(data, size, &f);
    if (st != KS_OK) {
        check(st == KS_ERR_FORMAT || st == KS_ERR_UNSUPPORTED, "unexpected status");
        check(ks_errmsg()[0] != '\0', "empty error message");
        check(f == NULL, "handle set on failure");
        return 0;
    }
    gguf_walk(f);
    round_trip(f);
    gguf_close(f);
    return 0;
}
