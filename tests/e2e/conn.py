#!/usr/bin/env python3
"""Connection-level defences of `kvserve serve` (issue 24), against the real
binary over raw sockets: thousands of idle connections and slowloris
connections cost no thread and do not keep a client from being served, the
per-address limit, the idle timeout and the header deadline, 401 and 413
from the headers before the body, JSON-only POSTs, cross-origin requests
(refused, or allowed by --cors-origin with its preflight), the Host check.
Counts and waits are bounded (a few seconds each). Exit 77 (skipped) without
the model or when the open-file limit cannot reach the idle count."""
import json
import os
import re
import resource
import socket
import subprocess
import sys
import time

BIN = os.environ.get("KVSERVE_BIN")
SHARED = os.environ.get("KVSERVE_SHARED", "../shared")
MODEL = os.path.join(SHARED, "models", "stories260K.gguf")
IDLE = int(os.environ.get("CONN_IDLE", "2000"))
SLOW = 50
PER_IP = 50        # idle connections per client address (127.0.0.N), under the limit of 64
TIMEOUT = 2        # --timeout of the first server
failed = False


def check(name, ok, detail=""):
    global failed
    print(("ok   " if ok else "FAIL ") + name + ("" if ok else ": " + detail), flush=True)
    failed |= not ok


def start(*flags):
    p = subprocess.Popen([BIN, "serve", "-m", MODEL, "--port", "0", "-c", "256", *flags],
                         stderr=subprocess.PIPE, text=True)
    port = None
    deadline = time.time() + 20
    while port is None and time.time() < deadline:
        line = p.stderr.readline()
        m = re.search(r"127\.0\.0\.1:(\d+)", line)
        if m:
            port = int(m.group(1))
    if port is None:
        p.kill()
        sys.exit("server did not start")
    # keep reading its log so it never blocks on a full pipe
    import threading
    threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
    return p, port


def connect(port, src="127.0.0.1"):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((src, 0))
    s.connect(("127.0.0.1", port))
    return s


def request(port, raw, src="127.0.0.1", timeout=10.0):
    """Send raw bytes, read until the server closes or the response is whole: (status, headers, body)."""
    s = connect(port, src)
    s.settimeout(timeout)
    try:
        s.sendall(raw)
        data = b""
        while True:
            m = re.search(rb"\r\n\r\n", data)
            if m:
                head = data[:m.end()].decode("latin-1")
                cl = re.search(r"(?i)content-length: *(\d+)", head)
                if cl and len(data) - m.end() >= int(cl.group(1)):
                    break
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    finally:
        s.close()
    m = re.match(rb"HTTP/1\.[01] (\d+)", data)
    if not m:
        return 0, "", data
    head, _, body = data.partition(b"\r\n\r\n")
    return int(m.group(1)), head.decode("latin-1"), body


def http(port, method, path, body=None, headers=(), src="127.0.0.1"):
    lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Connection: close", *headers]
    payload = b"" if body is None else body.encode()
    if body is not None:
        lines.append(f"Content-Length: {len(payload)}")
    return request(port, ("\r\n".join(lines) + "\r\n\r\n").encode() + payload, src)


def json_error(body, code):
    try:
        e = json.loads(body)["error"]
        return e.get("code") == code
    except (ValueError, KeyError, TypeError):
        return False


def threads(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"Threads:\s+(\d+)", f.read()).group(1))


def closed_by_server(s, within=0.05):
    """True when the server closes s within `within` seconds (it sends nothing first)."""
    s.settimeout(within)
    try:
        return s.recv(1) == b""
    except socket.timeout:
        return False
    except OSError:
        return True


KEY = ("Authorization: Bearer sekret",)
JSON = ("Content-Type: application/json",)
COMPLETION = '{"prompt": "Once upon a time", "max_tokens": 4}'


def crowd_and_timeouts():
    """The idle crowd, slowloris, a client served meanwhile, the limits and the timeouts."""
    p, port = start("--api-key", "sekret", "--timeout", str(TIMEOUT), "--max-conn-per-ip", "64",
                    "--max-body", "4096")
    try:
        base = threads(p.pid)
        idle = []
        for i in range(IDLE):
            idle.append(connect(port, f"127.0.1.{1 + i // PER_IP}"))
        slow = [connect(port, f"127.0.2.{1 + i // PER_IP}") for i in range(SLOW)]
        for s in slow:
            s.sendall(b"GET /health HTTP/1.1\r\n")
        t0 = time.time()
        status, _, body = http(port, "POST", "/v1/completions", COMPLETION, KEY + JSON)
        served = time.time() - t0
        n_threads = threads(p.pid)
        print(f"     {IDLE} idle + {SLOW} slowloris connections: server threads {n_threads} "
              f"(before {base}), a completion served in {served:.2f} s", flush=True)
        check("served among idle and slowloris connections", status == 200 and b"choices" in body,
              f"{status} {body[:200]!r}")
        check("idle connections cost no thread", n_threads <= base + 2, f"{n_threads} threads, {base} before")

        # the per-address limit: 64 from 127.0.3.1, the 65th is closed at once; others still get in
        mine = [connect(port, "127.0.3.1") for _ in range(64)]
        extra = connect(port, "127.0.3.1")
        check("per-address limit closes the 65th connection", closed_by_server(extra, within=5.0))
        status, _, _ = http(port, "GET", "/health", src="127.0.3.2")
        check("another address still served", status == 200, str(status))
        for s in mine + [extra]:
            s.close()

        # slowloris keeps sending a byte now and then: the header deadline closes it anyway
        end = time.time() + TIMEOUT + 1.5
        while time.time() < end:
            for s in slow:
                try:
                    s.sendall(b"X")
                except OSError:
                    pass
            time.sleep(0.4)
        check("idle connections closed by --timeout", sum(closed_by_server(s, within=3.0) for s in idle[:200]) == 200)
        check("slowloris connections closed by the header deadline", all(closed_by_server(s, within=3.0) for s in slow))
        for s in idle + slow:
            s.close()

        # 401 and 413 from the headers alone: the body is never sent
        raw = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
               "Content-Length: 8000000\r\n\r\n").encode()
        status, _, body = request(port, raw, timeout=5)
        check("401 before the body", status == 401 and json_error(body, "invalid_api_key"), f"{status} {body[:200]!r}")
        raw = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
               "Authorization: Bearer sekret\r\nContent-Length: 8000000\r\n\r\n").encode()
        status, _, body = request(port, raw, timeout=5)
        check("413 before the body (Content-Length)", status == 413 and json_error(body, "request_too_large"),
              f"{status} {body[:200]!r}")
        chunk = b"400\r\n" + b" " * 1024 + b"\r\n"
        raw = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
               "Authorization: Bearer sekret\r\nTransfer-Encoding: chunked\r\n\r\n").encode() + chunk * 8 + b"0\r\n\r\n"
        status, _, body = request(port, raw, timeout=5)
        check("413 for a chunked body past --max-body", status == 413 and json_error(body, "request_too_large"),
              f"{status} {body[:200]!r}")

        # cross-site requests and DNS rebinding
        status, _, body = http(port, "POST", "/cache/clear", "{}", KEY + ("Content-Type: text/plain",))
        check("text/plain POST refused (415)", status == 415 and json_error(body, "unsupported_media_type"),
              f"{status} {body[:200]!r}")
        status, _, body = http(port, "POST", "/cache/clear", "{}", KEY + JSON + ("Origin: http://evil.example",))
        check("cross-origin POST refused (403)", status == 403 and json_error(body, "origin_not_allowed"),
              f"{status} {body[:200]!r}")
        status, _, body = http(port, "POST", "/cache/clear", "{}", KEY + JSON + (f"Origin: http://127.0.0.1:{port}",))
        check("same-origin POST served", status == 200, f"{status} {body[:200]!r}")
        raw = f"GET /v1/models HTTP/1.1\r\nHost: evil.example:{port}\r\n{KEY[0]}\r\nConnection: close\r\n\r\n"
        status, _, body = request(port, raw.encode())
        check("rebinding Host refused (421)", status == 421 and json_error(body, "host_not_allowed"),
              f"{status} {body[:200]!r}")
        raw = f"GET /v1/models HTTP/1.1\r\nHost: localhost:{port}\r\n{KEY[0]}\r\nConnection: close\r\n\r\n"
        check("localhost Host served", request(port, raw.encode())[0] == 200)
    finally:
        p.terminate()
        p.wait(15)


def cors():
    p, port = start("--cors-origin", "http://app.example:3000", "--allowed-host", "kv.example")
    try:
        status, head, _ = http(port, "OPTIONS", "/v1/chat/completions", None,
                               ("Origin: http://app.example:3000", "Access-Control-Request-Method: POST",
                                "Access-Control-Request-Headers: authorization, content-type"))
        check("preflight from an allowed origin (204 + CORS headers)",
              status == 204 and "Access-Control-Allow-Origin: http://app.example:3000" in head
              and re.search(r"(?i)access-control-allow-headers: authorization, content-type", head)
              and re.search(r"(?i)access-control-allow-methods: .*POST", head), f"{status} {head}")
        status, head, body = http(port, "POST", "/v1/completions", COMPLETION,
                                  JSON + ("Origin: http://app.example:3000",))
        check("allowed cross-origin POST served with CORS headers",
              status == 200 and "Access-Control-Allow-Origin: http://app.example:3000" in head, f"{status} {head}")
        status, _, body = http(port, "OPTIONS", "/v1/completions", None,
                               ("Origin: http://other.example", "Access-Control-Request-Method: POST"))
        check("preflight from another origin refused (403)", status == 403 and json_error(body, "origin_not_allowed"),
              f"{status} {body[:200]!r}")
        raw = f"GET /health HTTP/1.1\r\nHost: kv.example:{port}\r\nConnection: close\r\n\r\n"
        check("--allowed-host name served", request(port, raw.encode())[0] == 200)
    finally:
        p.terminate()
        p.wait(15)


def main():
    if not BIN or not os.path.exists(MODEL):
        print(f"skipped: no KVSERVE_BIN or no {MODEL}")
        return 77
    want = IDLE + SLOW + 200
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < want + 128:
        print(f"skipped: the open-file limit ({hard}) cannot reach {want}")
        return 77
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    crowd_and_timeouts()
    cors()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
