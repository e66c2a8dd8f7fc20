"""The interface of speculative decoding algorithms."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["BaseSpeculativeAlgorithm"]


class BaseSpeculativeAlgorithm(ABC):
    """Proposes draft tokens that the target model verifies in one forward pass.

    Built once per scheduler process with the model runner.
    """

    def __init__(self, *, runner: Any, num_draft_tokens: int) -> None:
        self.runner = runner
        self.num_draft_tokens = num_draft_tokens

    @abstractmethod
    def propose(self, token_ids: list[list[int]]) -> list[list[int]]:
        """Draft up to ``num_draft_tokens`` next tokens for each running sequence."""

    @abstractmethod
    def accept(self, drafts: list[list[int]], target_logits: torch.Tensor) -> list[list[int]]:
        """Return, per sequence, the accepted prefix of its draft plus one token of the target."""
