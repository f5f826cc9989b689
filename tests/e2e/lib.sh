# Sourced by the e2e shell tests that drive a real `kvserve serve` on the
# built-in default model with curl: the checks that make a test skip (exit
# 77) instead of pass, a scratch dir and a server pid cleaned up at exit, ok/bad
# reporting (bad sets fail=1) and wait_port.
bin=${KVSERVE_BIN:?}
model=$(dirname "$bin")/default-model.gguf
[ -f "$model" ] || { echo "skipped: $model not found (the build makes it)"; exit 77; }
command -v curl >/dev/null || { echo "skipped: curl not installed"; exit 77; }
tmp=$(mktemp -d)
pid=
trap '[ -n "$pid" ] && kill $pid 2>/dev/null; rm -rf "$tmp"' EXIT
fail=0
ok() { echo "ok   $*"; }
bad() { echo "FAIL $*"; fail=1; }

# The port the server logging to $1 announces in its ready line (port set),
# or the log and exit 1 when it does not within 20 s.
wait_port() {
  port=
  for _ in $(seq 200); do port=$(grep -sao '127.0.0.1:[0-9]*' "$1" | cut -d: -f2); [ -n "$port" ] && break; sleep 0.1; done
  [ -n "$port" ] || { echo "server did not start"; cat "$1"; exit 1; }
}
