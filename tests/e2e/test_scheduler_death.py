"""A dying scheduler fails in-flight requests, turns /health unhealthy, and the server exits
non-zero. The fault is real: the scheduler process is killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx

from sgl_testing import ServerProcess


def scheduler_pid(server_pid: int) -> int:
    children = []
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        children += (task / "children").read_text().split()
    for pid in children:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"multiprocessing" in cmdline and b"resource_tracker" not in cmdline:
            return int(pid)
    raise AssertionError(f"no scheduler among children {children}")


def test_scheduler_death(tmp_path: Path) -> None:
    server = ServerProcess("--max-total-tokens", "4096", log_path=tmp_path / "server.log")
    try:
        result: dict[str, httpx.Response] = {}

        def long_request() -> None:
            result["response"] = httpx.post(
                f"{server.base_url}/v1/chat/completions", timeout=120, json={
                    # min_tokens: the answer (59 tokens, 2 s) must not finish before the kill
                    "model": "default", "max_tokens": 2000, "min_tokens": 2000, "temperature": 0,
                    "messages": [{"role": "user", "content": "Count to one thousand."}]})

        thread = threading.Thread(target=long_request)
        thread.start()
        time.sleep(1.5)  # the request is decoding now
        os.kill(scheduler_pid(server.proc.pid), signal.SIGKILL)

        statuses = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and 503 not in statuses:
            try:
                statuses.append(httpx.get(f"{server.base_url}/health", timeout=2).status_code)
            except httpx.HTTPError:
                break
            time.sleep(0.1)
        thread.join(timeout=30)
        assert 503 in statuses

        response = result["response"]
        assert response.status_code == 503
        assert "scheduler process died" in response.json()["error"]["message"]
        assert server.proc.wait(timeout=30) == 1
        assert "scheduler process died" in server.log()
    finally:
        server.stop()
