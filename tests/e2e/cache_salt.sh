#!/usr/bin/env bash
# Tenant isolation of the prefix cache through a real `kvserve serve` (issue 24):
# cache_salt shares pages only within one salt (in RAM and on disk after a
# restart), a salted request's cached_tokens counts whole pages, an unsalted one
# keeps the token-level count, --cache-salt-from-key isolates API keys,
# --admin-key guards the admin routes (401 without a key, 403 with another),
# and /cache/prefixes shows prompt text only with --cache-show-text.
set -u
. "$(dirname "$0")/lib.sh"

start() { # log file, extra flags...
  local log=$1; shift
  "$bin" serve -m "$model" --port 0 -c 1024 --parallel 2 -t 2 "$@" 2>"$log" &
  pid=$!
  wait_port "$log"
  url=http://127.0.0.1:$port
}
stop() { kill -TERM $pid; wait $pid; pid=; }

ids=$(seq 3 302 | paste -sd, -)                 # a 300-token prompt
guess=$(seq 3 297 | paste -sd, -),9,9,9,9,9     # the same but its last 5 tokens
cached() { # prompt ids, extra JSON fields, [bearer token] -> prints cached_tokens
  local auth=(); [ -n "${3:-}" ] && auth=(-H "Authorization: Bearer $3")
  curl -s "${auth[@]}" -H "Content-Type: application/json" "$url/v1/completions" \
    -d "{\"prompt\":[$1],\"max_tokens\":0$2}" | grep -o '"cached_tokens":[0-9]*' | cut -d: -f2
}
status() { # method path [bearer token] -> prints the HTTP status
  local auth=(); [ -n "${3:-}" ] && auth=(-H "Authorization: Bearer $3")
  curl -s -o "$tmp/body" -w '%{http_code}' -X "$1" "${auth[@]}" -H "Content-Type: application/json" \
    "$url$2" $([ "$1" = POST ] && echo -d '{}')
}

start "$tmp/log1" --cache-dir "$tmp/cache" --admin-key adm1n
P=$(curl -s "$url/cache/usage" | grep -o '"page_tokens":[0-9]*' | cut -d: -f2)
[ -n "$P" ] || { bad "no page_tokens in /cache/usage"; P=16; }
cached "$ids" ',"cache_salt":"tenant-a"' >/dev/null # warm tenant a's cache
c=$(cached "$ids" ',"cache_salt":"tenant-a"')
[ "${c:-0}" -ge 288 ] && [ $((c % P)) = 0 ] && ok "same salt shares: cached_tokens $c (whole pages of $P)" ||
  bad "same salt: cached_tokens '$c'"
c=$(cached "$ids" ',"cache_salt":"tenant-b"')
[ "$c" = 0 ] && ok "another salt shares nothing" || bad "another salt: cached_tokens '$c'"
c=$(cached "$ids" '')
[ "$c" = 0 ] && ok "no salt shares nothing with a salted prompt" || bad "no salt: cached_tokens '$c'"
c=$(cached "$guess" ',"cache_salt":"tenant-a"')
[ -n "$c" ] && [ $((c % P)) = 0 ] && ok "salted guess: cached_tokens $c, whole pages" ||
  bad "salted guess: cached_tokens '$c' (want a multiple of $P)"
c=$(cached "$guess" '')   # unsalted: the prompt above (now cached unsalted) matches token by token
[ -n "$c" ] && [ $((c % P)) != 0 ] && ok "unsalted guess keeps the token-level count ($c)" ||
  bad "unsalted guess: cached_tokens '$c' (want the exact count, not whole pages)"
code=$(curl -s -o "$tmp/body" -w '%{http_code}' -H "Content-Type: application/json" "$url/v1/completions" \
  -d '{"prompt":[3,4],"max_tokens":0,"cache_salt":""}')
[ "$code" = 400 ] && grep -q cache_salt "$tmp/body" && ok "empty cache_salt: 400" || bad "empty cache_salt: $code"

[ "$(status GET /cache/prefixes)" = 401 ] && grep -q '"code":"admin_key_required"' "$tmp/body" &&
  ok "/cache/prefixes without a key: 401 JSON" || bad "/cache/prefixes without a key: $(cat "$tmp/body")"
[ "$(status GET /cache/prefixes wrong)" = 403 ] && ok "/cache/prefixes with another key: 403" || bad "/cache/prefixes, another key"
[ "$(status POST /cache/clear)" = 401 ] && ok "/cache/clear without a key: 401" || bad "/cache/clear without a key"
[ "$(status GET /slots)" = 401 ] && ok "/slots without a key: 401" || bad "/slots without a key"
[ "$(status GET /cache/usage)" = 200 ] && ok "/cache/usage stays open" || bad "/cache/usage: $(cat "$tmp/body")"
[ "$(status GET '/cache/prefixes?limit=5' adm1n)" = 200 ] && grep -q '"tokens":' "$tmp/body" &&
  ! grep -q '"preview"' "$tmp/body" && ok "/cache/prefixes with the admin key: counts and keys, no text" ||
  bad "/cache/prefixes with the admin key: $(head -c 300 "$tmp/body")"
stop

# the salted pages on disk are found after a restart with their salt only
start "$tmp/log2" --cache-dir "$tmp/cache"
c=$(cached "$ids" ',"cache_salt":"tenant-c"')
[ "$c" = 0 ] && ok "after restart: another salt finds nothing on disk" || bad "after restart, salt c: cached_tokens '$c'"
c=$(cached "$ids" ',"cache_salt":"tenant-a"')
[ "${c:-0}" -ge 288 ] && ok "after restart: the same salt reads its pages back ($c)" ||
  bad "after restart, salt a: cached_tokens '$c'"
stop

# --cache-salt-from-key: one key's requests share, another key's do not; text only with --cache-show-text
start "$tmp/log3" --cache-salt-from-key --cache-show-text
cached "$ids" '' key-one >/dev/null
c=$(cached "$ids" '' key-one)
[ "${c:-0}" -ge 288 ] && ok "same API key shares ($c)" || bad "same API key: cached_tokens '$c'"
c=$(cached "$ids" '' key-two)
[ "$c" = 0 ] && ok "another API key shares nothing" || bad "another API key: cached_tokens '$c'"
c=$(cached "$ids" '')
[ "$c" = 0 ] && ok "no key shares nothing with a keyed tenant" || bad "no key: cached_tokens '$c'"
[ "$(status GET '/cache/prefixes?limit=5')" = 200 ] && grep -q '"preview"' "$tmp/body" &&
  ok "--cache-show-text: previews shown" || bad "--cache-show-text: $(head -c 300 "$tmp/body")"
grep -q key-one "$tmp/log3" && bad "the API key is in the log" || true
stop

# keys from files (not in ps): the API key opens the API, the admin key also opens it, and only it the admin routes
printf 'api-secret\n' >"$tmp/api.key"; printf 'admin-secret\n' >"$tmp/admin.key"; chmod 600 "$tmp"/*.key
start "$tmp/log4" --api-key-file "$tmp/api.key" --admin-key-file "$tmp/admin.key"
[ "$(status GET /v1/models)" = 401 ] && ok "--api-key-file: 401 without the key" || bad "--api-key-file: no 401"
[ "$(status GET /v1/models api-secret)" = 200 ] && ok "--api-key-file: the key from the file works" || bad "--api-key-file key"
[ "$(status GET /v1/models admin-secret)" = 200 ] && ok "the admin key opens the API too" || bad "admin key on /v1/models"
[ "$(status GET /cache/prefixes api-secret)" = 403 ] && ok "the API key is not the admin key: 403" || bad "API key on an admin route"
[ "$(status POST /cache/clear admin-secret)" = 200 ] && ok "--admin-key-file: the admin key clears the cache" || bad "admin key from file"
ps -o args= -p $pid | grep -q secret && bad "a key is in ps" || ok "no key in ps"
stop
exit $fail
