#!/usr/bin/env bash
# kvserve route end to end (scripts/cluster.sh -r): redis-server, two replicas
# publishing their KV events, the router in front. A long prompt sent again
# with another suffix goes to the replica that computed it and is served from
# its RAM; the answers are the replicas' own (greedy tokens equal to a
# replica asked directly); Authorization and SSE pass through; a replica
# killed with SIGKILL is skipped and its requests go to the other one. The
# replicas salt each request with its API key (--cache-salt-from-key, their
# shared --cache-redis-secret-file, which the router is given too), so every
# affinity below is the router computing the tenant's keys; the other
# replica reads the tenant's pages from Redis; /v1/messages and /v1/responses
# go where a chat with their system prompt was computed.
set -u
bin=${KVSERVE_BIN:?}
src=${KVSERVE_SOURCE:?}
model=$(dirname "$bin")/default-model.gguf
[ -f "$model" ] || { echo "skipped: $model not found (the build makes it)"; exit 77; }
for c in redis-server redis-cli curl python3; do
  command -v $c >/dev/null || { echo "skipped: $c not installed (scripts/deps.sh installs it)"; exit 77; }
done
tmp=$(mktemp -d)
fail=0
ok() { echo "ok   $*"; }
bad() { echo "FAIL $*"; fail=1; }
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
head -c 32 /dev/urandom >"$tmp/secret" && chmod 600 "$tmp/secret"
salted=(--cache-salt-from-key --cache-redis-secret-file "$tmp/secret")
set -m # its own process group, as in a terminal, so SIGINT reaches every process
KVSERVE_BIN=$bin "$src/scripts/cluster.sh" -r -n 2 -p "$port" -m "$model" -- -c 1024 -t 1 --parallel 2 \
  --api-key sekrit "${salted[@]}" >"$tmp/log" 2>&1 &
cpid=$!
set +m
trap 'kill -INT -$cpid 2>/dev/null; sleep 1; rm -rf "$tmp"' EXIT
for _ in $(seq 300); do grep -q 'ready at' "$tmp/log" && break; sleep 0.1; done
grep -q "ready at http://127.0.0.1:$port" "$tmp/log" && ok "cluster.sh -r: $(grep -o 'ready at [^ ]*' "$tmp/log")" ||
  { bad "cluster.sh -r did not start"; cat "$tmp/log"; exit 1; }
dir=$(grep -o '/tmp/kvserve-cluster-[A-Za-z0-9]*' "$tmp/log" | head -1)
url=http://127.0.0.1:$port
auth="Authorization: Bearer sekrit"

prefix=$(python3 -c "print(','.join(str(3+(i*11)%500) for i in range(384)))")
suffix() { python3 -c "print(','.join(str(7+($1*13+i*17)%400) for i in range(16)))"; }
# complete BASE-URL SUFFIX-SEED -> "<replica> <overlap> <cached_tokens> <text>" (replica: - when direct)
complete() {
  curl -s -D "$tmp/h" -H "$auth" -H "Content-Type: application/json" "$1/v1/completions" \
    -d "{\"prompt\":[$prefix,$(suffix "$2")],\"max_tokens\":8,\"temperature\":0,\"ignore_eos\":true}" >"$tmp/r"
  local route; route=$(grep -i '^x-kvserve-route:' "$tmp/h" | tr -d '\r' | cut -d' ' -f2-)
  local overlap; overlap=$(grep -o 'overlap=[0-9]*' <<<"$route" | cut -d= -f2)
  printf '%s %s %s %s\n' "$(cut -d';' -f1 <<<"${route:--}")" "${overlap:-0}" \
    "$(grep -o '"cached_tokens":[0-9]*' "$tmp/r" | cut -d: -f2 || echo -)" \
    "$(grep -oE '"text":"([^"\\]|\\.)*"' "$tmp/r" | head -1 | cut -d: -f2-)"
}
status() { curl -s "$url/route/status"; }
indexed() { # replica-url -> pages the router indexed for it
  status | python3 -c "import json,sys; print([r['pages_indexed'] for r in json.load(sys.stdin)['replicas'] if r['url']=='$1'][0])"
}
ram_hits() { curl -s -H "$auth" "$1/cache/usage" | python3 -c "import json,sys; print(json.load(sys.stdin)['prefix']['hit_tokens_ram'])"; }

read -r a _ c t1 <<<"$(complete "$url" 1)"
[ -n "$a" ] && [ "$a" != - ] && [ -n "$t1" ] && ok "through the router: answered by $a (cached $c)" ||
  { bad "first request: replica '$a' text '$t1'"; cat "$tmp/r"; }
for _ in $(seq 50); do [ "$(indexed "$a")" -ge 12 ] && break; sleep 0.1; done
n=$(indexed "$a")
[ "$n" -ge 12 ] && ok "the router indexed $n pages of $a from its KV events" || bad "pages indexed for $a: $n"
before=$(ram_hits "$a")
read -r a2 o c t2 <<<"$(complete "$url" 2)"
after=$(ram_hits "$a")
[ "$a2" = "$a" ] && [ "${o:-0}" -ge 12 ] && ok "another suffix: the same replica, overlap $o pages" ||
  bad "another suffix went to $a2 (overlap $o), not $a"
[ "${c:-0}" -ge 384 ] && [ $((after - before)) -ge 384 ] && ok "cached_tokens $c, from RAM (+$((after - before)) RAM hit tokens)" ||
  bad "cached_tokens $c, RAM hit tokens +$((after - before))"
b=$(for p in $(grep -ho 'on http://127.0.0.1:[0-9]*' "$dir"/replica*.log | cut -d' ' -f2); do [ "$p" != "$a" ] && echo "$p"; done)
read -r _ _ c2b t2b <<<"$(complete "$b" 2)"
[ -n "$t2" ] && [ "$t2" = "$t2b" ] && ok "the same greedy tokens as $b asked directly" || bad "router $t2 vs direct $t2b"
[ "${c2b:-0}" -ge 352 ] && [ $((c2b % 16)) = 0 ] && ok "$b asked directly: the tenant's pages from Redis (cached_tokens $c2b)" ||
  bad "$b asked directly: cached_tokens $c2b (want the tenant's pages from Redis)"

# a chat's system prompt, then Anthropic's /v1/messages with the same one: the router's rendering of both is
# the replica's, so the second goes where the first was computed
sys=$(python3 -c "print(' '.join('w%d' % i for i in range(120)))")
chat() { # path body -> "<replica> <overlap>"
  curl -s -D "$tmp/h" -o "$tmp/r" -H "$auth" -H "Content-Type: application/json" "$url$1" -d "$2"
  local route; route=$(grep -i '^x-kvserve-route:' "$tmp/h" | tr -d '\r' | cut -d' ' -f2-)
  echo "$(cut -d';' -f1 <<<"$route") $(grep -o 'overlap=[0-9]*' <<<"$route" | cut -d= -f2)"
}
held=$(status | python3 -c "import json,sys; print(' '.join(str(r['pages_indexed']) for r in json.load(sys.stdin)['replicas']))")
read -r ca _ <<<"$(chat /v1/chat/completions "{\"messages\":[{\"role\":\"system\",\"content\":\"$sys\"},{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":2}")"
for _ in $(seq 50); do
  now=$(status | python3 -c "import json,sys; print(' '.join(str(r['pages_indexed']) for r in json.load(sys.stdin)['replicas']))")
  [ "$now" != "$held" ] && break
  sleep 0.1
done
same_replica_as_chat() { # path body label: routed where the chat was computed, reading its pages there
  local before after a o
  before=$(ram_hits "$ca")
  read -r a o <<<"$(chat "$1" "$2")"
  after=$(ram_hits "$ca")
  [ "$a" = "$ca" ] && [ "${o:-0}" -ge 10 ] && [ $((after - before)) -ge 320 ] &&
    ok "$3: the same replica, overlap $o pages, +$((after - before)) RAM hit tokens" ||
    { bad "$1 went to $a (overlap $o), the chat to $ca"; cat "$tmp/r"; }
}
same_replica_as_chat /v1/messages "{\"system\":\"$sys\",\"messages\":[{\"role\":\"user\",\"content\":\"hello\"}],\"max_tokens\":2}" \
  "/v1/messages after a chat with its system prompt"
same_replica_as_chat /v1/responses "{\"instructions\":\"$sys\",\"input\":\"hey\",\"max_output_tokens\":2}" \
  "/v1/responses after it"

code=$(curl -s -o /dev/null -w '%{http_code}' -H "Content-Type: application/json" "$url/v1/completions" -d '{"prompt":"hi"}')
[ "$code" = 401 ] && ok "without the key: the replica's 401 passes through" || bad "without the key: $code"
curl -sN -H "$auth" -H "Content-Type: application/json" "$url/v1/completions" \
  -d '{"prompt":"hello","max_tokens":4,"stream":true,"ignore_eos":true}' >"$tmp/sse"
[ "$(grep -c '^data: {' "$tmp/sse")" -ge 2 ] && grep -q '^data: \[DONE\]' "$tmp/sse" && ok "SSE passes through" ||
  { bad "SSE through the router"; cat "$tmp/sse"; }

# a router started late reads the stream from its start: it knows at once where the prefix is
redis=$(grep -o 'redis://127.0.0.1:[0-9]*' "$tmp/log" | head -1)
late_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
reps=()
for p in $(grep -ho 'on http://127.0.0.1:[0-9]*' "$dir"/replica*.log | cut -d' ' -f2); do reps+=(--replica "$p"); done
"$bin" route --listen "127.0.0.1:$late_port" -m "$model" --cache-redis "$redis" "${reps[@]}" "${salted[@]}" \
  2>"$tmp/late.log" &
late=$!
for _ in $(seq 50); do # its index filled from the stream's past entries
  curl -s "http://127.0.0.1:$late_port/route/status" 2>/dev/null | python3 -c "import json,sys
sys.exit(0 if [r for r in json.load(sys.stdin)['replicas'] if r['url']=='$a' and r['pages_indexed'] >= 12] else 1)" \
    2>/dev/null && break
  sleep 0.1
done
read -r la lo _ _ <<<"$(complete "http://127.0.0.1:$late_port" 4)"
kill $late
wait $late 2>/dev/null
[ "$la" = "$a" ] && [ "${lo:-0}" -ge 12 ] && ok "a router started late: the stream's past gives it the index; the prefix goes to $la (overlap $lo)" ||
  { bad "the late router sent the prefix to $la (overlap $lo), not $a"; cat "$tmp/late.log"; }
# without the replicas' secret a router cannot compute the tenants' keys
"$bin" route --listen "127.0.0.1:$late_port" -m "$model" --cache-redis "$redis" "${reps[@]}" 2>"$tmp/late.log" &
late=$!
for _ in $(seq 50); do curl -sf "http://127.0.0.1:$late_port/health" >/dev/null && break; sleep 0.1; done
sleep 0.3 # its index filled
read -r _ lo _ _ <<<"$(complete "http://127.0.0.1:$late_port" 5)"
kill $late
wait $late 2>/dev/null
[ "${lo:-0}" = 0 ] && ok "a router without --cache-salt-from-key sees no overlap in the tenant's keys" ||
  bad "a router without the tenant key found overlap $lo"

read -r _ _ _ t3 <<<"$(complete "$a" 3)" # the reference, from the replica about to die
apid=
for p in $(pgrep -x kvserve); do
  for i in 1 2; do
    [ "$(readlink "/proc/$p/fd/2")" = "$dir/replica$i.log" ] && grep -q "on $a" "$dir/replica$i.log" && apid=$p
  done
done
[ -n "$apid" ] && kill -KILL "$apid" && ok "killed $a (SIGKILL)" || bad "no pid for $a"
read -r a3 _ _ t3r <<<"$(complete "$url" 3)"
[ "$a3" = "$b" ] && [ -n "$t3" ] && [ "$t3r" = "$t3" ] && ok "after the kill: answered by $b, the same tokens" ||
  bad "after the kill: replica '$a3', text '$t3r' vs '$t3'"
for _ in $(seq 30); do # at once if the router tried it, else at the next health check (1 s)
  healthy=$(status | python3 -c "import json,sys; print([r['healthy'] for r in json.load(sys.stdin)['replicas'] if r['url']=='$a'][0])")
  [ "$healthy" = False ] && break
  sleep 0.1
done
[ "$healthy" = False ] && ok "/route/status: $a is down" || bad "/route/status says $a healthy: $healthy"

kill -INT -$cpid
for _ in $(seq 100); do kill -0 $cpid 2>/dev/null || break; sleep 0.1; done
kill -0 $cpid 2>/dev/null && bad "cluster.sh still running after Ctrl-C" || ok "cluster.sh -r exited on Ctrl-C"
curl -s -m 1 "$url/health" >/dev/null && bad "the router still answers" || ok "the router stopped"
exit $fail
