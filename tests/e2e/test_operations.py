"""Server operations that apply to every frontend: metrics, the request log, client
disconnects, the API key, the body size limit and graceful shutdown on SIGTERM.

Most tests use the session server; the API key, the body limit and SIGTERM need settings of
their own, so they share one more server (``guarded``), which the last test shuts down.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sgl_testing import ServerProcess

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 65536
LONG = {"max_new_tokens": 3000, "ignore_eos": True}


def load(server: ServerProcess, headers: dict[str, str] | None = None) -> dict[str, Any]:
    info = httpx.get(f"{server.base_url}/get_server_info", headers=headers, timeout=30).json()
    return info["internal_states"][0]


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def metrics(server: ServerProcess) -> dict[str, float]:
    """Every sample of /metrics by name and labels, e.g. ``sgl:num_requests_total{...}``."""
    response = httpx.get(f"{server.base_url}/metrics", timeout=60)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


# --- metrics and the request log (session server) -------------------------------------------

def test_metrics_count_requests_and_tokens(server: ServerProcess) -> None:
    before = metrics(server)
    rid = f"metrics-{uuid.uuid4().hex}"
    result = httpx.post(f"{server.base_url}/generate", timeout=60, json={
        "text": "Count to ten:", "rid": rid,
        "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}).json()
    after = metrics(server)
    meta = result["meta_info"]

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew('sgl:num_requests_total{finish_reason="length"}') == 1
    assert grew("sgl:prompt_tokens_total") == meta["prompt_tokens"]
    assert grew("sgl:generation_tokens_total") == 6
    for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                      "e2e_request_latency_seconds"):
        assert grew(f"sgl:{histogram}_count") == 1, histogram
        assert grew(f"sgl:{histogram}_sum") > 0, histogram
    assert grew("sgl:e2e_request_latency_seconds_sum") == pytest.approx(meta["e2e_latency"],
                                                                        abs=0.05)
    for gauge in ("num_running_reqs", "num_queue_reqs", "token_usage", "kv_used_tokens",
                  "cache_hit_rate"):
        assert f"sgl:{gauge}" in after, gauge
    assert after["sgl:num_running_reqs"] == 0 and after["sgl:num_queue_reqs"] == 0
    assert 0 <= after["sgl:token_usage"] <= 1 and 0 <= after["sgl:cache_hit_rate"] <= 1

    log = server.log()
    line = next(line for line in log.splitlines() if f"request {rid} " in line)
    assert f"{meta['prompt_tokens']} prompt tokens" in line
    assert "6 completion tokens" in line and "length" in line


def test_metrics_gauges_see_running_requests(server: ServerProcess) -> None:
    with httpx.stream("POST", f"{server.base_url}/generate", timeout=60, json={
            "text": "Write an essay.", "stream": True, "sampling_params": LONG}) as response:
        lines = response.iter_lines()  # kept: dropping it would close the connection
        assert next(lines).startswith("data: ")  # the first token is out: the request runs
        running = metrics(server)
    assert running["sgl:num_running_reqs"] >= 1
    assert running["sgl:kv_used_tokens"] > 0 and running["sgl:token_usage"] > 0


# --- client disconnects (session server) ----------------------------------------------------

def _idle_kv(server: ServerProcess) -> int:
    assert httpx.post(f"{server.base_url}/flush_cache", timeout=30).status_code == 200
    return load(server)["kv_used_tokens"]


def _check_freed(server: ServerProcess, idle: int) -> None:
    """The aborted request leaves the scheduler long before it could have finished, and once
    the cache is flushed the KV pool is back to its idle use."""
    wait_for(lambda: load(server)["num_running_reqs"] == 0 and load(server)["num_waiting_reqs"]
             == 0, 10, "the disconnected request still runs in the scheduler")
    assert _idle_kv(server) == idle


STORY = "Tell me a long story."
#: one streaming route of every frontend, with a request that runs far longer than the test
STREAMS = {
    "native": ("/generate", {"text": STORY, "stream": True, "sampling_params": LONG}),
    "openai-chat": ("/v1/chat/completions", {
        "model": "default", "messages": [{"role": "user", "content": STORY}], "stream": True,
        "max_tokens": 3000, "ignore_eos": True}),
    "openai-completions": ("/v1/completions", {
        "model": "default", "prompt": STORY, "stream": True, "max_tokens": 3000,
        "ignore_eos": True}),
    "anthropic": ("/v1/messages", {
        "model": "default", "messages": [{"role": "user", "content": STORY}], "stream": True,
        "max_tokens": 3000}),
    "ollama-chat": ("/api/chat", {
        "model": "default", "messages": [{"role": "user", "content": STORY}],
        "options": {"num_predict": 3000}}),
    "ollama-generate": ("/api/generate", {
        "model": "default", "prompt": STORY, "options": {"num_predict": 3000}}),
}


@pytest.mark.parametrize("frontend", list(STREAMS))
def test_closing_a_stream_aborts_the_request(server: ServerProcess, frontend: str) -> None:
    """Every frontend's stream, cut by its client after the first event, aborts its request at
    once (finish reason ``abort`` in the metrics) and frees its KV memory."""
    path, body = STREAMS[frontend]
    idle = _idle_kv(server)
    aborted = 'sgl:num_requests_total{finish_reason="abort"}'
    before = metrics(server).get(aborted, 0.0)
    with httpx.stream("POST", f"{server.base_url}{path}", timeout=60, json=body) as response:
        assert response.status_code == 200
        lines = (line for line in response.iter_lines() if line.strip())
        first = next(lines)
        assert first.startswith(("data: ", "event: ", "{")), first
        next(lines)  # a second event: the request is in the scheduler
        state = load(server)
        assert state["num_running_reqs"] == 1 and state["kv_used_tokens"] > idle
    # leaving the block closed the connection mid-stream
    _check_freed(server, idle)
    assert metrics(server).get(aborted, 0.0) == before + 1
    assert f"client of POST {path} disconnected" in server.log()


@pytest.mark.parametrize("frontend", list(STREAMS))
def test_a_body_nested_too_deep_is_a_400_and_the_connection_stays_open(
        server: ServerProcess, frontend: str) -> None:
    """JSON nested 1,000 deep used to be a 500 (RecursionError in the parser) on every
    generation route, and the server then dropped the keep-alive connection."""
    path, body = STREAMS[frontend]
    deep = b'{"a": ' * 1000 + b"1" + b"}" * 1000
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        response = client.post(path, content=deep, headers={"Content-Type": "application/json"})
        assert response.status_code == 400, response.text
        assert "nests deeper than 64 levels" in response.text
        short = {**body, "stream": False}
        for key in ("max_tokens", "sampling_params", "options"):
            if key in short:
                short[key] = ({"max_new_tokens": 2} if key == "sampling_params" else
                              {"num_predict": 2} if key == "options" else 2)
        again = client.post(path, json=short)  # the same connection
        assert again.status_code == 200, again.text


def test_a_client_timing_out_aborts_a_non_streaming_request(server: ServerProcess) -> None:
    idle = _idle_kv(server)
    rid = f"gone-{uuid.uuid4().hex}"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/generate", timeout=httpx.Timeout(60, read=1.5), json={
            "text": "Tell me a long story.", "rid": rid, "sampling_params": LONG})
    _check_freed(server, idle)
    assert f"request {rid} cancelled" in server.log()


# --- API key, body limit, SIGTERM (a server of their own) -----------------------------------

@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("guarded") / "server.log"
    proc = ServerProcess("--api-key", KEY, "--max-request-body-size", str(BODY_LIMIT),
                         "--graceful-shutdown-timeout", "8", "--max-total-tokens", "8192",
                         log_path=log)
    yield proc
    proc.stop()


@pytest.mark.parametrize("method,path", [
    ("POST", "/generate"), ("GET", "/get_model_info"), ("GET", "/get_server_info"),
    ("POST", "/flush_cache"), ("POST", "/abort_request"), ("GET", "/from-nowhere"),
])
def test_routes_need_the_api_key(guarded: ServerProcess, method: str, path: str) -> None:
    url = f"{guarded.base_url}{path}"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                    {"x-api-key": "wrong"}, {"x-api-key": f"Bearer {KEY}"}):
        response = httpx.request(method, url, headers=headers, json={"text": "hi"}, timeout=60)
        assert response.status_code == 401, (headers, response.text)
        assert "API key" in response.json()["error"]["message"]


def test_the_api_key_opens_routes_and_health_stays_open(guarded: ServerProcess) -> None:
    response = httpx.post(f"{guarded.base_url}/generate", headers=AUTH, timeout=60, json={
        "text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert response.status_code == 200, response.text
    assert httpx.get(f"{guarded.base_url}/get_model_info", headers=AUTH, timeout=60).status_code == 200
    # the scheme is case-insensitive (issue 17, item 9)
    for scheme in ("bearer", "BEARER"):
        assert httpx.get(f"{guarded.base_url}/get_model_info", timeout=60,
                         headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200
    # Anthropic's clients send the key as x-api-key
    assert httpx.get(f"{guarded.base_url}/get_model_info",
                     headers={"x-api-key": KEY}, timeout=60).status_code == 200
    assert load(guarded, AUTH)["num_running_reqs"] == 0
    assert httpx.get(f"{guarded.base_url}/get_server_info",
                     headers=AUTH, timeout=60).json()["api_key"] == "<hidden>"
    assert httpx.get(f"{guarded.base_url}/health", timeout=60).status_code == 200
    assert httpx.get(f"{guarded.base_url}/metrics", timeout=60).status_code == 200
    # exactly those two: /health_generate runs the model (issue 55), a look-alike path is no
    # exemption either
    for path in ("/health_generate", "/healthz", "/health/../get_model_info", "/metrics2"):
        assert httpx.get(f"{guarded.base_url}{path}", timeout=60).status_code == 401, path
    assert httpx.get(f"{guarded.base_url}/health_generate", headers=AUTH,
                     timeout=60).status_code == 200


def test_body_size_limit(guarded: ServerProcess) -> None:
    url = f"{guarded.base_url}/generate"
    padding = " " * (BODY_LIMIT + 10)
    big = f'{{"text": "hi", "rid": "{padding}"}}'.encode()
    response = httpx.post(url, content=big, headers=AUTH, timeout=60)
    assert response.status_code == 413
    assert str(BODY_LIMIT) in response.json()["error"]["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is checked as it streams
        for start in range(0, len(big), 8192):
            yield big[start:start + 8192]

    response = httpx.post(url, content=chunks(), headers=AUTH, timeout=60)
    assert response.status_code == 413
    small = httpx.post(url, headers=AUTH, timeout=60, json={
        "text": "hi" + " " * 1000, "sampling_params": {"max_new_tokens": 1}})
    assert small.status_code == 200, small.text


SHORT_TOKENS = 64  # 8 tokens could finish between two polls of num_running_reqs


def test_sigterm_drains_then_aborts_and_exits_0(guarded: ServerProcess) -> None:
    """Last in this module: it stops the server. The short request in flight finishes; the
    one that cannot finish within --graceful-shutdown-timeout (8 s) is aborted; exit code 0."""
    results: dict[str, Any] = {}

    def short() -> None:
        results["short"] = httpx.post(f"{guarded.base_url}/generate", headers=AUTH, timeout=60,
                                      json={"text": "Hello", "sampling_params": {
                                          "max_new_tokens": SHORT_TOKENS, "ignore_eos": True}})

    def endless() -> None:
        events = []
        try:
            with httpx.stream("POST", f"{guarded.base_url}/generate", headers=AUTH, timeout=60,
                              json={"text": "Story:", "stream": True,
                                    "sampling_params": LONG}) as response:
                for line in response.iter_lines():
                    if line:
                        events.append(line)
        except httpx.HTTPError as exc:
            results["endless_error"] = exc
        results["endless"] = events

    threads = [threading.Thread(target=endless), threading.Thread(target=short)]
    threads[0].start()
    wait_for(lambda: load(guarded, AUTH)["num_running_reqs"] >= 1, 30, "nothing runs")
    threads[1].start()
    wait_for(lambda: load(guarded, AUTH)["num_running_reqs"] >= 2, 30, "short never ran")
    started = time.monotonic()
    guarded.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx.ConnectError):  # no new connections while draining
        httpx.get(f"{guarded.base_url}/health", timeout=2)
    code = guarded.proc.wait(60)
    elapsed = time.monotonic() - started
    for thread in threads:
        thread.join(30)

    assert code == 0
    assert results["short"].status_code == 200
    assert results["short"].json()["meta_info"]["completion_tokens"] == SHORT_TOKENS
    # the endless request was aborted: an error event (or a cut connection), never a finish
    events = [json.loads(e[len("data: "):]) for e in results["endless"] if e != "data: [DONE]"]
    assert events and "finish_reason" in events[0]["meta_info"]
    assert all(e["meta_info"]["finish_reason"] is None for e in events if "meta_info" in e)
    errors = [e["error"] for e in events if "error" in e]
    assert errors == [] or "shutting down" in errors[0]["message"]
    assert 7 < elapsed < 30
    log = Path(guarded.log_path).read_text()
    assert "SIGTERM received" in log
    assert "POST /generate aborted: the server is shutting down" in log
    assert "Traceback" not in log


# --- the settings themselves (no server) ----------------------------------------------------

def test_operation_settings_defaults_env_and_ranges() -> None:
    from sgl.config import ConfigError, load_settings

    defaults = load_settings(env={})
    assert defaults.api_key is None
    assert defaults.max_request_body_size == 32 * 2**20
    assert defaults.graceful_shutdown_timeout == 30.0
    from_env = load_settings(env={"SGL_API_KEY": "k", "SGL_MAX_REQUEST_BODY_SIZE": "1024",
                                  "SGL_GRACEFUL_SHUTDOWN_TIMEOUT": "2.5"})
    assert (from_env.api_key, from_env.max_request_body_size,
            from_env.graceful_shutdown_timeout) == ("k", 1024, 2.5)
    assert load_settings(env={"SGL_API_KEY": ""}).api_key is None  # empty: no key
    for key, value in (("max_request_body_size", 0), ("graceful_shutdown_timeout", -1)):
        with pytest.raises(ConfigError, match=key):
            load_settings(env={}, cli={key: value})
