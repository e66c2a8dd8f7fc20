"""All-reduce and all-gather through shared memory, for the ranks of one machine.

gloo's collectives go through TCP on loopback, a round trip through the kernel's network
stack each (``docs/benchmarks.md``, "Tensor parallelism"), and a decode step of a 30-layer model
runs 61 of them. Ranks on one machine can instead meet in a shared memory block: each rank copies its
tensor into its own slot and raises its *ready* counter; once every rank's counter reached the
step, each reads all slots and combines them in rank order (so every rank gets the same bits),
then raises its *done* counter, which a rank waits for before it overwrites its slot again.

It relies on x86-64's store order (a slot written before its counter is seen before it), so
it is used on x86-64 only; tensors larger than a slot fall back to gloo. A rank that waits for
a peer checks now and then that the peer's process is alive and that ``timeout`` has not
passed, so a dead peer fails the wait rather than hang it.
"""

from __future__ import annotations

import os
import platform
import time
from multiprocessing import shared_memory

import numpy as np
import torch
from torch.profiler import record_function

__all__ = ["SharedMemoryCollectives", "shared_memory_usable"]

#: bytes of one rank's slot; larger tensors go through gloo
SLOT_BYTES = 8 << 20
#: polls between checks of the peers' liveness and the deadline
CHECK_EVERY = 4096


def shared_memory_usable() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def _check_room(nbytes: int) -> None:
    """OSError unless /dev/shm has ``nbytes`` free: a block larger than what is free is
    created all the same (sparse), and the process dies of SIGBUS when it writes past it
    (containers often give /dev/shm 64 MiB)."""
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return  # no /dev/shm to ask: let the creation tell
    free = stat.f_bavail * stat.f_frsize
    if free < nbytes:
        raise OSError(f"/dev/shm has {free / 2**20:.0f} MiB free, the block needs "
                      f"{nbytes / 2**20:.0f} MiB")


class PeerFailure(RuntimeError):
    """A peer rank died or did not arrive within the timeout."""


class SharedMemoryCollectives:
    """The collectives of ``size`` ranks of one machine over the block ``name``.

    :param create: True on the rank that creates (and later removes) the block.
    :param pids: every rank's process id, for the liveness checks.
    :param timeout: seconds a rank waits for the others in one collective.
    :param share_cores: the ranks share cores: yield the core while waiting.
    """

    def __init__(self, name: str, rank: int, size: int, *, create: bool, pids: list[int],
                 timeout: float, share_cores: bool) -> None:
        header = 2 * size * 8
        total = header + size * SLOT_BYTES
        if create:
            _check_room(total)
        self.shm = shared_memory.SharedMemory(name=name, create=create, size=total)
        self.created = create
        self.rank, self.size = rank, size
        self.pids, self.timeout, self.share_cores = pids, timeout, share_cores
        #: ready[r], then done[r]: the last step rank r wrote its slot for, and finished reading
        self.counters = np.frombuffer(self.shm.buf, dtype=np.int64, count=2 * size)
        if create:
            self.counters[:] = 0
        self.slots = torch.frombuffer(self.shm.buf, dtype=torch.uint8, offset=header,
                                      count=size * SLOT_BYTES).view(size, SLOT_BYTES)
        self.step = 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Sum ``tensor`` over the ranks, in place; None when it does not fit a slot."""
        with record_function("sgl_tp::shm_all_reduce"):  # named in torch.profiler's tables
            return self._all_reduce(tensor)

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor | None:
        parts = self._exchange(tensor)
        if parts is None:
            return None
        if tensor.dtype in (torch.bfloat16, torch.float16):  # sum in float32, round once
            total = parts[0].float()
            for part in parts[1:]:
                total += part
            tensor.copy_(total.view(tensor.shape))
        else:
            tensor.copy_(parts[0].view(tensor.shape))
            for part in parts[1:]:
                tensor.add_(part.view(tensor.shape))
        self._release()
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor | None:
        """Every rank's ``tensor`` concatenated along ``dim`` in rank order; None when it does
        not fit a slot."""
        with record_function("sgl_tp::shm_all_gather"):
            parts = self._exchange(tensor)
            if parts is None:
                return None
            out = torch.cat([part.view(tensor.shape) for part in parts], dim=dim)
            self._release()
            return out

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Publish this rank's tensor and wait for everyone's; the others' views (valid until
        :meth:`_release`)."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > SLOT_BYTES or tensor.device.type != "cpu":
            return None
        self.step += 1
        self._wait(self.size, self.step - 1)  # everyone has read the previous step's slots
        self.slots[self.rank, :nbytes].copy_(tensor.contiguous().view(-1).view(torch.uint8))
        self.counters[self.rank] = self.step
        self._wait(0, self.step)
        return [self.slots[r, :nbytes].view(tensor.dtype) for r in range(self.size)]

    def _release(self) -> None:
        self.counters[self.size + self.rank] = self.step

    def _wait(self, offset: int, step: int) -> None:
        counters = self.counters[offset:offset + self.size]
        polls = 0
        deadline = None
        while (counters < step).any():
            polls += 1
            if self.share_cores or polls > 256:
                os.sched_yield()
            if polls % CHECK_EVERY == 0:
                deadline = deadline or time.monotonic() + self.timeout
                self._check_peers(counters, step, deadline)

    def _check_peers(self, counters: np.ndarray, step: int, deadline: float) -> None:
        for r in np.flatnonzero(counters < step):
            try:
                os.kill(self.pids[r], 0)
            except ProcessLookupError:
                raise PeerFailure(f"tensor-parallel rank {r} (pid {self.pids[r]}) is gone")
        if time.monotonic() > deadline:
            late = ", ".join(str(r) for r in np.flatnonzero(counters < step))
            raise PeerFailure(f"tensor-parallel rank(s) {late} did not arrive within "
                              f"{self.timeout:.0f} s (--dist-timeout)")

    def close(self) -> None:
        self.counters = np.zeros(0, dtype=np.int64)  # drop the views before closing
        del self.slots
        self.shm.close()
        if self.created:
            self.shm.unlink()
