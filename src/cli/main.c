/* kvserve: one binary, one subcommand per job. Each command lives in its own
 * file under src/cli/ and is declared in cli/cli.h. */
#include <stdio.h>
#include <string.h>

#include "cli/cli.h"

struct command {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *summary;
};

static const struct command commands[] = {
    {"version", cli_version, "print the version and the SIMD kernels in use"},
    {"info", cli_info, "print a GGUF file's metadata, tensors and memory needs"},
    {"synth", cli_synth, "write a deterministic random model of a real architecture's shapes"},
    {"generate", cli_generate, "generate tokens from a prompt, streaming them as they come"},
    {"bench", cli_bench, "measure prompt (pp) and generation (tg) speed like llama-bench"},
    {"perplexity", cli_perplexity, "score a text like llama-perplexity: PPL, KL divergence vs saved logits"},
    {"chat", cli_chat, "chat with a model in the terminal (chat template, conversation kept in the KV cache)"},
    {"template", cli_template, "print the prompt a chat request makes through the model's Jinja chat template"},
    {"tokenize", cli_tokenize, "print the token ids and pieces of a text under a model's vocabulary"},
    {"serve", cli_serve, "serve the OpenAI-compatible HTTP API with continuous batching"},
    {"route", cli_route, "route requests to kvserve replicas by the prompt pages each holds (KV events)"},
};

static void usage(FILE *out)
{
    fprintf(out, "usage: kvserve COMMAND [options]   (kvserve COMMAND --help for its flags)\n\ncommands:\n");
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        fprintf(out, "  %-12s %s\n", commands[i].name, commands[i].summary);
}

int main(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (!strcmp(argv[1], commands[i].name))
            return commands[i].run(argc - 1, argv + 1);
    fprintf(stderr, "kvserve: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
