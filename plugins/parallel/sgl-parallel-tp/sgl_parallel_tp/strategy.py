"""Tensor parallelism: the model's heads, MLP and vocabulary split over ``--tp-size`` ranks.

Every rank is a scheduler process with its own shard of the weights (the layers of
:mod:`sgl.layers` read :func:`~sgl.layers.tp.get_tp_group`) and its own shard of the KV pool
(its heads). Rank 0, the leader, is the only scheduler: it takes the requests, decides every
batch, samples and answers the server. Before each forward and each logits computation its
:class:`~sgl.engine.model_runner.ModelRunner` broadcasts the call to the other ranks
(:class:`BroadcastMirror`), which run it on their shards (:meth:`TensorParallel.follow`): the
all-reduces after attention and after the MLP, and the all-gather of the logits, then meet in
the same order on every rank. Since only the leader samples, the ranks never diverge.

The ranks talk through torch.distributed. On one machine they meet through a file in the
launch's private directory and gloo connects them over the loopback interface, so no rank listens
on the network (torch's TCP store binds every interface, whatever address it is given); across
machines (``--nnodes``), or where ``--dist-init-addr`` is given, they meet at that address over
TCP, on the interface ``GLOO_SOCKET_IFNAME`` names. The forward's collectives run on
gloo on CPU (through shared memory when every rank is on one machine) and on NCCL with
``--device cuda``, where rank ``i`` of a machine takes its GPU ``i``
(:func:`collective_backend`); the leader's calls always travel on a gloo group, pickled. Each
rank of a machine takes an equal share of the cores this process may use.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from sgl.config import split_host_port
from sgl.devices import resolve_device
from sgl.forward_batch import ForwardBatch
from sgl.layers.tp import TPGroup, get_tp_group, set_tp_group
from sgl.threads import take_core_share
from sgl.parallel import BaseParallelStrategy, GroupFailure, RankInfo, RunnerMirror
from sgl_parallel_tp.shm import SharedMemoryCollectives, shared_memory_usable

if TYPE_CHECKING:
    from sgl.config import ServerSettings
    from sgl.engine.model_runner import ModelRunner

__all__ = ["BroadcastMirror", "TensorParallel", "collective_backend"]

logger = logging.getLogger("sgl.parallel.tp")

#: how long an idle rank waits for the leader's next call (the leader may have no requests
#: for days; a leader that dies closes its sockets, which ends the wait at once)
IDLE_TIMEOUT = timedelta(days=365)
#: the batch's fields that are the process's own objects, not sent
LOCAL_FIELDS = ("req_to_token_pool", "kv_pool", "attn_backend", "attn_metadata")


def _loopback_interface() -> str | None:
    """The name of this machine's loopback interface (``lo`` on Linux, ``lo0`` on macOS)."""
    import socket

    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in names if n in ("lo", "lo0")), None)


def collective_backend(device: torch.device) -> str:
    """The torch.distributed backend of the forward's collectives on ``device``: NCCL for
    CUDA tensors, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


class TensorParallel(BaseParallelStrategy):
    """``--tp-size N`` (with ``--nnodes``, ``--node-rank``, ``--dist-init-addr``)."""

    @classmethod
    def from_settings(cls, settings: ServerSettings) -> TensorParallel | None:
        return cls(settings) if settings.tp_size > 1 else None

    @classmethod
    def check_settings(cls, settings: ServerSettings) -> str | None:
        """The model's heads must split evenly (checked here, before any process starts, from
        the model's config; the layers check the rest as they are built)."""
        if settings.tp_size == 1:
            return None
        from sgl.model_loader import ModelLoadError, load_hf_config

        try:
            config = load_hf_config(settings.model_path)
        except ModelLoadError:
            return None  # the scheduler reports it, as without tensor parallelism
        heads = getattr(config, "num_attention_heads", None)
        if not isinstance(heads, int):
            return None
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        fits = [n for n in range(1, heads + 1)
                if heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)]
        if settings.tp_size in fits:
            return None
        return (f"--tp-size {settings.tp_size}: the model's {heads} attention heads "
                f"({kv_heads} key/value heads) do not split evenly over {settings.tp_size} "
                f"ranks; sizes that do: {', '.join(map(str, fits))}")

    def local_ranks(self, init_addr: str) -> list[RankInfo]:
        s = self.settings
        per_node = s.tp_size // s.nnodes
        return [RankInfo(strategy="tp", rank=s.node_rank * per_node + i, world_size=s.tp_size,
                         local_rank=i, local_size=per_node, init_addr=init_addr)
                for i in range(per_node)]

    def init_process(self, rank: RankInfo) -> None:
        self.rank = rank
        self.sharing_cores = take_core_share(rank.local_rank, rank.local_size)
        address = split_host_port(rank.init_addr)
        if address is None:
            raise ValueError(f"--dist-init-addr {rank.init_addr!r}: expected HOST:PORT")
        host, port = address
        init_method = f"tcp://{host}:{port}"
        if self.settings.nnodes == 1 and not self.settings.dist_init_addr \
                and rank.rendezvous_dir:
            init_method = f"file://{os.path.join(rank.rendezvous_dir, 'tp-store')}"
            if (loopback := _loopback_interface()) is not None:
                os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
        timeout = timedelta(seconds=self.settings.dist_timeout)
        device = resolve_device(self.settings.device)
        if device.type == "cuda":
            torch.cuda.set_device(rank.local_rank)  # the runner's "cuda" is this GPU
        backend = collective_backend(device)
        try:
            # rank 0 listens at the address (TCPStore) or creates the file; the others connect
            # until the timeout
            dist.init_process_group(backend, init_method=init_method, rank=rank.rank,
                                    world_size=rank.world_size, timeout=timeout)
        except Exception as exc:
            raise RuntimeError(
                f"rank {rank.rank} of {rank.world_size} could not meet the other ranks at "
                f"{rank.init_addr} within {timeout.total_seconds():.0f} s (--dist-init-addr, "
                f"--dist-timeout): {type(exc).__name__}: {exc}") from None
        self._check_same_settings()
        #: the leader's calls travel on a group of their own, which may wait idle for long
        self.calls = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self.shared = self._shared_memory(rank) if backend == "gloo" else None
        set_tp_group(TPGroup(rank=rank.rank, size=rank.world_size,
                             process_group=dist.group.WORLD, fast=self.shared))
        logger.info("tensor-parallel rank %d of %d: pid %d, cores %s, collectives on %s",
                    rank.rank, rank.world_size, os.getpid(), _cores_text(),
                    "shared memory" if self.shared is not None else backend)

    def _shared_memory(self, rank: RankInfo) -> SharedMemoryCollectives | None:
        """The forward's collectives through shared memory when every rank is on this
        machine (on x86-64), else None (gloo). A rank that cannot create or attach the block
        (a small /dev/shm) makes every rank fall back to gloo."""
        if rank.local_size != rank.world_size or not shared_memory_usable():
            return None
        box: list[Any] = [f"sgl-tp-{os.getpid()}-{rank.init_addr.rpartition(':')[2]}"]
        dist.broadcast_object_list(box, src=0)
        pids: list[Any] = [None] * rank.world_size
        dist.all_gather_object(pids, os.getpid())
        shared = None
        for creating in (True, False):  # the leader creates the block, then the others attach
            failed = 0
            if creating == rank.leader:
                try:
                    shared = SharedMemoryCollectives(
                        box[0], rank.rank, rank.world_size, create=creating, pids=pids,
                        timeout=self.settings.dist_timeout, share_cores=self.sharing_cores)
                except OSError as exc:
                    failed = 1
                    logger.warning("rank %d: no shared memory block for the collectives (%s); "
                                   "they go through gloo", rank.rank, exc)
            anyone_failed = torch.tensor([failed])
            dist.all_reduce(anyone_failed, op=dist.ReduceOp.MAX)
            if anyone_failed.item():
                if shared is not None:
                    shared.close()
                return None
        return shared

    def _check_same_settings(self) -> None:
        """Every rank must build the same model the same way: compare the settings that shape
        it with the leader's, so that a node started with other flags fails at once."""
        s = self.settings
        mine = {key: getattr(s, key) for key in (
            "model_path", "device", "dtype", "tp_size", "nnodes", "context_length", "max_total_tokens",
            "max_running_requests", "page_size", "attention_backend", "cpu_isa",
            "chunked_prefill_size")}
        theirs: list[Any] = [None] * self.rank.world_size
        dist.all_gather_object(theirs, mine)
        for rank, other in enumerate(theirs):
            differ = {k: (mine[k], other[k]) for k in mine if mine[k] != other[k]}
            if differ:
                text = ", ".join(f"--{k.replace('_', '-')} {a!r} here, {b!r} on rank {rank}"
                                 for k, (a, b) in differ.items())
                raise ValueError(f"the ranks were started with different settings: {text}; "
                                 "start every node with the same flags")

    def lead(self, runner: ModelRunner) -> None:
        runner.mirror = BroadcastMirror(self.calls)

    def follow(self, runner: ModelRunner) -> None:
        table = runner.req_to_token_pool.req_to_token
        hidden: torch.Tensor | None = None
        while True:
            try:
                call = _receive(self.calls)
            except Exception as exc:
                raise GroupFailure(f"the leader (rank 0) is gone: {exc}") from None
            try:
                if call[0] == "forward":
                    fields, slots = call[1], call[2]
                    offset = 0
                    for row, n in zip(fields["req_pool_indices"].tolist(),
                                      fields["seq_lens_cpu"]):
                        table[row, :n] = slots[offset:offset + n]
                        offset += n
                    fields = {k: _to_device(v, runner.device) for k, v in fields.items()}
                    hidden = runner.forward(ForwardBatch(
                        **fields, req_to_token_pool=runner.req_to_token_pool,
                        kv_pool=runner.kv_pool, attn_backend=runner.attn_backend))
                elif call[0] == "logits":
                    assert hidden is not None, "logits before any forward"
                    runner.logits_at(hidden, call[1].to(runner.device))
                elif call[0] == "stop":
                    logger.info("rank %d stops with the leader", self.rank.rank)
                    _leave()
                    return
            except Exception as exc:
                logger.exception("rank %d failed to run the leader's %s", self.rank.rank,
                                 call[0])
                raise GroupFailure(f"rank {self.rank.rank} failed: {exc}") from None

    def describe(self) -> dict[str, Any]:
        s = self.settings
        return {"tp_size": s.tp_size, "nnodes": s.nnodes}


class BroadcastMirror(RunnerMirror):
    """The leader's side: each call is broadcast (pickled, gloo) to every other rank."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.closed = False

    def forward(self, batch: ForwardBatch) -> None:
        fields = {f.name: _to_device(getattr(batch, f.name), torch.device("cpu"))
                  for f in dataclasses.fields(batch) if f.name not in LOCAL_FIELDS}
        table = batch.req_to_token_pool.req_to_token
        # the rows' slots as the leader holds them (prefix-cache hits write rows outside any
        # forward, so the whole of each row goes)
        slots = torch.cat([table[row, :n] for row, n in
                           zip(batch.req_pool_indices.tolist(), batch.seq_lens_cpu)])
        self._send(("forward", fields, slots.cpu()))

    def logits_at(self, indices: torch.Tensor) -> None:
        self._send(("logits", indices.cpu()))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self._send(("stop",))
            except GroupFailure:
                return  # they are gone already
            _leave()

    def _send(self, call: tuple[Any, ...]) -> None:
        try:
            dist.broadcast_object_list([call], src=0, group=self.group)
        except Exception as exc:
            raise GroupFailure(f"a tensor-parallel rank is gone: {exc}") from None


def _leave() -> None:
    """Close the group before the process exits (gloo's threads, left running, abort the
    interpreter's exit), and the shared memory block."""
    fast = get_tp_group().fast
    if fast is not None:
        fast.close()
    try:
        dist.destroy_process_group()
    except Exception as exc:  # a peer closed first: nothing is left to close
        logger.debug("closing the process group: %s", exc)


def _to_device(value: Any, device: torch.device) -> Any:
    """A batch field (a tensor, a list of tensors or plain data) with its tensors on
    ``device``: they travel pickled through the CPU."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    return value


def _receive(group: Any) -> tuple[Any, ...]:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _cores_text() -> str:
    try:
        return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return "all"
