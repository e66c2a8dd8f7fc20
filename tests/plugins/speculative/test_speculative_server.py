"""``sgl serve --speculative-algorithm NGRAM`` as a user runs it: the real server, SGLang's
``/generate`` with its ``meta_info`` counts, the OpenAI route, ``/get_server_info``,
``/metrics``, ``sgl bench serving`` printing the acceptance length; and the flag combinations
``sgl serve`` refuses before loading a model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sgl_testing import ServerProcess, run_cli

pytestmark = pytest.mark.slow

PROMPT = ("Repeat this text exactly: The committee met on Tuesday to review the budget. It "
          "approved the new library and the repairs to the bridge.")


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("spec") / "server.log"
    with ServerProcess("--speculative-algorithm", "NGRAM", "--dtype", "float32",
                       "--max-total-tokens", "4096", log_path=log) as server:
        yield server


def generate(server: ServerProcess, **body: object) -> dict:
    r = httpx.post(f"{server.base_url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_reports_speculation(spec_server: ServerProcess) -> None:
    params = {"temperature": 0, "max_new_tokens": 48}
    out = generate(spec_server, text=PROMPT, sampling_params=params)
    meta = out["meta_info"]
    assert meta["spec_verify_ct"] >= 1
    assert meta["spec_accept_length"] >= 1.0
    assert 0.0 <= meta["spec_accept_rate"] <= 1.0
    assert meta["spec_num_correct_drafts"] <= meta["spec_num_proposed_drafts"]
    # streamed, the same text
    with httpx.stream("POST", f"{spec_server.base_url}/generate", timeout=120,
                      json={"text": PROMPT, "sampling_params": params, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["meta_info"]["completion_tokens"] == meta["completion_tokens"]
    chat = httpx.post(f"{spec_server.base_url}/v1/chat/completions", timeout=120, json={
        "model": "default", "messages": [{"role": "user", "content": PROMPT}],
        "temperature": 0, "max_tokens": 32}).json()
    assert chat["choices"][0]["message"]["content"]
    info = httpx.get(f"{spec_server.base_url}/get_server_info", timeout=30).json()
    assert info["speculative_algorithm"] == "NGRAM"
    state = info["internal_states"][0]  # where SGLang has them
    assert state["spec_verify_ct"] >= meta["spec_verify_ct"]
    assert state["avg_spec_accept_length"] >= 1.0
    metrics = httpx.get(f"{spec_server.base_url}/metrics", timeout=30).text
    count = next(line for line in metrics.splitlines()
                 if line.startswith("sgl:spec_accept_length_count"))
    assert float(count.split()[-1]) >= 1


def test_bench_serving_prints_the_accept_length(spec_server: ServerProcess,
                                                tmp_path: Path) -> None:
    result = run_cli(["bench", "serving", "--base-url", spec_server.base_url,
                      "--dataset-name", "random", "--num-prompts", "3", "--random-input-len",
                      "32", "--random-output-len", "8", "--disable-tqdm"], timeout=300)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("Accept length"))
    assert float(line.split()[-1]) >= 1.0


@pytest.mark.parametrize(("args", "names"), [
    (["--speculative-num-draft-tokens", "4"], ["speculative_num_draft_tokens",
                                               "--speculative-algorithm"]),
    (["--speculative-algorithm", "NGRAM", "--speculative-eagle-topk", "4"],
     ["--speculative-eagle-topk"]),
    (["--speculative-algorithm", "NGRAM", "--speculative-num-steps", "3"],
     ["--speculative-num-steps"]),
    (["--speculative-algorithm", "NGRAM", "--speculative-draft-model-path", "x"],
     ["--speculative-draft-model-path"]),
    (["--speculative-algorithm", "NGRAM", "--speculative-ngram-min-match-window-size", "5",
      "--speculative-ngram-max-match-window-size", "3"],
     ["--speculative-ngram-min-match-window-size"]),
    (["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "1"],
     ["speculative_num_draft_tokens", "at least 2"]),
    (["--speculative-algorithm", "EAGLE9"], ["EAGLE9", "NGRAM"]),
])
def test_bad_combinations_fail_before_loading(args: list[str], names: list[str]) -> None:
    result = run_cli(["serve", "--port", "1", *args], timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    for name in names:
        assert name in result.stderr, result.stderr


def test_n_samples_and_sessions_equal_the_plain_server(spec_server: ServerProcess,
                                                       server: ServerProcess) -> None:
    """``n > 1`` (seeded) and a two-turn session give the same tokens with speculation as the
    shared float32 server without it."""
    def both(**body: object) -> list[dict]:
        return [generate(s, **body) for s in (server, spec_server)]

    plain, spec = both(text=[PROMPT], sampling_params={"temperature": 0.8, "seed": 21, "n": 2,
                                                       "max_new_tokens": 32})
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    # a sample that ends at its first token (from the prefill) never verified anything
    assert all(o["meta_info"].get("spec_verify_ct", 0) >= 1 for o in spec
               if o["meta_info"]["completion_tokens"] > 1), [o["meta_info"] for o in spec]
    assert any("spec_verify_ct" in o["meta_info"] for o in spec)
    turns = []
    for s in (server, spec_server):
        sid = httpx.post(f"{s.base_url}/open_session", json={}, timeout=30).json()
        text, outputs = PROMPT, []
        for _ in range(2):
            out = generate(s, text=text, session_params={"id": sid},
                           sampling_params={"temperature": 0, "max_new_tokens": 24})
            outputs.append(out["output_ids"])
            text = text + out["text"] + " And once more, exactly:"
        r = httpx.post(f"{s.base_url}/close_session", json={"session_id": sid}, timeout=30)
        assert r.status_code == 200
        turns.append(outputs)
    assert turns[1] == turns[0]
