"""SGLang's own router (the ``sglang-router`` wheel, its Rust gateway) in front of two sgl
workers (issue 18): it registers them, routes ``/generate``, chat and completions (streamed
too) with the fields it adds to every request, fans ``/flush_cache`` out, and reads each
worker's real load from ``/get_load``."""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def launch_router(policy: str, workers: list[str], log: Path) -> Iterator[str]:
    """``python -m sglang_router.launch_router`` on a free port; its URL once it has
    registered every worker."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
             "--port", str(port), "--policy", policy, "--prometheus-port", str(free_port()),
             "--worker-urls", *workers],
            stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_workers(url, proc, log, count=len(workers))
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def router(server: ServerProcess, second_worker: ServerProcess,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("router") / "router.log"
    with launch_router("cache_aware", [server.base_url, second_worker.base_url], log) as url:
        yield url


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


GREEDY = {"temperature": 0}


def _answer(base: str, path: str, body: dict) -> str:
    response = httpx.post(f"{base}{path}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    out = response.json()
    if path == "/generate":
        return out["text"]
    choice = out["choices"][0]
    return choice["text"] if path == "/v1/completions" else choice["message"]["content"]


@pytest.mark.parametrize("path,body", [
    ("/generate", {"text": "The capital of France is",
                   "sampling_params": {"max_new_tokens": 8, "temperature": 0}}),
    ("/v1/chat/completions", {"model": "default", "messages": HI, "max_tokens": 8, **GREEDY}),
    ("/v1/completions", {"model": "default", "prompt": "Once upon a time", "max_tokens": 8,
                         **GREEDY}),
])
def test_the_router_answers_what_a_worker_answers(router: str, server: ServerProcess,
                                                  second_worker: ServerProcess, path: str,
                                                  body: dict) -> None:
    """Greedy, through the router: the text either worker gives when asked directly."""
    direct = _answer(server.base_url, path, body)
    assert direct and _answer(second_worker.base_url, path, body) == direct
    assert _answer(router, path, body) == direct


def test_cache_aware_sends_a_shared_prefix_to_one_worker(router: str, server: ServerProcess,
                                                         second_worker: ServerProcess) -> None:
    """The router's cache-aware policy keeps requests that share a long prefix on the worker
    that has it cached: after the first, each finds the prefix in its worker's cache."""
    for worker in (server, second_worker):
        assert httpx.post(f"{worker.base_url}/flush_cache", timeout=60).status_code == 200
    before = [_metric(w, "sgl:cached_tokens_total") for w in (server, second_worker)]
    prefix = " ".join(f"Rule {i}: be kind to the number {i * 7}." for i in range(30))
    cached = []
    for question in ("What is rule 3?", "What is rule 11?", "What is rule 20?",
                     "What is rule 29?"):
        response = httpx.post(f"{router}/generate", timeout=120, json={
            "text": f"{prefix}\n{question}", "sampling_params": {"max_new_tokens": 2,
                                                                 "temperature": 0}})
        assert response.status_code == 200, response.text
        meta = response.json()["meta_info"]
        cached.append((meta["cached_tokens"], meta["prompt_tokens"]))
    assert cached[0][0] == 0  # both caches were empty
    for hits, prompt in cached[1:]:  # the same worker each time: the prefix was there
        assert hits >= 0.8 * cached[0][1], cached
    counts = [_metric(w, "sgl:cached_tokens_total") - b
              for w, b in zip((server, second_worker), before)]
    assert min(counts) == 0 < max(counts), counts  # each worker's count: all on one of them


def _metric(worker: ServerProcess, name: str) -> float:
    text = httpx.get(f"{worker.base_url}/metrics", timeout=30).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name) and not line.startswith("#")]
    return sum(values)


def test_power_of_two_policy(server: ServerProcess, second_worker: ServerProcess,
                             tmp_path: Path) -> None:
    """``--policy power_of_two`` picks the less loaded of two workers by their ``/get_load``:
    it registers both, reads real loads and routes every route."""
    with launch_router("power_of_two", [server.base_url, second_worker.base_url],
                       tmp_path / "router.log") as url:
        body = {"text": "The capital of France is",
                "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
        direct = _answer(server.base_url, "/generate", body)
        for _ in range(4):
            assert _answer(url, "/generate", body) == direct
        chat = {"model": "default", "messages": HI, "max_tokens": 4, **GREEDY}
        assert _answer(url, "/v1/chat/completions", chat) == _answer(
            server.base_url, "/v1/chat/completions", chat)
        loads = httpx.get(f"{url}/get_loads", timeout=30).json()["workers"]
        assert len(loads) == 2 and all(w["load"] >= 0 for w in loads), loads
