#!/usr/bin/env python3
"""K concurrent greedy completions against one server (bench/spec.sh's `servers` arm).

    spec_client.py URL STREAMS GEN PROMPTS_FILE OUT_TEXTS [TEMPERATURE]

Sends STREAMS /v1/completions requests at once (prompt i % n of PROMPTS_FILE, one prompt a line; temperature 0 or
TEMPERATURE with seed i, max_tokens GEN, ignore_eos), waits for all of them and prints one line:

    tok/s drafted accepted completion_tokens wall_s

tok/s: every request's completion tokens over the wall time from the first send to the last answer. drafted and
accepted: kvserve's usage.draft_tokens / usage.accepted_tokens, or llama-server's timings.draft_n /
timings.draft_n_accepted (0 when the server reports neither). The texts go to OUT_TEXTS, one JSON string a line,
in request order, so two servers' outputs can be compared. SPEC_CLIENT_BODY (environment): a JSON object of more
request fields, e.g. '{"repeat_penalty": 1.5, "repeat_last_n": -1}'.
"""
import json
import os
import sys
import threading
import time
import urllib.request


def complete(url, prompt, gen, temp, out, i):
    fields = {"prompt": prompt, "max_tokens": gen, "temperature": temp, "seed": i, "ignore_eos": True}
    fields.update(json.loads(os.environ.get("SPEC_CLIENT_BODY", "{}")))
    body = json.dumps(fields).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        out[i] = json.load(r)


def main():
    if len(sys.argv) not in (6, 7):
        sys.exit(__doc__)
    url, streams, gen, prompts_file, texts_file = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    temp = float(sys.argv[6]) if len(sys.argv) == 7 else 0.0
    with open(prompts_file) as f:
        prompts = [line.rstrip("\n") for line in f if line.strip()]
    out = [None] * streams
    threads = [threading.Thread(target=complete, args=(url, prompts[i % len(prompts)], gen, temp, out, i))
               for i in range(streams)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    if any(o is None for o in out):
        sys.exit("spec_client: a request failed")
    tokens = drafted = accepted = 0
    with open(texts_file, "w") as f:
        for o in out:
            usage, timings = o.get("usage", {}), o.get("timings", {})
            tokens += usage.get("completion_tokens", 0)
            drafted += usage.get("draft_tokens", timings.get("draft_n", 0))
            accepted += usage.get("accepted_tokens", timings.get("draft_n_accepted", 0))
            f.write(json.dumps(o["choices"][0]["text"]) + "\n")
    print("%.2f %d %d %d %.3f" % (tokens / wall if wall > 0 else 0, drafted, accepted, tokens, wall))


if __name__ == "__main__":
    main()
