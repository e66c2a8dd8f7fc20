"""The quantized weight layouts of the kernel contract (``sgl::linear_q4``, ``sgl::linear_q8``,
``sgl::embedding_q``).

A quantized weight ``W [N, K]`` (K a multiple of 32) is cut along K into blocks of 32 values,
and each block stores small integers ``q`` and two float16 numbers, a scale ``d`` and an
offset ``m``, with ``W = d * q + m``:

* **q4**: ``qweight`` uint8 ``[N, K/32, 16]``; byte ``j`` of block ``b`` holds value ``32b + j``
  in its low nibble and ``32b + j + 16`` in its high nibble (``q`` in 0..15). This is the byte
  order of GGUF's ``Q4_0`` and ``Q4_1`` blocks, which map onto it as they are (``Q4_0``: ``m =
  -8 d``).
* **q8**: ``qweight`` int8 ``[N, K/32, 32]``, value ``32b + j`` at byte ``j`` (``q`` in
  -128..127). GGUF's ``Q8_0`` maps onto it with ``m = 0``.

``scales`` is float16 ``[N, K/32, 2]``: ``(d, m)`` of each block. Both layouts keep a row's
blocks together, so rows can be sliced (tensor parallelism), permuted and concatenated (fused
projections) without touching the blocks.

One layout has a scale per output channel instead of per block, SGLang's ``w8a8_int8`` weights
(``sgl::linear_w8a8``, which rounds the activations to int8 too):

* **w8**: ``qweight`` int8 ``[N, K]`` (``q`` in -127..127), ``scales`` float32 ``[N, 1]``,
  ``W = scale * q``. Rows and columns can be sliced as they are; the matmul takes the weight
  packed (:func:`sgl.kernels.ops.pack_int8_weight`), which a layer does once loaded.

:func:`quantize` makes these from a float weight (round to nearest per block, ``d`` and ``m``
from the block's range); :func:`dequantize` gives the float32 weight back.

Two layouts hold q4 and q8 weights packed for the integer products of ``round_x``
(``sgl::linear_qx16``), where the CPU kernel library packs them once loaded
(:meth:`~sgl.kernels.library.KernelLibrary.packs_x16`):

* **q4x16**, **q8x16**: uint8 ``[N/16, K/32, B]`` (N a multiple of 16): for each group of 16
  rows of W, block after block, the block's integers in the order of AVX512-VNNI's ``vpdpbusd``
  with the 16 rows in its 32-bit lanes (q4: 4 vectors of 64 bytes, lane ``c`` of vector ``i``
  holding bytes ``4i .. 4i + 3`` of row ``c``'s 16; q8: 8 vectors, lane ``c`` of vector ``i``
  values ``4i .. 4i + 3`` of row ``c`` plus 128, as unsigned bytes), then the 16 rows' ``d``
  and their ``m`` as float16: ``B`` = 320 (q4) or 576 (q8). A thread's share of the groups is
  then one sequential stream of memory, every byte of it used (:func:`pack_x16`,
  :func:`unpack_x16`).
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "CHANNEL_LAYOUT", "FORMATS", "LAYOUTS", "X16_GROUP", "X16_LAYOUTS", "check",
           "dequantize", "integers", "pack_x16", "quantize", "unpack_x16"]

#: values per block along K
BLOCK = 32
#: layout -> bytes of ``qweight`` per block
FORMATS = {"q4": 16, "q8": 32}
#: the layout with one scale per output channel
CHANNEL_LAYOUT = "w8"
#: every layout
LAYOUTS = (*FORMATS, CHANNEL_LAYOUT)
#: the packed layouts of round_x's matmuls -> (the layout they pack, bytes per group and block)
X16_LAYOUTS = {"q4x16": ("q4", 4 * 64 + 64), "q8x16": ("q8", 8 * 64 + 64)}
#: rows of W per group of a packed layout
X16_GROUP = 16


def check(fmt: str, qweight: torch.Tensor, scales: torch.Tensor) -> None:
    """ValueError unless ``qweight`` and ``scales`` are a weight in layout ``fmt``."""
    if fmt == CHANNEL_LAYOUT:
        if qweight.dim() != 2 or qweight.dtype != torch.int8:
            raise ValueError(f"w8 qweight must be int8 [N, K], got {qweight.dtype} "
                             f"{list(qweight.shape)}")
        if scales.dtype != torch.float32 or tuple(scales.shape) != (qweight.shape[0], 1):
            raise ValueError(f"w8 scales must be float32 [N, 1] = [{qweight.shape[0]}, 1], got "
                             f"{scales.dtype} {list(scales.shape)}")
        return
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized layout {fmt!r} (expected one of {list(LAYOUTS)})")
    dtype = torch.uint8 if fmt == "q4" else torch.int8
    if qweight.dim() != 3 or qweight.shape[2] != FORMATS[fmt] or qweight.dtype != dtype:
        raise ValueError(f"{fmt} qweight must be {dtype} [N, K/32, {FORMATS[fmt]}], got "
                         f"{qweight.dtype} {list(qweight.shape)}")
    if (scales.dtype != torch.float16 or scales.dim() != 3 or scales.shape[2] != 2
            or scales.shape[:2] != qweight.shape[:2]):
        raise ValueError(f"scales must be float16 [N, K/32, 2] matching qweight "
                         f"{list(qweight.shape)}, got {scales.dtype} {list(scales.shape)}")


def integers(fmt: str, qweight: torch.Tensor) -> torch.Tensor:
    """The integers ``q`` of every block, ``[N, K/32, 32]`` (uint8 for q4, int8 for q8)."""
    if fmt == "q8":
        return qweight
    return torch.cat([qweight & 0x0F, qweight >> 4], dim=-1)


def _values(fmt: str, qweight: torch.Tensor) -> torch.Tensor:
    """The integers ``q`` of every block as float32 ``[N, K/32, 32]``."""
    return integers(fmt, qweight).float()


def dequantize(fmt: str, qweight: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """The float32 ``W [N, K]`` of a quantized weight (``fmt``: one of :data:`LAYOUTS`, or of
    :data:`X16_LAYOUTS` with ``scales`` None)."""
    if fmt in X16_LAYOUTS:
        fmt, (qweight, scales) = X16_LAYOUTS[fmt][0], unpack_x16(fmt, qweight)
    check(fmt, qweight, scales)
    if fmt == CHANNEL_LAYOUT:
        return qweight.float() * scales
    s = scales.float()
    w = _values(fmt, qweight) * s[..., :1] + s[..., 1:]
    return w.reshape(qweight.shape[0], -1)


def quantize(fmt: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qweight, scales)`` of a float ``weight [N, K]`` (K a multiple of 32), each block
    rounded to nearest over its own range: q4 spans ``[min, max]`` with 16 levels (``m`` the
    minimum), q8 spans ``[-amax, amax]`` symmetrically (``m = 0``), as GGUF's ``Q4_1`` and
    ``Q8_0`` do. ``w8``: each row symmetrically over its own range, ``scale = max|w| / 127`` in
    float32 (any K)."""
    if fmt == CHANNEL_LAYOUT:
        if weight.dim() != 2:
            raise ValueError(f"can only quantize a 2-D weight, got {list(weight.shape)}")
        w = weight.detach().float()
        scale = w.abs().amax(-1, keepdim=True) / 127
        q = torch.where(scale > 0, w / scale.clamp_min(1e-30), 0).round().clamp(-127, 127)
        return q.to(torch.int8).contiguous(), scale.contiguous()
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized layout {fmt!r} (expected one of {sorted(FORMATS)})")
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise ValueError(f"can only quantize a 2-D weight whose width is a multiple of {BLOCK}, "
                         f"got {list(weight.shape)}")
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    if fmt == "q8":
        d = (w.abs().amax(-1, keepdim=True) / 127).half().float()
        q = torch.where(d > 0, w / d.clamp_min(1e-30), 0).round().clamp(-128, 127)
        scales = torch.cat([d, torch.zeros_like(d)], -1).half()
        return q.to(torch.int8).contiguous(), scales.contiguous()
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    d, m = ((hi - lo) / 15).half().float(), lo.half().float()
    q = torch.where(d > 0, (w - m) / d.clamp_min(1e-30), 0).round().clamp(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return packed.contiguous(), torch.cat([d, m], -1).half().contiguous()


def pack_x16(fmt: str, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A ``q4`` or ``q8`` weight (N a multiple of :data:`X16_GROUP`) in its packed layout
    ``fmt + "x16"`` (see the module docstring)."""
    check(fmt, qweight, scales)
    n, kb, qb = qweight.shape
    if fmt not in FORMATS or n % X16_GROUP:
        raise ValueError(f"only q4 and q8 weights of a multiple of {X16_GROUP} rows pack, got "
                         f"{fmt} with {n} rows")
    g = n // X16_GROUP
    # [group, row c, block, vector i, byte] -> [group, block, vector i, row c, byte]
    ints = qweight.view(torch.uint8).reshape(g, X16_GROUP, kb, qb // 4, 4)
    ints = ints.permute(0, 2, 3, 1, 4).reshape(g, kb, X16_GROUP * qb)
    if fmt == "q8":
        ints = ints ^ 0x80
    halves = scales.reshape(g, X16_GROUP, kb, 2).permute(0, 2, 3, 1).contiguous()
    return torch.cat([ints, halves.view(torch.uint8).reshape(g, kb, 64)], -1).contiguous()


def unpack_x16(layout: str, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qweight, scales)`` of a weight in a packed layout (the inverse of :func:`pack_x16`)."""
    fmt, size = X16_LAYOUTS[layout]
    if packed.dtype != torch.uint8 or packed.dim() != 3 or packed.shape[2] != size:
        raise ValueError(f"{layout} must be uint8 [N/16, K/32, {size}], got {packed.dtype} "
                         f"{list(packed.shape)}")
    g, kb, _ = packed.shape
    qb = FORMATS[fmt]
    ints = packed[..., :X16_GROUP * qb].reshape(g, kb, qb // 4, X16_GROUP, 4)
    ints = ints.permute(0, 3, 1, 2, 4).reshape(g * X16_GROUP, kb, qb)
    if fmt == "q8":
        ints = (ints ^ 0x80).view(torch.int8)
    halves = packed[..., X16_GROUP * qb:].contiguous().view(torch.float16)
    halves = halves.reshape(g, kb, 2, X16_GROUP)
    scales = halves.permute(0, 3, 1, 2).reshape(g * X16_GROUP, kb, 2)
    return ints.contiguous(), scales.contiguous()
