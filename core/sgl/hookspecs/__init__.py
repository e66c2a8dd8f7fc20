"""The hook specifications of sgl: one small module per concern.

The public contract between the core and its plugins. See ``docs/hooks.md``.
"""

from __future__ import annotations

from types import ModuleType

from sgl.hookspecs import (
    api,
    attention,
    cli,
    config,
    frontends,
    grammar,
    kernels,
    kvcache,
    lifecycle,
    models,
    parallel,
    scheduler,
    speculative,
    tools,
    transfer,
)
from sgl.hookspecs._marker import PROJECT_NAME, hookimpl, hookspec

__all__ = ["PROJECT_NAME", "SPEC_MODULES", "hookimpl", "hookspec"]

SPEC_MODULES: tuple[ModuleType, ...] = (
    lifecycle,
    api,
    cli,
    config,
    attention,
    kernels,
    models,
    grammar,
    kvcache,
    speculative,
    scheduler,
    parallel,
    transfer,
    frontends,
    tools,
)
