/* cli/args: small flag-value parsers shared by the kvserve subcommands.
 * Each returns false (after printing nothing) on a bad value; the caller
 * prints "kvserve CMD: bad value 'X' for FLAG" with its usage. */
#ifndef KS_CLI_ARGS_H
#define KS_CLI_ARGS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kv/kv.h"
#include "quant/quant.h"
#include "spec/spec.h"

/* A whole decimal integer in [lo, hi]. */
bool cli_parse_int(const char *s, long lo, long hi, int *out);
/* A 64-bit unsigned integer (decimal or 0x hex). */
bool cli_parse_u64(const char *s, uint64_t *out);
/* A finite float in [lo, hi]. */
bool cli_parse_float(const char *s, float lo, float hi, float *out);
/* A thread count: 1..1024. */
bool cli_parse_threads(const char *s, int *out);
/* A memory size: "4G", "512M", "1.5GiB", "65536" (bytes; K/M/G/T are
 * powers of 1024, an optional "B"/"iB" suffix is ignored), or "PCT%" of the
 * physical RAM, e.g. "50%". Never 0. */
bool cli_parse_mem(const char *s, size_t *bytes);
/* "on" or "off". */
bool cli_parse_on_off(const char *s, bool *out);
/* A comma-separated id list "1,2,3" into a malloc'd array (caller frees). */
bool cli_parse_ids(const char *s, int32_t **ids, int32_t *n);

/* A KV policy name: static or dynamic. */
bool cli_parse_kv_policy(const char *s, enum kv_policy *out);
/* Bytes of whole pages (at cfg's start types) that hold n_tokens of one
 * sequence, plus one spare page. */
size_t cli_kv_budget_for(const struct kv_config *cfg, int64_t n_tokens);

/* The KV-cache flags every command that runs a model takes: the user's
 * choices over kv_config_default(), and the budget (0: the command sizes it).
 *   --kv-mem SIZE, -ctk/--cache-type-k T, -ctv/--cache-type-v T,
 *   --kv-policy static|dynamic, --kv-page P, --kv-rotate on|off, --kv-scale-search on|off,
 *   --kv-smooth off|k|v|kv,
 *   --kv-sink N, --kv-hot N, --kv-floor T, --kv-ladder T,T,..., --kv-high R, --kv-low R,
 *   --kv-swa-full on|off
 * --kv-page-tokens and --kv-sinks are accepted as older spellings. */
struct cli_kv_flags {
    struct kv_config cfg;
    size_t mem;
};
void cli_kv_flags_init(struct cli_kv_flags *f);
/* True if flag is one of the above; *ok says whether value was good
 * (a power of two 16..256 for --kv-page, a ratio in (0, 1] for --kv-high
 * and --kv-low). */
bool cli_parse_kv_flag(const char *flag, const char *value, struct cli_kv_flags *f, bool *ok);
/* What the flags cannot say one at a time: NULL when they agree, else a
 * message such as "--kv-low 0.9 is above --kv-high 0.8" in buf. */
const char *cli_kv_flags_conflict(const struct cli_kv_flags *f, char *buf, size_t cap);
/* Copy the user's choices (not the shape, not the budget) into cfg. */
void cli_kv_flags_apply(const struct cli_kv_flags *f, struct kv_config *cfg);

/* The flags of every command that loads a model through model_load_flags:
 * --mmap, --no-repack and the KV-cache flags. */
struct cli_model_flags {
    bool mmap;      /* map the file instead of reading it into huge pages */
    bool no_repack; /* keep matrices row-major (A/B against the repacked kernels) */
    struct cli_kv_flags kv;
};
void cli_model_flags_init(struct cli_model_flags *f);
/* The help block for them, the same in every command's usage. */
extern const char cli_model_flags_help[];

/* Speculative decoding, the same in serve and generate (llama-server's names):
 *   --spec-type none|ngram, --draft-max N (1..SPEC_DRAFT_LIMIT), --draft-min N (0..64;
 *   above --draft-max is refused by the command). */
struct cli_spec_flags {
    enum spec_type type; /* SPEC_NONE */
    int draft_max;       /* 16 */
    int draft_min;       /* 0 */
    int pool_n;          /* --spec-ngram-size-n: ngram-pool's tokens per key (SPEC_POOL_N_DEFAULT) */
    const char *model_draft; /* --model-draft / -md FILE (implies --spec-type draft), NULL: none */
    float draft_p_min;   /* --draft-p-min P, 0..1 (0, llama-server's default) */
    enum quant_type draft_type_k, draft_type_v; /* --cache-type-k-draft / -ctkd, ...-v-draft / -ctvd;
                                                   QUANT_TYPE_COUNT: the KV policy's floor */
};
void cli_spec_flags_init(struct cli_spec_flags *f);
/* After parsing: --model-draft alone means --spec-type draft. NULL when the
 * flags agree, else a message (draft without a model, a model with another
 * speculator). */
const char *cli_spec_flags_conflict(struct cli_spec_flags *f);
/* True if flag is one of the above; *ok says whether value was good. */
bool cli_parse_spec_flag(const char *flag, const char *value, struct cli_spec_flags *f, bool *ok);
extern const char cli_spec_flags_help[];

/* ---- one command line ----------------------------------------------------- */

/* A command's flags, for cli_parse_command(). */
struct cli_command {
    const char *name;                  /* "serve": messages read "kvserve serve: ..." */
    void (*usage)(FILE *out);
    struct cli_model_flags *model;     /* --mmap and the KV flags; NULL: not taken */
    /* A flag without a value: true if it is one (and it was applied). */
    bool (*switch_flag)(const char *flag, void *opts);
    /* A flag with a value (NULL when argv ends): true if it is one; *ok
     * false when the value is bad or missing. Tried before the shared KV
     * flags, so a command may take one of them its own way. */
    bool (*value_flag)(const char *flag, const char *value, void *opts, bool *ok);
    void *opts;
};
/* Parse argv[1..argc). -h/--help prints the usage on stdout and returns -1.
 * An unknown flag, a bad or missing value or conflicting KV flags print
 * "kvserve NAME: bad value 'X' for FLAG" (or the like) and the usage on
 * stderr and return 2. Otherwise 0. */
int cli_parse_command(const struct cli_command *c, int argc, char **argv);

/* Physical RAM in bytes (0 if unknown). */
size_t cli_phys_mem(void);
/* Peak resident set size of this process in bytes (getrusage). */
size_t cli_peak_rss(void);
/* The built-in default model: default-model.gguf beside the kvserve
 * executable (the build writes both to build/). False if it is absent. */
bool cli_default_model(char *path, size_t cap);
/* Monotonic wall clock in seconds. */
double cli_now(void);
/* The whole of path ("-" = stdin) in a malloc'd NUL-terminated buffer (*len
 * its length without the NUL); NULL when it cannot be read or out of memory. */
char *cli_read_file(const char *path, size_t *len);

#endif
