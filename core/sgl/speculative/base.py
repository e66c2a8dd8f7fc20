"""The interface of speculative decoding algorithms.

An algorithm only *drafts*: for each running request it proposes the tokens it guesses come
next. The engine (:mod:`sgl.engine.speculative`) runs the request's last token and the draft
through the target model in one forward, samples the target's own token at every position
(with the request's sampling parameters, penalties and grammar) and keeps the draft up to the
first position where the two differ, plus the target's token there. Because a draft is a
guess without probabilities (a one-hot proposal), that is exact rejection sampling: greedy
requests get the tokens they get without speculation, sampled ones the same distribution
(with a seed, the same tokens).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from sgl.config import ServerSettings

__all__ = ["BaseSpeculativeAlgorithm", "DraftRequest", "DraftTree", "TargetStates",
           "check_draft_model_settings"]


@dataclass(frozen=True)
class DraftRequest:
    """What an algorithm sees of one decoding request.

    :param rid: the request's id (stable for its life, also across retraction).
    :param token_ids: its prompt and output so far; the last token is the one this step runs.
    :param max_draft: the most draft tokens the engine verifies for it this step (0: none).
    """

    rid: str
    token_ids: Sequence[int]
    max_draft: int


@dataclass(frozen=True)
class DraftTree:
    """A draft with branches: ``tokens[i]`` follows ``tokens[parents[i]]``, or the request's
    last token where ``parents[i]`` is -1; parents come before their children. The engine
    verifies the whole tree in one forward and follows the branch the target takes."""

    tokens: Sequence[int]
    parents: Sequence[int]


@dataclass(frozen=True)
class TargetStates:
    """The target model's hidden states of the tokens a request just added to its KV cache,
    for algorithms that draft from them (:attr:`BaseSpeculativeAlgorithm.target_hidden`).

    :param rid: the request's id.
    :param row: its row in the target's ``req_to_token`` table, whose entries
        ``[:start + len(hidden)]`` are the KV slots of its positions so far (a prefix-cache hit
        included, whose states the target did not compute).
    :param start: the position of the first of ``hidden``.
    :param hidden: ``[k, width]``, the states of positions ``start .. start + k - 1``.
    :param next_ids: the token that follows each of those positions (``next_ids[i]`` follows
        position ``start + i``; the last is the token the next step runs).
    """

    rid: str
    row: int
    start: int
    hidden: torch.Tensor
    next_ids: Sequence[int]


class BaseSpeculativeAlgorithm(ABC):
    """Proposes draft tokens that the target model verifies in one forward pass.

    Built once per scheduler process, after the target model, with the settings, the
    target's :class:`~sgl.engine.model_runner.ModelRunner` and the plugin manager (whose
    registries load a draft model).
    """

    #: the registered name, for messages
    name: ClassVar[str] = ""
    #: ``--speculative-num-draft-tokens`` when unset (the request's last token included)
    default_num_draft_tokens: ClassVar[int] = 4
    #: ``--speculative-disable-by-batch-size`` when unset: above this many decoding requests
    #: a step runs without speculation
    default_disable_by_batch_size: ClassVar[int] = 8
    #: which of the target's hidden states :meth:`observe` receives after every forward: None
    #: (no calls), ``"final"`` (after the final norm, what the LM head reads) or a tuple of
    #: decoder layer indices (the states entering them, concatenated; the number of layers
    #: names the last layer's output, see ``BaseCausalLM.capture_hidden_layers``). May be set
    #: per instance in ``__init__``.
    target_hidden: str | tuple[int, ...] | None = None
    #: whether it runs with ``--tp-size`` above 1: it drafts without a model of its own and
    #: reads the target only through the runner's ``forward`` and ``logits_at`` (which the
    #: tensor-parallel ranks mirror)
    tensor_parallel: ClassVar[bool] = False

    def __init__(self, *, settings: ServerSettings, runner: Any, num_draft_tokens: int,
                 plugin_manager: Any = None) -> None:
        self.settings = settings
        self.runner = runner
        self.num_draft_tokens = num_draft_tokens
        self.plugin_manager = plugin_manager

    @classmethod
    def draft_tokens(cls, settings: ServerSettings) -> int:
        """``--speculative-num-draft-tokens`` when unset: ``--speculative-num-steps`` + 1 (one
        chain) when that is given, else :attr:`default_num_draft_tokens`."""
        steps = settings.speculative_num_steps
        return steps + 1 if steps else cls.default_num_draft_tokens

    def default_batch_limit(self) -> int:
        """``--speculative-disable-by-batch-size`` when unset, for this model and dtype;
        default: :attr:`default_disable_by_batch_size`."""
        return self.default_disable_by_batch_size

    @classmethod
    def check_settings(cls, settings: ServerSettings) -> str | None:
        """A message naming the flags when ``settings`` combine in a way this algorithm cannot
        run (checked before the model loads); None when they are fine."""
        return None

    @abstractmethod
    def propose(self, reqs: Sequence[DraftRequest]) -> list[list[int] | DraftTree]:
        """Draft tokens for each request, at most ``max_draft`` each: a chain (a list; empty:
        no guess this step) or a :class:`DraftTree` (the engine keeps its first ``max_draft``
        nodes)."""

    def release(self, rid: str) -> None:  # noqa: B027 - optional hook
        """The request finished or gave its memory back; drop what is kept for it."""

    def observe(self, states: Sequence[TargetStates]) -> None:  # noqa: B027 - optional hook
        """After every target forward (before the next draft), with :attr:`target_hidden`
        set: the states of the positions each request of the batch keeps, a prompt chunk, its
        last token and the accepted drafts, in position order. A request absent from a step
        added nothing to its cache."""


def check_draft_model_settings(settings: ServerSettings, name: str, draft: str, *,
                               token_map: bool = False, trees: bool = False) -> str | None:
    """The flag checks of an algorithm with a draft model (``STANDALONE``, ``EAGLE``):
    ``draft`` says what ``--speculative-draft-model-path`` is; ``token_map``: it takes
    ``--speculative-token-map``; ``trees``: it drafts trees too (``--speculative-eagle-topk``
    above 1, whose sizes it checks itself), else only chains."""
    if not settings.speculative_draft_model_path:
        return f"{name} needs --speculative-draft-model-path ({draft})"
    if settings.speculative_token_map and not token_map:
        return (f"{name} takes no --speculative-token-map (the hot vocabulary of an EAGLE "
                "head whose LM head is its target's)")
    if (settings.speculative_eagle_topk or 1) > 1:
        return None if trees else (f"{name} drafts one chain per request "
                                   "(--speculative-eagle-topk 1)")
    steps, tokens = settings.speculative_num_steps, settings.speculative_num_draft_tokens
    if steps is not None and tokens is not None and tokens != steps + 1:
        return (f"with one chain, --speculative-num-draft-tokens ({tokens}) must be "
                f"--speculative-num-steps ({steps}) + 1")
    return None
