"""The scheduler's messages: what it takes from the server process and what it sends back.

:class:`SchedulerIO` is the part of :class:`~sgl.engine.scheduler.Scheduler` that handles the
server's messages (one handler per message type: a new request, checked before it waits; an
abort; the cache flush, sessions and state reports) and sends each step's outputs. The loop
itself is in :mod:`sgl.engine.scheduler`.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from sgl.engine.messages import (
    AbortRequest,
    CloseSessionRequest,
    FlushCacheRequest,
    GenerateRequest,
    OpenSessionRequest,
    SchedulerInfo,
    ServerInfoRequest,
    ShutdownRequest,
    TokenBatch,
    TokenOutput,
)
from sgl.engine.sequence import Req
from sgl.kernels import cpu
from sgl.kvcache import NoPrefixCache

if TYPE_CHECKING:
    from sgl.config import ServerSettings
    from sgl.engine.extension import Extensions
    from sgl.engine.grammar_manager import GrammarManager
    from sgl.engine.model_runner import ModelRunner
    from sgl.engine.sessions import Sessions
    from sgl.kvcache import BaseCachePolicy
    from sgl.threads import ThreadPlan

__all__ = ["SchedulerIO"]

logger = logging.getLogger("sgl.scheduler")


class SchedulerIO:
    """Message handling of the scheduler (a part of :class:`~sgl.engine.scheduler.Scheduler`,
    whose state it uses)."""

    settings: ServerSettings
    runner: ModelRunner
    cache: BaseCachePolicy
    grammar: GrammarManager
    sessions: Sessions
    extensions: Extensions
    threads: ThreadPlan
    waiting: deque[Req]
    running: list[Req]
    parallel: dict[str, Any]
    stopping: bool
    parent_pid: int
    num_received_reqs: int
    num_retractions: int
    new_token_ratio: float
    chunk_size: int
    eos_token_ids: list[int]
    _replies: list[TokenOutput]
    fail: Callable[[Req, str, int], None]
    release_finished: Callable[[], None]

    def connect(self, endpoints: dict[str, str]) -> None:
        """The sockets to the server process (and the handler of each message type)."""
        #: what each message from the server does
        self.handlers: dict[type, Callable[[Any], None]] = {
            GenerateRequest: self.add_request,
            AbortRequest: lambda msg: self.abort(msg.rid),
            FlushCacheRequest: lambda msg: self.reply_info(msg.rid, self.flush_cache()),
            ServerInfoRequest: lambda msg: self.reply_info(msg.rid, self.load_info()),
            OpenSessionRequest: lambda msg: self.reply_info(
                msg.rid, self.sessions.open_session(msg.session_id)),
            CloseSessionRequest: lambda msg: self.reply_info(
                msg.rid, self.sessions.close_session(msg.session_id, self.cache)),
            ShutdownRequest: lambda msg: self.stop(),
        }
        # the process's shared context, never terminated here: a context of our own that became
        # garbage with its sockets (a scheduler dropped without close(), in a reference cycle)
        # would block in its finalizer for ever, in whatever thread the collector ran. Its
        # sockets close with linger 0: an output to a server that is gone is dropped.
        self.zmq = zmq.Context.instance()
        self.zmq.setsockopt(zmq.LINGER, 0)
        self.recv_sock = self.zmq.socket(zmq.PULL)
        self.recv_sock.connect(endpoints["requests"])
        self.send_sock = self.zmq.socket(zmq.PUSH)
        self.send_sock.connect(endpoints["outputs"])
        self.poller = zmq.Poller()
        self.poller.register(self.recv_sock, zmq.POLLIN)

    def recv_requests(self, block: bool) -> None:
        """Handle every message waiting on the socket (``block``: wait up to a second for
        one; then also notice a server process that is gone)."""
        timeout = 1000 if block else 0
        while self.poller.poll(timeout):
            timeout = 0
            if not self.recv_sock.poll(0):  # only an extension's events: step
                break
            msg = self.recv_sock.recv_pyobj()
            handler = self.handlers.get(type(msg))
            if handler is None:
                logger.error("ignored a message of unknown type %s", type(msg).__name__)
                continue
            handler(msg)
        if block and os.getppid() != self.parent_pid:
            logger.error("the server process is gone; exiting")
            self.stop()

    def stop(self) -> None:
        self.stopping = True

    def add_request(self, msg: GenerateRequest) -> None:
        self.num_received_reqs += 1
        seed = msg.sampling.seed if msg.sampling.seed is not None else random.getrandbits(62)
        req = Req(msg.rid, list(msg.input_ids), msg.sampling, msg.logprobs, seed=seed,
                  arrival_time=msg.arrival_time or time.time(), session_id=msg.session_id,
                  bootstrap=msg.bootstrap)
        error = self.refusal(req) or self.extensions.check(req)
        if error is None and req.sampling.constraint is not None:
            error = self.grammar.submit(req)  # it waits in the grammar queue while compiling
            if error is None:
                return
        if error is not None:
            self.fail(req, error, 400)
            self._replies.append(req.take_output())
            return
        self.enqueue(req)

    def refusal(self, req: Req) -> str | None:
        """Why the scheduler itself refuses a new request (None: it does not)."""
        limit, pool = self.runner.context_length, self.runner.kv_pool
        if not req.input_ids:
            return "the prompt is empty"
        if len(req.input_ids) >= limit:
            return f"the prompt has {len(req.input_ids)} tokens; the context length is {limit}"
        if len(req.input_ids) + 1 > pool.size:
            return (f"the prompt has {len(req.input_ids)} tokens; the KV pool holds "
                    f"{pool.size} (raise --max-total-tokens)")
        if req.session_id is not None and req.session_id not in self.sessions:
            return f"session {req.session_id!r} is not open (open one with /open_session)"
        if max(req.input_ids) >= self.runner.vocab_size or min(req.input_ids) < 0:
            return f"input_ids must be token ids below the vocabulary size {self.runner.vocab_size}"
        if req.bootstrap is not None and "bootstrap" not in self.extensions.serves_fields:
            return ("bootstrap_room: this server is not disaggregated; start it with "
                    "--disaggregation-mode prefill or decode to take requests of SGLang's "
                    "router in PD mode")
        return None

    def enqueue(self, req: Req) -> None:
        """A new request (its grammar compiled, if it has one) waits for admission, unless an
        extension keeps it (a decode server's, until its KV comes from the prefill server)."""
        if not self.extensions.take(req):
            self.waiting.append(req)

    def abort(self, rid: str) -> None:
        self.grammar.abort(rid)
        self.extensions.abort(rid)
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
        for req in self.running:
            if req.rid == rid and not req.finished:
                req.finish_reason = {"type": "abort", "message": "aborted"}
                self.extensions.ended(req, "the request was aborted")
        self.release_finished()

    def flush_cache(self) -> dict[str, Any]:
        if self.running or self.waiting:
            return {"success": False, "message": f"cannot flush the cache while "
                    f"{len(self.running)} running and {len(self.waiting)} waiting requests "
                    "use it; retry when they are done"}
        dropped = self.cache.cached_tokens
        if not self.cache.flush():
            return {"success": False, "message": "cannot flush: cached prefixes are locked"}
        self.sessions.forget_cached()
        message = ("nothing is cached across requests (no prefix cache)"
                   if isinstance(self.cache, NoPrefixCache)
                   else f"flushed the {self.cache.name} cache ({dropped} tokens)")
        return {"success": True, "message": message, "kv_free": self.runner.kv_pool.num_free}

    def reply_info(self, rid: str, info: dict[str, Any]) -> None:
        self.send_sock.send_pyobj(TokenBatch(info=info, info_rid=rid))

    def send_outputs(self, reqs: list[Req]) -> None:
        seen: set[str] = set()
        outputs = self._replies
        self._replies = []
        for r in [*reqs, *(r for r in self.running if r.finished)]:
            if r.rid in seen:
                continue
            seen.add(r.rid)
            if r.sent < len(r.output_ids) or r.finished or r.input_token_logprobs:
                outputs.append(r.take_output())
        if outputs:
            self.send_sock.send_pyobj(TokenBatch(outputs))

    def load_info(self) -> dict[str, Any]:
        pool = self.runner.kv_pool
        return {"num_running_reqs": len(self.running), "num_waiting_reqs": len(self.waiting),
                "num_waiting_tokens": sum(len(r.input_ids) for r in self.waiting),
                "kv_used_tokens": pool.num_used, "kv_total_tokens": pool.size,
                "kv_free_tokens": pool.num_free, "new_token_ratio": self.new_token_ratio,
                "num_retractions": self.num_retractions,
                "num_received_reqs": self.num_received_reqs,
                "req_rows_free": self.runner.req_to_token_pool.num_free,
                "schedule_policy": self.settings.schedule_policy,
                "num_sessions": len(self.sessions), **self.cache.info(), **self.grammar.info(),
                **self.extensions.info()}

    def info(self) -> SchedulerInfo:
        r = self.runner
        return SchedulerInfo(
            ok=True, model_path=str(r.model_path), architecture=r.architecture,
            dtype=str(r.dtype).removeprefix("torch."), quantization=r.quantization,
            weights_bytes=r.weights_bytes, num_threads=self.threads.torch_threads,
            kernel_threads=self.threads.kernel_threads, cpu_isa=cpu.describe_isa(),
            context_length=r.context_length, vocab_size=r.vocab_size,
            max_total_tokens=r.kv_pool.size, kv_pool_bytes=r.kv_pool_bytes,
            attention_backend=self.settings.attention_backend,
            max_running_requests=self.settings.max_running_requests,
            chunked_prefill_size=self.chunk_size, eos_token_ids=self.eos_token_ids,
            cache_policy=self.cache.name, schedule_policy=self.settings.schedule_policy,
            grammar_backend=self.grammar.name or "none", parallel=self.parallel)
