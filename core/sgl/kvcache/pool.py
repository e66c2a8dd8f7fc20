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

    #: set_kv copies at most this many runs of consecutive slots; more go through torch's
    #: indexed write
    MAX_RUNS = 16

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
        #: a copy of the last ``loc`` set_kv wrote, and its runs of slots (``_runs``)
        self._runs_of: tuple[torch.Tensor, list[tuple[int, int, int]] | None] | None = None

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
        """Write the rows of ``k`` and ``v`` into slots ``loc`` of layer ``layer_id``."""
        k_buffer, v_buffer = self.k_buffer[layer_id], self.v_buffer[layer_id]
        runs = None
        if (loc.device.type == "cpu" and loc.dtype == torch.int64 and loc.dim() == 1
                and loc.numel() == k.shape[0] == v.shape[0] > 0):
            runs = self._runs(loc)
        if runs is None:
            k_buffer[loc] = k.to(self.dtype)
            v_buffer[loc] = v.to(self.dtype)
            return
        for slot, row, n in runs:
            k_buffer[slot:slot + n].copy_(k[row:row + n])
            v_buffer[slot:slot + n].copy_(v[row:row + n])

    def _runs(self, loc: torch.Tensor) -> list[tuple[int, int, int]] | None:
        """``loc`` as runs of consecutive slots, ``(first slot, first row, length)``; None when
        it has more than MAX_RUNS of them or a slot outside the pool. The slots of a forward's
        new tokens come from the free list in order, so they are mostly one run, and every
        layer writes the same ones: the runs of the last ``loc`` are kept with a copy of it, and
        used again while the slots are the same. A copy per run is cheaper than torch's indexed
        write (``k_buffer[loc] = k``), which scatters element by element."""
        cached = self._runs_of
        if cached is not None and cached[0].shape == loc.shape and torch.equal(cached[0], loc):
            return cached[1]
        runs: list[tuple[int, int, int]] | None = None
        breaks = (loc[1:] - loc[:-1] != 1).nonzero().flatten().tolist()
        if len(breaks) < self.MAX_RUNS:
            starts = [0, *(b + 1 for b in breaks)]
            ends = [*(b + 1 for b in breaks), loc.numel()]
            runs = [(slot, a, b - a) for slot, a, b in zip(loc[starts].tolist(), starts, ends)]
            if not all(0 <= slot and slot + n <= self.size + 1 for slot, _, n in runs):
                runs = None  # torch's indexed write says what is wrong
        self._runs_of = (loc.clone(), runs)
        return runs


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
