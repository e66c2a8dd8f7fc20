"""CUDA graphs for decode: every decode batch size captured once at start-up, then replayed.

A decode step of a small batch on a GPU is bound by kernel launches: hundreds of small kernels,
each launched from Python. :class:`CudaGraphRunner` records the launches of one decode forward
per batch size of :func:`capture_batch_sizes` into a CUDA graph at start-up (largest first, all
in one memory pool, so the smaller graphs reuse the larger one's activations) and replays the
whole forward with one launch afterwards. It is what the CPU kernel library's
:class:`~sgl.kernels.library.DecodeGraphs` do for the CPU's kernel calls, with two differences:
every size is captured before serving, and a batch runs in the smallest captured size that holds
it, the rows beyond it padding.

A captured graph reads fixed device addresses, so the runner owns static tensors of
``max_bs`` rows (token ids, positions, request rows, sequence lengths, new slots, and the two
per-sequence extend lengths). A graph of size ``bs`` is captured over a decode
:class:`~sgl.forward_batch.ForwardBatch` whose tensors are their first ``bs`` rows, every row a
padding row: token 0 at position 0 of request row 0, sequence length 1, new slot 0, the slot
the KV pool reserves for padding (:mod:`sgl.kvcache.pool`). Before a replay the runner pads the
batch with such rows, lets the attention backend plan the padded batch
(:meth:`~sgl.attention.base.BaseAttentionBackend.init_forward_metadata`), and copies the padded
batch's tensors and the tensors the backend lists in
:meth:`~sgl.attention.base.BaseAttentionBackend.graph_inputs` into the captured ones. A padding
row writes its key and value at slot 0 only, and its hidden state is dropped.

The attention backend chooses its kernels; the runner needs only ``graph_inputs``: every
per-batch tensor its kernels read, with shapes that depend on the batch size alone. A backend
that returns None (the default) cannot be captured: :class:`CudaGraphUnsupported`.

The hidden states :meth:`CudaGraphRunner.forward` returns are rows of the graph's own output:
valid until the next forward, as with the CPU kernel library's replays. The graph object sits behind
:func:`_capture`, so everything else (padding, copying, slicing) runs, and is tested, on CPU.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from sgl.forward_batch import ForwardBatch, ForwardMode
from sgl.kernels.library import DecodeGraphs

if TYPE_CHECKING:
    from sgl.attention.base import BaseAttentionBackend
    from sgl.kvcache.pool import KVPool, ReqToTokenPool

__all__ = ["CudaGraphRunner", "CudaGraphUnsupported", "capture_batch_sizes", "padding_batch"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: the batch tensors the runner keeps static copies of, in the order it copies them
_BATCH_TENSORS = ("input_ids", "positions", "req_pool_indices", "seq_lens",
                  "extend_prefix_lens", "extend_seq_lens", "out_cache_loc")
#: what a padding row holds in each of them: token 0 at position 0 of request row 0, one token
#: long, written at slot 0 (the KV pool's padding slot)
_PADDING = {"input_ids": 0, "positions": 0, "req_pool_indices": 0, "seq_lens": 1,
            "extend_prefix_lens": 0, "extend_seq_lens": 1, "out_cache_loc": 0}
#: eager forwards before capturing (lazy initialisation, autotuning and allocator warm-up
#: happen outside the graph)
WARMUP_FORWARDS = 2


class CudaGraphUnsupported(RuntimeError):
    """The model or attention backend cannot be captured into a CUDA graph; the runner should
    decode eagerly."""


def capture_batch_sizes(max_bs: int) -> list[int]:
    """The batch sizes :class:`CudaGraphRunner` captures for ``max_bs``: 1, 2, 4, 8, then every
    multiple of 8 up to ``max_bs``, and ``max_bs`` itself; e.g. 20 -> ``[1, 2, 4, 8, 16, 20]``.

    A batch of ``n`` rows runs in the smallest of them that is at least ``n``, so a batch pads
    by at most 7 rows (fewer below 8), while the number of graphs (memory and start-up time)
    grows by one per 8 rows."""
    if max_bs < 1:
        raise ValueError(f"the largest CUDA graph batch size must be at least 1, got {max_bs}")
    sizes = {bs for bs in (1, 2, 4) if bs < max_bs}
    sizes.update(range(8, max_bs, 8))
    sizes.add(max_bs)
    return sorted(sizes)


def _capture(fn: Callable[[], T], pool: Any) -> Callable[[], T]:
    """Capture ``fn``'s CUDA work into a graph that allocates from ``pool``; return a callable
    that replays it and returns what ``fn`` returned when captured (the graph's own tensors,
    which each replay overwrites). The only code of this module that needs a GPU."""
    if not torch.cuda.is_available():
        raise CudaGraphUnsupported("CUDA graphs need a CUDA device; torch sees none")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()

    def replay() -> T:
        graph.replay()
        return out

    return replay


@dataclasses.dataclass
class _Graph:
    batch: ForwardBatch  # the padding batch captured (keeps the backend's metadata alive)
    inputs: list[torch.Tensor]  # the backend's graph_inputs of that batch, read by the graph
    replay: Callable[[], tuple[torch.Tensor, list[torch.Tensor] | None]]


class CudaGraphRunner(DecodeGraphs):
    """Captures the decode forwards of ``model`` at :func:`capture_batch_sizes` of ``max_bs``
    (:meth:`capture`) and runs decode batches by replaying them (:meth:`forward`).

    :param model: the model; ``model(batch)`` returns hidden states ``[num_tokens, hidden]``.
    :param attn_backend: the attention backend the model's layers call (``batch.attn_backend``).
    :param kv_pool: the KV pool the batches write to; padding rows write its slot 0.
    :param req_to_token_pool: the request table the batches read.
    :param max_bs: the largest batch size captured.
    :param device: where the model runs (a CUDA device for real graphs).
    :param show_progress: draw a progress bar over the sizes while capturing.
    """

    def __init__(self, model: torch.nn.Module, attn_backend: BaseAttentionBackend, *,
                 kv_pool: KVPool, req_to_token_pool: ReqToTokenPool, max_bs: int,
                 device: torch.device | str, show_progress: bool = True) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool
        self.device = torch.device(device)
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = max_bs
        self.show_progress = show_progress
        #: batch size -> its captured graph, filled by capture()
        self.graphs: dict[int, _Graph] = {}
        self.replays = 0  # for tests and logs
        # the graphs read these; created outside inference mode so that copies may refill them
        self._static = {name: torch.full((max_bs,), _PADDING[name], dtype=torch.int64,
                                         device=self.device) for name in _BATCH_TENSORS}

    def _padding_batch(self, bs: int) -> ForwardBatch:
        """A decode batch of ``bs`` padding rows over the first rows of the static tensors."""
        return padding_batch(bs, self._static, kv_pool=self.kv_pool,
                             req_to_token_pool=self.req_to_token_pool,
                             attn_backend=self.attn_backend)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per batch size, largest first, in one memory pool; a progress bar
        "Capturing CUDA graphs" over the sizes; logs the time and the device memory taken.

        :raises CudaGraphUnsupported: the attention backend gives no ``graph_inputs`` for a
            decode batch, there is no CUDA device, or capturing failed (a host
            synchronisation in the forward, out of memory); the graphs captured so far are
            dropped."""
        from tqdm.auto import tqdm

        start, free_before = time.perf_counter(), _free_memory(self.device)
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        sizes = tqdm(sorted(self.batch_sizes, reverse=True), desc="Capturing CUDA graphs",
                     unit="graph", disable=not self.show_progress)
        try:
            for bs in sizes:
                sizes.set_postfix(bs=bs)
                self.graphs[bs] = self._capture_size(bs, pool)
        except BaseException:
            self.graphs.clear()
            raise
        finally:
            sizes.close()
        free_after = _free_memory(self.device)
        memory = "" if free_before is None or free_after is None else \
            f", {(free_before - free_after) / 2**20:.0f} MiB"
        logger.info("captured CUDA graphs of decode batch sizes %s in %.1f s%s "
                    "(--disable-cuda-graph turns this off)",
                    ", ".join(map(str, self.batch_sizes)), time.perf_counter() - start, memory)

    def _capture_size(self, bs: int, pool: Any) -> _Graph:
        batch = self._padding_batch(bs)
        self.attn_backend.init_forward_metadata(batch)
        inputs = self.attn_backend.graph_inputs(batch)
        if inputs is None:
            raise CudaGraphUnsupported(
                f"the {self.attn_backend.name} attention backend on {self.device} lists no "
                "graph_inputs for a decode batch, so its decode forward cannot be captured "
                "into a CUDA graph; run with --disable-cuda-graph or pick an attention "
                "backend whose graph_inputs lists the tensors its decode kernels read")
        model = self.model

        def run() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
            hidden = model(batch)
            parts = getattr(model, "captured_parts", None)
            return hidden, None if parts is None else list(parts)

        for _ in range(WARMUP_FORWARDS):
            run()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        try:
            replay = _capture(run, pool)
        except CudaGraphUnsupported:
            raise
        except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is one too
            raise CudaGraphUnsupported(
                f"capturing the decode forward of batch size {bs} into a CUDA graph failed: "
                f"{exc}. The model's or the {self.attn_backend.name} attention backend's "
                "decode forward must not synchronise with the host (.item(), .tolist(), a "
                "CPU tensor) and needs memory beyond the KV pool; lower --cuda-graph-max-bs "
                "or run with --disable-cuda-graph") from exc
        return _Graph(batch, list(inputs), replay)

    def prepare(self, max_bs: int | None, limit: int, *, show_progress: bool = True
                ) -> list[int]:
        """The sizes :meth:`capture` captured (at start-up, with the model runner)."""
        return sorted(self.graphs)

    def can_run(self, batch: ForwardBatch) -> bool:
        """Whether :meth:`forward` takes ``batch``: a decode batch (one token per sequence, no
        token trees) of at most the largest captured size, once :meth:`capture` has run."""
        n = int(batch.seq_lens.shape[0])
        return (batch.mode == ForwardMode.DECODE and bool(self.graphs)
                and 1 <= n <= max(self.graphs) and batch.num_tokens == n
                and (batch.tree_masks is None or all(m is None for m in batch.tree_masks)))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of a decode batch of ``n`` rows, by replaying the
        smallest captured size that holds it; ``init_forward_metadata(batch)`` need not have
        run. The result is the graph's output tensor: valid until the next forward."""
        if not self.can_run(batch):
            raise ValueError(f"CUDA graphs run decode batches of 1 to "
                             f"{max(self.graphs, default=0)} sequences without token trees "
                             f"(after capture()); got a {batch.mode.value} batch of "
                             f"{int(batch.seq_lens.shape[0])} sequences; check can_run first")
        n = int(batch.seq_lens.shape[0])
        bs = next(size for size in sorted(self.graphs) if size >= n)
        graph = self.graphs[bs]
        padded = _pad(batch, bs)
        self.attn_backend.init_forward_metadata(padded)
        inputs = self.attn_backend.graph_inputs(padded)
        if inputs is None:
            raise CudaGraphUnsupported(f"the {self.attn_backend.name} attention backend "
                                       "listed graph_inputs when capturing, none now")
        self._copy_inputs(graph, padded, inputs)
        hidden, parts = graph.replay()
        self.replays += 1
        if parts is not None:
            self.model.captured_parts = [p[:n] for p in parts]
        return hidden[:n]

    def _copy_inputs(self, graph: _Graph, padded: ForwardBatch,
                     inputs: list[torch.Tensor]) -> None:
        """The padded batch's tensors into the static ones (the model's code may read any of
        them: Phi-3's longrope reads ``seq_lens``), then the backend's graph inputs into the
        captured ones, in the same order."""
        for name in _BATCH_TENSORS:
            getattr(graph.batch, name).copy_(getattr(padded, name))
        if len(inputs) != len(graph.inputs):
            raise RuntimeError(f"the {self.attn_backend.name} attention backend lists "
                               f"{len(inputs)} graph_inputs for a decode batch of "
                               f"{padded.batch_size} rows, {len(graph.inputs)} when captured")
        for i, (captured, new) in enumerate(zip(graph.inputs, inputs)):
            if captured.shape != new.shape or captured.dtype != new.dtype:
                raise RuntimeError(
                    f"graph input {i} of the {self.attn_backend.name} attention backend is "
                    f"{new.dtype} {tuple(new.shape)} for a decode batch of {padded.batch_size} "
                    f"rows, {captured.dtype} {tuple(captured.shape)} when captured: a graph "
                    "input's shape may depend on the batch size only")
            captured.copy_(new)


def padding_batch(bs: int, tensors: dict[str, torch.Tensor] | None = None, *,
                  kv_pool: KVPool, req_to_token_pool: ReqToTokenPool,
                  attn_backend: BaseAttentionBackend,
                  device: torch.device | str = "cpu") -> ForwardBatch:
    """A decode batch of ``bs`` padding rows (token 0 at position 0 of request row 0, written
    at the KV pool's padding slot 0): over the first rows of ``tensors`` (one int64 tensor per
    batch tensor, of at least ``bs`` rows), which it fills, or over new tensors on ``device``."""
    if tensors is None:
        tensors = {name: torch.empty(bs, dtype=torch.int64, device=device)
                   for name in _BATCH_TENSORS}
    for name, tensor in tensors.items():
        tensor.fill_(_PADDING[name])
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        **{name: tensor[:bs] for name, tensor in tensors.items()},
        **{f"{name}_cpu": [_PADDING[name]] * bs for name in _host_copies()},
        req_to_token_pool=req_to_token_pool, kv_pool=kv_pool, attn_backend=attn_backend)


def _pad(batch: ForwardBatch, bs: int) -> ForwardBatch:
    """``batch`` with padding rows appended up to ``bs`` rows, in its tensors and in the Python
    lists it fills, without its attention metadata (the caller's batch is not changed)."""
    n = int(batch.seq_lens.shape[0])
    extra = bs - n

    def pad(name: str) -> torch.Tensor:
        tensor = getattr(batch, name)
        if not extra:
            return tensor
        return torch.cat([tensor, tensor.new_full((extra,), _PADDING[name])])

    def pad_list(name: str) -> list[int]:
        values = getattr(batch, f"{name}_cpu")
        if not values and name == "seq_lens":  # batch_size counts them
            values = getattr(batch, name).tolist()
        return list(values) + [_PADDING[name]] * extra if values else []

    return dataclasses.replace(
        batch, **{name: pad(name) for name in _BATCH_TENSORS},
        **{f"{name}_cpu": pad_list(name) for name in _host_copies()},
        tree_masks=None, attn_metadata=None)


def _host_copies() -> list[str]:
    """The batch tensors of which :class:`~sgl.forward_batch.ForwardBatch` also holds a Python
    list (``seq_lens_cpu`` and the like), for backends that plan on the host."""
    fields = {f.name for f in dataclasses.fields(ForwardBatch)}
    return [name for name in _BATCH_TENSORS if f"{name}_cpu" in fields]


def _free_memory(device: torch.device) -> int | None:
    """Free bytes of a CUDA device; None elsewhere."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.mem_get_info(device)[0])
