"""The hooks of the example plugin: one setting and one scheduler extension. Kept light: the
extension's module loads only in a scheduler process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sgl import hookimpl


@dataclass(frozen=True)
class StepTraceSettings:
    path: str | None = field(default=None, metadata={
        "help": "Write one JSON line per scheduler step to this file (off when unset)."})


@hookimpl
def sgl_add_config() -> type:
    return StepTraceSettings


@hookimpl
def sgl_register_scheduler_extensions(register: Any) -> None:
    register("step-trace", "sgl_step_trace.trace:StepTrace")
