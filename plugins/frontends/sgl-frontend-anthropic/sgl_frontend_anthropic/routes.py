"""``POST /v1/messages`` (and ``/v1/messages/count_tokens``) in Anthropic's shapes.

A final ``assistant`` message is a prefill: the reply continues it, and only the continuation
is returned, as Anthropic does. Stop reasons: ``end_turn`` (the model's end-of-turn token),
``max_tokens``, ``stop_sequence`` (with the sequence in ``stop_sequence``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from sgl.sampling import SamplingParams, SamplingParamsError
from sgl.server import http
from sgl.server.io_struct import GenerateError, GenerateReqInput
from sgl_frontend_anthropic.protocol import CountTokensRequest, MessagesRequest, error_body

if TYPE_CHECKING:
    from sgl.server.context import ServerContext

__all__ = ["make_router"]

M = TypeVar("M", bound=BaseModel)


class AnthropicError(Exception):
    """An error to answer with Anthropic's error body and the given status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.status, self.message), status_code=self.status)


async def _parse(request: Request, model: type[M]) -> M:
    try:
        return await http.parse_body(request, model)
    except http.BodyError as exc:
        raise AnthropicError(400, exc.message) from None


def _check_model(server: ServerContext, name: str) -> None:
    if name not in (server.model_name, "default"):
        raise AnthropicError(404, f"model: {name!r} not found; this server serves "
                                  f"{server.model_name!r}")


def _prompt_ids(server: ServerContext, req: CountTokensRequest) -> tuple[list[int], bool]:
    """Token ids of the conversation, and whether it ends with an assistant prefill."""
    tm = server.tokenizer_manager
    messages: list[dict[str, Any]] = [{"role": m.role, "content": m.text()}
                                      for m in req.messages]
    system = req.system_text()
    if system:
        messages.insert(0, {"role": "system", "content": system})
    prefill = messages[-1]["role"] == "assistant"
    if prefill:
        head, last = messages[:-1], messages[-1]["content"]
        if not head:
            raise AnthropicError(400, "messages: the first message must be a user message")
        return tm.apply_chat_template(head) + tm.encode(last.rstrip(), param="messages"), True
    return tm.apply_chat_template(messages), False


def _sampling(server: ServerContext, req: MessagesRequest, room: int) -> SamplingParams:
    """``max_tokens`` is a cap, as Anthropic treats it: a reply stops where the context ends
    (``room`` tokens after the prompt), with stop reason ``max_tokens``. ``output_config.format``
    becomes a JSON-schema constraint."""
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None and not server.plugin_manager.registries.grammar.names():
        raise AnthropicError(400, "output_config.format needs constrained decoding, and no "
                                  "grammar backend is installed; install a grammar backend "
                                  "plugin such as sgl-grammar-xgrammar")
    try:
        return SamplingParams.from_dict({
            "max_new_tokens": min(req.max_tokens, max(room, 1)),
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": req.top_p, "top_k": req.top_k,
            "stop": req.stop_sequences or None,
            "json_schema": json.dumps(fmt.schema_) if fmt is not None else None})
    except SamplingParamsError as exc:
        raise AnthropicError(400, str(exc)) from None


def _stop(meta: dict[str, Any]) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` from sgl's finish reason."""
    reason = meta.get("finish_reason") or {}
    if reason.get("type") == "length":
        return "max_tokens", None
    matched = reason.get("matched")
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def _message(server: ServerContext, mid: str, content: list[dict[str, Any]],
             stop: tuple[str | None, str | None], input_tokens: int, output_tokens: int,
             cached: int = 0) -> dict[str, Any]:
    return {"id": mid, "type": "message", "role": "assistant", "model": server.model_name,
            "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens,
                      "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}}


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return http.sse_event(data, event=kind)


async def _events(server: ServerContext, mid: str, input_tokens: int,
                  stream: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """Anthropic's event sequence: message_start, content_block_start, ping, the deltas,
    content_block_stop, message_delta (stop reason, usage), message_stop."""
    yield _event("message_start", {"type": "message_start", "message": _message(
        server, mid, [], (None, None), input_tokens, 0)})
    yield _event("content_block_start", {"type": "content_block_start", "index": 0,
                                         "content_block": {"type": "text", "text": ""}})
    yield _event("ping", {"type": "ping"})
    meta: dict[str, Any] = {}
    try:
        async for part in stream:
            meta = part["meta_info"]
            if part["text"]:
                yield _event("content_block_delta", {
                    "type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": part["text"]}})
    except GenerateError as exc:
        yield _event("error", error_body(exc.status, str(exc)))
        return
    yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
    reason, sequence = _stop(meta)
    yield _event("message_delta", {"type": "message_delta",
                                   "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                   "usage": {"output_tokens": meta.get("completion_tokens", 0)}})
    yield _event("message_stop", {"type": "message_stop"})


def make_router(server: ServerContext) -> APIRouter:
    """The Anthropic-compatible routes, bound to ``server``."""
    router = APIRouter(tags=["anthropic"])
    tm = server.tokenizer_manager

    async def answer(request: Request) -> Response:
        req = await _parse(request, MessagesRequest)
        _check_model(server, req.model)
        ids, _ = await tm.in_tokenizer_thread(_prompt_ids, server, req)
        sampling = _sampling(server, req, server.info.context_length - len(ids))
        obj = GenerateReqInput(input_ids=ids, sampling_params=sampling, stream=req.stream)
        mid = f"msg_{uuid.uuid4().hex}"
        if req.stream:
            stream = await tm.generate_stream(obj)  # a bad request raises here, before any byte
            return http.EventStreamResponse(_events(server, mid, len(ids), stream),
                                            closes=[stream])
        result = await tm.generate(obj)
        meta = result["meta_info"]  # type: ignore[index]
        content = [{"type": "text", "text": result["text"]}]  # type: ignore[index]
        return JSONResponse(_message(server, mid, content, _stop(meta), meta["prompt_tokens"],
                                     meta["completion_tokens"], meta.get("cached_tokens", 0)))

    @router.post("/v1/messages", openapi_extra=http.documented_body(MessagesRequest))
    async def messages(request: Request) -> Response:
        try:
            return await answer(request)
        except AnthropicError as exc:
            return exc.response()
        except GenerateError as exc:
            return JSONResponse(error_body(exc.status, str(exc)), status_code=exc.status)

    @router.post("/v1/messages/count_tokens",
                 openapi_extra=http.documented_body(CountTokensRequest))
    async def count_tokens(request: Request) -> Response:
        try:
            req = await _parse(request, CountTokensRequest)
            _check_model(server, req.model)
            ids, _ = await tm.in_tokenizer_thread(_prompt_ids, server, req)
        except AnthropicError as exc:
            return exc.response()
        except GenerateError as exc:
            return JSONResponse(error_body(exc.status, str(exc)), status_code=exc.status)
        return JSONResponse({"input_tokens": len(ids)})

    return router
