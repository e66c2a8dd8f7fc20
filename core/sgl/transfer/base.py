"""The interface of KV transfer backends (prefill/decode disaggregation).

A prefill server computes a prompt's KV; a decode server continues from it. The core does the
coordination (:mod:`sgl.disaggregation`: the bootstrap exchange, which slots, when, timeouts,
aborts); a backend only moves bytes. It sees the KV pool as :class:`KVBuffers`: a list of
tensors whose row ``i`` holds slot ``i`` (every layer's K and V), and copies rows of the prefill
side's buffers into rows of the decode side's, one-sided: the prefill side writes, the decode
side only says where (:meth:`BaseKVTransfer.local_info`) and which rows it expects.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    import torch

__all__ = ["BaseKVTransfer", "KVBuffers", "KVTransferError", "Role", "slot_runs"]

#: which side of a transfer a backend instance serves
Role = Literal["prefill", "decode"]


class KVTransferError(RuntimeError):
    """A transfer failed; the message says why (it ends the request with a clear error)."""


@dataclass(frozen=True)
class KVBuffers:
    """The KV pool as a backend sees it: ``tensors`` are contiguous, on one device, and each
    holds one row per slot (row 0 is the pool's padding slot)."""

    tensors: list[torch.Tensor]

    @property
    def row_bytes(self) -> list[int]:
        """Bytes of one slot's row in each buffer."""
        return [t[0].numel() * t.element_size() for t in self.tensors]

    @property
    def num_rows(self) -> int:
        return int(self.tensors[0].shape[0])

    def layout(self) -> dict[str, Any]:
        """What the other side compares before any byte moves: the buffer count and row sizes
        (a different model, dtype or tensor-parallel split gives a different layout)."""
        return {"buffers": len(self.tensors), "row_bytes": self.row_bytes,
                "dtype": str(self.tensors[0].dtype).removeprefix("torch.")}


def slot_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` for the runs where both slot lists go up by one at
    once: each run is one contiguous copy per buffer (a page, or more)."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class BaseKVTransfer(ABC):
    """Moves rows of the KV pool from a prefill server to a decode server.

    One instance per scheduler process, made when the scheduler starts with
    ``--disaggregation-mode prefill`` or ``decode``. Its methods are called from the core's
    transfer thread, one at a time, never from the forward; :meth:`write` may block.

    :param buffers: this process's KV pool.
    :param role: ``"prefill"`` (writes) or ``"decode"`` (is written to).
    :param host: the address this server advertises to its peers (from ``--host``, or this
        machine's address when that is a wildcard).
    """

    #: the name ``--disaggregation-transfer-backend`` selects it by
    name: ClassVar[str] = ""

    def __init__(self, buffers: KVBuffers, *, role: Role, host: str) -> None:
        self.buffers = buffers
        self.role = role
        self.host = host

    def local_info(self) -> dict[str, Any]:
        """Decode side: what a prefill side needs to write here (JSON-able; the core sends it
        with each request for KV). Default: nothing."""
        return {}

    def expect(self, room: int, dst_slots: list[int]) -> dict[str, Any] | None:
        """Decode side: rows ``dst_slots`` may be written for transfer ``room`` from now on.
        Backends that receive the bytes themselves check incoming writes against it. Returns
        fields added to :meth:`local_info` for this transfer only (JSON-able; sent to the
        prefill side in the want, which ``--disaggregation-secret`` authenticates), for
        example a token the writer must present; default none."""
        return None

    def forget(self, room: int) -> None:  # noqa: B027 (optional hook)
        """Decode side: transfer ``room`` is over (done, failed or aborted); a write for it
        that still arrives must not land."""

    @abstractmethod
    def write(self, peer: dict[str, Any], room: int, src_slots: list[int],
              dst_slots: list[int], timeout: float) -> int:
        """Prefill side: copy row ``src_slots[i]`` of every local buffer into row
        ``dst_slots[i]`` of the peer's same buffer, and return only when the bytes are in the
        peer's memory. Returns the bytes moved.

        :param peer: the decode side's :meth:`local_info`.
        :param room: the transfer's id (SGLang's ``bootstrap_room``).
        :param timeout: seconds this write may take.
        :raises KVTransferError: the write failed or timed out; nothing may be assumed about
            the peer's rows, and the core fails the request on both sides.
        """

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release sockets, threads and registered memory (the scheduler is stopping)."""
