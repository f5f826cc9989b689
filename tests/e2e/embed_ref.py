#!/usr/bin/env python3
"""Writes tests/data/embed-NAME.json from a running llama-server (see
docs/correctness.md, "Embeddings"): the token ids of three inputs
(/tokenize, add_special) and llama-server's /v1/embeddings answer for them
(L2-normalized).

    embed_ref.py PORT OUT.json PRESET TYPE POOLING   (POOLING: file, or the --pooling given)"""
import json
import sys
import urllib.request

INPUTS = ["Hello world, this is a test.", "ab",
          "The quick brown fox jumps over the lazy dog. The quick brown fox jumps again and again."]


def post(port, path, body):
    rq = urllib.request.Request("http://127.0.0.1:%s%s" % (port, path), json.dumps(body).encode(),
                                {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(rq))


def main():
    port, out, preset, typ, pooling = sys.argv[1:6]
    toks = [post(port, "/tokenize", {"content": s, "add_special": True})["tokens"] for s in INPUTS]
    res = post(port, "/v1/embeddings", {"input": INPUTS})
    emb = [d["embedding"] for d in sorted(res["data"], key=lambda d: d["index"])]
    made = "llama-server b10470 (../shared/anchor) --embeddings -ctk f32 -ctv f32 -fa off"
    made += "" if pooling == "file" else " --pooling " + pooling
    made += " on `kvserve synth --preset %s --type %s`; POST /v1/embeddings (L2-normalized, embd_normalize 2)" % (
        preset, typ)
    doc = {"made_with": made, "preset": preset, "type": typ, "pooling": pooling, "inputs": INPUTS, "tokens": toks,
           "prompt_tokens": res["usage"]["prompt_tokens"],
           "embeddings": [[float("%.9g" % v) for v in e] for e in emb]}
    with open(out, "w") as f:
        json.dump(doc, f, separators=(",", ":"))


if __name__ == "__main__":
    main()
