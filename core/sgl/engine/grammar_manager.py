"""Constrained decoding in the scheduler: the grammar queue, the compiled-grammar cache, the
batch bitmask and jump-forward.

A request with a constraint (``json_schema``, ``regex``, ``ebnf``, ``structural_tag``) does not
join the waiting queue at once: it waits in the *grammar queue* while its grammar compiles in a
compile worker process bounded in time and memory (:mod:`sgl.grammar.worker`; a thread here waits
for it), and the scheduler keeps decoding the others meanwhile. Compiled grammars are
cached by ``(kind, spec)``, so a repeated constraint is ready at once. Each step, the matchers of
the constrained requests fill one int32 bitmask for the batch, applied to the logits in one
vectorised operation (:func:`sgl.engine.sampler.apply_token_bitmask`). After sampling, the token
advances the request's matcher; the request finishes (``stop``) when the grammar terminates;
and where the grammar allows exactly one continuation its tokens are appended without sampling
(jump-forward), to be prefilled in the next step like a prompt chunk.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sgl.engine.sampler import apply_token_bitmask
from sgl.grammar.base import GrammarError
from sgl.grammar.select import backend_kinds, resolve_backend, unsupported_message
from sgl.grammar.worker import BackendRecipe, CompileWorkers

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from sgl.config import ServerSettings
    from sgl.engine.sequence import Req
    from sgl.grammar.base import BaseGrammarBackend
    from sgl.plugins import SglPluginManager

__all__ = ["GrammarManager", "GrammarStats", "make_grammar_manager"]

logger = logging.getLogger("sgl.grammar")

#: compiled grammars kept (least recently used dropped first), and their most serialized bytes
#: (one constraint can compile to hundreds of MB: the count alone bounds nothing)
CACHE_SIZE = 256
CACHE_BYTES = 1 << 30
#: seconds a step with nothing else to do waits for a grammar to finish compiling
IDLE_WAIT = 0.005


@dataclass
class GrammarStats:
    compiled: int = 0  # grammars compiled (cache misses)
    cache_hits: int = 0
    failed: int = 0  # constraints that did not compile
    compile_seconds: float = 0.0
    jump_forward_tokens: int = 0  # tokens appended without sampling


class GrammarManager:
    """The scheduler's side of grammar backends (see the module docstring)."""

    def __init__(self, backend_cls: type[BaseGrammarBackend] | None, name: str | None, *,
                 kinds: dict[str, frozenset[str]],
                 recipe: Callable[[], BackendRecipe] | None, vocab_size: int,
                 max_batch: int, jump_forward: bool, workers: int | None = None,
                 compile_timeout: float = 30.0, compile_memory_mb: int = 2048) -> None:
        self.name = name if backend_cls is not None else None
        self.cls = backend_cls
        self.kinds = kinds
        self.jump_forward = jump_forward
        self.stats = GrammarStats()
        #: requests whose grammar is compiling, with its future
        self.queue: list[tuple[Req, Future[Any]]] = []
        self._cache: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        self._sizes: dict[tuple[str, str], int] = {}  # serialized bytes of each compiled grammar
        self._bitmask = torch.zeros((max_batch, math.ceil(vocab_size / 32)), dtype=torch.int32)
        self._executor: ThreadPoolExecutor | None = None
        self._backend: Future[BaseGrammarBackend] | None = None
        self.workers: CompileWorkers | None = None
        if backend_cls is not None and recipe is not None:
            size = workers or min(4, max(2, (os.cpu_count() or 2) // 2))
            self._executor = ThreadPoolExecutor(size + 1, thread_name_prefix="sgl-grammar")
            recipe_future = self._executor.submit(recipe)
            # built in the background, so start-up and unconstrained requests never wait for it
            self._backend = self._executor.submit(self._build, recipe_future)
            self.workers = CompileWorkers(recipe_future.result, size=size,
                                          timeout=compile_timeout, memory_mb=compile_memory_mb,
                                          backend_name=backend_cls.name or str(name))

    def _build(self, recipe: Future[BackendRecipe]) -> BaseGrammarBackend:
        backend = recipe.result().build()
        logger.info("grammar backend %s ready", self.name)
        return backend

    @property
    def backend(self) -> BaseGrammarBackend:
        if self._backend is None:
            raise RuntimeError("no grammar backend")
        return self._backend.result()

    # compiling -------------------------------------------------------------------------------

    def submit(self, req: Req) -> str | None:
        """Start compiling ``req``'s constraint (or take it from the cache) and queue the
        request; returns why it cannot be served (status 400) instead."""
        constraint = req.sampling.constraint
        if constraint is None:
            raise ValueError(f"request {req.rid} has no constraint")
        kind = constraint[0]
        if self.cls is None or self._executor is None or kind not in self.cls.kinds:
            return unsupported_message(self.name, kind, self.kinds)
        future = self._cache.get(constraint)
        if future is not None:
            self._cache.move_to_end(constraint)
            self.stats.cache_hits += 1
        else:
            future = self._executor.submit(self._compile, *constraint)
            self._cache[constraint] = future
            while len(self._cache) > CACHE_SIZE or (
                    len(self._cache) > 1 and sum(self._sizes.values()) > CACHE_BYTES):
                self._sizes.pop(self._cache.popitem(last=False)[0], None)
        self.queue.append((req, future))
        return None

    def _compile(self, kind: str, spec: str) -> Any:
        """On a worker thread: compiled in a compile worker process, rebuilt here."""
        backend = self.backend  # waits while the backend is being built
        assert self.workers is not None
        start = time.perf_counter()
        try:
            data = self.workers.compile(kind, spec)
            self._sizes[(kind, spec)] = len(data)
            return backend.deserialize(data)
        finally:
            self.stats.compile_seconds += time.perf_counter() - start
            self.stats.compiled += 1

    def take_ready(self, wait_s: float = 0.0) -> tuple[list[Req], list[tuple[Req, str, int]]]:
        """The queued requests whose grammar is ready (each given a fresh matcher), and those
        whose grammar failed with the message and HTTP status. ``wait_s``: wait that long for
        one to finish when none has."""
        if not self.queue:
            return [], []
        if wait_s > 0 and not any(f.done() for _, f in self.queue):
            wait({f for _, f in self.queue}, timeout=wait_s, return_when=FIRST_COMPLETED)
        ready: list[Req] = []
        failed: list[tuple[Req, str, int]] = []
        still = []
        for req, future in self.queue:
            if not future.done():
                still.append((req, future))
                continue
            try:
                req.grammar = self.backend.new_matcher(future.result())
                ready.append(req)
            except GrammarError as exc:
                failed.append((req, str(exc), 400))
            except Exception as exc:  # the library failed on a constraint it accepted
                logger.exception("grammar backend %s failed on request %s", self.name, req.rid)
                failed.append((req, f"the {self.name} grammar backend failed: {exc}", 500))
        self.stats.failed += len(failed)
        self.queue = still
        return ready, failed

    def abort(self, rid: str) -> None:
        self.queue = [(r, f) for r, f in self.queue if r.rid != rid]

    # decoding --------------------------------------------------------------------------------

    def constrain(self, reqs: Sequence[Req], logits: torch.Tensor) -> None:
        """Mask ``logits`` (one row per request of ``reqs``) to the tokens each request's
        grammar allows; rows of unconstrained requests are left alone."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return
        for j, i in enumerate(rows):
            reqs[i].grammar.fill_next_token_bitmask(self._bitmask, j)  # type: ignore[union-attr]
        apply_token_bitmask(logits, self._bitmask[:len(rows)], rows)

    def constrain_drafts(self, items: Sequence[tuple[Req, int]], logits: torch.Tensor) -> None:
        """Mask the rows of draft positions (speculative decoding): ``(request, its first row)``
        pairs, where row ``first + i`` is the next-token distribution after the request's output
        and the first ``i`` tokens of ``req.draft``. The matcher walks the draft and is rolled
        back; past a draft token the grammar refuses the rows are left alone (the target's
        token before them cannot be that draft token, so they are never used)."""
        for req, first in items:
            matcher = req.grammar
            if matcher is None:
                continue
            rows, walked = [first], 0
            for token in req.draft:
                if not matcher.accept_token(token):
                    break
                walked += 1
                rows.append(first + walked)
            mask = torch.zeros((len(rows), self._bitmask.shape[1]), dtype=torch.int32)
            # fill from the deepest position back: each fill, then undo one token
            for i in range(len(rows) - 1, -1, -1):
                matcher.fill_next_token_bitmask(mask, i)
                if i:
                    matcher.rollback(1)
            apply_token_bitmask(logits, mask, rows)

    def advance(self, req: Req, room: int) -> str | None:
        """Feed the request's last token to its matcher; finish the request when the grammar
        terminates; else append up to ``room`` jump-forward tokens. Returns an error when the
        grammar rejects the token (the mask should have made that impossible)."""
        matcher = req.grammar
        if matcher is None:
            return None
        token = req.output_ids[-1]
        if not matcher.accept_token(token):
            return f"the {self.name} grammar rejected token {token}"
        if not self.finish_if_terminated(req) and self.jump_forward and room > 0 \
                and not req.logprobs.return_logprob:
            forced = []
            for t in matcher.find_jump_forward_tokens()[:room]:
                if not matcher.accept_token(t):
                    break
                forced.append(t)
            req.output_ids.extend(forced)
            self.stats.jump_forward_tokens += len(forced)
            self.finish_if_terminated(req)
        return None

    def finish_if_terminated(self, req: Req) -> bool:
        """Finish ``req`` (``stop``) when its grammar accepts nothing more: after a stop token
        (``matched`` is that token) or at the end of the grammar's language (``matched`` None,
        so no text is trimmed)."""
        if req.grammar is None or not req.grammar.is_terminated():
            return False
        token = req.output_ids[-1]
        stops = (*self.backend.stop_token_ids, *req.sampling.stop_token_ids)
        req.finish_reason = {"type": "stop", "matched": token if token in stops else None}
        return True

    def info(self) -> dict[str, Any]:
        s = self.stats
        return {"grammar_backend": self.name or "none", "num_grammar_queue_reqs": len(self.queue),
                "grammar_compiled": s.compiled, "grammar_cache_hits": s.cache_hits,
                "grammar_failed": s.failed, "grammar_compile_seconds": round(s.compile_seconds, 4),
                "grammar_jump_forward_tokens": s.jump_forward_tokens,
                "grammar_jump_forward": self.jump_forward,
                "grammar_compile_workers_started": self.workers.started if self.workers else 0,
                "grammar_compile_workers_lost": self.workers.lost if self.workers else 0}

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self.workers is not None:
            self.workers.close()


def make_grammar_manager(settings: ServerSettings, pm: SglPluginManager, *,
                         tokenizer: Callable[[], Any], vocab_size: int,
                         stop_token_ids: Sequence[int]) -> GrammarManager:
    """The grammar manager the settings ask for: ``--grammar-backend`` (``auto``: xgrammar when
    its plugin is installed, else none). The backend itself is built on a worker thread."""
    registry = pm.registries.grammar
    name = resolve_backend(settings.grammar_backend, registry)
    cls = registry.load(name) if name is not None else None

    def recipe() -> BackendRecipe:
        tok = tokenizer()
        stops = list(dict.fromkeys([*stop_token_ids, *([tok.eos_token_id]
                                                        if tok.eos_token_id is not None else [])]))
        return BackendRecipe(cls, tok, vocab_size, stops)  # type: ignore[arg-type]

    logger.info("grammar backend: %s; jump-forward %s", name or "none",
                "off" if settings.disable_jump_forward else "on")
    return GrammarManager(cls, name, kinds=backend_kinds(registry),
                          recipe=recipe if cls is not None else None,
                          vocab_size=vocab_size, max_batch=settings.max_running_requests,
                          jump_forward=not settings.disable_jump_forward,
                          compile_timeout=settings.grammar_compile_timeout,
                          compile_memory_mb=settings.grammar_compile_memory_mb)
