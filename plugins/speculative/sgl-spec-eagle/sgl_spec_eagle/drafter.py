"""EAGLE and EAGLE-3 drafting in the scheduler: the head's KV at its target's slots, caught up
from the target's hidden states after every forward, then greedy chains.

**Memory.** The head keeps one KV entry per position of a request, like the target, and at the
same slot index: its pool has the target's slots plus a scratch area of
``num_draft_tokens`` slots per request row for the positions it drafts. So a prefix the radix
cache keeps (and a later request finds) holds the head's KV too, the pool accounting is the
target's, and nothing is allocated or freed per step. The head's ``req_to_token`` has the
target's rows.

**Catching up** (:meth:`EagleDrafter.observe`, after each target forward): position ``p`` of the
head reads the token ``x[p + 1]`` and the target's state ``f[p]``; the positions a request
just kept (a prompt chunk; its last token and its accepted drafts) run through the head in one
extend, batched over the requests, and the head's output state at the request's last position
is kept for drafting.

**Drafting** (:meth:`EagleDrafter.propose`): the first draft token is the greedy token of that
kept state; each further one is one decode forward of the head on the previous draft token and
its own previous state, at the scratch slots. Greedy drafts are one-hot proposals, so the
engine's verification keeps the target's distribution exactly.

A position after a prefix-cache hit reads the head's KV written when the prefix was computed,
by the request that cached it; the entry of the prefix's last position was computed with the
token that followed it there, which a different continuation only makes a worse guess, never
a wrong output.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from sgl.engine.batch_builder import BatchSeq, make_forward_batch
from sgl.forward_batch import ForwardMode
from sgl.kernels.cpu import argmax_rows
from sgl.kvcache.pool import KVPool, ReqToTokenPool
from sgl.model_loader import ModelLoadError, load_hf_config, open_weights
from sgl.speculative import (
    BaseSpeculativeAlgorithm,
    DraftRequest,
    TargetStates,
    check_draft_chain_settings,
)
from sgl_spec_eagle.heads import Eagle3Head, EagleHead, aux_layer_ids, head_design

if TYPE_CHECKING:
    from torch import nn

    from sgl.attention.base import BaseAttentionBackend
    from sgl.config import ServerSettings

__all__ = ["Eagle3Drafter", "EagleDrafter"]

logger = logging.getLogger("sgl.speculative.eagle")


@dataclass
class _HeadMemory:
    """The head's KV pool, request table and attention backend, in the shape
    :func:`~sgl.engine.batch_builder.make_forward_batch` takes a runner."""

    device: torch.device
    kv_pool: KVPool
    req_to_token_pool: ReqToTokenPool
    attn_backend: BaseAttentionBackend


@dataclass
class _State:
    """A request in the head: its row, the positions whose KV the head holds from target
    states, and the head's output state at the last of them (None before any)."""

    row: int
    length: int
    last: torch.Tensor | None = None


class EagleDrafter(BaseSpeculativeAlgorithm):
    """``--speculative-algorithm EAGLE --speculative-draft-model-path HEAD`` (EAGLE, EAGLE-2)."""

    name = "EAGLE"
    default_num_draft_tokens = 4  # 3 head steps, SGLang's chain
    default_disable_by_batch_size = 4
    #: the draft head's design: 1 for EAGLE / EAGLE-2, 3 for EAGLE-3
    version: ClassVar[int] = 1

    def __init__(self, *, settings: ServerSettings, runner: Any, num_draft_tokens: int,
                 plugin_manager: Any = None) -> None:
        super().__init__(settings=settings, runner=runner, num_draft_tokens=num_draft_tokens,
                         plugin_manager=plugin_manager)
        if plugin_manager is None:
            raise ValueError(f"{self.name} needs the plugin manager for its attention backend")
        path = settings.speculative_draft_model_path
        config = load_hf_config(path)
        design = head_design(config)
        if design is not None and design != self.version:
            other = "EAGLE3" if design == 3 else "EAGLE"
            raise ModelLoadError(f"{path} is an {other.replace('3', '-3')} head (its config.json "
                                 f"says so); serve it with --speculative-algorithm {other}")
        self.target = runner.model
        self.head = self._build(config, runner)
        self.head.eval()
        self.head.load_weights(open_weights(path, runner.dtype))
        for module in self.head.modules():  # the CPU matmuls' packed weights
            process = getattr(module, "process_weights_after_loading", None)
            if callable(process):
                process()
        self.memory = self._memory(config, runner, settings.attention_backend,
                                   plugin_manager.registries)
        #: the first scratch slot; row r drafts at ``scratch + r * num_draft_tokens + j``
        self.scratch = runner.kv_pool.size + 1
        self.states: dict[str, _State] = {}
        logger.info("%s head %s: %d layer(s), KV %.1f MiB at the target's slots (+%d scratch)",
                    self.name, config.name_or_path or path, self.head.num_layers,
                    self.memory.kv_pool.size * self._bytes_per_token / 2**20,
                    self.memory.kv_pool.size - runner.kv_pool.size)

    @classmethod
    def check_settings(cls, settings: ServerSettings) -> str | None:
        return check_draft_chain_settings(settings, cls.name, f"the {cls.name} head")

    # building ----------------------------------------------------------------------------------

    def _build(self, config: Any, runner: Any) -> nn.Module:
        """The head for ``config``, checked against the target; sets :attr:`target_hidden`."""
        width = int(runner.hf_config.hidden_size)
        if config.hidden_size != width:
            raise ModelLoadError(f"the EAGLE head is {config.hidden_size} wide and the target "
                                 f"{width}; an EAGLE head reads the target's hidden states")
        self.target_hidden = "final"
        return EagleHead(config, dtype=runner.dtype, device=runner.device)

    def _memory(self, config: Any, runner: Any, backend: str, registries: Any) -> _HeadMemory:
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        rows = runner.req_to_token_pool
        pool = KVPool(size=runner.kv_pool.size + rows.max_requests * self.num_draft_tokens,
                      num_layers=self.head.num_layers, num_kv_heads=kv_heads, head_dim=head_dim,
                      dtype=runner.dtype, device=runner.device)
        self._bytes_per_token = KVPool.bytes_per_token(
            num_layers=self.head.num_layers, num_kv_heads=kv_heads, head_dim=head_dim,
            dtype=runner.dtype)
        table = ReqToTokenPool(max_requests=rows.max_requests,
                               max_context_len=rows.max_context_len, device=runner.device)
        attention = registries.attention.load(backend)(kv_pool=pool, req_to_token_pool=table,
                                                       device=runner.device)
        return _HeadMemory(runner.device, pool, table, attention)

    # the head's forward ------------------------------------------------------------------------

    def _forward(self, mode: ForwardMode, seqs: list[BatchSeq], slots: torch.Tensor,
                 states: torch.Tensor, from_target: bool) -> tuple[torch.Tensor, torch.Tensor]:
        batch = make_forward_batch(self.memory, mode, seqs, slots=slots)  # type: ignore[arg-type]
        self.memory.attn_backend.init_forward_metadata(batch)
        embeds = self._embed(batch.input_ids)
        return self.head(batch, embeds, states.to(embeds.dtype), from_target)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.target.get_input_embeddings()(ids)

    def _greedy(self, for_logits: torch.Tensor) -> list[int]:
        return argmax_rows(self.target.compute_logits(for_logits)).tolist()

    # the algorithm -----------------------------------------------------------------------------

    @torch.inference_mode()
    def observe(self, states: Sequence[TargetStates]) -> None:
        seqs, slots, features, kept = [], [], [], []
        table = self.runner.req_to_token_pool.req_to_token
        for s in states:
            k = min(s.hidden.shape[0], len(s.token_ids) - 1 - s.start)  # each needs its next token
            if k <= 0:
                continue
            state = self.states.get(s.rid)
            prefix = None
            if state is None or state.length != s.start or state.row != s.row:
                # new here (or after a failure): the prefix's KV is the one at its slots
                state = self.states[s.rid] = _State(s.row, s.start)
                prefix = table[s.row, :s.start]
            seqs.append(BatchSeq(s.row, s.start, list(s.token_ids[s.start + 1:s.start + 1 + k]),
                                 prefix_slots=prefix))
            slots.append(table[s.row, s.start:s.start + k])
            features.append(s.hidden[:k])
            kept.append((state, k))
        if not seqs:
            return
        _, after = self._forward(ForwardMode.EXTEND, seqs, torch.cat(slots),
                                 torch.cat(features), from_target=True)
        end = 0
        for state, k in kept:
            end += k
            state.length += k
            state.last = after[end - 1].clone()

    @torch.inference_mode()
    def propose(self, reqs: Sequence[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in reqs]
        active = [(i, state, r.max_draft) for i, r in enumerate(reqs)
                  if r.max_draft > 0 and (state := self.states.get(r.rid)) is not None
                  and state.last is not None and state.length == len(r.token_ids) - 1]
        if not active:
            return drafts
        current = torch.stack([state.last for _, state, _ in active])
        for_logits = self._logit_states(current)
        step = 0
        while True:
            for (i, _, _), token in zip(active, self._greedy(for_logits)):
                drafts[i].append(token)
            keep = [j for j, (i, _, most) in enumerate(active) if len(drafts[i]) < most]
            if not keep:
                return drafts
            active, current = [active[j] for j in keep], current[keep]
            seqs = [BatchSeq(state.row, state.length + step, [drafts[i][-1]])
                    for i, state, _ in active]
            slots = torch.tensor([self.scratch + state.row * self.num_draft_tokens + step
                                  for _, state, _ in active], dtype=torch.int64)
            for_logits, current = self._forward(ForwardMode.DECODE, seqs, slots, current,
                                                from_target=False)
            step += 1

    def _logit_states(self, states: torch.Tensor) -> torch.Tensor:
        """What the LM head reads for a kept output state (EAGLE: the state itself)."""
        return states

    def release(self, rid: str) -> None:
        self.states.pop(rid, None)


class Eagle3Drafter(EagleDrafter):
    """``--speculative-algorithm EAGLE3 --speculative-draft-model-path HEAD``."""

    name = "EAGLE3"
    version = 3

    def _build(self, config: Any, runner: Any) -> nn.Module:
        target = runner.hf_config
        width = int(getattr(config, "target_hidden_size", None) or target.hidden_size)
        if width != target.hidden_size:
            raise ModelLoadError(f"the EAGLE-3 head reads states {width} wide "
                                 f"(target_hidden_size); the target's are {target.hidden_size}")
        self.target_hidden = aux_layer_ids(config, int(target.num_hidden_layers))
        head = Eagle3Head(config, target_hidden=width,
                          own_embedding=config.hidden_size != target.hidden_size,
                          dtype=runner.dtype, device=runner.device)
        if head.lm_head is None and config.hidden_size != target.hidden_size:
            raise ModelLoadError("an EAGLE-3 head without draft_vocab_size uses the target's "
                                 "LM head, which needs the target's width")
        return head

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        own = self.head.embed_tokens
        return (own if own is not None else self.target.get_input_embeddings())(ids)

    def _logit_states(self, states: torch.Tensor) -> torch.Tensor:
        return self.head.norm(states)[0]

    def _greedy(self, for_logits: torch.Tensor) -> list[int]:
        head: Eagle3Head = self.head  # type: ignore[assignment]
        if head.lm_head is None:
            return super()._greedy(for_logits)
        best = argmax_rows(head.lm_head(for_logits))
        return head.hot_token_ids[best].tolist()
