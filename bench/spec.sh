#!/usr/bin/env bash
# Speculative decoding's benchmarks (issue 25), each printing a markdown table.
#
#   bench/spec.sh verify BIN [MODEL]   (a) the cost of verifying k = 1..KMAX drafts against one decode step: one
#                                      sequence, k + 1 tokens with every token's logits (kvserve bench --all-logits
#                                      ppK+1, timed after a decode step and an untimed verification cut back off,
#                                      as inside speculation) after DEPTH tokens of context, against tg at the
#                                      same depth. MODEL
#                                      default: a q4_0 `kvserve synth` of PRESET (llama-1b; e.g. PRESET=
#                                      qwen3moe-30b-a3b LAYERS=4 for the MoE shape) in the scratch dir (TINY=1:
#                                      the tiny preset). Goal: k = 8 costs <= 1.5x one step.
#   bench/spec.sh accept BIN MODEL     (b) input-grounded work ("retell the story" prompts whose answer repeats the
#                                      prompt; e.g. ../shared/models/stories260K.gguf): kvserve generate, greedy,
#                                      with --spec-type none and ngram: identical output, tokens per target pass,
#                                      acceptance and the tg speedup. GEN_FLAGS: more generate flags for both arms;
#                                      GEN_FLAGS="--repeat-penalty 1.5 --repeat-last-n -1" makes a workload where
#                                      nothing is accepted (a draft repeats the text, which the penalty forbids;
#                                      goal: ngram no more than 3% slower than none).
#   bench/spec.sh draft BIN MODEL DRAFT  (c) the same prompts with a draft model (--model-draft DRAFT, the same
#                                      vocabulary; e.g. ../shared/models/trained/tiny-llama-gqa-hd64-q8_0.gguf
#                                      drafted by its -q4_0.gguf): identical output, acceptance, tokens per target
#                                      pass and the tg speedup against --spec-type none.
#   bench/spec.sh all BIN MODEL [DRAFT] (a) and (b) (verify on its default model), and (c) with DRAFT.
#   bench/spec.sh servers BIN MODEL [DRAFT]  (c) side by side with llama.cpp's speculation: kvserve serve and the
#                                      anchor's llama-server (ANCHOR, $KVSERVE_SHARED/anchor/bin) on the same files and
#                                      prompts, greedy, STREAMS concurrent requests (1 and 4), each server plain and
#                                      speculating: with DRAFT, a draft model (kvserve --model-draft; llama-server
#                                      --spec-type draft-simple -md); without, n-gram lookup (kvserve --spec-type
#                                      ngram; llama-server LLAMA_NGRAM, default ngram-simple with 3-token keys).
#                                      Aggregate tok/s, acceptance as each server reports it (usage.draft_tokens /
#                                      accepted_tokens; timings.draft_n / draft_n_accepted) and the ratios.
#                                      TEMP > 0: sampled instead of greedy (seed i for request i; outputs differ).
#   bench/spec.sh served BIN MODEL     kvserve serve alone, plain against --spec-type ngram, STREAMS concurrent
#                                      requests, REPS interleaved rounds: served overhead of n-gram speculation.
#                                      REQ_BODY: more request fields (JSON), e.g. '{"repeat_penalty": 1.5,
#                                      "repeat_last_n": -1}' (the workload where nothing is accepted; goal: ngram no
#                                      more than 3% slower than plain).
#
# Env: THREADS (2), DEPTH (256), REPS (5), KMAX (16), GEN (128), DRAFT_MAX (16), PRESET, LAYERS, TINY=1 (a smoke
# run: the tiny model, DEPTH 32, REPS 1, KMAX 4, GEN 24). servers: STREAMS ("1 4"), CTX (512, tokens per request),
# KV_MEM (kvserve's --kv-mem; default: serve's own, room for STREAMS contexts of both models), TEMP (0),
# KVSERVE_SPEC_FLAGS (more flags for kvserve's speculating server, e.g. --draft-min 1 to draft whatever the cost
# model says), LLAMA_SPEC_FLAGS (the same for llama-server's), DRAFT_P_MIN (0: both servers' default),
# LLAMA_NGRAM, LLAMA_CPU (keep only that llama.cpp CPU variant).
# Run on a quiet machine: timings are medians of REPS runs.
set -euo pipefail
usage() { sed -n '2,45p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 2 ] || usage
what=$1 bin=$2 model=${3:-} draft_model=${4:-}
arm=ngram # (b) and (c) compare --spec-type none with this arm: ngram or draft
[ -x "$bin" ] || usage
if [ "${TINY:-0}" = 1 ]; then
  THREADS=${THREADS:-1} DEPTH=${DEPTH:-32} REPS=${REPS:-1} KMAX=${KMAX:-4} GEN=${GEN:-24}
else
  THREADS=${THREADS:-2} DEPTH=${DEPTH:-256} REPS=${REPS:-5} KMAX=${KMAX:-16} GEN=${GEN:-128}
fi
DRAFT_MAX=${DRAFT_MAX:-16}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# ---- (a) the cost of a verification -------------------------------------------------------------------------

verify() { # model
  local m=$1 list k
  list=$(seq -s, 2 $((KMAX + 1)))
  "$bin" bench -m "$m" -p "$list" -n 16 -d "$DEPTH" -r "$REPS" -t "$THREADS" --all-logits -o csv >"$tmp/bench.csv"
  echo "### Verifying k drafts against one decode step ($(basename "$m"), $THREADS threads, context $DEPTH)"
  echo
  echo "| k | k + 1 tokens (ms) | decode step (ms) | cost / step | speedup if all k are accepted |"
  echo "| ---: | ---: | ---: | ---: | ---: |"
  # csv: ...,test,n_prompt,n_gen,n_depth,reps,tps_median,... (fields 8, 9 and 12)
  awk -F, 'NR > 1 && $9 > 0 { step = 1000 / $12 }
           NR > 1 && $8 > 0 { n[$8] = $8; ms[$8] = 1000 * $8 / $12 }
           END { for (p = 2; p in n; p++) printf "| %d | %.3f | %.3f | %.2f | %.2fx |\n", p - 1, ms[p], step, ms[p] / step, p * step / ms[p] }' \
    "$tmp/bench.csv"
  echo
}

verify_model() {
  if [ -n "$model" ] && [ "$what" = verify ]; then echo "$model"; return; fi
  local preset=${PRESET:-llama-1b} layers=()
  [ "${TINY:-0}" = 1 ] && preset=${PRESET:-tiny}
  [ -n "${LAYERS:-}" ] && layers=(--layers "$LAYERS")
  "$bin" synth --preset "$preset" "${layers[@]}" --type q4_0 -t "$THREADS" -o "$tmp/$preset-q4_0.gguf" >/dev/null 2>&1
  echo "$tmp/$preset-q4_0.gguf"
}

# ---- (b) acceptance on input-grounded work ---------------------------------------------------------------------

PROMPTS=(
  "Lily had a red ball. She played with the ball in the park with her friend Tom. Tom threw the ball high and Lily caught it. They were very happy. Retell the story. Lily had a red ball. She played"
  "Once upon a time, there was a little dog named Max. Max liked to run in the garden and dig holes. One day Max found a big bone. He was so happy that he ran to show his mom. Once upon a time, there was a little dog named Max. Max liked"
  "Tim and Sue went to the beach. They built a sand castle with a big tower. A wave came and the castle fell down. Tim was sad, but Sue said they could build it again. Tim and Sue went to the beach. They built"
)

gen() { # none|ngram|draft prompt -> output in $tmp/out.$1, timing in $tmp/err.$1
  local flags=(--spec-type "$1")
  [ "$1" = draft ] && flags=(--model-draft "$draft_model")
  # shellcheck disable=SC2086 # GEN_FLAGS is a list of flags
  "$bin" generate -m "$model" -p "$2" -n "$GEN" --temp 0 -t "$THREADS" --ignore-eos --output-ids \
    "${flags[@]}" --draft-max "$DRAFT_MAX" ${GEN_FLAGS:-} >"$tmp/out.$1" 2>"$tmp/err.$1"
}
tg_of() { sed -n 's/.*generated [0-9]* tok, \([0-9.]*\) tok\/s.*/\1/p' "$tmp/err.$1"; }

accept() {
  [ -f "$model" ] || usage
  local what_drafts="Prompt lookup"
  [ "$arm" = draft ] && what_drafts="The draft model $(basename "$draft_model")"
  echo "### $what_drafts on \"retell the story\" prompts ($(basename "$model"), greedy${GEN_FLAGS:+ $GEN_FLAGS}, $GEN tokens, $THREADS threads, median of $REPS)"
  echo
  echo "| prompt | same output | drafted | accepted | tokens per target pass | tg none (t/s) | tg $arm (t/s) | speedup |"
  echo "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
  local i r same spec none ngram line
  for i in "${!PROMPTS[@]}"; do
    : >"$tmp/tg.none"; : >"$tmp/tg.$arm"
    for r in $(seq "$REPS"); do
      for spec in none "$arm"; do
        gen "$spec" "${PROMPTS[$i]}"
        tg_of "$spec" >>"$tmp/tg.$spec"
      done
    done
    same=yes; cmp -s "$tmp/out.none" "$tmp/out.$arm" || same=NO
    none=$(sort -g "$tmp/tg.none" | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }')
    ngram=$(sort -g "$tmp/tg.$arm" | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }')
    line=$(grep '^speculation:' "$tmp/err.$arm")
    echo "$line" | awk -v i=$((i + 1)) -v same="$same" -v a="$none" -v b="$ngram" '{
      printf "| %d | %s | %s | %s | %s | %.1f | %.1f | %.2fx |\n", i, same, $3, $5, $8, a, b, (a > 0 ? b / a : 0) }'
  done
  echo
}

# ---- (c) side by side with llama-server ----------------------------------------------------------------------

here=$(cd "$(dirname "$0")/.." && pwd)
pid=
servers() {
  [ -f "$model" ] || usage
  command -v python3 >/dev/null && command -v curl >/dev/null || { echo "servers: needs python3 and curl"; exit 1; }
  anchor=${ANCHOR:-${KVSERVE_SHARED:-$here/../shared}/anchor/bin}
  [ -x "$anchor/llama-server" ] || { echo "servers: no llama-server in $anchor (set ANCHOR)"; exit 1; }
  # shellcheck source=bench/servers.sh
  . "$here/bench/servers.sh"
  trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$tmp"' EXIT
  anchor_mirror
  local ctx=${CTX:-512} kv_mem=() p_min=${DRAFT_P_MIN:-0} streams=${STREAMS:-1 4} k r spec name kv_spec ll_spec
  [ -n "${KV_MEM:-}" ] && kv_mem=(--kv-mem "$KV_MEM")
  printf '%s\n' "${PROMPTS[@]}" >"$tmp/prompts"
  if [ -n "$draft_model" ]; then
    [ -f "$draft_model" ] || usage
    name="draft model $(basename "$draft_model")"
    kv_spec=(--model-draft "$draft_model" --draft-max "$DRAFT_MAX" --draft-p-min "$p_min")
    ll_spec=(--spec-type draft-simple -md "$draft_model" --spec-draft-n-max "$DRAFT_MAX" --spec-draft-p-min "$p_min")
  else
    name="n-gram lookup"
    kv_spec=(--spec-type ngram --draft-max "$DRAFT_MAX")
    # shellcheck disable=SC2206 # a list of flags
    ll_spec=(${LLAMA_NGRAM:---spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m $DRAFT_MAX})
  fi
  # shellcheck disable=SC2206 # lists of flags
  kv_spec+=(${KVSERVE_SPEC_FLAGS:-}) ll_spec+=(${LLAMA_SPEC_FLAGS:-})
  local temp=${TEMP:-0} how=greedy
  [ "$temp" != 0 ] && how="temperature $temp"
  cpu
  echo "kvserve: $("$bin" version | head -1); llama.cpp: $("$anchor/llama-server" --version 2>&1 | grep -m1 version || true)"
  echo
  echo "### Speculation side by side: $name on \"retell the story\" prompts ($(basename "$model"), $how, $GEN tokens, $THREADS threads, median of $REPS)"
  echo
  echo "llama-server speculating: ${ll_spec[*]}; kvserve: ${kv_spec[*]}"
  echo
  echo "| streams | kvserve plain (t/s) | kvserve spec (t/s) | kvserve accepted | llama plain (t/s) | llama spec (t/s) | llama accepted | kvserve spec / llama spec | kvserve spec / llama plain | same text |"
  echo "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
  for k in $streams; do
    for spec in kp ks lp ls; do : >"$tmp/run.$spec"; done
    for r in $(seq "$REPS"); do
      for spec in kp ks lp ls; do
        case $spec in
          kp) start_kvserve --parallel "$k" -c "$ctx" "${kv_mem[@]}" ;;
          ks) start_kvserve --parallel "$k" -c "$ctx" "${kv_mem[@]}" "${kv_spec[@]}" ;;
          lp) start_llama -np "$k" -c $((k * ctx)) ;;
          ls) start_llama -np "$k" -c $((k * ctx)) "${ll_spec[@]}" ;;
        esac
        python3 "$here/bench/spec_client.py" "$url" 1 4 "$tmp/prompts" "$tmp/warm" >/dev/null # warm up
        python3 "$here/bench/spec_client.py" "$url" "$k" "$GEN" "$tmp/prompts" "$tmp/text.$spec" "$temp" >>"$tmp/run.$spec"
        stop
      done
    done
    local t=() a=()
    for spec in kp ks lp ls; do
      t+=("$(cut -d' ' -f1 "$tmp/run.$spec" | median)")
      a+=("$(awk '{ d += $2; n += $3 } END { printf (d > 0 ? "%.1f%% (%d/%d)" : "-"), 100 * n / d, n, d }' "$tmp/run.$spec")")
    done
    local same="kvserve $(cmp -s "$tmp/text.kp" "$tmp/text.ks" && echo yes || echo NO), llama $(cmp -s "$tmp/text.lp" "$tmp/text.ls" && echo yes || echo NO), across $(cmp -s "$tmp/text.ks" "$tmp/text.ls" && echo yes || echo no)"
    [ "$temp" != 0 ] && same="- (sampled)"
    awk -v k="$k" -v kp="${t[0]}" -v ks="${t[1]}" -v ka="${a[1]}" -v lp="${t[2]}" -v ls="${t[3]}" -v la="${a[3]}" -v same="$same" 'BEGIN {
      printf "| %d | %.1f | %.1f | %s | %.1f | %.1f | %s | %.2fx | %.2fx | %s |\n", k, kp, ks, ka, lp, ls, la,
        (ls > 0 ? ks / ls : 0), (lp > 0 ? ks / lp : 0), same }'
  done
  echo
}

# kvserve serve plain (kp) against n-gram speculation (ks), interleaved; no llama-server.
served() {
  [ -f "$model" ] || usage
  command -v python3 >/dev/null && command -v curl >/dev/null || { echo "served: needs python3 and curl"; exit 1; }
  # shellcheck source=bench/servers.sh
  . "$here/bench/servers.sh"
  trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$tmp"' EXIT
  local ctx=${CTX:-512} streams=${STREAMS:-1 4} k spec t=() a
  printf '%s\n' "${PROMPTS[@]}" >"$tmp/prompts"
  export SPEC_CLIENT_BODY=${REQ_BODY:-"{}"}
  cpu
  echo
  echo "### Served n-gram speculation against plain ($(basename "$model"), greedy, $GEN tokens, $THREADS threads, median of $REPS, request fields $SPEC_CLIENT_BODY)"
  echo
  echo "| streams | plain (t/s) | ngram (t/s) | ngram / plain | drafted | accepted | same text |"
  echo "| ---: | ---: | ---: | ---: | ---: | ---: | --- |"
  for k in $streams; do
    : >"$tmp/run.kp"; : >"$tmp/run.ks"
    for _ in $(seq "$REPS"); do
      for spec in kp ks; do
        if [ "$spec" = kp ]; then start_kvserve --parallel "$k" -c "$ctx"
        else start_kvserve --parallel "$k" -c "$ctx" --spec-type ngram --draft-max "$DRAFT_MAX"; fi
        python3 "$here/bench/spec_client.py" "$url" 1 4 "$tmp/prompts" "$tmp/warm" >/dev/null # warm up
        python3 "$here/bench/spec_client.py" "$url" "$k" "$GEN" "$tmp/prompts" "$tmp/text.$spec" >>"$tmp/run.$spec"
        stop
      done
    done
    t=("$(cut -d' ' -f1 "$tmp/run.kp" | median)" "$(cut -d' ' -f1 "$tmp/run.ks" | median)")
    a=$(awk '{ d += $2; n += $3 } END { print d, n }' "$tmp/run.ks")
    awk -v k="$k" -v p="${t[0]}" -v s="${t[1]}" -v a="$a" -v same="$(cmp -s "$tmp/text.kp" "$tmp/text.ks" && echo yes || echo NO)" 'BEGIN {
      split(a, x, " "); printf "| %d | %.1f | %.1f | %.3f | %d | %d | %s |\n", k, p, s, (p > 0 ? s / p : 0), x[1], x[2], same }'
  done
  echo
}

case $what in
  servers) servers ;;
  served) served ;;
  verify) verify "$(verify_model)" ;;
  accept) accept ;;
  draft) [ -f "$draft_model" ] || usage; arm=draft; accept ;;
  all) verify "$(verify_model)"; accept; if [ -f "$draft_model" ]; then arm=draft; accept; fi ;;
  *) usage ;;
esac
