"""``POST /v1/chat/completions``: messages → chat template → generate → chat.completion.

Tools: when the request has ``tools`` (and ``tool_choice`` is not ``"none"``), the reply is
parsed by the frontend's tool-call parser. A chat template that does not mention ``tools``
gets the parser's instructions as (part of) the system message. ``tool_choice: "required"`` or
a named function starts the reply with the parser's call prefix, so the model only fills in the
rest of the call.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
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
from sgl_frontend_openai.logprobs import chat_logprobs
from sgl_frontend_openai.protocol import ChatCompletionRequest, ToolChoiceFunction

if TYPE_CHECKING:
    from sgl.server.context import ServerContext
    from sgl.tools import BaseToolParser

__all__ = ["create_chat_completion"]


@dataclass
class _Plan:
    """A chat request turned into what to generate."""

    obj: GenerateReqInput
    prefix: str = ""  # text the reply was started with (a forced tool call)
    tools: bool = False  # whether to parse tool calls out of the reply
    forced: bool = False


def _template(server: ServerContext) -> str:
    tm = server.tokenizer_manager
    return tm.chat_template or getattr(tm.tokenizer, "chat_template", None) or ""


def _messages(req: ChatCompletionRequest, parser: BaseToolParser, template: str,
              tools_on: bool) -> list[dict[str, Any]]:
    renders_calls = "tool_calls" in template
    out: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        try:
            content = m.text()
        except ValueError as exc:
            raise OpenAIError(400, f"messages[{i}].content: {exc}", "messages") from None
        role = "system" if m.role == "developer" else m.role
        message: dict[str, Any] = {"role": role, "content": content}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            if renders_calls:
                message["tool_calls"] = m.tool_calls
            else:
                calls = parser.render_calls(m.tool_calls)
                message["content"] = f"{content}\n{calls}" if content else calls
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    if tools_on and req.tools and "tools" not in template:
        prompt = parser.system_prompt([t.model_dump(exclude_none=True) for t in req.tools])
        if out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def plan_chat(server: ServerContext, parser: BaseToolParser,
              req: ChatCompletionRequest) -> _Plan:
    """Validate the request against this server and build the generate call."""
    check_model(server, req.model)
    extra = check_response_format(server, req.response_format)
    tm = server.tokenizer_manager
    template = _template(server)
    tools_on = bool(req.tools) and req.tool_choice != "none"
    messages = _messages(req, parser, template, tools_on)
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:  # as SGLang: the two keys templates read
        for key in ("thinking", "enable_thinking"):
            kwargs.setdefault(key, req.reasoning_effort != "none")
    if tools_on and req.tools and "tools" in template:
        kwargs["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
    if req.continue_final_message:  # SGLang's extension: go on with the last assistant turn
        kwargs.update(add_generation_prompt=False, continue_final_message=True)
    input_ids = tm.apply_chat_template(messages, **kwargs)
    prefix = ""
    if tools_on and (req.tool_choice == "required" or isinstance(req.tool_choice,
                                                                 ToolChoiceFunction)):
        name = req.tool_choice.function.name if isinstance(req.tool_choice,
                                                           ToolChoiceFunction) else None
        prefix = parser.forced_prefix(name)
        input_ids = input_ids + tm.encode(prefix)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    sampling = build_sampling(req, max_tokens, extra)
    if max_tokens is None:
        sampling.max_new_tokens = room_for(server, len(input_ids))
    if prefix and parser.call_end and parser.call_end not in sampling.stop:
        sampling.stop = [*sampling.stop, parser.call_end]  # a forced reply is one call
    obj = GenerateReqInput(input_ids=input_ids, sampling_params=sampling,
                           return_logprob=req.logprobs,
                           top_logprobs_num=(req.top_logprobs or 0) if req.logprobs else None,
                           return_text_in_logprobs=True, stream=req.stream,
                           data_parallel_rank=req.data_parallel_rank,
                           bootstrap_host=req.bootstrap_host, bootstrap_port=req.bootstrap_port,
                           bootstrap_room=req.bootstrap_room)
    return _Plan(obj, prefix=prefix, tools=tools_on, forced=bool(prefix))


def _finish(meta: dict[str, Any]) -> str:
    return FINISH_REASONS.get((meta.get("finish_reason") or {}).get("type", "stop"), "stop")


def _message(plan: _Plan, parser: BaseToolParser, text: str) -> tuple[dict[str, Any], bool]:
    """The assistant message of one choice, and whether it holds tool calls."""
    text = plan.prefix + text
    if plan.tools:
        parsed = parser.parse(text)
        if parsed.tool_calls:
            content = None if plan.forced else parsed.content
            return {"role": "assistant", "content": content,
                    "tool_calls": [c.to_openai() for c in parsed.tool_calls]}, True
    return {"role": "assistant", "content": text}, False


async def create_chat_completion(server: ServerContext, parser: BaseToolParser,
                                 req: ChatCompletionRequest) -> JSONResponse | EventStreamResponse:
    """Answer one chat completion request, streamed (SSE) or as one body."""
    tm = server.tokenizer_manager
    plan = await tm.in_tokenizer_thread(plan_chat, server, parser, req)
    if req.stream:
        stream = await tm.generate_stream(plan.obj)  # raises BadRequestError before any byte is out
        return EventStreamResponse(sse_stream(_chunks(server, parser, plan, req, stream)),
                                   closes=[stream])
    out = await tm.generate(plan.obj)
    results = out if isinstance(out, list) else [out]
    choices = []
    for i, result in enumerate(results):
        meta = result["meta_info"]
        message, called = _message(plan, parser, result["text"])
        choices.append({
            "index": i,
            "message": message,
            "logprobs": {"content": chat_logprobs(meta)} if req.logprobs else None,
            "finish_reason": "tool_calls" if called else _finish(meta),
        })
    first = results[0]["meta_info"]
    return JSONResponse({
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": now(),
        "model": server.model_name,
        "choices": choices,
        "usage": usage(first["prompt_tokens"],
                       sum(r["meta_info"]["completion_tokens"] for r in results),
                       first.get("cached_tokens", 0)),
    })


class _ReplySplitter:
    """Splits one streamed reply into text that can be sent at once and text held back
    because it may be a tool call (sent as ``tool_calls`` when the reply ends)."""

    def __init__(self, parser: BaseToolParser, plan: _Plan) -> None:
        self.parser, self.plan = parser, plan
        self.mode = "text" if not plan.tools else "call" if plan.forced else "undecided"
        self.held = ""  # the possible call (modes "undecided" and "call")
        self.tail = ""  # in "text" mode: an end that may be the start of a call marker

    def feed(self, text: str) -> str:
        """Take new text; return what may be sent now."""
        if self.mode == "undecided":
            self.held += text
            if self.parser.may_start_call(self.held):
                return ""
            self.mode, text, self.held = "text", self.held, ""
        if self.mode == "call":
            self.held += text
            return ""
        marker = self.parser.call_start if self.plan.tools else None
        if not marker:
            return text
        pending = self.tail + text
        pos = pending.find(marker)
        if pos >= 0:  # a call after some text: hold the rest
            self.mode, self.held, self.tail = "call", pending[pos:], ""
            return pending[:pos]
        keep = next((k for k in range(min(len(marker) - 1, len(pending)), 0, -1)
                     if pending.endswith(marker[:k])), 0)
        self.tail = pending[len(pending) - keep:]
        return pending[:len(pending) - keep]

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left to send when the reply ends: text, and the calls (OpenAI dicts)."""
        if self.mode == "text":
            return self.tail, []
        message, _ = _message(self.plan, self.parser, self.held)
        return message.get("content") or "", list(message.get("tool_calls") or [])


async def _chunks(server: ServerContext, parser: BaseToolParser, plan: _Plan,
                  req: ChatCompletionRequest, stream: AsyncIterator[dict[str, Any]]
                  ) -> AsyncIterator[dict[str, Any]]:
    """``chat.completion.chunk`` objects: a role delta first for each choice, then content
    deltas, then one with ``finish_reason``; with ``include_usage`` a last chunk with
    ``usage`` and no choices. A reply that may be a tool call is held back until it ends."""
    rid, created = new_id("chatcmpl"), now()
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats and include_usage)
    splitters: dict[int, _ReplySplitter] = {}
    completion: dict[int, int] = {}
    prompt_tokens = cached = 0

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None,
              logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": rid, "object": "chat.completion.chunk", "created": created,
            "model": server.model_name,
            "choices": [{"index": index, "delta": delta,
                         "logprobs": {"content": logprobs} if logprobs is not None else None,
                         "finish_reason": finish}]}
        if include_usage:
            body["usage"] = usage(prompt_tokens, sum(completion.values()), cached) \
                if continuous else None
        return body

    try:
        async for part in stream:
            index = part.get("index", 0)
            meta = part["meta_info"]
            prompt_tokens, cached = meta["prompt_tokens"], meta.get("cached_tokens", 0)
            completion[index] = meta["completion_tokens"]
            if index not in splitters:
                splitters[index] = _ReplySplitter(parser, plan)
                yield chunk(index, {"role": "assistant", "content": ""})
            splitter = splitters[index]
            logprobs = chat_logprobs(meta) if req.logprobs else None
            text = splitter.feed(part["text"])
            if text or logprobs:
                yield chunk(index, {"content": text} if text else {}, logprobs=logprobs)
            if meta["finish_reason"] is None:
                continue
            rest, calls = splitter.finish()
            if rest:
                yield chunk(index, {"content": rest})
            for k, call in enumerate(calls):
                yield chunk(index, {"tool_calls": [{**call, "index": k}]})
            yield chunk(index, {}, "tool_calls" if calls else _finish(meta))
    except GenerateError as exc:
        raise OpenAIError(exc.status, str(exc)) from None
    if include_usage:
        yield {"id": rid, "object": "chat.completion.chunk", "created": created,
               "model": server.model_name, "choices": [],
               "usage": usage(prompt_tokens, sum(completion.values()), cached)}
