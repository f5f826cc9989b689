/* Writes tests/kv_type_blocks.h: inputs and the bytes llama.cpp's reference
 * quantizers (ggml_quantize_chunk without an importance matrix, which runs
 * quantize_row_*_ref / quantize_iq4_nl) make of them, for the KV types whose
 * bit-exactness test_kv_types checks. Build and run against the anchor's
 * libggml-base (see ../shared/anchor/README.md):
 *   cc -O1 tests/data/kv_blocks/gen_kv_blocks.c -o /tmp/gen -L DIR -lggml-base -Wl,-rpath,DIR
 *   /tmp/gen > tests/kv_type_blocks.h
 * DIR: a mirror of ../shared/anchor/bin with real links (bench/vs_llamacpp.sh makes one). */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

size_t ggml_quantize_chunk(int type, const float *src, void *dst, int64_t start, int64_t nrows, int64_t n_per_row,
                           const float *imatrix);
void ggml_quantize_init(int type);

enum { N_BLOCKS = 12, N = N_BLOCKS * 32 };

static uint64_t rng = 0x243f6a8885a308d3ull;
static float uniform(void)
{
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)(rng >> 40) / 16777216.0f * 2.0f - 1.0f;
}

/* Blocks meant to reach every branch: random of several scales, a positive
 * or negative extreme, zeros, a constant, one spike, an offset block (the
 * _1 types' minimum), ties of the rounding. */
static void make_input(float *x)
{
    for (int b = 0; b < N_BLOCKS; b++) {
        float *y = x + 32 * b;
        for (int j = 0; j < 32; j++) {
            float u = uniform();
            switch (b) {
            case 0: y[j] = u; break;
            case 1: y[j] = u * 0.01f; break;
            case 2: y[j] = u * 300.0f; break;
            case 3: y[j] = j == 5 ? -4.0f : u; break;
            case 4: y[j] = 0.0f; break;
            case 5: y[j] = 0.75f; break;
            case 6: y[j] = j == 17 ? 2.5f : 0.0f; break;
            case 7: y[j] = 3.0f + u * 0.5f; break;
            case 8: y[j] = (float)(j - 16) * 0.125f; break;
            case 9: y[j] = u * u * u * 2.0f; break;
            case 10: y[j] = 1e-7f * u; break;
            default: y[j] = -1.0f - u * u; break;
            }
        }
    }
}

static void print_bytes(const char *name, const uint8_t *p, size_t n)
{
    printf("static const uint8_t %s[%zu] = {", name, n);
    for (size_t i = 0; i < n; i++)
        printf("%s0x%02x,", i % 16 ? " " : "\n    ", p[i]);
    printf("\n};\n");
}

int main(void)
{
    static float x[N];
    static uint8_t out[N * 4];
    make_input(x);
    printf("/* Made by tests/data/kv_blocks/gen_kv_blocks.c from llama.cpp's reference quantizers\n"
           " * (../shared/anchor, build b10470). Do not edit. */\n");
    printf("#define KV_BLOCKS_N %d\n", N);
    printf("static const uint32_t kv_blocks_input[%d] = {", N);
    for (int i = 0; i < N; i++) {
        uint32_t u;
        memcpy(&u, &x[i], 4);
        printf("%s0x%08x,", i % 8 ? " " : "\n    ", u);
    }
    printf("\n};\n");
    const struct { int type; const char *name; } types[] = {
        {30, "kv_blocks_bf16"}, {3, "kv_blocks_q4_1"}, {6, "kv_blocks_q5_0"},
        {7, "kv_blocks_q5_1"}, {20, "kv_blocks_iq4_nl"}, {2, "kv_blocks_q4_0"}, {8, "kv_blocks_q8_0"},
    };
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        ggml_quantize_init(types[t].type);
        size_t n = ggml_quantize_chunk(types[t].type, x, out, 0, 1, N, NULL);
        print_bytes(types[t].name, out, n);
    }
    return 0;
}
