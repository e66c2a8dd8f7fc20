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
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from sgl.engine.batch_builder import BatchSeq, make_forward_batch
from sgl.forward_batch import ForwardMode
from sgl.kernels.cpu import argmax_rows
from sgl.kvcache.pool import KVPool, ReqToTokenPool
from sgl.layers import ParallelLMHead
from sgl.layers.quantized import dense_rows
from sgl.model_loader import ModelLoadError, load_hf_config, open_weights
from sgl.speculative import (
    BaseSpeculativeAlgorithm,
    DraftRequest,
    DraftTree,
    TargetStates,
    check_draft_model_settings,
)
from sgl_spec_eagle.heads import Eagle3Head, EagleHead, aux_layer_ids, head_design

if TYPE_CHECKING:
    from torch import nn

    from sgl.attention.base import BaseAttentionBackend
    from sgl.config import ServerSettings

__all__ = ["Eagle3Drafter", "EagleDrafter"]

logger = logging.getLogger("sgl.speculative.eagle")

#: head forwards per step of a tree (``--speculative-eagle-topk`` above 1) when
#: ``--speculative-num-steps`` is not given
DEFAULT_TREE_STEPS = 3


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


def _top_k(logits: torch.Tensor, k: int,
           ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` likeliest columns of each row of ``logits``: log-probabilities (zeros for
    ``k == 1``, where greedy chains need none) and token ids (``ids[column]``, or the column)."""
    if k == 1:
        logp, best = logits.new_zeros(logits.shape[0], 1), argmax_rows(logits).view(-1, 1)
    else:
        logp, best = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
    return logp, best if ids is None else ids[best]


class _Beams:
    """One request's beam search: every candidate (token, parent candidate or -1, path
    log-probability, level), the current beams, and the beams that are head nodes."""

    def __init__(self, logp: list[float], ids: list[int]) -> None:
        self.token, self.parent, self.score, self.level = list(ids), [-1] * len(ids), \
            list(logp), [0] * len(ids)
        self.beams = list(range(len(ids)))
        self.nodes: list[int] = []  # candidates run through the head, in order
        self.node_of: dict[int, int] = {}  # candidate -> its index in nodes

    def grow(self) -> None:
        for c in self.beams:
            self.node_of[c] = len(self.nodes)
            self.nodes.append(c)

    def expand(self, logp: list[list[float]], ids: list[list[int]]) -> None:
        """The newest beams' children (``logp[b]``, ``ids[b]`` for beam ``b``); the ``topk``
        likeliest become the beams."""
        children = []
        for beam, row_logp, row_ids in zip(self.beams, logp, ids):
            for lp, token in zip(row_logp, row_ids):
                children.append(len(self.token))
                self.token.append(token)
                self.parent.append(beam)
                self.score.append(self.score[beam] + lp)
                self.level.append(self.level[beam] + 1)
        children.sort(key=lambda c: -self.score[c])
        self.beams = children[:len(self.beams)]

    def draft(self, size: int) -> DraftTree:
        """The ``size`` likeliest candidates whose parents are taken too, level by level."""
        taken: set[int] = set()
        for c in sorted(range(len(self.token)), key=lambda c: (-self.score[c], c)):
            if len(taken) == size:
                break
            if self.parent[c] < 0 or self.parent[c] in taken:
                taken.add(c)
        order = sorted(taken, key=lambda c: (self.level[c], -self.score[c], c))
        index = {c: i for i, c in enumerate(order)}
        return DraftTree([self.token[c] for c in order],
                         [index[self.parent[c]] if self.parent[c] >= 0 else -1 for c in order])


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
        self.topk = settings.speculative_eagle_topk or 1
        self.steps = settings.speculative_num_steps or DEFAULT_TREE_STEPS
        #: scratch slots per request row: its draft positions (a chain), or the beams a tree
        #: expands (``topk`` at each step but the last)
        self.scratch_per_row = max(num_draft_tokens, self.topk * (self.steps - 1))
        self.target = runner.model
        self.head = self._build(config, runner)
        self.head.eval()
        #: the target ids of --speculative-token-map's hot vocabulary and the LM head's rows
        #: for them (None: the full vocabulary)
        self.hot: torch.Tensor | None = None
        self.hot_head: ParallelLMHead | None = None
        if settings.speculative_token_map:
            self.hot, self.hot_head = self._hot_vocabulary(settings.speculative_token_map,
                                                           runner)
        self.head.load_weights(open_weights(path, runner.dtype))
        for module in self.head.modules():  # the CPU matmuls' packed weights
            process = getattr(module, "process_weights_after_loading", None)
            if callable(process):
                process()
        self.memory = self._memory(config, runner, settings.attention_backend,
                                   plugin_manager.registries)
        #: the first scratch slot; row r drafts at ``scratch + r * scratch_per_row + j``
        self.scratch = runner.kv_pool.size + 1
        self.states: dict[str, _State] = {}
        logger.info("%s head %s: %d layer(s), KV %.1f MiB at the target's slots (+%d scratch), "
                    "%s", self.name, config.name_or_path or path, self.head.num_layers,
                    self.memory.kv_pool.size * self._bytes_per_token / 2**20,
                    self.memory.kv_pool.size - runner.kv_pool.size,
                    "chains" if self.topk == 1 else f"trees ({self.steps} steps, top-{self.topk}, "
                    f"{num_draft_tokens - 1} nodes)")

    @classmethod
    def check_settings(cls, settings: ServerSettings) -> str | None:
        topk = settings.speculative_eagle_topk or 1
        problem = check_draft_model_settings(settings, cls.name, f"the {cls.name} head",
                                             token_map=cls.version == 1, trees=True)
        if not problem and settings.speculative_token_map \
                and not Path(settings.speculative_token_map).is_file():
            problem = f"--speculative-token-map {settings.speculative_token_map}: no such file"
        if problem or topk == 1:
            return problem
        steps = settings.speculative_num_steps or DEFAULT_TREE_STEPS
        tokens = settings.speculative_num_draft_tokens
        most = topk + (steps - 1) * topk * topk  # every candidate of the beam search
        if tokens is not None and tokens - 1 > most:
            return (f"--speculative-num-draft-tokens ({tokens}) is more than a tree of "
                    f"--speculative-num-steps {steps} and --speculative-eagle-topk {topk} "
                    f"offers: at most topk + (num_steps - 1) * topk^2 + 1 = {most + 1}")
        return None

    @classmethod
    def draft_tokens(cls, settings: ServerSettings) -> int:
        """A chain: ``num_steps + 1``; a tree: one node per beam and step, ``num_steps * topk``
        drafted."""
        topk = settings.speculative_eagle_topk or 1
        if topk == 1:
            return super().draft_tokens(settings)
        return 1 + (settings.speculative_num_steps or DEFAULT_TREE_STEPS) * topk

    # building ----------------------------------------------------------------------------------

    def _build(self, config: Any, runner: Any) -> nn.Module:
        """The head for ``config``, checked against the target; sets :attr:`target_hidden`."""
        width = int(runner.hf_config.hidden_size)
        if config.hidden_size != width:
            raise ModelLoadError(f"the EAGLE head is {config.hidden_size} wide and the target "
                                 f"{width}; an EAGLE head reads the target's hidden states")
        self.target_hidden = "final"
        return EagleHead(config, dtype=runner.dtype, device=runner.device)

    @staticmethod
    def _hot_vocabulary(path: str, runner: Any) -> tuple[torch.Tensor, ParallelLMHead]:
        """SGLang's token map (a ``.pt`` file of token ids, FR-Spec): the ids and an LM head of
        the target's rows for them."""
        try:
            ids = torch.as_tensor(torch.load(path, map_location="cpu", weights_only=True))
        except Exception as exc:
            raise ModelLoadError(f"--speculative-token-map {path}: cannot read it as a tensor "
                                 f"of token ids ({exc})") from exc
        vocab = runner.vocab_size
        if (ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point()
                or int(ids.min()) < 0 or int(ids.max()) >= vocab
                or ids.unique().numel() != ids.numel()):
            raise ModelLoadError(f"--speculative-token-map {path}: expected distinct token ids "
                                 f"in [0, {vocab}) as a 1-D tensor, got {tuple(ids.shape)} "
                                 f"{ids.dtype}")
        full = runner.model.get_output_embeddings()
        head = ParallelLMHead(ids.numel(), full.embedding_dim, dtype=full.weight_dtype,
                              device=full.weight.device, logit_softcap=full.logit_softcap)
        with torch.no_grad():  # a quantized LM head's rows are dequantized
            head.weight.copy_(dense_rows(full, ids.to(full.weight.device)))
        head.process_weights_after_loading()
        logger.info("EAGLE drafts from a hot vocabulary of %d tokens (%s)", ids.numel(), path)
        return ids.to(torch.int64).to(runner.device), head

    def _memory(self, config: Any, runner: Any, backend: str, registries: Any) -> _HeadMemory:
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        rows = runner.req_to_token_pool
        pool = KVPool(size=runner.kv_pool.size + rows.max_requests * self.scratch_per_row,
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

    def _top(self, for_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` likeliest next tokens of each row: log-probabilities and target ids."""
        if self.hot_head is None:
            return _top_k(self.target.compute_logits(for_logits), k, None)
        return _top_k(self.hot_head(for_logits), k, self.hot)

    # the algorithm -----------------------------------------------------------------------------

    @torch.inference_mode()
    def observe(self, states: Sequence[TargetStates]) -> None:
        seqs, slots, features, kept = [], [], [], []
        table = self.runner.req_to_token_pool.req_to_token
        for s in states:
            k = min(s.hidden.shape[0], len(s.next_ids))  # each position needs its next token
            if k <= 0:
                continue
            state = self.states.get(s.rid)
            prefix = None
            if state is None or state.length != s.start or state.row != s.row:
                # new here (or after a failure): the prefix's KV is the one at its slots
                state = self.states[s.rid] = _State(s.row, s.start)
                prefix = table[s.row, :s.start]
            seqs.append(BatchSeq(s.row, s.start, list(s.next_ids[:k]), prefix_slots=prefix))
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
    def propose(self, reqs: Sequence[DraftRequest]) -> list[list[int] | DraftTree]:
        drafts: list[list[int] | DraftTree] = [[] for _ in reqs]
        active = [(i, state, r.max_draft) for i, r in enumerate(reqs)
                  if r.max_draft > 0 and (state := self.states.get(r.rid)) is not None
                  and state.last is not None and state.length == len(r.token_ids) - 1]
        # a tree's beams take table entries beyond the request's positions (one each):
        # requests near the end of the context draft a chain
        limit = self.memory.req_to_token_pool.max_context_len - self.topk * (self.steps - 1)
        trees = [a for a in active if self.topk > 1 and a[1].length <= limit]
        chains = [a for a in active if not (self.topk > 1 and a[1].length <= limit)]
        if chains:
            self._chains(drafts, chains, torch.stack([state.last for _, state, _ in chains]))
        if trees:
            self._trees(drafts, trees, torch.stack([state.last for _, state, _ in trees]))
        return drafts

    def _slot(self, state: _State, j: int) -> int:
        return self.scratch + state.row * self.scratch_per_row + j

    def _chains(self, drafts: list[Any], active: list[tuple[int, _State, int]],
                current: torch.Tensor) -> None:
        """Greedy chains: each token after the first from one decode forward of the head."""
        for_logits = self._logit_states(current)
        step = 0
        while True:
            for (i, _, _), token in zip(active, self._top(for_logits, 1)[1].view(-1).tolist()):
                drafts[i].append(token)
            keep = [j for j, (i, _, most) in enumerate(active) if len(drafts[i]) < most]
            if not keep:
                return
            active, current = [active[j] for j in keep], current[keep]
            seqs = [BatchSeq(state.row, state.length + step, [drafts[i][-1]])
                    for i, state, _ in active]
            slots = torch.tensor([self._slot(state, step) for _, state, _ in active])
            for_logits, current = self._forward(ForwardMode.DECODE, seqs, slots, current,
                                                from_target=False)
            step += 1

    def _trees(self, drafts: list[Any], active: list[tuple[int, _State, int]],
               roots: torch.Tensor) -> None:
        """EAGLE's beam search, SGLang's ``--speculative-eagle-topk``: the ``topk`` likeliest
        tokens from the kept state are the first beams; each step runs the head once over
        every beam so far (a forest over the request's cached positions, recomputing the
        earlier beams, which costs little and keeps no per-step KV), expands the newest
        beams by their ``topk`` likeliest tokens each, and keeps the ``topk`` candidates of
        highest path probability as the next beams. The draft is the ``num_draft_tokens - 1``
        likeliest candidates of all steps (each one's parent among them: a path probability
        never grows), level by level."""
        k = self.topk
        logp, ids = self._top(self._logit_states(roots), k)
        trees = [_Beams(logp[j].tolist(), ids[j].tolist()) for j in range(len(active))]
        outputs: list[torch.Tensor] = []  # per request: the head's output state of each beam
        for step in range(1, self.steps):
            seqs, slots, inputs = [], [], []
            for j, (_, state, _) in enumerate(active):
                tree = trees[j]
                tree.grow()  # the newest beams become head nodes
                parents = [tree.node_of[tree.parent[c]] if tree.parent[c] >= 0 else -1
                           for c in tree.nodes]
                seqs.append(BatchSeq(state.row, state.length, [tree.token[c] for c in tree.nodes],
                                     tree_parents=parents))
                slots.extend(self._slot(state, n) for n in range(len(tree.nodes)))
                inputs.append(torch.stack([roots[j] if p < 0 else outputs[j][p]
                                           for p in parents]))
            for_logits, after = self._forward(ForwardMode.EXTEND, seqs, torch.tensor(slots),
                                              torch.cat(inputs), from_target=False)
            logp, ids = self._top(for_logits, k)
            outputs, end = [], 0
            for tree, seq in zip(trees, seqs):
                n = len(seq.token_ids)
                outputs.append(after[end:end + n])
                tree.expand(logp[end + n - k:end + n].tolist(), ids[end + n - k:end + n].tolist())
                end += n
        for tree, (i, _, most) in zip(trees, active):
            drafts[i] = tree.draft(min(most, self.num_draft_tokens - 1))

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

    def _top(self, for_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        head: Eagle3Head = self.head  # type: ignore[assignment]
        if head.lm_head is None:
            return super()._top(for_logits, k)
        return _top_k(head.lm_head(for_logits), k, head.hot_token_ids)
