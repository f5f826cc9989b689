/* tokenizer internals shared by the files of this module only. */
#ifndef KS_TOK_INTERNAL_H
#define KS_TOK_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tokenizer/tokenizer.h"

/* Token attributes, as llama.cpp derives them from tokenizer.ggml.token_type. */
enum {
    TOK_ATTR_NORMAL = 1u << 0,
    TOK_ATTR_UNKNOWN = 1u << 1,
    TOK_ATTR_CONTROL = 1u << 2,
    TOK_ATTR_USER_DEFINED = 1u << 3,
    TOK_ATTR_UNUSED = 1u << 4,
    TOK_ATTR_BYTE = 1u << 5,
    TOK_ATTR_LSTRIP = 1u << 6,
    TOK_ATTR_RSTRIP = 1u << 7,
};

/* ---- string -> int32 map (open addressing over a byte arena) ------------ */
struct tok_strmap {
    uint32_t *slots;  /* (capacity) entry index + 1; 0 = empty */
    uint32_t cap;     /* power of two */
    uint32_t n;
    uint64_t *hashes; /* (n) */
    uint32_t *off;    /* (n) offset of the key in arena */
    uint32_t *len;    /* (n) */
    int32_t *val;     /* (n) */
    char *arena;
    size_t arena_len, arena_cap;
};

uint64_t tok_hash_bytes(const char *s, size_t n);
ks_status tok_strmap_init(struct tok_strmap *m, uint32_t expected);
void tok_strmap_free(struct tok_strmap *m);
/* Insert or overwrite; *index receives the entry index. */
ks_status tok_strmap_put(struct tok_strmap *m, const char *s, size_t n, int32_t val, uint32_t *index);
/* Entry index, or -1. */
int64_t tok_strmap_find(const struct tok_strmap *m, const char *s, size_t n);

/* ---- uint64 -> int32 map (BPE merge ranks keyed by symbol-id pairs) ----- */
struct tok_pairmap {
    uint64_t *keys; /* (cap); UINT64_MAX = empty */
    int32_t *vals;  /* (cap) */
    uint32_t cap, n;
};

ks_status tok_pairmap_init(struct tok_pairmap *m, uint32_t expected);
void tok_pairmap_free(struct tok_pairmap *m);
/* Insert only if absent (the first merge of a pair wins, as in llama.cpp). */
void tok_pairmap_put_new(struct tok_pairmap *m, uint64_t key, int32_t val);
int32_t tok_pairmap_get(const struct tok_pairmap *m, uint64_t key); /* -1 if absent */

/* ---- the tokenizer ------------------------------------------------------ */
struct tok_token {
    uint32_t text_off, text_len;   /* raw vocabulary string, in tokenizer.text */
    uint32_t piece_off, piece_len; /* detokenized bytes, in tokenizer.text */
    float score;
    uint32_t attr;
};

#define TOK_MAX_REGEX 6

struct tokenizer {
    enum tok_family family;
    int32_t n_vocab;
    size_t max_token_len; /* longest vocabulary string in bytes */
    struct tok_token *tokens; /* (n_vocab) */
    char *text;               /* arena for every token's text and piece */
    size_t text_len;
    struct tok_special sp;
    bool *is_eog;             /* (n_vocab) */
    char pre[32];

    /* Lookup of a token by its text. SPM: the vocabulary strings. BPE: the
     * byte-level strings decoded to raw bytes, plus every merge half (value
     * -1 when it is not itself a token); the entry index is the symbol id
     * the merge map is keyed by. */
    struct tok_strmap lookup;
    struct tok_pairmap merges; /* BPE: (left sym << 32 | right sym) -> rank */
    int32_t byte_token[256];   /* id for each raw byte (byte fallback), or -1 */
    bool ignore_merges;        /* BPE: a word that is a whole token is taken as is */
    bool spm_split_words;      /* SPM: no token has U+2581 after other text, so merges never
                                  cross the start of a word and words encode alone */

    /* Special tokens that partition text before tokenizing: CONTROL,
     * USER_DEFINED and UNKNOWN tokens, longest text first. */
    int32_t *special;
    size_t n_special;
    /* Finding which special tokens occur in a text in one scan: their texts
     * in a map (entry per distinct text), and per first byte the distinct
     * lengths to try and the possible second bytes. */
    struct tok_strmap special_map;
    uint32_t *special_entry;       /* (n_special) entry of special[k] */
    uint32_t len_off[257];         /* lengths for first byte b: len_list[len_off[b] .. len_off[b+1]) */
    uint32_t *len_list;
    uint64_t second_byte[256][4];  /* bit c: some text starts with b, c */
    bool first_alone[256];         /* some text is the single byte b */

    /* BPE pre-tokenizer: compiled pcre2 patterns applied in sequence. */
    void *regex[TOK_MAX_REGEX];
    int n_regex;

    char *chat_template; /* tokenizer.chat_template or NULL */
    size_t chat_template_len;
};

static inline const char *tok_text_of(const struct tokenizer *t, int32_t id)
{
    return t->text + t->tokens[id].text_off;
}

/* Id of the token with these exact (lookup-form) bytes, or -1. */
int32_t tok_lookup(const struct tokenizer *t, const char *s, size_t n);

/* An id list that grows. */
struct tok_ids {
    int32_t *v;
    size_t n, cap;
};
ks_status tok_ids_push(struct tok_ids *ids, int32_t id);

/* Family encoders for one raw-text fragment. */
ks_status tok_spm_encode(const struct tokenizer *t, const char *text, size_t len, bool add_prefix,
                         struct tok_ids *out);
ks_status tok_bpe_encode(const struct tokenizer *t, const char *text, size_t len, struct tok_ids *out);
ks_status tok_wpm_encode(const struct tokenizer *t, const char *text, size_t len, struct tok_ids *out);

/* BPE setup in tok_bpe.c. */
struct gguf_file;
ks_status tok_bpe_setup(struct tokenizer *t, const struct gguf_file *f, const char *pre, size_t pre_len);
void tok_bpe_free(struct tokenizer *t);
/* Byte-level unicode: codepoint for byte b, and the reverse (-1 if none). */
uint32_t tok_byte_to_cp(uint8_t b);
int tok_cp_to_byte(uint32_t cp);
/* A byte-level string as raw bytes (out has room for n bytes): the length, or
 * -1 if a character is outside the byte alphabet. */
long tok_bytelevel_decode(const char *s, size_t n, char *out);

/* A merge candidate: the pair (left, right) of adjacent symbols whose byte
 * lengths were (ln, rn) when it was queued; key orders the queue (SPM: minus
 * the merged token's score, BPE: the merge rank), ties go to the leftmost. */
struct tok_bigram {
    float key;
    int32_t left, right;
    uint32_t ln, rn;
};
struct tok_heap {
    struct tok_bigram *v;
    size_t n, cap;
};
ks_status tok_heap_push(struct tok_heap *h, struct tok_bigram b);
struct tok_bigram tok_heap_pop(struct tok_heap *h); /* h->n must be > 0 */

/* A symbol during merging: bytes [off, off+n) of the fragment. */
struct tok_sym {
    uint32_t off, n;
    int32_t prev, next;
    int32_t entry; /* BPE: lookup entry index of its bytes, or -1 */
};

/* Per-call memo of word -> ids: text repeats words, and a word always
 * encodes the same way. */
struct tok_cache {
    struct tok_strmap map; /* word -> offset in ids of [count, id...] */
    struct tok_ids ids;
    bool ready;
};
#define TOK_CACHE_MAX_WORD 64
/* Append the cached ids of word s[0..n) to out; false if absent. */
bool tok_cache_get(const struct tok_cache *c, const char *s, size_t n, struct tok_ids *out);
/* Remember ids[0..count) for the word; failures only lose the memo. */
void tok_cache_put(struct tok_cache *c, const char *s, size_t n, const int32_t *ids, size_t count);
void tok_cache_free(struct tok_cache *c);

/* UTF-8 helpers. */
size_t tok_utf8_len(uint8_t lead); /* 1..4 from the lead byte (1 for invalid) */
/* Decode one codepoint at s (n bytes available); returns its length or 0 if
 * invalid/incomplete. */
size_t tok_utf8_decode(const char *s, size_t n, uint32_t *cp);
size_t tok_utf8_encode(uint32_t cp, char *out);

#endif
