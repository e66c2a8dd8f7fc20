"""The routes of SGLang's native API, wire-compatible with SGLang's runtime server.

``/generate`` passes the body to the core TokenizerManager, which checks it, runs it and builds
SGLang's result dicts; this module only parses JSON, picks streaming or not and shapes errors
as SGLang does (``{"error": {"message": ...}}``, status 400 for a bad request).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from typing_extensions import TypedDict  # pydantic reads typing's only from Python 3.12

from sgl.server.io_struct import BadRequestError, GenerateError, GenerateReqInput
from sgl.server.http import (
    BodyError,
    EventStreamResponse,
    documented_body,
    dumps,
    read_json,
    sse_event,
)

if TYPE_CHECKING:
    from sgl.server.context import ServerContext

__all__ = ["make_router"]

#: seconds /health_generate waits for its one token before answering 503
HEALTH_GENERATE_TIMEOUT = 20.0


class AbortRequestBody(TypedDict, total=False):
    """``/abort_request``: the request to stop, or all of them."""

    rid: str
    abort_all: bool


class OpenSessionBody(TypedDict, total=False):
    """``/open_session``: the id to open (default: a new one)."""

    session_id: str | None
    capacity_of_str_len: int


class CloseSessionBody(TypedDict):
    """``/close_session``: the session to close."""

    session_id: str


def _json(status: int, body: Any) -> Response:
    return Response(dumps(body), status_code=status, media_type="application/json")


def _error(status: int, message: str, param: str | None = None) -> Response:
    error: dict[str, Any] = {"message": message, "code": status}
    if param:
        error["param"] = param
    return _json(status, {"error": error})


async def _read_json(request: Request) -> Any:
    return await read_json(request, empty="the request body is empty; send a JSON object")


async def _object(request: Request, *, optional: bool = False, what: str = "") -> dict[str, Any]:
    """The body as a JSON object (``optional``: an empty body is ``{}``); :class:`BodyError`
    otherwise, ``what`` saying what the object must hold."""
    if optional and not (await request.body()).strip():
        return {}
    body = await _read_json(request)
    if not isinstance(body, dict):
        raise BodyError(f"the request body must be a JSON object{what}")
    return body


def _field(body: dict[str, Any], name: str, kind: type, default: Any, message: str) -> Any:
    """``body[name]`` if it is a ``kind`` (or absent: ``default``), else :class:`BodyError`
    with ``message`` (``{got}`` is the value's type name)."""
    value = body.get(name, default)
    if not isinstance(value, kind):
        raise BodyError(message.format(got=type(value).__name__, value=value), name)
    return value


async def _events(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """SGLang's stream: one ``data:`` event per chunk, an error event if the request fails on
    the way, then ``data: [DONE]``."""
    try:
        async for chunk in chunks:
            yield sse_event(chunk)
    except GenerateError as exc:
        yield sse_event({"error": {"message": str(exc), "code": exc.status}})
    yield sse_event("[DONE]")


def make_router(server: ServerContext) -> APIRouter:
    """The native API's routes, bound to one server."""
    router = APIRouter(tags=["native"])
    tm = server.tokenizer_manager
    model_facts: dict[str, Any] = {}

    @router.api_route("/generate", methods=["POST", "PUT"],
                      openapi_extra=documented_body(GenerateReqInput, closed=True))
    async def generate(request: Request) -> Response:
        """SGLang's ``/generate``: one prompt or a batch, streamed or not."""
        try:
            obj = GenerateReqInput.from_dict(await _read_json(request))
            if obj.stream is True:
                chunks = await tm.generate_stream(obj, incremental=False)
                return EventStreamResponse(_events(chunks), closes=[chunks])
            result = await tm.generate(obj)
        except BodyError as exc:
            return _error(400, str(exc))
        except GenerateError as exc:
            return _error(exc.status, str(exc), getattr(exc, "param", None))
        except (TypeError, ValueError) as exc:  # a value of the wrong type deep inside
            return _error(400, f"invalid request: {exc}")
        return _json(200, result)

    def model_info() -> dict[str, Any]:
        if not model_facts:
            model_facts["model_type"] = _model_type(server)
        return {
            "model_path": server.info.model_path,
            "tokenizer_path": server.info.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": model_facts["model_type"],
            "architectures": [server.info.architecture] if server.info.architecture else None,
            "served_model_name": server.model_name,
        }

    @router.get("/get_model_info")
    async def get_model_info() -> Response:
        """The served model: path, architecture, whether it generates."""
        return _json(200, model_info())

    @router.get("/model_info")
    async def model_info_alias() -> Response:
        """The same as ``/get_model_info``."""
        return _json(200, model_info())

    async def server_info() -> Response:
        try:
            return _json(200, await tm.get_server_info())
        except GenerateError as exc:
            return _error(exc.status, str(exc))

    @router.get("/get_server_info")
    async def get_server_info() -> Response:
        """Settings, the model's facts, the scheduler's load (``internal_states``), version."""
        return await server_info()

    @router.get("/server_info")
    async def server_info_alias() -> Response:
        """The same as ``/get_server_info``."""
        return await server_info()

    @router.api_route("/flush_cache", methods=["GET", "POST"], response_class=PlainTextResponse)
    async def flush_cache() -> Response:
        """Drop cached prefixes; 400 with the scheduler's reason when requests are running."""
        try:
            reply = await tm.flush_cache()
        except GenerateError as exc:
            return _error(exc.status, str(exc))
        message = str(reply.get("message") or "")
        if reply.get("success"):
            return PlainTextResponse(f"Cache flushed.\n{message}\n".rstrip() + "\n")
        return PlainTextResponse(f"Cache not flushed: {message}\n", status_code=400)

    @router.post("/abort_request", response_class=Response,
                 openapi_extra=documented_body(AbortRequestBody))
    async def abort_request(request: Request) -> Response:
        """Stop a request by ``rid`` (or all with ``abort_all``); 200 even if it is unknown."""
        try:
            body = await _object(request, what=" with a 'rid'")
            rid = _field(body, "rid", str, "", "rid must be a string, got {got}")
            abort_all = _field(body, "abort_all", bool, False,
                               "abort_all must be true or false, got {value!r}")
        except BodyError as exc:
            return _error(400, exc.message, exc.param)
        tm.abort_request(rid, abort_all=abort_all)
        return Response(status_code=200)

    @router.post("/open_session", openapi_extra=documented_body(OpenSessionBody, required=False))
    async def open_session(request: Request) -> Response:
        """Open a session whose conversation stays cached between its requests (send
        ``"session_params": {"id": ...}`` with each); answers the session id as a JSON string.
        SGLang's ``capacity_of_str_len`` is accepted and not needed."""
        try:
            body = await _object(request, optional=True)
            session_id = _field(body, "session_id", (str, type(None)), None,
                                "session_id must be a string")
        except BodyError as exc:
            return _error(400, exc.message, exc.param)
        try:
            return _json(200, await tm.open_session(session_id))
        except BadRequestError as exc:
            return _error(400, str(exc), "session_id")
        except GenerateError as exc:
            return _error(exc.status, str(exc))

    @router.post("/close_session", response_class=Response,
                 openapi_extra=documented_body(CloseSessionBody))
    async def close_session(request: Request) -> Response:
        """Close a session: its conversation may be evicted from the cache again."""
        try:
            body = await _object(request, what=' {"session_id": "..."}')
            session_id = _field(body, "session_id", str, None,
                                'the body must be {{"session_id": "..."}}')
        except BodyError as exc:
            return _error(400, exc.message, exc.param)
        try:
            await tm.close_session(session_id)
        except BadRequestError as exc:
            return _error(400, str(exc), "session_id")
        except GenerateError as exc:
            return _error(exc.status, str(exc))
        return Response(status_code=200)

    @router.get("/get_load")
    async def get_load() -> Response:
        """The load as SGLang's workers report it, one entry per data-parallel rank: requests
        running or waiting, and ``num_tokens``, the KV tokens the running requests hold (not
        what the cache keeps and could evict) plus the prompt tokens waiting. SGLang's router
        balances on ``num_tokens``."""
        try:
            loads = await tm.get_loads()
        except GenerateError as exc:
            return _error(exc.status, str(exc))
        return _json(200, [{"dp_rank": rank,
                            "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
                            "num_waiting_reqs": load["num_waiting_reqs"],
                            "num_tokens": load["kv_used_tokens"] - load.get("evictable_tokens", 0)
                            + load["num_waiting_tokens"]}
                           for rank, load in enumerate(loads)])

    @router.get("/health_generate", response_class=Response)
    async def health_generate() -> Response:
        """200 once the model has generated one token, 503 if it cannot within 20 s."""
        body = {"input_ids": tm.encode("Hello") or [0], "rid": f"HEALTH_CHECK_{uuid.uuid4().hex}",
                "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        try:
            await asyncio.wait_for(tm.generate(body), HEALTH_GENERATE_TIMEOUT)
        except asyncio.TimeoutError:
            return _error(503, f"no token generated within {HEALTH_GENERATE_TIMEOUT:.0f} s")
        except GenerateError as exc:
            return _error(503, f"generation failed: {exc}")
        return Response(status_code=200)

    return router


def _model_type(server: ServerContext) -> str | None:
    """The Hugging Face ``model_type`` of the served model, or None if it cannot be read."""
    try:
        from sgl.model_loader import load_hf_config

        return getattr(load_hf_config(server.info.model_path), "model_type", None)
    except Exception:  # an odd model folder must not break the info route
        return None
