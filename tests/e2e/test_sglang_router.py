"""SGLang's own router (the ``sglang-router`` wheel, its Rust gateway) in front of two sgl
workers (issue 18): it registers them, routes ``/generate``, chat and completions (streamed
too) with the fields it adds to every request, fans ``/flush_cache`` out, and reads each
worker's real load from ``/get_load``."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sgl_testing import ServerProcess, free_port

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def second_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("worker2") / "server.log"
    proc = ServerProcess("--max-total-tokens", "4096", "--dtype", "float32", log_path=log)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def router(server: ServerProcess, second_worker: ServerProcess,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("router") / "router.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
             "--port", str(port), "--policy", "cache_aware",
             "--prometheus-port", str(free_port()),
             "--worker-urls", server.base_url, second_worker.base_url],
            stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_workers(url, proc, log, count=2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait_for_workers(url: str, proc: subprocess.Popen, log: Path, count: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited:\n{log.read_text()[-3000:]}")
        try:
            loads = httpx.get(f"{url}/get_loads", timeout=5).json()["workers"]
            if len(loads) == count:
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the router did not register {count} workers:\n{log.read_text()[-3000:]}")


def test_generate_through_the_router(router: str) -> None:
    """The router adds ``model`` and ``return_bytes`` (and others) to every /generate; sgl used
    to refuse them ("unknown field(s): model, return_bytes")."""
    response = httpx.post(f"{router}/generate", timeout=120, json={
        "text": "The capital of France is", "sampling_params": {"max_new_tokens": 4,
                                                                 "temperature": 0}})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["text"] and body["meta_info"]["completion_tokens"] == 4


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": "default", "messages": HI, "max_tokens": 4}),
    ("/v1/completions", {"model": "default", "prompt": "Hello", "max_tokens": 4}),
])
def test_openai_routes_through_the_router(router: str, path: str, body: dict) -> None:
    """The router adds ``no_stop_trim``, ``separate_reasoning`` and the like; sgl used to refuse
    ``no_stop_trim`` as an unknown field."""
    response = httpx.post(f"{router}{path}", json={**body, "temperature": 0}, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4


def test_a_stream_through_the_router(router: str) -> None:
    events = []
    with httpx.stream("POST", f"{router}/v1/chat/completions", timeout=120, json={
            "model": "default", "messages": HI, "max_tokens": 6, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                   for e in events[:-1] if json.loads(e)["choices"])
    assert text


def test_flush_cache_through_the_router(router: str) -> None:
    response = httpx.post(f"{router}/flush_cache", timeout=60)
    assert response.status_code == 200, response.text


def test_the_router_reads_each_workers_load(router: str, server: ServerProcess) -> None:
    """``/get_load`` in SGLang's shape; the router used to report ``load: -1`` (no such route).
    A worker's load is the KV its running requests hold plus the prompts waiting."""
    loads = httpx.get(f"{router}/get_loads", timeout=30).json()["workers"]
    assert len(loads) == 2 and all(w["load"] >= 0 for w in loads), loads
    own = httpx.get(f"{server.base_url}/get_load", timeout=30).json()
    assert own[0]["dp_rank"] == 0 and {"num_reqs", "num_waiting_reqs", "num_tokens"} <= set(own[0])


def test_no_stop_trim_keeps_the_stop_string(server: ServerProcess) -> None:
    """SGLang's OpenAI extension, now implemented rather than refused."""
    def text(no_stop_trim: bool) -> str:
        response = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
            "model": "default", "prompt": "1, 2, 3, 4,", "max_tokens": 12, "temperature": 0,
            "stop": [","], "no_stop_trim": no_stop_trim})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    kept, trimmed = text(True), text(False)
    assert kept.endswith(",") and kept == trimmed + ","


def test_continue_final_message_goes_on_with_the_last_turn(server: ServerProcess) -> None:
    """SGLang's extension: the last assistant message is continued, not closed and followed by
    a new assistant turn (so the prompt has no end-of-turn and no new turn header)."""
    messages = [*HI, {"role": "assistant", "content": "Hi! The capital of France is"}]

    def prompt_tokens(**extra: object) -> int:
        response = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
            "model": "default", "messages": messages, "max_tokens": 2, "temperature": 0,
            **extra})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    assert prompt_tokens(continue_final_message=True) < prompt_tokens()
