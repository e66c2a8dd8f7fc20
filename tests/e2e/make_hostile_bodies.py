"""Write tests/e2e/hostile_bodies.json, the corpus test_fuzz.py sends: request bodies a hostile
or careless client sends to the six generation routes (types, ranges, sizes, nesting, unicode,
unknown fields, huge lengths, n, logprob counts). Run from the repository root; a long string or
list is written as {"$repeat": [value, count]}, raw text in parts as "raw_parts"."""
import base64, json

ROUTES = {
    "/v1/chat/completions": {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    "/v1/completions": {"model": "default", "prompt": "Hi", "max_tokens": 4},
    "/generate": {"text": "Hi", "sampling_params": {"max_new_tokens": 4}},
    "/v1/messages": {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
    "/api/chat": {"model": "default", "stream": False, "messages": [{"role": "user", "content": "Hi"}], "options": {"num_predict": 4}},
    "/api/generate": {"model": "default", "stream": False, "prompt": "Hi", "options": {"num_predict": 4}},
}
# where each route keeps its text, its output length and its sampling knobs
TEXT = {"/v1/chat/completions": ("messages", 0, "content"), "/v1/completions": ("prompt",),
        "/generate": ("text",), "/v1/messages": ("messages", 0, "content"),
        "/api/chat": ("messages", 0, "content"), "/api/generate": ("prompt",)}
LENGTH = {"/v1/chat/completions": ("max_tokens",), "/v1/completions": ("max_tokens",),
          "/generate": ("sampling_params", "max_new_tokens"), "/v1/messages": ("max_tokens",),
          "/api/chat": ("options", "num_predict"), "/api/generate": ("options", "num_predict")}
KNOBS = {"/v1/chat/completions": ((), ["temperature", "top_p", "n", "seed", "stop", "logprobs", "top_logprobs", "presence_penalty", "logit_bias", "stream", "response_format", "tools", "tool_choice"]),
         "/v1/completions": ((), ["temperature", "top_p", "n", "seed", "stop", "logprobs", "echo", "best_of", "logit_bias", "stream", "suffix"]),
         "/generate": (("sampling_params",), ["temperature", "top_p", "top_k", "min_p", "n", "seed", "stop", "stop_token_ids", "regex", "json_schema", "ebnf", "logit_bias", "repetition_penalty"]),
         "/v1/messages": ((), ["temperature", "top_p", "top_k", "stop_sequences", "stream", "system", "metadata"]),
         "/api/chat": (("options",), ["temperature", "top_p", "top_k", "seed", "stop", "num_ctx", "repeat_penalty"]),
         "/api/generate": (("options",), ["temperature", "top_p", "top_k", "seed", "stop", "num_ctx"])}
NATIVE_TOP = ["return_logprob", "top_logprobs_num", "logprob_start_len", "token_ids_logprob", "rid", "stream", "input_ids", "session_params"]
WRONG = ["x", True, [], {}, None, -1, 0, 1.5, 2**31, 2**63, -2**63 - 1, 10**400 // 10**360, 1e308, [1, "a"], {"a": {"b": []}}]
HUGE = [2**31, 2**63, 400000, 10**30, -1, -2**31]


def put(body, path, value):
    node = body
    for key in path[:-1]:
        if isinstance(node, list):
            node = node[key]
        else:
            node = node.setdefault(key, {})
    node[path[-1]] = value


def fresh(route):
    return json.loads(json.dumps(ROUTES[route]))


corpus = []


def add(route, why, body=None, raw=None, raw_bytes=None, raw_end=None, raw_mid=""):
    entry = {"route": route, "why": why}
    if raw_end is not None:  # raw text as parts: head (repeated), middle, tail (repeated)
        entry["raw_parts"] = [raw, raw_mid, raw_end]
        corpus.append(entry)
        return
    if raw_bytes is not None:
        entry["raw_base64"] = base64.b64encode(raw_bytes).decode()
    elif raw is not None:
        entry["raw"] = raw
    else:
        entry["json"] = body
    corpus.append(entry)


for route in ROUTES:
    # the whole body
    for raw in ["", " ", "null", "[]", "[1, 2]", '"text"', "42", "{", '{"model": ', "{}}", "{'a': 1}",
                '{"a": NaN}', '{"a": Infinity}', "\x00", '{"model": "default"}']:
        add(route, f"body {raw[:12]!r}", raw=raw)
    add(route, "invalid UTF-8 bytes", raw_bytes=b'{"prompt": "\xff\xfe\xc0\xaf"}')
    add(route, "UTF-16 body", raw_bytes=json.dumps(ROUTES[route]).encode("utf-16"))
    add(route, "nested 70 deep", raw='{"x": ' + "[" * 70 + "]" * 70 + "}")
    add(route, "nested 5000 deep", raw={"$repeat": ["[", 5000]}, raw_end={"$repeat": ["]", 5000]})
    add(route, "nested objects 2000 deep", raw={"$repeat": ['{"a":', 2000]}, raw_end={"$repeat": ["}", 2000]}, raw_mid="1")
    add(route, "duplicate keys", raw=json.dumps(ROUTES[route])[:-1] + ', "model": 1}')
    # unknown fields
    body = fresh(route); body["no_such_field"] = 1; add(route, "unknown field", body)
    body = fresh(route); body["__proto__"] = {"x": 1}; add(route, "prototype key", body)
    # the text: types, sizes, unicode
    for value in [None, 1, True, [], {}, [1, 2], "", " ", "\x00", "a\x00b", "\u202e\u202d", {"$repeat": ["😀", 50]},
                  "\ufffd\ufeff", {"$repeat": ["a", 200_000]}, {"$repeat": ["Hi ", 30_000]},
                  {"$repeat": ["<|im_start|>system\n<|im_end|>", 50]}]:
        body = fresh(route); put(body, TEXT[route], value)
        add(route, f"text {str(value)[:24]!r}", body)
    add(route, "lone surrogate in the text", raw=json.dumps(ROUTES[route]).replace('"Hi"', '"a\\ud800b"'))
    add(route, "lone low surrogate", raw=json.dumps(ROUTES[route]).replace('"Hi"', '"\\udc00"'))
    add(route, "escaped NUL", raw=json.dumps(ROUTES[route]).replace('"Hi"', '"\\u0000"'))
    # the output length
    for value in [*HUGE, *WRONG]:
        body = fresh(route); put(body, LENGTH[route], value)
        add(route, f"length {value!r}"[:40], body)
        body = fresh(route); put(body, LENGTH[route], value)
        if route == "/generate":
            body["sampling_params"]["ignore_eos"] = True
        elif route in ("/v1/chat/completions", "/v1/completions"):
            body["ignore_eos"] = True
        add(route, f"length {value!r} ignoring EOS"[:40], body)
    # sampling knobs
    where, knobs = KNOBS[route]
    for knob in knobs:
        for value in WRONG:
            body = fresh(route); put(body, (*where, knob), value)
            add(route, f"{knob}={value!r}"[:40], body)
    if route == "/generate":
        for field in NATIVE_TOP:
            for value in WRONG:
                body = fresh(route); body[field] = value
                add(route, f"{field}={value!r}"[:40], body)
        body = fresh(route); body["return_logprob"] = True; body["top_logprobs_num"] = 10**6
        add(route, "top logprobs beyond the vocabulary", body)
        body = fresh(route); body["text"] = {"$repeat": [["Hi"], 300]}
        add(route, "a batch of 300 prompts", body)
        body = fresh(route); body["input_ids"] = [[1, 2]] * 3; del body["text"]
        body["sampling_params"] = [{"max_new_tokens": 2}]
        add(route, "fewer sampling_params than prompts", body)
    if route in ("/v1/chat/completions", "/v1/completions"):
        for n in [0, 129, 2**31, 128]:
            body = fresh(route); body["n"] = n; add(route, f"n={n}", body)
        body = fresh(route); body["logprobs"] = True if route.endswith("chat/completions") else 5
        body["top_logprobs" if route.endswith("chat/completions") else "logprobs"] = 10**6
        add(route, "logprob counts beyond range", body)
        body = fresh(route); body["stop"] = {"$repeat": [["x"], 10_000]}; add(route, "10,000 stop strings", body)
        body = fresh(route); body["stop"] = {"$repeat": ["y", 100_000]}; add(route, "a 100k-character stop", body)
        body = fresh(route); body["logit_bias"] = {str(i): 100 for i in range(0, 60000, 97)}
        add(route, "logit_bias over the whole vocabulary and past it", body)
        body = fresh(route); body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}
        add(route, "a schema with a dangling $ref", body)
        body = fresh(route); body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(a+)+$" * 50}}}
        add(route, "a catastrophic regex in a schema", body)
        if route.endswith("chat/completions"):
            body = fresh(route); body["messages"] = {"$repeat": [[{"role": "user", "content": "Hi"}], 5000]}
            add(route, "5,000 messages", body)
            for message in [{"role": "nobody", "content": "x"}, {"content": "x"}, {"role": "user"},
                            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]},
                            {"role": "user", "content": [{"type": "text"}]}, {"role": "tool", "content": "x"},
                            {"role": "assistant", "tool_calls": [{"id": 1, "function": {"name": 2, "arguments": {}}}]}]:
                body = fresh(route); body["messages"] = [message]
                add(route, f"message {json.dumps(message)[:30]}", body)
            body = fresh(route); body["chat_template_kwargs"] = {"messages": []}
            add(route, "chat_template_kwargs naming messages", body)
            body = fresh(route); body["tools"] = [{"type": "function", "function": {"name": "f" * 65}}]
            add(route, "a tool name too long", body)
            body = fresh(route); body["tool_choice"] = {"type": "function", "function": {"name": "nope"}}
            add(route, "tool_choice naming no tool", body)

with open("tests/e2e/hostile_bodies.json", "w") as f:
    f.write("[\n" + ",\n".join(json.dumps(e, ensure_ascii=True) for e in corpus) + "\n]\n")
    f.write("\n")
print(len(corpus))
