"""What the Python e2e scripts share: the ok/FAIL lines and their count, a free port, JSON requests, waiting for a
server's /health, stopping servers, and the skip exit (77). Each script runs from this directory, so
`import e2e_http` finds this file."""
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

failures = 0


def check(cond, what):
    global failures
    print(("ok   " if cond else "FAIL ") + what)
    failures += 0 if cond else 1


def skip(why):
    print("skipped:", why)
    sys.exit(77)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def request(url, body=None, raw=False, headers=None, timeout=60):
    """(status, the answer parsed as JSON, or its text when raw); body a JSON value, a ready string, or None (GET).
    headers add to (or, with None values, remove) Content-Type: application/json."""
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    h = {k: v for k, v in h.items() if v is not None}
    data = None if body is None else body.encode() if isinstance(body, str) else json.dumps(body).encode()
    rq = urllib.request.Request(url, data=data, headers=h)
    try:
        with urllib.request.urlopen(rq, timeout=timeout) as r:
            text = r.read().decode()
            return r.status, text if raw else json.loads(text)
    except urllib.error.HTTPError as e:
        text = e.read().decode()
        return e.code, text if raw else json.loads(text)


def wait_up(url, proc, log):
    """Until url/health answers 200; exits with the server's log if it stops or does not come up in 15 s."""
    for _ in range(300):
        if proc.poll() is not None:
            print(open(log).read())
            sys.exit("server exited at start")
        try:
            if request(url + "/health")[0] == 200:
                return
        except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
            pass
        time.sleep(0.05)
    sys.exit("server did not start: " + open(log).read()[-2000:])


def stop_all(procs):
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
