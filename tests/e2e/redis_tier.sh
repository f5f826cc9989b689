#!/usr/bin/env bash
# The shared Redis tier through a real redis-server and two `kvserve serve`
# replicas on the built-in model: a long prompt served by A is served by B
# with >= 90% of it read from Redis and the same greedy tokens, in one round
# trip per lookup; a salted prompt is shared with the same salt only; then the
# faults, each ending with the same answers as a healthy run: a corrupt and a
# foreign value, Redis killed (and a replica started while it is down),
# restarted, stalled (SIGSTOP: every call times out), and full (noeviction:
# OOM on SET; allkeys-lru: holes in chains). Each fault is counted in
# /cache/usage and logged once.
set -u
bin=${KVSERVE_BIN:?}
model=$(dirname "$bin")/default-model.gguf
[ -f "$model" ] || { echo "skipped: $model not found (the build makes it)"; exit 77; }
for c in redis-server redis-cli curl python3; do
  command -v $c >/dev/null || { echo "skipped: $c not installed (scripts/deps.sh installs it)"; exit 77; }
done
tmp=$(mktemp -d)
pids=()
redis_pid=
cleanup() {
  [ -n "$redis_pid" ] && kill -CONT $redis_pid 2>/dev/null && kill $redis_pid 2>/dev/null
  for p in "${pids[@]}"; do kill $p 2>/dev/null; done
  wait 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
fail=0
ok() { echo "ok   $*"; }
bad() { echo "FAIL $*"; fail=1; }

rport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
rcli() { redis-cli -p "$rport" "$@"; }
redis_start() { # extra redis-server options
  redis-server --port "$rport" --bind 127.0.0.1 --save '' --appendonly no --dir "$tmp" "$@" >"$tmp/redis.log" 2>&1 &
  redis_pid=$!
  for _ in $(seq 100); do rcli ping 2>/dev/null | grep -q PONG && return; sleep 0.05; done
  echo "redis-server did not start"; cat "$tmp/redis.log"; exit 1
}
redis_kill() { kill -9 $redis_pid; wait $redis_pid 2>/dev/null; redis_pid=; }

start() { # name -> sets url_<name>
  "$bin" serve -m "$model" --port 0 -c 1024 --parallel 2 -t 1 --cache-redis "redis://127.0.0.1:$rport" \
    --cache-redis-timeout 100 2>"$tmp/$1.log" &
  pids+=($!)
  local port=
  for _ in $(seq 200); do port=$(grep -o 'on http://127.0.0.1:[0-9]*' "$tmp/$1.log" | grep -o '[0-9]*$'); [ -n "$port" ] && break; sleep 0.1; done
  [ -n "$port" ] || { echo "server $1 did not start"; cat "$tmp/$1.log"; exit 1; }
  eval "url_$1=http://127.0.0.1:$port"
}
ids() { python3 -c "import sys; k=int(sys.argv[1]); print(','.join(str(3+(i*7+k*131+(i*i*k)%97)%500) for i in range(600)))" "$1"; }
complete() { # url prompt-number [extra JSON fields] -> prints "<cached_tokens> <text as JSON>"
  local r; r=$(curl -s -H "Content-Type: application/json" "$1/v1/completions" \
    -d "{\"prompt\":[$(ids "$2")],\"max_tokens\":8,\"temperature\":0,\"ignore_eos\":true${3:+,$3}}")
  printf '%s %s\n' "$(grep -o '"cached_tokens":[0-9]*' <<<"$r" | cut -d: -f2)" \
    "$(grep -oE '"text":"([^"\\]|\\.)*"' <<<"$r" | head -1 | cut -d: -f2-)"
}
redis_stat() { # url field
  curl -s "$1/cache/usage" | python3 -c "import json,sys; print(json.load(sys.stdin)['redis']['$2'])"
}
same() { # what expected got
  [ -n "$2" ] && [ "$2" != '""' ] && [ "$2" = "$3" ] && ok "$1: same tokens" || bad "$1: $3, want $2"
}
new_keys() { rcli --scan --pattern 'kvserve:*' | sort >"$tmp/keys.$1"; }

redis_start
start A
start B

# ---- sharing: A computes, B reads ----------------------------------------------
read -r c t1 <<<"$(complete "$url_A" 1)"
[ "$c" = 0 ] && ok "A cold: cached_tokens 0" || bad "A cold: cached_tokens $c"
sleep 0.3 # written behind
n=$(rcli dbsize)
[ "$n" -ge 18 ] && ok "A wrote $n pages to Redis" || bad "A wrote $n pages to Redis (want >= 18)"
looks=$(redis_stat "$url_B" lookups) trips=$(redis_stat "$url_B" round_trips)
read -r c t <<<"$(complete "$url_B" 1)"
[ "$c" -ge 540 ] && ok "B: cached_tokens $c of 600 from Redis" || bad "B: cached_tokens $c (want >= 540)"
looks=$(( $(redis_stat "$url_B" lookups) - looks )) trips=$(( $(redis_stat "$url_B" round_trips) - trips ))
[ "$looks" -ge 1 ] && [ "$trips" = "$looks" ] && ok "B: $looks lookups, $trips round trips" ||
  bad "B: $looks lookups took $trips round trips (want one each)"
same "B after A" "$t1" "$t"
[ "$(redis_stat "$url_B" hits)" -ge 17 ] && ok "B counted $(redis_stat "$url_B" hits) Redis hits" || bad "no Redis hits counted on B"
curl -s "$url_B/metrics" | grep -q '^kvserve_prefix_hit_tokens_total{tier="redis"} [1-9]' &&
  ok "metrics: redis hit tokens" || bad "kvserve_prefix_hit_tokens_total{tier=\"redis\"} not counted"

# ---- salted: shared with the same salt only -------------------------------------
read -r c ts <<<"$(complete "$url_A" 9 '"cache_salt":"tenant-a"')"
sleep 0.3
read -r c t <<<"$(complete "$url_B" 9 '"cache_salt":"tenant-b"')"
[ "$c" = 0 ] && ok "another salt on B: cached_tokens 0" || bad "another salt on B: cached_tokens $c"
same "another salt" "$ts" "$t"
read -r c t <<<"$(complete "$url_B" 9)"
[ "$c" = 0 ] && ok "no salt on B: cached_tokens 0" || bad "no salt on B: cached_tokens $c"
read -r c t <<<"$(complete "$url_B" 9 '"cache_salt":"tenant-a"')"
[ "$c" -ge 540 ] && [ $((c % 16)) = 0 ] && ok "the same salt on B: cached_tokens $c from Redis (whole pages)" ||
  bad "the same salt on B: cached_tokens $c (want >= 540, whole pages)"
same "the same salt on B" "$ts" "$t"

# ---- a corrupt value and a foreign one ------------------------------------------
new_keys before
read -r _ t2 <<<"$(complete "$url_A" 2)"
sleep 0.3
new_keys after
mapfile -t k2 < <(comm -13 "$tmp/keys.before" "$tmp/keys.after")
for k in "${k2[@]}"; do rcli set "$k" "garbage, not a page" KEEPTTL >/dev/null; done
read -r c t <<<"$(complete "$url_B" 2)"
same "B with ${#k2[@]} corrupt values" "$t2" "$t"
[ "$c" = 0 ] && ok "corrupt values not used (cached_tokens 0)" || bad "corrupt: cached_tokens $c"
[ "$(redis_stat "$url_B" corrupt)" -ge 1 ] && ok "corrupt counted" || bad "corrupt not counted"
sleep 0.3
left=0
for k in "${k2[@]}"; do [ "$(rcli get "$k")" = "garbage, not a page" ] && left=$((left + 1)); done
[ $left -lt ${#k2[@]} ] && ok "the corrupt value read was deleted and B wrote its page ($left of ${#k2[@]} left)" ||
  bad "every corrupt value is still there"

new_keys before
read -r _ t3 <<<"$(complete "$url_A" 3)"
sleep 0.3
new_keys after
mapfile -t k3 < <(comm -13 "$tmp/keys.before" "$tmp/keys.after")
# every page of prompt 3 now holds one sound page of prompt 3: under all but one name, foreign
rcli --raw get "${k3[3]}" | head -c -1 >"$tmp/page"
for k in "${k3[@]}"; do rcli -x set "$k" <"$tmp/page" >/dev/null; done
read -r c t <<<"$(complete "$url_B" 3)"
same "B with foreign values" "$t3" "$t"
[ "$(redis_stat "$url_B" foreign)" -ge 1 ] && ok "foreign counted (cached_tokens $c)" || bad "foreign not counted"
[ "$(grep -c 'damaged page' "$tmp/B.log")" = 1 ] && ok "corrupt logged once" || bad "corrupt logged $(grep -c 'damaged page' "$tmp/B.log") times"

# ---- killed mid-run, a replica started while it is down, restarted ----------------
read -r _ t4 <<<"$(complete "$url_A" 4)"
redis_kill
read -r c t <<<"$(complete "$url_B" 4)"
same "B with Redis killed" "$t4" "$t"
read -r c t <<<"$(complete "$url_A" 1)"
same "A with Redis killed (RAM hit $c)" "$t1" "$t"
start C
grep -q 'cannot connect' "$tmp/C.log" && ok "C started with Redis down: $(grep -o 'cannot connect[^;]*' "$tmp/C.log")" ||
  bad "C: no line saying Redis is down"
read -r c t <<<"$(complete "$url_C" 1)"
same "C with Redis down" "$t1" "$t"
[ "$(redis_stat "$url_B" connect_failures)$(redis_stat "$url_B" errors)" != 00 ] && ok "B counted the outage" ||
  bad "B did not count the outage"
redis_start
for _ in $(seq 40); do # the backoff is at most 5 s
  complete "$url_C" 5 >/dev/null
  [ "$(redis_stat "$url_C" reconnects)" -ge 1 ] && [ "$(rcli dbsize)" -ge 18 ] && break
  sleep 0.25
done
[ "$(redis_stat "$url_C" reconnects)" -ge 1 ] && ok "C reconnected, wrote $(rcli dbsize) pages" || bad "C did not reconnect"
read -r _ t5 <<<"$(complete "$url_C" 5)"
read -r c t <<<"$(complete "$url_B" 5)"
same "B after the restart" "$t5" "$t"
[ "$c" -ge 540 ] && ok "B after the restart: cached_tokens $c from Redis" || bad "B after the restart: cached_tokens $c"

# ---- stalled: every call times out ---------------------------------------------
read -r _ t6 <<<"$(complete "$url_A" 6)"
sleep 0.3
kill -STOP $redis_pid
read -r c t <<<"$(complete "$url_B" 6)"
same "B with Redis stalled" "$t6" "$t"
[ "$(redis_stat "$url_B" timeouts)" -ge 1 ] && ok "timeouts counted" || bad "timeouts not counted"
kill -CONT $redis_pid

# ---- full ----------------------------------------------------------------------
rcli flushall >/dev/null
rcli config set maxmemory 1 >/dev/null; rcli config set maxmemory-policy noeviction >/dev/null
read -r _ t7 <<<"$(complete "$url_A" 7)"
sleep 0.3
[ "$(redis_stat "$url_A" full)" -ge 1 ] && ok "OOM on SET counted as full" || bad "full not counted"
grep -q 'Redis is full' "$tmp/A.log" && ok "full logged" || bad "full not logged"
read -r c t <<<"$(complete "$url_B" 7)"
same "B with Redis full" "$t7" "$t"
rcli config set maxmemory 0 >/dev/null
used=$(rcli info memory | tr -d '\r' | grep '^used_memory:' | cut -d: -f2)
rcli config set maxmemory $((used + 600 * 1024)) >/dev/null; rcli config set maxmemory-policy allkeys-lru >/dev/null
read -r _ t8 <<<"$(complete "$url_A" 8)"
sleep 0.3
read -r c t <<<"$(complete "$url_B" 8)"
same "B with allkeys-lru evicting (cached_tokens $c)" "$t8" "$t"

for p in "${pids[@]}"; do kill -TERM $p; done
for p in "${pids[@]}"; do wait $p; rc=$?; [ $rc = 0 ] || bad "a replica exited with $rc"; done
pids=()
exit $fail
