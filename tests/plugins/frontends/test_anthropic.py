"""The Anthropic frontend through the official ``anthropic`` client, against the real server
and model. (This client version takes sampling fields such as ``temperature`` only through
``extra_body``.)"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from sgl.plugins import create_plugin_manager
from sgl_testing import CAPITAL_QUESTION, ServerProcess

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": CAPITAL_QUESTION}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0,
                               timeout=120)


def test_plugin_is_installed() -> None:
    pm = create_plugin_manager()
    assert pm.records["frontend-anthropic"].available
    assert pm.registries.frontends.entry("anthropic").owner == "frontend-anthropic"


def test_messages(client: anthropic.Anthropic, server: ServerProcess) -> None:
    m = client.messages.create(model="default", max_tokens=24, messages=QUESTION,
                               extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.content[0].type == "text" and "Paris" in m.content[0].text
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert m.usage.input_tokens > 5 and 0 < m.usage.output_tokens <= 24
    # the same conversation through the OpenAI route gives the same greedy text
    oai = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    chat = oai.chat.completions.create(model="default", messages=QUESTION, temperature=0,
                                       max_tokens=24)
    assert m.content[0].text == chat.choices[0].message.content
    assert m.usage.input_tokens == chat.usage.prompt_tokens


def test_system_max_tokens_and_stop_sequences(client: anthropic.Anthropic) -> None:
    base = client.messages.create(model="default", max_tokens=3, messages=QUESTION,
                                  system="You answer in French.", extra_body=GREEDY)
    plain = client.messages.create(model="default", max_tokens=3, messages=QUESTION,
                                   extra_body=GREEDY)
    assert base.usage.input_tokens != plain.usage.input_tokens  # the system prompt is used
    assert base.stop_reason == "max_tokens" and base.usage.output_tokens == 3
    full = client.messages.create(model="default", max_tokens=24, messages=QUESTION,
                                  extra_body=GREEDY).content[0].text
    word = full.split()[2]
    cut = client.messages.create(model="default", max_tokens=24, messages=QUESTION,
                                 stop_sequences=[word], extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert word not in cut.content[0].text and full.startswith(cut.content[0].text)
    sampled = client.messages.create(model="default", max_tokens=4, messages=QUESTION,
                                     system=[{"type": "text", "text": "Be brief."}],
                                     extra_body={"temperature": 0.7, "top_p": 0.9, "top_k": 20})
    assert sampled.usage.output_tokens <= 4


def test_assistant_prefill_is_continued(client: anthropic.Anthropic) -> None:
    m = client.messages.create(model="default", max_tokens=8, extra_body=GREEDY, messages=[
        *QUESTION, {"role": "assistant", "content": "The capital of France is"}])
    assert m.content[0].text.strip().startswith("Paris")


def test_stream_event_sequence(client: anthropic.Anthropic, server: ServerProcess) -> None:
    whole = client.messages.create(model="default", max_tokens=24, messages=QUESTION,
                                   extra_body=GREEDY)
    with httpx.stream("POST", f"{server.base_url}/v1/messages", timeout=120, json={
            "model": "default", "max_tokens": 4, "messages": QUESTION, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        wire = [line.split(": ", 1)[1] for line in r.iter_lines() if line.startswith("event:")]
    assert wire[:3] == ["message_start", "content_block_start", "ping"]
    assert wire[-1] == "message_stop"
    events = list(client.messages.create(model="default", max_tokens=24, messages=QUESTION,
                                         stream=True, extra_body=GREEDY))
    kinds = [e.type for e in events]  # the client drops pings
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    assert events[-2].delta.stop_reason == "end_turn"
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    with client.messages.stream(model="default", max_tokens=24, messages=QUESTION,
                                extra_body=GREEDY) as stream:
        assert "".join(stream.text_stream) == whole.content[0].text
        assert stream.get_final_message().stop_reason == "end_turn"


def test_count_tokens(client: anthropic.Anthropic, server: ServerProcess) -> None:
    m = client.messages.create(model="default", max_tokens=1, messages=QUESTION,
                               extra_body=GREEDY)
    r = httpx.post(f"{server.base_url}/v1/messages/count_tokens",
                   json={"model": "default", "messages": QUESTION})
    assert r.json() == {"input_tokens": m.usage.input_tokens}


def test_unknown_model_is_404(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as exc:
        client.messages.create(model="claude-x", max_tokens=4, messages=QUESTION)
    assert exc.value.body["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("body", [
    b"{nope",
    b"[]",
    b'{"model": "default", "messages": [{"role": "user", "content": "hi"}]}',  # no max_tokens
    b'{"model": "default", "max_tokens": "ten", "messages": [{"role": "user", "content": "x"}]}',
    b'{"model": "default", "max_tokens": 5, "messages": []}',
    b'{"model": "default", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}',
    b'{"model": "default", "max_tokens": 5, "temperature": 1.5, '
    b'"messages": [{"role": "user", "content": "x"}]}',
    b'{"model": "default", "max_tokens": 5, "bogus": 1, '
    b'"messages": [{"role": "user", "content": "x"}]}',
    b'{"model": "default", "max_tokens": 5, "messages": [{"role": "user", "content": '
    b'[{"type": "image", "source": {}}]}]}',
    b'{"model": "default", "max_tokens": 5, "stream": true, '
    b'"messages": [{"role": "user", "content": "' + b"hello " * 9000 + b'"}]}',
])
def test_bad_requests_get_anthropic_errors(server: ServerProcess, body: bytes) -> None:
    r = httpx.post(f"{server.base_url}/v1/messages", content=body,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"]
    json.dumps(error)
