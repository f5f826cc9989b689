#!/usr/bin/env python3
"""Writes tests/data/wpm-PRESET.json from a running llama-server on a WordPiece
("bert") synth file (see docs/correctness.md, "Embeddings"): llama-server's
/tokenize (add_special) of inputs that exercise BERT's pre-tokenization
(lowercasing, accents, punctuation, CJK, control characters, ## pieces, [UNK]).

    wpm_ref.py PORT OUT.json PRESET"""
import json
import sys
import urllib.request

INPUTS = ["Hello world", "jumping foxes!", "\u00dcn\u00efc\u00f6d\u00e9 \u00c0CCENTS", "\u4e2d\u6587 text",
          "tab\tand\nnewline\r\n", "weird \u2603 chars \U0001F600", "   leading and trailing   ", "",
          "x" * 40, "don't stop", "e-mail: a@b.c", "zzzzqqq", "123 456.78", "((nested)) [CLS] [unused3]",
          "embedding models search documents", "a\u00a0b\u3000c", "caf\u00e9 na\u00efve r\u00e9sum\u00e9",
          "ABLE ableness mentment", "ctrl\u0007bell\u001fus"]


def post(port, path, body):
    rq = urllib.request.Request("http://127.0.0.1:%s%s" % (port, path), json.dumps(body).encode(),
                                {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(rq))


def main():
    port, out, preset = sys.argv[1:4]
    toks = [post(port, "/tokenize", {"content": s, "add_special": True})["tokens"] for s in INPUTS]
    doc = {"made_with": "llama-server b10470 (../shared/anchor) /tokenize (add_special true) on `kvserve synth "
                        "--preset %s --type f32`" % preset, "preset": preset, "inputs": INPUTS, "tokens": toks}
    with open(out, "w") as f:
        json.dump(doc, f, ensure_ascii=False, separators=(",", ":"))


if __name__ == "__main__":
    main()
