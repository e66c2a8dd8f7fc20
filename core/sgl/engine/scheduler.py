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

Optional participants (the core's speculative decoding, a plugin's prefill/decode
disaggregation, any :class:`~sgl.engine.extension.SchedulerExtension`) take part through the
hooks of :attr:`Scheduler.extensions`, which do nothing where no extension is on; they see the
scheduler through a :class:`~sgl.engine.extension.SchedulerView`.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
import zmq

from sgl.engine.batch_builder import make_forward_batch
from sgl.engine.extension import Extensions
from sgl.engine.finishing import FinishRules
from sgl.engine.grammar_manager import IDLE_WAIT, make_grammar_manager
from sgl.engine.logprobs import LogprobRows, add_input_logprobs, add_output_logprobs
from sgl.engine.messages import TokenOutput
from sgl.engine.sampler import SamplingInput, sample_next_tokens
from sgl.engine.schedule_policy import Admission, ScheduledBatch
from sgl.engine.scheduler_io import SchedulerIO
from sgl.engine.scheduler_view import SchedulerFacade, extension_classes
from sgl.engine.sequence import Req
from sgl.engine.sessions import Sessions
from sgl.engine.setup import build_runner, eos_token_ids, make_cache_policy, prepare_process
from sgl.engine.speculative import settle_draft
from sgl.kvcache import BaseCachePolicy, PrefixMatch

if TYPE_CHECKING:
    from sgl.config import ServerSettings
    from sgl.engine.model_runner import ModelRunner
    from sgl.plugins import SglPluginManager

__all__ = ["Scheduler"]

logger = logging.getLogger("sgl.scheduler")

#: share of a running request's remaining max_new_tokens that admission expects it to use
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.002


class Scheduler(SchedulerIO):
    """The loop of a scheduler process (the leader's, with a parallel strategy): requests in,
    batches through the model, tokens out; its messages are :class:`SchedulerIO`'s."""

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
        self.eos_token_ids = eos_token_ids(self.runner.hf_config)
        #: when a request's output ends (stop tokens and strings, lengths)
        self.finish = FinishRules(self.eos_token_ids, self.runner.context_length,
                                  self._tokenizer.result)
        self.admission = Admission(settings.schedule_policy,
                                   make_cache_policy(settings, pm, self.runner),
                                   self.runner.kv_pool, self.runner.req_to_token_pool,
                                   settings.max_running_requests, self.runner.context_length)
        self.grammar = make_grammar_manager(
            settings, pm, tokenizer=self._tokenizer.result, vocab_size=self.runner.vocab_size,
            stop_token_ids=self.eos_token_ids)
        self.sessions = Sessions()
        self.chunk_size = (settings.chunked_prefill_size if settings.chunked_prefill_size > 0
                           else self.runner.context_length)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.num_retractions = 0
        self.num_received_reqs = 0  # generation requests this scheduler was sent, ever
        self.stopping = False
        self.parent_pid = os.getppid()
        self._replies: list[TokenOutput] = []  # outputs of requests ended between steps
        self._step_slots: torch.Tensor | None = None  # KV slots of a forward still running
        #: the parallel strategy this scheduler leads, for /get_server_info; empty without one
        self.parallel: dict[str, Any] = {}

        self.connect(endpoints)
        #: the optional participants in each step, built last: they see a whole scheduler
        self.extensions = Extensions([cls(SchedulerFacade(self))
                                      for cls in extension_classes(settings, pm)])
        self.admission.max_output = self.extensions.max_output_tokens
        for sock in self.extensions.wake:  # their events wake an idle loop
            self.poller.register(sock, zmq.POLLIN)

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

    # the loop --------------------------------------------------------------------------------

    def event_loop(self) -> None:
        while not self.stopping:
            self.recv_requests(block=self.idle)
            self.step()

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self.grammar.queue
                    or self.extensions.busy)

    def step(self) -> None:
        """Schedule, run one forward, process its result, send what changed, free what
        finished."""
        self.admit_compiled()
        changed = self.extensions.before_step()
        batch = self.schedule()
        if batch:
            self.execute(batch)
        self.extensions.after_step()
        self.send_outputs([*batch.reqs, *changed])
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
        # drafts (speculative decoding) share this step's token budget and KV memory
        drafted = self.extensions.add_draft_tokens(decodes, min(free, self.chunk_size))
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
            self._replies.append(req.take_output())

    def start(self, req: Req, match: PrefixMatch) -> None:
        """Give a request its row, starting from the (locked) cached prefix ``match``."""
        self.give_row(req, match)
        req.kv_len = len(match)
        self.running.append(req)

    def give_row(self, req: Req, match: PrefixMatch) -> None:
        """A table row for ``req``, beginning with the (locked) cached prefix ``match``."""
        req.row = self.runner.req_to_token_pool.alloc()
        req.prefix = match
        if len(match):
            self.runner.req_to_token_pool.req_to_token[req.row, :len(match)] = match.slots
        if req.cached_tokens is None:  # first admission (not a retracted request resuming)
            req.cached_tokens = len(match)
            self.cache.stats.queried_tokens += len(req.input_ids)
            self.cache.stats.hit_tokens += len(match)
        req.scheduled_time = req.scheduled_time or time.time()

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
        self.extensions.released(req)
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
            self.extensions.batch_ran(batch, hidden)
            self.process_batch_result(batch, hidden)
        except Exception as exc:  # a bug in the batched part: these requests cannot go on
            logger.error("processing a batch of %d failed:\n%s", len(batch.items),
                         traceback.format_exc())
            self.extensions.batch_failed()
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
            self.guarded(req, "computing prompt logprobs", add_input_logprobs,
                         req, req.kv_len - n, n, hidden, start, self.runner.logits_at)
        self.cache_prefills([req for req, n in batch.items if n > 1 and req.draft is None])
        to_sample, drafted = [], []
        for i, req in enumerate(batch.reqs):
            if req.draft is not None:
                if not req.finished:  # its last token's row, then the draft's
                    drafted.append((req, offsets[i]))
                continue
            if req.pending or req.finished:
                continue
            if req.sampling.max_new_tokens == 0:
                req.finish_reason = {"type": "length", "length": 0}
            else:
                to_sample.append((req, offsets[i + 1] - 1))  # the row of its last token
        if drafted:  # the extension that drafted them verifies them
            self.extensions.verify(drafted, hidden)
        if to_sample:
            try:
                self.sample(to_sample, hidden)
            except Exception:  # find the request that makes the batch fail: sample each alone
                logger.error("sampling %d requests failed, sampling each alone:\n%s",
                             len(to_sample), traceback.format_exc())
                for item in to_sample:
                    self.guarded(item[0], "sampling", self.sample, [item], hidden)
        self.extensions.batch_done(batch, hidden)  # every next token is known now

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

    def take_token(self, req: Req, token: int, lp: LogprobRows | None = None,
                   row: int | None = None) -> None:
        """After ``token`` was sampled for ``req``: its logprobs (row ``row`` of ``lp``, if it
        asked for them), the grammar, the finish check."""
        if lp is not None and row is not None:
            add_output_logprobs(req, lp, row, token)
        room = min(req.remaining_new_tokens(), self.runner.context_length - req.seq_len)
        if (error := self.grammar.advance(req, room)) is not None:
            self.fail(req, error, 500)
        self.finish.check(req)

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

    # messages --------------------------------------------------------------------------------

    def fail(self, req: Req, message: str, status: int) -> None:
        req.error, req.error_status = message, status
        req.finish_reason = {"type": "abort", "message": message}
        self.extensions.ended(req, message)

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
        if req.finished and req.session_id is not None and req.error is None:
            self.sessions.keep(req.session_id, token_ids, self.cache)

    def release_finished(self) -> None:
        """Free the KV slots and table rows of finished requests."""
        still_running = []
        for req in self.running:
            if req.finished:
                self.free_memory(req)
                self.extensions.released(req)
            else:
                still_running.append(req)
        self.running = still_running

    def close(self) -> None:
        if self.runner.mirror is not None:  # the other ranks stop with the leader
            self.runner.mirror.close()
        self.grammar.close()
        self.extensions.close()
        self.recv_sock.close(linger=0)
        self.send_sock.close(linger=0)
