"""A draft model: a second :class:`~sgl.engine.model_runner.ModelRunner` with its own KV pool
(as many tokens as the target's, and the same request rows), which drafts greedily.

Each step, for the drafted requests together: one extend forward brings the draft model's KV
up to the request's tokens (the whole prompt the first time; afterwards the tokens the target
accepted, and the drafts it rejected are cut off first), which gives the first draft token;
then ``num_steps - 1`` decode forwards give the others. Greedy drafts have no probabilities to
offer, so the engine's verification (a one-hot proposal) keeps the target's distribution.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from sgl.engine.batch_builder import BatchSeq, make_forward_batch
from sgl.forward_batch import ForwardMode
from sgl.kernels.cpu import argmax_rows
from sgl.speculative import BaseSpeculativeAlgorithm, DraftRequest, check_draft_model_settings

if TYPE_CHECKING:
    from sgl.config import ServerSettings

__all__ = ["DraftModelDrafter"]

logger = logging.getLogger("sgl.speculative.standalone")


@dataclass
class _DraftSeq:
    """One request in the draft model: its row, and the tokens whose KV the draft pool holds."""

    row: int
    tokens: list[int] = field(default_factory=list)


class DraftModelDrafter(BaseSpeculativeAlgorithm):
    """``--speculative-algorithm STANDALONE --speculative-draft-model-path PATH``."""

    name = "STANDALONE"
    default_num_draft_tokens = 4  # 3 draft-model steps
    default_disable_by_batch_size = 4

    def __init__(self, *, settings: ServerSettings, runner: Any, num_draft_tokens: int,
                 plugin_manager: Any = None) -> None:
        super().__init__(settings=settings, runner=runner, num_draft_tokens=num_draft_tokens,
                         plugin_manager=plugin_manager)
        from sgl.engine.model_runner import SUPPORTED_DTYPES, ModelRunner

        if plugin_manager is None:
            raise ValueError("STANDALONE needs the plugin manager to load its draft model")
        self.draft = ModelRunner(
            model_path=settings.speculative_draft_model_path,
            dtype=next((k for k, v in SUPPORTED_DTYPES.items() if v == runner.dtype), "auto"),
            attention_backend=settings.attention_backend, registries=plugin_manager.registries,
            plugin_manager=plugin_manager, max_total_tokens=runner.kv_pool.size,
            max_running_requests=runner.req_to_token_pool.max_requests,
            page_size=settings.page_size, device=runner.device, show_progress=False,
            cpu_graphs=not settings.disable_cpu_graph)
        self.vocab_size = min(self.draft.vocab_size, runner.vocab_size)
        self.seqs: dict[str, _DraftSeq] = {}
        logger.info("draft model %s (%s): KV pool of %d tokens (%.1f MiB)",
                    self.draft.model_path.name, self.draft.architecture, self.draft.kv_pool.size,
                    self.draft.kv_pool_bytes / 2**20)

    @classmethod
    def check_settings(cls, settings: ServerSettings) -> str | None:
        return check_draft_model_settings(settings, "STANDALONE", "the draft model")

    # the draft model's KV ----------------------------------------------------------------------

    def _sync(self, rid: str, token_ids: Sequence[int], max_draft: int,
              budget: int) -> tuple[_DraftSeq | None, int]:
        """The request's draft sequence cut back to what still agrees with ``token_ids`` (the
        rejected drafts go), if ``budget`` free slots of the draft pool hold the rest of
        ``token_ids`` and ``max_draft`` more, and the slots it takes; else None (the request is
        not drafted this step)."""
        seq = self.seqs.get(rid)
        if seq is None:
            if self.draft.req_to_token_pool.num_free == 0:
                return None, 0
            seq = self.seqs[rid] = _DraftSeq(self.draft.req_to_token_pool.alloc())
        keep = min(len(seq.tokens), len(token_ids) - 1)  # the last token must run again
        start = max(0, keep - self.num_draft_tokens - 1)  # only the tail can have changed
        for i in range(start, keep):
            if seq.tokens[i] != token_ids[i]:
                keep = i
                break
        self._truncate(seq, keep)
        need = len(token_ids) - keep + max_draft
        if budget < need or len(token_ids) + max_draft > self.draft.context_length:
            self.release(rid)
            return None, 0
        return seq, need

    def _truncate(self, seq: _DraftSeq, keep: int) -> None:
        if len(seq.tokens) > keep:
            table = self.draft.req_to_token_pool.req_to_token
            self.draft.kv_pool.free(table[seq.row, keep:len(seq.tokens)].clone())
            del seq.tokens[keep:]

    def release(self, rid: str) -> None:
        seq = self.seqs.pop(rid, None)
        if seq is not None:
            self._truncate(seq, 0)
            self.draft.req_to_token_pool.free(seq.row)

    # drafting ----------------------------------------------------------------------------------

    def propose(self, reqs: Sequence[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in reqs]
        active: list[tuple[int, _DraftSeq, int]] = []  # (index in reqs, sequence, max draft)
        items = []
        budget = self.draft.kv_pool.num_free
        for i, r in enumerate(reqs):
            if r.max_draft <= 0:
                continue
            seq, need = self._sync(r.rid, r.token_ids, r.max_draft, budget)
            if seq is None:
                continue
            budget -= need
            new = list(r.token_ids[len(seq.tokens):])
            items.append(BatchSeq(seq.row, len(seq.tokens), new))
            seq.tokens.extend(new)
            active.append((i, seq, r.max_draft))
        if not items:
            return drafts
        logits = self.draft.forward_logits(make_forward_batch(self.draft, ForwardMode.EXTEND,
                                                              items))
        self._append(drafts, active, logits)
        while active := [(i, s, m) for i, s, m in active if len(drafts[i]) < m]:
            batch = make_forward_batch(self.draft, ForwardMode.DECODE, [
                BatchSeq(s.row, len(s.tokens), [drafts[i][-1]]) for i, s, _ in active])
            for i, s, _ in active:
                s.tokens.append(drafts[i][-1])
            self._append(drafts, active, self.draft.forward_logits(batch))
        return drafts

    def _append(self, drafts: list[list[int]], active: list[tuple[int, _DraftSeq, int]],
                logits: torch.Tensor) -> None:
        """Each active request's greedy next token; one the target's vocabulary does not have
        ends that request's draft."""
        for k, ((i, seq, _), token) in enumerate(zip(active, argmax_rows(logits).tolist())):
            if token < self.vocab_size:
                drafts[i].append(int(token))
            else:
                active[k] = (i, seq, len(drafts[i]))
