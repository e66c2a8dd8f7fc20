"""Model architectures: the base class model-family plugins implement."""

from __future__ import annotations

from sgl.models.base import BaseCausalLM
from sgl.models.loading import MappedWeight, load_mapped_weights

__all__ = ["BaseCausalLM", "MappedWeight", "load_mapped_weights"]
