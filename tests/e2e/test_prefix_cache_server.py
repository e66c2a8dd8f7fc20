"""The radix cache through the real server: cached_tokens in /generate's meta_info and in the
OpenAI usage, cache state in /get_server_info, /flush_cache, and sessions."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from sgl_testing import ServerProcess

pytestmark = pytest.mark.slow

PROMPT = ("A long shared system prompt for the prefix cache test. " * 6
          + "Question: what is the capital of France? Answer:")
GREEDY = {"max_new_tokens": 4, "temperature": 0}


def post(server: ServerProcess, path: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=120)


def internal(server: ServerProcess) -> dict[str, Any]:
    info = httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()
    return info["internal_states"][0]


def flush(server: ServerProcess) -> None:
    assert httpx.post(f"{server.base_url}/flush_cache", timeout=30).status_code == 200
    assert internal(server)["cached_tokens"] == 0


def test_repeated_generate_reports_cached_tokens(server: ServerProcess) -> None:
    flush(server)
    first = post(server, "/generate", text=PROMPT, sampling_params=GREEDY).json()
    again = post(server, "/generate", text=PROMPT, sampling_params=GREEDY).json()
    prompt_tokens = first["meta_info"]["prompt_tokens"]
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] == prompt_tokens - 1
    assert again["text"] == first["text"]
    state = internal(server)
    assert state["cache_policy"] == "radix" and state["schedule_policy"] == "lpm"
    assert state["cached_tokens"] >= prompt_tokens
    assert 0 < state["cache_hit_rate"] <= 1
    flush(server)
    after = post(server, "/generate", text=PROMPT, sampling_params=GREEDY).json()
    assert after["meta_info"]["cached_tokens"] == 0


def test_n_samples_share_the_prompt(server: ServerProcess) -> None:
    flush(server)
    results = post(server, "/generate", text=PROMPT,
                   sampling_params={"max_new_tokens": 4, "temperature": 0.7, "n": 3}).json()
    assert len(results) == 3
    cached = sorted(r["meta_info"]["cached_tokens"] for r in results)
    prompt_tokens = results[0]["meta_info"]["prompt_tokens"]
    assert cached == [0, prompt_tokens - 1, prompt_tokens - 1]


def test_openai_usage_reports_cached_tokens(server: ServerProcess) -> None:
    flush(server)
    body = {"model": "default", "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "system", "content": PROMPT},
                         {"role": "user", "content": "Say hi."}]}
    first = post(server, "/v1/chat/completions", **body).json()
    again = post(server, "/v1/chat/completions", **body).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == again["usage"]["prompt_tokens"] - 1


def test_sessions(server: ServerProcess) -> None:
    response = post(server, "/open_session", capacity_of_str_len=1000)
    assert response.status_code == 200
    sid = response.json()
    assert isinstance(sid, str) and sid
    assert internal(server)["num_sessions"] >= 1
    first = post(server, "/generate", text=PROMPT, sampling_params=GREEDY,
                 session_params={"id": sid}).json()
    turn2 = PROMPT + first["text"] + " And of Spain?"
    second = post(server, "/generate", text=turn2, sampling_params=GREEDY,
                  session_params={"id": sid}).json()
    assert second["meta_info"]["cached_tokens"] >= first["meta_info"]["prompt_tokens"]
    assert post(server, "/close_session", session_id=sid).status_code == 200
    closed = post(server, "/close_session", session_id=sid)
    assert closed.status_code == 400 and "not open" in closed.json()["error"]["message"]
    unknown = post(server, "/generate", text=PROMPT, sampling_params=GREEDY,
                   session_params={"id": sid})
    assert unknown.status_code == 400 and "not open" in unknown.json()["error"]["message"]
    bad = post(server, "/generate", text=PROMPT, session_params={"id": sid, "offset": 3})
    assert bad.status_code == 400 and "offset" in bad.json()["error"]["message"]
    assert post(server, "/open_session", session_id=7).status_code == 400
