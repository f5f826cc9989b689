#!/usr/bin/env bash
# scripts/cluster.sh end to end: redis-server, two replicas and HAProxy on
# loopback; requests through HAProxy with one X-Prefix-Key stick to one replica
# (a RAM hit), another key may land on the other replica, which reads the
# pages from Redis; the answers never change; Ctrl-C (SIGINT to the process
# group, as a terminal sends it) stops every process the script started.
set -u
bin=${KVSERVE_BIN:?}
src=${KVSERVE_SOURCE:?}
model=$(dirname "$bin")/default-model.gguf
[ -f "$model" ] || { echo "skipped: $model not found (the build makes it)"; exit 77; }
for c in redis-server redis-cli haproxy curl python3; do
  command -v $c >/dev/null || { echo "skipped: $c not installed (scripts/deps.sh installs it)"; exit 77; }
done
tmp=$(mktemp -d)
fail=0
ok() { echo "ok   $*"; }
bad() { echo "FAIL $*"; fail=1; }
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
set -m # the script gets its own process group, with SIGINT not ignored, as in a terminal
KVSERVE_BIN=$bin "$src/scripts/cluster.sh" -n 2 -p "$port" -m "$model" -- -c 1024 -t 1 --parallel 2 >"$tmp/log" 2>&1 &
cpid=$!
set +m
trap 'kill -INT -$cpid 2>/dev/null; sleep 1; rm -rf "$tmp"' EXIT
for _ in $(seq 300); do grep -q 'ready at' "$tmp/log" && break; sleep 0.1; done
grep -q "ready at http://127.0.0.1:$port" "$tmp/log" && ok "$(grep -o 'ready at [^ ]*' "$tmp/log")" ||
  { bad "cluster.sh did not start"; cat "$tmp/log"; exit 1; }
dir=$(grep -o '/tmp/kvserve-cluster-[A-Za-z0-9]*' "$tmp/log" | head -1)

ids=$(python3 -c "print(','.join(str(3+(i*11)%500) for i in range(400)))")
complete() { # prefix-key -> "<cached_tokens> <text>"
  local r; r=$(curl -s -H "X-Prefix-Key: $1" -H "Content-Type: application/json" "http://127.0.0.1:$port/v1/completions" \
    -d "{\"prompt\":[$ids],\"max_tokens\":8,\"temperature\":0,\"ignore_eos\":true}")
  printf '%s %s\n' "$(grep -o '"cached_tokens":[0-9]*' <<<"$r" | cut -d: -f2)" \
    "$(grep -oE '"text":"([^"\\]|\\.)*"' <<<"$r" | head -1 | cut -d: -f2-)"
}
read -r c t0 <<<"$(complete system-a)"
[ "$c" = 0 ] && [ -n "$t0" ] && [ "$t0" != '""' ] && ok "through HAProxy: cold" || bad "cold: cached $c text $t0"
sleep 0.3
read -r c t <<<"$(complete system-a)"
[ "$c" -ge 360 ] && [ "$t" = "$t0" ] && ok "same key, same replica: cached_tokens $c, same tokens" ||
  bad "same key: cached $c, $t vs $t0"
good=0
for k in b c d e f g h; do # keys hashed to both replicas: from RAM or from Redis, always >= 90%
  read -r c t <<<"$(complete "system-$k")"
  [ "$c" -ge 360 ] && [ "$t" = "$t0" ] && good=$((good + 1)) || bad "key system-$k: cached $c, $t vs $t0"
done
[ $good = 7 ] && ok "7 other keys: >= 360 of 400 tokens cached (RAM or Redis), same tokens"
hits=0
for p in $(grep -o 'replica[0-9] 127.0.0.1:[0-9]*' "$dir/haproxy.cfg" | cut -d: -f2); do
  h=$(curl -s "http://127.0.0.1:$p/cache/usage" | python3 -c "import json,sys; print(json.load(sys.stdin)['redis']['hits'])")
  hits=$((hits + h))
done
[ $hits -ge 1 ] && ok "Redis hits on the replicas: $hits" || bad "no replica read from Redis (the keys all hashed to one?)"
best=0
for p in $(grep -o 'replica[0-9] 127.0.0.1:[0-9]*' "$dir/haproxy.cfg" | cut -d: -f2); do # prefix affinity
  h=$(curl -s "http://127.0.0.1:$p/cache/prefixes?tokens=$ids" | python3 -c "import json,sys; print(json.load(sys.stdin)['ram_pages'])")
  [ "$h" -gt $best ] && best=$h
done
[ $best = 12 ] && ok "GET /cache/prefixes?tokens=...: a replica holds all 12 pages in RAM" || bad "prefix affinity: best $best of 12 pages"

kill -INT -$cpid
for _ in $(seq 100); do kill -0 $cpid 2>/dev/null || break; sleep 0.1; done
kill -0 $cpid 2>/dev/null && bad "cluster.sh still running after Ctrl-C" || ok "cluster.sh exited on Ctrl-C"
left=$(pgrep -f "$dir" | wc -l)
curl -s -m 1 "http://127.0.0.1:$port/health" >/dev/null && bad "HAProxy still answers" || ok "HAProxy stopped"
[ "$left" = 0 ] && ok "no process of the cluster left" || bad "$left processes of the cluster left"
exit $fail
