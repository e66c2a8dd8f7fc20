"""The ``tcp`` KV transfer backend: rows of the KV pool over ZMQ, checked by the receiver.

The decode side binds a ROUTER socket on its host at a random port and runs a daemon thread
that receives writes. A write comes in messages of a few buffers each (about
:data:`CHUNK_BYTES`), every message its own ZMQ multipart::

    [header (JSON), dst slots (int64), rows of buffer i, rows of buffer i+1, ...]

with the header ``{"seq", "room", "first", "bytes": [per buffer], "row_bytes": [per
buffer]}``. The thread scatters a message's rows into its buffers only when the room was
announced by :meth:`TcpKVTransfer.expect`, every slot is one of the room's, and every size
matches; it answers each message ``{"seq", "ok": true}`` or ``{"seq", "error": why}`` and
writes nothing when it refuses.

The prefill side gathers the rows (``index_select`` on the buffers seen as integer words) and
sends them without copying them again; its messages are all on the wire before the first answer is
awaited, so gathering, sending and scattering overlap.
"""

from __future__ import annotations

import hmac
import itertools
import json
import logging
import secrets
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
import zmq

from sgl.transfer import BaseKVTransfer, KVBuffers, KVTransferError, Role

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["CHUNK_BYTES", "TcpKVTransfer"]

logger = logging.getLogger("sgl.transfer.tcp")

#: a write is sent as messages of whole buffers, each message about this size (one buffer
#: larger than it goes alone): the receiver then holds a part of the write at a time
CHUNK_BYTES = 16 << 20

#: how often the receiver thread looks whether it should stop
_POLL_MS = 100


def _byte_rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a ``[rows, words]`` view of the same memory, in the widest integer type
    that divides a row (copying rows of int64 is several times faster than of uint8)."""
    rows = tensor.view(tensor.shape[0], -1)
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if (rows.shape[1] * rows.element_size()) % size == 0 \
                and (rows.storage_offset() * rows.element_size()) % size == 0:
            return rows.view(torch.uint8).view(dtype)
    return rows.view(torch.uint8)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class TcpKVTransfer(BaseKVTransfer):
    """KV over plain TCP (ZMQ): works anywhere, costs a copy into and out of the socket.

    Decode side: :meth:`local_info` is ``{"endpoint": "tcp://host:port"}``.
    """

    name = "tcp"

    def __init__(self, buffers: KVBuffers, *, role: Role, host: str) -> None:
        super().__init__(buffers, role=role, host=host)
        self._rows = [_byte_rows(t) for t in buffers.tensors]
        # the process's shared context, never terminated here (a context of our own dropped
        # with open sockets would block its finalizer for ever); each socket closes itself
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._seq = itertools.count(1)
        self._lock = threading.Lock()  # the prefill side's sockets
        self._peers: dict[str, zmq.Socket[Any]] = {}
        self._expected: dict[int, tuple[frozenset[int], str]] = {}
        self._expected_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.endpoint: str | None = None
        if role == "decode":
            sock = self._ctx.socket(zmq.ROUTER)
            url_host = _url_host(host)
            sock.ipv6 = url_host.startswith("[")
            port = sock.bind_to_random_port(f"tcp://{url_host}")
            self.endpoint = f"tcp://{url_host}:{port}"
            self._thread = threading.Thread(target=self._serve, args=(sock,), daemon=True,
                                            name="sgl-transfer-tcp")
            self._thread.start()

    # the decode side ------------------------------------------------------------------------

    def local_info(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint} if self.endpoint else {}

    def expect(self, room: int, dst_slots: list[int]) -> dict[str, Any]:
        """A fresh random token for this room: a write must present it (whoever reaches this
        port but did not see the want cannot write, even knowing the room)."""
        token = secrets.token_hex(16)
        with self._expected_lock:
            self._expected[room] = (frozenset(dst_slots), token)
        return {"token": token}

    def forget(self, room: int) -> None:
        with self._expected_lock:
            self._expected.pop(room, None)

    def _serve(self, sock: zmq.Socket[Any]) -> None:
        try:
            while not self._stop.is_set():
                if sock.poll(_POLL_MS):
                    identity, *message = sock.recv_multipart(copy=False)
                    reply = self._receive(message)
                    sock.send_multipart([identity, json.dumps(reply).encode()])
        finally:
            sock.close(linger=0)

    def _receive(self, message: Sequence[zmq.Frame]) -> dict[str, Any]:
        """Check one message against what was expected and scatter it; the answer to send."""
        try:
            header = json.loads(message[0].bytes)
            seq, room = header["seq"], header["room"]
        except (IndexError, ValueError, KeyError, TypeError):
            return {"error": "a malformed message (no header)"}
        try:
            why = self._scatter(room, header, message[1:])
        except Exception as exc:  # a bad message must not end the thread
            logger.exception("tcp transfer: a write for room %s could not be received", room)
            why = f"{type(exc).__name__}: {exc}"
        if why is None:
            return {"seq": seq, "ok": True}
        logger.warning("tcp transfer: refused a write for room %s: %s", room, why)
        return {"seq": seq, "error": why}

    def _scatter(self, room: int, header: dict[str, Any],
                 frames: Sequence[zmq.Frame]) -> str | None:
        """Write a message's rows into the buffers, or say why not (then nothing is written)."""
        with self._expected_lock:
            expected = self._expected.get(room)
        if expected is None:
            return (f"room {room} is not expected here (never announced, or forgotten: done, "
                    "failed or aborted)")
        allowed, token = expected
        if not isinstance(header.get("token"), str) \
                or not hmac.compare_digest(header["token"], token):
            return f"the write for room {room} does not carry the room's token"
        dst = torch.frombuffer(bytearray(frames[0].buffer), dtype=torch.int64)
        slots = dst.tolist()
        if not set(slots) <= allowed:
            return f"slots {sorted(set(slots) - allowed)[:8]} are not room {room}'s"
        if len(set(slots)) != len(slots):
            return "a slot is written twice in one write"
        if slots and not 0 <= min(slots) <= max(slots) < self.buffers.num_rows:
            return f"slots outside this pool's {self.buffers.num_rows} rows"
        first, payload = int(header["first"]), frames[1:]
        sizes, row_bytes = list(header["bytes"]), list(header["row_bytes"])
        mine = self.buffers.row_bytes
        last = first + len(payload)
        if not (0 <= first and last <= len(mine) and row_bytes == mine[first:last]
                and len(sizes) == len(payload)):
            return (f"the layout differs: buffers {first}..{last} with row bytes {row_bytes}, "
                    f"this side has {len(mine)} buffers of {mine}")
        for i, frame in enumerate(payload):
            if sizes[i] != len(slots) * mine[first + i] or len(frame) != sizes[i]:
                return (f"buffer {first + i}: {len(frame)} bytes for {len(slots)} rows of "
                        f"{mine[first + i]}")
        if not slots:
            return None
        index = dst.to(self._rows[0].device)
        for i, frame in enumerate(payload):
            target = self._rows[first + i]
            rows = torch.frombuffer(frame.buffer, dtype=target.dtype).view(len(slots), -1)
            target.index_copy_(0, index, rows.to(target.device))
        return None

    # the prefill side -----------------------------------------------------------------------

    def write(self, peer: dict[str, Any], room: int, src_slots: list[int],
              dst_slots: list[int], timeout: float) -> int:
        endpoint = peer.get("endpoint")
        if not endpoint:
            raise KVTransferError(f"tcp transfer: the decode side gave no endpoint ({peer})")
        if len(src_slots) != len(dst_slots):
            raise KVTransferError(f"tcp transfer: {len(src_slots)} source slots for "
                                  f"{len(dst_slots)} destination slots")
        if src_slots and not 0 <= min(src_slots) <= max(src_slots) < self.buffers.num_rows:
            raise KVTransferError(f"tcp transfer: source slots outside the pool's "
                                  f"{self.buffers.num_rows} rows")
        if not src_slots:
            return 0
        deadline = time.monotonic() + timeout
        with self._lock:
            sock = self._peer(endpoint)
            try:
                return self._send_and_wait(sock, endpoint, room, src_slots, dst_slots,
                                           deadline, timeout, peer)
            except KVTransferError:
                # answers still owed on this socket must not be taken for the next write's
                self._drop(endpoint)
                raise

    def _send_and_wait(self, sock: zmq.Socket[Any], endpoint: str, room: int,
                       src_slots: list[int], dst_slots: list[int], deadline: float,
                       timeout: float, peer: dict[str, Any]) -> int:
        dst = torch.tensor(dst_slots, dtype=torch.int64).numpy().tobytes()
        index = torch.tensor(src_slots, dtype=torch.int64, device=self._rows[0].device)
        owed: set[int] = set()
        moved = 0
        sock.sndtimeo = max(1, int(timeout * 1000))
        for first, last in self._chunks(len(src_slots)):
            parts = [self._rows[i].index_select(0, index).cpu() for i in range(first, last)]
            seq = next(self._seq)
            header = {"seq": seq, "room": room, "first": first, "token": peer.get("token"),
                      "bytes": [p.numel() * p.element_size() for p in parts],
                      "row_bytes": self.buffers.row_bytes[first:last]}
            try:
                # zero-copy: ZMQ holds each part (and so its rows) until it is on the wire
                sock.send_multipart([json.dumps(header).encode(), dst,
                                     *(p.numpy().data for p in parts)], copy=False)
            except zmq.Again:
                raise KVTransferError(f"tcp transfer to {endpoint}: could not send room "
                                      f"{room} within {timeout:g} s") from None
            owed.add(seq)
            moved += sum(header["bytes"])
        while owed:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not sock.poll(left_ms):
                raise KVTransferError(f"tcp transfer to {endpoint}: no answer for room {room} "
                                      f"within {timeout:g} s (is the decode server up?)")
            try:
                reply = json.loads(sock.recv())
            except ValueError:
                raise KVTransferError(f"tcp transfer to {endpoint}: a malformed answer for "
                                      f"room {room}") from None
            if reply.get("seq") not in owed:
                continue  # an answer to an earlier write that gave up
            if "error" in reply:
                raise KVTransferError(f"tcp transfer to {endpoint}: the decode side refused "
                                      f"room {room}: {reply['error']}")
            owed.discard(reply["seq"])
        return moved

    def _chunks(self, rows: int) -> list[tuple[int, int]]:
        """``[first, last)`` buffer ranges of about :data:`CHUNK_BYTES` of ``rows`` rows."""
        chunks: list[tuple[int, int]] = []
        first, size = 0, 0
        for i, row_bytes in enumerate(self.buffers.row_bytes):
            size += rows * row_bytes
            if size >= CHUNK_BYTES:
                chunks.append((first, i + 1))
                first, size = i + 1, 0
        if first < len(self.buffers.tensors) or not chunks:
            chunks.append((first, len(self.buffers.tensors)))
        return chunks

    def _peer(self, endpoint: str) -> zmq.Socket[Any]:
        sock = self._peers.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.ipv6 = "[" in endpoint
            sock.connect(endpoint)
            self._peers[endpoint] = sock
        return sock

    def _drop(self, endpoint: str) -> None:
        sock = self._peers.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    # both -----------------------------------------------------------------------------------

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            for endpoint in list(self._peers):
                self._drop(endpoint)
