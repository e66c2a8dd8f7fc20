"""Drafts from the request's own text: the longest recent n-gram that occurred before, and
what followed it there.

For a request whose tokens are ``t[0..L)``, every earlier position ``p`` with ``t[p] ==
t[L-1]`` is a candidate; its match length is how many tokens before ``p`` and before ``L-1``
agree (up to ``max_match_window_size``). The candidate with the longest match (at least
``min_match_window_size``; the latest among equals) proposes ``t[p+1 : p+1+k]``. The search is
a few vectorised numpy comparisons per request and step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from sgl.speculative import BaseSpeculativeAlgorithm, DraftRequest, DraftTree

if TYPE_CHECKING:
    from sgl.config import ServerSettings

__all__ = ["NgramDrafter", "ngram_draft", "ngram_tree"]

PLUGIN_ID = "speculative-ngram"


def _matches(t: np.ndarray, min_window: int, max_window: int) -> list[int]:
    """Earlier places ``p`` with ``t[p] == t[-1]`` whose match with the end is at least
    ``min_window`` long, best first: longest match, then latest."""
    n = t.shape[0]
    ends = np.flatnonzero(t[:n - 1] == t[n - 1])  # earlier places of the last token
    if ends.size == 0:
        return []
    width = min(max_window, n - 1)
    back = np.arange(width)
    before = ends[:, None] - back[None, :]
    valid = before >= 0
    agree = valid & (t[np.where(valid, before, 0)] == t[n - 1 - back][None, :])
    lengths = np.cumprod(agree, axis=1).sum(axis=1)
    order = np.lexsort((-ends, -lengths))  # longest first, then latest
    return [int(ends[i]) for i in order if lengths[i] >= min_window]


def ngram_tree(tokens: Sequence[int] | np.ndarray, max_draft: int, *, breadth: int,
               min_window: int = 1, max_window: int = 12) -> DraftTree | list[int]:
    """The continuations of the ``breadth`` best matches with distinct first tokens, merged
    into one tree of at most ``max_draft`` nodes (level by level, best match first); a chain
    (a list) when only one is found."""
    t = np.asarray(tokens, dtype=np.int64)
    if max_draft <= 0 or t.shape[0] < 2:
        return []
    branches: list[list[int]] = []
    firsts: set[int] = set()
    for end in _matches(t, min_window, max_window):
        cont = t[end + 1:end + 1 + max_draft].tolist()
        if cont and cont[0] not in firsts:
            firsts.add(cont[0])
            branches.append(cont)
            if len(branches) == breadth:
                break
    if len(branches) <= 1:
        return branches[0] if branches else []
    node_tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, ...], int] = {}  # prefix of a branch -> its node
    for depth in range(max_draft):
        for branch in branches:
            if depth >= len(branch) or len(node_tokens) >= max_draft:
                continue
            key = tuple(branch[:depth + 1])
            if key in index:
                continue
            parent = index.get(key[:-1], -1) if depth else -1
            if depth and key[:-1] not in index:
                continue  # its parent did not fit
            index[key] = len(node_tokens)
            node_tokens.append(branch[depth])
            parents.append(parent)
    return DraftTree(node_tokens, parents)


def ngram_draft(tokens: Sequence[int] | np.ndarray, max_draft: int, *, min_window: int = 1,
                max_window: int = 12) -> list[int]:
    """Up to ``max_draft`` tokens that followed the latest earlier occurrence of the longest
    suffix of ``tokens`` (``min_window`` to ``max_window`` tokens long); [] without one."""
    t = np.asarray(tokens, dtype=np.int64)
    if max_draft <= 0 or t.shape[0] < 2:
        return []
    found = _matches(t, min_window, max_window)
    return t[found[0] + 1:found[0] + 1 + max_draft].tolist() if found else []


class NgramDrafter(BaseSpeculativeAlgorithm):
    """``--speculative-algorithm NGRAM``."""

    name = "NGRAM"
    #: measured on SmolLM2 (docs/benchmarks.md, "Speculative decoding"): bfloat16 gained
    #: 1.26x at 4 decoding requests and lost (0.64x) at 8; float32 still gained 1.15x at 32
    default_num_draft_tokens = 8
    default_disable_by_batch_size = 4
    tensor_parallel = True  # drafts from the request's tokens, no model

    def default_batch_limit(self) -> int:
        import torch

        return 32 if self.runner.dtype == torch.float32 else self.default_disable_by_batch_size

    def __init__(self, *, settings: ServerSettings, runner: Any, num_draft_tokens: int,
                 plugin_manager: Any = None) -> None:
        super().__init__(settings=settings, runner=runner, num_draft_tokens=num_draft_tokens,
                         plugin_manager=plugin_manager)
        options = settings.plugin_settings.get(PLUGIN_ID)
        self.min_window = options.min_match_window_size if options else 1
        self.max_window = options.max_match_window_size if options else 12
        self.breadth = options.max_bfs_breadth if options else 1

    @classmethod
    def check_settings(cls, settings: ServerSettings) -> str | None:
        if settings.speculative_draft_model_path is not None:
            return ("NGRAM drafts from the request's own text and takes no "
                    "--speculative-draft-model-path")
        if settings.speculative_token_map is not None:
            return "NGRAM drafts from the request's own text and takes no --speculative-token-map"
        if settings.speculative_num_steps is not None:
            return ("NGRAM drafts --speculative-num-draft-tokens minus one tokens per step and "
                    "takes no --speculative-num-steps (the depth of a draft model)")
        if (settings.speculative_eagle_topk or 1) > 1:
            return ("NGRAM's trees come from --speculative-ngram-max-bfs-breadth; "
                    "--speculative-eagle-topk is for EAGLE")
        options = settings.plugin_settings.get(PLUGIN_ID)
        if options is not None:
            if options.max_bfs_breadth < 1:
                return "--speculative-ngram-max-bfs-breadth must be at least 1"
            if min(options.min_match_window_size, options.max_match_window_size) < 1:
                return "--speculative-ngram-min/max-match-window-size must be at least 1"
            if options.min_match_window_size > options.max_match_window_size:
                return ("--speculative-ngram-min-match-window-size "
                        f"{options.min_match_window_size} is above "
                        f"--speculative-ngram-max-match-window-size "
                        f"{options.max_match_window_size}")
        return None

    def propose(self, reqs: Sequence[DraftRequest]) -> list[list[int] | DraftTree]:
        if self.breadth > 1:
            return [ngram_tree(r.token_ids, r.max_draft, breadth=self.breadth,
                               min_window=self.min_window, max_window=self.max_window)
                    for r in reqs]
        return [ngram_draft(r.token_ids, r.max_draft, min_window=self.min_window,
                            max_window=self.max_window) for r in reqs]
