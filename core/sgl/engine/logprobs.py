"""Logprob entries in SGLang's layout, computed from a batch of logit rows, and the
bookkeeping of the entries a request asked for (of its prompt and of its output)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from sgl.engine.messages import LogprobEntry

if TYPE_CHECKING:
    from sgl.engine.sequence import Req

__all__ = ["LogprobRows", "add_input_logprobs", "add_output_logprobs"]


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



def add_output_logprobs(req: Req, lp: LogprobRows, row: int, token: int) -> None:
    """The entries ``req`` asked for of its output ``token``, from row ``row`` of ``lp``."""
    opts = req.logprobs
    req.output_token_logprobs.append(lp.token(row, token))
    if opts.top_logprobs_num > 0:
        req.output_top_logprobs.append(lp.top(row, opts.top_logprobs_num))
    if opts.token_ids_logprob:
        req.output_token_ids_logprobs.append(lp.of_ids(row, opts.token_ids_logprob))


def add_input_logprobs(req: Req, start: int, n: int, hidden: torch.Tensor, offset: int,
                       logits_at: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """The entries of the prompt positions a chunk of ``n`` tokens from position ``start``
    (rows ``offset..`` of ``hidden``) lets us compute: row ``p - 1`` predicts position ``p``;
    position 0 has no prediction."""
    opts = req.logprobs
    if not opts.return_logprob or req.next_input_logprob >= len(req.input_ids):
        return
    first = req.next_input_logprob
    if first == 0:
        req.input_token_logprobs.append((None, req.input_ids[0], None))
        if opts.top_logprobs_num > 0:
            req.input_top_logprobs.append(None)
        if opts.token_ids_logprob:
            req.input_token_ids_logprobs.append(None)
        first = 1
    last = min(start + n, len(req.input_ids) - 1)  # predicted positions up to here
    positions = list(range(max(first, start + 1), last + 1))
    req.next_input_logprob = max(first, last + 1)
    if not positions:
        return
    rows = torch.tensor([offset + p - 1 - start for p in positions], dtype=torch.int64)
    lp = LogprobRows(logits_at(hidden, rows))
    for j, p in enumerate(positions):
        req.input_token_logprobs.append(lp.token(j, req.input_ids[p]))
        if opts.top_logprobs_num > 0:
            req.input_top_logprobs.append(lp.top(j, opts.top_logprobs_num))
        if opts.token_ids_logprob:
            req.input_token_ids_logprobs.append(lp.of_ids(j, opts.token_ids_logprob))
