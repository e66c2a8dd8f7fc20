"""The interface of grammar backends (constrained decoding)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["BaseGrammarBackend", "BaseGrammarMatcher"]


class BaseGrammarMatcher(ABC):
    """The state of one request's grammar: which tokens may come next."""

    @abstractmethod
    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bitmask of the next step into ``bitmask[row]``."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar rejects it."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar accepts the output as complete."""


class BaseGrammarBackend(ABC):
    """Compiles constraints (JSON schema, regex, EBNF) into matchers for one tokenizer.

    Built once per scheduler process with the model's tokenizer and vocabulary size.
    """

    def __init__(self, *, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    @abstractmethod
    def compile(self, kind: str, spec: str) -> BaseGrammarMatcher:
        """Compile a constraint; ``kind`` is ``"json_schema"``, ``"regex"`` or ``"ebnf"``.
        Raise ValueError with a message for the user when ``spec`` is invalid."""
