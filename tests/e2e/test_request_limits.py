"""Limits a request cannot get past (issue 17): an output that cannot fit in the context, and
more top logprobs than the vocabulary has. Each is a 400 naming the limit, on the session
server, and the server goes on answering."""

from __future__ import annotations

import httpx
import pytest

from sgl_testing import ServerProcess

HUGE = 2**31


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": "default", "prompt": "Hi", "max_tokens": HUGE,
                         "ignore_eos": True, "stream": True}),
    ("/v1/chat/completions", {"model": "default", "max_tokens": 400000,
                              "messages": [{"role": "user", "content": "Hi"}]}),
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": HUGE}}),
])
def test_an_output_longer_than_the_context_is_refused(server: ServerProcess, path: str,
                                                      body: dict) -> None:
    """It used to be accepted, and its admission reserved KV for all of it, so every request
    after it waited for ever."""
    response = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert "new tokens fit" in response.text and "context length is" in response.text
    ok = httpx.post(f"{server.base_url}/generate", timeout=60, json={
        "text": "Hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert ok.status_code == 200


def test_anthropic_max_tokens_is_a_cap(server: ServerProcess) -> None:
    """Anthropic's max_tokens bounds the reply; beyond the context it is cut to what fits, as
    Anthropic's API does, rather than refused."""
    response = httpx.post(f"{server.base_url}/v1/messages", timeout=60, json={
        "model": "default", "max_tokens": HUGE, "temperature": 0,
        "messages": [{"role": "user", "content": "Say hi."}]})
    assert response.status_code == 200, response.text


def test_more_top_logprobs_than_the_vocabulary_is_refused(server: ServerProcess) -> None:
    """It used to reach the sampler and fail the whole batch ("selected index k out of
    range")."""
    vocab = httpx.get(f"{server.base_url}/get_server_info", timeout=60).json()["vocab_size"]
    response = httpx.post(f"{server.base_url}/generate", timeout=60, json={
        "text": "Hi", "return_logprob": True, "top_logprobs_num": vocab + 1,
        "sampling_params": {"max_new_tokens": 2}})
    assert response.status_code == 400, response.text
    assert f"more than the vocabulary's {vocab} tokens" in response.text
