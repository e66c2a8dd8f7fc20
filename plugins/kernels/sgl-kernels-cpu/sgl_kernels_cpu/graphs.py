"""Replaying recorded decode forwards on CPU, what CUDA graphs do for a GPU: this library's
:class:`~sgl.kernels.library.DecodeGraphs` (:meth:`CpuKernelLibrary.decode_graphs`).

On CPU a decode step of a small model spends much of its time in Python around the kernels:
module calls, shape and dtype checks, tensor allocations, argument conversion (how much:
docs/benchmarks.md, "Replaying decode forwards").

:class:`CpuGraphRunner` runs the second decode forward of a batch size as usual while
:func:`sgl.kernels.cpu.recording` has the kernel library take down every kernel call (the
kernel, its exact arguments, the tensors it reads and writes) and a torch dispatch mode checks
that nothing else computed: only the ``sgl::`` kernel operators, allocations and views may run.
A later decode batch of the same size copies its inputs (token ids, positions, and what the
attention backend lists in :meth:`~sgl.attention.base.BaseAttentionBackend.graph_inputs`) into
the recorded tensors and replays the calls, all in one call of the library
(:meth:`~sgl.kernels.library.KernelLibrary.replay`); no module code and no dispatcher runs. A
forward that computes anything with torch (a torch fallback, a model's own elementwise op,
float16) is not recorded and stays eager.

Before serving, :meth:`CpuGraphRunner.record_batch_sizes` records every batch size up to a
largest (the scheduler's ``--cpu-graph-max-bs``) over batches of padding rows, largest first,
the kernels' outputs of all of them carved from one arena the size of the largest's
activations, as CUDA graphs share a memory pool: only one forward runs at a time, and a replay
writes every activation before it reads it (each graph with its own activations would hold
dozens of times more). A size beyond them is recorded the second time it is seen (recording
costs more than an eager forward: a size the batch passes through only once is not worth it), its
activations in the arena as far as they fit and the rest on their own; graphs are dropped least
recently used first beyond ``max_bytes``.

With two kernel threads, a decode batch of at least 2 x :data:`MIN_PART_SIZE` sequences is
recorded as two parts, each the forward of half of its sequences, and a replay runs the parts
at once, one thread each, every kernel of a part on its own thread
(:meth:`~sgl.kernels.library.KernelLibrary.replay_parts`): the threads then never wait for each
other inside the step, and one runs a part's memory-bound attention while the other runs the
other part's matmuls; below the minimum, parts run slower than the whole batch on both threads
(docs/kernels.md, "Decode steps in two parts"). Every sequence's hidden states are the same bits
either way: each row of a kernel's output is computed alone.

As with CUDA graphs, the hidden states returned by a replay are the recorded tensor: they stay
valid until the next forward. The models' and the attention backend's kernels must not decide
anything from data that :meth:`graph_inputs` does not cover; the kernel path of every layer in
:mod:`sgl.layers` depends only on shapes, dtypes and the thread counts (part of the key).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sgl.kernels import cpu, ops
from sgl.kernels.library import DecodeGraphs, KernelTape

if TYPE_CHECKING:
    from sgl.attention.base import BaseAttentionBackend
    from sgl.forward_batch import ForwardBatch

__all__ = ["CPU_GRAPH_MAX_BS", "DEFAULT_MAX_BYTES", "MIN_PART_SIZE", "CpuGraphRunner",
           "split_parts"]

logger = logging.getLogger("sgl.decode_graphs")

#: memory the recorded activations of all kept graphs may hold (least recently used dropped
#: first)
DEFAULT_MAX_BYTES = 256 * 2**20
#: the largest decode batch recorded before serving by default (--cpu-graph-max-bs, never
#: above --max-running-requests)
CPU_GRAPH_MAX_BS = 64
#: recording costs about 1.6 eager forwards (the dispatch mode's Python runs for every torch
#: op), so a batch size is recorded when it comes back, not the first time it is seen
SEEN_BEFORE_RECORDING = 1
#: fewest sequences in each part of a split decode batch (see the module docstring)
MIN_PART_SIZE = 8
#: the kernel threads with which decode batches are split, one part per thread: the case
#: measured (two cores); with more threads every part would read all the weights on its own
SPLIT_THREADS = 2
#: each recorded part's activations start on a cache line of the arena
_ALIGN = 64


def split_parts(batch_size: int, kernel_threads: int) -> int:
    """The parts a decode batch of ``batch_size`` sequences is recorded and replayed in, with
    ``kernel_threads`` threads of sgl's kernels: one per thread when there are
    :data:`SPLIT_THREADS` and each gets :data:`MIN_PART_SIZE` sequences, else 1."""
    if kernel_threads == SPLIT_THREADS and batch_size >= MIN_PART_SIZE * kernel_threads:
        return kernel_threads
    return 1

_aten = torch.ops.aten
#: torch ops that allocate (their memory is counted against ``max_bytes``)
_ALLOCATING = frozenset({_aten.empty, _aten.empty_strided, _aten.new_empty,
                         _aten.new_empty_strided, _aten.empty_like})
#: torch ops that allocate or make views, the only ones a recorded forward may run
_NO_COMPUTE = _ALLOCATING | frozenset({
    _aten.view, _aten._unsafe_view, _aten.slice, _aten.split, _aten.split_with_sizes,
    _aten.select, _aten.unsqueeze, _aten.squeeze, _aten.t, _aten.transpose, _aten.permute,
    _aten.expand, _aten.alias, _aten.detach, _aten.as_strided, _aten.narrow, _aten.unbind,
})
#: ops that return a view when they can and a copy otherwise (under inference mode torch
#: dispatches them whole): allowed when the result shares the input's memory
_VIEW_OR_COPY = frozenset({_aten.reshape, _aten.flatten, _aten.unflatten, _aten.contiguous})


class _ComputeWatch(TorchDispatchMode):
    """Notes every torch op outside :data:`_NO_COMPUTE` and the kernel operators that runs
    inside the block, the kernel operators it calls, and the bytes that it allocates outside
    them."""

    def __init__(self) -> None:
        super().__init__()
        self.compute: list[str] = []
        self.kernel_calls = 0
        self.allocated = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        packet = func.overloadpacket
        out = func(*args, **(kwargs or {}))
        if func.namespace == ops.NAMESPACE:
            self.kernel_calls += 1
        elif packet in _VIEW_OR_COPY:
            if out.untyped_storage().data_ptr() != args[0].untyped_storage().data_ptr():
                self.compute.append(f"{packet} (a copy)")
        elif packet not in _NO_COMPUTE:
            self.compute.append(str(packet))
        if packet in _ALLOCATING:
            self.allocated += out.untyped_storage().nbytes()
        return out


@dataclasses.dataclass
class _Part:
    """The recorded forward of sequences ``start:end`` of the batch (all of it, unsplit)."""

    start: int
    end: int
    tape: KernelTape
    inputs: list[torch.Tensor]  # what the recorded calls read of the batch, in _inputs' order
    output: torch.Tensor


@dataclasses.dataclass
class _Graph:
    parts: list[_Part]
    output: torch.Tensor  # the hidden states of the batch: the one part's, or the parts' joined
    nbytes: int  # what the recording allocated outside the arena (kept for the replays)
    arena_bytes: int  # how much of an arena its activations take (all of them, in one)
    #: the model's ``captured_parts`` after the recorded forward: recorded tensors too, which
    #: a replay rewrites, so it restores them (EAGLE-3's layer states; such a batch is not split)
    captured: list[torch.Tensor] | None = None

    def fits(self, inputs: list[torch.Tensor]) -> bool:
        """Whether a batch's ``inputs`` have the recorded shapes and dtypes."""
        return all(a.shape == b.shape and a.dtype == b.dtype
                   for part in self.parts for a, b in zip(part.inputs, self.slices(part, inputs)))

    def slices(self, part: _Part, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The rows of a batch's ``inputs`` that ``part`` reads."""
        if len(self.parts) == 1:
            return inputs
        return [t[part.start:part.end] for t in inputs]


class CpuGraphRunner(DecodeGraphs):
    """Records and replays the decode forwards of one model (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, backend: BaseAttentionBackend,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.model = model
        self.backend = backend
        self.max_bytes = max_bytes
        #: key -> recorded graph, or None where that forward cannot be recorded (or is larger
        #: than max_bytes); least recently used first
        self.graphs: OrderedDict[tuple[int, ...], _Graph | None] = OrderedDict()
        #: the memory the recorded activations share, sized by record_batch_sizes for its
        #: largest batch; None until then (each recording then holds its own)
        self.arena: torch.Tensor | None = None
        self._seen: dict[tuple[int, ...], int] = {}  # forwards of keys not recorded yet
        self.replays = 0  # for tests and logs
        self.captures = 0

    def can_run(self, batch: ForwardBatch) -> bool:
        return True  # a batch it cannot record runs eagerly in forward

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The hidden states of a decode batch: replayed when its batch size was recorded,
        else computed (and recorded when it can be)."""
        self.backend.init_forward_metadata(batch)
        inputs = self._inputs(batch)
        if inputs is None:
            return self.model(batch)
        key = (batch.batch_size, cpu.kernel_threads(), torch.get_num_threads())
        if key in self.graphs:
            self.graphs.move_to_end(key)
            graph = self.graphs[key]
            if graph is None:
                return self.model(batch)
            if graph.fits(inputs):
                return self._replay(graph, inputs, batch, key)
        seen = self._seen.get(key, 0)
        if seen < SEEN_BEFORE_RECORDING:
            if len(self._seen) >= 1024:
                self._seen.clear()
            self._seen[key] = seen + 1
            return self.model(batch)
        self._seen.pop(key, None)
        return self._capture(batch, key, inputs)

    def _inputs(self, batch: ForwardBatch) -> list[torch.Tensor] | None:
        extra = self.backend.graph_inputs(batch)
        if extra is None:
            return None
        return [batch.input_ids, batch.positions, *extra]

    def _replay(self, graph: _Graph, inputs: list[torch.Tensor], batch: ForwardBatch,
                key: tuple[int, ...]) -> torch.Tensor:
        for part in graph.parts:
            for recorded, new in zip(part.inputs, graph.slices(part, inputs)):
                if recorded is not new:
                    recorded.copy_(new)
        try:
            if len(graph.parts) == 1:
                graph.parts[0].tape.replay()
            else:
                tapes = [part.tape for part in graph.parts]
                tapes[0].library.replay_parts(tapes)
        except RuntimeError as exc:  # a kernel refused these inputs: compute them eagerly
            logger.warning("replaying the decode forward of batch size %d failed (%s); "
                           "running it eagerly", batch.batch_size, exc)
            del self.graphs[key]
            return self.model(batch)
        self.replays += 1
        if len(graph.parts) > 1:
            for part in graph.parts:
                graph.output[part.start:part.end].copy_(part.output)
        if graph.captured is not None:
            self.model.captured_parts = graph.captured
        return graph.output

    def _capture(self, batch: ForwardBatch, key: tuple[int, ...],
                 inputs: list[torch.Tensor]) -> torch.Tensor:
        parts = split_parts(batch.batch_size, key[1]) if self._splittable(batch, inputs) else 1
        size = batch.batch_size
        recorded: list[_Part] = []
        outputs, nbytes, why, arena_bytes = [], 0, "", 0
        for i in range(parts):  # each part's activations after the one before's in the arena
            start, end = size * i // parts, size * (i + 1) // parts
            arena = (self.arena[arena_bytes:] if self.arena is not None
                     and arena_bytes < self.arena.numel() else None)
            part, output, part_bytes, used, why = self._record(batch, start, end, parts > 1,
                                                               arena)
            outputs.append(output)
            nbytes += part_bytes
            arena_bytes += -(-used // _ALIGN) * _ALIGN
            if part is None:
                break
            recorded.append(part)
        if parts > 1:  # the parts' hidden states joined (all of them recomputed if one failed)
            output = torch.cat(outputs) if not why else self.model(batch)
            nbytes += output.nbytes
        graph = None
        room = self.max_bytes - (self.arena.numel() if self.arena is not None else 0)
        if why:
            logger.debug("decode forward of batch size %d not recorded: %s", size, why)
        elif nbytes > room:
            logger.debug("decode forward of batch size %d not recorded: its activations "
                         "beyond the arena (%.0f MiB) exceed the %.0f MiB for them", size,
                         nbytes / 2**20, room / 2**20)
        elif recorded and all(len(part.tape) for part in recorded):
            captured = getattr(self.model, "captured_parts", None)
            graph = _Graph(recorded, output if parts > 1 else recorded[0].output, nbytes,
                           arena_bytes, list(captured) if captured is not None else None)
            self.captures += 1
            log = logger.info if self.captures == 1 else logger.debug
            log("recorded the decode forward of batch size %d (%s%d kernel calls, %.1f MiB of "
                "its own); batches of this size replay it (--disable-cpu-graph turns this off)",
                size, f"{parts} parts of " if parts > 1 else "",
                sum(len(part.tape) for part in recorded), nbytes / 2**20)
        self.graphs[key] = graph
        while self.nbytes > self.max_bytes and self.graphs:
            self.graphs.popitem(last=False)
        return output

    def prepare(self, max_bs: int | None, limit: int, *, show_progress: bool = True
                ) -> list[int]:
        """Record the decode forwards of batch sizes 1 to ``max_bs`` (None:
        :data:`CPU_GRAPH_MAX_BS`), never above ``limit`` (:meth:`record_batch_sizes`)."""
        return self.record_batch_sizes(min(CPU_GRAPH_MAX_BS if max_bs is None else max_bs,
                                           limit), show_progress=show_progress)

    @torch.inference_mode()
    def record_batch_sizes(self, max_bs: int, *, show_progress: bool = True) -> list[int]:
        """Record the decode forwards of every batch size from ``max_bs`` down to 1 now, over
        batches of padding rows (:func:`sgl.engine.cuda_graph.padding_batch`), so that no
        served batch waits for one; their activations share one arena, sized for the largest
        (the first forward of that size, recorded apart, measures it), as CUDA graphs share a
        memory pool. A progress bar "Recording decode forwards" over the sizes. The sizes
        recorded, largest first: fewer where the arena of ``max_bs`` would pass half of
        ``max_bytes`` (the largest batch whose activations fit in that half; the other half is
        for larger batches recorded later), none where a forward cannot be recorded (logged)."""
        from tqdm.auto import tqdm

        from sgl.engine.cuda_graph import padding_batch

        if max_bs < 1:
            return []
        started = time.perf_counter()
        pools = {"kv_pool": self.backend.kv_pool,
                 "req_to_token_pool": self.backend.req_to_token_pool,
                 "attn_backend": self.backend}

        def record(bs: int) -> _Graph | None:
            batch = padding_batch(bs, **pools)
            self.backend.init_forward_metadata(batch)
            inputs = self._inputs(batch)
            if inputs is None:
                return None
            key = (bs, cpu.kernel_threads(), torch.get_num_threads())
            self._capture(batch, key, inputs)
            return self.graphs.get(key)

        warm = padding_batch(max_bs, **pools)  # lazy set-up outside any recording
        self.backend.init_forward_metadata(warm)
        self.model(warm)
        limit, self.max_bytes = self.max_bytes, sys.maxsize  # all of it on the heap, this once
        try:
            largest = record(max_bs)
        finally:
            self.max_bytes = limit
        self.graphs.clear()
        if largest is None:
            logger.info("decode forwards not recorded at start-up: the one of batch size %d "
                        "cannot be (the debug log says why); sizes that recur are tried again",
                        max_bs)
            return []
        needed = largest.arena_bytes
        del largest
        if needed > self.max_bytes // 2:  # a large model: half for the arena, half for
            max_bs = max(1, max_bs * (self.max_bytes // 2) // needed)  # larger batches later
            needed = self.max_bytes // 2
        self.arena = torch.empty(needed, dtype=torch.uint8)
        recorded = []
        sizes = tqdm(range(max_bs, 0, -1), desc="Recording decode forwards", unit="size",
                     disable=not show_progress)
        for bs in sizes:
            if record(bs) is not None:
                recorded.append(bs)
        logger.info("recorded the decode forwards of %d batch sizes (1 to %d) in %.1f s, their "
                    "activations in one arena of %.1f MiB (--cpu-graph-max-bs sets the largest; "
                    "--disable-cpu-graph turns replays off)", len(recorded), max_bs,
                    time.perf_counter() - started, needed / 2**20)
        return recorded

    def _splittable(self, batch: ForwardBatch, inputs: list[torch.Tensor]) -> bool:
        """Whether a decode batch can be recorded in parts: one token per sequence, every
        tensor the backend lists indexed by sequence, no layer states captured (EAGLE-3)."""
        return (batch.num_tokens == batch.batch_size
                and batch.tree_masks is None
                and getattr(self.model, "captured_parts", None) is None
                and all(t.dim() >= 1 and t.shape[0] == batch.batch_size for t in inputs))

    def _record(self, batch: ForwardBatch, start: int, end: int, sliced: bool,
                arena: torch.Tensor | None) -> tuple[_Part | None, torch.Tensor, int, int, str]:
        """Record the forward of sequences ``start:end`` of ``batch`` (all of it unless
        ``sliced``), its kernels' outputs in ``arena`` as far as it holds them: the part (None
        when it cannot be recorded), its hidden states, the bytes it allocated outside the
        arena, the bytes of an arena it takes, and why it was not recorded."""
        # the recording keeps the batch tensors it reads and replays overwrite them: give it
        # copies, so that the caller's batch is never changed behind its back
        own = dataclasses.replace(batch, attn_metadata=None, **{
            f.name: (getattr(batch, f.name)[start:end] if sliced else getattr(batch, f.name))
            .clone() for f in dataclasses.fields(batch)
            if isinstance(getattr(batch, f.name), torch.Tensor)})
        if sliced:
            for name in ("seq_lens_cpu", "extend_prefix_lens_cpu", "extend_seq_lens_cpu",
                         "req_pool_indices_cpu"):
                setattr(own, name, getattr(batch, name)[start:end])
        self.backend.init_forward_metadata(own)
        inputs = self._inputs(own) or []
        watch = _ComputeWatch()
        with cpu.recording(arena) as tape, watch:
            output = self.model(own)
        nbytes, used = watch.allocated + tape.output_bytes(arena), tape.arena_bytes
        if watch.kernel_calls != len(tape):  # a kernel operator ran without the library
            return None, output, nbytes, used, (
                f"{watch.kernel_calls - len(tape)} of its {watch.kernel_calls} kernel calls "
                "were not recorded")
        if watch.compute:
            names = ", ".join(sorted(set(watch.compute)))
            return None, output, nbytes, used, f"it runs torch ops ({names})"
        return _Part(start, end, tape, inputs, output), output, nbytes, used, ""

    def clear(self) -> None:
        """Drop every recorded graph: call it after replacing a tensor that graphs read
        (weights, packed weights, the pools); changing one's values in place needs nothing."""
        self.graphs.clear()
        self._seen.clear()

    @property
    def nbytes(self) -> int:
        """Memory the kept graphs' activations hold: the arena and what each holds alone."""
        arena = self.arena.numel() if self.arena is not None else 0
        return arena + sum(g.nbytes for g in self.graphs.values() if g is not None)
