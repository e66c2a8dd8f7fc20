"""Speculative decoding: the base class algorithm plugins implement."""

from __future__ import annotations

from sgl.speculative.base import (
    BaseSpeculativeAlgorithm,
    DraftRequest,
    DraftTree,
    TargetStates,
    check_draft_model_settings,
)

__all__ = ["BaseSpeculativeAlgorithm", "DraftRequest", "DraftTree", "TargetStates",
           "check_draft_model_settings"]
