"""What the OpenAI routes share: errors, body parsing, sampling parameters, SSE framing."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from sgl.sampling import SamplingParams, SamplingParamsError
from sgl.server import http
from sgl_frontend_openai.protocol import error_body

if TYPE_CHECKING:
    from sgl.server.context import ServerContext
    from sgl_frontend_openai.protocol import ResponseFormat, _SamplingFields

__all__ = ["OpenAIError", "build_sampling", "check_model", "check_response_format",
           "error_response", "new_id", "now", "parse_body", "sse_stream", "usage"]

M = TypeVar("M", bound=BaseModel)

#: how sgl's finish reasons read in OpenAI's vocabulary
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "stop"}


class OpenAIError(Exception):
    """An error to answer with OpenAI's error body and the given status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code)


def error_type(status: int) -> str:
    """OpenAI's name for the kind of an error with this HTTP status."""
    return "server_error" if status >= 500 else "invalid_request_error"


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    """OpenAI's error JSON with ``type`` derived from the status, as OpenAI names them."""
    return JSONResponse(error_body(message, type=error_type(status), param=param, code=code),
                        status_code=status)


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body validated as ``model``; :class:`OpenAIError` (400) naming the field."""
    try:
        return await http.parse_body(request, model)
    except http.BodyError as exc:
        raise OpenAIError(400, exc.message, exc.param.split(".")[0] if exc.param else None) \
            from None


def check_model(server: ServerContext, name: str | None) -> None:
    """404 ``model_not_found`` unless ``name`` is the served name or ``"default"`` (as vLLM and
    SGLang answer a model they do not serve)."""
    if name is not None and name not in (server.model_name, "default"):
        raise OpenAIError(404, f"The model {name!r} does not exist; this server serves "
                               f"{server.model_name!r}", "model", "model_not_found")


def check_response_format(server: ServerContext, fmt: ResponseFormat | None) -> dict[str, Any]:
    """Sampling parameters for ``response_format``: nothing for ``text``; ``json_schema`` for
    JSON output (``json_object`` is any JSON object, as SGLang maps it). Without a grammar
    backend plugin the request is refused, naming one to install; other constraint problems
    (a bad schema, a backend that is off) are answered by the TokenizerManager's check."""
    if fmt is None or fmt.type == "text":
        return {}
    if not server.plugin_manager.registries.grammar.names():
        raise OpenAIError(400, f"response_format {fmt.type!r} needs constrained decoding, and no "
                               "grammar backend is installed; install a grammar backend plugin "
                               "such as sgl-grammar-xgrammar", "response_format")
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise OpenAIError(400, "response_format.json_schema.schema is required",
                              "response_format")
        return {"json_schema": json.dumps(fmt.json_schema.schema_)}
    return {"json_schema": json.dumps({"type": "object"})}


def build_sampling(req: _SamplingFields, max_tokens: int | None,
                   extra: dict[str, Any] | None = None) -> SamplingParams:
    """SGLang sampling parameters from the shared OpenAI fields; 400 naming the field."""
    values: dict[str, Any] = {
        "max_new_tokens": max_tokens,
        "min_new_tokens": req.min_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "stop": req.stop or None,
        "stop_token_ids": req.stop_token_ids,
        "seed": req.seed,
        "n": req.n,
        "ignore_eos": req.ignore_eos,
        "no_stop_trim": req.no_stop_trim,
        "skip_special_tokens": req.skip_special_tokens,
        "logit_bias": {int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
        "regex": req.regex,
        "ebnf": req.ebnf,
        **(extra or {}),
    }
    if max_tokens is None:
        values["max_new_tokens"] = 1  # set from the prompt length later
    try:
        return SamplingParams.from_dict(values)
    except SamplingParamsError as exc:
        raise OpenAIError(400, str(exc), str(exc).split(" ", 1)[0]) from None


def room_for(server: ServerContext, prompt_len: int) -> int:
    """New tokens that fit after a prompt in both the context and the KV pool."""
    room = min(server.info.context_length, server.info.max_total_tokens)
    return max(1, room - prompt_len)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object, with ``prompt_tokens_details.cached_tokens``."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


async def sse_stream(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """Frame the events as SSE and end with ``data: [DONE]``; an error half-way is sent as an
    error event (the status line is already out)."""
    from sgl.server.io_struct import GenerateError

    try:
        async for event in events:
            yield http.sse_event(event)
    except OpenAIError as exc:  # the status line is out: the type says what kind it was
        yield http.sse_event(error_body(exc.message, type=error_type(exc.status),
                                        param=exc.param, code=exc.code or str(exc.status)))
    except GenerateError as exc:
        yield http.sse_event(error_body(str(exc), type=error_type(exc.status),
                                        code=str(exc.status)))
    yield http.sse_event("[DONE]")
