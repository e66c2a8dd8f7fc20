"""SGLang's native API (plugin sgl-frontend-native) against the real session server."""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import httpx
import pytest

from sgl_testing import ServerProcess, run_cli

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "max_new_tokens": 8}


def generate(server: ServerProcess, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}/generate", json=body, timeout=120)


def stream_events(server: ServerProcess, **body: Any) -> list[Any]:
    """Every ``data:`` event of a streamed /generate, parsed (``[DONE]`` stays a string)."""
    events: list[Any] = []
    with httpx.stream("POST", f"{server.base_url}/generate", json={**body, "stream": True},
                      timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        buffer = ""
        for text in response.iter_text():
            buffer += text
            while "\n\n" in buffer:
                event, buffer = buffer.split("\n\n", 1)
                assert event.startswith("data: "), event
                data = event[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    assert buffer == ""
    return events


def load(server: ServerProcess) -> dict[str, Any]:
    info = httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()
    return info["internal_states"][0]


def wait_running(server: ServerProcess, count: int = 1, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while load(server)["num_running_reqs"] < count:
        assert time.monotonic() < deadline, "the request never started running"
        time.sleep(0.05)


def test_plugin_is_installed() -> None:
    result = run_cli(["plugins", "--json"])
    plugins = {p["name"]: p for p in json.loads(result.stdout)}
    assert plugins["frontend-native"]["available"]
    assert plugins["frontend-native"]["hooks"] == ["sgl_register_frontends"]


def test_generate_text(server: ServerProcess) -> None:
    response = generate(server, text=PROMPT, sampling_params=GREEDY)
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"text", "output_ids", "meta_info"}
    assert "Paris" in body["text"]
    assert len(body["output_ids"]) == 8
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 8
    assert meta["cached_tokens"] >= 0
    assert meta["e2e_latency"] > 0
    assert len(meta["id"]) == 32  # a fresh uuid hex when no rid is given
    assert "output_token_logprobs" not in meta


def test_generate_input_ids_matches_text(server: ServerProcess) -> None:
    by_text = generate(server, text=PROMPT, sampling_params=GREEDY, return_logprob=True,
                       logprob_start_len=0).json()
    prompt_ids = [entry[1] for entry in by_text["meta_info"]["input_token_logprobs"]]
    assert len(prompt_ids) == 5
    by_ids = generate(server, input_ids=prompt_ids, sampling_params=GREEDY, rid="ids-1").json()
    assert by_ids["output_ids"] == by_text["output_ids"]
    assert by_ids["text"] == by_text["text"]
    assert by_ids["meta_info"]["id"] == "ids-1"


def test_generate_batch_with_per_prompt_sampling(server: ServerProcess) -> None:
    response = generate(server, text=[PROMPT, "One, two, three,"], rid=["b-0", "b-1"],
                        sampling_params=[{"temperature": 0, "max_new_tokens": 3},
                                         {"temperature": 0, "max_new_tokens": 5}])
    assert response.status_code == 200, response.text
    first, second = response.json()
    assert first["meta_info"]["id"] == "b-0" and second["meta_info"]["id"] == "b-1"
    assert first["meta_info"]["completion_tokens"] == 3
    assert second["meta_info"]["completion_tokens"] == 5
    alone = generate(server, text=PROMPT,
                     sampling_params={"temperature": 0, "max_new_tokens": 3}).json()
    assert first["output_ids"] == alone["output_ids"]


def test_input_ids_batch(server: ServerProcess) -> None:
    results = generate(server, input_ids=[[504, 3575], [504]],
                       sampling_params={"temperature": 0, "max_new_tokens": 2}).json()
    assert [r["meta_info"]["prompt_tokens"] for r in results] == [2, 1]
    assert all(len(r["output_ids"]) == 2 for r in results)


def test_stop_string_finish_reason(server: ServerProcess) -> None:
    free = generate(server, text=PROMPT,
                    sampling_params={"temperature": 0, "max_new_tokens": 12}).json()
    stop = free["text"].strip().split()[1]  # a word the greedy continuation produces
    stopped = generate(server, text=PROMPT, sampling_params={
        "temperature": 0, "max_new_tokens": 12, "stop": [stop]}).json()
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stopped["text"] == free["text"][:free["text"].index(stop)]


def test_stream_is_cumulative_and_ends_with_done(server: ServerProcess) -> None:
    whole = generate(server, text=PROMPT, sampling_params=GREEDY, return_logprob=True).json()
    events = stream_events(server, text=PROMPT, sampling_params=GREEDY, return_logprob=True)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2
    for before, after in zip(chunks, chunks[1:]):
        assert after["text"].startswith(before["text"])  # SGLang streams the text so far
        assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
        assert before["meta_info"]["finish_reason"] is None
    last = chunks[-1]
    assert last["text"] == whole["text"]
    assert last["output_ids"] == whole["output_ids"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert "e2e_latency" in last["meta_info"]
    # each event carries only the new logprob entries: one per output token it adds
    seen = 0
    logprobs = []
    for chunk in chunks:
        new = chunk["meta_info"]["output_token_logprobs"]
        assert len(new) == len(chunk["output_ids"]) - seen
        seen += len(new)
        assert chunk["meta_info"]["output_token_logprobs_length"] == seen  # SGLang's running count
        logprobs += new
    assert [e[1] for e in logprobs] == whole["output_ids"]
    for got, want in zip(logprobs, whole["meta_info"]["output_token_logprobs"]):
        assert got[0] == pytest.approx(want[0], abs=1e-3)


def test_stream_batch_has_index(server: ServerProcess) -> None:
    events = stream_events(server, text=[PROMPT, "Hello"],
                           sampling_params={"temperature": 0, "max_new_tokens": 3})
    assert events[-1] == "[DONE]"
    finished = {c["index"] for c in events[:-1] if c["meta_info"]["finish_reason"]}
    assert finished == {0, 1}


def test_logprobs(server: ServerProcess) -> None:
    body = generate(server, text=PROMPT, sampling_params=GREEDY, return_logprob=True,
                    logprob_start_len=0, top_logprobs_num=3, return_text_in_logprobs=True).json()
    meta = body["meta_info"]
    inputs = meta["input_token_logprobs"]
    assert len(inputs) == meta["prompt_tokens"]
    assert inputs[0][0] is None  # nothing predicts the first token
    assert all(lp <= 0 for lp, _, _ in inputs[1:])
    assert "".join(text for _, _, text in inputs) == PROMPT
    outputs = meta["output_token_logprobs"]
    assert [tid for _, tid, _ in outputs] == body["output_ids"]
    assert meta["output_token_logprobs_length"] == len(outputs) == 8
    assert len(meta["output_top_logprobs"]) == 8
    for chosen, top in zip(outputs, meta["output_top_logprobs"]):
        assert len(top) == 3
        assert top[0][1] == chosen[1]  # greedy picks the most likely token
        assert top[0][0] == pytest.approx(chosen[0], abs=1e-4)
        assert top[0][0] >= top[1][0] >= top[2][0]
    assert len(meta["input_top_logprobs"]) == meta["prompt_tokens"]


def test_logprob_start_len(server: ServerProcess) -> None:
    meta = generate(server, text=PROMPT, sampling_params=GREEDY, return_logprob=True,
                    logprob_start_len=3).json()["meta_info"]
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"] - 3


def test_max_new_tokens_zero_gives_prompt_logprobs(server: ServerProcess) -> None:
    body = generate(server, text=PROMPT, sampling_params={"max_new_tokens": 0},
                    return_logprob=True, logprob_start_len=0).json()
    assert body["text"] == "" and body["output_ids"] == []
    meta = body["meta_info"]
    assert meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert len(meta["input_token_logprobs"]) == 5
    assert meta["output_token_logprobs"] == []


@pytest.mark.parametrize("path", ["/get_model_info", "/model_info"])
def test_model_info(server: ServerProcess, path: str) -> None:
    info = httpx.get(f"{server.base_url}{path}").json()
    assert info["model_path"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert info["is_generation"] is True
    assert info["architectures"] == ["LlamaForCausalLM"]
    assert info["model_type"] == "llama"


@pytest.mark.parametrize("path", ["/get_server_info", "/server_info"])
def test_server_info(server: ServerProcess, path: str) -> None:
    info = httpx.get(f"{server.base_url}{path}").json()
    assert info["port"] == server.port and info["max_total_tokens"] == 16384
    assert info["context_length"] > 0 and info["version"]
    state = info["internal_states"][0]
    assert state["num_running_reqs"] == 0
    assert {"kv_used_tokens", "kv_total_tokens", "num_waiting_reqs"} <= set(state)
    assert info["api_key"] is None
    # plugins' options by SGLang's names, as its router and clients read them
    assert info["disaggregation_mode"] == "null" and info["load_balance_method"] is None
    assert info["plugins"]["disaggregation"]["bootstrap_port"] == 8998


def test_health_generate(server: ServerProcess) -> None:
    response = httpx.get(f"{server.base_url}/health_generate", timeout=60)
    assert response.status_code == 200


def test_flush_cache_when_idle(server: ServerProcess) -> None:
    for method in ("GET", "POST"):
        response = httpx.request(method, f"{server.base_url}/flush_cache", timeout=30)
        assert response.status_code == 200, response.text
        assert response.text.startswith("Cache flushed.")


def _long_request(server: ServerProcess, rid: str, out: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        out["response"] = generate(server, text="Tell me a very long story.", rid=rid,
                                   sampling_params={"max_new_tokens": 2000, "ignore_eos": True})

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_abort_request_and_flush_while_busy(server: ServerProcess) -> None:
    rid = f"long-{uuid.uuid4().hex}"
    out: dict[str, Any] = {}
    thread = _long_request(server, rid, out)
    try:
        wait_running(server)
        busy = httpx.post(f"{server.base_url}/flush_cache", timeout=30)
        assert busy.status_code == 400
        assert "running" in busy.text
        aborted = httpx.post(f"{server.base_url}/abort_request", json={"rid": rid}, timeout=30)
        assert aborted.status_code == 200
    finally:
        thread.join(120)
    response = out["response"]
    assert response.status_code == 200, response.text
    meta = response.json()["meta_info"]
    assert meta["id"] == rid
    assert meta["finish_reason"]["type"] == "abort"
    assert meta["completion_tokens"] < 2000
    deadline = time.monotonic() + 10
    while load(server)["num_running_reqs"]:
        assert time.monotonic() < deadline, "the aborted request still runs in the scheduler"
        time.sleep(0.05)
    assert httpx.post(f"{server.base_url}/flush_cache", timeout=30).status_code == 200


def test_abort_unknown_rid_is_fine(server: ServerProcess) -> None:
    response = httpx.post(f"{server.base_url}/abort_request", json={"rid": "no-such-request"})
    assert response.status_code == 200


@pytest.mark.parametrize("body,needle", [
    (b"{not json", "not valid JSON"),
    (b"", "empty"),
    (b"[1, 2]", "JSON object"),
    (b'{"sampling_params": {}}', "text or input_ids"),
    (b'{"text": 5}', "text"),
    (b'{"text": "hi", "input_ids": [1]}', "either"),
    (b'{"input_ids": ["a", "b"]}', "input_ids"),
    (b'{"input_ids": [1, 99999999]}', "vocabulary"),
    (b'{"text": "hi", "sampling_params": "greedy"}', "sampling_params"),
    (b'{"text": "hi", "sampling_params": {"bogus": 1}}', "bogus"),
    (b'{"text": "hi", "sampling_params": {"temperature": -1}}', "temperature"),
    (b'{"text": "hi", "sampling_params": {"max_new_tokens": "ten"}}', "max_new_tokens"),
    (b'{"text": "hi", "sampling_params": [{}, {}]}', "sampling_params"),
    (b'{"text": ["a", "b"], "sampling_params": [{}]}', "sampling_params"),
    (b'{"text": "hi", "nonsense": true}', "nonsense"),
    (b'{"text": "hi", "stream": "yes"}', "stream"),
    (b'{"text": "hi", "return_logprob": "yes"}', "return_logprob"),
    (b'{"text": "hi", "return_logprob": true, "logprob_start_len": 50}', "logprob_start_len"),
    (b'{"text": "hi", "top_logprobs_num": -2}', "top_logprobs_num"),
    (b'{"text": "hi", "rid": 7}', "rid"),
    (b'{"text": []}', "empty"),
    (b'{"text": "' + b"hello " * 9000 + b'"}', "context length"),
])
def test_bad_generate_requests_get_400(server: ServerProcess, body: bytes, needle: str) -> None:
    response = httpx.post(f"{server.base_url}/generate", content=body, timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert needle in error["message"], error


@pytest.mark.parametrize("body", [b"{oops", b'"rid"', b'{"rid": 5}', b'{"abort_all": "yes"}'])
def test_bad_abort_requests_get_400(server: ServerProcess, body: bytes) -> None:
    response = httpx.post(f"{server.base_url}/abort_request", content=body)
    assert response.status_code == 400
    assert response.json()["error"]["message"]


def test_server_still_serves_after_bad_requests(server: ServerProcess) -> None:
    assert generate(server, text=PROMPT, sampling_params=GREEDY).status_code == 200


def test_the_payload_of_sglangs_serving_benchmark_is_accepted(server: ServerProcess) -> None:
    """SGLang's bench_serving (sglang backend) sends these fields with empty values; checked by
    hand against sglang 0.5.23's bench_serving, which ran unchanged against sgl."""
    events = stream_events(server, input_ids=[504, 3575, 282], sampling_params={
        "temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}, lora_path=None,
        return_logprob=False, return_routed_experts=False, logprob_start_len=-1)
    assert events[-1] == "[DONE]"
    assert events[-2]["meta_info"]["completion_tokens"] == 4
