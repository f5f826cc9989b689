#!/usr/bin/env python3
"""llama-server's routes against llama-server itself: the same requests to
`kvserve serve` and to ../shared/anchor/bin/llama-server (-t 1) on the built-in
default model (a tiny synth file, 512-token SentencePiece vocabulary) must
agree: /tokenize (add_special, parse_special, with_pieces), /detokenize and
/completion's greedy content, token counts and stop_type (whole and
streamed). Then kvserve's own shapes of /props, /slots and the OpenAI routes
without /v1. Exits 77 when the anchor binary or the model is absent."""
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import e2e_http
from e2e_http import check, free_port, skip, stop_all, wait_up

BIN = os.environ.get("KVSERVE_BIN")
SHARED = os.environ.get("KVSERVE_SHARED", "../shared")
LLAMA = os.path.join(SHARED, "anchor", "bin", "llama-server")
MODEL = os.path.join(os.path.dirname(BIN or "."), "default-model.gguf")


def request(url, body=None, raw=False):
    return e2e_http.request(url, body, raw=raw, timeout=30)


def stream_events(url, body):
    status, text = request(url, dict(body, stream=True), raw=True)
    assert status == 200, text
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def sse_pairs(url, body):
    """(event, data) of a stream with named events."""
    status, text = request(url, dict(body, stream=True), raw=True)
    assert status == 200, text
    out, name = [], None
    for line in text.splitlines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            out.append((name, json.loads(line[6:])))
    return out


def check_apis(ku, lu):
    """Anthropic's /v1/messages and OpenAI's /v1/responses against llama-server's own (greedy): the same text,
    token counts (Anthropic's prompt as computed + cache-read parts) and stop reasons; a stream's text and
    Anthropic's event order. Responses' status differs on purpose: kvserve answers OpenAI's "incomplete" with
    incomplete_details when max_output_tokens cut the answer, llama-server "completed"."""
    both = lambda path, body: (request(ku + path, body), request(lu + path, body))
    msgs = {"max_tokens": 8, "temperature": 0, "system": "Be brief.",
            "messages": [{"role": "user", "content": "Hello world"}, {"role": "assistant", "content": "Hi."},
                         {"role": "user", "content": [{"type": "text", "text": "Tell me more"}]}]}
    for rnd in range(2):  # the second time both have the prompt cached
        (ks, k), (ls, l) = both("/v1/messages", msgs)
        ku_, lu_ = k.get("usage", {}), l.get("usage", {})
        same = (ks == ls == 200 and k["content"] == l["content"] and k["stop_reason"] == l["stop_reason"]
                and ku_["output_tokens"] == lu_["output_tokens"]
                and ku_["input_tokens"] + ku_["cache_read_input_tokens"] ==
                lu_["input_tokens"] + lu_["cache_read_input_tokens"])
        check(same, "/v1/messages as llama-server's (round %d)" % rnd + ("" if same else ": %s vs %s" % (k, l)))
    ke, le = sse_pairs(ku + "/v1/messages", msgs), sse_pairs(lu + "/v1/messages", msgs)
    order = lambda ev: [n for i, (n, _) in enumerate(ev) if n != "ping" and (i == 0 or n != ev[i - 1][0])]
    streamed = lambda ev: "".join(d["delta"].get("text", "") for n, d in ev if n == "content_block_delta")
    check(order(ke) == order(le) and streamed(ke) == streamed(le) == k["content"][0]["text"],
          "/v1/messages stream as llama-server's: %s" % order(ke))
    resp = {"max_output_tokens": 8, "temperature": 0, "instructions": "Be brief.", "input": "Hello world"}
    (ks, k), (ls, l) = both("/v1/responses", resp)
    text = lambda r: [c["text"] for o in r.get("output", []) if o["type"] == "message" for c in o["content"]]
    same = (ks == ls == 200 and text(k) == text(l) and k["usage"]["input_tokens"] == l["usage"]["input_tokens"]
            and k["usage"]["output_tokens"] == l["usage"]["output_tokens"])
    check(same, "/v1/responses as llama-server's" + ("" if same else ": %s vs %s" % (k, l)))
    check(k.get("status") == "incomplete" and k.get("incomplete_details") == {"reason": "max_output_tokens"},
          "/v1/responses cut by max_output_tokens is incomplete (OpenAI's answer)")
    kd = [d.get("delta", "") for _, d in sse_pairs(ku + "/v1/responses", resp) if d.get("type") == "response.output_text.delta"]
    ld = [d.get("delta", "") for _, d in sse_pairs(lu + "/v1/responses", resp) if d.get("type") == "response.output_text.delta"]
    check("".join(kd) == "".join(ld) == "".join(text(k)), "/v1/responses stream as llama-server's")


def main():
    if not BIN or not os.path.exists(MODEL):
        skip("no kvserve binary or default model (the build makes it)")
    if not os.access(LLAMA, os.X_OK):
        skip(LLAMA + " not found")
    tmp = tempfile.mkdtemp()
    kport, lport = free_port(), free_port()
    klog, llog = os.path.join(tmp, "kvserve.log"), os.path.join(tmp, "llama.log")
    kv = subprocess.Popen([BIN, "serve", "-m", MODEL, "--port", str(kport), "-c", "512", "--parallel", "2",
                           "-t", "1"], stderr=open(klog, "w"), stdout=subprocess.DEVNULL)
    # the server-wide sampling flags: a request without the fields must sample as one that names them
    fport, flog = free_port(), os.path.join(tmp, "flags.log")
    flags = {"temperature": 0.9, "top_k": 5, "top_p": 0.8, "min_p": 0.1, "repeat_penalty": 1.3, "seed": 7}
    fl = subprocess.Popen([BIN, "serve", "-m", MODEL, "--port", str(fport), "-c", "512", "--parallel", "1", "-t", "1",
                           "--temp", "0.9", "--top-k", "5", "--top-p", "0.8", "--min-p", "0.1",
                           "--repeat-penalty", "1.3", "--seed", "7"], stderr=open(flog, "w"), stdout=subprocess.DEVNULL)
    ll = subprocess.Popen([LLAMA, "-m", MODEL, "--port", str(lport), "-c", "512", "-np", "1", "-t", "1"],
                          stderr=open(llog, "w"), stdout=subprocess.DEVNULL)
    try:
        ku, lu = "http://127.0.0.1:%d" % kport, "http://127.0.0.1:%d" % lport
        wait_up(ku, kv, klog)
        wait_up(lu, ll, llog)
        fu = "http://127.0.0.1:%d" % fport
        wait_up(fu, fl, flog)
        for path, key, base in (("/v1/completions", None, {"prompt": "Hello world", "max_tokens": 24}),
                                ("/completion", "content", {"prompt": "Hello world", "n_predict": 24})):
            a, b = request(fu + path, base)[1], request(ku + path, dict(base, **flags))[1]
            ta = a[key] if key else a["choices"][0]["text"]
            tb = b[key] if key else b["choices"][0]["text"]
            check(ta == tb and len(ta) > 0, "%s: the flags' defaults sample as the explicit fields (%r)" % (path, ta))
        params = request(fu + "/props")[1]["default_generation_settings"]["params"]
        check(all(abs(params[k] - v) < 1e-6 for k, v in flags.items()), "/props reports the flags: %s" % params)
        both = lambda path, body: (request(ku + path, body), request(lu + path, body))

        texts = ["Hello world", "  two  spaces\nand a line", "caf\u00e9 \u4e16\u754c \U0001F600", "<s> special </s>", ""]
        for t in texts:
            for extra in ({}, {"add_special": True}, {"with_pieces": True}, {"parse_special": False}):
                (ks, k), (ls, l) = both("/tokenize", dict(extra, content=t))
                check(ks == ls == 200 and k == l, "/tokenize %r %s" % (t, extra) + ("" if k == l else ": %s vs %s" % (k, l)))
        # (ids 4.. : byte 0x00, id 3, is U+FFFD in kvserve's JSON, \u0000 in llama-server's)
        for ids in ([1, 300, 20, 5, 100], [259, 299, 495], [2], [], list(range(4, 40)), [4, 240, 300]):
            (ks, k), (ls, l) = both("/detokenize", {"tokens": ids})
            check(ks == ls == 200 and k == l, "/detokenize %s" % ids[:6] + ("" if k == l else ": %s vs %s" % (k, l)))

        keys = ("content", "tokens_predicted", "tokens_evaluated", "stop_type", "stopping_word", "stop")
        cases = [{"prompt": "Hello world", "n_predict": 16},
                 {"prompt": [1, 300, 20, 5, 100], "n_predict": 12},
                 {"prompt": "abc def", "max_tokens": 10, "cache_prompt": False},
                 {"prompt": "1 2 3", "n_predict": 8},
                 {"prompt": "Hello world", "n_predict": 30, "stop": ["ddd"]},
                 # logit_bias: llama-server's [[id, false]], [["text", bias]] and positive biases, OpenAI's object
                 {"prompt": "Hello world", "n_predict": 8, "logit_bias": [[327, False], [3, False]]},
                 {"prompt": "Hello world", "n_predict": 8, "logit_bias": [["d", -100], [338, -100]]},
                 {"prompt": "Hello world", "n_predict": 8, "logit_bias": {"327": -100, "3": -100}},
                 {"prompt": "Hello world", "n_predict": 6, "logit_bias": [[300, 30], [301, 2.5]]}]
        for c in cases:
            c = dict(c, temperature=0)
            (ks, k), (ls, l) = both("/completion", c)
            kk, lk = {x: k.get(x) for x in keys}, {x: l.get(x) for x in keys}
            check(ks == ls == 200 and kk == lk, "/completion %s" % json.dumps(c) + ("" if kk == lk else ": %s vs %s" % (kk, lk)))
            ev = stream_events(ku + "/completion", c)
            text = "".join(e["content"] for e in ev)
            check(text == l["content"] and ev[-1]["stop"] and ev[-1]["stop_type"] == l["stop_type"]
                  and not any(e["stop"] for e in ev[:-1]), "/completion stream %s" % json.dumps(c))
        # n_probs: the same alternatives with the same log-probabilities (within 0.02: the two engines' logits differ by that much at the default KV precision); the
        # texts differ only for byte 0x00 (id 3), U+FFFD in kvserve's JSON
        c = {"prompt": "Hello world", "n_predict": 4, "n_probs": 2, "temperature": 0}  # the 3rd is a near tie
        (ks, k2), (ls, l2) = both("/completion", c)
        kp, lp = k2.get("completion_probabilities", []), l2.get("completion_probabilities", [])
        same = len(kp) == len(lp) == 4 and all(
            a["id"] == b["id"] and (a["token"] == b["token"] or a["id"] == 3) and a["bytes"] == b["bytes"]
            and abs(a["logprob"] - b["logprob"]) < 2e-2
            and [x["id"] for x in a["top_logprobs"]] == [x["id"] for x in b["top_logprobs"]]
            and all(abs(x["logprob"] - y["logprob"]) < 2e-2 for x, y in zip(a["top_logprobs"], b["top_logprobs"]))
            for a, b in zip(kp, lp))
        check(ks == ls == 200 and same, "/completion n_probs" + ("" if same else ": %s vs %s" % (kp[:1], lp[:1])))
        ev = stream_events(ku + "/completion", c)
        streamed = [p for e in ev for p in e.get("completion_probabilities", [])]
        check([p["id"] for p in streamed] == [p["id"] for p in kp], "/completion n_probs streamed")
        # post_sampling_probs: the final distribution's probabilities ("prob", "top_probs"); greedy lists the
        # token alone with probability 1; sampled, the first step's alternatives (the draws then differ)
        for c in ({"prompt": "Hello world", "n_predict": 3, "n_probs": 3, "post_sampling_probs": True, "temperature": 0},
                  {"prompt": "Hello world", "n_predict": 1, "n_probs": 3, "post_sampling_probs": True,
                   "temperature": 0.8, "top_k": 10}):
            for _ in range(8):  # a sampled end-of-generation token has no entry in llama-server's list: draw again
                (ks, k3), (ls, l3) = both("/completion", c)
                kp, lp = k3.get("completion_probabilities", []), l3.get("completion_probabilities", [])
                if len(kp) == len(lp):
                    break
            alts = lambda e: [(x["id"], x["token"] if x["id"] != 3 else "", x["bytes"]) for x in e["top_probs"]]
            same = ks == ls == 200 and len(kp) == len(lp) and all(
                set(a) == {"id", "token", "bytes", "prob", "top_probs"} and alts(a) == alts(b)
                and all(abs(x["prob"] - y["prob"]) < 2e-2 for x, y in zip(a["top_probs"], b["top_probs"]))
                and (c["temperature"] > 0 or (a["id"] == b["id"] and a["prob"] == b["prob"] == 1)) for a, b in zip(kp, lp))
            check(same, "/completion post_sampling_probs at temperature %g" % c["temperature"] +
                  ("" if same else ": %s vs %s" % (kp, lp)))
        t = k["timings"]
        check(all(x in t for x in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second")),
              "/completion timings")

        status, p = request(ku + "/props")
        g = p.get("default_generation_settings", {})
        check(status == 200 and p.get("total_slots") == 2 and p.get("n_ctx") == 512 and g.get("n_ctx") == 512
              and abs(g.get("params", {}).get("temperature", 0) - 0.8) < 1e-6 and p.get("model_path") == MODEL
              and isinstance(p.get("chat_template"), str) and p["chat_template"], "/props: %s" % json.dumps(p)[:300])
        # a long request shows in /slots while it runs, with its context and KV figures
        import threading
        long = threading.Thread(target=request, args=(ku + "/completion", {"prompt": [1, 300, 20], "n_predict": 150,
                                                                           "ignore_eos": True, "temperature": 0}))
        long.start()
        seen = None
        for _ in range(200):
            status, s = request(ku + "/slots")
            seen = next((e for e in s if e.get("n_prompt_tokens") == 3), None)
            if seen:
                break
            time.sleep(0.01)
        long.join()
        check(seen is not None and seen["n_ctx"] == 512 and seen["kv_pages"] >= 1 and seen["tokens"] >= 3
              and "cached_tokens" in seen and "id" in seen, "/slots while running: %s" % seen)
        for path in ("/models", "/v1/models"):
            status, m = request(ku + path)
            check(status == 200 and m["data"][0]["id"] == "default-model.gguf", "GET " + path)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
        a, b = request(ku + "/chat/completions", body), request(ku + "/v1/chat/completions", body)
        check(a[0] == 200 and a[1]["choices"][0]["message"] == b[1]["choices"][0]["message"], "POST /chat/completions")
        body = {"prompt": "Hello world", "max_tokens": 6, "temperature": 0}
        a, b = request(ku + "/completions", body), request(ku + "/v1/completions", body)
        check(a[0] == 200 and a[1]["choices"][0]["text"] == b[1]["choices"][0]["text"], "POST /completions")
        # both completion routes parse special-token text in the prompt, as llama-server's do
        a = request(ku + "/tokenize", {"content": "Hello world", "add_special": True})[1]["tokens"]
        b = request(ku + "/completion", {"prompt": "Hello world", "n_predict": 0})[1]["tokens_evaluated"]
        check(b == len(a), "/completion counts its prompt as /tokenize with add_special")
        body = {"prompt": "Hello </s> world", "max_tokens": 6, "temperature": 0}
        (ks, k), (ls, l) = both("/v1/completions", body)
        check(ks == ls == 200 and k["usage"]["prompt_tokens"] == l["usage"]["prompt_tokens"] == 14
              and k["choices"][0]["text"] == l["choices"][0]["text"],
              "/v1/completions parses </s> in its prompt as llama-server: %s vs %s" % (k.get("usage"), l.get("usage")))
        # several prompts on /completion: llama-server's array of answers, in prompt order
        body = {"prompt": ["Hello world", [1, 300, 20]], "n_predict": 10, "temperature": 0}
        (ks, k), (ls, l) = both("/completion", body)
        pick = lambda a: [{x: e.get(x) for x in ("index", "content", "tokens_predicted", "tokens_evaluated")} for e in a]
        check(ks == ls == 200 and isinstance(k, list) and pick(k) == pick(l),
              "/completion with several prompts" + ("" if ks == 200 and pick(k) == pick(l) else ": %s vs %s" % (k, l)))
        # /apply-template: the same prompt text for the same conversations; the built-in ChatML prints neither
        # an assistant's tool_calls nor the tools, and a tool result that is JSON text stays that text
        calls = [{"id": "call_1", "type": "function",
                  "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
        ask = {"role": "user", "content": "Weather in Paris?"}
        for msgs in ([{"role": "user", "content": "Hello world"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "More"}],
                     [ask, {"role": "assistant", "content": None, "tool_calls": calls},
                      {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 18,  \"unit\": \"c\"}"},
                      {"role": "user", "content": "And Rome?"}],
                     [ask, {"role": "assistant", "content": "Let me look.", "tool_calls": calls},
                      {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "[1,2]"}]}]):
            for extra in ({}, {"tools": tools}):
                (ks, k), (ls, l) = both("/apply-template", dict(extra, messages=msgs))
                check(ks == ls == 200 and k == l, "/apply-template %d messages%s" % (len(msgs), " with tools" * bool(extra))
                      + ("" if k == l else ": %s vs %s" % (k, l)))
        check_apis(ku, lu)
    finally:
        stop_all((kv, ll, fl))
    sys.exit(1 if e2e_http.failures else 0)


if __name__ == "__main__":
    main()
