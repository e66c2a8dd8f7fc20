"""Speculative decoding in the scheduler: draft, verify in one target forward, accept.

A decode step with speculation on (``--speculative-algorithm``) goes:

1. **draft** (:meth:`SpeculativeDecoding.draft`, while scheduling): the algorithm plugin
   proposes up to ``num_draft_tokens - 1`` tokens for each decoding request (``req.draft``),
   within the KV slots that are free; requests it has no guess for decode as usual, in the
   same batch. Above ``--speculative-disable-by-batch-size`` decoding requests the step runs
   without drafts.
2. **verify** (the forward): each request runs its last token and its draft as one extend
   (causal over the chain), so row ``i`` of its hidden states is the target's next-token
   distribution after the first ``i`` draft tokens.
3. **accept** (:meth:`SpeculativeDecoding.verify`): at every row the target's token is
   sampled as the sampler would sample it without speculation: the same penalties (over the
   output plus the draft before that row), logit bias, EOS ban before ``min_new_tokens``,
   grammar mask (the matcher walks the draft and is rolled back), temperature, top-k/p,
   min-p, and the same seeded noise (step = output length + ``i``). The draft is kept up to
   the first row where the target's token differs, and the target's token there is added.
   For a draft without probabilities (one-hot proposal q) that is rejection sampling exactly:
   the draft token d is kept with probability p(d), else the token is a draw from p without
   d, renormalised (``norm(max(p - q, 0))``). So greedy and seeded requests produce the very
   tokens they produce without speculation.

The scheduler then takes the accepted tokens one by one through its usual path (logprobs,
grammar, stop checks), so an output ends exactly where it would have; the KV of the draft
tokens it did not keep goes back to the pool at once (:func:`settle_draft`).
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sgl.engine.extension import SchedulerExtension, SchedulerView
from sgl.engine.logprobs import LogprobRows
from sgl.engine.sampler import SamplingInput, sample_next_tokens
from sgl.speculative import BaseSpeculativeAlgorithm, DraftRequest, DraftTree, TargetStates

if TYPE_CHECKING:
    from sgl.config import ServerSettings
    from sgl.engine.schedule_policy import ScheduledBatch
    from sgl.engine.sequence import Req

__all__ = ["SpecStats", "SpeculativeDecoding", "Verified", "settle_draft"]

logger = logging.getLogger("sgl.speculative")


@dataclass
class SpecStats:
    """Server-wide counts since start-up."""

    verify_steps: int = 0  # request-steps that ran with speculation on
    verified_tokens: int = 0  # tokens those steps produced (accepted drafts + one each)
    proposed_drafts: int = 0
    accepted_drafts: int = 0

    def info(self) -> dict[str, Any]:
        return {"spec_verify_ct": self.verify_steps,
                "spec_num_proposed_drafts": self.proposed_drafts,
                "spec_num_correct_drafts": self.accepted_drafts,
                "avg_spec_accept_length": (self.verified_tokens / self.verify_steps
                                           if self.verify_steps else None)}


@dataclass
class Verified:
    """The outcome of one request's verification: the tokens to append (the accepted draft
    tokens, then the target's token), the accepted draft tokens' indices in ``req.draft``
    (``path``; ``0, 1, ...`` for a chain), the row of each token's logprobs in ``logprobs``
    (None without return_logprob) and the hidden-state rows of the tokens whose KV stays."""

    req: Req
    tokens: list[int]
    path: list[int]
    logprobs: LogprobRows | None
    logprob_rows: list[int] | None
    #: the rows of ``hidden`` of the request's last token and of each token of ``path``
    hidden_rows: list[int]

    @property
    def accepted(self) -> int:
        return len(self.path)


def settle_draft(req: Req, keep: Sequence[int], free: Callable[[torch.Tensor], None],
                 table: torch.Tensor) -> None:
    """After verification: the KV of the draft tokens ``keep`` (indices into ``req.draft``, in
    sequence order) stays, at the request's next positions (a tree's accepted branch need not
    be the first slots); the slots of the rest are freed."""
    slots = req.draft_slots
    if slots is not None:
        kept = slots[list(keep)] if keep else slots[:0]
        if kept.numel():
            table[req.row, req.kv_len:req.kv_len + kept.numel()] = kept
        mask = torch.ones(slots.numel(), dtype=torch.bool)
        mask[list(keep)] = False
        if bool(mask.any()):
            free(slots[mask])
        req.kv_len += kept.numel()
    req.draft, req.draft_parents, req.draft_slots = None, None, None


def _path(parents: Sequence[int] | None, node: int) -> list[int]:
    """Draft indices from the root's child down to ``node`` (-1: the root itself)."""
    if parents is None:
        return list(range(node + 1))
    path = []
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


def _first_chain(parents: Sequence[int]) -> list[int]:
    """The tree's chain of first children from the root."""
    chain, current = [], -1
    for i, p in enumerate(parents):
        if p == current:
            chain.append(i)
            current = i
    return chain


class SpeculativeDecoding(SchedulerExtension):
    """The scheduler's side of ``--speculative-algorithm``: the algorithm plugin, the draft
    budget of each step and the acceptance of drafts (a scheduler extension of the core)."""

    name = "speculative"
    plain_decode = False  # its verify batches are what decode

    @classmethod
    def enabled(cls, settings: ServerSettings) -> bool:
        return settings.speculative_algorithm is not None

    def __init__(self, scheduler: SchedulerView) -> None:
        super().__init__(scheduler)
        settings, pm, runner = scheduler.settings, scheduler.plugins, scheduler.runner
        name = settings.speculative_algorithm
        cls: type[BaseSpeculativeAlgorithm] = pm.registries.speculative.load(name)
        if not (isinstance(cls, type) and issubclass(cls, BaseSpeculativeAlgorithm)):
            raise TypeError(f"speculative algorithm {name!r} is {cls!r}, not a subclass of "
                            "sgl.speculative.BaseSpeculativeAlgorithm")
        self.algorithm_name = name
        self.runner = runner
        self.num_draft_tokens = settings.speculative_num_draft_tokens \
            or cls.draft_tokens(settings)
        self.algorithm = cls(settings=settings, runner=runner,
                             num_draft_tokens=self.num_draft_tokens, plugin_manager=pm)
        self.disable_by_batch_size = settings.speculative_disable_by_batch_size \
            or self.algorithm.default_batch_limit()
        self.stats = SpecStats()
        self.target_hidden = self.algorithm.target_hidden
        if isinstance(self.target_hidden, tuple):
            try:
                runner.model.capture_hidden_layers(self.target_hidden)
            except (NotImplementedError, ValueError) as exc:
                raise ValueError(f"{name} drafts from the hidden states entering the target's "
                                 f"layers {list(self.target_hidden)}: {exc}") from exc
        elif self.target_hidden not in (None, "final"):
            raise ValueError(f"speculative algorithm {name!r} asks for target_hidden "
                             f"{self.target_hidden!r}; expected None, 'final' or layer indices")
        #: this step's (request, rows of the hidden states of the positions it kept)
        self._kept: list[tuple[Req, Sequence[int]]] = []
        logger.info("speculative decoding: %s, %d draft tokens per request and step, off above "
                    "%d decoding requests", name, self.num_draft_tokens - 1,
                    self.disable_by_batch_size)

    def add_draft_tokens(self, decodes: Sequence[Req], free_slots: int) -> int:
        """Set ``req.draft`` for the decoding requests (within ``free_slots`` KV slots);
        returns the number of draft tokens."""
        context_length = self.runner.context_length
        if not decodes or len(decodes) > self.disable_by_batch_size or free_slots <= 0:
            return 0
        asks = []
        for req in decodes:
            room = min(self.num_draft_tokens - 1, req.remaining_new_tokens() - 1,
                       context_length - req.seq_len - 1)
            asks.append(DraftRequest(req.rid, req.input_ids + req.output_ids, max(room, 0)))
        try:
            drafts = self.algorithm.propose(asks)
        except Exception:  # a broken draft costs speed, never a request: none this step
            logger.error("speculative algorithm %s failed to draft for %d requests; they "
                         "decode without drafts this step:\n%s", self.algorithm_name, len(asks),
                         traceback.format_exc())
            for ask in asks:
                self.algorithm.release(ask.rid)
            drafts = [[] for _ in asks]
        used = 0
        for req, ask, draft in zip(decodes, asks, drafts):
            tokens, parents = self._checked(draft, min(ask.max_draft, free_slots - used), req)
            req.draft = tokens  # possibly empty: verified alone, as a plain decode
            req.draft_parents = parents
            used += len(tokens)
        return used

    def _checked(self, draft: list[int] | DraftTree, room: int,
                 req: Req) -> tuple[list[int], list[int] | None]:
        """A draft cut to ``room`` tokens, as (tokens, parents or None for a chain); a tree
        becomes its first chain for a request with a grammar. A malformed draft (a token
        outside the vocabulary, a parent after its child) is logged and dropped: a broken
        algorithm costs speed, never a request."""
        parents: list[int] | None = None
        if isinstance(draft, DraftTree):
            tokens = [int(t) for t in list(draft.tokens)[:room]]
            parents = [int(p) for p in list(draft.parents)[:len(tokens)]]
            if len(parents) != len(tokens) or any(not -1 <= p < i
                                                  for i, p in enumerate(parents)):
                logger.error("speculative algorithm %s drafted a tree whose parents do not come "
                             "before their children (%s); dropped", self.algorithm_name, parents)
                return [], None
            if req.grammar is not None:  # the matcher walks chains: the first one
                tokens = [tokens[i] for i in _first_chain(parents)]
                parents = None
            elif all(p == i - 1 for i, p in enumerate(parents)):
                parents = None  # a chain after all
        else:
            tokens = [int(t) for t in list(draft)[:room]]
        if any(not 0 <= t < self.runner.vocab_size for t in tokens):
            logger.error("speculative algorithm %s drafted a token id outside the vocabulary "
                         "(%s); dropped", self.algorithm_name, tokens)
            return [], None
        return tokens, parents if tokens else None

    def verify(self, items: Sequence[tuple[Req, int]], hidden: torch.Tensor) -> None:
        """Verify the drafts of ``(request, its first row)`` pairs and take the accepted tokens;
        a failure fails only the request it concerns."""
        s = self.scheduler
        try:
            verified = self.accept(items, hidden)
        except Exception:
            if len(items) == 1:
                raise
            logger.error("verifying %d drafts failed, verifying each alone:\n%s", len(items),
                         traceback.format_exc())
            for item in items:
                s.guarded(item[0], "verifying its draft", self.verify, [item], hidden)
            return
        now = time.time()
        for v in verified:
            s.guarded(v.req, "taking its verified tokens", self.take_verified, v, now)
            settle_draft(v.req, [], s.runner.kv_pool.free,
                         s.runner.req_to_token_pool.req_to_token)  # if that failed half-way

    def take_verified(self, v: Verified, now: float) -> None:
        """Append a request's verified tokens one by one, each through the scheduler's
        ``take_token``, until one ends the output (or the grammar appends jump-forward tokens);
        keep the KV of the draft tokens that made it into the output."""
        req, appended = v.req, 0
        for j, token in enumerate(v.tokens):
            length = len(req.output_ids)
            req.output_ids.append(token)
            req.first_token_time = req.first_token_time or now
            appended += 1
            self.scheduler.take_token(req, token, v.logprobs,
                                      v.logprob_rows[j] if v.logprob_rows is not None else None)
            if req.finished or len(req.output_ids) != length + 1:
                break
        assert req.draft is not None
        self.count(req, len(req.draft), v.accepted, appended)
        keep = v.path[:appended]
        settle_draft(req, keep, self.runner.kv_pool.free,
                     self.runner.req_to_token_pool.req_to_token)
        self.kept(req, v.hidden_rows[:1 + len(keep)])

    def accept(self, items: Sequence[tuple[Req, int]], hidden: torch.Tensor
               ) -> list[Verified]:
        """Accept the drafts of ``(request, its first row in hidden)`` pairs (see the module
        docstring); nothing about a request changes here."""
        firsts, rows = [], []
        for req, start in items:
            firsts.append(len(rows))
            rows.extend(range(start, start + 1 + len(req.draft)))
        logits = self.runner.logits_at(hidden, torch.tensor(rows, dtype=torch.int64))
        wants = [j for (req, _), first in zip(items, firsts) if req.logprobs.return_logprob
                 for j in range(first, first + 1 + len(req.draft))]
        lp = LogprobRows(logits[wants]) if wants else None  # the model's, before the grammar
        lp_row = {j: i for i, j in enumerate(wants)}
        self.scheduler.grammar.constrain_drafts(
            [(req, first) for (req, _), first in zip(items, firsts) if req.grammar is not None],
            logits)
        params, seeds, steps, outputs, prompts, bans = [], [], [], [], [], []
        for req, _ in items:
            for node in range(-1, len(req.draft)):  # the root's row, then each draft token's
                before = [req.draft[j] for j in _path(req.draft_parents, node)]
                params.append(req.sampling)
                seeds.append(req.seed)
                steps.append(len(req.output_ids) + len(before))
                outputs.append(req.output_ids + before if before else req.output_ids)
                prompts.append(req.input_ids)
                bans.append(self.scheduler.banned(req, len(req.output_ids) + len(before)))
        targets = sample_next_tokens(logits, SamplingInput(
            params=params, seeds=seeds, steps=steps, output_ids=outputs, prompt_ids=prompts,
            banned=bans)).tolist()
        verified = []
        for (req, start), first in zip(items, firsts):
            parents = req.draft_parents
            path, node = [], -1
            while True:  # follow the child the target's token names, while there is one
                target = targets[first + 1 + node]
                children = [c for c in range(node + 1, len(req.draft))
                            if (parents[c] if parents is not None else c - 1) == node]
                child = next((c for c in children if req.draft[c] == target), None)
                if child is None:
                    break
                path.append(child)
                node = child
            tokens = [req.draft[c] for c in path] + [int(target)]
            rows = [first] + [first + 1 + c for c in path]
            lp_rows = [lp_row[r] for r in rows] if req.logprobs.return_logprob else None
            verified.append(Verified(req, tokens, path, lp, lp_rows,
                                     [start] + [start + 1 + c for c in path]))
        return verified

    def count(self, req: Req, proposed: int, accepted: int, appended: int) -> None:
        """Record one verification of ``req`` (its own counts and the server's)."""
        req.spec_verify_ct += 1
        req.spec_tokens += appended
        req.spec_proposed += proposed
        req.spec_accepted += accepted
        self.stats.verify_steps += 1
        self.stats.verified_tokens += appended
        self.stats.proposed_drafts += proposed
        self.stats.accepted_drafts += accepted

    def kept(self, req: Req, rows: Sequence[int]) -> None:
        """``req`` keeps the KV of the tokens in these rows of this step's hidden states (its
        last ``len(rows)`` positions); :meth:`observe` hands their states to the algorithm."""
        if self.target_hidden is not None and rows:
            self._kept.append((req, rows))

    def batch_ran(self, batch: ScheduledBatch, hidden: torch.Tensor) -> None:
        """The requests without a draft keep the KV of all the tokens they ran."""
        offsets = batch.offsets()
        for i, req in enumerate(batch.reqs):
            if req.draft is None:
                self.kept(req, range(offsets[i], offsets[i + 1]))

    def batch_failed(self) -> None:
        """Forget this step's kept positions (its result was not processed)."""
        self._kept = []

    def batch_done(self, batch: ScheduledBatch, hidden: torch.Tensor) -> None:
        """End of a step: the algorithm gets the target's states of the positions kept (see
        :meth:`kept`); if it fails, the requests concerned lose their drafting state (their
        drafts then start afresh), never their output."""
        kept, self._kept = self._kept, []
        kept = [(req, rows) for req, rows in kept if req.row is not None]
        if not kept:
            return
        try:
            source = hidden if self.target_hidden == "final" \
                else self.runner.model.captured_hidden
            if source is None:
                raise RuntimeError("the target model kept no hidden states of its layers")
            self.algorithm.observe([
                TargetStates(req.rid, req.row, req.kv_len - len(rows),
                             source.index_select(0, torch.tensor(list(rows), dtype=torch.int64,
                                                                 device=source.device)),
                             req.token_slice(req.kv_len - len(rows) + 1, req.kv_len + 1))
                for req, rows in kept])
        except Exception:
            logger.error("speculative algorithm %s failed to take the target's states of %d "
                         "requests; their drafting starts afresh:\n%s", self.algorithm_name,
                         len(kept), traceback.format_exc())
            for req, _ in kept:
                self.algorithm.release(req.rid)

    def released(self, req: Req) -> None:
        self.algorithm.release(req.rid)

    def info(self) -> dict[str, Any]:
        return {"speculative_algorithm": self.algorithm_name,
                "speculative_num_draft_tokens": self.num_draft_tokens,
                "speculative_disable_by_batch_size": self.disable_by_batch_size,
                **self.stats.info()}
