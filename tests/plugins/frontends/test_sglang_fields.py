"""SGLang's request fields that sgl does not implement, on the real server: accepted when empty
(as SGLang's router, bench_serving and frontend language send them), a 400 naming the field
when set, whatever the route; unknown fields stay a 400; the field table of docs/api.md names
every one of them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from sgl.server import io_struct
from sgl_frontend_openai import protocol
from sgl_testing import ServerProcess

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
GREEDY = {"temperature": 0, "max_new_tokens": 2}
ROUTES = {
    "/generate": ({"text": "Hello", "sampling_params": GREEDY}, io_struct),
    "/v1/completions": ({"model": "default", "prompt": "Hello", "max_tokens": 2,
                         "temperature": 0}, protocol),
    "/v1/chat/completions": ({"model": "default", "max_tokens": 2, "temperature": 0,
                              "messages": [{"role": "user", "content": "Hello"}]}, protocol),
}
#: a value that is set (not empty) for any field
SET = "x"


def post(server: ServerProcess, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{route}", json=body, timeout=120)


def error_param(response: httpx.Response) -> str | None:
    return response.json()["error"].get("param")


@pytest.mark.parametrize("route", ROUTES)
def test_every_unsupported_field_is_accepted_empty(server: ServerProcess, route: str) -> None:
    base, module = ROUTES[route]
    empty = {name: None for name in module.UNSUPPORTED_SGLANG_FIELDS if name != "model"}
    r = post(server, route, {**base, **empty})
    assert r.status_code == 200, r.text
    for value in (False, 0, "", [], {}):  # each empty JSON value
        assert post(server, route, {**base, "lora_path": value}).status_code == 200


@pytest.mark.parametrize("route", ROUTES)
def test_an_unsupported_field_that_is_set_is_refused_by_name(server: ServerProcess,
                                                             route: str) -> None:
    base, module = ROUTES[route]
    refused = sorted(module.UNSUPPORTED_SGLANG_FIELDS - module.IGNORED_SGLANG_FIELDS)
    assert "lora_path" in refused and "routed_dp_rank" in refused
    for name in refused:
        r = post(server, route, {**base, name: SET})
        assert r.status_code == 400, (name, r.text)
        assert error_param(r) == name
        assert f"{name}: not supported by sgl" in r.text
    for name in module.IGNORED_SGLANG_FIELDS - {"model"}:  # their value changes nothing here
        assert post(server, route, {**base, name: SET}).status_code == 200, name


@pytest.mark.parametrize("route", ROUTES)
def test_a_field_neither_knows_is_refused(server: ServerProcess, route: str) -> None:
    base, _ = ROUTES[route]
    r = post(server, route, {**base, "max_token": 5})  # a typo of max_tokens
    assert r.status_code == 400 and error_param(r) == "max_token"


def test_reasoning_effort_values_are_checked(server: ServerProcess) -> None:
    base, _ = ROUTES["/v1/chat/completions"]
    for effort in ("none", "low", "high"):
        assert post(server, "/v1/chat/completions",
                    {**base, "reasoning_effort": effort}).status_code == 200
    r = post(server, "/v1/chat/completions", {**base, "reasoning_effort": "extreme"})
    assert r.status_code == 400 and error_param(r) == "reasoning_effort"


def test_the_field_table_names_every_field() -> None:
    """docs/api.md has a row for every SGLang field sgl accepts without implementing it."""
    text = (ROOT / "docs" / "api.md").read_text()
    start = text.index("## SGLang's request fields")
    table = text[start:text.index("\n## ", start + 1)]
    named = set(re.findall(r"`([a-z_0-9]+)`", table))
    for module in (io_struct, protocol):
        missing = sorted(module.UNSUPPORTED_SGLANG_FIELDS - named)
        assert not missing, f"docs/api.md's SGLang field table lacks {missing}"
