/* Vocabularies for the tokenizer, chat and body harnesses: loaded once from
 * $KVSERVE_SHARED/models/vocab (default: the ../shared next to the source
 * tree, baked in by fuzz.cmake). A missing file aborts the run, so a harness
 * without its vocabulary fails loudly instead of passing on nothing. */
#ifndef KS_FUZZ_VOCAB_H
#define KS_FUZZ_VOCAB_H

#include <stdio.h>
#include <stdlib.h>

#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"

#ifndef KS_FUZZ_SHARED
#define KS_FUZZ_SHARED "../shared"
#endif

static inline struct tokenizer *fuzz_load_vocab(const char *file)
{
    const char *dir = getenv("KVSERVE_SHARED");
    char path[4096];
    snprintf(path, sizeof path, "%s/models/vocab/%s", dir && *dir ? dir : KS_FUZZ_SHARED, file);
    struct gguf_file *f = NULL;
    struct tokenizer *t = NULL;
    if (gguf_open(path, &f) != KS_OK || tok_load(f, &t) != KS_OK) {
        fprintf(stderr, "fuzz: cannot load the vocabulary %s: %s (set KVSERVE_SHARED)\n", path, ks_errmsg());
        abort();
    }
    gguf_close(f);
    return t;
}

#endif
