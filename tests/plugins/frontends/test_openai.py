"""The OpenAI frontend through the official ``openai`` client, against the real server and
model (greedy where outputs are compared)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from sgl.plugins import create_plugin_manager
from sgl_testing import CAPITAL_QUESTION, ServerProcess

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": CAPITAL_QUESTION}]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def test_plugin_is_installed() -> None:
    pm = create_plugin_manager()
    assert pm.records["frontend-openai"].available
    assert pm.registries.frontends.entry("openai").owner == "frontend-openai"


def test_chat_completion(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="default", messages=QUESTION, temperature=0,
                                       max_tokens=24)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    assert r.model == "SmolLM2-135M-Instruct.Q4_1"


def test_chat_equals_completion_of_the_templated_prompt(client: openai.OpenAI,
                                                        server: ServerProcess) -> None:
    """The chat route's text is what generating from the chat-templated token ids gives."""
    chat = client.chat.completions.create(model="default", messages=QUESTION, temperature=0,
                                          max_tokens=16)
    ids = httpx.post(f"{server.base_url}/v1/tokenize",
                     json={"messages": QUESTION}).json()["tokens"]
    completion = client.completions.create(model="default", prompt=ids, temperature=0,
                                           max_tokens=16)
    assert chat.choices[0].message.content == completion.choices[0].text
    assert chat.usage.prompt_tokens == len(ids)


def test_chat_equals_native_generate(client: openai.OpenAI, server: ServerProcess) -> None:
    """The same greedy request through SGLang's native /generate (the TokenizerManager's own
    result shape) gives the same text and counts."""
    ids = httpx.post(f"{server.base_url}/v1/tokenize",
                     json={"messages": QUESTION}).json()["tokens"]
    native = httpx.post(f"{server.base_url}/generate", timeout=120, json={
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 16}})
    if native.status_code == 404:
        pytest.skip("the native frontend is not installed")
    chat = client.chat.completions.create(model="default", messages=QUESTION, temperature=0,
                                          max_tokens=16)
    body = native.json()
    assert chat.choices[0].message.content == body["text"]
    assert chat.usage.completion_tokens == body["meta_info"]["completion_tokens"]
    assert chat.usage.prompt_tokens == body["meta_info"]["prompt_tokens"]


def test_chat_stream_matches_non_stream_and_reports_usage(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="default", messages=QUESTION, temperature=0,
                                           max_tokens=24)
    chunks = list(client.chat.completions.create(
        model="default", messages=QUESTION, temperature=0, max_tokens=24, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_with_n_choices_matches_non_stream(client: openai.OpenAI) -> None:
    args = dict(model="default", messages=[{"role": "user", "content": "Tell me a word."}],
                temperature=1.0, max_tokens=6, n=2, seed=11)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True,
                                             "continuous_usage_stats": True}))
    texts = {0: "", 1: ""}
    for c in chunks[:-1]:
        assert c.usage is not None  # continuous usage: every chunk carries the counts so far
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stream_ends_with_done(server: ServerProcess) -> None:
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", timeout=120, json={
            "model": "default", "messages": QUESTION, "max_tokens": 4, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_n_choices_and_seed(client: openai.OpenAI) -> None:
    args = dict(model="default", messages=[{"role": "user", "content": "Tell me a word."}],
                temperature=1.0, max_tokens=8, n=3, seed=7)
    first = client.chat.completions.create(**args)
    second = client.chat.completions.create(**args)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == \
        [c.message.content for c in second.choices]
    assert 3 <= first.usage.completion_tokens <= 24


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="default", messages=QUESTION, temperature=0,
                                       max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert item.top_logprobs[0].token == item.token
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-4)
        assert bytes(item.bytes).decode() == item.token
    assert "".join(i.token for i in content).startswith(r.choices[0].message.content[:5])


def test_completions_batch_n_echo_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model="default", prompt=["The sky is", "One, two,"],
                                  max_tokens=5, temperature=0, n=2, logprobs=2, echo=True)
    assert r.object == "text_completion" and [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text.startswith("The sky is")
    assert r.choices[2].text.startswith("One, two,")
    assert r.choices[0].text == r.choices[1].text  # greedy
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None  # the first prompt token has no logprob
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[1] == len(lp.tokens[0])
    assert r.usage.completion_tokens == 20


def test_completions_stream_matches_non_stream(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="default", prompt="The sky is", max_tokens=10,
                                      temperature=0)
    chunks = list(client.completions.create(model="default", prompt="The sky is",
                                            max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 10


def test_completions_default_max_tokens_is_16(client: openai.OpenAI) -> None:
    r = client.completions.create(model="default", prompt="Once upon a time", temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_stop_and_max_completion_tokens(client: openai.OpenAI) -> None:
    full = client.completions.create(model="default", prompt="One, two, three,", max_tokens=12,
                                     temperature=0).choices[0].text
    stop = full.strip()[2:4]
    cut = client.completions.create(model="default", prompt="One, two, three,", max_tokens=12,
                                    temperature=0, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and stop not in cut.text
    assert full.startswith(cut.text)
    r = client.chat.completions.create(model="default", messages=QUESTION, temperature=0,
                                       max_completion_tokens=3)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_logit_bias_and_penalties_change_the_output(client: openai.OpenAI,
                                                    server: ServerProcess) -> None:
    base = client.chat.completions.create(model="default", messages=QUESTION, temperature=0,
                                          max_tokens=4)
    first = httpx.post(f"{server.base_url}/v1/tokenize",
                       json={"prompt": base.choices[0].message.content}).json()["tokens"][0]
    biased = client.chat.completions.create(model="default", messages=QUESTION, temperature=0,
                                            max_tokens=4, logit_bias={str(first): -100})
    assert biased.choices[0].message.content != base.choices[0].message.content
    r = client.chat.completions.create(model="default", messages=QUESTION, temperature=0.5,
                                       top_p=0.9, presence_penalty=1.0, frequency_penalty=0.5,
                                       max_tokens=4, user="tester")
    assert r.usage.completion_tokens <= 4


def test_penalties_break_repetition(client: openai.OpenAI) -> None:
    """Greedy " apple, apple, apple," repeats itself; either penalty changes that."""
    def text(**extra: float) -> str:
        return client.completions.create(model="default", prompt="apple, apple, apple, apple,",
                                         temperature=0, max_tokens=10, **extra).choices[0].text

    base = text()
    assert base.count(" apple") >= 3
    assert text(frequency_penalty=2.0) != base and text(presence_penalty=2.0) != base


def test_tokenize_detokenize_round_trip(server: ServerProcess) -> None:
    text = "Hello, world! Ünïcödé works too."
    tok = httpx.post(f"{server.base_url}/v1/tokenize",
                     json={"model": "default", "prompt": text, "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) > 3 and len(tok["token_strs"]) == tok["count"]
    back = httpx.post(f"{server.base_url}/v1/detokenize", json={"tokens": tok["tokens"]}).json()
    assert back["prompt"] == text


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct.Q4_1"]
    assert client.models.retrieve("SmolLM2-135M-Instruct.Q4_1").id == models.data[0].id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_response_format_needs_a_grammar_backend(client: openai.OpenAI) -> None:
    if create_plugin_manager().registries.grammar.names():  # installed: JSON comes back
        r = client.chat.completions.create(model="default", messages=QUESTION, temperature=0,
                                           max_tokens=64, response_format={"type": "json_object"})
        if r.choices[0].finish_reason == "stop":
            json.loads(r.choices[0].message.content)
        return
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="default", messages=QUESTION,
                                       response_format={"type": "json_object"})
    assert "sgl-grammar-xgrammar" in str(exc.value)
    assert exc.value.body["param"] == "response_format"
    r = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=2,
                                       response_format={"type": "text"})
    assert r.choices[0].message.content is not None


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-9", messages=QUESTION)
    assert exc.value.body["code"] == "model_not_found" and "gpt-9" in exc.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hi")


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", b"{oops", None),
    ("/v1/completions", b"[1, 2]", None),
    ("/v1/completions", b'{"model": "default"}', "prompt"),
    ("/v1/completions", b'{"model": "default", "prompt": 5}', "prompt"),
    ("/v1/completions", b'{"model": "default", "prompt": "hi", "n": "two"}', "n"),
    ("/v1/completions", b'{"model": "default", "prompt": "hi", "max_tokens": -1}', "max_tokens"),
    ("/v1/completions", b'{"model": "default", "prompt": "hi", "frobnicate": 1}', "frobnicate"),
    ("/v1/completions", b'{"model": "default", "prompt": ""}', None),
    ("/v1/completions", b'{"model": "default", "prompt": [999999]}', None),
    ("/v1/completions", b'{"model": "default", "prompt": "hi", "suffix": "x"}', "suffix"),
    ("/v1/completions", b'{"model": "default", "prompt": "hi", "seed": 18446744073709551615}',
     "seed"),
    ("/v1/completions", b'{"model": "default", "prompt": "hi", "n": 2, '
                        b'"seed": 9223372036854775807}', "seed"),
    ("/v1/chat/completions", b'{"model": "default", "messages": [{"role": "user", "content": '
                             b'"hi"}], "top_logprobs": 2}', "top_logprobs"),
    ("/v1/chat/completions", b'{"model": "default", "messages": [{"role": "user", "content": '
                             b'"hi"}], "logit_bias": {"x": 1}}', "logit_bias"),
    ("/v1/chat/completions", b'{"model": "default", "messages": [{"role": "user", "content": '
                             b'"hi"}], "stream_options": {"include_usage": true}}',
     "stream_options"),
    ("/v1/chat/completions", b'{"model": "default", "messages": [{"role": "user", "content": '
                             b'[{"type": "image_url", "image_url": {"url": "x"}}]}]}', "messages"),
    ("/v1/chat/completions", b'{"model": "default", "messages": [{"role": "user", "content": '
                             b'"hi"}], "tool_choice": "required"}', "tool_choice"),
    ("/v1/chat/completions", b'{"model": "default", "messages": [{"role": "user", "content": '
                             b'"hi"}], "stream": true, "max_tokens": "x"}', "max_tokens"),
    ("/v1/tokenize", b'{"prompt": "a", "messages": []}', None),
    ("/v1/detokenize", b'{"tokens": [-1]}', "tokens"),
    ("/v1/detokenize", b'{"tokens": "abc"}', "tokens"),
])
def test_bad_requests_are_4xx_openai_errors(server: ServerProcess, path: str, body: bytes,
                                            param: str | None) -> None:
    r = httpx.post(f"{server.base_url}{path}", content=body,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_response_format_and_the_grammar_registry() -> None:
    """JSON formats are refused while no grammar backend is registered, naming the plugin to
    install; with one they become a ``json_schema`` sampling parameter."""
    from types import SimpleNamespace

    from sgl.registry import Registry
    from sgl.sampling import SamplingParams
    from sgl_frontend_openai.common import OpenAIError, check_response_format
    from sgl_frontend_openai.protocol import ResponseFormat

    grammar: Registry[object] = Registry("grammar backend")
    server = SimpleNamespace(plugin_manager=SimpleNamespace(
        registries=SimpleNamespace(grammar=grammar)))
    schema = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {
        "name": "city", "schema": {"type": "object"}}})
    with pytest.raises(OpenAIError, match="sgl-grammar-xgrammar"):
        check_response_format(server, schema)
    assert check_response_format(server, ResponseFormat(type="text")) == {}
    grammar.register("toy-grammar", "collections:OrderedDict", owner="toy")
    assert check_response_format(server, schema) == {"json_schema": '{"type": "object"}'}
    assert check_response_format(server, ResponseFormat(type="json_object")) == {
        "json_schema": '{"type": "object"}'}
    assert "json_schema" in SamplingParams.__dataclass_fields__
    with pytest.raises(OpenAIError, match="schema is required"):
        check_response_format(server, ResponseFormat(type="json_schema"))


@pytest.mark.parametrize("status,kind", [(503, "server_error"), (500, "server_error"),
                                         (400, "invalid_request_error")])
def test_a_stream_error_event_is_labelled_by_its_status(status: int, kind: str) -> None:
    """Scheduler death (503) and internal errors (500) half-way through a stream arrive as
    ``server_error`` events, as the non-streaming response says; they used to be labelled
    ``invalid_request_error`` whatever the cause (issue 17, item 7)."""
    import asyncio
    import json as jsonlib

    from sgl_frontend_openai.common import OpenAIError, sse_stream

    async def events():
        yield {"id": "x", "choices": []}
        raise OpenAIError(status, "the scheduler process died")

    async def collect() -> list[bytes]:
        return [chunk async for chunk in sse_stream(events())]

    chunks = asyncio.run(collect())
    error = jsonlib.loads(chunks[1].removeprefix(b"data: "))["error"]
    assert error["type"] == kind and error["code"] == str(status)
    assert chunks[-1] == b"data: [DONE]\n\n"


def test_reasoning_effort_reaches_the_chat_template() -> None:
    """``reasoning_effort`` becomes ``thinking`` / ``enable_thinking`` for the chat template, as
    SGLang passes it (false for ``none``), unless ``chat_template_kwargs`` sets them: the real
    TokenizerManager renders a template that prints both."""
    from types import SimpleNamespace

    from sgl.config import ServerSettings
    from sgl.engine.messages import SchedulerInfo
    from sgl.model_loader import load_tokenizer
    from sgl.server.tokenizer_manager import TokenizerManager
    from sgl_frontend_openai.chat import plan_chat
    from sgl_frontend_openai.protocol import ChatCompletionRequest

    tokenizer = load_tokenizer(None)
    template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                " thinking={{ thinking | default('unset') }}"
                " enable_thinking={{ enable_thinking | default('unset') }}")
    info = SchedulerInfo(ok=True, context_length=512, vocab_size=len(tokenizer))
    tm = TokenizerManager(tokenizer, {}, info, ServerSettings(chat_template=template))
    server = SimpleNamespace(model_name="toy", tokenizer_manager=tm,
                             info=SimpleNamespace(context_length=512, max_total_tokens=4096))

    def rendered(**fields: object) -> str:
        req = ChatCompletionRequest.model_validate({"model": "default", "messages": QUESTION,
                                                    "max_tokens": 1, **fields})
        return tokenizer.decode(plan_chat(server, None, req).obj.input_ids)

    assert rendered().endswith("thinking=unset enable_thinking=unset")
    assert rendered(reasoning_effort="none").endswith("thinking=False enable_thinking=False")
    assert rendered(reasoning_effort="high").endswith("thinking=True enable_thinking=True")
    assert rendered(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}
                    ).endswith("thinking=False enable_thinking=True")
