"""The routes of the OpenAI frontend."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from sgl.sampling import SamplingParams, SamplingParamsError
from sgl.server.io_struct import GenerateError, GenerateReqInput
from sgl_frontend_openai.protocol import ChatCompletionRequest, error_body

if TYPE_CHECKING:
    from sgl.server.context import ServerContext

__all__ = ["make_router"]

_FINISH = {"stop": "stop", "length": "length", "abort": "stop"}


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(error_body(message, type=kind, param=param), status_code=status)


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    param = ".".join(str(p) for p in err["loc"]) or None
    return f"{param}: {err['msg']}" if param else err["msg"], param


def make_router(server: ServerContext) -> APIRouter:
    router = APIRouter(tags=["openai"])
    tm = server.tokenizer_manager

    @router.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "sgl", "max_model_len": server.info.context_length}]}

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> JSONResponse:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(400, f"the request body is not valid JSON: {exc}")
        try:
            req = ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            message, param = _validation_message(exc)
            return _error(400, message, param)
        if req.stream:
            return _error(400, "stream=true is not supported yet", "stream")
        if req.model not in (server.model_name, "default"):
            return _error(404, f"the model {req.model!r} does not exist; this server serves "
                               f"{server.model_name!r}", "model")
        try:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        except ValueError as exc:
            return _error(400, str(exc), "messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        try:
            sampling = SamplingParams.from_dict({
                "max_new_tokens": max_tokens if max_tokens is not None
                else max(1, server.info.context_length - 1),
                "temperature": req.temperature if req.temperature is not None else 1.0,
                "top_p": req.top_p,
            })
            input_ids = tm.apply_chat_template(messages)
            if max_tokens is None:  # as much as fits in the context and the KV pool
                room = min(server.info.context_length, server.info.max_total_tokens)
                sampling.max_new_tokens = max(1, room - len(input_ids))
            result = await tm.generate(GenerateReqInput(input_ids=input_ids,
                                                        sampling_params=sampling))
        except SamplingParamsError as exc:
            return _error(400, str(exc))
        except GenerateError as exc:
            return _error(exc.status, str(exc), getattr(exc, "param", None))
        meta = result["meta_info"]
        reason = (meta["finish_reason"] or {}).get("type", "stop")
        return JSONResponse({
            "id": f"chatcmpl-{meta['id']}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": server.model_name,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": result["text"]},
                "logprobs": None,
                "finish_reason": _FINISH.get(reason, "stop"),
            }],
            "usage": {
                "prompt_tokens": meta["prompt_tokens"],
                "completion_tokens": meta["completion_tokens"],
                "total_tokens": meta["prompt_tokens"] + meta["completion_tokens"],
            },
        })

    return router
