/* grammar: grammar-constrained sampling. A GBNF grammar (llama.cpp's syntax)
 * is compiled once per request; a grammar state follows the text generated so
 * far and masks the logits of every step so that only tokens that keep the
 * text a prefix of the grammar's language can be drawn.
 *
 * GBNF, as llama.cpp reads it:
 *   name ::= alternatives           one rule per line; `root` is the start
 *   a b                             sequence        a | b     alternation
 *   ( ... )                         grouping (newlines allowed inside)
 *   x* x+ x? x{m} x{m,} x{m,n}      repetition (m, n <= GRAMMAR_MAX_REPEAT)
 *   "text"                          literal; escapes \n \r \t \\ \" \[ \] \- \/ \xHH \uHHHH \UHHHHHHHH
 *   [a-z_] [^"\\]                   character class, negated class
 *   .                               any character
 *   <[N]>                           the token with id N, drawn as itself (e.g.
 *                                   a control token of a tool-call markup); text
 *                                   never matches it, and its id is checked
 *                                   against the vocabulary only when drawn
 *   # comment                       to the end of the line
 * A rule may also continue on a new line that starts with `|` (llama.cpp
 * needs the whole rule on one line outside parentheses).
 *
 * Matching is over Unicode code points decoded from the tokens' bytes; a token
 * may end inside a character (byte-level BPE), and the rest of that character
 * must come from the next tokens. The state is a set of pushdown stacks, like
 * llama.cpp's, with bounded work: left recursion is refused at compile time,
 * a state holds at most GRAMMAR_MAX_STACKS stacks and one step expands at most
 * GRAMMAR_MAX_EXPAND rule references, at most GRAMMAR_MAX_DEPTH deep.
 *
 * Budget: a state is created with the number of tokens it may still draw
 * (max_tokens). Every stack knows the fewest bytes that complete the grammar
 * from it; a token is allowed only if after it the text can still complete
 * within the tokens left, counting one byte per token (every vocabulary with
 * byte tokens, i.e. byte-level BPE and SentencePiece with byte fallback, can
 * spell any text that way). So the text always completes at or before the
 * last token: generation ends by end-of-generation (EOG allowed only once the
 * grammar is complete) or exactly at max_tokens with a complete text.
 *
 * Speed: the vocabulary is a trie in depth-first order, walked once per mask
 * with one state per depth, so a prefix shared by many tokens is matched once
 * and a rejected prefix skips its whole subtree. Each stack set is interned
 * and its transitions are memoized (an array for ASCII), and the mask of a set
 * is cached as a bitset: a later step in the same set (inside a string, say)
 * costs one pass over the bitset (and, under a tight budget, a pass over the
 * few tokens whose completion distance differs from the set's, kept with
 * it). The vocabulary shares those bitsets
 * between states (grammar_vocab_set_mask_cache), so a set another request
 * has already walked is a copy, not a walk. A set that loops on every plain
 * string character (the inside of a JSON string, where nearly every token is
 * allowed) walks only the tokens that are not plain string content
 * (grammar_vocab_set_plain_skip).
 *
 * Threads: a compiled grammar and a vocabulary are immutable (but for the
 * vocabulary's mask cache, behind its lock) and may be shared by any number
 * of threads (the grammar's reference count is atomic). A state
 * belongs to one thread at a time.
 *
 * Errors follow status/status.h: on failure ks_errmsg() says what and where,
 * and out-parameters are untouched. */
#ifndef KS_GRAMMAR_H
#define KS_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "status/status.h"

#define GRAMMAR_MAX_STACKS 1024     /* stacks in one state (an ambiguous grammar fails here) */
#define GRAMMAR_MAX_EXPAND 100000   /* rule references expanded by one step */
#define GRAMMAR_MAX_REPEAT 10000    /* m and n of x{m,n} */
#define GRAMMAR_MAX_SOURCE (1u << 24) /* bytes of GBNF */
#define GRAMMAR_MAX_ELEMENTS (1 << 22) /* symbols after repetitions are expanded */
#define GRAMMAR_MAX_NESTING 256     /* depth of parentheses */
#define GRAMMAR_MAX_DEPTH 4096      /* nested rule references expanded without consuming a character */

struct grammar;
struct grammar_vocab;
struct grammar_state;

/* ---- compiling ------------------------------------------------------------ */

/* Compile GBNF text gbnf[0..len) (need not be NUL-terminated).
 *   out  receives the grammar with one reference; release it with grammar_free()
 * Errors: KS_ERR_FORMAT "line L, column C: ..." for a syntax error, an
 *         undefined rule (at its first use), a rule defined twice, an empty
 *         class or a repetition over GRAMMAR_MAX_REPEAT; "no 'root' rule";
 *         KS_ERR_UNSUPPORTED for a left-recursive rule (named, with the cycle)
 *         or a root that can never end; KS_ERR_RANGE for text over
 *         GRAMMAR_MAX_SOURCE; KS_ERR_NOMEM. */
ks_status grammar_compile(const char *gbnf, size_t len, struct grammar **out);
/* (also KS_ERR_FORMAT for parentheses nested over GRAMMAR_MAX_NESTING and
 * KS_ERR_RANGE for a grammar over GRAMMAR_MAX_ELEMENTS) */
/* Take one more reference (a state takes its own). */
void grammar_retain(struct grammar *g);
/* Drop one reference; the last frees the grammar. NULL is a no-op. */
void grammar_free(struct grammar *g);
/* The fewest bytes of text the grammar accepts (0 if it accepts ""). */
int32_t grammar_min_bytes(const struct grammar *g);

/* ---- JSON ----------------------------------------------------------------- */

/* GBNF of any JSON object (llama.cpp's json.gbnf: an object at the root, runs
 * of whitespace of at most 20 characters, numbers of at most 16 digits per
 * part). Static, NUL-terminated. */
const char *grammar_json_object_gbnf(void);

/* Convert a JSON Schema (JSON text schema[0..len)) to GBNF, OpenAI's strict
 * subset: type (object, array, string, number, integer, boolean, null, or a
 * list of them), properties (in declared order), required (the others are
 * optional), additionalProperties (false or absent), items, minItems,
 * maxItems, minLength, maxLength, enum, const, anyOf, $defs/definitions with
 * $ref ("#/$defs/NAME", "#/definitions/NAME", "#"), format (date, time,
 * date-time, uuid; other formats are plain strings). Annotations (title,
 * description, default, examples, $schema, $id, $comment, strict, name) are
 * ignored.
 *   gbnf  receives a malloc'd NUL-terminated grammar; the caller frees it
 * Errors: KS_ERR_FORMAT the text is not JSON; KS_ERR_UNSUPPORTED a keyword
 *         outside the subset (named, with its JSON pointer, e.g. "pattern at
 *         /properties/zip"); KS_ERR_INVALID_ARG a keyword with a bad value
 *         or an unresolved $ref; KS_ERR_NOMEM. */
ks_status grammar_from_json_schema(const char *schema, size_t len, char **gbnf);

/* Compose a schema into a larger grammar: the GBNF rules of the JSON Schema
 * schema[0..len) (the subset above) under the rule `name` ([A-Za-z0-9_], 1 to
 * 62 bytes), its helper rules named "name-r1", "name-r2", ... They use the
 * JSON primitive rules of grammar_json_primitives_gbnf() (value, object, array,
 * string, char, hex4, integer, number, boolean, null, ws), which the caller
 * appends once to the whole grammar and must not define otherwise.
 *   gbnf  receives malloc'd NUL-terminated rules; the caller frees them
 * Errors: those of grammar_from_json_schema; KS_ERR_INVALID_ARG a bad name. */
ks_status grammar_json_schema_rules(const char *schema, size_t len, const char *name, char **gbnf);
/* The JSON primitive rules (static, NUL-terminated), without a root. */
const char *grammar_json_primitives_gbnf(void);

/* ---- vocabulary ----------------------------------------------------------- */

enum grammar_token_kind {
    GRAMMAR_TOKEN_TEXT,    /* its bytes are text the grammar matches */
    GRAMMAR_TOKEN_SPECIAL, /* control / unused tokens: allowed only where a <[N]> terminal names them */
    GRAMMAR_TOKEN_EOG,     /* end of generation: allowed once the grammar is complete */
};

/* The bytes of token id (tokenizer.h's tok_piece) and its kind. */
typedef ks_status (*grammar_piece_fn)(void *user, int32_t id, const char **bytes, size_t *len,
                                      enum grammar_token_kind *kind);

/* Build the trie of a vocabulary of n_vocab tokens; piece is called once per
 * id (bytes are copied). A TEXT token with no bytes is never allowed.
 * Errors: KS_ERR_INVALID_ARG n_vocab < 1; whatever piece returns; KS_ERR_NOMEM. */
ks_status grammar_vocab_create(int32_t n_vocab, grammar_piece_fn piece, void *user, struct grammar_vocab **out);
/* The vocabulary of a tokenizer (tokenizer/tokenizer.h): bytes from
 * tok_piece, EOG from tok_is_eog, and control tokens, BOS, PAD and <unk> are
 * special. t is only read during the call. Errors: as grammar_vocab_create. */
struct tokenizer;
ks_status grammar_vocab_from_tokenizer(const struct tokenizer *t, struct grammar_vocab **out);
void grammar_vocab_free(struct grammar_vocab *v); /* NULL is a no-op */
int32_t grammar_vocab_size(const struct grammar_vocab *v);

/* The vocabulary keeps the masks its states compute (a stack set's full
 * mask, before the budget), keyed by the grammar's content and the set's, so
 * a request whose grammar another request compiled from the same text (the
 * same json_schema, json_object) reuses the masks instead of walking the
 * trie. Thread-safe (one lock, held for a lookup or an insert: a copy of
 * n_vocab / 8 bytes); bounded: past the limit it drops every mask and starts
 * over. set_mask_cache drops them and sets the limit in bytes (0: off;
 * default 64 MiB); call it while no state uses v. */
void grammar_vocab_set_mask_cache(struct grammar_vocab *v, size_t bytes);
struct grammar_mask_cache_stats {
    uint64_t hits, misses;    /* lookups answered, and not */
    uint32_t masks;           /* masks held */
    size_t bytes, limit;
};
void grammar_vocab_mask_cache_stats(const struct grammar_vocab *v, struct grammar_mask_cache_stats *out);

/* A stack set that every plain string character (valid UTF-8, no '"', no
 * '\\', no control byte, no DEL) leads back to itself, such as the inside of
 * a JSON string, allows the vocabulary's plain tokens (found once, at
 * create) at its own completion distance: its walk marks them at once and
 * visits only the subtrees of the trie that hold other tokens. The masks are
 * the same either way; set_plain_skip(v, false) turns the shortcut off (for
 * tests and benchmarks to compare against). Call it while no state uses v. */
void grammar_vocab_set_plain_skip(struct grammar_vocab *v, bool on);

/* ---- state ---------------------------------------------------------------- */

/* A state at the start of g's text (takes a reference on g; v is borrowed and
 * must outlive the state; v may be NULL for a state fed only with
 * grammar_accept_text). max_tokens: tokens the state may draw (see Budget);
 * negative means no limit.
 * Errors: KS_ERR_RANGE max_tokens is below grammar_min_bytes() (no output
 *         could complete; max_tokens 0 is allowed: nothing is drawn);
 *         KS_ERR_NOMEM. */
ks_status grammar_state_create(struct grammar *g, const struct grammar_vocab *v, int32_t max_tokens,
                               struct grammar_state **out);
void grammar_state_free(struct grammar_state *st); /* NULL is a no-op */

/* Lazy constraint (tool_choice auto): the text is free until a trigger
 * appears, a trigger word in the generated text or a trigger token drawn;
 * from the trigger on (the word's text, or the token, is the grammar's first
 * input) every token is constrained as above. An at_start word counts only
 * when no text but whitespace came before it. Budget: max_tokens is the whole
 * generation's; the constrained part gets the tokens left when it starts,
 * and a trigger whose text already cannot complete in them (or that the
 * grammar refuses) stays free text. */
#define GRAMMAR_MAX_TRIGGERS 4
#define GRAMMAR_MAX_TRIGGER_LEN 32
struct grammar_trigger {
    char word[GRAMMAR_MAX_TRIGGER_LEN]; /* NUL-terminated, when token < 0 */
    int32_t token;                      /* a trigger token, or -1 */
    bool at_start;
};
struct grammar_triggers {
    int n; /* 1..GRAMMAR_MAX_TRIGGERS */
    struct grammar_trigger t[GRAMMAR_MAX_TRIGGERS];
};
/* A lazy state (trig is copied). Errors: KS_ERR_INVALID_ARG a bad trigger
 * list; KS_ERR_NOMEM. No KS_ERR_RANGE: the grammar may never start. */
ks_status grammar_state_create_lazy(struct grammar *g, const struct grammar_vocab *v, int32_t max_tokens,
                                    const struct grammar_triggers *trig, struct grammar_state **out);
/* Has the constrained part started (always true for a state that is not lazy)? */
bool grammar_triggered(const struct grammar_state *st);

/* Set logits[i] = -INFINITY for every token the grammar does not allow now
 * (a lazy state before its trigger allows everything)
 * (a token is allowed by its bytes, or where a <[N]> terminal may come next
 * by its id; an EOG token never by <[N]>)
 * (and for ids >= the vocabulary's size; n_logits may exceed it). At least one
 * token is left.
 * Errors: KS_ERR_STATE no vocabulary, or no token can continue (the
 *         vocabulary cannot spell what the grammar needs, or the budget is
 *         spent); KS_ERR_RANGE a limit above was reached; KS_ERR_NOMEM.
 *         The state is unchanged on failure. */
ks_status grammar_mask(struct grammar_state *st, float *logits, int32_t n_logits);
/* Advance past a drawn token (one of the budget).
 * Errors: KS_ERR_INVALID_ARG the token is not allowed (out of range, special
 *         where no <[N]> terminal takes it,
 *         EOG before the text is complete, or text the grammar refuses);
 *         KS_ERR_RANGE a limit; KS_ERR_NOMEM. The state is unchanged on failure. */
ks_status grammar_accept(struct grammar_state *st, int32_t token);
/* Advance past raw text (no budget is spent). Same errors as grammar_accept. */
ks_status grammar_accept_text(struct grammar_state *st, const char *text, size_t len);
/* May the text end here (the grammar is complete and no character is cut)? */
bool grammar_complete(const struct grammar_state *st);

/* Trie walks this state has made (masks not served from a cache), and masks
 * it took from the vocabulary's shared cache, for tests and benchmarks. */
uint64_t grammar_state_walks(const struct grammar_state *st);
uint64_t grammar_state_shared_hits(const struct grammar_state *st);

/* Debug aid: check the state's invariants (its stacks: node and set bounds,
 * parents before children, sets sorted and within GRAMMAR_MAX_STACKS, the set
 * table; where the text is; its mask cache's byte count; the vocabulary's
 * shared mask cache: entries, bytes and limit, every key findable).
 * KS_ERR_INTERNAL names the first broken one. Debug builds (no NDEBUG;
 * -DKS_GRAMMAR_CHECK=0/1 overrides) also run it after every call here that
 * changes a state and abort naming the call; Release builds never do. */
ks_status grammar_check(const struct grammar_state *st);

/* Does g accept exactly text[0..len)? False with ks_errmsg() set when it
 * does not (or on out of memory). */
bool grammar_match(struct grammar *g, const char *text, size_t len);
/* Is text[0..len) a complete sentence of g that no longer sentence extends
 * (only the end may follow: a JSON object's closing brace)? A generation cut
 * by max_tokens exactly there was not cut. */
bool grammar_match_ended(struct grammar *g, const char *text, size_t len);

#endif
