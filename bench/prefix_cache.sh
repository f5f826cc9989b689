#!/usr/bin/env bash
# The prefix cache's benchmarks (issue 10), each printing a markdown table.
#
#   bench/prefix_cache.sh shared  BIN MODEL [K...]   K requests share a 1000-token prefix (27-token suffixes,
#                                                    32 generated), against llama-server -np K on the same file
#   bench/prefix_cache.sh chat    BIN MODEL          8 chat rounds of ~1500 new tokens: hit rate and TTFT per round
#   bench/prefix_cache.sh restart BIN MODEL          a 4000-token prompt cold, then after a restart with --cache-dir
#
# BIN is kvserve ("shared" runs bench_serve from beside it; both are in build/); llama.cpp comes from
# ANCHOR (default ../shared/anchor/bin). Env: REPS (3), THREADS (2), PREFIX (1000), SUFFIX (27), GEN (32),
# ROUNDS (8), ROUND_TOKENS (1500), LONG (4000). Prompts are token ids (100..355), so any vocabulary of 356
# tokens or more works. Run on a quiet machine: timings are medians of REPS runs with the two servers
# interleaved. Needs curl, bc and python3 (to pick free ports).
set -euo pipefail
usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 3 ] || usage
what=$1 bin=$2 model=$3; shift 3
[ -x "$bin" ] && [ -f "$model" ] || usage
bench=$(dirname "$bin")/bench_serve
here=$(cd "$(dirname "$0")/.." && pwd)
anchor=${ANCHOR:-$here/../shared/anchor/bin}
REPS=${REPS:-3} THREADS=${THREADS:-2} PREFIX=${PREFIX:-1000} SUFFIX=${SUFFIX:-27} GEN=${GEN:-32}
ROUNDS=${ROUNDS:-8} ROUND_TOKENS=${ROUND_TOKENS:-1500} LONG=${LONG:-4000}
tmp=$(mktemp -d)
pid=
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT

# shellcheck source=bench/servers.sh
. "$here/bench/servers.sh"

ids() { # from count -> comma-separated ids, deterministic per position
  awk -v a="$1" -v n="$2" 'BEGIN { for (i = a; i < a + n; i++) printf "%s%d", (i > a ? "," : ""), 100 + (i * 7919 + 13) % 256 }'
}
complete() { # prompt-ids max_tokens -> "seconds cached_tokens"
  printf '{"prompt":[%s],"max_tokens":%d,"temperature":0,"ignore_eos":true}' "$1" "$2" >"$tmp/body"
  curl -s -H 'Content-Type: application/json' -o "$tmp/resp" -w '%{time_total}' "$url/v1/completions" -d @"$tmp/body"
  printf ' %s\n' "$(grep -o '"cached_tokens":[0-9]*' "$tmp/resp" | cut -d: -f2 || echo 0)"
}

# ---- 1. shared prefix -----------------------------------------------------------------------------------

# One measured batch: warm the prefix, then K concurrent requests; prints "wall computed".
shared_run() { # server K
  local k=$2 counter
  if [ "$1" = kvserve ]; then
    start_kvserve --parallel "$k" -c 2048 --kv-mem $(( (k + 2) * 40 ))M; counter=kvserve_prompt_tokens_total
  else
    start_llama -np "$k" -c $(( k * 1100 )); counter=llamacpp:prompt_tokens_total
  fi
  "$bench" --url "$url" --clients 1 --requests 1 --prompt-len "$PREFIX" --shared-prefix "$PREFIX" \
    --gen-len 1 >/dev/null
  local before t0 t1 after
  before=$(metric "$counter"); t0=$(now)
  "$bench" --url "$url" --clients "$k" --requests "$k" --prompt-len $((PREFIX + SUFFIX)) \
    --shared-prefix "$PREFIX" --gen-len "$GEN" >"$tmp/bs.out"
  t1=$(now); after=$(metric "$counter")
  grep -q "| $k/$k |" "$tmp/bs.out" || { echo "not every request finished:"; cat "$tmp/bs.out"; exit 1; }
  stop
  echo "$(echo "$t1 - $t0" | bc -l) $((after - before))"
}

bench_shared() {
  [ -x "$bench" ] || { echo "$bench not found: build the bench_serve target"; exit 1; }
  local ks=("$@"); [ ${#ks[@]} -gt 0 ] || ks=(16 32)
  cpu; echo "model: $(basename "$model"), $PREFIX-token prefix + $SUFFIX-token suffixes, $GEN generated, -t $THREADS, median of $REPS"
  echo
  echo "| K | naive prompt tokens | kvserve computed | computed / naive | kvserve wall s | llama-server computed | llama-server wall s | wall llama / kvserve |"
  echo "|---|---|---|---|---|---|---|---|"
  for k in "${ks[@]}"; do
    interleave shared_run "$k"
    local naive=$((k * (PREFIX + SUFFIX))) kw kc lw lc
    kw=$(col_median "$tmp/kv" 1); kc=$(col_median "$tmp/kv" 2)
    lw=$(col_median "$tmp/ll" 1); lc=$(col_median "$tmp/ll" 2)
    printf '| %d | %d | %s | 1/%.1f | %.2f | %s | %.2f | %.1fx |\n' "$k" "$naive" "$kc" \
      "$(echo "$naive / $kc" | bc -l)" "$kw" "$lc" "$lw" "$(echo "$lw / $kw" | bc -l)"
  done
}

# ---- 2. multi-turn chat ------------------------------------------------------------------------------

bench_chat() {
  local ctx=$(( ROUNDS * (ROUND_TOKENS + 16) + 512 ))
  start_kvserve -c "$ctx" --kv-mem 2G
  cpu; echo "model: $(basename "$model"), $ROUNDS rounds of $ROUND_TOKENS new tokens + 16 assistant tokens, -t $THREADS"
  echo
  echo "| round | prompt tokens | earlier rounds' tokens | cached | hit rate | TTFT ms |"
  echo "|---|---|---|---|---|---|"
  local prompt="" len=0 prev=0 last_ttft=0
  for r in $(seq "$ROUNDS"); do
    [ $r -gt 1 ] && prompt="$prompt,$(ids $((1000000 + r * 16)) 16)" && len=$((len + 16))
    prompt="${prompt:+$prompt,}$(ids $((r * 100000)) "$ROUND_TOKENS")"; len=$((len + ROUND_TOKENS))
    read -r secs cached <<<"$(complete "$prompt" 1)"
    local rate="-"; [ $prev -gt 0 ] && rate=$(printf '%.1f%%' "$(echo "100 * $cached / $prev" | bc -l)")
    last_ttft=$(echo "$secs * 1000" | bc -l)
    printf '| %d | %d | %d | %d | %s | %.0f |\n' "$r" "$len" "$prev" "$cached" "$rate" "$last_ttft"
    prev=$len
  done
  curl -s -H 'Content-Type: application/json' "$url/cache/clear" -d '{"tier":"all"}' >/dev/null
  read -r secs cached <<<"$(complete "$prompt" 1)"
  local cold; cold=$(echo "$secs * 1000" | bc -l)
  printf '\nround %d cold (after POST /cache/clear): %.0f ms, cached %d; warm / cold = 1/%.1f\n' "$ROUNDS" "$cold" \
    "$cached" "$(echo "$cold / $last_ttft" | bc -l)"
  stop
}

# ---- 3. restart with --cache-dir -------------------------------------------------------------------------

bench_restart() {
  local dir=$tmp/cache prompt cold warm c1 c2 gbs bytes
  prompt=$(ids 7 "$LONG")
  cpu; echo "model: $(basename "$model"), a $LONG-token prompt, -t $THREADS"
  start_kvserve -c $((LONG + 512)) --cache-dir "$dir"
  read -r cold c1 <<<"$(complete "$prompt" 1)"
  stop
  grep 'written to the prefix cache' "$tmp/server.log" || true
  local dropped="page cache kept"
  if sync && echo 3 >/proc/sys/vm/drop_caches 2>/dev/null; then dropped="page cache dropped"; fi
  start_kvserve -c $((LONG + 512)) --cache-dir "$dir"
  read -r warm c2 <<<"$(complete "$prompt" 1)"
  gbs=$(curl -s "$url/metrics" | awk '$1 == "kvserve_disk_cache_read_gbs" { print $2 }')
  bytes=$(metric kvserve_disk_cache_read_bytes_total)
  stop
  echo
  echo "| run | TTFT ms | cached tokens |"
  echo "|---|---|---|"
  printf '| cold | %.0f | %d |\n| after restart (%s) | %.0f | %d |\n' "$(echo "$cold * 1000" | bc -l)" "$c1" \
    "$dropped" "$(echo "$warm * 1000" | bc -l)" "$c2"
  printf '\nwarm / cold = 1/%.1f; read %.1f MiB from disk at %s GB/s (measured by the store)\n' \
    "$(echo "$cold / $warm" | bc -l)" "$(echo "$bytes / 1048576" | bc -l)" "${gbs:-?}"
}

case $what in
  shared) anchor_mirror; bench_shared "$@" ;;
  chat) bench_chat ;;
  restart) bench_restart ;;
  *) usage ;;
esac
