"""Paged KV memory: a pool of token slots and the request -> slots table.

Slot 0 is reserved as a padding slot and never handed out, so a zero in ``req_to_token``
points at harmless memory.
"""

from __future__ import annotations

import torch

__all__ = ["KVPool", "OutOfSlotsError", "ReqToTokenPool"]


class OutOfSlotsError(RuntimeError):
    """The pool has fewer free slots than were asked for."""


class KVPool:
    """Key and value buffers for ``size`` tokens of every layer, handed out slot by slot."""

    def __init__(self, *, size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, page_size: int = 1,
                 v_head_dim: int | None = None) -> None:
        if size < 1:
            raise ValueError(f"KV pool size must be positive, got {size}")
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.device = device
        self.num_layers = num_layers
        v_head_dim = v_head_dim or head_dim
        shape_k = (size + 1, num_kv_heads, head_dim)
        shape_v = (size + 1, num_kv_heads, v_head_dim)
        self.k_buffer = [torch.zeros(shape_k, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape_v, dtype=dtype, device=device) for _ in range(num_layers)]
        self._free = torch.arange(1, size + 1, dtype=torch.int64)
        self._num_free = size

    @staticmethod
    def bytes_per_token(*, num_layers: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, v_head_dim: int | None = None) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return num_layers * num_kv_heads * (head_dim + (v_head_dim or head_dim)) * elem

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.size - self._num_free

    def alloc(self, n: int) -> torch.Tensor:
        """Take ``n`` free slots; raise :class:`OutOfSlotsError` when there are not enough."""
        if n > self._num_free:
            raise OutOfSlotsError(f"asked for {n} KV slots, {self._num_free} free of {self.size}")
        start = self.size - self._num_free
        self._num_free -= n
        return self._free[start:start + n].clone()

    def free(self, slots: torch.Tensor) -> None:
        """Give slots back. Freeing a slot twice corrupts the pool, so callers keep exact books."""
        n = int(slots.numel())
        if n == 0:
            return
        if self._num_free + n > self.size:
            raise RuntimeError(f"freeing {n} slots would exceed the pool size {self.size}")
        start = self.size - self._num_free - n
        self._free[start:start + n] = slots.to(torch.int64).flatten().cpu()
        self._num_free += n

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffer[layer_id][loc] = k.to(self.dtype)
        self.v_buffer[layer_id][loc] = v.to(self.dtype)


class ReqToTokenPool:
    """``req_to_token[row, i]`` is the KV slot of token ``i`` of the request in ``row``."""

    def __init__(self, *, max_requests: int, max_context_len: int, device: torch.device) -> None:
        self.max_requests = max_requests
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((max_requests, max_context_len), dtype=torch.int64,
                                        device=device)
        self._free_rows = list(range(max_requests - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int:
        if not self._free_rows:
            raise OutOfSlotsError(f"all {self.max_requests} request rows are in use")
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        self._free_rows.append(row)
