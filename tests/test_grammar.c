/* The grammar module: GBNF parsing and its errors, matching, the JSON grammar,
 * JSON Schema conversion keyword by keyword, the mask against real
 * vocabularies (checked token by token against feeding the token's bytes),
 * and the max_tokens guarantee (random walks that always end complete).
 * Vocabularies come from ../shared/models/vocab; those tests skip without them. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "gguf/gguf.h"
#include "grammar/grammar.h"
#include "support/skip.h"
#include "tokenizer/tokenizer.h"

static struct grammar *compile(const char *gbnf)
{
    struct grammar *g = NULL;
    ks_status st = grammar_compile(gbnf, strlen(gbnf), &g);
    if (st)
        fprintf(stderr, "compile failed: %s\n%s\n", ks_errmsg(), gbnf);
    assert_int_equal(st, KS_OK);
    return g;
}

static bool match(struct grammar *g, const char *text)
{
    return grammar_match(g, text, strlen(text));
}

static void expect_error(const char *gbnf, ks_status want, const char *fragment)
{
    struct grammar *g = NULL;
    ks_status st = grammar_compile(gbnf, strlen(gbnf), &g);
    if (st != want || !strstr(ks_errmsg(), fragment))
        fprintf(stderr, "grammar:\n%s\nwant %d containing '%s', got %d: %s\n", gbnf, want, fragment, st, ks_errmsg());
    assert_int_equal(st, want);
    assert_non_null(strstr(ks_errmsg(), fragment));
    assert_null(g);
}

/* ---- GBNF ------------------------------------------------------------------ */

static void test_parse_errors(void **state)
{
    (void)state;
    expect_error("root ::= \"a\" \n foo ::= [a-", KS_ERR_FORMAT, "line 2");
    expect_error("root ::= (\"a\"", KS_ERR_FORMAT, "expected ')'");
    expect_error("root ::= x", KS_ERR_FORMAT, "'x' is used but never defined");
    expect_error("root ::= \"a\"\nroot ::= \"b\"", KS_ERR_FORMAT, "defined twice");
    expect_error("a ::= \"x\"", KS_ERR_FORMAT, "no 'root' rule");
    expect_error("root ::= \"abc", KS_ERR_FORMAT, "unterminated string");
    expect_error("root ::= [abc", KS_ERR_FORMAT, "unterminated character class");
    expect_error("root ::= \"\\q\"", KS_ERR_FORMAT, "unknown escape");
    expect_error("root = \"a\"", KS_ERR_FORMAT, "expected '::='");
    expect_error("root ::= \"a\"{3,2}", KS_ERR_FORMAT, "below the minimum");
    expect_error("root ::= \"a\"{99999}", KS_ERR_FORMAT, "repetition count over");
    expect_error("root ::= []", KS_ERR_FORMAT, "empty character class");
    expect_error("root ::= \"a\" )", KS_ERR_FORMAT, "line 1, column 14");
    expect_error("root ::= root \"a\" | \"b\"", KS_ERR_UNSUPPORTED, "left-recursive");
    expect_error("root ::= x\nx ::= y? root \"a\"\ny ::= \"b\"", KS_ERR_UNSUPPORTED, "left-recursive");
    expect_error("root ::= (\"\")*", KS_ERR_UNSUPPORTED, "a group or repetition in rule 'root'");
    expect_error("root ::= x*\nx ::= \"a\"?", KS_ERR_UNSUPPORTED, "left-recursive");
    expect_error("root ::= \"a\" root", KS_ERR_UNSUPPORTED, "can never end");
    expect_error("root ::= \"\xff\"", KS_ERR_FORMAT, "invalid UTF-8");
    /* limits on untrusted text: nesting, and the size repetitions multiply to */
    char deep[2000] = "root ::= ";
    for (int i = 0; i < 300; i++)
        strcat(deep, "(");
    expect_error(deep, KS_ERR_FORMAT, "nested deeper than 256");
    expect_error("root ::= ((\"ab\"{10000}){10000}){10000}", KS_ERR_UNSUPPORTED, "shortest text is over");
    char *wide = malloc(8000);
    strcpy(wide, "root ::= ");
    for (int i = 0; i < 500; i++)
        strcat(wide, "\"a\"{10000} ");
    expect_error(wide, KS_ERR_RANGE, "over 4194304 elements");
    free(wide);
    struct grammar *big = compile("root ::= \"a\"{10000} \"b\"{10000} x\nx ::= \"c\"{0,10000}");
    assert_int_equal(grammar_min_bytes(big), 20000);
    grammar_free(big);
}

static void test_match_basics(void **state)
{
    (void)state;
    struct grammar *g = compile("# a comment\n"
                                "root ::= greeting (\" \" name)? \"!\"{1,3}   # trailing comment\n"
                                "greeting ::= \"hello\" | \"hi\"\n"
                                "name ::= [A-Z] [a-z]* | \"\\u00e9t\\xe9\"\n");
    assert_true(match(g, "hello!"));
    assert_true(match(g, "hi Bob!!!"));
    assert_true(match(g, "hi \xc3\xa9t\xc3\xa9!"));
    assert_true(match(g, "hi B!"));
    assert_false(match(g, "hi!!!!"));
    assert_false(match(g, "hi bob!"));
    assert_false(match(g, "hello"));
    assert_false(match(g, "hey!"));
    grammar_free(g);

    g = compile("root ::= [^a-c\\]] . [\\x41-\\x43] \"\\n\\t\\\\\\\"\"");
    assert_true(match(g, "d\xe2\x82\xac" "B\n\t\\\""));
    assert_true(match(g, "]xA\n\t\\\"") == false);
    assert_false(match(g, "axA\n\t\\\""));
    grammar_free(g);

    /* repetition forms, grouping across lines, '|' starting a line */
    g = compile("root ::= (\n  \"a\"+ \"b\"{2} \"c\"{1,} \"d\"{0,2}\n)\n  | \"x\" ( \"y\" | \"z\" )*\n");
    assert_true(match(g, "abbc"));
    assert_true(match(g, "aaabbcccdd"));
    assert_false(match(g, "abbcddd"));
    assert_false(match(g, "abc"));
    assert_true(match(g, "x"));
    assert_true(match(g, "xyzzy"));
    assert_false(match(g, "xa"));
    assert_int_equal(grammar_min_bytes(g), 1);
    grammar_free(g);

    /* deep right recursion runs in constant stack depth; ambiguity is bounded */
    g = compile("root ::= item*\nitem ::= \"a\" | \"b\"");
    char big[20001];
    for (int i = 0; i < 20000; i++)
        big[i] = i % 3 ? 'a' : 'b';
    big[20000] = 0;
    assert_true(match(g, big));
    grammar_free(g);

    /* a character cut where only a surrogate (or a code point over U+10FFFF) could follow is refused early */
    g = compile("root ::= [^\"]*");
    struct grammar_state *st;
    assert_int_equal(grammar_state_create(g, NULL, -1, &st), KS_OK);
    assert_int_equal(grammar_accept_text(st, "\xed", 1), KS_OK);
    assert_int_equal(grammar_accept_text(st, "\xa0", 1), KS_ERR_INVALID_ARG);
    assert_int_equal(grammar_accept_text(st, "\x9f", 1), KS_OK);
    assert_false(grammar_complete(st));
    assert_int_equal(grammar_accept_text(st, "\xbf", 1), KS_OK);
    assert_true(grammar_complete(st));
    assert_int_equal(grammar_accept_text(st, "\xf4\x90", 2), KS_ERR_INVALID_ARG);
    assert_int_equal(grammar_accept_text(st, "\xe0\x80", 2), KS_ERR_INVALID_ARG); /* overlong */
    assert_int_equal(grammar_check(st), KS_OK); /* refusals leave a sound state */
    grammar_state_free(st);
    grammar_free(g);

    g = compile("root ::= x\nx ::= \"(\" x \")\" | \"\"");
    assert_true(match(g, "((()))"));
    assert_false(match(g, "(()"));
    grammar_free(g);
}

/* ---- JSON ------------------------------------------------------------------- */

static void test_json_object_grammar(void **state)
{
    (void)state;
    const char *gbnf = grammar_json_object_gbnf();
    struct grammar *g = compile(gbnf);
    static const char *good[] = {
        "{}", "{ }", "{\"a\":1}", "{\"a\": [1, 2.5, -3e10, true, false, null, \"x\"]}",
        "{\"nested\": {\"deep\": {\"deeper\": [[], {}]}}}", "{\"esc\": \"\\\" \\\\ \\/ \\b \\f \\n \\r \\t \\u00e9\"}",
        "{\"utf8\": \"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\"}", "{\n  \"a\" : 0 ,\n  \"b\" : -0.5E+3\n}",
        "{\"n\": 1234567890123456}",
    };
    static const char *bad[] = {
        "", "[]", "1", "{", "{\"a\"}", "{\"a\":}", "{\"a\":1,}", "{a:1}", "{\"a\":01}", "{\"a\":1.}",
        "{\"a\":\"\x01\"}", "{\"a\":\"\\x\"}", "{\"a\":\"\\ud800\"}", "{\"a\":tru}", "{\"a\":1}x",
        "{                      }", /* 22 spaces: whitespace runs are bounded */
        "{\"n\": 12345678901234567}",
    };
    for (size_t i = 0; i < sizeof good / sizeof *good; i++) {
        if (!match(g, good[i]))
            fprintf(stderr, "rejected %s: %s\n", good[i], ks_errmsg());
        assert_true(match(g, good[i]));
        cJSON *j = cJSON_Parse(good[i]);
        assert_non_null(j);
        cJSON_Delete(j);
    }
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        if (match(g, bad[i]))
            fprintf(stderr, "accepted %s\n", bad[i]);
        assert_false(match(g, bad[i]));
    }
    grammar_free(g);
}

static struct grammar *schema_grammar(const char *schema)
{
    char *gbnf = NULL;
    ks_status st = grammar_from_json_schema(schema, strlen(schema), &gbnf);
    if (st)
        fprintf(stderr, "schema failed: %s\n", ks_errmsg());
    assert_int_equal(st, KS_OK);
    struct grammar *g = compile(gbnf);
    free(gbnf);
    return g;
}

static void schema_cases(const char *schema, const char *const *good, const char *const *bad)
{
    struct grammar *g = schema_grammar(schema);
    for (; good && *good; good++) {
        if (!match(g, *good))
            fprintf(stderr, "schema %s rejected %s: %s\n", schema, *good, ks_errmsg());
        assert_true(match(g, *good));
    }
    for (; bad && *bad; bad++) {
        if (match(g, *bad))
            fprintf(stderr, "schema %s accepted %s\n", schema, *bad);
        assert_false(match(g, *bad));
    }
    grammar_free(g);
}

#define L(...) ((const char *const[]){__VA_ARGS__, NULL})

static void test_schema_keywords(void **state)
{
    (void)state;
    schema_cases("{\"type\":\"string\"}", L("\"\"", "\"abc\""), L("abc", "1", "null"));
    schema_cases("{\"type\":\"integer\"}", L("0", "-12", "42"), L("1.5", "\"1\"", "01"));
    schema_cases("{\"type\":\"number\"}", L("0", "-1.25", "3e5", "2E-3"), L(".5", "1.", "\"1\""));
    schema_cases("{\"type\":\"boolean\"}", L("true", "false"), L("1", "null"));
    schema_cases("{\"type\":\"null\"}", L("null"), L("0", "\"null\""));
    schema_cases("{\"type\":[\"string\",\"null\"]}", L("\"x\"", "null"), L("1"));
    schema_cases("{\"enum\":[\"red\",\"green\",1,null]}", L("\"red\"", "\"green\"", "1", "null"),
                 L("\"blue\"", "\"Red\"", "2"));
    schema_cases("{\"const\":{\"k\":[1,\"a\\\"b\"]}}", L("{\"k\":[1,\"a\\\"b\"]}"), L("{\"k\":[1]}"));
    schema_cases("{\"anyOf\":[{\"type\":\"integer\"},{\"type\":\"string\"}]}", L("1", "\"1\""), L("true"));
    schema_cases("{\"type\":\"array\",\"items\":{\"type\":\"integer\"}}", L("[]", "[1]", "[1, 2 ,3]"),
                 L("[\"a\"]", "[1,]", "{}"));
    schema_cases("{\"type\":\"array\",\"items\":{\"type\":\"integer\"},\"minItems\":2,\"maxItems\":3}",
                 L("[1,2]", "[1,2,3]"), L("[]", "[1]", "[1,2,3,4]"));
    schema_cases("{\"type\":\"string\",\"minLength\":2,\"maxLength\":3}", L("\"ab\"", "\"a\\nb\"", "\"abc\""),
                 L("\"a\"", "\"abcd\""));
    schema_cases("{\"type\":\"string\",\"format\":\"date\"}", L("\"2024-02-29\""), L("\"2024-13-01\"", "\"x\""));
    schema_cases("{\"type\":\"string\",\"format\":\"date-time\"}", L("\"2024-02-29T23:59:59Z\"", "\"2024-01-01T00:00:00.123+02:00\""),
                 L("\"2024-01-01\""));
    schema_cases("{\"type\":\"string\",\"format\":\"uuid\"}", L("\"123e4567-e89b-12d3-a456-426614174000\""),
                 L("\"123e4567\""));
    /* objects: declared order, required always present, optional may be left out, nothing else */
    const char *obj = "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},"
                      "\"age\":{\"type\":\"integer\"},\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"}}},"
                      "\"required\":[\"name\",\"tags\"],\"additionalProperties\":false}";
    schema_cases(obj, L("{\"name\":\"a\",\"age\":3,\"tags\":[]}", "{\"name\":\"a\",\"tags\":[\"x\"]}",
                        "{ \"name\" : \"a\" , \"tags\" : [ ] }"),
                 L("{\"age\":3,\"name\":\"a\",\"tags\":[]}", "{\"name\":\"a\"}", "{\"name\":\"a\",\"tags\":[],\"x\":1}",
                   "{\"tags\":[]}", "{}"));
    schema_cases("{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"integer\"}},"
                 "\"additionalProperties\":false}",
                 L("{}", "{\"a\":1}", "{\"b\":2}", "{\"a\":1,\"b\":2}"), L("{\"b\":2,\"a\":1}", "{,\"b\":2}"));
    schema_cases("{\"type\":\"object\",\"properties\":{},\"additionalProperties\":false}", L("{}", "{ }"),
                 L("{\"a\":1}"));
    schema_cases("{\"type\":\"object\"}", L("{}", "{\"any\":[1,{}]}"), L("[]"));
    /* $defs / $ref, recursion through "#" */
    schema_cases("{\"$defs\":{\"pt\":{\"type\":\"object\",\"properties\":{\"x\":{\"type\":\"number\"}},"
                 "\"required\":[\"x\"],\"additionalProperties\":false}},"
                 "\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/pt\"}}",
                 L("[{\"x\":1},{\"x\":2.5}]"), L("[{\"y\":1}]"));
    schema_cases("{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\"},\"next\":{\"anyOf\":[{\"$ref\":\"#\"},"
                 "{\"type\":\"null\"}]}},\"required\":[\"v\",\"next\"],\"additionalProperties\":false}",
                 L("{\"v\":1,\"next\":{\"v\":2,\"next\":null}}"), L("{\"v\":1,\"next\":{\"v\":2}}"));
    /* annotations are ignored */
    schema_cases("{\"title\":\"t\",\"description\":\"d\",\"$schema\":\"x\",\"type\":\"integer\"}", L("1"), L("\"1\""));
}

/* Integer bounds: every integer near each bound (and a few far off) is
 * accepted exactly when it lies within them, written canonically. */
static void check_int_range(const char *bounds, long long lo, long long hi)
{
    char schema[256], text[32];
    snprintf(schema, sizeof schema, "{\"type\":\"integer\",%s}", bounds);
    struct grammar *g = schema_grammar(schema);
    long long probes[] = {lo, hi, 0, 1, -1, 9, 10, 99, 100, 999, 1000, -9, -10, -100, 9999999999999999LL,
                          -9999999999999999LL, 123456789012LL};
    for (size_t p = 0; p < sizeof probes / sizeof *probes; p++) {
        for (long long v = probes[p] - 25; v <= probes[p] + 25; v++) {
            if (v > 9999999999999999LL || v < -9999999999999999LL)
                continue;
            snprintf(text, sizeof text, "%lld", v);
            bool want = v >= lo && v <= hi;
            if (match(g, text) != want)
                fail_msg("%s: %s %s", schema, text, want ? "rejected" : "accepted");
        }
    }
    assert_false(match(g, "-0") && lo > 0);
    assert_false(match(g, "007"));
    assert_false(match(g, "1.5"));
    grammar_free(g);
}

/* Complete and nothing may follow (a JSON object's closing brace), against
 * complete but extensible, and a prefix. */
static void test_match_ended(void **state)
{
    (void)state;
    struct grammar *g = schema_grammar("{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},"
                                       "\"required\":[\"a\"],\"additionalProperties\":false}");
    assert_true(grammar_match_ended(g, "{\"a\":12}", 8));
    assert_false(grammar_match_ended(g, "{\"a\":12", 7));
    grammar_free(g);
    g = compile("root ::= [a-z]+");
    assert_true(grammar_match(g, "abc", 3));
    assert_false(grammar_match_ended(g, "abc", 3)); /* more letters may follow */
    grammar_free(g);
    g = compile("root ::= \"yes\" | \"no\"");
    assert_true(grammar_match_ended(g, "no", 2));
    assert_false(grammar_match_ended(g, "n", 1));
    grammar_free(g);
}

static void test_schema_integer_bounds(void **state)
{
    (void)state;
    check_int_range("\"minimum\":0", 0, 9999999999999999LL);
    check_int_range("\"minimum\":1,\"maximum\":100", 1, 100);
    check_int_range("\"minimum\":-37,\"maximum\":1234", -37, 1234);
    check_int_range("\"minimum\":-1000,\"maximum\":-10", -1000, -10);
    check_int_range("\"exclusiveMinimum\":0,\"exclusiveMaximum\":10", 1, 9);
    check_int_range("\"minimum\":2.5,\"maximum\":7.5", 3, 7);
    check_int_range("\"minimum\":105,\"maximum\":2999", 105, 2999);
    check_int_range("\"maximum\":5", -9999999999999999LL, 5);
    /* zod's .int(): the safe-integer bounds */
    check_int_range("\"minimum\":-9007199254740991,\"maximum\":9007199254740991", -9007199254740991LL,
                    9007199254740991LL);
    schema_cases("{\"type\":[\"integer\",\"null\"],\"minimum\":3,\"maximum\":4}", L("3", "4", "null"), L("2", "5"));
}

static void expect_schema_error(const char *schema, ks_status want, const char *fragment)
{
    char *gbnf = NULL;
    ks_status st = grammar_from_json_schema(schema, strlen(schema), &gbnf);
    if (st != want || !strstr(ks_errmsg(), fragment))
        fprintf(stderr, "schema %s: want %d containing '%s', got %d: %s\n", schema, want, fragment, st, ks_errmsg());
    assert_int_equal(st, want);
    assert_non_null(strstr(ks_errmsg(), fragment));
    assert_null(gbnf);
}

static void test_schema_errors(void **state)
{
    (void)state;
    expect_schema_error("{\"type\":", KS_ERR_FORMAT, "not valid JSON");
    expect_schema_error("{\"type\":\"object\",\"properties\":{\"zip\":{\"type\":\"string\",\"pattern\":\"^[0-9]+$\"}}}",
                        KS_ERR_UNSUPPORTED, "'pattern' is not supported (supported: ");
    expect_schema_error("{\"type\":\"object\",\"properties\":{\"zip\":{\"type\":\"string\",\"pattern\":\"x\"}}}",
                        KS_ERR_UNSUPPORTED, "at /properties/zip");
    expect_schema_error("{\"type\":\"number\",\"minimum\":3}", KS_ERR_UNSUPPORTED, "'minimum'");
    expect_schema_error("{\"minimum\":3}", KS_ERR_UNSUPPORTED, "need \"type\": \"integer\"");
    expect_schema_error("{\"type\":\"integer\",\"minimum\":3,\"maximum\":2}", KS_ERR_INVALID_ARG, "no integer");
    expect_schema_error("{\"type\":\"integer\",\"exclusiveMinimum\":2,\"exclusiveMaximum\":3}", KS_ERR_INVALID_ARG,
                        "no integer");
    expect_schema_error("{\"type\":\"integer\",\"minimum\":\"3\"}", KS_ERR_INVALID_ARG, "'minimum' must be a number");
    expect_schema_error("{\"type\":\"object\",\"additionalProperties\":true}", KS_ERR_UNSUPPORTED,
                        "additionalProperties");
    expect_schema_error("{\"type\":\"thing\"}", KS_ERR_INVALID_ARG, "unknown type 'thing'");
    expect_schema_error("{\"$ref\":\"#/$defs/nope\"}", KS_ERR_INVALID_ARG, "names no schema");
    expect_schema_error("{\"$ref\":\"http://x\"}", KS_ERR_UNSUPPORTED, "$ref");
    expect_schema_error("{\"type\":\"object\",\"properties\":{\"a\":{}},\"required\":[\"b\"]}", KS_ERR_INVALID_ARG,
                        "'b' is not in 'properties'");
    expect_schema_error("{\"enum\":[]}", KS_ERR_INVALID_ARG, "non-empty");
    expect_schema_error("[1]", KS_ERR_INVALID_ARG, "must be an object");
}

/* ---- masking against a real vocabulary ------------------------------------------- */

struct vocab {
    struct gguf_file *f;
    struct tokenizer *tok;
    struct grammar_vocab *gv;
};

static bool vocab_open(const char *name, struct vocab *v)
{
    const char *dir = getenv("KVSERVE_SHARED");
    char path[1024];
    snprintf(path, sizeof path, "%s/models/vocab/%s", dir ? dir : "../shared", name);
    memset(v, 0, sizeof *v);
    if (access(path, R_OK) != 0 || gguf_open(path, &v->f) || tok_load(v->f, &v->tok)) {
        printf("skipped: no vocabulary at %s\n", path);
        return false;
    }
    assert_int_equal(grammar_vocab_from_tokenizer(v->tok, &v->gv), KS_OK);
    return true;
}

static void vocab_close(struct vocab *v)
{
    grammar_vocab_free(v->gv);
    tok_free(v->tok);
    gguf_close(v->f);
}

/* Release runs the full sweeps; Debug (ASan+UBSan, ~20x slower) a fifth of
 * them, enough for memory safety. */
#ifdef NDEBUG
#define SWEEP 5
#else
#define SWEEP 1
#endif

static uint64_t rng_next(uint64_t *s)
{
    *s += 0x9E3779B97F4A7C15ull;
    uint64_t z = *s;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Random walks under the mask: every step's mask is checked against feeding
 * each (sampled) token's bytes to a fresh state; the walk must end complete
 * by EOG or exactly at the budget, and the text must parse as JSON. */
static void walk_checks(struct vocab *v, struct grammar *g, int32_t budget, uint64_t seed, bool check_mask,
                        bool is_json)
{
    int32_t n = tok_n_vocab(v->tok);
    float *logits = malloc((size_t)n * sizeof *logits);
    int32_t *allowed = malloc((size_t)n * sizeof *allowed);
    char *text = malloc(1 << 20);
    size_t len = 0;
    struct grammar_state *st;
    assert_int_equal(grammar_state_create(g, v->gv, budget, &st), KS_OK);
    bool ended = false, unbounded = budget > 100000;
    for (int32_t step = 0; step < (unbounded ? 40 : budget) && !ended; step++) {
        for (int32_t i = 0; i < n; i++)
            logits[i] = 0.0f;
        ks_status s = grammar_mask(st, logits, n);
        if (s)
            fprintf(stderr, "mask failed at step %d: %s (text so far: %.*s)\n", step, ks_errmsg(), (int)len, text);
        assert_int_equal(s, KS_OK);
        int32_t k = 0;
        for (int32_t i = 0; i < n; i++)
            if (logits[i] == 0.0f)
                allowed[k++] = i;
        assert_true(k > 0);
        if (check_mask) {
            /* a sample of tokens: allowed by the mask iff their bytes can follow (budget aside) */
            int32_t stride = n / (200 * SWEEP) + 1; /* ~1000 tokens per step (200 in Debug) */
            for (int32_t t = (int32_t)(rng_next(&seed) % (uint64_t)stride); t < n; t += stride) {
                const char *b;
                size_t bl;
                assert_int_equal(tok_piece(v->tok, t, &b, &bl), KS_OK);
                struct grammar_state *ref;
                assert_int_equal(grammar_state_create(g, NULL, -1, &ref), KS_OK);
                assert_int_equal(grammar_accept_text(ref, text, len), KS_OK);
                bool special = tok_is_control(v->tok, t) || tok_is_eog(v->tok, t) || bl == 0 ||
                               t == tok_special(v->tok)->bos || t == tok_special(v->tok)->unk ||
                               t == tok_special(v->tok)->pad;
                bool can = tok_is_eog(v->tok, t) ? grammar_complete(ref)
                                                 : !special && grammar_accept_text(ref, b, bl) == KS_OK;
                bool masked_in = logits[t] == 0.0f;
                if (masked_in && !can)
                    fprintf(stderr, "token %d '%.*s' allowed but cannot follow '%.*s'\n", t, (int)bl, b, (int)len,
                            text);
                assert_false(masked_in && !can);
                if (budget > 100000 && can && !masked_in)
                    fprintf(stderr, "token %d '%.*s' masked but can follow\n", t, (int)bl, b);
                if (budget > 100000)
                    assert_true(masked_in == can);
                grammar_state_free(ref);
            }
        }
        int32_t t = allowed[rng_next(&seed) % (uint64_t)k];
        /* prefer ending sometimes so walks are of mixed lengths */
        if (tok_is_eog(v->tok, t)) {
            assert_true(grammar_complete(st));
            ended = true;
            break;
        }
        assert_int_equal(grammar_accept(st, t), KS_OK);
        const char *b;
        size_t bl;
        tok_piece(v->tok, t, &b, &bl);
        assert_true(len + bl < (1 << 20));
        memcpy(text + len, b, bl);
        len += bl;
    }
    if (unbounded) { /* stopped after 40 tokens: only a prefix */
        grammar_state_free(st);
        free(logits);
        free(allowed);
        free(text);
        return;
    }
    assert_true(grammar_complete(st));
    assert_true(grammar_match(g, text, len));
    if (is_json) {
        cJSON *j = cJSON_ParseWithLength(text, len);
        if (!j)
            fprintf(stderr, "not JSON: %.*s\n", (int)len, text);
        assert_non_null(j);
        cJSON_Delete(j);
    }
    grammar_state_free(st);
    free(logits);
    free(allowed);
    free(text);
}

static void test_mask_vocab(const char *name)
{
    struct vocab v;
    if (!vocab_open(name, &v))
        return;
    const char *gbnf = grammar_json_object_gbnf();
    struct grammar *g = compile(gbnf);
    /* unbounded walks with the full mask check, then budgets from tight to loose */
    walk_checks(&v, g, 1 << 30, 1, true, true);
    /* (the full mask check, a reference match of every token, on a third of them: the suite's time) */
    for (int32_t budget = 2; budget <= 64; budget += 5)
        for (uint64_t seed = 0; seed < 2; seed++)
            walk_checks(&v, g, budget, seed * 7919 + (uint64_t)budget, budget % 20 == 2, true);
    grammar_free(g);

    g = schema_grammar("{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"},\"temp\":{\"type\":"
                       "\"number\"},\"ok\":{\"type\":\"boolean\"},\"tags\":{\"type\":\"array\",\"items\":{\"enum\":["
                       "\"a\",\"b\"]}}},\"required\":[\"city\",\"temp\",\"ok\",\"tags\"],\"additionalProperties\":false}");
    int32_t min = grammar_min_bytes(g);
    for (int32_t budget = min; budget <= min + 40; budget += 5)
        for (uint64_t seed = 0; seed < 2; seed++)
            walk_checks(&v, g, budget, seed + 100, seed == 0 && budget % 10 == min % 10, true);
    struct grammar_state *st;
    assert_int_equal(grammar_state_create(g, v.gv, min - 1, &st), KS_ERR_RANGE);
    assert_non_null(strstr(ks_errmsg(), "max_tokens"));
    grammar_free(g);

    /* a token cut inside a UTF-8 character: the grammar takes only 'é' then '!' */
    g = compile("root ::= \"\xc3\xa9\"+ \"!\"");
    walk_checks(&v, g, 1 << 30, 5, true, false);
    walk_checks(&v, g, 6, 6, true, false);
    grammar_free(g);
    vocab_close(&v);
}

static void test_mask_qwen3(void **state)
{
    (void)state;
    test_mask_vocab("ggml-vocab-qwen3.gguf");
}

static void test_mask_llama_spm(void **state)
{
    (void)state;
    test_mask_vocab("ggml-vocab-llama-spm.gguf");
}

/* Walk one state over the shared-cache vocabulary and one over a copy
 * without the cache, on the same draws and budget (-1: none): their masks
 * must be equal. Returns the shared state's walks and shared hits. */
static void walk_twins(struct vocab *shared, struct vocab *plain, const char *gbnf, int32_t budget, int32_t steps,
                       uint64_t seed, uint64_t *walks, uint64_t *hits)
{
    struct grammar *g1 = compile(gbnf), *g2 = compile(gbnf); /* two compilations, as two requests make */
    int32_t n = tok_n_vocab(shared->tok);
    float *l1 = calloc((size_t)n, sizeof *l1), *l2 = calloc((size_t)n, sizeof *l2);
    struct grammar_state *a, *b;
    assert_int_equal(grammar_state_create(g1, shared->gv, budget, &a), KS_OK);
    assert_int_equal(grammar_state_create(g2, plain->gv, budget, &b), KS_OK);
    for (int32_t step = 0; step < steps && (budget < 0 || step < budget); step++) {
        memset(l1, 0, (size_t)n * sizeof *l1);
        memset(l2, 0, (size_t)n * sizeof *l2);
        assert_int_equal(grammar_mask(a, l1, n), KS_OK);
        assert_int_equal(grammar_mask(b, l2, n), KS_OK);
        assert_memory_equal(l1, l2, (size_t)n * sizeof *l1);
        int32_t t = (int32_t)(rng_next(&seed) % (uint64_t)n), tries = 0;
        while ((l1[t] != 0.0f || tok_is_eog(shared->tok, t)) && ++tries < n)
            t = t + 1 < n ? t + 1 : 0;
        if (tries == n) /* only EOG is left: the text is complete */
            break;
        assert_int_equal(grammar_accept(a, t), KS_OK);
        assert_int_equal(grammar_accept(b, t), KS_OK);
    }
    *walks = grammar_state_walks(a);
    *hits = grammar_state_shared_hits(a);
    grammar_state_free(a);
    grammar_state_free(b);
    grammar_free(g1);
    grammar_free(g2);
    free(l1);
    free(l2);
}

/* The vocabulary's shared mask cache: a second request's copy of a grammar
 * takes the first's masks instead of walking, the masks are those a walk
 * gives, and another grammar never gets the first's masks. */
static void test_shared_mask_cache(void **state)
{
    (void)state;
    const char *dir = getenv("KVSERVE_SHARED");
    char path[1024];
    snprintf(path, sizeof path, "%s/models/vocab/ggml-vocab-qwen3.gguf", dir ? dir : "../shared");
    if (access(path, R_OK) != 0)
        KS_SKIP("no vocabulary at %s", path);
    struct vocab shared, plain;
    assert_true(vocab_open("ggml-vocab-qwen3.gguf", &shared));
    assert_true(vocab_open("ggml-vocab-qwen3.gguf", &plain));
    grammar_vocab_set_mask_cache(plain.gv, 0);
    uint64_t walks, hits, walks2, hits2;
    walk_twins(&shared, &plain, grammar_json_object_gbnf(), -1, 12 * SWEEP, 3, &walks, &hits);
    assert_true(walks > 0);
    assert_int_equal(hits, 0);
    /* the same draws: every set was walked by the first (only a character cut
     * inside a token, never cached, walks again) */
    walk_twins(&shared, &plain, grammar_json_object_gbnf(), -1, 12 * SWEEP, 3, &walks2, &hits2);
    assert_true(hits2 > 0);
    assert_true(walks2 < walks);
    assert_int_equal(walks2 + hits2, walks);
    walk_twins(&shared, &plain, "root ::= \"{\" [a-z ]* \"}\"", -1, 12 * SWEEP, 3, &walks, &hits);
    assert_int_equal(hits, 0);
    struct grammar_mask_cache_stats cs;
    grammar_vocab_mask_cache_stats(shared.gv, &cs);
    assert_true(cs.masks > 0 && cs.bytes <= cs.limit && cs.hits > 0);
    grammar_vocab_mask_cache_stats(plain.gv, &cs);
    assert_int_equal(cs.masks, 0);
    vocab_close(&shared);
    vocab_close(&plain);
}

/* The plain-string shortcut (a set that loops on every plain character
 * marks the plain tokens at once) gives the masks of the full walk, token by
 * token: inside strings, keys, numbers and escapes, with and without budgets,
 * and for classes that take only some plain characters (no shortcut). */
static bool plain_skip_vocab(const char *name)
{
    struct vocab fast, slow;
    if (!vocab_open(name, &fast))
        return false;
    assert_true(vocab_open(name, &slow));
    grammar_vocab_set_mask_cache(fast.gv, 0); /* every mask walked, none copied */
    grammar_vocab_set_mask_cache(slow.gv, 0);
    grammar_vocab_set_plain_skip(slow.gv, false);
    const char *schema = "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"n\":{\"type\":"
                         "\"number\"},\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"}}},"
                         "\"required\":[\"name\",\"n\",\"tags\"]}";
    char *schema_gbnf = NULL;
    assert_int_equal(grammar_from_json_schema(schema, strlen(schema), &schema_gbnf), KS_OK);
    struct grammar *g = compile(schema_gbnf);
    int32_t min = grammar_min_bytes(g);
    grammar_free(g);
    const char *gbnfs[] = {grammar_json_object_gbnf(), schema_gbnf,
                           "root ::= \"\\\"\" [^\"]* \"\\\"\"",     /* backslash too: a loop with other escapes */
                           "root ::= \"\\\"\" [^\"\\\\\\x7F\\x00-\\x1F]{0,6} \"\\\"\"", /* bounded: no loop */
                           "root ::= \"<\" [a-z ]* \">\""};                /* some plain characters only */
    const int32_t budgets[] = {-1, min + 2, min + 9, 40};
    uint64_t walks, hits;
    for (size_t k = 0; k < sizeof gbnfs / sizeof *gbnfs; k++)
        for (size_t b = 0; b < sizeof budgets / sizeof *budgets; b++)
            for (uint64_t seed = 0; seed < (SWEEP > 1 ? 2u : 1u); seed++) {
                walk_twins(&fast, &slow, gbnfs[k], budgets[b], 24, seed * 31 + k * 7 + b, &walks, &hits);
                assert_true(walks > 0);
            }
    free(schema_gbnf);
    vocab_close(&fast);
    vocab_close(&slow);
    return true;
}

static void test_plain_skip_qwen3(void **state)
{
    (void)state;
    if (!plain_skip_vocab("ggml-vocab-qwen3.gguf"))
        KS_SKIP("no ggml-vocab-qwen3.gguf under ../shared/models/vocab");
}

static void test_plain_skip_llama_spm(void **state)
{
    (void)state;
    if (!plain_skip_vocab("ggml-vocab-llama-spm.gguf"))
        KS_SKIP("no ggml-vocab-llama-spm.gguf under ../shared/models/vocab");
}

/* Special tokens are never drawn; EOG only once the text is complete. */
static void test_special_tokens(void **state)
{
    (void)state;
    struct vocab v;
    if (!vocab_open("ggml-vocab-qwen3.gguf", &v))
        return;
    struct grammar *g = compile("root ::= \"a\" \"b\"?");
    struct grammar_state *st;
    assert_int_equal(grammar_state_create(g, v.gv, -1, &st), KS_OK);
    int32_t n = tok_n_vocab(v.tok) + 100; /* a model may pad its vocabulary */
    float *logits = calloc((size_t)n, sizeof *logits);
    assert_int_equal(grammar_mask(st, logits, n), KS_OK);
    int32_t eos = tok_special(v.tok)->eos;
    assert_true(eos >= 0);
    assert_true(isinf(logits[eos]));
    assert_true(isinf(logits[n - 1]));
    assert_int_equal(grammar_accept(st, eos), KS_ERR_INVALID_ARG);
    int32_t a = tok_find(v.tok, "a", 1);
    assert_true(a >= 0 && logits[a] == 0.0f);
    assert_int_equal(grammar_accept(st, a), KS_OK);
    memset(logits, 0, (size_t)n * sizeof *logits);
    assert_int_equal(grammar_mask(st, logits, n), KS_OK);
    assert_true(logits[eos] == 0.0f);
    for (int32_t i = 0; i < tok_n_vocab(v.tok); i++)
        if (tok_is_control(v.tok, i) && !tok_is_eog(v.tok, i))
            assert_true(isinf(logits[i]));
    assert_int_equal(grammar_accept(st, eos), KS_OK);
    assert_int_equal(grammar_accept(st, a), KS_ERR_INVALID_ARG);
    free(logits);
    grammar_state_free(st);
    grammar_free(g);
    vocab_close(&v);
}

/* A vocabulary of the 256 bytes, then MARK (a control token, "[TOOL_CALLS]")
 * and END (end of generation). */
enum { MARK = 256, END = 257 };

static ks_status byte_piece(void *user, int32_t id, const char **bytes, size_t *len, enum grammar_token_kind *kind)
{
    static char all[256];
    (void)user;
    for (int i = 0; i < 256; i++)
        all[i] = (char)i;
    *kind = id == MARK ? GRAMMAR_TOKEN_SPECIAL : id == END ? GRAMMAR_TOKEN_EOG : GRAMMAR_TOKEN_TEXT;
    *bytes = id < 256 ? all + id : "[TOOL_CALLS]";
    *len = id < 256 ? 1 : id == MARK ? 12 : 0;
    return KS_OK;
}

/* How many ids the state's mask allows; *first the lowest. */
static int32_t n_allowed(struct grammar_state *st, float *logits, int32_t n, int32_t *first)
{
    for (int32_t i = 0; i < n; i++)
        logits[i] = 0.0f;
    assert_int_equal(grammar_mask(st, logits, n), KS_OK);
    int32_t k = 0;
    for (int32_t i = 0; i < n; i++)
        if (logits[i] == 0.0f && k++ == 0)
            *first = i;
    return k;
}

/* <[N]>: only drawing token N passes it (its text does not), it counts one
 * token of the budget, and the parse errors name the position. */
static void test_token_terminals(void **state)
{
    (void)state;
    expect_error("root ::= <[abc]>", KS_ERR_FORMAT, "expected a token id");
    expect_error("root ::= <[12", KS_ERR_FORMAT, "expected ']>'");
    expect_error("root ::= <[99999999]>", KS_ERR_FORMAT, "token id over");
    struct grammar_vocab *v;
    assert_int_equal(grammar_vocab_create(258, byte_piece, NULL, &v), KS_OK);
    struct grammar *g = compile("root ::= <[256]> \"[\" [a-z]+ \"]\" (\"; \" <[256]>)?");
    assert_int_equal(grammar_min_bytes(g), 4);
    assert_false(match(g, "[TOOL_CALLS][ab]")); /* text never stands for the token */
    float logits[258];
    int32_t first = -1;
    struct grammar_state *st;
    assert_int_equal(grammar_state_create(g, v, 6, &st), KS_OK);
    assert_int_equal(n_allowed(st, logits, 258, &first), 1);
    assert_int_equal(first, MARK);
    assert_int_equal(grammar_accept(st, '['), KS_ERR_INVALID_ARG);
    assert_int_equal(grammar_accept(st, MARK), KS_OK);
    assert_int_equal(grammar_accept(st, MARK), KS_ERR_INVALID_ARG);
    assert_int_equal(grammar_accept(st, '['), KS_OK);
    assert_int_equal(grammar_accept(st, 'x'), KS_OK);
    assert_int_equal(grammar_accept(st, ']'), KS_OK);
    assert_true(grammar_complete(st));
    /* 2 tokens left: "; " then the token would need 3, so only the end remains */
    assert_int_equal(n_allowed(st, logits, 258, &first), 1);
    assert_int_equal(first, END);
    grammar_state_free(st);

    assert_int_equal(grammar_state_create(g, v, -1, &st), KS_OK);
    const int32_t walk[] = {MARK, '[', 'q', ']', ';', ' '};
    for (size_t i = 0; i < sizeof walk / sizeof walk[0]; i++)
        assert_int_equal(grammar_accept(st, walk[i]), KS_OK);
    assert_int_equal(n_allowed(st, logits, 258, &first), 1);
    assert_int_equal(first, MARK);
    assert_int_equal(grammar_accept(st, MARK), KS_OK);
    assert_true(grammar_complete(st));
    grammar_state_free(st);
    grammar_free(g);

    /* an EOG token is never drawn through <[N]>, and a token outside the vocabulary is never allowed */
    g = compile("root ::= \"a\" | <[257]> | <[4000]>");
    assert_int_equal(grammar_state_create(g, v, -1, &st), KS_OK);
    assert_int_equal(n_allowed(st, logits, 258, &first), 1);
    assert_int_equal(first, 'a');
    grammar_state_free(st);
    grammar_free(g);
    grammar_vocab_free(v);
}

static void accept_bytes(struct grammar_state *st, const char *text)
{
    for (; *text; text++)
        assert_int_equal(grammar_accept(st, (unsigned char)*text), KS_OK);
}

static struct grammar_state *lazy_state(struct grammar *g, struct grammar_vocab *v, int32_t max_tokens,
                                        const char *word, int32_t token, bool at_start)
{
    struct grammar_triggers tr = {.n = 1};
    snprintf(tr.t[0].word, sizeof tr.t[0].word, "%s", word);
    tr.t[0].token = token;
    tr.t[0].at_start = at_start;
    struct grammar_state *st = NULL;
    assert_int_equal(grammar_state_create_lazy(g, v, max_tokens, &tr, &st), KS_OK);
    return st;
}

/* Lazy states: free until the trigger word (anywhere, or only first) or
 * token, then constrained with the tokens left; a trigger that cannot finish
 * in them stays text. */
static void test_lazy_triggers(void **state)
{
    (void)state;
    struct grammar_vocab *v;
    assert_int_equal(grammar_vocab_create(258, byte_piece, NULL, &v), KS_OK);
    float logits[258];
    int32_t first;
    struct grammar *g = compile("root ::= \"<call>\" [a-z]+ \"</call>\"");
    struct grammar_state *st = lazy_state(g, v, 40, "<call>", -1, false);
    assert_int_equal(n_allowed(st, logits, 258, &first), 258);
    accept_bytes(st, "hi <ca");
    assert_false(grammar_triggered(st));
    accept_bytes(st, "ll>");
    assert_true(grammar_triggered(st));
    assert_int_equal(n_allowed(st, logits, 258, &first), 26);
    assert_int_equal(first, 'a');
    accept_bytes(st, "xy</call>");
    assert_true(grammar_complete(st));
    assert_int_equal(n_allowed(st, logits, 258, &first), 1);
    assert_int_equal(first, END);
    grammar_state_free(st);

    /* budget: 20 - 9 drawn leaves 11 tokens, so the call must close within them */
    st = lazy_state(g, v, 20, "<call>", -1, false);
    accept_bytes(st, "abc<call>");
    assert_true(grammar_triggered(st));
    accept_bytes(st, "ab");
    assert_int_equal(n_allowed(st, logits, 258, &first), 27); /* 9 left: [a-z] or the '<' of "</call>" */
    accept_bytes(st, "cd");
    assert_int_equal(n_allowed(st, logits, 258, &first), 1); /* 7 left: "</call>" now */
    assert_int_equal(first, '<');
    grammar_state_free(st);
    grammar_free(g);

    /* too late to finish: the trigger stays text */
    g = compile("root ::= \"<call>\" [a-z]{20}");
    st = lazy_state(g, v, 16, "<call>", -1, false);
    accept_bytes(st, "<call>");
    assert_false(grammar_triggered(st));
    assert_int_equal(n_allowed(st, logits, 258, &first), 258);
    grammar_state_free(st);
    grammar_free(g);

    /* at_start: only after whitespace alone */
    g = compile("root ::= \"{\\\"n\\\"\" [0-9]");
    for (int blank = 0; blank < 2; blank++) {
        st = lazy_state(g, v, -1, "{\"n\"", -1, true);
        accept_bytes(st, blank ? " \n{\"n\"" : "so {\"n\"");
        assert_int_equal(grammar_triggered(st), blank);
        assert_int_equal(n_allowed(st, logits, 258, &first), blank ? 10 : 258);
        grammar_state_free(st);
    }
    grammar_free(g);

    /* a trigger token, drawn as the grammar's first terminal */
    g = compile("root ::= <[256]> \"[\" [a-z]+ \"]\"");
    st = lazy_state(g, v, 30, "", MARK, false);
    accept_bytes(st, "text [TOOL_CALLS]"); /* its text is not the token */
    assert_false(grammar_triggered(st));
    assert_int_equal(grammar_accept(st, MARK), KS_OK);
    assert_true(grammar_triggered(st));
    assert_int_equal(n_allowed(st, logits, 258, &first), 1);
    assert_int_equal(first, '[');
    grammar_state_free(st);
    grammar_free(g);
    grammar_vocab_free(v);
}

/* A real control token (Llama 3's <|start_header_id|>) is drawn only as itself. */
static void test_token_terminal_llama3(void **state)
{
    (void)state;
    struct vocab v;
    if (!vocab_open("ggml-vocab-llama3.gguf", &v))
        return;
    int32_t tag = tok_find(v.tok, "<|start_header_id|>", 19);
    assert_true(tag >= 0 && tok_is_control(v.tok, tag));
    char gbnf[128];
    snprintf(gbnf, sizeof gbnf, "root ::= <[%d]> \"{}\"", tag);
    struct grammar *g = compile(gbnf);
    struct grammar_state *st;
    assert_int_equal(grammar_state_create(g, v.gv, 8, &st), KS_OK);
    int32_t n = tok_n_vocab(v.tok), first = -1;
    float *logits = malloc((size_t)n * sizeof *logits);
    assert_int_equal(n_allowed(st, logits, n, &first), 1);
    assert_int_equal(first, tag);
    assert_int_equal(grammar_accept(st, tag), KS_OK);
    assert_int_equal(grammar_accept(st, tok_find(v.tok, "{}", 2)), KS_OK);
    assert_true(grammar_complete(st));
    free(logits);
    grammar_state_free(st);
    grammar_free(g);
    vocab_close(&v);
}

/* Schemas composed under names beside each other share the primitives. */
static void test_schema_rules_compose(void **state)
{
    (void)state;
    const char *a = "{\"type\":\"object\",\"properties\":{\"n\":{\"type\":\"integer\"}},\"required\":[\"n\"]}";
    const char *b = "{\"type\":\"array\",\"items\":{\"$ref\":\"#\"},\"maxItems\":2}";
    char *ra = NULL, *rb = NULL;
    assert_int_equal(grammar_json_schema_rules(a, strlen(a), "tool_a", &ra), KS_OK);
    assert_int_equal(grammar_json_schema_rules(b, strlen(b), "tool_b", &rb), KS_OK);
    char *all = malloc(strlen(ra) + strlen(rb) + strlen(grammar_json_primitives_gbnf()) + 64);
    sprintf(all, "root ::= tool_a \" \" tool_b\n%s%s%s", ra, rb, grammar_json_primitives_gbnf());
    struct grammar *g = compile(all);
    assert_true(match(g, "{\"n\": 3} [[], [[]]]"));
    assert_false(match(g, "{\"n\": \"3\"} []"));
    assert_false(match(g, "{\"n\": 3} [[], [], []]"));
    grammar_free(g);
    assert_int_equal(grammar_json_schema_rules(a, strlen(a), "bad name", &ra), KS_ERR_INVALID_ARG);
    assert_int_equal(grammar_json_schema_rules("{\"pattern\":\"x\"}", 15, "t", &rb), KS_ERR_UNSUPPORTED);
    free(ra);
    free(rb);
    free(all);
}

/* Mutated grammars and schemas, each in a buffer of exactly its length (no NUL
 * after it), so ASan catches any read past the end: compile or fail cleanly. */
static void test_mutations(void **state)
{
    (void)state;
    uint64_t seed = 7;
    const char *base = grammar_json_object_gbnf();
    size_t n = strlen(base);
    static const char alphabet[] = "()[]{}|*+?.\\\"#:=^-,0123456789 \nax";
    int compiled = 0;
    for (int iter = 0; iter < 600 * SWEEP; iter++) {
        char *buf = malloc(n);
        memcpy(buf, base, n);
        int edits = 1 + (int)(rng_next(&seed) % 4);
        for (int e = 0; e < edits; e++)
            buf[rng_next(&seed) % n] = alphabet[rng_next(&seed) % (sizeof alphabet - 1)];
        size_t len = iter % 5 == 0 ? (size_t)(rng_next(&seed) % n) : n; /* also truncated */
        struct grammar *g = NULL;
        if (grammar_compile(buf, len, &g) == KS_OK) {
            compiled++;
            assert_true(ks_errmsg() != NULL);
            (void)grammar_match(g, "{\"a\": [1, \"x\"]}", 16);
            (void)grammar_match(g, "", 0);
            grammar_free(g);
        } else {
            assert_true(strlen(ks_errmsg()) > 0);
        }
        free(buf);
    }
    print_message("%d of %d mutated grammars compiled\n", compiled, 600 * SWEEP);
    const char *schema = "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"array\",\"items\":{\"enum\":[1,\"x\"]}},"
                         "\"b\":{\"anyOf\":[{\"$ref\":\"#\"},{\"type\":\"null\"}]}},\"required\":[\"a\"]}";
    n = strlen(schema);
    for (int iter = 0; iter < 400 * SWEEP; iter++) {
        char *buf = malloc(n);
        memcpy(buf, schema, n);
        buf[rng_next(&seed) % n] = alphabet[rng_next(&seed) % (sizeof alphabet - 1)];
        char *gbnf = NULL;
        if (grammar_from_json_schema(buf, n, &gbnf) == KS_OK) {
            struct grammar *g = NULL;
            if (grammar_compile(gbnf, strlen(gbnf), &g) == KS_OK)
                grammar_free(g);
            free(gbnf);
        }
        free(buf);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_errors),       cmocka_unit_test(test_match_basics),
        cmocka_unit_test(test_json_object_grammar), cmocka_unit_test(test_schema_keywords),
        cmocka_unit_test(test_schema_errors),      cmocka_unit_test(test_special_tokens),
        cmocka_unit_test(test_schema_integer_bounds), cmocka_unit_test(test_match_ended),
        cmocka_unit_test(test_mask_qwen3),         cmocka_unit_test(test_mask_llama_spm),
        cmocka_unit_test(test_mutations),          cmocka_unit_test(test_shared_mask_cache),
        cmocka_unit_test(test_token_terminals),    cmocka_unit_test(test_token_terminal_llama3),
        cmocka_unit_test(test_schema_rules_compose), cmocka_unit_test(test_lazy_triggers),
        cmocka_unit_test(test_plain_skip_qwen3),   cmocka_unit_test(test_plain_skip_llama_spm),
    };
    return ks_run_tests(tests, NULL, NULL);
}
