/* imatrix_ones: an importance matrix of ones for every matrix of a GGUF model,
 * in the legacy binary format llama-quantize reads with --imatrix
 * (tools/quantize/quantize.cpp, load_legacy_imatrix), so that llama-quantize
 * makes IQ2_XXS, IQ2_XS, IQ1_S and IQ1_M files (it refuses them without one)
 * from a `kvserve synth` f32/f16 model. With all weights equal the quantizers
 * minimise the plain squared error. Format, all little-endian int32 / f32:
 *   n_entries, then per entry: name length, name bytes, ncall (1), nval,
 *   nval values; then the chunk count (1), dataset name length, name bytes.
 * nval is the row length (ne[0]) of a 2-D matrix and ne[0] * ne[2] of a 3-D
 * stack of experts.
 *
 * usage: imatrix_ones MODEL.gguf OUT.dat */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf/gguf.h"

static bool is_matrix(const struct gguf_tensor_info *t) { return t->n_dims == 2 || t->n_dims == 3; }

static bool put_i32(FILE *f, int32_t v) { return fwrite(&v, sizeof v, 1, f) == 1; }

static bool put_entry(FILE *f, const struct gguf_tensor_info *t)
{
    int32_t nval = (int32_t)(t->ne[0] * (t->n_dims == 3 ? t->ne[2] : 1));
    int32_t len = (int32_t)strlen(t->name);
    bool ok = put_i32(f, len) && fwrite(t->name, 1, (size_t)len, f) == (size_t)len && put_i32(f, 1) &&
              put_i32(f, nval);
    const float one = 1.0f;
    for (int32_t i = 0; ok && i < nval; i++)
        ok = fwrite(&one, sizeof one, 1, f) == 1;
    return ok;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: imatrix_ones MODEL.gguf OUT.dat\n");
        return 2;
    }
    struct gguf_file *g;
    if (gguf_open(argv[1], &g)) {
        fprintf(stderr, "imatrix_ones: %s\n", ks_errmsg());
        return 1;
    }
    FILE *f = fopen(argv[2], "wb");
    if (!f) {
        perror(argv[2]);
        gguf_close(g);
        return 1;
    }
    int32_t n = 0;
    for (int64_t i = 0; i < gguf_n_tensors(g); i++)
        n += is_matrix(gguf_tensor_at(g, i));
    static const char dataset[] = "ones";
    bool ok = put_i32(f, n);
    for (int64_t i = 0; ok && i < gguf_n_tensors(g); i++)
        if (is_matrix(gguf_tensor_at(g, i)))
            ok = put_entry(f, gguf_tensor_at(g, i));
    ok = ok && put_i32(f, 1) && put_i32(f, (int32_t)strlen(dataset)) &&
         fwrite(dataset, 1, strlen(dataset), f) == strlen(dataset);
    ok = fclose(f) == 0 && ok;
    gguf_close(g);
    if (!ok) {
        fprintf(stderr, "imatrix_ones: cannot write %s\n", argv[2]);
        return 1;
    }
    fprintf(stderr, "imatrix_ones: %d matrices into %s\n", n, argv[2]);
    return 0;
}
