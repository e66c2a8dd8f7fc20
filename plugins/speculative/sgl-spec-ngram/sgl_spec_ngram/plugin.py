"""Registers the ``NGRAM`` speculative algorithm and its options; imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sgl import hookimpl


@dataclass(frozen=True)
class NgramSettings:
    """Options of n-gram drafting (``--speculative-ngram-<field>``, SGLang's flags)."""

    min_match_window_size: int = field(default=1, metadata={
        "help": "Shortest n-gram of the request's latest tokens that may match an earlier "
                "place in its text.", "minimum": 1})
    max_match_window_size: int = field(default=12, metadata={
        "help": "Longest n-gram tried; the longest match (then the latest) gives the draft.",
        "minimum": 1})
    max_bfs_breadth: int = field(default=1, metadata={
        "help": "Most continuations drafted as one token tree (from the best matches, longest "
                "then latest, with distinct continuations); 1: one chain.", "minimum": 1})


@hookimpl
def sgl_add_config() -> type:
    return NgramSettings


@hookimpl
def sgl_register_speculative_algorithms(register: Any) -> None:
    register("NGRAM", "sgl_spec_ngram.ngram:NgramDrafter")
