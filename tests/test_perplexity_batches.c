/* kvserve perplexity on the trained model (../shared/models/trained), run as
 * the real binary: -b N scores the same as one batch per chunk with a static
 * cache, and the dynamic policy completes under budgets below what a chunk
 * needs at f16, down to exactly every page at the q4_0 floor (one byte less
 * is refused), in batches of 64 and in one batch of the chunk. KLD values are measured by bench/kv_quality_curve.sh, not
 * checked here. In a Debug build every cache mutation runs kv_check. */
#include <math.h>
#include <stdbool.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>
#include <cjson/cJSON.h>

#include "support/read_file.h"
#include "support/run_kvserve.h"
#include "support/skip.h"

/* The Debug (ASan+UBSan) build's binary is ~50x slower: a quarter of the tokens there. */
#ifdef NDEBUG
enum { CTX = 512, CHUNKS = 2 };
#else
enum { CTX = 256, CHUNKS = 1 };
#endif
enum { HEADER_BYTES = 12 };

/* The trained model's cache: 4 layers, 2 KV heads, head_dim 64. */
static const size_t F16_CHUNK_BYTES = (size_t)4 * 2 * 64 * 2 * 2 * CTX;
static const size_t Q4_0_CHUNK_BYTES = (size_t)4 * 2 * 2 * 18 * 2 * CTX;

static char g_model[4096], g_text[4096], g_out[1 << 16];

static bool inputs_present(void)
{
    const char *shared = getenv("KVSERVE_SHARED");
    snprintf(g_model, sizeof g_model, "%s/models/trained/tiny-llama-gqa-hd64-f32.gguf", shared ? shared : "../shared");
    snprintf(g_text, sizeof g_text, "%s/models/trained/sample.txt", shared ? shared : "../shared");
    return access(g_model, R_OK) == 0 && access(g_text, R_OK) == 0;
}

/* Run perplexity with the common arguments plus extra; its exit code. */
static int perplexity(const char *extra)
{
    char args[12288];
    int w = snprintf(args, sizeof args, "-m '%s' -f '%s' -c %d --chunks %d -t 2 %s", g_model, g_text, CTX, CHUNKS,
                     extra);
    assert_true(w > 0 && (size_t)w < sizeof args);
    return ks_run_kvserve("perplexity", args, g_out, sizeof g_out);
}

/* The logits a run saved (the KVPL header skipped); n floats into *n. */
static float *saved_logits(const char *extra, const char *path, size_t *n)
{
    char args[8192];
    snprintf(args, sizeof args, "%s --save-logits '%s'", extra, path);
    assert_int_equal(perplexity(args), 0);
    size_t len = 0;
    char *bytes = ks_read_file(path, &len);
    assert_non_null(bytes);
    assert_true(len > HEADER_BYTES && (len - HEADER_BYTES) % sizeof(float) == 0);
    *n = (len - HEADER_BYTES) / sizeof(float);
    float *out = malloc(*n * sizeof *out);
    assert_non_null(out);
    memcpy(out, bytes + HEADER_BYTES, *n * sizeof *out);
    free(bytes);
    remove(path);
    return out;
}

/* Batches of 64 and of 100 tokens (a partial last batch) give the logits of
 * one batch of the chunk within 1e-4 of the largest logit: the batch changes the
 * order of float sums in the matmuls, nothing else (an f16 cache turns such a
 * last-bit difference into an occasional f16 ulp of a K or V element, hence
 * ~2.5e-5 relative there and ~1e-6 with f32). */
static void batches_score_like_one_batch(void **state)
{
    (void)state;
    KS_NEED_KVSERVE();
    if (!inputs_present())
        KS_SKIP("no %s or %s", g_model, g_text);
    static const char *const caches[] = {"-ctk f16 -ctv f16", "-ctk f32 -ctv f32"};
    char path[] = "/tmp/ks_ppl_logits_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    for (size_t c = 0; c < sizeof caches / sizeof caches[0]; c++) {
        char extra[256];
        size_t n_one = 0, n_b = 0;
        snprintf(extra, sizeof extra, "%s -b %d", caches[c], CTX);
        float *one = saved_logits(extra, path, &n_one);
        float largest = 0.0f;
        for (size_t i = 0; i < n_one; i++)
            largest = fabsf(one[i]) > largest ? fabsf(one[i]) : largest;
        static const int batch[] = {64, 100};
        for (size_t b = 0; b < sizeof batch / sizeof batch[0]; b++) {
            snprintf(extra, sizeof extra, "%s -b %d", caches[c], batch[b]);
            float *got = saved_logits(extra, path, &n_b);
            assert_int_equal(n_b, n_one);
            float worst = 0.0f;
            for (size_t i = 0; i < n_one; i++)
                worst = fabsf(got[i] - one[i]) > worst ? fabsf(got[i] - one[i]) : worst;
            printf("%s -b %d: largest logit difference %g of %g\n", caches[c], batch[b], (double)worst,
                   (double)largest);
            assert_true(worst <= 1e-4f * largest);
            free(got);
        }
        free(one);
    }
}

/* PPL from a --json run's output. */
static double json_ppl(void)
{
    cJSON *j = cJSON_Parse(g_out);
    assert_non_null(j);
    const cJSON *ppl = cJSON_GetObjectItemCaseSensitive(j, "ppl");
    assert_true(cJSON_IsNumber(ppl));
    double v = ppl->valuedouble;
    cJSON_Delete(j);
    return v;
}

/* Budgets below one chunk at f16 (which a static f16 cache refuses): the
 * dynamic policy completes in batches of 64 and in one batch, down to every
 * page at the floor; a byte less is out of memory. */
static void dynamic_completes_below_f16(void **state)
{
    (void)state;
    KS_NEED_KVSERVE();
    if (!inputs_present())
        KS_SKIP("no %s or %s", g_model, g_text);
    const size_t budgets[] = {F16_CHUNK_BYTES / 2, F16_CHUNK_BYTES * 3 / 10, Q4_0_CHUNK_BYTES};
    char extra[512];
    snprintf(extra, sizeof extra, "--kv-mem %zu", budgets[0]);
    assert_int_equal(perplexity(extra), 1);
    ks_expect_text(g_out, "out of KV memory");
    for (size_t i = 0; i < sizeof budgets / sizeof budgets[0]; i++)
        for (int batch = 64; batch <= CTX; batch = batch == CTX ? 2 * CTX : CTX) {
            snprintf(extra, sizeof extra, "--json --kv-policy dynamic --kv-sink 32 --kv-hot 64 --kv-mem %zu -b %d",
                     budgets[i], batch);
            assert_int_equal(perplexity(extra), 0);
            double ppl = json_ppl();
            printf("dynamic, %zu bytes, -b %d: PPL %.4f\n", budgets[i], batch, ppl);
            assert_true(isfinite(ppl) && ppl > 1.0);
        }
    snprintf(extra, sizeof extra, "--kv-policy dynamic --kv-mem %zu", Q4_0_CHUNK_BYTES - 1);
    assert_int_equal(perplexity(extra), 1);
    ks_expect_text(g_out, "out of KV memory");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(batches_score_like_one_batch),
        cmocka_unit_test(dynamic_completes_below_f16),
    };
    return ks_run_tests(tests, NULL, NULL);
}
