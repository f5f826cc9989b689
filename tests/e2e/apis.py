#!/usr/bin/env python3
"""Anthropic's POST /v1/messages (+ count_tokens) and OpenAI's POST /v1/responses
on the built-in default model, checked against /v1/chat/completions, the route
both map onto: the same text (greedy, or sampled with the server's --seed) and token counts whole and streamed, the
streams' event sequences, a grammar-forced tool call and its round trip,
reasoning (a template whose generation prompt opens <think>) as thinking
blocks / reasoning items, x-api-key, and bad input as a 400 in each API's own
error shape. Exits 77 when the binary or the default model is absent."""
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import e2e_http
from e2e_http import check, free_port

BIN = os.environ.get("KVSERVE_BIN")
MODEL = os.path.join(os.path.dirname(BIN or "."), "default-model.gguf")
KEY = "k-e2e"

# chatml whose generation prompt opens <think> (DeepSeek-R1's way): the output starts in the reasoning
THINK_TEMPLATE = (
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}<|im_end|>\n"
    "{% endfor -%}{%- if add_generation_prompt -%}<|im_start|>assistant\n<think>\n{%- endif -%}")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8}},
           "required": ["city"]}


def request(url, body, headers=None, raw=False):
    """e2e_http.request with this server's x-api-key (headers may replace it, or drop it with None)."""
    return e2e_http.request(url, body, raw=raw, headers=dict({"x-api-key": KEY}, **(headers or {})))

def sse(url, body):
    """The stream's events as (event line, data object) pairs."""
    status, text = request(url, dict(body, stream=True), raw=True)
    assert status == 200, text
    events = []
    for block in text.split("\n\n"):
        lines = dict(l.split(": ", 1) for l in block.splitlines() if ": " in l)
        if "data" in lines:
            events.append((lines.get("event"), json.loads(lines["data"])))
    return events


def start(args, log):
    port = free_port()
    p = subprocess.Popen([BIN, "serve", "-m", MODEL, "--alias", "any", "--port", str(port), "-c", "1024", "--parallel", "2", "-t", "1"]
                         + args, stderr=open(log, "w"), stdout=subprocess.DEVNULL)
    url = "http://127.0.0.1:%d" % port
    for _ in range(300):
        if p.poll() is not None:
            sys.exit("server exited at start: " + open(log).read()[-2000:])
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return p, url
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.05)
    sys.exit("server did not start: " + open(log).read()[-2000:])


def chat(url, messages, **kw):
    return request(url + "/v1/chat/completions", dict({"temperature": 0}, messages=messages, **kw))[1]


# ---- Anthropic ------------------------------------------------------------------------

def anthropic(url):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "a story"}]}]
    body = {"model": "any", "system": [{"type": "text", "text": "You tell stories."}], "messages": msgs,
            "max_tokens": 16, "temperature": 1}
    ref = chat(url, [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Tell me\na story"}],
               max_tokens=16, temperature=1)
    st, m = request(url + "/v1/messages", body)
    ref_text = ref["choices"][0]["message"]["content"]
    check(st == 200 and m["type"] == "message" and m["role"] == "assistant" and m["id"].startswith("msg_"),
          "messages: a message object")
    check([b["type"] for b in m["content"]] == ["text"] and m["content"][0]["text"] == ref_text,
          "messages: the chat route's text, sampled with the server's --seed (%r)" % ref_text)
    check(m["stop_reason"] == "max_tokens" and m["stop_sequence"] is None, "messages: stop_reason max_tokens")
    # the prompt in Anthropic's parts: computed, and served by the prefix cache (the chat request above computed it)
    mu = m["usage"]
    check(mu["input_tokens"] + mu["cache_read_input_tokens"] == ref["usage"]["prompt_tokens"] and
          mu["cache_read_input_tokens"] > 0 and mu["cache_creation_input_tokens"] == 0 and mu["output_tokens"] == 16,
          "messages: usage %s" % mu)
    st, n = request(url + "/v1/messages/count_tokens", {k: v for k, v in body.items() if k != "max_tokens"})
    check(st == 200 and n == {"input_tokens": ref["usage"]["prompt_tokens"]}, "count_tokens: %s" % n)
    greedy = dict(body, temperature=0)
    st, a = request(url + "/v1/messages", greedy)
    st2, c = request(url + "/v1/messages", dict(greedy, model="claude-sonnet-4-5"))
    check(st == st2 == 200 and c["content"] == a["content"] and c["model"] == "any",
          "messages: any model name is this server's model (Claude Code's names)")

    ev = sse(url + "/v1/messages", body)
    types = [d["type"] for _, d in ev]
    check(all(e == d["type"] for e, d in ev), "stream: each event line names its data's type")
    check(types[:3] == ["message_start", "ping", "content_block_start"] and types[-3:] ==
          ["content_block_stop", "message_delta", "message_stop"] and
          set(types[3:-3]) == {"content_block_delta"}, "stream: Anthropic's event sequence")
    streamed = "".join(d["delta"]["text"] for _, d in ev if d["type"] == "content_block_delta")
    start_msg, delta = ev[0][1]["message"], ev[-2][1]
    check(streamed == ref_text, "stream: the same text")
    su = start_msg["usage"]
    check(su["input_tokens"] + su["cache_read_input_tokens"] == ref["usage"]["prompt_tokens"] and
          start_msg["content"] == [], "stream: message_start with the input tokens %s" % su)
    check(delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None} and
          delta["usage"]["output_tokens"] == 16, "stream: message_delta %s" % delta)

    # stop_sequences: cut before the match, stop_reason stop_sequence, whole and streamed
    long = request(url + "/v1/messages", dict(body, max_tokens=24))[1]["content"][0]["text"]
    stop = long[len(long) // 2:len(long) // 2 + 2]
    cut = request(url + "/v1/messages", dict(body, max_tokens=24, stop_sequences=["\x07never", stop]))[1]
    check(cut["content"][0]["text"] == long[:long.index(stop)] and cut["stop_reason"] == "stop_sequence" and
          cut["stop_sequence"] == stop, "stop_sequences: cut at %r" % stop)
    delta = sse(url + "/v1/messages", dict(body, max_tokens=24, stop_sequences=[stop]))[-2][1]["delta"]
    check(delta == {"stop_reason": "stop_sequence", "stop_sequence": stop}, "stop_sequences: streamed %s" % delta)

    # a grammar-forced tool call, whole and streamed, and its round trip
    tools = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    tb = {"messages": ask, "tools": tools, "tool_choice": {"type": "tool", "name": "get_weather"},
          "max_tokens": 120, "temperature": 0}
    m = request(url + "/v1/messages", tb)[1]
    use = [b for b in m["content"] if b["type"] == "tool_use"]
    check(m["stop_reason"] == "tool_use" and len(use) == 1 and use[0]["name"] == "get_weather" and
          isinstance(use[0]["input"].get("city"), str) and 1 <= len(use[0]["input"]["city"]) <= 8,
          "tool_choice tool: a tool_use block %s" % use)
    ev = sse(url + "/v1/messages", tb)
    starts = [d["content_block"] for _, d in ev if d["type"] == "content_block_start"]
    args = "".join(d["delta"]["partial_json"] for _, d in ev
                   if d["type"] == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    check(len(starts) == 1 and starts[0]["id"].startswith("call_") and
          dict(starts[0], id="") == {"type": "tool_use", "id": "", "name": "get_weather", "input": {}} and
          json.loads(args) == use[0]["input"] and
          ev[-2][1]["delta"]["stop_reason"] == "tool_use", "tool_choice tool: streamed as input_json_delta")
    any_ = request(url + "/v1/messages", dict(tb, tool_choice={"type": "any"}))[1]
    check(any_["stop_reason"] == "tool_use", "tool_choice any: a tool_use")
    result = "RESULT-7431: 18 degrees"
    thread = ask + [{"role": "assistant", "content": [{"type": "text", "text": "Checking."}, use[0]]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0]["id"], "content": result},
                                                 {"type": "text", "text": "Thanks!"}]}]
    st, back = request(url + "/v1/messages", {"messages": thread, "tools": tools, "max_tokens": 4, "temperature": 0})
    ref = chat(url, [ask[0], {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": use[0]["id"], "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps(use[0]["input"])}}]},
        {"role": "tool", "tool_call_id": use[0]["id"], "content": result}, {"role": "user", "content": "Thanks!"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                  "parameters": WEATHER}}], max_tokens=4)
    check(st == 200 and back["usage"]["input_tokens"] + back["usage"]["cache_read_input_tokens"] ==
          ref["usage"]["prompt_tokens"] and back["content"][0]["text"] == ref["choices"][0]["message"]["content"],
          "round trip: tool_use + tool_result render as the chat route's tool_calls + tool message")

    # bad input: 400 in Anthropic's error shape
    for what, b in (("no max_tokens", {"messages": ask}),
                    ("an image block", {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]}),
                    ("a document block", {"max_tokens": 4, "messages": [{"role": "user", "content": [
                        {"type": "text", "text": "x"}, {"type": "document", "source": {}}]}]}),
                    ("an image in a tool_result", {"max_tokens": 4, "messages": [{"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}]}]}),
                    ("an image block in system", {"max_tokens": 4, "messages": ask, "system": [{"type": "image"}]}),
                    ("an unknown field", {"max_tokens": 4, "messages": ask, "container": "x"}),
                    ("a system role in messages", {"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}),
                    ("tool_choice without tools", {"max_tokens": 4, "messages": ask, "tool_choice": {"type": "any"}}),
                    ("a body that is not JSON", "{nope")):
        st, e = request(url + "/v1/messages", b)
        check(st == 400 and e.get("type") == "error" and e["error"]["type"] == "invalid_request_error" and
              e["error"]["message"], "400 %s: %s" % (what, e.get("error", e)))
        # a part kvserve cannot read is refused by its place and type, never dropped
        want = {"an image block": "messages[0].content[0]", "a document block": "type 'document'",
                "an image in a tool_result": "messages[0].content[0].content[0].type 'image'",
                "an image block in system": "system[0].type 'image'"}.get(what, "")
        check(want in e.get("error", {}).get("message", ""), "400 %s names %s" % (what, want))


# ---- Responses ------------------------------------------------------------------------

def responses(url):
    ref = chat(url, [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Tell me a story"}],
               max_tokens=16, temperature=1)
    ref_text = ref["choices"][0]["message"]["content"]
    body = {"model": "any", "instructions": "You tell stories.", "max_output_tokens": 16, "temperature": 1,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "Tell me a story"}]}]}
    st, e = request(url + "/v1/responses", dict(body, model="gpt-5"))
    check(st == 404 and e["error"]["code"] == "model_not_found", "responses: a model not served is a 404")
    st, r = request(url + "/v1/responses", body)
    out = r.get("output", [])
    check(st == 200 and r["object"] == "response" and r["id"].startswith("resp_"), "responses: a response object")
    check([o["type"] for o in out] == ["message"] and out[0]["content"][0]["type"] == "output_text" and
          out[0]["content"][0]["text"] == ref_text, "responses: the chat route's text (%r)" % ref_text)
    check(r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"},
          "responses: cut by max_output_tokens is incomplete")
    u = r["usage"]
    check(u["input_tokens"] == ref["usage"]["prompt_tokens"] and u["output_tokens"] == 16 and
          u["total_tokens"] == u["input_tokens"] + 16, "responses: usage %s" % u)
    st, s = request(url + "/v1/responses", dict(body, input="Tell me a story"))
    check(s["output"][0]["content"][0]["text"] == ref_text, "responses: input as a string")

    ev = sse(url + "/v1/responses", body)
    types = [d["type"] for _, d in ev]
    check(all(e == d["type"] for e, d in ev) and [d["sequence_number"] for _, d in ev] == list(range(len(ev))),
          "stream: event lines and sequence numbers")
    check(types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                        "response.content_part.added"] and
          types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                         "response.incomplete"] and set(types[4:-4]) == {"response.output_text.delta"},
          "stream: the Responses event sequence")
    deltas = "".join(d["delta"] for _, d in ev if d["type"] == "response.output_text.delta")
    final = ev[-1][1]["response"]
    check(deltas == ref_text and ev[-4][1]["text"] == ref_text and
          final["output"][0]["content"][0]["text"] == ref_text and final["usage"]["output_tokens"] == 16,
          "stream: the same text in the deltas, the .done events and the final response")

    # a grammar-forced function call, whole and streamed, and its round trip
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}]
    tb = {"input": "What is the weather in Paris?", "tools": tools, "tool_choice": "required",
          "max_output_tokens": 120, "temperature": 0}
    r = request(url + "/v1/responses", tb)[1]
    calls = [o for o in r["output"] if o["type"] == "function_call"]
    args = json.loads(calls[0]["arguments"]) if calls else {}
    check(r["status"] == "completed" and len(calls) == 1 and calls[0]["name"] == "get_weather" and
          isinstance(args.get("city"), str), "tool_choice required: a function_call item %s" % calls)
    ev = sse(url + "/v1/responses", dict(tb, tool_choice={"type": "function", "name": "get_weather"}))
    done = [d for _, d in ev if d["type"] == "response.function_call_arguments.done"]
    streamed = "".join(d["delta"] for _, d in ev if d["type"] == "response.function_call_arguments.delta")
    check(len(done) == 1 and done[0]["arguments"] == streamed == calls[0]["arguments"] and
          ev[-1][1]["type"] == "response.completed" and
          ev[-1][1]["response"]["output"][0]["type"] == "function_call", "tool_choice named: streamed arguments")
    result = "RESULT-7431: 18 degrees"
    thread = [{"role": "user", "content": "What is the weather in Paris?"},
              {"type": "function_call", "call_id": calls[0]["call_id"], "name": "get_weather",
               "arguments": calls[0]["arguments"]},
              {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": result}]
    st, back = request(url + "/v1/responses", {"input": thread, "tools": tools, "max_output_tokens": 4, "temperature": 0})
    ref = chat(url, [{"role": "user", "content": "What is the weather in Paris?"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": calls[0]["call_id"], "type": "function",
                          "function": {"name": "get_weather", "arguments": calls[0]["arguments"]}}]},
                     {"role": "tool", "tool_call_id": calls[0]["call_id"], "content": result}],
               tools=[{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                         "parameters": WEATHER}}], max_tokens=4)
    check(st == 200 and back["usage"]["input_tokens"] == ref["usage"]["prompt_tokens"],
          "round trip: function_call + function_call_output render as the chat route's")

    # text.format json_schema constrains the output
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    r = request(url + "/v1/responses", {"input": "x", "max_output_tokens": 40, "temperature": 0,
                                        "text": {"format": {"type": "json_schema", "name": "o", "schema": schema}}})[1]
    obj = json.loads(r["output"][0]["content"][0]["text"])
    check(list(obj) == ["a"] and isinstance(obj["a"], int), "text.format json_schema: %s" % obj)

    for what, b, name in (("input of a bad type", {"input": 5}, "input"),
                          ("an image part", {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
                           "input[0].content[0].type 'input_image'"),
                          ("a file part", {"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"},
                                                                               {"type": "input_file", "file_id": "f"}]}]},
                           "input[0].content[1].type 'input_file'"),
                          ("an image as a tool's output", {"input": [{"type": "function_call_output", "call_id": "c",
                                                                      "output": [{"type": "input_image"}]}]},
                           "input[0].output[0].type 'input_image'"),
                          ("text.verbosity", {"input": "x", "text": {"verbosity": "low"}}, "'text.verbosity'"),
                          ("a web_search tool", {"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
                          ("previous_response_id", {"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
                          ("a negative max_output_tokens", {"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
                          ("a schema keyword outside the subset", {"input": "x", "text": {"format": {
                              "type": "json_schema", "name": "o", "schema": {"type": "string", "pattern": "a+"}}}},
                           "'text.format.schema'")):
        st, e = request(url + "/v1/responses", b)
        err = e.get("error", {})
        check(st == 400 and err.get("type") == "invalid_request_error" and name in err.get("message", ""),
              "400 %s: %s" % (what, err.get("message")))


def auth(url):
    body = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    check(request(url + "/v1/messages", body)[0] == 200, "x-api-key: accepted")
    check(request(url + "/v1/messages", body, {"x-api-key": None, "Authorization": "Bearer " + KEY})[0] == 200,
          "Authorization Bearer: accepted")
    st, e = request(url + "/v1/messages", body, {"x-api-key": "wrong"})
    check(st == 401 and e["type"] == "error" and e["error"]["type"] == "authentication_error",
          "a wrong key on /v1/messages: Anthropic's 401")
    st, e = request(url + "/v1/responses", {"input": "hi"}, {"x-api-key": None})
    check(st == 401 and e["error"]["code"] == "invalid_api_key", "no key on /v1/responses: OpenAI's 401")


def thinking(url):
    body = {"max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": "Think"}]}
    m = request(url + "/v1/messages", body)[1]
    check([b["type"] for b in m["content"]] in (["thinking"], ["thinking", "text"]) and m["content"][0]["thinking"],
          "messages: the reasoning is a thinking block")
    ev = sse(url + "/v1/messages", body)
    starts = [d["content_block"]["type"] for _, d in ev if d["type"] == "content_block_start"]
    th = "".join(d["delta"].get("thinking", "") for _, d in ev if d["type"] == "content_block_delta")
    check(starts[0] == "thinking" and th == m["content"][0]["thinking"], "stream: thinking_delta events")
    r = request(url + "/v1/responses", {"input": "Think", "max_output_tokens": 8, "temperature": 0})[1]
    check(r["output"][0]["type"] == "reasoning" and
          r["output"][0]["content"][0]["text"] == m["content"][0]["thinking"], "responses: a reasoning item")
    ev = sse(url + "/v1/responses", {"input": "Think", "max_output_tokens": 8, "temperature": 0})
    rs = "".join(d["delta"] for _, d in ev if d["type"] == "response.reasoning_text.delta")
    check(rs == m["content"][0]["thinking"] and ev[-1][1]["response"]["output"][0]["type"] == "reasoning",
          "responses stream: reasoning_text deltas")


def main():
    if not BIN or not os.path.exists(MODEL):
        print("skipped: no kvserve binary or default model (the build makes it)")
        sys.exit(77)
    tmp = tempfile.mkdtemp()
    tmpl = os.path.join(tmp, "think.jinja")
    with open(tmpl, "w") as f:
        f.write(THINK_TEMPLATE)
    # --seed: every request samples with seed 7, so a sampled text is reproducible across the routes
    a, aurl = start(["--api-key", KEY, "--seed", "7"], os.path.join(tmp, "a.log"))
    b, burl = start(["--chat-template-file", tmpl], os.path.join(tmp, "b.log"))
    try:
        anthropic(aurl)
        responses(aurl)
        auth(aurl)
        thinking(burl)
    finally:
        for p, log in ((a, "a.log"), (b, "b.log")):
            p.terminate()
            code = p.wait(timeout=60)
            # 0 after SIGTERM: a clean shutdown (and, in a sanitizer build, no report)
            check(code == 0, "server %s exited %s" % (log, code) + ("" if code == 0 else ":\n" +
                                                                      open(os.path.join(tmp, log)).read()[-4000:]))
    print("%d failed" % e2e_http.failures)
    sys.exit(1 if e2e_http.failures else 0)


if __name__ == "__main__":
    main()
