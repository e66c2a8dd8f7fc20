"""The Ollama frontend through the official ``ollama`` client, against the real server and
model (greedy, ``temperature: 0``, where outputs are compared)."""

from __future__ import annotations

import json

import httpx
import ollama
import openai
import pytest

from sgl.plugins import create_plugin_manager
from sgl_testing import CAPITAL_QUESTION, ServerProcess

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": CAPITAL_QUESTION}]
MODEL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> ollama.Client:
    return ollama.Client(host=server.base_url, timeout=120)


def test_plugin_is_installed() -> None:
    pm = create_plugin_manager()
    assert pm.records["frontend-ollama"].available
    assert pm.registries.frontends.entry("ollama").owner == "frontend-ollama"


def test_chat(client: ollama.Client, server: ServerProcess) -> None:
    r = client.chat(model=MODEL, messages=QUESTION, options={"temperature": 0, "num_predict": 24})
    assert r.done and r.done_reason == "stop" and r.model == MODEL
    assert r.message.role == "assistant" and "Paris" in r.message.content
    assert r.prompt_eval_count > 5 and 0 < r.eval_count <= 24
    assert r.total_duration > 0 and r.created_at.endswith("Z")
    oai = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    chat = oai.chat.completions.create(model="default", messages=QUESTION, temperature=0,
                                       max_tokens=24)
    assert r.message.content == chat.choices[0].message.content


def test_chat_stream_matches_non_stream(client: ollama.Client) -> None:
    options = {"temperature": 0, "num_predict": 24}
    whole = client.chat(model=f"{MODEL}:latest", messages=QUESTION, options=options)
    parts = list(client.chat(model=MODEL, messages=QUESTION, options=options, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count and parts[-1].done_reason == "stop"


def test_stream_is_the_default_and_ndjson(server: ServerProcess) -> None:
    with httpx.stream("POST", f"{server.base_url}/api/chat", timeout=120, json={
            "model": MODEL, "messages": QUESTION, "options": {"num_predict": 3}}) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert len(lines) >= 2 and lines[-1]["done"] is True
    assert lines[-1]["done_reason"] == "length" and lines[-1]["eval_count"] == 3


def test_generate_options_and_context(client: ollama.Client) -> None:
    options = {"temperature": 0, "num_predict": 24, "seed": 3, "top_k": 10, "top_p": 0.9}
    r = client.generate(model=MODEL, prompt=CAPITAL_QUESTION, options=options)
    assert r.done and "Paris" in r.response
    assert r.context[-r.eval_count:] and len(r.context) == r.prompt_eval_count + r.eval_count
    streamed = list(client.generate(model=MODEL, prompt=CAPITAL_QUESTION,
                                    options=options, stream=True))
    assert "".join(p.response for p in streamed) == r.response
    assert streamed[-1].context == r.context
    cut = client.generate(model=MODEL, prompt=CAPITAL_QUESTION,
                          options={**options, "stop": ["Paris"]})
    assert "Paris" not in cut.response and r.response.startswith(cut.response)
    short = client.generate(model=MODEL, prompt=CAPITAL_QUESTION,
                            options={**options, "num_predict": 2})
    assert short.eval_count == 2 and short.done_reason == "length"


def test_generate_raw_and_system(client: ollama.Client) -> None:
    raw = client.generate(model=MODEL, prompt="One, two, three,", raw=True,
                          options={"temperature": 0, "num_predict": 4})
    assert raw.prompt_eval_count < 10 and raw.eval_count == 4
    plain = client.generate(model=MODEL, prompt="Hi", options={"num_predict": 1})
    system = client.generate(model=MODEL, prompt="Hi", system="You are a pirate.",
                             options={"num_predict": 1})
    assert system.prompt_eval_count != plain.prompt_eval_count


def test_empty_prompt_loads_the_model(client: ollama.Client) -> None:
    r = client.generate(model=MODEL, prompt="")
    assert r.done and r.done_reason == "load" and r.response == ""


def test_tags_show_version(client: ollama.Client, server: ServerProcess) -> None:
    models = client.list().models
    assert [m.model for m in models] == [f"{MODEL}:latest"]
    assert models[0].details.format == "gguf" and models[0].details.quantization_level == "Q4_1"
    assert models[0].size > 10_000_000
    shown = client.show(MODEL)
    assert "im_start" in shown.template and shown.modelinfo["general.context_length"] > 0
    version = httpx.get(f"{server.base_url}/api/version").json()["version"]
    assert isinstance(version, str) and version


def test_unknown_model_is_404(client: ollama.Client) -> None:
    for call in (lambda: client.chat(model="llama3", messages=QUESTION),
                 lambda: client.generate(model="llama3", prompt="x"),
                 lambda: client.show("llama3")):
        with pytest.raises(ollama.ResponseError) as exc:
            call()
        assert exc.value.status_code == 404 and "llama3" in exc.value.error


def test_format_needs_a_grammar_backend(client: ollama.Client) -> None:
    if create_plugin_manager().registries.grammar.names():  # installed: JSON comes back
        r = client.chat(model=MODEL, messages=QUESTION, format="json",
                        options={"temperature": 0, "num_predict": 64})
        if r.done_reason == "stop":
            json.loads(r.message.content)
        return
    with pytest.raises(ollama.ResponseError) as exc:
        client.chat(model=MODEL, messages=QUESTION, format="json")
    assert exc.value.status_code == 400 and "sgl-grammar-xgrammar" in exc.value.error


@pytest.mark.parametrize("path,body", [
    ("/api/chat", b"{nope"),
    ("/api/chat", b'{"messages": []}'),
    ("/api/chat", b'{"model": "default", "messages": [{"role": "wizard", "content": "x"}]}'),
    ("/api/chat", b'{"model": "default", "messages": "hi"}'),
    ("/api/chat", b'{"model": "default", "messages": [], "bogus": true}'),
    ("/api/chat", b'{"model": "default", "messages": [{"role": "user", "content": "x"}], '
                  b'"options": {"temperature": "hot"}}'),
    ("/api/chat", b'{"model": "default", "messages": [{"role": "user", "content": "x"}], '
                  b'"options": {"warp_speed": 9}}'),
    ("/api/generate", b'{"model": "default", "prompt": 5}'),
    ("/api/generate", b'{"model": "default", "prompt": "x", "options": {"top_p": 2}}'),
    ("/api/generate", b'{"model": "default", "prompt": "x", "options": {"seed": 1e30}}'),
    ("/api/generate", b'{"model": "default", "prompt": "x", '
                      b'"options": {"seed": 18446744073709551615}}'),
    ("/api/generate", b'{"model": "default", "prompt": "' + b"hello " * 9000 + b'"}'),
    ("/api/show", b"{}"),
])
def test_bad_requests_get_ollama_errors(server: ServerProcess, path: str, body: bytes) -> None:
    r = httpx.post(f"{server.base_url}{path}", content=body,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert isinstance(r.json()["error"], str) and r.json()["error"]
