"""Bodies a careless or hostile client sends (issue 17): each is a 400 that names the field, in
the frontend's own error shape, never a 500; and /openapi.json describes what every route
reads. On the session server."""

from __future__ import annotations

import httpx
import pytest

from sgl_testing import ServerProcess

HI = [{"role": "user", "content": "Hi"}]


def post(server: ServerProcess, path: str, body: str | dict) -> httpx.Response:
    if isinstance(body, str):  # raw JSON text: escapes json.dumps would not write
        return httpx.post(f"{server.base_url}{path}", content=body, timeout=60,
                          headers={"content-type": "application/json"})
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", ["messages", "tokenize", "return_tensors", "chat_template"])
def test_chat_template_kwargs_may_not_set_the_calls_own_arguments(
        server: ServerProcess, name: str, stream: bool) -> None:
    """``messages`` used to be a 500 (TypeError: multiple values), ``tokenize`` a 400 with
    transformers' message."""
    response = post(server, "/v1/chat/completions", {
        "model": "default", "messages": HI, "max_tokens": 2, "stream": stream,
        "chat_template_kwargs": {name: []}})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "chat_template_kwargs" and repr(name) in error["message"]


def test_chat_template_kwargs_still_reach_the_template(server: ServerProcess) -> None:
    def prompt_tokens(kwargs: dict) -> int:
        response = post(server, "/v1/chat/completions", {
            "model": "default", "messages": HI, "max_tokens": 1, "temperature": 0,
            "chat_template_kwargs": kwargs})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    # without the generation prompt the template leaves out "<|im_start|>assistant\n"
    assert prompt_tokens({"add_generation_prompt": False}) < prompt_tokens({})


LONE = "a\\ud800b"  # JSON text: an unpaired surrogate escape


@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", f'{{"model": "default", "prompt": "{LONE}", "max_tokens": 2}}',
     "prompt"),
    ("/v1/chat/completions", f'{{"model": "default", "max_tokens": 2, "messages": '
                             f'[{{"role": "user", "content": "{LONE}"}}]}}',
     "messages[0].content"),
    ("/generate", f'{{"text": "{LONE}", "sampling_params": {{"max_new_tokens": 2}}}}', "text"),
    ("/v1/messages", f'{{"model": "default", "max_tokens": 2, "messages": '
                     f'[{{"role": "user", "content": "{LONE}"}}]}}', "messages[0].content"),
    ("/api/generate", f'{{"model": "default", "prompt": "{LONE}"}}', "prompt"),
    ("/generate", f'{{"text": "ok", "{LONE}": 1}}', "a\\\\ud800b"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(server: ServerProcess, path: str, body: str,
                                                    field: str) -> None:
    """It used to be a 500 on /v1/completions, and a 400 with the tokenizer's internal message
    ("TextEncodeInput must be Union[...]") elsewhere."""
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    assert "unpaired surrogate" in response.text and "TextEncodeInput" not in response.text
    assert field in response.text  # a key is shown with its escape


@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", {"model": "default", "prompt": "Hi", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"model": "default", "prompt": "Hi", "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"model": "default", "messages": HI, "temperature": "0"},
     "temperature"),
    ("/v1/chat/completions", {"model": "default", "messages": HI, "n": 1.0}, "n"),
    ("/v1/messages", {"model": "default", "max_tokens": True, "messages": HI}, "max_tokens"),
    ("/api/generate", {"model": "default", "prompt": "Hi", "stream": "yes"}, "stream"),
    ("/api/chat", {"model": "default", "messages": HI, "options": {"num_predict": "4"}},
     "num_predict"),
])
def test_values_of_the_wrong_type_are_refused_not_coerced(server: ServerProcess, path: str,
                                                          body: dict, field: str) -> None:
    """``max_tokens: true`` used to be taken as 1 and ``"stream": "yes"`` as true."""
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    assert field in response.text


@pytest.mark.parametrize("prompt", [[5, -16415855063], [[5, 471835616]], [[1], [2, 10**6]]])
def test_echo_of_token_ids_outside_the_vocabulary(server: ServerProcess, prompt: list) -> None:
    """Found by the fuzz suite: with ``echo`` the prompt ids were decoded before they were
    checked, and the tokenizer's OverflowError was a 500."""
    response = post(server, "/v1/completions", {"model": "default", "prompt": prompt,
                                                "echo": True, "max_tokens": 1})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and "outside the vocabulary" in error["message"]


def test_a_float_field_takes_an_integer(server: ServerProcess) -> None:
    """Strict types, but JSON's ``0`` is a number: ``temperature: 0`` stays valid."""
    response = post(server, "/v1/chat/completions", {
        "model": "default", "messages": HI, "max_tokens": 1, "temperature": 0, "top_p": 1})
    assert response.status_code == 200, response.text


def test_session_ids_are_bounded_in_length(server: ServerProcess) -> None:
    response = post(server, "/open_session", {"session_id": "s" * 10_000})
    assert response.status_code == 400 and "more than 256" in response.text


GENERATION_ROUTES = ["/v1/chat/completions", "/v1/completions", "/generate", "/v1/messages",
                     "/api/chat", "/api/generate"]


def test_openapi_describes_every_body(server: ServerProcess) -> None:
    """The schema used to document no request body at all, so fuzzers sent nothing real."""
    schema = httpx.get(f"{server.base_url}/openapi.json", timeout=60).json()
    components = schema["components"]["schemas"]
    for path in [*GENERATION_ROUTES, "/v1/tokenize", "/v1/detokenize", "/abort_request",
                 "/open_session", "/close_session", "/v1/messages/count_tokens", "/api/show"]:
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"].get("properties"), path
        text = str(body)
        for ref in [part.split("'")[0] for part in text.split("#/components/schemas/")[1:]]:
            assert ref in components, (path, ref)
    chat = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert {"messages", "max_tokens", "stream"} <= set(
        chat["content"]["application/json"]["schema"]["properties"])


@pytest.mark.parametrize("method,path,body", [
    ("GET", "/health_generate", None), ("POST", "/abort_request", {"rid": "nothing-here"})])
def test_empty_answers_are_documented_as_empty(server: ServerProcess, method: str, path: str,
                                               body: dict | None) -> None:
    """They answer 200 with no body (as SGLang does); the schema used to promise JSON."""
    schema = httpx.get(f"{server.base_url}/openapi.json", timeout=60).json()
    documented = schema["paths"][path][method.lower()]["responses"]["200"]
    response = httpx.request(method, f"{server.base_url}{path}", json=body, timeout=60)
    assert response.status_code == 200 and response.content == b""
    assert "application/json" not in documented.get("content", {})
