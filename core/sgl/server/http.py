"""The HTTP toolkit every frontend uses: reading a JSON body, and streaming responses that
abort their requests when the client goes away.

* :func:`read_json` and :func:`parse_body` read a request body (valid JSON, an object, nested
  at most :data:`MAX_JSON_DEPTH` deep, validated as a pydantic model) and raise
  :class:`BodyError` with a message naming the field; each frontend answers it in its own
  error shape.
* :class:`StreamResponse` (NDJSON and the like) and :class:`EventStreamResponse`
  (``text/event-stream``) close their body iterator *and* the request streams it reads
  (``closes=``) however the response ends: finished, failed, or cancelled because the client
  disconnected. Closing a TokenizerManager stream aborts its request at once, instead of when
  the garbage collector gets to it.
* :func:`answering` decorates a route so that the exceptions a frontend knows are answered in
  its error shape, and a returned dict is sent as JSON.
* :func:`documented_body` puts the JSON schema of what a route reads into ``/openapi.json``
  (the routes parse their bodies themselves, so FastAPI cannot see them).
* :func:`sse_event` frames one server-sent event (``data:``, with an ``event:`` line when
  named); :func:`dumps` writes strict JSON (non-finite floats as ``null``).
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Send

from sgl.server.io_struct import unpaired_surrogate

__all__ = ["MAX_JSON_DEPTH", "SCHEMAS_KEY", "BodyError", "EventStreamResponse", "StreamResponse",
           "answering", "documented_body", "dumps", "parse_body", "read_json", "sse_event"]

M = TypeVar("M", bound=BaseModel)

#: how deep a request body may nest objects and arrays (Python's parser recurses per level)
MAX_JSON_DEPTH = 64
#: where :func:`documented_body` leaves the sub-schemas for the app's ``/openapi.json``
SCHEMAS_KEY = "x-sgl-schemas"


class BodyError(ValueError):
    """The request body is not what the route takes; ``param`` is the dotted field, if any."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


#: a whole string (possessive: no backtracking into it), a bracket, or a quote that opens a
#: string never closed
_TOKEN = re.compile(rb'"(?:[^"\\]++|\\.)*+"|[\[\]{}]|"', re.DOTALL)


def _depth_exceeds(raw: bytes, limit: int) -> bool:
    """Whether brackets outside strings nest deeper than ``limit`` (checked before parsing,
    which would otherwise recurse once per level). One pass, left to right: a string that never
    closes ends the scan (the body is not JSON; the parser says where), so an unterminated
    string of escaped quotes costs one scan, not one per quote."""
    depth = 0
    for token in _TOKEN.finditer(raw):
        first = token.group()[:1]
        if first == b'"':
            if len(token.group()) == 1:  # an unterminated string
                return False
            continue
        depth += 1 if first in (b"[", b"{") else -1
        if depth > limit:
            return True
    return False


async def read_json(request: Request, *, empty: str | None = None) -> Any:
    """The body as JSON. :class:`BodyError` when it is not valid JSON, nests deeper than
    :data:`MAX_JSON_DEPTH`, holds a string that is not Unicode (an unpaired ``\\ud800``
    escape), or is empty (``empty`` is then the message; None: parse it as any other body)."""
    raw = await request.body()
    if empty is not None and not raw.strip():
        raise BodyError(empty)
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _depth_exceeds(raw,
                                                                           MAX_JSON_DEPTH):
        raise BodyError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BodyError(f"the request body is not valid JSON: {exc}") from None
    if b"\\u" in raw and (where := unpaired_surrogate(body)) is not None:
        raise BodyError(f"{where or 'the request body'}: the text holds an unpaired surrogate "
                        "(a \\ud800-\\udfff escape without its pair); send valid Unicode",
                        param=where or None)
    return body


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """``(message, dotted field)`` for the first error pydantic found."""
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    param = ".".join(loc) or None
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = f"unknown field {loc[-1]!r}"
    elif msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
        head = msg.split(":", 1)[0]
        if param is None and head.isidentifier():  # a model-level check names its field
            param = head
    return (f"{param}: {msg}" if param and not msg.startswith(f"{param}:") else msg), param


async def parse_body(request: Request, model: type[M]) -> M:
    """The body validated as ``model``, strictly (``"stream": "yes"`` or ``"max_tokens": true``
    is refused, not coerced); :class:`BodyError` naming the field."""
    body = await read_json(request)
    if not isinstance(body, dict):
        raise BodyError(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body, strict=True)
    except ValidationError as exc:
        raise BodyError(*validation_message(exc)) from None


def _closed(node: Any) -> None:
    """Mark every object schema under ``node`` as refusing fields it does not list."""
    if isinstance(node, dict):
        if "properties" in node:
            node.setdefault("additionalProperties", False)
        for value in node.values():
            _closed(value)
    elif isinstance(node, list):
        for value in node:
            _closed(value)


def documented_body(tp: Any, *, required: bool = True, closed: bool = False) -> dict[str, Any]:
    """``openapi_extra`` for a route that reads a body of type ``tp`` itself (a pydantic model,
    dataclass or TypedDict): its JSON schema in ``/openapi.json``, for client generators and
    fuzzers. ``closed``: the route refuses unknown fields (as a pydantic model with
    ``extra="forbid"`` says by itself). Sub-schemas are named after ``tp``'s package
    (``sgl_frontend_openai.ChatMessage``) so that two frontends' models of one name do not
    clash; the app moves them (under :data:`SCHEMAS_KEY`) into ``components``."""
    package = tp.__module__.split(".")[0]
    schema = TypeAdapter(tp).json_schema(ref_template=f"#/components/schemas/{package}.{{model}}")
    if closed:
        _closed(schema)
    defs = {f"{package}.{name}": sub for name, sub in schema.pop("$defs", {}).items()}
    return {"requestBody": {"required": required,
                            "content": {"application/json": {"schema": schema}}},
            SCHEMAS_KEY: defs}


Route = Callable[..., Awaitable[Any]]


def answering(answer: Callable[[Exception], Response | None]) -> Callable[[Route], Route]:
    """A decorator for routes: an exception for which ``answer`` gives a response is answered
    with it (the frontend's error shape), any other propagates; a returned dict is sent as
    JSON. The route keeps its signature, so FastAPI still reads its parameters."""

    def decorate(route: Route) -> Route:
        @functools.wraps(route)
        async def answered(*args: Any, **kwargs: Any) -> Any:
            try:
                out = await route(*args, **kwargs)
            except Exception as exc:
                response = answer(exc)
                if response is None:
                    raise
                return response
            return out if isinstance(out, Response) else JSONResponse(out)

        return answered

    return decorate


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def dumps(obj: Any) -> bytes:
    """Strict JSON: non-finite floats (a logprob of ``-inf``) become ``null``, as orjson
    writes them in SGLang."""
    try:
        text = json.dumps(obj, allow_nan=False, ensure_ascii=False)
    except ValueError:
        text = json.dumps(_finite(obj), allow_nan=False, ensure_ascii=False)
    return text.encode("utf-8", "backslashreplace")  # a lone surrogate as its JSON escape


def sse_event(obj: Any, event: str | None = None) -> bytes:
    """One event: ``event: <name>`` when named, ``data: <json>`` and a blank line (a string,
    such as ``[DONE]``, is sent as it is)."""
    data = obj.encode() if isinstance(obj, str) else dumps(obj)
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + data + b"\n\n"


async def _close(iterator: Any) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()


class StreamResponse(StreamingResponse):
    """A streamed response that closes its body iterator and ``closes`` (the request streams
    it reads) however it ends."""

    def __init__(self, content: AsyncIterator[Any], *,
                 closes: Iterable[AsyncIterator[Any]] = (), **kwargs: Any) -> None:
        kwargs.setdefault("headers", {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        super().__init__(content, **kwargs)
        self.closes = list(closes)

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await _close(self.body_iterator)
            for stream in self.closes:
                await _close(stream)


class EventStreamResponse(StreamResponse):
    """:class:`StreamResponse` as ``text/event-stream``."""

    media_type = "text/event-stream"
