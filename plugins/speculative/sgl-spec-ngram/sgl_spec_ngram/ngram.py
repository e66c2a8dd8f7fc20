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

from sgl.speculative import BaseSpeculativeAlgorithm, DraftRequest

if TYPE_CHECKING:
    from sgl.config import ServerSettings

__all__ = ["NgramDrafter", "ngram_draft"]

PLUGIN_ID = "speculative-ngram"


def ngram_draft(tokens: Sequence[int] | np.ndarray, max_draft: int, *, min_window: int = 1,
                max_window: int = 12) -> list[int]:
    """Up to ``max_draft`` tokens that followed the latest earlier occurrence of the longest
    suffix of ``tokens`` (``min_window`` to ``max_window`` tokens long); [] without one."""
    t = np.asarray(tokens, dtype=np.int64)
    n = t.shape[0]
    if max_draft <= 0 or n < 2:
        return []
    ends = np.flatnonzero(t[:n - 1] == t[n - 1])  # earlier places of the last token
    if ends.size == 0:
        return []
    width = min(max_window, n - 1)
    # agree[c, j]: the token j before candidate c equals the token j before the end
    back = np.arange(width)
    before = ends[:, None] - back[None, :]
    valid = before >= 0
    agree = valid & (t[np.where(valid, before, 0)] == t[n - 1 - back][None, :])
    lengths = np.cumprod(agree, axis=1).sum(axis=1)
    best = int(lengths.max())
    if best < min_window:
        return []
    end = int(ends[np.flatnonzero(lengths == best)[-1]])  # the latest of the longest
    return t[end + 1:end + 1 + max_draft].tolist()


class NgramDrafter(BaseSpeculativeAlgorithm):
    """``--speculative-algorithm NGRAM``."""

    name = "NGRAM"
    #: measured on SmolLM2 (docs/benchmarks.md, "Speculative decoding"): bfloat16 gained
    #: 1.26x at 4 decoding requests and lost (0.64x) at 8; float32 still gained 1.15x at 32
    default_num_draft_tokens = 8
    default_disable_by_batch_size = 4

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

    @classmethod
    def check_settings(cls, settings: ServerSettings) -> str | None:
        if settings.speculative_draft_model_path is not None:
            return ("NGRAM drafts from the request's own text and takes no "
                    "--speculative-draft-model-path")
        if settings.speculative_num_steps is not None:
            return ("NGRAM drafts --speculative-num-draft-tokens minus one tokens per step and "
                    "takes no --speculative-num-steps (the depth of a draft model)")
        if (settings.speculative_eagle_topk or 1) > 1:
            return ("NGRAM drafts one chain per request (--speculative-eagle-topk 1); token "
                    "trees are not verified yet")
        options = settings.plugin_settings.get(PLUGIN_ID)
        if options is not None:
            if min(options.min_match_window_size, options.max_match_window_size) < 1:
                return "--speculative-ngram-min/max-match-window-size must be at least 1"
            if options.min_match_window_size > options.max_match_window_size:
                return ("--speculative-ngram-min-match-window-size "
                        f"{options.min_match_window_size} is above "
                        f"--speculative-ngram-max-match-window-size "
                        f"{options.max_match_window_size}")
        return None

    def propose(self, reqs: Sequence[DraftRequest]) -> list[list[int]]:
        return [ngram_draft(r.token_ids, r.max_draft, min_window=self.min_window,
                            max_window=self.max_window) for r in reqs]
