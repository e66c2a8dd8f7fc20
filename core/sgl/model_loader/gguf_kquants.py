"""llama.cpp's K-quant blocks (``Q4_K``, ``Q5_K``, ``Q6_K``) repacked into the layouts of
:mod:`sgl.kernels.quant` (blocks of 32 values, ``W = d q + m`` with float16 ``d`` and ``m``).

A K-quant super-block holds 256 values of a row as 8 sub-blocks of 32 (``Q4_K``, ``Q5_K``) or
16 of 16 (``Q6_K``), each with its own small integer scale under a float16 super-block scale
(llama.cpp's ``ggml/src/ggml-quants.c``, ``dequantize_row_q4_K`` and the others):

* ``Q4_K`` (144 bytes): float16 ``d``, ``dmin``; 12 bytes packing the 6-bit scales ``sc`` and
  mins ``mn`` of the 8 sub-blocks; 128 bytes of nibbles, per 64 values 32 bytes whose low
  nibbles are one sub-block and high nibbles the next. ``W = d sc q - dmin mn``. Becomes
  **q4**, ``|err| <= 2^-11 (15 |d sc| + |dmin mn|)``.
* ``Q5_K`` (176 bytes): as ``Q4_K``, with 32 bytes of 5th bits (bit ``j`` of byte ``i``: value
  ``i`` of sub-block ``j``) before the nibbles; ``q`` in 0..31. Becomes **q8**, ``|err| <=
  2^-11 (31 |d sc| + |dmin mn|)``.
* ``Q6_K`` (210 bytes): 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales ``s`` (one
  per 16 values), float16 ``d``; ``W = d s (q - 32)``. Becomes **q6**, exactly: the same
  integers and scales, ``d`` repeated in each of the super-block's 8 blocks. (Kernels that take
  q4 and q8 only get it rounded to q8, :func:`sgl.kernels.quant.requantize_q6`.)

``Q4_K`` and ``Q5_K`` map sub-block for sub-block: the integers are kept (``Q4_K``'s nibbles
reordered into the q4 byte order, ``Q5_K``'s 5-bit ``q`` as int8) and the block gets ``d' =
fp16(d sc)``, ``m' = fp16(-dmin mn)``. Both products are multiples of 2^-24 (every float16 is,
and ``sc``, ``mn`` are integers), so their float16 rounding is exact below 2^-14 and within half
an ulp, 2^-11 relative, above: that rounding is the only change, hence the bounds above (and no
change at all where ``d sc`` and ``dmin mn`` are float16 numbers, e.g. ``d``, ``dmin`` powers of
two). A product beyond float16's range is a ValueError.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from sgl.kernels.quant import q6_weight

__all__ = ["KQUANT_LAYOUTS", "repack_kquant_blocks"]

#: values per K-quant super-block
QK_K = 256
#: K-quant block type -> the layout of :mod:`sgl.kernels.quant` its blocks become
KQUANT_LAYOUTS = {"Q4_K": "q4", "Q5_K": "q8", "Q6_K": "q6"}
_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def repack_kquant_blocks(type_name: str, data: np.ndarray, rows: int,
                         cols: int) -> tuple[str, torch.Tensor, torch.Tensor]:
    """``(layout, qweight, scales)`` of a GGUF tensor of K-quant type ``type_name`` (a key of
    :data:`KQUANT_LAYOUTS`) with ``rows`` x ``cols`` values, from its raw bytes ``data``."""
    layout = KQUANT_LAYOUTS.get(type_name)
    if layout is None:
        raise ValueError(f"{type_name} is not a K-quant sgl repacks "
                         f"(those it does: {', '.join(KQUANT_LAYOUTS)})")
    if cols % QK_K:
        raise ValueError(f"a {type_name} tensor's rows must hold whole {QK_K}-value "
                         f"super-blocks, got {cols} values")
    raw = np.ascontiguousarray(data).view(np.uint8)
    size = rows * (cols // QK_K) * _BLOCK_BYTES[type_name]
    if raw.size != size:
        raise ValueError(f"a {rows} x {cols} {type_name} tensor takes {size} bytes, got "
                         f"{raw.size}")
    blocks = raw.reshape(rows, cols // QK_K, _BLOCK_BYTES[type_name])
    qweight, scales = _REPACK[type_name](blocks)
    return layout, torch.from_numpy(qweight), torch.from_numpy(scales)


def _float16(x: np.ndarray, what: str) -> np.ndarray:
    """``x`` (float32) rounded to float16; a ValueError where a finite value overflows."""
    with np.errstate(over="ignore"):
        h = x.astype(np.float16)
    if np.isinf(h).any() and not np.array_equal(np.isinf(h), np.isinf(x)):
        raise ValueError(f"a K-quant block's {what} overflows float16 "
                         f"(largest: {np.abs(x[np.isfinite(x)]).max():g})")
    return h


def _halves(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of each super-block, as float32 ``[rows, blocks, 1]``."""
    return blocks[..., at:at + 2].copy().view(np.float16).astype(np.float32)


def _scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit scales and mins of the 8 sub-blocks from a super-block's 12 bytes
    (llama.cpp's ``get_scale_min_k4``): bytes 0-3 hold scales 0-3 in their low 6 bits, 4-7
    mins 0-3; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high
    nibble), whose top 2 bits are the top 2 bits of bytes 0-3 (scales) and 4-7 (mins)."""
    lo, hi, mix = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([lo & 63, (mix & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    mins = np.concatenate([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], axis=-1)
    return scales, mins


def _sub_block_scales(blocks: np.ndarray) -> np.ndarray:
    """``(fp16(d sc), fp16(-dmin mn))`` of every sub-block of ``Q4_K``/``Q5_K`` super-blocks:
    float16 ``[rows, blocks * 8, 2]``."""
    rows, n = blocks.shape[:2]
    sc, mn = _scales_and_mins(blocks[..., 4:16])
    d = _float16(_halves(blocks, 0) * sc, "scale d * sc")  # exact float32 products
    m = _float16(-_halves(blocks, 2) * mn, "offset dmin * min")
    return np.stack([d, m], axis=-1).reshape(rows, n * 8, 2)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """The 4-bit values of ``qs`` (``[rows, blocks, 128]``) as uint8 ``[rows, blocks * 8,
    32]``: each 32 bytes hold one sub-block in their low nibbles and the next in their high."""
    rows, n = qs.shape[:2]
    qs = qs.reshape(rows, n, 4, 1, 32)
    return np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(rows, n * 8, 32)


def _repack_q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    q = _nibbles(blocks[..., 16:144])
    packed = q[..., :16] | (q[..., 16:] << 4)  # sgl's q4 byte j: values j and j + 16
    return np.ascontiguousarray(packed), _sub_block_scales(blocks)


def _repack_q5_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rows, n = blocks.shape[:2]
    qh = blocks[..., 16:48].reshape(rows, n, 1, 32)  # bit j of byte i: value i of sub-block j
    fifth = (qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
    q = _nibbles(blocks[..., 48:176]) | (fifth.reshape(rows, n * 8, 32) << 4)
    return np.ascontiguousarray(q.view(np.int8)), _sub_block_scales(blocks)


def _q6_k_values(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(q, s, d)`` of every 32-value block: the 6-bit ``q`` (0..63) as uint8 ``[rows, blocks
    * 8, 32]``, the two int8 scales of its halves ``[rows, blocks * 8, 2]`` and the super-block
    scale ``d`` as float16 ``[rows, blocks * 8, 1]``."""
    rows, n = blocks.shape[:2]
    ql = blocks[..., 0:128].reshape(rows, n, 2, 1, 64)  # per 128 values: 64 bytes
    qh = blocks[..., 128:192].reshape(rows, n, 2, 1, 32)  # per 128 values: 32 bytes
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=3).reshape(rows, n, 2, 128)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 3
    q = low | (high.reshape(rows, n, 2, 128) << 4)
    s = blocks[..., 192:208].view(np.int8).reshape(rows, n * 8, 2)  # one per 16 values
    d = np.repeat(blocks[..., 208:210].copy().view(np.float16), 8, axis=1)
    return q.reshape(rows, n * 8, 32), s, d.reshape(rows, n * 8, 1)


def _repack_q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    q, s, d = _q6_k_values(blocks)
    qweight = q6_weight(torch.from_numpy(np.ascontiguousarray(q)),
                        torch.from_numpy(np.ascontiguousarray(s)))
    scales = np.concatenate([d, np.zeros_like(d)], axis=-1)
    return qweight.numpy(), np.ascontiguousarray(scales)


_REPACK: dict[str, Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]] = {
    "Q4_K": _repack_q4_k, "Q5_K": _repack_q5_k, "Q6_K": _repack_q6_k}
