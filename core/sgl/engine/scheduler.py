"""The scheduler process: owns the model, batches requests, samples tokens.

One step of :meth:`Scheduler.event_loop` is the whole cycle: take new requests, pick a batch
(admit waiting prompts as one prefill, otherwise decode everything running), run one forward,
sample, send the new tokens back, and free finished requests.
"""

from __future__ import annotations

import logging
import os
import traceback
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import zmq

from sgl.engine.batch_builder import BatchSeq, make_forward_batch, release_sequence
from sgl.engine.forward_batch import ForwardMode
from sgl.engine.messages import (
    AbortRequest,
    GenerateRequest,
    SchedulerInfo,
    ShutdownRequest,
    TokenBatch,
    TokenOutput,
)
from sgl.engine.sequence import Req
from sgl.sampling import sample

if TYPE_CHECKING:
    from sgl.config import ServerSettings
    from sgl.engine.model_runner import ModelRunner
    from sgl.plugins import SglPluginManager

__all__ = ["Scheduler", "default_num_threads"]

logger = logging.getLogger("sgl.scheduler")


def default_num_threads() -> int:
    """One less than the CPU count, so the server process keeps a core for HTTP and tokenizing."""
    return max(1, (os.cpu_count() or 2) - 1)


class Scheduler:
    def __init__(self, settings: ServerSettings, pm: SglPluginManager,
                 endpoints: dict[str, str]) -> None:
        from sgl.engine.model_runner import ModelRunner

        self.settings = settings
        self.num_threads = settings.num_threads or default_num_threads()
        torch.set_num_threads(self.num_threads)
        self.runner: ModelRunner = ModelRunner(
            model_path=settings.model_path,
            dtype=settings.dtype,
            attention_backend=settings.attention_backend,
            registries=pm.registries,
            plugin_manager=pm,
            max_total_tokens=settings.max_total_tokens,
            mem_fraction=settings.mem_fraction_static,
            max_running_requests=settings.max_running_requests,
            context_length=settings.context_length,
            page_size=settings.page_size,
        )
        self.eos_token_ids = _eos_ids(self.runner.hf_config)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.stopping = False
        self.parent_pid = os.getppid()

        self.zmq = zmq.Context()
        self.recv_sock = self.zmq.socket(zmq.PULL)
        self.recv_sock.connect(endpoints["requests"])
        self.send_sock = self.zmq.socket(zmq.PUSH)
        self.send_sock.connect(endpoints["outputs"])

    def info(self) -> SchedulerInfo:
        r = self.runner
        return SchedulerInfo(
            ok=True, model_path=str(r.model_path), architecture=r.architecture,
            dtype=str(r.dtype).removeprefix("torch."), num_threads=self.num_threads,
            context_length=r.context_length, vocab_size=r.vocab_size,
            max_total_tokens=r.kv_pool.size, kv_pool_bytes=r.kv_pool_bytes,
            attention_backend=self.settings.attention_backend, eos_token_ids=self.eos_token_ids)

    # the loop ----------------------------------------------------------------------------

    def event_loop(self) -> None:
        while not self.stopping:
            self.recv_requests(block=not (self.waiting or self.running))
            batch = self.admit_waiting() or self.running
            if not batch:
                continue
            mode = ForwardMode.EXTEND if batch is not self.running else ForwardMode.DECODE
            try:
                self.run_batch(mode, batch)
            except Exception as exc:  # a failing batch must not take the others down
                logger.error("batch of %d failed:\n%s", len(batch), traceback.format_exc())
                for req in batch:
                    req.error = f"internal error while running the model: {exc}"
                    req.error_status = 500
                    req.finish_reason = {"type": "abort", "message": req.error}
            self.send_outputs(batch)
            self.release_finished()

    def recv_requests(self, block: bool) -> None:
        timeout = 1000 if block else 0
        while self.recv_sock.poll(timeout):
            timeout = 0
            msg = self.recv_sock.recv_pyobj()
            if isinstance(msg, GenerateRequest):
                self.add_request(msg)
            elif isinstance(msg, AbortRequest):
                self.abort(msg.rid)
            elif isinstance(msg, ShutdownRequest):
                self.stopping = True
        if block and os.getppid() != self.parent_pid:
            logger.error("the server process is gone; exiting")
            self.stopping = True

    def add_request(self, msg: GenerateRequest) -> None:
        req = Req(msg.rid, list(msg.input_ids), msg.sampling)
        need = len(req.input_ids) + req.sampling.max_new_tokens
        error = None
        if not req.input_ids:
            error = "the prompt is empty"
        elif len(req.input_ids) >= self.runner.context_length:
            error = (f"the prompt has {len(req.input_ids)} tokens; the context length is "
                     f"{self.runner.context_length}")
        elif need > self.runner.kv_pool.size:
            error = (f"prompt ({len(req.input_ids)} tokens) plus max_new_tokens "
                     f"({req.sampling.max_new_tokens}) needs {need} KV slots; the pool has "
                     f"{self.runner.kv_pool.size} (raise --max-total-tokens)")
        if error is not None:
            req.error, req.finish_reason = error, {"type": "abort", "message": error}
            self.send_outputs([req])
            return
        self.waiting.append(req)

    def abort(self, rid: str) -> None:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
        for req in self.running:
            if req.rid == rid and not req.finished:
                req.finish_reason = {"type": "abort", "message": "aborted"}
        self.release_finished()

    def admit_waiting(self) -> list[Req]:
        """Move waiting requests that fit (rows, reserved KV) into the running set."""
        admitted: list[Req] = []
        pool, rows = self.runner.kv_pool, self.runner.req_to_token_pool
        reserved = sum(r.reserved for r in self.running)
        while (self.waiting and rows.num_free > 0
               and len(self.running) + len(admitted) < self.settings.max_running_requests):
            req = self.waiting[0]
            need = min(len(req.input_ids) + req.sampling.max_new_tokens, self.runner.context_length)
            if reserved + need > pool.size:
                break
            self.waiting.popleft()
            req.row, req.reserved = rows.alloc(), need
            reserved += need
            admitted.append(req)
        self.running.extend(admitted)
        return admitted

    def run_batch(self, mode: ForwardMode, reqs: Sequence[Req]) -> None:
        if mode is ForwardMode.EXTEND:
            seqs = [BatchSeq(r.row, r.kv_len, r.input_ids[r.kv_len:]) for r in reqs]
        else:
            seqs = [BatchSeq(r.row, r.kv_len, [r.output_ids[-1]]) for r in reqs]
        batch = make_forward_batch(self.runner, mode, seqs)
        for req, seq in zip(reqs, seqs):
            req.kv_len += len(seq.token_ids)
        logits = self.runner.forward_logits(batch)
        next_ids = sample(logits, [r.sampling for r in reqs]).tolist()
        for req, token in zip(reqs, next_ids):
            if req.sampling.max_new_tokens == 0:
                req.finish_reason = {"type": "length", "length": 0}
                continue
            req.output_ids.append(int(token))
            self.check_finished(req)

    def check_finished(self, req: Req) -> None:
        token, params = req.output_ids[-1], req.sampling
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            req.finish_reason = {"type": "stop", "matched": token}
        elif len(req.output_ids) >= params.max_new_tokens:
            req.finish_reason = {"type": "length", "length": params.max_new_tokens}
        elif req.seq_len >= self.runner.context_length:
            req.finish_reason = {"type": "length", "length": len(req.output_ids)}

    def send_outputs(self, reqs: Sequence[Req]) -> None:
        outputs = [
            TokenOutput(rid=r.rid, new_token_ids=r.unsent(), prompt_tokens=len(r.input_ids),
                        completion_tokens=len(r.output_ids), finish_reason=r.finish_reason,
                        error=r.error, error_status=r.error_status)
            for r in reqs
        ]
        if outputs:
            self.send_sock.send_pyobj(TokenBatch(outputs))

    def release_finished(self) -> None:
        """Free the KV slots and table rows of finished requests."""
        still_running = []
        for req in self.running:
            if not req.finished:
                still_running.append(req)
                continue
            if req.row is not None:
                release_sequence(self.runner, req.row, req.kv_len)
                req.row, req.kv_len = None, 0
        self.running = still_running

    def close(self) -> None:
        self.recv_sock.close(linger=0)
        self.send_sock.close(linger=0)
        self.zmq.term()


def _eos_ids(hf_config: Any) -> list[int]:
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def run_scheduler_process(settings_data: dict[str, Any], records: tuple[Any, ...],
                          endpoints: dict[str, str], ready_conn: Any) -> None:
    """Entry point of the scheduler process (started with the ``spawn`` method)."""
    from sgl.cli import plugin_config_classes
    from sgl.config import settings_from_dict
    from sgl.log import setup_logging
    from sgl.plugins import PluginSelection, create_plugin_manager

    setup_logging(settings_data.get("log_level", "info"), process="scheduler")
    scheduler = None
    try:
        pm = create_plugin_manager(PluginSelection(exact=tuple(records)))
        settings = settings_from_dict(settings_data, plugin_config_classes(pm))
        scheduler = Scheduler(settings, pm, endpoints)
        pm.notify_startup(settings=settings, process="scheduler", context=scheduler)
    except BaseException as exc:  # report why, then exit non-zero
        logger.error("scheduler failed to start:\n%s", traceback.format_exc())
        ready_conn.send(SchedulerInfo(ok=False, error=f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    ready_conn.send(scheduler.info())
    ready_conn.close()
    try:
        scheduler.event_loop()
    finally:
        pm.notify_shutdown(settings=settings, process="scheduler")
        scheduler.close()
