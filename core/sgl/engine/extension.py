"""The scheduler-extension contract: optional participants in the scheduler's steps.

A feature that takes part in scheduling without being the model, the cache or the grammar (the
core's speculative decoding, prefill/decode disaggregation, a trace recorder, a per-request
budget) is a :class:`SchedulerExtension`. A plugin registers its class with
``sgl_register_scheduler_extensions`` (docs/hooks.md); every scheduler makes one instance of
each registered class whose :meth:`~SchedulerExtension.enabled` says the settings ask for it,
in the plugins' call order. Every hook has a do-nothing default, so an extension overrides only
what it takes part in, and the scheduler calls each hook without asking whether a feature is
on.

An extension sees the scheduler only through a :class:`SchedulerView`: the requests running,
and the few things an extension may do to them (reply, fail, free, start, take a token).

One step of the scheduler, with the hooks where they run::

    messages         check(req) -> error or None, then take(req) -> kept by the extension?
    before_step()    -> requests whose output changed (to send this step)
    schedule         add_draft_tokens(decodes, free_slots) -> KV slots the drafts take
    forward          batch_ran(batch, hidden)
    results          verify(items, hidden) for requests carrying a draft; then
                     batch_done(batch, hidden), or batch_failed() if processing raised
    after_step()     (outputs are sent after it, finished requests freed)
    freeing          released(req) for each request whose memory was freed
    abort / fail     abort(rid), ended(req, message)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch
    import zmq

    from sgl.config import ServerSettings
    from sgl.engine.grammar_manager import GrammarManager
    from sgl.engine.model_runner import ModelRunner
    from sgl.engine.schedule_policy import ScheduledBatch
    from sgl.engine.sequence import Req
    from sgl.engine.logprobs import LogprobRows
    from sgl.plugins import SglPluginManager

__all__ = ["Extensions", "SchedulerExtension", "SchedulerView"]

logger = logging.getLogger("sgl.scheduler")


class SchedulerView:
    """What an extension sees of the scheduler: a narrow facade over its state.

    The scheduler implements it; an extension keeps the view it is given and calls nothing
    else of the scheduler.
    """

    settings: ServerSettings
    plugins: SglPluginManager
    #: the model, its KV pool (``runner.kv_pool``) and request table (``runner.req_to_token_pool``)
    runner: ModelRunner
    #: the scheduler's ZMQ context, for sockets of the extension's own
    zmq: zmq.Context[Any]
    #: the grammar manager (constraining a draft's rows)
    grammar: GrammarManager

    @property
    def running(self) -> Sequence[Req]:
        """The requests running, in order (read-only: use :meth:`run` and :meth:`stop_running`)."""
        raise NotImplementedError

    def held(self) -> list[Req]:
        """Every request this scheduler holds: compiling its grammar, waiting, running."""
        raise NotImplementedError

    def reply(self, req: Req) -> None:
        """Send what is new of ``req`` (its tokens, its finish reason or error) this step."""
        raise NotImplementedError

    def fail(self, req: Req, message: str, status: int) -> None:
        """End ``req`` with ``message`` (HTTP ``status``); the extensions hear of it
        (:meth:`SchedulerExtension.ended`)."""
        raise NotImplementedError

    def free(self, req: Req) -> None:
        """Hand ``req``'s computed KV to the prefix cache and free its table row."""
        raise NotImplementedError

    def reserve(self, req: Req, alongside: Sequence[Req]) -> torch.Tensor | None:
        """Give ``req`` a table row and KV slots for its whole prompt without running it (the
        cached prefix shared and locked, its KV length 0), if KV memory allows it next to the
        running requests and ``alongside``; returns the new slots (the positions after the
        cached prefix), or None when it does not fit now."""
        raise NotImplementedError

    def discard(self, req: Req, slots: torch.Tensor) -> None:
        """Give back what :meth:`reserve` gave ``req``, caching nothing."""
        raise NotImplementedError

    def run(self, req: Req) -> None:
        """``req``, whose KV covers its prompt (``req.kv_len``), joins the running requests."""
        raise NotImplementedError

    def stop_running(self, req: Req) -> None:
        """Take ``req`` out of the running requests (its row and KV stay with it)."""
        raise NotImplementedError

    def cache_prompt(self, req: Req) -> None:
        """Hand the KV ``req`` holds so far to the prefix cache (it keeps using it)."""
        raise NotImplementedError

    def take_token(self, req: Req, token: int, lp: LogprobRows | None = None,
                   row: int | None = None) -> None:
        """After ``token`` was appended to ``req.output_ids``: its logprobs (row ``row`` of
        ``lp``), the grammar, the stop checks."""
        raise NotImplementedError

    def banned(self, req: Req, step: int) -> list[int]:
        """The tokens ``req`` may not sample at output position ``step`` (EOS before
        ``min_new_tokens``)."""
        raise NotImplementedError

    def guarded(self, req: Req, stage: str, work: Callable[..., None], *args: Any) -> None:
        """``work(*args)``; if it raises, ``req`` alone fails (status 500)."""
        raise NotImplementedError


class SchedulerExtension:
    """A participant in the scheduler's steps; every hook does nothing unless overridden."""

    #: the name /get_server_info and the logs use
    name: ClassVar[str] = "extension"
    #: the optional request fields (of :class:`~sgl.engine.messages.GenerateRequest`) this
    #: extension serves: the scheduler refuses a request setting one that no extension serves
    serves_fields: ClassVar[frozenset[str]] = frozenset()
    #: the most tokens a request generates on this server (None: its max_new_tokens); admission
    #: reserves KV memory for that many
    max_output_tokens: ClassVar[int | None] = None
    #: whether decode steps stay plain one-token steps with this extension on (False: the
    #: runner does not record decode forwards for replay)
    plain_decode: ClassVar[bool] = True
    #: a ZMQ socket whose messages wake an idle scheduler (None: the extension has none)
    wake: zmq.Socket[Any] | None = None

    @classmethod
    def enabled(cls, settings: ServerSettings) -> bool:
        """Whether ``settings`` ask for this extension (the scheduler makes it only then)."""
        return True

    def __init__(self, scheduler: SchedulerView) -> None:
        self.scheduler = scheduler

    @property
    def busy(self) -> bool:
        """Work is pending that only more steps advance (an idle loop keeps stepping)."""
        return False

    def check(self, req: Req) -> str | None:
        """Why this server refuses a new request (a 400), or None."""
        return None

    def take(self, req: Req) -> bool:
        """A new, valid request: True when the extension keeps it instead of the waiting
        queue (it starts it later through the view)."""
        return False

    def before_step(self) -> list[Req]:
        """At the start of a step; returns the requests whose output it changed."""
        return []

    def add_draft_tokens(self, decodes: Sequence[Req], free_slots: int) -> int:
        """Set ``req.draft`` of decoding requests, within ``free_slots`` KV slots; returns
        the number of draft tokens. The extension that drafts also :meth:`verify` s."""
        return 0

    def batch_ran(self, batch: ScheduledBatch, hidden: torch.Tensor) -> None:
        """The batch's forward ran (``hidden``: one row per token, in the batch's order)."""

    def verify(self, items: Sequence[tuple[Req, int]], hidden: torch.Tensor) -> None:
        """Take the tokens of requests that carry a draft (``(request, its first row)``)."""
        raise NotImplementedError(f"{self.name} drafts tokens but does not verify them")

    def batch_done(self, batch: ScheduledBatch, hidden: torch.Tensor) -> None:
        """The batch's results are processed (every next token is known)."""

    def batch_failed(self) -> None:
        """Processing the batch's results raised; its requests failed."""

    def after_step(self) -> None:
        """After the step's forward and results, before its outputs are sent."""

    def released(self, req: Req) -> None:
        """``req``'s memory was freed (it finished, or was retracted to run again later)."""

    def ended(self, req: Req, message: str) -> None:
        """``req`` failed or was aborted with ``message``."""

    def abort(self, rid: str) -> None:
        """The client gave request ``rid`` up (the scheduler aborts its own copy too)."""

    def info(self) -> dict[str, Any]:
        """Keys for /get_server_info's internal state."""
        return {}

    def close(self) -> None:
        """The scheduler stops."""


class Extensions:
    """The extensions of one scheduler, called as one: each hook goes to every extension in
    order; with none, every hook does nothing."""

    def __init__(self, extensions: Sequence[SchedulerExtension]) -> None:
        self.all = list(extensions)
        drafting = [e for e in self.all if
                    type(e).add_draft_tokens is not SchedulerExtension.add_draft_tokens]
        if len(drafting) > 1:
            raise ValueError("two scheduler extensions draft tokens: "
                             f"{', '.join(e.name for e in drafting)}; enable one")
        # without a drafter, the base class's hooks: no drafts (it never touches its view)
        self._drafter = drafting[0] if drafting else SchedulerExtension(SchedulerView())
        self.serves_fields = frozenset().union(*(e.serves_fields for e in self.all))
        limits = [e.max_output_tokens for e in self.all if e.max_output_tokens is not None]
        self.max_output_tokens = min(limits) if limits else None
        self.plain_decode = all(e.plain_decode for e in self.all)
        self.wake = [e.wake for e in self.all if e.wake is not None]

    def named(self, name: str) -> SchedulerExtension | None:
        """The extension called ``name`` (None: it is not on)."""
        return next((e for e in self.all if e.name == name), None)

    @property
    def busy(self) -> bool:
        return any(e.busy for e in self.all)

    def check(self, req: Req) -> str | None:
        return next((error for e in self.all if (error := e.check(req)) is not None), None)

    def take(self, req: Req) -> bool:
        return any(e.take(req) for e in self.all)

    def before_step(self) -> list[Req]:
        return [req for e in self.all for req in e.before_step()]

    def add_draft_tokens(self, decodes: Sequence[Req], free_slots: int) -> int:
        return self._drafter.add_draft_tokens(decodes, free_slots)

    def batch_ran(self, batch: ScheduledBatch, hidden: torch.Tensor) -> None:
        for e in self.all:
            e.batch_ran(batch, hidden)

    def verify(self, items: Sequence[tuple[Req, int]], hidden: torch.Tensor) -> None:
        self._drafter.verify(items, hidden)

    def batch_done(self, batch: ScheduledBatch, hidden: torch.Tensor) -> None:
        for e in self.all:
            e.batch_done(batch, hidden)

    def batch_failed(self) -> None:
        for e in self.all:
            e.batch_failed()

    def after_step(self) -> None:
        for e in self.all:
            e.after_step()

    def released(self, req: Req) -> None:
        for e in self.all:
            e.released(req)

    def ended(self, req: Req, message: str) -> None:
        for e in self.all:
            e.ended(req, message)

    def abort(self, rid: str) -> None:
        for e in self.all:
            e.abort(rid)

    def info(self) -> dict[str, Any]:
        return {key: value for e in self.all for key, value in e.info().items()}

    def close(self) -> None:
        for e in self.all:
            try:
                e.close()
            except Exception:
                logger.exception("scheduler extension %s failed to close", e.name)
