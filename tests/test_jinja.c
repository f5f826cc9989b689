/* The jinja module: the language statement by statement, errors with their
 * line and column, every limit, random input under the sanitizers, and the
 * corpus of real chat templates against llama.cpp's renderings
 * (../shared/templates, skipped with exit code 77 when absent). */
#include <dirent.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "jinja/jinja.h"
#include "support/read_file.h"
#include "support/skip.h"

/* 2026-11-24 00:00:00 UTC, the date the corpus was rendered with. */
#define CORPUS_NOW 1795478400
/* 2026-11-27 00:00:00 UTC, the date tests/data/templates was rendered with. */
#define LOCAL_CORPUS_NOW 1795737600

/* ---- helpers ------------------------------------------------------------- */


static const char *shared_dir(void)
{
    const char *d = getenv("KVSERVE_SHARED");
    return d && *d ? d : "../shared";
}

/* Render src with the JSON context ctx (NULL = none); returns the text or
 * NULL with *st set. */
static char *render_opts(const char *src, const char *ctx, const struct jinja_opts *opts, ks_status *st)
{
    struct jinja_template *t = NULL;
    *st = jinja_parse(src, strlen(src), &t);
    if (*st)
        return NULL;
    cJSON *j = ctx ? cJSON_Parse(ctx) : NULL;
    if (ctx)
        assert_non_null(j);
    char *out = NULL;
    *st = jinja_render(t, j, opts, &out, NULL);
    cJSON_Delete(j);
    jinja_free(t);
    return out;
}

static void check_render(const char *src, const char *ctx, const char *want)
{
    ks_status st;
    char *out = render_opts(src, ctx, NULL, &st);
    if (st)
        fail_msg("template %s: %s", src, ks_errmsg());
    if (strcmp(out, want))
        fail_msg("template %s\n  gave [%s]\n  want [%s]", src, out, want);
    free(out);
}
#define R(src, want) check_render(src, NULL, want)
#define RC(src, ctx, want) check_render(src, ctx, want)

static void check_error(const char *src, const char *ctx, ks_status want_st, const char *want_msg)
{
    ks_status st;
    char *out = render_opts(src, ctx, NULL, &st);
    if (!st)
        fail_msg("template %s rendered '%s', want an error", src, out);
    if (st != want_st || !strstr(ks_errmsg(), want_msg))
        fail_msg("template %s: status %d '%s', want %d containing '%s'", src, st, ks_errmsg(), want_st, want_msg);
}

/* ---- the language ------------------------------------------------------- */

static void test_statements(void **state)
{
    (void)state;
    R("{% if 1 %}a{% elif 2 %}b{% else %}c{% endif %}", "a");
    R("{% if 0 %}a{% elif 2 %}b{% else %}c{% endif %}", "b");
    R("{% if 0 %}a{% elif none %}b{% else %}c{% endif %}", "c");
    R("{% for x in [1, 2, 3] %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}"
      "{{ loop.first }}{{ loop.last }}{{ loop.length }};{% endfor %}",
      "1032TrueFalse3;2121FalseFalse3;3210FalseTrue3;");
    R("{% for x in 'ab' %}{{ loop.previtem is defined }}{{ x }}{{ loop.nextitem | default('-') }}{% endfor %}",
      "Falseab" "Trueb-");
    R("{% for x in [] %}x{% else %}empty{% endfor %}", "empty");
    R("{% for x in [1, 2] %}{{ loop['index'] }}{{ loop.nosuch is defined }}{% for y in 'ab' %}{{ loop.index }}"
      "{% endfor %};{% endfor %}",
      "1False12;2False12;");
    R("{% for x in [1, 2, 3, 4] if x is even %}{{ x }}{{ loop.length }}{% endfor %}", "2242");
    R("{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }},{% endfor %}", "a=1,b=2,");
    R("{% for k in {'a': 1, 'b': 2} %}{{ k }}{% endfor %}", "ab");
    R("{% for x in range(10) %}{% if x == 3 %}{% break %}{% endif %}{{ x }}{% endfor %}", "012");
    R("{% for x in range(5) %}{% if x is odd %}{% continue %}{% endif %}{{ x }}{% endfor %}", "024");
    R("{% set x = 1 %}{% for i in [1] %}{% set x = 2 %}{% endfor %}{{ x }}", "1");
    R("{% set ns = namespace(x=1) %}{% for i in [1, 2] %}{% set ns.x = ns.x + i %}{% endfor %}{{ ns.x }}", "4");
    R("{% set a, b = [1, 2] %}{{ b }}{{ a }}", "21");
    R("{% set a = 1, 2 %}{{ a | length }}", "2");
    R("{% set t %}in {{ 1 + 1 }}{% endset %}[{{ t }}]", "[in 2]");
    R("{% macro m(a, b='B', c=none) %}{{ a }}{{ b }}{{ c }}{% endmacro %}{{ m(1) }}|{{ m(1, c=3) }}|{{ m(1, 2, 3) }}",
      "1BNone|1B3|123");
    R("{% macro outer() %}{% macro inner(x) %}<{{ x }}>{% endmacro %}{{ inner(1) }}{% endmacro %}{{ outer() }}", "<1>");
    R("{% filter upper %}ab{{ 'c' }}{% endfilter %}", "ABC");
    R("{% filter trim | upper %}  ab  {% endfilter %}", "AB");
    R("a{% generation %}b{% endgeneration %}c", "abc");
    R("a{# comment #}b", "ab");
}

static void test_whitespace(void **state)
{
    (void)state;
    R("a  {{- 'b' -}}  c", "abc");
    R("a  {%- if 1 -%}  b  {%- endif -%}  c", "abc");
    R("a  {#- c -#}  b", "ab");
    /* trim_blocks: the newline after a block tag goes; lstrip_blocks: the
     * indentation before it */
    R("{% if 1 %}\nx\n{% endif %}\ny", "x\ny");
    R("  {% if 1 %}\n  x\n  {% endif %}\n", "  x\n");
    R("a {% if 1 %}b{% endif %}", "a b");
    R("  {%+ if 1 %}x{% endif %}", "  x");
    R("  {{ 'x' }}\n.", "  x\n.");
    R("{# c #}\nx", "x");
    /* one trailing newline is dropped, and \r\n or \r read as \n, as Jinja2 and llama.cpp do */
    R("a\n", "a");
    R("a\n\n", "a\n");
    R("a\r\nb\rc{{ 'x\r\ny' }}", "a\nb\ncx\ny");
}

static void test_expressions(void **state)
{
    (void)state;
    R("{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 2 ** 3 ** 2 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }}",
      "7 9 64 3 -4 1 2");
    R("{{ 7 / 2 }} {{ 1.5 + 1 }} {{ 1e3 }} {{ 0.1 + 0.2 }} {{ 10 / 5 }}", "3.5 2.5 1000.0 0.30000000000000004 2.0");
    R("{{ 'a' ~ 1 ~ none }} {{ 'a' + 'b' }} {{ 'ab' * 2 }} {{ [1] + [2] }}", "a1None ab abab [1, 2]");
    R("{{ 1 < 2 }} {{ 'a' < 'b' }} {{ 1 == 1.0 }} {{ [1, 2] == [1, 2] }} {{ 1 != 2 }} {{ 2 >= 2 }} {{ 3 <= 2 }}",
      "True True True True True True False");
    R("{{ 1 < 2 < 3 }} {{ 1 < 3 < 2 }} {{ 'a' == 'a' in 'abc' }} {{ 3 > 2 == 2 }}", "True False True True");
    R("{{ 'b' in 'abc' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 3 not in [1] }} {{ 'z' in 'abc' }}",
      "True True True True False");
    R("{{ 0 or 'x' }} {{ 1 and 'y' }} {{ not 0 }} {{ none or [] }} {{ '' and 1 }}", "x y True [] ");
    R("{{ 'y' if 1 else 'n' }} {{ 'y' if 0 else 'n' }} [{{ 'y' if 0 }}]", "y n []");
    R("{{ [1, 2, 3][-1] }} {{ [1, 2, 3][1:] }} {{ [1, 2, 3][::-1] }} {{ 'héllo'[1:3] }} {{ 'abc'[-1] }}",
      "3 [2, 3] [3, 2, 1] él c");
    R("{{ {'a': {'b': 2}}['a'].b }} {{ {'a': 1}.missing is defined }} {{ [1][5] is defined }}", "2 False False");
    R("{{ \"it's\" }} {{ 'a\\nb' | length }} {{ '\\u00e9' }} {{ 'x' 'y' }}", "it's 3 é xy");
    R("{{ true }} {{ True }} {{ none }} {{ None }} {{ false is false }}", "True True None None True");
    R("{{ [1, 'a', none, true, {'k': 'v'}] }} {{ {'q': \"it's\"} | string }}",
      "[1, 'a', None, True, {'k': 'v'}] {'q': \"it's\"}");
    RC("{{ undefined_thing }}|{{ x.y.z }}|{{ 'a' + missing }}", "{\"x\": {}}", "||a");
}

static void test_methods(void **state)
{
    (void)state;
    R("[{{ '  a b  '.strip() }}][{{ 'xxaxx'.strip('x') }}][{{ '  a'.lstrip() }}][{{ 'a  '.rstrip() }}]",
      "[a b][a][a][a]");
    R("{{ 'a,b,,c'.split(',') }} {{ ' a  b '.split() }} {{ 'a-b-c'.split('-', 1) }}",
      "['a', 'b', '', 'c'] ['a', 'b'] ['a', 'b-c']");
    R("{{ 'abc'.startswith('ab') }} {{ 'abc'.endswith(('x', 'c')) }} {{ 'abc'.startswith('b') }}", "True True False");
    R("{{ 'aXbX'.replace('X', '-') }} {{ 'ab'.upper() }} {{ 'AB'.lower() }} {{ 'hello world'.title() }}",
      "a-b- AB ab Hello World");
    R("{{ '{}-{}'.format(1, 'a') }} {{ '{0}{0}'.format('x') }} {{ '{n}!'.format(n=3) }} {{ ', '.join(['a', 'b']) }}",
      "1-a xx 3! a, b");
    R("{{ 'abcb'.find('b') }} {{ 'abcb'.count('b') }}", "1 2");
    R("{% set d = {'a': 1} %}{{ d.get('a') }} {{ d.get('b') }} {{ d.get('b', 2) }} {{ d.keys() }} {{ d.values() }}",
      "1 None 2 ['a'] [1]");
    R("{% set l = [1, 2] %}{% set _ = l.append(3) %}{{ l }} {{ l.pop() }} {{ l.pop(0) }} {{ l }}", "[1, 2, 3] 3 1 [2]");
    R("{% set d = {'a': 1, 'b': 2} %}{{ d.pop('a') }} {{ d }}", "1 {'b': 2}");
}

static void test_filters(void **state)
{
    (void)state;
    R("{{ [1, 2] | length }} {{ 'héllo' | length }} {{ {'a': 1} | count }} {{ missing | length }}", "2 5 1 0");
    R("[{{ '  x  ' | trim }}] {{ 'Ab' | upper }} {{ 'Ab' | lower }} {{ 'ab cd' | title }} {{ 'ab' | capitalize }}",
      "[x] AB ab Ab Cd Ab");
    R("{{ missing | default('d') }} {{ '' | default('d') }} {{ '' | default('d', true) }} {{ 0 | d(5) }}", "d  d 0");
    R("{{ [1, 2] | join(', ') }} {{ [{'n': 'a'}, {'n': 'b'}] | join('+', attribute='n') }}", "1, 2 a+b");
    R("{{ {'b': 1, 'a': 2} | items | list }} {{ {'b': 1, 'A': 2, 'a': 3} | dictsort }}",
      "[('b', 1), ('a', 2)] [('A', 2), ('a', 3), ('b', 1)]");
    R("{{ (1, 2) }} {{ (1,) }} {{ (1, 2) | tojson }} {{ 1 | round }} {{ 2.5 | round }} {{ 2.5 is divisibleby 2 }}"
      " {{ nothing is iterable }}",
      "(1, 2) (1,) [1, 2] 1 2.0 False True");
    R("{{ [{'r': 'u', 'x': 1}, {'r': 's'}] | selectattr('r', 'equalto', 'u') | list | length }}"
      " {{ [{'r': 'u'}, {'r': 's'}] | rejectattr('r', 'eq', 'u') | map(attribute='r') | list }}",
      "1 ['s']");
    R("{{ [{'a': 1}, {'b': 2}] | selectattr('a') | list }} {{ [1, 2, 3, 4] | select('odd') | list }}"
      " {{ [1, 2, 3] | reject('even') | list }}",
      "[{'a': 1}] [1, 3] [1, 3]");
    R("{{ ['a', 'b'] | map('upper') | join }} {{ [{'f': {'n': 'x'}}] | map(attribute='f.n') | first }}", "AB x");
    R("{{ 'a-b' | replace('-', '+') }} {{ [3, 1, 2] | sort }} {{ [3, 1, 2] | sort(reverse=true) }}"
      " {{ [1, 2, 1, 3] | unique | list }} {{ [1, 2] | first }} {{ [1, 2] | last }} {{ [3, 1] | min }}"
      " {{ [3, 1] | max }} {{ [1, 2] | reverse | list }} {{ [1, 2.5] | sum }}",
      "a+b [1, 2, 3] [3, 2, 1] [1, 2, 3] 1 2 1 3 [2, 1] 3.5");
    R("{{ [{'n': 'b'}, {'n': 'a'}] | sort(attribute='n') | map(attribute='n') | join }}", "ab");
    R("{{ 'Hello World' | max }} {{ ['b', 'A', 'c'] | min }} {{ ['b', 'A'] | min(case_sensitive=true) }}"
      " {{ [{'n': 2}, {'n': 1}] | max(attribute='n') }}",
      "W A A {'n': 2}");
    R("{{ 'a\\nb\\n\\nc' | indent(2) }}|{{ 'a\\nb' | indent(2, true) }}", "a\n  b\n\n  c|  a\n  b");
    R("{{ '12' | int + 1 }} {{ 'x' | int }} {{ 2.7 | int }} {{ '1.5' | float }} {{ -3 | abs }} {{ 2.567 | round(1) }}",
      "13 0 2 1.5 3 2.6");
    R("{{ 1 | string ~ 2 }} {{ 'a b c' | wordcount }} {{ '<b>' | safe }} {{ '{\"k\": [1]}' | from_json }}",
      "12 3 <b> {'k': [1]}");
    /* tojson is Python's json.dumps(ensure_ascii=False) as llama.cpp writes it */
    R("{{ {'a': [1, 2.5, true, none], 'b': 'é \"q\" \\\\ \\n'} | tojson }}",
      "{\"a\": [1, 2.5, true, null], \"b\": \"é \\\"q\\\" \\\\ \\n\"}");
    R("{{ {'b': 1, 'a': {}} | tojson(indent=2) }}", "{\n  \"b\": 1,\n  \"a\": {}\n}");
    R("{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }} {{ [] | tojson }} {{ '\\u0001' | tojson }}",
      "{\"a\": 2, \"b\": 1} [] \"\\u0001\"");
}

static void test_tests(void **state)
{
    (void)state;
    RC("{{ x is defined }}{{ y is defined }}{{ y is undefined }}{{ n is none }}{{ x is not none }}",
       "{\"x\": 1, \"n\": null}", "TrueFalseTrueTrueTrue");
    R("{{ 'a' is string }}{{ {} is mapping }}{{ [] is iterable }}{{ 'a' is iterable }}{{ [] is sequence }}"
      "{{ 1 is number }}{{ 1 is integer }}{{ 1.0 is float }}{{ true is boolean }}{{ 1 is string }}",
      "TrueTrueTrueTrueTrueTrueTrueTrueTrueFalse");
    R("{{ 2 is in [1, 2] }}{{ 'k' is in {'k': 1} }}{{ 3 is not in [1] }}", "TrueTrueTrue");
    R("{{ true is true }}{{ 1 is true }}{{ false is false }}{{ 3 is odd }}{{ 4 is even }}{{ 9 is divisibleby 3 }}"
      "{{ 1 is eq 1 }}{{ 2 is gt 1 }}{{ 'a' is in 'abc' }}{{ none is sameas none }}{{ 'ab' is lower }}"
      "{{ range is callable }}",
      "TrueFalseTrueTrueTrueTrueTrueTrueTrueTrueTrueTrue");
}

static void test_globals(void **state)
{
    (void)state;
    R("{{ range(3) }} {{ range(1, 7, 2) }} {{ range(3, 0, -1) }}", "[0, 1, 2] [1, 3, 5] [3, 2, 1]");
    struct jinja_opts o = {.now = 1795478400};
    ks_status st;
    char *out = render_opts("{{ strftime_now('%Y-%m-%d %d %b %Y') }}", NULL, &o, &st);
    assert_int_equal(st, KS_OK);
    assert_string_equal(out, "2026-11-24 24 Nov 2026");
    free(out);
    check_error("{{ raise_exception('no') }}", NULL, KS_ERR_STATE, "line 1, column 19: template raised: no");
    check_error("\n\n  {% if x %}{{ raise_exception('bad role ' ~ x) }}{% endif %}", "{\"x\": \"tool\"}",
                KS_ERR_STATE, "line 3, column 31: template raised: bad role tool");
}

static void check_parse_error(const char *src, ks_status want_st, const char *want_msg)
{
    struct jinja_template *t = NULL;
    ks_status st = jinja_parse(src, strlen(src), &t);
    if (st != want_st || !strstr(ks_errmsg(), want_msg))
        fail_msg("parse %s: status %d '%s', want %d containing '%s'", src, st, ks_errmsg(), want_st, want_msg);
    assert_null(t);
}

static void test_errors(void **state)
{
    (void)state;
    check_parse_error("a\n{% if x %}b", KS_ERR_FORMAT, "line 2, column 11: this block is never closed (expected 'endif')");
    check_parse_error("ab\n  {{ 'x }}", KS_ERR_FORMAT, "line 2, column 6: unterminated string literal");
    check_parse_error("{{ 1 + }}", KS_ERR_FORMAT, "line 1, column 8: expected an expression, found '}}'");
    check_parse_error("x\n\n{% include 'f' %}", KS_ERR_UNSUPPORTED, "line 3, column 4: unsupported or misplaced statement 'include'");
    check_parse_error("{% endif %}", KS_ERR_UNSUPPORTED, "line 1, column 4: unsupported or misplaced statement 'endif'");
    check_parse_error("{{ a $ b }}", KS_ERR_FORMAT, "line 1, column 6: unexpected character '$'");
    check_parse_error("{{ x is frobnicated }}", KS_ERR_UNSUPPORTED, "line 1, column 9: unknown test 'frobnicated'");
    check_parse_error("{# open", KS_ERR_FORMAT, "line 1, column 1: comment {# is never closed");
    check_parse_error("{{ x ", KS_ERR_FORMAT, "line 1, column 1: {{ is never closed");
    check_parse_error("{% for x in %}{% endfor %}", KS_ERR_FORMAT, "line 1, column 13: expected an expression");
    char deep[1000];
    memset(deep, '(', sizeof deep);
    memcpy(deep, "{{ ", 3);
    memcpy(deep + sizeof deep - 4, " }}", 4);
    check_parse_error(deep, KS_ERR_RANGE, "nesting deeper than 200");
    check_error("{{ 1 + 'a' }}", NULL, KS_ERR_INVALID_ARG, "line 1, column 6: arithmetic on integer and string");
    check_parse_error("\n{{ x | nosuchfilter }}", KS_ERR_UNSUPPORTED, "line 2, column 8: unknown filter 'nosuchfilter'");
    check_parse_error("{% filter nope %}x{% endfilter %}", KS_ERR_UNSUPPORTED, "line 1, column 11: unknown filter 'nope'");
    check_error("{{ [1] | map('nosuch') | list }}", NULL, KS_ERR_UNSUPPORTED, "unknown filter 'nosuch'");
    check_error("{{ nofunc() }}", NULL, KS_ERR_INVALID_ARG, "'nofunc' is undefined, it cannot be called");
    check_error("{% for x in 5 %}{% endfor %}", NULL, KS_ERR_INVALID_ARG, "a integer cannot be iterated");
    check_error("{{ 1 // 0 }}", NULL, KS_ERR_INVALID_ARG, "division by zero");
    ks_status st;
    assert_null(render_opts("{{ x }}", "[1]", NULL, &st));
    assert_int_equal(st, KS_ERR_INVALID_ARG);
}

static void check_limit(const char *src, struct jinja_opts o, const char *want_msg)
{
    ks_status st;
    char *out = render_opts(src, NULL, &o, &st);
    if (st != KS_ERR_RANGE || !strstr(ks_errmsg(), want_msg))
        fail_msg("%s: status %d '%s', want KS_ERR_RANGE containing '%s'", src, st, ks_errmsg(), want_msg);
    assert_null(out);
}

static void test_limits(void **state)
{
    (void)state;
    check_limit("{% for i in range(100) %}xxxxxxxxxx{% endfor %}", (struct jinja_opts){.max_output = 500},
                "the output would pass its limit of 500 bytes");
    check_limit("{% for i in range(1000000000) %}{% endfor %}", (struct jinja_opts){0}, "over the step limit of 10000000");
    check_limit("{% for i in range(100) %}{% for j in range(100) %}{% endfor %}{% endfor %}",
                (struct jinja_opts){.max_steps = 5000}, "step limit of 5000");
    check_limit("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", (struct jinja_opts){0},
                "deeper than the depth limit 200");
    check_limit("{{ 'x' * 2000 }}", (struct jinja_opts){.max_string = 1000}, "a string would pass its limit of 1000");
    check_limit("{% set ns = namespace(s='x') %}{% for i in range(30) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                (struct jinja_opts){0}, "limit of 4194304 bytes");
    check_limit("{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set _ = ns.l.append([i, i, i]) %}"
                "{% endfor %}",
                (struct jinja_opts){.max_memory = 1 << 20}, "memory limit of 1048576 bytes");
    /* work on big values costs steps too: 3000 inserts and lookups in a
     * 3000-key dict scan ~9M keys */
    const char *big_dict = "{% set d = {} %}{% for i in range(3000) %}{% set _ = d.update({i: i}) %}{% endfor %}"
                           "{% for i in range(3000) %}{{ d[i] % 10 }}{% endfor %}";
    check_limit(big_dict, (struct jinja_opts){.max_steps = 100000}, "step limit of 100000");
    ks_status st1;
    char *ok = render_opts(big_dict, NULL, NULL, &st1);
    assert_int_equal(st1, KS_OK);
    assert_int_equal(strlen(ok), 3000);
    free(ok);
    /* accumulating a long prompt piece by piece (Reka's ns.out ~ piece) stays
     * linear in memory: 20000 pieces of 50 bytes in 16 MiB (copying the
     * string each time would take 10 GB) */
    ks_status st0;
    struct jinja_opts lin = {.max_memory = 16 << 20};
    char *acc = render_opts("{% set ns = namespace(s='') %}{% for i in range(20000) %}"
                            "{% set ns.s = ns.s ~ '0123456789012345678901234567890123456789012345678' ~ '\\n' %}"
                            "{% endfor %}{{ ns.s | length }}",
                            NULL, &lin, &st0);
    if (st0)
        fail_msg("%s", ks_errmsg());
    assert_string_equal(acc, "1000000");
    free(acc);
    /* within the limits the same templates render */
    ks_status st;
    struct jinja_opts o = {.max_output = 1000};
    char *out = render_opts("{% for i in range(100) %}xxxxxxxxxx{% endfor %}", NULL, &o, &st);
    assert_int_equal(st, KS_OK);
    assert_int_equal(strlen(out), 1000);
    free(out);
}

/* The chat layer: polyfills over the interpreter. */
static void test_chat(void **state)
{
    (void)state;
    const char *src = "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}"
                      "{{ raise_exception('System role not supported') }}{% endif %}"
                      "<{{ m.role }}>{{ m.content }}{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments.city }}"
                      "{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}";
    struct jinja_template *t = NULL;
    assert_int_equal(jinja_parse(src, strlen(src), &t), KS_OK);
    cJSON *req = cJSON_Parse("{\"messages\": [{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"user\", \"content\": "
                             "\"U\"}, {\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"type\": \"function\", "
                             "\"function\": {\"name\": \"f\", \"arguments\": \"{\\\"city\\\": \\\"Paris\\\"}\"}}]}]}");
    assert_non_null(req);
    struct jinja_chat chat = {"<s>", "</s>", 1, NULL};
    char *out = NULL;
    size_t len = 0;
    assert_int_equal(jinja_chat_render(t, req, &chat, NULL, &out, &len), KS_OK);
    assert_string_equal(out, "<user>S\nU<assistant>Paris<assistant>");
    assert_int_equal(len, strlen(out));
    free(out);
    cJSON_Delete(req);
    req = cJSON_Parse("{\"messages\": [{\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"function\": "
                      "{\"name\": \"f\", \"arguments\": \"{not json\"}}]}]}");
    assert_int_equal(jinja_chat_render(t, req, &chat, NULL, &out, &len), KS_ERR_INVALID_ARG);
    cJSON_Delete(req);
    req = cJSON_Parse("{\"prompt\": \"x\"}");
    assert_int_equal(jinja_chat_render(t, req, &chat, NULL, &out, &len), KS_ERR_INVALID_ARG);
    cJSON_Delete(req);
    jinja_free(t);

    /* enable_thinking stays true where it changes the generation prompt, and
     * is false where it only changes an earlier part (llama.cpp's view of
     * thinking support) */
    static const struct {
        const char *src, *want;
    } thinking[] = {
        {"{% for m in messages %}{{ m.content }}{% endfor %}{% if enable_thinking %}<think>{% endif %}", "U<think>"},
        {"{% if enable_thinking %}on{% else %}off{% endif %}|{% for m in messages %}{{ m.content }}{% endfor %}|A",
         "off|U|A"},
        {"{% for m in messages %}{{ m.content }}{% endfor %}", "U"},
    };
    req = cJSON_Parse("{\"messages\": [{\"role\": \"user\", \"content\": \"U\"}]}");
    for (size_t i = 0; i < sizeof thinking / sizeof thinking[0]; i++) {
        assert_int_equal(jinja_parse(thinking[i].src, strlen(thinking[i].src), &t), KS_OK);
        assert_int_equal(jinja_chat_render(t, req, &chat, NULL, &out, &len), KS_OK);
        assert_string_equal(out, thinking[i].want);
        free(out);
        jinja_free(t);
    }

    /* kwargs (chat_template_kwargs) are set after the defaults; an
     * enable_thinking there is taken as given, without the probe */
    cJSON *kw = cJSON_Parse("{\"enable_thinking\": false, \"extra\": \"E\", \"bos_token\": \"B\"}");
    struct jinja_chat chat_kw = {"<s>", "</s>", 1, kw};
    const char *ksrc = "{{ bos_token }}{{ extra }}{% if enable_thinking %}<think>{% endif %}";
    assert_int_equal(jinja_parse(ksrc, strlen(ksrc), &t), KS_OK);
    assert_int_equal(jinja_chat_render(t, req, &chat_kw, NULL, &out, &len), KS_OK);
    assert_string_equal(out, "BE");
    free(out);
    cJSON *not_object = cJSON_CreateArray();
    chat_kw.kwargs = not_object;
    assert_int_equal(jinja_chat_render(t, req, &chat_kw, NULL, &out, &len), KS_ERR_INVALID_ARG);
    cJSON_Delete(not_object);
    cJSON_Delete(kw);
    jinja_free(t);
    cJSON_Delete(req);
}

static size_t list_templates(const char *dir, char ***names);

/* ---- random input ---------------------------------------------------------- */

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}

static const char *const fuzz_tokens[] = {
    "{{", "}}", "{%", "%}", "{#", "#}", "{%-", "-%}", "{{-", "-}}", "if ", "elif ", "else", "endif", "for ", " in ",
    "endfor", "set ", "endset", "macro ", "endmacro", "filter ", "endfilter", "break", "continue", "loop.index",
    "loop.last", "messages", "message['content']", "m.role", "ns", "namespace(a=1)", "ns.a", "range(", "(", ")", "[",
    "]", "{", "}", ",", ":", "::", ".", "|", "| tojson", "| length", "| join(',')", "| items", "| map(attribute='x')",
    "| selectattr('role', 'equalto', 'user')", " is defined", " is not none", " is string", " and ", " or ", "not ",
    " if ", " else ", "+", "-", "*", "**", "/", "//", "%", "~", "==", "!=", "<", ">=", "'", "\"", "'str'", "\"q\\\"\"",
    "0", "1", "-1", "1.5", "1e308", "9223372036854775807", "true", "none", "x", "y", "raise_exception('r')",
    "strftime_now('%Y')", ".strip()", ".split(' ')", ".items()", ".get('k')", ".append(1)", ".pop()", ".format(1)",
    "[::-1]", "[1:]", "\n", " ", "\xc3\xa9", "\xff", "\x00",
};
#define N_FUZZ_TOKENS (sizeof fuzz_tokens / sizeof fuzz_tokens[0])

static const char fuzz_context[] =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"user\", \"content\": \"U \\u00e9\"}, "
    "{\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"id\": \"c\", \"function\": {\"name\": \"f\", "
    "\"arguments\": \"{\\\"a\\\": [1, {\\\"b\\\": null}]}\"}}]}, {\"role\": \"tool\", \"content\": \"{}\"}], "
    "\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {}}}], \"x\": [1, 2.5, \"s\"], "
    "\"y\": {\"k\": true}}";

/* Parse and render src under tight limits; any status is fine, a crash or
 * an out-of-bounds access (under ASan) is not. */
static void fuzz_one(const char *src, size_t len, const cJSON *ctx)
{
    struct jinja_template *t = NULL;
    if (jinja_parse(src, len, &t) != KS_OK) {
        assert_null(t);
        return;
    }
    struct jinja_opts o = {.max_output = 1 << 16, .max_string = 1 << 16, .max_steps = 20000, .max_depth = 64,
                           .max_memory = 8 << 20, .now = CORPUS_NOW};
    char *out = NULL;
    size_t n = 0;
    if (jinja_render(t, ctx, &o, &out, &n) == KS_OK) {
        assert_non_null(out);
        assert_true(n <= o.max_output);
        free(out);
    }
    struct jinja_chat chat = {"<s>", "</s>", 1, NULL};
    if (jinja_chat_render(t, ctx, &chat, &o, &out, &n) == KS_OK)
        free(out);
    jinja_free(t);
}

/* KVSERVE_JINJA_FUZZ=N runs N times the iterations, from seed N (a longer
 * hunt: KVSERVE_JINJA_FUZZ=50 build-asan/test_jinja). */
static int fuzz_scale(void)
{
    const char *e = getenv("KVSERVE_JINJA_FUZZ");
    int n = e ? atoi(e) : 1;
    if (n > 1)
        rng ^= (uint64_t)n * 0x2545F4914F6CDD1Dull;
    return n > 0 ? n : 1;
}

static void test_fuzz_random(void **state)
{
    (void)state;
    int scale = fuzz_scale();
    cJSON *ctx = cJSON_Parse(fuzz_context);
    assert_non_null(ctx);
    char buf[600];
    for (int iter = 0; iter < 10000 * scale; iter++) {
        size_t n = rnd() % sizeof buf;
        for (size_t i = 0; i < n; i++)
            buf[i] = (char)rnd();
        fuzz_one(buf, n, ctx);
    }
    for (int iter = 0; iter < 30000 * scale; iter++) {
        size_t n = 0, k = 1 + rnd() % 40;
        for (size_t i = 0; i < k; i++) {
            const char *tok = fuzz_tokens[rnd() % N_FUZZ_TOKENS];
            size_t tl = tok[0] ? strlen(tok) : 1; /* the "\x00" token is one NUL byte */
            if (n + tl > sizeof buf)
                break;
            memcpy(buf + n, tok, tl);
            n += tl;
        }
        fuzz_one(buf, n, ctx);
    }
    cJSON_Delete(ctx);
}

/* Every corpus template, cut, flipped, spliced with tokens. */
static void test_fuzz_corpus(void **state)
{
    (void)state;
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/templates", shared_dir());
    char **names;
    size_t n_names = list_templates(dir, &names);
    if (!n_names)
        KS_SKIP("no templates in %s", dir);
    cJSON *ctx = cJSON_Parse(fuzz_context);
    assert_non_null(ctx);
    int mutations = 150 * fuzz_scale();
    for (size_t t = 0; t < n_names; t++) {
        char path[2400];
        snprintf(path, sizeof path, "%s/%s.jinja", dir, names[t]);
        size_t len = 0;
        char *src = ks_read_file(path, &len);
        assert_non_null(src);
        char *mut = malloc(len + 64);
        assert_non_null(mut);
        for (int iter = 0; iter < mutations; iter++) {
            size_t n = len;
            memcpy(mut, src, len);
            int edits = 1 + (int)(rnd() % 4);
            for (int e = 0; e < edits && n; e++) {
                size_t at = rnd() % n;
                switch (rnd() % 4) {
                case 0: mut[at] = (char)rnd(); break;
                case 1: n = at; break; /* cut */
                case 2: memmove(mut + at, mut + at + 1, n - at - 1), n--; break;
                default: {
                    const char *tok = fuzz_tokens[rnd() % N_FUZZ_TOKENS];
                    size_t tl = strlen(tok);
                    if (n + tl <= len + 60) {
                        memmove(mut + at + tl, mut + at, n - at);
                        memcpy(mut + at, tok, tl);
                        n += tl;
                    }
                }
                }
            }
            fuzz_one(mut, n, ctx);
        }
        free(mut);
        free(src);
        free(names[t]);
    }
    free(names);
    cJSON_Delete(ctx);
}

/* ---- kvserve template ------------------------------------------------------ */

/* Run `kvserve template ARGS` on the request text req; returns its stdout. */
static char *run_template_cmd(const char *args, const char *req, int *rc)
{
    char req_path[] = "/tmp/test_jinja_reqXXXXXX";
    int fd = mkstemp(req_path);
    assert_true(fd >= 0);
    FILE *rf = fdopen(fd, "w");
    assert_non_null(rf);
    fputs(req, rf);
    fclose(rf);
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "'%s' template %s --request %s --now 2026-11-24", getenv("KVSERVE_BIN"), args, req_path);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t cap = 1 << 16, n = 0;
    char *out = malloc(cap);
    assert_non_null(out);
    n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    *rc = WEXITSTATUS(pclose(p));
    unlink(req_path);
    return out;
}

static void test_cli_template(void **state)
{
    (void)state;
    const char *bin = getenv("KVSERVE_BIN");
    char vocab[1024], tmpl[1024], ref_path[1024];
    snprintf(vocab, sizeof vocab, "%s/models/vocab/ggml-vocab-qwen3.gguf", shared_dir());
    snprintf(tmpl, sizeof tmpl, "%s/templates/meta-llama-Llama-3.1-8B-Instruct.jinja", shared_dir());
    snprintf(ref_path, sizeof ref_path, "%s/templates/rendered/meta-llama-Llama-3.1-8B-Instruct.json", shared_dir());
    char *ref_text = ks_read_file(ref_path, NULL);
    if (!bin || access(bin, X_OK) || access(vocab, R_OK) || !ref_text) {
        free(ref_text);
        KS_SKIP("KVSERVE_BIN, %s or the corpus is missing", vocab);
    }
    const char *req = "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", "
                      "\"content\": \"What is 2+2?\"}, {\"role\": \"assistant\", \"content\": \"4.\"}, {\"role\": "
                      "\"user\", \"content\": \"And 3+3?\"}]}";
    /* the model's own template (Qwen3's, in the vocabulary file) */
    char args[3000];
    snprintf(args, sizeof args, "-m '%s'", vocab);
    int rc;
    char *out = run_template_cmd(args, req, &rc);
    assert_int_equal(rc, 0);
    assert_string_equal(out, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                             "<|im_start|>assistant\n4.<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n"
                             "<|im_start|>assistant\n");
    free(out);
    /* a template file, byte for byte as llama.cpp rendered it */
    snprintf(args, sizeof args, "-m '%s' --chat-template-file '%s'", vocab, tmpl);
    out = run_template_cmd(args, req, &rc);
    assert_int_equal(rc, 0);
    cJSON *ref = cJSON_Parse(ref_text);
    assert_string_equal(out, cJSON_GetObjectItemCaseSensitive(ref, "multi_turn")->valuestring);
    free(out);
    cJSON_Delete(ref);
    free(ref_text);
    /* a template error names the file, line and column */
    char bad[] = "/tmp/test_jinja_badXXXXXX";
    int fd = mkstemp(bad);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, "ok\n{% if %}", 11), 11);
    close(fd);
    snprintf(args, sizeof args, "-m '%s' --chat-template-file %s 2>&1", vocab, bad);
    out = run_template_cmd(args, req, &rc);
    assert_int_equal(rc, 1);
    assert_non_null(strstr(out, "line 2, column 7: expected an expression"));
    free(out);
    unlink(bad);
}

/* ---- the corpus ---------------------------------------------------------- */

/* Renderings that do not match llama.cpp yet, and why. The corpus test fails
 * when one of these starts matching (take it off the list) or when a case not
 * listed stops matching. */
static const struct {
    const char *tmpl, *conv, *why;
} known_failures[] = {
    {NULL, NULL, NULL},
};

static const char *known_failure(const char *tmpl, const char *conv)
{
    for (size_t i = 0; known_failures[i].tmpl; i++)
        if (!strcmp(known_failures[i].tmpl, tmpl) && !strcmp(known_failures[i].conv, conv))
            return known_failures[i].why;
    return NULL;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static size_t list_templates(const char *dir, char ***names)
{
    DIR *d = opendir(dir);
    size_t n = 0, cap = 0;
    *names = NULL;
    for (struct dirent *e; d && (e = readdir(d));) {
        size_t len = strlen(e->d_name);
        if (len < 7 || strcmp(e->d_name + len - 6, ".jinja"))
            continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 64;
            *names = realloc(*names, cap * sizeof **names);
            assert_non_null(*names);
        }
        (*names)[n++] = strndup(e->d_name, len - 6);
    }
    if (d)
        closedir(d);
    if (n)
        qsort(*names, n, sizeof **names, cmp_str);
    return n;
}

struct corpus_tally {
    int match, total, known, unexpected, fixed;
};

/* One template against every conversation; prints its line of the report. */
static void corpus_template(const char *dir, const char *name, const cJSON *convs, int64_t now,
                            struct corpus_tally *tally)
{
    char path[2400];
    snprintf(path, sizeof path, "%s/%s.jinja", dir, name);
    size_t len = 0;
    char *src = ks_read_file(path, &len);
    assert_non_null(src);
    snprintf(path, sizeof path, "%s/rendered/%s.json", dir, name);
    char *ref_text = ks_read_file(path, NULL);
    assert_non_null(ref_text);
    cJSON *ref = cJSON_Parse(ref_text);
    assert_non_null(ref);
    struct jinja_template *t = NULL;
    ks_status pst = jinja_parse(src, len, &t);
    char parse_err[512] = "";
    if (pst)
        snprintf(parse_err, sizeof parse_err, "%s", ks_errmsg());
    struct jinja_chat chat = {"<|begin_of_text|>", "<|eot_id|>", 1, NULL};
    struct jinja_opts opts = {.now = now};
    int ok = 0, n = 0;
    char report[4096] = "";
    for (const cJSON *conv = convs->child; conv; conv = conv->next, n++) {
        const cJSON *want = cJSON_GetObjectItemCaseSensitive(ref, conv->string);
        char *out = NULL;
        size_t out_len = 0;
        ks_status st = pst ? pst : jinja_chat_render(t, conv, &chat, &opts, &out, &out_len);
        char what[600];
        bool match;
        if (cJSON_IsNull(want)) {
            match = st != KS_OK;
            snprintf(what, sizeof what, "rendered %zu bytes where llama.cpp refused", out_len);
        } else if (st) {
            match = false;
            snprintf(what, sizeof what, "error: %s", pst ? parse_err : ks_errmsg());
        } else {
            const char *w = want->valuestring;
            size_t wl = strlen(w), d = 0;
            while (d < wl && d < out_len && w[d] == out[d])
                d++;
            match = d == wl && d == out_len;
            snprintf(what, sizeof what, "first difference at byte %zu of %zu/%zu: got '%.40s' want '%.40s'", d, out_len,
                     wl, out + d, w + d);
        }
        free(out);
        const char *why = known_failure(name, conv->string);
        if (match) {
            ok++;
            if (why) {
                tally->fixed++;
                snprintf(report + strlen(report), sizeof report - strlen(report),
                         "    %s: matches now, take it off known_failures\n", conv->string);
            }
        } else if (why) {
            tally->known++;
            snprintf(report + strlen(report), sizeof report - strlen(report), "    %s: known failure (%s)\n",
                     conv->string, why);
        } else {
            tally->unexpected++;
            snprintf(report + strlen(report), sizeof report - strlen(report), "    %s: MISMATCH, %s\n",
                     conv->string, what);
        }
    }
    print_message("  %-50s %d/%d\n%s", name, ok, n, report);
    tally->match += ok;
    tally->total += n;
    jinja_free(t);
    cJSON_Delete(ref);
    free(ref_text);
    free(src);
}

static void test_corpus(void **state)
{
    (void)state;
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/templates", shared_dir());
    char path[1100];
    snprintf(path, sizeof path, "%s/conversations.json", dir);
    char *text = ks_read_file(path, NULL);
    if (!text)
        KS_SKIP("no %s", path);
    cJSON *convs = cJSON_Parse(text);
    assert_non_null(convs);
    char **names;
    size_t n = list_templates(dir, &names);
    struct corpus_tally tally = {0};
    for (size_t i = 0; i < n; i++) {
        corpus_template(dir, names[i], convs, CORPUS_NOW, &tally);
        free(names[i]);
    }
    free(names);
    print_message("corpus: %d/%d renderings match llama.cpp (%zu templates); %d known failures, %d unexpected, "
                  "%d fixed\n",
                  tally.match, tally.total, n, tally.known, tally.unexpected, tally.fixed);
    cJSON_Delete(convs);
    free(text);
    assert_int_equal(tally.unexpected, 0);
    assert_int_equal(tally.fixed, 0);
}

/* Templates of models the shared corpus lacks (gpt-oss's harmony), kept in
 * tests/data/templates with llama.cpp's renderings of the same six
 * conversations (llama-server --jinja --chat-template-file, POST
 * /apply-template, rendered on LOCAL_CORPUS_NOW). */
static void test_local_corpus(void **state)
{
    (void)state;
    char path[1100], dir[1024];
    snprintf(path, sizeof path, "%s/templates/conversations.json", shared_dir());
    char *text = ks_read_file(path, NULL);
    if (!text)
        KS_SKIP("no %s", path);
    const char *src = getenv("KVSERVE_SOURCE");
    snprintf(dir, sizeof dir, "%s/tests/data/templates", src ? src : ".");
    cJSON *convs = cJSON_Parse(text);
    assert_non_null(convs);
    char **names;
    size_t n = list_templates(dir, &names);
    assert_true(n > 0);
    struct corpus_tally tally = {0};
    for (size_t i = 0; i < n; i++) {
        corpus_template(dir, names[i], convs, LOCAL_CORPUS_NOW, &tally);
        free(names[i]);
    }
    free(names);
    cJSON_Delete(convs);
    free(text);
    assert_int_equal(tally.unexpected, 0);
    assert_int_equal(tally.match, tally.total);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_statements), cmocka_unit_test(test_whitespace), cmocka_unit_test(test_expressions),
        cmocka_unit_test(test_methods),    cmocka_unit_test(test_filters),    cmocka_unit_test(test_tests),
        cmocka_unit_test(test_globals),    cmocka_unit_test(test_errors),     cmocka_unit_test(test_limits),
        cmocka_unit_test(test_chat),
        cmocka_unit_test(test_fuzz_random), cmocka_unit_test(test_fuzz_corpus),
        cmocka_unit_test(test_corpus),      cmocka_unit_test(test_cli_template),
        cmocka_unit_test(test_local_corpus),
    };
    return ks_run_tests(tests, NULL, NULL);
}
