#!/usr/bin/env bash
# Two replicas behind HAProxy (deploy/haproxy.cfg's settings, no routing header: round robin), a shared
# system prompt and clients with distinct suffixes arriving over time (bench_serve, Poisson arrivals),
# in four set-ups, each started fresh (cold caches):
#   redis  - 2 kvserve replicas sharing pages through a redis-server (--cache-redis)
#   route  - the same, with KV events (--kv-events) and `kvserve route` in front instead of HAProxy
#            (prefix affinity: each request to the replica holding most of its prompt, against its load)
#   local  - the same 2 kvserve replicas, no shared tier
#   llama  - 2 llama-server replicas (the anchor's) behind the same HAProxy
# Prints one markdown table: TTFT p50/p99, total time (the whole run of the clients), and the bytes moved:
# read from and written to Redis by the replicas (their kvserve_redis_{read,write}_bytes_total), and the
# Redis lookups with their round trips (one each).
#
#   bench/cluster.sh BIN MODEL [redis route local llama]
#
# BIN is build/kvserve (bench_serve is taken from beside it); llama-server from ANCHOR (default
# $KVSERVE_SHARED/anchor/bin, else ../shared/anchor/bin). Env: THREADS per replica (1), CLIENTS (32), PREFIX (2000), SUFFIX (32), GEN (32),
# RATE requests/s (2), PARALLEL slots per replica (16), CTX (4096). Prompts are token ids, so the model's
# vocabulary needs 356 ids or more. Needs redis-server, haproxy, curl, python3. Run on a quiet machine.
set -euo pipefail
usage() { sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 2 ] || usage
bin=$1 model=$2; shift 2
[ -x "$bin" ] && [ -f "$model" ] || usage
setups=("$@")
[ ${#setups[@]} -gt 0 ] || setups=(redis route local llama)
here=$(cd "$(dirname "$0")/.." && pwd)
bench=$(dirname "$bin")/bench_serve
[ -x "$bench" ] || { echo "bench/cluster.sh: no $bench (cmake --build build --target bench_serve)" >&2; exit 1; }
anchor=${ANCHOR:-${KVSERVE_SHARED:-$here/../shared}/anchor/bin}
THREADS=${THREADS:-1} CLIENTS=${CLIENTS:-32} PREFIX=${PREFIX:-2000} SUFFIX=${SUFFIX:-32} GEN=${GEN:-32}
RATE=${RATE:-2} PARALLEL=${PARALLEL:-16} CTX=${CTX:-4096}
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

start_replica() { # kvserve|llama n [kvserve flags...]: appends its port to ports[]
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

redis_counts() { # the replicas' sums: "<bytes read> <bytes written> <lookups> <round trips>"
  local p
  for p in "${ports[@]}"; do curl -s "http://127.0.0.1:$p/metrics"; done | awk '
    $1 == "kvserve_redis_read_bytes_total" { r += $2 } $1 == "kvserve_redis_write_bytes_total" { w += $2 }
    $1 == "kvserve_redis_lookups_total" { l += $2 } $1 == "kvserve_redis_round_trips_total" { t += $2 }
    END { printf "%.0f %.0f %.0f %.0f\n", r, w, l, t }'
}

run_setup() { # setup -> one table row
  local setup=$1 flags=()
  ports=()
  if [ "$setup" = redis ] || [ "$setup" = route ]; then
    local rp; rp=$(free_port)
    redis-server --port "$rp" --bind 127.0.0.1 --save '' --appendonly no --dir "$tmp" \
      --maxmemory 2gb --maxmemory-policy allkeys-lru >"$tmp/redis.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 100); do redis-cli -p "$rp" ping 2>/dev/null | grep -q PONG && break; sleep 0.05; done
    flags=(--cache-redis "redis://127.0.0.1:$rp")
    [ "$setup" = route ] && flags+=(--kv-events)
  fi
  local kind=kvserve
  [ "$setup" = llama ] && kind=llama
  start_replica $kind 1 "${flags[@]}"
  start_replica $kind 2 "${flags[@]}"
  if [ "$setup" = route ]; then start_router "${flags[1]}"; else start_haproxy; fi
  local t0 t1
  t0=$(now)
  "$bench" --url "$url" --clients "$CLIENTS" --requests "$CLIENTS" --prompt-len $((PREFIX + SUFFIX)) \
    --shared-prefix "$PREFIX" --gen-len "$GEN" --rate "$RATE" >"$tmp/bench.$setup" 2>&1 ||
    { echo "bench_serve failed on $setup:"; cat "$tmp/bench.$setup"; exit 1; }
  t1=$(now)
  local counts="0 0 0 0"
  if [ "$setup" = redis ] || [ "$setup" = route ]; then counts=$(redis_counts); fi
  # the bench_serve row: | clients | prompt | gen | prefix | rate | done | TTFT p50 | TTFT p99 | ...
  awk -F'|' -v s="$setup" -v t="$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }')" -v c="$counts" \
    'BEGIN { split(c, n, " ") }
     /^\| [0-9]/ { printf "| %s | %s | %s | %s | %.1f | %.1f | %.1f | %d / %d |\n", s, $7, $8, $9, t, n[1] / 1048576,
                   n[2] / 1048576, n[3], n[4]; exit }' "$tmp/bench.$setup"
  stop_all
}

if [[ " ${setups[*]} " == *" llama "* ]]; then anchor_mirror; fi
echo "2 replicas x $THREADS threads, $CLIENTS clients at $RATE/s, $PREFIX shared + $SUFFIX own tokens, $GEN generated"
echo
echo "| set-up | done | TTFT p50 ms | TTFT p99 ms | total s | MiB read from Redis | MiB written to Redis | lookups / round trips |"
echo "|---|---|---|---|---|---|---|---|"
for s in "${setups[@]}"; do
  case $s in redis|route|local|llama) run_setup "$s" ;; *) echo "unknown set-up $s (redis, route, local, llama)" >&2; exit 2 ;; esac
done
