"""The real server (bundled SmolLM2, scheduler process, ZMQ) on a loopback port."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from sgl_testing import CAPITAL_QUESTION, ServerProcess


def chat(server: ServerProcess, content: str, **extra) -> httpx.Response:
    body = {"model": "default", "messages": [{"role": "user", "content": content}],
            "temperature": 0, "max_tokens": 32, **extra}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)


def test_capital_of_france(server: ServerProcess) -> None:
    response = chat(server, CAPITAL_QUESTION)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion"
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["prompt_tokens"] > 5 and 0 < usage["completion_tokens"] <= 32
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_greedy_is_deterministic_and_max_tokens_is_honoured(server: ServerProcess) -> None:
    first = chat(server, "Name three colors.", max_tokens=5).json()
    second = chat(server, "Name three colors.", max_tokens=5).json()
    assert first["choices"][0]["message"] == second["choices"][0]["message"]
    assert first["usage"]["completion_tokens"] == 5
    assert first["choices"][0]["finish_reason"] == "length"


def test_health_and_models(server: ServerProcess) -> None:
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    models = httpx.get(f"{server.base_url}/v1/models").json()
    assert models["data"][0]["id"] == "SmolLM2-135M-Instruct.Q4_1"


def test_route_from_a_plugin_file(server: ServerProcess) -> None:
    response = httpx.get(f"{server.base_url}/from-file-plugin")
    assert response.status_code == 200
    assert response.json() == {"plugin": "file", "model": "SmolLM2-135M-Instruct.Q4_1"}


def test_hook_sgl_on_startup(server: ServerProcess, markers_file: Path) -> None:
    lines = markers_file.read_text().splitlines()
    assert "startup server" in lines and "startup scheduler" in lines


@pytest.mark.parametrize("body,status,needle", [
    (b"{not json", 400, "not valid JSON"),
    (b'{"model": "default"}', 400, "messages"),
    (b'{"model": "default", "messages": []}', 400, "messages"),
    (b'{"model": "default", "messages": [{"role": "user", "content": "hi"}], "temperature": -1}',
     400, "temperature"),
    (b'{"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "x"}',
     400, "max_tokens"),
    (b'{"model": "default", "messages": [{"role": "wizard", "content": "hi"}]}', 400, "role"),
    (b'{"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}', 404, "gpt-9"),
    (b'{"model": "default", "messages": [{"role": "user", "content": "hi"}], "bogus": 1}',
     400, "bogus"),
])
def test_bad_requests_get_openai_errors(server: ServerProcess, body: bytes, status: int,
                                        needle: str) -> None:
    response = httpx.post(f"{server.base_url}/v1/chat/completions", content=body,
                          headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert needle in error["message"] or needle == error.get("param")


def test_prompt_longer_than_context_is_rejected(server: ServerProcess) -> None:
    response = chat(server, "hello " * 9000)
    assert response.status_code == 400
    assert "context length" in response.json()["error"]["message"]
    assert chat(server, "Say hi.", max_tokens=2).status_code == 200  # still serving


def test_startup_log_names_plugins_model_and_ready_line(server: ServerProcess) -> None:
    log = server.log()
    assert "plugin attn-torch (sgl-attn-torch) loaded" in log
    assert "dtype float32" in log and "torch thread" in log and "KV pool:" in log
    assert log.count("sgl is ready: serving SmolLM2-135M-Instruct.Q4_1 at http://127.0.0.1:") == 1
