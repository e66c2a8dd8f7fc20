"""The ``mooncake`` KV transfer backend: one-sided writes through Mooncake's transfer engine.

Both sides start a ``mooncake.engine.TransferEngine`` on their host, with peer-to-peer
handshakes (no metadata server), and register the memory of every KV buffer with it. The
decode side advertises its engine's session (``host:rpc_port``) and its buffers' addresses;
the prefill side turns a write into one contiguous copy per run of slots (:func:`slot_runs`)
per buffer and hands them to the engine in batches, which it writes straight into the decode
side's memory (over TCP here; RDMA where the machine has it and the protocol says so).

The decode side's process takes no part in a write, so it cannot refuse one: :meth:`expect`
and :meth:`forget` are no-ops, and a write that arrives after the decode side gave the room up
lands all the same. The prefill side checks what it can before it writes (the row sizes, and
that every destination slot is inside the decode side's pool).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from mooncake.engine import TransferEngine

from sgl.transfer import BaseKVTransfer, KVBuffers, KVTransferError, Role, slot_runs

__all__ = ["MooncakeKVTransfer"]

logger = logging.getLogger("sgl.transfer.mooncake")


class MooncakeKVTransfer(BaseKVTransfer):
    """KV through Mooncake's transfer engine.

    Decode side: :meth:`local_info` is ``{"session": "host:port", "addrs": [buffer
    addresses], "row_bytes": [...], "rows": n}``.
    """

    name = "mooncake"
    #: the engine's transport: ``tcp`` works on any machine; ``rdma`` needs RDMA NICs
    protocol = "tcp"
    #: the RDMA devices to use (comma-separated), or "" for all
    device_name = ""
    #: copies handed to the engine at once: its TCP transport queues at most 1,024 per peer
    #: (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``) and fails a batch that overflows the queue
    batch_size = 512

    def __init__(self, buffers: KVBuffers, *, role: Role, host: str) -> None:
        super().__init__(buffers, role=role, host=host)
        if any(t.device.type != "cpu" for t in buffers.tensors):
            raise KVTransferError(
                "mooncake: the KV pool is on the GPU, and the installed engine "
                "(mooncake-transfer-engine-non-cuda) registers host memory only; use "
                "--disaggregation-transfer-backend tcp, or a CUDA build of mooncake's engine")
        engine = TransferEngine()
        # without a port, the engine picks a free one for its handshakes (get_rpc_port)
        if engine.initialize(host, "P2PHANDSHAKE", self.protocol, self.device_name) != 0:
            raise KVTransferError(f"mooncake: could not start a transfer engine on {host} "
                                  f"with protocol {self.protocol!r} (see its log above)")
        self.session = f"{host}:{engine.get_rpc_port()}"
        self.addrs = [t.data_ptr() for t in buffers.tensors]
        sizes = [t.numel() * t.element_size() for t in buffers.tensors]
        if engine.batch_register_memory(self.addrs, sizes) != 0:
            raise KVTransferError("mooncake: could not register the KV buffers' memory "
                                  f"({sum(sizes)} bytes in {len(sizes)} buffers)")
        self.engine: TransferEngine | None = engine

    def local_info(self) -> dict[str, Any]:
        return {"session": self.session, "addrs": self.addrs,
                "row_bytes": self.buffers.row_bytes, "rows": self.buffers.num_rows}

    def write(self, peer: dict[str, Any], room: int, src_slots: list[int],
              dst_slots: list[int], timeout: float) -> int:
        session, peer_addrs = peer.get("session"), peer.get("addrs")
        row_bytes = self.buffers.row_bytes
        if not session or not isinstance(peer_addrs, list):
            raise KVTransferError(f"mooncake: the decode side gave no session or buffer "
                                  f"addresses ({peer})")
        if len(peer_addrs) != len(row_bytes) or peer.get("row_bytes", row_bytes) != row_bytes:
            raise KVTransferError(f"mooncake: the decode side at {session} has buffers of "
                                  f"{peer.get('row_bytes')} bytes a row, this side "
                                  f"{row_bytes}")
        if len(src_slots) != len(dst_slots):
            raise KVTransferError(f"mooncake: {len(src_slots)} source slots for "
                                  f"{len(dst_slots)} destination slots")
        if not src_slots:
            return 0
        peer_rows = int(peer.get("rows", self.buffers.num_rows))
        if min(dst_slots) < 0 or max(dst_slots) >= peer_rows:
            raise KVTransferError(f"mooncake: destination slots outside the decode side's "
                                  f"{peer_rows} rows")
        if min(src_slots) < 0 or max(src_slots) >= self.buffers.num_rows:
            raise KVTransferError(f"mooncake: source slots outside this pool's "
                                  f"{self.buffers.num_rows} rows")
        srcs: list[int] = []
        dsts: list[int] = []
        lengths: list[int] = []
        runs = slot_runs(src_slots, dst_slots)
        for mine, theirs, size in zip(self.addrs, peer_addrs, row_bytes):
            for s, d, n in runs:
                srcs.append(mine + s * size)
                dsts.append(int(theirs) + d * size)
                lengths.append(n * size)
        start = time.monotonic()
        status = self._write_batch(session, srcs, dsts, lengths)
        took = time.monotonic() - start
        if status != 0:
            raise KVTransferError(f"mooncake: the write of room {room} to {session} failed "
                                  f"(status {status}, after {took:.2f} s; the engine's log "
                                  "says why)")
        if took > timeout:
            # the bytes are there, but the decode side may have given the room up meanwhile
            raise KVTransferError(f"mooncake: the write of room {room} to {session} took "
                                  f"{took:.2f} s, over the {timeout:g} s timeout")
        return sum(lengths)

    def _write_batch(self, session: str, srcs: list[int], dsts: list[int],
                     lengths: list[int]) -> int:
        """Batches of :attr:`batch_size` copies when this version of the engine has batched
        writes, else one call per copy; the first non-zero status, or 0."""
        engine = self.engine
        if engine is None:
            raise KVTransferError("mooncake: the backend is closed")
        batch = getattr(engine, "batch_transfer_sync_write", None)
        if batch is not None:
            for i in range(0, len(srcs), self.batch_size):
                j = i + self.batch_size
                status = int(batch(session, srcs[i:j], dsts[i:j], lengths[i:j]))
                if status != 0:
                    return status
            return 0
        for src, dst, length in zip(srcs, dsts, lengths):
            status = int(engine.transfer_sync_write(session, src, dst, length))
            if status != 0:
                return status
        return 0

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is None:
            return
        if engine.batch_unregister_memory(self.addrs) != 0:
            logger.warning("mooncake: could not unregister the KV buffers' memory")
        del engine  # the last reference: the engine stops its threads and closes its sockets
