"""``POST /v1/completions``: a prompt (text or token ids, one or a batch) → text_completion.

Choice ``index`` is ``prompt_index * n + sample_index``, as OpenAI numbers them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse

from sgl.server.http import EventStreamResponse
from sgl.server.io_struct import GenerateError, GenerateReqInput
from sgl_frontend_openai.common import (
    FINISH_REASONS,
    OpenAIError,
    build_sampling,
    check_model,
    check_response_format,
    new_id,
    now,
    room_for,
    sse_stream,
    usage,
)
from sgl_frontend_openai.logprobs import completion_logprobs

if TYPE_CHECKING:
    from sgl.server.context import ServerContext
    from sgl_frontend_openai.protocol import CompletionRequest

__all__ = ["create_completion"]

#: OpenAI's default for /v1/completions when max_tokens is not given
DEFAULT_MAX_TOKENS = 16


def _prompts(server: ServerContext, req: CompletionRequest) -> tuple[dict[str, Any], list[str]]:
    """The prompt as GenerateReqInput fields, and each prompt's text (for ``echo``)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return {"text": prompt}, [prompt]
    if all(isinstance(p, str) for p in prompt):
        return {"text": list(prompt)}, list(prompt)  # type: ignore[arg-type]
    if all(isinstance(p, int) for p in prompt):
        ids = list(prompt)  # type: ignore[arg-type]
        return {"input_ids": ids}, [_echo_text(server, ids) if req.echo else ""]
    if all(isinstance(p, list) for p in prompt):
        batch = [list(p) for p in prompt]  # type: ignore[union-attr]
        return {"input_ids": batch}, [_echo_text(server, p) if req.echo else "" for p in batch]
    raise OpenAIError(400, "prompt must be a string, a list of strings, a list of token ids or "
                           "a list of token-id lists", "prompt")


def _echo_text(server: ServerContext, ids: list[int]) -> str:
    """The text of prompt ids for ``echo``, decoded before the ids reach the TokenizerManager's
    own checks: one outside the vocabulary is a 400 here, not the tokenizer's OverflowError."""
    tm = server.tokenizer_manager
    bad = next((t for t in ids if not 0 <= t < tm.vocab_size), None)
    if bad is not None:
        raise OpenAIError(400, f"prompt: token id {bad} is outside the vocabulary (ids must be in "
                               f"[0, {tm.vocab_size}))", "prompt")
    return tm.decode(ids)


def _request(server: ServerContext, req: CompletionRequest) -> tuple[GenerateReqInput, list[str]]:
    check_model(server, req.model)
    fields, texts = _prompts(server, req)
    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    extra = check_response_format(server, req.response_format)
    if req.json_schema is not None:  # SGLang's extension, the schema as text: checked as regex is
        extra = {"json_schema": req.json_schema}
    sampling = build_sampling(req, max_tokens, extra)
    want_logprobs = req.logprobs is not None
    obj = GenerateReqInput(**fields, sampling_params=sampling, return_logprob=want_logprobs,
                           top_logprobs_num=req.logprobs or 0,
                           logprob_start_len=0 if want_logprobs and req.echo else None,
                           return_text_in_logprobs=True, stream=req.stream,
                           data_parallel_rank=req.data_parallel_rank,
                           bootstrap_host=req.bootstrap_host, bootstrap_port=req.bootstrap_port,
                           bootstrap_room=req.bootstrap_room)
    if req.max_tokens is None:  # the default must not overflow a long prompt's context
        sampling.max_new_tokens = min(DEFAULT_MAX_TOKENS,
                                      room_for(server, _longest_prompt(server, fields)))
    return obj, texts


def _longest_prompt(server: ServerContext, fields: dict[str, Any]) -> int:
    """The token count of the longest prompt of the request."""
    if "text" in fields:
        texts = fields["text"] if isinstance(fields["text"], list) else [fields["text"]]
        return max(len(server.tokenizer_manager.encode(t)) for t in texts)
    ids = fields["input_ids"]
    return max(len(p) for p in ids) if ids and isinstance(ids[0], list) else len(ids)


def _finish(meta: dict[str, Any]) -> str:
    return FINISH_REASONS.get((meta.get("finish_reason") or {}).get("type", "stop"), "stop")


async def create_completion(server: ServerContext,
                            req: CompletionRequest) -> JSONResponse | EventStreamResponse:
    """Answer one completion request, streamed (SSE) or as one body."""
    tm = server.tokenizer_manager
    obj, texts = await tm.in_tokenizer_thread(_request, server, req)
    if req.stream:
        stream = await tm.generate_stream(obj)
        return EventStreamResponse(sse_stream(_chunks(server, req, texts, stream)),
                                   closes=[stream])
    out = await tm.generate(obj)
    results = out if isinstance(out, list) else [out]
    choices = []
    for i, result in enumerate(results):
        meta = result["meta_info"]
        echo = texts[i // req.n] if req.echo else ""
        choices.append({
            "index": i,
            "text": echo + result["text"],
            "logprobs": completion_logprobs(meta, echo=req.echo)
            if req.logprobs is not None else None,
            "finish_reason": _finish(meta),
        })
    return JSONResponse({
        "id": new_id("cmpl"), "object": "text_completion", "created": now(),
        "model": server.model_name, "choices": choices,
        "usage": _usage(results, req.n),
    })


def _usage(results: list[dict[str, Any]], n: int) -> dict[str, Any]:
    metas = [r["meta_info"] for r in results]
    firsts = metas[::n]  # one per prompt: its n samples share it
    return usage(sum(m["prompt_tokens"] for m in firsts),
                 sum(m["completion_tokens"] for m in metas),
                 sum(m.get("cached_tokens", 0) for m in firsts))


async def _chunks(server: ServerContext, req: CompletionRequest, texts: list[str],
                  stream: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    """``text_completion`` chunks; with ``include_usage`` a last one with ``usage``."""
    rid, created = new_id("cmpl"), now()
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    started: set[int] = set()
    metas: dict[int, dict[str, Any]] = {}
    offsets: dict[int, int] = {}

    def chunk(index: int, text: str, logprobs: dict[str, Any] | None,
              finish: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created,
                                "model": server.model_name,
                                "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                             "finish_reason": finish}]}
        if include_usage:
            body["usage"] = None
        return body

    try:
        async for part in stream:
            index = part.get("index", 0)
            meta = part["meta_info"]
            metas[index] = meta
            text = part["text"]
            echo = req.echo and index not in started
            if echo:
                text = texts[index // req.n] + text
            started.add(index)
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(meta, echo=echo, offset=offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs["tokens"])
            finished = meta["finish_reason"] is not None
            yield chunk(index, text, logprobs, _finish(meta) if finished else None)
    except GenerateError as exc:
        raise OpenAIError(exc.status, str(exc)) from None
    if include_usage:
        ordered = [{"meta_info": metas[i]} for i in sorted(metas)]
        yield {"id": rid, "object": "text_completion", "created": created,
               "model": server.model_name, "choices": [], "usage": _usage(ordered, req.n)}
