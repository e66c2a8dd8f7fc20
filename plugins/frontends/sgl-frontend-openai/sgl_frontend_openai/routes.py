"""The routes of the OpenAI frontend: chat completions, completions, models, tokenize and
detokenize. Every error is OpenAI's error JSON with a 4xx/5xx status."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from sgl.server import http
from sgl.server.io_struct import GenerateError
from sgl_frontend_openai.chat import create_chat_completion
from sgl_frontend_openai.common import OpenAIError, check_model, error_response, parse_body
from sgl_frontend_openai.completions import create_completion
from sgl_frontend_openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from sgl_frontend_openai.tool_parsers import select_tool_parser

if TYPE_CHECKING:
    from sgl.server.context import ServerContext

__all__ = ["make_router"]


def _error(exc: Exception) -> Response | None:
    """sgl's and this frontend's errors as OpenAI error bodies."""
    if isinstance(exc, OpenAIError):
        return exc.response()
    if isinstance(exc, GenerateError):
        return error_response(exc.status, str(exc), getattr(exc, "param", None))
    return None


answered = http.answering(_error)


def make_router(server: ServerContext) -> APIRouter:
    """The OpenAI-compatible routes, bound to ``server``."""
    router = APIRouter(tags=["openai"])
    tm = server.tokenizer_manager
    settings = server.settings.plugin_settings.get("frontend-openai")
    template = tm.chat_template or getattr(tm.tokenizer, "chat_template", None)
    parser = select_tool_parser(server.plugin_manager.registries.tool_parsers,
                                getattr(settings, "tool_call_parser", "auto"), template)

    @router.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(server)]}

    @router.get("/v1/models/{model:path}")
    @answered
    async def retrieve_model(model: str) -> Response:
        check_model(server, model)
        return _model_card(server)

    @router.post("/v1/chat/completions", openapi_extra=http.documented_body(ChatCompletionRequest))
    @answered
    async def chat_completions(request: Request) -> Response:
        req = await parse_body(request, ChatCompletionRequest)
        return await create_chat_completion(server, parser, req)

    @router.post("/v1/completions", openapi_extra=http.documented_body(CompletionRequest))
    @answered
    async def completions(request: Request) -> Response:
        req = await parse_body(request, CompletionRequest)
        return await create_completion(server, req)

    @router.post("/v1/tokenize", openapi_extra=http.documented_body(TokenizeRequest))
    @answered
    async def tokenize(request: Request) -> Response:
        req = await parse_body(request, TokenizeRequest)
        check_model(server, req.model)
        if req.messages is not None:
            messages = []
            for i, m in enumerate(req.messages):
                try:
                    messages.append({"role": m.role, "content": m.text()})
                except ValueError as exc:
                    raise OpenAIError(400, f"messages[{i}].content: {exc}",
                                      "messages") from None
            ids = await tm.in_tokenizer_thread(
                tm.apply_chat_template, messages, add_generation_prompt=req.add_generation_prompt)
        else:
            ids = await tm.in_tokenizer_thread(tm.encode, req.prompt or "",
                                               add_special_tokens=req.add_special_tokens)
        body: dict[str, Any] = {"tokens": ids, "count": len(ids),
                                "max_model_len": server.info.context_length}
        if req.return_token_strs:
            body["token_strs"] = [tm.token_text(t) for t in ids]
        return body

    @router.post("/v1/detokenize", openapi_extra=http.documented_body(DetokenizeRequest))
    @answered
    async def detokenize(request: Request) -> Response:
        req = await parse_body(request, DetokenizeRequest)
        check_model(server, req.model)
        bad = next((t for t in req.tokens if not 0 <= t < tm.vocab_size), None)
        if bad is not None:
            raise OpenAIError(400, f"tokens: token id {bad} is outside the vocabulary "
                                   f"(ids must be in [0, {tm.vocab_size}))", "tokens")
        return {"prompt": tm.decode(req.tokens, skip_special_tokens=False)}

    return router


def _model_card(server: ServerContext) -> dict[str, Any]:
    return {"id": server.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "sgl", "root": server.model_name,
            "max_model_len": server.info.context_length}
