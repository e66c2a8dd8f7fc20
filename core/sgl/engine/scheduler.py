"""The scheduler process: owns the model, batches requests, samples tokens.

One :meth:`Scheduler.step` of the event loop is three phases, after the messages from the
server (:meth:`~Scheduler.recv_requests`, one handler per message type):

1. :meth:`~Scheduler.schedule` returns a :class:`~sgl.engine.schedule_policy.ScheduledBatch`:
   the running decodes (retracting requests when KV memory runs out), the next chunks of
   prompts already running, and the waiting requests the
   :class:`~sgl.engine.schedule_policy.Admission` lets in;
2. :meth:`~Scheduler.run_batch` runs one forward over the mixed batch;
3. :meth:`~Scheduler.process_batch_result` computes logprobs, caches prefixes, samples, runs
   the grammars and checks which requests finished.

A failure fails only the request it concerns: a forward that raises is run again request by
request (:meth:`~Scheduler.forward_failed`), a batched sampling step likewise, and each request's
own share of the result processing is :meth:`~Scheduler.guarded`.

Then the new tokens go back to the server and finished requests are freed.
"""

from __future__ import annotations

import logging
import os
import random
import time
import traceback
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import zmq

from sgl.engine.batch_builder import make_forward_batch
from sgl.engine.finishing import FinishRules
from sgl.engine.cpu_graph import CPU_GRAPH_MAX_BS
from sgl.engine.disaggregation import disaggregation_side
from sgl.engine.grammar_manager import IDLE_WAIT, make_grammar_manager
from sgl.engine.logprobs import LogprobRows
from sgl.engine.setup import build_runner, prepare_process
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
from sgl.engine.sampler import SamplingInput, sample_next_tokens
from sgl.engine.schedule_policy import Admission, ScheduledBatch
from sgl.engine.speculative import (
    SpeculativeDecoding,
    Verified,
    request_spec_info,
    settle_draft,
)
from sgl.engine.sequence import Req
from sgl.kernels import cpu
from sgl.layers.tp import get_tp_group
from sgl.kvcache import BaseCachePolicy, NoPrefixCache, PrefixMatch

if TYPE_CHECKING:
    from sgl.config import ServerSettings
    from sgl.engine.model_runner import ModelRunner
    from sgl.plugins import SglPluginManager

__all__ = ["Scheduler", "build_runner", "configure_threads", "prepare_process"]

logger = logging.getLogger("sgl.scheduler")

#: share of a running request's remaining max_new_tokens that admission expects it to use
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.002
#: the most sessions open at once (each is an entry here and a protected cache prefix)
MAX_OPEN_SESSIONS = 1024


class Scheduler:
    def __init__(self, settings: ServerSettings, pm: SglPluginManager,
                 endpoints: dict[str, str]) -> None:
        from sgl.model_loader import load_tokenizer, resolve_model_path

        self.settings = settings
        self.plugins = pm
        # the tokenizer (for stop strings) loads while the model does; transformers' lazy
        # module is not safe to import from two threads at once, so import it here first
        from transformers import AutoConfig, AutoTokenizer  # noqa: F401
        # likewise torch._dynamo: the first call of some torch.ops.sgl operators imports it
        # (torch._compile), during decode-graph recording, while a grammar backend's thread may
        # be importing torch modules too; the race once failed a start with "cannot import
        # name 'IndentedBuffer' from 'torch._inductor.utils'"
        import torch._dynamo  # noqa: F401
        self.threads = prepare_process(settings, pm)

        self._tokenizer: Future[Any] = ThreadPoolExecutor(1).submit(
            load_tokenizer, resolve_model_path(settings.model_path))
        self.runner: ModelRunner = build_runner(settings, pm)
        self.eos_token_ids = _eos_ids(self.runner.hf_config)
        #: when a request's output ends (stop tokens and strings, lengths)
        self.finish = FinishRules(self.eos_token_ids, self.runner.context_length,
                                  self._tokenizer.result)
        if self.runner.kv_pool.size < self.runner.context_length:
            logger.warning("the KV pool (%d tokens) is smaller than the context length (%d): a "
                           "request that fills it alone stops there (finish reason length); "
                           "raise --max-total-tokens to avoid that", self.runner.kv_pool.size,
                           self.runner.context_length)
        self.admission = Admission(settings.schedule_policy,
                                   make_cache_policy(settings, pm, self.runner),
                                   self.runner.kv_pool, self.runner.req_to_token_pool,
                                   settings.max_running_requests, self.runner.context_length)
        self.grammar = make_grammar_manager(
            settings, pm, tokenizer=self._tokenizer.result, vocab_size=self.runner.vocab_size,
            stop_token_ids=self.eos_token_ids)
        #: drafts and verifies decode tokens (--speculative-algorithm); None when off
        self.spec: SpeculativeDecoding | None = (
            SpeculativeDecoding(settings, pm, self.runner)
            if settings.speculative_algorithm is not None else None)
        #: open sessions -> the cached conversation each protects (empty until its first request)
        self.sessions: dict[str, PrefixMatch] = {}
        self.chunk_size = (settings.chunked_prefill_size if settings.chunked_prefill_size > 0
                           else self.runner.context_length)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.num_retractions = 0
        self.num_received_reqs = 0  # generation requests this scheduler was sent, ever
        self.stopping = False
        self.parent_pid = os.getppid()
        self._replies: list[TokenOutput] = []  # outputs of requests rejected or aborted
        self._step_slots: torch.Tensor | None = None  # KV slots of a forward still running
        #: the parallel strategy this scheduler leads, for /get_server_info; empty without one
        self.parallel: dict[str, Any] = {}

        #: what each message from the server does
        self.handlers: dict[type, Callable[[Any], None]] = {
            GenerateRequest: self.add_request,
            AbortRequest: lambda msg: self.abort(msg.rid),
            FlushCacheRequest: lambda msg: self.reply_info(msg.rid, self.flush_cache()),
            ServerInfoRequest: lambda msg: self.reply_info(msg.rid, self.load_info()),
            OpenSessionRequest: lambda msg: self.reply_info(
                msg.rid, self.open_session(msg.session_id)),
            CloseSessionRequest: lambda msg: self.reply_info(
                msg.rid, self.close_session(msg.session_id)),
            ShutdownRequest: lambda msg: self.stop(),
        }
        self.zmq = zmq.Context()
        self.recv_sock = self.zmq.socket(zmq.PULL)
        self.recv_sock.connect(endpoints["requests"])
        self.send_sock = self.zmq.socket(zmq.PUSH)
        self.send_sock.connect(endpoints["outputs"])
        #: the prefill or decode side of a disaggregated server (--disaggregation-mode)
        self.disagg = disaggregation_side(self)
        self.poller = zmq.Poller()
        self.poller.register(self.recv_sock, zmq.POLLIN)
        if self.disagg is not None:
            self.poller.register(self.disagg.wake, zmq.POLLIN)  # its events wake an idle loop
            if self.disagg.mode == "prefill":
                self.admission.max_output = 1
        self.record_decode_forwards()

    def record_decode_forwards(self) -> list[int]:
        """Record the decode forwards of batch sizes 1 to ``--cpu-graph-max-bs`` before
        serving (:meth:`~sgl.engine.cpu_graph.CpuGraphRunner.record_batch_sizes`), where the
        runner replays them and plain decode batches will run: not with speculative decoding
        (its verify batches are what decode) nor on the prefill side of a disaggregated
        server. The sizes recorded."""
        graphs = self.runner.cpu_graphs
        if graphs is None or self.spec is not None or (
                self.disagg is not None and self.disagg.mode == "prefill"):
            return []
        max_bs = self.settings.cpu_graph_max_bs
        if max_bs is None:
            max_bs = CPU_GRAPH_MAX_BS
        return graphs.record_batch_sizes(min(max_bs, self.settings.max_running_requests),
                                         show_progress=get_tp_group().rank == 0)

    @property
    def cache(self) -> BaseCachePolicy:
        """The prefix cache (the admission's: it matches and locks prefixes in it)."""
        return self.admission.cache

    @cache.setter
    def cache(self, cache: BaseCachePolicy) -> None:
        self.admission.cache = cache

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer.result()

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

    # the loop --------------------------------------------------------------------------------

    def event_loop(self) -> None:
        while not self.stopping:
            self.recv_requests(block=self.idle)
            self.step()

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self.grammar.queue
                    or (self.disagg is not None and self.disagg.busy))

    def step(self) -> None:
        """Schedule, run one forward, process its result, send what changed, free what
        finished."""
        self.admit_compiled()
        arrived = self.disagg.admit() if self.disagg is not None else []
        batch = self.schedule()
        if batch:
            self.execute(batch)
        if self.disagg is not None:
            self.disagg.after_forward()
        self.send_outputs([*batch.reqs, *arrived])
        self.release_finished()

    # 1. scheduling ---------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """This step's work: the running decodes (retracting requests while the KV memory
        cannot hold their next tokens), the next chunks of prompts already running, then
        waiting requests, as far as the token budget and KV memory allow."""
        decodes = [r for r in self.running if r.pending == 1]
        while decodes and self.admission.kv_available() < len(decodes):
            self.retract(decodes.pop())
        if decodes:
            self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO,
                                       self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        free = self.admission.kv_available() - len(decodes)
        drafted = 0
        if self.spec is not None:  # drafts share this step's token budget and KV memory
            drafted = self.spec.draft(decodes, min(free, self.chunk_size),
                                      self.runner.context_length)
        batch = ScheduledBatch([(r, 1 + len(r.draft or ())) for r in decodes])
        budget = self.chunk_size - drafted
        free -= drafted
        for req in self.running:  # a prompt whose earlier chunks already ran
            if req.pending > 1 and budget > 0 and free > 0:
                n = min(req.pending, budget, free)
                batch.items.append((req, n))
                budget, free = budget - n, free - n
        if self.admission.has_room(self.waiting, len(self.running), budget):
            reserved = sum(self.admission.expected_output(r, self.new_token_ratio) + r.pending
                           for r in self.running) - len(decodes)
            in_flight = [(r, n) for r, n in batch.items if r.kv_len < len(r.input_ids)]
            for req, match, n in self.admission.select(self.waiting, len(self.running), budget,
                                                       free, reserved, self.new_token_ratio,
                                                       in_flight):
                self.waiting.remove(req)
                self.start(req, match)
                if n > 0:
                    batch.items.append((req, n))
        self.make_room(batch.num_tokens)
        return batch

    def admit_compiled(self) -> None:
        """Requests whose grammar finished compiling join the waiting queue; those whose grammar
        failed end with the error. With nothing else to run, wait a moment for one."""
        ready, failed = self.grammar.take_ready(0 if self.waiting or self.running else IDLE_WAIT)
        for req in ready:
            self.enqueue(req)
        for req, message, status in failed:
            self.fail(req, message, status)
            self._replies.append(self.take_output(req))

    def start(self, req: Req, match: PrefixMatch) -> None:
        """Give a request its row, starting from the (locked) cached prefix ``match``."""
        req.row = self.runner.req_to_token_pool.alloc()
        req.prefix, req.kv_len = match, len(match)
        if len(match):
            self.runner.req_to_token_pool.req_to_token[req.row, :len(match)] = match.slots
        if req.cached_tokens is None:  # first admission (not a retracted request resuming)
            req.cached_tokens = len(match)
            self.cache.stats.queried_tokens += len(req.input_ids)
            self.cache.stats.hit_tokens += len(match)
        req.scheduled_time = req.scheduled_time or time.time()
        self.running.append(req)

    def make_room(self, num_tokens: int) -> None:
        """Evict cached prefixes until ``num_tokens`` slots are free."""
        short = num_tokens - self.runner.kv_pool.num_free
        if short > 0:
            self.cache.evict(short)

    def retract(self, req: Req) -> None:
        """Give a running request's KV memory back; it waits again and resumes from its tokens."""
        if len(self.running) == 1:  # alone and still out of memory: it can never continue
            req.finish_reason = {"type": "length", "length": len(req.output_ids), "message": (
                f"the KV pool ({self.runner.kv_pool.size} tokens, --max-total-tokens) is full")}
            return
        self.running.remove(req)
        self.free_memory(req)
        if self.spec is not None:
            self.spec.release(req.rid)
        self.num_retractions += 1
        self.waiting.appendleft(req)
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1)
        logger.info("retracted request %s (%d tokens) to free KV memory", req.rid, req.seq_len)

    # 2. the forward --------------------------------------------------------------------------

    def run_batch(self, batch: ScheduledBatch) -> torch.Tensor:
        """One forward over the batch's tokens; returns the hidden states, one row a token.
        The requests' KV now covers the tokens that ran."""
        forward = make_forward_batch(self.runner, batch.mode, batch.seqs(),
                                     decode_seqs=batch.decode_seqs)
        self._step_slots = forward.out_cache_loc
        hidden = self.runner.forward(forward)
        self._step_slots = None  # from here on the requests own them
        table = self.runner.req_to_token_pool.req_to_token
        for req, n in batch.items:
            if req.draft:  # the draft's slots are the request's once verified (settle_draft)
                first = req.kv_len + 1
                req.draft_slots = table[req.row, first:first + len(req.draft)].clone()
                n = 1
            req.kv_len += n
        return hidden

    def execute(self, batch: ScheduledBatch) -> None:
        """Phases 2 and 3 for ``batch``; what raises fails only the requests it concerns."""
        try:
            hidden = self.run_batch(batch)
        except Exception as exc:
            self.forward_failed(batch, exc)
            return
        try:
            self.process_batch_result(batch, hidden)
        except Exception as exc:  # a bug in the batched part: these requests cannot go on
            logger.error("processing a batch of %d failed:\n%s", len(batch.items),
                         traceback.format_exc())
            if self.spec is not None:
                self.spec.drop_kept()
            for req in batch.reqs:
                self.settle(req, [])
                if not req.finished:
                    self.fail(req, f"internal error while processing the model's output: {exc}",
                              500)

    def forward_failed(self, batch: ScheduledBatch, exc: Exception) -> None:
        """A forward that raised changed no request (it only took KV slots for the new tokens,
        given back here), so each request of a larger batch runs again alone: only one that
        fails by itself fails."""
        logger.error("a forward of %d requests failed:\n%s", len(batch.items),
                     traceback.format_exc())
        if self._step_slots is not None:  # taken for the new tokens, never filled
            self.runner.kv_pool.free(self._step_slots)
            self._step_slots = None
        if len(batch.items) == 1:
            self.fail(batch.items[0][0], f"internal error while running the model: {exc}", 500)
            return
        for item in batch.items:
            self.execute(ScheduledBatch([item]))

    def guarded(self, req: Req, stage: str, work: Callable[..., None], *args: Any) -> None:
        """``work(*args)``: one request's share of the result processing; if it raises, that
        request fails (status 500) and the batch goes on."""
        try:
            work(*args)
        except Exception as exc:
            logger.error("request %s failed while %s:\n%s", req.rid, stage,
                         traceback.format_exc())
            self.fail(req, f"internal error while {stage}: {exc}", 500)

    # 3. the result ---------------------------------------------------------------------------

    def process_batch_result(self, batch: ScheduledBatch, hidden: torch.Tensor) -> None:
        """Prompt logprobs, cache the prefixes just computed, then for every sequence that
        reached its end: sample the next token, its logprobs, the grammar, the finish check."""
        offsets = batch.offsets()
        for (req, n), start in zip(batch.items, offsets):
            self.guarded(req, "computing prompt logprobs", self.input_logprobs,
                         req, req.kv_len - n, n, hidden, start)
        self.cache_prefills([req for req, n in batch.items if n > 1 and req.draft is None])
        to_sample, drafted = [], []
        for i, req in enumerate(batch.reqs):
            if req.draft is not None:
                if not req.finished:  # its last token's row, then the draft's
                    drafted.append((req, offsets[i]))
                continue
            if self.spec is not None:
                self.spec.kept(req, range(offsets[i], offsets[i + 1]))
            if req.pending or req.finished:
                continue
            if req.sampling.max_new_tokens == 0:
                req.finish_reason = {"type": "length", "length": 0}
            else:
                to_sample.append((req, offsets[i + 1] - 1))  # the row of its last token
        if drafted:
            self.accept_drafts(drafted, hidden)
        if to_sample:
            try:
                self.sample(to_sample, hidden)
            except Exception:  # find the request that makes the batch fail: sample each alone
                logger.error("sampling %d requests failed, sampling each alone:\n%s",
                             len(to_sample), traceback.format_exc())
                for item in to_sample:
                    self.guarded(item[0], "sampling", self.sample, [item], hidden)
        if self.spec is not None:  # every next token is known now
            self.spec.observe(hidden)

    def accept_drafts(self, items: list[tuple[Req, int]], hidden: torch.Tensor) -> None:
        """Verify the drafts of ``(request, its first row)`` pairs and take the accepted tokens
        (:mod:`sgl.engine.speculative`); a failure fails only the request it concerns."""
        assert self.spec is not None
        try:
            verified = self.spec.verify(items, hidden, self.grammar, self.finish.banned)
        except Exception:
            if len(items) == 1:
                raise
            logger.error("verifying %d drafts failed, verifying each alone:\n%s", len(items),
                         traceback.format_exc())
            for item in items:
                self.guarded(item[0], "verifying its draft", self.accept_drafts, [item], hidden)
            return
        now = time.time()
        for v in verified:
            self.guarded(v.req, "taking its verified tokens", self.take_verified, v, now)
            self.settle(v.req, [])  # if that failed half-way

    def take_verified(self, v: Verified, now: float) -> None:
        """Append a request's verified tokens one by one, each through :meth:`take_token`,
        until one ends the output (or the grammar appends jump-forward tokens); keep the KV of
        the draft tokens that made it into the output."""
        req, appended = v.req, 0
        for j, token in enumerate(v.tokens):
            length = len(req.output_ids)
            req.output_ids.append(token)
            req.first_token_time = req.first_token_time or now
            appended += 1
            self.take_token(req, token, v.logprobs,
                            v.logprob_rows[j] if v.logprob_rows is not None else None)
            if req.finished or len(req.output_ids) != length + 1:
                break
        assert self.spec is not None and req.draft is not None
        self.spec.count(req, len(req.draft), v.accepted, appended)
        keep = v.path[:appended]
        self.settle(req, keep)
        self.spec.kept(req, v.hidden_rows[:1 + len(keep)])

    def settle(self, req: Req, keep: list[int]) -> None:
        """End a request's draft: the KV of its draft tokens ``keep`` (indices) stays, the rest
        is freed."""
        if req.draft is not None:
            settle_draft(req, keep, self.runner.kv_pool.free,
                         self.runner.req_to_token_pool.req_to_token)

    def sample(self, to_sample: list[tuple[Req, int]], hidden: torch.Tensor) -> None:
        """Sample the next token of each request from its row of ``hidden``; nothing about a
        request changes before every token is drawn (so a failure can be retried)."""
        rows = torch.tensor([row for _, row in to_sample], dtype=torch.int64)
        logits = self.runner.logits_at(hidden, rows, reuse=True)
        reqs = [r for r, _ in to_sample]
        wants = [i for i, r in enumerate(reqs) if r.logprobs.return_logprob]
        lp = LogprobRows(logits[wants]) if wants else None  # the model's, before the grammar
        self.grammar.constrain(reqs, logits)
        next_ids = sample_next_tokens(logits, SamplingInput(
            params=[r.sampling for r in reqs], seeds=[r.seed for r in reqs],
            steps=[len(r.output_ids) for r in reqs], output_ids=[r.output_ids for r in reqs],
            prompt_ids=[r.input_ids for r in reqs], banned=[self.finish.banned(r) for r in reqs],
        )).tolist()
        now = time.time()
        lp_row = {i: row for row, i in enumerate(wants)}  # request -> its row of lp
        for i, (req, token) in enumerate(zip(reqs, next_ids)):
            req.output_ids.append(int(token))
            req.first_token_time = req.first_token_time or now
            self.guarded(req, "processing its new token", self.take_token, req, int(token), lp,
                         lp_row.get(i))

    def take_token(self, req: Req, token: int, lp: LogprobRows | None, row: int | None) -> None:
        """After ``token`` was sampled for ``req``: its logprobs (row ``row`` of ``lp``, if it
        asked for them), the grammar, the finish check."""
        if lp is not None and row is not None:
            self.output_logprobs(req, lp, row, token)
        room = min(req.remaining_new_tokens(), self.runner.context_length - req.seq_len)
        if (error := self.grammar.advance(req, room)) is not None:
            self.fail(req, error, 500)
        self.finish.check(req)

    def output_logprobs(self, req: Req, lp: LogprobRows, row: int, token: int) -> None:
        opts = req.logprobs
        req.output_token_logprobs.append(lp.token(row, token))
        if opts.top_logprobs_num > 0:
            req.output_top_logprobs.append(lp.top(row, opts.top_logprobs_num))
        if opts.token_ids_logprob:
            req.output_token_ids_logprobs.append(lp.of_ids(row, opts.token_ids_logprob))

    def cache_prefills(self, reqs: list[Req]) -> None:
        """Hand the prefixes just computed to the cache, so requests admitted from now on
        share them (the request keeps using them, locked)."""
        table = self.runner.req_to_token_pool.req_to_token
        for req in reqs:
            new = self.cache.cache_unfinished(req.token_slice(0, req.kv_len),
                                              table[req.row, :req.kv_len], req.prefix)
            if new is not req.prefix:
                table[req.row, :len(new)] = new.slots
                req.prefix = new

    def input_logprobs(self, req: Req, start: int, n: int, hidden: torch.Tensor,
                       offset: int) -> None:
        """Prompt logprobs for the positions this chunk lets us compute (row ``p - 1`` predicts
        position ``p``; position 0 has no prediction)."""
        opts = req.logprobs
        if not opts.return_logprob or req.next_input_logprob >= len(req.input_ids):
            return
        first = req.next_input_logprob
        if first == 0:
            req.input_token_logprobs.append((None, req.input_ids[0], None))
            if opts.top_logprobs_num > 0:
                req.input_top_logprobs.append(None)
            if opts.token_ids_logprob:
                req.input_token_ids_logprobs.append(None)
            first = 1
        last = min(start + n, len(req.input_ids) - 1)  # predicted positions up to here
        positions = list(range(max(first, start + 1), last + 1))
        req.next_input_logprob = max(first, last + 1)
        if not positions:
            return
        rows = torch.tensor([offset + p - 1 - start for p in positions], dtype=torch.int64)
        lp = LogprobRows(self.runner.logits_at(hidden, rows))
        for j, p in enumerate(positions):
            req.input_token_logprobs.append(lp.token(j, req.input_ids[p]))
            if opts.top_logprobs_num > 0:
                req.input_top_logprobs.append(lp.top(j, opts.top_logprobs_num))
            if opts.token_ids_logprob:
                req.input_token_ids_logprobs.append(lp.of_ids(j, opts.token_ids_logprob))

    # messages --------------------------------------------------------------------------------

    def recv_requests(self, block: bool) -> None:
        """Handle every message waiting on the socket (``block``: wait up to a second for
        one; then also notice a server process that is gone)."""
        timeout = 1000 if block else 0
        while self.poller.poll(timeout):
            timeout = 0
            if not self.recv_sock.poll(0):  # only the disaggregation link's events: step
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
        limit = self.runner.context_length
        error = None
        if not req.input_ids:
            error = "the prompt is empty"
        elif len(req.input_ids) >= limit:
            error = f"the prompt has {len(req.input_ids)} tokens; the context length is {limit}"
        elif len(req.input_ids) + 1 > self.runner.kv_pool.size:
            error = (f"the prompt has {len(req.input_ids)} tokens; the KV pool holds "
                     f"{self.runner.kv_pool.size} (raise --max-total-tokens)")
        elif req.session_id is not None and req.session_id not in self.sessions:
            error = f"session {req.session_id!r} is not open (open one with /open_session)"
        elif max(req.input_ids) >= self.runner.vocab_size or min(req.input_ids) < 0:
            error = f"input_ids must be token ids below the vocabulary size {self.runner.vocab_size}"
        elif self.disagg is not None:
            error = self.disagg.check(req)
        elif req.bootstrap is not None:
            error = ("bootstrap_room: this server is not disaggregated; start it with "
                     "--disaggregation-mode prefill or decode to take requests of SGLang's "
                     "router in PD mode")
        if error is None and req.sampling.constraint is not None:
            error = self.grammar.submit(req)  # it waits in the grammar queue while compiling
            if error is None:
                return
        if error is not None:
            self.fail(req, error, 400)
            self._replies.append(self.take_output(req))
            return
        self.enqueue(req)

    def enqueue(self, req: Req) -> None:
        """A new request (its grammar compiled, if it has one) waits for admission; on a
        decode server, for its KV from the prefill server."""
        if self.disagg is not None and self.disagg.mode == "decode":
            if req.sampling.max_new_tokens == 0:  # nothing to generate, nothing to transfer
                req.finish_reason = {"type": "length", "length": 0}
                self._replies.append(self.take_output(req))
            else:
                self.disagg.add(req)
            return
        self.waiting.append(req)

    def fail(self, req: Req, message: str, status: int) -> None:
        req.error, req.error_status = message, status
        req.finish_reason = {"type": "abort", "message": message}
        if self.disagg is not None:
            self.disagg.ended(req, message)

    def abort(self, rid: str) -> None:
        self.grammar.abort(rid)
        if self.disagg is not None:
            self.disagg.abort(rid)
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
        for req in self.running:
            if req.rid == rid and not req.finished:
                req.finish_reason = {"type": "abort", "message": "aborted"}
                if self.disagg is not None:
                    self.disagg.ended(req, "the request was aborted")
        self.release_finished()

    def flush_cache(self) -> dict[str, Any]:
        if self.running or self.waiting:
            return {"success": False, "message": f"cannot flush the cache while "
                    f"{len(self.running)} running and {len(self.waiting)} waiting requests "
                    "use it; retry when they are done"}
        dropped = self.cache.cached_tokens
        if not self.cache.flush():
            return {"success": False, "message": "cannot flush: cached prefixes are locked"}
        self.sessions = dict.fromkeys(self.sessions, PrefixMatch())  # they start over
        message = ("nothing is cached across requests (no prefix cache)"
                   if isinstance(self.cache, NoPrefixCache)
                   else f"flushed the {self.cache.name} cache ({dropped} tokens)")
        return {"success": True, "message": message, "kv_free": self.runner.kv_pool.num_free}

    def open_session(self, session_id: str) -> dict[str, Any]:
        if session_id in self.sessions:
            return {"success": False, "message": f"session {session_id!r} is already open"}
        if len(self.sessions) >= MAX_OPEN_SESSIONS:
            return {"success": False, "message": f"{MAX_OPEN_SESSIONS} sessions are open, the "
                    "most this server keeps; close one (/close_session) first"}
        self.sessions[session_id] = PrefixMatch()
        return {"success": True, "session_id": session_id}

    def close_session(self, session_id: str) -> dict[str, Any]:
        match = self.sessions.pop(session_id, None)
        if match is None:
            return {"success": False, "message": f"session {session_id!r} is not open"}
        self.cache.unprotect(match)
        return {"success": True, "session_id": session_id}

    def keep_for_session(self, req: Req, token_ids: list[int]) -> None:
        """After a session's request: protect its whole conversation (prompt and answer) in the
        cache, in place of the previous turn's."""
        previous = self.sessions.get(req.session_id or "")
        if previous is None or req.error is not None:
            return
        match = self.cache.match_prefix(token_ids)
        self.cache.protect(match)
        self.cache.unprotect(previous)
        self.sessions[req.session_id] = match

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
                **(self.spec.info() if self.spec is not None else {}),
                **(self.disagg.info() if self.disagg is not None else {})}

    def reply_info(self, rid: str, info: dict[str, Any]) -> None:
        self.send_sock.send_pyobj(TokenBatch(info=info, info_rid=rid))

    def take_output(self, r: Req) -> TokenOutput:
        """What is new of ``r`` since its last output (tokens not sent, logprob entries), as a
        :class:`TokenOutput`; the logprob lists go with it, emptied here."""
        out = TokenOutput(
            rid=r.rid, new_token_ids=r.unsent(), prompt_tokens=len(r.input_ids),
            cached_tokens=r.cached_tokens or 0,
            completion_tokens=len(r.output_ids), finish_reason=r.finish_reason, error=r.error,
            error_status=r.error_status, input_token_logprobs=r.input_token_logprobs,
            output_token_logprobs=r.output_token_logprobs,
            input_top_logprobs=r.input_top_logprobs, output_top_logprobs=r.output_top_logprobs,
            input_token_ids_logprobs=r.input_token_ids_logprobs,
            output_token_ids_logprobs=r.output_token_ids_logprobs,
            first_token_time=r.first_token_time, spec=request_spec_info(r),
            queue_time=(r.scheduled_time - r.arrival_time) if r.scheduled_time else None)
        r.input_token_logprobs, r.output_token_logprobs = [], []
        r.input_top_logprobs, r.output_top_logprobs = [], []
        r.input_token_ids_logprobs, r.output_token_ids_logprobs = [], []
        return out

    def send_outputs(self, reqs: list[Req]) -> None:
        seen: set[str] = set()
        outputs = self._replies
        self._replies = []
        for r in [*reqs, *(r for r in self.running if r.finished)]:
            if r.rid in seen:
                continue
            seen.add(r.rid)
            if r.sent < len(r.output_ids) or r.finished or r.input_token_logprobs:
                outputs.append(self.take_output(r))
        if outputs:
            self.send_sock.send_pyobj(TokenBatch(outputs))

    def free_memory(self, req: Req) -> None:
        """Hand a request's KV slots to the cache (which keeps or frees them) and free its row."""
        if req.row is None:
            return
        self.settle(req, [])
        slots = self.runner.req_to_token_pool.req_to_token[req.row, :req.kv_len].clone()
        token_ids = req.token_slice(0, req.kv_len)
        # Where decode steps attend with other arithmetic than prefills (the runner says), the
        # cache keeps the prompt's KV and frees the answer's: a later prompt holding this answer
        # (a chat's next turn) then computes it as a prefill would cold, so its tokens do not
        # depend on the cache. A session continues its own sequence and keeps all of it.
        keep = len(token_ids)
        if req.session_id is None and not self.runner.decode_matches_prefill:
            keep = max(min(len(token_ids), len(req.input_ids)), len(req.prefix))
        if req.private_kv:  # KV from an unauthenticated peer serves this request only
            keep, req.private_kv = len(req.prefix), False
        if keep < len(token_ids):
            self.runner.kv_pool.free(slots[keep:])
        self.cache.cache_finished(token_ids[:keep], slots[:keep], req.prefix)
        self.runner.req_to_token_pool.free(req.row)
        req.row, req.kv_len, req.prefix = None, 0, PrefixMatch()
        if req.finished and req.session_id is not None:
            self.keep_for_session(req, token_ids)

    def release_finished(self) -> None:
        """Free the KV slots and table rows of finished requests."""
        still_running = []
        for req in self.running:
            if req.finished:
                self.free_memory(req)
                if self.spec is not None:
                    self.spec.release(req.rid)
            else:
                still_running.append(req)
        self.running = still_running

    def close(self) -> None:
        if self.runner.mirror is not None:  # the other ranks stop with the leader
            self.runner.mirror.close()
        self.grammar.close()
        if self.disagg is not None:
            self.disagg.close()
        self.recv_sock.close(linger=0)
        self.send_sock.close(linger=0)
        self.zmq.term()


def make_cache_policy(settings: ServerSettings, pm: SglPluginManager,
                      runner: ModelRunner) -> BaseCachePolicy:
    """The cache policy the settings ask for: ``--cache-policy``, else ``radix`` when a plugin
    registers it, else none; ``--disable-radix-cache`` always means none."""
    name = settings.cache_policy
    if name is None and "radix" in pm.registries.cache:
        name = "radix"
    if settings.disable_radix_cache or name is None:
        cls: type[BaseCachePolicy] = NoPrefixCache
    else:
        cls = pm.registries.cache.load(name)
    logger.info("prefix cache: %s; schedule policy: %s", cls.name, settings.schedule_policy)
    return cls(kv_pool=runner.kv_pool, page_size=settings.page_size)


def _eos_ids(hf_config: Any) -> list[int]:
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
