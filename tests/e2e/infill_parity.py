#!/usr/bin/env python3
"""/infill against llama-server itself: a tiny synth model (f32) with the Qwen3
vocabulary (its <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>, <|fim_repo|>
and <|file_sep|> tokens), served by `kvserve serve` and by
../shared/anchor/bin/llama-server with the same context (2048: llama-server
caps a slot at the model's trained context), must give the same greedy
content and the same prompt token count for the same requests: extra files,
a prompt after the prefix, mixed string/id inputs, a prefix or a suffix long
enough to be cut, both (the same 400: past the context). Then the errors: a missing field, a bad extra file, a
model without FIM tokens (501). Exits 77 when the anchor, the vocabulary or
the kvserve binary is absent."""
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_http  # noqa: E402  (the shared helpers; lp.check counts in e2e_http.failures)
import llama_parity as lp  # noqa: E402  (its request/wait helpers)

VOCAB = os.path.join(lp.SHARED, "models", "vocab", "ggml-vocab-qwen3.gguf")


def main():
    if not lp.BIN or not os.path.exists(lp.MODEL):
        lp.skip("no kvserve binary or default model (the build makes it)")
    if not os.access(lp.LLAMA, os.X_OK):
        lp.skip(lp.LLAMA + " not found")
    if not os.path.exists(VOCAB):
        lp.skip(VOCAB + " not found")
    tmp = tempfile.mkdtemp()
    model = os.path.join(tmp, "fim.gguf")
    subprocess.run([lp.BIN, "synth", "--preset", "tiny", "--type", "f32", "--vocab", VOCAB, "-o", model, "-t", "2"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kport, lport, dport = lp.free_port(), lp.free_port(), lp.free_port()
    logs = [os.path.join(tmp, n) for n in ("kvserve.log", "llama.log", "default.log")]
    kv = subprocess.Popen([lp.BIN, "serve", "-m", model, "--port", str(kport), "-c", "2048", "--parallel", "2",
                           "-t", "1"], stderr=open(logs[0], "w"), stdout=subprocess.DEVNULL)
    ll = subprocess.Popen([lp.LLAMA, "-m", model, "--port", str(lport), "-c", "2048", "-np", "1", "-t", "1"],
                          stderr=open(logs[1], "w"), stdout=subprocess.DEVNULL)
    df = subprocess.Popen([lp.BIN, "serve", "-m", lp.MODEL, "--port", str(dport), "-c", "256", "-t", "1"],
                          stderr=open(logs[2], "w"), stdout=subprocess.DEVNULL)
    try:
        ku, lu, du = ("http://127.0.0.1:%d" % p for p in (kport, lport, dport))
        for url, proc, log in ((ku, kv, logs[0]), (lu, ll, logs[1]), (du, df, logs[2])):
            lp.wait_up(url, proc, log)
        code = "".join("def f%d(x):\n    return x * %d\n\n" % (i, i) for i in range(200))
        cases = [
            {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n    return c\n", "prompt": "c ="},
            {"input_prefix": "import os\n", "input_suffix": "print(x)\n",
             "input_extra": [{"filename": "util.py", "text": "def helper():\n    pass\n"},
                             {"text": "# no name\n"}]},
            {"input_prefix": ["x = ", 16, " + "], "input_suffix": ["\n", "y = x"]},
            {"input_prefix": code, "input_suffix": "    return 0\n", "prompt": "def g("},
            {"input_prefix": "x = 1\n", "input_suffix": code, "prompt": "def g("},
            {"input_prefix": "", "input_suffix": ""},
        ]
        keys = ("content", "tokens_evaluated", "tokens_predicted", "stop_type")
        for c in cases:
            c = dict(c, n_predict=8, temperature=0)
            (ks, k), (ls, l) = lp.request(ku + "/infill", c), lp.request(lu + "/infill", c)
            kk, lk = {x: k.get(x) for x in keys}, {x: l.get(x) for x in keys}
            what = "/infill %s" % str(c)[:90]
            lp.check(ks == ls == 200 and kk == lk, what + ("" if kk == lk else ": %s vs %s" % (kk, lk)))
        # a prefix and a suffix both cut to their share overflow a 2048 context in both servers
        c = {"input_prefix": code, "input_suffix": code, "n_predict": 8}
        (ks, k), (ls, l) = lp.request(ku + "/infill", c), lp.request(lu + "/infill", c)
        lp.check(ks == ls == 400 and "2051 tokens" in k["error"]["message"] and l["error"].get("n_prompt_tokens") == 2051,
                 "/infill past the context: %s / %s" % (k["error"]["message"], l["error"]["message"]))
        ev = lp.stream_events(ku + "/infill", dict(cases[0], n_predict=8, temperature=0))
        whole = lp.request(ku + "/infill", dict(cases[0], n_predict=8, temperature=0))[1]
        lp.check("".join(e["content"] for e in ev) == whole["content"] and ev[-1]["stop"], "/infill streamed")
        for body, want in (({"input_suffix": "x"}, "\"input_prefix\" is required"),
                           ({"input_prefix": "x"}, "\"input_suffix\" is required"),
                           ({"input_prefix": "x", "input_suffix": "y", "input_extra": {}}, "must be an array"),
                           ({"input_prefix": "x", "input_suffix": "y", "input_extra": [{"filename": "a"}]},
                            "\"text\" field"),
                           ({"input_prefix": "x", "input_suffix": "y", "prompt": 5}, "\"prompt\" must be a string"),
                           ({"input_prefix": 5, "input_suffix": "y"}, "input_prefix")):
            status, e = lp.request(ku + "/infill", body)
            lp.check(status == 400 and want in e["error"]["message"], "/infill 400: %s" % e["error"]["message"])
        status, e = lp.request(du + "/infill", {"input_prefix": "x", "input_suffix": "y"})
        lp.check(status == 501 and "Infill is not supported by this model" in e["error"]["message"],
                 "/infill on a model without FIM tokens: %d %s" % (status, e["error"]["message"]))
    finally:
        lp.stop_all((kv, ll, df))
        for f in os.listdir(tmp):
            os.unlink(os.path.join(tmp, f))
        os.rmdir(tmp)
    sys.exit(1 if e2e_http.failures else 0)


if __name__ == "__main__":
    main()
