"""The scheduler as its extensions see it, and which extensions a scheduler runs.

:class:`SchedulerFacade` implements :class:`~sgl.engine.extension.SchedulerView` over a
:class:`~sgl.engine.scheduler.Scheduler`: the narrow set of things an extension may read and do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from sgl.engine.extension import SchedulerExtension, SchedulerView
from sgl.engine.speculative import SpeculativeDecoding
from sgl.kvcache import PrefixMatch

if TYPE_CHECKING:
    import torch

    from sgl.config import ServerSettings
    from sgl.engine.scheduler import Scheduler
    from sgl.engine.sequence import Req
    from sgl.plugins import SglPluginManager

__all__ = ["CORE_EXTENSIONS", "SchedulerFacade", "extension_classes"]

#: the scheduler extensions of the core itself, before the plugins'
CORE_EXTENSIONS: tuple[type[SchedulerExtension], ...] = (SpeculativeDecoding,)


def extension_classes(settings: ServerSettings, pm: SglPluginManager
                      ) -> list[type[SchedulerExtension]]:
    """The scheduler extensions the settings ask for: the core's, then the plugins' in
    registration order."""
    classes = [*CORE_EXTENSIONS, *(entry.load() for entry in pm.registries.extensions)]
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, SchedulerExtension)):
            raise TypeError(f"scheduler extension {cls!r} is not a subclass of "
                            "sgl.engine.extension.SchedulerExtension")
    return [cls for cls in classes if cls.enabled(settings)]


class SchedulerFacade(SchedulerView):
    """The scheduler as its extensions see it (:class:`~sgl.engine.extension.SchedulerView`)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._s = s = scheduler
        self.settings, self.plugins, self.runner = s.settings, s.plugins, s.runner
        self.zmq, self.grammar = s.zmq, s.grammar
        self.fail, self.free, self.guarded = s.fail, s.free_memory, s.guarded
        self.take_token, self.banned = s.take_token, s.finish.banned

    @property
    def running(self) -> tuple[Req, ...]:
        return tuple(self._s.running)

    def held(self) -> list[Req]:
        s = self._s
        return [*s.waiting, *s.running, *(req for req, _ in s.grammar.queue)]

    def reply(self, req: Req) -> None:
        self._s._replies.append(req.take_output())

    def reserve(self, req: Req, alongside: Sequence[Req]) -> torch.Tensor | None:
        s = self._s
        others = [*s.running, *alongside]
        if s.runner.req_to_token_pool.num_free == 0 \
                or len(others) >= s.settings.max_running_requests:
            return None
        match = s.cache.match_prefix(req.input_ids[:-1])
        s.cache.lock(match)
        need = len(req.input_ids) - len(match)
        reserved = sum(s.admission.expected_output(r, s.new_token_ratio) for r in others)
        available = s.admission.kv_available()
        expected = s.admission.expected_output(req, s.new_token_ratio)
        if need > available or (others and need + expected > available - reserved):
            s.cache.unlock(match)
            return None
        s.make_room(need)
        slots = s.runner.kv_pool.alloc(need)
        s.give_row(req, match)
        s.runner.req_to_token_pool.req_to_token[req.row, len(match):len(req.input_ids)] = slots
        req.kv_len = 0
        return slots

    def discard(self, req: Req, slots: torch.Tensor) -> None:
        s = self._s
        s.runner.kv_pool.free(slots)
        s.cache.unlock(req.prefix)
        if req.row is not None:
            s.runner.req_to_token_pool.free(req.row)
        req.row, req.kv_len, req.prefix = None, 0, PrefixMatch()

    def run(self, req: Req) -> None:
        self._s.running.append(req)

    def stop_running(self, req: Req) -> None:
        self._s.running.remove(req)

    def cache_prompt(self, req: Req) -> None:
        self._s.cache_prefills([req])
