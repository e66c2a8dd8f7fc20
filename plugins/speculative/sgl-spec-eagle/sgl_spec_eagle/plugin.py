"""Registers the ``EAGLE`` and ``EAGLE3`` speculative algorithms; imports nothing heavy."""

from __future__ import annotations

from typing import Any

from sgl import hookimpl


@hookimpl
def sgl_register_speculative_algorithms(register: Any) -> None:
    register("EAGLE", "sgl_spec_eagle.drafter:EagleDrafter")
    register("EAGLE3", "sgl_spec_eagle.drafter:Eagle3Drafter")
