#!/usr/bin/env bash
# The prefix cache through a real `kvserve serve` with --cache-dir: a repeated
# prompt is served from RAM, the cached pages survive a restart (SIGTERM writes
# them, the next start reads them back), the answers never change, a warm-up
# with max_tokens 0 works, a damaged cache dir is moved aside (the server
# starts empty instead of crashing), and a bad, shared or linked --cache-dir is
# refused with a message.
set -u
. "$(dirname "$0")/lib.sh"

start() { # log file
  "$bin" serve -m "$model" --port 0 -c 1024 --parallel 2 -t 2 --cache-dir "$tmp/cache" 2>"$1" &
  pid=$!
  wait_port "$1"
  url=http://127.0.0.1:$port
}
stop() {
  kill -TERM $pid; wait $pid; local rc=$?; pid=
  [ $rc = 0 ] && ok "exit 0 on SIGTERM" || bad "exit code $rc on SIGTERM"
}
ids=$(seq 3 302 | paste -sd, -)                 # a 300-token prompt
complete() { # max_tokens -> prints "<cached_tokens> <text as JSON>"
  local r; r=$(curl -s -H "Content-Type: application/json" "$url/v1/completions" -d "{\"prompt\":[$ids],\"max_tokens\":$1,\"temperature\":0,\"ignore_eos\":true}")
  printf '%s %s\n' "$(grep -o '"cached_tokens":[0-9]*' <<<"$r" | cut -d: -f2)" \
    "$(grep -oE '"text":"([^"\\]|\\.)*"' <<<"$r" | head -1 | cut -d: -f2-)"
}

start "$tmp/log1"
read -r c1 t1 <<<"$(complete 8)"
[ "$c1" = 0 ] && ok "cold: cached_tokens 0" || bad "cold: cached_tokens $c1"
[ -n "$t1" ] && [ "$t1" != '""' ] || bad "cold: no text generated"
read -r c2 t2 <<<"$(complete 8)"
[ "$c2" -ge 288 ] && ok "RAM hit: cached_tokens $c2" || bad "RAM hit: cached_tokens $c2 (want >= 288)"
[ "$t1" = "$t2" ] && ok "same text with a hit" || bad "text changed with a hit: $t1 vs $t2"
stop
grep -q 'written to the prefix cache on disk' "$tmp/log1" && ok "pages persisted at shutdown" ||
  { bad "no persist line in the log"; cat "$tmp/log1"; }

start "$tmp/log2"
grep -q 'prefix cache on disk in' "$tmp/log2" && ok "store reopened: $(grep -o '[0-9]* pages' "$tmp/log2")" ||
  bad "no store line at start"
read -r c3 t3 <<<"$(complete 8)"
[ "$c3" -ge 288 ] && ok "after restart: cached_tokens $c3" || bad "after restart: cached_tokens $c3 (want >= 288)"
[ "$t1" = "$t3" ] && ok "same text after restart" || bad "text changed after restart: $t1 vs $t3"
curl -s "$url/metrics" | grep -q '^kvserve_prefix_hit_tokens_total{tier="disk"} [1-9]' &&
  ok "disk hits counted" || bad "kvserve_prefix_hit_tokens_total{tier=\"disk\"} not counted"
read -r c4 t4 <<<"$(complete 0)"
[ "$t4" = '""' ] && ok "max_tokens 0 answers at once with cached_tokens $c4" || bad "max_tokens 0 gave $t4"
stop

# a truncated data.mdb: moved aside, the server starts with an empty store
size=$(stat -c %s "$tmp/cache/data.mdb")
truncate -s 12288 "$tmp/cache/data.mdb" # the two meta pages and one more: the recorded pages are cut (half the file may hold them all)
start "$tmp/log4"
grep -q "was damaged.*moved it to $tmp/cache.damaged-" "$tmp/log4" && ok "damaged dir moved aside: $(grep -o 'was damaged.*' "$tmp/log4")" ||
  { bad "no move-aside line for a truncated data.mdb"; cat "$tmp/log4"; }
ls -d "$tmp"/cache.damaged-* >/dev/null 2>&1 && ok "the damaged copy is kept" || bad "no cache.damaged-* directory"
read -r c5 t5 <<<"$(complete 8)"
[ "$t1" = "$t5" ] && ok "same text from an empty store (cached_tokens $c5)" || bad "text changed after recovery: $t1 vs $t5"
stop

chmod 777 "$tmp/cache"
"$bin" serve -m "$model" --port 0 --cache-dir "$tmp/cache" 2>"$tmp/log5"; rc=$?
[ $rc != 0 ] && grep -q "chmod go-w $tmp/cache" "$tmp/log5" && ok "world-writable --cache-dir refused" ||
  { bad "world-writable --cache-dir: exit $rc"; cat "$tmp/log5"; }
chmod 700 "$tmp/cache"
rm -f "$tmp/cache/lock.mdb"; touch "$tmp/victim"; ln -s "$tmp/victim" "$tmp/cache/lock.mdb"
"$bin" serve -m "$model" --port 0 --cache-dir "$tmp/cache" 2>"$tmp/log6"; rc=$?
[ $rc != 0 ] && grep -q "lock.mdb is a symbolic link" "$tmp/log6" && [ ! -s "$tmp/victim" ] &&
  ok "linked lock.mdb refused, its target untouched" || { bad "linked lock.mdb: exit $rc"; cat "$tmp/log6"; }

touch "$tmp/file"
"$bin" serve -m "$model" --port 0 --cache-dir "$tmp/file/sub" 2>"$tmp/log3"; rc=$?
[ $rc != 0 ] && grep -q "$tmp/file/sub" "$tmp/log3" && ok "bad --cache-dir refused: $(tail -1 "$tmp/log3")" ||
  { bad "bad --cache-dir: exit $rc"; cat "$tmp/log3"; }
exit $fail
