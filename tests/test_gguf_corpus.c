/* gguf corpus replay: every prefix of a small valid file, many prefixes of
 * stories260K's header region, and thousands of deterministic bit flips and
 * byte overwrites of both. gguf_open_memory must never crash (each input sits
 * in an exact-size heap buffer, so ASan sees any over-read) and must return
 * KS_OK or KS_ERR_FORMAT / KS_ERR_UNSUPPORTED with a message. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "fuzz/gguf_seeds.h"
#include "fuzz/gguf_walk.h"
#include "gguf/gguf.h"
#include "support/skip.h"

enum { SMALL_FLIPS = 20000, STORIES_FLIPS = 20000, STORIES_DATA_PREFIX_STEP = 4099 };

struct tally {
    long ok, format, unsupported;
};

static uint64_t rng_state;
static uint64_t rng_next(void) /* splitmix64: deterministic across platforms */
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Open, check the status contract, walk on success. */
static void replay(const uint8_t *data, size_t size, struct tally *t, const char *what, uint64_t n)
{
    struct gguf_file *f = NULL;
    ks_status st = gguf_open_memory(data, size, &f);
    if (st == KS_OK) {
        assert_non_null(f);
        gguf_walk(f);
        gguf_close(f);
        t->ok++;
        return;
    }
    if ((st != KS_ERR_FORMAT && st != KS_ERR_UNSUPPORTED) || !ks_errmsg()[0])
        fail_msg("%s %llu (%zu bytes): status %d, message '%s'", what, (unsigned long long)n, size, st, ks_errmsg());
    assert_null(f);
    st == KS_ERR_FORMAT ? t->format++ : t->unsupported++;
}

static void replay_prefix(const uint8_t *file, size_t len, struct tally *t)
{
    uint8_t *copy = malloc(len ? len : 1); /* exact size: ASan catches over-reads */
    assert_non_null(copy);
    memcpy(copy, file, len);
    replay(copy, len, t, "prefix", len);
    free(copy);
}

/* Mutate one or a few positions in [0, span), replay, restore. */
static void replay_flips(uint8_t *file, size_t size, size_t span, long n, struct tally *t)
{
    enum { MAX_EDITS = 4 };
    for (long k = 0; k < n; k++) {
        size_t pos[MAX_EDITS];
        uint8_t old[MAX_EDITS];
        int edits = 1 + (int)(rng_next() % MAX_EDITS);
        for (int e = 0; e < edits; e++) {
            pos[e] = (size_t)(rng_next() % span);
            old[e] = file[pos[e]];
            uint64_t r = rng_next();
            if (r % 4) /* mostly single bit flips, sometimes a whole new byte */
                file[pos[e]] ^= (uint8_t)(1u << (r >> 8) % 8);
            else
                file[pos[e]] = (uint8_t)(r >> 16);
        }
        replay(file, size, t, "mutation", (uint64_t)k);
        for (int e = edits - 1; e >= 0; e--)
            file[pos[e]] = old[e];
    }
}

static void print_tally(const char *name, const struct tally *t)
{
    print_message("%s: %ld ok, %ld malformed, %ld unsupported\n", name, t->ok, t->format, t->unsupported);
}

/* Bytes a prefix must keep for the file to stay valid: up to the last tensor's end. */
static size_t needed_bytes(const struct gguf_file *f)
{
    size_t need = 0;
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        const struct gguf_tensor_info *t = gguf_tensor_at(f, i);
        size_t end = (size_t)(gguf_data_offset(f) + t->offset + t->nbytes);
        need = end > need ? end : need;
    }
    return need;
}

static void test_small_file_corpus(void **state)
{
    (void)state;
    size_t sizes[2];
    uint8_t *files[2] = {gguf_seed_small(&sizes[0]), gguf_seed_nested(&sizes[1])};
    assert_non_null(files[0]);
    const char *names[2] = {"small", "nested"};
    for (int i = 0; i < 2; i++) {
        struct gguf_file *f = NULL;
        if (gguf_open_memory(files[i], sizes[i], &f))
            fail_msg("%s seed is invalid: %s", names[i], ks_errmsg());
        size_t need = needed_bytes(f);
        gguf_close(f);
        struct tally prefixes = {0}, flips = {0};
        for (size_t len = 0; len < sizes[i]; len++)
            replay_prefix(files[i], len, &prefixes);
        assert_int_equal(prefixes.ok, sizes[i] - need); /* only prefixes that cut padding alone */
        rng_state = 42 + (uint64_t)i;
        replay_flips(files[i], sizes[i], sizes[i], SMALL_FLIPS, &flips);
        print_message("%s file (%zu bytes)\n", names[i], sizes[i]);
        print_tally("  prefixes", &prefixes);
        print_tally("  mutations", &flips);
        free(files[i]);
    }
}

static uint8_t *read_shared(const char *rel, size_t *size)
{
    const char *dir = getenv("KVSERVE_SHARED");
    if (!dir)
        return NULL;
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, rel);
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return NULL;
    fseek(fp, 0, SEEK_END);
    long n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    uint8_t *buf = n > 0 ? malloc((size_t)n) : NULL;
    if (buf && fread(buf, 1, (size_t)n, fp) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(fp);
    *size = (size_t)n;
    return buf;
}

static void test_stories260k_corpus(void **state)
{
    (void)state;
    size_t size;
    uint8_t *file = read_shared("models/stories260K.gguf", &size);
    if (!file)
        KS_SKIP("stories260K.gguf not found under $KVSERVE_SHARED/models");
    struct gguf_file *f = NULL;
    if (gguf_open_memory(file, size, &f))
        fail_msg("%s", ks_errmsg());
    size_t header = (size_t)gguf_data_offset(f), need = needed_bytes(f);
    gguf_close(f);
    assert_int_equal(need, size); /* the last tensor ends the file: only the whole file is valid */

    struct tally prefixes = {0}, flips = {0};
    for (size_t len = 0; len <= header; len++)
        replay_prefix(file, len, &prefixes);
    for (size_t len = header + 1; len < size; len += STORIES_DATA_PREFIX_STEP)
        replay_prefix(file, len, &prefixes);
    replay_prefix(file, size, &prefixes);
    assert_int_equal(prefixes.ok, 1); /* only the whole file */
    rng_state = 7;
    replay_flips(file, size, header, STORIES_FLIPS, &flips);
    print_message("stories260K (%zu bytes, header %zu)\n", size, header);
    print_tally("  prefixes", &prefixes);
    print_tally("  mutations", &flips);
    free(file);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_small_file_corpus),
        cmocka_unit_test(test_stories260k_corpus),
    };
    return ks_run_tests(tests, NULL, NULL);
}
