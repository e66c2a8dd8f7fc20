"""Structured output through the real server (the default backend, xgrammar): SGLang's
sampling_params on /generate, OpenAI's response_format and extra-body regex/ebnf, structural
tags, and bad constraints answered with 400 before anything streams."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from _cases import (
    EBNF, EBNF_PROMPT, PERSON, PERSON_PROMPT, REGEX, REGEX_PROMPT, check_ebnf, check_json,
    check_regex,
)

from sgl_testing import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")


def _chat(q: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": q}]


def test_server_uses_xgrammar_by_default(server: ServerProcess) -> None:
    info = httpx.get(f"{server.base_url}/get_server_info", timeout=60).json()
    assert info["grammar_backend"] == "xgrammar"
    assert info["internal_states"][0]["grammar_backend"] == "xgrammar"


def test_openai_response_format_and_extra_body(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="default", messages=_chat(PERSON_PROMPT), temperature=0, max_tokens=120,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON}})
    assert r.choices[0].finish_reason == "stop"
    check_json(r.choices[0].message.content, PERSON)
    r = client.chat.completions.create(
        model="default", messages=_chat("Give a JSON object describing a cat."), temperature=0,
        max_tokens=60, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut off: still a JSON object's beginning
        assert r.choices[0].message.content.startswith("{")
    r = client.chat.completions.create(model="default", messages=_chat(REGEX_PROMPT),
                                       temperature=0, max_tokens=40, extra_body={"regex": REGEX})
    check_regex(r.choices[0].message.content)
    r = client.completions.create(model="default", prompt="A sentence: ", temperature=0,
                                  max_tokens=40, extra_body={"ebnf": EBNF})
    check_ebnf(r.choices[0].text)


def test_completions_take_response_format_and_sglang_json_schema(client: openai.OpenAI) -> None:
    """/v1/completions takes chat's response_format and SGLang's json_schema string; two
    constraints at once are a 400 naming the first."""
    for extra in ({"response_format": {"type": "json_schema",
                                       "json_schema": {"name": "person", "schema": PERSON}}},
                  {"json_schema": json.dumps(PERSON)}):
        r = client.completions.create(model="default", prompt=PERSON_PROMPT, temperature=0,
                                      max_tokens=120, extra_body=extra)
        assert r.choices[0].finish_reason == "stop"
        check_json(r.choices[0].text, PERSON)
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="default", prompt="Hi", max_tokens=4,
                                  extra_body={"regex": REGEX, "json_schema": json.dumps(PERSON)})
    assert exc.value.body["param"] == "regex" and "json_schema" in exc.value.body["message"]


def test_anthropic_output_config_format(server: ServerProcess) -> None:
    """The current Anthropic client asks for structured output with ``output_config`` (and
    ``effort``, accepted with no effect)."""
    import anthropic

    client = anthropic.Anthropic(base_url=server.base_url, api_key="none")
    # temperature 0: the client's default (1) samples, and a sampled JSON string can run past
    # max_tokens (it did once in CI), which would say nothing about the constraint
    reply = client.messages.create(
        model="default", max_tokens=120, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": PERSON_PROMPT}],
        output_config={"format": {"type": "json_schema", "schema": PERSON}, "effort": "low"})
    assert reply.stop_reason == "end_turn"
    check_json(reply.content[0].text, PERSON)
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model="default", max_tokens=4,
                               messages=[{"role": "user", "content": "Hi"}],
                               output_config={"format": {"type": "json_schema",
                                                         "schema": {"type": "nonsense"}}})
    assert exc.value.status_code == 400
    with pytest.raises(anthropic.BadRequestError, match="effort"):
        client.messages.create(model="default", max_tokens=4,
                               messages=[{"role": "user", "content": "Hi"}],
                               output_config={"effort": "extreme"})


def test_native_generate_batch_mixing_constraints(server: ServerProcess) -> None:
    tag = {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<city>", "end": "</city>",
        "content": {"type": "json_schema", "json_schema": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
            "required": ["name"]}}}}
    body = {"text": [PERSON_PROMPT, REGEX_PROMPT, EBNF_PROMPT, "Name a city.", "Hello"],
            "sampling_params": [
                {"temperature": 0, "max_new_tokens": 120, "json_schema": json.dumps(PERSON)},
                {"temperature": 0, "max_new_tokens": 40, "regex": REGEX},
                {"temperature": 0, "max_new_tokens": 40, "ebnf": EBNF},
                {"temperature": 0, "max_new_tokens": 40, "structural_tag": json.dumps(tag)},
                {"temperature": 0, "max_new_tokens": 8}]}
    out = httpx.post(f"{server.base_url}/generate", json=body, timeout=300).json()
    check_json(out[0]["text"], PERSON)
    check_regex(out[1]["text"])
    check_ebnf(out[2]["text"])
    city = out[3]["text"]
    assert city.startswith("<city>") and city.endswith("</city>"), city
    assert isinstance(json.loads(city[len("<city>"):-len("</city>")])["name"], str)
    assert out[4]["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("extra,match", [
    ({"regex": "(ab"}, "invalid regex"),
    ({"json_schema": '{"type": "foo"}'}, "invalid json_schema"),
    ({"json_schema": "{oops"}, "not valid JSON"),
    ({"ebnf": "root ::= foo"}, "invalid ebnf"),
    ({"regex": "a", "ebnf": EBNF}, "at most one of"),
])
def test_bad_constraints_are_400(server: ServerProcess, extra: dict[str, str],
                                 match: str) -> None:
    for stream in (False, True):
        r = httpx.post(f"{server.base_url}/generate", timeout=60, json={
            "text": "Hi", "stream": stream, "sampling_params": {"max_new_tokens": 4, **extra}})
        assert r.status_code == 400, r.text
        assert match in r.text


def test_openai_bad_schema_is_400(client: openai.OpenAI) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(
                model="default", messages=_chat("Hi"), max_tokens=4, stream=stream,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": {"type": "foo"}}})
        assert "invalid json_schema" in str(exc.value)
