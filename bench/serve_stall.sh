#!/usr/bin/env bash
# A 6000-token prompt arriving while 8 streams decode: compare the streams'
# inter-token latency with and without it. Usage:
#   bench/serve_stall.sh KVSERVE_BIN MODEL.gguf [extra serve flags...]
# Prints two bench-serve tables: steady state, then the same load with the
# long prompt sent 2 s in. The ratio to read: worst stall (2nd) / ITL p50 (1st).
set -eu
bin=$1 model=$2; shift 2
log=$(mktemp)
nice "$bin" serve -m "$model" --port 0 -c 8192 "$@" 2>"$log" &
pid=$!
trap 'kill $pid 2>/dev/null; rm -f "$log"' EXIT
for _ in $(seq 200); do port=$(grep -o '127.0.0.1:[0-9]*' "$log" | cut -d: -f2 || true); [ -n "$port" ] && break; sleep 0.1; done
url=http://127.0.0.1:$port
"$bin" bench-serve --url "$url" --clients 8 --prompt-len 64 --gen-len 16 >/dev/null  # warm up the cost model
echo "steady state: 8 streams"
"$bin" bench-serve --url "$url" --clients 8 --prompt-len 64 --gen-len 300
echo "8 streams + one 6000-token prompt 2 s in"
"$bin" bench-serve --url "$url" --clients 8 --prompt-len 64 --gen-len 300 --seed 2 > "$log.b" &
b=$!
sleep 2
"$bin" bench-serve --url "$url" --clients 1 --prompt-len 6000 --gen-len 4 --seed 3 > "$log.long"
wait $b
cat "$log.b"; echo "the long request:"; cat "$log.long"; rm -f "$log.b" "$log.long"
