/* kvserve synth: write a deterministic random model of a real architecture's shapes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "model/model.h"

static void synth_usage(FILE *out)
{
    fprintf(out,
            "usage: kvserve synth --preset NAME --type T [--vocab VOCAB.gguf] [--layers N] [--seed N] [--pure] [-t N]\n"
            "                     -o OUT.gguf\n"
            "\n"
            "Write a deterministic random model (weights N(0, 0.02)-like, tied embeddings).\n"
            "  --preset NAME   %s\n"
            "  --type T        f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 q2_k q3_k q4_k q5_k q6_k\n"
            "                  q4_k_m iq4_nl iq4_xs mxfp4 iq3_xxs iq3_s iq2_s iq2_xxs iq2_xs iq1_s iq1_m\n"
            "                  (quantized types put output/token_embd at q6_k like llama-quantize;\n"
            "                   q4_k_m uses llama.cpp's Q4_K_M mix)\n"
            "  --pure          every matrix at exactly --type\n"
            "  --layers N      override the preset's layer count (e.g. a few layers of a big MoE)\n"
            "  --vocab FILE    copy tokenizer.* metadata from this GGUF (default: a 512-token\n"
            "                  SentencePiece vocab with byte fallback)\n"
            "  --seed N        PRNG seed (default 1234)\n"
            "  -t N            threads (default: all cores)\n"
            "  -o FILE         output path\n",
            model_synth_preset_names());
}

int cli_synth(int argc, char **argv)
{
    const char *preset = NULL, *type = NULL, *vocab = NULL, *out = NULL;
    unsigned long long seed = 1234;
    bool pure = false;
    int n_threads = threads_default_count();
    long layers = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool has_val = i + 1 < argc;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            synth_usage(stdout);
            return 0;
        } else if (!strcmp(a, "--pure")) {
            pure = true;
        } else if (has_val && !strcmp(a, "--preset")) {
            preset = argv[++i];
        } else if (has_val && !strcmp(a, "--type")) {
            type = argv[++i];
        } else if (has_val && !strcmp(a, "--vocab")) {
            vocab = argv[++i];
        } else if (has_val && !strcmp(a, "-o")) {
            out = argv[++i];
        } else if (has_val && !strcmp(a, "--seed")) {
            seed = strtoull(argv[++i], NULL, 10);
        } else if (has_val && !strcmp(a, "--layers")) {
            char *end;
            layers = strtol(argv[++i], &end, 10);
            if (*end || layers < 1 || layers > 4096) {
                fprintf(stderr, "kvserve synth: --layers '%s' must be an integer in 1..4096\n", argv[i]);
                return 2;
            }
        } else if (has_val && !strcmp(a, "-t")) {
            n_threads = atoi(argv[++i]);
        } else {
            fprintf(stderr, "kvserve synth: unknown or incomplete option '%s'\n\n", a);
            synth_usage(stderr);
            return 2;
        }
    }
    if (!preset || !type || !out || n_threads < 1) {
        fprintf(stderr, "kvserve synth: --preset, --type and -o are required (and -t must be >= 1)\n\n");
        synth_usage(stderr);
        return 2;
    }
    struct model_synth_spec spec;
    if (model_synth_preset(preset, &spec)) {
        fprintf(stderr, "kvserve synth: %s\n", ks_errmsg());
        return 2;
    }
    spec.seed = seed;
    if (layers)
        spec.n_layer = (int)layers;
    spec.pure = pure;
    threads_pool *pool = NULL;
    ks_status st = threads_create(n_threads, &pool);
    if (!st)
        st = model_synth(&spec, type, vocab, out, pool);
    threads_free(pool);
    if (st) {
        fprintf(stderr, "kvserve synth: %s\n", ks_errmsg());
        return st == KS_ERR_INVALID_ARG ? 2 : 1;
    }
    fprintf(stderr, "kvserve synth: wrote %s (%s, %s)\n", out, preset, type);
    return 0;
}
