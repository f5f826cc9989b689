#!/usr/bin/env bash
# Speculative decoding with a draft model through a real `kvserve serve -md`
# (issue 25), with curl: four greedy completions sent at once give the same
# text as a server without a draft model, their usage counts drafted and
# accepted tokens, /cache/usage shows the draft's pages in the same budget and
# /metrics its gauge. Per request: speculative.n_max 0 drafts nothing,
# n_min = n_max = 3 drafts in threes, n_min above n_max is refused, and a
# sampling request (its drafts drawn from the draft's q) counts its drafts
# too. The draft: one layer of the default model's preset
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
  if [ "$2" = draft ]; then
    local extra=('"speculative":{"n_max":0},"temperature":0' '"speculative":{"n_min":3,"n_max":3},"temperature":0'
                 '"speculative":{"n_min":4,"n_max":2}' '"temperature":0.8,"seed":5')
    for i in 0 1 2 3; do
      curl -s -H "Content-Type: application/json" "http://127.0.0.1:$port/v1/completions" -o "$tmp/extra.$i" \
        -w '%{http_code}' -d "{\"prompt\":\"${prompts[0]}\",\"max_tokens\":40,${extra[$i]}}" >"$tmp/extra.$i.code"
    done
  fi
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
n=$(field "$tmp/extra.0" draft_tokens)
[ "$n" = 0 ] && [ "$(text "$tmp/extra.0")" = "$(text "$tmp/plain.0")" ] &&
  ok "speculative.n_max 0: nothing drafted, the same text" || bad "speculative.n_max 0: $n drafted, $(head -c 300 "$tmp/extra.0")"
n=$(field "$tmp/extra.1" draft_tokens) a=$(field "$tmp/extra.1" accepted_tokens)
[ "$n" -gt 0 ] && [ $((n % 3)) = 0 ] && [ "$a" -le "$n" ] && [ "$(text "$tmp/extra.1")" = "$(text "$tmp/plain.0")" ] &&
  ok "speculative.n_min = n_max = 3: $n drafted in threes, $a accepted, the same text" ||
  bad "speculative.n_min = n_max = 3: $n drafted, $a accepted, $(head -c 300 "$tmp/extra.1")"
[ "$(cat "$tmp/extra.2.code")" = 400 ] && grep -q "n_min" "$tmp/extra.2" && ok "speculative.n_min above n_max: 400" ||
  bad "speculative.n_min above n_max: $(cat "$tmp/extra.2.code") $(head -c 300 "$tmp/extra.2")"
n=$(field "$tmp/extra.3" draft_tokens) a=$(field "$tmp/extra.3" accepted_tokens)
c=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["usage"]["completion_tokens"])' "$tmp/extra.3")
[ "$n" -gt 0 ] && [ "$a" -le "$n" ] && [ "$c" = 40 ] && ok "sampled with drafts: $n drafted, $a accepted, 40 tokens" ||
  bad "sampled: $n drafted, $a accepted, $(head -c 300 "$tmp/extra.3")"
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["draft_used"] > 0 and d["free"] == d["budget"] - d["used"] - d["draft_used"], d' \
  "$tmp/draft.usage" && ok "/cache/usage: draft_used in the budget" || bad "/cache/usage: $(head -c 300 "$tmp/draft.usage")"
grep -q '^kvserve_kv_draft_bytes_used [1-9]' "$tmp/draft.metrics" && ok "/metrics: kvserve_kv_draft_bytes_used" ||
  bad "/metrics: $(grep draft "$tmp/draft.metrics")"
exit $fail
