#!/usr/bin/env bash
# Every HTTP error case against a real `kvserve serve` with curl: status code
# and OpenAI's error shape, and the server keeps serving afterwards.
set -u
bin=${KVSERVE_BIN:?}; shared=${KVSERVE_SHARED:-../shared}
model=$shared/models/stories260K.gguf
[ -f "$model" ] || { echo "skipped: $model not found"; exit 77; }
command -v curl >/dev/null || { echo "skipped: curl not installed"; exit 77; }
log=$(mktemp); tmp=$(mktemp -d)
start() { # serve flags...: sets pid and url
  : >"$log"
  "$bin" serve -m "$model" --port 0 -c 64 --api-key sekret "$@" 2>"$log" &
  pid=$!
  local port=
  for _ in $(seq 100); do port=$(grep -o '127.0.0.1:[0-9]*' "$log" | cut -d: -f2); [ -n "$port" ] && break; sleep 0.1; done
  [ -n "$port" ] || { echo "server did not start"; cat "$log"; exit 1; }
  url=http://127.0.0.1:$port
}
trap 'kill $pid 2>/dev/null; rm -rf "$log" "$tmp"' EXIT
start --max-body 4096 --max-queue 0 --parallel 1
fail=0
check() { # name expected_status curl-args...
  local name=$1 want=$2; shift 2
  local got; got=$(curl -s -o "$tmp/body" -w '%{http_code}' "$@")
  if [ "$got" != "$want" ] || { [ "$want" -ge 400 ] && ! grep -q '"error":{"message":' "$tmp/body"; }; then
    echo "FAIL $name: want $want got $got: $(head -c 300 "$tmp/body")"; fail=1
  else echo "ok   $name ($got)"; fi
}
auth=(-H "Authorization: Bearer sekret" -H "Content-Type: application/json")
check health-no-key 200 "$url/health"
check page-no-key 200 "$url/"
check usage-key-in-url 401 "$url/cache/usage?key=sekret"
check missing-key 401 "$url/v1/models"
check wrong-key 401 -H "Authorization: Bearer nope" "$url/v1/models"
check models 200 "${auth[@]}" "$url/v1/models"
check unknown-route 404 "${auth[@]}" "$url/v1/nothing"
check wrong-method 405 "${auth[@]}" "$url/v1/chat/completions"
check malformed-json 400 "${auth[@]}" -d '{"prompt": ' "$url/v1/completions"
check not-an-object 400 "${auth[@]}" -d '"hello"' "$url/v1/completions"
check wrong-type 400 "${auth[@]}" -d '{"prompt": "hi", "temperature": "hot"}' "$url/v1/completions"
check prompt-type 400 "${auth[@]}" -d '{"prompt": {"a": 1}}' "$url/v1/completions"
check messages-type 400 "${auth[@]}" -d '{"messages": "hi"}' "$url/v1/chat/completions"
check max-completion-tokens-negative 400 "${auth[@]}" -d '{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -2}' "$url/v1/chat/completions"
check max-tokens-negative 400 "${auth[@]}" -d '{"prompt": "hi", "max_tokens": -1}' "$url/v1/completions"
check n-too-many 400 "${auth[@]}" -d '{"prompt": "hi", "n": 17}' "$url/v1/completions"
check over-context 400 "${auth[@]}" -d "{\"prompt\": \"$(printf 'once upon a time %.0s' $(seq 40))\"}" "$url/v1/completions"
head -c 8192 /dev/zero | tr '\0' ' ' > "$tmp/big"
check body-too-large 413 "${auth[@]}" --data-binary @"$tmp/big" "$url/v1/completions"
check queue-full 503 "${auth[@]}" -d '{"prompt": "hi", "max_tokens": 2}' "$url/v1/completions"
curl -s -D - -o /dev/null "${auth[@]}" -d '{"prompt": "hi"}' "$url/v1/completions" | grep -qi '^Retry-After:' \
  && echo "ok   retry-after" || { echo "FAIL retry-after header missing"; fail=1; }
check policy-bad-value 400 "${auth[@]}" -d '{"policy": "lru"}' "$url/cache/policy"
check policy-unknown-field 400 "${auth[@]}" -d '{"hot": 5}' "$url/cache/policy"
check policy-set 200 "${auth[@]}" -d '{"policy": "dynamic", "hot_tokens": 16}' "$url/cache/policy"
check clear-bad-tier 400 "${auth[@]}" -d '{"tier": "ssd"}' "$url/cache/clear"
check clear-unknown-field 400 "${auth[@]}" -d '{"tier": "ram", "all": true}' "$url/cache/clear"
check clear-disk-without-dir 400 "${auth[@]}" -d '{"tier": "disk"}' "$url/cache/clear"
check clear-malformed 400 "${auth[@]}" -d '{"tier": ' "$url/cache/clear"
check clear-not-object 400 "${auth[@]}" -d '["ram"]' "$url/cache/clear"
check clear-all-without-dir 200 "${auth[@]}" -d '{}' "$url/cache/clear"
check clear-ram 200 "${auth[@]}" -d '{"tier": "ram"}' "$url/cache/clear"
check clear-wrong-method 405 "${auth[@]}" "$url/cache/clear"
check prefixes-bad-limit 400 "${auth[@]}" "$url/cache/prefixes?limit=0"
check prefixes-bad-limit-text 400 "${auth[@]}" "$url/cache/prefixes?limit=ten"
check prefixes-limit-too-big 400 "${auth[@]}" "$url/cache/prefixes?limit=1001"
check prefixes-wrong-method 405 "${auth[@]}" -d '{}' "$url/cache/prefixes"
check prefixes 200 "${auth[@]}" "$url/cache/prefixes?limit=3"
check requantize-bad-type 400 "${auth[@]}" -d '{"type_k": "q3_k"}' "$url/cache/requantize"
check still-alive 200 "${auth[@]}" "$url/metrics"
kill -TERM $pid; wait $pid; rc=$?
[ $rc = 0 ] && echo "ok   exit 0 on SIGTERM" || { echo "FAIL exit code $rc on SIGTERM"; fail=1; }

# max_tokens 0 is a warm-up, not an error (the server above admits no request: --max-queue 0)
start
warm='once upon a time there was a little girl'
check max-tokens-zero 200 "${auth[@]}" -d "{\"prompt\": \"$warm\", \"max_tokens\": 0}" "$url/v1/completions"
grep -q '"text":"".*"finish_reason":"length".*"completion_tokens":0' "$tmp/body" \
  || { echo "FAIL max-tokens-zero body: $(head -c 300 "$tmp/body")"; fail=1; }
check after-warm-up 200 "${auth[@]}" -d "{\"prompt\": \"$warm\", \"max_tokens\": 1}" "$url/v1/completions"
grep -q '"cached_tokens":[1-9]' "$tmp/body" || { echo "FAIL after-warm-up: no cached tokens: $(head -c 300 "$tmp/body")"; fail=1; }
check max-completion-tokens-zero 200 "${auth[@]}" -d '{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}' "$url/v1/chat/completions"
check prefixes-after-warm-up 200 "${auth[@]}" "$url/cache/prefixes"
grep -q '"tier":"ram"' "$tmp/body" || { echo "FAIL prefixes-after-warm-up: no RAM chain: $(head -c 300 "$tmp/body")"; fail=1; }
kill -TERM $pid; wait $pid
exit $fail
