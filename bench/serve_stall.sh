#!/usr/bin/env bash
# A 6000-token prompt arriving while 8 streams decode: do the streams freeze?
#   bench/serve_stall.sh KVSERVE_BIN MODEL.gguf [extra serve flags...]
# Env: CLIENTS (8), GEN (gen tokens per stream, 4000), PROBE (6000), PROBE_AT (2 s).
# On a loaded machine pass -t 1: the thread pool's spin barrier turns every preemption of a
# worker into a stalled step, which swamps what the scheduler does.
# Runs bench_serve from beside KVSERVE_BIN (both are in build/).
# Prints bench_serve's table, then the streams' inter-token latency before, during
# and after the long prefill with the ratios; the goal is ITL during <= 2x a
# decode-only step at the same contexts (serve's --max-itl-ratio, default 1.5, is
# the knob; KVSERVE_SCHED_TRACE=1 with SERVE_LOG shows the decode-only steps the
# scheduler interleaves).
# GEN must be long enough that the streams outlive the prefill (a warning says so).
set -eu
bin=$1 model=$2; shift 2
bench=$(dirname "$bin")/bench_serve
[ -x "$bench" ] || { echo "$bench not found: build the bench_serve target"; exit 1; }
clients=${CLIENTS:-8} gen=${GEN:-4000} probe=${PROBE:-6000} at=${PROBE_AT:-2}
log=${SERVE_LOG:-$(mktemp)}  # SERVE_LOG=FILE keeps the server's stderr (with KVSERVE_SCHED_TRACE=1: every step)
nice "$bin" serve -m "$model" --port 0 -c 8192 --parallel $((clients + 1)) "$@" 2>"$log" &
pid=$!
trap 'kill $pid 2>/dev/null; [ -n "${SERVE_LOG:-}" ] || rm -f "$log"' EXIT
for _ in $(seq 300); do port=$(grep -ao '127.0.0.1:[0-9]*' "$log" | cut -d: -f2 || true); [ -n "$port" ] && break; sleep 0.1; done
[ -n "${port:-}" ] || { echo "server did not start:"; cat -v "$log"; exit 1; }
url=http://127.0.0.1:$port
head -1 "$log"
# warm up the step-cost model (decode-only and mixed steps)
"$bench" --url "$url" --clients "$clients" --prompt-len 64 --gen-len 32 >/dev/null
"$bench" --url "$url" --clients "$clients" --prompt-len 64 --gen-len "$gen" \
  --probe-len "$probe" --probe-at "$at" --seed 2
