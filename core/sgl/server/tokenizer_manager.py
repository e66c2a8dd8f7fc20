"""The server side of the runtime: tokenize, send to the scheduler, collect and detokenize.

One :class:`TokenizerManager` per server process. Frontends call :meth:`generate`; a background
task receives :class:`~sgl.engine.messages.TokenBatch` messages from the scheduler and hands the
tokens to the waiting request.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from sgl.engine.messages import AbortRequest, GenerateRequest, ShutdownRequest, TokenBatch
from sgl.sampling import SamplingParams

if TYPE_CHECKING:
    from sgl.engine.messages import SchedulerInfo

__all__ = ["GenerateError", "GenerateResult", "TokenizerManager"]

logger = logging.getLogger("sgl.tokenizer_manager")


class GenerateError(RuntimeError):
    """A request failed. ``status`` is the HTTP status a frontend should answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class GenerateResult:
    rid: str
    text: str
    output_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: dict[str, Any] | None
    e2e_latency: float


@dataclass
class _ReqState:
    prompt_tokens: int
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    error: str | None = None
    status: int = 400
    updated: asyncio.Event = field(default_factory=asyncio.Event)


class TokenizerManager:
    def __init__(self, tokenizer: Any, endpoints: dict[str, str], info: SchedulerInfo) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self.endpoints = endpoints
        self._states: dict[str, _ReqState] = {}
        self._zmq: zmq.asyncio.Context | None = None
        self._recv_task: asyncio.Task[None] | None = None
        self.dead_reason: str | None = None

    async def start(self) -> None:
        self._zmq = zmq.asyncio.Context()
        self._send = self._zmq.socket(zmq.PUSH)
        self._send.bind(self.endpoints["requests"])
        self._recv = self._zmq.socket(zmq.PULL)
        self._recv.bind(self.endpoints["outputs"])
        self._recv_task = asyncio.create_task(self._recv_loop(), name="sgl-recv")

    async def stop(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
        if self._zmq is not None:
            try:
                self._send.send_pyobj(ShutdownRequest(), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self._send.close(linger=100)
            self._recv.close(linger=0)
            self._zmq.term()
            self._zmq = None

    # --- encoding ---------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of a chat, formatted by the model's chat template, ready for the reply."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise GenerateError("this model has no chat template, so chat messages cannot be "
                                "formatted for it; send a plain prompt instead")
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True)
        except Exception as exc:  # jinja errors from the template itself
            raise GenerateError(f"cannot apply the chat template: {exc}") from exc
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # --- generation -------------------------------------------------------------------------

    async def generate(self, input_ids: list[int], sampling: SamplingParams,
                       rid: str | None = None) -> GenerateResult:
        """Run one request to completion."""
        start = time.perf_counter()
        rid = rid or uuid.uuid4().hex
        final = None
        async for state in self._stream(rid, input_ids, sampling):
            final = state
        assert final is not None
        text = self.decode(final.output_ids, sampling.skip_special_tokens)
        return GenerateResult(rid, text, list(final.output_ids), final.prompt_tokens,
                              len(final.output_ids), final.finish_reason,
                              time.perf_counter() - start)

    async def _stream(self, rid: str, input_ids: list[int],
                      sampling: SamplingParams) -> AsyncIterator[_ReqState]:
        if self.dead_reason is not None:
            raise GenerateError(self.dead_reason, status=503)
        if rid in self._states:
            raise GenerateError(f"request id {rid!r} is already in use")
        if len(input_ids) >= self.info.context_length:
            raise GenerateError(f"the prompt has {len(input_ids)} tokens; the model's context "
                                f"length is {self.info.context_length}")
        stop_ids = set(sampling.stop_token_ids)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None and not sampling.ignore_eos:
            stop_ids.add(int(eos))
        sampling.stop_token_ids = sorted(stop_ids)
        state = self._states[rid] = _ReqState(prompt_tokens=len(input_ids))
        finished = False
        try:
            await self._send.send_pyobj(GenerateRequest(rid, list(input_ids), sampling))
            while True:
                await state.updated.wait()
                state.updated.clear()
                if state.error is not None:
                    raise GenerateError(state.error, state.status)
                yield state
                if state.finish_reason is not None:
                    finished = True
                    return
        finally:
            self._states.pop(rid, None)
            if not finished and self.dead_reason is None and self._zmq is not None:
                await self._send.send_pyobj(AbortRequest(rid))

    async def _recv_loop(self) -> None:
        while True:
            batch: TokenBatch = await self._recv.recv_pyobj()
            for out in batch.outputs:
                state = self._states.get(out.rid)
                if state is None:
                    continue  # aborted by the client meanwhile
                state.output_ids.extend(out.new_token_ids)
                state.finish_reason = out.finish_reason
                state.error, state.status = out.error, out.error_status
                state.updated.set()

    def fail_all(self, reason: str) -> None:
        """Fail every in-flight request (the scheduler died) and refuse new ones."""
        self.dead_reason = reason
        for state in self._states.values():
            state.error, state.status = reason, 503
            state.updated.set()
