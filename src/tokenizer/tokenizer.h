/* tokenizer: text <-> token ids for GGUF vocabularies, exactly as llama.cpp
 * does it, plus a streaming detokenizer and chat templates.
 *
 * Families (tokenizer.ggml.model):
 *   "llama" SentencePiece-style: score-driven merges, <0xXX> byte fallback,
 *           the U+2581 space marker and the add-space-prefix rule, <unk>.
 *   "gpt2"  byte-level BPE: byte<->unicode mapping, merge ranks from
 *           tokenizer.ggml.merges, a regex pre-tokenizer chosen by
 *           tokenizer.ggml.pre (unknown values fall back to "default" with a
 *           warning on stderr).
 *   "bert"  WordPiece: lowercase, accents stripped, greedy longest match.
 *
 * Threads: a loaded tokenizer is immutable. Every const function below may be
 * called from any number of threads at once. A tok_stream belongs to one
 * thread at a time.
 *
 * Token ids are int32_t (as in model/model.h); "no such token" is -1.
 * Errors follow status/status.h: on failure a function has called ks_fail()
 * and leaves its out-parameters untouched. */
#ifndef KS_TOKENIZER_H
#define KS_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "status/status.h"

struct gguf_file;
struct jinja_template;
struct tokenizer;

enum tok_family {
    TOK_FAMILY_SPM, /* "llama" */
    TOK_FAMILY_BPE, /* "gpt2" */
    TOK_FAMILY_WPM, /* "bert" WordPiece (embedding models; kept for completeness) */
};

/* ---- loading ----------------------------------------------------------- */

/* Build a tokenizer from the tokenizer.* metadata of f. Everything needed is
 * copied: f may be closed afterwards.
 *   f    an open GGUF (a model or a vocab-only file)
 *   out  receives the tokenizer; free it with tok_free()
 * Errors: KS_ERR_NOT_FOUND  tokenizer.ggml.model or .tokens missing
 *         KS_ERR_UNSUPPORTED a model other than "llama"/"gpt2"
 *         KS_ERR_FORMAT     inconsistent arrays (scores/types/merges), bad ids
 *         KS_ERR_NOMEM */
ks_status tok_load(const struct gguf_file *f, struct tokenizer **out);
void tok_free(struct tokenizer *t); /* NULL is a no-op */

enum tok_family tok_family(const struct tokenizer *t);
/* The pre-tokenizer actually in use ("default" after a fallback); "" for SPM. */
const char *tok_pre_name(const struct tokenizer *t);
int32_t tok_n_vocab(const struct tokenizer *t);

/* ---- special tokens ---------------------------------------------------- */

struct tok_special {
    int32_t bos, eos, eot, eom, pad, unk, nl; /* -1 when the vocabulary has none */
    /* fill-in-the-middle (/infill): prefix, suffix, middle, pad, repository
     * and file separator, from tokenizer.ggml.fim_*_token_id or found by
     * their texts as llama.cpp does; pad, rep and sep end a generation. */
    int32_t fim_pre, fim_suf, fim_mid, fim_pad, fim_rep, fim_sep;
    bool add_bos;                             /* tokenizer.ggml.add_bos_token (SPM default true) */
    bool add_eos;                             /* tokenizer.ggml.add_eos_token (default false;
                                                 WPM: true, eos is then [SEP]) */
    bool add_space_prefix;                    /* SPM: prepend a space to the text (default true);
                                                 WPM: true (only drops the first space on decode) */
};

/* Never NULL; valid until tok_free(). */
const struct tok_special *tok_special(const struct tokenizer *t);
/* True for every end-of-generation id: eos, eot, eom and the other control
 * tokens llama.cpp treats as such (<|eot_id|>, <|im_end|>, <|end|>,
 * <end_of_turn>, <|endoftext|>, ...). False for an out-of-range id. */
bool tok_is_eog(const struct tokenizer *t, int32_t id);
/* True for control tokens (type CONTROL), which detokenize to "" unless
 * TOK_DECODE_SPECIAL is given. False for an out-of-range id. */
bool tok_is_control(const struct tokenizer *t, int32_t id);
/* Id of the token whose vocabulary text is exactly text[0..len), or -1. */
int32_t tok_find(const struct tokenizer *t, const char *text, size_t len);

/* ---- encoding ---------------------------------------------------------- */

/* Flags for tok_encode. */
#define TOK_ADD_SPECIAL 1u   /* add BOS/EOS as add_bos/add_eos say */
#define TOK_PARSE_SPECIAL 2u /* match control and user-defined tokens written in the
                                text; leave OFF for untrusted text (user input) */

/* Tokenize text[0..len) (any bytes; invalid UTF-8 is tokenized, never rejected,
 * and for SPM/BPE vocabularies with all 256 byte tokens it decodes back intact).
 *   ids    receives a malloc'd array the caller frees with free(); it is a
 *          valid pointer (never NULL) even when *n_ids is 0
 *   n_ids  receives the count
 * Errors: KS_ERR_INVALID_ARG (NULL t/ids/n_ids, or text NULL with len > 0),
 *         KS_ERR_RANGE (len over 1 GiB), KS_ERR_NOMEM. */
ks_status tok_encode(const struct tokenizer *t, const char *text, size_t len, unsigned flags,
                     int32_t **ids, size_t *n_ids);

/* ---- fill in the middle ----------------------------------------------- */

/* A piece of /infill's input_prefix or input_suffix: text (no special tokens
 * parsed) or, when text is NULL, a token id (the caller checked its range). */
struct tok_infill_part {
    const char *text;
    int32_t id;
};
/* A file of input_extra; name NULL: "tmp". */
struct tok_infill_file {
    const char *name, *text;
};
struct tok_infill {
    const struct tok_infill_part *prefix, *suffix;
    size_t n_prefix, n_suffix;
    const char *prompt;       /* continues the prefix (special tokens parsed); NULL: none */
    const struct tok_infill_file *files;
    size_t n_files;
    int32_t n_ctx;            /* the server's context: the files keep their last n_ctx - 2048 + 2 tokens */
    bool spm;                 /* the suffix first (--spm-infill) */
};
/* llama-server's /infill prompt (format_prompt_infill: the repository-level
 * FIM pattern, its cuts of the prefix, suffix and files) as token ids in
 * *ids (malloc'd), *n of them. The server serves it, the router keys it.
 * KS_ERR_UNSUPPORTED (no FIM prefix, suffix or middle token), KS_ERR_NOMEM,
 * tok_encode's errors. */
ks_status tok_infill_prompt(const struct tokenizer *tok, const struct tok_infill *in, int32_t **ids, size_t *n);

/* Can a draft model with vocabulary `draft` propose tokens for a target with
 * vocabulary `target` (speculative decoding)? llama.cpp's rules
 * (common_speculative_are_compatible) made strict: the same tokenizer family,
 * the same add_bos and add_eos and, where they are added, the same BOS / EOS
 * ids, and the same vocabulary: as many tokens, each with the same text
 * (llama.cpp tolerates 128 extra tokens and skips the first 5; a draft token
 * the target cannot read would only be rejected, but ids must mean the same).
 * KS_ERR_INVALID_ARG names the first difference: for the vocabulary, both
 * sizes and the first differing id with both texts. */
ks_status tok_check_same_vocab(const struct tokenizer *target, const struct tokenizer *draft);

/* ---- decoding ---------------------------------------------------------- */

/* The bytes a token stands for (U+2581 -> ' ', <0xXX> -> the byte, byte-level
 * unicode -> bytes). Control tokens give their text, e.g. "</s>". The bytes
 * are owned by t, valid until tok_free(), not NUL-terminated and may be a
 * partial UTF-8 sequence.
 * Errors: KS_ERR_RANGE for id < 0 or id >= n_vocab. */
ks_status tok_piece(const struct tokenizer *t, int32_t id, const char **bytes, size_t *len);
/* The token's raw vocabulary string (e.g. "▁the", "Ġthe", "<0x0A>"), owned
 * by t. Errors: KS_ERR_RANGE. */
ks_status tok_text(const struct tokenizer *t, int32_t id, const char **text, size_t *len);

/* A malloc'd NUL-terminated copy of the token's vocabulary text (a chat
 * template's bos_token / eos_token); "" for id -1 or an out-of-range id.
 * NULL only when out of memory. */
char *tok_text_dup(const struct tokenizer *t, int32_t id);

/* Flags for tok_decode and tok_stream_create. */
#define TOK_DECODE_SPECIAL 1u     /* render control tokens as their text (default: "") */
#define TOK_DECODE_KEEP_SPACE 2u  /* SPM/WPM with add_space_prefix: keep the leading space
                                     of the first non-control piece (default: drop it, so
                                     that decode(encode(x)) == x; a BOS before it does not
                                     count) */
#define TOK_DECODE_REPLACE_BAD 4u /* replace invalid UTF-8 with U+FFFD (default: raw bytes) */

/* Detokenize ids[0..n) in one shot into a malloc'd NUL-terminated string
 * (*len excludes the NUL); the caller frees it with free(). The result is
 * byte-identical to concatenating a tok_stream's output with the same flags.
 * Errors: KS_ERR_RANGE for an invalid id (names its index), KS_ERR_NOMEM. */
ks_status tok_decode(const struct tokenizer *t, const int32_t *ids, size_t n, unsigned flags,
                     char **out, size_t *len);

/* Copy s[0..n) into a malloc'd NUL-terminated string (*len excludes the NUL)
 * in which every byte that does not start a valid UTF-8 character (overlongs,
 * surrogates and code points above U+10FFFF included), and every NUL, became
 * U+FFFD: the result is valid UTF-8 and a C string, as JSON text needs. The
 * rules are tok_decode's with TOK_DECODE_REPLACE_BAD. Errors: KS_ERR_NOMEM. */
ks_status tok_utf8_sanitize(const char *s, size_t n, char **out, size_t *len);

/* A streaming detokenizer: push ids as they are generated, get back only
 * bytes that form whole UTF-8 characters; an incomplete sequence is held
 * until it completes or can no longer complete (then it is emitted raw, or as
 * U+FFFD with TOK_DECODE_REPLACE_BAD). tok_stream_flush() emits whatever is
 * still held at the end. The stream keeps a pointer to t. */
struct tok_stream;

ks_status tok_stream_create(const struct tokenizer *t, unsigned flags, struct tok_stream **out);
void tok_stream_free(struct tok_stream *s); /* NULL is a no-op */
/* Forget all state, as if newly created (a new turn / request). */
void tok_stream_reset(struct tok_stream *s);
/* Push one id. *bytes and *len receive the completed text (possibly len 0); the
 * bytes are owned by s and valid until the next call on s. On KS_ERR_RANGE
 * (invalid id) the stream is unchanged. */
ks_status tok_stream_push(struct tok_stream *s, int32_t id, const char **bytes, size_t *len);
/* Emit held bytes; the stream is then empty (but keeps its "first piece"
 * state, so a later push does not drop a leading space again). */
ks_status tok_stream_flush(struct tok_stream *s, const char **bytes, size_t *len);

/* ---- chat templates ---------------------------------------------------- */

/* Hand-written renderings of common families, as llama.cpp's built-ins do.
 * The server and `kvserve chat` render the model's own template with the
 * jinja module; these are the fallbacks a user names (--chat-template NAME). */
enum tok_chat_family {
    TOK_CHAT_CHATML,  /* "chatml":  <|im_start|>role\n...<|im_end|>\n  (Qwen, SmolLM) */
    TOK_CHAT_LLAMA3,  /* "llama3":  <|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|> */
    TOK_CHAT_LLAMA2,  /* "llama2":  [INST] <<SYS>>\n...\n<</SYS>>\n\n... [/INST] ...</s> */
    TOK_CHAT_MISTRAL, /* "mistral": [INST] ... [/INST] ...</s> (no <<SYS>>; system joins the user turn) */
    TOK_CHAT_ZEPHYR,  /* "zephyr":  <|role|>\n...EOS\n  (Zephyr, TinyLlama) */
    TOK_CHAT_GEMMA,   /* "gemma":   <start_of_turn>user|model\n...<end_of_turn>\n */
    TOK_CHAT_PHI3,    /* "phi3":    <|role|>\n...<|end|>\n */
    TOK_CHAT_COUNT
};

struct tok_chat_msg {
    const char *role;    /* "system", "user" or "assistant" (NUL-terminated) */
    const char *content; /* NUL-terminated */
};

/* "chatml", "llama3", ... Never NULL ("?" for an invalid value). */
const char *tok_chat_name(enum tok_chat_family fam);
/* "chatml, llama3, llama2, mistral, zephyr, gemma, phi3": for error messages. */
const char *tok_chat_names(void);
/* By name (the strings above; also accepts aliases "llama-3", "llama-2",
 * "tinyllama", "phi-3", "qwen"). Errors: KS_ERR_NOT_FOUND with a message
 * that lists the supported names. */
ks_status tok_chat_by_name(const char *name, enum tok_chat_family *out);
/* Detect the family from a Jinja template text (tokenizer.chat_template).
 * Errors: KS_ERR_UNSUPPORTED with a message listing the supported names and
 * suggesting --chat-template NAME. */
ks_status tok_chat_detect(const char *tmpl, size_t len, enum tok_chat_family *out);
/* The family for a model: override_name if not NULL, else detection from the
 * tokenizer.chat_template the tokenizer was loaded with; a vocabulary with no
 * template gets "chatml" (llama.cpp's fallback). Errors as above. */
ks_status tok_chat_for(const struct tokenizer *t, const char *override_name,
                       enum tok_chat_family *out);

/* The tokenizer.chat_template text the tokenizer was loaded with (owned by
 * t, NUL-terminated; *len, which may be NULL, receives its length), or NULL
 * when the vocabulary has none. */
const char *tok_chat_template(const struct tokenizer *t, size_t *len);

/* The chat template a server or a chat session renders every conversation
 * with, set up once from the user's choice and the vocabulary. */
struct tok_chat_setup {
    bool by_family;              /* a hand-written family the user named */
    enum tok_chat_family family; /* when by_family */
    struct jinja_template *jt;   /* else the parsed Jinja template */
    const char *src;             /* its text (len bytes): the caller's, the tokenizer's or
                                    jinja_chatml_template; not owned, valid while they are */
    size_t len;
    bool chatml_fallback;        /* the vocabulary has no template: src is ChatML (llama.cpp's fallback) */
    char *bos_text, *eos_text;   /* the vocabulary's BOS and EOS texts, Jinja's bos_token and eos_token */
};

/* family_name (not NULL): that hand-written family (tok_chat_by_name).
 * Else Jinja: text (len bytes) when not NULL, named origin in errors (e.g. a
 * file's path; NULL: "the chat template"), else the model's
 * tokenizer.chat_template, else ChatML. Errors: KS_ERR_NOT_FOUND (an unknown
 * family, listing the names), KS_ERR_FORMAT (the template does not parse: its
 * origin, line, column and what to do), KS_ERR_NOMEM. On an error *out holds
 * nothing. Free with tok_chat_setup_free (a zeroed struct is fine). */
ks_status tok_chat_setup(const struct tokenizer *t, const char *family_name, const char *text, size_t len,
                         const char *origin, struct tok_chat_setup *out);
void tok_chat_setup_free(struct tok_chat_setup *s);

/* Render msgs[0..n) in the family's format, ending with the assistant header
 * when add_generation_prompt. BOS is NOT written: encode the result with
 * TOK_ADD_SPECIAL | TOK_PARSE_SPECIAL. t (may be NULL) supplies the EOS text
 * for families that write it (zephyr); without t "</s>" is used.
 *   out  receives a malloc'd NUL-terminated string; the caller frees it.
 * Errors: KS_ERR_INVALID_ARG for a NULL role/content or an unknown role,
 *         KS_ERR_NOMEM. */
ks_status tok_chat_render(const struct tokenizer *t, enum tok_chat_family fam,
                          const struct tok_chat_msg *msgs, size_t n, bool add_generation_prompt,
                          char **out);

#endif
