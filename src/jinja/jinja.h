/* jinja: a strict, sandboxed interpreter for the Jinja subset that real chat
 * templates use, with data in cJSON values.
 *
 * The language (Jinja2 semantics with trim_blocks and lstrip_blocks on, as
 * transformers' apply_chat_template and llama.cpp set them):
 *   statements  if/elif/else, for (tuple targets, `if` filter, else, loop.index,
 *               index0, revindex, revindex0, first, last, length, previtem,
 *               nextitem), break, continue, set (names, tuples, ns.attr), block
 *               set, macro (defaults, keyword arguments), filter blocks,
 *               generation blocks (rendered as plain content), comments,
 *               whitespace control {%- -%} {{- -}} {#- -#} and {%+
 *   expressions literals, lists, dicts, tuples, attribute and index access,
 *               slices (strings by code point), calls, `if else`, and/or/not,
 *               == != < <= > >=, in / not in, is [not] TEST, ~ + - * / // % **
 *   filters     abs capitalize count default/d dictsort first float from_json
 *               indent int items join last length list lower map max min reject
 *               rejectattr replace reverse round safe select selectattr sort
 *               string sum title tojson trim unique upper wordcount
 *   tests       boolean callable defined divisibleby eq even false float ge gt in
 *               integer iterable le lower lt mapping ne none number odd sameas
 *               sequence string true undefined upper
 *   globals     range, namespace, raise_exception, strftime_now
 *   methods     str: strip lstrip rstrip split startswith endswith replace upper
 *               lower title capitalize format count find join; list: append pop
 *               index extend insert; dict: get items keys values pop update
 *               setdefault
 * Values print as Python's str() does: dicts, lists and tuples as their repr
 * ({'a': [1, 'x']}, (1, 2)), booleans as True/False, null as None; `+`
 * between a string and a dict or list writes the dict or list as JSON (as
 * llama.cpp does). Undefined values render as "", are false, iterate as empty
 * and add to a string as "" (llama.cpp's leniency); using one as a number or
 * calling one is an error. As in Jinja2 and llama.cpp, the template's last
 * newline is dropped and \r\n or \r read as \n.
 *
 * Sandbox: a template can only read its context and produce text. Nothing
 * touches files, the environment or the clock (strftime_now reads opts->now).
 * Every render runs under limits (struct jinja_opts): output bytes, string
 * bytes, steps (a budget of evaluation steps standing in for time: every loop
 * iteration, statement, expression node and filter costs one, and bulk work a
 * step per 64 bytes copied or searched or entries scanned), call and nesting
 * depth, and memory (which also bounds the work of everything that
 * allocates). A limit that fires is an error, never a truncated prompt.
 *
 * Threads: a parsed template is immutable; any number of threads may render it
 * at once. Errors follow status/status.h: a failing function has called
 * ks_fail() and leaves its out-parameters untouched. */
#ifndef KS_JINJA_H
#define KS_JINJA_H

#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "status/status.h"

struct jinja_template;

/* Limits and inputs of one render. A zero field takes the default in brackets. */
struct jinja_opts {
    size_t max_output;    /* bytes of rendered text [4 MiB] */
    size_t max_string;    /* bytes of any one string the template builds [4 MiB] */
    uint64_t max_steps;   /* evaluation steps [10 000 000] */
    unsigned max_depth;   /* nested macro calls plus expression nesting [200] */
    size_t max_memory;    /* bytes of values alive during the render [64 MiB] */
    int64_t now;          /* strftime_now's time, seconds since the epoch, UTC;
                             0 means 1970-01-01 (there is no hidden clock) */
};

/* Parse src[0..len) (need not be NUL-terminated; may contain any bytes).
 *   out  receives the template; free it with jinja_free(). The template keeps
 *        its own copy of src.
 * Errors: KS_ERR_INVALID_ARG  NULL out, or NULL src with len > 0
 *         KS_ERR_FORMAT       a syntax error; the message starts with
 *                             "line L, column C: " (1-based, columns in bytes)
 *         KS_ERR_UNSUPPORTED  a statement, filter or test outside the subset
 *                             (named, with the line and column)
 *         KS_ERR_RANGE        nesting deeper than 200, or len over 16 MiB
 *         KS_ERR_NOMEM */
ks_status jinja_parse(const char *src, size_t len, struct jinja_template **out);

/* NULL is a no-op. */
void jinja_free(struct jinja_template *t);

/* Render t with the variables of context (a JSON object; NULL = no variables).
 *   opts  limits and now; NULL = all defaults
 *   out   receives a malloc'd NUL-terminated string the caller frees with
 *         free(); *out_len (may be NULL) its length without the NUL (the text
 *         may itself hold NULs if the context strings do)
 * Errors: KS_ERR_INVALID_ARG  NULL t or out, a context that is not an object,
 *                             or a type error in the template (calling a
 *                             non-function, a number plus a string, ...)
 *         KS_ERR_STATE        the template called raise_exception(msg): the
 *                             message is "template raised: msg"
 *         KS_ERR_UNSUPPORTED  a filter or test named only at render time (map('x'),
 *                             select('x'))
 *         KS_ERR_RANGE        a limit fired (the message names it)
 *         KS_ERR_NOMEM
 * Every runtime error message starts with "line L, column C: " of the
 * expression or statement that failed. */
ks_status jinja_render(const struct jinja_template *t, const cJSON *context, const struct jinja_opts *opts,
                       char **out, size_t *out_len);

/* ---- chat templates ------------------------------------------------------ */

/* What llama.cpp does around a model's template when it renders an OpenAI chat
 * request (its polyfills), so that the prompt matches llama-server --jinja:
 * - tool-call `arguments` given as a JSON string are parsed into an object;
 * - a template that refuses the system role (raise_exception when it meets
 *   one) gets the system message folded into the first user turn
 *   ("SYSTEM\nUSER");
 * - `tools` are passed as given when the request has them;
 * - a BOS text the template prints at the very start is removed (tokenization
 *   adds BOS again);
 * - a template that reads message['tool_responses'] (Gemma 4) gets the tool
 *   messages that follow an assistant's tool calls as that message's
 *   tool_responses [{name, response}], the response parsed when it is JSON;
 * - enable_thinking is true, unless the flag changes nothing after the last
 *   message (the generation prompt): llama.cpp sees no thinking support in
 *   such a template (Apertus) and renders it with false;
 * - bos_token, eos_token, date_string ("24 Nov 2026", Llama 3.1) and
 *   datetime ("Nov 24 2026", FireFunction v2) are set, the dates from
 *   opts->now; add_generation_prompt is true, or left undefined when off.
 * The system fold is tried when the render raises and a system message is
 * present (llama.cpp probes the template's use of the system content
 * instead; the corpus of 60 templates gives the same prompts). */
struct jinja_chat {
    const char *bos_token;      /* NULL = "" */
    const char *eos_token;      /* NULL = "" */
    int add_generation_prompt;  /* nonzero = true */
    const cJSON *kwargs;        /* NULL, or an object whose entries are set in the
                                   context after the defaults above (the request's
                                   chat_template_kwargs, e.g. enable_thinking); an
                                   enable_thinking given here is used as is (no
                                   probe of the template's thinking support) */
};

/* Render request (an object with "messages" and optionally "tools") into the
 * prompt text, as jinja_render does (same ownership of *out). The request is
 * not modified (the polyfills work on a copy). chat NULL = empty BOS and EOS
 * texts, no generation prompt. A template that mentions enable_thinking is
 * rendered twice, one that raises on a system message twice.
 * Errors: as jinja_render; KS_ERR_INVALID_ARG also for NULL t, request or
 *         out, a request without a "messages" array, tool-call arguments
 *         that are not JSON, or kwargs that is not an object. */
ks_status jinja_chat_render(const struct jinja_template *t, const cJSON *request, const struct jinja_chat *chat,
                            const struct jinja_opts *opts, char **out, size_t *out_len);

/* ChatML as a Jinja template: what a model without tokenizer.chat_template is
 * rendered with (llama.cpp's fallback). NUL-terminated. */
extern const char jinja_chatml_template[];

#endif
