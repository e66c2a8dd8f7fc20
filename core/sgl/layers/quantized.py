"""Block-quantized weights in the layers: held in the layouts of :mod:`sgl.kernels.quant` and
multiplied by ``sgl::linear_q4`` / ``sgl::linear_q8`` without a dense copy.

A model built inside :func:`deferred_weights` gives its linear layers, token embedding and LM
head a weight on the ``meta`` device: nothing is allocated until the first tensor for it
arrives. That tensor decides how the weight is held:

* a :class:`QuantizedTensor` (a GGUF file's ``Q4_0``/``Q4_1``/``Q8_0`` and K-quant blocks,
  repacked by the loader) is kept in its layout, ``q4``, ``q8`` or ``q6``;
* a dense tensor is kept dense, except under ``int8``/``int4`` (:data:`QUANTIZE_MODES`), where a
  linear layer rounds it to ``q8``/``q4`` blocks as it arrives and an embedding to ``q8``, and
  under ``w8a8_int8``, where a linear layer rounds it per output channel (``w8``, SGLang's
  scheme: its matmul rounds the activations to int8 per token too) and the embedding and LM head
  stay dense, as SGLang keeps them.

Once loaded, a ``w8`` linear layer holds its weight packed for the matmul
(:func:`sgl.kernels.ops.pack_int8_weight`) in place of the ``[N, K]`` integers, and its scales as
float32 ``[N]`` (:func:`pack_channel_weight`). A ``q4``/``q8`` linear layer, LM head or
embedding whose matmuls round x to int8, on a CPU whose kernel library takes it
(:meth:`~sgl.kernels.library.KernelLibrary.packs_x16`), holds its blocks in the packed layout
``q4x16``/``q8x16`` (:func:`sgl.kernels.quant.pack_x16`: the same bytes, ordered for the
integer products of 16 rows at once), ``weight_scales`` None (:func:`pack_round_x_weight`); a
``q6`` weight there becomes ``q6x16``, and elsewhere on CPU is rounded to ``q8``
(:func:`sgl.kernels.quant.requantize_q6`: the other CPU kernels take q4 and q8 only).

Fused layers take their shards one by one and the shards may differ: a ``q4`` weight that
receives a ``q8`` shard becomes ``q8`` (every 4-bit value is an 8-bit value: nothing changes),
``q6`` beside another layout becomes ``q8`` (rounded, as above), and a quantized weight that receives a dense shard in the ``gguf`` mode becomes dense (the
blocks dequantized). A weight's module keeps ``weight`` (the dense tensor, or the blocks'
integers), ``weight_scales`` (a float16 buffer, None when dense) and ``weight_layout``
(``"q4"``, ``"q8"``, ``"q6"``, a packed layout or None).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from sgl.kernels import cpu, ops, quant

__all__ = ["INT8_ACTIVATIONS", "QUANTIZE_MODES", "QuantizedTensor",
           "deferred_mode", "deferred_round_x", "deferred_weights", "dense_rows",
           "embedding_layout", "pack_channel_weight", "pack_round_x_weight", "quantized_linear",
           "resolve_int8_activations", "store_weight_rows", "widen_q6_weight"]

#: the modes that quantize dense weights at load (to 8-/4-bit blocks), and the layout of linear
#: layers under each; under any other mode (``gguf``, a checkpoint weight format's name) the
#: weights are kept as they arrive, quantized blocks staying quantized
QUANTIZE_MODES = {"int8": "q8", "int4": "q4", "w8a8_int8": quant.CHANNEL_LAYOUT}
#: the layout of a quantized token embedding (and a tied LM head) under the modes of
#: :data:`QUANTIZE_MODES` that round them (see :func:`embedding_layout`)
EMBEDDING_LAYOUT = "q8"


class QuantizedTensor:
    """A weight ``[N, K]`` as blocks of 32 values along K: ``qweight`` and ``scales`` in the
    layout ``layout`` (``"q4"``, ``"q8"`` or ``"q6"``) of :mod:`sgl.kernels.quant`."""

    __slots__ = ("layout", "qweight", "scales")

    def __init__(self, layout: str, qweight: torch.Tensor, scales: torch.Tensor) -> None:
        quant.check(layout, qweight, scales)
        self.layout = layout
        self.qweight = qweight
        self.scales = scales

    @classmethod
    def quantize(cls, layout: str, weight: torch.Tensor) -> QuantizedTensor:
        """Round a dense ``weight [N, K]`` to blocks (see :func:`sgl.kernels.quant.quantize`)."""
        return cls(layout, *quant.quantize(layout, weight))

    @property
    def shape(self) -> torch.Size:
        if self.layout == quant.CHANNEL_LAYOUT:
            return self.qweight.shape
        return torch.Size((self.qweight.shape[0], self.qweight.shape[1] * quant.BLOCK))

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes

    def dim(self) -> int:
        return 2

    def __repr__(self) -> str:
        return f"QuantizedTensor({self.layout}, {list(self.shape)})"

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedTensor:
        """The same blocks with ``fn`` applied along the rows of both tensors (a slice, a
        permutation: anything that moves rows as a whole)."""
        return QuantizedTensor(self.layout, fn(self.qweight), fn(self.scales))

    def narrow(self, dim: int, start: int, length: int) -> QuantizedTensor:
        """Rows (``dim`` 0), or whole blocks of columns (``dim`` 1: ``start`` and ``length``
        multiples of 32), as views."""
        if dim == 0:
            return self.map_rows(lambda t: t.narrow(0, start, length))
        if dim != 1:
            raise ValueError(f"a quantized weight has 2 dimensions, not {dim + 1}")
        if self.layout == quant.CHANNEL_LAYOUT:  # a scale per row: any columns
            return QuantizedTensor(self.layout, self.qweight.narrow(1, start, length),
                                   self.scales)
        if start % quant.BLOCK or length % quant.BLOCK:
            raise ValueError(f"columns {start}..{start + length} cut through blocks of "
                             f"{quant.BLOCK} values")
        b0, nb = start // quant.BLOCK, length // quant.BLOCK
        return QuantizedTensor(self.layout, self.qweight.narrow(1, b0, nb),
                               self.scales.narrow(1, b0, nb))

    def to(self, device: torch.device | str) -> QuantizedTensor:
        return self.map_rows(lambda t: t.to(device))

    def with_layout(self, layout: str) -> QuantizedTensor:
        """The values in ``layout``: ``q4`` -> ``q8`` is exact (the nibbles become int8), ``q6``
        -> ``q8`` rounds where a block's two scales need it
        (:func:`sgl.kernels.quant.requantize_q6`); anything else is only the identity."""
        if layout == self.layout:
            return self
        if (self.layout, layout) == ("q6", "q8"):
            return QuantizedTensor("q8", *quant.requantize_q6(self.qweight.cpu(),
                                                              self.scales.cpu())).to(
                self.qweight.device)
        if (self.layout, layout) != ("q4", "q8"):
            raise ValueError(f"cannot hold {self.layout} blocks as {layout}")
        q = self.qweight
        values = torch.cat([q & 0x0F, q >> 4], dim=-1).to(torch.int8)
        return QuantizedTensor("q8", values, self.scales)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return quant.dequantize(self.layout, self.qweight.contiguous(),
                                self.scales.contiguous()).to(dtype)


# -- building a model whose weights are decided by what arrives --------------------------------

#: ``--int8-activations`` values. Where a quantized (``q4``/``q8``) layer rounds, every matmul of
#: it, prefill and decode, the LM head and the experts included, rounds ``x`` to int8 per block
#: of 32 (``round_x`` of ``sgl::linear_q4``/``linear_q8``, what llama.cpp does with every
#: matmul) and multiplies integers. The kernels sum the integers exactly and scale them in one
#: float sequence at any row count, and a row's rounding is its own, so a request's tokens stay
#: independent of its batch and of the prefix cache. ``on`` rounds, ``off`` never does,
#: ``auto`` (:func:`resolve_int8_activations`) rounds a GGUF file's blocks on CPU where the
#: kernels are faster so: those files are made for llama.cpp, which multiplies them this way.
#: Each value of ``x`` moves by at most ``max|x| / 254`` of its block.
INT8_ACTIVATIONS = ("auto", "on", "off")


def resolve_int8_activations(mode: str, quantization: str, device: torch.device | str) -> bool:
    """Whether quantized matmuls round ``x`` to int8 under ``--int8-activations mode``
    (:data:`INT8_ACTIVATIONS`) for weights held as ``quantization`` says
    (:func:`sgl.engine.model_runner.resolve_quantization`'s answer) on ``device``. ``auto``
    rounds a GGUF file's blocks on CPU where :func:`sgl.kernels.cpu.round_x_faster` says the kernels
    are faster so; a dense checkpoint rounded at load (``int8``/``int4``) stays weight-only."""
    if mode not in INT8_ACTIVATIONS:
        raise ValueError(f"unknown int8_activations {mode!r} "
                         f"(expected one of {', '.join(INT8_ACTIVATIONS)})")
    if mode != "auto":
        return mode == "on"
    return (quantization == "gguf" and torch.device(device).type == "cpu"
            and cpu.round_x_faster())


_deferred: tuple[str, bool] | None = None  # (mode, round x)


@contextlib.contextmanager
def deferred_weights(mode: str, *, round_x: bool = False) -> Iterator[None]:
    """Build models inside this to let their weights be held as they arrive (see the module
    docstring); ``mode``: ``int8``/``int4`` (:data:`QUANTIZE_MODES`), or the name of the
    format the weights arrive in (``gguf``, a weight format's name). ``round_x``: whether the
    layers' quantized matmuls round x to int8 (:func:`resolve_int8_activations`); False keeps
    every product exact."""
    global _deferred
    if not mode or mode == "none":
        raise ValueError(f"quantization mode {mode!r}: a dense model needs no deferred weights")
    previous, _deferred = _deferred, (mode, bool(round_x))
    try:
        yield
    finally:
        _deferred = previous


def deferred_round_x() -> bool:
    """Whether the layers built now round x to int8 in their quantized matmuls (the
    ``round_x`` of :func:`deferred_weights`; False outside it)."""
    return _deferred is not None and _deferred[1]


def deferred_mode() -> str | None:
    """The mode of the enclosing :func:`deferred_weights`, or None outside one."""
    return None if _deferred is None else _deferred[0]


def embedding_layout(mode: str | None) -> str | None:
    """The layout a dense token embedding (and LM head) is rounded to under ``mode``: 8-bit
    blocks under ``int8``/``int4``; None (dense) under ``w8a8_int8`` and modes that keep what
    arrives."""
    layout = QUANTIZE_MODES.get(mode or "")
    return None if layout in (None, quant.CHANNEL_LAYOUT) else EMBEDDING_LAYOUT


def _blocks(layout: str, rows: int, cols: int, device: torch.device) -> tuple[torch.Tensor,
                                                                              torch.Tensor]:
    if layout == quant.CHANNEL_LAYOUT:
        return (torch.empty((rows, cols), dtype=torch.int8, device=device),
                torch.empty((rows, 1), dtype=torch.float32, device=device))
    dtype = torch.int8 if layout == "q8" else torch.uint8
    nb = cols // quant.BLOCK
    # zero scales: rows not loaded yet are zeros (a fused layer converting its layout reads them)
    return (torch.empty((rows, nb, quant.FORMATS[layout]), dtype=dtype, device=device),
            torch.zeros((rows, nb, 2), dtype=torch.float16, device=device))


def _hold(module: nn.Module, layout: str | None, weight: torch.Tensor,
          scales: torch.Tensor | None) -> None:
    module.weight = nn.Parameter(weight, requires_grad=False)
    module.weight.weight_loader = module.weight_loader  # type: ignore[attr-defined]
    module.weight.takes_quantized = True  # type: ignore[attr-defined]
    module.weight_scales = scales  # a registered buffer (None when dense)
    module.weight_layout = layout
    for head in getattr(module, "tied_heads", ()):  # an LM head sharing this embedding
        head.weight, head.weight_scales, head.weight_layout = (
            module.weight, module.weight_scales, layout)


def _current(module: nn.Module) -> QuantizedTensor | torch.Tensor:
    if module.weight_layout is None:
        return module.weight.data
    return QuantizedTensor(module.weight_layout, module.weight.data, module.weight_scales)


def store_weight_rows(module: nn.Module, offset: int, loaded: torch.Tensor | QuantizedTensor,
                      what: str, *, quantize_as: str | None) -> None:
    """Copy ``loaded`` (``[rows, K]``, dense or quantized) into rows ``offset:offset + rows``
    of ``module.weight`` (``[N, K]``), allocating or converting the weight first as the module
    docstring says. ``quantize_as``: the layout a dense ``loaded`` is rounded to (None: kept
    dense)."""
    weight = module.weight
    rows, cols = module.weight_shape
    if tuple(loaded.shape) != (loaded.shape[0], cols) or offset + loaded.shape[0] > rows:
        raise ValueError(f"{what}: expected {cols} columns and at most {rows - offset} rows, "
                         f"got shape {tuple(loaded.shape)}")
    if not isinstance(loaded, QuantizedTensor) and quantize_as is not None \
            and (quantize_as == quant.CHANNEL_LAYOUT or cols % quant.BLOCK == 0):
        loaded = QuantizedTensor.quantize(quantize_as, loaded)
    layout = loaded.layout if isinstance(loaded, QuantizedTensor) else None
    if weight.is_meta:  # the first tensor for this weight decides how it is held
        if layout is None:
            _hold(module, None, torch.empty((rows, cols), dtype=module.weight_dtype,
                                            device=module.weight_device), None)
        else:
            _hold(module, layout, *_blocks(layout, rows, cols, module.weight_device))
    elif module.weight_layout != layout:
        held = _current(module)
        if module.weight_layout is None:  # dense stays dense
            loaded = loaded.dequantize(module.weight_dtype)
        elif layout is None or quant.CHANNEL_LAYOUT in (layout, module.weight_layout):
            # a dense shard, or blocks beside channels: the whole weight becomes dense
            _hold(module, None, held.dequantize(module.weight_dtype), None)
            if layout is not None:
                loaded = loaded.dequantize(module.weight_dtype)
        else:  # two block layouts: both as q8
            if module.weight_layout != "q8":
                widened = held.with_layout("q8")
                _hold(module, "q8", widened.qweight.contiguous(), widened.scales.contiguous())
            loaded = loaded.with_layout("q8")
    with torch.no_grad():
        if module.weight_layout is None:
            module.weight.data.narrow(0, offset, loaded.shape[0]).copy_(loaded)
        else:
            module.weight.data.narrow(0, offset, loaded.shape[0]).copy_(loaded.qweight)
            module.weight_scales.narrow(0, offset, loaded.shape[0]).copy_(loaded.scales)


def zero_weight_rows(module: nn.Module, start: int) -> None:
    """Zero rows ``start:`` of a held weight (padding rows: zero scales dequantize to 0)."""
    with torch.no_grad():
        module.weight.data[start:].zero_()
        if module.weight_scales is not None:
            module.weight_scales[start:].zero_()


def init_weight(module: nn.Module, rows: int, cols: int, dtype: torch.dtype | None,
                device: torch.device | str | None, loader: Callable[..., None]) -> None:
    """Give ``module`` its ``weight [rows, cols]``: allocated now, or on the ``meta`` device
    inside :func:`deferred_weights` (held as the first loaded tensor says)."""
    module.weight_shape = (rows, cols)
    module.weight_dtype = dtype or torch.get_default_dtype()
    module.weight_device = torch.device(device) if device is not None else torch.device("cpu")
    module.weight_mode = deferred_mode()
    #: whether its quantized matmuls round x to int8 (--int8-activations, INT8_ACTIVATIONS)
    module.round_x = deferred_round_x()
    place = "meta" if module.weight_mode is not None else device
    module.weight = nn.Parameter(torch.empty((rows, cols), dtype=dtype, device=place),
                                 requires_grad=False)
    module.weight.weight_loader = loader  # type: ignore[attr-defined]
    module.weight.takes_quantized = True  # type: ignore[attr-defined]
    module.register_buffer("weight_scales", None)
    module.weight_layout = None


def dense_rows(module: nn.Module, index: torch.Tensor | None = None) -> torch.Tensor:
    """``module.weight`` (rows ``index`` of it) as a dense tensor of the module's dtype."""
    if module.weight_layout in quant.X16_LAYOUTS:
        qweight, scales = quant.unpack_x16(module.weight_layout, module.weight.data)
        layout = quant.X16_LAYOUTS[module.weight_layout][0]
        if index is not None:
            qweight, scales = qweight[index], scales[index]
        return QuantizedTensor(layout, qweight, scales).dequantize(module.weight_dtype)
    weight = module.weight if index is None else module.weight[index]
    if module.weight_layout is None:
        return weight
    scales = module.weight_scales if index is None else module.weight_scales[index]
    return QuantizedTensor(module.weight_layout, weight, scales).dequantize(module.weight_dtype)




def pack_channel_weight(module: nn.Module) -> None:
    """Replace a loaded ``w8`` weight (int8 ``[N, K]``, scales ``[N, 1]``) by what
    ``sgl::linear_w8a8`` takes: its packed copy and the scales as float32 ``[N]``."""
    if module.weight.dtype == torch.uint8:  # packed already
        return
    module.weight = nn.Parameter(ops.pack_int8_weight(module.weight.data), requires_grad=False)
    module.weight_scales = module.weight_scales.reshape(-1).contiguous()


def pack_round_x_weight(module: nn.Module) -> None:
    """Hold a loaded ``q4``/``q8``/``q6`` weight of a module whose matmuls round x to int8
    (``module.round_x``) in its packed layout, where the CPU kernel library multiplies that
    layout (:func:`sgl.kernels.cpu.packs_x16`) and its rows are whole groups of 16. Otherwise a
    ``q6`` weight on CPU becomes ``q8`` (the other CPU kernels take q4 and q8) and the rest is
    left as it is. LM heads tied to the module follow it."""
    layout = module.weight_layout
    if layout not in ("q4", "q8", "q6") or module.weight.device.type != "cpu":
        return
    with torch.no_grad():
        if (module.round_x and module.weight.shape[0] % quant.X16_GROUP == 0
                and cpu.packs_x16()):
            packed = quant.pack_x16(layout, module.weight.data, module.weight_scales)
            _hold(module, f"{layout}x16", packed, None)
        else:
            widen_q6_weight(module)


def widen_q6_weight(module: nn.Module) -> None:
    """Hold a loaded ``q6`` weight as ``q8`` (:func:`sgl.kernels.quant.requantize_q6`), for
    kernels that take q4 and q8 only; any other weight is left as it is."""
    if module.weight_layout == "q6":
        with torch.no_grad():
            q8 = _current(module).with_layout("q8")
        _hold(module, "q8", q8.qweight, q8.scales)


def quantized_linear(x: torch.Tensor, layout: str, qweight: torch.Tensor,
                     scales: torch.Tensor, bias32: torch.Tensor | None, *,
                     round_x: bool = False) -> torch.Tensor:
    """``x @ W^T + bias`` for ``x [..., K]`` and a quantized ``W``: the kernel operator for
    float32 and bfloat16 ``x`` on CPU, the reference (dequantize, then multiply) otherwise.
    ``round_x``: round x to int8 per block first and multiply integers
    (:data:`INT8_ACTIVATIONS`)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    x2 = x.reshape(rows, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if layout in quant.X16_LAYOUTS:  # packed (pack_round_x_weight); every row rounded
        if not round_x:
            raise ValueError(f"a {layout} weight is multiplied with round_x only")
        bits = {"q4x16": 4, "q8x16": 8, "q6x16": 6}[layout]
        cpu_kernel = x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
        out = (torch.ops.sgl.linear_qx16 if cpu_kernel else ops.linear_qx16)(
            x2, qweight, bits, bias32)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])
    if layout == quant.CHANNEL_LAYOUT:  # packed (pack_channel_weight); every row rounded
        n = scales.numel()
        cpu_kernel = x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
        out = (torch.ops.sgl.linear_w8a8 if cpu_kernel else ops.linear_w8a8)(
            x2, qweight, scales, bias32)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)
    if layout == "q6":  # no CPU kernel but the packed one's (pack_round_x_weight)
        out = ops.linear_q6(x2, qweight, scales, bias32, round_x)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], qweight.shape[0])
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
        op = torch.ops.sgl.linear_q4 if layout == "q4" else torch.ops.sgl.linear_q8
        out = op(x2, qweight, scales, bias32, round_x)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], qweight.shape[0])
    op: Any = ops.linear_q4 if layout == "q4" else ops.linear_q8
    out = op(x2, qweight, scales, bias32, round_x)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], qweight.shape[0])
