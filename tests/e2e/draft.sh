#!/usr/bin/env bash
# Speculative decoding with a draft model through a real `kvserve serve -md`
# (issue 25), with curl: four greedy completions sent at once give the same
# text as a server without a draft model, their usage counts drafted and
# accepted tokens, /cache/usage shows the draft's pages in the same budget and
# /metrics its gauge. The draft: one layer of the default model's preset
# (`kvserve synth`, the same vocabulary). --max-itl-ratio 0: how much is drafted
# must not depend on measured step times.
set -u
. "$(dirname "$0")/lib.sh"
command -v python3 >/dev/null || { echo "skipped: python3 not installed"; exit 77; }

"$bin" synth --preset tiny --type q8_0 --layers 1 --seed 9 -o "$tmp/draft.gguf" >/dev/null 2>&1 ||
  { echo "FAIL synth"; exit 1; }
prompts=("once upon a time" "the cat sat on the mat and" "1 2 3 4 5 6" "hello hello hello")

# serve $1 (extra flags): the four completions into $tmp/$2.N
run() {
  "$bin" serve -m "$model" --port 0 -c 512 --parallel 4 -t 2 --max-itl-ratio 0 $1 2>"$tmp/log.$2" &
  pid=$!
  wait_port "$tmp/log.$2"
  local i
  for i in 0 1 2 3; do
    curl -s -H "Content-Type: application/json" "http://127.0.0.1:$port/v1/completions" \
      -d "{\"prompt\":\"${prompts[$i]}\",\"max_tokens\":40,\"temperature\":0}" >"$tmp/$2.$i" &
  done
  wait $(jobs -p | grep -v "^$pid\$")
  curl -s "http://127.0.0.1:$port/cache/usage" >"$tmp/$2.usage"
  curl -s "http://127.0.0.1:$port/metrics" >"$tmp/$2.metrics"
  kill -TERM $pid; wait $pid; pid=
}
text() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["choices"][0]["text"])' "$1"; }
field() { python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["usage"].get(sys.argv[2], 0))' "$1" "$2"; }

run "" plain
run "-md $tmp/draft.gguf --draft-min 1 --draft-max 6" draft
grep -q "speculation draft" "$tmp/log.draft" && ok "-md alone turns on --spec-type draft" || bad "$(cat "$tmp/log.draft")"
drafted=0
for i in 0 1 2 3; do
  a=$(text "$tmp/plain.$i") b=$(text "$tmp/draft.$i")
  [ -n "$a" ] && [ "$a" = "$b" ] && ok "prompt $i: the same text" || bad "prompt $i: '$a' vs '$b'"
  drafted=$((drafted + $(field "$tmp/draft.$i" draft_tokens)))
  [ "$(field "$tmp/plain.$i" draft_tokens)" = 0 ] || bad "prompt $i drafted without a draft model"
done
[ "$drafted" -gt 0 ] && ok "usage: $drafted tokens drafted" || bad "no draft tokens in usage"
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["draft_used"] > 0 and d["free"] == d["budget"] - d["used"] - d["draft_used"], d' \
  "$tmp/draft.usage" && ok "/cache/usage: draft_used in the budget" || bad "/cache/usage: $(head -c 300 "$tmp/draft.usage")"
grep -q '^kvserve_kv_draft_bytes_used [1-9]' "$tmp/draft.metrics" && ok "/metrics: kvserve_kv_draft_bytes_used" ||
  bad "/metrics: $(grep draft "$tmp/draft.metrics")"
exit $fail
