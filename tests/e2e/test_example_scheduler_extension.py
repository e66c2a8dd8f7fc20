"""The example scheduler extension (docs/plugins/sgl-step-trace), installed with pip into a
separate folder, takes part in a real server's scheduler without any change to the core: its
trace of the steps accounts for every token each request ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from sgl_testing import ServerProcess, run_cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def trace_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--disable-pip-version-check", "--target",
                    str(target), str(ROOT / "docs" / "plugins" / "sgl-step-trace")], check=True)
    path = os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {"PYTHONPATH": path}


def test_the_extension_is_registered_and_its_setting_listed(trace_env: dict[str, str]) -> None:
    result = run_cli(["plugins", "--json"], env=trace_env)
    assert result.returncode == 0, result.stderr
    plugin = {p["name"]: p for p in json.loads(result.stdout)}["step-trace"]
    assert plugin["hooks"] == ["sgl_add_config", "sgl_register_scheduler_extensions"]
    assert "--step-trace-path" in run_cli(["serve", "--help"], env=trace_env).stdout


def test_the_trace_accounts_for_every_token(trace_env: dict[str, str], tmp_path: Path) -> None:
    trace = tmp_path / "steps.jsonl"
    server = ServerProcess("--step-trace-path", str(trace), "--max-total-tokens", "4096",
                           env=trace_env, log_path=tmp_path / "server.log")
    shared = "Answer briefly and plainly, in one sentence. " * 3
    bodies = [{"text": f"{shared}Question {i}: name a colour.", "sampling_params": {
        "temperature": 0, "max_new_tokens": 6 + 3 * i, "ignore_eos": True}} for i in range(4)]

    def send(body: dict[str, Any]) -> dict[str, Any]:
        reply = httpx.post(f"{server.base_url}/generate", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()["meta_info"]

    try:
        with ThreadPoolExecutor(len(bodies)) as pool:  # batched together
            metas = list(pool.map(send, bodies))
        metas.append(send(bodies[0]))  # again: its prompt is a cache hit
        internal = httpx.get(f"{server.base_url}/get_server_info",
                             timeout=30).json()["internal_states"][0]
    finally:
        assert server.stop() == 0  # the extension's close() wrote what was left

    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    ran: dict[str, int] = defaultdict(int)
    for line in lines:
        for rid, tokens in line["batch"]:
            ran[rid] += tokens
    assert [line["step"] for line in lines] == list(range(1, len(lines) + 1))
    assert internal["step_trace_steps"] >= len(lines) - 1  # (the last written at close)
    assert any(len(line["batch"]) > 1 for line in lines), "the requests never shared a step"
    for meta in metas:
        # each forward runs the prompt's uncached tokens once, then every output token but
        # the last (its KV is never needed)
        expected = meta["prompt_tokens"] - meta["cached_tokens"] + meta["completion_tokens"] - 1
        assert ran[meta["id"]] == expected, (meta, ran[meta["id"]])
        assert any(meta["id"] in line["finished"] for line in lines)
    assert metas[-1]["cached_tokens"] > 0
