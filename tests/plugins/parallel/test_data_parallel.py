"""Data parallelism (sgl-parallel-dp): real replicas (spawned schedulers behind one server
process), each with the whole tiny model; the dispatch counted from each replica's own count of
the requests it was sent, and the prefix cache's hits from the responses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from sgl_testing import ServerProcess, free_port, run_cli
from test_tensor_parallel import MODELS, PROMPTS, save_tiny_model

pytestmark = pytest.mark.slow

PREFIX_A = list(range(300, 364))  # two 64-token "system prompts"
PREFIX_B = list(range(500, 564))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("dp") / "llama", *MODELS["llama"])


def engine(model: Path, dp_size: int, **settings: Any) -> Any:
    import sgl

    return sgl.Engine(str(model), dtype="float32", dp_size=dp_size, max_total_tokens=2048,
                      context_length=256, log_level="warning", **settings)


def received(eng: Any) -> list[int]:
    return [state["num_received_reqs"] for state in eng.get_server_info()["internal_states"]]


def greedy(eng: Any, prompts: list[list[int]]) -> list[list[int]]:
    outs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 5,
                                                            "temperature": 0})
    return [o["output_ids"] for o in outs]


def test_round_robin_spreads_requests_and_keeps_outputs(model: Path) -> None:
    one = engine(model, 1)
    try:
        expected = greedy(one, PROMPTS * 3)
    finally:
        one.shutdown()
    two = engine(model, 2)
    try:
        assert greedy(two, PROMPTS * 3) == expected
        assert received(two) == [3, 3]
        info = two.get_server_info()
        assert info["parallel"]["strategy"] == "dp"
        assert info["parallel"]["load_balance_method"] == "round_robin"
        assert [s["dp_rank"] for s in info["internal_states"]] == [0, 1]
    finally:
        two.shutdown()


def test_shortest_queue_sends_a_batch_to_both(model: Path) -> None:
    eng = engine(model, 2, load_balance_method="shortest_queue")
    try:
        greedy(eng, PROMPTS * 3)  # submitted together: each goes where fewer are in flight
        assert received(eng) == [3, 3]
    finally:
        eng.shutdown()


def cached_tokens(eng: Any, order: str) -> int:
    total = 0
    for i, group in enumerate(order):
        prefix = PREFIX_A if group == "A" else PREFIX_B
        out = eng.generate(input_ids=[*prefix, 900 + i, 7, 8, 9],
                           sampling_params={"max_new_tokens": 2, "temperature": 0})
        total += out["meta_info"]["cached_tokens"]
    return total


def test_cache_aware_keeps_a_prefix_on_one_replica(model: Path) -> None:
    order = "AABBABAB"
    rr = engine(model, 2, load_balance_method="round_robin")
    try:
        round_robin = cached_tokens(rr, order)
    finally:
        rr.shutdown()
    ca = engine(model, 2, load_balance_method="cache_aware")
    try:
        cache_aware = cached_tokens(ca, order)
        # A's four requests on one replica, B's four on the other: every repeat hits
        assert received(ca) == [4, 4]
        assert ca.get_server_info()["parallel"]["cache_aware_hits"] == 6
    finally:
        ca.shutdown()
    assert cache_aware >= 6 * 64
    assert cache_aware > round_robin


def test_server_reports_each_replica(model: Path, tmp_path: Path) -> None:
    with ServerProcess("--model-path", str(model), "--dtype", "float32", "--dp-size", "2",
                       "--max-total-tokens", "2048", "--context-length", "256",
                       log_path=tmp_path / "server.log") as server:
        for prompt in PROMPTS * 2:
            response = httpx.post(f"{server.base_url}/generate", timeout=60, json={
                "input_ids": prompt, "sampling_params": {"max_new_tokens": 3}})
            assert response.status_code == 200, response.text
        loads = httpx.get(f"{server.base_url}/get_load", timeout=10).json()
        assert [load["dp_rank"] for load in loads] == [0, 1]
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        for rank in (0, 1):
            assert f'sgl:replica_num_received_reqs{{dp_rank="{rank}"}} 2.0' in metrics
        # a session's requests stay on one replica, which keeps the conversation cached
        session = httpx.post(f"{server.base_url}/open_session", timeout=10,
                             json={"capacity_of_str_len": 1000}).json()
        cached = []
        for turn in range(3):
            response = httpx.post(f"{server.base_url}/generate", timeout=60, json={
                "input_ids": [*PREFIX_A, turn + 5], "session_params": {"id": session},
                "sampling_params": {"max_new_tokens": 2}})
            assert response.status_code == 200, response.text
            cached.append(response.json()["meta_info"]["cached_tokens"])
        assert cached[1] >= 64 and cached[2] >= 64, cached
        flushed = httpx.post(f"{server.base_url}/flush_cache", timeout=10)
        assert flushed.status_code == 200


@pytest.mark.parametrize("args, expected", [
    (["--load-balance-method", "cache_aware"], "it needs --dp-size above 1"),
    (["--dp-size", "2", "--tp-size", "3"], "data parallelism runs replicas of one rank"),
    (["--dp-size", "2", "--disable-plugin", "parallel-dp"],
     "no installed plugin provides data parallelism"),
    (["--dp-size", "2", "--load-balance-method", "fastest"], "'fastest' is not one of"),
])
def test_bad_settings_are_named(args: list[str], expected: str) -> None:
    result = run_cli(["serve", "--port", str(free_port()), *args], timeout=120)
    assert result.returncode != 0
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
