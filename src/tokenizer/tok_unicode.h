/* tokenizer: Unicode tables for the WordPiece pre-processing (generated). */
#ifndef KS_TOK_UNICODE_H
#define KS_TOK_UNICODE_H

#include <stdint.h>

enum { TOK_CP_WS = 1, TOK_CP_CONTROL = 2, TOK_CP_PUNCT = 4, TOK_CP_SYMBOL = 8 };

struct tok_cp_range {
    uint32_t first, last;
    uint32_t flags;
};
struct tok_cp_pair {
    uint32_t from, to;
};

extern const struct tok_cp_range tok_cp_flag_ranges[];
extern const unsigned tok_cp_flag_ranges_n;
extern const struct tok_cp_pair tok_cp_lower[]; /* sorted by from */
extern const unsigned tok_cp_lower_n;
extern const struct tok_cp_pair tok_cp_nfd[]; /* first code point of the NFD form */
extern const unsigned tok_cp_nfd_n;

#endif
