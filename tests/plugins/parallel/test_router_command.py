"""``sgl router`` (sgl-router): SGLang's real router (the sglang-router wheel) started in front
of real sgl workers, ones the command starts and ones it is given; its cache_aware policy
against round_robin on a shared-prefix workload, counted from each worker's own cache hits; and
--dp-aware in front of a worker with two data-parallel replicas."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sgl_testing import ServerProcess, free_port, run_cli
from test_tensor_parallel import save_tiny_model

pytestmark = pytest.mark.slow

GROUPS = 3  # odd: round robin over 2 workers sends a group's questions to both
QUESTIONS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with SmolLM2's vocabulary, so that text prompts and chat work."""
    return save_tiny_model(tmp_path_factory.mktemp("router") / "llama", "LlamaConfig",
                           {"vocab_size": 49152, "num_key_value_heads": 2,
                            "max_position_embeddings": 2048})


def worker_args(model: Path) -> list[str]:
    return ["--model-path", str(model), "--dtype", "float32", "--max-total-tokens", "8192",
            "--context-length", "2048"]


@contextlib.contextmanager
def sgl_router(args: list[str], log: Path) -> Iterator[tuple[str, str]]:
    """``sgl router ARGS`` on free ports; its URL and log once it says it is ready."""
    port = free_port()
    out = open(log, "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "sgl", "router", "--port", str(port),
                             "--prometheus-port", str(free_port()), *args],
                            stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while "sgl router is ready" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sgl router did not start:\n{log.read_text()[-4000:]}")
            time.sleep(0.3)
        yield f"http://127.0.0.1:{port}", log.read_text()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.close()
    assert proc.returncode == 0, log.read_text()[-3000:]


def test_router_starts_workers_and_answers_every_route(model: Path, tmp_path: Path) -> None:
    log = tmp_path / "router.log"
    with sgl_router(["--workers", "2", "--policy", "round_robin", "--",
                     *worker_args(model)], log) as (url, text):
        workers = re.findall(r"worker \d of 2: (http://127\.0\.0\.1:\d+)", text)
        assert len(workers) == 2, text
        response = httpx.post(f"{url}/generate", timeout=120, json={
            "text": "The capital of France is", "sampling_params": {"max_new_tokens": 4}})
        assert response.status_code == 200, response.text
        assert response.json()["meta_info"]["completion_tokens"] == 4
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "default", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4})
        assert chat.status_code == 200, chat.text
        events = []
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120, json={
                "model": "default", "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 5, "stream": True}) as stream:
            assert stream.status_code == 200
            events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) >= 3
        # round robin: the three requests went to both workers it started
        served = [httpx.get(f"{w}/get_server_info", timeout=10).json()["internal_states"][0]
                  ["num_received_reqs"] for w in workers]
        assert sorted(served) == [1, 2], served
    # the workers stopped with the router
    for worker in workers:
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{worker}/health", timeout=2)


def _non_loopback_address() -> str | None:
    import socket

    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect(("10.255.255.255", 1))  # no packet is sent: picks the outgoing interface
        address = sock.getsockname()[0]
        return None if address.startswith("127.") else address
    return None


def test_router_in_front_of_workers_with_an_api_key(model: Path, tmp_path: Path) -> None:
    """Workers started with --api-key: the router sends them the key and asks its clients for
    it (issue 55, 2.6), and its Prometheus metrics bind --host (loopback), not every
    interface."""
    key = "sk-router-test"
    worker = ServerProcess(*worker_args(model), "--api-key", key,
                           log_path=tmp_path / "worker.log")
    metrics_port = free_port()
    try:
        with sgl_router(["--worker-urls", worker.base_url, "--api-key", key,
                         "--prometheus-port", str(metrics_port)], tmp_path / "router.log") as (
                url, _):
            auth = {"Authorization": f"Bearer {key}"}
            response = httpx.post(f"{url}/generate", timeout=120, headers=auth, json={
                "text": "Hello", "sampling_params": {"max_new_tokens": 3}})
            assert response.status_code == 200, response.text
            # the router asks its own clients for the key too
            assert httpx.post(f"{url}/generate", timeout=120, json={
                "text": "Hello", "sampling_params": {"max_new_tokens": 3}}).status_code == 401
            assert httpx.get(f"http://127.0.0.1:{metrics_port}/metrics",
                             timeout=10).status_code == 200
            address = _non_loopback_address()
            if address is not None:
                with pytest.raises(httpx.ConnectError):
                    httpx.get(f"http://{address}:{metrics_port}/metrics", timeout=5)
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def two_workers(model: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[list[ServerProcess]]:
    logs = tmp_path_factory.mktemp("workers")
    workers = [ServerProcess(*worker_args(model), log_path=logs / f"w{i}.log") for i in range(2)]
    yield workers
    for w in workers:
        w.stop()


def shared_prefix_hits(url: str, workers: list[ServerProcess]) -> tuple[float, list[int]]:
    """Groups of questions sharing a long system prompt, sent one at a time, interleaved; the
    share of prompt tokens found in cache, and each worker's cached tokens."""
    for w in workers:
        assert httpx.post(f"{w.base_url}/flush_cache", timeout=30).status_code == 200
    before = [_cached_total(w) for w in workers]
    cached = prompt = 0
    for q in range(QUESTIONS):
        for g in range(GROUPS):
            system = " ".join(f"Group {g} rule {i}: keep the number {i * (g + 3)} safe."
                              for i in range(25))
            response = httpx.post(f"{url}/generate", timeout=120, json={
                "text": f"{system}\nQuestion {q}: what is rule {q * 5}?",
                "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
            assert response.status_code == 200, response.text
            meta = response.json()["meta_info"]
            cached += meta["cached_tokens"]
            prompt += meta["prompt_tokens"]
    per_worker = [int(_cached_total(w) - b) for w, b in zip(workers, before)]
    assert sum(per_worker) == cached
    return cached / prompt, per_worker


def _cached_total(worker: ServerProcess) -> float:
    text = httpx.get(f"{worker.base_url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sgl:cached_tokens_total"))


def test_cache_aware_beats_round_robin_on_shared_prefixes(two_workers: list[ServerProcess],
                                                          tmp_path: Path) -> None:
    urls = ",".join(w.base_url for w in two_workers)
    rates: dict[str, Any] = {}
    for policy in ("round_robin", "cache_aware"):
        with sgl_router(["--worker-urls", urls, "--policy", policy],
                        tmp_path / f"{policy}.log") as (url, _):
            rates[policy] = shared_prefix_hits(url, two_workers)
    (rr, rr_workers), (ca, ca_workers) = rates["round_robin"], rates["cache_aware"]
    # round robin sends a group's questions to both workers, so each prefills every prompt
    # once; cache_aware keeps a group on one worker, where only its first question misses
    assert ca > rr, rates
    assert min(rr_workers) > 0, rates
    print(json.dumps({"hit rate": {"round_robin": rr, "cache_aware": ca}}))


def test_dp_aware_routes_to_each_replica(model: Path, tmp_path: Path) -> None:
    with ServerProcess(*worker_args(model), "--dp-size", "2",
                       log_path=tmp_path / "worker.log") as worker:
        with sgl_router(["--worker-urls", worker.base_url, "--dp-aware", "--policy",
                         "round_robin"], tmp_path / "router.log") as (url, text):
            assert "in front of 2 worker(s)" in text
            for i in range(4):
                response = httpx.post(f"{url}/generate", timeout=120, json={
                    "text": f"Count to {i + 3}:", "sampling_params": {"max_new_tokens": 2}})
                assert response.status_code == 200, response.text
        states = httpx.get(f"{worker.base_url}/get_server_info", timeout=10).json()[
            "internal_states"]
        assert [s["num_received_reqs"] for s in states] == [2, 2]
        # a replica the worker does not have is a clear 400
        response = httpx.post(f"{worker.base_url}/generate", timeout=30, json={
            "text": "Hi", "data_parallel_rank": 5, "sampling_params": {"max_new_tokens": 1}})
        assert response.status_code == 400
        assert "data_parallel_rank 5: this server has 2 replica(s)" in response.text


@pytest.mark.parametrize("args, expected", [
    (["--worker-urls", "http://127.0.0.1:1", "--workers", "2"], "not both"),
    (["--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2"], "one URL per flag"),
    (["--worker-urls", "127.0.0.1:1"], "expected http://HOST:PORT"),
    (["--worker-urls", "http://127.0.0.1:1", "--", "--dtype", "float32"],
     "are for workers this command starts"),
    (["--policy", "fastest"], "'fastest' is not one of"),
])
def test_bad_router_arguments_are_named(args: list[str], expected: str) -> None:
    result = run_cli(["router", "--port", str(free_port()), *args], timeout=60)
    assert result.returncode != 0
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
