#!/usr/bin/env python3
"""POST /v1/embeddings and /embeddings of `kvserve serve --embeddings` on the
embedding synth presets (tiny-llama-embed: mean pooling, non-causal;
tiny-qwen3-embed: last-token pooling, causal; the encoders tiny-bert-embed and
tiny-nomic-bert-embed, whose --embeddings is implied), F32 weights and cache: every
vector within 1e-4 (L2) of llama-server's in tests/data/embed-*.json (the unit
test test_model_embed holds the model path to the same files), the usage
counts, base64 (little-endian f32) equal to the floats, token-id inputs,
llama-server's /embeddings shape, the refusals (dimensions, encoding_format,
no --embeddings, completions on a non-causal model,
--embeddings on a model that does not pool) and embeddings answered while a
completion runs. With ../shared/anchor/bin/llama-server present, the same
request to it agrees (cosine >= 0.9999). Exits 77 when the binary or the
references are absent."""
import base64
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error

import e2e_http
from e2e_http import check, free_port, request

BIN = os.environ.get("KVSERVE_BIN")
SOURCE = os.environ.get("KVSERVE_SOURCE", ".")
SHARED = os.environ.get("KVSERVE_SHARED", "../shared")
LLAMA = os.path.join(SHARED, "anchor", "bin", "llama-server")
DATA = os.path.join(SOURCE, "tests", "data")
CASES = [("tiny-llama-embed", "embed-tiny-llama-embed-f32.json"), ("tiny-qwen3-embed", "embed-tiny-qwen3-embed-f32.json"),
         ("tiny-bert-embed", "embed-tiny-bert-embed-f32.json"),
         ("tiny-nomic-bert-embed", "embed-tiny-nomic-bert-embed-f32.json")]
ENCODERS = ("tiny-bert-embed", "tiny-nomic-bert-embed")  # served without --embeddings: an encoder implies it
TOL = 1e-4


def start(args, log):
    port = free_port()
    proc = subprocess.Popen(args + ["--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = "http://127.0.0.1:%d" % port
    for _ in range(600):
        if proc.poll() is not None:
            return proc, None
        try:
            if request(url + "/health")[0] == 200:
                return proc, url
        except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
            pass
        time.sleep(0.05)
    return proc, None


def stop(proc):
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def l2(a, b):
    return math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)))


def cosine(a, b):
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def vectors(answer):
    return [d["embedding"] for d in sorted(answer["data"], key=lambda d: d["index"])]


def check_model(url, name, ref):
    st, a = request(url + "/v1/embeddings", {"input": ref["inputs"], "model": name})
    check(st == 200, "%s: /v1/embeddings of %d inputs answers 200 (%s)" % (name, len(ref["inputs"]), st))
    if st != 200:
        print(a)
        return
    got = vectors(a)
    worst = max(l2(g, r) for g, r in zip(got, ref["embeddings"]))
    check(len(got) == len(ref["embeddings"]) and worst <= TOL,
          "%s: every vector within %g (L2) of llama-server's (worst %.2e)" % (name, TOL, worst))
    check(a["object"] == "list" and all(d["object"] == "embedding" for d in a["data"]) and
          [d["index"] for d in a["data"]] == list(range(len(got))), "%s: OpenAI's shape" % name)
    check(a["usage"] == {"prompt_tokens": ref["prompt_tokens"], "total_tokens": ref["prompt_tokens"]},
          "%s: usage %s" % (name, a["usage"]))
    st, b = request(url + "/v1/embeddings", {"input": ref["inputs"], "encoding_format": "base64"})
    raw = [base64.b64decode(d["embedding"]) for d in sorted(b["data"], key=lambda d: d["index"])]
    floats = [list(struct.unpack("<%df" % (len(x) // 4), x)) for x in raw]
    check(st == 200 and floats == [[float(struct.unpack("<f", struct.pack("<f", v))[0]) for v in g] for g in got],
          "%s: base64 is the little-endian f32 bytes of the float answer" % name)
    st, t = request(url + "/v1/embeddings", {"input": ref["tokens"]})
    check(st == 200 and max(l2(g, r) for g, r in zip(vectors(t), ref["embeddings"])) <= TOL,
          "%s: token-id inputs give the same vectors" % name)
    st, one = request(url + "/v1/embeddings", {"input": ref["tokens"][1]})
    check(st == 200 and len(one["data"]) == 1 and l2(vectors(one)[0], ref["embeddings"][1]) <= TOL,
          "%s: one token-id list is one input" % name)
    st, n = request(url + "/embeddings", {"content": ref["inputs"][0]})
    check(st == 200 and isinstance(n, list) and n[0]["index"] == 0 and len(n[0]["embedding"]) == 1 and
          l2(n[0]["embedding"][0], ref["embeddings"][0]) <= TOL, "%s: llama-server's /embeddings shape" % name)


def check_refusals(url, dim):
    for body, what in [({"input": "ab", "dimensions": 8}, "dimensions other than the model's"),
                       ({"input": "ab", "encoding_format": "hex"}, "an unknown encoding_format"),
                       ({"input": []}, "no input"), ({"input": [[]]}, "an empty input"),
                       ({"input": [100000]}, "a token id outside the vocabulary")]:
        st, a = request(url + "/v1/embeddings", body)
        check(st == 400 and "error" in a, "400 for %s: %s" % (what, a.get("error", {}).get("message")))
    st, _ = request(url + "/v1/embeddings", {"input": "ab", "dimensions": dim})
    check(st == 200, "dimensions equal to the model's (%d) is accepted" % dim)
    st, a = request(url + "/v1/embeddings", {"input": "ab", "model": "not-this-one"})
    check(st == 404 and a["error"]["code"] == "model_not_found", "a model this server does not serve: 404")
    st, _ = request(url + "/v1/embeddings", {"input": "ab", "user": "u", "some_future_field": 1})
    check(st == 200, "user and unknown fields are ignored, as on the completion routes")


def check_llama_server(url, model, ref, log):
    if not os.path.exists(LLAMA):
        print("skipped: llama-server parity (no %s)" % LLAMA)
        return
    proc, lurl = start([LLAMA, "-m", model, "--embeddings", "-t", "1", "-c", "512", "-np", "1", "--host", "127.0.0.1"],
                       log)
    try:
        if not lurl:
            check(False, "llama-server starts")
            return
        body = {"input": ["parity: a sentence", "two", [1, 7, 9, 11]]}
        ours, theirs = request(url + "/v1/embeddings", body)[1], request(lurl + "/v1/embeddings", body)[1]
        worst = min(cosine(a, b) for a, b in zip(vectors(ours), vectors(theirs)))
        check(worst >= 0.9999 and ours["usage"] == theirs["usage"],
              "the same request to llama-server: cosine >= 0.9999 (worst %.7f), same usage" % worst)
    finally:
        stop(proc)


def main():
    if not BIN or not all(os.path.exists(os.path.join(DATA, f)) for _, f in CASES):
        print("skipped: no kvserve binary or no tests/data/embed-*.json")
        sys.exit(77)
    with tempfile.TemporaryDirectory(prefix="kvserve-embed-") as tmp:
        log = open(os.path.join(tmp, "log.txt"), "w+")
        for preset, ref_file in CASES:
            ref = json.load(open(os.path.join(DATA, ref_file)))
            model = os.path.join(tmp, preset + ".gguf")
            subprocess.run([BIN, "synth", "--preset", preset, "--type", "f32", "-o", model], check=True,
                           stdout=subprocess.DEVNULL)
            flags = [] if preset in ENCODERS else ["--embeddings"]
            proc, url = start([BIN, "serve", "-m", model] + flags + ["-t", "1", "--parallel", "4",
                                                                     "-ctk", "f32", "-ctv", "f32"], log)
            try:
                check(url is not None, "%s: kvserve serve %s starts" % (preset, " ".join(flags)))
                if not url:
                    continue
                check_model(url, preset, ref)
                if preset in ENCODERS:
                    st, a = request(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
                    check(st == 501 and "encoder" in a["error"]["message"],
                          "%s: chat completions on an encoder: 501 (%s)" % (preset, a["error"]["message"]))
                    check_llama_server(url, model, ref, log)
                elif preset == "tiny-llama-embed":
                    check_refusals(url, len(ref["embeddings"][0]))
                    st, a = request(url + "/v1/completions", {"prompt": "hi", "max_tokens": 4})
                    check(st == 501, "completions on a non-causal model: 501 (%s)" % a["error"]["message"])
                else:  # a causal embedder also generates, batched with the embeddings
                    done = {}
                    t = threading.Thread(target=lambda: done.update(
                        r=request(url + "/v1/completions", {"prompt": "Once upon", "max_tokens": 48})))
                    t.start()
                    st, _ = request(url + "/v1/embeddings", {"input": ref["inputs"]})
                    t.join()
                    check(st == 200 and done["r"][0] == 200, "embeddings beside a running completion")
                    check_llama_server(url, model, ref, log)
            finally:
                stop(proc)
        # without --embeddings: 501; --embeddings on a model that pools nothing: refused at start
        model = os.path.join(tmp, "tiny-qwen3-embed.gguf")
        proc, url = start([BIN, "serve", "-m", model, "-t", "1", "--parallel", "2"], log)
        try:
            st, a = request(url + "/v1/embeddings", {"input": "ab"})
            check(st == 501 and "--embeddings" in a["error"]["message"], "without --embeddings: 501 naming the flag")
        finally:
            stop(proc)
        plain = os.path.join(tmp, "tiny-llama.gguf")
        subprocess.run([BIN, "synth", "--preset", "tiny-llama", "--type", "f32", "-o", plain], check=True,
                       stdout=subprocess.DEVNULL)
        r = subprocess.run([BIN, "serve", "-m", plain, "--embeddings", "--port", "0"], capture_output=True, text=True,
                           timeout=60)
        check(r.returncode != 0 and "--pooling" in r.stderr, "--embeddings on a model without pooling is refused: " +
              r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "")
        proc, url = start([BIN, "serve", "-m", plain, "--embeddings", "--pooling", "last", "-t", "1", "--parallel", "2"],
                          log)
        try:
            st, a = request(url + "/v1/embeddings", {"input": "ab"}) if url else (0, {})
            st2, _ = request(url + "/v1/completions", {"prompt": "ab", "max_tokens": 2}) if url else (0, {})
            check(st == 200 and st2 == 200, "a generation model with --pooling last serves both")
        finally:
            stop(proc)
    print("%d failure(s)" % e2e_http.failures)
    sys.exit(1 if e2e_http.failures else 0)


if __name__ == "__main__":
    main()
