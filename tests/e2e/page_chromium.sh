#!/usr/bin/env bash
# The live page at / in headless Chromium (Debian's chromium package): while
# requests hold KV pages, the page's script must fetch /cache/usage and draw
# them (checked in the DOM Chromium dumps), and a screenshot is written to
# kv_page.png in the working directory (the build dir under ctest). Then,
# against a server with --api-key: / is served without the key, the data
# routes want the header (a key in the URL is not read), and with node the
# page is driven over the DevTools protocol (page_key.mjs): it asks for the key
# after a 401, sends it as a header on every fetch and keeps it across a reload.
# Exit 77 (skipped) without chromium, curl or the model.
set -u
bin=${KVSERVE_BIN:?}; shared=${KVSERVE_SHARED:-../shared}
model=$shared/models/trained/tiny-llama-gqa-hd64-f32.gguf
[ -f "$model" ] || { echo "skipped: $model not found"; exit 77; }
command -v curl >/dev/null || { echo "skipped: curl not installed"; exit 77; }
chrome=$(command -v chromium || command -v chromium-browser || true)
[ -n "$chrome" ] || { echo "skipped: chromium not installed (apt-get install chromium, or scripts/deps.sh)"; exit 77; }
out=${1:-$PWD/kv_page.png}
log=$(mktemp); tmp=$(mktemp -d); loops=()
"$bin" serve -m "$model" --port 0 -c 2048 --parallel 4 --kv-mem 6M --kv-policy dynamic --kv-hot 128 \
  --kv-sink 32 -t 1 2>"$log" &
pid=$!
cleanup() { kill "${loops[@]}" 2>/dev/null; kill $pid 2>/dev/null; wait 2>/dev/null; rm -rf "$log" "$tmp"; }
trap cleanup EXIT
for _ in $(seq 100); do port=$(grep -ao '127.0.0.1:[0-9]*' "$log" | cut -d: -f2); [ -n "$port" ] && break; sleep 0.1; done
[ -n "${port:-}" ] || { echo "FAIL: server did not start"; cat -v "$log"; exit 1; }
url=http://127.0.0.1:$port
# Three clients keep long generations going so pages are live whenever the page polls.
for i in 1 2 3; do
  ( while kill -0 $pid 2>/dev/null; do
      curl -s -H "Content-Type: application/json" "$url/v1/completions" -d "{\"prompt\":\"Once upon a time $i\",\"max_tokens\":1900,\"ignore_eos\":true}" >/dev/null
    done ) &
  loops+=($!)
done
for _ in $(seq 100); do curl -s "$url/cache/usage" | grep -q '"page_map_k"' && break; sleep 0.1; done
curl -s -H "Content-Type: application/json" "$url/cache/requantize" -d '{"type_k":"q4_0","scope":"all"}' >/dev/null # a mix of precisions to show

chromium_run() { # extra args...
  timeout 120 "$chrome" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync --disable-dev-shm-usage \
    --user-data-dir="$tmp/profile" --window-size=1280,900 --virtual-time-budget=3000 "$@" 2>>"$tmp/chrome.log"
}
fail=0
chromium_run --dump-dom "$url/" >"$tmp/dom.html"
used=$(grep -o 'data-used-pages="[0-9]*"' "$tmp/dom.html" | grep -o '[0-9]*')
polls=$(grep -o 'data-polls="[0-9]*"' "$tmp/dom.html" | grep -o '[0-9]*')
cells=$(grep -o 'class="pg[ "]' "$tmp/dom.html" | wc -l)
if [ "${polls:-0}" -ge 1 ] && [ "${used:-0}" -ge 1 ] && [ "$cells" -ge "${used:-1}" ]; then
  echo "ok   the page's script ran: $polls poll(s), $used used page(s) drawn, $cells cells"
else
  echo "FAIL page not rendered: polls=${polls:-none} used=${used:-none} cells=$cells"; fail=1
  head -c 2000 "$tmp/dom.html"; tail -5 "$tmp/chrome.log"
fi
grep -q 'id="rq-dry"' "$tmp/dom.html" && grep -q '<canvas id="chart"' "$tmp/dom.html" \
  && echo "ok   requantize dry-run button and usage chart present" || { echo "FAIL controls missing"; fail=1; }

rm -f "$out"
chromium_run --screenshot="$out" "$url/" >/dev/null
size=$(stat -c %s "$out" 2>/dev/null || echo 0)
# PNG signature, then IHDR width and height (big-endian at bytes 16..23)
sig=$(head -c 8 "$out" 2>/dev/null | od -An -tx1 | tr -d ' \n')
dims=$(od -An -tu1 -j16 -N8 "$out" 2>/dev/null | awk '{print $1*16777216+$2*65536+$3*256+$4 "x" $5*16777216+$6*65536+$7*256+$8}')
if [ "$sig" = 89504e470d0a1a0a ] && [ "$size" -gt 20000 ] && [ "$dims" = 1280x900 ]; then
  echo "ok   screenshot $out ($size bytes, $dims)"
else
  echo "FAIL screenshot: signature $sig, $size bytes, $dims"; tail -5 "$tmp/chrome.log"; fail=1
fi
curl -s "$url/health" | grep -q '"ok"' && echo "ok   server still healthy" || { echo "FAIL server unhealthy"; fail=1; }

kill "${loops[@]}" $pid 2>/dev/null; wait 2>/dev/null; loops=()
: >"$log"
"$bin" serve -m "$model" --port 0 -c 512 --parallel 1 --kv-mem 6M -t 1 --api-key sekret 2>"$log" &
pid=$!
port=
for _ in $(seq 100); do port=$(grep -ao '127.0.0.1:[0-9]*' "$log" | cut -d: -f2); [ -n "$port" ] && break; sleep 0.1; done
[ -n "$port" ] || { echo "FAIL: server with --api-key did not start"; cat -v "$log"; exit 1; }
url=http://127.0.0.1:$port
code() { curl -s -o "$tmp/body" -w '%{http_code}' "$@"; }
[ "$(code "$url/")" = 200 ] && grep -q 'id="keyform"' "$tmp/body" \
  && echo "ok   --api-key: / is served without the key" || { echo "FAIL --api-key: / not served without the key"; fail=1; }
[ "$(code "$url/cache/usage")" = 401 ] && [ "$(code "$url/cache/usage?key=sekret")" = 401 ] \
  && [ "$(code -H 'Authorization: Bearer sekret' "$url/cache/usage")" = 200 ] \
  && echo "ok   --api-key: /cache/usage needs the header (401 without it or with ?key=)" \
  || { echo "FAIL --api-key: /cache/usage auth"; fail=1; }
if command -v node >/dev/null; then
  node "$(dirname "$0")/page_key.mjs" "$chrome" "$url/" sekret "$tmp/profile-key" || fail=1
else
  echo "skipped: the page with --api-key in Chromium needs node (DevTools protocol driver page_key.mjs)"
fi
exit $fail
