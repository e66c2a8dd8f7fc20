"""The interface every model architecture implements."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from sgl.forward_batch import ForwardBatch

__all__ = ["BaseCausalLM"]


class BaseCausalLM(nn.Module):
    """A decoder-only language model that runs on ragged batches over the paged KV pool.

    Constructed as ``cls(config, dtype=..., device=...)`` on the target device with
    uninitialised weights, then filled by :meth:`load_weights` tensor by tensor. After that the
    runner calls ``process_weights_after_loading()`` on every submodule that defines it (the
    linear layers use it to prepare their CPU matmul weights; see ``sgl.layers.packed_linear``).
    """

    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = device
        #: after each forward, with :meth:`capture_hidden_layers` on: the hidden states that
        #: entered the chosen layers, ``[num_tokens, hidden]`` each, as the forward computed
        #: them (kept, not copied: a replayed decode forward restores its own)
        self.captured_parts: list[torch.Tensor] | None = None

    @abstractmethod
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the decoder over ``batch.input_ids``; return hidden states ``[num_tokens, hidden]``
        after the final norm. The runner picks the rows it needs and calls
        :meth:`compute_logits` on them only."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden] -> [n, vocab]`` float32 logits (soft-capping applied, if any)."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy weights given under their Hugging Face names into the parameters.

        Weights arrive one at a time (streamed from disk); an unknown name is an error, and so is
        a parameter left unfilled at the end (except a tied ``lm_head``).
        """

    def get_input_embeddings(self) -> nn.Module:
        """The token embedding (``ids [n] -> [n, hidden]``), which draft heads such as EAGLE's
        share with their target. Models that have none to share raise NotImplementedError."""
        raise NotImplementedError(f"{type(self).__name__} does not share its token embedding")

    @property
    def captured_hidden(self) -> torch.Tensor | None:
        """:attr:`captured_parts` concatenated, ``[num_tokens, len(layer_ids) * hidden]``."""
        parts = self.captured_parts
        return None if parts is None else torch.cat(parts, dim=-1)

    def get_output_embeddings(self) -> nn.Module:
        """The LM head (a :class:`~sgl.layers.ParallelLMHead`, ``.weight [vocab, hidden]``),
        which an EAGLE head's hot vocabulary slices. Models without one to share raise
        NotImplementedError."""
        raise NotImplementedError(f"{type(self).__name__} does not share its LM head")

    def capture_hidden_layers(self, layer_ids: Sequence[int]) -> None:
        """From now on keep, after each forward, the hidden states (residual stream) that
        entered the decoder layers ``layer_ids`` in :attr:`captured_parts`, in that order;
        ``num_layers`` names the output of the last layer, before the final norm. Keeping them
        must compute nothing (a reference to a tensor the forward made anyway), so that a
        recorded decode forward still replays. EAGLE-3 drafts from them. Models that cannot
        raise NotImplementedError."""
        raise NotImplementedError(f"{type(self).__name__} cannot keep the hidden states of "
                                  "its layers")
