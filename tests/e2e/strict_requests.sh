#!/usr/bin/env bash
# Request bodies cJSON would take but a server must refuse (issue 24), through
# a real `kvserve serve` with curl: each gets 400 with a JSON error and a code,
# the accepted neighbours still get 200, and every error carries a non-null code.
set -u
. "$(dirname "$0")/lib.sh"

"$bin" serve -m "$model" --port 0 -c 512 --parallel 2 -t 2 2>"$tmp/log" &
pid=$!
wait_port "$tmp/log"
url=http://127.0.0.1:$port

post() { # body file or string (printf format) -> status; body in $tmp/body
  printf "$1" >"$tmp/req"
  curl -s -o "$tmp/body" -w '%{http_code}' -H "Content-Type: application/json" "$url/v1/chat/completions" --data-binary @"$tmp/req"
}
expect() { # want-status want-code description body
  local got; got=$(post "$4")
  if [ "$got" = "$1" ] && { [ "$1" = 200 ] || grep -q "\"code\":\"$2\"" "$tmp/body"; }; then ok "$3: $got"
  else bad "$3: $got $(head -c 200 "$tmp/body")"; fi
}
m='"messages":[{"role":"user","content":"hi"}]'
expect 200 - "a plain body" "{\"max_tokens\":1,$m}\n"
expect 200 - "escaped backslash before u0000 (text, not NUL)" '{"max_tokens":1,"messages":[{"role":"user","content":"a \\\\u0000 b \\u00e9"}]}'
expect 400 invalid_json "a key twice" "{\"max_tokens\":1,\"max_tokens\":2,$m}"
expect 400 invalid_json "a key twice in a message" '{"max_tokens":1,"messages":[{"role":"user","content":"a","content":"b"}]}'
expect 400 invalid_json "bytes after the value" "{\"max_tokens\":1,$m} x"
expect 400 invalid_json "\\\\u0000 in content" '{"max_tokens":1,"messages":[{"role":"user","content":"a\\u0000b"}]}'
expect 400 invalid_json "invalid UTF-8" '{"max_tokens":1,"messages":[{"role":"user","content":"a\xff\xfe"}]}'
expect 400 invalid_json "overlong UTF-8" '{"max_tokens":1,"messages":[{"role":"user","content":"a\xc0\xaf"}]}'
expect 400 invalid_value "a user message without content" '{"max_tokens":1,"messages":[{"role":"user"}]}'
expect 400 invalid_value "a tool message without tool_call_id" \
  '{"max_tokens":1,"messages":[{"role":"user","content":"x"},{"role":"tool","content":"r"}]}'
printf '{"prompt":["a","b"],"max_tokens":1,"max_tokens":2}' >"$tmp/req"
code=$(curl -s -o "$tmp/body" -w '%{http_code}' -H "Content-Type: application/json" "$url/v1/completions" --data-binary @"$tmp/req")
[ "$code" = 400 ] && grep -q '"code":"invalid_json"' "$tmp/body" && ok "a key twice with several prompts: 400" ||
  bad "a key twice with several prompts: $code $(head -c 200 "$tmp/body")"
# a 1100-value enum sharing a prefix, inside an object: answered, not 500 at sampling time
enum=$(seq 0 1099 | sed 's/.*/"value&"/' | paste -sd, -)
printf '{"prompt":"hi","max_tokens":60,"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{"type":"object","properties":{"a":{"enum":[%s]}},"required":["a"]}}}}' "$enum" >"$tmp/req"
code=$(curl -s -o "$tmp/body" -w '%{http_code}' -H "Content-Type: application/json" "$url/v1/completions" --data-binary @"$tmp/req")
[ "$code" = 200 ] && grep -q 'value[0-9]' "$tmp/body" && ok "1100-value enum: 200 with one of them" ||
  bad "1100-value enum: $code $(head -c 200 "$tmp/body")"
# a route's error without its own code gets its status's
code=$(curl -s -o "$tmp/body" -w '%{http_code}' "$url/nope")
[ "$code" = 404 ] && grep -q '"code":"not_found"' "$tmp/body" && ok "404 has a code" || bad "404: $(cat "$tmp/body")"
kill -TERM $pid; wait $pid; pid=
exit $fail
