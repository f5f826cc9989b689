#!/usr/bin/env bash
# Streams under a connection flood: STREAMS streaming completions decode
# while IDLE idle connections and SLOW slowloris connections (a header byte
# every second) are held open, against the same streams without the flood.
# Reports each run's decode rate (tok/s per stream, mean), the worst gap
# between two tokens of a stream, and the server's threads and RSS; the goal
# is the flooded run within 10% of the quiet one.
#
#   bench/conn.sh [MODEL.gguf]      (default $KVSERVE_SHARED/models/stories260K.gguf)
#   env: IDLE (10000) SLOW (200) STREAMS (16) TOKENS (256) KVSERVE_BIN (build/kvserve)
#
# The attackers come from 127.0.x.y, 50 to an address (under the default
# --max-conn-per-ip 64), and reconnect when the server closes them (--timeout,
# the header deadline), as a real flood would. Needs python3 and an open-file
# hard limit above IDLE + SLOW.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${KVSERVE_BIN:-build/kvserve}
shared=${KVSERVE_SHARED:-$(cd .. && pwd)/shared}
model=${1:-$shared/models/stories260K.gguf}
[ -x "$bin" ] || { echo "bench/conn.sh: no $bin (build it first)" >&2; exit 1; }
[ -f "$model" ] || { echo "bench/conn.sh: no model $model" >&2; exit 1; }
log=$(mktemp)
"$bin" serve -m "$model" --port 0 --parallel "${STREAMS:-16}" 2>"$log" &
pid=$!
trap 'kill $pid 2>/dev/null; rm -f "$log"' EXIT
port=
for _ in $(seq 200); do port=$(grep -ao '127.0.0.1:[0-9]*' "$log" | head -1 | cut -d: -f2 || true); [ -n "$port" ] && break; sleep 0.1; done
[ -n "$port" ] || { echo "bench/conn.sh: the server did not start"; cat "$log"; exit 1; }
grep -a "connections" "$log" || true

python3 - "$port" "$pid" <<'EOF'
import http.client, json, os, resource, socket, sys, threading, time

port, pid = int(sys.argv[1]), int(sys.argv[2])
IDLE, SLOW = int(os.environ.get("IDLE", 10000)), int(os.environ.get("SLOW", 200))
STREAMS, TOKENS = int(os.environ.get("STREAMS", 16)), int(os.environ.get("TOKENS", 256))
PER_ADDR = 50
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
need = IDLE + SLOW + STREAMS + 64
if hard != resource.RLIM_INFINITY and hard < need:
    sys.exit(f"bench/conn.sh: the open-file hard limit {hard} is below {need}")
resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))


def server_stats():
    with open(f"/proc/{pid}/status") as f:
        st = dict(l.split(":", 1) for l in f if ":" in l)
    return int(st["Threads"]), int(st["VmRSS"].split()[0]) / 1024


def stream(i, out):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"prompt": f"Once upon a time {i}", "max_tokens": TOKENS, "stream": True,
                       "ignore_eos": True, "temperature": 0})
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    times = []
    for line in r:
        if line.startswith(b"data: {"):
            times.append(time.perf_counter())
    c.close()
    out[i] = times


def decode_run():
    out = [None] * STREAMS
    th = [threading.Thread(target=stream, args=(i, out)) for i in range(STREAMS)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    rates, gap = [], 0.0
    for times in out:
        if len(times) > 2:
            rates.append((len(times) - 2) / (times[-1] - times[1]))  # from the first token on
            gap = max(gap, max(b - a for a, b in zip(times[1:], times[2:])))
    return sum(rates) / max(len(rates), 1), gap, sum(len(t) for t in out)


class Flood:
    def __init__(self):
        self.idle, self.slow, self.stop = [None] * IDLE, [None] * SLOW, False
        self.reconnects = 0

    def connect(self, k, base):
        s = socket.socket()
        s.bind((f"127.{base}.{k // PER_ADDR // 250}.{1 + k // PER_ADDR % 250}", 0))
        s.settimeout(5)
        s.connect(("127.0.0.1", port))
        s.setblocking(False)
        return s

    def alive(self, s):
        try:
            return s is not None and s.recv(1) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False

    def keep(self):
        """Open everything, then every second: a byte from each slowloris, reopen what the server closed."""
        while not self.stop:
            for pool, base, slow in ((self.idle, 1, False), (self.slow, 2, True)):
                for k, s in enumerate(pool):
                    if self.stop:
                        return
                    if not self.alive(s):
                        if s is not None:
                            s.close()
                            self.reconnects += 1
                        try:
                            pool[k] = s = self.connect(k, base)
                            if slow:
                                s.send(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                        except OSError:
                            pool[k] = None
                    elif slow:
                        try:
                            s.send(b"X")
                        except OSError:
                            pass
            time.sleep(1)

    def close(self):
        self.stop = True
        for s in self.idle + self.slow:
            if s is not None:
                s.close()


decode_run()  # warm-up: first-request costs stay out of both runs
rate0, gap0, n0 = decode_run()
t0, rss0 = server_stats()
print(f"quiet:   {STREAMS} streams  {rate0:8.1f} tok/s per stream  worst gap {gap0 * 1000:7.1f} ms  "
      f"({n0} chunks)  server threads {t0}  RSS {rss0:.0f} MiB", flush=True)
flood = Flood()
keeper = threading.Thread(target=flood.keep)
keeper.start()
deadline = time.time() + 120
while time.time() < deadline and sum(s is not None for s in flood.idle + flood.slow) < IDLE + SLOW:
    time.sleep(0.5)
held = sum(s is not None for s in flood.idle + flood.slow)
rate1, gap1, n1 = decode_run()
t1, rss1 = server_stats()
print(f"flooded: {STREAMS} streams  {rate1:8.1f} tok/s per stream  worst gap {gap1 * 1000:7.1f} ms  "
      f"({n1} chunks)  server threads {t1}  RSS {rss1:.0f} MiB  "
      f"({held} of {IDLE + SLOW} flood connections held, {flood.reconnects} reopened)", flush=True)
flood.close()
keeper.join()
print(f"flooded / quiet: tok/s {rate1 / rate0 if rate0 else 0:.3f}, worst gap {gap1 / gap0 if gap0 else 0:.2f}x "
      f"(goal: tok/s within 10%)")
EOF
