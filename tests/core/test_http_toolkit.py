"""The core's HTTP toolkit (sgl.server.http), which every frontend reads bodies and streams
with: bounded JSON, messages that name the field, streams that close what they read."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict
from starlette.requests import ClientDisconnect, Request

from sgl.server.http import (
    MAX_JSON_DEPTH,
    BodyError,
    EventStreamResponse,
    StreamResponse,
    parse_body,
    read_json,
    sse_event,
)


def request_with(body: bytes) -> Request:
    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


class Item(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    count: int = 1


def test_json_nested_deeper_than_the_limit_is_refused_before_parsing() -> None:
    ok = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert asyncio.run(read_json(request_with(ok))) is not None
    deep = b'{"a": ' * 1000 + b"1" + b"}" * 1000  # json.loads would raise RecursionError
    with pytest.raises(BodyError, match=f"nests deeper than {MAX_JSON_DEPTH} levels"):
        asyncio.run(read_json(request_with(deep)))
    # brackets inside strings (escaped quotes too) are text, not nesting
    text = json.dumps({"prompt": "[" * 500 + '\\" {' * 100}).encode()
    assert asyncio.run(read_json(request_with(text)))["prompt"].startswith("[[[")


@pytest.mark.parametrize("body,message,param", [
    (b"{not json", "the request body is not valid JSON", None),
    (b"[1, 2]", "the request body must be a JSON object, got list", None),
    (b'{"name": "a", "colour": 1}', "colour: unknown field 'colour'", "colour"),
    (b'{"name": "a", "count": "many"}', "count: Input should be a valid integer", "count"),
])
def test_parse_body_names_what_is_wrong(body: bytes, message: str, param: str | None) -> None:
    with pytest.raises(BodyError, match=message) as info:
        asyncio.run(parse_body(request_with(body), Item))
    assert info.value.param == param
    assert asyncio.run(parse_body(request_with(b'{"name": "a"}'), Item)) == Item(name="a")


def test_sse_event_with_and_without_a_name() -> None:
    assert sse_event({"x": float("-inf")}) == b'data: {"x": null}\n\n'
    assert sse_event({"a": 1}, event="ping") == b'event: ping\ndata: {"a": 1}\n\n'
    assert sse_event("[DONE]") == b"data: [DONE]\n\n"


@pytest.mark.parametrize("response_class", [StreamResponse, EventStreamResponse])
def test_a_stream_cut_by_the_client_closes_the_streams_it_reads(response_class: type) -> None:
    """The source stays referenced (as a TokenizerManager holds its requests), so only an
    explicit close, not the garbage collector, can end it."""
    closed: list[str] = []

    async def source() -> AsyncIterator[str]:
        try:
            for i in range(1000):
                yield f"token {i}"
        finally:
            closed.append("source")

    async def framed(parts: AsyncIterator[str]) -> AsyncIterator[bytes]:
        async for part in parts:
            yield sse_event({"text": part})

    async def run() -> None:
        parts = source()
        response = response_class(framed(parts), closes=[parts])
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and len(sent) >= 3:
                raise OSError("the client went away")
            sent.append(message)

        async def receive() -> dict[str, Any]:
            await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

        with pytest.raises(ClientDisconnect):
            await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        assert closed == ["source"]  # before `parts` goes out of scope
        assert len(sent) == 3

    asyncio.run(run())
