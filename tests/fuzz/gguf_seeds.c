/* Write a seed corpus for fuzz_gguf: gguf_seeds OUT_DIR [stories260K.gguf].
 * The stories seed keeps the real model's metadata (512-token vocabulary)
 * but only its two smallest tensors, so it stays ~15 KB. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz/gguf_seeds.h"

static int save(const char *dir, const char *name, const void *buf, size_t size)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *fp = fopen(path, "wb");
    if (!fp || fwrite(buf, 1, size, fp) != size || fclose(fp)) {
        fprintf(stderr, "gguf_seeds: cannot write %s\n", path);
        return 1;
    }
    printf("%s (%zu bytes)\n", path, size);
    return 0;
}

static int stories_seed(const char *dir, const char *model)
{
    struct gguf_file *f;
    struct gguf_writer *w;
    if (gguf_open(model, &f) || gguf_writer_create(&w)) {
        fprintf(stderr, "gguf_seeds: %s\n", ks_errmsg());
        return 1;
    }
    ks_status st = gguf_writer_copy_kv(w, f, "");
    const char *keep[] = {"output_norm.weight", "blk.0.attn_norm.weight"};
    for (int i = 0; i < 2 && !st; i++) {
        const struct gguf_tensor_info *t = gguf_find_tensor(f, keep[i]);
        if (t)
            st = gguf_writer_add_tensor(w, t->name, t->n_dims, t->ne, t->type, t->data, t->nbytes);
    }
    void *buf = NULL;
    size_t size = 0;
    st = st ? st : gguf_writer_write_memory(w, &buf, &size);
    int rc = st ? (fprintf(stderr, "gguf_seeds: %s\n", ks_errmsg()), 1) : save(dir, "stories_meta.gguf", buf, size);
    free(buf);
    gguf_writer_free(w);
    gguf_close(f);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: gguf_seeds OUT_DIR [stories260K.gguf]\n");
        return 2;
    }
    size_t n;
    void *small = gguf_seed_small(&n);
    int rc = small ? save(argv[1], "small.gguf", small, n) : 1;
    free(small);
    void *nested = gguf_seed_nested(&n);
    rc |= save(argv[1], "nested.gguf", nested, n);
    free(nested);
    if (argc > 2)
        rc |= stories_seed(argv[1], argv[2]);
    return rc;
}
