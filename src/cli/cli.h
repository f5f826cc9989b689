/* cli: the kvserve subcommands. Each takes (argc, argv) with argv[0] the
 * command name, prints its own --help, and returns the process exit code
 * (0 ok, 1 runtime failure, 2 usage error). */
#ifndef KS_CLI_H
#define KS_CLI_H

int cli_version(int argc, char **argv);
int cli_info(int argc, char **argv);
int cli_synth(int argc, char **argv);
int cli_generate(int argc, char **argv);
int cli_bench(int argc, char **argv);
int cli_serve(int argc, char **argv);
int cli_perplexity(int argc, char **argv);
int cli_tokenize(int argc, char **argv);
int cli_chat(int argc, char **argv);
int cli_template(int argc, char **argv);
int cli_route(int argc, char **argv);

#endif
