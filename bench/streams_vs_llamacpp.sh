#!/usr/bin/env bash
# K concurrent decode streams: kvserve serve against llama.cpp's llama-server -np K on the same file.
#
#   bench/streams_vs_llamacpp.sh BIN MODEL [K...]      (K default 16)
#
# Each of K clients sends one streaming /v1/completions request at once (PROMPT distinct prompt tokens,
# GEN generated, ignore_eos); the aggregate tok/s is bench_serve's (tokens over the wall time of the run).
# The two servers run one after the other, REPS times, interleaved; medians. BIN is kvserve; bench_serve
# runs from beside it. Env: REPS (3), THREADS (2), PROMPT (64), GEN (128), ANCHOR (../shared/anchor/bin),
# LLAMA_CPU (keep only that llama.cpp CPU variant, e.g. haswell), KVSERVE_FLAGS (extra serve flags).
# Run on a quiet machine: llama.cpp's OpenMP threads collapse when anything else runs.
set -euo pipefail
usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 2 ] || usage
bin=$1 model=$2; shift 2
[ -x "$bin" ] && [ -f "$model" ] || usage
bench=$(dirname "$bin")/bench_serve
[ -x "$bench" ] || { echo "$bench not found: build the bench_serve target"; exit 1; }
here=$(cd "$(dirname "$0")/.." && pwd)
anchor=${ANCHOR:-$here/../shared/anchor/bin}
REPS=${REPS:-3} THREADS=${THREADS:-2} PROMPT=${PROMPT:-64} GEN=${GEN:-128} KVSERVE_FLAGS=${KVSERVE_FLAGS:-}
tmp=$(mktemp -d)
pid=
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT
# shellcheck source=bench/servers.sh
. "$here/bench/servers.sh"
anchor_mirror

# One run against the server at $url; prints "tok/s ITL-p50-ms".
streams_run() { # K
  "$bench" --url "$url" --clients "$1" --requests "$1" --prompt-len "$PROMPT" --gen-len "$GEN" >"$tmp/bs.out"
  grep -q "| $1/$1 |" "$tmp/bs.out" || { echo "not every request finished:" >&2; cat "$tmp/bs.out" >&2; exit 1; }
  awk -F'|' '/^\| [0-9]/ { gsub(/ /, ""); print $14, $10 }' "$tmp/bs.out"
}

one_server() { # kvserve|llama K
  local ctx=$(( $2 * (PROMPT + GEN + 64) ))
  if [ "$1" = kvserve ]; then
    # shellcheck disable=SC2086 # a list of flags
    start_kvserve --parallel "$2" -c $((PROMPT + GEN + 64)) $KVSERVE_FLAGS
  else
    start_llama -np "$2" -c "$ctx"
  fi
  "$bench" --url "$url" --clients 1 --requests 1 --prompt-len 8 --gen-len 4 >/dev/null # warm up
  streams_run "$2"
  stop
}

ks=("$@"); [ ${#ks[@]} -gt 0 ] || ks=(16)
cpu; echo "kvserve: $("$bin" version | head -1); model: $(basename "$model"); $PROMPT-token prompts, $GEN generated, -t $THREADS, median of $REPS"
echo
echo "| streams | kvserve tok/s | llama-server tok/s | ratio | kvserve ITL p50 ms | llama-server ITL p50 ms |"
echo "|---|---|---|---|---|---|"
for k in "${ks[@]}"; do
  interleave one_server "$k"
  kt=$(col_median "$tmp/kv" 1); lt=$(col_median "$tmp/ll" 1)
  ki=$(col_median "$tmp/kv" 2); li=$(col_median "$tmp/ll" 2)
  printf '| %d | %.1f | %.1f | %.2fx | %.1f | %.1f |\n' "$k" "$kt" "$lt" "$(echo "$kt / $lt" | bc -l)" "$ki" "$li"
done
