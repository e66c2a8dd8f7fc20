"""The Ollama routes: ``/api/chat`` and ``/api/generate`` (NDJSON streams by default, one object
with ``"stream": false``), ``/api/tags``, ``/api/show``, ``/api/version``.

Errors are Ollama's ``{"error": "..."}`` with a 4xx/5xx status; an error after the stream has
started is sent as a last line ``{"error": "..."}``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from sgl.sampling import SamplingParams, SamplingParamsError
from sgl.server import http
from sgl.server.io_struct import GenerateError, GenerateReqInput
from sgl_frontend_ollama.protocol import DEFAULTS, ChatRequest, GenerateRequest, ShowRequest

if TYPE_CHECKING:
    from sgl.server.context import ServerContext
    from sgl_frontend_ollama.protocol import Options, _Base

__all__ = ["make_router"]

M = TypeVar("M", bound=BaseModel)
R = TypeVar("R", ChatRequest, GenerateRequest)


class OllamaError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


async def _parse(request: Request, model: type[M]) -> M:
    try:
        return await http.parse_body(request, model)
    except http.BodyError as exc:
        raise OllamaError(400, exc.message) from None


def _names(server: ServerContext) -> set[str]:
    name = server.model_name
    return {name, f"{name}:latest", "default"}


def _check_model(server: ServerContext, name: str) -> None:
    if name not in _names(server):
        raise OllamaError(404, f"model {name!r} not found; this server serves "
                               f"{server.model_name!r}")


def _format_params(server: ServerContext, fmt: str | dict[str, Any] | None) -> dict[str, Any]:
    """Sampling parameters for ``format`` (``"json"`` or a JSON schema): a ``json_schema``
    constraint when a grammar backend is installed, else a 400 naming the plugin to install. A
    bad schema is answered (400) by the TokenizerManager's check."""
    if not fmt:
        return {}
    if not server.plugin_manager.registries.grammar.names():
        raise OllamaError(400, "format: structured output needs a grammar backend; install a "
                               "grammar backend plugin such as sgl-grammar-xgrammar")
    schema = {"type": "object"} if fmt == "json" else fmt
    return {"json_schema": json.dumps(schema)}


async def _generation_request(server: ServerContext, request: Request, model: type[R]) -> R:
    """The body of ``/api/chat`` or ``/api/generate``, for the served model, asking nothing
    this server cannot do."""
    req = await _parse(request, model)
    _check_model(server, req.model)
    _check_unsupported(req)
    return req


def _loaded(server: ServerContext, **fields: Any) -> JSONResponse:
    """Ollama's answer to a request with nothing to generate: the model is loaded."""
    return JSONResponse({"model": server.model_name, "created_at": _created_at(), **fields,
                         "done": True, "done_reason": "load"})


def _check_unsupported(req: _Base) -> None:
    if req.think not in (None, False):
        raise OllamaError(400, "think: this model does not support thinking")
    if req.logprobs:
        raise OllamaError(400, "logprobs: not supported by sgl's Ollama frontend; use the "
                               "OpenAI routes for logprobs")


def _sampling(server: ServerContext, req: _Base, prompt_len: int) -> SamplingParams:
    opts: Options | None = req.options
    get = (lambda key: getattr(opts, key, None))  # noqa: E731
    room = max(1, min(server.info.context_length, server.info.max_total_tokens) - prompt_len)
    num_predict = get("num_predict")
    max_new = room if num_predict is None or num_predict < 0 else min(num_predict, room)

    def pick(key: str) -> Any:
        value = get(key)
        return DEFAULTS.get(key) if value is None else value

    top_k = pick("top_k")
    try:
        return SamplingParams.from_dict({
            "max_new_tokens": max_new,
            "temperature": pick("temperature"),
            "top_p": pick("top_p"),
            "top_k": -1 if not top_k else top_k,
            "min_p": get("min_p"),
            "repetition_penalty": pick("repeat_penalty"),
            "presence_penalty": get("presence_penalty"),
            "frequency_penalty": get("frequency_penalty"),
            "stop": get("stop") or None,
            "seed": get("seed"),
            **_format_params(server, req.format),
        })
    except SamplingParamsError as exc:
        raise OllamaError(400, f"options: {exc}") from None


def _created_at() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _done_fields(meta: dict[str, Any], started: float) -> dict[str, Any]:
    """The final object's counters; durations in nanoseconds, as Ollama reports them."""
    reason = (meta.get("finish_reason") or {}).get("type")
    total = time.perf_counter() - started
    ttft = meta.get("time_to_first_token") or 0.0
    return {"done": True, "done_reason": "length" if reason == "length" else "stop",
            "total_duration": int(total * 1e9), "load_duration": 0,
            "prompt_eval_count": meta.get("prompt_tokens", 0),
            "prompt_eval_duration": int(ttft * 1e9),
            "eval_count": meta.get("completion_tokens", 0),
            "eval_duration": int(max(0.0, total - ttft) * 1e9)}


def _ndjson(lines: AsyncIterator[dict[str, Any]],
            request: AsyncIterator[Any]) -> http.StreamResponse:
    """One JSON object a line; ``request``, the stream ``lines`` reads, is closed (its request
    aborted) however the response ends."""
    async def body() -> AsyncIterator[bytes]:
        try:
            async for line in lines:
                yield http.dumps(line) + b"\n"
        except GenerateError as exc:
            yield http.dumps({"error": str(exc)}) + b"\n"

    return http.StreamResponse(body(), closes=[lines, request], media_type="application/x-ndjson")


def _details(server: ServerContext) -> dict[str, Any]:
    path = server.info.model_path
    quant = path.rsplit(".", 2)[-2] if path.endswith(".gguf") and path.count(".") >= 2 else ""
    family = server.info.architecture.removesuffix("ForCausalLM").lower()
    return {"parent_model": "", "format": "gguf" if path.endswith(".gguf") else "safetensors",
            "family": family, "families": [family] if family else None,
            "parameter_size": "", "quantization_level": quant}


def _answer_error(exc: Exception) -> Response | None:
    if isinstance(exc, OllamaError):
        return _error(exc.status, exc.message)
    if isinstance(exc, GenerateError):
        return _error(exc.status, str(exc))
    return None


answered = http.answering(_answer_error)


def make_router(server: ServerContext) -> APIRouter:
    """The Ollama-compatible routes, bound to ``server``."""
    router = APIRouter(tags=["ollama"])
    tm = server.tokenizer_manager

    async def run(obj: GenerateReqInput, stream: bool, started: float,
                  shape: Any) -> Response:
        """Generate, answering either an NDJSON stream or one object; ``shape(text)`` builds
        the per-line fields, ``shape(text, meta)`` those of the last line."""
        if stream:
            parts = await tm.generate_stream(obj)

            async def lines() -> AsyncIterator[dict[str, Any]]:
                output_ids: list[int] = []
                async for part in parts:
                    output_ids.extend(part["output_ids"])
                    meta = {**part["meta_info"], "output_ids": output_ids}
                    if meta["finish_reason"] is None:
                        if part["text"]:
                            yield {"model": server.model_name, "created_at": _created_at(),
                                   **shape(part["text"]), "done": False}
                        continue
                    if part["text"]:
                        yield {"model": server.model_name, "created_at": _created_at(),
                               **shape(part["text"]), "done": False}
                    yield {"model": server.model_name, "created_at": _created_at(),
                           **shape("", meta), **_done_fields(meta, started)}

            return _ndjson(lines(), parts)
        result = await tm.generate(obj)
        meta = result["meta_info"]  # type: ignore[index]
        return JSONResponse({"model": server.model_name, "created_at": _created_at(),
                             **shape(result["text"], meta),  # type: ignore[index]
                             **_done_fields(meta, started)})

    @router.post("/api/chat", openapi_extra=http.documented_body(ChatRequest))
    @answered
    async def chat(request: Request) -> Response:
        started = time.perf_counter()
        req = await _generation_request(server, request, ChatRequest)
        if req.tools:
            raise OllamaError(400, "tools: not supported by sgl's Ollama frontend; use the "
                                   "OpenAI routes for tool calls")
        if any(m.images for m in req.messages):
            raise OllamaError(400, "images: this model does not accept images")
        if not req.messages:  # Ollama answers an empty chat by loading the model
            return _loaded(server, message={"role": "assistant", "content": ""})
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        ids = await tm.in_tokenizer_thread(tm.apply_chat_template, messages)
        obj = GenerateReqInput(input_ids=ids, sampling_params=_sampling(server, req, len(ids)))

        def shape(text: str, meta: dict[str, Any] | None = None) -> dict[str, Any]:
            return {"message": {"role": "assistant", "content": text}}

        return await run(obj, req.stream, started, shape)

    @router.post("/api/generate", openapi_extra=http.documented_body(GenerateRequest))
    @answered
    async def generate(request: Request) -> Response:
        started = time.perf_counter()
        req = await _generation_request(server, request, GenerateRequest)
        if req.images:
            raise OllamaError(400, "images: this model does not accept images")
        if req.suffix:
            raise OllamaError(400, "suffix: this model does not support insertion")
        if req.template:
            raise OllamaError(400, "template: custom prompt templates are not supported; "
                                   "start the server with --chat-template instead")
        if not req.prompt and not req.context:  # Ollama: load the model, generate nothing
            return _loaded(server, response="")
        if req.raw:
            ids = await tm.in_tokenizer_thread(tm.encode, req.prompt)
        else:
            messages = [{"role": "user", "content": req.prompt}]
            if req.system:
                messages.insert(0, {"role": "system", "content": req.system})
            ids = await tm.in_tokenizer_thread(tm.apply_chat_template, messages)
        ids = list(req.context or []) + ids
        obj = GenerateReqInput(input_ids=ids, sampling_params=_sampling(server, req, len(ids)))

        def shape(text: str, meta: dict[str, Any] | None = None) -> dict[str, Any]:
            out: dict[str, Any] = {"response": text}
            if meta is not None:  # the last object: the conversation so far, as ids
                out["context"] = ids + list(meta.get("output_ids") or [])
            return out

        if not req.stream:
            result = await tm.generate(obj)
            meta = result["meta_info"]  # type: ignore[index]
            return JSONResponse({
                "model": server.model_name, "created_at": _created_at(),
                "response": result["text"],  # type: ignore[index]
                "context": ids + list(result["output_ids"]),  # type: ignore[index]
                **_done_fields(meta, started)})
        return await run(obj, True, started, shape)

    @router.get("/api/tags")
    async def tags() -> dict[str, Any]:
        return {"models": [{"name": f"{server.model_name}:latest",
                            "model": f"{server.model_name}:latest",
                            "modified_at": _created_at(), "size": _size(server),
                            "digest": "", "details": _details(server)}]}

    @router.post("/api/show", openapi_extra=http.documented_body(ShowRequest))
    @answered
    async def show(request: Request) -> Response:
        req = await _parse(request, ShowRequest)
        name = req.model or req.name
        if not name:
            raise OllamaError(400, "model: required")
        _check_model(server, name)
        info = server.info
        template = tm.chat_template or getattr(tm.tokenizer, "chat_template", None) or ""
        return JSONResponse({
            "modelfile": f"FROM {info.model_path}\n", "parameters": "", "template": template,
            "license": "", "details": _details(server), "modified_at": _created_at(),
            "model_info": {"general.architecture": info.architecture,
                           "general.context_length": info.context_length,
                           "general.vocab_size": info.vocab_size},
            "capabilities": ["completion"]})

    @router.get("/api/version")
    async def version() -> dict[str, Any]:
        from sgl import __version__

        return {"version": __version__}

    return router


def _size(server: ServerContext) -> int:
    from pathlib import Path

    path = Path(server.info.model_path)
    try:
        if path.is_file():
            return path.stat().st_size
        return sum(p.stat().st_size for p in path.glob("*.safetensors"))
    except OSError:
        return 0
