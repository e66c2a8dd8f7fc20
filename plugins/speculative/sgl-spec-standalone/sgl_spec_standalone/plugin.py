"""Registers the ``STANDALONE`` speculative algorithm; imports nothing heavy."""

from __future__ import annotations

from typing import Any

from sgl import hookimpl


@hookimpl
def sgl_register_speculative_algorithms(register: Any) -> None:
    register("STANDALONE", "sgl_spec_standalone.standalone:DraftModelDrafter")
