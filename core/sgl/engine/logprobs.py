"""Logprob entries in SGLang's layout, computed from a batch of logit rows."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sgl.engine.messages import LogprobEntry

__all__ = ["LogprobRows"]


class LogprobRows:
    """log_softmax of some logit rows, and the entries requests ask of them."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logprobs = torch.log_softmax(logits.float(), dim=-1)

    def token(self, row: int, token_id: int) -> LogprobEntry:
        return (float(self.logprobs[row, token_id]), int(token_id), None)

    def top(self, row: int, k: int) -> list[LogprobEntry]:
        values, ids = self.logprobs[row].topk(k)
        return [(float(v), int(i), None) for v, i in zip(values.tolist(), ids.tolist())]

    def of_ids(self, row: int, token_ids: Sequence[int]) -> list[LogprobEntry]:
        values = self.logprobs[row, list(token_ids)].tolist()
        return [(float(v), int(i), None) for v, i in zip(values, token_ids)]

