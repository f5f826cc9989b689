#!/usr/bin/env bash
# kvserve bench against llama.cpp's llama-bench on the same files, in the same run, interleaved.
#
#   bench/vs_llamacpp.sh [BUILD_DIR] MODEL.gguf [MODEL.gguf ...]
#
# For each model, ROUNDS times: llama-bench one rep, then kvserve bench one rep (pp and tg in each),
# so both see the same machine state; memory read bandwidth (bench_membw) is measured before and
# after each model. Prints a markdown table of medians: tok/s of both, the ratio kvserve/llama.cpp,
# kvserve's tg weight-read GB/s (active bytes for a mixture of experts) and its share of the
# measured bandwidth. The CPU and its vector extensions head the table.
#
# Env: THREADS (2), PP (512), TG (128), ROUNDS (3), ANCHOR (../shared/anchor/bin), NICE ("").
#   DEPTH (0): both programs first fill that many tokens of context (llama-bench -d, kvserve bench -d), so
#             pp and tg are measured at that depth (attention over a long context: DEPTH=4096 PP=0).
#   AB_FLAGS: each round also runs kvserve bench with these flags (e.g. --no-repack) right after the
#             plain run; the table gets a second kvserve row per model, "MODEL [AB_FLAGS]".
#   LLAMA_CPU: run llama.cpp's CPU variant of that name only (haswell = AVX2; icelake, zen4 =
#             AVX-512), e.g. haswell beside an AVX2-only kvserve build on an AVX-512 machine.
#   BUSY: that many processes spin on the CPU for the whole run (another program taking cores), to
#         see how both programs' threads cope when the machine is not theirs alone.
# Needs node (installed by scripts/deps.sh) to read both programs' JSON.
# q5_0 / q5_1 weights: gemma3-1b's width (1152) is not a multiple of 256, so llama-quantize's Q4_K_M
#   of it keeps q/k/v/gate/up at q5_0 and Q5_K_M at q5_1; a few layers show the kernels:
#   kvserve synth --preset gemma3-1b --type f16 --layers 4 -o g.gguf
#   ../shared/anchor/bin/llama-quantize g.gguf gemma3-1b-Q4_K_M.gguf Q4_K_M   (and Q5_K_M)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=$here/build
if [ $# -gt 0 ] && [ -d "$1" ]; then build=$(cd "$1" && pwd); shift; fi
[ $# -gt 0 ] || { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
THREADS=${THREADS:-2} PP=${PP:-512} TG=${TG:-128} DEPTH=${DEPTH:-0} ROUNDS=${ROUNDS:-3} NICE=${NICE:-}
AB_FLAGS=${AB_FLAGS:-} LLAMA_CPU=${LLAMA_CPU:-} BUSY=${BUSY:-0}
anchor=${ANCHOR:-$here/../shared/anchor/bin}
kvserve=$build/kvserve membw=$build/bench_membw
for f in "$kvserve" "$membw" "$anchor/llama-bench"; do
  [ -x "$f" ] || { echo "vs_llamacpp.sh: $f is missing (build kvserve; see ../shared/anchor)" >&2; exit 2; }
done
command -v node >/dev/null || { echo "vs_llamacpp.sh: node is needed to read the JSON" >&2; exit 2; }
tmp=$(mktemp -d)
spinners=()
trap '[ ${#spinners[@]} -eq 0 ] || kill "${spinners[@]}" 2>/dev/null; rm -rf "$tmp"' EXIT

# shellcheck source=bench/servers.sh
. "$here/bench/servers.sh"
anchor_mirror
for _ in $(seq "$BUSY"); do (while :; do :; done) & spinners+=($!); done

membw_gbs() { $NICE "$membw" -t "$THREADS" | sed -n 's/^memory read: \([0-9.]*\) GB\/s.*/\1/p'; }

# One rep of each program; their JSON rows go to $tmp/ll.json and $tmp/ks.json (one array per line).
one_round() {
  local m=$1
  $NICE "$anchor/llama-bench" -m "$m" -p "$PP" -n "$TG" -d "$DEPTH" -r 1 -t "$THREADS" -o json 2>/dev/null | tr -d '\n' >>"$tmp/ll.json"
  echo >>"$tmp/ll.json"
  $NICE "$kvserve" bench -m "$m" -p "$PP" -n "$TG" -d "$DEPTH" -r 1 -t "$THREADS" -o json 2>/dev/null | tr -d '\n' >>"$tmp/ks.json"
  echo >>"$tmp/ks.json"
  [ -n "$AB_FLAGS" ] || return 0
  # shellcheck disable=SC2086 # AB_FLAGS is a list of flags
  $NICE "$kvserve" bench -m "$m" -p "$PP" -n "$TG" -d "$DEPTH" -r 1 -t "$THREADS" -o json $AB_FLAGS 2>/dev/null | tr -d '\n' >>"$tmp/ab.json"
  echo >>"$tmp/ab.json"
}

cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
isa=$(grep -qw avx512f /proc/cpuinfo && echo AVX-512 || (grep -qw avx2 /proc/cpuinfo && echo AVX2 || echo scalar))
echo "CPU: $cpu ($isa), $(nproc) cores; -t $THREADS, pp$PP / tg$TG$([ "$DEPTH" = 0 ] || echo " at depth $DEPTH"), median of $ROUNDS interleaved rounds${spinners:+; $BUSY other process(es) spinning}"
echo "kvserve: $("$kvserve" version 2>/dev/null | head -1); llama.cpp CPU variant: ${LLAMA_CPU:-best available}"
echo
echo "| model | pp$PP llama.cpp | pp$PP kvserve | ratio | tg$TG llama.cpp | tg$TG kvserve | ratio | kvserve tg GB/s | membw GB/s | tg % of membw |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for m in "$@"; do
  : >"$tmp/ll.json"; : >"$tmp/ks.json"; : >"$tmp/ab.json"
  bw1=$(membw_gbs)
  for _ in $(seq "$ROUNDS"); do one_round "$m"; done
  bw2=$(membw_gbs)
  for variant in ks ab; do
  [ "$variant" = ks ] || [ -n "$AB_FLAGS" ] || continue
  label=$(basename "$m"); [ "$variant" = ks ] || label="$label [$AB_FLAGS]"
  node - "$tmp/ll.json" "$tmp/$variant.json" "$label" "$bw1" "$bw2" "$PP" "$TG" <<'EOF'
const fs = require('fs');
const [llFile, ksFile, name, bw1, bw2, pp, tg] = process.argv.slice(2);
const rows = f => fs.readFileSync(f, 'utf8').split('\n').filter(l => l.trim()).flatMap(l => JSON.parse(l));
const median = a => { const s = [...a].sort((x, y) => x - y); return s.length ? s[Math.floor((s.length - 1) / 2)] : NaN; };
const ll = rows(llFile), ks = rows(ksFile);
const llTs = (p, n) => median(ll.filter(r => r.n_prompt == p && r.n_gen == n).map(r => r.avg_ts));
const ksTs = (p, n) => median(ks.filter(r => r.n_prompt == p && r.n_gen == n).map(r => r.tps_median));
const ksGbs = median(ks.filter(r => r.n_gen == tg && r.n_prompt == 0).map(r => r.weights_gbs));
const bw = Math.max(+bw1, +bw2);
const f = (x, d = 1) => Number.isFinite(x) ? x.toFixed(d) : 'n/a';
const r = (a, b) => Number.isFinite(a / b) ? (a / b).toFixed(2) + 'x' : 'n/a';
const [lp, kp, lt, kt] = [llTs(pp, 0), ksTs(pp, 0), llTs(0, tg), ksTs(0, tg)];
console.log(`| ${name} | ${f(lp)} | ${f(kp)} | ${r(kp, lp)} | ${f(lt)} | ${f(kt)} | ${r(kt, lt)} | ${f(ksGbs)} | ${f(bw)} | ${f(100 * ksGbs / bw, 0)}% |`);
EOF
  done
done
