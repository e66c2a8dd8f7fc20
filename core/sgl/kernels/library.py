"""What a native kernel library gives the core, besides its operators (:mod:`sgl.kernels.ops`).

A kernel plugin registers a subclass of :class:`KernelLibrary` under a device type
(``sgl_register_kernel_libraries``, ``register("cpu", "pkg.module:Class")``). The core builds
it the first time a kernel could run, tells it the instruction-set level once
(:meth:`~KernelLibrary.set_level`), and from then on calls the ``torch.ops.sgl`` operators,
which the library implements for its device. The controls here are the rest: the library's own
threads, and recording a forward's kernel calls for replay (:meth:`KernelLibrary.decode_graphs`,
the library's :class:`DecodeGraphs`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from sgl.attention.base import BaseAttentionBackend
    from sgl.forward_batch import ForwardBatch

__all__ = ["DecodeGraphs", "KernelLibrary", "KernelLibraryUnavailable", "KernelTape",
           "PackedWeight"]


class DecodeGraphs(abc.ABC):
    """Decode forwards recorded once and replayed without the Python around their kernels:
    CUDA graphs on a GPU (:class:`sgl.engine.cuda_graph.CudaGraphRunner`), a kernel library's
    recordings of its calls on CPU (:meth:`KernelLibrary.decode_graphs`). The model runner's one
    decode path: a decode batch they :meth:`can_run` goes to :meth:`forward`, every other batch
    runs the model.

    As with CUDA graphs, the hidden states a replay returns are the recording's own tensor:
    valid until the next forward.
    """

    #: forwards replayed so far (for tests and logs)
    replays: int = 0

    @abc.abstractmethod
    def can_run(self, batch: ForwardBatch) -> bool:
        """Whether :meth:`forward` takes this decode batch."""

    @abc.abstractmethod
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The hidden states of a decode batch whose attention metadata is not planned yet
        (the graphs plan what they replay)."""

    def prepare(self, max_bs: int | None, limit: int, *, show_progress: bool = True
                ) -> list[int]:
        """Before serving: make the batch sizes up to ``max_bs`` (None: the graphs' own
        default; never above ``limit``, the most sequences a batch holds) ready, so that no
        served batch waits for a recording. The sizes ready."""
        return []

    def clear(self) -> None:
        """Drop what was recorded (after replacing a tensor the recordings read)."""


class PackedWeight(abc.ABC):
    """A prepared copy of a CPU weight ``[n, k]`` for :func:`sgl.layers.packed_linear.linear`:
    oneDNN's layout, or a kernel library's own (:meth:`KernelLibrary.pack_linear`).

    Held as a plain attribute, so ``module.to(...)`` leaves it behind (:func:`linear` then falls
    back to the plain weight) and ``copy.deepcopy`` drops it (an opaque oneDNN tensor cannot be
    copied).
    """

    def __init__(self, kind: str, tensor: torch.Tensor, n: int, dtype: torch.dtype) -> None:
        self.kind = kind  # the layout: "onednn", or a kernel library's name for its own
        self.tensor = tensor
        self.n = n
        self.dtype = dtype

    def __deepcopy__(self, memo: dict[int, object]) -> None:
        return None

    @abc.abstractmethod
    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """``F.linear(x, W, bias)`` through this copy for CPU ``x [..., k]`` of its dtype; None
        where ``F.linear`` on the plain weight is the faster choice for ``x``."""


class KernelLibraryUnavailable(RuntimeError):
    """The library is installed but cannot run here (its compiled part is missing, or built
    for another machine); the message says why and what to do."""


@dataclass
class KernelTape:
    """The kernel calls one thread made between :meth:`KernelLibrary.record_begin` and
    :meth:`KernelLibrary.record_end`: ``calls`` in the library's own encoding, and every tensor
    they read (``inputs``) or allocated (``outputs``), kept alive so their memory is never handed
    to anything else. :meth:`replay` runs the calls again on whatever those tensors hold now.

    Outputs recorded with an arena are views of it (those that fit); ``arena_bytes`` is how much
    of an arena the calls' outputs take, measured with or without one."""

    library: KernelLibrary | None = None
    calls: Any = None
    inputs: list[torch.Tensor] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    count: int = 0  # the number of calls
    arena_bytes: int = 0

    def __len__(self) -> int:
        return self.count

    @property
    def names(self) -> list[str]:
        """The kernel of each call, in order (for logs and tests)."""
        return self.library.call_names(self) if self.library is not None else []

    def output_bytes(self, arena: torch.Tensor | None = None) -> int:
        """Memory of the tensors the calls allocated (the activations a replay reuses), those
        in ``arena`` left out."""
        skip = arena.untyped_storage().data_ptr() if arena is not None else None
        seen: dict[int, int] = {}
        for t in self.outputs:
            storage = t.untyped_storage()
            if storage.data_ptr() != skip:
                seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    def replay(self) -> None:
        """Run the recorded calls in order; RuntimeError naming the first that fails."""
        if self.library is None or not self.count:
            return
        self.library.replay(self)


class KernelLibrary(abc.ABC):
    """The controls of one device's kernel library (see the module docstring)."""

    #: the instruction-set levels it has kernels for, best first (a machine runs its own and
    #: every one below it; :func:`sgl.kernels.cpu.kernel_levels`)
    levels: ClassVar[tuple[str, ...]] = ()

    @abc.abstractmethod
    def detect_isa(self) -> str:
        """The best of :attr:`levels` this machine runs (``none`` where it runs none of
        them)."""

    @abc.abstractmethod
    def set_level(self, level: str, emulated: bool = False) -> None:
        """Run the kernels of ``level`` (one of :attr:`levels`) from now on; ``emulated``: a
        level of :meth:`emulated_levels`, run in software."""

    def emulated_levels(self) -> tuple[str, ...]:
        """The levels above :meth:`detect_isa` the library can run with their instructions done
        in software: correct and slow, for testing a level's kernels on a CPU without it."""
        return ()

    @abc.abstractmethod
    def set_threads(self, threads: int) -> int:
        """Use ``threads`` threads (the caller included) in the kernels; the number in use."""

    @abc.abstractmethod
    def record_begin(self, arena: torch.Tensor | None = None) -> None:
        """Start keeping this thread's kernel calls (RuntimeError if it already does). With
        ``arena`` (a contiguous 1-D uint8 tensor) the calls' outputs are carved from it, one
        after the other, as far as it holds them; recordings that share an arena must never
        replay at the same time."""

    @abc.abstractmethod
    def record_end(self) -> KernelTape:
        """Stop keeping them; the calls kept since :meth:`record_begin`."""

    @abc.abstractmethod
    def replay(self, tape: KernelTape) -> None:
        """Run ``tape``'s calls again, in one go; RuntimeError naming the first that fails."""

    def replay_parts(self, tapes: list[KernelTape]) -> None:
        """Run several tapes that write no tensor in common, one kernel thread on each where the
        library can (the parts of a split decode batch, :meth:`decode_graphs`); by default one
        after the other. RuntimeError naming the first call that fails."""
        for tape in tapes:
            tape.replay()

    def call_names(self, tape: KernelTape) -> list[str]:
        """The kernel of each call on ``tape``, in order (for logs and tests)."""
        return [f"call {i}" for i in range(tape.count)]

    def pack_linear(self, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> PackedWeight | None:
        """A prepared copy of a 2-D ``weight [out, in]`` (and ``bias``) of this device for the
        library's matmuls (:func:`sgl.layers.packed_linear.pack_weight` asks), or None where it
        has none for that dtype."""
        return None

    def extend_attention_faster(self, dtype: torch.dtype) -> bool:
        """Whether ``sgl::extend_attention`` beats torch's SDPA (on one thread) for ``dtype`` at
        the level and threads in use."""
        return False

    def decode_attention_fits(self, num_heads: int, num_kv_heads: int, head_dim: int,
                              v_dim: int) -> bool:
        """Whether the attention kernels take heads of this shape."""
        return False

    def round_x_faster(self) -> bool:
        """Whether, at the level in use, the quantized matmuls (``linear_q4``/``linear_q8``)
        are at least as fast with ``round_x`` (x rounded to int8 per block, integer products)
        as exact at every row count: where they are, ``--int8-activations auto`` rounds a GGUF
        file's matmuls as llama.cpp does (``on`` rounds them regardless)."""
        return False

    def packs_x16(self) -> bool:
        """Whether, at the level in use, the library multiplies ``round_x`` weights packed in
        the x16 layouts (:func:`sgl.kernels.quant.pack_x16`, ``sgl::linear_qx16``, rows of
        ``sgl::embedding_q``): a quantized layer that rounds its activations then holds its
        weight so once loaded (:func:`sgl.layers.quantized.pack_round_x_weight`)."""
        return False

    def bfloat16_faster(self, level: str) -> bool:
        """Whether at ``level`` bfloat16 weights decode faster than float32 (the level has
        bfloat16 instructions, and its matmuls read half the bytes): ``--dtype auto`` picks
        bfloat16 there."""
        return False

    def decode_graphs(self, model: torch.nn.Module, backend: BaseAttentionBackend
                      ) -> DecodeGraphs | None:
        """The library's replays of decode forwards of ``model`` with attention ``backend``
        (None: it has none; decode steps then run the model each time)."""
        return None

    def describe(self) -> str:
        """A few words for logs: what the library is and where it was built."""
        return type(self).__name__
