"""How a scheduler process starts: its threads, its model runner, and its part in a group.

:func:`run_scheduler_process` is the entry point the launcher spawns (``spawn`` method: a fresh
interpreter with only its arguments). A process is the one scheduler, or one rank of a parallel
strategy: the leader builds the :class:`~sgl.engine.scheduler.Scheduler` and runs its loop,
a follower builds only a model runner and runs what the leader broadcasts
(:meth:`~sgl.parallel.BaseParallelStrategy.follow`). Either reports ready, or why it could not
start, through the pipe the launcher waits on.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from sgl.engine.messages import SchedulerInfo
from sgl.engine.scheduler import Scheduler
from sgl.engine.setup import build_runner, prepare_process, record_decode_forwards
from sgl.model_loader import ModelLoadError
from sgl.parallel.base import GroupFailure, RankInfo

if TYPE_CHECKING:
    from sgl.config import ServerSettings
    from sgl.parallel import BaseParallelStrategy
    from sgl.plugins import SglPluginManager

__all__ = ["build_scheduler", "run_scheduler_process"]

logger = logging.getLogger("sgl.scheduler")


def run_scheduler_process(settings_data: dict[str, Any], records: tuple[Any, ...],
                          endpoints: dict[str, str], ready_conn: Any,
                          rank: RankInfo | None = None) -> None:
    """Entry point of a scheduler process (started with the ``spawn`` method): the only one,
    or one rank of a parallel strategy, where the leader schedules and the others follow."""
    from sgl.config import settings_from_dict
    from sgl.log import setup_logging
    from sgl.plugins import PluginSelection, create_plugin_manager

    setup_logging(settings_data.get("log_level", "info"),
                  process="scheduler" if rank is None else rank.tag)
    try:
        pm = create_plugin_manager(PluginSelection(exact=tuple(records)))
        settings = settings_from_dict(settings_data, pm.config_classes())
        strategy = None
        if rank is not None:
            strategy = pm.registries.parallel.load(rank.strategy)(settings)
            strategy.init_process(rank)
        if rank is not None and not rank.leader:
            assert strategy is not None
            serve = _follower(settings, pm, strategy, rank)
        else:
            serve = _leader(settings, pm, endpoints, rank, strategy)
    except BaseException as exc:  # report why, then exit non-zero
        if isinstance(exc, (ValueError, ModelLoadError)):  # the message says it all
            logger.error("scheduler failed to start: %s", exc)
        else:
            logger.error("scheduler failed to start:\n%s", traceback.format_exc())
        ready_conn.send(SchedulerInfo(ok=False, error=f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    serve(ready_conn)


def build_scheduler(settings: ServerSettings, pm: SglPluginManager,
                    endpoints: dict[str, str]) -> Scheduler:
    """The scheduler, ready to serve: where its decode steps stay plain one-token steps (no
    extension says otherwise, such as speculation or a prefill server's hand-over), the
    decode forwards are recorded for replay first."""
    scheduler = Scheduler(settings, pm, endpoints)
    pool, context = scheduler.runner.kv_pool.size, scheduler.runner.context_length
    if pool < context:
        logger.warning("the KV pool (%d tokens) is smaller than the context length (%d): a "
                       "request that fills it alone stops there (finish reason length); raise "
                       "--max-total-tokens to avoid that", pool, context)
    if scheduler.extensions.plain_decode:
        record_decode_forwards(scheduler.runner, settings)
    return scheduler


def _leader(settings: ServerSettings, pm: SglPluginManager, endpoints: dict[str, str],
            rank: RankInfo | None, strategy: BaseParallelStrategy | None
            ) -> Callable[[Any], None]:
    """Build the scheduler (the leader of its ranks); returns what reports ready and runs its
    loop until it is told to stop."""
    scheduler = build_scheduler(settings, pm, endpoints)
    if strategy is not None and rank is not None:
        strategy.lead(scheduler.runner)
        scheduler.parallel = {"strategy": rank.strategy, **strategy.describe()}
    pm.notify_startup(settings=settings, process="scheduler", context=scheduler)

    def serve(ready_conn: Any) -> None:
        ready_conn.send(scheduler.info())
        ready_conn.close()
        try:
            with torch.inference_mode():
                scheduler.event_loop()
        except GroupFailure as exc:
            logger.error("the scheduler stops: %s", exc)
            raise SystemExit(1) from None
        finally:
            pm.notify_shutdown(settings=settings, process="scheduler")
            scheduler.close()

    return serve


def _follower(settings: ServerSettings, pm: SglPluginManager, strategy: BaseParallelStrategy,
              rank: RankInfo) -> Callable[[Any], None]:
    """Build a follower rank's model runner; returns what reports ready and runs the leader's
    broadcast calls until the group ends."""
    prepare_process(settings, pm)
    runner = build_runner(settings, pm)

    def serve(ready_conn: Any) -> None:
        ready_conn.send(SchedulerInfo(ok=True, model_path=str(runner.model_path),
                                      architecture=runner.architecture,
                                      max_total_tokens=runner.kv_pool.size))
        ready_conn.close()
        try:
            strategy.follow(runner)
        except GroupFailure as exc:
            logger.error("rank %d stops: %s", rank.rank, exc)
            raise SystemExit(1) from None

    return serve
