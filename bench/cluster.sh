#!/usr/bin/env bash
# Two replicas behind HAProxy (deploy/haproxy.cfg's settings, no routing header: round robin), a shared
# system prompt and clients with distinct suffixes arriving over time (bench_serve, Poisson arrivals),
# in these set-ups, each on replicas started fresh (empty RAM, no SSD tier):
#   redis       - 2 kvserve replicas sharing pages through a redis-server (--cache-redis), Redis empty too:
#                 the tier saves only the second replica's first computation of the prefix (each replica's
#                 RAM prefix cache, with in-flight sharing, serves every later client of its own)
#   redis-warm  - the same replicas joining a fleet whose Redis already holds the prefix's pages (autoscaling,
#                 a rolling deploy, a restart after a crash): a warm-up replica serves the prefix once, its
#                 pages are written behind to Redis, it stops, then the 2 fresh replicas take the clients
#   route       - as redis, with KV events (--kv-events) and `kvserve route` in front instead of HAProxy
#                 (prefix affinity: each request to the replica holding most of its prompt, against its load)
#   route-warm  - route on a warm Redis, as redis-warm
#   local       - the same 2 fresh kvserve replicas, no shared tier (what redis-warm's replicas would compute)
#   llama       - 2 fresh llama-server replicas (the anchor's) behind the same HAProxy
# Prints one markdown table: TTFT p50/p99, total time (the whole run of the clients), the cached prompt
# tokens the responses reported (usage.prompt_tokens_details.cached_tokens, summed), where the replicas'
# prompt tokens came from (their kvserve_prefix_* counters: RAM hits / taken from a concurrent prefill /
# Redis hits / computed), the bytes read from and written to Redis (kvserve_redis_{read,write}_bytes_total),
# the Redis lookups with their round trips, and how many greedy outputs equal those of the first kvserve
# set-up run (the same model and prompts must give the same tokens whatever tier served the prefix).
#
#   bench/cluster.sh BIN MODEL [redis redis-warm route route-warm local llama]
#
# BIN is build/kvserve (bench_serve is taken from beside it); llama-server from ANCHOR (default
# $KVSERVE_SHARED/anchor/bin, else ../shared/anchor/bin). Default set-ups: redis redis-warm route local llama.
# Env: THREADS per replica (1), CLIENTS (32), PREFIX (2000), SUFFIX (32), GEN (32), RATE requests/s (1),
# RATES (a list, e.g. "1 2 4": every set-up at each rate, one table; default RATE), PARALLEL slots per
# replica (16), CTX (4096), SEED (1). Prompts are token ids, so the model's vocabulary
# needs 356 ids or more. The tier pays when computing the prefix costs more than reading its pages: use a
# model whose 2,000-token prefill takes seconds on THREADS, e.g. `kvserve synth --preset smollm2-135m --type
# q8_0 -o /tmp/smollm2-q8_0.gguf` (~8 s on one thread of a 2-core Xeon; each kvserve set-up then takes about a
# minute, llama ~8: llama-server computes the prefix again in each of its slots). RATE 1 keeps two one-thread
# replicas of that model out of saturation once the prefix is cached, so the TTFTs measure the tier, not a
# queue; but at 1/s only the clients arriving during a fresh replica's ~8 s prefix wait for it, so the p50 is a
# cached request with or without the tier. A fleet scales out under load: RATES="1 2 4" shows the tier's
# gain as more clients meet a cold replica (the summary lines give each rate's p50/p99 ratios). Needs redis-server, redis-cli, haproxy, curl, python3. Run on a quiet machine.
set -euo pipefail
usage() { sed -n '2,38p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 2 ] || usage
bin=$1 model=$2; shift 2
[ -x "$bin" ] && [ -f "$model" ] || usage
setups=("$@")
[ ${#setups[@]} -gt 0 ] || setups=(redis redis-warm route local llama)
for s in "${setups[@]}"; do
  case $s in redis|redis-warm|route|route-warm|local|llama) ;;
    *) echo "unknown set-up $s (redis, redis-warm, route, route-warm, local, llama)" >&2; exit 2 ;; esac
done
here=$(cd "$(dirname "$0")/.." && pwd)
bench=$(dirname "$bin")/bench_serve
[ -x "$bench" ] || { echo "bench/cluster.sh: no $bench (cmake --build build --target bench_serve)" >&2; exit 1; }
anchor=${ANCHOR:-${KVSERVE_SHARED:-$here/../shared}/anchor/bin}
THREADS=${THREADS:-1} CLIENTS=${CLIENTS:-32} PREFIX=${PREFIX:-2000} SUFFIX=${SUFFIX:-32} GEN=${GEN:-32}
RATE=${RATE:-1} RATES=${RATES:-${RATE:-1}} PARALLEL=${PARALLEL:-16} CTX=${CTX:-4096} SEED=${SEED:-1}
for c in redis-server redis-cli haproxy curl python3; do
  command -v $c >/dev/null || { echo "bench/cluster.sh: $c is not installed (scripts/deps.sh)" >&2; exit 1; }
done
tmp=$(mktemp -d)
pids=()
stop_all() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
}
trap 'stop_all; rm -rf "$tmp"' EXIT
# shellcheck source=bench/servers.sh
. "$here/bench/servers.sh"
cpu

start_replica() { # kvserve|llama n [kvserve flags...]: appends its port to ports[], its pid to pids[]
  local kind=$1 n=$2; shift 2
  local p; p=$(free_port)
  if [ "$kind" = llama ]; then
    "$anchor/llama-server" -m "$model" --port "$p" -t "$THREADS" -np "$PARALLEL" -c $((CTX * PARALLEL)) --metrics \
      >"$tmp/replica$n.log" 2>&1 &
  else
    "$bin" serve -m "$model" --port "$p" -t "$THREADS" --parallel "$PARALLEL" -c "$CTX" "$@" 2>"$tmp/replica$n.log" &
  fi
  pid=$!
  pids+=("$pid")
  for _ in $(seq 1200); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$p/health")" = 200 ] && break
    kill -0 "$pid" 2>/dev/null || { echo "replica $n ($kind) exited:"; tail -20 "$tmp/replica$n.log"; exit 1; }
    sleep 0.1
  done
  ports+=("$p")
}

start_haproxy() { # -> sets url
  local p; p=$(free_port)
  {
    sed -n '/^global/,/^backend kvserve/p' "$here/deploy/haproxy.cfg" | sed "s/^    bind :8080/    bind 127.0.0.1:$p/"
    sed -n '/^backend kvserve/,$p' "$here/deploy/haproxy.cfg" | sed '1d' | grep -v '^    server '
    local i=0
    for rp in "${ports[@]}"; do i=$((i + 1)); echo "    server replica$i 127.0.0.1:$rp"; done
  } >"$tmp/haproxy.cfg"
  haproxy -W -db -f "$tmp/haproxy.cfg" >"$tmp/haproxy.log" 2>&1 &
  pids+=($!)
  url=http://127.0.0.1:$p
  for _ in $(seq 100); do curl -sf "$url/health" >/dev/null && return 0; sleep 0.1; done
  echo "haproxy did not start"; cat "$tmp/haproxy.log"; exit 1
}

start_router() { # kvserve route over ports[], with the replicas' Redis $1 -> sets url
  local p; p=$(free_port)
  local reps=() rp
  for rp in "${ports[@]}"; do reps+=(--replica "http://127.0.0.1:$rp"); done
  "$bin" route --listen "127.0.0.1:$p" -m "$model" --cache-redis "$1" "${reps[@]}" 2>"$tmp/route.log" &
  pids+=($!)
  url=http://127.0.0.1:$p
  for _ in $(seq 100); do curl -sf "$url/health" >/dev/null && return 0; sleep 0.1; done
  echo "kvserve route did not start"; cat "$tmp/route.log"; exit 1
}

start_redis() { # -> sets redis_url
  local rp; rp=$(free_port)
  redis-server --port "$rp" --bind 127.0.0.1 --save '' --appendonly no --dir "$tmp" \
    --maxmemory 2gb --maxmemory-policy allkeys-lru >"$tmp/redis.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do redis-cli -p "$rp" ping 2>/dev/null | grep -q PONG && break; sleep 0.05; done
  redis_url=redis://127.0.0.1:$rp
}

replica_counts() { # the kvserve replicas' sums: "<Redis bytes read> <written> <lookups> <round trips>
                   #  <prompt tokens: RAM hits> <shared from a concurrent prefill> <Redis hits> <missed at lookup>"
  local p
  for p in "${ports[@]}"; do curl -s "http://127.0.0.1:$p/metrics"; done | awk '
    $1 == "kvserve_redis_read_bytes_total" { r += $2 } $1 == "kvserve_redis_write_bytes_total" { w += $2 }
    $1 == "kvserve_redis_lookups_total" { l += $2 } $1 == "kvserve_redis_round_trips_total" { t += $2 }
    $1 == "kvserve_prefix_hit_tokens_total{tier=\"ram\"}" { ram += $2 }
    $1 == "kvserve_prefix_hit_tokens_total{tier=\"redis\"}" { red += $2 }
    $1 == "kvserve_prefix_shared_tokens_total" { sh += $2 } $1 == "kvserve_prefix_miss_tokens_total" { miss += $2 }
    END { printf "%.0f %.0f %.0f %.0f %.0f %.0f %.0f %.0f\n", r, w, l, t, ram, sh, red, miss }'
}

metric_of() { # port name -> value (0 if absent)
  curl -s "http://127.0.0.1:$1/metrics" | awk -v n="$2" '$1 == n { v = $2 } END { printf "%.0f\n", v + 0 }'
}

# A fleet's Redis that already holds the shared prefix: one kvserve replica with the tier serves it once
# (PREFIX + 1 prompt tokens, so every page of the prefix is full and cacheable), the test waits until
# its writer has put those pages in Redis, then stops it. Appends a line to $tmp/notes.
warm_tier() { # kvserve flags...
  local t0 wport wpid want done_pages=0 pt
  t0=$(now)
  start_replica kvserve 0 "$@"
  wport=${ports[-1]} wpid=$pid
  ports=()
  "$bench" --url "http://127.0.0.1:$wport" --clients 1 --requests 1 --prompt-len $((PREFIX + 1)) \
    --shared-prefix "$PREFIX" --gen-len 1 --seed "$SEED" >"$tmp/warm.log" 2>&1 ||
    { echo "the warm-up request failed:"; cat "$tmp/warm.log"; exit 1; }
  pt=$(curl -s "http://127.0.0.1:$wport/cache/usage" | python3 -c 'import json, sys; print(json.load(sys.stdin)["page_tokens"])')
  want=$((PREFIX / pt))
  for _ in $(seq 300); do
    done_pages=$(($(metric_of "$wport" kvserve_redis_writes_total) + $(metric_of "$wport" kvserve_redis_deduplicated_total)))
    [ "$done_pages" -ge "$want" ] && break
    sleep 0.1
  done
  [ "$done_pages" -ge "$want" ] || echo "warning: the warm-up replica wrote $done_pages of the prefix's $want pages" >&2
  printf -- '- %s: a warm-up replica computed the prefix and wrote %s pages (%.1f MiB) to Redis in %.1f s before the 2 fresh replicas started\n' \
    "$setup at $RATE/s" "$done_pages" "$(awk -v b="$(metric_of "$wport" kvserve_redis_write_bytes_total)" 'BEGIN { print b / 1048576 }')" \
    "$(awk -v a="$t0" -v b="$(now)" 'BEGIN { print b - a }')" >>"$tmp/notes"
  kill -TERM "$wpid"
  wait "$wpid" 2>/dev/null || true
  local keep=() p
  for p in "${pids[@]}"; do [ "$p" = "$wpid" ] || keep+=("$p"); done
  pids=("${keep[@]}")
}

# How many of this set-up's greedy outputs equal the reference set-up's ($ref, the first kvserve one).
same_text() { # setup
  if [ "$1" = llama ]; then echo "-"; elif [ "$1" = "$ref" ]; then echo "(reference)"; else
    awk '{ i = $1; sub(/^[^ ]* [^ ]* /, "") } NR == FNR { t[i] = $0; next } { n++; same += ($0 == t[i]) }
         END { printf "%d/%d\n", same, n }' "$tmp/out.$ref.$RATE" "$tmp/out.$1.$RATE"
  fi
}

run_setup() { # setup -> one table row
  local setup=$1 base=${1%-warm} flags=()
  ports=()
  if [ "$base" = redis ] || [ "$base" = route ]; then
    start_redis
    flags=(--cache-redis "$redis_url")
    [ "$base" = route ] && flags+=(--kv-events)
    [ "$base" != "$setup" ] && warm_tier "${flags[@]}"
  fi
  local kind=kvserve
  [ "$setup" = llama ] && kind=llama
  start_replica $kind 1 "${flags[@]}"
  start_replica $kind 2 "${flags[@]}"
  if [ "$base" = route ]; then start_router "$redis_url"; else start_haproxy; fi
  local t0 t1
  t0=$(now)
  "$bench" --url "$url" --clients "$CLIENTS" --requests "$CLIENTS" --prompt-len $((PREFIX + SUFFIX)) \
    --shared-prefix "$PREFIX" --gen-len "$GEN" --rate "$RATE" --seed "$SEED" --out "$tmp/out.$setup.$RATE" \
    >"$tmp/bench.$setup.$RATE" 2>&1 || true
  grep -q '^| [0-9]' "$tmp/bench.$setup.$RATE" || { echo "bench_serve failed on $setup:"; cat "$tmp/bench.$setup.$RATE"; exit 1; }
  grep -h '^bench_serve: ' "$tmp/bench.$setup.$RATE" | sed "s/^/- $setup: /" >>"$tmp/notes" || true
  t1=$(now)
  local counts="- - - - - - - -"
  [ "$kind" = kvserve ] && counts=$(replica_counts)
  local cached; cached=$(awk '$2 >= 0 { c += $2; n++ } END { if (n) printf "%d", c; else printf "-" }' "$tmp/out.$setup.$RATE")
  # the bench_serve row: | clients | prompt | gen | prefix | rate | done | TTFT p50 | TTFT p99 | ...
  awk -F'|' -v s="$setup" -v rate="$RATE" -v t="$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }')" -v c="$counts" \
    -v cached="$cached" -v same="$(same_text "$setup")" '
    function mib(x) { return x == "-" ? "-" : sprintf("%.1f", x / 1048576) }
    BEGIN { split(c, n, " ") }
    /^\| [0-9]/ {
      src = n[5] == "-" ? "-" : sprintf("%d / %d / %d / %d", n[5], n[6], n[7], n[8] - n[6])
      trips = n[3] == "-" ? "-" : n[3] " / " n[4]
      gsub(/ /, "", $7); gsub(/ /, "", $8); gsub(/ /, "", $9)
      printf "| %s | %s | %s | %s | %s | %.1f | %s | %s | %s | %s | %s | %s |\n", s, rate, $7, $8, $9, t, cached, src,
             mib(n[1]), mib(n[2]), trips, same; exit }' "$tmp/bench.$setup.$RATE" | tee -a "$tmp/rows"
  stop_all
}

if [[ " ${setups[*]} " == *" llama "* ]]; then anchor_mirror; fi
: >"$tmp/notes"
echo "2 replicas x $THREADS threads, $CLIENTS clients, Poisson arrivals at ${RATES// /, } requests/s, $PREFIX shared + $SUFFIX own tokens, $GEN generated"
echo
ref=
for s in "${setups[@]}"; do [ "$s" = llama ] || { ref=$s; break; }; done
echo "| set-up | rate/s | done | TTFT p50 ms | TTFT p99 ms | total s | cached tokens (responses) | prompt tokens: RAM / in-flight / Redis / computed | MiB read from Redis | MiB written to Redis | lookups / round trips | greedy = ${ref:--} |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
: >"$tmp/rows"
for RATE in $RATES; do
  for setup in "${setups[@]}"; do run_setup "$setup"; done
done
# Each rate's TTFT ratios of every set-up against redis-warm (or the first kvserve set-up).
awk -F'|' -v ref="$ref" '
  { gsub(/ /, ""); s = $2; r = $3; p50[s, r] = $5; p99[s, r] = $6; if (!(r in seen)) { seen[r] = 1; rates[++nr] = r }
    if (!(s in known)) { known[s] = 1; names[++ns] = s } }
  END {
    base = ("redis-warm", rates[1]) in p50 ? "redis-warm" : ref
    for (i = 1; i <= nr; i++) {
      r = rates[i]; line = ""
      for (j = 1; j <= ns; j++) {
        s = names[j]
        if (s == base || !((s, r) in p50) || p50[base, r] + 0 <= 0) continue
        line = line sprintf("%s %.2fx / %.2fx; ", s, p50[s, r] / p50[base, r], p99[s, r] / p99[base, r])
      }
      if (line != "") printf "- at %s/s, TTFT p50 / p99 of each set-up over %s'"'"'s: %s\n", r, base, substr(line, 1, length(line) - 2)
    }
  }' "$tmp/rows" >"$tmp/ratios"
if [ -s "$tmp/ratios" ]; then echo; cat "$tmp/ratios"; fi
if [ -s "$tmp/notes" ]; then echo; cat "$tmp/notes"; fi
