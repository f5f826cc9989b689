#!/usr/bin/env bash
# A kvserve cluster on this machine, loopback only: one redis-server (the
# shared page tier), N `kvserve serve` replicas with --cache-redis, and
# HAProxy in front routing as deploy/haproxy.cfg does (X-Prefix-Key, else
# X-Session-Id, consistent hashing, GET /health checks). Prints the URL, then
# runs until Ctrl-C (or SIGTERM), which stops everything it started.
#
#   scripts/cluster.sh [-n REPLICAS] [-p PORT] [-m MODEL.gguf] [-r] [-- kvserve serve flags...]
#
# -r puts `kvserve route` in front instead of HAProxy: the replicas publish
# their KV events (--kv-events) and the router sends each request to the
# replica holding most of its prompt, against its load (no header needed).
# The replica flags that change a prompt's keys (--chat-template, -c,
# --spm-infill, --cache-salt-from-key with --cache-redis-secret-file) go to
# the router too.
#
# Defaults: 2 replicas, HAProxy on port 8080, build/default-model.gguf, each
# replica -t 2 --parallel 4 (override after --). Logs and the generated
# haproxy.cfg go to a temporary directory, printed at start and removed at exit
# (KEEP_LOGS=1 keeps it). Needs redis-server and haproxy (scripts/deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
n=2 port=8080 model=build/default-model.gguf front=haproxy
while [ $# -gt 0 ]; do
  case $1 in
    -n) n=$2; shift 2 ;;
    -p) port=$2; shift 2 ;;
    -m) model=$2; shift 2 ;;
    -r|--router) front=route; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "cluster.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
extra=("$@")
keyed=() # the replica flags the router needs to compute the replicas' keys
for ((i = 0; i < ${#extra[@]}; i++)); do
  case ${extra[i]} in
    --chat-template|-c|--ctx-size|--cache-redis-secret-file) keyed+=("${extra[i]}" "${extra[i + 1]:-}"); i=$((i + 1)) ;;
    --spm-infill|--cache-salt-from-key) keyed+=("${extra[i]}") ;;
  esac
done
bin=${KVSERVE_BIN:-build/kvserve}
[[ $n =~ ^[1-9][0-9]?$ ]] || { echo "cluster.sh: -n wants 1..99 replicas" >&2; exit 2; }
[ -x "$bin" ] || { echo "cluster.sh: no $bin; build first (cmake --build build --target kvserve)" >&2; exit 1; }
[ -f "$model" ] || { echo "cluster.sh: no model $model" >&2; exit 1; }
needs="redis-server redis-cli python3"
[ $front = haproxy ] && needs="$needs haproxy"
for c in $needs; do
  command -v $c >/dev/null || { echo "cluster.sh: $c is not installed; run scripts/deps.sh" >&2; exit 1; }
done

dir=$(mktemp -d /tmp/kvserve-cluster-XXXXXX)
pids=()
stop_all() {
  trap - INT TERM EXIT
  echo "cluster.sh: stopping ${#pids[@]} processes"
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  [ "${KEEP_LOGS:-}" = 1 ] && echo "cluster.sh: logs kept in $dir" || rm -rf "$dir"
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_for() { # what command...
  local what=$1; shift
  for _ in $(seq 300); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "cluster.sh: $what did not start; logs in $dir" >&2
  KEEP_LOGS=1
  exit 1
}

rport=$(free_port)
redis-server --port "$rport" --bind 127.0.0.1 --save '' --appendonly no --dir "$dir" \
  --maxmemory 1gb --maxmemory-policy allkeys-lru >"$dir/redis.log" 2>&1 &
pids+=($!)
wait_for "redis-server" redis-cli -p "$rport" ping

servers=() replicas=() events=()
[ $front = route ] && events=(--kv-events)
for i in $(seq "$n"); do
  "$bin" serve -m "$model" --host 127.0.0.1 --port 0 -t 2 --parallel 4 --cache-redis "redis://127.0.0.1:$rport" \
    "${events[@]}" "${extra[@]}" 2>"$dir/replica$i.log" &
  pids+=($!)
  wait_for "replica $i" grep -q 'on http://127.0.0.1:[0-9]' "$dir/replica$i.log"
  rp=$(grep -o 'on http://127.0.0.1:[0-9]*' "$dir/replica$i.log" | grep -o '[0-9]*$')
  servers+=("    server replica$i 127.0.0.1:$rp")
  replicas+=(--replica "http://127.0.0.1:$rp")
done

if [ $front = route ]; then
  "$bin" route --listen "127.0.0.1:$port" -m "$model" --cache-redis "redis://127.0.0.1:$rport" "${replicas[@]}" \
    "${keyed[@]}" 2>"$dir/route.log" &
  pids+=($!)
  wait_for "kvserve route on port $port" curl -sf "http://127.0.0.1:$port/health"
  echo "cluster.sh: redis://127.0.0.1:$rport, $n replicas, logs in $dir"
  echo "cluster.sh: ready at http://127.0.0.1:$port  (kvserve route: prefix affinity from KV events; Ctrl-C stops all)"
  wait -n "${pids[0]}" "${pids[-1]}" || true # redis or the router: a replica that dies is the router's to skip
  echo "cluster.sh: a process of the cluster exited; see $dir" >&2
  KEEP_LOGS=1
  exit 1
fi

# the routing of deploy/haproxy.cfg, with this machine's ports
{
  sed -n '/^global/,/^backend kvserve/p' deploy/haproxy.cfg | sed "s/^    bind :8080/    bind 127.0.0.1:$port/"
  sed -n '/^backend kvserve/,$p' deploy/haproxy.cfg | sed '1d' | grep -v '^    server '
  printf '%s\n' "${servers[@]}"
} >"$dir/haproxy.cfg"
haproxy -W -db -f "$dir/haproxy.cfg" >"$dir/haproxy.log" 2>&1 &
pids+=($!)
wait_for "haproxy on port $port" curl -sf "http://127.0.0.1:$port/health"

echo "cluster.sh: redis://127.0.0.1:$rport, $n replicas, logs in $dir"
echo "cluster.sh: ready at http://127.0.0.1:$port  (route with X-Prefix-Key or X-Session-Id; Ctrl-C stops all)"
wait -n "${pids[@]}" || true
echo "cluster.sh: a process of the cluster exited; see $dir" >&2
KEEP_LOGS=1
exit 1
