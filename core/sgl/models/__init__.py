"""Model architectures: the base class model-family plugins implement."""

from __future__ import annotations

from sgl.models.base import BaseCausalLM

__all__ = ["BaseCausalLM"]
