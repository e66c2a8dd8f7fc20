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
* **q6**: GGUF's ``Q6_K`` as it is, per block of 32: ``qweight`` uint8 ``[N, K/32, 26]``, the
  low 4 bits of ``q`` (0..63) in q4's byte order (bytes 0-15), the high 2 bits (byte ``16 +
  j``, bits ``2t, 2t + 1``: value ``j + 8t``), then two int8 scales ``s0`` (values 0-15) and
  ``s1`` (16-31); ``m = 0`` and ``W = d * s * (q - 32)`` with the half's ``s``. Only GGUF
  files make it (:mod:`sgl.model_loader.gguf_kquants`); :func:`requantize_q6` rounds it to q8.

``scales`` is float16 ``[N, K/32, 2]``: ``(d, m)`` of each block. The layouts keep a row's
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
* **q6x16**: the same for q6, ``B`` = 448: the low 4 bits as q4x16's 4 vectors, then 2 vectors
  of high bits (lane ``c`` of vector ``p``, byte ``b``, bits ``2t, 2t + 1``: the high bits of
  value ``16p + 4t + b`` of row ``c``), the 16 rows' ``s0``, their ``s1`` (int8), then their
  ``d`` as float16 (the matmul works out ``sum x (q - 32)`` per half from x's own sums).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["BLOCK", "CHANNEL_LAYOUT", "FORMATS", "LAYOUTS", "X16_GROUP", "X16_LAYOUTS", "check",
           "dequantize", "integers", "pack_x16", "q6_integers", "q6_weight", "quantize",
           "requantize_q6", "unpack_x16"]

#: values per block along K
BLOCK = 32
#: layout -> bytes of ``qweight`` per block
FORMATS = {"q4": 16, "q8": 32, "q6": 26}
#: the layout with one scale per output channel
CHANNEL_LAYOUT = "w8"
#: every layout
LAYOUTS = (*FORMATS, CHANNEL_LAYOUT)
#: the packed layouts of round_x's matmuls -> (the layout they pack, bytes per group and block)
X16_LAYOUTS = {"q4x16": ("q4", 4 * 64 + 64), "q8x16": ("q8", 8 * 64 + 64),
               "q6x16": ("q6", 6 * 64 + 64)}
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
    dtype = torch.int8 if fmt == "q8" else torch.uint8
    if qweight.dim() != 3 or qweight.shape[2] != FORMATS[fmt] or qweight.dtype != dtype:
        raise ValueError(f"{fmt} qweight must be {dtype} [N, K/32, {FORMATS[fmt]}], got "
                         f"{qweight.dtype} {list(qweight.shape)}")
    if (scales.dtype != torch.float16 or scales.dim() != 3 or scales.shape[2] != 2
            or scales.shape[:2] != qweight.shape[:2]):
        raise ValueError(f"scales must be float16 [N, K/32, 2] matching qweight "
                         f"{list(qweight.shape)}, got {scales.dtype} {list(scales.shape)}")


def integers(fmt: str, qweight: torch.Tensor) -> torch.Tensor:
    """The integers ``q`` of every block, ``[N, K/32, 32]`` (uint8 for q4, int8 for q8; for q6
    the signed ``s (q - 32)`` as int32, :func:`q6_integers`)."""
    if fmt == "q8":
        return qweight
    if fmt == "q6":
        return q6_integers(qweight)
    return torch.cat([qweight & 0x0F, qweight >> 4], dim=-1)


def _pairs(raw: torch.Tensor) -> torch.Tensor:
    """The four 2-bit fields of each byte of ``raw [...]`` as ``[..., 4]`` (field ``t``: bits
    ``2t, 2t + 1``)."""
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=raw.device)
    return (raw[..., None] >> shifts) & 3


def _pack_pairs(fields: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_pairs`: ``[..., 4]`` 2-bit fields as bytes ``[...]``."""
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=fields.device)
    return (fields << shifts).sum(-1, dtype=torch.uint8)


def _q6_highs(qweight: torch.Tensor) -> torch.Tensor:
    """The high 2 bits of every value of a q6 weight, in value order ``[N, K/32, 32]``."""
    return _pairs(qweight[..., 16:24]).transpose(-1, -2).reshape(*qweight.shape[:2], 32)


def _q6_high_bytes(highs: torch.Tensor) -> torch.Tensor:
    """q6's 8 bytes of high bits (byte ``j``, bits ``2t``: value ``j + 8t``) from ``[..., 32]``
    in value order."""
    return _pack_pairs(highs.reshape(*highs.shape[:-1], 4, 8).transpose(-1, -2))


def q6_weight(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The ``qweight`` of a q6 weight from its values ``q`` (0..63, uint8 ``[N, K/32, 32]``)
    and the int8 scales of each block's halves ``s [N, K/32, 2]``."""
    low = (q[..., :16] & 0x0F) | ((q[..., 16:] & 0x0F) << 4)  # q4's byte order
    return torch.cat([low, _q6_high_bytes(q >> 4), s.view(torch.uint8)], -1).contiguous()


def q6_integers(qweight: torch.Tensor) -> torch.Tensor:
    """``s (q - 32)`` of every value of a q6 weight, int32 ``[N, K/32, 32]`` (at most 4096 in
    magnitude: ``W = d`` times it)."""
    low = torch.cat([qweight[..., :16] & 0x0F, qweight[..., :16] >> 4], dim=-1)
    q = (low | (_q6_highs(qweight) << 4)).to(torch.int32) - 32
    s = qweight[..., 24:26].view(torch.int8).to(torch.int32)
    return q * s.repeat_interleave(16, dim=-1)


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
    if fmt == "q6":
        raise ValueError("q6 holds GGUF Q6_K blocks as they are; sgl does not round weights to it "
                         "(quantize to q4 or q8)")
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


def requantize_q6(qweight: torch.Tensor, scales: torch.Tensor,
                  rows_per_step: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A q6 weight as q8 ``(qweight, scales)``, for the kernels that take q4 and q8 only.

    A q6 block's integers ``n = s (q - 32)`` span up to +-4096: a single ``(d', m = 0)`` holds
    them exactly only when ``n / c`` fits int8 for a ``c`` with ``d c`` a float16 number. Each
    block takes the first of these whose ``q' = n / c`` fits int8: ``c = gcd(n)`` with ``d c``
    a float16 number (exact); ``c`` the power of two in ``gcd(n)`` (exact); ``c = gcd(n)`` with
    ``d' = fp16(d c)`` rounded (``|err| <= 2^-11 max|W|``; e.g. both halves with the same
    scale). Otherwise the block's 32 values are requantized as :func:`quantize` does for q8:
    ``d' = fp16(max|W| / 127)``, ``q' = round(W / d')``, ``|err| <= d' / 2 <= (1 + 2^-10)
    max|W| / 254``, at most an eighth of the block's coarser step ``d |s|`` (``max|W| <= 32 d
    |s|``). Real files mostly take this last way. ``rows_per_step`` bounds the temporaries
    (default: about 4M values at a time)."""
    check("q6", qweight, scales)
    if rows_per_step is None:
        rows_per_step = max(1, (1 << 22) // max(1, qweight.shape[1] * BLOCK))
    q8 = torch.empty(qweight.shape[:2] + (32,), dtype=torch.int8)
    s8 = torch.zeros(scales.shape, dtype=torch.float16)
    for start in range(0, qweight.shape[0], rows_per_step):
        part = slice(start, start + rows_per_step)
        q8[part], s8[part, :, 0] = _requantize_q6_rows(qweight[part], scales[part])
    return q8, s8


def _requantize_q6_rows(qweight: torch.Tensor,
                        scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ints = q6_integers(qweight).numpy()
    d = scales[..., :1].float().numpy()
    g = np.maximum(np.gcd.reduce(ints, axis=-1, keepdims=True), 1)  # gcd(0, ...) = 0
    two = g & -g  # the power of two in g

    def candidate(c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        q = ints // c  # exact: c divides every integer of its block
        fits = ((q >= -128) & (q <= 127)).all(axis=-1, keepdims=True)
        dc = d * c  # exact in float32: 11 bits times at most 12
        with np.errstate(over="ignore"):
            h = dc.astype(np.float16)
        return q, h, fits & (h.astype(np.float32) == dc), fits & np.isfinite(h)

    q_g, d_g, exact_g, rounded_g = candidate(g)
    q_two, d_two, exact_two, _ = candidate(two)
    weight = torch.from_numpy((d * ints).reshape(ints.shape[0], -1))  # exact in float32
    q_re, s_re = quantize("q8", weight)
    d_re = s_re[..., :1].numpy()
    if not np.isfinite(d_re).all():
        raise ValueError("a q6 block's requantized scale overflows float16")
    use_g = exact_g | (~exact_two & rounded_g)
    q = np.where(use_g, q_g, np.where(exact_two, q_two, q_re.numpy()))
    scale = np.where(use_g, d_g, np.where(exact_two, d_two, d_re))
    return torch.from_numpy(q.astype(np.int8)), torch.from_numpy(scale[..., 0])


def _lanes(ints: torch.Tensor, g: int, kb: int) -> torch.Tensor:
    """``[N, K/32, bytes]`` per row -> ``[N/16, K/32, 16 * bytes]``: vector after vector of 4
    bytes of each of the group's 16 rows (vpdpbusd's lanes)."""
    qb = ints.shape[-1]
    ints = ints.reshape(g, X16_GROUP, kb, qb // 4, 4)
    return ints.permute(0, 2, 3, 1, 4).reshape(g, kb, X16_GROUP * qb)


def _rows(lanes: torch.Tensor, qb: int) -> torch.Tensor:
    """The inverse of :func:`_lanes`."""
    g, kb, _ = lanes.shape
    ints = lanes.reshape(g, kb, qb // 4, X16_GROUP, 4)
    return ints.permute(0, 3, 1, 2, 4).reshape(g * X16_GROUP, kb, qb)


def pack_x16(fmt: str, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A ``q4``, ``q8`` or ``q6`` weight (N a multiple of :data:`X16_GROUP`) in its packed layout
    ``fmt + "x16"`` (see the module docstring)."""
    check(fmt, qweight, scales)
    n, kb, qb = qweight.shape
    if fmt not in FORMATS or n % X16_GROUP:
        raise ValueError(f"only q4, q8 and q6 weights of a multiple of {X16_GROUP} rows pack, "
                         f"got {fmt} with {n} rows")
    g = n // X16_GROUP
    if fmt == "q6":
        # byte 4p + b, bits 2t: value 16p + 4t + b (so that vector 4p + t's byte b finds its
        # bits at 2t of the high vector p)
        high = _q6_highs(qweight).reshape(n, kb, 2, 4, 4).permute(0, 1, 2, 4, 3)  # [p, b, t]
        high = _pack_pairs(high).reshape(n, kb, 8)
        s = qweight[..., 24:26].reshape(g, X16_GROUP, kb, 2).permute(0, 2, 3, 1)
        d = scales[..., 0].reshape(g, X16_GROUP, kb).permute(0, 2, 1).contiguous()
        return torch.cat([_lanes(qweight[..., :16], g, kb), _lanes(high, g, kb),
                          s.reshape(g, kb, 32), d.view(torch.uint8).reshape(g, kb, 32)],
                         -1).contiguous()
    ints = _lanes(qweight.view(torch.uint8), g, kb)
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
    n = g * X16_GROUP
    if fmt == "q6":
        low = _rows(packed[..., :256], 16)
        high = _rows(packed[..., 256:384], 8)  # byte 4p + b, bits 2t: value 16p + 4t + b
        bits = _pairs(high).reshape(n, kb, 2, 4, 4)  # [.., p, b, t]
        raw = _q6_high_bytes(bits.permute(0, 1, 2, 4, 3).reshape(n, kb, 32))
        s = packed[..., 384:416].reshape(g, kb, 2, X16_GROUP).permute(0, 3, 1, 2)
        d = packed[..., 416:448].contiguous().view(torch.float16).reshape(g, kb, X16_GROUP)
        d = d.permute(0, 2, 1).reshape(n, kb, 1)
        qweight = torch.cat([low, raw, s.reshape(n, kb, 2)], -1)
        return qweight.contiguous(), torch.cat([d, torch.zeros_like(d)], -1).contiguous()
    qb = FORMATS[fmt]
    ints = _rows(packed[..., :X16_GROUP * qb], qb)
    if fmt == "q8":
        ints = (ints ^ 0x80).view(torch.int8)
    halves = packed[..., X16_GROUP * qb:].contiguous().view(torch.float16)
    halves = halves.reshape(g, kb, 2, X16_GROUP)
    scales = halves.permute(0, 3, 1, 2).reshape(n, kb, 2)
    return ints.contiguous(), scales.contiguous()
