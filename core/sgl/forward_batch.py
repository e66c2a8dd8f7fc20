"""What one forward pass of the model runs on.

A batch is *ragged*: the new tokens of every sequence are concatenated into one flat
``input_ids`` tensor (no padding to the longest sequence). The key/value vectors of every token
live in the :class:`~sgl.kvcache.pool.KVPool`; ``req_to_token[req_pool_indices[i], :seq_lens[i]]``
lists the pool slots of sequence ``i`` in order, and ``out_cache_loc`` lists the slots the new
tokens are written to.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from sgl.attention.base import BaseAttentionBackend
    from sgl.kvcache.pool import KVPool, ReqToTokenPool

__all__ = ["ForwardBatch", "ForwardMode"]


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill of new tokens on top of an (optional) cached prefix
    DECODE = "decode"  # exactly one new token per sequence


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64, new tokens of all sequences, concatenated
    positions: torch.Tensor  # [num_tokens] int64, position of each new token in its sequence
    req_pool_indices: torch.Tensor  # [batch] int64, row of each sequence in req_to_token
    seq_lens: torch.Tensor  # [batch] int64, prefix + new tokens (the length after this pass)
    extend_prefix_lens: torch.Tensor  # [batch] int64, tokens already in KV before this pass
    extend_seq_lens: torch.Tensor  # [batch] int64, new tokens of each sequence (1 in decode)
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slot each new token is written to
    req_to_token_pool: ReqToTokenPool
    kv_pool: KVPool
    attn_backend: BaseAttentionBackend
    # Python copies of the small per-sequence tensors, for backends that plan on the host
    seq_lens_cpu: list[int] = field(default_factory=list)
    extend_prefix_lens_cpu: list[int] = field(default_factory=list)
    extend_seq_lens_cpu: list[int] = field(default_factory=list)
    req_pool_indices_cpu: list[int] = field(default_factory=list)
    # token trees (speculative verification), one entry per sequence: None for a causal
    # chain, else a bool [n, n] over its n new tokens, True where token i may attend token j
    # (its ancestors and itself); only for backends with ``supports_tree_mask``. The tokens'
    # ``positions`` are then their depths after the prefix, and row ``prefix + i`` of
    # ``req_to_token`` is token i's slot.
    tree_masks: list[torch.Tensor | None] | None = None
    # in EXTEND, how many leading sequences are decode rows: one generated token of a running
    # request each (a mixed step's), which a backend may attend with its decode kernel; the
    # others are prompt tokens, a lone last one after a prefix-cache hit included, and take the
    # extend path, so that a token's arithmetic does not depend on the cache. None: not said
    # (a backend then takes no row for a decode row).
    decode_seqs: int | None = None
    # whatever the attention backend computed in init_forward_metadata
    attn_metadata: Any = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
