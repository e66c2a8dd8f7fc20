"""Which registered parallelism strategy the settings turn on."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sgl.parallel.base import BaseParallelStrategy

if TYPE_CHECKING:
    from sgl.config import ServerSettings
    from sgl.plugins import Registries

__all__ = ["parallel_strategy"]

logger = logging.getLogger("sgl.parallel")


def parallel_strategy(settings: ServerSettings,
                      registries: Registries) -> tuple[str, BaseParallelStrategy] | None:
    """``(name, strategy)`` of the one registered strategy these settings turn on, else None
    (one scheduler process). :class:`~sgl.config.ConfigError` when a core flag asks for
    parallelism no installed plugin provides, when two strategies are on, or when the strategy
    refuses the settings (its message)."""
    from sgl.config import ConfigError

    active, broken = [], []
    for name in registries.parallel.names():
        entry = registries.parallel.entry(name)
        try:
            cls = entry.load()
        except Exception as exc:  # the others still run; named if the settings needed one
            broken.append(f"parallel strategy {name!r} of plugin {entry.owner!r} failed to "
                          f"import: {type(exc).__name__}: {exc}")
            logger.warning("%s", broken[-1])
            continue
        if not (isinstance(cls, type) and issubclass(cls, BaseParallelStrategy)):
            raise ConfigError(f"plugin {entry.owner!r} registered parallel strategy {name!r} "
                              f"as {cls!r}, which is not a subclass of "
                              "sgl.parallel.BaseParallelStrategy")
        problem = cls.check_settings(settings)
        if problem:
            raise ConfigError(problem)
        strategy = cls.from_settings(settings)
        if strategy is not None:
            active.append((name, strategy))
    if settings.tp_size > 1 and not active:
        raise ConfigError(f"--tp-size {settings.tp_size}: no installed plugin provides tensor "
                          "parallelism (install sgl-parallel-tp: make install does)"
                          + "".join(f"; {line}" for line in broken))
    if settings.dp_size > 1 and not active:
        raise ConfigError(f"--dp-size {settings.dp_size}: no installed plugin provides data "
                          "parallelism (install sgl-parallel-dp: make install does)"
                          + "".join(f"; {line}" for line in broken))
    if len(active) > 1:
        raise ConfigError("these settings turn on more than one parallel strategy ("
                          f"{', '.join(name for name, _ in active)}); sgl runs one at a time")
    return active[0] if active else None
